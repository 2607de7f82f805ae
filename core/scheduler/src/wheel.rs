//! A hierarchical timing wheel: O(1) insert and cancel, amortised O(1) expiry, independent of how many
//! timers are armed. Ticks are 1 ms; a timer fires at the first tick boundary at or after its deadline.
//! It stores opaque `u64` payloads and never interprets them (the timer table does).

use crate::api::At;

/// Nanoseconds per wheel tick.
pub const TICK_NS: u64 = 1_000_000;
const SLOT_BITS: u32 = 6;
const SLOTS: usize = 1 << SLOT_BITS;
const LEVELS: usize = 6;
/// Ticks the wheel can hold ahead of `elapsed` (64^6 ms, about 2.2 years); farther deadlines clamp.
const MAX_TICKS: u64 = (1u64 << (SLOT_BITS as usize * LEVELS)) - 1;
const NIL: u32 = u32::MAX;
/// The extra bucket of due timers not yet popped.
const PENDING: usize = SLOTS * LEVELS;

/// A handle to an armed timer, valid until it fires or is cancelled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TimerHandle(u32);

impl TimerHandle {
    pub(crate) fn from_raw(raw: u32) -> TimerHandle {
        TimerHandle(raw)
    }
    pub(crate) fn raw(self) -> u32 {
        self.0
    }
}

#[derive(Clone, Copy)]
struct Entry {
    /// Tick at which the timer fires.
    when: u64,
    payload: u64,
    next: u32,
    prev: u32,
    /// `level * SLOTS + slot` while linked; NIL when free or expired.
    bucket: u32,
}

/// The wheel. `elapsed` is the last tick processed.
pub struct Wheel {
    entries: Vec<Entry>,
    free_head: u32,
    heads: Vec<u32>,
    occupied: [u64; LEVELS],
    elapsed: u64,
    len: usize,
    /// No timer is due before this tick (a lower bound kept by inserts; exact after a pop finds
    /// nothing due): `pop_expired` returns at once before it.
    quiet_until: u64,
}

impl Default for Wheel {
    fn default() -> Self {
        Wheel::new()
    }
}

fn level_for(elapsed: u64, when: u64) -> usize {
    let masked = (elapsed ^ when) | (SLOTS as u64 - 1);
    let masked = masked.min(MAX_TICKS);
    let significant = 63 - masked.leading_zeros() as usize;
    (significant / SLOT_BITS as usize).min(LEVELS - 1)
}

fn slot_for(when: u64, level: usize) -> usize {
    ((when >> (level as u32 * SLOT_BITS)) as usize) & (SLOTS - 1)
}

impl Wheel {
    pub fn new() -> Wheel {
        Wheel {
            entries: Vec::new(),
            free_head: NIL,
            heads: vec![NIL; SLOTS * LEVELS + 1],
            occupied: [0; LEVELS],
            elapsed: 0,
            len: 0,
            quiet_until: u64::MAX,
        }
    }

    /// Armed timers.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The tick a deadline fires at (ceiling).
    pub fn tick_of(deadline: At) -> u64 {
        deadline.0.div_ceil(TICK_NS)
    }

    /// When a timer with `deadline` fires: its tick boundary.
    pub fn fire_time(deadline: At) -> At {
        At(Wheel::tick_of(deadline).saturating_mul(TICK_NS))
    }

    /// The tick an armed timer fires at.
    pub fn tick(&self, handle: TimerHandle) -> u64 {
        self.entries[handle.0 as usize].when
    }

    /// Arm a timer for `deadline` carrying `payload`. A deadline already past fires at the next
    /// `expire` call.
    pub fn insert(&mut self, deadline: At, payload: u64) -> TimerHandle {
        let when = Wheel::tick_of(deadline).max(self.elapsed).min(self.elapsed.saturating_add(MAX_TICKS));
        let index = if self.free_head != NIL {
            let index = self.free_head;
            self.free_head = self.entries[index as usize].next;
            index
        } else {
            self.entries.push(Entry { when: 0, payload: 0, next: NIL, prev: NIL, bucket: NIL });
            (self.entries.len() - 1) as u32
        };
        self.entries[index as usize].when = when;
        self.entries[index as usize].payload = payload;
        self.link(index);
        self.len += 1;
        self.quiet_until = self.quiet_until.min(when);
        TimerHandle(index)
    }

    fn link(&mut self, index: u32) {
        let when = self.entries[index as usize].when;
        let level = level_for(self.elapsed, when);
        let slot = slot_for(when, level);
        self.link_into(index, level * SLOTS + slot);
    }

    /// Push an entry on a bucket's list (`PENDING`: due, waiting to be popped).
    fn link_into(&mut self, index: u32, bucket: usize) {
        let head = self.heads[bucket];
        {
            let entry = &mut self.entries[index as usize];
            entry.bucket = bucket as u32;
            entry.prev = NIL;
            entry.next = head;
        }
        if head != NIL {
            self.entries[head as usize].prev = index;
        }
        self.heads[bucket] = index;
        if bucket != PENDING {
            self.occupied[bucket / SLOTS] |= 1u64 << (bucket % SLOTS);
        } else {
            self.quiet_until = 0;
        }
    }

