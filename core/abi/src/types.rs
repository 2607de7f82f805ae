//! Plain data that crosses the plugin boundary: ids, open code sets, descriptors and events.
//! Every type here is `#[repr(C)]`/`#[repr(transparent)]` and derives `StableAbi`; code sets are
//! `u32` newtypes with named constants (never Rust enums), so a newer side can add codes and an
//! older side sees an unknown value it must treat as a failure, never as "keep waiting".

use abi_stable::{
    std_types::{RSlice, RString, RVec},
    StableAbi,
};
use std::fmt;

/// The ABI version a host and a plugin must agree on. Appending a trait method or a module field
/// keeps the version; any change to an existing layout or meaning bumps it (see `ABI.md`).
pub const ABI_VERSION: u32 = 1;

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[repr(transparent)]
        #[derive(StableAbi, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub u64);
    };
}

id_type!(
    /// One transfer as the sending plugin sees it (one chunk of one part of a room). Chosen by the
    /// host, unique per host process for the lifetime of the plugin instance.
    XferId
);
id_type!(
    /// A peer gateway, as numbered by the host. A peer that restarts gets a new id.
    PeerId
);
id_type!(
    /// A region registered with this plugin instance.
    LocalKey
);
id_type!(
    /// A peer's region, imported from the remote-key bytes that peer's plugin produced.
    RemoteKey
);
id_type!(
    /// Receiver-side authorisation for incoming writes: one per room part, chosen by the receiving
    /// host and carried by every submit that writes into that part's slices.
    Ticket
);

/// A set of named `u32` codes. Unknown values are legal on the wire and must be handled.
macro_rules! code_set {
    ($(#[$doc:meta])* $name:ident { $($(#[$cdoc:meta])* $konst:ident = $val:expr => $text:expr,)* }) => {
        $(#[$doc])*
        #[repr(transparent)]
        #[derive(StableAbi, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub u32);
        impl $name {
            $($(#[$cdoc])* pub const $konst: $name = $name($val);)*
            /// Every code this version of the ABI names.
            pub const ALL: &'static [$name] = &[$($name::$konst),*];
            /// The snake_case name used in logs and metrics; `"unknown"` for codes this side does not know.
            pub fn as_str(self) -> &'static str {
                match self.0 { $($val => $text,)* _ => "unknown" }
            }
            /// Parse a snake_case name.
            pub fn from_name(name: &str) -> Option<Self> {
                match name { $($text => Some($name::$konst),)* _ => None }
            }
            /// Whether this side knows the code.
            pub fn is_known(self) -> bool { self.as_str() != "unknown" }
        }
        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({})", self.as_str(), self.0)
            }
        }
        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result { f.write_str(self.as_str()) }
        }
    };
}

code_set!(
    /// Why a plugin call or a transfer failed.
    ReasonCode {
        /// The host cancelled the transfer.
        CANCELLED = 1 => "cancelled",
        /// The transfer's own timeout (`SubmitRequest::timeout_ns`) passed.
        TIMEOUT = 2 => "timeout",
        /// The peer died, restarted, or its connection was lost.
        PEER_LOST = 3 => "peer_lost",
        /// The peer could not be reached (connect failed, unknown endpoint).
        PEER_UNREACHABLE = 4 => "peer_unreachable",
        /// A malformed argument (bad config, bad endpoint bytes, zero-length region...).
        INVALID_ARGUMENT = 5 => "invalid_argument",
        /// A segment lies outside its region.
        OUT_OF_RANGE = 6 => "out_of_range",
        /// A local or remote key the plugin does not know (never registered, or released).
        UNKNOWN_KEY = 7 => "unknown_key",
        /// A memory kind this plugin cannot serve; refused at registration.
        UNSUPPORTED_MEMORY = 8 => "unsupported_memory",
        /// The transport reported an error.
        TRANSPORT_ERROR = 9 => "transport_error",
        /// A plugin limit was reached (in-flight transfers, segments per submit, memory).
        RESOURCE_EXHAUSTED = 10 => "resource_exhausted",
        /// Plugin code panicked; the SDK caught it at the boundary.
        PANIC = 11 => "panic",
        /// The plugin cannot run on this machine (no driver, no device); the message says why.
        UNAVAILABLE = 12 => "unavailable",
        /// The plugin is shutting down or shut down.
        SHUTDOWN = 13 => "shutdown",
        /// The peer or the plugin broke the protocol (unexpected frame, duplicate id).
        PROTOCOL_VIOLATION = 14 => "protocol_violation",
        /// The peer failed authentication (unknown or wrong certificate).
        AUTH_FAILED = 15 => "auth_failed",
        /// Data arrived corrupted and was rejected.
        DATA_CORRUPTED = 16 => "data_corrupted",
        /// A bug inside the plugin that it detected itself.
        INTERNAL = 17 => "internal",
        /// The transfer id is already live in this plugin instance.
        DUPLICATE_ID = 18 => "duplicate_id",
        /// The peer speaks an incompatible protocol or ABI version.
        VERSION_MISMATCH = 19 => "version_mismatch",
        /// No incoming ticket authorises this write at the receiver.
        NOT_EXPECTED = 20 => "not_expected",
    }
);

