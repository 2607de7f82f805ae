//! The NVLink plugin instance: `open`, and every `Plugin` call, on top of the shared tables, the
//! pure checks and the CUDA layer. Owns the API contract (refusals with reason codes, logged every
//! time); never blocks on a copy and never delivers transfer events itself (the worker does).

use crate::admission::{check_region, route_import, route_vmm_import, ImportRoute, RegionSource};
use crate::chunk_plan::plan_copies;
use crate::config::NvlinkConfig;
use crate::cuda::{self, CudaBackend, CudaDevice, IpcMapping};
use crate::engine::{Engine, NewTransfer};
use crate::fd_socket::{self, FdServer};
use crate::segments::{range_fits, resolve_segments, LocalView, RemoteView, SubmitLimits};
use crate::state::{Control, ImportedKey, LiveTransfer, LocalRegion, State};
use crate::vmm::{VmmError, VmmMapping};
use crate::wire::{read_boot_id, AnyRemoteKey, EndpointWire, RemoteKeyWire, VmmKeyWire};
use crate::worker::{self, Shared};
use kvgate_abi::sdk::{spawn_worker, Sink};
use kvgate_abi::*;
use std::any::Any;
use std::collections::HashSet;
use std::os::fd::{AsFd, BorrowedFd};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The plugin's name in `PluginInfo` and in `builtin:nvlink`.
pub const PLUGIN_NAME: &str = "nvlink";

/// Capabilities of an instance with `config`.
pub fn capabilities(config: &NvlinkConfig) -> Capabilities {
    Capabilities {
        memory_kinds: MemoryKind::CUDA_DEVICE.bit(),
        scope: scope::SAME_HOST,
        flags: 0,
        max_segments_per_submit: config.max_segments_per_submit,
        max_inflight_transfers: config.max_inflight_transfers,
        max_transfer_bytes: config.max_transfer_bytes,
    }
}

// CONFORMANCE: HYGIENE-4 (module and instance report the same name and ABI version)
pub fn plugin_info(config: &NvlinkConfig) -> PluginInfo {
    PluginInfo {
        name: PLUGIN_NAME.into(),
        version: env!("CARGO_PKG_VERSION").into(),
        abi_version: ABI_VERSION,
        capabilities: capabilities(config),
    }
}

/// A random-enough 64-bit nonce (std's per-process random hash keys, the clock and the pid).
fn fresh_nonce() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.write_u32(std::process::id());
    h.write_u64(COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    h.finish() | 1
}

fn logged(e: PluginError) -> PluginError {
    tracing::warn!(reason = %e.code, "{}", e.message);
    e
}

/// One open instance.
pub struct NvlinkPlugin {
    shared: Arc<Shared>,
    devices: Vec<CudaDevice>,
    endpoint: EndpointWire,
    worker: Mutex<Option<JoinHandle<()>>>,
    /// The descriptor socket of this instance's CUDA VMM regions, started by the first one.
    fd_server: Mutex<Option<Arc<FdServer>>>,
}

