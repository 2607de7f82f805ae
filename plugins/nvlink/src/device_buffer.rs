//! Device memory for the GPU tests and the bandwidth benchmark: allocated with `cuMemAlloc`
//! (IPC-exportable, unlike pool allocations), filled and read back synchronously. Not used by the
//! transfer path; never call it before `cuda::driver_library_present()` said yes.

use cudarc::driver::{result, CudaContext};
use std::sync::Arc;

/// One `cuMemAlloc` allocation, freed on drop.
pub struct DeviceBuffer {
    ctx: Arc<CudaContext>,
    pub ptr: u64,
    pub len: u64,
}

impl DeviceBuffer {
    pub fn alloc(ctx: &Arc<CudaContext>, len: u64) -> Result<DeviceBuffer, String> {
        ctx.bind_to_thread().map_err(|e| format!("bind context: {e}"))?;
        // SAFETY: plain allocation in the bound context.
        let ptr = unsafe { result::malloc_sync(len as usize) }.map_err(|e| format!("cuMemAlloc {len}: {e}"))?;
        Ok(DeviceBuffer { ctx: ctx.clone(), ptr, len })
    }

    pub fn write(&self, offset: u64, bytes: &[u8]) -> Result<(), String> {
        assert!(offset + bytes.len() as u64 <= self.len, "write past the buffer");
        self.ctx.bind_to_thread().map_err(|e| format!("bind context: {e}"))?;
        // SAFETY: range checked above; the allocation is live.
        unsafe { result::memcpy_htod_sync(self.ptr + offset, bytes) }.map_err(|e| format!("cuMemcpyHtoD: {e}"))
    }

    pub fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, String> {
        assert!(offset + len <= self.len, "read past the buffer");
        self.ctx.bind_to_thread().map_err(|e| format!("bind context: {e}"))?;
        let mut out = vec![0u8; len as usize];
        // SAFETY: range checked above; the allocation is live.
        unsafe { result::memcpy_dtoh_sync(&mut out, self.ptr + offset) }.map_err(|e| format!("cuMemcpyDtoH: {e}"))?;
        Ok(out)
    }

    /// A raw synchronous `cuMemcpyDtoD` (the benchmark's reference).
    pub fn copy_to(&self, dst: &DeviceBuffer, len: u64) -> Result<(), String> {
        assert!(len <= self.len && len <= dst.len, "copy past a buffer");
        self.ctx.bind_to_thread().map_err(|e| format!("bind context: {e}"))?;
        // SAFETY: both allocations are live and at least `len` long.
        unsafe { result::memcpy_dtod_sync(dst.ptr, self.ptr, len as usize) }.map_err(|e| format!("cuMemcpyDtoD: {e}"))
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from cuMemAlloc in this context and is freed once, here.
        let freed = self.ctx.bind_to_thread().and_then(|()| unsafe { result::free_sync(self.ptr) });
        if let Err(e) = freed {
            tracing::warn!("nvlink test buffer: cuMemFree failed: {e}");
        }
    }
}

/// Deterministic pseudo-random bytes (xorshift64*) for checksummed transfers.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut state = seed | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        out.extend_from_slice(&state.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
    }
    out.truncate(len);
    out
}
