//! Conformance mutant `ucx-tcp-drops-deadlines`: the real UCX plugin, wrapped through the plugin
//! interface, with one defect: `submit` hands UCX an hour instead of the transfer's `timeout_ns` (a
//! deadline lost on its way to the transport). Over a healthy link every transfer still ends; over a
//! black-holed TCP connection (the harness's TCP fault proxy) one never does, which TIME-12 catches.
//! Test code only: it exists to prove the harness catches this defect over TCP, and never ships.

use kvgate_abi::sdk::{Plugin, PluginFactory, Sink};
use kvgate_abi::{
    IncomingRequest, LocalKey, PeerId, PluginError, PluginInfo, RegionDesc, Registration, RemoteKey, Stats,
    SubmitRequest, Ticket, XferId,
};
use kvgate_plugin_ucx::{UcxFactory, UcxPlugin};

/// The deadline every transfer gets instead of its own.
const DROPPED_DEADLINE_NS: u64 = 3_600 * 1_000_000_000;
const NAME: &str = "mutant-ucx-tcp-drops-deadlines";

pub struct Factory;
pub struct Mutant(UcxPlugin);

fn renamed(mut info: PluginInfo) -> PluginInfo {
    info.name = NAME.into();
    info
}

impl PluginFactory for Factory {
    type Plugin = Mutant;
    fn info() -> PluginInfo {
        renamed(UcxFactory::info())
    }
    fn open(config: &str, sink: Sink) -> Result<Mutant, PluginError> {
        UcxFactory::open(config, sink).map(Mutant)
    }
    fn check_config(config: &str) -> Result<(), PluginError> {
        UcxFactory::check_config(config)
    }
}

impl Plugin for Mutant {
    fn info(&self) -> PluginInfo {
        renamed(Plugin::info(&self.0))
    }
    fn local_endpoint(&self) -> Vec<u8> {
        Plugin::local_endpoint(&self.0)
    }
    fn connect(&self, peer: PeerId, endpoint: &[u8]) -> Result<(), PluginError> {
        Plugin::connect(&self.0, peer, endpoint)
    }
    fn disconnect(&self, peer: PeerId) {
        Plugin::disconnect(&self.0, peer)
    }
    fn register(&self, region: &RegionDesc) -> Result<Registration, PluginError> {
        Plugin::register(&self.0, region)
    }
    fn deregister(&self, key: LocalKey) -> Result<(), PluginError> {
        Plugin::deregister(&self.0, key)
    }
    fn import_remote_key(&self, peer: PeerId, bytes: &[u8]) -> Result<RemoteKey, PluginError> {
        Plugin::import_remote_key(&self.0, peer, bytes)
    }
    fn release_remote_key(&self, key: RemoteKey) {
        Plugin::release_remote_key(&self.0, key)
    }
    fn submit(&self, request: &SubmitRequest<'_>) -> Result<(), PluginError> {
        // The defect: the transfer's own deadline never reaches the transport.
        let dropped = SubmitRequest { timeout_ns: DROPPED_DEADLINE_NS, segments: request.segments, ..*request };
        Plugin::submit(&self.0, &dropped)
    }
    fn cancel(&self, xfer: XferId) {
        Plugin::cancel(&self.0, xfer)
    }
    fn expect_incoming(&self, request: &IncomingRequest<'_>) -> Result<(), PluginError> {
        Plugin::expect_incoming(&self.0, request)
    }
    fn cancel_incoming(&self, peer: PeerId, ticket: Ticket) {
        Plugin::cancel_incoming(&self.0, peer, ticket)
    }
    fn stats(&self) -> Stats {
        Plugin::stats(&self.0)
    }
    fn shutdown(&self) {
        Plugin::shutdown(&self.0)
    }
}

kvgate_abi::export_plugin!(Factory);
