//! The fd socket (`<engine_api.unix_socket>.fds`): an engine passes a descriptor of its memory (a
//! memfd, or any file it can map) as SCM_RIGHTS and gets a token, which a `RegisterMemory`
//! (`passed_fd`) then names. The gateway never opens a path for such memory, and the engine may exit
//! without the pool vanishing under a live room. Owns the table of passed descriptors not yet
//! registered: bounded in count (`engine_api.max_passed_fds`) and time (`engine_api.passed_fd_ttl_ms`).
//!
//! Protocol, per message: the engine sends one byte with exactly one descriptor attached; the gateway
//! answers one line, `ok <token>` or `err <reason> <message>`. A connection may pass several.

use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
use std::collections::HashMap;
use std::io::{IoSliceMut, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The fd socket of an engine socket.
pub fn fd_socket_path(engine_socket: &Path) -> PathBuf {
    let mut name = engine_socket.as_os_str().to_owned();
    name.push(".fds");
    PathBuf::from(name)
}

/// Passed descriptors waiting for their `RegisterMemory`.
pub struct PassedFds {
    held: Mutex<HashMap<u64, (OwnedFd, Instant)>>,
    max: usize,
    ttl: Duration,
}

impl PassedFds {
    pub fn new(max: u64, ttl_ms: u64) -> PassedFds {
        PassedFds { held: Mutex::new(HashMap::new()), max: max as usize, ttl: Duration::from_millis(ttl_ms) }
    }

    /// Keep `fd`; its token, or why not (`too_many_passed_fds`). Expired ones are closed first.
    pub fn put(&self, fd: OwnedFd) -> Result<u64, (&'static str, String)> {
        let mut held = self.held.lock().unwrap();
        let ttl = self.ttl;
        held.retain(|_, (_, at)| at.elapsed() < ttl);
        if held.len() >= self.max {
            return Err((
                "too_many_passed_fds",
                format!("engine_api.max_passed_fds = {} descriptors wait for their RegisterMemory already", self.max),
            ));
        }
        let mut token = rand::random::<u64>();
        while token == 0 || held.contains_key(&token) {
            token = rand::random::<u64>();
        }
        held.insert(token, (fd, Instant::now()));
        Ok(token)
    }

    /// The descriptor of `token`, once (None: never passed, already taken, or past its ttl).
    pub fn take(&self, token: u64) -> Option<OwnedFd> {
        let (fd, at) = self.held.lock().unwrap().remove(&token)?;
        (at.elapsed() < self.ttl).then_some(fd)
    }

    pub fn len(&self) -> usize {
        self.held.lock().unwrap().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Serve the fd socket on its own thread (blocked in `accept` while idle) until `stop` is set: one
/// connection at a time, each read bounded by `read_timeout` (a silent client holds it at most that
/// long). Accept errors (out of descriptors) back off as the other listeners do, 10 ms doubling to
/// 1 s, with one log line per `REFUSAL_LOG_INTERVAL_MS`.
pub fn spawn_fd_socket(
    listener: UnixListener,
    table: Arc<PassedFds>,
    read_timeout: Duration,
    stop: Arc<AtomicBool>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    use crate::listeners::{ACCEPT_BACKOFF_MAX_MS, ACCEPT_BACKOFF_MIN_MS, REFUSAL_LOG_INTERVAL_MS};
    listener.set_nonblocking(false)?;
    std::thread::Builder::new().name("kvgate-fd-socket".into()).spawn(move || {
        let mut backoff = Duration::from_millis(ACCEPT_BACKOFF_MIN_MS);
        let (mut last_line, mut errors_since) = (None::<Instant>, 0u64);
        while !stop.load(Ordering::Relaxed) {
            match listener.accept() {
                Ok((stream, _)) => {
                    backoff = Duration::from_millis(ACCEPT_BACKOFF_MIN_MS);
                    serve_connection(stream, &table, read_timeout, &stop);
                }
                Err(e) => {
                    errors_since += 1;
                    if last_line.is_none_or(|at| at.elapsed() >= Duration::from_millis(REFUSAL_LOG_INTERVAL_MS)) {
                        tracing::warn!(
                            listener = "fd_socket",
                            errors = errors_since,
                            "fd socket cannot accept ({e}); waiting {backoff:?} before the next try"
                        );
                        (last_line, errors_since) = (Some(Instant::now()), 0);
                    }
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_millis(ACCEPT_BACKOFF_MAX_MS));
                }
            }
        }
    })
}

fn serve_connection(mut stream: UnixStream, table: &PassedFds, read_timeout: Duration, stop: &AtomicBool) {
    if stream.set_nonblocking(false).is_err() || stream.set_read_timeout(Some(read_timeout)).is_err() {
        return;
    }
    while !stop.load(Ordering::Relaxed) {
        let answer = match receive_fd(&stream) {
            Ok(None) => return,
            Ok(Some(fd)) => match table.put(fd) {
                Ok(token) => format!("ok {token}\n"),
                Err((reason, message)) => {
                    tracing::info!(reason, "passed descriptor refused: {message}");
                    format!("err {reason} {message}\n")
                }
            },
            Err(Refused(reason, message)) => {
                tracing::info!(reason, "fd socket: {message}");
                let _ = stream.write_all(format!("err {reason} {message}\n").as_bytes());
                return;
            }
        };
        if stream.write_all(answer.as_bytes()).is_err() {
            return;
        }
    }
}

struct Refused(&'static str, String);

/// One message: Ok(None) at the end of the stream, the one descriptor it carried, or why not.
#[allow(unsafe_code)] // the kernel's SCM_RIGHTS descriptors become owned here
fn receive_fd(stream: &UnixStream) -> Result<Option<OwnedFd>, Refused> {
    let mut byte = [0u8; 1];
    let mut iov = [IoSliceMut::new(&mut byte)];
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; 4]);
    let message = recvmsg::<()>(stream.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC)
        .map_err(|e| Refused("fd_socket_error", format!("receive: {e}")))?;
    let mut fds = Vec::new();
    for cmsg in message.cmsgs().map_err(|e| Refused("fd_socket_error", format!("control message: {e}")))? {
        if let ControlMessageOwned::ScmRights(received) = cmsg {
            // SAFETY: the kernel just installed these descriptors in this process; each is owned once.
            fds.extend(received.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }));
        }
    }
    if message.bytes == 0 && fds.is_empty() {
        return Ok(None);
    }
    if message.flags.contains(MsgFlags::MSG_CTRUNC) || fds.len() != 1 {
        return Err(Refused(
            "one_fd_per_message",
            format!("a message must carry exactly one descriptor, not {}", fds.len()),
        ));
    }
    Ok(fds.pop())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memfd() -> OwnedFd {
        nix::sys::memfd::memfd_create(c"kvgate-test", nix::sys::memfd::MFdFlags::MFD_CLOEXEC).unwrap()
    }

    #[test]
    fn the_table_holds_at_most_its_limit_and_hands_each_descriptor_out_once() {
        let table = PassedFds::new(2, 60_000);
        let a = table.put(memfd()).unwrap();
        let b = table.put(memfd()).unwrap();
        assert_ne!(a, b);
        let (reason, _) = table.put(memfd()).unwrap_err();
        assert_eq!(reason, "too_many_passed_fds", "past the limit");
        assert!(table.take(a).is_some());
        assert!(table.take(a).is_none(), "once");
        table.put(memfd()).unwrap();
        assert_eq!(table.len(), 2, "at the limit again");
    }

    #[test]
    fn a_descriptor_past_its_ttl_is_closed_and_its_token_forgotten() {
        let table = PassedFds::new(1, 100);
        let token = table.put(memfd()).unwrap();
        std::thread::sleep(Duration::from_millis(150));
        assert!(table.take(token).is_none(), "expired");
        let token = table.put(memfd()).unwrap();
        std::thread::sleep(Duration::from_millis(150));
        table.put(memfd()).expect("the expired one no longer counts against the limit");
        assert!(table.take(token).is_none());
    }
}
