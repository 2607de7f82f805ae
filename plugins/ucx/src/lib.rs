//! kvgate-plugin-ucx: the kvgate transport over UCX (RDMA verbs, TCP, shared memory) through the
//! system libucp and our own bindings (`kvgate-ucx-sys`). Owns one UCP context, worker and progress
//! thread per instance; never lets a call wait on the network or a panic cross the ABI (the SDK).
//!
//! - [`config`]: the TOML settings (`tls`, `devices`, `rndv_thresh`, `mode`, limits);
//! - [`ucp`]: the small safe wrapper over UCP; [`wire`]: bytes exchanged with peers;
//! - [`shared`]: books shared by the API threads and the progress thread; [`engine`]: that thread;
//! - [`receiver`]: the receiver side of the active-message protocol; [`plugin`]: the `Plugin` face;
//! - [`fast_map`]: seeded fast hash maps for the per-message books; [`token_slab`]: books found by
//!   the token a UCX completion hands back; [`vec_pool`]: spare vectors reused on the hot path;
//! - [`ucx_log`]: UCX's log lines go to `tracing`, never to the host's stdout.

#![deny(clippy::undocumented_unsafe_blocks)]

pub mod config;
pub mod engine;
pub mod fast_map;
pub mod plugin;
pub mod receiver;
pub mod shared;
pub mod token_slab;
pub mod ucp;
pub mod ucx_log;
pub mod vec_pool;
pub mod wire;

pub use config::{ResolvedMode, TransferMode, UcxConfig};
pub use plugin::{UcxFactory, UcxPlugin};

/// The plugin's ABI module, for registration as a built-in (`PluginHost::register_builtin("ucx", module())`).
/// Builds a fresh module each call (one small leaked allocation); call it once per process.
pub fn module() -> kvgate_abi::PluginModRef {
    kvgate_abi::sdk::module::<UcxFactory>()
}
