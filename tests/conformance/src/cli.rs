//! The command line of `kvgate conformance` (flattened into the gateway's subcommand) and of the
//! stand-alone `kvgate-conformance` binary: parse, run, write the reports, return the exit status.
//! Never exits the process itself; the caller does, with the status `run` returns.

use crate::config;
use crate::controller::PeerCommand;
use crate::report::Status;
use crate::runner::{run_plan, RunPlan};
use std::path::PathBuf;

/// Exit status when a clause failed.
pub const EXIT_CLAUSE_FAILED: i32 = 1;
/// Exit status when the harness could not run (bad arguments, unreadable config, unwritable report).
pub const EXIT_HARNESS_ERROR: i32 = 2;
/// Exit status when no clause failed but one was not exercised: the run certifies nothing.
pub const EXIT_NOT_EXERCISED: i32 = 3;

#[derive(clap::Args, Debug, Clone)]
pub struct ConformanceArgs {
    /// The plugin to check: `builtin:NAME` or the path of a plugin library (`.so`).
    #[arg(long)]
    pub plugin: String,
    /// TOML file: `[harness]` limits (see CONFORMANCE.md) and the `[plugin]` table passed to `open`.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Which clauses to run: comma-separated ids, groups or `PREFIX*` (default: all).
    #[arg(long)]
    pub clauses: Option<String>,
    /// Seed of every random choice; a run is replayed by giving the seed it printed.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Write the JSON report here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write a JUnit XML report here.
    #[arg(long)]
    pub junit: Option<PathBuf>,
    /// A smaller frozen-receiver abort storm (1000 transfers); every size, count and bound a catch
    /// depends on stays as in the full profile.
    #[arg(long)]
    pub quick: bool,
    /// Run the whole plan N times, with seeds `--seed`, `--seed`+1, …: one line per run, then how
    /// often each clause passed (and `--json` writes that summary). For the N-seed certification of a
    /// plugin, a long run kept out of CI; exit status as for one run, over all of them.
    #[arg(long, value_name = "N")]
    pub seeds: Option<u64>,
    /// Internal: run as a peer process of a harness (speaks the control protocol on stdin/stdout).
    #[arg(long, hide = true)]
    pub peer_mode: bool,
}

/// The filter of a peer process's log (tracing syntax); default [`PEER_LOG_DEFAULT`].
pub const PEER_LOG_ENV: &str = "KVGATE_CONFORMANCE_PEER_LOG";
/// A peer logs warnings and errors unless [`PEER_LOG_ENV`] says otherwise.
pub const PEER_LOG_DEFAULT: &str = "warn";

/// A peer's log goes to its stderr (its stdout carries the control protocol), where the controller
/// keeps it for failure reports. A subscriber already installed by the host binary stays.
fn init_peer_logging() {
    let filter = std::env::var(PEER_LOG_ENV).unwrap_or_else(|_| PEER_LOG_DEFAULT.to_string());
    let filter = tracing_subscriber::EnvFilter::try_new(&filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(PEER_LOG_DEFAULT));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(false).try_init();
}

/// Run the harness (or, with `--peer-mode`, a peer process). Returns the process exit status:
/// 0 when no clause failed, [`EXIT_CLAUSE_FAILED`] when one did, [`EXIT_NOT_EXERCISED`] when none
/// failed but one was not exercised, [`EXIT_HARNESS_ERROR`] on a usage error.
pub fn run(args: ConformanceArgs) -> i32 {
    if args.peer_mode {
        init_peer_logging();
        return crate::peer::server::peer_main();
    }
    let (limits, plugin_config) = match config::load(args.config.as_deref(), args.quick) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvgate conformance: {e}");
            return EXIT_HARNESS_ERROR;
        }
    };
    let cmd = match PeerCommand::from_current_process() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvgate conformance: {e}");
            return EXIT_HARNESS_ERROR;
        }
    };
    let seed = args.seed.unwrap_or_else(seed_from_time);
    if let Some(n) = args.seeds {
        return run_seeds(&args, limits, plugin_config, cmd, seed, n);
    }
    eprintln!("kvgate conformance: plugin {} seed {seed} (replay with --seed {seed})", args.plugin);
    let report = run_plan(RunPlan {
        plugin: args.plugin.clone(),
        plugin_config,
        limits,
        clauses: args.clauses.clone(),
        seed,
        quick: args.quick,
        cmd,
    });
    print!("{}", report.to_table());
    if let Some(path) = &args.json {
        if let Err(e) = std::fs::write(path, report.to_json()) {
            eprintln!("kvgate conformance: cannot write {}: {e}", path.display());
            return EXIT_HARNESS_ERROR;
        }
    }
    if let Some(path) = &args.junit {
        if let Err(e) = std::fs::write(path, report.to_junit()) {
            eprintln!("kvgate conformance: cannot write {}: {e}", path.display());
            return EXIT_HARNESS_ERROR;
        }
    }
    if report.clauses.iter().any(|c| c.status == Status::Fail) {
        EXIT_CLAUSE_FAILED
    } else if report.clauses.iter().any(|c| c.status == Status::NotExercised) {
        EXIT_NOT_EXERCISED
    } else {
        0
    }
}

