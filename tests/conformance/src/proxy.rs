//! A fault-injecting loopback UDP proxy for network plugins: the harness rewrites the receiver's
//! endpoint so the sender reaches it through the proxy, then passes, black-holes, delays or corrupts
//! datagrams on demand. Owns its sockets and thread; never parses a plugin's protocol (it only finds
//! a loopback IPv4 address and a bound UDP port in the endpoint bytes).

use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    Pass,
    /// Drop every datagram, both ways.
    BlackHole,
    /// Hold every datagram this long.
    Delay(Duration),
    /// Flip one byte in every datagram (both ways).
    Corrupt,
}

/// Datagrams the proxy forwarded and dropped (for evidence).
#[derive(Default)]
pub struct Counters {
    pub forwarded: AtomicU64,
    pub dropped: AtomicU64,
    pub corrupted: AtomicU64,
}

pub struct UdpProxy {
    pub listen: SocketAddr,
    pub target: SocketAddr,
    fault: Arc<Mutex<Fault>>,
    pub counters: Arc<Counters>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// How long the proxy thread sleeps waiting for a datagram before it re-checks `stop` and delays.
const POLL_MS: u64 = 2;
/// Most datagrams held at once under `Delay`.
const MAX_HELD_DATAGRAMS: usize = 100_000;

impl UdpProxy {
    pub fn start(target: SocketAddr) -> std::io::Result<UdpProxy> {
        let front = UdpSocket::bind("127.0.0.1:0")?;
        let back = UdpSocket::bind("127.0.0.1:0")?;
        back.connect(target)?;
        front.set_read_timeout(Some(Duration::from_millis(POLL_MS)))?;
        back.set_read_timeout(Some(Duration::from_millis(POLL_MS)))?;
        front.set_nonblocking(true)?;
        back.set_nonblocking(true)?;
        let listen = front.local_addr()?;
        let fault = Arc::new(Mutex::new(Fault::Pass));
        let counters = Arc::new(Counters::default());
        let stop = Arc::new(AtomicBool::new(false));
        let (f, c, s) = (Arc::clone(&fault), Arc::clone(&counters), Arc::clone(&stop));
        let thread =
            std::thread::Builder::new().name("udp-fault-proxy".into()).spawn(move || pump(front, back, f, c, s))?;
        Ok(UdpProxy { listen, target, fault, counters, stop, thread: Some(thread) })
    }

