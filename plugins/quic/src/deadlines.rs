//! The deadlines of outgoing transfers handed to their lanes at submit (the peer's connections were up):
//! one task per instance fails each such transfer `TIMEOUT` once its deadline passes, so a transfer
//! needs no task and no timer of its own. Never holds a transfer alive, never touches one that ended.

use crate::transfers::Transfer;
use kvgate_abi::ReasonCode;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::{Arc, Mutex, Weak};
use tokio::sync::Notify;
use tokio::time::Instant;

/// Entries kept before the first sweep of ended transfers; afterwards a sweep runs once the heap has
/// doubled since the last one, so the heap stays within twice the live transfers (plus this).
pub const DEADLINE_PRUNE_MIN_ENTRIES: usize = 4096;

struct Entry {
    at: Instant,
    /// Submission order: ties of `at` keep it, and entries never compare equal.
    seq: u64,
    timeout_ms: u128,
    t: Weak<Transfer>,
}

impl PartialEq for Entry {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Entry {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

struct Heap {
    entries: BinaryHeap<Reverse<Entry>>,
    next_seq: u64,
    /// Sweep out ended transfers once the heap reaches this many entries.
    prune_at: usize,
}

/// Pending deadlines, earliest first.
pub struct Deadlines {
    heap: Mutex<Heap>,
    /// An earlier deadline than the one the task sleeps for was added.
    earlier: Notify,
}

impl Default for Deadlines {
    fn default() -> Self {
        Deadlines {
            heap: Mutex::new(Heap { entries: BinaryHeap::new(), next_seq: 0, prune_at: DEADLINE_PRUNE_MIN_ENTRIES }),
            earlier: Notify::new(),
        }
    }
}

impl Deadlines {
    /// Fail `t` with `TIMEOUT` at `at` unless it ended before (`timeout_ms` is for the message).
    pub fn watch(&self, t: &Arc<Transfer>, at: Instant, timeout_ms: u128) {
        let mut heap = self.heap.lock().expect("deadlines lock");
        if heap.entries.len() >= heap.prune_at {
            heap.entries.retain(|Reverse(e)| e.t.strong_count() > 0);
            heap.prune_at = (2 * heap.entries.len()).max(DEADLINE_PRUNE_MIN_ENTRIES);
        }
        let earliest = heap.entries.peek().map(|Reverse(e)| e.at);
        let seq = heap.next_seq;
        heap.next_seq += 1;
        heap.entries.push(Reverse(Entry { at, seq, timeout_ms, t: Arc::downgrade(t) }));
        drop(heap);
        if earliest.is_none_or(|e| at < e) {
            self.earlier.notify_one();
        }
    }

    /// Entries held right now (ended transfers included until the next sweep).
    pub fn len(&self) -> usize {
        self.heap.lock().expect("deadlines lock").entries.len()
    }

    /// The transfers whose deadline passed at `now` (removed), and the next deadline.
    fn take_expired(&self, now: Instant) -> (Vec<(Weak<Transfer>, u128)>, Option<Instant>) {
        let mut heap = self.heap.lock().expect("deadlines lock");
        let mut expired = Vec::new();
        while heap.entries.peek().is_some_and(|Reverse(e)| e.at <= now) {
            let Reverse(e) = heap.entries.pop().expect("peeked");
            expired.push((e.t, e.timeout_ms));
        }
        (expired, heap.entries.peek().map(|Reverse(e)| e.at))
    }

