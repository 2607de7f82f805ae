//! Config parsing and validation: defaults, every bound at and just past its limit, unknown keys
//! and type errors named.

use kvgate_abi::ReasonCode;
use kvgate_plugin_nvlink::config::{NvlinkConfig, BOUNDS, MAX_DEVICES};

fn err(text: &str) -> String {
    let e = NvlinkConfig::parse(text).expect_err(text);
    assert_eq!(e.code, ReasonCode::INVALID_ARGUMENT, "{text}: {e}");
    e.message.to_string()
}

#[test]
fn empty_config_gives_the_documented_defaults() {
    let c = NvlinkConfig::parse("").unwrap();
    assert_eq!(c, NvlinkConfig::default());
    assert_eq!(c.chunk_bytes, 16 << 20);
    assert_eq!(c.vmm_fd_request_timeout_ms, 5000);
    assert_eq!(c.streams_per_peer, 2);
    assert_eq!(c.max_copies_in_flight_per_transfer, 4);
    assert!(c.devices.is_empty());
}

#[test]
fn every_key_parses() {
    let c = NvlinkConfig::parse(
        "devices = [0, 2]\nstreams_per_peer = 3\nchunk_bytes = 1048576\nmax_copies_in_flight_per_transfer = 8\n\
         max_inflight_transfers = 10\nmax_segments_per_submit = 11\nmax_transfer_bytes = 12\n\
         max_registered_regions = 13\nmax_imported_remote_keys = 14\nmax_peers = 15\npoll_spin_us = 16\n\
         poll_max_sleep_us = 17\nshutdown_drain_ms = 18\nvmm_fd_request_timeout_ms = 19\n",
    )
    .unwrap();
    assert_eq!(c.devices, vec![0, 2]);
    assert_eq!(
        (c.streams_per_peer, c.chunk_bytes, c.max_copies_in_flight_per_transfer, c.max_inflight_transfers),
        (3, 1 << 20, 8, 10)
    );
    assert_eq!((c.max_segments_per_submit, c.max_transfer_bytes, c.max_registered_regions), (11, 12, 13));
    assert_eq!((c.max_imported_remote_keys, c.max_peers, c.poll_spin_us), (14, 15, 16));
    assert_eq!((c.poll_max_sleep_us, c.shutdown_drain_ms, c.vmm_fd_request_timeout_ms), (17, 18, 19));
}

#[test]
fn each_bound_is_accepted_at_its_limit_and_refused_just_past_it() {
    for &(key, min, max) in BOUNDS {
        NvlinkConfig::parse(&format!("{key} = {min}")).unwrap_or_else(|e| panic!("{key} = {min}: {e}"));
        NvlinkConfig::parse(&format!("{key} = {max}")).unwrap_or_else(|e| panic!("{key} = {max}: {e}"));
        let past_max = err(&format!("{key} = {}", max + 1));
        assert!(past_max.contains(key), "{past_max}");
        if min > 0 {
            let below_min = err(&format!("{key} = {}", min - 1));
            assert!(below_min.contains(key) && below_min.contains(&format!("{min}..={max}")), "{below_min}");
        }
    }
}

#[test]
fn an_unknown_key_is_refused_and_named() {
    let m = err("chunk_byte = 1048576");
    assert!(m.contains("chunk_byte"), "{m}");
}

#[test]
fn a_wrong_type_names_the_key() {
    let m = err("streams_per_peer = \"four\"");
    assert!(m.contains("streams_per_peer"), "{m}");
    let m = err("devices = 0");
    assert!(m.contains("devices"), "{m}");
}

#[test]
fn negative_numbers_and_malformed_toml_are_refused() {
    err("chunk_bytes = -1");
    err("devices = [-1]");
    err("this is not toml");
}

#[test]
fn duplicate_devices_and_too_many_devices_are_refused() {
    let m = err("devices = [1, 0, 1]");
    assert!(m.contains("devices") && m.contains("twice"), "{m}");
    let at_limit: Vec<String> = (0..MAX_DEVICES).map(|i| i.to_string()).collect();
    NvlinkConfig::parse(&format!("devices = [{}]", at_limit.join(","))).unwrap();
    let past: Vec<String> = (0..=MAX_DEVICES).map(|i| i.to_string()).collect();
    let m = err(&format!("devices = [{}]", past.join(",")));
    assert!(m.contains("devices"), "{m}");
}
