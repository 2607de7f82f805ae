//! What the admin listener asks the driver for and gets back: the snapshot `/metrics`, `/rooms`,
//! `/plugins` and `/health` render, and a plugin reload's outcome. Plain data.

use kvgate_core::{At, Metrics};
use serde::Serialize;

/// One non-terminal room in `/rooms`.
#[derive(Clone, Debug, Serialize)]
pub struct RoomJson {
    pub room: u64,
    pub generation: u32,
    pub role: &'static str,
    pub state: &'static str,
    pub age_ms: u64,
    pub peer: String,
    /// The wire name of the plugin instance carrying the room (`shm`, `shm@2`).
    pub plugin: String,
    /// That instance's generation (0 before one was chosen).
    pub plugin_generation: u32,
    pub last_event: String,
    pub last_event_age_ms: u64,
    pub parts: u32,
    pub parts_done: u32,
    pub bytes_total: u64,
    pub bytes_done: u64,
}

/// One line of `/plugins`.
#[derive(Clone, Debug, Serialize)]
pub struct PluginStatus {
    pub name: String,
    /// For an opened instance: its generation (1 for the first, one more per reload that reopened
    /// it) and its wire name; 0 and empty for a plugin with no instance.
    pub generation: u32,
    pub wire_name: String,
    /// `active`, `draining` (retired by a reload, finishing what it holds), `closed`; empty for a
    /// plugin with no instance.
    pub state: String,
    /// `builtin` or the library path.
    pub origin: String,
    /// `opened`, `unavailable`, `open_failed`, `load_failed`, `not_opened` (not in plugins.preference),
    /// or `unhealthy` once a worker died.
    pub status: String,
    pub reason: String,
    pub abi_version: Option<u32>,
    pub version: String,
    pub memory_kinds: Vec<&'static str>,
    pub scope: Vec<&'static str>,
    pub max_inflight_transfers: u64,
    pub max_segments_per_submit: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct PeerStatus {
    pub name: String,
    /// Empty for a discovered peer whose record is withdrawn (its link may still be up).
    pub address: String,
    pub up: bool,
    /// `static` (`[[peers]]`) or `etcd` (discovery).
    pub source: &'static str,
}

/// Everything the admin listener shows, taken in one driver turn.
#[derive(Clone, Debug)]
pub struct AdminSnapshot {
    pub now: At,
    pub metrics: Metrics,
    pub rooms: Vec<RoomJson>,
    pub plugins: Vec<PluginStatus>,
    pub peers: Vec<PeerStatus>,
    /// `peer_link.auth` in force (`psk`, `tls` or `none`).
    pub peer_link_auth: &'static str,
    /// Empty when healthy; otherwise one line per problem.
    pub problems: Vec<String>,
    /// The latest plugin reload's outcome, if there was one.
    pub last_reload: Option<ReloadOutcome>,
    /// What an operator should know that does not make the gateway unhealthy (e.g. no peer is up).
    pub warnings: Vec<String>,
}

/// What a reload did, or why it did nothing.
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct ReloadOutcome {
    pub applied: bool,
    /// Why it was refused (empty when applied).
    pub error: String,
    /// Wire names of the instances opened, kept and retired.
    pub opened: Vec<String>,
    pub kept: Vec<String>,
    pub retired: Vec<String>,
    pub preference: Vec<String>,
    /// Milliseconds since the Unix epoch.
    pub at_unix_ms: u64,
}

impl ReloadOutcome {
    pub fn refused(error: String) -> ReloadOutcome {
        ReloadOutcome { error, at_unix_ms: unix_ms(), ..Default::default() }
    }
}

/// Milliseconds since the Unix epoch, now.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}
