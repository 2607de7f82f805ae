//! Test support: two UCX plugin instances in one process, an event log with bounded waits,
//! buffers with random bytes and checksums. Every wait here has a limit; nothing may hang.
#![allow(dead_code)]

use kvgate_abi::sdk::{sink_from_fn, Plugin, PluginFactory, Sink};
use kvgate_abi::*;
use kvgate_plugin_ucx::{UcxFactory, UcxPlugin};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Bytes as lowercase hex, for passing endpoints and keys between processes on a text line.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The bytes of `hex`'s text; panics on anything else (both ends are this crate's own code).
pub fn unhex(text: &str) -> Vec<u8> {
    assert!(text.len().is_multiple_of(2), "odd-length hex: {text:?}");
    (0..text.len()).step_by(2).map(|i| u8::from_str_radix(&text[i..i + 2], 16).expect("hex digits")).collect()
}

/// The most any single wait in these tests may take before the test fails.
pub const WAIT_LIMIT: Duration = Duration::from_secs(20);

#[derive(Default)]
pub struct EventLog {
    events: Mutex<Vec<Event>>,
    changed: Condvar,
}

impl EventLog {
    pub fn sink(self: &Arc<Self>) -> Sink {
        let log = self.clone();
        Sink::new(sink_from_fn(move |e| {
            log.events.lock().unwrap_or_else(|p| p.into_inner()).push(e);
            log.changed.notify_all();
        }))
    }

    /// Wait (at most `limit`) for an event matching `pred`; returns it or panics with the log.
    pub fn wait_for(&self, limit: Duration, what: &str, pred: impl Fn(&Event) -> bool) -> Event {
        let until = Instant::now() + limit;
        let mut events = self.events.lock().unwrap();
        loop {
            if let Some(e) = events.iter().find(|e| pred(e)) {
                return e.clone();
            }
            let now = Instant::now();
            if now >= until {
                let log = format!("{:#?}", *events);
                drop(events);
                panic!("no event `{what}` within {limit:?}; log: {log}");
            }
            events = self.changed.wait_timeout(events, until - now).unwrap().0;
        }
    }

    pub fn terminal_of(&self, xfer: XferId, limit: Duration) -> Event {
        self.wait_for(limit, &format!("terminal of {xfer:?}"), |e| e.is_terminal() && e.xfer == xfer)
    }

    pub fn all(&self) -> Vec<Event> {
        self.events.lock().unwrap().clone()
    }

    pub fn count(&self, pred: impl Fn(&Event) -> bool) -> usize {
        self.events.lock().unwrap().iter().filter(|e| pred(e)).count()
    }
}

/// One plugin instance with its event log.
pub struct Side {
    pub plugin: UcxPlugin,
    pub log: Arc<EventLog>,
}

pub fn open(config: &str) -> Side {
    let log = Arc::new(EventLog::default());
    let plugin = UcxFactory::open(config, log.sink()).unwrap_or_else(|e| panic!("open({config:?}): {e}"));
    Side { plugin, log }
}

pub const PEER_A: PeerId = PeerId(101);
pub const PEER_B: PeerId = PeerId(202);

/// Sender A and receiver B, connected both ways (A knows B as `PEER_B`, B knows A as `PEER_A`).
pub fn pair(config: &str) -> (Side, Side) {
    let a = open(config);
    let b = open(config);
    a.plugin.connect(PEER_B, &b.plugin.local_endpoint()).unwrap();
    b.plugin.connect(PEER_A, &a.plugin.local_endpoint()).unwrap();
    (a, b)
}

/// A heap buffer with a stable address, registered with one side.
pub struct Buffer {
    pub bytes: Vec<u8>,
    pub key: LocalKey,
    pub remote_key_bytes: Vec<u8>,
}

pub fn region(bytes: &mut [u8]) -> RegionDesc {
    RegionDesc {
        kind: MemoryKind::HOST,
        device: -1,
        addr: bytes.as_mut_ptr() as u64,
        len: bytes.len() as u64,
        ..Default::default()
    }
}

