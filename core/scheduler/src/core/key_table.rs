//! The room-key table: room id (chosen by engines and peers) -> where the room is (a slab slot or a
//! tombstone record), as 8-byte entries (the id's 32-bit seeded hash and a 32-bit value) in one
//! linear-probing array. The ids themselves stay in the rooms and records; it never decides what a
//! value means, and it never compares ids itself (the caller's closures do).
//!
//! Why not a `HashMap<u64, u64>`: every room inserts one key and every evicted tombstone drops one,
//! at a random place in a table as large as `max_tombstones`. A hashbrown map spends 16 bytes per
//! bucket plus a control byte; this table spends 8 bytes per slot. And an evicted tombstone's entry
//! is not looked up at all: it goes stale where it is (its value names a record no longer held,
//! which the caller's `is_stale` recognises) and sweeps drop stale entries in one pass over the
//! array, in memory order. So a room costs one random cache line here (at insert), not two.

use super::peer_keyed::peer_keyed_hash_state;
use foldhash::quality::SeedableRandomState;
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
/// When an insert finds the table at its load limit, stale entries are swept first; if the rest
/// still fill more than `GROW_ABOVE_NUMERATOR / GROW_ABOVE_DENOMINATOR` of the slots the table
/// doubles, so an insert never sweeps again before an eighth of the slots has filled.
const GROW_ABOVE_NUMERATOR: usize = 3;
const GROW_ABOVE_DENOMINATOR: usize = 8;
/// A sweep is due once `slots / SWEEP_AFTER_EVICTIONS_DIVISOR` evictions happened since the last
/// one: a stale entry is never older than that many evictions (see `note_eviction`), and a sweep's
/// pass costs a few slots per eviction.
const SWEEP_AFTER_EVICTIONS_DIVISOR: usize = 4;
/// Most slots a table may have (2^28: 2 GiB of entries). Entries are rooms in the slab plus held
/// tombstones (each bounded by its limit, at most 2^24) plus stale entries; the bound keeps a stale
/// entry younger than 2^26 evictions, so the caller's 30-bit tombstone sequence numbers never alias
/// a stale value with a held one.
pub(crate) const MAX_KEY_TABLE_SLOTS: usize = 1 << 28;

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
    /// Entries in use, stale ones included.
    len: usize,
    /// Evictions (`note_eviction`) since the last sweep.
    evictions_since_sweep: usize,
}

