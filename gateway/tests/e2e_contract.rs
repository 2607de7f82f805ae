//! The contract clauses the gateway itself enforces (CONFORMANCE.md): layout checks before any byte
//! moves (HANDSHAKE-1), shutdown leaves nothing live (RES-6), every failure logged with its fields
//! every time (OBS-3), the metrics that must exist and move (OBS-4). Real `kvgate serve` processes.

mod common;

use common::*;
use kvgate_client::{proto, reason_of, room_key, slice};
use kvgate_demo::engine::{prepare_slots, run_room, slot_checksum, wait_terminal};
use kvgate_demo::gateways::{GatewayPair, PairSettings, DECODE_NAME, PREFILL_NAME};
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(10);

/// The `room failed` lines of `log` for `room`.
fn failure_lines(log: &str, room: u64) -> Vec<String> {
    plain_log(log)
        .lines()
        .filter(|l| l.contains("room failed") && l.contains(&format!("room={room}#")))
        .map(str::to_string)
        .collect()
}

// CONFORMANCE: HANDSHAKE-1
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layout_mismatch_fails_the_room_before_any_byte_moves_and_harms_nothing_else() {
    let _serial = serial().await;
    let dir = work_dir();
    let mut pair = GatewayPair::start(&binary(), dir.path(), &PairSettings::default()).await.unwrap();
    let shape = small_shape();
    let prefill = engine(dir.path(), &pair.prefill.socket, "prefill", &shape, 3).await;
    let decode = engine(dir.path(), &pair.decode.socket, "decode", &shape, 3).await;
    let part = shape.part_bytes();

    // Part count: the sender comes first with two parts; the receiver then expects one.
    prepare_slots(&prefill, &decode, 800, 0, 0).await.unwrap();
    let cleared = slot_checksum(&decode, 0).await.unwrap();
    let (mut p_rx, mut d_rx) = (prefill.events.listen(800), decode.events.listen(800));
    let started = Instant::now();
    for p in 0..2u32 {
        let send = proto::SendRequest {
            offset: None,
            key: Some(room_key(800, 0)),
            part: p,
            chunk: 0,
            slices: vec![slice(prefill.region, p as u64 * part, part)],
            last: true,
            peer: DECODE_NAME.into(),
        };
        prefill.client.send(send).await.unwrap();
    }
    decode.client.expect(room_key(800, 0), PREFILL_NAME, vec![vec![slice(decode.region, 0, part)]], 0).await.unwrap();
    let (p, d) = tokio::join!(wait_terminal(&mut p_rx, started, WAIT), wait_terminal(&mut d_rx, started, WAIT));
    let (p, d) = (p.unwrap(), d.unwrap());
    assert!(!p.succeeded && p.reason == "layout_mismatch", "prefill: {p:?}");
    assert!(!d.succeeded && !d.reason.is_empty(), "decode: {d:?}");
    assert!(p.seen_after < Duration::from_secs(2) && d.seen_after < Duration::from_secs(2), "fast: {p:?} {d:?}");
    assert_eq!(slot_checksum(&decode, 0).await.unwrap(), cleared, "no byte reached the destination");

    // Lengths: the sender's only chunk is 4 KiB and last; the receiver expects a whole part.
    let (mut p_rx, mut d_rx) = (prefill.events.listen(801), decode.events.listen(801));
    let started = Instant::now();
    let send = proto::SendRequest {
        offset: None,
        key: Some(room_key(801, 0)),
        part: 0,
        chunk: 0,
        slices: vec![slice(prefill.region, 0, 4096)],
        last: true,
        peer: DECODE_NAME.into(),
    };
    prefill.client.send(send).await.unwrap();
    decode
        .client
        .expect(room_key(801, 0), PREFILL_NAME, vec![vec![slice(decode.region, part, part)]], 0)
        .await
        .unwrap();
    let (p, d) = tokio::join!(wait_terminal(&mut p_rx, started, WAIT), wait_terminal(&mut d_rx, started, WAIT));
    let (p, d) = (p.unwrap(), d.unwrap());
    assert!(!p.succeeded && p.reason == "length_mismatch", "prefill: {p:?}");
    assert!(!d.succeeded && !d.reason.is_empty(), "decode: {d:?}");
    assert_eq!(slot_checksum(&decode, 0).await.unwrap(), cleared, "no byte reached the destination");
    for room in [800, 801] {
        let lines = failure_lines(&pair.prefill.log(), room);
        assert_eq!(lines.len(), 1, "one failure line for room {room}: {lines:?}");
    }

    // Nothing else harmed: the same pair, the same link, a clean room right after.
    let r = run_room(&prefill, &decode, &shape, 802, 2, 2).await.unwrap();
    assert!(r.verified, "{r:?}");

    // Versions: a peer speaking another peer-link protocol version is refused before its first frame.
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", pair.prefill.peer_listen))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = proto::peer_link_client::PeerLinkClient::new(channel);
    let hello = proto::PeerFrame {
        frame: Some(proto::peer_frame::Frame::Hello(proto::Hello {
            name: DECODE_NAME.into(),
            incarnation: 7,
            protocol_version: 999,
            plugins: vec![],
            host: "localhost".into(),
            to: PREFILL_NAME.into(),
            ..Default::default()
        })),
        mac: vec![],
    };
    let refused = client.link(tokio_stream::iter(vec![hello])).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition, "{refused:?}");
    assert!(refused.message().starts_with("version_mismatch"), "{refused:?}");
    // ...and the live link with the real decode gateway is untouched.
    let r = run_room(&prefill, &decode, &shape, 803, 1, 1).await.unwrap();
    assert!(r.verified, "{r:?}");
    pair.stop();
}

