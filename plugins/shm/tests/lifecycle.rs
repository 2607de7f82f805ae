//! Every way a transfer can end besides success (cancel, its own timeout, deregister, disconnect,
//! shutdown) ends it with exactly one terminal event, a `QUIESCED` once no worker touches it, and no
//! byte landing after that; stats return to their baseline.

mod common;
use common::*;
use kvgate_abi::{EventKind, ReasonCode, XferId};
use std::time::Duration;

/// Big enough that a copy with 64 KiB chunks on one worker is still running when the test acts.
const BIG: usize = 128 << 20;
/// One worker, small chunks, and every transfer to the worker (none copied inline by `submit`): a
/// test that holds the sink holds the worker, not its own thread.
const SLOW: &str = "workers = 1\nchunk_bytes = 65536\ninline_copy_bytes = 0";

/// A pair with a BIG source full of non-zero bytes and a zeroed destination.
fn big_pair(
    config: &str,
) -> (Pair, kvgate_plugin_shm::SharedRegion, kvgate_plugin_shm::SharedRegion, Vec<kvgate_abi::Segment>) {
    let pair = Pair::new(config);
    let (src, dst) = (region(BIG), region(BIG));
    src.as_mut_slice().fill(0x5A);
    let (local, _, remote) = pair.regions(&src, &dst);
    let segments = vec![segment(local, 0, remote, 0, BIG as u64)];
    (pair, src, dst, segments)
}

/// Wait until the first destination byte changed (the copy is under way) or transfer 1 already
/// ended (a 1 ms timeout can fire before the first chunk on a loaded machine).
fn wait_started(dst: &kvgate_plugin_shm::SharedRegion, events: &Recorder) {
    let deadline = std::time::Instant::now() + WAIT;
    // SAFETY: the region's first byte is mapped for as long as `dst` lives; volatile, as the plugin's
    // worker writes it.
    while unsafe { std::ptr::read_volatile(dst.as_slice().as_ptr()) } == 0 {
        if events.of(XferId(1)).iter().any(|e| e.is_terminal()) {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "copy never started");
        std::thread::yield_now();
    }
}

/// After the transfer settled, the destination no longer changes.
fn assert_destination_still(dst: &kvgate_plugin_shm::SharedRegion) {
    let before = dst.as_slice().to_vec();
    std::thread::sleep(Duration::from_millis(50));
    assert!(dst.as_slice() == before.as_slice(), "a byte landed after QUIESCED");
}

fn assert_baseline(i: &Instance) {
    let s = i.stats();
    assert_eq!((s.live_transfers, s.unquiesced_transfers), (0, 0), "{s:?}");
}

/// Tries before giving up on catching a copy under way (on a loaded machine the test thread can
/// be descheduled for longer than the whole copy takes).
const ATTEMPTS: usize = 5;

/// Submit a BIG transfer, wait until its copy is under way, then `act`; retried when the copy
/// finished before `act` took effect. Returns the pair, the destination and the terminal event.
fn act_mid_transfer(
    config: &str,
    timeout_ns: u64,
    act: impl Fn(&Pair, &[kvgate_abi::Segment]),
) -> (Pair, [kvgate_plugin_shm::SharedRegion; 2], Vec<kvgate_abi::Segment>, kvgate_abi::Event) {
    for attempt in 1..=ATTEMPTS {
        let (pair, src, dst, segments) = big_pair(config);
        ok(pair.submit(1, timeout_ns, &segments));
        wait_started(&dst, &pair.sender.events);
        act(&pair, &segments);
        let terminal = pair.sender.events.settled(XferId(1));
        if terminal.kind == EventKind::SUCCEEDED && attempt < ATTEMPTS {
            eprintln!("attempt {attempt}: the copy finished before the test acted; trying again");
            continue;
        }
        return (pair, [src, dst], segments, terminal);
    }
    unreachable!()
}

// CONFORMANCE: ABORT-2, ABORT-3, RES-3
#[test]
fn cancel_mid_transfer_fails_then_quiesces_and_nothing_lands_after() {
    let (pair, [_src, dst], _, terminal) =
        act_mid_transfer(SLOW, NO_TIMEOUT_NS, |p, _| p.sender.transport.cancel(XferId(1)));
    assert_eq!((terminal.kind, terminal.reason), (EventKind::FAILED, ReasonCode::CANCELLED), "{terminal:?}");
    assert_destination_still(&dst);
    assert!(dst.as_slice()[BIG - 1] == 0, "the cancelled copy stopped before the end");
    assert_baseline(&pair.sender);
    // Cancel again, and cancel of an unknown id: harmless, no event.
    let events = pair.sender.events.all().len();
    pair.sender.transport.cancel(XferId(1));
    pair.sender.transport.cancel(XferId(999));
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(pair.sender.events.all().len(), events);
}

