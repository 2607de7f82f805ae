//! Listener bounds through real `kvgate serve` processes: connections past a listener's cap are
//! closed at once while the ones inside it (a real engine's included) keep working; silent
//! connections are closed after the handshake bound; and a gateway out of file descriptors backs
//! off instead of spinning, logs the cause once per interval, and serves again once descriptors
//! are free.

mod common;

use common::*;
use kvgate::admin_client as http;
use kvgate_demo::gateways::{GatewayPair, PairSettings};
use std::time::{Duration, Instant};
use tokio::io::AsyncReadExt;

const WAIT: Duration = Duration::from_secs(20);

/// Whether the gateway closed `stream` within `within` (EOF or an error), as opposed to holding it.
/// What it sends before (an HTTP/2 server's SETTINGS) is read and dropped.
async fn closed_within<S: tokio::io::AsyncRead + Unpin>(stream: &mut S, within: Duration) -> bool {
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => continue,
            Err(_) => return false,
        }
    }
}

fn metric(text: &str, listener: &str, reason: &str) -> u64 {
    let prefix = format!("kvgate_listener_refused_total{{listener=\"{listener}\",reason=\"{reason}\"}} ");
    text.lines().find_map(|l| l.strip_prefix(&prefix)).map(|v| v.trim().parse::<f64>().unwrap() as u64).unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_a_cap_are_closed_and_silent_ones_end_after_the_handshake_bound() {
    let _serial = serial().await;
    let dir = work_dir();
    let env = vec![
        ("KVGATE__ADMIN__CONNECTIONS__MAX_CONNECTIONS".to_string(), "4".to_string()),
        ("KVGATE__ADMIN__CONNECTIONS__HANDSHAKE_TIMEOUT_MS".to_string(), "1500".to_string()),
        ("KVGATE__ENGINE_API__CONNECTIONS__MAX_CONNECTIONS".to_string(), "3".to_string()),
        ("KVGATE__ENGINE_API__CONNECTIONS__HANDSHAKE_TIMEOUT_MS".to_string(), "1500".to_string()),
    ];
    let mut pair =
        GatewayPair::start(&binary(), dir.path(), &PairSettings { env_decode: env, ..PairSettings::default() })
            .await
            .unwrap();
    let admin = pair.decode.admin.clone();

    // Admin: four silent connections are held (the cap), the fifth is closed at once.
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(tokio::net::TcpStream::connect(&admin).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut fifth = tokio::net::TcpStream::connect(&admin).await.unwrap();
    assert!(closed_within(&mut fifth, Duration::from_secs(5)).await, "the connection past admin's cap was kept");
    for stream in held.iter_mut() {
        assert!(
            !closed_within(stream, Duration::from_millis(100)).await,
            "a connection within the cap was closed early"
        );
    }
    // Silent past handshake_timeout_ms: closed by the gateway, and admin answers again.
    for stream in held.iter_mut() {
        assert!(
            closed_within(stream, Duration::from_secs(10)).await,
            "a silent connection was kept past its handshake bound"
        );
    }
    let (code, text) = http::get(&admin, "/metrics").await.unwrap();
    assert_eq!(code, 200);
    assert!(metric(&text, "admin", "connection_limit") >= 1, "{text}");
    assert!(metric(&text, "admin", "handshake_timeout") >= 4, "{text}");

    // Engine socket: a real engine holds one place; two raw connections take the rest; the next is
    // closed, and the engine's own calls go on.
    let shape = small_shape();
    let decode = engine(dir.path(), &pair.decode.socket, "decode", &shape, 1).await;
    let mut raw = Vec::new();
    for _ in 0..2 {
        raw.push(tokio::net::UnixStream::connect(&pair.decode.socket).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut past = tokio::net::UnixStream::connect(&pair.decode.socket).await.unwrap();
    assert!(
        closed_within(&mut past, Duration::from_secs(5)).await,
        "the connection past the engine socket's cap was kept"
    );
    decode.client.list_rooms(true).await.expect("the engine's own connection keeps working at the cap");
    for stream in raw.iter_mut() {
        assert!(closed_within(stream, Duration::from_secs(10)).await, "a silent engine-socket connection was kept");
    }
    decode.client.list_rooms(true).await.expect("the engine's connection outlived the silent ones");
    let (_, text) = http::get(&admin, "/metrics").await.unwrap();
    assert!(metric(&text, "engine_api", "connection_limit") >= 1, "{text}");
    let log = pair.decode.log();
    assert!(log.contains("listener=\"admin\"") || log.contains("listener=admin"), "no refusal logged:\n{log}");
    pair.stop();
}

fn open_descriptors(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count()).unwrap_or(0)
}

/// utime + stime of `pid`, in clock ticks.
fn cpu_ticks(pid: i32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after_name = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_descriptors_the_gateway_backs_off_logs_and_serves_again() {
    let _serial = serial().await;
    let dir = work_dir();
    let env = vec![
        ("KVGATE__ADMIN__CONNECTIONS__MAX_CONNECTIONS".to_string(), "1000".to_string()),
        ("KVGATE__ENGINE_API__CONNECTIONS__MAX_CONNECTIONS".to_string(), "1000".to_string()),
    ];
    let mut pair =
        GatewayPair::start(&binary(), dir.path(), &PairSettings { env_decode: env, ..PairSettings::default() })
            .await
            .unwrap();
    let pid = pair.decode.pid().unwrap();
    let limit = open_descriptors(pid) + 16;
    let status = std::process::Command::new("prlimit")
        .arg(format!("--pid={pid}"))
        .arg(format!("--nofile={limit}:{limit}"))
        .status()
        .unwrap();
    assert!(status.success(), "prlimit failed");
    let admin = pair.decode.admin.clone();
    // Both kinds of listener: admin (axum) over TCP and the engine API (tonic) on its socket.
    let mut flood = Vec::new();
    let mut engine_flood = Vec::new();
    for _ in 0..64 {
        flood.push(tokio::net::TcpStream::connect(&admin).await.unwrap());
        engine_flood.push(tokio::net::UnixStream::connect(&pair.decode.socket).await.unwrap());
    }
    // The gateway is out of descriptors now; a spinning accept loop would burn a whole core.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (ticks, started) = (cpu_ticks(pid), Instant::now());
    tokio::time::sleep(Duration::from_secs(2)).await;
    let spent = (cpu_ticks(pid) - ticks) as f64 / 100.0;
    assert!(
        spent < 0.5 * started.elapsed().as_secs_f64(),
        "the gateway spent {spent:.2} s of CPU in {:?} out of descriptors",
        started.elapsed()
    );
    for listener in ["admin", "engine_api"] {
        let lines = pair.decode.log().lines().filter(|l| l.contains("accept failed") && l.contains(listener)).count();
        assert!(
            (1..=2).contains(&lines),
            "expected one rate-limited accept-failure line of {listener}, found {lines}:\n{}",
            pair.decode.log()
        );
    }
    drop(flood);
    drop(engine_flood);
    let deadline = Instant::now() + WAIT;
    loop {
        if let Ok(Ok((200, text))) = tokio::time::timeout(Duration::from_secs(2), http::get(&admin, "/metrics")).await {
            assert!(metric(&text, "admin", "accept_error") >= 1, "{text}");
            assert!(metric(&text, "engine_api", "accept_error") >= 1, "{text}");
            break;
        }
        assert!(Instant::now() < deadline, "admin did not answer again once descriptors were free");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    pair.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_engine_connection_cannot_take_every_watch_place() {
    let _serial = serial().await;
    let dir = work_dir();
    let env = vec![
        ("KVGATE__ENGINE_API__MAX_WATCHERS".to_string(), "4".to_string()),
        ("KVGATE__ENGINE_API__MAX_WATCHERS_PER_CONNECTION".to_string(), "2".to_string()),
    ];
    let mut pair =
        GatewayPair::start(&binary(), dir.path(), &PairSettings { env_decode: env, ..PairSettings::default() })
            .await
            .unwrap();
    let greedy = kvgate_client::Client::connect_unix(&pair.decode.socket).await.unwrap();
    let other = kvgate_client::Client::connect_unix(&pair.decode.socket).await.unwrap();
    // At the per-connection limit: accepted; one past it: refused with its reason.
    let mut greedy_streams = vec![greedy.watch(None).await.unwrap(), greedy.watch_outcomes(None).await.unwrap()];
    let e = greedy.watch(None).await.unwrap_err();
    assert_eq!(kvgate_client::reason_of(&e).as_deref(), Some("too_many_watchers"), "{e:?}");
    assert!(e.message().contains("max_watchers_per_connection"), "{}", e.message());
    // Another connection still finds places.
    let _others = [other.watch(None).await.unwrap(), other.watch(None).await.unwrap()];
    // A stream that ends gives its connection's place back.
    drop(greedy_streams.pop());
    let deadline = Instant::now() + WAIT;
    loop {
        match greedy.watch(None).await {
            Ok(stream) => {
                greedy_streams.push(stream);
                break;
            }
            Err(e) => {
                assert_eq!(kvgate_client::reason_of(&e).as_deref(), Some("too_many_watchers"), "{e:?}");
                assert!(Instant::now() < deadline, "the ended stream's place was never given back");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    pair.stop();
}
