//! Peer sessions as the driver sees them: which session is current for each peer name, the plugins
//! connected with it (every plugin both sides opened that can reach it, in the link's preference
//! order; the core picks one per part from the memory it moves), the remote keys imported from it
//! into each; turning link events into core inputs. Never waits on a link: frames out are queued
//! without blocking (`PeerSender::send`).

use super::Driver;
use crate::peer_link::{codec, dials, PeerEvent, PeerSender, SessionId};
use kvgate_abi::{abi_stable::std_types::{RResult, RSlice}, PeerId, RemoteKey};
use kvgate_client::proto::{self, peer_frame::Frame};
use kvgate_core::{PeerLoss, PeerMessage, PeerPlugin, PluginSlot, RegionId, Role};
use crate::metrics::GatewayMetrics;
use std::collections::HashMap;

pub struct PeerSessionState {
    pub name: String,
    /// The peer process's incarnation (from its Hello).
    pub incarnation: u64,
    pub sender: PeerSender,
    /// The plugins connected with this peer, in preference order (empty: none usable).
    pub plugins: Vec<PluginSlot>,
    /// Remote keys imported from this session: (peer region id, plugin) -> key in that plugin.
    pub remote_keys: HashMap<(u64, PluginSlot), RemoteKey>,
    /// Core messages of the current driver step, sent together at its end.
    outbox: super::outbox::Outbox,
}

#[derive(Default)]
pub struct Peers {
    by_session: HashMap<SessionId, PeerSessionState>,
    current: HashMap<String, SessionId>,
    /// The last incarnation seen per name (a different one on the next Up = the peer restarted).
    incarnations: HashMap<String, u64>,
    /// Names of the latest sessions that ended (at most `DEPARTED_NAMES_KEPT`, oldest dropped first):
    /// the rooms a lost session fails are logged after it is gone, and still name their peer.
    departed: std::collections::VecDeque<(SessionId, String, u64)>,
    /// Per peer name: outcome messages for rooms of a lost session, kept for that peer's incarnation
    /// until it is back on a new session (`peer_link.parked_outcomes`).
    parked: HashMap<String, (u64, std::collections::VecDeque<PeerMessage>)>,
    /// Sessions whose outbox holds messages (flushed at the end of the driver step).
    unflushed: Vec<SessionId>,
}

/// How many ended sessions' names are kept for the log lines of their rooms.
pub const DEPARTED_NAMES_KEPT: usize = 1024;

impl Peers {
    pub fn current(&self, name: &str) -> Option<PeerId> {
        self.current.get(name).map(|s| PeerId(*s))
    }
    pub fn session(&self, id: SessionId) -> Option<&PeerSessionState> {
        self.by_session.get(&id)
    }
    /// The peer name of a session, live or among the latest ended.
    pub fn name_of(&self, peer: u64) -> Option<&str> {
        match self.by_session.get(&peer) {
            Some(s) => Some(s.name.as_str()),
            None => self.departed.iter().rev().find(|(id, _, _)| *id == peer).map(|(_, name, _)| name.as_str()),
        }
    }

    /// The name and incarnation of a session that ended (among the latest `DEPARTED_NAMES_KEPT`).
    fn departed(&self, session: SessionId) -> Option<(&str, u64)> {
        self.departed.iter().rev().find(|(id, _, _)| *id == session).map(|(_, name, incarnation)| (name.as_str(), *incarnation))
    }

    fn remember_departed(&mut self, session: SessionId, name: String, incarnation: u64) {
        if self.departed.len() == DEPARTED_NAMES_KEPT {
            self.departed.pop_front();
        }
        self.departed.push_back((session, name, incarnation));
    }

