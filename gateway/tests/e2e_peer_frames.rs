//! Large engine calls and the peer link: an expect whose notice is far larger than a fragment
//! crosses the link in fragments while other rooms keep moving, and one whose notice would pass
//! `peer_link.max_frame_bytes` is refused at the engine call instead of breaking the link; a gateway
//! that sends core messages in batches links with one that does not, and rooms move both ways.

mod common;

use common::*;
use kvgate_client::{proto, reason_of, room_key, slice, Slice};
use kvgate_demo::engine::{prepare_slots, run_room, slot_checksum, wait_terminal};
use kvgate_demo::gateways::{GatewayPair, PairSettings, DECODE_NAME, PREFILL_NAME};
use prost::Message;
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(30);
const LIMIT_BYTES: u64 = 1 << 20;

fn settings() -> PairSettings {
    let env = vec![
        ("KVGATE__PEER_LINK__MAX_FRAME_BYTES".to_string(), LIMIT_BYTES.to_string()),
        ("KVGATE__ENGINE_API__MAX_REQUEST_BYTES".to_string(), LIMIT_BYTES.to_string()),
        ("KVGATE__PEER_LINK__FRAME_FRAGMENT_BYTES".to_string(), "4096".to_string()),
    ];
    PairSettings { env_prefill: env.clone(), env_decode: env, ..PairSettings::default() }
}

/// `count` adjacent slices of `len` bytes from `offset` of `region`.
fn many_slices(region: u64, offset: u64, count: u64, len: u64) -> Vec<Slice> {
    (0..count).map(|i| slice(region, offset + i * len, len)).collect()
}

