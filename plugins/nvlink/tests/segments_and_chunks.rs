//! Segment validation (keys, peer, ranges, limits; refused before any byte moves) and the chunk
//! planner (merging, splitting at chunk_bytes, exact coverage).

use kvgate_abi::{LocalKey, PeerId, ReasonCode, RemoteKey, Segment};
use kvgate_plugin_nvlink::chunk_plan::{plan_copies, CopyOp};
use kvgate_plugin_nvlink::segments::*;

const PEER: PeerId = PeerId(7);
const LIMITS: SubmitLimits = SubmitLimits { max_segments_per_submit: 4, max_transfer_bytes: 1000 };

fn local(k: LocalKey) -> Option<LocalView> {
    (k.0 == 1).then_some(LocalView { addr: 0x1000, len: 500, device_index: 0 })
}
fn remote(k: RemoteKey) -> Option<RemoteView> {
    match k.0 {
        1 => Some(RemoteView { peer: PEER, addr: 0x9000, len: 600 }),
        2 => Some(RemoteView { peer: PeerId(8), addr: 0xa000, len: 600 }),
        _ => None,
    }
}
fn seg(local_offset: u64, remote_offset: u64, len: u64) -> Segment {
    Segment { local: LocalKey(1), local_offset, remote: RemoteKey(1), remote_offset, len }
}
fn resolve(segments: &[Segment], limits: SubmitLimits) -> Result<Vec<ResolvedSegment>, kvgate_abi::PluginError> {
    resolve_segments(segments, PEER, limits, local, remote)
}

#[test]
fn valid_segments_resolve_to_device_addresses() {
    let r = resolve(&[seg(0, 0, 10), seg(490, 590, 10)], LIMITS).unwrap();
    assert_eq!(r[0], ResolvedSegment { src: 0x1000, dst: 0x9000, len: 10, device_index: 0 });
    assert_eq!(r[1], ResolvedSegment { src: 0x1000 + 490, dst: 0x9000 + 590, len: 10, device_index: 0 });
}

#[test]
fn ranges_are_accepted_at_the_region_end_and_refused_one_byte_past() {
    resolve(&[seg(0, 0, 500)], LIMITS).unwrap();
    assert_eq!(resolve(&[seg(1, 0, 500)], LIMITS).unwrap_err().code, ReasonCode::OUT_OF_RANGE);
    resolve(&[seg(0, 100, 500)], LIMITS).unwrap();
    assert_eq!(resolve(&[seg(0, 101, 500)], LIMITS).unwrap_err().code, ReasonCode::OUT_OF_RANGE);
    assert_eq!(resolve(&[seg(u64::MAX, 0, 2)], LIMITS).unwrap_err().code, ReasonCode::OUT_OF_RANGE);
}

#[test]
fn zero_length_segments_are_valid_and_move_nothing() {
    assert!(resolve(&[seg(500, 600, 0)], LIMITS).unwrap().is_empty());
    assert!(resolve(&[], LIMITS).unwrap().is_empty());
}

#[test]
fn unknown_keys_and_another_peers_key_are_refused() {
    let unknown_local = Segment { local: LocalKey(9), ..seg(0, 0, 1) };
    assert_eq!(resolve(&[unknown_local], LIMITS).unwrap_err().code, ReasonCode::UNKNOWN_KEY);
    let unknown_remote = Segment { remote: RemoteKey(9), ..seg(0, 0, 1) };
    assert_eq!(resolve(&[unknown_remote], LIMITS).unwrap_err().code, ReasonCode::UNKNOWN_KEY);
    let other_peer = Segment { remote: RemoteKey(2), ..seg(0, 0, 1) };
    let e = resolve(&[other_peer], LIMITS).unwrap_err();
    assert_eq!(e.code, ReasonCode::UNKNOWN_KEY);
    assert!(e.message.contains("peer 8"), "{e}");
}

#[test]
fn segment_count_limit_at_and_past() {
    resolve(&[seg(0, 0, 1); 4], LIMITS).unwrap();
    assert_eq!(resolve(&[seg(0, 0, 1); 5], LIMITS).unwrap_err().code, ReasonCode::RESOURCE_EXHAUSTED);
}

