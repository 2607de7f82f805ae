//! Local memory regions: mapping an engine's shared-memory file, registering it with every opened
//! plugin that serves its kind, telling the core, and announcing its remote keys to peers. Never
//! copies or reads the bytes; the mapping only gives plugins an address.

use super::Driver;
use crate::channels::{ApiError, MemorySpec, Registered};
use kvgate_abi::{
    abi_stable::std_types::{RResult, RString, RVec},
    LocalKey, MemoryKind, RegionDesc,
};
use kvgate_client::proto::{self, peer_frame::Frame};
use kvgate_core::{PluginSlot, RegionId, RegionInfo};
use std::collections::BTreeMap;
use tonic::Code;

pub struct LocalRegion {
    pub label: String,
    pub keys: Vec<(PluginSlot, LocalKey)>,
    pub announce: proto::RegionAnnounce,
    /// What plugins were given at registration (a plugin reload registers it with new instances).
    pub desc: RegionDesc,
    _mapping: Option<memmap2::MmapMut>,
    /// A passed descriptor behind the region, kept open as long as it is registered.
    _file: Option<std::fs::File>,
}

pub struct Regions {
    by_id: BTreeMap<u64, LocalRegion>,
    next_id: u64,
    max_regions: u64,
    /// Regions released while a plugin refused to let go of them (its `deregister` failed: it may
    /// still read or write the memory): kept mapped until the plugins are shut down, never unmapped
    /// under a plugin.
    quarantined: Vec<LocalRegion>,
}

impl Regions {
    pub fn new(max_regions: u64) -> Regions {
        Regions { by_id: BTreeMap::new(), next_id: 1, max_regions, quarantined: Vec::new() }
    }
    pub fn announcements(&self) -> impl Iterator<Item = &proto::RegionAnnounce> {
        self.by_id.values().map(|r| &r.announce)
    }
    pub fn len(&self) -> usize {
        self.by_id.len()
    }
    pub fn ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.by_id.keys().copied()
    }
    /// Drops every registration and its mapping without asking the plugins (they are shut down).
    pub fn forget_all(&mut self) {
        self.by_id.clear();
        self.quarantined.clear();
    }
}

fn map_shared_file(path: &str, offset: u64, len: u64) -> Result<memmap2::MmapMut, ApiError> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| ApiError::invalid("memory_unavailable", format!("cannot open {path}: {e}")))?;
    map_file(&file, path, offset, len)
}

#[allow(unsafe_code)] // mapping an engine's memory file
fn map_file(file: &std::fs::File, path: &str, offset: u64, len: u64) -> Result<memmap2::MmapMut, ApiError> {
    let file_len = file.metadata().map_err(|e| ApiError::invalid("memory_unavailable", format!("{path}: {e}")))?.len();
    if offset.checked_add(len).is_none_or(|end| end > file_len) {
        return Err(ApiError::invalid(
            "slice_out_of_range",
            format!("offset {offset} + len {len} lies past the end of {path} ({file_len} bytes)"),
        ));
    }
    // SAFETY: the mapping is shared with the engine that owns the file; the gateway never reads or
    // writes through it (plugins write into peers' mappings as the engines agreed by expect/send).
    unsafe { memmap2::MmapOptions::new().offset(offset).len(len as usize).map_mut(file) }
        .map_err(|e| ApiError::invalid("memory_unavailable", format!("cannot map {path}: {e}")))
}

/// The plugins' view of host memory mapped here from `path` (which a same-host peer can open too).
fn host_region(mapping: &mut memmap2::MmapMut, path: String, offset: u64, len: u64) -> RegionDesc {
    RegionDesc {
        kind: MemoryKind::HOST,
        device: -1,
        addr: mapping.as_mut_ptr() as u64,
        len,
        backing_path: RString::from(path),
        backing_offset: offset,
        ipc_handle: RVec::new(),
    }
}

