//! Logging set-up (tracing): text or JSON lines on stderr, filter from `RUST_LOG` or `[log] level`.
//! Never drops or samples a line: every failure is logged every time, with one exception kept to a
//! rate: TLS handshakes that fail on the peer-link port (anyone may connect there), which tonic
//! reports only at debug level; a layer of its own raises them to one warning per
//! [`TLS_FAILURE_LOG_INTERVAL_MS`] (with the count in between) and counts every one.

use crate::config::LogSection;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tracing::field::{Field, Visit};
use tracing_subscriber::filter::{EnvFilter, Targets};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

/// Where tonic reports a failed TLS accept, and the message it gives.
const TONIC_TLS_TARGET: &str = "tonic::transport::server::io_stream";
const TONIC_TLS_MESSAGE: &str = "tls accept error";
/// At most one warning line about failed peer-link TLS handshakes this often.
pub const TLS_FAILURE_LOG_INTERVAL_MS: u64 = 10_000;

/// Failed TLS handshakes on the peer-link listener since start (`/metrics`).
pub static TLS_HANDSHAKE_FAILURES: AtomicU64 = AtomicU64::new(0);

pub fn init(log: &LogSection) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(&log.level));
    // Colours only on a terminal: a log redirected to a file (the demo's and the bench's gateway logs,
    // a service manager's journal) stays plain text that grep and log shippers read as written.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_ansi(ansi);
    let fmt =
        if log.format == "json" { fmt.json().with_filter(filter).boxed() } else { fmt.with_filter(filter).boxed() };
    let tls = TlsFailures::default().with_filter(Targets::new().with_target(TONIC_TLS_TARGET, tracing::Level::DEBUG));
    let _ = tracing_subscriber::registry().with(fmt).with(tls).try_init();
}

/// `log` without terminal colour codes (ANSI escape sequences), as a log written to a terminal
/// reads once captured: for tools and tests that search a gateway's log for its reason codes.
pub fn without_colour(log: &str) -> String {
    let mut out = String::with_capacity(log.len());
    let mut chars = log.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Turns tonic's debug-level "tls accept error" events into rate-limited warnings.
#[derive(Default)]
struct TlsFailures {
    /// When the last warning was written, and how many failures since.
    last: Mutex<(Option<Instant>, u64)>,
}

#[derive(Default)]
struct Fields {
    message: String,
    error: String,
}

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        match field.name() {
            "message" => self.message = format!("{value:?}"),
            "error" => self.error = format!("{value:?}"),
            _ => {}
        }
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        match field.name() {
            "message" => self.message = value.to_string(),
            "error" => self.error = value.to_string(),
            _ => {}
        }
    }
}

impl<S: tracing::Subscriber> Layer<S> for TlsFailures {
    fn on_event(&self, event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        if !fields.message.contains(TONIC_TLS_MESSAGE) {
            return;
        }
        TLS_HANDSHAKE_FAILURES.fetch_add(1, Ordering::Relaxed);
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        last.1 += 1;
        let now = Instant::now();
        if last.0.is_none_or(|at| now.duration_since(at) >= Duration::from_millis(TLS_FAILURE_LOG_INTERVAL_MS)) {
            let failures = last.1;
            *last = (Some(now), 0);
            drop(last);
            tracing::warn!(
                target: "kvgate::peer_link",
                reason = "tls_handshake_failed",
                failures_since_last_line = failures,
                "a TLS handshake on the peer-link port failed: {}",
                fields.error
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::without_colour;

    #[test]
    fn colour_codes_are_removed_and_the_text_kept() {
        let coloured = "\u{1b}[2m2026-12-04\u{1b}[0m \u{1b}[33m WARN\u{1b}[0m room failed reason=transfer_timeout";
        assert_eq!(without_colour(coloured), "2026-12-04  WARN room failed reason=transfer_timeout");
        assert_eq!(without_colour("plain text"), "plain text");
    }
}