code_set!(
    /// What an [`Event`] reports.
    EventKind {
        /// Outgoing transfer done: every byte is visible at the destination. Terminal; implies quiesced.
        SUCCEEDED = 1 => "succeeded",
        /// Outgoing transfer failed (`reason`, `message`). Terminal. `FLAG_QUIESCED` may ride along.
        FAILED = 2 => "failed",
        /// No further byte of this transfer (outgoing `xfer`) or ticket (incoming) can land.
        QUIESCED = 3 => "quiesced",
        /// Bytes moved so far (`bytes`). Optional, never terminal.
        PROGRESS = 4 => "progress",
        /// The plugin lost the peer; its transfers get their own `FAILED` events too.
        PEER_DOWN = 5 => "peer_down",
        /// A worker of the plugin died; the plugin fails everything it held and stays unhealthy.
        UNHEALTHY = 6 => "unhealthy",
        /// Receiver side: writes under `ticket` were refused or broke (`reason`).
        INCOMING_FAILED = 7 => "incoming_failed",
    }
);

code_set!(
    /// Kind of memory a region lives in.
    MemoryKind {
        /// Host memory, mapped in this process (and, for same-host plugins, backed by a shared file).
        HOST = 1 => "host",
        /// CUDA device memory, described by an IPC handle.
        CUDA_DEVICE = 2 => "cuda_device",
    }
);

impl MemoryKind {
    /// The bit of this kind in [`Capabilities::memory_kinds`].
    pub fn bit(self) -> u32 {
        1u32.checked_shl(self.0).unwrap_or(0)
    }
}

/// Where a plugin's peers may live ([`Capabilities::scope`] bits).
pub mod scope {
    /// Peers on the same host (shared memory, CUDA IPC).
    pub const SAME_HOST: u32 = 1;
    /// Peers on other hosts (network).
    pub const CROSS_HOST: u32 = 2;
}

/// Behaviour flags ([`Capabilities::flags`]).
pub mod cap_flags {
    /// The receiving side's plugin enforces incoming tickets and reports `QUIESCED` for a ticket
    /// after `cancel_incoming`; the host then need not rely on the sender's word alone.
    pub const RECEIVER_ENFORCED: u32 = 1;
    /// The plugin emits `PROGRESS` events.
    pub const PROGRESS_EVENTS: u32 = 2;
}

/// Event flag bits ([`Event::flags`]).
pub mod event_flags {
    /// On a `FAILED` event: no further byte can land either (no separate `QUIESCED` will follow).
    pub const QUIESCED: u32 = 1;
    /// The event is about an incoming ticket, not an outgoing transfer.
    pub const INCOMING: u32 = 2;
}