    /// Keep `message`, addressed to the ended `session`, for that peer's next session of the same
    /// incarnation; `false` when it cannot be kept (unknown session, `limit` 0).
    pub fn park(&mut self, session: SessionId, message: PeerMessage, limit: usize) -> bool {
        let Some((name, incarnation)) = self.departed(session).map(|(n, i)| (n.to_string(), i)) else { return false };
        if limit == 0 {
            return false;
        }
        let entry = self.parked.entry(name).or_insert_with(|| (incarnation, Default::default()));
        if entry.0 != incarnation {
            *entry = (incarnation, Default::default());
        }
        if entry.1.len() == limit {
            if let Some(dropped) = entry.1.pop_front() {
                tracing::warn!(room = %dropped.room(), limit, reason = "parked_outcomes_full", "an outcome kept for a lost peer was dropped (peer_link.parked_outcomes); that room waits for its quarantine bound");
            }
        }
        entry.1.push_back(message);
        true
    }
    pub fn is_up(&self, name: &str) -> bool {
        self.current.contains_key(name)
    }
    /// `frame` to every session, after the core messages gathered for it (order is kept).
    pub fn broadcast(&mut self, frame: Frame, metrics: &GatewayMetrics) {
        for state in self.by_session.values_mut() {
            metrics.count_core_batches(state.outbox.flush(&state.sender));
            state.sender.send(frame.clone());
        }
    }

    /// Queue a core message for `session` (see `outbox.rs`); `false` when no such session is live.
    pub fn send_core(&mut self, session: SessionId, message: proto::CoreMessage, metrics: &GatewayMetrics) -> bool {
        let Some(state) = self.by_session.get_mut(&session) else { return false };
        let was_empty = state.outbox.is_empty();
        metrics.count_core_message();
        metrics.count_core_batches(state.outbox.push(&state.sender, message));
        if was_empty && !state.outbox.is_empty() {
            self.unflushed.push(session);
        }
        true
    }

    /// Send every gathered core message: the end of a driver step.
    pub fn flush(&mut self, metrics: &GatewayMetrics) {
        for session in self.unflushed.drain(..) {
            if let Some(state) = self.by_session.get_mut(&session) {
                metrics.count_core_batches(state.outbox.flush(&state.sender));
            }
        }
    }
}

/// The plugin both sides use: the dialler's preference order, restricted to plugins both opened.
fn shared_preferences(local_name: &str, local_prefs: &[String], hello: &proto::Hello) -> Vec<String> {
    let theirs: Vec<String> = hello.plugins.iter().map(|p| p.plugin.clone()).collect();
    let order = if dials(local_name, &hello.name) { local_prefs.to_vec() } else { theirs.clone() };
    order.into_iter().filter(|p| theirs.contains(p) && local_prefs.contains(p)).collect()
}

impl Driver {
    pub(super) fn on_peer_event(&mut self, event: PeerEvent) {
        match event {
            PeerEvent::Up { name, session, hello, sender } => self.peer_up(name, session, hello, sender),
            PeerEvent::Frame { session, frame } => self.peer_frame(session, frame),
            PeerEvent::Lost { name, session, reason, detail } => {
                let cause = match reason {
                    "peer_restarted" => PeerLoss::Restarted,
                    _ if detail.starts_with("no frame for") => PeerLoss::HeartbeatTimeout,
                    _ => PeerLoss::LinkClosed,
                };
                self.peer_lost(&name, session, cause);
            }
        }
    }

