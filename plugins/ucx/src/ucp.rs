//! A small safe wrapper over the UCP calls the plugin uses: context, worker, endpoint, memory map,
//! remote keys, and the request parameters of the `_nbx` calls. Owns UCX handles and their release
//! order; never decides transfer policy. Worker and endpoint calls belong to the progress thread only.

use kvgate_ucx_sys as sys;
use std::ffi::{c_void, CStr, CString};
use std::sync::Arc;

pub use sys::{ucp_ep_h, ucp_mem_h, ucp_rkey_h, ucs_status_t};

/// UCX's own text for a status (`"No such device"`, ...).
pub fn status_text(status: ucs_status_t) -> String {
    // SAFETY: ucs_status_string accepts any status and returns a static string or null (checked).
    unsafe {
        let text = sys::ucs_status_string(status);
        if text.is_null() {
            format!("ucs status {}", status.0)
        } else {
            CStr::from_ptr(text).to_string_lossy().into_owned()
        }
    }
}

pub fn is_ok(status: ucs_status_t) -> bool {
    status == ucs_status_t::UCS_OK
}

/// A UCX error: the call that failed and UCX's status.
#[derive(Debug, Clone)]
pub struct UcxError {
    pub call: &'static str,
    pub status: ucs_status_t,
}

impl std::fmt::Display for UcxError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} failed: {} ({})", self.call, status_text(self.status), self.status.0)
    }
}

fn check(call: &'static str, status: ucs_status_t) -> Result<(), UcxError> {
    if is_ok(status) {
        Ok(())
    } else {
        Err(UcxError { call, status })
    }
}

/// `ucp_config_t` while it is being filled; released on drop.
pub struct Config(*mut sys::ucp_config_t);

impl Config {
    /// Read UCX's defaults and the `UCX_*` environment.
    pub fn read() -> Result<Config, UcxError> {
        let mut config = std::ptr::null_mut();
        // SAFETY: null prefix and file name read UCX's defaults and the environment; `config` is an out-
        // pointer on the stack, released by `Drop`.
        check("ucp_config_read", unsafe { sys::ucp_config_read(std::ptr::null(), std::ptr::null(), &mut config) })?;
        Ok(Config(config))
    }

    /// `ucp_config_modify(name, value)`; a bad name or value is UCX's error.
    pub fn modify(&mut self, name: &str, value: &str) -> Result<(), UcxError> {
        let name = CString::new(name)
            .map_err(|_| UcxError { call: "ucp_config_modify", status: ucs_status_t::UCS_ERR_INVALID_PARAM })?;
        let value = CString::new(value)
            .map_err(|_| UcxError { call: "ucp_config_modify", status: ucs_status_t::UCS_ERR_INVALID_PARAM })?;
        // SAFETY: `self.0` is a live config (released only on drop); the names are NUL-terminated CStrings
        // that outlive the call.
        check("ucp_config_modify", unsafe { sys::ucp_config_modify(self.0, name.as_ptr(), value.as_ptr()) })
    }
}

impl Drop for Config {
    fn drop(&mut self) {
        // SAFETY: `self.0` came from ucp_config_read and is released once, here.
        unsafe { sys::ucp_config_release(self.0) }
    }
}

/// A UCP context (features: AM, RMA, wakeup; workers may share it across threads).
pub struct Context(sys::ucp_context_h);

// SAFETY: the context is created with `mt_workers_shared`, so the calls made on it from any thread (mem_map,
// rkey_pack, mem_unmap) are thread-safe in UCX.
unsafe impl Send for Context {}
// SAFETY: as for `Send`: UCX serialises its own context calls under `mt_workers_shared`; the handle itself is
// never mutated from Rust.
unsafe impl Sync for Context {}

