//! The receiver's side of one lane stream: decode frames, check every segment against the region and
//! the expected ticket before writing a byte, and say how the lane ended. Never trusts a length or key
//! from the wire; a malformed or hostile stream ends as `Violation` (the caller closes the connection).

use crate::reader::{ByteSource, FrameReader, ReadFail, SourceError, MAX_READ_CHUNK_BYTES};
use crate::regions::Regions;
use crate::tickets::{authorise_segment, write_under, Refusal, Tickets};
use crate::wire::Frame;
use kvgate_abi::{PeerId, ReasonCode, Ticket};

/// What a receiving lane needs.
pub struct LaneContext<'a> {
    pub peer: PeerId,
    pub tickets: &'a Tickets,
    pub regions: &'a Regions,
    /// Most segments one lane may announce (`max_segments_per_submit`).
    pub max_segments: u64,
}

/// How a receiving lane ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LaneOutcome {
    /// Every byte of the lane is in place.
    Done { bytes: u64 },
    /// A segment was refused before it was written (ticket or bounds); nothing more is written.
    Refused(Refusal),
    /// The sender reset the stream (cancel); `bytes` were written before.
    Cancelled { bytes: u64 },
    /// The stream broke the protocol; the connection must end with this reason.
    Violation(String),
    /// The connection went away mid-lane.
    Lost(String),
}

/// The lane's identity once its LANE_BEGIN was read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaneId {
    pub xfer: u64,
    pub ticket: Ticket,
}

fn from_read_fail(fail: ReadFail, written: u64) -> LaneOutcome {
    match fail {
        ReadFail::Truncated(why) => LaneOutcome::Violation(why),
        ReadFail::Malformed(e) => LaneOutcome::Violation(e.0),
        ReadFail::Source(SourceError::Reset(_)) => LaneOutcome::Cancelled { bytes: written },
        ReadFail::Source(SourceError::ConnectionLost(why)) => LaneOutcome::Lost(why),
        ReadFail::Source(SourceError::Other(why)) => LaneOutcome::Lost(why),
    }
}

/// Receive one lane. Returns the lane identity (once known) and how it ended.
pub async fn receive_lane<S: ByteSource>(reader: &mut FrameReader<S>, ctx: &LaneContext<'_>) -> (Option<LaneId>, LaneOutcome) {
    let begin = match reader.read_frame().await {
        Ok(Some(f)) => f,
        Ok(None) => return (None, LaneOutcome::Violation("lane stream ended before LANE_BEGIN".into())),
        Err(fail) => return (None, from_read_fail(fail, 0)),
    };
    let Frame::LaneBegin { xfer, ticket, lane_index, lane_count, segment_count, lane_bytes } = begin else {
        return (None, LaneOutcome::Violation(format!("lane stream opened with {begin:?} instead of LANE_BEGIN")));
    };
    let id = LaneId { xfer, ticket: Ticket(ticket) };
    if lane_count == 0 || lane_index >= lane_count {
        return (Some(id), LaneOutcome::Violation(format!("lane {lane_index} of {lane_count} is not a lane")));
    }
    if segment_count > ctx.max_segments {
        return (Some(id), LaneOutcome::Violation(format!("lane announces {segment_count} segments, limit {}", ctx.max_segments)));
    }
    let Some(grant) = ctx.tickets.lookup(ctx.peer, Ticket(ticket)) else {
        return (
            Some(id),
            LaneOutcome::Refused(Refusal {
                reason: ReasonCode::NOT_EXPECTED,
                message: format!("no ticket {ticket} is expected from peer {}", ctx.peer.0),
            }),
        );
    };
    let mut written: u64 = 0;
    for index in 0..segment_count {
        let frame = match reader.read_frame().await {
            Ok(Some(f)) => f,
            Ok(None) => return (Some(id), LaneOutcome::Violation(format!("lane ended after {index} of {segment_count} segments"))),
            Err(fail) => return (Some(id), from_read_fail(fail, written)),
        };
        let Frame::Segment { key, offset, len } = frame else {
            return (Some(id), LaneOutcome::Violation(format!("expected SEGMENT {index}, got {frame:?}")));
        };
        if written.checked_add(len).is_none_or(|total| total > lane_bytes) {
            return (Some(id), LaneOutcome::Violation(format!("segment {index} of {len} bytes overruns the lane's {lane_bytes} bytes")));
        }
        if let Err(refusal) = authorise_segment(&grant, ctx.regions, key, offset, len) {
            return (Some(id), LaneOutcome::Refused(refusal));
        }
        let mut done: u64 = 0;
        while done < len {
            let want = (len - done).min(MAX_READ_CHUNK_BYTES as u64) as usize;
            let data = match reader.read_payload(want).await {
                Ok(d) => d,
                Err(fail) => return (Some(id), from_read_fail(fail, written)),
            };
            if let Err(refusal) = write_under(&grant, ctx.regions, key, offset + done, &data) {
                return (Some(id), LaneOutcome::Refused(refusal));
            }
            done += data.len() as u64;
            written += data.len() as u64;
        }
    }
    match reader.read_frame().await {
        Ok(Some(Frame::LaneEnd { segment_count: end_count, lane_bytes: end_bytes })) => {
            if end_count != segment_count || end_bytes != lane_bytes || written != lane_bytes {
                return (
                    Some(id),
                    LaneOutcome::Violation(format!(
                        "LANE_END says {end_count} segments / {end_bytes} bytes, lane announced {segment_count} / {lane_bytes}, received {written}"
                    )),
                );
            }
            (Some(id), LaneOutcome::Done { bytes: written })
        }
        Ok(Some(other)) => (Some(id), LaneOutcome::Violation(format!("expected LANE_END, got {other:?}"))),
        Ok(None) => (Some(id), LaneOutcome::Violation("lane ended without LANE_END".into())),
        Err(fail) => (Some(id), from_read_fail(fail, written)),
    }
}
