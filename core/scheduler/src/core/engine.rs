//! Engine requests: expect (receiver), send (sender), abort (either). Every check that can refuse
//! runs before anything changes, so a refusal leaves the core as it was. It never moves a byte
//! itself: accepted chunks become `Submit` commands.

use super::mapping::{insert_range, map_chunk, stream_position, SourceSlice};
use super::room::{ChunkXfer, HeldChunk, Placement, RecvPart, RoleData, Room, SendPart, AT_CURSOR};
use super::store::{Lookup, TicketRef, XferRef};
use super::{Core, LocalRegion};
use crate::api::*;
use crate::lifecycle::{TicketState, TransferState};
use crate::metrics::{HarmlessAbort, LateSource};
use crate::table::RoomInput;
use crate::timer::TimerKind;
use kvgate_abi::{LocalRange, PeerId, Ticket, XferId};

/// Why a chunk could not be placed in its destination stream.
pub(super) enum PlaceError {
    /// A source region is unknown.
    UnknownRegion,
    /// A source region is not registered with the part's plugin.
    NotInPlugin,
    /// More bytes than the destination has left, or a last chunk that leaves it short.
    LengthMismatch,
    TooManySegments,
    /// An explicitly placed chunk covers bytes another chunk of the part covers already.
    Overlap,
}

/// A send's slices: owned (from `EngineRequest::Send`) or borrowed (`Core::handle_send`). Copied
/// only when the chunk must be held (before the expect notice).
pub(super) enum SendSlices<'a> {
    Owned(Vec<Slice>),
    Borrowed(&'a [Slice]),
}

impl SendSlices<'_> {
    fn as_slice(&self) -> &[Slice] {
        match self {
            SendSlices::Owned(slices) => slices,
            SendSlices::Borrowed(slices) => slices,
        }
    }

    fn into_boxed(self) -> Box<[Slice]> {
        match self {
            SendSlices::Owned(slices) => slices.into_boxed_slice(),
            SendSlices::Borrowed(slices) => slices.into(),
        }
    }
}

/// Whether two destination slices of an expect (of one part or of two) cover the same bytes: two
/// writes would race for them. One slice (the common room) needs no work.
fn overlapping_slices<P: AsRef<[Slice]>>(parts: &[P]) -> bool {
    let count: usize = parts.iter().map(|p| p.as_ref().len()).sum();
    if count < 2 {
        return false;
    }
    let mut ranges: smallvec::SmallVec<[(RegionId, u64, u64); 8]> = smallvec::SmallVec::with_capacity(count);
    for part in parts {
        ranges.extend(part.as_ref().iter().map(|s| (s.region, s.offset, s.offset.saturating_add(s.len))));
    }
    ranges.sort_unstable();
    ranges.windows(2).any(|w| w[0].0 == w[1].0 && w[1].1 < w[0].2)
}

/// The senders of a receiver room whose parts come from more than one peer (the bound peer first,
/// each listed once); None when every part comes from the bound peer.
fn receiver_senders(peer: PeerId, part_peers: &[PeerId]) -> Option<Box<super::room::Senders>> {
    (!part_peers.is_empty() && part_peers.iter().any(|&p| p != peer)).then(|| {
        let mut senders = super::room::Senders::default();
        senders.peers.push((peer, false));
        for &sender in part_peers {
            if !senders.peers.iter().any(|(p, _)| *p == sender) {
                senders.peers.push((sender, false));
            }
        }
        Box::new(senders)
    })
}

impl Core {
    fn refuse(room: RoomKey, reason: RefusalReason) -> Result<(), Refusal> {
        Err(Refusal { room, reason })
    }

    /// Check that every slice names a known region and lies inside it; returns the byte count.
    // CONFORMANCE: DATA-5
    fn check_local_slices(&self, room: RoomKey, slices: &[Slice]) -> Result<u64, Refusal> {
        let mut total = 0u64;
        for slice in slices {
            self.region_of_slice(room, slice)?;
            total = total.saturating_add(slice.len);
        }
        Ok(total)
    }

    /// The registered region `slice` names, if the slice is non-empty and lies inside it.
    fn region_of_slice(&self, room: RoomKey, slice: &Slice) -> Result<&LocalRegion, Refusal> {
        let Some(region) = self.regions.get(&slice.region) else {
            return Err(Refusal { room, reason: RefusalReason::UnknownRegion });
        };
        let end = slice.offset.checked_add(slice.len);
        if slice.len == 0 || end.is_none_or(|end| end > region.len) {
            return Err(Refusal { room, reason: RefusalReason::SliceOutOfRange });
        }
        Ok(region)
    }

