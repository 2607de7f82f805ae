//! The deadline task of outgoing transfers handed to their lanes at submit (the peer's connections
//! were up): the deadlines themselves live in the transfers' ledger (the SDK's heap); one task per
//! instance sleeps until the earliest and has the ledger fail what is due `TIMEOUT`, so a transfer
//! needs no task and no timer of its own. Never holds a transfer alive, never touches one that ended.

use crate::transfers::{Transfer, Transfers};
use std::sync::Arc;
use tokio::sync::Notify;
use tokio::time::Instant;

/// Wakes the deadline task when an earlier deadline than the one it sleeps for was added.
#[derive(Default)]
pub struct Deadlines {
    earlier: Notify,
}

impl Deadlines {
    /// Fail `t` with `TIMEOUT` at `at` unless it ended before (`timeout_ms` is for the message).
    pub fn watch(&self, t: &Arc<Transfer>, at: Instant, timeout_ms: u128) {
        if t.table().set_deadline(t, at.into_std(), timeout_ms) {
            self.earlier.notify_one();
        }
    }

    /// The instance's deadline task (runs until the runtime shuts down).
    pub async fn run(self: Arc<Self>, transfers: Arc<Transfers>) {
        loop {
            match transfers.expire(std::time::Instant::now()) {
                Some(at) => {
                    tokio::select! {
                        _ = tokio::time::sleep_until(Instant::from_std(at)) => {}
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
    use kvgate_abi::{EventKind, PeerId, ReasonCode, XferId};
    use std::sync::Mutex;
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
        runtime.spawn(deadlines.clone().run(transfers.clone()));
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
        assert_eq!(
            events.recv_timeout(Duration::from_secs(5)).unwrap(),
            (XferId(3), EventKind::FAILED, ReasonCode::CANCELLED.0)
        );
        drop(ended);
        runtime.block_on(async { tokio::time::sleep(Duration::from_millis(200)).await });
        let (xfer, kind, reason) = events.try_recv().expect("the early deadline fired before the late one");
        assert_eq!((xfer, kind, reason), (XferId(2), EventKind::FAILED, ReasonCode::TIMEOUT.0));
        assert!(events.try_recv().is_err(), "the late deadline fired early, or the ended transfer was failed again");
        runtime.block_on(async { tokio::time::sleep(Duration::from_millis(400)).await });
        assert_eq!(events.try_recv().unwrap(), (XferId(1), EventKind::FAILED, ReasonCode::TIMEOUT.0));
        assert_eq!(transfers.deadline_entries(), 0);
    }
}
