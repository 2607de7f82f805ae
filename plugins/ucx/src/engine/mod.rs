//! The progress thread: owns the UCP worker and its endpoints, runs commands from the API threads,
//! posts puts/active messages, turns completions, replies, endpoint failures and deadlines into
//! events, and sleeps on the worker's event fd when idle. Never blocks on the network; every wait
//! is bounded by a deadline or `busy_poll_us`.
//!
//! This file holds the thread's books and its loop (commands, progress rounds, completions, timers).
//! Endpoints and peers are in `peers`, outgoing transfers in `outgoing`, a receiver's replies to its
//! senders in `replies`, and the bounded shutdown in `shutdown`.

mod outgoing;
mod peers;
mod replies;
mod shutdown;

use crate::config::ResolvedMode;
use crate::fast_map::{FastHashBuilder, FastMap, FastSet};
use crate::receiver::{self, Receiver, SenderNotice, COMPLETIONS, EP_ERRORS, RECV_TOKEN_BIT, REPLY_EARLY_BIT};
use crate::shared::{Command, OutgoingJob, RegionHold, Shared};
use crate::ucp::{self, ucp_ep_h, ucp_rkey_h, ucs_status_t, Posted, Worker};
use crate::vec_pool::VecPool;
use crate::wire::{self, CommitHeader, DataHeader, Header, ReplyHeader};
use kvgate_abi::sdk::{Admission, TransferLedger};
use kvgate_abi::{event_flags, Event, EventKind, LocalKey, PeerId, ReasonCode, XferId};
use replies::replies_go_now;
use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often receiver tombstones and expired tickets are swept.
const SWEEP_INTERVAL_MS: u64 = 100;
/// Most rounds of `ucp_worker_progress` per loop iteration before commands are looked at again.
const MAX_PROGRESS_ROUNDS_PER_ITERATION: u32 = 64;
/// Spare header and token vectors kept for reuse (one of each per transfer in flight is plenty).
const SPARE_VECS: usize = 1024;
/// Largest token list kept for reuse (a transfer that posted more frees its own).
const SPARE_TOKEN_LIST_MAX: usize = 256;

thread_local! {
    /// Set on the progress thread (a call made from inside an event it delivers must not wait for it).
    static PROGRESS_THREAD: Cell<bool> = const { Cell::new(false) };
}

/// Whether the calling thread is an instance's progress thread.
pub fn on_progress_thread() -> bool {
    PROGRESS_THREAD.with(|t| t.get())
}

/// The one UCP endpoint to a remote instance, shared by every peer id the host connected to that
/// instance. A second UCP endpoint to the same worker must never exist: over TCP, UCT pairs the
/// sockets of both processes by per-address connection sequence numbers, so the sockets of a second
/// endpoint can end up carrying the remote's endpoint to us, and closing it (a `disconnect` of the
/// second peer id) would break the first peer's replies.
struct PeerConn {
    ep: ucp_ep_h,
    /// The remote worker address it was created with.
    address: Vec<u8>,
    /// Created with `UCP_ERR_HANDLING_MODE_PEER` (may be force-closed; failures reported).
    peer_failure_handling: bool,
    token: u64,
    rkeys: HashMap<u64, ucp_rkey_h>,
    /// A pidfd on the peer's process, when it runs on this host and the endpoint has no peer-failure
    /// handling (shared memory): readable once that process has exited.
    process_fd: Option<i32>,
    /// The peer ids using this endpoint (closed when the last one leaves).
    users: Vec<PeerId>,
    /// Requests posted on this endpoint that UCX has not handed back yet.
    outstanding: u64,
    /// No peer id uses it since the host disconnected the last one (UCX reported no failure): kept
    /// open for `endpoint_linger_ms` from this instant for a reconnect of the same remote instance,
    /// with the transfers that were cut off (quiesced if it is closed after all).
    parked: Option<(Instant, Vec<u64>)>,
}

