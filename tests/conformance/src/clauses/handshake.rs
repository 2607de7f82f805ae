//! HANDSHAKE-2..4: a restarted peer is a new generation, unsupported memory is refused at
//! registration, malformed endpoint and key bytes are refused. Over TCP (a receiver endpoint naming a
//! port the receiver listens on, no loopback UDP address) HANDSHAKE-2 runs through the harness's TCP
//! proxy, and the restarted receiver comes up behind the same proxy address.

use super::*;
use crate::controller::PeerProcess;
use crate::peer::protocol::{Op, Outcome, RawRegion};
use crate::proxy::find_loopback_udp;
use crate::tcp_proxy::{find_listening_port, listening_tcp_ports, rewrite_tcp_port};
use crate::world::{describe, seg, Side, RX_PEER, TX_PEER};

/// The id the sender knows the first generation by when it goes through the TCP proxy.
const PROXIED_PEER: u64 = 22;
use kvgate_abi::{EventKind, MemoryKind, ReasonCode};

fn refused(outcome: &Outcome) -> Option<String> {
    match outcome {
        Outcome::Failed { error } => Some(error.code_name.clone()),
        _ => None,
    }
}

// CONFORMANCE: HANDSHAKE-2
pub fn handshake_2(ctx: &mut Ctx) -> CheckResult {
    with_pair(ctx, |p, ctx| {
        // Over TCP: each side reaches the other through a TCP proxy from the start (UCX pairs the
        // sockets of both directions, so both go the same way).
        let rx_endpoint = p.endpoint(Side::Rx, ctx)?;
        let to_rx = match find_loopback_udp(&rx_endpoint) {
            Some(_) => None,
            None => super::network::tcp_proxy_to(p, Side::Rx, ctx)?,
        };
        let mut to_tx = None;
        if let Some((_, rewritten)) = &to_rx {
            if let Some((proxy, tx_endpoint)) = super::network::tcp_proxy_to(p, Side::Tx, ctx)? {
                p.call(Side::Rx, Op::Disconnect { peer: TX_PEER }, ctx)?;
                p.call(Side::Rx, Op::Connect { peer: TX_PEER, endpoint: tx_endpoint.clone() }, ctx)?;
                to_tx = Some((proxy, tx_endpoint));
            }
            p.call(Side::Tx, Op::Disconnect { peer: RX_PEER }, ctx)?;
            if let Outcome::Failed { error } =
                p.call(Side::Tx, Op::Connect { peer: PROXIED_PEER, endpoint: rewritten.clone() }, ctx)?.outcome
            {
                return fail(format!("connect through the TCP proxy refused: {}: {}", error.code_name, error.message));
            }
            p.rx_peer = PROXIED_PEER;
        }
        let proxy = to_rx.map(|(proxy, _)| proxy);
        let src = p.alloc_src(1 << 20, ctx.rng.next_u64(), ctx)?;
        let dst = p.alloc_dst(1 << 20, ctx.rng.next_u64(), ctx)?;
        let ticket = p.authorise(&dst, ctx)?;
        sleep_ms(20);
        match super::data::transfer_and_settle(p, ticket, src.rid, dst.rid, vec![seg(&src, 0, &dst, 0, 65536)], ctx)? {
            Ok(_) => {}
            Err(e) => return fail(format!("first generation: {e}")),
        }
        let waiting = p.ticket();
        let (old_live, r) = p.submit(waiting, ctx.limits.long_timeout_ms, vec![seg(&src, 0, &dst, 4096, 4096)], ctx)?;
        accepted(r, "transfer")?;
        sleep_ms(10);
        let was_live = p.terminal(old_live).is_none();
        // The receiver dies and a new generation starts with the same plugin and config.
        p.rx.kill();
        p.rx = PeerProcess::spawn(&ctx.cmd, "receiver-gen2").map_err(Verdict::Fail)?;
        match p
            .call(
                Side::Rx,
                Op::Open {
                    plugin: ctx.plugin.clone(),
                    config: ctx.plugin_config.clone(),
                    memory: ctx.limits.memory_provider.clone(),
                },
                ctx,
            )?
            .outcome
        {
            Outcome::Info { .. } => {}
            other => return fail(format!("second generation could not open: {other:?}")),
        }
        let tx_endpoint = match &to_tx {
            Some((_, through_proxy)) => through_proxy.clone(),
            None => p.endpoint(Side::Tx, ctx)?,
        };
        p.call(Side::Rx, Op::Connect { peer: TX_PEER, endpoint: tx_endpoint }, ctx)?;
        let disc = p.call(Side::Tx, Op::Disconnect { peer: p.rx_peer }, ctx)?;
        let mut problems = Vec::new();
        if was_live {
            match p.wait_terminal(old_live, ms_of(ctx.limits.abort_grace_ms + 1_000)) {
                Some(e) if e.kind == EventKind::SUCCEEDED.0 => {
                    problems.push(format!("old generation's waiting transfer {}", describe(&e)))
                }
                Some(e) if e.t_ns.saturating_sub(disc.t_ns) > grace_ns(ctx) => problems.push(format!(
                    "old generation's transfer ended {} ms after disconnect",
                    (e.t_ns - disc.t_ns) / 1_000_000
                )),
                Some(_) => {}
                None => problems.push("old generation's live transfer never ended after disconnect".into()),
            }
        }
        let old_peer = p.rx_peer;
        let mut endpoint = p.endpoint(Side::Rx, ctx)?;
        if let Some(proxy) = &proxy {
            // The new generation behind the same address: the proxy now forwards to its port.
            let ports = listening_tcp_ports(p.rx.pid());
            let Some((at, port)) = find_listening_port(&endpoint, &ports) else {
                return fail(format!(
                    "the restarted receiver's endpoint names none of the TCP ports it listens on ({ports:?})"
                ));
            };
            proxy.retarget(([127, 0, 0, 1], port).into());
            endpoint = rewrite_tcp_port(&endpoint, at, proxy.listen.port());
        }
        p.rx_peer = 3;
        if let Outcome::Failed { error } = p.call(Side::Tx, Op::Connect { peer: 3, endpoint }, ctx)?.outcome {
            return fail(format!("connect to the new generation refused: {}: {}", error.code_name, error.message));
        }
        let dst2 = p.alloc_dst(1 << 20, ctx.rng.next_u64(), ctx)?;
        let ticket2 = p.authorise(&dst2, ctx)?;
        sleep_ms(20);
        let moved = match super::data::transfer_and_settle(
            p,
            ticket2,
            src.rid,
            dst2.rid,
            vec![seg(&src, 7, &dst2, 5, 100_000)],
            ctx,
        )? {
            Ok(l) => l,
            Err(e) => {
                problems.push(format!("new generation: {e}"));
                String::new()
            }
        };
        // Cached state of the old generation must be gone.
        let stale = [("the old generation's remote key", 3u64, dst.remote), ("the old peer id", old_peer, dst2.remote)];
        for (what, peer, remote) in stale {
            let saved = p.rx_peer;
            p.rx_peer = peer;
            let (x, r) = p.submit(
                ticket2,
                2_000,
                vec![crate::peer::protocol::Seg { remote, ..seg(&src, 0, &dst2, 0, 64) }],
                ctx,
            )?;
            p.rx_peer = saved;
            if r.is_ok() {
                if let Some(e) = p.wait_terminal(x, ms_of(2_000 + ctx.limits.deadline_slack_ms)) {
                    if e.kind == EventKind::SUCCEEDED.0 {
                        problems.push(format!("a submit using {what} after disconnect SUCCEEDED"));
                    }
                }
            }
        }
        let route = match &proxy {
            Some(proxy) => format!(
                "; both generations behind the same TCP proxy address {} ({}; the way back: {})",
                proxy.listen,
                proxy.summary(),
                to_tx.as_ref().map_or("direct".to_string(), |(t, _)| t.summary())
            ),
            None => String::new(),
        };
        verdict_of(
            problems,
            format!("receiver killed and restarted; disconnect ended the old generation's transfers; new generation moved data ({moved}); old keys and id refused{route}"),
        )
    })
}

