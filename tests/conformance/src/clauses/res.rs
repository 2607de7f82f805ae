//! RES-1, RES-2, RES-3, RES-5: exactly one terminal event, nothing held after it (random lifecycles
//! with faults), no byte landing after quiesce, and shutdown with transfers in flight.

use super::*;
use crate::peer::protocol::{Op, Outcome, Seg, WireEvent, WireStats};
use crate::report::Status;
use crate::world::{describe, is_terminal, ms, seg, Side, Xfer};
use kvgate_abi::{event_flags, EventKind};

// CONFORMANCE: RES-1
pub fn res_1(ctx: &mut Ctx) -> CheckResult {
    with_pair(ctx, |p, ctx| {
        let src = p.alloc_src(1 << 20, ctx.rng.next_u64(), ctx)?;
        let dst = p.alloc_dst(1 << 20, ctx.rng.next_u64(), ctx)?;
        let ticket = p.authorise(&dst, ctx)?;
        sleep_ms(20);
        let mut ids = Vec::new();
        for i in 0..60u64 {
            let (x, r) = p.submit(ticket, 10_000, vec![seg(&src, i * 8192, &dst, i * 8192, 8192)], ctx)?;
            accepted(r, "transfer")?;
            ids.push(x);
            if i % 3 == 0 {
                p.cancel(x, ctx)?;
            }
        }
        let waiting = p.ticket();
        for i in 0..10u64 {
            let (x, r) = p.submit(waiting, 50, vec![seg(&src, i * 4096, &dst, i * 4096, 4096)], ctx)?;
            accepted(r, "transfer")?;
            ids.push(x);
        }
        let missing = p.wait_all_terminal(&ids, ms_of(10_000 + ctx.limits.deadline_slack_ms));
        if !missing.is_empty() {
            return fail(format!("transfers {:?} never got a terminal event", &missing[..missing.len().min(5)]));
        }
        sleep_ms(100);
        let events = p.tx.events();
        let mut doubles = Vec::new();
        for x in &ids {
            let t: Vec<String> = events.iter().filter(|e| e.xfer == *x && is_terminal(e)).map(describe).collect();
            if t.len() != 1 {
                doubles.push(format!("transfer {x}: {}", t.join(", ")));
            }
        }
        verdict_of(
            doubles,
            format!("{} transfers (completed, cancelled, timed out): one terminal event each; every event checked against the ledger of the whole run", ids.len()),
        )
    })
}

/// Stats that must return to baseline once nothing is live.
fn resource_diff(what: &str, base: &WireStats, now: &WireStats) -> Vec<String> {
    let mut out = Vec::new();
    let fields = [
        ("registered_regions", base.registered_regions, now.registered_regions),
        ("registered_bytes", base.registered_bytes, now.registered_bytes),
        ("imported_remote_keys", base.imported_remote_keys, now.imported_remote_keys),
        ("live_tickets", base.live_tickets, now.live_tickets),
    ];
    for (name, b, n) in fields {
        if b != n {
            out.push(format!("{what} {name}: baseline {b}, now {n}"));
        }
    }
    out
}

struct Planned {
    xfer: u64,
    ticket: u64,
    timeout_ns: u64,
    segments: Vec<Seg>,
    cancel_at_once: bool,
    cancel_later: bool,
}

