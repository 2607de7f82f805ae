//! The sending side of a lane: one long-lived bidirectional stream to a peer that carries parts of
//! transfers back to back, and the reader of the receiver's replies on the same stream. Settles every
//! part handed to it exactly once (its reply, a skip before its first byte, or the loss of the lane,
//! which closes the connection); never reports a transfer's success itself (`Transfer` does).

use crate::net::{app_code, classify_connection_error};
use crate::outgoing::LanePlan;
use crate::reader::{FrameReader, ReadFail};
use crate::shared::Shared;
use crate::staging::HEADER_ROOM_BYTES;
use crate::transfers::Transfer;
use crate::wire::Frame;
use kvgate_abi::{PluginError, ReasonCode};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;

/// Encoded sizes of the sender's frames (type byte and body).
pub const PART_BEGIN_BYTES: usize = 33;
pub const SEGMENT_HEADER_BYTES: usize = 25;
pub const PART_END_BYTES: usize = 17;
pub const PART_ABORT_BYTES: usize = 9;

// A part of one class-sized segment fits in one staging buffer of its class.
const _: () = assert!(PART_BEGIN_BYTES + SEGMENT_HEADER_BYTES + PART_END_BYTES <= HEADER_ROOM_BYTES);

/// One transfer's share of bytes on one lane.
pub struct Part {
    pub t: Arc<Transfer>,
    pub ticket: u64,
    pub index: u32,
    pub count: u32,
    pub plan: LanePlan,
}

/// A part whose PART_BEGIN went out and whose reply has not come back.
struct Unanswered {
    t: Arc<Transfer>,
    bytes: u64,
    /// PART_ABORT was sent: the reply is CANCEL_ACK (or a REFUSED sent before the receiver saw it).
    aborted: bool,
}

#[derive(Default)]
struct Waiting {
    parts: VecDeque<Unanswered>,
    /// Set once the lane is dead (first reason wins): nothing more is sent on it.
    closed: Option<PluginError>,
}

/// One lane of a connection, shared by the transfers that use it.
pub struct Lane {
    queue: mpsc::UnboundedSender<Part>,
    /// Payload bytes handed to the lane and not yet settled: the least loaded lane takes the next part.
    outstanding_bytes: AtomicU64,
    /// Payload bytes queued and not yet staged (sizes the staging buffer, so queued parts share one).
    unstaged_bytes: AtomicU64,
    /// The writer waits for quinn to take a staged buffer (the connection's `send_window_bytes` of
    /// unacknowledged data is full): the lane has more to send than the connection lets out.
    waiting_for_quinn: AtomicBool,
    waiting: Mutex<Waiting>,
}

fn settle_failed(t: &Transfer, e: &PluginError) {
    t.fail(e.code, e.message.to_string());
    t.lane_settled();
}

impl Lane {
    /// A lane on `conn`; its stream is opened by its own task right away.
    pub fn start(shared: &Arc<Shared>, conn: quinn::Connection) -> Arc<Lane> {
        let (queue, rx) = mpsc::unbounded_channel();
        let lane = Arc::new(Lane {
            queue,
            outstanding_bytes: AtomicU64::new(0),
            unstaged_bytes: AtomicU64::new(0),
            waiting_for_quinn: AtomicBool::new(false),
            waiting: Mutex::new(Waiting::default()),
        });
        shared.handle.spawn(run_writer(shared.clone(), lane.clone(), conn, rx));
        lane
    }

    pub fn outstanding_bytes(&self) -> u64 {
        self.outstanding_bytes.load(Ordering::Relaxed)
    }

    /// Whether the lane is held back by its connection right now: its writer waits for quinn to take
    /// a buffer, or parts wait behind the one being staged. A lane whose parts all went out and wait
    /// only for their replies is not (a transfer at a time over a long round trip sends little, and
    /// that is not a stuck connection).
    pub fn held_back(&self) -> bool {
        self.waiting_for_quinn.load(Ordering::Relaxed) || self.unstaged_bytes.load(Ordering::Relaxed) > 0
    }

