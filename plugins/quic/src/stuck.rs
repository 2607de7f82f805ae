//! Stuck-connection watchdog. A peer's outgoing connection that is busy (it holds back a lane,
//! `Lane::held_back`: data waiting for quinn; or its lanes' unanswered parts carry at least a window's
//! worth of the bar, `busy`) while its sending rate stays below a bar for `stuck_after_ms` is replaced:
//! its lanes fail their parts with `TRANSPORT_ERROR` (the message names the rates), it is closed, and
//! the peer is connected afresh.
//! The bar is the larger of `stuck_min_bytes_per_s` and `stuck_below_best_percent` of the best rate the
//! connection, or another connection to the same peer, reached over such a window. This is what keeps a congestion controller that fell into a
//! state it does not leave (quinn's BBR was seen stuck at a tenth of the link after the loss ended) from
//! pinning a peer's transfers to it for the peer's lifetime. Owns the detection (`StallDetector`, pure
//! arithmetic on samples) and the per-peer task that samples quinn's counters.

use crate::peers::{self, Links, PeerEntry};
use crate::shared::Shared;
use kvgate_abi::{PluginError, ReasonCode};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// Samples per `stuck_after_ms` window.
pub const SAMPLES_PER_WINDOW: u64 = 4;

/// The configured bounds (`stuck_after_ms`, `stuck_min_bytes_per_s`, `stuck_below_best_percent`).
#[derive(Clone, Copy, Debug)]
pub struct StuckRule {
    pub after_ms: u64,
    pub min_bytes_per_s: u64,
    pub below_best_percent: u64,
}

impl StuckRule {
    pub fn from_config(c: &crate::config::QuicConfig) -> StuckRule {
        StuckRule {
            after_ms: c.stuck_after_ms,
            min_bytes_per_s: c.stuck_min_bytes_per_s,
            below_best_percent: c.stuck_below_best_percent,
        }
    }

    /// Whether any bar is set (a zero window or no bar at all disables the watchdog).
    pub fn enabled(&self) -> bool {
        self.after_ms > 0 && (self.min_bytes_per_s > 0 || self.below_best_percent > 0)
    }
}

/// One reading of a connection: when, its sent UDP bytes so far, and whether it held a lane back.
#[derive(Clone, Copy, Debug)]
pub struct Sample {
    pub at_ms: u64,
    pub sent_bytes: u64,
    pub busy: bool,
}

/// What made a connection count as stuck.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stuck {
    pub window_ms: u64,
    pub bytes_per_s: u64,
    pub bar_bytes_per_s: u64,
    pub best_bytes_per_s: u64,
}

/// The rate of one connection over sliding windows of at least `after_ms`, every sample busy.
pub struct StallDetector {
    rule: StuckRule,
    samples: VecDeque<Sample>,
    best_bytes_per_s: u64,
    /// The best window any connection to the same peer reached (`set_peer_best`): they share a path,
    /// so what one of them sent, each could.
    peer_best_bytes_per_s: u64,
}

impl StallDetector {
    pub fn new(rule: StuckRule) -> StallDetector {
        StallDetector { rule, samples: VecDeque::new(), best_bytes_per_s: 0, peer_best_bytes_per_s: 0 }
    }

    /// The best window this connection reached.
    pub fn best_bytes_per_s(&self) -> u64 {
        self.best_bytes_per_s
    }

    /// The best window any connection to the same peer reached (this one's included).
    pub fn set_peer_best(&mut self, bytes_per_s: u64) {
        self.peer_best_bytes_per_s = bytes_per_s;
    }

    /// The best a window's rate is measured against: this connection's, or its peer's, whichever is higher.
    fn reference_bytes_per_s(&self) -> u64 {
        self.best_bytes_per_s.max(self.peer_best_bytes_per_s)
    }

    /// The bar a window's rate must reach: the floor, or the share of the best window (of this
    /// connection or any other to the same peer), whichever is higher.
    pub fn bar_bytes_per_s(&self) -> u64 {
        let best = self.reference_bytes_per_s();
        let share = (u128::from(best) * u128::from(self.rule.below_best_percent) / 100) as u64;
        share.max(self.rule.min_bytes_per_s)
    }

    /// Add a sample; `Some` once the last `after_ms` (or a little more, the sampling's granularity)
    /// were busy throughout and their rate stayed below the bar. A rate at the bar is not stuck.
    pub fn observe(&mut self, s: Sample) -> Option<Stuck> {
        if !self.rule.enabled() {
            return None;
        }
        if !s.busy {
            // A window must have parts outstanding throughout: an idle connection sends nothing.
            self.samples.clear();
            return None;
        }
        self.samples.push_back(s);
        while self.samples.len() >= 2 && s.at_ms.saturating_sub(self.samples[1].at_ms) >= self.rule.after_ms {
            self.samples.pop_front();
        }
        let first = *self.samples.front().expect("just pushed");
        let window_ms = s.at_ms.saturating_sub(first.at_ms);
        if window_ms < self.rule.after_ms || window_ms == 0 {
            return None;
        }
        let sent = s.sent_bytes.saturating_sub(first.sent_bytes);
        let bytes_per_s = (u128::from(sent) * 1000 / u128::from(window_ms)).min(u128::from(u64::MAX)) as u64;
        let bar = self.bar_bytes_per_s();
        if bytes_per_s < bar {
            return Some(Stuck {
                window_ms,
                bytes_per_s,
                bar_bytes_per_s: bar,
                best_bytes_per_s: self.reference_bytes_per_s(),
            });
        }
        self.best_bytes_per_s = self.best_bytes_per_s.max(bytes_per_s);
        None
    }
}

