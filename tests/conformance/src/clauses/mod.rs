//! The checks of the clauses a plugin must meet, one function per clause id, grouped by file as in
//! CONFORMANCE.md. A check returns its evidence on pass or a [`Verdict`] on fail/unsupported; it
//! never reads another check's state and always ends its peers (through [`with_pair`]).

pub mod abort;
pub mod data;
pub mod handshake;
pub mod hygiene;
pub mod network;
pub mod obs;
pub mod res;
pub mod time;

use crate::controller::STDERR_TAIL_LINES;
use crate::peer::protocol::CallError;
use crate::world::{total_bytes, Ctx, Pair, Verdict};
use std::time::Duration;

pub type CheckResult = Result<String, Verdict>;

/// Open a pair, run `body`, then always finish the pair (run-wide ledger checks, peers closed).
///
/// Transfers still without their terminal event when the pair is finished (RES-1's run-wide
/// invariant, see [`Pair::finish`]) fail RES-1, naming the clause; when the clause has already failed
/// on its own, they are added to its evidence instead (its failure is then usually why).
pub fn with_pair(ctx: &mut Ctx, body: impl FnOnce(&mut Pair, &mut Ctx) -> CheckResult) -> CheckResult {
    let mut pair = Pair::open(ctx)?;
    let result = body(&mut pair, ctx).map_err(|v| {
        with_peer_logs(v, &pair.tx.stderr_tail(STDERR_TAIL_LINES), &pair.rx.stderr_tail(STDERR_TAIL_LINES))
    });
    let unended = pair.finish(ctx);
    match (result, unended) {
        (Err(Verdict::Fail(what)), Some(unended)) => {
            Err(Verdict::Fail(format!("{what}; and at the end of the clause: {unended}")))
        }
        (result, Some(unended)) => {
            // CONFORMANCE: RES-1 (every accepted submit ends with a terminal event, in every clause)
            ctx.findings.add("RES-1", format!("[{}] {unended}", ctx.current));
            result
        }
        (result, None) => result,
    }
}

/// A failure's evidence with the last lines each peer logged (the plugin's own warnings), so a
/// failure seen once can be diagnosed from the report alone.
fn with_peer_logs(verdict: Verdict, sender_tail: &str, receiver_tail: &str) -> Verdict {
    match verdict {
        Verdict::Fail(what) if !(sender_tail.is_empty() && receiver_tail.is_empty()) => {
            let quote = |tail: &str| if tail.is_empty() { "(nothing)".to_string() } else { tail.to_string() };
            Verdict::Fail(format!(
                "{what} [sender stderr: {}] [receiver stderr: {}]",
                quote(sender_tail),
                quote(receiver_tail)
            ))
        }
        other => other,
    }
}

pub fn fail<T>(what: impl Into<String>) -> Result<T, Verdict> {
    Err(Verdict::Fail(what.into()))
}

pub fn grace_ns(ctx: &Ctx) -> u64 {
    ctx.limits.abort_grace_ms * 1_000_000
}

pub fn ms_of(ms: u64) -> Duration {
    Duration::from_millis(ms)
}

pub fn sleep_ms(ms: u64) {
    std::thread::sleep(Duration::from_millis(ms));
}

/// A submit of a valid transfer must be accepted.
pub fn accepted(r: Result<u64, CallError>, what: &str) -> Result<u64, Verdict> {
    r.or_else(|e| fail(format!("{what}: submit of a valid transfer refused: {}: {}", e.code_name, e.message)))
}

/// Join a list of failure lines into one evidence string (first few).
pub fn verdict_of(failures: Vec<String>, pass_evidence: String) -> CheckResult {
    if failures.is_empty() {
        Ok(pass_evidence)
    } else {
        let n = failures.len();
        let shown: Vec<String> = failures.into_iter().take(4).collect();
        fail(format!("{} problem(s): {}", n, shown.join("; ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_quotes_what_the_peers_logged_and_a_pass_does_not() {
        let quoted = with_peer_logs(Verdict::Fail("no reply".into()), "WARN ucx: reply dropped", "");
        assert!(
            matches!(&quoted, Verdict::Fail(m) if m == "no reply [sender stderr: WARN ucx: reply dropped] [receiver stderr: (nothing)]"),
            "{quoted:?}"
        );
        assert!(
            matches!(with_peer_logs(Verdict::Fail("x".into()), "", ""), Verdict::Fail(m) if m == "x"),
            "nothing logged: unchanged"
        );
        assert!(
            matches!(with_peer_logs(Verdict::Unsupported("no GPU".into()), "a", "b"), Verdict::Unsupported(m) if m == "no GPU")
        );
    }
}
