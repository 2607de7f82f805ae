//! The one worker thread of an instance: moves submitted transfers and controls into the engine,
//! steps it, publishes counts and delivers events. Owns the poll cadence: blocks on the condvar
//! when idle, yields for `poll_spin_us` after progress, then sleeps with doubling backoff capped at
//! `poll_max_sleep_us` (never a busy spin). Never holds the state lock while delivering events.

use crate::config::NvlinkConfig;
use crate::engine::{CopyBackend, Engine};
use crate::state::{Control, State};
use kvgate_abi::sdk::Sink;
use kvgate_abi::{Event, ReasonCode};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// What the API side and the worker share.
pub struct Shared {
    pub state: Mutex<State>,
    pub wake: Condvar,
    pub sink: Sink,
    pub config: NvlinkConfig,
}

impl Shared {
    pub fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A poisoned lock means a panic inside a critical section; the tables are still
        // consistent enough to fail everything, which is what the callers then do.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Runs until shutdown. `drain_deadline` bounds how long copies already on the GPU are awaited.
pub fn run<B: CopyBackend>(shared: &Shared, mut engine: Engine<B>) {
    let spin = Duration::from_micros(shared.config.poll_spin_us);
    let max_sleep = Duration::from_micros(shared.config.poll_max_sleep_us);
    let mut backoff = Duration::from_micros(1);
    let mut last_progress = Instant::now();
    let mut drain_deadline: Option<Instant> = None;
    let mut events: Vec<Event> = Vec::new();
    loop {
        let shutting = {
            let mut st = shared.lock();
            for new in st.pending.drain(..) {
                engine.admit(new);
            }
            for control in std::mem::take(&mut st.controls) {
                match control {
                    Control::Fail { xfer, reason, message } => engine.fail(xfer, reason, message),
                    Control::FailPeer { peer, reason, message } => engine.fail_all(Some(peer), reason, &message),
                    Control::ForgetPeerStreams { peer } => engine.backend_mut().forget_peer(peer),
                }
            }
            st.shutting_down
        };
        if shutting {
            engine.fail_all(None, ReasonCode::SHUTDOWN, "nvlink: plugin shutting down");
            drain_deadline
                .get_or_insert_with(|| Instant::now() + Duration::from_millis(shared.config.shutdown_drain_ms));
        }
        let now = Instant::now();
        let (finished, changed) = engine.step(now, &mut events);
        {
            let mut st = shared.lock();
            for id in &finished {
                st.live.remove(id);
            }
            st.counts = engine.counts();
        }
        for event in events.drain(..) {
            shared.sink.deliver(event);
        }
        if shutting {
            if engine.is_idle() {
                return;
            }
            if drain_deadline.is_some_and(|d| now >= d) {
                let counts = engine.counts();
                tracing::error!(
                    copies_in_flight = counts.copies_in_flight,
                    "nvlink: shutdown_drain_ms passed with copies still on the GPU; their transfers stay unquiesced"
                );
                return;
            }
        }
        if changed {
            last_progress = now;
            backoff = Duration::from_micros(1);
            continue;
        }
        let st = shared.lock();
        if !st.pending.is_empty() || !st.controls.is_empty() || st.shutting_down != shutting {
            continue;
        }
        if engine.is_idle() {
            drop(shared.wake.wait(st).unwrap_or_else(|p| p.into_inner()));
        } else if now.duration_since(last_progress) < spin {
            drop(st);
            std::thread::yield_now();
        } else {
            let mut wait = backoff;
            if let Some(deadline) = engine.next_deadline() {
                wait = wait.min(deadline.saturating_duration_since(now));
            }
            drop(shared.wake.wait_timeout(st, wait).unwrap_or_else(|p| p.into_inner()));
            backoff = (backoff * 2).min(max_sleep);
        }
    }
}

#[cfg(test)]
mod tests {
    //! The worker loop with a timed fake GPU (copies finish a fixed time after issue): events
    //! arrive while it sleeps, controls and deadlines wake it, shutdown drains within its bound.
    use super::*;
    use crate::chunk_plan::CopyOp;
    use crate::engine::{Lane, NewTransfer};
    use crate::state::LiveTransfer;
    use kvgate_abi::sdk::sink_from_fn;
    use kvgate_abi::{event_flags, EventKind, PeerId, XferId};
    use std::sync::{mpsc, Arc};
    use std::thread::JoinHandle;

    struct TimedGpu {
        busy: Duration,
    }

    impl CopyBackend for TimedGpu {
        type Fence = Instant;
        fn issue(&mut self, _op: &CopyOp, _lane: Lane) -> Result<Instant, String> {
            Ok(Instant::now() + self.busy)
        }
        fn poll(&mut self, done_at: &Instant) -> Result<bool, String> {
            Ok(Instant::now() >= *done_at)
        }
        fn recycle(&mut self, _fence: Instant) {}
    }

