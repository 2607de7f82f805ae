//! The peer side: peer up/lost, the intrusive list of each peer's live rooms, and the messages one
//! core sends another (expect notice, matched, part done, abort, room failed, quiesced). It trusts
//! no message: anything for an unknown, stale or terminal room, or that contradicts what this side
//! announced (a part done with another byte count), is counted late and changes nothing.

use super::engine::PlaceError;
use super::room::{DestSlice, RoleData, SendPart, NIL};
use super::store::Lookup;
use super::{Core, PeerEntry};
use crate::api::*;
use crate::metrics::LateSource;
use crate::table::RoomInput;
use crate::timer::TimerKind;
use kvgate_abi::{PeerId, Ticket};

impl Core {
    pub(super) fn peer_up(&mut self, now: At, peer: PeerId, incarnation: u64, plugins: &[PeerPlugin]) {
        if let Some(entry) = self.peers.get(&peer) {
            if entry.incarnation == incarnation {
                return;
            }
            self.peer_lost(now, peer, PeerLoss::Restarted);
        }
        // Slots past `MAX_PLUGIN_SLOTS` cannot be named by a part (kept in one byte).
        let plugins = plugins.iter().copied().filter(|p| p.slot.0 < super::room::MAX_PLUGIN_SLOTS).collect();
        let entry = PeerEntry {
            incarnation,
            plugins,
            retired: smallvec::SmallVec::new(),
            bytes_moving: 0,
            room_head: NIL,
            remote_regions: super::peer_keyed_map(),
        };
        self.peers.insert(peer, entry);
    }

    // CONFORMANCE: TIME-7
    pub(super) fn peer_lost(&mut self, now: At, peer: PeerId, _cause: PeerLoss) {
        self.fail_peer_rooms(now, peer, FailReason::PeerLost);
        self.extra_bound.remove(&peer);
        let Some(entry) = self.peers.remove(&peer) else { return };
        // Rooms still listed (quarantined) keep waiting for a local quiesce or their timer.
        let mut slot = entry.room_head;
        while slot != NIL {
            let room = self.room_mut(slot);
            let next = room.peer_next;
            room.peer_prev = NIL;
            room.peer_next = NIL;
            room.in_peer_list = false;
            slot = next;
        }
    }

    /// Fail every live room bound to `peer` with `reason`, and every live room with a part from it.
    pub(super) fn fail_peer_rooms(&mut self, now: At, peer: PeerId, reason: FailReason) {
        let Some(entry) = self.peers.get(&peer) else { return };
        let mut live = Vec::new();
        let mut slot = entry.room_head;
        while slot != NIL {
            let room = self.room_at(slot);
            if !room.state.is_terminal() {
                live.push(slot);
            }
            slot = room.peer_next;
        }
        for &(slot, epoch) in self.extra_bound.get(&peer).into_iter().flatten() {
            if self.rooms.holds(slot, epoch) && !self.room_at(slot).state.is_terminal() {
                live.push(slot);
            }
        }
        let input = if reason == FailReason::PeerLost { RoomInput::PeerLost } else { RoomInput::PluginFailure };
        for slot in live {
            // A room with several senders fails as a whole: the senders still there are told (read
            // before the failure, which may release the room's slot).
            let room = self.room_at(slot);
            let others: smallvec::SmallVec<[PeerId; 2]> =
                if reason == FailReason::PeerLost && self.several_senders(slot) {
                    room.peer().into_iter().chain(room.extra_senders()).filter(|&p| p != peer).collect()
                } else {
                    smallvec::SmallVec::new()
                };
            let key = room.key;
            self.fail_room(now, slot, input, reason, None, None);
            for other in others {
                self.push_peer(other, PeerMessage::RoomFailed { room: key, reason, to: Role::Sender });
            }
        }
    }

    /// Bind a room to its peer (and that peer's preferred plugin, until its parts are assigned
    /// theirs) and list it under the peer.
    pub(super) fn link_peer(&mut self, slot: u32, peer: PeerId) {
        let Some(entry) = self.peers.get_mut(&peer) else { return };
        let head = entry.room_head;
        let plugin = entry.first_plugin();
        entry.room_head = slot;
        if head != NIL {
            self.room_mut(head).peer_prev = slot;
        }
        let room = self.room_mut(slot);
        debug_assert!(!room.in_peer_list);
        room.set_peer(peer, plugin);
        room.peer_prev = NIL;
        room.peer_next = head;
        room.in_peer_list = true;
    }