/// An endpoint being torn down: closed (by force or by flush), but UCX may still hold requests
/// posted on it, and UCT may still read their source memory or invoke their completions. It is
/// retired (its remote keys destroyed, its transfers quiesced) only once the close has completed and
/// every one of its requests has been handed back.
struct RetiringConn {
    instance: u64,
    rkeys: HashMap<u64, ucp_rkey_h>,
    outstanding: u64,
    /// The close request is still in UCX's hands.
    close_pending: bool,
    /// Transfers that quiesce once it is retired.
    quiesce: Vec<u64>,
    since: Instant,
    /// `endpoint_retire_pending` already logged.
    warned: bool,
    /// UCX would not close it and its peer is gone: its requests are left to UCX (their holds stay
    /// in `requests`), its remote keys are never destroyed.
    abandoned: bool,
}

enum ReqKind {
    /// A data message, put or commit/cancel of a transfer.
    Xfer { xfer: u64 },
    /// The flush that ends a put-mode transfer.
    Flush { xfer: u64 },
    /// The close of the retiring endpoint with this token.
    Close { conn: u64 },
    /// A reply or a goodbye: nothing waits on it.
    Other,
}

struct Req {
    request: *mut c_void,
    kind: ReqKind,
    /// An active-message header UCX may read until the request completes.
    header: Vec<u8>,
    /// Data bytes this request carries (counted in `Engine::posted_bytes` until it completes).
    bytes: u64,
    /// The token of the endpoint it was posted on (0: none, an endpoint close).
    conn: u64,
    /// The source region it reads, held registered until UCX hands the request back.
    hold: Option<RegionHold>,
}

struct Outgoing {
    job: Box<OutgoingJob>,
    next_segment: usize,
    posted: u64,
    data_messages: u64,
    /// The index of the last segment with bytes (active-message mode: its message carries the commit).
    last_data_segment: Option<usize>,
    final_sent: bool,
    cancel_sent: bool,
    awaiting_reply: bool,
    flush_done: bool,
    any_put_posted: bool,
    /// `fail` is stopping it: what that does (a cancel message that cannot be sent, a flush that
    /// completes at once) neither succeeds it nor replaces the first cause.
    failing: bool,
    /// Its endpoint is being closed; it quiesces when the close completes.
    closing: bool,
    /// Listed in `Engine::stalled`: it has operations left to post and waits for room or an endpoint.
    stalled: bool,
    /// Tokens of the requests it posted (some may have completed since).
    tokens: Vec<u64>,
}

