//! Two UCX plugin instances in one process, over UCX TCP (loopback) and shared memory: data
//! integrity, receiver enforcement, cancel then quiesced, timeouts, peer shutdown, resource baselines.
//! Every wait is bounded (support::WAIT_LIMIT); a stuck plugin fails the test instead of hanging it.

mod support;

use kvgate_abi::sdk::Plugin;
use kvgate_abi::*;
use std::time::{Duration, Instant};
use support::*;

const LONG: Duration = Duration::from_secs(30);

/// Sizes from the contract, each at an unaligned offset on both sides.
fn data_integrity(config: &str) {
    let (a, b) = pair(config);
    let sizes = [0usize, 1, 4095, 64 << 10, 1 << 20, 4 << 20];
    let total: usize = sizes.iter().map(|s| s + 7).sum();
    let src = buffer(&a, total + 64, 0x5eed_0001);
    let dst = buffer(&b, total + 64, 0x5eed_0002);
    let remote = a.plugin.import_remote_key(PEER_B, &dst.remote_key_bytes).unwrap();
    let (mut src_off, mut dst_off) = (3u64, 5u64);
    for (i, &size) in sizes.iter().enumerate() {
        let xfer = 1000 + i as u64;
        let ticket = 5000 + i as u64;
        expect(&b, ticket, PEER_A, LONG, &[LocalRange { key: dst.key, offset: dst_off, len: size as u64 }]);
        let seg = Segment { local: src.key, local_offset: src_off, remote, remote_offset: dst_off, len: size as u64 };
        submit(&a, xfer, PEER_B, ticket, LONG, &[seg]).unwrap();
        let done = a.log.terminal_of(XferId(xfer), WAIT_LIMIT);
        assert_eq!(done.kind, EventKind::SUCCEEDED, "size {size}: {done:?}");
        assert_eq!(done.bytes, size as u64);
        let s = &src.bytes[src_off as usize..src_off as usize + size];
        let d = &dst.bytes[dst_off as usize..dst_off as usize + size];
        assert_eq!(checksum(s), checksum(d), "size {size}: checksum differs");
        b.plugin.cancel_incoming(PEER_A, Ticket(ticket));
        src_off += size as u64 + 7;
        dst_off += size as u64 + 7;
    }
    // Bytes outside every destination range stay untouched.
    let untouched = random_bytes(dst.bytes.len(), 0x5eed_0002);
    assert_eq!(&dst.bytes[..5], &untouched[..5]);
    assert_eq!(&dst.bytes[dst_off as usize..], &untouched[dst_off as usize..]);
    baseline(&a, &b);
}

/// A scatter-gather list of thousands of odd-sized segments, reversed on the destination side.
fn scatter_gather(config: &str) {
    let (a, b) = pair(config);
    let count = 4000u64;
    let seg_len = 37u64;
    let src = buffer(&a, (count * seg_len) as usize, 11);
    let dst = buffer(&b, (count * seg_len) as usize + 1, 12);
    let remote = a.plugin.import_remote_key(PEER_B, &dst.remote_key_bytes).unwrap();
    let segments: Vec<Segment> = (0..count)
        .map(|i| Segment {
            local: src.key,
            local_offset: i * seg_len,
            remote,
            remote_offset: 1 + (count - 1 - i) * seg_len,
            len: seg_len,
        })
        .collect();
    expect(&b, 77, PEER_A, LONG, &[LocalRange { key: dst.key, offset: 1, len: count * seg_len }]);
    submit(&a, 1, PEER_B, 77, LONG, &segments).unwrap();
    let done = a.log.terminal_of(XferId(1), WAIT_LIMIT);
    assert_eq!(done.kind, EventKind::SUCCEEDED, "{done:?}");
    for i in 0..count as usize {
        let s = &src.bytes[i * seg_len as usize..][..seg_len as usize];
        let d = &dst.bytes[1 + (count as usize - 1 - i) * seg_len as usize..][..seg_len as usize];
        assert_eq!(s, d, "segment {i}");
    }
    b.plugin.cancel_incoming(PEER_A, Ticket(77));
    baseline(&a, &b);
}

