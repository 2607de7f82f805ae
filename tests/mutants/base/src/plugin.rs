//! The plugin's calls and its state table. Every call takes the state lock briefly and never waits on
//! the peer (sends go to an outbox the worker flushes); the worker (worker.rs) copies and keeps time.
//! Each [`crate::Faults`] switch changes one behaviour, marked `FAULT:` where it acts.

use crate::link::{abstract_addr, Link};
use crate::wire::{encode_key, parse_endpoint, parse_key, Msg, RemoteMap, ENDPOINT_PREFIX};
use crate::Faults;
use kvgate_abi::sdk::{Plugin, Sink};
use kvgate_abi::*;
use std::collections::{HashMap, HashSet};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixDatagram;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    WaitingForTicket,
    Ready,
    Copying,
    WaitingForAck,
    /// UDP: failed while the receiver may still write it (a commit sent, no answer yet); `QUIESCED`
    /// comes with the receiver's answer, or once the deadline plus [`COMMIT_GRACE_MS`] has passed
    /// (the receiver refuses a commit past the deadline).
    Unquiesced,
    /// Terminal already reported, the copy still running (only under a fault).
    Finishing,
    /// Kept for ever (only under a fault).
    Leaked,
}

/// How long past its deadline a transfer failed while its commit was unanswered waits before it is
/// reported quiesced.
pub(crate) const COMMIT_GRACE_MS: u64 = 100;

/// One resolved segment: raw addresses in this process, and (for UDP) where it goes in the peer's
/// region.
#[derive(Clone, Copy)]
pub(crate) struct Piece {
    pub src: u64,
    pub dst: u64,
    pub len: u64,
    pub in_range: bool,
    /// The peer's local key for the destination region, and the offset in it.
    pub remote_key: u64,
    pub remote_offset: u64,
}

pub(crate) struct Transfer {
    pub peer: u64,
    pub ticket: u64,
    pub deadline: Instant,
    pub pieces: Arc<Vec<Piece>>,
    pub _keep: Vec<Arc<RemoteMap>>,
    pub local_keys: Vec<u64>,
    pub phase: Phase,
    pub reported: bool,
    pub stop: Arc<AtomicBool>,
    /// Stopped because its source region went, to be reported `SUCCEEDED` (only under a fault).
    pub fail_open: bool,
    /// Cancelled, the cancel queued for the worker (only under a fault): never picked for a copy.
    pub cancel_queued: bool,
}

#[derive(Default)]
pub(crate) struct State {
    pub shut: bool,
    pub regions: HashMap<u64, (u64, u64)>,
    pub peers: HashMap<u64, String>,
    /// UDP: where a peer's hello came from, the path to answer it on (a fault proxy, say).
    pub routes: HashMap<u64, String>,
    /// UDP, sender: data datagrams of each copying transfer the receiver has staged.
    pub got: HashMap<u64, u32>,
    /// UDP, receiver: transfers being staged, by (sender address, transfer).
    pub incoming: HashMap<(String, u64), crate::udp_rx::Incoming>,
    pub remotes: HashMap<u64, (u64, Arc<RemoteMap>)>,
    pub transfers: HashMap<u64, Transfer>,
    pub granted: HashSet<(u64, u64)>,
    pub tickets: HashMap<(u64, u64), Instant>,
    pub outbox: Vec<(String, Msg)>,
    /// Cancels queued for the worker, and when it last ended one (only under a fault).
    pub queued_cancels: std::collections::VecDeque<u64>,
    pub last_queued_cancel: Option<Instant>,
    next_key: u64,
}

pub(crate) struct Shared {
    pub name: &'static str,
    pub sink: Sink,
    pub faults: Faults,
    pub segment_delay_us: u64,
    pub socket: Link,
    pub endpoint: Vec<u8>,
    pub state: Mutex<State>,
    pub stop_worker: AtomicBool,
    pub worker_alive: AtomicBool,
    /// `SUCCEEDED` events decided so far (for `lose_some_successes`).
    pub successes: AtomicU64,
}

impl Shared {
    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether ending `t` now leaves it unquiesced: a UDP commit is out and unanswered.
    pub fn awaits_verdict(&self, t: &Transfer) -> bool {
        self.socket.is_udp() && t.phase == Phase::WaitingForAck
    }

    /// Fail a transfer whose UDP commit is unanswered: reported now, quiesced later (see
    /// [`Phase::Unquiesced`]).
    pub fn fail_unquiesced(&self, t: &mut Transfer, xfer: u64, reason: ReasonCode, message: &str) {
        t.reported = true;
        t.phase = Phase::Unquiesced;
        self.failed(xfer, reason, message.to_string(), false);
    }

