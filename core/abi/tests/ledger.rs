//! The SDK's transfer ledger: each transition, deadlines at and just past their instant, cancel
//! races, exactly-once terminal events, quiesce tracking and lost-terminal detection; and the
//! region views' bounds.

use kvgate_abi::sdk::ledger::{transfers_dropped_without_terminal, Expired, Phase};
use kvgate_abi::sdk::{Admission, Failure, OrderedDelivery, RegionView, TransferLedger};
use kvgate_abi::{event_flags, EventKind, PeerId, ReasonCode, XferId};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn admission(deadline: Option<Instant>) -> Admission {
    Admission { peer: PeerId(7), total_bytes: 100, deadline }
}

/// (xfer, kind, quiesced flag, reason)
fn events<T>(ledger: &mut TransferLedger<T>) -> Vec<(u64, EventKind, bool, ReasonCode)> {
    ledger
        .take_events()
        .into_iter()
        .map(|e| {
            assert_eq!(e.peer, PeerId(7), "every event carries the transfer's peer");
            (e.xfer.0, e.kind, e.flags & event_flags::QUIESCED != 0, e.reason)
        })
        .collect()
}

fn no_message<T>(_: XferId, _: &kvgate_abi::sdk::ledger::Entry<T>) -> String {
    "timed out".into()
}

// CONFORMANCE: RES-1 (exactly one terminal event per admitted transfer)
#[test]
fn success_is_reported_once_and_a_second_terminal_is_refused_and_counted() {
    let mut ledger = TransferLedger::new();
    ledger.admit(XferId(1), admission(None), ()).unwrap();
    assert_eq!(ledger.live_transfers(), 1);
    assert!(ledger.succeed(XferId(1)));
    assert_eq!(events(&mut ledger), vec![(1, EventKind::SUCCEEDED, false, ReasonCode(0))]);
    assert_eq!(ledger.live_transfers(), 0);
    assert!(ledger.is_empty(), "a transfer nothing holds leaves at its terminal event");
    // Unknown now: nothing queued, nothing counted.
    assert!(!ledger.succeed(XferId(1)));
    assert_eq!(ledger.fail(XferId(1), ReasonCode::TIMEOUT, "late"), Failure::Unknown);
    assert!(events(&mut ledger).is_empty());
    assert_eq!(ledger.refused_terminals(), 0);
}

#[test]
fn a_held_transfer_refuses_every_second_terminal() {
    let mut ledger = TransferLedger::new();
    ledger.admit(XferId(1), admission(None), ()).unwrap();
    assert!(ledger.hold(XferId(1)));
    assert!(ledger.succeed(XferId(1)));
    assert_eq!(ledger.entry(XferId(1)).unwrap().phase(), Phase::Succeeded);
    assert!(!ledger.succeed(XferId(1)), "second success refused");
    assert_eq!(ledger.fail(XferId(1), ReasonCode::TIMEOUT, "x"), Failure::AlreadyTerminal);
    assert_eq!(ledger.cancel(XferId(1), "c"), Failure::AlreadyTerminal);
    assert!(!ledger.hold(XferId(1)), "nothing new starts after the terminal event");
    assert_eq!(ledger.refused_terminals(), 2);
    ledger.release(XferId(1));
    assert_eq!(
        events(&mut ledger),
        vec![(1, EventKind::SUCCEEDED, false, ReasonCode(0))],
        "no QUIESCED after SUCCEEDED"
    );
    assert!(ledger.is_empty());
}

// CONFORMANCE: RES-3 (QUIESCED only once nothing holds the transfer, never before FAILED)
#[test]
fn a_failure_while_held_quiesces_at_the_last_release() {
    let mut ledger = TransferLedger::new();
    ledger.admit(XferId(1), admission(None), "data").unwrap();
    assert!(ledger.hold(XferId(1)) && ledger.hold(XferId(1)));
    assert_eq!(ledger.fail(XferId(1), ReasonCode::PEER_LOST, "gone"), Failure::FailedUnquiesced);
    assert_eq!(ledger.live_transfers(), 0);
    assert_eq!(ledger.unquiesced_transfers(), 1);
    assert!(ledger.any_held(|d| *d == "data"));
    ledger.release(XferId(1));
    assert_eq!(events(&mut ledger), vec![(1, EventKind::FAILED, false, ReasonCode::PEER_LOST)]);
    ledger.release(XferId(1));
    assert_eq!(events(&mut ledger), vec![(1, EventKind::QUIESCED, false, ReasonCode(0))]);
    assert_eq!(ledger.unquiesced_transfers(), 0);
    assert!(!ledger.any_held(|_| true));
    assert!(ledger.is_empty());
}

