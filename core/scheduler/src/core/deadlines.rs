//! Where each room's one deadline entry lives: the timer wheel, or the nursery (a FIFO of rooms whose
//! earliest deadline is still far off, moved into the wheel only when the nursery's span passes).
//! Most rooms end before that, so they never touch the wheel. It stores (slot, epoch) payloads and
//! never fires a room's timer itself (the core does), nor decides which timers a room has.

use crate::api::At;
use crate::wheel::{TimerHandle, Wheel, TICK_NS};
use std::collections::VecDeque;

/// A room's entry value: no entry.
pub(crate) const NO_ENTRY: u32 = u32::MAX;
/// A room's entry value with this bit set: waiting in the nursery, at the entry whose sequence
/// number (mod 2^31) is in the low bits. Any other value is a wheel handle (below this bit).
const NURSERY_BIT: u32 = 1 << 31;
const SEQUENCE_MASK: u32 = NURSERY_BIT - 1;
/// A nursery entry whose room left the nursery before its span ended (skipped, its slot unread).
const LEFT: u32 = u32::MAX;

/// Whether a room's entry value says it waits in the nursery.
pub(crate) fn in_nursery(entry: u32) -> bool {
    entry != NO_ENTRY && entry & NURSERY_BIT != 0
}

/// The nursery's span: a room enters it only if its earliest deadline is at or after the end of the
/// current span (64 wheel ticks, 64 ms), and moves to the wheel when that end passes. Spans are
/// aligned, so the core wakes at most once per span for the nursery.
const NURSERY_SPAN_NS: u64 = 64 * TICK_NS;

/// A room waiting in the nursery: its slot (`LEFT` once the room left early), the slot's epoch, and
/// when it moves to the wheel (never after the room's earliest deadline; non-decreasing along the
/// FIFO).
#[derive(Clone, Copy)]
struct NurseryEntry {
    slot: u32,
    epoch: u32,
    promote_at: At,
}

/// The payload of a room's wheel entry: its slot and the slot's epoch.
pub(crate) fn encode_entry(slot: u32, epoch: u32) -> u64 {
    ((slot as u64) << 32) | epoch as u64
}

pub(crate) fn decode_entry(payload: u64) -> (u32, u32) {
    ((payload >> 32) as u32, payload as u32)
}

#[derive(Default)]
pub(crate) struct Deadlines {
    pub wheel: Wheel,
    nursery: VecDeque<NurseryEntry>,
    /// The sequence number of the nursery's front entry (entry `seq` is at `seq - front_sequence`).
    front_sequence: u64,
    /// Rooms in the nursery (the FIFO also holds the entries of rooms that left it, marked `LEFT`).
    nursery_rooms: usize,
    /// The promote time of the nursery's newest entry (meaningful while the nursery is not empty).
    newest_promote_at: At,
}

impl Deadlines {
    /// Entries held: wheel entries plus rooms in the nursery.
    pub fn len(&self) -> usize {
        self.wheel.len() + self.nursery_rooms
    }

    /// When a room entering the nursery at `now` would move to the wheel.
    fn promote_time(&self, now: At) -> At {
        let end_of_span = At((now.0 / NURSERY_SPAN_NS).saturating_add(1).saturating_mul(NURSERY_SPAN_NS));
        match self.newest_promote_time() {
            Some(last) => end_of_span.max(last),
            None => end_of_span,
        }
    }

    /// The latest promote time of the nursery (a room whose earliest deadline is at or after it may
    /// stay in the nursery, whichever entry is its own).
    fn newest_promote_time(&self) -> Option<At> {
        (!self.nursery.is_empty()).then_some(self.newest_promote_at)
    }

    /// A new entry for a room that has none, due at `deadline`; returns the room's entry value.
    fn place(&mut self, now: At, slot: u32, epoch: u32, deadline: At) -> u32 {
        let promote_at = self.promote_time(now);
        if deadline >= promote_at {
            let sequence = self.front_sequence + self.nursery.len() as u64;
            self.nursery.push_back(NurseryEntry { slot, epoch, promote_at });
            self.newest_promote_at = promote_at;
            self.nursery_rooms += 1;
            NURSERY_BIT | (sequence as u32 & SEQUENCE_MASK)
        } else {
            self.wheel_insert(slot, epoch, deadline)
        }
    }

