//! Every limit of `CoreConfig`, tested just at it and just past it, the config validation (naming
//! key, value and range), and every engine refusal before any byte moves.
// CONFORMANCE: TIME-11, DATA-5

mod support;
use kvgate_core::*;
use support::*;

#[test]
fn default_config_is_valid_and_every_key_is_checked_at_and_past_its_range() {
    CoreConfig::default().validate().unwrap();
    let base = CoreConfig::default();
    for (key, _value, min, max) in base.ranges() {
        let set = |value: u64| {
            let mut config = base.clone();
            let field: &mut u64 = match key {
                "max_inflight_rooms" => &mut config.max_inflight_rooms,
                "max_parts_per_room" => &mut config.max_parts_per_room,
                "max_chunks_per_part" => &mut config.max_chunks_per_part,
                "max_slices_per_request" => &mut config.max_slices_per_request,
                "max_segments_per_submit" => &mut config.max_segments_per_submit,
                "max_pending_sends" => &mut config.max_pending_sends,
                "max_tombstones" => &mut config.max_tombstones,
                "tombstone_ttl_ms" => &mut config.tombstone_ttl_ms,
                "bootstrap_timeout_ms" => &mut config.bootstrap_timeout_ms,
                "transfer_base_ms" => &mut config.transfer_base_ms,
                "min_bandwidth_bytes_per_s" => &mut config.min_bandwidth_bytes_per_s,
                "room_timeout_ms" => &mut config.room_timeout_ms,
                "max_room_timeout_ms" => &mut config.max_room_timeout_ms,
                "plugin_grace_ms" => &mut config.plugin_grace_ms,
                "quarantine_timeout_ms" => &mut config.quarantine_timeout_ms,
                other => panic!("untested key {other}"),
            };
            *field = value;
            if key == "room_timeout_ms" {
                config.max_room_timeout_ms = config.max_room_timeout_ms.max(value.min(max));
            }
            if key == "max_room_timeout_ms" {
                config.room_timeout_ms = config.room_timeout_ms.min(value.max(min));
            }
            config.validate()
        };
        assert!(set(min).is_ok(), "{key} at its minimum");
        assert!(set(max).is_ok(), "{key} at its maximum");
        if min > 0 {
            let error = set(min - 1).unwrap_err();
            assert_eq!(error.key, key);
            assert!(error.to_string().contains(key) && error.to_string().contains(&format!("{}", min - 1)));
        }
        if max < u64::MAX {
            assert_eq!(set(max + 1).unwrap_err().key, key);
        }
    }
    let mut inverted = CoreConfig::default();
    inverted.room_timeout_ms = inverted.max_room_timeout_ms + 1;
    assert_eq!(inverted.validate().unwrap_err().key, "room_timeout_ms");
    assert!(Core::new(inverted).is_err());
}

fn pair_with(change: impl FnOnce(&mut CoreConfig)) -> Pair {
    let mut config = CoreConfig::default();
    change(&mut config);
    Pair::with_config(config)
}

#[test]
fn max_inflight_rooms_at_and_past() {
    let mut pair = pair_with(|c| c.max_inflight_rooms = 3);
    pair.link_up = false;
    for n in 0..3 {
        pair.expect(key(n), &[&[(0, 8)]]).unwrap();
    }
    assert_eq!(pair.expect(key(3), &[&[(0, 8)]]).unwrap_err().reason, RefusalReason::TooManyRooms);
    // A terminal room frees its place.
    pair.abort_decode(key(0));
    pair.expect(key(3), &[&[(0, 8)]]).unwrap();
    // The sender side answers an expect notice past its limit with `overloaded`.
    let mut pair = pair_with(|c| c.max_inflight_rooms = 1);
    pair.send(key(50), 0, 0, &[(0, 8)], true).unwrap();
    pair.expect(key(51), &[&[(0, 8)]]).unwrap();
    assert_eq!(pair.decode.failure(key(51)), Some(FailReason::SenderFailed));
    let Some(Outcome::Failed(failure)) = pair.decode.terminal(key(51)) else { panic!() };
    assert_eq!(failure.peer_reason, Some(FailReason::Overloaded));
    assert_eq!(pair.send(key(52), 0, 0, &[(0, 8)], true).unwrap_err().reason, RefusalReason::TooManyRooms);
}

#[test]
fn max_parts_per_room_at_and_past() {
    let mut pair = pair_with(|c| c.max_parts_per_room = 2);
    pair.expect(key(1), &[&[(0, 8)], &[(8, 8)]]).unwrap();
    let refused = pair.expect(key(2), &[&[(0, 8)], &[(8, 8)], &[(16, 8)]]).unwrap_err();
    assert_eq!(refused.reason, RefusalReason::TooManyParts);
    pair.send(key(3), 1, 0, &[(0, 8)], true).unwrap();
    assert_eq!(pair.send(key(4), 2, 0, &[(0, 8)], true).unwrap_err().reason, RefusalReason::TooManyParts);
}

