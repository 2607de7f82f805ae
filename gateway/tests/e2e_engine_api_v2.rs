//! Engine API v2 through real `kvgate serve` processes: engine sessions that own regions and rooms
//! (an engine gone past its grace loses its rooms on both sides and its memory is released; one
//! back within its grace resumes), no outcome lost or repeated however the Watch stream is cut
//! (resumed from the replay log, or reconciled from a snapshot once the log moved on), batched calls.

mod common;

use common::*;
use kvgate_client::outcomes::{Outcome, OutcomeWatch};
use kvgate_client::{proto, reason_of, room_key, slice, Client, RoomKey};
use kvgate_demo::gateways::{GatewayPair, PairSettings, DECODE_NAME, PREFILL_NAME};
use kvgate_demo::pool::KvPool;
use std::collections::HashMap;
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(20);
const SLOT: u64 = 4096;

fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

async fn terminal_of(stream: &mut tonic::Streaming<proto::RoomEvent>, room: u64, within: Duration) -> proto::Terminal {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let event = tokio::time::timeout_at(deadline, stream.message())
            .await
            .expect("no terminal event in time")
            .unwrap()
            .expect("stream open");
        if event.key.map(|k| k.room) == Some(room) {
            if let Some(proto::room_event::Event::Terminal(t)) = event.event {
                return t;
            }
        }
    }
}

