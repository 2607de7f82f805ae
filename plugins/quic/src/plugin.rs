//! The plugin instance: owns the tokio runtime, the endpoints and every table, and answers the host's
//! calls. Every call returns without waiting on the network; work on the wire runs as runtime tasks.

use crate::config::QuicConfig;
use crate::net;
use crate::outgoing::{plan_lanes, run_transfer, PlannedSegment};
use crate::peers::{self, PeerEntry};
use crate::regions::{in_bounds, Regions};
use crate::shared::Shared;
use crate::staging::StagingPool;
use crate::tickets::Tickets;
use crate::tls::{self, Identity, KnownPeers};
use crate::transfers::Transfers;
use crate::wire::{EndpointInfo, WIRE_VERSION};
use kvgate_abi::sdk::{Plugin, Sink};
use kvgate_abi::{
    cap_flags, scope, Capabilities, Event, IncomingRequest, LocalKey, MemoryKind, PeerId, PluginError, PluginInfo,
    ReasonCode, RegionDesc, Registration, RemoteKey, Stats, SubmitRequest, Ticket, XferId, ABI_VERSION,
};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

/// How long `shutdown` waits for the runtime's threads to finish their current step.
pub const SHUTDOWN_JOIN_TIMEOUT_MS: u64 = 2000;

/// One open instance of the QUIC plugin.
pub struct QuicPlugin {
    shared: Arc<Shared>,
    runtime: Mutex<Option<tokio::runtime::Runtime>>,
}

fn random_u64() -> u64 {
    use ring::rand::SecureRandom;
    let mut bytes = [0u8; 8];
    ring::rand::SystemRandom::new().fill(&mut bytes).expect("the system random source works");
    u64::from_le_bytes(bytes)
}

pub fn capabilities(config: &QuicConfig) -> Capabilities {
    Capabilities {
        memory_kinds: MemoryKind::HOST.bit(),
        scope: scope::SAME_HOST | scope::CROSS_HOST,
        flags: cap_flags::RECEIVER_ENFORCED,
        max_segments_per_submit: config.max_segments_per_submit,
        max_inflight_transfers: config.max_inflight_transfers,
        max_transfer_bytes: 0,
    }
}

// CONFORMANCE: HYGIENE-4 (module and instance report the same name and ABI version)
pub fn plugin_info(config: &QuicConfig) -> PluginInfo {
    PluginInfo {
        name: "quic".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        abi_version: ABI_VERSION,
        capabilities: capabilities(config),
    }
}

fn unavailable(what: &str, e: impl std::fmt::Display) -> PluginError {
    PluginError::new(ReasonCode::UNAVAILABLE, format!("quic: {what}: {e}"))
}

