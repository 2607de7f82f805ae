//! kvgate-client: the Rust client of the engine API, and the generated protobuf types (`proto`) that
//! the gateway serves. It connects over a Unix socket (default) or TCP with a bearer token; it never
//! carries KV bytes, only references to memory the engine registered. [`LaneClient`] speaks the same
//! calls on the engine fast lane (`<socket>.lane`: length-prefixed frames, no HTTP/2).

pub mod proto {
    //! Generated from `gateway/proto/kvgate.proto`.
    tonic::include_proto!("kvgate.v1");
}

pub mod fd_pass;
pub mod lane;
pub mod lane_frame;
pub mod outcomes;

pub use lane::{LaneClient, LaneError};

use hyper_util::rt::TokioIo;
use proto::engine_api_client::EngineApiClient;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tonic::metadata::MetadataValue;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint, Uri};
use tonic::{Request, Status};

pub use proto::{RoomEvent, RoomInfo, RoomKey, Slice};

/// Metadata key that carries the machine-readable reason of a refused call.
pub const REASON_METADATA_KEY: &str = "kvgate-reason";

/// The reason code of a refused call (`unknown_region`, `length_mismatch`, ...), if the gateway set one.
pub fn reason_of(status: &Status) -> Option<String> {
    status.metadata().get(REASON_METADATA_KEY).and_then(|v| v.to_str().ok()).map(str::to_string)
}

/// Metadata key of the engine session a call belongs to (see `Client::in_session`).
pub const SESSION_METADATA_KEY: &str = "kvgate-session";

/// Adds `authorization: Bearer <token>` (TCP engine API) and `kvgate-session` (a session's calls) to
/// every call.
#[derive(Clone)]
pub struct BearerToken {
    token: Option<MetadataValue<tonic::metadata::Ascii>>,
    session: Option<MetadataValue<tonic::metadata::Ascii>>,
}

impl tonic::service::Interceptor for BearerToken {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(value) = &self.token {
            request.metadata_mut().insert("authorization", value.clone());
        }
        if let Some(value) = &self.session {
            request.metadata_mut().insert(SESSION_METADATA_KEY, value.clone());
        }
        Ok(request)
    }
}

/// A connected engine-API client. Cheap to clone.
#[derive(Clone)]
pub struct Client {
    inner: EngineApiClient<InterceptedService<Channel, BearerToken>>,
    channel: Channel,
    token: Option<MetadataValue<tonic::metadata::Ascii>>,
    session: Option<u64>,
}

/// Connection errors.
#[derive(Debug)]
pub enum ConnectError {
    /// The address or token is malformed.
    Invalid(String),
    /// The gateway could not be reached.
    Transport(tonic::transport::Error),
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConnectError::Invalid(m) => write!(f, "{m}"),
            ConnectError::Transport(e) => write!(f, "cannot reach the gateway: {e}"),
        }
    }
}
impl std::error::Error for ConnectError {}

/// How long a connect attempt may take.
pub const CONNECT_TIMEOUT_MS: u64 = 5_000;

