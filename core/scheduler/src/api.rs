//! The public vocabulary of kvgate-core: ids, requests, refusals, peer messages, commands and room
//! events. Plain data only; the gateway serialises what crosses a wire. This module never holds state
//! and never decides anything: the decisions live in `core` and `table`.

use kvgate_abi::{LocalKey, LocalRange, PeerId, ReasonCode, Segment, Ticket, XferId};
use serde::{Deserialize, Serialize};
use std::fmt;

/// An instant: monotonic nanoseconds from an origin the driver picks. Instants are compared, moved
/// by a `Span` (`saturating_add`) and subtracted into a `Span` (`saturating_since`); they are never
/// added to each other.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct At(pub u64);

/// A span of time in nanoseconds: a timeout, an age, an elapsed time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Span(pub u64);

impl At {
    /// The driver's origin.
    pub const ZERO: At = At(0);
    pub const MAX: At = At(u64::MAX);
    /// The instant `span` after the driver's origin.
    pub const fn from_origin(span: Span) -> At {
        At(span.0)
    }
    /// `span` after this instant (saturating at `At::MAX`).
    pub const fn saturating_add(self, span: Span) -> At {
        At(self.0.saturating_add(span.0))
    }
    /// `span` before this instant (saturating at the origin).
    pub const fn saturating_sub(self, span: Span) -> At {
        At(self.0.saturating_sub(span.0))
    }
    /// The span from `earlier` to this instant (zero if `earlier` is later).
    pub const fn saturating_since(self, earlier: At) -> Span {
        Span(self.0.saturating_sub(earlier.0))
    }
    /// The span from the driver's origin to this instant.
    pub const fn since_origin(self) -> Span {
        Span(self.0)
    }
}

impl Span {
    pub const ZERO: Span = Span(0);
    pub const MAX: Span = Span(u64::MAX);
    pub const fn from_ms(ms: u64) -> Span {
        Span(ms.saturating_mul(1_000_000))
    }
    pub const fn from_us(us: u64) -> Span {
        Span(us.saturating_mul(1_000))
    }
    pub const fn from_secs(s: u64) -> Span {
        Span(s.saturating_mul(1_000_000_000))
    }
    pub const fn as_ms(self) -> u64 {
        self.0 / 1_000_000
    }
    pub const fn saturating_add(self, other: Span) -> Span {
        Span(self.0.saturating_add(other.0))
    }
    pub const fn saturating_sub(self, other: Span) -> Span {
        Span(self.0.saturating_sub(other.0))
    }
}

impl fmt::Display for At {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", Span(self.0))
    }
}

impl fmt::Display for Span {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{:06}ms", self.0 / 1_000_000, self.0 % 1_000_000)
    }
}

/// A room: an id both engines agree on plus a generation. A reused `room` with a higher generation
/// starts clean; anything for a lower generation is refused as late.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct RoomKey {
    pub room: u64,
    pub generation: u32,
}

impl RoomKey {
    pub const fn new(room: u64, generation: u32) -> RoomKey {
        RoomKey { room, generation }
    }
}

impl fmt::Display for RoomKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}", self.room, self.generation)
    }
}

/// How an expect's parts are sent, beyond the room's bound peer (`Core::handle_expect_from`); the
/// default is the plain expect (every part from the bound peer, read from memory of its
/// destination's kind).
#[derive(Clone, Copy, Debug, Default)]
pub struct ExpectShape<'a> {
    /// Each part's sender (`part_peers[p]`; missing: the room's bound peer).
    pub part_peers: &'a [PeerId],
    /// The memory kind each part's sender reads it from (`source_kinds[p]`; None or missing: the
    /// kind of the part's first destination region).
    pub source_kinds: &'a [Option<kvgate_abi::MemoryKind>],
}

/// Which side of a room this core plays. One gateway plays sender for some rooms and receiver for
/// others (and both for a room whose two engines share the gateway).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// The prefill side: gets `Send`s from its engine, submits the writes.
    Sender,
    /// The decode side: gets the `Expect`, owns the destination memory.
    Receiver,
}

