//! The framed peer-link transport: a TCP connection that starts with [`MAGIC`] each way, then carries
//! `PeerFrame`s as length-prefixed frames (u32 little-endian length, then the protobuf; the engine
//! fast lane's framing, `kvgate_client::lane_frame`). No HTTP/2: no HPACK, no flow-control frames, no
//! connection task between the socket and the link. The handshake reads the socket through
//! [`socket_inbound`]; the live link's reading is then handed to the driver's thread
//! ([`FramedInbound::detach`], `intake.rs`). Frames out are written by the link's writer
//! (`writer.rs`). Owns the bytes on the wire only: the handshake and
//! authentication above it are the same as on a gRPC link (`dial.rs`, `server.rs`).

use super::handshaken::{Inbound, InboundError};
use kvgate_client::lane_frame::FrameBuffer;
use kvgate_client::proto::PeerFrame;
use prost::Message;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt};

/// The first bytes of a framed link, sent by the dialler and echoed by the server before anything
/// else. An HTTP/2 connection starts with `PRI * HTTP/2.0`, a TLS one with a handshake record, so a
/// listener tells them apart from these.
pub const MAGIC: &[u8; 8] = b"KVGPEER1";

/// Reads the framed link's inbound frames from `io` (an in-memory pipe in tests: read wherever it is
/// polled): each at most `max_frame_bytes` (a length past it ends the link before its body is read),
/// each a `PeerFrame` that decodes.
pub fn inbound<R: AsyncRead + Unpin + Send + 'static>(io: R, max_frame_bytes: usize) -> Inbound {
    framed_inbound(io, None, max_frame_bytes)
}

/// [`inbound`] over a TCP connection, with a descriptor of its own for the socket (`socket`): read
/// through `io` during the handshake, then handed to the driver's thread ([`FramedInbound::detach`]),
/// which reads it on.
pub fn socket_inbound<R: AsyncRead + Unpin + Send + 'static>(
    io: R,
    socket: OwnedFd,
    max_frame_bytes: usize,
) -> Inbound {
    framed_inbound(io, Some(socket), max_frame_bytes)
}

fn framed_inbound<R: AsyncRead + Unpin + Send + 'static>(
    io: R,
    socket: Option<OwnedFd>,
    max_frame_bytes: usize,
) -> Inbound {
    let io: Box<dyn AsyncRead + Unpin + Send> = Box::new(io);
    Inbound::Framed(FramedInbound { reader: Reader::new(io, FrameBuffer::default(), max_frame_bytes), socket })
}

/// A framed link's inbound side while its handshake runs.
pub struct FramedInbound {
    reader: Reader<Box<dyn AsyncRead + Unpin + Send>>,
    /// A descriptor of its own for the socket (`None` over an in-memory pipe).
    socket: Option<OwnedFd>,
}

impl FramedInbound {
    /// The next frame; `None` at a clean end or after an error was returned. Cancel-safe.
    pub async fn next(&mut self) -> Option<Result<PeerFrame, InboundError>> {
        self.reader.next().await
    }

    /// The socket with the bytes already read past the last frame taken, to be read on by a
    /// runtime other than the one that read the handshake; `Err(self)` when there is no socket.
    pub fn detach(self) -> Result<DetachedReader, FramedInbound> {
        match self.socket {
            Some(socket) => Ok(DetachedReader { socket, reader: self.reader.with_io(()) }),
            None => Err(self),
        }
    }
}

/// A framed link's reading, between two runtimes: [`DetachedReader::attach`] on the runtime that
/// reads it on.
pub struct DetachedReader {
    socket: OwnedFd,
    /// The reader's state (buffered bytes, bound, whether it failed), without its I/O.
    reader: Reader<()>,
}

impl DetachedReader {
    /// The socket (for a check beside the reading, [`bytes_waiting`]).
    pub fn socket(&self) -> BorrowedFd<'_> {
        self.socket.as_fd()
    }

    /// Registers the socket with the calling runtime's reactor; frames already buffered come first.
    pub fn attach(self) -> std::io::Result<Reader<tokio::net::TcpStream>> {
        let socket = std::net::TcpStream::from(self.socket);
        socket.set_nonblocking(true)?;
        Ok(self.reader.with_io(tokio::net::TcpStream::from_std(socket)?))
    }
}