    fn unlink(&mut self, index: u32) {
        let Entry { next, prev, bucket, .. } = self.entries[index as usize];
        debug_assert!(bucket != NIL, "unlink of a timer that is not armed");
        if prev != NIL {
            self.entries[prev as usize].next = next;
        } else {
            self.heads[bucket as usize] = next;
            if next == NIL && bucket as usize != PENDING {
                let level = bucket as usize / SLOTS;
                let slot = bucket as usize % SLOTS;
                self.occupied[level] &= !(1u64 << slot);
            }
        }
        if next != NIL {
            self.entries[next as usize].prev = prev;
        }
        self.entries[index as usize].bucket = NIL;
    }

    fn release(&mut self, index: u32) {
        self.entries[index as usize].next = self.free_head;
        self.entries[index as usize].bucket = NIL;
        self.free_head = index;
        self.len -= 1;
    }

    /// Move an armed timer to `deadline` with a new payload, reusing its entry (same handle).
    pub fn rearm(&mut self, handle: TimerHandle, deadline: At, payload: u64) {
        let when = Wheel::tick_of(deadline).max(self.elapsed).min(self.elapsed.saturating_add(MAX_TICKS));
        self.unlink(handle.0);
        let entry = &mut self.entries[handle.0 as usize];
        entry.when = when;
        entry.payload = payload;
        self.link(handle.0);
        self.quiet_until = self.quiet_until.min(when);
    }

    /// Disarm a timer; returns its payload. The handle must be armed (a programmer error otherwise).
    pub fn cancel(&mut self, handle: TimerHandle) -> u64 {
        let payload = self.entries[handle.0 as usize].payload;
        self.unlink(handle.0);
        self.release(handle.0);
        payload
    }

    /// The deadline of an armed timer (its tick boundary).
    #[cfg(test)]
    pub fn deadline(&self, handle: TimerHandle) -> At {
        At(self.entries[handle.0 as usize].when.saturating_mul(TICK_NS))
    }

    /// `(level, slot, tick)` of the next occupied bucket in time order.
    fn next_bucket(&self) -> Option<(usize, usize, u64)> {
        for level in 0..LEVELS {
            let occupied = self.occupied[level];
            if occupied == 0 {
                continue;
            }
            let slot_range = 1u64 << (level as u32 * SLOT_BITS);
            let level_range = slot_range << SLOT_BITS;
            let now_slot = ((self.elapsed / slot_range) % SLOTS as u64) as u32;
            let rotated = occupied.rotate_right(now_slot);
            let slot = ((rotated.trailing_zeros() + now_slot) % SLOTS as u32) as u64;
            let level_start = self.elapsed & !(level_range - 1);
            let mut tick = level_start + slot * slot_range;
            if tick + slot_range <= self.elapsed {
                tick += level_range;
            }
            return Some((level, slot as usize, tick.max(self.elapsed)));
        }
        None
    }

    /// The earliest time `expire` may have something to do (a level>0 bucket's start is a lower
    /// bound: waking then cascades it).
    pub fn next_deadline(&self) -> Option<At> {
        if self.heads[PENDING] != NIL {
            return Some(At(self.elapsed.saturating_mul(TICK_NS)));
        }
        // `quiet_until` bounds every timer's tick from below too (and moves past a level boundary
        // whose cascade `pop_expired` skipped as not due).
        self.next_bucket().map(|(_, _, tick)| At(tick.max(self.quiet_until).saturating_mul(TICK_NS)))
    }

    /// Pop one timer due at `now` (its payload), or None when none is due. Timers are popped one
    /// at a time so that the caller may cancel or arm others between pops (a due timer not yet
    /// popped can still be cancelled).
    /// Whether a timer may be due at `now` (false: `pop_expired` would return None).
    #[inline]
    pub fn may_be_due(&self, now: At) -> bool {
        now.0 / TICK_NS >= self.quiet_until
    }

    #[inline]
    pub fn pop_expired(&mut self, now: At) -> Option<u64> {
        if now.0 / TICK_NS < self.quiet_until {
            // Nothing is due (a skipped cascade only moves timers that are not due yet).
            return None;
        }
        self.pop_expired_slow(now)
    }