// CONFORMANCE: ABORT-1
#[test]
fn cancel_of_a_queued_transfer_fails_it_quiesced_at_once() {
    let (pair, _src, _dst, segments) = big_pair(SLOW);
    pair.sender.events.hold();
    ok(pair.submit(1, NO_TIMEOUT_NS, &[segment(segments[0].local, 0, segments[0].remote, 0, 0)]));
    pair.sender.events.wait_count(1); // the only worker is now stuck delivering transfer 1's success
    ok(pair.submit(2, NO_TIMEOUT_NS, &segments));
    pair.sender.transport.cancel(XferId(2)); // delivered by the stuck worker once released
    pair.sender.events.release();
    let terminal = pair.sender.events.settled(XferId(2));
    assert_eq!(terminal.kind, EventKind::FAILED);
    assert_ne!(terminal.flags & kvgate_abi::event_flags::QUIESCED, 0, "never started: quiesced at once");
    assert_baseline(&pair.sender);
}

// CONFORMANCE: TIME-4, RES-3
#[test]
fn own_timeout_fails_a_running_transfer() {
    let (pair, [_src, dst], _, terminal) = act_mid_transfer(SLOW, 1_000_000, |_, _| {});
    assert_eq!((terminal.kind, terminal.reason), (EventKind::FAILED, ReasonCode::TIMEOUT), "{terminal:?}");
    assert!(terminal.message.contains("timed out"), "{terminal:?}");
    assert_destination_still(&dst);
    assert_baseline(&pair.sender);
}

// CONFORMANCE: TIME-1
#[test]
fn own_timeout_fails_a_transfer_still_queued_behind_another() {
    let (pair, _src, _dst, segments) = big_pair(SLOW);
    pair.sender.events.hold();
    ok(pair.submit(1, NO_TIMEOUT_NS, &[segment(segments[0].local, 0, segments[0].remote, 0, 0)]));
    pair.sender.events.wait_count(1);
    ok(pair.submit(2, 1_000_000, &segments));
    // The timer fails transfer 2 while the only worker is still held: it never started.
    let deadline = std::time::Instant::now() + WAIT;
    while pair.sender.stats().live_transfers != 0 {
        assert!(std::time::Instant::now() < deadline, "transfer 2 never timed out");
        std::thread::sleep(Duration::from_millis(1));
    }
    pair.sender.events.release();
    let terminal = pair.sender.events.settled(XferId(2));
    assert_eq!((terminal.kind, terminal.reason), (EventKind::FAILED, ReasonCode::TIMEOUT));
    assert_ne!(terminal.flags & kvgate_abi::event_flags::QUIESCED, 0);
    assert_baseline(&pair.sender);
}

#[test]
fn a_timeout_longer_than_the_copy_does_not_fire() {
    let pair = Pair::new("");
    let (src, dst) = (region(1 << 20), region(1 << 20));
    let (local, _, remote) = pair.regions(&src, &dst);
    ok(pair.submit(1, 30_000_000_000, &[segment(local, 0, remote, 0, 1 << 20)]));
    assert_eq!(pair.sender.events.settled(XferId(1)).kind, EventKind::SUCCEEDED);
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(pair.sender.events.of(XferId(1)).len(), 1, "no late timeout event");
}

// CONFORMANCE: DATA-4
#[test]
fn deregistering_the_source_fails_the_transfer_before_returning() {
    let (pair, [_src, dst], segments, terminal) = act_mid_transfer(SLOW, NO_TIMEOUT_NS, |p, segments| {
        ok(p.sender.transport.deregister(segments[0].local));
        // deregister returned: no worker reads the source any more.
        assert_eq!(p.sender.stats().unquiesced_transfers, 0);
    });
    assert_eq!((terminal.kind, terminal.reason), (EventKind::FAILED, ReasonCode::UNKNOWN_KEY));
    assert_destination_still(&dst);
    let e = err(pair.submit(2, NO_TIMEOUT_NS, &segments));
    assert_eq!(e.code, ReasonCode::UNKNOWN_KEY);
    assert_eq!(err(pair.sender.transport.deregister(segments[0].local)).code, ReasonCode::UNKNOWN_KEY);
}

// CONFORMANCE: TIME-3, HANDSHAKE-2
#[test]
fn disconnect_fails_the_peers_transfers_and_drops_its_keys() {
    let (pair, [_src, dst], segments, terminal) =
        act_mid_transfer(SLOW, NO_TIMEOUT_NS, |p, _| p.sender.transport.disconnect(RECEIVER));
    assert_eq!((terminal.kind, terminal.reason), (EventKind::FAILED, ReasonCode::PEER_LOST));
    assert_destination_still(&dst);
    let s = pair.sender.stats();
    assert_eq!((s.imported_remote_keys, s.connected_peers, s.live_transfers, s.unquiesced_transfers), (0, 0, 0, 0));
    assert_eq!(err(pair.submit(2, NO_TIMEOUT_NS, &segments)).code, ReasonCode::PEER_UNREACHABLE);
}

