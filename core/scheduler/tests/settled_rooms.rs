//! What a settled room (a tombstone) still answers: late plugin events for its transfers and tickets
//! are classified by the state each one was left in (late, or a violation by clause), late peer
//! messages and engine requests are refused as for any terminal room, its admin view stays whole,
//! and once it is evicted or expired its ids are only late and its key is free.

mod support;
use kvgate_abi::{EventKind, ReasonCode};
use kvgate_core::*;
use support::*;

fn violations(core: &Core, clause: ViolationClause) -> u64 {
    core.metrics().violation(clause)
}

fn late(core: &Core, source: LateSource) -> u64 {
    core.metrics().late_messages[source.index()]
}

/// A pair with `rooms` sender rooms each holding one 64-byte transfer in flight (no plugin answer),
/// then aborted on the prefill side and left until their quarantine timer settles them.
fn settled_with_transfers_unanswered(config: CoreConfig, rooms: u64) -> (Pair, Vec<u64>) {
    let quarantine_ms = config.quarantine_timeout_ms;
    let mut pair = Pair::with_config(config);
    pair.auto_complete = false;
    pair.cancel_answers = false;
    let mut xfers = Vec::new();
    for n in 1..=rooms {
        pair.expect(key(n), &[&[(n * 64, 64)]]).unwrap();
        pair.send(key(n), 0, 0, &[(n * 64, 64)], true).unwrap();
        let xfer = *pair.prefill.live_submits().iter().max().unwrap();
        xfers.push(xfer);
        pair.abort_prefill(key(n));
        assert_eq!(pair.prefill.state(pair.now, key(n), Role::Sender), Some(RoomState::Quarantined));
    }
    pair.advance_ms(quarantine_ms + 1);
    for n in 1..=rooms {
        assert_eq!(pair.prefill.reusable(key(n)), Some(ReleaseCause::QuarantineTimeout));
        assert_eq!(pair.prefill.state(pair.now, key(n), Role::Sender), Some(RoomState::Failed));
    }
    (pair, xfers)
}

#[test]
fn late_events_for_a_settled_transfer_still_in_flight_are_classified_by_its_state() {
    let config = CoreConfig { plugin_grace_ms: 3_600_000, quarantine_timeout_ms: 1_000, ..CoreConfig::default() };
    let (mut pair, xfers) = settled_with_transfers_unanswered(config, 4);
    let core = |pair: &Pair| pair.prefill.core.metrics().clone();
    let moved_before = core(&pair).bytes_moved;
    // Room 1: progress while in flight is fine; a success is counted and shows in the view.
    pair.plugin_event(Event::progress(XferId(xfers[0]), 1));
    assert_eq!(pair.prefill.core.metrics().violations_total(), 0);
    pair.prefill.core.handle_plugin_event(pair.now, PluginSlot(7), &Event::succeeded(XferId(xfers[0]), 64));
    assert_eq!(violations(&pair.prefill.core, ViolationClause::WrongPlugin), 1);
    pair.plugin_event(Event::succeeded(XferId(xfers[0]), 64));
    assert_eq!(core(&pair).bytes_moved, moved_before + 64);
    let view = pair.prefill.core.room(pair.now, key(1), Role::Sender).unwrap();
    assert_eq!((view.state, view.bytes_done, view.bytes_total), (RoomState::Failed, 64, 64));
    assert_eq!(view.failure.map(|f| f.reason), Some(FailReason::Aborted));
    pair.plugin_event(Event::succeeded(XferId(xfers[0]), 64));
    pair.plugin_event(Event::quiesced(XferId(xfers[0])));
    assert_eq!(violations(&pair.prefill.core, ViolationClause::DuplicateEvent), 2);
    pair.plugin_event(Event::progress(XferId(xfers[0]), 1));
    assert_eq!(violations(&pair.prefill.core, ViolationClause::EventAfterTerminal), 1);
    pair.plugin_event(Event::failed(XferId(xfers[0]), ReasonCode(4242), "??"));
    assert_eq!(violations(&pair.prefill.core, ViolationClause::UnknownReasonCode), 1);
    assert_eq!(violations(&pair.prefill.core, ViolationClause::DuplicateEvent), 3);
    let mut unknown = Event::progress(XferId(xfers[0]), 1);
    unknown.kind = EventKind(99);
    pair.plugin_event(unknown);
    assert_eq!(violations(&pair.prefill.core, ViolationClause::UnknownEventKind), 1);
    // Room 2: failed without quiesce, then quiesced once (fine), then again (a duplicate).
    pair.plugin_event(Event::failed(XferId(xfers[1]), ReasonCode::TRANSPORT_ERROR, "reset"));
    pair.plugin_event(Event::quiesced(XferId(xfers[1])));
    assert_eq!(violations(&pair.prefill.core, ViolationClause::DuplicateEvent), 3);
    pair.plugin_event(Event::quiesced(XferId(xfers[1])));
    assert_eq!(violations(&pair.prefill.core, ViolationClause::DuplicateEvent), 4);
    // Room 3: quiesced before any terminal event; room 4: success with the wrong byte count.
    pair.plugin_event(Event::quiesced(XferId(xfers[2])));
    assert_eq!(violations(&pair.prefill.core, ViolationClause::QuiescedBeforeTerminal), 1);
    pair.plugin_event(Event::succeeded(XferId(xfers[3]), 63));
    assert_eq!(violations(&pair.prefill.core, ViolationClause::SucceededBytesMismatch), 1);
    assert_eq!(core(&pair).bytes_moved, moved_before + 64);
    let view = pair.prefill.core.room(pair.now, key(4), Role::Sender).unwrap();
    assert_eq!(view.bytes_done, 0);
    // None of this is late, and no room changed state.
    assert_eq!(late(&pair.prefill.core, LateSource::Plugin), 0);
    for n in 1..=4 {
        assert_eq!(pair.prefill.state(pair.now, key(n), Role::Sender), Some(RoomState::Failed));
        assert_eq!(pair.prefill.terminal_count(key(n)), 1);
    }
    assert_eq!(pair.prefill.core.live_rooms(), 0);
    assert_eq!(pair.prefill.core.metrics().tombstones, 4);
}

