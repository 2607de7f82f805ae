//! The room state machine as one declared transition table: `transition(state, input)` gives the next
//! state or a typed error naming both. The core consults it for every state change; this module
//! holds no data and performs no side effect.

use crate::api::RoomState;
use std::fmt;

/// Everything that can happen to an existing room.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub enum RoomInput {
    /// An engine expect for this room and generation (always a duplicate once the room exists).
    Expect,
    /// An engine send accepted for this room.
    Send,
    /// The receiver's expect notice reached the sender.
    ExpectNotice,
    /// The sender's `Matched` reached the receiver.
    Matched,
    /// A transfer of the room succeeded (its part not yet complete, or other parts remain).
    ChunkSucceeded,
    /// A part completed and others remain.
    PartDone,
    /// The last outstanding part completed.
    AllPartsDone,
    /// The local engine aborted the room.
    EngineAbort,
    /// The peer's engine aborted the room.
    PeerAbort,
    /// The peer's side of the room failed.
    PeerRoomFailed,
    /// The peer link was lost.
    PeerLost,
    /// A plugin failed a transfer or ticket, broke the protocol, or went unhealthy.
    PluginFailure,
    /// The room could not be started as announced (layout, length, region errors at match time).
    MatchFailure,
    /// A newer generation of the room id arrived.
    Superseded,
    BootstrapTimer,
    TransferTimer,
    RoomTimer,
    PluginGraceTimer,
    QuarantineTimer,
    /// Every transfer (or ticket) that could touch the room's memory is quiesced.
    Quiesced,
    /// The room failed with nothing that could still touch its memory.
    NothingInFlight,
    TombstoneTimer,
}

impl RoomInput {
    pub const ALL: [RoomInput; 22] = [
        RoomInput::Expect,
        RoomInput::Send,
        RoomInput::ExpectNotice,
        RoomInput::Matched,
        RoomInput::ChunkSucceeded,
        RoomInput::PartDone,
        RoomInput::AllPartsDone,
        RoomInput::EngineAbort,
        RoomInput::PeerAbort,
        RoomInput::PeerRoomFailed,
        RoomInput::PeerLost,
        RoomInput::PluginFailure,
        RoomInput::MatchFailure,
        RoomInput::Superseded,
        RoomInput::BootstrapTimer,
        RoomInput::TransferTimer,
        RoomInput::RoomTimer,
        RoomInput::PluginGraceTimer,
        RoomInput::QuarantineTimer,
        RoomInput::Quiesced,
        RoomInput::NothingInFlight,
        RoomInput::TombstoneTimer,
    ];
}

/// An input that the table does not allow in a state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct IllegalTransition {
    pub state: RoomState,
    pub input: RoomInput,
}

impl fmt::Display for IllegalTransition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "illegal transition: {:?} in state {}", self.input, self.state)
    }
}
impl std::error::Error for IllegalTransition {}

/// The whole table. Terminal states are absorbing: the only transitions out of `Succeeded` and
/// `Failed` are none (a tombstone expiry keeps the state; the core then drops the room), and
/// `Quarantined` only moves to `Failed` (memory released), never back to a live state.
// CONFORMANCE: ABORT-5
pub const fn transition(state: RoomState, input: RoomInput) -> Result<RoomState, IllegalTransition> {
    use RoomInput as I;
    use RoomState as S;
    let next = match (state, input) {
        // Sender bootstrap.
        (S::WaitingExpect, I::Send) => S::WaitingExpect,
        (S::WaitingExpect, I::ExpectNotice) => S::Transferring,
        (S::WaitingSend, I::Send) => S::Transferring,
        // Receiver bootstrap.
        (S::WaitingSender, I::Matched) => S::Transferring,
        (S::WaitingSender, I::PartDone) => S::Transferring,
        (S::WaitingSender, I::AllPartsDone) => S::Succeeded,
        // Moving bytes.
        (S::Transferring, I::Send) => S::Transferring,
        (S::Transferring, I::ChunkSucceeded) => S::Transferring,
        (S::Transferring, I::PartDone) => S::Transferring,
        (S::Transferring, I::AllPartsDone) => S::Succeeded,
        (S::Transferring, I::TransferTimer) => S::Quarantined,
        (S::Transferring, I::PluginGraceTimer) => S::Quarantined,
        (S::WaitingExpect | S::WaitingSend | S::WaitingSender, I::BootstrapTimer) => S::Quarantined,
        // Any failure of a live room: terminal at once, memory quarantined until released.
        // CONFORMANCE: ABORT-6
        (
            S::WaitingExpect | S::WaitingSend | S::WaitingSender | S::Transferring,
            I::EngineAbort
            | I::PeerAbort
            | I::PeerRoomFailed
            | I::PeerLost
            | I::PluginFailure
            | I::MatchFailure
            | I::Superseded
            | I::RoomTimer,
        ) => S::Quarantined,
        // Quarantine: only released, never revived.
        // CONFORMANCE: RES-4
        (S::Quarantined, I::PluginGraceTimer) => S::Quarantined,
        (S::Quarantined, I::Quiesced | I::NothingInFlight | I::QuarantineTimer) => S::Failed,
        // Settled terminal rooms: the tombstone expires (the core drops the room).
        (S::Succeeded | S::Failed, I::TombstoneTimer) => state,
        _ => return Err(IllegalTransition { state, input }),
    };
    Ok(next)
}

/// `transition` evaluated once at compile time: `NEXT[state][input]` is the next state's index in
/// `RoomState::ALL`, or `ILLEGAL`. The core's hot path reads this; `transition` stays the one
/// declaration of the table.
const ILLEGAL: u8 = u8::MAX;
const NEXT: [[u8; RoomInput::ALL.len()]; RoomState::COUNT] = {
    let mut table = [[ILLEGAL; RoomInput::ALL.len()]; RoomState::COUNT];
    let mut s = 0;
    while s < RoomState::COUNT {
        let mut i = 0;
        while i < RoomInput::ALL.len() {
            let input = RoomInput::ALL[i];
            table[s][input as usize] = match transition(RoomState::ALL[s], input) {
                Ok(next) => next as u8,
                Err(_) => ILLEGAL,
            };
            i += 1;
        }
        s += 1;
    }
    table
};

/// `transition(state, input)` by table lookup.
#[inline]
pub(crate) fn transition_by_table(state: RoomState, input: RoomInput) -> Result<RoomState, IllegalTransition> {
    match NEXT[state as usize][input as usize] {
        ILLEGAL => Err(IllegalTransition { state, input }),
        next => Ok(RoomState::ALL[next as usize]),
    }
}

/// The table as text, one line per (state, input), for the snapshot test and the docs.
pub fn render_table() -> String {
    let mut out = String::new();
    for state in RoomState::ALL {
        for input in RoomInput::ALL {
            let outcome = match transition(state, input) {
                Ok(next) => next.as_str().to_string(),
                Err(_) => "illegal".to_string(),
            };
            out.push_str(&format!("{:<14} + {:<17} -> {}\n", state.as_str(), format!("{input:?}"), outcome));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_compiled_table_agrees_with_the_declared_one_everywhere() {
        for state in RoomState::ALL {
            for input in RoomInput::ALL {
                assert_eq!(transition_by_table(state, input), transition(state, input), "{state:?} + {input:?}");
            }
        }
    }
}
