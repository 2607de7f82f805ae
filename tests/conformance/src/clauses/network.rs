//! TIME-12 and DATA-7: a network plugin under a black-holed, corrupting, resetting or slow network,
//! through a loopback fault proxy: the UDP one when the receiver's endpoint names a loopback UDP
//! address, the TCP one when it names a TCP port the receiver process listens on (UCX over TCP).
//! A plugin whose endpoint names neither moves no network traffic the harness can fault: these
//! clauses are then unsupported, with that reason.

use super::*;
use crate::peer::protocol::{Op, Outcome};
use crate::proxy::{find_loopback_udp, rewrite_port, Fault, UdpProxy};
use crate::tcp_proxy::{find_listening_port, listening_tcp_ports, rewrite_tcp_port, TcpFault, TcpProxy};
use crate::world::{describe, seg, Dst, Side, Src, RX_PEER, TX_PEER};
use kvgate_abi::EventKind;
use std::sync::atomic::Ordering;

/// The id the sender knows the receiver by when it goes through the proxy.
const PROXIED_PEER: u64 = 21;

/// The proxy a pair's traffic goes through.
pub(crate) enum NetProxy {
    Udp(UdpProxy),
    /// `to_rx` carries the connections the sender opens to the receiver; `to_tx`, when the sender's
    /// endpoint names a listening port too, those the receiver opens back.
    Tcp {
        to_rx: TcpProxy,
        to_tx: Option<TcpProxy>,
    },
}

impl NetProxy {
    fn set_tcp(&self, fault: TcpFault) {
        if let NetProxy::Tcp { to_rx, to_tx } = self {
            to_rx.set(fault);
            if let Some(t) = to_tx {
                t.set(fault);
            }
        }
    }

    fn summary(&self) -> String {
        match self {
            NetProxy::Udp(u) => {
                format!("{} datagrams dropped by the UDP proxy", u.counters.dropped.load(Ordering::Relaxed))
            }
            NetProxy::Tcp { to_rx, to_tx } => {
                let back = to_tx
                    .as_ref()
                    .map_or("not proxied (no listening port in the sender's endpoint)".to_string(), |t| t.summary());
                format!("TCP proxy toward the receiver: {}; toward the sender: {back}", to_rx.summary())
            }
        }
    }
}

/// A TCP proxy to the port `side` listens on, and its endpoint rewritten to name the proxy; None
/// when its endpoint names no port it listens on.
pub(crate) fn tcp_proxy_to(p: &mut Pair, side: Side, ctx: &mut Ctx) -> Result<Option<(TcpProxy, Vec<u8>)>, Verdict> {
    let endpoint = p.endpoint(side, ctx)?;
    let ports = listening_tcp_ports(p.peer(side).pid());
    let Some((at, port)) = find_listening_port(&endpoint, &ports) else { return Ok(None) };
    let proxy = TcpProxy::start(([127, 0, 0, 1], port).into())
        .map_err(|e| Verdict::Fail(format!("cannot start the TCP proxy: {e}")))?;
    let rewritten = rewrite_tcp_port(&endpoint, at, proxy.listen.port());
    Ok(Some((proxy, rewritten)))
}

