//! What crosses between the peer links and the driver: a session's events (up, frames, lost and
//! why) and the non-blocking sender of its outbound frames.

use crate::peer_link::writer::{Direct, LinkWriter};
use kvgate_client::proto::{self, peer_frame::Frame, PeerFrame};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::sync::mpsc;

/// The sending halves of one link's lanes, and, on a framed link, its writer, through which the
/// driver's thread writes straight to the socket when nothing waits ahead (`peer_link/writer.rs`).
#[derive(Clone)]
pub struct Outbound {
    pub bulk: mpsc::Sender<PeerFrame>,
    pub urgent: mpsc::Sender<PeerFrame>,
    pub direct: Option<Arc<LinkWriter>>,
}

impl std::fmt::Debug for Outbound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbound").field("direct", &self.direct.is_some()).finish_non_exhaustive()
    }
}

impl Outbound {
    /// Queues `frame` on the bulk lane, waiting for room (the handshake's frames).
    pub async fn queue_bulk(&self, frame: PeerFrame) -> Result<(), mpsc::error::SendError<PeerFrame>> {
        if let Some(w) = &self.direct {
            w.queuing();
        }
        let sent = self.bulk.send(frame).await;
        if let (Err(_), Some(w)) = (&sent, &self.direct) {
            w.unqueued();
        }
        sent
    }

    /// Queues `frame` on the bulk lane if it has room; `Err(true)` when the lane is closed, `Err(false)`
    /// when it is full.
    pub fn try_queue_bulk(&self, frame: PeerFrame) -> Result<(), bool> {
        if let Some(w) = &self.direct {
            w.queuing();
        }
        let sent = self.bulk.try_send(frame).map_err(|e| matches!(e, mpsc::error::TrySendError::Closed(_)));
        if let (Err(_), Some(w)) = (&sent, &self.direct) {
            w.unqueued();
        }
        sent
    }
}

/// A process-unique number for one session with one peer incarnation; the driver uses it as the
/// plugin `PeerId`, so a reconnected or restarted peer is always a new peer to the core.
pub type SessionId = u64;

/// What the peer links tell the driver.
#[derive(Debug)]
pub enum PeerEvent {
    /// A session is up: the peer's Hello and how to send to it.
    Up { name: String, session: SessionId, hello: proto::Hello, sender: PeerSender },
    /// A frame (not a heartbeat) from a live session, in order.
    Frame { session: SessionId, frame: Frame },
    /// The session ended, and why (the session task logged the details).
    Lost { name: String, session: SessionId, end: LinkEnd },
}

/// Why a session ended, known where it ended; `reason()` is the reason code logged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkEnd {
    /// A frame failed its MAC (`peer_auth_failed`).
    AuthFailed,
    /// A frame broke the link protocol (`protocol_violation`).
    ProtocolViolation,
    /// The peer closed the link, the stream failed, or the send queue overflowed or closed (`peer_lost`).
    Closed,
    /// No frame within `heartbeat_interval_ms * heartbeat_misses` (`peer_lost`).
    HeartbeatTimeout,
    /// The same peer process dialled a new link (`peer_lost`).
    Replaced,
    /// The peer dialled a new link with a new incarnation (`peer_restarted`).
    Restarted,
    /// This gateway is stopping (`shutdown`).
    Shutdown,
}

impl LinkEnd {
    pub fn reason(self) -> &'static str {
        match self {
            LinkEnd::AuthFailed => "peer_auth_failed",
            LinkEnd::ProtocolViolation => "protocol_violation",
            LinkEnd::Closed | LinkEnd::HeartbeatTimeout | LinkEnd::Replaced => "peer_lost",
            LinkEnd::Restarted => "peer_restarted",
            LinkEnd::Shutdown => "shutdown",
        }
    }
}

/// Sends frames to one session. `send` never waits: a full queue (the peer stopped reading) or a
/// closed one (the link's stream ended) reports `false`, and the session task then declares the
/// peer lost with that cause.
#[derive(Clone, Debug)]
pub struct PeerSender {
    tx: Outbound,
    failed: Arc<SendFailure>,
}

/// Why a send failed, for the session task's loss message.
#[derive(Debug, Default)]
struct SendFailure {
    notify: tokio::sync::Notify,
    closed: std::sync::atomic::AtomicBool,
}

impl PeerSender {
    /// Sends `frame`: a heartbeat on the urgent lane; anything else straight to a framed link's
    /// socket when nothing waits ahead of it, else on the bulk lane.
    pub fn send(&self, frame: Frame) -> bool {
        let heartbeat = matches!(frame, Frame::Heartbeat(_));
        let mut frame = PeerFrame { frame: Some(frame), mac: Vec::new() };
        if let (false, Some(writer)) = (heartbeat, &self.tx.direct) {
            frame = match writer.try_direct(frame) {
                Direct::Taken => return true,
                Direct::Behind(frame) => *frame,
                Direct::Failed => return self.fail(true),
            };
        }
        let sent = if heartbeat {
            self.tx.urgent.try_send(frame).map_err(|e| matches!(e, mpsc::error::TrySendError::Closed(_)))
        } else {
            self.tx.try_queue_bulk(frame)
        };
        match sent {
            Ok(()) => true,
            Err(closed) => self.fail(closed),
        }
    }

    /// Records a failed send (`closed`: the link's outbound side is gone, else its queue is full)
    /// for the session task; returns `false`.
    fn fail(&self, closed: bool) -> bool {
        if closed {
            self.failed.closed.store(true, Ordering::Relaxed);
        }
        self.failed.notify.notify_one();
        false
    }

    /// A sender onto `lanes`; the session task waits on `failed` to learn of a failed send.
    pub fn new(lanes: Outbound) -> PeerSender {
        PeerSender { tx: lanes, failed: Arc::default() }
    }

    /// Returns once a send failed (at once if one failed since the last call).
    pub async fn failed(&self) {
        self.failed.notify.notified().await
    }

    /// Why a send failed, for the session's loss message.
    pub fn loss_detail(&self) -> &'static str {
        if self.failed.closed.load(Ordering::Relaxed) {
            "the link's outbound stream closed"
        } else {
            "send queue full (peer_link.send_queue_frames; the peer stopped reading)"
        }
    }
}
