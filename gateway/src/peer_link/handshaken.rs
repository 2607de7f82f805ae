//! A link once its handshake (and authentication) is done: what the dialler and the server hand the
//! peer's link task. Plain data, the same whichever transport carries the link.

use crate::channels::Outbound;
use crate::config::PeerTransport;
use kvgate_client::proto::{self, PeerFrame};
use std::pin::Pin;

/// A link's inbound frames, in order; an error or the end is the link's loss.
pub enum Inbound {
    /// tonic's stream of a gRPC link, read by the link's session task.
    Grpc(Pin<Box<dyn tokio_stream::Stream<Item = Result<PeerFrame, InboundError>> + Send>>),
    /// A framed link: read here through the handshake; once live, its socket is read on the driver's
    /// thread (`session.rs`).
    Framed(super::framed::FramedInbound),
}

impl Inbound {
    /// The next frame; `None` at the end. Cancel-safe: a frame half read when a `next()` is dropped
    /// is read on by the next one.
    pub async fn next(&mut self) -> Option<Result<PeerFrame, InboundError>> {
        match self {
            Inbound::Grpc(stream) => tokio_stream::StreamExt::next(stream).await,
            Inbound::Framed(framed) => framed.next().await,
        }
    }
}

/// Why a link's inbound frames stopped: the peer broke the protocol (reason `protocol_violation`), or
/// the connection failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InboundError {
    ProtocolViolation(String),
    Broken(String),
}

impl std::fmt::Display for InboundError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            InboundError::ProtocolViolation(why) => write!(f, "protocol_violation: {why}"),
            InboundError::Broken(why) => f.write_str(why),
        }
    }
}

/// A handshaken (and authenticated) link: the peer's hello, its inbound frames, our outbound queue
/// and, with `peer_link.auth = "psk"`, the check of every inbound frame's MAC.
pub struct Session {
    pub hello: proto::Hello,
    pub inbound: Inbound,
    pub outbound: Outbound,
    pub opener: Option<super::psk::FrameOpener>,
    /// What carries it (for the log and the metrics).
    pub transport: PeerTransport,
}

/// A gRPC stream as a link's inbound frames.
pub fn grpc_inbound(stream: tonic::Streaming<PeerFrame>) -> Inbound {
    Inbound::Grpc(Box::pin(tokio_stream::StreamExt::map(stream, |item| {
        item.map_err(|status| InboundError::Broken(status.message().to_string()))
    })))
}