    /// The peers whose endpoint (or the address a datagram came from) is `addr`.
    pub fn peers_at(st: &State, addr: &str) -> Vec<u64> {
        st.peers.iter().filter(|(_, e)| *e == addr).map(|(p, _)| *p).collect()
    }

    /// Where to send to reach `peer`: the path its hello came by, else its endpoint.
    pub fn route(st: &State, peer: u64) -> Option<String> {
        st.routes.get(&peer).or_else(|| st.peers.get(&peer)).cloned()
    }

    /// A failure event (FAULT: `reasonless_failures` drops its reason and message).
    pub fn failed(&self, xfer: u64, reason: ReasonCode, message: String, quiesced: bool) {
        let (reason, message) =
            if self.faults.reasonless_failures { (ReasonCode(0), String::new()) } else { (reason, message) };
        let mut e = Event::failed(XferId(xfer), reason, message);
        if quiesced {
            e.flags |= event_flags::QUIESCED;
        }
        self.sink.deliver(e);
    }

    /// End every live transfer matching `which` with `reason`: at once if idle, or by stopping its
    /// copy (the worker then reports `QUIESCED`).
    pub fn fail_where(&self, st: &mut State, reason: ReasonCode, message: &str, which: impl Fn(&Transfer) -> bool) {
        let ids: Vec<u64> = st.transfers.iter().filter(|(_, t)| !t.reported && which(t)).map(|(x, _)| *x).collect();
        for x in ids {
            let t = st.transfers.get_mut(&x).expect("listed");
            if t.phase == Phase::Copying {
                t.stop.store(true, Ordering::SeqCst);
                t.reported = true;
                self.failed(x, reason, message.to_string(), false);
            } else if self.awaits_verdict(t) {
                self.fail_unquiesced(t, x, reason, message);
            } else {
                st.transfers.remove(&x);
                self.failed(x, reason, message.to_string(), true);
            }
        }
    }
}

pub struct RefPlugin {
    shared: Arc<Shared>,
    worker: Mutex<Option<JoinHandle<()>>>,
    note_socket: UnixDatagram,
}

static INSTANCES: AtomicU64 = AtomicU64::new(0);

fn err(code: ReasonCode, message: impl Into<String>) -> PluginError {
    PluginError::new(code, message)
}

/// FAULT (`abort_after_stall`): a thread that aborts the process when its own tick comes more than
/// [`crate::WATCHDOG_STALL_MS`] late, whatever is in flight. Core dumps are switched off first, so a
/// test run leaves no core file behind.
fn start_watchdog(shared: Arc<Shared>) {
    std::thread::spawn(move || {
        let tick = std::time::Duration::from_millis(crate::WATCHDOG_TICK_MS);
        let stall = std::time::Duration::from_millis(crate::WATCHDOG_STALL_MS);
        while !shared.stop_worker.load(Ordering::SeqCst) {
            let before = std::time::Instant::now();
            std::thread::sleep(tick);
            let gap = before.elapsed();
            if gap > stall {
                eprintln!(
                    "{}: watchdog: process stalled for {} ms (limit {} ms); aborting",
                    shared.name,
                    gap.as_millis(),
                    stall.as_millis()
                );
                let no_core = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
                // SAFETY: setrlimit(2) with a valid struct; abort(3) ends the process.
                unsafe { libc::setrlimit(libc::RLIMIT_CORE, &no_core) };
                std::process::abort();
            }
        }
    });
}

