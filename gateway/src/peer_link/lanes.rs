//! The two lanes of a link's outbound side, and the joining of fragments on its inbound side.
//!
//! Heartbeats ride an urgent lane that is always read first; every other frame rides the bulk lane,
//! and one whose encoding is larger than `peer_link.frame_fragment_bytes` leaves as consecutive
//! `Fragment` frames. On a gRPC link ([`outbound_stream`]) at most one fragment, never a whole large
//! frame, stands between two heartbeats; a framed link's writer (`writer.rs`) writes a frame's
//! fragments together ([`fragments`]). Either way a large frame cannot starve the link's liveness:
//! inbound, every fragment counts as hearing from the peer. Fragments are joined up to
//! `peer_link.max_frame_bytes` (a peer sending more breaks the protocol and loses the link).

use crate::channels::Outbound;
use kvgate_client::proto::{self, peer_frame::Frame, PeerFrame};
use prost::Message;
use tokio::sync::mpsc;

/// The receiving halves, turned into the link's outbound stream by [`outbound_stream`].
pub struct OutboundReceivers {
    pub(super) bulk: mpsc::Receiver<PeerFrame>,
    pub(super) urgent: mpsc::Receiver<PeerFrame>,
}

#[cfg(test)]
impl OutboundReceivers {
    /// The next bulk frame already queued, if any.
    pub fn try_recv_bulk(&mut self) -> Option<PeerFrame> {
        self.bulk.try_recv().ok()
    }
}

/// Frames the urgent lane holds (heartbeats only: one per interval, so a handful is plenty; a full
/// urgent lane means the link stopped draining, which the bulk lane's bound reports too).
pub const URGENT_QUEUE_FRAMES: usize = 16;

/// The lanes of one link: `bulk_frames` is `peer_link.send_queue_frames`.
pub fn channels(bulk_frames: usize) -> (Outbound, OutboundReceivers) {
    channels_with(bulk_frames, None)
}

/// The lanes of one framed link, whose frames the driver's thread may write straight through
/// `direct` (`writer.rs`).
pub fn channels_with(
    bulk_frames: usize,
    direct: Option<std::sync::Arc<super::writer::LinkWriter>>,
) -> (Outbound, OutboundReceivers) {
    let (bulk, bulk_rx) = mpsc::channel(bulk_frames);
    let (urgent, urgent_rx) = mpsc::channel(URGENT_QUEUE_FRAMES);
    (Outbound { bulk, urgent, direct }, OutboundReceivers { bulk: bulk_rx, urgent: urgent_rx })
}

/// `frame` as it leaves: whole, or as consecutive `Fragment` frames of at most `fragment_bytes` of
/// its encoding each.
pub fn fragments(frame: PeerFrame, fragment_bytes: u64) -> Vec<PeerFrame> {
    let mut splitter = Splitter { splitting: None, fragment_bytes: fragment_bytes.max(1) as usize };
    let mut out = vec![splitter.admit(frame)];
    while let Some(fragment) = splitter.next_fragment() {
        out.push(fragment);
    }
    out
}

/// A large frame being sent a fragment at a time.
struct Splitting {
    encoded: Vec<u8>,
    sent: usize,
}

struct Splitter {
    splitting: Option<Splitting>,
    fragment_bytes: usize,
}

impl Splitter {
    /// The next fragment of the frame being split, if any.
    fn next_fragment(&mut self) -> Option<PeerFrame> {
        let split = self.splitting.as_mut()?;
        let end = (split.sent + self.fragment_bytes).min(split.encoded.len());
        let data = split.encoded[split.sent..end].to_vec();
        split.sent = end;
        let last = end == split.encoded.len();
        if last {
            self.splitting = None;
        }
        Some(PeerFrame { frame: Some(Frame::Fragment(proto::Fragment { data, last })), mac: Vec::new() })
    }

    /// `frame` as it leaves: whole, or its first fragment (the rest follow from `splitting`).
    fn admit(&mut self, frame: PeerFrame) -> PeerFrame {
        if frame.encoded_len() <= self.fragment_bytes {
            return frame;
        }
        self.splitting = Some(Splitting { encoded: frame.encode_to_vec(), sent: 0 });
        self.next_fragment().expect("a frame being split has a first fragment")
    }
}

/// The link's outbound frames in send order: urgent first whenever one waits, then the rest of a
/// frame being split, then the next bulk frame. Ends when the bulk lane closes.
pub fn outbound_stream(
    lanes: OutboundReceivers,
    fragment_bytes: u64,
) -> impl tokio_stream::Stream<Item = PeerFrame> + Send + 'static {
    let splitter = Splitter { splitting: None, fragment_bytes: fragment_bytes.max(1) as usize };
    futures_util::stream::unfold((lanes, splitter), |(mut lanes, mut splitter)| async move {
        let OutboundReceivers { bulk, urgent } = &mut lanes;
        let splitter_ref = &mut splitter;
        let frame = tokio::select! {
            biased;
            Some(frame) = urgent.recv() => frame,
            frame = async move {
                match splitter_ref.next_fragment() {
                    Some(fragment) => Some(fragment),
                    None => bulk.recv().await.map(|frame| splitter_ref.admit(frame)),
                }
            } => frame?,
        };
        Some((frame, (lanes, splitter)))
    })
}

/// Joins one peer's inbound fragments back into frames.
#[derive(Debug)]
pub struct Reassembly {
    buffer: Vec<u8>,
    max_frame_bytes: usize,
}

impl Reassembly {
    pub fn new(max_frame_bytes: u64) -> Self {
        Reassembly { buffer: Vec::new(), max_frame_bytes: max_frame_bytes as usize }
    }

