//! Property tests of the receiver's frame decoding on a lane (wire version 2: parts back to back):
//! hostile, malformed and truncated lane streams end with a reason (violation, reset, lost) and never
//! panic or write outside the bytes the ticket authorises; every part that ends is answered exactly
//! once; a refused or aborted part's remaining bytes are discarded and the next part is served.
//! The reply decoder, endpoint and remote-key decoders never panic either.

use bytes::Bytes;
use kvgate_abi::ReasonCode;
use kvgate_abi::{LocalRange, MemoryKind, PeerId, RegionDesc, Ticket};
use kvgate_plugin_quic::incoming::{serve_lane, LaneContext, LaneEnd, PartId};
use kvgate_plugin_quic::reader::{FrameReader, MemorySource, ReadFail, SourceError};
use kvgate_plugin_quic::regions::Regions;
use kvgate_plugin_quic::tickets::Tickets;
use kvgate_plugin_quic::wire::{EndpointInfo, Frame, RemoteKeyInfo};
use proptest::prelude::*;
use std::time::{Duration, Instant};

const GUARD: usize = 4096;
const REGION: usize = 4096;
/// The ticket authorises [TICKET_FROM, TICKET_TO) of the region.
const TICKET_FROM: u64 = 1024;
const TICKET_TO: u64 = 3072;
const CANARY: u8 = 0x5a;
const PEER: PeerId = PeerId(3);
const TICKET: u64 = 77;

/// A region between two guard areas, all set to the canary byte.
struct Arena {
    memory: Box<[u8]>,
}

impl Arena {
    fn new() -> Arena {
        Arena { memory: vec![CANARY; GUARD + REGION + GUARD].into_boxed_slice() }
    }
    fn region_desc(&mut self) -> RegionDesc {
        RegionDesc {
            kind: MemoryKind::HOST,
            device: -1,
            addr: self.memory[GUARD..].as_mut_ptr() as u64,
            len: REGION as u64,
            ..Default::default()
        }
    }
}

#[derive(Debug, Clone)]
enum Piece {
    Frame(Frame),
    /// Raw bytes (garbage, or a frame cut short).
    Raw(Vec<u8>),
    /// `n` payload bytes of value 0xAB.
    Payload(usize),
}

fn interesting_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(1),
        Just(TICKET_FROM - 1),
        Just(TICKET_FROM),
        Just(TICKET_TO - 1),
        Just(TICKET_TO),
        Just(REGION as u64 - 1),
        Just(REGION as u64),
        Just(REGION as u64 + 1),
        Just(u64::MAX),
        Just(u64::MAX - 1),
        Just(1u64 << 63),
        0u64..8192,
        any::<u64>(),
    ]
}

fn frame_strategy(real_key: u64) -> impl Strategy<Value = Frame> {
    let key = prop_oneof![3 => Just(real_key), 1 => any::<u64>()];
    let ticket = prop_oneof![3 => Just(TICKET), 1 => any::<u64>()];
    let xfer = prop_oneof![3 => Just(1u64), 1 => any::<u64>()];
    prop_oneof![
        (ticket, any::<u32>(), 0u32..4, interesting_u64()).prop_map(|(ticket, part_index, part_count, bytes)| {
            Frame::PartBegin { xfer: 1, ticket, part_index: part_index % 3, part_count, bytes }
        }),
        (key, interesting_u64(), interesting_u64()).prop_map(|(key, offset, len)| Frame::Segment { key, offset, len }),
        (0u64..6, interesting_u64()).prop_map(|(segments, bytes)| Frame::PartEnd { segments, bytes }),
        xfer.prop_map(|xfer| Frame::PartAbort { xfer }),
        (any::<u64>(), any::<u64>()).prop_map(|(xfer, bytes)| Frame::Done { xfer, bytes }),
        (any::<u64>(), any::<u64>()).prop_map(|(xfer, bytes)| Frame::CancelAck { xfer, bytes }),
        (any::<u64>(), any::<u32>(), ".{0,40}").prop_map(|(xfer, reason, message)| Frame::Refused {
            xfer,
            reason,
            message
        }),
        (any::<u32>(), any::<u16>(), any::<u64>()).prop_map(|(magic, version, instance)| Frame::Hello {
            magic,
            version,
            instance
        }),
        (any::<u16>(), any::<u32>(), any::<u64>()).prop_map(|(version, status, instance)| Frame::HelloReply {
            version,
            status,
            instance
        }),
    ]
}

