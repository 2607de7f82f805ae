//! Every listener of the gateway (engine API on its unix socket or TCP, peer link, admin) accepts
//! through here: a cap on the connections one listener holds open (past it a new connection is
//! closed at once), a deadline for a connection's first byte and a bound on its silence, TCP_NODELAY
//! on every TCP socket, and back-off with a rate-limited log line when accept itself fails (EMFILE,
//! ENFILE: out of descriptors). Every refusal and close is counted in
//! `kvgate_listener_refused_total{listener,reason}`; open connections in `kvgate_listener_connections`.
//! Owns no protocol: what runs over a connection is tonic's, axum's or a framed peer link's.
//!
//! tonic ignores `Server::tcp_nodelay` for `serve_with_incoming*`, so a bare listener stream would
//! leave Nagle on and hold small frames ~40 ms behind the delayed ACK: never hand one over.

use crate::config::ConnectionLimits;
use crate::metrics::GatewayMetrics;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};

/// At most one log line per listener and reason this often; the lines in between are counted and
/// the next line says how many.
pub const REFUSAL_LOG_INTERVAL_MS: u64 = 10_000;
/// First and longest wait after a failed accept (doubling in between, reset by a good accept).
pub const ACCEPT_BACKOFF_MIN_MS: u64 = 10;
pub const ACCEPT_BACKOFF_MAX_MS: u64 = 1_000;

/// Something that accepts connections: a TCP or a unix-socket listener.
pub trait Acceptor: Send + 'static {
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    type Addr: Send + 'static;
    fn accept_one(&mut self) -> impl Future<Output = io::Result<(Self::Io, Self::Addr)>> + Send;
}

impl Acceptor for tokio::net::TcpListener {
    type Io = tokio::net::TcpStream;
    type Addr = std::net::SocketAddr;
    async fn accept_one(&mut self) -> io::Result<(Self::Io, Self::Addr)> {
        let (stream, addr) = self.accept().await?;
        // A socket that cannot take the option still works, only with Nagle on: keep it.
        let _ = stream.set_nodelay(true);
        Ok((stream, addr))
    }
}

impl Acceptor for tokio::net::UnixListener {
    type Io = tokio::net::UnixStream;
    type Addr = tokio::net::unix::SocketAddr;
    async fn accept_one(&mut self) -> io::Result<(Self::Io, Self::Addr)> {
        self.accept().await
    }
}

/// Shared by a listener and the connections it accepted: limits, counts, log pacing.
struct Shared {
    name: &'static str,
    limits: ConnectionLimits,
    metrics: Arc<GatewayMetrics>,
    /// Per reason: when the last line was written, and how many refusals since.
    log: Mutex<Vec<(&'static str, Option<std::time::Instant>, u64)>>,
}

impl Shared {
    fn refused(&self, reason: &'static str, detail: &dyn std::fmt::Display) {
        self.metrics.count_listener_refusal(self.name, reason);
        let mut log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        let index = match log.iter().position(|(r, _, _)| *r == reason) {
            Some(i) => i,
            None => {
                log.push((reason, None, 0));
                log.len() - 1
            }
        };
        let (_, last, since) = &mut log[index];
        *since += 1;
        let now = std::time::Instant::now();
        if last.is_none_or(|at| now.duration_since(at) >= Duration::from_millis(REFUSAL_LOG_INTERVAL_MS)) {
            tracing::warn!(
                listener = self.name,
                reason,
                refused_since_last_line = *since,
                "connection refused or closed: {detail}"
            );
            *last = Some(now);
            *since = 0;
        }
    }
}

/// A listener with its connection cap, timeouts and accept back-off.
pub struct GuardedListener<L> {
    inner: L,
    open: Arc<Semaphore>,
    shared: Arc<Shared>,
    backoff: Duration,
}

impl<L: Acceptor> GuardedListener<L> {
    /// `name` labels the metrics and log lines (`engine_api`, `peer_link`, `admin`).
    pub fn new(inner: L, name: &'static str, limits: ConnectionLimits, metrics: Arc<GatewayMetrics>) -> Self {
        let open = Arc::new(Semaphore::new(limits.max_connections as usize));
        let shared = Arc::new(Shared { name, limits, metrics, log: Mutex::new(Vec::new()) });
        GuardedListener { inner, open, shared, backoff: Duration::from_millis(ACCEPT_BACKOFF_MIN_MS) }
    }

