//! How rooms end: failure (first cause wins), success, quarantine release and tombstone creation (the
//! records: `tombstone`). Every terminal path goes through here so each room gets exactly one `Terminal` and one
//! `Reusable`. It never revives a terminal room.

use super::room::{BytesCounted, RoleData, Room};
use super::tombstone::Tombstone;
use super::Core;
use crate::api::*;
use crate::lifecycle::Verdict;
use crate::table::RoomInput;
use crate::timer::TimerKind;
use kvgate_abi::{PeerId, Ticket, XferId};
use smallvec::SmallVec;

fn came_from_peer(reason: FailReason) -> bool {
    matches!(
        reason,
        FailReason::AbortedByPeer
            | FailReason::SenderFailed
            | FailReason::ReceiverFailed
            | FailReason::PeerLost
            | FailReason::Overloaded
    )
}

impl Core {
    /// Whether nothing can still touch the room's memory.
    fn nothing_in_flight(room: &Room) -> bool {
        room.in_flight == 0 && room.unquiesced == 0
    }

    /// Fail a live room: terminal at once, first cause wins (a terminal room is left as it is).
    // CONFORMANCE: ABORT-5, ABORT-6, OBS-3
    pub(super) fn fail_room(
        &mut self,
        now: At,
        slot: u32,
        input: RoomInput,
        reason: FailReason,
        peer_reason: Option<FailReason>,
        plugin_reason: Option<u32>,
    ) {
        let phase = self.room_at(slot).state.phase();
        let transferring = self.time_transferring(now, slot);
        if self.room_at(slot).state.is_terminal() {
            return;
        }
        if !self.step(now, slot, input) {
            return;
        }
        self.leave_link(slot);
        self.disarm_all(slot, &[TimerKind::Bootstrap, TimerKind::Transfer, TimerKind::Room]);
        let failure = Failure { reason, phase, peer_reason, plugin_reason };
        self.metrics.failures[reason.index()][phase.index()] += 1;
        let grace = Span::from_ms(self.config.plugin_grace_ms);
        let mut commands = Vec::new();
        let room = self.room_mut(slot);
        room.failure = Some(failure);
        if room.last_event != LastEvent::Aborted {
            room.touch(now, LastEvent::Failed);
        }
        let (key, role, peer) = (room.key, room.role, room.peer());
        let dropped_held = Self::cancel_all(room, &mut commands);
        let outstanding_xfers = role == Role::Sender && room.in_flight > 0;
        let quiet = Self::nothing_in_flight(room);
        let bytes_total = room.bytes_total;
        let elapsed = now.saturating_since(room.created);
        let (bytes, plugin) = (room.bytes_done, room.plugin());
        self.metrics.pending_sends -= dropped_held;
        let outcome = Outcome::Failed(failure);
        self.push_engine(RoomEvent::Terminal {
            room: key,
            role,
            outcome,
            elapsed,
            bytes,
            peer: peer.map(|p| p.0),
            plugin,
            transferring,
        });
        self.commands.extend(commands);
        if outstanding_xfers {
            let current = self.timer_deadline(slot, TimerKind::PluginGrace);
            let after_cancel = now.saturating_add(grace);
            if current.is_none_or(|deadline| after_cancel < deadline) {
                self.arm(now, slot, TimerKind::PluginGrace, after_cancel);
            }
        }
        // CONFORMANCE: TIME-8, ABORT-10
        if let Some(peer) = peer.filter(|_| !came_from_peer(reason)) {
            self.tell_peers_room_failed(slot, peer, reason);
        }
        if quiet {
            self.release_quarantine(now, slot, RoomInput::NothingInFlight, ReleaseCause::NothingInFlight);
        } else {
            // CONFORMANCE: RES-4
            self.room_mut(slot).bytes_counted = BytesCounted::InQuarantine;
            self.metrics.quarantined_bytes += bytes_total;
            self.arm(
                now,
                slot,
                TimerKind::Quarantine,
                now.saturating_add(Span::from_ms(self.config.quarantine_timeout_ms)),
            );
        }
    }

    /// A failing room's cancels: every transfer in flight (sender) or ticket still open
    /// (receiver), into `commands`; a sender's held chunks are dropped. Returns how many were held.
    fn cancel_all(room: &mut Room, commands: &mut Vec<Command>) -> u64 {
        let peer = room.peer();
        let mut dropped_held = 0u64;
        match &mut room.data {
            RoleData::Sender { parts, .. } => {
                for part in parts.iter_mut() {
                    dropped_held += part.held.len() as u64;
                    part.held = SmallVec::new();
                    for chunk in &part.chunks {
                        if chunk.state.is_in_flight() {
                            commands.push(Command::Cancel { plugin: part.plugin(), xfer: XferId(chunk.xfer) });
                        }
                    }
                }
            }
            RoleData::Receiver { ticket_base, parts, .. } => {
                for (index, part) in parts.iter().enumerate() {
                    if part.ticket.is_open() {
                        commands.push(Command::CancelIncoming {
                            plugin: part.plugin,
                            peer: peer.expect("a receiver room has a peer"),
                            ticket: Ticket(*ticket_base + index as u64),
                        });
                    }
                }
            }
        }
        dropped_held
    }