impl Context {
    pub fn new(config: &Config) -> Result<Arc<Context>, UcxError> {
        let params = sys::ucp_params_t {
            field_mask: (sys::ucp_params_field::UCP_PARAM_FIELD_FEATURES
                | sys::ucp_params_field::UCP_PARAM_FIELD_MT_WORKERS_SHARED
                | sys::ucp_params_field::UCP_PARAM_FIELD_NAME)
                .0 as u64,
            features: (sys::ucp_feature::UCP_FEATURE_AM
                | sys::ucp_feature::UCP_FEATURE_RMA
                | sys::ucp_feature::UCP_FEATURE_WAKEUP)
                .0 as u64,
            mt_workers_shared: 1,
            name: c"kvgate-ucx".as_ptr(),
            ..Default::default()
        };
        let mut context = std::ptr::null_mut();
        // SAFETY: `params` and the config are valid for the call (the config outlives it); `context` is an
        // out-pointer on the stack, cleaned up by `Drop`.
        check("ucp_init", unsafe {
            sys::ucp_init_version(sys::UCP_API_MAJOR, sys::UCP_API_MINOR, &params, config.0, &mut context)
        })?;
        Ok(Arc::new(Context(context)))
    }

    /// Register `len` bytes at `addr` with UCX and pack its remote key.
    pub fn map(self: &Arc<Self>, addr: u64, len: u64) -> Result<MemMap, UcxError> {
        let params = sys::ucp_mem_map_params_t {
            field_mask: (sys::ucp_mem_map_params_field::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | sys::ucp_mem_map_params_field::UCP_MEM_MAP_PARAM_FIELD_LENGTH)
                .0 as u64,
            address: addr as *mut c_void,
            length: len as usize,
            ..Default::default()
        };
        let mut memh = std::ptr::null_mut();
        // SAFETY: `self.0` is a live context; the range was checked by the caller to be a registered host
        // region of the caller's; `memh` is an out-pointer, unmapped by `MemMap`'s `Drop`.
        check("ucp_mem_map", unsafe { sys::ucp_mem_map(self.0, &params, &mut memh) })?;
        let mut buffer = std::ptr::null_mut();
        let mut size = 0usize;
        // SAFETY: `memh` was mapped just above on this context; `buffer` and `size` are out-pointers, the
        // buffer released below.
        let packed = unsafe { sys::ucp_rkey_pack(self.0, memh, &mut buffer, &mut size) };
        if !is_ok(packed) {
            // SAFETY: `memh` was mapped just above on this context and is unmapped once, here, since no
            // `MemMap` owns it.
            unsafe { sys::ucp_mem_unmap(self.0, memh) };
            return Err(UcxError { call: "ucp_rkey_pack", status: packed });
        }
        // SAFETY: ucp_rkey_pack returned OK, so `buffer` holds `size` bytes; they are copied before the
        // buffer is released below.
        let rkey = unsafe { std::slice::from_raw_parts(buffer as *const u8, size).to_vec() };
        // SAFETY: `buffer` came from ucp_rkey_pack and is released once, after its bytes were copied.
        unsafe { sys::ucp_rkey_buffer_release(buffer) };
        Ok(MemMap { context: self.clone(), memh, packed_rkey: rkey })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: `self.0` is the live context, cleaned up once when its last `Arc` drops (after every worker
        // and map holding it).
        unsafe { sys::ucp_cleanup(self.0) }
    }
}

/// A registered memory range; unmapped when the last holder drops it.
pub struct MemMap {
    context: Arc<Context>,
    pub memh: ucp_mem_h,
    pub packed_rkey: Vec<u8>,
}

// SAFETY: a memory handle is an opaque registration that UCX lets any thread use and unmap (the context is
// `mt_workers_shared`); `MemMap` never mutates it.
unsafe impl Send for MemMap {}
// SAFETY: as for `Send`: shared references only read `memh` and the packed key.
unsafe impl Sync for MemMap {}

impl Drop for MemMap {
    fn drop(&mut self) {
        // SAFETY: `memh` was mapped on this context (held alive by `self.context`) and is unmapped once, when
        // the last holder drops the map.
        unsafe { sys::ucp_mem_unmap(self.context.0, self.memh) };
    }
}

/// A UCP worker (single-threaded: only the progress thread touches it after `new`).
pub struct Worker {
    pub raw: sys::ucp_worker_h,
    _context: Arc<Context>,
}

// SAFETY: a worker is single-threaded (`UCS_THREAD_MODE_SINGLE`): it is created on the opening thread and
// then moved once into the progress thread, the only one that uses it afterwards; it is never shared
// (`Worker` is not `Sync`).
unsafe impl Send for Worker {}

impl Worker {
    pub fn new(context: &Arc<Context>) -> Result<Worker, UcxError> {
        let params = sys::ucp_worker_params_t {
            field_mask: (sys::ucp_worker_params_field::UCP_WORKER_PARAM_FIELD_THREAD_MODE
                | sys::ucp_worker_params_field::UCP_WORKER_PARAM_FIELD_EVENTS)
                .0 as u64,
            thread_mode: sys::ucs_thread_mode_t::UCS_THREAD_MODE_SINGLE,
            events: (sys::ucp_wakeup_event_types::UCP_WAKEUP_RX.0
                | sys::ucp_wakeup_event_types::UCP_WAKEUP_TX.0
                | sys::ucp_wakeup_event_types::UCP_WAKEUP_RMA.0) as _,
            ..Default::default()
        };
        let mut worker = std::ptr::null_mut();
        // SAFETY: `context.0` is a live context (kept alive by the worker's `Arc`); `params` is valid for the
        // call; `worker` is an out-pointer, destroyed by `Drop`.
        check("ucp_worker_create", unsafe { sys::ucp_worker_create(context.0, &params, &mut worker) })?;
        Ok(Worker { raw: worker, _context: context.clone() })
    }