/// A transfer of 16 adjacent 64 KiB blocks into 16 ranges listed one per block, out of order (as a
/// paged pool hands out neighbours): the sender joins the blocks into one message, the receiver's
/// ticket joins the ranges, and every byte lands. Then blocks adjacent at the source but not at the
/// destination, into ranges with gaps between them: they stay separate messages, and the gaps stay
/// untouched.
fn adjacent_blocks(config: &str) {
    const BLOCK: u64 = 64 << 10;
    const BLOCKS: u64 = 16;
    let (a, b) = pair(config);
    let src = buffer(&a, (2 * BLOCKS * BLOCK) as usize, 71);
    let dst = buffer(&b, (3 * BLOCKS * BLOCK) as usize, 72);
    let remote = a.plugin.import_remote_key(PEER_B, &dst.remote_key_bytes).unwrap();
    let ranges: Vec<LocalRange> =
        (0..BLOCKS).rev().map(|i| LocalRange { key: dst.key, offset: i * BLOCK, len: BLOCK }).collect();
    expect(&b, 8, PEER_A, LONG, &ranges);
    let joined: Vec<Segment> = (0..BLOCKS)
        .map(|i| Segment { local: src.key, local_offset: i * BLOCK, remote, remote_offset: i * BLOCK, len: BLOCK })
        .collect();
    submit(&a, 80, PEER_B, 8, LONG, &joined).unwrap();
    let done = a.log.terminal_of(XferId(80), WAIT_LIMIT);
    assert_eq!((done.kind, done.bytes), (EventKind::SUCCEEDED, BLOCKS * BLOCK), "{done:?}");
    assert_eq!(&src.bytes[..(BLOCKS * BLOCK) as usize], &dst.bytes[..(BLOCKS * BLOCK) as usize]);
    // Destination blocks every other block from BLOCKS * BLOCK on: a gap of one block between each.
    let base = BLOCKS * BLOCK;
    let ranges: Vec<LocalRange> =
        (0..BLOCKS).map(|i| LocalRange { key: dst.key, offset: base + 2 * i * BLOCK, len: BLOCK }).collect();
    expect(&b, 9, PEER_A, LONG, &ranges);
    let apart: Vec<Segment> = (0..BLOCKS)
        .map(|i| Segment {
            local: src.key,
            local_offset: base + i * BLOCK,
            remote,
            remote_offset: base + 2 * i * BLOCK,
            len: BLOCK,
        })
        .collect();
    submit(&a, 81, PEER_B, 9, LONG, &apart).unwrap();
    let done = a.log.terminal_of(XferId(81), WAIT_LIMIT);
    assert_eq!((done.kind, done.bytes), (EventKind::SUCCEEDED, BLOCKS * BLOCK), "{done:?}");
    let untouched = random_bytes(dst.bytes.len(), 72);
    for i in 0..BLOCKS as usize {
        let (block, from) = (BLOCK as usize, base as usize);
        assert_eq!(&dst.bytes[from + 2 * i * block..][..block], &src.bytes[from + i * block..][..block], "block {i}");
        assert_eq!(
            &dst.bytes[from + (2 * i + 1) * block..][..block],
            &untouched[from + (2 * i + 1) * block..][..block],
            "gap after block {i}"
        );
    }
    b.plugin.cancel_incoming(PEER_A, Ticket(8));
    b.plugin.cancel_incoming(PEER_A, Ticket(9));
    baseline(&a, &b);
}

