//! Proves the harness: every mutant fails on the clause it breaks and on no clause outside that
//! clause's group, with evidence; the faithful base plugin (`reference`, and `reference-udp` over
//! loopback UDP) passes every clause; a plugin that is unavailable is unsupported everywhere, never
//! pass. Quick profile; runs serialised.

mod common;
use common::*;

/// Every mutant runs with a paced copy (20 µs per segment), so cancels land mid-copy.
const MUTANT_CONFIG: &str = "[plugin]\nsegment_delay_us = 20\n";

fn assert_fails_only_on(defect: &str, clause: &str) {
    assert_fails_only_on_each(defect, &[clause]);
}

/// For a defect that breaks more than one clause (each named): every one fails, with evidence, and
/// nothing outside their groups does.
fn assert_fails_only_on_each(defect: &str, clauses: &[&str]) {
    assert_fails_on_each_and_perhaps(defect, clauses, &[]);
}

/// As [`assert_fails_only_on_each`], and `perhaps` (clauses outside those groups) may fail too: a
/// defect that breaks them only when the run's timing goes one way.
fn assert_fails_on_each_and_perhaps(defect: &str, clauses: &[&str], perhaps: &[&str]) {
    let groups: Vec<&str> = clauses.iter().map(|c| c.split('-').next().unwrap()).collect();
    let run = run_mutant(defect, &["--quick"], MUTANT_CONFIG);
    let failed = run.with_status("fail");
    for clause in clauses {
        assert!(failed.iter().any(|c| c == clause), "{defect} must fail {clause}; failed: {failed:?}\n{}", run.stdout);
        let (_, _, evidence) = run.clauses().into_iter().find(|(id, _, _)| id == clause).unwrap();
        assert!(evidence.len() > 20, "evidence for {clause} must say what was seen: {evidence:?}");
    }
    let outside: Vec<&String> = failed
        .iter()
        .filter(|c| !groups.iter().any(|g| c.starts_with(&format!("{g}-"))) && !perhaps.contains(&c.as_str()))
        .collect();
    assert!(outside.is_empty(), "{defect} must fail only {groups:?} clauses; also failed {outside:?}\n{}", run.stdout);
    assert_eq!(run.status, 1, "exit status must be non-zero when a clause fails");
    for (id, status, evidence) in run.clauses() {
        if status == "unsupported" {
            assert!(may_be_unsupported(&id, &evidence), "{defect}: {id} unsupported: {evidence}");
        }
    }
    assert!(
        run.with_status("not_exercised").is_empty(),
        "{defect}: every clause's situation must arise\n{}",
        run.stdout
    );
    assert_eq!(run.report["certified"], false);
}

#[test]
fn reference_plugin_passes_every_clause() {
    let run = run_mutant("reference", &["--quick"], MUTANT_CONFIG);
    assert_all_pass(&run, false);
    assert_eq!(run.report["abi_version"], kvgate_abi::ABI_VERSION);
    assert_eq!(run.report["seed"], 20261130u64);
}

/// The base's network variant, through the harness's UDP fault proxy: the network clauses pass too,
/// so the two network mutants below fail for their defect, not for the variant.
#[test]
fn reference_plugin_over_udp_passes_every_clause_the_network_ones_included() {
    let run = run_mutant("reference-udp", &["--quick"], MUTANT_CONFIG);
    assert_all_pass(&run, true);
}

// CONFORMANCE: DATA-7
#[test]
fn unchecked_payloads_fails_data_7() {
    assert_fails_only_on("unchecked-payloads", "DATA-7");
}

// CONFORMANCE: TIME-12, DATA-7, TIME-2, TIME-3 (one defect: a window the receiver never takes, whether
// the network drops or damages it or the receiver is frozen or dead, is waited for for ever)
#[test]
fn window_without_deadline_fails_time_12_and_data_7() {
    assert_fails_only_on_each("window-without-deadline", &["TIME-12", "DATA-7", "TIME-2", "TIME-3"]);
}

// CONFORMANCE: ABORT-1 (the SGLang/NIXL silent pin), RES-1 (TIME-5 cancels its thousand transfers
// waiting for an unauthorised ticket and leaves them: the pin keeps them without a terminal event)
#[test]
fn silent_pin_fails_abort_1() {
    assert_fails_only_on_each("silent-pin", &["ABORT-1", "RES-1"]);
}

// CONFORMANCE: TIME-2
#[test]
fn frozen_peer_hang_fails_time_2() {
    assert_fails_only_on("frozen-peer-hang", "TIME-2");
}

