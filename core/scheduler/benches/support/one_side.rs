//! One gateway's share of a room lifecycle: a no-op pair records every input one side's core
//! receives for a batch of lifecycles (the caller leaves that untimed), then a shadow core of that
//! side, fed the same inputs since its creation, replays them alone (the caller times that).
//! Included by path next to `noop_pair.rs`; it owns no measurement.

use super::noop_pair::{new_side, Input, NoopPair, Side, A, B, EXPECT_PART, SEND_SLICES, SLOT};
use kvgate_core::*;

/// Lifecycles recorded by the pair, then replayed by the shadow core, at a time.
pub const REPLAY_BATCH: u64 = 1_000;

/// A pair that records one side, and the shadow core of that side.
pub struct OneSide {
    pub pair: NoopPair,
    pub shadow: Core,
    pub side: Side,
}

impl OneSide {
    pub fn new(config: CoreConfig, side: Side) -> OneSide {
        let mut pair = NoopPair::new(config.clone());
        pair.record = Some(side);
        let shadow = new_side(config, NoopPair::START, side);
        OneSide { pair, shadow, side }
    }

    /// Runs `count` lifecycles through the pair, keeping the inputs of this side's core.
    pub fn record(&mut self, count: u64) {
        self.pair.recorded.clear();
        for _ in 0..count {
            self.pair.lifecycle();
        }
    }

    /// Records and replays `lifecycles` in batches of `REPLAY_BATCH`, `replay` doing each batch's
    /// replay; returns the time spent in `replay` alone.
    pub fn in_batches(&mut self, lifecycles: u64, replay: impl Fn(&mut OneSide)) -> std::time::Duration {
        let mut replaying = std::time::Duration::ZERO;
        let mut left = lifecycles;
        while left > 0 {
            let batch = left.min(REPLAY_BATCH);
            self.record(batch);
            let start = std::time::Instant::now();
            replay(self);
            replaying += start.elapsed();
            left -= batch;
        }
        replaying
    }

    /// Feeds the recorded inputs to the shadow core and executes its commands as the pair's
    /// driver does (buffers of executed commands recycled, the rest dropped).
    pub fn replay(&mut self) {
        let core = &mut self.shadow;
        for input in &self.pair.recorded {
            match input {
                Input::Expect { now, room } => core.handle_expect(*now, *room, B, &[&EXPECT_PART[..]], None).unwrap(),
                Input::Send { now, room } => core.handle_send(*now, *room, Some(A), 0, 0, &SEND_SLICES, true).unwrap(),
                Input::PeerMessage { now, from, message } => core.handle_peer_message(*now, *from, message),
                Input::PluginEvent { now, event } => core.handle_plugin_event(*now, SLOT, event),
                Input::Timeout { now } => core.handle_timeout(*now),
            }
            while let Some(command) = core.poll_command() {
                match command {
                    Command::ToPeer { .. } if self.side == Side::Receiver => core.recycle_command(command),
                    Command::ExpectIncoming { .. } | Command::Submit { .. } => core.recycle_command(command),
                    _ => {}
                }
            }
        }
    }

    /// The shadow must be where its side of the pair is: every counter and gauge equal.
    pub fn check_in_step(&self) {
        let original = match self.side {
            Side::Receiver => &self.pair.receiver,
            Side::Sender => &self.pair.sender,
        };
        assert_eq!(self.shadow.metrics(), original.metrics(), "the replayed {:?} core fell out of step", self.side);
        assert!(self.shadow.metrics().rooms_succeeded > 0, "nothing was replayed");
    }
}
