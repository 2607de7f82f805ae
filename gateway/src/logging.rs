//! Logging set-up (tracing): text or JSON lines on stderr, filter from `RUST_LOG` or `[log] level`.
//! Never drops or samples a line: every failure is logged every time.

use crate::config::LogSection;
use tracing_subscriber::EnvFilter;

pub fn init(log: &LogSection) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(&log.level));
    // Colours only on a terminal: a log redirected to a file (the demo's and the bench's gateway logs,
    // a service manager's journal) stays plain text that grep and log shippers read as written.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi);
    let _ = if log.format == "json" { builder.json().try_init() } else { builder.try_init() };
}
