//! The `Core` state machine: rooms in a slab, keys in a seeded open-addressing table (`key_table`), deadlines in one timer wheel
//! (at most one entry per room, at its earliest deadline; a far deadline waits in a nursery FIFO
//! first, see `deadlines`), settled rooms as compact records in a tombstone FIFO (`tombstone`).
//! Inputs are `handle_*(now, ..)`, outputs `poll_command()` / `poll_timeout()`; it never does IO,
//! never reads a clock and never calls a plugin. Cost per event does not depend on the room count.

mod deadlines;
mod engine;
mod id_table;
mod key_table;
mod mapping;
mod outcome;
mod peer;
mod peer_keyed;
mod plugin;
mod recycle;
mod room;
mod tombstone;
mod view;

use crate::api::*;
use crate::config::{ConfigError, CoreConfig};
use crate::metrics::{LateSource, Metrics};
use crate::table::{transition_by_table, IllegalTransition, RoomInput};
use crate::timer::TimerKind;
use crate::wheel::{Wheel, TICK_NS};
use deadlines::{decode_entry, Deadlines};
use kvgate_abi::{Event, LocalKey, PeerId, RemoteKey};
use engine::SendSlices;
use id_table::SequentialIdTable;
use room::{Room, Slot, NIL};
use key_table::KeyTable;
use tombstone::{key_value_is_stale, Tombstone, TOMBSTONE_KEY_BIT, TOMBSTONE_SLOT};
use rustc_hash::FxHashMap;
use std::collections::VecDeque;
use peer_keyed::{peer_keyed_map, PeerKeyedMap};

/// A local region as the core knows it.
struct LocalRegion {
    len: u64,
    kind: kvgate_abi::MemoryKind,
    keys: Vec<(PluginSlot, LocalKey)>,
}

impl LocalRegion {
    fn key_for(&self, plugin: PluginSlot) -> Option<LocalKey> {
        self.keys.iter().find(|(slot, _)| *slot == plugin).map(|(_, key)| *key)
    }
}

/// A peer's region: its length and its key in each plugin it was imported into.
struct RemoteRegion {
    len: u64,
    keys: smallvec::SmallVec<[(PluginSlot, RemoteKey); 1]>,
}

impl RemoteRegion {
    fn key_for(&self, plugin: PluginSlot) -> Option<RemoteKey> {
        self.keys.iter().find(|(slot, _)| *slot == plugin).map(|(_, key)| *key)
    }
}

/// A connected peer: its incarnation, the plugins connected with it (preference order), remote
/// regions and live rooms (intrusive list head).
struct PeerEntry {
    incarnation: u64,
    plugins: smallvec::SmallVec<[PeerPlugin; 2]>,
    /// Plugin instances still connected with this peer but no longer offered for new rooms (a
    /// plugin reload retired them): an expect notice may still name one for rooms it started.
    retired: smallvec::SmallVec<[PluginSlot; 2]>,
    /// Bytes of the rooms with this peer whose transfer deadline runs (they share the link): a new
    /// room's transfer bound counts them ahead of its own.
    bytes_moving: u64,
    room_head: u32,
    remote_regions: PeerKeyedMap<RegionId, RemoteRegion>,
}

impl PeerEntry {
    /// The preferred plugin: rooms are bound to it until their parts are assigned one each.
    fn first_plugin(&self) -> PluginSlot {
        self.plugins.first().map_or(PluginSlot::NONE, |p| p.slot)
    }

    fn has_plugin(&self, plugin: PluginSlot) -> bool {
        self.plugins.iter().any(|p| p.slot == plugin) || self.retired.contains(&plugin)
    }
}

/// Where an outgoing transfer id points: a room's chunk, or (`slot == TOMBSTONE_SLOT`) entry `part`
/// of the tombstone record whose truncated sequence number is `epoch`.
#[derive(Clone, Copy)]
struct XferRef {
    slot: u32,
    epoch: u32,
    part: u32,
    chunk: u32,
    plugin: PluginSlot,
}

/// Where an incoming ticket points: a room's part, or (`slot == TOMBSTONE_SLOT`) entry `part` of
/// the tombstone record whose truncated sequence number is `epoch`.
#[derive(Clone, Copy)]
struct TicketRef {
    slot: u32,
    epoch: u32,
    part: u32,
}