impl QuicPlugin {
    /// Open an instance from a parsed configuration.
    pub fn open(config: QuicConfig, sink: Sink) -> Result<QuicPlugin, PluginError> {
        config.validate()?;
        if config.listen_address.ip().is_unspecified() && config.advertise_ip.is_none() {
            return Err(PluginError::new(
                ReasonCode::INVALID_ARGUMENT,
                format!("quic config: `advertise_ip` is required when listen_address is {}", config.listen_address),
            ));
        }
        let identity = match (&config.certificate_path, &config.private_key_path) {
            (Some(cert), Some(key)) => Identity::from_pem_files(cert, key)?,
            _ => Identity::self_signed()?,
        };
        if config.malloc_trim_threshold_bytes != 0 {
            crate::allocator::set_malloc_trim_threshold(config.malloc_trim_threshold_bytes).map_err(|why| {
                PluginError::new(
                    ReasonCode::INVALID_ARGUMENT,
                    format!("quic config: `malloc_trim_threshold_bytes`: {why}"),
                )
            })?;
            tracing::info!(
                bytes = config.malloc_trim_threshold_bytes,
                "quic: glibc malloc trim threshold set (process-wide)"
            );
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.worker_threads)
            .thread_name("kvgate-quic")
            .enable_all()
            .build()
            .map_err(|e| unavailable("cannot start the runtime", e))?;
        let _context = runtime.enter();
        let known = Arc::new(KnownPeers::default());
        let transport = net::transport_config(&config)?;
        let server_crypto = quinn::crypto::rustls::QuicServerConfig::try_from(tls::server_crypto(
            &identity,
            known.clone(),
            config.cipher_suite,
        )?)
        .map_err(|e| PluginError::new(ReasonCode::INTERNAL, format!("quic server crypto: {e}")))?;
        let mut server_config = quinn::ServerConfig::with_crypto(Arc::new(server_crypto));
        server_config.transport_config(transport.clone());
        let mut endpoint_config = quinn::EndpointConfig::default();
        endpoint_config.max_udp_payload_size(config.mtu_discovery_upper_bound_bytes).map_err(|e| {
            PluginError::new(
                ReasonCode::INVALID_ARGUMENT,
                format!("quic config: `mtu_discovery_upper_bound_bytes`: {e}"),
            )
        })?;
        let mut endpoints = Vec::with_capacity(config.endpoints);
        let mut addresses = Vec::with_capacity(config.endpoints);
        for i in 0..config.endpoints {
            let mut addr = config.listen_address;
            if addr.port() != 0 {
                let port = addr.port().checked_add(i as u16).ok_or_else(|| {
                    PluginError::new(
                        ReasonCode::INVALID_ARGUMENT,
                        "quic config: `listen_address` port + endpoints exceeds 65535",
                    )
                })?;
                addr.set_port(port);
            }
            let socket = net::udp_socket(addr, config.socket_buffer_bytes)?;
            let endpoint = quinn::Endpoint::new(
                endpoint_config.clone(),
                Some(server_config.clone()),
                socket,
                Arc::new(quinn::TokioRuntime),
            )
            .map_err(|e| unavailable("cannot start an endpoint", e))?;
            let bound = endpoint.local_addr().map_err(|e| unavailable("endpoint address", e))?;
            addresses.push(SocketAddr::new(config.advertise_ip.unwrap_or(bound.ip()), bound.port()));
            endpoints.push(endpoint);
        }
        let instance = random_u64();
        let wire_version = config.wire_version_override.unwrap_or(WIRE_VERSION);
        let endpoint_bytes =
            EndpointInfo { wire_version, instance, fingerprint: identity.fingerprint, addresses }.encode();
        let staging = StagingPool::new(config.write_chunk_bytes, config.staging_pool_bytes);
        let shared = Arc::new(Shared {
            transfers: Transfers::new(sink.clone()),
            config,
            sink,
            instance,
            wire_version,
            identity,
            known,
            regions: Regions::new(instance),
            tickets: Tickets::default(),
            transport,
            staging,
            deadlines: Arc::default(),
            endpoints,
            handle: runtime.handle().clone(),
            lane_streams_opened: std::sync::atomic::AtomicU64::new(0),
            stuck_connections_replaced: std::sync::atomic::AtomicU64::new(0),
            peers: Mutex::new(HashMap::new()),
            endpoint_bytes,
            shut_down: AtomicBool::new(false),
            lifecycle: RwLock::new(()),
        });
        for endpoint in &shared.endpoints {
            runtime.spawn(crate::server::accept_loop(shared.clone(), endpoint.clone()));
        }
        runtime.spawn(shared.deadlines.clone().run(shared.transfers.clone()));
        drop(_context);
        Ok(QuicPlugin { shared, runtime: Mutex::new(Some(runtime)) })
    }

    /// quinn's statistics of every outgoing connection (all peers): datagrams, losses, congestion
    /// events, path MTU. For benchmarks and diagnostics; empty once shut down.
    pub fn outgoing_connection_stats(&self) -> Vec<quinn::ConnectionStats> {
        let entries: Vec<Arc<PeerEntry>> = self.shared.peers.lock().expect("peers lock").values().cloned().collect();
        entries.iter().flat_map(|e| e.connection_stats()).collect()
    }

    /// The same for the connections peers opened to this instance (the ones their writes arrive on).
    pub fn incoming_connection_stats(&self) -> Vec<quinn::ConnectionStats> {
        let entries: Vec<Arc<PeerEntry>> = self.shared.peers.lock().expect("peers lock").values().cloned().collect();
        entries.iter().flat_map(|e| e.incoming_connection_stats()).collect()
    }

