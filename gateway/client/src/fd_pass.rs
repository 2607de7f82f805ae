//! Passing a memory descriptor (a memfd, or any file the engine maps) to the gateway on its fd socket
//! (`<engine socket>.fds`): one byte with the descriptor as SCM_RIGHTS, answered by the line
//! `ok <token>` or `err <reason> <message>`. The token then goes in `RegisterMemory { passed_fd }`
//! (`Client::register_passed_fd`). Blocking: a few microseconds on a local socket.

use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
use std::io::{BufRead, BufReader, IoSlice};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

/// The fd socket beside an engine socket.
pub fn fd_socket_path(engine_socket: &Path) -> PathBuf {
    let mut name = engine_socket.as_os_str().to_owned();
    name.push(".fds");
    PathBuf::from(name)
}

/// Why a descriptor was not taken: the gateway's reason code and message, or an I/O error.
#[derive(Debug)]
pub enum PassError {
    Refused { reason: String, message: String },
    Io(std::io::Error),
}

impl std::fmt::Display for PassError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PassError::Refused { reason, message } => write!(f, "{reason}: {message}"),
            PassError::Io(e) => write!(f, "fd socket: {e}"),
        }
    }
}

impl std::error::Error for PassError {}

/// Pass `fd` to the gateway whose engine socket is `engine_socket`; returns its token.
pub fn pass_fd(engine_socket: &Path, fd: BorrowedFd<'_>) -> Result<u64, PassError> {
    let stream = UnixStream::connect(fd_socket_path(engine_socket)).map_err(PassError::Io)?;
    let fds = [fd.as_raw_fd()];
    let cmsg = [ControlMessage::ScmRights(&fds)];
    sendmsg::<()>(stream.as_raw_fd(), &[IoSlice::new(b"F")], &cmsg, MsgFlags::empty(), None)
        .map_err(|e| PassError::Io(e.into()))?;
    let mut line = String::new();
    BufReader::new(&stream).read_line(&mut line).map_err(PassError::Io)?;
    let line = line.trim_end();
    if let Some(token) = line.strip_prefix("ok ") {
        return token
            .parse()
            .map_err(|_| PassError::Refused { reason: "bad_answer".into(), message: line.to_string() });
    }
    let rest = line.strip_prefix("err ").unwrap_or(line);
    let (reason, message) = rest.split_once(' ').unwrap_or((rest, ""));
    Err(PassError::Refused { reason: reason.to_string(), message: message.to_string() })
}
