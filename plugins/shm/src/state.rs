//! The shm plugin's shared state under one lock: the transfer ledger (the SDK's: terminal events,
//! deadlines, quiesce holds and the ordered outbox) and the work queue over it, regions, imported
//! keys and peers. A worker's chunk is a ledger hold, so `QUIESCED` comes only once no worker holds a
//! chunk of a failed transfer. Never copies bytes and never calls the sink (the outbox is flushed
//! outside the lock).

use crate::mapping::PeerMapping;
use crate::plan::{Chunk, Cursor, Piece};
use crate::wire::Endpoint;
use kvgate_abi::sdk::{Admission, RegionView, TransferLedger};
use kvgate_abi::{Event, LocalKey, PeerId, ReasonCode, RemoteKey, XferId};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

/// A region registered with this instance (a source of outgoing copies).
#[derive(Clone, Debug)]
pub struct LocalRegion {
    pub view: RegionView,
    pub len: u64,
    /// The backing file, held open while registered: peers map it through this descriptor.
    pub backing: std::sync::Arc<std::fs::File>,
}

/// A peer's region imported from its remote-key bytes: its file held open and checked at import,
/// mapped into this process only when a transfer first writes into it.
#[derive(Debug)]
pub struct ImportedKey {
    pub peer: PeerId,
    pub backing: crate::mapping::PeerBacking,
    pub mapping: std::sync::OnceLock<Arc<PeerMapping>>,
}

impl ImportedKey {
    /// The region's mapping, made now if no transfer wrote into it before (one `mmap`, no page
    /// touched; with `populate` a thread of its own then pre-faults it).
    pub fn mapping(&self, populate: bool) -> Result<&Arc<PeerMapping>, kvgate_abi::PluginError> {
        if let Some(mapping) = self.mapping.get() {
            return Ok(mapping);
        }
        let mapping = Arc::new(PeerMapping::map_backing(&self.backing)?);
        if populate {
            let background = Arc::clone(&mapping);
            let spawned = std::thread::Builder::new()
                .name("kvgate-shm-populate".into())
                .spawn(move || background.populate(crate::mapping::POPULATE_CHUNK_BYTES));
            if let Err(e) = spawned {
                tracing::warn!(
                    reason = "populate_unavailable",
                    "shm: no thread to pre-fault a peer mapping ({e}); it faults on first use"
                );
            }
        }
        Ok(self.mapping.get_or_init(|| mapping))
    }
}

/// The shm side of one outgoing transfer, kept in the ledger from submit until it is terminal *and*
/// quiesced (each chunk a worker is copying is a ledger hold).
#[derive(Debug)]
pub struct Transfer {
    pub peer: PeerId,
    pub pieces: Arc<Vec<Piece>>,
    pub cursor: Cursor,
    pub total_bytes: u64,
    /// Copied with streaming stores (`ShmConfig::streams`).
    pub streaming: bool,
    pub copied_bytes: u64,
    pub deadline: Option<Instant>,
    pub timeout_ns: u64,
    /// The local regions it reads (deregistering one fails it).
    pub local_keys: Vec<LocalKey>,
    /// Keeps every destination mapping alive while a worker may write through it.
    pub mappings: Vec<Arc<PeerMapping>>,
}

/// A chunk claimed by a worker.
#[derive(Debug)]
pub struct Job {
    pub xfer: XferId,
    pub pieces: Arc<Vec<Piece>>,
    pub chunk: Chunk,
    /// Copy with streaming stores (decided per transfer at submit).
    pub streaming: bool,
}

#[derive(Default)]
pub struct State {
    /// Every transfer until it is terminal and quiesced, its deadline, and the events decided under
    /// the lock, delivered in this order outside it. The ledger lowers `live_transfers` in the step
    /// that queues the terminal event, which the deciding thread flushes as soon as it lets go of the
    /// lock: `stats()` never counts a transfer whose terminal event was delivered.
    // CONFORMANCE: OBS-2 (live_transfers lowered no later than the terminal event is delivered)
    pub transfers: TransferLedger<Transfer>,
    /// Transfers with chunks not yet handed out, oldest first. A failed transfer's entry stays until
    /// it reaches the front or the queue is compacted (see `stale_in_queue`).
    pub queue: VecDeque<XferId>,
    /// Entries of `queue` whose transfer failed; compacted away once they are half the queue, so a
    /// cancel costs O(1) amortised (a 10 000-cancel storm stays linear).
    pub stale_in_queue: usize,
    pub regions: HashMap<LocalKey, LocalRegion>,
    pub registered_bytes: u64,
    pub imported: HashMap<RemoteKey, ImportedKey>,
    pub peers: HashMap<PeerId, Endpoint>,
    pub next_key: u64,
    pub shutting_down: bool,
    /// False once a worker died or the instance shut down.
    pub healthy: bool,
    /// What the timer thread is doing, so a submit wakes it only for a deadline earlier than the
    /// one it sleeps towards (a wake-up per transfer costs two context switches).
    pub timer: TimerSleep,
}

