//! The harness's limits and the plugin's config, read from `--config FILE` (`[harness]` and `[plugin]`
//! tables), each limit named with its unit, defaulted, and validated when read. Never read elsewhere.

use serde::{Deserialize, Serialize};

/// Every bound the harness judges a plugin by. Defaults are documented in CONFORMANCE.md.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct HarnessLimits {
    /// G: how long after `cancel` returns a terminal event may come.
    pub abort_grace_ms: u64,
    /// The longest a single plugin call may take.
    pub call_bound_ms: u64,
    /// How late after `timeout_ns` a terminal event may come.
    pub deadline_slack_ms: u64,
    /// By when every transfer of an abort storm must be terminal.
    pub storm_grace_ms: u64,
    /// How long the controller waits for a peer's reply before it declares the call blocked.
    pub reply_bound_ms: u64,
    /// The deadline given to transfers that only a cancel should end ("never", for the check).
    pub long_timeout_ms: u64,
    /// Transfers cancelled at once in the abort storm (ABORT-4).
    pub storm_transfers: u64,
    /// Random lifecycles of the resource check (RES-2).
    pub lifecycles: u64,
    /// Segments of the scatter-gather check (DATA-2).
    pub scatter_segments: u64,
    /// The largest single transfer of the data check (DATA-1).
    pub max_data_bytes: u64,
    /// Where the peers' regions live: `auto` (host memory when the plugin declares it, else CUDA
    /// device memory), `host`, `fake_device` (host memory declared as CUDA device memory, for
    /// device-only test plugins) or `cuda` (needs the harness's `cuda` feature and a driver).
    pub memory_provider: String,
}

impl Default for HarnessLimits {
    fn default() -> Self {
        HarnessLimits {
            abort_grace_ms: 100,
            call_bound_ms: 100,
            deadline_slack_ms: 200,
            storm_grace_ms: 5_000,
            reply_bound_ms: 10_000,
            long_timeout_ms: 60_000,
            storm_transfers: 10_000,
            lifecycles: 10_000,
            scatter_segments: 10_000,
            max_data_bytes: 64 << 20,
            memory_provider: "auto".into(),
        }
    }
}

/// The `--quick` profile (the mutant tests) keeps every catch: it shrinks only what no check's catch
/// depends on, the frozen-receiver abort storm of ABORT-4 (10 000 → 1 000 transfers; ABORT-4's
/// loaded case, which times cancels under load, is the same in both profiles). Transfer sizes stay at
/// `max_data_bytes` (a deadline ignored only for large transfers shows only in large ones, TIME-4),
/// and the lifecycles at `lifecycles` (a defect once every few thousand transfers needs thousands).
pub const QUICK_STORM_TRANSFERS: u64 = 1_000;

const MAX_MS: u64 = 600_000;
const MAX_COUNT: u64 = 1_000_000;
const MAX_DATA_BYTES: u64 = 1 << 30;

impl HarnessLimits {
    pub fn validate(&self) -> Result<(), String> {
        let ms = [
            ("abort_grace_ms", self.abort_grace_ms),
            ("call_bound_ms", self.call_bound_ms),
            ("deadline_slack_ms", self.deadline_slack_ms),
            ("storm_grace_ms", self.storm_grace_ms),
            ("reply_bound_ms", self.reply_bound_ms),
            ("long_timeout_ms", self.long_timeout_ms),
        ];
        for (name, v) in ms {
            if v == 0 || v > MAX_MS {
                return Err(format!("[harness] {name} = {v}: must be in 1..={MAX_MS}"));
            }
        }
        let counts = [
            ("storm_transfers", self.storm_transfers),
            ("lifecycles", self.lifecycles),
            ("scatter_segments", self.scatter_segments),
        ];
        for (name, v) in counts {
            if v == 0 || v > MAX_COUNT {
                return Err(format!("[harness] {name} = {v}: must be in 1..={MAX_COUNT}"));
            }
        }
        if self.max_data_bytes == 0 || self.max_data_bytes > MAX_DATA_BYTES {
            return Err(format!("[harness] max_data_bytes = {}: must be in 1..={MAX_DATA_BYTES}", self.max_data_bytes));
        }
        if !crate::peer::memory::PROVIDERS.contains(&self.memory_provider.as_str()) {
            return Err(format!(
                "[harness] memory_provider = {:?}: must be one of {:?}",
                self.memory_provider,
                crate::peer::memory::PROVIDERS
            ));
        }
        if self.reply_bound_ms <= self.call_bound_ms {
            return Err("[harness] reply_bound_ms must exceed call_bound_ms".into());
        }
        Ok(())
    }

