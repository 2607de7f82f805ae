//! Every deadline of the timer table, checked just before and at its expiry with a fake clock:
//! bootstrap, transfer (scaled by bytes), room, plugin grace, quarantine and tombstone.
// CONFORMANCE: TIME-6

mod support;
use kvgate_core::*;
use support::*;

#[test]
fn receiver_bootstrap_timeout_fires_at_its_deadline_not_before() {
    let mut pair = Pair::new();
    let room = key(1);
    pair.link_up = false; // the sender never hears of the room
    pair.expect(room, &[&[(0, 8)]]).unwrap();
    pair.advance_ms(9_999);
    assert_eq!(pair.decode.terminal(room), None);
    pair.advance_ms(1);
    let Some(Outcome::Failed(failure)) = pair.decode.terminal(room) else { panic!("bootstrap fired") };
    assert_eq!(failure.reason, FailReason::BootstrapTimeout);
    assert_eq!(failure.phase, Phase::Bootstrap);
    let metrics = pair.decode.core.metrics();
    assert_eq!(metrics.failures[FailReason::BootstrapTimeout.index()][Phase::Bootstrap.index()], 1);
}

#[test]
fn sender_bootstrap_timeout_when_the_expect_never_comes() {
    let mut pair = Pair::new();
    let room = key(2);
    pair.send(room, 0, 0, &[(0, 8)], true).unwrap();
    pair.advance_ms(9_999);
    assert_eq!(pair.prefill.terminal(room), None);
    pair.advance_ms(1);
    assert_eq!(pair.prefill.failure(room), Some(FailReason::BootstrapTimeout));
    assert_eq!(pair.prefill.core.metrics().pending_sends, 0, "held chunks dropped");
    assert_eq!(pair.prefill.reusable(room), Some(ReleaseCause::NothingInFlight));
}

#[test]
fn transfer_timeout_scales_with_bytes() {
    let mut pair = Pair::new();
    pair.auto_complete = false;
    let room = key(3);
    pair.expect(room, &[&[(0, 1_000_000)]]).unwrap();
    pair.send(room, 0, 0, &[(0, 1_000_000)], true).unwrap();
    // 1 000 ms base + 1 MB at 100 MB/s = 1 010 ms.
    pair.advance_ms(1_009);
    assert_eq!(pair.prefill.terminal(room), None);
    pair.advance_ms(1);
    let Some(Outcome::Failed(failure)) = pair.prefill.terminal(room) else { panic!("transfer deadline fired") };
    assert_eq!(failure.reason, FailReason::TransferTimeout);
    assert_eq!(failure.phase, Phase::Transfer);
    assert_eq!(pair.prefill.cancels.len(), 1, "the plugin is told to cancel");
    assert!(pair.decode.terminal(room).is_some(), "the receiver fails too");
}

#[test]
fn room_timeout_from_the_engine_deadline() {
    let mut pair = Pair::new();
    let room = key(4);
    let result = pair.decode.core.handle_engine(
        pair.now,
        EngineRequest::Expect {
            room,
            peer: PREFILL_ID,
            parts: vec![slices(DST_REGION, &[(0, 8)])],
            timeout_ms: Some(500),
        },
    );
    result.unwrap();
    pair.drive();
    pair.advance_ms(499);
    assert_eq!(pair.decode.terminal(room), None);
    pair.advance_ms(1);
    assert_eq!(pair.decode.failure(room), Some(FailReason::RoomTimeout));
    // The sender learned the remaining deadline from the notice and fails at the same time (by its
    // own room timer or by the receiver's RoomFailed, whichever the driver runs first).
    assert!(matches!(pair.prefill.failure(room), Some(FailReason::RoomTimeout | FailReason::ReceiverFailed)));
}

#[test]
fn sender_room_deadline_follows_the_notice() {
    let mut pair = Pair::new();
    pair.link_up = true;
    let room = key(5);
    let parts = vec![slices(DST_REGION, &[(0, 8)])];
    pair.decode
        .core
        .handle_engine(pair.now, EngineRequest::Expect { room, peer: PREFILL_ID, parts, timeout_ms: Some(300) })
        .unwrap();
    pair.link_up = false;
    pair.drive(); // the notice is lost with the link down; deliver it by hand
    let notice = pair.decode.to_peer[0].clone();
    pair.prefill.core.handle_peer_message(pair.now, DECODE_ID, &notice);
    pair.drive();
    pair.advance_ms(300);
    assert_eq!(pair.prefill.failure(room), Some(FailReason::RoomTimeout));
}

