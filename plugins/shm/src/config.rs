//! The shm plugin's config string: TOML, unknown keys refused, every limit named with its unit,
//! defaulted and range-checked here. A refusal is an `INVALID_ARGUMENT` error naming the key.
//! Never read from the environment or a file: the host hands the whole string to `open`.

use kvgate_abi::{PluginError, ReasonCode};
use serde::Deserialize;

/// Parsed and validated configuration of one shm plugin instance.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ShmConfig {
    /// Copy threads of the instance. Default 2, allowed 1..=64.
    pub workers: u32,
    /// Bytes one worker copies before it looks at cancellation and hands the rest of the transfer
    /// to the pool again. Default 1 MiB, allowed 4 KiB..=1 GiB.
    pub chunk_bytes: u64,
    /// Transfers submitted and not yet terminal (the bound of the work queue); a submit past it fails
    /// with `RESOURCE_EXHAUSTED`. Default 65 536 (a 10 000-transfer cancel storm fits), allowed
    /// 1..=1 048 576.
    pub max_inflight_transfers: u64,
    /// Segments one submit may carry. Default 1 048 576, allowed 1..=16 777 216.
    pub max_segments_per_submit: u64,
    /// Bytes one transfer may carry. Default 1 TiB, allowed 1..=2^48.
    pub max_transfer_bytes: u64,
    /// Pre-fault a peer's region once a transfer first writes into it (on a thread of its own,
    /// `MADV_POPULATE_WRITE`), so later copies into it take no page faults. Default false: a region
    /// is faulted in only where bytes land.
    pub populate_mappings: bool,
    /// Bytes of regions one peer may have imported at once (their files held open, mapped once
    /// written); an import past it is refused with `RESOURCE_EXHAUSTED`. Default 1 TiB, allowed
    /// 1 MiB..=2^48.
    pub max_import_bytes_per_peer: u64,
    /// Copy large transfers with non-temporal (streaming) stores, which write around the cache: the
    /// copying core does not read each destination line in before overwriting it, and the transfer
    /// does not evict the caches of the processes beside it. Default true.
    pub streaming_stores: bool,
    /// Transfers of at least this many bytes use streaming stores (when `streaming_stores`); smaller
    /// ones a plain memcpy, since their destination is likely still cached when it is read.
    /// Default 1 MiB, allowed 0..=2^48 (0 streams every transfer).
    pub streaming_stores_min_bytes: u64,
    /// A transfer of at most this many bytes (and at most `chunk_bytes`) submitted while no other
    /// chunk waits is copied by the submitting thread before `submit` returns, instead of waking a
    /// copy worker: for a small transfer the wake-ups (a worker's, then the caller's for the event)
    /// cost more than the copy. Default 64 KiB (a few microseconds of copying), allowed 0..=1 MiB
    /// (0: every transfer goes to the workers).
    pub inline_copy_bytes: u64,
}

pub const DEFAULT_WORKERS: u32 = 2;
pub const MAX_WORKERS: u32 = 64;
pub const DEFAULT_CHUNK_BYTES: u64 = 1 << 20;
pub const MIN_CHUNK_BYTES: u64 = 4 << 10;
pub const MAX_CHUNK_BYTES: u64 = 1 << 30;
pub const DEFAULT_MAX_INFLIGHT_TRANSFERS: u64 = 65_536;
pub const MAX_MAX_INFLIGHT_TRANSFERS: u64 = 1 << 20;
pub const DEFAULT_MAX_SEGMENTS_PER_SUBMIT: u64 = 1 << 20;
pub const MAX_MAX_SEGMENTS_PER_SUBMIT: u64 = 1 << 24;
pub const DEFAULT_MAX_TRANSFER_BYTES: u64 = 1 << 40;
pub const MAX_MAX_TRANSFER_BYTES: u64 = 1 << 48;
pub const DEFAULT_MAX_IMPORT_BYTES_PER_PEER: u64 = 1 << 40;
pub const MIN_MAX_IMPORT_BYTES_PER_PEER: u64 = 1 << 20;
pub const MAX_MAX_IMPORT_BYTES_PER_PEER: u64 = 1 << 48;
pub const DEFAULT_STREAMING_STORES_MIN_BYTES: u64 = 1 << 20;
pub const MAX_STREAMING_STORES_MIN_BYTES: u64 = 1 << 48;
pub const DEFAULT_INLINE_COPY_BYTES: u64 = 64 << 10;
pub const MAX_INLINE_COPY_BYTES: u64 = 1 << 20;

