//! The progress thread: owns the UCP worker and its endpoints, runs commands from the API threads,
//! posts puts/active messages, turns completions, replies, endpoint failures and deadlines into
//! events, and sleeps on the worker's event fd when idle. Never blocks on the network; every wait
//! is bounded by a deadline or `busy_poll_us`.

use crate::config::ResolvedMode;
use crate::deadline_heap::DeadlineHeap;
use crate::fast_map::FastMap;
use crate::receiver::{self, Receiver, SenderNotice, COMPLETIONS, EP_ERRORS, RECV_TOKEN_BIT, REPLY_EARLY_BIT};
use crate::shared::{Command, OutgoingJob, Shared};
use crate::ucp::{self, ucp_ep_h, ucp_rkey_h, ucs_status_t, Posted, Worker};
use crate::vec_pool::VecPool;
use crate::wire::{self, CommitHeader, DataHeader, Header, ReplyHeader};
use kvgate_abi::{Event, LocalKey, PeerId, ReasonCode, XferId};
use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often receiver tombstones and expired tickets are swept.
const SWEEP_INTERVAL_MS: u64 = 100;
/// Most rounds of `ucp_worker_progress` per loop iteration before commands are looked at again.
const MAX_PROGRESS_ROUNDS_PER_ITERATION: u32 = 64;
/// How long shutdown waits for its goodbye messages to leave (after `shutdown_grace_ms`).
const GOODBYE_MS: u64 = 100;
/// How long shutdown waits for UCX to hand back the endpoint closes it started (after the goodbyes).
const ENDPOINT_CLOSE_WAIT_MS: u64 = 200;
/// How long a shutdown wait sleeps when a progress round found nothing to do (leaves the core to
/// a receiver in the same process).
const SHUTDOWN_IDLE_SLEEP_US: u64 = 50;
/// Spare header and token vectors kept for reuse (one of each per transfer in flight is plenty).
const SPARE_VECS: usize = 1024;
/// Largest token list kept for reuse (a transfer that posted more frees its own).
const SPARE_TOKEN_LIST_MAX: usize = 256;

/// The one UCP endpoint to a remote instance, shared by every peer id the host connected to that
/// instance. A second UCP endpoint to the same worker must never exist: over TCP, UCT pairs the
/// sockets of both processes by per-address connection sequence numbers, so the sockets of a second
/// endpoint can end up carrying the remote's endpoint to us, and closing it (a `disconnect` of the
/// second peer id) would break the first peer's replies.
struct PeerConn {
    ep: ucp_ep_h,
    /// Created with `UCP_ERR_HANDLING_MODE_PEER` (may be force-closed; failures reported).
    peer_failure_handling: bool,
    token: u64,
    rkeys: HashMap<u64, ucp_rkey_h>,
    /// A pidfd on the peer's process, when it runs on this host and the endpoint has no peer-failure
    /// handling (shared memory): readable once that process has exited.
    process_fd: Option<i32>,
    /// The peer ids using this endpoint (closed when the last one leaves).
    users: Vec<PeerId>,
}

enum ReqKind {
    /// A data message, put or commit/cancel of a transfer.
    Xfer { xfer: u64 },
    /// The flush that ends a put-mode transfer.
    Flush { xfer: u64 },
    /// An endpoint close; these transfers quiesce when it completes.
    Close { xfers: Vec<u64> },
    /// A reply or a goodbye: nothing waits on it.
    Other,
}

