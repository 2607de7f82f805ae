//! Test kit for the shm plugin: instances opened through the ABI module (the same path a host takes),
//! an event recorder that checks the one-terminal rule, shared regions, and a seeded data generator.
#![allow(dead_code)]

use kvgate_abi::abi_stable::std_types::{RResult, RSlice, RStr};
use kvgate_abi::sdk::sink_from_fn;
use kvgate_abi::{
    Event, EventKind, LocalKey, PeerId, PluginError, RemoteKey, Segment, SubmitRequest, Ticket, TransportBox, XferId,
};
use kvgate_plugin_shm::SharedRegion;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Long enough for any copy in these tests on a loaded 2-core machine; a test that waits this
/// long has failed.
pub const WAIT: Duration = Duration::from_secs(60);
/// Transfer timeout used when a test does not test timeouts.
pub const NO_TIMEOUT_NS: u64 = 600_000_000_000;

pub fn ok<T>(r: RResult<T, PluginError>) -> T {
    r.into_result().unwrap_or_else(|e| panic!("plugin call failed: {e}"))
}

pub fn err<T: std::fmt::Debug>(r: RResult<T, PluginError>) -> PluginError {
    match r.into_result() {
        Ok(v) => panic!("expected an error, got Ok({v:?})"),
        Err(e) => e,
    }
}

#[derive(Default)]
struct Log {
    all: Vec<Event>,
    by_xfer: std::collections::HashMap<XferId, Vec<Event>>,
}

/// Every event an instance delivered, in order (and indexed by outgoing transfer).
#[derive(Default)]
pub struct Recorder {
    log: Mutex<Log>,
    changed: Condvar,
    /// While true, `deliver` blocks: the delivering plugin thread stalls, deterministically.
    held: Mutex<bool>,
    released: Condvar,
}

fn is_quiesced_by(e: &Event) -> bool {
    e.kind == EventKind::SUCCEEDED
        || e.kind == EventKind::QUIESCED
        || (e.kind == EventKind::FAILED && e.flags & kvgate_abi::event_flags::QUIESCED != 0)
}

impl Recorder {
    /// Make the next delivery block until [`Recorder::release`].
    pub fn hold(&self) {
        *self.held.lock().unwrap() = true;
    }
    pub fn release(&self) {
        *self.held.lock().unwrap() = false;
        self.released.notify_all();
    }
    fn record(&self, e: Event) {
        {
            let mut log = self.log.lock().unwrap();
            if !e.is_incoming() {
                log.by_xfer.entry(e.xfer).or_default().push(e.clone());
            }
            log.all.push(e);
        }
        self.changed.notify_all();
        let mut held = self.held.lock().unwrap();
        while *held {
            held = self.released.wait(held).unwrap();
        }
    }
    /// A sink that records into this recorder.
    pub fn sink(self: &Arc<Self>) -> kvgate_abi::EventSinkBox {
        let recorder = Arc::clone(self);
        sink_from_fn(move |e| recorder.record(e))
    }
    /// Wait until `n` events were delivered in all.
    pub fn wait_count(&self, n: usize) {
        self.wait_until(&format!("{n} events"), |log| log.all.len() >= n);
    }
    pub fn all(&self) -> Vec<Event> {
        self.log.lock().unwrap().all.clone()
    }
    /// The events of one outgoing transfer, in order.
    pub fn of(&self, xfer: XferId) -> Vec<Event> {
        self.log.lock().unwrap().by_xfer.get(&xfer).cloned().unwrap_or_default()
    }
    fn wait_until(&self, what: &str, done: impl Fn(&Log) -> bool) {
        let deadline = Instant::now() + WAIT;
        let mut log = self.log.lock().unwrap();
        while !done(&log) {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "timed out waiting for {what}; events: {:?}", log.all);
            log = self.changed.wait_timeout(log, left).unwrap().0;
        }
    }
    /// Wait for the transfer's terminal event and return it.
    pub fn terminal(&self, xfer: XferId) -> Event {
        self.wait_until(&format!("terminal event of {xfer:?}"), |log| {
            log.by_xfer.get(&xfer).is_some_and(|es| es.iter().any(Event::is_terminal))
        });
        self.of(xfer).into_iter().find(Event::is_terminal).unwrap()
    }
    /// Wait until the transfer is terminal and quiesced; check the event sequence is legal:
    /// exactly one terminal, then (for a failure without the flag) exactly one `QUIESCED`.
    pub fn settled(&self, xfer: XferId) -> Event {
        self.wait_until(&format!("{xfer:?} quiesced"), |log| {
            log.by_xfer.get(&xfer).is_some_and(|es| es.iter().any(is_quiesced_by))
        });
        let events = self.of(xfer);
        let terminals: Vec<&Event> = events.iter().filter(|e| e.is_terminal()).collect();
        assert_eq!(terminals.len(), 1, "exactly one terminal event: {events:?}");
        let quiesced = events.iter().filter(|e| e.kind == EventKind::QUIESCED).count();
        let flagged =
            terminals[0].kind == EventKind::SUCCEEDED || terminals[0].flags & kvgate_abi::event_flags::QUIESCED != 0;
        assert_eq!(quiesced, usize::from(!flagged), "one QUIESCED unless the terminal implies it: {events:?}");
        if quiesced == 1 {
            let t = events.iter().position(|e| e.is_terminal()).unwrap();
            let q = events.iter().position(|e| e.kind == EventKind::QUIESCED).unwrap();
            assert!(t < q, "QUIESCED after the terminal event: {events:?}");
        }
        terminals[0].clone()
    }
}