#[test]
fn late_events_for_a_settled_transfer_forced_silent_are_late() {
    let config = CoreConfig { plugin_grace_ms: 100, quarantine_timeout_ms: 1_000, ..CoreConfig::default() };
    let (mut pair, xfers) = settled_with_transfers_unanswered(config, 2);
    assert_eq!(violations(&pair.prefill.core, ViolationClause::PluginSilent), 2);
    let moved_before = pair.prefill.core.metrics().bytes_moved;
    pair.plugin_event(Event::succeeded(XferId(xfers[0]), 64));
    assert_eq!(late(&pair.prefill.core, LateSource::Plugin), 1);
    assert_eq!(pair.prefill.core.metrics().bytes_moved, moved_before, "a forced transfer's late success moves nothing");
    pair.plugin_event(Event::failed_quiesced(XferId(xfers[0]), ReasonCode::CANCELLED, "late"));
    assert_eq!(violations(&pair.prefill.core, ViolationClause::DuplicateEvent), 1);
    pair.plugin_event(Event::failed(XferId(xfers[1]), ReasonCode::CANCELLED, "late"));
    assert_eq!(late(&pair.prefill.core, LateSource::Plugin), 2);
    pair.plugin_event(Event::failed_quiesced(XferId(xfers[1]), ReasonCode::CANCELLED, "late"));
    assert_eq!(late(&pair.prefill.core, LateSource::Plugin), 3);
    pair.plugin_event(Event::quiesced(XferId(xfers[1])));
    assert_eq!(violations(&pair.prefill.core, ViolationClause::DuplicateEvent), 2);
    assert_eq!(pair.prefill.core.room(pair.now, key(1), Role::Sender).unwrap().bytes_done, 0);
}