/// Opens an instance: parse `config` (errors name the key), then check for the CUDA driver with
/// `driver_present` before any other CUDA call (no driver: `UNAVAILABLE` with the reason), then
/// open the devices and start the worker.
// CONFORMANCE: HYGIENE-3, TIME-10 (no driver: UNAVAILABLE; a dead worker is reported through spawn_worker)
pub fn open_with_probe(
    config: &str,
    sink: Sink,
    driver_present: impl FnOnce() -> bool,
) -> Result<NvlinkPlugin, PluginError> {
    let config = NvlinkConfig::parse(config).map_err(logged)?;
    if !driver_present() {
        return Err(logged(PluginError::new(ReasonCode::UNAVAILABLE, cuda::NO_DRIVER_REASON)));
    }
    let devices =
        match catch_unwind(AssertUnwindSafe(|| cuda::open_devices(&config.devices))) {
            Ok(Ok(devices)) => devices,
            Ok(Err(why)) => return Err(logged(PluginError::new(ReasonCode::UNAVAILABLE, format!("nvlink: {why}")))),
            Err(_) => return Err(logged(PluginError::new(
                ReasonCode::UNAVAILABLE,
                "nvlink: the CUDA driver library failed while opening the devices (missing symbol or broken install)",
            ))),
        };
    let endpoint = EndpointWire { instance_nonce: fresh_nonce(), pid: std::process::id(), boot_id: read_boot_id() };
    let backend = CudaBackend::new(devices.iter().map(|d| d.ctx.clone()).collect(), config.streams_per_peer);
    let engine = Engine::new(backend, config.max_copies_in_flight_per_transfer, config.streams_per_peer);
    let shared = Arc::new(Shared {
        state: Mutex::new(State { worker_alive: true, next_local_key: 1, next_remote_key: 1, ..State::default() }),
        wake: Condvar::new(),
        sink: sink.clone(),
        config,
    });
    let worker_shared = shared.clone();
    let handle = spawn_worker("kvgate-nvlink", sink, move || run_worker(worker_shared, engine))
        .map_err(|e| logged(PluginError::new(ReasonCode::RESOURCE_EXHAUSTED, format!("nvlink: spawn worker: {e}"))))?;
    tracing::info!(devices = ?devices.iter().map(|d| d.ordinal).collect::<Vec<_>>(), "nvlink: opened");
    Ok(NvlinkPlugin { shared, devices, endpoint, worker: Mutex::new(Some(handle)), fd_server: Mutex::new(None) })
}

/// The worker, with its death made visible: a panic fails every live transfer (not quiesced: copies
/// may still be on the GPU) and marks the instance unhealthy; the SDK then reports `UNHEALTHY`.
fn run_worker(shared: Arc<Shared>, engine: Engine<CudaBackend>) {
    let outcome = catch_unwind(AssertUnwindSafe(|| worker::run(&shared, engine)));
    let mut st = shared.lock();
    st.worker_alive = false;
    if let Err(payload) = outcome {
        st.unhealthy_reason = Some("nvlink worker panicked".into());
        let live: Vec<XferId> = st.live.keys().copied().collect();
        st.live.clear();
        st.pending.clear();
        drop(st);
        for xfer in live {
            shared.sink.failed(xfer, ReasonCode::INTERNAL, "nvlink: worker died; copies may still land");
        }
        std::panic::resume_unwind(payload);
    }
}

impl NvlinkPlugin {
    fn config(&self) -> &NvlinkConfig {
        &self.shared.config
    }

    fn usable(st: &State) -> Result<(), PluginError> {
        if st.shutting_down || st.shut_down {
            return Err(PluginError::new(ReasonCode::SHUTDOWN, "nvlink: plugin shut down"));
        }
        if let Some(why) = &st.unhealthy_reason {
            return Err(PluginError::new(ReasonCode::INTERNAL, format!("nvlink: unhealthy: {why}")));
        }
        Ok(())
    }

    fn device_ordinals(&self) -> Vec<u32> {
        self.devices.iter().map(|d| d.ordinal).collect()
    }

    /// The mapping of `handle` in device `device_index`'s context (shared process-wide).
    fn mapping(&self, handle: &[u8; 64], device_index: usize) -> Result<Arc<IpcMapping>, PluginError> {
        IpcMapping::shared(&self.devices[device_index].ctx, handle)
            .map_err(|e| PluginError::new(ReasonCode::TRANSPORT_ERROR, format!("nvlink: {e}")))
    }

