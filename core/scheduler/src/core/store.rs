//! The room store: every room this core holds, behind one seam. A room lives in a slab slot (its
//! epoch changes on every reuse) while live or quarantined, and as a compact tombstone record in a
//! FIFO once settled; a room key finds either (`key_table`), a transfer id or ticket finds its chunk
//! or part (`id_table`). The store opens rooms, finds them by key or id, moves their state (keeping
//! the per-state gauges), settles them into records and expires records. It decides nothing about
//! the protocol: the handlers do, and never reach the slab, the key table, the records or the id
//! tables themselves.

use super::id_table::SequentialIdTable;
use super::key_table::KeyTable;
use super::room::{Room, Slot, NIL};
use super::tombstone::{held_tombstone_offset, key_value_is_stale, tombstone_key_value, Tombstone, TOMBSTONE_KEY_BIT};
use crate::api::*;
use crate::metrics::Metrics;
use crate::table::{transition_by_table, IllegalTransition, RoomInput};
use crate::wheel::Wheel;
use std::collections::VecDeque;

/// The `slot` of a transfer or ticket reference that names a tombstone record (its `epoch` is then
/// the record's sequence number, truncated: at most `max_tombstones` < 2^32 records are held).
pub(super) const TOMBSTONE_SLOT: u32 = NIL;

/// Where an outgoing transfer id points: a room's chunk, or (`slot == TOMBSTONE_SLOT`) entry `part`
/// of the tombstone record whose truncated sequence number is `epoch`.
#[derive(Clone, Copy)]
pub(super) struct XferRef {
    pub slot: u32,
    pub epoch: u32,
    pub part: u32,
    pub chunk: u32,
    pub plugin: PluginSlot,
}

/// Where an incoming ticket points: a room's part, or (`slot == TOMBSTONE_SLOT`) entry `part` of
/// the tombstone record whose truncated sequence number is `epoch`.
#[derive(Clone, Copy)]
pub(super) struct TicketRef {
    pub slot: u32,
    pub epoch: u32,
    pub part: u32,
}

/// What the store holds for a room key.
pub(super) enum Lookup {
    /// No room with this id and role.
    Absent,
    /// The room of exactly this generation, in the slab (live or quarantined).
    Same(u32),
    /// The room of exactly this generation, settled: its tombstone record's sequence number.
    Settled(u64),
    /// A room of a lower generation (to be superseded or replaced): its slot, NIL when settled.
    Older(u32),
    /// A room of a higher generation: the key is stale.
    Newer,
}

/// What a held room or tombstone of generation `held` is to a request for generation `wanted` of
/// the same id: `same`, `older` (to be superseded or replaced), or newer (the request is stale).
#[inline(always)]
fn by_generation(held: u32, wanted: u32, same: Lookup, older: Lookup) -> Lookup {
    if held == wanted {
        same
    } else if held < wanted {
        older
    } else {
        Lookup::Newer
    }
}

/// Whether the age of the oldest room in `state` is kept (`Metrics::oldest_entered_by_state`): every
/// live state, and quarantine (terminal, but memory still held: a quarantine that lasts must show).
#[inline]
fn aged(state: RoomState) -> bool {
    !state.is_terminal() || state == RoomState::Quarantined
}

