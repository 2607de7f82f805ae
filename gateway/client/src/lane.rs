//! `LaneClient`: the engine fast lane (`<engine_api.unix_socket>.lane`), the engine API's calls as
//! length-prefixed protobuf frames on one Unix socket, without HTTP/2. Same calls, same meaning, same
//! reason codes as [`crate::Client`]; many calls may be in flight at once on one connection.
//!
//! Owns one connection: callers write their frame themselves (one `write` per call, under a lock),
//! one reader task matches replies to callers by id and hands room events to the watch.

use crate::lane_frame::{encode_frame, FrameBuffer};
use crate::proto::{self, lane_reply::Reply, lane_request::Call};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::OwnedWriteHalf;
use tokio::sync::{mpsc, oneshot};

/// The lane socket of an engine socket: `<engine socket>.lane`.
pub fn lane_socket_path(engine_socket: &Path) -> PathBuf {
    let mut name = engine_socket.as_os_str().to_owned();
    name.push(".lane");
    PathBuf::from(name)
}

/// Largest reply frame this client accepts, in bytes (a `ListRooms` of many rooms is the largest).
pub const LANE_CLIENT_MAX_FRAME_BYTES: usize = 64 << 20;
/// A connection that sent nothing for this long sends an `Info` call, so that the gateway's
/// `engine_api.connections.idle_timeout_ms` never closes a connection kept for its watch.
pub const LANE_KEEPALIVE_MS: u64 = 20_000;

/// A refused or failed lane call: the gRPC status code the same call would have had on gRPC, the
/// reason code (`unknown_region`, `frame_too_large`, `lane_closed`, ...) and the gateway's message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaneError {
    pub code: tonic::Code,
    pub reason: String,
    pub message: String,
}

impl LaneError {
    fn closed(why: impl std::fmt::Display) -> LaneError {
        LaneError {
            code: tonic::Code::Unavailable,
            reason: "lane_closed".into(),
            message: format!("the lane connection is closed: {why}"),
        }
    }

    fn unexpected(what: &str) -> LaneError {
        LaneError {
            code: tonic::Code::Internal,
            reason: "unexpected_reply".into(),
            message: format!("the gateway answered a {what} call with another kind of reply"),
        }
    }

    /// The reason code.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

impl From<proto::LaneError> for LaneError {
    fn from(e: proto::LaneError) -> LaneError {
        LaneError { code: tonic::Code::from_i32(e.code), reason: e.reason, message: e.message }
    }
}

impl std::fmt::Display for LaneError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {} ({:?})", self.reason, self.message, self.code)
    }
}
impl std::error::Error for LaneError {}

/// What waits for a reply of a given id.
enum Waiting {
    Call(oneshot::Sender<Result<Reply, LaneError>>),
    /// A watch: its opening (answered once), then its events.
    Watch {
        opened: Option<oneshot::Sender<Result<(), LaneError>>>,
        events: mpsc::UnboundedSender<proto::RoomEvent>,
    },
}

struct Shared {
    writer: tokio::sync::Mutex<OwnedWriteHalf>,
    waiting: Mutex<HashMap<u64, Waiting>>,
    next_id: AtomicU64,
    /// Why the connection ended, once it has (an error frame of the gateway, or the socket's error).
    ended: Mutex<Option<LaneError>>,
    wrote_recently: AtomicBool,
}

/// A connection on the lane. Cheap to clone; clones share the connection.
#[derive(Clone)]
pub struct LaneClient {
    shared: Arc<Shared>,
    session: Option<u64>,
}

impl LaneClient {
    /// Connect to the lane socket at `path` (see [`lane_socket_path`]) and check it answers (`Info`).
    pub async fn connect(path: impl AsRef<Path>) -> Result<LaneClient, LaneError> {
        let path = path.as_ref();
        let stream = tokio::net::UnixStream::connect(path)
            .await
            .map_err(|e| LaneError::closed(format!("cannot connect to {}: {e}", path.display())))?;
        let (read, write) = stream.into_split();
        let shared = Arc::new(Shared {
            writer: tokio::sync::Mutex::new(write),
            waiting: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            ended: Mutex::new(None),
            wrote_recently: AtomicBool::new(true),
        });
        tokio::spawn(read_replies(read, Arc::downgrade(&shared)));
        tokio::spawn(keep_alive(Arc::downgrade(&shared)));
        let client = LaneClient { shared, session: None };
        client.info().await?;
        Ok(client)
    }

    /// This client's calls (on the same connection) made in engine session `id` (opened here or on
    /// gRPC: sessions belong to the gateway, not to a connection).
    pub fn in_session(&self, id: u64) -> LaneClient {
        LaneClient { shared: self.shared.clone(), session: Some(id) }
    }

    /// The session this client's calls are made in.
    pub fn session(&self) -> Option<u64> {
        self.session
    }