/// `max_posted_ops_per_transfer = 2`: transfers of 2 messages (at the bound), 3 (just past it) and
/// 40, submitted together, their blocks a block apart on the destination so that none are joined:
/// each succeeds with its bytes (a transfer held at the bound resumes as its operations complete).
fn posted_ops_bound(config: &str) {
    const BLOCK: u64 = 64 << 10; // above UCX's eager size: a sent block stays posted until its rendezvous ends
    let counts = [2u64, 3, 40];
    let total: u64 = counts.iter().sum();
    let (a, b) = pair(&format!("{config}max_posted_ops_per_transfer = 2\n"));
    let src = buffer(&a, (total * BLOCK) as usize, 91);
    let dst = buffer(&b, (2 * total * BLOCK) as usize, 92);
    let remote = a.plugin.import_remote_key(PEER_B, &dst.remote_key_bytes).unwrap();
    let mut first = 0;
    for (i, &n) in counts.iter().enumerate() {
        let blocks = first..first + n;
        let ranges: Vec<LocalRange> =
            blocks.clone().map(|k| LocalRange { key: dst.key, offset: 2 * k * BLOCK, len: BLOCK }).collect();
        expect(&b, 20 + i as u64, PEER_A, LONG, &ranges);
        let segments: Vec<Segment> = blocks
            .map(|k| Segment {
                local: src.key,
                local_offset: k * BLOCK,
                remote,
                remote_offset: 2 * k * BLOCK,
                len: BLOCK,
            })
            .collect();
        submit(&a, 200 + i as u64, PEER_B, 20 + i as u64, LONG, &segments).unwrap();
        first += n;
    }
    for (i, &n) in counts.iter().enumerate() {
        let done = a.log.terminal_of(XferId(200 + i as u64), WAIT_LIMIT);
        assert_eq!((done.kind, done.bytes), (EventKind::SUCCEEDED, n * BLOCK), "{n} messages: {done:?}");
    }
    let untouched = random_bytes(dst.bytes.len(), 92);
    for k in 0..total as usize {
        let block = BLOCK as usize;
        assert_eq!(&dst.bytes[2 * k * block..][..block], &src.bytes[k * block..][..block], "block {k}");
        assert_eq!(
            &dst.bytes[(2 * k + 1) * block..][..block],
            &untouched[(2 * k + 1) * block..][..block],
            "gap after block {k}"
        );
    }
    for i in 0..counts.len() as u64 {
        b.plugin.cancel_incoming(PEER_A, Ticket(20 + i));
    }
    baseline(&a, &b);
}

/// `max_posted_bytes` (the instance's posted data, over all its transfers): ten transfers of four
/// 64 KiB blocks each, none joined. At three blocks the instance never has more than three posted
/// (and, in active-message mode, where a block stays posted until its rendezvous ends, reaches
/// three); at one byte under a block each block moves alone. Every transfer succeeds with its bytes:
/// a transfer held by the bound resumes as others' messages complete.
fn posted_bytes_bound(config: &str) {
    const BLOCK: u64 = 64 << 10;
    const TRANSFERS: u64 = 10;
    const BLOCKS: u64 = 4;
    let am = !config.contains("mode = \"put\"");
    for (limit, peak_expected) in [(3 * BLOCK, 3 * BLOCK), (BLOCK - 1, BLOCK)] {
        let (a, b) = pair(&format!("{config}max_posted_bytes = {limit}\n"));
        let total = TRANSFERS * BLOCKS;
        let src = buffer(&a, (total * BLOCK) as usize, 93);
        let dst = buffer(&b, (2 * total * BLOCK) as usize, 94);
        let remote = a.plugin.import_remote_key(PEER_B, &dst.remote_key_bytes).unwrap();
        for t in 0..TRANSFERS {
            let blocks = t * BLOCKS..(t + 1) * BLOCKS;
            let ranges: Vec<LocalRange> =
                blocks.clone().map(|k| LocalRange { key: dst.key, offset: 2 * k * BLOCK, len: BLOCK }).collect();
            expect(&b, 40 + t, PEER_A, LONG, &ranges);
            let segments: Vec<Segment> = blocks
                .map(|k| Segment {
                    local: src.key,
                    local_offset: k * BLOCK,
                    remote,
                    remote_offset: 2 * k * BLOCK,
                    len: BLOCK,
                })
                .collect();
            submit(&a, 400 + t, PEER_B, 40 + t, LONG, &segments).unwrap();
        }
        for t in 0..TRANSFERS {
            let done = a.log.terminal_of(XferId(400 + t), WAIT_LIMIT);
            assert_eq!(
                (done.kind, done.bytes),
                (EventKind::SUCCEEDED, BLOCKS * BLOCK),
                "limit {limit}, transfer {t}: {done:?}"
            );
        }
        for k in 0..total as usize {
            let block = BLOCK as usize;
            assert_eq!(
                &dst.bytes[2 * k * block..][..block],
                &src.bytes[k * block..][..block],
                "limit {limit}: block {k}"
            );
        }
        let peak = a.plugin.posted_bytes_peak_for_tests();
        assert!(peak <= peak_expected, "limit {limit}: {peak} bytes posted at once");
        if am {
            assert_eq!(peak, peak_expected, "limit {limit}: the bound is reached");
        }
        for t in 0..TRANSFERS {
            b.plugin.cancel_incoming(PEER_A, Ticket(40 + t));
        }
        baseline(&a, &b);
    }
}

