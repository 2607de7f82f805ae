//! Running the `kvgate-conformance` binary on a plugin and reading its JSON report.
//! Runs are serialised: the bounds the harness judges by assume it has the machine to itself.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;

static ONE_RUN_AT_A_TIME: Mutex<()> = Mutex::new(());

pub struct Run {
    pub status: i32,
    pub report: serde_json::Value,
    pub stdout: String,
    pub seconds: f64,
}

impl Run {
    pub fn clauses(&self) -> Vec<(String, String, String)> {
        self.report["clauses"]
            .as_array()
            .expect("clauses array")
            .iter()
            .map(|c| {
                (
                    c["id"].as_str().unwrap().to_string(),
                    c["status"].as_str().unwrap().to_string(),
                    c["evidence"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    }
    pub fn with_status(&self, status: &str) -> Vec<String> {
        self.clauses().into_iter().filter(|(_, s, _)| s == status).map(|(id, _, _)| id).collect()
    }
}

/// The cdylib of a mutant crate, built by cargo next to this test (it is a dev-dependency).
pub fn mutant_library(package: &str) -> PathBuf {
    let lib = package.replace('-', "_");
    kvgate_host::artifacts::built_cdylib_path(package, &lib).unwrap_or_else(|e| panic!("{e}"))
}

/// The harness's default bounds are set for release builds. An unoptimised build of a plugin runs
/// its per-segment loops many times slower, so a debug test run allows more deadline slack and a
/// longer call bound; defects the mutants carry (hangs, blocked calls) exceed any bound.
fn debug_build_limits() -> &'static str {
    if cfg!(debug_assertions) {
        "[harness]\ndeadline_slack_ms = 500\ncall_bound_ms = 250\n"
    } else {
        ""
    }
}

/// The seed every test run uses unless it asks for another ([`run_harness_with_seed`]).
pub const TEST_SEED: u64 = 20261130;

/// Run the harness binary on `plugin` with extra arguments; returns its exit status and report.
pub fn run_harness(plugin: &str, extra: &[&str], plugin_config: &str) -> Run {
    run_harness_with_seed(plugin, TEST_SEED, extra, plugin_config)
}

/// [`run_harness`] with the seed given.
pub fn run_harness_with_seed(plugin: &str, seed: u64, extra: &[&str], plugin_config: &str) -> Run {
    run_harness_in(plugin, seed, extra, plugin_config, &[])
}

/// The harness on the mutant library with `defect` (a row of `kvgate_mutant_base::DEFECTS`) switched on.
pub fn run_mutant(defect: &str, extra: &[&str], plugin_config: &str) -> Run {
    run_mutant_with_seed(defect, TEST_SEED, extra, plugin_config)
}

/// [`run_mutant`] with the seed given.
pub fn run_mutant_with_seed(defect: &str, seed: u64, extra: &[&str], plugin_config: &str) -> Run {
    assert!(kvgate_mutant_base::defect(defect).is_some(), "no defect named {defect:?} in kvgate_mutant_base::DEFECTS");
    let library = mutant_library("kvgate-mutants");
    run_harness_in(&library.to_string_lossy(), seed, extra, plugin_config, &[(kvgate_mutant_base::DEFECT_ENV, defect)])
}

/// The harness process with `env` set (the peer processes it starts inherit it).
fn run_harness_in(plugin: &str, seed: u64, extra: &[&str], plugin_config: &str, env: &[(&str, &str)]) -> Run {
    let _one = ONE_RUN_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!(
        "kvgate-conformance-test-{}-{}{}",
        std::process::id(),
        plugin.replace(['/', ':', '.'], "_"),
        env.iter().map(|(_, v)| format!("-{v}")).collect::<String>()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("report.json");
    let junit = dir.join("report.xml");
    let config = dir.join("config.toml");
    std::fs::write(&config, format!("{}{plugin_config}", debug_build_limits())).unwrap();
    let started = std::time::Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_kvgate-conformance"))
        .args(["--plugin", plugin, "--seed", &seed.to_string(), "--config"])
        .arg(&config)
        .arg("--json")
        .arg(&json)
        .arg("--junit")
        .arg(&junit)
        .args(extra)
        .envs(env.iter().copied())
        .output()
        .expect("harness binary runs");
    let seconds = started.elapsed().as_secs_f64();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let text = std::fs::read_to_string(&json).unwrap_or_else(|e| {
        panic!("no JSON report ({e}); stdout:\n{stdout}\nstderr:\n{}", String::from_utf8_lossy(&out.stderr))
    });
    let report: serde_json::Value = serde_json::from_str(&text).expect("valid JSON report");
    let junit_text = std::fs::read_to_string(&junit).expect("JUnit report written");
    assert!(junit_text.contains("<testsuite") && junit_text.contains("<testcase"), "{junit_text}");
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!("{stdout}harness run on {plugin}: {seconds:.1} s");
    Run { status: out.status.code().unwrap_or(-1), report, stdout, seconds }
}

/// Clauses that need network traffic to fault; same-host plugins report them unsupported.
pub const NETWORK_CLAUSES: [&str; 2] = ["TIME-12", "DATA-7"];

/// Clauses about an optional feature (PROGRESS events): unsupported, with that reason, for a plugin
/// that emits none in the whole run and does not advertise them.
pub const OPTIONAL_FEATURE_CLAUSES: [&str; 1] = ["OBS-5"];

/// Whether an `unsupported` verdict on `id` is one the plugin may get: a network clause (same-host
/// plugins) or an optional feature it does not use; the evidence says which.
pub fn may_be_unsupported(id: &str, evidence: &str) -> bool {
    (NETWORK_CLAUSES.contains(&id) && evidence.contains("no loopback UDP address"))
        || (OPTIONAL_FEATURE_CLAUSES.contains(&id) && evidence.contains("transfers with PROGRESS events: 0 of"))
}

/// Every clause passes, except the network clauses, which a plugin that moves no network traffic
/// reports unsupported (with that reason) when `network` is false, and OBS-5, unsupported for a
/// plugin that emits no PROGRESS event. Nothing is `not_exercised`; the run certifies the plugin.
pub fn assert_all_pass(run: &Run, network: bool) {
    for (id, status, evidence) in run.clauses() {
        if !network && NETWORK_CLAUSES.contains(&id.as_str()) {
            assert_eq!(status, "unsupported", "{id}: {evidence}");
            assert!(evidence.contains("no loopback UDP address"), "{id}: {evidence}");
        } else if status == "unsupported" && OPTIONAL_FEATURE_CLAUSES.contains(&id.as_str()) {
            assert!(may_be_unsupported(&id, &evidence), "{id}: {evidence}");
        } else {
            assert_eq!(status, "pass", "{id}: {evidence}\n{}", run.stdout);
        }
    }
    assert_eq!(run.status, 0);
    assert_eq!(run.report["certified"], true, "{}", run.stdout);
    assert_eq!(run.clauses().len(), kvgate_conformance::registry::registry().len());
}