#[test]
fn transfer_bytes_limit_at_and_past() {
    let limits = SubmitLimits { max_segments_per_submit: 10, max_transfer_bytes: 1000 };
    resolve(&[seg(0, 0, 500), seg(0, 100, 500)], limits).unwrap();
    let e = resolve(&[seg(0, 0, 500), seg(0, 100, 500), seg(0, 0, 1)], limits).unwrap_err();
    assert_eq!(e.code, ReasonCode::RESOURCE_EXHAUSTED);
    assert!(e.message.contains("max_transfer_bytes"), "{e}");
}

fn rs(src: u64, dst: u64, len: u64, device_index: usize) -> ResolvedSegment {
    ResolvedSegment { src, dst, len, device_index }
}

fn covered(ops: &[CopyOp]) -> u64 {
    ops.iter().map(|o| o.len).sum()
}

#[test]
fn a_large_segment_splits_at_chunk_bytes() {
    let ops = plan_copies(&[rs(0, 1 << 40, 10, 0)], 4);
    assert_eq!(
        ops,
        vec![
            CopyOp { src: 0, dst: 1 << 40, len: 4, device_index: 0 },
            CopyOp { src: 4, dst: (1 << 40) + 4, len: 4, device_index: 0 },
            CopyOp { src: 8, dst: (1 << 40) + 8, len: 2, device_index: 0 },
        ]
    );
    assert_eq!(plan_copies(&[rs(0, 100, 8, 0)], 4).len(), 2, "exactly two chunks at 2 x chunk_bytes");
    assert_eq!(plan_copies(&[rs(0, 100, 4, 0)], 4).len(), 1, "one chunk at chunk_bytes");
    assert_eq!(plan_copies(&[rs(0, 100, 5, 0)], 4).len(), 2, "two chunks just past chunk_bytes");
}

#[test]
fn contiguous_segments_merge_and_others_do_not() {
    // Contiguous on both sides, same device: one copy.
    let ops = plan_copies(&[rs(0, 100, 3, 0), rs(3, 103, 3, 0), rs(6, 106, 3, 0)], 1 << 20);
    assert_eq!(ops, vec![CopyOp { src: 0, dst: 100, len: 9, device_index: 0 }]);
    // Gap on the destination, or another device: separate copies.
    assert_eq!(plan_copies(&[rs(0, 100, 3, 0), rs(3, 104, 3, 0)], 1 << 20).len(), 2);
    assert_eq!(plan_copies(&[rs(0, 100, 3, 0), rs(3, 103, 3, 1)], 1 << 20).len(), 2);
    // A merged run is still split at chunk_bytes.
    let ops = plan_copies(&[rs(0, 100, 3, 0), rs(3, 103, 3, 0)], 4);
    assert_eq!(ops.iter().map(|o| o.len).collect::<Vec<_>>(), vec![4, 2]);
}

#[test]
fn plans_cover_exactly_the_bytes_of_many_random_scatter_lists() {
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = |m: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % m
    };
    for _ in 0..200 {
        let chunk = 1 + next(64);
        let mut segs = Vec::new();
        let (mut src, mut dst) = (0u64, 1u64 << 32);
        for _ in 0..1 + next(40) {
            let len = next(100);
            src += next(3) * 7;
            dst += next(3) * 5;
            segs.push(rs(src, dst, len, next(2) as usize));
            src += len;
            dst += len;
        }
        let ops = plan_copies(&segs, chunk);
        assert_eq!(covered(&ops), segs.iter().map(|s| s.len).sum::<u64>());
        assert!(ops.iter().all(|o| o.len > 0 && o.len <= chunk));
        // Every byte of every segment is copied to the right place exactly once.
        let mut expected: Vec<(u64, u64, usize)> =
            segs.iter().flat_map(|s| (0..s.len).map(move |i| (s.src + i, s.dst + i, s.device_index))).collect();
        let mut actual: Vec<(u64, u64, usize)> =
            ops.iter().flat_map(|o| (0..o.len).map(move |i| (o.src + i, o.dst + i, o.device_index))).collect();
        expected.sort_unstable();
        actual.sort_unstable();
        assert_eq!(expected, actual);
    }
}
