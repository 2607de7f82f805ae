//! The pure checks behind `register` and `import_remote_key`: which regions this instance can
//! serve and how a peer's key reaches its memory. Owns refusals with reason codes; never calls
//! CUDA (the plugin calls these first, then the driver), so they are unit-tested without a GPU.

use crate::wire::{EndpointWire, RemoteKeyWire, VmmKeyWire, IPC_HANDLE_BYTES};
use kvgate_abi::cuda_vmm::CudaVmmBacking;
use kvgate_abi::{MemoryKind, PluginError, ReasonCode, RegionDesc};

fn refuse(code: ReasonCode, what: &str, message: String) -> PluginError {
    PluginError::new(code, format!("nvlink {what}: {message}"))
}

/// How a region handed to `register` is reached in this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RegionSource {
    /// Device memory of this process at `RegionDesc::addr` (an IPC handle is exported for it,
    /// unless the caller gave one).
    LocalPointer,
    /// Memory of another process (an engine): open `RegionDesc::ipc_handle`; the region starts
    /// `RegionDesc::backing_offset` bytes into that allocation.
    EngineHandle,
    /// A CUDA VMM allocation whose descriptor the host holds (`backing_path =
    /// "cuda-vmm-fd:<fd>:<allocation_size>"`): import a duplicate of `fd`, map the allocation; the
    /// region starts `RegionDesc::backing_offset` bytes into it.
    VmmDescriptor { fd: i32, allocation_size: u64 },
}

/// What `register` decided before touching the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionPlan {
    pub device_index: usize,
    pub source: RegionSource,
}

/// Checks a region descriptor against the devices this instance serves and its limits.
pub fn check_region(
    region: &RegionDesc,
    device_ordinals: &[u32],
    registered_regions: u64,
    max_registered_regions: u64,
) -> Result<RegionPlan, PluginError> {
    let what = "register";
    if region.kind != MemoryKind::CUDA_DEVICE {
        return Err(refuse(
            ReasonCode::UNSUPPORTED_MEMORY,
            what,
            format!(
                "memory kind {} refused: this plugin serves CUDA device memory only (no host staging)",
                region.kind
            ),
        ));
    }
    if region.len == 0 {
        return Err(refuse(ReasonCode::INVALID_ARGUMENT, what, "zero-length region".into()));
    }
    if region.device < 0 {
        return Err(refuse(ReasonCode::INVALID_ARGUMENT, what, format!("negative device ordinal {}", region.device)));
    }
    let device_index = device_ordinals.iter().position(|&o| o as i64 == region.device as i64).ok_or_else(|| {
        refuse(
            ReasonCode::UNSUPPORTED_MEMORY,
            what,
            format!("device {} is not served by this instance (devices {:?})", region.device, device_ordinals),
        )
    })?;
    if !region.ipc_handle.is_empty() && region.ipc_handle.len() != IPC_HANDLE_BYTES {
        return Err(refuse(
            ReasonCode::INVALID_ARGUMENT,
            what,
            format!("ipc_handle has {} bytes, a CUDA IPC handle has {IPC_HANDLE_BYTES}", region.ipc_handle.len()),
        ));
    }
    let source = match (region.addr, region.ipc_handle.is_empty()) {
        (0, true) => match CudaVmmBacking::parse(region.backing_path.as_str()) {
            Some(Ok(b)) => {
                if region.backing_offset.checked_add(region.len).is_none_or(|end| end > b.allocation_size) {
                    return Err(refuse(
                        ReasonCode::OUT_OF_RANGE,
                        what,
                        format!(
                            "backing_offset {} + {} bytes exceed the CUDA VMM allocation ({} bytes)",
                            region.backing_offset, region.len, b.allocation_size
                        ),
                    ));
                }
                RegionSource::VmmDescriptor { fd: b.fd, allocation_size: b.allocation_size }
            }
            Some(Err(why)) => return Err(refuse(ReasonCode::INVALID_ARGUMENT, what, why)),
            None => return Err(refuse(
                ReasonCode::INVALID_ARGUMENT,
                what,
                "needs a device address, an IPC handle or a CUDA VMM descriptor (backing_path cuda-vmm-fd:<fd>:<size>)"
                    .into(),
            )),
        },
        (0, false) => RegionSource::EngineHandle,
        (addr, _) => {
            if addr.checked_add(region.len).is_none() {
                return Err(refuse(ReasonCode::INVALID_ARGUMENT, what, "address + length overflows".into()));
            }
            RegionSource::LocalPointer
        }
    };
    if source == RegionSource::EngineHandle && region.backing_offset.checked_add(region.len).is_none() {
        return Err(refuse(ReasonCode::INVALID_ARGUMENT, what, "backing_offset + length overflows".into()));
    }
    if registered_regions >= max_registered_regions {
        return Err(refuse(
            ReasonCode::RESOURCE_EXHAUSTED,
            what,
            format!("max_registered_regions {max_registered_regions} reached"),
        ));
    }
    Ok(RegionPlan { device_index, source })
}

/// How an imported key's memory is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImportRoute {
    /// The region lives in this very process (two instances in one process): use its address.
    SameProcess,
    /// Open the key's IPC handle, in the context of device `device_index` (the device with the
    /// key's UUID if this instance serves it, else the first one, with lazy peer access).
    OpenHandle { device_index: usize },
}

/// Checks that `key` was made by the instance behind `peer` and decides how to reach it.
pub fn route_import(
    key: &RemoteKeyWire,
    peer: &EndpointWire,
    local: &EndpointWire,
    device_uuids: &[[u8; 16]],
) -> Result<ImportRoute, PluginError> {
    if key.instance_nonce != peer.instance_nonce {
        return Err(refuse(
            ReasonCode::INVALID_ARGUMENT,
            "import_remote_key",
            format!(
                "key made by instance {:#x}, but the peer is instance {:#x} (foreign or stale key)",
                key.instance_nonce, peer.instance_nonce
            ),
        ));
    }
    if key.holder_pid == local.pid && peer.pid == local.pid && peer.boot_id == local.boot_id {
        return Ok(ImportRoute::SameProcess);
    }
    let device_index = device_uuids.iter().position(|u| *u == key.device_uuid).unwrap_or(0);
    Ok(ImportRoute::OpenHandle { device_index })
}

/// Checks that a CUDA VMM `key` was made by the instance behind `peer`; the device whose context
/// maps it (the key's device by UUID if this instance serves it, else the first one).
pub fn route_vmm_import(
    key: &VmmKeyWire,
    peer: &EndpointWire,
    device_uuids: &[[u8; 16]],
) -> Result<usize, PluginError> {
    if key.instance_nonce != peer.instance_nonce {
        return Err(refuse(
            ReasonCode::INVALID_ARGUMENT,
            "import_remote_key",
            format!(
                "key made by instance {:#x}, but the peer is instance {:#x} (foreign or stale key)",
                key.instance_nonce, peer.instance_nonce
            ),
        ));
    }
    Ok(device_uuids.iter().position(|u| *u == key.device_uuid).unwrap_or(0))
}
