//! DATA-1..4: succeeded means every byte landed (checksums over random data, odd sizes, unaligned
//! offsets, long scatter lists), bad requests refused before any byte moves, no fail-open.

use super::*;
use crate::peer::protocol::{Op, Outcome, Seg};
use crate::world::{describe, ms, seg, Side};
use kvgate_abi::EventKind;

const DATA_TIMEOUT_MS: u64 = 60_000;

/// Submit `segs`, wait for the terminal event, and compare both sides' checksums the moment it arrives.
pub(crate) fn transfer_and_verify(
    p: &mut Pair,
    ticket: u64,
    src_rid: u32,
    dst_rid: u32,
    segs: Vec<Seg>,
    ctx: &mut Ctx,
) -> Result<Result<String, String>, Verdict> {
    transfer_and_compare(p, ticket, src_rid, dst_rid, segs, 0, ctx)
}

/// Like [`transfer_and_verify`], but compares only after `settle_ms`: for checks whose subject is not
/// the moment of `SUCCEEDED` (that is DATA-1's), only that the bytes did move.
pub(crate) fn transfer_and_settle(
    p: &mut Pair,
    ticket: u64,
    src_rid: u32,
    dst_rid: u32,
    segs: Vec<Seg>,
    ctx: &mut Ctx,
) -> Result<Result<String, String>, Verdict> {
    transfer_and_compare(p, ticket, src_rid, dst_rid, segs, 300, ctx)
}

fn transfer_and_compare(
    p: &mut Pair,
    ticket: u64,
    src_rid: u32,
    dst_rid: u32,
    segs: Vec<Seg>,
    settle_ms: u64,
    ctx: &mut Ctx,
) -> Result<Result<String, String>, Verdict> {
    let src_ranges: Vec<(u64, u64)> = segs.iter().map(|s| (s.local_offset, s.len)).collect();
    let dst_ranges: Vec<(u64, u64)> = segs.iter().map(|s| (s.remote_offset, s.len)).collect();
    let bytes: u64 = segs.iter().map(|s| s.len).sum();
    let nseg = segs.len();
    let (x, r) = p.submit(ticket, DATA_TIMEOUT_MS, segs, ctx)?;
    if let Err(e) = r {
        return Ok(Err(format!(
            "{bytes} bytes in {nseg} segments: valid submit refused: {}: {}",
            e.code_name, e.message
        )));
    }
    let Some(t) = p.wait_terminal(x, ms_of(DATA_TIMEOUT_MS + ctx.limits.deadline_slack_ms)) else {
        return Ok(Err(format!("{bytes} bytes in {nseg} segments: no terminal event")));
    };
    // Read the destination at once: SUCCEEDED must mean the bytes are already there.
    if settle_ms > 0 {
        sleep_ms(settle_ms);
    }
    let dst_sum = p.checksum(Side::Rx, dst_rid, dst_ranges, ctx)?;
    if t.kind != EventKind::SUCCEEDED.0 {
        return Ok(Err(format!(
            "{bytes} bytes in {nseg} segments: valid transfer ended {}: {}",
            describe(&t),
            t.message
        )));
    }
    let src_sum = p.checksum(Side::Tx, src_rid, src_ranges, ctx)?;
    let took = t.t_ns.saturating_sub(p.xfers[&x].submitted_ns);
    if src_sum != dst_sum {
        return Ok(Err(format!(
            "{bytes} bytes in {nseg} segments: SUCCEEDED at {:.1} ms but the destination checksum {dst_sum:#x} differs from the source {src_sum:#x} when read right after the event",
            ms(t.t_ns)
        )));
    }
    Ok(Ok(format!("{bytes} B/{nseg} seg ok in {:.1} ms", ms(took))))
}

