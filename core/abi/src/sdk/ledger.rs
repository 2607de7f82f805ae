//! The transfer ledger: the plugin side of the transfer contract, written once. It owns each
//! outgoing transfer's lifecycle (submitted → live → exactly one terminal event → quiesced), the
//! deadline heap whose expiry is the `TIMEOUT` failure, cancel bookkeeping, and quiesce tracking
//! (holds: what still touches a transfer's memory). It decides events and queues them in order; it
//! never calls the sink, reads the clock only to place a failed transfer's quiesce bound (callers
//! pass `now` to `expire`) and takes no lock (a plugin keeps
//! it under its own, and delivers [`TransferLedger::take_events`] outside that lock, e.g. through
//! [`OrderedDelivery`]).
//!
//! The only ways to an event are [`TransferLedger::succeed`], [`TransferLedger::fail`] (and the
//! calls built on it: `cancel`, `expire`, `fail_where`, `close_all`) and [`TransferLedger::release`].
//! Each checks the transfer's phase, so a second terminal event cannot be produced: the attempt is
//! refused and counted ([`TransferLedger::refused_terminals`]). A ledger dropped while transfers are
//! still live (their terminal event lost) counts them in [`transfers_dropped_without_terminal`].

use crate::types::{Event, PeerId, PluginError, ReasonCode, XferId};
use std::cmp::Reverse;
use std::collections::hash_map::RandomState;
use std::collections::{BinaryHeap, HashMap};
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, TryLockError};
use std::time::{Duration, Instant};

/// Heap entries tolerated above twice the ledger's entries before the heap is rebuilt without the
/// stale ones (a transfer has at most two: its deadline and, once failed unquiesced, its quiesce bound).
pub const STALE_DEADLINES_FLOOR: usize = 4_096;

static DROPPED_WITHOUT_TERMINAL: AtomicU64 = AtomicU64::new(0);

/// Transfers, over every ledger of this process, that were still live (no terminal event) when
/// their ledger was dropped: each is a lost terminal event.
pub fn transfers_dropped_without_terminal() -> u64 {
    DROPPED_WITHOUT_TERMINAL.load(Ordering::SeqCst)
}

/// Where a transfer is in its lifecycle. A transfer leaves the ledger once it is terminal and
/// nothing holds it; `Succeeded` and `Failed` are seen only while holds remain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Submitted, no terminal event yet.
    Live,
    /// `SUCCEEDED` was queued; nothing more will be (its holds leave silently).
    Succeeded,
    /// `FAILED` was queued without the quiesced flag; `QUIESCED` follows when the last hold goes.
    Failed,
}

/// What [`TransferLedger::admit`] records about a transfer besides the plugin's own data.
#[derive(Clone, Copy, Debug)]
pub struct Admission {
    /// Stamped on every event of the transfer.
    pub peer: PeerId,
    /// Reported by `SUCCEEDED`.
    pub total_bytes: u64,
    /// When it fails `TIMEOUT` if still live (`None`: the host's own deadline is the only one,
    /// e.g. a `timeout_ns` past what the clock can represent).
    pub deadline: Option<Instant>,
}

/// One transfer in the ledger.
#[derive(Debug)]
pub struct Entry<T> {
    /// The plugin's own per-transfer state.
    pub data: T,
    peer: PeerId,
    total_bytes: u64,
    deadline: Option<Instant>,
    phase: Phase,
    holds: u32,
    cancel_requested: bool,
}

impl<T> Entry<T> {
    pub fn phase(&self) -> Phase {
        self.phase
    }
    pub fn is_live(&self) -> bool {
        self.phase == Phase::Live
    }
    pub fn peer(&self) -> PeerId {
        self.peer
    }
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }
    /// Holds taken and not yet released (see [`TransferLedger::hold`]).
    pub fn holds(&self) -> u32 {
        self.holds
    }
    /// Whether the host cancelled it (whatever ended it first).
    pub fn cancel_requested(&self) -> bool {
        self.cancel_requested
    }
}

/// What a [`TransferLedger::fail`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// Not in the ledger (never admitted, or terminal and quiesced): nothing queued.
    Unknown,
    /// Already terminal: nothing queued (the first cause stands).
    AlreadyTerminal,
    /// `FAILED` queued with the quiesced flag; the transfer left the ledger.
    FailedQuiesced,
    /// `FAILED` queued; `QUIESCED` follows when its last hold is released.
    FailedUnquiesced,
}

