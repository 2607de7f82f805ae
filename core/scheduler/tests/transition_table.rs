//! Drives every input in every state through the declared transition table and compares the result
//! with the checked-in snapshot. Regenerate after a deliberate change with
//! `KVGATE_UPDATE_SNAPSHOTS=1 cargo test -p kvgate-core --test transition_table`.
// CONFORMANCE: ABORT-5

use kvgate_core::*;

const SNAPSHOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/snapshots/transition_table.txt");

#[test]
fn transition_table_matches_snapshot() {
    let rendered = render_table();
    if std::env::var_os("KVGATE_UPDATE_SNAPSHOTS").is_some() {
        std::fs::write(SNAPSHOT, &rendered).expect("write snapshot");
        return;
    }
    let expected = std::fs::read_to_string(SNAPSHOT).unwrap_or_default();
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
            "the transition table changed:\n{diff}\nIf the change is deliberate, regenerate with \
             KVGATE_UPDATE_SNAPSHOTS=1 cargo test -p kvgate-core --test transition_table"
        );
    }
}

#[test]
fn every_state_and_input_gives_a_state_or_a_typed_error_naming_both() {
    for state in RoomState::ALL {
        for input in RoomInput::ALL {
            match transition(state, input) {
                Ok(next) => {
                    if state.is_terminal() {
                        assert!(next.is_terminal(), "terminal {state} left for {next} on {input:?}");
                    }
                    if matches!(state, RoomState::Succeeded | RoomState::Failed) {
                        assert_eq!(next, state, "settled terminal states are absorbing");
                    }
                }
                Err(error) => {
                    assert_eq!((error.state, error.input), (state, input));
                    assert!(error.to_string().contains(state.as_str()));
                }
            }
        }
    }
}

#[test]
fn every_live_state_can_be_aborted_and_times_out() {
    // CONFORMANCE: ABORT-6, TIME-6
    for state in RoomState::ALL.into_iter().filter(|s| !s.is_terminal()) {
        assert_eq!(transition(state, RoomInput::EngineAbort), Ok(RoomState::Quarantined));
        assert_eq!(transition(state, RoomInput::RoomTimer), Ok(RoomState::Quarantined));
        assert_eq!(transition(state, RoomInput::PeerLost), Ok(RoomState::Quarantined));
    }
}