// CONFORMANCE: DATA-1
pub fn data_1(ctx: &mut Ctx) -> CheckResult {
    with_pair(ctx, |p, ctx| {
        let sizes: Vec<u64> = [0u64, 1, 4095, 64 << 10, 4 << 20, 64 << 20]
            .into_iter()
            .filter(|s| *s <= ctx.limits.max_data_bytes)
            .collect();
        let (mut lines, mut problems) = (Vec::new(), Vec::new());
        for size in sizes {
            let pad = 8192;
            let src = p.alloc_src(size + pad, ctx.rng.next_u64(), ctx)?;
            let dst = p.alloc_dst(size + pad, ctx.rng.next_u64(), ctx)?;
            let ticket = p.authorise(&dst, ctx)?;
            sleep_ms(10);
            let (so, d_o) = (1 + ctx.rng.below(4094), 1 + ctx.rng.below(4094));
            let segs = if size < (64 << 10) {
                vec![seg(&src, so, &dst, d_o, size)]
            } else {
                let a = 1 + ctx.rng.below(size / 2);
                let b = 1 + ctx.rng.below(size - a - 1);
                vec![
                    seg(&src, so, &dst, d_o, a),
                    seg(&src, so + a, &dst, d_o + a, b),
                    seg(&src, so + a + b, &dst, d_o + a + b, size - a - b),
                ]
            };
            match transfer_and_verify(p, ticket, src.rid, dst.rid, segs, ctx)? {
                Ok(l) => lines.push(l),
                Err(e) => problems.push(e),
            }
            p.call(Side::Tx, Op::Deregister { key: src.key }, ctx)?;
            p.call(Side::Tx, Op::Release { key: dst.remote }, ctx)?;
            p.call(Side::Rx, Op::Deregister { key: dst.key }, ctx)?;
        }
        verdict_of(
            problems,
            format!("random bytes at odd offsets, checksummed at the SUCCEEDED event: {}", lines.join(", ")),
        )
    })
}

// CONFORMANCE: DATA-2
pub fn data_2(ctx: &mut Ctx) -> CheckResult {
    with_pair(ctx, |p, ctx| {
        let count = ctx.limits.scatter_segments;
        let mut rng = ctx.rng.fork(0xda7a2);
        let mut lens = Vec::new();
        let (mut src_offs, mut dst_offs) = (Vec::new(), Vec::new());
        let (mut so, mut d_o) = (rng.below(64), rng.below(64));
        for _ in 0..count {
            let l = 1 + rng.below(257);
            lens.push(l);
            src_offs.push(so);
            dst_offs.push(d_o);
            so += l + rng.below(65);
            d_o += l + 1 + rng.below(64); // at least one untouched byte between destination segments
        }
        let src = p.alloc_src(so + 64, ctx.rng.next_u64(), ctx)?;
        let dst = p.alloc_dst(d_o + 64, ctx.rng.next_u64(), ctx)?;
        let ticket = p.authorise(&dst, ctx)?;
        sleep_ms(10);
        // The gaps between destination segments must stay as they were.
        let mut gaps = vec![(0, dst_offs[0])];
        for i in 0..count as usize {
            let end = dst_offs[i] + lens[i];
            let next = if i + 1 < count as usize { dst_offs[i + 1] } else { dst.len };
            gaps.push((end, next - end));
        }
        let gaps_before = p.checksum(Side::Rx, dst.rid, gaps.clone(), ctx)?;
        let per_submit = match p.info.max_segments_per_submit {
            0 => count,
            m => m.min(count),
        };
        let all: Vec<Seg> = (0..count as usize).map(|i| seg(&src, src_offs[i], &dst, dst_offs[i], lens[i])).collect();
        let (mut lines, mut problems) = (Vec::new(), Vec::new());
        for chunk in all.chunks(per_submit as usize) {
            match transfer_and_verify(p, ticket, src.rid, dst.rid, chunk.to_vec(), ctx)? {
                Ok(l) => lines.push(l),
                Err(e) => problems.push(e),
            }
        }
        let gaps_after = p.checksum(Side::Rx, dst.rid, gaps, ctx)?;
        if gaps_before != gaps_after {
            problems.push("bytes between destination segments changed".into());
        }
        verdict_of(
            problems,
            format!("{count} segments of 1..=257 bytes at unaligned offsets on both sides, {per_submit} per submit: {}; gaps untouched", lines.join(", ")),
        )
    })
}

/// How long after a second submit of the same id returned the first's terminal event may still be
/// stamped for the second to count as accepted after the first ended (DATA-3).
const DUPLICATE_SLACK_NS: u64 = 1_000_000;