impl Driver {
    pub(super) fn register_region(&mut self, memory: MemorySpec, label: String) -> Result<Registered, ApiError> {
        let max_text = self.config.engine_api.max_text_bytes as usize;
        if label.len() > max_text {
            return Err(ApiError::invalid(
                "text_too_long",
                format!("a label of {} bytes; engine_api.max_text_bytes = {max_text}", label.len()),
            ));
        }
        if let MemorySpec::SharedFile { path, .. } = &memory {
            if path.len() > super::engine::MAX_PATH_BYTES {
                let shown = super::engine::clip(path, 64);
                return Err(ApiError::invalid(
                    "text_too_long",
                    format!("a path of {} bytes ({shown}); at most {}", path.len(), super::engine::MAX_PATH_BYTES),
                ));
            }
        }
        if self.regions.len() as u64 >= self.regions.max_regions {
            return Err(ApiError::new(
                Code::ResourceExhausted,
                "too_many_regions",
                format!("engine_api.max_regions = {} regions are registered already", self.regions.max_regions),
            ));
        }
        let mut passed = None;
        let (desc, mapping) = match memory {
            MemorySpec::SharedFile { path, offset, len } => {
                if len == 0 {
                    return Err(ApiError::invalid("empty_region", "a region needs len > 0"));
                }
                let mut mapping = map_shared_file(&path, offset, len)?;
                (host_region(&mut mapping, path, offset, len), Some(mapping))
            }
            MemorySpec::PassedFd { file, offset, len } => {
                if len == 0 {
                    return Err(ApiError::invalid("empty_region", "a region needs len > 0"));
                }
                use std::os::fd::AsRawFd;
                // The path a same-host peer (and a plugin) opens: this process's descriptor.
                let path = format!("/proc/{}/fd/{}", std::process::id(), file.as_raw_fd());
                let mut mapping = map_file(&file, &path, offset, len)?;
                passed = Some(file);
                (host_region(&mut mapping, path, offset, len), Some(mapping))
            }
            MemorySpec::CudaIpc { device, handle, offset, len } => {
                if len == 0 || handle.is_empty() {
                    return Err(ApiError::invalid("empty_region", "a CUDA region needs len > 0 and an IPC handle"));
                }
                let desc = RegionDesc {
                    kind: MemoryKind::CUDA_DEVICE,
                    device,
                    addr: 0,
                    len,
                    backing_path: RString::new(),
                    backing_offset: offset,
                    ipc_handle: RVec::from(handle),
                };
                (desc, None)
            }
            MemorySpec::CudaVmmFd { file, device, offset, len, allocation_size } => {
                if len == 0 || allocation_size == 0 {
                    return Err(ApiError::invalid(
                        "empty_region",
                        "a CUDA VMM region needs len > 0 and allocation_size > 0",
                    ));
                }
                if device < 0 {
                    return Err(ApiError::invalid(
                        "invalid_device",
                        format!("CUDA device ordinal {device} is negative"),
                    ));
                }
                if offset.checked_add(len).is_none_or(|end| end > allocation_size) {
                    return Err(ApiError::invalid(
                        "slice_out_of_range",
                        format!("offset {offset} + len {len} lies past the end of the CUDA VMM allocation ({allocation_size} bytes)"),
                    ));
                }
                use std::os::fd::AsRawFd;
                let backing = kvgate_abi::cuda_vmm::CudaVmmBacking { fd: file.as_raw_fd(), allocation_size };
                let desc = RegionDesc {
                    kind: MemoryKind::CUDA_DEVICE,
                    device,
                    addr: 0,
                    len,
                    backing_path: RString::from(backing.to_backing_path()),
                    backing_offset: offset,
                    ipc_handle: RVec::new(),
                };
                passed = Some(file);
                (desc, None)
            }
        };
        let mut keys = Vec::new();
        let mut remote_keys = Vec::new();
        let mut accepted = Vec::new();
        let mut refusals = Vec::new();
        for (slot, plugin) in self.plugins.iter().enumerate() {
            if !self.instances[slot].is_active() {
                continue;
            }
            if !plugin.capabilities().serves(desc.kind) {
                refusals.push(format!("{}: memory kind {} not served", plugin.name(), desc.kind));
                continue;
            }
            match plugin.transport().register(&desc) {
                RResult::ROk(registration) => {
                    keys.push((PluginSlot(slot as u32), registration.key));
                    remote_keys.push(proto::RemoteKey {
                        plugin: self.instances[slot].wire_name.clone(),
                        key: registration.remote_key.to_vec(),
                    });
                    accepted.push(plugin.name().to_string());
                }
                RResult::RErr(e) => refusals.push(format!("{}: {e}", plugin.name())),
            }
        }
        if keys.is_empty() {
            return Err(ApiError::invalid(
                "unsupported_memory",
                format!("no opened plugin accepted the region: {}", refusals.join("; ")),
            ));
        }
        let id = self.regions.next_id;
        self.regions.next_id += 1;
        let announce = proto::RegionAnnounce { region: id, len: desc.len, keys: remote_keys };
        let now = self.now();
        self.core.handle_region_registered(
            now,
            RegionInfo { id: RegionId(id), len: desc.len, memory_kind: desc.kind, keys: keys.clone() },
        );
        self.peers.broadcast(Frame::RegionAnnounce(announce.clone()), &self.metrics);
        tracing::info!(region = id, len = desc.len, label = %label, plugins = ?accepted, refused = ?refusals, "region registered");
        self.regions.by_id.insert(id, LocalRegion { label, keys, announce, desc, _mapping: mapping, _file: passed });
        Ok(Registered { region: id, plugins: accepted, refused: refusals })
    }

