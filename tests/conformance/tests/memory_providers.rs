//! The peers' memory provider: a plugin that serves only CUDA device memory is certified here through
//! the `fake_device` provider (host files registered as device memory, as the gateway's `fake-device`
//! test plugin reads them); with `auto` in a build without CUDA support it is unsupported on every
//! clause with that reason, never pass; and the provider really decides what is registered (a
//! host-only plugin refuses the fake device regions).

mod common;
use common::*;

fn fake_device_plugin() -> String {
    kvgate_host::artifacts::built_cdylib_path(
        "kvgate-gateway-fixture-fake-device-plugin",
        "kvgate_fixture_fake_device_plugin",
    )
    .unwrap_or_else(|e| panic!("{e}"))
    .to_string_lossy()
    .into_owned()
}

const FAKE_DEVICE: &str = "[harness]\nmemory_provider = \"fake_device\"\n";

#[test]
fn a_device_only_plugin_passes_every_clause_on_fake_device_memory() {
    let run = run_harness(&fake_device_plugin(), &["--quick"], FAKE_DEVICE);
    assert_all_pass(&run, false);
    assert_eq!(run.report["limits"]["memory_provider"], "fake_device");
    let (_, _, evidence) = run.clauses().into_iter().find(|(id, _, _)| id == "HANDSHAKE-3").unwrap();
    assert!(evidence.contains("host refused") && evidence.contains("cuda_device advertised"), "{evidence}");
}

#[test]
fn device_memory_without_cuda_support_is_unsupported_with_the_reason_never_pass() {
    let run = run_harness(&fake_device_plugin(), &["--quick", "--clauses", "DATA,ABORT-2"], "");
    if cfg!(feature = "cuda") {
        return; // a CUDA build decides by the driver (tests/gpu/run.sh)
    }
    assert_eq!(run.with_status("pass"), Vec::<String>::new(), "{}", run.stdout);
    for (id, status, evidence) in run.clauses() {
        assert_eq!(status, "unsupported", "{id}: {evidence}");
        assert!(evidence.contains("built without CUDA support"), "{id}: {evidence}");
    }
    assert_eq!(run.report["certified"], false);
}

#[test]
fn a_host_only_plugin_refuses_fake_device_regions() {
    let run = run_harness("builtin:shm", &["--quick", "--clauses", "DATA-1"], FAKE_DEVICE);
    let (_, status, evidence) = run.clauses().into_iter().find(|(id, _, _)| id == "DATA-1").unwrap();
    assert_eq!(status, "fail", "{evidence}");
    assert!(
        evidence.contains("memory provider \"fake_device\"") && evidence.contains("unsupported_memory"),
        "{evidence}"
    );
}
