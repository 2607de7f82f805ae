//! ABORT-1..4: cancel in every state a plugin can be in, harmless cancels, and the abort storm.
//! Every measurement is on the sender peer's clock, from `cancel` returning to the terminal event.

use super::*;
use crate::peer::protocol::{Op, Outcome};
use crate::report::Status;
use crate::world::{is_terminal, ms, seg, Pair, Side};
use kvgate_abi::{EventKind, ReasonCode};

/// What one cancel showed: `Ok(line)` or `Err(problem)`, and whether it reached a live transfer (the
/// transfer had no terminal event before the cancel and ended after it by [`ended_by_cancel`]).
struct Cancelled {
    verdict: Result<String, String>,
    reached: bool,
}

/// Cancel `xfer` and judge the time to its terminal event against G.
fn cancel_and_time(p: &mut Pair, xfer: u64, state: &str, ctx: &mut Ctx) -> Result<Cancelled, Verdict> {
    let before = p.terminal(xfer);
    let c = p.cancel(xfer, ctx)?;
    let g = grace_ns(ctx);
    let wait = ms_of(ctx.limits.abort_grace_ms + 1_000);
    let mut reached = false;
    let verdict = match (before, p.wait_terminal(xfer, wait)) {
        (Some(e), _) => Ok(format!("{state}: already {} before cancel", crate::world::describe(&e))),
        (None, Some(e)) => {
            reached = ended_by_cancel(&e);
            let late = e.t_ns.saturating_sub(c.t_ns);
            if late > g {
                Err(format!("{state}: terminal {:.1} ms after cancel returned (bound {} ms)", ms(late), ctx.limits.abort_grace_ms))
            } else {
                Ok(format!("{state}: {} {:.2} ms after cancel", crate::world::describe(&e), ms(late)))
            }
        }
        (None, None) => Err(format!(
            "{state}: cancel of transfer {xfer} returned at {:.1} ms; no terminal event within {} ms (transfer still pending)",
            ms(c.t_ns),
            wait.as_millis()
        )),
    };
    Ok(Cancelled { verdict, reached })
}

/// Whether a terminal event is the failure a cancel brings: `FAILED` with reason `CANCELLED`, or with
/// no reason at all (a reason is OBS-1's to require). A refusal that happens to come after the cancel
/// (`NOT_EXPECTED` from a receiver that rejects the ticket) is not.
fn ended_by_cancel(e: &crate::peer::protocol::WireEvent) -> bool {
    e.kind == EventKind::FAILED.0 && (e.reason == ReasonCode::CANCELLED.0 || e.reason == 0)
}

/// What ABORT-1 moves in each of its transfers cancelled with the receiver frozen: enough that a
/// plugin copying without the receiver's grant (one-sided) is still copying when the cancel comes.
const ABORT_1_LARGE_BYTES: u64 = 256 << 20;
/// How many such transfers ABORT-1 cancels.
const ABORT_1_LARGE_CASES: u64 = 3;

