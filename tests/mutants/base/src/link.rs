//! The socket an instance talks to its peers on: an abstract Unix datagram socket (the same-host
//! variant) or a loopback UDP socket (the network variant, whose traffic a fault proxy can stand in).
//! Peers' addresses are text: the abstract name, or "127.0.0.1:port". Both sockets are non-blocking.

use crate::udp_wire::{frame_control, unframe_control};
use std::net::UdpSocket;
use std::os::fd::{AsRawFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

/// Receive buffer asked of the kernel for the UDP socket (it caps it at `net.core.rmem_max`).
const UDP_RECEIVE_BUFFER_BYTES: libc::c_int = 4 << 20;

pub(crate) enum Link {
    Unix(UnixDatagram),
    Udp(UdpSocket),
}

pub(crate) fn abstract_addr(name: &str) -> std::io::Result<SocketAddr> {
    SocketAddr::from_abstract_name(name.as_bytes())
}

/// Ask the kernel for a socket buffer size (`SO_RCVBUF` or `SO_SNDBUF`) in bytes; it clamps the value
/// between its minimum and `net.core.{r,w}mem_max`.
pub(crate) fn set_buffer(fd: RawFd, option: libc::c_int, bytes: libc::c_int) -> std::io::Result<()> {
    // SAFETY: an option of the size given, on a socket the caller owns.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            option,
            (&bytes as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

impl Link {
    pub fn unix(name: &str) -> std::io::Result<Link> {
        let socket = UnixDatagram::bind_addr(&abstract_addr(name)?)?;
        socket.set_nonblocking(true)?;
        Ok(Link::Unix(socket))
    }

    pub fn udp() -> std::io::Result<Link> {
        let socket = UdpSocket::bind("127.0.0.1:0")?;
        socket.set_nonblocking(true)?;
        // Best effort: the default buffer also works, with more retransmissions.
        let _ = set_buffer(socket.as_raw_fd(), libc::SO_RCVBUF, UDP_RECEIVE_BUFFER_BYTES);
        Ok(Link::Udp(socket))
    }

    pub fn is_udp(&self) -> bool {
        matches!(self, Link::Udp(_))
    }

    /// The UDP port bound (0 for the Unix socket).
    pub fn port(&self) -> u16 {
        match self {
            Link::Udp(s) => s.local_addr().map(|a| a.port()).unwrap_or(0),
            Link::Unix(_) => 0,
        }
    }

    pub fn raw_fd(&self) -> RawFd {
        match self {
            Link::Unix(s) => s.as_raw_fd(),
            Link::Udp(s) => s.as_raw_fd(),
        }
    }

    /// One datagram and the address it came from (`None` for an unnamed Unix sender).
    pub fn recv_from(&self, buf: &mut [u8]) -> std::io::Result<(usize, Option<String>)> {
        match self {
            Link::Unix(s) => {
                let (n, from) = s.recv_from(buf)?;
                Ok((n, from.as_abstract_name().map(|n| String::from_utf8_lossy(n).into_owned())))
            }
            Link::Udp(s) => {
                let (n, from) = s.recv_from(buf)?;
                Ok((n, Some(from.to_string())))
            }
        }
    }

    pub fn send_to(&self, bytes: &[u8], to: &str) -> std::io::Result<usize> {
        match self {
            Link::Unix(s) => s.send_to_addr(bytes, &abstract_addr(to)?),
            Link::Udp(s) => s.send_to(bytes, to),
        }
    }

    /// Control text as this link carries it.
    pub fn frame(&self, text: &str) -> Vec<u8> {
        match self {
            Link::Unix(_) => text.as_bytes().to_vec(),
            Link::Udp(_) => frame_control(text),
        }
    }

    /// The control text of a datagram, if it is one.
    pub fn unframe(&self, datagram: &[u8]) -> Option<String> {
        match self {
            Link::Unix(_) => Some(String::from_utf8_lossy(datagram).into_owned()),
            Link::Udp(_) => unframe_control(datagram),
        }
    }
}