    /// The instance's deadline task (runs until the runtime shuts down).
    pub async fn run(self: Arc<Self>) {
        loop {
            let (expired, next) = self.take_expired(Instant::now());
            for (t, timeout_ms) in expired {
                // A transfer that ended is gone or no longer live: `fail` then does nothing.
                if let Some(t) = t.upgrade() {
                    t.fail(ReasonCode::TIMEOUT, format!("the transfer timeout ({timeout_ms} ms from submit) passed"));
                }
            }
            match next {
                Some(at) => {
                    tokio::select! {
                        _ = tokio::time::sleep_until(at) => {}
                        _ = self.earlier.notified() => {}
                    }
                }
                None => self.earlier.notified().await,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transfers::Transfers;
    use kvgate_abi::sdk::{sink_from_fn, Sink};
    use kvgate_abi::{EventKind, PeerId, XferId};
    use std::time::Duration;

    fn table() -> (Arc<Transfers>, std::sync::mpsc::Receiver<(XferId, EventKind, u32)>) {
        let (tx, rx) = std::sync::mpsc::channel();
        let tx = Mutex::new(tx);
        let sink = Sink::new(sink_from_fn(move |e| {
            let _ = tx.lock().unwrap().send((e.xfer, e.kind, e.reason.0));
        }));
        (Transfers::new(sink), rx)
    }

    #[test]
    fn a_passed_deadline_fails_its_live_transfer_and_leaves_ended_ones_alone() {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        let (transfers, events) = table();
        let deadlines = Arc::new(Deadlines::default());
        runtime.spawn(deadlines.clone().run());
        let now = Instant::now();
        let late = transfers.admit(XferId(1), PeerId(9), 1, 1, 16).unwrap();
        let early = transfers.admit(XferId(2), PeerId(9), 1, 1, 16).unwrap();
        let ended = transfers.admit(XferId(3), PeerId(9), 1, 1, 16).unwrap();
        deadlines.watch(&late, now + Duration::from_millis(400), 400);
        // Added later with an earlier deadline: the task, asleep for 400 ms, wakes up for it.
        runtime.block_on(async { tokio::time::sleep(Duration::from_millis(20)).await });
        deadlines.watch(&early, now + Duration::from_millis(60), 60);
        deadlines.watch(&ended, now + Duration::from_millis(40), 40);
        ended.fail(ReasonCode::CANCELLED, "cancelled");
        assert_eq!(events.recv_timeout(Duration::from_secs(5)).unwrap(), (XferId(3), EventKind::FAILED, ReasonCode::CANCELLED.0));
        drop(ended);
        runtime.block_on(async { tokio::time::sleep(Duration::from_millis(200)).await });
        let (xfer, kind, reason) = events.try_recv().expect("the early deadline fired before the late one");
        assert_eq!((xfer, kind, reason), (XferId(2), EventKind::FAILED, ReasonCode::TIMEOUT.0));
        assert!(events.try_recv().is_err(), "the late deadline fired early, or the ended transfer was failed again");
        runtime.block_on(async { tokio::time::sleep(Duration::from_millis(400)).await });
        assert_eq!(events.try_recv().unwrap(), (XferId(1), EventKind::FAILED, ReasonCode::TIMEOUT.0));
        assert_eq!(deadlines.len(), 0);
    }

    #[test]
    fn ended_transfers_are_swept_once_the_heap_reaches_its_prune_size() {
        let (transfers, _events) = table();
        let deadlines = Deadlines::default();
        let far = Instant::now() + Duration::from_secs(3600);
        let live = transfers.admit(XferId(0), PeerId(1), 1, 1, 1 << 20).unwrap();
        deadlines.watch(&live, far, 1);
        for i in 1..DEADLINE_PRUNE_MIN_ENTRIES as u64 {
            let t = transfers.admit(XferId(i), PeerId(1), 1, 1, 1 << 20).unwrap();
            deadlines.watch(&t, far, 1);
            t.fail(ReasonCode::CANCELLED, "ended");
        }
        // At the prune size: nothing swept yet.
        assert_eq!(deadlines.len(), DEADLINE_PRUNE_MIN_ENTRIES);
        // Just past it: the ended transfers go, the live one and the new one stay.
        let t = transfers.admit(XferId(1 << 40), PeerId(1), 1, 1, 1 << 20).unwrap();
        deadlines.watch(&t, far, 1);
        assert_eq!(deadlines.len(), 2);
    }
}
