//! Built-in registration, `open` outcomes (unavailable apart from other failures) and per-peer
//! selection with every skipped preference explained. Uses small fake plugins written with the SDK.

use kvgate_abi::abi_stable::prefix_type::PrefixTypeTrait;
use kvgate_abi::sdk::{module, sink_from_fn, Plugin, PluginFactory, Sink};
use kvgate_abi::*;
use kvgate_host::{LoadError, OpenError, OpenedPlugin, PluginHost, PluginOrigin, SkipReason};

/// A do-nothing transport; its config string picks its open outcome and its health.
struct Fake {
    info: PluginInfo,
    healthy: bool,
}

impl Plugin for Fake {
    fn info(&self) -> PluginInfo {
        self.info.clone()
    }
    fn local_endpoint(&self) -> Vec<u8> {
        Vec::new()
    }
    fn connect(&self, _: PeerId, _: &[u8]) -> Result<(), PluginError> {
        Ok(())
    }
    fn disconnect(&self, _: PeerId) {}
    fn register(&self, _: &RegionDesc) -> Result<Registration, PluginError> {
        Err(PluginError::new(ReasonCode::UNSUPPORTED_MEMORY, "fake"))
    }
    fn deregister(&self, _: LocalKey) -> Result<(), PluginError> {
        Ok(())
    }
    fn import_remote_key(&self, _: PeerId, _: &[u8]) -> Result<RemoteKey, PluginError> {
        Err(PluginError::new(ReasonCode::UNKNOWN_KEY, "fake"))
    }
    fn release_remote_key(&self, _: RemoteKey) {}
    fn submit(&self, _: &SubmitRequest<'_>) -> Result<(), PluginError> {
        Err(PluginError::new(ReasonCode::UNAVAILABLE, "fake"))
    }
    fn cancel(&self, _: XferId) {}
    fn stats(&self) -> Stats {
        Stats { healthy: u8::from(self.healthy), ..Stats::default() }
    }
    fn shutdown(&self) {}
}

fn info(name: &str, kinds: u32, scope: u32) -> PluginInfo {
    PluginInfo {
        name: name.into(),
        version: "test".into(),
        abi_version: ABI_VERSION,
        capabilities: Capabilities { memory_kinds: kinds, scope, ..Capabilities::default() },
    }
}

fn open_fake(info: PluginInfo, config: &str) -> Result<Fake, PluginError> {
    match config {
        "unavailable" => Err(PluginError::new(ReasonCode::UNAVAILABLE, "no device here")),
        "bad" => Err(PluginError::new(ReasonCode::INVALID_ARGUMENT, "key `x` is wrong")),
        "broken" => Err(PluginError::new(ReasonCode::TRANSPORT_ERROR, "socket refused")),
        "panic" => panic!("fake open panicked"),
        "unhealthy" => Ok(Fake { info, healthy: false }),
        _ => Ok(Fake { info, healthy: true }),
    }
}

macro_rules! fake_factory {
    ($factory:ident, $name:expr, $kinds:expr, $scope:expr) => {
        struct $factory;
        impl PluginFactory for $factory {
            type Plugin = Fake;
            fn info() -> PluginInfo {
                info($name, $kinds, $scope)
            }
            fn open(config: &str, _sink: Sink) -> Result<Fake, PluginError> {
                open_fake(Self::info(), config)
            }
        }
    };
}

const HOST: u32 = 1 << 1; // MemoryKind::HOST.bit()
const CUDA: u32 = 1 << 2; // MemoryKind::CUDA_DEVICE.bit()
fake_factory!(LocalFake, "local", HOST, scope::SAME_HOST);
fake_factory!(NetFake, "net", HOST, scope::CROSS_HOST);
fake_factory!(GpuFake, "gpu", CUDA, scope::SAME_HOST | scope::CROSS_HOST);
fake_factory!(LiarFake, "liar", HOST, scope::SAME_HOST);

fn sink() -> EventSinkBox {
    sink_from_fn(|_| {})
}

fn host() -> PluginHost {
    assert_eq!(MemoryKind::HOST.bit(), HOST);
    assert_eq!(MemoryKind::CUDA_DEVICE.bit(), CUDA);
    let mut host = PluginHost::new();
    host.register_builtin("local", module::<LocalFake>()).unwrap();
    host.register_builtin("net", module::<NetFake>()).unwrap();
    host.register_builtin("gpu", module::<GpuFake>()).unwrap();
    host
}