    /// Lane streams this instance opened to its peers so far. Lanes live as long as their connection,
    /// so this stays at `connections_per_peer * lanes_per_connection` per connected peer however many
    /// transfers run. For tests and diagnostics.
    pub fn lane_streams_opened(&self) -> u64 {
        self.shared.lane_streams_opened.load(Ordering::Relaxed)
    }

    /// Times a peer's connections were replaced because one of them was stuck (`stuck_after_ms`). For
    /// tests and diagnostics.
    pub fn stuck_connections_replaced(&self) -> u64 {
        self.shared.stuck_connections_replaced.load(Ordering::Relaxed)
    }

    fn refuse_if_shut_down(&self) -> Result<(), PluginError> {
        if self.shared.is_shut_down() {
            return Err(PluginError::new(ReasonCode::SHUTDOWN, "the quic plugin is shut down"));
        }
        Ok(())
    }

    fn timeout_of(&self, timeout_ns: u64) -> Duration {
        if timeout_ns == 0 {
            Duration::from_millis(self.shared.config.default_transfer_timeout_ms)
        } else {
            Duration::from_nanos(timeout_ns)
        }
    }

    /// Check every segment and resolve remote keys; nothing is started on error.
    // CONFORMANCE: DATA-2, DATA-3 (every segment checked against both regions before anything is queued)
    fn resolve_segments(
        &self,
        request: &SubmitRequest<'_>,
        entry: &PeerEntry,
    ) -> Result<(Vec<PlannedSegment>, u64), PluginError> {
        let shared = &self.shared;
        let count = request.segments.len() as u64;
        if count > shared.config.max_segments_per_submit {
            return Err(PluginError::new(
                ReasonCode::RESOURCE_EXHAUSTED,
                format!("{count} segments exceed max_segments_per_submit ({})", shared.config.max_segments_per_submit),
            ));
        }
        let mut planned = Vec::with_capacity(request.segments.len());
        let mut total: u64 = 0;
        for (i, seg) in request.segments.iter().enumerate() {
            let local_len = shared.regions.local_len(seg.local).ok_or_else(|| {
                PluginError::new(
                    ReasonCode::UNKNOWN_KEY,
                    format!("segment {i}: local key {} is not registered", seg.local.0),
                )
            })?;
            if !in_bounds(seg.local_offset, seg.len, local_len) {
                return Err(PluginError::new(
                    ReasonCode::OUT_OF_RANGE,
                    format!(
                        "segment {i}: source {}+{} outside local region {} of {local_len} bytes",
                        seg.local_offset, seg.len, seg.local.0
                    ),
                ));
            }
            let remote = shared.regions.remote(seg.remote).ok_or_else(|| {
                PluginError::new(
                    ReasonCode::UNKNOWN_KEY,
                    format!("segment {i}: remote key {} is not imported", seg.remote.0),
                )
            })?;
            if remote.peer != request.peer || remote.info.instance != entry.info.instance {
                return Err(PluginError::new(
                    ReasonCode::UNKNOWN_KEY,
                    format!(
                        "segment {i}: remote key {} belongs to another peer or an earlier incarnation of it",
                        seg.remote.0
                    ),
                ));
            }
            if !in_bounds(seg.remote_offset, seg.len, remote.info.len) {
                return Err(PluginError::new(
                    ReasonCode::OUT_OF_RANGE,
                    format!(
                        "segment {i}: destination {}+{} outside remote region of {} bytes",
                        seg.remote_offset, seg.len, remote.info.len
                    ),
                ));
            }
            total = total
                .checked_add(seg.len)
                .ok_or_else(|| PluginError::new(ReasonCode::INVALID_ARGUMENT, "the segments' lengths overflow u64"))?;
            planned.push(PlannedSegment {
                local_key: seg.local.0,
                local_offset: seg.local_offset,
                remote_key: remote.info.key,
                remote_offset: seg.remote_offset,
                len: seg.len,
            });
        }
        Ok((planned, total))
    }
}

impl Plugin for QuicPlugin {
    fn info(&self) -> PluginInfo {
        plugin_info(&self.shared.config)
    }

