//! State shared between the API threads and the progress thread: registered regions, imported remote
//! keys, peers, incoming tickets, live transfer ids and the command queue with its wake-up fd.
//! Owns bookkeeping under one mutex; never calls into a UCX worker (only the progress thread does).

use crate::config::{ResolvedMode, UcxConfig};
use crate::fast_map::{FastMap, FastSet};
use crate::ucp::{Context, MemMap};
use kvgate_abi::sdk::Sink;
use kvgate_abi::{LocalKey, LocalRange, PeerId, Segment, Ticket, XferId};
use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

/// A region registered with this instance. Its UCX registration (`map`) is released when the last
/// holder drops it: the registry, the transfers that read it, and every UCX request posted on it
/// ([`RegionHold`]).
pub struct LocalRegion {
    pub key: LocalKey,
    pub addr: u64,
    pub len: u64,
    pub map: MemMap,
    /// UCX requests that may still read or write the region (sends, puts, rendezvous receives):
    /// the [`RegionHold`]s alive. `deregister` waits (bounded) until it is 0.
    requests: AtomicU64,
    /// Set by `deregister` before it waits: from then on no new request is posted on the region
    /// ([`RegionHold::try_new`]).
    deregistered: AtomicBool,
    /// Signalled when `requests` drops to 0 once deregistered (taken before notifying, so a waiter
    /// never misses it).
    idle_lock: Mutex<()>,
    idle: Condvar,
}

impl LocalRegion {
    pub fn new(key: LocalKey, addr: u64, len: u64, map: MemMap) -> LocalRegion {
        LocalRegion {
            key,
            addr,
            len,
            map,
            requests: AtomicU64::new(0),
            deregistered: AtomicBool::new(false),
            idle_lock: Mutex::new(()),
            idle: Condvar::new(),
        }
    }

    /// UCX requests still posted on the region.
    pub fn requests_in_flight(&self) -> u64 {
        self.requests.load(Ordering::SeqCst)
    }

    /// No request may be posted on the region from now on; returns the requests still posted.
    /// (SeqCst with `RegionHold::try_new`'s count-then-check: either that sees the flag and posts
    /// nothing, or this sees its count and waits for it.)
    pub fn close_to_new_requests(&self) -> u64 {
        self.deregistered.store(true, Ordering::SeqCst);
        self.requests.load(Ordering::SeqCst)
    }

    /// Wait until no UCX request touches the region, at most `limit`; whether none does.
    pub fn wait_until_untouched(&self, limit: std::time::Duration) -> bool {
        let until = Instant::now() + limit;
        let mut guard = self.idle_lock.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if self.requests_in_flight() == 0 {
                return true;
            }
            let now = Instant::now();
            if now >= until {
                return false;
            }
            guard = self.idle.wait_timeout(guard, until - now).unwrap_or_else(|p| p.into_inner()).0;
        }
    }
}

/// One UCX request posted on a region (a send or put reading it, a rendezvous receive writing it):
/// keeps the region's UCX registration alive and counts in [`LocalRegion::requests_in_flight`] until
/// the request has been handed back by UCX and the hold is dropped.
pub struct RegionHold(Arc<LocalRegion>);

impl RegionHold {
    /// A hold for a request about to be posted on `region`, or `None` once the region is
    /// deregistered (post nothing then).
    pub fn try_new(region: &Arc<LocalRegion>) -> Option<RegionHold> {
        region.requests.fetch_add(1, Ordering::SeqCst);
        let hold = RegionHold(region.clone());
        if region.deregistered.load(Ordering::SeqCst) {
            return None; // dropping `hold` takes the count back
        }
        Some(hold)
    }
}

impl Drop for RegionHold {
    fn drop(&mut self) {
        // Only a deregistered region has a waiter (it sets the flag before it looks at the count:
        // SeqCst on both sides, so either it sees this decrement or this sees its flag).
        if self.0.requests.fetch_sub(1, Ordering::SeqCst) == 1 && self.0.deregistered.load(Ordering::SeqCst) {
            let _guard = self.0.idle_lock.lock().unwrap_or_else(|p| p.into_inner());
            self.0.idle.notify_all();
        }
    }
}