impl Role {
    pub const ALL: [Role; 2] = [Role::Sender, Role::Receiver];
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Sender => "sender",
            Role::Receiver => "receiver",
        }
    }
    pub fn opposite(self) -> Role {
        match self {
            Role::Sender => Role::Receiver,
            Role::Receiver => Role::Sender,
        }
    }
}

/// A local memory region, as numbered by the engine that registered it (unique per gateway).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct RegionId(pub u64);

/// One opened plugin instance, as numbered by the driver.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct PluginSlot(pub u32);

impl PluginSlot {
    /// No plugin instance: a plugin name in an expect notice that this gateway did not open.
    pub const NONE: PluginSlot = PluginSlot(u32::MAX);
}

/// A plugin instance connected with a peer, and the memory kinds it serves (bits of
/// `kvgate_abi::MemoryKind::bit`): a peer's plugins are given in preference order, and each part of
/// a room uses the first that serves its memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PeerPlugin {
    pub slot: PluginSlot,
    pub memory_kinds: u32,
}

/// `len` bytes at `offset` in `region`. In an `Expect` the region is local (destination); in a
/// `Send` it is local (source); in an `ExpectNotice` it is the receiver's region id.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Slice {
    pub region: RegionId,
    pub offset: u64,
    pub len: u64,
}

impl Slice {
    pub const fn new(region: RegionId, offset: u64, len: u64) -> Slice {
        Slice { region, offset, len }
    }
}

/// What an engine asks of its gateway.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EngineRequest {
    /// Decode side: bytes for `room` will come from `peer` into `parts[p]` (its slices, concatenated,
    /// are part p's byte stream). `timeout_ms`: the room's overall deadline from now (None: the
    /// configured `room_timeout_ms`; capped by `max_room_timeout_ms`).
    Expect { room: RoomKey, peer: PeerId, parts: Vec<Vec<Slice>>, timeout_ms: Option<u64> },
    /// Prefill side: chunk `chunk` (0, 1, 2.. in order) of part `part`, read from `slices`, lands
    /// right after chunk-1 in the part's stream. `peer`: where the room's receiver lives, when the
    /// engine knows it (None: bound to whichever peer sends the room's `ExpectNotice`).
    Send { room: RoomKey, peer: Option<PeerId>, part: u32, chunk: u32, slices: Vec<Slice>, last: bool },
    /// Stop the room now. `role` None: every local room with that key (both roles).
    Abort { room: RoomKey, role: Option<Role> },
}

/// Why an engine request was refused. A refusal changes nothing (except that a refused request for
/// a tombstoned room is counted as late).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum RefusalReason {
    /// A slice names a region this gateway does not have registered.
    UnknownRegion,
    /// A slice lies (partly) outside its region, or has zero length.
    SliceOutOfRange,
    /// The last chunk leaves the destination short, or a chunk overflows it.
    LengthMismatch,
    /// A chunk number already accepted for this part.
    DuplicateChunk,
    /// A chunk number past the next expected one.
    OutOfOrderChunk,
    /// A chunk after the part's last chunk.
    ChunkAfterLast,
    /// A part number past the room's part count (or `max_parts_per_room`).
    UnknownPart,
    /// An `Expect` for a room that is already live.
    DuplicateExpect,
    /// The room (this generation) is terminal or tombstoned: the request is late.
    RoomTerminal,
    /// A higher generation of this room exists: the request is late.
    StaleGeneration,
    /// The request names a peer that is not connected (no `handle_peer_up`).
    PeerNotConnected,
    /// A `Send` names a different peer than the room is bound to.
    PeerMismatch,
    /// An `Expect` with no parts, a part with no slices, or an empty `Send`.
    EmptyRequest,
    /// `max_inflight_rooms` reached.
    TooManyRooms,
    /// `max_parts_per_room` exceeded.
    TooManyParts,
    /// `max_chunks_per_part` exceeded.
    TooManyChunks,
    /// `max_slices_per_request` exceeded.
    TooManySlices,
    /// The chunk maps to more than `max_segments_per_submit` segments (the core refuses; it never
    /// splits a chunk into several submits).
    TooManySegments,
    /// `max_pending_sends` (chunks held without an expect) reached.
    TooManyPendingSends,
    /// The engine's `timeout_ms` is 0.
    InvalidTimeout,
    /// A chunk placed at an offset covers bytes an earlier chunk of the part already covers.
    OverlappingChunk,
    /// A part's chunks mix placement at an explicit offset with placement in chunk order.
    PlacementMismatch,
    /// Two destination slices of an expect (of one part or of two) cover the same bytes.
    OverlappingSlices,
    /// No plugin connected with the peer can serve the memory: for an expect, none holds a key for
    /// every destination region of a part and serves the part's source memory kind; for a send, a
    /// source region is not registered with the plugin the receiver chose for the part.
    NoPluginForMemory,
}

