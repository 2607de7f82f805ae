//! Outgoing connections to each known peer: establish them (TLS with the pinned fingerprint, then the
//! HELLO version exchange), publish their state, and turn the loss of any of them into PEER_DOWN and
//! PEER_LOST failures. Never waits on the network from a host call: everything here runs as tasks.

use crate::lanes::Lane;
use crate::net::{app_code, classify_connection_error, peer_refused_our_certificate};
use crate::reader::{FrameReader, ReadFail};
use crate::shared::Shared;
use crate::tls;
use crate::wire::{EndpointInfo, Frame, HELLO_MAGIC};
use kvgate_abi::{Event, PeerId, PluginError, ReasonCode};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// First wait before retrying a connection the peer refused our certificate on (doubles each time).
pub const AUTH_RETRY_FIRST_MS: u64 = 20;
/// Longest wait between such retries; all retries together stay within `connect_timeout_ms`.
pub const AUTH_RETRY_MAX_MS: u64 = 500;

/// Why one connection attempt failed, and whether trying again may help.
struct AttemptError {
    error: PluginError,
    /// The peer refused our certificate: it may not have learnt our endpoint yet.
    retry: bool,
}

impl From<PluginError> for AttemptError {
    fn from(error: PluginError) -> Self {
        AttemptError { error, retry: false }
    }
}

/// The outgoing side of a peer.
#[derive(Clone)]
pub enum PeerStatus {
    /// No connection and no attempt in progress.
    Idle,
    Connecting,
    Ready(Arc<Links>),
    /// The last attempt failed or the connections were lost; the next submit tries again.
    Down(PluginError),
}

/// The outgoing connections to a peer and the lanes on them (`lanes_per_connection` each, interleaved:
/// lane `i` is on connection `i % connections`).
pub struct Links {
    pub conns: Vec<quinn::Connection>,
    pub lanes: Vec<Arc<Lane>>,
}

impl Links {
    /// `n` distinct lanes (repeating only if `n` exceeds the lanes), the least outstanding bytes first;
    /// ties go in rotation from `start`, so idle lanes take turns.
    pub fn pick_lanes(&self, n: usize, start: usize) -> Vec<Arc<Lane>> {
        let len = self.lanes.len();
        let mut order: Vec<usize> = (0..len).map(|i| start.wrapping_add(i) % len).collect();
        order.sort_by_key(|&i| self.lanes[i].outstanding_bytes());
        order.iter().cycle().take(n).map(|&i| self.lanes[i].clone()).collect()
    }

    /// What the lanes of connection `i` hold right now (lane `j` is on connection `j % conns`):
    /// whether any is held back by it (`Lane::held_back`), and the payload bytes of their parts not
    /// yet answered by the receiver (`Lane::outstanding_bytes`).
    pub fn connection_load(&self, i: usize) -> (bool, u64) {
        let lanes = self.lanes.iter().skip(i).step_by(self.conns.len().max(1));
        lanes.fold((false, 0u64), |(held, bytes), l| {
            (held || l.held_back(), bytes.saturating_add(l.outstanding_bytes()))
        })
    }
}

pub struct PeerEntry {
    pub id: PeerId,
    pub info: EndpointInfo,
    pub endpoint_bytes: Vec<u8>,
    status: watch::Sender<PeerStatus>,
    /// Connections this peer opened to us (it writes into our regions over them).
    incoming: Mutex<Vec<quinn::Connection>>,
    client_config: quinn::ClientConfig,
    removed: AtomicBool,
    /// Where the next transfer's first lane goes: transfers of one lane would otherwise all share the
    /// first connection (and one core).
    next_connection: AtomicUsize,
}

impl PeerEntry {
    pub fn new(
        shared: &Shared,
        id: PeerId,
        info: EndpointInfo,
        endpoint_bytes: Vec<u8>,
    ) -> Result<PeerEntry, PluginError> {
        let crypto = tls::client_crypto(&shared.identity, info.fingerprint, shared.config.cipher_suite)?;
        let quic_crypto = quinn::crypto::rustls::QuicClientConfig::try_from(crypto)
            .map_err(|e| PluginError::new(ReasonCode::INTERNAL, format!("quic client crypto: {e}")))?;
        let mut client_config = quinn::ClientConfig::new(Arc::new(quic_crypto));
        client_config.transport_config(shared.transport.clone());
        let (status, _) = watch::channel(PeerStatus::Idle);
        Ok(PeerEntry {
            id,
            info,
            endpoint_bytes,
            status,
            incoming: Mutex::new(Vec::new()),
            client_config,
            removed: AtomicBool::new(false),
            next_connection: AtomicUsize::new(0),
        })
    }