#[test]
fn silent_plugin_is_forced_failed_after_grace_and_counted() {
    let mut pair = Pair::new();
    pair.auto_complete = false;
    pair.cancel_answers = false; // the plugin never answers, not even the cancel
    let room = key(6);
    pair.expect(room, &[&[(0, 1_000)]]).unwrap();
    pair.send(room, 0, 0, &[(0, 1_000)], true).unwrap();
    // 1 000 ms + 1 000 B at 100 MB/s = 1 000.01 ms: fires on the next 1 ms tick.
    pair.advance_ms(1_000);
    assert_eq!(pair.prefill.failure(room), None);
    pair.advance_ms(1);
    assert_eq!(pair.prefill.failure(room), Some(FailReason::TransferTimeout));
    assert_eq!(pair.prefill.state(pair.now, room, Role::Sender), Some(RoomState::Quarantined));
    assert_eq!(pair.prefill.core.metrics().violation(ViolationClause::PluginSilent), 0);
    pair.advance_ms(49);
    assert_eq!(pair.prefill.core.metrics().violation(ViolationClause::PluginSilent), 0);
    assert!(pair.prefill.violations.is_empty(), "{:?}", pair.prefill.violations);
    pair.advance_ms(1);
    assert_eq!(pair.prefill.core.metrics().violation(ViolationClause::PluginSilent), 1);
    // Found on a timer, not in a plugin event: the report names the transfer and the room.
    let [silent] = pair.prefill.violations[..] else { panic!("one report: {:?}", pair.prefill.violations) };
    assert_eq!(
        (silent.clause, silent.room, silent.event, silent.count),
        (ViolationClause::PluginSilent, Some((room, Role::Sender)), None, 1)
    );
    assert_eq!(pair.prefill.core.room_of_xfer(XferId(silent.xfer)), Some((room, Role::Sender)));
    assert!(silent.plugin.is_some(), "the room had bound its peer's plugin: {silent:?}");
    // Still quarantined: a silent plugin never proved no byte can land.
    assert_eq!(pair.prefill.state(pair.now, room, Role::Sender), Some(RoomState::Quarantined));
    assert_eq!(pair.prefill.reusable(room), None);
}

#[test]
fn quarantine_is_bounded_by_its_timeout() {
    // CONFORMANCE: RES-4
    let mut pair = Pair::new();
    pair.auto_complete = false;
    pair.cancel_answers = false;
    let room = key(7);
    pair.expect(room, &[&[(0, 1_000)]]).unwrap();
    pair.send(room, 0, 0, &[(0, 1_000)], true).unwrap();
    pair.abort_prefill(room);
    assert_eq!(pair.prefill.failure(room), Some(FailReason::Aborted));
    assert_eq!(pair.prefill.core.metrics().quarantined_bytes, 1_000);
    assert_eq!(pair.decode.state(pair.now, room, Role::Receiver), Some(RoomState::Quarantined));
    // The quarantine has an age, on both sides, from the moment it began.
    let quarantined_at = pair.now;
    for node in [&pair.prefill, &pair.decode] {
        assert_eq!(node.core.metrics().oldest_entered_by_state[RoomState::Quarantined.index()], Some(quarantined_at));
    }
    pair.advance_ms(29_999);
    assert_eq!(pair.prefill.reusable(room), None);
    assert_eq!(pair.decode.reusable(room), None);
    assert_eq!(
        pair.prefill.core.metrics().oldest_entered_by_state[RoomState::Quarantined.index()],
        Some(quarantined_at)
    );
    pair.advance_ms(1);
    assert_eq!(pair.prefill.reusable(room), Some(ReleaseCause::QuarantineTimeout));
    assert_eq!(pair.decode.reusable(room), Some(ReleaseCause::QuarantineTimeout));
    assert_eq!(pair.prefill.core.metrics().quarantined_bytes, 0);
    assert_eq!(pair.prefill.core.metrics().failures_by_reason(FailReason::QuarantineTimeout), 1);
    // Released: no quarantine left to age.
    assert_eq!(pair.prefill.core.metrics().oldest_entered_by_state[RoomState::Quarantined.index()], None);
}

#[test]
fn tombstone_expires_after_its_ttl() {
    let mut pair = Pair::new();
    let room = key(8);
    pair.expect(room, &[&[(0, 8)]]).unwrap();
    pair.send(room, 0, 0, &[(0, 8)], true).unwrap();
    assert_eq!(pair.decode.core.metrics().tombstones, 1);
    pair.advance_ms(59_999);
    assert!(pair.decode.core.room(pair.now, room, Role::Receiver).is_some());
    pair.advance_ms(1);
    assert!(pair.decode.core.room(pair.now, room, Role::Receiver).is_none());
    assert_eq!(pair.decode.core.metrics().tombstones, 0);
    assert_eq!(pair.decode.core.held_rooms(), 0);
    assert_eq!(pair.decode.core.armed_timers(), 0);
    assert_eq!(pair.prefill.core.held_rooms(), 0);
    assert_eq!(pair.prefill.core.armed_timers(), 0);
}

#[test]
fn no_false_timeout_when_the_completion_is_already_observable() {
    // CONFORMANCE: TIME-9
    let mut pair = Pair::new();
    pair.auto_complete = false;
    let room = key(9);
    pair.expect(room, &[&[(0, 1_000)]]).unwrap();
    pair.send(room, 0, 0, &[(0, 1_000)], true).unwrap();
    let xfer = pair.prefill.live_submits()[0];
    // The completion and the deadline arrive at the same instant; the driver feeds events first.
    pair.now = pair.now.saturating_add(Span::from_ms(1_000));
    pair.complete(xfer);
    pair.drive();
    pair.advance_ms(0);
    assert_eq!(pair.prefill.terminal(room), Some(Outcome::Succeeded));
    assert_eq!(pair.decode.terminal(room), Some(Outcome::Succeeded));
}

#[test]
fn poll_timeout_names_the_earliest_deadline() {
    let mut pair = Pair::new();
    assert_eq!(pair.decode.core.poll_timeout(), None);
    pair.expect(key(10), &[&[(0, 8)]]).unwrap();
    let wake = pair.decode.core.poll_timeout().unwrap();
    assert!(wake <= pair.now.saturating_add(Span::from_ms(10_000)));
}