#[test]
fn a_failure_with_nothing_held_carries_the_quiesced_flag_and_the_first_cause_wins() {
    let mut ledger = TransferLedger::new();
    ledger.admit(XferId(1), admission(None), ()).unwrap();
    assert_eq!(ledger.fail(XferId(1), ReasonCode::UNKNOWN_KEY, "deregistered"), Failure::FailedQuiesced);
    assert_eq!(ledger.fail(XferId(1), ReasonCode::TIMEOUT, "later"), Failure::Unknown);
    assert_eq!(events(&mut ledger), vec![(1, EventKind::FAILED, true, ReasonCode::UNKNOWN_KEY)]);
}

#[test]
fn a_live_transfer_released_to_zero_stays_live_and_holdable() {
    let mut ledger = TransferLedger::new();
    ledger.admit(XferId(1), admission(None), ()).unwrap();
    assert!(ledger.hold(XferId(1)));
    ledger.release(XferId(1));
    assert!(ledger.is_live(XferId(1)));
    assert!(events(&mut ledger).is_empty());
    assert!(ledger.hold(XferId(1)));
    ledger.release(XferId(1));
    assert!(ledger.succeed(XferId(1)));
}

// CONFORMANCE: DATA-3 (an id already live is refused)
#[test]
fn an_id_still_in_the_ledger_is_refused_until_it_quiesced() {
    let mut ledger = TransferLedger::new();
    ledger.admit(XferId(1), admission(None), 1).unwrap();
    assert_eq!(ledger.admit(XferId(1), admission(None), 2).unwrap_err().code, ReasonCode::DUPLICATE_ID);
    assert!(ledger.hold(XferId(1)));
    ledger.fail(XferId(1), ReasonCode::CANCELLED, "c");
    assert_eq!(
        ledger.admit(XferId(1), admission(None), 3).unwrap_err().code,
        ReasonCode::DUPLICATE_ID,
        "failed, unquiesced"
    );
    ledger.release(XferId(1));
    ledger.admit(XferId(1), admission(None), 4).unwrap();
    assert_eq!(ledger.get(XferId(1)), Some(&4));
}

// CONFORMANCE: TIME-1, TIME-4 (the deadline fails a live transfer at its instant, not before)
#[test]
fn a_deadline_fires_at_its_instant_and_not_just_before() {
    let t0 = Instant::now();
    let at = t0 + Duration::from_millis(50);
    let mut ledger = TransferLedger::new();
    ledger.admit(XferId(1), admission(Some(at)), ()).unwrap();
    let before = ledger.expire(at - Duration::from_nanos(1), no_message);
    assert_eq!(before, Expired { next: Some(at), ..Expired::default() });
    assert!(events(&mut ledger).is_empty());
    let at_deadline = ledger.expire(at, |x, e| format!("{} timed out after {} bytes", x.0, e.total_bytes()));
    assert_eq!(at_deadline.timed_out, vec![XferId(1)]);
    assert_eq!(at_deadline.next, None);
    let failed = ledger.take_events();
    assert_eq!(failed.len(), 1);
    assert_eq!((failed[0].kind, failed[0].reason), (EventKind::FAILED, ReasonCode::TIMEOUT));
    assert_eq!(failed[0].message.as_str(), "1 timed out after 100 bytes");
}

#[test]
fn just_past_the_deadline_only_the_due_transfers_fail_in_deadline_order() {
    let t0 = Instant::now();
    let mut ledger = TransferLedger::new();
    for (id, ms) in [(1, 30), (2, 10), (3, 20), (4, 40)] {
        ledger.admit(XferId(id), admission(Some(t0 + Duration::from_millis(ms))), ()).unwrap();
    }
    ledger.admit(XferId(5), admission(None), ()).unwrap();
    let e = ledger.expire(t0 + Duration::from_millis(30) + Duration::from_nanos(1), no_message);
    assert_eq!(e.timed_out, vec![XferId(2), XferId(3), XferId(1)]);
    assert_eq!(e.next, Some(t0 + Duration::from_millis(40)));
    assert_eq!(ledger.live_transfers(), 2);
    let e = ledger.expire(t0 + Duration::from_secs(3600), no_message);
    assert_eq!(e.timed_out, vec![XferId(4)]);
    assert!(ledger.is_live(XferId(5)), "no deadline, never expired");
}

