//! Buffer reuse: the buffers of commands a driver hands back (`recycle_command`), expect-notice part
//! lists and sender rooms' part lists, each pool bounded in count and in the capacity it keeps, so a
//! steady stream allocates nothing for them and a huge buffer is freed rather than pinned.

use super::*;

/// Most emptied sender part lists kept for reuse, and the largest capacity kept.
const SPARE_SEND_PARTS: usize = 64;
const SPARE_SEND_PARTS_CAPACITY: usize = 4;
/// Most command buffers (segments, ranges) handed back by `recycle_command` kept for reuse, and the
/// largest capacity kept (in elements): a huge submit's buffer is freed, not pinned.
const SPARE_COMMAND_BUFFERS: usize = 64;
const SPARE_COMMAND_BUFFER_CAPACITY: usize = 1024;
/// Most parts of a notice part list kept for reuse (`recycle_command`).
const SPARE_NOTICE_PARTS: usize = 64;

/// The buffers kept for reuse, one pool per kind.
#[derive(Default)]
pub(super) struct Spares {
    /// Emptied part lists of dropped sender rooms, reused by new ones (at most `SPARE_SEND_PARTS`
    /// lists of at most `SPARE_SEND_PARTS_CAPACITY` parts: no heap block per room in steady state).
    send_parts: Vec<Vec<room::SendPart>>,
    /// Emptied buffers of executed commands (`recycle_command`), reused by the next `Submit` and
    /// `ExpectIncoming` (at most `SPARE_COMMAND_BUFFERS` of each, of at most
    /// `SPARE_COMMAND_BUFFER_CAPACITY` elements).
    pub segments: Vec<Vec<kvgate_abi::Segment>>,
    pub ranges: Vec<Vec<kvgate_abi::LocalRange>>,
    /// Part lists and ticket lists of sent expect notices (`recycle_command`) and of owned expect
    /// requests, reused by the next notice (same bounds, see `keep_spare_notice_parts`).
    notice_parts: Vec<Vec<Vec<Slice>>>,
    pub tickets: Vec<Vec<kvgate_abi::Ticket>>,
    pub plugin_lists: Vec<Vec<PluginSlot>>,
}

impl Core {
    /// Optional: hand back a command the driver has executed, so the core reuses its buffers (a
    /// `Submit`'s segments, an `ExpectIncoming`'s ranges, a sent `ExpectNotice`'s parts and
    /// tickets) for a later command of that kind. A driver that recycles every command (and uses
    /// `handle_send` / `handle_expect`) causes no heap allocation for them in steady state; dropping
    /// a command instead is always correct. Other commands are simply dropped.
    #[inline]
    pub fn recycle_command(&mut self, command: Command) {
        match command {
            Command::Submit { segments, .. } => Self::keep_spare(&mut self.spares.segments, segments),
            Command::ExpectIncoming { ranges, .. } => Self::keep_spare(&mut self.spares.ranges, ranges),
            Command::ToPeer { message: PeerMessage::ExpectNotice { parts, tickets, plugins, .. }, .. } => {
                self.keep_spare_notice_parts(parts);
                Self::keep_spare(&mut self.spares.tickets, tickets);
                Self::keep_spare(&mut self.spares.plugin_lists, plugins);
            }
            _ => {}
        }
    }

    /// Keep a notice's part list (with its parts' slice buffers) for reuse, if it is small enough
    /// (at most `SPARE_NOTICE_PARTS` parts and `SPARE_COMMAND_BUFFER_CAPACITY` slices in all) and
    /// the pool has room.
    pub(super) fn keep_spare_notice_parts(&mut self, parts: Vec<Vec<Slice>>) {
        let slices: usize = parts.iter().map(Vec::capacity).sum();
        if parts.capacity() != 0
            && parts.capacity() <= SPARE_NOTICE_PARTS
            && slices <= SPARE_COMMAND_BUFFER_CAPACITY
            && self.spares.notice_parts.len() < SPARE_COMMAND_BUFFERS
        {
            self.spares.notice_parts.push(parts);
        }
    }

    /// The parts of a new expect notice: a copy of `parts`, in a reused buffer when there is one.
    pub(super) fn notice_parts<P: AsRef<[Slice]>>(&mut self, parts: &[P]) -> Vec<Vec<Slice>> {
        let mut notice = self.spares.notice_parts.pop().unwrap_or_default();
        notice.truncate(parts.len());
        for (index, part) in parts.iter().enumerate() {
            match notice.get_mut(index) {
                Some(buffer) => {
                    buffer.clear();
                    buffer.extend_from_slice(part.as_ref());
                }
                None => notice.push(part.as_ref().to_vec()),
            }
        }
        notice
    }

    /// Keep an emptied buffer for reuse, if it is small enough and the pool has room.
    pub(super) fn keep_spare<T>(pool: &mut Vec<Vec<T>>, mut buffer: Vec<T>) {
        if buffer.capacity() != 0
            && buffer.capacity() <= SPARE_COMMAND_BUFFER_CAPACITY
            && pool.len() < SPARE_COMMAND_BUFFERS
        {
            buffer.clear();
            pool.push(buffer);
        }
    }

    /// Command buffers held for reuse: (segment buffers, range buffers).
    #[cfg(test)]
    pub(crate) fn spare_command_buffers(&self) -> (usize, usize) {
        (self.spares.segments.len(), self.spares.ranges.len())
    }