#[test]
fn max_chunks_per_part_at_and_past() {
    let mut pair = pair_with(|c| c.max_chunks_per_part = 2);
    pair.auto_complete = false;
    pair.expect(key(1), &[&[(0, 24)]]).unwrap();
    pair.send(key(1), 0, 0, &[(0, 8)], false).unwrap();
    pair.send(key(1), 0, 1, &[(8, 8)], false).unwrap();
    assert_eq!(pair.send(key(1), 0, 2, &[(16, 8)], true).unwrap_err().reason, RefusalReason::TooManyChunks);
}

#[test]
fn max_slices_per_request_at_and_past() {
    let mut pair = pair_with(|c| c.max_slices_per_request = 2);
    pair.expect(key(1), &[&[(0, 8), (8, 8)]]).unwrap();
    let refused = pair.expect(key(2), &[&[(0, 8), (8, 8), (16, 8)]]).unwrap_err();
    assert_eq!(refused.reason, RefusalReason::TooManySlices);
    assert_eq!(
        pair.send(key(3), 0, 0, &[(0, 1), (1, 1), (2, 1)], true).unwrap_err().reason,
        RefusalReason::TooManySlices
    );
}

#[test]
fn max_segments_per_submit_at_and_past_refuses_never_splits() {
    let mut pair = pair_with(|c| c.max_segments_per_submit = 3);
    pair.auto_complete = false;
    pair.expect(key(1), &[&[(0, 1), (10, 1), (20, 1), (30, 1)]]).unwrap();
    let refused = pair.send(key(1), 0, 0, &[(0, 4)], true).unwrap_err();
    assert_eq!(refused.reason, RefusalReason::TooManySegments);
    assert!(pair.prefill.submits.is_empty(), "nothing moved");
    pair.send(key(1), 0, 0, &[(0, 3)], false).unwrap();
    assert_eq!(pair.prefill.submits.values().next().unwrap().segments.len(), 3);
    // Held chunks that exceed it fail the room when the notice arrives.
    pair.send(key(2), 0, 0, &[(0, 4)], true).unwrap();
    pair.expect(key(2), &[&[(0, 1), (10, 1), (20, 1), (30, 1)]]).unwrap();
    assert_eq!(pair.prefill.failure(key(2)), Some(FailReason::TooManySegments));
}

#[test]
fn max_pending_sends_at_and_past() {
    let mut pair = pair_with(|c| c.max_pending_sends = 2);
    pair.send(key(1), 0, 0, &[(0, 8)], false).unwrap();
    pair.send(key(1), 0, 1, &[(8, 8)], false).unwrap();
    assert_eq!(pair.send(key(1), 0, 2, &[(16, 8)], true).unwrap_err().reason, RefusalReason::TooManyPendingSends);
    assert_eq!(pair.send(key(2), 0, 0, &[(16, 8)], true).unwrap_err().reason, RefusalReason::TooManyPendingSends);
    assert_eq!(pair.prefill.core.live_rooms(), 1, "a refused first send creates no room");
}

#[test]
fn max_tombstones_at_and_past_drops_the_oldest() {
    let mut pair = pair_with(|c| c.max_tombstones = 2);
    for n in 0..2 {
        pair.expect(key(n), &[&[(0, 8)]]).unwrap();
        pair.send(key(n), 0, 0, &[(0, 8)], true).unwrap();
    }
    assert_eq!(pair.decode.core.metrics().tombstones, 2);
    assert_eq!(pair.decode.core.metrics().tombstones_evicted, 0);
    pair.expect(key(2), &[&[(0, 8)]]).unwrap();
    pair.send(key(2), 0, 0, &[(0, 8)], true).unwrap();
    assert_eq!(pair.decode.core.metrics().tombstones, 2);
    assert_eq!(pair.decode.core.metrics().tombstones_evicted, 1);
    assert!(pair.decode.core.room(pair.now, key(0), Role::Receiver).is_none(), "oldest dropped first");
    assert!(pair.decode.core.room(pair.now, key(1), Role::Receiver).is_some());
}

