//! What a live link does with each inbound frame, wherever its socket is read: the MAC checked
//! (`psk`), heartbeats taken as liveness only, fragments joined, handshake frames refused, and every
//! other frame handed to the driver in order. Records when the peer was last heard, for the session
//! task that judges silence.
//!
//! A framed link's frames are taken on the driver's own thread ([`spawn_reader`]): the driver's
//! input queue is then filled by a task of the driver's runtime, so a frame reaches the driver
//! without waking another thread ([`Reading`]). A gRPC link's are taken by the session task (tonic reads it).

use super::framed::DetachedReader;
use super::handshaken::{Inbound, InboundError};
use super::lanes::Reassembly;
use super::psk::FrameOpener;
use crate::channels::{DriverInput, LinkEnd, PeerEvent, SessionId};
use kvgate_client::proto::{peer_frame::Frame, PeerFrame};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// When a link's peer was last heard, shared between the link's reader and its session task.
pub(super) struct Heard {
    since: Instant,
    /// Nanoseconds from `since` to the last frame read.
    last_ns: AtomicU64,
}

impl Heard {
    pub fn new() -> Arc<Heard> {
        Arc::new(Heard { since: Instant::now(), last_ns: AtomicU64::new(0) })
    }

    /// Records that the peer was heard now.
    fn mark(&self) {
        let ns = Instant::now().saturating_duration_since(self.since).as_nanos() as u64;
        self.last_ns.fetch_max(ns, Ordering::Relaxed);
    }

    /// When the last frame was read (the session's start if none was).
    pub fn last(&self) -> Instant {
        self.since + std::time::Duration::from_nanos(self.last_ns.load(Ordering::Relaxed))
    }
}

/// What became of one inbound item.
pub(super) enum Taken {
    /// Taken (handed to the driver, or a heartbeat or a fragment): read on.
    Next,
    /// The link is over, and why.
    End(LinkEnd, String),
    /// The driver's queue is closed: the gateway is stopping.
    DriverGone,
}

/// One link's inbound frame handling.
pub(super) struct Intake {
    pub session: SessionId,
    pub opener: Option<FrameOpener>,
    pub joining: Reassembly,
    pub events: mpsc::Sender<DriverInput>,
    pub heard: Arc<Heard>,
}

impl Intake {
    /// Takes one item of the link's inbound side (`None`: the peer closed it).
    pub async fn take(&mut self, item: Option<Result<PeerFrame, InboundError>>) -> Taken {
        let frame = match item {
            None => return Taken::End(LinkEnd::Closed, "the peer closed the link".into()),
            Some(Err(InboundError::ProtocolViolation(why))) => return Taken::End(LinkEnd::ProtocolViolation, why),
            Some(Err(InboundError::Broken(why))) => return Taken::End(LinkEnd::Closed, format!("link error: {why}")),
            Some(Ok(frame)) => frame,
        };
        let frame = match self.opener.as_mut() {
            Some(opener) => match opener.open(frame) {
                Ok(frame) => frame,
                Err(why) => return Taken::End(LinkEnd::AuthFailed, why),
            },
            None => frame,
        };
        self.heard.mark();
        let Some(frame) = frame.frame else { return Taken::Next };
        let frame = match frame {
            Frame::Heartbeat(_) => return Taken::Next,
            Frame::Fragment(fragment) => match self.joining.push(fragment) {
                Ok(Some(whole)) => whole,
                Ok(None) => return Taken::Next,
                Err(why) => return Taken::End(LinkEnd::ProtocolViolation, why),
            },
            _ if self.joining.pending_bytes() > 0 => {
                return Taken::End(LinkEnd::ProtocolViolation, "a frame between the fragments of another".into())
            }
            frame => frame,
        };
        if let Frame::Hello(_) | Frame::Refused(_) = frame {
            return Taken::End(LinkEnd::ProtocolViolation, "a handshake frame on a live link".into());
        }
        match self.events.send(DriverInput::Peer(PeerEvent::Frame { session: self.session, frame })).await {
            Ok(()) => Taken::Next,
            Err(_) => Taken::DriverGone,
        }
    }
}

/// Where a live link's inbound side is read.
pub(super) enum Reading {
    /// By the session task itself: a gRPC link, or a framed one with no driver runtime to read it
    /// on (in-process tests).
    Here { inbound: Inbound, intake: Box<Intake> },
    /// By a task on the driver's runtime; `socket` (a descriptor of its own) tells whether bytes
    /// wait unread while that thread is busy.
    OnDriver { task: JoinHandle<Option<(LinkEnd, String)>>, socket: Option<OwnedFd>, done: bool },
}

/// What [`Reading::next`] returned, for [`Reading::take`].
pub(super) enum Read {
    Item(Option<Result<PeerFrame, InboundError>>),
    Done(Taken),
}

