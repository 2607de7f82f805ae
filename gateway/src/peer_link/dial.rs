//! Dialling a peer: connect (framed, or gRPC with TLS when `peer_link.auth = "tls"`), exchange
//! Hellos (and, with `psk`, check the server's proof and answer its challenge), all within
//! `connect_timeout_ms`. A framed dial to a gateway that does not take framed links falls back to
//! gRPC. Never retries by itself (the peer task paces retries).

use super::handshaken::{grpc_inbound, Inbound, Session};
use super::{framed, lanes, psk, sealed_stream, writer, LinkAuth, LocalIdentity};
use crate::channels::Outbound;
use crate::config::{GatewayConfig, PeerEntry, PeerTransport};
use anyhow::{bail, Context};
use kvgate_client::proto::{self, peer_frame::Frame, peer_link_client::PeerLinkClient, PeerFrame};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tonic::transport::Endpoint;

pub(super) async fn dial(
    config: &GatewayConfig,
    peer: &PeerEntry,
    identity: &LocalIdentity,
    auth: &LinkAuth,
) -> anyhow::Result<Session> {
    let timeout = Duration::from_millis(config.peer_link.connect_timeout_ms);
    tokio::time::timeout(timeout, dial_inner(config, peer, identity, auth)).await.with_context(|| {
        format!("dial {} timed out after {} ms (peer_link.connect_timeout_ms)", peer.address, timeout.as_millis())
    })?
}

async fn dial_inner(
    config: &GatewayConfig,
    peer: &PeerEntry,
    identity: &LocalIdentity,
    auth: &LinkAuth,
) -> anyhow::Result<Session> {
    if config.peer_link.transport_mode() == PeerTransport::Framed {
        match dial_framed(peer).await? {
            Some(stream) => {
                let sealer = writer::SharedSealer::default();
                let writer = writer::LinkWriter::new(stream.as_fd(), sealer, config.peer_link.frame_fragment_bytes)
                    .context("duplicate the link's socket")?;
                let link = Link::new(config, peer, identity, auth, Some(writer));
                return link.open_framed(config, stream)?.handshake(peer, identity, auth).await;
            }
            None => tracing::debug!(
                peer = %peer.name,
                "{} does not take framed links (an older kvgate?): dialling gRPC",
                peer.address
            ),
        }
    }
    let link = Link::new(config, peer, identity, auth, None);
    link.open_grpc(config, peer, auth).await?.handshake(peer, identity, auth).await
}

/// TCP, our magic, the peer's echo (`framed.rs`). `None` when the peer answered something else or
/// closed: it does not take framed links.
async fn dial_framed(peer: &PeerEntry) -> anyhow::Result<Option<tokio::net::TcpStream>> {
    let mut stream =
        tokio::net::TcpStream::connect(&peer.address).await.with_context(|| format!("connect to {}", peer.address))?;
    // A socket that cannot take the option still works, only with Nagle on.
    let _ = stream.set_nodelay(true);
    stream.write_all(framed::MAGIC).await.with_context(|| format!("write to {}", peer.address))?;
    let framed = framed::read_magic(&mut stream).await.with_context(|| format!("read from {}", peer.address))?;
    Ok(framed.then_some(stream))
}

/// A link being dialled: our Hello already queued on its outbound lanes (with a challenge under
/// `psk`), and the sealer the outbound side applies once the handshake sets it.
struct Link {
    lanes: Outbound,
    receivers: lanes::OutboundReceivers,
    sealer: writer::SharedSealer,
    nonce: Vec<u8>,
}

/// A link whose connection is open: `Link`'s lanes plus its inbound frames.
struct OpenLink {
    lanes: Outbound,
    inbound: Inbound,
    sealer: writer::SharedSealer,
    nonce: Vec<u8>,
    transport: PeerTransport,
}

impl Link {
    /// `direct`: a framed link's writer (its sealer is the link's).
    fn new(
        config: &GatewayConfig,
        peer: &PeerEntry,
        identity: &LocalIdentity,
        auth: &LinkAuth,
        direct: Option<Arc<writer::LinkWriter>>,
    ) -> Link {
        let sealer = direct.as_ref().map(|w| w.sealer().clone()).unwrap_or_default();
        let (lanes, receivers) = lanes::channels_with(config.peer_link.send_queue_frames as usize, direct);
        let nonce = match auth {
            LinkAuth::Psk(_) => psk::nonce(),
            _ => Vec::new(),
        };
        let hello = identity.hello_to(&peer.name, auth.mode(), nonce.clone(), Vec::new());
        lanes.try_queue_bulk(hello).expect("new lanes have room for the hello");
        Link { lanes, receivers, sealer, nonce }
    }

