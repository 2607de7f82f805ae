//! Hash maps for the per-message books (transfer ids, tickets, request tokens, instance ids): a
//! seeded folded-multiply hash over `u64` words instead of SipHash, which cost about as much as the
//! rest of a 64 KiB message's bookkeeping. Owns only hashing; never used for anything secret.
//!
//! Each map gets its own random seed (from std's `RandomState`), so keys a peer chooses (its transfer
//! ids, in the receiver's records) cannot be picked in advance to collide.

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasher, Hasher};

/// A `HashMap` with [`FastHashBuilder`].
pub type FastMap<K, V> = HashMap<K, V, FastHashBuilder>;
/// A `HashSet` with [`FastHashBuilder`].
pub type FastSet<K> = HashSet<K, FastHashBuilder>;

const MULTIPLIER: u64 = 0x9e37_79b9_7f4a_7c15;

/// Builds [`FastHasher`]s sharing one random seed.
#[derive(Clone, Debug)]
pub struct FastHashBuilder {
    seed: u64,
}

impl Default for FastHashBuilder {
    fn default() -> Self {
        FastHashBuilder { seed: RandomState::new().hash_one(0x6b76_6761_7465_u64) | 1 }
    }
}

impl BuildHasher for FastHashBuilder {
    type Hasher = FastHasher;
    fn build_hasher(&self) -> FastHasher {
        FastHasher { state: self.seed }
    }
}

/// Folds each `u64` word into the state with a 64×64→128-bit multiply (high and low halves xored).
pub struct FastHasher {
    state: u64,
}

fn fold(a: u64, b: u64) -> u64 {
    let wide = (a as u128).wrapping_mul(b as u128);
    (wide as u64) ^ ((wide >> 64) as u64)
}

impl Hasher for FastHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            self.write_u64(u64::from_le_bytes(chunk.try_into().expect("8 bytes")));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut last = [0u8; 8];
            last[..rest.len()].copy_from_slice(rest);
            self.write_u64(u64::from_le_bytes(last) ^ ((rest.len() as u64) << 56));
        }
    }

    fn write_u64(&mut self, word: u64) {
        self.state = fold(self.state ^ word, MULTIPLIER);
    }

    fn write_u32(&mut self, word: u32) {
        self.write_u64(word as u64);
    }

    fn write_usize(&mut self, word: usize) {
        self.write_u64(word as u64);
    }

    fn finish(&self) -> u64 {
        fold(self.state, MULTIPLIER ^ 0xa076_1d64_78bd_642f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequential_keys_spread_over_buckets_and_maps_behave() {
        let builder = FastHashBuilder::default();
        // The low 10 bits pick one of 1024 buckets: sequential ids must not pile up.
        let mut buckets = vec![0u32; 1024];
        for key in 0..1_048_576u64 {
            buckets[(builder.hash_one(key) & 1023) as usize] += 1;
        }
        let (min, max) = (buckets.iter().min().unwrap(), buckets.iter().max().unwrap());
        assert!(*min > 824 && *max < 1224, "bucket load {min}..{max} (1024 expected)");
        let mut map: FastMap<(u64, u64), u64> = FastMap::default();
        for i in 0..10_000u64 {
            map.insert((i >> 3, i), i);
        }
        assert_eq!(map.len(), 10_000);
        assert!((0..10_000u64).all(|i| map.get(&(i >> 3, i)) == Some(&i)));
        assert_eq!(map.remove(&(1, 8)), Some(8));
        assert_eq!(map.get(&(1, 8)), None);
    }

    #[test]
    fn maps_get_different_seeds_and_bytes_hash_by_content() {
        let (a, b) = (FastHashBuilder::default(), FastHashBuilder::default());
        assert_ne!(a.hash_one(42u64), b.hash_one(42u64));
        assert_eq!(a.hash_one("kvgate"), a.hash_one("kvgate"));
        assert_ne!(a.hash_one("kvgate"), a.hash_one("kvgatf"));
        assert_ne!(a.hash_one([1u8, 0]), a.hash_one([1u8]));
    }
}
