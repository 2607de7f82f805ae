//! Drives every input in every state through the declared transfer and ticket tables and compares
//! the result with the checked-in snapshots. Regenerate after a deliberate change with
//! `KVGATE_UPDATE_SNAPSHOTS=1 cargo test -p kvgate-core --test lifecycle_tables`.
// CONFORMANCE: ABORT-9, TIME-10

use kvgate_core::lifecycle::*;
use kvgate_core::ViolationClause;

fn check_snapshot(name: &str, rendered: &str) {
    let path = format!("{}/tests/snapshots/{name}", env!("CARGO_MANIFEST_DIR"));
    if std::env::var_os("KVGATE_UPDATE_SNAPSHOTS").is_some() {
        std::fs::write(&path, rendered).expect("write snapshot");
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_default();
    if expected != rendered {
        let mut diff = String::new();
        for (old, new) in expected.lines().zip(rendered.lines()) {
            if old != new {
                diff.push_str(&format!("- {old}\n+ {new}\n"));
            }
        }
        let (old_len, new_len) = (expected.lines().count(), rendered.lines().count());
        if old_len != new_len {
            diff.push_str(&format!("(snapshot has {old_len} lines, table renders {new_len})\n"));
        }
        panic!(
            "the table in {name} changed:\n{diff}\nIf the change is deliberate, regenerate with \
             KVGATE_UPDATE_SNAPSHOTS=1 cargo test -p kvgate-core --test lifecycle_tables"
        );
    }
}

#[test]
fn transfer_table_matches_snapshot() {
    let rendered = render_transfer_table();
    assert_eq!(rendered.lines().count(), TransferState::ALL.len() * TransferInput::ALL.len());
    check_snapshot("transfer_table.txt", &rendered);
}

#[test]
fn ticket_table_matches_snapshot() {
    let rendered = render_ticket_table();
    assert_eq!(rendered.lines().count(), TicketState::ALL.len() * TicketInput::ALL.len());
    check_snapshot("ticket_table.txt", &rendered);
}

/// A plugin can send anything: every plugin input has a row in every state (a misbehaving plugin is
/// a counted violation, never an illegal transition). Only the core's own inputs can be refused, and
/// the refusal names the state and the input.
#[test]
fn plugin_inputs_are_total_and_only_the_cores_own_inputs_can_be_refused() {
    for state in TransferState::ALL {
        for input in TransferInput::ALL {
            match transfer_transition(state, input) {
                Ok(_) => {}
                Err(illegal) => {
                    assert_eq!(input, TransferInput::GraceExpired, "a plugin input refused in {state:?}");
                    assert_eq!((illegal.state, illegal.input), (state, input));
                    let text = RefusedInput::Transfer(illegal).to_string();
                    assert!(text.contains(state.as_str()) && text.contains("GraceExpired"), "{text}");
                }
            }
        }
    }
    for state in TicketState::ALL {
        for input in TicketInput::ALL {
            match ticket_transition(state, input) {
                Ok(_) => {}
                Err(illegal) => {
                    assert_eq!(input, TicketInput::RoomSucceeded, "a plugin input refused in {state:?}");
                    assert_eq!((illegal.state, illegal.input), (state, input));
                    let text = RefusedInput::Ticket(illegal).to_string();
                    assert!(text.contains(state.as_str()) && text.contains("RoomSucceeded"), "{text}");
                }
            }
        }
    }
}

/// A transfer takes one terminal event: once it left `InFlight` it never returns there, and a second
/// terminal event is a duplicate (except after the core forced it failed, where it is late).
#[test]
fn a_transfer_never_returns_in_flight_and_a_second_terminal_event_is_never_accepted() {
    let terminal_inputs = [
        TransferInput::Succeeded,
        TransferInput::SucceededBytesMismatch,
        TransferInput::FailedQuiesced,
        TransferInput::FailedUnquiesced,
    ];
    for state in TransferState::ALL.into_iter().filter(|s| *s != TransferState::InFlight) {
        for input in TransferInput::ALL {
            if let Ok(step) = transfer_transition(state, input) {
                assert_ne!(step.next, TransferState::InFlight, "{state:?} + {input:?}");
                if terminal_inputs.contains(&input) {
                    let expected = if state == TransferState::ForcedSilent {
                        Verdict::Late
                    } else {
                        Verdict::Violation(ViolationClause::DuplicateEvent)
                    };
                    assert_eq!(step.verdict, expected, "{state:?} + {input:?}");
                }
            }
        }
    }
    // A quiesced transfer stays quiesced: nothing leads from a state where no byte can land to one
    // where bytes may.
    for state in [TransferState::Succeeded, TransferState::FailedQuiesced] {
        for input in TransferInput::ALL {
            if let Ok(step) = transfer_transition(state, input) {
                assert!(
                    !step.next.is_in_flight() && !step.next.is_unquiesced(),
                    "{state:?} + {input:?} -> {:?}",
                    step.next
                );
            }
        }
    }
}

/// A closed ticket never reopens, and an unknown event kind always fails a live room.
#[test]
fn a_ticket_never_reopens_and_unknown_kinds_are_never_kept_waiting() {
    for state in TicketState::ALL {
        for input in TicketInput::ALL {
            if let Ok(step) = ticket_transition(state, input) {
                if !state.is_open() {
                    assert!(!step.next.is_open(), "{state:?} + {input:?} reopened the ticket");
                }
            }
        }
        let unknown = ticket_transition(state, TicketInput::UnknownKind).unwrap();
        assert_eq!(unknown.effect, TicketEffect::ProtocolViolation);
        assert_eq!(unknown.verdict, Verdict::Violation(ViolationClause::UnknownEventKind));
    }
    for state in TransferState::ALL {
        let unknown = transfer_transition(state, TransferInput::UnknownKind).unwrap();
        assert_eq!(unknown.effect, TransferEffect::ProtocolViolation);
        assert_eq!(unknown.verdict, Verdict::Violation(ViolationClause::UnknownEventKind));
    }
}
