//! The plugin SDK: write a plugin as plain safe Rust ([`Plugin`] + [`PluginFactory`]) and get an
//! ABI v1 module whose every exported entry catches panics and turns them into failures
//! (a panic that crossed the boundary would abort the host process).
//!
//! The plugin side of the transfer contract is here too, written once: [`TransferLedger`] (one
//! terminal event per transfer, deadlines, cancels, quiesce tracking) and [`RegionView`] (bounds-checked
//! copies of registered memory, the only place a host-memory plugin dereferences a foreign address).

pub mod ledger;
pub mod region;

pub use ledger::{Admission, Failure, OrderedDelivery, TransferLedger};
pub use region::RegionView;

use crate::module::{PluginMod, PluginModRef};
use crate::transport::{EventSinkBox, Transport, TransportBox, Transport_TO};
use crate::types::*;
use abi_stable::{
    prefix_type::PrefixTypeTrait,
    sabi_trait::TD_Opaque,
    std_types::{RErr, ROk, RResult, RSlice, RStr, RString, RVec},
};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

/// The host's event sink, cheap to clone into plugin threads.
#[derive(Clone)]
pub struct Sink(Arc<EventSinkBox>);

impl Sink {
    pub fn new(sink: EventSinkBox) -> Sink {
        Sink(Arc::new(sink))
    }
    pub fn deliver(&self, event: Event) {
        self.0.deliver(event)
    }
    pub fn succeeded(&self, xfer: XferId, bytes: u64) {
        self.deliver(Event::succeeded(xfer, bytes))
    }
    pub fn failed(&self, xfer: XferId, reason: ReasonCode, message: impl Into<String>) {
        self.deliver(Event::failed(xfer, reason, message))
    }
    pub fn failed_quiesced(&self, xfer: XferId, reason: ReasonCode, message: impl Into<String>) {
        self.deliver(Event::failed_quiesced(xfer, reason, message))
    }
    pub fn quiesced(&self, xfer: XferId) {
        self.deliver(Event::quiesced(xfer))
    }
    pub fn progress(&self, xfer: XferId, bytes: u64) {
        self.deliver(Event::progress(xfer, bytes))
    }
}

/// A sink from a closure (hosts and tests use it; plugins receive theirs at `open`).
pub fn sink_from_fn<F: Fn(Event) + Send + Sync + 'static>(f: F) -> EventSinkBox {
    struct FnSink<F>(F);
    impl<F: Fn(Event) + Send + Sync + 'static> crate::transport::EventSink for FnSink<F> {
        fn deliver(&self, event: Event) {
            (self.0)(event)
        }
    }
    crate::transport::EventSink_TO::from_value(FnSink(f), TD_Opaque)
}

/// A transport in safe Rust. Mirrors [`Transport`]; see its rules.
pub trait Plugin: Send + Sync + 'static {
    fn info(&self) -> PluginInfo;
    fn local_endpoint(&self) -> Vec<u8>;
    fn connect(&self, peer: PeerId, endpoint: &[u8]) -> Result<(), PluginError>;
    fn disconnect(&self, peer: PeerId);
    fn register(&self, region: &RegionDesc) -> Result<Registration, PluginError>;
    fn deregister(&self, key: LocalKey) -> Result<(), PluginError>;
    fn import_remote_key(&self, peer: PeerId, bytes: &[u8]) -> Result<RemoteKey, PluginError>;
    fn release_remote_key(&self, key: RemoteKey);
    fn submit(&self, request: &SubmitRequest<'_>) -> Result<(), PluginError>;
    fn cancel(&self, xfer: XferId);
    /// One-sided plugins (the sender writes directly) accept every ticket and enforce nothing;
    /// they must not advertise `cap_flags::RECEIVER_ENFORCED`.
    fn expect_incoming(&self, _request: &IncomingRequest<'_>) -> Result<(), PluginError> {
        Ok(())
    }
    fn cancel_incoming(&self, _peer: PeerId, _ticket: Ticket) {}
    fn stats(&self) -> Stats;
    fn shutdown(&self);
}

