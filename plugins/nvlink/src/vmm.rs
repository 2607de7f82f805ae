//! CUDA VMM allocations (`cuMemCreate`; PyTorch's expandable segments) reached through a POSIX file
//! descriptor: importing the descriptor, reserving address space, mapping the whole allocation and
//! granting the plugin's device read/write access; unmapping and freeing the address range when the
//! last holder lets go. Owns those driver calls only; must never be entered before
//! `cuda::driver_library_present()` said yes.
//!
//! The imported allocation handle is released right after mapping: the mapping keeps the physical
//! memory alive, so the memory stays valid for as long as a [`VmmMapping`] exists, even when its
//! owner frees it meanwhile. Regions and imported keys hold their mapping in an `Arc`, and so do the
//! transfers using them, so the range is unmapped only after the last transfer touching it quiesced.

use cudarc::driver::{sys, CudaContext, DriverError};
use std::ffi::c_void;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::Arc;

fn driver_error(what: &str, e: DriverError) -> String {
    format!("{what}: {e}")
}

/// Why an import failed: the allocation's size does not fit the driver's rules, or a driver call
/// failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VmmError {
    /// The caller's description is wrong (size not a multiple of the allocation's granularity).
    Invalid(String),
    /// The descriptor or the driver refused.
    Driver(String),
}

impl std::fmt::Display for VmmError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            VmmError::Invalid(m) | VmmError::Driver(m) => f.write_str(m),
        }
    }
}

/// One imported VMM allocation, mapped in this process for one device; unmapped and its address
/// range freed on drop.
pub struct VmmMapping {
    ctx: Arc<CudaContext>,
    /// Device address of the allocation's first byte in this process.
    pub base: u64,
    /// Size of the mapped allocation in bytes.
    pub size: u64,
}

/// Releases an allocation handle, logging a failure (it would leak the handle, not corrupt memory).
fn release(handle: sys::CUmemGenericAllocationHandle) {
    // SAFETY: `handle` came from cuMemImportFromShareableHandle and is released exactly once.
    if let Err(e) = unsafe { sys::cuMemRelease(handle).result() } {
        tracing::warn!("nvlink: cuMemRelease of an imported VMM handle failed: {e}");
    }
}

/// Frees a reserved address range, logging a failure.
fn free_range(base: sys::CUdeviceptr, size: usize) {
    // SAFETY: `base`/`size` are exactly a range cuMemAddressReserve returned, nothing is mapped in it.
    if let Err(e) = unsafe { sys::cuMemAddressFree(base, size).result() } {
        tracing::warn!(base, "nvlink: cuMemAddressFree failed: {e}");
    }
}

impl VmmMapping {
    /// Imports the allocation behind `fd` (a descriptor from `cuMemExportToShareableHandle` with
    /// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`; borrowed: a duplicate is imported and closed, the
    /// caller's stays open) and maps all `allocation_size` bytes with read/write access for the
    /// device of `ctx`.
    pub fn import(ctx: &Arc<CudaContext>, fd: BorrowedFd<'_>, allocation_size: u64) -> Result<VmmMapping, VmmError> {
        let drv = |what: &str, e: DriverError| VmmError::Driver(driver_error(what, e));
        let size = usize::try_from(allocation_size).map_err(|_| {
            VmmError::Invalid(format!("allocation size {allocation_size} does not fit this machine's address space"))
        })?;
        let own = fd
            .try_clone_to_owned()
            .map_err(|e| VmmError::Invalid(format!("cannot duplicate descriptor {}: {e}", fd.as_raw_fd())))?;
        ctx.bind_to_thread().map_err(|e| drv("bind context", e))?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: out-pointer to a local; for the POSIX descriptor type the driver takes the
        // descriptor's number as the pointer value and does not close or keep it.
        let imported = unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                own.as_raw_fd() as usize as *mut c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
            .result()
        };
        drop(own);
        imported.map_err(|e| drv("cuMemImportFromShareableHandle (not a CUDA VMM descriptor?)", e))?;

        // SAFETY: an all-zero CUmemAllocationProp is a valid value of this plain C struct (the
        // driver overwrites it below).
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        // SAFETY: out-pointer to a local; `handle` is a live imported handle.
        if let Err(e) = unsafe { sys::cuMemGetAllocationPropertiesFromHandle(&mut prop, handle).result() } {
            release(handle);
            return Err(drv("cuMemGetAllocationPropertiesFromHandle", e));
        }
        let mut granularity: usize = 0;
        // SAFETY: out-pointer to a local; `prop` is the allocation's own properties.
        let granted = unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granularity,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
            .result()
        };
        if let Err(e) = granted {
            release(handle);
            return Err(drv("cuMemGetAllocationGranularity", e));
        }
        if granularity == 0 || size == 0 || size % granularity != 0 {
            release(handle);
            return Err(VmmError::Invalid(format!(
                "allocation size {allocation_size} is not a positive multiple of the allocation's granularity ({granularity} bytes)"
            )));
        }

        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: out-pointer to a local; no fixed address requested (0), no flags.
        if let Err(e) = unsafe { sys::cuMemAddressReserve(&mut base, size, granularity, 0, 0).result() } {
            release(handle);
            return Err(drv("cuMemAddressReserve", e));
        }
        // SAFETY: `base..base+size` was just reserved and is unmapped; offset must be 0, flags 0.
        if let Err(e) = unsafe { sys::cuMemMap(base, size, 0, handle, 0).result() } {
            free_range(base, size);
            release(handle);
            return Err(drv(&format!("cuMemMap of {allocation_size} bytes (is that the allocation's size?)"), e));
        }
        // The mapping holds the physical memory from here on.
        release(handle);
        let access = sys::CUmemAccessDesc {
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: ctx.ordinal() as i32,
            },
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        let mapping = VmmMapping { ctx: ctx.clone(), base, size: allocation_size };
        // SAFETY: the range is mapped (above); one access descriptor, read from a local.
        unsafe { sys::cuMemSetAccess(base, size, &access, 1).result() }
            .map_err(|e| drv(&format!("cuMemSetAccess for device {} (read/write)", ctx.ordinal()), e))?;
        Ok(mapping)
    }

    /// Whether `offset + len` lies inside the mapped allocation.
    pub fn fits(&self, offset: u64, len: u64) -> bool {
        offset.checked_add(len).is_some_and(|end| end <= self.size)
    }
}

impl Drop for VmmMapping {
    fn drop(&mut self) {
        if let Err(e) = self.ctx.bind_to_thread() {
            tracing::warn!(base = self.base, "nvlink: bind context to unmap a VMM allocation: {e}");
            return;
        }
        // SAFETY: `base..base+size` is mapped by this value alone; every transfer that used it
        // held this mapping until it quiesced, so no copy touches it any more.
        match unsafe { sys::cuMemUnmap(self.base, self.size as usize).result() } {
            Ok(()) => free_range(self.base, self.size as usize),
            Err(e) => tracing::warn!(base = self.base, "nvlink: cuMemUnmap failed (address range kept): {e}"),
        }
    }
}