fn piece_strategy(real_key: u64) -> impl Strategy<Value = Piece> {
    prop_oneof![
        4 => frame_strategy(real_key).prop_map(Piece::Frame),
        3 => (0usize..3000).prop_map(Piece::Payload),
        1 => proptest::collection::vec(any::<u8>(), 0..64).prop_map(Piece::Raw),
        1 => (frame_strategy(real_key), 0usize..40).prop_map(|(f, cut)| {
            let mut bytes = f.to_bytes();
            bytes.truncate(cut.min(bytes.len().saturating_sub(1)));
            Piece::Raw(bytes)
        }),
    ]
}

fn serialise(pieces: &[Piece]) -> Vec<u8> {
    let mut out = Vec::new();
    for p in pieces {
        match p {
            Piece::Frame(f) => f.encode(&mut out),
            Piece::Raw(bytes) => out.extend_from_slice(bytes),
            Piece::Payload(n) => out.extend(std::iter::repeat_n(0xABu8, *n)),
        }
    }
    out
}

fn split(bytes: Vec<u8>, cuts: &[usize]) -> Vec<Bytes> {
    let bytes = Bytes::from(bytes);
    let mut chunks = Vec::new();
    let mut at = 0;
    let mut sorted: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
    sorted.sort_unstable();
    for cut in sorted {
        if cut > at {
            chunks.push(bytes.slice(at..cut));
            at = cut;
        }
    }
    chunks.push(bytes.slice(at..));
    chunks
}

/// How a lane ended, what the receiver answered (in order) and which parts it refused.
#[derive(Debug)]
struct Served {
    end: LaneEnd,
    in_part: Option<PartId>,
    replies: Vec<Frame>,
    refused: Vec<PartId>,
}

fn run_lane(chunks: Vec<Bytes>, end: Option<SourceError>, arena: &mut Arena) -> Served {
    let regions = Regions::new(1);
    let tickets = Tickets::default();
    let (key, _) = regions.register(&arena.region_desc()).unwrap();
    assert_eq!(key.0, 1, "the strategies aim at key 1");
    tickets
        .expect(
            PEER,
            Ticket(TICKET),
            Instant::now() + Duration::from_secs(60),
            &[LocalRange { key, offset: TICKET_FROM, len: TICKET_TO - TICKET_FROM }],
            &regions,
            16,
        )
        .unwrap();
    let ctx = LaneContext { peer: PEER, tickets: &tickets, regions: &regions };
    let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let mut reader = FrameReader::new(MemorySource::new(chunks, end));
    let mut refused = Vec::new();
    let mut on_refused = |part: PartId, _: &kvgate_plugin_quic::tickets::Refusal| refused.push(part);
    let (end, in_part) = runtime.block_on(serve_lane(&mut reader, &ctx, &mut on_refused));
    let replies = std::mem::take(&mut reader.source_mut().replies);
    Served { end, in_part, replies, refused }
}

fn begins(pieces: &[Piece]) -> usize {
    pieces.iter().filter(|p| matches!(p, Piece::Frame(Frame::PartBegin { .. }))).count()
}

fn reply_xfer(f: &Frame) -> u64 {
    match f {
        Frame::Done { xfer, .. } | Frame::Refused { xfer, .. } | Frame::CancelAck { xfer, .. } => *xfer,
        other => panic!("the receiver replied with {other:?}"),
    }
}