#[test]
fn builtins_are_listed_and_open() {
    let host = host();
    let listing = host.plugins();
    let names: Vec<&str> = listing.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(names, ["local", "net", "gpu"]);
    assert!(listing.iter().all(|l| l.origin == PluginOrigin::Builtin && l.abi_version == Some(ABI_VERSION)));
    let opened = host.open("local", "", sink()).unwrap();
    assert_eq!((opened.name(), opened.origin()), ("local", &PluginOrigin::Builtin));
    assert_eq!(opened.capabilities().scope, scope::SAME_HOST);
    assert!(host.module("net").is_some() && host.module("nope").is_none());
}

// CONFORMANCE: HYGIENE-2 (ABI version mismatch)
#[test]
fn bad_builtins_are_refused() {
    let mut host = host();
    let e = host.register_builtin("local", module::<LocalFake>()).unwrap_err();
    assert!(matches!(e, LoadError::DuplicateName { .. }), "{e}");
    let e = host.register_builtin("alias", module::<LocalFake>()).unwrap_err();
    assert!(matches!(e, LoadError::NameMismatch { .. }), "{e}");
    extern "C" fn abi_two() -> u32 {
        ABI_VERSION + 1
    }
    let real = module::<LiarFake>();
    let future = PluginMod {
        abi_version: abi_two,
        info: real.info(),
        open: real.open(),
        check_config: real.check_config().expect("built by this SDK"),
    }
    .leak_into_prefix();
    match host.register_builtin("liar", future).unwrap_err() {
        LoadError::AbiVersionMismatch { plugin_abi_version, host_abi_version, origin } => {
            assert_eq!(
                (plugin_abi_version, host_abi_version, origin),
                (ABI_VERSION + 1, ABI_VERSION, PluginOrigin::Builtin)
            );
        }
        other => panic!("expected AbiVersionMismatch, got {other}"),
    }
    assert_eq!(host.plugins().len(), 3, "nothing refused was added");
}

// CONFORMANCE: HYGIENE-3 (unavailable kept apart from other failures)
#[test]
fn open_failures_are_classified() {
    let host = host();
    match host.open("gpu", "unavailable", sink()).unwrap_err() {
        OpenError::Unavailable { plugin, reason } => {
            assert_eq!((plugin.as_str(), reason.as_str()), ("gpu", "no device here"))
        }
        other => panic!("expected Unavailable, got {other}"),
    }
    let e = host.open("gpu", "bad", sink()).unwrap_err();
    assert!(matches!(&e, OpenError::InvalidConfig { message, .. } if message.contains("`x`")), "{e}");
    let e = host.open("gpu", "broken", sink()).unwrap_err();
    assert!(matches!(&e, OpenError::Failed { code: ReasonCode::TRANSPORT_ERROR, .. }), "{e}");
    let e = host.open("gpu", "panic", sink()).unwrap_err();
    assert!(
        matches!(&e, OpenError::Failed { code: ReasonCode::PANIC, message, .. } if message.contains("fake open panicked")),
        "{e}"
    );
    assert_eq!(host.open("nope", "", sink()).unwrap_err(), OpenError::UnknownPlugin { plugin: "nope".into() });
    assert_eq!(host.open("nope", "", sink()).unwrap_err().code(), "unknown_plugin");
}

#[test]
fn select_takes_the_first_preference_that_fits() {
    let host = host();
    let opened: Vec<OpenedPlugin> = ["net", "local", "gpu"].iter().map(|n| host.open(n, "", sink()).unwrap()).collect();
    assert_eq!(host.select(&["local", "net"], MemoryKind::HOST, true, &opened), Ok(1));
    assert_eq!(host.select(&["local", "net"], MemoryKind::HOST, false, &opened), Ok(0));
    assert_eq!(host.select(&["gpu", "local"], MemoryKind::CUDA_DEVICE, true, &opened), Ok(2));
    let skipped = host.select(&["local", "net"], MemoryKind::CUDA_DEVICE, true, &opened).unwrap_err();
    assert_eq!(
        skipped,
        vec![
            ("local".to_string(), SkipReason::MemoryKindUnsupported(MemoryKind::CUDA_DEVICE)),
            ("net".to_string(), SkipReason::MemoryKindUnsupported(MemoryKind::CUDA_DEVICE)),
        ]
    );
    let skipped = host.select(&["net"], MemoryKind::HOST, true, &opened).unwrap_err();
    assert_eq!(skipped, vec![("net".to_string(), SkipReason::ScopeMismatch { same_host: true })]);
    assert_eq!(host.select::<&str>(&[], MemoryKind::HOST, true, &opened), Err(vec![]));
}

