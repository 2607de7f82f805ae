//! Property tests of the receiver's frame decoding: hostile, malformed and truncated lane streams end
//! with a reason (refused, violation, cancelled, lost) and never panic or write outside the bytes the
//! ticket authorises. Endpoint and remote-key decoders never panic either.

use bytes::Bytes;
use kvgate_abi::{LocalRange, MemoryKind, PeerId, RegionDesc, Ticket};
use kvgate_plugin_quic::incoming::{receive_lane, LaneContext, LaneOutcome};
use kvgate_plugin_quic::reader::{FrameReader, MemorySource, SourceError};
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
    prop_oneof![
        (ticket, any::<u32>(), 0u32..4, interesting_u64(), interesting_u64()).prop_map(|(ticket, lane_index, lane_count, segment_count, lane_bytes)| {
            Frame::LaneBegin { xfer: 1, ticket, lane_index: lane_index % 3, lane_count, segment_count: segment_count % 6, lane_bytes }
        }),
        (key, interesting_u64(), interesting_u64()).prop_map(|(key, offset, len)| Frame::Segment { key, offset, len }),
        (0u64..6, interesting_u64()).prop_map(|(segment_count, lane_bytes)| Frame::LaneEnd { segment_count, lane_bytes }),
        any::<u64>().prop_map(|bytes| Frame::LaneDone { bytes }),
        any::<u64>().prop_map(|bytes| Frame::CancelAck { bytes }),
        (any::<u32>(), ".{0,40}").prop_map(|(reason, message)| Frame::LaneRefused { reason, message }),
        (any::<u32>(), any::<u16>(), any::<u64>()).prop_map(|(magic, version, instance)| Frame::Hello { magic, version, instance }),
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

fn run_lane(chunks: Vec<Bytes>, end: Option<SourceError>, arena: &mut Arena) -> LaneOutcome {
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
    let ctx = LaneContext { peer: PEER, tickets: &tickets, regions: &regions, max_segments: 1 << 20 };
    let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let mut reader = FrameReader::new(MemorySource::new(chunks, end));
    runtime.block_on(receive_lane(&mut reader, &ctx)).1
}

fn assert_only_ticket_range_written(arena: &Arena) {
    let m = &arena.memory;
    let from = GUARD + TICKET_FROM as usize;
    let to = GUARD + TICKET_TO as usize;
    assert!(m[..from].iter().all(|&b| b == CANARY), "a byte before the ticket range was written");
    assert!(m[to..].iter().all(|&b| b == CANARY), "a byte after the ticket range was written");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// Anything a hostile sender can put on a lane stream.
    #[test]
    fn hostile_lane_streams_never_write_outside_the_ticket(
        pieces in proptest::collection::vec(piece_strategy(1), 0..12),
        cuts in proptest::collection::vec(any::<usize>(), 0..6),
        end in prop_oneof![Just(None), Just(Some(SourceError::Reset(1))), Just(Some(SourceError::ConnectionLost("gone".into())))],
    ) {
        let mut arena = Arena::new();
        let outcome = run_lane(split(serialise(&pieces), &cuts), end, &mut arena);
        assert_only_ticket_range_written(&arena);
        if let LaneOutcome::Done { bytes } = outcome {
            prop_assert!(bytes <= TICKET_TO - TICKET_FROM, "{bytes} bytes confirmed");
        }
    }

    /// A well-formed lane inside the ticket writes exactly its bytes and is confirmed.
    #[test]
    fn well_formed_lanes_inside_the_ticket_are_done(
        segments in proptest::collection::vec((TICKET_FROM..TICKET_TO, 0u64..300), 0..5),
        cuts in proptest::collection::vec(any::<usize>(), 0..6),
    ) {
        let segments: Vec<(u64, u64)> = segments.into_iter().map(|(off, len)| (off, len.min(TICKET_TO - off))).collect();
        let total: u64 = segments.iter().map(|s| s.1).sum();
        let mut pieces = vec![Piece::Frame(Frame::LaneBegin {
            xfer: 1, ticket: TICKET, lane_index: 0, lane_count: 1, segment_count: segments.len() as u64, lane_bytes: total,
        })];
        for (offset, len) in &segments {
            pieces.push(Piece::Frame(Frame::Segment { key: 1, offset: *offset, len: *len }));
            pieces.push(Piece::Payload(*len as usize));
        }
        pieces.push(Piece::Frame(Frame::LaneEnd { segment_count: segments.len() as u64, lane_bytes: total }));
        let mut arena = Arena::new();
        let outcome = run_lane(split(serialise(&pieces), &cuts), None, &mut arena);
        prop_assert_eq!(outcome, LaneOutcome::Done { bytes: total });
        assert_only_ticket_range_written(&arena);
        for (offset, len) in segments {
            let at = GUARD + offset as usize;
            prop_assert!(arena.memory[at..at + len as usize].iter().all(|&b| b == 0xAB));
        }
    }

    /// The same lane cut short anywhere ends as a violation, a reset or a loss — never as done.
    #[test]
    fn truncated_lanes_are_never_done(cut_at in 0usize..200, end in prop_oneof![Just(None), Just(Some(SourceError::Reset(1)))]) {
        let mut pieces = vec![Piece::Frame(Frame::LaneBegin { xfer: 1, ticket: TICKET, lane_index: 0, lane_count: 1, segment_count: 1, lane_bytes: 100 })];
        pieces.push(Piece::Frame(Frame::Segment { key: 1, offset: TICKET_FROM, len: 100 }));
        pieces.push(Piece::Payload(100));
        pieces.push(Piece::Frame(Frame::LaneEnd { segment_count: 1, lane_bytes: 100 }));
        let mut bytes = serialise(&pieces);
        let full = bytes.len();
        bytes.truncate(cut_at.min(full - 1));
        let mut arena = Arena::new();
        let outcome = run_lane(vec![Bytes::from(bytes)], end.clone(), &mut arena);
        let ended_with_reason = match (&outcome, &end) {
            (LaneOutcome::Violation(why), None) => !why.is_empty(),
            (LaneOutcome::Cancelled { .. }, Some(SourceError::Reset(_))) => true,
            _ => false,
        };
        prop_assert!(ended_with_reason, "{:?} for a lane cut at {} of {}", outcome, cut_at, full);
        assert_only_ticket_range_written(&arena);
    }

    #[test]
    fn endpoint_and_remote_key_decoders_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        let _ = EndpointInfo::decode(&bytes);
        let _ = RemoteKeyInfo::decode(&bytes);
    }

    #[test]
    fn endpoint_bytes_round_trip(instance in any::<u64>(), fp in any::<[u8; 32]>(), ports in proptest::collection::vec(any::<u16>(), 1..5)) {
        let addresses = ports.iter().map(|p| std::net::SocketAddr::from(([10, 0, 0, 1], *p))).collect();
        let info = EndpointInfo { wire_version: 1, instance, fingerprint: fp, addresses };
        prop_assert_eq!(EndpointInfo::decode(&info.encode()).unwrap(), info);
    }
}

