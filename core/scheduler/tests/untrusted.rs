//! Never trust a plugin or a peer: unknown, duplicate and late events are counted per clause, an
//! unknown kind or reason fails the room `plugin_protocol_violation`, peer loss fails every room of
//! that peer at once, and quarantine waits for a real quiesce.

mod support;
use kvgate_abi::{event_flags, EventKind};
use kvgate_core::*;
use support::*;

fn transferring_pair(room: RoomKey) -> (Pair, u64) {
    let mut pair = Pair::new();
    pair.auto_complete = false;
    pair.expect(room, &[&[(0, 64)]]).unwrap();
    pair.send(room, 0, 0, &[(0, 64)], true).unwrap();
    let xfer = pair.prefill.live_submits()[0];
    (pair, xfer)
}

fn violations(pair: &Pair, clause: ViolationClause) -> u64 {
    pair.prefill.core.metrics().violation(clause)
}

// CONFORMANCE: ABORT-9
#[test]
fn unknown_event_kind_fails_the_room_never_keeps_waiting() {
    let room = key(1);
    let (mut pair, xfer) = transferring_pair(room);
    let mut event = Event::progress(XferId(xfer), 1);
    event.kind = EventKind(99);
    pair.plugin_event(event);
    assert_eq!(pair.prefill.failure(room), Some(FailReason::PluginProtocolViolation));
    assert_eq!(violations(&pair, ViolationClause::UnknownEventKind), 1);
    assert_eq!(pair.decode.failure(room), Some(FailReason::SenderFailed));
}

#[test]
fn unknown_reason_code_is_a_protocol_violation() {
    let room = key(2);
    let (mut pair, xfer) = transferring_pair(room);
    pair.prefill.submits.clear();
    pair.plugin_event(Event::failed_quiesced(XferId(xfer), ReasonCode(4242), "??"));
    assert_eq!(pair.prefill.failure(room), Some(FailReason::PluginProtocolViolation));
    assert_eq!(violations(&pair, ViolationClause::UnknownReasonCode), 1);
}

#[test]
fn event_for_a_transfer_never_submitted_is_counted_and_changes_nothing() {
    let room = key(3);
    let (mut pair, _xfer) = transferring_pair(room);
    pair.plugin_event(Event::succeeded(XferId(987_654), 64));
    assert_eq!(violations(&pair, ViolationClause::UnknownXfer), 1);
    assert_eq!(pair.prefill.terminal(room), None);
    // Reported as found: the plugin and its event, and no room (the id names none).
    let reported = Violation {
        clause: ViolationClause::UnknownXfer,
        plugin: Some(SLOT),
        event: Some("succeeded"),
        xfer: 987_654,
        room: None,
        count: 1,
    };
    assert_eq!(pair.prefill.violations, [reported]);
}

#[test]
fn second_terminal_event_is_a_violation() {
    let room = key(4);
    let mut pair = Pair::new();
    pair.auto_complete = false;
    pair.expect(room, &[&[(0, 64)]]).unwrap();
    pair.send(room, 0, 0, &[(0, 32)], false).unwrap();
    let first = pair.prefill.live_submits()[0];
    pair.complete(first);
    pair.drive();
    pair.plugin_event(Event::succeeded(XferId(first), 32));
    assert_eq!(violations(&pair, ViolationClause::DuplicateEvent), 1);
    assert_eq!(pair.prefill.failure(room), Some(FailReason::PluginProtocolViolation));
    // Reported with the room the transfer belongs to.
    let reported = Violation {
        clause: ViolationClause::DuplicateEvent,
        plugin: Some(SLOT),
        event: Some("succeeded"),
        xfer: first,
        room: Some((room, Role::Sender)),
        count: 1,
    };
    assert_eq!(pair.prefill.violations, [reported]);
}

#[test]
fn succeeded_with_the_wrong_byte_count_is_not_success() {
    let room = key(5);
    let (mut pair, xfer) = transferring_pair(room);
    pair.prefill.submits.clear();
    pair.plugin_event(Event::succeeded(XferId(xfer), 63));
    assert_eq!(violations(&pair, ViolationClause::SucceededBytesMismatch), 1);
    assert_eq!(pair.prefill.failure(room), Some(FailReason::PluginProtocolViolation));
}

#[test]
fn quiesced_before_terminal_and_wrong_plugin_are_counted() {
    let room = key(6);
    let (mut pair, xfer) = transferring_pair(room);
    pair.prefill.core.handle_plugin_event(pair.now, PluginSlot(7), &Event::succeeded(XferId(xfer), 64));
    assert_eq!(violations(&pair, ViolationClause::WrongPlugin), 1);
    assert_eq!(pair.prefill.terminal(room), None);
    pair.prefill.submits.clear();
    pair.plugin_event(Event::quiesced(XferId(xfer)));
    assert_eq!(violations(&pair, ViolationClause::QuiescedBeforeTerminal), 1);
    assert_eq!(pair.prefill.failure(room), Some(FailReason::PluginProtocolViolation));
}

