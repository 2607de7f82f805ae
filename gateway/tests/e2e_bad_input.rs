//! Bad input gets a clear error with a reason code and changes nothing: malformed or out-of-range
//! configuration, unknown regions, slices out of range, mismatched lengths, a second expect for a
//! live room, a wrong bearer token, a peer with a certificate from the wrong CA.

mod common;

use common::pki::{leaf, leaf_named, pki, tls_toml};
use common::*;
use kvgate_client::{proto, reason_of, room_key, slice, Client};
use kvgate_demo::engine::{expect_into, run_room, send_all};
use kvgate_demo::gateways::{GatewayPair, PairSettings, DECODE_NAME, PREFILL_NAME};
use std::process::Command;
use std::time::Duration;

#[test]
fn serve_refuses_a_typo_and_an_out_of_range_limit_naming_the_key() {
    let dir = work_dir();
    for (text, expected) in [
        ("[peer_link]\nheartbeat_intervall_ms = 100\n", "heartbeat_intervall_ms"),
        ("[peer_link]\nheartbeat_misses = 1\n", "peer_link.heartbeat_misses = 1 is not allowed (allowed: 2..=100)"),
        ("[scheduler]\nmax_inflight_rooms = 0\n", "scheduler.max_inflight_rooms = 0"),
        ("[gateway\nname = \"x\"\n", "invalid configuration"),
    ] {
        let path = dir.path().join("bad.toml");
        std::fs::write(&path, text).unwrap();
        let out = Command::new(binary()).args(["serve", "--config"]).arg(&path).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{text}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(expected), "{text}: {stderr}");
    }
}