// CONFORMANCE: ABORT-1
pub fn abort_1(ctx: &mut Ctx) -> CheckResult {
    with_pair(ctx, |p, ctx| {
        let src = p.alloc_src(1 << 16, ctx.rng.next_u64(), ctx)?;
        let dst = p.alloc_dst(1 << 16, ctx.rng.next_u64(), ctx)?;
        let (mut lines, mut problems) = (Vec::new(), Vec::new());
        let (mut reached, mut tries) = (0u64, 0u64);
        let mut record = |c: Cancelled| {
            tries += 1;
            reached += u64::from(c.reached);
            match c.verdict {
                Ok(l) => lines.push(l),
                Err(e) => problems.push(e),
            }
        };
        for i in 0..5u64 {
            // The receiver never authorises this ticket: the counterpart has not registered.
            let ticket = p.ticket();
            let (x, r) =
                p.submit(ticket, ctx.limits.long_timeout_ms, vec![seg(&src, i * 4096, &dst, i * 4096, 4096)], ctx)?;
            accepted(r, "transfer to an unregistered ticket")?;
            sleep_ms(5 + 5 * i);
            record(cancel_and_time(p, x, &format!("waiting for peer registration ({} ms)", 5 + 5 * i), ctx)?);
        }
        // A running receiver may refuse an unknown ticket at once (the transfer then ends before the
        // cancel), and a one-sided plugin moves a small transfer before the cancel comes: neither
        // shows what a cancel does to a live transfer. So, with the receiver frozen (it can neither
        // grant nor refuse), large transfers under tickets it never authorised, each cancelled as
        // soon as its submit returns.
        let region = ctx.limits.max_data_bytes.min(16 << 20);
        let mut pieces = ABORT_1_LARGE_BYTES / region;
        if p.info.max_segments_per_submit > 0 {
            pieces = pieces.min(p.info.max_segments_per_submit);
        }
        if p.info.max_transfer_bytes > 0 {
            pieces = pieces.min(p.info.max_transfer_bytes / region);
        }
        let pieces = pieces.max(1);
        let big_src = p.alloc_src(region, ctx.rng.next_u64(), ctx)?;
        let big_dst = p.alloc_dst(region, ctx.rng.next_u64(), ctx)?;
        p.rx.freeze().map_err(Verdict::Fail)?;
        for _ in 0..ABORT_1_LARGE_CASES {
            let ticket = p.ticket();
            let segs = (0..pieces).map(|_| seg(&big_src, 0, &big_dst, 0, region)).collect();
            let (x, r) = p.submit(ticket, ctx.limits.long_timeout_ms, segs, ctx)?;
            let state = format!("receiver frozen, {} MiB in {pieces} segments", (pieces * region) >> 20);
            match r {
                Ok(_) => record(cancel_and_time(p, x, &state, ctx)?),
                Err(e) => record(Cancelled {
                    verdict: Ok(format!("{state}: submit refused ({})", e.code_name)),
                    reached: false,
                }),
            }
        }
        p.rx.resume();
        ctx.exercise("ABORT-1", "cancels that reached a live transfer", reached, tries, Status::NotExercised);
        verdict_of(
            problems,
            format!("{tries} transfers whose receiver never authorised the ticket: {}", lines.join("; ")),
        )
    })
}

/// How long ABORT-2 waits, receiver frozen, for a 4 KiB transfer's bytes to land before it cancels.
const FROZEN_LANDING_BOUND_MS: u64 = 1_000;
/// How long after they landed (or the bound) it cancels: time for the plugin to start waiting on
/// the frozen receiver.
const FROZEN_SETTLE_MS: u64 = 20;

