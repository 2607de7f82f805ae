//! Plugin events, never trusted: unknown, duplicate or late events are counted violations (per
//! clause); an unknown kind or reason fails the room `plugin_protocol_violation`. It never waits on
//! a plugin: silence is handled by the plugin-grace timer.

use super::room::{RoleData, XferState};
use super::Core;
use crate::api::*;
use crate::metrics::{LateSource, ViolationClause};
use crate::table::RoomInput;
use kvgate_abi::{Event, EventKind, ReasonCode};

impl Core {
    fn violation(&mut self, clause: ViolationClause) {
        self.metrics.violations[clause.index()] += 1;
    }

    // CONFORMANCE: ABORT-9, TIME-10
    pub(super) fn plugin_event(&mut self, now: Nanos, plugin: PluginSlot, event: &Event) {
        if event.is_incoming() {
            return self.incoming_event(now, plugin, event);
        }
        match event.kind {
            EventKind::PEER_DOWN => return self.fail_peer_rooms(now, event.peer, FailReason::PeerLost),
            EventKind::UNHEALTHY => {
                // Every room with a peer the plugin serves: a room whose parts use other plugins fails
                // too (a bound, never a wait).
                let peers: Vec<_> =
                    self.peers.iter().filter(|(_, entry)| entry.has_plugin(plugin)).map(|(peer, _)| *peer).collect();
                for peer in peers {
                    self.fail_peer_rooms(now, peer, FailReason::PluginFailed);
                }
                return;
            }
            _ => {}
        }
        let Some(xref) = self.xfers.get(event.xfer.0) else {
            if event.xfer.0 != 0 && event.xfer.0 < self.next_xfer {
                self.count_late(LateSource::Plugin);
            } else {
                self.violation(ViolationClause::UnknownXfer);
            }
            return;
        };
        if xref.plugin != plugin {
            return self.violation(ViolationClause::WrongPlugin);
        }
        if xref.slot == super::TOMBSTONE_SLOT {
            return self.settled_xfer_event(xref, event);
        }
        debug_assert_eq!(self.epoch(xref.slot), xref.epoch);
        let slot = xref.slot;
        let (state, bytes) = {
            let RoleData::Sender { parts, .. } = &self.room_at(slot).data else { unreachable!() };
            let chunk = &parts[xref.part as usize].chunks[xref.chunk as usize];
            (chunk.state, chunk.bytes)
        };
        let live = !self.room_at(slot).state.is_terminal();
        let set_state = |core: &mut Core, new: XferState| {
            let room = core.room_mut(slot);
            match state {
                XferState::InFlight => room.in_flight -= 1,
                XferState::FailedUnquiesced | XferState::ForcedSilent => room.unquiesced -= 1,
                XferState::Succeeded | XferState::FailedQuiesced => {}
            }
            if matches!(new, XferState::FailedUnquiesced | XferState::ForcedSilent) {
                room.unquiesced += 1;
            }
            let RoleData::Sender { parts, .. } = &mut room.data else { unreachable!() };
            parts[xref.part as usize].chunks[xref.chunk as usize].state = new;
        };
        let protocol_failure = |core: &mut Core| {
            if !core.room_at(slot).state.is_terminal() {
                core.fail_room(now, slot, RoomInput::PluginFailure, FailReason::PluginProtocolViolation, None, None);
            }
        };
        match event.kind {
            EventKind::SUCCEEDED => match state {
                XferState::InFlight if event.bytes == bytes => {
                    set_state(self, XferState::Succeeded);
                    self.metrics.bytes_moved += bytes;
                    self.room_mut(slot).bytes_done += bytes;
                    if live {
                        self.chunk_succeeded(now, slot, xref.part);
                    } else {
                        self.check_release(now, slot);
                    }
                }
                XferState::InFlight => {
                    self.violation(ViolationClause::SucceededBytesMismatch);
                    set_state(self, XferState::FailedQuiesced);
                    protocol_failure(self);
                    self.check_release(now, slot);
                }
                XferState::ForcedSilent => {
                    self.count_late(LateSource::Plugin);
                    set_state(self, XferState::Succeeded);
                    self.check_release(now, slot);
                }
                _ => {
                    self.violation(ViolationClause::DuplicateEvent);
                    protocol_failure(self);
                }
            },
            EventKind::FAILED => {
                let known_reason = event.reason.0 != 0 && event.reason.is_known();
                if !known_reason {
                    self.violation(ViolationClause::UnknownReasonCode);
                }
                let quiesced = event.flags & kvgate_abi::event_flags::QUIESCED != 0;
                let next = if quiesced { XferState::FailedQuiesced } else { XferState::FailedUnquiesced };
                match state {
                    XferState::InFlight => {
                        set_state(self, next);
                        if live {
                            let (reason, code) = if known_reason {
                                (FailReason::PluginFailed, Some(event.reason.0))
                            } else {
                                (FailReason::PluginProtocolViolation, None)
                            };
                            self.fail_room(now, slot, RoomInput::PluginFailure, reason, None, code);
                        } else {
                            self.check_release(now, slot);
                        }
                    }
                    XferState::ForcedSilent => {
                        self.count_late(LateSource::Plugin);
                        if quiesced {
                            set_state(self, XferState::FailedQuiesced);
                            self.check_release(now, slot);
                        }
                    }
                    _ => {
                        self.violation(ViolationClause::DuplicateEvent);
                        protocol_failure(self);
                    }
                }
            }
            EventKind::QUIESCED => match state {
                XferState::FailedUnquiesced | XferState::ForcedSilent => {
                    set_state(self, XferState::FailedQuiesced);
                    self.check_release(now, slot);
                }
                XferState::InFlight => {
                    self.violation(ViolationClause::QuiescedBeforeTerminal);
                    set_state(self, XferState::FailedQuiesced);
                    protocol_failure(self);
                    self.check_release(now, slot);
                }
                XferState::Succeeded | XferState::FailedQuiesced => self.violation(ViolationClause::DuplicateEvent),
            },
            EventKind::PROGRESS => {
                if state != XferState::InFlight {
                    self.violation(ViolationClause::EventAfterTerminal);
                }
            }
            _ => {
                // An unknown kind (or an incoming kind without the incoming flag): never "keep waiting".
                self.violation(ViolationClause::UnknownEventKind);
                protocol_failure(self);
            }
        }
        let _ = ReasonCode::CANCELLED;
    }

