//! Every numeric knob of the QUIC plugin's TOML is accepted at its limits and refused just past them,
//! with an error naming the key; unknown keys and malformed values are refused too.

use kvgate_abi::ReasonCode;
use kvgate_plugin_quic::{CipherSuite, CongestionController, QuicConfig};

/// (key, smallest accepted, largest accepted); `None` where the limit is the type's own.
const LIMITS: &[(&str, Option<u64>, Option<u64>)] = &[
    ("endpoints", Some(1), Some(16)),
    ("connections_per_peer", Some(1), Some(16)),
    ("lanes_per_connection", Some(1), Some(64)),
    ("min_lane_bytes", Some(4096), None),
    ("max_concurrent_streams_per_connection", Some(16), Some(65536)),
    ("worker_threads", Some(1), Some(64)),
    ("initial_mtu_bytes", Some(1200), None),
    ("mtu_black_hole_cooldown_ms", Some(100), Some(3_600_000)),
    ("stream_window_bytes", Some(65536), Some(1 << 30)),
    ("connection_window_bytes", Some(65536), Some(1 << 32)),
    ("send_window_bytes", Some(65536), Some(1 << 32)),
    ("initial_congestion_window_bytes", None, Some(1 << 30)),
    ("idle_timeout_ms", Some(100), Some(600_000)),
    ("keep_alive_interval_ms", Some(10), Some(999)),
    ("connect_timeout_ms", Some(100), Some(600_000)),
    ("default_transfer_timeout_ms", Some(1), Some(3_600_000)),
    ("write_chunk_bytes", Some(4096), Some(16 << 20)),
    ("staging_pool_bytes", None, Some(1 << 32)),
    ("socket_buffer_bytes", Some(65536), Some(1 << 30)),
    ("stuck_min_bytes_per_s", None, Some(1 << 40)),
    ("stuck_below_best_percent", None, Some(100)),
    ("max_segments_per_submit", Some(1), Some(1 << 24)),
    ("max_inflight_transfers", Some(1), Some(1 << 24)),
    ("max_live_tickets", Some(1), Some(1 << 24)),
];

/// Keys whose accepted range depends on another key: pinned so the table above stays meaningful.
fn base(key: &str) -> String {
    match key {
        "keep_alive_interval_ms" => "idle_timeout_ms = 1000\n".into(),
        "idle_timeout_ms" => "keep_alive_interval_ms = 10\n".into(),
        "initial_mtu_bytes" => "mtu_discovery_upper_bound_bytes = 65527\nsegmentation_offload = false\n".into(),
        _ => String::new(),
    }
}

fn parse(text: &str) -> Result<QuicConfig, kvgate_abi::PluginError> {
    QuicConfig::parse(text)
}

#[test]
fn defaults_are_valid_and_documented_values() {
    let c = parse("").unwrap();
    assert_eq!(c.connections_per_peer, 2);
    assert_eq!(c.lanes_per_connection, 2);
    assert_eq!(c.idle_timeout_ms, 3000);
    assert_eq!(c.keep_alive_interval_ms, 500);
    assert_eq!(c.congestion_controller, CongestionController::Cubic);
    assert_eq!(c.mtu_discovery_upper_bound_bytes, 1452);
    assert!(c.segmentation_offload);
    assert_eq!(c.effective_initial_congestion_window_bytes(), 14720);
}

#[test]
fn every_limit_holds_at_and_just_past_it() {
    for (key, min, max) in LIMITS {
        if let Some(min) = min {
            parse(&format!("{}{key} = {min}", base(key))).unwrap_or_else(|e| panic!("{key} = {min} refused: {e}"));
            let err = parse(&format!("{}{key} = {}", base(key), min - 1)).expect_err(key);
            assert_eq!(err.code, ReasonCode::INVALID_ARGUMENT);
            assert!(err.message.contains(key), "{key}: {err}");
        }
        if let Some(max) = max {
            parse(&format!("{}{key} = {max}", base(key))).unwrap_or_else(|e| panic!("{key} = {max} refused: {e}"));
            let err = parse(&format!("{}{key} = {}", base(key), max + 1)).expect_err(key);
            assert!(err.message.contains(key), "{key}: {err}");
        }
    }
}

