//! Stuck-room warnings without scanning the rooms: one FIFO per `admin.stuck_room_warn_ms` age. A room
//! enters the first when the driver first sees it; every room of a FIFO waits the same age, so each is
//! in due order and a tick pops only what is due (work per room and age, never per live room per tick).
//! Never keeps a room alive or changes it: a popped room that ended, or was replaced, is skipped.
//! Lines are rationed (`admin.stuck_room_warn_lines_per_s`, a one-second burst): past the ration, the
//! rooms one tick finds at an age are counted in one summary line, so a mass of stuck rooms costs the
//! driver a few lines per tick, not thousands (each line is formatted and written on this thread).

use super::Driver;
use kvgate_core::{At, Role, RoomKey, Span};
use std::collections::VecDeque;

/// The per-age FIFOs of `(first_seen, room, role)`, and the ration of warning lines.
pub struct StuckQueues {
    ages_ms: Vec<u64>,
    queues: Vec<VecDeque<(At, RoomKey, Role)>>,
    lines: LineRation,
}

/// A token bucket of log lines: `per_s` lines a second, at most one second's worth saved up.
/// Tokens are counted in thousandths of a line so that every whole millisecond adds exactly.
struct LineRation {
    per_s: u64,
    milli_lines: u64,
    refilled_at: At,
}

impl LineRation {
    fn new(per_s: u64, now: At) -> LineRation {
        LineRation { per_s, milli_lines: per_s.saturating_mul(1000), refilled_at: now }
    }

    fn refill(&mut self, now: At) {
        let elapsed_ms = now.saturating_since(self.refilled_at).0 / 1_000_000;
        self.refilled_at = self.refilled_at.saturating_add(Span::from_ms(elapsed_ms));
        let full = self.per_s.saturating_mul(1000);
        self.milli_lines = self.milli_lines.saturating_add(elapsed_ms.saturating_mul(self.per_s)).min(full);
    }

    /// Takes one line if one is left.
    fn take(&mut self) -> bool {
        let left = self.milli_lines >= 1000;
        if left {
            self.milli_lines -= 1000;
        }
        left
    }
}

impl StuckQueues {
    pub fn new(ages_ms: &[u64], lines_per_s: u64, now: At) -> StuckQueues {
        StuckQueues {
            ages_ms: ages_ms.to_vec(),
            queues: ages_ms.iter().map(|_| VecDeque::new()).collect(),
            lines: LineRation::new(lines_per_s, now),
        }
    }

    /// A room the driver sees for the first time.
    pub fn track(&mut self, first_seen: At, room: RoomKey, role: Role) {
        if let Some(first) = self.queues.first_mut() {
            first.push_back((first_seen, room, role));
        }
    }

    /// Entries waiting in every FIFO (for tests).
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.queues.iter().map(VecDeque::len).sum()
    }

    fn pop_due(&mut self, level: usize, now: At) -> Option<(At, RoomKey, Role)> {
        let due = |first_seen: At| first_seen.saturating_add(Span::from_ms(self.ages_ms[level])) <= now;
        match self.queues[level].front() {
            Some(&(first_seen, _, _)) if due(first_seen) => self.queues[level].pop_front(),
            _ => None,
        }
    }
}

