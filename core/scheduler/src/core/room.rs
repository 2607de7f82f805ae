//! One room's data as the core keeps it in its slab: common bookkeeping plus the sender's or the
//! receiver's parts. Plain data with small helpers; every decision is taken in the core's handlers.

use crate::api::*;
use crate::lifecycle::{TicketState, TransferState};
use crate::timer::TimerKind;
use crate::wheel::Wheel;
use kvgate_abi::{PeerId, RemoteKey, Ticket};
use smallvec::SmallVec;

pub(crate) const NIL: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
pub(crate) struct ChunkXfer {
    pub xfer: u64,
    pub bytes: u64,
    pub state: TransferState,
}

/// A chunk accepted before the expect notice arrived.
#[derive(Clone, Debug)]
pub(crate) struct HeldChunk {
    /// Boxed: a held chunk never grows, and the box is 8 bytes smaller than a Vec.
    pub slices: Box<[Slice]>,
    /// Where its bytes go in the part's destination stream (`AT_CURSOR`: after the previous chunk's).
    pub at: u64,
    pub last: bool,
}

/// `HeldChunk::at` of a chunk placed in chunk order.
pub(crate) const AT_CURSOR: u64 = u64::MAX;

/// How a part's chunks say where their bytes go: not yet known (no chunk), one after the other in
/// chunk order, or each at its own offset (any order).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Placement {
    #[default]
    Unset,
    Cursor,
    Explicit,
}

/// One destination slice resolved to the peer's remote key.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DestSlice {
    pub key: RemoteKey,
    pub offset: u64,
    pub len: u64,
}

#[derive(Clone, Debug, Default)]
pub(crate) struct SendPart {
    pub ticket: Ticket,
    /// The plugin the receiver opened the ticket on (set with the notice): every chunk of the part
    /// goes through it. One byte (`PluginSlot` below `MAX_PLUGIN_SLOTS`): a sender room stays within
    /// its memory budget.
    plugin: u8,
    /// Set once from the expect notice; one slice inline (no heap block in the common case).
    pub dest: SmallVec<[DestSlice; 1]>,
    pub dest_total: u64,
    /// Bytes of the destination stream already claimed by accepted chunks.
    pub filled: u64,
    pub cursor_slice: u32,
    pub cursor_offset: u64,
    /// Cursor placement: the next chunk number expected. Explicit placement: chunks accepted.
    pub next_chunk: u32,
    /// Cursor placement: the last chunk was accepted. Explicit: every byte is covered.
    pub last_seen: bool,
    pub placement: Placement,
    /// Explicit placement: the byte ranges of the part's stream already covered, sorted and merged.
    /// Boxed: 8 bytes in every part, where a `Vec` would take 24 in the many that never use it.
    #[allow(clippy::box_collection)]
    pub covered: Option<Box<Vec<(u64, u64)>>>,
    pub chunks_succeeded: u32,
    pub done: bool,
    /// One chunk inline (most parts are one chunk), more spill to the heap.
    pub chunks: SmallVec<[ChunkXfer; 1]>,
    /// Chunks accepted before the notice; one inline, more spill to the heap.
    pub held: SmallVec<[HeldChunk; 1]>,
}

/// Plugin slots a room's parts can use: `0..MAX_PLUGIN_SLOTS` (a peer's plugins past it are ignored).
pub(crate) const MAX_PLUGIN_SLOTS: u32 = 255;

impl SendPart {
    pub fn plugin(&self) -> PluginSlot {
        PluginSlot(self.plugin as u32)
    }

    pub fn set_plugin(&mut self, plugin: PluginSlot) {
        debug_assert!(plugin.0 < MAX_PLUGIN_SLOTS);
        self.plugin = plugin.0 as u8;
    }

    /// Another sender sends this part (the notice gave it no slices): done from the start, never
    /// sent here. Own parts always have a destination.
    pub fn foreign(&self) -> bool {
        self.done && self.dest.is_empty()
    }
}

#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RecvPart {
    pub bytes: u64,
    pub done: bool,
    pub ticket: TicketState,
    /// The plugin the part's ticket is open on (chosen from its memory at the expect).
    pub plugin: PluginSlot,
    /// Which of the room's senders the part comes from (an index into `Senders::peers`; 0, the
    /// room's bound peer, when it has one sender).
    pub sender: u16,
}

