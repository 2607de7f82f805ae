//! Where a peer's regions live: one [`MemoryProvider`] per peer process, chosen at `open` from the
//! harness's `memory_provider` setting and the plugin's declared memory kinds. Owns allocation and
//! the `RegionDesc` a region is registered with; never judges a plugin.
//!
//! - `host`: a `/dev/shm` file mapped shared, registered as `HOST` (every plugin that serves host memory).
//! - `fake_device`: the same host file registered as `CUDA_DEVICE`, its IPC handle the file's path
//!   (the convention of the gateway's `fake-device` test plugin): device-only plugins testable
//!   without a GPU, every byte still readable by the controller.
//! - `cuda`: `cuMemAlloc` device memory on device 0, registered as `CUDA_DEVICE` (the plugin exports
//!   its IPC handle). Only with the harness's optional CUDA support (feature `cuda`, as
//!   `tests/gpu/run.sh` builds it) and a driver; otherwise the choice fails with the reason, and
//!   every clause is reported unsupported. The region's host file is then a mirror, refreshed from
//!   the device at each fill and checksum.
//!
//! `auto` (the default) takes `host` when the plugin declares host memory, else `cuda` when it
//! declares CUDA device memory.

use super::region::Region;
use kvgate_abi::{MemoryKind, RegionDesc};

/// The `[harness] memory_provider` values.
pub const PROVIDERS: &[&str] = &["auto", "host", "fake_device", "cuda"];

/// Device memory behind a region (the CUDA provider): bytes written through and read back.
pub trait DeviceMemory: Send + Sync {
    /// The device address registered with the plugin.
    fn device_addr(&self) -> u64;
    fn ordinal(&self) -> i32;
    fn write(&self, offset: u64, bytes: &[u8]) -> Result<(), String>;
    fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, String>;
}

/// Allocates a peer's regions and says how each is registered.
pub trait MemoryProvider: Send {
    fn name(&self) -> &'static str;
    /// A region of `len` bytes, id `rid`, backed by its host file (and device memory, for `cuda`).
    fn alloc(&self, rid: u32, len: u64) -> Result<Region, String>;
    /// The descriptor `Register` hands the plugin for the whole of `region`.
    fn describe(&self, region: &Region) -> RegionDesc;
}

pub struct HostProvider;

impl MemoryProvider for HostProvider {
    fn name(&self) -> &'static str {
        "host"
    }
    fn alloc(&self, rid: u32, len: u64) -> Result<Region, String> {
        Region::create(rid, len)
    }
    fn describe(&self, r: &Region) -> RegionDesc {
        RegionDesc {
            kind: MemoryKind::HOST,
            device: -1,
            addr: r.addr as u64,
            len: r.len,
            backing_path: r.path.to_string_lossy().as_ref().into(),
            backing_offset: 0,
            ipc_handle: Default::default(),
        }
    }
}

/// Host memory declared as CUDA device memory, its IPC handle the host file's path.
pub struct FakeDeviceProvider;

impl MemoryProvider for FakeDeviceProvider {
    fn name(&self) -> &'static str {
        "fake_device"
    }
    fn alloc(&self, rid: u32, len: u64) -> Result<Region, String> {
        Region::create(rid, len)
    }
    fn describe(&self, r: &Region) -> RegionDesc {
        RegionDesc {
            kind: MemoryKind::CUDA_DEVICE,
            device: 0,
            addr: r.addr as u64,
            len: r.len,
            backing_path: Default::default(),
            backing_offset: 0,
            ipc_handle: r.path.to_string_lossy().as_bytes().to_vec().into(),
        }
    }
}

/// The provider for `requested` (one of [`PROVIDERS`]) and a plugin declaring `memory_kinds`, or
/// why it cannot be had here (the run is then unsupported, never pass).
pub fn choose(requested: &str, memory_kinds: u32) -> Result<Box<dyn MemoryProvider>, String> {
    match requested {
        "host" => Ok(Box::new(HostProvider)),
        "fake_device" => Ok(Box::new(FakeDeviceProvider)),
        "cuda" => cuda::provider(),
        "auto" if memory_kinds & MemoryKind::HOST.bit() != 0 => Ok(Box::new(HostProvider)),
        "auto" if memory_kinds & MemoryKind::CUDA_DEVICE.bit() != 0 => cuda::provider(),
        "auto" => {
            Err(format!("the plugin declares no memory kind the harness can provide (memory_kinds {memory_kinds:#x})"))
        }
        other => Err(format!("unknown memory provider {other:?} (one of {PROVIDERS:?})")),
    }
}