#[test]
fn mtu_bounds_are_u16_and_ordered() {
    parse("initial_mtu_bytes = 65527\nmtu_discovery_upper_bound_bytes = 65527\nsegmentation_offload = false").unwrap();
    let err = parse("initial_mtu_bytes = 65528\nmtu_discovery_upper_bound_bytes = 65527\nsegmentation_offload = false")
        .unwrap_err();
    assert!(err.message.contains("initial_mtu_bytes"), "{err}");
    let err = parse("initial_mtu_bytes = 9000\nmtu_discovery_upper_bound_bytes = 8999").unwrap_err();
    assert!(err.message.contains("mtu_discovery_upper_bound_bytes"), "{err}");
    let err = parse("mtu_discovery_upper_bound_bytes = 1199").unwrap_err();
    assert!(err.message.contains("mtu_discovery_upper_bound_bytes"), "{err}");
}

#[test]
fn the_initial_congestion_window_holds_two_initial_datagrams() {
    parse("initial_mtu_bytes = 1200\ninitial_congestion_window_bytes = 2400").unwrap();
    let err = parse("initial_mtu_bytes = 1200\ninitial_congestion_window_bytes = 2399").unwrap_err();
    assert!(err.message.contains("initial_congestion_window_bytes"), "{err}");
    let automatic =
        parse("initial_mtu_bytes = 65507\nmtu_discovery_upper_bound_bytes = 65507\nsegmentation_offload = false")
            .unwrap();
    assert_eq!(automatic.effective_initial_congestion_window_bytes(), 655_070);
}

#[test]
fn min_mtu_lies_between_1200_and_the_initial_mtu() {
    parse("initial_mtu_bytes = 9000\nmtu_discovery_upper_bound_bytes = 9000\nsegmentation_offload = false\nmin_mtu_bytes = 9000").unwrap();
    let err = parse("initial_mtu_bytes = 9000\nmtu_discovery_upper_bound_bytes = 9000\nsegmentation_offload = false\nmin_mtu_bytes = 9001").unwrap_err();
    assert!(err.message.contains("min_mtu_bytes"), "{err}");
    let err = parse("min_mtu_bytes = 1199").unwrap_err();
    assert!(err.message.contains("min_mtu_bytes"), "{err}");
    parse("initial_mtu_bytes = 65507\nsegmentation_offload = false\nmtu_discovery_upper_bound_bytes = 65507\nmin_mtu_bytes = 16000").unwrap();
    let err = parse("initial_mtu_bytes = 65507\nsegmentation_offload = false\nmtu_discovery_upper_bound_bytes = 65507\nmin_mtu_bytes = 16001").unwrap_err();
    assert!(err.message.contains("min_mtu_bytes"), "{err}");
}

#[test]
fn segmentation_offload_only_with_datagrams_up_to_1500_bytes() {
    parse("mtu_discovery_upper_bound_bytes = 1500").unwrap();
    let err = parse("mtu_discovery_upper_bound_bytes = 1501").unwrap_err();
    assert!(err.message.contains("segmentation_offload"), "{err}");
    parse("mtu_discovery_upper_bound_bytes = 1501\nsegmentation_offload = false").unwrap();
}

#[test]
fn lanes_stay_below_the_concurrent_stream_limit() {
    // The control stream needs one stream beside the lanes.
    parse("max_concurrent_streams_per_connection = 16\nlanes_per_connection = 15").unwrap();
    let err = parse("max_concurrent_streams_per_connection = 16\nlanes_per_connection = 16").unwrap_err();
    assert_eq!(err.code, ReasonCode::INVALID_ARGUMENT);
    assert!(
        err.message.contains("lanes_per_connection") && err.message.contains("max_concurrent_streams_per_connection"),
        "{err}"
    );
    // The version 1 key is gone: refused by name.
    let err = parse("streams_per_connection = 1").unwrap_err();
    assert!(err.message.contains("streams_per_connection"), "{err}");
}

#[test]
fn the_malloc_trim_threshold_is_zero_or_within_its_range() {
    assert_eq!(parse("").unwrap().malloc_trim_threshold_bytes, 0, "the allocator is left alone by default");
    parse("malloc_trim_threshold_bytes = 0").unwrap();
    for ok in [131072u64, 1 << 30] {
        parse(&format!("malloc_trim_threshold_bytes = {ok}")).unwrap_or_else(|e| panic!("{ok} refused: {e}"));
    }
    for bad in [1u64, 131071, (1 << 30) + 1] {
        let err = parse(&format!("malloc_trim_threshold_bytes = {bad}")).expect_err("out of range");
        assert_eq!(err.code, ReasonCode::INVALID_ARGUMENT);
        assert!(err.message.contains("malloc_trim_threshold_bytes"), "{err}");
    }
}