/// One shm instance opened through the ABI module, with its recorder.
pub struct Instance {
    pub transport: TransportBox,
    pub events: Arc<Recorder>,
}

impl Instance {
    pub fn open(config: &str) -> Instance {
        Self::try_open(config).unwrap_or_else(|e| panic!("open failed: {e}"))
    }
    pub fn try_open(config: &str) -> Result<Instance, PluginError> {
        let events = Arc::new(Recorder::default());
        let sink = events.sink();
        let module = kvgate_plugin_shm::module();
        let transport = (module.open())(RStr::from_str(config), sink).into_result()?;
        Ok(Instance { transport, events })
    }
    pub fn stats(&self) -> kvgate_abi::Stats {
        self.transport.stats()
    }
}

/// Two instances in one process acting as two gateways, connected both ways.
pub struct Pair {
    pub sender: Instance,
    pub receiver: Instance,
}

pub const RECEIVER: PeerId = PeerId(2);
pub const SENDER: PeerId = PeerId(1);

impl Pair {
    pub fn new(sender_config: &str) -> Pair {
        let pair = Pair { sender: Instance::open(sender_config), receiver: Instance::open("") };
        let to_receiver = pair.receiver.transport.local_endpoint();
        ok(pair.sender.transport.connect(RECEIVER, RSlice::from_slice(&to_receiver)));
        let to_sender = pair.sender.transport.local_endpoint();
        ok(pair.receiver.transport.connect(SENDER, RSlice::from_slice(&to_sender)));
        pair
    }

    /// Register `src` with the sender and `dst` with the receiver; import `dst`'s key at the sender.
    pub fn regions(&self, src: &SharedRegion, dst: &SharedRegion) -> (LocalKey, LocalKey, RemoteKey) {
        let local = ok(self.sender.transport.register(&src.desc()));
        let dest = ok(self.receiver.transport.register(&dst.desc()));
        let remote = ok(self.sender.transport.import_remote_key(RECEIVER, RSlice::from_slice(&dest.remote_key)));
        (local.key, dest.key, remote)
    }

    pub fn submit(&self, xfer: u64, timeout_ns: u64, segments: &[Segment]) -> RResult<(), PluginError> {
        self.sender.transport.submit(request(xfer, timeout_ns, segments))
    }
}

pub fn request(xfer: u64, timeout_ns: u64, segments: &[Segment]) -> SubmitRequest<'_> {
    SubmitRequest {
        xfer: XferId(xfer),
        peer: RECEIVER,
        ticket: Ticket(xfer),
        timeout_ns,
        segments: RSlice::from_slice(segments),
    }
}

pub fn segment(local: LocalKey, local_offset: u64, remote: RemoteKey, remote_offset: u64, len: u64) -> Segment {
    Segment { local, local_offset, remote, remote_offset, len }
}

pub fn region(len: usize) -> SharedRegion {
    SharedRegion::memfd(len).expect("memfd region")
}

/// Deterministic bytes from a seed (xorshift64*), printed by the caller for replay.
pub fn fill(bytes: &mut [u8], seed: u64) {
    let mut x = seed | 1;
    for chunk in bytes.chunks_mut(8) {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let v = x.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}

/// An FNV-1a-style 64-bit checksum over 8-byte words (position-sensitive, fast even in debug builds).
pub fn checksum(bytes: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ bytes.len() as u64;
    let mut words = bytes.chunks_exact(8);
    for w in &mut words {
        h = (h ^ u64::from_le_bytes(w.try_into().unwrap())).wrapping_mul(0x0100_0000_01b3).rotate_left(29);
    }
    for &b in words.remainder() {
        h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
    }
    h
}