impl RefusalReason {
    pub const COUNT: usize = 24;
    pub fn index(self) -> usize {
        self as usize
    }
    pub fn as_str(self) -> &'static str {
        match self {
            RefusalReason::UnknownRegion => "unknown_region",
            RefusalReason::SliceOutOfRange => "slice_out_of_range",
            RefusalReason::LengthMismatch => "length_mismatch",
            RefusalReason::DuplicateChunk => "duplicate_chunk",
            RefusalReason::OutOfOrderChunk => "out_of_order_chunk",
            RefusalReason::ChunkAfterLast => "chunk_after_last",
            RefusalReason::UnknownPart => "unknown_part",
            RefusalReason::DuplicateExpect => "duplicate_expect",
            RefusalReason::RoomTerminal => "room_terminal",
            RefusalReason::StaleGeneration => "stale_generation",
            RefusalReason::PeerNotConnected => "peer_not_connected",
            RefusalReason::PeerMismatch => "peer_mismatch",
            RefusalReason::EmptyRequest => "empty_request",
            RefusalReason::TooManyRooms => "too_many_rooms",
            RefusalReason::TooManyParts => "too_many_parts",
            RefusalReason::TooManyChunks => "too_many_chunks",
            RefusalReason::TooManySlices => "too_many_slices",
            RefusalReason::TooManySegments => "too_many_segments",
            RefusalReason::TooManyPendingSends => "too_many_pending_sends",
            RefusalReason::InvalidTimeout => "invalid_timeout",
            RefusalReason::OverlappingChunk => "overlapping_chunk",
            RefusalReason::PlacementMismatch => "placement_mismatch",
            RefusalReason::OverlappingSlices => "overlapping_slices",
            RefusalReason::NoPluginForMemory => "no_plugin_for_memory",
        }
    }
    pub const ALL: &'static [RefusalReason] = &[
        RefusalReason::UnknownRegion,
        RefusalReason::SliceOutOfRange,
        RefusalReason::LengthMismatch,
        RefusalReason::DuplicateChunk,
        RefusalReason::OutOfOrderChunk,
        RefusalReason::ChunkAfterLast,
        RefusalReason::UnknownPart,
        RefusalReason::DuplicateExpect,
        RefusalReason::RoomTerminal,
        RefusalReason::StaleGeneration,
        RefusalReason::PeerNotConnected,
        RefusalReason::PeerMismatch,
        RefusalReason::EmptyRequest,
        RefusalReason::TooManyRooms,
        RefusalReason::TooManyParts,
        RefusalReason::TooManyChunks,
        RefusalReason::TooManySlices,
        RefusalReason::TooManySegments,
        RefusalReason::TooManyPendingSends,
        RefusalReason::InvalidTimeout,
        RefusalReason::OverlappingChunk,
        RefusalReason::PlacementMismatch,
        RefusalReason::OverlappingSlices,
        RefusalReason::NoPluginForMemory,
    ];
}

impl fmt::Display for RefusalReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An engine request the core refused, before any byte moved.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refusal {
    pub room: RoomKey,
    pub reason: RefusalReason,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "room {} refused: {}", self.room, self.reason)
    }
}
impl std::error::Error for Refusal {}