    pub(super) fn unlink_peer(&mut self, slot: u32) {
        let epoch = self.rooms.epoch(slot);
        let extra: smallvec::SmallVec<[PeerId; 2]> = self.room_at(slot).extra_senders().collect();
        for peer in extra {
            if let Some(rooms) = self.extra_bound.get_mut(&peer) {
                rooms.remove(&(slot, epoch));
            }
        }
        let room = self.room_at(slot);
        if !room.in_peer_list {
            return;
        }
        let (prev, next, peer) = (room.peer_prev, room.peer_next, room.peer().expect("listed room has a peer"));
        if prev != NIL {
            self.room_mut(prev).peer_next = next;
        } else if let Some(entry) = self.peers.get_mut(&peer) {
            entry.room_head = next;
        }
        if next != NIL {
            self.room_mut(next).peer_prev = prev;
        }
        let room = self.room_mut(slot);
        room.peer_prev = NIL;
        room.peer_next = NIL;
        room.in_peer_list = false;
    }

    /// The slot of `key`/`role` if it is exactly this generation and bound to `peer` (or unbound,
    /// or with a part from `peer`).
    fn peer_room(&self, key: RoomKey, role: Role, peer: PeerId) -> Option<u32> {
        match self.rooms.lookup(key, role) {
            Lookup::Same(slot) if self.room_at(slot).peer().is_none() || self.room_at(slot).bound_to(peer) => {
                Some(slot)
            }
            _ => None,
        }
    }

    /// Whether a receiver room's parts come from more than one peer.
    fn several_senders(&self, slot: u32) -> bool {
        matches!(&self.room_at(slot).data, RoleData::Receiver { senders: Some(_), .. })
    }

    pub(super) fn peer_message(&mut self, now: At, peer: PeerId, message: &PeerMessage) {
        match *message {
            PeerMessage::ExpectNotice { room, ref parts, ref tickets, ref plugins, timeout } => {
                self.on_expect_notice(now, peer, room, parts, tickets, plugins, timeout)
            }
            PeerMessage::Matched { room } => match self.peer_room(room, Role::Receiver, peer) {
                Some(slot) if self.room_at(slot).state == RoomState::WaitingSender => {
                    self.receiver_matched(now, slot);
                }
                // The first of several senders moved the room on; the others' words change nothing.
                Some(slot) if self.several_senders(slot) && !self.room_at(slot).state.is_terminal() => {}
                _ => self.count_late(LateSource::Peer),
            },
            PeerMessage::PartDone { room, part, bytes } => self.on_part_done(now, peer, room, part, bytes),
            PeerMessage::Abort { room, reason, to } => {
                self.on_peer_failure(now, peer, room, to, RoomInput::PeerAbort, FailReason::AbortedByPeer, reason)
            }
            PeerMessage::RoomFailed { room, reason, to } => {
                let local = if to == Role::Receiver { FailReason::SenderFailed } else { FailReason::ReceiverFailed };
                self.on_peer_failure(now, peer, room, to, RoomInput::PeerRoomFailed, local, reason)
            }
            PeerMessage::Quiesced { room } => match self.peer_room(room, Role::Receiver, peer) {
                Some(slot) if self.room_at(slot).state == RoomState::Quarantined => {
                    if self.all_senders_quiesced(slot, peer) {
                        self.release_quarantine(now, slot, RoomInput::Quiesced, ReleaseCause::Quiesced);
                    }
                }
                _ => self.count_late(LateSource::Peer),
            },
        }
    }

    /// Note that `peer` said nothing more from it can land in the room; whether every sender has.
    fn all_senders_quiesced(&mut self, slot: u32, peer: PeerId) -> bool {
        let RoleData::Receiver { senders: Some(senders), .. } = &mut self.room_mut(slot).data else { return true };
        for (sender, quiesced) in senders.peers.iter_mut() {
            if *sender == peer {
                *quiesced = true;
            }
        }
        senders.peers.iter().all(|(_, quiesced)| *quiesced)
    }

    fn receiver_matched(&mut self, now: At, slot: u32) {
        self.step(now, slot, RoomInput::Matched);
        let deadline = self.link_transfer_deadline(now, slot);
        self.move_timer(now, slot, TimerKind::Bootstrap, TimerKind::Transfer, deadline);
        self.room_mut(slot).touch(now, LastEvent::Matched);
    }

