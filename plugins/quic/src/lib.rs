//! kvgate-plugin-quic: kvgate's transport for any IP network, on quinn (QUIC) with rustls.
//! Peers authenticate each other by pinned certificate fingerprints (exchanged by the gateways), and
//! every incoming write is checked by the receiver against its regions and the ticket it expects.
//!
//! Built in through [`module`]; loadable as `libkvgate_quic.so` (crate `kvgate-plugin-quic-so`).
//! Configuration keys: see [`QuicConfig`]. Wire format: see [`wire`].

mod allocator;
pub mod config;
mod deadlines;
pub mod incoming;
mod lanes;
mod net;
pub mod outgoing;
mod packet_crypto;
mod peers;
mod plugin;
pub mod reader;
pub mod regions;
pub mod replies;
mod server;
mod shared;
pub mod staging;
mod stuck;
pub mod tickets;
pub mod tls;
mod transfers;
pub mod wire;

pub use config::{CipherSuite, CongestionController, QuicConfig};
pub use plugin::QuicPlugin;

use kvgate_abi::sdk::{PluginFactory, Sink};
use kvgate_abi::{PluginError, PluginInfo, PluginModRef};

/// Opens [`QuicPlugin`] instances from a TOML config string.
pub struct QuicFactory;

impl PluginFactory for QuicFactory {
    type Plugin = QuicPlugin;
    fn info() -> PluginInfo {
        plugin::plugin_info(&QuicConfig::default())
    }
    fn open(config: &str, sink: Sink) -> Result<QuicPlugin, PluginError> {
        QuicPlugin::open(QuicConfig::parse(config)?, sink)
    }
    fn check_config(config: &str) -> Result<(), PluginError> {
        QuicConfig::parse(config).map(|_| ())
    }
}

/// The ABI module of the built-in plugin (`builtin:quic`). Call once per process.
pub fn module() -> PluginModRef {
    kvgate_abi::sdk::module::<QuicFactory>()
}