/// Zero-length segments before, between and after the data (the last message with bytes carries
/// the commit in active-message mode; empty ones send nothing): every transfer succeeds with its bytes.
fn empty_segments_around_the_data(config: &str) {
    let (a, b) = pair(config);
    let src = buffer(&a, 4096, 51);
    let dst = buffer(&b, 4096, 52);
    let remote = a.plugin.import_remote_key(PEER_B, &dst.remote_key_bytes).unwrap();
    expect(&b, 3, PEER_A, LONG, &[LocalRange { key: dst.key, offset: 0, len: 4096 }]);
    let seg =
        |offset: u64, len: u64| Segment { local: src.key, local_offset: offset, remote, remote_offset: offset, len };
    let shapes: [Vec<Segment>; 4] = [
        vec![seg(0, 100), seg(100, 0), seg(100, 0)],
        vec![seg(200, 0), seg(200, 100), seg(300, 0)],
        vec![seg(400, 100), seg(500, 0), seg(500, 100)],
        vec![seg(600, 0), seg(600, 0)],
    ];
    for (i, segments) in shapes.iter().enumerate() {
        let xfer = 60 + i as u64;
        submit(&a, xfer, PEER_B, 3, LONG, segments).unwrap();
        let end = a.log.terminal_of(XferId(xfer), WAIT_LIMIT);
        let bytes: u64 = segments.iter().map(|s| s.len).sum();
        assert_eq!((end.kind, end.bytes), (EventKind::SUCCEEDED, bytes), "shape {i}: {end:?}");
    }
    for (from, to) in [(0, 100), (200, 300), (400, 600)] {
        assert_eq!(&src.bytes[from..to], &dst.bytes[from..to], "bytes {from}..{to}");
    }
    let untouched = random_bytes(4096, 52);
    assert_eq!(&dst.bytes[100..200], &untouched[100..200], "an empty segment wrote");
    b.plugin.cancel_incoming(PEER_A, Ticket(3));
    baseline(&a, &b);
}

/// Cancel right after submit: exactly one terminal event, then quiesced (flag or event), and the
/// stats return to their baseline.
fn cancel_then_quiesced(config: &str) {
    let (a, b) = pair(config);
    let len = 32usize << 20;
    let src = buffer(&a, len, 1);
    let dst = buffer(&b, len, 2);
    let remote = a.plugin.import_remote_key(PEER_B, &dst.remote_key_bytes).unwrap();
    expect(&b, 9, PEER_A, LONG, &[LocalRange { key: dst.key, offset: 0, len: len as u64 }]);
    for round in 0..5u64 {
        let xfer = 300 + round;
        let seg = Segment { local: src.key, local_offset: 0, remote, remote_offset: 0, len: len as u64 };
        submit(&a, xfer, PEER_B, 9, LONG, &[seg]).unwrap();
        a.plugin.cancel(XferId(xfer));
        a.plugin.cancel(XferId(xfer)); // double cancel is harmless
        let end = a.log.terminal_of(XferId(xfer), WAIT_LIMIT);
        // A transfer that finished before the cancel was seen may succeed; otherwise it is cancelled.
        assert!(end.kind == EventKind::SUCCEEDED || end.reason == ReasonCode::CANCELLED, "round {round}: {end:?}");
        if end.kind == EventKind::FAILED && end.flags & event_flags::QUIESCED == 0 {
            a.log.wait_for(WAIT_LIMIT, "quiesced after cancel", |e| {
                e.kind == EventKind::QUIESCED && e.xfer == XferId(xfer) && !e.is_incoming()
            });
        }
        assert_eq!(a.log.count(|e| e.is_terminal() && e.xfer == XferId(xfer)), 1, "exactly one terminal event");
    }
    a.plugin.cancel(XferId(123_456)); // unknown id: ignored
    b.plugin.cancel_incoming(PEER_A, Ticket(9));
    if b.plugin.info().capabilities.flags & cap_flags::RECEIVER_ENFORCED != 0 {
        b.log.wait_for(WAIT_LIMIT, "incoming quiesced", |e| {
            e.kind == EventKind::QUIESCED && e.is_incoming() && e.xfer == XferId(9)
        });
    }
    baseline(&a, &b);
}

