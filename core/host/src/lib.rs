//! kvgate-host: loads plugins (built-in modules and `.so` libraries through the stable ABI), checks
//! their ABI, opens instances and picks one per peer. The gateway and the conformance harness share it.
//! It never decides a room's fate and never depends on a plugin crate.

pub mod artifacts;
pub mod error;
pub mod host;
pub mod library;
pub mod opened;

pub use error::{LoadError, OpenError, PluginOrigin, SkipReason};
pub use host::{PluginHost, PluginListing};
pub use library::MAX_ABI_ERROR_LINES;
pub use opened::OpenedPlugin;