impl KeyTable {
    /// An empty table with its own random seed.
    pub fn new() -> KeyTable {
        KeyTable { hasher: peer_keyed_hash_state(), entries: Vec::new(), len: 0, evictions_since_sweep: 0 }
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
    /// value names, and refuses stale values), if any.
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
    /// `u32::MAX`. `is_stale` tells the values of stale entries, should the table need a sweep.
    #[inline]
    pub fn insert_new(&mut self, hash: u32, value: u32, is_stale: impl FnMut(u32) -> bool) {
        assert!(value != EMPTY, "the empty marker is not a value");
        if (self.len + 1) * MAX_LOAD_DENOMINATOR > self.entries.len() * MAX_LOAD_NUMERATOR {
            self.make_room(is_stale);
        }
        let mask = self.mask();
        let mut index = hash as usize & mask;
        while self.entries[index].value != EMPTY {
            index = (index + 1) & mask;
        }
        self.entries[index] = Entry { hash, value };
        self.len += 1;
    }

    /// One tombstone was evicted (its entry, if the caller still had one, is now stale). Returns
    /// whether a sweep is due (`sweep`): the caller must sweep before the next eviction.
    #[inline]
    pub fn note_eviction(&mut self) -> bool {
        if self.len == 0 {
            // Nothing held, nothing can be stale.
            self.evictions_since_sweep = 0;
            return false;
        }
        self.evictions_since_sweep += 1;
        self.evictions_since_sweep >= self.entries.len() / SWEEP_AFTER_EVICTIONS_DIVISOR
    }

    /// Drop every entry whose value `is_stale` accepts, in one pass in memory order: from just after
    /// a free slot (so every cluster is met from its start), a stale entry frees its slot and a
    /// held one not at its home moves back to the first free slot from its home. Each entry is thus
    /// re-placed after the entries before it in its cluster, as if inserted again in that order.
    #[cold]
    pub fn sweep(&mut self, mut is_stale: impl FnMut(u32) -> bool) {
        self.evictions_since_sweep = 0;
        if self.len == 0 {
            return;
        }
        let slots = self.entries.len();
        let mask = slots - 1;
        // At most half the slots are in use: there is a free one.
        let start = self.entries.iter().position(|entry| entry.value == EMPTY).expect("a free slot");
        for step in 1..slots {
            let index = (start + step) & mask;
            let entry = self.entries[index];
            if entry.value == EMPTY {
                continue;
            }
            if is_stale(entry.value) {
                self.entries[index] = FREE;
                self.len -= 1;
                continue;
            }
            let home = entry.hash as usize & mask;
            if home == index {
                continue;
            }
            // Its home is at or before `index` in this cluster: the probe stops at `index` at the latest.
            self.entries[index] = FREE;
            let mut target = home;
            while self.entries[target].value != EMPTY {
                target = (target + 1) & mask;
            }
            self.entries[target] = entry;
        }
    }

    /// At the load limit: sweep stale entries if evictions happened since the last sweep, then
    /// double until the rest fill at most three eighths of the slots.
    #[cold]
    fn make_room(&mut self, is_stale: impl FnMut(u32) -> bool) {
        if self.evictions_since_sweep > 0 {
            self.sweep(is_stale);
        }
        while (self.len + 1) * GROW_ABOVE_DENOMINATOR > self.entries.len() * GROW_ABOVE_NUMERATOR {
            self.grow();
        }
    }

    /// The slot count after growing from `slots`; panics past `MAX_KEY_TABLE_SLOTS`.
    fn grown_slots(slots: usize) -> usize {
        let grown = (2 * slots).max(MIN_SLOTS);
        assert!(grown <= MAX_KEY_TABLE_SLOTS, "room-key table past {MAX_KEY_TABLE_SLOTS} slots");
        grown
    }

    /// Double the slots (the first time: `MIN_SLOTS`), re-placing every entry by its stored hash.
    fn grow(&mut self) {
        let slots = KeyTable::grown_slots(self.entries.len());
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

    /// Random inserts, value changes and removals (a value goes stale, as an evicted tombstone's;
    /// sweeps now and then) against a reference map, with ids drawn from a small range (so stale
    /// and held entries share clusters) and from a huge one.
    #[test]
    fn matches_a_reference_map() {
        let mut rng = 7u64;
        let mut table = KeyTable::new();
        let mut by_id: HashMap<u64, u32> = HashMap::new();
        let mut by_value: HashMap<u32, u64> = HashMap::new();
        let mut stale: std::collections::HashSet<u32> = std::collections::HashSet::new();
        let mut next_value = 0u32;
        for step in 0..200_000u32 {
            let id = if next_random(&mut rng).is_multiple_of(2) {
                next_random(&mut rng) % 4096
            } else {
                next_random(&mut rng)
            };
            let found = find_id(&table, &by_value, id);
            assert_eq!(found.map(|index| table.value_at(index)), by_id.get(&id).copied(), "step {step}, id {id}");
            match (next_random(&mut rng) % 3, found) {
                (0, Some(_)) => {
                    let value = by_id.remove(&id).unwrap();
                    by_value.remove(&value);
                    stale.insert(value);
                    if table.note_eviction() || next_random(&mut rng).is_multiple_of(64) {
                        table.sweep(|value| stale.contains(&value));
                        stale.clear();
                    }
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
                    let swept = std::cell::Cell::new(false);
                    table.insert_new(table.hash(id), next_value, |value| {
                        swept.set(true);
                        stale.contains(&value)
                    });
                    if swept.get() {
                        stale.clear();
                    }
                    by_id.insert(id, next_value);
                    by_value.insert(next_value, id);
                }
            }
            assert_eq!(table.len(), by_id.len() + stale.len(), "step {step}");
        }
        for (&id, &value) in &by_id {
            let index = find_id(&table, &by_value, id).expect("every held id is found");
            assert_eq!(table.value_at(index), value);
            assert_eq!(table.find_value(table.hash(id), value), Some(index));
        }
    }

    /// Entries that share one home slot (and wrap around the end of the array) are all found, and
    /// sweeping any of them away keeps the others reachable.
    #[test]
    fn colliding_hashes_wrap_and_survive_removals_in_any_order() {
        for remove_order in [[0usize, 1, 2, 3, 4], [4, 3, 2, 1, 0], [2, 0, 4, 1, 3]] {
            let mut table = KeyTable::new();
            let last_slot = MIN_SLOTS as u32 - 1;
            // Five entries homed at the last slot wrap to slots 0..4; one homed at slot 1 sits behind them.
            for value in 0..5 {
                table.insert_new(last_slot, value, |_| false);
            }
            table.insert_new(1, 100, |_| false);
            assert_eq!(table.slots(), MIN_SLOTS);
            for (removed, &value) in remove_order.iter().enumerate() {
                assert!(table.find_value(last_slot, value as u32).is_some(), "held");
                table.sweep(|held| held == value as u32);
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
                table.insert_new(hash, value, |_| false);
                values.push((hash, value));
                value += 1;
                assert_eq!(table.slots(), slots, "at most half full: {} entries", table.len());
            }
            let hash = table.hash(value as u64);
            table.insert_new(hash, value, |_| false);
            values.push((hash, value));
            value += 1;
            assert_eq!(table.slots(), 2 * slots, "one past half full doubles");
            for &(hash, held) in &values {
                assert!(table.find_value(hash, held).is_some());
            }
        }
    }

    /// Stale entries (as the core's evicted tombstones) are never found, sweeps drop exactly them,
    /// and the held entries sharing their clusters stay reachable.
    #[test]
    fn stale_entries_are_never_found_and_sweeps_drop_exactly_them() {
        let mut rng = 5u64;
        let mut table = KeyTable::new();
        let mut held: Vec<(u32, u32)> = Vec::new();
        let mut stale: std::collections::HashSet<u32> = std::collections::HashSet::new();
        let mut stale_hashes: Vec<(u32, u32)> = Vec::new();
        let mut value = 0u32;
        for round in 0..60 {
            for _ in 0..200 {
                // Few distinct homes, so stale and held entries share clusters.
                let hash = (next_random(&mut rng) % 64) as u32 * 0x9E37;
                let swept = std::cell::Cell::new(false);
                table.insert_new(hash, value, |v| {
                    swept.set(true);
                    stale.contains(&v)
                });
                if swept.get() {
                    // The insert swept (its load limit): the stale entries are gone.
                    stale.clear();
                    stale_hashes.clear();
                }
                held.push((hash, value));
                value += 1;
            }
            // Every other held entry goes stale (lazily: nothing is removed).
            let mut index = 0;
            held.retain(|&(hash, v)| {
                index += 1;
                if index % 2 == 0 {
                    return true;
                }
                stale.insert(v);
                stale_hashes.push((hash, v));
                table.note_eviction();
                false
            });
            if round % 3 == 0 {
                table.sweep(|v| stale.contains(&v));
                stale.clear();
                stale_hashes.clear();
            }
            assert_eq!(table.len(), held.len() + stale.len(), "round {round}");
            for &(hash, v) in &stale_hashes {
                assert_eq!(table.find(hash, |found| found == v && !stale.contains(&found)), None);
                assert!(table.find_value(hash, v).is_some(), "a stale entry stays until a sweep");
            }
            for &(hash, v) in &held {
                assert!(table.find_value(hash, v).is_some(), "held value {v} lost in round {round}");
            }
        }
    }

    /// A sweep is due at exactly a quarter of the slots in evictions, not one before; it resets
    /// the count.
    #[test]
    fn a_sweep_is_due_after_a_quarter_of_the_slots_in_evictions() {
        let mut table = KeyTable::new();
        for value in 0..40 {
            table.insert_new(table.hash(value as u64), value, |_| false);
        }
        let due_after = table.slots() / SWEEP_AFTER_EVICTIONS_DIVISOR;
        assert_eq!(table.slots(), 128);
        for eviction in 1..due_after {
            assert!(!table.note_eviction(), "not due after {eviction} evictions");
        }
        assert!(table.note_eviction(), "due after {due_after} evictions");
        table.sweep(|value| value < 10);
        assert_eq!(table.len(), 30);
        assert!(!table.note_eviction(), "the count restarts after a sweep");
    }

    /// At the load limit an insert sweeps stale entries instead of growing when few are held, and
    /// grows when the held ones fill more than three eighths of the slots.
    #[test]
    fn an_insert_at_the_load_limit_sweeps_before_it_grows() {
        let mut table = KeyTable::new();
        let mut value = 0u32;
        // Fill to the load limit of 64 slots with 32 entries.
        while table.len() < 32 {
            table.insert_new(table.hash(value as u64), value, |_| false);
            value += 1;
        }
        assert_eq!(table.slots(), 64);
        // 20 of them become stale through evictions: the next insert sweeps them, no growth.
        table.note_eviction();
        table.insert_new(table.hash(value as u64), value, |held| held < 20);
        value += 1;
        assert_eq!((table.slots(), table.len()), (64, 13));
        // Fill again with nothing stale: past half full it doubles.
        while table.len() < 32 {
            table.insert_new(table.hash(value as u64), value, |_| false);
            value += 1;
        }
        table.note_eviction();
        table.insert_new(table.hash(value as u64), value, |held| held < 20);
        assert_eq!(
            (table.slots(), table.len()),
            (128, 33),
            "more than three eighths of 64 slots held after the sweep: doubled"
        );
    }

    #[test]
    fn grows_up_to_max_key_table_slots() {
        assert_eq!(KeyTable::grown_slots(0), MIN_SLOTS);
        assert_eq!(KeyTable::grown_slots(MAX_KEY_TABLE_SLOTS / 2), MAX_KEY_TABLE_SLOTS);
    }

    #[test]
    #[should_panic(expected = "room-key table past")]
    fn does_not_grow_past_max_key_table_slots() {
        KeyTable::grown_slots(MAX_KEY_TABLE_SLOTS);
    }

    #[test]
    #[should_panic(expected = "the empty marker is not a value")]
    fn the_empty_marker_is_refused_as_a_value() {
        KeyTable::new().insert_new(0, u32::MAX, |_| false);
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