#[test]
fn late_ticket_events_for_settled_receivers_follow_the_ticket_state() {
    let mut pair = Pair::new();
    // Room 1 succeeds (its ticket is closed by the cancel sent on success).
    pair.expect(key(1), &[&[(0, 64)]]).unwrap();
    pair.send(key(1), 0, 0, &[(0, 64)], true).unwrap();
    assert_eq!(pair.decode.terminal(key(1)), Some(Outcome::Succeeded));
    // Room 2 fails (aborted) and is released by the sender's quiesced word: its ticket stays open.
    pair.expect(key(2), &[&[(64, 64)]]).unwrap();
    pair.abort_decode(key(2));
    assert_eq!(pair.decode.state(pair.now, key(2), Role::Receiver), Some(RoomState::Failed));
    let tickets = pair.decode.tickets_opened.clone();
    assert_eq!(tickets.len(), 2);
    let event = |pair: &mut Pair, event: Event| pair.decode.core.handle_plugin_event(pair.now, SLOT, &event);
    event(&mut pair, Event::incoming_quiesced(PREFILL_ID, tickets[0]));
    assert_eq!(pair.decode.core.metrics().violations_total(), 0, "the answer to the success cancel");
    event(&mut pair, Event::incoming_failed(PREFILL_ID, tickets[0], ReasonCode::TRANSPORT_ERROR, "late"));
    assert_eq!(late(&pair.decode.core, LateSource::Plugin), 1);
    event(&mut pair, Event::incoming_failed(PREFILL_ID, tickets[0], ReasonCode(4242), "??"));
    assert_eq!(late(&pair.decode.core, LateSource::Plugin), 2);
    assert_eq!(violations(&pair.decode.core, ViolationClause::UnknownReasonCode), 1);
    let mut unknown = Event::incoming_quiesced(PREFILL_ID, tickets[0]);
    unknown.kind = EventKind(99);
    event(&mut pair, unknown);
    assert_eq!(violations(&pair.decode.core, ViolationClause::UnknownEventKind), 1);
    event(&mut pair, Event::incoming_quiesced(PREFILL_ID, tickets[1]));
    assert_eq!(violations(&pair.decode.core, ViolationClause::DuplicateEvent), 0, "the open ticket closes");
    event(&mut pair, Event::incoming_quiesced(PREFILL_ID, tickets[1]));
    assert_eq!(violations(&pair.decode.core, ViolationClause::DuplicateEvent), 1);
    let view = pair.decode.core.room(pair.now, key(1), Role::Receiver).unwrap();
    assert_eq!((view.state, view.parts, view.parts_done, view.bytes_done), (RoomState::Succeeded, 1, 1, 64));
    assert_eq!(view.peer, Some(PREFILL_ID.0));
    assert_eq!(view.plugin, Some(SLOT));
    assert_eq!(view.next_deadline, Some(pair.now.saturating_add(Span::from_ms(60_000))));
    assert_eq!(pair.decode.core.rooms(pair.now).filter(|v| v.state.is_terminal()).count(), 2);
}

#[test]
fn evicted_tombstones_leave_only_late_ids_and_a_free_key() {
    let config = CoreConfig { max_tombstones: 1, ..CoreConfig::default() };
    let mut pair = Pair::with_config(config);
    pair.auto_complete = false;
    let mut xfers = Vec::new();
    for n in 1..=2 {
        pair.expect(key(n), &[&[(n * 64, 64)]]).unwrap();
        pair.send(key(n), 0, 0, &[(n * 64, 64)], true).unwrap();
        let xfer = *pair.prefill.live_submits().iter().max().unwrap();
        pair.complete(xfer);
        pair.drive();
        xfers.push(xfer);
        assert_eq!(pair.prefill.terminal(key(n)), Some(Outcome::Succeeded));
    }
    let core = &pair.prefill.core;
    assert_eq!((core.metrics().tombstones, core.metrics().tombstones_evicted), (1, 1));
    assert!(core.room(pair.now, key(1), Role::Sender).is_none());
    assert!(core.room(pair.now, key(2), Role::Sender).is_some());
    pair.plugin_event(Event::succeeded(XferId(xfers[0]), 64));
    assert_eq!(late(&pair.prefill.core, LateSource::Plugin), 1, "an evicted room's transfer is late");
    pair.plugin_event(Event::succeeded(XferId(xfers[1]), 64));
    assert_eq!(violations(&pair.prefill.core, ViolationClause::DuplicateEvent), 1, "a held tombstone's is a duplicate");
    let tickets = pair.decode.tickets_opened.clone();
    pair.decode.core.handle_plugin_event(
        pair.now,
        SLOT,
        &Event::incoming_failed(PREFILL_ID, tickets[0], ReasonCode::CANCELLED, "x"),
    );
    assert_eq!(late(&pair.decode.core, LateSource::Plugin), 1);
    assert_eq!(pair.decode.core.held_rooms(), 1);
    // The evicted key is free: the same room and generation is a new room again.
    pair.auto_complete = true;
    pair.expect(key(1), &[&[(64, 64)]]).unwrap();
    assert_eq!(pair.decode.state(pair.now, key(1), Role::Receiver), Some(RoomState::WaitingSender));
}

