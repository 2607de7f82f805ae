//! The transfer state machine: issues each transfer's copies through a [`CopyBackend`] (a bounded
//! window per transfer), polls their fences, and produces exactly one terminal event per transfer
//! followed by QUIESCED once every issued copy finished. Owns transfer state; never sleeps, never
//! reads a clock (the worker passes `now`), never calls CUDA itself.

use crate::chunk_plan::CopyOp;
use kvgate_abi::{Event, PeerId, ReasonCode, XferId};
use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::time::Instant;

/// Which copy stream an op goes to: the engine spreads a transfer's chunks over the peer's lanes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Lane {
    pub peer: PeerId,
    pub device_index: usize,
    pub stream: u32,
}

/// Something that can run a copy asynchronously and tell when it finished (CUDA streams and
/// events in the plugin; host memcpy in the unit tests).
pub trait CopyBackend {
    /// A handle on one issued copy.
    type Fence;
    /// Enqueue `op` on `lane` and return a fence that completes with it.
    fn issue(&mut self, op: &CopyOp, lane: Lane) -> Result<Self::Fence, String>;
    /// `Ok(true)` once the copy finished, `Ok(false)` while it runs, `Err` if the device failed.
    fn poll(&mut self, fence: &Self::Fence) -> Result<bool, String>;
    /// Give back a fence that completed or failed.
    fn recycle(&mut self, fence: Self::Fence);
    /// Drop per-peer resources (streams) of a peer that went away; copies already queued finish.
    fn forget_peer(&mut self, _peer: PeerId) {}
}

/// A transfer as the engine receives it (already validated and planned).
pub struct NewTransfer {
    pub xfer: XferId,
    pub peer: PeerId,
    /// The plugin's own timeout; `None` if it overflows the clock (the host still enforces one).
    pub deadline: Option<Instant>,
    pub ops: Vec<CopyOp>,
    pub total_bytes: u64,
    /// Keeps the regions and mappings the copies touch alive until the transfer is quiesced.
    pub holds: Box<dyn Any + Send>,
}

struct Transfer<F> {
    new: NewTransfer,
    next_op: usize,
    inflight: VecDeque<F>,
    failure: Option<(ReasonCode, String)>,
    terminal_sent: bool,
    lane_cursor: u32,
}

/// Counters the plugin's `stats` reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineCounts {
    /// Not yet terminal.
    pub live: u64,
    /// Terminal (failed) with copies still on the device.
    pub unquiesced: u64,
    /// Copies issued and not yet finished, over all transfers.
    pub copies_in_flight: u64,
}

pub struct Engine<B: CopyBackend> {
    backend: B,
    transfers: HashMap<XferId, Transfer<B::Fence>>,
    max_copies_in_flight_per_transfer: usize,
    streams_per_peer: u32,
}