/// A local region, registered by the driver with every plugin that may use it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionInfo {
    pub id: RegionId,
    pub len: u64,
    pub memory_kind: kvgate_abi::MemoryKind,
    /// The region's key in each plugin instance it is registered with.
    pub keys: Vec<(PluginSlot, LocalKey)>,
}

/// Why the driver reports a peer lost.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PeerLoss {
    /// The peer link closed or failed.
    LinkClosed,
    /// Heartbeats missed past the configured bound.
    HeartbeatTimeout,
    /// The peer came back with a new incarnation (restarted).
    Restarted,
    /// A plugin reported the peer down.
    PluginPeerDown,
}

impl PeerLoss {
    pub fn as_str(self) -> &'static str {
        match self {
            PeerLoss::LinkClosed => "link_closed",
            PeerLoss::HeartbeatTimeout => "heartbeat_timeout",
            PeerLoss::Restarted => "restarted",
            PeerLoss::PluginPeerDown => "plugin_peer_down",
        }
    }
}

/// Messages between the cores of two gateways (carried by the peer link; the gateway serialises
/// them, e.g. into protobuf). Every message names its room; `to` says which role's room it is for
/// when ambiguous.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PeerMessage {
    /// Receiver → sender: the room's destination (receiver's region ids), one ticket per part, and
    /// how long the room may still live.
    /// `plugins`: the plugin each part's ticket is open on (as the core that holds the message
    /// numbers its plugin instances; the driver translates by name on the wire), one entry per
    /// part, or one entry for every part.
    ExpectNotice {
        room: RoomKey,
        parts: Vec<Vec<Slice>>,
        tickets: Vec<Ticket>,
        plugins: Vec<PluginSlot>,
        timeout: Span,
    },
    /// Sender → receiver: the expect met the first send; bytes may now move (the receiver leaves
    /// its bootstrap phase).
    Matched { room: RoomKey },
    /// Sender → receiver: every chunk of `part` succeeded (`bytes` in total).
    PartDone { room: RoomKey, part: u32, bytes: u64 },
    /// Either side: the engine aborted the room; `to` is the role of the room at the receiving core.
    Abort { room: RoomKey, reason: FailReason, to: Role },
    /// Either side: the room failed here (`reason`); `to` is the role at the receiving core.
    RoomFailed { room: RoomKey, reason: FailReason, to: Role },
    /// Sender → receiver: after a failure, no further byte from this room can land.
    Quiesced { room: RoomKey },
}

impl PeerMessage {
    pub fn room(&self) -> RoomKey {
        match self {
            PeerMessage::ExpectNotice { room, .. }
            | PeerMessage::Matched { room }
            | PeerMessage::PartDone { room, .. }
            | PeerMessage::Abort { room, .. }
            | PeerMessage::RoomFailed { room, .. }
            | PeerMessage::Quiesced { room } => *room,
        }
    }
    /// The role of the room this message is for, at the core that receives it.
    pub fn target_role(&self) -> Role {
        match self {
            PeerMessage::ExpectNotice { .. } => Role::Sender,
            PeerMessage::Matched { .. } | PeerMessage::PartDone { .. } | PeerMessage::Quiesced { .. } => Role::Receiver,
            PeerMessage::Abort { to, .. } | PeerMessage::RoomFailed { to, .. } => *to,
        }
    }
    pub fn kind_str(&self) -> &'static str {
        match self {
            PeerMessage::ExpectNotice { .. } => "expect_notice",
            PeerMessage::Matched { .. } => "matched",
            PeerMessage::PartDone { .. } => "part_done",
            PeerMessage::Abort { .. } => "abort",
            PeerMessage::RoomFailed { .. } => "room_failed",
            PeerMessage::Quiesced { .. } => "quiesced",
        }
    }
}