    /// The worker's address, the bytes a peer's `ucp_ep_create` needs.
    pub fn address(&self) -> Result<Vec<u8>, UcxError> {
        let mut address = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: `self.raw` is a live worker; `address` and `len` are out-pointers, the address released
        // below.
        check("ucp_worker_get_address", unsafe { sys::ucp_worker_get_address(self.raw, &mut address, &mut len) })?;
        // SAFETY: ucp_worker_get_address returned OK, so `address` holds `len` bytes; they are copied before
        // it is released.
        let bytes = unsafe { std::slice::from_raw_parts(address as *const u8, len).to_vec() };
        // SAFETY: `address` came from ucp_worker_get_address on this worker and is released once, here.
        unsafe { sys::ucp_worker_release_address(self.raw, address) };
        Ok(bytes)
    }

    pub fn event_fd(&self) -> Result<i32, UcxError> {
        let mut fd = -1;
        // SAFETY: `self.raw` is a live worker created with wakeup events; `fd` is an out-pointer on the stack
        // (the descriptor stays owned by UCX).
        check("ucp_worker_get_efd", unsafe { sys::ucp_worker_get_efd(self.raw, &mut fd) })?;
        Ok(fd)
    }

    /// `ucp_worker_arm`: `Ok(true)` armed (safe to sleep), `Ok(false)` events pending (progress again).
    pub fn arm(&self) -> Result<bool, UcxError> {
        // SAFETY: `self.raw` is a live worker, used only by the thread that owns it.
        let status = unsafe { sys::ucp_worker_arm(self.raw) };
        if status == ucs_status_t::UCS_ERR_BUSY {
            return Ok(false);
        }
        check("ucp_worker_arm", status).map(|_| true)
    }

    /// One round of progress; the number of events it handled.
    pub fn progress(&self) -> u32 {
        // SAFETY: `self.raw` is a live worker, progressed only by the thread that owns it (single-thread
        // mode).
        unsafe { sys::ucp_worker_progress(self.raw) }
    }

    pub fn set_am_handler(&self, id: u32, cb: sys::ucp_am_recv_callback_t, arg: *mut c_void) -> Result<(), UcxError> {
        let params = sys::ucp_am_handler_param_t {
            field_mask: (sys::ucp_am_handler_param_field::UCP_AM_HANDLER_PARAM_FIELD_ID
                | sys::ucp_am_handler_param_field::UCP_AM_HANDLER_PARAM_FIELD_CB
                | sys::ucp_am_handler_param_field::UCP_AM_HANDLER_PARAM_FIELD_ARG
                | sys::ucp_am_handler_param_field::UCP_AM_HANDLER_PARAM_FIELD_FLAGS)
                .0 as u64,
            id,
            cb,
            arg,
            flags: sys::ucp_am_cb_flags::UCP_AM_FLAG_WHOLE_MSG.0,
        };
        // SAFETY: `self.raw` is a live worker; the callback and its argument stay valid for the worker's life
        // (the argument is the engine's boxed receiver, which outlives the worker's progress).
        check("ucp_worker_set_am_recv_handler", unsafe { sys::ucp_worker_set_am_recv_handler(self.raw, &params) })
    }

