//! `[discovery]` against an etcd that checks who calls: a user with a password file and a role on its
//! prefix registers, a wrong password or a prefix outside the role is refused `etcd_auth_failed`; an
//! etcd serving TLS with client certificates takes a gateway with the cluster's certificates and
//! refuses one from another CA; an unreadable password file stops start-up naming the key; discovered
//! peers link over mutual TLS checked against the `tls_name` their record publishes.

mod common;

use common::etcd::{discovery_only_settings, Etcd, EtcdServerTls};
use common::pki::{leaf_named, pem_files, pki, tls_toml, Pki};
use common::*;
use etcd_client::Permission;
use kvgate_demo::engine::run_room;
use kvgate_demo::gateways::{free_port, Cluster, GatewayPair, PairSettings};
use std::path::Path;
use std::time::Duration;
use tokio::time::Instant;

/// Polls `admin`'s `/metrics` until `series` reads `want`; fails with the log after `within`.
async fn wait_metric(
    admin: &str,
    series: &str,
    want: impl Fn(f64) -> bool,
    within: Duration,
    log: &dyn Fn() -> String,
) {
    eventually(within, &format!("{series} as wanted"), || async { want(metric(admin, series).await) }, log).await;
}

const REGISTERED: &str = "kvgate_discovery_registered";
const AUTH_FAILED: &str = "kvgate_discovery_errors_total{reason=\"etcd_auth_failed\"}";

