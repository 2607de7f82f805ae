//! Every limit and deadline of the core, with its unit in its name, its documented default and the
//! range `validate()` accepts. This module only describes and checks settings; it never applies them.

use serde::{Deserialize, Serialize};
use std::fmt;

/// The core's settings (`[scheduler]` in the gateway's TOML). Defaults are in `Default`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CoreConfig {
    /// Most live rooms (both roles, not counting terminal ones). Default 100 000.
    pub max_inflight_rooms: u64,
    /// Most parts in one room. Default 256.
    pub max_parts_per_room: u64,
    /// Most chunks in one part. Default 65 536.
    pub max_chunks_per_part: u64,
    /// Most slices in one request (an expect's part, a send). Default 1 048 576.
    pub max_slices_per_request: u64,
    /// Most segments one chunk may map to; a chunk past it is refused (`too_many_segments`), never
    /// split. Default 262 144.
    pub max_segments_per_submit: u64,
    /// Most chunks held (all rooms together) while their room waits for its expect notice.
    /// Default 65 536.
    pub max_pending_sends: u64,
    /// Most terminal rooms remembered to refuse late messages. Oldest dropped first. Default 1 000 000.
    pub max_tombstones: u64,
    /// How long a settled terminal room is remembered. Default 60 000 ms.
    pub tombstone_ttl_ms: u64,
    /// How long a room may wait for its counterpart (expect or first send). Default 10 000 ms.
    pub bootstrap_timeout_ms: u64,
    /// Fixed part of the transfer deadline. Default 1 000 ms.
    pub transfer_base_ms: u64,
    /// The transfer deadline adds `bytes / min_bandwidth_bytes_per_s`, counting the bytes of the rooms
    /// already moving with the same peer ahead of the room's own (they share the link). Default
    /// 100 000 000 (100 MB/s): the least the link to one peer is expected to carry.
    pub min_bandwidth_bytes_per_s: u64,
    /// A room's overall deadline when the engine names none. Default 60 000 ms.
    pub room_timeout_ms: u64,
    /// Cap on an engine-supplied room deadline. Default 600 000 ms.
    pub max_room_timeout_ms: u64,
    /// How long a plugin may stay silent past a transfer's timeout (or after a cancel). Default 50 ms.
    pub plugin_grace_ms: u64,
    /// How long a failed room's memory may stay quarantined waiting for a quiesce. Default 30 000 ms.
    pub quarantine_timeout_ms: u64,
}

impl Default for CoreConfig {
    fn default() -> Self {
        CoreConfig {
            max_inflight_rooms: 100_000,
            max_parts_per_room: 256,
            max_chunks_per_part: 65_536,
            max_slices_per_request: 1_048_576,
            max_segments_per_submit: 262_144,
            max_pending_sends: 65_536,
            max_tombstones: 1_000_000,
            tombstone_ttl_ms: 60_000,
            bootstrap_timeout_ms: 10_000,
            transfer_base_ms: 1_000,
            min_bandwidth_bytes_per_s: 100_000_000,
            room_timeout_ms: 60_000,
            max_room_timeout_ms: 600_000,
            plugin_grace_ms: 50,
            quarantine_timeout_ms: 30_000,
        }
    }
}

/// A setting out of its allowed range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    /// The key, e.g. `max_inflight_rooms`.
    pub key: &'static str,
    pub value: u64,
    pub min: u64,
    pub max: u64,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "scheduler.{} = {} is out of range: allowed {}..={}", self.key, self.value, self.min, self.max)
    }
}
impl std::error::Error for ConfigError {}

const HOUR_MS: u64 = 3_600_000;
const DAY_MS: u64 = 24 * HOUR_MS;

impl CoreConfig {
    /// Every key with the range it accepts: `(key, value, min, max)`.
    pub fn ranges(&self) -> [(&'static str, u64, u64, u64); 15] {
        [
            ("max_inflight_rooms", self.max_inflight_rooms, 1, 16_777_216),
            ("max_parts_per_room", self.max_parts_per_room, 1, 65_536),
            ("max_chunks_per_part", self.max_chunks_per_part, 1, 16_777_216),
            ("max_slices_per_request", self.max_slices_per_request, 1, 16_777_216),
            ("max_segments_per_submit", self.max_segments_per_submit, 1, 16_777_216),
            ("max_pending_sends", self.max_pending_sends, 0, 16_777_216),
            ("max_tombstones", self.max_tombstones, 1, 16_777_216),
            ("tombstone_ttl_ms", self.tombstone_ttl_ms, 1, DAY_MS),
            ("bootstrap_timeout_ms", self.bootstrap_timeout_ms, 1, DAY_MS),
            ("transfer_base_ms", self.transfer_base_ms, 1, DAY_MS),
            ("min_bandwidth_bytes_per_s", self.min_bandwidth_bytes_per_s, 1, u64::MAX / 2),
            ("room_timeout_ms", self.room_timeout_ms, 1, DAY_MS),
            ("max_room_timeout_ms", self.max_room_timeout_ms, 1, DAY_MS),
            ("plugin_grace_ms", self.plugin_grace_ms, 1, HOUR_MS),
            ("quarantine_timeout_ms", self.quarantine_timeout_ms, 1, DAY_MS),
        ]
    }

    /// Check every key against its range; the first bad key is named with its value and range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (key, value, min, max) in self.ranges() {
            if value < min || value > max {
                return Err(ConfigError { key, value, min, max });
            }
        }
        if self.room_timeout_ms > self.max_room_timeout_ms {
            return Err(ConfigError {
                key: "room_timeout_ms",
                value: self.room_timeout_ms,
                min: 1,
                max: self.max_room_timeout_ms,
            });
        }
        Ok(())
    }
}
