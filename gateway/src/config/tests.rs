//! Config loading and validation: typos, wrong types, limits at and just past their bounds.

use super::*;

fn errors_of(text: &str) -> String {
    match load_config_from_str(text) {
        Ok(_) => panic!("accepted:\n{text}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn empty_text_gives_the_defaults_and_they_are_valid() {
    assert_eq!(load_config_from_str("").unwrap(), GatewayConfig::default());
}

#[test]
fn default_toml_round_trips() {
    let text = default_toml();
    assert_eq!(load_config_from_str(&text).unwrap(), GatewayConfig::default());
}

#[test]
fn a_typo_in_a_key_is_refused_naming_the_key_and_its_section() {
    let e = errors_of("[peer_link]\nheartbeat_interval = 100\n");
    assert!(e.contains("heartbeat_interval"), "{e}");
    assert!(e.contains("peer_link") || e.contains("line 2"), "{e}");
    let e = errors_of("[schedular]\nroom_timeout_ms = 1\n");
    assert!(e.contains("schedular"), "{e}");
    let e = errors_of("[scheduler]\nroom_timeout = 1\n");
    assert!(e.contains("room_timeout"), "{e}");
}

#[test]
fn malformed_toml_and_wrong_types_are_refused() {
    assert!(errors_of("[gateway\nname = 1").contains("invalid configuration"));
    let e = errors_of("[peer_link]\nheartbeat_misses = \"five\"\n");
    assert!(e.contains("heartbeat_misses") || e.contains("line 2"), "{e}");
}

#[test]
fn heartbeat_limits_are_checked_at_and_just_past_each_bound() {
    for ok in [10, 60_000] {
        load_config_from_str(&format!("[peer_link]\nheartbeat_interval_ms = {ok}\n")).unwrap();
    }
    for bad in [9, 60_001] {
        let e = errors_of(&format!("[peer_link]\nheartbeat_interval_ms = {bad}\n"));
        assert!(e.contains(&format!("peer_link.heartbeat_interval_ms = {bad}")) && e.contains("10..=60000"), "{e}");
    }
    load_config_from_str("[peer_link]\nheartbeat_misses = 2\n").unwrap();
    load_config_from_str("[peer_link]\nheartbeat_misses = 100\n").unwrap();
    assert!(errors_of("[peer_link]\nheartbeat_misses = 1\n").contains("peer_link.heartbeat_misses = 1"));
    assert!(errors_of("[peer_link]\nheartbeat_misses = 101\n").contains("peer_link.heartbeat_misses = 101"));
}

#[test]
fn queue_limits_are_checked_at_and_just_past_each_bound() {
    let cases = [
        ("driver", "event_queue_len", 16, 1 << 20),
        ("driver", "plugin_event_queue_len", 16, 1 << 24),
        ("peer_link", "send_queue_frames", 16, 1 << 24),
        ("engine_api", "max_regions", 1, 1 << 20),
        ("engine_api", "max_watchers", 1, 65_536),
        ("engine_api", "watch_buffer_events", 16, 1 << 20),
        ("engine_api", "http2_max_pending_reset_streams", 20, 1 << 20),
        ("engine_api", "watch_replay_events", 16, 1 << 24),
        ("engine_api", "max_batch_calls", 1, 1 << 20),
        ("engine_api", "session_grace_ms", 100, 3_600_000),
        ("engine_api", "max_sessions", 1, 65_536),
        ("engine_api", "max_text_bytes", 16, 65_536),
        ("engine_api", "max_passed_fds", 1, 4096),
        ("engine_api", "passed_fd_ttl_ms", 100, 3_600_000),
        ("engine_api", "lane_max_frame_bytes", 1024, 1 << 30),
        ("engine_api", "lane_max_calls_in_flight", 1, 1 << 20),
        ("engine_api", "lane_max_queued_reply_bytes", 64 * 1024, 1 << 30),
        ("admin", "quarantine_unhealthy_ms", 100, 86_400_000),
    ];
    for (section, key, min, max) in cases {
        load_config_from_str(&format!("[{section}]\n{key} = {min}\n")).unwrap();
        load_config_from_str(&format!("[{section}]\n{key} = {max}\n")).unwrap();
        for bad in [min - 1, max + 1] {
            let e = errors_of(&format!("[{section}]\n{key} = {bad}\n"));
            assert!(e.contains(&format!("{section}.{key} = {bad}")) && e.contains(&format!("{min}..={max}")), "{e}");
        }
    }
}

#[test]
fn scheduler_limits_come_from_the_core_and_name_their_key() {
    let e = errors_of("[scheduler]\nplugin_grace_ms = 0\n");
    assert!(e.contains("scheduler.plugin_grace_ms = 0"), "{e}");
    let e = errors_of("[scheduler]\nroom_timeout_ms = 700000\nmax_room_timeout_ms = 600000\n");
    assert!(e.contains("scheduler.room_timeout_ms"), "{e}");
}

#[test]
fn every_problem_is_reported_at_once() {
    let e = errors_of("[peer_link]\nheartbeat_misses = 0\nheartbeat_interval_ms = 0\n[log]\nformat = \"xml\"\n");
    assert!(e.contains("3 problems"), "{e}");
}

#[test]
fn peers_are_checked() {
    let e = errors_of("[gateway]\nname = \"a\"\n[[peers]]\nname = \"a\"\naddress = \"nowhere\"\n");
    assert!(e.contains("peers[0].name") && e.contains("peers[0].address"), "{e}");
    let e = errors_of("[[peers]]\nname = \"b\"\naddress = \"h:1\"\n[[peers]]\nname = \"b\"\naddress = \"h:2\"\n");
    assert!(e.contains("peers[1].name"), "{e}");
    let e = errors_of("[[peers]]\nname = \"b\"\naddress = \"h:1\"\nsame_hots = true\n");
    assert!(e.contains("same_hots"), "{e}");
}

#[test]
fn tcp_engine_api_requires_a_token_file() {
    let e = errors_of("[engine_api]\ntcp_listen = \"127.0.0.1:7070\"\n");
    assert!(e.contains("engine_api.bearer_token_file"), "{e}");
    load_config_from_str("[engine_api]\ntcp_listen = \"127.0.0.1:7070\"\nbearer_token_file = \"/etc/t\"\n").unwrap();
}

#[test]
fn tls_needs_all_three_files() {
    let e = errors_of("[peer_link.tls]\ncert_file = \"c\"\n");
    assert!(e.contains("peer_link.tls.key_file") && e.contains("peer_link.tls.ca_file"), "{e}");
}

#[test]
fn plugin_config_tables_are_passed_through_as_toml() {
    let c = load_config_from_str("[plugins.config.shm]\nworkers = 3\n").unwrap();
    assert_eq!(toml::to_string(&c.plugins.config["shm"]).unwrap().trim(), "workers = 3");
}

#[test]
fn plugin_reload_limits_are_checked_at_and_just_past_their_bounds() {
    for ok in [1, 1024] {
        assert_eq!(
            load_config_from_str(&format!("[plugins]\nmax_mapped_libraries = {ok}\n"))
                .unwrap()
                .plugins
                .max_mapped_libraries,
            ok
        );
    }
    for bad in [0, 1025] {
        let e = errors_of(&format!("[plugins]\nmax_mapped_libraries = {bad}\n"));
        assert!(e.contains(&format!("plugins.max_mapped_libraries = {bad}")) && e.contains("1..=1024"), "{e}");
    }
    for ok in [100, 86_400_000] {
        assert_eq!(
            load_config_from_str(&format!("[plugins]\ndrain_timeout_ms = {ok}\n")).unwrap().plugins.drain_timeout_ms,
            ok
        );
    }
    for bad in [99, 86_400_001] {
        let e = errors_of(&format!("[plugins]\ndrain_timeout_ms = {bad}\n"));
        assert!(e.contains(&format!("plugins.drain_timeout_ms = {bad}")) && e.contains("100..=86400000"), "{e}");
    }
    for (key, min, max) in [
        ("restart_max_attempts", 0u64, 100u64),
        ("restart_window_ms", 1_000, 86_400_000),
        ("restart_backoff_ms", 10, 600_000),
    ] {
        for ok in [min, max] {
            load_config_from_str(&format!("[plugins]\n{key} = {ok}\n")).unwrap();
        }
        let past: Vec<u64> = if min > 0 { vec![min - 1, max + 1] } else { vec![max + 1] };
        for bad in past {
            let e = errors_of(&format!("[plugins]\n{key} = {bad}\n"));
            assert!(e.contains(&format!("plugins.{key} = {bad}")) && e.contains(&format!("{min}..={max}")), "{e}");
        }
    }
}

#[test]
fn shutdown_grace_is_checked_at_and_just_past_its_bounds() {
    for ok in [0, 60_000] {
        assert_eq!(
            load_config_from_str(&format!("[driver]\nshutdown_grace_ms = {ok}\n")).unwrap().driver.shutdown_grace_ms,
            ok
        );
    }
    let e = errors_of("[driver]\nshutdown_grace_ms = 60001\n");
    assert!(e.contains("driver.shutdown_grace_ms = 60001") && e.contains("0..=60000"), "{e}");
    for ok in [0, 1, super::MAX_IO_THREADS] {
        assert_eq!(load_config_from_str(&format!("[driver]\nio_threads = {ok}\n")).unwrap().driver.io_threads, ok);
    }
    let e = errors_of(&format!("[driver]\nio_threads = {}\n", super::MAX_IO_THREADS + 1));
    assert!(e.contains("driver.io_threads = 257") && e.contains("0..=256"), "{e}");
}

#[test]
fn stuck_room_warning_rate_is_checked_at_and_just_past_its_bounds() {
    for ok in [0, 1, super::MAX_STUCK_ROOM_WARN_LINES_PER_S] {
        assert_eq!(
            load_config_from_str(&format!("[admin]\nstuck_room_warn_lines_per_s = {ok}\n"))
                .unwrap()
                .admin
                .stuck_room_warn_lines_per_s,
            ok
        );
    }
    let e =
        errors_of(&format!("[admin]\nstuck_room_warn_lines_per_s = {}\n", super::MAX_STUCK_ROOM_WARN_LINES_PER_S + 1));
    assert!(e.contains("admin.stuck_room_warn_lines_per_s = 100001") && e.contains("0..=100000"), "{e}");
}

/// Discovery on (peer links then need their authentication: a key file, which validation does not read).
const ETCD: &str =
    "[peer_link]\npsk_file = \"/etc/kvgate/peer.key\"\n[discovery]\netcd_endpoints = [\"http://127.0.0.1:2379\"]\n";
const ETCD_ONLY: &str = "[discovery]\netcd_endpoints = [\"http://127.0.0.1:2379\"]\n";

#[test]
fn discovery_limits_are_checked_at_and_just_past_each_bound_only_when_it_is_on() {
    // Each key with the other of the lease pair set so that only its own range is in play.
    let cases = [
        ("lease_ttl_s", 2, 600, "request_timeout_ms = 10\n"),
        ("request_timeout_ms", 10, 60_000, "lease_ttl_s = 600\n"),
        ("retry_interval_ms", 10, 60_000, ""),
        ("max_peers", 1, MAX_DISCOVERED_PEERS, ""),
    ];
    for (key, min, max, other) in cases {
        let etcd = format!("{ETCD}{other}");
        load_config_from_str(&format!("{etcd}{key} = {min}\n")).unwrap();
        load_config_from_str(&format!("{etcd}{key} = {max}\n")).unwrap();
        for bad in [min - 1, max + 1] {
            let e = errors_of(&format!("{etcd}{key} = {bad}\n"));
            assert!(e.contains(&format!("discovery.{key} = {bad}")) && e.contains(&format!("{min}..={max}")), "{e}");
            // Without endpoints the section is unused and not checked.
            load_config_from_str(&format!("[discovery]\n{key} = {bad}\n")).unwrap();
        }
    }
    let sixteen: Vec<String> = (0..16).map(|i| format!("\"http://10.0.0.{i}:2379\"")).collect();
    let key = "[peer_link]\npsk_file = \"/etc/kvgate/peer.key\"\n";
    load_config_from_str(&format!("{key}[discovery]\netcd_endpoints = [{}]\n", sixteen.join(","))).unwrap();
    let seventeen = format!("{},\"http://10.0.0.99:2379\"", sixteen.join(","));
    let e = errors_of(&format!("{key}[discovery]\netcd_endpoints = [{seventeen}]\n"));
    assert!(e.contains("discovery.etcd_endpoints (count) = 17") && e.contains("1..=16"), "{e}");
}

#[test]
fn the_request_timeout_is_at_most_a_third_of_the_lease_at_and_just_past_the_limit() {
    load_config_from_str(&format!("{ETCD}lease_ttl_s = 3\nrequest_timeout_ms = 1000\n")).unwrap();
    let e = errors_of(&format!("{ETCD}lease_ttl_s = 3\nrequest_timeout_ms = 1001\n"));
    assert!(
        e.contains("discovery.request_timeout_ms = 1001") && e.contains("a third of discovery.lease_ttl_s (1000 ms)"),
        "{e}"
    );
    // The defaults (10 s, 3000 ms) are inside it.
    load_config_from_str(ETCD).unwrap();
}

#[test]
fn discovery_addresses_and_prefix_are_checked() {
    let e = errors_of("[discovery]\netcd_endpoints = [\"127.0.0.1:2379\", \"http://etcd\"]\n");
    assert!(
        e.contains("discovery.etcd_endpoints[0]")
            && e.contains("discovery.etcd_endpoints[1]")
            && e.contains("http://host:port"),
        "{e}"
    );
    let e = errors_of(&format!("{ETCD}key_prefix = \"/kvgate/peers\"\n"));
    assert!(e.contains("discovery.key_prefix") && e.contains("ending in /"), "{e}");
    let e = errors_of(&format!("{ETCD}advertise_address = \"10.0.0.1\"\n"));
    assert!(e.contains("discovery.advertise_address") && e.contains("host:port"), "{e}");
    // A wildcard listen address cannot be dialled: the advertised one must be given.
    let wildcard = format!("[peer_link]\nlisten = \"0.0.0.0:7100\"\npsk_file = \"/etc/kvgate/peer.key\"\n{ETCD_ONLY}");
    let e = errors_of(&wildcard);
    assert!(e.contains("discovery.advertise_address") && e.contains("wildcard"), "{e}");
    load_config_from_str(&format!("{wildcard}advertise_address = \"10.0.0.1:7100\"\n")).unwrap();
}

#[test]
fn discovery_credentials_and_tls_come_whole() {
    let e = errors_of(&format!("{ETCD}username = \"kvgate\"\n"));
    assert!(e.contains("discovery.password_file") && e.contains("or neither"), "{e}");
    let e = errors_of(&format!("{ETCD}password_file = \"/etc/kvgate/etcd-password\"\n"));
    assert!(e.contains("discovery.username") && e.contains("or neither"), "{e}");
    load_config_from_str(&format!("{ETCD}username = \"kvgate\"\npassword_file = \"/etc/kvgate/etcd-password\"\n"))
        .unwrap();

    // TLS: https:// endpoints only, a CA always, a client certificate with its key.
    let e = errors_of(&format!("{ETCD}[discovery.tls]\nca_file = \"/etc/ca.pem\"\n"));
    assert!(e.contains("discovery.etcd_endpoints[0]") && e.contains("https://host:port"), "{e}");
    let https =
        "[peer_link]\npsk_file = \"/etc/kvgate/peer.key\"\n[discovery]\netcd_endpoints = [\"https://etcd-1:2379\"]\n";
    let e = errors_of(https);
    assert!(e.contains("discovery.etcd_endpoints[0]") && e.contains("needs discovery.tls"), "{e}");
    let e = errors_of(&format!("{https}[discovery.tls]\ncert_file = \"/etc/c.pem\"\n"));
    assert!(e.contains("discovery.tls.ca_file") && e.contains("discovery.tls.cert_file"), "{e}");
    load_config_from_str(&format!("{https}[discovery.tls]\nca_file = \"/etc/ca.pem\"\n")).unwrap();
    load_config_from_str(&format!(
        "{https}[discovery.tls]\nca_file = \"/etc/ca.pem\"\ncert_file = \"/etc/c.pem\"\nkey_file = \"/etc/c.key\"\n"
    ))
    .unwrap();
}

#[test]
fn a_log_level_the_filter_would_not_understand_is_refused() {
    for bad in ["warning", "verbose", "", " ", "kvgate=loud", "=info", "info,"] {
        let e = errors_of(&format!("[log]\nlevel = {bad:?}\n"));
        assert!(e.contains("log.level") && e.contains("trace|debug|info|warn|error|off"), "{bad:?}: {e}");
    }
    for good in ["info", "WARN", "off", "kvgate::driver=debug,warn", "h2=error, info"] {
        load_config_from_str(&format!("[log]\nlevel = {good:?}\n")).unwrap_or_else(|e| panic!("{good:?}: {e}"));
    }
}

#[test]
fn peer_links_need_authentication_unless_none_is_written_and_then_only_on_loopback() {
    let peer = "[[peers]]\nname = \"decode\"\naddress = \"127.0.0.1:7101\"\n";
    // A gateway with no peer needs no key; one with a peer (or discovery) does.
    load_config_from_str("").unwrap();
    let e = errors_of(peer);
    assert!(e.contains("peer_link.psk_file") && e.contains("kvgate keygen psk"), "{e}");
    assert!(errors_of(ETCD_ONLY).contains("peer_link.psk_file"));
    let c = load_config_from_str(&format!("[peer_link]\npsk_file = \"/k\"\n{peer}")).unwrap();
    assert_eq!(c.peer_link.auth_mode(), PeerAuthMode::Psk);
    // `tls` needs its section; the section alone means `tls`; `psk` beside it is refused.
    assert!(errors_of(&format!("[peer_link]\nauth = \"tls\"\n{peer}")).contains("only with [peer_link.tls]"));
    let tls = "[peer_link.tls]\ncert_file = \"/c\"\nkey_file = \"/k\"\nca_file = \"/ca\"\n";
    assert_eq!(load_config_from_str(&format!("{peer}{tls}")).unwrap().peer_link.auth_mode(), PeerAuthMode::Tls);
    assert!(errors_of(&format!("[peer_link]\nauth = \"psk\"\npsk_file = \"/k\"\n{peer}{tls}"))
        .contains("one authentication per link"));
    // `none`: only written, only on loopback, with no key file beside it.
    assert_eq!(
        load_config_from_str(&format!("[peer_link]\nauth = \"none\"\n{peer}")).unwrap().peer_link.auth_mode(),
        PeerAuthMode::None
    );
    // The transport: framed unless TLS; framed with TLS is refused, gRPC is allowed with any.
    assert_eq!(c.peer_link.transport_mode(), PeerTransport::Framed);
    assert_eq!(load_config_from_str(&format!("{peer}{tls}")).unwrap().peer_link.transport_mode(), PeerTransport::Grpc);
    let grpc = load_config_from_str(&format!("[peer_link]\npsk_file = \"/k\"\ntransport = \"grpc\"\n{peer}")).unwrap();
    assert_eq!(grpc.peer_link.transport_mode(), PeerTransport::Grpc);
    let e = errors_of(&format!("[peer_link]\ntransport = \"framed\"\n{peer}{tls}"));
    assert!(e.contains("peer_link.transport") && e.contains("no TLS yet"), "{e}");
    assert!(errors_of(&format!("[peer_link]\ntransport = \"http\"\n{peer}")).contains("transport"));
    for listen in ["0.0.0.0:7100", "10.0.0.1:7100", "[::]:7100"] {
        let e = errors_of(&format!("[peer_link]\nauth = \"none\"\nlisten = {listen:?}\n{peer}"));
        assert!(e.contains("peer_link.listen") && e.contains("loopback"), "{listen}: {e}");
    }
    load_config_from_str(&format!("[peer_link]\nauth = \"none\"\nlisten = \"[::1]:7100\"\n{peer}")).unwrap();
    assert!(errors_of(&format!("[peer_link]\nauth = \"none\"\npsk_file = \"/k\"\n{peer}"))
        .contains("empty unless peer_link.auth"));
    // A misspelt mode is a parse error naming the key.
    assert!(errors_of("[peer_link]\nauth = \"pks\"\n").contains("auth"));
}

#[test]
fn every_listeners_connection_limits_are_checked_at_and_just_past_each_bound() {
    for section in ["engine_api", "peer_link", "admin"] {
        for (key, min, max) in [
            ("max_connections", 1u64, 65_536u64),
            ("handshake_timeout_ms", 100, 600_000),
            ("idle_timeout_ms", 1_000, 86_400_000),
        ] {
            for ok in [min, max] {
                load_config_from_str(&format!("[{section}.connections]\n{key} = {ok}\n")).unwrap();
            }
            for bad in [min - 1, max + 1] {
                let e = errors_of(&format!("[{section}.connections]\n{key} = {bad}\n"));
                assert!(e.contains(&format!("{section}.connections.{key} = {bad}")), "{e}");
            }
        }
    }
    assert!(errors_of("[engine_api.connections]\nmax_conections = 5\n").contains("max_conections"));
    // A peer link's silence bound leaves room for heartbeats: at 2 x the interval, and just under.
    load_config_from_str(
        "[peer_link]\nheartbeat_interval_ms = 1000\n[peer_link.connections]\nidle_timeout_ms = 2000\n",
    )
    .unwrap();
    let e = errors_of("[peer_link]\nheartbeat_interval_ms = 1000\n[peer_link.connections]\nidle_timeout_ms = 1999\n");
    assert!(e.contains("peer_link.connections.idle_timeout_ms = 1999") && e.contains("heartbeat_interval_ms"), "{e}");
}

#[test]
fn watchers_per_connection_are_checked_at_and_just_past_their_bounds() {
    load_config_from_str("[engine_api]\nmax_watchers_per_connection = 1\n").unwrap();
    load_config_from_str("[engine_api]\nmax_watchers_per_connection = 65536\n").unwrap();
    assert!(errors_of("[engine_api]\nmax_watchers_per_connection = 65537\n")
        .contains("engine_api.max_watchers_per_connection = 65537"));
    assert!(errors_of("[engine_api]\nmax_watchers_per_connection = 0\n")
        .contains("engine_api.max_watchers_per_connection = 0"));
}

#[test]
fn the_inputs_per_step_are_checked_at_and_just_past_their_bounds() {
    assert_eq!(load_config_from_str("[driver]\ninputs_per_step = 1\n").unwrap().driver.inputs_per_step, 1);
    load_config_from_str("[driver]\ninputs_per_step = 4096\n").unwrap();
    assert!(errors_of("[driver]\ninputs_per_step = 4097\n").contains("driver.inputs_per_step = 4097"));
    assert!(errors_of("[driver]\ninputs_per_step = 0\n").contains("driver.inputs_per_step = 0"));
}

#[test]
fn the_stall_catch_up_is_checked_at_and_just_past_its_bounds() {
    load_config_from_str("[driver]\nstall_catch_up_ms = 0\n").unwrap();
    load_config_from_str("[driver]\nstall_catch_up_ms = 10000\n").unwrap();
    assert!(errors_of("[driver]\nstall_catch_up_ms = 10001\n").contains("driver.stall_catch_up_ms = 10001"));
}

#[test]
fn parked_outcomes_are_checked_at_and_just_past_their_bound() {
    load_config_from_str("[peer_link]\nparked_outcomes = 0\n").unwrap();
    load_config_from_str("[peer_link]\nparked_outcomes = 1048576\n").unwrap();
    assert!(errors_of("[peer_link]\nparked_outcomes = 1048577\n").contains("peer_link.parked_outcomes = 1048577"));
}