    /// The next connection within the cap. Waits (never spins) while accept fails.
    pub async fn next(&mut self) -> (Guarded<L::Io>, L::Addr) {
        loop {
            match self.inner.accept_one().await {
                Ok((io, addr)) => {
                    self.backoff = Duration::from_millis(ACCEPT_BACKOFF_MIN_MS);
                    match self.open.clone().try_acquire_owned() {
                        Ok(permit) => return (Guarded::new(io, permit, self.shared.clone()), addr),
                        Err(_) => {
                            drop(io);
                            let max = self.shared.limits.max_connections;
                            self.shared.refused(
                                "connection_limit",
                                &format_args!("{max} connections open (connections.max_connections)"),
                            );
                        }
                    }
                }
                // The peer gave up before we accepted: nothing to do.
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::ConnectionAborted
                            | io::ErrorKind::ConnectionReset
                            | io::ErrorKind::ConnectionRefused
                    ) => {}
                Err(e) => {
                    let wait = self.backoff;
                    self.shared.refused(
                        "accept_error",
                        &format_args!("accept failed ({e}); waiting {} ms before the next accept", wait.as_millis()),
                    );
                    tokio::time::sleep(wait).await;
                    self.backoff = (wait * 2).min(Duration::from_millis(ACCEPT_BACKOFF_MAX_MS));
                }
            }
        }
    }

    /// The accepted connections as a stream, for tonic's `serve_with_incoming*`.
    pub fn into_stream(self) -> impl tokio_stream::Stream<Item = io::Result<Guarded<L::Io>>> + Send + 'static {
        futures_util::stream::unfold(self, |mut listener| async move {
            let (io, _) = listener.next().await;
            Some((Ok(io), listener))
        })
    }
}

impl axum::serve::Listener for GuardedListener<tokio::net::TcpListener> {
    type Io = Guarded<tokio::net::TcpStream>;
    type Addr = std::net::SocketAddr;
    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        self.next().await
    }
    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

/// An accepted connection: holds its place under the cap, and fails its reads once it has sent
/// nothing for `handshake_timeout_ms` (before its first byte) or `idle_timeout_ms` (after), which
/// makes tonic or axum close it.
pub struct Guarded<Io> {
    inner: Io,
    hold: Arc<ConnectionHold>,
    shared: Arc<Shared>,
    /// When the silence bound is next checked; re-armed lazily from `last_read`.
    timer: Pin<Box<Sleep>>,
    last_read: Option<Instant>,
}

/// A connection's place under its listener's cap, counted in its open-connections gauge until the
/// last holder drops it (the connection, and whatever else keeps the connection's socket in use).
pub struct ConnectionHold {
    _permit: OwnedSemaphorePermit,
    shared: Arc<Shared>,
}

impl Drop for ConnectionHold {
    fn drop(&mut self) {
        self.shared.metrics.listener_opened(self.shared.name, -1);
    }
}

impl<Io> Guarded<Io> {
    fn new(inner: Io, permit: OwnedSemaphorePermit, shared: Arc<Shared>) -> Self {
        shared.metrics.listener_opened(shared.name, 1);
        let first = Instant::now() + Duration::from_millis(shared.limits.handshake_timeout_ms);
        let hold = Arc::new(ConnectionHold { _permit: permit, shared: shared.clone() });
        Guarded { inner, hold, shared, timer: Box::pin(tokio::time::sleep_until(first)), last_read: None }
    }

    /// The connection's place under the cap, for a task that keeps using its socket through another
    /// descriptor after this one is dropped.
    pub fn hold(&self) -> Arc<ConnectionHold> {
        self.hold.clone()
    }

    /// The connection itself (to peek at its first bytes).
    pub fn get_ref(&self) -> &Io {
        &self.inner
    }