    fn wheel_insert(&mut self, slot: u32, epoch: u32, deadline: At) -> u32 {
        let raw = self.wheel.insert(deadline, encode_entry(slot, epoch)).raw();
        assert!(raw < NURSERY_BIT, "timer wheel handles stay below 2^31");
        raw
    }

    /// A room leaves the nursery before its span ended: its entry is marked, so that the nursery
    /// never reads the room's slot again.
    fn leave_nursery(&mut self, entry: u32) {
        let offset = (entry & SEQUENCE_MASK).wrapping_sub(self.front_sequence as u32) & SEQUENCE_MASK;
        let held = &mut self.nursery[offset as usize];
        debug_assert_ne!(held.slot, LEFT, "a room leaves the nursery once");
        held.slot = LEFT;
        self.nursery_rooms -= 1;
    }

    /// The room's earliest deadline may have moved earlier, to `deadline`; returns its entry value.
    /// The common case (a room in the nursery whose new deadline is still past the nursery's
    /// newest promote time) is answered inline; the rest is `lower_slow`.
    #[inline]
    pub fn lower(&mut self, now: At, entry: u32, slot: u32, epoch: u32, deadline: At) -> u32 {
        if in_nursery(entry) && self.newest_promote_time().is_some_and(|at| deadline >= at) {
            return entry;
        }
        self.lower_slow(now, entry, slot, epoch, deadline)
    }

    fn lower_slow(&mut self, now: At, entry: u32, slot: u32, epoch: u32, deadline: At) -> u32 {
        if entry == NO_ENTRY {
            return self.place(now, slot, epoch, deadline);
        }
        if in_nursery(entry) {
            if self.newest_promote_time().is_some_and(|at| deadline >= at) {
                return entry;
            }
            self.leave_nursery(entry);
            return self.wheel_insert(slot, epoch, deadline);
        }
        let handle = TimerHandle::from_raw(entry);
        if Wheel::tick_of(deadline) < self.wheel.tick(handle) {
            self.wheel.rearm(handle, deadline, encode_entry(slot, epoch));
        }
        entry
    }

    /// The room's earliest deadline is now `earliest` (None: nothing armed); returns its entry value.
    pub fn sync(&mut self, now: At, entry: u32, slot: u32, epoch: u32, earliest: Option<At>) -> u32 {
        match earliest {
            None if entry == NO_ENTRY => NO_ENTRY,
            None if in_nursery(entry) => {
                self.leave_nursery(entry);
                NO_ENTRY
            }
            None => {
                self.wheel.cancel(TimerHandle::from_raw(entry));
                NO_ENTRY
            }
            Some(deadline) if entry == NO_ENTRY || in_nursery(entry) => self.lower(now, entry, slot, epoch, deadline),
            Some(deadline) => {
                let handle = TimerHandle::from_raw(entry);
                if Wheel::tick_of(deadline) != self.wheel.tick(handle) {
                    self.wheel.rearm(handle, deadline, encode_entry(slot, epoch));
                }
                entry
            }
        }
    }

    /// Whether a nursery span or a wheel timer may be due at `now` (false: certainly nothing).
    #[inline]
    pub fn may_be_due(&self, now: At) -> bool {
        self.nursery.front().is_some_and(|front| front.promote_at <= now) || self.wheel.may_be_due(now)
    }

    /// Take the next room whose nursery span ended at `now` (its slot and epoch); the caller moves it
    /// to the wheel with `promote`. Entries of rooms that left are dropped on the way.
    #[inline]
    pub fn pop_nursery(&mut self, now: At) -> Option<(u32, u32)> {
        match self.nursery.front() {
            Some(front) if front.promote_at <= now => self.pop_nursery_slow(now),
            _ => None,
        }
    }

    fn pop_nursery_slow(&mut self, now: At) -> Option<(u32, u32)> {
        loop {
            let front = *self.nursery.front()?;
            if front.promote_at > now {
                return None;
            }
            self.nursery.pop_front();
            self.front_sequence += 1;
            if front.slot != LEFT {
                return Some((front.slot, front.epoch));
            }
        }
    }

