//! The admin view of rooms (`RoomView`), built on demand from the slab and the tombstone records.
//! Read-only: it never changes a room and costs nothing unless asked.

use super::room::Room;
use super::tombstone::TOMBSTONE_KEY_BIT;
use super::Core;
use crate::api::*;
use crate::timer::TimerKind;
use kvgate_abi::XferId;

impl Core {
    fn view_of(&self, now: Nanos, room: &Room) -> RoomView {
        let next_deadline = TimerKind::ALL
            .iter()
            .filter_map(|&kind| room.timer(kind))
            .min();
        RoomView {
            room: room.key,
            role: room.role,
            state: room.state,
            age: now.saturating_sub(room.created),
            peer: room.peer().map(|peer| peer.0),
            plugin: room.plugin(),
            last_event: room.last_event,
            last_event_age: now.saturating_sub(room.last_event_at),
            next_deadline,
            parts: room.part_count(),
            parts_done: room.parts_done,
            bytes_total: room.bytes_total,
            bytes_done: room.bytes_done,
            failure: room.failure,
        }
    }

    /// The admin view of one room (ages computed at `now`).
    pub fn room(&self, now: Nanos, room: RoomKey, role: Role) -> Option<RoomView> {
        let value = self.key_value(room.room, role)?;
        if value & TOMBSTONE_KEY_BIT != 0 {
            let record = self.tombstone_at(self.held_tombstone_seq(value)?);
            return (record.key() == room).then(|| self.view_of_tombstone(now, record));
        }
        let held = self.slots[value as usize].room.as_ref()?;
        (held.key == room).then(|| self.view_of(now, held))
    }

    /// The room, and its role, that a plugin transfer id belongs to: live, quarantined, or settled
    /// while its record is held. `None` for an id the core never issued or has forgotten. For the
    /// gateway's log of contract violations; a table lookup, nothing more.
    pub fn room_of_xfer(&self, xfer: XferId) -> Option<(RoomKey, Role)> {
        let xref = self.xfers.get(xfer.0)?;
        if xref.slot == super::TOMBSTONE_SLOT {
            let record = self.tombstones.get(self.tombstone_index_of(xref.epoch))?;
            return Some((record.key(), record.role));
        }
        let room = self.slots.get(xref.slot as usize)?.room.as_ref()?;
        Some((room.key, room.role))
    }

    /// The latest transfer the core forced failed because its plugin stayed silent past the plugin
    /// grace (counted as a `plugin_silent` violation), with its room: `None` before the first.
    pub fn latest_silent_transfer(&self) -> Option<SilentTransfer> {
        self.latest_silent
    }

    /// Every room the core holds: live and quarantined rooms in slab order, then tombstones
    /// oldest first.
    pub fn rooms(&self, now: Nanos) -> impl Iterator<Item = RoomView> + '_ {
        let held = self.slots.iter().filter_map(move |slot| slot.room.as_ref().map(|room| self.view_of(now, room)));
        held.chain(self.tombstones.iter().map(move |record| self.view_of_tombstone(now, record)))
    }
}