// CONFORMANCE: RES-2
pub fn res_2(ctx: &mut Ctx) -> CheckResult {
    with_pair(ctx, |p, ctx| {
        let base_tx = p.stats(Side::Tx, ctx)?;
        let base_rx = p.stats(Side::Rx, ctx)?;
        let len = 1u64 << 20;
        let src = p.alloc_src(len, ctx.rng.next_u64(), ctx)?;
        let dst = p.alloc_dst(len, ctx.rng.next_u64(), ctx)?;
        let good = p.authorise(&dst, ctx)?;
        let never = p.ticket();
        sleep_ms(20);
        let mut rng = ctx.rng.fork(0x5e5);
        let total = ctx.limits.lifecycles;
        let batch = 100u64;
        let short_ms_max = 100u64;
        let mut all = Vec::new();
        let mut frozen_batches = 0;
        let mut done = 0u64;
        let mut batch_no = 0u64;
        while done < total {
            batch_no += 1;
            // Every eighth batch runs with the receiver frozen, a few transfers only.
            let frozen = batch_no.is_multiple_of(8);
            let n = if frozen { 3.min(total - done) } else { batch.min(total - done) };
            if frozen {
                p.rx.freeze().map_err(Verdict::Fail)?;
                frozen_batches += 1;
            }
            let mut plan = Vec::new();
            for _ in 0..n {
                let ticket = if rng.below(100) < 85 { good } else { never };
                let short = rng.below(100) < 25 || ticket == never;
                let timeout_ns = if short {
                    (1 + rng.below(short_ms_max)) * 1_000_000
                } else {
                    ctx.limits.long_timeout_ms * 1_000_000
                };
                let nseg = 1 + rng.below(3);
                let segments = (0..nseg)
                    .map(|_| {
                        let l = 1 + rng.below(4096);
                        seg(&src, rng.below(len - l), &dst, rng.below(len - l), l)
                    })
                    .collect();
                let action = rng.below(3);
                plan.push(Planned {
                    xfer: p.xfer_id(),
                    ticket,
                    timeout_ns,
                    segments,
                    cancel_at_once: action == 1,
                    // A long transfer on an unauthorised ticket must be ended by someone.
                    cancel_later: action == 2 || (!short && ticket == never),
                });
            }
            let peer = p.rx_peer;
            let mut sent = Vec::new();
            for l in &plan {
                let op = Op::Submit {
                    xfer: l.xfer,
                    peer,
                    ticket: l.ticket,
                    timeout_ns: l.timeout_ns,
                    segments: l.segments.clone(),
                };
                let sid = p.tx.send(&op);
                let cid = l.cancel_at_once.then(|| p.tx.send(&Op::Cancel { xfer: l.xfer }));
                sent.push((l, sid, cid));
            }
            for (l, sid, cid) in sent {
                let reply =
                    p.tx.wait_reply(sid, p.bound())
                        .map_err(|e| Verdict::Fail(format!("submit during lifecycles: {e}")))?;
                p.inspect(&reply.outcome, "submit", ctx);
                let ok = matches!(reply.outcome, Outcome::Done);
                p.xfers.insert(l.xfer, Xfer::new(ok, reply.t_ns, l.timeout_ns, total_bytes(&l.segments)));
                if let Some(cid) = cid {
                    p.tx.wait_reply(cid, p.bound())
                        .map_err(|e| Verdict::Fail(format!("cancel during lifecycles: {e}")))?;
                }
                all.push(l.xfer);
            }
            if frozen {
                sleep_ms(10);
                p.rx.resume();
            }
            let later: Vec<u64> = plan.iter().filter(|l| l.cancel_later).map(|l| l.xfer).collect();
            if !later.is_empty() {
                p.call(Side::Tx, Op::CancelMany { xfers: later }, ctx)?;
            }
            done += n;
        }
        // Liveness phase: faults healed, everything must end.
        let missing =
            p.wait_all_terminal(&all, ms_of(short_ms_max + ctx.limits.deadline_slack_ms + ctx.limits.storm_grace_ms));
        let quiesce_bound = ms_of(ctx.limits.abort_grace_ms + 2_000);
        p.tx.wait_events(quiesce_bound, |events| {
            let failed_unquiesced = events
                .iter()
                .filter(|e| {
                    e.kind == EventKind::FAILED.0 && e.flags & (event_flags::QUIESCED | event_flags::INCOMING) == 0
                })
                .filter(|e| !Pair::quiesced(events, e.xfer))
                .count();
            failed_unquiesced == 0
        });
        sleep_ms(50);
        let events = p.tx.events();
        let terminal: std::collections::BTreeSet<u64> =
            events.iter().filter(|e| is_terminal(e)).map(|e| e.xfer).collect();
        let accepted: Vec<u64> = all.iter().copied().filter(|x| p.accepted(*x)).collect();
        let nonterminal = accepted.iter().filter(|x| !terminal.contains(x)).count() as u64;
        let unquiesced =
            accepted.iter().filter(|x| terminal.contains(x) && !Pair::quiesced(&events, **x)).count() as u64;
        let now_tx = p.stats(Side::Tx, ctx)?;
        let mut problems = Vec::new();
        if now_tx.live_transfers > nonterminal {
            problems.push(format!(
                "live_transfers = {} but only {nonterminal} of {} accepted transfers lack a terminal event: {} leaked",
                now_tx.live_transfers,
                accepted.len(),
                now_tx.live_transfers - nonterminal
            ));
        }
        if now_tx.unquiesced_transfers > unquiesced {
            problems.push(format!(
                "unquiesced_transfers = {} but only {unquiesced} failed transfers lack their QUIESCED",
                now_tx.unquiesced_transfers
            ));
        }
        // Release everything the check created, then every resource gauge is back at baseline.
        p.call(Side::Rx, Op::CancelIncoming { peer: crate::world::TX_PEER, ticket: good }, ctx)?;
        p.call(Side::Tx, Op::Deregister { key: src.key }, ctx)?;
        p.call(Side::Tx, Op::Release { key: dst.remote }, ctx)?;
        p.call(Side::Rx, Op::Deregister { key: dst.key }, ctx)?;
        sleep_ms(ctx.limits.abort_grace_ms);
        let end_tx = p.stats(Side::Tx, ctx)?;
        let end_rx = p.stats(Side::Rx, ctx)?;
        problems.extend(resource_diff("sender", &base_tx, &end_tx));
        problems.extend(resource_diff("receiver", &base_rx, &end_rx));
        let _ = missing;
        verdict_of(
            problems,
            format!(
                "{} random lifecycles ({} accepted; cancels at once and later, short deadlines, unauthorised tickets, {frozen_batches} batches with the receiver frozen): \
                 live_transfers {} with {nonterminal} non-terminal, unquiesced {} with {unquiesced} due; regions, bytes, keys and tickets back to baseline",
                all.len(),
                accepted.len(),
                now_tx.live_transfers,
                now_tx.unquiesced_transfers
            ),
        )
    })
}

