//! The benchmark's interval for a median (benches/median_interval.rs): which runs bound it, with
//! what coverage, and the verdict it gives against a target.

#[path = "../benches/median_interval.rs"]
mod median_interval;
use median_interval::*;

fn runs(n: usize) -> Vec<f64> {
    // Out of order on purpose: the interval must sort.
    (1..=n).rev().map(|i| i as f64).collect()
}

#[test]
fn nine_runs_are_bracketed_by_the_second_and_eighth() {
    let i = median_interval(&runs(9), 0.90).expect("nine runs give an interval");
    assert_eq!((i.low, i.high), (2.0, 8.0));
    // 1 - 2 * (1 + 9) / 512
    assert!((i.coverage - (1.0 - 20.0 / 512.0)).abs() < 1e-12, "{}", i.coverage);
}

#[test]
fn twenty_one_runs_are_bracketed_by_the_seventh_and_fifteenth() {
    let i = median_interval(&runs(21), 0.90).unwrap();
    assert_eq!((i.low, i.high), (7.0, 15.0));
    assert!(i.coverage >= 0.90 && i.coverage < 0.93, "{}", i.coverage);
    // One step narrower would fall under 90 %: P(Binomial(21, 1/2) <= 7) is about 0.0946 (coverage 0.811).
    let narrower = median_interval(&runs(21), 0.81).unwrap();
    assert_eq!((narrower.low, narrower.high), (8.0, 14.0));
}

#[test]
fn three_runs_are_too_few_for_ninety_per_cent() {
    assert_eq!(median_interval(&runs(3), 0.90), None);
    // ... and give the whole range at 75 %.
    let i = median_interval(&runs(3), 0.75).unwrap();
    assert_eq!((i.low, i.high), (1.0, 3.0));
    assert_eq!(median_interval(&[], 0.5), None);
    assert_eq!(median_interval(&runs(MAX_RUNS + 1), 0.9), None);
    assert!(median_interval(&runs(MAX_RUNS), 0.9).is_some());
}

#[test]
fn the_verdict_follows_where_the_target_falls() {
    let at = |low, high| Some(MedianInterval { low, high, coverage: 0.95 });
    assert_eq!(verdict(at(0.95, 1.10), 0.95), Verdict::Met, "the target at the low end is met");
    assert_eq!(verdict(at(0.80, 0.9499), 0.95), Verdict::Missed);
    assert_eq!(verdict(at(0.90, 0.98), 0.95), Verdict::NotDecided);
    assert_eq!(verdict(at(0.90, 0.95), 0.95), Verdict::NotDecided, "the target at the high end is not missed");
    assert_eq!(verdict(None, 0.95), Verdict::TooFewRuns);
    let words: Vec<&str> =
        [Verdict::Met, Verdict::Missed, Verdict::NotDecided, Verdict::TooFewRuns].iter().map(|v| v.word()).collect();
    assert_eq!(words, ["met", "missed", "not decided", "too few runs"]);
}
