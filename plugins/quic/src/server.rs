//! The accepting side of every endpoint: refuse unknown certificates and other wire versions, then
//! serve each lane stream a peer opens (the checks themselves live in `incoming`). Never writes into
//! memory except through `incoming::serve_lane`.

use crate::incoming::{serve_lane as serve_lane_frames, LaneContext, LaneEnd, PartId};
use crate::net::app_code;
use crate::reader::FrameReader;
use crate::replies::ReceivingLane;
use crate::shared::Shared;
use crate::tickets::Refusal;
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
        Err((
            ReasonCode::PEER_UNREACHABLE,
            format!("no HELLO within connect_timeout_ms ({})", shared.config.connect_timeout_ms),
        ))
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
    let (mut send, recv) =
        conn.accept_bi().await.map_err(|e| (ReasonCode::PEER_LOST, format!("no control stream: {e}")))?;
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
            format!(
                "kvgate-quic wire version mismatch: the client speaks {version}, this side {}",
                shared.wire_version
            ),
        ));
    }
    let reply = Frame::HelloReply { version: shared.wire_version, status: 0, instance: shared.instance };
    send.write_all(&reply.to_bytes())
        .await
        .map_err(|e| (ReasonCode::PEER_LOST, format!("sending HELLO_REPLY: {e}")))?;
    let _ = send.finish();
    Ok(())
}

async fn serve_lane(
    shared: Arc<Shared>,
    conn: quinn::Connection,
    peer: PeerId,
    send: quinn::SendStream,
    recv: quinn::RecvStream,
) {
    let mut reader = FrameReader::new(ReceivingLane::new(send, recv));
    let ctx = LaneContext { peer, tickets: &shared.tickets, regions: &shared.regions };
    // An incoming failure is reported only for a ticket the host still holds: a cancelled or expired
    // ticket already ended on the host's side.
    let report = |part: PartId, reason: ReasonCode, message: &str| {
        if shared.tickets.lookup(peer, part.ticket).is_some() {
            shared.sink.deliver(Event::incoming_failed(peer, part.ticket, reason, message.to_string()));
        }
    };
    let mut on_refused = |part: PartId, refusal: &Refusal| {
        tracing::warn!(
            peer = peer.0,
            xfer = part.xfer,
            ticket = part.ticket.0,
            reason = %refusal.reason,
            message = %refusal.message,
            "quic: refused an incoming part"
        );
        report(part, refusal.reason, &refusal.message);
    };
    let (end, in_part) = serve_lane_frames(&mut reader, &ctx, &mut on_refused).await;
    match end {
        LaneEnd::Closed | LaneEnd::Reset(_) => reader.source_mut().finish().await,
        LaneEnd::Violation(why) => {
            tracing::warn!(peer = peer.0, reason = "protocol_violation", message = %why, "quic: closing a connection that broke the protocol");
            if let Some(part) = in_part {
                report(part, ReasonCode::PROTOCOL_VIOLATION, &why);
            }
            conn.close(app_code(ReasonCode::PROTOCOL_VIOLATION), why.as_bytes());
        }
        LaneEnd::Lost(why) => match in_part {
            Some(part) => {
                tracing::warn!(peer = peer.0, xfer = part.xfer, reason = "peer_lost", message = %why, "quic: incoming lane broke inside a part");
                report(part, ReasonCode::PEER_LOST, &why);
            }
            None => tracing::debug!(peer = peer.0, message = %why, "quic: incoming lane ended with its connection"),
        },
    }
}
