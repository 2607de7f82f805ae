//! Registered local regions (host memory of this process, addressed by `RegionDesc::addr`) and imported
//! remote keys. Every copy of the plugin goes through here, into or out of the SDK's region views
//! (bounds-checked; the plugin dereferences no address itself), under the table's read lock, so
//! `deregister` waits for copies in progress and no copy starts after it (the views' invariant).

use crate::wire::RemoteKeyInfo;
use kvgate_abi::sdk::RegionView;
use kvgate_abi::{LocalKey, MemoryKind, PeerId, PluginError, ReasonCode, RegionDesc, RemoteKey};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, RwLock};

struct LocalRegion {
    view: RegionView,
    len: u64,
}

/// A peer's region as imported from its remote-key bytes.
#[derive(Debug, Clone, Copy)]
pub struct RemoteRegion {
    pub peer: PeerId,
    pub info: RemoteKeyInfo,
}

pub struct Regions {
    instance: u64,
    next_key: AtomicU64,
    local: RwLock<HashMap<u64, LocalRegion>>,
    remote: Mutex<HashMap<u64, RemoteRegion>>,
}

fn refuse(code: ReasonCode, message: String) -> PluginError {
    PluginError::new(code, message)
}

/// `offset + len <= region_len`, without overflow.
pub fn in_bounds(offset: u64, len: u64, region_len: u64) -> bool {
    offset.checked_add(len).is_some_and(|end| end <= region_len)
}

impl Regions {
    pub fn new(instance: u64) -> Regions {
        Regions {
            instance,
            next_key: AtomicU64::new(1),
            local: RwLock::new(HashMap::new()),
            remote: Mutex::new(HashMap::new()),
        }
    }

    pub fn register(&self, desc: &RegionDesc) -> Result<(LocalKey, RemoteKeyInfo), PluginError> {
        if desc.kind != MemoryKind::HOST {
            return Err(refuse(
                ReasonCode::UNSUPPORTED_MEMORY,
                format!("quic serves host memory only, not {} (device {})", desc.kind, desc.device),
            ));
        }
        if desc.len == 0 || desc.addr == 0 {
            return Err(refuse(
                ReasonCode::INVALID_ARGUMENT,
                format!("region addr {:#x} len {} is empty or null", desc.addr, desc.len),
            ));
        }
        let end = desc.addr.checked_add(desc.len);
        if end.is_none()
            || usize::try_from(desc.addr).is_err()
            || usize::try_from(desc.len).is_err()
            || desc.len > isize::MAX as u64
        {
            return Err(refuse(
                ReasonCode::INVALID_ARGUMENT,
                format!("region addr {:#x} len {} overflows the address space", desc.addr, desc.len),
            ));
        }
        let view = RegionView::registered(desc)?;
        let key = self.next_key.fetch_add(1, Ordering::Relaxed);
        self.local.write().expect("regions lock").insert(key, LocalRegion { view, len: desc.len });
        Ok((LocalKey(key), RemoteKeyInfo { instance: self.instance, key, len: desc.len }))
    }

    pub fn deregister(&self, key: LocalKey) -> Result<(), PluginError> {
        match self.local.write().expect("regions lock").remove(&key.0) {
            Some(_) => Ok(()),
            None => Err(refuse(ReasonCode::UNKNOWN_KEY, format!("local key {} is not registered", key.0))),
        }
    }

    pub fn local_len(&self, key: LocalKey) -> Option<u64> {
        self.local.read().expect("regions lock").get(&key.0).map(|r| r.len)
    }

    /// Append `len` bytes of local region `key` at `offset` to `out`.
    pub fn copy_out(&self, key: u64, offset: u64, len: usize, out: &mut Vec<u8>) -> Result<(), PluginError> {
        let table = self.local.read().expect("regions lock");
        let region = table.get(&key).ok_or_else(|| {
            refuse(ReasonCode::UNKNOWN_KEY, format!("source region {key} was deregistered during the transfer"))
        })?;
        if !in_bounds(offset, len as u64, region.len) {
            return Err(refuse(
                ReasonCode::OUT_OF_RANGE,
                format!("source {offset}+{len} outside region {key} of {} bytes", region.len),
            ));
        }
        // The read lock keeps `deregister` (the write lock) out for the copy: the view stays valid.
        region.view.copy_out(offset, len, out)
    }

    /// Copy `data` into local region `key` at `offset`.
    pub fn copy_in(&self, key: u64, offset: u64, data: &[u8]) -> Result<(), PluginError> {
        let table = self.local.read().expect("regions lock");
        let region = table
            .get(&key)
            .ok_or_else(|| refuse(ReasonCode::UNKNOWN_KEY, format!("destination region {key} is not registered")))?;
        if !in_bounds(offset, data.len() as u64, region.len) {
            return Err(refuse(
                ReasonCode::OUT_OF_RANGE,
                format!("destination {offset}+{} outside region {key} of {} bytes", data.len(), region.len),
            ));
        }
        // As in `copy_out`: the read lock keeps the view valid for the copy.
        region.view.copy_in(offset, data)
    }

    /// Check a destination range against its region without writing.
    pub fn check_destination(&self, key: u64, offset: u64, len: u64) -> Result<(), PluginError> {
        let table = self.local.read().expect("regions lock");
        let region = table
            .get(&key)
            .ok_or_else(|| refuse(ReasonCode::UNKNOWN_KEY, format!("destination region {key} is not registered")))?;
        if !in_bounds(offset, len, region.len) {
            return Err(refuse(
                ReasonCode::OUT_OF_RANGE,
                format!("destination {offset}+{len} outside region {key} of {} bytes", region.len),
            ));
        }
        Ok(())
    }

    pub fn import(&self, peer: PeerId, bytes: &[u8]) -> Result<RemoteKey, PluginError> {
        let id = self.next_key.fetch_add(1, Ordering::Relaxed);
        let info = RemoteKeyInfo::decode(bytes).map_err(|e| refuse(ReasonCode::INVALID_ARGUMENT, e.0))?;
        self.remote.lock().expect("remote keys lock").insert(id, RemoteRegion { peer, info });
        Ok(RemoteKey(id))
    }

    pub fn release_remote(&self, key: RemoteKey) {
        self.remote.lock().expect("remote keys lock").remove(&key.0);
    }

    pub fn remote(&self, key: RemoteKey) -> Option<RemoteRegion> {
        self.remote.lock().expect("remote keys lock").get(&key.0).copied()
    }

    /// (regions, bytes, imported remote keys)
    pub fn counts(&self) -> (u64, u64, u64) {
        let local = self.local.read().expect("regions lock");
        let bytes = local.values().map(|r| r.len).sum();
        (local.len() as u64, bytes, self.remote.lock().expect("remote keys lock").len() as u64)
    }

    pub fn clear(&self) {
        self.local.write().expect("regions lock").clear();
        self.remote.lock().expect("remote keys lock").clear();
    }
}