// CONFORMANCE: RES-5
#[test]
fn shutdown_fails_live_transfers_joins_workers_and_releases_everything() {
    let (pair, [_src, dst], segments, _) =
        act_mid_transfer("workers = 2\nchunk_bytes = 65536", NO_TIMEOUT_NS, |p, segments| {
            ok(p.submit(2, NO_TIMEOUT_NS, segments));
            p.sender.transport.shutdown();
        });
    // Everything is delivered before shutdown returns.
    for x in [1, 2] {
        let events = pair.sender.events.of(XferId(x));
        assert_eq!(events.iter().filter(|e| e.is_terminal()).count(), 1, "{events:?}");
        assert_eq!(events[0].reason, ReasonCode::SHUTDOWN, "{events:?}");
        pair.sender.events.settled(XferId(x));
    }
    let s = pair.sender.stats();
    assert_eq!(s.workers_alive, 0, "{s:?}");
    assert_eq!(s.healthy, 0);
    assert_eq!((s.live_transfers, s.unquiesced_transfers, s.registered_regions, s.registered_bytes), (0, 0, 0, 0));
    assert_eq!((s.imported_remote_keys, s.connected_peers), (0, 0));
    assert_destination_still(&dst);
    assert_eq!(err(pair.submit(3, NO_TIMEOUT_NS, &segments)).code, ReasonCode::SHUTDOWN);
    pair.sender.transport.shutdown(); // twice: harmless
}

// CONFORMANCE: OBS-2, RES-2
/// Many lifecycles of every kind; afterwards every gauge is back at its baseline.
#[test]
fn stats_are_exact_and_return_to_baseline() {
    let pair = Pair::new("workers = 2\nchunk_bytes = 4096");
    let base = pair.sender.stats();
    assert_eq!(base.workers_alive, 3, "two copy workers and the timer: {base:?}");
    assert_eq!((base.connected_peers, base.healthy, base.registered_regions), (1, 1, 0));
    let (src, dst) = (region(1 << 20), region(1 << 20));
    let (local, _, remote) = pair.regions(&src, &dst);
    let s = pair.sender.stats();
    assert_eq!((s.registered_regions, s.registered_bytes, s.imported_remote_keys), (1, 1 << 20, 1));
    for round in 0..300u64 {
        let len = (round * 3511) % (1 << 20);
        ok(pair.submit(round, NO_TIMEOUT_NS, &[segment(local, 0, remote, 0, len)]));
        match round % 3 {
            0 => pair.sender.transport.cancel(XferId(round)),
            1 if round % 2 == 0 => pair.sender.transport.cancel(XferId(round)),
            _ => {}
        }
    }
    for round in 0..300u64 {
        pair.sender.events.settled(XferId(round));
    }
    let s = pair.sender.stats();
    assert_eq!((s.live_transfers, s.unquiesced_transfers), (0, 0), "{s:?}");
    pair.sender.transport.release_remote_key(remote);
    ok(pair.sender.transport.deregister(local));
    let s = pair.sender.stats();
    assert_eq!(s, base, "back to the baseline");
}

#[test]
fn dropping_an_instance_shuts_it_down() {
    for attempt in 1..=ATTEMPTS {
        let (pair, _src, dst, segments) = big_pair(SLOW);
        ok(pair.submit(1, NO_TIMEOUT_NS, &segments));
        wait_started(&dst, &pair.sender.events);
        let events = std::sync::Arc::clone(&pair.sender.events);
        drop(pair);
        let terminal = events.settled(XferId(1));
        if terminal.kind == EventKind::SUCCEEDED && attempt < ATTEMPTS {
            continue;
        }
        assert_eq!((terminal.kind, terminal.reason), (EventKind::FAILED, ReasonCode::SHUTDOWN));
        return;
    }
}

/// 10 000 live transfers cancelled at once: every one ends exactly once, the instance stays healthy.
// CONFORMANCE: ABORT-4
#[test]
fn a_storm_of_ten_thousand_cancels_ends_every_transfer_once() {
    let pair = Pair::new("workers = 1\ninline_copy_bytes = 0");
    let (src, dst) = (region(1 << 16), region(1 << 16));
    let (local, _, remote) = pair.regions(&src, &dst);
    let seg = [segment(local, 0, remote, 0, 1 << 16)];
    pair.sender.events.hold();
    ok(pair.submit(0, NO_TIMEOUT_NS, &[segment(local, 0, remote, 0, 0)]));
    pair.sender.events.wait_count(1); // the only worker is held: the storm hits queued transfers
    for x in 1..=10_000 {
        ok(pair.submit(x, NO_TIMEOUT_NS, &seg));
    }
    assert_eq!(pair.sender.stats().live_transfers, 10_000);
    for x in 1..=10_000 {
        pair.sender.transport.cancel(XferId(x));
    }
    pair.sender.events.release();
    for x in 1..=10_000 {
        let terminal = pair.sender.events.settled(XferId(x));
        assert_eq!((terminal.kind, terminal.reason), (EventKind::FAILED, ReasonCode::CANCELLED));
    }
    let s = pair.sender.stats();
    assert_eq!((s.live_transfers, s.unquiesced_transfers, s.healthy), (0, 0, 1), "{s:?}");
}
