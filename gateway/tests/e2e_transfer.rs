//! Two `kvgate serve` processes, a synthetic prefill and decode engine through kvgate-client: KV
//! caches move and are verified by checksum (shm, and QUIC), the admin endpoints reflect it.

mod common;

use common::*;
use kvgate_demo::engine::run_room;
use kvgate_demo::gateways::{GatewayPair, PairSettings};
use std::time::Duration;

async fn move_and_verify(plugin: &str) {
    let dir = work_dir();
    let settings = PairSettings { plugin: plugin.into(), ..PairSettings::default() };
    let mut pair = GatewayPair::start(&binary(), dir.path(), &settings).await.unwrap();
    let shape = small_shape();
    let prefill = engine(dir.path(), &pair.prefill.socket, "prefill", &shape, 2).await;
    let decode = engine(dir.path(), &pair.decode.socket, "decode", &shape, 2).await;
    for (i, room) in [101u64, 102, 103].iter().enumerate() {
        let slot = i as u64 % 2;
        let r = run_room(&prefill, &decode, &shape, *room, slot, slot).await.unwrap();
        assert!(
            r.prefill.succeeded && r.decode.succeeded,
            "room {room}: {r:?}\n{}\n{}",
            pair.prefill.log(),
            pair.decode.log()
        );
        assert!(r.verified, "room {room}: checksum mismatch");
    }
    assert!(wait_rooms_empty(&pair.prefill.admin, Duration::from_secs(5)).await.as_array().unwrap().is_empty());
    assert!(wait_rooms_empty(&pair.decode.admin, Duration::from_secs(5)).await.as_array().unwrap().is_empty());
    let text = metrics(&pair.prefill.admin).await;
    let moved = sample(&text, "kvgate_bytes_moved_total").unwrap_or(0.0);
    assert!(moved >= 3.0 * shape.request_bytes() as f64, "bytes moved {moved}\n{text}");
    assert_eq!(sample(&text, "kvgate_rooms_succeeded_total"), Some(3.0), "{text}");
    assert!(text.contains("kvgate_peer_up{peer=\"decode\"} 1"), "{text}");
    let (code, health) = kvgate::admin_client::get(&pair.decode.admin, "/healthz").await.unwrap();
    assert_eq!(code, 200, "{health}");
    let (_, plugins) = kvgate::admin_client::get(&pair.decode.admin, "/plugins").await.unwrap();
    assert!(
        plugins.contains(&format!("\"name\":\"{plugin}\"")) && plugins.contains("\"status\":\"opened\""),
        "{plugins}"
    );
    let (code, discovery) = kvgate::admin_client::get(&pair.decode.admin, "/discovery").await.unwrap();
    assert!(
        code == 200 && discovery.contains("\"enabled\":false") && discovery.contains("\"registered\":false"),
        "{discovery}"
    );
    pair.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_caches_move_between_two_gateway_processes_over_shm_verified_by_checksum() {
    let _serial = serial().await;
    move_and_verify("shm").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_caches_move_between_two_gateway_processes_over_quic_verified_by_checksum() {
    let _serial = serial().await;
    move_and_verify("quic").await;
}
