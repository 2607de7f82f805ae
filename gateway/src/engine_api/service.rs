//! The `EngineApi` gRPC methods: check that required fields are present, turn the request into an
//! `EngineCall` for the driver, and map the reply (or refusal, with its reason code) to gRPC.
//! Never decides anything the core decides.

use super::watch_feed::{WatchFeed, Watcher};
use crate::channels::{ApiError, DriverInput, EngineCall, ExpectCall, MemorySpec, SendCall};
use crate::driver::sessions::SESSION_METADATA_KEY;
use crate::listeners::ConnectionId;
use kvgate_client::proto::{self, engine_api_server::EngineApi, register_memory_request::Memory};
use kvgate_core::{RegionId, RoomKey, Slice};
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

#[derive(Clone)]
pub struct EngineApiService {
    driver: mpsc::Sender<DriverInput>,
    watch: WatchFeed,
    watchers: Arc<Semaphore>,
    per_connection: Arc<ConnectionWatches>,
    max_batch_calls: usize,
    session_grace_ms: u64,
    info: Arc<proto::InfoReply>,
    /// Descriptors passed on the fd socket, taken by `RegisterMemory { passed_fd }`.
    passed_fds: Arc<super::fd_pass::PassedFds>,
}

impl EngineApiService {
    pub fn new(
        driver: mpsc::Sender<DriverInput>,
        watch: WatchFeed,
        config: &crate::config::EngineApiSection,
        info: proto::InfoReply,
    ) -> Self {
        EngineApiService {
            driver,
            watch,
            watchers: Arc::new(Semaphore::new(config.max_watchers as usize)),
            per_connection: Arc::new(ConnectionWatches {
                open: Mutex::new(HashMap::new()),
                max: config.max_watchers_per_connection,
            }),
            max_batch_calls: config.max_batch_calls as usize,
            session_grace_ms: config.session_grace_ms,
            info: Arc::new(info),
            passed_fds: Arc::new(super::fd_pass::PassedFds::new(config.max_passed_fds, config.passed_fd_ttl_ms)),
        }
    }

    /// The table the fd socket fills (`fd_pass::spawn_fd_socket`).
    pub fn passed_fds(&self) -> Arc<super::fd_pass::PassedFds> {
        self.passed_fds.clone()
    }

    /// The descriptor passed under `token`, once (`unknown_fd_token` otherwise).
    fn take_passed_fd(&self, token: u64) -> Result<std::os::fd::OwnedFd, Status> {
        self.passed_fds.take(token).ok_or_else(|| {
            let message = format!("no descriptor waits under token {token} (never passed, already registered, or past engine_api.passed_fd_ttl_ms)");
            ApiError::new(tonic::Code::NotFound, "unknown_fd_token", message).to_status()
        })
    }

    /// A batch longer than `engine_api.max_batch_calls` is refused whole (nothing of it is applied).
    fn check_batch(&self, calls: usize) -> Result<(), Status> {
        if calls > self.max_batch_calls {
            let message = format!("{calls} calls in one batch; engine_api.max_batch_calls = {}", self.max_batch_calls);
            return Err(ApiError::new(tonic::Code::ResourceExhausted, "too_many_calls", message).to_status());
        }
        Ok(())
    }

    async fn call<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, ApiError>>) -> EngineCall,
    ) -> Result<T, Status> {
        let (tx, rx) = oneshot::channel();
        self.driver
            .send(DriverInput::Engine(make(tx)))
            .await
            .map_err(|_| Status::unavailable("shutdown: the gateway is stopping"))?;
        let reply = rx.await.map_err(|_| Status::unavailable("shutdown: the gateway is stopping"))?;
        reply.map_err(|e| e.to_status())
    }
}

fn room_key(key: Option<proto::RoomKey>) -> Result<RoomKey, Status> {
    let key = key.ok_or_else(|| ApiError::invalid("missing_field", "the request needs a room key").to_status())?;
    Ok(RoomKey::new(key.room, key.generation))
}