// CONFORMANCE: HANDSHAKE-3
pub fn handshake_3(ctx: &mut Ctx) -> CheckResult {
    with_pair(ctx, |p, ctx| {
        let rid = p.rid();
        p.call(Side::Tx, Op::Alloc { rid, len: 1 << 16, seed: 3 }, ctx)?;
        let (mut lines, mut problems) = (Vec::new(), Vec::new());
        for kind in MemoryKind::ALL.iter().copied() {
            if p.info.memory_kinds & kind.bit() != 0 {
                lines.push(format!("{kind} advertised"));
                continue;
            }
            let region = RawRegion {
                kind: kind.0,
                device: 0,
                rid: Some(rid),
                addr_offset: 0,
                len: 1 << 16,
                backing: true,
                ipc_handle: vec![0xab; 64],
            };
            let out = p.call(Side::Tx, Op::RegisterRaw { region }, ctx)?.outcome;
            match &out {
                Outcome::Failed { error } if error.code == ReasonCode::UNSUPPORTED_MEMORY.0 => {
                    lines.push(format!("{kind} refused (unsupported_memory)"))
                }
                Outcome::Failed { error } => problems.push(format!(
                    "{kind} (not advertised) refused with {} instead of unsupported_memory",
                    error.code_name
                )),
                _ => problems
                    .push(format!("register of {kind} memory, which the plugin does not advertise, was accepted")),
            }
        }
        let zero = RawRegion {
            kind: MemoryKind::HOST.0,
            device: -1,
            rid: Some(rid),
            addr_offset: 0,
            len: 0,
            backing: true,
            ipc_handle: vec![],
        };
        match refused(&p.call(Side::Tx, Op::RegisterRaw { region: zero }, ctx)?.outcome) {
            Some(code) => lines.push(format!("zero-length region refused ({code})")),
            None => problems.push("a zero-length region was accepted".into()),
        }
        let same_host_only = p.info.scope == kvgate_abi::scope::SAME_HOST;
        if same_host_only && p.info.memory_kinds & MemoryKind::HOST.bit() != 0 {
            let bare = RawRegion {
                kind: MemoryKind::HOST.0,
                device: -1,
                rid: Some(rid),
                addr_offset: 0,
                len: 4096,
                backing: false,
                ipc_handle: vec![],
            };
            match refused(&p.call(Side::Tx, Op::RegisterRaw { region: bare }, ctx)?.outcome) {
                Some(code) => lines.push(format!("host region without a backing file refused ({code})")),
                None => problems
                    .push("a same-host plugin accepted a host region with no backing file a peer could map".into()),
            }
        }
        verdict_of(problems, lines.join("; "))
    })
}