/// A peer's region, imported from its remote-key bytes.
pub struct RemoteRegion {
    pub id: u64,
    pub peer: PeerId,
    pub region: u64,
    pub addr: u64,
    pub len: u64,
    pub packed_rkey: Vec<u8>,
}

/// A peer this instance was told about.
pub struct PeerInfo {
    pub instance: u64,
    pub worker_address: Vec<u8>,
    /// Set by the progress thread when UCX reported the endpoint failed; cleared by a new `connect`.
    pub down: bool,
}

/// An incoming ticket (receiver side).
pub struct TicketState {
    pub peer: PeerId,
    /// Allowed ranges by (region key, offset) -> len.
    pub ranges: BTreeMap<(u64, u64), u64>,
    pub deadline: Instant,
    pub cancelled: bool,
    /// Rendezvous receives under this ticket still writing.
    pub pending_writes: u64,
}

impl TicketState {
    /// `ranges` were checked against their regions (no end past a region, so none overflows).
    pub fn new(peer: PeerId, ranges: &[LocalRange], deadline: Instant) -> TicketState {
        TicketState { peer, ranges: joined_ranges(ranges), deadline, cancelled: false, pending_writes: 0 }
    }

    /// Whether `[offset, offset + len)` of `region` lies inside one allowed range (ranges that
    /// overlap or touch count as one: see `joined_ranges`).
    pub fn allows(&self, region: u64, offset: u64, len: u64) -> bool {
        let Some(end) = offset.checked_add(len) else { return false };
        match self.ranges.range(..=(region, offset)).next_back() {
            Some((&(r, start), &range_len)) => r == region && start.checked_add(range_len).is_some_and(|e| end <= e),
            None => false,
        }
    }

    pub fn authorises(&self, now: Instant) -> bool {
        !self.cancelled && now < self.deadline
    }
}

/// A ticket's ranges keyed by (region key, start), with ranges of one region that overlap or touch
/// joined into one. The bytes allowed are the same; a message may then cover two ranges listed side
/// by side, as the sender's joined segments do (`push_joined`). A range past `u64::MAX` allows nothing.
fn joined_ranges(ranges: &[LocalRange]) -> BTreeMap<(u64, u64), u64> {
    let mut spans: Vec<(u64, u64, u64)> =
        ranges.iter().filter_map(|r| Some((r.key.0, r.offset, r.offset.checked_add(r.len)?))).collect();
    spans.sort_unstable();
    let mut joined: BTreeMap<(u64, u64), u64> = BTreeMap::new();
    let mut current: Option<(u64, u64, u64)> = None;
    for (key, start, end) in spans {
        current = match current {
            Some((k, s, e)) if k == key && start <= e => Some((k, s, e.max(end))),
            Some((k, s, e)) => {
                joined.insert((k, s), e - s);
                Some((key, start, end))
            }
            None => Some((key, start, end)),
        };
    }
    if let Some((k, s, e)) = current {
        joined.insert((k, s), e - s);
    }
    joined
}

/// Append `next` to a transfer's resolved segments, or extend the last one when `next` continues
/// it on both sides (same source registration, same remote region, no gap on either side) and the
/// two together hold at most `max_bytes`: adjacent blocks of a pool then move as one message, with
/// one rendezvous, one receiver check and one completion instead of one each. Empty segments are
/// kept as they are; `max_bytes` 0 joins nothing.
pub fn push_joined(resolved: &mut Vec<ResolvedSegment>, next: ResolvedSegment, max_bytes: u64) {
    if let Some(last) = resolved.last_mut() {
        let continues = last.len > 0
            && next.len > 0
            && last.len.checked_add(next.len).is_some_and(|sum| sum <= max_bytes)
            && last.local_key == next.local_key
            && last.remote_key == next.remote_key
            && last.local_addr.checked_add(last.len) == Some(next.local_addr)
            && last.remote_offset.checked_add(last.len) == Some(next.remote_offset);
        if continues {
            last.len += next.len;
            return;
        }
    }
    resolved.push(next);
}

/// One segment of an outgoing transfer, resolved at submit.
#[derive(Clone, Copy, Debug)]
pub struct ResolvedSegment {
    pub local_addr: u64,
    pub local_key: u64,
    /// The source registration's `ucp_mem_h`, as an address (kept alive by the job's `local_regions`).
    pub local_memh: usize,
    pub remote_key: u64,
    pub remote_region: u64,
    pub remote_offset: u64,
    pub remote_addr: u64,
    pub len: u64,
}

