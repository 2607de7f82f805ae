//! The receiver's side of one lane: decode the parts that follow each other on the stream, check every
//! segment against the region and the part's ticket before writing a byte, and answer each part exactly
//! once. Never trusts a length or key from the wire; a malformed or hostile stream ends as `Violation`.

use crate::reader::{FrameReader, LaneIo, ReadFail, SourceError, MAX_READ_CHUNK_BYTES};
use crate::regions::Regions;
use crate::tickets::{authorise_segment, write_under, Refusal, SharedGrant, Tickets};
use crate::wire::Frame;
use kvgate_abi::{PeerId, ReasonCode, Ticket};

/// What a receiving lane needs.
pub struct LaneContext<'a> {
    pub peer: PeerId,
    pub tickets: &'a Tickets,
    pub regions: &'a Regions,
}

/// How a receiving lane ended. Every part that began before the end was answered, except the part in
/// progress at a `Violation` or `Lost` end (the connection is gone or closed by the caller then).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LaneEnd {
    /// The sender ended the stream cleanly between two parts.
    Closed,
    /// The sender reset the stream (this application code); a part in progress was answered
    /// `CANCEL_ACK` (or had been refused already).
    Reset(u64),
    /// The stream broke the protocol; the connection must end with this reason.
    Violation(String),
    /// The connection (or the way back for replies) went away.
    Lost(String),
}

/// The part a lane was in when it ended, or a part that was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartId {
    pub xfer: u64,
    pub ticket: Ticket,
}

fn end_of(fail: ReadFail) -> LaneEnd {
    match fail {
        ReadFail::Truncated(why) => LaneEnd::Violation(why),
        ReadFail::Malformed(e) => LaneEnd::Violation(e.0),
        ReadFail::Source(SourceError::Reset(code)) => LaneEnd::Reset(code),
        ReadFail::Source(SourceError::ConnectionLost(why)) => LaneEnd::Lost(why),
        ReadFail::Source(SourceError::Other(why)) => LaneEnd::Lost(why),
    }
}

/// Serve one lane until it ends: parts back to back, each answered `DONE`, `REFUSED` or `CANCEL_ACK`
/// through the lane's replies. `on_refused` hears of every refused part (the host may be told).
/// Returns how the lane ended and the part in progress then, if any.
pub async fn serve_lane<S: LaneIo>(
    reader: &mut FrameReader<S>,
    ctx: &LaneContext<'_>,
    on_refused: &mut (dyn FnMut(PartId, &Refusal) + Send),
) -> (LaneEnd, Option<PartId>) {
    loop {
        let frame = match reader.read_frame().await {
            Ok(Some(f)) => f,
            Ok(None) => return (LaneEnd::Closed, None),
            Err(fail) => return (end_of(fail), None),
        };
        let Frame::PartBegin { xfer, ticket, part_index, part_count, bytes } = frame else {
            return (LaneEnd::Violation(format!("expected PART_BEGIN between parts, got {frame:?}")), None);
        };
        let id = PartId { xfer, ticket: Ticket(ticket) };
        if part_count == 0 || part_index >= part_count {
            return (
                LaneEnd::Violation(format!("part {part_index} of {part_count} of transfer {xfer} is not a part")),
                Some(id),
            );
        }
        if let Err(end) = receive_part(reader, ctx, id, bytes, on_refused).await {
            return (end, Some(id));
        }
        // Parts may arrive faster than they are served: yield to other tasks once the budget is spent.
        tokio::task::coop::consume_budget().await;
    }
}

/// Where a part's bytes go: into memory under its ticket, or nowhere once it was refused.
enum Destination {
    Write(SharedGrant),
    /// Refused (and answered): its remaining bytes are read and dropped, never written.
    Discard,
}

async fn reply<S: LaneIo>(reader: &mut FrameReader<S>, frame: Frame) -> Result<(), LaneEnd> {
    reader
        .source_mut()
        .queue_reply(&frame)
        .await
        .map_err(|e| LaneEnd::Lost(format!("the way back for replies broke: {e:?}")))
}

async fn refuse<S: LaneIo>(
    reader: &mut FrameReader<S>,
    id: PartId,
    refusal: Refusal,
    on_refused: &mut (dyn FnMut(PartId, &Refusal) + Send),
) -> Result<Destination, LaneEnd> {
    on_refused(id, &refusal);
    reply(reader, Frame::Refused { xfer: id.xfer, reason: refusal.reason.0, message: refusal.message }).await?;
    Ok(Destination::Discard)
}

