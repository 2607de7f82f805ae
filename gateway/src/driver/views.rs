//! Read-only views the driver hands out: rooms for the engine API (`RoomInfo`) and for `/rooms`
//! (JSON), plugin and peer status, health, and the metrics snapshot `/metrics` renders. Never
//! changes driver state.

use super::peers::Peers;
use super::Driver;
use crate::channels::{AdminSnapshot, PeerStatus, PluginStatus, RoomJson};
use kvgate_client::proto;
use kvgate_core::{RoomState, RoomView, Span};
use kvgate_host::OpenedPlugin;

pub fn peer_name(peers: &Peers, view: &RoomView) -> String {
    view.peer.and_then(|p| peers.name_of(p)).map(str::to_string).unwrap_or_default()
}

pub fn plugin_name(plugins: &[OpenedPlugin], view: &RoomView) -> String {
    view.plugin.and_then(|s| plugins.get(s.0 as usize)).map(|p| p.name().to_string()).unwrap_or_default()
}

pub fn room_info(view: &RoomView, peers: &Peers, plugins: &[OpenedPlugin]) -> proto::RoomInfo {
    proto::RoomInfo {
        key: Some(proto::RoomKey { room: view.room.room, generation: view.room.generation }),
        state: view.state.as_str().into(),
        role: view.role.as_str().into(),
        peer: peer_name(peers, view),
        plugin: plugin_name(plugins, view),
        age_ms: view.age.as_ms(),
        bytes_total: view.bytes_total,
        bytes_done: view.bytes_done,
        reason: view.failure.map(|f| f.reason.as_str().to_string()).unwrap_or_default(),
        phase: view.failure.map(|f| f.phase.as_str().to_string()).unwrap_or_default(),
        reusable: matches!(view.state, kvgate_core::RoomState::Succeeded | kvgate_core::RoomState::Failed),
        last_event: format!("{:?}", view.last_event),
    }
}

impl Driver {
    pub(super) fn snapshot(&self) -> AdminSnapshot {
        let now = self.now();
        let mut problems = Vec::new();
        let mut rooms = Vec::new();
        for view in self.core.rooms(now) {
            if view.state.is_terminal() {
                continue;
            }
            if let Some(deadline) = view.next_deadline {
                // A room past its own next deadline by more than the plugin grace is overdue.
                let grace = Span::from_ms(self.config.scheduler.plugin_grace_ms + super::HOUSEKEEPING_INTERVAL_MS);
                if now > deadline.saturating_add(grace) {
                    problems.push(format!(
                        "room {} ({}) outlived its deadline by {} ms",
                        view.room,
                        view.role.as_str(),
                        now.saturating_since(deadline).as_ms()
                    ));
                }
            }
            rooms.push(RoomJson {
                room: view.room.room,
                generation: view.room.generation,
                role: view.role.as_str(),
                state: view.state.as_str(),
                age_ms: view.age.as_ms(),
                peer: peer_name(&self.peers, &view),
                plugin: view.plugin.map(|slot| self.plugin_name(slot).to_string()).unwrap_or_default(),
                plugin_generation: view
                    .plugin
                    .and_then(|slot| self.instances.get(slot.0 as usize))
                    .map_or(0, |i| i.generation),
                last_event: format!("{:?}", view.last_event),
                last_event_age_ms: view.last_event_age.as_ms(),
                parts: view.parts,
                parts_done: view.parts_done,
                bytes_total: view.bytes_total,
                bytes_done: view.bytes_done,
            });
        }
        let mut plugins = self.instance_statuses();
        for (slot, unhealthy) in self.plugin_unhealthy.iter().enumerate() {
            if let (Some(reason), Some(instance)) = (unhealthy, self.instances.get(slot)) {
                if !instance.is_open() {
                    continue;
                }
                let supervision = match self.restart_given_up.get(&slot) {
                    Some(why) => format!("; {why}"),
                    None if self.pending_restarts.iter().any(|(_, s)| *s == slot) => {
                        "; restarting after its back-off".to_string()
                    }
                    None => String::new(),
                };
                problems.push(format!("plugin {} unhealthy: {reason}{supervision}", instance.wire_name));
                if let Some(p) = plugins.iter_mut().find(|p| p.wire_name == instance.wire_name) {
                    p.status = "unhealthy".into();
                    p.reason = reason.clone();
                }
            }
        }
        let metrics = self.core.metrics().clone();
        let quarantined = RoomState::Quarantined.index();
        if let Some(entered) = metrics.oldest_entered_by_state[quarantined] {
            let (age_ms, limit_ms) = (now.saturating_since(entered).as_ms(), self.config.admin.quarantine_unhealthy_ms);
            if age_ms > limit_ms {
                problems.push(format!(
                    "{} room(s) quarantined, the oldest for {age_ms} ms (admin.quarantine_unhealthy_ms = {limit_ms}): no word yet that nothing can land in their memory",
                    metrics.rooms_by_state[quarantined]
                ));
            }
        }
        let peers: Vec<PeerStatus> = self
            .directory
            .list()
            .into_iter()
            .map(|(name, entry, source)| PeerStatus {
                up: self.peers.is_up(&name),
                address: entry.map(|e| e.address).unwrap_or_default(),
                name,
                source: source.as_str(),
            })
            .collect();
        let mut warnings = Vec::new();
        if !peers.is_empty() && peers.iter().all(|p| !p.up) {
            let names: Vec<&str> = peers.iter().map(|p| p.name.as_str()).collect();
            warnings.push(format!("no configured peer is up ({}): no room can move", names.join(", ")));
        }
        let peer_link_auth = self.config.peer_link.auth_mode().as_str();
        let last_reload = self.last_reload.clone();
        AdminSnapshot { now, metrics, rooms, plugins, peers, peer_link_auth, problems, warnings, last_reload }
    }

    /// One line per plugin instance (every generation, closed ones included), then the plugins
    /// known at start that have no instance (not loaded, unavailable, not preferred).
    fn instance_statuses(&self) -> Vec<PluginStatus> {
        let mut lines: Vec<PluginStatus> = self
            .plugins
            .iter()
            .zip(&self.instances)
            .map(|(plugin, instance)| {
                let mut line = crate::plugin_setup::status_of(
                    plugin.info(),
                    plugin.name(),
                    instance.origin.clone(),
                    "opened",
                    instance.closed_reason.clone(),
                );
                line.generation = instance.generation;
                line.wire_name = instance.wire_name.clone();
                line.state = instance.state.as_str().to_string();
                line
            })
            .collect();
        lines.extend(
            self.plugin_listing
                .iter()
                .filter(|l| l.status != "opened" && !self.plugins.iter().any(|p| p.name() == l.name))
                .cloned(),
        );
        lines
    }
}
