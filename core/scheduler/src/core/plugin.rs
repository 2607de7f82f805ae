//! Plugin events, never trusted: unknown, duplicate or late events are counted violations (per
//! clause); an unknown kind or reason fails the room `plugin_protocol_violation`. What an event does
//! to a transfer or a ticket is read from the declared lifecycle tables (`crate::lifecycle`), for a
//! live room and a settled one alike; these handlers only find the transfer or ticket and carry out
//! the row. It never waits on a plugin: silence is handled by the plugin-grace timer.

use super::room::RoleData;
use super::store::TOMBSTONE_SLOT;
use super::Core;
use crate::api::*;
use crate::lifecycle::{
    ticket_transition, transfer_transition, RefusedInput, TicketEffect, TicketInput, TicketState, TicketStep,
    TransferEffect, TransferInput, TransferState, TransferStep, Verdict,
};
use crate::metrics::LateSource;
use crate::table::RoomInput;
use kvgate_abi::{event_flags, Event, EventKind};

/// Where a transfer's state is kept: a live (or quarantined) room's chunk, or entry `entry` of the
/// settled room's tombstone record at FIFO index `index`.
#[derive(Clone, Copy)]
enum TransferSite {
    Live { slot: u32, part: u32, chunk: u32 },
    Settled { index: usize, entry: usize },
}

/// Where a ticket's state is kept: a live (or quarantined) room's part, or entry `entry` of the
/// settled room's tombstone record at FIFO index `index`.
#[derive(Clone, Copy)]
enum TicketSite {
    Live { slot: u32, part: u32 },
    Settled { index: usize, entry: usize },
}

/// The transfer table's input for a plugin event about a transfer of `bytes` bytes.
fn transfer_input(event: &Event, bytes: u64) -> TransferInput {
    match event.kind {
        EventKind::SUCCEEDED if event.bytes == bytes => TransferInput::Succeeded,
        EventKind::SUCCEEDED => TransferInput::SucceededBytesMismatch,
        EventKind::FAILED if event.flags & event_flags::QUIESCED != 0 => TransferInput::FailedQuiesced,
        EventKind::FAILED => TransferInput::FailedUnquiesced,
        EventKind::QUIESCED => TransferInput::Quiesced,
        EventKind::PROGRESS => TransferInput::Progress,
        // An unknown kind (or an incoming kind without the incoming flag).
        _ => TransferInput::UnknownKind,
    }
}

/// The ticket table's input for a plugin event about a ticket.
fn ticket_input(event: &Event) -> TicketInput {
    match event.kind {
        EventKind::QUIESCED => TicketInput::Quiesced,
        EventKind::INCOMING_FAILED => TicketInput::IncomingFailed,
        _ => TicketInput::UnknownKind,
    }
}

impl Core {
    /// Count a violation by `plugin`'s `event` and report it (`Command::Violation`), naming the
    /// room the event's transfer id or ticket belongs to.
    fn violation(&mut self, clause: ViolationClause, plugin: PluginSlot, event: &Event) {
        self.metrics.violations[clause.index()] += 1;
        let id = event.xfer.0;
        let room = if event.is_incoming() { self.rooms.owner_of_ticket(id) } else { self.rooms.owner_of_transfer(id) };
        let violation =
            Violation { clause, plugin: Some(plugin), event: Some(event.kind.as_str()), xfer: id, room, count: 1 };
        self.commands.push_back(Command::Violation(violation));
    }

    /// Count what a table row says the input was.
    fn count_verdict(&mut self, verdict: Verdict, plugin: PluginSlot, event: &Event) {
        match verdict {
            Verdict::Accepted => {}
            Verdict::Late => self.count_late(LateSource::Plugin),
            Verdict::Violation(clause) => self.violation(clause, plugin, event),
        }
    }

    /// The plugin's reason code of a failure, if this side knows it (an unknown or missing one is a
    /// counted violation).
    fn known_reason(&mut self, plugin: PluginSlot, event: &Event) -> Option<u32> {
        let known = event.reason.0 != 0 && event.reason.is_known();
        if !known {
            self.violation(ViolationClause::UnknownReasonCode, plugin, event);
        }
        known.then_some(event.reason.0)
    }