impl RefPlugin {
    pub(crate) fn start(
        name: &'static str,
        sink: Sink,
        faults: Faults,
        segment_delay_us: u64,
    ) -> Result<RefPlugin, PluginError> {
        let n = INSTANCES.fetch_add(1, Ordering::Relaxed);
        let io = |e: std::io::Error| err(ReasonCode::TRANSPORT_ERROR, format!("control socket: {e}"));
        let (socket, endpoint) = if faults.udp {
            let socket = Link::udp().map_err(io)?;
            let endpoint = crate::udp_wire::encode_endpoint(socket.port());
            (socket, endpoint)
        } else {
            let name = format!("{ENDPOINT_PREFIX}{}-{n}", std::process::id());
            (Link::unix(&name).map_err(io)?, name.into_bytes())
        };
        let note_socket = UnixDatagram::unbound().map_err(io)?;
        if faults.blocking_send_in_submit {
            // The smallest send buffer the kernel allows: a handful of notes a frozen peer has not read
            // fill it, whatever `net.unix.max_dgram_qlen` the host has, so the blocking send blocks.
            crate::link::set_buffer(note_socket.as_raw_fd(), libc::SO_SNDBUF, 1).map_err(io)?;
        }
        let shared = Arc::new(Shared {
            name,
            sink: sink.clone(),
            faults,
            segment_delay_us,
            socket,
            endpoint,
            state: Mutex::new(State::default()),
            stop_worker: AtomicBool::new(false),
            worker_alive: AtomicBool::new(true),
            successes: AtomicU64::new(0),
        });
        if faults.abort_after_stall {
            start_watchdog(Arc::clone(&shared));
        }
        let for_worker = Arc::clone(&shared);
        let worker =
            kvgate_abi::sdk::spawn_worker(&format!("{name}-worker"), sink, move || crate::worker::run(&for_worker))
                .map_err(|e| err(ReasonCode::RESOURCE_EXHAUSTED, format!("cannot start worker: {e}")))?;
        Ok(RefPlugin { shared, worker: Mutex::new(Some(worker)), note_socket })
    }

    fn check_segment(&self, st: &State, peer: u64, s: &Segment) -> Result<(Piece, Arc<RemoteMap>), PluginError> {
        let &(laddr, llen) = st
            .regions
            .get(&s.local.0)
            .ok_or_else(|| err(ReasonCode::UNKNOWN_KEY, format!("unknown local key {}", s.local.0)))?;
        let (owner, map) = st
            .remotes
            .get(&s.remote.0)
            .ok_or_else(|| err(ReasonCode::UNKNOWN_KEY, format!("unknown remote key {}", s.remote.0)))?;
        if *owner != peer {
            return Err(err(
                ReasonCode::UNKNOWN_KEY,
                format!("remote key {} belongs to peer {owner}, not {peer}", s.remote.0),
            ));
        }
        let (local_end, remote_end) = if self.shared.faults.panic_on_offset_overflow {
            // FAULT: unchecked arithmetic on untrusted offsets.
            (
                Some(s.local_offset.checked_add(s.len).expect("local offset overflow")),
                Some(s.remote_offset.checked_add(s.len).expect("remote offset overflow")),
            )
        } else {
            (s.local_offset.checked_add(s.len), s.remote_offset.checked_add(s.len))
        };
        let in_range = local_end.is_some_and(|e| e <= llen) && remote_end.is_some_and(|e| e <= map.len);
        let (remote_key, remote_offset) = (map.owner_key, s.remote_offset);
        // FAULT: `skip_segment_range_checks` leaves the check to the copy, after earlier segments moved.
        if !in_range && !self.shared.faults.skip_segment_range_checks {
            return Err(err(
                ReasonCode::OUT_OF_RANGE,
                format!("segment {}+{} → {}+{} outside its regions", s.local_offset, s.len, s.remote_offset, s.len),
            ));
        }
        let piece = if in_range {
            Piece {
                src: laddr + s.local_offset,
                dst: map.addr as u64 + s.remote_offset,
                len: s.len,
                in_range,
                remote_key,
                remote_offset,
            }
        } else {
            Piece { src: 0, dst: 0, len: 0, in_range, remote_key, remote_offset }
        };
        Ok((piece, Arc::clone(map)))
    }
}

impl Plugin for RefPlugin {
    fn info(&self) -> PluginInfo {
        crate::info_with(self.shared.name, &self.shared.faults)
    }

    fn local_endpoint(&self) -> Vec<u8> {
        self.shared.endpoint.clone()
    }

    fn connect(&self, peer: PeerId, endpoint: &[u8]) -> Result<(), PluginError> {
        let udp = self.shared.socket.is_udp();
        let parsed = if udp { crate::udp_wire::parse_endpoint(endpoint) } else { parse_endpoint(endpoint) };
        let endpoint = match parsed {
            Ok(endpoint) => endpoint,
            // FAULT: any bytes are an endpoint.
            Err(_) if self.shared.faults.accept_any_endpoint => String::from_utf8_lossy(endpoint).into_owned(),
            Err(e) => return Err(e),
        };
        let mut st = self.shared.lock();
        if st.shut {
            return Err(err(ReasonCode::SHUTDOWN, "shut down"));
        }
        st.peers.insert(peer.0, endpoint.clone());
        st.routes.remove(&peer.0);
        if udp {
            st.outbox.push((endpoint, Msg::Hello(self.shared.socket.port())));
        }
        Ok(())
    }