struct Req {
    request: *mut c_void,
    kind: ReqKind,
    /// An active-message header UCX may read until the request completes.
    header: Vec<u8>,
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
    terminal: bool,
    unquiesced: bool,
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
    xfers: FastMap<u64, Outgoing>,
    requests: FastMap<u64, Req>,
    next_token: u64,
    timers: DeadlineHeap,
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
        Ok(Box::new(Engine {
            shared,
            worker,
            receiver,
            worker_fd,
            peers: FastMap::default(),
            conns: FastMap::default(),
            ep_tokens: FastMap::default(),
            xfers: FastMap::default(),
            requests: FastMap::default(),
            next_token: 1,
            timers: DeadlineHeap::default(),
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
        let busy_poll = Duration::from_micros(self.shared.config.busy_poll_us);
        let mut last_activity = Instant::now();
        loop {
            let held = self.shared.commands_held_for_tests.load(Ordering::SeqCst);
            let mut commands = std::mem::take(&mut self.command_buffer);
            // Look before swapping: a swap writes the flag's cache line every round, even when idle.
            if !held && self.shared.commands_pending.load(Ordering::Relaxed) && self.shared.commands_pending.swap(false, Ordering::SeqCst) {
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
        if let Some((at, _)) = self.timers.peek() {
            wait = wait.min(at.saturating_duration_since(now));
        }
        let timeout_ms = wait.as_micros().div_ceil(1000) as i32;
        self.shared.progress_thread_sleeping.store(true, Ordering::SeqCst);
        if self.shared.commands_pending.load(Ordering::SeqCst) && !self.shared.commands_held_for_tests.load(Ordering::SeqCst) {
            self.shared.progress_thread_sleeping.store(false, Ordering::SeqCst);
            return;
        }
        let mut fds = [
            libc::pollfd { fd: self.worker_fd, events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: self.shared.wake_fd, events: libc::POLLIN, revents: 0 },
        ];
        unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout_ms) };
        self.shared.progress_thread_sleeping.store(false, Ordering::SeqCst);
        if fds[1].revents != 0 {
            let mut value: u64 = 0;
            unsafe { libc::read(self.shared.wake_fd, &mut value as *mut u64 as *mut c_void, 8) };
        }
    }

    fn handle(&mut self, command: Command) {
        match command {
            Command::Connect { peer, instance, worker_address, process } => self.connect(peer, instance, &worker_address, process),
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

    fn connect(&mut self, peer: PeerId, instance: u64, address: &[u8], process: Option<u32>) {
        if let Some(&old) = self.peers.get(&peer) {
            // A reconnect ends the peer's transfers; the endpoint stays when it reaches the same instance.
            self.drop_peer(peer, "peer reconnected (new incarnation)", false, false, true, old == instance);
        }
        if let Some(conn) = self.conns.get_mut(&instance) {
            conn.users.push(peer);
            self.peers.insert(peer, instance);
            return;
        }
        let token = self.token();
        let try_peer_mode = !self.shared.config.shared_memory_only();
        let mut created = self.worker.connect(address, try_peer_mode, Some(receiver::ep_failed), token).map(|ep| (ep, try_peer_mode));
        if created.is_err() && try_peer_mode {
            tracing::info!(peer = peer.0, "ucx endpoint without peer-failure handling (the transport offers none)");
            created = self.worker.connect(address, false, Some(receiver::ep_failed), token).map(|ep| (ep, false));
        }
        match created {
            Ok((ep, peer_failure_handling)) => {
                self.ep_tokens.insert(token, instance);
                let watched = process.filter(|_| !peer_failure_handling);
                let process_fd = watched.and_then(|pid| open_process_fd(peer, pid));
                let conn = PeerConn { ep, peer_failure_handling, token, rkeys: HashMap::new(), process_fd, users: vec![peer] };
                self.conns.insert(instance, conn);
                self.peers.insert(peer, instance);
                if let (Some(pid), None) = (watched, process_fd) {
                    if process_gone(pid) {
                        self.peer_process_exited(instance, pid);
                    }
                }
            }
            Err(e) => {
                let message = format!("cannot create a UCX endpoint to peer {}: {e}", peer.0);
                tracing::warn!(reason = "peer_unreachable", peer = peer.0, "{message}");
                if let Some(p) = self.shared.lock().peers.get_mut(&peer) {
                    p.down = true;
                }
                self.shared.sink.deliver(Event::peer_down(peer, ReasonCode::PEER_UNREACHABLE, message));
            }
        }
    }

    /// The endpoint `peer` uses.
    fn conn_of(&self, peer: PeerId) -> Option<&PeerConn> {
        self.peers.get(&peer).and_then(|instance| self.conns.get(instance))
    }

    /// The remote instance is gone (goodbye, endpoint failure, process exit): every peer id that
    /// names it is marked down and dropped (`why` gets the peer id), and its endpoint closed by force.
    /// Peer ids whose endpoint this thread has not made yet are marked down too (their transfers
    /// are then refused with `PEER_LOST`).
    fn drop_instance(&mut self, instance: u64, why: impl Fn(PeerId) -> String) {
        for info in self.shared.lock().peers.values_mut().filter(|p| p.instance == instance) {
            info.down = true;
        }
        let users = self.conns.get(&instance).map(|c| c.users.clone()).unwrap_or_default();
        for peer in users {
            self.drop_peer(peer, &why(peer), true, true, true, false);
        }
    }

    /// Fail every transfer to `peer` with `PEER_LOST` and forget the peer; close its endpoint (by force
    /// where UCX allows) when no other peer id uses it and `keep_endpoint` is false. With
    /// `close_quiesces`, its transfers quiesce once the close completes; on an endpoint that stays
    /// open they end with a cancel message and quiesce on the receiver's answer, as any failure.
    /// `peer_gone`: the peer said goodbye or UCX declared it dead, so closing by force cannot upset it.
    fn drop_peer(&mut self, peer: PeerId, why: &str, announce_down: bool, peer_gone: bool, close_quiesces: bool, keep_endpoint: bool) {
        let instance = self.peers.get(&peer).copied();
        let shared_with_others = instance.and_then(|i| self.conns.get(&i)).is_some_and(|c| c.users.iter().any(|p| *p != peer));
        let closes_endpoint = instance.is_some() && !shared_with_others && !keep_endpoint;
        let victims: Vec<u64> = self.xfers.iter().filter(|(_, x)| x.job.peer == peer).map(|(id, _)| *id).collect();
        for xfer in &victims {
            if closes_endpoint {
                if let Some(x) = self.xfers.get_mut(xfer) {
                    x.next_segment = x.job.segments.len();
                    x.final_sent = true;
                    x.cancel_sent = true;
                    x.closing = close_quiesces;
                }
            }
            self.fail(*xfer, ReasonCode::PEER_LOST, why.to_string());
        }
        self.peers.remove(&peer);
        let mut closed_at_once = true;
        if let Some(instance) = instance {
            if let Some(conn) = self.conns.get_mut(&instance) {
                conn.users.retain(|p| *p != peer);
            }
            let conn = if closes_endpoint { self.conns.remove(&instance) } else { None };
            if let Some(conn) = conn {
                self.ep_tokens.remove(&conn.token);
                if let Some(fd) = conn.process_fd {
                    unsafe { libc::close(fd) };
                }
                for (_, rkey) in conn.rkeys {
                    // SAFETY: unpacked by this thread, dropped from the books here, used by nothing in flight.
                    unsafe { ucp::rkey_destroy(rkey) };
                }
                let token = self.token();
                let force = conn.peer_failure_handling || peer_gone;
                // SAFETY: the endpoint leaves `conns` here, so it is closed once.
                match unsafe { ucp::close_ep(conn.ep, force, Some(receiver::send_done), token) } {
                    Posted::Pending(request) => {
                        closed_at_once = false;
                        let xfers = if close_quiesces { victims.clone() } else { Vec::new() };
                        let kind = ReqKind::Close { xfers };
                        self.requests.insert(token, Req { request, kind, header: Vec::new() });
                    }
                    Posted::Done => {}
                    Posted::Failed(status) => {
                        tracing::warn!(reason = "transport_error", peer = peer.0, "ucx endpoint close: {}", ucp::status_text(status));
                    }
                }
            }
        }
        if closes_endpoint && closed_at_once && close_quiesces {
            self.closed(&victims);
        }
        if announce_down {
            tracing::warn!(reason = "peer_lost", peer = peer.0, "ucx peer lost: {why}");
            self.shared.sink.deliver(Event::peer_down(peer, ReasonCode::PEER_LOST, why.to_string()));
        }
    }

    /// The endpoint of these transfers is closed: nothing of theirs can land any more.
    fn closed(&mut self, xfers: &[u64]) {
        for xfer in xfers {
            if let Some(x) = self.xfers.get_mut(xfer) {
                x.awaiting_reply = false;
                x.flush_done = true;
                x.closing = false;
                // UCX moves nothing more on a closed endpoint; requests it has not handed back yet are
                // freed when their callbacks come (the transfer is gone by then).
                x.posted = 0;
            }
            self.maybe_finish(*xfer);
        }
    }

    fn start(&mut self, job: Box<OutgoingJob>) {
        let xfer = job.xfer.0;
        let deadline = job.deadline;
        if !self.peers.contains_key(&job.peer) {
            let peer = job.peer;
            let tokens = self.token_lists.take();
            self.xfers.insert(xfer, Outgoing::new(job, tokens));
            self.fail(xfer, ReasonCode::PEER_LOST, format!("no endpoint to peer {}", peer.0));
            self.maybe_finish(xfer);
            return;
        }
        let tokens = self.token_lists.take();
        self.xfers.insert(xfer, Outgoing::new(job, tokens));
        self.timers.push(deadline, xfer);
        self.pump(xfer);
    }

    /// Pump the stalled transfers again (those still stalled list themselves anew).
    fn pump_all(&mut self) {
        if self.stalled.is_empty() {
            return;
        }
        let spare = std::mem::take(&mut self.pump_buffer);
        let mut ready = std::mem::replace(&mut self.stalled, spare);
        for xfer in ready.drain(..) {
            if let Some(x) = self.xfers.get_mut(&xfer) {
                x.stalled = false;
                self.pump(xfer);
            }
        }
        self.pump_buffer = ready;
    }

    /// List `xfer` as stalled (once).
    fn stall(&mut self, xfer: u64) {
        if let Some(x) = self.xfers.get_mut(&xfer) {
            if !x.stalled {
                x.stalled = true;
                self.stalled.push(xfer);
            }
        }
    }

    /// Post as many operations of `xfer` as its window allows, then its commit or flush; listed as
    /// stalled when it has to stop with operations left.
    fn pump(&mut self, xfer: u64) {
        let max_posted = self.shared.config.max_posted_ops_per_transfer;
        let mode = self.shared.mode;
        loop {
            let Some(x) = self.xfers.get(&xfer) else { return };
            if x.terminal {
                return;
            }
            let ep = match self.conn_of(x.job.peer) {
                Some(conn) if x.posted < max_posted => conn.ep,
                // At the posted-operations bound, or no endpoint yet: pumped again after activity.
                _ => {
                    if x.next_segment < x.job.segments.len() || !x.final_sent {
                        self.stall(xfer);
                    }
                    return;
                }
            };
            if x.next_segment >= x.job.segments.len() {
                if !x.final_sent {
                    match mode {
                        ResolvedMode::Am => self.send_commit(xfer, ep, wire::AM_COMMIT),
                        ResolvedMode::Put => self.post_flush(xfer, ep),
                    }
                }
                return;
            }
            let index = x.next_segment;
            let carries_commit = x.last_data_segment == Some(index);
            let segment = x.job.segments[index];
            self.xfers.get_mut(&xfer).unwrap().next_segment += 1;
            if segment.len == 0 {
                continue;
            }
            let result = match mode {
                ResolvedMode::Am => self.post_data(xfer, ep, &segment, carries_commit),
                ResolvedMode::Put => self.post_put(xfer, ep, &segment),
            };
            if let Err((reason, message)) = result {
                self.fail(xfer, reason, message);
                self.maybe_finish(xfer);
                return;
            }
        }
    }

    /// Keep a posted request (and the header UCX may read until it completes) until its completion.
    fn track(&mut self, token: u64, posted: Posted, kind: ReqKind, header: Vec<u8>) -> Result<bool, ucs_status_t> {
        match posted {
            Posted::Done => {
                self.headers.give(header);
                Ok(false)
            }
            Posted::Pending(request) => {
                if let ReqKind::Xfer { xfer } = kind {
                    if let Some(x) = self.xfers.get_mut(&xfer) {
                        x.tokens.push(token);
                    }
                }
                self.requests.insert(token, Req { request, kind, header });
                Ok(true)
            }
            Posted::Failed(status) => {
                self.headers.give(header);
                Err(status)
            }
        }
    }

    /// Post one data message; `carries_commit`: it is the transfer's last, and tells the receiver how
    /// many messages and bytes to expect (no separate `AM_COMMIT` follows).
    fn post_data(
        &mut self,
        xfer: u64,
        ep: ucp_ep_h,
        segment: &crate::shared::ResolvedSegment,
        carries_commit: bool,
    ) -> Result<(), (ReasonCode, String)> {
        let x = self.xfers.get(&xfer).unwrap();
        let mut header = self.headers.take();
        DataHeader {
            sender: self.shared.instance,
            xfer,
            ticket: x.job.ticket.0,
            region: segment.remote_region,
            offset: segment.remote_offset,
            len: segment.len,
            commit: carries_commit.then_some((x.data_messages + 1, x.job.total_bytes)),
        }
        .encode_into(&mut header);
        let token = self.token();
        let param = ucp::send_param(
            Some(receiver::send_done),
            token,
            0,
            segment.local_memh as ucp::ucp_mem_h,
        );
        let posted = ucp::classify(unsafe {
            ucp::ucp_am_send_nbx(
                ep,
                wire::AM_DATA,
                header.as_ptr() as *const c_void,
                header.len(),
                segment.local_addr as *const c_void,
                segment.len as usize,
                &param,
            )
        });
        let pending = self
            .track(token, posted, ReqKind::Xfer { xfer }, header)
            .map_err(|s| (reason_for(s), format!("ucp_am_send_nbx: {}", ucp::status_text(s))))?;
        let x = self.xfers.get_mut(&xfer).unwrap();
        x.posted += pending as u64;
        x.data_messages += 1;
        x.awaiting_reply = true;
        x.final_sent |= carries_commit;
        Ok(())
    }

    fn send_commit(&mut self, xfer: u64, ep: ucp_ep_h, id: u32) {
        let x = self.xfers.get(&xfer).unwrap();
        let mut header = self.headers.take();
        CommitHeader {
            sender: self.shared.instance,
            xfer,
            ticket: x.job.ticket.0,
            segments: x.data_messages,
            bytes: x.job.total_bytes,
        }
        .encode_into(&mut header);
        let token = self.token();
        let param = ucp::send_param(
            Some(receiver::send_done),
            token,
            0,
            std::ptr::null_mut(),
        );
        let posted = ucp::classify(unsafe {
            ucp::ucp_am_send_nbx(ep, id, header.as_ptr() as *const c_void, header.len(), std::ptr::null(), 0, &param)
        });
        let result = self.track(token, posted, ReqKind::Xfer { xfer }, header);
        let x = self.xfers.get_mut(&xfer).unwrap();
        x.final_sent = true;
        if id == wire::AM_CANCEL {
            x.cancel_sent = true;
        }
        match result {
            Ok(pending) => {
                x.posted += pending as u64;
                x.awaiting_reply = true;
            }
            Err(status) => {
                // The receiver will never answer this message; the endpoint is broken.
                x.awaiting_reply = false;
                let message = format!("ucp_am_send_nbx (control): {}", ucp::status_text(status));
                self.fail(xfer, reason_for(status), message);
            }
        }
    }

    fn rkey_for(&mut self, peer: PeerId, remote_key: u64, xfer: u64) -> Result<ucp_rkey_h, String> {
        let instance = *self.peers.get(&peer).ok_or("no endpoint")?;
        let conn = self.conns.get_mut(&instance).ok_or("no endpoint")?;
        if let Some(rkey) = conn.rkeys.get(&remote_key) {
            return Ok(*rkey);
        }
        let x = self.xfers.get(&xfer).ok_or("no transfer")?;
        let remote = x.job.remote_regions.iter().find(|r| r.id == remote_key).ok_or("remote key not held by the job")?;
        // SAFETY: `conn.ep` is live while it is in `conns`.
        let rkey = unsafe { ucp::rkey_unpack(conn.ep, &remote.packed_rkey) }.map_err(|e| e.to_string())?;
        conn.rkeys.insert(remote_key, rkey);
        Ok(rkey)
    }

    fn post_put(&mut self, xfer: u64, ep: ucp_ep_h, segment: &crate::shared::ResolvedSegment) -> Result<(), (ReasonCode, String)> {
        let peer = self.xfers.get(&xfer).unwrap().job.peer;
        let rkey = self.rkey_for(peer, segment.remote_key, xfer).map_err(|m| (ReasonCode::TRANSPORT_ERROR, m))?;
        let token = self.token();
        let param = ucp::send_param(Some(receiver::send_done), token, 0, segment.local_memh as ucp::ucp_mem_h);
        let posted = ucp::classify(unsafe {
            ucp::ucp_put_nbx(ep, segment.local_addr as *const c_void, segment.len as usize, segment.remote_addr, rkey, &param)
        });
        let pending = self
            .track(token, posted, ReqKind::Xfer { xfer }, Vec::new())
            .map_err(|s| (reason_for(s), format!("ucp_put_nbx: {}", ucp::status_text(s))))?;
        let x = self.xfers.get_mut(&xfer).unwrap();
        x.posted += pending as u64;
        x.any_put_posted = true;
        Ok(())
    }

    /// Post the flush that makes a put-mode transfer's bytes visible remotely (or that quiesces it).
    fn post_flush(&mut self, xfer: u64, ep: ucp_ep_h) {
        let token = self.token();
        let param = ucp::send_param(Some(receiver::send_done), token, 0, std::ptr::null_mut());
        let posted = ucp::classify(unsafe { ucp::ucp_ep_flush_nbx(ep, &param) });
        let result = self.track(token, posted, ReqKind::Flush { xfer }, Vec::new());
        let x = self.xfers.get_mut(&xfer).unwrap();
        x.final_sent = true;
        match result {
            Ok(true) => x.posted += 1,
            Ok(false) => self.flush_done(xfer, ucs_status_t::UCS_OK),
            Err(status) => self.flush_done(xfer, status),
        }
    }

    fn flush_done(&mut self, xfer: u64, status: ucs_status_t) {
        let Some(x) = self.xfers.get_mut(&xfer) else { return };
        x.flush_done = true;
        if !x.terminal {
            if ucp::is_ok(status) {
                self.succeed(xfer);
            } else {
                self.fail(xfer, reason_for(status), format!("ucp_ep_flush_nbx: {}", ucp::status_text(status)));
            }
        }
        self.maybe_finish(xfer);
    }

    fn succeed(&mut self, xfer: u64) {
        let Some(x) = self.xfers.get_mut(&xfer) else { return };
        if x.terminal {
            return;
        }
        x.terminal = true;
        let bytes = x.job.total_bytes;
        self.shared.lock().live_xfers.remove(&xfer);
        self.shared.sink.deliver(Event::succeeded(XferId(xfer), bytes));
    }

    /// Make `xfer` terminal with `reason` (once) and start quiescing it.
    fn fail(&mut self, xfer: u64, reason: ReasonCode, message: String) {
        let mode = self.shared.mode;
        let Some(x) = self.xfers.get_mut(&xfer) else { return };
        if x.terminal {
            return;
        }
        x.terminal = true;
        x.next_segment = x.job.segments.len();
        let peer = x.job.peer;
        // Stop what has not started; what is on the wire completes (or fails) through its callback.
        let cancellable: Vec<*mut c_void> =
            x.tokens.iter().filter_map(|t| self.requests.get(t)).map(|r| r.request).collect();
        for request in cancellable {
            // SAFETY: tracked requests are freed only when they leave `requests`.
            unsafe { ucp::request_cancel(&self.worker, request) };
        }
        let ep = self.conn_of(peer).map(|c| c.ep);
        let x = self.xfers.get_mut(&xfer).unwrap();
        let needs_cancel_message = mode == ResolvedMode::Am && x.awaiting_reply && !x.cancel_sent;
        let needs_flush = mode == ResolvedMode::Put && x.any_put_posted && !x.final_sent;
        match ep {
            Some(ep) if needs_cancel_message => self.send_commit(xfer, ep, wire::AM_CANCEL),
            Some(ep) if needs_flush => self.post_flush(xfer, ep),
            None => {
                let x = self.xfers.get_mut(&xfer).unwrap();
                x.awaiting_reply = false;
            }
            _ => {}
        }
        let x = self.xfers.get_mut(&xfer).unwrap();
        let quiesced = x.posted == 0 && !x.awaiting_reply && !x.closing && (mode == ResolvedMode::Am || !x.any_put_posted || x.flush_done);
        tracing::warn!(reason = reason.as_str(), xfer, peer = peer.0, quiesced, "ucx transfer failed: {message}");
        let mut registry = self.shared.lock();
        registry.live_xfers.remove(&xfer);
        if quiesced {
            drop(registry);
            self.shared.sink.deliver(Event::failed_quiesced(XferId(xfer), reason, message));
        } else {
            registry.unquiesced_xfers.insert(xfer);
            drop(registry);
            x.unquiesced = true;
            let deadline = Instant::now() + Duration::from_millis(self.shared.config.quiesce_timeout_ms);
            self.timers.push(deadline, xfer);
            self.shared.sink.deliver(Event::failed(XferId(xfer), reason, message));
        }
    }

    /// Forget a terminal transfer once nothing of it is in flight; report `QUIESCED` if owed.
    fn maybe_finish(&mut self, xfer: u64) {
        let mode = self.shared.mode;
        let Some(x) = self.xfers.get(&xfer) else { return };
        let flushed = mode == ResolvedMode::Am || !x.any_put_posted || x.flush_done;
        if !x.terminal || x.posted > 0 || x.awaiting_reply || !flushed || x.closing {
            return;
        }
        let x = self.xfers.remove(&xfer).unwrap();
        let unquiesced = x.unquiesced;
        self.token_lists.give(x.tokens);
        let xfers = &self.xfers;
        self.timers.drop_stale(xfers.len(), |id| xfers.contains_key(&id));
        if unquiesced {
            self.shared.lock().unquiesced_xfers.remove(&xfer);
            self.shared.sink.deliver(Event::quiesced(XferId(xfer)));
        }
    }

    /// Completions, endpoint failures and replies gathered by callbacks during progress.
    /// Called after every progress round, and most find nothing: a small check, inlined into the
    /// loop, before the call that swaps the queues out (whose frame alone cost more than the check).
    #[inline(always)]
    fn drain(&mut self) -> bool {
        let nothing_queued = COMPLETIONS.with(|c| c.borrow().is_empty())
            && EP_ERRORS.with(|c| c.borrow().is_empty())
            && {
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
        self.headers.give(req.header);
        match req.kind {
            ReqKind::Xfer { xfer } => {
                let Some(x) = self.xfers.get_mut(&xfer) else { return };
                x.posted = x.posted.saturating_sub(1);
                let refused_by_receiver = status == ucs_status_t::UCS_ERR_REJECTED;
                if !ucp::is_ok(status) && status != ucs_status_t::UCS_ERR_CANCELED && !refused_by_receiver {
                    self.fail(xfer, reason_for(status), format!("UCX operation failed: {}", ucp::status_text(status)));
                }
                self.maybe_finish(xfer);
            }
            ReqKind::Flush { xfer } => {
                if let Some(x) = self.xfers.get_mut(&xfer) {
                    x.posted = x.posted.saturating_sub(1);
                }
                self.flush_done(xfer, status);
            }
            ReqKind::Close { xfers } => self.closed(&xfers),
            ReqKind::Other => {}
        }
    }

    fn on_reply(&mut self, xfer: u64, code: u32) {
        let Some(x) = self.xfers.get_mut(&xfer) else { return };
        if code & REPLY_EARLY_BIT != 0 {
            let reason = ReasonCode(code & !REPLY_EARLY_BIT);
            self.fail(xfer, reason, format!("receiver refused a segment: {reason}"));
            return;
        }
        x.awaiting_reply = false;
        if code == 0 {
            if x.final_sent && !x.cancel_sent {
                self.succeed(xfer);
            }
        } else {
            let reason = ReasonCode(code);
            self.fail(xfer, reason, format!("receiver refused the transfer: {reason}"));
        }
        self.maybe_finish(xfer);
    }

    /// Send `replies` (emptied): one `AM_REPLY` message per sender for up to
    /// `MAX_REPLIES_PER_MESSAGE` of them, each sender's replies in the order they were made.
    fn send_replies(&mut self, replies: &mut Vec<(u64, ReplyHeader)>) {
        if replies.len() > 1 {
            replies.sort_by_key(|(sender, _)| *sender); // stable
        }
        let mut start = 0;
        while start < replies.len() {
            let sender = replies[start].0;
            let mut end = start + 1;
            while end < replies.len() && replies[end].0 == sender && end - start < wire::MAX_REPLIES_PER_MESSAGE {
                end += 1;
            }
            self.send_reply_message(sender, &replies[start..end]);
            start = end;
        }
        replies.clear();
    }

    /// One message carrying `replies` (all to `sender`).
    fn send_reply_message(&mut self, sender: u64, replies: &[(u64, ReplyHeader)]) {
        // The endpoint to the sender's instance, whichever peer id (or ids) the host knows it by.
        let Some(ep) = self.conns.get(&sender).map(|c| c.ep) else {
            if self.endpoint_coming(sender) {
                self.replies_awaiting_endpoint.extend_from_slice(replies);
            } else {
                for (_, header) in replies {
                    tracing::warn!(reason = "peer_unreachable", xfer = header.xfer, "ucx reply dropped: no endpoint to sender {sender:#x}");
                }
            }
            return;
        };
        // One buffer for every reply message: UCX reads it until the send completes, which is
        // mostly at once (a short message); a send still pending keeps it and the next takes a new one.
        let mut bytes = std::mem::take(&mut self.reply_bytes);
        bytes.clear();
        wire::encode_replies(replies.iter().map(|(_, h)| h), &mut bytes);
        let token = self.token();
        let param = ucp::send_param(Some(receiver::send_done), token, 0, std::ptr::null_mut());
        let posted = ucp::classify(unsafe {
            ucp::ucp_am_send_nbx(ep, wire::AM_REPLY, bytes.as_ptr() as *const c_void, bytes.len(), std::ptr::null(), 0, &param)
        });
        if let Posted::Done = posted {
            self.reply_bytes = bytes;
            return;
        }
        if let Err(status) = self.track(token, posted, ReqKind::Other, bytes) {
            tracing::warn!(reason = "transport_error", "ucx reply to a sender failed: {}", ucp::status_text(status));
        }
    }

    /// Whether the host connected a peer id naming `instance` (not down) whose endpoint is not made
    /// yet: its `Connect` command is queued (the registry and the queue change under one lock).
    fn endpoint_coming(&self, instance: u64) -> bool {
        !self.conns.contains_key(&instance) && self.shared.lock().peers.values().any(|p| p.instance == instance && !p.down)
    }

    /// After a batch of commands: send the replies whose endpoint now exists; drop (logged) those
    /// whose endpoint will not come (the connect failed or was undone).
    fn retry_replies_awaiting_endpoint(&mut self) {
        // `send_replies` sends, queues again while the endpoint is still coming, or drops.
        let mut waiting = std::mem::take(&mut self.replies_awaiting_endpoint);
        self.send_replies(&mut waiting);
    }

    fn fire_timers(&mut self, now: Instant) {
        while let Some((at, xfer)) = self.timers.peek() {
            if at > now {
                return;
            }
            self.timers.pop();
            let Some(x) = self.xfers.get(&xfer) else { continue };
            if !x.terminal {
                if at >= x.job.deadline {
                    self.fail(xfer, ReasonCode::TIMEOUT, "transfer timeout_ns passed".into());
                    self.maybe_finish(xfer);
                }
            } else if x.unquiesced {
                // Closing the endpoint would not make this true (bytes already in the peer's socket
                // buffer still land when it resumes), so the transfer stays unquiesced until the peer
                // answers or UCX declares it dead; the host's quarantine bound decides meanwhile.
                tracing::warn!(
                    reason = "quiesce_pending",
                    xfer,
                    peer = x.job.peer.0,
                    "ucx peer has not confirmed within quiesce_timeout_ms = {} that cancelled transfer {xfer} stopped",
                    self.shared.config.quiesce_timeout_ms
                );
            }
        }
    }

    /// Peers watched through a pidfd (same host, no UCX peer-failure handling): a process that has
    /// exited is a lost peer, as UCX's error handler would report over TCP. Runs every
    /// `SWEEP_INTERVAL_MS`, so a killed peer fails its transfers within about that.
    fn check_peer_processes(&mut self) {
        let exited: Vec<u64> = self
            .conns
            .iter()
            .filter_map(|(instance, conn)| conn.process_fd.map(|fd| (*instance, fd)))
            .filter(|&(_, fd)| {
                let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
                let ready = unsafe { libc::poll(&mut pfd, 1, 0) };
                ready > 0 && pfd.revents != 0
            })
            .map(|(instance, _)| instance)
            .collect();
        for instance in exited {
            self.peer_process_exited(instance, 0);
        }
    }

    fn peer_process_exited(&mut self, instance: u64, pid: u32) {
        self.drop_instance(instance, |peer| {
            if pid != 0 {
                format!("peer {} process {pid} is gone", peer.0)
            } else {
                format!("peer {} process exited", peer.0)
            }
        });
    }

    fn sweep_tickets(&mut self, now: Instant) {
        let mut registry = self.shared.lock();
        registry.tickets.retain(|_, t| t.pending_writes > 0 || (now < t.deadline && !t.cancelled));
    }

    fn release_rkey(&mut self, id: u64) {
        let in_use = self.xfers.values().any(|x| x.job.remote_regions.iter().any(|r| r.id == id));
        if in_use {
            return; // destroyed with the endpoint
        }
        for conn in self.conns.values_mut() {
            if let Some(rkey) = conn.rkeys.remove(&id) {
                // SAFETY: the last user of this rkey is gone; it leaves the books here.
                unsafe { ucp::rkey_destroy(rkey) };
            }
        }
    }

    fn fail_users_of(&mut self, key: LocalKey) {
        let users: Vec<u64> = self
            .xfers
            .iter()
            .filter(|(_, x)| !x.terminal && x.job.segments.iter().any(|s| s.local_key == key.0))
            .map(|(id, _)| *id)
            .collect();
        for xfer in users {
            self.fail(xfer, ReasonCode::UNKNOWN_KEY, format!("source region {} deregistered", key.0));
            self.maybe_finish(xfer);
        }
    }

    /// Progress the worker (completions, replies, peers' messages) until `done` or `until`.
    fn progress_until(&mut self, until: Instant, done: impl Fn(&Engine) -> bool) {
        while !done(self) && Instant::now() < until {
            let mut activity = false;
            let mut rounds = 0;
            while rounds < MAX_PROGRESS_ROUNDS_PER_ITERATION && self.worker.progress() > 0 {
                rounds += 1;
                activity = true;
            }
            activity |= self.drain();
            if !activity {
                std::thread::sleep(Duration::from_micros(SHUTDOWN_IDLE_SLEEP_US));
            }
        }
    }

    /// Tell every peer this instance is going away, waiting at most `GOODBYE_MS` for the messages to leave.
    fn say_goodbye(&mut self) {
        let bye = wire::encode_bye(self.shared.instance);
        let mut tokens = Vec::new();
        let eps: Vec<ucp_ep_h> = self.conns.values().map(|c| c.ep).collect();
        for ep in eps {
            let token = self.token();
            let param = ucp::send_param(Some(receiver::send_done), token, 0, std::ptr::null_mut());
            let posted = ucp::classify(unsafe {
                ucp::ucp_am_send_nbx(ep, wire::AM_BYE, bye.as_ptr() as *const c_void, bye.len(), std::ptr::null(), 0, &param)
            });
            if let Ok(true) = self.track(token, posted, ReqKind::Other, bye.clone()) {
                tokens.push(token);
            }
        }
        let until = Instant::now() + Duration::from_millis(GOODBYE_MS);
        self.progress_until(until, |e| tokens.iter().all(|t| !e.requests.contains_key(t)));
    }

    /// Fail everything; report `QUIESCED` for what receivers confirm within `shutdown_grace_ms` (and
    /// only for that: a frozen receiver may still apply what it holds, so the rest stay unquiesced);
    /// say goodbye; close every endpoint; wait (bounded) for UCX to hand the requests back.
    /// Every wait is bounded: `shutdown_grace_ms` + `GOODBYE_MS` + `ENDPOINT_CLOSE_WAIT_MS` in all.
    fn shutdown(&mut self) {
        let grace_until = Instant::now() + Duration::from_millis(self.shared.config.shutdown_grace_ms);
        let live: Vec<u64> = self.xfers.keys().copied().collect();
        for xfer in &live {
            self.fail(*xfer, ReasonCode::SHUTDOWN, "plugin shutting down".into());
            self.maybe_finish(*xfer);
        }
        // Receivers answer the cancel messages (am) and flushes complete (put): those transfers quiesce.
        self.progress_until(grace_until, |e| e.xfers.is_empty());
        self.say_goodbye();
        let peers: Vec<PeerId> = self.peers.keys().copied().collect();
        for peer in peers {
            self.drop_peer(peer, "plugin shutting down", false, false, false, false);
        }
        let close_until = Instant::now() + Duration::from_millis(ENDPOINT_CLOSE_WAIT_MS);
        self.progress_until(close_until, |e| {
            let closes_done = e.requests.values().all(|r| !matches!(r.kind, ReqKind::Close { .. }));
            closes_done && e.receiver.borrow().pending_receives() == 0
        });
        // What no receiver confirmed stays unquiesced: the host's quarantine bound decides for it.
        let unconfirmed: Vec<u64> = self.xfers.keys().copied().collect();
        for xfer in unconfirmed {
            let x = self.xfers.remove(&xfer).expect("listed above");
            tracing::warn!(
                reason = "quiesce_unconfirmed",
                xfer,
                peer = x.job.peer.0,
                "ucx transfer {xfer} not confirmed quiesced within shutdown_grace_ms = {}: no QUIESCED is reported for it",
                self.shared.config.shutdown_grace_ms
            );
        }
        self.shared.lock().unquiesced_xfers.clear();
        // UCX must get every request back before the worker is destroyed; one still in progress is
        // released by UCX itself when it completes.
        for (_, req) in self.requests.drain() {
            // SAFETY: drained from `requests`, so freed once.
            unsafe { ucp::request_free(req.request) };
        }
        for request in self.receiver.borrow().pending_requests() {
            // SAFETY: each pending receive's request, freed once here at shutdown; no receive
            // completes after this (the worker is no longer progressed).
            unsafe { ucp::request_free(request) };
        }
        self.shared.healthy.store(false, Ordering::Release);
    }
}

/// Whether the replies gathered so far go out now: at once outside a progress burst, and inside one
/// as soon as no write is still landing (nothing more would join them) or `batch` of them are due.
/// So a reply waits at most until the next write in flight lands or the burst ends, and one message
/// answers up to `batch` transfers (on shared memory at 64 KiB, 2 a message instead of 1 moved the
/// plugin from 0.94 to 0.97 of `ucx_perftest`: docs/ucx-performance-record.md).
fn replies_go_now(due: usize, receives_in_flight: usize, batch: usize, in_progress_burst: bool) -> bool {
    !in_progress_burst || receives_in_flight == 0 || due >= batch
}

/// `pidfd_open(pid)`: a descriptor that becomes readable when the process exits; `None` (logged) when
/// the kernel refuses (no pidfd support, another pid namespace, the process already gone).
fn open_process_fd(peer: PeerId, pid: u32) -> Option<i32> {
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        let error = std::io::Error::last_os_error();
        tracing::info!(peer = peer.0, pid, "ucx peer process not watched (pidfd_open: {error}); deadlines bound its transfers");
        return None;
    }
    Some(fd as i32)
}

/// Whether `pid` names no process (`kill(pid, 0)` says ESRCH).
fn process_gone(pid: u32) -> bool {
    let rc = unsafe { libc::kill(pid as libc::pid_t, 0) };
    rc != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
}

/// The reason for a failed UCX operation: the connection's death is the peer's loss.
fn reason_for(status: ucs_status_t) -> ReasonCode {
    match status {
        ucs_status_t::UCS_ERR_CONNECTION_RESET
        | ucs_status_t::UCS_ERR_ENDPOINT_TIMEOUT
        | ucs_status_t::UCS_ERR_UNREACHABLE
        | ucs_status_t::UCS_ERR_NOT_CONNECTED => ReasonCode::PEER_LOST,
        _ => ReasonCode::TRANSPORT_ERROR,
    }
}

impl Outgoing {
    fn new(job: Box<OutgoingJob>, tokens: Vec<u64>) -> Outgoing {
        let last_data_segment = job.segments.iter().rposition(|s| s.len > 0);
        Outgoing {
            job,
            next_segment: 0,
            posted: 0,
            data_messages: 0,
            last_data_segment,
            final_sent: false,
            cancel_sent: false,
            awaiting_reply: false,
            flush_done: false,
            any_put_posted: false,
            terminal: false,
            unquiesced: false,
            closing: false,
            stalled: false,
            tokens,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::replies_go_now;

    #[test]
    fn replies_are_held_in_a_burst_until_the_batch_is_due() {
        // In a burst with writes still landing: held below the batch, sent at it and past it.
        assert!(!replies_go_now(1, 3, 2, true));
        assert!(replies_go_now(2, 3, 2, true));
        assert!(replies_go_now(3, 3, 2, true));
        assert!(!replies_go_now(3, 1, 4, true));
        assert!(replies_go_now(4, 1, 4, true));
        // A batch of 1 never holds.
        assert!(replies_go_now(1, 5, 1, true));
    }

    #[test]
    fn replies_go_once_nothing_else_is_landing_or_the_burst_ends() {
        assert!(replies_go_now(1, 0, 2, true), "no write in flight: nothing would join them");
        assert!(replies_go_now(1, 3, 2, false), "after the burst every held reply goes");
        assert!(replies_go_now(0, 0, 64, false));
    }
}