    /// Adds a fragment; returns the whole frame on the last one. An error is a protocol violation
    /// (more than `max_frame_bytes`, an undecodable frame, a fragment inside a fragment).
    pub fn push(&mut self, fragment: proto::Fragment) -> Result<Option<Frame>, String> {
        if self.buffer.len() + fragment.data.len() > self.max_frame_bytes {
            return Err(format!(
                "a fragmented frame exceeds peer_link.max_frame_bytes = {} (the peer's may be larger)",
                self.max_frame_bytes
            ));
        }
        self.buffer.extend_from_slice(&fragment.data);
        if !fragment.last {
            return Ok(None);
        }
        let encoded = std::mem::take(&mut self.buffer);
        let frame =
            PeerFrame::decode(encoded.as_slice()).map_err(|e| format!("a fragmented frame does not decode: {e}"))?;
        match frame.frame {
            Some(Frame::Fragment(_)) => Err("a fragment inside a fragmented frame".into()),
            Some(Frame::Hello(_)) | Some(Frame::AuthProof(_)) | Some(Frame::Refused(_)) => {
                Err("a handshake frame inside a fragmented frame".into())
            }
            Some(frame) => Ok(Some(frame)),
            None => Err("an empty fragmented frame".into()),
        }
    }

    /// Bytes held for a frame not yet complete.
    pub fn pending_bytes(&self) -> usize {
        self.buffer.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_stream::StreamExt;

    fn core_frame(payload_bytes: usize) -> PeerFrame {
        let slices =
            (0..payload_bytes / 8).map(|i| proto::RemoteSlice { region: 1, offset: i as u64, len: 1 }).collect();
        let notice = proto::ExpectNotice {
            parts: vec![proto::RemoteParts { slices }],
            tickets: vec![7],
            timeout_ns: 1,
            part_plugins: Vec::new(),
            ..Default::default()
        };
        let core = proto::CoreMessage {
            key: Some(proto::RoomKey { room: 9, generation: 1 }),
            message: Some(proto::core_message::Message::ExpectNotice(notice)),
        };
        PeerFrame { frame: Some(Frame::Core(core)), mac: Vec::new() }
    }

    fn heartbeat(seq: u64) -> PeerFrame {
        PeerFrame { frame: Some(Frame::Heartbeat(proto::Heartbeat { seq })), mac: Vec::new() }
    }

    #[tokio::test]
    async fn a_frame_at_the_fragment_size_leaves_whole_and_one_byte_more_is_split() {
        let frame = core_frame(4096);
        let at = frame.encoded_len() as u64;
        let (out, lanes) = channels(8);
        out.bulk.send(frame.clone()).await.unwrap();
        drop(out);
        let sent: Vec<PeerFrame> = outbound_stream(lanes, at).collect().await;
        assert_eq!(sent, vec![frame.clone()]);

        let (out, lanes) = channels(8);
        out.bulk.send(frame.clone()).await.unwrap();
        drop(out);
        let sent: Vec<PeerFrame> = outbound_stream(lanes, at - 1).collect().await;
        assert_eq!(sent.len(), 2, "split in two");
        let mut join = Reassembly::new(at);
        assert_eq!(join.push(fragment_of(&sent[0])).unwrap(), None);
        assert_eq!(join.push(fragment_of(&sent[1])).unwrap(), frame.frame);
        assert_eq!(join.pending_bytes(), 0);
    }

    fn fragment_of(frame: &PeerFrame) -> proto::Fragment {
        match &frame.frame {
            Some(Frame::Fragment(f)) => f.clone(),
            other => panic!("not a fragment: {other:?}"),
        }
    }

    #[tokio::test]
    async fn heartbeats_overtake_the_rest_of_a_large_frame() {
        let big = core_frame(1 << 20);
        let (out, lanes) = channels(8);
        out.bulk.send(big.clone()).await.unwrap();
        out.bulk.send(heartbeat(0)).await.unwrap(); // a bulk frame queued behind it
        let mut stream = Box::pin(outbound_stream(lanes, 64 << 10));
        let first = stream.next().await.unwrap();
        assert!(matches!(first.frame, Some(Frame::Fragment(_))));
        out.urgent.send(heartbeat(1)).await.unwrap();
        let second = stream.next().await.unwrap();
        assert_eq!(second, heartbeat(1), "the urgent heartbeat goes next, not the remaining fragments");
        drop(out);
        let rest: Vec<PeerFrame> = stream.collect().await;
        let mut join = Reassembly::new(2 << 20);
        let mut whole = join.push(fragment_of(&first)).unwrap();
        for frame in &rest[..rest.len() - 1] {
            whole = join.push(fragment_of(frame)).unwrap().or(whole);
        }
        assert_eq!(whole, big.frame, "the fragments join back into the frame");
        assert_eq!(rest.last().unwrap(), &heartbeat(0), "bulk order is kept");
    }

    #[test]
    fn joining_stops_at_the_frame_limit_and_refuses_nested_or_handshake_frames() {
        let frame = core_frame(4096);
        let encoded = frame.encode_to_vec();
        let limit = encoded.len() as u64;
        let at = Reassembly::new(limit).push(proto::Fragment { data: encoded.clone(), last: true });
        assert_eq!(at.unwrap(), frame.frame, "exactly max_frame_bytes is accepted");
        let mut past = Reassembly::new(limit - 1);
        let e = past.push(proto::Fragment { data: encoded, last: true }).unwrap_err();
        assert!(e.contains("max_frame_bytes"), "{e}");
        let nested =
            PeerFrame { frame: Some(Frame::Fragment(proto::Fragment { data: vec![1], last: true })), mac: Vec::new() };
        let e =
            Reassembly::new(1 << 20).push(proto::Fragment { data: nested.encode_to_vec(), last: true }).unwrap_err();
        assert!(e.contains("inside"), "{e}");
    }
}
