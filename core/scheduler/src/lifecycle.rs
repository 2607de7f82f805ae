//! The lifecycles of an outgoing transfer (one chunk) and of an incoming ticket (one part) as two
//! declared tables, like the room's (`table`): `transfer_transition(state, input)` and
//! `ticket_transition(state, input)` give the next state, what the event is (accepted, late, or a
//! violated clause) and what it does to the room, or a typed error naming both. The core consults
//! them for every plugin event, for live rooms and settled ones alike (a settled room's record keeps
//! each transfer's and ticket's state); this module holds no data and performs no side effect.

use crate::api::ViolationClause;
use crate::table::IllegalTransition;
use std::fmt;

/// Where an outgoing transfer (one chunk) stands, as far as the core knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum TransferState {
    /// Submitted, no terminal event yet.
    InFlight,
    /// `SUCCEEDED` (implies quiesced).
    Succeeded,
    /// `FAILED`, bytes may still land.
    FailedUnquiesced,
    /// `FAILED` and quiesced (flag or separate event).
    FailedQuiesced,
    /// Forced failed by the plugin-grace timer; bytes may still land.
    ForcedSilent,
}

impl TransferState {
    pub const ALL: [TransferState; 5] = [
        TransferState::InFlight,
        TransferState::Succeeded,
        TransferState::FailedUnquiesced,
        TransferState::FailedQuiesced,
        TransferState::ForcedSilent,
    ];

    /// Counted in its room's `in_flight`: no terminal event yet.
    pub const fn is_in_flight(self) -> bool {
        matches!(self, TransferState::InFlight)
    }

    /// Counted in its room's `unquiesced`: failed (or forced) while bytes may still land.
    pub const fn is_unquiesced(self) -> bool {
        matches!(self, TransferState::FailedUnquiesced | TransferState::ForcedSilent)
    }

    pub const fn as_str(self) -> &'static str {
        match self {
            TransferState::InFlight => "in_flight",
            TransferState::Succeeded => "succeeded",
            TransferState::FailedUnquiesced => "failed_unquiesced",
            TransferState::FailedQuiesced => "failed_quiesced",
            TransferState::ForcedSilent => "forced_silent",
        }
    }
}

/// Everything that can happen to an outgoing transfer: the plugin's events (already told apart by
/// what the core checks: the byte count, the quiesced flag) and the core's own grace timer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum TransferInput {
    /// `SUCCEEDED` reporting the transfer's byte count.
    Succeeded,
    /// `SUCCEEDED` reporting another byte count.
    SucceededBytesMismatch,
    /// `FAILED` with the quiesced flag.
    FailedQuiesced,
    /// `FAILED` without it.
    FailedUnquiesced,
    /// `QUIESCED`.
    Quiesced,
    /// `PROGRESS`.
    Progress,
    /// An event kind the core does not know for an outgoing transfer.
    UnknownKind,
    /// The plugin-grace deadline passed with no terminal event (the core's own input).
    GraceExpired,
}

impl TransferInput {
    pub const ALL: [TransferInput; 8] = [
        TransferInput::Succeeded,
        TransferInput::SucceededBytesMismatch,
        TransferInput::FailedQuiesced,
        TransferInput::FailedUnquiesced,
        TransferInput::Quiesced,
        TransferInput::Progress,
        TransferInput::UnknownKind,
        TransferInput::GraceExpired,
    ];
}

/// Where an incoming ticket (one part of a receiver room) stands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum TicketState {
    /// Open on its plugin: writes may land.
    #[default]
    Open,
    /// Cancelled by the core because the room succeeded: the plugin's `QUIESCED` is the expected
    /// answer.
    CancelledOnSuccess,
    /// Closed by the plugin (`QUIESCED`): nothing more lands.
    Closed,
}

impl TicketState {
    pub const ALL: [TicketState; 3] = [TicketState::Open, TicketState::CancelledOnSuccess, TicketState::Closed];

    pub const fn is_open(self) -> bool {
        matches!(self, TicketState::Open)
    }

    pub const fn as_str(self) -> &'static str {
        match self {
            TicketState::Open => "open",
            TicketState::CancelledOnSuccess => "cancelled_on_success",
            TicketState::Closed => "closed",
        }
    }
}

/// Everything that can happen to an incoming ticket.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum TicketInput {
    /// `QUIESCED` for the ticket.
    Quiesced,
    /// `INCOMING_FAILED` for the ticket.
    IncomingFailed,
    /// An event kind the core does not know for a ticket.
    UnknownKind,
    /// The room succeeded: the core cancels the ticket (the core's own input).
    RoomSucceeded,
}

impl TicketInput {
    pub const ALL: [TicketInput; 4] =
        [TicketInput::Quiesced, TicketInput::IncomingFailed, TicketInput::UnknownKind, TicketInput::RoomSucceeded];
}

