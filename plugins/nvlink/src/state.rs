//! The instance's shared tables (regions, imported keys, IPC and VMM mappings, peers, live transfers) and
//! the mailbox between API calls and the worker. Owns bookkeeping under one mutex; never calls
//! CUDA while building a request and never delivers events (the worker does, outside the lock).

use crate::cuda::IpcMapping;
use crate::engine::{EngineCounts, NewTransfer};
use crate::vmm::VmmMapping;
use crate::wire::EndpointWire;
use kvgate_abi::{LocalKey, PeerId, ReasonCode, RemoteKey, XferId};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// A registered region.
pub struct LocalRegion {
    pub device_index: usize,
    /// Device address of the first byte in this process.
    pub addr: u64,
    pub len: u64,
    /// Set when the region is an engine's memory this instance opened.
    pub _mapping: Option<Arc<IpcMapping>>,
    /// Set when the region is a CUDA VMM allocation this instance imported and mapped.
    pub _vmm: Option<Arc<VmmMapping>>,
}

/// An imported peer region.
pub struct ImportedKey {
    pub peer: PeerId,
    /// Device address of the first byte, mapped into this process.
    pub addr: u64,
    pub len: u64,
    /// Set when the key was reached through `cuIpcOpenMemHandle`; shared by every key of the
    /// same allocation, closed when the last key and transfer let go.
    pub _mapping: Option<Arc<IpcMapping>>,
    /// Set when the key names a CUDA VMM allocation, imported through the holder's descriptor
    /// socket and mapped for this key alone; unmapped when the key and its transfers let go.
    pub _vmm: Option<Arc<VmmMapping>>,
}

/// What the worker must apply to the engine.
#[derive(Debug, Clone)]
pub enum Control {
    Fail { xfer: XferId, reason: ReasonCode, message: String },
    FailPeer { peer: PeerId, reason: ReasonCode, message: String },
    ForgetPeerStreams { peer: PeerId },
}

/// Keys a live transfer uses (to fail it when one goes away).
pub struct LiveTransfer {
    pub locals: Vec<LocalKey>,
    pub remotes: Vec<RemoteKey>,
}

#[derive(Default)]
pub struct State {
    pub regions: HashMap<LocalKey, Arc<LocalRegion>>,
    pub registered_bytes: u64,
    pub imported: HashMap<RemoteKey, Arc<ImportedKey>>,
    pub peers: HashMap<PeerId, EndpointWire>,
    /// Transfers submitted and not yet out of the engine (terminal and quiesced).
    pub live: HashMap<XferId, LiveTransfer>,
    pub pending: Vec<NewTransfer>,
    pub controls: Vec<Control>,
    /// Published by the worker after each step.
    pub counts: EngineCounts,
    pub next_local_key: u64,
    pub next_remote_key: u64,
    pub shutting_down: bool,
    pub shut_down: bool,
    pub worker_alive: bool,
    pub unhealthy_reason: Option<String>,
}

impl State {
    /// Fails every live transfer whose keys match.
    pub fn fail_users(
        &mut self,
        local: Option<LocalKey>,
        remote: Option<RemoteKey>,
        reason: ReasonCode,
        message: &str,
    ) {
        let users: HashSet<XferId> = self
            .live
            .iter()
            .filter(|(_, t)| {
                local.is_some_and(|k| t.locals.contains(&k)) || remote.is_some_and(|k| t.remotes.contains(&k))
            })
            .map(|(x, _)| *x)
            .collect();
        for xfer in users {
            self.controls.push(Control::Fail { xfer, reason, message: message.to_string() });
        }
    }
}
