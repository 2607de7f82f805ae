//! The transfer state machine: issues each transfer's copies through a [`CopyBackend`] (a bounded
//! window per transfer) and polls their fences. Its transfers live in the SDK's ledger, which makes
//! exactly one terminal event per transfer and QUIESCED once every issued copy finished (each copy
//! on the device is a ledger hold). Never sleeps, never reads a clock (the worker passes `now`),
//! never calls CUDA itself.

use crate::chunk_plan::CopyOp;
use kvgate_abi::sdk::{Admission, TransferLedger};
use kvgate_abi::{event_flags, Event, EventKind, PeerId, ReasonCode, XferId};
use std::any::Any;
use std::collections::VecDeque;
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
    /// Copies on the device, each a ledger hold.
    inflight: VecDeque<F>,
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
    transfers: TransferLedger<Transfer<B::Fence>>,
    max_copies_in_flight_per_transfer: usize,
    streams_per_peer: u32,
}

impl<B: CopyBackend> Engine<B> {
    pub fn new(backend: B, max_copies_in_flight_per_transfer: u32, streams_per_peer: u32) -> Self {
        assert!(max_copies_in_flight_per_transfer > 0 && streams_per_peer > 0, "validated at config load");
        Engine {
            backend,
            transfers: TransferLedger::new(),
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
        let admission = Admission { peer: new.peer, total_bytes: new.total_bytes, deadline: new.deadline };
        let admitted = self.transfers.admit(
            xfer,
            admission,
            Transfer { new, next_op: 0, inflight: VecDeque::new(), lane_cursor: 0 },
        );
        assert!(admitted.is_ok(), "transfer {} admitted twice; submit checks live ids", xfer.0);
    }

    /// Stops a transfer: no further copy is issued; `FAILED` is reported at the next step (with
    /// the quiesced flag when no copy of it is on the device). Unknown, finished or already failed
    /// ids are ignored (first cause wins).
    // CONFORMANCE: ABORT-1, ABORT-2, ABORT-3, RES-1, OBS-1 (ends a live transfer at once, with a reason; other ids ignored)
    pub fn fail(&mut self, xfer: XferId, reason: ReasonCode, message: impl Into<String>) {
        let message = message.into();
        let (peer, copies_in_flight) = match self.transfers.entry(xfer) {
            Some(e) if e.is_live() => (e.peer(), e.holds()),
            _ => return,
        };
        tracing::warn!(xfer = xfer.0, peer = peer.0, reason = %reason, copies_in_flight, "{message}");
        self.transfers.fail(xfer, reason, message);
    }

    /// Fails every transfer to `peer` (or every transfer, for `None`).
    // CONFORMANCE: TIME-3, ABORT-4 (a lost peer fails its transfers at once; a cancel is one map lookup)
    pub fn fail_all(&mut self, peer: Option<PeerId>, reason: ReasonCode, message: &str) {
        let ids: Vec<XferId> = self
            .transfers
            .iter()
            .filter(|(_, e)| e.is_live() && peer.is_none_or(|p| e.peer() == p))
            .map(|(x, _)| x)
            .collect();
        for id in ids {
            self.fail(id, reason, message);
        }
    }

    pub fn is_idle(&self) -> bool {
        self.transfers.is_empty() && !self.transfers.has_events()
    }

    /// The earliest own deadline of a live transfer.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.transfers.iter().filter(|(_, e)| e.is_live()).filter_map(|(_, e)| e.deadline()).min()
    }

    pub fn counts(&self) -> EngineCounts {
        EngineCounts {
            live: self.transfers.live_transfers(),
            unquiesced: self.transfers.unquiesced_transfers(),
            copies_in_flight: self.transfers.iter().map(|(_, e)| e.data.inflight.len() as u64).sum(),
        }
    }

    /// Advances every transfer once: applies deadlines, polls fences, issues copies into free
    /// window slots, and appends the events to report. Returns the ids that left the engine
    /// (terminal and quiesced) and whether anything changed.
    // CONFORMANCE: TIME-1, TIME-2, TIME-4, DATA-1, RES-3 (own deadline; SUCCEEDED only once every copy finished)
    pub fn step(&mut self, now: Instant, events: &mut Vec<Event>) -> (Vec<XferId>, bool) {
        let mut changed = false;
        let timed_out = self.transfers.expire(now, |_, _| "nvlink: transfer timeout passed".into()).timed_out;
        for xfer in timed_out {
            tracing::warn!(xfer = xfer.0, reason = %ReasonCode::TIMEOUT, "nvlink: transfer timeout passed");
        }
        let ids: Vec<XferId> = self.transfers.iter().map(|(x, _)| x).collect();
        for id in ids {
            changed |= self.poll_fences(id);
            if self.transfers.is_live(id) {
                changed |= self.issue_window(id);
            }
            let done = self.transfers.get(id).is_some_and(|t| t.next_op == t.new.ops.len() && t.inflight.is_empty());
            if done && self.transfers.is_live(id) {
                self.transfers.succeed(id);
            }
        }
        let mut finished = Vec::new();
        for event in self.transfers.take_events() {
            changed = true;
            let quiesced = event.flags & event_flags::QUIESCED != 0;
            if event.kind == EventKind::SUCCEEDED || event.kind == EventKind::QUIESCED || quiesced {
                finished.push(event.xfer);
            }
            events.push(event);
        }
        (finished, changed)
    }

    /// Removes finished fences (in any order: chunks run on several streams). A device error
    /// fails the transfer; the errored copy counts as finished (the context is unusable after it).
    fn poll_fences(&mut self, id: XferId) -> bool {
        let Some(t) = self.transfers.get_mut(id) else { return false };
        let backend = &mut self.backend;
        let mut finished = 0;
        let mut error = None;
        let mut i = 0;
        while i < t.inflight.len() {
            let outcome = backend.poll(&t.inflight[i]);
            if let Ok(false) = outcome {
                i += 1;
                continue;
            }
            let fence = t.inflight.remove(i).expect("index checked");
            backend.recycle(fence);
            finished += 1;
            if let Err(e) = outcome {
                error.get_or_insert(e);
            }
        }
        if let Some(e) = error {
            self.fail(id, ReasonCode::TRANSPORT_ERROR, format!("nvlink: copy failed on the device: {e}"));
        }
        for _ in 0..finished {
            self.transfers.release(id);
        }
        finished > 0
    }

    fn issue_window(&mut self, id: XferId) -> bool {
        let (window, streams) = (self.max_copies_in_flight_per_transfer, self.streams_per_peer);
        let mut changed = false;
        let mut issue_error = None;
        {
            let Some(t) = self.transfers.get_mut(id) else { return false };
            let mut issued = 0;
            while t.inflight.len() < window && t.next_op < t.new.ops.len() {
                let op = t.new.ops[t.next_op];
                let lane = Lane { peer: t.new.peer, device_index: op.device_index, stream: t.lane_cursor % streams };
                match self.backend.issue(&op, lane) {
                    Ok(fence) => {
                        t.inflight.push_back(fence);
                        t.next_op += 1;
                        t.lane_cursor = t.lane_cursor.wrapping_add(1);
                        issued += 1;
                        changed = true;
                    }
                    Err(e) => {
                        issue_error = Some(e);
                        changed = true;
                        break;
                    }
                }
            }
            for _ in 0..issued {
                self.transfers.hold(id);
            }
        }
        if let Some(e) = issue_error {
            self.fail(id, ReasonCode::TRANSPORT_ERROR, format!("nvlink: could not issue a copy: {e}"));
        }
        changed
    }
}