    // CONFORMANCE: HANDSHAKE-3 (only CUDA device memory with a usable handle is taken)
    fn register_inner(&self, region: &RegionDesc) -> Result<Registration, PluginError> {
        let mut st = self.shared.lock();
        Self::usable(&st)?;
        let plan = check_region(
            region,
            &self.device_ordinals(),
            st.regions.len() as u64,
            self.config().max_registered_regions,
        )?;
        let device = &self.devices[plan.device_index];
        let err = |code: ReasonCode, m: String| PluginError::new(code, format!("nvlink register: {m}"));
        if let RegionSource::VmmDescriptor { fd, allocation_size } = plan.source {
            return self.register_vmm(st, region, plan.device_index, fd, allocation_size);
        }
        let (addr, offset_in_allocation, handle, mapping) = match plan.source {
            RegionSource::LocalPointer => {
                let info = cuda::inspect_device_pointer(&device.ctx, region.addr)
                    .map_err(|e| err(ReasonCode::UNSUPPORTED_MEMORY, e))?;
                if info.device_ordinal != device.ordinal {
                    return Err(err(
                        ReasonCode::INVALID_ARGUMENT,
                        format!(
                            "address is on device {}, the region says device {}",
                            info.device_ordinal, device.ordinal
                        ),
                    ));
                }
                let offset = region.addr - info.allocation_base;
                if !range_fits(offset, region.len, info.allocation_len) {
                    return Err(err(
                        ReasonCode::OUT_OF_RANGE,
                        format!(
                            "{} bytes at offset {offset} exceed the allocation ({} bytes)",
                            region.len, info.allocation_len
                        ),
                    ));
                }
                let handle = match region.ipc_handle.len() {
                    0 => cuda::export_ipc_handle(&device.ctx, info.allocation_base)
                        .map_err(|e| err(ReasonCode::UNSUPPORTED_MEMORY, e))?,
                    _ => region.ipc_handle.as_slice().try_into().expect("length checked"),
                };
                (region.addr, offset, handle, None)
            }
            RegionSource::EngineHandle => {
                let handle: [u8; 64] = region.ipc_handle.as_slice().try_into().expect("length checked");
                let mapping = self.mapping(&handle, plan.device_index)?;
                if !mapping.fits(region.backing_offset, region.len) {
                    return Err(err(
                        ReasonCode::OUT_OF_RANGE,
                        format!(
                            "backing_offset {} + {} exceeds the allocation ({:?} bytes)",
                            region.backing_offset, region.len, mapping.len
                        ),
                    ));
                }
                (mapping.base + region.backing_offset, region.backing_offset, handle, Some(mapping))
            }
            RegionSource::VmmDescriptor { .. } => unreachable!("handled above"),
        };
        let key = LocalKey(st.next_local_key);
        st.next_local_key += 1;
        let wire = RemoteKeyWire {
            instance_nonce: self.endpoint.instance_nonce,
            region_id: key.0,
            device: device.ordinal as i32,
            device_uuid: device.uuid,
            holder_pid: self.endpoint.pid,
            holder_addr: addr,
            offset_in_allocation,
            len: region.len,
            ipc_handle: handle,
        };
        st.regions.insert(
            key,
            Arc::new(LocalRegion {
                device_index: plan.device_index,
                addr,
                len: region.len,
                _mapping: mapping,
                _vmm: None,
            }),
        );
        st.registered_bytes += region.len;
        Ok(Registration { key, remote_key: wire.encode().into() })
    }

    /// The peer's endpoint, if the instance is usable, the peer connected and the import limit not reached.
    fn import_admission(&self, st: &State, peer: PeerId) -> Result<EndpointWire, PluginError> {
        Self::usable(st)?;
        let peer_endpoint = st.peers.get(&peer).cloned().ok_or_else(|| {
            PluginError::new(
                ReasonCode::PEER_UNREACHABLE,
                format!("nvlink import_remote_key: peer {} is not connected", peer.0),
            )
        })?;
        if st.imported.len() as u64 >= self.config().max_imported_remote_keys {
            return Err(PluginError::new(
                ReasonCode::RESOURCE_EXHAUSTED,
                format!(
                    "nvlink import_remote_key: max_imported_remote_keys {} reached",
                    self.config().max_imported_remote_keys
                ),
            ));
        }
        Ok(peer_endpoint)
    }

