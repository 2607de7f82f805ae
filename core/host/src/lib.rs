//! kvgate-host: loads plugins (built-in modules and `.so` libraries through the stable ABI), checks
//! their ABI, opens instances and picks one per peer. The gateway and the conformance harness share it.
//! It never decides a room's fate and never depends on a plugin crate.
//!
//! ```text
//! let mut host = PluginHost::new();
//! host.register_builtin("shm", kvgate_plugin_shm::module())?;      // done by the gateway's `builtin`
//! for result in host.load_all(&config.plugin_paths) {               // every bad plugin is reported
//!     if let Err(e) = result { eprintln!("{e}") }                    // e.code(): machine-readable
//! }
//! let mut opened = Vec::new();                                       // index = plugin slot
//! match host.open("shm", "workers = 2", sink) {
//!     Ok(plugin) => opened.push(plugin),
//!     Err(OpenError::Unavailable { plugin, reason }) => { /* unsupported here, not a failure */ }
//!     Err(e) => return Err(e.into()),
//! }
//! let slot = host.select(&["nvlink", "shm", "quic"], MemoryKind::HOST, same_host, &opened)
//!     .map_err(|skipped| /* Vec<(name, SkipReason)>: say why each was passed over */ skipped)?;
//! opened[slot].transport().submit(request);
//! ```
//!
//! Tests, benches and the conformance harness find the workspace's plugin libraries with
//! [`artifacts::built_or_build_cdylib`] (`cargo test` builds no cdylib by itself).

#![forbid(unsafe_code)]

pub mod artifacts;
pub mod error;
pub mod host;
pub mod library;
pub mod opened;

pub use error::{ConfigCheck, LoadError, OpenError, PluginOrigin, SkipReason};
pub use host::{PluginHost, PluginListing};
pub use library::MAX_ABI_ERROR_LINES;
pub use opened::OpenedPlugin;
