//! Engine calls as the driver receives them (already decoded from protobuf by `engine_api`), and
//! their translation into core requests. Every refusal carries a reason code; a refused call changes
//! nothing. Never blocks: each call is answered through its oneshot before the next event.

use super::{views, Driver};
use kvgate_client::proto;
use kvgate_core::{EngineRequest, PeerId, RefusalReason, Role, RoomKey, Slice};
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

/// Memory an engine registers, by reference.
#[derive(Clone, Debug)]
pub enum MemorySpec {
    SharedFile { path: String, offset: u64, len: u64 },
    CudaIpc { device: i32, handle: Vec<u8>, len: u64 },
}

pub enum EngineCall {
    Register { memory: MemorySpec, label: String, reply: Reply<(u64, Vec<String>)> },
    Unregister { region: u64, reply: Reply<()> },
    Expect { room: RoomKey, peer: String, parts: Vec<Vec<Slice>>, timeout_ms: Option<u64>, reply: Reply<()> },
    Send { room: RoomKey, peer: Option<String>, part: u32, chunk: u32, slices: Vec<Slice>, last: bool, reply: Reply<()> },
    Abort { room: RoomKey, why: String, reply: Reply<bool> },
    GetRoom { room: RoomKey, reply: Reply<proto::RoomInfo> },
    ListRooms { include_terminal: bool, reply: Reply<Vec<proto::RoomInfo>> },
}

fn refusal_code(reason: RefusalReason) -> tonic::Code {
    use tonic::Code;
    match reason {
        RefusalReason::DuplicateExpect => Code::AlreadyExists,
        RefusalReason::RoomTerminal | RefusalReason::StaleGeneration | RefusalReason::PeerNotConnected | RefusalReason::PeerMismatch => {
            Code::FailedPrecondition
        }
        RefusalReason::TooManyRooms | RefusalReason::TooManyPendingSends => Code::ResourceExhausted,
        _ => Code::InvalidArgument,
    }
}

impl Driver {
    pub(super) fn on_engine_call(&mut self, call: EngineCall) {
        match call {
            EngineCall::Register { memory, label, reply } => {
                let result = self.register_region(memory, label);
                let _ = reply.send(result);
            }
            EngineCall::Unregister { region, reply } => {
                let _ = reply.send(self.unregister_region(region));
            }
            EngineCall::Expect { room, peer, parts, timeout_ms, reply } => {
                let result = self.peer_id_of(&peer).and_then(|peer| self.submit_engine(EngineRequest::Expect { room, peer, parts, timeout_ms }));
                let _ = reply.send(result);
            }
            EngineCall::Send { room, peer, part, chunk, slices, last, reply } => {
                let peer = match peer.as_deref().filter(|p| !p.is_empty()) {
                    Some(name) => self.peer_id_of(name).map(Some),
                    None => Ok(None),
                };
                let result = peer.and_then(|peer| self.submit_engine(EngineRequest::Send { room, peer, part, chunk, slices, last }));
                let _ = reply.send(result);
            }
            EngineCall::Abort { room, why, reply } => {
                let now = self.now();
                let was_live = Role::ALL.iter().any(|role| self.core.room(now, room, *role).is_some_and(|v| !v.state.is_terminal()));
                tracing::info!(room = %room, was_live, "engine abort: {why}");
                let result = self.submit_engine(EngineRequest::Abort { room, role: None }).map(|()| was_live);
                let _ = reply.send(result);
            }
            EngineCall::GetRoom { room, reply } => {
                let now = self.now();
                let view = [Role::Receiver, Role::Sender].iter().find_map(|role| self.core.room(now, room, *role));
                let result = match view {
                    Some(v) => Ok(views::room_info(&v, &self.peers, &self.plugins)),
                    None => Err(ApiError::new(tonic::Code::NotFound, "unknown_room", format!("room {room} is not known here"))),
                };
                let _ = reply.send(result);
            }
            EngineCall::ListRooms { include_terminal, reply } => {
                let now = self.now();
                let rooms = self
                    .core
                    .rooms(now)
                    .filter(|v| include_terminal || !v.state.is_terminal())
                    .map(|v| views::room_info(&v, &self.peers, &self.plugins))
                    .collect();
                let _ = reply.send(Ok(rooms));
            }
        }
    }

    fn peer_id_of(&self, name: &str) -> Result<PeerId, ApiError> {
        // A peer withdrawn from discovery whose link is still up keeps taking rooms until the link goes.
        if let Some(peer) = self.peers.current(name) {
            return Ok(peer);
        }
        if self.directory.entry(name).is_none() {
            return Err(ApiError::invalid("unknown_peer", format!("{name:?} is not a configured peer (see [[peers]]) nor one discovery found")));
        }
        Err(ApiError::new(tonic::Code::Unavailable, "peer_not_connected", format!("peer {name:?} is known but its link is down")))
    }

    fn submit_engine(&mut self, request: EngineRequest) -> Result<(), ApiError> {
        let now = self.now();
        self.core.handle_engine(now, request).map_err(|refusal| {
            tracing::info!(room = %refusal.room, reason = refusal.reason.as_str(), "engine request refused");
            ApiError::new(refusal_code(refusal.reason), refusal.reason.as_str(), refusal.to_string())
        })
    }
}
