//! `[discovery]` against a real etcd: gateways with no `[[peers]]` find each other and move KV caches;
//! a stopped gateway's record goes at once (lease revoked), a killed one's when its lease expires; a
//! name taken on another host is refused until it is free, one left by this host is taken over, a
//! record deleted or overwritten under a live gateway is restored; `max_peers` at and just past its limit; malformed records;
//! etcd down at start-up does not stop a gateway, which registers once etcd is up; etcd lost for
//! longer than the lease does not cut linked gateways apart; hundreds of records arriving and going in
//! one batch are followed while KV caches keep moving.

mod common;

use common::etcd::{discovery_gateway, this_host, wait_registered, Etcd};
use common::*;
use kvgate_demo::engine::run_room;
use kvgate_demo::gateways::{free_port, GatewayPair, PairSettings};
use std::time::Duration;
use tokio::time::Instant;

fn discovery_toml(etcd: &Etcd, prefix: &str, extra: &str) -> String {
    format!(
        "[discovery]\netcd_endpoints = [\"{}\"]\nkey_prefix = \"{prefix}\"\nretry_interval_ms = 200\n{extra}",
        etcd.url()
    )
}

fn discovered_pair(etcd: &Etcd, prefix: &str, extra: &str) -> PairSettings {
    let table = discovery_toml(etcd, prefix, extra);
    PairSettings { static_peers: false, extra_prefill: table.clone(), extra_decode: table, ..PairSettings::default() }
}

/// Both gateways' logs, read when called (the pair may be stopped by then).
fn pair_logs(pair: &GatewayPair) -> impl Fn() -> String {
    let paths = [pair.prefill.log_path.clone(), pair.decode.log_path.clone()];
    move || paths.iter().map(|p| std::fs::read_to_string(p).unwrap_or_default()).collect::<Vec<_>>().join("\n")
}

/// A pair found through etcd, once each gateway sees the other up, found through etcd.
async fn linked_pair(dir: &std::path::Path, settings: &PairSettings) -> GatewayPair {
    let pair = GatewayPair::start(&binary(), dir, settings).await.unwrap();
    let logs = pair_logs(&pair);
    for admin in [&pair.prefill.admin, &pair.decode.admin] {
        eventually(
            Duration::from_secs(15),
            "each gateway sees the other up, found through etcd",
            || async {
                let p = peers(admin).await;
                p.len() == 1 && p[0]["up"] == true && p[0]["source"] == "etcd"
            },
            &logs,
        )
        .await;
    }
    pair
}

