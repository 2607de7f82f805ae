//! Test scaffolding: two plugin instances in one process over loopback, event collectors, host buffers.
#![allow(dead_code)]

use kvgate_abi::sdk::{sink_from_fn, Plugin, Sink};
use kvgate_abi::{
    Event, EventKind, IncomingRequest, LocalKey, LocalRange, MemoryKind, PeerId, ReasonCode, RegionDesc, RemoteKey,
    Segment, Stats, SubmitRequest, Ticket, XferId,
};
use kvgate_plugin_quic::{QuicConfig, QuicPlugin};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Every event one instance delivered, in order.
#[derive(Default)]
pub struct Events {
    list: Mutex<Vec<Event>>,
    changed: Condvar,
}

impl Events {
    pub fn push(&self, e: Event) {
        self.list.lock().unwrap().push(e);
        self.changed.notify_all();
    }
    pub fn all(&self) -> Vec<Event> {
        self.list.lock().unwrap().clone()
    }
    /// Wait until an event matches, or panic with every event seen.
    pub fn wait_for(&self, what: &str, within: Duration, pred: impl Fn(&Event) -> bool) -> Event {
        self.try_wait_for(within, pred)
            .unwrap_or_else(|| panic!("no event `{what}` within {within:?}; events: {:#?}", self.all()))
    }
    /// Wait until an event matches; `None` once `within` passed without one.
    pub fn try_wait_for(&self, within: Duration, pred: impl Fn(&Event) -> bool) -> Option<Event> {
        let deadline = Instant::now() + within;
        let mut list = self.list.lock().unwrap();
        loop {
            if let Some(e) = list.iter().find(|e| pred(e)) {
                return Some(e.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            list = self.changed.wait_timeout(list, deadline - now).unwrap().0;
        }
    }
    /// The outgoing events of one transfer.
    pub fn of_xfer(&self, xfer: XferId) -> Vec<Event> {
        self.all()
            .into_iter()
            .filter(|e| !e.is_incoming() && e.xfer == xfer && e.kind != EventKind::PEER_DOWN)
            .collect()
    }
    /// Wait for the terminal event of `xfer`.
    pub fn terminal(&self, xfer: XferId, within: Duration) -> Event {
        self.wait_for("terminal", within, |e| e.xfer == xfer && e.is_terminal())
    }
    /// Wait until `xfer` is quiesced (a QUIESCED event, or the flag on its failure, or success).
    pub fn quiesced(&self, xfer: XferId, within: Duration) -> Event {
        self.wait_for("quiesced", within, |e| {
            !e.is_incoming()
                && e.xfer == xfer
                && (e.kind == EventKind::QUIESCED
                    || e.kind == EventKind::SUCCEEDED
                    || (e.kind == EventKind::FAILED && e.flags & kvgate_abi::event_flags::QUIESCED != 0))
        })
    }
}

pub struct Node {
    pub plugin: QuicPlugin,
    pub events: Arc<Events>,
}

pub fn open(config: QuicConfig) -> Node {
    let events = Arc::new(Events::default());
    let e = events.clone();
    let sink = Sink::new(sink_from_fn(move |ev| e.push(ev)));
    let plugin = QuicPlugin::open(config, sink).expect("open quic plugin");
    Node { plugin, events }
}

pub const PEER_A: PeerId = PeerId(1);
pub const PEER_B: PeerId = PeerId(2);

/// Two instances that know each other: `a` sees `b` as PEER_B, `b` sees `a` as PEER_A.
pub fn pair(config: QuicConfig) -> (Node, Node) {
    pair_with(config.clone(), config)
}

pub fn pair_with(config_a: QuicConfig, config_b: QuicConfig) -> (Node, Node) {
    let a = open(config_a);
    let b = open(config_b);
    a.plugin.connect(PEER_B, &b.plugin.local_endpoint()).unwrap();
    b.plugin.connect(PEER_A, &a.plugin.local_endpoint()).unwrap();
    (a, b)
}

/// Host memory that stays put while registered; the plugin writes it from its own threads, so the
/// test only touches it through raw copies.
pub struct Buffer {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer owns its heap bytes; the plugin writes them from its threads and the test only
// reads them through raw copies once a transfer ended.
unsafe impl Send for Buffer {}
// SAFETY: as for Send.
unsafe impl Sync for Buffer {}

impl Buffer {
    pub fn zeroed(len: usize) -> Buffer {
        let boxed = vec![0u8; len.max(1)].into_boxed_slice();
        Buffer { ptr: Box::into_raw(boxed) as *mut u8, len }
    }
    /// Random bytes: fully random up to 8 MiB; past that a random 1 MiB tile repeats (big buffers only
    /// serve to keep a transfer busy, and filling them byte by byte is slow in debug builds).
    pub fn random(len: usize, seed: u64) -> Buffer {
        const FULLY_RANDOM_BYTES: usize = 8 << 20;
        const TILE_BYTES: usize = 1 << 20;
        let b = Buffer::zeroed(len);
        let mut data = vec![0u8; len.min(FULLY_RANDOM_BYTES)];
        if len > FULLY_RANDOM_BYTES {
            data.truncate(TILE_BYTES);
        }
        fill_random(&mut data, seed);
        let mut offset = 0;
        while offset < len {
            let n = data.len().min(len - offset);
            b.write(offset, &data[..n]);
            offset += n;
        }
        b
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn desc(&self) -> RegionDesc {
        RegionDesc {
            kind: MemoryKind::HOST,
            device: -1,
            addr: self.ptr as u64,
            len: self.len as u64,
            ..Default::default()
        }
    }
    pub fn write(&self, offset: usize, data: &[u8]) {
        assert!(offset + data.len() <= self.len);
        // SAFETY: the range is inside the buffer (asserted above), which this value owns.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(offset), data.len()) }
    }
    pub fn snapshot(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.len];
        // SAFETY: `self.len` bytes are readable at `self.ptr` (owned) and writable in `out`.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr, out.as_mut_ptr(), self.len) }
        out
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from a leaked boxed slice of `len.max(1)` bytes, freed once, here.
        unsafe { drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len.max(1)))) }
    }
}

