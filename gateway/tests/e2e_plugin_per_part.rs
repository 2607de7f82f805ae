//! The plugin is chosen per part from the memory it moves, through real `kvgate serve` processes.
//! Both gateways open `fake-device` (a fixture that serves only CUDA device memory, backed here by a
//! host file) and the built-in `shm` (host memory only). One room has a part in host memory and a
//! part in "device" memory: each part goes through the one plugin that holds its regions, its chunks
//! arrive in reverse order at explicit offsets, and every byte lands. Memory no connected plugin
//! serves is refused with `no_plugin_for_memory`.

mod common;

use common::*;
use kvgate_client::{proto, reason_of, room_key, slice, Client};
use kvgate_demo::gateways::{GatewayPair, PairSettings, DECODE_NAME, PREFILL_NAME};
use kvgate_demo::pool::{checksum, KvPool};
use std::path::{Path, PathBuf};
use std::time::Duration;

const SLOT: u64 = 256 * 1024;
const CHUNKS: u64 = 4;
const WAIT: Duration = Duration::from_secs(20);

fn fake_device_library() -> PathBuf {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    kvgate_host::artifacts::built_or_build_cdylib(
        "kvgate-gateway-fixture-fake-device-plugin",
        "kvgate_fixture_fake_device_plugin",
        &workspace,
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

/// One engine's memory: a host pool (shm) and a "device" pool (fake-device, by IPC handle).
struct Memory {
    host: KvPool,
    device: KvPool,
    host_region: u64,
    device_region: u64,
}

async fn memory(client: &Client, dir: &Path, side: &str) -> Memory {
    let host = KvPool::create(dir, &format!("{side}-host"), SLOT, 2).unwrap();
    let device = KvPool::create(dir, &format!("{side}-device"), SLOT, 2).unwrap();
    let host_region =
        client.register_shared_memory(&host.path.display().to_string(), 0, host.len(), "host pool").await.unwrap();
    let handle = device.path.display().to_string().into_bytes();
    let device_region = client.register_cuda_ipc(0, handle, 0, device.len(), "device pool").await.unwrap();
    Memory { host, device, host_region, device_region }
}

/// Part `part` of `room` sent from `region` slot `slot`, its chunks last first, each at its offset.
fn reversed_chunks(room: u64, part: u32, region: u64, slot: u64) -> Vec<proto::SendRequest> {
    let chunk = SLOT / CHUNKS;
    (0..CHUNKS)
        .rev()
        .map(|c| proto::SendRequest {
            key: Some(room_key(room, 0)),
            part,
            chunk: c as u32,
            slices: vec![slice(region, slot * SLOT + c * chunk, chunk)],
            last: false,
            peer: DECODE_NAME.into(),
            offset: Some(c * chunk),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_part_moves_through_the_plugin_that_serves_its_memory() {
    let _serial = serial().await;
    let dir = work_dir();
    let settings = PairSettings {
        plugin: "fake-device, shm".into(),
        plugin_libraries: vec![fake_device_library()],
        ..PairSettings::default()
    };
    let mut pair = GatewayPair::start(&binary(), dir.path(), &settings).await.unwrap();
    let prefill = Client::connect_unix(&pair.prefill.socket).await.unwrap();
    let decode = Client::connect_unix(&pair.decode.socket).await.unwrap();
    let mut src = memory(&prefill, dir.path(), "prefill").await;
    let dst = memory(&decode, dir.path(), "decode").await;
    // Each pool is registered with exactly one plugin, so a part can only move through that one.
    for log in [pair.prefill.log(), pair.decode.log()] {
        let log = plain_log(&log);
        let registered: Vec<&str> = log.lines().filter(|l| l.contains("region registered")).collect();
        assert!(
            registered.iter().any(|l| l.contains("label=host pool") && l.contains("plugins=[\"shm\"]")),
            "{registered:?}"
        );
        assert!(
            registered.iter().any(|l| l.contains("label=device pool") && l.contains("plugins=[\"fake-device\"]")),
            "{registered:?}"
        );
    }
    let host_sum = src.host.fill(0, 11);
    let device_sum = src.device.fill(0, 22);
    assert_ne!(host_sum, device_sum);

    let (room, key) = (4_000u64, room_key(4_000, 0));
    let mut p_events = prefill.watch(Some(key)).await.unwrap();
    let mut d_events = decode.watch(Some(key)).await.unwrap();
    let parts = vec![vec![slice(dst.host_region, 0, SLOT)], vec![slice(dst.device_region, 0, SLOT)]];
    decode.expect(key, PREFILL_NAME, parts, 0).await.unwrap();
    let mut sends = reversed_chunks(room, 1, src.device_region, 0);
    sends.extend(reversed_chunks(room, 0, src.host_region, 0));
    let reply = prefill.send_batch(sends).await.unwrap();
    assert!(reply.results.iter().all(|r| r.reason.is_empty()), "{reply:?}");
    let (p, d) = (terminal_event(&mut p_events, room, WAIT).await, terminal_event(&mut d_events, room, WAIT).await);
    assert!(p.succeeded && d.succeeded, "prefill {p:?}, decode {d:?}\n{}", pair.decode.log());
    assert_eq!(checksum(dst.host.slot(0)), host_sum, "the host part landed whole");
    assert_eq!(checksum(dst.device.slot(0)), device_sum, "the device part landed whole");

    // A device destination whose sender reads host memory: no connected plugin moves that.
    let refused = decode
        .expect_batch(vec![proto::ExpectRequest {
            key: Some(room_key(4_001, 0)),
            peer: PREFILL_NAME.into(),
            parts: vec![proto::PartSlices {
                slices: vec![slice(dst.device_region, SLOT, SLOT)],
                source_kind: "host".into(),
            }],
            timeout_ms: None,
            part_peers: Vec::new(),
        }])
        .await
        .unwrap();
    assert_eq!(refused.results[0].reason, "no_plugin_for_memory", "{refused:?}");
    let e = decode
        .expect_batch(vec![proto::ExpectRequest {
            key: Some(room_key(4_001, 0)),
            peer: PREFILL_NAME.into(),
            parts: vec![proto::PartSlices {
                slices: vec![slice(dst.device_region, SLOT, SLOT)],
                source_kind: "tpu".into(),
            }],
            timeout_ms: None,
            part_peers: Vec::new(),
        }])
        .await;
    let unknown = match e {
        Ok(reply) => reply.results[0].reason.clone(),
        Err(status) => reason_of(&status).unwrap_or_default(),
    };
    assert_eq!(unknown, "unknown_memory_kind");
    // A chunk for the device part read from host memory: its plugin cannot read it.
    let key = room_key(4_002, 0);
    decode.expect(key, PREFILL_NAME, vec![vec![slice(dst.device_region, SLOT, SLOT)]], 0).await.unwrap();
    let mut wrong = reversed_chunks(4_002, 0, src.host_region, 1);
    wrong.truncate(1);
    // The sender learns the part's plugin from the expect notice: wait until the room is bound.
    eventually(
        WAIT,
        "the expect notice at the prefill gateway",
        || async { prefill.get_room(key).await.is_ok_and(|r| r.state == "waiting_send") },
        &|| pair.prefill.log(),
    )
    .await;
    let reply = prefill.send_batch(wrong).await.unwrap();
    assert_eq!(reply.results[0].reason, "no_plugin_for_memory", "{reply:?}");
    prefill.abort(key, "test over").await.unwrap();
    pair.stop();
}