    /// An engine's `UnregisterMemory`: refused while any live or quarantined room holds the region
    /// (its memory may still be read or written); the engine aborts those rooms and unregisters once
    /// they are reusable.
    pub(super) fn unregister_region(&mut self, id: u64) -> Result<(), ApiError> {
        if !self.regions.by_id.contains_key(&id) {
            return Err(ApiError::new(Code::NotFound, "unknown_region", format!("region {id} is not registered")));
        }
        if let Some((count, named)) = self.region_use.users(id) {
            let names: Vec<String> = named.iter().map(|(room, role)| format!("{room} ({})", role.as_str())).collect();
            let more = if count > named.len() { format!(" and {} more", count - named.len()) } else { String::new() };
            tracing::info!(region = id, rooms = count, "unregister refused: region in use");
            return Err(ApiError::new(
                Code::FailedPrecondition,
                "region_in_use",
                format!(
                    "region {id} is held by {count} room(s) not yet reusable: {}{more}; abort them and unregister once they are reusable",
                    names.join(", ")
                ),
            ));
        }
        self.sessions.disown_region(id);
        self.orphan_regions.remove(&id);
        self.release_region(id)
    }

    /// Deregister a region from every plugin, the core and the peers, whoever holds it (shutdown,
    /// once nothing can land any more).
    pub(super) fn release_region(&mut self, id: u64) -> Result<(), ApiError> {
        let Some(region) = self.regions.by_id.remove(&id) else {
            return Err(ApiError::new(Code::NotFound, "unknown_region", format!("region {id} is not registered")));
        };
        let now = self.now();
        self.core.handle_region_unregistered(now, RegionId(id));
        let mut refused = false;
        for (slot, key) in &region.keys {
            if let Some(plugin) = self.plugins.get(slot.0 as usize) {
                if let RResult::RErr(e) = plugin.transport().deregister(*key) {
                    tracing::warn!(region = id, plugin = plugin.name(), reason = %e.code, "deregister failed: {e}");
                    // A key the plugin does not know is not in its hands; any other refusal may mean it
                    // still touches the memory.
                    refused |= e.code != kvgate_abi::ReasonCode::UNKNOWN_KEY;
                }
            }
        }
        self.peers.broadcast(Frame::RegionWithdraw(proto::RegionWithdraw { region: id }), &self.metrics);
        if refused {
            tracing::warn!(
                region = id,
                label = %region.label,
                reason = "region_quarantined",
                "region unregistered, but a plugin refused to let go of it: its memory stays mapped until the plugins shut down"
            );
            self.regions.quarantined.push(region);
        } else {
            tracing::info!(region = id, label = %region.label, "region unregistered");
        }
        Ok(())
    }

    /// A plugin reload opened `slots`: register every region with those that serve its memory
    /// kind, tell the core, and add their keys to its announcement (sent by the caller).
    pub(super) fn register_regions_with(&mut self, slots: &[usize]) {
        let now = self.now();
        for (id, region) in self.regions.by_id.iter_mut() {
            for &slot in slots {
                let plugin = &self.plugins[slot];
                if !plugin.capabilities().serves(region.desc.kind) {
                    continue;
                }
                match plugin.transport().register(&region.desc) {
                    RResult::ROk(registration) => {
                        region.keys.push((PluginSlot(slot as u32), registration.key));
                        let key = proto::RemoteKey {
                            plugin: self.instances[slot].wire_name.clone(),
                            key: registration.remote_key.to_vec(),
                        };
                        region.announce.keys.push(key);
                    }
                    RResult::RErr(e) => {
                        tracing::warn!(region = id, plugin = %self.instances[slot].wire_name, "a reloaded plugin refused a registered region: {e}")
                    }
                }
            }
            let info = RegionInfo {
                id: RegionId(*id),
                len: region.desc.len,
                memory_kind: region.desc.kind,
                keys: region.keys.clone(),
            };
            self.core.handle_region_registered(now, info);
        }
    }

    /// An instance is closing: deregister every region from it and drop its keys (core and
    /// announcements).
    pub(super) fn deregister_regions_from(&mut self, slot: PluginSlot) {
        let now = self.now();
        let wire = self.instances[slot.0 as usize].wire_name.clone();
        for (id, region) in self.regions.by_id.iter_mut() {
            let Some(at) = region.keys.iter().position(|(s, _)| *s == slot) else { continue };
            let (_, key) = region.keys.remove(at);
            if let RResult::RErr(e) = self.plugins[slot.0 as usize].transport().deregister(key) {
                tracing::warn!(region = id, plugin = %wire, "deregister failed: {e}");
            }
            region.announce.keys.retain(|k| k.plugin != wire);
            let info = RegionInfo {
                id: RegionId(*id),
                len: region.desc.len,
                memory_kind: region.desc.kind,
                keys: region.keys.clone(),
            };
            self.core.handle_region_registered(now, info);
        }
    }
}