// CONFORMANCE: ABORT-2
pub fn abort_2(ctx: &mut Ctx) -> CheckResult {
    with_pair(ctx, |p, ctx| {
        let big = ctx.limits.max_data_bytes.min(16 << 20);
        let src = p.alloc_src(big, ctx.rng.next_u64(), ctx)?;
        let dst = p.alloc_dst(big, ctx.rng.next_u64(), ctx)?;
        let ticket = p.authorise(&dst, ctx)?;
        p.settle_ticket(&src, &dst, ticket, ctx)?;
        let (mut lines, mut problems) = (Vec::new(), Vec::new());
        let mut record = |c: Cancelled| match c.verdict {
            Ok(l) => lines.push(l),
            Err(e) => problems.push(e),
        };
        // Mid-transfer: a large scattered transfer cancelled right after submit returns.
        let n = 1000u64;
        let piece = big / n;
        let segs = (0..n).map(|i| seg(&src, i * piece, &dst, i * piece, piece)).collect();
        let (x, r) = p.submit(ticket, ctx.limits.long_timeout_ms, segs, ctx)?;
        accepted(r, "large transfer")?;
        record(cancel_and_time(p, x, &format!("mid-transfer ({} MiB in {n} segments)", big >> 20), ctx)?);
        // Frozen receiver. The 4 KiB it is sent are first made to differ from the source, so the
        // harness can see them land.
        p.call(Side::Rx, Op::Fill { rid: dst.rid, offset: 0, len: 4096, seed: ctx.rng.next_u64() }, ctx)?;
        p.rx.freeze().map_err(Verdict::Fail)?;
        let (x, r) = p.submit(ticket, ctx.limits.long_timeout_ms, vec![seg(&src, 0, &dst, 0, 4096)], ctx)?;
        let submitted = r.is_ok();
        // A plugin that writes from the sender's side moves the 4 KiB and then waits on the frozen
        // receiver: the cancel must work in that state too, so it waits for the bytes to land (however
        // loaded the machine), then a little more. A plugin whose receiver does the writing cannot
        // land them; after the bound it is cancelled in the state it is in.
        let landed = p.wait_landed(&src, &dst, 0, 4096, ms_of(FROZEN_LANDING_BOUND_MS));
        sleep_ms(FROZEN_SETTLE_MS);
        if submitted {
            let state = if landed {
                "receiver frozen (SIGSTOP), bytes landed"
            } else {
                "receiver frozen (SIGSTOP), bytes not landed"
            };
            record(cancel_and_time(p, x, state, ctx)?);
        }
        p.rx.resume();
        // Dead receiver.
        p.rx.kill();
        sleep_ms(10);
        let (x, r) = p.submit(ticket, ctx.limits.long_timeout_ms, vec![seg(&src, 0, &dst, 0, 4096)], ctx)?;
        match r {
            Ok(_) => record(cancel_and_time(p, x, "receiver killed (SIGKILL)", ctx)?),
            Err(e) => lines.push(format!("receiver killed: submit refused at once ({})", e.code_name)),
        }
        verdict_of(problems, lines.join("; "))
    })
}

// CONFORMANCE: ABORT-3
pub fn abort_3(ctx: &mut Ctx) -> CheckResult {
    with_pair(ctx, |p, ctx| {
        let src = p.alloc_src(1 << 16, ctx.rng.next_u64(), ctx)?;
        let extra = p.alloc_src(1 << 16, ctx.rng.next_u64(), ctx)?;
        let dst = p.alloc_dst(1 << 16, ctx.rng.next_u64(), ctx)?;
        let ticket = p.authorise(&dst, ctx)?;
        sleep_ms(20);
        let bound = ms_of(ctx.limits.long_timeout_ms.min(30_000));
        let (done, r) = p.submit(ticket, ctx.limits.long_timeout_ms, vec![seg(&src, 0, &dst, 0, 4096)], ctx)?;
        accepted(r, "transfer")?;
        let (on_extra, r) =
            p.submit(ticket, ctx.limits.long_timeout_ms, vec![seg(&extra, 0, &dst, 8192, 4096)], ctx)?;
        accepted(r, "transfer")?;
        let missing = p.wait_all_terminal(&[done, on_extra], bound);
        if !missing.is_empty() {
            return fail(format!(
                "transfers {missing:?} to an authorised ticket never ended within {} ms",
                bound.as_millis()
            ));
        }
        sleep_ms(20);
        match p.call(Side::Tx, Op::Deregister { key: extra.key }, ctx)?.outcome {
            Outcome::Done => {}
            other => return fail(format!("deregister of an idle region: {other:?}")),
        }
        let stats_before = p.stats(Side::Tx, ctx)?;
        let events_before = p.tx.event_count();
        let never = p.xfer_id() + 1_000_000;
        let cases = [
            ("an id never submitted", never),
            ("a transfer already terminal", done),
            ("the same transfer again (double cancel)", done),
            ("a transfer whose source region was deregistered", on_extra),
        ];
        let mut problems = Vec::new();
        let mut slowest = 0u64;
        for (what, x) in cases {
            let reply = p.cancel(x, ctx)?;
            slowest = slowest.max(reply.call_ns);
            if reply.call_ns > ctx.limits.call_bound_ms * 1_000_000 {
                problems.push(format!("cancel of {what} took {:.1} ms", ms(reply.call_ns)));
            }
        }
        sleep_ms(ctx.limits.abort_grace_ms);
        let new_events: Vec<String> = p.tx.events()[events_before..].iter().map(crate::world::describe).collect();
        if !new_events.is_empty() {
            problems.push(format!("harmless cancels produced events: {}", new_events.join(", ")));
        }
        let stats_after = p.stats(Side::Tx, ctx)?;
        if stats_after != stats_before {
            problems.push(format!("stats changed: before {stats_before:?}, after {stats_after:?}"));
        }
        verdict_of(
            problems,
            format!(
                "cancel of an unknown id, a terminal transfer, twice, and after deregistration: no event, stats unchanged, slowest call {:.2} ms",
                ms(slowest)
            ),
        )
    })
}