/// The timer thread's sleep, as last recorded under the state lock.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TimerSleep {
    /// Running (it reads the deadline set again before it sleeps, so nothing needs waking).
    #[default]
    Awake,
    /// Sleeping until this instant.
    Until(Instant),
    /// Sleeping with no deadline to wait for.
    Indefinitely,
}

impl TimerSleep {
    /// Whether a new transfer due at `deadline` must wake the timer.
    pub fn must_wake_for(self, deadline: Instant) -> bool {
        match self {
            TimerSleep::Awake => false,
            TimerSleep::Until(wake) => deadline < wake,
            TimerSleep::Indefinitely => true,
        }
    }
}

impl State {
    pub fn new() -> State {
        State { healthy: true, next_key: 1, ..State::default() }
    }

    pub fn allocate_key(&mut self) -> u64 {
        let key = self.next_key;
        self.next_key += 1;
        key
    }

    /// Add a validated transfer and queue its chunks (the caller checked the id is not live).
    pub fn insert(&mut self, xfer: XferId, transfer: Transfer) -> Result<(), kvgate_abi::PluginError> {
        let admission =
            Admission { peer: transfer.peer, total_bytes: transfer.total_bytes, deadline: transfer.deadline };
        self.transfers.admit(xfer, admission, transfer)?;
        self.queue.push_back(xfer);
        Ok(())
    }

    /// Fail a live transfer (no effect on unknown or already terminal ones): `FAILED` with the
    /// quiesced flag when no worker holds a chunk of it, else `FAILED` now and `QUIESCED` later.
    // CONFORMANCE: RES-1, RES-3 (one terminal event; QUIESCED only once no worker holds a chunk)
    pub fn fail(&mut self, xfer: XferId, reason: ReasonCode, message: String) {
        let was_queued = self.transfers.get(xfer).is_some_and(|t| !t.cursor.is_done(&t.pieces));
        if self.transfers.fail(xfer, reason, message).ended_it() {
            self.note_failed(was_queued);
        }
    }

    /// A transfer still queued failed: its queue entry is stale now.
    fn note_failed(&mut self, was_queued: bool) {
        if !was_queued {
            return;
        }
        self.stale_in_queue += 1;
        if self.stale_in_queue > 64 && self.stale_in_queue * 2 > self.queue.len() {
            self.compact_queue();
        }
    }

    /// Drop the queue entries of transfers that failed or are gone.
    // CONFORMANCE: ABORT-4 (a cancel storm stays linear)
    fn compact_queue(&mut self) {
        let transfers = &self.transfers;
        self.queue.retain(|&x| transfers.is_live(x) && transfers.get(x).is_some_and(|t| !t.cursor.is_done(&t.pieces)));
        self.stale_in_queue = 0;
    }

    /// The host cancelled `xfer` (unknown or finished ids are ignored).
    pub fn cancel(&mut self, xfer: XferId) {
        let was_queued = self.transfers.get(xfer).is_some_and(|t| !t.cursor.is_done(&t.pieces));
        if self.transfers.cancel(xfer, "cancelled by the host").ended_it() {
            self.note_failed(was_queued);
        }
    }

    /// Fail every live transfer that matches `which`.
    pub fn fail_where(&mut self, which: impl Fn(&Transfer) -> bool, reason: ReasonCode, message: &str) {
        let doomed: Vec<XferId> =
            self.transfers.iter().filter(|(_, e)| e.is_live() && which(&e.data)).map(|(x, _)| x).collect();
        for xfer in doomed {
            self.fail(xfer, reason, message.to_string());
        }
    }