/// What a plugin can do. Limits are explicit; `0` means "no limit of its own".
#[repr(C)]
#[derive(StableAbi, Clone, Debug, Default, PartialEq, Eq)]
pub struct Capabilities {
    /// Bitset of [`MemoryKind::bit`].
    pub memory_kinds: u32,
    /// Bitset of [`scope`] values.
    pub scope: u32,
    /// Bitset of [`cap_flags`].
    pub flags: u32,
    /// Most segments one submit may carry.
    pub max_segments_per_submit: u64,
    /// Most live outgoing transfers; a submit past it fails with `RESOURCE_EXHAUSTED`.
    pub max_inflight_transfers: u64,
    /// Largest single transfer in bytes.
    pub max_transfer_bytes: u64,
}

impl Capabilities {
    pub fn serves(&self, kind: MemoryKind) -> bool {
        self.memory_kinds & kind.bit() != 0
    }
}

/// Static description of a plugin.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq)]
pub struct PluginInfo {
    /// Short name, e.g. `shm`, `quic`.
    pub name: RString,
    /// The plugin's own version.
    pub version: RString,
    /// The ABI version it was built against ([`ABI_VERSION`]).
    pub abi_version: u32,
    pub capabilities: Capabilities,
}

/// A failed synchronous call.
#[repr(C)]
#[derive(StableAbi, Clone, PartialEq, Eq)]
pub struct PluginError {
    pub code: ReasonCode,
    pub message: RString,
}

impl PluginError {
    pub fn new(code: ReasonCode, message: impl Into<String>) -> Self {
        PluginError { code, message: RString::from(message.into()) }
    }
}

impl fmt::Debug for PluginError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}
impl fmt::Display for PluginError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}
impl std::error::Error for PluginError {}

/// A region of memory handed to `register`.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, Default, PartialEq, Eq)]
pub struct RegionDesc {
    pub kind: MemoryKind,
    /// CUDA device ordinal; `-1` for host memory.
    pub device: i32,
    /// Where the region is mapped in this process (host), or the device pointer once opened (0 if
    /// the plugin must open `ipc_handle` itself).
    pub addr: u64,
    pub len: u64,
    /// A file that backs the region and that a same-host peer can map (`/dev/shm/..`,
    /// `/proc/<pid>/fd/<n>` for a memfd); empty if none. For `CUDA_DEVICE` with `addr = 0` and no
    /// `ipc_handle`: `cuda-vmm-fd:<fd>:<allocation_size>`, a CUDA VMM allocation's descriptor held
    /// by the host (see [`crate::cuda_vmm`]).
    pub backing_path: RString,
    /// Offset of the region inside `backing_path`.
    pub backing_offset: u64,
    /// CUDA IPC memory handle bytes (`cuIpcGetMemHandle`), for `CUDA_DEVICE`; empty otherwise.
    pub ipc_handle: RVec<u8>,
}

impl Default for MemoryKind {
    fn default() -> Self {
        MemoryKind::HOST
    }
}

/// What `register` returns: the key for local use and the bytes a peer imports.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq)]
pub struct Registration {
    pub key: LocalKey,
    pub remote_key: RVec<u8>,
}

/// One contiguous piece of a transfer: `len` bytes from a local region to a remote one.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Segment {
    pub local: LocalKey,
    pub local_offset: u64,
    pub remote: RemoteKey,
    pub remote_offset: u64,
    pub len: u64,
}

/// An outgoing transfer (a write into the peer's memory).
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug)]
pub struct SubmitRequest<'a> {
    pub xfer: XferId,
    pub peer: PeerId,
    /// The receiver's ticket for these writes (see [`IncomingRequest`]).
    pub ticket: Ticket,
    /// The plugin must end the transfer (`FAILED`/`TIMEOUT`) no later than this many nanoseconds
    /// after `submit` returns, measured on its own monotonic clock. The host enforces it too.
    pub timeout_ns: u64,
    pub segments: RSlice<'a, Segment>,
}

impl SubmitRequest<'_> {
    pub fn total_bytes(&self) -> u64 {
        self.segments.iter().map(|s| s.len).sum()
    }
}

/// One local range that incoming writes under a ticket may touch.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LocalRange {
    pub key: LocalKey,
    pub offset: u64,
    pub len: u64,
}