    fn local_endpoint(&self) -> Vec<u8> {
        self.shared.endpoint_bytes.clone()
    }

    // CONFORMANCE: HANDSHAKE-2, HANDSHAKE-4 (malformed endpoints refused; a new endpoint is a new peer)
    fn connect(&self, peer: PeerId, endpoint: &[u8]) -> Result<(), PluginError> {
        self.refuse_if_shut_down()?;
        let info = EndpointInfo::decode(endpoint).map_err(|e| PluginError::new(ReasonCode::INVALID_ARGUMENT, e.0))?;
        if let Some(existing) = self.shared.peer(peer) {
            if existing.endpoint_bytes == endpoint {
                return Ok(());
            }
            self.disconnect(peer);
        }
        let entry = Arc::new(PeerEntry::new(&self.shared, peer, info.clone(), endpoint.to_vec())?);
        self.shared.known.insert(info.fingerprint, peer);
        self.shared.peers.lock().expect("peers lock").insert(peer, entry.clone());
        peers::start(&self.shared, &entry);
        Ok(())
    }

    // CONFORMANCE: TIME-3, HANDSHAKE-2 (the peer's transfers fail at once)
    fn disconnect(&self, peer: PeerId) {
        let entry = self.shared.peers.lock().expect("peers lock").remove(&peer);
        self.shared.known.remove_peer(peer);
        if let Some(entry) = entry {
            entry.close_all(ReasonCode::PEER_LOST, "disconnected by the host");
        }
        for t in self.shared.transfers.of_peer(peer) {
            t.fail(ReasonCode::PEER_LOST, format!("peer {} was disconnected by the host", peer.0));
        }
    }

    // CONFORMANCE: HANDSHAKE-3
    fn register(&self, region: &RegionDesc) -> Result<Registration, PluginError> {
        self.refuse_if_shut_down()?;
        let (key, remote) = self.shared.regions.register(region)?;
        Ok(Registration { key, remote_key: remote.encode().into() })
    }

    // CONFORMANCE: DATA-4 (a copy out of a deregistered region is refused, so its transfer fails)
    fn deregister(&self, key: LocalKey) -> Result<(), PluginError> {
        self.shared.regions.deregister(key)
    }

    fn import_remote_key(&self, peer: PeerId, bytes: &[u8]) -> Result<RemoteKey, PluginError> {
        self.refuse_if_shut_down()?;
        self.shared.regions.import(peer, bytes)
    }

    fn release_remote_key(&self, key: RemoteKey) {
        self.shared.regions.release_remote(key)
    }

    // CONFORMANCE: TIME-5 (submit hands work to the runtime and never waits on the network)
    fn submit(&self, request: &SubmitRequest<'_>) -> Result<(), PluginError> {
        let _alive = self.shared.lifecycle.read().expect("lifecycle lock");
        self.refuse_if_shut_down()?;
        let shared = &self.shared;
        let entry = shared.peer(request.peer).ok_or_else(|| {
            PluginError::new(
                ReasonCode::PEER_UNREACHABLE,
                format!("peer {} is not connected (connect it first)", request.peer.0),
            )
        })?;
        let (segments, total) = self.resolve_segments(request, &entry)?;
        let max_lanes = shared.config.connections_per_peer * shared.config.lanes_per_connection;
        let lanes = plan_lanes(&segments, total, max_lanes, shared.config.min_lane_bytes);
        let deadline = tokio::time::Instant::now() + self.timeout_of(request.timeout_ns);
        let t = shared.transfers.admit(
            request.xfer,
            request.peer,
            total,
            lanes.len(),
            shared.config.max_inflight_transfers,
        )?;
        match crate::peers::ready_now(&entry) {
            // Connections up: the parts go to their lanes now and the instance's deadline task keeps
            // the deadline (no task, timer or wake-up of the transfer's own).
            Some(links) => {
                crate::outgoing::dispatch(&t, &links, &entry, lanes, request.ticket.0, Some(&shared.handle));
                shared.deadlines.watch(&t, deadline, self.timeout_of(request.timeout_ns).as_millis());
            }
            None => {
                shared.handle.spawn(run_transfer(shared.clone(), t, entry, lanes, request.ticket.0, deadline));
            }
        }
        Ok(())
    }