    // CONFORMANCE: ABORT-9, TIME-10
    pub(super) fn plugin_event(&mut self, now: At, plugin: PluginSlot, event: &Event) {
        if event.is_incoming() {
            return self.ticket_event(now, plugin, event);
        }
        match event.kind {
            EventKind::PEER_DOWN => self.fail_peer_rooms(now, event.peer, FailReason::PeerLost),
            EventKind::UNHEALTHY => self.plugin_unhealthy(now, plugin),
            _ => self.transfer_event(now, plugin, event),
        }
    }

    /// Every room with a peer the plugin serves fails: a room whose parts use other plugins fails
    /// too (a bound, never a wait).
    fn plugin_unhealthy(&mut self, now: At, plugin: PluginSlot) {
        let peers: Vec<_> =
            self.peers.iter().filter(|(_, entry)| entry.has_plugin(plugin)).map(|(peer, _)| *peer).collect();
        for peer in peers {
            self.fail_peer_rooms(now, peer, FailReason::PluginFailed);
        }
    }

    /// The transfer an event names, if this core issued it to `plugin` and still knows it (an id
    /// issued and forgotten is late, one never issued or from another plugin a violation).
    fn transfer_site(&mut self, plugin: PluginSlot, event: &Event) -> Option<TransferSite> {
        let xfer = event.xfer.0;
        let Some(xref) = self.rooms.transfer(xfer) else {
            if self.rooms.transfer_issued(xfer) {
                self.count_late(LateSource::Plugin);
            } else {
                self.violation(ViolationClause::UnknownXfer, plugin, event);
            }
            return None;
        };
        if xref.plugin != plugin {
            self.violation(ViolationClause::WrongPlugin, plugin, event);
            return None;
        }
        if xref.slot == TOMBSTONE_SLOT {
            return Some(TransferSite::Settled {
                index: self.rooms.record_index(xref.epoch),
                entry: xref.part as usize,
            });
        }
        debug_assert_eq!(self.rooms.epoch(xref.slot), xref.epoch);
        Some(TransferSite::Live { slot: xref.slot, part: xref.part, chunk: xref.chunk })
    }

    /// A transfer's state and byte count.
    fn transfer_at(&self, site: TransferSite) -> (TransferState, u64) {
        match site {
            TransferSite::Live { slot, part, chunk } => {
                let RoleData::Sender { parts, .. } = &self.room_at(slot).data else {
                    unreachable!("transfers belong to senders")
                };
                let chunk = &parts[part as usize].chunks[chunk as usize];
                (chunk.state, chunk.bytes)
            }
            TransferSite::Settled { index, entry } => {
                let settled = &self.rooms.record_at(index).ids[entry];
                (settled.state, settled.bytes)
            }
        }
    }

    /// An event about an outgoing transfer: its row in the transfer table, carried out.
    fn transfer_event(&mut self, now: At, plugin: PluginSlot, event: &Event) {
        let Some(site) = self.transfer_site(plugin, event) else { return };
        let (state, bytes) = self.transfer_at(site);
        let input = transfer_input(event, bytes);
        let reason = if event.kind == EventKind::FAILED { self.known_reason(plugin, event) } else { None };
        let step = match transfer_transition(state, input) {
            Ok(step) => step,
            Err(illegal) => return self.count_refused_input(RefusedInput::Transfer(illegal)),
        };
        self.count_verdict(step.verdict, plugin, event);
        match site {
            TransferSite::Live { slot, part, chunk } => {
                self.live_transfer_step(now, slot, part, chunk, bytes, state, step, reason)
            }
            TransferSite::Settled { index, entry } => {
                let record = self.rooms.record_at_mut(index);
                record.ids[entry].state = step.next;
                if step.effect == TransferEffect::Landed {
                    record.bytes_done += bytes;
                    self.metrics.bytes_moved += bytes;
                }
            }
        }
    }

