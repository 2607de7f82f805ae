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
    /// Smaller storms, lifecycles and data (1000, 1000, 4 MiB); the same bounds.
    #[arg(long)]
    pub quick: bool,
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
    let filter = tracing_subscriber::EnvFilter::try_new(&filter).unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(PEER_LOG_DEFAULT));
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

/// The only clock read of the harness: choosing a seed when none was given (it is printed).
fn seed_from_time() -> u64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    now.as_nanos() as u64 ^ (std::process::id() as u64) << 32
}