/// Work for the driver. The driver executes commands in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    /// Start an outgoing transfer. If the plugin's `submit` returns `Err`, the driver reports it as
    /// `Event::failed_quiesced(xfer, code, message)` through `handle_plugin_event`.
    Submit { plugin: PluginSlot, xfer: XferId, peer: PeerId, ticket: Ticket, timeout: Span, segments: Vec<Segment> },
    /// Stop an outgoing transfer (harmless if already finished).
    Cancel { plugin: PluginSlot, xfer: XferId },
    /// Receiver: authorise incoming writes under `ticket` for `timeout`.
    ExpectIncoming { plugin: PluginSlot, peer: PeerId, ticket: Ticket, timeout: Span, ranges: Vec<LocalRange> },
    /// Receiver: revoke a ticket.
    CancelIncoming { plugin: PluginSlot, peer: PeerId, ticket: Ticket },
    /// Send a message to a peer gateway.
    ToPeer { peer: PeerId, message: PeerMessage },
    /// Tell the engine(s) of the room.
    ToEngine(RoomEvent),
    /// A plugin broke its contract (already counted in `Metrics::violations`): for the driver's log.
    Violation(Violation),
}

/// A plugin contract clause the core saw broken. Each is counted; none is ever "keep waiting".
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ViolationClause {
    /// An event for a transfer id this core never submitted.
    UnknownXfer,
    /// A second terminal event (or any event) for a transfer already finished and quiesced.
    DuplicateEvent,
    /// An `EventKind` this side does not know (the transfer's room fails `plugin_protocol_violation`).
    UnknownEventKind,
    /// A `FAILED` with an unknown or missing `ReasonCode` (the room fails `plugin_protocol_violation`).
    UnknownReasonCode,
    /// No terminal event within the transfer's timeout + `plugin_grace_ms` (forced failed).
    PluginSilent,
    /// An event about a transfer from a plugin instance other than the one it was submitted to.
    WrongPlugin,
    /// `SUCCEEDED` reporting a byte count other than the transfer's.
    SucceededBytesMismatch,
    /// `QUIESCED` for an outgoing transfer that had no terminal event yet.
    QuiescedBeforeTerminal,
    /// An incoming event for a ticket this core never issued or already released.
    UnknownTicket,
    /// `PROGRESS` or `SUCCEEDED` after the transfer failed.
    EventAfterTerminal,
}

impl ViolationClause {
    pub const ALL: [ViolationClause; 10] = [
        ViolationClause::UnknownXfer,
        ViolationClause::DuplicateEvent,
        ViolationClause::UnknownEventKind,
        ViolationClause::UnknownReasonCode,
        ViolationClause::PluginSilent,
        ViolationClause::WrongPlugin,
        ViolationClause::SucceededBytesMismatch,
        ViolationClause::QuiescedBeforeTerminal,
        ViolationClause::UnknownTicket,
        ViolationClause::EventAfterTerminal,
    ];
    pub const COUNT: usize = 10;
    pub fn index(self) -> usize {
        self as usize
    }
    pub fn as_str(self) -> &'static str {
        match self {
            ViolationClause::UnknownXfer => "unknown_xfer",
            ViolationClause::DuplicateEvent => "duplicate_event",
            ViolationClause::UnknownEventKind => "unknown_event_kind",
            ViolationClause::UnknownReasonCode => "unknown_reason_code",
            ViolationClause::PluginSilent => "plugin_silent",
            ViolationClause::WrongPlugin => "wrong_plugin",
            ViolationClause::SucceededBytesMismatch => "succeeded_bytes_mismatch",
            ViolationClause::QuiescedBeforeTerminal => "quiesced_before_terminal",
            ViolationClause::UnknownTicket => "unknown_ticket",
            ViolationClause::EventAfterTerminal => "event_after_terminal",
        }
    }
}

/// A plugin contract violation the core counted, with where it came from: the plugin instance,
/// the event (none for one found on a timer: `plugin_silent`), the transfer id or ticket it named
/// and the room that id belongs to, when the core knows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Violation {
    pub clause: ViolationClause,
    pub plugin: Option<PluginSlot>,
    /// The event's kind (`EventKind::as_str`); `None` for a violation found on a timer.
    pub event: Option<&'static str>,
    pub xfer: u64,
    pub room: Option<(RoomKey, Role)>,
    /// How many violations this one report stands for (several transfers of one room forced
    /// silent at once; otherwise 1).
    pub count: u32,
}

