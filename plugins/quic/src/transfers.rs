//! Outgoing transfers and their one declared lifecycle, kept in the SDK's ledger: Live → Terminal
//! (succeeded or failed) → Closed once every lane settled (the receiver acknowledged, or the
//! connection is gone). Each lane handed a part is a ledger hold, so the ledger gives each transfer
//! exactly one terminal event, then at most one QUIESCED, never any after Closed; this module adds
//! the lanes' success count, the stop signal lanes watch, and the ids of closed transfers.

use kvgate_abi::sdk::{Admission, OrderedDelivery, Sink, TransferLedger};
use kvgate_abi::{PeerId, ReasonCode, XferId};
use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;
use tokio::sync::watch;

/// One outgoing transfer.
pub struct Transfer {
    pub xfer: XferId,
    pub peer: PeerId,
    pub total_bytes: u64,
    /// Becomes true at the terminal transition; lanes stop writing, the timer stops.
    stop: watch::Sender<bool>,
    table: Arc<Transfers>,
}

/// The ledger's record of a transfer besides its phase and holds (one per unsettled lane).
struct Books {
    t: Arc<Transfer>,
    lanes_done: usize,
    lane_count: usize,
    /// For the timeout's message (set with the deadline).
    timeout_ms: u128,
}

impl Transfer {
    /// The table the transfer is kept in.
    pub fn table(&self) -> &Arc<Transfers> {
        &self.table
    }

    pub fn stop_signal(&self) -> watch::Receiver<bool> {
        self.stop.subscribe()
    }

    /// Whether the transfer was stopped (terminal): parts not yet sent are skipped, parts being sent end
    /// with PART_ABORT.
    pub fn is_stopped(&self) -> bool {
        *self.stop.borrow()
    }

    /// Reserve one part before handing it to a lane (a ledger hold); false once the transfer is terminal.
    pub fn lane_opening(&self) -> bool {
        self.table.ledger().hold(self.xfer)
    }

    /// Fail the transfer (first cause wins). Reported every time it happens.
    // CONFORMANCE: OBS-1 (a reason code and a message, logged each time)
    // CONFORMANCE: ABORT-1, ABORT-2, RES-1, RES-3 (FAILED at once, lanes stop; QUIESCED once every lane settled)
    pub fn fail(&self, reason: ReasonCode, message: impl Into<String>) {
        let message = message.into();
        let mut ledger = self.table.ledger();
        if !ledger.is_live(self.xfer) {
            return;
        }
        tracing::warn!(xfer = self.xfer.0, peer = self.peer.0, reason = %reason, %message, "quic transfer failed");
        ledger.fail(self.xfer, reason, message);
        self.table.note_if_closed(&ledger, self.xfer);
        drop(ledger);
        self.stop.send_replace(true);
        self.table.flush();
    }

    /// A lane's receiver confirmed every byte of the lane.
    // CONFORMANCE: DATA-1 (SUCCEEDED only once every lane's receiver confirmed its bytes)
    pub fn lane_done(&self) {
        let mut ledger = self.table.ledger();
        let all_done = match ledger.get_mut(self.xfer) {
            Some(b) => {
                b.lanes_done += 1;
                b.lanes_done == b.lane_count
            }
            None => false,
        };
        let live = ledger.is_live(self.xfer);
        ledger.release(self.xfer);
        let succeeded = all_done && live && ledger.succeed(self.xfer);
        self.table.note_if_closed(&ledger, self.xfer);
        drop(ledger);
        if succeeded {
            self.stop.send_replace(true);
        }
        self.table.flush();
    }

    /// A lane ended without success, and its receiver can no longer write (it acknowledged, refused,
    /// or the connection is gone).
    pub fn lane_settled(&self) {
        let mut ledger = self.table.ledger();
        ledger.release(self.xfer);
        self.table.note_if_closed(&ledger, self.xfer);
        drop(ledger);
        self.table.flush();
    }
}

/// How many closed transfer ids are remembered so that a reused id is refused (`DUPLICATE_ID`) instead
/// of starting a second life whose events the host would take for the first one's. Ids are unique per
/// instance by contract; this bounds the memory spent checking it.
pub const REMEMBERED_CLOSED_IDS: usize = 65536;

/// Closed ids, oldest first, bounded by [`REMEMBERED_CLOSED_IDS`].
#[derive(Default)]
struct ClosedIds {
    set: HashSet<XferId>,
    order: VecDeque<XferId>,
}

impl ClosedIds {
    fn remember(&mut self, xfer: XferId) {
        if self.set.insert(xfer) {
            self.order.push_back(xfer);
            if self.order.len() > REMEMBERED_CLOSED_IDS {
                if let Some(old) = self.order.pop_front() {
                    self.set.remove(&old);
                }
            }
        }
    }
}

/// Every transfer not yet closed.
pub struct Transfers {
    ledger: Mutex<TransferLedger<Books>>,
    closed: Mutex<ClosedIds>,
    delivery: OrderedDelivery,
    sink: Sink,
}

impl Transfers {
    pub fn new(sink: Sink) -> Arc<Transfers> {
        Arc::new(Transfers {
            ledger: Mutex::new(TransferLedger::new()),
            closed: Mutex::new(ClosedIds::default()),
            delivery: OrderedDelivery::new(),
            sink,
        })
    }