    fn on_part_done(&mut self, now: At, peer: PeerId, key: RoomKey, part: u32, bytes: u64) {
        let Some(slot) = self.peer_room(key, Role::Receiver, peer) else {
            return self.count_late(LateSource::Peer);
        };
        let room = self.room_mut(slot);
        if room.state.is_terminal() {
            return self.count_late(LateSource::Peer);
        }
        let RoleData::Receiver { parts, senders, .. } = &mut room.data else { unreachable!() };
        let from = |p: &super::room::RecvPart| senders.as_ref().is_none_or(|s| s.peers[p.sender as usize].0 == peer);
        // The sender reports the bytes of the part's destination, which this side announced: any
        // other count is a peer breaking the protocol. Like a word about an unknown or finished
        // part it is counted and changes nothing (never fail-open: the part stays undone, and the
        // room ends by a correct report or its transfer deadline).
        let Some(target) = parts.get_mut(part as usize).filter(|p| !p.done && from(p) && p.bytes == bytes) else {
            return self.count_late(LateSource::Peer);
        };
        target.done = true;
        let part_bytes = target.bytes;
        room.parts_done += 1;
        room.bytes_done += part_bytes;
        room.touch(now, LastEvent::PartDone);
        let all_done = room.parts_done == room.part_count();
        let waiting = room.state == RoomState::WaitingSender;
        self.push_engine(RoomEvent::PartSucceeded { room: key, role: Role::Receiver, part, bytes: part_bytes });
        if all_done {
            self.succeed_room(now, slot);
        } else if waiting {
            self.receiver_matched(now, slot);
        } else {
            self.step(now, slot, RoomInput::PartDone);
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn on_peer_failure(
        &mut self,
        now: At,
        peer: PeerId,
        key: RoomKey,
        to: Role,
        input: RoomInput,
        local_reason: FailReason,
        peer_reason: FailReason,
    ) {
        match self.rooms.lookup(key, to) {
            Lookup::Settled(seq) => {
                let bound = self.rooms.record(seq).peer();
                self.count_late(LateSource::Peer);
                if to == Role::Sender && bound.is_none_or(|bound| bound == peer) {
                    // The receiver waits for our word that nothing more lands.
                    self.push_peer(peer, PeerMessage::Quiesced { room: key });
                }
            }
            Lookup::Same(slot) => {
                if self.room_at(slot).peer().is_some_and(|_| !self.room_at(slot).bound_to(peer)) {
                    return self.count_late(LateSource::Peer);
                }
                let state = self.room_at(slot).state;
                if !state.is_terminal() {
                    if input == RoomInput::PeerAbort {
                        self.room_mut(slot).touch(now, LastEvent::Aborted);
                    }
                    // The room's other senders stop too: the room fails as a whole (read before the
                    // failure, which may release the room's slot).
                    let room = self.room_at(slot);
                    let others: smallvec::SmallVec<[PeerId; 2]> = if to == Role::Receiver {
                        room.extra_senders().chain(room.peer()).filter(|&p| p != peer).collect()
                    } else {
                        smallvec::SmallVec::new()
                    };
                    self.fail_room(now, slot, input, local_reason, Some(peer_reason), None);
                    for other in others {
                        self.push_peer(
                            other,
                            PeerMessage::RoomFailed { room: key, reason: local_reason, to: Role::Sender },
                        );
                    }
                } else {
                    self.count_late(LateSource::Peer);
                    if to == Role::Sender && matches!(state, RoomState::Succeeded | RoomState::Failed) {
                        // The receiver waits for our word that nothing more lands.
                        self.push_peer(peer, PeerMessage::Quiesced { room: key });
                    }
                }
            }
            Lookup::Newer => self.count_late(LateSource::Peer),
            lookup @ (Lookup::Absent | Lookup::Older(_)) => {
                // The counterpart is not here yet: remember the failure so it is refused when it comes.
                // CONFORMANCE: ABORT-6
                if let Lookup::Older(old) = lookup {
                    self.supersede(now, old);
                }
                self.create_tombstone(now, key, to, local_reason);
                if to == Role::Sender {
                    self.push_peer(peer, PeerMessage::Quiesced { room: key });
                }
            }
        }
    }

    /// An expect notice for a room that is already over on this side: tell the receiver at once why
    /// (an abort as an abort, any other failure as the room's failure).
    fn tell_receiver_room_is_over(&mut self, peer: PeerId, key: RoomKey, reason: FailReason) {
        let message = if reason == FailReason::Aborted {
            PeerMessage::Abort { room: key, reason, to: Role::Receiver }
        } else {
            PeerMessage::RoomFailed { room: key, reason, to: Role::Receiver }
        };
        self.push_peer(peer, message);
    }

    #[allow(clippy::too_many_arguments)]
    fn on_expect_notice(
        &mut self,
        now: At,
        peer: PeerId,
        key: RoomKey,
        parts: &[Vec<Slice>],
        tickets: &[Ticket],
        plugins: &[PluginSlot],
        remaining: Span,
    ) {
        if !self.peers.contains_key(&peer) {
            return self.count_late(LateSource::Peer);
        }
        let lookup = self.rooms.lookup(key, Role::Sender);
        let slot = match lookup {
            Lookup::Newer => return self.count_late(LateSource::Peer),
            Lookup::Settled(seq) => {
                let failure = self.rooms.record(seq).failure;
                self.count_late(LateSource::Peer);
                if let Some(failure) = failure {
                    self.tell_receiver_room_is_over(peer, key, failure.reason);
                }
                return;
            }
            Lookup::Same(slot) => {
                let room = self.room_at(slot);
                if room.peer().is_some_and(|bound| bound != peer) || room.state != RoomState::WaitingExpect {
                    let terminal_failure = room.failure.filter(|_| room.state.is_terminal());
                    self.count_late(LateSource::Peer);
                    if let Some(failure) = terminal_failure {
                        self.tell_receiver_room_is_over(peer, key, failure.reason);
                    }
                    return;
                }
                slot
            }
            Lookup::Absent | Lookup::Older(_) => {
                if self.rooms.live() >= self.config.max_inflight_rooms {
                    let message =
                        PeerMessage::RoomFailed { room: key, reason: FailReason::Overloaded, to: Role::Receiver };
                    return self.push_peer(peer, message);
                }
                let parts = self.spare_send_parts();
                let deadline = now.saturating_add(Span::from_ms(self.config.room_timeout_ms));
                self.open_room(now, lookup, Some(peer), || {
                    let data = RoleData::Sender { notice: false, parts };
                    let mut room = super::room::Room::new(key, Role::Sender, RoomState::WaitingSend, now, data);
                    room.deadline = deadline;
                    room
                })
            }
        };
        if self.room_at(slot).peer().is_none() {
            self.link_peer(slot, peer);
        }
        self.room_mut(slot).touch(now, LastEvent::ExpectNotice);
        if let Err(reason) = self.apply_notice(now, slot, peer, parts, tickets, plugins, remaining) {
            self.fail_room(now, slot, RoomInput::MatchFailure, reason, None, None);
        }
    }

    /// Resolve the notice's destination (each part in the plugin the receiver opened its ticket
    /// on), then submit any held chunks in order.
    #[allow(clippy::too_many_arguments)]
    fn apply_notice(
        &mut self,
        now: At,
        slot: u32,
        peer: PeerId,
        notice_parts: &[Vec<Slice>],
        tickets: &[Ticket],
        plugins: &[PluginSlot],
        remaining: Span,
    ) -> Result<(), FailReason> {
        let assigned = self.check_notice(slot, peer, notice_parts, tickets, plugins)?;
        self.resolve_notice(now, slot, peer, notice_parts, tickets, &assigned, remaining);
        if self.room_at(slot).state != RoomState::WaitingExpect {
            return Ok(());
        }
        self.step(now, slot, RoomInput::ExpectNotice);
        self.start_transfer(now, slot);
        self.submit_held_chunks(now, slot)
    }

    /// Check an expect notice against the room's held sends and the peer's regions, changing
    /// nothing; returns each part's plugin (an old receiver names none: every part uses the link's
    /// preferred one).
    fn check_notice(
        &self,
        slot: u32,
        peer: PeerId,
        notice_parts: &[Vec<Slice>],
        tickets: &[Ticket],
        plugins: &[PluginSlot],
    ) -> Result<smallvec::SmallVec<[PluginSlot; 4]>, FailReason> {
        let RoleData::Sender { parts: held, .. } = &self.room_at(slot).data else { unreachable!() };
        if notice_parts.is_empty()
            || notice_parts.len() as u64 > self.config.max_parts_per_room
            || tickets.len() != notice_parts.len()
            || held.len() > notice_parts.len()
            || !(plugins.is_empty() || plugins.len() == 1 || plugins.len() == notice_parts.len())
        {
            return Err(FailReason::LayoutMismatch);
        }
        let entry = &self.peers[&peer];
        let part_plugin = |index: usize| match plugins.len() {
            0 => entry.first_plugin(),
            1 => plugins[0],
            _ => plugins[index],
        };
        // A part with no slices is another sender's: at least one must be this sender's, and no
        // chunk may be held for another's.
        let foreign = |index: usize| notice_parts[index].is_empty();
        let held_foreign = held.iter().enumerate().any(|(i, p)| foreign(i) && !p.held.is_empty());
        if notice_parts.iter().all(Vec::is_empty) || held_foreign {
            return Err(FailReason::LayoutMismatch);
        }
        let remote = &entry.remote_regions;
        for (index, part) in notice_parts.iter().enumerate().filter(|(index, _)| !foreign(*index)) {
            let plugin = part_plugin(index);
            if !entry.has_plugin(plugin) {
                return Err(FailReason::NoPluginForMemory);
            }
            for slice in part {
                let Some(region) = remote.get(&slice.region).filter(|r| r.key_for(plugin).is_some()) else {
                    return Err(FailReason::UnknownRemoteRegion);
                };
                if slice.len == 0 || slice.offset.checked_add(slice.len).is_none_or(|end| end > region.len) {
                    return Err(FailReason::UnknownRemoteRegion);
                }
            }
        }
        Ok((0..notice_parts.len()).map(part_plugin).collect())
    }

    /// Write a checked notice into the room: each part's destination in the peer's keys, its ticket
    /// and plugin (another sender's part is done from the start), the room's bytes, and the
    /// receiver's deadline when it comes before the room's own.
    #[allow(clippy::too_many_arguments)]
    fn resolve_notice(
        &mut self,
        now: At,
        slot: u32,
        peer: PeerId,
        notice_parts: &[Vec<Slice>],
        tickets: &[Ticket],
        assigned: &[PluginSlot],
        remaining: Span,
    ) {
        let room_cap = Span::from_ms(self.config.max_room_timeout_ms);
        let notice_deadline = now.saturating_add(if remaining < room_cap { remaining } else { room_cap });
        let remote = &self.peers[&peer].remote_regions;
        let room = self.rooms.get_mut(slot);
        let RoleData::Sender { notice, parts } = &mut room.data else { unreachable!() };
        *notice = true;
        parts.reserve_exact(notice_parts.len().saturating_sub(parts.len()));
        parts.resize_with(notice_parts.len(), SendPart::default);
        let mut bytes_total = 0;
        for (((part, notice_part), &ticket), &plugin) in parts.iter_mut().zip(notice_parts).zip(tickets).zip(assigned) {
            let mut dest = smallvec::SmallVec::with_capacity(notice_part.len());
            let mut total = 0u64;
            for slice in notice_part {
                let key = remote[&slice.region].key_for(plugin).expect("checked by check_notice");
                dest.push(DestSlice { key, offset: slice.offset, len: slice.len });
                total += slice.len;
            }
            part.dest = dest;
            part.dest_total = total;
            part.ticket = ticket;
            if notice_part.is_empty() {
                part.done = true;
                room.parts_done += 1;
            } else {
                part.set_plugin(plugin);
            }
            bytes_total += total;
        }
        room.bytes_total = bytes_total;
        let own = notice_parts.iter().position(|p| !p.is_empty()).expect("checked by check_notice");
        room.set_peer(peer, assigned[own]);
        if notice_deadline < room.deadline {
            room.deadline = notice_deadline;
            self.arm(now, slot, TimerKind::Room, notice_deadline);
        }
    }

    /// The room matched: submit the chunks held before the notice, part by part in order. The
    /// first that does not fit its destination fails the room (the rest are dropped with it).
    fn submit_held_chunks(&mut self, now: At, slot: u32) -> Result<(), FailReason> {
        let part_count = self.room_at(slot).part_count();
        for part in 0..part_count {
            let held = {
                let RoleData::Sender { parts, .. } = &mut self.room_mut(slot).data else { unreachable!() };
                std::mem::take(&mut parts[part as usize].held)
            };
            let count = held.len() as u64;
            let mut result = Ok(());
            for chunk in &held {
                match self.place_chunk(now, slot, part, chunk.at, &chunk.slices, chunk.last) {
                    Ok(segments) => self.submit_last_placed(now, slot, part, segments),
                    Err(error) => {
                        result = Err(match error {
                            PlaceError::UnknownRegion => FailReason::RegionUnregistered,
                            PlaceError::NotInPlugin => FailReason::NoPluginForMemory,
                            // Held chunks that overlap, or run past the destination: they do not fit it.
                            PlaceError::LengthMismatch | PlaceError::Overlap => FailReason::LengthMismatch,
                            PlaceError::TooManySegments => FailReason::TooManySegments,
                        });
                        break;
                    }
                }
            }
            self.metrics.pending_sends -= count;
            result?;
        }
        Ok(())
    }
}