// CONFORMANCE: DATA-3
pub fn data_3(ctx: &mut Ctx) -> CheckResult {
    with_pair(ctx, |p, ctx| {
        let len = 1u64 << 16;
        let src = p.alloc_src(len, ctx.rng.next_u64(), ctx)?;
        let dst = p.alloc_dst(len, ctx.rng.next_u64(), ctx)?;
        let gone_src = p.alloc_src(len, ctx.rng.next_u64(), ctx)?;
        let gone_dst = p.alloc_dst(len, ctx.rng.next_u64(), ctx)?;
        let ticket = p.authorise(&dst, ctx)?;
        sleep_ms(10);
        p.call(Side::Tx, Op::Deregister { key: gone_src.key }, ctx)?;
        p.call(Side::Tx, Op::Release { key: gone_dst.remote }, ctx)?;
        let untouched = vec![(0, len)];
        let dst_before = p.checksum(Side::Rx, dst.rid, untouched.clone(), ctx)?;
        let ok = seg(&src, 0, &dst, 0, 100);
        let mut cases: Vec<(String, Vec<Seg>, Option<u64>)> = vec![
            ("remote segment past the end of its region".into(), vec![ok, Seg { remote_offset: len - 10, ..ok }], None),
            ("local segment past the end of its region".into(), vec![ok, Seg { local_offset: len - 10, ..ok }], None),
            ("remote offset near u64::MAX".into(), vec![ok, Seg { remote_offset: u64::MAX - 5, ..ok }], None),
            ("local offset near u64::MAX".into(), vec![ok, Seg { local_offset: u64::MAX - 5, ..ok }], None),
            ("length near u64::MAX".into(), vec![ok, Seg { len: u64::MAX - 1, ..ok }], None),
            ("unknown local key".into(), vec![ok, Seg { local: 0xdead_beef, ..ok }], None),
            ("unknown remote key".into(), vec![ok, Seg { remote: 0xdead_beef, ..ok }], None),
            ("deregistered local key".into(), vec![ok, Seg { local: gone_src.key, ..ok }], None),
            ("released remote key".into(), vec![ok, Seg { remote: gone_dst.remote, ..ok }], None),
            ("unknown peer".into(), vec![ok], Some(0x7777)),
        ];
        if p.info.max_segments_per_submit > 0 && p.info.max_segments_per_submit < 1_000_000 {
            let n = p.info.max_segments_per_submit + 1;
            cases.push((
                format!("{n} segments (max_segments_per_submit {})", n - 1),
                (0..n).map(|_| Seg { len: 1, ..ok }).collect(),
                None,
            ));
        }
        let mut problems = Vec::new();
        let mut refused = Vec::new();
        for (what, segs, peer) in cases {
            let xfer = p.xfer_id();
            let saved = p.rx_peer;
            if let Some(peer) = peer {
                p.rx_peer = peer;
            }
            let r = p.submit_as(xfer, ticket, 5_000_000_000, segs, ctx)?;
            p.rx_peer = saved;
            match r {
                Ok(_) => {
                    let t = p.wait_terminal(xfer, ms_of(5_000 + ctx.limits.deadline_slack_ms));
                    problems.push(format!(
                        "{what}: submit accepted{}",
                        t.map(|e| format!(", then {} {:?}", describe(&e), e.message)).unwrap_or_default()
                    ));
                }
                Err(e) => refused.push(format!("{what} → {}", e.code_name)),
            }
        }
        // A second submit of a live id. The first moves up to 64 MiB four times over (4000 segments
        // cycling through the same 1000 pieces), so it is still moving when the second arrives one
        // call later, even from a plugin whose copy threads keep every core busy meanwhile. Accepting
        // the second is right only if the first had ended by then: its terminal event, stamped by the
        // sending peer's clock, comes no later than `DUPLICATE_SLACK_NS` after the second submit
        // returned (a plugin may forget the id just before it delivers the event). A transfer still
        // moving ends milliseconds later.
        let big = ctx.limits.max_data_bytes.min(64 << 20);
        let big_src = p.alloc_src(big, ctx.rng.next_u64(), ctx)?;
        let big_dst = p.alloc_dst(big, ctx.rng.next_u64(), ctx)?;
        let live_ticket = p.authorise(&big_dst, ctx)?;
        sleep_ms(10);
        let piece = big / 1000;
        let moving: Vec<Seg> =
            (0..4000).map(|i| seg(&big_src, i % 1000 * piece, &big_dst, i % 1000 * piece, piece)).collect();
        let (x, r) = p.submit(live_ticket, ctx.limits.long_timeout_ms, moving, ctx)?;
        accepted(r, "transfer")?;
        // One small segment, so that the second call reaches the plugin as fast as the harness can send it.
        let again = vec![seg(&big_src, 0, &big_dst, 0, 64)];
        match p.submit_as(x, live_ticket, ctx.limits.long_timeout_ms * 1_000_000, again, ctx)? {
            Ok(second_returned_ns) => match p.wait_terminal(x, ms_of(5_000 + ctx.limits.deadline_slack_ms)) {
                Some(first) if first.t_ns <= second_returned_ns + DUPLICATE_SLACK_NS => {}
                Some(first) => problems.push(format!(
                    "a second submit of a live id was accepted; the first ended {:.1} ms after it returned",
                    (first.t_ns - second_returned_ns) as f64 / 1e6
                )),
                None => problems.push("a second submit of a live id was accepted; no terminal event followed".into()),
            },
            Err(e) => refused.push(format!("duplicate live id → {}", e.code_name)),
        }
        p.cancel(x, ctx)?;
        p.wait_terminal(x, ms_of(ctx.limits.abort_grace_ms + 1_000));
        sleep_ms(50);
        let dst_after = p.checksum(Side::Rx, dst.rid, untouched, ctx)?;
        if dst_before != dst_after {
            problems.push("the destination changed although every bad submit was refused".into());
        }
        verdict_of(problems, format!("refused before any byte moved: {}", refused.join(", ")))
    })
}

