//! Latency samples and the figures derived from them (nearest-rank percentiles, throughput).
//! Pure arithmetic on measured durations; never measures anything itself.

use std::time::Duration;

/// Nearest-rank percentile `p` (0..=100) of `samples` (any order); zero when empty.
pub fn percentile(samples: &[Duration], p: f64) -> Duration {
    if samples.is_empty() {
        return Duration::ZERO;
    }
    let mut sorted = samples.to_vec();
    sorted.sort();
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

pub fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

pub fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Decimal gigabytes per second (1 GB = 1e9 bytes), zero for an empty interval.
pub fn gbps(bytes: u64, wall: Duration) -> f64 {
    let s = wall.as_secs_f64();
    if s > 0.0 {
        bytes as f64 / 1e9 / s
    } else {
        0.0
    }
}

/// `measured / reference`, or zero when the reference is not positive.
pub fn ratio(measured: f64, reference: f64) -> f64 {
    if reference > 0.0 && reference.is_finite() {
        measured / reference
    } else {
        0.0
    }
}

/// Human size: 4 KiB, 64 MiB, 1 GiB.
pub fn size_label(bytes: u64) -> String {
    const UNITS: [(&str, u64); 3] = [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    for (unit, scale) in UNITS {
        if bytes >= scale && bytes.is_multiple_of(scale) {
            return format!("{} {unit}", bytes / scale);
        }
    }
    format!("{bytes} B")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles_ignore_input_order() {
        let mut v: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        v.reverse();
        assert_eq!(percentile(&v, 50.0), Duration::from_millis(50));
        assert_eq!(percentile(&v, 99.0), Duration::from_millis(99));
        assert_eq!(percentile(&v[..1], 99.0), Duration::from_millis(100));
        assert_eq!(percentile(&[], 50.0), Duration::ZERO);
    }

    #[test]
    fn rates_ratios_and_labels() {
        assert_eq!(gbps(2_000_000_000, Duration::from_secs(2)), 1.0);
        assert_eq!(gbps(1, Duration::ZERO), 0.0);
        assert_eq!(ratio(1.0, 4.0), 0.25);
        assert_eq!(ratio(1.0, 0.0), 0.0);
        assert_eq!(size_label(4096), "4 KiB");
        assert_eq!(size_label(64 << 20), "64 MiB");
        assert_eq!(size_label(1000), "1000 B");
    }
}
