//! Executing the core's commands: plugin calls (non-blocking by contract), frames to peers (queued,
//! never awaited), room events to engines (broadcast to watchers), with one log line for every
//! failure and the transfer metrics. Never decides a room's fate: a synchronous plugin refusal is
//! fed back to the core as the failure event the contract prescribes.

use super::Driver;
use crate::peer_link::codec;
use kvgate_abi::{
    abi_stable::std_types::{RResult, RSlice},
    Event, IncomingRequest, SubmitRequest,
};
use kvgate_client::proto;
use kvgate_core::{Command, Outcome, PluginSlot, ReleaseCause, Role, RoomEvent, RoomKey, RoomState, Span};

impl Driver {
    pub(super) fn execute(&mut self, command: Command) {
        let command = match command {
            Command::ToEngine(event) => return self.room_event(event),
            Command::Violation(violation) => return self.violation_log.note(violation),
            other => other,
        };
        match &command {
            Command::Submit { plugin, xfer, peer, ticket, timeout, segments } => {
                // To the peer instance the destination key was imported from (see `pairing`).
                let route = match self.peers.session(peer.0) {
                    Some(state) if state.virtual_ids => {
                        segments.first().and_then(|s| state.key_routes.get(&(*plugin, s.remote)).copied())
                    }
                    _ => None,
                };
                let request = SubmitRequest {
                    xfer: *xfer,
                    peer: route.unwrap_or(*peer),
                    ticket: *ticket,
                    timeout_ns: timeout.0,
                    segments: RSlice::from_slice(segments),
                };
                if let Some(opened) = self.plugins.get(plugin.0 as usize) {
                    if let RResult::RErr(e) = opened.transport().submit(request) {
                        tracing::debug!(plugin = opened.name(), xfer = xfer.0, "submit refused: {e}");
                        self.feedback
                            .push_back((*plugin, Event::failed_quiesced(*xfer, e.code, e.message.to_string())));
                    }
                }
            }
            Command::Cancel { plugin, xfer } => {
                if let Some(opened) = self.plugins.get(plugin.0 as usize) {
                    opened.transport().cancel(*xfer);
                }
            }
            Command::ExpectIncoming { plugin, peer, ticket, timeout, ranges } => {
                // For the peer instance this one is paired with (the notice names it).
                let route = match self.peers.session(peer.0) {
                    Some(s) if s.virtual_ids => s
                        .remote_ids
                        .get(s.partner.get(plugin).map_or("", String::as_str))
                        .copied()
                        .filter(|id| id != peer),
                    _ => None,
                };
                if let Some(id) = route {
                    self.ticket_routes.insert((*plugin, *ticket), id);
                }
                let request = IncomingRequest {
                    ticket: *ticket,
                    peer: route.unwrap_or(*peer),
                    timeout_ns: timeout.0,
                    ranges: RSlice::from_slice(ranges),
                };
                if let Some(opened) = self.plugins.get(plugin.0 as usize) {
                    if let RResult::RErr(e) = opened.transport().expect_incoming(request) {
                        self.ticket_routes.remove(&(*plugin, *ticket));
                        self.feedback.push_back((
                            *plugin,
                            Event::incoming_failed(*peer, *ticket, e.code, e.message.to_string()),
                        ));
                    }
                }
            }
            Command::CancelIncoming { plugin, peer, ticket } => {
                let route = match self.ticket_routes.is_empty() {
                    true => *peer,
                    false => self.ticket_routes.remove(&(*plugin, *ticket)).unwrap_or(*peer),
                };
                if let Some(opened) = self.plugins.get(plugin.0 as usize) {
                    opened.transport().cancel_incoming(route, *ticket);
                }
            }
            Command::ToPeer { peer, message } => match self.peers.session(peer.0) {
                // Sent at the end of this driver step (`Peers::flush`). A full queue makes the session
                // task declare the peer lost; the core then learns it.
                Some(state) => {
                    let names = codec::InstanceNames { own: &self.plugin_names, partner: &state.partner_by_slot };
                    let encoded = codec::encode_in(message, names);
                    self.peers.send_core(peer.0, encoded, &self.metrics);
                }
                None => {
                    let keep = matches!(message, kvgate_core::PeerMessage::Quiesced { .. });
                    let limit = self.config.peer_link.parked_outcomes as usize;
                    if !(keep && self.peers.park(peer.0, message.clone(), limit)) {
                        tracing::debug!(peer = peer.0, kind = message.kind_str(), room = %message.room(), "message for a gone peer session dropped");
                    }
                }
            },
            Command::ToEngine(_) | Command::Violation(_) => {} // handled above, before the match
        }
        // The plugin call borrowed the segments (or ranges) only for its duration: the core may
        // reuse the buffer for a later command.
        self.core.recycle_command(command);
    }

