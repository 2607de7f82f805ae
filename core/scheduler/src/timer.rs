//! The core's one timer table: every deadline a room can have, with what its firing means. The core
//! handles every expiry in one match (`Core::on_timer`); this module never decides an outcome.

/// One deadline of one room. Armed and cancelled by the core; at most one of each kind per room.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TimerKind {
    /// Armed when the room is created. Firing: the counterpart (expect notice, first send, or the
    /// sender's `Matched`) never appeared — the room fails `bootstrap_timeout`.
    Bootstrap = 0,
    /// Armed when bytes may start moving (sender: first submit; receiver: `Matched`), at
    /// `transfer_base_ms + bytes / min_bandwidth_bytes_per_s`. Firing: `transfer_timeout`.
    Transfer = 1,
    /// Armed when the room is created, at its overall deadline. Firing: `room_timeout`.
    Room = 2,
    /// Armed at the first submit (transfer deadline + `plugin_grace_ms`) and re-armed at cancel
    /// (+ `plugin_grace_ms`). Firing: every transfer still without a terminal event is forced failed
    /// and counted as a `plugin_silent` contract violation (the room fails `plugin_silent` if live).
    PluginGrace = 3,
    /// Armed when a room fails with writes possibly in flight. Firing: the memory is released
    /// without a quiesce (`Reusable` with `quarantine_timeout`).
    Quarantine = 4,
    /// Armed when a terminal room is settled (reusable). Firing: the tombstone is dropped; late
    /// messages for the room are no longer recognised as such. Kept in the core's tombstone FIFO,
    /// not the wheel (one constant ttl: settle order is expiry order).
    Tombstone = 5,
}

impl TimerKind {
    pub const COUNT: usize = 6;
    pub const ALL: [TimerKind; 6] = [
        TimerKind::Bootstrap,
        TimerKind::Transfer,
        TimerKind::Room,
        TimerKind::PluginGrace,
        TimerKind::Quarantine,
        TimerKind::Tombstone,
    ];
    pub fn index(self) -> usize {
        self as usize
    }
    pub fn as_str(self) -> &'static str {
        match self {
            TimerKind::Bootstrap => "bootstrap",
            TimerKind::Transfer => "transfer",
            TimerKind::Room => "room",
            TimerKind::PluginGrace => "plugin_grace",
            TimerKind::Quarantine => "quarantine",
            TimerKind::Tombstone => "tombstone",
        }
    }
    /// The kinds kept in the wheel (every kind but `Tombstone`, which expires from the tombstone
    /// FIFO: its duration is one constant, so expiry order is insertion order).
    pub(crate) const WHEEL: [TimerKind; 5] =
        [TimerKind::Bootstrap, TimerKind::Transfer, TimerKind::Room, TimerKind::PluginGrace, TimerKind::Quarantine];
    pub(crate) fn bit(self) -> u8 {
        1 << self as u8
    }
}
