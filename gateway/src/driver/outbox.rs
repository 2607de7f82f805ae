//! Core messages to one peer session, gathered while the driver handles one input and sent together
//! at the end of that step (`Driver::drain`) as `CoreBatch` frames: one frame, one MAC and one queue
//! slot for many rooms, where a frame each would cost a slot, a MAC and an HTTP/2 frame per message
//! on both gateways. Only towards a peer whose Hello lists `core_batch` (and with
//! `peer_link.core_batch` on); otherwise every message leaves at once as its own frame. A batch never
//! encodes past `peer_link.frame_fragment_bytes` (it is sent and a new one begun), so batching never
//! makes a frame fragment; one message larger than that leaves alone, fragmented as before. Order is
//! kept: any other frame to the session sends the gathered messages first.

use crate::channels::PeerSender;
use kvgate_client::proto::{self, peer_frame::Frame};
use prost::Message;

/// The messages gathered for one session and their encoded size inside a `CoreBatch`.
#[derive(Debug)]
pub struct Outbox {
    /// Whether this session takes `CoreBatch` frames (both sides agreed).
    batching: bool,
    /// Most encoded bytes of one batch (`peer_link.frame_fragment_bytes`).
    batch_bytes: usize,
    messages: Vec<proto::CoreMessage>,
    encoded: usize,
}

impl Outbox {
    pub fn new(batching: bool, batch_bytes: u64) -> Outbox {
        Outbox { batching, batch_bytes: batch_bytes as usize, messages: Vec::new(), encoded: 0 }
    }

    /// Whether messages wait for [`Outbox::flush`].
    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }

    /// Queue `message` for `sender`: gathered when batching (a full batch leaves first), else sent.
    /// Returns how many `CoreBatch` frames left (0 or 1).
    pub fn push(&mut self, sender: &PeerSender, message: proto::CoreMessage) -> u64 {
        if !self.batching {
            sender.send(Frame::Core(message));
            return 0;
        }
        // A field of a `CoreBatch`: its tag, its length prefix and the message.
        let len = message.encoded_len();
        let field = 1 + prost::encoding::encoded_len_varint(len as u64) + len;
        let batches =
            if !self.messages.is_empty() && self.encoded + field > self.batch_bytes { self.flush(sender) } else { 0 };
        self.messages.push(message);
        self.encoded += field;
        batches
    }

    /// Send what was gathered: one message as a plain `Core` frame, several as one `CoreBatch`.
    /// Returns how many `CoreBatch` frames left (0 or 1).
    pub fn flush(&mut self, sender: &PeerSender) -> u64 {
        self.encoded = 0;
        match self.messages.len() {
            0 => 0,
            1 => {
                let message = self.messages.pop().expect("one message");
                sender.send(Frame::Core(message));
                0
            }
            n => {
                // The next batch starts with room for as many (no regrowth message by message).
                let messages = std::mem::replace(&mut self.messages, Vec::with_capacity(n));
                sender.send(Frame::CoreBatch(proto::CoreBatch { messages }));
                1
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::peer_link::lanes;

    fn message(room: u64) -> proto::CoreMessage {
        proto::CoreMessage {
            key: Some(proto::RoomKey { room, generation: 0 }),
            message: Some(proto::core_message::Message::Matched(proto::Matched {})),
        }
    }

    fn sent(rx: &mut lanes::OutboundReceivers) -> Vec<Frame> {
        let mut out = Vec::new();
        while let Some(frame) = rx.try_recv_bulk() {
            out.push(frame.frame.expect("a frame"));
        }
        out
    }

    fn batch_of(frame: &Frame) -> Vec<u64> {
        match frame {
            Frame::CoreBatch(b) => b.messages.iter().map(|m| m.key.as_ref().map_or(0, |k| k.room)).collect(),
            Frame::Core(m) => vec![m.key.as_ref().map_or(0, |k| k.room)],
            other => panic!("not core: {other:?}"),
        }
    }

    #[test]
    fn messages_leave_together_at_flush_in_order_and_one_alone_as_a_core_frame() {
        let (tx, mut rx) = lanes::channels(64);
        let sender = PeerSender::new(tx);
        let mut outbox = Outbox::new(true, 256 << 10);
        for room in 1..=5 {
            outbox.push(&sender, message(room));
        }
        assert!(sent(&mut rx).is_empty(), "nothing leaves before the flush");
        outbox.flush(&sender);
        let frames = sent(&mut rx);
        assert_eq!(frames.len(), 1);
        assert!(matches!(frames[0], Frame::CoreBatch(_)));
        assert_eq!(batch_of(&frames[0]), vec![1, 2, 3, 4, 5]);
        outbox.push(&sender, message(6));
        outbox.flush(&sender);
        let frames = sent(&mut rx);
        assert!(matches!(frames[0], Frame::Core(_)), "a single message is a plain Core frame");
        assert!(outbox.is_empty());
    }

    #[test]
    fn a_batch_stops_at_its_byte_bound_and_just_under_it_stays_one() {
        let one = message(1);
        let field = 1 + prost::encoding::encoded_len_varint(one.encoded_len() as u64) + one.encoded_len();
        // Exactly four fields fit: one frame. One byte less: the fourth starts a second batch.
        for (bound, frames) in [(4 * field, 1), (4 * field - 1, 2)] {
            let (tx, mut rx) = lanes::channels(64);
            let sender = PeerSender::new(tx);
            let mut outbox = Outbox::new(true, bound as u64);
            for room in 1..=4 {
                outbox.push(&sender, message(room));
            }
            outbox.flush(&sender);
            let got = sent(&mut rx);
            assert_eq!(got.len(), frames, "bound {bound}");
            let rooms: Vec<u64> = got.iter().flat_map(batch_of).collect();
            assert_eq!(rooms, vec![1, 2, 3, 4], "order kept across batches");
            for frame in &got {
                let encoded = proto::PeerFrame { frame: Some(frame.clone()), mac: Vec::new() }.encoded_len();
                assert!(
                    encoded <= bound + 8,
                    "a batch of {encoded} bytes past its bound {bound} (+ the frame's own tag and length)"
                );
            }
        }
    }

    #[test]
    fn without_batching_every_message_leaves_at_once() {
        let (tx, mut rx) = lanes::channels(64);
        let sender = PeerSender::new(tx);
        let mut outbox = Outbox::new(false, 256 << 10);
        outbox.push(&sender, message(1));
        outbox.push(&sender, message(2));
        assert!(outbox.is_empty());
        let frames = sent(&mut rx);
        assert_eq!(frames.len(), 2);
        assert!(frames.iter().all(|f| matches!(f, Frame::Core(_))));
    }
}