    pub fn set(&self, fault: Fault) {
        *self.fault.lock().unwrap() = fault;
    }
}

impl Drop for UdpProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn pump(front: UdpSocket, back: UdpSocket, fault: Arc<Mutex<Fault>>, counters: Arc<Counters>, stop: Arc<AtomicBool>) {
    let mut client: Option<SocketAddr> = None;
    let mut held: std::collections::VecDeque<(Instant, bool, Vec<u8>)> = Default::default();
    let mut buf = vec![0u8; 65_536];
    while !stop.load(Ordering::SeqCst) {
        let mut idle = true;
        // Client → target.
        while let Ok((n, from)) = front.recv_from(&mut buf) {
            idle = false;
            client = Some(from);
            handle(true, &buf[..n], &fault, &counters, &mut held);
        }
        // Target → client.
        while let Ok(n) = back.recv(&mut buf) {
            idle = false;
            handle(false, &buf[..n], &fault, &counters, &mut held);
        }
        let now = Instant::now();
        while held.front().is_some_and(|(due, _, _)| *due <= now) {
            let (_, to_target, data) = held.pop_front().expect("front");
            let _ = if to_target { back.send(&data) } else { client.map_or(Ok(0), |c| front.send_to(&data, c)) };
            counters.forwarded.fetch_add(1, Ordering::Relaxed);
        }
        if idle {
            std::thread::sleep(Duration::from_millis(POLL_MS.min(1)));
        }
    }
}

fn handle(
    to_target: bool,
    data: &[u8],
    fault: &Mutex<Fault>,
    counters: &Counters,
    held: &mut std::collections::VecDeque<(Instant, bool, Vec<u8>)>,
) {
    let f = *fault.lock().unwrap();
    let mut data = data.to_vec();
    let delay = match f {
        Fault::BlackHole => {
            counters.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        Fault::Corrupt => {
            if !data.is_empty() {
                let i = data.len() / 2;
                data[i] ^= 0x5a;
                counters.corrupted.fetch_add(1, Ordering::Relaxed);
            }
            Duration::ZERO
        }
        Fault::Delay(d) => d,
        Fault::Pass => Duration::ZERO,
    };
    if held.len() >= MAX_HELD_DATAGRAMS {
        counters.dropped.fetch_add(1, Ordering::Relaxed);
        return;
    }
    held.push_back((Instant::now() + delay, to_target, data));
}

/// Loopback UDP ports bound on this host (from /proc/net/udp), to tell a port from other bytes.
fn bound_udp_ports() -> Vec<u16> {
    let text = std::fs::read_to_string("/proc/net/udp").unwrap_or_default();
    text.lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().nth(1))
        .filter_map(|local| local.split_once(':'))
        .filter_map(|(_, port)| u16::from_str_radix(port, 16).ok())
        .collect()
}

/// Where the endpoint names a loopback IPv4 UDP address: (offset of the port bytes, little endian?, port).
pub fn find_loopback_udp(endpoint: &[u8]) -> Option<(usize, bool, u16)> {
    let bound = bound_udp_ports();
    let pattern = [127u8, 0, 0, 1];
    (0..endpoint.len().saturating_sub(5)).find_map(|i| {
        if endpoint[i..i + 4] != pattern {
            return None;
        }
        let (a, b) = (endpoint[i + 4], endpoint[i + 5]);
        let le = u16::from_le_bytes([a, b]);
        let be = u16::from_be_bytes([a, b]);
        if bound.contains(&le) {
            Some((i + 4, true, le))
        } else if bound.contains(&be) {
            Some((i + 4, false, be))
        } else {
            None
        }
    })
}

/// The endpoint with its port replaced by `port` (same byte order).
pub fn rewrite_port(endpoint: &[u8], at: usize, little_endian: bool, port: u16) -> Vec<u8> {
    let mut out = endpoint.to_vec();
    let bytes = if little_endian { port.to_le_bytes() } else { port.to_be_bytes() };
    out[at..at + 2].copy_from_slice(&bytes);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forwards_drops_and_corrupts() {
        let server = UdpSocket::bind("127.0.0.1:0").unwrap();
        server.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
        let proxy = UdpProxy::start(server.local_addr().unwrap()).unwrap();
        let client = UdpSocket::bind("127.0.0.1:0").unwrap();
        let mut buf = [0u8; 16];
        client.send_to(b"hello", proxy.listen).unwrap();
        let n = server.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"hello");
        proxy.set(Fault::Corrupt);
        client.send_to(b"hello", proxy.listen).unwrap();
        let n = server.recv(&mut buf).unwrap();
        assert_ne!(&buf[..n], b"hello");
        proxy.set(Fault::BlackHole);
        client.send_to(b"hello", proxy.listen).unwrap();
        assert!(server.recv(&mut buf).is_err());
        assert_eq!(proxy.counters.dropped.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn finds_a_bound_loopback_port_in_either_byte_order() {
        let s = UdpSocket::bind("127.0.0.1:0").unwrap();
        let port = s.local_addr().unwrap().port();
        let mut ep = vec![9, 9, 4, 127, 0, 0, 1];
        ep.extend_from_slice(&port.to_le_bytes());
        assert_eq!(find_loopback_udp(&ep), Some((7, true, port)));
        let moved = rewrite_port(&ep, 7, true, 4242);
        assert_eq!(&moved[7..9], &4242u16.to_le_bytes());
        assert_eq!(find_loopback_udp(b"kvgate-refplugin-1-0"), None);
    }
}