/// What the key table says about a room key.
enum Lookup {
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

/// One gateway's scheduler. Deterministic: the same inputs give the same outputs.
pub struct Core {
    config: CoreConfig,
    metrics: Metrics,
    slots: Vec<Slot>,
    free_slots: Vec<u32>,
    /// Room id -> slot, or tombstone record (`tombstone_key_value(seq)`), one table per role
    /// (indexed by `role as usize`): an 8-byte key hashes faster than `(id, role)`. Keyed hash: room
    /// ids may come from peers. The ids live in the rooms and records (`key_value_room_id`).
    keys: [KeyTable; 2],
    /// Transfer id -> chunk, ticket -> part: both issued in increasing order.
    xfers: SequentialIdTable<XferRef>,
    tickets: SequentialIdTable<TicketRef>,
    peers: FxHashMap<PeerId, PeerEntry>,
    /// Receiver rooms whose parts come from several peers, under each sender other than the room's
    /// bound peer (which lists them itself): (slot, epoch), so that losing any sender fails them.
    extra_bound: FxHashMap<PeerId, rustc_hash::FxHashSet<(u32, u32)>>,
    regions: FxHashMap<RegionId, LocalRegion>,
    /// Each room's one deadline entry: in the timer wheel, or in the nursery while far off.
    deadlines: Deadlines,
    commands: VecDeque<Command>,
    next_xfer: u64,
    next_ticket: u64,
    live_rooms: u64,
    /// Settled rooms as compact records in settle order: every tombstone lives
    /// `tombstone_ttl_ms`, so this is expiry order too; the oldest is evicted first. Their slab
    /// slots are free.
    tombstones: VecDeque<Tombstone>,
    /// The sequence number of `tombstones`' front record (record `seq` is at `seq - front`).
    tombstone_front_seq: u64,
    /// Emptied part lists of dropped sender rooms, reused by new ones (at most
    /// `SPARE_SEND_PARTS` lists of at most `SPARE_SEND_PARTS_CAPACITY` parts: no heap block per
    /// room in steady state).
    spare_send_parts: Vec<Vec<room::SendPart>>,
    state_fifos: [VecDeque<(u32, u32, Nanos)>; RoomState::COUNT],
    /// Emptied buffers of executed commands (`recycle_command`), reused by the next `Submit` and
    /// `ExpectIncoming` (at most `SPARE_COMMAND_BUFFERS` of each, of at most
    /// `SPARE_COMMAND_BUFFER_CAPACITY` elements).
    spare_segments: Vec<Vec<kvgate_abi::Segment>>,
    spare_ranges: Vec<Vec<kvgate_abi::LocalRange>>,
    /// Part lists and ticket lists of sent expect notices (`recycle_command`) and of owned expect
    /// requests, reused by the next notice (same bounds, see `keep_spare_notice_parts`).
    spare_notice_parts: Vec<Vec<Vec<Slice>>>,
    spare_tickets: Vec<Vec<kvgate_abi::Ticket>>,
    spare_plugin_lists: Vec<Vec<PluginSlot>>,
    /// The latest transfer the plugin-grace timer forced failed (`plugin_silent`): found on a timer,
    /// not from a plugin event, so the gateway's violation log asks here which room it was.
    latest_silent: Option<SilentTransfer>,
}

impl Core {
    /// A core with `config` (validated).
    pub fn new(config: CoreConfig) -> Result<Core, ConfigError> {
        config.validate()?;
        Ok(Core {
            config,
            metrics: Metrics::default(),
            slots: Vec::new(),
            free_slots: Vec::new(),
            keys: [KeyTable::new(), KeyTable::new()],
            xfers: SequentialIdTable::default(),
            tickets: SequentialIdTable::default(),
            peers: FxHashMap::default(),
            extra_bound: FxHashMap::default(),
            regions: FxHashMap::default(),
            deadlines: Deadlines::default(),
            commands: VecDeque::new(),
            next_xfer: 1,
            next_ticket: 1,
            live_rooms: 0,
            tombstones: VecDeque::new(),
            tombstone_front_seq: 0,
            spare_send_parts: Vec::new(),
            state_fifos: Default::default(),
            spare_segments: Vec::new(),
            spare_ranges: Vec::new(),
            spare_notice_parts: Vec::new(),
            spare_tickets: Vec::new(),
            spare_plugin_lists: Vec::new(),
            latest_silent: None,
        })
    }