/// Receiver enforcement (AM mode): a write under an unknown ticket or outside the ticket's ranges
/// fails at the sender with the receiver's reason, and the receiver reports it.
fn receiver_refuses(config: &str) {
    let (a, b) = pair(config);
    assert_ne!(a.plugin.info().capabilities.flags & cap_flags::RECEIVER_ENFORCED, 0);
    let src = buffer(&a, 1 << 20, 3);
    let dst = buffer(&b, 1 << 20, 4);
    let before = dst.bytes.clone();
    let remote = a.plugin.import_remote_key(PEER_B, &dst.remote_key_bytes).unwrap();
    for (xfer, len) in [(1u64, 100u64), (2, 512 << 10)] {
        let seg = Segment { local: src.key, local_offset: 0, remote, remote_offset: 0, len };
        submit(&a, xfer, PEER_B, 4242, LONG, &[seg]).unwrap();
        let end = a.log.terminal_of(XferId(xfer), WAIT_LIMIT);
        assert_eq!((end.kind, end.reason), (EventKind::FAILED, ReasonCode::NOT_EXPECTED), "{end:?}");
    }
    b.log.wait_for(WAIT_LIMIT, "incoming_failed", |e| {
        e.kind == EventKind::INCOMING_FAILED && e.reason == ReasonCode::NOT_EXPECTED
    });
    expect(&b, 7, PEER_A, LONG, &[LocalRange { key: dst.key, offset: 0, len: 1000 }]);
    for (xfer, len) in [(3u64, 1001u64), (4, 256 << 10)] {
        let seg = Segment { local: src.key, local_offset: 0, remote, remote_offset: 0, len };
        submit(&a, xfer, PEER_B, 7, LONG, &[seg]).unwrap();
        let end = a.log.terminal_of(XferId(xfer), WAIT_LIMIT);
        assert_eq!((end.kind, end.reason), (EventKind::FAILED, ReasonCode::OUT_OF_RANGE), "{end:?}");
    }
    assert!(dst.bytes == before, "a refused write changed the destination");
    b.plugin.cancel_incoming(PEER_A, Ticket(7));
    baseline(&a, &b);
}

/// A peer whose worker never progresses: the transfer ends with TIMEOUT by its own `timeout_ns`, and
/// is *not* reported quiesced while the peer may still apply what it holds; it quiesces once the peer
/// is gone (TCP: UCX reports the closed connection). Over shared memory UCX reports nothing, so it
/// stays unquiesced, and shutdown does not claim it either: it returns within its bounds without a
/// `QUIESCED` for it (the frozen peer could still pull the bytes when it resumes).
fn timeout_against_frozen_peer(config: &str) {
    let config = &format!("{config}quiesce_timeout_ms = 100\n");
    let a = open(config);
    let frozen = frozen_peer(config, 8 << 20);
    a.plugin.connect(PEER_B, &frozen.endpoint).unwrap();
    let remote = a.plugin.import_remote_key(PEER_B, &frozen.remote_key).unwrap();
    let src = buffer(&a, 8 << 20, 5);
    let seg = Segment { local: src.key, local_offset: 0, remote, remote_offset: 0, len: 8 << 20 };
    let started = Instant::now();
    submit(&a, 1, PEER_B, 1, Duration::from_millis(200), &[seg]).unwrap();
    let end = a.log.terminal_of(XferId(1), WAIT_LIMIT);
    let elapsed = started.elapsed();
    assert_eq!((end.kind, end.reason), (EventKind::FAILED, ReasonCode::TIMEOUT), "{end:?}");
    assert!(elapsed >= Duration::from_millis(200), "timed out early: {elapsed:?}");
    assert_eq!(end.flags & event_flags::QUIESCED, 0, "data was on its way to a live peer: {end:?}");
    std::thread::sleep(Duration::from_millis(400)); // past quiesce_timeout_ms: still no claim
    assert_eq!(a.log.count(|e| e.kind == EventKind::QUIESCED), 0);
    assert_eq!(a.plugin.stats().unquiesced_transfers, 1);
    let shared_memory = kvgate_plugin_ucx::UcxConfig::parse(config).unwrap().shared_memory_only();
    drop(frozen); // the peer goes away
    if !shared_memory {
        let down = a.log.wait_for(WAIT_LIMIT, "peer_down once the peer is gone", |e| e.kind == EventKind::PEER_DOWN);
        assert_eq!(down.reason, ReasonCode::PEER_LOST);
        a.log.wait_for(WAIT_LIMIT, "quiesced once the peer is gone", |e| {
            e.kind == EventKind::QUIESCED && e.xfer == XferId(1)
        });
        wait_stats(&a, "nothing live", |s| s.live_transfers == 0 && s.unquiesced_transfers == 0);
    }
    let shutdown_started = Instant::now();
    a.plugin.shutdown();
    let took = shutdown_started.elapsed();
    // shutdown_grace_ms (500 by default) + goodbye (100 ms) + endpoint closes (200 ms), plus scheduling slack.
    assert!(took < Duration::from_millis(2000), "shutdown took {took:?}");
    let quiesced = a.log.count(|e| e.kind == EventKind::QUIESCED);
    assert_eq!(quiesced, if shared_memory { 0 } else { 1 }, "{:?}", a.log.all());
    let s = a.plugin.stats();
    assert_eq!((s.live_transfers, s.unquiesced_transfers, s.workers_alive), (0, 0, 0), "{s:?}");
}