#[test]
fn a_deadline_of_an_ended_transfer_does_nothing_even_if_its_id_returns() {
    let t0 = Instant::now();
    let mut ledger = TransferLedger::new();
    ledger.admit(XferId(1), admission(Some(t0 + Duration::from_millis(5))), ()).unwrap();
    assert!(ledger.succeed(XferId(1)));
    // The id comes back with a later deadline: the old heap entry must not fail it.
    ledger.admit(XferId(1), admission(Some(t0 + Duration::from_millis(50))), ()).unwrap();
    let e = ledger.expire(t0 + Duration::from_millis(10), no_message);
    assert!(e.timed_out.is_empty());
    assert!(ledger.is_live(XferId(1)));
    assert_eq!(events(&mut ledger), vec![(1, EventKind::SUCCEEDED, false, ReasonCode(0))]);
}

// CONFORMANCE: ABORT-1, ABORT-3 (a cancel ends a live transfer at once; other cancels are harmless)
#[test]
fn cancel_ends_a_live_transfer_and_is_harmless_otherwise() {
    let mut ledger: TransferLedger<()> = TransferLedger::new();
    assert_eq!(ledger.cancel(XferId(9), "c"), Failure::Unknown, "never submitted");
    ledger.admit(XferId(1), admission(None), ()).unwrap();
    assert_eq!(ledger.cancel(XferId(1), "c"), Failure::FailedQuiesced);
    assert_eq!(ledger.cancel(XferId(1), "c"), Failure::Unknown, "second cancel of a finished transfer");
    assert_eq!(events(&mut ledger), vec![(1, EventKind::FAILED, true, ReasonCode::CANCELLED)]);
    assert_eq!(ledger.refused_terminals(), 0, "a cancel of an unknown id is not even an attempt");
}

#[test]
fn cancel_racing_success_and_timeout_gives_one_terminal_whichever_comes_first() {
    let t0 = Instant::now();
    // Success first, then the cancel and the deadline: only SUCCEEDED.
    let mut ledger = TransferLedger::new();
    ledger.admit(XferId(1), admission(Some(t0)), ()).unwrap();
    assert!(ledger.hold(XferId(1)));
    assert!(ledger.succeed(XferId(1)));
    assert_eq!(ledger.cancel(XferId(1), "c"), Failure::AlreadyTerminal);
    assert!(ledger.entry(XferId(1)).unwrap().cancel_requested());
    assert!(ledger.expire(t0, no_message).timed_out.is_empty());
    ledger.release(XferId(1));
    assert_eq!(events(&mut ledger), vec![(1, EventKind::SUCCEEDED, false, ReasonCode(0))]);
    // Cancel first: the copy that finishes afterwards cannot report success.
    ledger.admit(XferId(2), admission(Some(t0)), ()).unwrap();
    assert!(ledger.hold(XferId(2)));
    assert_eq!(ledger.cancel(XferId(2), "c"), Failure::FailedUnquiesced);
    assert!(!ledger.succeed(XferId(2)), "SUCCEEDED after an accepted cancel is refused");
    assert!(ledger.expire(t0, no_message).timed_out.is_empty(), "the deadline finds it terminal");
    ledger.release(XferId(2));
    assert_eq!(
        events(&mut ledger),
        vec![(2, EventKind::FAILED, false, ReasonCode::CANCELLED), (2, EventKind::QUIESCED, false, ReasonCode(0))]
    );
}

#[test]
fn fail_where_and_close_all_end_every_selected_transfer_once() {
    let mut ledger = TransferLedger::new();
    for id in 1..=4u64 {
        ledger.admit(XferId(id), admission(None), id % 2).unwrap();
    }
    assert!(ledger.hold(XferId(1)));
    assert!(ledger.succeed(XferId(4)));
    assert_eq!(ledger.fail_where(|d| *d == 1, ReasonCode::PEER_LOST, "peer gone"), 2);
    assert_eq!(ledger.fail_where(|d| *d == 1, ReasonCode::PEER_LOST, "again"), 0);
    ledger.close_all(ReasonCode::SHUTDOWN, "shutting down");
    let got = events(&mut ledger);
    // fail_where takes transfers in no particular order; each transfer's own events are in order.
    let mut sorted = got.clone();
    sorted.sort_by_key(|e| e.0);
    assert_eq!(
        sorted,
        vec![
            (1, EventKind::FAILED, false, ReasonCode::PEER_LOST),
            (1, EventKind::QUIESCED, false, ReasonCode(0)),
            (2, EventKind::FAILED, true, ReasonCode::SHUTDOWN),
            (3, EventKind::FAILED, true, ReasonCode::PEER_LOST),
            (4, EventKind::SUCCEEDED, false, ReasonCode(0)),
        ]
    );
    assert_eq!(got.len(), 5);
    assert!(ledger.is_empty());
    assert_eq!((ledger.live_transfers(), ledger.unquiesced_transfers()), (0, 0));
}