#[test]
fn late_completion_after_abort_does_not_revive_the_room() {
    // CONFORMANCE: ABORT-5
    let room = key(7);
    let (mut pair, xfer) = transferring_pair(room);
    pair.cancel_answers = false;
    pair.abort_prefill(room);
    pair.complete(xfer);
    pair.drive();
    assert_eq!(pair.prefill.failure(room), Some(FailReason::Aborted));
    assert_eq!(pair.prefill.terminal_count(room), 1);
    // The success proves no byte is still landing: the quarantine is released.
    assert_eq!(pair.prefill.reusable(room), Some(ReleaseCause::Quiesced));
    assert_eq!(pair.prefill.core.metrics().violations_total(), 0);
}

#[test]
fn sender_quarantine_waits_for_a_separate_quiesced() {
    // CONFORMANCE: RES-4
    let room = key(8);
    let (mut pair, xfer) = transferring_pair(room);
    pair.prefill.submits.clear();
    pair.plugin_event(Event::failed(XferId(xfer), ReasonCode::TRANSPORT_ERROR, "reset"));
    assert_eq!(pair.prefill.failure(room), Some(FailReason::PluginFailed));
    assert_eq!(pair.prefill.state(pair.now, room, Role::Sender), Some(RoomState::Quarantined));
    assert_eq!(pair.decode.state(pair.now, room, Role::Receiver), Some(RoomState::Quarantined));
    assert_eq!(pair.decode.core.metrics().quarantined_bytes, 64);
    pair.plugin_event(Event::quiesced(XferId(xfer)));
    assert_eq!(pair.prefill.reusable(room), Some(ReleaseCause::Quiesced));
    // The sender's Quiesced notice releases the receiver.
    assert_eq!(pair.decode.reusable(room), Some(ReleaseCause::Quiesced));
    assert_eq!(pair.decode.core.metrics().quarantined_bytes, 0);
}

#[test]
fn receiver_enforced_plugin_releases_quarantine_without_the_peer() {
    let room = key(9);
    let (mut pair, _xfer) = transferring_pair(room);
    pair.link_up = false;
    pair.receiver_enforced = true;
    pair.abort_decode(room);
    assert_eq!(pair.decode.failure(room), Some(FailReason::Aborted));
    assert_eq!(pair.decode.reusable(room), Some(ReleaseCause::Quiesced));
}

#[test]
fn incoming_failed_fails_the_receiver_room() {
    let room = key(10);
    let (mut pair, _xfer) = transferring_pair(room);
    let ticket = pair.decode.tickets_opened[0];
    let event = Event::incoming_failed(PREFILL_ID, ticket, ReasonCode::NOT_EXPECTED, "no ticket");
    pair.decode.core.handle_plugin_event(pair.now, SLOT, &event);
    pair.drive();
    let Some(Outcome::Failed(failure)) = pair.decode.terminal(room) else { panic!() };
    assert_eq!(failure.reason, FailReason::IncomingFailed);
    assert_eq!(failure.plugin_reason_str(), Some("not_expected"));
    assert_eq!(pair.prefill.failure(room), Some(FailReason::ReceiverFailed));
}

#[test]
fn unknown_ticket_is_a_violation() {
    let mut pair = Pair::new();
    let event = Event::incoming_quiesced(PREFILL_ID, Ticket(9_999));
    pair.decode.core.handle_plugin_event(pair.now, SLOT, &event);
    assert_eq!(pair.decode.core.metrics().violation(ViolationClause::UnknownTicket), 1);
    let mut flagged = Event::quiesced(XferId(1));
    flagged.flags = event_flags::INCOMING;
    pair.decode.core.handle_plugin_event(pair.now, SLOT, &flagged);
    assert_eq!(pair.decode.core.live_rooms(), 0);
}