/// How long RES-3 watches the destination, continuously, once a transfer was reported quiesced.
const RES_3_WATCH_MS: u64 = 300;
/// What each of RES-3's mid-transfer cases moves: passes over the whole destination, alternating
/// between two halves of the source, so that every pass rewrites every byte with other bytes.
const RES_3_MID_BYTES: u64 = 256 << 20;
/// RES-3's mid-transfer cases: after the destination was seen changing, cancel after this many ms.
const RES_3_CANCEL_POINTS_MS: [u64; 4] = [0, 0, 3, 10];

/// The destination as the harness reads it from the shared file (works while the receiver is frozen).
fn snapshot(p: &Pair, dst: &crate::world::Dst) -> Result<Vec<u8>, Verdict> {
    p.region_bytes(Side::Rx, dst.rid, 0, dst.len).map_err(|e| Verdict::Fail(format!("reading the destination: {e}")))
}

/// Bytes of each of the small windows RES-3 reads to see a transfer's bytes moving, and how many such
/// windows, evenly spaced over the destination: reading them takes microseconds where the whole
/// destination takes milliseconds, long enough for a fast plugin to finish before the cancel.
const RES_3_PROBE_BYTES: u64 = 4096;
const RES_3_PROBE_WINDOWS: u64 = 8;