/// The receiver shuts down mid-stream: the sender's transfers fail with PEER_LOST (or TIMEOUT if the
/// transport noticed nothing) and the sender reports PEER_DOWN.
fn peer_shutdown(config: &str) {
    let (a, b) = pair(config);
    let len = 16usize << 20;
    let src = buffer(&a, len, 1);
    let dst = buffer(&b, len, 2);
    let remote = a.plugin.import_remote_key(PEER_B, &dst.remote_key_bytes).unwrap();
    expect(&b, 1, PEER_A, LONG, &[LocalRange { key: dst.key, offset: 0, len: len as u64 }]);
    // Warm up, then shut the receiver down while transfers are queued.
    let seg = Segment { local: src.key, local_offset: 0, remote, remote_offset: 0, len: len as u64 };
    submit(&a, 1, PEER_B, 1, LONG, &[seg]).unwrap();
    assert_eq!(a.log.terminal_of(XferId(1), WAIT_LIMIT).kind, EventKind::SUCCEEDED);
    b.plugin.shutdown();
    assert_eq!(b.plugin.stats().healthy, 0);
    let started = Instant::now();
    let mut failed = 0;
    for xfer in 2..6u64 {
        match submit(&a, xfer, PEER_B, 1, Duration::from_secs(10), &[seg]) {
            Ok(()) => {
                let end = a.log.terminal_of(XferId(xfer), WAIT_LIMIT);
                assert_eq!(end.kind, EventKind::FAILED, "{end:?}");
                assert_eq!(end.reason, ReasonCode::PEER_LOST, "{end:?}");
                failed += 1;
            }
            Err(e) => assert_eq!(e.code, ReasonCode::PEER_LOST, "{e}"),
        }
    }
    let down = a.log.wait_for(WAIT_LIMIT, "peer_down", |e| e.kind == EventKind::PEER_DOWN && e.peer == PEER_B);
    assert_eq!(down.reason, ReasonCode::PEER_LOST);
    let elapsed = started.elapsed();
    assert!(elapsed < Duration::from_secs(10), "peer loss took {elapsed:?} (failed {failed} in flight)");
    wait_stats(&a, "nothing live", |s| s.live_transfers == 0 && s.unquiesced_transfers == 0);
    a.plugin.shutdown();
}

/// Shutdown with transfers in flight to a live receiver returns promptly, every transfer terminal and
/// confirmed quiesced first (the grace is generous so that a loaded machine cannot fail this; shutdown
/// returns as soon as every receiver has answered).
fn shutdown_with_transfers_in_flight(config: &str) {
    let (a, b) = pair(&format!("{config}shutdown_grace_ms = 10000\n"));
    let len = 16u64 << 20;
    let src = buffer(&a, len as usize, 1);
    let dst = buffer(&b, len as usize, 2);
    let remote = a.plugin.import_remote_key(PEER_B, &dst.remote_key_bytes).unwrap();
    expect(&b, 1, PEER_A, LONG, &[LocalRange { key: dst.key, offset: 0, len }]);
    let mut ids = Vec::new();
    for i in 0..20u64 {
        let seg = Segment { local: src.key, local_offset: i * 4096, remote, remote_offset: i * 4096, len: 4096 };
        submit(&a, 100 + i, PEER_B, 999, LONG, &[seg]).unwrap(); // unauthorised ticket
        ids.push(100 + i);
    }
    for i in 0..5u64 {
        let piece = len / 1000;
        let segs: Vec<Segment> = (0..1000u64)
            .map(|j| Segment { local: src.key, local_offset: j * piece, remote, remote_offset: j * piece, len: piece })
            .collect();
        submit(&a, 200 + i, PEER_B, 1, LONG, &segs).unwrap();
        ids.push(200 + i);
    }
    let started = Instant::now();
    a.plugin.shutdown();
    let took = started.elapsed();
    assert!(took < Duration::from_secs(5), "shutdown took {took:?}");
    for xfer in ids {
        let end = a.log.terminal_of(XferId(xfer), Duration::from_millis(1));
        let quiesced = end.kind == EventKind::SUCCEEDED
            || end.flags & event_flags::QUIESCED != 0
            || a.log.count(|e| e.kind == EventKind::QUIESCED && e.xfer == XferId(xfer)) == 1;
        assert!(quiesced, "transfer {xfer} not quiesced at shutdown: {end:?}");
    }
    let s = a.plugin.stats();
    assert_eq!(
        (s.live_transfers, s.unquiesced_transfers, s.registered_regions, s.workers_alive),
        (0, 0, 0, 0),
        "{s:?}"
    );
    b.plugin.shutdown();
}