/// Whether a connection counts as busy for one reading: it holds a lane back (data waits for quinn),
/// or the parts its lanes have not had answered carry at least what the bar sends in a whole window
/// (`bar_bytes_per_s x after_ms`, and at least one byte), so that a window below the bar cannot be for
/// want of data to send. The second covers a connection whose transfers in flight fit in its
/// `send_window_bytes`: its lanes hand quinn every byte at once and are never held back. With no bar
/// (0) only the first applies.
pub fn busy(held_back: bool, outstanding_bytes: u64, bar_bytes_per_s: u64, after_ms: u64) -> bool {
    if held_back {
        return true;
    }
    let window_bytes = (u128::from(bar_bytes_per_s) * u128::from(after_ms) / 1000).max(1);
    bar_bytes_per_s > 0 && u128::from(outstanding_bytes) >= window_bytes
}

impl Stuck {
    pub fn to_error(self, peer: u64, connection: usize) -> PluginError {
        PluginError::new(
            ReasonCode::TRANSPORT_ERROR,
            format!(
                "connection {connection} to peer {peer} stuck: sent {} B/s over {} ms with data to send, below {} B/s \
                 (stuck_min_bytes_per_s, or stuck_below_best_percent of the best {} B/s of a connection to the peer); \
                 replaced by a new connection",
                self.bytes_per_s, self.window_ms, self.bar_bytes_per_s, self.best_bytes_per_s
            ),
        )
    }
}