// CONFORMANCE: TIME-7
#[test]
fn peer_lost_fails_every_room_of_that_peer_at_once() {
    let mut pair = Pair::new();
    pair.auto_complete = false;
    for n in 0..5 {
        pair.expect(key(100 + n), &[&[(n * 100, 64)]]).unwrap();
    }
    pair.send(key(100), 0, 0, &[(0, 64)], true).unwrap();
    // A room with another peer is untouched.
    pair.decode.core.handle_peer_up(pair.now, PeerId(77), 1, SLOT);
    pair.decode
        .core
        .handle_engine(
            pair.now,
            EngineRequest::Expect {
                room: key(200),
                peer: PeerId(77),
                parts: vec![slices(DST_REGION, &[(0, 8)])],
                timeout_ms: None,
            },
        )
        .unwrap();
    pair.link_up = false;
    pair.drive();
    pair.decode.core.handle_peer_lost(pair.now, PREFILL_ID, PeerLoss::HeartbeatTimeout);
    pair.prefill.core.handle_peer_lost(pair.now, DECODE_ID, PeerLoss::HeartbeatTimeout);
    pair.drive();
    for n in 0..5 {
        assert_eq!(pair.decode.failure(key(100 + n)), Some(FailReason::PeerLost));
    }
    assert_eq!(pair.prefill.failure(key(100)), Some(FailReason::PeerLost));
    assert_eq!(pair.decode.terminal(key(200)), None);
    assert_eq!(pair.decode.core.live_rooms(), 1);
    // A new expect to the lost peer is refused until it is back.
    let refused = pair.expect(key(300), &[&[(0, 8)]]).unwrap_err();
    assert_eq!(refused.reason, RefusalReason::PeerNotConnected);
}

#[test]
fn a_new_incarnation_of_a_peer_fails_the_old_rooms() {
    // CONFORMANCE: HANDSHAKE-2
    let mut pair = Pair::new();
    pair.expect(key(1), &[&[(0, 8)]]).unwrap();
    pair.decode.core.handle_peer_up(pair.now, PREFILL_ID, 2, SLOT);
    pair.drive();
    assert_eq!(pair.decode.failure(key(1)), Some(FailReason::PeerLost));
}

#[test]
fn plugin_peer_down_and_unhealthy_fail_rooms_fast() {
    // CONFORMANCE: TIME-10
    let (mut pair, _xfer) = transferring_pair(key(1));
    pair.plugin_event(Event::peer_down(DECODE_ID, ReasonCode::PEER_LOST, "gone"));
    assert_eq!(pair.prefill.failure(key(1)), Some(FailReason::PeerLost));
    let (mut pair, _xfer) = transferring_pair(key(2));
    pair.plugin_event(Event::unhealthy(ReasonCode::INTERNAL, "worker died"));
    assert_eq!(pair.prefill.failure(key(2)), Some(FailReason::PluginFailed));
}

#[test]
fn late_peer_messages_are_counted_and_never_touch_another_room() {
    // CONFORMANCE: ABORT-8
    let mut pair = Pair::new();
    pair.expect(key(1), &[&[(0, 8)]]).unwrap();
    pair.decode.core.handle_peer_message(
        pair.now,
        PREFILL_ID,
        &PeerMessage::PartDone { room: key(2), part: 0, bytes: 8 },
    );
    pair.decode.core.handle_peer_message(pair.now, PREFILL_ID, &PeerMessage::Matched { room: RoomKey::new(1, 5) });
    pair.decode.core.handle_peer_message(
        pair.now,
        PeerId(55),
        &PeerMessage::PartDone { room: key(1), part: 0, bytes: 8 },
    );
    pair.decode.core.handle_peer_message(pair.now, PREFILL_ID, &PeerMessage::Quiesced { room: key(1) });
    pair.drive();
    assert_eq!(pair.decode.core.metrics().late_messages[LateSource::Peer.index()], 4);
    assert_eq!(pair.decode.state(pair.now, key(1), Role::Receiver), Some(RoomState::WaitingSender));
    assert_eq!(pair.decode.core.live_rooms(), 1);
}

/// A part done reporting another byte count than the part's destination holds is a peer breaking
/// the protocol: counted, and the part stays undone (never fail-open); the correct report completes
/// the room.
#[test]
fn a_part_done_with_another_byte_count_is_counted_and_changes_nothing() {
    // CONFORMANCE: ABORT-8
    let mut pair = Pair::new();
    pair.expect(key(1), &[&[(0, 8)]]).unwrap();
    for bytes in [0, 7, 9, u64::MAX] {
        pair.decode.core.handle_peer_message(
            pair.now,
            PREFILL_ID,
            &PeerMessage::PartDone { room: key(1), part: 0, bytes },
        );
    }
    pair.drive();
    assert_eq!(pair.decode.core.metrics().late_messages[LateSource::Peer.index()], 4);
    assert_eq!(pair.decode.state(pair.now, key(1), Role::Receiver), Some(RoomState::WaitingSender));
    pair.decode.core.handle_peer_message(
        pair.now,
        PREFILL_ID,
        &PeerMessage::PartDone { room: key(1), part: 0, bytes: 8 },
    );
    pair.drive();
    assert_eq!(pair.decode.core.metrics().late_messages[LateSource::Peer.index()], 4);
    assert_eq!(pair.decode.state(pair.now, key(1), Role::Receiver), Some(RoomState::Succeeded));
}
