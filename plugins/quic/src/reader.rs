//! Reads frames and payload bytes from a stream of chunks (a quinn `RecvStream`, or bytes a test
//! hands in). Owns buffering across chunk boundaries; never allocates by a length the peer chose.

use crate::wire::{fixed_body_len, frame_type, DecodeError, Frame, MAX_REFUSAL_MESSAGE_BYTES, REFUSED_HEADER_BYTES};
use bytes::Bytes;
use std::future::Future;

/// Why a source stopped giving bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceError {
    /// The sender reset the stream with this application code (it cancelled).
    Reset(u64),
    /// The connection is gone (closed, timed out, reset).
    ConnectionLost(String),
    /// Anything else the stream reported.
    Other(String),
}

/// Where chunks come from.
pub trait ByteSource: Send {
    /// The next chunk of at most `max` bytes; `None` at a clean end of stream.
    fn next_chunk(&mut self, max: usize) -> impl Future<Output = Result<Option<Bytes>, SourceError>> + Send;
}

impl ByteSource for quinn::RecvStream {
    async fn next_chunk(&mut self, max: usize) -> Result<Option<Bytes>, SourceError> {
        match self.read_chunk(max, true).await {
            Ok(chunk) => Ok(chunk.map(|c| c.bytes)),
            Err(quinn::ReadError::Reset(code)) => Err(SourceError::Reset(code.into_inner())),
            Err(quinn::ReadError::ConnectionLost(e)) => Err(SourceError::ConnectionLost(e.to_string())),
            Err(other) => Err(SourceError::Other(other.to_string())),
        }
    }
}

/// A source over chunks held in memory (tests, fuzzing).
pub struct MemorySource {
    chunks: std::collections::VecDeque<Bytes>,
    /// What to report once the chunks run out: `None` is a clean end.
    pub end: Option<SourceError>,
    /// Replies queued through [`LaneIo`], in order.
    pub replies: Vec<Frame>,
}

impl MemorySource {
    pub fn new(chunks: impl IntoIterator<Item = Bytes>, end: Option<SourceError>) -> MemorySource {
        MemorySource { chunks: chunks.into_iter().collect(), end, replies: Vec::new() }
    }
}

impl ByteSource for MemorySource {
    async fn next_chunk(&mut self, max: usize) -> Result<Option<Bytes>, SourceError> {
        while let Some(mut chunk) = self.chunks.pop_front() {
            if chunk.is_empty() {
                continue;
            }
            if chunk.len() > max {
                let rest = chunk.split_off(max);
                self.chunks.push_front(rest);
            }
            return Ok(Some(chunk));
        }
        match self.end.clone() {
            None => Ok(None),
            Some(e) => Err(e),
        }
    }
}

/// A receiving lane: its bytes, and the way back for the receiver's replies.
pub trait LaneIo: ByteSource {
    /// Queue one reply. It is sent at the latest before the next read that would wait for the peer
    /// (replies of several parts then share one write); an error means the way back is gone.
    fn queue_reply(&mut self, frame: &Frame) -> impl Future<Output = Result<(), SourceError>> + Send;
}

impl LaneIo for MemorySource {
    async fn queue_reply(&mut self, frame: &Frame) -> Result<(), SourceError> {
        self.replies.push(frame.clone());
        Ok(())
    }
}

/// Why a frame could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadFail {
    /// The stream ended inside a frame or before expected bytes.
    Truncated(String),
    /// The bytes are not a valid frame.
    Malformed(DecodeError),
    /// The source failed.
    Source(SourceError),
}

/// Most bytes asked of the source at once.
pub const MAX_READ_CHUNK_BYTES: usize = 1 << 20;

pub struct FrameReader<S> {
    source: S,
    pending: Bytes,
}

impl<S: ByteSource> FrameReader<S> {
    pub fn new(source: S) -> Self {
        FrameReader { source, pending: Bytes::new() }
    }

    pub fn into_source(self) -> S {
        self.source
    }

    pub fn source(&self) -> &S {
        &self.source
    }

    pub fn source_mut(&mut self) -> &mut S {
        &mut self.source
    }

    /// Make sure `pending` is non-empty; `Ok(false)` at a clean end of stream.
    async fn fill(&mut self, max: usize) -> Result<bool, ReadFail> {
        while self.pending.is_empty() {
            match self.source.next_chunk(max.max(1)).await.map_err(ReadFail::Source)? {
                Some(chunk) => self.pending = chunk,
                None => return Ok(false),
            }
        }
        Ok(true)
    }

    async fn read_exact(&mut self, out: &mut [u8], what: &str) -> Result<(), ReadFail> {
        let mut filled = 0;
        while filled < out.len() {
            if !self.fill(MAX_READ_CHUNK_BYTES).await? {
                return Err(ReadFail::Truncated(format!("stream ended inside {what}")));
            }
            let n = (out.len() - filled).min(self.pending.len());
            out[filled..filled + n].copy_from_slice(&self.pending[..n]);
            self.pending = self.pending.slice(n..);
            filled += n;
        }
        Ok(())
    }

    /// The next frame, or `None` at a clean end of stream between frames.
    pub async fn read_frame(&mut self) -> Result<Option<Frame>, ReadFail> {
        if !self.fill(MAX_READ_CHUNK_BYTES).await? {
            return Ok(None);
        }
        let ty = self.pending[0];
        self.pending = self.pending.slice(1..);
        if ty == frame_type::REFUSED {
            let mut head = [0u8; REFUSED_HEADER_BYTES - 1];
            self.read_exact(&mut head, "a REFUSED header").await?;
            let xfer = u64::from_le_bytes(head[..8].try_into().expect("8 bytes"));
            let reason = u32::from_le_bytes(head[8..12].try_into().expect("4 bytes"));
            let len = u16::from_le_bytes(head[12..].try_into().expect("2 bytes")) as usize;
            if len > MAX_REFUSAL_MESSAGE_BYTES {
                return Err(ReadFail::Malformed(DecodeError(format!(
                    "REFUSED message of {len} bytes exceeds {MAX_REFUSAL_MESSAGE_BYTES}"
                ))));
            }
            let mut text = vec![0u8; len];
            self.read_exact(&mut text, "a REFUSED message").await?;
            return Ok(Some(Frame::decode_refused(xfer, reason, &text)));
        }
        let len = fixed_body_len(ty)
            .ok_or_else(|| ReadFail::Malformed(DecodeError(format!("unknown frame type 0x{ty:02x}"))))?;
        let mut body = [0u8; 64];
        self.read_exact(&mut body[..len], "a frame body").await?;
        Frame::decode_fixed(ty, &body[..len]).map(Some).map_err(ReadFail::Malformed)
    }

    /// Wait for the end of the stream after its last frame: `Ok(true)` at a clean end, `Ok(false)` when
    /// more bytes follow. Reading the end before dropping a quinn stream spares a STOP_SENDING frame.
    pub async fn expect_end(&mut self) -> Result<bool, ReadFail> {
        Ok(!self.fill(1).await?)
    }

    /// Up to `max` payload bytes (at least one); the end of stream here is a truncation.
    pub async fn read_payload(&mut self, max: usize) -> Result<Bytes, ReadFail> {
        if !self.fill(max.min(MAX_READ_CHUNK_BYTES)).await? {
            return Err(ReadFail::Truncated("stream ended inside segment data".into()));
        }
        let n = max.min(self.pending.len());
        let out = self.pending.slice(..n);
        self.pending = self.pending.slice(n..);
        Ok(out)
    }
}
