//! Which local plugin instance talks to which of a peer's, per peer session, across plugin reloads.
//! For each plugin both sides have open, the local instance (the active one, else the newest
//! draining one) is paired with the peer's (its current one, else its newest retiring one), and
//! pairs where both are current are offered to the core first. A connection, once made, stays until
//! either instance goes away, so rooms finish on the pair they started on.
//!
//! A plugin addresses a peer's instance by a plugin peer id: the session id for the first instance
//! of each plugin the session met, a fresh id from `VIRTUAL_PEER_BASE` up for later ones. The driver
//! translates between the two: a submit goes to the id its destination key was imported under, a
//! ticket is opened for the id of the instance's partner, and events naming a plugin peer id are
//! fed to the core under the session.

use super::instances::plugin_of;
use super::Driver;
use crate::channels::SessionId;
use crate::peer_link::dials;
use kvgate_abi::{
    abi_stable::std_types::{RResult, RSlice},
    scope, PeerId,
};
use kvgate_client::proto::{self, peer_frame::Frame};
use kvgate_core::{PeerPlugin, PluginSlot};

/// Plugin peer ids of later instances start here (session ids count up from 1, far below).
pub const VIRTUAL_PEER_BASE: u64 = 1 << 62;

/// One decided pair: local slot, the peer's instance (wire name, endpoint), both current.
struct Pair {
    slot: PluginSlot,
    remote: String,
    endpoint: Vec<u8>,
    both_current: bool,
}

impl Driver {
    /// The local instance of plugin `name` to pair with a peer: the active one if it is usable,
    /// else the newest usable draining one.
    fn local_instance_of(&self, name: &str, same_host: bool) -> Option<PluginSlot> {
        let usable = |slot: usize| {
            let plugin = &self.plugins[slot];
            let caps = plugin.capabilities();
            let needed = if same_host { scope::SAME_HOST } else { scope::CROSS_HOST };
            plugin.name() == name
                && self.instances[slot].is_open()
                && caps.scope & needed != 0
                && plugin.transport().stats().healthy != 0
        };
        let slots = 0..self.plugins.len();
        slots
            .clone()
            .rev()
            .find(|&s| usable(s) && self.instances[s].is_active())
            .or_else(|| slots.rev().find(|&s| usable(s)))
            .map(|s| PluginSlot(s as u32))
    }

    /// The order plugins are tried in with this peer: the dialler's preference, then the plugins
    /// only draining instances still offer.
    fn pairing_order(&self, peer_name: &str, remote: &[proto::PluginEndpoint]) -> Vec<String> {
        let local: Vec<String> = {
            let mut names = self.config.plugins.preference.clone();
            for (slot, plugin) in self.plugins.iter().enumerate() {
                if self.instances[slot].is_open() && !names.iter().any(|n| n == plugin.name()) {
                    names.push(plugin.name().to_string());
                }
            }
            names
        };
        let mut theirs: Vec<String> = Vec::new();
        for endpoint in remote {
            let name = plugin_of(&endpoint.plugin).to_string();
            if !theirs.contains(&name) {
                theirs.push(name);
            }
        }
        let order = if dials(&self.config.gateway.name, peer_name) { local.clone() } else { theirs.clone() };
        order.into_iter().filter(|n| theirs.contains(n) && local.contains(n)).collect()
    }

    /// (Re)pair session `session` with the peer instances it advertised last. Connects the pairs
    /// not yet connected; returns the offered plugins (preference order, pairs of current instances
    /// first) and the connected slots that are no longer offered.
    pub(super) fn pair_session(&mut self, session: SessionId) -> (Vec<PeerPlugin>, Vec<PluginSlot>) {
        let Some(state) = self.peers.by_session.get(&session) else { return (Vec::new(), Vec::new()) };
        let same_host = self.directory.entry(&state.name).is_some_and(|p| p.same_host);
        let mut pairs = Vec::new();
        for name in self.pairing_order(&state.name, &state.remote) {
            let Some(slot) = self.local_instance_of(&name, same_host) else { continue };
            let of_name = || state.remote.iter().filter(|e| plugin_of(&e.plugin) == name);
            let Some(remote) = of_name().find(|e| !e.retiring).or_else(|| of_name().next_back()) else { continue };
            let both_current = self.instances[slot.0 as usize].is_active() && !remote.retiring;
            pairs.push(Pair { slot, remote: remote.plugin.clone(), endpoint: remote.endpoint.clone(), both_current });
        }
        pairs.sort_by_key(|p| !p.both_current);
        let mut offered = Vec::new();
        for pair in pairs {
            let id = self.plugin_peer_id(session, &pair.remote);
            let Some(state) = self.peers.by_session.get_mut(&session) else { break };
            if !state.links.contains(&(pair.slot, pair.remote.clone())) {
                let plugin = &self.plugins[pair.slot.0 as usize];
                match plugin.transport().connect(id, RSlice::from_slice(&pair.endpoint)) {
                    RResult::ROk(()) => {
                        state.links.insert((pair.slot, pair.remote.clone()));
                    }
                    RResult::RErr(e) => {
                        tracing::error!(peer = %state.name, plugin = %self.instances[pair.slot.0 as usize].wire_name, remote = %pair.remote, "plugin connect failed: {e}");
                        continue;
                    }
                }
            }
            state.partner.insert(pair.slot, pair.remote);
            offered.push(PeerPlugin {
                slot: pair.slot,
                memory_kinds: self.plugins[pair.slot.0 as usize].capabilities().memory_kinds,
            });
        }
        let Some(state) = self.peers.by_session.get_mut(&session) else { return (offered, Vec::new()) };
        let mut retired: Vec<PluginSlot> =
            state.links.iter().map(|(slot, _)| *slot).filter(|s| !offered.iter().any(|p| p.slot == *s)).collect();
        retired.sort();
        retired.dedup();
        state.plugins = offered.iter().map(|p| p.slot).collect();
        state.refresh_partner_names(self.plugins.len());
        (offered, retired)
    }

