//! The `Core` state machine: rooms in a slab, keys in a fast hash, deadlines in one timer wheel.
//! Inputs are `handle_*(now, ..)`, outputs `poll_command()` / `poll_timeout()`; it never does IO.

use crate::api::*;
use crate::config::{ConfigError, CoreConfig};
use crate::metrics::Metrics;
use kvgate_abi::{Event, PeerId, RemoteKey};

/// One gateway's scheduler. Deterministic: the same inputs give the same outputs.
pub struct Core {
    config: CoreConfig,
    metrics: Metrics,
}

impl Core {
    /// A core with `config` (validated).
    pub fn new(config: CoreConfig) -> Result<Core, ConfigError> {
        config.validate()?;
        Ok(Core { config, metrics: Metrics::default() })
    }
    pub fn config(&self) -> &CoreConfig {
        &self.config
    }
    /// An engine's expect, send or abort. A refusal changes nothing.
    pub fn handle_engine(&mut self, now: Nanos, request: EngineRequest) -> Result<(), Refusal> {
        let _ = (now, request);
        todo!()
    }
    /// A local region, registered by the driver with the plugins named in `info.keys`.
    pub fn handle_region_registered(&mut self, now: Nanos, info: RegionInfo) {
        let _ = (now, info);
        todo!()
    }
    /// A local region is gone; later sends naming it are refused, held chunks naming it fail.
    pub fn handle_region_unregistered(&mut self, now: Nanos, region: RegionId) {
        let _ = (now, region);
        todo!()
    }
    /// A peer's region (its id as the peer numbers it), imported by the driver into the plugin used
    /// for that peer.
    pub fn handle_remote_region(&mut self, now: Nanos, peer: PeerId, region: RegionId, len: u64, key: RemoteKey) {
        let _ = (now, peer, region, len, key);
        todo!()
    }
    /// The peer link is up; `plugin` is the plugin instance used with this peer. A new incarnation
    /// of a known peer is handled as lost + up.
    pub fn handle_peer_up(&mut self, now: Nanos, peer: PeerId, incarnation: u64, plugin: PluginSlot) {
        let _ = (now, peer, incarnation, plugin);
        todo!()
    }
    /// The peer link is lost: every room bound to `peer` fails at once (`peer_lost`).
    pub fn handle_peer_lost(&mut self, now: Nanos, peer: PeerId, cause: PeerLoss) {
        let _ = (now, peer, cause);
        todo!()
    }
    /// A message from a peer gateway's core.
    pub fn handle_peer_message(&mut self, now: Nanos, peer: PeerId, message: PeerMessage) {
        let _ = (now, peer, message);
        todo!()
    }
    /// An event a plugin instance delivered to its sink.
    pub fn handle_plugin_event(&mut self, now: Nanos, plugin: PluginSlot, event: &Event) {
        let _ = (now, plugin, event);
        todo!()
    }
    /// Fire every timer due at `now`.
    pub fn handle_timeout(&mut self, now: Nanos) {
        let _ = now;
        todo!()
    }
    /// The next command for the driver, in order.
    pub fn poll_command(&mut self) -> Option<Command> {
        todo!()
    }
    /// When the core next needs `handle_timeout` (None: no timer armed).
    pub fn poll_timeout(&self) -> Option<Nanos> {
        todo!()
    }
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }
    /// The admin view of one room (ages computed at `now`).
    pub fn room(&self, now: Nanos, room: RoomKey, role: Role) -> Option<RoomView> {
        let _ = (now, room, role);
        todo!()
    }
    /// Every room the core holds (live, quarantined and tombstoned), in no particular order.
    pub fn rooms(&self, now: Nanos) -> impl Iterator<Item = RoomView> + '_ {
        let _ = now;
        std::iter::empty()
    }
}
