//! The accepting side of every endpoint: refuse unknown certificates and other wire versions, then
//! serve each lane stream a peer opens (the checks themselves live in `incoming`). Never writes into
//! memory except through `incoming::receive_lane`.

use crate::incoming::{receive_lane, LaneContext, LaneOutcome};
use crate::net::app_code;
use crate::plugin::Shared;
use crate::reader::FrameReader;
use crate::tls;
use crate::wire::{Frame, HELLO_MAGIC};
use kvgate_abi::{Event, PeerId, ReasonCode};
use std::sync::Arc;
use std::time::Duration;

pub async fn accept_loop(shared: Arc<Shared>, endpoint: quinn::Endpoint) {
    while let Some(incoming) = endpoint.accept().await {
        if shared.is_shut_down() {
            incoming.refuse();
            continue;
        }
        let shared = shared.clone();
        tokio::spawn(async move { serve_connection(shared, incoming).await });
    }
}

async fn serve_connection(shared: Arc<Shared>, incoming: quinn::Incoming) {
    let remote = incoming.remote_address();
    let conn = match incoming.await {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(%remote, reason = "auth_failed", error = %e, "quic: incoming handshake failed");
            return;
        }
    };
    let peer = match tls::peer_fingerprint(&conn).and_then(|fp| shared.known.lookup(&fp)) {
        Some(p) => p,
        None => {
            tracing::warn!(%remote, reason = "auth_failed", "quic: refused a connection whose certificate belongs to no known peer");
            conn.close(app_code(ReasonCode::AUTH_FAILED), b"certificate of no known peer");
            return;
        }
    };
    let timeout = Duration::from_millis(shared.config.connect_timeout_ms);
    if let Err(why) = tokio::time::timeout(timeout, answer_hello(&shared, &conn)).await.unwrap_or_else(|_| {
        Err((ReasonCode::PEER_UNREACHABLE, format!("no HELLO within connect_timeout_ms ({})", shared.config.connect_timeout_ms)))
    }) {
        tracing::warn!(peer = peer.0, %remote, reason = %why.0, message = %why.1, "quic: refused an incoming connection");
        conn.close(app_code(why.0), why.1.as_bytes());
        return;
    }
    match shared.peer(peer) {
        Some(entry) if !entry.is_removed() => entry.add_incoming(conn.clone()),
        _ => {
            conn.close(app_code(ReasonCode::AUTH_FAILED), b"peer forgotten");
            return;
        }
    }
    loop {
        match conn.accept_bi().await {
            Ok((send, recv)) => {
                let (shared, conn) = (shared.clone(), conn.clone());
                tokio::spawn(async move { serve_lane(shared, conn, peer, send, recv).await });
            }
            Err(e) => {
                tracing::debug!(peer = peer.0, error = %e, "quic: incoming connection ended");
                return;
            }
        }
    }
}

/// Read the client's HELLO and accept it, or say why not.
async fn answer_hello(shared: &Shared, conn: &quinn::Connection) -> Result<(), (ReasonCode, String)> {
    let (mut send, recv) = conn.accept_bi().await.map_err(|e| (ReasonCode::PEER_LOST, format!("no control stream: {e}")))?;
    let mut reader = FrameReader::new(recv);
    let frame = reader.read_frame().await.map_err(|e| (ReasonCode::PROTOCOL_VIOLATION, format!("bad HELLO: {e:?}")))?;
    let Some(Frame::Hello { magic, version, .. }) = frame else {
        return Err((ReasonCode::PROTOCOL_VIOLATION, format!("expected HELLO, got {frame:?}")));
    };
    if magic != HELLO_MAGIC {
        return Err((ReasonCode::PROTOCOL_VIOLATION, format!("HELLO magic {magic:#x} is not kvgate-quic's")));
    }
    if version != shared.wire_version {
        return Err((
            ReasonCode::VERSION_MISMATCH,
            format!("kvgate-quic wire version mismatch: the client speaks {version}, this side {}", shared.wire_version),
        ));
    }
    let reply = Frame::HelloReply { version: shared.wire_version, status: 0, instance: shared.instance };
    send.write_all(&reply.to_bytes()).await.map_err(|e| (ReasonCode::PEER_LOST, format!("sending HELLO_REPLY: {e}")))?;
    let _ = send.finish();
    Ok(())
}

async fn serve_lane(shared: Arc<Shared>, conn: quinn::Connection, peer: PeerId, mut send: quinn::SendStream, recv: quinn::RecvStream) {
    let mut reader = FrameReader::new(recv);
    let ctx = LaneContext {
        peer,
        tickets: &shared.tickets,
        regions: &shared.regions,
        max_segments: shared.config.max_segments_per_submit,
    };
    let (id, outcome) = receive_lane(&mut reader, &ctx).await;
    // An incoming failure is reported only for a ticket the host still holds: a cancelled or expired
    // ticket already ended on the host's side.
    let report = |reason: ReasonCode, message: &str| {
        if let Some(id) = id {
            if shared.tickets.lookup(peer, id.ticket).is_some() {
                shared.sink.deliver(Event::incoming_failed(peer, id.ticket, reason, message.to_string()));
            }
        }
    };
    match outcome {
        LaneOutcome::Done { bytes } => {
            let _ = send.write_all(&Frame::LaneDone { bytes }.to_bytes()).await;
            let _ = send.finish();
            // The sender finishes the stream right after LANE_END: wait for that end rather than
            // stop the stream (one STOP_SENDING frame per lane saved). Bytes after LANE_END break
            // the protocol; a reset or a lost connection here changes nothing (every byte is in place).
            if let Ok(false) = reader.expect_end().await {
                let why = "bytes after LANE_END";
                tracing::warn!(peer = peer.0, reason = "protocol_violation", message = why, "quic: closing a connection that broke the protocol");
                conn.close(app_code(ReasonCode::PROTOCOL_VIOLATION), why.as_bytes());
            }
        }
        LaneOutcome::Cancelled { bytes } => {
            let _ = send.write_all(&Frame::CancelAck { bytes }.to_bytes()).await;
            let _ = send.finish();
        }
        LaneOutcome::Refused(refusal) => {
            tracing::warn!(
                peer = peer.0,
                xfer = id.map(|i| i.xfer),
                ticket = id.map(|i| i.ticket.0),
                reason = %refusal.reason,
                message = %refusal.message,
                "quic: refused an incoming lane"
            );
            report(refusal.reason, &refusal.message);
            let frame = Frame::LaneRefused { reason: refusal.reason.0, message: refusal.message };
            let _ = send.write_all(&frame.to_bytes()).await;
            let _ = send.finish();
            let _ = reader.into_source().stop(app_code(ReasonCode::NOT_EXPECTED));
        }
        LaneOutcome::Violation(why) => {
            tracing::warn!(peer = peer.0, reason = "protocol_violation", message = %why, "quic: closing a connection that broke the protocol");
            report(ReasonCode::PROTOCOL_VIOLATION, &why);
            conn.close(app_code(ReasonCode::PROTOCOL_VIOLATION), why.as_bytes());
        }
        LaneOutcome::Lost(why) => {
            tracing::warn!(peer = peer.0, reason = "peer_lost", message = %why, "quic: incoming lane broke");
            report(ReasonCode::PEER_LOST, &why);
        }
    }
}
