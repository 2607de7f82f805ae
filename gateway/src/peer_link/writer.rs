//! A framed link's writer: one buffer of sealed, encoded bytes per link, written to the socket by
//! whichever thread holds its lock.
//!
//! The driver's thread writes its frames straight through ([`LinkWriter::try_direct`]) when nothing
//! waits ahead of them, so an outbound frame costs one `send` on the thread that made it and wakes no
//! other. Everything else goes through the link's lanes and the writer task ([`spawn`]) on the
//! multi-threaded runtime: heartbeats (which must go out while the driver's thread is blocked in a
//! plugin call), the handshake, frames made while the socket was behind, and the rest of a write the
//! socket could not take at once. Sealing (`psk`) happens under the same lock as the encoding, so the
//! MACs' sequence is the order on the wire. A link's unwritten bytes are bounded by the lanes' bound
//! (`peer_link.send_queue_frames`): the writer takes no frame from them while bytes wait, and the
//! driver's thread writes straight through only when none do.

use super::lanes::{fragments, OutboundReceivers};
use super::psk::FrameSealer;
use kvgate_client::lane_frame::encode_frame;
use kvgate_client::proto::PeerFrame;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// The writer task stops gathering queued frames into one `write` past this many bytes.
const WRITE_BATCH_BYTES: usize = 256 << 10;

/// The sealer a link's handshake sets once its keys are known (`psk`); `None` leaves frames unsealed.
pub type SharedSealer = Arc<Mutex<Option<FrameSealer>>>;

/// What [`LinkWriter::try_direct`] did with a frame.
#[derive(Debug)]
pub enum Direct {
    /// Encoded; written, or left for the writer task to finish.
    Taken,
    /// Frames or bytes wait ahead of it: queue it on the bulk lane.
    Behind(Box<PeerFrame>),
    /// The link's socket failed: the link is lost.
    Failed,
}

struct Pending {
    /// Sealed, encoded bytes not yet written, from `sent` on.
    bytes: Vec<u8>,
    sent: usize,
    failed: bool,
}

impl Pending {
    fn unsent(&self) -> usize {
        self.bytes.len() - self.sent
    }
}

/// One framed link's outbound bytes and socket.
pub struct LinkWriter {
    socket: OwnedFd,
    sealer: SharedSealer,
    fragment_bytes: u64,
    pending: Mutex<Pending>,
    /// Bulk-lane frames queued and not yet encoded: a direct write waits behind them.
    queued_bulk: AtomicUsize,
    /// Wakes the writer task to finish a direct write the socket did not take whole.
    flush_wanted: tokio::sync::Notify,
}

impl LinkWriter {
    /// A writer for `socket` (a descriptor of its own is kept), sealing with `sealer` once it is set,
    /// splitting frames larger than `fragment_bytes`.
    pub fn new(socket: BorrowedFd<'_>, sealer: SharedSealer, fragment_bytes: u64) -> std::io::Result<Arc<LinkWriter>> {
        Ok(Arc::new(LinkWriter {
            socket: socket.try_clone_to_owned()?,
            sealer,
            fragment_bytes,
            pending: Mutex::new(Pending { bytes: Vec::with_capacity(64 << 10), sent: 0, failed: false }),
            queued_bulk: AtomicUsize::new(0),
            flush_wanted: tokio::sync::Notify::new(),
        }))
    }

    pub fn sealer(&self) -> &SharedSealer {
        &self.sealer
    }

    /// A frame is about to be queued on the bulk lane (before the queueing, so that no direct write
    /// can pass it); [`LinkWriter::unqueued`] if the queueing failed.
    pub fn queuing(&self) {
        self.queued_bulk.fetch_add(1, Ordering::SeqCst);
    }