impl Failure {
    /// Whether this call made the transfer terminal.
    pub fn ended_it(self) -> bool {
        matches!(self, Failure::FailedQuiesced | Failure::FailedUnquiesced)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Due {
    /// The transfer's own deadline: fails it `TIMEOUT` if still live.
    Deadline,
    /// The quiesce bound of a failed transfer: reported as overdue if still unquiesced.
    QuiesceBound,
}

/// What [`TransferLedger::expire`] found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Expired {
    /// Transfers this call failed `TIMEOUT`.
    pub timed_out: Vec<XferId>,
    /// Failed transfers still unquiesced past the quiesce bound (the plugin logs them; the host's
    /// quarantine bound decides what happens to their memory).
    pub quiesce_overdue: Vec<XferId>,
    /// The next instant `expire` has something to do, if any.
    pub next: Option<Instant>,
}

/// Every transfer of one plugin instance from `submit` until it is terminal and quiesced.
pub struct TransferLedger<T, S = RandomState> {
    entries: HashMap<XferId, Entry<T>, S>,
    heap: BinaryHeap<Reverse<(Instant, Due, XferId)>>,
    live: u64,
    unquiesced: u64,
    outbox: Vec<Event>,
    refused_terminals: u64,
    quiesce_bound: Option<Duration>,
}

impl<T> Default for TransferLedger<T, RandomState> {
    fn default() -> Self {
        TransferLedger::with_hasher(RandomState::new())
    }
}

impl<T> TransferLedger<T, RandomState> {
    pub fn new() -> Self {
        Self::default()
    }
}

impl<T, S: BuildHasher> TransferLedger<T, S> {
    /// A ledger whose map hashes ids with `hasher`.
    pub fn with_hasher(hasher: S) -> Self {
        TransferLedger {
            entries: HashMap::with_hasher(hasher),
            heap: BinaryHeap::new(),
            live: 0,
            unquiesced: 0,
            outbox: Vec::new(),
            refused_terminals: 0,
            quiesce_bound: None,
        }
    }

    /// After a failure that is not quiesced at once, report the transfer in
    /// [`Expired::quiesce_overdue`] if it is still unquiesced `bound` later (`None`: never).
    pub fn set_quiesce_bound(&mut self, bound: Option<Duration>) {
        self.quiesce_bound = bound;
    }

    /// Record a submitted transfer, live, with no hold. Refused (`DUPLICATE_ID`) while an entry of
    /// that id exists, live or not yet quiesced; nothing is recorded then.
    // CONFORMANCE: DATA-3 (an id already live is refused, DUPLICATE_ID)
    pub fn admit(&mut self, xfer: XferId, admission: Admission, data: T) -> Result<(), PluginError> {
        if self.entries.contains_key(&xfer) {
            return Err(PluginError::new(ReasonCode::DUPLICATE_ID, format!("transfer {} is already live", xfer.0)));
        }
        if let Some(at) = admission.deadline {
            self.heap.push(Reverse((at, Due::Deadline, xfer)));
        }
        self.entries.insert(
            xfer,
            Entry {
                data,
                peer: admission.peer,
                total_bytes: admission.total_bytes,
                deadline: admission.deadline,
                phase: Phase::Live,
                holds: 0,
                cancel_requested: false,
            },
        );
        self.live += 1;
        Ok(())
    }