/// An outgoing transfer handed to the progress thread.
pub struct OutgoingJob {
    pub xfer: XferId,
    pub peer: PeerId,
    pub ticket: Ticket,
    pub deadline: Instant,
    pub segments: Vec<ResolvedSegment>,
    pub total_bytes: u64,
    /// Keeps the source registrations mapped while UCX may still read them.
    pub local_regions: Vec<Arc<LocalRegion>>,
    pub remote_regions: Vec<Arc<RemoteRegion>>,
}

impl OutgoingJob {
    /// A hold on the source registration `local_key` for one request about to read it; `None` when
    /// it is not the job's or was deregistered meanwhile (nothing may be posted from it then).
    pub fn source_hold(&self, local_key: u64) -> Option<RegionHold> {
        // `local_regions` holds each region once, sorted by key (`each_once`; one region is sorted).
        let at = self.local_regions.binary_search_by_key(&local_key, |r| r.key.0).ok()?;
        RegionHold::try_new(&self.local_regions[at])
    }
}

/// Work for the progress thread.
pub enum Command {
    /// `instance`: the remote plugin instance (one UCX endpoint per instance, shared by its peer ids);
    /// `process`: the peer's pid when it runs on this host (watched where UCX reports no peer failure).
    Connect {
        peer: PeerId,
        instance: u64,
        worker_address: Vec<u8>,
        process: Option<u32>,
    },
    Disconnect {
        peer: PeerId,
    },
    Submit(Box<OutgoingJob>),
    Cancel(XferId),
    ReleaseRemoteKey(u64),
    Deregistered(LocalKey),
    Shutdown,
}

/// Everything under the one lock.
#[derive(Default)]
pub struct Registry {
    pub regions: FastMap<u64, Arc<LocalRegion>>,
    pub next_local_key: u64,
    pub remote_keys: FastMap<u64, Arc<RemoteRegion>>,
    pub next_remote_key: u64,
    pub peers: FastMap<PeerId, PeerInfo>,
    /// The peer id incoming writes from a remote instance are attributed to: the latest connected of
    /// the peer ids that name it (several may; see [`Registry::forget_instance_of`]).
    pub instance_to_peer: FastMap<u64, PeerId>,
    pub tickets: FastMap<u64, TicketState>,
    /// Outgoing transfers submitted and not yet terminal.
    pub live_xfers: FastSet<u64>,
    /// Outgoing transfers terminal but not yet quiesced.
    pub unquiesced_xfers: FastSet<u64>,
    pub commands: VecDeque<Command>,
    pub shut_down: bool,
}

impl Registry {
    pub fn live_tickets(&self, now: Instant) -> u64 {
        self.tickets.values().filter(|t| t.authorises(now)).count() as u64
    }

    /// `peer` (connected to `instance`) is going away or moving: incoming writes from `instance` are
    /// attributed to another peer id still connected to it, or to none. Call before removing `peer`
    /// from `peers`.
    pub fn forget_instance_of(&mut self, peer: PeerId, instance: u64) {
        if self.instance_to_peer.get(&instance) != Some(&peer) {
            return;
        }
        let other = self.peers.iter().find(|(p, info)| **p != peer && info.instance == instance).map(|(p, _)| *p);
        match other {
            Some(other) => self.instance_to_peer.insert(instance, other),
            None => self.instance_to_peer.remove(&instance),
        };
    }

    /// Whether a write from `sender` (a remote instance) may use a ticket the host opened for
    /// `ticket_peer`: that peer id must be connected to that instance.
    pub fn sender_is_peer(&self, sender: u64, ticket_peer: PeerId) -> bool {
        sender_is_peer(&self.peers, sender, ticket_peer)
    }
}

/// Whether the remote instance `sender` is the one `ticket_peer` names (several peer ids may name
/// one instance). A free function so that a caller holding a ticket mutably can still ask.
pub fn sender_is_peer(peers: &FastMap<PeerId, PeerInfo>, sender: u64, ticket_peer: PeerId) -> bool {
    peers.get(&ticket_peer).is_some_and(|info| info.instance == sender)
}

