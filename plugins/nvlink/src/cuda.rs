//! Everything that calls the CUDA driver (through cudarc, loaded at run time): finding the driver
//! and devices, inspecting and exporting device pointers, opening peers' IPC handles, and the
//! stream/event copy backend. Must never be entered before `driver_library_present()` said yes:
//! cudarc panics when libcuda is missing.

use crate::chunk_plan::CopyOp;
use crate::engine::{CopyBackend, Lane};
use crate::wire::IPC_HANDLE_BYTES;
use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaStream, DriverError};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

/// Whether libcuda can be loaded. The only CUDA-related call allowed before it returned true.
pub fn driver_library_present() -> bool {
    // SAFETY: only tries to dlopen the driver library under its known names; no CUDA call.
    unsafe { sys::is_culib_present() }
}

/// The reason given when the driver library is missing.
pub const NO_DRIVER_REASON: &str = "libcuda not found (no NVIDIA driver on this machine; searched libcuda.so, \
     libcuda.so.1 and the other names cudarc knows): the nvlink plugin needs an NVIDIA GPU and its driver";

/// One device the instance serves.
pub struct CudaDevice {
    pub ordinal: u32,
    pub ctx: Arc<CudaContext>,
    pub uuid: [u8; 16],
}

fn driver_error(what: &str, e: DriverError) -> String {
    format!("{what}: {e}")
}

/// Opens the primary context of each requested ordinal (every visible one for `[]`).
/// Call only after [`driver_library_present`].
pub fn open_devices(requested: &[u32]) -> Result<Vec<CudaDevice>, String> {
    result::init().map_err(|e| driver_error("cuInit failed (driver present but unusable)", e))?;
    let count = CudaContext::device_count().map_err(|e| driver_error("cuDeviceGetCount failed", e))?;
    if count <= 0 {
        return Err("the CUDA driver reports no device".into());
    }
    let ordinals: Vec<u32> = if requested.is_empty() { (0..count as u32).collect() } else { requested.to_vec() };
    let mut devices = Vec::with_capacity(ordinals.len());
    for ordinal in ordinals {
        if ordinal as i64 >= count as i64 {
            return Err(format!("device ordinal {ordinal} configured, but only {count} device(s) are visible"));
        }
        let ctx =
            CudaContext::new(ordinal as usize).map_err(|e| driver_error(&format!("device {ordinal}: context"), e))?;
        let uuid = ctx.uuid().map_err(|e| driver_error(&format!("device {ordinal}: uuid"), e))?;
        devices.push(CudaDevice { ordinal, ctx, uuid: uuid.bytes.map(|b| b as u8) });
    }
    Ok(devices)
}

/// Where a device pointer of this process lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PointerInfo {
    pub device_ordinal: u32,
    pub allocation_base: u64,
    pub allocation_len: u64,
}

fn pointer_attribute_i32(attribute: sys::CUpointer_attribute, ptr: u64) -> Result<i32, DriverError> {
    let mut value: i32 = 0;
    // SAFETY: both attributes queried here write one 32-bit integer.
    unsafe { sys::cuPointerGetAttribute(&mut value as *mut i32 as *mut c_void, attribute, ptr).result()? };
    Ok(value)
}

/// Checks that `ptr` is device memory of this process and finds its allocation.
pub fn inspect_device_pointer(ctx: &CudaContext, ptr: u64) -> Result<PointerInfo, String> {
    ctx.bind_to_thread().map_err(|e| driver_error("bind context", e))?;
    let memory_type = pointer_attribute_i32(sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr)
        .map_err(|e| driver_error("not a CUDA pointer of this process", e))?;
    if memory_type != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as i32 {
        return Err(format!("address {ptr:#x} is not device memory (CUmemorytype {memory_type})"));
    }
    let ordinal = pointer_attribute_i32(sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
        .map_err(|e| driver_error("device ordinal of pointer", e))?;
    let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
    // SAFETY: out-pointers to locals.
    unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr).result() }
        .map_err(|e| driver_error("cuMemGetAddressRange", e))?;
    Ok(PointerInfo { device_ordinal: ordinal as u32, allocation_base: base, allocation_len: size as u64 })
}