/// Bytes of each ABORT-4 transfer.
const ABORT_4_BYTES: u64 = 1 << 20;
/// ABORT-4's loaded case: how many transfers are submitted at once under a granted ticket and then
/// cancelled one after another, each timed against G (fewer when `max_inflight_transfers` says so).
/// The same in `--quick`: the case is about hundreds of transfers live at once.
const LOADED_TRANSFERS: u64 = 400;
/// What each of them moves: this many passes over a 1 MiB destination (fewer as
/// `max_segments_per_submit` and `max_transfer_bytes` allow), 1.6 GiB in all, more than any plugin
/// copies before the cancels are through.
const LOADED_PASSES: u64 = 4;
/// A cancel of the loaded case counts as made under load when at least this many of the case's
/// transfers were live (no terminal event yet) when it began.
const LOADED_MIN_LIVE: u64 = 100;
/// How long the loaded case waits to see the first bytes land before it cancels anyway.
const LOADED_MOVING_BOUND_MS: u64 = 2_000;

/// One cancel of the loaded case: the transfer, when its cancel began and returned (sender clock),
/// how many of the case's transfers were live when it began, and its terminal event.
struct LoadedCancel {
    xfer: u64,
    started_ns: u64,
    returned_ns: u64,
    live: u64,
    terminal: Option<crate::peer::protocol::WireEvent>,
}

/// How many of `cancels`' transfers were live when each cancel began: those whose terminal event (if
/// any) came after that moment.
fn live_at_each_cancel(cancels: &mut [LoadedCancel]) {
    let mut ends: Vec<u64> = cancels.iter().map(|c| c.terminal.as_ref().map_or(u64::MAX, |e| e.t_ns)).collect();
    ends.sort_unstable();
    for c in cancels.iter_mut() {
        c.live = (ends.len() - ends.partition_point(|&t| t < c.started_ns)) as u64;
    }
}

