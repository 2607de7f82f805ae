//! Defects an outside reliability and security test found, each kept fixed through real `kvgate
//! serve` processes: memory unregistered while a room still holds it, and peer links that believed
//! whoever sent a Hello naming a configured peer.

mod common;

use common::*;
use kvgate_client::proto::{self, peer_frame::Frame};
use kvgate_client::{reason_of, room_key, slice};
use kvgate_demo::engine::{
    expect_into, prepare_slots, run_room, send_all, slot_checksum, wait_reusable, wait_terminal,
};
use kvgate_demo::gateways::{Cluster, GatewayPair, PairSettings, DECODE_NAME, PREFILL_NAME};
use std::process::Command;
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(20);

fn refused(result: Result<(), tonic::Status>) -> (String, String) {
    let status = result.expect_err("the call was accepted");
    (reason_of(&status).unwrap_or_default(), status.message().to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unregister_of_a_region_a_room_holds_is_refused_on_both_sides_until_the_room_is_reusable() {
    let _serial = serial().await;
    let dir = work_dir();
    let mut pair = GatewayPair::start(&binary(), dir.path(), &PairSettings::default()).await.unwrap();
    let shape = small_shape();
    let prefill = engine(dir.path(), &pair.prefill.socket, "prefill", &shape, 2).await;
    let decode = engine(dir.path(), &pair.decode.socket, "decode", &shape, 2).await;

    // Destination side, before any send: the expect holds the decode pool.
    let room = 900;
    let expected = prepare_slots(&prefill, &decode, room, 0, 0).await.unwrap();
    let mut d_rx = decode.events.listen(room);
    let mut p_rx = prefill.events.listen(room);
    expect_into(&decode, &shape, room, 0, PREFILL_NAME, 0).await.unwrap();
    let (reason, message) = refused(decode.client.unregister_memory(decode.region).await);
    assert_eq!(reason, "region_in_use", "{message}");
    assert!(
        message.contains("900#0") && message.contains("receiver") && message.contains("1 room"),
        "names the room: {message}"
    );

    // Source side: the first chunk holds the prefill pool (the room waits for its other chunks).
    send_all(&prefill, &shape, room, 0, DECODE_NAME, Some(1)).await.unwrap();
    let (reason, message) = refused(prefill.client.unregister_memory(prefill.region).await);
    assert_eq!(reason, "region_in_use", "{message}");
    assert!(message.contains("900#0") && message.contains("sender"), "{message}");

    // Still refused while bytes move, and nothing was released meanwhile: the room completes intact.
    let started = Instant::now();
    let prefill_client = prefill.client.clone();
    for chunk in 1..shape.chunks {
        // Before each of the remaining chunks the room is live on both sides: both regions held.
        assert_eq!(refused(decode.client.unregister_memory(decode.region).await).0, "region_in_use");
        assert_eq!(refused(prefill.client.unregister_memory(prefill.region).await).0, "region_in_use");
        for part in 0..shape.parts {
            let slices = shape.chunk_slices(prefill.region, 0, part, chunk);
            let request = proto::SendRequest {
                offset: None,
                key: Some(room_key(room, 0)),
                part: part as u32,
                chunk: chunk as u32,
                slices,
                last: chunk + 1 == shape.chunks,
                peer: DECODE_NAME.into(),
            };
            prefill_client.send(request).await.unwrap();
        }
    }
    let d = wait_terminal(&mut d_rx, started, WAIT).await.unwrap();
    let p = wait_terminal(&mut p_rx, started, WAIT).await.unwrap();
    assert!(d.succeeded && p.succeeded, "{d:?} {p:?}");
    assert_eq!(slot_checksum(&decode, 0).await.unwrap(), expected);

    // Reusable on both sides: both regions go.
    assert!(wait_reusable(&mut d_rx, WAIT).await && wait_reusable(&mut p_rx, WAIT).await);
    decode.client.unregister_memory(decode.region).await.unwrap();
    prefill.client.unregister_memory(prefill.region).await.unwrap();
    assert_eq!(refused(decode.client.unregister_memory(decode.region).await).0, "unknown_region");

    // An engine that wants its memory back aborts the room first, then unregisters once reusable.
    let pool_path = |e: &kvgate_demo::engine::Engine| e.pool.lock().unwrap().path.display().to_string();
    let len = shape.request_bytes() * 2;
    let d_region = decode.client.register_shared_memory(&pool_path(&decode), 0, len, "again").await.unwrap();
    let mut rx = decode.events.listen(901);
    decode
        .client
        .expect(
            room_key(901, 0),
            PREFILL_NAME,
            vec![shape.part_slices(d_region, 0, 0), shape.part_slices(d_region, 0, 1)],
            0,
        )
        .await
        .unwrap();
    assert_eq!(refused(decode.client.unregister_memory(d_region).await).0, "region_in_use");
    decode.client.abort(room_key(901, 0), "engine wants its memory back").await.unwrap();
    let o = wait_terminal(&mut rx, Instant::now(), WAIT).await.unwrap();
    assert!(!o.succeeded && o.reason == "aborted", "{o:?}");
    assert!(wait_reusable(&mut rx, WAIT).await);
    decode.client.unregister_memory(d_region).await.unwrap();
    pair.stop();
}

/// A PeerLink client to `address` (plain HTTP/2, as an impostor on the host would connect).
async fn peer_link_client(address: &str) -> proto::peer_link_client::PeerLinkClient<tonic::transport::Channel> {
    let channel =
        tonic::transport::Endpoint::from_shared(format!("http://{address}")).unwrap().connect().await.unwrap();
    proto::peer_link_client::PeerLinkClient::new(channel)
}

fn impostor_hello(nonce: Vec<u8>) -> proto::PeerFrame {
    proto::PeerFrame {
        frame: Some(Frame::Hello(proto::Hello {
            name: DECODE_NAME.into(),
            incarnation: 0xBAD,
            protocol_version: 1,
            host: "localhost".into(),
            to: PREFILL_NAME.into(),
            auth: "psk".into(),
            nonce,
            ..Default::default()
        })),
        mac: vec![],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_impostor_naming_a_configured_peer_is_refused_and_the_real_link_and_its_rooms_are_untouched() {
    let _serial = serial().await;
    let dir = work_dir();
    let mut pair = GatewayPair::start(&binary(), dir.path(), &PairSettings::default()).await.unwrap();
    let shape = small_shape();
    let prefill = engine(dir.path(), &pair.prefill.socket, "prefill", &shape, 4).await;
    let decode = engine(dir.path(), &pair.decode.socket, "decode", &shape, 4).await;
    let (_, body) = kvgate::admin_client::get(&pair.prefill.admin, "/plugins").await.unwrap();
    assert!(body.contains("\"peer_link_auth\":\"psk\""), "{body}");

    // Four rooms live across the real link, waiting for their senders.
    let rooms = [910u64, 911, 912, 913];
    let mut listeners = Vec::new();
    for (slot, room) in rooms.iter().enumerate() {
        let expected = prepare_slots(&prefill, &decode, *room, slot as u64, slot as u64).await.unwrap();
        listeners.push((*room, slot as u64, expected, decode.events.listen(*room), prefill.events.listen(*room)));
        expect_into(&decode, &shape, *room, slot as u64, PREFILL_NAME, 0).await.unwrap();
    }

    // An impostor names `decode` (the peer that dials `prefill`) without answering any challenge:
    // refused before anything reaches the prefill gateway's rooms.
    let mut client = peer_link_client(&pair.prefill.peer_listen).await;
    let status = client.link(tokio_stream::iter(vec![impostor_hello(vec![])])).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
    assert!(status.message().starts_with("peer_auth_failed"), "{status:?}");

    // With a challenge but no key: the server's Hello comes back (it proves the key, not the
    // impostor), and the impostor's guessed answer ends the link.
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(impostor_hello(vec![7u8; 32])).await.unwrap();
    let mut inbound = client.link(tokio_stream::wrappers::ReceiverStream::new(rx)).await.unwrap().into_inner();
    let hello = match inbound.message().await.unwrap().and_then(|f| f.frame) {
        Some(Frame::Hello(h)) => h,
        other => panic!("expected the server's hello, got {other:?}"),
    };
    assert_eq!(hello.nonce.len(), 32);
    assert_eq!(hello.proof.len(), 32);
    let guess = proto::PeerFrame {
        frame: Some(Frame::AuthProof(proto::AuthProof { proof: vec![0u8; 32] })),
        mac: vec![1u8; 32],
    };
    tx.send(guess).await.unwrap();
    // The refused link ends (the server drops its side); nothing else arrives on it.
    let ended = tokio::time::timeout(Duration::from_secs(5), async {
        if let Ok(Some(frame)) = inbound.message().await {
            panic!("a frame reached the impostor: {frame:?}");
        }
    })
    .await;
    assert!(ended.is_ok(), "the impostor's link was not closed");
    drop(tx);

    // Every refusal is logged with its reason; the real peer never looked restarted or lost.
    eventually(
        WAIT,
        "the refusals logged",
        || async { pair.prefill.log().matches("peer_auth_failed").count() >= 2 },
        &|| pair.prefill.log(),
    )
    .await;
    let log = plain_log(&pair.prefill.log());
    assert!(!log.contains("peer_restarted") && !log.contains("peer link lost"), "{log}");

    // The rooms that were live go through and verify.
    for (room, slot, expected, mut d_rx, mut p_rx) in listeners {
        let started = Instant::now();
        send_all(&prefill, &shape, room, slot, DECODE_NAME, None).await.unwrap();
        let (d, p) = (
            wait_terminal(&mut d_rx, started, WAIT).await.unwrap(),
            wait_terminal(&mut p_rx, started, WAIT).await.unwrap(),
        );
        assert!(d.succeeded && p.succeeded, "room {room}: {d:?} {p:?}");
        assert_eq!(slot_checksum(&decode, slot).await.unwrap(), expected, "room {room}");
    }
    pair.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_holding_different_keys_never_link() {
    let _serial = serial().await;
    let dir = work_dir();
    // The decode gateway's key is another one than the prefill gateway's.
    let other_key = dir.path().join("other.key");
    let out = Command::new(binary()).args(["keygen", "psk"]).arg(&other_key).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let settings = PairSettings {
        env_decode: vec![("KVGATE__PEER_LINK__PSK_FILE".into(), other_key.display().to_string())],
        wait_for_peers: false,
        ..PairSettings::default()
    };
    let mut pair = GatewayPair::start(&binary(), dir.path(), &settings).await.unwrap();
    // The dialler (decode) finds the server's proof wrong and says so, every attempt.
    eventually(
        WAIT,
        "the dialler reports the key mismatch",
        || async { pair.decode.log().contains("did not prove the pre-shared key") },
        &|| pair.decode.log(),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    for g in [&pair.prefill, &pair.decode] {
        let up = peers(&g.admin).await;
        assert!(up.iter().all(|p| p["up"] == false), "{}: {up:?}", g.name);
    }
    let prefill = engine(dir.path(), &pair.prefill.socket, "prefill", &small_shape(), 1).await;
    let status = prefill
        .client
        .send(proto::SendRequest {
            offset: None,
            key: Some(room_key(920, 0)),
            part: 0,
            chunk: 0,
            slices: vec![slice(prefill.region, 0, 4096)],
            last: true,
            peer: DECODE_NAME.into(),
        })
        .await
        .unwrap_err();
    assert_eq!(reason_of(&status).as_deref(), Some("peer_not_connected"), "{status:?}");
    pair.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unauthenticated_link_only_when_written_logged_and_shown() {
    let _serial = serial().await;
    let dir = work_dir();
    let env = || {
        vec![
            ("KVGATE__PEER_LINK__AUTH".to_string(), "none".to_string()),
            ("KVGATE__PEER_LINK__PSK_FILE".to_string(), String::new()),
        ]
    };
    let settings = PairSettings::default();
    let members = [(PREFILL_NAME, "", env()), (DECODE_NAME, "", env())];
    let mut cluster = Cluster::start(&binary(), dir.path(), &settings, &members).await.unwrap();
    let (_, body) = kvgate::admin_client::get(&cluster.get(PREFILL_NAME).admin, "/plugins").await.unwrap();
    assert!(body.contains("\"peer_link_auth\":\"none\""), "{body}");
    assert!(plain_log(&cluster.get(PREFILL_NAME).log()).contains("peer links are NOT authenticated"));
    let shape = small_shape();
    let prefill = engine(dir.path(), &cluster.get(PREFILL_NAME).socket, "prefill", &shape, 1).await;
    let decode = engine(dir.path(), &cluster.get(DECODE_NAME).socket, "decode", &shape, 1).await;
    assert!(run_room(&prefill, &decode, &shape, 930, 0, 0).await.unwrap().verified);
    cluster.stop();
}

fn config_check(path: &std::path::Path, env: &[(&str, &str)]) -> (i32, String) {
    let out = Command::new(binary())
        .args(["config", "check"])
        .arg(path)
        .envs(env.iter().copied())
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)),
    )
}

#[test]
fn config_check_refuses_a_link_without_authentication_unless_written_and_never_off_loopback() {
    let dir = tempfile::tempdir().unwrap();
    let peers = "[[peers]]\nname = \"decode\"\naddress = \"127.0.0.1:7101\"\n";
    let write = |name: &str, text: String| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    // No key, no TLS, no `auth = "none"`: refused, saying how to make a key.
    let (code, out) = config_check(&write("a.toml", format!("[gateway]\nname = \"prefill\"\n{peers}")), &[]);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("peer_link.psk_file") && out.contains("kvgate keygen psk"), "{out}");
    // Written in so many words, on loopback: accepted, and said.
    let (code, out) = config_check(&write("b.toml", format!("[peer_link]\nauth = \"none\"\n{peers}")), &[]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("NOT authenticated"), "{out}");
    // ...but never on an address other hosts reach.
    let (code, out) = config_check(
        &write("c.toml", format!("[peer_link]\nauth = \"none\"\nlisten = \"0.0.0.0:7100\"\n{peers}")),
        &[],
    );
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("a loopback address while peer_link.auth = \"none\""), "{out}");
    // A key file: made by `kvgate keygen psk`, found relative to the config's folder.
    let out = Command::new(binary()).args(["keygen", "psk"]).arg(dir.path().join("peer.key")).output().unwrap();
    assert!(out.status.success());
    let (code, out) = config_check(&write("d.toml", format!("[peer_link]\npsk_file = \"peer.key\"\n{peers}")), &[]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("authenticated by pre-shared key") && out.contains("peer.key"), "{out}");
    // A key file others may read is refused.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.path().join("peer.key"), std::fs::Permissions::from_mode(0o644)).unwrap();
    let (code, out) = config_check(&dir.path().join("d.toml"), &[]);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("chmod 600"), "{out}");
    // `keygen` never overwrites a key by accident.
    let again = Command::new(binary()).args(["keygen", "psk"]).arg(dir.path().join("peer.key")).output().unwrap();
    assert!(!again.status.success() && String::from_utf8_lossy(&again.stderr).contains("--force"));
}

#[test]
fn every_shipped_config_runs_authenticated() {
    let configs = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs");
    let key_dir = tempfile::tempdir().unwrap();
    let key = key_dir.path().join("peer.key");
    assert!(Command::new(binary()).args(["keygen", "psk"]).arg(&key).status().unwrap().success());
    for deployment in std::fs::read_dir(&configs).unwrap() {
        let deployment = deployment.unwrap().path();
        if !deployment.is_dir() {
            continue;
        }
        for side in ["prefill.toml", "decode.toml"] {
            let path = deployment.join(side);
            let text = std::fs::read_to_string(&path).unwrap();
            let config = kvgate::config::load_config_from_str(&text).unwrap();
            let mode = config.peer_link.auth_mode();
            assert_ne!(mode, kvgate::config::PeerAuthMode::None, "{}", path.display());
            if mode == kvgate::config::PeerAuthMode::Psk {
                // `config check` with the deployment's key (given here through the environment) says so.
                let (code, out) = config_check(&path, &[("KVGATE__PEER_LINK__PSK_FILE", key.to_str().unwrap())]);
                assert_eq!(code, 0, "{}: {out}", path.display());
                assert!(out.contains("authenticated by pre-shared key"), "{out}");
                // Without the key file, it says how to make it.
                let (code, out) = config_check(&path, &[]);
                if !deployment.join("peer.key").exists() {
                    assert_eq!(code, 2, "{out}");
                    assert!(out.contains("kvgate keygen psk"), "{out}");
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keygen_tls_makes_certificates_two_gateways_link_with() {
    let _serial = serial().await;
    let dir = work_dir();
    let pki_dir = dir.path().join("pki");
    let out = Command::new(binary())
        .args(["keygen", "tls", "--dir"])
        .arg(&pki_dir)
        .args(["--name", PREFILL_NAME, "--name", DECODE_NAME, "--also", "localhost"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(pki_dir.join("decode.key")).unwrap().permissions().mode() & 0o777, 0o600);
    let tls = |name: &str| {
        let p = |f: String| pki_dir.join(f).display().to_string();
        format!(
            "[peer_link.tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\nca_file = \"{}\"\n",
            p(format!("{name}.pem")),
            p(format!("{name}.key")),
            p("ca.pem".into())
        )
    };
    let settings =
        PairSettings { extra_prefill: tls(PREFILL_NAME), extra_decode: tls(DECODE_NAME), ..PairSettings::default() };
    let mut pair = GatewayPair::start(&binary(), dir.path(), &settings).await.unwrap();
    let (_, body) = kvgate::admin_client::get(&pair.prefill.admin, "/plugins").await.unwrap();
    assert!(body.contains("\"peer_link_auth\":\"tls\""), "{body}");
    let shape = small_shape();
    let prefill = engine(dir.path(), &pair.prefill.socket, "prefill", &shape, 1).await;
    let decode = engine(dir.path(), &pair.decode.socket, "decode", &shape, 1).await;
    assert!(run_room(&prefill, &decode, &shape, 940, 0, 0).await.unwrap().verified);
    // Handshakes that fail on the peer-link port (not TLS at all, here) are logged, at most one line
    // per interval with the count, and every one is counted.
    for _ in 0..5 {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut junk = tokio::net::TcpStream::connect(&pair.decode.peer_listen).await.unwrap();
        junk.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
        let mut sink = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), junk.read_to_end(&mut sink)).await;
    }
    eventually(
        WAIT,
        "the failed handshakes counted",
        || async {
            let (_, text) = kvgate::admin_client::get(&pair.decode.admin, "/metrics").await.unwrap();
            text.lines().any(|l| {
                l.strip_prefix("kvgate_peer_tls_handshake_failures_total ")
                    .is_some_and(|v| v.trim().parse::<f64>().unwrap_or(0.0) >= 5.0)
            })
        },
        &|| pair.decode.log(),
    )
    .await;
    let lines = pair.decode.log().lines().filter(|l| l.contains("tls_handshake_failed")).count();
    assert_eq!(lines, 1, "one rate-limited line for five failures:\n{}", pair.decode.log());
    assert!(run_room(&prefill, &decode, &shape, 941, 0, 0).await.unwrap().verified, "the real link is untouched");
    pair.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_an_engine_gave_up_on_during_a_stall_do_not_close_its_connection_or_its_watch() {
    let _serial = serial().await;
    let dir = work_dir();
    let mut pair = GatewayPair::start(&binary(), dir.path(), &PairSettings::default()).await.unwrap();
    let shape = small_shape();
    let decode = engine(dir.path(), &pair.decode.socket, "decode", &shape, 1).await;
    // The gateway stalls (shorter than the peer link's loss bound); the engine's calls time out
    // client-side meanwhile, each resetting its stream: 50, past h2's default of 20.
    pair.decode.freeze().unwrap();
    // SIGSTOP lands asynchronously: go on only once every thread of the gateway reads as stopped.
    let pid = pair.decode.pid().unwrap();
    let stopped = || {
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
            .map(|d| d.flatten().map(|t| t.path()).collect::<Vec<_>>())
            .unwrap_or_default();
        !tasks.is_empty()
            && tasks.iter().all(|t| {
                std::fs::read_to_string(t.join("stat"))
                    .is_ok_and(|s| s.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('T')))
            })
    };
    let deadline = Instant::now() + Duration::from_secs(1);
    while !stopped() {
        assert!(Instant::now() < deadline, "the gateway did not stop");
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut calls = Vec::new();
    for i in 0..50u64 {
        let client = decode.client.clone();
        calls.push(tokio::spawn(async move {
            tokio::time::timeout(Duration::from_millis(200), client.get_room(room_key(5000 + i, 0))).await
        }));
    }
    for call in calls {
        assert!(call.await.unwrap().is_err(), "a call answered by a frozen gateway");
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    pair.decode.thaw().unwrap();
    // The same connection and the same Watch stream still carry calls and outcomes.
    let mut rx = decode.events.listen(950);
    decode
        .client
        .expect(room_key(950, 0), PREFILL_NAME, vec![shape.part_slices(decode.region, 0, 0)], 0)
        .await
        .unwrap();
    decode.client.abort(room_key(950, 0), "check the watch").await.unwrap();
    let o = wait_terminal(&mut rx, Instant::now(), Duration::from_secs(10))
        .await
        .expect("the watch stream survived the resets");
    assert_eq!(o.reason, "aborted");
    assert!(!plain_log(&pair.decode.log()).contains("too_many_resets"));
    pair.stop();
}

#[test]
fn an_engine_socket_path_naming_a_regular_file_leaves_it_alone() {
    let dir = work_dir();
    let precious = dir.path().join("precious.txt");
    std::fs::write(&precious, "do not delete").unwrap();
    let config = dir.path().join("g.toml");
    std::fs::write(
        &config,
        format!("[engine_api]\nunix_socket = {:?}\n[admin]\nlisten = \"\"\n", precious.display().to_string()),
    )
    .unwrap();
    let out = Command::new(binary()).args(["serve", "--config"]).arg(&config).env_remove("RUST_LOG").output().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("is not a socket; refusing to replace it"), "{stderr}");
    assert_eq!(std::fs::read_to_string(&precious).unwrap(), "do not delete");
}

#[test]
fn a_log_level_typo_is_refused_by_config_check_and_serve() {
    let dir = work_dir();
    for level in ["warning", "verbose", ""] {
        let config = dir.path().join("g.toml");
        std::fs::write(&config, format!("[log]\nlevel = {level:?}\n")).unwrap();
        let (code, out) = config_check(&config, &[]);
        assert_eq!(code, 2, "{level:?}: {out}");
        assert!(out.contains("log.level"), "{out}");
        let serve =
            Command::new(binary()).args(["serve", "--config"]).arg(&config).env_remove("RUST_LOG").output().unwrap();
        assert_eq!(serve.status.code(), Some(2), "{level:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn free_text_is_bounded_and_overlapping_destinations_are_refused() {
    let _serial = serial().await;
    let dir = work_dir();
    let settings = PairSettings {
        env_decode: vec![("KVGATE__ENGINE_API__MAX_TEXT_BYTES".into(), "64".into())],
        ..PairSettings::default()
    };
    let mut pair = GatewayPair::start(&binary(), dir.path(), &settings).await.unwrap();
    let shape = small_shape();
    let decode = engine(dir.path(), &pair.decode.socket, "decode", &shape, 2).await;
    let path = decode.pool.lock().unwrap().path.display().to_string();
    // A label at the limit is kept; one byte past it is refused.
    decode.client.register_shared_memory(&path, 0, 4096, &"l".repeat(64)).await.unwrap();
    let e = decode.client.register_shared_memory(&path, 0, 4096, &"l".repeat(65)).await.unwrap_err();
    assert_eq!(reason_of(&e).as_deref(), Some("text_too_long"), "{e:?}");
    // A 100 KiB path: refused with its reason, the message short enough that the reason arrives.
    let e = decode
        .client
        .register_shared_memory(&format!("/dev/shm/{}", "p".repeat(100 << 10)), 0, 4096, "x")
        .await
        .unwrap_err();
    assert_eq!(reason_of(&e).as_deref(), Some("text_too_long"), "{e:?}");
    assert!(e.message().len() < 1024, "{}", e.message().len());
    // A 100 KB abort reason is logged cut to the limit.
    decode.client.abort(room_key(960, 0), &"w".repeat(100_000)).await.unwrap();
    eventually(WAIT, "the abort logged", || async { pair.decode.log().contains("engine abort") }, &|| {
        pair.decode.log()
    })
    .await;
    let line = pair.decode.log().lines().find(|l| l.contains("engine abort")).unwrap().to_string();
    assert!(line.len() < 1024 && line.contains("bytes more"), "{}", line.len());
    // Two parts over the same bytes: refused.
    let e = decode
        .client
        .expect(
            room_key(961, 0),
            PREFILL_NAME,
            vec![vec![slice(decode.region, 0, 8192)], vec![slice(decode.region, 4096, 8192)]],
            0,
        )
        .await
        .unwrap_err();
    assert_eq!(reason_of(&e).as_deref(), Some("overlapping_slices"), "{e:?}");
    pair.stop();
}

#[test]
fn an_engine_socket_folder_another_user_owns_or_may_write_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let dir = work_dir();
    let serve = |socket_dir: &std::path::Path| {
        let config = dir.path().join("g.toml");
        let socket = socket_dir.join("engine.sock");
        std::fs::write(
            &config,
            format!("[engine_api]\nunix_socket = {:?}\n[admin]\nlisten = \"\"\n", socket.display().to_string()),
        )
        .unwrap();
        let out =
            Command::new(binary()).args(["serve", "--config"]).arg(&config).env_remove("RUST_LOG").output().unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stderr).to_string(), socket)
    };
    // Writable by everyone, not sticky.
    let open = dir.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let (ok, stderr, socket) = serve(&open);
    assert!(!ok && stderr.contains("writable by other users"), "{stderr}");
    assert!(!socket.exists());
    // Owned by another user (when this test may hand a folder to one: it runs as root in CI).
    if nix::unistd::geteuid().is_root() {
        let theirs = dir.path().join("theirs");
        std::fs::create_dir(&theirs).unwrap();
        nix::unistd::chown(&theirs, Some(nix::unistd::Uid::from_raw(65534)), None).unwrap();
        let (ok, stderr, _) = serve(&theirs);
        assert!(!ok && stderr.contains("owned by uid 65534"), "{stderr}");
    }
    // A folder that does not exist yet is made for this user only.
    let fresh = dir.path().join("fresh/sub");
    let config = dir.path().join("g.toml");
    std::fs::write(
        &config,
        format!(
            "[engine_api]\nunix_socket = {:?}\n[admin]\nlisten = \"\"\n[peer_link]\nlisten = \"127.0.0.1:0\"\n",
            fresh.join("e.sock").display().to_string()
        ),
    )
    .unwrap();
    let mut child = Command::new(binary())
        .args(["serve", "--config"])
        .arg(&config)
        .env_remove("RUST_LOG")
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + WAIT;
    while !fresh.join("e.sock").exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(std::fs::metadata(&fresh).unwrap().permissions().mode() & 0o777, 0o700);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_says_when_no_configured_peer_is_up() {
    let _serial = serial().await;
    let dir = work_dir();
    let mut pair = GatewayPair::start(&binary(), dir.path(), &PairSettings::default()).await.unwrap();
    let healthz = |admin: String| async move { kvgate::admin_client::get(&admin, "/healthz").await.unwrap() };
    let (code, body) = healthz(pair.decode.admin.clone()).await;
    assert!(code == 200 && !body.contains("no configured peer"), "{body}");
    pair.prefill.kill();
    eventually(
        WAIT,
        "healthz warns that no peer is up",
        || async {
            let (code, body) = healthz(pair.decode.admin.clone()).await;
            code == 200 && body.contains("no configured peer is up (prefill)")
        },
        &|| pair.decode.log(),
    )
    .await;
    pair.stop();
}

#[test]
fn without_a_configured_socket_the_engine_api_listens_in_the_users_runtime_folder() {
    use std::os::unix::fs::PermissionsExt;
    let dir = work_dir();
    let runtime = dir.path().join("run-user");
    std::fs::create_dir(&runtime).unwrap();
    std::fs::set_permissions(&runtime, std::fs::Permissions::from_mode(0o700)).unwrap();
    let config = dir.path().join("g.toml");
    std::fs::write(&config, "[admin]\nlisten = \"\"\n[peer_link]\nlisten = \"127.0.0.1:0\"\n").unwrap();
    // What `config default` says is where `serve` listens.
    let shown = Command::new(binary()).args(["config", "default"]).env("XDG_RUNTIME_DIR", &runtime).output().unwrap();
    let expected = runtime.join("kvgate").join("engine.sock");
    assert!(
        String::from_utf8_lossy(&shown.stdout).contains(&format!("unix_socket = {:?}", expected.display().to_string()))
    );
    let mut child = Command::new(binary())
        .args(["serve", "--config"])
        .arg(&config)
        .env("XDG_RUNTIME_DIR", &runtime)
        .env_remove("RUST_LOG")
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + WAIT;
    while !expected.exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(expected.exists(), "no engine socket at {}", expected.display());
    assert_eq!(std::fs::metadata(runtime.join("kvgate")).unwrap().permissions().mode() & 0o777, 0o700);
    // Without a runtime folder: a folder of this user's own under /tmp, named by uid.
    let shown = Command::new(binary()).args(["config", "default"]).env_remove("XDG_RUNTIME_DIR").output().unwrap();
    let uid = nix::unistd::getuid();
    assert!(
        String::from_utf8_lossy(&shown.stdout).contains(&format!("unix_socket = \"/tmp/kvgate-{uid}/engine.sock\""))
    );
}