/// Shared by every handle of one plugin instance.
pub struct Shared {
    pub registry: Mutex<Registry>,
    pub sink: Sink,
    pub config: UcxConfig,
    pub mode: ResolvedMode,
    pub instance: u64,
    pub context: Arc<Context>,
    pub worker_address: Vec<u8>,
    /// This host's boot id (a peer with the same one runs on this host).
    pub boot_id: [u8; 16],
    /// eventfd the progress thread sleeps on next to the worker's fd.
    pub wake_fd: i32,
    /// Set by `wake` after queueing a command; the progress thread takes the lock only when it is set.
    pub commands_pending: AtomicBool,
    /// Test hook ([`crate::UcxPlugin::hold_commands_for_tests`]): while set, the progress thread
    /// progresses the worker but takes no command, so a test can order a peer's writes before a
    /// queued `connect`. Always false outside tests.
    pub commands_held_for_tests: AtomicBool,
    /// Set by the progress thread while it sleeps (or is about to): only then does `wake` write `wake_fd`.
    pub progress_thread_sleeping: AtomicBool,
    pub healthy: AtomicBool,
    pub workers_alive: AtomicU64,
    /// The most data bytes the progress thread has had posted to UCX at once (see
    /// `max_posted_bytes`); read by tests through [`crate::UcxPlugin::posted_bytes_peak_for_tests`].
    pub posted_bytes_peak: AtomicU64,
}

impl Shared {
    pub fn lock(&self) -> MutexGuard<'_, Registry> {
        // A poisoned lock means a panic while holding it; the data is still consistent enough to
        // fail everything, which is what the caller will do once it sees `healthy == false`.
        self.registry.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queue a command and wake the progress thread.
    pub fn post(&self, command: Command) {
        self.lock().commands.push_back(command);
        self.wake();
    }

    /// Tell the progress thread a command is queued; the eventfd is written only when it sleeps.
    /// (SeqCst on both flags: the thread sets `progress_thread_sleeping` and then reads
    /// `commands_pending`; this sets `commands_pending` and then reads `progress_thread_sleeping`, so
    /// at least one of the two sees the other.)
    pub fn wake(&self) {
        self.commands_pending.store(true, Ordering::SeqCst);
        if self.progress_thread_sleeping.load(Ordering::SeqCst) {
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from a u64 on the stack to the instance's own eventfd, open while `self`
            // lives.
            unsafe { libc::write(self.wake_fd, &one as *const u64 as *const libc::c_void, 8) };
        }
    }

    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Acquire)
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // SAFETY: the eventfd was opened in `open` for this instance and is closed once, here, when the last
        // holder of `Shared` drops it.
        unsafe { libc::close(self.wake_fd) };
    }
}

/// A submit's segments resolved, with the regions they use (held for the transfer's life).
pub type ResolvedSubmit = (Vec<ResolvedSegment>, Vec<Arc<LocalRegion>>, Vec<Arc<RemoteRegion>>);

