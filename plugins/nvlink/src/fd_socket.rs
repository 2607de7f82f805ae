//! The descriptor socket of CUDA VMM regions: a file descriptor cannot travel in a remote key's
//! bytes, so the instance that registered VMM regions serves their descriptors on an
//! abstract-namespace unix socket (as NCCL does for cuMem IPC), and an importer asks for one by
//! region id and secret. Owns the server (its thread, the table of served descriptors, every check
//! on a request) and the client call; never touches CUDA (the tests serve a memfd).
//!
//! Protocol, one request per connection: the importer sends [`REQUEST_BYTES`] bytes (`KVGNVFD1`,
//! the region id as u64 little endian, the region's secret); the server answers one line, `ok` with
//! the descriptor attached (SCM_RIGHTS), or `err <reason> <message>`, then closes. Both sides check
//! with SO_PEERCRED that the other runs as the same uid; the server hands a descriptor out only for a
//! region it serves now (registered, not yet deregistered) and only with that region's secret.
//! Every wait is bounded by the request timeout (`vmm_fd_request_timeout_ms`).

use kvgate_abi::{PluginError, ReasonCode};
use nix::sys::socket::{
    self, getsockopt, recvmsg, sendmsg, sockopt, AddressFamily, ControlMessage, ControlMessageOwned, MsgFlags,
    SockFlag, SockType, UnixAddr,
};
use nix::sys::time::TimeVal;
use std::collections::HashMap;
use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::wire::VMM_SECRET_BYTES;

/// First bytes of every request.
pub const REQUEST_MAGIC: &[u8; 8] = b"KVGNVFD1";
/// Size of a request in bytes: magic, region id, secret.
pub const REQUEST_BYTES: usize = 8 + 8 + VMM_SECRET_BYTES;
/// Longest answer line an importer reads, in bytes (newline included); a longer one is a protocol
/// violation.
pub const MAX_ANSWER_BYTES: usize = 512;
/// Longest refusal message the server writes, in bytes (the line stays under [`MAX_ANSWER_BYTES`]).
const MAX_MESSAGE_BYTES: usize = 400;
/// Accept errors (out of descriptors) back off from this many milliseconds...
const ACCEPT_BACKOFF_MIN_MS: u64 = 10;
/// ... doubling up to this many.
const ACCEPT_BACKOFF_MAX_MS: u64 = 1000;

/// `n` random bytes from the kernel (`/dev/urandom`).
pub fn random_bytes<const N: usize>() -> std::io::Result<[u8; N]> {
    let mut out = [0u8; N];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut out)?;
    Ok(out)
}

/// A fresh socket name for one instance: `kvgate-nvlink-<16 random hex digits>`.
pub fn fresh_socket_name() -> std::io::Result<String> {
    let bytes: [u8; 8] = random_bytes()?;
    Ok(format!("kvgate-nvlink-{}", bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()))
}

/// One descriptor the server hands out.
struct Served {
    fd: OwnedFd,
    secret: [u8; VMM_SECRET_BYTES],
}

type Table = Arc<Mutex<HashMap<u64, Served>>>;

/// The server of one plugin instance: a thread blocked in `accept`, one connection at a time, each
/// bounded by the request timeout. Stops (and joins its thread) on [`FdServer::stop`] or drop.
pub struct FdServer {
    name: String,
    table: Table,
    stop: Arc<AtomicBool>,
    listener: Arc<UnixListener>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

fn uid() -> u32 {
    nix::unistd::getuid().as_raw()
}

fn peer_uid(stream: &UnixStream) -> std::io::Result<u32> {
    Ok(getsockopt(stream, sockopt::PeerCredentials)?.uid())
}

impl FdServer {
    /// Binds `name` in the abstract namespace and starts serving.
    pub fn start(name: String, request_timeout: Duration) -> std::io::Result<FdServer> {
        let addr = SocketAddr::from_abstract_name(name.as_bytes())?;
        let listener = Arc::new(UnixListener::bind_addr(&addr)?);
        let table: Table = Arc::new(Mutex::new(HashMap::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (t, s, l) = (table.clone(), stop.clone(), listener.clone());
        let thread = std::thread::Builder::new()
            .name("kvgate-nvlink-fds".into())
            .spawn(move || accept_loop(&l, &t, &s, request_timeout))?;
        tracing::info!(socket = %name, "nvlink: serving CUDA VMM descriptors on an abstract unix socket");
        Ok(FdServer { name, table, stop, listener, thread: Mutex::new(Some(thread)) })
    }

    /// The abstract-namespace name (without the leading NUL).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Serves `fd` for `region_id` to whoever presents `secret` (replaces an earlier one).
    pub fn serve(&self, region_id: u64, secret: [u8; VMM_SECRET_BYTES], fd: OwnedFd) {
        self.table.lock().unwrap_or_else(|p| p.into_inner()).insert(region_id, Served { fd, secret });
    }

    /// Stops serving `region_id` (its descriptor is closed); whether it was served.
    pub fn withdraw(&self, region_id: u64) -> bool {
        self.table.lock().unwrap_or_else(|p| p.into_inner()).remove(&region_id).is_some()
    }

    /// How many regions are served now.
    pub fn served(&self) -> usize {
        self.table.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Stops the thread (a request in progress finishes first, bounded by the request timeout), waits
    /// for it, and closes every served descriptor. Idempotent.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the thread out of `accept` (Linux returns EINVAL there after a shutdown of the listener).
        let _ = socket::shutdown(self.listener.as_raw_fd(), socket::Shutdown::Both);
        if let Some(handle) = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take() {
            if handle.thread().id() != std::thread::current().id() {
                let _ = handle.join();
            }
        }
        self.table.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
}

impl Drop for FdServer {
    fn drop(&mut self) {
        self.stop();
    }
}

fn accept_loop(listener: &UnixListener, table: &Table, stop: &AtomicBool, timeout: Duration) {
    let mut backoff = Duration::from_millis(ACCEPT_BACKOFF_MIN_MS);
    while !stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, _)) => {
                backoff = Duration::from_millis(ACCEPT_BACKOFF_MIN_MS);
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                serve_connection(stream, table, timeout);
            }
            Err(e) => {
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                tracing::warn!("nvlink: descriptor socket cannot accept ({e}); waiting {backoff:?}");
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_millis(ACCEPT_BACKOFF_MAX_MS));
            }
        }
    }
}

