//! What the UCX plugin refuses before any byte moves: bad configs (with the key named), transports
//! that cannot run here (UNAVAILABLE with UCX's reason), bad endpoints and keys, out-of-range and
//! duplicate submits, limits at and just past their value, memory kinds it cannot serve.

mod support;

use kvgate_abi::sdk::{sink_from_fn, Plugin, PluginFactory, Sink};
use kvgate_abi::*;
use kvgate_plugin_ucx::UcxFactory;
use std::time::Duration;
use support::*;

fn open_err(config: &str) -> PluginError {
    match UcxFactory::open(config, Sink::new(sink_from_fn(|_| {}))) {
        Ok(_) => panic!("open({config:?}) succeeded"),
        Err(e) => e,
    }
}

#[test]
fn malformed_config_names_the_key() {
    let e = open_err("tls = \"tcp\"\nbogus_key = 1\n");
    assert_eq!(e.code, ReasonCode::INVALID_ARGUMENT);
    assert!(e.message.contains("bogus_key"), "{e}");
    let e = open_err("mode = \"teleport\"");
    assert_eq!(e.code, ReasonCode::INVALID_ARGUMENT);
    let e = open_err("max_inflight_transfers = 0");
    assert!(e.message.contains("max_inflight_transfers"), "{e}");
}

#[test]
fn ucx_refusing_a_setting_names_the_key() {
    // UCX's ucp_config_modify checks values of the settings it knows (an unknown name only draws
    // UCX's own warning at worker creation).
    let e = open_err("[ucx_options]\nRNDV_SCHEME = \"sideways\"\n");
    assert_eq!(e.code, ReasonCode::INVALID_ARGUMENT);
    assert!(e.message.contains("ucx_options.RNDV_SCHEME"), "{e}");
    let e = open_err("rndv_thresh = \"not-a-size\"");
    assert_eq!(e.code, ReasonCode::INVALID_ARGUMENT);
    assert!(e.message.contains("rndv_thresh"), "{e}");
}

#[test]
fn no_usable_transport_is_unavailable_with_ucx_reason() {
    // No InfiniBand here (nor on CI): UCX finds no device for `rc`.
    let e = open_err("tls = \"rc\"");
    assert_eq!(e.code, ReasonCode::UNAVAILABLE, "{e}");
    assert!(e.message.contains("no usable UCX transport"), "{e}");
    let e = open_err("tls = \"tcp\"\ndevices = \"no_such_nic0\"");
    assert_eq!(e.code, ReasonCode::UNAVAILABLE, "{e}");
}

#[test]
fn bad_endpoint_and_remote_key_bytes_are_refused() {
    let a = open(&tcp_config());
    assert_eq!(a.plugin.connect(PEER_B, b"garbage").unwrap_err().code, ReasonCode::INVALID_ARGUMENT);
    assert_eq!(a.plugin.connect(PEER_B, &[]).unwrap_err().code, ReasonCode::INVALID_ARGUMENT);
    assert_eq!(a.plugin.import_remote_key(PEER_B, b"garbage").unwrap_err().code, ReasonCode::INVALID_ARGUMENT);
    a.plugin.shutdown();
}

#[test]
fn cuda_memory_is_refused_at_registration() {
    let a = open(&tcp_config());
    let desc = RegionDesc { kind: MemoryKind::CUDA_DEVICE, device: 0, addr: 0x1000, len: 4096, ..Default::default() };
    assert_eq!(a.plugin.register(&desc).unwrap_err().code, ReasonCode::UNSUPPORTED_MEMORY);
    let desc = RegionDesc { kind: MemoryKind(99), device: 0, addr: 0x1000, len: 4096, ..Default::default() };
    assert_eq!(a.plugin.register(&desc).unwrap_err().code, ReasonCode::UNSUPPORTED_MEMORY);
    let mut empty: Vec<u8> = Vec::new();
    assert_eq!(a.plugin.register(&region(&mut empty)).unwrap_err().code, ReasonCode::INVALID_ARGUMENT);
    a.plugin.shutdown();
}