    pub fn unqueued(&self) {
        self.queued_bulk.fetch_sub(1, Ordering::SeqCst);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Seals and encodes `frame` (its fragments, if large) at the end of `pending`.
    fn encode(&self, pending: &mut Pending, frame: PeerFrame) {
        let mut sealer = self.sealer.lock().unwrap_or_else(|e| e.into_inner());
        for piece in fragments(frame, self.fragment_bytes) {
            let piece = match sealer.as_mut() {
                Some(s) => s.seal(piece),
                None => piece,
            };
            encode_frame(&piece, &mut pending.bytes);
        }
    }

    /// Writes what `pending` holds until the socket takes no more: `Ok(true)` when all is written.
    fn write_out(&self, pending: &mut Pending) -> std::io::Result<bool> {
        use nix::sys::socket::{send, MsgFlags};
        while pending.unsent() > 0 {
            let flags = MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL;
            match send(self.socket.as_raw_fd(), &pending.bytes[pending.sent..], flags) {
                Ok(n) => pending.sent += n,
                Err(nix::errno::Errno::EAGAIN) => return Ok(false),
                Err(nix::errno::Errno::EINTR) => {}
                Err(e) => {
                    pending.failed = true;
                    return Err(e.into());
                }
            }
        }
        pending.bytes.clear();
        pending.sent = 0;
        Ok(true)
    }

    /// Writes `frame` now on the calling thread when no frame or byte waits ahead of it; what the
    /// socket does not take at once the writer task finishes.
    pub fn try_direct(&self, frame: PeerFrame) -> Direct {
        let mut pending = self.lock();
        if pending.failed {
            return Direct::Failed;
        }
        if pending.unsent() > 0 || self.queued_bulk.load(Ordering::SeqCst) > 0 {
            return Direct::Behind(Box::new(frame));
        }
        self.encode(&mut pending, frame);
        match self.write_out(&mut pending) {
            Ok(true) => Direct::Taken,
            Ok(false) => {
                drop(pending);
                self.flush_wanted.notify_one();
                Direct::Taken
            }
            Err(e) => {
                tracing::debug!("peer link write failed: {e}");
                Direct::Failed
            }
        }
    }

    /// Encodes a frame the writer task took from a lane (`bulk`: from the bulk lane).
    fn take_from_lane(&self, frame: PeerFrame, bulk: bool) -> usize {
        let mut pending = self.lock();
        self.encode(&mut pending, frame);
        if bulk {
            self.queued_bulk.fetch_sub(1, Ordering::SeqCst);
        }
        pending.unsent()
    }

    /// Writes what waits; `WouldBlock` while bytes remain (for `AsyncFd::try_io`).
    fn flush(&self) -> std::io::Result<()> {
        let mut pending = self.lock();
        match self.write_out(&mut pending)? {
            true => Ok(()),
            false => Err(std::io::ErrorKind::WouldBlock.into()),
        }
    }

    fn mark_failed(&self) {
        self.lock().failed = true;
    }

    /// Encoded bytes not yet written.
    #[cfg(test)]
    fn pending_bytes(&self) -> usize {
        self.lock().unsent()
    }
}

/// Starts the task that writes what the lanes carry, urgent first, and finishes what direct writes
/// left, until the bulk lane closes (then the socket's sending side is shut) or a write fails (then
/// the lanes close, which the link's session task sees as the link's loss). `keep` lives as long as
/// the task (an accepted connection's place under the listener's cap).
pub fn spawn<K: Send + 'static>(writer: Arc<LinkWriter>, lanes: OutboundReceivers, keep: K) {
    tokio::spawn(async move {
        let _keep = keep;
        let OutboundReceivers { mut bulk, mut urgent } = lanes;
        // A descriptor of the socket on this runtime's reactor, registered for write readiness only:
        // registered for reading too, every frame the peer sends would wake this runtime's worker
        // beside the driver's thread that reads it. The bytes go through the writer's own descriptor.
        let registered = writer.socket.try_clone().and_then(|fd| {
            // SAFETY: the `OwnedFd` is open, owned by the `AsyncFd` alone and always the same descriptor.
            #[allow(unsafe_code)]
            let registered = unsafe { AsyncFd::register_with_interest(fd, Interest::WRITABLE) };
            registered.map_err(|e| e.into_parts().1)
        });
        let socket = match registered {
            Ok(socket) => socket,
            Err(e) => {
                tracing::warn!("peer link writer: register the socket: {e}");
                writer.mark_failed();
                return;
            }
        };
        loop {
            // What waits goes out before more is taken from the lanes.
            if let Err(e) = flush_when_writable(&writer, &socket).await {
                tracing::debug!("peer link write failed: {e}");
                writer.mark_failed();
                return;
            }
            let mut unsent = tokio::select! {
                biased;
                Some(frame) = urgent.recv() => writer.take_from_lane(frame, false),
                frame = bulk.recv() => match frame {
                    Some(frame) => writer.take_from_lane(frame, true),
                    None => break,
                },
                // A direct write left bytes: finish them before taking more.
                _ = writer.flush_wanted.notified() => continue,
            };
            // Every frame already queued goes in the same write.
            while unsent < WRITE_BATCH_BYTES {
                unsent = match urgent.try_recv() {
                    Ok(frame) => writer.take_from_lane(frame, false),
                    Err(_) => match bulk.try_recv() {
                        Ok(frame) => writer.take_from_lane(frame, true),
                        Err(_) => break,
                    },
                };
            }
        }
        // The lanes closed: write what is left, then end the sending side.
        if let Err(e) = flush_when_writable(&writer, &socket).await {
            tracing::debug!("peer link write failed: {e}");
        }
        let _ = nix::sys::socket::shutdown(writer.socket.as_raw_fd(), nix::sys::socket::Shutdown::Write);
    });
}

