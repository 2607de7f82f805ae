//! `[discovery]` against an etcd cluster of three members on loopback, as production runs it: with a
//! member down (and listed first) gateways still register, find each other and move KV caches; when
//! the member a gateway talks to dies, it moves to another, keeps its record and keeps following
//! peers that come and go, whichever member it was; when its member freezes, it moves on before its
//! lease can expire, so its record never goes.

mod common;

use common::etcd::{discovery_gateway, wait_registered, EtcdCluster};
use common::*;
use kvgate_demo::engine::run_room;
use kvgate_demo::gateways::{Cluster, GatewayPair, PairSettings};
use std::time::Duration;
use tokio::time::Instant;

/// `[discovery]` listing every member, member `first` first (the one a gateway dials at start).
fn cluster_toml(etcd: &EtcdCluster, first: usize, prefix: &str, extra: &str) -> String {
    let mut urls = etcd.urls();
    urls.rotate_left(first);
    let endpoints = urls.iter().map(|u| format!("\"{u}\"")).collect::<Vec<_>>().join(", ");
    format!("[discovery]\netcd_endpoints = [{endpoints}]\nkey_prefix = \"{prefix}\"\nretry_interval_ms = 200\n{extra}")
}

/// A gateway named `steady` with `table`, once it has registered.
async fn registered_gateway(dir: &std::path::Path, table: &str) -> Cluster {
    let steady = discovery_gateway(dir, "steady", table).await;
    wait_registered(steady.get("steady"), Duration::from_secs(10)).await;
    steady
}