    pub fn config(&self) -> &CoreConfig {
        &self.config
    }

    /// An engine's expect, send or abort. A refusal changes nothing (a refusal for a terminal or
    /// stale room is counted as a late engine message). An abort is never refused.
    pub fn handle_engine(&mut self, now: Nanos, request: EngineRequest) -> Result<(), Refusal> {
        let result = match request {
            EngineRequest::Expect { room, peer, parts, timeout_ms } => {
                let result = self.engine_expect(now, room, peer, &parts, &[], &[], timeout_ms);
                // The notice got its own copy: the request's buffer is kept for a later notice.
                self.keep_spare_notice_parts(parts);
                result
            }
            EngineRequest::Send { room, peer, part, chunk, slices, last } => {
                self.engine_send(now, room, peer, part, chunk, None, SendSlices::Owned(slices), last)
            }
            EngineRequest::Abort { room, role } => {
                self.engine_abort(now, room, role);
                Ok(())
            }
        };
        self.count_refusal(result)
    }

    /// An engine's send with its slices borrowed: exactly `handle_engine(EngineRequest::Send {..})`
    /// (same checks, refusals, counters and commands) without a `Vec` per chunk. The core copies the
    /// slices only when it must hold the chunk (sent before the receiver's expect notice).
    #[allow(clippy::too_many_arguments)]
    pub fn handle_send(
        &mut self,
        now: Nanos,
        room: RoomKey,
        peer: Option<PeerId>,
        part: u32,
        chunk: u32,
        slices: &[Slice],
        last: bool,
    ) -> Result<(), Refusal> {
        let result = self.engine_send(now, room, peer, part, chunk, None, SendSlices::Borrowed(slices), last);
        self.count_refusal(result)
    }

    /// `handle_send` with the chunk placed at byte `at` of the part's destination stream (the part's
    /// slices concatenated) instead of after the previous chunk: a part's chunks then all name their
    /// offset (`placement_mismatch` otherwise), come in any order with any chunk numbers, may not
    /// overlap (`overlapping_chunk`) or run past the end (`length_mismatch`), and the part is done
    /// once every byte is covered exactly once (`last`, when given, says the chunk completes it).
    #[allow(clippy::too_many_arguments)]
    pub fn handle_send_at(
        &mut self,
        now: Nanos,
        room: RoomKey,
        peer: Option<PeerId>,
        part: u32,
        chunk: u32,
        at: u64,
        slices: &[Slice],
        last: bool,
    ) -> Result<(), Refusal> {
        let result = self.engine_send(now, room, peer, part, chunk, Some(at), SendSlices::Borrowed(slices), last);
        self.count_refusal(result)
    }

    /// An engine's expect with its parts borrowed (`&[Vec<Slice>]`, `&[&[Slice]]`, ..): exactly
    /// `handle_engine(EngineRequest::Expect {..})` (same checks, refusals, counters and commands)
    /// without the request's own `Vec`s. The expect notice's buffers come from notices handed back
    /// with `recycle_command`.
    pub fn handle_expect<P: AsRef<[Slice]>>(
        &mut self,
        now: Nanos,
        room: RoomKey,
        peer: PeerId,
        parts: &[P],
        timeout_ms: Option<u64>,
    ) -> Result<(), Refusal> {
        let result = self.engine_expect(now, room, peer, parts, &[], &[], timeout_ms);
        self.count_refusal(result)
    }

    /// `handle_expect` with each part's sender (`part_peers[p]`; missing: `peer`, the room's bound
    /// peer) and the memory kind the sender reads it from (`source_kinds[p]`; None or missing: the
    /// kind of the part's destination). Each part uses the first plugin connected with its sender
    /// that holds a key for every destination region of the part and serves its source kind
    /// (`no_plugin_for_memory` when none does). A room with several senders fails as a whole when
    /// any part fails or any sender is lost, and every sender is told.
    #[allow(clippy::too_many_arguments)]
    pub fn handle_expect_from<P: AsRef<[Slice]>>(
        &mut self,
        now: Nanos,
        room: RoomKey,
        peer: PeerId,
        parts: &[P],
        part_peers: &[PeerId],
        source_kinds: &[Option<kvgate_abi::MemoryKind>],
        timeout_ms: Option<u64>,
    ) -> Result<(), Refusal> {
        let result = self.engine_expect(now, room, peer, parts, part_peers, source_kinds, timeout_ms);
        self.count_refusal(result)
    }