    fn disconnect(&self, peer: PeerId) {
        let mut st = self.shared.lock();
        if st.peers.remove(&peer.0).is_none() {
            return;
        }
        // FAULT: the peer's transfers are left to their deadlines.
        if !self.shared.faults.disconnect_keeps_transfers {
            self.shared.fail_where(&mut st, ReasonCode::PEER_LOST, "peer disconnected", |t| t.peer == peer.0);
        }
        st.remotes.retain(|_, (owner, _)| *owner != peer.0);
        st.routes.remove(&peer.0);
        st.granted.retain(|(p, _)| *p != peer.0);
        st.tickets.retain(|(p, _), _| *p != peer.0);
    }

    fn register(&self, region: &RegionDesc) -> Result<Registration, PluginError> {
        // FAULT: `accept_any_memory_kind` skips the memory-kind check.
        if region.kind != MemoryKind::HOST && !self.shared.faults.accept_any_memory_kind {
            return Err(err(
                ReasonCode::UNSUPPORTED_MEMORY,
                format!("{} memory is not served (host only)", region.kind),
            ));
        }
        if region.len == 0 || region.addr == 0 {
            return Err(err(ReasonCode::INVALID_ARGUMENT, "region has no address or zero length"));
        }
        if region.backing_path.is_empty() {
            return Err(err(ReasonCode::INVALID_ARGUMENT, "region has no backing file a peer could map"));
        }
        let mut st = self.shared.lock();
        if st.shut {
            return Err(err(ReasonCode::SHUTDOWN, "shut down"));
        }
        st.next_key += 1;
        let key = st.next_key;
        st.regions.insert(key, (region.addr, region.len));
        let remote_key = encode_key(region.backing_path.as_str(), region.backing_offset, region.len, key).into();
        Ok(Registration { key: LocalKey(key), remote_key })
    }

    fn deregister(&self, key: LocalKey) -> Result<(), PluginError> {
        let stops: Vec<Arc<AtomicBool>> = {
            let mut st = self.shared.lock();
            if st.regions.remove(&key.0).is_none() {
                return Err(err(ReasonCode::UNKNOWN_KEY, format!("unknown local key {}", key.0)));
            }
            let copying: Vec<_> = st
                .transfers
                .values()
                .filter(|t| t.phase == Phase::Copying && t.local_keys.contains(&key.0))
                .map(|t| Arc::clone(&t.stop))
                .collect();
            if self.shared.faults.deregister_succeeds_partial_copy {
                // FAULT: the copy stops where it is and the transfer is still to succeed.
                for t in
                    st.transfers.values_mut().filter(|t| t.phase == Phase::Copying && t.local_keys.contains(&key.0))
                {
                    t.fail_open = true;
                    t.stop.store(true, Ordering::SeqCst);
                }
            } else {
                self.shared.fail_where(&mut st, ReasonCode::UNKNOWN_KEY, "source region deregistered", |t| {
                    t.local_keys.contains(&key.0)
                });
            }
            copying
        };
        // The memory may be freed once we return: wait (briefly, one piece) for the copy to stop.
        let until = Instant::now() + Duration::from_millis(50);
        while stops.iter().any(|s| Arc::strong_count(s) > 1) && Instant::now() < until {
            std::thread::yield_now();
        }
        Ok(())
    }

    fn import_remote_key(&self, peer: PeerId, bytes: &[u8]) -> Result<RemoteKey, PluginError> {
        let key = parse_key(bytes)?;
        if !self.shared.lock().peers.contains_key(&peer.0) {
            return Err(err(ReasonCode::PEER_UNREACHABLE, format!("unknown peer {}", peer.0)));
        }
        let map = RemoteMap::map(&key)?;
        let mut st = self.shared.lock();
        st.next_key += 1;
        let key = st.next_key;
        st.remotes.insert(key, (peer.0, Arc::new(map)));
        Ok(RemoteKey(key))
    }

    fn release_remote_key(&self, key: RemoteKey) {
        self.shared.lock().remotes.remove(&key.0);
    }