/// ABORT-4's loaded case (see CONFORMANCE.md): hundreds of transfers live at once because their bytes
/// are moving under a granted ticket (no ticket a plugin could ignore keeps them live), each cancelled
/// and timed from its own cancel's return to its terminal event against G. Returns the evidence, or
/// the problems found.
fn abort_4_loaded(p: &mut Pair, ctx: &mut Ctx) -> Result<Result<String, Vec<String>>, Verdict> {
    let piece = ABORT_4_BYTES;
    let mut passes = LOADED_PASSES;
    if p.info.max_segments_per_submit > 0 {
        passes = passes.min(p.info.max_segments_per_submit);
    }
    if p.info.max_transfer_bytes > 0 {
        passes = passes.min(p.info.max_transfer_bytes / piece);
    }
    let passes = passes.max(1);
    let mut count = LOADED_TRANSFERS;
    if p.info.max_inflight_transfers > 0 {
        count = count.min(p.info.max_inflight_transfers.saturating_sub(8).max(1));
    }
    let src = p.alloc_src(piece, ctx.rng.next_u64(), ctx)?;
    let dst = p.alloc_dst(piece, ctx.rng.next_u64(), ctx)?;
    let ticket = p.authorise(&dst, ctx)?;
    p.settle_ticket(&src, &dst, ticket, ctx)?;
    // The destination made to differ from the source everywhere, so the first bytes to land show.
    p.call(Side::Rx, Op::Fill { rid: dst.rid, offset: 0, len: piece, seed: ctx.rng.next_u64() }, ctx)?;
    let filled = p
        .region_bytes(Side::Rx, dst.rid, 0, 4096)
        .map_err(|e| Verdict::Fail(format!("reading the destination: {e}")))?;
    let first = p.xfer_id() + 1;
    for _ in 0..count {
        p.xfer_id();
    }
    let timeout_ns = ctx.limits.long_timeout_ms * 1_000_000;
    let segments: Vec<_> = (0..passes).map(|_| seg(&src, 0, &dst, 0, piece)).collect();
    let peer = p.rx_peer;
    let reply = p.call(
        Side::Tx,
        Op::SubmitMany { first_xfer: first, count, peer, ticket, timeout_ns, segments: segments.clone() },
        ctx,
    )?;
    let Outcome::Batch { errors, .. } = reply.outcome else {
        return fail("loaded case: submit batch: unexpected reply");
    };
    let mut ids = Vec::new();
    for (i, e) in errors.iter().enumerate() {
        let x = first + i as u64;
        p.xfers.insert(x, crate::world::Xfer::new(e.is_none(), reply.t_ns, timeout_ns, total_bytes(&segments)));
        if e.is_none() {
            ids.push(x);
        }
    }
    if ids.is_empty() {
        return Ok(Err(vec![format!("loaded case: every one of {count} submits under a granted ticket was refused")]));
    }
    // Bytes moving: the destination's first page differs from its fill.
    let start = std::time::Instant::now();
    let mut moving = false;
    while start.elapsed() < ms_of(LOADED_MOVING_BOUND_MS) {
        if p.region_bytes(Side::Rx, dst.rid, 0, 4096).is_ok_and(|now| now != filled) {
            moving = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_micros(100));
    }
    let reply = p.call(Side::Tx, Op::CancelMany { xfers: ids.clone() }, ctx)?;
    let Outcome::Batch { started_ns, returned_ns, .. } = reply.outcome else {
        return fail("loaded case: cancel batch: unexpected reply");
    };
    if started_ns.len() != ids.len() || returned_ns.len() != ids.len() {
        return fail("loaded case: the peer did not time each cancel of the batch");
    }
    let missing = p.wait_all_terminal(&ids, ms_of(ctx.limits.abort_grace_ms + 2_000));
    let events = p.tx.events();
    let mut cancels: Vec<LoadedCancel> = (0..ids.len())
        .map(|i| LoadedCancel {
            xfer: ids[i],
            started_ns: started_ns[i],
            returned_ns: returned_ns[i],
            live: 0,
            terminal: events.iter().find(|e| e.xfer == ids[i] && is_terminal(e)).cloned(),
        })
        .collect();
    live_at_each_cancel(&mut cancels);
    let g = grace_ns(ctx);
    let (mut reached, mut under_load, mut late, mut slowest) = (0u64, 0u64, Vec::new(), (0u64, 0u64, 0u64));
    for c in &cancels {
        // Ended before its cancel began: not reached (RES-3 says what may follow a cancel).
        let Some(e) = &c.terminal else { continue };
        if e.t_ns < c.started_ns {
            continue;
        }
        let took = e.t_ns.saturating_sub(c.returned_ns);
        if ended_by_cancel(e) {
            reached += 1;
            if c.live >= LOADED_MIN_LIVE && moving {
                under_load += 1;
            }
        }
        if took > slowest.0 || slowest.1 == 0 {
            slowest = (took, c.xfer, c.live);
        }
        if took > g {
            late.push((c.xfer, took, c.live));
        }
    }
    ctx.exercise(
        "ABORT-4",
        &format!(
            "cancels under load (a live transfer reached with at least {LOADED_MIN_LIVE} live, bytes seen moving)"
        ),
        under_load,
        ids.len() as u64,
        Status::NotExercised,
    );
    let peak = cancels.iter().map(|c| c.live).max().unwrap_or(0);
    let what = format!(
        "loaded case: {} transfers of {} MiB under a granted ticket, bytes {} moving, cancelled one after another ({} of them live at the first cancel)",
        ids.len(),
        (passes * piece) >> 20,
        if moving { "seen" } else { "not seen" },
        peak
    );
    let mut problems = Vec::new();
    if !missing.is_empty() {
        problems.push(format!(
            "{what}: {} of them never got a terminal event (first: {:?})",
            missing.len(),
            &missing[..missing.len().min(5)]
        ));
    }
    if !late.is_empty() {
        let shown: Vec<String> = late
            .iter()
            .take(3)
            .map(|(x, took, live)| format!("transfer {x} {:.1} ms with {live} live", ms(*took)))
            .collect();
        problems.push(format!(
            "{what}: {} of {} cancels reached their terminal event later than G ({} ms) after the cancel returned: {}{}",
            late.len(),
            ids.len(),
            ctx.limits.abort_grace_ms,
            shown.join(", "),
            if late.len() > shown.len() { ", ..." } else { "" }
        ));
    }
    if !problems.is_empty() {
        return Ok(Err(problems));
    }
    Ok(Ok(format!(
        "{what}: {reached} ended by their cancel, the slowest {:.2} ms after its cancel returned (transfer {}, {} live; bound G = {} ms)",
        ms(slowest.0),
        slowest.1,
        slowest.2,
        ctx.limits.abort_grace_ms
    )))
}