/// Whether bytes wait unread in the socket `fd` (or its end has arrived): the peer has spoken, even
/// if its reader has not run since. A failed check says no.
pub fn bytes_waiting(fd: BorrowedFd<'_>) -> bool {
    use nix::sys::socket::{recv, MsgFlags};
    let mut byte = [0u8; 1];
    recv(fd.as_raw_fd(), &mut byte, MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT).is_ok()
}

/// Decodes one link's frames from its byte stream.
pub struct Reader<R> {
    io: R,
    buffer: FrameBuffer,
    max_frame_bytes: usize,
    failed: bool,
}

impl<R> Reader<R> {
    fn new(io: R, buffer: FrameBuffer, max_frame_bytes: usize) -> Reader<R> {
        Reader { io, buffer, max_frame_bytes, failed: false }
    }

    /// The same reader (what it buffered, its bound, whether it failed) over `io`.
    fn with_io<T>(self, io: T) -> Reader<T> {
        Reader { io, buffer: self.buffer, max_frame_bytes: self.max_frame_bytes, failed: self.failed }
    }
}

impl<R: AsyncRead + Unpin> Reader<R> {
    /// The next frame; `None` at a clean end of the connection or after an error was returned.
    /// Cancel-safe: bytes read are kept in the buffer.
    pub async fn next(&mut self) -> Option<Result<PeerFrame, InboundError>> {
        if self.failed {
            return None;
        }
        loop {
            match self.buffer.take(self.max_frame_bytes) {
                Ok(Some(body)) => {
                    let frame = PeerFrame::decode(body)
                        .map_err(|e| InboundError::ProtocolViolation(format!("a frame does not decode: {e}")));
                    self.failed = frame.is_err();
                    return Some(frame);
                }
                Ok(None) => {}
                Err(too_large) => {
                    self.failed = true;
                    return Some(Err(InboundError::ProtocolViolation(format!(
                        "a frame of {} bytes, past peer_link.max_frame_bytes = {} (plus its envelope)",
                        too_large.len, too_large.max
                    ))));
                }
            }
            match self.io.read_buf(self.buffer.spare()).await {
                Ok(0) => return None,
                Ok(_) => {}
                Err(e) => {
                    self.failed = true;
                    return Some(Err(InboundError::Broken(format!("read: {e}"))));
                }
            }
        }
    }
}

/// What a connection to the peer-link listener speaks, from its first bytes.
#[derive(Debug, PartialEq, Eq)]
pub enum Speaks {
    /// A framed link: its [`MAGIC`] is still unread.
    Framed,
    /// Anything else (HTTP/2, TLS): for the gRPC server.
    Other,
}