pub fn buffer(side: &Side, len: usize, seed: u64) -> Buffer {
    let mut bytes = random_bytes(len, seed);
    let registration = side.plugin.register(&region(&mut bytes)).expect("register");
    Buffer { bytes, key: registration.key, remote_key_bytes: registration.remote_key.to_vec() }
}

pub fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

/// FNV-1a over a byte range.
pub fn checksum(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ *b as u64).wrapping_mul(0x100_0000_01b3))
}

pub fn submit(
    side: &Side,
    xfer: u64,
    peer: PeerId,
    ticket: u64,
    timeout: Duration,
    segments: &[Segment],
) -> Result<(), PluginError> {
    side.plugin.submit(&SubmitRequest {
        xfer: XferId(xfer),
        peer,
        ticket: Ticket(ticket),
        timeout_ns: timeout.as_nanos() as u64,
        segments: segments.into(),
    })
}

pub fn expect(side: &Side, ticket: u64, peer: PeerId, timeout: Duration, ranges: &[LocalRange]) {
    side.plugin
        .expect_incoming(&IncomingRequest {
            ticket: Ticket(ticket),
            peer,
            timeout_ns: timeout.as_nanos() as u64,
            ranges: ranges.into(),
        })
        .expect("expect_incoming");
}

/// Wait (bounded) until `stats` satisfies `pred`.
pub fn wait_stats(side: &Side, what: &str, pred: impl Fn(&Stats) -> bool) -> Stats {
    let until = Instant::now() + WAIT_LIMIT;
    loop {
        let s = side.plugin.stats();
        if pred(&s) {
            return s;
        }
        if Instant::now() >= until {
            panic!("stats never reached `{what}`: {s:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

pub fn tcp_config() -> String {
    "tls = \"tcp\"\ndevices = \"lo\"\n".to_string()
}

/// Shared memory with one-sided puts forced (UCX emulates them with active messages there).
pub fn sm_config() -> String {
    "tls = \"posix,sysv,cma\"\nmode = \"put\"\n".to_string()
}

/// Shared memory in `auto` mode, which is active messages there.
pub fn sm_am_config() -> String {
    "tls = \"posix,sysv,cma\"\n".to_string()
}

/// A UCX worker that never progresses: transfers to it stay live until cancelled or timed out.
pub struct FrozenPeer {
    pub endpoint: Vec<u8>,
    pub remote_key: Vec<u8>,
    pub target: Vec<u8>,
    _map: kvgate_plugin_ucx::ucp::MemMap,
    _worker: kvgate_plugin_ucx::ucp::Worker,
}

pub fn frozen_peer(config: &str, len: usize) -> FrozenPeer {
    use kvgate_plugin_ucx::{ucp, wire, UcxConfig};
    let parsed = UcxConfig::parse(config).unwrap();
    let mut ucx_config = ucp::Config::read().unwrap();
    for (name, value, _) in parsed.ucx_settings() {
        ucx_config.modify(&name, &value).unwrap();
    }
    let context = ucp::Context::new(&ucx_config).unwrap();
    let worker = ucp::Worker::new(&context).unwrap();
    let mut target = vec![0u8; len];
    let map = context.map(target.as_mut_ptr() as u64, len as u64).unwrap();
    let endpoint =
        wire::EndpointBytes { instance: 0xf00d, pid: 0, boot_id: [0; 16], worker_address: worker.address().unwrap() }
            .encode();
    let remote_key = wire::RemoteKeyBytes {
        owner_instance: 0xf00d,
        region: 1,
        addr: target.as_ptr() as u64,
        len: len as u64,
        packed_rkey: map.packed_rkey.clone(),
    }
    .encode();
    FrozenPeer { endpoint, remote_key, target, _map: map, _worker: worker }
}