/// Reconnect the pair through a fresh proxy (UDP, else TCP both ways where each side listens);
/// regions and a ticket ready, and one transfer through the proxy already done (the connection is
/// up before faults start, and its bytes are seen going through the proxy).
pub(crate) fn through_proxy(p: &mut Pair, ctx: &mut Ctx) -> Result<(NetProxy, Src, Dst, u64), Verdict> {
    let endpoint = p.endpoint(Side::Rx, ctx)?;
    let (proxy, rewritten) = if let Some((at, little_endian, port)) = find_loopback_udp(&endpoint) {
        let proxy = UdpProxy::start(([127, 0, 0, 1], port).into())
            .map_err(|e| Verdict::Fail(format!("cannot start the UDP proxy: {e}")))?;
        let rewritten = rewrite_port(&endpoint, at, little_endian, proxy.listen.port());
        (NetProxy::Udp(proxy), rewritten)
    } else if let Some((to_rx, rewritten)) = tcp_proxy_to(p, Side::Rx, ctx)? {
        // The way back first: the receiver reconnects to the sender through a proxy of its own.
        let to_tx = match tcp_proxy_to(p, Side::Tx, ctx)? {
            Some((to_tx, tx_endpoint)) => {
                p.call(Side::Rx, Op::Disconnect { peer: TX_PEER }, ctx)?;
                if let Outcome::Failed { error } =
                    p.call(Side::Rx, Op::Connect { peer: TX_PEER, endpoint: tx_endpoint }, ctx)?.outcome
                {
                    return Err(Verdict::Fail(format!(
                        "receiver's connect back through the proxy refused: {}: {}",
                        error.code_name, error.message
                    )));
                }
                Some(to_tx)
            }
            None => None,
        };
        (NetProxy::Tcp { to_rx, to_tx }, rewritten)
    } else {
        return Err(Verdict::Unsupported(
            "the receiver's endpoint names no loopback UDP address and no TCP port the receiver listens on: no network traffic to fault".into(),
        ));
    };
    p.call(Side::Tx, Op::Disconnect { peer: RX_PEER }, ctx)?;
    if let Outcome::Failed { error } =
        p.call(Side::Tx, Op::Connect { peer: PROXIED_PEER, endpoint: rewritten }, ctx)?.outcome
    {
        return Err(Verdict::Fail(format!(
            "connect through the proxy refused: {}: {}",
            error.code_name, error.message
        )));
    }
    p.rx_peer = PROXIED_PEER;
    let src = p.alloc_src(1 << 20, ctx.rng.next_u64(), ctx)?;
    let dst = p.alloc_dst(1 << 20, ctx.rng.next_u64(), ctx)?;
    let ticket = p.authorise(&dst, ctx)?;
    sleep_ms(20);
    match super::data::transfer_and_verify(p, ticket, src.rid, dst.rid, vec![seg(&src, 0, &dst, 0, 65536)], ctx)? {
        Ok(_) => {}
        Err(e) => return Err(Verdict::Fail(format!("through the proxy with no fault: {e}"))),
    }
    if let NetProxy::Tcp { to_rx, .. } = &proxy {
        if to_rx.counters.forwarded_bytes.load(Ordering::Relaxed) < 65536 {
            return Err(Verdict::Fail(format!(
                "a 64 KiB transfer to the proxied endpoint went around the proxy ({})",
                to_rx.summary()
            )));
        }
    }
    Ok((proxy, src, dst, ticket))
}

/// TIME-12 over TCP, one fault on a pair of its own: two transfers (200 and 500 ms) submitted while
/// the proxy holds every byte (a delay longer than both), so that they are live when `fault` then
/// hits every connection; each judged against its deadline.
fn time_12_tcp_case(ctx: &mut Ctx, fault: TcpFault, what: &str) -> CheckResult {
    with_pair(ctx, |p, ctx| {
        let (proxy, src, dst, ticket) = through_proxy(p, ctx)?;
        proxy.set_tcp(TcpFault::Delay(std::time::Duration::from_secs(10)));
        let mut xfers = Vec::new();
        for (i, timeout_ms) in [200u64, 500].into_iter().enumerate() {
            let off = (1 + i as u64) * 65536;
            let (x, r) = p.submit(ticket, timeout_ms, vec![seg(&src, off, &dst, off, 65536)], ctx)?;
            accepted(r, "transfer through the proxy (every byte held)")?;
            xfers.push((x, timeout_ms));
        }
        sleep_ms(20);
        let live = xfers.iter().filter(|(x, _)| p.terminal(*x).is_none()).count();
        proxy.set_tcp(fault);
        let verdict = super::time::judge_deadlines(p, &xfers, what, ctx);
        proxy.set_tcp(TcpFault::Pass);
        if live == 0 {
            return Err(Verdict::Fail(format!(
                "{what}: both transfers ended while every byte was held, before the fault"
            )));
        }
        verdict.map(|e| format!("{e} ({live} of 2 live when it hit; {})", proxy.summary()))
    })
}