    /// Move a room out of the nursery (just popped) into the wheel at its earliest deadline (None:
    /// no entry).
    pub fn promote(&mut self, slot: u32, epoch: u32, earliest: Option<At>) -> u32 {
        self.nursery_rooms -= 1;
        match earliest {
            Some(deadline) => self.wheel_insert(slot, epoch, deadline),
            None => NO_ENTRY,
        }
    }

    /// The earliest time `handle_timeout` may have something to do here.
    pub fn next_deadline(&self) -> Option<At> {
        let nursery = self.nursery.front().map(|entry| entry.promote_at);
        match (self.wheel.next_deadline(), nursery) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    /// Pop everything due at `now` the way the core does: nursery first, then the wheel.
    fn fire(deadlines: &mut Deadlines, entries: &mut [u32], earliest: &[Option<At>], now: At) -> Vec<u32> {
        while let Some((slot, _)) = deadlines.pop_nursery(now) {
            assert!(in_nursery(entries[slot as usize]), "only rooms still in the nursery come up");
            entries[slot as usize] = deadlines.promote(slot, 0, earliest[slot as usize]);
        }
        let mut fired = Vec::new();
        while let Some(payload) = deadlines.wheel.pop_expired(now) {
            let (slot, _) = decode_entry(payload);
            entries[slot as usize] = NO_ENTRY;
            fired.push(slot);
        }
        fired
    }

    #[test]
    fn a_far_deadline_waits_in_the_nursery_and_still_fires_on_its_tick() {
        let mut deadlines = Deadlines::default();
        let now = At(10 * MS);
        let far = At(10_000 * MS);
        let mut entries = [deadlines.lower(now, NO_ENTRY, 0, 0, far)];
        assert!(in_nursery(entries[0]));
        assert_eq!(deadlines.wheel.len(), 0);
        assert_eq!(deadlines.len(), 1);
        // The driver is woken at the end of the nursery span, never after the deadline.
        let wake = deadlines.next_deadline().unwrap();
        assert!(wake <= far && wake > now, "wake {wake} for a deadline {far}");
        assert!(fire(&mut deadlines, &mut entries, &[Some(far)], wake).is_empty());
        assert!(!in_nursery(entries[0]), "promoted at the end of its span");
        assert_eq!(deadlines.wheel.len(), 1);
        assert!(fire(&mut deadlines, &mut entries, &[Some(far)], At(far.0 - 1)).is_empty());
        assert_eq!(fire(&mut deadlines, &mut entries, &[Some(far)], far), vec![0]);
        assert_eq!(deadlines.len(), 0);
    }

    #[test]
    fn a_near_deadline_goes_straight_to_the_wheel_and_an_earlier_one_leaves_the_nursery() {
        let mut deadlines = Deadlines::default();
        let now = At(10 * MS);
        // Within the current span: straight to the wheel.
        let near = deadlines.lower(now, NO_ENTRY, 0, 0, At(12 * MS));
        assert!(!in_nursery(near));
        // Far, then lowered to a near deadline: moves to the wheel and fires at the near one.
        let mut entries = [near, deadlines.lower(now, NO_ENTRY, 1, 0, At(10_000 * MS))];
        assert!(in_nursery(entries[1]));
        entries[1] = deadlines.lower(now, entries[1], 1, 0, At(20 * MS));
        assert!(!in_nursery(entries[1]));
        assert_eq!(deadlines.len(), 2);
        let earliest = [Some(At(12 * MS)), Some(At(20 * MS))];
        assert_eq!(fire(&mut deadlines, &mut entries, &earliest, At(12 * MS)), vec![0]);
        assert_eq!(fire(&mut deadlines, &mut entries, &earliest, At(20 * MS)), vec![1]);
        // The stale nursery entry is skipped when its span ends.
        assert!(fire(&mut deadlines, &mut entries, &earliest, At(1_000 * MS)).is_empty());
        assert_eq!(deadlines.len(), 0);
        assert_eq!(deadlines.next_deadline(), None);
    }

    #[test]
    fn a_room_that_ends_in_the_nursery_leaves_no_entry() {
        let mut deadlines = Deadlines::default();
        let entry = deadlines.lower(At(MS), NO_ENTRY, 0, 0, At(10_000 * MS));
        assert_eq!(deadlines.sync(At(2 * MS), entry, 0, 0, None), NO_ENTRY);
        assert_eq!(deadlines.len(), 0);
    }
}
