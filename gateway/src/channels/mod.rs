//! Every type that crosses the driver's queues: what the engine API, the peer links, the admin
//! listener and the plugins send the driver, and what it answers. The driver, the peer links, the
//! metrics and the plugin setup all depend on this module and it on none of them, so none of them
//! depends on another to talk to the driver.

pub mod admin;
pub mod engine;
pub mod peer;

pub use admin::{AdminSnapshot, PeerStatus, PluginStatus, ReloadOutcome, RoomJson};
pub use engine::{ApiError, EngineCall, ExpectCall, MemorySpec, Registered, Reply, SendCall, SessionEnd};
pub use peer::{LinkEnd, Outbound, PeerEvent, PeerSender, SessionId};

use kvgate_abi::Event;
use kvgate_core::PluginSlot;
use tokio::sync::oneshot;

/// Everything the driver is asked, except plugin events (which have their own queue).
pub enum DriverInput {
    Engine(EngineCall),
    Peer(PeerEvent),
    Admin(oneshot::Sender<AdminSnapshot>),
    /// Apply the plugin part of a newly read configuration (see `reload`).
    ReloadPlugins(Box<crate::config::PluginsSection>, oneshot::Sender<ReloadOutcome>),
    /// A reload refused before it reached the driver (kept for `/plugins`).
    ReloadRefused(ReloadOutcome),
    /// Stop: shut the plugins down and return.
    Shutdown,
}

/// A plugin event, tagged with the slot of the instance that delivered it.
pub type PluginEventMsg = (PluginSlot, Event);