fn status_reason(result: Result<impl std::fmt::Debug, tonic::Status>) -> String {
    match result {
        Ok(v) => panic!("accepted: {v:?}"),
        Err(s) => reason_of(&s).unwrap_or_else(|| format!("no reason in {s:?}")),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_engine_calls_are_refused_with_a_reason_and_change_nothing() {
    let _serial = serial().await;
    let dir = work_dir();
    let mut pair = GatewayPair::start(&binary(), dir.path(), &PairSettings::default()).await.unwrap();
    let shape = small_shape();
    let prefill = engine(dir.path(), &pair.prefill.socket, "prefill", &shape, 2).await;
    let decode = engine(dir.path(), &pair.decode.socket, "decode", &shape, 2).await;
    let pool_len = shape.request_bytes() * 2;

    // Registration by reference only: a missing file, a range past the end of the file.
    assert_eq!(
        status_reason(decode.client.register_shared_memory("/dev/shm/kvgate-no-such-file", 0, 4096, "x").await),
        "memory_unavailable"
    );
    let pool_path = decode.pool.lock().unwrap().path.display().to_string();
    assert_eq!(
        status_reason(decode.client.register_shared_memory(&pool_path, pool_len - 10, 4096, "x").await),
        "slice_out_of_range"
    );

    // Unknown region, slice out of its region.
    let room = room_key(600, 0);
    assert_eq!(
        status_reason(decode.client.expect(room, PREFILL_NAME, vec![vec![slice(999, 0, 4096)]], 0).await),
        "unknown_region"
    );
    assert_eq!(
        status_reason(
            decode.client.expect(room, PREFILL_NAME, vec![vec![slice(decode.region, pool_len - 100, 4096)]], 0).await
        ),
        "slice_out_of_range"
    );
    let bad_send = proto::SendRequest {
        offset: None,
        key: Some(room),
        part: 0,
        chunk: 0,
        slices: vec![slice(prefill.region, pool_len, 1)],
        last: true,
        peer: DECODE_NAME.into(),
    };
    assert_eq!(status_reason(prefill.client.send(bad_send).await), "slice_out_of_range");
    // An unknown peer name, and a request without a room key.
    assert_eq!(
        status_reason(decode.client.expect(room, "nobody", vec![vec![slice(decode.region, 0, 4096)]], 0).await),
        "unknown_peer"
    );
    let no_key = proto::SendRequest { offset: None, key: None, ..Default::default() };
    assert_eq!(status_reason(prefill.client.send(no_key).await), "missing_field");
    // A timeout of 0 ms given explicitly (an absent one means the gateway's `room_timeout_ms`);
    // the room is not created, so the same key is accepted with a timeout of 1 ms, at the limit.
    let with_timeout = |timeout_ms| proto::ExpectRequest {
        key: Some(room_key(690, 0)),
        peer: PREFILL_NAME.into(),
        parts: vec![proto::PartSlices { slices: vec![slice(decode.region, 0, 4096)], source_kind: String::new() }],
        timeout_ms,
        part_peers: Vec::new(),
    };
    assert_eq!(status_reason(decode.client.expect_request(with_timeout(Some(0))).await), "invalid_timeout");
    assert!(decode.client.get_room(room_key(690, 0)).await.is_err(), "a refused expect creates no room");
    decode.client.expect_request(with_timeout(Some(1))).await.unwrap();

    // A second expect for a live room.
    expect_into(&decode, &shape, 601, 0, PREFILL_NAME, 0).await.unwrap();
    assert_eq!(status_reason(expect_into(&decode, &shape, 601, 1, PREFILL_NAME, 0).await), "duplicate_expect");

    // Mismatched lengths: the expect announced 2 MiB; a single last chunk of 4 KiB leaves it short.
    let mut refused = None;
    for _ in 0..50 {
        // Wait until the expect notice reached the prefill gateway, so the send can be checked at once.
        if prefill.client.get_room(room_key(601, 0)).await.is_ok() {
            let short = proto::SendRequest {
                offset: None,
                key: Some(room_key(601, 0)),
                part: 0,
                chunk: 0,
                slices: vec![slice(prefill.region, 0, 4096)],
                last: true,
                peer: DECODE_NAME.into(),
            };
            refused = Some(status_reason(prefill.client.send(short).await));
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(refused.as_deref(), Some("length_mismatch"));
    // Nothing changed: the live room is still waiting, intact, and the pair still moves a clean room.
    let info = decode.client.get_room(room_key(601, 0)).await.unwrap();
    assert_eq!(info.reason, "", "{info:?}");
    send_all(&prefill, &shape, 601, 0, DECODE_NAME, None).await.unwrap();
    let r = run_room(&prefill, &decode, &shape, 602, 1, 1).await.unwrap();
    assert!(r.verified, "{r:?}");
    for g in [&pair.prefill, &pair.decode] {
        let left = wait_rooms_empty(&g.admin, Duration::from_secs(5)).await;
        assert!(left.as_array().unwrap().is_empty(), "{}: {left}", g.name);
    }
    let text = metrics(&pair.decode.admin).await;
    assert!(sample(&text, "kvgate_refusals_total{reason=\"duplicate_expect\"}").unwrap_or(0.0) >= 1.0, "{text}");
    pair.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_engine_api_refuses_a_wrong_or_missing_bearer_token() {
    let _serial = serial().await;
    let dir = work_dir();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "right-token\n").unwrap();
    let port = kvgate_demo::gateways::free_port();
    let settings = PairSettings {
        env_decode: vec![
            ("KVGATE__ENGINE_API__TCP_LISTEN".into(), format!("127.0.0.1:{port}")),
            ("KVGATE__ENGINE_API__BEARER_TOKEN_FILE".into(), token_file.display().to_string()),
        ],
        ..PairSettings::default()
    };
    let mut pair = GatewayPair::start(&binary(), dir.path(), &settings).await.unwrap();
    let url = format!("http://127.0.0.1:{port}");
    for token in [Some("wrong-token"), None] {
        let client = Client::connect_tcp(&url, token).await.unwrap();
        let err = client.list_rooms(true).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unauthenticated, "{token:?}");
        assert_eq!(reason_of(&err).as_deref(), Some("bad_token"));
    }
    let client = Client::connect_tcp(&url, Some("right-token")).await.unwrap();
    assert!(client.list_rooms(true).await.unwrap().is_empty());
    // The Unix socket is private to this user.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&pair.decode.socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    pair.stop();
}

/// Starts a pair whose TLS settings must keep the link down; checks that it stays down (both admin
/// views, and an expect for `room` refused `peer_not_connected`).
async fn start_pair_without_link(dir: &std::path::Path, settings: &PairSettings, room: u64) -> GatewayPair {
    let pair = GatewayPair::start(&binary(), dir, settings).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for g in [&pair.prefill, &pair.decode] {
        let (_, body) = kvgate::admin_client::get(&g.admin, "/plugins").await.unwrap();
        assert!(body.contains("\"up\":false") && !body.contains("\"up\":true"), "{}: {body}", g.name);
    }
    let decode = Client::connect_unix(&pair.decode.socket).await.unwrap();
    let err = decode.expect(room_key(room, 0), PREFILL_NAME, vec![vec![slice(1, 0, 1)]], 0).await.unwrap_err();
    assert_eq!(reason_of(&err).as_deref(), Some("peer_not_connected"), "{err:?}");
    pair
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_links_use_mutual_tls_and_refuse_a_certificate_from_another_ca() {
    let _serial = serial().await;
    let dir = work_dir();
    let (cluster_ca, cluster_ca_pem) = pki("kvgate cluster CA");
    let (rogue_ca, rogue_ca_pem) = pki("rogue CA");
    let prefill_cert = leaf(&cluster_ca, &cluster_ca_pem);
    let decode_cert = leaf(&cluster_ca, &cluster_ca_pem);
    let rogue_cert = leaf(&rogue_ca, &rogue_ca_pem);

    // Both certificates from the cluster CA: the link comes up and KV moves.
    let settings = PairSettings {
        extra_prefill: tls_toml(dir.path(), "prefill", &prefill_cert, &cluster_ca_pem),
        extra_decode: tls_toml(dir.path(), "decode", &decode_cert, &cluster_ca_pem),
        ..PairSettings::default()
    };
    let mut pair = GatewayPair::start(&binary(), dir.path(), &settings).await.unwrap();
    let shape = small_shape();
    let prefill = engine(dir.path(), &pair.prefill.socket, "prefill", &shape, 1).await;
    let decode = engine(dir.path(), &pair.decode.socket, "decode", &shape, 1).await;
    let r = run_room(&prefill, &decode, &shape, 700, 0, 0).await.unwrap();
    assert!(r.verified, "{r:?}");
    pair.stop();

    // The decode gateway presents a certificate the prefill gateway's CA never signed: no link.
    let settings = PairSettings {
        extra_prefill: tls_toml(dir.path(), "prefill2", &prefill_cert, &cluster_ca_pem),
        extra_decode: tls_toml(dir.path(), "decode2", &rogue_cert, &cluster_ca_pem),
        wait_for_peers: false,
        ..PairSettings::default()
    };
    let mut pair = start_pair_without_link(dir.path(), &settings, 701).await;
    pair.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_certificate_from_the_right_ca_but_for_another_name_is_refused() {
    let _serial = serial().await;
    let dir = work_dir();
    let (cluster_ca, cluster_ca_pem) = pki("kvgate cluster CA");
    let prefill_cert = leaf(&cluster_ca, &cluster_ca_pem);
    // Signed by the cluster CA, but for a name the prefill gateway does not expect for `decode`
    // (its `peers.tls_name` is "localhost"): any gateway of the cluster could otherwise claim to be
    // any other in its Hello. The decode gateway dials (its name sorts first), prefill checks.
    let impostor_cert = leaf_named(&cluster_ca, &cluster_ca_pem, "impostor.kv.internal");
    let settings = PairSettings {
        extra_prefill: tls_toml(dir.path(), "prefill", &prefill_cert, &cluster_ca_pem),
        extra_decode: tls_toml(dir.path(), "decode", &impostor_cert, &cluster_ca_pem),
        wait_for_peers: false,
        ..PairSettings::default()
    };
    let mut pair = start_pair_without_link(dir.path(), &settings, 702).await;
    let log = pair.prefill.log();
    assert!(log.contains("peer_identity_mismatch"), "the refusal is logged with its reason code: {log}");
    assert!(log.contains("expected_name") && log.contains("localhost"), "the refusal names the expected name: {log}");
    pair.stop();
}
