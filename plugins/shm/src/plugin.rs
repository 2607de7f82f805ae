//! The shm transport instance: validates every call against its state before any byte moves, starts
//! and joins its threads, and answers `stats()` exactly. One-sided: the sender maps the receiver's
//! shared file and writes; it never trusts a peer's key without checking it against that peer's nonce.

use crate::config::ShmConfig;
use crate::mapping::{open_backing_file, PeerBacking, PeerMapping};
use crate::plan::{Cursor, Piece};
use crate::state::{ImportedKey, LocalRegion, Transfer};
use crate::wire::{Endpoint, RemoteKeyBytes};
use crate::workers::{timer_loop, worker_loop, Shared};
use kvgate_abi::sdk::{spawn_worker, Plugin, RegionView, Sink};
use kvgate_abi::{
    scope, Capabilities, LocalKey, MemoryKind, PeerId, PluginError, PluginInfo, ReasonCode, RegionDesc, Registration,
    RemoteKey, Stats, SubmitRequest, XferId, ABI_VERSION,
};
use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The plugin's name, as registered with a host.
pub const PLUGIN_NAME: &str = "shm";

/// One open instance of the shm transport.
pub struct ShmPlugin {
    shared: Arc<Shared>,
    endpoint: Endpoint,
    /// Worker and timer threads; emptied (joined) by `shutdown`, which holds this lock throughout.
    threads: Mutex<Vec<JoinHandle<()>>>,
}

// CONFORMANCE: OBS-1 (every refusal carries a reason code and a message)
fn err(code: ReasonCode, message: impl Into<String>) -> PluginError {
    PluginError::new(code, message)
}

/// Static info for a config (the capabilities carry its limits).
// CONFORMANCE: HYGIENE-4 (module and instance report the same name and ABI version)
pub fn plugin_info(config: &ShmConfig) -> PluginInfo {
    PluginInfo {
        name: PLUGIN_NAME.into(),
        version: env!("CARGO_PKG_VERSION").into(),
        abi_version: ABI_VERSION,
        capabilities: Capabilities {
            memory_kinds: MemoryKind::HOST.bit(),
            scope: scope::SAME_HOST,
            flags: 0,
            max_segments_per_submit: config.max_segments_per_submit,
            max_inflight_transfers: config.max_inflight_transfers,
            max_transfer_bytes: config.max_transfer_bytes,
        },
    }
}

/// The kernel's boot id: equal for every process of this machine until it reboots.
fn host_id() -> [u8; 16] {
    let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let digits: Vec<u8> = text.bytes().filter_map(|b| (b as char).to_digit(16).map(|d| d as u8)).collect();
    let mut id = [0u8; 16];
    for (i, pair) in digits.chunks(2).take(16).enumerate() {
        id[i] = pair[0] << 4 | pair.get(1).copied().unwrap_or(0);
    }
    id
}

/// A fresh, non-zero nonce for this instance (std's per-process random hash keys, the clock, the pid).
fn fresh_nonce() -> u64 {
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    hasher
        .write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos());
    hasher.finish().max(1)
}

impl ShmPlugin {
    /// Parse `config`, start the workers and the timer.
    pub fn open(config: &str, sink: Sink) -> Result<ShmPlugin, PluginError> {
        let config = ShmConfig::parse(config)?;
        let workers = config.workers;
        let shared = Arc::new(Shared::new(config, sink.clone()));
        let endpoint = Endpoint { host_id: host_id(), pid: std::process::id(), nonce: fresh_nonce() };
        let plugin = ShmPlugin { shared, endpoint, threads: Mutex::new(Vec::new()) };
        for i in 0..=workers {
            let shared = Arc::clone(&plugin.shared);
            let (name, body): (String, fn(&Shared)) = if i < workers {
                (format!("kvgate-shm-copy-{i}"), worker_loop)
            } else {
                ("kvgate-shm-timer".into(), timer_loop)
            };
            plugin.shared.count_thread_in();
            match spawn_worker(&name, sink.clone(), move || body(&shared)) {
                Ok(handle) => plugin.threads.lock().unwrap_or_else(|p| p.into_inner()).push(handle),
                Err(e) => {
                    plugin.shared.count_thread_out();
                    plugin.shutdown();
                    return Err(err(ReasonCode::RESOURCE_EXHAUSTED, format!("cannot start shm thread {name}: {e}")));
                }
            }
        }
        Ok(plugin)
    }

