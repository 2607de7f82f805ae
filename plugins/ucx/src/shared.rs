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
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

/// A region registered with this instance.
pub struct LocalRegion {
    pub key: LocalKey,
    pub addr: u64,
    pub len: u64,
    pub map: MemMap,
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
    pub fn new(peer: PeerId, ranges: &[LocalRange], deadline: Instant) -> TicketState {
        let ranges = ranges.iter().map(|r| ((r.key.0, r.offset), r.len)).collect();
        TicketState { peer, ranges, deadline, cancelled: false, pending_writes: 0 }
    }

    /// Whether `[offset, offset + len)` of `region` lies inside one allowed range.
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

/// Work for the progress thread.
pub enum Command {
    /// `instance`: the remote plugin instance (one UCX endpoint per instance, shared by its peer ids);
    /// `process`: the peer's pid when it runs on this host (watched where UCX reports no peer failure).
    Connect { peer: PeerId, instance: u64, worker_address: Vec<u8>, process: Option<u32> },
    Disconnect { peer: PeerId },
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
        self.peers.get(&ticket_peer).is_some_and(|info| info.instance == sender)
    }
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
            unsafe { libc::write(self.wake_fd, &one as *const u64 as *const libc::c_void, 8) };
        }
    }

    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Acquire)
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        unsafe { libc::close(self.wake_fd) };
    }
}

/// A submit's segments resolved, with the regions they use (held for the transfer's life).
pub type ResolvedSubmit = (Vec<ResolvedSegment>, Vec<Arc<LocalRegion>>, Vec<Arc<RemoteRegion>>);

/// Resolve and bounds-check the segments of a submit against the registry.
pub fn resolve_segments(registry: &Registry, peer: PeerId, segments: &[Segment]) -> Result<ResolvedSubmit, kvgate_abi::PluginError> {
    use kvgate_abi::{PluginError, ReasonCode};
    let mut resolved = Vec::with_capacity(segments.len());
    let mut locals: FastMap<u64, Arc<LocalRegion>> = FastMap::default();
    let mut remotes: FastMap<u64, Arc<RemoteRegion>> = FastMap::default();
    for (i, s) in segments.iter().enumerate() {
        let local = registry
            .regions
            .get(&s.local.0)
            .ok_or_else(|| PluginError::new(ReasonCode::UNKNOWN_KEY, format!("segment {i}: unknown local key {}", s.local.0)))?;
        let remote = registry
            .remote_keys
            .get(&s.remote.0)
            .ok_or_else(|| PluginError::new(ReasonCode::UNKNOWN_KEY, format!("segment {i}: unknown remote key {}", s.remote.0)))?;
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
        resolved.push(ResolvedSegment {
            local_addr: local.addr + s.local_offset,
            local_key: s.local.0,
            local_memh: local.map.memh as usize,
            remote_key: s.remote.0,
            remote_region: remote.region,
            remote_offset: s.remote_offset,
            remote_addr: remote.addr + s.remote_offset,
            len: s.len,
        });
        locals.entry(s.local.0).or_insert_with(|| local.clone());
        remotes.entry(s.remote.0).or_insert_with(|| remote.clone());
    }
    Ok((resolved, locals.into_values().collect(), remotes.into_values().collect()))
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
}
