//! The sending side of a transfer: split it into lanes (one stream each, spread over the peer's
//! connections), stream each lane's segments, and settle each lane only on the receiver's word
//! (done, refused, cancel acknowledged) or the loss of its connection. Never reports success itself:
//! `Transfer` does, once every lane is confirmed.

use crate::net::{app_code, classify_connection_error};
use crate::peers::{self, PeerEntry};
use crate::plugin::Shared;
use crate::reader::{FrameReader, ReadFail};
use crate::staging::StagingPool;
use crate::transfers::Transfer;
use crate::wire::Frame;
use kvgate_abi::{PluginError, ReasonCode};
use std::sync::Arc;
use tokio::sync::watch;
use tokio::time::Instant;

/// One contiguous piece, already resolved to the receiver's key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlannedSegment {
    pub local_key: u64,
    pub local_offset: u64,
    pub remote_key: u64,
    pub remote_offset: u64,
    pub len: u64,
}

/// The segments one stream carries.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LanePlan {
    pub segments: Vec<PlannedSegment>,
    pub bytes: u64,
}

/// Split `segments` into at most `max_lanes` lanes of nearly equal bytes, none below `min_lane_bytes`
/// (except a single lane). Zero-length segments move nothing and are dropped. Always one lane at least.
pub fn plan_lanes(segments: &[PlannedSegment], total: u64, max_lanes: usize, min_lane_bytes: u64) -> Vec<LanePlan> {
    let lanes = (total / min_lane_bytes.max(1)).clamp(1, max_lanes.max(1) as u64) as usize;
    let target = total.div_ceil(lanes as u64).max(1);
    let mut plans: Vec<LanePlan> = vec![LanePlan::default()];
    for seg in segments.iter().filter(|s| s.len > 0) {
        let mut seg = *seg;
        while seg.len > 0 {
            let is_last_lane = plans.len() == lanes;
            let current = plans.last_mut().expect("one lane");
            let room = if is_last_lane { u64::MAX } else { target - current.bytes };
            let take = seg.len.min(room);
            current.segments.push(PlannedSegment { len: take, ..seg });
            current.bytes += take;
            seg.local_offset += take;
            seg.remote_offset += take;
            seg.len -= take;
            if current.bytes >= target && !is_last_lane {
                plans.push(LanePlan::default());
            }
        }
    }
    if plans.len() > 1 && plans.last().is_some_and(|p| p.bytes == 0) {
        plans.pop();
    }
    plans
}

async fn stopped(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|stop| *stop).await;
}

/// Drive one transfer: wait for the peer's connections, start the lanes, enforce the deadline.
pub async fn run_transfer(shared: Arc<Shared>, t: Arc<Transfer>, entry: Arc<PeerEntry>, lanes: Vec<LanePlan>, ticket: u64, deadline: Instant) {
    let mut stop = t.stop_signal();
    let timeout_ms = deadline.saturating_duration_since(Instant::now()).as_millis();
    let conns = tokio::select! {
        r = peers::ready(&shared, &entry) => r,
        _ = tokio::time::sleep_until(deadline) => {
            t.fail(ReasonCode::TIMEOUT, "the transfer timeout passed while connecting to the peer");
            return;
        }
        _ = stopped(&mut stop) => return,
    };
    let conns = match conns {
        Ok(c) => c,
        Err(e) => {
            t.fail(e.code, format!("peer {}: {}", entry.id.0, e.message));
            return;
        }
    };
    let lane_count = lanes.len() as u32;
    let first = entry.first_connection_for(lanes.len());
    for (index, lane) in lanes.into_iter().enumerate() {
        if !t.lane_opening() {
            break;
        }
        let conn = conns[first.wrapping_add(index) % conns.len()].clone();
        let begin = Frame::LaneBegin {
            xfer: t.xfer.0,
            ticket,
            lane_index: index as u32,
            lane_count,
            segment_count: lane.segments.len() as u64,
            lane_bytes: lane.bytes,
        };
        let (shared, t) = (shared.clone(), t.clone());
        tokio::spawn(async move { run_lane(shared, t, conn, begin, lane).await });
    }
    tokio::select! {
        _ = tokio::time::sleep_until(deadline) => {
            t.fail(ReasonCode::TIMEOUT, format!("the transfer timeout ({timeout_ms} ms from submit) passed"));
        }
        _ = stopped(&mut stop) => {}
    }
}

enum WriteEnd {
    /// Every frame was handed to the stream.
    Written,
    /// The transfer was stopped (cancel, timeout, another lane failed).
    Stopped,
    /// A local failure (the source region went away).
    Local(PluginError),
    /// The receiver stopped the stream: its reply says why.
    StoppedByReceiver,
    /// The connection is gone.
    Lost(PluginError),
}

