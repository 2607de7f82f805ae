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
    /// Where a chunk's bytes start in its part's byte stream (the part's slices concatenated): every
    /// earlier chunk's tokens, for every layer's K and V. The `offset` of a placed `Send`.
    pub fn chunk_stream_offset(&self, chunk: u64) -> u64 {
        self.layers * 2 * self.chunk_tokens(chunk).0 * self.token_bytes()
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
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .with_context(|| format!("create {}", path.display()))?;
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
    /// Fill a slot with bytes derived from `seed`; returns their checksum. Four independent xorshift
    /// streams, one per word of every 32 bytes: one serial stream cost ~50 ms of a core per 64 MiB
    /// room, work that competed with the transfers the demo shows (docs/bench-findings.md, "The
    /// demo's table").
    pub fn fill(&mut self, slot: u64, seed: u64) -> u64 {
        let mut x = [0u64; LANES];
        for (lane, v) in x.iter_mut().enumerate() {
            *v = seed.wrapping_add(lane as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        }
        let bytes = self.slot_mut(slot);
        let mut groups = bytes.chunks_exact_mut(8 * LANES);
        for group in &mut groups {
            for (lane, word) in group.chunks_exact_mut(8).enumerate() {
                let v = &mut x[lane];
                *v ^= *v << 13;
                *v ^= *v >> 7;
                *v ^= *v << 17;
                word.copy_from_slice(&v.to_le_bytes());
            }
        }
        for (i, b) in groups.into_remainder().iter_mut().enumerate() {
            *b = (x[0] >> (8 * (i % 8))) as u8 ^ i as u8;
        }
        checksum(self.slot(slot))
    }
    /// Zero a slot (so a transfer that did not happen cannot pass the checksum).
    pub fn clear(&mut self, slot: u64) {
        self.slot_mut(slot).fill(0);
    }
}

/// Independent streams of [`KvPool::fill`] and [`checksum`] (a serial chain runs at one word per
/// multiply latency; four chains keep a core's multipliers busy).
const LANES: usize = 4;

/// A 64-bit checksum of `bytes` (order-sensitive; fast enough for gigabytes): four chains over the
/// words of every 32 bytes, folded together with the length, then the tail.
pub fn checksum(bytes: &[u8]) -> u64 {
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut h = [0xcbf2_9ce4_8422_2325u64, 0x8422_2325_cbf2_9ce4, 0x9E37_79B9_7F4A_7C15, 0x7F4A_7C15_9E37_79B9];
    let mut groups = bytes.chunks_exact(8 * LANES);
    for group in &mut groups {
        for (lane, word) in group.chunks_exact(8).enumerate() {
            let w = u64::from_le_bytes(word.try_into().expect("8 bytes"));
            h[lane] = (h[lane].rotate_left(5) ^ w).wrapping_mul(PRIME);
        }
    }
    let mut out = (bytes.len() as u64).wrapping_mul(PRIME);
    for lane in h {
        out = (out.rotate_left(5) ^ lane).wrapping_mul(PRIME);
    }
    for b in groups.remainder() {
        out = (out ^ *b as u64).wrapping_mul(PRIME);
    }
    out
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
    fn a_chunks_stream_offset_is_the_bytes_of_the_chunks_before_it() {
        for (tokens, chunks) in [(13, 4), (512, 4), (7, 7), (9, 1)] {
            let shape = KvShape::llama_8b_like(tokens, chunks);
            let mut at = 0;
            for chunk in 0..chunks {
                assert_eq!(shape.chunk_stream_offset(chunk), at, "{tokens} tokens, chunk {chunk} of {chunks}");
                at += shape.chunk_slices(1, 0, 0, chunk).iter().map(|s| s.len).sum::<u64>();
            }
            assert_eq!(at, shape.part_bytes(), "the chunks cover the part");
        }
    }

    #[test]
    fn checksum_sees_a_single_changed_byte() {
        let mut a = vec![7u8; 4096];
        let before = checksum(&a);
        a[4000] ^= 1;
        assert_ne!(before, checksum(&a));
        // Anywhere: in every lane, and in a tail shorter than a group.
        let base: Vec<u8> = (0..4099u32).map(|i| (i * 7 % 256) as u8).collect();
        let sum = checksum(&base);
        for at in [0, 8, 16, 24, 31, 4095, 4096, 4098] {
            let mut b = base.clone();
            b[at] ^= 0x80;
            assert_ne!(sum, checksum(&b), "byte {at}");
        }
        // Order-sensitive: two words of one lane swapped, and two words of different lanes.
        for (i, j) in [(0, 32), (0, 8)] {
            let mut b = base.clone();
            let (x, y) = (b[i..i + 8].to_vec(), b[j..j + 8].to_vec());
            b[i..i + 8].copy_from_slice(&y);
            b[j..j + 8].copy_from_slice(&x);
            assert_ne!(sum, checksum(&b), "words at {i} and {j} swapped");
        }
    }

    #[test]
    fn a_fill_is_its_seeds_and_its_checksum_is_returned() {
        let dir = tempfile::tempdir().unwrap();
        let mut pool = KvPool::create(dir.path(), "p", 4099, 2).unwrap();
        let (a, b) = (pool.fill(0, 1), pool.fill(1, 2));
        assert_ne!(a, b, "another seed, other bytes");
        assert_eq!(a, checksum(pool.slot(0)));
        assert_ne!(pool.slot(0)[..64], pool.slot(1)[..64]);
        assert!(pool.slot(0).iter().filter(|&&x| x == 0).count() < 100, "no page of zeros passes for KV");
        assert_eq!(pool.fill(0, 1), a, "the same seed, the same bytes");
    }
}
