//! OBS-1, OBS-2 and OBS-5: failures carry a reason and a message (every event and error of the run is
//! inspected; this check provokes each kind of failure), `stats()` follows reality, and progress only
//! moves forward (every PROGRESS event of the run is checked; this check provokes them).

use super::*;
use crate::peer::protocol::{Op, Outcome, RawRegion};
use crate::world::{is_terminal, seg, Side};
use kvgate_abi::{cap_flags, EventKind};

// CONFORMANCE: OBS-1
pub fn obs_1(ctx: &mut Ctx) -> CheckResult {
    with_pair(ctx, |p, ctx| {
        let src = p.alloc_src(1 << 16, ctx.rng.next_u64(), ctx)?;
        let dst = p.alloc_dst(1 << 16, ctx.rng.next_u64(), ctx)?;
        let waiting = p.ticket();
        let (cancelled, r) = p.submit(waiting, ctx.limits.long_timeout_ms, vec![seg(&src, 0, &dst, 0, 4096)], ctx)?;
        accepted(r, "transfer")?;
        p.cancel(cancelled, ctx)?;
        let (timed_out, r) = p.submit(waiting, 20, vec![seg(&src, 0, &dst, 0, 4096)], ctx)?;
        accepted(r, "transfer")?;
        let (_, refused) = p.submit(waiting, 1_000, vec![seg(&src, 1 << 20, &dst, 0, 4096)], ctx)?;
        let region = RawRegion {
            kind: 0xfff0,
            device: 0,
            rid: None,
            addr_offset: 0,
            len: 4096,
            backing: false,
            ipc_handle: vec![],
        };
        let reg = p.call(Side::Tx, Op::RegisterRaw { region }, ctx)?;
        p.wait_all_terminal(
            &[cancelled, timed_out],
            ms_of(ctx.limits.abort_grace_ms + ctx.limits.deadline_slack_ms + 1_000),
        );
        let failures =
            p.tx.events().iter().filter(|e| is_terminal(e) && e.kind == kvgate_abi::EventKind::FAILED.0).count();
        let errors = usize::from(refused.is_err()) + usize::from(matches!(reg.outcome, Outcome::Failed { .. }));
        Ok(format!("provoked a cancel, a timeout, a bad submit and a bad register ({failures} FAILED events, {errors} errors); every event and error of the run inspected"))
    })
}

// CONFORMANCE: OBS-2
pub fn obs_2(ctx: &mut Ctx) -> CheckResult {
    with_pair(ctx, |p, ctx| {
        let mut problems = Vec::new();
        let base = p.stats(Side::Tx, ctx)?;
        if base.healthy != 1 {
            problems.push(format!("healthy = {} on a freshly opened plugin", base.healthy));
        }
        if base.connected_peers < 1 {
            problems.push("connected_peers = 0 after a connect".into());
        }
        let len = 3 * 65536 + 17;
        let src = p.alloc_src(len, ctx.rng.next_u64(), ctx)?;
        let s = p.stats(Side::Tx, ctx)?;
        if s.registered_regions != base.registered_regions + 1 || s.registered_bytes != base.registered_bytes + len {
            problems.push(format!(
                "after registering {len} bytes: regions {} → {}, bytes {} → {}",
                base.registered_regions, s.registered_regions, base.registered_bytes, s.registered_bytes
            ));
        }
        let dst = p.alloc_dst(1 << 16, ctx.rng.next_u64(), ctx)?;
        let s2 = p.stats(Side::Tx, ctx)?;
        if s2.imported_remote_keys != s.imported_remote_keys + 1 {
            problems.push(format!(
                "after an import: imported_remote_keys {} → {}",
                s.imported_remote_keys, s2.imported_remote_keys
            ));
        }
        let endpoint = p.endpoint(Side::Rx, ctx)?;
        p.call(Side::Tx, Op::Connect { peer: 12, endpoint }, ctx)?;
        let s3 = p.stats(Side::Tx, ctx)?;
        if s3.connected_peers != s2.connected_peers + 1 {
            problems.push(format!("after a connect: connected_peers {} → {}", s2.connected_peers, s3.connected_peers));
        }
        p.call(Side::Tx, Op::Disconnect { peer: 12 }, ctx)?;
        let s4 = p.stats(Side::Tx, ctx)?;
        if s4.connected_peers != s2.connected_peers {
            problems
                .push(format!("after a disconnect: connected_peers {} → {}", s3.connected_peers, s4.connected_peers));
        }
        // Live transfers: five waiting on a ticket not yet authorised.
        let waiting = p.ticket();
        let mut ids = Vec::new();
        let mut last_reply_ns = 0;
        for i in 0..5u64 {
            let (x, r) =
                p.submit(waiting, ctx.limits.long_timeout_ms, vec![seg(&src, i * 100, &dst, i * 100, 100)], ctx)?;
            last_reply_ns = accepted(r, "transfer")?;
            ids.push(x);
        }
        // The contract (OBS-2): a transfer whose terminal event was delivered before `stats()` was
        // called is not counted, and one `stats()` leaves out has its terminal event delivered within
        // G of `stats()` returning (the decrement may precede the event by its delivery in flight,
        // never by more). Event and reply times are the sender peer's own clock.
        let reply = p.call(Side::Tx, Op::Stats, ctx)?;
        let Outcome::Stats { stats } = reply.outcome else {
            return fail(format!("stats: unexpected reply {:?}", reply.outcome));
        };
        let live = stats.live_transfers;
        // Surely before the stats call: the last submit's reply (same peer, calls one at a time).
        let called_ns = last_reply_ns;
        let lag_ns = ctx.limits.abort_grace_ms * 1_000_000;
        // Give a transfer that really is live time to show it: no grant for longer than the lag.
        sleep_ms(ctx.limits.abort_grace_ms + 50);
        let ended_at = |x: u64| p.terminal(x).map(|e| e.t_ns);
        let before = ids.iter().filter(|x| ended_at(**x).is_none_or(|t| t >= called_ns)).count() as u64;
        let after = ids.iter().filter(|x| ended_at(**x).is_none_or(|t| t > reply.t_ns + lag_ns)).count() as u64;
        if live > before + base.live_transfers {
            problems.push(format!(
                "live_transfers = {live} counts transfers whose terminal event was delivered before stats() was called ({before} of the harness's transfers were live then, baseline {})",
                base.live_transfers
            ));
        }
        if live < after + base.live_transfers {
            problems.push(format!(
                "live_transfers = {live} while {after} of the harness's transfers had no terminal event until more than {} ms after stats() returned (baseline {})",
                ctx.limits.abort_grace_ms, base.live_transfers
            ));
        }
        let timeout_ns = ctx.limits.long_timeout_ms * 1_000_000;
        p.call(
            Side::Rx,
            Op::ExpectIncoming {
                ticket: waiting,
                peer: crate::world::TX_PEER,
                timeout_ns,
                ranges: vec![(dst.key, 0, dst.len)],
            },
            ctx,
        )?;
        let rx_tickets = p.stats(Side::Rx, ctx)?.live_tickets;
        let missing = p.wait_all_terminal(&ids, ms_of(10_000));
        if !missing.is_empty() {
            problems.push(format!("transfers {missing:?} never ended after their ticket was authorised"));
        }
        sleep_ms(20);
        let end = p.stats(Side::Tx, ctx)?;
        if end.live_transfers != base.live_transfers {
            problems.push(format!(
                "live_transfers {} after every transfer ended (baseline {})",
                end.live_transfers, base.live_transfers
            ));
        }
        p.call(Side::Tx, Op::Release { key: dst.remote }, ctx)?;
        p.call(Side::Tx, Op::Deregister { key: src.key }, ctx)?;
        let fin = p.stats(Side::Tx, ctx)?;
        if fin.registered_regions != base.registered_regions
            || fin.registered_bytes != base.registered_bytes
            || fin.imported_remote_keys != base.imported_remote_keys
        {
            problems.push(format!("after deregister and release: {fin:?}, baseline {base:?}"));
        }
        verdict_of(
            problems,
            format!("register/deregister, import/release, connect/disconnect and live transfers moved the gauges exactly (live peak {live}, receiver tickets {rx_tickets}, healthy 1)"),
        )
    })
}

