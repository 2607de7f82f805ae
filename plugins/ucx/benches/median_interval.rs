//! How far a median of noisy runs can be trusted: a distribution-free interval for the median (with
//! n independent runs, the k-th smallest and the k-th largest bracket the true median with
//! probability 1 - 2 P(Binomial(n, 1/2) < k)), and from it whether a target is met, missed, or not
//! decided by that many runs. Owns the arithmetic only; `ucx_vs_perftest` prints it per point and
//! its tests live in `tests/median_interval.rs`.

/// The interval's lowest and highest value and the probability that it holds the true median.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MedianInterval {
    pub low: f64,
    pub high: f64,
    pub coverage: f64,
}

/// Most runs the interval is computed for (the binomial's point masses stay representable).
pub const MAX_RUNS: usize = 1000;

/// The narrowest order-statistic interval whose coverage is at least `confidence`; `None` when
/// `values` are too few for any (3 runs cover the median with 75 % at most) or more than [`MAX_RUNS`].
pub fn median_interval(values: &[f64], confidence: f64) -> Option<MedianInterval> {
    let n = values.len();
    if n == 0 || n > MAX_RUNS {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mut best = None;
    let mut below = 0.0; // P(Binomial(n, 1/2) <= k - 1)
    let mut mass = 0.5f64.powi(n as i32); // P(Binomial(n, 1/2) = k - 1)
    for k in 1..=n.div_ceil(2) {
        below += mass;
        let coverage = 1.0 - 2.0 * below;
        if coverage < confidence {
            break;
        }
        best = Some(MedianInterval { low: sorted[k - 1], high: sorted[n - k], coverage });
        mass *= (n - (k - 1)) as f64 / k as f64;
    }
    best
}

/// What `n` runs say about a median against a target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The whole interval is at or above the target.
    Met,
    /// The whole interval is below the target.
    Missed,
    /// The interval holds the target: these runs cannot tell.
    NotDecided,
    /// Too few runs for an interval at this confidence.
    TooFewRuns,
}

impl Verdict {
    pub fn word(self) -> &'static str {
        match self {
            Verdict::Met => "met",
            Verdict::Missed => "missed",
            Verdict::NotDecided => "not decided",
            Verdict::TooFewRuns => "too few runs",
        }
    }
}

pub fn verdict(interval: Option<MedianInterval>, target: f64) -> Verdict {
    match interval {
        None => Verdict::TooFewRuns,
        Some(i) if i.low >= target => Verdict::Met,
        Some(i) if i.high < target => Verdict::Missed,
        Some(_) => Verdict::NotDecided,
    }
}