/// `cuIpcGetMemHandle` of an allocation base. Fails for memory that cannot be exported this way
/// (stream-ordered pools, VMM allocations).
pub fn export_ipc_handle(ctx: &CudaContext, allocation_base: u64) -> Result<[u8; IPC_HANDLE_BYTES], String> {
    ctx.bind_to_thread().map_err(|e| driver_error("bind context", e))?;
    let mut handle = sys::CUipcMemHandle { reserved: [0; IPC_HANDLE_BYTES] };
    // SAFETY: out-pointer to a local handle.
    unsafe { sys::cuIpcGetMemHandle(&mut handle, allocation_base).result() }
        .map_err(|e| driver_error("cuIpcGetMemHandle (memory from cuMemAlloc is required)", e))?;
    Ok(handle.reserved.map(|b| b as u8))
}

/// A peer's allocation mapped into this process with `cuIpcOpenMemHandle`; closed on drop (after
/// every transfer and key holding it let go).
pub struct IpcMapping {
    ctx: Arc<CudaContext>,
    pub base: u64,
    /// Size of the mapped allocation, as the driver reports it (`None` if it would not say).
    pub len: Option<u64>,
}

/// Mappings open in this process, by (handle, device ordinal): CUDA maps an allocation once per
/// context, and every instance of the plugin in a process shares the devices' primary contexts.
static OPEN_MAPPINGS: std::sync::Mutex<Vec<(MappingKey, std::sync::Weak<IpcMapping>)>> =
    std::sync::Mutex::new(Vec::new());

/// An IPC handle and the device ordinal of the context it is mapped in.
type MappingKey = ([u8; IPC_HANDLE_BYTES], u32);

impl IpcMapping {
    /// The mapping of `handle` in `ctx`, shared with every other holder in this process; opened on
    /// first use, closed when the last holder drops it.
    pub fn shared(ctx: &Arc<CudaContext>, handle: &[u8; IPC_HANDLE_BYTES]) -> Result<Arc<IpcMapping>, String> {
        let key = (*handle, ctx.ordinal() as u32);
        let mut open = OPEN_MAPPINGS.lock().unwrap_or_else(|p| p.into_inner());
        open.retain(|(_, weak)| weak.strong_count() > 0);
        if let Some(found) = open.iter().find(|(k, _)| *k == key).and_then(|(_, weak)| weak.upgrade()) {
            return Ok(found);
        }
        let mapping = Arc::new(IpcMapping::open(ctx, handle)?);
        open.push((key, Arc::downgrade(&mapping)));
        Ok(mapping)
    }