impl Default for ShmConfig {
    fn default() -> Self {
        ShmConfig {
            workers: DEFAULT_WORKERS,
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            max_inflight_transfers: DEFAULT_MAX_INFLIGHT_TRANSFERS,
            max_segments_per_submit: DEFAULT_MAX_SEGMENTS_PER_SUBMIT,
            max_transfer_bytes: DEFAULT_MAX_TRANSFER_BYTES,
            populate_mappings: false,
            max_import_bytes_per_peer: DEFAULT_MAX_IMPORT_BYTES_PER_PEER,
            streaming_stores: true,
            streaming_stores_min_bytes: DEFAULT_STREAMING_STORES_MIN_BYTES,
            inline_copy_bytes: DEFAULT_INLINE_COPY_BYTES,
        }
    }
}

impl ShmConfig {
    /// Parse a TOML config string (empty means every default) and check every limit.
    // CONFORMANCE: HYGIENE-3
    pub fn parse(text: &str) -> Result<ShmConfig, PluginError> {
        let config: ShmConfig =
            toml::from_str(text).map_err(|e| invalid(format!("shm config: {}", e.message().trim_end())))?;
        config.validate()?;
        Ok(config)
    }

    /// Check every limit against its allowed range; the error names the key and the range.
    pub fn validate(&self) -> Result<(), PluginError> {
        check_range("workers", self.workers as u64, 1, MAX_WORKERS as u64)?;
        check_range("chunk_bytes", self.chunk_bytes, MIN_CHUNK_BYTES, MAX_CHUNK_BYTES)?;
        check_range("max_inflight_transfers", self.max_inflight_transfers, 1, MAX_MAX_INFLIGHT_TRANSFERS)?;
        check_range("max_segments_per_submit", self.max_segments_per_submit, 1, MAX_MAX_SEGMENTS_PER_SUBMIT)?;
        check_range("max_transfer_bytes", self.max_transfer_bytes, 1, MAX_MAX_TRANSFER_BYTES)?;
        check_range(
            "max_import_bytes_per_peer",
            self.max_import_bytes_per_peer,
            MIN_MAX_IMPORT_BYTES_PER_PEER,
            MAX_MAX_IMPORT_BYTES_PER_PEER,
        )?;
        check_range("streaming_stores_min_bytes", self.streaming_stores_min_bytes, 0, MAX_STREAMING_STORES_MIN_BYTES)?;
        check_range("inline_copy_bytes", self.inline_copy_bytes, 0, MAX_INLINE_COPY_BYTES)?;
        Ok(())
    }

    /// Whether a transfer of `total_bytes` may be copied by the submitting thread.
    pub fn copies_inline(&self, total_bytes: u64) -> bool {
        self.inline_copy_bytes > 0 && total_bytes <= self.inline_copy_bytes.min(self.chunk_bytes)
    }

    /// Whether a transfer of `total_bytes` is copied with streaming stores.
    pub fn streams(&self, total_bytes: u64) -> bool {
        self.streaming_stores && total_bytes >= self.streaming_stores_min_bytes
    }
}

fn check_range(key: &str, value: u64, min: u64, max: u64) -> Result<(), PluginError> {
    if value < min || value > max {
        return Err(invalid(format!("shm config: {key} = {value} is outside {min}..={max}")));
    }
    Ok(())
}

