//! Normal flows over an in-memory pair: both arrival orders, multi-part multi-chunk rooms, the
//! scatter/gather mapping checked byte for byte, and the events engines see.

mod support;
use kvgate_core::*;
use support::*;

#[test]
fn expect_first_then_send_succeeds_on_both_sides() {
    let mut pair = Pair::new();
    let room = key(1);
    pair.expect(room, &[&[(0, 4096)]]).unwrap();
    assert_eq!(pair.decode.state(pair.now, room, Role::Receiver), Some(RoomState::WaitingSender));
    assert_eq!(pair.prefill.state(pair.now, room, Role::Sender), Some(RoomState::WaitingSend));
    pair.send(room, 0, 0, &[(8192, 4096)], true).unwrap();
    assert_eq!(pair.decode.terminal(room), Some(Outcome::Succeeded));
    assert_eq!(pair.prefill.terminal(room), Some(Outcome::Succeeded));
    assert_eq!(pair.decode.reusable(room), Some(ReleaseCause::NothingInFlight));
    assert_eq!(pair.decode_bytes(0, 4096), pair.prefill_bytes(8192, 4096));
    assert_eq!(pair.decode.core.metrics().rooms_succeeded, 1);
    assert_eq!(pair.prefill.core.metrics().bytes_moved, 4096);
    // The receiver revokes its ticket once done.
    assert_eq!(pair.decode.tickets_cancelled, pair.decode.tickets_opened);
}

#[test]
fn send_first_then_expect_succeeds_and_held_chunks_flush_in_order() {
    let mut pair = Pair::new();
    let room = key(2);
    pair.send(room, 0, 0, &[(0, 100)], false).unwrap();
    pair.send(room, 0, 1, &[(1000, 50)], true).unwrap();
    assert_eq!(pair.prefill.state(pair.now, room, Role::Sender), Some(RoomState::WaitingExpect));
    assert_eq!(pair.prefill.core.metrics().pending_sends, 2);
    pair.expect(room, &[&[(500, 150)]]).unwrap();
    assert_eq!(pair.decode.terminal(room), Some(Outcome::Succeeded));
    assert_eq!(pair.prefill.terminal(room), Some(Outcome::Succeeded));
    assert_eq!(pair.prefill.core.metrics().pending_sends, 0);
    assert_eq!(pair.decode_bytes(500, 100), pair.prefill_bytes(0, 100));
    assert_eq!(pair.decode_bytes(600, 50), pair.prefill_bytes(1000, 50));
}

#[test]
fn multi_part_multi_chunk_scatter_gather_lands_every_byte() {
    let mut pair = Pair::new();
    let room = key(3);
    // Part 0: three destination slices; part 1: one. Chunks cut across slice boundaries.
    pair.expect(room, &[&[(0, 10), (100, 7), (200, 13)], &[(4000, 30)]]).unwrap();
    pair.auto_complete = false;
    pair.send(room, 0, 0, &[(50, 4), (60, 8)], false).unwrap();
    pair.send(room, 1, 0, &[(300, 30)], true).unwrap();
    pair.send(room, 0, 1, &[(70, 9), (90, 9)], true).unwrap();
    assert_eq!(pair.prefill.submits.len(), 3);
    let segments: usize = pair.prefill.submits.values().map(|s| s.segments.len()).sum();
    assert_eq!(segments, 3 + 1 + 3, "split at both sides' boundaries");
    assert_eq!(pair.decode.terminal(room), None);
    for xfer in pair.prefill.live_submits() {
        pair.complete(xfer);
    }
    pair.drive();
    assert_eq!(pair.decode.terminal(room), Some(Outcome::Succeeded));
    let source: Vec<u8> = [(50u64, 4u64), (60, 8), (70, 9), (90, 9)]
        .iter()
        .flat_map(|&(o, l)| pair.prefill_bytes(o, l).to_vec())
        .collect();
    let dest: Vec<u8> =
        [(0u64, 10u64), (100, 7), (200, 13)].iter().flat_map(|&(o, l)| pair.decode_bytes(o, l).to_vec()).collect();
    assert_eq!(source, dest);
    assert_eq!(pair.decode_bytes(4000, 30), pair.prefill_bytes(300, 30));
    let part_events = pair.decode.events.iter().filter(|e| matches!(e, RoomEvent::PartSucceeded { .. })).count();
    assert_eq!(part_events, 2);
}