    fn check_running(state: &crate::state::State) -> Result<(), PluginError> {
        if state.shutting_down {
            return Err(err(ReasonCode::SHUTDOWN, "shm plugin is shut down"));
        }
        if !state.healthy {
            return Err(err(ReasonCode::INTERNAL, "shm plugin is unhealthy (a copy worker died)"));
        }
        Ok(())
    }

    /// Resolve and check every segment; nothing is queued unless all of them are valid.
    // CONFORMANCE: DATA-3, DATA-2 (every segment checked against both regions, overflow included)
    fn plan(&self, state: &crate::state::State, request: &SubmitRequest<'_>) -> Result<Transfer, PluginError> {
        let config = &self.shared.config;
        let segments = request.segments.as_slice();
        if segments.len() as u64 > config.max_segments_per_submit {
            return Err(err(
                ReasonCode::RESOURCE_EXHAUSTED,
                format!(
                    "{} segments exceed max_segments_per_submit = {}",
                    segments.len(),
                    config.max_segments_per_submit
                ),
            ));
        }
        let mut pieces = Vec::with_capacity(segments.len());
        let mut local_keys: Vec<LocalKey> = Vec::new();
        let mut mappings: Vec<Arc<PeerMapping>> = Vec::new();
        let mut total_bytes: u64 = 0;
        for (i, s) in segments.iter().enumerate() {
            let local = state.regions.get(&s.local).ok_or_else(|| {
                err(ReasonCode::UNKNOWN_KEY, format!("segment {i}: local key {} is not registered", s.local.0))
            })?;
            let imported = state.imported.get(&s.remote).ok_or_else(|| {
                err(ReasonCode::UNKNOWN_KEY, format!("segment {i}: remote key {} is not imported", s.remote.0))
            })?;
            let remote_peer = imported.peer;
            if remote_peer != request.peer {
                return Err(err(
                    ReasonCode::UNKNOWN_KEY,
                    format!(
                        "segment {i}: remote key {} belongs to peer {}, not {}",
                        s.remote.0, remote_peer.0, request.peer.0
                    ),
                ));
            }
            check_range(i, "local", s.local_offset, s.len, local.len)?;
            check_range(i, "remote", s.remote_offset, s.len, imported.backing.region_len())?;
            let remote_mapping = imported
                .mapping(config.populate_mappings)
                .map_err(|e| err(e.code, format!("segment {i}: remote key {}: {}", s.remote.0, e.message)))?;
            total_bytes =
                total_bytes.checked_add(s.len).filter(|&t| t <= config.max_transfer_bytes).ok_or_else(|| {
                    err(
                        ReasonCode::RESOURCE_EXHAUSTED,
                        format!("transfer exceeds max_transfer_bytes = {}", config.max_transfer_bytes),
                    )
                })?;
            if !local_keys.contains(&s.local) {
                local_keys.push(s.local);
            }
            if !mappings.iter().any(|m| Arc::ptr_eq(m, remote_mapping)) {
                mappings.push(Arc::clone(remote_mapping));
            }
            pieces.push(Piece {
                src: local.view.slice(s.local_offset, s.len)?,
                dst: remote_mapping.view().slice(s.remote_offset, s.len)?,
                len: s.len,
            });
        }
        let deadline = Instant::now().checked_add(Duration::from_nanos(request.timeout_ns));
        Ok(Transfer {
            peer: request.peer,
            pieces: Arc::new(pieces),
            cursor: Cursor::default(),
            total_bytes,
            streaming: config.streams(total_bytes),
            copied_bytes: 0,
            deadline,
            timeout_ns: request.timeout_ns,
            local_keys,
            mappings,
        })
    }