/// Watch the connections of `links` until they stop being the peer's current ones; replace them as
/// soon as one is stuck. One task per set of connections, waking `SAMPLES_PER_WINDOW` times a window.
pub async fn watch(shared: Arc<Shared>, entry: Arc<PeerEntry>, links: Arc<Links>) {
    let rule = StuckRule::from_config(&shared.config);
    if !rule.enabled() {
        return;
    }
    let mut detectors: Vec<StallDetector> = links.conns.iter().map(|_| StallDetector::new(rule)).collect();
    let start = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis((rule.after_ms / SAMPLES_PER_WINDOW).max(1)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if !peers::is_current(&entry, &links) {
            return;
        }
        let at_ms = start.elapsed().as_millis() as u64;
        let peer_best = detectors.iter().map(StallDetector::best_bytes_per_s).max().unwrap_or(0);
        for d in detectors.iter_mut() {
            d.set_peer_best(peer_best);
        }
        for (i, conn) in links.conns.iter().enumerate() {
            let (held_back, outstanding_bytes) = links.connection_load(i);
            let busy = busy(held_back, outstanding_bytes, detectors[i].bar_bytes_per_s(), rule.after_ms);
            let sample = Sample { at_ms, sent_bytes: conn.stats().udp_tx.bytes, busy };
            if let Some(stuck) = detectors[i].observe(sample) {
                peers::replace_stuck(&shared, &entry, &links, stuck.to_error(entry.id.0, i));
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WINDOW_MS: u64 = 1000;

    fn rule(min_bytes_per_s: u64, below_best_percent: u64) -> StuckRule {
        StuckRule { after_ms: WINDOW_MS, min_bytes_per_s, below_best_percent }
    }

    fn busy(at_ms: u64, sent_bytes: u64) -> Sample {
        Sample { at_ms, sent_bytes, busy: true }
    }

    #[test]
    fn a_rate_at_the_floor_is_fine_and_one_byte_per_second_below_it_is_stuck() {
        let mut d = StallDetector::new(rule(1000, 0));
        assert_eq!(d.observe(busy(0, 0)), None);
        assert_eq!(d.observe(busy(WINDOW_MS, 1000)), None, "exactly the floor");
        let mut d = StallDetector::new(rule(1000, 0));
        d.observe(busy(0, 0));
        let stuck = d.observe(busy(WINDOW_MS, 999)).expect("just below the floor");
        assert_eq!(stuck, Stuck { window_ms: WINDOW_MS, bytes_per_s: 999, bar_bytes_per_s: 1000, best_bytes_per_s: 0 });
    }

    #[test]
    fn nothing_is_judged_before_a_whole_window_and_it_is_at_the_window() {
        let mut d = StallDetector::new(rule(1000, 0));
        d.observe(busy(0, 0));
        assert_eq!(d.observe(busy(WINDOW_MS - 1, 0)), None, "one millisecond short of stuck_after_ms");
        assert!(d.observe(busy(WINDOW_MS, 0)).is_some(), "at stuck_after_ms");
    }

    #[test]
    fn an_idle_sample_restarts_the_window() {
        let mut d = StallDetector::new(rule(1000, 0));
        d.observe(busy(0, 0));
        d.observe(busy(500, 0));
        assert_eq!(d.observe(Sample { at_ms: 600, sent_bytes: 0, busy: false }), None);
        assert_eq!(d.observe(busy(700, 0)), None);
        assert_eq!(d.observe(busy(1600, 0)), None, "900 ms busy since the idle sample");
        assert!(d.observe(busy(1700, 0)).is_some(), "a whole window busy again");
    }

    #[test]
    fn the_bar_follows_the_best_window_and_a_drop_to_just_below_the_share_is_stuck() {
        let mut d = StallDetector::new(rule(0, 10));
        // 1 MB/s for two windows (sliding, sampled every quarter).
        let mut sent = 0;
        for q in 0..=8u64 {
            sent = q * 250_000;
            assert_eq!(d.observe(busy(q * 250, sent)), None);
        }
        assert_eq!(d.best_bytes_per_s(), 1_000_000);
        assert_eq!(d.bar_bytes_per_s(), 100_000);
        // Then exactly 10 % of it: the window ending 1000 ms after the drop reads 100 000 B/s.
        for q in 9..=12u64 {
            sent += 25_000;
            assert_eq!(d.observe(busy(q * 250, sent)), None, "at 10 % of the best (sample {q})");
        }
        // One byte short over the next window: 99 999 B/s.
        for q in 13..=15u64 {
            sent += 25_000;
            assert_eq!(d.observe(busy(q * 250, sent)), None);
        }
        let stuck = d.observe(busy(16 * 250, sent + 24_999)).expect("just below 10 % of the best");
        assert_eq!(stuck.bytes_per_s, 99_999);
        assert_eq!(stuck.best_bytes_per_s, 1_000_000);
    }

    #[test]
    fn the_bar_follows_the_best_connection_of_the_peer_and_a_rate_just_below_its_share_is_stuck() {
        // This connection reached 100 000 B/s; a sibling to the same peer reached 1 000 000 B/s.
        let mut d = StallDetector::new(rule(0, 10));
        d.observe(busy(0, 0));
        assert_eq!(d.observe(busy(WINDOW_MS, 100_000)), None);
        assert_eq!(d.bar_bytes_per_s(), 10_000, "its own best alone");
        d.set_peer_best(1_000_000);
        assert_eq!(d.bar_bytes_per_s(), 100_000, "10 % of the sibling's best");
        // Exactly the bar over the next window: not stuck; one byte per second less: stuck.
        assert_eq!(d.observe(busy(2 * WINDOW_MS, 200_000)), None, "at 10 % of the peer's best");
        let stuck = d.observe(busy(3 * WINDOW_MS, 299_999)).expect("just below 10 % of the peer's best");
        assert_eq!(stuck.bytes_per_s, 99_999);
        assert_eq!(stuck.best_bytes_per_s, 1_000_000);
        // A lower peer best never lowers the bar below the connection's own.
        let mut d = StallDetector::new(rule(0, 10));
        d.observe(busy(0, 0));
        d.observe(busy(WINDOW_MS, 100_000));
        d.set_peer_best(50_000);
        assert_eq!(d.bar_bytes_per_s(), 10_000);
    }

    #[test]
    fn the_floor_wins_over_a_lower_share() {
        let mut d = StallDetector::new(rule(500_000, 10));
        d.observe(busy(0, 0));
        assert_eq!(d.observe(busy(WINDOW_MS, 1_000_000)), None);
        assert_eq!(d.bar_bytes_per_s(), 500_000, "10 % of 1 MB/s is below the floor");
    }

    #[test]
    fn unanswered_bytes_make_a_connection_busy_from_a_window_of_the_bar_not_one_byte_below() {
        // A bar of 1 MB/s over a 1000 ms window: 1 000 000 unanswered bytes.
        assert!(super::busy(false, 1_000_000, 1_000_000, WINDOW_MS), "exactly a window's worth of the bar");
        assert!(!super::busy(false, 999_999, 1_000_000, WINDOW_MS), "one byte short");
        assert!(super::busy(true, 0, 1_000_000, WINDOW_MS), "a lane held back is busy whatever is outstanding");
        // No bar yet (no best window, no floor): only a lane held back counts.
        assert!(!super::busy(false, u64::MAX, 0, WINDOW_MS));
        assert!(super::busy(true, 0, 0, WINDOW_MS));
        // A bar whose window's worth rounds to nothing still needs a byte outstanding.
        assert!(!super::busy(false, 0, 1, 1));
        assert!(super::busy(false, 1, 1, 1));
    }

    #[test]
    fn a_disabled_rule_never_reports() {
        for r in [StuckRule { after_ms: 0, min_bytes_per_s: 1 << 40, below_best_percent: 50 }, rule(0, 0)] {
            let mut d = StallDetector::new(r);
            for ms in (0..10 * WINDOW_MS).step_by(100) {
                assert_eq!(d.observe(busy(ms, 0)), None);
            }
        }
    }
}