    /// The plugin one part of an expect uses: the first of the peer's plugins that holds a key for
    /// every destination region of the part and serves the memory kind the sender reads it from
    /// (`source`, or the kind of the part's first destination region). Slices already checked.
    fn part_plugin(
        &self,
        room: RoomKey,
        peer: PeerId,
        slices: &[Slice],
        source: Option<kvgate_abi::MemoryKind>,
    ) -> Result<PluginSlot, Refusal> {
        let entry = &self.peers[&peer];
        let source = source.unwrap_or_else(|| self.regions[&slices[0].region].kind);
        let first = entry.plugins[0].slot;
        // The common case: the preferred plugin serves the part (one region, one lookup).
        let serves = |plugin: &PeerPlugin| {
            plugin.memory_kinds & source.bit() != 0
                && slices.iter().all(|s| self.regions[&s.region].key_for(plugin.slot).is_some())
        };
        if serves(&entry.plugins[0]) {
            return Ok(first);
        }
        entry.plugins[1..]
            .iter()
            .find(|p| serves(p))
            .map(|p| p.slot)
            .ok_or(Refusal { room, reason: RefusalReason::NoPluginForMemory })
    }

    /// One part of an expect in `plugin`'s keys (every region holds one: `part_plugin`); returns its
    /// byte count and ranges.
    fn resolve_expect_part(&mut self, plugin: PluginSlot, slices: &[Slice]) -> (u64, Vec<LocalRange>) {
        let mut total = 0u64;
        let mut ranges = self.spares.ranges.pop().unwrap_or_default();
        ranges.reserve(slices.len());
        for slice in slices {
            total = total.saturating_add(slice.len);
            let key = self.regions[&slice.region].key_for(plugin).expect("part_plugin checked every region");
            ranges.push(LocalRange { key, offset: slice.offset, len: slice.len });
        }
        (total, ranges)
    }

    pub(super) fn engine_expect<P: AsRef<[Slice]>>(
        &mut self,
        now: At,
        key: RoomKey,
        peer: PeerId,
        parts: &[P],
        shape: ExpectShape<'_>,
        timeout_ms: Option<u64>,
    ) -> Result<(), Refusal> {
        let lookup = self.check_expect(key, peer, parts, shape, timeout_ms)?;
        let plugins = self.expect_plugins(key, peer, parts, shape)?;
        // Accepted: from here on nothing refuses.
        self.open_receiver(now, key, peer, lookup, parts, shape, plugins, timeout_ms);
        Ok(())
    }

    /// Every check of an expect that needs no plugin: its limits, its peers, its room key, its
    /// slices. Returns what the store holds for the key (absent or an older generation).
    fn check_expect<P: AsRef<[Slice]>>(
        &self,
        key: RoomKey,
        peer: PeerId,
        parts: &[P],
        shape: ExpectShape<'_>,
        timeout_ms: Option<u64>,
    ) -> Result<Lookup, Refusal> {
        if timeout_ms == Some(0) {
            return Err(Refusal { room: key, reason: RefusalReason::InvalidTimeout });
        }
        if parts.is_empty() || parts.iter().any(|p| p.as_ref().is_empty()) {
            return Err(Refusal { room: key, reason: RefusalReason::EmptyRequest });
        }
        if parts.len() as u64 > self.config.max_parts_per_room {
            return Err(Refusal { room: key, reason: RefusalReason::TooManyParts });
        }
        if parts.iter().any(|p| p.as_ref().len() as u64 > self.config.max_slices_per_request) {
            return Err(Refusal { room: key, reason: RefusalReason::TooManySlices });
        }
        let connected = |peer: &PeerId| self.peers.get(peer).is_some_and(|entry| !entry.plugins.is_empty());
        if !connected(&peer) || !shape.part_peers.iter().all(connected) {
            return Err(Refusal { room: key, reason: RefusalReason::PeerNotConnected });
        }
        let lookup = self.rooms.lookup(key, Role::Receiver);
        let refused = match lookup {
            Lookup::Same(slot) if self.room_at(slot).state.is_terminal() => RefusalReason::RoomTerminal,
            Lookup::Settled(_) => RefusalReason::RoomTerminal,
            Lookup::Same(_) => RefusalReason::DuplicateExpect,
            Lookup::Newer => RefusalReason::StaleGeneration,
            Lookup::Absent | Lookup::Older(_) => {
                // Every slice checked first (a slice out of range is reported before a missing plugin).
                for part in parts {
                    self.check_local_slices(key, part.as_ref())?;
                }
                return Ok(lookup);
            }
        };
        Err(Refusal { room: key, reason: refused })
    }

