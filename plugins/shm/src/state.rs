//! The shm plugin's shared state under one lock: transfers and their work queue, deadlines, regions,
//! imported keys, peers, and the ordered outbox of events. Every transition that ends a transfer lives
//! here, so each transfer gets exactly one terminal event and `QUIESCED` only once no worker holds a
//! chunk of it. Never copies bytes and never calls the sink (the outbox is flushed outside the lock).

use crate::mapping::PeerMapping;
use crate::plan::{Chunk, Cursor, Piece};
use crate::wire::Endpoint;
use kvgate_abi::{Event, LocalKey, PeerId, ReasonCode, RemoteKey, XferId};
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

/// A region registered with this instance (a source of outgoing copies).
#[derive(Clone, Debug)]
pub struct LocalRegion {
    pub addr: usize,
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
                tracing::warn!(reason = "populate_unavailable", "shm: no thread to pre-fault a peer mapping ({e}); it faults on first use");
            }
        }
        Ok(self.mapping.get_or_init(|| mapping))
    }
}

/// One outgoing transfer from submit until it is terminal *and* quiesced.
#[derive(Debug)]
pub struct Transfer {
    pub peer: PeerId,
    pub pieces: Arc<Vec<Piece>>,
    pub cursor: Cursor,
    pub total_bytes: u64,
    /// Copied with streaming stores (`ShmConfig::streams`).
    pub streaming: bool,
    pub copied_bytes: u64,
    /// Chunks a worker is copying right now; `QUIESCED` waits for 0.
    pub active_chunks: u32,
    /// A `FAILED` event was emitted; the transfer stays only until `active_chunks` is 0.
    pub failed: bool,
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

#[derive(Debug, Default)]
pub struct State {
    pub transfers: HashMap<XferId, Transfer>,
    /// Transfers with chunks not yet handed out, oldest first. A failed transfer's entry stays until
    /// it reaches the front or the queue is compacted (see `stale_in_queue`).
    pub queue: VecDeque<XferId>,
    /// Entries of `queue` whose transfer failed; compacted away once they are half the queue, so a
    /// cancel costs O(1) amortised (a 10 000-cancel storm stays linear).
    pub stale_in_queue: usize,
    pub deadlines: BTreeSet<(Instant, XferId)>,
    /// Transfers submitted and not yet terminal. Lowered under the lock in the same step that queues
    /// the terminal event in `outbox`, which the deciding thread flushes as soon as it lets go of the
    /// lock: `stats()` never counts a transfer whose terminal event was delivered, and leads the event
    /// only by its delivery in flight.
    // CONFORMANCE: OBS-2 (live_transfers lowered no later than the terminal event is delivered)
    pub live_transfers: u64,
    pub regions: HashMap<LocalKey, LocalRegion>,
    pub registered_bytes: u64,
    pub imported: HashMap<RemoteKey, ImportedKey>,
    pub peers: HashMap<PeerId, Endpoint>,
    pub next_key: u64,
    /// Events decided under the lock, delivered in this order outside it.
    pub outbox: Vec<Event>,
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

    /// Add a validated transfer and queue its chunks.
    pub fn insert(&mut self, xfer: XferId, transfer: Transfer) {
        if let Some(deadline) = transfer.deadline {
            self.deadlines.insert((deadline, xfer));
        }
        self.transfers.insert(xfer, transfer);
        self.queue.push_back(xfer);
        self.live_transfers += 1;
    }

    /// Fail a live transfer (no effect on unknown or already terminal ones). Emits `FAILED` with the
    /// quiesced flag when no worker holds a chunk of it, else `FAILED` now and `QUIESCED` later.
    // CONFORMANCE: RES-1, RES-3 (one terminal event; QUIESCED only once no worker holds a chunk)
    pub fn fail(&mut self, xfer: XferId, reason: ReasonCode, message: String) {
        let Some(t) = self.transfers.get_mut(&xfer) else { return };
        if t.failed {
            return;
        }
        t.failed = true;
        let was_queued = !t.cursor.is_done(&t.pieces);
        self.live_transfers -= 1;
        if let Some(deadline) = t.deadline {
            self.deadlines.remove(&(deadline, xfer));
        }
        if t.active_chunks == 0 {
            self.outbox.push(Event { peer: t.peer, ..Event::failed_quiesced(xfer, reason, message) });
            self.transfers.remove(&xfer);
        } else {
            self.outbox.push(Event { peer: t.peer, ..Event::failed(xfer, reason, message) });
        }
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
        self.queue.retain(|x| transfers.get(x).is_some_and(|t| !t.failed && !t.cursor.is_done(&t.pieces)));
        self.stale_in_queue = 0;
    }

    /// Fail every live transfer that matches `which`.
    pub fn fail_where(&mut self, which: impl Fn(&Transfer) -> bool, reason: ReasonCode, message: &str) {
        let doomed: Vec<XferId> =
            self.transfers.iter().filter(|(_, t)| !t.failed && which(t)).map(|(&x, _)| x).collect();
        for xfer in doomed {
            self.fail(xfer, reason, message.to_string());
        }
    }

    /// Hand the next chunk of the oldest queued transfer to a worker.
    pub fn claim(&mut self, chunk_bytes: u64) -> Option<Job> {
        while let Some(&xfer) = self.queue.front() {
            let Some(t) = self.transfers.get_mut(&xfer).filter(|t| !t.failed) else {
                self.queue.pop_front();
                self.stale_in_queue = self.stale_in_queue.saturating_sub(1);
                continue;
            };
            let chunk = t.cursor.next_chunk(&t.pieces, chunk_bytes);
            if t.cursor.is_done(&t.pieces) {
                self.queue.pop_front();
            }
            if let Some(chunk) = chunk {
                t.active_chunks += 1;
                return Some(Job { xfer, pieces: Arc::clone(&t.pieces), chunk, streaming: t.streaming });
            }
        }
        None
    }

