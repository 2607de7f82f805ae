//! Benchmarks of kvgate-core (filled in below).
fn main() {}
