//! Peer links: one gRPC bidirectional stream per pair of gateways (dialled by the gateway whose name
//! sorts first), a Hello each way, heartbeats, and loss detection within
//! `heartbeat_interval_ms * heartbeat_misses`. Hands sessions and frames to the driver; never
//! interprets a frame's meaning for rooms (the driver and the core do).

pub mod codec;
mod dial;
pub mod directory;
mod server;
mod session;
mod tls;

pub use directory::{PeerDirectory, PeerSource, Upsert};
pub use server::PeerLinkService;
pub use session::{PeerEvent, PeerSender, SessionId};

use crate::config::{GatewayConfig, PeerEntry};
use kvgate_client::proto::{self, PeerFrame};
use std::sync::Arc;
use tokio::sync::mpsc;

/// The peer-link protocol version carried in every Hello.
pub const PEER_PROTOCOL_VERSION: u32 = 1;

/// What this gateway says about itself in every Hello.
#[derive(Clone, Debug)]
pub struct LocalIdentity {
    pub name: String,
    pub incarnation: u64,
    pub host: String,
    /// Opened plugins in preference order, with their endpoints.
    pub plugins: Vec<proto::PluginEndpoint>,
}

impl LocalIdentity {
    pub fn hello_to(&self, peer: &str) -> PeerFrame {
        PeerFrame {
            frame: Some(proto::peer_frame::Frame::Hello(proto::Hello {
                name: self.name.clone(),
                incarnation: self.incarnation,
                protocol_version: PEER_PROTOCOL_VERSION,
                plugins: self.plugins.clone(),
                host: self.host.clone(),
                to: peer.to_string(),
            })),
        }
    }
}

/// Whether this gateway dials `peer` (true) or waits to be dialled.
pub fn dials(local_name: &str, peer: &str) -> bool {
    local_name < peer
}

/// Starts the link tasks: one per peer, for the static ones now and for discovered ones as
/// discovery adds them.
#[derive(Clone)]
pub struct PeerLinks {
    config: Arc<GatewayConfig>,
    identity: Arc<LocalIdentity>,
    events: mpsc::Sender<crate::driver::DriverInput>,
    tls: Option<Arc<tls::PeerTls>>,
    directory: Arc<PeerDirectory>,
}

impl PeerLinks {
    /// Starts the tasks of the static peers in `directory`'s `static_tasks`; returns the links (for
    /// discovery) and the gRPC service that accepts dialled links. Peer events go straight into the
    /// driver's input queue as `DriverInput::Peer`.
    pub fn start(
        config: Arc<GatewayConfig>,
        identity: Arc<LocalIdentity>,
        events: mpsc::Sender<crate::driver::DriverInput>,
        directory: Arc<PeerDirectory>,
        static_tasks: Vec<(String, directory::NewPeer)>,
    ) -> anyhow::Result<(PeerLinks, PeerLinkService)> {
        let tls = match &config.peer_link.tls {
            Some(t) => Some(Arc::new(tls::PeerTls::load(t)?)),
            None => None,
        };
        let links = PeerLinks { config: config.clone(), identity: identity.clone(), events, tls, directory: directory.clone() };
        for (name, new) in static_tasks {
            links.spawn(name, new);
        }
        Ok((links, PeerLinkService::new(identity, config, directory)))
    }

    pub fn directory(&self) -> &Arc<PeerDirectory> {
        &self.directory
    }

    /// Starts the link task of a peer the directory just added.
    pub fn spawn(&self, name: String, new: directory::NewPeer) {
        let task = session::PeerTask {
            config: self.config.clone(),
            name,
            entry: new.entry,
            directory: self.directory.clone(),
            identity: self.identity.clone(),
            events: self.events.clone(),
            incoming: new.incoming,
            tls: self.tls.clone(),
        };
        tokio::spawn(task.run());
    }
}

/// The server TLS config for the peer-link listener, when TLS is configured.
pub fn server_tls(config: &GatewayConfig) -> anyhow::Result<Option<tonic::transport::ServerTlsConfig>> {
    match &config.peer_link.tls {
        Some(t) => Ok(Some(tls::PeerTls::load(t)?.server_config())),
        None => Ok(None),
    }
}

/// The name used for TLS verification of `peer`.
pub fn tls_name(peer: &PeerEntry) -> String {
    if !peer.tls_name.is_empty() {
        return peer.tls_name.clone();
    }
    peer.address.rsplit_once(':').map(|(h, _)| h.trim_matches(['[', ']']).to_string()).unwrap_or_default()
}