/// Tells a framed link from anything else by peeking at most `MAGIC.len()` bytes, waiting for them
/// at most `wait`. `peek` returns what the bytes read so far were, to be retried while they are a
/// strict prefix of the magic.
pub async fn sniff<F, Fut>(mut peek: F, wait: Duration) -> std::io::Result<Speaks>
where
    F: FnMut(Vec<u8>) -> Fut,
    Fut: std::future::Future<Output = std::io::Result<(usize, Vec<u8>)>>,
{
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let (n, seen) = tokio::time::timeout_at(deadline, peek(vec![0u8; MAGIC.len()])).await.map_err(|_| {
            std::io::Error::new(std::io::ErrorKind::TimedOut, "no first bytes within connect_timeout_ms")
        })??;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        if seen[..n] != MAGIC[..n] {
            return Ok(Speaks::Other);
        }
        if n == MAGIC.len() {
            return Ok(Speaks::Framed);
        }
        // A strict prefix so far: `peek` returns at once while bytes wait, so pause before the next
        // (and give up at the deadline: a ready peek beats `timeout_at`).
        if tokio::time::Instant::now() >= deadline {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "only part of a framed link's magic within connect_timeout_ms",
            ));
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Reads the peer's [`MAGIC`] (the server's echo, or the dialler's opening). `Ok(false)`: the peer
/// sent something else, or closed, so it does not take framed links.
pub async fn read_magic<R: AsyncRead + Unpin>(io: &mut R) -> std::io::Result<bool> {
    let mut seen = [0u8; MAGIC.len()];
    match io.read_exact(&mut seen).await {
        Ok(_) => Ok(&seen == MAGIC),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(false),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_client::lane_frame::encode_frame;
    use kvgate_client::proto::{self, peer_frame::Frame};
    use tokio::io::AsyncWriteExt;

    /// Every item `inbound` yields, to its end.
    async fn all_frames(mut inbound: Inbound) -> Vec<Result<PeerFrame, InboundError>> {
        let mut items = Vec::new();
        while let Some(item) = inbound.next().await {
            items.push(item);
        }
        items
    }

    /// One frame of exactly `len` encoded bytes, then what the reader makes of it under `max`.
    async fn read_one(len: usize, max: usize) -> Vec<Result<PeerFrame, InboundError>> {
        let frame = PeerFrame { frame: Some(Frame::Heartbeat(proto::Heartbeat { seq: 1 })), mac: Vec::new() };
        let pad = len - frame.encoded_len() - 3; // `mac` field: one tag byte, two length bytes (len >= 131)
        let frame = PeerFrame { mac: vec![7; pad], ..frame };
        assert_eq!(frame.encoded_len(), len);
        let mut bytes = Vec::new();
        encode_frame(&frame, &mut bytes);
        let (mut a, b) = tokio::io::duplex(1 << 20);
        a.write_all(&bytes).await.unwrap();
        drop(a);
        all_frames(inbound(b, max)).await
    }

    #[tokio::test]
    async fn a_frame_at_the_bound_is_read_and_one_byte_more_ends_the_link() {
        let at = read_one(4000, 4000).await;
        assert!(at.len() == 1 && at[0].is_ok(), "{at:?}");
        let past = read_one(4001, 4000).await;
        assert_eq!(past.len(), 1, "the error, then nothing: {past:?}");
        let e = past[0].as_ref().unwrap_err();
        assert!(matches!(e, InboundError::ProtocolViolation(why) if why.contains("max_frame_bytes")), "{e}");
    }

    #[tokio::test]
    async fn garbage_ends_the_link_with_a_protocol_violation() {
        let (mut a, b) = tokio::io::duplex(1024);
        a.write_all(&[3, 0, 0, 0, 0xff, 0xff, 0xff]).await.unwrap();
        drop(a);
        let read: Vec<_> = all_frames(inbound(b, 1024)).await;
        assert_eq!(read.len(), 1);
        let e = read[0].as_ref().unwrap_err();
        assert!(matches!(e, InboundError::ProtocolViolation(why) if why.contains("does not decode")), "{read:?}");
    }

    /// What `sniff` says of a connection whose first bytes are `bytes` (and no more ever arrive):
    /// each peek returns them, as a socket's peek returns what waits unread.
    async fn sniffed(bytes: &'static [u8]) -> std::io::Result<Speaks> {
        let peek = move |mut buf: Vec<u8>| async move {
            let n = bytes.len().min(buf.len());
            buf[..n].copy_from_slice(&bytes[..n]);
            Ok((n, buf))
        };
        sniff(peek, Duration::from_millis(50)).await
    }

    #[tokio::test]
    async fn the_listener_tells_a_framed_link_from_http2_and_tls_and_waits_only_so_long() {
        assert_eq!(sniffed(b"KVGPEER1\x05\x00").await.unwrap(), Speaks::Framed);
        assert_eq!(sniffed(b"PRI * HTTP/2.0\r\n").await.unwrap(), Speaks::Other);
        assert_eq!(sniffed(b"\x16\x03\x01\x02\x00").await.unwrap(), Speaks::Other);
        // A strict prefix that never completes: waited for, then refused at the bound.
        let e = sniffed(b"KVG").await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
        assert_eq!(sniffed(b"").await.unwrap_err().kind(), std::io::ErrorKind::UnexpectedEof);
    }

    #[tokio::test]
    async fn read_magic_tells_a_framed_server_from_an_http2_one() {
        let (mut a, mut b) = tokio::io::duplex(1024);
        a.write_all(MAGIC).await.unwrap();
        assert!(read_magic(&mut b).await.unwrap());
        // An HTTP/2 server's first bytes are its SETTINGS frame; a refusing one may just close.
        let (mut a, mut b) = tokio::io::duplex(1024);
        a.write_all(&[0, 0, 18, 4, 0, 0, 0, 0, 0]).await.unwrap();
        assert!(!read_magic(&mut b).await.unwrap());
        let (a, mut b) = tokio::io::duplex(1024);
        drop(a);
        assert!(!read_magic(&mut b).await.unwrap());
    }
}
