//! Logging set-up (tracing): text or JSON lines on stderr, filter from `RUST_LOG` or `[log] level`.
//! Never drops or samples a line: every failure is logged every time.

use crate::config::LogSection;
use tracing_subscriber::EnvFilter;

pub fn init(log: &LogSection) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(&log.level));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let _ = if log.format == "json" { builder.json().try_init() } else { builder.try_init() };
}
