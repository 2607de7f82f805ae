//! The room-key table: room id (chosen by engines and peers) -> where the room is (a slab slot or a
//! tombstone record), as 8-byte entries (the id's 32-bit seeded hash and a 32-bit value) in one
//! linear-probing array. The ids themselves stay in the rooms and records; it never decides what a
//! value means, and it never compares ids itself (the caller's closure does).
//!
//! Why not a `HashMap<u64, u64>`: every room inserts one key and every evicted tombstone removes
//! one, at a random place in a table as large as `max_tombstones`. A hashbrown map spends 16 bytes
//! per bucket plus a control byte and, with peer-chosen ids churning, grows to twice its live size;
//! this table spends 8 bytes per slot at a load of at most one half, so the same keys take half the
//! cache lines. Removal shifts the rest of the cluster back (no deleted markers, never a rehash
//! in place), and the stored hashes let it grow without reading one id.

use super::peer_keyed::peer_keyed_hash_state;
use foldhash::fast::SeedableRandomState;
use std::hash::BuildHasher;

/// An entry's value when the slot is empty (never a valid value: see `KeyTable::insert_new`).
const EMPTY: u32 = u32::MAX;

/// The table grows (doubles) before an insert would put more than `MAX_LOAD_NUMERATOR /
/// MAX_LOAD_DENOMINATOR` of its slots in use: at a load of one half a linear probe ends in the
/// home cache line almost always.
const MAX_LOAD_NUMERATOR: usize = 1;
const MAX_LOAD_DENOMINATOR: usize = 2;
/// The first allocation, in slots.
const MIN_SLOTS: usize = 16;
/// Most slots a table may have: the stored hash has 32 bits, so a slot's home is well defined up to
/// 2^32 slots; beyond it the core would hold more than 2^31 rooms, which `max_inflight_rooms` and
/// `max_tombstones` (each at most 2^24) exclude.
pub(crate) const MAX_KEY_TABLE_SLOTS: usize = 1 << 32;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    /// The low 32 bits of the id's seeded hash; its low bits are the entry's home slot.
    hash: u32,
    /// What the caller stored (`EMPTY`: a free slot).
    value: u32,
}

const FREE: Entry = Entry { hash: 0, value: EMPTY };

/// A table from peer-chosen room ids to 32-bit values (ids hashed with a per-table random seed).
pub(crate) struct KeyTable {
    hasher: SeedableRandomState,
    /// A power of two in length (or empty).
    entries: Vec<Entry>,
    len: usize,
}

impl KeyTable {
    /// An empty table with its own random seed.
    pub fn new() -> KeyTable {
        KeyTable { hasher: peer_keyed_hash_state(), entries: Vec::new(), len: 0 }
    }

    /// The id's hash, as this table stores it.
    #[inline]
    pub fn hash(&self, id: u64) -> u32 {
        self.hasher.hash_one(id) as u32
    }

