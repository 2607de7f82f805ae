//! TIME-1..5: every transfer ends by its deadline whatever the peer does, and no call blocks.
//! Lateness is measured on the sender peer's clock from `submit` returning to the terminal event.

use super::*;
use crate::peer::protocol::{Op, Outcome};
use crate::world::{describe, ms, seg, Side};

/// Judge each transfer's terminal event against `timeout + slack`.
pub(crate) fn judge_deadlines(p: &Pair, xfers: &[(u64, u64)], what: &str, ctx: &Ctx) -> CheckResult {
    let slack = ctx.limits.deadline_slack_ms;
    let longest = xfers.iter().map(|&(_, t)| t).max().unwrap_or(0);
    p.wait_all_terminal(&xfers.iter().map(|&(x, _)| x).collect::<Vec<_>>(), ms_of(longest + slack + 2_000));
    let (mut lines, mut problems) = (Vec::new(), Vec::new());
    for &(x, timeout_ms) in xfers {
        let submitted = p.xfers[&x].submitted_ns;
        match p.terminal(x) {
            Some(e) => {
                let after = e.t_ns.saturating_sub(submitted);
                if after > (timeout_ms + slack) * 1_000_000 {
                    problems.push(format!(
                        "{what}: timeout {timeout_ms} ms, {} came {:.1} ms after submit (bound {} ms)",
                        describe(&e),
                        ms(after),
                        timeout_ms + slack
                    ));
                } else {
                    lines.push(format!("{timeout_ms} ms → {} after {:.1} ms", crate::world::describe(&e), ms(after)));
                }
            }
            None => problems.push(format!(
                "{what}: transfer {x} with timeout {timeout_ms} ms has no terminal event {} ms after submit",
                longest + slack + 2_000
            )),
        }
    }
    verdict_of(problems, format!("{what}: {}", lines.join("; ")))
}

// CONFORMANCE: TIME-1
pub fn time_1(ctx: &mut Ctx) -> CheckResult {
    with_pair(ctx, |p, ctx| {
        let src = p.alloc_src(1 << 16, ctx.rng.next_u64(), ctx)?;
        let dst = p.alloc_dst(1 << 16, ctx.rng.next_u64(), ctx)?;
        let mut xfers = Vec::new();
        for (i, timeout_ms) in [50u64, 200, 500].into_iter().enumerate() {
            let ticket = p.ticket(); // never authorised
            let (x, r) =
                p.submit(ticket, timeout_ms, vec![seg(&src, i as u64 * 4096, &dst, i as u64 * 4096, 4096)], ctx)?;
            accepted(r, "transfer to an unregistered ticket")?;
            xfers.push((x, timeout_ms));
        }
        judge_deadlines(p, &xfers, "receiver never authorised the ticket", ctx)
    })
}

// CONFORMANCE: TIME-2
pub fn time_2(ctx: &mut Ctx) -> CheckResult {
    with_pair(ctx, |p, ctx| {
        let src = p.alloc_src(1 << 20, ctx.rng.next_u64(), ctx)?;
        let dst = p.alloc_dst(1 << 20, ctx.rng.next_u64(), ctx)?;
        let ticket = p.authorise(&dst, ctx)?;
        p.settle_ticket(&src, &dst, ticket, ctx)?;
        p.rx.freeze().map_err(Verdict::Fail)?;
        let mut xfers = Vec::new();
        for (i, timeout_ms) in [100u64, 300].into_iter().enumerate() {
            let (x, r) =
                p.submit(ticket, timeout_ms, vec![seg(&src, i as u64 * 65536, &dst, i as u64 * 65536, 65536)], ctx)?;
            match r {
                Ok(_) => xfers.push((x, timeout_ms)),
                Err(e) => {
                    p.rx.resume();
                    return fail(format!(
                        "submit refused while the receiver was frozen: {}: {}",
                        e.code_name, e.message
                    ));
                }
            }
        }
        let verdict = judge_deadlines(p, &xfers, "receiver frozen (SIGSTOP) after authorising", ctx);
        p.rx.resume();
        verdict
    })
}

