//! Hash maps for the per-message books (transfer ids, tickets, request tokens, instance ids): foldhash
//! (hashbrown's default hasher, a folded multiply) instead of SipHash, which cost about as much as the
//! rest of a 64 KiB message's bookkeeping. Owns only the choice of hasher; never used for anything secret.
//!
//! Each map gets its own random seed, so keys a peer chooses (its transfer ids, in the receiver's
//! records) cannot be picked in advance to collide. The `quality` variant, as kvgate-core's
//! peer-keyed maps use: hashbrown takes a key's bucket from the hash's low bits, and foldhash's `fast`
//! variant leaves those poorly mixed for sequential ids under about one process seed in twelve (in
//! 20 000 seeds, 262 144 sequential ids into 1 024 buckets: 8 % of seeds gave some bucket under half
//! or over 1.5× its share, the worst 0 and 10×). `quality` adds one folded multiply per hash and
//! stayed within 0.68–1.36× of the share for every one of those seeds.

use std::collections::{HashMap, HashSet};

/// Builds the hashers of one map: `Default` draws that map's own random seed (with the process's
/// random shared seed); tests can fix both with `with_seed`.
pub type FastHashBuilder = foldhash::quality::SeedableRandomState;
/// A `HashMap` with [`FastHashBuilder`].
pub type FastMap<K, V> = HashMap<K, V, FastHashBuilder>;
/// A `HashSet` with [`FastHashBuilder`].
pub type FastSet<K> = HashSet<K, FastHashBuilder>;

#[cfg(test)]
mod tests {
    use super::*;
    use foldhash::SharedSeed;
    use std::hash::BuildHasher;

    /// Seeds from a fixed xorshift, so a failure names a seed and reproduces. With foldhash's
    /// `fast` variant the second of these seeds already piles sequential ids up.
    fn fixed_builders(count: usize) -> Vec<(u64, FastHashBuilder)> {
        let mut x = 0x1234_5678_9abc_def1u64;
        (0..count)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let shared: &'static SharedSeed = Box::leak(Box::new(SharedSeed::from_u64(x)));
                (x, FastHashBuilder::with_seed(x.rotate_left(17), shared))
            })
            .collect()
    }

    /// Least and most keys any of 1 024 buckets (a hash's low 10 bits) gets.
    fn bucket_load(builder: &FastHashBuilder, keys: impl Iterator<Item = u64>) -> (u32, u32) {
        let mut buckets = vec![0u32; 1024];
        for key in keys {
            buckets[(builder.hash_one(key) & 1023) as usize] += 1;
        }
        (*buckets.iter().min().unwrap(), *buckets.iter().max().unwrap())
    }

    #[test]
    fn sequential_and_high_bit_ids_spread_over_buckets_for_every_seed() {
        const KEYS: u64 = 262_144; // 256 a bucket
        for (seed, builder) in fixed_builders(64) {
            for (pattern, shift) in [("sequential", 0u32), ("i << 20", 20)] {
                let (min, max) = bucket_load(&builder, (0..KEYS).map(|i| i << shift));
                assert!(
                    min > 128 && max < 384,
                    "{pattern} ids under seed {seed:#x}: bucket load {min}..{max} (256 expected)"
                );
            }
        }
    }

    #[test]
    fn maps_behave_and_default_builders_differ() {
        let mut map: FastMap<(u64, u64), u64> = FastMap::default();
        for i in 0..10_000u64 {
            map.insert((i >> 3, i), i);
        }
        assert_eq!(map.len(), 10_000);
        assert!((0..10_000u64).all(|i| map.get(&(i >> 3, i)) == Some(&i)));
        assert_eq!(map.remove(&(1, 8)), Some(8));
        assert_eq!(map.get(&(1, 8)), None);
        let (a, b) = (FastHashBuilder::default(), FastHashBuilder::default());
        assert_ne!(a.hash_one(42u64), b.hash_one(42u64));
        assert_eq!(a.hash_one("kvgate"), a.hash_one("kvgate"));
        assert_ne!(a.hash_one("kvgate"), a.hash_one("kvgatf"));
        assert_ne!(a.hash_one([1u8, 0]), a.hash_one([1u8]));
    }
}
