//! An opened plugin instance: the transport object shared by every user of it, with the info and
//! capabilities read once at open. Never decides a transfer's fate; it only carries the object.

use crate::error::PluginOrigin;
use kvgate_abi::abi_stable::{
    sabi_trait::TD_Opaque,
    std_types::{RErr, RResult, RSlice, RVec},
};
use kvgate_abi::{
    Capabilities, IncomingRequest, LocalKey, PeerId, PluginError, PluginInfo, ReasonCode, RegionDesc, Registration,
    RemoteKey, Stats, SubmitRequest, Ticket, Transport, TransportBox, Transport_TO, XferId,
};
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

    /// Shut the instance down and let go of its transport object (its threads, sockets and
    /// buffers), keeping name, origin and info: what is left refuses every call. The library stays
    /// mapped. Other clones keep the object until they are dropped.
    pub fn into_closed(self) -> OpenedPlugin {
        self.transport.shutdown();
        let closed = Transport_TO::from_value(ClosedTransport { info: self.info.clone() }, TD_Opaque);
        OpenedPlugin { transport: Arc::new(closed), ..self }
    }
}

/// What remains of a closed instance: refuses every call, reports nothing live and unhealthy.
struct ClosedTransport {
    info: PluginInfo,
}

fn closed() -> PluginError {
    PluginError::new(ReasonCode::UNAVAILABLE, "this plugin instance is closed")
}

impl Transport for ClosedTransport {
    fn info(&self) -> PluginInfo {
        self.info.clone()
    }
    fn local_endpoint(&self) -> RVec<u8> {
        RVec::new()
    }
    fn connect(&self, _peer: PeerId, _endpoint: RSlice<'_, u8>) -> RResult<(), PluginError> {
        RErr(closed())
    }
    fn disconnect(&self, _peer: PeerId) {}
    fn register(&self, _region: &RegionDesc) -> RResult<Registration, PluginError> {
        RErr(closed())
    }
    fn deregister(&self, _key: LocalKey) -> RResult<(), PluginError> {
        RErr(closed())
    }
    fn import_remote_key(&self, _peer: PeerId, _bytes: RSlice<'_, u8>) -> RResult<RemoteKey, PluginError> {
        RErr(closed())
    }
    fn release_remote_key(&self, _key: RemoteKey) {}
    fn submit(&self, _request: SubmitRequest<'_>) -> RResult<(), PluginError> {
        RErr(closed())
    }
    fn cancel(&self, _xfer: XferId) {}
    fn expect_incoming(&self, _request: IncomingRequest<'_>) -> RResult<(), PluginError> {
        RErr(closed())
    }
    fn cancel_incoming(&self, _peer: PeerId, _ticket: Ticket) {}
    fn stats(&self) -> Stats {
        Stats::default()
    }
    fn shutdown(&self) {}
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
