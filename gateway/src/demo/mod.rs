//! `kvgate demo` (being written): starts a prefill and a decode gateway here and moves synthetic KV
//! caches between them. Until it lands the command says so and fails.
#[derive(clap::Args, Debug)]
pub struct DemoArgs {}
pub fn run(_args: DemoArgs) -> i32 {
    eprintln!("kvgate demo: not available in this build yet");
    1
}