    fn import_inner(&self, peer: PeerId, bytes: &[u8]) -> Result<RemoteKey, PluginError> {
        let mut st = self.shared.lock();
        let peer_endpoint = self.import_admission(&st, peer)?;
        let key = match AnyRemoteKey::decode(bytes)? {
            AnyRemoteKey::Ipc(key) => key,
            AnyRemoteKey::Vmm(key) => {
                drop(st);
                return self.import_vmm(peer, &peer_endpoint, &key);
            }
        };
        let uuids: Vec<[u8; 16]> = self.devices.iter().map(|d| d.uuid).collect();
        let imported = match route_import(&key, &peer_endpoint, &self.endpoint, &uuids)? {
            ImportRoute::SameProcess => {
                let ctx = &self.devices[uuids.iter().position(|u| *u == key.device_uuid).unwrap_or(0)].ctx;
                let info = cuda::inspect_device_pointer(ctx, key.holder_addr).map_err(|e| {
                    PluginError::new(ReasonCode::INVALID_ARGUMENT, format!("nvlink import_remote_key: {e}"))
                })?;
                let offset = key.holder_addr - info.allocation_base;
                if !range_fits(offset, key.len, info.allocation_len) {
                    return Err(PluginError::new(
                        ReasonCode::OUT_OF_RANGE,
                        "nvlink import_remote_key: key exceeds its allocation",
                    ));
                }
                ImportedKey { peer, addr: key.holder_addr, len: key.len, _mapping: None, _vmm: None }
            }
            ImportRoute::OpenHandle { device_index } => {
                let mapping = self.mapping(&key.ipc_handle, device_index)?;
                if !mapping.fits(key.offset_in_allocation, key.len) {
                    return Err(PluginError::new(
                        ReasonCode::OUT_OF_RANGE,
                        format!(
                            "nvlink import_remote_key: offset {} + {} exceeds the mapped allocation ({:?} bytes)",
                            key.offset_in_allocation, key.len, mapping.len
                        ),
                    ));
                }
                ImportedKey {
                    peer,
                    addr: mapping.base + key.offset_in_allocation,
                    len: key.len,
                    _mapping: Some(mapping),
                    _vmm: None,
                }
            }
        };
        let id = RemoteKey(st.next_remote_key);
        st.next_remote_key += 1;
        st.imported.insert(id, Arc::new(imported));
        Ok(id)
    }

    /// The instance's descriptor socket, started on first use.
    fn fd_server(&self) -> Result<Arc<FdServer>, PluginError> {
        let mut slot = self.fd_server.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(server) = slot.as_ref() {
            return Ok(server.clone());
        }
        let timeout = Duration::from_millis(self.config().vmm_fd_request_timeout_ms);
        let server = fd_socket::fresh_socket_name().and_then(|name| FdServer::start(name, timeout)).map_err(|e| {
            PluginError::new(
                ReasonCode::RESOURCE_EXHAUSTED,
                format!("nvlink register: start the descriptor socket: {e}"),
            )
        })?;
        let server = Arc::new(server);
        *slot = Some(server.clone());
        Ok(server)
    }

