//! The core never trusts a plugin. Both gateways load `silent-plugin` as a `.so` (a test fixture:
//! once a transfer's bytes are written it waits for an acknowledgement that never comes, and neither
//! its deadline, a cancel nor a disconnect ends the wait), and a room through it still ends: the core
//! fails it at its own transfer deadline, counts the plugin's silence as a contract violation and logs
//! it, keeps the memory quarantined (a silent plugin never proved that no byte can land any more) and
//! releases it at `quarantine_timeout_ms`, telling the engines why and logging it. A plugin that
//! reports every success twice has each duplicate counted and logged in bounded lines. Real
//! `kvgate serve` processes.

mod common;

use common::*;
use kvgate_client::proto;
use kvgate_demo::engine::{expect_into, send_all, wait_terminal};
use kvgate_demo::gateways::{GatewayPair, PairSettings, DECODE_NAME, PREFILL_NAME};
use kvgate_demo::pool::KvShape;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedReceiver;

const TRANSFER_BASE_MS: u64 = 400;
const PLUGIN_GRACE_MS: u64 = 300;
const QUARANTINE_TIMEOUT_MS: u64 = 2_000;
/// Well inside the quarantine: `/healthz` turns 503 past it.
const QUARANTINE_UNHEALTHY_MS: u64 = 300;
/// Scheduling slack on a loaded 2-core machine.
const SLACK: Duration = Duration::from_millis(1_500);

/// A plugin library of this workspace, built for this test's profile if it is not yet.
fn plugin_library(package: &str, lib_name: &str) -> PathBuf {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    kvgate_host::artifacts::built_or_build_cdylib(package, lib_name, &workspace).unwrap_or_else(|e| panic!("{e}"))
}

/// The reason of the room's `Reusable` event, waiting up to `within`.
async fn reusable_reason(rx: &mut UnboundedReceiver<proto::RoomEvent>, within: Duration) -> Option<String> {
    let deadline = tokio::time::Instant::now() + within;
    while let Ok(Some(event)) = tokio::time::timeout_at(deadline, rx.recv()).await {
        if let Some(proto::room_event::Event::Reusable(r)) = event.event {
            return Some(r.reason);
        }
    }
    None
}

fn lines_with(log: &str, needles: &[&str]) -> Vec<String> {
    plain_log(log).lines().filter(|l| needles.iter().all(|n| l.contains(n))).map(str::to_string).collect()
}