    /// The plugin of each part of an expect (its sender's first plugin that serves it), then the
    /// checks that come after: no two slices overlap, and there is room for one more room.
    fn expect_plugins<P: AsRef<[Slice]>>(
        &mut self,
        key: RoomKey,
        peer: PeerId,
        parts: &[P],
        shape: ExpectShape<'_>,
    ) -> Result<Vec<PluginSlot>, Refusal> {
        let mut plugins = self.spares.plugin_lists.pop().unwrap_or_default();
        plugins.clear();
        let mut refusal = None;
        for (index, part) in parts.iter().enumerate() {
            let sender = shape.part_peers.get(index).copied().unwrap_or(peer);
            match self.part_plugin(key, sender, part.as_ref(), shape.source_kinds.get(index).copied().flatten()) {
                Ok(plugin) => plugins.push(plugin),
                Err(refused) => {
                    refusal = Some(refused.reason);
                    break;
                }
            }
        }
        if refusal.is_none() && overlapping_slices(parts) {
            refusal = Some(RefusalReason::OverlappingSlices);
        }
        if refusal.is_none() && self.rooms.live() >= self.config.max_inflight_rooms {
            // CONFORMANCE: TIME-11
            refusal = Some(RefusalReason::TooManyRooms);
        }
        match refusal {
            None => Ok(plugins),
            Some(reason) => {
                self.spares.plugin_lists.push(plugins);
                Err(Refusal { room: key, reason })
            }
        }
    }

    /// Each part of an accepted expect as its receiver room keeps it (from sender `sender_index`),
    /// its ranges in its plugin's keys, and the room's bytes.
    #[allow(clippy::type_complexity)]
    fn receiver_parts<P: AsRef<[Slice]>>(
        &mut self,
        parts: &[P],
        plugins: &[PluginSlot],
        sender_index: impl Fn(usize) -> u16,
    ) -> (smallvec::SmallVec<[RecvPart; 1]>, smallvec::SmallVec<[Vec<LocalRange>; 1]>, u64) {
        let mut recv_parts = smallvec::SmallVec::with_capacity(parts.len());
        let mut part_ranges = smallvec::SmallVec::with_capacity(parts.len());
        let mut bytes_total = 0u64;
        for (index, (part, &plugin)) in parts.iter().zip(plugins).enumerate() {
            let (bytes, ranges) = self.resolve_expect_part(plugin, part.as_ref());
            bytes_total += bytes;
            recv_parts.push(RecvPart {
                bytes,
                done: false,
                ticket: TicketState::Open,
                plugin,
                sender: sender_index(index),
            });
            part_ranges.push(ranges);
        }
        (recv_parts, part_ranges, bytes_total)
    }