    async fn send_frame(&self, id: u64, call: Call, waiting: Waiting) -> Result<(), LaneError> {
        if let Some(why) = self.shared.ended.lock().unwrap_or_else(|e| e.into_inner()).clone() {
            return Err(why);
        }
        self.shared.waiting.lock().unwrap_or_else(|e| e.into_inner()).insert(id, waiting);
        let mut frame = Vec::new();
        encode_frame(&proto::LaneRequest { id, session: self.session, call: Some(call) }, &mut frame);
        let written = self.shared.writer.lock().await.write_all(&frame).await;
        self.shared.wrote_recently.store(true, Ordering::Relaxed);
        if let Err(e) = written {
            self.shared.waiting.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
            return Err(LaneError::closed(e));
        }
        Ok(())
    }

    async fn call(&self, call: Call) -> Result<Reply, LaneError> {
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.send_frame(id, call, Waiting::Call(tx)).await?;
        match rx.await {
            Ok(reply) => reply,
            Err(_) => Err(self.end_reason()),
        }
    }

    fn end_reason(&self) -> LaneError {
        self.shared
            .ended
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .unwrap_or_else(|| LaneError::closed("ended"))
    }

    /// Open (or resume, by the same name within its grace) an engine session.
    pub async fn open_session(&self, name: &str) -> Result<proto::OpenSessionReply, LaneError> {
        match self.call(Call::OpenSession(proto::OpenSessionRequest { name: name.to_string() })).await? {
            Reply::OpenSession(r) => Ok(r),
            _ => Err(LaneError::unexpected("open_session")),
        }
    }

    /// End session `id` now: its live rooms fail `engine_lost`, its regions are released.
    pub async fn close_session(&self, id: u64) -> Result<proto::CloseSessionReply, LaneError> {
        match self.call(Call::CloseSession(proto::CloseSessionRequest { session: id })).await? {
            Reply::CloseSession(r) => Ok(r),
            _ => Err(LaneError::unexpected("close_session")),
        }
    }

    /// Register memory (any kind `RegisterMemory` takes); the region id.
    pub async fn register_memory(&self, request: proto::RegisterMemoryRequest) -> Result<u64, LaneError> {
        match self.call(Call::RegisterMemory(request)).await? {
            Reply::RegisterMemory(r) => Ok(r.region),
            _ => Err(LaneError::unexpected("register_memory")),
        }
    }

    pub async fn unregister_memory(&self, region: u64) -> Result<(), LaneError> {
        match self.call(Call::UnregisterMemory(proto::UnregisterMemoryRequest { region })).await? {
            Reply::UnregisterMemory(_) => Ok(()),
            _ => Err(LaneError::unexpected("unregister_memory")),
        }
    }

    /// Decode side: a room's destination (see `Client::expect_request`).
    pub async fn expect(&self, request: proto::ExpectRequest) -> Result<(), LaneError> {
        match self.call(Call::Expect(request)).await? {
            Reply::Expect(_) => Ok(()),
            _ => Err(LaneError::unexpected("expect")),
        }
    }

    /// Prefill side: one chunk of one part.
    pub async fn send(&self, request: proto::SendRequest) -> Result<(), LaneError> {
        match self.call(Call::Send(request)).await? {
            Reply::Send(_) => Ok(()),
            _ => Err(LaneError::unexpected("send")),
        }
    }

    /// Many expects in one call (each applied on its own, in order): one result per expect.
    pub async fn expect_batch(&self, expects: Vec<proto::ExpectRequest>) -> Result<proto::BatchReply, LaneError> {
        match self.call(Call::ExpectBatch(proto::ExpectBatchRequest { expects })).await? {
            Reply::ExpectBatch(r) => Ok(r),
            _ => Err(LaneError::unexpected("expect_batch")),
        }
    }

    /// Many sends in one call (each applied on its own, in order): one result per send.
    pub async fn send_batch(&self, sends: Vec<proto::SendRequest>) -> Result<proto::BatchReply, LaneError> {
        match self.call(Call::SendBatch(proto::SendBatchRequest { sends })).await? {
            Reply::SendBatch(r) => Ok(r),
            _ => Err(LaneError::unexpected("send_batch")),
        }
    }

    /// The engine-API version and the gateway's name and plugins.
    pub async fn info(&self) -> Result<proto::InfoReply, LaneError> {
        match self.call(Call::Info(proto::InfoRequest {})).await? {
            Reply::Info(r) => Ok(r),
            _ => Err(LaneError::unexpected("info")),
        }
    }

    /// End a room now. Returns whether it was live.
    pub async fn abort(&self, key: proto::RoomKey, why: &str) -> Result<bool, LaneError> {
        match self.call(Call::Abort(proto::AbortRequest { key: Some(key), why: why.to_string() })).await? {
            Reply::Abort(r) => Ok(r.was_live),
            _ => Err(LaneError::unexpected("abort")),
        }
    }

    pub async fn get_room(&self, key: proto::RoomKey) -> Result<proto::RoomInfo, LaneError> {
        match self.call(Call::GetRoom(proto::GetRoomRequest { key: Some(key) })).await? {
            Reply::GetRoom(r) => Ok(r),
            _ => Err(LaneError::unexpected("get_room")),
        }
    }