    /// The plugin peer id of the peer's instance `remote` in `session` (allocated on first use).
    fn plugin_peer_id(&mut self, session: SessionId, remote: &str) -> PeerId {
        let Some(state) = self.peers.by_session.get_mut(&session) else { return PeerId(session) };
        if let Some(id) = state.remote_ids.get(remote) {
            return *id;
        }
        let first_of_plugin = !state.remote_ids.keys().any(|r| plugin_of(r) == plugin_of(remote));
        let id = if first_of_plugin {
            PeerId(session)
        } else {
            self.next_plugin_peer_id += 1;
            state.virtual_ids = true;
            PeerId(VIRTUAL_PEER_BASE + self.next_plugin_peer_id)
        };
        state.remote_ids.insert(remote.to_string(), id);
        self.plugin_peer_sessions.insert(id.0, session);
        id
    }

    /// The session behind a plugin peer id (the id itself for a session id).
    pub(super) fn session_of_plugin_peer(&self, id: PeerId) -> PeerId {
        match self.plugin_peer_sessions.get(&id.0) {
            Some(session) => PeerId(*session),
            None => id,
        }
    }

    /// Whether a plugin peer id names a peer instance that is retiring or gone (its link going
    /// down is expected once the peer closes it and fails no room).
    pub(super) fn plugin_peer_is_leaving(&self, id: PeerId) -> bool {
        let Some(session) =
            self.plugin_peer_sessions.get(&id.0).copied().or((id.0 < VIRTUAL_PEER_BASE).then_some(id.0))
        else {
            return false;
        };
        let Some(state) = self.peers.by_session.get(&session) else { return false };
        // A session id names the first instance of each plugin: leaving only if every instance it
        // can name is.
        let named: Vec<&String> = state.remote_ids.iter().filter(|(_, v)| **v == id).map(|(k, _)| k).collect();
        !named.is_empty()
            && named.iter().all(|wire| state.remote.iter().find(|e| &e.plugin == *wire).is_none_or(|e| e.retiring))
    }

    /// Import the keys of the peer's regions, as announced last, into `slots` (each from its
    /// partner's key). Returns how many keys were imported.
    pub(super) fn import_announced(&mut self, session: SessionId, slots: &[PluginSlot]) -> usize {
        let Some(state) = self.peers.by_session.get(&session) else { return 0 };
        let announces: Vec<proto::RegionAnnounce> = state.announces.values().cloned().collect();
        announces.iter().map(|a| self.import_region(session, a, slots)).sum()
    }

