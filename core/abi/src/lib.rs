//! kvgate-abi: the only crate a kvgate plugin depends on.
//!
//! - [`types`]: the plain data of ABI v1 (ids, reason codes, descriptors, events);
//! - [`Transport`] / [`EventSink`]: the FFI-safe trait objects a plugin and its host exchange;
//! - [`PluginMod`]: the root module a plugin library exports;
//! - [`sdk`]: write a plugin in safe Rust with panics caught at every entry;
//! - [`cuda_vmm`]: how a host names a CUDA VMM allocation's descriptor in a `RegionDesc`.
//!
//! How this ABI may evolve is written down in `ABI.md` next to this crate.

pub mod cuda_vmm;
pub mod module;
pub mod sdk;
pub mod transport;
pub mod types;

pub use abi_stable;
pub use module::{PluginMod, PluginModRef};
pub use sdk::{Plugin, PluginFactory, Sink};
pub use transport::{EventSink, EventSinkBox, EventSink_TO, Transport, TransportBox, Transport_TO};
pub use types::*;
