//! Without a CUDA driver the plugin opens cleanly as UNAVAILABLE with the reason, through the
//! factory and through the ABI module, and never panics; config errors still come first.

use kvgate_abi::sdk::{sink_from_fn, PluginFactory, Sink};
use kvgate_abi::{abi_stable::std_types::RStr, MemoryKind, ReasonCode, ABI_VERSION};
use kvgate_plugin_nvlink::{cuda, open_with_probe, NvlinkFactory};

fn quiet_sink() -> Sink {
    Sink::new(sink_from_fn(|e| panic!("no event expected without an instance: {e:?}")))
}

#[test]
fn open_without_a_driver_is_unavailable_with_the_reason() {
    let e = open_with_probe("", quiet_sink(), || false).err().expect("must not open");
    assert_eq!(e.code, ReasonCode::UNAVAILABLE);
    assert!(e.message.contains("libcuda not found"), "{e}");
}

#[test]
fn a_bad_config_is_reported_before_the_driver_check() {
    let e =
        open_with_probe("chunk_bytes = 1", quiet_sink(), || panic!("driver probed before the config")).err().unwrap();
    assert_eq!(e.code, ReasonCode::INVALID_ARGUMENT);
    assert!(e.message.contains("chunk_bytes"), "{e}");
}

#[test]
fn the_real_factory_on_this_machine_never_panics_and_is_unavailable_without_libcuda() {
    let opened = std::panic::catch_unwind(|| NvlinkFactory::open("", quiet_sink()).map(|_| ()));
    let result = opened.expect("open panicked");
    if !cuda::driver_library_present() {
        let e = result.unwrap_err();
        assert_eq!(e.code, ReasonCode::UNAVAILABLE, "{e}");
        assert!(e.message.contains("libcuda not found"), "{e}");
    } else if let Err(e) = result {
        // A driver without a usable GPU must still be a clean UNAVAILABLE, never a panic.
        assert_eq!(e.code, ReasonCode::UNAVAILABLE, "{e}");
    }
}

#[test]
fn the_abi_module_reports_info_and_returns_unavailable_across_the_boundary() {
    let module = kvgate_plugin_nvlink::module();
    assert_eq!(module.abi_version()(), ABI_VERSION);
    let info = module.info()();
    assert_eq!(info.name.as_str(), "nvlink");
    assert!(info.capabilities.serves(MemoryKind::CUDA_DEVICE));
    assert!(!info.capabilities.serves(MemoryKind::HOST));
    assert_eq!(info.capabilities.max_inflight_transfers, 4096);
    if !cuda::driver_library_present() {
        let sink = sink_from_fn(|e| panic!("unexpected event {e:?}"));
        let e = module.open()(RStr::from("max_peers = 4"), sink).into_result().err().expect("must not open");
        assert_eq!(e.code, ReasonCode::UNAVAILABLE);
        let sink = sink_from_fn(|e| panic!("unexpected event {e:?}"));
        let e = module.open()(RStr::from("max_peers = 0"), sink).into_result().err().unwrap();
        assert_eq!(e.code, ReasonCode::INVALID_ARGUMENT);
    }
}