    /// Import one announced region into `slots`, each from the key of the peer instance it is
    /// paired with. A key already imported from the same instance is kept; another replaces it for
    /// new rooms, the old one staying imported (rooms may still use it) until the session ends.
    pub(super) fn import_region(
        &mut self,
        session: SessionId,
        announce: &proto::RegionAnnounce,
        slots: &[PluginSlot],
    ) -> usize {
        let now = self.now();
        let peer = PeerId(session);
        let mut imported = 0;
        for &slot in slots {
            let Some(state) = self.peers.by_session.get_mut(&session) else { return imported };
            let Some(partner) = state.partner.get(&slot).cloned() else { continue };
            let Some(key) = announce.keys.iter().find(|k| k.plugin == partner) else { continue };
            let Some(&id) = state.remote_ids.get(&partner) else { continue };
            // The same key from the same instance again (every plugin change re-announces every
            // region): keep the imported one, which rooms may be using.
            let source = (partner.clone(), key.key.clone());
            if state.key_source.get(&(announce.region, slot)) == Some(&source)
                && state.remote_keys.contains_key(&(announce.region, slot))
            {
                continue;
            }
            let plugin = &self.plugins[slot.0 as usize];
            match plugin.transport().import_remote_key(id, RSlice::from_slice(&key.key)) {
                RResult::ROk(remote) => {
                    state.key_source.insert((announce.region, slot), source);
                    // A replaced key stays imported (rooms may still use it) until the session ends.
                    if let Some(old) = state.remote_keys.insert((announce.region, slot), remote) {
                        state.superseded_keys.push((slot, old));
                    }
                    state.key_routes.insert((slot, remote), id);
                    self.core.handle_remote_region_key(
                        now,
                        peer,
                        kvgate_core::RegionId(announce.region),
                        announce.len,
                        slot,
                        remote,
                    );
                    imported += 1;
                }
                RResult::RErr(e) => {
                    tracing::error!(peer = %state.name, region = announce.region, plugin = %self.instances[slot.0 as usize].wire_name, "import of a peer region failed: {e}")
                }
            }
        }
        imported
    }

    /// This gateway's open instances as a Hello or `PluginsChanged` lists them: active ones in
    /// preference order, then draining ones.
    pub(super) fn advertised_plugins(&self) -> Vec<proto::PluginEndpoint> {
        let endpoint = |slot: usize, retiring: bool| proto::PluginEndpoint {
            plugin: self.instances[slot].wire_name.clone(),
            endpoint: self.plugins[slot].transport().local_endpoint().to_vec(),
            retiring,
        };
        let mut list = Vec::new();
        for name in &self.config.plugins.preference {
            list.extend(
                (0..self.plugins.len())
                    .filter(|&s| self.instances[s].is_active() && self.plugins[s].name() == name)
                    .map(|s| endpoint(s, false)),
            );
        }
        list.extend(
            (0..self.plugins.len())
                .filter(|&s| matches!(self.instances[s].state, super::instances::InstanceState::Draining { .. }))
                .map(|s| endpoint(s, true)),
        );
        list
    }

    /// Tell `session`'s peer the instances this gateway has open now (and which of its changes
    /// were applied here).
    pub(super) fn send_plugins_changed(&mut self, session: SessionId) {
        let Some(ack) = self.peers.by_session.get(&session).map(|s| s.peer_change_seq) else { return };
        let update = proto::PluginsChanged { plugins: self.advertised_plugins(), seq: self.plugin_change_seq, ack };
        if let Some(state) = self.peers.by_session.get_mut(&session) {
            // After the core messages gathered for this session, so a notice is never overtaken.
            state.send_frame(Frame::PluginsChanged(update), &self.metrics);
        }
    }

    /// The peer's instances changed: drop the connections to instances it closed, pair again,
    /// import its keys into re-paired instances, and acknowledge a change not seen before.
    pub(super) fn on_plugins_changed(&mut self, session: SessionId, update: proto::PluginsChanged) {
        let Some(state) = self.peers.by_session.get_mut(&session) else { return };
        let new_change = update.seq > state.peer_change_seq;
        state.peer_change_seq = state.peer_change_seq.max(update.seq);
        state.acked_change_seq = state.acked_change_seq.max(update.ack);
        state.remote = update.plugins;
        let gone: Vec<(PluginSlot, String)> =
            state.links.iter().filter(|(_, wire)| !state.remote.iter().any(|e| &e.plugin == wire)).cloned().collect();
        for (slot, wire) in &gone {
            state.links.remove(&(*slot, wire.clone()));
            if state.partner.get(slot) == Some(wire) {
                state.partner.remove(slot);
            }
            if let Some(&id) = state.remote_ids.get(wire) {
                let transport = self.plugins[slot.0 as usize].transport();
                transport.disconnect(id);
                // Keys from that instance that re-pairing replaced: no room can use them any more
                // (the peer closed the instance once the rooms bound to it ended).
                let routes = &mut state.key_routes;
                state.superseded_keys.retain(|(s, key)| {
                    if s != slot || routes.get(&(*s, *key)) != Some(&id) {
                        return true;
                    }
                    routes.remove(&(*s, *key));
                    transport.release_remote_key(*key);
                    false
                });
            }
            tracing::info!(peer = %state.name, plugin = %self.instances[slot.0 as usize].wire_name, remote = %wire, "the peer closed a plugin instance: connection dropped");
        }
        state.refresh_partner_names(self.plugins.len());
        self.repair_session(session);
        if new_change {
            self.send_plugins_changed(session);
        }
    }
}
