//! The demo's swap act, on a fresh shm gateway pair: rooms keep moving while both gateways switch
//! their transport from shm to QUIC and back (`POST /plugins/reload`), and not one is lost: every
//! room succeeds with its bytes checked, and each retired plugin generation drains and closes.

use super::engine::{run_room, Engine};
use super::gateways::{rewrite_plugins, GatewayPair, GatewayProcess, PairSettings};
use super::pool::{KvPool, KvShape};
use kvgate::admin_client as http;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Rooms in flight during the act.
const SWAP_WORKERS: u64 = 16;
/// How long a retired generation may take to close before the act reports it.
const DRAIN_WAIT_MS: u64 = 30_000;

async fn reload(gateway: &GatewayProcess, plugins: &str) -> anyhow::Result<String> {
    rewrite_plugins(&gateway.config_path, plugins)?;
    let (code, body) = http::post(&gateway.admin, "/plugins/reload", Duration::from_secs(40)).await?;
    let outcome: kvgate::driver::reload::ReloadOutcome = serde_json::from_str(&body)?;
    anyhow::ensure!(code == 200, "{}: {}", gateway.name, kvgate::plugin_reload::describe(&outcome));
    Ok(kvgate::plugin_reload::describe(&outcome))
}

/// Whether `wire_name` is closed on `gateway` within the wait.
async fn closed(gateway: &GatewayProcess, wire_name: &str) -> bool {
    let deadline = Instant::now() + Duration::from_millis(DRAIN_WAIT_MS);
    while Instant::now() < deadline {
        if let Ok((200, body)) = http::get(&gateway.admin, "/plugins").await {
            let view: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
            let list = view["plugins"].as_array().cloned().unwrap_or_default();
            if list.iter().any(|p| p["wire_name"] == wire_name && p["state"] == "closed") {
                return true;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

/// Returns whether no room was lost and every retired generation closed. Rooms of 16 tokens (2 MiB),
/// whatever the demo's size: the act is about rooms lost, not bytes per second.
pub async fn run(binary: &Path, dir: &Path) -> anyhow::Result<bool> {
    let shape = &KvShape::llama_8b_like(16, 2);
    println!("\nswap act (shm -> quic -> shm under traffic, {SWAP_WORKERS} rooms in flight)");
    let mut pair = GatewayPair::start(binary, dir, &PairSettings::default()).await?;
    let prefill = Arc::new(
        Engine::connect(
            &pair.prefill.socket,
            KvPool::create(dir, "swap-prefill-pool", shape.request_bytes(), SWAP_WORKERS)?,
            "prefill",
        )
        .await?,
    );
    let decode = Arc::new(
        Engine::connect(
            &pair.decode.socket,
            KvPool::create(dir, "swap-decode-pool", shape.request_bytes(), SWAP_WORKERS)?,
            "decode",
        )
        .await?,
    );
    let (stop, rooms, lost) =
        (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let tasks: Vec<_> = (0..SWAP_WORKERS)
        .map(|slot| {
            let (prefill, decode, shape, stop, rooms, lost) = (prefill.clone(), decode.clone(), *shape, stop.clone(), rooms.clone(), lost.clone());
            tokio::spawn(async move {
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) {
                    let room = 800_000_000 + slot * 100_000 + n;
                    n += 1;
                    let ok = matches!(run_room(&prefill, &decode, &shape, room, slot, slot).await, Ok(r) if r.prefill.succeeded && r.decode.succeeded && r.verified);
                    rooms.fetch_add(1, Ordering::Relaxed);
                    lost.fetch_add(u64::from(!ok), Ordering::Relaxed);
                }
            })
        })
        .collect();
    let quic = format!("preference = [\"quic\"]\n[plugins.config.quic]\n{}\n", crate::gateways::QUIC_LOOPBACK_CONFIG);
    let steps = [(quic.as_str(), "shm"), ("preference = [\"shm\"]\n", "quic")];
    let mut closed_ok = true;
    for (plugins, retired) in steps {
        tokio::time::sleep(Duration::from_millis(500)).await;
        for gateway in [&pair.prefill, &pair.decode] {
            println!("  {}: {}", gateway.name, reload(gateway, plugins).await?);
        }
        for gateway in [&pair.prefill, &pair.decode] {
            let ok = closed(gateway, retired).await;
            println!("  {}: {retired} {}", gateway.name, if ok { "drained and closed" } else { "NOT CLOSED in time" });
            closed_ok &= ok;
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await?;
    }
    pair.stop();
    let (rooms, lost) = (rooms.load(Ordering::Relaxed), lost.load(Ordering::Relaxed));
    println!("swap act: {rooms} rooms moved while the transport changed twice, {lost} lost");
    Ok(lost == 0 && closed_ok)
}