    /// Count a refusal (and a late engine message when the room is over or stale).
    #[inline]
    fn count_refusal(&mut self, result: Result<(), Refusal>) -> Result<(), Refusal> {
        if let Err(refusal) = &result {
            self.metrics.refusals[refusal.reason.index()] += 1;
            if matches!(refusal.reason, RefusalReason::RoomTerminal | RefusalReason::StaleGeneration) {
                self.count_late(LateSource::Engine);
            }
        }
        result
    }

    /// The engine that owned `room` on `role`'s side is gone (its session ended): a live room fails
    /// `engine_lost` at once and the peer is told, as for an abort. Returns whether it was live.
    pub fn handle_engine_lost(&mut self, now: Nanos, room: RoomKey, role: Role) -> bool {
        self.engine_lost(now, room, role)
    }

    /// A local region, registered by the driver with the plugins named in `info.keys`. Registering
    /// an id again replaces it.
    pub fn handle_region_registered(&mut self, _now: Nanos, info: RegionInfo) {
        self.regions.insert(info.id, LocalRegion { len: info.len, kind: info.memory_kind, keys: info.keys });
    }

    /// A local region is gone; later sends naming it are refused, held chunks naming it fail
    /// (`region_unregistered`) when their room matches.
    pub fn handle_region_unregistered(&mut self, _now: Nanos, region: RegionId) {
        self.regions.remove(&region);
    }

    /// A peer's region (its id as the peer numbers it), imported by the driver into the peer's
    /// preferred plugin (`handle_remote_region_key` names the plugin). Call after `handle_peer_up`
    /// of the peer's current incarnation; ignored for a peer that is not up.
    pub fn handle_remote_region(&mut self, now: Nanos, peer: PeerId, region: RegionId, len: u64, key: RemoteKey) {
        let Some(plugin) = self.peers.get(&peer).map(PeerEntry::first_plugin) else { return };
        self.handle_remote_region_key(now, peer, region, len, plugin, key);
    }

    /// A peer's region imported into `plugin` (one of the peer's plugins): its key there replaces
    /// any earlier one, and its length is the latest announced. Ignored for a peer that is not up.
    pub fn handle_remote_region_key(&mut self, _now: Nanos, peer: PeerId, region: RegionId, len: u64, plugin: PluginSlot, key: RemoteKey) {
        let Some(entry) = self.peers.get_mut(&peer) else { return };
        let remote = entry.remote_regions.entry(region).or_insert_with(|| RemoteRegion { len, keys: smallvec::SmallVec::new() });
        remote.len = len;
        match remote.keys.iter_mut().find(|(slot, _)| *slot == plugin) {
            Some(held) => held.1 = key,
            None => remote.keys.push((plugin, key)),
        }
    }

    /// The peer link is up with one plugin instance, serving every memory kind: the one-plugin form
    /// of `handle_peer_up_with`.
    pub fn handle_peer_up(&mut self, now: Nanos, peer: PeerId, incarnation: u64, plugin: PluginSlot) {
        self.peer_up(now, peer, incarnation, &[PeerPlugin { slot: plugin, memory_kinds: u32::MAX }]);
    }

    /// The peer link is up; `plugins` are the plugin instances connected with this peer, in
    /// preference order (at least one). A new incarnation of a known peer is handled as lost
    /// (`restarted`) + up.
    pub fn handle_peer_up_with(&mut self, now: Nanos, peer: PeerId, incarnation: u64, plugins: &[PeerPlugin]) {
        self.peer_up(now, peer, incarnation, plugins);
    }