    fn submit(&self, r: &SubmitRequest<'_>) -> Result<(), PluginError> {
        if self.shared.faults.blocking_send_in_submit {
            // FAULT: a synchronous send to the peer from the caller's thread.
            let endpoint = self.shared.lock().peers.get(&r.peer.0).cloned();
            if let Some(endpoint) = endpoint {
                if let Ok(addr) = abstract_addr(&endpoint) {
                    let _ = self.note_socket.send_to_addr(Msg::Note(r.xfer.0).encode().as_bytes(), &addr);
                }
            }
        }
        let mut st = self.shared.lock();
        if st.shut {
            return Err(err(ReasonCode::SHUTDOWN, "shut down"));
        }
        if !st.peers.contains_key(&r.peer.0) {
            return Err(err(ReasonCode::PEER_UNREACHABLE, format!("unknown peer {}", r.peer.0)));
        }
        if st.transfers.contains_key(&r.xfer.0) {
            return Err(err(ReasonCode::DUPLICATE_ID, format!("transfer {} is live", r.xfer.0)));
        }
        if r.segments.is_empty() {
            return Err(err(ReasonCode::INVALID_ARGUMENT, "no segments"));
        }
        if r.segments.len() as u64 > crate::MAX_SEGMENTS_PER_SUBMIT
            || st.transfers.len() as u64 >= crate::MAX_INFLIGHT_TRANSFERS
        {
            return Err(err(ReasonCode::RESOURCE_EXHAUSTED, "segment or in-flight limit reached"));
        }
        let mut pieces = Vec::with_capacity(r.segments.len());
        let mut keep = Vec::new();
        let mut local_keys = Vec::new();
        for s in r.segments.iter() {
            let (piece, map) = self.check_segment(&st, r.peer.0, s)?;
            pieces.push(piece);
            if !keep.iter().any(|m| Arc::ptr_eq(m, &map)) {
                keep.push(map);
            }
            if !local_keys.contains(&s.local.0) {
                local_keys.push(s.local.0);
            }
        }
        let timeout = Duration::from_nanos(r.timeout_ns.min(365 * 24 * 3600 * 1_000_000_000));
        let phase = if st.granted.contains(&(r.peer.0, r.ticket.0)) { Phase::Ready } else { Phase::WaitingForTicket };
        st.transfers.insert(
            r.xfer.0,
            Transfer {
                peer: r.peer.0,
                ticket: r.ticket.0,
                deadline: Instant::now() + timeout,
                pieces: Arc::new(pieces),
                _keep: keep,
                local_keys,
                phase,
                reported: false,
                stop: Arc::new(AtomicBool::new(false)),
                fail_open: false,
                cancel_queued: false,
            },
        );
        Ok(())
    }

    fn cancel(&self, xfer: XferId) {
        let mut st = self.shared.lock();
        let busy = st.transfers.len();
        let Some(t) = st.transfers.get_mut(&xfer.0) else {
            // FAULT: an event for a transfer that does not exist.
            if self.shared.faults.fail_unknown_cancels {
                self.shared.failed(xfer.0, ReasonCode::CANCELLED, "cancelled".into(), true);
            }
            return;
        };
        if t.reported || t.cancel_queued {
            return;
        }
        // FAULT: under load, a cancel of a transfer not being copied waits in the worker's queue.
        if self.shared.faults.cancel_queued_when_busy
            && busy > crate::QUEUED_CANCEL_LIVE_TRANSFERS
            && t.phase != Phase::Copying
        {
            t.cancel_queued = true;
            st.queued_cancels.push_back(xfer.0);
            return;
        }
        // FAULT: the silent pin: a transfer the peer has not registered yet is not in the table
        // `cancel` consults, so the cancel is dropped and the transfer keeps waiting.
        if self.shared.faults.ignore_cancel_while_waiting_for_ticket && t.phase == Phase::WaitingForTicket {
            return;
        }
        // FAULT: the cancel is left to an acknowledgement that may never come.
        if self.shared.faults.cancel_left_to_ack && t.phase == Phase::WaitingForAck {
            return;
        }
        // FAULT: a cancel past the queue's capacity is dropped without a word.
        if self.shared.faults.drop_cancels_when_busy && busy > crate::BUSY_LIVE_TRANSFERS {
            return;
        }
        let faults = self.shared.faults;
        // FAULT: once bytes move, the cancel is ignored; the copy finishes and succeeds.
        if faults.ignore_cancel_mid_copy && t.phase == Phase::Copying {
            return;
        }
        if t.phase == Phase::Copying {
            t.reported = true;
            if faults.quiesce_before_copy_stops {
                // FAULT: quiesced at once, though the copy stops only at the next segment boundary.
                t.stop.store(true, Ordering::SeqCst);
                t.phase = Phase::Finishing;
                self.shared.failed(xfer.0, ReasonCode::CANCELLED, "cancelled".into(), true);
            } else if faults.write_after_cancel {
                // FAULT: claims quiesced while the copy goes on.
                t.phase = Phase::Finishing;
                self.shared.failed(xfer.0, ReasonCode::CANCELLED, "cancelled".into(), true);
            } else {
                t.stop.store(true, Ordering::SeqCst);
                self.shared.failed(xfer.0, ReasonCode::CANCELLED, "cancelled mid-copy".into(), false);
            }
            return;
        }
        if self.shared.awaits_verdict(t) {
            return self.shared.fail_unquiesced(
                t,
                xfer.0,
                ReasonCode::CANCELLED,
                "cancelled with its commit unanswered",
            );
        }
        if faults.leak_on_cancel {
            // FAULT: reported, but never removed from the table.
            t.reported = true;
            t.phase = Phase::Leaked;
        } else {
            st.transfers.remove(&xfer.0);
        }
        self.shared.failed(xfer.0, ReasonCode::CANCELLED, "cancelled".into(), true);
    }

