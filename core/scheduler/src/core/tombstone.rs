//! Settled rooms as compact tombstone records: when a room settles its slab slot and part lists are
//! freed at once, and a small record (key, outcome, what the admin view shows, its transfer ids and
//! tickets) joins a FIFO, evicted oldest first by count and age. It never revives a room.

use super::room::{RoleData, NIL};
use crate::lifecycle::{TicketState, TransferState};
use super::{Core, TicketRef, XferRef};
use crate::api::*;
use crate::wheel::Wheel;
use kvgate_abi::PeerId;
use smallvec::SmallVec;

/// The `slot` of a transfer or ticket reference that names a tombstone record (its `epoch` is then
/// the record's sequence number, truncated: at most `max_tombstones` < 2^32 records are held).
pub(super) const TOMBSTONE_SLOT: u32 = NIL;

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
/// its place in the FIFO plus `Core::tombstone_front_seq`). Fields packed by hand (the key and the
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
    pub created: Nanos,
    pub last_event_at: Nanos,
    /// When the tombstone expires (`tombstone_ttl_ms` after it settled, never before the one ahead).
    pub expiry: Nanos,
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

impl Core {
    /// The record with sequence number `seq` (held: the key table and the id tables name only
    /// held records).
    #[inline]
    pub(super) fn tombstone_at(&self, seq: u64) -> &Tombstone {
        &self.tombstones[(seq - self.tombstone_front_seq) as usize]
    }

    /// The sequence number of the record a key-table value (`TOMBSTONE_KEY_BIT` set) names, if it
    /// is still held (None: a stale entry).
    #[inline]
    pub(super) fn held_tombstone_seq(&self, value: u32) -> Option<u64> {
        let offset = held_tombstone_offset(value, self.tombstone_front_seq, self.tombstones.len())?;
        Some(self.tombstone_front_seq + offset as u64)
    }

    /// Drop the stale entries of `role`'s key table (records evicted since its last sweep).
    #[cold]
    fn sweep_keys(&mut self, role: Role) {
        let (front_seq, held) = (self.tombstone_front_seq, self.tombstones.len());
        self.keys[role as usize].sweep(|value| key_value_is_stale(value, front_seq, held));
    }

    /// The record a transfer or ticket reference names by its truncated sequence number.
    #[inline]
    pub(super) fn tombstone_index_of(&self, seq32: u32) -> usize {
        let index = seq32.wrapping_sub(self.tombstone_front_seq as u32) as usize;
        debug_assert!(index < self.tombstones.len(), "ids name only held tombstones");
        index
    }

    /// A terminal room whose memory is reusable: remember it as a tombstone record, bounded in
    /// time and count, and free its slot and part lists now. Its expiry is one constant ttl away
    /// (settle order is expiry order; a clock that steps back never puts an expiry before the one
    /// ahead of it).
    pub(super) fn settle(&mut self, now: Nanos, slot: u32) {
        let mut expiry = now.saturating_add(Nanos::from_ms(self.config.tombstone_ttl_ms));
        if let Some(last) = self.tombstones.back() {
            expiry = expiry.max(last.expiry);
        }
        let seq = self.tombstone_front_seq + self.tombstones.len() as u64;
        let entry = &mut self.slots[slot as usize];
        let epoch = entry.epoch;
        let room = entry.room.as_mut().expect("live slot");
        // Nothing is armed once settled: the room's deadline entry (if any) is released.
        debug_assert_eq!(room.earliest_wheel_deadline(), None);
        debug_assert!(!room.in_peer_list, "a settled room is unlinked from its peer first");
        debug_assert!(matches!(room.state, RoomState::Succeeded | RoomState::Failed));
        room.wheel_entry = self.deadlines.sync(now, room.wheel_entry, slot, epoch, None);
        room.armed = 0;
        let mut ids = SmallVec::new();
        let mut dropped_held = 0u64;
        match &room.data {
            RoleData::Sender { parts, .. } => {
                for part in parts {
                    dropped_held += part.held.len() as u64;
                    for chunk in &part.chunks {
                        let index = ids.len() as u32;
                        let plugin = part.plugin();
                        ids.push(SettledId { id: chunk.xfer, bytes: chunk.bytes, state: chunk.state, ticket: TicketState::Closed, plugin });
                        let xref = XferRef { slot: TOMBSTONE_SLOT, epoch: seq as u32, part: index, chunk: 0, plugin };
                        self.xfers.replace(chunk.xfer, xref);
                    }
                }
            }
            RoleData::Receiver { ticket_base, parts, .. } => {
                for (index, part) in parts.iter().enumerate() {
                    let ticket = ticket_base + index as u64;
                    ids.push(SettledId { id: ticket, bytes: 0, state: TransferState::Succeeded, ticket: part.ticket, plugin: part.plugin });
                    self.tickets.replace(ticket, TicketRef { slot: TOMBSTONE_SLOT, epoch: seq as u32, part: index as u32 });
                }
            }
        }
        let peer = room.peer();
        let record = Tombstone {
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
        };
        self.metrics.pending_sends -= dropped_held;
        let spare = match &mut room.data {
            RoleData::Sender { parts, .. } => Some(std::mem::take(parts)),
            RoleData::Receiver { .. } => None,
        };
        entry.room = None;
        entry.epoch = entry.epoch.wrapping_add(1);
        if let Some(parts) = spare {
            self.recycle_send_parts(parts);
        }
        self.free_slots.push(slot);
        // The oldest leaves before the new one joins (the same records go): a full FIFO is a ring
        // of exactly `max_tombstones` records, so the new record is written where the evicted one
        // was just read, in cache.
        while self.metrics.tombstones >= self.config.max_tombstones {
            self.metrics.tombstones_evicted += 1;
            self.drop_oldest_tombstone();
        }
        self.reserve_tombstone();
        let (role, room_id) = (record.role, record.room_id);
        self.tombstones.push_back(record);
        self.metrics.tombstones += 1;
        // The room's key entry now names the record (unless a newer generation took the key over);
        // only once the record is held, so a sweep during the evictions above never finds its
        // value stale.
        let keys = &mut self.keys[role as usize];
        let hash = keys.hash(room_id);
        if let Some(index) = keys.find_value(hash, slot) {
            keys.set_value_at(index, tombstone_key_value(seq));
        }
    }

