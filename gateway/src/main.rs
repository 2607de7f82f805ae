//! The `kvgate` binary: parse the command line and hand over to `kvgate::cli`.
//! Nothing else lives here.

fn main() {
    std::process::exit(kvgate::cli::main());
}
