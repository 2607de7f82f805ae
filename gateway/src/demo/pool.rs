//! Synthetic KV pools: a shared-memory file split into slots, one slot per in-flight request, laid
//! out as a real paged KV cache (`[part][layer][K|V][token][heads_per_part x head_dim x bf16]`), with
//! the scatter-gather slices of each chunk, a seeded fill and a checksum. Never talks to a gateway.

use anyhow::Context;
use kvgate_client::{slice, Slice};
use std::path::{Path, PathBuf};

/// The shape of one request's KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvShape {
    pub layers: u64,
    pub heads: u64,
    pub head_dim: u64,
    pub dtype_bytes: u64,
    pub tokens: u64,
    /// Tensor-parallel ranks: each part carries `heads / parts` heads.
    pub parts: u64,
    /// Chunked prefill: each part's tokens are sent in this many chunks.
    pub chunks: u64,
}

impl KvShape {
    /// 32 layers x K,V x 8 heads x 128 dims x bf16: 128 KiB per token.
    pub fn llama_8b_like(tokens: u64, chunks: u64) -> KvShape {
        KvShape { layers: 32, heads: 8, head_dim: 128, dtype_bytes: 2, tokens, parts: 2, chunks }
    }
    /// Bytes of one token of one layer's K (or V) in one part.
    pub fn token_bytes(&self) -> u64 {
        self.heads / self.parts * self.head_dim * self.dtype_bytes
    }
    pub fn part_bytes(&self) -> u64 {
        self.layers * 2 * self.tokens * self.token_bytes()
    }
    pub fn request_bytes(&self) -> u64 {
        self.parts * self.part_bytes()
    }
    /// Token range `[start, end)` of a chunk (the last chunk takes the remainder).
    pub fn chunk_tokens(&self, chunk: u64) -> (u64, u64) {
        let per = self.tokens / self.chunks;
        let start = chunk * per;
        let end = if chunk + 1 == self.chunks { self.tokens } else { start + per };
        (start, end)
    }
    /// Offset inside a slot of (part, layer, kv, token).
    fn offset(&self, part: u64, layer: u64, kv: u64, token: u64) -> u64 {
        ((part * self.layers + layer) * 2 + kv) * self.tokens * self.token_bytes() + token * self.token_bytes()
    }
    /// The slices (in `region`, slot at `slot_offset`) of one chunk of one part, in stream order:
    /// every layer's K then V for the chunk's tokens.
    pub fn chunk_slices(&self, region: u64, slot_offset: u64, part: u64, chunk: u64) -> Vec<Slice> {
        let (start, end) = self.chunk_tokens(chunk);
        let len = (end - start) * self.token_bytes();
        let mut out = Vec::with_capacity(self.layers as usize * 2);
        for layer in 0..self.layers {
            for kv in 0..2 {
                out.push(slice(region, slot_offset + self.offset(part, layer, kv, start), len));
            }
        }
        out
    }
    /// A part's whole destination: its chunks' slices concatenated (the order the sender fills).
    pub fn part_slices(&self, region: u64, slot_offset: u64, part: u64) -> Vec<Slice> {
        (0..self.chunks).flat_map(|c| self.chunk_slices(region, slot_offset, part, c)).collect()
    }
}

/// A pool file mapped in this (engine) process.
pub struct KvPool {
    pub path: PathBuf,
    pub slot_bytes: u64,
    pub slots: u64,
    map: memmap2::MmapMut,
}

impl KvPool {
    /// Create `dir/name` with `slots` slots of `slot_bytes` each.
    pub fn create(dir: &Path, name: &str, slot_bytes: u64, slots: u64) -> anyhow::Result<KvPool> {
        let path = dir.join(name);
        let file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).with_context(|| format!("create {}", path.display()))?;
        file.set_len(slot_bytes * slots)?;
        // SAFETY: the file was just created by this process; the gateway maps it too, and writes only
        // into slots this engine lent it through expect.
        let map = unsafe { memmap2::MmapOptions::new().len((slot_bytes * slots) as usize).map_mut(&file)? };
        Ok(KvPool { path, slot_bytes, slots, map })
    }
    pub fn len(&self) -> u64 {
        self.slot_bytes * self.slots
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn slot_offset(&self, slot: u64) -> u64 {
        slot * self.slot_bytes
    }
    fn slot_mut(&mut self, slot: u64) -> &mut [u8] {
        let start = self.slot_offset(slot) as usize;
        &mut self.map[start..start + self.slot_bytes as usize]
    }
    pub fn slot(&self, slot: u64) -> &[u8] {
        let start = self.slot_offset(slot) as usize;
        &self.map[start..start + self.slot_bytes as usize]
    }
    /// Fill a slot with bytes derived from `seed`; returns their checksum.
    pub fn fill(&mut self, slot: u64, seed: u64) -> u64 {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        for word in self.slot_mut(slot).chunks_exact_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            word.copy_from_slice(&x.to_le_bytes());
        }
        checksum(self.slot(slot))
    }
    /// Zero a slot (so a transfer that did not happen cannot pass the checksum).
    pub fn clear(&mut self, slot: u64) {
        self.slot_mut(slot).fill(0);
    }
}

/// A 64-bit checksum of `bytes` (order-sensitive; fast enough for gigabytes).
pub fn checksum(bytes: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for word in bytes.chunks_exact(8) {
        let w = u64::from_le_bytes(word.try_into().expect("8 bytes"));
        h = (h.rotate_left(5) ^ w).wrapping_mul(0x0000_0100_0000_01b3);
    }
    for b in bytes.chunks_exact(8).remainder() {
        h = (h ^ *b as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_every_byte_of_a_part_exactly_once() {
        let shape = KvShape { tokens: 13, chunks: 4, ..KvShape::llama_8b_like(13, 4) };
        let mut covered = vec![0u8; shape.request_bytes() as usize];
        for part in 0..shape.parts {
            for s in shape.part_slices(1, 0, part) {
                for b in &mut covered[s.offset as usize..(s.offset + s.len) as usize] {
                    *b += 1;
                }
            }
        }
        assert!(covered.iter().all(|&c| c == 1));
        assert_eq!(shape.token_bytes(), 1024);
        assert_eq!(KvShape::llama_8b_like(1, 1).request_bytes(), 128 * 1024);
    }

    #[test]
    fn checksum_sees_a_single_changed_byte() {
        let mut a = vec![7u8; 4096];
        let before = checksum(&a);
        a[4000] ^= 1;
        assert_ne!(before, checksum(&a));
    }
}
