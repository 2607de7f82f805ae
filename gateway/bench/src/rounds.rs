//! Repeated rounds of a target measurement: which cell of a plugin carries its target, how several
//! rounds of that cell (each with its own reference) become one reported cell (the median round by
//! ratio), and how rounds of timed aborts become one latency figure (the median round by p99).
//! Never measures; never hides a failure of any round.

use super::report::SHM_TARGET_CELL;
use super::results::{AbortLatency, CellResult};
use super::stats::{micros, percentile, ratio};
use std::time::Duration;

/// Most rounds `--target-rounds` accepts (each round is a whole cell plus its reference).
pub const MAX_TARGET_ROUNDS: u64 = 15;

/// The cell of `plugin` whose ratio is checked against a target, among `cells` of the plan: the
/// 4 MiB single-block cell for shm, the largest single-block cell for the others (the bulk cell,
/// as `report::targets` picks it). `None` when the plan has no such cell.
pub fn target_cell(plugin: &str, cells: &[(u64, u64)]) -> Option<(u64, u64)> {
    if plugin == "shm" {
        return cells.contains(&SHM_TARGET_CELL).then_some(SHM_TARGET_CELL);
    }
    cells.iter().copied().filter(|&(_, blocks)| blocks == 1).max_by_key(|&(block, _)| block)
}

/// One cell from its rounds: the figures of the round with the median ratio (to the copy limit where
/// every round measured one, else to the reference; the lower median for an even count), the ratios of every round in `round_ratios`, and the failures, failure reasons and
/// verification of every round, so a bad round is never hidden behind a good median.
pub fn median_round(mut rounds: Vec<CellResult>) -> Option<CellResult> {
    if rounds.is_empty() {
        return None;
    }
    let ratios: Vec<f64> = rounds.iter().map(|r| r.ratio).collect();
    let throughputs: Vec<f64> = rounds.iter().map(|r| r.throughput_gbps).collect();
    let references: Vec<f64> = rounds.iter().map(|r| r.reference_gbps).collect();
    let failures: u64 = rounds.iter().map(|r| r.failures).sum();
    let verified = rounds.iter().all(|r| r.verified);
    let mut reasons: Vec<String> = rounds.iter().flat_map(|r| r.failure_reasons.iter().cloned()).collect();
    reasons.sort();
    reasons.dedup();
    reasons.truncate(super::datapath::MAX_FAILURE_REASONS_PER_CELL);
    // A cell measured against the machine's copy limit (shm) is decided on that ratio.
    let by_limit = rounds.iter().all(|r| r.limit_ratio > 0.0);
    let limit_ratios: Vec<f64> = if by_limit { rounds.iter().map(|r| r.limit_ratio).collect() } else { Vec::new() };
    let limits: Vec<f64> = if by_limit {
        rounds.iter().map(|r| r.copy_limit.as_ref().map(|l| l.gbps).unwrap_or(0.0)).collect()
    } else {
        Vec::new()
    };
    let key = |r: &CellResult| if by_limit { r.limit_ratio } else { r.ratio };
    let mut order: Vec<usize> = (0..rounds.len()).collect();
    order.sort_by(|&a, &b| key(&rounds[a]).total_cmp(&key(&rounds[b])));
    let median = order[(order.len() - 1) / 2];
    let mut cell = rounds.swap_remove(median);
    cell.round_ratios = ratios;
    cell.round_throughput_gbps = throughputs;
    cell.round_reference_gbps = references;
    cell.round_limit_ratios = limit_ratios;
    cell.round_limit_gbps = limits;
    cell.failures = failures;
    cell.failure_reasons = reasons;
    cell.verified = verified;
    Some(cell)
}

/// The largest spread (fastest / slowest round) of a target cell's reference that still counts as
/// steady: past it the note says the reference ran at different speeds from round to round (as TCP
/// loopback references at 64 MiB did on one host: 1.4 GB/s in one round, 3.6 in another).
/// `BENCHMARKS.md`'s method text quotes it (tested).
pub const STEADY_REFERENCE_SPREAD: f64 = 1.5;