    pub fn contains(&self, xfer: XferId) -> bool {
        self.entries.contains_key(&xfer)
    }
    pub fn entry(&self, xfer: XferId) -> Option<&Entry<T>> {
        self.entries.get(&xfer)
    }
    pub fn get(&self, xfer: XferId) -> Option<&T> {
        self.entries.get(&xfer).map(|e| &e.data)
    }
    pub fn get_mut(&mut self, xfer: XferId) -> Option<&mut T> {
        self.entries.get_mut(&xfer).map(|e| &mut e.data)
    }
    /// Whether `xfer` is in the ledger and not yet terminal.
    pub fn is_live(&self, xfer: XferId) -> bool {
        self.entries.get(&xfer).is_some_and(|e| e.phase == Phase::Live)
    }
    /// Every entry, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (XferId, &Entry<T>)> {
        self.entries.iter().map(|(x, e)| (*x, e))
    }
    /// Every entry's own data, mutably.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (XferId, &mut T)> {
        self.entries.iter_mut().map(|(x, e)| (*x, &mut e.data))
    }
    /// Entries in the ledger (live, or terminal and still held).
    pub fn len(&self) -> usize {
        self.entries.len()
    }
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Transfers submitted and not yet terminal. Lowered in the same step that queues the terminal
    /// event, so a `stats()` read after the event was delivered never counts the transfer.
    // CONFORMANCE: OBS-2 (live_transfers lowered no later than the terminal event is delivered)
    pub fn live_transfers(&self) -> u64 {
        self.live
    }
    /// Transfers failed and not yet quiesced.
    pub fn unquiesced_transfers(&self) -> u64 {
        self.unquiesced
    }
    /// Terminal attempts refused because the transfer was already terminal (a second `succeed`,
    /// a cancel or a failure after the first cause, a success after a failure).
    pub fn refused_terminals(&self) -> u64 {
        self.refused_terminals
    }

    /// Something (a worker copying a chunk, a lane, a posted operation, a device copy) is about to
    /// touch the transfer's memory: `QUIESCED` waits until it is released. Refused (false) once the
    /// transfer is terminal or unknown, so nothing new starts after the terminal event.
    pub fn hold(&mut self, xfer: XferId) -> bool {
        match self.entries.get_mut(&xfer) {
            Some(e) if e.phase == Phase::Live => {
                e.holds += 1;
                true
            }
            _ => false,
        }
    }

    /// A hold taken by [`TransferLedger::hold`] no longer touches the transfer's memory. The last
    /// release of a failed transfer queues `QUIESCED`; of a terminal one, it leaves the ledger and its
    /// data is returned.
    // CONFORMANCE: RES-3 (QUIESCED only once nothing holds the transfer, and only after FAILED)
    pub fn release(&mut self, xfer: XferId) -> Option<T> {
        let e = self.entries.get_mut(&xfer)?;
        debug_assert!(e.holds > 0, "transfer {} released more often than held", xfer.0);
        e.holds = e.holds.saturating_sub(1);
        if e.holds > 0 || e.phase == Phase::Live {
            return None;
        }
        let e = self.entries.remove(&xfer).expect("present above");
        if e.phase == Phase::Failed {
            self.unquiesced -= 1;
            self.outbox.push(Event { peer: e.peer, ..Event::quiesced(xfer) });
        }
        self.drop_stale_deadlines();
        Some(e.data)
    }

    /// Forget a terminal transfer that will never quiesce as far as this plugin can tell (e.g. at
    /// shutdown, a receiver that never confirmed): no event; the host's quarantine bound decides
    /// for its memory. A live transfer is never forgotten (`None`): it must get its terminal event.
    pub fn forget_terminal(&mut self, xfer: XferId) -> Option<T> {
        let phase = self.entries.get(&xfer)?.phase;
        if phase == Phase::Live {
            return None;
        }
        let e = self.entries.remove(&xfer).expect("present above");
        if phase == Phase::Failed {
            self.unquiesced -= 1;
        }
        Some(e.data)
    }

    /// Whether anything still holds a transfer that `which` selects (e.g. one reading a region
    /// about to be deregistered, or writing under a ticket being revoked).
    pub fn any_held(&self, which: impl Fn(&T) -> bool) -> bool {
        self.entries.values().any(|e| e.holds > 0 && which(&e.data))
    }

    /// Queue `SUCCEEDED` for a live transfer: the plugin knows every byte is visible at the
    /// destination. Refused and counted (false) if it is terminal; ignored if unknown. A transfer
    /// still held stays until its holds are released, with no further event.
    // CONFORMANCE: RES-1, DATA-1 (exactly one terminal event; SUCCEEDED only when the plugin says every byte landed)
    pub fn succeed(&mut self, xfer: XferId) -> bool {
        let Some(e) = self.entries.get_mut(&xfer) else { return false };
        if e.phase != Phase::Live {
            self.refused_terminals += 1;
            return false;
        }
        let (peer, bytes) = (e.peer, e.total_bytes);
        self.live -= 1;
        if e.holds == 0 {
            self.entries.remove(&xfer);
            self.drop_stale_deadlines();
        } else {
            e.phase = Phase::Succeeded;
        }
        self.outbox.push(Event { peer, ..Event::succeeded(xfer, bytes) });
        true
    }

    /// Queue `FAILED` for a live transfer (first cause wins): with the quiesced flag when nothing
    /// holds it, else `QUIESCED` follows at its last release. Unknown ids and terminal transfers
    /// queue nothing (a terminal one counts as refused).
    // CONFORMANCE: RES-1, RES-3 (one terminal event; QUIESCED only once nothing holds the transfer)
    pub fn fail(&mut self, xfer: XferId, reason: ReasonCode, message: impl Into<String>) -> Failure {
        let now_bound = self.quiesce_bound;
        let Some(e) = self.entries.get_mut(&xfer) else { return Failure::Unknown };
        if e.phase != Phase::Live {
            self.refused_terminals += 1;
            return Failure::AlreadyTerminal;
        }
        let peer = e.peer;
        self.live -= 1;
        if e.holds == 0 {
            self.entries.remove(&xfer);
            self.outbox.push(Event { peer, ..Event::failed_quiesced(xfer, reason, message) });
            self.drop_stale_deadlines();
            Failure::FailedQuiesced
        } else {
            e.phase = Phase::Failed;
            self.unquiesced += 1;
            self.outbox.push(Event { peer, ..Event::failed(xfer, reason, message) });
            if let Some(bound) = now_bound {
                if let Some(at) = Instant::now().checked_add(bound) {
                    self.heap.push(Reverse((at, Due::QuiesceBound, xfer)));
                }
            }
            Failure::FailedUnquiesced
        }
    }

    /// The host cancelled `xfer`: a live transfer fails `CANCELLED` at once, whatever it waits for
    /// (no peer, no answer, no ticket involved); unknown, terminal or twice-cancelled ids are
    /// harmless and queue nothing.
    // CONFORMANCE: ABORT-1, ABORT-2, ABORT-3 (a cancel ends a live transfer at once; any other id is ignored)
    pub fn cancel(&mut self, xfer: XferId, message: impl Into<String>) -> Failure {
        match self.entries.get_mut(&xfer) {
            None => Failure::Unknown,
            Some(e) if e.phase != Phase::Live => {
                e.cancel_requested = true;
                Failure::AlreadyTerminal
            }
            Some(e) => {
                e.cancel_requested = true;
                self.fail(xfer, ReasonCode::CANCELLED, message)
            }
        }
    }

    /// Fail every live transfer that `which` selects; returns how many this call ended.
    pub fn fail_where(&mut self, which: impl Fn(&T) -> bool, reason: ReasonCode, message: &str) -> usize {
        let doomed: Vec<XferId> =
            self.entries.iter().filter(|(_, e)| e.phase == Phase::Live && which(&e.data)).map(|(x, _)| *x).collect();
        for &xfer in &doomed {
            self.fail(xfer, reason, message);
        }
        doomed.len()
    }

    /// Fail `TIMEOUT` every live transfer whose deadline is at or before `now` (the message from
    /// `message`), and report failed transfers unquiesced past the quiesce bound.
    // CONFORMANCE: TIME-1, TIME-2, TIME-3, TIME-4 (a transfer never outlives its own deadline)
    pub fn expire(&mut self, now: Instant, message: impl Fn(XferId, &Entry<T>) -> String) -> Expired {
        let expired = self.take_due(now);
        for &xfer in &expired.timed_out {
            let text = message(xfer, &self.entries[&xfer]);
            self.fail(xfer, ReasonCode::TIMEOUT, text);
        }
        expired
    }

    /// As [`TransferLedger::expire`], but the live transfers whose deadline passed are only listed
    /// in `timed_out`, still live: the caller fails each one `TIMEOUT` itself (through its own path
    /// that also stops what it has in flight, ending in [`TransferLedger::fail`]).
    pub fn take_due(&mut self, now: Instant) -> Expired {
        let mut expired = Expired::default();
        while let Some(&Reverse((at, due, xfer))) = self.heap.peek() {
            if at > now {
                expired.next = Some(at);
                break;
            }
            self.heap.pop();
            let Some(e) = self.entries.get(&xfer) else { continue };
            match due {
                Due::Deadline if e.phase == Phase::Live && e.deadline == Some(at) => expired.timed_out.push(xfer),
                Due::QuiesceBound if e.phase == Phase::Failed => expired.quiesce_overdue.push(xfer),
                _ => {}
            }
        }
        expired
    }

    /// Give a live transfer a deadline (or a new one) after admission, e.g. once its parts are on
    /// their way; returns whether it is now the earliest entry of the heap (a sleeping timer must be
    /// woken). A terminal or unknown transfer is left alone (false).
    pub fn set_deadline(&mut self, xfer: XferId, at: Instant) -> bool {
        let Some(e) = self.entries.get_mut(&xfer).filter(|e| e.phase == Phase::Live) else { return false };
        e.deadline = Some(at);
        let earliest = self.heap.peek().is_none_or(|Reverse((first, _, _))| at < *first);
        self.heap.push(Reverse((at, Due::Deadline, xfer)));
        self.drop_stale_deadlines();
        earliest
    }

    /// The earliest heap entry (possibly stale): when `expire` may next have something to do.
    pub fn next_due(&self) -> Option<Instant> {
        self.heap.peek().map(|Reverse((at, _, _))| *at)
    }

    /// Shutdown: fail every live transfer (`FAILED` with the quiesced flag) and quiesce every failed
    /// one, forgetting them all. The caller has stopped everything that touched their memory.
    // CONFORMANCE: RES-5 (every live transfer gets its terminal event before shutdown returns)
    pub fn close_all(&mut self, reason: ReasonCode, message: &str) {
        let mut ids: Vec<XferId> = self.entries.keys().copied().collect();
        ids.sort_unstable_by_key(|x| x.0);
        for xfer in ids {
            let e = self.entries.remove(&xfer).expect("id taken from the map");
            match e.phase {
                Phase::Live => {
                    self.live -= 1;
                    self.outbox.push(Event { peer: e.peer, ..Event::failed_quiesced(xfer, reason, message) });
                }
                Phase::Failed => {
                    self.unquiesced -= 1;
                    self.outbox.push(Event { peer: e.peer, ..Event::quiesced(xfer) });
                }
                Phase::Succeeded => {}
            }
        }
        self.heap.clear();
    }

    /// The events queued so far, in the order they were decided; deliver them in that order.
    pub fn take_events(&mut self) -> Vec<Event> {
        std::mem::take(&mut self.outbox)
    }
    /// Whether events are waiting for delivery.
    pub fn has_events(&self) -> bool {
        !self.outbox.is_empty()
    }
    /// Queue an event that is not a transfer's (e.g. `UNHEALTHY`) in order with the ledger's.
    pub fn push_event(&mut self, event: Event) {
        self.outbox.push(event);
    }

    /// Heap entries held right now (stale ones included until the next rebuild).
    pub fn heap_len(&self) -> usize {
        self.heap.len()
    }

    /// After a transfer leaves: once the heap holds more than `STALE_DEADLINES_FLOOR` entries beyond
    /// twice the ledger's entries, keep only those of transfers still present (amortised O(1) per
    /// transfer: a rebuild follows at least `STALE_DEADLINES_FLOOR` departures).
    fn drop_stale_deadlines(&mut self) {
        if self.heap.len() <= STALE_DEADLINES_FLOOR + 2 * self.entries.len() {
            return;
        }
        let entries = &self.entries;
        self.heap.retain(|Reverse((_, _, xfer))| entries.contains_key(xfer));
    }
}