impl Reading {
    /// Starts reading `inbound`: a framed link's socket on `driver` when there is one.
    pub fn start(inbound: Inbound, intake: Intake, driver: Option<&tokio::runtime::Handle>) -> Reading {
        let (framed, driver) = match (inbound, driver) {
            (Inbound::Framed(framed), Some(driver)) => (framed, driver),
            (inbound, _) => return Reading::Here { inbound, intake: Box::new(intake) },
        };
        match framed.detach() {
            Ok(reader) => {
                // Without it the silence check only misses the driver-busy case; reading goes on.
                let socket = reader.socket().try_clone_to_owned().ok();
                Reading::OnDriver { task: spawn_reader(driver, reader, intake), socket, done: false }
            }
            Err(framed) => Reading::Here { inbound: Inbound::Framed(framed), intake: Box::new(intake) },
        }
    }

    /// The next inbound item, or the end of the reader on the driver's thread. Cancel-safe.
    pub async fn next(&mut self) -> Read {
        match self {
            Reading::Here { inbound, .. } => Read::Item(inbound.next().await),
            Reading::OnDriver { done: true, .. } => std::future::pending().await,
            Reading::OnDriver { task, done, .. } => {
                let ended = task.await;
                *done = true;
                Read::Done(match ended {
                    Ok(Some((end, why))) => Taken::End(end, why),
                    Ok(None) => Taken::DriverGone,
                    Err(e) => Taken::End(
                        LinkEnd::Closed,
                        format!("link error: its reader on the driver's thread stopped: {e}"),
                    ),
                })
            }
        }
    }

    /// Takes what `next` returned (not cancel-safe: await it to the end).
    pub async fn take(&mut self, read: Read) -> Taken {
        match (self, read) {
            (_, Read::Done(taken)) => taken,
            (Reading::Here { intake, .. }, Read::Item(item)) => intake.take(item).await,
            (Reading::OnDriver { .. }, Read::Item(_)) => unreachable!("the driver's reader yields no items here"),
        }
    }

    /// Whether the peer's bytes wait unread in a socket read on the driver's thread.
    pub fn bytes_waiting(&self) -> bool {
        match self {
            Reading::OnDriver { socket: Some(socket), done: false, .. } => super::framed::bytes_waiting(socket.as_fd()),
            _ => false,
        }
    }

    /// Stops the reading, and waits until no frame of it can still reach the driver.
    pub async fn stop(self) {
        if let Reading::OnDriver { task, done: false, .. } = self {
            task.abort();
            let _ = task.await;
        }
    }
}

/// Reads a framed link on `runtime` (the driver's) until it ends; the task's result is why
/// (`None`: the driver is gone). Aborting the task stops the reading.
fn spawn_reader(
    runtime: &tokio::runtime::Handle,
    reader: DetachedReader,
    mut intake: Intake,
) -> JoinHandle<Option<(LinkEnd, String)>> {
    runtime.spawn(async move {
        // Registered with the reactor of the runtime this runs on.
        let mut reader = match reader.attach() {
            Ok(reader) => reader,
            Err(e) => {
                return Some((LinkEnd::Closed, format!("link error: read the socket on the driver's thread: {e}")))
            }
        };
        loop {
            let item = reader.next().await;
            match intake.take(item).await {
                Taken::Next => {}
                Taken::End(end, why) => return Some((end, why)),
                Taken::DriverGone => return None,
            }
        }
    })
}