/// The probe windows of the destination, concatenated.
fn probe(p: &Pair, dst: &crate::world::Dst) -> Result<Vec<u8>, Verdict> {
    let len = RES_3_PROBE_BYTES.min(dst.len);
    let step = (dst.len / RES_3_PROBE_WINDOWS).max(len);
    let mut out = Vec::new();
    let mut at = 0;
    while at + len <= dst.len && out.len() < (RES_3_PROBE_WINDOWS * len) as usize {
        out.extend(
            p.region_bytes(Side::Rx, dst.rid, at, len)
                .map_err(|e| Verdict::Fail(format!("reading the destination: {e}")))?,
        );
        at += step;
    }
    Ok(out)
}

/// Read the destination again and again for `watch_ms` from now: when it changed, after how many
/// milliseconds of watching and at which byte.
fn watch_destination(p: &Pair, dst: &crate::world::Dst, watch_ms: u64) -> Result<Option<(f64, usize)>, Verdict> {
    let first = snapshot(p, dst)?;
    let start = std::time::Instant::now();
    while start.elapsed() < ms_of(watch_ms) {
        let now = snapshot(p, dst)?;
        if let Some(at) = first.iter().zip(&now).position(|(a, b)| a != b) {
            return Ok(Some((start.elapsed().as_secs_f64() * 1e3, at)));
        }
        std::thread::sleep(std::time::Duration::from_micros(500));
    }
    Ok(None)
}

/// After a `FAILED`: wait for the transfer's quiesce report, then watch the destination from the
/// moment it is seen. `Err` is the problem found.
fn quiesce_then_watch(
    p: &Pair,
    x: u64,
    t: &WireEvent,
    dst: &crate::world::Dst,
    what: &str,
    ctx: &Ctx,
) -> Result<Result<String, String>, Verdict> {
    let bound = ms_of(ctx.limits.deadline_slack_ms + 2_000);
    if !p.tx.wait_events(bound, |events| Pair::quiesced(events, x)) {
        return Ok(Err(format!("{what}: {} and no QUIESCED within {} ms", describe(t), bound.as_millis())));
    }
    let q_at = p.tx.events().iter().filter(|e| e.xfer == x).map(|e| e.t_ns).max().unwrap_or(0);
    Ok(match watch_destination(p, dst, RES_3_WATCH_MS)? {
        Some((after, at)) => Err(format!(
            "{what}: destination byte {at} changed {after:.1} ms into the watch that began when the transfer was reported quiesced (at {:.1} ms): bytes landed after quiesce",
            ms(q_at)
        )),
        None => Ok(format!("{what}: {}, destination unchanged for {RES_3_WATCH_MS} ms after quiesce", describe(t))),
    })
}

