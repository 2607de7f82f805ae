//! An opened plugin instance: the transport object shared by every user of it, with the info and
//! capabilities read once at open. Never decides a transfer's fate; it only carries the object.

use crate::error::PluginOrigin;
use kvgate_abi::{Capabilities, PluginInfo, TransportBox};
use std::fmt;
use std::sync::Arc;

/// One open instance of a plugin. Cheap to clone (the transport is `Arc`-shared, `Send + Sync`).
///
/// Dropping the last clone drops the instance; call [`OpenedPlugin::shutdown`] first to fail live
/// transfers and join the plugin's workers at a point of your choosing.
#[derive(Clone)]
pub struct OpenedPlugin {
    name: String,
    origin: PluginOrigin,
    info: PluginInfo,
    transport: Arc<TransportBox>,
}

impl OpenedPlugin {
    pub(crate) fn new(name: String, origin: PluginOrigin, info: PluginInfo, transport: TransportBox) -> Self {
        OpenedPlugin { name, origin, info, transport: Arc::new(transport) }
    }
    /// The plugin's registered name.
    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn origin(&self) -> &PluginOrigin {
        &self.origin
    }
    /// The instance's info, read once right after `open`.
    pub fn info(&self) -> &PluginInfo {
        &self.info
    }
    pub fn capabilities(&self) -> &Capabilities {
        &self.info.capabilities
    }
    /// The transport object (call its methods directly: `opened.transport().submit(..)`).
    pub fn transport(&self) -> &TransportBox {
        &self.transport
    }
    /// A shared handle on the transport object, for threads and tasks.
    pub fn transport_arc(&self) -> Arc<TransportBox> {
        Arc::clone(&self.transport)
    }
    /// Fail every live transfer, join the plugin's workers, release registrations.
    pub fn shutdown(&self) {
        self.transport.shutdown()
    }
}

impl fmt::Debug for OpenedPlugin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpenedPlugin")
            .field("name", &self.name)
            .field("origin", &self.origin)
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}