#[test]
fn settled_rooms_refuse_late_requests_and_messages_like_any_terminal_room() {
    let config = CoreConfig { tombstone_ttl_ms: 1_000, ..CoreConfig::default() };
    let mut pair = Pair::with_config(config);
    pair.expect(key(1), &[&[(0, 64)]]).unwrap();
    pair.send(key(1), 0, 0, &[(0, 64)], true).unwrap();
    assert_eq!(pair.prefill.terminal(key(1)), Some(Outcome::Succeeded));
    let refusal = pair.send(key(1), 0, 1, &[(0, 8)], true).unwrap_err();
    assert_eq!(refusal.reason, RefusalReason::RoomTerminal);
    let refusal = pair.expect(key(1), &[&[(0, 64)]]).unwrap_err();
    assert_eq!(refusal.reason, RefusalReason::RoomTerminal);
    assert_eq!(late(&pair.prefill.core, LateSource::Engine), 1);
    assert_eq!(late(&pair.decode.core, LateSource::Engine), 1);
    pair.abort_prefill(key(1));
    assert_eq!(pair.prefill.core.metrics().aborts_harmless[HarmlessAbort::AfterTerminal.index()], 1);
    // A failure word for the settled sender: late, and answered with our quiesced word, but only
    // to the peer the room was bound to.
    let message = PeerMessage::Abort { room: key(1), reason: FailReason::Aborted, to: Role::Sender };
    let sent_before = pair.prefill.to_peer.len();
    pair.link_up = false;
    pair.prefill.core.handle_peer_message(pair.now, DECODE_ID, &message);
    pair.prefill.core.handle_peer_message(pair.now, PeerId(55), &message);
    pair.drive();
    assert_eq!(late(&pair.prefill.core, LateSource::Peer), 2);
    assert_eq!(pair.prefill.to_peer[sent_before..], [PeerMessage::Quiesced { room: key(1) }]);
    // A settled failed sender answers a late expect notice with why it is over.
    pair.link_up = true;
    pair.expect(key(2), &[&[(64, 64)]]).unwrap();
    pair.abort_decode(key(2));
    pair.abort_prefill(key(3));
    assert_eq!(pair.prefill.core.metrics().aborts_harmless[HarmlessAbort::Unknown.index()], 1);
    pair.link_up = false;
    let notice = PeerMessage::ExpectNotice {
        room: key(3),
        parts: vec![slices(DST_REGION, &[(0, 8)])],
        tickets: vec![Ticket(99)],
        plugins: vec![],
        timeout: Span::from_ms(1_000),
    };
    let sent_before = pair.prefill.to_peer.len();
    pair.prefill.core.handle_peer_message(pair.now, DECODE_ID, &notice);
    pair.drive();
    assert_eq!(late(&pair.prefill.core, LateSource::Peer), 3);
    assert_eq!(
        pair.prefill.to_peer[sent_before..],
        [PeerMessage::Abort { room: key(3), reason: FailReason::Aborted, to: Role::Receiver }]
    );
    pair.abort_prefill(key(3));
    assert_eq!(pair.prefill.core.metrics().aborts_harmless[HarmlessAbort::Duplicate.index()], 1);
    // A newer generation takes the key over; the old tombstone's expiry leaves it alone.
    pair.link_up = true;
    let newer = RoomKey::new(1, key(1).generation + 1);
    pair.send(newer, 0, 0, &[(0, 8)], true).unwrap();
    pair.advance_ms(1_100);
    assert_eq!(pair.prefill.state(pair.now, newer, Role::Sender), Some(RoomState::WaitingExpect));
    assert!(pair.prefill.core.room(pair.now, key(1), Role::Sender).is_none());
    assert_eq!(pair.prefill.core.metrics().tombstones, 0);
    assert_eq!(pair.prefill.core.held_rooms(), 1);
}