fn assert_only_ticket_range_written(arena: &Arena) {
    let m = &arena.memory;
    let from = GUARD + TICKET_FROM as usize;
    let to = GUARD + TICKET_TO as usize;
    assert!(m[..from].iter().all(|&b| b == CANARY), "a byte before the ticket range was written");
    assert!(m[to..].iter().all(|&b| b == CANARY), "a byte after the ticket range was written");
}

/// A well-formed part of transfer `xfer` under `ticket`: its segments inside the ticket, then PART_END,
/// or PART_ABORT after the first `abort_after` segments when given.
fn part_pieces(xfer: u64, ticket: u64, segments: &[(u64, u64)], abort_after: Option<usize>) -> Vec<Piece> {
    let total: u64 = segments.iter().map(|s| s.1).sum();
    let mut pieces = vec![Piece::Frame(Frame::PartBegin { xfer, ticket, part_index: 0, part_count: 1, bytes: total })];
    for (i, (offset, len)) in segments.iter().enumerate() {
        if abort_after == Some(i) {
            pieces.push(Piece::Frame(Frame::PartAbort { xfer }));
            return pieces;
        }
        pieces.push(Piece::Frame(Frame::Segment { key: 1, offset: *offset, len: *len }));
        pieces.push(Piece::Payload(*len as usize));
    }
    pieces.push(Piece::Frame(Frame::PartEnd { segments: segments.len() as u64, bytes: total }));
    pieces
}

/// Segments inside the ticket, none empty.
fn segments_in_ticket() -> impl Strategy<Value = Vec<(u64, u64)>> {
    proptest::collection::vec((TICKET_FROM..TICKET_TO, 1u64..300), 0..4)
        .prop_map(|v| v.into_iter().map(|(off, len)| (off, len.min(TICKET_TO - off))).collect())
}

#[derive(Debug, Clone)]
enum PartKind {
    Whole,
    /// Aborted before its segment `n` (the earlier ones are written).
    Aborted(usize),
    /// Under a ticket the receiver does not expect: refused, its bytes discarded.
    Unexpected,
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// Anything a hostile sender can put on a lane: nothing outside the ticket is written, no part is
    /// answered twice, and a lane that ends cleanly answered every part it began.
    #[test]
    fn hostile_lane_streams_never_write_outside_the_ticket(
        pieces in proptest::collection::vec(piece_strategy(1), 0..14),
        cuts in proptest::collection::vec(any::<usize>(), 0..6),
        end in prop_oneof![Just(None), Just(Some(SourceError::Reset(1))), Just(Some(SourceError::ConnectionLost("gone".into())))],
    ) {
        let mut arena = Arena::new();
        let served = run_lane(split(serialise(&pieces), &cuts), end, &mut arena);
        assert_only_ticket_range_written(&arena);
        for r in &served.replies {
            reply_xfer(r);
        }
        // Raw pieces may hide a PART_BEGIN: count the parts only when every frame is a whole one.
        if !pieces.iter().any(|p| matches!(p, Piece::Raw(_))) {
            prop_assert!(served.replies.len() <= begins(&pieces), "{} replies for {} parts: {:?}", served.replies.len(), begins(&pieces), served);
            if served.end == LaneEnd::Closed {
                prop_assert_eq!(served.replies.len(), begins(&pieces), "a cleanly ended lane answers every part: {:?}", served);
            }
        }
        if served.end == LaneEnd::Closed {
            prop_assert!(served.in_part.is_none());
        }
        if let LaneEnd::Violation(why) | LaneEnd::Lost(why) = &served.end {
            prop_assert!(!why.is_empty());
        }
    }