    /// Hand the next chunk of the oldest queued transfer to a worker (a ledger hold until
    /// [`State::complete`]).
    pub fn claim(&mut self, chunk_bytes: u64) -> Option<Job> {
        while let Some(&xfer) = self.queue.front() {
            if !self.transfers.is_live(xfer) {
                self.queue.pop_front();
                self.stale_in_queue = self.stale_in_queue.saturating_sub(1);
                continue;
            }
            let t = self.transfers.get_mut(xfer).expect("live transfers are in the ledger");
            let chunk = t.cursor.next_chunk(&t.pieces, chunk_bytes);
            if t.cursor.is_done(&t.pieces) {
                self.queue.pop_front();
            }
            if let Some(chunk) = chunk {
                let job = Job { xfer, pieces: Arc::clone(&t.pieces), chunk, streaming: t.streaming };
                self.transfers.hold(xfer);
                return Some(job);
            }
        }
        None
    }

    /// A worker finished copying `job` (or unwound out of it: either way it no longer touches it).
    // CONFORMANCE: DATA-1, RES-3 (SUCCEEDED only after the last chunk was copied)
    // CONFORMANCE: RES-2 (a transfer leaves the ledger at its terminal event, or at its last chunk once failed)
    pub fn complete(&mut self, job: &Job) {
        let done = match self.transfers.get_mut(job.xfer) {
            Some(t) => {
                t.copied_bytes += job.chunk.bytes;
                t.cursor.is_done(&t.pieces)
            }
            None => return,
        };
        self.transfers.release(job.xfer);
        let idle = self.transfers.entry(job.xfer).is_some_and(|e| e.is_live() && e.holds() == 0);
        if done && idle {
            debug_assert!(
                self.transfers.get(job.xfer).is_some_and(|t| t.copied_bytes == t.total_bytes),
                "every byte copied before success"
            );
            self.transfers.succeed(job.xfer);
        }
    }

    /// Fail every transfer whose deadline is at or before `now`; returns the next deadline.
    // CONFORMANCE: TIME-1, TIME-4
    // CONFORMANCE: TIME-2 (one-sided: a frozen receiver cannot hold a copy past its deadline)
    pub fn expire(&mut self, now: Instant) -> Option<Instant> {
        let still_queued = std::cell::RefCell::new(0usize);
        let expired = self.transfers.expire(now, |_, e| {
            let t = &e.data;
            *still_queued.borrow_mut() += usize::from(!t.cursor.is_done(&t.pieces));
            format!(
                "shm transfer timed out after {} ns with {} of {} bytes copied",
                t.timeout_ns, t.copied_bytes, t.total_bytes
            )
        });
        for _ in 0..still_queued.into_inner() {
            self.note_failed(true);
        }
        expired.next
    }

    /// Whether a worker still holds a chunk of a transfer reading `key`.
    pub fn region_busy(&self, key: LocalKey) -> bool {
        self.transfers.any_held(|t| t.local_keys.contains(&key))
    }

    /// Transfers submitted and not yet terminal.
    pub fn live_transfers(&self) -> u64 {
        self.transfers.live_transfers()
    }

    /// Transfers terminal but not yet quiesced.
    pub fn unquiesced_transfers(&self) -> u64 {
        self.transfers.unquiesced_transfers()
    }