/// How a plugin library opens instances.
pub trait PluginFactory: 'static {
    type Plugin: Plugin;
    /// Static information (the same `name` every instance reports).
    fn info() -> PluginInfo;
    /// Parse `config` and start an instance that reports through `sink`.
    fn open(config: &str, sink: Sink) -> Result<Self::Plugin, PluginError>;
    /// Parse and check `config` as `open` would, opening nothing. The default says the plugin
    /// cannot check its config apart from opening (`UNAVAILABLE`), which the host reports as
    /// "not checked", never as valid.
    fn check_config(_config: &str) -> Result<(), PluginError> {
        Err(PluginError::new(ReasonCode::UNAVAILABLE, "this plugin checks its config only when it opens"))
    }
}

/// Runs `f`, turning a panic into a `PANIC` error that carries the panic message.
pub fn catch_panic<T>(what: &str, f: impl FnOnce() -> Result<T, PluginError>) -> Result<T, PluginError> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(result) => result,
        Err(payload) => Err(PluginError::new(ReasonCode::PANIC, format!("{what} panicked: {}", panic_text(&payload)))),
    }
}

fn panic_text(payload: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

/// Spawn a plugin worker thread whose panic is reported as `UNHEALTHY` instead of vanishing.
// CONFORMANCE: TIME-10
pub fn spawn_worker<F>(name: &str, sink: Sink, f: F) -> std::io::Result<std::thread::JoinHandle<()>>
where
    F: FnOnce() + Send + 'static,
{
    let thread_name = name.to_string();
    std::thread::Builder::new().name(thread_name.clone()).spawn(move || {
        if let Err(payload) = catch_unwind(AssertUnwindSafe(f)) {
            sink.deliver(Event::unhealthy(
                ReasonCode::PANIC,
                format!("worker {thread_name} panicked: {}", panic_text(&payload)),
            ));
        }
    })
}

/// Wraps a [`Plugin`] so that no panic crosses the ABI.
// CONFORMANCE: HYGIENE-1 (every entry of every plugin built on the SDK catches panics)
struct Guarded<P: Plugin> {
    inner: P,
    sink: Sink,
}

impl<P: Plugin> Guarded<P> {
    fn call<T>(&self, what: &str, f: impl FnOnce(&P) -> Result<T, PluginError>) -> RResult<T, PluginError> {
        match catch_panic(what, || f(&self.inner)) {
            Ok(v) => ROk(v),
            Err(e) => RErr(e),
        }
    }
    /// For calls with no result: a panic makes the instance unhealthy, visibly.
    fn call_void(&self, what: &str, f: impl FnOnce(&P)) {
        if let Err(e) = catch_panic(what, || {
            f(&self.inner);
            Ok(())
        }) {
            self.sink.deliver(Event::unhealthy(e.code, e.message.to_string()));
        }
    }
}

impl<P: Plugin> Transport for Guarded<P> {
    fn info(&self) -> PluginInfo {
        match catch_panic("info", || Ok(self.inner.info())) {
            Ok(info) => info,
            Err(e) => {
                self.sink.deliver(Event::unhealthy(e.code, e.message.to_string()));
                PluginInfo {
                    name: RString::from("panicked"),
                    version: RString::new(),
                    abi_version: ABI_VERSION,
                    capabilities: Capabilities::default(),
                }
            }
        }
    }
    fn local_endpoint(&self) -> RVec<u8> {
        match catch_panic("local_endpoint", || Ok(self.inner.local_endpoint())) {
            Ok(v) => v.into(),
            Err(e) => {
                self.sink.deliver(Event::unhealthy(e.code, e.message.to_string()));
                RVec::new()
            }
        }
    }
    fn connect(&self, peer: PeerId, endpoint: RSlice<'_, u8>) -> RResult<(), PluginError> {
        self.call("connect", |p| p.connect(peer, endpoint.as_slice()))
    }
    fn disconnect(&self, peer: PeerId) {
        self.call_void("disconnect", |p| p.disconnect(peer))
    }
    fn register(&self, region: &RegionDesc) -> RResult<Registration, PluginError> {
        self.call("register", |p| p.register(region))
    }
    fn deregister(&self, key: LocalKey) -> RResult<(), PluginError> {
        self.call("deregister", |p| p.deregister(key))
    }
    fn import_remote_key(&self, peer: PeerId, bytes: RSlice<'_, u8>) -> RResult<RemoteKey, PluginError> {
        self.call("import_remote_key", |p| p.import_remote_key(peer, bytes.as_slice()))
    }
    fn release_remote_key(&self, key: RemoteKey) {
        self.call_void("release_remote_key", |p| p.release_remote_key(key))
    }
    fn submit(&self, request: SubmitRequest<'_>) -> RResult<(), PluginError> {
        self.call("submit", |p| p.submit(&request))
    }
    fn cancel(&self, xfer: XferId) {
        self.call_void("cancel", |p| p.cancel(xfer))
    }
    fn expect_incoming(&self, request: IncomingRequest<'_>) -> RResult<(), PluginError> {
        self.call("expect_incoming", |p| p.expect_incoming(&request))
    }
    fn cancel_incoming(&self, peer: PeerId, ticket: Ticket) {
        self.call_void("cancel_incoming", |p| p.cancel_incoming(peer, ticket))
    }
    fn stats(&self) -> Stats {
        match catch_panic("stats", || Ok(self.inner.stats())) {
            Ok(s) => s,
            Err(e) => {
                self.sink.deliver(Event::unhealthy(e.code, e.message.to_string()));
                Stats::default()
            }
        }
    }
    fn shutdown(&self) {
        self.call_void("shutdown", |p| p.shutdown())
    }
}

extern "C" fn abi_version_entry() -> u32 {
    ABI_VERSION
}

extern "C" fn info_entry<F: PluginFactory>() -> PluginInfo {
    match catch_panic("info", || Ok(F::info())) {
        Ok(info) => info,
        Err(e) => PluginInfo {
            name: RString::from(format!("panicked: {e}")),
            version: RString::new(),
            abi_version: ABI_VERSION,
            capabilities: Capabilities::default(),
        },
    }
}

extern "C" fn open_entry<F: PluginFactory>(config: RStr<'_>, sink: EventSinkBox) -> RResult<TransportBox, PluginError> {
    let sink = Sink::new(sink);
    let opened = catch_panic("open", || F::open(config.as_str(), sink.clone()));
    match opened {
        Ok(plugin) => ROk(Transport_TO::from_value(Guarded { inner: plugin, sink }, TD_Opaque)),
        Err(e) => RErr(e),
    }
}

extern "C" fn check_config_entry<F: PluginFactory>(config: RStr<'_>) -> RResult<(), PluginError> {
    match catch_panic("check_config", || F::check_config(config.as_str())) {
        Ok(()) => ROk(()),
        Err(e) => RErr(e),
    }
}

/// Build the ABI module of a plugin. Leaks one small allocation; call it once per process
/// (the export macro and the built-in registry do).
pub fn module<F: PluginFactory>() -> PluginModRef {
    PluginMod {
        abi_version: abi_version_entry,
        info: info_entry::<F>,
        open: open_entry::<F>,
        check_config: check_config_entry::<F>,
    }
    .leak_into_prefix()
}

/// Export a plugin from a `cdylib` crate: `kvgate_abi::export_plugin!(MyFactory);`.
/// The crate needs `abi_stable` as a direct dependency (the attribute expands to `::abi_stable` paths).
#[macro_export]
macro_rules! export_plugin {
    ($factory:ty) => {
        #[::abi_stable::export_root_module]
        pub fn kvgate_plugin_root_module() -> $crate::PluginModRef {
            $crate::sdk::module::<$factory>()
        }
    };
}