    /// Hostile bytes after well-formed parts (some refused and being discarded when the tail starts):
    /// the parts before the tail are answered in order, nothing outside the ticket is written.
    #[test]
    fn hostile_tails_after_good_parts_never_write_outside_the_ticket(
        good in proptest::collection::vec((segments_in_ticket(), any::<bool>()), 0..4),
        cut_into_last in any::<bool>(),
        tail in proptest::collection::vec(piece_strategy(1), 0..10),
        cuts in proptest::collection::vec(any::<usize>(), 0..6),
    ) {
        let mut pieces = Vec::new();
        for (i, (segments, expected)) in good.iter().enumerate() {
            let ticket = if *expected { TICKET } else { TICKET + 1 };
            pieces.extend(part_pieces(200 + i as u64, ticket, segments, None));
        }
        let whole_parts = good.len() - usize::from(cut_into_last && !good.is_empty());
        if whole_parts < good.len() {
            // The last part loses its PART_END: the tail lands inside it (writing or discarding).
            pieces.pop();
        }
        pieces.extend(tail);
        let mut arena = Arena::new();
        let served = run_lane(split(serialise(&pieces), &cuts), None, &mut arena);
        assert_only_ticket_range_written(&arena);
        prop_assert!(served.replies.len() >= whole_parts, "{:?}", served);
        for (i, r) in served.replies.iter().take(whole_parts).enumerate() {
            prop_assert_eq!(reply_xfer(r), 200 + i as u64, "{:?}", served);
            let expected = good[i].1;
            prop_assert_eq!(matches!(r, Frame::Done { .. }), expected, "{:?}", served);
        }
    }

    /// Well-formed parts back to back on one lane (whole, aborted, or under an unexpected ticket): each is
    /// answered once and in order, and exactly the bytes of the accepted pieces land.
    #[test]
    fn parts_back_to_back_are_each_answered_once_in_order(
        parts in proptest::collection::vec((segments_in_ticket(), prop_oneof![
            3 => Just(PartKind::Whole),
            1 => (0usize..4).prop_map(PartKind::Aborted),
            1 => Just(PartKind::Unexpected),
        ]), 1..6),
        cuts in proptest::collection::vec(any::<usize>(), 0..8),
    ) {
        let mut pieces = Vec::new();
        let mut expected_replies = Vec::new();
        let mut expected_memory = vec![CANARY; REGION];
        for (i, (segments, kind)) in parts.iter().enumerate() {
            let xfer = 100 + i as u64;
            match kind {
                PartKind::Whole => {
                    pieces.extend(part_pieces(xfer, TICKET, segments, None));
                    let total: u64 = segments.iter().map(|s| s.1).sum();
                    expected_replies.push(Frame::Done { xfer, bytes: total });
                    for (off, len) in segments {
                        expected_memory[*off as usize..(*off + *len) as usize].fill(0xAB);
                    }
                }
                PartKind::Aborted(n) => {
                    let n = (*n).min(segments.len());
                    if n == segments.len() {
                        // Past its last segment there is nothing to abort: the part ends whole.
                        pieces.extend(part_pieces(xfer, TICKET, segments, None));
                        let total: u64 = segments.iter().map(|s| s.1).sum();
                        expected_replies.push(Frame::Done { xfer, bytes: total });
                    } else {
                        pieces.extend(part_pieces(xfer, TICKET, segments, Some(n)));
                        let written: u64 = segments[..n].iter().map(|s| s.1).sum();
                        expected_replies.push(Frame::CancelAck { xfer, bytes: written });
                    }
                    for (off, len) in &segments[..n] {
                        expected_memory[*off as usize..(*off + *len) as usize].fill(0xAB);
                    }
                }
                PartKind::Unexpected => {
                    pieces.extend(part_pieces(xfer, TICKET + 1, segments, None));
                    expected_replies.push(Frame::Refused { xfer, reason: ReasonCode::NOT_EXPECTED.0, message: String::new() });
                }
            }
        }
        let mut arena = Arena::new();
        let served = run_lane(split(serialise(&pieces), &cuts), None, &mut arena);
        prop_assert_eq!(&served.end, &LaneEnd::Closed, "{:?}", served);
        prop_assert_eq!(served.replies.len(), expected_replies.len(), "{:?}", served);
        for (got, want) in served.replies.iter().zip(&expected_replies) {
            match (got, want) {
                (Frame::Refused { xfer, reason, message }, Frame::Refused { xfer: w, reason: wr, .. }) => {
                    prop_assert_eq!((xfer, reason), (w, wr));
                    prop_assert!(!message.is_empty());
                }
                _ => prop_assert_eq!(got, want),
            }
        }
        prop_assert!(arena.memory[GUARD..GUARD + REGION] == expected_memory[..], "the region differs from the accepted pieces");
        assert_only_ticket_range_written(&arena);
    }

