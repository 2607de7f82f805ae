//! The admin view of rooms (`RoomView`), built on demand from the room store's rooms and records.
//! Read-only: it never changes a room and costs nothing unless asked.

use super::room::Room;
use super::store::Held;
use super::Core;
use crate::api::*;
use crate::timer::TimerKind;
use kvgate_abi::XferId;

impl Core {
    fn view_of(&self, now: At, room: &Room) -> RoomView {
        let next_deadline = TimerKind::ALL.iter().filter_map(|&kind| room.timer(kind)).min();
        RoomView {
            room: room.key,
            role: room.role,
            state: room.state,
            age: now.saturating_since(room.created),
            peer: room.peer().map(|peer| peer.0),
            plugin: room.plugin(),
            last_event: room.last_event,
            last_event_age: now.saturating_since(room.last_event_at),
            next_deadline,
            parts: room.part_count(),
            parts_done: room.parts_done,
            bytes_total: room.bytes_total,
            bytes_done: room.bytes_done,
            failure: room.failure,
        }
    }

    /// The admin view of one room (ages computed at `now`).
    pub fn room(&self, now: At, room: RoomKey, role: Role) -> Option<RoomView> {
        self.rooms.find(room, role).map(|held| self.view_of_held(now, held))
    }

    fn view_of_held(&self, now: At, held: Held<'_>) -> RoomView {
        match held {
            Held::Room(room) => self.view_of(now, room),
            Held::Record(record) => record.view(now),
        }
    }

    /// The room, and its role, that a plugin transfer id belongs to: live, quarantined, or settled
    /// while its record is held. `None` for an id the core never issued or has forgotten. For the
    /// gateway's log of contract violations; a table lookup, nothing more.
    pub fn room_of_xfer(&self, xfer: XferId) -> Option<(RoomKey, Role)> {
        self.rooms.owner_of_transfer(xfer.0)
    }

    /// Every room the core holds: live and quarantined rooms in slab order, then tombstones
    /// oldest first.
    pub fn rooms(&self, now: At) -> impl Iterator<Item = RoomView> + '_ {
        self.rooms.iter().map(move |held| self.view_of_held(now, held))
    }
}
