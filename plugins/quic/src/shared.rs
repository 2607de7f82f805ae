//! What the host-facing calls and the runtime's tasks share: the config, the sink, every table
//! (regions, tickets, transfers, deadlines, peers) and the runtime's handle. Its own module so that
//! the plugin, the lanes, the peers, the server and the outgoing transfers depend on it rather than
//! on one another. Owns no behaviour beyond the shutdown flag and the peer lookup.

use crate::config::QuicConfig;
use crate::peers::PeerEntry;
use crate::regions::Regions;
use crate::staging::StagingPool;
use crate::tickets::Tickets;
use crate::tls::{Identity, KnownPeers};
use crate::transfers::Transfers;
use kvgate_abi::sdk::Sink;
use kvgate_abi::PeerId;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};

/// State shared by the host-facing calls and the runtime's tasks.
pub struct Shared {
    pub config: QuicConfig,
    pub sink: Sink,
    /// Random per open: remote keys and endpoints of an earlier incarnation are told apart.
    pub instance: u64,
    pub wire_version: u16,
    pub identity: Identity,
    pub known: Arc<KnownPeers>,
    pub regions: Regions,
    pub tickets: Tickets,
    pub transfers: Arc<Transfers>,
    pub transport: Arc<quinn::TransportConfig>,
    /// Staging buffers of outgoing stream data (`write_chunk_bytes` each, `staging_pool_bytes` idle at most).
    pub staging: Arc<StagingPool>,
    /// Deadlines of the transfers dispatched at submit (see `deadlines`).
    pub deadlines: Arc<crate::deadlines::Deadlines>,
    pub endpoints: Vec<quinn::Endpoint>,
    pub handle: tokio::runtime::Handle,
    /// Lane streams this instance opened (diagnostics: lanes are long-lived, not one per transfer).
    pub lane_streams_opened: std::sync::atomic::AtomicU64,
    /// Sets of connections replaced because one of them was stuck (`crate::stuck`).
    pub stuck_connections_replaced: std::sync::atomic::AtomicU64,
    pub(crate) peers: Mutex<HashMap<PeerId, Arc<PeerEntry>>>,
    pub(crate) endpoint_bytes: Vec<u8>,
    pub(crate) shut_down: AtomicBool,
    /// Submits hold it shared; shutdown takes it exclusively, so no transfer slips in behind it.
    pub(crate) lifecycle: RwLock<()>,
}

impl Shared {
    pub fn is_shut_down(&self) -> bool {
        self.shut_down.load(Ordering::Acquire)
    }
    pub fn peer(&self, peer: PeerId) -> Option<Arc<PeerEntry>> {
        self.peers.lock().expect("peers lock").get(&peer).cloned()
    }
}
