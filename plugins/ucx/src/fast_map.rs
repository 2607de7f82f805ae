//! Hash maps for the per-message books (transfer ids, tickets, request tokens, instance ids): foldhash
//! (hashbrown's default hasher, a folded multiply) instead of SipHash, which cost about as much as the
//! rest of a 64 KiB message's bookkeeping. Owns only the choice of hasher; never used for anything secret.
//!
//! Each map gets its own random seed (`foldhash::fast::RandomState`), so keys a peer chooses (its
//! transfer ids, in the receiver's records) cannot be picked in advance to collide.

use std::collections::{HashMap, HashSet};

/// Builds the hashers of one map, with that map's own random seed.
pub type FastHashBuilder = foldhash::fast::RandomState;
/// A `HashMap` with [`FastHashBuilder`].
pub type FastMap<K, V> = HashMap<K, V, FastHashBuilder>;
/// A `HashSet` with [`FastHashBuilder`].
pub type FastSet<K> = HashSet<K, FastHashBuilder>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher;

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