/// Encoded sizes of the frames (type byte and body).
const LANE_BEGIN_BYTES: u64 = 41;
const SEGMENT_HEADER_BYTES: u64 = 25;
const LANE_END_BYTES: u64 = 17;

/// A staged buffer that fills up goes to quinn, and a new one of the right size takes its place.
struct Stager<'a> {
    shared: &'a Shared,
    buf: Vec<u8>,
    /// Bytes the lane puts on the stream (frames and payload), and bytes flushed so far.
    lane_total: u64,
    flushed: u64,
}

impl Stager<'_> {
    fn full(&self) -> bool {
        self.buf.len() >= StagingPool::fill_limit(&self.buf)
    }

    /// Hand the buffer to quinn and take one sized for what is left of the lane.
    async fn flush(&mut self, send: &mut quinn::SendStream) -> Option<WriteEnd> {
        self.flushed += self.buf.len() as u64;
        let left = self.lane_total.saturating_sub(self.flushed);
        let next = self.shared.staging.take(usize::try_from(left).unwrap_or(usize::MAX));
        let full = self.shared.staging.freeze(std::mem::replace(&mut self.buf, next));
        flush(send, full).await
    }
}

async fn write_lane(shared: &Shared, send: &mut quinn::SendStream, begin: &Frame, lane: &LanePlan) -> WriteEnd {
    // Each staged buffer goes to quinn as it is (no copy) and returns to the pool once quinn drops it.
    // Payload fills a buffer up to its fill limit, so a frame header appended to a buffer that is not
    // full never makes it grow. A lane smaller than a chunk takes a smaller buffer.
    let headers = LANE_BEGIN_BYTES + lane.segments.len() as u64 * SEGMENT_HEADER_BYTES + LANE_END_BYTES;
    let lane_total = lane.bytes.saturating_add(headers);
    let buf = shared.staging.take(usize::try_from(lane_total).unwrap_or(usize::MAX));
    let mut stager = Stager { shared, buf, lane_total, flushed: 0 };
    begin.encode(&mut stager.buf);
    for seg in &lane.segments {
        if stager.full() {
            if let Some(end) = stager.flush(send).await {
                return end;
            }
        }
        Frame::Segment { key: seg.remote_key, offset: seg.remote_offset, len: seg.len }.encode(&mut stager.buf);
        let mut done = 0u64;
        while done < seg.len {
            if stager.full() {
                if let Some(end) = stager.flush(send).await {
                    return end;
                }
            }
            let n = ((seg.len - done) as usize).min(StagingPool::fill_limit(&stager.buf) - stager.buf.len());
            if let Err(e) = shared.regions.copy_out(seg.local_key, seg.local_offset + done, n, &mut stager.buf) {
                return WriteEnd::Local(e);
            }
            done += n as u64;
        }
    }
    if stager.full() {
        if let Some(end) = stager.flush(send).await {
            return end;
        }
    }
    Frame::LaneEnd { segment_count: lane.segments.len() as u64, lane_bytes: lane.bytes }.encode(&mut stager.buf);
    if let Some(end) = flush(send, shared.staging.freeze(stager.buf)).await {
        return end;
    }
    WriteEnd::Written
}

async fn flush(send: &mut quinn::SendStream, chunk: bytes::Bytes) -> Option<WriteEnd> {
    match send.write_chunk(chunk).await {
        Ok(()) => None,
        Err(quinn::WriteError::Stopped(_)) => Some(WriteEnd::StoppedByReceiver),
        Err(quinn::WriteError::ConnectionLost(e)) => Some(WriteEnd::Lost(classify_connection_error(&e, true))),
        Err(other) => Some(WriteEnd::Lost(PluginError::new(ReasonCode::TRANSPORT_ERROR, format!("stream write failed: {other}")))),
    }
}

fn lost_reason(conn: &quinn::Connection, fallback: String) -> PluginError {
    match conn.close_reason() {
        Some(e) => classify_connection_error(&e, true),
        None => PluginError::new(ReasonCode::TRANSPORT_ERROR, fallback),
    }
}