    /// A chunk of a live sender room succeeded: complete its part, maybe the room.
    fn chunk_succeeded(&mut self, now: Nanos, slot: u32, part: u32) {
        let room = self.room_mut(slot);
        room.touch(now, LastEvent::ChunkSucceeded);
        let key = room.key;
        let RoleData::Sender { parts, .. } = &mut room.data else { unreachable!() };
        let target = &mut parts[part as usize];
        target.chunks_succeeded += 1;
        let part_complete = target.last_seen && target.chunks_succeeded == target.next_chunk && target.held.is_empty();
        if !part_complete {
            self.step(now, slot, RoomInput::ChunkSucceeded);
            return;
        }
        target.done = true;
        let part_bytes = target.dest_total;
        room.parts_done += 1;
        let all_done = room.parts_done == room.part_count();
        let peer = room.peer().expect("a transferring room has a peer");
        self.push_engine(RoomEvent::PartSucceeded { room: key, role: Role::Sender, part, bytes: part_bytes });
        self.push_peer(peer, PeerMessage::PartDone { room: key, part, bytes: part_bytes });
        if all_done {
            self.succeed_room(now, slot);
        } else {
            self.step(now, slot, RoomInput::PartDone);
        }
    }

    /// Receiver-side events about an incoming ticket (from the plugin it is open on).
    fn incoming_event(&mut self, now: Nanos, plugin: PluginSlot, event: &Event) {
        let ticket = event.xfer.0;
        let Some(tref) = self.tickets.get(ticket) else {
            if ticket != 0 && ticket < self.next_ticket {
                self.count_late(LateSource::Plugin);
            } else {
                self.violation(ViolationClause::UnknownTicket);
            }
            return;
        };
        if tref.slot == super::TOMBSTONE_SLOT {
            return self.settled_ticket_event(tref, plugin, event);
        }
        let slot = tref.slot;
        debug_assert_eq!(self.epoch(slot), tref.epoch);
        let RoleData::Receiver { parts, .. } = &self.room_at(slot).data else { unreachable!() };
        if parts[tref.part as usize].plugin != plugin {
            return self.violation(ViolationClause::WrongPlugin);
        }
        let live = !self.room_at(slot).state.is_terminal();
        match event.kind {
            EventKind::QUIESCED => {
                let room = self.room_mut(slot);
                let RoleData::Receiver { parts, .. } = &mut room.data else { unreachable!() };
                let target = &mut parts[tref.part as usize];
                if !target.ticket_open {
                    // The answer to the cancel we sent on success: expected, nothing to do.
                    if room.state != RoomState::Succeeded {
                        self.violation(ViolationClause::DuplicateEvent);
                    }
                    return;
                }
                target.ticket_open = false;
                room.in_flight -= 1;
                if live {
                    // The plugin closed the ticket before the room ended: writes can no longer land.
                    self.fail_room(now, slot, RoomInput::PluginFailure, FailReason::IncomingFailed, None, None);
                } else if self.room_at(slot).in_flight == 0 && self.room_at(slot).state == RoomState::Quarantined {
                    self.release_quarantine(now, slot, RoomInput::Quiesced, ReleaseCause::Quiesced);
                }
            }
            EventKind::INCOMING_FAILED => {
                let known_reason = event.reason.0 != 0 && event.reason.is_known();
                if !known_reason {
                    self.violation(ViolationClause::UnknownReasonCode);
                }
                if live {
                    let (reason, code) = if known_reason {
                        (FailReason::IncomingFailed, Some(event.reason.0))
                    } else {
                        (FailReason::PluginProtocolViolation, None)
                    };
                    self.fail_room(now, slot, RoomInput::PluginFailure, reason, None, code);
                } else {
                    self.count_late(LateSource::Plugin);
                }
            }
            _ => {
                self.violation(ViolationClause::UnknownEventKind);
                if live {
                    self.fail_room(now, slot, RoomInput::PluginFailure, FailReason::PluginProtocolViolation, None, None);
                }
            }
        }
    }
}
