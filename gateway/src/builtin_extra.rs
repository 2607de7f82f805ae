//! Built-in plugins beyond shm that this build links (QUIC once its crate exports `module()`).
//! Never registers a plugin that cannot be built here.

use kvgate_host::PluginHost;

pub fn register(host: &mut PluginHost) {
    let _ = host;
}
