//! Read-only views the driver hands out: rooms for the engine API (`RoomInfo`) and for `/rooms`
//! (JSON), plugin and peer status, health, and the metrics snapshot `/metrics` renders. Never
//! changes driver state.

use super::peers::Peers;
use super::Driver;
use kvgate_client::proto;
use kvgate_core::{Metrics, Nanos, RoomState, RoomView};
use kvgate_host::OpenedPlugin;
use serde::Serialize;

/// One non-terminal room in `/rooms`.
#[derive(Clone, Debug, Serialize)]
pub struct RoomJson {
    pub room: u64,
    pub generation: u32,
    pub role: &'static str,
    pub state: &'static str,
    pub age_ms: u64,
    pub peer: String,
    /// The wire name of the plugin instance carrying the room (`shm`, `shm@2`).
    pub plugin: String,
    /// That instance's generation (0 before one was chosen).
    pub plugin_generation: u32,
    pub last_event: String,
    pub last_event_age_ms: u64,
    pub parts: u32,
    pub parts_done: u32,
    pub bytes_total: u64,
    pub bytes_done: u64,
}

/// One line of `/plugins`.
#[derive(Clone, Debug, Serialize)]
pub struct PluginStatus {
    pub name: String,
    /// For an opened instance: its generation (1 for the first, one more per reload that reopened
    /// it) and its wire name; 0 and empty for a plugin with no instance.
    pub generation: u32,
    pub wire_name: String,
    /// `active`, `draining` (retired by a reload, finishing what it holds), `closed`; empty for a
    /// plugin with no instance.
    pub state: String,
    /// `builtin` or the library path.
    pub origin: String,
    /// `opened`, `unavailable`, `open_failed`, `load_failed`, `not_opened` (not in plugins.preference),
    /// or `unhealthy` once a worker died.
    pub status: String,
    pub reason: String,
    pub abi_version: Option<u32>,
    pub version: String,
    pub memory_kinds: Vec<&'static str>,
    pub scope: Vec<&'static str>,
    pub max_inflight_transfers: u64,
    pub max_segments_per_submit: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct PeerStatus {
    pub name: String,
    /// Empty for a discovered peer whose record is withdrawn (its link may still be up).
    pub address: String,
    pub up: bool,
    /// `static` (`[[peers]]`) or `etcd` (discovery).
    pub source: &'static str,
}

/// Everything the admin listener shows, taken in one driver turn.
#[derive(Clone, Debug)]
pub struct AdminSnapshot {
    pub now: Nanos,
    pub metrics: Metrics,
    pub rooms: Vec<RoomJson>,
    pub plugins: Vec<PluginStatus>,
    pub peers: Vec<PeerStatus>,
    /// `peer_link.auth` in force (`psk`, `tls` or `none`).
    pub peer_link_auth: &'static str,
    /// Empty when healthy; otherwise one line per problem.
    pub problems: Vec<String>,
    /// The latest plugin reload's outcome, if there was one.
    pub last_reload: Option<super::reload::ReloadOutcome>,
    /// What an operator should know that does not make the gateway unhealthy (e.g. no peer is up).
    pub warnings: Vec<String>,
}

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
                let grace = Nanos::from_ms(self.config.scheduler.plugin_grace_ms + super::HOUSEKEEPING_INTERVAL_MS);
                if now > deadline.saturating_add(grace) {
                    problems.push(format!("room {} ({}) outlived its deadline by {} ms", view.room, view.role.as_str(), now.saturating_sub(deadline).as_ms()));
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
                plugin_generation: view.plugin.and_then(|slot| self.instances.get(slot.0 as usize)).map_or(0, |i| i.generation),
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
                    None if self.pending_restarts.iter().any(|(_, s)| *s == slot) => "; restarting after its back-off".to_string(),
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
            let (age_ms, limit_ms) = (now.saturating_sub(entered).as_ms(), self.config.admin.quarantine_unhealthy_ms);
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
                let mut line = crate::plugin_setup::status_of(plugin.info(), plugin.name(), instance.origin.clone(), "opened", instance.closed_reason.clone());
                line.generation = instance.generation;
                line.wire_name = instance.wire_name.clone();
                line.state = instance.state.as_str().to_string();
                line
            })
            .collect();
        lines.extend(self.plugin_listing.iter().filter(|l| l.status != "opened" && !self.plugins.iter().any(|p| p.name() == l.name)).cloned());
        lines
    }
}