pub struct Engine {
    shared: Arc<Shared>,
    worker: Worker,
    receiver: Box<RefCell<Receiver>>,
    worker_fd: i32,
    /// Connected peer ids and the remote instance each one names.
    peers: FastMap<PeerId, u64>,
    /// One endpoint per remote instance.
    conns: FastMap<u64, PeerConn>,
    /// Endpoint tokens (the error callback's argument) and the instance each one reaches.
    ep_tokens: FastMap<u64, u64>,
    /// Closed endpoints UCX may still hold requests of, by token.
    retiring: FastMap<u64, RetiringConn>,
    /// (remote instance, worker address) of every endpoint this worker closed: a second endpoint to
    /// the same remote worker address is never made (UCX 1.13's TCP transport crashes on it; README,
    /// Requests, endpoints and memory), so a `connect` to one of them is refused `PEER_UNREACHABLE`.
    closed_endpoints: FastSet<(u64, Vec<u8>)>,
    /// Outgoing transfers until terminal and quiesced (the SDK's ledger: terminal events, deadlines,
    /// quiesce bounds). Each holds one ledger hold while anything of it may still land
    /// ([`Engine::maybe_finish`] releases it).
    xfers: TransferLedger<Outgoing, FastHashBuilder>,
    requests: FastMap<u64, Req>,
    /// Bytes of the data messages and puts posted to UCX and not completed yet, over all transfers;
    /// at most `max_posted_bytes` (a message alone may exceed it).
    posted_bytes: u64,
    next_token: u64,
    last_sweep: Instant,
    /// Replies to a sender whose `connect` the host made but whose endpoint this thread has not
    /// created yet (its `Connect` command is queued behind the progress round that took the
    /// sender's writes): sent once the endpoint exists, dropped (logged) if it never will.
    replies_awaiting_endpoint: Vec<(u64, ReplyHeader)>,
    /// Buffers reused every round (commands taken from the queue, completions and endpoint failures
    /// gathered by callbacks, transfers to pump, replies and their encoded bytes), so a steady stream
    /// allocates nothing for them.
    command_buffer: VecDeque<Command>,
    completion_buffer: Vec<(u64, ucs_status_t)>,
    failure_buffer: Vec<(u64, ucs_status_t)>,
    pump_buffer: Vec<u64>,
    /// Transfers with operations left to post that `pump` had to leave: at
    /// `max_posted_ops_per_transfer`, or with no endpoint yet. Only these are pumped again after
    /// activity, so a loop round costs nothing per transfer merely awaiting its reply.
    stalled: Vec<u64>,
    notice_buffer: Vec<SenderNotice>,
    reply_buffer: Vec<(u64, ReplyHeader)>,
    reply_bytes: Vec<u8>,
    /// Active-message headers (kept alive until UCX completes their send) and transfers' token lists.
    headers: VecPool<u8>,
    token_lists: VecPool<u64>,
    /// `reply_batch_transfers`: replies held together while writes are still landing in a burst.
    reply_batch: usize,
    /// Inside the progress rounds of one loop iteration (replies may be held); false after them.
    in_progress_burst: bool,
    /// Holds of the requests still in UCX at shutdown: dropped with the engine, after the worker
    /// (fields drop in order), so their regions stay registered while UCX could touch them.
    held_past_shutdown: Vec<RegionHold>,
}

impl Engine {
    /// Set up the worker's handlers. Runs on the opening thread; `run` then moves to the progress thread.
    pub fn new(shared: Arc<Shared>, worker: Worker) -> Result<Box<Engine>, ucp::UcxError> {
        let worker_fd = worker.event_fd()?;
        let receiver = Box::new(RefCell::new(Receiver::new(shared.clone(), worker.raw)));
        let arg = &*receiver as *const RefCell<Receiver> as *mut c_void;
        worker.set_am_handler(wire::AM_DATA, Some(receiver::am_data), arg)?;
        worker.set_am_handler(wire::AM_COMMIT, Some(receiver::am_commit), arg)?;
        worker.set_am_handler(wire::AM_CANCEL, Some(receiver::am_cancel), arg)?;
        worker.set_am_handler(wire::AM_REPLY, Some(receiver::am_reply), arg)?;
        worker.set_am_handler(wire::AM_BYE, Some(receiver::am_bye), arg)?;
        let reply_batch = shared.config.reply_batch_transfers as usize;
        let mut xfers = TransferLedger::with_hasher(FastHashBuilder::default());
        xfers.set_quiesce_bound(Some(Duration::from_millis(shared.config.quiesce_timeout_ms)));
        Ok(Box::new(Engine {
            shared,
            worker,
            receiver,
            worker_fd,
            peers: FastMap::default(),
            conns: FastMap::default(),
            ep_tokens: FastMap::default(),
            retiring: FastMap::default(),
            closed_endpoints: FastSet::default(),
            xfers,
            requests: FastMap::default(),
            posted_bytes: 0,
            next_token: 1,
            last_sweep: Instant::now(),
            replies_awaiting_endpoint: Vec::new(),
            command_buffer: VecDeque::new(),
            completion_buffer: Vec::new(),
            failure_buffer: Vec::new(),
            pump_buffer: Vec::new(),
            stalled: Vec::new(),
            notice_buffer: Vec::new(),
            reply_buffer: Vec::new(),
            reply_bytes: Vec::new(),
            headers: VecPool::new(SPARE_VECS, wire::MAX_HEADER_BYTES),
            token_lists: VecPool::new(SPARE_VECS, SPARE_TOKEN_LIST_MAX),
            reply_batch,
            in_progress_burst: false,
            held_past_shutdown: Vec::new(),
        }))
    }

