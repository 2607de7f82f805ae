//! One task per known peer: obtain a session (dial it, or accept it from the server), run it
//! (heartbeats out; frames in, read here or on the driver's thread, `intake.rs`; loss after
//! `heartbeat_interval_ms * heartbeat_misses` of silence with nothing unread in the socket), then
//! report the loss and start over; a discovered peer's task ends once its record is withdrawn and no
//! session is left. Never blocks the driver: frames out go through a bounded queue whose overflow is
//! itself a loss.

use super::handshaken::Session;
use super::intake::{Heard, Intake, Reading, Taken};
use super::{dial, LocalIdentity, PeerDirectory};
use crate::channels::{DriverInput, LinkEnd, PeerEvent, PeerSender};
use crate::config::{GatewayConfig, PeerEntry};
use kvgate_client::proto::{self, peer_frame::Frame};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

static NEXT_SESSION: AtomicU64 = AtomicU64::new(1);

pub(super) struct PeerTask {
    pub config: Arc<GatewayConfig>,
    pub name: String,
    /// The entry to dial; `None` once the peer's discovery record is withdrawn.
    pub entry: watch::Receiver<Option<PeerEntry>>,
    pub directory: Arc<PeerDirectory>,
    pub identity: Arc<LocalIdentity>,
    /// The driver's input queue: peer events go straight in (no forwarding task in between).
    pub events: mpsc::Sender<DriverInput>,
    pub incoming: mpsc::Receiver<Session>,
    pub auth: super::LinkAuth,
    /// The driver's runtime: a framed link's socket is read there (`intake.rs`). `None` in tests
    /// that run no driver thread: the session task reads it.
    pub driver_runtime: Option<tokio::runtime::Handle>,
    /// The last authentication failure logged, and when (repeats are rate-limited).
    pub last_auth_warning: Option<(String, Instant)>,
}

/// How often a dial that keeps failing authentication is logged.
pub const DIAL_AUTH_WARN_INTERVAL_MS: u64 = 10_000;

impl PeerTask {
    pub async fn run(mut self) {
        let dialer = super::dials(&self.identity.name, &self.name);
        let reconnect = Duration::from_millis(self.config.peer_link.reconnect_interval_ms);
        let mut next: Option<Session> = None;
        loop {
            let current = self.entry.borrow_and_update().clone();
            let session = match (next.take(), current) {
                (Some(s), _) => s,
                (None, None) => {
                    if self.directory.retire(&self.name) {
                        tracing::info!(peer = %self.name, "peer withdrawn from discovery: its link task ends");
                        return;
                    }
                    continue;
                }
                (None, Some(peer)) if dialer => match dial::dial(&self.config, &peer, &self.identity, &self.auth).await
                {
                    Ok(s) => s,
                    Err(e) => {
                        self.log_dial_failure(&e);
                        self.wait_or_entry_change(reconnect).await;
                        continue;
                    }
                },
                (None, Some(_)) => tokio::select! {
                    accepted = self.incoming.recv() => match accepted {
                        Some(s) => s,
                        None => return,
                    },
                    changed = self.entry.changed() => match changed {
                        Ok(()) => continue,
                        Err(_) => return,
                    },
                },
            };
            next = self.run_session(session).await;
            if dialer && next.is_none() {
                self.wait_or_entry_change(reconnect).await;
            }
        }
    }

    /// A failed dial: an authentication failure is a warning (at most one line per
    /// `DIAL_AUTH_WARN_INTERVAL_MS` while it repeats, since the task retries every
    /// `reconnect_interval_ms`); an unreachable peer is routine and stays at debug.
    fn log_dial_failure(&mut self, error: &anyhow::Error) {
        let text = format!("{error:#}");
        if !text.contains("peer_auth_failed") {
            tracing::debug!(peer = %self.name, "peer link dial failed: {text}");
            return;
        }
        let now = Instant::now();
        let repeat = self.last_auth_warning.as_ref().is_some_and(|(last, at)| {
            *last == text && now.duration_since(*at) < Duration::from_millis(DIAL_AUTH_WARN_INTERVAL_MS)
        });
        if !repeat {
            tracing::warn!(peer = %self.name, reason = "peer_auth_failed", "peer link refused: {text}");
            self.last_auth_warning = Some((text, now));
        }
    }