// CONFORMANCE: RES-3
pub fn res_3(ctx: &mut Ctx) -> CheckResult {
    with_pair(ctx, |p, ctx| {
        let big = ctx.limits.max_data_bytes.min(16 << 20);
        let src = p.alloc_src(2 * big, ctx.rng.next_u64(), ctx)?;
        let dst = p.alloc_dst(big, ctx.rng.next_u64(), ctx)?;
        let ticket = p.authorise(&dst, ctx)?;
        p.settle_ticket(&src, &dst, ticket, ctx)?;
        let (mut lines, mut problems) = (Vec::new(), Vec::new());
        for attempt in 0..5u64 {
            let frozen = attempt == 4;
            let seed = ctx.rng.next_u64();
            p.call(Side::Rx, Op::Fill { rid: dst.rid, offset: 0, len: big, seed }, ctx)?;
            let n = 1000u64;
            let piece = big / n;
            let segs = (0..n).map(|i| seg(&src, i * piece, &dst, i * piece, piece)).collect();
            if frozen {
                p.rx.freeze().map_err(Verdict::Fail)?;
            }
            let (x, r) = p.submit(ticket, ctx.limits.long_timeout_ms, segs, ctx)?;
            accepted(r, "large transfer")?;
            if attempt % 2 == 1 {
                sleep_ms(1);
            }
            p.cancel(x, ctx)?;
            let t = p.wait_terminal(x, ms_of(ctx.limits.abort_grace_ms + 2_000));
            // A frozen receiver may hold bytes the plugin cannot yet rule out: quiesce is due once it runs again.
            if frozen {
                p.rx.resume();
            }
            let Some(t) = t else {
                problems.push(format!("attempt {attempt}: no terminal event after cancel"));
                continue;
            };
            if t.kind == EventKind::SUCCEEDED.0 {
                lines.push(format!("attempt {attempt}: completed before the cancel"));
                continue;
            }
            let what = format!("attempt {attempt}{}", if frozen { " (receiver frozen)" } else { "" });
            match quiesce_then_watch(p, x, &t, &dst, &what, ctx)? {
                Ok(l) => lines.push(l),
                Err(e) => problems.push(e),
            }
        }
        // Cancels inside a transfer whose bytes are seen moving: passes over the whole destination,
        // alternating between the two halves of the source, cancelled once the destination was seen
        // changing. A success after such a cancel must leave the destination as it was when the
        // cancel returned; a failure must leave it alone once reported quiesced.
        let mut passes = (RES_3_MID_BYTES / big).max(2);
        if p.info.max_segments_per_submit > 0 {
            passes = passes.min(p.info.max_segments_per_submit);
        }
        if p.info.max_transfer_bytes > 0 {
            passes = passes.min(p.info.max_transfer_bytes / big);
        }
        let passes = passes.max(1);
        let last_half = ((passes - 1) % 2) * big;
        let (mut moving, mut mid) = (0u64, 0u64);
        for (case, wait_ms) in RES_3_CANCEL_POINTS_MS.iter().enumerate() {
            let seed = ctx.rng.next_u64();
            p.call(Side::Rx, Op::Fill { rid: dst.rid, offset: 0, len: big, seed }, ctx)?;
            let filled_probe = probe(p, &dst)?;
            let finished = p
                .region_bytes(Side::Tx, src.rid, last_half, big)
                .map_err(|e| Verdict::Fail(format!("reading the source: {e}")))?;
            let segs = (0..passes).map(|i| seg(&src, (i % 2) * big, &dst, 0, big)).collect();
            let (x, r) = p.submit(ticket, ctx.limits.long_timeout_ms, segs, ctx)?;
            accepted(r, "large transfer")?;
            // Bytes moving: the destination differs from its fill (or the transfer already ended).
            let start = std::time::Instant::now();
            let mut seen = false;
            while start.elapsed() < p.bound() && p.terminal(x).is_none() {
                if probe(p, &dst)? != filled_probe {
                    seen = true;
                    break;
                }
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
            sleep_ms(*wait_ms);
            let cancel = p.cancel(x, ctx)?;
            let at_cancel = snapshot(p, &dst)?;
            let what = format!("mid-transfer case {case} ({} MiB in {passes} passes, cancelled {wait_ms} ms after bytes were seen moving)", (passes * big) >> 20);
            let Some(t) = p.wait_terminal(x, p.bound()) else {
                problems.push(format!("{what}: no terminal event within {} ms of the cancel", p.bound().as_millis()));
                continue;
            };
            let ended_before = t.t_ns <= cancel.t_ns.saturating_sub(cancel.call_ns);
            if seen && !ended_before && at_cancel != finished {
                mid += 1;
            }
            if seen {
                moving += 1;
            }
            if t.kind == EventKind::SUCCEEDED.0 {
                // Allowed only if every byte had landed before the cancel returned.
                sleep_ms(20);
                let end = snapshot(p, &dst)?;
                match at_cancel.iter().zip(&end).position(|(a, b)| a != b) {
                    Some(at) => problems.push(format!(
                        "{what}: {} after the cancel returned (at {:.1} ms), but destination byte {at} changed after the cancel returned: the cancel was ignored while bytes still moved",
                        describe(&t),
                        ms(cancel.t_ns)
                    )),
                    None => lines.push(format!("{what}: completed before the cancel, destination unchanged since the cancel returned")),
                }
                continue;
            }
            match quiesce_then_watch(p, x, &t, &dst, &what, ctx)? {
                Ok(l) => lines.push(l),
                Err(e) => problems.push(e),
            }
        }
        let tries = RES_3_CANCEL_POINTS_MS.len();
        // A run none of whose cancels landed inside a transfer still moving tested nothing of the
        // clause's main case: not exercised, never pass.
        ctx.exercise(
            "RES-3",
            "mid-transfer cancels that found bytes moving and the transfer unfinished",
            mid,
            tries as u64,
            Status::NotExercised,
        );
        verdict_of(
            problems,
            format!("{}; mid-transfer cases: bytes seen moving before {moving} of {tries} cancels, {mid} of them reached the transfer unfinished", lines.join("; ")),
        )
    })
}

// CONFORMANCE: RES-5
pub fn res_5(ctx: &mut Ctx) -> CheckResult {
    with_pair(ctx, |p, ctx| {
        let big = ctx.limits.max_data_bytes.min(16 << 20);
        let src = p.alloc_src(big, ctx.rng.next_u64(), ctx)?;
        let dst = p.alloc_dst(big, ctx.rng.next_u64(), ctx)?;
        let ticket = p.authorise(&dst, ctx)?;
        let waiting = p.ticket();
        sleep_ms(20);
        let mut ids = Vec::new();
        for i in 0..20u64 {
            let (x, r) =
                p.submit(waiting, ctx.limits.long_timeout_ms, vec![seg(&src, i * 4096, &dst, i * 4096, 4096)], ctx)?;
            accepted(r, "transfer")?;
            ids.push(x);
        }
        for _ in 0..5 {
            let n = 1000u64;
            let piece = big / n;
            let segs = (0..n).map(|i| seg(&src, i * piece, &dst, i * piece, piece)).collect();
            let (x, r) = p.submit(ticket, ctx.limits.long_timeout_ms, segs, ctx)?;
            accepted(r, "large transfer")?;
            ids.push(x);
        }
        let shut = p.call(Side::Tx, Op::Shutdown, ctx)?;
        let mut problems = Vec::new();
        let events = p.tx.events();
        for x in &ids {
            match events.iter().find(|e| e.xfer == *x && is_terminal(e)) {
                None => problems.push(format!("transfer {x} had no terminal event when shutdown returned")),
                Some(e) if e.t_ns > shut.t_ns => problems.push(format!("{} came after shutdown returned", describe(e))),
                _ => {}
            }
        }
        let stats = p.stats(Side::Tx, ctx)?;
        if stats.workers_alive != 0 || stats.registered_regions != 0 || stats.live_transfers != 0 {
            problems.push(format!(
                "after shutdown: workers_alive {}, registered_regions {}, live_transfers {}",
                stats.workers_alive, stats.registered_regions, stats.live_transfers
            ));
        }
        let (late, r) = p.submit(ticket, 1_000, vec![seg(&src, 0, &dst, 0, 4096)], ctx)?;
        if r.is_ok() {
            problems.push(format!("submit after shutdown was accepted (transfer {late})"));
        }
        let rid = p.rid();
        p.call(Side::Tx, Op::Alloc { rid, len: 4096, seed: 1 }, ctx)?;
        if let Outcome::Registered { .. } = p.call(Side::Tx, Op::Register { rid }, ctx)?.outcome {
            problems.push("register after shutdown was accepted".into());
        }
        sleep_ms(100);
        let after: Vec<String> =
            p.tx.events().iter().filter(|e| e.t_ns > shut.t_ns && e.xfer != late).map(describe).collect();
        if !after.is_empty() {
            problems.push(format!("events after shutdown returned: {}", after.join(", ")));
        }
        verdict_of(
            problems,
            format!(
                "shutdown with {} transfers in flight returned in {:.1} ms: all terminal before it returned, workers joined, registrations released, later calls refused",
                ids.len(),
                ms(shut.call_ns)
            ),
        )
    })
}
