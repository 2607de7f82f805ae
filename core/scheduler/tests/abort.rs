//! Abort as a core transition: terminal at once in every state, tombstoned so late counterparts are
//! refused, propagated to the peer, harmless when doubled, late or unknown (counted once).

mod support;
use kvgate_core::*;
use support::*;

fn assert_aborted_now(node: &Node, room: RoomKey) {
    assert_eq!(node.failure(room), Some(FailReason::Aborted), "terminal in the same call as the abort");
    assert_eq!(node.terminal_count(room), 1);
}

// CONFORMANCE: ABORT-6, ABORT-10
#[test]
fn abort_receiver_waiting_for_sender() {
    let mut pair = Pair::new();
    let room = key(1);
    pair.link_up = false;
    pair.expect(room, &[&[(0, 8)]]).unwrap();
    pair.link_up = true;
    pair.abort_decode(room);
    assert_aborted_now(&pair.decode, room);
    // The sender had never seen the room: it records a tombstone and refuses the late send.
    let late = pair.send(room, 0, 0, &[(0, 8)], true).unwrap_err();
    assert_eq!(late.reason, RefusalReason::RoomTerminal);
    // And answered quiesced, so the receiver's memory is reusable at once.
    assert_eq!(pair.decode.reusable(room), Some(ReleaseCause::Quiesced));
}

#[test]
fn abort_sender_holding_chunks() {
    let mut pair = Pair::new();
    let room = key(2);
    pair.send(room, 0, 0, &[(0, 8)], false).unwrap();
    pair.abort_prefill(room);
    assert_aborted_now(&pair.prefill, room);
    assert_eq!(pair.prefill.core.metrics().pending_sends, 0);
    let late = pair.send(room, 0, 1, &[(0, 8)], true).unwrap_err();
    assert_eq!(late.reason, RefusalReason::RoomTerminal);
}

#[test]
fn abort_sender_with_notice_before_any_chunk() {
    let mut pair = Pair::new();
    let room = key(3);
    pair.expect(room, &[&[(0, 8)]]).unwrap();
    assert_eq!(pair.prefill.state(pair.now, room, Role::Sender), Some(RoomState::WaitingSend));
    pair.abort_prefill(room);
    assert_aborted_now(&pair.prefill, room);
    assert_eq!(pair.decode.failure(room), Some(FailReason::AbortedByPeer));
    assert_eq!(pair.decode.reusable(room), Some(ReleaseCause::Quiesced));
}

#[test]
fn abort_mid_transfer_on_either_side_cancels_and_reaches_the_peer() {
    for abort_on_sender in [true, false] {
        let mut pair = Pair::new();
        pair.auto_complete = false;
        let room = key(4);
        pair.expect(room, &[&[(0, 64)]]).unwrap();
        pair.send(room, 0, 0, &[(0, 32)], false).unwrap();
        if abort_on_sender {
            pair.abort_prefill(room);
            assert_aborted_now(&pair.prefill, room);
            assert_eq!(pair.decode.failure(room), Some(FailReason::AbortedByPeer));
        } else {
            pair.abort_decode(room);
            assert_aborted_now(&pair.decode, room);
            assert_eq!(pair.prefill.failure(room), Some(FailReason::AbortedByPeer));
        }
        assert_eq!(pair.prefill.cancels.len(), 1);
        // The cancel was answered with FAILED+quiesced: both sides reusable.
        assert_eq!(pair.prefill.reusable(room), Some(ReleaseCause::Quiesced));
        assert_eq!(pair.decode.reusable(room), Some(ReleaseCause::Quiesced));
        // A completion arriving later changes nothing.
        assert_eq!(pair.decode.terminal_count(room), 1);
    }
}

#[test]
fn abort_in_quarantine_and_after_success_is_harmless_and_counted_once() {
    // CONFORMANCE: ABORT-7
    let mut pair = Pair::new();
    pair.auto_complete = false;
    pair.cancel_answers = false;
    let room = key(5);
    pair.expect(room, &[&[(0, 64)]]).unwrap();
    pair.send(room, 0, 0, &[(0, 64)], true).unwrap();
    pair.abort_prefill(room);
    assert_eq!(pair.prefill.state(pair.now, room, Role::Sender), Some(RoomState::Quarantined));
    pair.abort_prefill(room);
    pair.abort_prefill(room);
    let metrics = pair.prefill.core.metrics();
    assert_eq!(metrics.aborts, 1);
    assert_eq!(metrics.aborts_harmless[HarmlessAbort::Duplicate.index()], 2);
    assert_eq!(pair.prefill.terminal_count(room), 1);

    let done = key(6);
    pair.auto_complete = true;
    pair.expect(done, &[&[(100, 8)]]).unwrap();
    pair.send(done, 0, 0, &[(0, 8)], true).unwrap();
    pair.abort_decode(done);
    assert_eq!(pair.decode.terminal(done), Some(Outcome::Succeeded));
    assert_eq!(pair.decode.core.metrics().aborts_harmless[HarmlessAbort::AfterTerminal.index()], 1);
}