/// One lane: open its stream, write it, then wait for the receiver's reply (never abandoned: after a
/// stop the reply is the proof that the receiver writes nothing more).
async fn run_lane(shared: Arc<Shared>, t: Arc<Transfer>, conn: quinn::Connection, begin: Frame, lane: LanePlan) {
    let mut stop = t.stop_signal();
    let opened = tokio::select! {
        r = conn.open_bi() => r,
        _ = stopped(&mut stop) => {
            // Nothing was sent on this lane: the receiver cannot write for it.
            t.lane_settled();
            return;
        }
    };
    let (mut send, recv) = match opened {
        Ok(pair) => pair,
        Err(e) => {
            let e = classify_connection_error(&e, true);
            t.fail(e.code, e.message.to_string());
            t.lane_settled();
            return;
        }
    };
    let end = tokio::select! {
        end = write_lane(&shared, &mut send, &begin, &lane) => end,
        _ = stopped(&mut stop) => WriteEnd::Stopped,
    };
    match end {
        WriteEnd::Written => {
            let _ = send.finish();
        }
        WriteEnd::Stopped => {
            let _ = send.reset(app_code(ReasonCode::CANCELLED));
        }
        WriteEnd::Local(e) => {
            t.fail(e.code, e.message.to_string());
            let _ = send.reset(app_code(ReasonCode::CANCELLED));
        }
        WriteEnd::StoppedByReceiver => {}
        WriteEnd::Lost(e) => {
            t.fail(e.code, e.message.to_string());
            t.lane_settled();
            return;
        }
    }
    let mut reader = FrameReader::new(recv);
    let reply = {
        let read = reader.read_frame();
        tokio::pin!(read);
        tokio::select! {
            r = &mut read => r,
            _ = stopped(&mut stop) => {
                // Stopped after the last byte was handed over: ask the receiver to drop what it has not
                // written yet, then wait for its word all the same.
                let _ = send.reset(app_code(ReasonCode::CANCELLED));
                read.await
            }
        }
    };
    // After a reply, wait for the receiver's end of the stream (it finishes right after replying)
    // rather than stop it: one STOP_SENDING frame per lane saved.
    let read_end = matches!(reply, Ok(Some(Frame::LaneDone { .. } | Frame::LaneRefused { .. } | Frame::CancelAck { .. })));
    match reply {
        Ok(Some(Frame::LaneDone { bytes })) if bytes == lane.bytes => t.lane_done(),
        Ok(Some(Frame::LaneDone { bytes })) => {
            t.fail(ReasonCode::PROTOCOL_VIOLATION, format!("the receiver confirmed {bytes} bytes of a {}-byte lane", lane.bytes));
            t.lane_settled();
        }
        Ok(Some(Frame::CancelAck { .. })) => {
            t.fail(ReasonCode::PROTOCOL_VIOLATION, "the receiver acknowledged a cancel that was never sent");
            t.lane_settled();
        }
        Ok(Some(Frame::LaneRefused { reason, message })) => {
            t.fail(ReasonCode(reason), format!("the receiver refused the transfer: {message}"));
            t.lane_settled();
        }
        Ok(other) => {
            let why = format!("expected a lane reply, got {other:?}");
            conn.close(app_code(ReasonCode::PROTOCOL_VIOLATION), why.as_bytes());
            t.fail(ReasonCode::PROTOCOL_VIOLATION, why);
            t.lane_settled();
        }
        Err(ReadFail::Source(source)) => {
            let e = lost_reason(&conn, format!("lane reply stream failed: {source:?}"));
            t.fail(e.code, e.message.to_string());
            t.lane_settled();
        }
        Err(bad) => {
            let why = format!("bad lane reply: {bad:?}");
            conn.close(app_code(ReasonCode::PROTOCOL_VIOLATION), why.as_bytes());
            t.fail(ReasonCode::PROTOCOL_VIOLATION, why);
            t.lane_settled();
        }
    }
    // The lane is settled: nothing below touches the transfer. A receiver that never ends its reply
    // stream holds only this task, until its connection goes.
    drop(t);
    if read_end {
        let _ = reader.expect_end().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_size_constants_match_the_encoding() {
        let encoded = |f: Frame| {
            let mut out = Vec::new();
            f.encode(&mut out);
            out.len() as u64
        };
        let begin = Frame::LaneBegin { xfer: 1, ticket: 2, lane_index: 0, lane_count: 1, segment_count: 1, lane_bytes: 3 };
        assert_eq!(encoded(begin), LANE_BEGIN_BYTES);
        assert_eq!(encoded(Frame::Segment { key: 1, offset: 2, len: 3 }), SEGMENT_HEADER_BYTES);
        assert_eq!(encoded(Frame::LaneEnd { segment_count: 1, lane_bytes: 3 }), LANE_END_BYTES);
        assert!(LANE_BEGIN_BYTES as usize <= crate::staging::MAX_FRAME_HEADER_BYTES);
        assert!((LANE_BEGIN_BYTES + SEGMENT_HEADER_BYTES + LANE_END_BYTES) as usize <= crate::staging::HEADER_ROOM_BYTES);
    }
}