/// For tests: a "driver thread", a single-threaded runtime on its own thread, serving until the
/// returned sender fires or drops.
#[cfg(test)]
pub(super) fn driver_thread() -> (tokio::runtime::Handle, tokio::sync::oneshot::Sender<()>) {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let handle = runtime.handle().clone();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || runtime.block_on(async move { stopped.await.ok() }));
    (handle, stop)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::peer_link::framed;
    use kvgate_client::lane_frame::encode_frame;
    use kvgate_client::proto;
    use std::time::Duration;
    use tokio::io::AsyncWriteExt;

    fn withdraw(region: u64) -> PeerFrame {
        PeerFrame { frame: Some(Frame::RegionWithdraw(proto::RegionWithdraw { region })), mac: Vec::new() }
    }

    fn encoded(frames: &[PeerFrame]) -> Vec<u8> {
        let mut bytes = Vec::new();
        for frame in frames {
            encode_frame(frame, &mut bytes);
        }
        bytes
    }

    /// A connected TCP pair: the link's end as a framed inbound side (read here first, as during a
    /// handshake), and the peer's end to write frames with.
    async fn link() -> (Inbound, tokio::net::TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let peer = tokio::net::TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        let (ours, _) = listener.accept().await.unwrap();
        let socket = std::os::fd::AsFd::as_fd(&ours).try_clone_to_owned().unwrap();
        let (read, _write) = ours.into_split();
        (framed::socket_inbound(read, socket, 1 << 20), peer)
    }

    fn intake(events: mpsc::Sender<DriverInput>) -> (Intake, Arc<Heard>) {
        let heard = Heard::new();
        let intake =
            Intake { session: 9, opener: None, joining: Reassembly::new(1 << 20), events, heard: heard.clone() };
        (intake, heard)
    }

    async fn next_region(events: &mut mpsc::Receiver<DriverInput>) -> u64 {
        let input = tokio::time::timeout(Duration::from_secs(5), events.recv()).await.expect("a frame in time");
        match input {
            Some(DriverInput::Peer(PeerEvent::Frame { session: 9, frame: Frame::RegionWithdraw(w) })) => w.region,
            _ => panic!("expected a frame of session 9"),
        }
    }

    #[tokio::test]
    async fn a_framed_link_read_on_the_driver_thread_hands_over_every_frame_in_order_buffered_ones_first() {
        let (driver, _stop) = driver_thread();
        let (mut inbound, mut peer) = link().await;
        // The handshake's frame and the first frames after it arrive in one write: the reader that
        // took the first has the others buffered when the link is handed to the driver's thread.
        peer.write_all(&encoded(&[withdraw(0), withdraw(1), withdraw(2)])).await.unwrap();
        assert_eq!(inbound.next().await.unwrap().unwrap(), withdraw(0));
        let (events_tx, mut events) = mpsc::channel(1024);
        let (intake, heard) = intake(events_tx);
        let before = heard.last();
        let mut reading = Reading::start(inbound, intake, Some(&driver));
        assert!(matches!(reading, Reading::OnDriver { .. }), "a socket and a driver runtime: read there");
        let mut frames = Vec::new();
        for region in 3..500 {
            frames.push(withdraw(region));
            frames.push(PeerFrame { frame: Some(Frame::Heartbeat(proto::Heartbeat { seq: region })), mac: Vec::new() });
        }
        peer.write_all(&encoded(&frames)).await.unwrap();
        for region in 1..500 {
            assert_eq!(next_region(&mut events).await, region, "in order, heartbeats not handed over");
        }
        assert!(heard.last() > before, "the reader on the driver's thread records the peer as heard");
        // The peer closes: the reading ends with the reason, once.
        drop(peer);
        match tokio::time::timeout(Duration::from_secs(5), reading.next()).await.expect("the end in time") {
            Read::Done(Taken::End(LinkEnd::Closed, why)) => assert!(why.contains("closed"), "{why}"),
            _ => panic!("expected the link's end"),
        }
        reading.stop().await;
        assert!(events.try_recv().is_err(), "nothing after the end");
    }

    #[tokio::test]
    async fn bytes_unread_while_the_driver_thread_is_busy_are_seen_and_none_after_it_reads_them() {
        let (driver, _stop) = driver_thread();
        let (inbound, mut peer) = link().await;
        let (events_tx, mut events) = mpsc::channel(16);
        let (intake, heard) = intake(events_tx);
        let reading = Reading::start(inbound, intake, Some(&driver));
        assert!(!reading.bytes_waiting(), "nothing sent yet");
        // The driver's thread blocks (a long plugin call), and the peer speaks meanwhile.
        let (blocked_tx, blocked) = std::sync::mpsc::channel();
        driver.spawn(async move {
            blocked_tx.send(()).unwrap();
            std::thread::sleep(Duration::from_millis(1500));
        });
        blocked.recv().unwrap();
        let heard_before = heard.last();
        peer.write_all(&encoded(&[withdraw(1)])).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(reading.bytes_waiting(), "the peer's frame waits unread in the socket");
        assert_eq!(heard.last(), heard_before, "and its reader has not run");
        assert_eq!(next_region(&mut events).await, 1, "read once the thread is free");
        assert!(!reading.bytes_waiting(), "nothing left unread");
        reading.stop().await;
    }

    #[tokio::test]
    async fn a_stopped_reading_hands_nothing_more_to_the_driver() {
        let (driver, _stop) = driver_thread();
        let (inbound, mut peer) = link().await;
        let (events_tx, mut events) = mpsc::channel(16);
        let reading = Reading::start(inbound, intake(events_tx).0, Some(&driver));
        peer.write_all(&encoded(&[withdraw(1)])).await.unwrap();
        assert_eq!(next_region(&mut events).await, 1);
        reading.stop().await;
        // The socket may already be closed by then (the reading held its last descriptor).
        let _ = peer.write_all(&encoded(&[withdraw(2)])).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(events.try_recv().is_err(), "a frame after the stop reached the driver");
    }

    #[tokio::test]
    async fn without_a_driver_runtime_the_session_task_reads_the_link_itself() {
        let (mut inbound, mut peer) = link().await;
        peer.write_all(&encoded(&[withdraw(0), withdraw(1)])).await.unwrap();
        assert_eq!(inbound.next().await.unwrap().unwrap(), withdraw(0));
        let (events_tx, mut events) = mpsc::channel(16);
        let mut reading = Reading::start(inbound, intake(events_tx).0, None);
        assert!(matches!(reading, Reading::Here { .. }));
        let read = reading.next().await;
        assert!(matches!(reading.take(read).await, Taken::Next));
        assert_eq!(next_region(&mut events).await, 1);
    }
}
