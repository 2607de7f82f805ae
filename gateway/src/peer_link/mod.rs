//! Peer links: one link per pair of gateways (dialled by the gateway whose name sorts first), framed
//! on TCP (`framed.rs`) or a gRPC bidirectional stream (`peer_link.transport`), a Hello each way, heartbeats, and loss detection within
//! `heartbeat_interval_ms * heartbeat_misses`. Hands sessions and frames to the driver; never
//! interprets a frame's meaning for rooms (the driver and the core do).

pub mod codec;
mod dial;
pub mod directory;
pub mod framed;
mod handshaken;
mod intake;
pub mod lanes;
pub mod listener;
pub mod psk;
mod server;
mod session;
mod tls;
#[cfg(test)]
mod transport_tests;
pub mod writer;

pub use directory::{PeerDirectory, PeerSource, Upsert};
pub use server::PeerLinkService;

use crate::config::{GatewayConfig, PeerAuthMode, PeerEntry};
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
    /// Opened plugin instances, current ones in preference order, then retiring ones, with their
    /// endpoints. A plugin reload replaces the list; a link dialled or accepted later says the new one.
    pub plugins: AdvertisedPlugins,
    /// Optional protocol features this gateway takes ([`FEATURE_CORE_BATCH`]), listed in its Hello.
    pub features: Vec<String>,
}

/// The plugin instances every Hello advertises, shared between the driver (which changes them on a
/// plugin reload) and the peer-link tasks (which read them for each new link).
#[derive(Clone, Debug, Default)]
pub struct AdvertisedPlugins(Arc<std::sync::RwLock<Vec<proto::PluginEndpoint>>>);

impl AdvertisedPlugins {
    pub fn new(plugins: Vec<proto::PluginEndpoint>) -> AdvertisedPlugins {
        AdvertisedPlugins(Arc::new(std::sync::RwLock::new(plugins)))
    }
    pub fn get(&self) -> Vec<proto::PluginEndpoint> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
    pub fn set(&self, plugins: Vec<proto::PluginEndpoint>) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = plugins;
    }
}

/// A Hello listing this takes `CoreBatch` frames (`peer_link.core_batch`).
pub const FEATURE_CORE_BATCH: &str = "core_batch";

impl LocalIdentity {
    /// This gateway's Hello to `peer`, with the authentication fields of `auth` (`nonce` and
    /// `proof` are empty unless `psk`).
    pub fn hello_to(&self, peer: &str, auth: PeerAuthMode, nonce: Vec<u8>, proof: Vec<u8>) -> PeerFrame {
        PeerFrame {
            frame: Some(proto::peer_frame::Frame::Hello(proto::Hello {
                name: self.name.clone(),
                incarnation: self.incarnation,
                protocol_version: PEER_PROTOCOL_VERSION,
                plugins: self.plugins.get(),
                host: self.host.clone(),
                to: peer.to_string(),
                auth: auth.as_str().to_string(),
                nonce,
                proof,
                features: self.features.clone(),
            })),
            mac: Vec::new(),
        }
    }
}

/// How this gateway's peer links are authenticated (`peer_link.auth`), with the material loaded.
#[derive(Clone)]
pub enum LinkAuth {
    Psk(Arc<psk::Psk>),
    Tls(Arc<tls::PeerTls>),
    /// Unauthenticated: the operator wrote `peer_link.auth = "none"`.
    None,
}

impl LinkAuth {
    /// Load the key or certificates `config` names (at start: a gateway that cannot read them does
    /// not start).
    pub fn load(config: &GatewayConfig) -> anyhow::Result<LinkAuth> {
        Ok(match config.peer_link.auth_mode() {
            PeerAuthMode::Psk if config.peer_link.psk_file.is_empty() => {
                // Validation allows this only for a gateway with no peer at all: refuse every link.
                LinkAuth::Psk(Arc::new(psk::Psk::unusable()))
            }
            PeerAuthMode::Psk => LinkAuth::Psk(Arc::new(
                psk::Psk::load(std::path::Path::new(&config.peer_link.psk_file))
                    .map_err(|e| anyhow::anyhow!("peer_link.psk_file: {e:#}"))?,
            )),
            PeerAuthMode::Tls => {
                let section = config
                    .peer_link
                    .tls
                    .as_ref()
                    .ok_or_else(|| anyhow::anyhow!("peer_link.auth = \"tls\" needs [peer_link.tls]"))?;
                LinkAuth::Tls(Arc::new(tls::PeerTls::load(section)?))
            }
            PeerAuthMode::None => LinkAuth::None,
        })
    }