/// What an input is, as counted: accepted, late (`LateSource::Plugin`), or a violated clause.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Verdict {
    Accepted,
    Late,
    Violation(ViolationClause),
}

/// What a transfer's input does to its room. Whenever the transfer's state changes in a room that
/// is already terminal, the room is released if nothing of it is left in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum TransferEffect {
    /// Nothing beyond the transfer's state and the count.
    Nothing,
    /// The bytes landed: counted moved; a live room's part moves on.
    Landed,
    /// The transfer failed: a live room fails with the plugin's reason (`plugin_protocol_violation`
    /// when the reason is unknown).
    Failed,
    /// The plugin broke the protocol: a live room fails `plugin_protocol_violation`.
    ProtocolViolation,
}

/// What a ticket's input does to its room.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum TicketEffect {
    /// Nothing beyond the ticket's state and the count.
    Nothing,
    /// The plugin closed the ticket: it no longer counts in flight; a live room fails
    /// `incoming_failed` (writes can no longer land), a quarantined one is released once no ticket
    /// is left open.
    Closed,
    /// The plugin failed the ticket: a live room fails `incoming_failed` with the plugin's reason
    /// (`plugin_protocol_violation` when unknown); for a terminal room the event is late.
    Failed,
    /// The plugin broke the protocol: a live room fails `plugin_protocol_violation`.
    ProtocolViolation,
}

/// One row of a lifecycle table: the next state, the verdict, the effect on the room.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Step<S, E> {
    pub next: S,
    pub verdict: Verdict,
    pub effect: E,
}

pub type TransferStep = Step<TransferState, TransferEffect>;
pub type TicketStep = Step<TicketState, TicketEffect>;

/// An input that the transfer table does not allow in a state (only the core's own inputs can be).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct IllegalTransferTransition {
    pub state: TransferState,
    pub input: TransferInput,
}

/// An input that the ticket table does not allow in a state (only the core's own inputs can be).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct IllegalTicketTransition {
    pub state: TicketState,
    pub input: TicketInput,
}

/// An input one of the core's declared tables refused (a core bug, never expected): counted in
/// `Metrics::illegal_transitions`, the latest kept in `Metrics::latest_illegal_transition`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RefusedInput {
    Room(IllegalTransition),
    Transfer(IllegalTransferTransition),
    Ticket(IllegalTicketTransition),
}

impl fmt::Display for RefusedInput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RefusedInput::Room(illegal) => write!(f, "{illegal}"),
            RefusedInput::Transfer(t) => {
                write!(f, "illegal transfer transition: {:?} in state {}", t.input, t.state.as_str())
            }
            RefusedInput::Ticket(t) => {
                write!(f, "illegal ticket transition: {:?} in state {}", t.input, t.state.as_str())
            }
        }
    }
}

impl From<IllegalTransition> for RefusedInput {
    fn from(illegal: IllegalTransition) -> RefusedInput {
        RefusedInput::Room(illegal)
    }
}

const fn step<S, E>(next: S, verdict: Verdict, effect: E) -> Step<S, E> {
    Step { next, verdict, effect }
}

