//! Repeated rounds of a target cell: which cell of a plugin carries its target, and how several
//! rounds of that cell (each with its own reference) become one reported cell, the median round by
//! ratio. Never measures; never hides a failure of any round.

use super::report::SHM_TARGET_CELL;
use super::results::CellResult;

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

/// One cell from its rounds: the figures of the round with the median ratio (the lower median for an
/// even count), the ratios of every round in `round_ratios`, and the failures, failure reasons and
/// verification of every round, so a bad round is never hidden behind a good median.
pub fn median_round(mut rounds: Vec<CellResult>) -> Option<CellResult> {
    if rounds.is_empty() {
        return None;
    }
    let ratios: Vec<f64> = rounds.iter().map(|r| r.ratio).collect();
    let failures: u64 = rounds.iter().map(|r| r.failures).sum();
    let verified = rounds.iter().all(|r| r.verified);
    let mut reasons: Vec<String> = rounds.iter().flat_map(|r| r.failure_reasons.iter().cloned()).collect();
    reasons.sort();
    reasons.dedup();
    reasons.truncate(super::datapath::MAX_FAILURE_REASONS_PER_CELL);
    let mut order: Vec<usize> = (0..rounds.len()).collect();
    order.sort_by(|&a, &b| rounds[a].ratio.total_cmp(&rounds[b].ratio));
    let median = order[(order.len() - 1) / 2];
    let mut cell = rounds.swap_remove(median);
    cell.round_ratios = ratios;
    cell.failures = failures;
    cell.failure_reasons = reasons;
    cell.verified = verified;
    Some(cell)
}

/// `median of 5 rounds, ratios 0.612-0.981` for a cell run in rounds; empty otherwise.
pub fn rounds_note(cell: &CellResult) -> String {
    if cell.round_ratios.len() < 2 {
        return String::new();
    }
    let lo = cell.round_ratios.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = cell.round_ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("median of {} rounds, ratios {lo:.3}-{hi:.3}", cell.round_ratios.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round(ratio: f64, failures: u64, reason: &str) -> CellResult {
        CellResult {
            ratio,
            throughput_gbps: ratio * 10.0,
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
        assert_eq!(cell.failures, 1, "a failure of another round is kept");
        assert_eq!(cell.failure_reasons, vec!["peer_lost".to_string()]);
        assert_eq!(rounds_note(&cell), "median of 3 rounds, ratios 0.500-1.100");
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