// CONFORMANCE: TIME-3
pub fn time_3(ctx: &mut Ctx) -> CheckResult {
    with_pair(ctx, |p, ctx| {
        let src = p.alloc_src(1 << 16, ctx.rng.next_u64(), ctx)?;
        let dst = p.alloc_dst(1 << 16, ctx.rng.next_u64(), ctx)?;
        // Disconnect: transfers waiting on an unauthorised ticket must fail within G.
        let waiting_ticket = p.ticket();
        let mut waiting = Vec::new();
        for i in 0..3u64 {
            let (x, r) = p.submit(
                waiting_ticket,
                ctx.limits.long_timeout_ms,
                vec![seg(&src, i * 4096, &dst, i * 4096, 4096)],
                ctx,
            )?;
            accepted(r, "transfer")?;
            waiting.push(x);
        }
        sleep_ms(10);
        let live: Vec<u64> = waiting.iter().copied().filter(|x| p.terminal(*x).is_none()).collect();
        let disc = p.call(Side::Tx, Op::Disconnect { peer: p.rx_peer }, ctx)?;
        let mut problems = Vec::new();
        let missing = p.wait_all_terminal(&live, ms_of(ctx.limits.abort_grace_ms + 1_000));
        for x in &live {
            match p.terminal(*x) {
                Some(e) if e.t_ns.saturating_sub(disc.t_ns) > grace_ns(ctx) => problems.push(format!(
                    "after disconnect: {} came {:.1} ms later (bound {} ms)",
                    describe(&e),
                    ms(e.t_ns.saturating_sub(disc.t_ns)),
                    ctx.limits.abort_grace_ms
                )),
                Some(e) if e.kind == kvgate_abi::EventKind::SUCCEEDED.0 => problems
                    .push(format!("after disconnect: {} for a transfer the receiver never authorised", describe(&e))),
                _ => {}
            }
        }
        if !missing.is_empty() {
            problems.push(format!("after disconnect: transfers {missing:?} never ended"));
        }
        // Reconnect, then kill the receiver: transfers to it end by their deadline.
        let endpoint = p.endpoint(Side::Rx, ctx)?;
        p.rx_peer = 11;
        match p.call(Side::Tx, Op::Connect { peer: 11, endpoint }, ctx)?.outcome {
            Outcome::Done => {}
            other => return fail(format!("reconnect after disconnect: {other:?}")),
        }
        let dst2 = p.alloc_dst(1 << 16, ctx.rng.next_u64(), ctx)?;
        let ticket = p.authorise(&dst2, ctx)?;
        sleep_ms(20);
        p.rx.kill();
        let mut xfers = Vec::new();
        for (i, timeout_ms) in [100u64, 300].into_iter().enumerate() {
            let (x, r) =
                p.submit(ticket, timeout_ms, vec![seg(&src, i as u64 * 4096, &dst2, i as u64 * 4096, 4096)], ctx)?;
            if r.is_ok() {
                xfers.push((x, timeout_ms));
            }
        }
        let killed = judge_deadlines(p, &xfers, "receiver killed (SIGKILL)", ctx);
        match killed {
            Ok(ev) => {
                verdict_of(problems, format!("disconnect failed {} waiting transfers within G; {ev}", live.len()))
            }
            Err(Verdict::Fail(f)) => {
                problems.push(f);
                verdict_of(problems, String::new())
            }
            Err(v) => Err(v),
        }
    })
}

// CONFORMANCE: TIME-4
pub fn time_4(ctx: &mut Ctx) -> CheckResult {
    with_pair(ctx, |p, ctx| {
        let big = ctx.limits.max_data_bytes.min(64 << 20);
        let src = p.alloc_src(big, ctx.rng.next_u64(), ctx)?;
        let dst = p.alloc_dst(big, ctx.rng.next_u64(), ctx)?;
        let ticket = p.authorise(&dst, ctx)?;
        sleep_ms(20);
        let n = 10_000u64.min(big / 64);
        let piece = big / n;
        let mut xfers = Vec::new();
        for timeout_ms in [1u64, 5, 20] {
            let segs = (0..n).map(|i| seg(&src, i * piece, &dst, i * piece, piece)).collect();
            let (x, r) = p.submit(ticket, timeout_ms, segs, ctx)?;
            if r.is_ok() {
                xfers.push((x, timeout_ms));
            }
            // One at a time: each transfer gets the plugin's full attention and still must stop.
            p.wait_terminal(x, ms_of(timeout_ms + ctx.limits.deadline_slack_ms + 2_000));
        }
        if xfers.is_empty() {
            return fail("every short-deadline submit was refused");
        }
        judge_deadlines(p, &xfers, &format!("{} MiB in {n} segments", big >> 20), ctx)
    })
}