/// One part, from after its PART_BEGIN to its PART_END or PART_ABORT. `Err` ends the lane.
async fn receive_part<S: LaneIo>(
    reader: &mut FrameReader<S>,
    ctx: &LaneContext<'_>,
    id: PartId,
    bytes: u64,
    on_refused: &mut (dyn FnMut(PartId, &Refusal) + Send),
) -> Result<(), LaneEnd> {
    let mut dest = match ctx.tickets.lookup(ctx.peer, id.ticket) {
        Some(grant) => Destination::Write(grant),
        None => {
            let refusal = Refusal {
                reason: ReasonCode::NOT_EXPECTED,
                message: format!("no ticket {} is expected from peer {}", id.ticket.0, ctx.peer.0),
            };
            refuse(reader, id, refusal, on_refused).await?
        }
    };
    // Bytes received for the part (written or discarded), bytes written, SEGMENT frames seen.
    let (mut received, mut written, mut segments) = (0u64, 0u64, 0u64);
    // A reset inside a part: the sender gave up; answer the part unless it was refused already.
    let cancelled = |dest: &Destination, written: u64| match dest {
        Destination::Write(_) => Some(Frame::CancelAck { xfer: id.xfer, bytes: written }),
        Destination::Discard => None,
    };
    loop {
        let frame = match reader.read_frame().await {
            Ok(Some(f)) => f,
            Ok(None) => return Err(LaneEnd::Violation(format!("the lane ended inside part of transfer {}", id.xfer))),
            Err(ReadFail::Source(SourceError::Reset(code))) => {
                if let Some(ack) = cancelled(&dest, written) {
                    reply(reader, ack).await?;
                }
                return Err(LaneEnd::Reset(code));
            }
            Err(fail) => return Err(end_of(fail)),
        };
        match frame {
            Frame::Segment { key, offset, len } => {
                if len == 0 {
                    return Err(LaneEnd::Violation(format!("empty SEGMENT in transfer {}", id.xfer)));
                }
                if received.checked_add(len).is_none_or(|total| total > bytes) {
                    return Err(LaneEnd::Violation(format!(
                        "segment of {len} bytes after {received} overruns the part's {bytes} bytes (transfer {})",
                        id.xfer
                    )));
                }
                segments += 1;
                if let Destination::Write(grant) = &dest {
                    if let Err(refusal) = authorise_segment(grant, ctx.regions, key, offset, len) {
                        dest = refuse(reader, id, refusal, on_refused).await?;
                    }
                }
                let mut done: u64 = 0;
                while done < len {
                    let want = (len - done).min(MAX_READ_CHUNK_BYTES as u64) as usize;
                    let data = match reader.read_payload(want).await {
                        Ok(d) => d,
                        Err(ReadFail::Source(SourceError::Reset(code))) => {
                            if let Some(ack) = cancelled(&dest, written) {
                                reply(reader, ack).await?;
                            }
                            return Err(LaneEnd::Reset(code));
                        }
                        Err(fail) => return Err(end_of(fail)),
                    };
                    if let Destination::Write(grant) = &dest {
                        match write_under(grant, ctx.regions, key, offset + done, &data) {
                            Ok(()) => written += data.len() as u64,
                            Err(refusal) => dest = refuse(reader, id, refusal, on_refused).await?,
                        }
                    }
                    done += data.len() as u64;
                    received += data.len() as u64;
                }
            }
            Frame::PartEnd { segments: end_segments, bytes: end_bytes } => {
                if end_segments != segments || end_bytes != bytes || received != bytes {
                    return Err(LaneEnd::Violation(format!(
                        "PART_END says {end_segments} segments / {end_bytes} bytes, the part announced {bytes} bytes and carried {segments} / {received} (transfer {})",
                        id.xfer
                    )));
                }
                if let Destination::Write(_) = dest {
                    reply(reader, Frame::Done { xfer: id.xfer, bytes: written }).await?;
                }
                return Ok(());
            }
            Frame::PartAbort { xfer } => {
                if xfer != id.xfer {
                    return Err(LaneEnd::Violation(format!(
                        "PART_ABORT for transfer {xfer} inside a part of transfer {}",
                        id.xfer
                    )));
                }
                if let Some(ack) = cancelled(&dest, written) {
                    reply(reader, ack).await?;
                }
                return Ok(());
            }
            other => {
                return Err(LaneEnd::Violation(format!(
                    "expected SEGMENT, PART_END or PART_ABORT inside a part of transfer {}, got {other:?}",
                    id.xfer
                )))
            }
        }
    }
}