    /// Two parts cut short anywhere: the part in progress is never confirmed; a clean end mid-part is a
    /// violation and a reset answers it CANCEL_ACK.
    #[test]
    fn truncated_lanes_never_confirm_the_part_in_progress(cut_at in 0usize..400, end in prop_oneof![Just(None), Just(Some(SourceError::Reset(1)))]) {
        let mut pieces = part_pieces(1, TICKET, &[(TICKET_FROM, 100)], None);
        pieces.extend(part_pieces(2, TICKET, &[(TICKET_FROM + 200, 50), (TICKET_FROM + 300, 50)], None));
        let first_len = serialise(&pieces[..4]).len();
        let mut bytes = serialise(&pieces);
        let full = bytes.len();
        bytes.truncate(cut_at.min(full - 1));
        let cut = bytes.len();
        let mut arena = Arena::new();
        let served = run_lane(vec![Bytes::from(bytes)], end.clone(), &mut arena);
        let done: Vec<u64> = served.replies.iter().filter(|r| matches!(r, Frame::Done { .. })).map(reply_xfer).collect();
        if cut < first_len {
            prop_assert!(done.is_empty(), "{:?}", served);
        } else {
            prop_assert_eq!(done, vec![1], "{:?}", served);
        }
        // Cut inside a frame or a part (a clean end there is a violation).
        let mid_stream = cut != 0 && cut != first_len;
        // A part began (its whole PART_BEGIN arrived) and did not end.
        let begin_bytes = 33;
        let part_begun = (begin_bytes..first_len).contains(&cut) || cut >= first_len + begin_bytes;
        match (&served.end, &end) {
            (LaneEnd::Violation(why), None) => prop_assert!(mid_stream && !why.is_empty(), "{:?}", served),
            (LaneEnd::Closed, None) => prop_assert!(!mid_stream, "{:?}", served),
            (LaneEnd::Reset(1), Some(_)) => {
                let acks = served.replies.iter().filter(|r| matches!(r, Frame::CancelAck { .. })).count();
                prop_assert_eq!(acks, usize::from(part_begun), "{:?}", served);
                prop_assert_eq!(served.in_part.is_some(), part_begun, "{:?}", served);
            }
            _ => prop_assert!(false, "unexpected end {:?} for a lane cut at {} of {}", served, cut, full),
        }
        assert_only_ticket_range_written(&arena);
    }

    /// Whatever bytes arrive as replies, the sender's decoder returns a frame or a reason, never panics,
    /// and reads every well-formed frame back as it was encoded.
    #[test]
    fn reply_decoding_never_panics_and_round_trips(
        frames in proptest::collection::vec(frame_strategy(1), 0..8),
        garbage in proptest::collection::vec(any::<u8>(), 0..64),
        cuts in proptest::collection::vec(any::<usize>(), 0..6),
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let mut encoded = Vec::new();
        for f in &frames {
            f.encode(&mut encoded);
        }
        let mut reader = FrameReader::new(MemorySource::new(split(encoded, &cuts), None));
        let read: Vec<Frame> = runtime.block_on(async {
            let mut out = Vec::new();
            while let Ok(Some(f)) = reader.read_frame().await {
                out.push(f);
            }
            out
        });
        prop_assert_eq!(read, frames);
        let mut reader = FrameReader::new(MemorySource::new(split(garbage, &cuts), None));
        runtime.block_on(async {
            for _ in 0..64 {
                match reader.read_frame().await {
                    Ok(Some(_)) => continue,
                    Ok(None) => break,
                    Err(ReadFail::Malformed(e)) => { assert!(!e.0.is_empty()); break }
                    Err(ReadFail::Truncated(why)) => { assert!(!why.is_empty()); break }
                    Err(ReadFail::Source(e)) => panic!("memory source failed: {e:?}"),
                }
            }
        });
    }