/// Whether the gateway process `pid` still maps a file whose path contains `name`.
fn maps_file(pid: i32, name: &str) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default().contains(name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_gone_past_its_grace_loses_its_rooms_on_both_sides_and_its_memory_is_released() {
    let _serial = serial().await;
    let dir = work_dir();
    let grace_ms = 500u64;
    let settings =
        PairSettings { env_decode: env(&[("KVGATE__ENGINE_API__SESSION_GRACE_MS", "500")]), ..PairSettings::default() };
    let mut pair = GatewayPair::start(&binary(), dir.path(), &settings).await.unwrap();
    let observer = Client::connect_unix(&pair.decode.socket).await.unwrap();
    let mut decode_events = observer.watch_outcomes(None).await.unwrap();
    let prefill = Client::connect_unix(&pair.prefill.socket).await.unwrap();
    let mut prefill_events = prefill.watch_outcomes(None).await.unwrap();
    let pool = KvPool::create(dir.path(), "session-pool", SLOT, 4).unwrap();
    let pool_path = pool.path.display().to_string();
    let pool_name = pool.path.file_name().unwrap().to_string_lossy().to_string();

    // The engine: a session, its pool, a Watch stream that keeps it attached, two rooms waiting for
    // their sender.
    let engine = Client::connect_unix(&pair.decode.socket).await.unwrap();
    let opened = engine.open_session("decode-rank-0").await.unwrap();
    assert!(!opened.resumed && opened.grace_ms == grace_ms, "{opened:?}");
    let session = engine.in_session(opened.session);
    let region = session.register_shared_memory(&pool_path, 0, pool.len(), "session pool").await.unwrap();
    let watch = session.watch_outcomes(None).await.unwrap();
    for room in [1000u64, 1001] {
        session
            .expect(room_key(room, 0), PREFILL_NAME, vec![vec![slice(region, (room - 1000) * SLOT, SLOT)]], 0)
            .await
            .unwrap();
    }
    let gateway = pair.decode.pid().unwrap();
    assert!(maps_file(gateway, &pool_name));
    // Well within the grace nothing happens, even with the stream gone for a moment.
    tokio::time::sleep(Duration::from_millis(grace_ms * 2)).await;
    assert!(observer.get_room(room_key(1000, 0)).await.unwrap().state != "failed");

    // The engine dies: its connection and its stream go.
    let died = Instant::now();
    drop((watch, session, engine));
    for room in [1000u64, 1001] {
        let d = terminal_of(&mut decode_events, room, WAIT).await;
        assert!(!d.succeeded && d.reason == "engine_lost", "decode side of {room}: {d:?}");
        let p = terminal_of(&mut prefill_events, room, WAIT).await;
        assert!(
            !p.succeeded && p.reason == "aborted_by_peer" && p.peer_reason == "engine_lost",
            "prefill side of {room}: {p:?}"
        );
    }
    let bound = Duration::from_millis(grace_ms + kvgate::driver::HOUSEKEEPING_INTERVAL_MS + 1_000);
    assert!(died.elapsed() <= bound, "rooms ended {:?} after the engine died (bound {bound:?})", died.elapsed());
    // Its region is released (once its rooms are reusable: the peer confirms nothing can land) and
    // its memory unmapped.
    eventually(WAIT, "the region released", || async {
        matches!(observer.unregister_memory(region).await, Err(s) if reason_of(&s).as_deref() == Some("unknown_region"))
    }, &|| pair.decode.log()).await;
    eventually(WAIT, "the pool unmapped", || async { !maps_file(gateway, &pool_name) }, &|| pair.decode.log()).await;
    let log = plain_log(&pair.decode.log());
    assert!(log.contains("engine session ended") && log.contains("rooms_ended=2"), "{log}");
    // Calls naming the ended session are refused.
    let stale = observer.in_session(opened.session);
    let e = stale.expect(room_key(1002, 0), PREFILL_NAME, vec![vec![slice(region, 0, SLOT)]], 0).await.unwrap_err();
    assert_eq!(reason_of(&e).as_deref(), Some("unknown_session"));
    pair.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_back_within_its_grace_resumes_its_session_and_a_closed_one_ends_at_once() {
    let _serial = serial().await;
    let dir = work_dir();
    let settings = PairSettings {
        env_decode: env(&[("KVGATE__ENGINE_API__SESSION_GRACE_MS", "3000")]),
        ..PairSettings::default()
    };
    let mut pair = GatewayPair::start(&binary(), dir.path(), &settings).await.unwrap();
    let pool = KvPool::create(dir.path(), "resume-pool", SLOT, 2).unwrap();
    let first = Client::connect_unix(&pair.decode.socket).await.unwrap();
    let opened = first.open_session("decode-rank-1").await.unwrap();
    let session = first.in_session(opened.session);
    let region = session.register_shared_memory(&pool.path.display().to_string(), 0, pool.len(), "p").await.unwrap();
    let watch = session.watch_outcomes(None).await.unwrap();
    session.expect(room_key(1100, 0), PREFILL_NAME, vec![vec![slice(region, 0, SLOT)]], 0).await.unwrap();
    // A second engine may not take the name while the first is attached.
    let other = Client::connect_unix(&pair.decode.socket).await.unwrap();
    let e = other.open_session("decode-rank-1").await.unwrap_err();
    assert_eq!(reason_of(&e).as_deref(), Some("session_in_use"));
    drop((watch, session, first));
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Reconnected within the grace: the same session, its room still live.
    let again = Client::connect_unix(&pair.decode.socket).await.unwrap();
    let resumed = again.open_session("decode-rank-1").await.unwrap();
    assert!(resumed.resumed && resumed.session == opened.session, "{resumed:?}");
    let session = again.in_session(resumed.session);
    let _watch = session.watch_outcomes(None).await.unwrap();
    assert_eq!(session.get_room(room_key(1100, 0)).await.unwrap().state, "waiting_sender");
    // Closing it ends the room and releases the region at once.
    let closed = again.close_session(resumed.session).await.unwrap();
    assert_eq!((closed.rooms_ended, closed.regions_released + closed.regions_pending), (1, 1), "{closed:?}");
    assert_eq!(again.get_room(room_key(1100, 0)).await.unwrap().reason, "engine_lost");
    eventually(WAIT, "the region released once the room is reusable", || async {
        matches!(again.unregister_memory(region).await, Err(s) if reason_of(&s).as_deref() == Some("unknown_region"))
    }, &|| pair.decode.log()).await;
    // Bad names are refused with a reason.
    for bad in ["", "has space", &"x".repeat(129)] {
        let e = again.open_session(bad).await.unwrap_err();
        assert_eq!(reason_of(&e).as_deref(), Some("invalid_session_name"), "{bad:?}");
    }
    pair.stop();
}

/// `rooms` one-slice rooms of `SLOT` bytes: expects on decode and sends on prefill, each in batches.
async fn move_rooms(prefill: &Client, decode: &Client, src: u64, dst: u64, rooms: std::ops::Range<u64>) {
    let expects: Vec<proto::ExpectRequest> = rooms
        .clone()
        .map(|room| proto::ExpectRequest {
            key: Some(room_key(room, 0)),
            peer: PREFILL_NAME.into(),
            parts: vec![proto::PartSlices {
                slices: vec![slice(dst, (room % 256) * SLOT, SLOT)],
                source_kind: String::new(),
            }],
            timeout_ms: None,
            part_peers: Vec::new(),
        })
        .collect();
    let reply = decode.expect_batch(expects).await.unwrap();
    assert_eq!(
        reply.accepted as usize,
        rooms.clone().count(),
        "{:?}",
        reply.results.iter().find(|r| !r.reason.is_empty())
    );
    let sends: Vec<proto::SendRequest> = rooms
        .clone()
        .map(|room| proto::SendRequest {
            offset: None,
            key: Some(room_key(room, 0)),
            part: 0,
            chunk: 0,
            slices: vec![slice(src, (room % 256) * SLOT, SLOT)],
            last: true,
            peer: DECODE_NAME.into(),
        })
        .collect();
    let reply = prefill.send_batch(sends).await.unwrap();
    assert_eq!(reply.accepted as usize, rooms.count());
}

/// Reads every tracked room's outcomes, cutting the stream at random points; each room's Terminal
/// and Reusable must come exactly once.
async fn read_all(watch: &mut OutcomeWatch, rooms: &[u64], cut_every: u32) -> HashMap<u64, (u32, u32, bool)> {
    let mut seen: HashMap<u64, (u32, u32, bool)> = HashMap::new();
    let mut n = 0u32;
    while watch.pending() > 0 {
        let outcome = tokio::time::timeout(WAIT, watch.next()).await.expect("an outcome in time").unwrap();
        let entry = seen.entry(outcome.room().room).or_default();
        match outcome {
            Outcome::Terminal { terminal, .. } => {
                entry.0 += 1;
                entry.2 = terminal.succeeded;
            }
            Outcome::Reusable { .. } => entry.1 += 1,
        }
        n += 1;
        if rand_cut(n, cut_every) {
            watch.cut();
        }
    }
    assert_eq!(seen.len(), rooms.len(), "{seen:?} {:?}", watch.counts());
    seen
}

fn rand_cut(n: u32, every: u32) -> bool {
    // A fixed pseudo-random pattern: reproducible, and not periodic.
    let x = (n as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(17);
    x.is_multiple_of(every as u64)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_cut_at_random_points_under_load_loses_and_repeats_no_outcome() {
    let _serial = serial().await;
    let dir = work_dir();
    // A small replay log on the decode side, so that some cuts outlast it and force a reconcile.
    let settings = PairSettings {
        env_decode: env(&[("KVGATE__ENGINE_API__WATCH_REPLAY_EVENTS", "64")]),
        ..PairSettings::default()
    };
    let mut pair = GatewayPair::start(&binary(), dir.path(), &settings).await.unwrap();
    let prefill = Client::connect_unix(&pair.prefill.socket).await.unwrap();
    let decode = Client::connect_unix(&pair.decode.socket).await.unwrap();
    assert_eq!(decode.info().await.unwrap().api_version, 2);
    let src_pool = KvPool::create(dir.path(), "src", SLOT, 256).unwrap();
    let dst_pool = KvPool::create(dir.path(), "dst", SLOT, 256).unwrap();
    let src =
        prefill.register_shared_memory(&src_pool.path.display().to_string(), 0, src_pool.len(), "src").await.unwrap();
    let dst =
        decode.register_shared_memory(&dst_pool.path.display().to_string(), 0, dst_pool.len(), "dst").await.unwrap();

    // Round 1: 256 rooms in batches of 8, the stream cut at random points, each cut shorter than the
    // log: resumed from the log every time, never reconciled.
    let mut watch = OutcomeWatch::start(decode.clone()).await.unwrap();
    for batch in 0..32u64 {
        let rooms: Vec<u64> = (batch * 8..batch * 8 + 8).collect();
        for room in &rooms {
            watch.track(room_key(*room, 0), "receiver");
        }
        move_rooms(&prefill, &decode, src, dst, batch * 8..batch * 8 + 8).await;
        let seen = read_all(&mut watch, &rooms, 3).await;
        assert!(seen.values().all(|&(t, r, ok)| t == 1 && r == 1 && ok), "{seen:?}");
    }
    assert!(watch.counts().resumed > 5 && watch.counts().reconciled == 0, "{:?}", watch.counts());

    // Round 2: the stream is cut and 256 more rooms end before it comes back, far more than the
    // 64-event log holds: the watch reconciles from a snapshot, and still nothing is lost or repeated.
    let rooms: Vec<u64> = (256..512).collect();
    for room in &rooms {
        watch.track(room_key(*room, 0), "receiver");
    }
    watch.cut();
    move_rooms(&prefill, &decode, src, dst, 256..512).await;
    eventually(
        WAIT,
        "every room of round 2 reusable",
        || async { decode.list_rooms(false).await.unwrap().is_empty() },
        &|| String::new(),
    )
    .await;
    let seen = read_all(&mut watch, &rooms, 5).await;
    assert!(seen.values().all(|&(t, r, ok)| t == 1 && r == 1 && ok), "{seen:?}");
    assert!(watch.counts().reconciled >= 1, "{:?}", watch.counts());
    // A cursor the log no longer reaches is refused with its reason, naming what the log holds.
    let e = decode.watch_after(None, true, kvgate_client::Cursor { seq: 1, incarnation: 0 }).await.unwrap_err();
    assert_eq!(reason_of(&e).as_deref(), Some("watch_cursor_expired"), "{e:?}");
    pair.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_call_of_a_batch_stands_alone_and_a_batch_past_its_limit_is_refused_whole() {
    let _serial = serial().await;
    let dir = work_dir();
    let settings =
        PairSettings { env_decode: env(&[("KVGATE__ENGINE_API__MAX_BATCH_CALLS", "8")]), ..PairSettings::default() };
    let mut pair = GatewayPair::start(&binary(), dir.path(), &settings).await.unwrap();
    let decode = Client::connect_unix(&pair.decode.socket).await.unwrap();
    let pool = KvPool::create(dir.path(), "dst", SLOT, 8).unwrap();
    let dst = decode.register_shared_memory(&pool.path.display().to_string(), 0, pool.len(), "dst").await.unwrap();
    let expect = |room: u64, region: u64| proto::ExpectRequest {
        key: Some(RoomKey { room, generation: 0 }),
        peer: PREFILL_NAME.into(),
        parts: vec![proto::PartSlices {
            slices: vec![slice(region, (room % 8) * SLOT, SLOT)],
            source_kind: String::new(),
        }],
        timeout_ms: None,
        part_peers: Vec::new(),
    };
    // At the limit: 8 calls, the fourth naming an unknown region; the others are applied.
    let batch: Vec<_> = (0..8).map(|i| expect(1200 + i, if i == 3 { 999 } else { dst })).collect();
    let reply = decode.expect_batch(batch).await.unwrap();
    assert_eq!(reply.accepted, 7);
    assert_eq!(reply.results[3].reason, "unknown_region", "{:?}", reply.results);
    assert!(reply.results.iter().enumerate().all(|(i, r)| (i == 3) != r.reason.is_empty()));
    assert!(decode.get_room(room_key(1207, 0)).await.is_ok());
    // Just past it: refused whole, nothing applied.
    let batch: Vec<_> = (0..9).map(|i| expect(1300 + i, dst)).collect();
    let e = decode.expect_batch(batch).await.unwrap_err();
    assert_eq!(reason_of(&e).as_deref(), Some("too_many_calls"));
    assert!(decode.get_room(room_key(1300, 0)).await.is_err());
    pair.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunks_in_random_order_after_a_prefix_skip_land_byte_exact_and_overlaps_are_refused() {
    let _serial = serial().await;
    let dir = work_dir();
    let mut pair = GatewayPair::start(&binary(), dir.path(), &PairSettings::default()).await.unwrap();
    let prefill = Client::connect_unix(&pair.prefill.socket).await.unwrap();
    let decode = Client::connect_unix(&pair.decode.socket).await.unwrap();
    const PAGE: u64 = 4096;
    let mut src_pool = KvPool::create(dir.path(), "src", PAGE, 32).unwrap();
    let dst_pool = KvPool::create(dir.path(), "dst", PAGE, 32).unwrap();
    for page in 0..32 {
        src_pool.fill(page, 100 + page);
    }
    let src =
        prefill.register_shared_memory(&src_pool.path.display().to_string(), 0, src_pool.len(), "src").await.unwrap();
    let dst =
        decode.register_shared_memory(&dst_pool.path.display().to_string(), 0, dst_pool.len(), "dst").await.unwrap();
    // Two parts (a layer's K and V), 8 pages each on the prefill side; the decode side has the first
    // 2 pages of each cached and expects only pages 2..8, at scattered destination pages.
    let src_page = |part: u64, page: u64| part * 8 + page;
    let dst_page = |part: u64, page: u64| 31 - (part * 8 + page); // reversed: nothing adjacent in order
    let parts: Vec<Vec<kvgate_client::Slice>> =
        (0..2).map(|part| (2..8).map(|page| slice(dst, dst_page(part, page) * PAGE, PAGE)).collect()).collect();
    let room = room_key(1400, 0);
    let mut events = decode.watch_outcomes(None).await.unwrap();
    decode.expect(room, PREFILL_NAME, parts, 0).await.unwrap();
    // Three chunks of two pages per part, every chunk naming its offset in the 6-page stream, all six
    // sends in one batch in a shuffled order.
    let mut sends = Vec::new();
    for part in 0..2u64 {
        for chunk in 0..3u64 {
            let pages =
                (2 + 2 * chunk..4 + 2 * chunk).map(|page| slice(src, src_page(part, page) * PAGE, PAGE)).collect();
            sends.push(proto::SendRequest {
                key: Some(room),
                part: part as u32,
                chunk: chunk as u32,
                slices: pages,
                last: false,
                peer: DECODE_NAME.into(),
                offset: Some(2 * chunk * PAGE),
            });
        }
    }
    let order = [4usize, 1, 5, 0, 3, 2];
    let shuffled: Vec<_> = order.iter().map(|&i| sends[i].clone()).collect();
    // The last of the six, held back: first an overlapping one is refused with its reason.
    let (first_five, last) = shuffled.split_at(5);
    let reply = prefill.send_batch(first_five.to_vec()).await.unwrap();
    assert_eq!(reply.accepted, 5, "{:?}", reply.results);
    let mut overlapping = last[0].clone();
    overlapping.offset = Some(overlapping.offset.unwrap() - PAGE); // its first page overlaps a placed chunk
    let e = prefill.send(overlapping).await.unwrap_err();
    assert_eq!(reason_of(&e).as_deref(), Some("overlapping_chunk"), "{e:?}");
    let mut in_order = last[0].clone();
    in_order.offset = None;
    let e = prefill.send(in_order).await.unwrap_err();
    assert_eq!(reason_of(&e).as_deref(), Some("placement_mismatch"), "{e:?}");
    prefill.send(last[0].clone()).await.unwrap();
    let t = terminal_of(&mut events, 1400, WAIT).await;
    assert!(t.succeeded, "{t:?}");
    for part in 0..2 {
        for page in 2..8 {
            assert_eq!(
                dst_pool.slot(dst_page(part, page)),
                src_pool.slot(src_page(part, page)),
                "part {part} page {page}"
            );
        }
    }
    pair.stop();
}