    /// `register` of a CUDA VMM descriptor the host holds: import a duplicate and map it here, serve
    /// another duplicate to peers on the descriptor socket, and hand out a VMM key.
    fn register_vmm(
        &self,
        mut st: std::sync::MutexGuard<'_, State>,
        region: &RegionDesc,
        device_index: usize,
        fd: i32,
        allocation_size: u64,
    ) -> Result<Registration, PluginError> {
        let err = |code: ReasonCode, m: String| PluginError::new(code, format!("nvlink register: {m}"));
        // SAFETY: `fd` >= 0 (checked when parsed); the host keeps it open while it registers the
        // region and until it deregisters it (the `cuda_vmm` convention). Only borrowed to duplicate.
        let host_fd = unsafe { BorrowedFd::borrow_raw(fd) };
        let served = host_fd
            .try_clone_to_owned()
            .map_err(|e| err(ReasonCode::INVALID_ARGUMENT, format!("descriptor {fd} of the CUDA VMM region: {e}")))?;
        let device = &self.devices[device_index];
        let mapping = VmmMapping::import(&device.ctx, served.as_fd(), allocation_size).map_err(|e| match e {
            VmmError::Invalid(m) => err(ReasonCode::INVALID_ARGUMENT, m),
            VmmError::Driver(m) => err(ReasonCode::UNSUPPORTED_MEMORY, m),
        })?;
        let server = self.fd_server()?;
        let secret = fd_socket::random_bytes()
            .map_err(|e| err(ReasonCode::INTERNAL, format!("no random secret for the region (/dev/urandom: {e})")))?;
        let key = LocalKey(st.next_local_key);
        st.next_local_key += 1;
        let wire = VmmKeyWire {
            instance_nonce: self.endpoint.instance_nonce,
            region_id: key.0,
            device: device.ordinal as i32,
            device_uuid: device.uuid,
            holder_pid: self.endpoint.pid,
            socket_name: server.name().to_string(),
            secret,
            offset_in_allocation: region.backing_offset,
            len: region.len,
            allocation_size,
        };
        server.serve(key.0, secret, served);
        let addr = mapping.base + region.backing_offset;
        st.regions.insert(
            key,
            Arc::new(LocalRegion {
                device_index,
                addr,
                len: region.len,
                _mapping: None,
                _vmm: Some(Arc::new(mapping)),
            }),
        );
        st.registered_bytes += region.len;
        Ok(Registration { key, remote_key: wire.encode().into() })
    }

    /// `import_remote_key` of a CUDA VMM key: fetch the descriptor from the holder's socket (without
    /// the state lock: bounded by `vmm_fd_request_timeout_ms`), map it, then record the key if the
    /// instance and the peer are still there.
    fn import_vmm(
        &self,
        peer: PeerId,
        peer_endpoint: &EndpointWire,
        key: &VmmKeyWire,
    ) -> Result<RemoteKey, PluginError> {
        let uuids: Vec<[u8; 16]> = self.devices.iter().map(|d| d.uuid).collect();
        let device_index = route_vmm_import(key, peer_endpoint, &uuids)?;
        let timeout = Duration::from_millis(self.config().vmm_fd_request_timeout_ms);
        let fd = fd_socket::request_fd(&key.socket_name, key.region_id, &key.secret, timeout)
            .map_err(|e| PluginError::new(e.code, format!("nvlink import_remote_key: {}", e.message)))?;
        let mapping =
            VmmMapping::import(&self.devices[device_index].ctx, fd.as_fd(), key.allocation_size).map_err(|e| {
                let code = match e {
                    VmmError::Invalid(_) => ReasonCode::INVALID_ARGUMENT,
                    VmmError::Driver(_) => ReasonCode::TRANSPORT_ERROR,
                };
                PluginError::new(
                    code,
                    format!("nvlink import_remote_key: region {} of peer {}: {e}", key.region_id, peer.0),
                )
            })?;
        drop(fd);
        let mut st = self.shared.lock();
        // Checked again: the peer may have gone, or the limit been reached, while the lock was free.
        self.import_admission(&st, peer)?;
        if st.peers.get(&peer).is_none_or(|e| e.instance_nonce != key.instance_nonce) {
            return Err(PluginError::new(
                ReasonCode::PEER_LOST,
                format!("nvlink import_remote_key: peer {} reconnected as another instance meanwhile", peer.0),
            ));
        }
        let imported = ImportedKey {
            peer,
            addr: mapping.base + key.offset_in_allocation,
            len: key.len,
            _mapping: None,
            _vmm: Some(Arc::new(mapping)),
        };
        let id = RemoteKey(st.next_remote_key);
        st.next_remote_key += 1;
        st.imported.insert(id, Arc::new(imported));
        Ok(id)
    }

