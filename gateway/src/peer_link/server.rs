//! The `PeerLink` gRPC service: accepts links dialled by peers whose name sorts before ours, checks
//! their Hello (and, with TLS, that their certificate names the peer the Hello claims to be), and
//! hands the session to that peer's task. Never accepts an unknown peer (neither in `[[peers]]` nor
//! discovered, or withdrawn from discovery).

use super::session::Session;
use super::{LocalIdentity, PeerDirectory};
use crate::config::GatewayConfig;
use kvgate_client::proto::{peer_frame::Frame, peer_link_server::PeerLink, PeerFrame};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

pub struct PeerLinkService {
    identity: Arc<LocalIdentity>,
    config: Arc<GatewayConfig>,
    directory: Arc<PeerDirectory>,
}

impl PeerLinkService {
    pub(super) fn new(identity: Arc<LocalIdentity>, config: Arc<GatewayConfig>, directory: Arc<PeerDirectory>) -> Self {
        PeerLinkService { identity, config, directory }
    }
}

type FrameStream = Pin<Box<dyn tokio_stream::Stream<Item = Result<PeerFrame, Status>> + Send>>;

#[tonic::async_trait]
impl PeerLink for PeerLinkService {
    type LinkStream = FrameStream;

    async fn link(&self, request: Request<Streaming<PeerFrame>>) -> Result<Response<FrameStream>, Status> {
        let client_certs = request.peer_certs();
        let mut inbound = request.into_inner();
        let timeout = Duration::from_millis(self.config.peer_link.connect_timeout_ms);
        let first = tokio::time::timeout(timeout, inbound.message())
            .await
            .map_err(|_| Status::deadline_exceeded("no hello within peer_link.connect_timeout_ms"))??;
        let Some(Frame::Hello(hello)) = first.and_then(|f| f.frame) else {
            return Err(Status::invalid_argument("protocol_violation: a link starts with a hello"));
        };
        if hello.to != self.identity.name {
            return Err(Status::invalid_argument(format!("protocol_violation: hello addressed to {:?}, this is {:?}", hello.to, self.identity.name)));
        }
        if hello.protocol_version != super::PEER_PROTOCOL_VERSION {
            return Err(Status::failed_precondition(format!("version_mismatch: peer-link protocol {} (this gateway speaks {})", hello.protocol_version, super::PEER_PROTOCOL_VERSION)));
        }
        let dialler_is_peer = super::dials(&hello.name, &self.identity.name);
        let known = self.directory.entry(&hello.name).zip(self.directory.incoming(&hello.name)).filter(|_| dialler_is_peer);
        let Some((entry, session_tx)) = known else {
            tracing::warn!(peer = %hello.name, "refused a peer link from an unknown or dialling peer (unknown_peer)");
            return Err(Status::permission_denied(format!("unknown_peer: {:?} is not a configured or discovered peer that dials this gateway", hello.name)));
        };
        if self.config.peer_link.tls.is_some() {
            let expected = super::tls_name(&entry);
            let leaf = client_certs.as_ref().and_then(|certs| certs.first().cloned());
            if let Err(why) = super::tls::check_certificate_name(leaf.as_ref(), &expected) {
                tracing::warn!(peer = %hello.name, expected_name = %expected, "refused a peer link (peer_identity_mismatch): {why}");
                return Err(Status::permission_denied(format!(
                    "peer_identity_mismatch: the certificate of {:?} is not valid for {expected:?} (peers.tls_name): {why}",
                    hello.name
                )));
            }
        }
        let (tx, rx) = mpsc::channel(self.config.peer_link.send_queue_frames as usize);
        tx.send(self.identity.hello_to(&hello.name)).await.map_err(|_| Status::internal("link closed"))?;
        session_tx.send(Session { hello, inbound, outbound: tx }).await.map_err(|_| Status::unavailable("gateway stopping"))?;
        let outbound = ReceiverStream::new(rx);
        Ok(Response::new(Box::pin(tokio_stream::StreamExt::map(outbound, Ok))))
    }
}
