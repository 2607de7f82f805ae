//! Synthetic engines: a prefill engine and a decode engine, each a client of its own gateway in an
//! engine session of its own, with a KV pool registered by file path. `run_room` moves one request's
//! KV cache (expect on decode, one batched send per chunk on prefill), waits for both sides' terminal
//! events and verifies the destination checksum. Never decides an outcome itself: it reports what the
//! gateways said.

use super::pool::{checksum, KvPool, KvShape};
use anyhow::{bail, Context};
use kvgate_client::{proto, room_key, Client, RoomEvent};
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// How long `run_room` waits for a side's terminal event before calling the room lost.
pub const ROOM_WAIT_TIMEOUT_MS: u64 = 60_000;

/// Routes a gateway's watch stream to per-room listeners.
#[derive(Clone, Default)]
pub struct EventRouter {
    rooms: Arc<Mutex<HashMap<u64, mpsc::UnboundedSender<RoomEvent>>>>,
}

impl EventRouter {
    /// Start routing `client`'s watch stream (every room; outcomes only, which is all `run_room` reads).
    pub async fn start(client: &Client) -> anyhow::Result<EventRouter> {
        let router = EventRouter::default();
        let mut stream = client.watch_outcomes(None).await.context("watch")?;
        let rooms = router.rooms.clone();
        tokio::spawn(async move {
            while let Ok(Some(event)) = stream.message().await {
                let room = event.key.as_ref().map(|k| k.room).unwrap_or(0);
                let target = rooms.lock().unwrap_or_else(|e| e.into_inner()).get(&room).cloned();
                if let Some(tx) = target {
                    let _ = tx.send(event);
                }
            }
        });
        Ok(router)
    }
    /// Start routing room events that arrive on `events` (e.g. a `LaneClient` watch).
    pub fn from_events(mut events: mpsc::UnboundedReceiver<RoomEvent>) -> EventRouter {
        let router = EventRouter::default();
        let rooms = router.rooms.clone();
        tokio::spawn(async move {
            while let Some(event) = events.recv().await {
                let room = event.key.as_ref().map(|k| k.room).unwrap_or(0);
                let target = rooms.lock().unwrap_or_else(|e| e.into_inner()).get(&room).cloned();
                if let Some(tx) = target {
                    let _ = tx.send(event);
                }
            }
        });
        router
    }
    pub fn listen(&self, room: u64) -> mpsc::UnboundedReceiver<RoomEvent> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.rooms.lock().unwrap_or_else(|e| e.into_inner()).insert(room, tx);
        rx
    }
    pub fn forget(&self, room: u64) {
        self.rooms.lock().unwrap_or_else(|e| e.into_inner()).remove(&room);
    }
}

/// One engine: its client (in its session), its pool (registered as one region) and its event router
/// (whose Watch stream keeps the session attached).
pub struct Engine {
    pub client: Client,
    pub session: u64,
    pub region: u64,
    pub pool: Arc<Mutex<KvPool>>,
    pub events: EventRouter,
}

/// A session name unique in this process, from an engine's label.
fn session_name(label: &str) -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let base: String =
        label.chars().map(|c| if c.is_ascii_alphanumeric() || "._:-".contains(c) { c } else { '-' }).take(64).collect();
    format!("{base}-{}-{}", std::process::id(), NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
}

impl Engine {
    pub async fn connect(socket: &Path, pool: KvPool, label: &str) -> anyhow::Result<Engine> {
        let client = Client::connect_unix(socket).await.with_context(|| format!("connect {}", socket.display()))?;
        let session = client
            .open_session(&session_name(label))
            .await
            .map_err(|s| anyhow::anyhow!("open a session for {label}: {}", s.message()))?
            .session;
        let client = client.in_session(session);
        let region = client
            .register_shared_memory(&pool.path.display().to_string(), 0, pool.len(), label)
            .await
            .map_err(|s| anyhow::anyhow!("register {label} pool: {}", s.message()))?;
        let events = EventRouter::start(&client).await?;
        Ok(Engine { client, session, region, pool: Arc::new(Mutex::new(pool)), events })
    }
}

/// What one side said about a room.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SideOutcome {
    pub succeeded: bool,
    /// Failure reason code (empty on success).
    pub reason: String,
    pub phase: String,
    pub elapsed_ms: u64,
    /// When this engine saw the terminal event.
    pub seen_after: Duration,
}

/// The result of one room.
#[derive(Clone, Debug)]
pub struct RoomResult {
    pub room: u64,
    pub bytes: u64,
    /// When the engines issued the room's expect and first send: its transfer window starts.
    pub started: Instant,
    /// From `started` to the later of both sides' terminal events: the transfer through the gateways.
    pub latency: Duration,
    /// The synthetic engines' own work on the room, outside `latency`: generating the source KV and
    /// zeroing the destination before, checksumming the destination after (wall time, on the same
    /// cores as the gateways).
    pub engine_work: Duration,
    pub prefill: SideOutcome,
    pub decode: SideOutcome,
    /// The destination checksum matched the source (only checked when both sides succeeded).
    pub verified: bool,
}

