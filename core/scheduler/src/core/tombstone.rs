//! Settled rooms as compact tombstone records: when a room settles its slab slot and part lists are
//! freed at once, and a small record (key, outcome, what the admin view shows, its transfer ids and
//! tickets with their lifecycle states) takes its place in the room store's FIFO, evicted oldest
//! first by count and age. This module holds the record and how key-table values name records; it
//! never revives a room.

use super::room::{RoleData, Room};
use crate::api::*;
use crate::lifecycle::{TicketState, TransferState};
use crate::wheel::Wheel;
use kvgate_abi::PeerId;
use smallvec::SmallVec;

/// A key-table value with this bit set names a tombstone record (the low 30 bits: its sequence
/// number, truncated: at most `max_tombstones` < 2^30 records are held); without it, a slab slot.
pub(super) const TOMBSTONE_KEY_BIT: u32 = 1 << 31;
const TOMBSTONE_KEY_SEQ_MASK: u32 = (1 << 30) - 1;

/// The key-table value of the tombstone record with sequence number `seq`.
#[inline]
pub(super) fn tombstone_key_value(seq: u64) -> u32 {
    TOMBSTONE_KEY_BIT | (seq as u32 & TOMBSTONE_KEY_SEQ_MASK)
}

/// The place in the FIFO (from the front, at sequence number `front_seq`, `held` records) of the
/// record a key-table value with `TOMBSTONE_KEY_BIT` names, or None when that record was evicted
/// (the entry is stale: evicted records leave their key entries to the table's sweeps). Exact
/// because a stale entry is swept before 2^26 more evictions (`key_table::MAX_KEY_TABLE_SLOTS`)
/// and at most `max_tombstones` <= 2^24 records are held: the 30-bit distance of a stale value
/// from the front is at least 2^30 - 2^26, past every held record.
#[inline]
pub(super) fn held_tombstone_offset(value: u32, front_seq: u64, held: usize) -> Option<usize> {
    let offset = (value & TOMBSTONE_KEY_SEQ_MASK).wrapping_sub(front_seq as u32) & TOMBSTONE_KEY_SEQ_MASK;
    ((offset as usize) < held).then_some(offset as usize)
}

/// Whether a key-table value names a tombstone record no longer held.
#[inline]
pub(super) fn key_value_is_stale(value: u32, front_seq: u64, held: usize) -> bool {
    value & TOMBSTONE_KEY_BIT != 0 && held_tombstone_offset(value, front_seq, held).is_none()
}

/// One transfer id (sender) or ticket (receiver) of a settled room, with its lifecycle state (what
/// the lifecycle tables classify a late plugin event by).
#[derive(Clone, Copy, Debug)]
pub(crate) struct SettledId {
    pub id: u64,
    /// Sender: the chunk's bytes (checked by a late `SUCCEEDED`). Receiver: unused.
    pub bytes: u64,
    /// Sender: the transfer's state. Receiver: unused.
    pub state: TransferState,
    /// Receiver: the ticket's state. Sender: unused.
    pub ticket: TicketState,
    /// The plugin the transfer ran on, or the ticket was open on.
    pub plugin: PluginSlot,
}

/// A settled room as remembered until its tombstone expires or is evicted (its sequence number is
/// its place in the room store's FIFO plus the front's sequence number). Fields packed by hand (the key and the
/// peer split into plain words): at most 128 bytes, two cache lines.
#[derive(Clone, Debug)]
pub(crate) struct Tombstone {
    room_id: u64,
    generation: u32,
    pub role: Role,
    /// `Succeeded` or `Failed`.
    pub state: RoomState,
    pub last_event: LastEvent,
    /// The bound peer's id and plugin, meaningful when `has_peer`.
    peer_id: u64,
    plugin_slot: PluginSlot,
    has_peer: bool,
    pub created: At,
    pub last_event_at: At,
    /// When the tombstone expires (`tombstone_ttl_ms` after it settled, never before the one ahead).
    pub expiry: At,
    pub parts: u32,
    pub parts_done: u32,
    pub bytes_total: u64,
    pub bytes_done: u64,
    pub failure: Option<Failure>,
    /// Sender: every chunk's transfer id in part then chunk order. Receiver: every part's ticket.
    /// One inline (most rooms have one part of one chunk).
    pub ids: SmallVec<[SettledId; 1]>,
}

impl Tombstone {
    pub fn key(&self) -> RoomKey {
        RoomKey { room: self.room_id, generation: self.generation }
    }

    /// The peer the room was bound to.
    pub fn peer(&self) -> Option<PeerId> {
        self.has_peer.then_some(PeerId(self.peer_id))
    }

    fn plugin(&self) -> Option<PluginSlot> {
        self.has_peer.then_some(self.plugin_slot)
    }
}

