//! The `PeerLink` gRPC service: accepts links dialled by peers whose name sorts before ours, checks
//! their Hello and their authentication (`psk`: the challenge-response, `tls`: that their certificate
//! names the peer the Hello claims to be), and only then hands the session to that peer's task. Never
//! accepts an unknown peer (neither in `[[peers]]` nor discovered, or withdrawn from discovery), and
//! logs every refusal with its reason.

use super::handshaken::Session;
use super::{lanes, psk, sealed_stream, LinkAuth, LocalIdentity, PeerDirectory};
use crate::config::GatewayConfig;
use kvgate_client::proto::{peer_frame::Frame, peer_link_server::PeerLink, PeerFrame};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tonic::{Request, Response, Status, Streaming};

pub struct PeerLinkService {
    identity: Arc<LocalIdentity>,
    config: Arc<GatewayConfig>,
    directory: Arc<PeerDirectory>,
    auth: LinkAuth,
}

impl PeerLinkService {
    pub(super) fn new(
        identity: Arc<LocalIdentity>,
        config: Arc<GatewayConfig>,
        directory: Arc<PeerDirectory>,
        auth: LinkAuth,
    ) -> Self {
        PeerLinkService { identity, config, directory, auth }
    }
}

type FrameStream = Pin<Box<dyn tokio_stream::Stream<Item = Result<PeerFrame, Status>> + Send>>;

fn refuse(peer: &str, reason: &str, why: String) -> Status {
    tracing::warn!(peer = %peer, reason, "refused a peer link: {why}");
    Status::permission_denied(format!("{reason}: {why}"))
}

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
            return Err(Status::invalid_argument(format!(
                "protocol_violation: hello addressed to {:?}, this is {:?}",
                hello.to, self.identity.name
            )));
        }
        if hello.protocol_version != super::PEER_PROTOCOL_VERSION {
            return Err(Status::failed_precondition(format!(
                "version_mismatch: peer-link protocol {} (this gateway speaks {})",
                hello.protocol_version,
                super::PEER_PROTOCOL_VERSION
            )));
        }
        let dialler_is_peer = super::dials(&hello.name, &self.identity.name);
        let known =
            self.directory.entry(&hello.name).zip(self.directory.incoming(&hello.name)).filter(|_| dialler_is_peer);
        let Some((entry, session_tx)) = known else {
            return Err(refuse(
                &hello.name,
                "unknown_peer",
                format!("{:?} is not a configured or discovered peer that dials this gateway", hello.name),
            ));
        };
        let (tx, rx) = lanes::channels(self.config.peer_link.send_queue_frames as usize);
        let sealer = Arc::new(Mutex::new(None));
        match &self.auth {
            LinkAuth::Tls(_) => {
                let expected = super::tls_name(&entry);
                let leaf = client_certs.as_ref().and_then(|certs| certs.first().cloned());
                if let Err(why) = super::tls::check_certificate_name(leaf.as_ref(), &expected) {
                    tracing::warn!(peer = %hello.name, expected_name = %expected, reason = "peer_identity_mismatch", "refused a peer link: {why}");
                    return Err(Status::permission_denied(format!(
                        "peer_identity_mismatch: the certificate of {:?} is not valid for {expected:?} (peers.tls_name): {why}",
                        hello.name
                    )));
                }
                tx.bulk
                    .send(self.identity.hello_to(&hello.name, self.auth.mode(), Vec::new(), Vec::new()))
                    .await
                    .map_err(|_| Status::internal("link closed"))?;
                session_tx
                    .send(Session { hello, inbound, outbound: tx, opener: None })
                    .await
                    .map_err(|_| Status::unavailable("gateway stopping"))?;
            }
            LinkAuth::None => {
                tx.bulk
                    .send(self.identity.hello_to(&hello.name, self.auth.mode(), Vec::new(), Vec::new()))
                    .await
                    .map_err(|_| Status::internal("link closed"))?;
                session_tx
                    .send(Session { hello, inbound, outbound: tx, opener: None })
                    .await
                    .map_err(|_| Status::unavailable("gateway stopping"))?;
            }
            LinkAuth::Psk(key) => {
                if hello.nonce.len() != psk::NONCE_BYTES {
                    return Err(refuse(
                        &hello.name,
                        "peer_auth_failed",
                        format!(
                            "{:?} sent no challenge (its peer_link.auth is {:?}; this gateway's is \"psk\")",
                            hello.name, hello.auth
                        ),
                    ));
                }
                let nonce = psk::nonce();
                let transcript = psk::Transcript {
                    dialler: &hello.name,
                    server: &self.identity.name,
                    dialler_nonce: &hello.nonce,
                    server_nonce: &nonce,
                    dialler_incarnation: hello.incarnation,
                    server_incarnation: self.identity.incarnation,
                };
                let proof = key.server_proof(&transcript);
                let (link_sealer, mut opener) = key.link_macs(&transcript, false);
                let expected_answer = key.dialler_proof(&transcript);
                *sealer.lock().unwrap_or_else(|e| e.into_inner()) = Some(link_sealer);
                tx.bulk
                    .send(self.identity.hello_to(&hello.name, self.auth.mode(), nonce, proof))
                    .await
                    .map_err(|_| Status::internal("link closed"))?;
                // The dialler answers only once it holds our Hello, which goes out with the response:
                // its proof is awaited in a task, and the link is handed on only when it checks out.
                tokio::spawn(async move {
                    let name = hello.name.clone();
                    let answer = match tokio::time::timeout(timeout, inbound.message()).await {
                        Ok(Ok(Some(frame))) => {
                            opener.open(frame).map_err(|e| format!("its answer failed the link MAC: {e}"))
                        }
                        Ok(Ok(None)) => Err("it closed the link before answering the challenge".to_string()),
                        Ok(Err(status)) => Err(format!("link error before its answer: {}", status.message())),
                        Err(_) => Err("no answer to the challenge within peer_link.connect_timeout_ms".to_string()),
                    };
                    let proven = answer.and_then(|frame| match frame.frame {
                        Some(Frame::AuthProof(p)) if psk::constant_time_eq(&p.proof, &expected_answer) => Ok(()),
                        Some(Frame::AuthProof(_)) => {
                            Err("its proof is wrong (a different peer_link.psk_file?)".to_string())
                        }
                        _ => Err("its first frame after the Hello is not an AuthProof".to_string()),
                    });
                    match proven {
                        Ok(()) => {
                            let _ =
                                session_tx.send(Session { hello, inbound, outbound: tx, opener: Some(opener) }).await;
                        }
                        // Dropping the outbound queue ends the response stream: the dialler sees the link close.
                        Err(why) => drop(refuse(&name, "peer_auth_failed", why)),
                    }
                });
            }
        }
        let outbound = sealed_stream(rx, sealer, &self.config);
        Ok(Response::new(Box::pin(tokio_stream::StreamExt::map(outbound, Ok))))
    }
}