// CONFORMANCE: RES-6
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_shutdown_ends_every_live_room_shuts_plugins_down_and_releases_registrations() {
    let _serial = serial().await;
    let dir = work_dir();
    let mut pair = GatewayPair::start(&binary(), dir.path(), &PairSettings::default()).await.unwrap();
    let shape = small_shape();
    let prefill = engine(dir.path(), &pair.prefill.socket, "prefill", &shape, 3).await;
    let decode = engine(dir.path(), &pair.decode.socket, "decode", &shape, 3).await;
    let part = shape.part_bytes();
    // Three rooms live on the decode gateway, waiting for a sender that has not come yet.
    let rooms = [810u64, 811, 812];
    let mut listeners = Vec::new();
    for (i, room) in rooms.iter().enumerate() {
        listeners.push((*room, decode.events.listen(*room), prefill.events.listen(*room)));
        decode
            .client
            .expect(room_key(*room, 0), PREFILL_NAME, vec![vec![slice(decode.region, i as u64 * part, part)]], 0)
            .await
            .unwrap();
    }
    // Wait until the prefill gateway knows them too (the expect notices crossed the link).
    let deadline = Instant::now() + WAIT;
    for room in rooms {
        while prefill.client.get_room(room_key(room, 0)).await.is_err() {
            assert!(Instant::now() < deadline, "room {room} never reached the prefill gateway");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    let started = Instant::now();
    let decode_process = &mut pair.decode;
    decode_process.stop(Duration::from_secs(15));
    let stopped_in = started.elapsed();
    let log = plain_log(&decode_process.log());
    assert!(log.contains("shutdown: every live room aborted") && log.contains("rooms=3"), "{log}");
    assert!(log.contains("plugin shut down plugin=shm"), "{log}");
    let last = log
        .lines()
        .find(|l| l.contains("driver stopped, plugins shut down, registrations released"))
        .unwrap_or_else(|| panic!("{log}"));
    assert!(
        last.contains("rooms_aborted=3")
            && last.contains("rooms_still_quarantined=0")
            && last.contains("regions_released=1"),
        "{last}"
    );
    assert!(stopped_in < Duration::from_secs(5), "stopped in {stopped_in:?}");
    for room in rooms {
        let lines = failure_lines(&log, room);
        assert!(lines.len() == 1 && lines[0].contains("reason=\"aborted\""), "room {room}: {lines:?}");
    }
    // The decode engines saw their rooms end, and the prefill side ended each room too (told by the
    // abort, or at worst by the link's loss), so nothing on either side stays live.
    for (room, mut d_rx, mut p_rx) in listeners {
        let d = wait_terminal(&mut d_rx, started, WAIT).await.unwrap();
        assert!(!d.succeeded && d.reason == "aborted", "decode room {room}: {d:?}");
        let p = wait_terminal(&mut p_rx, started, WAIT).await.unwrap();
        assert!(
            !p.succeeded && (p.reason == "aborted_by_peer" || p.reason == "peer_lost"),
            "prefill room {room}: {p:?}"
        );
    }
    let left = wait_rooms_empty(&pair.prefill.admin, WAIT).await;
    assert!(left.as_array().unwrap().is_empty(), "{left}");
    pair.stop();
}

// CONFORMANCE: OBS-3
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_failure_is_logged_every_time_with_reason_room_peer_phase_and_elapsed() {
    let _serial = serial().await;
    let dir = work_dir();
    let mut pair = GatewayPair::start(&binary(), dir.path(), &PairSettings::default()).await.unwrap();
    let shape = small_shape();
    let decode = engine(dir.path(), &pair.decode.socket, "decode", &shape, 2).await;
    let part = shape.part_bytes();
    // The same failure twice (a sender that never comes within the room's 300 ms deadline), then an abort.
    let mut rx = Vec::new();
    for room in [820u64, 821, 822] {
        rx.push(decode.events.listen(room));
        let timeout_ms = if room == 822 { 0 } else { 300 };
        decode
            .client
            .expect(room_key(room, 0), PREFILL_NAME, vec![vec![slice(decode.region, 0, part)]], timeout_ms)
            .await
            .unwrap();
    }
    decode.client.abort(room_key(822, 0), "the test aborts it").await.unwrap();
    let started = Instant::now();
    for r in rx.iter_mut() {
        let o = wait_terminal(r, started, WAIT).await.unwrap();
        assert!(!o.succeeded, "{o:?}");
    }
    let log = pair.decode.log();
    for (room, reason) in [(820u64, "room_timeout"), (821, "room_timeout"), (822, "aborted")] {
        let lines = failure_lines(&log, room);
        assert_eq!(lines.len(), 1, "room {room}: {lines:?}");
        let line = &lines[0];
        for field in [
            format!("reason=\"{reason}\""),
            "role=\"receiver\"".into(),
            "phase=\"bootstrap\"".into(),
            format!("peer={PREFILL_NAME}"),
            "plugin=".into(),
        ] {
            assert!(line.contains(&field), "room {room}: no {field} in {line}");
        }
        let elapsed: u64 = line
            .split("elapsed_ms=")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{line}"));
        if reason == "room_timeout" {
            assert!((300..5_000).contains(&elapsed), "room {room}: elapsed_ms={elapsed} for a 300 ms deadline");
        }
    }
    pair.stop();
}

// CONFORMANCE: OBS-4
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_export_states_ages_reasons_violations_late_messages_and_quarantine_and_they_move() {
    let _serial = serial().await;
    let dir = work_dir();
    let mut pair = GatewayPair::start(&binary(), dir.path(), &PairSettings::default()).await.unwrap();
    let shape = small_shape();
    let decode = engine(dir.path(), &pair.decode.socket, "decode", &shape, 2).await;
    let part = shape.part_bytes();
    let admin = pair.decode.admin.clone();

    let first = metrics(&admin).await;
    // (Counters are typed without their `_total` suffix; their samples carry it.)
    for family in [
        "kvgate_rooms gauge",
        "kvgate_oldest_room_age_seconds gauge",
        "kvgate_plugin_contract_violations counter",
        "kvgate_late_messages counter",
        "kvgate_quarantined_bytes gauge",
    ] {
        assert!(first.contains(&format!("# TYPE {family}")), "no {family} family:\n{first}");
    }
    assert!(first.contains("kvgate_plugin_contract_violations_total{clause="), "violations by clause:\n{first}");
    let waiting = "kvgate_rooms{state=\"waiting_sender\"}";
    let age = "kvgate_oldest_room_age_seconds{state=\"waiting_sender\"}";
    assert_eq!(sample(&first, waiting).unwrap_or(0.0), 0.0, "{first}");

    // A room waiting for its sender: the state gauge and its age move.
    let mut rx = decode.events.listen(830);
    decode.client.expect(room_key(830, 0), PREFILL_NAME, vec![vec![slice(decode.region, 0, part)]], 0).await.unwrap();
    tokio::time::sleep(Duration::from_millis(600)).await;
    let live = metrics(&admin).await;
    assert_eq!(sample(&live, waiting), Some(1.0), "{live}");
    assert!(sample(&live, age).is_some_and(|a| a >= 0.5), "{live}");

    // Its abort: the failure counter by reason moves, the gauges fall back.
    let failures = |text: &str| -> f64 {
        text.lines()
            .filter(|l| l.starts_with("kvgate_room_failures_total{") && l.contains("reason=\"aborted\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    decode.client.abort(room_key(830, 0), "the test aborts it").await.unwrap();
    wait_terminal(&mut rx, Instant::now(), WAIT).await.unwrap();
    // A late call for the aborted room is refused and counted as late.
    let late = decode
        .client
        .expect(room_key(830, 0), PREFILL_NAME, vec![vec![slice(decode.region, 0, part)]], 0)
        .await
        .unwrap_err();
    assert_eq!(reason_of(&late).as_deref(), Some("room_terminal"), "{late:?}");
    let after = metrics(&admin).await;
    assert_eq!(failures(&after) - failures(&live), 1.0, "{after}");
    assert_eq!(sample(&after, waiting).unwrap_or(0.0), 0.0, "{after}");
    let late_total = |text: &str| -> f64 {
        text.lines()
            .filter(|l| l.starts_with("kvgate_late_messages_total"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    assert!(late_total(&after) > late_total(&live), "late messages did not move:\n{after}");
    pair.stop();
}

// CONFORMANCE: DATA-6
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watchers_that_stall_or_vanish_and_a_busy_scraper_change_no_room_outcome() {
    let _serial = serial().await;
    let dir = work_dir();
    let settings = PairSettings {
        env_decode: vec![("KVGATE__ENGINE_API__WATCH_BUFFER_EVENTS".into(), "16".into())],
        ..PairSettings::default()
    };
    let mut pair = GatewayPair::start(&binary(), dir.path(), &settings).await.unwrap();
    let shape = small_shape();
    let prefill = engine(dir.path(), &pair.prefill.socket, "prefill", &shape, 2).await;
    let decode = engine(dir.path(), &pair.decode.socket, "decode", &shape, 2).await;
    // Telemetry consumers gone wrong: a watcher that never reads its stream, one that hangs up
    // mid-way, and a scraper that reads /metrics without pause.
    let stalled = kvgate_client::Client::connect_unix(&pair.decode.socket).await.unwrap();
    let stalled_watch = stalled.watch(None).await.unwrap();
    let vanishing = kvgate_client::Client::connect_unix(&pair.decode.socket).await.unwrap();
    let mut vanishing_watch = Some(vanishing.watch(None).await.unwrap());
    let admin = pair.decode.admin.clone();
    let scraping = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let scraper = {
        let scraping = scraping.clone();
        tokio::spawn(async move {
            let mut scrapes = 0u64;
            while scraping.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = kvgate::admin_client::get(&admin, "/metrics").await;
                scrapes += 1;
            }
            scrapes
        })
    };
    // Far more room events than the 16-event watch buffer: every room still succeeds, verified.
    let rooms = 120u64;
    for i in 0..rooms {
        if i == rooms / 2 {
            drop(vanishing_watch.take());
        }
        let r = run_room(&prefill, &decode, &shape, 10_000 + i, i % 2, i % 2).await.unwrap();
        assert!(r.verified, "room {}: {r:?}", 10_000 + i);
    }
    scraping.store(false, std::sync::atomic::Ordering::Relaxed);
    assert!(scraper.await.unwrap() > 0);
    let text = metrics(&pair.decode.admin).await;
    assert_eq!(sample(&text, "kvgate_rooms_succeeded_total"), Some(rooms as f64), "{text}");
    let failed: f64 = text
        .lines()
        .filter(|l| l.starts_with("kvgate_room_failures_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(failed, 0.0, "{text}");
    drop(stalled_watch);
    pair.stop();
}