impl<B: CopyBackend> Engine<B> {
    pub fn new(backend: B, max_copies_in_flight_per_transfer: u32, streams_per_peer: u32) -> Self {
        assert!(max_copies_in_flight_per_transfer > 0 && streams_per_peer > 0, "validated at config load");
        Engine {
            backend,
            transfers: HashMap::new(),
            max_copies_in_flight_per_transfer: max_copies_in_flight_per_transfer as usize,
            streams_per_peer,
        }
    }

    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }

    /// Takes a new transfer. The caller guarantees the id is not live (it checks at submit).
    pub fn admit(&mut self, new: NewTransfer) {
        let xfer = new.xfer;
        let previous = self.transfers.insert(
            xfer,
            Transfer { new, next_op: 0, inflight: VecDeque::new(), failure: None, terminal_sent: false, lane_cursor: 0 },
        );
        assert!(previous.is_none(), "transfer {} admitted twice; submit checks live ids", xfer.0);
    }

    /// Stops a transfer: no further copy is issued; it fails with `reason` at the next step.
    /// Unknown, finished or already failing ids are ignored (first cause wins).
    pub fn fail(&mut self, xfer: XferId, reason: ReasonCode, message: impl Into<String>) {
        if let Some(t) = self.transfers.get_mut(&xfer) {
            if t.failure.is_none() && !t.terminal_sent {
                t.failure = Some((reason, message.into()));
            }
        }
    }

    /// Fails every transfer to `peer` (or every transfer, for `None`).
    pub fn fail_all(&mut self, peer: Option<PeerId>, reason: ReasonCode, message: &str) {
        let ids: Vec<XferId> =
            self.transfers.values().filter(|t| peer.is_none_or(|p| t.new.peer == p)).map(|t| t.new.xfer).collect();
        for id in ids {
            self.fail(id, reason, message);
        }
    }

    pub fn is_idle(&self) -> bool {
        self.transfers.is_empty()
    }

    /// The earliest own deadline of a live transfer.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.transfers.values().filter(|t| t.failure.is_none() && !t.terminal_sent).filter_map(|t| t.new.deadline).min()
    }

    pub fn counts(&self) -> EngineCounts {
        let mut c = EngineCounts::default();
        for t in self.transfers.values() {
            if t.terminal_sent {
                c.unquiesced += 1;
            } else {
                c.live += 1;
            }
            c.copies_in_flight += t.inflight.len() as u64;
        }
        c
    }

    /// Advances every transfer once: polls fences, applies deadlines, issues copies into free
    /// window slots, and appends the events to report. Returns the ids that left the engine
    /// (terminal and quiesced) and whether anything changed.
    pub fn step(&mut self, now: Instant, events: &mut Vec<Event>) -> (Vec<XferId>, bool) {
        let mut finished = Vec::new();
        let mut changed = false;
        let ids: Vec<XferId> = self.transfers.keys().copied().collect();
        for id in ids {
            let t = self.transfers.get_mut(&id).expect("id taken from the map");
            changed |= Self::poll_fences(&mut self.backend, t);
            if t.failure.is_none() && !t.terminal_sent && t.new.deadline.is_some_and(|d| now >= d) {
                t.failure = Some((ReasonCode::TIMEOUT, "nvlink: transfer timeout passed".into()));
            }
            if t.failure.is_none() {
                changed |= Self::issue_window(&mut self.backend, t, self.max_copies_in_flight_per_transfer, self.streams_per_peer);
            }
            if let Some(done) = Self::report(t, events) {
                changed = true;
                if done {
                    self.transfers.remove(&id);
                    finished.push(id);
                }
            }
        }
        (finished, changed)
    }

    /// Removes finished fences (in any order: chunks run on several streams). A device error
    /// fails the transfer; the errored copy counts as finished (the context is unusable after it).
    fn poll_fences(backend: &mut B, t: &mut Transfer<B::Fence>) -> bool {
        let mut changed = false;
        let mut i = 0;
        while i < t.inflight.len() {
            let outcome = backend.poll(&t.inflight[i]);
            if let Ok(false) = outcome {
                i += 1;
                continue;
            }
            let fence = t.inflight.remove(i).expect("index checked");
            backend.recycle(fence);
            changed = true;
            if let Err(e) = outcome {
                if t.failure.is_none() && !t.terminal_sent {
                    t.failure = Some((ReasonCode::TRANSPORT_ERROR, format!("nvlink: copy failed on the device: {e}")));
                }
            }
        }
        changed
    }

    fn issue_window(backend: &mut B, t: &mut Transfer<B::Fence>, window: usize, streams: u32) -> bool {
        let mut changed = false;
        while t.inflight.len() < window && t.next_op < t.new.ops.len() {
            let op = t.new.ops[t.next_op];
            let lane = Lane { peer: t.new.peer, device_index: op.device_index, stream: t.lane_cursor % streams };
            match backend.issue(&op, lane) {
                Ok(fence) => {
                    t.inflight.push_back(fence);
                    t.next_op += 1;
                    t.lane_cursor = t.lane_cursor.wrapping_add(1);
                    changed = true;
                }
                Err(e) => {
                    t.failure = Some((ReasonCode::TRANSPORT_ERROR, format!("nvlink: could not issue a copy: {e}")));
                    return true;
                }
            }
        }
        changed
    }

    /// Emits what the transfer's state calls for. `Some(true)`: the transfer is done and leaves;
    /// `Some(false)`: an event was emitted, the transfer stays; `None`: nothing to report.
    fn report(t: &mut Transfer<B::Fence>, events: &mut Vec<Event>) -> Option<bool> {
        let xfer = t.new.xfer;
        if let Some((reason, message)) = &t.failure {
            if !t.terminal_sent {
                t.terminal_sent = true;
                tracing::warn!(xfer = xfer.0, peer = t.new.peer.0, reason = %reason, copies_in_flight = t.inflight.len(), "{message}");
                if t.inflight.is_empty() {
                    events.push(Event::failed_quiesced(xfer, *reason, message.clone()));
                    return Some(true);
                }
                events.push(Event::failed(xfer, *reason, message.clone()));
                return Some(false);
            }
            if t.inflight.is_empty() {
                events.push(Event::quiesced(xfer));
                return Some(true);
            }
            return None;
        }
        if t.next_op == t.new.ops.len() && t.inflight.is_empty() {
            t.terminal_sent = true;
            events.push(Event::succeeded(xfer, t.new.total_bytes));
            return Some(true);
        }
        None
    }
}