    fn token(&mut self) -> u64 {
        let t = self.next_token;
        self.next_token += 1;
        debug_assert!(t & RECV_TOKEN_BIT == 0);
        t
    }

    /// The progress loop; returns after `Command::Shutdown`.
    pub fn run(mut self: Box<Self>) {
        PROGRESS_THREAD.with(|t| t.set(true));
        let busy_poll = Duration::from_micros(self.shared.config.busy_poll_us);
        let mut last_activity = Instant::now();
        loop {
            let held = self.shared.commands_held_for_tests.load(Ordering::SeqCst);
            let mut commands = std::mem::take(&mut self.command_buffer);
            // Look before swapping: a swap writes the flag's cache line every round, even when idle.
            if !held
                && self.shared.commands_pending.load(Ordering::Relaxed)
                && self.shared.commands_pending.swap(false, Ordering::SeqCst)
            {
                std::mem::swap(&mut self.shared.lock().commands, &mut commands);
            }
            let mut activity = !commands.is_empty();
            while let Some(command) = commands.pop_front() {
                if let Command::Shutdown = command {
                    self.shutdown();
                    return;
                }
                self.handle(command);
            }
            self.command_buffer = commands;
            if !self.replies_awaiting_endpoint.is_empty() {
                self.retry_replies_awaiting_endpoint();
            }
            let mut rounds = 0;
            while rounds < MAX_PROGRESS_ROUNDS_PER_ITERATION && self.worker.progress() > 0 {
                rounds += 1;
                activity = true;
                // Complete and answer what this round finished before progressing further: a receiver
                // taking a burst of messages replies as they land (not after the burst), so the sender's
                // window keeps moving, `reply_batch_transfers` at a time while more writes are landing.
                self.in_progress_burst = true;
                self.drain();
                // A command queued meanwhile (a submit from the event sink, on this thread, or from
                // the host) is taken now rather than after the burst: a transfer starts as soon as
                // the one before it completes, as a window refilled on completion must.
                if self.shared.commands_pending.load(Ordering::Relaxed) {
                    break;
                }
            }
            // The burst is over: whatever replies are held go now.
            self.in_progress_burst = false;
            activity |= self.drain();
            if activity {
                // A window opens only when something completed or arrived.
                self.pump_all();
            }
            let now = Instant::now();
            self.fire_timers(now);
            if now.duration_since(self.last_sweep) >= Duration::from_millis(SWEEP_INTERVAL_MS) {
                self.last_sweep = now;
                self.receiver.borrow_mut().sweep(now);
                self.sweep_tickets(now);
                self.check_peer_processes();
                self.check_retiring(now);
                self.close_lingering(now);
            }
            if activity {
                last_activity = now;
                continue;
            }
            // Poll for `busy_poll_us` after the last activity whatever is in flight: a sender's
            // transfers awaiting their reply have no UCX request pending, and a receiver between two
            // messages of a stream has nothing pending at all; sleeping there makes the peer pay a
            // wake-up signal (a socket write) and this thread a wake-up for every message.
            if now.duration_since(last_activity) < busy_poll {
                // Yield rather than spin: on a small machine the thread that would complete the
                // work (the host, a receiver in the same process) may be waiting for this core.
                std::thread::yield_now();
                continue;
            }
            self.sleep(now);
        }
    }