    /// Room for one more record: the FIFO grows by doubling, but never past `max_tombstones`.
    #[inline]
    fn reserve_tombstone(&mut self) {
        let (len, capacity) = (self.tombstones.len(), self.tombstones.capacity());
        if len == capacity {
            let limit = usize::try_from(self.config.max_tombstones).unwrap_or(usize::MAX);
            let target = (2 * capacity).max(4).min(limit).max(len + 1);
            self.tombstones.reserve_exact(target - len);
        }
    }

    /// Forget the oldest tombstone entirely (expired or evicted): its key, transfer ids, tickets.
    pub(super) fn drop_oldest_tombstone(&mut self) {
        // The record is read in place (not moved out of the ring: it is two cache lines).
        let Some(record) = self.tombstones.front() else { return };
        let state = record.state;
        match record.role {
            Role::Sender => {
                for settled in &record.ids {
                    self.xfers.remove(settled.id);
                }
            }
            Role::Receiver => {
                for settled in &record.ids {
                    self.tickets.remove(settled.id);
                }
            }
        }
        self.tombstones.pop_front();
        self.tombstone_front_seq += 1;
        // Its key entry (unless a newer generation took the key over) is stale from now on, left
        // where it is for a sweep: no random read of the key table per eviction. A sweep is due in
        // a table after a quarter of its slots in evictions of either role (the sequence numbers
        // are shared), so every stale entry goes while its value still reads as stale.
        for role in Role::ALL {
            if self.keys[role as usize].note_eviction() {
                self.sweep_keys(role);
            }
        }
        self.metrics.rooms_by_state[state.index()] -= 1;
        self.metrics.tombstones -= 1;
    }

    /// The admin view of a tombstone (its next deadline is its expiry).
    pub(super) fn view_of_tombstone(&self, now: Nanos, record: &Tombstone) -> RoomView {
        RoomView {
            room: record.key(),
            role: record.role,
            state: record.state,
            age: now.saturating_sub(record.created),
            peer: record.peer().map(|peer| peer.0),
            plugin: record.plugin(),
            last_event: record.last_event,
            last_event_age: now.saturating_sub(record.last_event_at),
            next_deadline: Some(Wheel::fire_time(record.expiry)),
            parts: record.parts,
            parts_done: record.parts_done,
            bytes_total: record.bytes_total,
            bytes_done: record.bytes_done,
            failure: record.failure,
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
        assert!(crate::config::CoreConfig { max_tombstones: MOST_HELD as u64 + 1, ..Default::default() }.validate().is_err());
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
            let mut core = Core::new(config).unwrap();
            for n in 0..3 * max_tombstones {
                core.engine_abort(Nanos::from_ms(1), RoomKey::new(n, 0), Some(Role::Sender));
                assert_eq!(core.tombstones.len() as u64, (n + 1).min(max_tombstones));
                assert!(core.tombstones.capacity() as u64 <= max_tombstones, "capacity {}", core.tombstones.capacity());
            }
            assert_eq!(core.metrics.tombstones_evicted, 2 * max_tombstones);
        }
    }
}