    /// Hand a part (already counted by `Transfer::lane_opening`) to the lane; it is settled exactly once.
    /// The queue holds at most one part per live transfer and lane (`max_inflight_transfers` bounds it).
    /// A part refused by a dead lane is failed on the runtime behind `defer` when given (the host's
    /// thread, inside `submit`, reports no event), else right here.
    pub fn submit(&self, part: Part, defer: Option<&tokio::runtime::Handle>) {
        let bytes = part.plan.bytes;
        self.outstanding_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.unstaged_bytes.fetch_add(bytes, Ordering::Relaxed);
        if let Err(mpsc::error::SendError(part)) = self.queue.send(part) {
            self.unstaged_bytes.fetch_sub(bytes, Ordering::Relaxed);
            self.outstanding_bytes.fetch_sub(bytes, Ordering::Relaxed);
            let why = self.waiting.lock().expect("lane lock").closed.clone();
            let why = why.unwrap_or_else(|| PluginError::new(ReasonCode::PEER_LOST, "the lane to the peer is closed"));
            match defer {
                Some(handle) => {
                    handle.spawn(async move { settle_failed(&part.t, &why) });
                }
                None => settle_failed(&part.t, &why),
            }
        }
    }

    /// Record a part about to go out; false (and nothing recorded) once the lane is dead.
    fn expect_reply(&self, t: &Arc<Transfer>, bytes: u64) -> Result<(), PluginError> {
        let mut w = self.waiting.lock().expect("lane lock");
        if let Some(e) = &w.closed {
            return Err(e.clone());
        }
        w.parts.push_back(Unanswered { t: t.clone(), bytes, aborted: false });
        Ok(())
    }

    /// Before PART_ABORT goes out for the part of `t` (if it still waits for its reply).
    fn mark_aborted(&self, t: &Arc<Transfer>) {
        let mut w = self.waiting.lock().expect("lane lock");
        if let Some(p) = w.parts.iter_mut().rev().find(|p| Arc::ptr_eq(&p.t, t)) {
            p.aborted = true;
        }
    }

    /// Settle the oldest unanswered part with the receiver's reply; `Err` names a protocol violation.
    fn settle_reply(&self, frame: Frame) -> Result<(), String> {
        let mut w = self.waiting.lock().expect("lane lock");
        let Some(front) = w.parts.front() else {
            return Err(format!("a reply with no part waiting for one: {frame:?}"));
        };
        let xfer = front.t.xfer.0;
        let expected = match &frame {
            Frame::Done { xfer: x, bytes } => *x == xfer && *bytes == front.bytes && !front.aborted,
            Frame::Refused { xfer: x, .. } => *x == xfer,
            Frame::CancelAck { xfer: x, .. } => *x == xfer && front.aborted,
            _ => false,
        };
        if !expected {
            return Err(format!(
                "reply {frame:?} does not answer the oldest part (transfer {xfer}, {} bytes, aborted: {})",
                front.bytes, front.aborted
            ));
        }
        let part = w.parts.pop_front().expect("front exists");
        drop(w);
        self.outstanding_bytes.fetch_sub(part.bytes, Ordering::Relaxed);
        match frame {
            Frame::Done { .. } => part.t.lane_done(),
            Frame::Refused { reason, message, .. } => {
                part.t.fail(ReasonCode(reason), format!("the receiver refused the transfer: {message}"));
                part.t.lane_settled();
            }
            _ => part.t.lane_settled(),
        }
        Ok(())
    }

    /// The lane is given up (its connection is replaced): every part on it fails with `why`, queued
    /// ones as the writer drains them.
    pub fn fail_all(&self, why: &PluginError) {
        self.close(why)
    }

    /// The lane is dead (its connection is closed): every unanswered part is settled as failed.
    fn close(&self, why: &PluginError) {
        let parts: Vec<Unanswered> = {
            let mut w = self.waiting.lock().expect("lane lock");
            if w.closed.is_none() {
                w.closed = Some(why.clone());
            }
            w.parts.drain(..).collect()
        };
        for p in parts {
            self.outstanding_bytes.fetch_sub(p.bytes, Ordering::Relaxed);
            settle_failed(&p.t, why);
        }
    }
}

/// A lane that cannot go on closes its connection: only then can no byte of an unanswered part still
/// land at the receiver, and the peer is set up afresh (new connections, new lanes) by the next submit.
fn kill_connection(conn: &quinn::Connection, reason: ReasonCode, why: &str) -> PluginError {
    match conn.close_reason() {
        Some(e) => classify_connection_error(&e, true),
        None => {
            tracing::warn!(reason = %reason, message = why, "quic: closing a connection whose lane broke");
            conn.close(app_code(reason), why.as_bytes());
            PluginError::new(reason, why.to_string())
        }
    }
}

