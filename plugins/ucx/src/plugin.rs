//! The `Plugin` face of the UCX transport: validates every call on the caller's thread, keeps the
//! shared books, and hands network work to the progress thread. Never waits on the network; the
//! only blocking call is `shutdown`, which joins the progress thread (bounded by its drain limit).

use crate::config::{ResolvedMode, UcxConfig};
use crate::engine::Engine;
use crate::shared::{
    resolve_segments, Command, LocalRegion, OutgoingJob, PeerInfo, Registry, RemoteRegion, Shared, TicketState,
};
use crate::ucp::{self, Context, Worker};
use crate::wire::{EndpointBytes, RemoteKeyBytes};
use kvgate_abi::sdk::{spawn_worker, Plugin, PluginFactory, Sink};
use kvgate_abi::{
    cap_flags, scope, Capabilities, Event, IncomingRequest, LocalKey, MemoryKind, PeerId, PluginError, PluginInfo,
    ReasonCode, RegionDesc, Registration, RemoteKey, Stats, SubmitRequest, Ticket, XferId, ABI_VERSION,
};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Opens [`UcxPlugin`] instances (the `PluginFactory` of this crate).
pub struct UcxFactory;

/// One UCP context + worker + progress thread.
pub struct UcxPlugin {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

fn capabilities(config: &UcxConfig, mode: ResolvedMode) -> Capabilities {
    Capabilities {
        memory_kinds: MemoryKind::HOST.bit(),
        scope: scope::SAME_HOST | scope::CROSS_HOST,
        flags: if mode == ResolvedMode::Am { cap_flags::RECEIVER_ENFORCED } else { 0 },
        max_segments_per_submit: config.max_segments_per_submit,
        max_inflight_transfers: config.max_inflight_transfers,
        max_transfer_bytes: 0,
    }
}

fn static_info(capabilities: Capabilities) -> PluginInfo {
    PluginInfo { name: "ucx".into(), version: env!("CARGO_PKG_VERSION").into(), abi_version: ABI_VERSION, capabilities }
}

fn unavailable(message: String) -> PluginError {
    tracing::warn!(reason = "unavailable", "ucx plugin cannot open: {message}");
    PluginError::new(ReasonCode::UNAVAILABLE, message)
}

fn random_instance_id() -> u64 {
    let mut bytes = [0u8; 8];
    // SAFETY: getrandom writes at most 8 bytes into the 8-byte array it is given.
    let got = unsafe { libc::getrandom(bytes.as_mut_ptr() as *mut libc::c_void, 8, 0) };
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    let fallback = nanos ^ ((std::process::id() as u64) << 32);
    if got == 8 {
        u64::from_le_bytes(bytes) | 1
    } else {
        fallback | 1
    }
}

/// Parse the config and hand every UCX setting to UCX's own config parser (which opens no
/// transport), so that `check_config` refuses what `open` would.
// CONFORMANCE: HYGIENE-3 (a malformed config fails INVALID_ARGUMENT; no UCX, UNAVAILABLE)
fn parse_with_ucx(config_text: &str) -> Result<(UcxConfig, ucp::Config), PluginError> {
    let config = UcxConfig::parse(config_text)?;
    let mut ucx_config = ucp::Config::read().map_err(|e| unavailable(format!("UCX configuration: {e}")))?;
    for (name, value, key) in config.ucx_settings() {
        ucx_config.modify(&name, &value).map_err(|e| {
            let message =
                format!("ucx config: `{key}` = {value:?} refused by UCX ({name}): {}", ucp::status_text(e.status));
            tracing::warn!(reason = "invalid_argument", "{message}");
            PluginError::new(ReasonCode::INVALID_ARGUMENT, message)
        })?;
    }
    Ok((config, ucx_config))
}

impl PluginFactory for UcxFactory {
    type Plugin = UcxPlugin;

    fn info() -> PluginInfo {
        let config = UcxConfig::default();
        static_info(capabilities(&config, config.resolved_mode()))
    }

    fn check_config(config_text: &str) -> Result<(), PluginError> {
        parse_with_ucx(config_text).map(|_| ())
    }