    // CONFORMANCE: DATA-3, TIME-5, TIME-11 (every check before anything is queued; never waits; bounded)
    fn submit_inner(&self, request: &SubmitRequest<'_>) -> Result<(), PluginError> {
        let submitted_at = Instant::now();
        let mut st = self.shared.lock();
        Self::usable(&st)?;
        let refuse = |code: ReasonCode, m: String| PluginError::new(code, format!("nvlink submit: {m}"));
        if !st.peers.contains_key(&request.peer) {
            return Err(refuse(ReasonCode::PEER_UNREACHABLE, format!("peer {} is not connected", request.peer.0)));
        }
        if st.live.contains_key(&request.xfer) {
            return Err(refuse(ReasonCode::DUPLICATE_ID, format!("transfer {} is already live", request.xfer.0)));
        }
        if st.live.len() as u64 >= self.config().max_inflight_transfers {
            return Err(refuse(
                ReasonCode::RESOURCE_EXHAUSTED,
                format!("max_inflight_transfers {} reached", self.config().max_inflight_transfers),
            ));
        }
        let limits = SubmitLimits {
            max_segments_per_submit: self.config().max_segments_per_submit,
            max_transfer_bytes: self.config().max_transfer_bytes,
        };
        let segments = request.segments.as_slice();
        let resolved = resolve_segments(
            segments,
            request.peer,
            limits,
            |k| st.regions.get(&k).map(|r| LocalView { addr: r.addr, len: r.len, device_index: r.device_index }),
            |k| st.imported.get(&k).map(|r| RemoteView { peer: r.peer, addr: r.addr, len: r.len }),
        )?;
        let ops = plan_copies(&resolved, self.config().chunk_bytes);
        let locals: Vec<LocalKey> = segments.iter().map(|s| s.local).collect::<HashSet<_>>().into_iter().collect();
        let remotes: Vec<RemoteKey> = segments.iter().map(|s| s.remote).collect::<HashSet<_>>().into_iter().collect();
        let mut holds: Vec<Box<dyn Any + Send>> = Vec::with_capacity(locals.len() + remotes.len());
        holds.extend(locals.iter().map(|k| Box::new(st.regions[k].clone()) as Box<dyn Any + Send>));
        holds.extend(remotes.iter().map(|k| Box::new(st.imported[k].clone()) as Box<dyn Any + Send>));
        st.live.insert(request.xfer, LiveTransfer { locals, remotes });
        st.pending.push(NewTransfer {
            xfer: request.xfer,
            peer: request.peer,
            deadline: submitted_at.checked_add(Duration::from_nanos(request.timeout_ns)),
            ops,
            total_bytes: request.total_bytes(),
            holds: Box::new(holds),
        });
        drop(st);
        self.shared.wake.notify_one();
        Ok(())
    }

    fn control(&self, control: Control) {
        self.shared.lock().controls.push(control);
        self.shared.wake.notify_one();
    }
}

impl kvgate_abi::sdk::Plugin for NvlinkPlugin {
    fn info(&self) -> PluginInfo {
        plugin_info(self.config())
    }

    fn local_endpoint(&self) -> Vec<u8> {
        self.endpoint.encode()
    }

    // CONFORMANCE: HANDSHAKE-2, HANDSHAKE-4 (malformed endpoints refused; a new incarnation drops the old)
    fn connect(&self, peer: PeerId, endpoint: &[u8]) -> Result<(), PluginError> {
        let result = (|| {
            let mut st = self.shared.lock();
            Self::usable(&st)?;
            let remote = EndpointWire::decode(endpoint)?;
            if !remote.same_host_as(&self.endpoint) {
                return Err(PluginError::new(
                    ReasonCode::PEER_UNREACHABLE,
                    format!("nvlink connect: peer {} runs on another host (CUDA IPC is same-host only)", peer.0),
                ));
            }
            if !st.peers.contains_key(&peer) && st.peers.len() as u64 >= self.config().max_peers {
                return Err(PluginError::new(
                    ReasonCode::RESOURCE_EXHAUSTED,
                    format!("nvlink connect: max_peers {} reached", self.config().max_peers),
                ));
            }
            st.peers.insert(peer, remote);
            Ok(())
        })();
        result.map_err(logged)
    }

    fn disconnect(&self, peer: PeerId) {
        let mut st = self.shared.lock();
        if st.peers.remove(&peer).is_none() {
            return;
        }
        st.imported.retain(|_, k| k.peer != peer);
        st.controls.push(Control::FailPeer {
            peer,
            reason: ReasonCode::PEER_LOST,
            message: format!("nvlink: peer {} disconnected", peer.0),
        });
        st.controls.push(Control::ForgetPeerStreams { peer });
        drop(st);
        self.shared.wake.notify_one();
    }

