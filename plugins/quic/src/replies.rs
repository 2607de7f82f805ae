//! The receiver's way back on a lane: replies (`DONE`, `REFUSED`, `CANCEL_ACK`) are queued and written
//! together, at the latest before the lane's reader would wait for the sender, or once a batch is full.
//! Owns the batching policy only; never decides what a reply says.

use crate::reader::{ByteSource, LaneIo, SourceError};
use crate::wire::Frame;
use bytes::Bytes;
use std::future::Future;
use std::task::Poll;

/// Most replies held back for one write: a batch this full is written at once, so a receiver that
/// never runs out of input still confirms steadily.
pub const REPLY_BATCH_MAX_FRAMES: usize = 16;

/// Most payload bytes the held-back `DONE` replies may confirm before they are written at once
/// (1 MiB): a part this large is confirmed without waiting for other parts.
pub const REPLY_BATCH_MAX_CONFIRMED_BYTES: u64 = 1 << 20;

/// Replies not yet written.
#[derive(Default)]
pub struct ReplyBatch {
    encoded: Vec<u8>,
    frames: usize,
    confirmed_bytes: u64,
}

impl ReplyBatch {
    /// Add a reply; `true` when the batch is full and must be written now.
    pub fn push(&mut self, frame: &Frame) -> bool {
        frame.encode(&mut self.encoded);
        self.frames += 1;
        if let Frame::Done { bytes, .. } = frame {
            self.confirmed_bytes = self.confirmed_bytes.saturating_add(*bytes);
        }
        self.frames >= REPLY_BATCH_MAX_FRAMES || self.confirmed_bytes >= REPLY_BATCH_MAX_CONFIRMED_BYTES
    }

    pub fn is_empty(&self) -> bool {
        self.frames == 0
    }

    /// The replies' bytes, leaving the batch empty.
    pub fn take(&mut self) -> Vec<u8> {
        self.frames = 0;
        self.confirmed_bytes = 0;
        std::mem::take(&mut self.encoded)
    }

    /// Replies held back right now.
    pub fn len(&self) -> usize {
        self.frames
    }
}

/// A lane as the receiver sees it: the sender's bytes in, replies out.
pub struct ReceivingLane {
    pub recv: quinn::RecvStream,
    pub send: quinn::SendStream,
    batch: ReplyBatch,
}

fn from_read(r: Result<Option<quinn::Chunk>, quinn::ReadError>) -> Result<Option<Bytes>, SourceError> {
    match r {
        Ok(chunk) => Ok(chunk.map(|c| c.bytes)),
        Err(quinn::ReadError::Reset(code)) => Err(SourceError::Reset(code.into_inner())),
        Err(quinn::ReadError::ConnectionLost(e)) => Err(SourceError::ConnectionLost(e.to_string())),
        Err(other) => Err(SourceError::Other(other.to_string())),
    }
}

async fn write_batch(send: &mut quinn::SendStream, batch: &mut ReplyBatch) -> Result<(), SourceError> {
    if batch.is_empty() {
        return Ok(());
    }
    let bytes = batch.take();
    send.write_all(&bytes).await.map_err(|e| SourceError::ConnectionLost(format!("writing replies: {e}")))
}

impl ReceivingLane {
    pub fn new(send: quinn::SendStream, recv: quinn::RecvStream) -> ReceivingLane {
        ReceivingLane { recv, send, batch: ReplyBatch::default() }
    }

    /// Write the replies held back, then end the way back (the lane is over).
    pub async fn finish(&mut self) {
        let _ = write_batch(&mut self.send, &mut self.batch).await;
        let _ = self.send.finish();
    }
}

impl ByteSource for ReceivingLane {
    fn next_chunk(&mut self, max: usize) -> impl Future<Output = Result<Option<Bytes>, SourceError>> + Send {
        let ReceivingLane { recv, send, batch } = self;
        async move {
            let read = recv.read_chunk(max, true);
            tokio::pin!(read);
            if batch.is_empty() {
                return from_read(read.await);
            }
            // Bytes already here come first; before waiting for more, the replies go out.
            if let Poll::Ready(r) = std::future::poll_fn(|cx| Poll::Ready(read.as_mut().poll(cx))).await {
                return from_read(r);
            }
            write_batch(send, batch).await?;
            from_read(read.await)
        }
    }
}

impl LaneIo for ReceivingLane {
    async fn queue_reply(&mut self, frame: &Frame) -> Result<(), SourceError> {
        if self.batch.push(frame) {
            write_batch(&mut self.send, &mut self.batch).await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_is_full_at_its_frame_limit_not_before() {
        let mut batch = ReplyBatch::default();
        for i in 0..REPLY_BATCH_MAX_FRAMES - 1 {
            assert!(!batch.push(&Frame::Done { xfer: i as u64, bytes: 1 }), "full after {} frames", i + 1);
        }
        assert!(batch.push(&Frame::CancelAck { xfer: 99, bytes: 0 }));
        assert_eq!(batch.len(), REPLY_BATCH_MAX_FRAMES);
        let bytes = batch.take();
        assert_eq!(bytes.len(), (REPLY_BATCH_MAX_FRAMES - 1) * 17 + 17);
        assert!(batch.is_empty());
    }

    #[test]
    fn a_batch_is_full_once_it_confirms_its_byte_limit_not_before() {
        let mut batch = ReplyBatch::default();
        assert!(!batch.push(&Frame::Done { xfer: 1, bytes: REPLY_BATCH_MAX_CONFIRMED_BYTES - 1 }));
        assert!(batch.push(&Frame::Done { xfer: 2, bytes: 1 }));
        batch.take();
        assert!(batch.push(&Frame::Done { xfer: 3, bytes: REPLY_BATCH_MAX_CONFIRMED_BYTES }));
        batch.take();
        // Refusals confirm no bytes.
        assert!(!batch.push(&Frame::Refused { xfer: 4, reason: 1, message: "x".into() }));
    }
}
