//! Shared helpers of the end-to-end tests: the built `kvgate` binary, a work folder on tmpfs, pools
//! and engines, admin reads. Tests in one file run one at a time (`serial()`): each starts gateway
//! processes, and a 2-core CI machine must not be oversubscribed into false heartbeat losses.
#![allow(dead_code)]

pub mod etcd;
pub mod pki;

use kvgate::admin_client as http;
use kvgate_demo::engine::Engine;
use kvgate_demo::pool::{KvPool, KvShape};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::sync::{Mutex, MutexGuard};

/// An async lock: tests hold it across their awaits, and a test that panics holding it does not
/// poison it for the rest.
static SERIAL: Mutex<()> = Mutex::const_new(());

pub async fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().await
}

/// The `kvgate` binary, built (or found up to date) first: it is the package `kvgate` (gateway/cli),
/// not this one, so cargo does not build it for these tests.
pub fn binary() -> PathBuf {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"));
    kvgate_host::artifacts::built_or_build_binary("kvgate", "kvgate", workspace).unwrap_or_else(|e| panic!("{e}"))
}

/// A temp folder on tmpfs (the shm plugin maps only shared-memory files).
pub fn work_dir() -> tempfile::TempDir {
    let base = if Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
    tempfile::Builder::new().prefix("kvgate-e2e-").tempdir_in(base).unwrap()
}

/// A small but real KV shape: 16 tokens x 128 KiB, 2 parts, 2 chunks (2 MiB per request).
pub fn small_shape() -> KvShape {
    KvShape::llama_8b_like(16, 2)
}

pub async fn engine(dir: &Path, socket: &Path, name: &str, shape: &KvShape, slots: u64) -> Engine {
    let pool = KvPool::create(dir, &format!("{name}-pool"), shape.request_bytes(), slots).unwrap();
    Engine::connect(socket, pool, name).await.unwrap()
}

pub async fn rooms_json(admin: &str) -> serde_json::Value {
    let (code, body) = http::get(admin, "/rooms").await.unwrap();
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// Wait (bounded) until `/rooms` on `admin` is empty; returns the last body.
pub async fn wait_rooms_empty(admin: &str, within: Duration) -> serde_json::Value {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let rooms = rooms_json(admin).await;
        if rooms.as_array().is_some_and(|a| a.is_empty()) || tokio::time::Instant::now() > deadline {
            return rooms;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub async fn metrics(admin: &str) -> String {
    let (code, body) = http::get(admin, "/metrics").await.unwrap();
    assert_eq!(code, 200);
    body
}

/// The value of one sample line of the Prometheus text (`name{labels}` exactly as printed).
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        l.strip_prefix(series).and_then(|rest| rest.trim().split(' ').next()).and_then(|v| v.parse().ok())
    })
}

/// The value of `series` on `admin`'s `/metrics`; 0 when the series is not printed.
pub async fn metric(admin: &str, series: &str) -> f64 {
    sample(&metrics(admin).await, series).unwrap_or(0.0)
}

/// `/discovery` of `admin`, parsed.
pub async fn discovery_view(admin: &str) -> serde_json::Value {
    let (code, body) = http::get(admin, "/discovery").await.unwrap();
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// The peers `/plugins` lists on `admin`.
pub async fn peers(admin: &str) -> Vec<serde_json::Value> {
    let (code, body) = http::get(admin, "/plugins").await.unwrap();
    assert_eq!(code, 200, "{body}");
    let value: serde_json::Value = serde_json::from_str(&body).unwrap();
    value["peers"].as_array().cloned().unwrap_or_default()
}

/// (wire name, state, closed reason) of every plugin instance `/plugins` lists on `admin`.
pub async fn plugin_instances(admin: &str) -> Vec<(String, String, String)> {
    let (code, body) = http::get(admin, "/plugins").await.unwrap();
    assert_eq!(code, 200, "{body}");
    let view: serde_json::Value = serde_json::from_str(&body).unwrap();
    view["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["generation"].as_u64().unwrap_or(0) > 0)
        .map(|p| {
            (
                p["wire_name"].as_str().unwrap().to_string(),
                p["state"].as_str().unwrap().to_string(),
                p["reason"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// Polls `check` every 50 ms until it holds; fails with `what` and `context()` after `within`.
pub async fn eventually<F, Fut>(within: Duration, what: &str, mut check: F, context: &dyn Fn() -> String)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + within;
    while !check().await {
        assert!(tokio::time::Instant::now() < deadline, "not within {within:?}: {what}\n{}", context());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A gateway's log without terminal colour codes.
#[allow(unused_imports)] // each test binary compiles this module; only some read logs
pub use kvgate::logging::without_colour as plain_log;

/// The `Terminal` event of `room` on a `Watch` stream, waiting up to `within`.
pub async fn terminal_event(
    stream: &mut tonic::Streaming<kvgate_client::proto::RoomEvent>,
    room: u64,
    within: Duration,
) -> kvgate_client::proto::Terminal {
    use kvgate_client::proto::room_event::Event;
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let event = tokio::time::timeout_at(deadline, stream.message())
            .await
            .expect("no terminal event in time")
            .unwrap()
            .expect("stream open");
        if let (Some(key), Some(Event::Terminal(t))) = (event.key, event.event) {
            if key.room == room {
                return t;
            }
        }
    }
}