/// Wait for the `Terminal` event of `room` on one side, then (best effort, bounded) for `Reusable`.
pub async fn wait_terminal(
    rx: &mut mpsc::UnboundedReceiver<RoomEvent>,
    started: Instant,
    timeout: Duration,
) -> anyhow::Result<SideOutcome> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let event = tokio::time::timeout_at(deadline, rx.recv())
            .await
            .context("no terminal event in time")?
            .context("event stream closed")?;
        if let Some(proto::room_event::Event::Terminal(t)) = event.event {
            return Ok(SideOutcome {
                succeeded: t.succeeded,
                reason: t.reason,
                phase: t.phase,
                elapsed_ms: t.elapsed_ms,
                seen_after: started.elapsed(),
            });
        }
    }
}

/// Wait until the room's memory is reusable on that side (bounded by `timeout`).
pub async fn wait_reusable(rx: &mut mpsc::UnboundedReceiver<RoomEvent>, timeout: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + timeout;
    while let Ok(Some(event)) = tokio::time::timeout_at(deadline, rx.recv()).await {
        if matches!(event.event, Some(proto::room_event::Event::Reusable(_))) {
            return true;
        }
    }
    false
}

/// Prefill side: send every chunk of every part of `room` from `slot`, one `SendBatch` per chunk
/// (every part's slices of that chunk), stopping at the first chunk with a refusal (returned with its
/// reason code, as a single `Send`'s would be). With `chunk_limit`, only the first chunks are sent
/// and no part is completed.
pub async fn send_all(
    prefill: &Engine,
    shape: &KvShape,
    room: u64,
    slot: u64,
    peer: &str,
    chunk_limit: Option<u64>,
) -> Result<(), tonic::Status> {
    let order: Vec<u64> = (0..chunk_limit.unwrap_or(shape.chunks).min(shape.chunks)).collect();
    send_chunks(prefill, shape, ChunkPlan { room, slot, peer, order: &order, offsets: false }).await
}

/// The order the demo's prefill engine sends a room's chunks in: a shuffle of `0..chunks` seeded by
/// the room (the same room always in the same order), as an engine whose layers or pages finish out
/// of order would send them.
pub fn shuffled_chunks(room: u64, chunks: u64) -> Vec<u64> {
    use rand::seq::SliceRandom;
    use rand::SeedableRng;
    let mut order: Vec<u64> = (0..chunks).collect();
    order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(room));
    order
}

/// Prefill side, the demo's engines: send every chunk of every part of `room` from `slot` in a
/// shuffled order ([`shuffled_chunks`]), each chunk naming its byte offset in its part's stream
/// (`SendRequest.offset`, so the receiver needs no agreement on how chunks are cut or numbered), one
/// `SendBatch` per chunk (every part's slices of that chunk), `last` on the final batch (it
/// completes every part). Stops at the first chunk with a refusal, as [`send_all`] does.
pub async fn send_all_placed(
    prefill: &Engine,
    shape: &KvShape,
    room: u64,
    slot: u64,
    peer: &str,
) -> Result<(), tonic::Status> {
    let order = shuffled_chunks(room, shape.chunks);
    send_chunks(prefill, shape, ChunkPlan { room, slot, peer, order: &order, offsets: true }).await
}

/// Which chunks of a room a prefill engine sends, in what order, and whether each names its offset.
struct ChunkPlan<'a> {
    room: u64,
    slot: u64,
    peer: &'a str,
    order: &'a [u64],
    offsets: bool,
}

/// One `SendBatch` per chunk of `plan.order`; `last` on the final one only when the order covers
/// every chunk of the room.
async fn send_chunks(prefill: &Engine, shape: &KvShape, plan: ChunkPlan<'_>) -> Result<(), tonic::Status> {
    let slot_offset = prefill.pool.lock().unwrap_or_else(|e| e.into_inner()).slot_offset(plan.slot);
    let complete = plan.order.len() as u64 == shape.chunks;
    for (i, &chunk) in plan.order.iter().enumerate() {
        let sends = (0..shape.parts)
            .map(|part| proto::SendRequest {
                offset: plan.offsets.then(|| shape.chunk_stream_offset(chunk)),
                key: Some(room_key(plan.room, 0)),
                part: part as u32,
                chunk: chunk as u32,
                slices: shape.chunk_slices(prefill.region, slot_offset, part, chunk),
                last: complete && i + 1 == plan.order.len(),
                peer: plan.peer.to_string(),
            })
            .collect();
        let reply = prefill.client.send_batch(sends).await?;
        if let Some(refused) = reply.results.into_iter().find(|r| !r.reason.is_empty()) {
            return Err(refusal_status(&refused));
        }
    }
    Ok(())
}

