//! Accepting a dialled link, whatever carries it (`accept`: a framed connection from `listener.rs`,
//! or the `PeerLink` gRPC service's stream): checks links dialled by peers whose name sorts before
//! ours, their Hello and their authentication (`psk`: the challenge-response, `tls`: that their
//! certificate names the peer the Hello claims to be), and only then hands the session to that peer's
//! task. Never accepts an unknown peer (neither in `[[peers]]` nor discovered, or withdrawn from
//! discovery); every refusal carries a reason code.

use super::handshaken::{Inbound, InboundError, Session};
use super::lanes::OutboundReceivers;
use super::writer::{LinkWriter, SharedSealer};
use super::{lanes, psk, sealed_stream, LinkAuth, LocalIdentity, PeerDirectory};
use crate::config::{GatewayConfig, PeerTransport};
use kvgate_client::proto::{peer_frame::Frame, peer_link_server::PeerLink, PeerFrame};
use std::pin::Pin;
use std::sync::Arc;
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

/// Why a link was refused: a reason code, the text for the dialler and its gRPC status code.
#[derive(Debug)]
pub struct Refusal {
    pub reason: &'static str,
    pub message: String,
    code: tonic::Code,
    /// Already logged where it was decided.
    pub logged: bool,
}

impl Refusal {
    fn new(code: tonic::Code, reason: &'static str, message: String) -> Refusal {
        Refusal { reason, message, code, logged: false }
    }

    /// A refusal worth a warning (logged once, where it is decided).
    fn logged(peer: &str, reason: &'static str, why: String) -> Refusal {
        tracing::warn!(peer = %peer, reason, "refused a peer link: {why}");
        Refusal { logged: true, ..Refusal::new(tonic::Code::PermissionDenied, reason, why) }
    }

    pub fn status(&self) -> Status {
        Status::new(self.code, format!("{}: {}", self.reason, self.message))
    }
}

#[tonic::async_trait]
impl PeerLink for PeerLinkService {
    type LinkStream = FrameStream;

    async fn link(&self, request: Request<Streaming<PeerFrame>>) -> Result<Response<FrameStream>, Status> {
        let client_certs = request.peer_certs();
        let leaf = client_certs.as_ref().and_then(|certs| certs.first().cloned());
        let inbound = super::handshaken::grpc_inbound(request.into_inner());
        let (lanes, sealer) = self.accept(inbound, leaf, PeerTransport::Grpc, None).await.map_err(|r| r.status())?;
        let outbound = sealed_stream(lanes, sealer, &self.config);
        Ok(Response::new(Box::pin(tokio_stream::StreamExt::map(outbound, Ok))))
    }
}

