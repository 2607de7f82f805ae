//! The clause registry: every clause the harness checks, by id and group, with its check function.
//! The cross-reference test reads this list; an id here must exist in CONFORMANCE.md.

use crate::clauses::{abort, data, handshake, hygiene, network, obs, res, time, CheckResult};
use crate::world::Ctx;

pub struct Clause {
    pub id: &'static str,
    pub group: &'static str,
    pub check: fn(&mut Ctx) -> CheckResult,
}

/// Every harness check, in run order. Run-wide findings (RES-1, RES-3, OBS-1, OBS-5, HYGIENE-1) are
/// merged into their clauses after every check has run.
pub fn registry() -> Vec<Clause> {
    let c = |id, group, check| Clause { id, group, check };
    vec![
        c("HYGIENE-4", "HYGIENE", hygiene::hygiene_4 as fn(&mut Ctx) -> CheckResult),
        c("HYGIENE-3", "HYGIENE", hygiene::hygiene_3),
        c("ABORT-1", "ABORT", abort::abort_1),
        c("ABORT-2", "ABORT", abort::abort_2),
        c("ABORT-3", "ABORT", abort::abort_3),
        c("ABORT-4", "ABORT", abort::abort_4),
        c("TIME-1", "TIME", time::time_1),
        c("TIME-2", "TIME", time::time_2),
        c("TIME-3", "TIME", time::time_3),
        c("TIME-4", "TIME", time::time_4),
        c("TIME-5", "TIME", time::time_5),
        c("TIME-12", "TIME", network::time_12),
        c("RES-1", "RES", res::res_1),
        c("RES-2", "RES", res::res_2),
        c("RES-3", "RES", res::res_3),
        c("RES-5", "RES", res::res_5),
        c("DATA-1", "DATA", data::data_1),
        c("DATA-2", "DATA", data::data_2),
        c("DATA-3", "DATA", data::data_3),
        c("DATA-4", "DATA", data::data_4),
        c("DATA-7", "DATA", network::data_7),
        c("HANDSHAKE-2", "HANDSHAKE", handshake::handshake_2),
        c("HANDSHAKE-3", "HANDSHAKE", handshake::handshake_3),
        c("HANDSHAKE-4", "HANDSHAKE", handshake::handshake_4),
        c("OBS-1", "OBS", obs::obs_1),
        c("OBS-2", "OBS", obs::obs_2),
        c("OBS-5", "OBS", obs::obs_5),
        c("HYGIENE-1", "HYGIENE", hygiene::hygiene_1),
    ]
}

/// Whether `id` (of `group`) is selected by `--clauses`: comma-separated ids, groups, or `PREFIX*`.
pub fn selected(pattern: Option<&str>, id: &str, group: &str) -> bool {
    let Some(pattern) = pattern else { return true };
    pattern.split(',').map(str::trim).filter(|s| !s.is_empty()).any(|item| {
        let item = item.to_ascii_uppercase();
        match item.strip_suffix('*') {
            Some(prefix) => id.starts_with(prefix),
            None => item == id || item == group,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_select_ids_groups_and_prefixes() {
        assert!(selected(None, "ABORT-1", "ABORT"));
        assert!(selected(Some("abort"), "ABORT-1", "ABORT"));
        assert!(selected(Some("TIME-2,ABORT-1"), "ABORT-1", "ABORT"));
        assert!(!selected(Some("TIME-2,ABORT-1"), "ABORT-10", "ABORT"));
        assert!(selected(Some("ABORT-1*"), "ABORT-10", "ABORT"));
        assert!(!selected(Some("RES"), "ABORT-1", "ABORT"));
    }

    #[test]
    fn ids_are_unique_and_in_their_group() {
        let r = registry();
        let mut ids: Vec<_> = r.iter().map(|c| c.id).collect();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), r.len());
        for c in &r {
            assert!(c.id.starts_with(&format!("{}-", c.group)), "{}", c.id);
        }
    }
}