/// `median of 5 rounds, ratios 0.612-0.981` for a cell run in rounds, with the rounds' kvgate and
/// reference throughput where they were recorded, and a warning when the reference's spread
/// passes `STEADY_REFERENCE_SPREAD`; empty for a cell run once.
pub fn rounds_note(cell: &CellResult) -> String {
    if cell.round_ratios.len() < 2 {
        return String::new();
    }
    let (lo, hi) = min_max(&cell.round_ratios);
    let mut note = if cell.round_limit_ratios.len() == cell.round_ratios.len() {
        let (l_lo, l_hi) = min_max(&cell.round_limit_ratios);
        let (g_lo, g_hi) = min_max(&cell.round_limit_gbps);
        format!(
            "median of {} rounds by the ratio to the copy limit, ratios to it {l_lo:.3}-{l_hi:.3} (limit {g_lo:.2}-{g_hi:.2} GB/s), ratios to the reference {lo:.3}-{hi:.3}",
            cell.round_ratios.len()
        )
    } else {
        format!("median of {} rounds, ratios {lo:.3}-{hi:.3}", cell.round_ratios.len())
    };
    if cell.round_reference_gbps.len() == cell.round_ratios.len()
        && cell.round_throughput_gbps.len() == cell.round_ratios.len()
    {
        let (k_lo, k_hi) = min_max(&cell.round_throughput_gbps);
        let (r_lo, r_hi) = min_max(&cell.round_reference_gbps);
        note.push_str(&format!("; kvgate {k_lo:.2}-{k_hi:.2} GB/s, reference {r_lo:.2}-{r_hi:.2} GB/s"));
        let of_medians = ratio(median_of(&cell.round_throughput_gbps), median_of(&cell.round_reference_gbps));
        if of_medians > 0.0 {
            note.push_str(&format!(", ratio of the medians {of_medians:.3}"));
        }
        if r_lo > 0.0 && r_hi / r_lo > STEADY_REFERENCE_SPREAD {
            note.push_str(&format!(
                "; the reference's spread ({:.1}x) passes {STEADY_REFERENCE_SPREAD}x: it ran at different speeds from round to round, so this ratio is not a steady reading",
                r_hi / r_lo
            ));
        }
    }
    note
}

/// The lower median, as rounds are picked.
fn median_of(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted.get(sorted.len().saturating_sub(1) / 2).copied().unwrap_or(0.0)
}

fn min_max(values: &[f64]) -> (f64, f64) {
    values.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &v| (lo.min(v), hi.max(v)))
}

/// One abort-to-terminal figure from rounds of timed aborts (`rounds[i]`: the samples of round i):
/// p50/p99/max of the round with the median p99 (the lower median for an even count), every
/// round's p99 in `round_p99_us` (left empty for one round), the pooled p99 and max of all samples,
/// and `missing` (terminals that never came, in any round) kept whole.
pub fn median_abort_round(path: &str, rooms_in_flight: u64, rounds: &[Vec<Duration>], missing: u64) -> AbortLatency {
    let all: Vec<Duration> = rounds.iter().flatten().copied().collect();
    let p99s: Vec<f64> = rounds.iter().map(|r| micros(percentile(r, 99.0))).collect();
    let mut order: Vec<usize> = (0..rounds.len()).collect();
    order.sort_by(|&a, &b| p99s[a].total_cmp(&p99s[b]));
    let median: &[Duration] =
        order.get(order.len().saturating_sub(1) / 2).map(|&i| rounds[i].as_slice()).unwrap_or(&[]);
    AbortLatency {
        path: path.to_string(),
        rooms_in_flight,
        aborts: all.len() as u64,
        p50_us: micros(percentile(median, 50.0)),
        p99_us: micros(percentile(median, 99.0)),
        max_us: micros(percentile(median, 100.0)),
        missing_terminal: missing,
        round_p99_us: if rounds.len() > 1 { p99s } else { Vec::new() },
        pooled_p99_us: micros(percentile(&all, 99.0)),
        pooled_max_us: micros(percentile(&all, 100.0)),
    }
}