/// A refused call of a batch as the status a single call would have got (reason code in the message
/// and in the `kvgate-reason` metadata).
pub fn refusal_status(refused: &proto::CallResult) -> tonic::Status {
    let mut status = tonic::Status::failed_precondition(format!("{}: {}", refused.reason, refused.message));
    if let Ok(value) = refused.reason.parse() {
        status.metadata_mut().insert(kvgate_client::REASON_METADATA_KEY, value);
    }
    status
}

/// Decode side: expect `room` into `slot`.
pub async fn expect_into(
    decode: &Engine,
    shape: &KvShape,
    room: u64,
    slot: u64,
    peer: &str,
    deadline_ms: u64,
) -> Result<(), tonic::Status> {
    let slot_offset = decode.pool.lock().unwrap_or_else(|e| e.into_inner()).slot_offset(slot);
    let parts = (0..shape.parts).map(|p| shape.part_slices(decode.region, slot_offset, p)).collect();
    decode.client.expect(room_key(room, 0), peer, parts, deadline_ms).await
}

/// Fill the source slot (returns its checksum) and clear the destination slot, off the async threads.
pub async fn prepare_slots(prefill: &Engine, decode: &Engine, room: u64, src: u64, dst: u64) -> anyhow::Result<u64> {
    let (p, d) = (prefill.pool.clone(), decode.pool.clone());
    Ok(tokio::task::spawn_blocking(move || {
        d.lock().unwrap_or_else(|e| e.into_inner()).clear(dst);
        p.lock().unwrap_or_else(|e| e.into_inner()).fill(src, room)
    })
    .await?)
}

pub async fn slot_checksum(engine: &Engine, slot: u64) -> anyhow::Result<u64> {
    let pool = engine.pool.clone();
    Ok(tokio::task::spawn_blocking(move || checksum(pool.lock().unwrap_or_else(|e| e.into_inner()).slot(slot))).await?)
}

/// Move one request's KV cache from `src` (prefill pool) to `dst` (decode pool) and verify it. The
/// chunks go in a shuffled order, each placed by its offset ([`send_all_placed`]).
pub async fn run_room(
    prefill: &Engine,
    decode: &Engine,
    shape: &KvShape,
    room: u64,
    src: u64,
    dst: u64,
) -> anyhow::Result<RoomResult> {
    let engine_started = Instant::now();
    let expected = prepare_slots(prefill, decode, room, src, dst).await?;
    let prepare = engine_started.elapsed();
    let mut p_rx = prefill.events.listen(room);
    let mut d_rx = decode.events.listen(room);
    let started = Instant::now();
    let (expect, send) = tokio::join!(
        expect_into(decode, shape, room, dst, super::gateways::PREFILL_NAME, 0),
        send_all_placed(prefill, shape, room, src, super::gateways::DECODE_NAME)
    );
    if let Err(s) = expect {
        bail!("expect of room {room} refused: {}", s.message());
    }
    if let Err(s) = send {
        bail!("send of room {room} refused: {}", s.message());
    }
    let timeout = Duration::from_millis(ROOM_WAIT_TIMEOUT_MS);
    let (p, d) = tokio::join!(wait_terminal(&mut p_rx, started, timeout), wait_terminal(&mut d_rx, started, timeout));
    let (prefill_outcome, decode_outcome) = (p?, d?);
    let latency = started.elapsed();
    let check_started = Instant::now();
    let verified =
        prefill_outcome.succeeded && decode_outcome.succeeded && slot_checksum(decode, dst).await? == expected;
    let engine_work = prepare + check_started.elapsed();
    // Slots are reused: wait until neither side can still touch them.
    let reuse = Duration::from_millis(ROOM_WAIT_TIMEOUT_MS);
    let _ = tokio::join!(wait_reusable(&mut p_rx, reuse), wait_reusable(&mut d_rx, reuse));
    prefill.events.forget(room);
    decode.events.forget(room);
    Ok(RoomResult {
        room,
        bytes: shape.request_bytes(),
        started,
        latency,
        engine_work,
        prefill: prefill_outcome,
        decode: decode_outcome,
        verified,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rooms_chunks_go_in_a_shuffled_order_of_its_own_every_time() {
        let mut shuffled = 0;
        for room in 0..200 {
            let order = shuffled_chunks(room, 4);
            let mut sorted = order.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, vec![0, 1, 2, 3], "room {room}: every chunk once");
            assert_eq!(order, shuffled_chunks(room, 4), "room {room}: the same order again");
            shuffled += usize::from(order != sorted);
        }
        assert!(shuffled > 150, "most rooms go out of order: {shuffled} of 200");
        assert_eq!(shuffled_chunks(7, 1), vec![0]);
        assert!(shuffled_chunks(7, 0).is_empty());
    }
}