pub fn fill_random(out: &mut [u8], seed: u64) {
    let mut x = seed | 1;
    for chunk in out.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}

/// FNV-1a 64 over a byte range.
pub fn checksum(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ *b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// A registered source on `from` and destination on `to` (imported into `from`).
pub struct Route {
    pub src_key: LocalKey,
    pub dst_key: LocalKey,
    pub remote: RemoteKey,
}

pub fn route(from: &Node, from_peer_of_to: PeerId, to: &Node, src: &Buffer, dst: &Buffer) -> Route {
    let src_reg = from.plugin.register(&src.desc()).unwrap();
    let dst_reg = to.plugin.register(&dst.desc()).unwrap();
    let remote = from.plugin.import_remote_key(from_peer_of_to, &dst_reg.remote_key).unwrap();
    Route { src_key: src_reg.key, dst_key: dst_reg.key, remote }
}

pub fn expect(to: &Node, from_peer: PeerId, ticket: Ticket, ranges: &[LocalRange], timeout: Duration) {
    to.plugin
        .expect_incoming(&IncomingRequest {
            ticket,
            peer: from_peer,
            timeout_ns: timeout.as_nanos() as u64,
            ranges: ranges.into(),
        })
        .unwrap();
}

pub fn submit(
    from: &Node,
    to_peer: PeerId,
    xfer: XferId,
    ticket: Ticket,
    segments: &[Segment],
    timeout: Duration,
) -> Result<(), kvgate_abi::PluginError> {
    from.plugin.submit(&SubmitRequest {
        xfer,
        peer: to_peer,
        ticket,
        timeout_ns: timeout.as_nanos() as u64,
        segments: segments.into(),
    })
}

/// Wait until the stats' transfer and ticket counts return to zero.
pub fn wait_baseline(node: &Node, within: Duration) -> Stats {
    let deadline = Instant::now() + within;
    loop {
        let s = node.plugin.stats();
        if s.live_transfers == 0 && s.unquiesced_transfers == 0 && s.live_tickets == 0 {
            return s;
        }
        if Instant::now() >= deadline {
            panic!("stats not back to baseline within {within:?}: {s:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

pub fn assert_failed(e: &Event, reason: ReasonCode) {
    assert_eq!(e.kind, EventKind::FAILED, "expected a failure, got {e:?}");
    assert_eq!(e.reason, reason, "wrong reason: {e:?}");
    assert!(!e.message.is_empty(), "a failure carries a message: {e:?}");
}

/// A config for loopback tests: small timeouts so the failure tests run in seconds.
pub fn test_config() -> QuicConfig {
    QuicConfig { idle_timeout_ms: 1500, keep_alive_interval_ms: 200, connect_timeout_ms: 2000, ..QuicConfig::default() }
}

/// A config whose transfers crawl (tiny windows), so a test can act mid-transfer.
pub fn slow_config() -> QuicConfig {
    QuicConfig {
        stream_window_bytes: 65536,
        connection_window_bytes: 65536,
        send_window_bytes: 65536,
        write_chunk_bytes: 4096,
        ..test_config()
    }
}

pub const WAIT: Duration = Duration::from_secs(20);
