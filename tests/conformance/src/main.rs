//! `kvgate-conformance`: the stand-alone harness binary (the same as `kvgate conformance`), and the
//! peer process the harness spawns. Parses arguments and exits with the status `run` returns.

use clap::Parser;

#[derive(Parser)]
#[command(name = "kvgate-conformance", about = "Run a kvgate plugin through the conformance contract (CONFORMANCE.md)")]
struct Cli {
    #[command(flatten)]
    args: kvgate_conformance::ConformanceArgs,
}

fn main() {
    let cli = Cli::parse();
    std::process::exit(kvgate_conformance::run(cli.args));
}