    pub fn add_incoming(&self, conn: quinn::Connection) {
        let mut incoming = self.incoming.lock().expect("incoming lock");
        incoming.retain(|c| c.close_reason().is_none());
        incoming.push(conn);
    }

    pub fn is_removed(&self) -> bool {
        self.removed.load(Ordering::Acquire)
    }

    /// Close every connection with this peer (host `disconnect`, or shutdown).
    pub fn close_all(&self, reason: ReasonCode, why: &str) {
        self.removed.store(true, Ordering::Release);
        let previous =
            self.status.send_replace(PeerStatus::Down(PluginError::new(ReasonCode::PEER_LOST, why.to_string())));
        if let PeerStatus::Ready(links) = previous {
            for c in links.conns.iter() {
                c.close(app_code(reason), why.as_bytes());
            }
        }
        for c in self.incoming.lock().expect("incoming lock").drain(..) {
            c.close(app_code(reason), why.as_bytes());
        }
    }

    /// quinn's statistics of the outgoing connections, when they are up.
    pub fn connection_stats(&self) -> Vec<quinn::ConnectionStats> {
        match &*self.status.borrow() {
            PeerStatus::Ready(links) => links.conns.iter().map(|c| c.stats()).collect(),
            _ => Vec::new(),
        }
    }

    /// quinn's statistics of the live connections this peer opened to us.
    pub fn incoming_connection_stats(&self) -> Vec<quinn::ConnectionStats> {
        let incoming = self.incoming.lock().expect("incoming lock");
        incoming.iter().filter(|c| c.close_reason().is_none()).map(|c| c.stats()).collect()
    }

    /// The connection index of a transfer's first lane, `lanes` further for the next transfer: lanes
    /// rotate over the connections across transfers.
    pub fn first_connection_for(&self, lanes: usize) -> usize {
        self.next_connection.fetch_add(lanes.max(1), Ordering::Relaxed)
    }

    /// Whether any outgoing connection exists right now.
    pub fn is_ready(&self) -> bool {
        matches!(*self.status.borrow(), PeerStatus::Ready(_))
    }
}

/// Start an attempt unless one is in progress or the connections are up.
fn ensure_connecting(shared: &Arc<Shared>, entry: &Arc<PeerEntry>) {
    let started = entry.status.send_if_modified(|s| match s {
        PeerStatus::Idle | PeerStatus::Down(_) if !entry.is_removed() => {
            *s = PeerStatus::Connecting;
            true
        }
        _ => false,
    });
    if started {
        let (shared, entry) = (shared.clone(), entry.clone());
        shared.handle.clone().spawn(async move { establish(shared, entry).await });
    }
}

/// Start connecting now (at `connect`), so the first transfer does not pay for the handshake.
pub fn start(shared: &Arc<Shared>, entry: &Arc<PeerEntry>) {
    ensure_connecting(shared, entry)
}

/// The peer's connections if they are up right now (only the status's read lock).
pub fn ready_now(entry: &PeerEntry) -> Option<Arc<Links>> {
    match &*entry.status.borrow() {
        PeerStatus::Ready(links) => Some(links.clone()),
        _ => None,
    }
}

/// The peer's connections once they are up, or why they are not.
pub async fn ready(shared: &Arc<Shared>, entry: &Arc<PeerEntry>) -> Result<Arc<Links>, PluginError> {
    // The common case (connections up) takes only the status's read lock.
    if let PeerStatus::Ready(links) = &*entry.status.borrow() {
        return Ok(links.clone());
    }
    let mut rx = entry.status.subscribe();
    ensure_connecting(shared, entry);
    loop {
        match &*rx.borrow_and_update() {
            PeerStatus::Ready(links) => return Ok(links.clone()),
            PeerStatus::Down(e) => return Err(e.clone()),
            PeerStatus::Idle | PeerStatus::Connecting => {}
        }
        if rx.changed().await.is_err() {
            return Err(PluginError::new(ReasonCode::PEER_LOST, "the peer was forgotten"));
        }
    }
}