/// A refusal: reason word and message.
struct Refusal(&'static str, String);

fn serve_connection(mut stream: UnixStream, table: &Table, timeout: Duration) {
    let answer = (|| {
        stream
            .set_read_timeout(Some(timeout))
            .and_then(|()| stream.set_write_timeout(Some(timeout)))
            .map_err(|e| Refusal("socket_error", format!("set timeouts: {e}")))?;
        let their_uid = peer_uid(&stream).map_err(|e| Refusal("socket_error", format!("SO_PEERCRED: {e}")))?;
        if their_uid != uid() {
            return Err(Refusal(
                "uid_mismatch",
                format!("the requester runs as uid {their_uid}, this process as uid {}", uid()),
            ));
        }
        let mut request = [0u8; REQUEST_BYTES];
        stream.read_exact(&mut request).map_err(|e| match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => Refusal(
                "request_timeout",
                format!("no complete request within vmm_fd_request_timeout_ms ({} ms)", timeout.as_millis()),
            ),
            _ => Refusal("bad_request", format!("reading the request: {e}")),
        })?;
        if &request[..8] != REQUEST_MAGIC {
            return Err(Refusal("bad_request", "not a descriptor request (wrong magic)".into()));
        }
        let region_id = u64::from_le_bytes(request[8..16].try_into().expect("8 bytes"));
        let secret: [u8; VMM_SECRET_BYTES] = request[16..].try_into().expect("secret bytes");
        let guard = table.lock().unwrap_or_else(|p| p.into_inner());
        let served = guard.get(&region_id).ok_or_else(|| {
            Refusal(
                "unknown_region",
                format!("region {region_id} is not served (never registered here, or deregistered)"),
            )
        })?;
        if !same_secret(&served.secret, &secret) {
            return Err(Refusal("bad_secret", format!("wrong secret for region {region_id}")));
        }
        served.fd.try_clone().map_err(|e| Refusal("socket_error", format!("dup: {e}")))
    })();
    match answer {
        Ok(fd) => {
            let iov = [IoSlice::new(b"ok\n")];
            let fds = [fd.as_raw_fd()];
            if let Err(e) = sendmsg::<()>(
                stream.as_raw_fd(),
                &iov,
                &[ControlMessage::ScmRights(&fds)],
                MsgFlags::MSG_NOSIGNAL,
                None,
            ) {
                tracing::info!("nvlink: descriptor socket: sending a descriptor failed: {e}");
            }
        }
        Err(Refusal(reason, mut message)) => {
            tracing::info!(reason, "nvlink: descriptor request refused: {message}");
            let mut cut = message.len().min(MAX_MESSAGE_BYTES);
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
            let _ = stream.write_all(format!("err {reason} {}\n", message.replace('\n', " ")).as_bytes());
        }
    }
}