// CONFORMANCE: TIME-5, ABORT-4 (the storm is submitted to a frozen receiver, and the blocked submit
// never returns)
#[test]
fn block_in_submit_fails_time_5() {
    assert_fails_only_on_each("block-in-submit", &["TIME-5", "ABORT-4"]);
}

// CONFORMANCE: RES-1
#[test]
fn double_success_fails_res_1() {
    assert_fails_only_on("double-success", "RES-1");
}

// CONFORMANCE: RES-2
#[test]
fn leak_on_abort_fails_res_2() {
    assert_fails_only_on("leak-on-abort", "RES-2");
}

// CONFORMANCE: RES-3
#[test]
fn write_after_cancel_fails_res_3() {
    assert_fails_only_on("write-after-cancel", "RES-3");
}

// CONFORMANCE: RES-3 (quiesced reported while the copy worker still writes the segment in progress:
// seen by watching the destination continuously from the report, in the mid-transfer cases)
#[test]
fn premature_quiesce_fails_res_3() {
    assert_fails_only_on("premature-quiesce", "RES-3");
}

// CONFORMANCE: RES-3 (a success after a cancel whose bytes landed after the cancel returned). ABORT-2
// may fail too: when its own mid-transfer cancel is ignored and the rest of the copy and the
// acknowledgement take longer than G, the terminal event is late.
#[test]
fn ignores_cancel_mid_transfer_fails_res_3() {
    assert_fails_on_each_and_perhaps("ignores-cancel-mid-transfer", &["RES-3"], &["ABORT-2"]);
}

// CONFORMANCE: ABORT-4 (cancels slow only under load: fast with a few transfers live, so ABORT-1,
// ABORT-2 and the 5 s storm pass; the loaded case times each of 400 cancels, made with hundreds of
// transfers live under a granted ticket, against G). Caught on other seeds and in the full profile
// too: the clause alone, a few seconds a run.
#[test]
fn cancel_slow_under_load_fails_abort_4() {
    let package = "cancel-slow-under-load";
    assert_fails_only_on(package, "ABORT-4");
    for (seed, profile) in [(1u64, &["--quick"][..]), (2, &["--quick"][..]), (3, &[][..])] {
        let args: Vec<&str> = profile.iter().copied().chain(["--clauses", "ABORT-4"]).collect();
        let run = run_mutant_with_seed(package, seed, &args, MUTANT_CONFIG);
        let (_, status, evidence) = run.clauses().into_iter().find(|(id, _, _)| id == "ABORT-4").unwrap();
        assert_eq!(status, "fail", "seed {seed} {profile:?}: {}", run.stdout);
        // In the full profile the 10 000-transfer storm's cancels, queued first, already overrun the
        // storm grace, and the loaded case's wait behind them: the evidence says so instead.
        assert!(
            evidence.contains("later than G") || profile.is_empty(),
            "seed {seed}: the evidence names the late cancels: {evidence}"
        );
    }
    // The faithful base meets G in the same case, hundreds of transfers live.
    let run = run_mutant("reference", &["--quick", "--clauses", "ABORT-4"], MUTANT_CONFIG);
    let (_, status, evidence) = run.clauses().into_iter().find(|(id, _, _)| id == "ABORT-4").unwrap();
    assert_eq!(status, "pass", "{}", run.stdout);
    assert!(
        evidence.contains("cancels under load")
            && !evidence.contains(
                "cancels under load (a live transfer reached with at least 100 live, bytes seen moving): 0 of"
            ),
        "{evidence}"
    );
}

// CONFORMANCE: DATA-1
#[test]
fn early_success_fails_data_1() {
    assert_fails_only_on("early-success", "DATA-1");
}

// CONFORMANCE: DATA-3
#[test]
fn accepts_bad_segment_fails_data_3() {
    assert_fails_only_on("accepts-bad-segment", "DATA-3");
}

// CONFORMANCE: HANDSHAKE-3
#[test]
fn accepts_cuda_region_fails_handshake_3() {
    assert_fails_only_on("accepts-cuda-region", "HANDSHAKE-3");
}

// CONFORMANCE: OBS-1
#[test]
fn reasonless_failure_fails_obs_1() {
    assert_fails_only_on("reasonless-failure", "OBS-1");
}

// CONFORMANCE: HYGIENE-1
#[test]
fn panic_in_submit_fails_hygiene_1() {
    assert_fails_only_on("panic-in-submit", "HYGIENE-1");
}

// CONFORMANCE: OBS-2
#[test]
fn stale_stats_fails_obs_2() {
    assert_fails_only_on("stale-stats", "OBS-2");
}

// CONFORMANCE: HYGIENE-3
#[test]
fn ignores_bad_config_fails_hygiene_3() {
    assert_fails_only_on("ignores-bad-config", "HYGIENE-3");
}