#[cfg(not(feature = "cuda"))]
mod cuda {
    use super::MemoryProvider;

    pub fn provider() -> Result<Box<dyn MemoryProvider>, String> {
        Err("CUDA device memory: this harness was built without CUDA support (build kvgate-conformance with \
             `--features cuda`, as tests/gpu/run.sh does)"
            .into())
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::{DeviceMemory, MemoryProvider, Region};
    use kvgate_abi::{MemoryKind, RegionDesc};
    use kvgate_plugin_nvlink::cuda::{driver_library_present, open_devices, CudaDevice, NO_DRIVER_REASON};
    use kvgate_plugin_nvlink::device_buffer::DeviceBuffer;

    pub struct CudaProvider {
        device: CudaDevice,
    }

    struct Device {
        buffer: DeviceBuffer,
        ordinal: i32,
    }

    impl DeviceMemory for Device {
        fn device_addr(&self) -> u64 {
            self.buffer.ptr
        }
        fn ordinal(&self) -> i32 {
            self.ordinal
        }
        fn write(&self, offset: u64, bytes: &[u8]) -> Result<(), String> {
            self.buffer.write(offset, bytes)
        }
        fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, String> {
            self.buffer.read(offset, len)
        }
    }

    pub fn provider() -> Result<Box<dyn MemoryProvider>, String> {
        if !driver_library_present() {
            return Err(format!("CUDA device memory: {NO_DRIVER_REASON}"));
        }
        let device = open_devices(&[0]).map_err(|e| format!("CUDA device memory: {e}"))?.remove(0);
        Ok(Box::new(CudaProvider { device }))
    }

    impl MemoryProvider for CudaProvider {
        fn name(&self) -> &'static str {
            "cuda"
        }
        fn alloc(&self, rid: u32, len: u64) -> Result<Region, String> {
            let mut region = Region::create(rid, len)?;
            let buffer = DeviceBuffer::alloc(&self.device.ctx, len.max(1))?;
            region.device = Some(Box::new(Device { buffer, ordinal: self.device.ordinal as i32 }));
            Ok(region)
        }
        fn describe(&self, r: &Region) -> RegionDesc {
            let device = r.device.as_ref().expect("a CUDA region has device memory");
            RegionDesc {
                kind: MemoryKind::CUDA_DEVICE,
                device: device.ordinal(),
                addr: device.device_addr(),
                len: r.len,
                backing_path: Default::default(),
                backing_offset: 0,
                ipc_handle: Default::default(),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_takes_host_memory_when_declared_and_device_memory_otherwise() {
        let host = MemoryKind::HOST.bit();
        let device = MemoryKind::CUDA_DEVICE.bit();
        assert_eq!(choose("auto", host).unwrap().name(), "host");
        assert_eq!(choose("auto", host | device).unwrap().name(), "host");
        assert_eq!(choose("host", device).unwrap().name(), "host", "an explicit choice stands");
        assert_eq!(choose("fake_device", host).unwrap().name(), "fake_device");
        let none = choose("auto", 0).err().expect("no kind, no provider");
        assert!(none.contains("no memory kind"), "{none}");
        assert!(choose("gpu", host).err().expect("unknown").contains("unknown memory provider"));
        // Device memory: real only with the CUDA support and a driver; here, a reason.
        if cfg!(not(feature = "cuda")) {
            let why = choose("auto", device).err().expect("no CUDA support in this build");
            assert!(why.contains("without CUDA support"), "{why}");
        }
    }

    #[test]
    fn the_fake_device_provider_registers_the_host_file_as_device_memory() {
        let provider = FakeDeviceProvider;
        let region = provider.alloc(900_001, 8192).unwrap();
        let desc = provider.describe(&region);
        assert_eq!((desc.kind, desc.device, desc.len), (MemoryKind::CUDA_DEVICE, 0, 8192));
        assert_eq!(desc.ipc_handle.as_slice(), region.path.to_string_lossy().as_bytes());
        assert!(desc.backing_path.is_empty());
        let host = HostProvider.describe(&region);
        assert_eq!((host.kind, host.device), (MemoryKind::HOST, -1));
        assert_eq!(host.backing_path.as_str(), region.path.to_string_lossy());
    }
}