    fn expect_incoming(&self, r: &IncomingRequest<'_>) -> Result<(), PluginError> {
        let mut st = self.shared.lock();
        let Some(endpoint) = Shared::route(&st, r.peer.0) else {
            return Err(err(ReasonCode::PEER_UNREACHABLE, format!("unknown peer {}", r.peer.0)));
        };
        for range in r.ranges.iter() {
            let &(_, len) = st
                .regions
                .get(&range.key.0)
                .ok_or_else(|| err(ReasonCode::UNKNOWN_KEY, format!("unknown local key {}", range.key.0)))?;
            if range.offset.checked_add(range.len).is_none_or(|e| e > len) {
                return Err(err(ReasonCode::OUT_OF_RANGE, "incoming range outside its region"));
            }
        }
        let expiry = Instant::now() + Duration::from_nanos(r.timeout_ns.min(365 * 24 * 3600 * 1_000_000_000));
        st.tickets.insert((r.peer.0, r.ticket.0), expiry);
        st.outbox.push((endpoint, Msg::Ticket(r.ticket.0)));
        Ok(())
    }

    fn cancel_incoming(&self, peer: PeerId, ticket: Ticket) {
        let mut st = self.shared.lock();
        if st.tickets.remove(&(peer.0, ticket.0)).is_some() {
            if let Some(endpoint) = Shared::route(&st, peer.0) {
                st.outbox.push((endpoint, Msg::Revoke(ticket.0)));
            }
        }
    }

    fn stats(&self) -> Stats {
        let st = self.shared.lock();
        let live = st.transfers.values().filter(|t| !t.reported || t.phase == Phase::Leaked).count() as u64;
        Stats {
            // FAULT: a count that never moves.
            live_transfers: if self.shared.faults.stale_live_transfers { 0 } else { live },
            unquiesced_transfers: st
                .transfers
                .values()
                .filter(|t| t.reported && matches!(t.phase, Phase::Copying | Phase::Unquiesced))
                .count() as u64,
            live_tickets: st.tickets.len() as u64,
            registered_regions: st.regions.len() as u64,
            registered_bytes: st.regions.values().map(|(_, l)| l).sum(),
            imported_remote_keys: st.remotes.len() as u64,
            connected_peers: st.peers.len() as u64,
            workers_alive: u64::from(self.shared.worker_alive.load(Ordering::SeqCst)),
            healthy: u8::from(!st.shut && self.shared.worker_alive.load(Ordering::SeqCst)),
        }
    }

    fn shutdown(&self) {
        {
            let mut st = self.shared.lock();
            if st.shut {
                return;
            }
            st.shut = true;
            // FAULT: live transfers are dropped below without a terminal event.
            if !self.shared.faults.shutdown_without_terminal_events {
                self.shared.fail_where(&mut st, ReasonCode::SHUTDOWN, "plugin shutting down", |_| true);
            }
        }
        self.shared.stop_worker.store(true, Ordering::SeqCst);
        if let Some(w) = self.worker.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = w.join();
        }
        let mut st = self.shared.lock();
        st.transfers.clear();
        st.regions.clear();
        st.remotes.clear();
        st.peers.clear();
        st.routes.clear();
        st.got.clear();
        st.incoming.clear();
        st.tickets.clear();
        st.granted.clear();
        st.outbox.clear();
        st.queued_cancels.clear();
    }
}

impl Drop for RefPlugin {
    fn drop(&mut self) {
        self.shutdown();
    }
}
