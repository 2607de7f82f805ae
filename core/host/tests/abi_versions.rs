//! The ABI's compatibility rule against real libraries of other kvgate-abi versions (ABI.md,
//! "Versions: the compatibility rule"):
//!
//! - `fixtures/abi-previous`: a plugin built against kvgate-abi 0.1.0 as it was before `check_config`
//!   was appended to the root module (a frozen copy of that interface) loads into this host, opens,
//!   moves bytes through its transport, and its config is reported not checked, not valid;
//! - `fixtures/abi-previous-minor`: the same source declared as kvgate-abi 0.0.1 (the series before
//!   0.1) is refused at load with `library_version_mismatch`, naming both versions.
//!
//! Each fixture is a workspace of its own (it holds a second package named `kvgate-abi`), built here
//! into this test's target directory, as the other fixture libraries are.

use kvgate_abi::sdk::sink_from_fn;
use kvgate_abi::{Event, EventKind, LocalKey, MemoryKind, PeerId, RegionDesc, Segment, SubmitRequest, Ticket, XferId};
use kvgate_host::artifacts::built_or_build_cdylib;
use kvgate_host::{ConfigCheck, LoadError, OpenError, PluginHost};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

/// How long the test waits for the loopback plugin's `SUCCEEDED` (it delivers it inside `submit`).
const EVENT_WAIT_MS: u64 = 10_000;

fn fixture(workspace: &str, package: &str, lib_name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures").join(workspace);
    built_or_build_cdylib(package, lib_name, &dir).unwrap_or_else(|e| panic!("{e}"))
}

fn previous_library() -> PathBuf {
    fixture("abi-previous", "kvgate-host-fixture-abi-previous", "kvgate_fixture_abi_previous")
}

fn previous_minor_library() -> PathBuf {
    fixture("abi-previous-minor", "kvgate-host-fixture-abi-previous-minor", "kvgate_fixture_abi_previous_minor")
}

fn host_region(buffer: &mut [u8]) -> RegionDesc {
    RegionDesc {
        kind: MemoryKind::HOST,
        device: -1,
        addr: buffer.as_mut_ptr() as u64,
        len: buffer.len() as u64,
        ..RegionDesc::default()
    }
}

#[test]
fn a_plugin_built_against_the_previous_compatible_abi_loads_and_moves_bytes() {
    let mut host = PluginHost::new();
    let name =
        host.load_library(previous_library()).unwrap_or_else(|e| panic!("the previous-ABI plugin is refused: {e}"));
    assert_eq!(name, "previous");
    let listing = host.plugins();
    assert_eq!(listing.len(), 1, "{listing:?}");
    assert_eq!(listing[0].abi_version, Some(kvgate_abi::ABI_VERSION));

    // `check_config` did not exist then: the host reads the field as absent and says so.
    match host.check_config("previous", "") {
        ConfigCheck::NotChecked { reason } => {
            assert!(reason.contains("built before config checks existed"), "{reason}")
        }
        other => panic!("a plugin without check_config must be reported not checked, got {other:?}"),
    }
    // Its own config errors still cross the boundary with their code.
    match host.open("previous", "workers = 2", sink_from_fn(|_| {})) {
        Err(OpenError::InvalidConfig { plugin, message }) => {
            assert_eq!(plugin, "previous");
            assert!(message.contains("takes no config"), "{message}");
        }
        other => panic!("expected InvalidConfig, got {:?}", other.map(|p| p.name().to_string())),
    }

    let (tx, rx) = mpsc::channel::<Event>();
    let tx = std::sync::Mutex::new(tx);
    let opened = host.open("previous", "", sink_from_fn(move |e| tx.lock().unwrap().send(e).unwrap())).expect("opens");
    assert!(opened.capabilities().serves(MemoryKind::HOST));
    let transport = opened.transport();

    let mut source: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 251) as u8).collect();
    let mut destination = vec![0u8; 4096];
    let src = transport.register(&host_region(&mut source)).into_result().expect("registers the source");
    let dst = transport.register(&host_region(&mut destination)).into_result().expect("registers the destination");
    let remote = transport
        .import_remote_key(PeerId(1), dst.remote_key.as_slice().into())
        .into_result()
        .expect("imports the destination's key");
    let segments = [
        Segment { local: src.key, local_offset: 0, remote, remote_offset: 1024, len: 3072 },
        Segment { local: src.key, local_offset: 3072, remote, remote_offset: 0, len: 1024 },
    ];
    let request = SubmitRequest {
        xfer: XferId(7),
        peer: PeerId(1),
        ticket: Ticket(1),
        timeout_ns: 1_000_000_000,
        segments: segments.as_slice().into(),
    };
    transport.submit(request).into_result().expect("submits");

    let event = rx.recv_timeout(Duration::from_millis(EVENT_WAIT_MS)).expect("an event for the transfer");
    assert_eq!((event.kind, event.xfer, event.bytes), (EventKind::SUCCEEDED, XferId(7), 4096), "{:?}", event.message);
    assert_eq!(&destination[1024..], &source[..3072]);
    assert_eq!(&destination[..1024], &source[3072..]);
    assert_eq!(transport.stats().registered_regions, 2);

    // A segment past its region is refused with the plugin's own code, through the old layout.
    let past = [Segment { local: src.key, local_offset: 4000, remote, remote_offset: 0, len: 200 }];
    let request = SubmitRequest {
        xfer: XferId(8),
        peer: PeerId(1),
        ticket: Ticket(1),
        timeout_ns: 1_000_000_000,
        segments: past.as_slice().into(),
    };
    let refused = transport.submit(request).into_result().expect_err("a segment past its region is refused");
    assert_eq!(refused.code, kvgate_abi::ReasonCode::OUT_OF_RANGE, "{refused}");
    assert!(transport.deregister(LocalKey(src.key.0)).is_ok());
    opened.shutdown();
}

#[test]
fn a_plugin_built_against_the_previous_minor_series_is_refused_by_version() {
    let path = previous_minor_library();
    let mut host = PluginHost::new();
    let error = host.load_library(&path).expect_err("a plugin of the 0.0 series must not load into a 0.1 host");
    assert_eq!(error.code(), "library_version_mismatch", "{error}");
    let LoadError::LibraryVersionMismatch { message, .. } = &error else { panic!("{error:?}") };
    let host_version = kvgate_abi_version();
    assert!(
        message.contains("kvgate-abi 0.0.1") && message.contains(&format!("kvgate-abi {host_version}")),
        "the reason names both versions: {message}"
    );
    assert_eq!(error.to_string().lines().count(), 1, "a one-line reason, not a layout dump: {error}");
    assert!(host.module("previous").is_none(), "nothing was admitted");
    assert!(host.plugins().iter().all(|p| p.status.is_err()), "listed only as a failed load");
}

/// The version of the kvgate-abi this host is built against (versioned on its own, not with this
/// crate): read from its manifest.
fn kvgate_abi_version() -> String {
    let manifest = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../abi/Cargo.toml")).unwrap();
    let line =
        manifest.lines().find(|l| l.trim_start().starts_with("version = \"")).expect("kvgate-abi sets its version");
    line.split('"').nth(1).unwrap().to_string()
}