async fn run_writer(
    shared: Arc<Shared>,
    lane: Arc<Lane>,
    conn: quinn::Connection,
    mut rx: mpsc::UnboundedReceiver<Part>,
) {
    let end = match conn.open_bi().await {
        Err(e) => classify_connection_error(&e, true),
        Ok((send, recv)) => {
            shared.lane_streams_opened.fetch_add(1, Ordering::Relaxed);
            shared.handle.spawn(run_reader(lane.clone(), conn.clone(), recv));
            let mut writer = LaneWriter { shared: &shared, lane: &lane, send, buf: Vec::new() };
            let end = writer.serve(&conn, &mut rx).await;
            kill_connection(&conn, end.code, &end.message)
        }
    };
    lane.close(&end);
    // The first reason the lane died for (a stuck connection's, say) is what its queued parts report.
    let end = lane.waiting.lock().expect("lane lock").closed.clone().unwrap_or(end);
    rx.close();
    while let Ok(part) = rx.try_recv() {
        lane.unstaged_bytes.fetch_sub(part.plan.bytes, Ordering::Relaxed);
        lane.outstanding_bytes.fetch_sub(part.plan.bytes, Ordering::Relaxed);
        settle_failed(&part.t, &end);
    }
}

async fn run_reader(lane: Arc<Lane>, conn: quinn::Connection, recv: quinn::RecvStream) {
    let mut reader = FrameReader::new(recv);
    let end = loop {
        match reader.read_frame().await {
            Ok(Some(frame)) => {
                if let Err(why) = lane.settle_reply(frame) {
                    break kill_connection(&conn, ReasonCode::PROTOCOL_VIOLATION, &why);
                }
            }
            Ok(None) => {
                break kill_connection(
                    &conn,
                    ReasonCode::PROTOCOL_VIOLATION,
                    "the receiver ended the replies of a lane in use",
                )
            }
            Err(ReadFail::Source(source)) => {
                break kill_connection(
                    &conn,
                    ReasonCode::PROTOCOL_VIOLATION,
                    &format!("the replies of a lane broke: {source:?}"),
                )
            }
            Err(bad) => {
                break kill_connection(&conn, ReasonCode::PROTOCOL_VIOLATION, &format!("bad reply on a lane: {bad:?}"))
            }
        }
    };
    lane.close(&end);
}

/// Stages frames and payload into pooled buffers and hands them to quinn. A buffer only ever ends at a
/// frame boundary (a segment is cut into pieces that fit), so a part can be aborted between buffers.
struct LaneWriter<'a> {
    shared: &'a Arc<Shared>,
    lane: &'a Lane,
    send: quinn::SendStream,
    buf: Vec<u8>,
}