/// The senders of a receiver room whose parts come from several peers: index 0 is the room's bound
/// peer. Each entry says whether that sender confirmed that nothing more from it can land.
#[derive(Clone, Debug, Default)]
pub(crate) struct Senders {
    pub peers: SmallVec<[(PeerId, bool); 2]>,
}

#[derive(Clone, Debug)]
pub(crate) enum RoleData {
    Sender {
        notice: bool,
        parts: Vec<SendPart>,
    },
    /// One part inline (no heap block per room in the common case); a receiver's part list
    /// never changes length. `senders`: set when the parts come from more than one peer.
    Receiver {
        ticket_base: u64,
        parts: SmallVec<[RecvPart; 1]>,
        senders: Option<Box<Senders>>,
    },
}

#[derive(Clone, Debug)]
pub(crate) struct Room {
    pub key: RoomKey,
    pub role: Role,
    pub state: RoomState,
    pub last_event: LastEvent,
    /// The bound peer's id, meaningful when `has_peer` (a flag, not an Option: 8 bytes less).
    peer_id: u64,
    has_peer: bool,
    /// The bound peer's plugin instance, meaningful when `has_peer` (bound together).
    plugin_slot: PluginSlot,
    pub created: At,
    pub state_entered: At,
    pub last_event_at: At,
    /// The room's overall deadline.
    pub deadline: At,
    /// Timer deadlines, meaningful when the kind's bit (`1 << kind`) is set in `armed`. Kinds that
    /// are never armed together share a cell (see `timer_cell`); `Room` is `deadline`.
    timer_at: [At; 3],
    pub armed: u8,
    /// The room's one wheel entry (NIL: none), due no later than its earliest armed timer other
    /// than `Tombstone` (tombstones expire from the core's tombstone FIFO).
    pub wheel_entry: u32,
    /// Intrusive list of the live rooms of `peer`.
    pub peer_prev: u32,
    pub peer_next: u32,
    pub in_peer_list: bool,
    pub failure: Option<Failure>,
    pub bytes_total: u64,
    pub bytes_done: u64,
    pub parts_done: u32,
    /// Sender: transfers without a terminal event. Receiver: tickets not reported quiesced.
    pub in_flight: u32,
    /// Sender: transfers failed (or forced) and not quiesced.
    pub unquiesced: u32,
    /// Where `bytes_total` is counted (it never changes once the transfer started).
    pub bytes_counted: BytesCounted,
    pub data: RoleData,
}

impl Room {
    pub fn new(key: RoomKey, role: Role, state: RoomState, now: At, data: RoleData) -> Room {
        Room {
            key,
            role,
            state,
            last_event: LastEvent::Created,
            peer_id: 0,
            has_peer: false,
            plugin_slot: PluginSlot(0),
            created: now,
            state_entered: now,
            last_event_at: now,
            deadline: now,
            timer_at: [At::ZERO; 3],
            armed: 0,
            wheel_entry: NIL,
            peer_prev: NIL,
            peer_next: NIL,
            in_peer_list: false,
            failure: None,
            bytes_total: 0,
            bytes_done: 0,
            parts_done: 0,
            in_flight: 0,
            unquiesced: 0,
            bytes_counted: BytesCounted::Nowhere,
            data,
        }
    }

    /// The peer the room is bound to.
    pub fn peer(&self) -> Option<PeerId> {
        self.has_peer.then_some(PeerId(self.peer_id))
    }

    /// The plugin instance of the room's first part (the peer's preferred one until the parts are
    /// assigned theirs): what a room view shows.
    pub fn plugin(&self) -> Option<PluginSlot> {
        self.has_peer.then_some(self.plugin_slot)
    }

    /// Bind the room to `peer` and the plugin instance used with it.
    pub fn set_peer(&mut self, peer: PeerId, plugin: PluginSlot) {
        self.peer_id = peer.0;
        self.plugin_slot = plugin;
        self.has_peer = true;
    }

