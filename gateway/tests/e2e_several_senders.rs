//! A room whose parts come from two prefill gateways (tensor-parallel ranks on two hosts feeding one
//! decode rank), through three real `kvgate serve` processes: each prefill gateway sends only its own
//! part and every byte lands; when one prefill gateway dies mid-room, the room fails as a whole on the
//! decode side (`peer_lost`) and the other prefill gateway is told (`receiver_failed`, peer reason
//! `peer_lost`) instead of waiting for its deadline.

mod common;

use common::*;
use kvgate_client::{proto, room_key, slice, Client};
use kvgate_demo::gateways::{Cluster, PairSettings};
use kvgate_demo::pool::{checksum, KvPool};
use std::time::{Duration, Instant};

const SLOT: u64 = 512 * 1024;
const WAIT: Duration = Duration::from_secs(20);

/// Decode expects `room`: part 0 from `rank-0`, part 1 from `rank-1`, in slot `slot` of each half.
fn two_sender_expect(room: u64, region: u64, slot: u64) -> proto::ExpectRequest {
    proto::ExpectRequest {
        key: Some(room_key(room, 0)),
        peer: "rank-0".into(),
        parts: (0..2)
            .map(|p| proto::PartSlices {
                slices: vec![slice(region, (2 * slot + p) * SLOT, SLOT)],
                source_kind: String::new(),
            })
            .collect(),
        timeout_ms: None,
        part_peers: vec!["rank-0".into(), "rank-1".into()],
    }
}

fn send(room: u64, part: u32, region: u64, slot: u64) -> proto::SendRequest {
    proto::SendRequest {
        key: Some(room_key(room, 0)),
        part,
        chunk: 0,
        slices: vec![slice(region, slot * SLOT, SLOT)],
        last: true,
        peer: "decode".into(),
        offset: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_room_takes_its_parts_from_two_prefill_gateways_and_fails_whole_when_one_dies() {
    let _serial = serial().await;
    let dir = work_dir();
    let members = [("decode", "", vec![]), ("rank-0", "", vec![]), ("rank-1", "", vec![])];
    let mut cluster = Cluster::start(&binary(), dir.path(), &PairSettings::default(), &members).await.unwrap();
    let decode = Client::connect_unix(&cluster.get("decode").socket).await.unwrap();
    let ranks = [
        Client::connect_unix(&cluster.get("rank-0").socket).await.unwrap(),
        Client::connect_unix(&cluster.get("rank-1").socket).await.unwrap(),
    ];
    let mut dst = KvPool::create(dir.path(), "decode-kv", SLOT, 4).unwrap();
    let dst_region = decode.register_shared_memory(&dst.path.display().to_string(), 0, dst.len(), "kv").await.unwrap();
    let mut sources = Vec::new();
    for (rank, client) in ranks.iter().enumerate() {
        let pool = KvPool::create(dir.path(), &format!("rank-{rank}-kv"), SLOT, 2).unwrap();
        let region =
            client.register_shared_memory(&pool.path.display().to_string(), 0, pool.len(), "kv").await.unwrap();
        sources.push((pool, region));
    }
    let sums: Vec<u64> =
        sources.iter_mut().enumerate().map(|(rank, (pool, _))| pool.fill(0, 100 + rank as u64)).collect();
    dst.clear(0);
    dst.clear(1);

    // Each rank sends its own part; the room succeeds on all three gateways.
    let room = 7_000;
    let mut d_events = decode.watch(Some(room_key(room, 0))).await.unwrap();
    let mut r_events = [
        ranks[0].watch(Some(room_key(room, 0))).await.unwrap(),
        ranks[1].watch(Some(room_key(room, 0))).await.unwrap(),
    ];
    decode.expect_request(two_sender_expect(room, dst_region, 0)).await.unwrap();
    for (rank, client) in ranks.iter().enumerate() {
        client.send(send(room, rank as u32, sources[rank].1, 0)).await.unwrap();
    }
    let d = terminal_event(&mut d_events, room, WAIT).await;
    assert!(d.succeeded, "decode: {d:?}\n{}", cluster.get("decode").log());
    for (rank, events) in r_events.iter_mut().enumerate() {
        let r = terminal_event(events, room, WAIT).await;
        assert!(r.succeeded, "rank {rank}: {r:?}");
    }
    assert_eq!(checksum(dst.slot(0)), sums[0], "part 0 came from rank 0");
    assert_eq!(checksum(dst.slot(1)), sums[1], "part 1 came from rank 1");
    // A rank sending the other rank's part is refused.
    let room = 7_001;
    decode.expect_request(two_sender_expect(room, dst_region, 1)).await.unwrap();
    eventually(
        WAIT,
        "rank 0 holds the room",
        || async { ranks[0].get_room(room_key(room, 0)).await.is_ok_and(|r| r.state == "waiting_send") },
        &|| String::new(),
    )
    .await;
    let e = ranks[0].send(send(room, 1, sources[0].1, 1)).await.unwrap_err();
    assert_eq!(kvgate_client::reason_of(&e).as_deref(), Some("unknown_part"));

    // Rank 1's gateway dies before either rank sent: the room fails whole, and rank 0, which holds
    // its side waiting for its engine, is told at once rather than waiting for its deadline.
    let mut d_events = decode.watch(Some(room_key(room, 0))).await.unwrap();
    let mut r0_events = ranks[0].watch(Some(room_key(room, 0))).await.unwrap();
    let died = Instant::now();
    cluster.get_mut("rank-1").kill();
    let d = terminal_event(&mut d_events, room, WAIT).await;
    assert!(!d.succeeded && d.reason == "peer_lost", "decode: {d:?}");
    let r0 = terminal_event(&mut r0_events, room, WAIT).await;
    assert!(!r0.succeeded && r0.reason == "receiver_failed" && r0.peer_reason == "peer_lost", "rank 0: {r0:?}");
    let e = ranks[0].send(send(room, 0, sources[0].1, 1)).await.unwrap_err();
    assert_eq!(kvgate_client::reason_of(&e).as_deref(), Some("room_terminal"));
    assert!(
        died.elapsed() < Duration::from_secs(5),
        "ended by the heartbeat bound, not a deadline: {:?}",
        died.elapsed()
    );
    let left = wait_rooms_empty(&cluster.get("decode").admin, WAIT).await;
    assert!(left.as_array().unwrap().is_empty(), "decode rooms: {left}");
    cluster.stop();
}
