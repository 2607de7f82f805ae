//! Supervision through real `kvgate serve` processes, with the `dying-shm` fixture whose worker
//! dies on command: the room it held fails with its reason, the instance is restarted as a new
//! generation after the back-off, the peer pairs with it and new rooms succeed; past
//! `plugins.restart_max_attempts` it stays down and `/healthz` says why.

mod common;

use common::*;
use kvgate_demo::engine::run_room;
use kvgate_demo::gateways::{GatewayPair, PairSettings};
use kvgate_demo::pool::KvShape;
use std::path::{Path, PathBuf};
use std::time::Duration;

fn dying_library() -> PathBuf {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    kvgate_host::artifacts::built_or_build_cdylib(
        "kvgate-gateway-fixture-dying-plugin",
        "kvgate_fixture_dying_plugin",
        &workspace,
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

/// The room failed with a reason on both sides, or ended (failed) before its later chunks were sent.
fn assert_failed(result: anyhow::Result<kvgate_demo::engine::RoomResult>) {
    match result {
        Ok(r) => assert!(
            !r.prefill.succeeded && !r.prefill.reason.is_empty() && !r.decode.succeeded && !r.decode.reason.is_empty(),
            "{r:?}"
        ),
        Err(e) => assert!(format!("{e:#}").contains("room_terminal"), "{e:#}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_worker_fails_its_room_is_restarted_and_stays_down_past_the_limit() {
    let _serial = serial().await;
    let dir = work_dir();
    let die_file = dir.path().join("die-now");
    let limits = vec![
        ("KVGATE__PLUGINS__RESTART_MAX_ATTEMPTS".to_string(), "1".to_string()),
        ("KVGATE__PLUGINS__RESTART_BACKOFF_MS".to_string(), "10".to_string()),
    ];
    let settings = PairSettings {
        plugin: "dying-shm".into(),
        plugin_libraries: vec![dying_library()],
        plugin_config: format!("die_file = {}", toml::Value::String(die_file.display().to_string())),
        env_prefill: limits,
        ..PairSettings::default()
    };
    let mut pair = GatewayPair::start(&binary(), dir.path(), &settings).await.unwrap();
    let shape = KvShape::llama_8b_like(2, 2);
    let prefill = engine(dir.path(), &pair.prefill.socket, "prefill", &shape, 1).await;
    let decode = engine(dir.path(), &pair.decode.socket, "decode", &shape, 1).await;
    let run = |room| run_room(&prefill, &decode, &shape, room, 0, 0);
    let ok = |r: &kvgate_demo::engine::RoomResult| r.prefill.succeeded && r.decode.succeeded && r.verified;
    let r = run(1).await.unwrap();
    assert!(ok(&r), "{r:?}");

    // The worker dies: its room fails with a reason, the instance is replaced by generation 2.
    std::fs::write(&die_file, b"").unwrap();
    assert_failed(run(2).await);
    let gateway = &pair.prefill;
    eventually(
        Duration::from_secs(20),
        "dying-shm restarted as dying-shm@2",
        || async {
            let all = plugin_instances(&gateway.admin).await;
            all.iter().any(|(w, s, _)| w == "dying-shm@2" && s == "active")
                && all.iter().any(|(w, s, r)| w == "dying-shm" && s == "closed" && r == "restarted")
        },
        &|| gateway.log(),
    )
    .await;
    let (code, health) = kvgate::admin_client::get(&gateway.admin, "/healthz").await.unwrap();
    assert_eq!(code, 200, "healthy again once restarted: {health}");
    let r = run(3).await.unwrap();
    assert!(ok(&r), "a new room runs on the restarted instance: {r:?}\n{}", gateway.log());

    // Again, past plugins.restart_max_attempts = 1 within the window: it stays down, and says why.
    std::fs::write(&die_file, b"").unwrap();
    assert_failed(run(4).await);
    eventually(
        Duration::from_secs(20),
        "/healthz names the restart limit",
        || async {
            let (code, health) = kvgate::admin_client::get(&gateway.admin, "/healthz").await.unwrap();
            code == 503
                && health.contains("dying-shm@2 unhealthy")
                && health.contains("plugins.restart_max_attempts = 1")
        },
        &|| gateway.log(),
    )
    .await;
    assert!(plain_log(&gateway.log()).contains("plugin_restart_limit"), "logged with its reason");
    assert!(
        !plugin_instances(&gateway.admin).await.iter().any(|(w, _, _)| w == "dying-shm@3"),
        "not restarted past the limit"
    );
    pair.stop();
}