/// Receiver side: authorise writes from `peer` under `ticket` into `ranges` for `timeout_ns`.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug)]
pub struct IncomingRequest<'a> {
    pub ticket: Ticket,
    pub peer: PeerId,
    pub timeout_ns: u64,
    pub ranges: RSlice<'a, LocalRange>,
}

/// An asynchronous report from a plugin to its host.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq)]
pub struct Event {
    pub kind: EventKind,
    /// The outgoing transfer, or the ticket (as a number) when `flags` has `INCOMING`.
    pub xfer: XferId,
    pub peer: PeerId,
    /// Set on `FAILED`, `INCOMING_FAILED`, `PEER_DOWN`, `UNHEALTHY`; `ReasonCode(0)` otherwise.
    pub reason: ReasonCode,
    /// Bytes moved so far (`PROGRESS`), or in total (`SUCCEEDED`).
    pub bytes: u64,
    /// Bitset of [`event_flags`].
    pub flags: u32,
    pub message: RString,
}

impl Event {
    fn base(kind: EventKind, xfer: XferId) -> Event {
        Event { kind, xfer, peer: PeerId(0), reason: ReasonCode(0), bytes: 0, flags: 0, message: RString::new() }
    }
    pub fn succeeded(xfer: XferId, bytes: u64) -> Event {
        Event { bytes, ..Event::base(EventKind::SUCCEEDED, xfer) }
    }
    pub fn failed(xfer: XferId, reason: ReasonCode, message: impl Into<String>) -> Event {
        Event { reason, message: message.into().into(), ..Event::base(EventKind::FAILED, xfer) }
    }
    /// A failure after which nothing more can land (no separate `QUIESCED` follows).
    pub fn failed_quiesced(xfer: XferId, reason: ReasonCode, message: impl Into<String>) -> Event {
        Event { flags: event_flags::QUIESCED, ..Event::failed(xfer, reason, message) }
    }
    pub fn quiesced(xfer: XferId) -> Event {
        Event::base(EventKind::QUIESCED, xfer)
    }
    pub fn progress(xfer: XferId, bytes: u64) -> Event {
        Event { bytes, ..Event::base(EventKind::PROGRESS, xfer) }
    }
    pub fn peer_down(peer: PeerId, reason: ReasonCode, message: impl Into<String>) -> Event {
        Event { peer, reason, message: message.into().into(), ..Event::base(EventKind::PEER_DOWN, XferId(0)) }
    }
    pub fn unhealthy(reason: ReasonCode, message: impl Into<String>) -> Event {
        Event { reason, message: message.into().into(), ..Event::base(EventKind::UNHEALTHY, XferId(0)) }
    }
    pub fn incoming_quiesced(peer: PeerId, ticket: Ticket) -> Event {
        Event { peer, flags: event_flags::INCOMING, ..Event::base(EventKind::QUIESCED, XferId(ticket.0)) }
    }
    pub fn incoming_failed(peer: PeerId, ticket: Ticket, reason: ReasonCode, message: impl Into<String>) -> Event {
        Event {
            peer,
            reason,
            flags: event_flags::INCOMING,
            message: message.into().into(),
            ..Event::base(EventKind::INCOMING_FAILED, XferId(ticket.0))
        }
    }
    pub fn is_incoming(&self) -> bool {
        self.flags & event_flags::INCOMING != 0
    }
    /// `SUCCEEDED` or `FAILED` of an outgoing transfer.
    pub fn is_terminal(&self) -> bool {
        !self.is_incoming() && (self.kind == EventKind::SUCCEEDED || self.kind == EventKind::FAILED)
    }
}

/// Live resources, for leak checks and gauges.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Outgoing transfers submitted and not yet terminal.
    pub live_transfers: u64,
    /// Outgoing transfers terminal but not yet quiesced.
    pub unquiesced_transfers: u64,
    /// Incoming tickets not yet cancelled or expired.
    pub live_tickets: u64,
    pub registered_regions: u64,
    pub registered_bytes: u64,
    pub imported_remote_keys: u64,
    pub connected_peers: u64,
    /// Worker threads alive.
    pub workers_alive: u64,
    /// 0 once a worker died or the plugin shut down.
    pub healthy: u8,
}