/// The lifecycle state of a room.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RoomState {
    /// Sender: chunks held, the receiver's expect notice has not arrived.
    WaitingExpect,
    /// Sender: the expect notice arrived, no chunk yet.
    WaitingSend,
    /// Receiver: expect posted and announced, the sender has not matched it yet.
    WaitingSender,
    /// Bytes may be moving.
    Transferring,
    /// Terminal: every part succeeded. Absorbing.
    Succeeded,
    /// Terminal failure; destination (receiver) or source (sender) may still be touched by a
    /// transfer on the wire: not yet reusable.
    Quarantined,
    /// Terminal failure, memory reusable. Absorbing.
    Failed,
}

impl RoomState {
    pub const ALL: [RoomState; 7] = [
        RoomState::WaitingExpect,
        RoomState::WaitingSend,
        RoomState::WaitingSender,
        RoomState::Transferring,
        RoomState::Succeeded,
        RoomState::Quarantined,
        RoomState::Failed,
    ];
    pub const COUNT: usize = 7;
    pub fn index(self) -> usize {
        self as usize
    }
    pub fn is_terminal(self) -> bool {
        matches!(self, RoomState::Succeeded | RoomState::Quarantined | RoomState::Failed)
    }
    pub fn as_str(self) -> &'static str {
        match self {
            RoomState::WaitingExpect => "waiting_expect",
            RoomState::WaitingSend => "waiting_send",
            RoomState::WaitingSender => "waiting_sender",
            RoomState::Transferring => "transferring",
            RoomState::Succeeded => "succeeded",
            RoomState::Quarantined => "quarantined",
            RoomState::Failed => "failed",
        }
    }
    /// The phase a failure in this state belongs to.
    pub fn phase(self) -> Phase {
        match self {
            RoomState::WaitingExpect | RoomState::WaitingSend | RoomState::WaitingSender => Phase::Bootstrap,
            RoomState::Transferring => Phase::Transfer,
            RoomState::Succeeded | RoomState::Quarantined | RoomState::Failed => Phase::Terminal,
        }
    }
}

impl fmt::Display for RoomState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The phase of a room's life, for failures and metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Waiting for the counterpart (expect or first send).
    Bootstrap,
    /// Matched; bytes may move.
    Transfer,
    /// After the terminal outcome (quarantine, tombstone).
    Terminal,
}

impl Phase {
    pub const ALL: [Phase; 3] = [Phase::Bootstrap, Phase::Transfer, Phase::Terminal];
    pub const COUNT: usize = 3;
    pub fn index(self) -> usize {
        self as usize
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Bootstrap => "bootstrap",
            Phase::Transfer => "transfer",
            Phase::Terminal => "terminal",
        }
    }
}

/// Why a room failed (or, for `QuarantineTimeout`, why its memory was released without a quiesce).
/// Codes are stable snake_case strings (`as_str`), used in logs, metrics and peer messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum FailReason {
    /// The counterpart (expect or first send) never appeared within `bootstrap_timeout_ms`.
    BootstrapTimeout,
    /// Bytes did not finish within `transfer_base_ms + bytes / min_bandwidth_bytes_per_s`.
    TransferTimeout,
    /// The room's overall deadline passed.
    RoomTimeout,
    /// The local engine aborted the room.
    Aborted,
    /// The peer's engine aborted the room.
    AbortedByPeer,
    /// The peer link was lost (or the peer restarted, or a plugin reported it down).
    PeerLost,
    /// A plugin reported a transfer failed, or reported itself unhealthy.
    PluginFailed,
    /// A plugin stayed silent past its transfer timeout + `plugin_grace_ms`.
    PluginSilent,
    /// A plugin sent an event outside the contract (unknown kind or reason, bytes mismatch).
    PluginProtocolViolation,
    /// The sending side reported the room failed (its reason rides along in `Failure::peer_reason`).
    SenderFailed,
    /// The receiving side reported the room failed (its reason rides along in `Failure::peer_reason`).
    ReceiverFailed,
    /// The receiving plugin refused or broke incoming writes for the room's ticket.
    IncomingFailed,
    /// Held chunks do not fit the destination that the expect notice announced.
    LengthMismatch,
    /// A held chunk maps to more than `max_segments_per_submit` segments.
    TooManySegments,
    /// The expect notice names a receiver region this core never learned (`handle_remote_region`),
    /// or a slice outside it.
    UnknownRemoteRegion,
    /// A source region was unregistered before its chunk was submitted.
    RegionUnregistered,
    /// The expect notice does not match the held sends (part count, ticket count).
    LayoutMismatch,
    /// A higher generation of the room replaced this one.
    Superseded,
    /// Quarantine released by `quarantine_timeout_ms`, not by a quiesce.
    QuarantineTimeout,
    /// The sending core had no room left (`max_inflight_rooms`) when the expect notice arrived.
    Overloaded,
    /// The engine session that owned the room ended (closed, or its connection gone past its grace).
    EngineLost,
    /// The expect notice assigns a part to a plugin this gateway has not connected with the peer,
    /// or a held chunk's source region is not registered with the part's plugin.
    NoPluginForMemory,
}