/// Many tombstones over a few reused ids, against a model of the FIFO: an evicted record's key is
/// free (the key table drops it lazily, in sweeps) and a held record's is not, across every sweep
/// and generation change.
#[test]
fn keys_of_evicted_tombstones_are_free_and_held_ones_answer_through_every_sweep() {
    const MAX_TOMBSTONES: usize = 8;
    let config = CoreConfig { max_tombstones: MAX_TOMBSTONES as u64, ..CoreConfig::default() };
    let mut core = Core::new(config).unwrap();
    let now = At::from_origin(Span::from_ms(1));
    // The model: FIFO of (id, generation, seq); id -> (generation, seq) of its latest record.
    let mut fifo = std::collections::VecDeque::new();
    let mut latest: std::collections::HashMap<u64, (u32, u64)> = std::collections::HashMap::new();
    let mut next_seq = 0u64;
    let mut rng = 0x5eed_u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    for step in 0..40_000u64 {
        // Mostly a small pool of ids (held and stale entries share the table), sometimes a new one.
        let id = if next() % 8 == 0 { 1_000_000 + step } else { next() % 24 };
        let generation = (next() % 3) as u32;
        let held = latest.get(&id).copied().filter(|&(_, seq)| seq + MAX_TOMBSTONES as u64 >= next_seq);
        let creates = match held {
            Some((held_generation, _)) => held_generation < generation,
            None => true,
        };
        core.handle_engine(now, EngineRequest::Abort { room: RoomKey::new(id, generation), role: Some(Role::Sender) })
            .unwrap();
        while core.poll_command().is_some() {}
        if creates {
            fifo.push_back((id, generation, next_seq));
            latest.insert(id, (generation, next_seq));
            next_seq += 1;
            if fifo.len() > MAX_TOMBSTONES {
                fifo.pop_front();
            }
        }
        assert_eq!(core.metrics().tombstones, fifo.len() as u64, "step {step}");
        for probe in [id, next() % 24] {
            let expected = latest.get(&probe).copied().filter(|&(_, seq)| seq + MAX_TOMBSTONES as u64 >= next_seq);
            for probe_generation in 0..3 {
                let view = core.room(now, RoomKey::new(probe, probe_generation), Role::Sender);
                let held_here = expected.is_some_and(|(held_generation, _)| held_generation == probe_generation);
                assert_eq!(view.is_some(), held_here, "step {step}: id {probe} generation {probe_generation}");
            }
        }
    }
    assert!(core.metrics().tombstones_evicted > 10_000);
}

#[test]
fn a_transfer_id_names_its_room_while_live_and_while_its_tombstone_is_held() {
    let mut pair = Pair::new();
    pair.auto_complete = false;
    pair.cancel_answers = false;
    pair.expect(key(1), &[&[(0, 64)]]).unwrap();
    pair.send(key(1), 0, 0, &[(0, 64)], true).unwrap();
    let xfer = XferId(*pair.prefill.live_submits().iter().max().unwrap());
    assert_eq!(pair.prefill.core.room_of_xfer(xfer), Some((key(1), Role::Sender)));
    pair.plugin_event(Event::succeeded(xfer, 64));
    assert_eq!(pair.prefill.state(pair.now, key(1), Role::Sender), Some(RoomState::Succeeded));
    assert_eq!(pair.prefill.core.room_of_xfer(xfer), Some((key(1), Role::Sender)), "settled, its record held");
    assert_eq!(pair.prefill.core.room_of_xfer(XferId(xfer.0 + 1_000)), None, "never issued");
    assert_eq!(pair.prefill.core.room_of_xfer(XferId(0)), None);
}