    fn open(config_text: &str, sink: Sink) -> Result<UcxPlugin, PluginError> {
        crate::ucx_log::route_ucx_logs_to_tracing();
        let (config, ucx_config) = parse_with_ucx(config_text)?;
        let context = Context::new(&ucx_config).map_err(|e| unavailable(format!("no usable UCX transport: {e}")))?;
        drop(ucx_config);
        let worker = Worker::new(&context).map_err(|e| unavailable(format!("no usable UCX transport: {e}")))?;
        let worker_address = worker.address().map_err(|e| unavailable(e.to_string()))?;
        // SAFETY: eventfd takes only values; the descriptor it returns is checked below and owned by `Shared`
        // (closed on drop).
        let wake_fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if wake_fd < 0 {
            return Err(unavailable(format!("eventfd: {}", std::io::Error::last_os_error())));
        }
        let mode = config.resolved_mode();
        let shared = Arc::new(Shared {
            registry: Mutex::new(Registry { next_local_key: 1, next_remote_key: 1, ..Registry::default() }),
            sink: sink.clone(),
            config,
            mode,
            instance: random_instance_id(),
            context,
            worker_address,
            boot_id: crate::wire::this_boot_id(),
            wake_fd,
            commands_pending: AtomicBool::new(false),
            commands_held_for_tests: AtomicBool::new(false),
            progress_thread_sleeping: AtomicBool::new(false),
            healthy: AtomicBool::new(true),
            workers_alive: AtomicU64::new(0),
            posted_bytes_peak: AtomicU64::new(0),
        });
        let engine = Engine::new(shared.clone(), worker).map_err(|e| unavailable(e.to_string()))?;
        let engine = SendBox(engine);
        let thread_shared = shared.clone();
        shared.workers_alive.store(1, Ordering::Release);
        let thread = spawn_worker("kvgate-ucx-progress", sink, move || {
            let _alive = AliveGuard(thread_shared);
            let engine = engine;
            engine.0.run();
        })
        .map_err(|e| {
            shared.workers_alive.store(0, Ordering::Release);
            PluginError::new(ReasonCode::RESOURCE_EXHAUSTED, format!("cannot start the progress thread: {e}"))
        })?;
        tracing::info!(mode = ?mode, ucx = %ucp::version(), "ucx plugin open");
        Ok(UcxPlugin { shared, thread: Mutex::new(Some(thread)) })
    }
}

/// The engine holds raw UCX pointers; it is moved once into its own thread and used only there.
struct SendBox(Box<Engine>);
// SAFETY: the engine's raw UCX handles belong to a worker created with a single-thread mode; the box is moved
// once into the progress thread and used only there, never touched from the thread that made it.
unsafe impl Send for SendBox {}

/// Marks the progress thread gone (and the instance unhealthy) however it ends.
struct AliveGuard(Arc<Shared>);
// CONFORMANCE: TIME-10 (a progress thread that died fails what it held and leaves the instance unhealthy)
impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.0.workers_alive.store(0, Ordering::Release);
        self.0.healthy.store(false, Ordering::Release);
        // A progress thread that died (rather than shut down) fails whatever it still held.
        let mut registry = self.0.lock();
        if !registry.shut_down {
            let live: Vec<u64> = registry.live_xfers.drain().collect();
            drop(registry);
            for xfer in live {
                tracing::warn!(reason = "internal", xfer, "ucx progress thread died; transfer failed");
                self.0.sink.failed(XferId(xfer), ReasonCode::INTERNAL, "ucx progress thread died");
            }
        }
    }
}

fn shut(what: &str) -> PluginError {
    PluginError::new(ReasonCode::SHUTDOWN, format!("ucx plugin is shut down ({what})"))
}

impl UcxPlugin {
    fn usable(&self, registry: &Registry, what: &str) -> Result<(), PluginError> {
        if registry.shut_down {
            return Err(shut(what));
        }
        if !self.shared.is_healthy() {
            return Err(PluginError::new(ReasonCode::INTERNAL, format!("ucx progress thread is gone ({what})")));
        }
        Ok(())
    }

    pub fn mode(&self) -> ResolvedMode {
        self.shared.mode
    }

