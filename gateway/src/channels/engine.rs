//! Engine calls as the driver receives them (decoded from protobuf by `engine_api`), their replies
//! and refusals. Plain data: the driver acts on them (`driver/engine.rs`).

use kvgate_client::proto;
use kvgate_core::{RoomKey, Slice};
use tokio::sync::oneshot;

/// Where the answer to an engine call goes.
pub type Reply<T> = oneshot::Sender<Result<T, ApiError>>;

/// A refused engine call: the gRPC code, a machine-readable reason and a human message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    pub code: tonic::Code,
    pub reason: String,
    pub message: String,
}

impl ApiError {
    pub fn new(code: tonic::Code, reason: &str, message: impl Into<String>) -> ApiError {
        ApiError { code, reason: reason.to_string(), message: message.into() }
    }
    pub fn invalid(reason: &str, message: impl Into<String>) -> ApiError {
        ApiError::new(tonic::Code::InvalidArgument, reason, message)
    }
    pub fn to_status(&self) -> tonic::Status {
        let mut status = tonic::Status::new(self.code, format!("{}: {}", self.reason, self.message));
        if let Ok(value) = self.reason.parse() {
            status.metadata_mut().insert(kvgate_client::REASON_METADATA_KEY, value);
        }
        status
    }
}

/// A region registered: its id, the plugins that accepted it, and each that refused it with why.
#[derive(Clone, Debug)]
pub struct Registered {
    pub region: u64,
    pub plugins: Vec<String>,
    pub refused: Vec<String>,
}

/// Memory an engine registers, by reference.
#[derive(Debug)]
pub enum MemorySpec {
    SharedFile {
        path: String,
        offset: u64,
        len: u64,
    },
    CudaIpc {
        device: i32,
        handle: Vec<u8>,
        offset: u64,
        len: u64,
    },
    /// Host memory behind a descriptor the engine passed on the fd socket: the gateway keeps it open
    /// while the region is registered, and names it to plugins as `/proc/<gateway pid>/fd/<n>`.
    PassedFd {
        file: std::fs::File,
        offset: u64,
        len: u64,
    },
    /// A CUDA VMM allocation's descriptor passed on the fd socket: the gateway keeps it open while the
    /// region is registered and names it to plugins by the `kvgate_abi::cuda_vmm` convention.
    CudaVmmFd {
        file: std::fs::File,
        device: i32,
        offset: u64,
        len: u64,
        allocation_size: u64,
    },
}

/// One expect, decoded.
#[derive(Clone, Debug)]
pub struct ExpectCall {
    /// The engine session the room belongs to, if the call named one.
    pub session: Option<u64>,
    pub room: RoomKey,
    pub peer: String,
    /// The peer each part comes from (empty, or an empty name: `peer`).
    pub part_peers: Vec<String>,
    pub parts: Vec<Vec<Slice>>,
    /// The memory kind the sender reads each part from (empty, or None for a part: the kind of
    /// its destination).
    pub source_kinds: Vec<Option<kvgate_abi::MemoryKind>>,
    pub timeout_ms: Option<u64>,
}

/// One send (one chunk of one part), decoded.
#[derive(Clone, Debug)]
pub struct SendCall {
    /// The engine session the room belongs to, if the call named one.
    pub session: Option<u64>,
    pub room: RoomKey,
    pub peer: Option<String>,
    pub part: u32,
    pub chunk: u32,
    /// Byte offset in the part's destination stream (None: after the previous chunk).
    pub at: Option<u64>,
    pub slices: Vec<Slice>,
    pub last: bool,
}

pub enum EngineCall {
    Register {
        memory: MemorySpec,
        label: String,
        session: Option<u64>,
        reply: Reply<Registered>,
    },
    OpenSession {
        name: String,
        reply: Reply<(u64, bool)>,
    },
    CloseSession {
        session: u64,
        reply: Reply<SessionEnd>,
    },
    /// A `Watch` stream of the session opened; `DetachSession` when it closes.
    AttachSession {
        session: u64,
        reply: Reply<()>,
    },
    DetachSession {
        session: u64,
    },
    Unregister {
        region: u64,
        reply: Reply<()>,
    },
    Expect {
        call: ExpectCall,
        reply: Reply<()>,
    },
    Send {
        call: SendCall,
        reply: Reply<()>,
    },
    /// Each call decoded on its own (one that could not be is refused in its place).
    ExpectBatch {
        calls: Vec<Result<ExpectCall, ApiError>>,
        reply: Reply<Vec<Result<(), ApiError>>>,
    },
    SendBatch {
        calls: Vec<Result<SendCall, ApiError>>,
        reply: Reply<Vec<Result<(), ApiError>>>,
    },
    Abort {
        room: RoomKey,
        why: String,
        reply: Reply<bool>,
    },
    GetRoom {
        room: RoomKey,
        reply: Reply<proto::RoomInfo>,
    },
    ListRooms {
        include_terminal: bool,
        reply: Reply<(Vec<proto::RoomInfo>, u64)>,
    },
}

/// What ending a session did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SessionEnd {
    pub rooms_ended: u32,
    pub regions_released: u32,
    pub regions_pending: u32,
}

impl From<SessionEnd> for proto::CloseSessionReply {
    fn from(end: SessionEnd) -> Self {
        proto::CloseSessionReply {
            rooms_ended: end.rooms_ended,
            regions_released: end.regions_released,
            regions_pending: end.regions_pending,
        }
    }
}
