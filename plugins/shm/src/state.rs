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
}

/// A peer's region imported from its remote-key bytes, mapped into this process.
#[derive(Debug)]
pub struct ImportedKey {
    pub peer: PeerId,
    pub mapping: Arc<PeerMapping>,
}

/// One outgoing transfer from submit until it is terminal *and* quiesced.
#[derive(Debug)]
pub struct Transfer {
    pub peer: PeerId,
    pub pieces: Arc<Vec<Piece>>,
    pub cursor: Cursor,
    pub total_bytes: u64,
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
}

#[derive(Debug, Default)]
pub struct State {
    pub transfers: HashMap<XferId, Transfer>,
    /// Transfers with chunks not yet handed out, oldest first.
    pub queue: VecDeque<XferId>,
    pub deadlines: BTreeSet<(Instant, XferId)>,
    /// Transfers submitted and not yet terminal.
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
    pub fn fail(&mut self, xfer: XferId, reason: ReasonCode, message: String) {
        let Some(t) = self.transfers.get_mut(&xfer) else { return };
        if t.failed {
            return;
        }
        t.failed = true;
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
        self.queue.retain(|&queued| queued != xfer);
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
                continue;
            };
            let chunk = t.cursor.next_chunk(&t.pieces, chunk_bytes);
            if t.cursor.is_done(&t.pieces) {
                self.queue.pop_front();
            }
            if let Some(chunk) = chunk {
                t.active_chunks += 1;
                return Some(Job { xfer, pieces: Arc::clone(&t.pieces), chunk });
            }
        }
        None
    }

    /// A worker finished copying `job` (or unwound out of it: either way it no longer touches it).
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
