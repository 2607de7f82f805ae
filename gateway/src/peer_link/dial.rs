//! Dialling a peer: connect (TLS when `peer_link.auth = "tls"`), open the `Link` stream, exchange
//! Hellos (and, with `psk`, check the server's proof and answer its challenge), all within
//! `connect_timeout_ms`. Never retries by itself (the peer task paces retries).

use super::handshaken::Session;
use super::{lanes, psk, sealed_stream, LinkAuth, LocalIdentity};
use crate::config::{GatewayConfig, PeerEntry};
use anyhow::{bail, Context};
use kvgate_client::proto::{self, peer_frame::Frame, peer_link_client::PeerLinkClient, PeerFrame};
use std::sync::{Arc, Mutex};
use std::time::Duration;
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
    let tls = auth.tls();
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut endpoint = Endpoint::from_shared(format!("{scheme}://{}", peer.address))?
        .connect_timeout(Duration::from_millis(config.peer_link.connect_timeout_ms))
        .tcp_nodelay(true);
    if let Some(tls) = tls {
        endpoint = endpoint.tls_config(tls.client_config(&super::tls_name(peer)))?;
    }
    let channel = endpoint.connect().await.with_context(|| format!("connect to {}", peer.address))?;
    let (tx, rx) = lanes::channels(config.peer_link.send_queue_frames as usize);
    let sealer = Arc::new(Mutex::new(None));
    let nonce = match auth {
        LinkAuth::Psk(_) => psk::nonce(),
        _ => Vec::new(),
    };
    tx.bulk.send(identity.hello_to(&peer.name, auth.mode(), nonce.clone(), Vec::new())).await.ok();
    let mut client = PeerLinkClient::new(channel).max_decoding_message_size(super::max_decoding_bytes(config));
    let mut inbound = client.link(sealed_stream(rx, sealer.clone(), config)).await.context("open link")?.into_inner();
    let first = inbound.message().await.context("read hello")?;
    let Some(Frame::Hello(hello)) = first.and_then(|f| f.frame) else { bail!("the peer did not start with a hello") };
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
                dialler_nonce: &nonce,
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
            *sealer.lock().unwrap_or_else(|e| e.into_inner()) = Some(link_sealer);
            tx.bulk
                .send(PeerFrame { frame: Some(Frame::AuthProof(proto::AuthProof { proof })), mac: Vec::new() })
                .await
                .ok();
            Some(link_opener)
        }
        _ => None,
    };
    Ok(Session { hello, inbound, outbound: tx, opener })
}
