//! One room's data as the core keeps it in its slab: common bookkeeping plus the sender's or the
//! receiver's parts. Plain data with small helpers; every decision is taken in the core's handlers.

use crate::api::*;
use crate::timer::TimerKind;
use crate::wheel::TimerHandle;
use kvgate_abi::{PeerId, RemoteKey, Ticket};
use smallvec::SmallVec;

pub(crate) const NIL: u32 = u32::MAX;

/// Where a transfer (one chunk) stands, as far as the core knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum XferState {
    /// Submitted, no terminal event yet.
    InFlight,
    /// `SUCCEEDED` (implies quiesced).
    Succeeded,
    /// `FAILED`, bytes may still land.
    FailedUnquiesced,
    /// `FAILED` and quiesced (flag or separate event).
    FailedQuiesced,
    /// Forced failed by the plugin-grace timer; bytes may still land.
    ForcedSilent,
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct ChunkXfer {
    pub xfer: u64,
    pub bytes: u64,
    pub state: XferState,
}

/// A chunk accepted before the expect notice arrived.
#[derive(Clone, Debug)]
pub(crate) struct HeldChunk {
    /// Boxed: a held chunk never grows, and the box is 8 bytes smaller than a Vec.
    pub slices: Box<[Slice]>,
    pub last: bool,
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
    /// Boxed: set once from the expect notice (8 bytes smaller than a Vec).
    pub dest: Box<[DestSlice]>,
    pub dest_total: u64,
    /// Bytes of the destination stream already claimed by accepted chunks.
    pub filled: u64,
    pub cursor_slice: u32,
    pub cursor_offset: u64,
    pub next_chunk: u32,
    pub last_seen: bool,
    pub chunks_succeeded: u32,
    pub done: bool,
    pub chunks: Vec<ChunkXfer>,
    /// Chunks accepted before the notice; one inline, more spill to the heap.
    pub held: SmallVec<[HeldChunk; 1]>,
}

#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RecvPart {
    pub bytes: u64,
    pub done: bool,
    pub ticket_open: bool,
}

#[derive(Clone, Debug)]
pub(crate) enum RoleData {
    Sender { notice: bool, parts: Vec<SendPart> },
    /// Boxed: a receiver's part list never changes length (8 bytes smaller than a Vec).
    Receiver { ticket_base: u64, parts: Box<[RecvPart]> },
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
    pub plugin: Option<PluginSlot>,
    pub created: Nanos,
    pub state_entered: Nanos,
    pub last_event_at: Nanos,
    /// The room's overall deadline.
    pub deadline: Nanos,
    pub timers: [u32; TimerKind::COUNT],
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
    /// Whether `bytes_total` is counted in the quarantined-bytes gauge (it never changes once
    /// the room is terminal).
    pub quarantine_counted: bool,
    /// Whether this core remembers the room only as a tombstone (never had a local engine).
    pub tombstone_only: bool,
    pub data: RoleData,
}

impl Room {
    pub fn new(key: RoomKey, role: Role, state: RoomState, now: Nanos, data: RoleData) -> Room {
        Room {
            key,
            role,
            state,
            last_event: LastEvent::Created,
            peer_id: 0,
            has_peer: false,
            plugin: None,
            created: now,
            state_entered: now,
            last_event_at: now,
            deadline: now,
            timers: [NIL; TimerKind::COUNT],
            peer_prev: NIL,
            peer_next: NIL,
            in_peer_list: false,
            failure: None,
            bytes_total: 0,
            bytes_done: 0,
            parts_done: 0,
            in_flight: 0,
            unquiesced: 0,
            quarantine_counted: false,
            tombstone_only: false,
            data,
        }
    }

    /// The peer the room is bound to.
    pub fn peer(&self) -> Option<PeerId> {
        self.has_peer.then_some(PeerId(self.peer_id))
    }

    pub fn set_peer(&mut self, peer: PeerId) {
        self.peer_id = peer.0;
        self.has_peer = true;
    }

    pub fn timer(&self, kind: TimerKind) -> Option<TimerHandle> {
        let raw = self.timers[kind.index()];
        (raw != NIL).then(|| TimerHandle::from_raw(raw))
    }

    pub fn part_count(&self) -> u32 {
        match &self.data {
            RoleData::Sender { parts, .. } => parts.len() as u32,
            RoleData::Receiver { parts, .. } => parts.len() as u32,
        }
    }

    pub fn touch(&mut self, now: Nanos, event: LastEvent) {
        self.last_event = event;
        self.last_event_at = now;
    }
}

/// A slab slot: the epoch changes every time the slot is reused, so stale timers and ids that name
/// an old occupant are recognised.
pub(crate) struct Slot {
    pub epoch: u32,
    pub room: Option<Room>,
}