    fn start(busy: Duration, config: NvlinkConfig) -> (Arc<Shared>, mpsc::Receiver<Event>, JoinHandle<()>) {
        let (tx, rx) = mpsc::channel();
        let tx = Mutex::new(tx);
        let sink = Sink::new(sink_from_fn(move |e| {
            let _ = tx.lock().unwrap().send(e);
        }));
        let shared = Arc::new(Shared { state: Mutex::new(State::default()), wake: Condvar::new(), sink, config });
        let engine = Engine::new(TimedGpu { busy }, shared.config.max_copies_in_flight_per_transfer, 1);
        let worker_shared = shared.clone();
        let handle = std::thread::spawn(move || run(&worker_shared, engine));
        (shared, rx, handle)
    }

    fn submit(shared: &Shared, xfer: u64, chunks: u64, timeout: Duration) {
        let ops = (0..chunks).map(|i| CopyOp { src: i, dst: 1000 + i, len: 1, device_index: 0 }).collect();
        let mut st = shared.lock();
        st.live.insert(XferId(xfer), LiveTransfer { locals: vec![], remotes: vec![] });
        st.pending.push(NewTransfer {
            xfer: XferId(xfer),
            peer: PeerId(1),
            deadline: Some(Instant::now() + timeout),
            ops,
            total_bytes: chunks,
            holds: Box::new(()),
        });
        drop(st);
        shared.wake.notify_one();
    }

    fn stop(shared: &Shared, handle: JoinHandle<()>) {
        shared.lock().shutting_down = true;
        shared.wake.notify_all();
        handle.join().unwrap();
    }

    const LONG: Duration = Duration::from_secs(60);

    #[test]
    fn copies_finishing_while_the_worker_sleeps_complete_the_transfer() {
        let (shared, rx, handle) = start(
            Duration::from_millis(5),
            NvlinkConfig { max_copies_in_flight_per_transfer: 1, ..NvlinkConfig::default() },
        );
        std::thread::sleep(Duration::from_millis(50)); // idle first: a submit must wake it
        submit(&shared, 1, 3, LONG);
        let e = rx.recv_timeout(Duration::from_secs(5)).expect("no event");
        assert_eq!((e.kind, e.xfer, e.bytes), (EventKind::SUCCEEDED, XferId(1), 3));
        assert!(shared.lock().live.is_empty(), "the finished id left the live table");
        stop(&shared, handle);
    }

    #[test]
    fn a_cancel_wakes_the_worker_and_fails_at_once_even_with_copies_on_the_device() {
        let (shared, rx, handle) = start(LONG, NvlinkConfig { shutdown_drain_ms: 50, ..NvlinkConfig::default() });
        submit(&shared, 1, 2, LONG);
        std::thread::sleep(Duration::from_millis(20));
        let cancelled_at = Instant::now();
        shared.lock().controls.push(Control::Fail {
            xfer: XferId(1),
            reason: ReasonCode::CANCELLED,
            message: "test".into(),
        });
        shared.wake.notify_one();
        let e = rx.recv_timeout(Duration::from_secs(5)).expect("no event");
        assert_eq!((e.kind, e.reason), (EventKind::FAILED, ReasonCode::CANCELLED));
        assert_eq!(e.flags & event_flags::QUIESCED, 0, "copies are still on the device");
        assert!(cancelled_at.elapsed() < Duration::from_secs(1), "cancel took {:?}", cancelled_at.elapsed());
        // Shutdown gives up on the stuck copies after shutdown_drain_ms and returns.
        let stopping = Instant::now();
        stop(&shared, handle);
        assert!(stopping.elapsed() < Duration::from_secs(2), "shutdown took {:?}", stopping.elapsed());
        assert!(rx.try_recv().is_err(), "no QUIESCED for copies that never finished");
    }

    #[test]
    fn the_own_deadline_wakes_a_sleeping_worker() {
        let (shared, rx, handle) =
            start(LONG, NvlinkConfig { poll_max_sleep_us: 100_000, shutdown_drain_ms: 50, ..NvlinkConfig::default() });
        let submitted = Instant::now();
        submit(&shared, 1, 1, Duration::from_millis(30));
        let e = rx.recv_timeout(Duration::from_secs(5)).expect("no event");
        assert_eq!((e.kind, e.reason), (EventKind::FAILED, ReasonCode::TIMEOUT));
        let took = submitted.elapsed();
        assert!(took >= Duration::from_millis(30) && took < Duration::from_secs(1), "timeout after {took:?}");
        stop(&shared, handle);
    }

    #[test]
    fn shutdown_fails_live_transfers_and_quiesces_them_when_their_copies_finish() {
        let (shared, rx, handle) = start(Duration::from_millis(20), NvlinkConfig::default());
        submit(&shared, 1, 2, LONG);
        submit(&shared, 2, 0, LONG);
        std::thread::sleep(Duration::from_millis(5));
        stop(&shared, handle);
        let events: Vec<Event> = rx.try_iter().collect();
        let terminal: Vec<_> = events.iter().filter(|e| e.is_terminal()).map(|e| e.xfer).collect();
        assert_eq!(terminal.len(), 2, "{events:?}");
        let first = events.iter().find(|e| e.xfer == XferId(1) && e.is_terminal()).unwrap();
        if first.kind == EventKind::FAILED && first.flags & event_flags::QUIESCED == 0 {
            assert!(events.iter().any(|e| e.xfer == XferId(1) && e.kind == EventKind::QUIESCED), "{events:?}");
        }
        assert!(shared.lock().live.is_empty());
    }
}