    /// Notice buffers held for reuse: (part lists, ticket lists).
    #[cfg(test)]
    pub(crate) fn spare_notice_buffers(&self) -> (usize, usize) {
        (self.spares.notice_parts.len(), self.spares.tickets.len())
    }

    /// An empty part list for a new sender room (a reused one when there is one).
    pub(super) fn spare_send_parts(&mut self) -> Vec<room::SendPart> {
        self.spares.send_parts.pop().unwrap_or_default()
    }

    /// Keep a dropped sender room's part list for reuse (small ones, a bounded number of them).
    pub(super) fn recycle_send_parts(&mut self, mut parts: Vec<room::SendPart>) {
        if parts.capacity() != 0
            && parts.capacity() <= SPARE_SEND_PARTS_CAPACITY
            && self.spares.send_parts.len() < SPARE_SEND_PARTS
        {
            parts.clear();
            self.spares.send_parts.push(parts);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn segments(capacity: usize) -> Command {
        Command::Submit {
            plugin: PluginSlot(0),
            xfer: kvgate_abi::XferId(1),
            peer: PeerId(1),
            ticket: kvgate_abi::Ticket(1),
            timeout: Span::ZERO,
            segments: Vec::with_capacity(capacity),
        }
    }

    #[test]
    fn recycled_buffers_are_kept_up_to_their_capacity_and_count_limits() {
        let mut core = Core::new(CoreConfig::default()).unwrap();
        core.recycle_command(segments(SPARE_COMMAND_BUFFER_CAPACITY));
        assert_eq!(core.spare_command_buffers(), (1, 0), "a buffer at the capacity limit is kept");
        core.recycle_command(segments(SPARE_COMMAND_BUFFER_CAPACITY + 1));
        assert_eq!(core.spare_command_buffers(), (1, 0), "a buffer past the capacity limit is freed");
        core.recycle_command(segments(0));
        assert_eq!(core.spare_command_buffers(), (1, 0), "an unallocated buffer is not kept");
        for _ in 1..SPARE_COMMAND_BUFFERS {
            core.recycle_command(segments(4));
        }
        assert_eq!(core.spare_command_buffers(), (SPARE_COMMAND_BUFFERS, 0), "the pool fills to its limit");
        core.recycle_command(segments(4));
        assert_eq!(core.spare_command_buffers(), (SPARE_COMMAND_BUFFERS, 0), "and no further");
        let ranges = Command::ExpectIncoming {
            plugin: PluginSlot(0),
            peer: PeerId(1),
            ticket: kvgate_abi::Ticket(1),
            timeout: Span::ZERO,
            ranges: Vec::with_capacity(1),
        };
        core.recycle_command(ranges);
        assert_eq!(core.spare_command_buffers(), (SPARE_COMMAND_BUFFERS, 1));
    }

    fn notice(parts: Vec<Vec<Slice>>, tickets: usize) -> Command {
        let message = PeerMessage::ExpectNotice {
            room: RoomKey::new(1, 0),
            parts,
            tickets: Vec::with_capacity(tickets),
            plugins: Vec::new(),
            timeout: Span::ZERO,
        };
        Command::ToPeer { peer: PeerId(1), message }
    }

    #[test]
    fn recycled_notices_are_kept_within_their_part_slice_and_count_limits() {
        let mut core = Core::new(CoreConfig::default()).unwrap();
        core.recycle_command(notice(vec![Vec::with_capacity(SPARE_COMMAND_BUFFER_CAPACITY)], 1));
        assert_eq!(core.spare_notice_buffers(), (1, 1), "a notice at the slice limit is kept");
        core.recycle_command(notice(vec![Vec::with_capacity(SPARE_COMMAND_BUFFER_CAPACITY), Vec::with_capacity(1)], 1));
        assert_eq!(core.spare_notice_buffers(), (1, 2), "parts past the slice limit are freed");
        let mut parts = Vec::with_capacity(SPARE_NOTICE_PARTS + 1);
        parts.push(Vec::with_capacity(1));
        core.recycle_command(notice(parts, 0));
        assert_eq!(
            core.spare_notice_buffers(),
            (1, 2),
            "a part list past the part limit is freed, no empty ticket list kept"
        );
        for _ in 1..SPARE_COMMAND_BUFFERS {
            core.recycle_command(notice(vec![Vec::with_capacity(2)], 1));
        }
        assert_eq!(core.spare_notice_buffers().0, SPARE_COMMAND_BUFFERS, "the pool fills to its limit");
        core.recycle_command(notice(vec![Vec::with_capacity(2)], 1));
        assert_eq!(core.spare_notice_buffers().0, SPARE_COMMAND_BUFFERS, "and no further");
        // A reused list takes exactly the new parts (fewer, more, different lengths).
        let a = Slice::new(RegionId(1), 0, 8);
        let b = Slice::new(RegionId(2), 8, 16);
        assert_eq!(core.notice_parts(&[[a, b]]), vec![vec![a, b]]);
        let mut core = Core::new(CoreConfig::default()).unwrap();
        core.recycle_command(notice(vec![vec![a, a, a], vec![b], vec![b, b]], 1));
        assert_eq!(core.notice_parts(&[&[b][..]]), vec![vec![b]]);
        core.recycle_command(notice(vec![vec![a]], 1));
        let parts: [&[Slice]; 3] = [&[b, b], &[a], &[a, b, a]];
        assert_eq!(core.notice_parts(&parts), vec![vec![b, b], vec![a], vec![a, b, a]]);
    }
}