fn slices(list: Vec<proto::Slice>) -> Vec<Slice> {
    list.into_iter().map(|s| Slice::new(RegionId(s.region), s.offset, s.len)).collect()
}

/// The engine session a call names in its `kvgate-session` metadata, if any.
fn session_of<T>(request: &Request<T>) -> Result<Option<u64>, Status> {
    let Some(value) = request.metadata().get(SESSION_METADATA_KEY) else { return Ok(None) };
    let parsed = value.to_str().ok().and_then(|v| v.trim().parse::<u64>().ok());
    match parsed {
        Some(id) => Ok(Some(id)),
        None => Err(ApiError::invalid(
            "invalid_session",
            format!("{SESSION_METADATA_KEY} metadata must be a session id (a decimal number)"),
        )
        .to_status()),
    }
}

fn send_call(r: proto::SendRequest, session: Option<u64>) -> Result<SendCall, ApiError> {
    let key = r.key.ok_or_else(|| ApiError::invalid("missing_field", "the request needs a room key"))?;
    let peer = (!r.peer.is_empty()).then_some(r.peer);
    Ok(SendCall {
        session,
        room: RoomKey::new(key.room, key.generation),
        peer,
        part: r.part,
        chunk: r.chunk,
        at: r.offset,
        slices: slices(r.slices),
        last: r.last,
    })
}

fn expect_call(r: proto::ExpectRequest, session: Option<u64>) -> Result<ExpectCall, ApiError> {
    let key = r.key.ok_or_else(|| ApiError::invalid("missing_field", "the request needs a room key"))?;
    let mut source_kinds = Vec::new();
    if r.parts.iter().any(|p| !p.source_kind.is_empty()) {
        for (index, part) in r.parts.iter().enumerate() {
            let kind = match part.source_kind.as_str() {
                "" => None,
                name => Some(kvgate_abi::MemoryKind::from_name(name).ok_or_else(|| {
                    ApiError::invalid(
                        "unknown_memory_kind",
                        format!("part {index}: source_kind {name:?} is not a memory kind (host, cuda_device)"),
                    )
                })?),
            };
            source_kinds.push(kind);
        }
    }
    if r.part_peers.len() > r.parts.len() {
        return Err(ApiError::invalid(
            "unknown_part",
            format!("{} part_peers for {} parts", r.part_peers.len(), r.parts.len()),
        ));
    }
    let parts = r.parts.into_iter().map(|p| slices(p.slices)).collect();
    let room = RoomKey::new(key.room, key.generation);
    Ok(ExpectCall {
        session,
        room,
        peer: r.peer,
        part_peers: r.part_peers,
        parts,
        source_kinds,
        timeout_ms: r.timeout_ms,
    })
}

/// Held by a session's `Watch` stream: its end detaches the session (the driver then counts the grace).
/// `Watch` streams open per engine connection (`engine_api.max_watchers_per_connection`).
struct ConnectionWatches {
    open: Mutex<HashMap<ConnectionId, u64>>,
    max: u64,
}

/// One connection's place among its watchers, given back when the stream ends.
struct ConnectionWatchSlot {
    watches: Arc<ConnectionWatches>,
    connection: ConnectionId,
}

impl ConnectionWatches {
    fn take(self: &Arc<Self>, connection: ConnectionId) -> Result<ConnectionWatchSlot, Status> {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let count = open.entry(connection).or_insert(0);
        if *count >= self.max {
            return Err(ApiError::new(
                tonic::Code::ResourceExhausted,
                "too_many_watchers",
                format!(
                    "this connection holds engine_api.max_watchers_per_connection = {} Watch streams already",
                    self.max
                ),
            )
            .to_status());
        }
        *count += 1;
        Ok(ConnectionWatchSlot { watches: self.clone(), connection })
    }
}

impl Drop for ConnectionWatchSlot {
    fn drop(&mut self) {
        let mut open = self.watches.open.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(count) = open.get_mut(&self.connection) {
            *count -= 1;
            if *count == 0 {
                open.remove(&self.connection);
            }
        }
    }
}

struct SessionAttachment {
    driver: mpsc::Sender<DriverInput>,
    session: u64,
}

