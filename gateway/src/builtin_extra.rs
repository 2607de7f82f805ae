//! Built-in plugins beyond shm that this build links: QUIC (pure Rust, works on any IP network).
//! UCX and NVLink need system libraries or a GPU and are loaded from their `.so` instead: neither is
//! in this crate's dependency graph (`cargo tree -p kvgate-gateway -e normal`; the `kvgate` binary
//! links them only into `kvgate conformance`, through the harness's `ucx` and `nvlink` features).

use kvgate_abi::PluginModRef;
use kvgate_host::PluginHost;

pub fn register(host: &mut PluginHost) {
    for (name, module) in modules() {
        if let Err(e) = host.register_builtin(name, module) {
            tracing::error!("built-in {name} plugin refused: {e}");
        }
    }
}

/// The extra built-in modules, built once per process (each build leaks one small allocation).
pub fn modules() -> Vec<(&'static str, PluginModRef)> {
    static MODULES: std::sync::OnceLock<Vec<(&'static str, PluginModRef)>> = std::sync::OnceLock::new();
    MODULES.get_or_init(|| vec![("quic", kvgate_plugin_quic::module())]).clone()
}
