//! The engine fast lane (`<engine socket>.lane`) through real `kvgate serve` processes: rooms move
//! through it with every byte checked, their terminal events arrive on the lane's watch, engine
//! sessions are shared with gRPC (opened on one, used on the other), and every refusal carries its
//! reason code: an unknown session (the same as on gRPC), an unknown call, too many calls in flight,
//! a frame at `engine_api.lane_max_frame_bytes` (served) and one byte past it (refused, connection
//! closed, logged), a frame that is not a request.

mod common;

use common::*;
use kvgate_client::lane::lane_socket_path;
use kvgate_client::lane_frame::{encode_frame, FrameBuffer};
use kvgate_client::proto::{self, lane_reply::Reply, lane_request::Call};
use kvgate_client::{reason_of, room_key, slice, Client, LaneClient};
use kvgate_demo::gateways::{GatewayPair, PairSettings, DECODE_NAME, PREFILL_NAME};
use kvgate_demo::pool::{checksum, KvPool};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::mpsc::UnboundedReceiver;

const SLOT: u64 = 256 * 1024;
const SLOTS: u64 = 8;
const WAIT: Duration = Duration::from_secs(20);

/// The next `Terminal` of `room` on a lane watch.
async fn lane_terminal(events: &mut UnboundedReceiver<proto::RoomEvent>, room: u64) -> proto::Terminal {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let event = tokio::time::timeout_at(deadline, events.recv())
            .await
            .unwrap_or_else(|_| panic!("no terminal event for room {room} on the lane"))
            .expect("the lane watch ended");
        if event.key.as_ref().is_some_and(|k| k.room == room) {
            if let Some(proto::room_event::Event::Terminal(t)) = event.event {
                return t;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rooms_move_through_the_lane_with_sessions_shared_with_grpc() {
    let _serial = serial().await;
    let dir = work_dir();
    let mut pair = GatewayPair::start(&binary(), dir.path(), &PairSettings::default()).await.unwrap();
    let mut src = KvPool::create(dir.path(), "lane-src", SLOT, SLOTS).unwrap();
    let mut dst = KvPool::create(dir.path(), "lane-dst", SLOT, SLOTS).unwrap();

    // Decode: the session is opened on gRPC and the pool registered there; the lane works in it.
    let decode_grpc = Client::connect_unix(&pair.decode.socket).await.unwrap();
    let decode_session = decode_grpc.open_session("lane-decode").await.unwrap().session;
    let decode_grpc = decode_grpc.in_session(decode_session);
    let dst_region =
        decode_grpc.register_shared_memory(&dst.path.display().to_string(), 0, dst.len(), "dst").await.unwrap();
    let decode = LaneClient::connect(lane_socket_path(&pair.decode.socket)).await.unwrap().in_session(decode_session);
    let mut decode_events = decode.watch_outcomes(None).await.unwrap();

    // Prefill: the session is opened on the lane; gRPC registers the pool in it.
    let prefill = LaneClient::connect(lane_socket_path(&pair.prefill.socket)).await.unwrap();
    let reply = prefill.open_session("lane-prefill").await.unwrap();
    let prefill = prefill.in_session(reply.session);
    let prefill_grpc = Client::connect_unix(&pair.prefill.socket).await.unwrap().in_session(reply.session);
    let src_region =
        prefill_grpc.register_shared_memory(&src.path.display().to_string(), 0, src.len(), "src").await.unwrap();
    let mut prefill_events = prefill.watch_outcomes(None).await.unwrap();
    let info = prefill.info().await.unwrap();
    assert_eq!(info.gateway, PREFILL_NAME);

    // Rooms one by one, then a batch of the rest in flight at once, every slot's bytes checked.
    let expect = |room: u64, s: u64| proto::ExpectRequest {
        key: Some(room_key(room, 0)),
        peer: PREFILL_NAME.into(),
        parts: vec![proto::PartSlices { slices: vec![slice(dst_region, s * SLOT, SLOT)], ..Default::default() }],
        ..Default::default()
    };
    let send = |room: u64, s: u64| proto::SendRequest {
        key: Some(room_key(room, 0)),
        slices: vec![slice(src_region, s * SLOT, SLOT)],
        last: true,
        peer: DECODE_NAME.into(),
        ..Default::default()
    };
    let mut sums = Vec::new();
    for s in 0..SLOTS {
        sums.push(src.fill(s, 100 + s));
        dst.clear(s);
    }
    for s in 0..2 {
        let room = 9_100 + s;
        let (e, p) = tokio::join!(decode.expect(expect(room, s)), prefill.send(send(room, s)));
        e.unwrap();
        p.unwrap();
        let (d, p) = (lane_terminal(&mut decode_events, room).await, lane_terminal(&mut prefill_events, room).await);
        assert!(d.succeeded && p.succeeded, "{d:?} {p:?}\n{}", pair.decode.log());
    }
    let rooms: Vec<u64> = (2..SLOTS).map(|s| 9_200 + s).collect();
    let expects = rooms.iter().zip(2..).map(|(r, s)| expect(*r, s)).collect();
    let sends = rooms.iter().zip(2..).map(|(r, s)| send(*r, s)).collect();
    let (e, p) = tokio::join!(decode.expect_batch(expects), prefill.send_batch(sends));
    assert_eq!(e.unwrap().accepted as usize, rooms.len());
    assert_eq!(p.unwrap().accepted as usize, rooms.len());
    // The batch's rooms end in any order: take terminals as they come until every room has one.
    let mut open: std::collections::HashSet<u64> = rooms.iter().copied().collect();
    let deadline = tokio::time::Instant::now() + WAIT;
    while !open.is_empty() {
        let event = tokio::time::timeout_at(deadline, decode_events.recv())
            .await
            .unwrap_or_else(|_| panic!("no terminal event on the lane for rooms {open:?}"))
            .expect("the lane watch ended");
        if let (Some(key), Some(proto::room_event::Event::Terminal(t))) = (event.key.as_ref(), event.event) {
            if open.remove(&key.room) {
                assert!(t.succeeded, "room {}: {t:?}", key.room);
            }
        }
    }
    for s in 0..SLOTS {
        assert_eq!(checksum(dst.slot(s)), sums[s as usize], "slot {s}: every byte landed");
    }
    // The same room seen from gRPC, the lane's rooms in its session's books.
    let room = decode_grpc.get_room(room_key(9_100, 0)).await.unwrap();
    assert_eq!(room.state, "succeeded");
    pair.stop();
    assert!(!lane_socket_path(&pair.decode.socket).exists(), "the lane socket is removed at stop");
}

/// A raw lane connection, to send frames the client never would.
struct RawLane {
    stream: UnixStream,
    buf: FrameBuffer,
}

impl RawLane {
    async fn connect(socket: &std::path::Path) -> RawLane {
        RawLane { stream: UnixStream::connect(lane_socket_path(socket)).await.unwrap(), buf: FrameBuffer::default() }
    }

    async fn write(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.unwrap();
    }

    /// The next reply; `None` once the gateway closed the connection.
    async fn reply(&mut self) -> Option<proto::LaneReply> {
        loop {
            if let Some(body) = self.buf.take(1 << 20).unwrap() {
                return Some(<proto::LaneReply as prost::Message>::decode(body).unwrap());
            }
            let read = tokio::time::timeout(WAIT, self.stream.read_buf(self.buf.spare())).await.expect("a reply");
            if read.unwrap_or(0) == 0 {
                return None;
            }
        }
    }
}

fn frame(request: proto::LaneRequest) -> Vec<u8> {
    let mut out = Vec::new();
    encode_frame(&request, &mut out);
    out
}

fn error_of(reply: &proto::LaneReply) -> &proto::LaneError {
    match &reply.reply {
        Some(Reply::Error(e)) => e,
        other => panic!("expected an error, got {other:?}"),
    }
}

/// An abort whose frame body is exactly `len` bytes (its `why` padded).
fn abort_of_len(id: u64, len: usize) -> Vec<u8> {
    let mut pad = len as i64 - 16;
    loop {
        let why = "x".repeat(pad.max(0) as usize);
        let request = proto::LaneRequest {
            id,
            session: None,
            call: Some(Call::Abort(proto::AbortRequest { key: Some(room_key(77, 0)), why })),
        };
        let missing = len as i64 - prost::Message::encoded_len(&request) as i64;
        if missing == 0 {
            return frame(request);
        }
        pad += missing;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lane_refusals_carry_their_reason_codes() {
    let _serial = serial().await;
    let dir = work_dir();
    let env = vec![
        ("KVGATE__ENGINE_API__LANE_MAX_FRAME_BYTES".to_string(), "4096".to_string()),
        ("KVGATE__ENGINE_API__LANE_MAX_CALLS_IN_FLIGHT".to_string(), "4".to_string()),
    ];
    let settings = PairSettings { env_decode: env, ..PairSettings::default() };
    let mut pair = GatewayPair::start(&binary(), dir.path(), &settings).await.unwrap();
    let socket = pair.decode.socket.clone();

    // An unknown session: the same reason code as on gRPC.
    let expect = proto::ExpectRequest {
        key: Some(room_key(1, 0)),
        peer: PREFILL_NAME.into(),
        parts: vec![proto::PartSlices { slices: vec![slice(1, 0, 8)], ..Default::default() }],
        ..Default::default()
    };
    let lane = LaneClient::connect(lane_socket_path(&socket)).await.unwrap();
    let e = lane.in_session(987_654).expect(expect.clone()).await.unwrap_err();
    let grpc = Client::connect_unix(&socket).await.unwrap().in_session(987_654);
    let status = grpc.expect_request(expect).await.unwrap_err();
    assert_eq!(e.reason(), "unknown_session", "{e}");
    assert_eq!(reason_of(&status).as_deref(), Some(e.reason()));
    assert_eq!(e.code, status.code());
    // A second watch on one connection.
    let _events = lane.watch_outcomes(None).await.unwrap();
    assert_eq!(lane.watch_outcomes(None).await.unwrap_err().reason(), "too_many_watchers");

    // An unknown call: refused by id, the connection goes on.
    let mut raw = RawLane::connect(&socket).await;
    raw.write(&frame(proto::LaneRequest { id: 5, session: None, call: None })).await;
    let reply = raw.reply().await.unwrap();
    assert_eq!((reply.id, error_of(&reply).reason.as_str()), (5, "unknown_call"));

    // Calls in flight: at most 4 on one connection; five written at once, the fifth is refused.
    let mut five = Vec::new();
    for id in 10..15 {
        five.extend(frame(proto::LaneRequest { id, session: None, call: Some(Call::Info(proto::InfoRequest {})) }));
    }
    raw.write(&five).await;
    let mut refused = Vec::new();
    for _ in 0..5 {
        let reply = raw.reply().await.unwrap();
        if let Some(Reply::Error(e)) = &reply.reply {
            refused.push((reply.id, e.reason.clone()));
        }
    }
    assert_eq!(refused, vec![(14, "too_many_calls_in_flight".to_string())]);

    // A frame of exactly engine_api.lane_max_frame_bytes is served.
    raw.write(&abort_of_len(20, 4096)).await;
    let reply = raw.reply().await.unwrap();
    assert!(matches!(reply.reply, Some(Reply::Abort(_))), "{reply:?}");
    assert_eq!(reply.id, 20);
    // One byte past it: an error frame, then the connection is closed.
    raw.write(&abort_of_len(21, 4097)).await;
    let reply = raw.reply().await.unwrap();
    assert_eq!((reply.id, error_of(&reply).reason.as_str()), (0, "frame_too_large"));
    assert!(error_of(&reply).message.contains("engine_api.lane_max_frame_bytes = 4096"), "{reply:?}");
    assert!(raw.reply().await.is_none(), "closed after frame_too_large");

    // A frame that is not a request.
    let mut raw = RawLane::connect(&socket).await;
    raw.write(&[3, 0, 0, 0, 0xff, 0xff, 0xff]).await;
    let reply = raw.reply().await.unwrap();
    assert_eq!((reply.id, error_of(&reply).reason.as_str()), (0, "bad_frame"));
    assert!(raw.reply().await.is_none(), "closed after bad_frame");

    // Both ends of a connection are logged with their reason.
    let log = pair.decode.log();
    assert!(log.contains("frame_too_large") && log.contains("bad_frame"), "{log}");
    pair.stop();
}
