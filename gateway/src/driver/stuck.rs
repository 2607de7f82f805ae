//! Stuck-room warnings without scanning the rooms: one FIFO per `admin.stuck_room_warn_ms` age. A room
//! enters the first when the driver first sees it; every room of a FIFO waits the same age, so each is
//! in due order and a tick pops only what is due (work per room and age, never per live room per tick).
//! Never keeps a room alive or changes it: a popped room that ended, or was replaced, is skipped.

use super::Driver;
use kvgate_core::{Nanos, Role, RoomKey};
use std::collections::VecDeque;

/// The per-age FIFOs of `(first_seen, room, role)`.
pub struct StuckQueues {
    ages_ms: Vec<u64>,
    queues: Vec<VecDeque<(Nanos, RoomKey, Role)>>,
}

impl StuckQueues {
    pub fn new(ages_ms: &[u64]) -> StuckQueues {
        StuckQueues { ages_ms: ages_ms.to_vec(), queues: ages_ms.iter().map(|_| VecDeque::new()).collect() }
    }

    /// A room the driver sees for the first time.
    pub fn track(&mut self, first_seen: Nanos, room: RoomKey, role: Role) {
        if let Some(first) = self.queues.first_mut() {
            first.push_back((first_seen, room, role));
        }
    }

    /// Entries waiting in every FIFO (for tests).
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.queues.iter().map(VecDeque::len).sum()
    }

    fn pop_due(&mut self, level: usize, now: Nanos) -> Option<(Nanos, RoomKey, Role)> {
        let due = |first_seen: Nanos| first_seen.saturating_add(Nanos::from_ms(self.ages_ms[level])) <= now;
        match self.queues[level].front() {
            Some(&(first_seen, _, _)) if due(first_seen) => self.queues[level].pop_front(),
            _ => None,
        }
    }
}

impl Driver {
    /// Warns once per age for every room still live at that age.
    pub(super) fn warn_stuck_rooms(&mut self) {
        let now = self.now();
        for level in 0..self.stuck.ages_ms.len() {
            while let Some((first_seen, room, role)) = self.stuck.pop_due(level, now) {
                let same_room = self.room_clock.get(&(room, role)).is_some_and(|c| c.first_seen == first_seen);
                let Some(view) = self.core.room(now, room, role).filter(|v| same_room && !v.state.is_terminal()) else { continue };
                tracing::warn!(
                    room = %view.room, role = view.role.as_str(), state = view.state.as_str(), age_ms = view.age.as_ms(),
                    peer = ?view.peer, last_event = ?view.last_event, "room still live at {} ms (admin.stuck_room_warn_ms)",
                    self.stuck.ages_ms[level]
                );
                if let Some(next) = self.stuck.queues.get_mut(level + 1) {
                    next.push_back((first_seen, room, role));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_come_due_in_order_and_only_when_their_age_is_reached() {
        let mut q = StuckQueues::new(&[100, 1000]);
        for i in 0..3u64 {
            q.track(Nanos::from_ms(i * 10), RoomKey::new(i, 0), Role::Receiver);
        }
        assert_eq!(q.pop_due(0, Nanos::from_ms(99)), None, "nothing is due before its age");
        assert_eq!(q.pop_due(0, Nanos::from_ms(100)).map(|e| e.1), Some(RoomKey::new(0, 0)));
        assert_eq!(q.pop_due(0, Nanos::from_ms(100)), None, "the next one is due at 110 ms");
        assert_eq!(q.pop_due(0, Nanos::from_ms(200)).map(|e| e.1), Some(RoomKey::new(1, 0)));
        assert_eq!(q.len(), 1);
        let empty = StuckQueues::new(&[]);
        assert_eq!(empty.len(), 0);
    }
}