    pub fn mode(&self) -> PeerAuthMode {
        match self {
            LinkAuth::Psk(_) => PeerAuthMode::Psk,
            LinkAuth::Tls(_) => PeerAuthMode::Tls,
            LinkAuth::None => PeerAuthMode::None,
        }
    }

    fn tls(&self) -> Option<&tls::PeerTls> {
        match self {
            LinkAuth::Tls(t) => Some(t),
            _ => None,
        }
    }
}

/// A link's outbound frame stream (its lanes, large frames fragmented) that MACs every frame once
/// the link's sealer is set (`psk`), and passes frames through untouched otherwise (`tls`, `none`,
/// and the Hello).
pub(crate) fn sealed_stream(
    rx: lanes::OutboundReceivers,
    sealer: writer::SharedSealer,
    config: &GatewayConfig,
) -> impl tokio_stream::Stream<Item = PeerFrame> + Send + 'static {
    tokio_stream::StreamExt::map(lanes::outbound_stream(rx, config.peer_link.frame_fragment_bytes), move |frame| {
        match sealer.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            Some(sealer) => sealer.seal(frame),
            None => frame,
        }
    })
}

/// The largest message a peer link decodes (tonic's bound, and the framed reader's): a whole frame of `max_frame_bytes` (a peer that
/// fragments less than this gateway) plus its envelope and MAC.
pub fn max_decoding_bytes(config: &GatewayConfig) -> usize {
    (config.peer_link.max_frame_bytes + 4096) as usize
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
    events: mpsc::Sender<crate::channels::DriverInput>,
    auth: LinkAuth,
    directory: Arc<PeerDirectory>,
    driver_runtime: Option<tokio::runtime::Handle>,
}

impl PeerLinks {
    /// Starts the tasks of the static peers in `directory`'s `static_tasks`; returns the links (for
    /// discovery) and the gRPC service that accepts dialled links. Peer events go straight into the
    /// driver's input queue as `DriverInput::Peer`; framed links' sockets are read on
    /// `driver_runtime` (the driver's thread) when given.
    pub fn start(
        config: Arc<GatewayConfig>,
        driver_runtime: Option<tokio::runtime::Handle>,
        identity: Arc<LocalIdentity>,
        events: mpsc::Sender<crate::channels::DriverInput>,
        directory: Arc<PeerDirectory>,
        static_tasks: Vec<(String, directory::NewPeer)>,
    ) -> anyhow::Result<(PeerLinks, PeerLinkService)> {
        let auth = LinkAuth::load(&config)?;
        if auth.mode() == PeerAuthMode::None {
            tracing::warn!(
                listen = %config.peer_link.listen,
                "peer_link.auth = \"none\": peer links are NOT authenticated; any local process that reaches the port and names a configured peer is believed"
            );
        }
        let links = PeerLinks {
            config: config.clone(),
            identity: identity.clone(),
            events,
            auth: auth.clone(),
            directory: directory.clone(),
            driver_runtime,
        };
        for (name, new) in static_tasks {
            links.spawn(name, new);
        }
        Ok((links, PeerLinkService::new(identity, config, directory, auth)))
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
            auth: self.auth.clone(),
            driver_runtime: self.driver_runtime.clone(),
            last_auth_warning: None,
        };
        tokio::spawn(task.run());
    }
}

/// The server TLS config for the peer-link listener, when TLS is configured.
pub fn server_tls(config: &GatewayConfig) -> anyhow::Result<Option<tonic::transport::ServerTlsConfig>> {
    match (&config.peer_link.tls, config.peer_link.auth_mode()) {
        (Some(t), PeerAuthMode::Tls) => Ok(Some(tls::PeerTls::load(t)?.server_config())),
        _ => Ok(None),
    }
}

/// The name used for TLS verification of `peer`.
pub fn tls_name(peer: &PeerEntry) -> String {
    if !peer.tls_name.is_empty() {
        return peer.tls_name.clone();
    }
    peer.address.rsplit_once(':').map(|(h, _)| h.trim_matches(['[', ']']).to_string()).unwrap_or_default()
}