fn expect_request_bytes(room: u64, slices: &[Slice]) -> usize {
    proto::ExpectRequest {
        key: Some(room_key(room, 0)),
        peer: PREFILL_NAME.to_string(),
        parts: vec![proto::PartSlices { slices: slices.to_vec(), source_kind: String::new() }],
        timeout_ms: None,
        part_peers: Vec::new(),
    }
    .encoded_len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expect_hundreds_of_fragments_long_crosses_the_link_and_other_rooms_keep_moving() {
    let _serial = serial().await;
    let dir = work_dir();
    let mut pair = GatewayPair::start(&binary(), dir.path(), &settings()).await.unwrap();
    let shape = small_shape();
    let prefill = engine(dir.path(), &pair.prefill.socket, "prefill", &shape, 4).await;
    let decode = engine(dir.path(), &pair.decode.socket, "decode", &shape, 4).await;

    // One part of 16 384 slices of 128 bytes (one 2 MiB slot): a notice of ~150 KiB, 40-odd
    // fragments of 4 KiB.
    let room = 7100;
    let expected = prepare_slots(&prefill, &decode, room, 0, 0).await.unwrap();
    let slot_bytes = shape.request_bytes();
    let (src, dst) = {
        let (p, d) = (prefill.pool.lock().unwrap(), decode.pool.lock().unwrap());
        (p.slot_offset(0), d.slot_offset(0))
    };
    let slices = many_slices(decode.region, dst, slot_bytes / 128, 128);
    assert!(expect_request_bytes(room, &slices) > 100 << 10, "the notice is many fragments long");
    let mut p_rx = prefill.events.listen(room);
    let mut d_rx = decode.events.listen(room);
    let started = Instant::now();
    decode.client.expect(room_key(room, 0), PREFILL_NAME, vec![slices], 0).await.unwrap();
    let send = proto::SendRequest {
        key: Some(room_key(room, 0)),
        part: 0,
        chunk: 0,
        slices: vec![slice(prefill.region, src, slot_bytes)],
        last: true,
        peer: DECODE_NAME.to_string(),
        offset: None,
    };
    // Rooms of the ordinary shape run beside it, before and after.
    let (sent, other) = tokio::join!(prefill.client.send(send), run_room(&prefill, &decode, &shape, 7101, 1, 1));
    sent.unwrap();
    let (p, d) = tokio::join!(wait_terminal(&mut p_rx, started, WAIT), wait_terminal(&mut d_rx, started, WAIT));
    assert!(p.unwrap().succeeded && d.unwrap().succeeded);
    assert_eq!(slot_checksum(&decode, 0).await.unwrap(), expected, "the bytes landed where the 16 384 slices say");
    assert!(other.unwrap().verified);
    assert!(run_room(&prefill, &decode, &shape, 7102, 2, 2).await.unwrap().verified);
    for log in [pair.prefill.log(), pair.decode.log()] {
        assert!(!log.contains("peer link lost"), "the link was lost:\n{log}");
    }
    pair.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expect_whose_notice_would_pass_the_frame_limit_is_refused_and_the_link_stays_up() {
    let _serial = serial().await;
    let dir = work_dir();
    let mut pair = GatewayPair::start(&binary(), dir.path(), &settings()).await.unwrap();
    let shape = small_shape();
    let prefill = engine(dir.path(), &pair.prefill.socket, "prefill", &shape, 8).await;
    let decode = engine(dir.path(), &pair.decode.socket, "decode", &shape, 8).await;
    // The most 16-byte slices whose request still fits max_request_bytes: its notice (the same
    // slices, plus tickets, deadline and envelopes) does not fit max_frame_bytes.
    let room = 7200;
    let mut count = 60_000;
    while expect_request_bytes(room, &many_slices(decode.region, 0, count + 1, 16)) <= LIMIT_BYTES as usize - 8 {
        count += 1;
    }
    let slices = many_slices(decode.region, 0, count, 16);
    assert!(expect_request_bytes(room, &slices) <= LIMIT_BYTES as usize);
    let e = decode.client.expect(room_key(room, 0), PREFILL_NAME, vec![slices], 0).await.unwrap_err();
    assert_eq!(reason_of(&e).as_deref(), Some("frame_too_large"), "{e:?}");
    assert!(e.message().contains("peer_link.max_frame_bytes"), "{}", e.message());
    // Well under the limit: accepted (and aborted, as it has no sender).
    decode
        .client
        .expect(room_key(room + 1, 0), PREFILL_NAME, vec![many_slices(decode.region, 0, 1024, 16)], 0)
        .await
        .unwrap();
    decode.client.abort(room_key(room + 1, 0), "test done").await.unwrap();
    assert!(run_room(&prefill, &decode, &shape, room + 2, 0, 4).await.unwrap().verified);
    pair.stop();
}

/// Starts a pair with `key` set to `prefill_value` / `decode_value` (a `KVGATE__...` override) and
/// moves eight rooms from `first_room` through it, each verified. The caller stops the pair.
async fn pair_moving_rooms(
    dir: &std::path::Path,
    key: &str,
    (prefill_value, decode_value): (&str, &str),
    first_room: u64,
) -> GatewayPair {
    let mut s = settings();
    s.env_prefill.push((key.into(), prefill_value.into()));
    s.env_decode.push((key.into(), decode_value.into()));
    let pair = GatewayPair::start(&binary(), dir, &s).await.unwrap();
    let shape = small_shape();
    let prefill = engine(dir, &pair.prefill.socket, "prefill", &shape, 8).await;
    let decode = engine(dir, &pair.decode.socket, "decode", &shape, 8).await;
    let rooms = (0..8u64).map(|i| run_room(&prefill, &decode, &shape, first_room + i, i, i));
    for result in futures_util::future::join_all(rooms).await {
        let result = result.unwrap();
        assert!(result.verified, "{key}: prefill {prefill_value}, decode {decode_value}: {result:?}");
    }
    pair
}

/// `peer_link.core_batch = false` on one side: that side announces no `core_batch` feature, so the
/// other sends it one frame per message and neither sends a `CoreBatch`; with it on both sides, rooms
/// in flight together leave in batches. Every room arrives intact either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batching_gateway_and_one_without_batches_move_rooms_together() {
    let _serial = serial().await;
    for (prefill_batches, decode_batches) in [("false", "true"), ("true", "false"), ("true", "true")] {
        let dir = work_dir();
        let mut pair =
            pair_moving_rooms(dir.path(), "KVGATE__PEER_LINK__CORE_BATCH", (prefill_batches, decode_batches), 7300)
                .await;
        for log in [pair.prefill.log(), pair.decode.log()] {
            assert!(!log.contains("undecodable"), "{log}");
        }
        let mut batches = 0.0;
        for admin in [&pair.prefill.admin, &pair.decode.admin] {
            assert!(metric(admin, "kvgate_peer_core_messages_total").await >= 8.0, "every room sends core messages");
            batches += metric(admin, "kvgate_peer_core_batches_total").await;
        }
        match (prefill_batches, decode_batches) {
            ("true", "true") => assert!(batches > 0.0, "rooms in flight together left in no batch"),
            _ => assert_eq!(batches, 0.0, "a batch went to a gateway that does not take them"),
        }
        pair.stop();
    }
}

/// `peer_link.transport` on each side: the dialling gateway's choice carries the link (decode dials,
/// its name sorts first), the listener takes either, and rooms move intact on both. The link's
/// transport is in both gateways' "peer link up" lines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn framed_and_grpc_links_carry_rooms_whichever_side_asks_for_which() {
    let _serial = serial().await;
    for (prefill_transport, decode_transport) in [("grpc", "framed"), ("framed", "grpc"), ("framed", "framed")] {
        let dir = work_dir();
        let mut pair =
            pair_moving_rooms(dir.path(), "KVGATE__PEER_LINK__TRANSPORT", (prefill_transport, decode_transport), 7400)
                .await;
        for log in [pair.prefill.log(), pair.decode.log()] {
            let up = log.lines().find(|l| l.contains("peer link up")).unwrap_or_else(|| panic!("no link up: {log}"));
            assert!(
                up.contains(&format!("transport=\"{decode_transport}\""))
                    || up.contains(&format!("transport={decode_transport}")),
                "{up}"
            );
        }
        pair.stop();
    }
}