/// `median of 5 rounds by p99, round p99s 210-1350 us; all 2500 aborts pooled: p99 980 us, max 4100 us`
/// for a figure measured in rounds; empty otherwise.
pub fn abort_rounds_note(a: &AbortLatency) -> String {
    if a.round_p99_us.len() < 2 {
        return String::new();
    }
    let (lo, hi) = min_max(&a.round_p99_us);
    format!(
        "median of {} rounds by p99, round p99s {lo:.0}-{hi:.0} us; all {} aborts pooled: p99 {:.0} us, max {:.0} us",
        a.round_p99_us.len(),
        a.aborts,
        a.pooled_p99_us,
        a.pooled_max_us
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn us(values: &[u64]) -> Vec<Duration> {
        values.iter().map(|&v| Duration::from_micros(v)).collect()
    }

    #[test]
    fn the_median_abort_round_stands_and_the_pooled_tail_is_kept() {
        // Round p99s (nearest rank of 4 samples = the largest): 400, 9000, 300.
        let rounds = vec![us(&[100, 200, 300, 400]), us(&[100, 100, 100, 9_000]), us(&[150, 150, 150, 300])];
        let a = median_abort_round("here", 100_000, &rounds, 2);
        assert_eq!(a.p99_us, 400.0, "the round with the median p99");
        assert_eq!(a.p50_us, 200.0, "its own p50");
        assert_eq!(a.round_p99_us, vec![400.0, 9_000.0, 300.0], "in the order they ran");
        assert_eq!(a.pooled_max_us, 9_000.0, "the worst sample of any round is kept");
        assert_eq!(a.aborts, 12);
        assert_eq!(a.missing_terminal, 2);
        assert_eq!(
            abort_rounds_note(&a),
            "median of 3 rounds by p99, round p99s 300-9000 us; all 12 aborts pooled: p99 9000 us, max 9000 us"
        );
    }

    #[test]
    fn one_abort_round_is_its_own_figure_and_no_round_is_zero() {
        let a = median_abort_round("here", 10, &[us(&[5, 7, 9])], 0);
        assert_eq!((a.p50_us, a.p99_us, a.max_us, a.pooled_p99_us), (7.0, 9.0, 9.0, 9.0));
        assert!(a.round_p99_us.is_empty());
        assert_eq!(abort_rounds_note(&a), "", "one round is not a median");
        let even = median_abort_round("here", 10, &[us(&[50]), us(&[10]), us(&[40]), us(&[20])], 0);
        assert_eq!(even.p99_us, 20.0, "the lower median of an even count");
        let none = median_abort_round("here", 10, &[], 3);
        assert_eq!((none.aborts, none.p99_us, none.missing_terminal), (0, 0.0, 3));
    }

    fn round(ratio: f64, failures: u64, reason: &str) -> CellResult {
        CellResult {
            ratio,
            throughput_gbps: ratio * 10.0,
            reference_gbps: 10.0,
            failures,
            failure_reasons: if reason.is_empty() { vec![] } else { vec![reason.to_string()] },
            verified: true,
            ..CellResult::default()
        }
    }

    #[test]
    fn the_median_round_stands_and_every_round_is_accounted() {
        let cell = median_round(vec![round(0.9, 0, ""), round(0.5, 1, "peer_lost"), round(1.1, 0, "")]).unwrap();
        assert_eq!(cell.ratio, 0.9);
        assert_eq!(cell.throughput_gbps, 9.0, "the figures are the median round's");
        assert_eq!(cell.round_ratios, vec![0.9, 0.5, 1.1], "in the order they ran");
        assert_eq!(cell.round_throughput_gbps, vec![9.0, 5.0, 11.0], "in the order they ran");
        assert_eq!(cell.round_reference_gbps, vec![10.0, 10.0, 10.0]);
        assert_eq!(cell.failures, 1, "a failure of another round is kept");
        assert_eq!(cell.failure_reasons, vec!["peer_lost".to_string()]);
        assert_eq!(rounds_note(&cell), "median of 3 rounds, ratios 0.500-1.100; kvgate 5.00-11.00 GB/s, reference 10.00-10.00 GB/s, ratio of the medians 0.900");
    }

    #[test]
    fn a_reference_spread_past_the_bound_is_called_unsteady_and_at_it_is_not() {
        let with_reference =
            |ratio: f64, reference: f64| CellResult { reference_gbps: reference, ..round(ratio, 0, "") };
        let at = median_round(vec![with_reference(1.0, 2.0), with_reference(1.0, 3.0)]).unwrap();
        assert!(!rounds_note(&at).contains("not a steady reading"), "{}", rounds_note(&at));
        let past = median_round(vec![with_reference(1.0, 2.0), with_reference(1.0, 3.01)]).unwrap();
        assert!(rounds_note(&past).ends_with("the reference's spread (1.5x) passes 1.5x: it ran at different speeds from round to round, so this ratio is not a steady reading"), "{}", rounds_note(&past));
        // A report written before the per-round throughputs were recorded keeps its old note.
        let mut old = past.clone();
        old.round_reference_gbps.clear();
        assert_eq!(rounds_note(&old), "median of 2 rounds, ratios 1.000-1.000");
    }

    #[test]
    fn an_even_count_takes_the_lower_median_and_one_unverified_round_marks_the_cell() {
        let mut rounds = vec![round(0.8, 0, ""), round(0.6, 0, ""), round(0.7, 0, ""), round(0.9, 0, "")];
        rounds[3].verified = false;
        let cell = median_round(rounds).unwrap();
        assert_eq!(cell.ratio, 0.7);
        assert!(!cell.verified);
        assert!(median_round(vec![]).is_none());
        assert_eq!(rounds_note(&median_round(vec![round(0.4, 0, "")]).unwrap()), "", "one round is not a median");
    }

    #[test]
    fn rounds_with_a_copy_limit_are_decided_on_the_ratio_to_it() {
        let with_limit = |ratio: f64, limit_ratio: f64| CellResult {
            limit_ratio,
            copy_limit: Some(crate::results::CopyLimit { gbps: 20.0, ..Default::default() }),
            ..round(ratio, 0, "")
        };
        // By the reference the median would be the 1.2 round; by the limit it is the 0.85 one.
        let cell = median_round(vec![with_limit(1.2, 0.95), with_limit(1.1, 0.85), with_limit(1.3, 0.80)]).unwrap();
        assert_eq!(cell.limit_ratio, 0.85);
        assert_eq!(cell.ratio, 1.1);
        assert_eq!(cell.round_limit_ratios, vec![0.95, 0.85, 0.80]);
        assert_eq!(cell.round_limit_gbps, vec![20.0; 3]);
        assert!(rounds_note(&cell).starts_with("median of 3 rounds by the ratio to the copy limit, ratios to it 0.800-0.950 (limit 20.00-20.00 GB/s), ratios to the reference 1.100-1.300"), "{}", rounds_note(&cell));
        // One round without a limit: decided on the reference, as before.
        let mixed = median_round(vec![with_limit(1.2, 0.95), round(1.1, 0, ""), with_limit(1.3, 0.80)]).unwrap();
        assert_eq!(mixed.ratio, 1.2);
        assert!(mixed.round_limit_ratios.is_empty());
    }

    #[test]
    fn target_cells_follow_the_report() {
        let mib = 1u64 << 20;
        let cells = vec![(4096, 1), (4 * mib, 1), (4 * mib, 100), (64 * mib, 1)];
        assert_eq!(target_cell("shm", &cells), Some((4 * mib, 1)));
        assert_eq!(target_cell("quic", &cells), Some((64 * mib, 1)));
        assert_eq!(target_cell("ucx-tcp", &cells[..3]), Some((4 * mib, 1)));
        assert_eq!(target_cell("shm", &[(4096, 1)]), None);
        assert_eq!(target_cell("quic", &[(4096, 100)]), None);
    }
}