/// Resolve and bounds-check the segments of a submit against the registry, joining segments that
/// continue each other up to `join_max_bytes` (`push_joined`).
// CONFORMANCE: DATA-2, DATA-3 (every segment checked against both regions, overflow included)
pub fn resolve_segments(
    registry: &Registry,
    peer: PeerId,
    segments: &[Segment],
    join_max_bytes: u64,
) -> Result<ResolvedSubmit, kvgate_abi::PluginError> {
    use kvgate_abi::{PluginError, ReasonCode};
    let mut resolved = Vec::with_capacity(segments.len());
    // The regions the transfer holds, each once: a segment naming the region of the one before is
    // skipped at once (the common case), the rest are sorted and deduplicated at the end.
    let mut locals: Vec<Arc<LocalRegion>> = Vec::with_capacity(1);
    let mut remotes: Vec<Arc<RemoteRegion>> = Vec::with_capacity(1);
    for (i, s) in segments.iter().enumerate() {
        let local = registry.regions.get(&s.local.0).ok_or_else(|| {
            PluginError::new(ReasonCode::UNKNOWN_KEY, format!("segment {i}: unknown local key {}", s.local.0))
        })?;
        let remote = registry.remote_keys.get(&s.remote.0).ok_or_else(|| {
            PluginError::new(ReasonCode::UNKNOWN_KEY, format!("segment {i}: unknown remote key {}", s.remote.0))
        })?;
        if remote.peer != peer {
            return Err(PluginError::new(
                ReasonCode::UNKNOWN_KEY,
                format!("segment {i}: remote key {} belongs to peer {}, not {}", s.remote.0, remote.peer.0, peer.0),
            ));
        }
        let local_end = s.local_offset.checked_add(s.len);
        let remote_end = s.remote_offset.checked_add(s.len);
        if local_end.is_none_or(|e| e > local.len) || remote_end.is_none_or(|e| e > remote.len) {
            return Err(PluginError::new(
                ReasonCode::OUT_OF_RANGE,
                format!(
                    "segment {i}: local {}+{} of {} or remote {}+{} of {} out of range",
                    s.local_offset, s.len, local.len, s.remote_offset, s.len, remote.len
                ),
            ));
        }
        let segment = ResolvedSegment {
            local_addr: local.addr + s.local_offset,
            local_key: s.local.0,
            local_memh: local.map.memh as usize,
            remote_key: s.remote.0,
            remote_region: remote.region,
            remote_offset: s.remote_offset,
            remote_addr: remote.addr + s.remote_offset,
            len: s.len,
        };
        push_joined(&mut resolved, segment, join_max_bytes);
        if locals.last().is_none_or(|l| l.key != s.local) {
            locals.push(local.clone());
        }
        if remotes.last().is_none_or(|r| r.id != s.remote.0) {
            remotes.push(remote.clone());
        }
    }
    each_once(&mut locals, |l| l.key.0);
    each_once(&mut remotes, |r| r.id);
    Ok((resolved, locals, remotes))
}