fn invalid(message: String) -> PluginError {
    PluginError::new(ReasonCode::INVALID_ARGUMENT, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_config_gives_defaults() {
        assert_eq!(ShmConfig::parse("").unwrap(), ShmConfig::default());
    }

    #[test]
    fn every_key_parses() {
        let c = ShmConfig::parse(
            "workers = 3\nchunk_bytes = 8192\nmax_inflight_transfers = 7\nmax_segments_per_submit = 9\n\
             max_transfer_bytes = 100\npopulate_mappings = false\nstreaming_stores = false\n\
             streaming_stores_min_bytes = 65536",
        )
        .unwrap();
        assert_eq!((c.streaming_stores, c.streaming_stores_min_bytes), (false, 65536));
        assert_eq!((c.workers, c.chunk_bytes, c.max_inflight_transfers), (3, 8192, 7));
        assert_eq!((c.max_segments_per_submit, c.max_transfer_bytes, c.populate_mappings), (9, 100, false));
    }

    #[test]
    fn unknown_key_is_refused_by_name() {
        let e = ShmConfig::parse("worker = 2").unwrap_err();
        assert_eq!(e.code, ReasonCode::INVALID_ARGUMENT);
        assert!(e.message.contains("worker"), "{e}");
    }

    #[test]
    fn wrong_type_is_refused_by_name() {
        let e = ShmConfig::parse("chunk_bytes = \"big\"").unwrap_err();
        assert_eq!(e.code, ReasonCode::INVALID_ARGUMENT);
        assert!(e.message.contains("invalid type"), "{e}");
    }

    /// Each limit is accepted at both ends of its range and refused just past them, naming the key.
    #[test]
    fn every_limit_at_and_past_its_bounds() {
        type Setter = fn(&mut ShmConfig, u64);
        let limits: [(&str, u64, u64, Setter); 7] = [
            ("workers", 1, MAX_WORKERS as u64, |c, v| c.workers = v as u32),
            ("chunk_bytes", MIN_CHUNK_BYTES, MAX_CHUNK_BYTES, |c, v| c.chunk_bytes = v),
            ("max_inflight_transfers", 1, MAX_MAX_INFLIGHT_TRANSFERS, |c, v| c.max_inflight_transfers = v),
            ("max_segments_per_submit", 1, MAX_MAX_SEGMENTS_PER_SUBMIT, |c, v| c.max_segments_per_submit = v),
            ("max_transfer_bytes", 1, MAX_MAX_TRANSFER_BYTES, |c, v| c.max_transfer_bytes = v),
            ("streaming_stores_min_bytes", 0, MAX_STREAMING_STORES_MIN_BYTES, |c, v| c.streaming_stores_min_bytes = v),
            ("inline_copy_bytes", 0, MAX_INLINE_COPY_BYTES, |c, v| c.inline_copy_bytes = v),
        ];
        for (key, min, max, set) in limits {
            for ok in [min, max] {
                let mut c = ShmConfig::default();
                set(&mut c, ok);
                assert!(c.validate().is_ok(), "{key} = {ok} must be accepted");
            }
            for bad in [min.checked_sub(1), Some(max + 1)].into_iter().flatten() {
                let mut c = ShmConfig::default();
                set(&mut c, bad);
                let e = c.validate().unwrap_err();
                assert_eq!(e.code, ReasonCode::INVALID_ARGUMENT);
                assert!(e.message.contains(key), "{key} = {bad}: {e}");
            }
        }
    }

    /// The threshold is inclusive, and `streaming_stores = false` turns streaming off at any size.
    #[test]
    fn streaming_applies_at_and_above_the_threshold_only() {
        let c = ShmConfig::default();
        assert!(!c.streams(DEFAULT_STREAMING_STORES_MIN_BYTES - 1));
        assert!(c.streams(DEFAULT_STREAMING_STORES_MIN_BYTES));
        let every = ShmConfig { streaming_stores_min_bytes: 0, ..ShmConfig::default() };
        assert!(every.streams(0));
        let off = ShmConfig { streaming_stores: false, streaming_stores_min_bytes: 0, ..ShmConfig::default() };
        assert!(!off.streams(1 << 40));
        assert!(ShmConfig::parse("streaming_stores_min_bytes = -1").is_err());
    }

    /// Inline up to the smaller of the two bounds, inclusive; 0 never (a zero-byte transfer has
    /// nothing to copy either way).
    #[test]
    fn inline_copies_stop_at_the_bound_and_at_the_chunk_size() {
        let c = ShmConfig::default();
        assert!(c.copies_inline(DEFAULT_INLINE_COPY_BYTES));
        assert!(!c.copies_inline(DEFAULT_INLINE_COPY_BYTES + 1));
        let small_chunks = ShmConfig { chunk_bytes: 8192, ..ShmConfig::default() };
        assert!(small_chunks.copies_inline(8192) && !small_chunks.copies_inline(8193));
        let off = ShmConfig { inline_copy_bytes: 0, ..ShmConfig::default() };
        assert!(!off.copies_inline(1) && !off.copies_inline(0));
    }

    #[test]
    fn limits_parse_through_toml_too() {
        let e = ShmConfig::parse("workers = 0").unwrap_err();
        assert!(e.message.contains("workers = 0"), "{e}");
        let e = ShmConfig::parse("workers = 65").unwrap_err();
        assert!(e.message.contains("workers = 65"), "{e}");
        assert_eq!(ShmConfig::parse("workers = 64").unwrap().workers, 64);
    }
}
