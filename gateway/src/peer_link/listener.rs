//! The peer-link listener's two protocols on one port: each accepted connection's first bytes say
//! whether it is a framed link (`framed.rs`), served here, or anything else (HTTP/2, TLS), handed to
//! the gRPC server. With `peer_link.auth = "tls"` every connection goes to the gRPC server (framed
//! links have no TLS yet). A connection that sends nothing within `connect_timeout_ms` is closed and
//! counted (`kvgate_listener_refused_total{listener="peer_link",reason="handshake_timeout"}`).

use super::framed::{self, Speaks};
use super::{writer, PeerLinkService};
use crate::config::{GatewayConfig, PeerAuthMode, PeerTransport};
use crate::listeners::{Guarded, GuardedListener};
use kvgate_client::proto::{self, peer_frame::Frame, PeerFrame};
use std::io;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch};

/// Connections accepted but not yet taken by the gRPC server.
const GRPC_HANDOVER_QUEUE: usize = 64;

/// Starts routing `listener`'s connections; returns the stream of those for the gRPC server. Stops
/// accepting once `stop` turns true.
pub fn route(
    listener: GuardedListener<tokio::net::TcpListener>,
    service: Arc<PeerLinkService>,
    config: Arc<GatewayConfig>,
    mut stop: watch::Receiver<bool>,
) -> std::pin::Pin<Box<dyn tokio_stream::Stream<Item = io::Result<Guarded<TcpStream>>> + Send>> {
    if config.peer_link.auth_mode() == PeerAuthMode::Tls {
        return Box::pin(listener.into_stream());
    }
    let (grpc, grpc_rx) = mpsc::channel(GRPC_HANDOVER_QUEUE);
    tokio::spawn(async move {
        let mut listener = listener;
        loop {
            let conn = tokio::select! {
                (conn, _) = listener.next() => conn,
                _ = stop.wait_for(|s| *s) => return,
            };
            let (grpc, service, config) = (grpc.clone(), service.clone(), config.clone());
            tokio::spawn(async move {
                let wait = Duration::from_millis(config.peer_link.connect_timeout_ms);
                let stream = conn.get_ref();
                let peek = move |mut buf: Vec<u8>| async move {
                    let n = stream.peek(&mut buf).await?;
                    Ok((n, buf))
                };
                match framed::sniff(peek, wait).await {
                    Ok(Speaks::Framed) => serve_framed(conn, &service, &config).await,
                    Ok(Speaks::Other) => {
                        let _ = grpc.send(Ok(conn)).await;
                    }
                    // Counted and logged as the listener's own refusals are.
                    Err(e) if e.kind() == io::ErrorKind::TimedOut => conn.refuse(
                        "handshake_timeout",
                        &format_args!("{e} (peer_link.connect_timeout_ms = {} ms)", wait.as_millis()),
                    ),
                    Err(e) => tracing::debug!("peer-link connection closed before it said what it speaks: {e}"),
                }
            });
        }
    });
    Box::pin(tokio_stream::wrappers::ReceiverStream::new(grpc_rx))
}

/// A framed link: takes its magic, echoes it, then runs the same handshake as a gRPC link; a refusal
/// is sent as a `Refused` frame before the connection closes.
async fn serve_framed(mut conn: Guarded<TcpStream>, service: &PeerLinkService, config: &GatewayConfig) {
    let mut magic = [0u8; framed::MAGIC.len()];
    if conn.read_exact(&mut magic).await.is_err() || conn.write_all(framed::MAGIC).await.is_err() {
        return;
    }
    // The socket's own descriptor goes with the inbound side: once the link is live, the driver's
    // thread reads it (`intake.rs`).
    let socket = match conn.get_ref().as_fd().try_clone_to_owned() {
        Ok(socket) => socket,
        Err(e) => {
            // Out of descriptors, as a failed accept is: counted and logged (paced) as one.
            conn.refuse("accept_error", &format_args!("duplicate a framed peer link's socket: {e}"));
            return;
        }
    };
    let sealer = writer::SharedSealer::default();
    let direct = match writer::LinkWriter::new(conn.get_ref().as_fd(), sealer, config.peer_link.frame_fragment_bytes) {
        Ok(direct) => direct,
        Err(e) => {
            conn.refuse("accept_error", &format_args!("duplicate a framed peer link's socket: {e}"));
            return;
        }
    };
    // The connection itself is only read (the handshake, then `intake.rs` takes over its socket), so
    // once the handshake is read it leaves this runtime's reactor: registered here for reading, every
    // frame would wake a worker beside the driver's thread. The writer task keeps its place under
    // the cap for as long as it writes.
    let hold = conn.hold();
    let inbound = framed::socket_inbound(conn, socket, super::max_decoding_bytes(config));
    match service.accept(inbound, None, PeerTransport::Framed, Some(direct.clone())).await {
        Ok((lanes, _sealer)) => writer::spawn(direct, lanes, hold),
        Err(refusal) => {
            if !refusal.logged {
                tracing::info!(reason = refusal.reason, "refused a framed peer link: {}", refusal.message);
            }
            let refused = proto::LinkRefused { reason: refusal.reason.to_string(), message: refusal.message };
            writer::last_frame(direct, PeerFrame { frame: Some(Frame::Refused(refused)), mac: Vec::new() }, hold);
        }
    }
}