#[test]
fn an_unquiesced_failure_is_reported_overdue_past_the_quiesce_bound() {
    let mut ledger = TransferLedger::new();
    ledger.set_quiesce_bound(Some(Duration::from_millis(5)));
    ledger.admit(XferId(1), admission(None), ()).unwrap();
    ledger.admit(XferId(2), admission(None), ()).unwrap();
    assert!(ledger.hold(XferId(1)) && ledger.hold(XferId(2)));
    ledger.fail(XferId(1), ReasonCode::CANCELLED, "c");
    ledger.fail(XferId(2), ReasonCode::CANCELLED, "c");
    ledger.release(XferId(2));
    let e = ledger.expire(Instant::now() + Duration::from_secs(1), no_message);
    assert_eq!(e.quiesce_overdue, vec![XferId(1)], "only the one still held");
}

#[test]
fn the_deadline_heap_stays_bounded_under_a_stream_of_short_transfers() {
    let far = Instant::now() + Duration::from_secs(60);
    let mut ledger = TransferLedger::new();
    let mut most = 0;
    for id in 0..50_000u64 {
        ledger.admit(XferId(id), admission(Some(far)), ()).unwrap();
        if id >= 8 {
            assert!(ledger.succeed(XferId(id - 8)));
        }
        most = most.max(ledger.heap_len());
    }
    assert!(most <= kvgate_abi::sdk::ledger::STALE_DEADLINES_FLOOR + 2 * 9 + 1, "{most} entries");
}

#[test]
fn a_ledger_dropped_with_live_transfers_is_counted() {
    let before = transfers_dropped_without_terminal();
    let mut ledger = TransferLedger::new();
    ledger.admit(XferId(1), admission(None), ()).unwrap();
    ledger.admit(XferId(2), admission(None), ()).unwrap();
    ledger.succeed(XferId(2));
    drop(ledger);
    assert!(transfers_dropped_without_terminal() > before, "the lost terminal event is detected");
}

#[test]
fn ordered_delivery_delivers_everything_queued_in_order() {
    let queue = Mutex::new(vec![]);
    let delivered = Arc::new(Mutex::new(Vec::new()));
    let delivery = OrderedDelivery::new();
    let mut ledger = TransferLedger::new();
    for id in 1..=3 {
        ledger.admit(XferId(id), admission(None), ()).unwrap();
        ledger.succeed(XferId(id));
    }
    queue.lock().unwrap().extend(ledger.take_events());
    let d = Arc::clone(&delivered);
    delivery.flush(
        || !queue.lock().unwrap().is_empty(),
        || std::mem::take(&mut *queue.lock().unwrap()),
        |e| d.lock().unwrap().push(e.xfer.0),
    );
    assert_eq!(*delivered.lock().unwrap(), vec![1, 2, 3]);
}

#[test]
fn region_views_check_every_range_and_copy_exactly() {
    let mut src: Vec<u8> = (0..64u8).collect();
    let mut dst = vec![0xEEu8; 64];
    // SAFETY: both buffers outlive the views, which are used only in this test.
    let (s, d) = unsafe {
        (
            RegionView::from_raw_parts(src.as_mut_ptr() as usize, 64),
            RegionView::from_raw_parts(dst.as_mut_ptr() as usize, 64),
        )
    };
    s.copy_to(3, &d, 10, 20).unwrap();
    assert_eq!(&dst[10..30], &src[3..23]);
    assert_eq!((dst[9], dst[30]), (0xEE, 0xEE));
    let mut out = vec![1u8];
    s.copy_out(60, 4, &mut out).unwrap();
    assert_eq!(out, vec![1, 60, 61, 62, 63]);
    d.copy_in(62, &[5, 6]).unwrap();
    assert_eq!(&dst[62..], &[5, 6]);
    // At the end of the region: fine; one byte past it, or an offset near u64::MAX: refused.
    assert!(s.check(64, 0).is_ok() && s.check(0, 64).is_ok());
    for (offset, len) in [(0, 65), (64, 1), (u64::MAX, 2), (u64::MAX - 1, 1)] {
        assert_eq!(s.check(offset, len).unwrap_err().code, ReasonCode::OUT_OF_RANGE, "{offset}+{len}");
    }
    assert!(s.copy_to(0, &d, 60, 5).is_err());
    assert!(d.copy_in(63, &[1, 2]).is_err());
    assert!(s.copy_out(61, 4, &mut out).is_err());
    assert_eq!(dst[63], 6, "a refused copy writes nothing");
    assert_eq!(s.slice(8, 8).unwrap().addr_at(0, 8).unwrap(), src.as_ptr() as usize + 8);
}

