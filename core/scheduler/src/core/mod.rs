//! The `Core` state machine: every room in the room store (`store`: live rooms in a slab, settled
//! ones as compact tombstone records, found by key or by transfer id and ticket), deadlines in one
//! timer wheel (at most one entry per room, at its earliest deadline; a far deadline waits in a
//! nursery FIFO first, see `deadlines`). The handlers read as the protocol: engine requests
//! (`engine`), peer messages (`peer`), plugin events (`plugin`, through the lifecycle tables), how
//! rooms end (`outcome`). Inputs are `handle_*(now, ..)`, outputs `poll_command()` /
//! `poll_timeout()`; it never does IO, never reads a clock and never calls a plugin. Cost per event
//! does not depend on the room count.

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
mod store;
mod tombstone;
mod view;

use crate::api::*;
use crate::config::{ConfigError, CoreConfig};
use crate::metrics::{LateSource, Metrics};
use crate::table::{IllegalTransition, RoomInput};
use crate::timer::TimerKind;
use crate::wheel::{Wheel, TICK_NS};
use deadlines::{decode_entry, Deadlines};
use engine::SendSlices;
use kvgate_abi::{Event, LocalKey, PeerId, RemoteKey};
use peer_keyed::{peer_keyed_map, PeerKeyedMap};
use recycle::Spares;
use room::{Room, NIL};
use rustc_hash::FxHashMap;
use std::collections::VecDeque;
use store::{Lookup, RoomStore};

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

/// One gateway's scheduler. Deterministic: the same inputs give the same outputs.
pub struct Core {
    config: CoreConfig,
    metrics: Metrics,
    /// Every room held, live or settled, and the ids that name them.
    rooms: RoomStore,
    peers: FxHashMap<PeerId, PeerEntry>,
    /// Receiver rooms whose parts come from several peers, under each sender other than the room's
    /// bound peer (which lists them itself): (slot, epoch), so that losing any sender fails them.
    extra_bound: FxHashMap<PeerId, rustc_hash::FxHashSet<(u32, u32)>>,
    regions: FxHashMap<RegionId, LocalRegion>,
    /// Each room's one deadline entry: in the timer wheel, or in the nursery while far off.
    deadlines: Deadlines,
    commands: VecDeque<Command>,
    /// Buffers kept for reuse (`recycle`).
    spares: Spares,
}

impl Core {
    /// A core with `config` (validated).
    pub fn new(config: CoreConfig) -> Result<Core, ConfigError> {
        config.validate()?;
        Ok(Core {
            config,
            metrics: Metrics::default(),
            rooms: RoomStore::new(),
            peers: FxHashMap::default(),
            extra_bound: FxHashMap::default(),
            regions: FxHashMap::default(),
            deadlines: Deadlines::default(),
            commands: VecDeque::new(),
            spares: Spares::default(),
        })
    }

    pub fn config(&self) -> &CoreConfig {
        &self.config
    }