    /// Counts and logs (paced) this connection's refusal by whoever serves it, with its reason code
    /// (the caller then drops it).
    pub fn refuse(&self, reason: &'static str, detail: &dyn std::fmt::Display) {
        self.shared.refused(reason, detail);
    }

    /// Whether the connection has been silent past its bound (re-arms the timer when it has not).
    fn silent_too_long(&mut self, cx: &mut Context<'_>) -> Option<&'static str> {
        loop {
            if self.timer.as_mut().poll(cx).is_pending() {
                return None;
            }
            let Some(last) = self.last_read else { return Some("handshake_timeout") };
            let due = last + Duration::from_millis(self.shared.limits.idle_timeout_ms);
            if due <= Instant::now() {
                return Some("idle_timeout");
            }
            self.timer.as_mut().reset(due);
        }
    }
}

impl<Io: AsyncRead + Unpin> AsyncRead for Guarded<Io> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        match Pin::new(&mut self.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    self.last_read = Some(Instant::now());
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => match self.silent_too_long(cx) {
                None => Poll::Pending,
                Some(reason) => {
                    let limits = &self.shared.limits;
                    let bound = if reason == "handshake_timeout" {
                        limits.handshake_timeout_ms
                    } else {
                        limits.idle_timeout_ms
                    };
                    self.shared.refused(reason, &format_args!("silent for {bound} ms (connections.{reason}_ms)"));
                    Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("{reason}: silent for {bound} ms"),
                    )))
                }
            },
            other => other,
        }
    }
}

impl<Io: AsyncWrite + Unpin> AsyncWrite for Guarded<Io> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

