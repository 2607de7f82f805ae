//! Faults with real processes: SIGKILL and SIGSTOP of a gateway mid-transfer fail exactly the rooms
//! bound to it, with `peer_lost`, within heartbeat_interval_ms x heartbeat_misses + grace, while an
//! unrelated peer's rooms complete; aborts from either engine at every phase end the room on both
//! gateways, and a counterpart that comes after an abort is refused.

mod common;

use common::*;
use kvgate_client::{reason_of, room_key};
use kvgate_demo::engine::{expect_into, prepare_slots, send_all, slot_checksum, wait_reusable, wait_terminal};
use kvgate_demo::gateways::{Cluster, GatewayPair, PairSettings, DECODE_NAME, PREFILL_NAME};
use std::time::{Duration, Instant};

/// Scheduling slack on top of the heartbeat bound (a loaded 2-core machine, debug builds).
const GRACE_MS: u64 = 1_000;

fn bound(s: &PairSettings) -> Duration {
    Duration::from_millis(s.heartbeat_interval_ms * s.heartbeat_misses + GRACE_MS)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_of_a_prefill_gateway_fails_only_its_rooms_with_peer_lost_within_the_bound() {
    let _serial = serial().await;
    let dir = work_dir();
    let settings = PairSettings::default();
    let members = [(DECODE_NAME, "", vec![]), (PREFILL_NAME, "", vec![]), ("prefill2", "", vec![])];
    let mut cluster = Cluster::start(&binary(), dir.path(), &settings, &members).await.unwrap();
    let shape = small_shape();
    let decode = engine(dir.path(), &cluster.get(DECODE_NAME).socket, "decode", &shape, 5).await;
    let doomed = engine(dir.path(), &cluster.get(PREFILL_NAME).socket, "prefill", &shape, 3).await;
    let healthy = engine(dir.path(), &cluster.get("prefill2").socket, "prefill2", &shape, 2).await;
    let mut doomed_rx = Vec::new();
    for i in 0..3u64 {
        let room = 200 + i;
        doomed_rx.push(decode.events.listen(room));
        expect_into(&decode, &shape, room, i, PREFILL_NAME, 0).await.unwrap();
        send_all(&doomed, &shape, room, i, DECODE_NAME, Some(1)).await.unwrap();
    }
    let mut healthy_rooms = Vec::new();
    for i in 0..2u64 {
        let room = 300 + i;
        let expected = prepare_slots(&healthy, &decode, room, i, 3 + i).await.unwrap();
        let rx = decode.events.listen(room);
        expect_into(&decode, &shape, room, 3 + i, "prefill2", 0).await.unwrap();
        send_all(&healthy, &shape, room, i, DECODE_NAME, Some(1)).await.unwrap();
        healthy_rooms.push((room, i, expected, rx));
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    cluster.get_mut(PREFILL_NAME).kill();
    let killed_at = Instant::now();
    for (i, rx) in doomed_rx.iter_mut().enumerate() {
        let o = wait_terminal(rx, killed_at, bound(&settings) + Duration::from_secs(5)).await.unwrap();
        assert!(!o.succeeded && o.reason == "peer_lost", "room {}: {o:?}", 200 + i);
        assert!(
            o.seen_after <= bound(&settings),
            "room {} ended after {:?}, bound {:?}",
            200 + i,
            o.seen_after,
            bound(&settings)
        );
    }
    // Each failure line names the peer that was lost (its session was already gone when they were written).
    let log = plain_log(&cluster.get(DECODE_NAME).log());
    let lost: Vec<&str> =
        log.lines().filter(|l| l.contains("room failed") && l.contains("reason=\"peer_lost\"")).collect();
    assert_eq!(lost.len(), 3, "{log}");
    assert!(lost.iter().all(|l| l.contains(&format!("peer={PREFILL_NAME} "))), "{lost:?}");
    // The unrelated peer's rooms were untouched: they finish and verify.
    for (room, slot, expected, mut rx) in healthy_rooms {
        let started = Instant::now();
        let p = healthy.client.clone();
        for chunk in 1..shape.chunks {
            for part in 0..shape.parts {
                let offset = healthy.pool.lock().unwrap().slot_offset(slot);
                let request = kvgate_client::proto::SendRequest {
                    offset: None,
                    key: Some(room_key(room, 0)),
                    part: part as u32,
                    chunk: chunk as u32,
                    slices: shape.chunk_slices(healthy.region, offset, part, chunk),
                    last: chunk + 1 == shape.chunks,
                    peer: DECODE_NAME.into(),
                };
                p.send(request).await.unwrap();
            }
        }
        let o = wait_terminal(&mut rx, started, Duration::from_secs(20)).await.unwrap();
        assert!(o.succeeded, "unrelated room {room} must succeed: {o:?}");
        assert_eq!(slot_checksum(&decode, 3 + slot).await.unwrap(), expected, "room {room} bytes");
    }
    let left = wait_rooms_empty(&cluster.get(DECODE_NAME).admin, Duration::from_secs(5)).await;
    assert!(left.as_array().unwrap().is_empty(), "{left}");
    let text = metrics(&cluster.get(DECODE_NAME).admin).await;
    assert!(text.contains("kvgate_peer_up{peer=\"prefill\"} 0"), "{text}");
    cluster.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigstop_of_the_decode_gateway_fails_its_rooms_on_the_prefill_side_with_peer_lost() {
    let _serial = serial().await;
    let dir = work_dir();
    let settings = PairSettings::default();
    let mut pair = GatewayPair::start(&binary(), dir.path(), &settings).await.unwrap();
    let shape = small_shape();
    let prefill = engine(dir.path(), &pair.prefill.socket, "prefill", &shape, 3).await;
    let decode = engine(dir.path(), &pair.decode.socket, "decode", &shape, 3).await;
    let mut rxs = Vec::new();
    for i in 0..3u64 {
        let room = 400 + i;
        rxs.push((prefill.events.listen(room), decode.events.listen(room)));
        expect_into(&decode, &shape, room, i, PREFILL_NAME, 0).await.unwrap();
        if i < 2 {
            send_all(&prefill, &shape, room, i, DECODE_NAME, Some(1)).await.unwrap();
        }
    }
    tokio::time::sleep(Duration::from_millis(150)).await;
    pair.decode.freeze().unwrap();
    let frozen_at = Instant::now();
    for (i, (p_rx, _)) in rxs.iter_mut().enumerate() {
        let o = wait_terminal(p_rx, frozen_at, bound(&settings) + Duration::from_secs(5)).await.unwrap();
        assert!(!o.succeeded && o.reason == "peer_lost", "room {}: {o:?}", 400 + i);
        assert!(o.seen_after <= bound(&settings), "room {} after {:?}", 400 + i, o.seen_after);
    }
    let left = wait_rooms_empty(&pair.prefill.admin, Duration::from_secs(2)).await;
    assert!(left.as_array().unwrap().is_empty(), "prefill /rooms: {left}");
    pair.decode.thaw().unwrap();
    let thawed_at = Instant::now();
    for (i, (_, d_rx)) in rxs.iter_mut().enumerate() {
        let o = wait_terminal(d_rx, thawed_at, bound(&settings) + Duration::from_secs(5)).await.unwrap();
        assert!(!o.succeeded, "room {} on the thawed decode gateway: {o:?}", 400 + i);
    }
    let left = wait_rooms_empty(&pair.decode.admin, Duration::from_secs(5)).await;
    assert!(left.as_array().unwrap().is_empty(), "decode /rooms: {left}");
    pair.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_from_either_engine_at_every_phase_ends_the_room_on_both_gateways() {
    let _serial = serial().await;
    let dir = work_dir();
    let settings = PairSettings::default();
    let mut pair = GatewayPair::start(&binary(), dir.path(), &settings).await.unwrap();
    let shape = small_shape();
    let prefill = engine(dir.path(), &pair.prefill.socket, "prefill", &shape, 8).await;
    let decode = engine(dir.path(), &pair.decode.socket, "decode", &shape, 8).await;
    let timeout = Duration::from_secs(10);
    // (aborting side, phase): bootstrap = only the aborting side's request was posted;
    // matched = expect and first chunk posted; transfer = all but the last chunk posted.
    let mut room = 500u64;
    for aborter in ["prefill", "decode"] {
        for phase in ["bootstrap", "matched", "transfer"] {
            room += 1;
            let slot = room % 8;
            let (mut p_rx, mut d_rx) = (prefill.events.listen(room), decode.events.listen(room));
            let started = Instant::now();
            match (aborter, phase) {
                ("prefill", "bootstrap") => send_all(&prefill, &shape, room, slot, DECODE_NAME, Some(1)).await.unwrap(),
                ("decode", "bootstrap") => expect_into(&decode, &shape, room, slot, PREFILL_NAME, 0).await.unwrap(),
                _ => {
                    expect_into(&decode, &shape, room, slot, PREFILL_NAME, 0).await.unwrap();
                    let chunks = if phase == "matched" { 1 } else { shape.chunks - 1 };
                    send_all(&prefill, &shape, room, slot, DECODE_NAME, Some(chunks)).await.unwrap();
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
            let client = if aborter == "prefill" { &prefill.client } else { &decode.client };
            assert!(client.abort(room_key(room, 0), "test").await.unwrap(), "room {room} was live");
            let own = if aborter == "prefill" {
                wait_terminal(&mut p_rx, started, timeout).await
            } else {
                wait_terminal(&mut d_rx, started, timeout).await
            };
            let own = own.unwrap();
            assert_eq!((own.succeeded, own.reason.as_str()), (false, "aborted"), "{aborter} {phase}");
            if (aborter, phase) == ("prefill", "bootstrap") {
                // The decode side never had the room: its late expect is refused, not re-created.
                tokio::time::sleep(Duration::from_millis(100)).await;
                let late = expect_into(&decode, &shape, room, slot, PREFILL_NAME, 0).await.unwrap_err();
                assert_eq!(reason_of(&late).as_deref(), Some("room_terminal"), "{late:?}");
            } else if (aborter, phase) == ("decode", "bootstrap") {
                let other = wait_terminal(&mut p_rx, started, timeout).await.unwrap();
                assert_eq!(other.reason, "aborted_by_peer");
                let late = send_all(&prefill, &shape, room, slot, DECODE_NAME, Some(1)).await.unwrap_err();
                assert_eq!(reason_of(&late).as_deref(), Some("room_terminal"), "{late:?}");
            } else {
                let other = if aborter == "prefill" {
                    wait_terminal(&mut d_rx, started, timeout).await
                } else {
                    wait_terminal(&mut p_rx, started, timeout).await
                };
                let other = other.unwrap();
                assert_eq!((other.succeeded, other.reason.as_str()), (false, "aborted_by_peer"), "{aborter} {phase}");
            }
            assert!(
                wait_reusable(if aborter == "prefill" { &mut p_rx } else { &mut d_rx }, timeout).await,
                "{aborter} {phase}: never reusable"
            );
        }
    }
    // A second abort, and an abort of an unknown room, are harmless.
    assert!(!prefill.client.abort(room_key(room, 0), "again").await.unwrap());
    assert!(!decode.client.abort(room_key(777_777, 0), "unknown").await.unwrap());
    for g in [&pair.prefill, &pair.decode] {
        let left = wait_rooms_empty(&g.admin, Duration::from_secs(5)).await;
        assert!(left.as_array().unwrap().is_empty(), "{}: {left}", g.name);
    }
    pair.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_prefill_gateway_is_a_new_incarnation_old_rooms_fail_and_new_rooms_work() {
    let _serial = serial().await;
    let dir = work_dir();
    let settings = PairSettings::default();
    let mut pair = GatewayPair::start(&binary(), dir.path(), &settings).await.unwrap();
    let shape = small_shape();
    let decode = engine(dir.path(), &pair.decode.socket, "decode", &shape, 2).await;
    let mut old_rx = decode.events.listen(1001);
    expect_into(&decode, &shape, 1001, 0, PREFILL_NAME, 0).await.unwrap();
    pair.prefill.restart(&binary()).unwrap();
    let restarted_at = Instant::now();
    let o = wait_terminal(&mut old_rx, restarted_at, bound(&settings) + Duration::from_secs(5)).await.unwrap();
    assert_eq!((o.succeeded, o.reason.as_str()), (false, "peer_lost"), "{o:?}");
    // Wait for the new incarnation's link, then move a room through it.
    let deadline = Instant::now() + Duration::from_secs(20);
    let prefill = loop {
        if let Ok(client) = kvgate_client::Client::connect_unix(&pair.prefill.socket).await {
            if client.list_rooms(true).await.is_ok() {
                break engine(dir.path(), &pair.prefill.socket, "prefill-new", &shape, 2).await;
            }
        }
        assert!(Instant::now() < deadline, "restarted gateway never answered:\n{}", pair.prefill.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let mut r = None;
    for attempt in 0..50u64 {
        // A fresh room per attempt: a half-accepted earlier attempt must not interfere.
        match kvgate_demo::engine::run_room(&prefill, &decode, &shape, 1002 + attempt, 1, 1).await {
            Ok(result) => {
                r = Some(result);
                break;
            }
            // The link to the new incarnation may not be up yet: `peer_not_connected`.
            Err(e) if format!("{e:#}").contains("peer_not_connected") => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(e) => panic!("{e:#}"),
        }
    }
    let r = r.expect("the link to the restarted gateway came up");
    assert!(r.verified, "{r:?}");
    assert!(pair.decode.log().contains("peer restarted (new incarnation)"), "{}", pair.decode.log());
    pair.stop();
}