fn write(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_with_a_role_on_its_prefix_registers_and_a_wrong_password_or_prefix_is_refused_etcd_auth_failed() {
    let _serial = serial().await;
    let dir = work_dir();
    let mut etcd = Etcd::started(dir.path()).await;
    let prefix = "/kvgate-test/auth/";
    let mut root = etcd.client().await.unwrap();
    root.user_add("root", "root-secret", None).await.unwrap();
    root.user_grant_role("root", "root").await.unwrap();
    root.role_add("gateways").await.unwrap();
    root.role_grant_permission("gateways", Permission::read_write(prefix).with_prefix()).await.unwrap();
    root.user_add("kvgate", "gw-secret", None).await.unwrap();
    root.user_grant_role("kvgate", "gateways").await.unwrap();
    root.auth_enable().await.unwrap();
    etcd.client_options = etcd.client_options.clone().with_user("root", "root-secret");

    let right = write(dir.path(), "right-password", "gw-secret\n");
    let wrong = write(dir.path(), "wrong-password", "guess\n");
    let table = |password_file: &str, key_prefix: &str| {
        format!(
            "[discovery]\netcd_endpoints = [\"{}\"]\nkey_prefix = \"{key_prefix}\"\nretry_interval_ms = 200\nusername = \"kvgate\"\npassword_file = \"{password_file}\"\n",
            etcd.url()
        )
    };
    let (good, bad_password, bad_prefix) = (table(&right, prefix), table(&wrong, prefix), table(&right, "/elsewhere/"));
    let members = [
        ("good", good.as_str(), vec![]),
        ("badpassword", bad_password.as_str(), vec![]),
        ("badprefix", bad_prefix.as_str(), vec![]),
    ];
    let mut cluster = Cluster::start(&binary(), dir.path(), &discovery_only_settings(), &members).await.unwrap();
    let within = Duration::from_secs(15);

    let good = cluster.get("good");
    wait_metric(&good.admin, REGISTERED, |v| v == 1.0, within, &|| good.log()).await;
    for name in ["badpassword", "badprefix"] {
        let g = cluster.get(name);
        wait_metric(&g.admin, AUTH_FAILED, |v| v >= 2.0, within, &|| g.log()).await;
        assert_eq!(sample(&metrics(&g.admin).await, REGISTERED), Some(0.0));
        assert!(g.log().contains("etcd_auth_failed"), "{}", g.log());
    }
    assert!(cluster.get("badpassword").log().contains("authentication failed"), "{}", cluster.get("badpassword").log());
    assert!(cluster.get("badprefix").log().contains("permission denied"), "{}", cluster.get("badprefix").log());
    assert_eq!(etcd.keys(prefix).await, [format!("{prefix}good")]);
    assert!(etcd.keys("/elsewhere/").await.is_empty());
    cluster.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_with_client_certificates_a_gateway_of_the_cluster_registers_and_one_from_another_ca_does_not() {
    let _serial = serial().await;
    let dir = work_dir();
    let (cluster_ca, cluster_ca_pem) = pki("kvgate test cluster CA");
    let (rogue_ca, rogue_ca_pem) = pki("someone else's CA");
    let server = leaf_named(&cluster_ca, &cluster_ca_pem, "127.0.0.1");
    let (server_cert, server_key, server_ca) = pem_files(dir.path(), "etcd-server", &server, &cluster_ca_pem);
    let client = leaf_named(&cluster_ca, &cluster_ca_pem, "kvgate-test-client");
    let client_tls = etcd_client::TlsOptions::new()
        .ca_certificate(etcd_client::Certificate::from_pem(&cluster_ca_pem))
        .identity(etcd_client::Identity::from_pem(&client.cert_pem, &client.key_pem));
    let server_tls =
        EtcdServerTls { cert_file: server_cert.into(), key_file: server_key.into(), client_ca_file: server_ca.into() };
    let mut etcd = Etcd::with_tls(dir.path(), server_tls, client_tls);
    etcd.start().await;

    let prefix = "/kvgate-test/tls/";
    let table = |name: &str, own: &Pki| {
        let (cert, key, ca) = pem_files(dir.path(), name, own, &cluster_ca_pem);
        format!(
            "[discovery]\netcd_endpoints = [\"{}\"]\nkey_prefix = \"{prefix}\"\nretry_interval_ms = 200\n[discovery.tls]\nca_file = \"{ca}\"\ncert_file = \"{cert}\"\nkey_file = \"{key}\"\n",
            etcd.url()
        )
    };
    let member = table("member", &leaf_named(&cluster_ca, &cluster_ca_pem, "member"));
    let stranger = table("stranger", &leaf_named(&rogue_ca, &rogue_ca_pem, "stranger"));
    let members = [("member", member.as_str(), vec![]), ("stranger", stranger.as_str(), vec![])];
    let mut cluster = Cluster::start(&binary(), dir.path(), &discovery_only_settings(), &members).await.unwrap();
    let within = Duration::from_secs(15);
    let member = cluster.get("member");
    wait_metric(&member.admin, REGISTERED, |v| v == 1.0, within, &|| member.log()).await;
    let stranger = cluster.get("stranger");
    let tls_failed = "kvgate_discovery_errors_total{reason=\"etcd_tls_failed\"}";
    wait_metric(&stranger.admin, tls_failed, |v| v >= 2.0, within, &|| stranger.log()).await;
    assert_eq!(sample(&metrics(&stranger.admin).await, REGISTERED), Some(0.0));
    assert_eq!(etcd.keys(prefix).await, [format!("{prefix}member")]);
    cluster.stop();
}

#[test]
fn an_unreadable_password_file_stops_start_up_naming_the_key() {
    let dir = work_dir();
    let missing = dir.path().join("no-such-password");
    let config = format!(
        "[gateway]\nname = \"early\"\n[engine_api]\nunix_socket = \"{}\"\n[peer_link]\nlisten = \"127.0.0.1:{}\"\nauth = \"none\"\n[admin]\nlisten = \"\"\n\
         [discovery]\netcd_endpoints = [\"http://127.0.0.1:{}\"]\nusername = \"kvgate\"\npassword_file = \"{}\"\n",
        dir.path().join("early.sock").display(),
        free_port(),
        free_port(),
        missing.display()
    );
    let path = write(dir.path(), "early.toml", &config);
    let out = std::process::Command::new(binary())
        .args(["serve", "--config", &path])
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("discovery.password_file: cannot read") && stderr.contains("no-such-password"), "{stderr}");
    assert!(!dir.path().join("early.sock").exists(), "the engine socket was bound before the credentials were read");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovered_peers_link_over_mutual_tls_checked_against_the_name_their_record_publishes() {
    let _serial = serial().await;
    let dir = work_dir();
    let etcd = Etcd::started(dir.path()).await;
    let (ca, ca_pem) = pki("kvgate test cluster CA");
    let discovery = |prefix: &str, tls_name: &str| {
        format!("[discovery]\netcd_endpoints = [\"{}\"]\nkey_prefix = \"{prefix}\"\nretry_interval_ms = 200\ntls_name = \"{tls_name}\"\n", etcd.url())
    };
    let prefill_cert = leaf_named(&ca, &ca_pem, "prefill.kv.internal");
    let decode_cert = leaf_named(&ca, &ca_pem, "decode.kv.internal");
    // `run` keeps each run's key prefix and certificate files apart.
    let settings = |run: &str, decode_cert: &Pki| PairSettings {
        static_peers: false,
        extra_prefill: tls_toml(dir.path(), &format!("prefill-{run}"), &prefill_cert, &ca_pem)
            + &discovery(&format!("/kvgate-test/{run}/"), "prefill.kv.internal"),
        extra_decode: tls_toml(dir.path(), &format!("decode-{run}"), decode_cert, &ca_pem)
            + &discovery(&format!("/kvgate-test/{run}/"), "decode.kv.internal"),
        wait_for_peers: false,
        ..PairSettings::default()
    };

    // Each certificate carries the name its gateway's record publishes: the link comes up, KV moves.
    let mut pair = GatewayPair::start(&binary(), dir.path(), &settings("mtls", &decode_cert)).await.unwrap();
    let up = "kvgate_peer_up{peer=\"decode\"}";
    wait_metric(&pair.prefill.admin, up, |v| v == 1.0, Duration::from_secs(15), &|| pair.prefill.log()).await;
    let shape = small_shape();
    let prefill = engine(dir.path(), &pair.prefill.socket, "prefill", &shape, 1).await;
    let decode = engine(dir.path(), &pair.decode.socket, "decode", &shape, 1).await;
    let r = run_room(&prefill, &decode, &shape, 710, 0, 0).await.unwrap();
    assert!(r.verified, "{r:?}");
    drop((prefill, decode));
    pair.stop();

    // Signed by the same CA but for another name than decode's record says: prefill, which decode
    // dials (its name sorts first), refuses the link.
    let impostor = leaf_named(&ca, &ca_pem, "impostor.kv.internal");
    let mut pair = GatewayPair::start(&binary(), dir.path(), &settings("impostor", &impostor)).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    while !pair.prefill.log().contains("peer_identity_mismatch") {
        assert!(Instant::now() < deadline, "no peer_identity_mismatch:\n{}", pair.prefill.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        pair.prefill.log().contains("decode.kv.internal"),
        "the refusal names the record's name: {}",
        pair.prefill.log()
    );
    assert_ne!(sample(&metrics(&pair.prefill.admin).await, up), Some(1.0));
    pair.stop();
}