    /// Test hook: while `hold` is true the progress thread keeps progressing UCX (peers' messages
    /// are received and answered) but leaves the host's calls queued, as a loaded machine may for a
    /// while; releasing it runs them. Not part of the `Plugin` interface.
    #[doc(hidden)]
    pub fn hold_commands_for_tests(&self, hold: bool) {
        self.shared.commands_held_for_tests.store(hold, Ordering::SeqCst);
        self.shared.wake();
    }

    /// Test hook: the most data bytes (messages or puts) this instance has had posted to UCX at
    /// once, which `max_posted_bytes` bounds. Not part of the `Plugin` interface.
    #[doc(hidden)]
    pub fn posted_bytes_peak_for_tests(&self) -> u64 {
        self.shared.posted_bytes_peak.load(Ordering::Relaxed)
    }
}

impl UcxPlugin {
    // Trait-independent bodies; `impl Plugin` below logs every refusal.

    // CONFORMANCE: HYGIENE-4 (module and instance report the same name and ABI version)
    pub fn info(&self) -> PluginInfo {
        static_info(capabilities(&self.shared.config, self.shared.mode))
    }

    pub fn local_endpoint(&self) -> Vec<u8> {
        EndpointBytes {
            instance: self.shared.instance,
            pid: std::process::id(),
            boot_id: self.shared.boot_id,
            worker_address: self.shared.worker_address.clone(),
        }
        .encode()
    }

    // CONFORMANCE: HANDSHAKE-4 (malformed endpoints refused)
    fn connect_checked(&self, peer: PeerId, endpoint: &[u8]) -> Result<(), PluginError> {
        let decoded = EndpointBytes::decode(endpoint)?;
        let mut registry = self.shared.lock();
        self.usable(&registry, "connect")?;
        if let Some(old_instance) = registry.peers.get(&peer).map(|old| old.instance) {
            registry.forget_instance_of(peer, old_instance);
        }
        registry.instance_to_peer.insert(decoded.instance, peer);
        registry.peers.insert(
            peer,
            PeerInfo { instance: decoded.instance, worker_address: decoded.worker_address.clone(), down: false },
        );
        let same_host = decoded.boot_id == self.shared.boot_id && decoded.boot_id != [0; 16];
        let process = (same_host && decoded.pid != 0).then_some(decoded.pid);
        registry.commands.push_back(Command::Connect {
            peer,
            instance: decoded.instance,
            worker_address: decoded.worker_address,
            process,
        });
        drop(registry);
        self.shared.wake();
        Ok(())
    }

    pub fn disconnect(&self, peer: PeerId) {
        let mut registry = self.shared.lock();
        if let Some(instance) = registry.peers.get(&peer).map(|info| info.instance) {
            // Another peer id connected to the same instance keeps receiving its writes.
            registry.forget_instance_of(peer, instance);
            registry.peers.remove(&peer);
            registry.commands.push_back(Command::Disconnect { peer });
        }
        drop(registry);
        self.shared.wake();
    }

    // CONFORMANCE: HANDSHAKE-3 (unservable memory and malformed regions refused here)
    fn register_checked(&self, region: &RegionDesc) -> Result<Registration, PluginError> {
        if region.kind != MemoryKind::HOST {
            return Err(PluginError::new(
                ReasonCode::UNSUPPORTED_MEMORY,
                format!("ucx plugin serves host memory only (this UCX has no CUDA support), not {}", region.kind),
            ));
        }
        if region.len == 0 || region.addr == 0 || region.addr.checked_add(region.len).is_none() {
            return Err(PluginError::new(
                ReasonCode::INVALID_ARGUMENT,
                format!("bad region addr {:#x} len {}", region.addr, region.len),
            ));
        }
        self.usable(&self.shared.lock(), "register")?;
        let map = self.shared.context.map(region.addr, region.len).map_err(|e| {
            tracing::warn!(reason = "transport_error", "ucx register: {e}");
            PluginError::new(ReasonCode::TRANSPORT_ERROR, e.to_string())
        })?;
        let mut registry = self.shared.lock();
        self.usable(&registry, "register")?;
        let key = registry.next_local_key;
        registry.next_local_key += 1;
        let remote_key = RemoteKeyBytes {
            owner_instance: self.shared.instance,
            region: key,
            addr: region.addr,
            len: region.len,
            packed_rkey: map.packed_rkey.clone(),
        }
        .encode();
        registry.regions.insert(key, Arc::new(LocalRegion::new(LocalKey(key), region.addr, region.len, map)));
        Ok(Registration { key: LocalKey(key), remote_key: remote_key.into() })
    }