    #[test]
    fn endpoint_and_remote_key_decoders_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        let _ = EndpointInfo::decode(&bytes);
        let _ = RemoteKeyInfo::decode(&bytes);
    }

    #[test]
    fn endpoint_bytes_round_trip(instance in any::<u64>(), fp in any::<[u8; 32]>(), ports in proptest::collection::vec(any::<u16>(), 1..5)) {
        let addresses = ports.iter().map(|p| std::net::SocketAddr::from(([10, 0, 0, 1], *p))).collect();
        let info = EndpointInfo { wire_version: 2, instance, fingerprint: fp, addresses };
        prop_assert_eq!(EndpointInfo::decode(&info.encode()).unwrap(), info);
    }
}

#[test]
fn a_refused_part_is_discarded_and_the_next_part_is_served() {
    // Part 1's second segment runs past the region: refused before a byte of it is written, the rest
    // of the part (its payload and a third segment) is read and dropped; part 2 lands.
    let mut pieces = vec![
        Piece::Frame(Frame::PartBegin { xfer: 1, ticket: TICKET, part_index: 0, part_count: 1, bytes: 30 }),
        Piece::Frame(Frame::Segment { key: 1, offset: TICKET_FROM, len: 10 }),
        Piece::Payload(10),
        Piece::Frame(Frame::Segment { key: 1, offset: REGION as u64 - 5, len: 10 }),
        Piece::Payload(10),
        Piece::Frame(Frame::Segment { key: 1, offset: TICKET_FROM + 20, len: 10 }),
        Piece::Payload(10),
        Piece::Frame(Frame::PartEnd { segments: 3, bytes: 30 }),
    ];
    pieces.extend(part_pieces(2, TICKET, &[(TICKET_FROM + 100, 7)], None));
    let mut arena = Arena::new();
    let served = run_lane(vec![Bytes::from(serialise(&pieces))], None, &mut arena);
    assert_eq!(served.end, LaneEnd::Closed, "{served:?}");
    assert_eq!(served.replies.len(), 2, "{served:?}");
    match &served.replies[0] {
        Frame::Refused { xfer: 1, reason, .. } => assert_eq!(ReasonCode(*reason), ReasonCode::OUT_OF_RANGE),
        other => panic!("expected a refusal of part 1, got {other:?}"),
    }
    assert_eq!(served.replies[1], Frame::Done { xfer: 2, bytes: 7 });
    assert_eq!(served.refused, vec![PartId { xfer: 1, ticket: Ticket(TICKET) }]);
    let m = &arena.memory;
    let at = |off: u64| GUARD + off as usize;
    assert!(
        m[at(TICKET_FROM)..at(TICKET_FROM + 10)].iter().all(|&b| b == 0xAB),
        "the first segment was written before the refusal"
    );
    assert!(
        m[at(TICKET_FROM + 20)..at(TICKET_FROM + 30)].iter().all(|&b| b == CANARY),
        "a segment after the refusal was written"
    );
    assert!(m[at(TICKET_FROM + 100)..at(TICKET_FROM + 107)].iter().all(|&b| b == 0xAB));
    assert!(m[GUARD + REGION..].iter().all(|&b| b == CANARY));
    assert_only_ticket_range_written(&arena);
}

#[test]
fn an_unknown_frame_type_is_a_violation() {
    let mut arena = Arena::new();
    match run_lane(vec![Bytes::from_static(&[0x7f, 1, 2, 3])], None, &mut arena).end {
        LaneEnd::Violation(why) => assert!(why.contains("0x7f"), "{why}"),
        other => panic!("expected a violation, got {other:?}"),
    }
}