    /// Sleeps `pause`, or less when the peer's entry changes (a new address, or withdrawn).
    async fn wait_or_entry_change(&mut self, pause: Duration) {
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = self.entry.changed() => {}
        }
    }

    /// Runs until the session is lost; returns a newer session that replaced it, if any.
    pub(super) async fn run_session(&mut self, session: Session) -> Option<Session> {
        let id = NEXT_SESSION.fetch_add(1, Ordering::Relaxed);
        let name = self.name.clone();
        let sender = PeerSender::new(session.outbound.clone());
        tracing::info!(peer = %name, session = id, incarnation = session.hello.incarnation, transport = session.transport.as_str(), "peer link up");
        if self
            .events
            .send(DriverInput::Peer(PeerEvent::Up {
                name: name.clone(),
                session: id,
                hello: session.hello.clone(),
                sender: sender.clone(),
            }))
            .await
            .is_err()
        {
            return None;
        }
        let heard = Heard::new();
        let intake = Intake {
            session: id,
            opener: session.opener,
            joining: super::lanes::Reassembly::new(self.config.peer_link.max_frame_bytes),
            events: self.events.clone(),
            heard: heard.clone(),
        };
        let mut inbound = Reading::start(session.inbound, intake, self.driver_runtime.as_ref());
        let interval = Duration::from_millis(self.config.peer_link.heartbeat_interval_ms);
        let silence_limit = interval * self.config.peer_link.heartbeat_misses as u32;
        let mut heartbeat = tokio::time::interval(interval);
        let mut seq = 0u64;
        let mut last_heard = heard.last();
        let catch_up = Duration::from_millis(self.config.driver.stall_catch_up_ms);
        let mut replacement = None;
        let (end, detail): (LinkEnd, String) = loop {
            last_heard = last_heard.max(heard.last());
            // Frames already received go first: after a stall of this process, the peer's frames
            // waiting in the socket are read before its silence is judged.
            tokio::select! {
                biased;
                read = inbound.next() => match inbound.take(read).await {
                    Taken::Next => {}
                    Taken::End(end, why) => break (end, why),
                    Taken::DriverGone => return None,
                },
                _ = heartbeat.tick() => {
                    seq += 1;
                    if !sender.send(Frame::Heartbeat(proto::Heartbeat { seq })) {
                        break (LinkEnd::Closed, sender.loss_detail().into());
                    }
                }
                _ = tokio::time::sleep_until(last_heard + silence_limit) => {
                    if heard.last() > last_heard {
                        continue;
                    }
                    // Woken much later than asked: this process was stalled, and what the peer sent
                    // meanwhile may still be unread. Listen for `driver.stall_catch_up_ms` more.
                    let late = Instant::now().saturating_duration_since(last_heard + silence_limit);
                    if !catch_up.is_zero() && late > catch_up {
                        tracing::info!(peer = %name, late_ms = late.as_millis() as u64, "stalled past this link's silence bound: reading what arrived before judging it");
                        last_heard = Instant::now() + catch_up - silence_limit;
                        continue;
                    }
                    // The peer's bytes wait unread: its reader (the driver's thread) is behind, the
                    // peer is not silent.
                    if inbound.bytes_waiting() {
                        tracing::info!(peer = %name, silent_ms = silence_limit.as_millis() as u64, "the peer's frames wait unread past this link's silence bound (the driver's thread is busy): not a loss");
                        last_heard = Instant::now();
                        continue;
                    }
                    break (LinkEnd::HeartbeatTimeout, format!("no frame for {} ms (heartbeat_interval_ms {} x heartbeat_misses {})",
                        silence_limit.as_millis(), interval.as_millis(), self.config.peer_link.heartbeat_misses));
                }
                _ = sender.failed() => break (LinkEnd::Closed, sender.loss_detail().into()),
                newer = self.incoming.recv() => match newer {
                    Some(s) => {
                        let restarted = s.hello.incarnation != session.hello.incarnation;
                        replacement = Some(s);
                        break (if restarted { LinkEnd::Restarted } else { LinkEnd::Replaced }, "the peer dialled a new link".into());
                    }
                    None => break (LinkEnd::Shutdown, "gateway stopping".into()),
                },
            }
        };
        // No frame of this session reaches the driver after its loss.
        inbound.stop().await;
        tracing::warn!(peer = %name, session = id, reason = end.reason(), "peer link lost: {detail}");
        let _ = self.events.send(DriverInput::Peer(PeerEvent::Lost { name, session: id, end })).await;
        replacement
    }
}
