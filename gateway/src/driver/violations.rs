//! The log of plugin contract violations and refused lifecycle inputs: the core reports each
//! violation as it finds it (`Command::Violation`, already counted in its metrics); this keeps the
//! latest report and the count not yet logged per clause, and housekeeping writes at most one line
//! per clause each `HOUSEKEEPING_INTERVAL_MS`, so a plugin flooding bad events costs a line per
//! interval, never one per event.

use super::Driver;
use kvgate_core::{Violation, ViolationClause};

/// Violations reported and not yet logged, by `ViolationClause::index()`.
#[derive(Debug, Default)]
pub(super) struct ViolationLog {
    unlogged: [u64; ViolationClause::COUNT],
    latest: [Option<Violation>; ViolationClause::COUNT],
    /// `Metrics::illegal_transitions` already logged.
    illegal_transitions_logged: u64,
}

impl ViolationLog {
    pub fn note(&mut self, violation: Violation) {
        let i = violation.clause.index();
        self.unlogged[i] += u64::from(violation.count);
        self.latest[i] = Some(violation);
    }
}

impl Driver {
    /// One warning per clause for the violations reported since the last call (the core counts
    /// them in `kvgate_plugin_contract_violations_total`; the log says so too), naming the latest.
    pub(super) fn log_new_violations(&mut self) {
        let metrics = self.core.metrics();
        let log = &mut self.violation_log;
        if metrics.illegal_transitions != log.illegal_transitions_logged {
            let new = metrics.illegal_transitions - log.illegal_transitions_logged;
            let latest = metrics.latest_illegal_transition.map(|t| t.to_string()).unwrap_or_default();
            tracing::error!(new, total = metrics.illegal_transitions, latest = %latest, "core transition table refused an input (a kvgate bug; the room kept its state)");
            log.illegal_transitions_logged = metrics.illegal_transitions;
        }
        for clause in ViolationClause::ALL {
            let i = clause.index();
            let new = std::mem::take(&mut log.unlogged[i]);
            let Some(site) = log.latest[i].take().filter(|_| new > 0) else { continue };
            let total = metrics.violation(clause);
            let (room, role) = match site.room {
                Some((key, role)) => (key.to_string(), role.as_str()),
                None => ("-".to_string(), "-"),
            };
            let plugin = site
                .plugin
                .map_or("?", |slot| self.instances.get(slot.0 as usize).map_or("?", |p| p.wire_name.as_str()));
            tracing::warn!(
                clause = clause.as_str(), new, total, plugin = %plugin, event = site.event.unwrap_or("none"),
                xfer = site.xfer, room = %room, role, "plugin contract violation (the latest named)"
            );
        }
    }
}