#[test]
fn the_stuck_window_is_zero_or_within_its_range() {
    let c = parse("").unwrap();
    assert_eq!(
        (c.stuck_after_ms, c.stuck_min_bytes_per_s, c.stuck_below_best_percent),
        (3000, 0, 10),
        "the watchdog is on by default"
    );
    parse("stuck_after_ms = 0").unwrap();
    for ok in [100u64, 600_000] {
        parse(&format!("stuck_after_ms = {ok}")).unwrap_or_else(|e| panic!("{ok} refused: {e}"));
    }
    for bad in [1u64, 99, 600_001] {
        let err = parse(&format!("stuck_after_ms = {bad}")).expect_err("out of range");
        assert_eq!(err.code, ReasonCode::INVALID_ARGUMENT);
        assert!(err.message.contains("stuck_after_ms"), "{err}");
    }
}

#[test]
fn keep_alive_must_be_below_the_idle_timeout() {
    let err = parse("idle_timeout_ms = 1000\nkeep_alive_interval_ms = 1000").unwrap_err();
    assert!(err.message.contains("keep_alive_interval_ms"), "{err}");
}

#[test]
fn unknown_keys_and_bad_values_are_refused_by_name() {
    let err = parse("idle_timeout = 5").unwrap_err();
    assert!(err.message.contains("idle_timeout"), "{err}");
    let err = parse("congestion_controller = \"vegas\"").unwrap_err();
    assert!(err.message.contains("vegas"), "{err}");
    let err = parse("endpoints = \"two\"").unwrap_err();
    assert!(err.message.contains("endpoints"), "{err}");
    for (name, cc) in [
        ("cubic", CongestionController::Cubic),
        ("bbr", CongestionController::Bbr),
        ("newreno", CongestionController::Newreno),
    ] {
        assert_eq!(parse(&format!("congestion_controller = \"{name}\"")).unwrap().congestion_controller, cc);
    }
    let err = parse("cipher_suite = \"aes192gcm\"").unwrap_err();
    assert!(err.message.contains("aes192gcm"), "{err}");
    assert_eq!(parse("").unwrap().cipher_suite, CipherSuite::Aes128gcm);
    for (name, suite) in [
        ("aes128gcm", CipherSuite::Aes128gcm),
        ("aes256gcm", CipherSuite::Aes256gcm),
        ("chacha20poly1305", CipherSuite::Chacha20poly1305),
    ] {
        assert_eq!(parse(&format!("cipher_suite = \"{name}\"")).unwrap().cipher_suite, suite);
    }
}

#[test]
fn a_certificate_needs_its_key_and_both_must_exist() {
    let err = parse("certificate_path = \"/nonexistent/cert.pem\"").unwrap_err();
    assert!(err.message.contains("private_key_path"), "{err}");
    let config =
        parse("certificate_path = \"/nonexistent/cert.pem\"\nprivate_key_path = \"/nonexistent/key.pem\"").unwrap();
    let sink = kvgate_abi::sdk::Sink::new(kvgate_abi::sdk::sink_from_fn(|_| {}));
    let err = kvgate_plugin_quic::QuicPlugin::open(config, sink).err().expect("missing files refused");
    assert_eq!(err.code, ReasonCode::INVALID_ARGUMENT);
    assert!(err.message.contains("certificate_path"), "{err}");
}

#[test]
fn an_unspecified_listen_address_needs_an_advertised_ip() {
    let config = parse("listen_address = \"0.0.0.0:0\"").unwrap();
    let sink = kvgate_abi::sdk::Sink::new(kvgate_abi::sdk::sink_from_fn(|_| {}));
    let err = kvgate_plugin_quic::QuicPlugin::open(config, sink).err().expect("refused");
    assert!(err.message.contains("advertise_ip"), "{err}");
}

#[test]
fn the_module_opens_through_the_abi_and_reports_bad_config() {
    let module = kvgate_plugin_quic::module();
    assert_eq!((module.abi_version())(), kvgate_abi::ABI_VERSION);
    let info = (module.info())();
    assert_eq!(info.name.as_str(), "quic");
    assert_ne!(info.capabilities.flags & kvgate_abi::cap_flags::RECEIVER_ENFORCED, 0);
    let sink = kvgate_abi::sdk::sink_from_fn(|_| {});
    let err = match (module.open())("worker_threads = 0".into(), sink).into_result() {
        Ok(_) => panic!("worker_threads = 0 accepted"),
        Err(e) => e,
    };
    assert_eq!(err.code, ReasonCode::INVALID_ARGUMENT);
    assert!(err.message.contains("worker_threads"), "{err}");
    let sink = kvgate_abi::sdk::sink_from_fn(|_| {});
    let transport = (module.open())("".into(), sink).unwrap();
    assert!(!transport.local_endpoint().is_empty());
    transport.shutdown();
}