/// Writes every byte that waits, sleeping on the socket's write readiness while it is full.
async fn flush_when_writable(writer: &LinkWriter, socket: &AsyncFd<OwnedFd>) -> std::io::Result<()> {
    loop {
        match writer.flush() {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            done => return done,
        }
        let mut ready = socket.writable().await?;
        // A `WouldBlock` here clears the readiness, so the next wait sleeps until the socket drains.
        if let Ok(done) = ready.try_io(|_| writer.flush()) {
            return done;
        }
    }
}

/// Writes `frame` as the link's last (a refusal), whatever was queued before it, then ends the
/// socket's sending side; `keep` as for [`spawn`].
pub fn last_frame<K: Send + 'static>(writer: Arc<LinkWriter>, frame: PeerFrame, keep: K) {
    {
        let mut pending = writer.lock();
        writer.encode(&mut pending, frame);
    }
    let (lanes, receivers) = super::lanes::channels(1);
    drop(lanes);
    spawn(writer, receivers, keep);
}

impl AsFd for LinkWriter {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.socket.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channels::PeerSender;
    use crate::peer_link::framed;
    use crate::peer_link::lanes::{channels_with, Reassembly};
    use crate::peer_link::psk::{Psk, Transcript};
    use kvgate_client::proto::{self, peer_frame::Frame};
    use std::time::Duration;

