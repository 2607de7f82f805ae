//! The `kvgate` binary: the whole command line (clap) and where each command goes. The daemon's
//! commands (`serve`, `keygen`, `config`, `plugins`, `rooms`, `abort`) are in the gateway library
//! (`kvgate::cli` and the `cli_*` modules); the tools `demo` (kvgate-demo), `bench` (kvgate-bench) and
//! `conformance` (kvgate-conformance) are crates of their own, linked only into this binary.
//! Exit codes: 0 ok, 1 failure, 2 bad usage or bad configuration.

use clap::{Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(name = "kvgate", version, about = "KV-cache transfer gateway for disaggregated LLM serving")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

// Parsed once at start: the size of the largest variant (the conformance and bench arguments)
// costs nothing, and boxing them would only obscure the clap derive.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run a gateway.
    Serve {
        /// TOML config; without it the built-in defaults (plus KVGATE__ overrides) are used.
        #[arg(long, short)]
        config: Option<PathBuf>,
    },
    /// Start a prefill and a decode gateway here and move synthetic KV caches between them.
    Demo(kvgate_demo::DemoArgs),
    /// Run the plugin conformance harness (CONFORMANCE.md) against a plugin.
    Conformance(kvgate_conformance::cli::ConformanceArgs),
    /// Measure the data path and the control path against their references; table, JSON, plots.
    Bench(kvgate_bench::BenchArgs),
    /// Make the key or certificates that authenticate peer links.
    Keygen {
        #[command(subcommand)]
        command: kvgate::cli_keygen::KeygenCommand,
    },
    /// Configuration helpers.
    Config {
        #[command(subcommand)]
        command: kvgate::cli::ConfigCommand,
    },
    /// Plugins.
    Plugins {
        #[command(subcommand)]
        command: kvgate::cli::PluginsCommand,
    },
    /// List the rooms of a running gateway.
    Rooms {
        #[command(flatten)]
        target: kvgate::cli::Target,
        /// Include recently terminal rooms.
        #[arg(long)]
        all: bool,
    },
    /// Abort a room on a running gateway (and, through it, on its peer).
    Abort {
        room: u64,
        #[arg(long, default_value_t = 0)]
        generation: u32,
        #[command(flatten)]
        target: kvgate::cli::Target,
    },
}

fn main() {
    std::process::exit(run(Cli::parse()));
}

fn run(cli: Cli) -> i32 {
    match cli.command {
        Command::Serve { config } => kvgate::cli::serve(config),
        Command::Demo(args) => kvgate_demo::run(args),
        Command::Conformance(args) => kvgate_conformance::cli::run(args),
        Command::Bench(args) => kvgate_bench::run(args),
        Command::Keygen { command } => kvgate::cli_keygen::run(command),
        Command::Config { command } => kvgate::cli::config(command),
        Command::Plugins { command } => kvgate::cli_plugins::run(command),
        Command::Rooms { target, all } => kvgate::cli_remote::rooms(target, all),
        Command::Abort { room, generation, target } => kvgate::cli_remote::abort(target, room, generation),
    }
}