    /// Create an endpoint to a worker address; never waits for the network. `err_arg` comes back in
    /// `err_cb` when the peer fails.
    /// `peer_failure_handling` asks UCX for peer-failure detection (`UCP_ERR_HANDLING_MODE_PEER`);
    /// UCX 1.13's shared-memory transports cannot provide it.
    pub fn connect(
        &self,
        address: &[u8],
        peer_failure_handling: bool,
        err_cb: sys::ucp_err_handler_cb_t,
        err_arg: u64,
    ) -> Result<ucp_ep_h, UcxError> {
        // SAFETY: an all-zero `ucp_ep_params_t` is valid (no field selected); the fields used are set below
        // and named in `field_mask`.
        let mut params: sys::ucp_ep_params_t = unsafe { std::mem::zeroed() };
        params.field_mask = (sys::ucp_ep_params_field::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
            | sys::ucp_ep_params_field::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
            | sys::ucp_ep_params_field::UCP_EP_PARAM_FIELD_ERR_HANDLER)
            .0 as u64;
        params.address = address.as_ptr() as *const sys::ucp_address_t;
        params.err_mode = if peer_failure_handling {
            sys::ucp_err_handling_mode_t::UCP_ERR_HANDLING_MODE_PEER
        } else {
            sys::ucp_err_handling_mode_t::UCP_ERR_HANDLING_MODE_NONE
        };
        params.err_handler = sys::ucp_err_handler_t { cb: err_cb, arg: err_arg as *mut c_void };
        let mut ep = std::ptr::null_mut();
        // SAFETY: `self.raw` is a live worker; `params.address` points into `address`, which outlives the
        // call (UCX copies what it keeps); `ep` is an out-pointer.
        check("ucp_ep_create", unsafe { sys::ucp_ep_create(self.raw, &params, &mut ep) })?;
        Ok(ep)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // SAFETY: `self.raw` is destroyed once, here, after the engine stopped progressing it and closed its
        // endpoints.
        unsafe { sys::ucp_worker_destroy(self.raw) }
    }
}

/// What an `_nbx` call returned.
pub enum Posted {
    /// Completed at once (no callback will come).
    Done,
    /// In flight: the callback will fire with `user_data`; free the request after it did.
    Pending(*mut c_void),
    Failed(ucs_status_t),
}

pub fn classify(ptr: *mut c_void) -> Posted {
    if ptr.is_null() {
        Posted::Done
    } else if sys::ucs_ptr_is_err(ptr) {
        Posted::Failed(sys::ucs_ptr_status(ptr))
    } else {
        Posted::Pending(ptr)
    }
}

/// Request parameters with a send-completion callback, `user_data` and optional flags/memh.
pub fn send_param(
    cb: sys::ucp_send_nbx_callback_t,
    user_data: u64,
    flags: u32,
    memh: ucp_mem_h,
) -> sys::ucp_request_param_t {
    // SAFETY: an all-zero `ucp_request_param_t` is valid (no attribute selected); the attributes used are set
    // below and named in `op_attr_mask`.
    let mut param: sys::ucp_request_param_t = unsafe { std::mem::zeroed() };
    let mut mask = sys::ucp_op_attr_t::UCP_OP_ATTR_FIELD_CALLBACK | sys::ucp_op_attr_t::UCP_OP_ATTR_FIELD_USER_DATA;
    if flags != 0 {
        mask |= sys::ucp_op_attr_t::UCP_OP_ATTR_FIELD_FLAGS;
        param.flags = flags;
    }
    if !memh.is_null() {
        mask |= sys::ucp_op_attr_t::UCP_OP_ATTR_FIELD_MEMH;
        param.memh = memh;
    }
    param.op_attr_mask = mask.0;
    param.cb.send = cb;
    param.user_data = user_data as *mut c_void;
    param
}

/// Request parameters for `ucp_am_recv_data_nbx`.
pub fn recv_am_param(
    cb: sys::ucp_am_recv_data_nbx_callback_t,
    user_data: u64,
    memh: ucp_mem_h,
) -> sys::ucp_request_param_t {
    // SAFETY: an all-zero `ucp_request_param_t` is valid (no attribute selected); the attributes used are set
    // below and named in `op_attr_mask`.
    let mut param: sys::ucp_request_param_t = unsafe { std::mem::zeroed() };
    let mut mask = sys::ucp_op_attr_t::UCP_OP_ATTR_FIELD_CALLBACK | sys::ucp_op_attr_t::UCP_OP_ATTR_FIELD_USER_DATA;
    if !memh.is_null() {
        mask |= sys::ucp_op_attr_t::UCP_OP_ATTR_FIELD_MEMH;
        param.memh = memh;
    }
    param.op_attr_mask = mask.0;
    param.cb.recv_am = cb;
    param.user_data = user_data as *mut c_void;
    param
}

/// Start closing an endpoint: by force (pending operations complete with an error; only for
/// endpoints with peer-failure handling), or by flushing what is outstanding.
///
/// # Safety
/// `ep` is a live endpoint of the worker this thread progresses, not closed before.
pub unsafe fn close_ep(ep: ucp_ep_h, force: bool, cb: sys::ucp_send_nbx_callback_t, user_data: u64) -> Posted {
    let flags = if force { sys::ucp_ep_close_flags_t::UCP_EP_CLOSE_FLAG_FORCE.0 } else { 0 };
    let param = send_param(cb, user_data, flags, std::ptr::null_mut());
    // SAFETY: the caller guarantees `ep` is a live endpoint of the worker this thread progresses, closed
    // once; `param` is valid for the call.
    classify(unsafe { sys::ucp_ep_close_nbx(ep, &param) })
}

/// # Safety
/// `request` is a request UCX returned to this thread and that has not been freed.
pub unsafe fn request_free(request: *mut c_void) {
    // SAFETY: the caller guarantees `request` came from UCX on this thread and is freed once.
    unsafe { sys::ucp_request_free(request) }
}

/// # Safety
/// `request` is a live (not yet freed) request of `worker`.
pub unsafe fn request_cancel(worker: &Worker, request: *mut c_void) {
    // SAFETY: the caller guarantees `request` is live (not freed) and belongs to `worker`.
    unsafe { sys::ucp_request_cancel(worker.raw, request) }
}

/// # Safety
/// `ep` is a live endpoint of the worker this thread progresses.
pub unsafe fn rkey_unpack(ep: ucp_ep_h, packed: &[u8]) -> Result<ucp_rkey_h, UcxError> {
    let mut rkey = std::ptr::null_mut();
    // SAFETY: the caller guarantees `ep` is live; `packed` is valid for the call (UCX copies what it keeps);
    // `rkey` is an out-pointer.
    check("ucp_ep_rkey_unpack", unsafe { sys::ucp_ep_rkey_unpack(ep, packed.as_ptr() as *const c_void, &mut rkey) })?;
    Ok(rkey)
}

/// # Safety
/// `rkey` came from [`rkey_unpack`] and is destroyed once, with no operation using it in flight.
pub unsafe fn rkey_destroy(rkey: ucp_rkey_h) {
    // SAFETY: the caller guarantees `rkey` came from `rkey_unpack`, is destroyed once, and no operation uses
    // it.
    unsafe { sys::ucp_rkey_destroy(rkey) }
}

pub fn version() -> String {
    // SAFETY: ucp_get_version_string returns a static NUL-terminated string.
    unsafe { CStr::from_ptr(sys::ucp_get_version_string()).to_string_lossy().into_owned() }
}

pub use sys::{
    ucp_am_data_release, ucp_am_recv_data_nbx, ucp_am_recv_param_t, ucp_am_send_nbx, ucp_ep_flush_nbx, ucp_put_nbx,
};
pub use sys::{ucp_am_recv_attr_t, ucp_send_am_flags};