    pub fn apply_quick(&mut self) {
        self.storm_transfers = self.storm_transfers.min(QUICK_STORM_TRANSFERS);
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    #[serde(default)]
    harness: HarnessLimits,
    #[serde(default)]
    plugin: Option<toml::Table>,
}

/// Limits and the plugin's config string (the `[plugin]` table as TOML; empty without one).
pub fn load(path: Option<&std::path::Path>, quick: bool) -> Result<(HarnessLimits, String), String> {
    let file: FileConfig = match path {
        Some(p) => {
            let text = std::fs::read_to_string(p).map_err(|e| format!("cannot read {}: {e}", p.display()))?;
            toml::from_str(&text).map_err(|e| format!("{}: {e}", p.display()))?
        }
        None => FileConfig::default(),
    };
    let mut limits = file.harness;
    if quick {
        limits.apply_quick();
    }
    limits.validate()?;
    let plugin_config = match file.plugin {
        Some(t) => toml::to_string(&t).map_err(|e| format!("[plugin]: {e}"))?,
        None => String::new(),
    };
    Ok((limits, plugin_config))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_limits_are_checked_at_and_past_the_bound() {
        HarnessLimits::default().validate().unwrap();
        let at = HarnessLimits { abort_grace_ms: MAX_MS, ..Default::default() };
        at.validate().unwrap();
        let past = HarnessLimits { abort_grace_ms: MAX_MS + 1, ..Default::default() };
        assert!(past.validate().unwrap_err().contains("abort_grace_ms"));
        let zero = HarnessLimits { storm_transfers: 0, ..Default::default() };
        assert!(zero.validate().unwrap_err().contains("storm_transfers"));
        let at = HarnessLimits { lifecycles: MAX_COUNT, ..Default::default() };
        at.validate().unwrap();
        let past = HarnessLimits { lifecycles: MAX_COUNT + 1, ..Default::default() };
        assert!(past.validate().is_err());
        let at = HarnessLimits { max_data_bytes: MAX_DATA_BYTES, ..Default::default() };
        at.validate().unwrap();
        assert!(HarnessLimits { max_data_bytes: MAX_DATA_BYTES + 1, ..Default::default() }.validate().is_err());
    }

    #[test]
    fn unknown_keys_are_refused_and_the_plugin_table_is_passed_on() {
        let dir = std::env::temp_dir().join(format!("kvgate-conf-cfg-{}", std::process::id()));
        std::fs::write(&dir, "[harness]\nabort_grace_ms = 50\n[plugin]\nsegment_delay_us = 3\n").unwrap();
        let (limits, plugin) = load(Some(&dir), true).unwrap();
        assert_eq!(limits.abort_grace_ms, 50);
        assert_eq!(limits.storm_transfers, QUICK_STORM_TRANSFERS);
        let full = HarnessLimits::default();
        assert_eq!(
            (limits.lifecycles, limits.max_data_bytes),
            (full.lifecycles, full.max_data_bytes),
            "--quick keeps sizes and lifecycles"
        );
        assert!(plugin.contains("segment_delay_us = 3"), "{plugin}");
        std::fs::write(&dir, "[harness]\nabort_grace = 50\n").unwrap();
        assert!(load(Some(&dir), false).unwrap_err().contains("abort_grace"));
        let _ = std::fs::remove_file(&dir);
    }
}