    /// A worker finished copying `job` (or unwound out of it: either way it no longer touches it).
    // CONFORMANCE: DATA-1, RES-3 (SUCCEEDED only after the last chunk was copied)
    pub fn complete(&mut self, job: &Job) {
        let Some(t) = self.transfers.get_mut(&job.xfer) else { return };
        t.active_chunks -= 1;
        if t.failed {
            if t.active_chunks == 0 {
                self.outbox.push(Event { peer: t.peer, ..Event::quiesced(job.xfer) });
                self.transfers.remove(&job.xfer);
            }
            return;
        }
        t.copied_bytes += job.chunk.bytes;
        if t.active_chunks == 0 && t.cursor.is_done(&t.pieces) {
            debug_assert_eq!(t.copied_bytes, t.total_bytes, "every byte copied before success");
            let (peer, bytes, deadline) = (t.peer, t.total_bytes, t.deadline);
            self.transfers.remove(&job.xfer);
            self.live_transfers -= 1;
            if let Some(deadline) = deadline {
                self.deadlines.remove(&(deadline, job.xfer));
            }
            self.outbox.push(Event { peer, ..Event::succeeded(job.xfer, bytes) });
        }
    }

    /// Fail every transfer whose deadline is at or before `now`; returns the next deadline.
    // CONFORMANCE: TIME-1, TIME-4
    pub fn expire(&mut self, now: Instant) -> Option<Instant> {
        while let Some(&(deadline, xfer)) = self.deadlines.first() {
            if deadline > now {
                return Some(deadline);
            }
            self.deadlines.pop_first();
            let message = match self.transfers.get(&xfer) {
                Some(t) => format!(
                    "shm transfer timed out after {} ns with {} of {} bytes copied",
                    t.timeout_ns, t.copied_bytes, t.total_bytes
                ),
                None => continue,
            };
            self.fail(xfer, ReasonCode::TIMEOUT, message);
        }
        None
    }

    /// Whether a worker still holds a chunk of a transfer reading `key`.
    pub fn region_busy(&self, key: LocalKey) -> bool {
        self.transfers.values().any(|t| t.active_chunks > 0 && t.local_keys.contains(&key))
    }

    /// Transfers terminal but not yet quiesced.
    pub fn unquiesced_transfers(&self) -> u64 {
        self.transfers.len() as u64 - self.live_transfers
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
            pieces: Arc::new(vec![Piece { src: 0, dst: 0, len: 10 * chunks }]),
            cursor: Cursor::default(),
            total_bytes: 10 * chunks,
            streaming: false,
            copied_bytes: 0,
            active_chunks: 0,
            failed: false,
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
        std::mem::take(&mut state.outbox).iter().map(|e| (e.kind, e.flags & event_flags::QUIESCED != 0)).collect()
    }

    #[test]
    fn failure_while_a_worker_holds_a_chunk_quiesces_only_when_it_lets_go() {
        let mut state = State::new();
        state.insert(XferId(1), transfer(3, None));
        let job = state.claim(10).unwrap();
        state.fail(XferId(1), ReasonCode::CANCELLED, "c".into());
        assert_eq!(kinds(&mut state), vec![(EventKind::FAILED, false)]);
        assert_eq!((state.live_transfers, state.unquiesced_transfers()), (0, 1));
        assert!(state.region_busy(LocalKey(1)));
        assert!(state.claim(10).is_none(), "no chunk of a failed transfer is handed out");
        state.fail(XferId(1), ReasonCode::TIMEOUT, "t".into());
        assert!(state.outbox.is_empty(), "one terminal event only");
        state.complete(&job);
        assert_eq!(kinds(&mut state), vec![(EventKind::QUIESCED, false)]);
        assert_eq!((state.transfers.len(), state.unquiesced_transfers()), (0, 0));
        assert!(!state.region_busy(LocalKey(1)));
    }

    #[test]
    fn failure_with_no_chunk_in_flight_is_quiesced_at_once() {
        let mut state = State::new();
        state.insert(XferId(1), transfer(3, None));
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
            state.insert(XferId(x), transfer(1, None));
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
        state.insert(XferId(1), transfer(3, Some(Instant::now() + std::time::Duration::from_secs(60))));
        let (a, b, c) = (state.claim(10).unwrap(), state.claim(10).unwrap(), state.claim(10).unwrap());
        assert!(state.claim(10).is_none());
        state.complete(&c);
        state.complete(&a);
        assert!(state.outbox.is_empty(), "a chunk is still being copied");
        state.complete(&b);
        let events = std::mem::take(&mut state.outbox);
        assert_eq!((events.len(), events[0].kind, events[0].bytes), (1, EventKind::SUCCEEDED, 30));
        assert!(state.transfers.is_empty() && state.deadlines.is_empty() && state.live_transfers == 0);
    }

    #[test]
    fn expiry_fails_due_transfers_and_reports_the_next_deadline() {
        let now = Instant::now();
        let later = now + std::time::Duration::from_secs(5);
        let mut state = State::new();
        state.insert(XferId(1), transfer(1, Some(now)));
        state.insert(XferId(2), transfer(1, Some(later)));
        assert_eq!(state.expire(now), Some(later));
        let events = std::mem::take(&mut state.outbox);
        assert_eq!((events.len(), events[0].xfer, events[0].reason), (1, XferId(1), ReasonCode::TIMEOUT));
        assert_eq!(state.live_transfers, 1);
    }
}
