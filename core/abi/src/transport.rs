#![allow(non_local_definitions)] // emitted by #[sabi_trait]; harmless, see abi_stable 0.11 docs
//! The two FFI-safe trait objects of ABI v1: the transport a plugin implements and the event sink
//! a host implements. Methods are only ever appended after `last_prefix_field` (see `ABI.md`).
//! No future, clock or runtime crosses here: every call returns promptly and never waits on the
//! network; outcomes arrive later through the sink.

use crate::types::*;
use abi_stable::{
    sabi_trait,
    std_types::{RBox, RResult, RSlice, RVec},
};

/// A memory-to-memory write engine, opened by [`crate::PluginMod::open`].
///
/// Rules every implementation follows (clause ids from `CONFORMANCE.md`):
/// - every submitted transfer gets exactly one terminal event (`SUCCEEDED` or `FAILED`);
/// - `SUCCEEDED` only once every byte is visible at the destination;
/// - after `FAILED`, a `QUIESCED` (or the `QUIESCED` flag on the failure) once no byte can land;
/// - `cancel` of any id, in any state, is harmless and prompt;
/// - no call blocks on the network, no panic escapes (the SDK guarantees the latter).
#[sabi_trait]
pub trait Transport: Send + Sync {
    /// Name, version, ABI version and capabilities of this instance.
    fn info(&self) -> PluginInfo;
    /// Bytes a peer passes to its own `connect` to reach this instance.
    fn local_endpoint(&self) -> RVec<u8>;
    /// Learn how to reach `peer`. Does not wait for the network: failures surface as events.
    fn connect(&self, peer: PeerId, endpoint: RSlice<'_, u8>) -> RResult<(), PluginError>;
    /// Forget `peer`: its live transfers fail with `PEER_LOST`.
    fn disconnect(&self, peer: PeerId);
    /// Make a region usable as a source or destination. Refuses kinds it cannot serve.
    fn register(&self, region: &RegionDesc) -> RResult<Registration, PluginError>;
    /// Release a registration. Transfers still using it fail.
    fn deregister(&self, key: LocalKey) -> RResult<(), PluginError>;
    /// Import a peer's remote-key bytes.
    fn import_remote_key(&self, peer: PeerId, bytes: RSlice<'_, u8>) -> RResult<RemoteKey, PluginError>;
    /// Drop an imported remote key.
    fn release_remote_key(&self, key: RemoteKey);
    /// Start an outgoing transfer. An `Err` means nothing was started and no event will follow.
    fn submit(&self, request: SubmitRequest<'_>) -> RResult<(), PluginError>;
    /// Stop an outgoing transfer. Unknown or finished ids are ignored.
    fn cancel(&self, xfer: XferId);
    /// Receiver side: authorise incoming writes under a ticket.
    fn expect_incoming(&self, request: IncomingRequest<'_>) -> RResult<(), PluginError>;
    /// Receiver side: revoke a ticket; `QUIESCED` (incoming) once no write under it can land.
    fn cancel_incoming(&self, peer: PeerId, ticket: Ticket);
    /// Live resources.
    fn stats(&self) -> Stats;
    /// Fail every live transfer, join workers, release registrations, then return.
    #[sabi(last_prefix_field)]
    fn shutdown(&self);
}

/// A transport object owned by the host.
pub type TransportBox = Transport_TO<'static, RBox<()>>;

/// Where a plugin sends its events. Callable from any plugin thread; never blocks for long.
#[sabi_trait]
pub trait EventSink: Send + Sync {
    #[sabi(last_prefix_field)]
    fn deliver(&self, event: Event);
}

/// An event sink owned by the plugin (handed over at `open`).
pub type EventSinkBox = EventSink_TO<'static, RBox<()>>;