async fn establish(shared: Arc<Shared>, entry: Arc<PeerEntry>) {
    let count = shared.config.connections_per_peer;
    let mut conns = Vec::with_capacity(count);
    let deadline = Instant::now() + Duration::from_millis(shared.config.connect_timeout_ms);
    for i in 0..count {
        let endpoint = &shared.endpoints[i % shared.endpoints.len()];
        let addr = entry.info.addresses[i % entry.info.addresses.len()];
        let result = connect_with_retries(&shared, &entry, endpoint, addr, deadline).await;
        match result {
            Ok(c) => conns.push(c),
            Err(e) => {
                for c in &conns {
                    c.close(app_code(e.code), b"connection setup failed");
                }
                tracing::warn!(peer = entry.id.0, %addr, reason = %e.code, message = %e.message, "quic: cannot connect to peer");
                if entry.status.send_if_modified(|s| {
                    if matches!(s, PeerStatus::Connecting) {
                        *s = PeerStatus::Down(e.clone());
                        true
                    } else {
                        false
                    }
                }) {
                    shared.sink.deliver(Event::peer_down(
                        entry.id,
                        e.code,
                        format!("cannot connect to {addr}: {}", e.message),
                    ));
                }
                return;
            }
        }
    }
    let mut lanes = Vec::with_capacity(conns.len() * shared.config.lanes_per_connection);
    for _ in 0..shared.config.lanes_per_connection {
        for c in &conns {
            lanes.push(Lane::start(&shared, c.clone()));
        }
    }
    let links = Arc::new(Links { conns, lanes });
    let published = entry.status.send_if_modified(|s| {
        if matches!(s, PeerStatus::Connecting) && !entry.is_removed() {
            *s = PeerStatus::Ready(links.clone());
            true
        } else {
            false
        }
    });
    if !published {
        for c in links.conns.iter() {
            c.close(app_code(ReasonCode::PEER_LOST), b"peer forgotten");
        }
        return;
    }
    tracing::debug!(
        peer = entry.id.0,
        connections = links.conns.len(),
        lanes = links.lanes.len(),
        "quic: connected to peer"
    );
    shared.handle.spawn(crate::stuck::watch(shared.clone(), entry.clone(), links.clone()));
    for c in links.conns.iter() {
        let (shared, entry, links, c) = (shared.clone(), entry.clone(), links.clone(), c.clone());
        shared.handle.clone().spawn(async move {
            let error = c.closed().await;
            on_connection_lost(&shared, &entry, &links, &error);
        });
    }
}

/// Whether `links` are the peer's current connections.
pub fn is_current(entry: &PeerEntry, links: &Arc<Links>) -> bool {
    matches!(&*entry.status.borrow(), PeerStatus::Ready(current) if Arc::ptr_eq(current, links))
}

/// A connection of `links` is stuck (`crate::stuck`): new transfers wait for fresh connections, the
/// parts outstanding on every lane of `links` fail with `why`, the connections close with its reason
/// code, and new connections are opened right away. No PEER_DOWN: the peer itself is still there.
pub fn replace_stuck(shared: &Arc<Shared>, entry: &Arc<PeerEntry>, links: &Arc<Links>, why: PluginError) {
    let replaced = entry.status.send_if_modified(|s| match s {
        PeerStatus::Ready(current) if Arc::ptr_eq(current, links) && !entry.is_removed() => {
            *s = PeerStatus::Idle;
            true
        }
        _ => false,
    });
    if !replaced {
        return;
    }
    tracing::warn!(peer = entry.id.0, reason = %why.code, message = %why.message, "quic: replacing a stuck connection");
    shared.stuck_connections_replaced.fetch_add(1, Ordering::Relaxed);
    for lane in links.lanes.iter() {
        lane.fail_all(&why);
    }
    for c in links.conns.iter() {
        c.close(app_code(why.code), why.message.as_bytes());
    }
    ensure_connecting(shared, entry);
}

/// One connection ended: the whole peer is down (every connection closed, every transfer failed).
fn on_connection_lost(
    shared: &Arc<Shared>,
    entry: &Arc<PeerEntry>,
    links: &Arc<Links>,
    error: &quinn::ConnectionError,
) {
    let e = classify_connection_error(error, true);
    let lost =
        PluginError::new(ReasonCode::PEER_LOST, format!("connection to peer {} lost: {}", entry.id.0, e.message));
    let was_current = entry.status.send_if_modified(|s| match s {
        PeerStatus::Ready(current) if Arc::ptr_eq(current, links) => {
            *s = PeerStatus::Down(lost.clone());
            true
        }
        _ => false,
    });
    if !was_current {
        return;
    }
    for c in links.conns.iter() {
        c.close(app_code(ReasonCode::PEER_LOST), b"a sibling connection was lost");
    }
    tracing::warn!(peer = entry.id.0, reason = "peer_lost", message = %lost.message, "quic: peer down");
    shared.sink.deliver(Event::peer_down(entry.id, ReasonCode::PEER_LOST, lost.message.to_string()));
    for t in shared.transfers.of_peer(entry.id) {
        t.fail(ReasonCode::PEER_LOST, lost.message.to_string());
    }
}