    // CONFORMANCE: ABORT-1, ABORT-2, ABORT-3, ABORT-4 (no peer involved, one ledger step; unknown or finished ids ignored)
    fn cancel(&self, xfer: XferId) {
        if let Some(t) = self.shared.transfers.get(xfer) {
            t.fail(ReasonCode::CANCELLED, "cancelled by the host");
        }
    }

    fn expect_incoming(&self, request: &IncomingRequest<'_>) -> Result<(), PluginError> {
        self.refuse_if_shut_down()?;
        let shared = &self.shared;
        let timeout = self.timeout_of(request.timeout_ns);
        let deadline = std::time::Instant::now() + timeout;
        let grant = shared.tickets.expect(
            request.peer,
            request.ticket,
            deadline,
            request.ranges.as_slice(),
            &shared.regions,
            shared.config.max_live_tickets,
        )?;
        let (weak, peer, ticket) = (Arc::downgrade(&self.shared), request.peer, request.ticket);
        shared.handle.spawn(async move {
            tokio::time::sleep(timeout).await;
            if let Some(shared) = weak.upgrade() {
                if shared.tickets.expire(peer, ticket, &grant) {
                    tracing::debug!(peer = peer.0, ticket = ticket.0, "quic: incoming ticket expired");
                }
            }
        });
        Ok(())
    }

    fn cancel_incoming(&self, peer: PeerId, ticket: Ticket) {
        // Returns once no write under the ticket is in progress; none can start afterwards.
        self.shared.tickets.revoke(peer, ticket);
        self.shared.sink.deliver(Event::incoming_quiesced(peer, ticket));
    }

    // CONFORMANCE: RES-2, OBS-2 (live, unquiesced and ticket counts straight from the tables)
    fn stats(&self) -> Stats {
        let shared = &self.shared;
        let (live, unquiesced) = shared.transfers.counts();
        let (regions, bytes, remote_keys) = shared.regions.counts();
        let running = !shared.is_shut_down();
        let workers =
            self.runtime.lock().expect("runtime lock").as_ref().map(|r| r.metrics().num_workers() as u64).unwrap_or(0);
        Stats {
            live_transfers: live,
            unquiesced_transfers: unquiesced,
            live_tickets: shared.tickets.count(),
            registered_regions: regions,
            registered_bytes: bytes,
            imported_remote_keys: remote_keys,
            connected_peers: shared.peers.lock().expect("peers lock").len() as u64,
            workers_alive: workers,
            healthy: running as u8,
        }
    }

    fn shutdown(&self) {
        let shared = &self.shared;
        {
            let _exclusive = shared.lifecycle.write().expect("lifecycle lock");
            if shared.shut_down.swap(true, Ordering::AcqRel) {
                return;
            }
        }
        let entries: Vec<Arc<PeerEntry>> = shared.peers.lock().expect("peers lock").drain().map(|(_, e)| e).collect();
        for entry in entries {
            shared.known.remove_peer(entry.id);
            entry.close_all(ReasonCode::SHUTDOWN, "the peer's quic plugin shut down");
        }
        for endpoint in &shared.endpoints {
            endpoint.close(net::app_code(ReasonCode::SHUTDOWN), b"the peer's quic plugin shut down");
        }
        shared.transfers.close_all_for_shutdown();
        shared.tickets.revoke_all();
        shared.regions.clear();
        if let Some(runtime) = self.runtime.lock().expect("runtime lock").take() {
            // Joined from a plain thread: dropping a runtime inside another runtime's context panics.
            let joiner = std::thread::Builder::new()
                .name("kvgate-quic-shutdown".into())
                .spawn(move || runtime.shutdown_timeout(Duration::from_millis(SHUTDOWN_JOIN_TIMEOUT_MS)));
            if let Ok(joiner) = joiner {
                let _ = joiner.join();
            }
        }
    }
}

impl Drop for QuicPlugin {
    fn drop(&mut self) {
        self.shutdown();
    }
}
