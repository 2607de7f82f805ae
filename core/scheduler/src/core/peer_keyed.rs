//! The hash for the core's maps keyed by ids that a peer gateway chooses: room ids (an expect notice
//! or a failure message creates a room or tombstone under the peer's id) and remote region ids (the
//! peer announces them). It only builds maps; it never decides what goes into them.

use foldhash::quality::SeedableRandomState;
use foldhash::SharedSeed;
use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::OnceLock;

/// A map keyed by ids a peer chooses. Such keys are attacker-controlled as far as the core is
/// concerned: with an unkeyed hash (FxHash) a peer could choose ids that all land in one probe
/// sequence and make every operation on the table linear in its size. These maps use foldhash (the
/// default hasher of hashbrown; in the class of ahash with a random state: a folded multiply of the
/// input with secret seeds) with a per-map seed and a process-wide shared seed, both drawn from the
/// OS through std's `RandomState`: a peer cannot compute a colliding set in advance, and one found
/// against one map does not carry over to another. Its `quality` variant: one more folded multiply
/// at the end, because the tables take their slot from the hash's low bits, and foldhash's `fast`
/// variant leaves those poorly mixed for ids that differ only in their high bits (ids `i << 52`
/// fell into at most 1 024 of 4 096 slots for one seed in four). It does not claim resistance against an attacker
/// who recovers the seeds from precise timing of this core's table operations; SipHash-1-3 (std's
/// own map) would, at about 130 instructions per hash, some 1 800 instructions (25 %) per room
/// lifecycle here. Nothing iterates these maps, so the seeds never change the core's outputs. Maps
/// keyed by ids that the local driver or engines assign (peers, local regions) and the core's own
/// ids (transfer ids, tickets) keep FxHash.
pub(crate) type PeerKeyedMap<K, V> = HashMap<K, V, SeedableRandomState>;

/// 64 bits from the OS's randomness (std seeds `RandomState` from it; each call differs).
fn os_random_u64() -> u64 {
    RandomState::new().hash_one(0x6b76_6761_7465_u64)
}

/// A hash state with its own random seed, for one table keyed by peer-chosen ids (a `PeerKeyedMap`
/// or the core's room-key table, `key_table`).
pub(crate) fn peer_keyed_hash_state() -> SeedableRandomState {
    static SHARED_SEED: OnceLock<SharedSeed> = OnceLock::new();
    let shared = SHARED_SEED.get_or_init(|| SharedSeed::from_u64(os_random_u64()));
    SeedableRandomState::with_seed(os_random_u64(), shared)
}

/// An empty map with its own random seed.
pub(crate) fn peer_keyed_map<K, V>() -> PeerKeyedMap<K, V> {
    HashMap::with_hasher(peer_keyed_hash_state())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys that all collide under an unkeyed multiplicative hash (FxHash: the same hash for every
    /// key, so one probe sequence) spread over a seeded map's buckets, and two maps hash the same
    /// key differently.
    #[test]
    fn ids_chosen_to_collide_under_fxhash_spread_and_each_map_has_its_own_seed() {
        use rustc_hash::FxBuildHasher;
        // FxHash (rustc-hash 2) of a u64 is `(k * K).rotate_left(26)` for a constant K: keys that
        // differ only in bits the multiplication pushes out collide in every table bucket index.
        let fx = FxBuildHasher;
        let keys: Vec<u64> = (0..4096u64).map(|i| i << 52).collect();
        let fx_buckets: std::collections::HashSet<u64> = keys.iter().map(|k| fx.hash_one(k) & 0xFFF).collect();
        let map: PeerKeyedMap<u64, u32> = peer_keyed_map();
        let seeded_buckets: std::collections::HashSet<u64> =
            keys.iter().map(|k| map.hasher().hash_one(k) & 0xFFF).collect();
        assert!(fx_buckets.len() <= 16, "the crafted keys should collide under FxHash: {} buckets", fx_buckets.len());
        assert!(seeded_buckets.len() > 1024, "a seeded map spreads them: {} of 4096 buckets", seeded_buckets.len());
        let other: PeerKeyedMap<u64, u32> = peer_keyed_map();
        let differing = keys.iter().filter(|k| map.hasher().hash_one(k) != other.hasher().hash_one(k)).count();
        assert_eq!(differing, keys.len(), "two maps never share a seed");
    }
}