#[test]
fn bad_requests_are_refused_before_any_byte_moves() {
    let mut pair = Pair::new();
    pair.auto_complete = false;
    let room = key(1);
    let unknown = pair.decode.core.handle_engine(
        pair.now,
        EngineRequest::Expect {
            room,
            peer: PREFILL_ID,
            parts: vec![slices(RegionId(99), &[(0, 8)])],
            timeout_ms: None,
        },
    );
    assert_eq!(unknown.unwrap_err().reason, RefusalReason::UnknownRegion);
    assert_eq!(pair.expect(room, &[&[(REGION_LEN - 4, 8)]]).unwrap_err().reason, RefusalReason::SliceOutOfRange);
    assert_eq!(pair.expect(room, &[&[(0, 0)]]).unwrap_err().reason, RefusalReason::SliceOutOfRange);
    assert_eq!(pair.expect(room, &[&[(u64::MAX, 2)]]).unwrap_err().reason, RefusalReason::SliceOutOfRange);
    assert_eq!(pair.expect(room, &[]).unwrap_err().reason, RefusalReason::EmptyRequest);
    let zero_timeout = pair.decode.core.handle_engine(
        pair.now,
        EngineRequest::Expect {
            room,
            peer: PREFILL_ID,
            parts: vec![slices(DST_REGION, &[(0, 8)])],
            timeout_ms: Some(0),
        },
    );
    assert_eq!(zero_timeout.unwrap_err().reason, RefusalReason::InvalidTimeout);
    let no_peer = pair.decode.core.handle_engine(
        pair.now,
        EngineRequest::Expect { room, peer: PeerId(42), parts: vec![slices(DST_REGION, &[(0, 8)])], timeout_ms: None },
    );
    assert_eq!(no_peer.unwrap_err().reason, RefusalReason::PeerNotConnected);
    assert_eq!(pair.decode.core.live_rooms(), 0, "refusals change nothing");

    pair.expect(room, &[&[(0, 16)]]).unwrap();
    assert_eq!(pair.expect(room, &[&[(0, 16)]]).unwrap_err().reason, RefusalReason::DuplicateExpect);
    assert_eq!(pair.send(room, 0, 1, &[(0, 8)], false).unwrap_err().reason, RefusalReason::OutOfOrderChunk);
    assert_eq!(pair.send(room, 0, 0, &[(0, 17)], false).unwrap_err().reason, RefusalReason::LengthMismatch);
    assert_eq!(pair.send(room, 0, 0, &[(0, 8)], true).unwrap_err().reason, RefusalReason::LengthMismatch);
    assert_eq!(pair.send(room, 1, 0, &[(0, 8)], true).unwrap_err().reason, RefusalReason::UnknownPart);
    let bad_source = pair.prefill.core.handle_engine(
        pair.now,
        EngineRequest::Send {
            room,
            peer: None,
            part: 0,
            chunk: 0,
            slices: slices(RegionId(98), &[(0, 8)]),
            last: false,
        },
    );
    assert_eq!(bad_source.unwrap_err().reason, RefusalReason::UnknownRegion);
    let wrong_peer = pair.prefill.core.handle_engine(
        pair.now,
        EngineRequest::Send {
            room,
            peer: Some(PeerId(42)),
            part: 0,
            chunk: 0,
            slices: slices(SRC_REGION, &[(0, 8)]),
            last: false,
        },
    );
    assert_eq!(wrong_peer.unwrap_err().reason, RefusalReason::PeerNotConnected);
    assert!(pair.prefill.submits.is_empty(), "no byte moved");
    pair.send(room, 0, 0, &[(0, 8)], false).unwrap();
    assert_eq!(pair.send(room, 0, 0, &[(0, 8)], false).unwrap_err().reason, RefusalReason::DuplicateChunk);
    pair.send(room, 0, 1, &[(8, 8)], true).unwrap();
    assert_eq!(pair.send(room, 0, 2, &[(0, 8)], true).unwrap_err().reason, RefusalReason::ChunkAfterLast);
    assert_eq!(pair.prefill.submits.len(), 2);
    let metrics = pair.prefill.core.metrics();
    assert_eq!(metrics.refusal(RefusalReason::LengthMismatch), 2);
    assert_eq!(metrics.refusal(RefusalReason::ChunkAfterLast), 1);
}

#[test]
fn unregistered_source_region_fails_a_held_chunk_at_match() {
    let mut pair = Pair::new();
    pair.send(key(1), 0, 0, &[(0, 8)], true).unwrap();
    pair.prefill.core.handle_region_unregistered(pair.now, SRC_REGION);
    pair.expect(key(1), &[&[(0, 8)]]).unwrap();
    assert_eq!(pair.prefill.failure(key(1)), Some(FailReason::RegionUnregistered));
    assert_eq!(pair.decode.failure(key(1)), Some(FailReason::SenderFailed));
}

#[test]
fn held_chunks_that_do_not_fit_the_destination_fail_with_length_mismatch() {
    let mut pair = Pair::new();
    pair.send(key(1), 0, 0, &[(0, 8)], true).unwrap();
    pair.expect(key(1), &[&[(0, 16)]]).unwrap();
    assert_eq!(pair.prefill.failure(key(1)), Some(FailReason::LengthMismatch));
    // A notice with fewer parts than the held sends is a layout mismatch.
    pair.send(key(2), 1, 0, &[(0, 8)], true).unwrap();
    pair.expect(key(2), &[&[(0, 8)]]).unwrap();
    assert_eq!(pair.prefill.failure(key(2)), Some(FailReason::LayoutMismatch));
}
