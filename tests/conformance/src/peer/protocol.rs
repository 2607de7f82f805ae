//! The control protocol between the harness and a peer process: one JSON object per line, requests on
//! the peer's stdin, replies and plugin events on its stdout. Owns only the message shapes; never
//! decides a verdict (the controller does) and never carries region bytes (only checksums).

use serde::{Deserialize, Serialize};

/// One segment of a submit, as ABI v1's `Segment`.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seg {
    pub local: u64,
    pub local_offset: u64,
    pub remote: u64,
    pub remote_offset: u64,
    pub len: u64,
}

/// A region descriptor for `RegisterRaw` (hostile or unusual registrations).
#[derive(Serialize, Deserialize, Clone, Debug, Default)]
pub struct RawRegion {
    pub kind: u32,
    pub device: i32,
    /// Address inside region `rid`'s mapping plus this offset, or 0 when `rid` is `None`.
    pub rid: Option<u32>,
    pub addr_offset: u64,
    pub len: u64,
    pub backing: bool,
    pub ipc_handle: Vec<u8>,
}

fn auto_memory() -> String {
    "auto".into()
}

#[derive(Serialize, Deserialize, Clone, Debug)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    /// Load and open the plugin (`builtin:NAME` or a `.so` path) with its TOML config; its regions
    /// then come from the memory provider `memory` (`[harness] memory_provider`: `auto` chooses from
    /// the plugin's memory kinds). A provider this peer cannot have is answered `Unavailable`.
    Open {
        plugin: String,
        config: String,
        #[serde(default = "auto_memory")]
        memory: String,
    },
    /// Open a second time with this config (to check refusals), closing the result at once.
    TryOpen {
        config: String,
    },
    Info,
    Endpoint,
    Connect {
        peer: u64,
        endpoint: Vec<u8>,
    },
    Disconnect {
        peer: u64,
    },
    /// Create a region of `len` bytes with the memory provider (a `/dev/shm` file mapped, and device
    /// memory behind it for `cuda`), fill it from `seed`.
    Alloc {
        rid: u32,
        len: u64,
        seed: u64,
    },
    /// Register the whole of region `rid` with the plugin.
    Register {
        rid: u32,
    },
    RegisterRaw {
        region: RawRegion,
    },
    Deregister {
        key: u64,
    },
    Import {
        peer: u64,
        bytes: Vec<u8>,
    },
    Release {
        key: u64,
    },
    Fill {
        rid: u32,
        offset: u64,
        len: u64,
        seed: u64,
    },
    /// Checksum of the given ranges of region `rid`, hashed range by range.
    Checksum {
        rid: u32,
        ranges: Vec<(u64, u64)>,
    },
    Submit {
        xfer: u64,
        peer: u64,
        ticket: u64,
        timeout_ns: u64,
        segments: Vec<Seg>,
    },
    /// Many submits of one segment list shape; `xfer` ids from `first_xfer` upward.
    SubmitMany {
        first_xfer: u64,
        count: u64,
        peer: u64,
        ticket: u64,
        timeout_ns: u64,
        segments: Vec<Seg>,
    },
    Cancel {
        xfer: u64,
    },
    CancelMany {
        xfers: Vec<u64>,
    },
    ExpectIncoming {
        ticket: u64,
        peer: u64,
        timeout_ns: u64,
        ranges: Vec<(u64, u64, u64)>,
    },
    CancelIncoming {
        peer: u64,
        ticket: u64,
    },
    Stats,
    Shutdown,
    Exit,
}

#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct Request {
    pub id: u64,
    #[serde(flatten)]
    pub op: Op,
}

/// An error a plugin call returned.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct CallError {
    pub code: u32,
    pub code_name: String,
    pub message: String,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct WireStats {
    pub live_transfers: u64,
    pub unquiesced_transfers: u64,
    pub live_tickets: u64,
    pub registered_regions: u64,
    pub registered_bytes: u64,
    pub imported_remote_keys: u64,
    pub connected_peers: u64,
    pub workers_alive: u64,
    pub healthy: u8,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct WireInfo {
    pub name: String,
    pub version: String,
    pub abi_version: u32,
    pub memory_kinds: u32,
    pub scope: u32,
    pub flags: u32,
    pub max_segments_per_submit: u64,
    pub max_inflight_transfers: u64,
    pub max_transfer_bytes: u64,
}

/// What a request produced (besides the common timing fields of [`Reply`]).
#[derive(Serialize, Deserialize, Clone, Debug)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Outcome {
    Done,
    Failed {
        error: CallError,
    },
    /// `Open` of an instance that is not available here (a harness reports every clause unsupported).
    Unavailable {
        reason: String,
        module: Option<WireInfo>,
    },
    Info {
        module: WireInfo,
        instance: WireInfo,
    },
    Bytes {
        bytes: Vec<u8>,
    },
    Registered {
        key: u64,
        remote_key: Vec<u8>,
    },
    Key {
        key: u64,
    },
    Checksum {
        value: u64,
    },
    Stats {
        stats: WireStats,
    },
    /// One result per call of a batch, with the longest call, and the peer clock right before each
    /// call began and right after it returned (ABORT-4 times each cancel of a batch to its transfer's
    /// terminal event).
    Batch {
        errors: Vec<Option<CallError>>,
        max_call_ns: u64,
        slowest_index: u64,
        #[serde(default)]
        started_ns: Vec<u64>,
        #[serde(default)]
        returned_ns: Vec<u64>,
    },
    /// The harness's own request could not be carried out (bad region id, mmap failure).
    PeerError {
        message: String,
    },
}

#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct Reply {
    pub id: u64,
    /// Peer clock (ns since the peer started) right after the plugin call returned.
    pub t_ns: u64,
    /// How long the plugin call took.
    pub call_ns: u64,
    pub outcome: Outcome,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct WireEvent {
    pub kind: u32,
    pub xfer: u64,
    pub peer: u64,
    pub reason: u32,
    pub bytes: u64,
    pub flags: u32,
    pub message: String,
    /// Peer clock when the sink received it.
    pub t_ns: u64,
}

/// A line on a peer's stdout.
#[derive(Serialize, Deserialize, Clone, Debug)]
#[serde(tag = "line", rename_all = "snake_case")]
pub enum Line {
    Reply(Reply),
    Event(WireEvent),
}