// CONFORMANCE: HANDSHAKE-4
#[test]
fn accepts_bad_endpoint_fails_handshake_4() {
    assert_fails_only_on("accepts-bad-endpoint", "HANDSHAKE-4");
}

// CONFORMANCE: RES-5
#[test]
fn silent_shutdown_fails_res_5() {
    assert_fails_only_on("silent-shutdown", "RES-5");
}

// CONFORMANCE: ABORT-4, RES-1 (TIME-5's thousand cancelled transfers are dropped the same way and
// never end)
#[test]
fn drops_cancels_when_busy_fails_abort_4() {
    assert_fails_only_on_each("drops-cancels-when-busy", &["ABORT-4", "RES-1"]);
}

// CONFORMANCE: DATA-2
#[test]
fn truncated_scatter_list_fails_data_2() {
    assert_fails_only_on("truncated-scatter-list", "DATA-2");
}

// CONFORMANCE: TIME-1
#[test]
fn late_ticket_deadline_fails_time_1() {
    assert_fails_only_on("late-ticket-deadline", "TIME-1");
}

// CONFORMANCE: TIME-4
#[test]
fn copies_past_deadline_fails_time_4() {
    assert_fails_only_on("copies-past-deadline", "TIME-4");
}

// CONFORMANCE: ABORT-2
#[test]
fn cancel_waits_for_ack_fails_abort_2() {
    assert_fails_only_on("cancel-waits-for-ack", "ABORT-2");
}

// CONFORMANCE: DATA-4
#[test]
fn fail_open_deregister_fails_data_4() {
    assert_fails_only_on("fail-open-deregister", "DATA-4");
}

// CONFORMANCE: TIME-3, HANDSHAKE-2 (one defect, two clauses: both fail transfers at disconnect)
#[test]
fn disconnect_keeps_transfers_fails_time_3_and_handshake_2() {
    assert_fails_only_on_each("disconnect-keeps-transfers", &["TIME-3", "HANDSHAKE-2"]);
}

// CONFORMANCE: ABORT-3, RES-1 (one defect, two clauses: RES-1 checks every event of the run)
#[test]
fn fails_unknown_cancels_fails_abort_3_and_res_1() {
    assert_fails_only_on_each("fails-unknown-cancels", &["ABORT-3", "RES-1"]);
}

// CONFORMANCE: RES-1 (a transfer with no terminal event at all, found by the run-wide invariant at the
// end of the clauses whose own checks do not wait for every transfer: TIME-5, RES-2)
#[test]
fn loses_terminal_event_fails_res_1() {
    assert_fails_only_on("loses-terminal-event", "RES-1");
    let run = run_mutant("loses-terminal-event", &["--quick", "--clauses", "TIME-5,RES-1"], MUTANT_CONFIG);
    let (_, status, evidence) = run.clauses().into_iter().find(|(id, _, _)| id == "RES-1").unwrap();
    assert_eq!(status, "fail", "{}", run.stdout);
    assert!(
        evidence.contains("[TIME-5]") && evidence.contains("never got a terminal event in clause TIME-5"),
        "the evidence names the clause and the transfer: {evidence}"
    );
    assert!(evidence.contains("transfer "), "{evidence}");
}

// CONFORMANCE: OBS-5
#[test]
fn progress_backwards_fails_obs_5() {
    assert_fails_only_on("progress-backwards", "OBS-5");
    let run = run_mutant("progress-backwards", &["--quick", "--clauses", "OBS-5"], MUTANT_CONFIG);
    let (_, status, evidence) = run.clauses().into_iter().find(|(id, _, _)| id == "OBS-5").unwrap();
    assert_eq!(status, "fail", "OBS-5's own transfers show it: {}", run.stdout);
    assert!(evidence.contains("went backwards"), "{evidence}");
}

// CONFORMANCE: HYGIENE-3
#[test]
fn unavailable_plugin_is_unsupported_everywhere_never_pass() {
    let run = run_mutant("unavailable", &["--quick"], MUTANT_CONFIG);
    let clauses = run.clauses();
    assert_eq!(clauses.len(), kvgate_conformance::registry::registry().len());
    for (id, status, evidence) in &clauses {
        assert_eq!(status, "unsupported", "{id}: {evidence}");
        assert!(evidence.contains("unavailable"), "{id}: {evidence}");
    }
    assert_eq!(run.status, 0, "unsupported is not a failure");
}

