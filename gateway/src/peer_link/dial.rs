//! Dialling a peer: connect (TLS when configured), open the `Link` stream, exchange Hellos, all
//! within `connect_timeout_ms`. Never retries by itself (the peer task paces retries).

use super::session::Session;
use super::LocalIdentity;
use crate::config::{GatewayConfig, PeerEntry};
use anyhow::{bail, Context};
use kvgate_client::proto::{peer_frame::Frame, peer_link_client::PeerLinkClient};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Endpoint;

pub(super) async fn dial(config: &GatewayConfig, peer: &PeerEntry, identity: &LocalIdentity, tls: Option<&super::tls::PeerTls>) -> anyhow::Result<Session> {
    let timeout = Duration::from_millis(config.peer_link.connect_timeout_ms);
    tokio::time::timeout(timeout, dial_inner(config, peer, identity, tls))
        .await
        .with_context(|| format!("dial {} timed out after {} ms (peer_link.connect_timeout_ms)", peer.address, timeout.as_millis()))?
}

async fn dial_inner(config: &GatewayConfig, peer: &PeerEntry, identity: &LocalIdentity, tls: Option<&super::tls::PeerTls>) -> anyhow::Result<Session> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut endpoint = Endpoint::from_shared(format!("{scheme}://{}", peer.address))?
        .connect_timeout(Duration::from_millis(config.peer_link.connect_timeout_ms))
        .tcp_nodelay(true);
    if let Some(tls) = tls {
        endpoint = endpoint.tls_config(tls.client_config(&super::tls_name(peer)))?;
    }
    let channel = endpoint.connect().await.with_context(|| format!("connect to {}", peer.address))?;
    let (tx, rx) = mpsc::channel(config.peer_link.send_queue_frames as usize);
    tx.send(identity.hello_to(&peer.name)).await.ok();
    let mut client = PeerLinkClient::new(channel).max_decoding_message_size(64 << 20);
    let mut inbound = client.link(ReceiverStream::new(rx)).await.context("open link")?.into_inner();
    let first = inbound.message().await.context("read hello")?;
    let Some(Frame::Hello(hello)) = first.and_then(|f| f.frame) else { bail!("the peer did not start with a hello") };
    if hello.name != peer.name {
        bail!("dialled {} expecting {:?}, found {:?}", peer.address, peer.name, hello.name);
    }
    if hello.protocol_version != super::PEER_PROTOCOL_VERSION {
        bail!("peer {} speaks peer-link protocol {}, this gateway {}", peer.name, hello.protocol_version, super::PEER_PROTOCOL_VERSION);
    }
    Ok(Session { hello, inbound, outbound: tx })
}
