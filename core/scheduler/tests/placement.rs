//! Chunks that name where their bytes go (`handle_send_at`): any order, any chunk numbers, a part
//! done once every byte of its destination is covered exactly once; overlaps, overruns, a `last` that
//! leaves a gap and placement mixed with chunk order are refused with their reason and change nothing.
//! Chunks held before the expect notice are placed at their offsets when it comes.

mod support;

use kvgate_core::*;
use support::*;

/// Destination: part 0 is three scattered slices of 100, 50 and 150 bytes (a 300-byte stream).
const DEST: &[(u64, u64)] = &[(1_000, 100), (5_000, 50), (9_000, 150)];

fn reason(result: Result<(), Refusal>) -> RefusalReason {
    result.expect_err("refused").reason
}

#[test]
fn chunks_in_any_order_fill_a_scattered_destination_exactly() {
    let mut pair = Pair::new();
    let room = key(1);
    pair.expect(room, &[DEST]).unwrap();
    // The stream's bytes 120..300 first (they straddle the second and third slices), then 0..120
    // in two pieces, the last one first; chunk numbers in no particular order.
    pair.send_at(room, 0, 7, 120, &[(20_000, 180)], false).unwrap();
    assert!(pair.decode.terminal(room).is_none(), "not all bytes covered yet");
    pair.send_at(room, 0, 2, 60, &[(30_000, 60)], false).unwrap();
    pair.send_at(room, 0, 0, 0, &[(40_000, 60)], false).unwrap();
    assert_eq!(pair.decode.terminal(room), Some(Outcome::Succeeded));
    assert_eq!(pair.prefill.terminal(room), Some(Outcome::Succeeded));
    // Stream byte b lands at the destination slice holding it.
    let stream: Vec<u8> = [(40_000u64, 60u64), (30_000, 60), (20_000, 180)]
        .iter()
        .flat_map(|&(o, l)| pair.prefill_bytes(o, l).to_vec())
        .collect();
    let landed: Vec<u8> = DEST.iter().flat_map(|&(o, l)| pair.decode_bytes(o, l).to_vec()).collect();
    assert_eq!(landed, stream);
}

#[test]
fn overlaps_overruns_gaps_and_mixed_placement_are_refused_and_change_nothing() {
    let mut pair = Pair::new();
    let room = key(2);
    pair.expect(room, &[DEST]).unwrap();
    pair.send_at(room, 0, 0, 100, &[(20_000, 100)], false).unwrap();
    let submits = pair.prefill.core.metrics().submits;
    // Overlapping the placed range at either end, or inside it.
    assert_eq!(reason(pair.send_at(room, 0, 1, 50, &[(0, 51)], false)), RefusalReason::OverlappingChunk);
    assert_eq!(reason(pair.send_at(room, 0, 1, 199, &[(0, 10)], false)), RefusalReason::OverlappingChunk);
    assert_eq!(reason(pair.send_at(room, 0, 1, 120, &[(0, 10)], false)), RefusalReason::OverlappingChunk);
    // Past the end of the 300-byte stream: at the end exactly is fine, one byte past is not.
    assert_eq!(reason(pair.send_at(room, 0, 1, 250, &[(0, 51)], false)), RefusalReason::LengthMismatch);
    assert_eq!(reason(pair.send_at(room, 0, 1, u64::MAX - 5, &[(0, 10)], false)), RefusalReason::LengthMismatch);
    // A `last` chunk that leaves a gap.
    assert_eq!(reason(pair.send_at(room, 0, 1, 200, &[(0, 100)], true)), RefusalReason::LengthMismatch);
    // Chunk order and explicit offsets in one part.
    assert_eq!(reason(pair.send(room, 0, 1, &[(0, 100)], false)), RefusalReason::PlacementMismatch);
    assert_eq!(pair.prefill.core.metrics().submits, submits, "nothing refused was submitted");
    // Touching at both ends is fine: the part completes, and nothing more is taken.
    pair.send_at(room, 0, 1, 200, &[(0, 100)], false).unwrap();
    pair.send_at(room, 0, 2, 0, &[(0, 100)], true).unwrap();
    assert_eq!(pair.decode.terminal(room), Some(Outcome::Succeeded));
    assert_eq!(reason(pair.send_at(room, 0, 3, 0, &[(0, 1)], false)), RefusalReason::RoomTerminal);
}

#[test]
fn a_part_in_chunk_order_refuses_an_explicit_offset() {
    let mut pair = Pair::new();
    let room = key(3);
    pair.expect(room, &[DEST]).unwrap();
    pair.send(room, 0, 0, &[(0, 100)], false).unwrap();
    assert_eq!(reason(pair.send_at(room, 0, 1, 100, &[(0, 100)], false)), RefusalReason::PlacementMismatch);
    pair.send(room, 0, 1, &[(0, 200)], true).unwrap();
    assert_eq!(pair.decode.terminal(room), Some(Outcome::Succeeded));
}

#[test]
fn chunks_sent_before_the_expect_are_placed_at_their_offsets_when_it_comes() {
    let mut pair = Pair::new();
    let room = key(4);
    // A prefix-cache skip on the sender: chunk 1 (stream bytes 150..300) before chunk 0, both before
    // the receiver's expect.
    pair.send_at(room, 0, 1, 150, &[(60_000, 150)], false).unwrap();
    pair.send_at(room, 0, 0, 0, &[(70_000, 150)], false).unwrap();
    assert!(pair.prefill.terminal(room).is_none());
    pair.expect(room, &[DEST]).unwrap();
    assert_eq!(pair.decode.terminal(room), Some(Outcome::Succeeded));
    let stream: Vec<u8> =
        [(70_000u64, 150u64), (60_000, 150)].iter().flat_map(|&(o, l)| pair.prefill_bytes(o, l).to_vec()).collect();
    let landed: Vec<u8> = DEST.iter().flat_map(|&(o, l)| pair.decode_bytes(o, l).to_vec()).collect();
    assert_eq!(landed, stream);
}

#[test]
fn held_chunks_that_overlap_are_refused_and_ones_past_the_end_fail_the_room_when_the_expect_comes() {
    let mut pair = Pair::new();
    let room = key(5);
    pair.send_at(room, 0, 0, 0, &[(0, 200)], false).unwrap();
    // Overlapping a held chunk: refused at once, before any expect.
    assert_eq!(reason(pair.send_at(room, 0, 1, 100, &[(0, 200)], false)), RefusalReason::OverlappingChunk);
    // Touching it is fine; running past the 300-byte destination shows only when the expect comes.
    pair.send_at(room, 0, 1, 200, &[(0, 200)], false).unwrap();
    pair.expect(room, &[DEST]).unwrap();
    assert_eq!(pair.prefill.failure(room), Some(FailReason::LengthMismatch));
    assert!(pair.decode.failure(room).is_some(), "the receiver is told");
}

#[test]
fn an_expect_whose_destination_slices_overlap_is_refused() {
    let mut pair = Pair::new();
    // Two slices of one part, and slices of two parts, over the same bytes.
    assert_eq!(reason(pair.expect(key(6), &[&[(0, 100), (50, 100)]])), RefusalReason::OverlappingSlices);
    assert_eq!(reason(pair.expect(key(6), &[&[(0, 100)], &[(99, 10)]])), RefusalReason::OverlappingSlices);
    assert!(pair.decode.state(pair.now, key(6), Role::Receiver).is_none(), "nothing was created");
    // Touching is fine.
    pair.expect(key(6), &[&[(0, 100)], &[(100, 10)]]).unwrap();
}
