//! Peer sessions as the driver sees them: which session is current for each peer name, the plugins
//! connected with it (every plugin both sides opened that can reach it, in the link's preference
//! order; the core picks one per part from the memory it moves), the remote keys imported from it
//! into each; turning link events into core inputs. Never waits on a link: frames out are queued
//! without blocking (`PeerSender::send`).

use super::Driver;
use crate::channels::{LinkEnd, PeerEvent, PeerSender, SessionId};
use crate::metrics::GatewayMetrics;
use crate::peer_link::codec;
use kvgate_abi::{PeerId, RemoteKey};
use kvgate_client::proto::{self, peer_frame::Frame};
use kvgate_core::{PeerLoss, PeerMessage, PluginSlot, Role};
use std::collections::{HashMap, HashSet};

pub struct PeerSessionState {
    pub name: String,
    /// The peer process's incarnation (from its Hello).
    pub incarnation: u64,
    pub sender: PeerSender,
    /// The plugins offered for new rooms with this peer, in preference order (empty: none usable).
    pub plugins: Vec<PluginSlot>,
    /// Remote keys imported from this session: (peer region id, plugin) -> key in that plugin.
    pub remote_keys: HashMap<(u64, PluginSlot), RemoteKey>,
    /// The peer's open plugin instances (its Hello, then its latest `PluginsChanged`).
    pub remote: Vec<proto::PluginEndpoint>,
    /// The plugin peer id local instances know each of the peer's instances by (see `pairing`).
    pub remote_ids: HashMap<String, PeerId>,
    /// Connections made: (local instance, the peer's instance by wire name).
    pub links: HashSet<(PluginSlot, String)>,
    /// The peer instance each connected local instance is paired with now.
    pub partner: HashMap<PluginSlot, String>,
    /// The peer's latest announce of each of its regions (imported again into re-paired instances).
    pub announces: HashMap<u64, proto::RegionAnnounce>,
    /// The peer instance and key bytes each imported key came from: (peer region id, plugin) ->
    /// (wire name, key bytes).
    pub key_source: HashMap<(u64, PluginSlot), (String, Vec<u8>)>,
    /// Keys a re-pairing replaced (rooms may still use them), released when the session ends.
    pub superseded_keys: Vec<(PluginSlot, RemoteKey)>,
    /// The plugin peer id each imported key was imported under: where a submit with it goes.
    pub key_routes: HashMap<(PluginSlot, RemoteKey), PeerId>,
    /// Whether any of the peer's instances is known by a plugin peer id other than the session's
    /// (only after a plugin reload): until then no submit or ticket needs routing.
    pub virtual_ids: bool,
    /// `partner` by slot ("" where none): how notices to and from this peer name instances.
    pub partner_by_slot: Vec<String>,
    /// The highest plugin change of the peer seen here, and the highest of ours it applied.
    pub peer_change_seq: u64,
    pub acked_change_seq: u64,
    /// Core messages of the current driver step, sent together at its end.
    outbox: super::outbox::Outbox,
}

impl PeerSessionState {
    fn new(
        name: String,
        incarnation: u64,
        sender: PeerSender,
        remote: Vec<proto::PluginEndpoint>,
        outbox: super::outbox::Outbox,
    ) -> PeerSessionState {
        PeerSessionState {
            name,
            incarnation,
            sender,
            plugins: Vec::new(),
            remote_keys: HashMap::new(),
            remote,
            remote_ids: HashMap::new(),
            links: HashSet::new(),
            partner: HashMap::new(),
            announces: HashMap::new(),
            key_source: HashMap::new(),
            superseded_keys: Vec::new(),
            key_routes: HashMap::new(),
            virtual_ids: false,
            partner_by_slot: Vec::new(),
            peer_change_seq: 0,
            acked_change_seq: 0,
            outbox,
        }
    }

    /// Send `frame` now, after the core messages gathered for this session (order is kept).
    pub fn send_frame(&mut self, frame: Frame, metrics: &GatewayMetrics) -> bool {
        metrics.count_core_batches(self.outbox.flush(&self.sender));
        self.sender.send(frame)
    }

    /// Rebuild `partner_by_slot` after `partner` changed.
    pub fn refresh_partner_names(&mut self, slots: usize) {
        self.partner_by_slot =
            (0..slots).map(|s| self.partner.get(&PluginSlot(s as u32)).cloned().unwrap_or_default()).collect();
    }
}

