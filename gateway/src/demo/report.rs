//! The demo's results table: per plugin, rooms, GB moved, aggregate GB/s, p50/p99 latency and
//! failures by reason. Pure formatting of measured numbers.

use super::engine::RoomResult;
use std::collections::BTreeMap;
use std::time::Duration;

/// One plugin's run.
pub struct PluginRun {
    pub plugin: String,
    pub results: Vec<RoomResult>,
    /// Rooms that could not even be started or waited for, with why.
    pub errors: Vec<String>,
    pub wall: Duration,
    /// Set when the plugin could not run here at all.
    pub unavailable: Option<String>,
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

impl PluginRun {
    pub fn verified(&self) -> usize {
        self.results.iter().filter(|r| r.verified).count()
    }
    pub fn failures(&self) -> BTreeMap<String, usize> {
        let mut by_reason = BTreeMap::new();
        for r in &self.results {
            if !r.verified {
                let reason = if !r.decode.reason.is_empty() {
                    r.decode.reason.clone()
                } else if !r.prefill.reason.is_empty() {
                    r.prefill.reason.clone()
                } else {
                    "checksum_mismatch".to_string()
                };
                *by_reason.entry(reason).or_insert(0) += 1;
            }
        }
        if !self.errors.is_empty() {
            *by_reason.entry("engine_error".to_string()).or_insert(0) += self.errors.len();
        }
        by_reason
    }
}

pub fn table(runs: &[PluginRun]) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "{:<8} {:>6} {:>9} {:>9} {:>7} {:>9} {:>9}  {}\n",
        "plugin", "rooms", "verified", "GB moved", "GB/s", "p50 ms", "p99 ms", "failures by reason"
    ));
    for run in runs {
        if let Some(why) = &run.unavailable {
            out.push_str(&format!("{:<8} {:>6} {:>9} {:>9} {:>7} {:>9} {:>9}  unavailable: {why}\n", run.plugin, "-", "-", "-", "-", "-", "-"));
            continue;
        }
        let moved: u64 = run.results.iter().filter(|r| r.verified).map(|r| r.bytes).sum();
        let gb = moved as f64 / 1e9;
        let rate = if run.wall.as_secs_f64() > 0.0 { gb / run.wall.as_secs_f64() } else { 0.0 };
        let mut latencies: Vec<Duration> = run.results.iter().filter(|r| r.verified).map(|r| r.latency).collect();
        latencies.sort();
        let failures = run.failures();
        let failures = if failures.is_empty() {
            "none".to_string()
        } else {
            failures.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(", ")
        };
        out.push_str(&format!(
            "{:<8} {:>6} {:>9} {:>9.2} {:>7.2} {:>9.1} {:>9.1}  {}\n",
            run.plugin,
            run.results.len() + run.errors.len(),
            run.verified(),
            gb,
            rate,
            percentile(&latencies, 50.0).as_secs_f64() * 1e3,
            percentile(&latencies, 99.0).as_secs_f64() * 1e3,
            failures
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_pick_the_nearest_rank() {
        let v: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(percentile(&v, 50.0), Duration::from_millis(50));
        assert_eq!(percentile(&v, 99.0), Duration::from_millis(99));
        assert_eq!(percentile(&v[..1], 99.0), Duration::from_millis(1));
        assert_eq!(percentile(&[], 50.0), Duration::ZERO);
    }
}
