//! The one process-wide setting the plugin may apply, and only when configured: glibc's malloc trim
//! threshold (`malloc_trim_threshold_bytes`). Never touches the allocator when the knob is 0.

/// Whether this build can apply `malloc_trim_threshold_bytes` (glibc targets only).
pub const TRIM_THRESHOLD_SUPPORTED: bool = cfg!(all(target_os = "linux", target_env = "gnu"));

/// Set glibc's `M_TRIM_THRESHOLD` to `bytes` (already validated). `Err` carries why it was not applied.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn set_malloc_trim_threshold(bytes: u64) -> Result<(), String> {
    let value = libc::c_int::try_from(bytes).map_err(|_| format!("{bytes} does not fit mallopt's int"))?;
    // SAFETY: mallopt only updates glibc's allocator parameters under its own lock.
    match unsafe { libc::mallopt(libc::M_TRIM_THRESHOLD, value) } {
        1 => Ok(()),
        _ => Err(format!("mallopt(M_TRIM_THRESHOLD, {bytes}) refused")),
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn set_malloc_trim_threshold(_bytes: u64) -> Result<(), String> {
    Err("this build does not use glibc's allocator".into())
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use super::*;

    #[test]
    fn glibc_accepts_the_threshold_within_the_config_range() {
        // The range of `malloc_trim_threshold_bytes` at both ends; the second call leaves glibc's
        // default back in place for the rest of this test process.
        assert_eq!(set_malloc_trim_threshold(crate::config::MAX_MALLOC_TRIM_THRESHOLD_BYTES), Ok(()));
        assert_eq!(set_malloc_trim_threshold(crate::config::MIN_MALLOC_TRIM_THRESHOLD_BYTES), Ok(()));
        assert!(set_malloc_trim_threshold(1 << 40).is_err());
    }
}