// CONFORMANCE: TIME-12
pub fn time_12(ctx: &mut Ctx) -> CheckResult {
    let mut tcp = false;
    let black_hole = with_pair(ctx, |p, ctx| {
        let (proxy, src, dst, ticket) = through_proxy(p, ctx)?;
        if let NetProxy::Udp(u) = &proxy {
            u.set(Fault::BlackHole);
        }
        proxy.set_tcp(TcpFault::BlackHole);
        let mut xfers = Vec::new();
        for (i, timeout_ms) in [200u64, 500].into_iter().enumerate() {
            let off = (1 + i as u64) * 65536;
            let (x, r) = p.submit(ticket, timeout_ms, vec![seg(&src, off, &dst, off, 65536)], ctx)?;
            if r.is_ok() {
                xfers.push((x, timeout_ms));
            }
        }
        let what = match proxy {
            NetProxy::Udp(_) => "network black-holed (every datagram dropped both ways)",
            NetProxy::Tcp { .. } => {
                "network black-holed (every byte of every connection dropped both ways, connections kept open)"
            }
        };
        let verdict = super::time::judge_deadlines(p, &xfers, what, ctx);
        if let NetProxy::Udp(u) = &proxy {
            u.set(Fault::Pass);
        }
        proxy.set_tcp(TcpFault::Pass);
        tcp = matches!(proxy, NetProxy::Tcp { .. });
        verdict.map(|e| format!("{e}; {}", proxy.summary()))
    })?;
    if !tcp {
        return Ok(black_hole);
    }
    // Over TCP a connection can also be reset or half-closed under the plugin.
    let reset = time_12_tcp_case(ctx, TcpFault::Reset, "every connection reset (RST), new ones too")?;
    let half = time_12_tcp_case(
        ctx,
        TcpFault::HalfClose,
        "every connection half-closed toward its target (end of file), bytes after it dropped",
    )?;
    Ok(format!("{black_hole}; {reset}; {half}"))
}

// CONFORMANCE: DATA-7
pub fn data_7(ctx: &mut Ctx) -> CheckResult {
    with_pair(ctx, |p, ctx| {
        let (proxy, src, dst, ticket) = through_proxy(p, ctx)?;
        let (mut lines, mut problems) = (Vec::new(), Vec::new());
        let delay = std::time::Duration::from_millis(30);
        // Over TCP only the delay: a segment damaged on the wire is dropped by TCP's own checksum and
        // sent again, so no network corrupts a TCP stream (a proxy that did would be forging bytes).
        let faults: Vec<(&str, u64)> = match proxy {
            NetProxy::Udp(_) => vec![("every datagram corrupted", 131_072), ("every datagram delayed 30 ms", 393_216)],
            NetProxy::Tcp { .. } => vec![(
                "every chunk of every connection delayed 30 ms (corruption is TCP's own checksum's to catch)",
                393_216,
            )],
        };
        for (i, (what, off)) in faults.into_iter().enumerate() {
            match &proxy {
                NetProxy::Udp(u) => u.set(if i == 0 { Fault::Corrupt } else { Fault::Delay(delay) }),
                NetProxy::Tcp { .. } => proxy.set_tcp(TcpFault::Delay(delay)),
            }
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
        let counters = match &proxy {
            NetProxy::Udp(u) => {
                u.set(Fault::Pass);
                format!("{} datagrams corrupted", u.counters.corrupted.load(Ordering::Relaxed))
            }
            NetProxy::Tcp { .. } => {
                proxy.set_tcp(TcpFault::Pass);
                proxy.summary()
            }
        };
        verdict_of(problems, format!("{}; {counters}; never a success with wrong bytes", lines.join("; ")))
    })
}