/// `shutdown_grace_ms = 0`: shutdown waits for no confirmation, yet every transfer is terminal before
/// it returns, within the fixed goodbye and endpoint-close bounds.
fn shutdown_with_zero_grace(config: &str) {
    let (a, b) = pair(&format!("{config}shutdown_grace_ms = 0\n"));
    let len = 16u64 << 20;
    let src = buffer(&a, len as usize, 1);
    let dst = buffer(&b, len as usize, 2);
    let remote = a.plugin.import_remote_key(PEER_B, &dst.remote_key_bytes).unwrap();
    expect(&b, 1, PEER_A, LONG, &[LocalRange { key: dst.key, offset: 0, len }]);
    let seg = Segment { local: src.key, local_offset: 0, remote, remote_offset: 0, len };
    for xfer in 1..=4u64 {
        submit(&a, xfer, PEER_B, 1, LONG, &[seg]).unwrap();
    }
    let started = Instant::now();
    a.plugin.shutdown();
    let took = started.elapsed();
    // goodbye (100 ms) + endpoint closes (200 ms) + scheduling slack; the grace adds nothing.
    assert!(took < Duration::from_millis(1500), "shutdown took {took:?}");
    for xfer in 1..=4u64 {
        a.log.terminal_of(XferId(xfer), Duration::from_millis(1));
    }
    let s = a.plugin.stats();
    assert_eq!((s.live_transfers, s.unquiesced_transfers, s.workers_alive), (0, 0, 0), "{s:?}");
    b.plugin.shutdown();
}

/// Every counter back to its baseline once regions, keys and peers are released.
fn baseline(a: &Side, b: &Side) {
    for side in [a, b] {
        wait_stats(side, "no live transfers or tickets", |s| {
            s.live_transfers == 0 && s.unquiesced_transfers == 0 && s.live_tickets == 0
        });
        side.plugin.shutdown();
        let s = side.plugin.stats();
        assert_eq!(
            (s.registered_regions, s.registered_bytes, s.imported_remote_keys, s.workers_alive),
            (0, 0, 0, 0),
            "{s:?}"
        );
    }
}

macro_rules! per_transport {
    ($($name:ident),*) => {
        mod tcp { $( #[test] fn $name() { super::$name(&super::tcp_config()); } )* }
        mod sm_put { $( #[test] fn $name() { super::$name(&super::sm_config()); } )* }
        mod sm_am { $( #[test] fn $name() { super::$name(&super::sm_am_config()); } )* }
    };
}

per_transport!(
    data_integrity,
    scatter_gather,
    adjacent_blocks,
    posted_ops_bound,
    posted_bytes_bound,
    empty_segments_around_the_data,
    cancel_then_quiesced,
    peer_shutdown,
    shutdown_with_transfers_in_flight,
    shutdown_with_zero_grace
);

#[test]
fn tcp_receiver_refuses() {
    receiver_refuses(&tcp_config());
}

#[test]
fn sm_am_receiver_refuses() {
    receiver_refuses(&sm_am_config());
}

#[test]
fn tcp_timeout_against_frozen_peer() {
    timeout_against_frozen_peer(&tcp_config());
}

#[test]
fn sm_am_timeout_against_frozen_peer() {
    timeout_against_frozen_peer(&sm_am_config());
}
