//! A fault-injecting loopback TCP proxy, the TCP counterpart of [`crate::proxy::UdpProxy`], for
//! transports that move their bytes over TCP (UCX over TCP): the sender connects to the proxy, the
//! proxy to the receiver, and on demand it passes, black-holes, delays, resets or half-closes every
//! connection. Owns its sockets and threads; never parses a plugin's protocol.
//!
//! Not yet used by a clause: see CONFORMANCE.md (*Network faults over TCP*) for what is missing.

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
    pub target: SocketAddr,
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
        let fault = Arc::new(Mutex::new(TcpFault::Pass));
        let counters = Arc::new(TcpCounters::default());
        let stop = Arc::new(AtomicBool::new(false));
        let threads: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let (f, c, s, t) = (Arc::clone(&fault), Arc::clone(&counters), Arc::clone(&stop), Arc::clone(&threads));
        let acceptor = std::thread::Builder::new().name("tcp-fault-proxy".into()).spawn(move || accept(listener, target, f, c, s, t))?;
        Ok(TcpProxy { listen, target, fault, counters, stop, threads, acceptor: Some(acceptor) })
    }

    pub fn set(&self, fault: TcpFault) {
        *self.fault.lock().unwrap_or_else(|e| e.into_inner()) = fault;
    }
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

fn accept(listener: TcpListener, target: SocketAddr, fault: Arc<Mutex<TcpFault>>, counters: Arc<TcpCounters>, stop: Arc<AtomicBool>, threads: Arc<Mutex<Vec<JoinHandle<()>>>>) {
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
        let Ok(server) = TcpStream::connect_timeout(&target, Duration::from_secs(1)) else {
            reset(&client);
            continue;
        };
        let pair = [(&client, &server), (&server, &client)].map(|(from, to)| (from.try_clone(), to.try_clone()));
        let mut spawned = Vec::new();
        for (i, (from, to)) in pair.into_iter().enumerate() {
            let (Ok(from), Ok(to)) = (from, to) else { continue };
            let (f, c, s) = (Arc::clone(&fault), Arc::clone(&counters), Arc::clone(&stop));
            let to_target = i == 0;
            if let Ok(t) = std::thread::Builder::new().name("tcp-fault-pump".into()).spawn(move || pump(from, to, to_target, f, c, s)) {
                spawned.push(t);
            }
        }
        threads.lock().unwrap_or_else(|e| e.into_inner()).extend(spawned);
    }
}

/// Move bytes from `from` to `to` (toward the target when `to_target`) under the current fault,
/// until either side closes, a reset, or `stop`.
fn pump(mut from: TcpStream, mut to: TcpStream, to_target: bool, fault: Arc<Mutex<TcpFault>>, counters: Arc<TcpCounters>, stop: Arc<AtomicBool>) {
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
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut | std::io::ErrorKind::Interrupted) => continue,
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
    fn passes_black_holes_delays_resets_and_half_closes() {
        let (server, eofs) = echo_server();
        let proxy = TcpProxy::start(server).unwrap();
        let mut client = TcpStream::connect(proxy.listen).unwrap();
        assert_eq!(echo_within(&mut client, b"hello", Duration::from_secs(2)).unwrap(), b"hello");

        proxy.set(TcpFault::BlackHole);
        assert!(echo_within(&mut client, b"lost", Duration::from_millis(200)).is_err(), "nothing comes back through a black hole");
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
        assert!(matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset), "an open connection is reset: {r:?}");
        let mut late = TcpStream::connect(proxy.listen).unwrap();
        late.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let r = late.read(&mut buf);
        assert!(matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset), "a new connection is reset at once: {r:?}");
        assert!(proxy.counters.resets.load(Ordering::Relaxed) >= 2);
    }
}
