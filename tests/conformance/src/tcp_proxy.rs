//! A fault-injecting loopback TCP proxy, the TCP counterpart of [`crate::proxy::UdpProxy`], for
//! transports that move their bytes over TCP (UCX over TCP): the sender connects to the proxy, the
//! proxy to the receiver, and on demand it passes, black-holes, delays, resets or half-closes every
//! connection. Owns its sockets and threads; never parses a plugin's protocol.
//!
//! The way in ([`find_listening_port`]): a receiver's endpoint bytes name the TCP port it listens on
//! (UCX's worker address carries it big-endian, and no literal loopback address), so the harness
//! finds, in the endpoint, a port the receiver process really listens on (read from `/proc`) and
//! rewrites it to the proxy's. The target can change ([`TcpProxy::retarget`]): a receiver restarted
//! behind the proxy is a peer restarting at the same address (HANDSHAKE-2).

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TcpFault {
    Pass,
    /// Read and drop every byte, both ways; the connections stay open.
    BlackHole,
    /// Hold every chunk this long before forwarding it, in order.
    Delay(Duration),
    /// Abort every connection with a reset (RST), both sides; later connections are reset at once.
    Reset,
    /// Close the direction toward the target (it reads end of file) and drop what the client sends
    /// after; the direction back to the client keeps working.
    HalfClose,
}

/// What the proxy did (for evidence).
#[derive(Default)]
pub struct TcpCounters {
    pub connections: AtomicU64,
    pub forwarded_bytes: AtomicU64,
    pub dropped_bytes: AtomicU64,
    pub resets: AtomicU64,
    pub half_closes: AtomicU64,
}

pub struct TcpProxy {
    pub listen: SocketAddr,
    target: Arc<Mutex<SocketAddr>>,
    fault: Arc<Mutex<TcpFault>>,
    pub counters: Arc<TcpCounters>,
    stop: Arc<AtomicBool>,
    threads: Arc<Mutex<Vec<JoinHandle<()>>>>,
    acceptor: Option<JoinHandle<()>>,
}

/// How long a pump waits for bytes before it looks at the fault, the held chunks and `stop` again.
const POLL_MS: u64 = 1;

impl TcpProxy {
    /// Listen on a fresh loopback port and forward every connection to `target`.
    pub fn start(target: SocketAddr) -> std::io::Result<TcpProxy> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let listen = listener.local_addr()?;
        let target = Arc::new(Mutex::new(target));
        let fault = Arc::new(Mutex::new(TcpFault::Pass));
        let counters = Arc::new(TcpCounters::default());
        let stop = Arc::new(AtomicBool::new(false));
        let threads: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let (to, f, c, s, t) =
            (Arc::clone(&target), Arc::clone(&fault), Arc::clone(&counters), Arc::clone(&stop), Arc::clone(&threads));
        let acceptor = std::thread::Builder::new()
            .name("tcp-fault-proxy".into())
            .spawn(move || accept(listener, to, f, c, s, t))?;
        Ok(TcpProxy { listen, target, fault, counters, stop, threads, acceptor: Some(acceptor) })
    }

    pub fn set(&self, fault: TcpFault) {
        *self.fault.lock().unwrap_or_else(|e| e.into_inner()) = fault;
    }

    /// Forward connections accepted from now on to `target` (those already open keep theirs).
    pub fn retarget(&self, target: SocketAddr) {
        *self.target.lock().unwrap_or_else(|e| e.into_inner()) = target;
    }

    pub fn target(&self) -> SocketAddr {
        *self.target.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What it did so far, for evidence.
    pub fn summary(&self) -> String {
        let c = &self.counters;
        format!(
            "{} connections, {} bytes forwarded, {} dropped, {} reset, {} half-closed",
            c.connections.load(Ordering::Relaxed),
            c.forwarded_bytes.load(Ordering::Relaxed),
            c.dropped_bytes.load(Ordering::Relaxed),
            c.resets.load(Ordering::Relaxed),
            c.half_closes.load(Ordering::Relaxed)
        )
    }
}

