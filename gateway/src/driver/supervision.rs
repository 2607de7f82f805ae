//! Supervision of plugin instances: an instance that reported a dead worker (`UNHEALTHY`; the core
//! has failed its rooms with `plugin_failed`) is replaced by a new generation of the same plugin and
//! settings after a back-off, at most `plugins.restart_max_attempts` times within
//! `plugins.restart_window_ms`; past that it stays down and `/healthz` says why. The back-off is
//! `plugins.restart_backoff_ms`, doubled for each restart already made within the window (checked
//! on the driver's housekeeping tick, so up to `HOUSEKEEPING_INTERVAL_MS` later).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// The named limits, from `[plugins]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RestartLimits {
    pub max_attempts: u64,
    pub window_ms: u64,
    pub backoff_ms: u64,
}

impl RestartLimits {
    pub fn of(plugins: &crate::config::PluginsSection) -> RestartLimits {
        RestartLimits {
            max_attempts: plugins.restart_max_attempts,
            window_ms: plugins.restart_window_ms,
            backoff_ms: plugins.restart_backoff_ms,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Restart after this back-off; this is attempt `attempt` (1-based) within the window.
    RestartAfter { backoff: Duration, attempt: u64 },
    /// The limit is reached: stay down. Says why, naming the limits.
    GiveUp(String),
}

/// The restarts of one plugin (by name) within the window.
#[derive(Clone, Debug, Default)]
pub struct RestartHistory {
    restarts: VecDeque<Instant>,
}

impl RestartHistory {
    /// What to do about a dead instance at `now`; a restart decided is counted at once.
    pub fn decide(&mut self, now: Instant, limits: RestartLimits) -> Decision {
        let window = Duration::from_millis(limits.window_ms);
        while self.restarts.front().is_some_and(|t| now.saturating_duration_since(*t) >= window) {
            self.restarts.pop_front();
        }
        let made = self.restarts.len() as u64;
        if made >= limits.max_attempts {
            return Decision::GiveUp(format!(
                "restart limit reached: {made} restart(s) within plugins.restart_window_ms = {} (plugins.restart_max_attempts = {}); it stays down",
                limits.window_ms, limits.max_attempts
            ));
        }
        self.restarts.push_back(now);
        let backoff = limits.backoff_ms.saturating_mul(1u64 << made.min(20));
        Decision::RestartAfter { backoff: Duration::from_millis(backoff), attempt: made + 1 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: RestartLimits = RestartLimits { max_attempts: 3, window_ms: 10_000, backoff_ms: 100 };

    #[test]
    fn restarts_back_off_doubling_up_to_the_limit_then_stay_down() {
        let (mut history, start) = (RestartHistory::default(), Instant::now());
        for (attempt, backoff) in [(1, 100), (2, 200), (3, 400)] {
            assert_eq!(
                history.decide(start, LIMITS),
                Decision::RestartAfter { backoff: Duration::from_millis(backoff), attempt }
            );
        }
        // At the limit (3 within the window), one more is refused with the limits named.
        let Decision::GiveUp(why) = history.decide(start + Duration::from_millis(9_999), LIMITS) else {
            panic!("past the limit")
        };
        assert!(
            why.contains("plugins.restart_max_attempts = 3") && why.contains("plugins.restart_window_ms = 10000"),
            "{why}"
        );
    }

    #[test]
    fn restarts_older_than_the_window_no_longer_count() {
        let (mut history, start) = (RestartHistory::default(), Instant::now());
        for _ in 0..3 {
            history.decide(start, LIMITS);
        }
        // Exactly one window later the three have aged out: back to the first back-off.
        let later = start + Duration::from_millis(LIMITS.window_ms);
        assert_eq!(
            history.decide(later, LIMITS),
            Decision::RestartAfter { backoff: Duration::from_millis(100), attempt: 1 }
        );
    }

    #[test]
    fn no_restart_at_all_when_the_limit_is_zero() {
        let limits = RestartLimits { max_attempts: 0, ..LIMITS };
        assert!(matches!(RestartHistory::default().decide(Instant::now(), limits), Decision::GiveUp(_)));
    }
}