#[derive(Default)]
pub struct Peers {
    pub(super) by_session: HashMap<SessionId, PeerSessionState>,
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
        self.departed
            .iter()
            .rev()
            .find(|(id, _, _)| *id == session)
            .map(|(_, name, incarnation)| (name.as_str(), *incarnation))
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
    pub fn set_current(&mut self, name: &str, session: SessionId) {
        self.current.insert(name.to_string(), session);
    }
    pub fn is_up(&self, name: &str) -> bool {
        self.current.contains_key(name)
    }
    pub fn sessions(&self) -> Vec<SessionId> {
        self.by_session.keys().copied().collect()
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

impl Driver {
    pub(super) fn on_peer_event(&mut self, event: PeerEvent) {
        match event {
            PeerEvent::Up { name, session, hello, sender } => self.peer_up(name, session, hello, sender),
            PeerEvent::Frame { session, frame } => self.peer_frame(session, frame),
            PeerEvent::Lost { name, session, end } => {
                let cause = match end {
                    LinkEnd::Restarted => PeerLoss::Restarted,
                    LinkEnd::HeartbeatTimeout => PeerLoss::HeartbeatTimeout,
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
        let ours = self.advertised_plugins();
        let theirs: Vec<String> = hello.plugins.iter().map(|p| p.plugin.clone()).collect();
        let batching = self.config.peer_link.core_batch
            && hello.features.iter().any(|f| f == crate::peer_link::FEATURE_CORE_BATCH);
        let outbox = super::outbox::Outbox::new(batching, self.config.peer_link.frame_fragment_bytes);
        self.peers
            .by_session
            .insert(session, PeerSessionState::new(name.clone(), hello.incarnation, sender, hello.plugins, outbox));
        // Every shared plugin that reaches this peer (scope) and is healthy, connected in order.
        let (connected, _) = self.pair_session(session);
        let same_host = self.directory.entry(&name).is_some_and(|p| p.same_host);
        if connected.is_empty() {
            tracing::error!(peer = %name, ours = ?ours.iter().map(|p| &p.plugin).collect::<Vec<_>>(), theirs = ?theirs, same_host,
                "no plugin usable with this peer: rooms with it will be refused (peer_not_connected)");
        }
        self.metrics.set_peer_up(&name, true);
        if let Some(state) = self.peers.by_session.get(&session) {
            for announce in self.regions.announcements() {
                state.sender.send(Frame::RegionAnnounce(announce.clone()));
            }
        }
        if !connected.is_empty() {
            self.peers.current.insert(name.clone(), session);
            self.core.handle_peer_up_with(now, peer, hello.incarnation, &connected);
            let names: Vec<&str> =
                connected.iter().map(|p| self.instances[p.slot.0 as usize].wire_name.as_str()).collect();
            tracing::info!(peer = %name, session, plugins = ?names, "peer ready");
        }
        self.deliver_parked(&name, session, hello.incarnation);
    }

    fn peer_frame(&mut self, session: SessionId, frame: Frame) {
        let now = self.now();
        let Some(state) = self.peers.by_session.get_mut(&session) else { return };
        match frame {
            Frame::RegionAnnounce(announce) => {
                // Imported into every local instance connected with the peer, from the key of the
                // peer instance it is paired with.
                state.announces.insert(announce.region, announce.clone());
                let slots: Vec<PluginSlot> = state.partner.keys().copied().collect();
                let offered = !state.plugins.is_empty();
                let imported = self.import_region(session, &announce, &slots);
                if imported == 0 && offered {
                    let theirs: Vec<&str> = announce.keys.iter().map(|k| k.plugin.as_str()).collect();
                    let name = self.peers.by_session.get(&session).map(|s| s.name.clone()).unwrap_or_default();
                    tracing::warn!(peer = %name, region = announce.region, plugins = ?theirs, "peer region has no key for any plugin connected with it");
                }
            }
            Frame::RegionWithdraw(w) => {
                state.announces.remove(&w.region);
                let held: Vec<(u64, PluginSlot)> =
                    state.remote_keys.keys().filter(|(region, _)| *region == w.region).copied().collect();
                for entry in held {
                    state.key_source.remove(&entry);
                    if let Some(key) = state.remote_keys.remove(&entry) {
                        state.key_routes.remove(&(entry.1, key));
                        self.plugins[entry.1 .0 as usize].transport().release_remote_key(key);
                    }
                }
            }
            Frame::PluginsChanged(update) => self.on_plugins_changed(session, update),
            Frame::Core(message) => self.peer_core_message(now, session, message),
            Frame::CoreBatch(batch) => {
                for message in batch.messages {
                    self.peer_core_message(now, session, message);
                }
            }
            // The session task checks both before a frame gets here (a second Hello ends the link).
            // Fragments are joined by the link's session task; none reaches the driver, nor does a
            // refusal (it can only stand in place of a Hello, which the dialler reads).
            Frame::Hello(_) | Frame::Heartbeat(_) | Frame::AuthProof(_) | Frame::Fragment(_) | Frame::Refused(_) => {}
        }
    }

    /// One core message from a live session, to the core (a message that does not decode is counted
    /// and dropped: the room it was for ends on its own deadline).
    fn peer_core_message(&mut self, now: kvgate_core::At, session: SessionId, message: proto::CoreMessage) {
        let Some(state) = self.peers.by_session.get(&session) else { return };
        let decoded = codec::decode_in(
            message,
            codec::InstanceNames { own: &self.plugin_names, partner: &state.partner_by_slot },
        );
        match decoded {
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
        }
        for (slot, wire) in &state.links {
            let id = state.remote_ids.get(wire).copied().unwrap_or(PeerId(session));
            self.plugins[slot.0 as usize].transport().disconnect(id);
        }
        for ((_, slot), key) in &state.remote_keys {
            self.plugins[slot.0 as usize].transport().release_remote_key(*key);
        }
        for (slot, key) in &state.superseded_keys {
            self.plugins[slot.0 as usize].transport().release_remote_key(*key);
        }
        for id in state.remote_ids.values() {
            self.plugin_peer_sessions.remove(&id.0);
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
            let Some(state) = self.peers.session(session) else { return };
            let names = codec::InstanceNames { own: &self.plugin_names, partner: &state.partner_by_slot };
            let encoded = codec::encode_in(&message, names);
            self.peers.send_core(session, encoded, &self.metrics);
        }
    }

    /// For an outcome message (`Quiesced`, `RoomFailed`) about a room bound to an earlier session of
    /// the same peer process: that session's peer id, under which the core knows the room.
    fn outcome_addressee(&self, now: kvgate_core::At, session: SessionId, message: &PeerMessage) -> Option<PeerId> {
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