    pub async fn list_rooms(&self, include_terminal: bool) -> Result<proto::ListRoomsReply, LaneError> {
        match self.call(Call::ListRooms(proto::ListRoomsRequest { include_terminal })).await? {
            Reply::ListRooms(r) => Ok(r),
            _ => Err(LaneError::unexpected("list_rooms")),
        }
    }

    /// Room events, as `Watch` gives them (in this client's session, which the watch keeps attached).
    /// The receiver ends when the watch or the connection does; one watch per connection.
    pub async fn watch(
        &self,
        request: proto::WatchRequest,
    ) -> Result<mpsc::UnboundedReceiver<proto::RoomEvent>, LaneError> {
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let (opened_tx, opened_rx) = oneshot::channel();
        let (events_tx, events_rx) = mpsc::unbounded_channel();
        self.send_frame(id, Call::Watch(request), Waiting::Watch { opened: Some(opened_tx), events: events_tx })
            .await?;
        match opened_rx.await {
            Ok(Ok(())) => Ok(events_rx),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(self.end_reason()),
        }
    }

    /// Only the outcomes (`Terminal`, `Reusable`) of every room, or of `key`.
    pub async fn watch_outcomes(
        &self,
        key: Option<proto::RoomKey>,
    ) -> Result<mpsc::UnboundedReceiver<proto::RoomEvent>, LaneError> {
        self.watch(proto::WatchRequest { key, outcomes_only: true, after_seq: None, incarnation: 0 }).await
    }
}

/// The connection's reader: every reply to whoever waits for its id, until the socket ends; then every
/// caller still waiting learns why.
async fn read_replies(mut read: tokio::net::unix::OwnedReadHalf, shared: std::sync::Weak<Shared>) {
    let mut buf = FrameBuffer::default();
    let why = 'read: loop {
        match read.read_buf(buf.spare()).await {
            Ok(0) => break LaneError::closed("the gateway closed it"),
            Ok(_) => {}
            Err(e) => break LaneError::closed(e),
        }
        let Some(shared) = shared.upgrade() else { return };
        loop {
            let body = match buf.take(LANE_CLIENT_MAX_FRAME_BYTES) {
                Ok(Some(body)) => body,
                Ok(None) => break,
                Err(e) => break 'read LaneError::closed(format!("a reply of {} bytes, past {}", e.len, e.max)),
            };
            let reply = match <proto::LaneReply as prost::Message>::decode(body) {
                Ok(reply) => reply,
                Err(e) => break 'read LaneError::closed(format!("an undecodable reply: {e}")),
            };
            if reply.id == 0 {
                if let Some(Reply::Error(e)) = reply.reply {
                    break 'read LaneError::from(e);
                }
                continue;
            }
            deliver(&shared, reply);
        }
    };
    if let Some(shared) = shared.upgrade() {
        *shared.ended.lock().unwrap_or_else(|e| e.into_inner()) = Some(why.clone());
        let waiting: Vec<_> = shared.waiting.lock().unwrap_or_else(|e| e.into_inner()).drain().collect();
        for (_, w) in waiting {
            match w {
                Waiting::Call(tx) => drop(tx.send(Err(why.clone()))),
                Waiting::Watch { opened: Some(tx), .. } => drop(tx.send(Err(why.clone()))),
                Waiting::Watch { .. } => {}
            }
        }
    }
}

fn deliver(shared: &Shared, reply: proto::LaneReply) {
    let mut waiting = shared.waiting.lock().unwrap_or_else(|e| e.into_inner());
    match waiting.get_mut(&reply.id) {
        Some(Waiting::Watch { opened, events }) => match reply.reply {
            Some(Reply::Event(event)) => {
                let _ = events.send(event);
            }
            Some(Reply::WatchOpened(_)) => {
                if let Some(tx) = opened.take() {
                    let _ = tx.send(Ok(()));
                }
            }
            Some(Reply::Error(e)) => {
                if let Some(Waiting::Watch { opened: Some(tx), .. }) = waiting.remove(&reply.id) {
                    let _ = tx.send(Err(e.into()));
                }
            }
            _ => {}
        },
        Some(Waiting::Call(_)) => {
            if let Some(Waiting::Call(tx)) = waiting.remove(&reply.id) {
                drop(waiting);
                let result = match reply.reply {
                    Some(Reply::Error(e)) => Err(e.into()),
                    Some(r) => Ok(r),
                    None => Err(LaneError::unexpected("lane")),
                };
                let _ = tx.send(result);
            }
        }
        None => {}
    }
}

/// Sends an `Info` whenever the connection wrote nothing for [`LANE_KEEPALIVE_MS`]; ends with it.
async fn keep_alive(shared: std::sync::Weak<Shared>) {
    loop {
        tokio::time::sleep(Duration::from_millis(LANE_KEEPALIVE_MS)).await;
        let Some(strong) = shared.upgrade() else { return };
        if strong.ended.lock().unwrap_or_else(|e| e.into_inner()).is_some() {
            return;
        }
        if !strong.wrote_recently.swap(false, Ordering::Relaxed) {
            let client = LaneClient { shared: strong, session: None };
            let _ = client.info().await;
        }
    }
}
