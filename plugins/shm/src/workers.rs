//! The shm plugin's threads: copy workers that take chunks from the shared queue (a small transfer
//! submitted to an empty queue is copied by the submitting thread instead, `copy_claimed`), one timer
//! thread that enforces each transfer's own timeout, and the ordered, re-entrancy-safe delivery of
//! the outbox.
//! A worker never holds the state lock while copying, and nothing calls the sink under that lock.

use crate::config::ShmConfig;
use crate::plan::copy_chunk;
use crate::state::{Job, State, TimerSleep};
use kvgate_abi::sdk::{OrderedDelivery, Sink};
use kvgate_abi::{Event, ReasonCode};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Instant;

/// What every thread of one instance shares.
pub struct Shared {
    pub state: Mutex<State>,
    /// Workers wait here for queued chunks (and for shutdown).
    pub work_ready: Condvar,
    /// The timer waits here for an earlier deadline (and for shutdown).
    pub timer_wake: Condvar,
    /// `deregister` waits here for workers to let go of a region.
    pub chunk_done: Condvar,
    /// Delivers the ledger's events in the order they were decided.
    pub delivery: OrderedDelivery,
    pub sink: Sink,
    pub config: ShmConfig,
    pub threads_alive: AtomicU64,
}

impl Shared {
    /// Count a thread about to be spawned; undone by the thread's exit or [`Shared::count_thread_out`].
    pub fn count_thread_in(&self) {
        self.threads_alive.fetch_add(1, Ordering::SeqCst);
    }
    /// Undo [`Shared::count_thread_in`] for a thread that failed to spawn.
    pub fn count_thread_out(&self) {
        self.threads_alive.fetch_sub(1, Ordering::SeqCst);
    }

    pub fn new(config: ShmConfig, sink: Sink) -> Shared {
        Shared {
            state: Mutex::new(State::new()),
            work_ready: Condvar::new(),
            timer_wake: Condvar::new(),
            chunk_done: Condvar::new(),
            delivery: OrderedDelivery::new(),
            sink,
            config,
            threads_alive: AtomicU64::new(0),
        }
    }

    /// The state lock; a panic elsewhere never makes it unusable (the state stays consistent
    /// because no transition panics half-way).
    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Deliver the outbox in order. Whoever holds the delivery lock drains everything queued,
    /// including events queued by a sink that calls back into the plugin; callers that find it
    /// held return at once and leave their events to the holder. The sink is called through the
    /// ABI's `extern "C"` vtable: a host sink that panics aborts the process, so hosts must not
    /// panic in `deliver`.
    pub fn flush(&self) {
        self.delivery.flush(|| self.lock().transfers.has_events(), || self.lock().take_events(), |e| self.deliver(e));
    }

    /// Deliver everything queued, waiting for a concurrent deliverer if there is one.
    pub fn flush_blocking(&self) {
        self.delivery.flush_blocking(|| self.lock().take_events(), |e| self.deliver(e));
    }

    fn deliver(&self, event: Event) {
        log_event(&event);
        self.sink.deliver(event);
    }
}

fn log_event(event: &Event) {
    if event.kind == kvgate_abi::EventKind::FAILED || event.kind == kvgate_abi::EventKind::UNHEALTHY {
        tracing::warn!(xfer = event.xfer.0, peer = event.peer.0, reason = %event.reason, "shm: {}: {}", event.kind, event.message);
    }
}

/// Takes a thread off `threads_alive` when it ends. The spawner counts the thread in *before* it
/// starts (see [`Shared::count_thread_in`]), so `stats()` right after `open` already sees it.
struct AliveGuard<'a>(&'a AtomicU64);

impl Drop for AliveGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A copy worker: claim a chunk, copy it without the lock, complete it; until shutdown.
pub fn worker_loop(shared: &Shared) {
    let _alive = AliveGuard(&shared.threads_alive);
    let mut state = shared.lock();
    loop {
        if state.shutting_down {
            return;
        }
        let Some(job) = state.claim(shared.config.chunk_bytes) else {
            state = shared.work_ready.wait(state).unwrap_or_else(|p| p.into_inner());
            continue;
        };
        drop(state);
        if !copy_claimed(shared, job) {
            return;
        }
        state = shared.lock();
    }
}

/// Copies a claimed chunk without the lock, completes it and delivers the events it caused; run by a
/// worker, or by `submit` for a small transfer (`inline_copy_bytes`). `false`: the copy panicked,
/// and the instance is now unhealthy.
pub fn copy_claimed(shared: &Shared, job: Job) -> bool {
    // The chunk is a ledger hold: the local region cannot be deregistered (deregister waits on
    // `chunk_done`) nor the peer mapping unmapped (the transfer holds it) while it is active.
    let copied = catch_unwind(AssertUnwindSafe(|| copy_chunk(&job.pieces, job.chunk, job.streaming)));
    let mut state = shared.lock();
    if let Ok(Err(e)) = &copied {
        // Cannot happen (every piece was cut to its views at submit); never reported as copied.
        state.fail(job.xfer, e.code, format!("shm copy refused: {}", e.message));
    }
    state.complete(&job);
    if copied.is_err() {
        worker_died(shared, state, &job);
        return false;
    }
    shared.chunk_done.notify_all();
    drop(state);
    shared.flush();
    true
}

/// A worker that panicked fails everything the instance holds and leaves it unhealthy.
// CONFORMANCE: TIME-10
fn worker_died(shared: &Shared, mut state: MutexGuard<'_, State>, job: &Job) {
    state.healthy = false;
    let message = format!("shm copy worker panicked while copying transfer {}", job.xfer.0);
    state.fail_where(|_| true, ReasonCode::INTERNAL, &message);
    state.transfers.push_event(Event::unhealthy(ReasonCode::INTERNAL, message));
    shared.chunk_done.notify_all();
    drop(state);
    shared.flush();
}

/// The timer: fail transfers whose own timeout passed, sleeping until the earliest deadline.
pub fn timer_loop(shared: &Shared) {
    let _alive = AliveGuard(&shared.threads_alive);
    let mut state = shared.lock();
    loop {
        if state.shutting_down {
            return;
        }
        let next = state.expire(Instant::now());
        if state.transfers.has_events() {
            drop(state);
            shared.flush();
            state = shared.lock();
            continue;
        }
        // Recorded under the lock the wait releases, so a submit that reads it cannot miss the sleep.
        state = match next {
            Some(deadline) => {
                state.timer = TimerSleep::Until(deadline);
                let wait = deadline.saturating_duration_since(Instant::now());
                shared.timer_wake.wait_timeout(state, wait).unwrap_or_else(|p| p.into_inner()).0
            }
            None => {
                state.timer = TimerSleep::Indefinitely;
                shared.timer_wake.wait(state).unwrap_or_else(|p| p.into_inner())
            }
        };
        state.timer = TimerSleep::Awake;
    }
}