/// Keep one of each region in `regions` (by `key`).
fn each_once<T>(regions: &mut Vec<Arc<T>>, key: impl Fn(&T) -> u64) {
    if regions.len() > 1 {
        regions.sort_unstable_by_key(|r| key(r));
        regions.dedup_by_key(|r| key(r));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn ticket_ranges_allow_only_inside_one_range() {
        let ranges = [
            LocalRange { key: LocalKey(1), offset: 0, len: 100 },
            LocalRange { key: LocalKey(1), offset: 200, len: 50 },
            LocalRange { key: LocalKey(2), offset: 10, len: 10 },
        ];
        let t = TicketState::new(PeerId(1), &ranges, Instant::now() + Duration::from_secs(1));
        assert!(t.allows(1, 0, 100));
        assert!(!t.allows(1, 0, 101));
        assert!(!t.allows(1, 150, 10));
        assert!(t.allows(1, 249, 1));
        assert!(!t.allows(1, 249, 2));
        assert!(t.allows(2, 10, 10));
        assert!(!t.allows(2, 9, 2));
        assert!(!t.allows(3, 0, 1));
        assert!(!t.allows(1, u64::MAX, 2));
    }

    #[test]
    fn ticket_ranges_that_touch_or_overlap_are_one_range() {
        let range = |key: u64, offset: u64, len: u64| LocalRange { key: LocalKey(key), offset, len };
        // Listed out of order: 0..100 and 100..150 touch, 140..160 overlaps them, 161..170 is past a
        // one-byte gap, and region 2 starts where region 1's first range ends.
        let ranges = [range(1, 100, 50), range(1, 161, 9), range(2, 150, 10), range(1, 0, 100), range(1, 140, 20)];
        let t = TicketState::new(PeerId(1), &ranges, Instant::now() + Duration::from_secs(1));
        assert!(t.allows(1, 0, 160), "touching and overlapping ranges join");
        assert!(t.allows(1, 50, 100));
        assert!(!t.allows(1, 0, 161), "the gap byte 160 stays outside");
        assert!(!t.allows(1, 150, 15), "a message over the gap is refused");
        assert!(t.allows(1, 161, 9));
        assert!(!t.allows(1, 161, 10));
        assert!(t.allows(2, 150, 10));
        assert!(!t.allows(2, 140, 20), "ranges of other regions never join");
        assert_eq!(t.ranges.len(), 3, "{:?}", t.ranges);
    }

    #[test]
    fn a_range_with_the_same_start_as_another_does_not_shrink_it() {
        let ranges =
            [LocalRange { key: LocalKey(1), offset: 0, len: 100 }, LocalRange { key: LocalKey(1), offset: 0, len: 10 }];
        let t = TicketState::new(PeerId(1), &ranges, Instant::now() + Duration::from_secs(1));
        assert!(t.allows(1, 0, 100));
    }

    #[test]
    fn each_region_is_held_once_whatever_the_order_segments_name_them() {
        let (a, b, c) = (Arc::new(1u64), Arc::new(2u64), Arc::new(3u64));
        // As `resolve_segments` leaves them: repeats next to each other already skipped.
        let mut regions = vec![a.clone(), b.clone(), a.clone(), c.clone(), b.clone()];
        each_once(&mut regions, |r| *r);
        let keys: Vec<u64> = regions.iter().map(|r| **r).collect();
        assert_eq!(keys, [1, 2, 3]);
        let mut one = vec![c.clone()];
        each_once(&mut one, |r| *r);
        assert_eq!(one.len(), 1);
        assert_eq!(Arc::strong_count(&a), 2, "the duplicate holds were released");
    }

    fn resolved(local_key: u64, local_addr: u64, remote_key: u64, remote_offset: u64, len: u64) -> ResolvedSegment {
        ResolvedSegment {
            local_addr,
            local_key,
            local_memh: 0,
            remote_key,
            remote_region: 9,
            remote_offset,
            remote_addr: 0x9000 + remote_offset,
            len,
        }
    }

    fn shape(segments: &[ResolvedSegment]) -> Vec<(u64, u64, u64)> {
        segments.iter().map(|s| (s.local_addr, s.remote_offset, s.len)).collect()
    }

    #[test]
    fn segments_that_continue_each_other_on_both_sides_join() {
        let mut out = Vec::new();
        for i in 0..4 {
            push_joined(&mut out, resolved(1, 0x1000 + i * 64, 2, 512 + i * 64, 64), 1 << 20);
        }
        assert_eq!(shape(&out), [(0x1000, 512, 256)]);
    }

    #[test]
    fn joining_stops_at_the_byte_limit() {
        let blocks = |max_bytes: u64| {
            let mut out = Vec::new();
            for i in 0..4 {
                push_joined(&mut out, resolved(1, 0x1000 + i * 64, 2, i * 64, 64), max_bytes);
            }
            shape(&out).iter().map(|s| s.2).collect::<Vec<u64>>()
        };
        assert_eq!(blocks(256), [256], "at the limit");
        assert_eq!(blocks(255), [192, 64], "one byte under what four blocks need");
        assert_eq!(blocks(128), [128, 128]);
        assert_eq!(blocks(127), [64, 64, 64, 64]);
        assert_eq!(blocks(0), [64, 64, 64, 64], "0 joins nothing");
        // A segment longer than the limit on its own is kept whole, and nothing joins onto it.
        let mut out = Vec::new();
        push_joined(&mut out, resolved(1, 0x1000, 2, 0, 300), 256);
        push_joined(&mut out, resolved(1, 0x1000 + 300, 2, 300, 10), 256);
        assert_eq!(shape(&out), [(0x1000, 0, 300), (0x1000 + 300, 300, 10)]);
    }

    #[test]
    fn segments_with_a_gap_or_another_key_or_no_bytes_stay_apart() {
        let cases: [(&str, [ResolvedSegment; 2]); 6] = [
            ("gap at the source", [resolved(1, 0x1000, 2, 0, 64), resolved(1, 0x1041, 2, 64, 64)]),
            ("gap at the destination", [resolved(1, 0x1000, 2, 0, 64), resolved(1, 0x1040, 2, 65, 64)]),
            ("reversed", [resolved(1, 0x1040, 2, 64, 64), resolved(1, 0x1000, 2, 0, 64)]),
            ("another source registration", [resolved(1, 0x1000, 2, 0, 64), resolved(3, 0x1040, 2, 64, 64)]),
            ("another remote region", [resolved(1, 0x1000, 2, 0, 64), resolved(1, 0x1040, 4, 64, 64)]),
            ("an empty segment", [resolved(1, 0x1000, 2, 0, 64), resolved(1, 0x1040, 2, 64, 0)]),
        ];
        for (what, [first, second]) in cases {
            let mut out = Vec::new();
            push_joined(&mut out, first, 1 << 20);
            push_joined(&mut out, second, 1 << 20);
            assert_eq!(out.len(), 2, "{what}: {:?}", shape(&out));
        }
    }
}