    fn ledger(&self) -> MutexGuard<'_, TransferLedger<Books>> {
        self.ledger.lock().expect("transfers lock")
    }

    /// Remember `xfer` once it has left the ledger (so its id is never reused).
    fn note_if_closed(&self, ledger: &TransferLedger<Books>, xfer: XferId) {
        if !ledger.contains(xfer) {
            self.closed.lock().expect("closed ids lock").remember(xfer);
        }
    }

    /// Deliver what the ledger decided, in order, outside its lock.
    fn flush(&self) {
        self.delivery.flush(|| self.ledger().has_events(), || self.ledger().take_events(), |e| self.sink.deliver(e));
    }

    /// Admit a transfer of `lane_count` lanes, or refuse it (`DUPLICATE_ID`, `RESOURCE_EXHAUSTED`).
    // CONFORMANCE: DATA-3, TIME-11 (a live or reused id refused; max_inflight_transfers bounds the table)
    pub fn admit(
        self: &Arc<Self>,
        xfer: XferId,
        peer: PeerId,
        total_bytes: u64,
        lane_count: usize,
        max_inflight: u64,
    ) -> Result<Arc<Transfer>, kvgate_abi::PluginError> {
        let mut ledger = self.ledger();
        if ledger.contains(xfer) {
            return Err(kvgate_abi::PluginError::new(
                ReasonCode::DUPLICATE_ID,
                format!("transfer {} is already live", xfer.0),
            ));
        }
        if self.closed.lock().expect("closed ids lock").set.contains(&xfer) {
            return Err(kvgate_abi::PluginError::new(
                ReasonCode::DUPLICATE_ID,
                format!("transfer id {} was already used by this instance (ids are never reused)", xfer.0),
            ));
        }
        if ledger.len() as u64 >= max_inflight {
            return Err(kvgate_abi::PluginError::new(
                ReasonCode::RESOURCE_EXHAUSTED,
                format!("{} transfers in flight reached max_inflight_transfers ({max_inflight})", ledger.len()),
            ));
        }
        let (stop, _) = watch::channel(false);
        let t = Arc::new(Transfer { xfer, peer, total_bytes, stop, table: self.clone() });
        let books = Books { t: t.clone(), lanes_done: 0, lane_count, timeout_ms: 0 };
        ledger.admit(xfer, Admission { peer, total_bytes, deadline: None }, books)?;
        Ok(t)
    }

    /// Fail `t` with `TIMEOUT` at `at` unless it ended before (`timeout_ms` is for the message).
    /// Returns whether `at` is now the earliest deadline (the deadline task must be woken).
    pub fn set_deadline(&self, t: &Transfer, at: Instant, timeout_ms: u128) -> bool {
        let mut ledger = self.ledger();
        if let Some(b) = ledger.get_mut(t.xfer) {
            b.timeout_ms = timeout_ms;
        }
        ledger.set_deadline(t.xfer, at)
    }

    /// Fail `TIMEOUT` every transfer whose deadline passed at `now`; returns the next deadline.
    // CONFORMANCE: TIME-1, TIME-2, TIME-4, TIME-12 (a transfer dispatched at submit never outlives its deadline)
    pub fn expire(&self, now: Instant) -> Option<Instant> {
        let mut ledger = self.ledger();
        let expired = ledger.take_due(now);
        let mut stopped = Vec::with_capacity(expired.timed_out.len());
        for xfer in expired.timed_out {
            let Some(b) = ledger.get(xfer) else { continue };
            let (t, timeout_ms) = (b.t.clone(), b.timeout_ms);
            let message = format!("the transfer timeout ({timeout_ms} ms from submit) passed");
            tracing::warn!(xfer = xfer.0, peer = t.peer.0, reason = %ReasonCode::TIMEOUT, %message, "quic transfer failed");
            ledger.fail(xfer, ReasonCode::TIMEOUT, message);
            self.note_if_closed(&ledger, xfer);
            stopped.push(t);
        }
        let next = ledger.next_due();
        drop(ledger);
        for t in stopped {
            t.stop.send_replace(true);
        }
        self.flush();
        next
    }

    /// Heap entries of the deadlines held right now (ended transfers included until the next sweep).
    pub fn deadline_entries(&self) -> usize {
        self.ledger().heap_len()
    }

    pub fn get(&self, xfer: XferId) -> Option<Arc<Transfer>> {
        self.ledger().get(xfer).map(|b| b.t.clone())
    }

    /// Live transfers to `peer`.
    pub fn of_peer(&self, peer: PeerId) -> Vec<Arc<Transfer>> {
        self.ledger().iter().filter(|(_, e)| e.peer() == peer).map(|(_, e)| e.data.t.clone()).collect()
    }

    /// (live, terminal but not yet quiesced)
    // CONFORMANCE: OBS-2 (lowered in the step that queues the terminal event)
    pub fn counts(&self) -> (u64, u64) {
        let ledger = self.ledger();
        (ledger.live_transfers(), ledger.unquiesced_transfers())
    }

    /// Shutdown: end every transfer at once, with nothing more to follow.
    // CONFORMANCE: RES-5
    pub fn close_all_for_shutdown(&self) {
        let mut ledger = self.ledger();
        let all: Vec<Arc<Transfer>> = ledger.iter().map(|(_, e)| e.data.t.clone()).collect();
        for (xfer, e) in ledger.iter() {
            if e.is_live() {
                tracing::warn!(
                    xfer = xfer.0,
                    peer = e.peer().0,
                    reason = "shutdown",
                    "quic transfer failed: plugin shut down"
                );
            }
        }
        ledger.close_all(ReasonCode::SHUTDOWN, "the quic plugin shut down");
        drop(ledger);
        for t in all {
            t.stop.send_replace(true);
        }
        self.flush();
    }
}