    fn peer_up(&mut self, name: String, session: SessionId, hello: proto::Hello, sender: PeerSender) {
        let now = self.now();
        let peer = PeerId(session);
        if let Some(previous) = self.peers.incarnations.insert(name.clone(), hello.incarnation) {
            if previous != hello.incarnation {
                tracing::warn!(peer = %name, previous, incarnation = hello.incarnation, "peer restarted (new incarnation)");
            }
        }
        let local_prefs: Vec<String> = self.plugins.iter().map(|p| p.name().to_string()).collect();
        let same_host = self.directory.entry(&name).is_some_and(|p| p.same_host);
        let candidates = shared_preferences(&self.config.gateway.name, &local_prefs, &hello);
        // Every shared plugin that reaches this peer (scope) and is healthy, connected in order.
        let mut connected = Vec::new();
        for slot in usable_plugins(&self.plugins, &candidates, same_host) {
            let endpoint = hello.plugins.iter().find(|p| p.plugin == self.plugins[slot].name()).map(|p| p.endpoint.clone()).unwrap_or_default();
            match self.plugins[slot].transport().connect(peer, RSlice::from_slice(&endpoint)) {
                RResult::ROk(()) => connected.push(PeerPlugin { slot: PluginSlot(slot as u32), memory_kinds: self.plugins[slot].capabilities().memory_kinds }),
                RResult::RErr(e) => tracing::error!(peer = %name, plugin = self.plugins[slot].name(), "plugin connect failed: {e}"),
            }
        }
        if connected.is_empty() {
            tracing::error!(peer = %name, ours = ?local_prefs, theirs = ?hello.plugins.iter().map(|p| &p.plugin).collect::<Vec<_>>(), same_host,
                "no plugin usable with this peer: rooms with it will be refused (peer_not_connected)");
        }
        self.metrics.set_peer_up(&name, true);
        for announce in self.regions.announcements() {
            sender.send(Frame::RegionAnnounce(announce.clone()));
        }
        let plugins: Vec<PluginSlot> = connected.iter().map(|p| p.slot).collect();
        let batching = self.config.peer_link.core_batch && hello.features.iter().any(|f| f == crate::peer_link::FEATURE_CORE_BATCH);
        let outbox = super::outbox::Outbox::new(batching, self.config.peer_link.frame_fragment_bytes);
        self.peers.by_session.insert(session, PeerSessionState { name: name.clone(), incarnation: hello.incarnation, sender, plugins: plugins.clone(), remote_keys: HashMap::new(), outbox });
        if !connected.is_empty() {
            self.peers.current.insert(name.clone(), session);
            self.core.handle_peer_up_with(now, peer, hello.incarnation, &connected);
            let names: Vec<&str> = plugins.iter().map(|slot| self.plugin_name(*slot)).collect();
            tracing::info!(peer = %name, session, plugins = ?names, "peer ready");
        }
        self.deliver_parked(&name, session, hello.incarnation);
    }

    fn peer_frame(&mut self, session: SessionId, frame: Frame) {
        let now = self.now();
        let Some(state) = self.peers.by_session.get_mut(&session) else { return };
        let peer = PeerId(session);
        match frame {
            Frame::RegionAnnounce(announce) => {
                // Imported into every plugin connected with the peer that the region is registered with.
                let mut imported = 0;
                for &slot in &state.plugins {
                    let plugin = &self.plugins[slot.0 as usize];
                    let Some(key) = announce.keys.iter().find(|k| k.plugin == plugin.name()) else { continue };
                    match plugin.transport().import_remote_key(peer, RSlice::from_slice(&key.key)) {
                        RResult::ROk(remote) => {
                            if let Some(old) = state.remote_keys.insert((announce.region, slot), remote) {
                                plugin.transport().release_remote_key(old);
                            }
                            self.core.handle_remote_region_key(now, peer, RegionId(announce.region), announce.len, slot, remote);
                            imported += 1;
                        }
                        RResult::RErr(e) => tracing::error!(peer = %state.name, region = announce.region, plugin = plugin.name(), "import of a peer region failed: {e}"),
                    }
                }
                if imported == 0 && !state.plugins.is_empty() {
                    let theirs: Vec<&str> = announce.keys.iter().map(|k| k.plugin.as_str()).collect();
                    tracing::warn!(peer = %state.name, region = announce.region, plugins = ?theirs, "peer region has no key for any plugin connected with it");
                }
            }
            Frame::RegionWithdraw(w) => {
                for &slot in &state.plugins {
                    if let Some(key) = state.remote_keys.remove(&(w.region, slot)) {
                        self.plugins[slot.0 as usize].transport().release_remote_key(key);
                    }
                }
            }
            Frame::Core(message) => self.peer_core_message(now, session, message),
            Frame::CoreBatch(batch) => {
                for message in batch.messages {
                    self.peer_core_message(now, session, message);
                }
            }
            // The session task checks both before a frame gets here (a second Hello ends the link).
            // Fragments are joined by the link's session task; none reaches the driver.
            Frame::Hello(_) | Frame::Heartbeat(_) | Frame::AuthProof(_) | Frame::Fragment(_) => {}
        }
    }

