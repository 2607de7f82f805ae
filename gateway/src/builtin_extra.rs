//! Built-in plugins beyond shm that this build links: QUIC (pure Rust, works on any IP network).
//! UCX and NVLink need system libraries or a GPU and are loaded from their `.so` instead.

use kvgate_host::PluginHost;

pub fn register(host: &mut PluginHost) {
    if let Err(e) = host.register_builtin("quic", kvgate_plugin_quic::module()) {
        tracing::error!("built-in quic plugin refused: {e}");
    }
}