    /// Fail `peer`'s transfers and drop its imported keys (disconnect, or a restarted peer).
    fn forget_peer(&self, state: &mut crate::state::State, peer: PeerId, message: &str) {
        state.fail_where(|t| t.peer == peer, ReasonCode::PEER_LOST, message);
        state.imported.retain(|_, k| k.peer != peer);
    }
}

fn check_range(i: usize, side: &str, offset: u64, len: u64, region_len: u64) -> Result<(), PluginError> {
    match offset.checked_add(len) {
        Some(end) if end <= region_len => Ok(()),
        _ => Err(err(
            ReasonCode::OUT_OF_RANGE,
            format!("segment {i}: {side} range {offset}+{len} lies outside its region of {region_len} bytes"),
        )),
    }
}

impl Plugin for ShmPlugin {
    fn info(&self) -> PluginInfo {
        plugin_info(&self.shared.config)
    }

    fn local_endpoint(&self) -> Vec<u8> {
        self.endpoint.encode()
    }

    // CONFORMANCE: HANDSHAKE-4, HANDSHAKE-2 (malformed endpoints refused; a new nonce drops the old incarnation)
    fn connect(&self, peer: PeerId, endpoint: &[u8]) -> Result<(), PluginError> {
        let remote = Endpoint::decode(endpoint)?;
        if remote.host_id != self.endpoint.host_id {
            return Err(err(
                ReasonCode::PEER_UNREACHABLE,
                format!("peer {} is on another host: shm reaches only this one", peer.0),
            ));
        }
        let mut state = self.shared.lock();
        Self::check_running(&state)?;
        if let Some(known) = state.peers.get(&peer) {
            if known.nonce == remote.nonce {
                return Ok(());
            }
            self.forget_peer(&mut state, peer, "shm peer restarted (new endpoint nonce)");
        }
        state.peers.insert(peer, remote);
        drop(state);
        self.shared.flush();
        Ok(())
    }

    // CONFORMANCE: TIME-3, HANDSHAKE-2 (the peer's transfers fail, its keys are dropped)
    fn disconnect(&self, peer: PeerId) {
        let mut state = self.shared.lock();
        if state.peers.remove(&peer).is_some() {
            self.forget_peer(&mut state, peer, "shm peer disconnected");
        }
        drop(state);
        self.shared.flush();
    }

    // CONFORMANCE: HANDSHAKE-3 (unservable memory and malformed regions refused here, never at a transfer)
    fn register(&self, region: &RegionDesc) -> Result<Registration, PluginError> {
        if region.kind != MemoryKind::HOST {
            return Err(err(
                ReasonCode::UNSUPPORTED_MEMORY,
                format!("shm serves host memory only, not {}", region.kind),
            ));
        }
        if region.len == 0 || region.addr == 0 {
            return Err(err(ReasonCode::INVALID_ARGUMENT, "shm region needs a non-zero addr and len"));
        }
        let view = RegionView::registered(region)
            .map_err(|_| err(ReasonCode::INVALID_ARGUMENT, "shm region wraps around the address space"))?;
        let path = region.backing_path.as_str();
        if path.is_empty() || !path.starts_with('/') {
            return Err(err(ReasonCode::INVALID_ARGUMENT, "shm region needs an absolute backing_path a peer can map"));
        }
        let (backing, file_len) = open_backing_file(path)?;
        if region.backing_offset.checked_add(region.len).is_none_or(|end| end > file_len) {
            return Err(err(
                ReasonCode::OUT_OF_RANGE,
                format!(
                    "region {}+{} lies outside backing file {path:?} of {file_len} bytes",
                    region.backing_offset, region.len
                ),
            ));
        }
        let mut state = self.shared.lock();
        Self::check_running(&state)?;
        let key = LocalKey(state.allocate_key());
        let meta = backing.metadata().map_err(|e| err(ReasonCode::INVALID_ARGUMENT, format!("fstat {path:?}: {e}")))?;
        let remote_key = RemoteKeyBytes {
            nonce: self.endpoint.nonce,
            region_id: key.0,
            backing_path: path.to_string(),
            backing_offset: region.backing_offset,
            len: region.len,
            owner_fd: backing.as_raw_fd() as u32,
            dev: meta.dev(),
            ino: meta.ino(),
        };
        state.regions.insert(key, LocalRegion { view, len: region.len, backing: Arc::new(backing) });
        state.registered_bytes += region.len;
        Ok(Registration { key, remote_key: remote_key.encode().into() })
    }