impl PeerLinkService {
    /// Takes a dialled link whatever carries it: checks its Hello and authentication, answers with
    /// our Hello, and hands the session to the peer's task once it is proven. Returns the link's
    /// outbound lanes and the sealer the handshake set (for the transport to send through), or why it
    /// was refused. `leaf` is the dialler's TLS certificate, if any; `direct` a framed link's writer.
    pub async fn accept(
        &self,
        mut inbound: Inbound,
        leaf: Option<tonic::transport::CertificateDer<'static>>,
        transport: PeerTransport,
        direct: Option<Arc<LinkWriter>>,
    ) -> Result<(OutboundReceivers, SharedSealer), Refusal> {
        use tonic::Code;
        let timeout = Duration::from_millis(self.config.peer_link.connect_timeout_ms);
        let first = match tokio::time::timeout(timeout, inbound.next()).await {
            Err(_) => {
                return Err(Refusal::new(
                    Code::DeadlineExceeded,
                    "protocol_violation",
                    "no hello within peer_link.connect_timeout_ms".into(),
                ))
            }
            Ok(Some(Err(InboundError::ProtocolViolation(why)))) => {
                return Err(Refusal::new(Code::InvalidArgument, "protocol_violation", why))
            }
            Ok(Some(Err(InboundError::Broken(why)))) => {
                return Err(Refusal::new(Code::Unavailable, "link_closed", why))
            }
            Ok(None) => return Err(Refusal::new(Code::Unavailable, "link_closed", "closed before its hello".into())),
            Ok(Some(Ok(frame))) => frame,
        };
        let Some(Frame::Hello(hello)) = first.frame else {
            return Err(Refusal::new(Code::InvalidArgument, "protocol_violation", "a link starts with a hello".into()));
        };
        if hello.to != self.identity.name {
            return Err(Refusal::new(
                Code::InvalidArgument,
                "protocol_violation",
                format!("hello addressed to {:?}, this is {:?}", hello.to, self.identity.name),
            ));
        }
        if hello.protocol_version != super::PEER_PROTOCOL_VERSION {
            return Err(Refusal::new(
                Code::FailedPrecondition,
                "version_mismatch",
                format!(
                    "peer-link protocol {} (this gateway speaks {})",
                    hello.protocol_version,
                    super::PEER_PROTOCOL_VERSION
                ),
            ));
        }
        let dialler_is_peer = super::dials(&hello.name, &self.identity.name);
        let known =
            self.directory.entry(&hello.name).zip(self.directory.incoming(&hello.name)).filter(|_| dialler_is_peer);
        let Some((entry, session_tx)) = known else {
            return Err(Refusal::logged(
                &hello.name,
                "unknown_peer",
                format!("{:?} is not a configured or discovered peer that dials this gateway", hello.name),
            ));
        };
        let sealer = direct.as_ref().map(|w| w.sealer().clone()).unwrap_or_default();
        let (tx, rx) = lanes::channels_with(self.config.peer_link.send_queue_frames as usize, direct);
        match &self.auth {
            LinkAuth::Tls(_) => {
                let expected = super::tls_name(&entry);
                if let Err(why) = super::tls::check_certificate_name(leaf.as_ref(), &expected) {
                    tracing::warn!(peer = %hello.name, expected_name = %expected, reason = "peer_identity_mismatch", "refused a peer link: {why}");
                    return Err(Refusal {
                        logged: true,
                        ..Refusal::new(
                            Code::PermissionDenied,
                            "peer_identity_mismatch",
                            format!(
                                "the certificate of {:?} is not valid for {expected:?} (peers.tls_name): {why}",
                                hello.name
                            ),
                        )
                    });
                }
                tx.queue_bulk(self.identity.hello_to(&hello.name, self.auth.mode(), Vec::new(), Vec::new()))
                    .await
                    .map_err(|_| Refusal::new(Code::Internal, "link_closed", "link closed".into()))?;
                session_tx
                    .send(Session { hello, inbound, outbound: tx, opener: None, transport })
                    .await
                    .map_err(|_| Refusal::new(Code::Unavailable, "shutdown", "gateway stopping".into()))?;
            }
            LinkAuth::None => {
                tx.queue_bulk(self.identity.hello_to(&hello.name, self.auth.mode(), Vec::new(), Vec::new()))
                    .await
                    .map_err(|_| Refusal::new(Code::Internal, "link_closed", "link closed".into()))?;
                session_tx
                    .send(Session { hello, inbound, outbound: tx, opener: None, transport })
                    .await
                    .map_err(|_| Refusal::new(Code::Unavailable, "shutdown", "gateway stopping".into()))?;
            }
            LinkAuth::Psk(key) => {
                if hello.nonce.len() != psk::NONCE_BYTES {
                    return Err(Refusal::logged(
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
                tx.queue_bulk(self.identity.hello_to(&hello.name, self.auth.mode(), nonce, proof))
                    .await
                    .map_err(|_| Refusal::new(Code::Internal, "link_closed", "link closed".into()))?;
                // The dialler answers only once it holds our Hello, which goes out with the response:
                // its proof is awaited in a task, and the link is handed on only when it checks out.
                tokio::spawn(async move {
                    let name = hello.name.clone();
                    let answer = match tokio::time::timeout(timeout, inbound.next()).await {
                        Ok(Some(Ok(frame))) => {
                            opener.open(frame).map_err(|e| format!("its answer failed the link MAC: {e}"))
                        }
                        Ok(None) => Err("it closed the link before answering the challenge".to_string()),
                        Ok(Some(Err(why))) => Err(format!("link error before its answer: {why}")),
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
                            let session = Session { hello, inbound, outbound: tx, opener: Some(opener), transport };
                            let _ = session_tx.send(session).await;
                        }
                        // Dropping the outbound queue ends the response stream: the dialler sees the link close.
                        Err(why) => drop(Refusal::logged(&name, "peer_auth_failed", why)),
                    }
                });
            }
        }
        Ok((rx, sealer))
    }
}