/// The TCP ports process `pid` listens on (IPv4 and IPv6), read from `/proc`: the listening sockets
/// of its network namespace whose inode is one of its open descriptors.
pub fn listening_tcp_ports(pid: u32) -> Vec<u16> {
    let mut inodes = std::collections::HashSet::new();
    if let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) {
        for fd in fds.flatten() {
            let Ok(link) = std::fs::read_link(fd.path()) else { continue };
            let link = link.to_string_lossy();
            if let Some(inode) = link.strip_prefix("socket:[").and_then(|l| l.strip_suffix(']')) {
                inodes.insert(inode.to_string());
            }
        }
    }
    let mut ports = Vec::new();
    for table in ["tcp", "tcp6"] {
        let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")) else { continue };
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // sl local_address rem_address st tx:rx tr:tm retrnsmt uid timeout inode
            let (Some(local), Some(state), Some(inode)) = (fields.get(1), fields.get(3), fields.get(9)) else {
                continue;
            };
            if *state != "0A" || !inodes.contains(*inode) {
                continue;
            }
            if let Some(port) = local.rsplit(':').next().and_then(|h| u16::from_str_radix(h, 16).ok()) {
                ports.push(port);
            }
        }
    }
    ports.sort_unstable();
    ports.dedup();
    ports
}

/// Where in `endpoint` a port of `ports` is written big-endian (network order, as in a socket
/// address): the last such place (UCX's worker address ends with its TCP interface's port), with the
/// port. None when no listening port appears.
pub fn find_listening_port(endpoint: &[u8], ports: &[u16]) -> Option<(usize, u16)> {
    (0..endpoint.len().saturating_sub(1))
        .rev()
        .map(|at| (at, u16::from_be_bytes([endpoint[at], endpoint[at + 1]])))
        .find(|(_, port)| *port != 0 && ports.contains(port))
}

/// `endpoint` with the port at `at` replaced by `port` (big-endian).
pub fn rewrite_tcp_port(endpoint: &[u8], at: usize, port: u16) -> Vec<u8> {
    let mut out = endpoint.to_vec();
    out[at..at + 2].copy_from_slice(&port.to_be_bytes());
    out
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.acceptor.take() {
            let _ = t.join();
        }
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|e| e.into_inner()));
        for t in threads {
            let _ = t.join();
        }
    }
}

fn current(fault: &Mutex<TcpFault>) -> TcpFault {
    *fault.lock().unwrap_or_else(|e| e.into_inner())
}

/// Close `s` with a reset rather than a FIN: linger on, with a zero timeout, then close.
fn reset(s: &TcpStream) {
    let linger = libc::linger { l_onoff: 1, l_linger: 0 };
    // SAFETY: setsockopt(2) on a socket this process owns, with a valid `linger` of the right size.
    unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
}

