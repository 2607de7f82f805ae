//! What crosses between the peer links and the driver: a session's events (up, frames, lost and
//! why) and the non-blocking sender of its outbound frames.

use kvgate_client::proto::{self, peer_frame::Frame, PeerFrame};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::sync::mpsc;

/// The sending halves of one link's lanes.
#[derive(Clone, Debug)]
pub struct Outbound {
    pub bulk: mpsc::Sender<PeerFrame>,
    pub urgent: mpsc::Sender<PeerFrame>,
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
    /// Queues `frame`: a heartbeat on the urgent lane, anything else on the bulk lane.
    pub fn send(&self, frame: Frame) -> bool {
        let lane = if matches!(frame, Frame::Heartbeat(_)) { &self.tx.urgent } else { &self.tx.bulk };
        match lane.try_send(PeerFrame { frame: Some(frame), mac: Vec::new() }) {
            Ok(()) => true,
            Err(e) => {
                if matches!(e, mpsc::error::TrySendError::Closed(_)) {
                    self.failed.closed.store(true, Ordering::Relaxed);
                }
                self.failed.notify.notify_one();
                false
            }
        }
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