#[test]
fn room_fails_when_one_part_fails_and_first_cause_wins() {
    // CONFORMANCE: ABORT-5
    let mut pair = Pair::new();
    let room = key(4);
    pair.expect(room, &[&[(0, 10)], &[(10, 10)]]).unwrap();
    pair.auto_complete = false;
    pair.send(room, 0, 0, &[(0, 10)], true).unwrap();
    pair.send(room, 1, 0, &[(0, 10)], true).unwrap();
    let xfers = pair.prefill.live_submits();
    pair.complete(xfers[0]);
    pair.fail(xfers[1], ReasonCode::TRANSPORT_ERROR);
    pair.drive();
    let Some(Outcome::Failed(failure)) = pair.prefill.terminal(room) else { panic!("sender failed") };
    assert_eq!(failure.reason, FailReason::PluginFailed);
    assert_eq!(failure.plugin_reason_str(), Some("transport_error"));
    assert_eq!(failure.phase, Phase::Transfer);
    // CONFORMANCE: TIME-8
    let Some(Outcome::Failed(receiver)) = pair.decode.terminal(room) else { panic!("receiver failed") };
    assert_eq!(receiver.reason, FailReason::SenderFailed);
    assert_eq!(receiver.peer_reason, Some(FailReason::PluginFailed));
    assert_eq!(pair.prefill.terminal_count(room), 1);
    // A later timer or abort does not change the reported cause.
    pair.abort_prefill(room);
    pair.advance_ms(120_000);
    assert_eq!(pair.prefill.terminal_count(room), 1);
    assert_eq!(pair.prefill.failure(room), Some(FailReason::PluginFailed));
}

#[test]
fn engines_see_state_changes_then_exactly_one_terminal_and_one_reusable() {
    let mut pair = Pair::new();
    let room = key(5);
    pair.expect(room, &[&[(0, 64)]]).unwrap();
    pair.send(room, 0, 0, &[(0, 64)], true).unwrap();
    for node in [&pair.decode, &pair.prefill] {
        let kinds: Vec<&str> = node
            .events
            .iter()
            .map(|e| match e {
                RoomEvent::StateChanged { .. } => "state",
                RoomEvent::PartSucceeded { .. } => "part",
                RoomEvent::Terminal { .. } => "terminal",
                RoomEvent::Reusable { .. } => "reusable",
            })
            .collect();
        assert_eq!(kinds.iter().filter(|k| **k == "terminal").count(), 1);
        assert_eq!(kinds.last(), Some(&"reusable"));
        assert_eq!(kinds[kinds.len() - 2], "terminal");
    }
}

#[test]
fn submit_timeout_and_ticket_are_passed_to_the_plugin() {
    let mut pair = Pair::new();
    pair.auto_complete = false;
    let room = key(6);
    pair.expect(room, &[&[(0, 1_000_000)]]).unwrap();
    pair.send(room, 0, 0, &[(0, 1_000_000)], true).unwrap();
    let submitted = pair.prefill.submits.values().next().unwrap().clone();
    assert_eq!(submitted.ticket, pair.decode.tickets_opened[0]);
    // transfer_base_ms 1000 + 1 MB / 100 MB/s = 1010 ms.
    assert_eq!(submitted.timeout, Span::from_ms(1_010));
}

#[test]
fn a_new_generation_starts_clean_and_the_old_one_is_refused_as_late() {
    // CONFORMANCE: ABORT-8
    let mut pair = Pair::new();
    pair.expect(RoomKey::new(7, 0), &[&[(0, 8)]]).unwrap();
    pair.send(RoomKey::new(7, 0), 0, 0, &[(0, 8)], true).unwrap();
    pair.expect(RoomKey::new(7, 1), &[&[(0, 8)]]).unwrap();
    let late = pair.send(RoomKey::new(7, 0), 0, 0, &[(0, 8)], true);
    assert!(late.is_err());
    pair.send(RoomKey::new(7, 1), 0, 0, &[(0, 8)], true).unwrap();
    assert_eq!(pair.decode.terminal(RoomKey::new(7, 1)), Some(Outcome::Succeeded));
    let stale = pair.expect(RoomKey::new(7, 0), &[&[(0, 8)]]);
    assert_eq!(stale.unwrap_err().reason, RefusalReason::StaleGeneration);
    assert!(pair.decode.core.metrics().late_messages[LateSource::Engine.index()] >= 1);
}

#[test]
fn a_newer_generation_supersedes_a_live_older_one() {
    let mut pair = Pair::new();
    pair.expect(RoomKey::new(8, 0), &[&[(0, 8)]]).unwrap();
    pair.expect(RoomKey::new(8, 1), &[&[(0, 8)]]).unwrap();
    assert_eq!(pair.decode.failure(RoomKey::new(8, 0)), Some(FailReason::Superseded));
    pair.send(RoomKey::new(8, 1), 0, 0, &[(0, 8)], true).unwrap();
    assert_eq!(pair.decode.terminal(RoomKey::new(8, 1)), Some(Outcome::Succeeded));
}

#[test]
fn room_view_shows_state_age_peer_and_deadline() {
    let mut pair = Pair::new();
    let room = key(9);
    pair.expect(room, &[&[(0, 8)]]).unwrap();
    pair.advance_ms(5);
    let view = pair.decode.core.room(pair.now, room, Role::Receiver).unwrap();
    assert_eq!(view.state, RoomState::WaitingSender);
    assert_eq!(view.age, Span::from_ms(5));
    assert_eq!(view.peer, Some(PREFILL_ID.0));
    assert_eq!(view.plugin, Some(SLOT));
    assert_eq!(view.last_event, LastEvent::Expect);
    // Bootstrap (10 s) comes before the room deadline (60 s).
    assert_eq!(view.next_deadline, Some(At::from_origin(Span::from_ms(1_000 + 10_000))));
    assert_eq!(pair.decode.core.rooms(pair.now).count(), 1);
}