/// The whole transfer table. A terminal event is taken once: a second one is a duplicate (the
/// room fails `plugin_protocol_violation` if still live), except after the core forced the transfer
/// failed (`ForcedSilent`), where the plugin's belated word is late and says whether bytes can
/// still land.
// CONFORMANCE: ABORT-9, TIME-10
pub const fn transfer_transition(
    state: TransferState,
    input: TransferInput,
) -> Result<TransferStep, IllegalTransferTransition> {
    use TransferEffect as E;
    use TransferInput as I;
    use TransferState as S;
    use Verdict::{Accepted, Late, Violation};
    use ViolationClause as V;
    let row = match (state, input) {
        (S::InFlight, I::Succeeded) => step(S::Succeeded, Accepted, E::Landed),
        (S::InFlight, I::SucceededBytesMismatch) => {
            step(S::FailedQuiesced, Violation(V::SucceededBytesMismatch), E::ProtocolViolation)
        }
        (S::InFlight, I::FailedQuiesced) => step(S::FailedQuiesced, Accepted, E::Failed),
        (S::InFlight, I::FailedUnquiesced) => step(S::FailedUnquiesced, Accepted, E::Failed),
        (S::InFlight, I::Quiesced) => {
            step(S::FailedQuiesced, Violation(V::QuiescedBeforeTerminal), E::ProtocolViolation)
        }
        (S::InFlight, I::Progress) => step(S::InFlight, Accepted, E::Nothing),
        (S::InFlight, I::GraceExpired) => step(S::ForcedSilent, Violation(V::PluginSilent), E::Nothing),
        // Forced failed: the plugin's terminal word comes late; only a quiesce ends it.
        (S::ForcedSilent, I::Succeeded | I::SucceededBytesMismatch) => step(S::Succeeded, Late, E::Nothing),
        (S::ForcedSilent, I::FailedQuiesced) => step(S::FailedQuiesced, Late, E::Nothing),
        (S::ForcedSilent, I::FailedUnquiesced) => step(S::ForcedSilent, Late, E::Nothing),
        (S::ForcedSilent | S::FailedUnquiesced, I::Quiesced) => step(S::FailedQuiesced, Accepted, E::Nothing),
        // A second terminal event.
        (
            S::Succeeded | S::FailedUnquiesced | S::FailedQuiesced,
            I::Succeeded | I::SucceededBytesMismatch | I::FailedQuiesced | I::FailedUnquiesced,
        ) => step(state, Violation(V::DuplicateEvent), E::ProtocolViolation),
        (S::Succeeded | S::FailedQuiesced, I::Quiesced) => step(state, Violation(V::DuplicateEvent), E::Nothing),
        (S::Succeeded | S::FailedUnquiesced | S::FailedQuiesced | S::ForcedSilent, I::Progress) => {
            step(state, Violation(V::EventAfterTerminal), E::Nothing)
        }
        // Never "keep waiting" on a kind this side does not know.
        (_, I::UnknownKind) => step(state, Violation(V::UnknownEventKind), E::ProtocolViolation),
        // The grace timer forces only transfers still in flight.
        (S::Succeeded | S::FailedUnquiesced | S::FailedQuiesced | S::ForcedSilent, I::GraceExpired) => {
            return Err(IllegalTransferTransition { state, input })
        }
    };
    Ok(row)
}

/// The whole ticket table. A ticket is closed once; the `QUIESCED` that answers the core's cancel
/// on success is expected, any other second one is a duplicate.
// CONFORMANCE: ABORT-9
pub const fn ticket_transition(state: TicketState, input: TicketInput) -> Result<TicketStep, IllegalTicketTransition> {
    use TicketEffect as E;
    use TicketInput as I;
    use TicketState as S;
    use Verdict::{Accepted, Violation};
    use ViolationClause as V;
    let row = match (state, input) {
        (S::Open, I::Quiesced) => step(S::Closed, Accepted, E::Closed),
        (S::CancelledOnSuccess, I::Quiesced) => step(S::CancelledOnSuccess, Accepted, E::Nothing),
        (S::Closed, I::Quiesced) => step(S::Closed, Violation(V::DuplicateEvent), E::Nothing),
        (_, I::IncomingFailed) => step(state, Accepted, E::Failed),
        (_, I::UnknownKind) => step(state, Violation(V::UnknownEventKind), E::ProtocolViolation),
        (S::Open, I::RoomSucceeded) => step(S::CancelledOnSuccess, Accepted, E::Nothing),
        // Only an open ticket is cancelled on success.
        (S::CancelledOnSuccess | S::Closed, I::RoomSucceeded) => return Err(IllegalTicketTransition { state, input }),
    };
    Ok(row)
}

/// One rendered row: `state + input -> next, verdict, room: effect` (or `illegal`).
fn render_row(out: &mut String, state: &str, input: String, row: Option<(&str, Verdict, String)>) {
    let outcome = match row {
        Some((next, verdict, effect)) => {
            let verdict = match verdict {
                Verdict::Accepted => "accepted".to_string(),
                Verdict::Late => "late".to_string(),
                Verdict::Violation(clause) => format!("violation {}", clause.as_str()),
            };
            format!("{next}, {verdict}, room: {effect}")
        }
        None => "illegal".to_string(),
    };
    out.push_str(&format!("{state:<20} + {input:<22} -> {outcome}\n"));
}

/// The transfer table as text, one line per (state, input), for the snapshot test and the docs.
pub fn render_transfer_table() -> String {
    let mut out = String::new();
    for state in TransferState::ALL {
        for input in TransferInput::ALL {
            let row = transfer_transition(state, input)
                .ok()
                .map(|step| (step.next.as_str(), step.verdict, format!("{:?}", step.effect)));
            render_row(&mut out, state.as_str(), format!("{input:?}"), row);
        }
    }
    out
}

/// The ticket table as text, one line per (state, input), for the snapshot test and the docs.
pub fn render_ticket_table() -> String {
    let mut out = String::new();
    for state in TicketState::ALL {
        for input in TicketInput::ALL {
            let row = ticket_transition(state, input)
                .ok()
                .map(|step| (step.next.as_str(), step.verdict, format!("{:?}", step.effect)));
            render_row(&mut out, state.as_str(), format!("{input:?}"), row);
        }
    }
    out
}