impl Client {
    /// Connect over the gateway's Unix socket.
    pub async fn connect_unix(path: impl AsRef<Path>) -> Result<Client, ConnectError> {
        let path: PathBuf = path.as_ref().to_path_buf();
        // The URI is ignored by the connector; tonic needs a syntactically valid one.
        let channel = Endpoint::try_from("http://kvgate.local")
            .map_err(|e| ConnectError::Invalid(e.to_string()))?
            .connect_timeout(Duration::from_millis(CONNECT_TIMEOUT_MS))
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let path = path.clone();
                async move { Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(path).await?)) }
            }))
            .await
            .map_err(ConnectError::Transport)?;
        Ok(Client::from_channel(channel, None))
    }

    /// Connect over TCP (`http://host:port`) presenting `token`.
    pub async fn connect_tcp(url: &str, token: Option<&str>) -> Result<Client, ConnectError> {
        let header = match token {
            Some(t) => Some(
                format!("Bearer {t}")
                    .parse::<MetadataValue<tonic::metadata::Ascii>>()
                    .map_err(|_| ConnectError::Invalid("the bearer token must be ASCII".into()))?,
            ),
            None => None,
        };
        let channel = Endpoint::try_from(url.to_string())
            .map_err(|e| ConnectError::Invalid(format!("bad URL {url}: {e}")))?
            .connect_timeout(Duration::from_millis(CONNECT_TIMEOUT_MS))
            .connect()
            .await
            .map_err(ConnectError::Transport)?;
        Ok(Client::from_channel(channel, header))
    }

    fn from_channel(channel: Channel, token: Option<MetadataValue<tonic::metadata::Ascii>>) -> Client {
        Client::with_metadata(channel, token, None)
    }

    fn with_metadata(
        channel: Channel,
        token: Option<MetadataValue<tonic::metadata::Ascii>>,
        session: Option<u64>,
    ) -> Client {
        let session_value = session.map(|id| id.to_string().parse().expect("a decimal number is ASCII"));
        let interceptor = BearerToken { token: token.clone(), session: session_value };
        let inner = EngineApiClient::with_interceptor(channel.clone(), interceptor).max_decoding_message_size(64 << 20);
        Client { inner, channel, token, session }
    }

    /// Open (or resume, by the same name within its grace) an engine session.
    pub async fn open_session(&self, name: &str) -> Result<proto::OpenSessionReply, Status> {
        Ok(self.inner.clone().open_session(proto::OpenSessionRequest { name: name.to_string() }).await?.into_inner())
    }

    /// This client's calls (on the same connection) made in session `id`: the regions and rooms they
    /// create are the session's, and its `Watch` streams keep the session attached.
    pub fn in_session(&self, id: u64) -> Client {
        Client::with_metadata(self.channel.clone(), self.token.clone(), Some(id))
    }

    /// The session this client's calls are made in.
    pub fn session(&self) -> Option<u64> {
        self.session
    }

    /// End session `id` now: its live rooms fail `engine_lost`, its regions are released.
    pub async fn close_session(&self, id: u64) -> Result<proto::CloseSessionReply, Status> {
        Ok(self.inner.clone().close_session(proto::CloseSessionRequest { session: id }).await?.into_inner())
    }

    /// Register `len` bytes at `offset` of a shared-memory file (or `/proc/<pid>/fd/<n>` of a memfd).
    pub async fn register_shared_memory(&self, path: &str, offset: u64, len: u64, label: &str) -> Result<u64, Status> {
        let request = proto::RegisterMemoryRequest {
            memory: Some(proto::register_memory_request::Memory::SharedMemory(proto::SharedMemoryFile {
                path: path.to_string(),
                offset,
                len,
            })),
            label: label.to_string(),
        };
        Ok(self.inner.clone().register_memory(request).await?.into_inner().region)
    }

    /// Register CUDA device memory by its IPC handle: `len` bytes at `offset` inside the allocation.
    pub async fn register_cuda_ipc(
        &self,
        device: i32,
        ipc_handle: Vec<u8>,
        offset: u64,
        len: u64,
        label: &str,
    ) -> Result<u64, Status> {
        let request = proto::RegisterMemoryRequest {
            memory: Some(proto::register_memory_request::Memory::CudaIpc(proto::CudaIpcMemory {
                device,
                ipc_handle,
                len,
                offset,
            })),
            label: label.to_string(),
        };
        Ok(self.inner.clone().register_memory(request).await?.into_inner().region)
    }

    /// Register host memory behind a descriptor passed on the fd socket (`fd_pass::pass_fd`): `len`
    /// bytes at `offset` of it.
    pub async fn register_passed_fd(&self, token: u64, offset: u64, len: u64, label: &str) -> Result<u64, Status> {
        let request = proto::RegisterMemoryRequest {
            memory: Some(proto::register_memory_request::Memory::PassedFd(proto::PassedFdMemory {
                token,
                offset,
                len,
            })),
            label: label.to_string(),
        };
        Ok(self.inner.clone().register_memory(request).await?.into_inner().region)
    }

    /// Register CUDA VMM memory (`cuMemCreate`, e.g. PyTorch's expandable segments) by the POSIX
    /// descriptor its owner exported (`cuMemExportToShareableHandle`), passed on the fd socket
    /// (`fd_pass::pass_fd`): `len` bytes at `offset` inside the allocation of `allocation_size` bytes
    /// on CUDA device `device`. Plugins that cannot import such memory say so in the reply's refusals.
    pub async fn register_cuda_vmm_fd(
        &self,
        token: u64,
        device: i32,
        offset: u64,
        len: u64,
        allocation_size: u64,
        label: &str,
    ) -> Result<u64, Status> {
        let memory = proto::CudaVmmFdMemory { token, device, offset, len, allocation_size };
        let request = proto::RegisterMemoryRequest {
            memory: Some(proto::register_memory_request::Memory::CudaVmmFd(memory)),
            label: label.to_string(),
        };
        Ok(self.inner.clone().register_memory(request).await?.into_inner().region)
    }

    pub async fn unregister_memory(&self, region: u64) -> Result<(), Status> {
        self.inner.clone().unregister_memory(proto::UnregisterMemoryRequest { region }).await?;
        Ok(())
    }

    /// Decode side: the room's destination, one list of slices per part. `timeout_ms`: how long the
    /// room may live from now; 0 leaves it unset (the gateway's `room_timeout_ms`).
    pub async fn expect(
        &self,
        key: RoomKey,
        peer: &str,
        parts: Vec<Vec<Slice>>,
        timeout_ms: u64,
    ) -> Result<(), Status> {
        let request = proto::ExpectRequest {
            key: Some(key),
            peer: peer.to_string(),
            parts: parts.into_iter().map(|slices| proto::PartSlices { slices, source_kind: String::new() }).collect(),
            timeout_ms: (timeout_ms > 0).then_some(timeout_ms),
            part_peers: Vec::new(),
        };
        self.inner.clone().expect(request).await?;
        Ok(())
    }

    /// Decode side, any request: parts from several prefill gateways (`part_peers`), source memory
    /// kinds (`PartSlices::source_kind`).
    pub async fn expect_request(&self, request: proto::ExpectRequest) -> Result<(), Status> {
        self.inner.clone().expect(request).await?;
        Ok(())
    }

    /// Prefill side: one chunk of one part.
    pub async fn send(&self, request: proto::SendRequest) -> Result<(), Status> {
        self.inner.clone().send(request).await?;
        Ok(())
    }

    /// Many sends in one call (each applied on its own, in order): one result per send.
    pub async fn send_batch(&self, sends: Vec<proto::SendRequest>) -> Result<proto::BatchReply, Status> {
        Ok(self.inner.clone().send_batch(proto::SendBatchRequest { sends }).await?.into_inner())
    }

    /// Many expects in one call (each applied on its own, in order): one result per expect.
    pub async fn expect_batch(&self, expects: Vec<proto::ExpectRequest>) -> Result<proto::BatchReply, Status> {
        Ok(self.inner.clone().expect_batch(proto::ExpectBatchRequest { expects }).await?.into_inner())
    }

    /// The engine-API version and the gateway's name and plugins.
    pub async fn info(&self) -> Result<proto::InfoReply, Status> {
        Ok(self.inner.clone().info(proto::InfoRequest {}).await?.into_inner())
    }

    /// End a room now. Returns whether it was live.
    pub async fn abort(&self, key: RoomKey, why: &str) -> Result<bool, Status> {
        Ok(self
            .inner
            .clone()
            .abort(proto::AbortRequest { key: Some(key), why: why.to_string() })
            .await?
            .into_inner()
            .was_live)
    }

    pub async fn get_room(&self, key: RoomKey) -> Result<RoomInfo, Status> {
        Ok(self.inner.clone().get_room(proto::GetRoomRequest { key: Some(key) }).await?.into_inner())
    }

    pub async fn list_rooms(&self, include_terminal: bool) -> Result<Vec<RoomInfo>, Status> {
        Ok(self.list_rooms_at(include_terminal).await?.0)
    }

    /// Every room, and the cursor the snapshot is consistent with: the sequence number of the last
    /// room event it reflects and the gateway incarnation it belongs to (watch after it to go on
    /// without a gap).
    pub async fn list_rooms_at(&self, include_terminal: bool) -> Result<(Vec<RoomInfo>, Cursor), Status> {
        let reply = self.inner.clone().list_rooms(proto::ListRoomsRequest { include_terminal }).await?.into_inner();
        Ok((reply.rooms, Cursor { seq: reply.seq, incarnation: reply.incarnation }))
    }

    /// Room events after `cursor`: replayed from the gateway's log, then live. Refused with
    /// `watch_cursor_expired` when the log no longer reaches back that far, or the cursor belongs to
    /// another incarnation of the gateway (it restarted).
    pub async fn watch_after(
        &self,
        key: Option<RoomKey>,
        outcomes_only: bool,
        cursor: Cursor,
    ) -> Result<tonic::Streaming<RoomEvent>, Status> {
        let request =
            proto::WatchRequest { key, outcomes_only, after_seq: Some(cursor.seq), incarnation: cursor.incarnation };
        Ok(self.inner.clone().watch(request).await?.into_inner())
    }

    /// Room events (every room when `key` is `None`).
    pub async fn watch(&self, key: Option<RoomKey>) -> Result<tonic::Streaming<RoomEvent>, Status> {
        Ok(self
            .inner
            .clone()
            .watch(proto::WatchRequest { key, outcomes_only: false, after_seq: None, incarnation: 0 })
            .await?
            .into_inner())
    }

    /// Only the outcomes (`Terminal`, `Reusable`) of every room, or of `key`: what an engine needs to
    /// finish requests and reuse memory, at a fraction of the gateway's cost per room.
    pub async fn watch_outcomes(&self, key: Option<RoomKey>) -> Result<tonic::Streaming<RoomEvent>, Status> {
        Ok(self
            .inner
            .clone()
            .watch(proto::WatchRequest { key, outcomes_only: true, after_seq: None, incarnation: 0 })
            .await?
            .into_inner())
    }
}

/// Where an engine stands in a gateway's room events: the last `seq` handled, in which gateway
/// incarnation (0: unchecked).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cursor {
    pub seq: u64,
    pub incarnation: u64,
}

/// `RoomKey { room, generation }`.
pub fn room_key(room: u64, generation: u32) -> RoomKey {
    RoomKey { room, generation }
}

/// `Slice { region, offset, len }`.
pub fn slice(region: u64, offset: u64, len: u64) -> Slice {
    Slice { region, offset, len }
}