    // CONFORMANCE: DATA-4 (transfers reading the region fail; no worker touches it once this returns)
    fn deregister(&self, key: LocalKey) -> Result<(), PluginError> {
        let mut state = self.shared.lock();
        let Some(region) = state.regions.remove(&key) else {
            return Err(err(ReasonCode::UNKNOWN_KEY, format!("local key {} is not registered", key.0)));
        };
        state.registered_bytes -= region.len;
        state.fail_where(
            |t| t.local_keys.contains(&key),
            ReasonCode::UNKNOWN_KEY,
            "shm source region deregistered mid-transfer",
        );
        while state.region_busy(key) {
            state = self.shared.chunk_done.wait(state).unwrap_or_else(|p| p.into_inner());
        }
        drop(state);
        self.shared.flush();
        Ok(())
    }

    // CONFORMANCE: HANDSHAKE-4, HANDSHAKE-2 (malformed or stale keys refused; only a file the peer's
    // own process registered is ever mapped)
    fn import_remote_key(&self, peer: PeerId, bytes: &[u8]) -> Result<RemoteKey, PluginError> {
        let key = RemoteKeyBytes::decode(bytes)?;
        let (peer_nonce, peer_pid) = {
            let state = self.shared.lock();
            Self::check_running(&state)?;
            match state.peers.get(&peer) {
                Some(endpoint) => (endpoint.nonce, endpoint.pid),
                None => return Err(err(ReasonCode::PEER_UNREACHABLE, format!("peer {} is not connected", peer.0))),
            }
        };
        if key.nonce != peer_nonce {
            return Err(err(
                ReasonCode::PEER_LOST,
                format!("stale remote key: made by another incarnation of peer {}", peer.0),
            ));
        }
        // Never the path the key names: the descriptor the peer's process holds the file open with,
        // and only if it is still the same file. A key naming a file the peer did not register (or
        // a path of this process's choosing) can therefore never make this process map it.
        let owner_path = format!("/proc/{peer_pid}/fd/{}", key.owner_fd);
        // Opened and checked only: the mapping is made when a transfer first writes into the region
        // (so a peer's source pools, never written here, are never mapped).
        let backing = PeerBacking::open(&owner_path, Some((key.dev, key.ino)), key.backing_offset, key.len)
            .map_err(|e| err(e.code, format!("peer {} region {:?}: {}", peer.0, key.backing_path, e.message)))?;
        let mut state = self.shared.lock();
        Self::check_running(&state)?;
        if state.peers.get(&peer).map(|e| e.nonce) != Some(peer_nonce) {
            return Err(err(ReasonCode::PEER_LOST, format!("peer {} went away during the import", peer.0)));
        }
        let imported: u64 = state.imported.values().filter(|k| k.peer == peer).map(|k| k.backing.region_len()).sum();
        let bound = self.shared.config.max_import_bytes_per_peer;
        if imported.saturating_add(key.len) > bound {
            return Err(err(
                ReasonCode::RESOURCE_EXHAUSTED,
                format!("peer {} has {imported} bytes of regions imported; {} more would pass max_import_bytes_per_peer = {bound}", peer.0, key.len),
            ));
        }
        let remote = RemoteKey(state.allocate_key());
        state.imported.insert(remote, ImportedKey { peer, backing, mapping: std::sync::OnceLock::new() });
        Ok(remote)
    }