#[test]
fn submits_are_checked_before_anything_moves() {
    let config = format!("{}max_inflight_transfers = 2\nmax_segments_per_submit = 3\n", tcp_config());
    let (a, b) = pair(&config);
    let src = buffer(&a, 4096, 1);
    let dst = buffer(&b, 4096, 2);
    let remote = a.plugin.import_remote_key(PEER_B, &dst.remote_key_bytes).unwrap();
    let seg = |local_offset: u64, remote_offset: u64, len: u64| Segment {
        local: src.key,
        local_offset,
        remote,
        remote_offset,
        len,
    };
    let long = Duration::from_secs(30);
    let code = |r: Result<(), PluginError>| r.unwrap_err().code;
    assert_eq!(code(submit(&a, 1, PEER_B, 1, long, &[seg(4000, 0, 97)])), ReasonCode::OUT_OF_RANGE);
    assert_eq!(code(submit(&a, 1, PEER_B, 1, long, &[seg(0, 4000, 97)])), ReasonCode::OUT_OF_RANGE);
    assert_eq!(code(submit(&a, 1, PEER_B, 1, long, &[seg(u64::MAX, 0, 2)])), ReasonCode::OUT_OF_RANGE);
    let unknown_local = Segment { local: LocalKey(999), ..seg(0, 0, 1) };
    assert_eq!(code(submit(&a, 1, PEER_B, 1, long, &[unknown_local])), ReasonCode::UNKNOWN_KEY);
    let unknown_remote = Segment { remote: RemoteKey(999), ..seg(0, 0, 1) };
    assert_eq!(code(submit(&a, 1, PEER_B, 1, long, &[unknown_remote])), ReasonCode::UNKNOWN_KEY);
    assert_eq!(code(submit(&a, 1, PeerId(77), 1, long, &[seg(0, 0, 1)])), ReasonCode::PEER_UNREACHABLE);
    // max_segments_per_submit = 3: at the limit accepted (then refused by the receiver: no ticket), past it refused.
    assert_eq!(code(submit(&a, 1, PEER_B, 1, long, &[seg(0, 0, 1); 4])), ReasonCode::RESOURCE_EXHAUSTED);
    // A frozen-free way to keep transfers live: a receiver that has the ticket, large enough windows.
    expect(&b, 1, PEER_A, long, &[LocalRange { key: dst.key, offset: 0, len: 4096 }]);
    submit(&a, 10, PEER_B, 1, long, &[seg(0, 0, 1); 3]).unwrap();
    assert_eq!(code(submit(&a, 10, PEER_B, 1, long, &[seg(0, 0, 1)])), ReasonCode::DUPLICATE_ID,);
    a.log.terminal_of(XferId(10), WAIT_LIMIT);
    // Nothing moved for the refused submits: only transfer 10 has an event.
    assert!(a.log.all().iter().filter(|e| e.is_terminal()).all(|e| e.xfer == XferId(10)));
    a.plugin.shutdown();
    b.plugin.shutdown();
}

#[test]
fn max_inflight_transfers_at_and_past_the_limit() {
    let config = format!("{}max_inflight_transfers = 2\n", tcp_config());
    let a = open(&config);
    let frozen = frozen_peer(&tcp_config(), 8 << 20);
    a.plugin.connect(PEER_B, &frozen.endpoint).unwrap();
    let src = buffer(&a, 8 << 20, 1);
    let remote = a.plugin.import_remote_key(PEER_B, &frozen.remote_key).unwrap();
    let seg = [Segment { local: src.key, local_offset: 0, remote, remote_offset: 0, len: 8 << 20 }];
    let long = Duration::from_secs(60);
    submit(&a, 1, PEER_B, 1, long, &seg).unwrap();
    submit(&a, 2, PEER_B, 1, long, &seg).unwrap(); // at the limit
    assert_eq!(submit(&a, 3, PEER_B, 1, long, &seg).unwrap_err().code, ReasonCode::RESOURCE_EXHAUSTED); // past it
    assert_eq!(a.plugin.stats().live_transfers, 2);
    a.plugin.cancel(XferId(1));
    let end = a.log.terminal_of(XferId(1), WAIT_LIMIT);
    assert_eq!(end.reason, ReasonCode::CANCELLED);
    submit(&a, 3, PEER_B, 1, long, &seg).unwrap(); // room again
    a.plugin.shutdown();
    for xfer in [2, 3] {
        let end = a.log.terminal_of(XferId(xfer), WAIT_LIMIT);
        assert_eq!(end.reason, ReasonCode::SHUTDOWN, "{end:?}");
    }
    drop(frozen);
}

#[test]
fn calls_after_shutdown_fail_with_shutdown() {
    let a = open(&tcp_config());
    a.plugin.shutdown();
    a.plugin.shutdown(); // twice is harmless
    let mut bytes = vec![0u8; 64];
    assert_eq!(a.plugin.register(&region(&mut bytes)).unwrap_err().code, ReasonCode::SHUTDOWN);
    assert_eq!(submit(&a, 1, PEER_B, 1, Duration::from_secs(1), &[]).unwrap_err().code, ReasonCode::SHUTDOWN);
    let s = a.plugin.stats();
    assert_eq!((s.healthy, s.workers_alive), (0, 0));
}