#[test]
fn a_segment_past_the_region_is_refused_before_any_byte_is_written() {
    let pieces = [
        Piece::Frame(Frame::LaneBegin { xfer: 1, ticket: TICKET, lane_index: 0, lane_count: 1, segment_count: 1, lane_bytes: 10 }),
        Piece::Frame(Frame::Segment { key: 1, offset: REGION as u64 - 5, len: 10 }),
        Piece::Payload(10),
        Piece::Frame(Frame::LaneEnd { segment_count: 1, lane_bytes: 10 }),
    ];
    let mut arena = Arena::new();
    match run_lane(vec![Bytes::from(serialise(&pieces))], None, &mut arena) {
        LaneOutcome::Refused(r) => assert_eq!(r.reason, kvgate_abi::ReasonCode::OUT_OF_RANGE, "{r:?}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert!(arena.memory.iter().all(|&b| b == CANARY));
}

#[test]
fn an_unknown_frame_type_is_a_violation() {
    let mut arena = Arena::new();
    match run_lane(vec![Bytes::from_static(&[0x7f, 1, 2, 3])], None, &mut arena) {
        LaneOutcome::Violation(why) => assert!(why.contains("0x7f"), "{why}"),
        other => panic!("expected a violation, got {other:?}"),
    }
}

#[test]
fn the_end_of_a_stream_is_told_from_trailing_bytes() {
    let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let end = Frame::LaneEnd { segment_count: 1, lane_bytes: 2 }.to_bytes();
    let read = |chunks: Vec<Bytes>, end_with: Option<SourceError>| {
        let mut reader = FrameReader::new(MemorySource::new(chunks, end_with));
        runtime.block_on(async {
            let frame = reader.read_frame().await.expect("frame");
            assert!(matches!(frame, Some(Frame::LaneEnd { .. })), "{frame:?}");
            reader.expect_end().await
        })
    };
    assert_eq!(read(vec![Bytes::from(end.clone()), Bytes::new()], None), Ok(true));
    let mut trailing = end.clone();
    trailing.push(0);
    assert_eq!(read(vec![Bytes::from(trailing)], None), Ok(false));
    assert_eq!(read(vec![Bytes::from(end.clone()), Bytes::from_static(&[1])], None), Ok(false));
    let reset = read(vec![Bytes::from(end)], Some(SourceError::Reset(5)));
    assert_eq!(reset, Err(kvgate_plugin_quic::reader::ReadFail::Source(SourceError::Reset(5))));
}