    /// The plugins connected with an up peer changed without the link going down (a plugin reload):
    /// `plugins` (preference order) are offered for new rooms from now on; `retired` are still
    /// connected and accepted for the rooms that already use them, never chosen for a new one.
    /// Rooms keep the plugins they were given. Ignored for a peer that is not up.
    pub fn handle_peer_plugins(&mut self, _now: Nanos, peer: PeerId, plugins: &[PeerPlugin], retired: &[PluginSlot]) {
        let Some(entry) = self.peers.get_mut(&peer) else { return };
        entry.plugins = plugins.iter().copied().filter(|p| p.slot.0 < room::MAX_PLUGIN_SLOTS).collect();
        entry.retired = retired.iter().copied().filter(|s| s.0 < room::MAX_PLUGIN_SLOTS && !plugins.iter().any(|p| p.slot == *s)).collect();
    }

    /// The peer link is lost: every live room bound to `peer` fails at once (`peer_lost`).
    pub fn handle_peer_lost(&mut self, now: Nanos, peer: PeerId, cause: PeerLoss) {
        self.peer_lost(now, peer, cause);
    }

    /// A message from a peer gateway's core, borrowed: the core copies what it keeps, so the driver
    /// may reuse the message's buffers (e.g. its decode buffers) afterwards.
    pub fn handle_peer_message(&mut self, now: Nanos, peer: PeerId, message: &PeerMessage) {
        self.peer_message(now, peer, message);
    }

    /// An event a plugin instance delivered to its sink. The driver also reports a synchronous
    /// `submit` error here, as `Event::failed_quiesced(xfer, code, message)`.
    pub fn handle_plugin_event(&mut self, now: Nanos, plugin: PluginSlot, event: &Event) {
        self.plugin_event(now, plugin, event);
    }

    /// Fire every timer due at `now`. The driver drains plugin events and peer messages already
    /// received before calling it, so a completion already observable wins over a deadline.
    #[inline]
    pub fn handle_timeout(&mut self, now: Nanos) {
        // Most calls find nothing due: three front checks, inlined into the driver.
        let tombstone_due = self.tombstones.front().is_some_and(|record| Wheel::tick_of(record.expiry) <= now.0 / TICK_NS);
        if tombstone_due || self.deadlines.may_be_due(now) {
            self.fire_due(now);
        }
    }

    /// `handle_timeout` when something may be due.
    fn fire_due(&mut self, now: Nanos) {
        let now_tick = now.0 / TICK_NS;
        // Rooms whose nursery span ended move to the wheel first (their deadlines may be due now).
        while let Some((slot, epoch)) = self.deadlines.pop_nursery(now) {
            let entry = &mut self.slots[slot as usize];
            debug_assert_eq!(entry.epoch, epoch, "a room leaves the nursery before its slot is reused");
            let room = entry.room.as_mut().expect("a room in the nursery is held");
            debug_assert!(deadlines::in_nursery(room.wheel_entry));
            room.wheel_entry = self.deadlines.promote(slot, epoch, room.earliest_wheel_deadline());
        }
        while let Some(payload) = self.deadlines.wheel.pop_expired(now) {
            let (slot, epoch) = decode_entry(payload);
            if !self.slot_is(slot, epoch) {
                debug_assert!(false, "timer for a vanished room");
                continue;
            }
            self.room_mut(slot).wheel_entry = NIL;
            // Fire the room's due timers earliest first; a handler may disarm the others.
            while let Some(kind) = self.room_at(slot).due_timer(now_tick) {
                self.room_mut(slot).armed &= !kind.bit();
                self.on_timer(now, slot, kind);
                if !self.slot_is(slot, epoch) {
                    break;
                }
            }
            if self.slot_is(slot, epoch) {
                self.sync_wheel_entry(now, slot);
            }
        }
        // Tombstones expire in FIFO order (`tombstone_ttl_ms` after they settled).
        while let Some(record) = self.tombstones.front() {
            if Wheel::tick_of(record.expiry) > now_tick {
                break;
            }
            self.drop_oldest_tombstone();
        }
    }

    /// The next command for the driver, in order.
    #[inline]
    pub fn poll_command(&mut self) -> Option<Command> {
        self.commands.pop_front()
    }