// CONFORMANCE: HANDSHAKE-4
pub fn handshake_4(ctx: &mut Ctx) -> CheckResult {
    with_pair(ctx, |p, ctx| {
        let dst = p.alloc_dst(1 << 16, ctx.rng.next_u64(), ctx)?;
        let half = dst.remote_bytes[..dst.remote_bytes.len() / 2].to_vec();
        let mut flipped = dst.remote_bytes.clone();
        if let Some(b) = flipped.first_mut() {
            *b ^= 0xff;
        }
        let cases: Vec<(&str, Op)> = vec![
            ("endpoint of 7 bytes of 0xff", Op::Connect { peer: 9, endpoint: vec![0xff; 7] }),
            ("empty endpoint", Op::Connect { peer: 10, endpoint: vec![] }),
            ("remote key of 13 bytes of 0xff", Op::Import { peer: p.rx_peer, bytes: vec![0xff; 13] }),
            ("empty remote key", Op::Import { peer: p.rx_peer, bytes: vec![] }),
            ("remote key cut in half", Op::Import { peer: p.rx_peer, bytes: half }),
            ("remote key with its first byte flipped", Op::Import { peer: p.rx_peer, bytes: flipped }),
        ];
        let (mut lines, mut problems) = (Vec::new(), Vec::new());
        for (what, op) in cases {
            match refused(&p.call(Side::Tx, op, ctx)?.outcome) {
                Some(code) => lines.push(format!("{what} → {code}")),
                None => problems.push(format!("{what} was accepted")),
            }
        }
        verdict_of(problems, lines.join("; "))
    })
}