/// A room the store holds, as an admin view reads it.
pub(super) enum Held<'a> {
    Room(&'a Room),
    Record(&'a Tombstone),
}

/// A state change the store made: the engine hears of it unless the new state is terminal.
pub(super) struct Moved {
    pub key: RoomKey,
    pub role: Role,
    pub from: RoomState,
    pub to: RoomState,
}

pub(super) struct RoomStore {
    slots: Vec<Slot>,
    free_slots: Vec<u32>,
    /// Room id -> slot, or tombstone record (`tombstone_key_value(seq)`), one table per role
    /// (indexed by `role as usize`): an 8-byte key hashes faster than `(id, role)`. Keyed hash: room
    /// ids may come from peers. The ids live in the rooms and records (`key_value_room_id`).
    keys: [KeyTable; 2],
    /// Transfer id -> chunk, ticket -> part: both issued in increasing order.
    xfers: SequentialIdTable<XferRef>,
    tickets: SequentialIdTable<TicketRef>,
    next_xfer: u64,
    next_ticket: u64,
    /// Rooms that are not terminal.
    live: u64,
    /// Settled rooms as compact records in settle order: every tombstone lives
    /// `tombstone_ttl_ms`, so this is expiry order too; the oldest is evicted first. Their slab
    /// slots are free.
    tombstones: VecDeque<Tombstone>,
    /// The sequence number of `tombstones`' front record (record `seq` is at `seq - front`).
    front_seq: u64,
    /// Per aged state, the rooms in the order they entered it (slot, epoch, when): stale entries
    /// are dropped from the front, the front gives `Metrics::oldest_entered_by_state`.
    state_fifos: [VecDeque<(u32, u32, At)>; RoomState::COUNT],
}

impl RoomStore {
    pub fn new() -> RoomStore {
        RoomStore {
            slots: Vec::new(),
            free_slots: Vec::new(),
            keys: [KeyTable::new(), KeyTable::new()],
            xfers: SequentialIdTable::default(),
            tickets: SequentialIdTable::default(),
            next_xfer: 1,
            next_ticket: 1,
            live: 0,
            tombstones: VecDeque::new(),
            front_seq: 0,
            state_fifos: Default::default(),
        }
    }

    // ----- rooms in the slab -----

    #[inline]
    pub fn get(&self, slot: u32) -> &Room {
        self.slots[slot as usize].room.as_ref().expect("live slot")
    }

    #[inline]
    pub fn get_mut(&mut self, slot: u32) -> &mut Room {
        self.slots[slot as usize].room.as_mut().expect("live slot")
    }

    /// The room in `slot`, if the slot holds one (it may have settled while an input was handled).
    #[inline]
    pub fn try_get(&self, slot: u32) -> Option<&Room> {
        self.slots[slot as usize].room.as_ref()
    }

    /// The room in `slot` with the slot's epoch.
    #[inline]
    pub fn get_with_epoch(&mut self, slot: u32) -> (u32, &mut Room) {
        let entry = &mut self.slots[slot as usize];
        (entry.epoch, entry.room.as_mut().expect("live slot"))
    }

    #[inline]
    pub fn epoch(&self, slot: u32) -> u32 {
        self.slots[slot as usize].epoch
    }

    /// Whether `slot` holds a room and is at `epoch`.
    #[inline]
    pub fn holds(&self, slot: u32, epoch: u32) -> bool {
        let entry = &self.slots[slot as usize];
        entry.epoch == epoch && entry.room.is_some()
    }

    /// Rooms that are not terminal.
    #[inline]
    pub fn live(&self) -> u64 {
        self.live
    }

    /// Rooms held: in the slab (live and quarantined) plus tombstone records.
    pub fn held(&self) -> usize {
        self.slots.len() - self.free_slots.len() + self.tombstones.len()
    }

    // ----- finding by key -----

    /// Whether a key-table value names the held room or tombstone record of room id `id` (a stale
    /// value names nothing).
    #[inline]
    fn key_value_names(&self, value: u32, id: u64) -> bool {
        if value & TOMBSTONE_KEY_BIT != 0 {
            self.held_record_seq(value).is_some_and(|seq| self.record(seq).key().room == id)
        } else {
            self.get(value).key.room == id
        }
    }

    /// The key-table value held for room id `id` in `role`'s table, if any (never a stale one).
    #[inline]
    fn key_value(&self, id: u64, role: Role) -> Option<u32> {
        let keys = &self.keys[role as usize];
        let index = keys.find(keys.hash(id), |value| self.key_value_names(value, id))?;
        Some(keys.value_at(index))
    }

    #[inline]
    pub fn lookup(&self, key: RoomKey, role: Role) -> Lookup {
        match self.key_value(key.room, role) {
            None => Lookup::Absent,
            Some(value) if value & TOMBSTONE_KEY_BIT != 0 => {
                let seq = self.held_record_seq(value).expect("key_value returns held values");
                by_generation(
                    self.record(seq).key().generation,
                    key.generation,
                    Lookup::Settled(seq),
                    Lookup::Older(NIL),
                )
            }
            Some(slot) => {
                by_generation(self.get(slot).key.generation, key.generation, Lookup::Same(slot), Lookup::Older(slot))
            }
        }
    }

    /// The room or record held for room id `room.room` in `role`, if it is of exactly `room`'s
    /// generation.
    pub fn find(&self, room: RoomKey, role: Role) -> Option<Held<'_>> {
        let value = self.key_value(room.room, role)?;
        if value & TOMBSTONE_KEY_BIT != 0 {
            let record = self.record(self.held_record_seq(value)?);
            return (record.key() == room).then_some(Held::Record(record));
        }
        let held = self.slots[value as usize].room.as_ref()?;
        (held.key == room).then_some(Held::Room(held))
    }

    /// Every room held: live and quarantined rooms in slab order, then records oldest first.
    pub fn iter(&self) -> impl Iterator<Item = Held<'_>> + '_ {
        let rooms = self.slots.iter().filter_map(|slot| slot.room.as_ref().map(Held::Room));
        rooms.chain(self.tombstones.iter().map(Held::Record))
    }

    // ----- opening and moving rooms -----

    /// Put a new room, built by `build`, in the slab and the key table (replacing an older
    /// generation's entry), and count it. The slot is claimed first so the room is built in place,
    /// not copied.
    #[inline(always)]
    pub fn open(&mut self, build: impl FnOnce() -> Room, metrics: &mut Metrics) -> u32 {
        let slot = match self.free_slots.pop() {
            Some(slot) => {
                let entry = &mut self.slots[slot as usize];
                entry.epoch = entry.epoch.wrapping_add(1);
                slot
            }
            None => {
                self.slots.push(Slot { epoch: 0, room: None });
                (self.slots.len() - 1) as u32
            }
        };
        let room = self.slots[slot as usize].room.insert(build());
        let (key, role) = (room.key.room, room.role);
        let state = room.state;
        let entered = room.state_entered;
        // The key's entry (an older generation's, if any) now names the new room.
        assert!(slot < TOMBSTONE_KEY_BIT, "slab slots stay below 2^31");
        self.point_key(key, role, slot);
        metrics.rooms_created += 1;
        metrics.rooms_by_state[state.index()] += 1;
        if !state.is_terminal() {
            self.live += 1;
            self.push_state_fifo(slot, state, entered, metrics);
        }
        slot
    }

    /// Make room id `id`'s entry in `role`'s table name `value` (an older generation's entry, if
    /// held, is taken over).
    #[inline(always)]
    fn point_key(&mut self, id: u64, role: Role, value: u32) {
        let hash = self.keys[role as usize].hash(id);
        let held = self.keys[role as usize].find(hash, |held| self.key_value_names(held, id));
        let (front_seq, records) = (self.front_seq, self.tombstones.len());
        match held {
            Some(index) => self.keys[role as usize].set_value_at(index, value),
            None => {
                self.keys[role as usize].insert_new(hash, value, |held| key_value_is_stale(held, front_seq, records))
            }
        }
    }

    fn push_state_fifo(&mut self, slot: u32, state: RoomState, entered: At, metrics: &mut Metrics) {
        let epoch = self.epoch(slot);
        let fifo = &mut self.state_fifos[state.index()];
        if fifo.is_empty() {
            metrics.oldest_entered_by_state[state.index()] = Some(entered);
        }
        fifo.push_back((slot, epoch, entered));
    }

    /// Drop stale heads of a state's FIFO and refresh its oldest-entered gauge.
    fn refresh_state_fifo(&mut self, state: RoomState, metrics: &mut Metrics) {
        let fifo = &mut self.state_fifos[state.index()];
        while let Some(&(slot, epoch, entered)) = fifo.front() {
            let slot_entry = &self.slots[slot as usize];
            let current = slot_entry.epoch == epoch
                && slot_entry.room.as_ref().is_some_and(|r| r.state == state && r.state_entered == entered);
            if current {
                break;
            }
            fifo.pop_front();
        }
        metrics.oldest_entered_by_state[state.index()] = fifo.front().map(|&(_, _, entered)| entered);
    }

    /// Move the room through the transition table on `input`, keeping the per-state gauges and the
    /// live count. Returns the change, None when the state stays.
    pub fn transition(
        &mut self,
        now: At,
        slot: u32,
        input: RoomInput,
        metrics: &mut Metrics,
    ) -> Result<Option<Moved>, IllegalTransition> {
        let entry = &mut self.slots[slot as usize];
        let epoch = entry.epoch;
        let room = entry.room.as_mut().expect("live slot");
        let from = room.state;
        let to = transition_by_table(from, input)?;
        if to == from {
            return Ok(None);
        }
        room.state = to;
        room.state_entered = now;
        let (key, role) = (room.key, room.role);
        metrics.rooms_by_state[from.index()] -= 1;
        metrics.rooms_by_state[to.index()] += 1;
        if aged(from) {
            // The room leaving is most often its state's oldest: its entry is the front, dropped
            // without reading the slot again.
            let fifo = &mut self.state_fifos[from.index()];
            if fifo.front().is_some_and(|&(front, front_epoch, _)| front == slot && front_epoch == epoch) {
                fifo.pop_front();
            }
            self.refresh_state_fifo(from, metrics);
        }
        if !from.is_terminal() && to.is_terminal() {
            self.live -= 1;
        }
        if aged(to) {
            let fifo = &mut self.state_fifos[to.index()];
            if fifo.is_empty() {
                metrics.oldest_entered_by_state[to.index()] = Some(now);
            }
            fifo.push_back((slot, epoch, now));
        }
        Ok(Some(Moved { key, role, from, to }))
    }

    // ----- transfer ids and tickets -----

    /// Issue the next transfer id, pointing at `xref`.
    #[inline]
    pub fn issue_transfer(&mut self, xref: XferRef) -> u64 {
        let xfer = self.next_xfer;
        self.next_xfer += 1;
        self.xfers.insert(xfer, xref);
        xfer
    }

    /// Reserve `count` consecutive tickets; returns the first (each is pointed at its part with
    /// `bind_ticket`).
    #[inline]
    pub fn reserve_tickets(&mut self, count: u64) -> u64 {
        let base = self.next_ticket;
        self.next_ticket += count;
        base
    }

    #[inline]
    pub fn bind_ticket(&mut self, ticket: u64, tref: TicketRef) {
        self.tickets.insert(ticket, tref);
    }

    #[inline]
    pub fn transfer(&self, xfer: u64) -> Option<XferRef> {
        self.xfers.get(xfer)
    }

    #[inline]
    pub fn ticket(&self, ticket: u64) -> Option<TicketRef> {
        self.tickets.get(ticket)
    }

    /// Whether `xfer` was issued (and is forgotten if `transfer` finds nothing: a late id).
    #[inline]
    pub fn transfer_issued(&self, xfer: u64) -> bool {
        xfer != 0 && xfer < self.next_xfer
    }

    /// Whether `ticket` was issued (and is forgotten if `ticket` finds nothing: a late id).
    #[inline]
    pub fn ticket_issued(&self, ticket: u64) -> bool {
        ticket != 0 && ticket < self.next_ticket
    }

    /// The room, and its role, that a transfer id belongs to: live, quarantined, or settled while
    /// its record is held.
    pub fn owner_of_transfer(&self, xfer: u64) -> Option<(RoomKey, Role)> {
        let xref = self.xfers.get(xfer)?;
        if xref.slot == TOMBSTONE_SLOT {
            let record = self.tombstones.get(self.record_index(xref.epoch))?;
            return Some((record.key(), record.role));
        }
        let room = self.slots.get(xref.slot as usize)?.room.as_ref()?;
        Some((room.key, room.role))
    }

    /// The room, and its role, that a ticket belongs to: live, quarantined, or settled while its
    /// record is held.
    pub fn owner_of_ticket(&self, ticket: u64) -> Option<(RoomKey, Role)> {
        let tref = self.tickets.get(ticket)?;
        if tref.slot == TOMBSTONE_SLOT {
            let record = self.tombstones.get(self.record_index(tref.epoch))?;
            return Some((record.key(), record.role));
        }
        let room = self.slots.get(tref.slot as usize)?.room.as_ref()?;
        Some((room.key, room.role))
    }

    // ----- settled rooms -----

    /// The record with sequence number `seq` (held: the key table and the id tables name only
    /// held records).
    #[inline]
    pub fn record(&self, seq: u64) -> &Tombstone {
        &self.tombstones[(seq - self.front_seq) as usize]
    }

    /// The record at place `index` of the FIFO (`record_index`).
    #[inline]
    pub fn record_at(&self, index: usize) -> &Tombstone {
        &self.tombstones[index]
    }

    #[inline]
    pub fn record_at_mut(&mut self, index: usize) -> &mut Tombstone {
        &mut self.tombstones[index]
    }

    /// The place in the FIFO of the record a transfer or ticket reference names by its truncated
    /// sequence number.
    #[inline]
    pub fn record_index(&self, seq32: u32) -> usize {
        let index = seq32.wrapping_sub(self.front_seq as u32) as usize;
        debug_assert!(index < self.tombstones.len(), "ids name only held tombstones");
        index
    }

    /// The sequence number of the record a key-table value (`TOMBSTONE_KEY_BIT` set) names, if it
    /// is still held (None: a stale entry).
    #[inline]
    fn held_record_seq(&self, value: u32) -> Option<u64> {
        let offset = held_tombstone_offset(value, self.front_seq, self.tombstones.len())?;
        Some(self.front_seq + offset as u64)
    }

    /// Records held.
    #[inline]
    pub fn records(&self) -> usize {
        self.tombstones.len()
    }

    /// When the oldest record expires.
    #[inline]
    pub fn next_expiry(&self) -> Option<At> {
        self.tombstones.front().map(|record| record.expiry)
    }

    /// The expiry of a record settled at `now`: one constant ttl away, never before the newest
    /// record's (settle order is expiry order, even if a clock steps back).
    pub fn expiry_at(&self, now: At, ttl: Span) -> At {
        let expiry = now.saturating_add(ttl);
        self.tombstones.back().map_or(expiry, |last| expiry.max(last.expiry))
    }

    /// The room in `slot` (terminal, nothing armed, unlinked from its peer) is replaced by its
    /// tombstone `record` (sequence number: `next_record_seq`): its transfer ids and tickets now name
    /// the record, its slot is free. The room is returned for its buffers to be reused.
    pub fn settle(&mut self, slot: u32, record: Tombstone, max_records: u64, metrics: &mut Metrics) -> Room {
        let seq = self.front_seq + self.tombstones.len() as u64;
        let entry = &mut self.slots[slot as usize];
        let room = entry.room.take().expect("live slot");
        entry.epoch = entry.epoch.wrapping_add(1);
        for (index, settled) in record.ids.iter().enumerate() {
            let (epoch, entry) = (seq as u32, index as u32);
            match record.role {
                Role::Sender => {
                    let xref = XferRef { slot: TOMBSTONE_SLOT, epoch, part: entry, chunk: 0, plugin: settled.plugin };
                    self.xfers.replace(settled.id, xref);
                }
                Role::Receiver => {
                    self.tickets.replace(settled.id, TicketRef { slot: TOMBSTONE_SLOT, epoch, part: entry })
                }
            }
        }
        self.free_slots.push(slot);
        let (role, id) = (record.role, record.key().room);
        self.push_record(record, max_records, metrics);
        // The room's key entry now names the record (unless a newer generation took the key over);
        // only once the record is held, so a sweep during the evictions never finds its value stale.
        let keys = &mut self.keys[role as usize];
        let hash = keys.hash(id);
        if let Some(index) = keys.find_value(hash, slot) {
            keys.set_value_at(index, tombstone_key_value(seq));
        }
        room
    }

    /// Remember a room that never had a slab slot (an abort or a failure before the counterpart
    /// came) as a record: its key now names it, replacing an older generation's entry.
    pub fn bury(&mut self, record: Tombstone, max_records: u64, metrics: &mut Metrics) {
        let seq = self.front_seq + self.tombstones.len() as u64;
        let (role, id, state) = (record.role, record.key().room, record.state);
        metrics.rooms_by_state[state.index()] += 1;
        self.push_record(record, max_records, metrics);
        self.point_key(id, role, tombstone_key_value(seq));
    }

    /// Append a record, evicting the oldest while `max_records` are held. The oldest leaves before
    /// the new one joins: a full FIFO is a ring of exactly `max_records` records, so the new record
    /// is written where the evicted one was just read, in cache.
    fn push_record(&mut self, record: Tombstone, max_records: u64, metrics: &mut Metrics) {
        while metrics.tombstones >= max_records {
            metrics.tombstones_evicted += 1;
            self.drop_oldest(metrics);
        }
        self.reserve_record(max_records);
        self.tombstones.push_back(record);
        metrics.tombstones += 1;
    }

    /// Room for one more record: the FIFO grows by doubling, but never past `max_records`.
    #[inline]
    fn reserve_record(&mut self, max_records: u64) {
        let (len, capacity) = (self.tombstones.len(), self.tombstones.capacity());
        if len == capacity {
            let limit = usize::try_from(max_records).unwrap_or(usize::MAX);
            let target = (2 * capacity).max(4).min(limit).max(len + 1);
            self.tombstones.reserve_exact(target - len);
        }
    }

    /// Drop every record whose expiry tick is at or before `now_tick` (oldest first).
    pub fn expire_due(&mut self, now_tick: u64, metrics: &mut Metrics) {
        while let Some(record) = self.tombstones.front() {
            if Wheel::tick_of(record.expiry) > now_tick {
                break;
            }
            self.drop_oldest(metrics);
        }
    }

    /// Forget the oldest record entirely (expired or evicted): its key, transfer ids, tickets.
    fn drop_oldest(&mut self, metrics: &mut Metrics) {
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
        self.front_seq += 1;
        // Its key entry (unless a newer generation took the key over) is stale from now on, left
        // where it is for a sweep: no random read of the key table per eviction. A sweep is due in
        // a table after a quarter of its slots in evictions of either role (the sequence numbers
        // are shared), so every stale entry goes while its value still reads as stale.
        for role in Role::ALL {
            if self.keys[role as usize].note_eviction() {
                self.sweep_keys(role);
            }
        }
        metrics.rooms_by_state[state.index()] -= 1;
        metrics.tombstones -= 1;
    }

    /// Drop the stale entries of `role`'s key table (records evicted since its last sweep).
    #[cold]
    fn sweep_keys(&mut self, role: Role) {
        let (front_seq, held) = (self.front_seq, self.tombstones.len());
        self.keys[role as usize].sweep(|value| key_value_is_stale(value, front_seq, held));
    }

    /// The FIFO's capacity (a full FIFO is a ring of exactly `max_tombstones` records).
    #[cfg(test)]
    pub fn record_capacity(&self) -> usize {
        self.tombstones.capacity()
    }
}