    fn register(&self, region: &RegionDesc) -> Result<Registration, PluginError> {
        self.register_inner(region).map_err(logged)
    }

    // CONFORMANCE: DATA-4 (transfers using the region fail)
    fn deregister(&self, key: LocalKey) -> Result<(), PluginError> {
        let mut st = self.shared.lock();
        let Some(region) = st.regions.remove(&key) else {
            return Err(logged(PluginError::new(
                ReasonCode::UNKNOWN_KEY,
                format!("nvlink deregister: local key {} is not registered", key.0),
            )));
        };
        st.registered_bytes -= region.len;
        st.fail_users(Some(key), None, ReasonCode::UNKNOWN_KEY, "nvlink: a source region was deregistered");
        drop(st);
        if region._vmm.is_some() {
            // No peer gets its descriptor from now on (peers that imported it keep their mappings).
            if let Some(server) = self.fd_server.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
                server.withdraw(key.0);
            }
        }
        self.shared.wake.notify_one();
        Ok(())
    }

    fn import_remote_key(&self, peer: PeerId, bytes: &[u8]) -> Result<RemoteKey, PluginError> {
        self.import_inner(peer, bytes).map_err(logged)
    }

    fn release_remote_key(&self, key: RemoteKey) {
        let mut st = self.shared.lock();
        if st.imported.remove(&key).is_some() {
            st.fail_users(None, Some(key), ReasonCode::UNKNOWN_KEY, "nvlink: a destination key was released");
            drop(st);
            self.shared.wake.notify_one();
        }
    }

    fn submit(&self, request: &SubmitRequest<'_>) -> Result<(), PluginError> {
        self.submit_inner(request).map_err(logged)
    }

    fn cancel(&self, xfer: XferId) {
        if self.shared.lock().live.contains_key(&xfer) {
            self.control(Control::Fail {
                xfer,
                reason: ReasonCode::CANCELLED,
                message: "nvlink: cancelled by the host".into(),
            });
        }
    }

    // CONFORMANCE: OBS-2, RES-2 (counts published by the worker from the engine's ledger)
    fn stats(&self) -> Stats {
        let st = self.shared.lock();
        Stats {
            live_transfers: st.counts.live + st.pending.len() as u64,
            unquiesced_transfers: st.counts.unquiesced,
            live_tickets: 0,
            registered_regions: st.regions.len() as u64,
            registered_bytes: st.registered_bytes,
            imported_remote_keys: st.imported.len() as u64,
            connected_peers: st.peers.len() as u64,
            workers_alive: st.worker_alive as u64,
            healthy: (st.worker_alive && st.unhealthy_reason.is_none() && !st.shut_down) as u8,
        }
    }

    // CONFORMANCE: RES-5
    fn shutdown(&self) {
        {
            let mut st = self.shared.lock();
            if st.shut_down {
                return;
            }
            st.shutting_down = true;
        }
        self.shared.wake.notify_all();
        let handle = self.worker.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(handle) = handle {
            if handle.thread().id() == std::thread::current().id() {
                // Called from an event the worker delivers: it exits after this delivery round.
                tracing::warn!("nvlink: shutdown called from the worker thread; not waiting for it");
            } else {
                let _ = handle.join(); // a worker panic was already reported as UNHEALTHY
            }
        }
        if let Some(server) = self.fd_server.lock().unwrap_or_else(|p| p.into_inner()).take() {
            server.stop();
        }
        let mut st = self.shared.lock();
        st.regions.clear();
        st.registered_bytes = 0;
        st.imported.clear();
        st.peers.clear();
        st.shut_down = true;
        tracing::info!("nvlink: shut down");
    }
}

impl Drop for NvlinkPlugin {
    fn drop(&mut self) {
        kvgate_abi::sdk::Plugin::shutdown(self);
    }
}