impl Drop for SessionAttachment {
    fn drop(&mut self) {
        let (driver, session) = (self.driver.clone(), self.session);
        // Never lost to a full queue: the send waits for room on a task of its own.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = driver.send(DriverInput::Engine(EngineCall::DetachSession { session })).await;
            });
        }
    }
}

fn batch_reply(results: Vec<Result<(), ApiError>>) -> proto::BatchReply {
    let accepted = results.iter().filter(|r| r.is_ok()).count() as u32;
    let results = results
        .into_iter()
        .map(|r| match r {
            Ok(()) => proto::CallResult::default(),
            Err(e) => proto::CallResult { reason: e.reason, message: e.message },
        })
        .collect();
    proto::BatchReply { results, accepted }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<proto::RoomEvent, Status>> + Send>>;

#[tonic::async_trait]
impl EngineApi for EngineApiService {
    async fn open_session(
        &self,
        request: Request<proto::OpenSessionRequest>,
    ) -> Result<Response<proto::OpenSessionReply>, Status> {
        let name = request.into_inner().name;
        let (session, resumed) = self.call(|reply| EngineCall::OpenSession { name, reply }).await?;
        Ok(Response::new(proto::OpenSessionReply { session, resumed, grace_ms: self.session_grace_ms }))
    }

    async fn close_session(
        &self,
        request: Request<proto::CloseSessionRequest>,
    ) -> Result<Response<proto::CloseSessionReply>, Status> {
        let session = request.into_inner().session;
        let end = self.call(|reply| EngineCall::CloseSession { session, reply }).await?;
        Ok(Response::new(end.into()))
    }

    async fn register_memory(
        &self,
        request: Request<proto::RegisterMemoryRequest>,
    ) -> Result<Response<proto::RegisterMemoryReply>, Status> {
        let session = session_of(&request)?;
        let r = request.into_inner();
        let memory = match r.memory {
            Some(Memory::SharedMemory(m)) => MemorySpec::SharedFile { path: m.path, offset: m.offset, len: m.len },
            Some(Memory::CudaIpc(c)) => {
                MemorySpec::CudaIpc { device: c.device, handle: c.ipc_handle, offset: c.offset, len: c.len }
            }
            Some(Memory::PassedFd(p)) => {
                let fd = self.take_passed_fd(p.token)?;
                MemorySpec::PassedFd { file: std::fs::File::from(fd), offset: p.offset, len: p.len }
            }
            Some(Memory::CudaVmmFd(v)) => {
                let fd = self.take_passed_fd(v.token)?;
                MemorySpec::CudaVmmFd {
                    file: std::fs::File::from(fd),
                    device: v.device,
                    offset: v.offset,
                    len: v.len,
                    allocation_size: v.allocation_size,
                }
            }
            None => {
                return Err(ApiError::invalid(
                    "missing_field",
                    "register_memory needs shared_memory, cuda_ipc, passed_fd or cuda_vmm_fd",
                )
                .to_status())
            }
        };
        let registered = self.call(|reply| EngineCall::Register { memory, label: r.label, session, reply }).await?;
        Ok(Response::new(proto::RegisterMemoryReply {
            region: registered.region,
            plugins: registered.plugins,
            refused: registered.refused,
        }))
    }

    async fn unregister_memory(
        &self,
        request: Request<proto::UnregisterMemoryRequest>,
    ) -> Result<Response<proto::UnregisterMemoryReply>, Status> {
        let region = request.into_inner().region;
        self.call(|reply| EngineCall::Unregister { region, reply }).await?;
        Ok(Response::new(proto::UnregisterMemoryReply {}))
    }

    async fn expect(&self, request: Request<proto::ExpectRequest>) -> Result<Response<proto::ExpectReply>, Status> {
        let session = session_of(&request)?;
        let call = expect_call(request.into_inner(), session).map_err(|e| e.to_status())?;
        self.call(|reply| EngineCall::Expect { call, reply }).await?;
        Ok(Response::new(proto::ExpectReply {}))
    }

    async fn send(&self, request: Request<proto::SendRequest>) -> Result<Response<proto::SendReply>, Status> {
        let session = session_of(&request)?;
        let call = send_call(request.into_inner(), session).map_err(|e| e.to_status())?;
        self.call(|reply| EngineCall::Send { call, reply }).await?;
        Ok(Response::new(proto::SendReply {}))
    }

    async fn send_batch(
        &self,
        request: Request<proto::SendBatchRequest>,
    ) -> Result<Response<proto::BatchReply>, Status> {
        let session = session_of(&request)?;
        let sends = request.into_inner().sends;
        self.check_batch(sends.len())?;
        let calls = sends.into_iter().map(|r| send_call(r, session)).collect();
        let results = self.call(|reply| EngineCall::SendBatch { calls, reply }).await?;
        Ok(Response::new(batch_reply(results)))
    }

    async fn expect_batch(
        &self,
        request: Request<proto::ExpectBatchRequest>,
    ) -> Result<Response<proto::BatchReply>, Status> {
        let session = session_of(&request)?;
        let expects = request.into_inner().expects;
        self.check_batch(expects.len())?;
        let calls = expects.into_iter().map(|r| expect_call(r, session)).collect();
        let results = self.call(|reply| EngineCall::ExpectBatch { calls, reply }).await?;
        Ok(Response::new(batch_reply(results)))
    }

    async fn info(&self, _request: Request<proto::InfoRequest>) -> Result<Response<proto::InfoReply>, Status> {
        Ok(Response::new((*self.info).clone()))
    }

    async fn abort(&self, request: Request<proto::AbortRequest>) -> Result<Response<proto::AbortReply>, Status> {
        let r = request.into_inner();
        let room = room_key(r.key)?;
        let was_live = self.call(|reply| EngineCall::Abort { room, why: r.why, reply }).await?;
        Ok(Response::new(proto::AbortReply { was_live }))
    }

    async fn get_room(&self, request: Request<proto::GetRoomRequest>) -> Result<Response<proto::RoomInfo>, Status> {
        let room = room_key(request.into_inner().key)?;
        Ok(Response::new(self.call(|reply| EngineCall::GetRoom { room, reply }).await?))
    }

    async fn list_rooms(
        &self,
        request: Request<proto::ListRoomsRequest>,
    ) -> Result<Response<proto::ListRoomsReply>, Status> {
        let include_terminal = request.into_inner().include_terminal;
        let (rooms, seq) = self.call(|reply| EngineCall::ListRooms { include_terminal, reply }).await?;
        Ok(Response::new(proto::ListRoomsReply { rooms, seq, incarnation: self.info.incarnation }))
    }

    type WatchStream = EventStream;

    async fn watch(&self, request: Request<proto::WatchRequest>) -> Result<Response<EventStream>, Status> {
        let session = session_of(&request)?;
        // Over a listener of this gateway every request carries its connection; one without (a
        // service driven in-process) has no per-connection bound.
        let connection_slot = match request.extensions().get::<ConnectionId>() {
            Some(connection) => Some(self.per_connection.take(*connection)?),
            None => None,
        };
        let request = request.into_inner();
        let permit = self.watchers.clone().try_acquire_owned().map_err(|_| {
            ApiError::new(
                tonic::Code::ResourceExhausted,
                "too_many_watchers",
                "engine_api.max_watchers streams are open already",
            )
            .to_status()
        })?;
        let cursor = request.after_seq.map(|seq| (seq, request.incarnation));
        let mut watcher =
            self.watch.subscribe(request.key, request.outcomes_only, cursor, permit).map_err(|e| e.to_status())?;
        let attachment = match session {
            Some(session) => {
                self.call(|reply| EngineCall::AttachSession { session, reply }).await?;
                Some(SessionAttachment { driver: self.driver.clone(), session })
            }
            None => None,
        };
        watcher = watcher.holding(Box::new((connection_slot, attachment)));
        let stream: EventStream = Box::pin(futures_util::stream::unfold(watcher, Watcher::next_item));
        Ok(Response::new(stream))
    }
}