    /// Where a kind's deadline lives: `Bootstrap` and `Transfer` are exclusive (the room's
    /// bootstrap timer becomes its transfer timer), so are `Quarantine` and `Tombstone` (a room is
    /// settled once released); `Room` (None) is the room's `deadline`.
    fn timer_cell(kind: TimerKind) -> Option<usize> {
        match kind {
            TimerKind::Bootstrap | TimerKind::Transfer => Some(0),
            TimerKind::PluginGrace => Some(1),
            TimerKind::Quarantine | TimerKind::Tombstone => Some(2),
            TimerKind::Room => None,
        }
    }

    /// The raw deadline of `kind` (meaningful when armed).
    fn timer_at(&self, kind: TimerKind) -> At {
        match Room::timer_cell(kind) {
            Some(cell) => self.timer_at[cell],
            None => self.deadline,
        }
    }

    /// Arm `kind` at `deadline` (the room's own bookkeeping only: the core moves the wheel entry).
    pub fn set_timer(&mut self, kind: TimerKind, deadline: At) {
        match Room::timer_cell(kind) {
            Some(cell) => {
                let sharing = match kind {
                    TimerKind::Bootstrap => TimerKind::Transfer.bit(),
                    TimerKind::Transfer => TimerKind::Bootstrap.bit(),
                    TimerKind::Quarantine => TimerKind::Tombstone.bit(),
                    TimerKind::Tombstone => TimerKind::Quarantine.bit(),
                    _ => 0,
                };
                debug_assert_eq!(self.armed & sharing, 0, "{kind:?} armed with the timer sharing its cell");
                self.timer_at[cell] = deadline;
            }
            None => self.deadline = deadline,
        }
        self.armed |= kind.bit();
    }

    /// The deadline of the room's timer of `kind`, if armed (rounded up to the wheel tick it
    /// fires at).
    pub fn timer(&self, kind: TimerKind) -> Option<At> {
        (self.armed & kind.bit() != 0).then(|| Wheel::fire_time(self.timer_at(kind)))
    }

    /// The due timer (tick at or before `now_tick`) that fires first, ties broken by kind order;
    /// `Tombstone` excluded.
    pub fn due_timer(&self, now_tick: u64) -> Option<TimerKind> {
        let mut best: Option<(u64, TimerKind)> = None;
        for kind in TimerKind::WHEEL {
            if self.armed & kind.bit() == 0 {
                continue;
            }
            let tick = Wheel::tick_of(self.timer_at(kind));
            if tick <= now_tick && best.is_none_or(|(t, _)| tick < t) {
                best = Some((tick, kind));
            }
        }
        best.map(|(_, kind)| kind)
    }

    /// The earliest armed deadline other than `Tombstone`.
    pub fn earliest_wheel_deadline(&self) -> Option<At> {
        TimerKind::WHEEL.into_iter().filter(|kind| self.armed & kind.bit() != 0).map(|kind| self.timer_at(kind)).min()
    }

    pub fn part_count(&self) -> u32 {
        match &self.data {
            RoleData::Sender { parts, .. } => parts.len() as u32,
            RoleData::Receiver { parts, .. } => parts.len() as u32,
        }
    }

    /// The peers a receiver room's parts come from, beyond its bound peer (empty for one sender).
    pub fn extra_senders(&self) -> impl Iterator<Item = PeerId> + '_ {
        let senders = match &self.data {
            RoleData::Receiver { senders: Some(senders), .. } => &senders.peers[1..],
            _ => &[],
        };
        senders.iter().map(|(peer, _)| *peer)
    }

    /// Whether `peer` is the room's bound peer or one of its other senders.
    pub fn bound_to(&self, peer: PeerId) -> bool {
        self.peer() == Some(peer) || self.extra_senders().any(|p| p == peer)
    }

    pub fn touch(&mut self, now: At, event: LastEvent) {
        self.last_event = event;
        self.last_event_at = now;
    }
}

/// Where a room's bytes are counted: with its peer's bytes moving while its transfer runs
/// (`Core::leave_link`), in the quarantined-bytes gauge while terminal with memory held. One or the
/// other, never both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BytesCounted {
    Nowhere,
    OnLink,
    InQuarantine,
}

/// A slab slot: the epoch changes every time the slot is reused, so stale timers and ids that name
/// an old occupant are recognised.
pub(crate) struct Slot {
    pub epoch: u32,
    pub room: Option<Room>,
}
