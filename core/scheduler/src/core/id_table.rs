//! A table from ids the core issues in increasing order (transfer ids, tickets) to small values: a
//! window over the recent ids, indexed by `id - base` (no hashing), plus a hash map for the few old
//! ids still held when the window would outgrow its bound. It never issues ids (the core does).

use rustc_hash::FxHashMap;
use std::collections::VecDeque;

/// Ids still free in the window before old live ids move to the overflow map: after an insert the
/// window holds at most `2 × live ids in it + WINDOW_SLACK_IDS` entries.
const WINDOW_SLACK_IDS: usize = 4096;

pub(crate) struct SequentialIdTable<V: Copy> {
    /// The id of `window[0]`.
    base: u64,
    window: VecDeque<Option<V>>,
    window_live: usize,
    /// Ids older than `base` that are still held (ids the window let go).
    overflow: FxHashMap<u64, V>,
}

impl<V: Copy> Default for SequentialIdTable<V> {
    fn default() -> Self {
        SequentialIdTable { base: 0, window: VecDeque::new(), window_live: 0, overflow: FxHashMap::default() }
    }
}

impl<V: Copy> SequentialIdTable<V> {
    /// Insert `id`, which must be higher than every id inserted before (ids skipped are absent).
    #[inline]
    pub fn insert(&mut self, id: u64, value: V) {
        // The common case: the next id, and the window within its bound after the insert.
        if !self.window.is_empty()
            && id == self.base + self.window.len() as u64
            && self.window.len() < 2 * (self.window_live + 1) + WINDOW_SLACK_IDS
        {
            self.window.push_back(Some(value));
            self.window_live += 1;
            return;
        }
        self.insert_slow(id, value);
    }

    fn insert_slow(&mut self, id: u64, value: V) {
        if self.window.is_empty() {
            self.base = id;
        }
        let end = self.base + self.window.len() as u64;
        assert!(id >= end, "ids are inserted in increasing order");
        for _ in end..id {
            self.window.push_back(None);
        }
        self.window.push_back(Some(value));
        self.window_live += 1;
        while self.window.len() > 2 * self.window_live + WINDOW_SLACK_IDS {
            self.pop_front_to_overflow();
        }
    }

    pub fn get(&self, id: u64) -> Option<V> {
        match id.checked_sub(self.base) {
            Some(offset) if offset < self.window.len() as u64 => self.window[offset as usize],
            _ => self.overflow.get(&id).copied(),
        }
    }

    /// Replace the value of `id` if it is held (a settled room's ids are re-pointed at its
    /// tombstone record); an id not held stays absent.
    pub fn replace(&mut self, id: u64, value: V) {
        match id.checked_sub(self.base) {
            Some(offset) if offset < self.window.len() as u64 => {
                if let Some(held) = self.window[offset as usize].as_mut() {
                    *held = value;
                }
            }
            _ => {
                if let Some(held) = self.overflow.get_mut(&id) {
                    *held = value;
                }
            }
        }
    }

    pub fn remove(&mut self, id: u64) -> Option<V> {
        match id.checked_sub(self.base) {
            Some(offset) if offset < self.window.len() as u64 => {
                let value = self.window[offset as usize].take();
                if value.is_some() {
                    self.window_live -= 1;
                    while self.window.front().is_some_and(|front| front.is_none()) {
                        self.window.pop_front();
                        self.base += 1;
                    }
                }
                value
            }
            _ => self.overflow.remove(&id),
        }
    }

    /// Ids held.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.window_live + self.overflow.len()
    }

    fn pop_front_to_overflow(&mut self) {
        if let Some(front) = self.window.pop_front() {
            if let Some(value) = front {
                self.overflow.insert(self.base, value);
                self.window_live -= 1;
            }
            self.base += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    use crate::test_random as next_random;

    /// The table against a reference map, with ids held for very different times (so some move to
    /// the overflow map) and gaps between ids.
    #[test]
    fn matches_a_reference_map() {
        let mut rng = 11u64;
        let mut table = SequentialIdTable::default();
        let mut model = BTreeMap::new();
        let mut next = 1u64;
        for step in 0..300_000u64 {
            match next_random(&mut rng) % 4 {
                0 | 1 => {
                    next += 1 + next_random(&mut rng) % 3;
                    table.insert(next, step);
                    model.insert(next, step);
                    assert!(table.window.len() <= 2 * table.window_live + WINDOW_SLACK_IDS);
                }
                2 if step % 5 == 0 => {
                    // Re-point a held id (or try one never inserted): the value changes, absence stays.
                    let id = next - next_random(&mut rng) % (64.min(next));
                    table.replace(id, step + 1_000_000);
                    if let Some(held) = model.get_mut(&id) {
                        *held = step + 1_000_000;
                    }
                }
                2 => {
                    // Mostly recent ids, sometimes an old one, sometimes one never inserted.
                    let span = if next_random(&mut rng).is_multiple_of(8) { next } else { 64.min(next) };
                    let id = next - next_random(&mut rng) % span;
                    assert_eq!(table.remove(id), model.remove(&id), "remove {id}");
                }
                _ => {
                    let id = next_random(&mut rng) % (next + 10);
                    assert_eq!(table.get(id), model.get(&id).copied(), "get {id}");
                }
            }
            assert_eq!(table.len(), model.len());
        }
        assert!(!table.overflow.is_empty(), "the test should exercise the overflow map");
    }

    #[test]
    fn a_window_emptied_restarts_at_the_next_id() {
        let mut table = SequentialIdTable::default();
        table.insert(5, 'a');
        assert_eq!(table.remove(5), Some('a'));
        table.insert(1_000_000, 'b');
        assert_eq!(table.window.len(), 1);
        assert_eq!(table.get(1_000_000), Some('b'));
        assert_eq!(table.get(5), None);
    }
}