    /// The events decided so far, in order.
    pub fn take_events(&mut self) -> Vec<Event> {
        self.transfers.take_events()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_abi::{event_flags, EventKind};
    use std::time::Duration;

    /// A transfer of `chunks` chunks of 10 bytes (addresses are never dereferenced here).
    fn transfer(chunks: u64, deadline: Option<Instant>) -> Transfer {
        Transfer {
            peer: PeerId(1),
            pieces: Arc::new(vec![Piece::unbacked(10 * chunks)]),
            cursor: Cursor::default(),
            total_bytes: 10 * chunks,
            streaming: false,
            copied_bytes: 0,
            deadline,
            timeout_ns: 1,
            local_keys: vec![LocalKey(1)],
            mappings: Vec::new(),
        }
    }

    #[test]
    fn the_timer_is_woken_only_for_a_deadline_before_its_own() {
        let now = Instant::now();
        let later = now + Duration::from_millis(5);
        assert!(!TimerSleep::Awake.must_wake_for(now), "a running timer reads the deadlines itself");
        assert!(TimerSleep::Indefinitely.must_wake_for(later));
        assert!(TimerSleep::Until(later).must_wake_for(now), "an earlier deadline wakes it");
        assert!(!TimerSleep::Until(later).must_wake_for(later), "the same instant does not");
        assert!(!TimerSleep::Until(now).must_wake_for(later));
    }

    fn kinds(state: &mut State) -> Vec<(EventKind, bool)> {
        state.take_events().iter().map(|e| (e.kind, e.flags & event_flags::QUIESCED != 0)).collect()
    }

    #[test]
    fn failure_while_a_worker_holds_a_chunk_quiesces_only_when_it_lets_go() {
        let mut state = State::new();
        state.insert(XferId(1), transfer(3, None)).unwrap();
        let job = state.claim(10).unwrap();
        state.fail(XferId(1), ReasonCode::CANCELLED, "c".into());
        assert_eq!(kinds(&mut state), vec![(EventKind::FAILED, false)]);
        assert_eq!((state.live_transfers(), state.unquiesced_transfers()), (0, 1));
        assert!(state.region_busy(LocalKey(1)));
        assert!(state.claim(10).is_none(), "no chunk of a failed transfer is handed out");
        state.fail(XferId(1), ReasonCode::TIMEOUT, "t".into());
        assert!(!state.transfers.has_events(), "one terminal event only");
        state.complete(&job);
        assert_eq!(kinds(&mut state), vec![(EventKind::QUIESCED, false)]);
        assert_eq!((state.transfers.len(), state.unquiesced_transfers()), (0, 0));
        assert!(!state.region_busy(LocalKey(1)));
    }

    #[test]
    fn failure_with_no_chunk_in_flight_is_quiesced_at_once() {
        let mut state = State::new();
        state.insert(XferId(1), transfer(3, None)).unwrap();
        state.fail(XferId(1), ReasonCode::CANCELLED, "c".into());
        assert_eq!(kinds(&mut state), vec![(EventKind::FAILED, true)]);
        assert!(state.transfers.is_empty());
        assert!(state.claim(10).is_none(), "nothing left to hand out");
        assert!(state.queue.is_empty() && state.stale_in_queue == 0);
    }

    /// A cancel storm of queued transfers: the queue is compacted, never scanned once per cancel.
    #[test]
    fn cancelling_queued_transfers_compacts_the_queue() {
        let mut state = State::new();
        for x in 0..1000 {
            state.insert(XferId(x), transfer(1, None)).unwrap();
        }
        for x in 0..999 {
            state.fail(XferId(x), ReasonCode::CANCELLED, "c".into());
        }
        assert!(state.queue.len() < 600, "compacted: {}", state.queue.len());
        let job = state.claim(10).unwrap();
        assert_eq!(job.xfer, XferId(999), "the only live transfer is served next");
        assert!(state.claim(10).is_none());
    }

    #[test]
    fn success_waits_for_every_chunk_of_every_worker() {
        let mut state = State::new();
        state.insert(XferId(1), transfer(3, Some(Instant::now() + std::time::Duration::from_secs(60)))).unwrap();
        let (a, b, c) = (state.claim(10).unwrap(), state.claim(10).unwrap(), state.claim(10).unwrap());
        assert!(state.claim(10).is_none());
        state.complete(&c);
        state.complete(&a);
        assert!(!state.transfers.has_events(), "a chunk is still being copied");
        state.complete(&b);
        let events = state.take_events();
        assert_eq!((events.len(), events[0].kind, events[0].bytes), (1, EventKind::SUCCEEDED, 30));
        assert!(state.transfers.is_empty() && state.live_transfers() == 0);
    }

    #[test]
    fn expiry_fails_due_transfers_and_reports_the_next_deadline() {
        let now = Instant::now();
        let later = now + std::time::Duration::from_secs(5);
        let mut state = State::new();
        state.insert(XferId(1), transfer(1, Some(now))).unwrap();
        state.insert(XferId(2), transfer(1, Some(later))).unwrap();
        assert_eq!(state.expire(now), Some(later));
        let events = state.take_events();
        assert_eq!((events.len(), events[0].xfer, events[0].reason), (1, XferId(1), ReasonCode::TIMEOUT));
        assert_eq!(state.live_transfers(), 1);
    }
}