    /// Set a live room's chunk to `next` (from `from`), keeping the room's in-flight and unquiesced
    /// counts.
    pub(super) fn set_transfer_state(
        &mut self,
        slot: u32,
        part: u32,
        chunk: u32,
        from: TransferState,
        next: TransferState,
    ) {
        let room = self.room_mut(slot);
        room.in_flight -= from.is_in_flight() as u32;
        room.unquiesced -= from.is_unquiesced() as u32;
        room.in_flight += next.is_in_flight() as u32;
        room.unquiesced += next.is_unquiesced() as u32;
        let RoleData::Sender { parts, .. } = &mut room.data else { unreachable!("transfers belong to senders") };
        parts[part as usize].chunks[chunk as usize].state = next;
    }

    /// A transfer table row for a live (or quarantined) room's chunk. Whenever the transfer's state
    /// changes, a quarantined room with nothing left in flight is released.
    #[allow(clippy::too_many_arguments)]
    fn live_transfer_step(
        &mut self,
        now: At,
        slot: u32,
        part: u32,
        chunk: u32,
        bytes: u64,
        from: TransferState,
        step: TransferStep,
        reason: Option<u32>,
    ) {
        let live = !self.room_at(slot).state.is_terminal();
        self.set_transfer_state(slot, part, chunk, from, step.next);
        match step.effect {
            TransferEffect::Nothing => {}
            TransferEffect::Landed => {
                self.metrics.bytes_moved += bytes;
                self.room_mut(slot).bytes_done += bytes;
                if live {
                    self.chunk_succeeded(now, slot, part);
                }
            }
            TransferEffect::Failed if live => {
                let cause =
                    if reason.is_some() { FailReason::PluginFailed } else { FailReason::PluginProtocolViolation };
                self.fail_room(now, slot, RoomInput::PluginFailure, cause, None, reason);
            }
            TransferEffect::ProtocolViolation if live => {
                self.fail_room(now, slot, RoomInput::PluginFailure, FailReason::PluginProtocolViolation, None, None);
            }
            TransferEffect::Failed | TransferEffect::ProtocolViolation => {}
        }
        if step.next != from {
            self.check_release(now, slot);
        }
    }