impl Driver {
    /// Warns once per age for every room still live at that age: by name while the line ration
    /// lasts, then in one summary line per age with the count of the rest; every such room is
    /// counted in `stuck_rooms_total{age_ms}` either way.
    pub(super) fn warn_stuck_rooms(&mut self) {
        let now = self.now();
        self.stuck.lines.refill(now);
        for level in 0..self.stuck.ages_ms.len() {
            let age_ms = self.stuck.ages_ms[level];
            let (mut found, mut unnamed) = (0u64, 0u64);
            while let Some((first_seen, room, role)) = self.stuck.pop_due(level, now) {
                // The room opened at `first_seen`, not a later one under the same key.
                let same_room = |age: Span| now.saturating_sub(age) == first_seen;
                let Some(view) = self.core.room(now, room, role).filter(|v| same_room(v.age) && !v.state.is_terminal())
                else {
                    continue;
                };
                found += 1;
                if self.stuck.lines.take() {
                    let peer = view.peer.and_then(|p| self.peers.name_of(p)).unwrap_or("-");
                    tracing::warn!(
                        room = %view.room, role = view.role.as_str(), state = view.state.as_str(), age_ms = view.age.as_ms(),
                        peer = %peer, last_event = ?view.last_event, "room still live at {age_ms} ms (admin.stuck_room_warn_ms)"
                    );
                } else {
                    unnamed += 1;
                }
                if let Some(next) = self.stuck.queues.get_mut(level + 1) {
                    next.push_back((first_seen, room, role));
                }
            }
            if found > 0 {
                self.metrics.count_stuck_rooms(age_ms, found);
            }
            if unnamed > 0 {
                tracing::warn!(
                    rooms = unnamed, age_ms, lines_per_s = self.stuck.lines.per_s,
                    "{unnamed} more rooms still live at {age_ms} ms, not named one by one (admin.stuck_room_warn_lines_per_s); \
                     the admin view lists every room"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_come_due_in_order_and_only_when_their_age_is_reached() {
        let mut q = StuckQueues::new(&[100, 1000], 100, At(0));
        for i in 0..3u64 {
            q.track(At::from_origin(Span::from_ms(i * 10)), RoomKey::new(i, 0), Role::Receiver);
        }
        assert_eq!(q.pop_due(0, At::from_origin(Span::from_ms(99))), None, "nothing is due before its age");
        assert_eq!(q.pop_due(0, At::from_origin(Span::from_ms(100))).map(|e| e.1), Some(RoomKey::new(0, 0)));
        assert_eq!(q.pop_due(0, At::from_origin(Span::from_ms(100))), None, "the next one is due at 110 ms");
        assert_eq!(q.pop_due(0, At::from_origin(Span::from_ms(200))).map(|e| e.1), Some(RoomKey::new(1, 0)));
        assert_eq!(q.len(), 1);
        let empty = StuckQueues::new(&[], 100, At(0));
        assert_eq!(empty.len(), 0);
    }

    fn lines_taken(ration: &mut LineRation) -> u64 {
        std::iter::from_fn(|| ration.take().then_some(())).count() as u64
    }

    #[test]
    fn the_line_ration_allows_one_second_of_lines_at_once_and_refills_by_the_millisecond() {
        let mut ration = LineRation::new(100, At(0));
        assert_eq!(lines_taken(&mut ration), 100, "a full second's worth at the start");
        ration.refill(At::from_origin(Span::from_ms(9)));
        assert_eq!(lines_taken(&mut ration), 0, "9 ms at 100/s is 0.9 of a line");
        ration.refill(At::from_origin(Span::from_ms(10)));
        assert_eq!(lines_taken(&mut ration), 1, "the tenth millisecond completes a line");
        ration.refill(At::from_origin(Span::from_ms(250)));
        assert_eq!(lines_taken(&mut ration), 24, "240 ms more at 100/s");
        ration.refill(At::from_origin(Span::from_ms(3_600_000)));
        assert_eq!(lines_taken(&mut ration), 100, "an idle hour saves up one second's worth, no more");
        ration.refill(At::from_origin(Span::from_ms(3_600_000)).saturating_add(Span(999_999)));
        assert_eq!(lines_taken(&mut ration), 0, "under a millisecond adds nothing yet");
    }

    #[test]
    fn the_line_ration_at_its_bounds() {
        let mut none = LineRation::new(0, At(0));
        none.refill(At::from_origin(Span::from_ms(10_000)));
        assert_eq!(lines_taken(&mut none), 0, "0 lines a second: every room goes to the summary line");
        let max = crate::config::MAX_STUCK_ROOM_WARN_LINES_PER_S;
        let mut most = LineRation::new(max, At(0));
        assert_eq!(lines_taken(&mut most), max);
        most.refill(At(u64::MAX));
        assert_eq!(lines_taken(&mut most), max, "no overflow at the largest rate and clock");
    }
}
