//! The operator's side against running gateways: `kvgate rooms`, `kvgate abort ROOM`,
//! `kvgate plugins list|inspect`, the stuck-room warning (named, or counted past its line ration) and
//! the one log line every failure gets.

mod common;

use common::*;
use kvgate_demo::engine::{expect_into, wait_terminal};
use kvgate_demo::gateways::{GatewayPair, PairSettings, PREFILL_NAME};
use std::process::Command;
use std::time::{Duration, Instant};

fn kvgate(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(binary()).args(args).env_remove("RUST_LOG").output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rooms_and_abort_commands_act_on_a_running_gateway_and_every_failure_is_logged() {
    let _serial = serial().await;
    let dir = work_dir();
    // The prefill side's own copy of room 802 (made by the decode side's expect notice) waits for a
    // send too: its bootstrap deadline is set well past the decode side's, so the room this test
    // watches ends with its own `bootstrap_timeout` rather than racing to a `sender_failed`.
    let prefill_bootstrap = vec![("KVGATE__SCHEDULER__BOOTSTRAP_TIMEOUT_MS".to_string(), "10000".to_string())];
    let settings = PairSettings {
        bootstrap_timeout_ms: 1_500,
        stuck_room_warn_ms: vec![300, 700],
        env_prefill: prefill_bootstrap,
        ..PairSettings::default()
    };
    let mut pair = GatewayPair::start(&binary(), dir.path(), &settings).await.unwrap();
    let shape = small_shape();
    let decode = engine(dir.path(), &pair.decode.socket, "decode", &shape, 2).await;
    let socket = pair.decode.socket.display().to_string();
    let mut aborted_rx = decode.events.listen(801);
    let mut timed_out_rx = decode.events.listen(802);
    let started = Instant::now();
    expect_into(&decode, &shape, 801, 0, PREFILL_NAME, 0).await.unwrap();
    expect_into(&decode, &shape, 802, 1, PREFILL_NAME, 0).await.unwrap();

    let (code, out, err) = kvgate(&["rooms", "--socket", &socket]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("801") && out.contains("802") && out.contains("2 room(s)"), "{out}");

    let (code, out, err) = kvgate(&["abort", "801", "--socket", &socket]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("801#0 aborted (it was live)"), "{out}");
    let o = wait_terminal(&mut aborted_rx, started, Duration::from_secs(5)).await.unwrap();
    assert_eq!(o.reason, "aborted");

    // Nobody sends room 802: stuck-room warnings at 300 and 700 ms, then bootstrap_timeout at 1.5 s.
    let o = wait_terminal(&mut timed_out_rx, started, Duration::from_secs(10)).await.unwrap();
    assert_eq!((o.reason.as_str(), o.phase.as_str()), ("bootstrap_timeout", "bootstrap"));
    let (code, out, _) = kvgate(&["rooms", "--socket", &socket]);
    assert_eq!(code, 0);
    assert!(out.contains("0 room(s)"), "{out}");
    let (code, out, _) = kvgate(&["rooms", "--socket", &socket, "--all"]);
    assert_eq!(code, 0);
    assert!(out.contains("bootstrap_timeout"), "{out}");

    tokio::time::sleep(Duration::from_millis(200)).await;
    let log = pair.decode.log();
    for age in [300, 700] {
        let stuck: Vec<&str> = log
            .lines()
            .filter(|l| l.contains(&format!("room still live at {age} ms")) && l.contains("802#0"))
            .collect();
        assert_eq!(stuck.len(), 1, "one warning at {age} ms for room 802:\n{log}");
    }
    for (room, reason) in [("801#0", "aborted"), ("802#0", "bootstrap_timeout")] {
        let line = log
            .lines()
            .find(|l| l.contains("room failed") && l.contains(room))
            .unwrap_or_else(|| panic!("no failure line for {room}:\n{log}"));
        for field in [reason, "phase", "peer", "elapsed_ms", "plugin"] {
            assert!(line.contains(field), "{room}: {field} missing in {line}");
        }
    }
    let text = metrics(&pair.decode.admin).await;
    assert!(
        sample(&text, "kvgate_room_failures_total{reason=\"bootstrap_timeout\",phase=\"bootstrap\",plugin=\"shm\"}")
            .is_some_and(|v| v >= 1.0),
        "{text}"
    );
    assert!(sample(&text, "kvgate_aborts_total").is_some_and(|v| v >= 1.0), "{text}");
    for age in [300, 700] {
        assert_eq!(sample(&text, &format!("kvgate_stuck_rooms_total{{age_ms=\"{age}\"}}")), Some(1.0), "{text}");
    }
    pair.stop();
}

/// The sum of the counts in the `N more rooms still live at AGE ms` summary lines.
fn summarized_at(log: &str, age: u64) -> u64 {
    let marker = format!(" more rooms still live at {age} ms");
    log.lines()
        .filter_map(|l| {
            let at = l.find(&marker)?;
            l[..at].rsplit(' ').next()?.parse::<u64>().ok()
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stuck_rooms_past_the_line_ration_are_counted_in_a_summary_line_not_dropped() {
    let _serial = serial().await;
    let dir = work_dir();
    const ROOMS: u64 = 4;
    // One named line a second (the ration's bound is 1 line at once): of four rooms stuck together,
    // one is named at 300 ms and the rest are counted; at 700 ms the ration has not refilled.
    let ration = vec![("KVGATE__ADMIN__STUCK_ROOM_WARN_LINES_PER_S".to_string(), "1".to_string())];
    let prefill_bootstrap = vec![("KVGATE__SCHEDULER__BOOTSTRAP_TIMEOUT_MS".to_string(), "10000".to_string())];
    let settings = PairSettings {
        bootstrap_timeout_ms: 1_500,
        stuck_room_warn_ms: vec![300, 700],
        env_decode: ration,
        env_prefill: prefill_bootstrap,
        ..PairSettings::default()
    };
    let mut pair = GatewayPair::start(&binary(), dir.path(), &settings).await.unwrap();
    let shape = small_shape();
    let decode = engine(dir.path(), &pair.decode.socket, "decode", &shape, ROOMS).await;
    let started = Instant::now();
    let mut ends = Vec::new();
    for n in 0..ROOMS {
        ends.push(decode.events.listen(900 + n));
        expect_into(&decode, &shape, 900 + n, n, PREFILL_NAME, 0).await.unwrap();
    }
    for rx in &mut ends {
        let o = wait_terminal(rx, started, Duration::from_secs(10)).await.unwrap();
        assert_eq!(o.reason, "bootstrap_timeout");
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let log = pair.decode.log();
    let named = |age: u64| log.lines().filter(|l| l.contains(&format!("room still live at {age} ms"))).count() as u64;
    assert!(named(300) + named(700) >= 1, "the ration's one line is used:\n{log}");
    assert!(named(300) + named(700) <= 2, "at most one line a second, and the rooms ended within 1.5 s:\n{log}");
    for age in [300, 700] {
        assert_eq!(
            named(age) + summarized_at(&log, age),
            ROOMS,
            "every stuck room at {age} ms named or counted:\n{log}"
        );
    }
    assert!(summarized_at(&log, 300) >= ROOMS - 1, "{log}");
    let text = metrics(&pair.decode.admin).await;
    for age in [300, 700] {
        assert_eq!(
            sample(&text, &format!("kvgate_stuck_rooms_total{{age_ms=\"{age}\"}}")),
            Some(ROOMS as f64),
            "{text}"
        );
    }
    pair.stop();
}

#[test]
fn plugins_list_shows_the_built_in_plugins_and_inspect_explains_a_bad_library() {
    let (code, out, err) = kvgate(&["plugins", "list"]);
    assert_eq!(code, 0, "{err}");
    for name in ["shm", "quic"] {
        assert!(out.lines().any(|l| l.starts_with(name) && l.contains("builtin")), "{out}");
    }
    let dir = work_dir();
    let fake = dir.path().join("libnot_a_plugin.so");
    std::fs::write(&fake, b"not an ELF object").unwrap();
    let (code, _, err) = kvgate(&["plugins", "inspect", &fake.display().to_string()]);
    assert_eq!(code, 1);
    assert!(err.contains("not loadable"), "{err}");
}