// CONFORMANCE: DATA-4
pub fn data_4(ctx: &mut Ctx) -> CheckResult {
    with_pair(ctx, |p, ctx| {
        let big = ctx.limits.max_data_bytes.min(16 << 20);
        let (mut lines, mut problems) = (Vec::new(), Vec::new());
        for attempt in 0..3u64 {
            let src = p.alloc_src(big, ctx.rng.next_u64(), ctx)?;
            let dst = p.alloc_dst(big, ctx.rng.next_u64(), ctx)?;
            let ticket = p.authorise(&dst, ctx)?;
            sleep_ms(10);
            let n = 4000u64;
            let piece = big / n;
            let segs: Vec<Seg> = (0..n).map(|i| seg(&src, i * piece, &dst, i * piece, piece)).collect();
            let ranges: Vec<(u64, u64)> = segs.iter().map(|s| (s.local_offset, s.len)).collect();
            let src_sum = p.checksum(Side::Tx, src.rid, ranges.clone(), ctx)?;
            let (x, r) = p.submit(ticket, DATA_TIMEOUT_MS, segs, ctx)?;
            accepted(r, "large transfer")?;
            if attempt > 0 {
                sleep_ms(attempt);
            }
            let dereg = p.call(Side::Tx, Op::Deregister { key: src.key }, ctx)?;
            let dereg_result = match dereg.outcome {
                Outcome::Done => "deregistered".to_string(),
                Outcome::Failed { error } => format!("deregister refused ({})", error.code_name),
                _ => "?".into(),
            };
            let Some(t) = p.wait_terminal(x, ms_of(DATA_TIMEOUT_MS)) else {
                problems.push(format!("attempt {attempt}: no terminal event after the source was deregistered"));
                continue;
            };
            let dst_sum = p.checksum(Side::Rx, dst.rid, ranges, ctx)?;
            if t.kind == EventKind::SUCCEEDED.0 && dst_sum != src_sum {
                problems.push(format!("attempt {attempt}: source {dereg_result} mid-transfer, then SUCCEEDED with the destination not matching the source"));
            } else {
                lines.push(format!("attempt {attempt}: {dereg_result} → {}", describe(&t)));
            }
        }
        verdict_of(problems, lines.join("; "))
    })
}
