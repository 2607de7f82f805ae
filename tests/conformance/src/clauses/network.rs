//! TIME-12 and DATA-7: a network plugin under a black-holed, corrupting or slow network, through the
//! loopback UDP fault proxy. A plugin whose receiver endpoint names no loopback UDP address moves no
//! network traffic the harness can fault: these clauses are then unsupported, with that reason.

use super::*;
use crate::peer::protocol::{Op, Outcome};
use crate::proxy::{find_loopback_udp, rewrite_port, Fault, UdpProxy};
use crate::world::{describe, seg, Dst, Side, Src, RX_PEER};
use kvgate_abi::EventKind;
use std::sync::atomic::Ordering;

/// The id the sender knows the receiver by when it goes through the proxy.
const PROXIED_PEER: u64 = 21;

/// Reconnect the sender to the receiver through a fresh proxy; regions and a ticket ready, and one
/// transfer through the proxy already done (the connection is up before faults start).
fn through_proxy(p: &mut Pair, ctx: &mut Ctx) -> Result<(UdpProxy, Src, Dst, u64), Verdict> {
    let endpoint = p.endpoint(Side::Rx, ctx)?;
    let Some((at, little_endian, port)) = find_loopback_udp(&endpoint) else {
        return Err(Verdict::Unsupported("the receiver's endpoint names no loopback UDP address: no network traffic to fault".into()));
    };
    let proxy = UdpProxy::start(([127, 0, 0, 1], port).into()).map_err(|e| Verdict::Fail(format!("cannot start the UDP proxy: {e}")))?;
    let rewritten = rewrite_port(&endpoint, at, little_endian, proxy.listen.port());
    p.call(Side::Tx, Op::Disconnect { peer: RX_PEER }, ctx)?;
    if let Outcome::Failed { error } = p.call(Side::Tx, Op::Connect { peer: PROXIED_PEER, endpoint: rewritten }, ctx)?.outcome {
        return Err(Verdict::Fail(format!("connect through the proxy refused: {}: {}", error.code_name, error.message)));
    }
    p.rx_peer = PROXIED_PEER;
    let src = p.alloc_src(1 << 20, ctx.rng.next_u64(), ctx)?;
    let dst = p.alloc_dst(1 << 20, ctx.rng.next_u64(), ctx)?;
    let ticket = p.authorise(&dst, ctx)?;
    sleep_ms(20);
    match super::data::transfer_and_verify(p, ticket, src.rid, dst.rid, vec![seg(&src, 0, &dst, 0, 65536)], ctx)? {
        Ok(_) => Ok((proxy, src, dst, ticket)),
        Err(e) => Err(Verdict::Fail(format!("through the proxy with no fault: {e}"))),
    }
}

// CONFORMANCE: TIME-12
pub fn time_12(ctx: &mut Ctx) -> CheckResult {
    with_pair(ctx, |p, ctx| {
        let (proxy, src, dst, ticket) = through_proxy(p, ctx)?;
        proxy.set(Fault::BlackHole);
        let mut xfers = Vec::new();
        for (i, timeout_ms) in [200u64, 500].into_iter().enumerate() {
            let off = (1 + i as u64) * 65536;
            let (x, r) = p.submit(ticket, timeout_ms, vec![seg(&src, off, &dst, off, 65536)], ctx)?;
            if r.is_ok() {
                xfers.push((x, timeout_ms));
            }
        }
        let verdict = super::time::judge_deadlines(p, &xfers, "network black-holed (every datagram dropped both ways)", ctx);
        proxy.set(Fault::Pass);
        let dropped = proxy.counters.dropped.load(Ordering::Relaxed);
        verdict.map(|e| format!("{e}; {dropped} datagrams dropped by the proxy"))
    })
}

// CONFORMANCE: DATA-7
pub fn data_7(ctx: &mut Ctx) -> CheckResult {
    with_pair(ctx, |p, ctx| {
        let (proxy, src, dst, ticket) = through_proxy(p, ctx)?;
        let (mut lines, mut problems) = (Vec::new(), Vec::new());
        for (what, fault) in [("every datagram corrupted", Fault::Corrupt), ("every datagram delayed 30 ms", Fault::Delay(std::time::Duration::from_millis(30)))] {
            proxy.set(fault);
            let off = if fault == Fault::Corrupt { 131_072 } else { 393_216 };
            let segs = vec![seg(&src, off, &dst, off, 262_144)];
            let (x, r) = p.submit(ticket, 5_000, segs, ctx)?;
            if let Err(e) = r {
                lines.push(format!("{what}: submit refused ({})", e.code_name));
                continue;
            }
            let Some(t) = p.wait_terminal(x, ms_of(5_000 + ctx.limits.deadline_slack_ms + 1_000)) else {
                problems.push(format!("{what}: no terminal event"));
                continue;
            };
            if t.kind == EventKind::SUCCEEDED.0 {
                let d = p.checksum(Side::Rx, dst.rid, vec![(off, 262_144)], ctx)?;
                let s = p.checksum(Side::Tx, src.rid, vec![(off, 262_144)], ctx)?;
                if d != s {
                    problems.push(format!("{what}: SUCCEEDED but the destination does not match the source"));
                    continue;
                }
            }
            lines.push(format!("{what}: {}", describe(&t)));
        }
        proxy.set(Fault::Pass);
        let corrupted = proxy.counters.corrupted.load(Ordering::Relaxed);
        verdict_of(problems, format!("{}; {corrupted} datagrams corrupted; never a success with wrong bytes", lines.join("; ")))
    })
}