/// Every crate under `tests/mutants/` (but the base) is run by a test in this file and named in
/// CONFORMANCE.md: a broken plugin in its table of mutants, a reference plugin by its path. A mutant
/// added without either, or a row left behind by one removed, fails here.
#[test]
fn every_mutant_is_tested_here_and_listed_in_conformance_md() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let tests = include_str!("mutants.rs");
    let doc = std::fs::read_to_string(root.join("CONFORMANCE.md")).expect("CONFORMANCE.md");
    // The base's defects, and the mutant crates beside the base and its library (UCX's wrapper).
    let mut names: Vec<String> = kvgate_mutant_base::DEFECTS.iter().map(|d| d.name.to_string()).collect();
    for entry in std::fs::read_dir(root.join("tests/mutants")).expect("tests/mutants") {
        let dir = entry.expect("entry").file_name().to_string_lossy().into_owned();
        if dir != "base" && dir != "library" {
            assert!(
                tests.contains(&format!("\"kvgate-mutant-{dir}\"")),
                "tests/mutants/{dir} is run by no test in mutants.rs"
            );
            names.push(dir);
        }
    }
    names.sort();
    assert!(names.len() >= 30, "{names:?}");
    let section = doc.split("\n## Mutants\n").nth(1).expect("a Mutants section").split("\n## ").next().unwrap_or("");
    let rows: Vec<&str> =
        section.lines().filter(|l| l.starts_with("| `")).map(|l| l.split('`').nth(1).unwrap_or("")).collect();
    for name in &names {
        let run_by_a_test =
            tests.contains(&format!("\"{name}\"")) || tests.contains(&format!("\"kvgate-mutant-{name}\""));
        assert!(run_by_a_test, "the mutant {name} is run by no test in mutants.rs");
        if name.starts_with("reference") {
            assert!(doc.contains(&format!("`{name}`")), "CONFORMANCE.md does not name the faithful variant {name}");
        } else {
            assert!(
                rows.contains(&name.replace('-', "_").as_str()),
                "CONFORMANCE.md's table of mutants has no row for {name}"
            );
        }
    }
    assert!(rows.len() >= 28, "{rows:?}");
    for row in &rows {
        assert!(names.contains(&row.replace('_', "-")), "CONFORMANCE.md lists `{row}`, which is no mutant");
    }
}

// CONFORMANCE: HYGIENE-1 (a host that dies with no call in progress: TIME-2 freezes the receiver for
// longer than the mutant's watchdog allows, and makes no call to it after resuming it, so only the
// end-of-clause check can see the death)
#[test]
fn abort_after_stall_fails_hygiene_1_from_a_clause_with_no_call_after_the_death() {
    let run = run_mutant("abort-after-stall", &["--quick", "--clauses", "TIME-2,HYGIENE-1"], MUTANT_CONFIG);
    let clauses = run.clauses();
    let status = |id: &str| clauses.iter().find(|(c, _, _)| c == id).map(|(_, s, e)| (s.clone(), e.clone())).unwrap();
    let (time_2, evidence) = status("TIME-2");
    assert_eq!(time_2, "pass", "the plugin met its deadlines; the death comes after: {evidence}");
    let (hygiene_1, evidence) = status("HYGIENE-1");
    assert_eq!(hygiene_1, "fail", "a receiver dead between calls must fail HYGIENE-1:\n{}", run.stdout);
    assert!(evidence.contains("[TIME-2] receiver peer process died during the clause"), "{evidence}");
    assert!(evidence.contains("watchdog"), "the evidence quotes the peer's last words: {evidence}");
    assert_eq!(run.status, 1);
}

/// The real UCX plugin over TCP, with each transfer's deadline dropped on its way to the transport:
/// through the harness's TCP fault proxy, the black-holed case of TIME-12 leaves its transfers
/// without a terminal event, and the clause fails naming the proxy's fault. (Only TIME-12 runs: the
/// defect breaks every deadline clause, and the point here is the TCP proxy.)
// CONFORMANCE: TIME-12 (through the TCP fault proxy)
#[test]
fn ucx_tcp_drops_deadlines_fails_time_12_through_the_tcp_proxy() {
    let lib = mutant_library("kvgate-mutant-ucx-tcp-drops-deadlines");
    let run = run_harness(
        &lib.to_string_lossy(),
        &["--quick", "--clauses", "TIME-12"],
        "[plugin]\ntls = \"tcp\"\ndevices = \"lo\"\n",
    );
    assert_eq!(run.with_status("fail"), ["TIME-12"], "{}", run.stdout);
    let (_, _, evidence) = run.clauses().into_iter().find(|(id, _, _)| id == "TIME-12").unwrap();
    assert!(evidence.contains("every byte of every connection dropped"), "the TCP proxy's black hole: {evidence}");
    assert!(evidence.contains("has no terminal event"), "{evidence}");
    assert_eq!(run.status, 1);
}