#[test]
fn a_request_limit_above_the_frame_limit_is_refused_by_config_check() {
    let dir = work_dir();
    let config = dir.path().join("g.toml");
    let check = |text: &str| {
        std::fs::write(&config, text).unwrap();
        let out = std::process::Command::new(binary())
            .args(["config", "check"])
            .arg(&config)
            .env_remove("RUST_LOG")
            .output()
            .unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stderr).to_string())
    };
    let auth = "[peer_link]\nauth = \"none\"\n";
    // 128 MiB requests over the default 64 MiB frames: the configuration that broke the link.
    let (code, err) = check(&format!("{auth}[engine_api]\nmax_request_bytes = 134217728\n"));
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("engine_api.max_request_bytes") && err.contains("peer_link.max_frame_bytes"), "{err}");
    // Equal: accepted; one byte more: refused.
    assert_eq!(
        check(&format!("{auth}max_frame_bytes = 2097152\n[engine_api]\nmax_request_bytes = 2097152\n")).0,
        Some(0)
    );
    assert_eq!(
        check(&format!("{auth}max_frame_bytes = 2097152\n[engine_api]\nmax_request_bytes = 2097153\n")).0,
        Some(2)
    );
    // Each limit at and just past its bounds.
    assert_eq!(check(&format!("{auth}max_frame_bytes = 1048576\n[engine_api]\nmax_request_bytes = 4096\n")).0, Some(0));
    assert_eq!(check(&format!("{auth}max_frame_bytes = 1048575\n[engine_api]\nmax_request_bytes = 4096\n")).0, Some(2));
    assert_eq!(check(&format!("{auth}max_frame_bytes = 1073741824\n")).0, Some(0));
    assert_eq!(check(&format!("{auth}max_frame_bytes = 1073741825\n")).0, Some(2));
    assert_eq!(check(&format!("{auth}frame_fragment_bytes = 4096\n")).0, Some(0));
    assert_eq!(check(&format!("{auth}frame_fragment_bytes = 4095\n")).0, Some(2));
    assert_eq!(check(&format!("{auth}frame_fragment_bytes = 16777216\n")).0, Some(0));
    assert_eq!(check(&format!("{auth}frame_fragment_bytes = 16777217\n")).0, Some(2));
}