    fn open(ctx: &Arc<CudaContext>, handle: &[u8; IPC_HANDLE_BYTES]) -> Result<IpcMapping, String> {
        ctx.bind_to_thread().map_err(|e| driver_error("bind context", e))?;
        let raw = sys::CUipcMemHandle { reserved: handle.map(|b| b as std::ffi::c_char) };
        let mut base: sys::CUdeviceptr = 0;
        let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
        // SAFETY: out-pointer to a local; the handle is plain bytes the driver validates.
        unsafe { sys::cuIpcOpenMemHandle_v2(&mut base, raw, flags).result() }
            .map_err(|e| driver_error("cuIpcOpenMemHandle", e))?;
        let (mut range_base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: out-pointers to locals; `base` was just mapped.
        let len = match unsafe { sys::cuMemGetAddressRange_v2(&mut range_base, &mut size, base).result() } {
            Ok(()) => Some(size as u64),
            Err(e) => {
                // Not expected for IPC mappings; without a size, ranges are checked against the key only.
                tracing::warn!(base, "nvlink: cuMemGetAddressRange of an opened IPC handle failed: {e}");
                None
            }
        };
        Ok(IpcMapping { ctx: ctx.clone(), base, len })
    }

    /// Whether `offset + len` lies inside the mapped allocation (true when its size is unknown).
    pub fn fits(&self, offset: u64, len: u64) -> bool {
        offset.checked_add(len).is_some_and(|end| self.len.is_none_or(|size| end <= size))
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        if self.base == 0 {
            return;
        }
        // SAFETY: `base` came from cuIpcOpenMemHandle in this context and is closed once, here, when
        // the last holder of the mapping lets go.
        let closed = self.ctx.bind_to_thread().and_then(|()| unsafe { sys::cuIpcCloseMemHandle(self.base).result() });
        if let Err(e) = closed {
            tracing::warn!(base = self.base, "nvlink: cuIpcCloseMemHandle failed: {e}");
        }
    }
}

/// Copies on CUDA streams (one set per peer and device, created on first use), completion on
/// events taken from a per-device pool.
pub struct CudaBackend {
    devices: Vec<Arc<CudaContext>>,
    streams: HashMap<(u64, usize), Vec<Arc<CudaStream>>>,
    streams_per_peer: u32,
    spare_events: Vec<Vec<CudaEvent>>,
}

/// One issued copy: its completion event and the device it ran on.
pub struct CudaFence {
    event: CudaEvent,
    device_index: usize,
}

impl CudaBackend {
    pub fn new(devices: Vec<Arc<CudaContext>>, streams_per_peer: u32) -> CudaBackend {
        let spare_events = devices.iter().map(|_| Vec::new()).collect();
        CudaBackend { devices, streams: HashMap::new(), streams_per_peer, spare_events }
    }

    fn stream(&mut self, lane: Lane) -> Result<Arc<CudaStream>, DriverError> {
        let key = (lane.peer.0, lane.device_index);
        if !self.streams.contains_key(&key) {
            let ctx = &self.devices[lane.device_index];
            let streams = (0..self.streams_per_peer).map(|_| ctx.new_stream()).collect::<Result<Vec<_>, _>>()?;
            self.streams.insert(key, streams);
        }
        Ok(self.streams[&key][lane.stream as usize % self.streams_per_peer as usize].clone())
    }

    fn event(&mut self, device_index: usize) -> Result<CudaEvent, DriverError> {
        match self.spare_events[device_index].pop() {
            Some(e) => Ok(e),
            None => self.devices[device_index].new_event(None),
        }
    }

    /// Drops the streams of a peer that went away (work already queued on them still completes).
    pub fn forget_peer(&mut self, peer: u64) {
        self.streams.retain(|(p, _), _| *p != peer);
    }
}

impl CopyBackend for CudaBackend {
    type Fence = CudaFence;

    fn forget_peer(&mut self, peer: kvgate_abi::PeerId) {
        CudaBackend::forget_peer(self, peer.0)
    }

    fn issue(&mut self, op: &CopyOp, lane: Lane) -> Result<CudaFence, String> {
        let stream = self.stream(lane).map_err(|e| driver_error("create stream", e))?;
        let event = self.event(op.device_index).map_err(|e| driver_error("create event", e))?;
        self.devices[op.device_index].bind_to_thread().map_err(|e| driver_error("bind context", e))?;
        // SAFETY: src and dst were validated against live registrations/mappings that the transfer
        // holds until it is quiesced; the copy runs on a stream of the source's context.
        unsafe { result::memcpy_dtod_async(op.dst, op.src, op.len as usize, stream.cu_stream()) }
            .map_err(|e| driver_error("cuMemcpyDtoDAsync", e))?;
        event.record(&stream).map_err(|e| driver_error("cuEventRecord", e))?;
        Ok(CudaFence { event, device_index: op.device_index })
    }

    fn poll(&mut self, fence: &CudaFence) -> Result<bool, String> {
        fence.event.try_is_complete().map_err(|e| driver_error("cuEventQuery", e))
    }

    fn recycle(&mut self, fence: CudaFence) {
        self.spare_events[fence.device_index].push(fence.event);
    }
}