impl FailReason {
    pub const ALL: &'static [FailReason] = &[
        FailReason::BootstrapTimeout,
        FailReason::TransferTimeout,
        FailReason::RoomTimeout,
        FailReason::Aborted,
        FailReason::AbortedByPeer,
        FailReason::PeerLost,
        FailReason::PluginFailed,
        FailReason::PluginSilent,
        FailReason::PluginProtocolViolation,
        FailReason::SenderFailed,
        FailReason::ReceiverFailed,
        FailReason::IncomingFailed,
        FailReason::LengthMismatch,
        FailReason::TooManySegments,
        FailReason::UnknownRemoteRegion,
        FailReason::RegionUnregistered,
        FailReason::LayoutMismatch,
        FailReason::Superseded,
        FailReason::QuarantineTimeout,
        FailReason::Overloaded,
        FailReason::EngineLost,
        FailReason::NoPluginForMemory,
    ];
    pub const COUNT: usize = 22;
    pub fn index(self) -> usize {
        self as usize
    }
    pub fn as_str(self) -> &'static str {
        match self {
            FailReason::BootstrapTimeout => "bootstrap_timeout",
            FailReason::TransferTimeout => "transfer_timeout",
            FailReason::RoomTimeout => "room_timeout",
            FailReason::Aborted => "aborted",
            FailReason::AbortedByPeer => "aborted_by_peer",
            FailReason::PeerLost => "peer_lost",
            FailReason::PluginFailed => "plugin_failed",
            FailReason::PluginSilent => "plugin_silent",
            FailReason::PluginProtocolViolation => "plugin_protocol_violation",
            FailReason::SenderFailed => "sender_failed",
            FailReason::ReceiverFailed => "receiver_failed",
            FailReason::IncomingFailed => "incoming_failed",
            FailReason::LengthMismatch => "length_mismatch",
            FailReason::TooManySegments => "too_many_segments",
            FailReason::UnknownRemoteRegion => "unknown_remote_region",
            FailReason::RegionUnregistered => "region_unregistered",
            FailReason::LayoutMismatch => "layout_mismatch",
            FailReason::Superseded => "superseded",
            FailReason::QuarantineTimeout => "quarantine_timeout",
            FailReason::Overloaded => "overloaded",
            FailReason::EngineLost => "engine_lost",
            FailReason::NoPluginForMemory => "no_plugin_for_memory",
        }
    }
    pub fn from_name(name: &str) -> Option<FailReason> {
        FailReason::ALL.iter().copied().find(|r| r.as_str() == name)
    }
}

impl fmt::Display for FailReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A room's failure, as reported to engines and kept in its view.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    pub reason: FailReason,
    pub phase: Phase,
    /// For `SenderFailed` / `ReceiverFailed` / `AbortedByPeer`: the reason the peer gave.
    pub peer_reason: Option<FailReason>,
    /// For `PluginFailed` / `IncomingFailed`: the plugin's `ReasonCode` value.
    pub plugin_reason: Option<u32>,
}