// CONFORMANCE: OBS-5
pub fn obs_5(ctx: &mut Ctx) -> CheckResult {
    with_pair(ctx, |p, ctx| {
        let len = ctx.limits.max_data_bytes.min(16 << 20);
        let src = p.alloc_src(len, ctx.rng.next_u64(), ctx)?;
        let dst = p.alloc_dst(len, ctx.rng.next_u64(), ctx)?;
        let ticket = p.authorise(&dst, ctx)?;
        p.settle_ticket(&src, &dst, ticket, ctx)?;
        // Segments that halve in size, then 64 of random sizes: progress counted any way but as a
        // running total of the transfer goes backwards here.
        let mut halving = Vec::new();
        let (mut at, mut l) = (0u64, len / 2);
        while l >= 1024 {
            halving.push(seg(&src, at, &dst, at, l));
            at += l;
            l /= 2;
        }
        let mut random = Vec::new();
        let mut at = 0u64;
        for _ in 0..64 {
            let l = 1 + ctx.rng.below(len / 64);
            random.push(seg(&src, at, &dst, at, l));
            at += l;
        }
        let mut ids = Vec::new();
        for segs in [halving, random] {
            let (x, r) = p.submit(ticket, ctx.limits.long_timeout_ms, segs, ctx)?;
            accepted(r, "transfer")?;
            ids.push(x);
            p.wait_terminal(x, p.bound());
        }
        // One cancelled as soon as its submit returns: no PROGRESS may follow its terminal event.
        let cycled = (0..16).map(|_| seg(&src, 0, &dst, 0, len)).collect();
        let (x, r) = p.submit(ticket, ctx.limits.long_timeout_ms, cycled, ctx)?;
        accepted(r, "transfer")?;
        p.cancel(x, ctx)?;
        ids.push(x);
        let missing = p.wait_all_terminal(&ids, p.bound());
        if !missing.is_empty() {
            return fail(format!("transfers {missing:?} had no terminal event within {} ms", p.bound().as_millis()));
        }
        sleep_ms(50);
        let progress =
            p.tx.events().iter().filter(|e| e.kind == EventKind::PROGRESS.0 && ids.contains(&e.xfer)).count();
        let advertised = p.info.flags & cap_flags::PROGRESS_EVENTS != 0;
        Ok(format!(
            "3 transfers (segments halving from {} KiB, 64 random segments, one cancelled at once): {progress} PROGRESS events{}; every PROGRESS event of the run checked against its transfer's bytes and terminal event",
            len / 2 / 1024,
            if advertised { "" } else { " (the plugin does not advertise PROGRESS_EVENTS; they are optional in ABI v1)" }
        ))
    })
}