/// One connection, retried while the peer refuses our certificate, all within `deadline`.
async fn connect_with_retries(
    shared: &Shared,
    entry: &PeerEntry,
    endpoint: &quinn::Endpoint,
    addr: std::net::SocketAddr,
    deadline: Instant,
) -> Result<quinn::Connection, PluginError> {
    let timed_out = || {
        PluginError::new(
            ReasonCode::PEER_UNREACHABLE,
            format!("no connection to {addr} within connect_timeout_ms ({})", shared.config.connect_timeout_ms),
        )
    };
    let mut wait_ms = AUTH_RETRY_FIRST_MS;
    // Once the peer refused our certificate, running out of time reports that refusal.
    let mut last_refusal: Option<PluginError> = None;
    loop {
        let attempt = match tokio::time::timeout_at(deadline, connect_one(shared, entry, endpoint, addr)).await {
            Ok(attempt) => attempt,
            Err(_) => return Err(last_refusal.unwrap_or_else(timed_out)),
        };
        match attempt {
            Ok(conn) => return Ok(conn),
            Err(AttemptError { error, retry: true }) if Instant::now() + Duration::from_millis(wait_ms) < deadline => {
                tracing::debug!(peer = entry.id.0, %addr, message = %error.message, "quic: peer refused our certificate; retrying");
                last_refusal = Some(error);
                tokio::time::sleep(Duration::from_millis(wait_ms)).await;
                wait_ms = (wait_ms * 2).min(AUTH_RETRY_MAX_MS);
            }
            Err(AttemptError { error, .. }) => return Err(error),
        }
    }
}

fn attempt_error(e: &quinn::ConnectionError) -> AttemptError {
    AttemptError { error: classify_connection_error(e, false), retry: peer_refused_our_certificate(e) }
}

async fn connect_one(
    shared: &Shared,
    entry: &PeerEntry,
    endpoint: &quinn::Endpoint,
    addr: std::net::SocketAddr,
) -> Result<quinn::Connection, AttemptError> {
    let connecting = endpoint.connect_with(entry.client_config.clone(), addr, tls::SERVER_NAME).map_err(|e| {
        PluginError::new(ReasonCode::PEER_UNREACHABLE, format!("cannot start a connection to {addr}: {e}"))
    })?;
    let conn = connecting.await.map_err(|e| attempt_error(&e))?;
    let why_closed = |conn: &quinn::Connection, fallback: String| match conn.close_reason() {
        Some(e) => attempt_error(&e),
        None => AttemptError::from(PluginError::new(ReasonCode::PROTOCOL_VIOLATION, fallback)),
    };
    let (mut send, recv) = match conn.open_bi().await {
        Ok(pair) => pair,
        Err(e) => return Err(attempt_error(&e)),
    };
    let hello = Frame::Hello { magic: HELLO_MAGIC, version: shared.wire_version, instance: shared.instance };
    if let Err(e) = send.write_all(&hello.to_bytes()).await {
        return Err(why_closed(&conn, format!("sending HELLO failed: {e}")));
    }
    let _ = send.finish();
    let mut reader = FrameReader::new(recv);
    match reader.read_frame().await {
        Ok(Some(Frame::HelloReply { status: 0, .. })) => Ok(conn),
        Ok(Some(Frame::HelloReply { version, status, .. })) => {
            conn.close(app_code(ReasonCode(status)), b"hello refused");
            Err(AttemptError::from(PluginError::new(
                ReasonCode(status),
                format!("peer refused HELLO: it speaks wire version {version}, this side {}", shared.wire_version),
            )))
        }
        Ok(other) => {
            let why = format!("expected HELLO_REPLY, got {other:?}");
            conn.close(app_code(ReasonCode::PROTOCOL_VIOLATION), why.as_bytes());
            Err(AttemptError::from(PluginError::new(ReasonCode::PROTOCOL_VIOLATION, why)))
        }
        Err(ReadFail::Source(_)) => {
            // The server closes the connection with the reason (version mismatch, unknown certificate).
            let _ = tokio::time::timeout(Duration::from_millis(shared.config.connect_timeout_ms), conn.closed()).await;
            Err(why_closed(&conn, "the peer ended the control stream without a HELLO_REPLY".into()))
        }
        Err(other) => {
            let why = format!("bad HELLO_REPLY: {other:?}");
            conn.close(app_code(ReasonCode::PROTOCOL_VIOLATION), why.as_bytes());
            Err(AttemptError::from(PluginError::new(ReasonCode::PROTOCOL_VIOLATION, why)))
        }
    }
}
