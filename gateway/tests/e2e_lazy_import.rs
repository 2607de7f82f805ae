//! A peer's region is imported without being mapped: a decode engine registers a 4 GiB sparse
//! pool, the prefill gateway imports it (holds its file open) yet maps none of it, and maps it only
//! when a room first writes into it; the bytes land, and the pool's untouched pages stay unfaulted.

mod common;

use common::*;
use kvgate_client::room_key;
use kvgate_demo::engine::{prepare_slots, send_all, wait_terminal};
use kvgate_demo::gateways::{GatewayPair, PairSettings, DECODE_NAME, PREFILL_NAME};
use std::os::unix::fs::MetadataExt;
use std::time::{Duration, Instant};

const POOL_BYTES: u64 = 4 << 30;

fn holds_open(pid: i32, path: &std::path::Path) -> bool {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|target| target == path))
}

fn mappings_of(pid: i32, ino: u64) -> usize {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    maps.lines().filter(|l| l.split_whitespace().nth(4).and_then(|i| i.parse::<u64>().ok()) == Some(ino)).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peers_pool_is_mapped_only_once_a_room_writes_into_it() {
    let _serial = serial().await;
    let dir = work_dir();
    let mut pair = GatewayPair::start(&binary(), dir.path(), &PairSettings::default()).await.unwrap();
    let shape = small_shape();
    let prefill = engine(dir.path(), &pair.prefill.socket, "prefill", &shape, 1).await;
    let decode = engine(dir.path(), &pair.decode.socket, "decode", &shape, 1).await;
    let pool = dir.path().join("big-sparse-pool");
    std::fs::File::create(&pool).unwrap().set_len(POOL_BYTES).unwrap();
    let ino = std::fs::metadata(&pool).unwrap().ino();
    let region = decode.client.register_shared_memory(&pool.display().to_string(), 0, POOL_BYTES, "big").await.unwrap();
    let prefill_pid = pair.prefill.pid().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    // The decode gateway holds the file open under its own descriptor; the prefill gateway opens it
    // through that one (`/proc/<decode pid>/fd/<n>`), which resolves to the same file.
    while !holds_open(prefill_pid, &pool) {
        assert!(Instant::now() < deadline, "the prefill gateway never imported the pool");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(mappings_of(prefill_pid, ino), 0, "importing the 4 GiB pool mapped it");

    // A room into the last 2 MiB of the pool: mapped now, the bytes land, the rest stays sparse.
    let room = 9300;
    let expected = prepare_slots(&prefill, &decode, room, 0, 0).await.unwrap();
    let at = POOL_BYTES - shape.request_bytes();
    let mut p_rx = prefill.events.listen(room);
    let mut d_rx = decode.events.listen(room);
    let started = Instant::now();
    let parts = (0..shape.parts).map(|p| shape.part_slices(region, at, p)).collect();
    decode.client.expect(room_key(room, 0), PREFILL_NAME, parts, 0).await.unwrap();
    send_all(&prefill, &shape, room, 0, DECODE_NAME, None).await.unwrap();
    let (p, d) = tokio::join!(
        wait_terminal(&mut p_rx, started, Duration::from_secs(20)),
        wait_terminal(&mut d_rx, started, Duration::from_secs(20))
    );
    assert!(p.unwrap().succeeded && d.unwrap().succeeded);
    assert_eq!(mappings_of(prefill_pid, ino), 1, "the first room into the pool maps it once");
    let written = {
        use std::io::{Read, Seek, SeekFrom};
        let mut f = std::fs::File::open(&pool).unwrap();
        f.seek(SeekFrom::Start(at)).unwrap();
        let mut buf = vec![0u8; shape.request_bytes() as usize];
        f.read_exact(&mut buf).unwrap();
        kvgate_demo::pool::checksum(&buf)
    };
    assert_eq!(written, expected, "the room's bytes are where its slices said");
    let resident_kib = std::fs::metadata(&pool).unwrap().blocks() * 512 / 1024;
    assert!(resident_kib < 64 << 10, "{resident_kib} KiB of the pool are backed: pages nobody wrote were faulted in");
    pair.stop();
}