const REGISTERED: &str = "kvgate_discovery_registered";
const NAME_TAKEN: &str = "kvgate_discovery_errors_total{reason=\"name_taken\"}";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_member_down_and_listed_first_gateways_register_find_each_other_and_move_kv_caches() {
    let _serial = serial().await;
    let dir = work_dir();
    let mut etcd = EtcdCluster::started(dir.path(), 3).await;
    etcd.members[0].kill();
    etcd.settle().await;
    let prefix = "/kvgate-test/member-down/";
    // Time enough for a live member to answer on a loaded machine: only the dead one may fail.
    let table = cluster_toml(&etcd, 0, prefix, "lease_ttl_s = 15\nrequest_timeout_ms = 5000\n");
    let settings = PairSettings {
        static_peers: false,
        extra_prefill: table.clone(),
        extra_decode: table,
        ..PairSettings::default()
    };
    let mut pair =
        GatewayPair::start(&binary(), dir.path(), &settings).await.unwrap_or_else(|e| panic!("{e:#}\n{}", etcd.logs()));
    let logs = || format!("{}\n{}", pair.prefill.log(), pair.decode.log());
    for admin in [&pair.prefill.admin, &pair.decode.admin] {
        eventually(Duration::from_secs(10), "registered", || async { metric(admin, REGISTERED).await == 1.0 }, &logs)
            .await;
        eventually(
            Duration::from_secs(10),
            "the other gateway found through etcd and linked",
            || async {
                let p = peers(admin).await;
                p.len() == 1 && p[0]["up"] == true && p[0]["source"] == "etcd"
            },
            &logs,
        )
        .await;
    }
    assert_eq!(etcd.members[1].keys(prefix).await, [format!("{prefix}decode"), format!("{prefix}prefill")]);

    let shape = small_shape();
    let prefill = engine(dir.path(), &pair.prefill.socket, "prefill", &shape, 2).await;
    let decode = engine(dir.path(), &pair.decode.socket, "decode", &shape, 2).await;
    let r = run_room(&prefill, &decode, &shape, 401, 0, 0).await.unwrap();
    assert!(r.prefill.succeeded && r.decode.succeeded && r.verified, "{r:?}\n{}", logs());
    drop((prefill, decode));
    // The dead member cost each gateway its first session and nothing after: no call of the
    // session that registered went to it.
    let urls = etcd.urls();
    for admin in [&pair.prefill.admin, &pair.decode.admin] {
        let text = metrics(admin).await;
        let errors: Vec<&str> = text.lines().filter(|l| l.starts_with("kvgate_discovery_errors_total{")).collect();
        assert_eq!(errors, ["kvgate_discovery_errors_total{reason=\"etcd_unreachable\"} 1"], "{}", logs());
        // The admin view says where the gateway is registered and what the dead member did.
        let view = discovery_view(admin).await;
        assert!(view["enabled"] == true && view["registered"] == true && view["lease_id"].as_i64() > Some(0), "{view}");
        assert_eq!(view["endpoint"], urls[1].as_str(), "{view}");
        assert!(
            view["last_error"]["reason"] == "etcd_unreachable" && view["last_error"]["endpoint"] == urls[0].as_str(),
            "{view}"
        );
    }
    assert!(discovery_view(&pair.decode.admin).await["key"] == format!("{prefix}decode").as_str());
    pair.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_its_member_dies_a_gateway_moves_to_another_keeps_its_record_and_keeps_following_peers() {
    let _serial = serial().await;
    let dir = work_dir();
    let mut etcd = EtcdCluster::started(dir.path(), 3).await;
    let prefix = "/kvgate-test/member-lost/";
    let ttl_s = 2;
    let table = cluster_toml(&etcd, 0, prefix, &format!("lease_ttl_s = {ttl_s}\nrequest_timeout_ms = 500\n"));
    let mut steady = registered_gateway(dir.path(), &table).await;
    let (admin, log) = (steady.get("steady").admin.clone(), || steady.get("steady").log());
    let steady_key = format!("{prefix}steady");

    // Each member in turn: whichever one the gateway talks to dies in one of these rounds.
    for down in 0..etcd.members.len() {
        etcd.members[down].kill();
        let alive = &etcd.members[(down + 1) % etcd.members.len()];
        // A gateway that joins while the member is down is found...
        let name = format!("late-{down}");
        let mut late = discovery_gateway(dir.path(), &name, &table).await;
        let up = || async { peers(&admin).await.iter().any(|p| p["name"] == name.as_str() && p["up"] == true) };
        eventually(Duration::from_secs(15), &format!("{name} found and linked with member {down} down"), up, &log)
            .await;
        // ...and forgotten when it stops.
        late.stop();
        eventually(
            Duration::from_secs(15),
            &format!("{name} forgotten"),
            || async { peers(&admin).await.is_empty() },
            &log,
        )
        .await;
        // Past two lease periods the record is still there, kept alive through another member.
        tokio::time::sleep(Duration::from_secs(2 * ttl_s)).await;
        eventually(
            Duration::from_secs(10),
            "registered through a live member",
            || async { metric(&admin, REGISTERED).await == 1.0 },
            &log,
        )
        .await;
        let record = alive.value(&steady_key).await;
        assert!(
            record.as_deref().is_some_and(|v| v.contains(&steady.get("steady").peer_listen)),
            "member {down} down: record {record:?}\n{}",
            log()
        );
        etcd.members[down].start().await;
    }
    assert_eq!(metric(&admin, NAME_TAKEN).await, 0.0, "{}", log());
    steady.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_its_member_freezes_a_gateway_moves_on_before_its_lease_can_expire_and_its_record_never_goes() {
    let _serial = serial().await;
    let dir = work_dir();
    let etcd = EtcdCluster::started(dir.path(), 3).await;
    // A follower freezes: the leader and the other follower keep the quorum, and the lease runs
    // on the leader, which hears no keep-alive from a gateway still talking to the frozen member.
    let leader = etcd.leader().await;
    let frozen = (leader + 1) % etcd.members.len();
    let prefix = "/kvgate-test/member-frozen/";
    let ttl = Duration::from_secs(6);
    let table =
        cluster_toml(&etcd, frozen, prefix, &format!("lease_ttl_s = {}\nrequest_timeout_ms = 1000\n", ttl.as_secs()));
    let mut steady = registered_gateway(dir.path(), &table).await;
    let (admin, log) = (steady.get("steady").admin.clone(), || steady.get("steady").log());
    let key = format!("{prefix}steady");
    assert!(
        log().contains(&format!("endpoint={}", etcd.urls()[frozen])),
        "not registered through member {frozen}:\n{}",
        log()
    );

    etcd.members[frozen].freeze();
    // For two lease periods the record is read every 50 ms on the leader: it must never be missing.
    let until = Instant::now() + 2 * ttl;
    while Instant::now() < until {
        let record = etcd.members[leader].local_value(&key).await;
        assert!(record.is_some(), "the record went while member {frozen} was frozen\n{}", log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(metric(&admin, REGISTERED).await, 1.0, "{}", log());
    let unreachable = metric(&admin, "kvgate_discovery_errors_total{reason=\"etcd_unreachable\"}").await;
    assert!(unreachable >= 1.0, "the frozen member was not noticed\n{}", log());
    let view = discovery_view(&admin).await;
    let frozen_url = etcd.urls()[frozen].clone();
    assert!(
        view["registered"] == true && view["endpoint"] != frozen_url.as_str(),
        "still on the frozen member: {view}"
    );
    assert!(
        view["last_error"]["reason"] == "etcd_unreachable" && view["last_error"]["endpoint"] == frozen_url.as_str(),
        "{view}"
    );
    assert!(view["last_error"]["detail"].as_str().is_some_and(|d| d.contains("keep-alive")), "{view}");
    // A gateway that joins now is found (it dials the frozen member first, too).
    let mut late = discovery_gateway(dir.path(), "late", &table).await;
    let up = || async { peers(&admin).await.iter().any(|p| p["name"] == "late" && p["up"] == true) };
    eventually(Duration::from_secs(15), "late found and linked", up, &log).await;
    late.stop();
    etcd.members[frozen].thaw();
    steady.stop();
}
