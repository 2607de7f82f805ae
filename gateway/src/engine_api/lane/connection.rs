//! One lane connection: this task reads frames, decodes them and starts each call (no task per call:
//! the calls in flight are futures it polls itself), and queues each answer; one writer task writes
//! whatever is queued, and the connection's room events, in one `write` at a time.

use super::dispatch::{dispatch, lane_error, refusal, Answer, EventStream};
use super::reply_queue::ReplyQueue;
use super::LaneLimits;
use crate::engine_api::EngineApiService;
use crate::listeners::ConnectionId;
use futures_util::stream::{FuturesUnordered, StreamExt};
use futures_util::FutureExt;
use kvgate_client::lane_frame::{FrameBuffer, FrameTooLarge};
use kvgate_client::proto::{self, lane_reply::Reply};
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

/// Room events the writer encodes per `write` at most, so that replies never wait behind a flood.
pub const EVENTS_PER_WRITE: usize = 256;

/// Serve one accepted connection until the engine closes it or breaks the protocol.
pub async fn serve<Io>(io: Io, connection: ConnectionId, service: EngineApiService, limits: LaneLimits)
where
    Io: AsyncRead + AsyncWrite + Send + 'static,
{
    let (mut read, write) = tokio::io::split(io);
    let queue = Arc::new(ReplyQueue::new(limits.max_queued_reply_bytes));
    let (watch_tx, watch_rx) = mpsc::channel(1);
    let writer = tokio::spawn(write_replies(write, queue.clone(), watch_rx));
    let service = &service;
    let mut in_flight = FuturesUnordered::new();
    let mut buf = FrameBuffer::default();
    let mut reading = true;
    let mut watch_call: Option<u64> = None;
    loop {
        tokio::select! {
            biased;
            Some((id, answer)) = in_flight.next(), if !in_flight.is_empty() => match answer {
                Ok(Answer::Reply(reply)) => queue.push(&proto::LaneReply { id, reply: Some(reply) }),
                Ok(Answer::Watch(stream)) => {
                    queue.push(&proto::LaneReply { id, reply: Some(Reply::WatchOpened(proto::WatchOpened {})) });
                    let _ = watch_tx.send((id, stream)).await;
                }
                Err(status) => {
                    if watch_call == Some(id) {
                        watch_call = None;
                    }
                    queue.push(&proto::LaneReply { id, reply: Some(Reply::Error(lane_error(&status))) })
                }
            },
            read = read.read_buf(buf.spare()), if reading && queue.has_room() => {
                match read {
                    Ok(0) | Err(_) => reading = false,
                    Ok(_) => {
                        if let Err(end) = take_calls(&mut buf, &limits, connection, service, &mut in_flight, &queue, &mut watch_call) {
                            tracing::warn!(connection = connection.0, reason = end.reason, "engine lane connection closed: {}", end.message);
                            queue.push(&refusal(0, end.code, end.reason, end.message));
                            break;
                        }
                    }
                }
            }
            _ = queue.drained.notified(), if reading && !queue.has_room() => {}
        }
        if !reading && in_flight.is_empty() {
            break;
        }
    }
    queue.close();
    let _ = writer.await;
}

/// Why a connection is ended by the gateway.
struct ConnectionEnd {
    code: tonic::Code,
    reason: &'static str,
    message: String,
}