impl<Io: tonic::transport::server::Connected> tonic::transport::server::Connected for Guarded<Io> {
    type ConnectInfo = Io::ConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

/// Which accepted connection a request came over (engine API listeners): tonic puts it in every
/// request's extensions, so that a per-connection limit can be kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConnectionId(pub u64);

static NEXT_CONNECTION_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// A number no other accepted connection of this process has (gRPC and lane listeners alike).
pub fn next_connection_id() -> ConnectionId {
    ConnectionId(NEXT_CONNECTION_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
}

/// A guarded connection with its [`ConnectionId`] as tonic's connect info.
pub struct Numbered<Io> {
    inner: Guarded<Io>,
    id: ConnectionId,
}

impl<L: Acceptor> GuardedListener<L> {
    /// The accepted connections, each numbered, as a stream for tonic.
    pub fn into_numbered_stream(
        self,
    ) -> impl tokio_stream::Stream<Item = io::Result<Numbered<L::Io>>> + Send + 'static {
        tokio_stream::StreamExt::map(self.into_stream(), |io| {
            io.map(|inner| Numbered { inner, id: next_connection_id() })
        })
    }
}

impl<Io: AsyncRead + Unpin> AsyncRead for Numbered<Io> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<Io: AsyncWrite + Unpin> AsyncWrite for Numbered<Io> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

impl<Io> tonic::transport::server::Connected for Numbered<Io> {
    type ConnectInfo = ConnectionId;
    fn connect_info(&self) -> ConnectionId {
        self.id
    }
}

/// The HTTP/2 keep-alive ping interval of a gRPC listener with these limits: a third of the idle
/// bound, so that a live client's answers keep its connection from looking silent.
pub fn keepalive_interval(limits: &ConnectionLimits) -> Duration {
    Duration::from_millis((limits.idle_timeout_ms / 3).max(1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    fn limits(max: u64, handshake_ms: u64, idle_ms: u64) -> ConnectionLimits {
        ConnectionLimits { max_connections: max, handshake_timeout_ms: handshake_ms, idle_timeout_ms: idle_ms }
    }

    async fn listener(
        limits: ConnectionLimits,
    ) -> (GuardedListener<tokio::net::TcpListener>, std::net::SocketAddr, Arc<GatewayMetrics>) {
        let inner = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = inner.local_addr().unwrap();
        let metrics = Arc::new(GatewayMetrics::default());
        (GuardedListener::new(inner, "test", limits, metrics.clone()), addr, metrics)
    }

    #[tokio::test]
    async fn accepted_sockets_have_nodelay() {
        let (mut l, addr, _) = listener(limits(4, 10_000, 10_000)).await;
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (accepted, _) = l.next().await;
        assert!(accepted.inner.nodelay().unwrap());
    }

    /// The trap the nodelay option exists for: a plain accept leaves Nagle on.
    #[tokio::test]
    async fn a_plain_accept_leaves_nagle_on() {
        let inner = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let _client = tokio::net::TcpStream::connect(inner.local_addr().unwrap()).await.unwrap();
        assert!(!inner.accept().await.unwrap().0.nodelay().unwrap());
    }

    #[tokio::test]
    async fn the_cap_holds_at_its_limit_and_closes_the_one_past_it() {
        let (mut l, addr, metrics) = listener(limits(2, 10_000, 10_000)).await;
        let mut clients = Vec::new();
        let mut held = Vec::new();
        for _ in 0..2 {
            clients.push(tokio::net::TcpStream::connect(addr).await.unwrap());
            held.push(l.next().await.0);
        }
        let mut third = tokio::net::TcpStream::connect(addr).await.unwrap();
        let waiting = tokio::time::timeout(Duration::from_millis(300), l.next()).await;
        assert!(waiting.is_err(), "nothing past the cap is handed on");
        let mut byte = [0u8; 1];
        assert_eq!(third.read(&mut byte).await.unwrap_or(0), 0, "the connection past the cap is closed");
        assert!(metrics.listener_refusals("test", "connection_limit") >= 1);
        drop(held.pop());
        clients.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        let _again =
            tokio::time::timeout(Duration::from_secs(5), l.next()).await.expect("a freed place is taken again");
    }

    #[tokio::test]
    async fn a_hold_kept_past_its_connection_keeps_the_place_under_the_cap_until_it_is_dropped() {
        let (mut l, addr, metrics) = listener(limits(1, 10_000, 10_000)).await;
        let _first = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (accepted, _) = l.next().await;
        let hold = accepted.hold();
        drop(accepted);
        let mut second = tokio::net::TcpStream::connect(addr).await.unwrap();
        let waiting = tokio::time::timeout(Duration::from_millis(300), l.next()).await;
        assert!(waiting.is_err(), "the hold still fills the cap of one");
        let mut byte = [0u8; 1];
        assert_eq!(second.read(&mut byte).await.unwrap_or(0), 0, "the connection past the cap is closed");
        assert!(metrics.listener_refusals("test", "connection_limit") >= 1);
        drop(hold);
        let _third = tokio::net::TcpStream::connect(addr).await.unwrap();
        let _again =
            tokio::time::timeout(Duration::from_secs(5), l.next()).await.expect("the place is free once the hold goes");
    }

    #[tokio::test]
    async fn silence_before_the_first_byte_and_after_the_last_ends_the_connection() {
        let (mut l, addr, metrics) = listener(limits(4, 200, 400)).await;
        let _silent = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (mut accepted, _) = l.next().await;
        let started = Instant::now();
        let mut buf = [0u8; 8];
        let e = accepted.read(&mut buf).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(started.elapsed() >= Duration::from_millis(200));
        assert_eq!(metrics.listener_refusals("test", "handshake_timeout"), 1);

        let mut talker = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (mut accepted, _) = l.next().await;
        use tokio::io::AsyncWriteExt;
        let mut last = Instant::now();
        for round in 0..4 {
            if round > 0 {
                tokio::time::sleep(Duration::from_millis(150)).await;
            }
            talker.write_all(b"x").await.unwrap();
            assert_eq!(accepted.read(&mut buf).await.unwrap(), 1, "a connection that talks within the bound stays");
            last = Instant::now();
        }
        let e = accepted.read(&mut buf).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(last.elapsed() >= Duration::from_millis(400), "closed only after idle_timeout_ms of silence");
        assert_eq!(metrics.listener_refusals("test", "idle_timeout"), 1);
    }
}