    /// Tell the room's peer (and each other sender of a room with several) that it failed here:
    /// an abort as an abort (an engine gone is an abort the engine could no longer send itself),
    /// any other cause as the room's failure.
    fn tell_peers_room_failed(&mut self, slot: u32, peer: PeerId, reason: FailReason) {
        let room = self.room_at(slot);
        let (key, to) = (room.key, room.role.opposite());
        let message = if matches!(reason, FailReason::Aborted | FailReason::EngineLost) {
            PeerMessage::Abort { room: key, reason, to }
        } else {
            PeerMessage::RoomFailed { room: key, reason, to }
        };
        // Every sender of a room with several is told (one message each).
        let extra: SmallVec<[PeerId; 2]> = room.extra_senders().collect();
        for other in extra {
            self.push_peer(other, message.clone());
        }
        self.push_peer(peer, message);
    }

    /// How long the room has been moving bytes (`None`: it is not in `Transferring`).
    fn time_transferring(&self, now: At, slot: u32) -> Option<Span> {
        let room = self.room_at(slot);
        (room.state == RoomState::Transferring).then(|| now.saturating_since(room.state_entered))
    }

    /// Every part succeeded.
    pub(super) fn succeed_room(&mut self, now: At, slot: u32) {
        let transferring = self.time_transferring(now, slot);
        if !self.step(now, slot, RoomInput::AllPartsDone) {
            return;
        }
        self.leave_link(slot);
        self.disarm_all(slot, &[TimerKind::Bootstrap, TimerKind::Transfer, TimerKind::Room, TimerKind::PluginGrace]);
        self.metrics.rooms_succeeded += 1;
        let room = self.rooms.get_mut(slot);
        let (key, role, peer) = (room.key, room.role, room.peer());
        let elapsed = now.saturating_since(room.created);
        let (bytes, plugin) = (room.bytes_done, room.plugin());
        let outcome = Outcome::Succeeded;
        self.commands.push_back(Command::ToEngine(RoomEvent::Terminal {
            room: key,
            role,
            outcome,
            elapsed,
            bytes,
            peer: peer.map(|p| p.0),
            plugin,
            transferring,
        }));
        self.commands.push_back(Command::ToEngine(RoomEvent::Reusable {
            room: key,
            role,
            cause: ReleaseCause::NothingInFlight,
            plugin,
        }));
        if let RoleData::Receiver { ticket_base, parts, .. } = &mut room.data {
            for (index, part) in parts.iter_mut().enumerate() {
                if part.ticket.is_open() {
                    part.ticket = super::plugin::CANCELLED_ON_SUCCESS;
                    self.commands.push_back(Command::CancelIncoming {
                        plugin: part.plugin,
                        peer: peer.expect("a receiver room has a peer"),
                        ticket: Ticket(*ticket_base + index as u64),
                    });
                }
            }
            room.in_flight = 0;
        }
        self.unlink_peer(slot);
        self.settle(now, slot);
    }

    /// A quarantined room's memory is released (quiesced, nothing in flight, or timeout).
    pub(super) fn release_quarantine(&mut self, now: At, slot: u32, input: RoomInput, cause: ReleaseCause) {
        if !self.step(now, slot, input) {
            return;
        }
        self.disarm_all(slot, &[TimerKind::Quarantine, TimerKind::PluginGrace]);
        let room = self.room_mut(slot);
        let held = if std::mem::replace(&mut room.bytes_counted, BytesCounted::Nowhere) == BytesCounted::InQuarantine {
            room.bytes_total
        } else {
            0
        };
        let (key, role, peer, plugin) = (room.key, room.role, room.peer(), room.plugin());
        let failure = room.failure;
        if cause == ReleaseCause::Quiesced {
            room.touch(now, LastEvent::Quiesced);
        }
        self.metrics.quarantined_bytes -= held;
        if cause == ReleaseCause::QuarantineTimeout {
            self.metrics.failures[FailReason::QuarantineTimeout.index()][Phase::Terminal.index()] += 1;
        }
        self.push_engine(RoomEvent::Reusable { room: key, role, cause, plugin });
        // A failed room's receiver waits for this word before reusing its memory. Also after the
        // peer's link was lost: the host delivers it once the same peer process is back on a new
        // link (or drops it if the peer restarted, which ended the receiver's rooms anyway).
        if role == Role::Sender && cause != ReleaseCause::QuarantineTimeout && failure.is_some() {
            if let Some(peer) = peer {
                self.push_peer(peer, PeerMessage::Quiesced { room: key });
            }
        }
        self.unlink_peer(slot);
        self.settle(now, slot);
    }

