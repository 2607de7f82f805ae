//! The one worker thread of an instance: moves submitted transfers and controls into the engine,
//! steps it, publishes counts and delivers events. Owns the poll cadence: blocks on the condvar
//! when idle, yields for `poll_spin_us` after progress, then sleeps with doubling backoff capped at
//! `poll_max_sleep_us` (never a busy spin). Never holds the state lock while delivering events.

use crate::config::NvlinkConfig;
use crate::cuda::CudaBackend;
use crate::engine::Engine;
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
pub fn run(shared: &Shared, mut engine: Engine<CudaBackend>) {
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
                    Control::ForgetPeerStreams { peer } => engine.backend_mut().forget_peer(peer.0),
                }
            }
            st.shutting_down
        };
        if shutting {
            engine.fail_all(None, ReasonCode::SHUTDOWN, "nvlink: plugin shutting down");
            drain_deadline.get_or_insert_with(|| Instant::now() + Duration::from_millis(shared.config.shutdown_drain_ms));
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
