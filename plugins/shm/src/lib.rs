//! kvgate-plugin-shm: the same-host reference transport. Regions are host memory backed by a shared
//! file; the sender maps the receiver's file and copies with a bounded pool of worker threads.
//! It never trusts a peer's key (checked against the peer's nonce and the file's size) and never
//! reports success before every byte is copied.
//!
//! Config (TOML, every key optional, unknown keys refused): see [`ShmConfig`].
//! Built in with [`module()`]; exported as a cdylib by the `kvgate-plugin-shm-so` crate.

pub mod config;
pub mod mapping;
pub mod plan;
pub mod plugin;
pub mod state;
pub mod stream_copy;
pub mod wire;
pub mod workers;

pub use config::ShmConfig;
pub use mapping::SharedRegion;
pub use plugin::{plugin_info, ShmPlugin, PLUGIN_NAME};

use kvgate_abi::sdk::{PluginFactory, Sink};
use kvgate_abi::{PluginError, PluginInfo, PluginModRef};

/// Opens [`ShmPlugin`] instances for the SDK.
pub struct ShmFactory;

impl PluginFactory for ShmFactory {
    type Plugin = ShmPlugin;
    fn info() -> PluginInfo {
        plugin_info(&ShmConfig::default())
    }
    fn open(config: &str, sink: Sink) -> Result<ShmPlugin, PluginError> {
        ShmPlugin::open(config, sink)
    }
    fn check_config(config: &str) -> Result<(), PluginError> {
        ShmConfig::parse(config).map(|_| ())
    }
}

/// The plugin's ABI module, for built-in registration (`host.register_builtin("shm", module())`).
/// Built once per process and shared by every caller.
pub fn module() -> PluginModRef {
    static MODULE: std::sync::OnceLock<PluginModRef> = std::sync::OnceLock::new();
    *MODULE.get_or_init(kvgate_abi::sdk::module::<ShmFactory>)
}
