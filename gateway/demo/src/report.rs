//! The demo's results table: per plugin, rooms, GB moved, the transfer's p50/p99 latency, the rate
//! the gateways achieved while rooms were in transfer, the synthetic engines' own time per room, the
//! wall-clock rate with that work included, the cores each side kept busy, and failures by reason.
//! Pure formatting of measured numbers.

use super::engine::RoomResult;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// One plugin's run.
pub struct PluginRun {
    pub plugin: String,
    pub results: Vec<RoomResult>,
    /// Rooms that could not even be started or waited for, with why.
    pub errors: Vec<String>,
    pub wall: Duration,
    /// Set when the plugin could not run here at all.
    pub unavailable: Option<String>,
    /// CPU time (user + system) the two gateway processes and the engines' process (this one) used
    /// during `wall`.
    pub gateway_cpu: Duration,
    pub engine_cpu: Duration,
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// How long at least one of `windows` (start, length) was open: the time the gateways had a room in
/// transfer. Overlapping windows count once.
pub fn busy_time(windows: &[(Instant, Duration)]) -> Duration {
    let mut spans: Vec<(Instant, Instant)> = windows.iter().map(|&(start, len)| (start, start + len)).collect();
    spans.sort();
    let mut total = Duration::ZERO;
    let mut current: Option<(Instant, Instant)> = None;
    for (start, end) in spans {
        current = match current {
            Some((s, e)) if start <= e => Some((s, e.max(end))),
            Some((s, e)) => {
                total += e - s;
                Some((start, end))
            }
            None => Some((start, end)),
        };
    }
    if let Some((s, e)) = current {
        total += e - s;
    }
    total
}

fn rate(bytes: u64, time: Duration) -> f64 {
    if time.as_secs_f64() > 0.0 {
        bytes as f64 / 1e9 / time.as_secs_f64()
    } else {
        0.0
    }
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
    /// Bytes of the verified rooms.
    pub fn moved_bytes(&self) -> u64 {
        self.results.iter().filter(|r| r.verified).map(|r| r.bytes).sum()
    }
    /// The rate the gateways achieved: verified bytes over the time at least one room was in
    /// transfer (from its expect and first send to its last terminal event).
    pub fn gateway_gbps(&self) -> f64 {
        let windows: Vec<(Instant, Duration)> = self.results.iter().map(|r| (r.started, r.latency)).collect();
        rate(self.moved_bytes(), busy_time(&windows))
    }
    /// Verified bytes over the whole run: the engines' own work included.
    pub fn wall_gbps(&self) -> f64 {
        rate(self.moved_bytes(), self.wall)
    }
}

/// Cores a side kept busy over `wall` (`1.52`), or `-` for an empty run.
fn cores(cpu: Duration, wall: Duration) -> String {
    if wall.is_zero() {
        "-".into()
    } else {
        format!("{:.2}", cpu.as_secs_f64() / wall.as_secs_f64())
    }
}

pub fn table(runs: &[PluginRun]) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "{:<8} {:>6} {:>9} {:>9} {:>13} {:>13} {:>13} {:>13} {:>9} {:>13}  {}\n",
        "plugin",
        "rooms",
        "verified",
        "GB moved",
        "transfer p50",
        "transfer p99",
        "gateways GB/s",
        "engines p50",
        "wall GB/s",
        "CPU gw / eng",
        "failures by reason"
    ));
    for run in runs {
        if let Some(why) = &run.unavailable {
            out.push_str(&format!(
                "{:<8} {:>6} {:>9} {:>9} {:>13} {:>13} {:>13} {:>13} {:>9} {:>13}  unavailable: {why}\n",
                run.plugin, "-", "-", "-", "-", "-", "-", "-", "-", "-"
            ));
            continue;
        }
        let mut latencies: Vec<Duration> = run.results.iter().filter(|r| r.verified).map(|r| r.latency).collect();
        latencies.sort();
        let mut engine: Vec<Duration> = run.results.iter().map(|r| r.engine_work).collect();
        engine.sort();
        let failures = run.failures();
        let failures = if failures.is_empty() {
            "none".to_string()
        } else {
            failures.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(", ")
        };
        let ms = |d: Duration| format!("{:.1} ms", d.as_secs_f64() * 1e3);
        out.push_str(&format!(
            "{:<8} {:>6} {:>9} {:>9.2} {:>13} {:>13} {:>13.2} {:>13} {:>9.2} {:>13}  {}\n",
            run.plugin,
            run.results.len() + run.errors.len(),
            run.verified(),
            run.moved_bytes() as f64 / 1e9,
            ms(percentile(&latencies, 50.0)),
            ms(percentile(&latencies, 99.0)),
            run.gateway_gbps(),
            ms(percentile(&engine, 50.0)),
            run.wall_gbps(),
            format!("{} / {}", cores(run.gateway_cpu, run.wall), cores(run.engine_cpu, run.wall)),
            failures
        ));
    }
    out
}

/// What the columns mean, printed under the table: the engines' work is the demo's, not the gateways'.
pub fn legend(cpus: usize, inflight: u64) -> String {
    format!(
        "transfer: from a room's expect and first send to both sides' terminal events (the gateways' work, waiting for CPU included).\n\
         gateways GB/s: verified bytes / the time at least one room was in transfer.\n\
         engines: the synthetic engines' own work per room, outside the transfer: generating the source KV and zeroing the\n\
         destination before, checksumming it after. wall GB/s: verified bytes / the whole run, that work included.\n\
         CPU gw / eng: cores the two gateways and the engines kept busy. All of it shares this machine's {cpus} CPUs, with {inflight}\n\
         rooms in flight: the engines' work competes with the transfers, so neither column is the data path's speed alone.\n\
         `kvgate bench` measures the data path against this machine's copy limit.\n"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_time_counts_overlapping_windows_once() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        assert_eq!(busy_time(&[]), Duration::ZERO);
        // [0,10) and [5,20) overlap: 20; [30,40) apart: 10 more; [32,35) inside it: nothing more.
        let windows = [(t0 + ms(30), ms(10)), (t0, ms(10)), (t0 + ms(5), ms(15)), (t0 + ms(32), ms(3))];
        assert_eq!(busy_time(&windows), ms(30));
        assert_eq!(busy_time(&[(t0, ms(10)), (t0 + ms(10), ms(10))]), ms(20), "touching windows join");
    }

    #[test]
    fn percentiles_pick_the_nearest_rank() {
        let v: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(percentile(&v, 50.0), Duration::from_millis(50));
        assert_eq!(percentile(&v, 99.0), Duration::from_millis(99));
        assert_eq!(percentile(&v[..1], 99.0), Duration::from_millis(1));
        assert_eq!(percentile(&[], 50.0), Duration::ZERO);
    }
}