    /// A connected pair on loopback, (writing side, reading side); `small`: with a small send buffer,
    /// so that the writing side fills soon when nothing reads.
    async fn pair(small: bool) -> (tokio::net::TcpStream, tokio::net::TcpStream) {
        use nix::sys::socket::{setsockopt, sockopt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let (dialled, accepted) = tokio::join!(tokio::net::TcpStream::connect(address), listener.accept());
        let (writing, reading) = (dialled.unwrap(), accepted.unwrap().0);
        if small {
            setsockopt(&writing, sockopt::SndBuf, &4096).unwrap();
        }
        (writing, reading)
    }

    /// A core frame for `room` carrying about `pad` bytes.
    fn core(room: u64, pad: usize) -> Frame {
        let notice = proto::ExpectNotice { tickets: vec![7; pad], ..Default::default() };
        Frame::Core(proto::CoreMessage {
            key: Some(proto::RoomKey { room, generation: 1 }),
            message: Some(proto::core_message::Message::ExpectNotice(notice)),
        })
    }

    fn room_of(frame: &Frame) -> u64 {
        match frame {
            Frame::Core(core) => core.key.as_ref().map_or(u64::MAX, |k| k.room),
            other => panic!("not a core frame: {other:?}"),
        }
    }

    const ROOMS: u64 = 3000;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn frames_written_straight_through_and_through_the_lanes_arrive_in_order_sealed_in_sequence() {
        let (writing, reading) = pair(false).await;
        let key = Psk::unusable();
        let transcript = Transcript {
            dialler: "decode-0",
            server: "prefill-0",
            dialler_nonce: b"dn",
            server_nonce: b"sn",
            dialler_incarnation: 1,
            server_incarnation: 2,
        };
        let (sealer, _) = key.link_macs(&transcript, true);
        let (_, mut opener) = key.link_macs(&transcript, false);
        let writer = LinkWriter::new(writing.as_fd(), Arc::new(Mutex::new(Some(sealer))), 16 << 10).unwrap();
        let (outbound, lanes) = channels_with(1 << 16, Some(writer.clone()));
        spawn(writer.clone(), lanes, writing);
        let sender = PeerSender::new(outbound.clone());
        // Nothing reads yet: the socket fills, and later frames wait on the bulk lane. One frame in
        // ten is larger than a fragment; heartbeats go between (fewer than the urgent lane holds: it
        // is not drained either while the socket is full).
        let mut waited_on_the_lane = false;
        for room in 0..ROOMS {
            let pad = if room % 10 == 0 { 40 << 10 } else { 100 };
            assert!(sender.send(core(room, pad)), "room {room}");
            if room % 300 == 0 {
                assert!(sender.send(Frame::Heartbeat(proto::Heartbeat { seq: room })));
            }
            waited_on_the_lane |= outbound.bulk.capacity() < outbound.bulk.max_capacity();
        }
        assert!(waited_on_the_lane, "the socket filled and frames waited on the bulk lane");
        drop((sender, outbound));
        let mut inbound = framed::inbound(reading, 1 << 20);
        let mut joining = Reassembly::new(1 << 20);
        let (mut next_room, mut heartbeats) = (0, 0);
        let check = |frame: Frame, next_room: &mut u64| {
            assert_eq!(room_of(&frame), *next_room, "in the order sent");
            *next_room += 1;
        };
        while let Some(item) = inbound.next().await {
            let frame = opener.open(item.unwrap()).expect("every MAC the next in sequence");
            match frame.frame.unwrap() {
                Frame::Heartbeat(_) => heartbeats += 1,
                Frame::Fragment(piece) => {
                    if let Some(whole) = joining.push(piece).unwrap() {
                        check(whole, &mut next_room);
                    }
                }
                other => check(other, &mut next_room),
            }
        }
        assert_eq!(next_room, ROOMS, "every frame once, then the end");
        assert_eq!(heartbeats, ROOMS.div_ceil(300));
    }

    #[tokio::test]
    async fn a_peer_that_stops_reading_fills_the_bulk_lane_to_its_bound_then_the_send_fails() {
        let (writing, _reading) = pair(true).await;
        let writer = LinkWriter::new(writing.as_fd(), SharedSealer::default(), 256 << 10).unwrap();
        let (outbound, _lanes) = channels_with(16, Some(writer.clone()));
        let sender = PeerSender::new(outbound);
        // Straight through until the socket takes no more of a frame.
        let mut room = 0;
        while writer.pending_bytes() == 0 {
            assert!(sender.send(core(room, 16 << 10)), "room {room}");
            room += 1;
            assert!(room < 10_000, "the socket never filled");
        }
        for i in 0..16 {
            assert!(sender.send(core(room + i, 100)), "frame {i} of the lane's 16");
        }
        assert!(!sender.send(core(room + 16, 100)), "one past the lane's bound fails");
        assert!(sender.loss_detail().contains("send queue full"), "{}", sender.loss_detail());
    }

    #[tokio::test]
    async fn a_write_to_a_closed_connection_fails_the_send_as_a_closed_link() {
        let (writing, reading) = pair(true).await;
        let writer = LinkWriter::new(writing.as_fd(), SharedSealer::default(), 256 << 10).unwrap();
        let (outbound, lanes) = channels_with(16, Some(writer.clone()));
        spawn(writer, lanes, writing);
        let sender = PeerSender::new(outbound);
        assert!(sender.send(core(0, 100)), "a live connection takes a frame");
        drop(reading);
        let failed = async {
            for room in 1.. {
                if !sender.send(core(room, 100)) {
                    return room;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            unreachable!()
        };
        tokio::time::timeout(Duration::from_secs(5), failed).await.expect("a send to a closed connection fails");
        assert_eq!(sender.loss_detail(), "the link's outbound stream closed");
    }
}
