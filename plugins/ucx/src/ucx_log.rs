//! Routes UCX's own log lines (by default printed to the process's *stdout*, where they can corrupt a
//! host's output) into `tracing`, once per process. Owns only that handler; fatal lines are left to
//! UCX's default handler, which aborts as UCX intends.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::Once;

/// `ucs_log_func_rc_t`.
const UCS_LOG_FUNC_RC_STOP: c_int = 0;
const UCS_LOG_FUNC_RC_CONTINUE: c_int = 1;
/// `ucs_log_level_t` values.
const UCS_LOG_LEVEL_FATAL: c_int = 0;
const UCS_LOG_LEVEL_ERROR: c_int = 1;
const UCS_LOG_LEVEL_WARN: c_int = 2;
/// Longest UCX log line kept (the rest is cut).
const LOG_LINE_BYTES: usize = 1024;

type LogHandler = unsafe extern "C" fn(
    file: *const c_char,
    line: c_uint,
    function: *const c_char,
    level: c_int,
    comp_conf: *const c_void,
    message: *const c_char,
    ap: *mut c_void,
) -> c_int;

extern "C" {
    fn ucs_log_push_handler(handler: LogHandler);
    // On x86_64 System V a `va_list` parameter is passed as a pointer to its one-element array.
    fn vsnprintf(buf: *mut c_char, size: usize, format: *const c_char, ap: *mut c_void) -> c_int;
}

unsafe extern "C" fn to_tracing(
    file: *const c_char,
    line: c_uint,
    _function: *const c_char,
    level: c_int,
    _comp_conf: *const c_void,
    message: *const c_char,
    ap: *mut c_void,
) -> c_int {
    if level == UCS_LOG_LEVEL_FATAL {
        return UCS_LOG_FUNC_RC_CONTINUE;
    }
    let mut buf = [0 as c_char; LOG_LINE_BYTES];
    vsnprintf(buf.as_mut_ptr(), buf.len(), message, ap);
    let text = CStr::from_ptr(buf.as_ptr()).to_string_lossy();
    let file = if file.is_null() { "?".into() } else { CStr::from_ptr(file).to_string_lossy() };
    match level {
        UCS_LOG_LEVEL_ERROR => tracing::error!(target: "ucx", "{file}:{line} {text}"),
        UCS_LOG_LEVEL_WARN => tracing::warn!(target: "ucx", "{file}:{line} {text}"),
        _ => tracing::debug!(target: "ucx", "{file}:{line} {text}"),
    }
    UCS_LOG_FUNC_RC_STOP
}

/// Install the handler (idempotent). Only on x86_64, where the `va_list` ABI above holds.
pub fn route_ucx_logs_to_tracing() {
    static ONCE: Once = Once::new();
    if cfg!(target_arch = "x86_64") {
        // SAFETY: the handler has the C signature UCX expects on x86_64 (checked by the `cfg!` above) and
        // lives for the whole program; pushing it is done once (`Once`).
        ONCE.call_once(|| unsafe { ucs_log_push_handler(to_tracing) });
    }
}