impl LaneWriter<'_> {
    fn free(&self) -> usize {
        self.buf.capacity() - self.buf.len()
    }

    /// Hand what is staged to quinn (waits for flow control; only the stream's end interrupts it).
    async fn flush(&mut self) -> Result<(), PluginError> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let staged = self.shared.staging.freeze(std::mem::take(&mut self.buf));
        self.lane.waiting_for_quinn.store(true, Ordering::Relaxed);
        let written = self.send.write_chunk(staged).await;
        self.lane.waiting_for_quinn.store(false, Ordering::Relaxed);
        match written {
            Ok(()) => Ok(()),
            Err(quinn::WriteError::ConnectionLost(e)) => Err(classify_connection_error(&e, true)),
            Err(quinn::WriteError::Stopped(code)) => Err(PluginError::new(
                ReasonCode::PROTOCOL_VIOLATION,
                format!("the receiver stopped a lane in use (code {code})"),
            )),
            Err(other) => Err(PluginError::new(ReasonCode::TRANSPORT_ERROR, format!("lane write failed: {other}"))),
        }
    }

    /// Make room for `need` more bytes: flush a buffer with less room, and take one sized for
    /// `payload_ahead` (the part's remaining payload) plus whatever else is queued on the lane.
    async fn room(&mut self, need: usize, payload_ahead: u64) -> Result<(), PluginError> {
        if self.free() >= need {
            return Ok(());
        }
        self.flush().await?;
        let queued = self.lane.unstaged_bytes.load(Ordering::Relaxed);
        let wanted = payload_ahead.saturating_add(queued).saturating_add(HEADER_ROOM_BYTES as u64);
        let old =
            std::mem::replace(&mut self.buf, self.shared.staging.take(usize::try_from(wanted).unwrap_or(usize::MAX)));
        drop(self.shared.staging.freeze(old));
        debug_assert!(self.free() >= need);
        Ok(())
    }

    async fn serve(&mut self, conn: &quinn::Connection, rx: &mut mpsc::UnboundedReceiver<Part>) -> PluginError {
        loop {
            let part = match rx.try_recv() {
                Ok(part) => part,
                Err(mpsc::error::TryRecvError::Disconnected) => {
                    return PluginError::new(ReasonCode::PEER_LOST, "the lane was dropped")
                }
                Err(mpsc::error::TryRecvError::Empty) => {
                    // Nothing else queued: what is staged goes out now, then wait for the next part.
                    if let Err(e) = self.flush().await {
                        return e;
                    }
                    tokio::select! {
                        biased;
                        part = rx.recv() => match part {
                            Some(part) => part,
                            None => return PluginError::new(ReasonCode::PEER_LOST, "the lane was dropped"),
                        },
                        e = conn.closed() => return classify_connection_error(&e, true),
                    }
                }
            };
            self.lane.unstaged_bytes.fetch_sub(part.plan.bytes, Ordering::Relaxed);
            if let Err(e) = self.write_part(part).await {
                return e;
            }
            // A lane that always has a part queued and room in quinn never waits: let the worker run
            // other tasks (quinn's connection driver among them) once its budget is spent.
            tokio::task::coop::consume_budget().await;
        }
    }

    /// Stage one part: PART_BEGIN, its segments cut into pieces, PART_END; or PART_ABORT once the
    /// transfer is stopped (checked before every piece). `Err` only when the lane is dead.
    async fn write_part(&mut self, part: Part) -> Result<(), PluginError> {
        let Part { t, ticket, index, count, plan } = part;
        if t.is_stopped() {
            // Not a byte of it went out: the receiver cannot write for it.
            self.lane.outstanding_bytes.fetch_sub(plan.bytes, Ordering::Relaxed);
            t.lane_settled();
            return Ok(());
        }
        if let Err(e) = self.lane.expect_reply(&t, plan.bytes) {
            self.lane.outstanding_bytes.fetch_sub(plan.bytes, Ordering::Relaxed);
            settle_failed(&t, &e);
            return Err(e);
        }
        let xfer = t.xfer.0;
        self.room(PART_BEGIN_BYTES, plan.bytes).await?;
        Frame::PartBegin { xfer, ticket, part_index: index, part_count: count, bytes: plan.bytes }
            .encode(&mut self.buf);
        let mut left = plan.bytes;
        let mut pieces = 0u64;
        for seg in &plan.segments {
            let mut done = 0u64;
            while done < seg.len {
                self.room(SEGMENT_HEADER_BYTES + 1, left).await?;
                if t.is_stopped() {
                    return self.abort(&t).await;
                }
                let n = (seg.len - done).min((self.free() - SEGMENT_HEADER_BYTES) as u64);
                let mark = self.buf.len();
                Frame::Segment { key: seg.remote_key, offset: seg.remote_offset + done, len: n }.encode(&mut self.buf);
                if let Err(e) =
                    self.shared.regions.copy_out(seg.local_key, seg.local_offset + done, n as usize, &mut self.buf)
                {
                    self.buf.truncate(mark);
                    t.fail(e.code, e.message.to_string());
                    return self.abort(&t).await;
                }
                pieces += 1;
                done += n;
                left -= n;
            }
        }
        self.room(PART_END_BYTES, 0).await?;
        Frame::PartEnd { segments: pieces, bytes: plan.bytes }.encode(&mut self.buf);
        Ok(())
    }

    async fn abort(&mut self, t: &Arc<Transfer>) -> Result<(), PluginError> {
        self.room(PART_ABORT_BYTES, 0).await?;
        self.lane.mark_aborted(t);
        Frame::PartAbort { xfer: t.xfer.0 }.encode(&mut self.buf);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_size_constants_match_the_encoding() {
        let encoded = |f: Frame| f.to_bytes().len();
        assert_eq!(
            encoded(Frame::PartBegin { xfer: 1, ticket: 2, part_index: 0, part_count: 1, bytes: 3 }),
            PART_BEGIN_BYTES
        );
        assert_eq!(encoded(Frame::Segment { key: 1, offset: 2, len: 3 }), SEGMENT_HEADER_BYTES);
        assert_eq!(encoded(Frame::PartEnd { segments: 1, bytes: 3 }), PART_END_BYTES);
        assert_eq!(encoded(Frame::PartAbort { xfer: 1 }), PART_ABORT_BYTES);
    }
}