// CONFORMANCE: TIME-5
pub fn time_5(ctx: &mut Ctx) -> CheckResult {
    with_pair(ctx, |p, ctx| {
        let bound_ns = ctx.limits.call_bound_ms * 1_000_000;
        let stuck = ms_of((ctx.limits.call_bound_ms * 20).max(2_000));
        let src = p.alloc_src(1 << 20, ctx.rng.next_u64(), ctx)?;
        let dst = p.alloc_dst(1 << 20, ctx.rng.next_u64(), ctx)?;
        let ticket = p.authorise(&dst, ctx)?;
        p.settle_ticket(&src, &dst, ticket, ctx)?;
        let mut problems = Vec::new();
        let mut slowest: Vec<(String, u64)> = Vec::new();
        // Load: a thousand transfers waiting on an unauthorised ticket.
        let waiting_ticket = p.ticket();
        let load = 1_000u64;
        let first = p.xfer_id() + 1;
        for _ in 0..load {
            p.xfer_id();
        }
        let timeout_ns = ctx.limits.long_timeout_ms * 1_000_000;
        let peer = p.rx_peer;
        let op = Op::SubmitMany {
            first_xfer: first,
            count: load,
            peer,
            ticket: waiting_ticket,
            timeout_ns,
            segments: vec![seg(&src, 0, &dst, 0, 64)],
        };
        let reply = p.call(Side::Tx, op, ctx)?;
        let mut load_ids = Vec::new();
        if let Outcome::Batch { errors, max_call_ns, .. } = &reply.outcome {
            slowest.push(("submit under load".into(), *max_call_ns));
            for (i, e) in errors.iter().enumerate() {
                let x = first + i as u64;
                p.xfers.insert(x, crate::world::Xfer::new(e.is_none(), reply.t_ns, timeout_ns, 64));
                if e.is_none() {
                    load_ids.push(x);
                }
            }
        }
        // The receiver frozen: every kind of call, and a burst of submits to the frozen peer.
        p.rx.freeze().map_err(Verdict::Fail)?;
        let burst = 200u64;
        let first = p.xfer_id() + 1;
        for _ in 0..burst {
            p.xfer_id();
        }
        let op = Op::SubmitMany {
            first_xfer: first,
            count: burst,
            peer,
            ticket,
            timeout_ns,
            segments: vec![seg(&src, 0, &dst, 4096, 4096)],
        };
        let id = p.tx.send(&op);
        match p.tx.wait_reply(id, stuck) {
            Ok(reply) => {
                p.inspect(&reply.outcome, "submit", ctx);
                if let Outcome::Batch { errors, max_call_ns, slowest_index, .. } = reply.outcome {
                    slowest.push((format!("submit #{slowest_index} to the frozen receiver"), max_call_ns));
                    for (i, e) in errors.iter().enumerate() {
                        p.xfers.insert(
                            first + i as u64,
                            crate::world::Xfer::new(e.is_none(), reply.t_ns, timeout_ns, 4096),
                        );
                    }
                }
            }
            Err(e) => {
                problems.push(format!("{burst} submits to the frozen receiver: {e}"));
                p.rx.resume();
                // Let the blocked call finish so the ledger stays whole.
                if let Ok(reply) = p.tx.wait_reply(id, p.bound()) {
                    if let Outcome::Batch { errors, .. } = reply.outcome {
                        for (i, e) in errors.iter().enumerate() {
                            p.xfers.insert(
                                first + i as u64,
                                crate::world::Xfer::new(e.is_none(), reply.t_ns, timeout_ns, 4096),
                            );
                        }
                    }
                }
            }
        }
        let calls: Vec<(&str, Op)> = vec![
            ("stats", Op::Stats),
            ("local_endpoint", Op::Endpoint),
            ("import_remote_key", Op::Import { peer, bytes: dst.remote_bytes.clone() }),
            ("cancel", Op::Cancel { xfer: first }),
            ("cancel (unknown id)", Op::Cancel { xfer: first + 10_000_000 }),
        ];
        for (what, op) in calls {
            let id = p.tx.send(&op);
            match p.tx.wait_reply(id, stuck) {
                Ok(r) => {
                    p.inspect(&r.outcome, what, ctx);
                    slowest.push((format!("{what} while the receiver was frozen"), r.call_ns));
                }
                Err(e) => problems.push(format!("{what} while the receiver was frozen: {e}")),
            }
        }
        if p.rx.frozen {
            p.rx.resume();
        }
        let cancel = p.call(Side::Tx, Op::CancelMany { xfers: load_ids }, ctx)?;
        if let Outcome::Batch { max_call_ns, .. } = cancel.outcome {
            slowest.push(("cancel under load".into(), max_call_ns));
        }
        let reg = p.rid();
        p.call(Side::Tx, Op::Alloc { rid: reg, len: 1 << 20, seed: 1 }, ctx)?;
        let r = p.call(Side::Tx, Op::Register { rid: reg }, ctx)?;
        slowest.push(("register".into(), r.call_ns));
        if let Outcome::Registered { key, .. } = r.outcome {
            let r = p.call(Side::Tx, Op::Deregister { key }, ctx)?;
            slowest.push(("deregister".into(), r.call_ns));
        }
        for (what, ns) in &slowest {
            if *ns > bound_ns {
                problems.push(format!("{what} took {:.1} ms (bound {} ms)", ms(*ns), ctx.limits.call_bound_ms));
            }
        }
        let worst = slowest.iter().max_by_key(|(_, ns)| *ns).cloned().unwrap_or_default();
        verdict_of(
            problems,
            format!(
                "{} kinds of call timed, under 1000 live transfers and with the receiver frozen; slowest: {} {:.2} ms",
                slowest.len(),
                worst.0,
                ms(worst.1)
            ),
        )
    })
}