    fn pop_expired_slow(&mut self, now: At) -> Option<u64> {
        let now_tick = now.0 / TICK_NS;
        loop {
            let head = self.heads[PENDING];
            if head != NIL {
                let payload = self.entries[head as usize].payload;
                self.unlink(head);
                self.release(head);
                return Some(payload);
            }
            match self.next_bucket() {
                Some((level, slot, tick)) if tick <= now_tick => {
                    self.elapsed = tick;
                    let bucket = level * SLOTS + slot;
                    let mut index = self.heads[bucket];
                    self.heads[bucket] = NIL;
                    self.occupied[level] &= !(1u64 << slot);
                    while index != NIL {
                        let next = self.entries[index as usize].next;
                        if self.entries[index as usize].when <= tick {
                            self.link_into(index, PENDING);
                        } else {
                            self.link(index);
                        }
                        index = next;
                    }
                }
                next => {
                    self.elapsed = self.elapsed.max(now_tick);
                    self.quiet_until = match next {
                        Some((_, _, tick)) => tick.max(now_tick + 1),
                        None => u64::MAX,
                    };
                    return None;
                }
            }
        }
    }

    /// Pop every timer due at `now` into `out` (for tests and callers that cancel nothing between).
    #[cfg(test)]
    pub fn expire(&mut self, now: At, out: &mut Vec<u64>) {
        while let Some(payload) = self.pop_expired(now) {
            out.push(payload);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    use crate::test_random as next_random;

    /// The wheel against a reference model (a sorted map): same timers fire at the same ticks,
    /// never early, and `next_deadline` is never later than the true next deadline.
    #[test]
    fn wheel_matches_reference_model() {
        let mut rng = 7u64;
        let mut wheel = Wheel::new();
        let mut model: BTreeMap<u64, u64> = BTreeMap::new(); // payload -> tick
        let mut handles: BTreeMap<u64, TimerHandle> = BTreeMap::new();
        let mut now = 0u64;
        let mut next_payload = 0u64;
        for _ in 0..200_000 {
            match next_random(&mut rng) % 10 {
                0..=4 => {
                    let spans = [10u64, 100, 5_000, 300_000, 20_000_000, 3_000_000_000];
                    let span = spans[(next_random(&mut rng) % spans.len() as u64) as usize];
                    let deadline = now * TICK_NS + next_random(&mut rng) % (span * TICK_NS);
                    let handle = wheel.insert(At(deadline), next_payload);
                    model.insert(next_payload, Wheel::tick_of(At(deadline)).max(now));
                    handles.insert(next_payload, handle);
                    next_payload += 1;
                }
                5 if !handles.is_empty() => {
                    let pick = next_random(&mut rng) % next_payload;
                    if let Some((&payload, &handle)) = handles.range(pick..).next() {
                        assert_eq!(wheel.cancel(handle), payload);
                        handles.remove(&payload);
                        model.remove(&payload);
                    }
                }
                _ => {
                    let true_next = model.values().min().copied();
                    if let (Some(bound), Some(truth)) = (wheel.next_deadline(), true_next) {
                        assert!(bound.0 <= truth * TICK_NS, "next_deadline {} after true {}", bound.0, truth);
                    }
                    assert_eq!(wheel.next_deadline().is_some(), true_next.is_some());
                    let step = [0u64, 1, 7, 64, 4096, 300_000][(next_random(&mut rng) % 6) as usize];
                    now += next_random(&mut rng) % (step + 1);
                    let mut fired = Vec::new();
                    wheel.expire(At(now * TICK_NS), &mut fired);
                    let mut expected: Vec<u64> =
                        model.iter().filter(|(_, &tick)| tick <= now).map(|(&p, _)| p).collect();
                    fired.sort_unstable();
                    expected.sort_unstable();
                    assert_eq!(fired, expected, "at tick {now}");
                    for payload in fired {
                        model.remove(&payload);
                        handles.remove(&payload);
                    }
                }
            }
            assert_eq!(wheel.len(), model.len());
        }
    }

    /// Two timers due together: cancelling the second after popping the first must be safe (the
    /// core cancels and re-arms timers of a room while handling another of its expiries).
    #[test]
    fn a_due_timer_not_yet_popped_can_be_cancelled() {
        let mut wheel = Wheel::new();
        let first = wheel.insert(At(5_000_000), 1);
        let second = wheel.insert(At(5_000_000), 2);
        let popped = wheel.pop_expired(At(6_000_000)).unwrap();
        let other = if popped == 1 { second } else { first };
        wheel.cancel(other);
        let again = wheel.insert(At(7_000_000), 3);
        assert_eq!(wheel.pop_expired(At(6_000_000)), None);
        assert_eq!(wheel.len(), 1);
        assert_eq!(wheel.deadline(again), At(7_000_000));
        assert_eq!(wheel.pop_expired(At(7_000_000)), Some(3));
        assert_eq!(wheel.len(), 0);
    }

    #[test]
    fn deadline_fires_at_its_tick_boundary_not_before() {
        let mut wheel = Wheel::new();
        wheel.insert(At(1_500_000), 1);
        let mut out = Vec::new();
        wheel.expire(At(1_999_999), &mut out);
        assert!(out.is_empty());
        assert_eq!(wheel.next_deadline(), Some(At(2_000_000)));
        wheel.expire(At(2_000_000), &mut out);
        assert_eq!(out, vec![1]);
    }
}
