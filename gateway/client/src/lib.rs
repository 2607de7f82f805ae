//! kvgate-client: the Rust client of the engine API, and the generated protobuf types (`proto`) that
//! the gateway serves. It connects over a Unix socket (default) or TCP with a bearer token; it never
//! carries KV bytes, only references to memory the engine registered.

pub mod proto {
    //! Generated from `gateway/proto/kvgate.proto`.
    tonic::include_proto!("kvgate.v1");
}

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

/// Adds `authorization: Bearer <token>` to every call (TCP engine API).
#[derive(Clone)]
pub struct BearerToken(Option<MetadataValue<tonic::metadata::Ascii>>);

impl tonic::service::Interceptor for BearerToken {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(value) = &self.0 {
            request.metadata_mut().insert("authorization", value.clone());
        }
        Ok(request)
    }
}

/// A connected engine-API client. Cheap to clone.
#[derive(Clone)]
pub struct Client {
    inner: EngineApiClient<InterceptedService<Channel, BearerToken>>,
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
                format!("Bearer {t}").parse::<MetadataValue<tonic::metadata::Ascii>>().map_err(|_| ConnectError::Invalid("the bearer token must be ASCII".into()))?,
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
        let inner = EngineApiClient::with_interceptor(channel, BearerToken(token)).max_decoding_message_size(64 << 20);
        Client { inner }
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

    /// Register CUDA device memory by its IPC handle.
    pub async fn register_cuda_ipc(&self, device: i32, ipc_handle: Vec<u8>, len: u64, label: &str) -> Result<u64, Status> {
        let request = proto::RegisterMemoryRequest {
            memory: Some(proto::register_memory_request::Memory::CudaIpc(proto::CudaIpcMemory { device, ipc_handle, len })),
            label: label.to_string(),
        };
        Ok(self.inner.clone().register_memory(request).await?.into_inner().region)
    }

    pub async fn unregister_memory(&self, region: u64) -> Result<(), Status> {
        self.inner.clone().unregister_memory(proto::UnregisterMemoryRequest { region }).await?;
        Ok(())
    }

    /// Decode side: the room's destination, one list of slices per part.
    pub async fn expect(&self, key: RoomKey, peer: &str, parts: Vec<Vec<Slice>>, deadline_ms: u64) -> Result<(), Status> {
        let request = proto::ExpectRequest {
            key: Some(key),
            peer: peer.to_string(),
            parts: parts.into_iter().map(|slices| proto::PartSlices { slices }).collect(),
            deadline_ms,
        };
        self.inner.clone().expect(request).await?;
        Ok(())
    }

    /// Prefill side: one chunk of one part.
    pub async fn send(&self, request: proto::SendRequest) -> Result<(), Status> {
        self.inner.clone().send(request).await?;
        Ok(())
    }

    /// End a room now. Returns whether it was live.
    pub async fn abort(&self, key: RoomKey, why: &str) -> Result<bool, Status> {
        Ok(self.inner.clone().abort(proto::AbortRequest { key: Some(key), why: why.to_string() }).await?.into_inner().was_live)
    }

    pub async fn get_room(&self, key: RoomKey) -> Result<RoomInfo, Status> {
        Ok(self.inner.clone().get_room(proto::GetRoomRequest { key: Some(key) }).await?.into_inner())
    }

    pub async fn list_rooms(&self, include_terminal: bool) -> Result<Vec<RoomInfo>, Status> {
        Ok(self.inner.clone().list_rooms(proto::ListRoomsRequest { include_terminal }).await?.into_inner().rooms)
    }

    /// Room events (every room when `key` is `None`).
    pub async fn watch(&self, key: Option<RoomKey>) -> Result<tonic::Streaming<RoomEvent>, Status> {
        Ok(self.inner.clone().watch(proto::WatchRequest { key, outcomes_only: false }).await?.into_inner())
    }

    /// Only the outcomes (`Terminal`, `Reusable`) of every room, or of `key`: what an engine needs to
    /// finish requests and reuse memory, at a fraction of the gateway's cost per room.
    pub async fn watch_outcomes(&self, key: Option<RoomKey>) -> Result<tonic::Streaming<RoomEvent>, Status> {
        Ok(self.inner.clone().watch(proto::WatchRequest { key, outcomes_only: true }).await?.into_inner())
    }
}

/// `RoomKey { room, generation }`.
pub fn room_key(room: u64, generation: u32) -> RoomKey {
    RoomKey { room, generation }
}

/// `Slice { region, offset, len }`.
pub fn slice(region: u64, offset: u64, len: u64) -> Slice {
    Slice { region, offset, len }
}
