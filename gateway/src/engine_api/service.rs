//! The `EngineApi` gRPC methods: check that required fields are present, turn the request into an
//! `EngineCall` for the driver, and map the reply (or refusal, with its reason code) to gRPC.
//! Never decides anything the core decides.

use crate::driver::{ApiError, DriverInput, EngineCall, MemorySpec};
use kvgate_client::proto::{self, engine_api_server::EngineApi, register_memory_request::Memory};
use kvgate_core::{RegionId, RoomKey, Slice};
use std::pin::Pin;
use std::sync::Arc;
use super::watch_feed::{WatchFeed, Watcher};
use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

#[derive(Clone)]
pub struct EngineApiService {
    driver: mpsc::Sender<DriverInput>,
    watch: WatchFeed,
    watchers: Arc<Semaphore>,
}

impl EngineApiService {
    pub fn new(driver: mpsc::Sender<DriverInput>, watch: WatchFeed, max_watchers: u64) -> Self {
        EngineApiService { driver, watch, watchers: Arc::new(Semaphore::new(max_watchers as usize)) }
    }

    async fn call<T>(&self, make: impl FnOnce(oneshot::Sender<Result<T, ApiError>>) -> EngineCall) -> Result<T, Status> {
        let (tx, rx) = oneshot::channel();
        self.driver.send(DriverInput::Engine(make(tx))).await.map_err(|_| Status::unavailable("shutdown: the gateway is stopping"))?;
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

type EventStream = Pin<Box<dyn Stream<Item = Result<proto::RoomEvent, Status>> + Send>>;

#[tonic::async_trait]
impl EngineApi for EngineApiService {
    async fn register_memory(&self, request: Request<proto::RegisterMemoryRequest>) -> Result<Response<proto::RegisterMemoryReply>, Status> {
        let r = request.into_inner();
        let memory = match r.memory {
            Some(Memory::SharedMemory(m)) => MemorySpec::SharedFile { path: m.path, offset: m.offset, len: m.len },
            Some(Memory::CudaIpc(c)) => MemorySpec::CudaIpc { device: c.device, handle: c.ipc_handle, len: c.len },
            None => return Err(ApiError::invalid("missing_field", "register_memory needs shared_memory or cuda_ipc").to_status()),
        };
        let (region, plugins) = self.call(|reply| EngineCall::Register { memory, label: r.label, reply }).await?;
        Ok(Response::new(proto::RegisterMemoryReply { region, plugins }))
    }

    async fn unregister_memory(&self, request: Request<proto::UnregisterMemoryRequest>) -> Result<Response<proto::UnregisterMemoryReply>, Status> {
        let region = request.into_inner().region;
        self.call(|reply| EngineCall::Unregister { region, reply }).await?;
        Ok(Response::new(proto::UnregisterMemoryReply {}))
    }

    async fn expect(&self, request: Request<proto::ExpectRequest>) -> Result<Response<proto::ExpectReply>, Status> {
        let r = request.into_inner();
        let room = room_key(r.key)?;
        let parts = r.parts.into_iter().map(|p| slices(p.slices)).collect();
        let timeout_ms = (r.deadline_ms > 0).then_some(r.deadline_ms);
        self.call(|reply| EngineCall::Expect { room, peer: r.peer, parts, timeout_ms, reply }).await?;
        Ok(Response::new(proto::ExpectReply {}))
    }

    async fn send(&self, request: Request<proto::SendRequest>) -> Result<Response<proto::SendReply>, Status> {
        let r = request.into_inner();
        let room = room_key(r.key)?;
        let peer = (!r.peer.is_empty()).then_some(r.peer);
        let slices = slices(r.slices);
        self.call(|reply| EngineCall::Send { room, peer, part: r.part, chunk: r.chunk, slices, last: r.last, reply }).await?;
        Ok(Response::new(proto::SendReply {}))
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

    async fn list_rooms(&self, request: Request<proto::ListRoomsRequest>) -> Result<Response<proto::ListRoomsReply>, Status> {
        let include_terminal = request.into_inner().include_terminal;
        let rooms = self.call(|reply| EngineCall::ListRooms { include_terminal, reply }).await?;
        Ok(Response::new(proto::ListRoomsReply { rooms }))
    }

    type WatchStream = EventStream;

    async fn watch(&self, request: Request<proto::WatchRequest>) -> Result<Response<EventStream>, Status> {
        let request = request.into_inner();
        let permit = self.watchers.clone().try_acquire_owned().map_err(|_| {
            ApiError::new(tonic::Code::ResourceExhausted, "too_many_watchers", "engine_api.max_watchers streams are open already").to_status()
        })?;
        let watcher = self.watch.subscribe(request.key, request.outcomes_only, permit);
        let stream: EventStream = Box::pin(futures_util::stream::unfold(watcher, Watcher::next_item));
        Ok(Response::new(stream))
    }
}
