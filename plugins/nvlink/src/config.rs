//! The NVLink plugin's configuration: parsed from the TOML string given to `open`, every key
//! named, bounded and defaulted here. Owns parsing and validation only; never touches CUDA.

use kvgate_abi::{PluginError, ReasonCode};
use serde::Deserialize;

/// Every tunable of one plugin instance. Unknown keys are refused (a typo must not fall back to a
/// default silently). Each limit has its unit in its name and a documented default.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NvlinkConfig {
    /// CUDA device ordinals (as this process sees them) the instance serves. Default `[]`: every
    /// visible device. Regions on other devices are refused at `register`.
    pub devices: Vec<u32>,
    /// Copy streams the instance creates per (peer, local device). Default 2, 1..=32.
    pub streams_per_peer: u32,
    /// Largest single copy; larger segments are split so a cancel takes effect between chunks.
    /// Default 16 MiB, 64 KiB..=1 GiB.
    pub chunk_bytes: u64,
    /// Chunks of one transfer queued on the GPU at once (bounds the bytes that still land after a
    /// cancel: this many chunks). Default 4, 1..=64.
    pub max_copies_in_flight_per_transfer: u32,
    /// Outgoing transfers submitted and not yet quiesced; a submit past it fails with
    /// `RESOURCE_EXHAUSTED`. Default 4096, 1..=1_000_000.
    pub max_inflight_transfers: u64,
    /// Segments one submit may carry. Default 65536, 1..=16_777_216.
    pub max_segments_per_submit: u64,
    /// Largest transfer in bytes. Default 64 GiB, 1..=2^50.
    pub max_transfer_bytes: u64,
    /// Regions registered at once. Default 65536, 1..=1_000_000.
    pub max_registered_regions: u64,
    /// Remote keys imported at once. Default 65536, 1..=1_000_000.
    pub max_imported_remote_keys: u64,
    /// Peers connected at once. Default 256, 1..=65536.
    pub max_peers: u64,
    /// After the last progress, the completion poller yields (no sleep) for this long before it
    /// starts sleeping. Default 20 µs, 0..=1000.
    pub poll_spin_us: u64,
    /// Longest sleep of the completion poller between two polls while copies are in flight (the
    /// sleep doubles from 1 µs up to this). Default 200 µs, 1..=100_000.
    pub poll_max_sleep_us: u64,
    /// How long `shutdown` waits for copies already on the GPU to finish before it gives up on
    /// them (their transfers are failed either way). Default 5000 ms, 1..=600_000.
    pub shutdown_drain_ms: u64,
    /// CUDA VMM descriptors served to same-host peers: how long either side of one request on the
    /// instance's descriptor socket may take (the server waits this long for a request, an importer
    /// this long for the answer). Default 5000 ms, 1..=60_000.
    pub vmm_fd_request_timeout_ms: u64,
}

impl Default for NvlinkConfig {
    fn default() -> Self {
        NvlinkConfig {
            devices: Vec::new(),
            streams_per_peer: 2,
            chunk_bytes: 16 << 20,
            max_copies_in_flight_per_transfer: 4,
            max_inflight_transfers: 4096,
            max_segments_per_submit: 65536,
            max_transfer_bytes: 64 << 30,
            max_registered_regions: 65536,
            max_imported_remote_keys: 65536,
            max_peers: 256,
            poll_spin_us: 20,
            poll_max_sleep_us: 200,
            shutdown_drain_ms: 5000,
            vmm_fd_request_timeout_ms: 5000,
        }
    }
}

/// The inclusive bounds of every numeric key, checked after parsing.
pub const BOUNDS: &[(&str, u64, u64)] = &[
    ("streams_per_peer", 1, 32),
    ("chunk_bytes", 64 << 10, 1 << 30),
    ("max_copies_in_flight_per_transfer", 1, 64),
    ("max_inflight_transfers", 1, 1_000_000),
    ("max_segments_per_submit", 1, 16_777_216),
    ("max_transfer_bytes", 1, 1 << 50),
    ("max_registered_regions", 1, 1_000_000),
    ("max_imported_remote_keys", 1, 1_000_000),
    ("max_peers", 1, 65536),
    ("poll_spin_us", 0, 1000),
    ("poll_max_sleep_us", 1, 100_000),
    ("shutdown_drain_ms", 1, 600_000),
    ("vmm_fd_request_timeout_ms", 1, 60_000),
];

/// Most device ordinals one instance may list.
pub const MAX_DEVICES: usize = 64;

impl NvlinkConfig {
    /// Parse and validate. Errors are `INVALID_ARGUMENT` and name the offending key.
    pub fn parse(text: &str) -> Result<NvlinkConfig, PluginError> {
        let config: NvlinkConfig = toml::from_str(text).map_err(|e| invalid(describe_toml_error(text, &e)))?;
        config.validate()?;
        Ok(config)
    }

    fn value_of(&self, key: &str) -> u64 {
        match key {
            "streams_per_peer" => self.streams_per_peer as u64,
            "chunk_bytes" => self.chunk_bytes,
            "max_copies_in_flight_per_transfer" => self.max_copies_in_flight_per_transfer as u64,
            "max_inflight_transfers" => self.max_inflight_transfers,
            "max_segments_per_submit" => self.max_segments_per_submit,
            "max_transfer_bytes" => self.max_transfer_bytes,
            "max_registered_regions" => self.max_registered_regions,
            "max_imported_remote_keys" => self.max_imported_remote_keys,
            "max_peers" => self.max_peers,
            "poll_spin_us" => self.poll_spin_us,
            "poll_max_sleep_us" => self.poll_max_sleep_us,
            "shutdown_drain_ms" => self.shutdown_drain_ms,
            "vmm_fd_request_timeout_ms" => self.vmm_fd_request_timeout_ms,
            other => unreachable!("BOUNDS names unknown key {other}"),
        }
    }

    /// Check every bound; the first violation is reported with its key and the allowed range.
    pub fn validate(&self) -> Result<(), PluginError> {
        for &(key, min, max) in BOUNDS {
            let value = self.value_of(key);
            if value < min || value > max {
                return Err(invalid(format!("{key} = {value} is outside {min}..={max}")));
            }
        }
        if self.devices.len() > MAX_DEVICES {
            return Err(invalid(format!("devices lists {} ordinals, at most {MAX_DEVICES}", self.devices.len())));
        }
        let mut seen = self.devices.clone();
        seen.sort_unstable();
        if let Some(pair) = seen.windows(2).find(|w| w[0] == w[1]) {
            return Err(invalid(format!("devices lists ordinal {} twice", pair[0])));
        }
        Ok(())
    }
}

/// The parser's message, prefixed with the key of the line it points at (type errors do not name
/// the key themselves).
fn describe_toml_error(text: &str, error: &toml::de::Error) -> String {
    let message = error.message().trim().to_string();
    let Some(span) = error.span() else { return message };
    let line_start = text[..span.start.min(text.len())].rfind('\n').map_or(0, |i| i + 1);
    let line = text[line_start..].lines().next().unwrap_or("");
    match line.split_once('=') {
        Some((key, _)) if !key.trim().is_empty() => format!("key `{}`: {message}", key.trim()),
        _ => message,
    }
}

fn invalid(message: String) -> PluginError {
    PluginError::new(ReasonCode::INVALID_ARGUMENT, format!("nvlink config: {message}"))
}