    /// Forget the region; return once no UCX request touches it any more (its sends, puts and
    /// rendezvous receives handed back by UCX), waiting at most `deregister_wait_ms`. Past that the
    /// region is quarantined: its UCX registration stays until the last request completes, and the
    /// error tells the host to keep its memory mapped.
    // CONFORMANCE: DATA-4 (transfers reading it fail), TIME-5 (bounded by deregister_wait_ms)
    fn deregister_checked(&self, key: LocalKey) -> Result<(), PluginError> {
        let mut registry = self.shared.lock();
        let Some(region) = registry.regions.remove(&key.0) else {
            return Err(PluginError::new(ReasonCode::UNKNOWN_KEY, format!("no registered region {}", key.0)));
        };
        // Under the registry lock, which rendezvous receives take their hold under: none starts after it.
        let in_flight = region.close_to_new_requests();
        registry.commands.push_back(Command::Deregistered(key));
        drop(registry);
        self.shared.wake();
        if in_flight == 0 {
            return Ok(());
        }
        let limit = Duration::from_millis(self.shared.config.deregister_wait_ms);
        // The progress thread hands the requests back: it cannot wait for itself (a host calling
        // from inside an event it delivers).
        if !crate::engine::on_progress_thread() && region.wait_until_untouched(limit) {
            return Ok(());
        }
        let left = region.requests_in_flight();
        if left == 0 {
            return Ok(());
        }
        let message = format!(
            "region {} quarantined: {left} UCX request(s) still use it after deregister_wait_ms = {}; its UCX \
             registration is kept until they complete, and its memory must stay mapped",
            key.0, self.shared.config.deregister_wait_ms
        );
        tracing::warn!(reason = "region_quarantined", region = key.0, requests = left, "ucx deregister: {message}");
        Err(PluginError::new(ReasonCode::TRANSPORT_ERROR, message))
    }

    // CONFORMANCE: HANDSHAKE-4 (malformed or stale remote keys refused)
    fn import_remote_key_checked(&self, peer: PeerId, bytes: &[u8]) -> Result<RemoteKey, PluginError> {
        let decoded = RemoteKeyBytes::decode(bytes)?;
        let mut registry = self.shared.lock();
        self.usable(&registry, "import_remote_key")?;
        if let Some(info) = registry.peers.get(&peer) {
            if info.instance != decoded.owner_instance {
                return Err(PluginError::new(
                    ReasonCode::INVALID_ARGUMENT,
                    format!(
                        "remote key was made by instance {:#x}, peer {} is instance {:#x}",
                        decoded.owner_instance, peer.0, info.instance
                    ),
                ));
            }
        }
        let id = registry.next_remote_key;
        registry.next_remote_key += 1;
        registry.remote_keys.insert(
            id,
            Arc::new(RemoteRegion {
                id,
                peer,
                region: decoded.region,
                addr: decoded.addr,
                len: decoded.len,
                packed_rkey: decoded.packed_rkey,
            }),
        );
        Ok(RemoteKey(id))
    }

    pub fn release_remote_key(&self, key: RemoteKey) {
        let mut registry = self.shared.lock();
        if registry.remote_keys.remove(&key.0).is_some() {
            registry.commands.push_back(Command::ReleaseRemoteKey(key.0));
            drop(registry);
            self.shared.wake();
        }
    }