/// A clause that failed or was not exercised in one run: its id, its verdict and its evidence.
type Uncertified = (String, &'static str, String);

/// How often each clause ended in each verdict over an N-seed run, and every run that did not certify.
#[derive(serde::Serialize, Default)]
struct SeedSummary {
    plugin: String,
    profile: String,
    first_seed: u64,
    runs: u64,
    certified_runs: u64,
    /// Per clause: runs with each verdict (`pass`, `fail`, `unsupported`, `not_exercised`).
    clauses: std::collections::BTreeMap<String, std::collections::BTreeMap<&'static str, u64>>,
    /// Per run that did not certify: its seed, and each clause that failed or was not exercised.
    uncertified: Vec<(u64, Vec<Uncertified>)>,
}

/// `--seeds N`: the plan once per seed, `first`..`first + n`, summarised.
fn run_seeds(
    args: &ConformanceArgs,
    limits: config::HarnessLimits,
    plugin_config: String,
    cmd: PeerCommand,
    first: u64,
    n: u64,
) -> i32 {
    if n == 0 || args.junit.is_some() {
        eprintln!("kvgate conformance: --seeds takes N ≥ 1 and no --junit (its --json is the summary)");
        return EXIT_HARNESS_ERROR;
    }
    let mut summary = SeedSummary {
        plugin: args.plugin.clone(),
        profile: if args.quick { "quick" } else { "full" }.into(),
        first_seed: first,
        ..Default::default()
    };
    let (mut any_fail, mut any_unexercised) = (false, false);
    for seed in first..first.saturating_add(n) {
        let report = run_plan(RunPlan {
            plugin: args.plugin.clone(),
            plugin_config: plugin_config.clone(),
            limits: limits.clone(),
            clauses: args.clauses.clone(),
            seed,
            quick: args.quick,
            cmd: cmd.clone(),
        });
        summary.runs += 1;
        let mut bad = Vec::new();
        for c in &report.clauses {
            *summary.clauses.entry(c.id.clone()).or_default().entry(c.status.as_str()).or_default() += 1;
            if matches!(c.status, Status::Fail | Status::NotExercised) {
                bad.push((c.id.clone(), c.status.as_str(), c.evidence.clone()));
            }
        }
        any_fail |= report.clauses.iter().any(|c| c.status == Status::Fail);
        any_unexercised |= report.clauses.iter().any(|c| c.status == Status::NotExercised);
        if report.certified() {
            summary.certified_runs += 1;
            println!("seed {seed}: certified ({} ms)", report.elapsed_ms);
        } else {
            let shown: Vec<String> = bad
                .iter()
                .map(|(id, status, e)| format!("{id} {status}: {}", e.chars().take(300).collect::<String>()))
                .collect();
            println!("seed {seed}: NOT certified ({} ms): {}", report.elapsed_ms, shown.join(" | "));
            summary.uncertified.push((seed, bad));
        }
    }
    println!(
        "{}: {} of {} seeds certified ({} profile, seeds {first}..{})",
        args.plugin,
        summary.certified_runs,
        summary.runs,
        summary.profile,
        first.saturating_add(n) - 1
    );
    for (id, counts) in &summary.clauses {
        let line: Vec<String> = counts.iter().map(|(status, k)| format!("{status} {k}")).collect();
        println!("  {id:<12} {}", line.join(", "));
    }
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&summary).unwrap_or_default();
        if let Err(e) = std::fs::write(path, text) {
            eprintln!("kvgate conformance: cannot write {}: {e}", path.display());
            return EXIT_HARNESS_ERROR;
        }
    }
    if any_fail {
        EXIT_CLAUSE_FAILED
    } else if any_unexercised {
        EXIT_NOT_EXERCISED
    } else {
        0
    }
}

/// The only clock read of the harness: choosing a seed when none was given (it is printed).
fn seed_from_time() -> u64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    now.as_nanos() as u64 ^ (std::process::id() as u64) << 32
}