    /// Arm the worker and wait on its fd and the wake fd, at most until the next deadline.
    fn sleep(&mut self, now: Instant) {
        match self.worker.arm() {
            Ok(true) => {}
            Ok(false) => return,
            Err(e) => {
                tracing::warn!(reason = "transport_error", "ucx worker arm: {e}");
                std::thread::sleep(Duration::from_millis(1));
                return;
            }
        }
        let mut wait = Duration::from_millis(SWEEP_INTERVAL_MS);
        if let Some(at) = self.xfers.next_due() {
            wait = wait.min(at.saturating_duration_since(now));
        }
        let timeout_ms = wait.as_micros().div_ceil(1000) as i32;
        self.shared.progress_thread_sleeping.store(true, Ordering::SeqCst);
        if self.shared.commands_pending.load(Ordering::SeqCst)
            && !self.shared.commands_held_for_tests.load(Ordering::SeqCst)
        {
            self.shared.progress_thread_sleeping.store(false, Ordering::SeqCst);
            return;
        }
        let mut fds = [
            libc::pollfd { fd: self.worker_fd, events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: self.shared.wake_fd, events: libc::POLLIN, revents: 0 },
        ];
        // SAFETY: `fds` is an array of two valid pollfds on the stack and the count says 2; the timeout is
        // bounded.
        unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout_ms) };
        self.shared.progress_thread_sleeping.store(false, Ordering::SeqCst);
        if fds[1].revents != 0 {
            let mut value: u64 = 0;
            // SAFETY: reads 8 bytes into a u64 on the stack from the instance's own eventfd, which lives as
            // long as `shared`.
            unsafe { libc::read(self.shared.wake_fd, &mut value as *mut u64 as *mut c_void, 8) };
        }
    }

    fn handle(&mut self, command: Command) {
        match command {
            Command::Connect { peer, instance, worker_address, process } => {
                self.connect(peer, instance, &worker_address, process)
            }
            Command::Disconnect { peer } => {
                self.drop_peer(peer, "peer disconnected by the host", false, false, true, false);
            }
            Command::Submit(job) => self.start(job),
            Command::Cancel(xfer) => self.fail(xfer.0, ReasonCode::CANCELLED, "cancelled by the host".into()),
            Command::ReleaseRemoteKey(id) => self.release_rkey(id),
            Command::Deregistered(key) => self.fail_users_of(key),
            Command::Shutdown => unreachable!("handled by run"),
        }
    }

    /// Keep a posted request (with the header UCX may read and the hold on the source region it
    /// reads) until its completion, counted on the endpoint `conn` it was posted on.
    fn track(
        &mut self,
        token: u64,
        posted: Posted,
        kind: ReqKind,
        header: Vec<u8>,
        conn: u64,
        hold: Option<RegionHold>,
    ) -> Result<bool, ucs_status_t> {
        match posted {
            Posted::Done => {
                self.headers.give(header);
                Ok(false)
            }
            Posted::Pending(request) => {
                if let ReqKind::Xfer { xfer } = kind {
                    if let Some(x) = self.xfers.get_mut(XferId(xfer)) {
                        x.tokens.push(token);
                    }
                }
                if let Some(c) = self.ep_tokens.get(&conn).and_then(|i| self.conns.get_mut(i)) {
                    c.outstanding += 1;
                } else if let Some(r) = self.retiring.get_mut(&conn) {
                    r.outstanding += 1;
                }
                self.requests.insert(token, Req { request, kind, header, bytes: 0, conn, hold });
                Ok(true)
            }
            Posted::Failed(status) => {
                self.headers.give(header);
                Err(status)
            }
        }
    }

    /// A request posted on endpoint `conn` was handed back: an endpoint being retired may now be.
    fn request_returned(&mut self, conn: u64) {
        if let Some(c) = self.ep_tokens.get(&conn).and_then(|i| self.conns.get_mut(i)) {
            c.outstanding = c.outstanding.saturating_sub(1);
        } else if let Some(r) = self.retiring.get_mut(&conn) {
            r.outstanding = r.outstanding.saturating_sub(1);
            self.maybe_retire(conn);
        }
    }

    /// Completions, endpoint failures and replies gathered by callbacks during progress.
    /// Called after every progress round, and most find nothing: a small check, inlined into the
    /// loop, before the call that swaps the queues out (whose frame alone cost more than the check).
    #[inline(always)]
    fn drain(&mut self) -> bool {
        let nothing_queued =
            COMPLETIONS.with(|c| c.borrow().is_empty()) && EP_ERRORS.with(|c| c.borrow().is_empty()) && {
                let r = self.receiver.borrow();
                r.byes.is_empty() && r.notices.is_empty() && r.replies.is_empty()
            };
        !nothing_queued && self.drain_queued()
    }

    /// [`Engine::drain`] once something is queued.
    #[inline(never)]
    fn drain_queued(&mut self) -> bool {
        // Swap with this thread's reused buffers (empty, capacity kept) rather than take.
        let mut completions = std::mem::take(&mut self.completion_buffer);
        let mut failures = std::mem::take(&mut self.failure_buffer);
        COMPLETIONS.with(|c| std::mem::swap(&mut *c.borrow_mut(), &mut completions));
        EP_ERRORS.with(|c| std::mem::swap(&mut *c.borrow_mut(), &mut failures));
        let byes = std::mem::take(&mut self.receiver.borrow_mut().byes);
        let mut activity = !(completions.is_empty() && failures.is_empty() && byes.is_empty());
        for instance in byes {
            self.drop_instance(instance, |peer| format!("peer {} shut down", peer.0));
        }
        for (token, status) in completions.drain(..) {
            if token & RECV_TOKEN_BIT != 0 {
                self.receiver.borrow_mut().on_recv_done(token, status);
                continue;
            }
            self.on_complete(token, status);
        }
        for (token, status) in failures.drain(..) {
            if let Some(instance) = self.ep_tokens.get(&token).copied() {
                let status = ucp::status_text(status);
                self.drop_instance(instance, |peer| format!("UCX endpoint to peer {} failed: {status}", peer.0));
            }
        }
        self.completion_buffer = completions;
        self.failure_buffer = failures;
        // Taken after the completions: a receive that just finished answers in this same round.
        let mut notices = std::mem::take(&mut self.notice_buffer);
        let mut replies = std::mem::take(&mut self.reply_buffer);
        {
            let mut r = self.receiver.borrow_mut();
            std::mem::swap(&mut r.notices, &mut notices);
            if replies_go_now(r.replies.len(), r.pending_receives(), self.reply_batch, self.in_progress_burst) {
                std::mem::swap(&mut r.replies, &mut replies);
            }
        }
        activity |= !(notices.is_empty() && replies.is_empty());
        for notice in notices.drain(..) {
            self.on_reply(notice.xfer, notice.code);
        }
        self.send_replies(&mut replies);
        self.notice_buffer = notices;
        self.reply_buffer = replies;
        // Replies sent during the loop may have queued more work for the next round.
        let more = self.receiver.borrow().replies.len() + self.receiver.borrow().notices.len();
        activity || more > 0
    }

    fn on_complete(&mut self, token: u64, status: ucs_status_t) {
        let Some(req) = self.requests.remove(&token) else { return };
        // SAFETY: removed from `requests` above, so freed once.
        unsafe { ucp::request_free(req.request) };
        self.posted_bytes -= req.bytes;
        self.headers.give(req.header);
        // UCX has handed the request back: nothing reads its source any more.
        drop(req.hold);
        match req.kind {
            ReqKind::Xfer { xfer } => {
                if let Some(x) = self.xfers.get_mut(XferId(xfer)) {
                    x.posted = x.posted.saturating_sub(1);
                    let refused_by_receiver = status == ucs_status_t::UCS_ERR_REJECTED;
                    if !ucp::is_ok(status) && status != ucs_status_t::UCS_ERR_CANCELED && !refused_by_receiver {
                        let message = format!("UCX operation failed: {}", ucp::status_text(status));
                        self.fail(xfer, reason_for(status), message);
                    }
                    self.maybe_finish(xfer);
                }
            }
            ReqKind::Flush { xfer } => {
                if let Some(x) = self.xfers.get_mut(XferId(xfer)) {
                    x.posted = x.posted.saturating_sub(1);
                }
                self.flush_done(xfer, status);
            }
            ReqKind::Close { conn } => {
                if let Some(r) = self.retiring.get_mut(&conn) {
                    r.close_pending = false;
                }
                self.maybe_retire(conn);
            }
            ReqKind::Other => {}
        }
        if req.conn != 0 {
            self.request_returned(req.conn);
        }
    }

    // CONFORMANCE: TIME-1, TIME-2, TIME-3, TIME-4, TIME-12 (each transfer's own deadline, from the ledger)
    fn fire_timers(&mut self, now: Instant) {
        if self.xfers.next_due().is_none_or(|at| at > now) {
            return;
        }
        let due = self.xfers.take_due(now);
        for xfer in due.timed_out {
            self.fail(xfer.0, ReasonCode::TIMEOUT, "transfer timeout_ns passed".into());
            self.maybe_finish(xfer.0);
        }
        for xfer in due.quiesce_overdue {
            // Closing the endpoint would not make this true (bytes already in the peer's socket
            // buffer still land when it resumes), so the transfer stays unquiesced until the peer
            // answers or UCX declares it dead; the host's quarantine bound decides meanwhile.
            let peer = self.xfers.get(xfer).map_or(0, |x| x.job.peer.0);
            tracing::warn!(
                reason = "quiesce_pending",
                xfer = xfer.0,
                peer,
                "ucx peer has not confirmed within quiesce_timeout_ms = {} that cancelled transfer {} stopped",
                self.shared.config.quiesce_timeout_ms,
                xfer.0
            );
        }
    }

    /// Deliver what the ledger decided, after moving the registry's books the same way (a `stats()`
    /// read after an event never counts its transfer as live).
    // CONFORMANCE: OBS-2 (live_transfers lowered before the terminal event is delivered)
    fn deliver_ledger_events(&mut self) {
        if !self.xfers.has_events() {
            return;
        }
        let events = self.xfers.take_events();
        {
            let mut registry = self.shared.lock();
            for e in &events {
                let xfer = e.xfer.0;
                match e.kind {
                    EventKind::SUCCEEDED => {
                        registry.live_xfers.remove(&xfer);
                    }
                    EventKind::FAILED => {
                        registry.live_xfers.remove(&xfer);
                        if e.flags & event_flags::QUIESCED == 0 {
                            registry.unquiesced_xfers.insert(xfer);
                        }
                    }
                    EventKind::QUIESCED => {
                        registry.unquiesced_xfers.remove(&xfer);
                    }
                    _ => {}
                }
            }
        }
        for event in events {
            self.shared.sink.deliver(event);
        }
    }

    fn sweep_tickets(&mut self, now: Instant) {
        let mut registry = self.shared.lock();
        registry.tickets.retain(|_, t| t.pending_writes > 0 || (now < t.deadline && !t.cancelled));
    }
}

/// The reason for a failed UCX operation: the connection's death is the peer's loss.
// CONFORMANCE: OBS-1 (every UCX failure maps to a reason code ABI v1 defines)
fn reason_for(status: ucs_status_t) -> ReasonCode {
    match status {
        ucs_status_t::UCS_ERR_CONNECTION_RESET
        | ucs_status_t::UCS_ERR_ENDPOINT_TIMEOUT
        | ucs_status_t::UCS_ERR_UNREACHABLE
        | ucs_status_t::UCS_ERR_NOT_CONNECTED => ReasonCode::PEER_LOST,
        _ => ReasonCode::TRANSPORT_ERROR,
    }
}