    // CONFORMANCE: DATA-3, TIME-5, TIME-11 (every check before anything is queued; never waits; bounded)
    fn submit_checked(&self, request: &SubmitRequest<'_>) -> Result<(), PluginError> {
        let config = &self.shared.config;
        let deadline = Instant::now() + Duration::from_nanos(request.timeout_ns);
        if request.segments.len() as u64 > config.max_segments_per_submit {
            return Err(PluginError::new(
                ReasonCode::RESOURCE_EXHAUSTED,
                format!(
                    "{} segments exceed max_segments_per_submit = {}",
                    request.segments.len(),
                    config.max_segments_per_submit
                ),
            ));
        }
        let mut registry = self.shared.lock();
        self.usable(&registry, "submit")?;
        if registry.live_xfers.contains(&request.xfer.0) || registry.unquiesced_xfers.contains(&request.xfer.0) {
            return Err(PluginError::new(
                ReasonCode::DUPLICATE_ID,
                format!("transfer {} is already live", request.xfer.0),
            ));
        }
        if registry.live_xfers.len() as u64 >= config.max_inflight_transfers {
            return Err(PluginError::new(
                ReasonCode::RESOURCE_EXHAUSTED,
                format!("max_inflight_transfers = {} reached", config.max_inflight_transfers),
            ));
        }
        match registry.peers.get(&request.peer) {
            None => {
                return Err(PluginError::new(
                    ReasonCode::PEER_UNREACHABLE,
                    format!("peer {} is not connected", request.peer.0),
                ));
            }
            Some(p) if p.down => {
                return Err(PluginError::new(ReasonCode::PEER_LOST, format!("peer {} is down", request.peer.0)));
            }
            Some(_) => {}
        }
        let (segments, local_regions, remote_regions) =
            resolve_segments(&registry, request.peer, request.segments.as_slice(), config.join_segments_max_bytes)?;
        let total_bytes = segments.iter().map(|s| s.len).sum();
        registry.live_xfers.insert(request.xfer.0);
        registry.commands.push_back(Command::Submit(Box::new(OutgoingJob {
            xfer: request.xfer,
            peer: request.peer,
            ticket: request.ticket,
            deadline,
            segments,
            total_bytes,
            local_regions,
            remote_regions,
        })));
        drop(registry);
        self.shared.wake();
        Ok(())
    }

    // CONFORMANCE: ABORT-3, ABORT-4 (unknown or finished ids ignored; a cancel is one queued command, never a wait)
    pub fn cancel(&self, xfer: XferId) {
        let registry = self.shared.lock();
        if registry.shut_down || !(registry.live_xfers.contains(&xfer.0) || registry.unquiesced_xfers.contains(&xfer.0))
        {
            return;
        }
        drop(registry);
        self.shared.post(Command::Cancel(xfer));
    }

    fn expect_incoming_checked(&self, request: &IncomingRequest<'_>) -> Result<(), PluginError> {
        let now = Instant::now();
        let mut registry = self.shared.lock();
        self.usable(&registry, "expect_incoming")?;
        for (i, range) in request.ranges.iter().enumerate() {
            let region = registry.regions.get(&range.key.0).ok_or_else(|| {
                PluginError::new(ReasonCode::UNKNOWN_KEY, format!("range {i}: no registered region {}", range.key.0))
            })?;
            if range.offset.checked_add(range.len).is_none_or(|end| end > region.len) {
                return Err(PluginError::new(
                    ReasonCode::OUT_OF_RANGE,
                    format!(
                        "range {i}: {}+{} outside region {} of {} bytes",
                        range.offset, range.len, range.key.0, region.len
                    ),
                ));
            }
        }
        if let Some(existing) = registry.tickets.get(&request.ticket.0) {
            if existing.authorises(now) || existing.pending_writes > 0 {
                return Err(PluginError::new(
                    ReasonCode::DUPLICATE_ID,
                    format!("ticket {} is already live", request.ticket.0),
                ));
            }
        }
        if registry.live_tickets(now) >= self.shared.config.max_live_tickets {
            return Err(PluginError::new(
                ReasonCode::RESOURCE_EXHAUSTED,
                format!("max_live_tickets = {} reached", self.shared.config.max_live_tickets),
            ));
        }
        let deadline = now + Duration::from_nanos(request.timeout_ns);
        registry.tickets.insert(request.ticket.0, TicketState::new(request.peer, request.ranges.as_slice(), deadline));
        Ok(())
    }