    /// Entries held.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.len
    }

    #[inline]
    fn mask(&self) -> usize {
        self.entries.len().wrapping_sub(1)
    }

    /// The index of the entry with `hash` whose value `is_id` accepts (the caller checks the id the
    /// value names), if any.
    #[inline]
    pub fn find(&self, hash: u32, mut is_id: impl FnMut(u32) -> bool) -> Option<usize> {
        if self.entries.is_empty() {
            return None;
        }
        let mask = self.mask();
        let mut index = hash as usize & mask;
        loop {
            let entry = self.entries[index];
            if entry.value == EMPTY {
                return None;
            }
            if entry.hash == hash && is_id(entry.value) {
                return Some(index);
            }
            index = (index + 1) & mask;
        }
    }

    /// The index of the entry with `hash` and exactly `value`, if any (no id comparison: values are
    /// unique among the entries of one id's hash as the caller uses them).
    #[inline]
    pub fn find_value(&self, hash: u32, value: u32) -> Option<usize> {
        self.find(hash, |held| held == value)
    }

    /// The value at `index` (from `find`, before any insert or removal).
    #[inline]
    pub fn value_at(&self, index: usize) -> u32 {
        self.entries[index].value
    }

    /// Replace the value at `index` (from `find`, before any insert or removal).
    #[inline]
    pub fn set_value_at(&mut self, index: usize, value: u32) {
        assert!(value != EMPTY, "the empty marker is not a value");
        debug_assert!(self.entries[index].value != EMPTY);
        self.entries[index].value = value;
    }

    /// Insert an entry for an id the caller found absent (`find` returned None). `value` must not be
    /// `u32::MAX`.
    #[inline]
    pub fn insert_new(&mut self, hash: u32, value: u32) {
        assert!(value != EMPTY, "the empty marker is not a value");
        if (self.len + 1) * MAX_LOAD_DENOMINATOR > self.entries.len() * MAX_LOAD_NUMERATOR {
            self.grow();
        }
        let mask = self.mask();
        let mut index = hash as usize & mask;
        while self.entries[index].value != EMPTY {
            index = (index + 1) & mask;
        }
        self.entries[index] = Entry { hash, value };
        self.len += 1;
    }

    /// Remove the entry at `index` (from `find`): the entries after it in its cluster that may move
    /// back do, so every probe still ends at the first free slot.
    pub fn remove_at(&mut self, index: usize) {
        debug_assert!(self.entries[index].value != EMPTY);
        let mask = self.mask();
        let mut hole = index;
        let mut next = index;
        loop {
            next = (next + 1) & mask;
            let entry = self.entries[next];
            if entry.value == EMPTY {
                break;
            }
            let home = entry.hash as usize & mask;
            // The entry may fill the hole if the hole lies on its probe path (from home to next).
            if next.wrapping_sub(home) & mask >= next.wrapping_sub(hole) & mask {
                self.entries[hole] = entry;
                hole = next;
            }
        }
        self.entries[hole] = FREE;
        self.len -= 1;
    }

    /// Double the slots (the first time: `MIN_SLOTS`), re-placing every entry by its stored hash.
    #[cold]
    fn grow(&mut self) {
        let slots = (2 * self.entries.len()).max(MIN_SLOTS);
        assert!(slots <= MAX_KEY_TABLE_SLOTS, "room-key table past {MAX_KEY_TABLE_SLOTS} slots");
        let old = std::mem::replace(&mut self.entries, vec![FREE; slots]);
        let mask = slots - 1;
        for entry in old.into_iter().filter(|entry| entry.value != EMPTY) {
            let mut index = entry.hash as usize & mask;
            while self.entries[index].value != EMPTY {
                index = (index + 1) & mask;
            }
            self.entries[index] = entry;
        }
    }

    /// Slots allocated.
    #[cfg(test)]
    pub fn slots(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_random as next_random;
    use std::collections::HashMap;

    /// A reference: id -> value, with the ids kept by the test (as the core keeps them in rooms).
    fn find_id(table: &KeyTable, ids: &HashMap<u32, u64>, id: u64) -> Option<usize> {
        table.find(table.hash(id), |value| ids.get(&value) == Some(&id))
    }

    /// Random inserts, value changes and removals against a reference map, with ids drawn from a
    /// small range (so removals hit clusters) and from a huge one.
    #[test]
    fn matches_a_reference_map() {
        let mut rng = 7u64;
        let mut table = KeyTable::new();
        let mut by_id: HashMap<u64, u32> = HashMap::new();
        let mut by_value: HashMap<u32, u64> = HashMap::new();
        let mut next_value = 0u32;
        for step in 0..200_000u32 {
            let id = if next_random(&mut rng) % 2 == 0 { next_random(&mut rng) % 4096 } else { next_random(&mut rng) };
            let found = find_id(&table, &by_value, id);
            assert_eq!(found.map(|index| table.value_at(index)), by_id.get(&id).copied(), "step {step}, id {id}");
            match (next_random(&mut rng) % 3, found) {
                (0, Some(index)) => {
                    table.remove_at(index);
                    let value = by_id.remove(&id).unwrap();
                    by_value.remove(&value);
                }
                (1, Some(index)) => {
                    next_value += 1;
                    table.set_value_at(index, next_value);
                    let old = by_id.insert(id, next_value).unwrap();
                    by_value.remove(&old);
                    by_value.insert(next_value, id);
                }
                (_, Some(_)) => {}
                (_, None) => {
                    next_value += 1;
                    table.insert_new(table.hash(id), next_value);
                    by_id.insert(id, next_value);
                    by_value.insert(next_value, id);
                }
            }
            assert_eq!(table.len(), by_id.len());
        }
        for (&id, &value) in &by_id {
            let index = find_id(&table, &by_value, id).expect("every held id is found");
            assert_eq!(table.value_at(index), value);
            assert_eq!(table.find_value(table.hash(id), value), Some(index));
        }
    }

    /// Entries that share one home slot (and wrap around the end of the array) are all found, and
    /// removing any of them keeps the others reachable.
    #[test]
    fn colliding_hashes_wrap_and_survive_removals_in_any_order() {
        for remove_order in [[0usize, 1, 2, 3, 4], [4, 3, 2, 1, 0], [2, 0, 4, 1, 3]] {
            let mut table = KeyTable::new();
            let last_slot = MIN_SLOTS as u32 - 1;
            // Five entries homed at the last slot wrap to slots 0..4; one homed at slot 1 sits behind them.
            for value in 0..5 {
                table.insert_new(last_slot, value);
            }
            table.insert_new(1, 100);
            assert_eq!(table.slots(), MIN_SLOTS);
            for (removed, &value) in remove_order.iter().enumerate() {
                let index = table.find_value(last_slot, value as u32).expect("held");
                table.remove_at(index);
                assert_eq!(table.find_value(last_slot, value as u32), None);
                for &other in &remove_order[removed + 1..] {
                    assert!(table.find_value(last_slot, other as u32).is_some(), "{other} lost after removing {value}");
                }
                assert!(table.find_value(1, 100).is_some(), "the entry homed at slot 1 stays reachable");
            }
            assert_eq!(table.len(), 1);
        }
    }

    /// The load limit: a table of `n` slots holds `n / 2` entries, the next insert doubles it, and
    /// every entry is found after growing.
    #[test]
    fn grows_exactly_past_half_full() {
        let mut table = KeyTable::new();
        let mut values = Vec::new();
        let mut value = 0u32;
        for slots in [MIN_SLOTS, 2 * MIN_SLOTS, 4 * MIN_SLOTS] {
            while table.len() < slots * MAX_LOAD_NUMERATOR / MAX_LOAD_DENOMINATOR {
                let hash = table.hash(value as u64);
                table.insert_new(hash, value);
                values.push((hash, value));
                value += 1;
                assert_eq!(table.slots(), slots, "at most half full: {} entries", table.len());
            }
            let hash = table.hash(value as u64);
            table.insert_new(hash, value);
            values.push((hash, value));
            value += 1;
            assert_eq!(table.slots(), 2 * slots, "one past half full doubles");
            for &(hash, held) in &values {
                assert!(table.find_value(hash, held).is_some());
            }
        }
    }

    #[test]
    #[should_panic(expected = "the empty marker is not a value")]
    fn the_empty_marker_is_refused_as_a_value() {
        KeyTable::new().insert_new(0, u32::MAX);
    }

    /// Ids that all collide under an unkeyed multiplicative hash (FxHash, see `peer_keyed`) get
    /// spread-out home slots: a peer cannot pile its rooms into one probe cluster.
    #[test]
    fn ids_chosen_to_collide_under_fxhash_get_spread_out_homes() {
        let table = KeyTable::new();
        let homes: std::collections::HashSet<u32> = (0..4096u64).map(|i| table.hash(i << 52) & 0xFFF).collect();
        assert!(homes.len() > 1024, "{} of 4096 home slots", homes.len());
    }

    #[test]
    fn each_table_has_its_own_seed() {
        let (a, b) = (KeyTable::new(), KeyTable::new());
        let differing = (0..1024u64).filter(|&id| a.hash(id) != b.hash(id)).count();
        assert!(differing > 1000, "{differing} of 1024 ids hash differently");
    }
}