    fn open_framed(self, config: &GatewayConfig, stream: tokio::net::TcpStream) -> anyhow::Result<OpenLink> {
        // The socket's own descriptor goes with the inbound side: once the link is live, the
        // driver's thread reads it (`intake.rs`).
        let socket = stream.as_fd().try_clone_to_owned().context("duplicate the link's socket")?;
        let direct = self.lanes.direct.clone().context("a framed link has its writer")?;
        // The stream itself only reads the handshake: dropped with it, it leaves this runtime's
        // reactor, which would otherwise wake a worker for every frame the driver's thread reads.
        writer::spawn(direct, self.receivers, ());
        Ok(OpenLink {
            lanes: self.lanes,
            inbound: framed::socket_inbound(stream, socket, super::max_decoding_bytes(config)),
            sealer: self.sealer,
            nonce: self.nonce,
            transport: PeerTransport::Framed,
        })
    }

    async fn open_grpc(self, config: &GatewayConfig, peer: &PeerEntry, auth: &LinkAuth) -> anyhow::Result<OpenLink> {
        let tls = auth.tls();
        let scheme = if tls.is_some() { "https" } else { "http" };
        let mut endpoint = Endpoint::from_shared(format!("{scheme}://{}", peer.address))?
            .connect_timeout(Duration::from_millis(config.peer_link.connect_timeout_ms))
            .tcp_nodelay(true);
        if let Some(tls) = tls {
            endpoint = endpoint.tls_config(tls.client_config(&super::tls_name(peer)))?;
        }
        let channel = endpoint.connect().await.with_context(|| format!("connect to {}", peer.address))?;
        let mut client = PeerLinkClient::new(channel).max_decoding_message_size(super::max_decoding_bytes(config));
        let outbound = sealed_stream(self.receivers, self.sealer.clone(), config);
        let inbound = client.link(outbound).await.context("open link")?.into_inner();
        Ok(OpenLink {
            lanes: self.lanes,
            inbound: grpc_inbound(inbound),
            sealer: self.sealer,
            nonce: self.nonce,
            transport: PeerTransport::Grpc,
        })
    }
}

impl OpenLink {
    /// Reads the peer's Hello (or its refusal), checks it and, under `psk`, its proof, and answers.
    async fn handshake(
        mut self,
        peer: &PeerEntry,
        identity: &LocalIdentity,
        auth: &LinkAuth,
    ) -> anyhow::Result<Session> {
        let first = match self.inbound.next().await {
            Some(Ok(frame)) => frame,
            Some(Err(why)) => bail!("read hello: {why}"),
            None => bail!("read hello: the peer closed the link"),
        };
        let hello = match first.frame {
            Some(Frame::Hello(hello)) => hello,
            Some(Frame::Refused(refused)) => bail!("open link: {}: {}", refused.reason, refused.message),
            _ => bail!("the peer did not start with a hello"),
        };
        if hello.name != peer.name {
            bail!("dialled {} expecting {:?}, found {:?}", peer.address, peer.name, hello.name);
        }
        if hello.protocol_version != super::PEER_PROTOCOL_VERSION {
            bail!(
                "peer {} speaks peer-link protocol {}, this gateway {}",
                peer.name,
                hello.protocol_version,
                super::PEER_PROTOCOL_VERSION
            );
        }
        let opener = match auth {
            LinkAuth::Psk(key) => {
                let transcript = psk::Transcript {
                    dialler: &identity.name,
                    server: &hello.name,
                    dialler_nonce: &self.nonce,
                    server_nonce: &hello.nonce,
                    dialler_incarnation: identity.incarnation,
                    server_incarnation: hello.incarnation,
                };
                if hello.nonce.len() != psk::NONCE_BYTES || !key.check_server_proof(&transcript, &hello.proof) {
                    bail!(
                        "peer_auth_failed: {} did not prove the pre-shared key (its peer_link.auth is {:?}; both sides need auth = \"psk\" and the same psk_file)",
                        peer.name,
                        hello.auth
                    );
                }
                let proof = key.dialler_proof(&transcript);
                let (link_sealer, link_opener) = key.link_macs(&transcript, true);
                *self.sealer.lock().unwrap_or_else(|e| e.into_inner()) = Some(link_sealer);
                let answer = PeerFrame { frame: Some(Frame::AuthProof(proto::AuthProof { proof })), mac: Vec::new() };
                self.lanes.queue_bulk(answer).await.ok();
                Some(link_opener)
            }
            _ => None,
        };
        Ok(Session { hello, inbound: self.inbound, outbound: self.lanes, opener, transport: self.transport })
    }
}