impl<T, S> Drop for TransferLedger<T, S> {
    fn drop(&mut self) {
        if self.live > 0 {
            DROPPED_WITHOUT_TERMINAL.fetch_add(self.live, Ordering::SeqCst);
            eprintln!(
                "kvgate-abi: a transfer ledger was dropped with {} live transfers (terminal events lost)",
                self.live
            );
        }
    }
}

/// Delivers events in the order they were decided, from whichever thread decided them, never
/// under the caller's state lock. Whoever holds the delivery lock drains everything queued,
/// including what a sink that calls back into the plugin queues; callers that find it held return
/// at once and leave their events to the holder.
#[derive(Default)]
pub struct OrderedDelivery {
    delivering: Mutex<()>,
}

impl OrderedDelivery {
    pub fn new() -> Self {
        Self::default()
    }

    /// Deliver what `take` returns (it takes the queued events under the caller's lock) until it
    /// returns none; return at once if another thread is delivering. `pending` tells (under the
    /// caller's lock) whether events are queued: checked after letting go of the delivery lock, so
    /// events queued while the holder was finishing are never left behind.
    pub fn flush(
        &self,
        pending: impl Fn() -> bool,
        mut take: impl FnMut() -> Vec<Event>,
        mut deliver: impl FnMut(Event),
    ) {
        loop {
            let guard = match self.delivering.try_lock() {
                Ok(guard) => guard,
                Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
                Err(TryLockError::WouldBlock) => return,
            };
            loop {
                let batch = take();
                if batch.is_empty() {
                    break;
                }
                batch.into_iter().for_each(&mut deliver);
            }
            drop(guard);
            if !pending() {
                return;
            }
        }
    }

    /// Deliver what `take` returns, waiting for a concurrent deliverer if there is one.
    pub fn flush_blocking(&self, mut take: impl FnMut() -> Vec<Event>, mut deliver: impl FnMut(Event)) {
        let _guard = self.delivering.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            let batch = take();
            if batch.is_empty() {
                return;
            }
            batch.into_iter().for_each(&mut deliver);
        }
    }
}