impl Tombstone {
    /// The record of a settling room (terminal, its memory reusable), expiring at `expiry`.
    pub fn of_room(room: &Room, expiry: At) -> Tombstone {
        let mut ids = SmallVec::new();
        match &room.data {
            RoleData::Sender { parts, .. } => {
                for part in parts {
                    let plugin = part.plugin();
                    for chunk in &part.chunks {
                        ids.push(SettledId {
                            id: chunk.xfer,
                            bytes: chunk.bytes,
                            state: chunk.state,
                            ticket: TicketState::Closed,
                            plugin,
                        });
                    }
                }
            }
            RoleData::Receiver { ticket_base, parts, .. } => {
                for (index, part) in parts.iter().enumerate() {
                    let ticket = ticket_base + index as u64;
                    ids.push(SettledId {
                        id: ticket,
                        bytes: 0,
                        state: TransferState::Succeeded,
                        ticket: part.ticket,
                        plugin: part.plugin,
                    });
                }
            }
        }
        let peer = room.peer();
        Tombstone {
            room_id: room.key.room,
            generation: room.key.generation,
            role: room.role,
            state: room.state,
            last_event: room.last_event,
            peer_id: peer.map_or(0, |peer| peer.0),
            plugin_slot: room.plugin().unwrap_or(PluginSlot(0)),
            has_peer: peer.is_some(),
            created: room.created,
            last_event_at: room.last_event_at,
            expiry,
            parts: room.part_count(),
            parts_done: room.parts_done,
            bytes_total: room.bytes_total,
            bytes_done: room.bytes_done,
            failure: room.failure,
            ids,
        }
    }

    /// The record of a room that never existed here (an abort or a failure before the
    /// counterpart), remembered from `now` so its late counterpart is refused.
    pub fn remembered(
        key: RoomKey,
        role: Role,
        failure: Failure,
        last_event: LastEvent,
        now: At,
        expiry: At,
    ) -> Tombstone {
        Tombstone {
            room_id: key.room,
            generation: key.generation,
            role,
            state: RoomState::Failed,
            last_event,
            peer_id: 0,
            plugin_slot: PluginSlot(0),
            has_peer: false,
            created: now,
            last_event_at: now,
            expiry,
            parts: 0,
            parts_done: 0,
            bytes_total: 0,
            bytes_done: 0,
            failure: Some(failure),
            ids: SmallVec::new(),
        }
    }

    /// The admin view of the record (its next deadline is its expiry).
    pub fn view(&self, now: At) -> RoomView {
        RoomView {
            room: self.key(),
            role: self.role,
            state: self.state,
            age: now.saturating_since(self.created),
            peer: self.peer().map(|peer| peer.0),
            plugin: self.plugin(),
            last_event: self.last_event,
            last_event_age: now.saturating_since(self.last_event_at),
            next_deadline: Some(Wheel::fire_time(self.expiry)),
            parts: self.parts,
            parts_done: self.parts_done,
            bytes_total: self.bytes_total,
            bytes_done: self.bytes_done,
            failure: self.failure,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tombstone_record_is_smaller_than_the_slab_slot_it_frees() {
        let record = std::mem::size_of::<Tombstone>();
        let slot = std::mem::size_of::<super::super::room::Slot>();
        println!("tombstone record: {record} B, slab slot: {slot} B");
        assert!(record <= 128, "{record} B");
        assert!(record < slot);
    }

    /// Key-table values carry 30 bits of a record's sequence number: held records resolve across
    /// the 2^30 wrap, the record just evicted and one evicted 2^26 records ago (the most a sweep
    /// lets a stale entry age) read as stale, with the most records a core may hold (2^24).
    #[test]
    fn tombstone_key_values_resolve_across_the_30_bit_wrap_and_stale_ones_never_alias() {
        const MOST_HELD: usize = 1 << 24;
        assert!(crate::config::CoreConfig { max_tombstones: MOST_HELD as u64 + 1, ..Default::default() }
            .validate()
            .is_err());
        for front_seq in [0u64, (1 << 30) - 2, (1 << 30) - 2 + (1 << 40), u32::MAX as u64 + 7] {
            for offset in [0, 1, 2, MOST_HELD - 1] {
                let value = tombstone_key_value(front_seq + offset as u64);
                assert_eq!(held_tombstone_offset(value, front_seq, MOST_HELD), Some(offset), "front {front_seq}");
                assert!(!key_value_is_stale(value, front_seq, MOST_HELD));
            }
            for age in [1u64, 2, 1 << 26] {
                let Some(evicted) = front_seq.checked_sub(age) else { continue };
                let value = tombstone_key_value(evicted);
                assert_eq!(held_tombstone_offset(value, front_seq, MOST_HELD), None, "front {front_seq}, age {age}");
                assert!(key_value_is_stale(value, front_seq, MOST_HELD));
            }
            // A slab slot is never stale.
            assert!(!key_value_is_stale(7, front_seq, MOST_HELD));
        }
    }

    #[test]
    fn a_full_fifo_is_a_ring_of_exactly_max_tombstones_records() {
        for max_tombstones in [1u64, 3, 5, 100] {
            let config = crate::CoreConfig { max_tombstones, ..crate::CoreConfig::default() };
            let mut core = super::super::Core::new(config).unwrap();
            for n in 0..3 * max_tombstones {
                core.engine_abort(At::from_origin(Span::from_ms(1)), RoomKey::new(n, 0), Some(Role::Sender));
                assert_eq!(core.rooms.records() as u64, (n + 1).min(max_tombstones));
                assert!(
                    core.rooms.record_capacity() as u64 <= max_tombstones,
                    "capacity {}",
                    core.rooms.record_capacity()
                );
            }
            assert_eq!(core.metrics.tombstones_evicted, 2 * max_tombstones);
        }
    }
}