/// Start every whole call now in `buf`; an oversize or undecodable frame ends the connection.
fn take_calls<'s>(
    buf: &mut FrameBuffer,
    limits: &LaneLimits,
    connection: ConnectionId,
    service: &'s EngineApiService,
    in_flight: &mut FuturesUnordered<CallFuture<'s>>,
    queue: &ReplyQueue,
    watch_call: &mut Option<u64>,
) -> Result<(), ConnectionEnd> {
    loop {
        let body = match buf.take(limits.max_frame_bytes as usize) {
            Ok(Some(body)) => body,
            Ok(None) => return Ok(()),
            Err(FrameTooLarge { len, max }) => {
                return Err(ConnectionEnd {
                    code: tonic::Code::ResourceExhausted,
                    reason: "frame_too_large",
                    message: format!("a frame of {len} bytes; engine_api.lane_max_frame_bytes = {max}"),
                })
            }
        };
        let request = <proto::LaneRequest as prost::Message>::decode(body).map_err(|e| ConnectionEnd {
            code: tonic::Code::InvalidArgument,
            reason: "bad_frame",
            message: format!("a frame that is not a LaneRequest: {e}"),
        })?;
        let id = request.id;
        if in_flight.len() as u64 >= limits.max_calls_in_flight {
            let message = format!(
                "{} calls in flight on this connection; engine_api.lane_max_calls_in_flight = {}",
                in_flight.len(),
                limits.max_calls_in_flight
            );
            tracing::info!(
                connection = connection.0,
                reason = "too_many_calls_in_flight",
                "lane call refused: {message}"
            );
            queue.push(&refusal(id, tonic::Code::ResourceExhausted, "too_many_calls_in_flight", message));
            continue;
        }
        if matches!(request.call, Some(proto::lane_request::Call::Watch(_))) {
            if watch_call.is_some() {
                let message = "this lane connection has its watch already (one per connection)".to_string();
                tracing::info!(connection = connection.0, reason = "too_many_watchers", "lane call refused: {message}");
                queue.push(&refusal(id, tonic::Code::ResourceExhausted, "too_many_watchers", message));
                continue;
            }
            *watch_call = Some(id);
        }
        if request.call.is_none() {
            tracing::info!(
                connection = connection.0,
                id,
                reason = "unknown_call",
                "lane call refused: no call this gateway knows"
            );
        }
        in_flight
            .push(dispatch(service, connection, request.session, request.call).map(move |answer| (id, answer)).boxed());
    }
}

type CallFuture<'s> = futures_util::future::BoxFuture<'s, (u64, Result<Answer, tonic::Status>)>;

/// The writer: waits for queued replies or room events, then writes all it has in one `write`.
async fn write_replies<W: AsyncWrite>(
    write: W,
    queue: Arc<ReplyQueue>,
    mut watch_rx: mpsc::Receiver<(u64, EventStream)>,
) {
    tokio::pin!(write);
    let mut out = Vec::new();
    let mut watch: Option<(u64, EventStream)> = None;
    loop {
        let mut event = None;
        tokio::select! {
            _ = queue.ready.notified() => {}
            Some(opened) = watch_rx.recv(), if watch.is_none() => watch = Some(opened),
            next = next_event(&mut watch), if watch.is_some() => event = Some(next),
        }
        let closing = queue.take_into(&mut out);
        if let Some(next) = event {
            encode_event(next, &mut watch, &mut out);
        }
        for _ in 0..EVENTS_PER_WRITE {
            let Some(next) = next_event(&mut watch).now_or_never() else { break };
            encode_event(next, &mut watch, &mut out);
        }
        if !out.is_empty() {
            if write.write_all(&out).await.is_err() {
                queue.writer_gone();
                return;
            }
            out.clear();
        }
        if closing {
            let mut rest = Vec::new();
            queue.take_into(&mut rest);
            let _ = write.write_all(&rest).await;
            let _ = write.shutdown().await;
            return;
        }
    }
}

async fn next_event(watch: &mut Option<(u64, EventStream)>) -> Option<Result<proto::RoomEvent, tonic::Status>> {
    match watch {
        Some((_, stream)) => stream.next().await,
        None => std::future::pending().await,
    }
}

/// One event (or the watch's end) of the connection's watch, as a frame.
fn encode_event(
    next: Option<Result<proto::RoomEvent, tonic::Status>>,
    watch: &mut Option<(u64, EventStream)>,
    out: &mut Vec<u8>,
) {
    let Some((id, _)) = watch else { return };
    let id = *id;
    let reply = match next {
        Some(Ok(event)) => Reply::Event(event),
        Some(Err(status)) => {
            *watch = None;
            Reply::Error(lane_error(&status))
        }
        None => {
            *watch = None;
            return;
        }
    };
    kvgate_client::lane_frame::encode_frame(&proto::LaneReply { id, reply: Some(reply) }, out);
}