    /// A chunk of a live sender room succeeded: complete its part, maybe the room.
    fn chunk_succeeded(&mut self, now: At, slot: u32, part: u32) {
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

    /// The ticket an incoming event names, if this core issued it and still knows it and it is open
    /// on `plugin` (a ticket issued and forgotten is late, one never issued or on another plugin a
    /// violation).
    fn ticket_site(&mut self, plugin: PluginSlot, event: &Event) -> Option<TicketSite> {
        let ticket = event.xfer.0;
        let Some(tref) = self.rooms.ticket(ticket) else {
            if self.rooms.ticket_issued(ticket) {
                self.count_late(LateSource::Plugin);
            } else {
                self.violation(ViolationClause::UnknownTicket, plugin, event);
            }
            return None;
        };
        let (site, on) = if tref.slot == TOMBSTONE_SLOT {
            let (index, entry) = (self.rooms.record_index(tref.epoch), tref.part as usize);
            (TicketSite::Settled { index, entry }, self.rooms.record_at(index).ids[entry].plugin)
        } else {
            debug_assert_eq!(self.rooms.epoch(tref.slot), tref.epoch);
            let RoleData::Receiver { parts, .. } = &self.room_at(tref.slot).data else {
                unreachable!("tickets belong to receivers")
            };
            (TicketSite::Live { slot: tref.slot, part: tref.part }, parts[tref.part as usize].plugin)
        };
        if on != plugin {
            self.violation(ViolationClause::WrongPlugin, plugin, event);
            return None;
        }
        Some(site)
    }

    /// Receiver-side events about an incoming ticket: its row in the ticket table, carried out.
    fn ticket_event(&mut self, now: At, plugin: PluginSlot, event: &Event) {
        let Some(site) = self.ticket_site(plugin, event) else { return };
        let state = match site {
            TicketSite::Live { slot, part } => {
                let RoleData::Receiver { parts, .. } = &self.room_at(slot).data else { unreachable!() };
                parts[part as usize].ticket
            }
            TicketSite::Settled { index, entry } => self.rooms.record_at(index).ids[entry].ticket,
        };
        let input = ticket_input(event);
        let reason = if input == TicketInput::IncomingFailed { self.known_reason(plugin, event) } else { None };
        let step = match ticket_transition(state, input) {
            Ok(step) => step,
            Err(illegal) => return self.count_refused_input(RefusedInput::Ticket(illegal)),
        };
        self.count_verdict(step.verdict, plugin, event);
        match site {
            TicketSite::Live { slot, part } => self.live_ticket_step(now, slot, part, step, reason),
            TicketSite::Settled { index, entry } => {
                self.rooms.record_at_mut(index).ids[entry].ticket = step.next;
                if step.effect == TicketEffect::Failed {
                    self.count_late(LateSource::Plugin);
                }
            }
        }
    }

    /// A ticket table row for a live (or quarantined) receiver room's part.
    fn live_ticket_step(&mut self, now: At, slot: u32, part: u32, step: TicketStep, reason: Option<u32>) {
        let room = self.room_mut(slot);
        let live = !room.state.is_terminal();
        let RoleData::Receiver { parts, .. } = &mut room.data else { unreachable!() };
        parts[part as usize].ticket = step.next;
        match step.effect {
            TicketEffect::Nothing => {}
            TicketEffect::Closed => {
                room.in_flight -= 1;
                if live {
                    // The plugin closed the ticket before the room ended: writes can no longer land.
                    self.fail_room(now, slot, RoomInput::PluginFailure, FailReason::IncomingFailed, None, None);
                } else if room.in_flight == 0 && room.state == RoomState::Quarantined {
                    self.release_quarantine(now, slot, RoomInput::Quiesced, ReleaseCause::Quiesced);
                }
            }
            TicketEffect::Failed if live => {
                let cause =
                    if reason.is_some() { FailReason::IncomingFailed } else { FailReason::PluginProtocolViolation };
                self.fail_room(now, slot, RoomInput::PluginFailure, cause, None, reason);
            }
            TicketEffect::Failed => self.count_late(LateSource::Plugin),
            TicketEffect::ProtocolViolation if live => {
                self.fail_room(now, slot, RoomInput::PluginFailure, FailReason::PluginProtocolViolation, None, None);
            }
            TicketEffect::ProtocolViolation => {}
        }
    }
}

/// The state the core's own inputs lead to, read from the tables at compile time (a table that
/// refused them would not build): a transfer the grace timer forces, a ticket cancelled on success.
pub(super) const FORCED_SILENT: TransferStep =
    match transfer_transition(TransferState::InFlight, TransferInput::GraceExpired) {
        Ok(step) => step,
        Err(_) => panic!("the transfer table forces in-flight transfers"),
    };
pub(super) const CANCELLED_ON_SUCCESS: TicketState =
    match ticket_transition(TicketState::Open, TicketInput::RoomSucceeded) {
        Ok(step) => step.next,
        Err(_) => panic!("the ticket table cancels open tickets on success"),
    };

#[cfg(test)]
mod tests {
    use super::*;

    /// A refused input is counted and kept for the gateway to report (in a debug build the core
    /// also stops at once: a refused input is a core bug).
    #[test]
    #[cfg_attr(debug_assertions, should_panic(expected = "illegal transfer transition"))]
    fn a_refused_lifecycle_input_is_counted_and_kept() {
        let mut core = Core::new(crate::CoreConfig::default()).unwrap();
        let illegal = transfer_transition(TransferState::Succeeded, TransferInput::GraceExpired).unwrap_err();
        core.count_refused_input(RefusedInput::Transfer(illegal));
        let illegal = ticket_transition(TicketState::Closed, TicketInput::RoomSucceeded).unwrap_err();
        core.count_refused_input(RefusedInput::Ticket(illegal));
        assert_eq!(core.metrics.illegal_transitions, 2);
        assert_eq!(core.metrics.latest_illegal_transition, Some(RefusedInput::Ticket(illegal)));
    }
}