impl Failure {
    pub fn plugin_reason_str(&self) -> Option<&'static str> {
        self.plugin_reason.map(|code| ReasonCode(code).as_str())
    }
}

/// A room's terminal outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    Succeeded,
    Failed(Failure),
}

/// What released a room's memory for reuse.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReleaseCause {
    /// Nothing could still be in flight (success, or no transfer/ticket was ever started).
    NothingInFlight,
    /// The plugin or the peer reported every transfer quiesced.
    Quiesced,
    /// `quarantine_timeout_ms` passed first (reason code `quarantine_timeout`).
    QuarantineTimeout,
}

impl ReleaseCause {
    pub fn as_str(self) -> &'static str {
        match self {
            ReleaseCause::NothingInFlight => "nothing_in_flight",
            ReleaseCause::Quiesced => "quiesced",
            ReleaseCause::QuarantineTimeout => "quarantine_timeout",
        }
    }
}

/// What the core tells the engine(s) of a room. Every room gets exactly one `Terminal`, then exactly
/// one `Reusable` (at once after success or when nothing was in flight).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RoomEvent {
    /// The room entered a non-terminal state: from `from`, or, `None`, as the room opened here at
    /// `opened_at`. `plugin`: the instance carrying the room, once bound to a peer.
    StateChanged {
        room: RoomKey,
        role: Role,
        state: RoomState,
        from: Option<RoomState>,
        opened_at: At,
        plugin: Option<PluginSlot>,
    },
    /// One part succeeded (receiver: the sender's `PartDone`; sender: its last chunk succeeded).
    PartSucceeded { room: RoomKey, role: Role, part: u32, bytes: u64 },
    /// The room's outcome, `elapsed` since the room was created here; what the log and the
    /// metrics report of it: `bytes` landed, the peer (`PeerId.0`) and plugin instance it was bound to, and how
    /// long it spent `transferring` (`None`: it never started moving bytes).
    Terminal {
        room: RoomKey,
        role: Role,
        outcome: Outcome,
        elapsed: Span,
        bytes: u64,
        peer: Option<u64>,
        plugin: Option<PluginSlot>,
        transferring: Option<Span>,
    },
    /// No byte can land in (receiver) or be read from (sender) the room's memory any more.
    /// `plugin`: the instance that carried the room, if it was bound to a peer.
    Reusable { room: RoomKey, role: Role, cause: ReleaseCause, plugin: Option<PluginSlot> },
}

impl RoomEvent {
    pub fn room(&self) -> RoomKey {
        match self {
            RoomEvent::StateChanged { room, .. }
            | RoomEvent::PartSucceeded { room, .. }
            | RoomEvent::Terminal { room, .. }
            | RoomEvent::Reusable { room, .. } => *room,
        }
    }
    pub fn role(&self) -> Role {
        match self {
            RoomEvent::StateChanged { role, .. }
            | RoomEvent::PartSucceeded { role, .. }
            | RoomEvent::Terminal { role, .. }
            | RoomEvent::Reusable { role, .. } => *role,
        }
    }
}

/// The last thing that happened to a room (admin view).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LastEvent {
    Created,
    Expect,
    Send,
    ExpectNotice,
    Matched,
    Submitted,
    ChunkSucceeded,
    PartDone,
    Failed,
    Aborted,
    Quiesced,
    TimerFired,
}

/// A room as the admin view shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoomView {
    pub room: RoomKey,
    pub role: Role,
    pub state: RoomState,
    /// Time since the room was created here.
    pub age: Span,
    /// The peer gateway's id (`PeerId.0`), once the room is bound to one.
    pub peer: Option<u64>,
    pub plugin: Option<PluginSlot>,
    pub last_event: LastEvent,
    pub last_event_age: Span,
    /// The next deadline of the room (any timer), if one is armed.
    pub next_deadline: Option<At>,
    pub parts: u32,
    pub parts_done: u32,
    pub bytes_total: u64,
    pub bytes_done: u64,
    pub failure: Option<Failure>,
}