    /// When the core next needs `handle_timeout` (None: no timer armed). It may be a little early
    /// (a wheel level boundary, or the end of a 64 ms nursery span): calling `handle_timeout` then is
    /// cheap and correct.
    pub fn poll_timeout(&self) -> Option<Nanos> {
        let tombstone = self.tombstones.front().map(|record| Wheel::fire_time(record.expiry));
        match (self.deadlines.next_deadline(), tombstone) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Rooms that are not terminal.
    pub fn live_rooms(&self) -> u64 {
        self.live_rooms
    }

    /// Timer entries held: wheel entries (at most one per room) plus tombstone expiries (for leak
    /// checks: 0 once every room is dropped).
    pub fn armed_timers(&self) -> usize {
        self.deadlines.len() + self.tombstones.len()
    }

    /// Rooms held: in the slab (live and quarantined) plus tombstone records.
    pub fn held_rooms(&self) -> usize {
        self.slots.len() - self.free_slots.len() + self.tombstones.len()
    }

    // ----- the timer table's one match -----

    fn on_timer(&mut self, now: Nanos, slot: u32, kind: TimerKind) {
        self.room_mut(slot).touch(now, LastEvent::TimerFired);
        match kind {
            // CONFORMANCE: TIME-6
            TimerKind::Bootstrap => self.fail_room(now, slot, RoomInput::BootstrapTimer, FailReason::BootstrapTimeout, None, None),
            TimerKind::Transfer => self.fail_room(now, slot, RoomInput::TransferTimer, FailReason::TransferTimeout, None, None),
            TimerKind::Room => self.fail_room(now, slot, RoomInput::RoomTimer, FailReason::RoomTimeout, None, None),
            TimerKind::PluginGrace => self.plugin_grace_expired(now, slot),
            TimerKind::Quarantine => self.release_quarantine(now, slot, RoomInput::QuarantineTimer, ReleaseCause::QuarantineTimeout),
            // Tombstones expire from the tombstone FIFO (`handle_timeout`), never from the wheel.
            TimerKind::Tombstone => unreachable!("a tombstone expiry in the wheel"),
        }
    }

    // ----- slab, keys, states, timers -----

    #[inline]
    fn room_at(&self, slot: u32) -> &Room {
        self.slots[slot as usize].room.as_ref().expect("live slot")
    }

    #[inline]
    fn room_mut(&mut self, slot: u32) -> &mut Room {
        self.slots[slot as usize].room.as_mut().expect("live slot")
    }

    #[inline]
    fn epoch(&self, slot: u32) -> u32 {
        self.slots[slot as usize].epoch
    }

    /// Whether a key-table value names the held room or tombstone record of room id `id` (a stale
    /// value names nothing).
    #[inline]
    fn key_value_names(&self, value: u32, id: u64) -> bool {
        if value & TOMBSTONE_KEY_BIT != 0 {
            self.held_tombstone_seq(value).is_some_and(|seq| self.tombstone_at(seq).key().room == id)
        } else {
            self.room_at(value).key.room == id
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
    fn lookup(&self, key: RoomKey, role: Role) -> Lookup {
        match self.key_value(key.room, role) {
            None => Lookup::Absent,
            Some(value) if value & TOMBSTONE_KEY_BIT != 0 => {
                let seq = self.held_tombstone_seq(value).expect("key_value returns held values");
                by_generation(self.tombstone_at(seq).key().generation, key.generation, Lookup::Settled(seq), Lookup::Older(NIL))
            }
            Some(slot) => by_generation(self.room_at(slot).key.generation, key.generation, Lookup::Same(slot), Lookup::Older(slot)),
        }
    }

    /// Put a new room, built by `build`, in the slab and the key table (replacing an older
    /// generation's entry). The slot is claimed first so the room is built in place, not copied.
    #[inline(always)]
    fn insert_room(&mut self, build: impl FnOnce() -> Room) -> u32 {
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
        let hash = self.keys[role as usize].hash(key);
        let held = self.keys[role as usize].find(hash, |value| self.key_value_names(value, key));
        let (front_seq, tombstones) = (self.tombstone_front_seq, self.tombstones.len());
        match held {
            Some(index) => self.keys[role as usize].set_value_at(index, slot),
            None => self.keys[role as usize].insert_new(hash, slot, |value| key_value_is_stale(value, front_seq, tombstones)),
        }
        self.metrics.rooms_created += 1;
        self.metrics.rooms_by_state[state.index()] += 1;
        if !state.is_terminal() {
            self.live_rooms += 1;
            self.push_state_fifo(slot, state, entered);
        }
        slot
    }

    fn push_state_fifo(&mut self, slot: u32, state: RoomState, entered: Nanos) {
        let epoch = self.epoch(slot);
        let fifo = &mut self.state_fifos[state.index()];
        if fifo.is_empty() {
            self.metrics.oldest_entered_by_state[state.index()] = Some(entered);
        }
        fifo.push_back((slot, epoch, entered));
    }

    /// Drop stale heads of a state's FIFO and refresh its oldest-entered gauge.
    fn refresh_state_fifo(&mut self, state: RoomState) {
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
        self.metrics.oldest_entered_by_state[state.index()] = fifo.front().map(|&(_, _, entered)| entered);
    }

    /// Apply one input through the transition table.
    fn apply(&mut self, now: Nanos, slot: u32, input: RoomInput) -> Result<RoomState, IllegalTransition> {
        let entry = &mut self.slots[slot as usize];
        let epoch = entry.epoch;
        let room = entry.room.as_mut().expect("live slot");
        let from = room.state;
        let to = transition_by_table(from, input)?;
        if to == from {
            return Ok(to);
        }
        room.state = to;
        room.state_entered = now;
        let (key, role) = (room.key, room.role);
        self.metrics.rooms_by_state[from.index()] -= 1;
        self.metrics.rooms_by_state[to.index()] += 1;
        if aged(from) {
            // The room leaving is most often its state's oldest: its entry is the front, dropped
            // without reading the slot again.
            let fifo = &mut self.state_fifos[from.index()];
            if fifo.front().is_some_and(|&(front, front_epoch, _)| front == slot && front_epoch == epoch) {
                fifo.pop_front();
            }
            self.refresh_state_fifo(from);
        }
        if !from.is_terminal() && to.is_terminal() {
            self.live_rooms -= 1;
        }
        if aged(to) {
            let fifo = &mut self.state_fifos[to.index()];
            if fifo.is_empty() {
                self.metrics.oldest_entered_by_state[to.index()] = Some(now);
            }
            fifo.push_back((slot, epoch, now));
        }
        if !to.is_terminal() {
            self.commands.push_back(Command::ToEngine(RoomEvent::StateChanged { room: key, role, state: to }));
        }
        Ok(to)
    }

    /// Apply one input through the transition table; an input the table refuses (a core bug) is
    /// counted and kept (`Metrics::illegal_transitions`), never dropped unseen. Returns whether it
    /// was applied.
    fn step(&mut self, now: Nanos, slot: u32, input: RoomInput) -> bool {
        match self.apply(now, slot, input) {
            Ok(_) => true,
            Err(illegal) => {
                debug_assert!(false, "{illegal}");
                self.metrics.illegal_transitions += 1;
                self.metrics.latest_illegal_transition = Some(illegal);
                false
            }
        }
    }

    /// Whether `slot` holds a room and is at `epoch`.
    #[inline]
    fn slot_is(&self, slot: u32, epoch: u32) -> bool {
        let entry = &self.slots[slot as usize];
        entry.epoch == epoch && entry.room.is_some()
    }

    /// Arm (or re-arm) the room's timer of `kind` (never `Tombstone`: see `settle`). The room's one
    /// wheel entry moves only when the new deadline comes before it.
    fn arm(&mut self, now: Nanos, slot: u32, kind: TimerKind, deadline: Nanos) {
        debug_assert!(kind != TimerKind::Tombstone);
        let entry = &mut self.slots[slot as usize];
        let epoch = entry.epoch;
        let room = entry.room.as_mut().expect("live slot");
        room.set_timer(kind, deadline);
        room.wheel_entry = self.deadlines.lower(now, room.wheel_entry, slot, epoch, deadline);
    }

    /// Disarm `from` and arm `to` at `deadline`.
    fn move_timer(&mut self, now: Nanos, slot: u32, from: TimerKind, to: TimerKind, deadline: Nanos) {
        self.disarm(slot, from);
        self.arm(now, slot, to, deadline);
    }

    /// Disarm a timer: nothing moves in the wheel (the room's entry, if now early, finds nothing
    /// due and is re-armed at the next deadline).
    #[inline]
    fn disarm(&mut self, slot: u32, kind: TimerKind) {
        self.room_mut(slot).armed &= !kind.bit();
    }

    /// Disarm several of the room's timers with one slab lookup.
    #[inline]
    fn disarm_all(&mut self, slot: u32, kinds: &[TimerKind]) {
        let room = self.room_mut(slot);
        for &kind in kinds {
            room.armed &= !kind.bit();
        }
    }

    /// After the room's wheel entry fired or its timers changed: the entry (if any) is at its
    /// earliest armed deadline, or released when none is armed.
    fn sync_wheel_entry(&mut self, now: Nanos, slot: u32) {
        let entry = &mut self.slots[slot as usize];
        let epoch = entry.epoch;
        let room = entry.room.as_mut().expect("live slot");
        room.wheel_entry = self.deadlines.sync(now, room.wheel_entry, slot, epoch, room.earliest_wheel_deadline());
    }

    #[inline]
    fn timer_deadline(&self, slot: u32, kind: TimerKind) -> Option<Nanos> {
        self.room_at(slot).timer(kind)
    }

    // CONFORMANCE: ABORT-8
    #[inline]
    fn count_late(&mut self, source: LateSource) {
        self.metrics.late_messages[source.index()] += 1;
    }

    /// The transfer deadline of a room starting to move its bytes now: `transfer_base_ms` plus its
    /// bytes and those of the rooms already moving with the same peer (they share the link) at
    /// `min_bandwidth_bytes_per_s`. Its bytes join the peer's until the room ends (`leave_link`).
    fn link_transfer_deadline(&mut self, now: Nanos, slot: u32) -> Nanos {
        let room = self.room_at(slot);
        let (bytes, peer) = (room.bytes_total, room.peer());
        let ahead = match peer.and_then(|peer| self.peers.get_mut(&peer)) {
            Some(entry) => {
                let ahead = entry.bytes_moving;
                entry.bytes_moving = entry.bytes_moving.saturating_add(bytes);
                Some(ahead)
            }
            None => None,
        };
        if ahead.is_some() {
            self.room_mut(slot).bytes_counted = room::BytesCounted::OnLink;
        }
        let ahead = ahead.unwrap_or(0);
        now.saturating_add(self.transfer_budget(ahead.saturating_add(bytes)))
    }

    /// The room no longer moves bytes over its peer's link (terminal): its share is taken off.
    fn leave_link(&mut self, slot: u32) {
        let room = self.room_mut(slot);
        if room.bytes_counted != room::BytesCounted::OnLink {
            return;
        }
        room.bytes_counted = room::BytesCounted::Nowhere;
        let share = room.bytes_total;
        if let Some(entry) = room.peer().and_then(|peer| self.peers.get_mut(&peer)) {
            entry.bytes_moving = entry.bytes_moving.saturating_sub(share);
        }
    }

    /// Bytes moving with `peer` now (the transfer bound counts them ahead of a new room).
    pub fn bytes_moving_with(&self, peer: PeerId) -> u64 {
        self.peers.get(&peer).map_or(0, |entry| entry.bytes_moving)
    }

    fn transfer_budget(&self, bytes: u64) -> Nanos {
        let bandwidth = self.config.min_bandwidth_bytes_per_s;
        // The 64-bit division when the product fits (below ~18 GB), the 128-bit one otherwise.
        let per_byte_ns = match bytes.checked_mul(1_000_000_000) {
            Some(scaled) => scaled / bandwidth,
            None => ((bytes as u128 * 1_000_000_000u128) / bandwidth as u128).min(u64::MAX as u128) as u64,
        };
        Nanos::from_ms(self.config.transfer_base_ms).saturating_add(Nanos(per_byte_ns))
    }

    #[inline]
    fn push_engine(&mut self, event: RoomEvent) {
        self.commands.push_back(Command::ToEngine(event));
    }

    #[inline]
    fn push_peer(&mut self, peer: PeerId, message: PeerMessage) {
        self.commands.push_back(Command::ToPeer { peer, message });
    }
}