    pub fn cancel_incoming(&self, peer: PeerId, ticket: Ticket) {
        let mut registry = self.shared.lock();
        let quiet = match registry.tickets.get_mut(&ticket.0) {
            Some(t) if t.peer == peer && t.pending_writes > 0 => {
                // The progress thread reports QUIESCED when the last receive under it ends.
                t.cancelled = true;
                false
            }
            Some(t) if t.peer == peer => {
                registry.tickets.remove(&ticket.0);
                true
            }
            Some(_) => return,
            None => true,
        };
        drop(registry);
        if quiet && self.shared.mode == ResolvedMode::Am {
            self.shared.sink.deliver(Event::incoming_quiesced(peer, ticket));
        }
    }

    pub fn stats(&self) -> Stats {
        let now = Instant::now();
        let registry = self.shared.lock();
        Stats {
            live_transfers: registry.live_xfers.len() as u64,
            unquiesced_transfers: registry.unquiesced_xfers.len() as u64,
            live_tickets: registry.live_tickets(now),
            registered_regions: registry.regions.len() as u64,
            registered_bytes: registry.regions.values().map(|r| r.len).sum(),
            imported_remote_keys: registry.remote_keys.len() as u64,
            connected_peers: registry.peers.values().filter(|p| !p.down).count() as u64,
            workers_alive: self.shared.workers_alive.load(Ordering::Acquire),
            healthy: (self.shared.is_healthy() && !registry.shut_down) as u8,
        }
    }

    // CONFORMANCE: RES-5
    pub fn shutdown(&self) {
        let Some(thread) = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take() else { return };
        {
            let mut registry = self.shared.lock();
            registry.shut_down = true;
            registry.commands.push_back(Command::Shutdown);
        }
        self.shared.wake();
        let _ = thread.join();
        let mut registry = self.shared.lock();
        registry.regions.clear();
        registry.remote_keys.clear();
        registry.tickets.clear();
        registry.peers.clear();
        registry.instance_to_peer.clear();
        registry.live_xfers.clear();
        registry.unquiesced_xfers.clear();
        registry.commands.clear();
    }
}

/// Every refusal is logged with its reason code, every time.
fn logged<T>(call: &str, result: Result<T, PluginError>) -> Result<T, PluginError> {
    if let Err(e) = &result {
        tracing::warn!(reason = e.code.as_str(), call, "ucx {call} refused: {}", e.message);
    }
    result
}

impl Plugin for UcxPlugin {
    fn info(&self) -> PluginInfo {
        UcxPlugin::info(self)
    }
    fn local_endpoint(&self) -> Vec<u8> {
        UcxPlugin::local_endpoint(self)
    }
    fn connect(&self, peer: PeerId, endpoint: &[u8]) -> Result<(), PluginError> {
        logged("connect", self.connect_checked(peer, endpoint))
    }
    fn disconnect(&self, peer: PeerId) {
        UcxPlugin::disconnect(self, peer)
    }
    fn register(&self, region: &RegionDesc) -> Result<Registration, PluginError> {
        logged("register", self.register_checked(region))
    }
    fn deregister(&self, key: LocalKey) -> Result<(), PluginError> {
        logged("deregister", self.deregister_checked(key))
    }
    fn import_remote_key(&self, peer: PeerId, bytes: &[u8]) -> Result<RemoteKey, PluginError> {
        logged("import_remote_key", self.import_remote_key_checked(peer, bytes))
    }
    fn release_remote_key(&self, key: RemoteKey) {
        UcxPlugin::release_remote_key(self, key)
    }
    fn submit(&self, request: &SubmitRequest<'_>) -> Result<(), PluginError> {
        logged("submit", self.submit_checked(request))
    }
    fn cancel(&self, xfer: XferId) {
        UcxPlugin::cancel(self, xfer)
    }
    fn expect_incoming(&self, request: &IncomingRequest<'_>) -> Result<(), PluginError> {
        logged("expect_incoming", self.expect_incoming_checked(request))
    }
    fn cancel_incoming(&self, peer: PeerId, ticket: Ticket) {
        UcxPlugin::cancel_incoming(self, peer, ticket)
    }
    fn stats(&self) -> Stats {
        UcxPlugin::stats(self)
    }
    fn shutdown(&self) {
        UcxPlugin::shutdown(self)
    }
}

impl Drop for UcxPlugin {
    fn drop(&mut self) {
        self.shutdown();
    }
}