#[test]
fn select_explains_every_skipped_preference() {
    let mut host = host();
    let _ = host.load_library("/nonexistent/libkvgate_ucx.so");
    assert!(host.open("gpu", "unavailable", sink()).is_err());
    let sick = host.open("local", "unhealthy", sink()).unwrap();
    let net = host.open("net", "", sink()).unwrap();
    let opened = vec![sick, net];
    let skipped = host.select(&["ucx", "gpu", "nowhere", "local", "net"], MemoryKind::HOST, true, &opened).unwrap_err();
    let reasons: Vec<(&str, &str)> = skipped.iter().map(|(n, why)| (n.as_str(), why.code())).collect();
    assert_eq!(
        reasons,
        [
            ("ucx", "load_failed"),
            ("gpu", "unavailable"),
            ("nowhere", "not_registered"),
            ("local", "unhealthy"),
            ("net", "scope_mismatch")
        ]
    );
    assert!(skipped[1].1.to_string().contains("no device here"), "{}", skipped[1].1);
    // Once the unavailable plugin opens, it is merely not among the opened instances.
    host.open("gpu", "", sink()).unwrap();
    let skipped = host.select(&["gpu"], MemoryKind::HOST, true, &opened).unwrap_err();
    assert_eq!(skipped, vec![("gpu".to_string(), SkipReason::NotOpened)]);
}

// CONFORMANCE: HYGIENE-4
#[test]
fn an_instance_reporting_another_name_is_refused() {
    struct Renamer;
    impl PluginFactory for Renamer {
        type Plugin = Fake;
        fn info() -> PluginInfo {
            info("renamer", HOST, scope::SAME_HOST)
        }
        fn open(_config: &str, _sink: Sink) -> Result<Fake, PluginError> {
            Ok(Fake { info: info("someone-else", HOST, scope::SAME_HOST), healthy: true })
        }
    }
    let mut host = PluginHost::new();
    host.register_builtin("renamer", module::<Renamer>()).unwrap();
    let e = host.open("renamer", "", sink()).unwrap_err();
    assert_eq!(e.code(), "bad_instance", "{e}");
}

/// A plugin that checks its config apart from opening: `workers` must be 1..=4.
struct Checked;
impl PluginFactory for Checked {
    type Plugin = Fake;
    fn info() -> PluginInfo {
        info("checked", HOST, scope::SAME_HOST)
    }
    fn open(config: &str, _sink: Sink) -> Result<Fake, PluginError> {
        Self::check_config(config)?;
        open_fake(Self::info(), "")
    }
    fn check_config(config: &str) -> Result<(), PluginError> {
        match config.trim() {
            "" | "workers = 1" | "workers = 4" => Ok(()),
            "workers = 5" => Err(PluginError::new(ReasonCode::INVALID_ARGUMENT, "workers = 5 is outside 1..=4")),
            other => Err(PluginError::new(ReasonCode::TRANSPORT_ERROR, format!("cannot judge {other:?}"))),
        }
    }
}

#[test]
fn configs_are_checked_without_opening_and_never_called_valid_unchecked() {
    use kvgate_host::ConfigCheck;
    let mut host = host();
    host.register_builtin("checked", module::<Checked>()).unwrap();
    assert_eq!(host.check_config("checked", "workers = 4"), ConfigCheck::Valid);
    assert_eq!(host.check_config("checked", "workers = 1"), ConfigCheck::Valid);
    match host.check_config("checked", "workers = 5") {
        ConfigCheck::Invalid(OpenError::InvalidConfig { plugin, message }) => {
            assert_eq!(plugin, "checked");
            assert!(message.contains("outside 1..=4"), "{message}");
        }
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
    assert!(matches!(
        host.check_config("checked", "odd"),
        ConfigCheck::Invalid(OpenError::Failed { code: ReasonCode::TRANSPORT_ERROR, .. })
    ));
    // A plugin that only checks by opening is "not checked", not valid.
    assert!(matches!(host.check_config("local", "anything"), ConfigCheck::NotChecked { .. }));
    assert!(matches!(host.check_config("nosuch", ""), ConfigCheck::Invalid(OpenError::UnknownPlugin { .. })));
    // A plugin whose library did not load is "not checked", with the load failure as the reason.
    let _ = host.load_library("/nonexistent/libkvgate_gone.so");
    match host.check_config("gone", "") {
        ConfigCheck::NotChecked { reason } => assert!(reason.contains("did not load"), "{reason}"),
        other => panic!("expected NotChecked, got {other:?}"),
    }
}
