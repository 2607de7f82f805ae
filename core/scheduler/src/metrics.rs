//! Plain-data counters and gauges of one core (`Metrics`), and the codes they are keyed by.
//! The core updates them in O(1) per event; this module never formats or exports them (the gateway
//! does) and never reads a clock (ages take `now`).

use crate::api::{At, FailReason, Phase, RefusalReason, RoomState, Span, ViolationClause};
use serde::{Deserialize, Serialize};

/// Where a late message (for a terminal, tombstoned or older-generation room) came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LateSource {
    Engine,
    Peer,
    Plugin,
}

impl LateSource {
    pub const ALL: [LateSource; 3] = [LateSource::Engine, LateSource::Peer, LateSource::Plugin];
    pub const COUNT: usize = 3;
    pub fn index(self) -> usize {
        self as usize
    }
    pub fn as_str(self) -> &'static str {
        match self {
            LateSource::Engine => "engine",
            LateSource::Peer => "peer",
            LateSource::Plugin => "plugin",
        }
    }
}

/// Why an engine abort changed nothing (each counted once per abort request).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HarmlessAbort {
    /// The room was already aborted.
    Duplicate,
    /// The room was already terminal for another cause.
    AfterTerminal,
    /// No such room: a tombstone is recorded so a late counterpart is refused.
    Unknown,
}

impl HarmlessAbort {
    pub const ALL: [HarmlessAbort; 3] =
        [HarmlessAbort::Duplicate, HarmlessAbort::AfterTerminal, HarmlessAbort::Unknown];
    pub const COUNT: usize = 3;
    pub fn index(self) -> usize {
        self as usize
    }
    pub fn as_str(self) -> &'static str {
        match self {
            HarmlessAbort::Duplicate => "duplicate",
            HarmlessAbort::AfterTerminal => "after_terminal",
            HarmlessAbort::Unknown => "unknown",
        }
    }
}

/// Counters and gauges of one core. Arrays are indexed by the key enum's `index()`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Metrics {
    /// Rooms per state (gauge), by `RoomState::index()`; terminal states count tombstones too.
    pub rooms_by_state: [u64; RoomState::COUNT],
    /// When the room that has waited longest in each non-terminal state entered it (gauge; `None`
    /// when the state is empty; always `None` for terminal states).
    pub oldest_entered_by_state: [Option<At>; RoomState::COUNT],
    pub rooms_created: u64,
    pub rooms_succeeded: u64,
    /// Failures by `FailReason::index()` then `Phase::index()`. `quarantine_timeout` is counted here
    /// too (phase `terminal`) when a quarantine is released by its timer.
    pub failures: [[u64; Phase::COUNT]; FailReason::COUNT],
    /// Engine requests refused, by `RefusalReason::index()`.
    pub refusals: [u64; RefusalReason::COUNT],
    /// Engine aborts that terminated a live room.
    pub aborts: u64,
    /// Engine aborts that changed nothing, by `HarmlessAbort::index()`.
    pub aborts_harmless: [u64; HarmlessAbort::COUNT],
    /// Plugin contract violations by `ViolationClause::index()` (expected to stay 0).
    pub violations: [u64; ViolationClause::COUNT],
    /// Late messages refused, by `LateSource::index()`.
    pub late_messages: [u64; LateSource::COUNT],
    /// Inputs one of the core's declared tables refused (room, transfer or ticket: a bug in the
    /// core, never expected); the latest is kept so the gateway can say which.
    pub illegal_transitions: u64,
    pub latest_illegal_transition: Option<crate::lifecycle::RefusedInput>,
    /// Bytes of memory held in quarantine now (gauge).
    pub quarantined_bytes: u64,
    /// Bytes confirmed moved (`SUCCEEDED` transfers).
    pub bytes_moved: u64,
    pub submits: u64,
    pub segments_submitted: u64,
    /// Tombstones now (gauge), and those dropped early by `max_tombstones`.
    pub tombstones: u64,
    pub tombstones_evicted: u64,
    /// Chunks held without an expect notice (gauge).
    pub pending_sends: u64,
}

impl Metrics {
    /// How long at `now` the longest-waiting room in non-terminal `state` has been in it.
    pub fn oldest_age(&self, state: RoomState, now: At) -> Option<Span> {
        self.oldest_entered_by_state[state.index()].map(|created| now.saturating_since(created))
    }
    pub fn failures_total(&self) -> u64 {
        self.failures.iter().flatten().sum()
    }
    pub fn failures_by_reason(&self, reason: FailReason) -> u64 {
        self.failures[reason.index()].iter().sum()
    }
    pub fn violations_total(&self) -> u64 {
        self.violations.iter().sum()
    }
    pub fn violation(&self, clause: ViolationClause) -> u64 {
        self.violations[clause.index()]
    }
    pub fn late_total(&self) -> u64 {
        self.late_messages.iter().sum()
    }
    pub fn refusal(&self, reason: RefusalReason) -> u64 {
        self.refusals[reason.index()]
    }
    pub fn live_rooms(&self) -> u64 {
        RoomState::ALL.iter().filter(|s| !s.is_terminal()).map(|s| self.rooms_by_state[s.index()]).sum()
    }
}