#[test]
fn a_registered_view_refuses_empty_null_and_wrapping_regions() {
    let desc = |addr: u64, len: u64| kvgate_abi::RegionDesc { addr, len, ..Default::default() };
    assert!(RegionView::registered(&desc(0x1000, 16)).is_ok());
    for (addr, len) in [(0, 16), (0x1000, 0), (u64::MAX - 4, 16)] {
        assert_eq!(RegionView::registered(&desc(addr, len)).unwrap_err().code, ReasonCode::INVALID_ARGUMENT);
    }
}

#[test]
fn the_last_release_of_a_terminal_transfer_hands_its_data_back() {
    let mut ledger = TransferLedger::new();
    ledger.admit(XferId(1), admission(None), vec![1u64, 2]).unwrap();
    assert!(ledger.hold(XferId(1)) && ledger.hold(XferId(1)));
    assert_eq!(ledger.release(XferId(1)), None, "still held");
    assert_eq!(ledger.release(XferId(1)), None, "live: stays");
    assert!(ledger.hold(XferId(1)));
    assert!(ledger.succeed(XferId(1)));
    assert_eq!(ledger.release(XferId(1)), Some(vec![1, 2]));
    assert!(ledger.is_empty());
}

#[test]
fn only_terminal_transfers_are_forgotten_and_without_an_event() {
    let mut ledger = TransferLedger::new();
    ledger.admit(XferId(1), admission(None), ()).unwrap();
    ledger.admit(XferId(2), admission(None), ()).unwrap();
    assert!(ledger.hold(XferId(1)) && ledger.hold(XferId(2)));
    ledger.fail(XferId(1), ReasonCode::SHUTDOWN, "s");
    ledger.take_events();
    assert_eq!(ledger.forget_terminal(XferId(2)), None, "a live transfer must get its terminal event");
    assert_eq!(ledger.forget_terminal(XferId(1)), Some(()));
    assert_eq!(ledger.unquiesced_transfers(), 0);
    assert!(events(&mut ledger).is_empty(), "no QUIESCED for a forgotten transfer");
    assert!(ledger.is_live(XferId(2)));
    ledger.release(XferId(2));
    ledger.succeed(XferId(2));
}

#[test]
fn take_due_lists_due_transfers_without_failing_them() {
    let t0 = Instant::now();
    let mut ledger = TransferLedger::new();
    ledger.admit(XferId(1), admission(Some(t0)), ()).unwrap();
    let due = ledger.take_due(t0);
    assert_eq!(due.timed_out, vec![XferId(1)]);
    assert!(ledger.is_live(XferId(1)) && !ledger.has_events(), "the caller fails it");
    assert_eq!(ledger.fail(XferId(1), ReasonCode::TIMEOUT, "t"), Failure::FailedQuiesced);
    assert!(ledger.take_due(t0 + Duration::from_secs(1)).timed_out.is_empty(), "listed once");
}

#[test]
fn a_deadline_set_after_admission_replaces_the_first_and_says_when_it_is_the_earliest() {
    let t0 = Instant::now();
    let mut ledger = TransferLedger::new();
    ledger.admit(XferId(1), admission(Some(t0 + Duration::from_millis(10))), ()).unwrap();
    ledger.admit(XferId(2), admission(None), ()).unwrap();
    assert!(!ledger.set_deadline(XferId(2), t0 + Duration::from_millis(20)), "not before the first");
    assert!(ledger.set_deadline(XferId(1), t0 + Duration::from_millis(5)), "the new earliest");
    assert!(!ledger.set_deadline(XferId(1), t0 + Duration::from_millis(30)), "a later one is not the earliest");
    // Only the latest deadline of transfer 1 counts.
    assert!(ledger.expire(t0 + Duration::from_millis(10), no_message).timed_out.is_empty());
    assert_eq!(ledger.expire(t0 + Duration::from_millis(20), no_message).timed_out, vec![XferId(2)]);
    assert_eq!(ledger.expire(t0 + Duration::from_millis(30), no_message).timed_out, vec![XferId(1)]);
    assert!(!ledger.set_deadline(XferId(1), t0), "terminal: left alone");
}