/// Compares secrets without stopping at the first difference.
fn same_secret(a: &[u8; VMM_SECRET_BYTES], b: &[u8; VMM_SECRET_BYTES]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn failed(code: ReasonCode, message: String) -> PluginError {
    PluginError::new(code, format!("nvlink descriptor request: {message}"))
}

fn timeval(d: Duration) -> TimeVal {
    let d = d.max(Duration::from_micros(1)); // 0 would mean "no timeout"
    TimeVal::new(d.as_secs() as _, d.subsec_micros() as _)
}

/// Asks the instance serving on `socket_name` for region `region_id`'s descriptor. Bounded by
/// `timeout` in all (connect, request, answer). Refusals carry the server's reason.
pub fn request_fd(
    socket_name: &str,
    region_id: u64,
    secret: &[u8; VMM_SECRET_BYTES],
    timeout: Duration,
) -> Result<OwnedFd, PluginError> {
    let deadline = Instant::now() + timeout;
    let left = || deadline.saturating_duration_since(Instant::now());
    let io = |what: &str, e: std::io::Error| -> PluginError {
        match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => failed(
                ReasonCode::TIMEOUT,
                format!(
                    "{what}: no answer from {socket_name} within vmm_fd_request_timeout_ms ({} ms)",
                    timeout.as_millis()
                ),
            ),
            _ => failed(ReasonCode::TRANSPORT_ERROR, format!("{what} ({socket_name}): {e}")),
        }
    };
    let sock = socket::socket(AddressFamily::Unix, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)
        .map_err(|e| io("socket", e.into()))?;
    socket::setsockopt(&sock, sockopt::SendTimeout, &timeval(left())).map_err(|e| io("SO_SNDTIMEO", e.into()))?;
    let addr = UnixAddr::new_abstract(socket_name.as_bytes()).map_err(|e| io("address", e.into()))?;
    socket::connect(sock.as_raw_fd(), &addr).map_err(|e| match e {
        nix::errno::Errno::ECONNREFUSED | nix::errno::Errno::ENOENT => failed(
            ReasonCode::PEER_UNREACHABLE,
            format!(
                "nothing listens on {socket_name} (the registering instance shut down, or runs in another network namespace)"
            ),
        ),
        other => io("connect", other.into()),
    })?;
    let mut stream = UnixStream::from(sock);
    let their_uid = peer_uid(&stream).map_err(|e| io("SO_PEERCRED", e))?;
    if their_uid != uid() {
        return Err(failed(
            ReasonCode::AUTH_FAILED,
            format!("{socket_name} is served by uid {their_uid}, this process runs as uid {}", uid()),
        ));
    }
    let mut request = Vec::with_capacity(REQUEST_BYTES);
    request.extend_from_slice(REQUEST_MAGIC);
    request.extend_from_slice(&region_id.to_le_bytes());
    request.extend_from_slice(secret);
    stream.set_write_timeout(Some(left().max(Duration::from_micros(1)))).map_err(|e| io("set timeout", e))?;
    stream.write_all(&request).map_err(|e| io("send the request", e))?;
    let mut line = Vec::with_capacity(64);
    let mut fds: Vec<OwnedFd> = Vec::new();
    while !line.contains(&b'\n') {
        let wait = left();
        if wait.is_zero() {
            return Err(io("read the answer", std::io::ErrorKind::TimedOut.into()));
        }
        stream.set_read_timeout(Some(wait)).map_err(|e| io("set timeout", e))?;
        let mut buf = [0u8; MAX_ANSWER_BYTES];
        let room = MAX_ANSWER_BYTES - line.len();
        let mut iov = [IoSliceMut::new(&mut buf[..room])];
        let mut space = nix::cmsg_space!([std::os::fd::RawFd; 4]);
        let message = recvmsg::<()>(stream.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC)
            .map_err(|e| io("read the answer", e.into()))?;
        for cmsg in message.cmsgs().map_err(|e| io("control message", e.into()))? {
            if let ControlMessageOwned::ScmRights(received) = cmsg {
                // SAFETY: the kernel just installed these descriptors in this process; each is owned once.
                fds.extend(received.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }));
            }
        }
        let got = message.bytes;
        if got == 0 {
            return Err(failed(
                ReasonCode::TRANSPORT_ERROR,
                format!("{socket_name} closed the connection without an answer"),
            ));
        }
        line.extend_from_slice(&buf[..got]);
        if !line.contains(&b'\n') && line.len() >= MAX_ANSWER_BYTES {
            return Err(failed(ReasonCode::PROTOCOL_VIOLATION, format!("answer longer than {MAX_ANSWER_BYTES} bytes")));
        }
    }
    let end = line.iter().position(|&b| b == b'\n').expect("newline seen");
    let text = String::from_utf8_lossy(&line[..end]).into_owned();
    if text == "ok" {
        if fds.len() != 1 {
            return Err(failed(
                ReasonCode::PROTOCOL_VIOLATION,
                format!("answer ok with {} descriptors, expected 1", fds.len()),
            ));
        }
        return Ok(fds.pop().expect("one descriptor"));
    }
    let Some(rest) = text.strip_prefix("err ") else {
        return Err(failed(ReasonCode::PROTOCOL_VIOLATION, format!("unexpected answer {text:?}")));
    };
    let (reason, message) = rest.split_once(' ').unwrap_or((rest, ""));
    let code = match reason {
        "unknown_region" => ReasonCode::UNKNOWN_KEY,
        "bad_secret" | "uid_mismatch" => ReasonCode::AUTH_FAILED,
        "request_timeout" => ReasonCode::TIMEOUT,
        "bad_request" => ReasonCode::PROTOCOL_VIOLATION,
        _ => ReasonCode::TRANSPORT_ERROR,
    };
    Err(failed(code, format!("{socket_name} refused region {region_id}: {reason}: {message}")))
}