#[test]
fn version_1_lane_frames_are_unknown_now() {
    // LANE_BEGIN (0x10) of wire version 1 with a plausible body.
    let mut old = vec![0x10];
    old.extend_from_slice(&[0u8; 40]);
    let mut arena = Arena::new();
    match run_lane(vec![Bytes::from(old)], None, &mut arena).end {
        LaneEnd::Violation(why) => assert!(why.contains("0x10"), "{why}"),
        other => panic!("expected a violation, got {other:?}"),
    }
}

#[test]
fn empty_segments_and_foreign_aborts_are_violations() {
    let begin = Piece::Frame(Frame::PartBegin { xfer: 5, ticket: TICKET, part_index: 0, part_count: 1, bytes: 10 });
    let cases = [
        (vec![begin.clone(), Piece::Frame(Frame::Segment { key: 1, offset: TICKET_FROM, len: 0 })], "empty SEGMENT"),
        (vec![begin.clone(), Piece::Frame(Frame::PartAbort { xfer: 6 })], "PART_ABORT for transfer 6"),
        (vec![begin.clone(), Piece::Frame(Frame::Done { xfer: 5, bytes: 10 })], "expected SEGMENT"),
        (vec![Piece::Frame(Frame::PartEnd { segments: 0, bytes: 0 })], "expected PART_BEGIN"),
        (
            vec![Piece::Frame(Frame::PartBegin { xfer: 5, ticket: TICKET, part_index: 2, part_count: 2, bytes: 0 })],
            "is not a part",
        ),
    ];
    for (pieces, needle) in cases {
        let mut arena = Arena::new();
        let served = run_lane(vec![Bytes::from(serialise(&pieces))], None, &mut arena);
        match &served.end {
            LaneEnd::Violation(why) => assert!(why.contains(needle), "{needle}: {why}"),
            other => panic!("{needle}: expected a violation, got {other:?}"),
        }
        assert!(served.replies.is_empty(), "{needle}: {served:?}");
        assert!(arena.memory.iter().all(|&b| b == CANARY));
    }
}

#[test]
fn a_refused_message_longer_than_the_limit_is_malformed() {
    let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let mut bytes = vec![frame_type_refused()];
    bytes.extend_from_slice(&9u64.to_le_bytes());
    bytes.extend_from_slice(&1u32.to_le_bytes());
    bytes.extend_from_slice(&((kvgate_plugin_quic::wire::MAX_REFUSAL_MESSAGE_BYTES + 1) as u16).to_le_bytes());
    bytes.extend(std::iter::repeat_n(b'x', 2000));
    let mut reader = FrameReader::new(MemorySource::new([Bytes::from(bytes)], None));
    match runtime.block_on(reader.read_frame()) {
        Err(ReadFail::Malformed(e)) => assert!(e.0.contains("exceeds"), "{e}"),
        other => panic!("expected a malformed frame, got {other:?}"),
    }
}

fn frame_type_refused() -> u8 {
    kvgate_plugin_quic::wire::frame_type::REFUSED
}

#[test]
fn the_end_of_a_stream_is_told_from_trailing_bytes() {
    let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let end = Frame::PartEnd { segments: 1, bytes: 2 }.to_bytes();
    let read = |chunks: Vec<Bytes>, end_with: Option<SourceError>| {
        let mut reader = FrameReader::new(MemorySource::new(chunks, end_with));
        runtime.block_on(async {
            let frame = reader.read_frame().await.expect("frame");
            assert!(matches!(frame, Some(Frame::PartEnd { .. })), "{frame:?}");
            reader.expect_end().await
        })
    };
    assert_eq!(read(vec![Bytes::from(end.clone()), Bytes::new()], None), Ok(true));
    let mut trailing = end.clone();
    trailing.push(0);
    assert_eq!(read(vec![Bytes::from(trailing)], None), Ok(false));
    assert_eq!(read(vec![Bytes::from(end.clone()), Bytes::from_static(&[1])], None), Ok(false));
    let reset = read(vec![Bytes::from(end)], Some(SourceError::Reset(5)));
    assert_eq!(reset, Err(ReadFail::Source(SourceError::Reset(5))));
}