#[test]
fn abort_of_an_unknown_room_is_counted_once_and_refuses_the_late_counterparts() {
    let mut pair = Pair::new();
    let room = key(7);
    let result = pair.prefill.core.handle_engine(pair.now, EngineRequest::Abort { room, role: None });
    assert!(result.is_ok());
    pair.drive();
    let metrics = pair.prefill.core.metrics();
    assert_eq!(metrics.aborts_harmless[HarmlessAbort::Unknown.index()], 1);
    assert_eq!(metrics.aborts, 0);
    assert_eq!(pair.send(room, 0, 0, &[(0, 8)], true).unwrap_err().reason, RefusalReason::RoomTerminal);
    // The receiver's expect reaches a tombstone: the sender tells it at once.
    pair.expect(room, &[&[(0, 8)]]).unwrap();
    assert_eq!(pair.decode.failure(room), Some(FailReason::AbortedByPeer));
    assert!(pair.prefill.core.metrics().late_messages[LateSource::Peer.index()] >= 1);
}

#[test]
fn failed_room_abort_counts_after_terminal() {
    let mut pair = Pair::new();
    let room = key(8);
    pair.send(room, 0, 0, &[(0, 8)], true).unwrap();
    pair.advance_ms(10_000);
    assert_eq!(pair.prefill.failure(room), Some(FailReason::BootstrapTimeout));
    pair.abort_prefill(room);
    assert_eq!(pair.prefill.core.metrics().aborts_harmless[HarmlessAbort::AfterTerminal.index()], 1);
    assert_eq!(pair.prefill.failure(room), Some(FailReason::BootstrapTimeout));
}

/// The SGLang/NIXL silent pin: the decode side aborts before the prefill side registered the room,
/// and the plugin never answers anything. The room must still be terminal at once (well within the
/// abort grace), and the late counterpart must be refused, never re-creating the room.
#[test]
fn sglang_silent_pin_abort_before_peer_registered() {
    // CONFORMANCE: ABORT-6, ABORT-1
    let mut pair = Pair::new();
    pair.auto_complete = false;
    pair.cancel_answers = false;
    let room = key(9);
    pair.expect(room, &[&[(0, 4096)]]).unwrap();
    // The prefill engine has not registered the room; only the notice arrived there.
    let before = pair.now;
    pair.abort_decode(room);
    assert_eq!(pair.now, before, "no time needed: the abort is a core transition");
    assert_aborted_now(&pair.decode, room);
    assert_eq!(pair.prefill.failure(room), Some(FailReason::AbortedByPeer));
    // The late counterpart (the prefill engine's send) is refused and counted, not re-created.
    let late = pair.send(room, 0, 0, &[(0, 4096)], true).unwrap_err();
    assert_eq!(late.reason, RefusalReason::RoomTerminal);
    assert!(pair.prefill.submits.is_empty(), "no byte moves for an aborted room");
    assert_eq!(pair.prefill.core.metrics().late_messages[LateSource::Engine.index()], 1);
    assert_eq!(pair.prefill.core.live_rooms(), 0);
    assert_eq!(pair.decode.core.live_rooms(), 0);
    // Nothing stays pinned: both sides settle, and the tombstones expire.
    pair.advance_ms(120_000);
    assert_eq!(pair.decode.core.held_rooms(), 0);
    assert_eq!(pair.prefill.core.held_rooms(), 0);
    assert_eq!(pair.decode.core.metrics().quarantined_bytes, 0);
}

#[test]
fn abort_before_the_notice_reaches_the_sender_then_late_notice_is_answered() {
    let mut pair = Pair::new();
    let room = key(10);
    // The prefill engine aborts a room it has never seen.
    pair.prefill.core.handle_engine(pair.now, EngineRequest::Abort { room, role: Some(Role::Sender) }).unwrap();
    pair.drive();
    pair.expect(room, &[&[(0, 8)]]).unwrap();
    assert_eq!(pair.decode.failure(room), Some(FailReason::AbortedByPeer));
    assert_eq!(pair.prefill.core.live_rooms(), 0);
}