    fn release_remote_key(&self, key: RemoteKey) {
        self.shared.lock().imported.remove(&key);
    }

    // CONFORMANCE: DATA-3, TIME-5, TIME-11 (every check before anything is queued; never waits; bounded)
    fn submit(&self, request: &SubmitRequest<'_>) -> Result<(), PluginError> {
        if request.timeout_ns == 0 {
            return Err(err(ReasonCode::INVALID_ARGUMENT, "timeout_ns must be > 0"));
        }
        let mut state = self.shared.lock();
        Self::check_running(&state)?;
        if !state.peers.contains_key(&request.peer) {
            return Err(err(ReasonCode::PEER_UNREACHABLE, format!("peer {} is not connected", request.peer.0)));
        }
        if state.transfers.contains(request.xfer) {
            return Err(err(ReasonCode::DUPLICATE_ID, format!("transfer {} is already live", request.xfer.0)));
        }
        let limit = self.shared.config.max_inflight_transfers;
        if state.live_transfers() >= limit {
            return Err(err(
                ReasonCode::RESOURCE_EXHAUSTED,
                format!("{limit} live transfers: max_inflight_transfers reached"),
            ));
        }
        let transfer = self.plan(&state, request)?;
        let spans_chunks = transfer.total_bytes > self.shared.config.chunk_bytes;
        let inline = state.queue.is_empty() && self.shared.config.copies_inline(transfer.total_bytes);
        let wake_timer = transfer.deadline.is_some_and(|d| state.timer.must_wake_for(d));
        state.insert(request.xfer, transfer)?;
        if inline {
            // Nothing else waits, so the chunk claimed is this transfer's (its only one).
            if let Some(job) = state.claim(self.shared.config.chunk_bytes) {
                drop(state);
                crate::workers::copy_claimed(&self.shared, job);
                return Ok(());
            }
        }
        drop(state);
        if spans_chunks {
            self.shared.work_ready.notify_all();
        } else {
            self.shared.work_ready.notify_one();
        }
        if wake_timer {
            self.shared.timer_wake.notify_one();
        }
        Ok(())
    }

    // CONFORMANCE: ABORT-1, ABORT-2, ABORT-3 (no peer involved; unknown or finished ids ignored)
    fn cancel(&self, xfer: XferId) {
        self.shared.lock().cancel(xfer);
        self.shared.flush();
    }

    // CONFORMANCE: OBS-2
    fn stats(&self) -> Stats {
        let state = self.shared.lock();
        Stats {
            live_transfers: state.live_transfers(),
            unquiesced_transfers: state.unquiesced_transfers(),
            live_tickets: 0,
            registered_regions: state.regions.len() as u64,
            registered_bytes: state.registered_bytes,
            imported_remote_keys: state.imported.len() as u64,
            connected_peers: state.peers.len() as u64,
            workers_alive: self.shared.threads_alive.load(Ordering::SeqCst),
            healthy: u8::from(state.healthy && !state.shutting_down),
        }
    }

    // CONFORMANCE: RES-5
    fn shutdown(&self) {
        let mut threads = self.threads.lock().unwrap_or_else(|p| p.into_inner());
        {
            let mut state = self.shared.lock();
            state.shutting_down = true;
            state.fail_where(|_| true, ReasonCode::SHUTDOWN, "shm plugin shutting down");
        }
        self.shared.work_ready.notify_all();
        self.shared.timer_wake.notify_all();
        for handle in threads.drain(..) {
            let _ = handle.join();
        }
        {
            let mut state = self.shared.lock();
            debug_assert!(state.transfers.is_empty(), "workers quiesced every transfer before exiting");
            state.transfers.close_all(ReasonCode::SHUTDOWN, "shm plugin shutting down");
            state.queue.clear();
            state.imported.clear();
            state.regions.clear();
            state.registered_bytes = 0;
            state.peers.clear();
        }
        self.shared.flush_blocking();
    }
}

impl Drop for ShmPlugin {
    fn drop(&mut self) {
        self.shutdown();
    }
}