    /// After a quiesce or a late terminal event: release the quarantine if nothing is left.
    /// A slot already freed (the room settled while the event was handled) has nothing left.
    pub(super) fn check_release(&mut self, now: At, slot: u32) {
        let Some(room) = self.rooms.try_get(slot) else { return };
        if room.state == RoomState::Quarantined && Self::nothing_in_flight(room) {
            self.release_quarantine(now, slot, RoomInput::Quiesced, ReleaseCause::Quiesced);
        }
    }

    /// The plugin-grace deadline passed: every transfer still without a terminal event is forced
    /// failed and counted as a contract violation.
    // CONFORMANCE: TIME-6
    pub(super) fn plugin_grace_expired(&mut self, now: At, slot: u32) {
        // Each transfer still in flight takes the transfer table's `GraceExpired` row.
        let forced_step = super::plugin::FORCED_SILENT;
        let room = self.room_mut(slot);
        let mut forced = 0u32;
        let mut last_forced = None;
        if let RoleData::Sender { parts, .. } = &mut room.data {
            for part in parts.iter_mut() {
                for chunk in part.chunks.iter_mut() {
                    if chunk.state.is_in_flight() {
                        chunk.state = forced_step.next;
                        forced += 1;
                        last_forced = Some(chunk.xfer);
                    }
                }
            }
        }
        room.in_flight -= forced;
        room.unquiesced += forced * forced_step.next.is_unquiesced() as u32;
        let site = last_forced.map(|xfer| (xfer, room.key, room.role, room.plugin()));
        if let (Verdict::Violation(clause), Some((xfer, key, role, plugin))) = (forced_step.verdict, site) {
            // Found on a timer, not in a plugin event: the report names the room and its latest
            // forced transfer.
            self.metrics.violations[clause.index()] += forced as u64;
            let violation = Violation { clause, plugin, event: None, xfer, room: Some((key, role)), count: forced };
            self.commands.push_back(Command::Violation(violation));
        }
        if !self.room_at(slot).state.is_terminal() {
            self.fail_room(now, slot, RoomInput::PluginGraceTimer, FailReason::PluginSilent, None, None);
        } else {
            self.step(now, slot, RoomInput::PluginGraceTimer);
        }
    }

    /// A terminal room whose memory is reusable: remember it as a tombstone record, bounded in
    /// time and count, and free its slot and part lists now. Its expiry is one constant ttl away
    /// (settle order is expiry order; a clock that steps back never puts an expiry before the one
    /// ahead of it).
    pub(super) fn settle(&mut self, now: At, slot: u32) {
        let expiry = self.rooms.expiry_at(now, Span::from_ms(self.config.tombstone_ttl_ms));
        let (epoch, room) = self.rooms.get_with_epoch(slot);
        // Nothing is armed once settled: the room's deadline entry (if any) is released.
        debug_assert_eq!(room.earliest_wheel_deadline(), None);
        debug_assert!(!room.in_peer_list, "a settled room is unlinked from its peer first");
        debug_assert!(matches!(room.state, RoomState::Succeeded | RoomState::Failed));
        room.wheel_entry = self.deadlines.sync(now, room.wheel_entry, slot, epoch, None);
        room.armed = 0;
        let record = Tombstone::of_room(room, expiry);
        let room = self.rooms.settle(slot, record, self.config.max_tombstones, &mut self.metrics);
        if let RoleData::Sender { parts, .. } = room.data {
            self.metrics.pending_sends -= parts.iter().map(|part| part.held.len() as u64).sum::<u64>();
            self.recycle_send_parts(parts);
        }
    }

    /// Remember a room that never existed here (an abort or a failure before the counterpart), so
    /// its late counterpart is refused.
    pub(super) fn create_tombstone(&mut self, now: At, key: RoomKey, role: Role, reason: FailReason) {
        let expiry = self.rooms.expiry_at(now, Span::from_ms(self.config.tombstone_ttl_ms));
        let failure = Failure { reason, phase: Phase::Bootstrap, peer_reason: None, plugin_reason: None };
        let last_event = if reason == FailReason::Aborted { LastEvent::Aborted } else { LastEvent::Failed };
        let record = Tombstone::remembered(key, role, failure, last_event, now, expiry);
        self.rooms.bury(record, self.config.max_tombstones, &mut self.metrics);
    }
}