fn accept(
    listener: TcpListener,
    target: Arc<Mutex<SocketAddr>>,
    fault: Arc<Mutex<TcpFault>>,
    counters: Arc<TcpCounters>,
    stop: Arc<AtomicBool>,
    threads: Arc<Mutex<Vec<JoinHandle<()>>>>,
) {
    while !stop.load(Ordering::SeqCst) {
        let client = match listener.accept() {
            Ok((client, _)) => client,
            Err(_) => {
                std::thread::sleep(Duration::from_millis(POLL_MS));
                continue;
            }
        };
        counters.connections.fetch_add(1, Ordering::Relaxed);
        if current(&fault) == TcpFault::Reset {
            reset(&client);
            counters.resets.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        let to = *target.lock().unwrap_or_else(|e| e.into_inner());
        let Ok(server) = TcpStream::connect_timeout(&to, Duration::from_secs(1)) else {
            reset(&client);
            continue;
        };
        let pair = [(&client, &server), (&server, &client)].map(|(from, to)| (from.try_clone(), to.try_clone()));
        let mut spawned = Vec::new();
        for (i, (from, to)) in pair.into_iter().enumerate() {
            let (Ok(from), Ok(to)) = (from, to) else { continue };
            let (f, c, s) = (Arc::clone(&fault), Arc::clone(&counters), Arc::clone(&stop));
            let to_target = i == 0;
            if let Ok(t) = std::thread::Builder::new()
                .name("tcp-fault-pump".into())
                .spawn(move || pump(from, to, to_target, f, c, s))
            {
                spawned.push(t);
            }
        }
        threads.lock().unwrap_or_else(|e| e.into_inner()).extend(spawned);
    }
}

/// Move bytes from `from` to `to` (toward the target when `to_target`) under the current fault,
/// until either side closes, a reset, or `stop`.
fn pump(
    mut from: TcpStream,
    mut to: TcpStream,
    to_target: bool,
    fault: Arc<Mutex<TcpFault>>,
    counters: Arc<TcpCounters>,
    stop: Arc<AtomicBool>,
) {
    let _ = from.set_read_timeout(Some(Duration::from_millis(POLL_MS)));
    let mut held: std::collections::VecDeque<(Instant, Vec<u8>)> = Default::default();
    let mut buf = vec![0u8; 65_536];
    let mut half_closed = false;
    while !stop.load(Ordering::SeqCst) {
        let f = current(&fault);
        if f == TcpFault::Reset {
            // Both pumps of the connection get here: each drops its handles, and the last close of
            // each socket, lingering for no time, sends a reset (a shutdown would send a FIN first).
            reset(&from);
            reset(&to);
            if to_target {
                counters.resets.fetch_add(1, Ordering::Relaxed);
            }
            return;
        }
        if f == TcpFault::HalfClose && to_target && !half_closed {
            let _ = to.shutdown(Shutdown::Write);
            half_closed = true;
            counters.half_closes.fetch_add(1, Ordering::Relaxed);
        }
        let now = Instant::now();
        while held.front().is_some_and(|(due, _)| *due <= now) {
            let (_, data) = held.pop_front().expect("front");
            if to.write_all(&data).is_err() {
                return;
            }
            counters.forwarded_bytes.fetch_add(data.len() as u64, Ordering::Relaxed);
        }
        let n = match from.read(&mut buf) {
            Ok(0) => {
                // End of file from this side: pass it on once what is held has gone.
                for (_, data) in held.drain(..) {
                    let _ = to.write_all(&data);
                }
                let _ = to.shutdown(Shutdown::Write);
                return;
            }
            Ok(n) => n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut | std::io::ErrorKind::Interrupted
                ) =>
            {
                continue
            }
            Err(_) => {
                let _ = to.shutdown(Shutdown::Write);
                return;
            }
        };
        let data = &buf[..n];
        match current(&fault) {
            TcpFault::BlackHole => {
                counters.dropped_bytes.fetch_add(n as u64, Ordering::Relaxed);
            }
            TcpFault::HalfClose if to_target || half_closed => {
                counters.dropped_bytes.fetch_add(n as u64, Ordering::Relaxed);
            }
            TcpFault::Delay(d) => held.push_back((Instant::now() + d, data.to_vec())),
            _ if !held.is_empty() => held.push_back((Instant::now(), data.to_vec())),
            _ => {
                if to.write_all(data).is_err() {
                    return;
                }
                counters.forwarded_bytes.fetch_add(n as u64, Ordering::Relaxed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An echo server on loopback: every connection echoes what it reads; `eofs` counts the
    /// connections that read end of file.
    fn echo_server() -> (SocketAddr, Arc<AtomicU64>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let eofs = Arc::new(AtomicU64::new(0));
        let e = Arc::clone(&eofs);
        std::thread::spawn(move || {
            for s in listener.incoming() {
                let Ok(mut s) = s else { return };
                let e = Arc::clone(&e);
                std::thread::spawn(move || {
                    let mut buf = [0u8; 4096];
                    loop {
                        match s.read(&mut buf) {
                            Ok(0) => {
                                e.fetch_add(1, Ordering::SeqCst);
                                // Half-closed by the peer: this direction still works.
                                let _ = s.write_all(b"bye");
                                return;
                            }
                            Ok(n) => {
                                if s.write_all(&buf[..n]).is_err() {
                                    return;
                                }
                            }
                            Err(_) => return,
                        }
                    }
                });
            }
        });
        (addr, eofs)
    }

    fn echo_within(client: &mut TcpStream, msg: &[u8], bound: Duration) -> std::io::Result<Vec<u8>> {
        client.set_read_timeout(Some(bound))?;
        client.write_all(msg)?;
        let mut got = vec![0u8; msg.len()];
        client.read_exact(&mut got)?;
        Ok(got)
    }

    #[test]
    fn finds_a_listening_port_of_this_process_in_endpoint_bytes_and_rewrites_it() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let ports = listening_tcp_ports(std::process::id());
        assert!(ports.contains(&port), "{port} not in {ports:?}");
        let mut endpoint = vec![7u8; 40];
        endpoint.extend_from_slice(&port.to_be_bytes());
        assert_eq!(find_listening_port(&endpoint, &ports), Some((40, port)));
        let rewritten = rewrite_tcp_port(&endpoint, 40, 4242);
        assert_eq!(&rewritten[40..], &4242u16.to_be_bytes());
        assert_eq!(&rewritten[..40], &endpoint[..40]);
        assert_eq!(find_listening_port(&[7u8; 40], &ports), None, "no listening port: none found");
        drop(listener);
        assert!(!listening_tcp_ports(std::process::id()).contains(&port), "a closed listener is not listed");
    }

    #[test]
    fn a_retargeted_proxy_forwards_new_connections_to_the_new_target() {
        let (first, _) = echo_server();
        let (second, second_eofs) = echo_server();
        let proxy = TcpProxy::start(first).unwrap();
        let mut client = TcpStream::connect(proxy.listen).unwrap();
        assert_eq!(echo_within(&mut client, b"one", Duration::from_secs(2)).unwrap(), b"one");
        proxy.retarget(second);
        assert_eq!(proxy.target(), second);
        let mut client = TcpStream::connect(proxy.listen).unwrap();
        assert_eq!(echo_within(&mut client, b"two", Duration::from_secs(2)).unwrap(), b"two");
        client.shutdown(Shutdown::Write).unwrap();
        let deadline = Instant::now() + Duration::from_secs(2);
        while second_eofs.load(Ordering::SeqCst) == 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(second_eofs.load(Ordering::SeqCst), 1, "the second connection reached the new target");
    }

    #[test]
    fn passes_black_holes_delays_resets_and_half_closes() {
        let (server, eofs) = echo_server();
        let proxy = TcpProxy::start(server).unwrap();
        let mut client = TcpStream::connect(proxy.listen).unwrap();
        assert_eq!(echo_within(&mut client, b"hello", Duration::from_secs(2)).unwrap(), b"hello");

        proxy.set(TcpFault::BlackHole);
        assert!(
            echo_within(&mut client, b"lost", Duration::from_millis(200)).is_err(),
            "nothing comes back through a black hole"
        );
        assert!(proxy.counters.dropped_bytes.load(Ordering::Relaxed) >= 4);

        let mut client = TcpStream::connect(proxy.listen).unwrap();
        proxy.set(TcpFault::Delay(Duration::from_millis(150)));
        let t = Instant::now();
        assert_eq!(echo_within(&mut client, b"late", Duration::from_secs(2)).unwrap(), b"late");
        assert!(t.elapsed() >= Duration::from_millis(300), "held 150 ms each way: {:?}", t.elapsed());

        proxy.set(TcpFault::Pass);
        assert_eq!(echo_within(&mut client, b"again", Duration::from_secs(2)).unwrap(), b"again");
        proxy.set(TcpFault::HalfClose);
        let deadline = Instant::now() + Duration::from_secs(2);
        while eofs.load(Ordering::SeqCst) == 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(eofs.load(Ordering::SeqCst) >= 1, "the target read end of file");
        let mut bye = [0u8; 3];
        client.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        client.read_exact(&mut bye).unwrap();
        assert_eq!(&bye, b"bye", "the direction back to the client still works");

        proxy.set(TcpFault::Pass);
        let mut client = TcpStream::connect(proxy.listen).unwrap();
        assert_eq!(echo_within(&mut client, b"ok", Duration::from_secs(2)).unwrap(), b"ok");
        proxy.set(TcpFault::Reset);
        client.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let mut buf = [0u8; 8];
        let r = client.read(&mut buf);
        assert!(
            matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
            "an open connection is reset: {r:?}"
        );
        let mut late = TcpStream::connect(proxy.listen).unwrap();
        late.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let r = late.read(&mut buf);
        assert!(
            matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
            "a new connection is reset at once: {r:?}"
        );
        assert!(proxy.counters.resets.load(Ordering::Relaxed) >= 2);
    }
}