    /// An accepted expect: open the receiver room (its senders, the bound peer first, and each
    /// part's ranges in its plugin's keys), open each part's ticket on its plugin, and send the
    /// expect notice (one per sender when the parts come from several).
    #[allow(clippy::too_many_arguments)]
    fn open_receiver<P: AsRef<[Slice]>>(
        &mut self,
        now: At,
        key: RoomKey,
        peer: PeerId,
        lookup: Lookup,
        parts: &[P],
        shape: ExpectShape<'_>,
        mut plugins: Vec<PluginSlot>,
        timeout_ms: Option<u64>,
    ) {
        let part_peers = shape.part_peers;
        // Each part's sender: `part_peers[p]`, or `peer` (the room's bound peer) when not given.
        let sender_of = |index: usize| part_peers.get(index).copied().unwrap_or(peer);
        let senders = receiver_senders(peer, part_peers);
        let sender_index = |index: usize| -> u16 {
            senders
                .as_ref()
                .map_or(0, |s| s.peers.iter().position(|(p, _)| *p == sender_of(index)).expect("listed above") as u16)
        };
        let (recv_parts, part_ranges, bytes_total) = self.receiver_parts(parts, &plugins, sender_index);
        let extra_senders: smallvec::SmallVec<[PeerId; 2]> =
            senders.iter().flat_map(|s| s.peers[1..].iter().map(|(p, _)| *p)).collect();
        let ticket_base = self.rooms.reserve_tickets(parts.len() as u64);
        let room_timeout_ms = timeout_ms.unwrap_or(self.config.room_timeout_ms).min(self.config.max_room_timeout_ms);
        let deadline = now.saturating_add(Span::from_ms(room_timeout_ms));
        let in_flight = parts.len() as u32;
        let slot = self.open_room(now, lookup, Some(peer), || {
            let data = RoleData::Receiver { ticket_base, parts: recv_parts, senders };
            let mut room = Room::new(key, Role::Receiver, RoomState::WaitingSender, now, data);
            room.deadline = deadline;
            room.bytes_total = bytes_total;
            room.in_flight = in_flight;
            room.touch(now, LastEvent::Expect);
            room
        });
        let epoch = self.rooms.epoch(slot);
        for &extra in &extra_senders {
            self.extra_bound.entry(extra).or_default().insert((slot, epoch));
        }
        let first = plugins[0];
        self.room_mut(slot).set_peer(peer, first);
        let remaining = deadline.saturating_since(now);
        let mut tickets = self.spares.tickets.pop().unwrap_or_default();
        tickets.reserve(parts.len());
        for (index, ranges) in part_ranges.into_iter().enumerate() {
            let ticket = Ticket(ticket_base + index as u64);
            self.rooms.bind_ticket(ticket.0, TicketRef { slot, epoch, part: index as u32 });
            let plugin = plugins[index];
            self.commands.push_back(Command::ExpectIncoming {
                plugin,
                peer: sender_of(index),
                ticket,
                timeout: remaining,
                ranges,
            });
            tickets.push(ticket);
        }
        if !extra_senders.is_empty() {
            self.push_split_notices(key, peer, parts, part_peers, &tickets, &plugins, remaining, &extra_senders);
            Self::keep_spare(&mut self.spares.tickets, tickets);
            Self::keep_spare(&mut self.spares.plugin_lists, plugins);
            return;
        }
        // One entry when every part uses the same plugin (the common room).
        if plugins.iter().all(|&p| p == first) {
            plugins.truncate(1);
        }
        let parts = self.notice_parts(parts);
        self.push_peer(peer, PeerMessage::ExpectNotice { room: key, parts, tickets, plugins, timeout: remaining });
    }

    /// The expect notices of a room whose parts come from several senders: each sender gets every
    /// part, with no slices (and ticket 0) for the parts another sender sends.
    #[allow(clippy::too_many_arguments)]
    fn push_split_notices<P: AsRef<[Slice]>>(
        &mut self,
        key: RoomKey,
        peer: PeerId,
        parts: &[P],
        part_peers: &[PeerId],
        tickets: &[Ticket],
        plugins: &[PluginSlot],
        remaining: Span,
        extra_senders: &[PeerId],
    ) {
        let sender_of = |index: usize| part_peers.get(index).copied().unwrap_or(peer);
        for sender in std::iter::once(peer).chain(extra_senders.iter().copied()) {
            let own = |index: usize| sender_of(index) == sender;
            let notice_parts =
                parts.iter().enumerate().map(|(i, p)| if own(i) { p.as_ref().to_vec() } else { Vec::new() }).collect();
            let notice_tickets = tickets.iter().enumerate().map(|(i, t)| if own(i) { *t } else { Ticket(0) }).collect();
            let notice_plugins =
                plugins.iter().enumerate().map(|(i, p)| if own(i) { *p } else { PluginSlot::NONE }).collect();
            let message = PeerMessage::ExpectNotice {
                room: key,
                parts: notice_parts,
                tickets: notice_tickets,
                plugins: notice_plugins,
                timeout: remaining,
            };
            self.push_peer(sender, message);
        }
    }