    /// One core message from a live session, to the core (a message that does not decode is counted
    /// and dropped: the room it was for ends on its own deadline).
    fn peer_core_message(&mut self, now: kvgate_core::Nanos, session: SessionId, message: proto::CoreMessage) {
        match codec::decode(message, &self.plugin_names) {
            Ok(message) => {
                let peer = self.outcome_addressee(now, session, &message).unwrap_or(PeerId(session));
                self.core.handle_peer_message(now, peer, &message)
            }
            Err(e) => {
                self.metrics.count_bad_peer_frame();
                let name = self.peers.name_of(session).unwrap_or("-");
                tracing::warn!(peer = %name, "undecodable peer message dropped: {e}");
            }
        }
    }

    fn peer_lost(&mut self, name: &str, session: SessionId, cause: PeerLoss) {
        let now = self.now();
        let Some(state) = self.peers.by_session.remove(&session) else { return };
        self.peers.remember_departed(session, state.name.clone(), state.incarnation);
        if self.peers.current.get(name) == Some(&session) {
            self.peers.current.remove(name);
        }
        self.metrics.set_peer_up(name, false);
        if !state.plugins.is_empty() {
            self.core.handle_peer_lost(now, PeerId(session), cause);
            for &slot in &state.plugins {
                self.plugins[slot.0 as usize].transport().disconnect(PeerId(session));
            }
            for ((_, slot), key) in &state.remote_keys {
                self.plugins[slot.0 as usize].transport().release_remote_key(*key);
            }
        }
        tracing::warn!(peer = %name, session, cause = cause.as_str(), "peer lost: every room bound to it fails (peer_lost)");
    }
}

impl Driver {
    /// Send what was kept for `name` while it was away, if this new session is the same process.
    fn deliver_parked(&mut self, name: &str, session: SessionId, incarnation: u64) {
        let Some((kept_for, messages)) = self.peers.parked.remove(name) else { return };
        if kept_for != incarnation {
            tracing::info!(peer = %name, dropped = messages.len(), "outcomes kept for a previous incarnation of the peer dropped (it restarted)");
            return;
        }
        if self.peers.session(session).is_none() {
            return;
        }
        tracing::info!(peer = %name, delivered = messages.len(), "outcomes kept while the peer was away delivered on its new link");
        for message in messages {
            self.peers.send_core(session, codec::encode(&message, &self.plugin_names), &self.metrics);
        }
    }

    /// For an outcome message (`Quiesced`, `RoomFailed`) about a room bound to an earlier session of
    /// the same peer process: that session's peer id, under which the core knows the room.
    fn outcome_addressee(&self, now: kvgate_core::Nanos, session: SessionId, message: &PeerMessage) -> Option<PeerId> {
        let role = match message {
            PeerMessage::Quiesced { .. } => Role::Receiver,
            PeerMessage::RoomFailed { to, .. } => *to,
            _ => return None,
        };
        let current = self.peers.by_session.get(&session)?;
        let bound = self.core.room(now, message.room(), role)?.peer?;
        if bound == session {
            return None;
        }
        let (name, incarnation) = self.peers.departed(bound)?;
        (name == current.name && incarnation == current.incarnation).then_some(PeerId(bound))
    }
}

/// The slots of the `candidates` (shared plugin names, in preference order) that reach a peer on
/// this host or another (`same_host`) and are healthy. Memory kinds are not checked here: the core
/// picks, per part, a plugin that serves the part's memory.
fn usable_plugins(plugins: &[kvgate_host::OpenedPlugin], candidates: &[String], same_host: bool) -> Vec<usize> {
    use kvgate_abi::scope;
    candidates
        .iter()
        .filter_map(|name| {
            let slot = plugins.iter().position(|p| p.name() == name)?;
            let caps = plugins[slot].capabilities();
            let scope_ok = caps.scope & if same_host { scope::SAME_HOST } else { scope::CROSS_HOST } != 0;
            (scope_ok && plugins[slot].transport().stats().healthy != 0).then_some(slot)
        })
        .collect()
}