    /// The name of the plugin carrying a room ("none" before one was chosen).
    fn room_plugin_name(&self, plugin: Option<PluginSlot>) -> &str {
        plugin.map(|s| self.plugin_name(s)).unwrap_or("none")
    }

    /// One room event: its metrics and log line, then the wire event for the `Watch` streams.
    /// Progress events (state changes, parts done) are not even built while no stream wants them.
    /// Everything reported comes with the event.
    fn room_event(&mut self, event: RoomEvent) {
        let now = self.now();
        let at_ms = now.since_origin().as_ms();
        let wire = match &event {
            RoomEvent::StateChanged { room, role, state, from, opened_at, plugin } => {
                if from.is_none() {
                    self.stuck.track(*opened_at, *room, *role);
                }
                if *state == RoomState::Transferring {
                    self.metrics.observe_bootstrap(self.room_plugin_name(*plugin), now.saturating_since(*opened_at));
                }
                if !self.watch.wants_progress() {
                    return;
                }
                proto::room_event::Event::StateChanged(proto::StateChanged { state: state.as_str().into() })
            }
            RoomEvent::PartSucceeded { part, bytes, .. } => {
                if !self.watch.wants_progress() {
                    return;
                }
                proto::room_event::Event::StateChanged(proto::StateChanged {
                    state: format!("part_{part}_succeeded_{bytes}_bytes"),
                })
            }
            RoomEvent::Terminal { room, role, outcome, elapsed, bytes, peer, plugin, transferring } => {
                let ended = Ended {
                    room: *room,
                    role: *role,
                    elapsed: *elapsed,
                    bytes: *bytes,
                    peer: *peer,
                    plugin: *plugin,
                    transferring: *transferring,
                };
                self.terminal_event(outcome, ended)
            }
            RoomEvent::Reusable { room, role, cause, plugin } => {
                if *cause == ReleaseCause::QuarantineTimeout {
                    tracing::warn!(
                        room = %room, role = role.as_str(), plugin = %self.room_plugin_name(*plugin),
                        quarantine_timeout_ms = self.config.scheduler.quarantine_timeout_ms,
                        "quarantine timed out: memory released without the plugin reporting that no byte can land any more"
                    );
                }
                self.region_use.release(*room, *role);
                self.sessions.room_reusable(*room, *role);
                self.release_orphan_regions();
                proto::room_event::Event::Reusable(proto::Reusable { reason: cause.as_str().into() })
            }
        };
        let room = event.room();
        self.watch.publish(proto::RoomEvent {
            key: Some(proto::RoomKey { room: room.room, generation: room.generation }),
            event: Some(wire),
            at_ms,
            role: event.role().as_str().into(),
            seq: 0, // assigned by the feed
        });
    }

    /// A room's outcome: the metrics and log line it is worth, and its wire event.
    fn terminal_event(&mut self, outcome: &Outcome, ended: Ended) -> proto::room_event::Event {
        let Ended { room, role, elapsed, bytes, peer, plugin, transferring } = ended;
        let plugin_name = self.room_plugin_name(plugin);
        match outcome {
            Outcome::Succeeded => {
                if role == Role::Sender {
                    self.metrics.observe_transfer(plugin_name, bytes, transferring.unwrap_or(elapsed));
                }
                tracing::debug!(room = %room, role = role.as_str(), elapsed_ms = elapsed.as_ms(), bytes, "room succeeded");
                proto::room_event::Event::Terminal(proto::Terminal {
                    succeeded: true,
                    elapsed_ms: elapsed.as_ms(),
                    bytes,
                    ..Default::default()
                })
            }
            Outcome::Failed(failure) => {
                let peer_name = peer.and_then(|p| self.peers.name_of(p)).unwrap_or("-");
                tracing::warn!(
                    room = %room, role = role.as_str(), reason = failure.reason.as_str(), phase = failure.phase.as_str(),
                    peer = %peer_name, plugin = %plugin_name, elapsed_ms = elapsed.as_ms(),
                    peer_reason = failure.peer_reason.map(|r| r.as_str()), plugin_reason = failure.plugin_reason_str(),
                    "room failed"
                );
                self.metrics.count_failure(failure.reason.as_str(), failure.phase.as_str(), plugin_name);
                proto::room_event::Event::Terminal(proto::Terminal {
                    succeeded: false,
                    reason: failure.reason.as_str().into(),
                    phase: failure.phase.as_str().into(),
                    elapsed_ms: elapsed.as_ms(),
                    bytes,
                    peer_reason: failure.peer_reason.map(|r| r.as_str().to_string()).unwrap_or_default(),
                })
            }
        }
    }
}

/// What a `Terminal` room event says of the room besides its outcome.
struct Ended {
    room: RoomKey,
    role: Role,
    elapsed: Span,
    bytes: u64,
    peer: Option<u64>,
    plugin: Option<PluginSlot>,
    transferring: Option<Span>,
}
