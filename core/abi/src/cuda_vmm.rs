//! The convention by which a host names a CUDA VMM allocation (`cuMemCreate`, PyTorch's expandable
//! segments) to a plugin through a [`RegionDesc`](crate::RegionDesc), with no change to the ABI.
//! Owns the spelling of that convention (encoding and strict parsing); never touches CUDA.
//!
//! Such memory cannot be exported with `cuIpcGetMemHandle`; its owner exports it as a POSIX file
//! descriptor (`cuMemExportToShareableHandle`, `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`). The host
//! keeps that descriptor open in its own process while the region is registered, and describes it as:
//!
//! - `kind = CUDA_DEVICE`, `device` = the CUDA ordinal (as the host process sees it), `addr = 0`,
//!   `ipc_handle` empty, `len` = the region's length;
//! - `backing_path = "cuda-vmm-fd:<fd>:<allocation_size>"`: `<fd>` is the descriptor's number in the
//!   host process (the process that loaded the plugin), `<allocation_size>` the size in bytes of the
//!   whole allocation the descriptor names (mapping an imported allocation needs it, and the driver
//!   cannot be asked for it); both decimal;
//! - `backing_offset` = where the region starts inside the allocation.
//!
//! A plugin that serves it duplicates the descriptor (it never closes the host's) and imports the
//! duplicate; it may rely on the host's descriptor staying open until it `deregister`s the region.
//! A plugin that does not know this form sees `addr = 0` with no IPC handle and refuses the region,
//! which is the right answer for it. The descriptor is not a file: opening `backing_path` (or
//! `/proc/<pid>/fd/<fd>`) does not work.

/// The prefix of a `backing_path` that names a CUDA VMM descriptor.
pub const CUDA_VMM_FD_PREFIX: &str = "cuda-vmm-fd:";

/// A CUDA VMM allocation's descriptor, as a host names it in `backing_path`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaVmmBacking {
    /// The descriptor's number in the host process.
    pub fd: i32,
    /// Size in bytes of the whole allocation.
    pub allocation_size: u64,
}

impl CudaVmmBacking {
    /// The `backing_path` that names this descriptor.
    pub fn to_backing_path(&self) -> String {
        format!("{CUDA_VMM_FD_PREFIX}{}:{}", self.fd, self.allocation_size)
    }

    /// `None` when `backing_path` is not of this form (another kind of backing, or none); otherwise
    /// the descriptor, or why the text is malformed.
    pub fn parse(backing_path: &str) -> Option<Result<CudaVmmBacking, String>> {
        let rest = backing_path.strip_prefix(CUDA_VMM_FD_PREFIX)?;
        let parsed = (|| {
            let (fd, size) = rest.split_once(':').ok_or("expected cuda-vmm-fd:<fd>:<allocation_size>")?;
            let decimal = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
            if !decimal(fd) || !decimal(size) {
                return Err("descriptor and allocation size must be decimal numbers");
            }
            let fd: i32 = fd.parse().map_err(|_| "descriptor number out of range")?;
            let allocation_size: u64 = size.parse().map_err(|_| "allocation size out of range")?;
            if allocation_size == 0 {
                return Err("allocation size 0");
            }
            Ok(CudaVmmBacking { fd, allocation_size })
        })();
        Some(parsed.map_err(|why| format!("backing_path {backing_path:?}: {why}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_refuses_malformed_text() {
        let b = CudaVmmBacking { fd: 17, allocation_size: 2 << 20 };
        assert_eq!(b.to_backing_path(), "cuda-vmm-fd:17:2097152");
        assert_eq!(CudaVmmBacking::parse(&b.to_backing_path()), Some(Ok(b)));
        assert_eq!(CudaVmmBacking::parse("/dev/shm/pool"), None);
        assert_eq!(CudaVmmBacking::parse(""), None);
        for bad in [
            "cuda-vmm-fd:",
            "cuda-vmm-fd:17",
            "cuda-vmm-fd:-1:4096",
            "cuda-vmm-fd:17:0",
            "cuda-vmm-fd:x:1",
            "cuda-vmm-fd:99999999999:1",
            "cuda-vmm-fd:1:+5",
        ] {
            assert!(matches!(CudaVmmBacking::parse(bad), Some(Err(_))), "{bad} accepted");
        }
        let max = format!("cuda-vmm-fd:{}:{}", i32::MAX, u64::MAX);
        assert_eq!(CudaVmmBacking::parse(&max), Some(Ok(CudaVmmBacking { fd: i32::MAX, allocation_size: u64::MAX })));
    }
}