    /// An engine's expect, send or abort. A refusal changes nothing (a refusal for a terminal or
    /// stale room is counted as a late engine message). An abort is never refused.
    pub fn handle_engine(&mut self, now: At, request: EngineRequest) -> Result<(), Refusal> {
        let result = match request {
            EngineRequest::Expect { room, peer, parts, timeout_ms } => {
                let result = self.engine_expect(now, room, peer, &parts, ExpectShape::default(), timeout_ms);
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
        now: At,
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
        now: At,
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
        now: At,
        room: RoomKey,
        peer: PeerId,
        parts: &[P],
        timeout_ms: Option<u64>,
    ) -> Result<(), Refusal> {
        let result = self.engine_expect(now, room, peer, parts, ExpectShape::default(), timeout_ms);
        self.count_refusal(result)
    }

    /// `handle_expect` with each part's sender and the memory kind the sender reads it from
    /// (`ExpectShape`). Each part uses the first plugin connected with its sender that holds a key
    /// for every destination region of the part and serves its source kind (`no_plugin_for_memory`
    /// when none does). A room with several senders fails as a whole when any part fails or any
    /// sender is lost, and every sender is told.
    pub fn handle_expect_from<P: AsRef<[Slice]>>(
        &mut self,
        now: At,
        room: RoomKey,
        peer: PeerId,
        parts: &[P],
        shape: ExpectShape<'_>,
        timeout_ms: Option<u64>,
    ) -> Result<(), Refusal> {
        let result = self.engine_expect(now, room, peer, parts, shape, timeout_ms);
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
    pub fn handle_engine_lost(&mut self, now: At, room: RoomKey, role: Role) -> bool {
        self.engine_lost(now, room, role)
    }

    /// A local region, registered by the driver with the plugins named in `info.keys`. Registering
    /// an id again replaces it.
    pub fn handle_region_registered(&mut self, _now: At, info: RegionInfo) {
        self.regions.insert(info.id, LocalRegion { len: info.len, kind: info.memory_kind, keys: info.keys });
    }

    /// A local region is gone; later sends naming it are refused, held chunks naming it fail
    /// (`region_unregistered`) when their room matches.
    pub fn handle_region_unregistered(&mut self, _now: At, region: RegionId) {
        self.regions.remove(&region);
    }

    /// A peer's region (its id as the peer numbers it), imported by the driver into the peer's
    /// preferred plugin (`handle_remote_region_key` names the plugin). Call after `handle_peer_up`
    /// of the peer's current incarnation; ignored for a peer that is not up.
    pub fn handle_remote_region(&mut self, now: At, peer: PeerId, region: RegionId, len: u64, key: RemoteKey) {
        let Some(plugin) = self.peers.get(&peer).map(PeerEntry::first_plugin) else { return };
        self.handle_remote_region_key(now, peer, region, len, plugin, key);
    }

    /// A peer's region imported into `plugin` (one of the peer's plugins): its key there replaces
    /// any earlier one, and its length is the latest announced. Ignored for a peer that is not up.
    pub fn handle_remote_region_key(
        &mut self,
        _now: At,
        peer: PeerId,
        region: RegionId,
        len: u64,
        plugin: PluginSlot,
        key: RemoteKey,
    ) {
        let Some(entry) = self.peers.get_mut(&peer) else { return };
        let remote =
            entry.remote_regions.entry(region).or_insert_with(|| RemoteRegion { len, keys: smallvec::SmallVec::new() });
        remote.len = len;
        match remote.keys.iter_mut().find(|(slot, _)| *slot == plugin) {
            Some(held) => held.1 = key,
            None => remote.keys.push((plugin, key)),
        }
    }

    /// The peer link is up with one plugin instance, serving every memory kind: the one-plugin form
    /// of `handle_peer_up_with`.
    pub fn handle_peer_up(&mut self, now: At, peer: PeerId, incarnation: u64, plugin: PluginSlot) {
        self.peer_up(now, peer, incarnation, &[PeerPlugin { slot: plugin, memory_kinds: u32::MAX }]);
    }

    /// The peer link is up; `plugins` are the plugin instances connected with this peer, in
    /// preference order (at least one). A new incarnation of a known peer is handled as lost
    /// (`restarted`) + up.
    pub fn handle_peer_up_with(&mut self, now: At, peer: PeerId, incarnation: u64, plugins: &[PeerPlugin]) {
        self.peer_up(now, peer, incarnation, plugins);
    }

    /// The plugins connected with an up peer changed without the link going down (a plugin reload):
    /// `plugins` (preference order) are offered for new rooms from now on; `retired` are still
    /// connected and accepted for the rooms that already use them, never chosen for a new one.
    /// Rooms keep the plugins they were given. Ignored for a peer that is not up.
    pub fn handle_peer_plugins(&mut self, _now: At, peer: PeerId, plugins: &[PeerPlugin], retired: &[PluginSlot]) {
        let Some(entry) = self.peers.get_mut(&peer) else { return };
        entry.plugins = plugins.iter().copied().filter(|p| p.slot.0 < room::MAX_PLUGIN_SLOTS).collect();
        entry.retired = retired
            .iter()
            .copied()
            .filter(|s| s.0 < room::MAX_PLUGIN_SLOTS && !plugins.iter().any(|p| p.slot == *s))
            .collect();
    }

    /// The peer link is lost: every live room bound to `peer` fails at once (`peer_lost`).
    pub fn handle_peer_lost(&mut self, now: At, peer: PeerId, cause: PeerLoss) {
        self.peer_lost(now, peer, cause);
    }

    /// A message from a peer gateway's core, borrowed: the core copies what it keeps, so the driver
    /// may reuse the message's buffers (e.g. its decode buffers) afterwards.
    pub fn handle_peer_message(&mut self, now: At, peer: PeerId, message: &PeerMessage) {
        self.peer_message(now, peer, message);
    }

    /// An event a plugin instance delivered to its sink. The driver also reports a synchronous
    /// `submit` error here, as `Event::failed_quiesced(xfer, code, message)`.
    pub fn handle_plugin_event(&mut self, now: At, plugin: PluginSlot, event: &Event) {
        self.plugin_event(now, plugin, event);
    }

    /// Fire every timer due at `now`. The driver drains plugin events and peer messages already
    /// received before calling it, so a completion already observable wins over a deadline.
    #[inline]
    pub fn handle_timeout(&mut self, now: At) {
        // Most calls find nothing due: three front checks, inlined into the driver.
        let tombstone_due = self.rooms.next_expiry().is_some_and(|expiry| Wheel::tick_of(expiry) <= now.0 / TICK_NS);
        if tombstone_due || self.deadlines.may_be_due(now) {
            self.fire_due(now);
        }
    }

    /// `handle_timeout` when something may be due.
    fn fire_due(&mut self, now: At) {
        let now_tick = now.0 / TICK_NS;
        // Rooms whose nursery span ended move to the wheel first (their deadlines may be due now).
        while let Some((slot, epoch)) = self.deadlines.pop_nursery(now) {
            let (held_epoch, room) = self.rooms.get_with_epoch(slot);
            debug_assert_eq!(held_epoch, epoch, "a room leaves the nursery before its slot is reused");
            debug_assert!(deadlines::in_nursery(room.wheel_entry));
            room.wheel_entry = self.deadlines.promote(slot, epoch, room.earliest_wheel_deadline());
        }
        while let Some(payload) = self.deadlines.wheel.pop_expired(now) {
            let (slot, epoch) = decode_entry(payload);
            if !self.rooms.holds(slot, epoch) {
                debug_assert!(false, "timer for a vanished room");
                continue;
            }
            self.room_mut(slot).wheel_entry = NIL;
            // Fire the room's due timers earliest first; a handler may disarm the others.
            while let Some(kind) = self.room_at(slot).due_timer(now_tick) {
                self.room_mut(slot).armed &= !kind.bit();
                self.on_timer(now, slot, kind);
                if !self.rooms.holds(slot, epoch) {
                    break;
                }
            }
            if self.rooms.holds(slot, epoch) {
                self.sync_wheel_entry(now, slot);
            }
        }
        // Tombstones expire in FIFO order (`tombstone_ttl_ms` after they settled).
        self.rooms.expire_due(now_tick, &mut self.metrics);
    }

    /// The next command for the driver, in order.
    #[inline]
    pub fn poll_command(&mut self) -> Option<Command> {
        self.commands.pop_front()
    }

    /// When the core next needs `handle_timeout` (None: no timer armed). It may be a little early
    /// (a wheel level boundary, or the end of a 64 ms nursery span): calling `handle_timeout` then is
    /// cheap and correct.
    pub fn poll_timeout(&self) -> Option<At> {
        let tombstone = self.rooms.next_expiry().map(Wheel::fire_time);
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
        self.rooms.live()
    }

    /// Timer entries held: wheel entries (at most one per room) plus tombstone expiries (for leak
    /// checks: 0 once every room is dropped).
    pub fn armed_timers(&self) -> usize {
        self.deadlines.len() + self.rooms.records()
    }

    /// Rooms held: in the slab (live and quarantined) plus tombstone records.
    pub fn held_rooms(&self) -> usize {
        self.rooms.held()
    }

    // ----- the timer table's one match -----

    fn on_timer(&mut self, now: At, slot: u32, kind: TimerKind) {
        self.room_mut(slot).touch(now, LastEvent::TimerFired);
        match kind {
            // CONFORMANCE: TIME-6
            TimerKind::Bootstrap => {
                self.fail_room(now, slot, RoomInput::BootstrapTimer, FailReason::BootstrapTimeout, None, None)
            }
            TimerKind::Transfer => {
                self.fail_room(now, slot, RoomInput::TransferTimer, FailReason::TransferTimeout, None, None)
            }
            TimerKind::Room => self.fail_room(now, slot, RoomInput::RoomTimer, FailReason::RoomTimeout, None, None),
            TimerKind::PluginGrace => self.plugin_grace_expired(now, slot),
            TimerKind::Quarantine => {
                self.release_quarantine(now, slot, RoomInput::QuarantineTimer, ReleaseCause::QuarantineTimeout)
            }
            // Tombstones expire from the tombstone FIFO (`handle_timeout`), never from the wheel.
            TimerKind::Tombstone => unreachable!("a tombstone expiry in the wheel"),
        }
    }

    // ----- rooms, states, timers -----

    #[inline]
    fn room_at(&self, slot: u32) -> &Room {
        self.rooms.get(slot)
    }

    #[inline]
    fn room_mut(&mut self, slot: u32) -> &mut Room {
        self.rooms.get_mut(slot)
    }

    /// Open a room: the one place a room is created. An older generation of its key is superseded
    /// first; the room, built by `build` (with its overall deadline), joins the store, is bound to
    /// `peer` when known, gets its bootstrap and room deadlines, and the engine hears its first
    /// state.
    fn open_room(&mut self, now: At, older: Lookup, peer: Option<PeerId>, build: impl FnOnce() -> Room) -> u32 {
        if let Lookup::Older(old) = older {
            self.supersede(now, old);
        }
        let slot = self.rooms.open(build, &mut self.metrics);
        if let Some(peer) = peer {
            self.link_peer(slot, peer);
        }
        let room = self.room_at(slot);
        let (key, role, state, deadline, plugin) = (room.key, room.role, room.state, room.deadline, room.plugin());
        self.arm(now, slot, TimerKind::Bootstrap, now.saturating_add(Span::from_ms(self.config.bootstrap_timeout_ms)));
        self.arm(now, slot, TimerKind::Room, deadline);
        self.push_engine(RoomEvent::StateChanged { room: key, role, state, from: None, opened_at: now, plugin });
        slot
    }

    /// Apply one input through the transition table (the store keeps the gauges); the engine
    /// hears of every new live state.
    fn apply(&mut self, now: At, slot: u32, input: RoomInput) -> Result<(), IllegalTransition> {
        if let Some(moved) = self.rooms.transition(now, slot, input, &mut self.metrics)? {
            if !moved.to.is_terminal() {
                let room = self.room_at(slot);
                let (opened_at, plugin) = (room.created, room.plugin());
                self.push_engine(RoomEvent::StateChanged {
                    room: moved.key,
                    role: moved.role,
                    state: moved.to,
                    from: Some(moved.from),
                    opened_at,
                    plugin,
                });
            }
        }
        Ok(())
    }

    /// Apply one input through the transition table; an input the table refuses (a core bug) is
    /// counted and kept (`Metrics::illegal_transitions`), never dropped unseen. Returns whether it
    /// was applied.
    fn step(&mut self, now: At, slot: u32, input: RoomInput) -> bool {
        match self.apply(now, slot, input) {
            Ok(_) => true,
            Err(illegal) => {
                self.count_refused_input(illegal.into());
                false
            }
        }
    }

    /// An input a declared table refused (a core bug): counted and kept, never dropped unseen.
    pub(super) fn count_refused_input(&mut self, refused: crate::lifecycle::RefusedInput) {
        debug_assert!(false, "{refused}");
        self.metrics.illegal_transitions += 1;
        self.metrics.latest_illegal_transition = Some(refused);
    }

    /// Arm (or re-arm) the room's timer of `kind` (never `Tombstone`: see `settle`). The room's one
    /// wheel entry moves only when the new deadline comes before it.
    fn arm(&mut self, now: At, slot: u32, kind: TimerKind, deadline: At) {
        debug_assert!(kind != TimerKind::Tombstone);
        let (epoch, room) = self.rooms.get_with_epoch(slot);
        room.set_timer(kind, deadline);
        room.wheel_entry = self.deadlines.lower(now, room.wheel_entry, slot, epoch, deadline);
    }

    /// Disarm `from` and arm `to` at `deadline`.
    fn move_timer(&mut self, now: At, slot: u32, from: TimerKind, to: TimerKind, deadline: At) {
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
    fn sync_wheel_entry(&mut self, now: At, slot: u32) {
        let (epoch, room) = self.rooms.get_with_epoch(slot);
        room.wheel_entry = self.deadlines.sync(now, room.wheel_entry, slot, epoch, room.earliest_wheel_deadline());
    }

    #[inline]
    fn timer_deadline(&self, slot: u32, kind: TimerKind) -> Option<At> {
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
    fn link_transfer_deadline(&mut self, now: At, slot: u32) -> At {
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

    fn transfer_budget(&self, bytes: u64) -> Span {
        let bandwidth = self.config.min_bandwidth_bytes_per_s;
        // The 64-bit division when the product fits (below ~18 GB), the 128-bit one otherwise.
        let per_byte_ns = match bytes.checked_mul(1_000_000_000) {
            Some(scaled) => scaled / bandwidth,
            None => ((bytes as u128 * 1_000_000_000u128) / bandwidth as u128).min(u64::MAX as u128) as u64,
        };
        Span::from_ms(self.config.transfer_base_ms).saturating_add(Span(per_byte_ns))
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
