//! Every plugin kvgate ships passes every clause: the shared-memory plugin in the full profile
//! (10 000-transfer abort storm, 10 000 random lifecycles, 64 MiB transfers).

mod common;
use common::*;

// CONFORMANCE: ABORT-1, ABORT-2, ABORT-3, ABORT-4, TIME-1, TIME-2, TIME-3, TIME-4, TIME-5
// CONFORMANCE: RES-1, RES-2, RES-3, RES-5, DATA-1, DATA-2, DATA-3, DATA-4
// CONFORMANCE: HANDSHAKE-2, HANDSHAKE-3, HANDSHAKE-4, OBS-1, OBS-2, HYGIENE-1, HYGIENE-3, HYGIENE-4
#[test]
fn shm_passes_every_clause_in_the_full_profile() {
    let run = run_harness("builtin:shm", &[], "");
    let not_passed: Vec<_> = run.clauses().into_iter().filter(|(_, s, _)| s != "pass").collect();
    assert!(not_passed.is_empty(), "{not_passed:#?}");
    assert_eq!(run.status, 0);
    assert_eq!(run.report["profile"], "full");
    assert_eq!(run.report["limits"]["storm_transfers"], 10_000);
    assert_eq!(run.report["limits"]["lifecycles"], 10_000);
}