// CONFORMANCE: TIME-6, RES-4
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_that_never_ends_a_transfer_cannot_keep_a_room_alive() {
    let _serial = serial().await;
    let dir = work_dir();
    let env: Vec<(String, String)> = [
        ("KVGATE__SCHEDULER__TRANSFER_BASE_MS", TRANSFER_BASE_MS),
        ("KVGATE__SCHEDULER__PLUGIN_GRACE_MS", PLUGIN_GRACE_MS),
        ("KVGATE__SCHEDULER__QUARANTINE_TIMEOUT_MS", QUARANTINE_TIMEOUT_MS),
        ("KVGATE__ADMIN__QUARANTINE_UNHEALTHY_MS", QUARANTINE_UNHEALTHY_MS),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let settings = PairSettings {
        plugin: "silent-plugin".into(),
        plugin_libraries: vec![plugin_library("kvgate-gateway-fixture-silent-plugin", "kvgate_fixture_silent_plugin")],
        env_prefill: env.clone(),
        env_decode: env,
        ..PairSettings::default()
    };
    let mut pair = GatewayPair::start(&binary(), dir.path(), &settings).await.unwrap();
    let shape = small_shape();
    let prefill = engine(dir.path(), &pair.prefill.socket, "prefill", &shape, 2).await;
    let decode = engine(dir.path(), &pair.decode.socket, "decode", &shape, 2).await;
    let (admin_p, admin_d) = (pair.prefill.admin.clone(), pair.decode.admin.clone());
    let violations = "kvgate_plugin_contract_violations_total{clause=\"plugin_silent\"}";
    assert_eq!(metric(&admin_p, violations).await, 0.0);

    let room = 900;
    let (mut p_rx, mut d_rx) = (prefill.events.listen(room), decode.events.listen(room));
    expect_into(&decode, &shape, room, 0, PREFILL_NAME, 0).await.unwrap();
    let started = Instant::now();
    send_all(&prefill, &shape, room, 0, DECODE_NAME, None).await.unwrap();

    // The room ends at the core's transfer deadline, on both sides, although the plugin never ends it.
    let wait = Duration::from_millis(TRANSFER_BASE_MS) + SLACK + Duration::from_secs(5);
    let (p, d) = tokio::join!(wait_terminal(&mut p_rx, started, wait), wait_terminal(&mut d_rx, started, wait));
    let (p, d) = (p.unwrap(), d.unwrap());
    // Both sides keep the transfer deadline; whichever fires first tells the other.
    assert!(!p.succeeded && ["transfer_timeout", "receiver_failed"].contains(&p.reason.as_str()), "prefill: {p:?}");
    assert!(!d.succeeded && ["transfer_timeout", "sender_failed"].contains(&d.reason.as_str()), "decode: {d:?}");
    assert!(p.reason == "transfer_timeout" || d.reason == "transfer_timeout", "prefill {p:?}, decode {d:?}");
    assert!(p.seen_after >= Duration::from_millis(TRANSFER_BASE_MS), "not before the deadline: {p:?}");
    assert!(p.seen_after <= Duration::from_millis(TRANSFER_BASE_MS) + SLACK, "at the deadline: {p:?}");
    let failed_at = Instant::now();

    // The memory stays quarantined; the plugin's silence past its grace is counted and logged.
    assert!(metric(&admin_p, "kvgate_quarantined_bytes").await > 0.0, "{}", metrics(&admin_p).await);
    // One violation per transfer the plugin left without a terminal event: every chunk of every part.
    let transfers = (shape.parts * shape.chunks) as f64;
    eventually(
        Duration::from_millis(PLUGIN_GRACE_MS) + SLACK,
        "the silence counted as plugin_silent violations",
        || async { metric(&admin_p, violations).await == transfers },
        &|| pair.prefill.log(),
    )
    .await;
    let needles = ["plugin contract violation", "clause=\"plugin_silent\"", &format!("new={transfers} ")];
    let housekeeping = Duration::from_millis(2 * kvgate::driver::HOUSEKEEPING_INTERVAL_MS);
    eventually(
        housekeeping + SLACK,
        "the violations logged",
        || async { !lines_with(&pair.prefill.log(), &needles).is_empty() },
        &|| pair.prefill.log(),
    )
    .await;
    let logged = lines_with(&pair.prefill.log(), &["plugin contract violation"]);
    assert_eq!(logged.len(), 1, "one warning naming the clause and the count: {logged:?}");
    // Found on a timer, not in an event: the line still names the plugin, a transfer and the room.
    for needle in ["plugin=silent-plugin", "event=\"none\"", "xfer=", &format!("room={room}#"), "role=\"sender\""] {
        assert!(logged[0].contains(needle), "{needle:?} in {logged:?}");
    }
    let text = metrics(&admin_p).await;
    assert_eq!(sample(&text, "kvgate_rooms{state=\"quarantined\"}"), Some(1.0), "the room is still held:\n{text}");
    // The quarantine has an age, and past admin.quarantine_unhealthy_ms the gateway says it is unhealthy.
    eventually(
        SLACK,
        "the quarantine's age",
        || async { metric(&admin_p, "kvgate_oldest_room_age_seconds{state=\"quarantined\"}").await > 0.0 },
        &|| String::new(),
    )
    .await;
    eventually(
        Duration::from_millis(QUARANTINE_UNHEALTHY_MS) + SLACK,
        "/healthz 503 naming the quarantine",
        || async {
            let (code, body) = kvgate::admin_client::get(&admin_p, "/healthz").await.unwrap();
            code == 503 && body.contains("quarantined") && body.contains("admin.quarantine_unhealthy_ms")
        },
        &|| String::new(),
    )
    .await;

    // ...until quarantine_timeout_ms: then released, the engines told why, and the log says so.
    let within = Duration::from_millis(QUARANTINE_TIMEOUT_MS) + SLACK;
    assert_eq!(reusable_reason(&mut p_rx, within).await.as_deref(), Some("quarantine_timeout"), "prefill");
    assert!(
        failed_at.elapsed() >= Duration::from_millis(QUARANTINE_TIMEOUT_MS) - Duration::from_millis(200),
        "not released early: {:?}",
        failed_at.elapsed()
    );
    assert_eq!(reusable_reason(&mut d_rx, within).await.as_deref(), Some("quarantine_timeout"), "decode");
    for (name, admin, log) in [("prefill", &admin_p, pair.prefill.log()), ("decode", &admin_d, pair.decode.log())] {
        eventually(
            SLACK,
            &format!("{name}: nothing quarantined"),
            || async { metric(admin, "kvgate_quarantined_bytes").await == 0.0 },
            &|| String::new(),
        )
        .await;
        let left = wait_rooms_empty(admin, SLACK).await;
        assert!(left.as_array().unwrap().is_empty(), "{name} /rooms: {left}");
        let timed_out = lines_with(&log, &["quarantine timed out", &format!("room={room}#")]);
        assert_eq!(timed_out.len(), 1, "{name}: one warning: {timed_out:?}\n{log}");
        assert!(timed_out[0].contains("plugin=silent-plugin"), "{name}: names the plugin: {timed_out:?}");
        let failures = "kvgate_core_failures_total{reason=\"quarantine_timeout\",phase=\"terminal\"}";
        assert_eq!(metric(admin, failures).await, 1.0, "{name}: {}", metrics(admin).await);
    }
    // Only the sender's plugin went silent; the receiver's core counted nothing against it.
    assert_eq!(metric(&admin_d, violations).await, 0.0);
    pair.stop();
}

/// A plugin that reports every success twice (the `double-success` conformance mutant, as a `.so`),
/// one transfer a room: the core does not take the plugin's word. A duplicate that arrives while the
/// room is live fails it `plugin_protocol_violation`; one that arrives after it settled is only
/// counted. Either way every room ends, every duplicate is counted, and the log carries at most one
/// line per housekeeping round for them, never one per event.
// CONFORMANCE: OBS-4
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_events_are_counted_each_and_logged_in_bounded_lines() {
    let _serial = serial().await;
    let dir = work_dir();
    // The conformance mutants' library, with the `double-success` defect.
    let library = plugin_library("kvgate-mutants", "kvgate_mutants");
    let env = vec![("KVGATE_MUTANT".to_string(), "double-success".to_string())];
    let settings = PairSettings {
        plugin: "mutant-double-success".into(),
        plugin_libraries: vec![library],
        env_prefill: env.clone(),
        env_decode: env,
        ..PairSettings::default()
    };
    let mut pair = GatewayPair::start(&binary(), dir.path(), &settings).await.unwrap();
    let shape = KvShape { parts: 1, chunks: 1, ..small_shape() };
    let prefill = engine(dir.path(), &pair.prefill.socket, "prefill", &shape, 2).await;
    let decode = engine(dir.path(), &pair.decode.socket, "decode", &shape, 2).await;
    let admin = pair.prefill.admin.clone();
    let rooms = 30u64;
    let started = Instant::now();
    for room in 0..rooms {
        let r =
            kvgate_demo::engine::run_room(&prefill, &decode, &shape, 1_000 + room, room % 2, room % 2).await.unwrap();
        let distrusted = !r.prefill.succeeded && r.prefill.reason == "plugin_protocol_violation" && !r.decode.succeeded;
        assert!(r.verified || distrusted, "room {room}: {r:?}");
    }
    let duplicates = rooms as f64;
    let series = "kvgate_plugin_contract_violations_total{clause=\"duplicate_event\"}";
    eventually(SLACK, "every duplicate counted", || async { metric(&admin, series).await == duplicates }, &|| {
        pair.prefill.log()
    })
    .await;
    // Every count is logged once the next housekeeping round has run.
    tokio::time::sleep(Duration::from_millis(2 * kvgate::driver::HOUSEKEEPING_INTERVAL_MS)).await;
    let elapsed = started.elapsed();
    let lines = lines_with(&pair.prefill.log(), &["plugin contract violation", "clause=\"duplicate_event\""]);
    let logged: u64 = lines
        .iter()
        .map(|l| {
            l.split("new=").nth(1).and_then(|v| v.split(' ').next()).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
        })
        .sum();
    assert_eq!(logged as f64, duplicates, "the lines add up to the count: {lines:#?}");
    for line in &lines {
        let named = ["plugin=mutant-double-success", "event=\"succeeded\"", "room=10", "role=\"sender\"", "xfer="];
        assert!(
            named.iter().all(|n| line.contains(n)),
            "names the latest duplicate's plugin, event, transfer and room: {line}"
        );
    }
    let rounds = elapsed.as_millis() as u64 / kvgate::driver::HOUSEKEEPING_INTERVAL_MS + 1;
    assert!(
        lines.len() as u64 <= rounds && (lines.len() as f64) < duplicates,
        "{} lines for {duplicates} duplicates in {elapsed:?}",
        lines.len()
    );
    pair.stop();
}