    /// A chunk of a part: placed after the previous chunk's bytes (`at` None, chunks in order), or at
    /// byte `at` of the part's destination stream (any order; the part is done once every byte is
    /// covered exactly once).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn engine_send(
        &mut self,
        now: At,
        key: RoomKey,
        peer: Option<PeerId>,
        part: u32,
        chunk: u32,
        at: Option<u64>,
        slices: SendSlices<'_>,
        last: bool,
    ) -> Result<(), Refusal> {
        if slices.as_slice().is_empty() {
            return Self::refuse(key, RefusalReason::EmptyRequest);
        }
        if slices.as_slice().len() as u64 > self.config.max_slices_per_request {
            return Self::refuse(key, RefusalReason::TooManySlices);
        }
        if part as u64 >= self.config.max_parts_per_room {
            return Self::refuse(key, RefusalReason::TooManyParts);
        }
        if chunk as u64 >= self.config.max_chunks_per_part {
            return Self::refuse(key, RefusalReason::TooManyChunks);
        }
        if let Some(peer) = peer {
            if !self.peers.contains_key(&peer) {
                return Self::refuse(key, RefusalReason::PeerNotConnected);
            }
        }
        self.check_local_slices(key, slices.as_slice())?;
        match self.rooms.lookup(key, Role::Sender) {
            Lookup::Newer => Self::refuse(key, RefusalReason::StaleGeneration),
            Lookup::Same(slot) => self.send_to_existing(now, slot, peer, part, chunk, at, slices, last),
            // CONFORMANCE: ABORT-6
            Lookup::Settled(_) => Self::refuse(key, RefusalReason::RoomTerminal),
            lookup @ (Lookup::Absent | Lookup::Older(_)) => {
                self.open_sender(now, key, lookup, peer, part, chunk, at, slices, last)
            }
        }
    }

    /// The first send of a room this core has not seen: after the room and pending-send limits, a
    /// sender room waiting for the receiver's expect notice, holding the chunk.
    #[allow(clippy::too_many_arguments)]
    fn open_sender(
        &mut self,
        now: At,
        key: RoomKey,
        lookup: Lookup,
        peer: Option<PeerId>,
        part: u32,
        chunk: u32,
        at: Option<u64>,
        slices: SendSlices<'_>,
        last: bool,
    ) -> Result<(), Refusal> {
        if self.rooms.live() >= self.config.max_inflight_rooms {
            return Self::refuse(key, RefusalReason::TooManyRooms);
        }
        if self.metrics.pending_sends >= self.config.max_pending_sends {
            return Self::refuse(key, RefusalReason::TooManyPendingSends);
        }
        if chunk != 0 && at.is_none() {
            return Self::refuse(key, RefusalReason::OutOfOrderChunk);
        }
        let mut parts = self.spare_send_parts();
        parts.reserve_exact(part as usize + 1);
        parts.resize_with(part as usize + 1, SendPart::default);
        let target = &mut parts[part as usize];
        target.held.push(HeldChunk { slices: slices.into_boxed(), at: at.unwrap_or(AT_CURSOR), last });
        target.next_chunk = 1;
        target.placement = if at.is_some() { Placement::Explicit } else { Placement::Cursor };
        // Explicit placement: done when every byte is covered, known once the notice came.
        target.last_seen = last && at.is_none();
        let deadline = now.saturating_add(Span::from_ms(self.config.room_timeout_ms));
        self.open_room(now, lookup, peer, || {
            let data = RoleData::Sender { notice: false, parts };
            let mut room = Room::new(key, Role::Sender, RoomState::WaitingExpect, now, data);
            room.deadline = deadline;
            room.touch(now, LastEvent::Send);
            room
        });
        self.metrics.pending_sends += 1;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn send_to_existing(
        &mut self,
        now: At,
        slot: u32,
        peer: Option<PeerId>,
        part: u32,
        chunk: u32,
        at: Option<u64>,
        slices: SendSlices<'_>,
        last: bool,
    ) -> Result<(), Refusal> {
        let (key, notice, wanted) = self.check_send(slot, peer, part, chunk, at)?;
        if !notice {
            return self.hold_chunk(now, slot, peer, part, at, slices, last, wanted);
        }
        let segments = match self.place_chunk(now, slot, part, at.unwrap_or(AT_CURSOR), slices.as_slice(), last) {
            Ok(segments) => segments,
            Err(PlaceError::UnknownRegion) => return Self::refuse(key, RefusalReason::UnknownRegion),
            Err(PlaceError::NotInPlugin) => return Self::refuse(key, RefusalReason::NoPluginForMemory),
            Err(PlaceError::LengthMismatch) => return Self::refuse(key, RefusalReason::LengthMismatch),
            Err(PlaceError::TooManySegments) => return Self::refuse(key, RefusalReason::TooManySegments),
            Err(PlaceError::Overlap) => return Self::refuse(key, RefusalReason::OverlappingChunk),
        };
        self.room_mut(slot).touch(now, LastEvent::Send);
        if self.room_at(slot).state == RoomState::WaitingSend {
            self.step(now, slot, RoomInput::Send);
            self.start_transfer(now, slot);
        }
        self.submit_last_placed(now, slot, part, segments);
        Ok(())
    }

    /// The checks of a send to an existing sender room, changing nothing: the room is live and
    /// bound to the same peer, the part is its own (once the notice came), and the chunk follows
    /// the part's placement and order. Returns the room's key, whether the notice came, and the
    /// chunk's placement.
    fn check_send(
        &self,
        slot: u32,
        peer: Option<PeerId>,
        part: u32,
        chunk: u32,
        at: Option<u64>,
    ) -> Result<(RoomKey, bool, Placement), Refusal> {
        let room = self.room_at(slot);
        let key = room.key;
        let refusal = |reason| Refusal { room: key, reason };
        if room.state.is_terminal() {
            // CONFORMANCE: ABORT-6
            return Err(refusal(RefusalReason::RoomTerminal));
        }
        if let (Some(asked), Some(bound)) = (peer, room.peer()) {
            if asked != bound {
                return Err(refusal(RefusalReason::PeerMismatch));
            }
        }
        let RoleData::Sender { notice, parts } = &room.data else { unreachable!("sender key maps to a sender room") };
        let notice = *notice;
        // After the notice: a part past the room's, or one another sender sends.
        if notice && parts.get(part as usize).is_none_or(|p| p.foreign()) {
            return Err(refusal(RefusalReason::UnknownPart));
        }
        let (next_chunk, last_seen, placement) = parts
            .get(part as usize)
            .map(|p| (p.next_chunk, p.last_seen, p.placement))
            .unwrap_or((0, false, Placement::Unset));
        let wanted = if at.is_some() { Placement::Explicit } else { Placement::Cursor };
        if placement != Placement::Unset && placement != wanted {
            return Err(refusal(RefusalReason::PlacementMismatch));
        }
        if at.is_some() {
            // Any chunk number, any order: overlaps and the end of the part are checked at placement.
            if last_seen {
                return Err(refusal(RefusalReason::ChunkAfterLast));
            }
        } else {
            if last_seen && chunk >= next_chunk {
                return Err(refusal(RefusalReason::ChunkAfterLast));
            }
            if chunk < next_chunk {
                return Err(refusal(RefusalReason::DuplicateChunk));
            }
            if chunk > next_chunk {
                return Err(refusal(RefusalReason::OutOfOrderChunk));
            }
        }
        Ok((key, notice, wanted))
    }

    /// A chunk sent before the receiver's expect notice: held (bounded by `max_pending_sends`) until
    /// the notice says where its bytes go.
    #[allow(clippy::too_many_arguments)]
    fn hold_chunk(
        &mut self,
        now: At,
        slot: u32,
        peer: Option<PeerId>,
        part: u32,
        at: Option<u64>,
        slices: SendSlices<'_>,
        last: bool,
        wanted: Placement,
    ) -> Result<(), Refusal> {
        let key = self.room_at(slot).key;
        if self.metrics.pending_sends >= self.config.max_pending_sends {
            return Self::refuse(key, RefusalReason::TooManyPendingSends);
        }
        if self.room_at(slot).peer().is_none() {
            if let Some(peer) = peer {
                self.link_peer(slot, peer);
            }
        }
        let RoleData::Sender { parts, .. } = &mut self.room_mut(slot).data else { unreachable!() };
        if part as usize >= parts.len() {
            parts.resize_with(part as usize + 1, SendPart::default);
        }
        let target = &mut parts[part as usize];
        if let Some(at) = at {
            // Before the notice the destination's length is unknown, but overlaps already show.
            let end = at.saturating_add(slices.as_slice().iter().map(|s| s.len).sum());
            let overlaps = target.held.iter().any(|h| {
                let held_end = h.at.saturating_add(h.slices.iter().map(|s| s.len).sum());
                h.at < end && at < held_end
            });
            if overlaps {
                return Self::refuse(key, RefusalReason::OverlappingChunk);
            }
        }
        target.held.push(HeldChunk { slices: slices.into_boxed(), at: at.unwrap_or(AT_CURSOR), last });
        target.next_chunk += 1;
        target.placement = wanted;
        target.last_seen = last && at.is_none();
        self.metrics.pending_sends += 1;
        self.room_mut(slot).touch(now, LastEvent::Send);
        self.step(now, slot, RoomInput::Send);
        Ok(())
    }

    /// Map a chunk onto its part's destination and record it (cursor, chunk count); the submit
    /// itself is `submit_last_placed`. Changes nothing on error.
    /// `at`: the byte of the part's destination stream the chunk starts at, or `AT_CURSOR` (right after
    /// the previous chunk). An explicitly placed chunk must not overlap one already placed nor run
    /// past the part's end; with `last` it must complete the part.
    pub(super) fn place_chunk(
        &mut self,
        _now: At,
        slot: u32,
        part: u32,
        at: u64,
        slices: &[Slice],
        last: bool,
    ) -> Result<Vec<kvgate_abi::Segment>, PlaceError> {
        let plugin = match &self.room_at(slot).data {
            RoleData::Sender { parts, .. } => parts[part as usize].plugin(),
            RoleData::Receiver { .. } => unreachable!("chunks are placed in sender rooms"),
        };
        // Resolve every source key first (nothing changes on error), then map without a copy.
        let mut bytes = 0u64;
        let mut cached: Option<(RegionId, kvgate_abi::LocalKey)> = None;
        for slice in slices {
            if !matches!(cached, Some((region, _)) if region == slice.region) {
                let Some(region) = self.regions.get(&slice.region) else { return Err(PlaceError::UnknownRegion) };
                let Some(key) = region.key_for(plugin) else { return Err(PlaceError::NotInPlugin) };
                cached = Some((slice.region, key));
            }
            bytes += slice.len;
        }
        let regions = &self.regions;
        // Starts with the last key resolved: a chunk from one region needs no second lookup.
        let sources = slices.iter().map(move |slice| {
            let key = match cached {
                Some((region, key)) if region == slice.region => key,
                _ => {
                    let key = regions[&slice.region].key_for(plugin).expect("resolved above");
                    cached = Some((slice.region, key));
                    key
                }
            };
            SourceSlice { key, offset: slice.offset, len: slice.len }
        });
        let max_segments = self.config.max_segments_per_submit;
        let spare = self.spares.segments.pop().unwrap_or_default();
        let RoleData::Sender { parts, .. } = &mut self.rooms.get_mut(slot).data else { unreachable!() };
        let target = &mut parts[part as usize];
        if at != AT_CURSOR {
            // Explicit: [at, at + bytes) of the stream, not overlapping any chunk already placed.
            let end =
                at.checked_add(bytes).filter(|&end| end <= target.dest_total).ok_or(PlaceError::LengthMismatch)?;
            let covered = target.covered.get_or_insert_with(Default::default);
            let index = covered.partition_point(|&(_, e)| e <= at);
            if covered.get(index).is_some_and(|&(s, _)| s < end) {
                return Err(PlaceError::Overlap);
            }
            if last && target.filled + bytes != target.dest_total {
                return Err(PlaceError::LengthMismatch);
            }
            let (start_slice, start_offset) = stream_position(&target.dest, at);
            let (segments, _, _) =
                map_chunk(sources, slices.len(), &target.dest, start_slice, start_offset, max_segments, spare)
                    .map_err(|_| PlaceError::TooManySegments)?;
            insert_range(covered, index, at, end);
            target.placement = Placement::Explicit;
            target.filled += bytes;
            target.last_seen = target.filled == target.dest_total;
            target.chunks.push(ChunkXfer { xfer: 0, bytes, state: TransferState::InFlight });
            return Ok(segments);
        }
        let remaining = target.dest_total - target.filled;
        if bytes > remaining || (last && bytes != remaining) {
            return Err(PlaceError::LengthMismatch);
        }
        let (segments, cursor_slice, cursor_offset) = map_chunk(
            sources,
            slices.len(),
            &target.dest,
            target.cursor_slice,
            target.cursor_offset,
            max_segments,
            spare,
        )
        .map_err(|_| PlaceError::TooManySegments)?;
        target.cursor_slice = cursor_slice;
        target.cursor_offset = cursor_offset;
        target.placement = Placement::Cursor;
        target.filled += bytes;
        target.last_seen = last;
        target.chunks.push(ChunkXfer { xfer: 0, bytes, state: TransferState::InFlight });
        Ok(segments)
    }

    /// Emit the `Submit` of the chunk `place_chunk` just recorded.
    pub(super) fn submit_last_placed(&mut self, now: At, slot: u32, part: u32, segments: Vec<kvgate_abi::Segment>) {
        let epoch = self.rooms.epoch(slot);
        let transfer_deadline = self.timer_deadline(slot, TimerKind::Transfer).unwrap_or(now);
        let timeout = Span(transfer_deadline.saturating_since(now).0.max(1_000_000));
        let (plugin, chunk) = {
            let RoleData::Sender { parts, .. } = &self.room_at(slot).data else { unreachable!() };
            let target = &parts[part as usize];
            (target.plugin(), (target.chunks.len() - 1) as u32)
        };
        let xfer = self.rooms.issue_transfer(XferRef { slot, epoch, part, chunk, plugin });
        let room = self.room_mut(slot);
        let peer = room.peer().expect("submitting room has a peer");
        room.in_flight += 1;
        room.touch(now, LastEvent::Submitted);
        let RoleData::Sender { parts, .. } = &mut room.data else { unreachable!() };
        let target = &mut parts[part as usize];
        target.chunks[chunk as usize].xfer = xfer;
        target.next_chunk = target.next_chunk.max(chunk + 1);
        let ticket = target.ticket;
        self.metrics.submits += 1;
        self.metrics.segments_submitted += segments.len() as u64;
        self.commands.push_back(Command::Submit { plugin, xfer: XferId(xfer), peer, ticket, timeout, segments });
    }

    /// Sender: the room matched (notice + first chunk): leave bootstrap, arm the transfer deadline
    /// and the plugin grace, tell the receiver.
    pub(super) fn start_transfer(&mut self, now: At, slot: u32) {
        let transfer_deadline = self.link_transfer_deadline(now, slot);
        self.move_timer(now, slot, TimerKind::Bootstrap, TimerKind::Transfer, transfer_deadline);
        let grace = Span::from_ms(self.config.plugin_grace_ms);
        self.arm(now, slot, TimerKind::PluginGrace, transfer_deadline.saturating_add(grace));
        let room = self.room_mut(slot);
        room.touch(now, LastEvent::Matched);
        let (key, peer) = (room.key, room.peer());
        if let Some(peer) = peer {
            self.push_peer(peer, PeerMessage::Matched { room: key });
        }
    }

    /// A newer generation replaces `old` (NIL: a settled one): a live one fails `superseded`;
    /// either way its key entry is taken over by the new room.
    pub(super) fn supersede(&mut self, now: At, old: u32) {
        if old != super::NIL && !self.room_at(old).state.is_terminal() {
            self.fail_room(now, old, RoomInput::Superseded, FailReason::Superseded, None, None);
        }
    }

    /// The engine that owned the room on `role`'s side is gone: the room, if live, fails
    /// `engine_lost` (the peer is told, as for an abort). Returns whether it was live.
    pub(super) fn engine_lost(&mut self, now: At, key: RoomKey, role: Role) -> bool {
        let Lookup::Same(slot) = self.rooms.lookup(key, role) else { return false };
        if self.room_at(slot).state.is_terminal() {
            return false;
        }
        self.room_mut(slot).touch(now, LastEvent::Aborted);
        self.fail_room(now, slot, RoomInput::EngineAbort, FailReason::EngineLost, None, None);
        self.metrics.aborts += 1;
        true
    }

    // CONFORMANCE: ABORT-6, ABORT-7
    pub(super) fn engine_abort(&mut self, now: At, key: RoomKey, role: Option<Role>) {
        let roles: &[Role] = match role {
            Some(Role::Sender) => &[Role::Sender],
            Some(Role::Receiver) => &[Role::Receiver],
            None => &Role::ALL,
        };
        let mut aborted_any = false;
        let mut harmless = HarmlessAbort::Unknown;
        let mut absent_roles: [Option<Role>; 2] = [None, None];
        let mut stale = false;
        for (index, &role) in roles.iter().enumerate() {
            match self.rooms.lookup(key, role) {
                Lookup::Same(slot) => {
                    let room = self.room_at(slot);
                    if !room.state.is_terminal() {
                        self.room_mut(slot).touch(now, LastEvent::Aborted);
                        self.fail_room(now, slot, RoomInput::EngineAbort, FailReason::Aborted, None, None);
                        aborted_any = true;
                    } else if room.failure.is_some_and(|f| f.reason == FailReason::Aborted) {
                        harmless = HarmlessAbort::Duplicate;
                    } else if harmless != HarmlessAbort::Duplicate {
                        harmless = HarmlessAbort::AfterTerminal;
                    }
                }
                Lookup::Settled(seq) => {
                    if self.rooms.record(seq).failure.is_some_and(|f| f.reason == FailReason::Aborted) {
                        harmless = HarmlessAbort::Duplicate;
                    } else if harmless != HarmlessAbort::Duplicate {
                        harmless = HarmlessAbort::AfterTerminal;
                    }
                }
                Lookup::Newer => stale = true,
                Lookup::Absent | Lookup::Older(_) => absent_roles[index] = Some(role),
            }
        }
        if aborted_any {
            self.metrics.aborts += 1;
            return;
        }
        let all_absent = roles.iter().enumerate().all(|(i, _)| absent_roles[i].is_some());
        if all_absent {
            // An abort before the counterpart exists: remember it, so the late counterpart is
            // refused and never re-creates the room.
            for role in absent_roles.into_iter().flatten() {
                if let Lookup::Older(old) = self.rooms.lookup(key, role) {
                    self.supersede(now, old);
                }
                self.create_tombstone(now, key, role, FailReason::Aborted);
            }
            harmless = HarmlessAbort::Unknown;
        } else if stale && harmless == HarmlessAbort::Unknown {
            self.count_late(LateSource::Engine);
        }
        self.metrics.aborts_harmless[harmless.index()] += 1;
    }
}