/// A record another (fake) gateway published, as discovery writes them.
async fn put_record(etcd: &Etcd, prefix: &str, name: &str, address: &str, host: &str) {
    let value = serde_json::json!({"name": name, "address": address, "host": host, "incarnation": 1}).to_string();
    etcd.client().await.unwrap().put(format!("{prefix}{name}"), value, None).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_with_no_static_peers_find_each_other_through_etcd_and_move_kv_caches() {
    let _serial = serial().await;
    let dir = work_dir();
    let etcd = Etcd::started(dir.path()).await;
    let prefix = "/kvgate-test/pair/";
    // A long lease: the record must go at a clean stop because it is revoked, not because it expired.
    let settings = discovered_pair(&etcd, prefix, "lease_ttl_s = 60\n");
    let mut pair = linked_pair(dir.path(), &settings).await;
    let logs = pair_logs(&pair);
    for admin in [&pair.prefill.admin, &pair.decode.admin] {
        assert_eq!(metric(admin, "kvgate_discovery_registered").await, 1.0);
        assert_eq!(metric(admin, "kvgate_discovery_peers").await, 1.0);
    }
    assert_eq!(etcd.keys(prefix).await, [format!("{prefix}decode"), format!("{prefix}prefill")]);

    let shape = small_shape();
    let prefill = engine(dir.path(), &pair.prefill.socket, "prefill", &shape, 2).await;
    let decode = engine(dir.path(), &pair.decode.socket, "decode", &shape, 2).await;
    for room in [201u64, 202] {
        let r = run_room(&prefill, &decode, &shape, room, 0, 0).await.unwrap();
        assert!(r.prefill.succeeded && r.decode.succeeded && r.verified, "room {room}: {r:?}\n{}", logs());
    }
    drop((prefill, decode));

    // A clean stop revokes the lease: the record goes long before its 60 s would run out, and the
    // other gateway forgets the peer once its link is gone.
    let stopped_at = Instant::now();
    pair.decode.stop(Duration::from_secs(10));
    eventually(
        Duration::from_secs(10),
        "decode's record removed at its stop",
        || async { etcd.keys(prefix).await == [format!("{prefix}prefill")] },
        &logs,
    )
    .await;
    assert!(stopped_at.elapsed() < Duration::from_secs(20), "the record went by expiry, not by revocation");
    eventually(
        Duration::from_secs(10),
        "prefill forgets the withdrawn peer",
        || async { peers(&pair.prefill.admin).await.is_empty() },
        &logs,
    )
    .await;
    assert!(pair.prefill.log().contains("discovery: peer withdrawn"), "{}", logs());
    pair.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_gateway_s_record_expires_with_its_lease_and_its_peer_forgets_it() {
    let _serial = serial().await;
    let dir = work_dir();
    let etcd = Etcd::started(dir.path()).await;
    let prefix = "/kvgate-test/killed/";
    let ttl_s = 2;
    let settings = discovered_pair(&etcd, prefix, &format!("lease_ttl_s = {ttl_s}\nrequest_timeout_ms = 500\n"));
    let mut pair = linked_pair(dir.path(), &settings).await;
    let logs = pair_logs(&pair);
    // Past several lease periods the live gateways' records are still there (the lease is kept alive).
    tokio::time::sleep(Duration::from_secs(2 * ttl_s)).await;
    assert_eq!(etcd.keys(prefix).await.len(), 2, "{}", logs());

    pair.decode.kill();
    let killed_at = Instant::now();
    eventually(
        Duration::from_secs(3 * ttl_s + 5),
        "the killed gateway's record expires",
        || async { etcd.keys(prefix).await == [format!("{prefix}prefill")] },
        &logs,
    )
    .await;
    let gone_after = killed_at.elapsed();
    assert!(
        gone_after >= Duration::from_millis(ttl_s * 1000 / 2),
        "the record went after {gone_after:?}, before its lease could expire"
    );
    eventually(
        Duration::from_secs(10),
        "prefill forgets the peer",
        || async { peers(&pair.prefill.admin).await.is_empty() },
        &logs,
    )
    .await;
    assert_eq!(metric(&pair.prefill.admin, "kvgate_discovery_peers").await, 0.0);
    pair.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_held_by_a_gateway_on_another_host_is_refused_until_it_is_free() {
    let _serial = serial().await;
    let dir = work_dir();
    let etcd = Etcd::started(dir.path()).await;
    let prefix = "/kvgate-test/taken/";
    put_record(&etcd, prefix, "solo", "10.9.9.9:7100", "another-host").await;
    let mut cluster = discovery_gateway(dir.path(), "solo", &discovery_toml(&etcd, prefix, "")).await;
    let solo = cluster.get("solo");
    let taken = "kvgate_discovery_errors_total{reason=\"name_taken\"}";
    eventually(
        Duration::from_secs(10),
        "name_taken counted",
        || async { metric(&solo.admin, taken).await >= 2.0 },
        &|| solo.log(),
    )
    .await;
    assert_eq!(metric(&solo.admin, "kvgate_discovery_registered").await, 0.0);
    assert!(solo.log().contains("name_taken") && solo.log().contains("another-host"), "{}", solo.log());
    // The other holder's record was left as it was.
    let mut client = etcd.client().await.unwrap();
    assert!(etcd.value(&format!("{prefix}solo")).await.is_some_and(|v| v.contains("10.9.9.9:7100")));

    client.delete(format!("{prefix}solo"), None).await.unwrap();
    wait_registered(solo, Duration::from_secs(10)).await;
    assert!(etcd.value(&format!("{prefix}solo")).await.is_some_and(|v| v.contains(&solo.peer_listen)));
    cluster.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_of_the_same_name_from_this_host_is_taken_over_at_start() {
    let _serial = serial().await;
    let dir = work_dir();
    let etcd = Etcd::started(dir.path()).await;
    let prefix = "/kvgate-test/takeover/";
    // What this gateway's previous run left behind (its lease not yet expired): same name, same host.
    put_record(&etcd, prefix, "solo", "127.0.0.1:1", &this_host()).await;
    let mut cluster = discovery_gateway(dir.path(), "solo", &discovery_toml(&etcd, prefix, "")).await;
    let solo = cluster.get("solo");
    wait_registered(solo, Duration::from_secs(10)).await;
    assert!(solo.log().contains("took over this host's earlier record"), "{}", solo.log());
    assert_eq!(metric(&solo.admin, "kvgate_discovery_errors_total{reason=\"name_taken\"}").await, 0.0);
    assert!(etcd.value(&format!("{prefix}solo")).await.is_some_and(|v| v.contains(&solo.peer_listen)));
    cluster.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_whose_record_is_deleted_or_overwritten_under_it_registers_again() {
    let _serial = serial().await;
    let dir = work_dir();
    let etcd = Etcd::started(dir.path()).await;
    let prefix = "/kvgate-test/lost/";
    let mut cluster = discovery_gateway(dir.path(), "solo", &discovery_toml(&etcd, prefix, "lease_ttl_s = 60\n")).await;
    let solo = cluster.get("solo");
    let lost = "kvgate_discovery_errors_total{reason=\"record_lost\"}";
    let record_is_solos =
        || async { etcd.value(&format!("{prefix}solo")).await.is_some_and(|v| v.contains(&solo.peer_listen)) };
    wait_registered(solo, Duration::from_secs(10)).await;
    // An operator's `etcdctl del`: the record comes back well before the 60 s lease could matter.
    etcd.client().await.unwrap().delete(format!("{prefix}solo"), None).await.unwrap();
    eventually(
        Duration::from_secs(10),
        "record_lost counted once",
        || async { metric(&solo.admin, lost).await == 1.0 },
        &|| solo.log(),
    )
    .await;
    eventually(Duration::from_secs(10), "the record is back", record_is_solos, &|| solo.log()).await;
    // Overwritten without a lease (another writer): counted, and this gateway's record restored over
    // it, since it names this host.
    put_record(&etcd, prefix, "solo", "127.0.0.1:1", &this_host()).await;
    eventually(
        Duration::from_secs(10),
        "record_lost counted again",
        || async { metric(&solo.admin, lost).await == 2.0 },
        &|| solo.log(),
    )
    .await;
    eventually(Duration::from_secs(10), "the record is back again", record_is_solos, &|| solo.log()).await;
    assert_eq!(metric(&solo.admin, "kvgate_discovery_registered").await, 1.0);
    cluster.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_peers_admits_peers_up_to_the_limit_and_refuses_the_next_and_malformed_records_are_ignored() {
    let _serial = serial().await;
    let dir = work_dir();
    let etcd = Etcd::started(dir.path()).await;
    let prefix = "/kvgate-test/limit/";
    let mut cluster = discovery_gateway(dir.path(), "gw", &discovery_toml(&etcd, prefix, "max_peers = 2\n")).await;
    let gw = cluster.get("gw");
    wait_registered(gw, Duration::from_secs(10)).await;
    // Nothing listens at these addresses: the peers stay down, which is all this test needs.
    let nowhere = || format!("127.0.0.1:{}", free_port());
    put_record(&etcd, prefix, "a-peer", &nowhere(), "h").await;
    put_record(&etcd, prefix, "z-peer", &nowhere(), "h").await;
    let names = || async {
        peers(&gw.admin).await.iter().map(|p| p["name"].as_str().unwrap_or("").to_string()).collect::<Vec<_>>()
    };
    eventually(
        Duration::from_secs(10),
        "two peers at the limit",
        || async { names().await == ["a-peer", "z-peer"] },
        &|| gw.log(),
    )
    .await;
    put_record(&etcd, prefix, "m-peer", &nowhere(), "h").await;
    let limit = "kvgate_discovery_errors_total{reason=\"peer_limit\"}";
    eventually(
        Duration::from_secs(10),
        "the third refused",
        || async { metric(&gw.admin, limit).await == 1.0 },
        &|| gw.log(),
    )
    .await;
    assert_eq!(names().await, ["a-peer", "z-peer"]);
    assert!(gw.log().contains("peer_limit"), "{}", gw.log());

    // Malformed: not JSON, and a record naming another gateway than its key.
    let mut client = etcd.client().await.unwrap();
    client.put(format!("{prefix}junk"), "not json", None).await.unwrap();
    let misfiled = serde_json::json!({"name": "someone-else", "address": nowhere()}).to_string();
    client.put(format!("{prefix}misfiled"), misfiled, None).await.unwrap();
    let bad = "kvgate_discovery_errors_total{reason=\"bad_record\"}";
    eventually(
        Duration::from_secs(10),
        "two bad records counted",
        || async { metric(&gw.admin, bad).await == 2.0 },
        &|| gw.log(),
    )
    .await;

    // A withdrawn peer frees its place: the dialled one (a-peer sorts first, so it dials gw) and the
    // one gw dials (z-peer) both go, and a new record is admitted.
    client.delete(format!("{prefix}a-peer"), None).await.unwrap();
    client.delete(format!("{prefix}z-peer"), None).await.unwrap();
    eventually(
        Duration::from_secs(10),
        "both withdrawn peers forgotten",
        || async { names().await.is_empty() },
        &|| gw.log(),
    )
    .await;
    put_record(&etcd, prefix, "m-peer", &nowhere(), "h").await;
    eventually(Duration::from_secs(10), "a record admitted again", || async { names().await == ["m-peer"] }, &|| {
        gw.log()
    })
    .await;
    cluster.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_down_at_start_up_does_not_stop_the_gateway_which_registers_once_etcd_is_up() {
    let _serial = serial().await;
    let dir = work_dir();
    let mut etcd = Etcd::on_free_port(dir.path());
    let prefix = "/kvgate-test/late/";
    let mut cluster =
        discovery_gateway(dir.path(), "early", &discovery_toml(&etcd, prefix, "request_timeout_ms = 500\n")).await;
    let early = cluster.get("early");
    let unreachable = "kvgate_discovery_errors_total{reason=\"etcd_unreachable\"}";
    eventually(
        Duration::from_secs(10),
        "etcd_unreachable counted, again and again",
        || async { metric(&early.admin, unreachable).await >= 3.0 },
        &|| early.log(),
    )
    .await;
    assert_eq!(metric(&early.admin, "kvgate_discovery_registered").await, 0.0);
    assert!(early.log().contains("etcd_unreachable"), "{}", early.log());

    etcd.start().await;
    wait_registered(early, Duration::from_secs(15)).await;
    assert_eq!(etcd.keys(prefix).await, [format!("{prefix}early")]);
    cluster.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn linked_gateways_keep_moving_kv_caches_while_etcd_is_down_past_their_lease_and_register_again_after() {
    let _serial = serial().await;
    let dir = work_dir();
    let mut etcd = Etcd::started(dir.path()).await;
    let prefix = "/kvgate-test/outage/";
    let ttl_s = 2;
    let settings = discovered_pair(&etcd, prefix, &format!("lease_ttl_s = {ttl_s}\nrequest_timeout_ms = 500\n"));
    let mut pair = linked_pair(dir.path(), &settings).await;
    let logs = pair_logs(&pair);
    let shape = small_shape();
    let prefill = engine(dir.path(), &pair.prefill.socket, "prefill", &shape, 2).await;
    let decode = engine(dir.path(), &pair.decode.socket, "decode", &shape, 2).await;

    etcd.kill();
    // Past the lease: both gateways have lost their registration and counted why...
    tokio::time::sleep(Duration::from_secs(ttl_s + 2)).await;
    for admin in [&pair.prefill.admin, &pair.decode.admin] {
        eventually(
            Duration::from_secs(5),
            "registration lost while etcd is down",
            || async { metric(admin, "kvgate_discovery_registered").await == 0.0 },
            &logs,
        )
        .await;
        let text = metrics(admin).await;
        let counted: f64 = ["etcd_unreachable", "etcd_request_failed", "lease_expired"]
            .iter()
            .filter_map(|r| sample(&text, &format!("kvgate_discovery_errors_total{{reason=\"{r}\"}}")))
            .sum();
        assert!(counted >= 1.0, "no discovery error counted:\n{text}");
    }
    // ...but the link they had is untouched and KV caches still move.
    assert!(peers(&pair.prefill.admin).await.first().is_some_and(|p| p["up"] == true), "{}", logs());
    for room in [301u64, 302] {
        let r = run_room(&prefill, &decode, &shape, room, 0, 0).await.unwrap();
        assert!(
            r.prefill.succeeded && r.decode.succeeded && r.verified,
            "room {room} during the outage: {r:?}\n{}",
            logs()
        );
    }

    etcd.start().await;
    for admin in [&pair.prefill.admin, &pair.decode.admin] {
        eventually(
            Duration::from_secs(15),
            "registered again once etcd is back",
            || async { metric(admin, "kvgate_discovery_registered").await == 1.0 },
            &logs,
        )
        .await;
    }
    eventually(Duration::from_secs(10), "both records back", || async { etcd.keys(prefix).await.len() == 2 }, &logs)
        .await;
    assert!(
        peers(&pair.decode.admin).await.first().is_some_and(|p| p["up"] == true && p["source"] == "etcd"),
        "{}",
        logs()
    );
    drop((prefill, decode));
    pair.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundreds_of_records_arriving_and_going_at_once_are_followed_while_kv_caches_keep_moving() {
    let _serial = serial().await;
    let dir = work_dir();
    let etcd = Etcd::started(dir.path()).await;
    let prefix = "/kvgate-test/many/";
    let settings = discovered_pair(&etcd, prefix, "max_peers = 512\n");
    let mut pair = linked_pair(dir.path(), &settings).await;
    let logs = pair_logs(&pair);
    // 300 gateways that never answer (nothing listens at their addresses), written 100 to a
    // transaction: decode sorts before them and dials each; prefill sorts after and waits for them.
    const FAKES: usize = 300;
    let mut client = etcd.client().await.unwrap();
    for batch in (0..FAKES).collect::<Vec<_>>().chunks(100) {
        let puts: Vec<etcd_client::TxnOp> = batch
            .iter()
            .map(|i| {
                let name = format!("fake-{i:03}");
                let value = serde_json::json!({"name": name, "address": format!("127.0.0.1:{}", free_port()), "host": "elsewhere"}).to_string();
                etcd_client::TxnOp::put(format!("{prefix}{name}"), value, None)
            })
            .collect();
        client.txn(etcd_client::Txn::new().and_then(puts)).await.unwrap();
    }
    for admin in [&pair.prefill.admin, &pair.decode.admin] {
        eventually(
            Duration::from_secs(20),
            "every record followed",
            || async { metric(admin, "kvgate_discovery_peers").await == (FAKES + 1) as f64 },
            &logs,
        )
        .await;
        assert_eq!(peers(admin).await.len(), FAKES + 1);
    }
    let shape = small_shape();
    let prefill = engine(dir.path(), &pair.prefill.socket, "prefill", &shape, 2).await;
    let decode = engine(dir.path(), &pair.decode.socket, "decode", &shape, 2).await;
    let r = run_room(&prefill, &decode, &shape, 501, 0, 0).await.unwrap();
    assert!(
        r.prefill.succeeded && r.decode.succeeded && r.verified,
        "with {FAKES} unreachable peers: {r:?}\n{}",
        logs()
    );

    // One delete of the whole range: a single watch answer carrying 300 deletions.
    client.delete(format!("{prefix}fake-"), Some(etcd_client::DeleteOptions::new().with_prefix())).await.unwrap();
    for admin in [&pair.prefill.admin, &pair.decode.admin] {
        eventually(
            Duration::from_secs(20),
            "every withdrawn record forgotten",
            || async { peers(admin).await.len() == 1 },
            &logs,
        )
        .await;
        assert_eq!(metric(admin, "kvgate_discovery_peers").await, 1.0);
    }
    let r = run_room(&prefill, &decode, &shape, 502, 0, 0).await.unwrap();
    assert!(r.prefill.succeeded && r.decode.succeeded && r.verified, "after the withdrawal: {r:?}\n{}", logs());
    drop((prefill, decode));
    pair.stop();
}