// CONFORMANCE: ABORT-4
pub fn abort_4(ctx: &mut Ctx) -> CheckResult {
    let storm = with_pair(ctx, |p, ctx| {
        let src = p.alloc_src(ABORT_4_BYTES, ctx.rng.next_u64(), ctx)?;
        let dst = p.alloc_dst(ABORT_4_BYTES, ctx.rng.next_u64(), ctx)?;
        // Never authorised, and the receiver frozen for the storm: it can neither grant nor refuse
        // the ticket, so every transfer of a plugin that waits for the receiver stays live; one that
        // copies without it (one-sided) has a megabyte to copy per transfer, most still queued when
        // the cancels come.
        let ticket = p.ticket();
        let count = ctx.limits.storm_transfers;
        let first = p.xfer_id() + 1;
        let timeout_ns = ctx.limits.long_timeout_ms * 1_000_000;
        let segments = vec![seg(&src, 0, &dst, 0, ABORT_4_BYTES)];
        let peer = p.rx_peer;
        p.rx.freeze().map_err(Verdict::Fail)?;
        let reply = p.call(
            Side::Tx,
            Op::SubmitMany { first_xfer: first, count, peer, ticket, timeout_ns, segments: segments.clone() },
            ctx,
        )?;
        let Outcome::Batch { errors, .. } = reply.outcome else { return fail("submit batch: unexpected reply") };
        let mut ids = Vec::new();
        for (i, e) in errors.iter().enumerate() {
            let x = first + i as u64;
            p.xfers.insert(x, crate::world::Xfer::new(e.is_none(), reply.t_ns, timeout_ns, total_bytes(&segments)));
            if e.is_none() {
                ids.push(x);
            }
        }
        for _ in 0..count {
            p.xfer_id();
        }
        if ids.is_empty() {
            return fail(format!("every one of {count} submits was refused"));
        }
        let refused = count as usize - ids.len();
        let mark = p.tx.event_count();
        let cancel = p.call(Side::Tx, Op::CancelMany { xfers: ids.clone() }, ctx)?;
        let missing = p.wait_all_terminal(&ids, ms_of(ctx.limits.storm_grace_ms + 2_000));
        p.rx.resume();
        let events = p.tx.events();
        // Reached: ended by the cancel (see `ended_by_cancel`), in an event that came after the cancels were sent.
        let reached = events[mark.min(events.len())..]
            .iter()
            .filter(|e| crate::world::is_terminal(e) && ended_by_cancel(e) && e.xfer >= first && e.xfer < first + count)
            .count() as u64;
        ctx.exercise(
            "ABORT-4",
            "cancels that reached a live transfer in the storm",
            reached,
            ids.len() as u64,
            Status::NotExercised,
        );
        let last = events.iter().filter(|e| crate::world::is_terminal(e)).map(|e| e.t_ns).max().unwrap_or(0);
        let took = last.saturating_sub(cancel.t_ns);
        let stats = p.stats(Side::Tx, ctx)?;
        let mut problems = Vec::new();
        if !missing.is_empty() {
            problems.push(format!(
                "{} of {} cancelled transfers never got a terminal event (first: {:?})",
                missing.len(),
                ids.len(),
                &missing[..missing.len().min(5)]
            ));
        } else if took > ctx.limits.storm_grace_ms * 1_000_000 {
            problems.push(format!(
                "the last terminal event came {:.0} ms after the cancels (bound {} ms)",
                ms(took),
                ctx.limits.storm_grace_ms
            ));
        }
        if stats.healthy == 0 {
            problems.push("plugin reports unhealthy after the storm".into());
        }
        verdict_of(
            problems,
            format!(
                "{} transfers of 1 MiB, receiver frozen, cancelled at once ({refused} submits refused): all terminal {:.1} ms after the cancels returned (bound {} ms)",
                ids.len(),
                ms(took),
                ctx.limits.storm_grace_ms
            ),
        )
    });
    // The loaded case in a pair of its own: what it measures is the load it makes, not what the
    // storm left behind (gigabytes a plugin may still be draining from a receiver that was frozen).
    let loaded = with_pair(ctx, |p, ctx| match abort_4_loaded(p, ctx)? {
        Ok(evidence) => Ok(evidence),
        Err(found) => verdict_of(found, String::new()),
    });
    match (storm, loaded) {
        (Ok(storm), Ok(loaded)) => Ok(format!("storm: {storm}; {loaded}")),
        (Err(Verdict::Fail(a)), Err(Verdict::Fail(b))) => fail(format!("storm: {a}; {b}")),
        (Err(v), _) | (_, Err(v)) => Err(v),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::peer::protocol::WireEvent;

    fn cancel(xfer: u64, started_ns: u64, ended_ns: Option<u64>) -> LoadedCancel {
        let terminal = ended_ns.map(|t_ns| WireEvent {
            kind: EventKind::FAILED.0,
            xfer,
            peer: 1,
            reason: ReasonCode::CANCELLED.0,
            bytes: 0,
            flags: 0,
            message: "cancelled".into(),
            t_ns,
        });
        LoadedCancel { xfer, started_ns, returned_ns: started_ns + 1, live: 0, terminal }
    }

    // CONFORMANCE: ABORT-4 (the loaded case counts, for each cancel, the transfers live when it began)
    #[test]
    fn each_cancel_counts_the_transfers_live_when_it_began() {
        // Transfer 1 ended before any cancel, 2 at its own cancel, 3 long after, 4 never.
        let mut cancels =
            vec![cancel(1, 100, Some(50)), cancel(2, 110, Some(111)), cancel(3, 120, Some(900)), cancel(4, 130, None)];
        live_at_each_cancel(&mut cancels);
        let live: Vec<u64> = cancels.iter().map(|c| c.live).collect();
        assert_eq!(live, vec![3, 3, 2, 2], "an event at the very moment a cancel began still counts as live");
    }
}
