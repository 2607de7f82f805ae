//! The gateway's configuration: one typed tree, built-in defaults < TOML file < `KVGATE__SECTION__KEY`
//! environment (see `load`), every limit checked by `validate` with key, value and allowed range.
//! Never starts anything and never reads a setting outside this tree.

mod load;
#[cfg(test)]
mod tests;
mod validate;

pub use load::{default_toml, load_config, load_config_from_str, single_underscore_env_warnings, ConfigError};
pub use validate::{check_range, LimitError};

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The whole configuration of one gateway.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct GatewayConfig {
    pub gateway: GatewaySection,
    pub engine_api: EngineApiSection,
    pub peer_link: PeerLinkSection,
    /// Static peers: every gateway this one exchanges KV caches with (besides those `discovery` finds).
    pub peers: Vec<PeerEntry>,
    pub discovery: DiscoverySection,
    pub plugins: PluginsSection,
    pub scheduler: kvgate_core::CoreConfig,
    pub driver: DriverSection,
    pub admin: AdminSection,
    pub log: LogSection,
}

/// Who this gateway is.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct GatewaySection {
    /// The name peers know this gateway by (their `[[peers]] name`). Non-empty, at most 64 bytes.
    pub name: String,
}

impl Default for GatewaySection {
    fn default() -> Self {
        GatewaySection { name: "kvgate".to_string() }
    }
}

/// Where engines reach the gateway.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct EngineApiSection {
    /// Unix socket path (created with mode 0600); empty disables it.
    pub unix_socket: String,
    /// Optional TCP listen address (`127.0.0.1:7070`); empty disables it. Requires a bearer token.
    pub tcp_listen: String,
    /// File holding the bearer token TCP clients must present (`authorization: Bearer <token>`).
    pub bearer_token_file: String,
    /// Most regions engines may register at once.
    pub max_regions: u64,
    /// Most concurrent `Watch` streams.
    pub max_watchers: u64,
    /// `Watch` streams one engine connection may hold open at once (so that one engine cannot take
    /// every `max_watchers` place; one above `max_watchers` is simply never reached).
    pub max_watchers_per_connection: u64,
    /// Events buffered per watcher; a watcher that falls this far behind catches up from the replay log.
    pub watch_buffer_events: u64,
    /// Room events kept for `Watch` resumption (`after_seq`); a cursor older than these is refused
    /// (`watch_cursor_expired`) and the engine reconciles from `ListRooms`.
    pub watch_replay_events: u64,
    /// Largest engine-API request accepted, in bytes.
    pub max_request_bytes: u64,
    /// Streams of one engine connection that the engine may reset (e.g. calls it timed out) before
    /// the gateway reads them, before HTTP/2 closes the whole connection (`too_many_resets`). A
    /// gateway that stalled for seconds finds every call the engine gave up on reset at once.
    pub http2_max_pending_reset_streams: u64,
    /// Connections of the unix socket and of `tcp_listen` (each listener its own cap).
    pub connections: ConnectionLimits,
    /// Most calls in one `SendBatch` or `ExpectBatch`; a longer batch is refused whole (`too_many_calls`).
    pub max_batch_calls: u64,
    /// How long an engine session survives with no `Watch` stream open before it ends (its live rooms
    /// fail `engine_lost`, its regions are released); an engine reconnecting within it resumes.
    pub session_grace_ms: u64,
    /// Most engine sessions open at once (`too_many_sessions` past it).
    pub max_sessions: u64,
    /// Longest free text an engine may send: a region's label (refused past it, `text_too_long`) and an
    /// abort's reason (cut to it in the log).
    pub max_text_bytes: u64,
    /// Descriptors passed on the fd socket (`<unix_socket>.fds`) and not yet named by a
    /// `RegisterMemory`, held at once (`too_many_passed_fds` past it).
    pub max_passed_fds: u64,
    /// How long a passed descriptor waits for its `RegisterMemory` before it is closed
    /// (`unknown_fd_token` after it).
    pub passed_fd_ttl_ms: u64,
    /// The engine fast lane: the same calls as length-prefixed frames on `<unix_socket>.lane` (mode
    /// 0600, same folder checks), beside gRPC. Needs `unix_socket`.
    pub lane: bool,
    /// Largest lane frame accepted from an engine, in bytes (its length prefix not counted). A longer
    /// one is answered `frame_too_large` and its connection closed.
    pub lane_max_frame_bytes: u64,
    /// Calls one lane connection may have in flight (accepted, not yet answered); one more is refused
    /// `too_many_calls_in_flight` (a watch counts as one for as long as it is open).
    pub lane_max_calls_in_flight: u64,
    /// Reply bytes one lane connection may have queued but not yet written (an engine that does not
    /// read its replies); at it, the gateway reads no more of that connection's calls until the
    /// engine has read them.
    pub lane_max_queued_reply_bytes: u64,
}

impl Default for EngineApiSection {
    fn default() -> Self {
        EngineApiSection {
            unix_socket: default_engine_socket(),
            tcp_listen: String::new(),
            bearer_token_file: String::new(),
            max_regions: 4096,
            max_watchers: 256,
            max_watchers_per_connection: 16,
            watch_buffer_events: 4096,
            watch_replay_events: 65536,
            max_request_bytes: 16 << 20,
            http2_max_pending_reset_streams: 4096,
            connections: ConnectionLimits::new(1024, 10_000, 300_000),
            max_batch_calls: 4096,
            session_grace_ms: 5000,
            max_sessions: 1024,
            max_text_bytes: 1024,
            max_passed_fds: 64,
            passed_fd_ttl_ms: 10_000,
            lane: true,
            lane_max_frame_bytes: 16 << 20,
            lane_max_calls_in_flight: 4096,
            lane_max_queued_reply_bytes: 4 << 20,
        }
    }
}

/// Links to peer gateways.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct PeerLinkSection {
    /// Listen address of the peer-link server (`127.0.0.1:7100`); it takes framed and gRPC links.
    pub listen: String,
    /// A heartbeat is sent at least this often on every link.
    pub heartbeat_interval_ms: u64,
    /// A link that received nothing for `heartbeat_interval_ms * heartbeat_misses` is lost.
    pub heartbeat_misses: u64,
    /// A dial (TCP + TLS + hello) that takes longer than this fails.
    pub connect_timeout_ms: u64,
    /// Wait between two dials to an unreachable peer.
    pub reconnect_interval_ms: u64,
    /// Frames queued towards one peer; a peer that lets the queue fill is declared lost.
    pub send_queue_frames: u64,
    /// Largest peer-link frame accepted from a peer, in bytes (a fragmented one once joined). A frame
    /// this gateway would send past it is refused at the engine call that would cause it. Must be at
    /// least `engine_api.max_request_bytes`, and the same on every gateway of a deployment.
    pub max_frame_bytes: u64,
    /// A frame whose encoding is larger than this leaves in fragments of this size, so that
    /// heartbeats (which go first) never wait behind more than one fragment.
    pub frame_fragment_bytes: u64,
    /// Core messages the driver sends a peer while handling one input leave together in `CoreBatch`
    /// frames of at most `frame_fragment_bytes` (one frame, one MAC and one queue slot for many
    /// rooms), when the peer's Hello says it takes them. `false` sends one frame per message.
    pub core_batch: bool,
    /// Outcome messages (`Quiesced`) for a peer whose link was lost, kept until the same peer
    /// process is back on a new link and then delivered there, so that its quarantined rooms need
    /// not wait for `quarantine_timeout_ms`. Past it the oldest is dropped (and that room waits for
    /// its quarantine bound). 0 keeps none.
    pub parked_outcomes: u64,
    /// How peer links are authenticated: `psk` (a pre-shared key file proven by challenge-response,
    /// every frame then carries a MAC), `tls` (mutual TLS, `[peer_link.tls]`), or `none` (anyone who
    /// can reach the port and names a peer is believed; logged as a warning, loopback only).
    /// Unset: `tls` when `[peer_link.tls]` is given, `psk` otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub auth: Option<PeerAuthMode>,
    /// The pre-shared key of `auth = "psk"`: a file of mode 0600 holding at least 32 random bytes as
    /// hex (`kvgate keygen psk FILE` makes one); every gateway of the deployment holds the same key.
    pub psk_file: String,
    /// Mutual TLS for peer links (`auth = "tls"`).
    pub tls: Option<PeerTlsSection>,
    /// What carries a link this gateway dials: `framed` (length-prefixed frames straight on the TCP
    /// connection: no HTTP/2, no task between the socket and the link) or `grpc` (a gRPC stream over
    /// HTTP/2). The listener takes both, and a framed dial to a gateway that does not take framed
    /// links falls back to gRPC, so mixed versions link. Unset: `framed`, or `grpc` with
    /// `auth = "tls"` (framed links have no TLS yet).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub transport: Option<PeerTransport>,
    /// Connections of the peer-link listener (dialled links; heartbeats keep a live one talking).
    pub connections: ConnectionLimits,
}

/// How a peer link proves who is at the other end.
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum PeerAuthMode {
    Psk,
    Tls,
    None,
}

impl PeerAuthMode {
    pub fn as_str(self) -> &'static str {
        match self {
            PeerAuthMode::Psk => "psk",
            PeerAuthMode::Tls => "tls",
            PeerAuthMode::None => "none",
        }
    }
}

/// What carries a peer link (`peer_link.transport`).
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum PeerTransport {
    Framed,
    Grpc,
}

impl PeerTransport {
    pub fn as_str(self) -> &'static str {
        match self {
            PeerTransport::Framed => "framed",
            PeerTransport::Grpc => "grpc",
        }
    }
}

impl PeerLinkSection {
    /// The transport this gateway dials with: `transport`, or its default (`grpc` with TLS, else
    /// `framed`).
    pub fn transport_mode(&self) -> PeerTransport {
        self.transport.unwrap_or(if self.auth_mode() == PeerAuthMode::Tls {
            PeerTransport::Grpc
        } else {
            PeerTransport::Framed
        })
    }

    /// The authentication in force: `auth`, or its default (`tls` with `[peer_link.tls]`, else `psk`).
    pub fn auth_mode(&self) -> PeerAuthMode {
        self.auth.unwrap_or(if self.tls.is_some() { PeerAuthMode::Tls } else { PeerAuthMode::Psk })
    }
}

impl Default for PeerLinkSection {
    fn default() -> Self {
        PeerLinkSection {
            listen: "127.0.0.1:7100".to_string(),
            heartbeat_interval_ms: 200,
            heartbeat_misses: 5,
            connect_timeout_ms: 2000,
            reconnect_interval_ms: 250,
            send_queue_frames: 65536,
            max_frame_bytes: 64 << 20,
            frame_fragment_bytes: 256 << 10,
            core_batch: true,
            parked_outcomes: 65_536,
            auth: None,
            psk_file: String::new(),
            tls: None,
            transport: None,
            connections: ConnectionLimits::new(256, 10_000, 120_000),
        }
    }
}

/// PEM files for mutually authenticated TLS between gateways.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct PeerTlsSection {
    /// This gateway's certificate chain.
    pub cert_file: String,
    /// Its private key.
    pub key_file: String,
    /// The CA that signed every peer's certificate; peers whose certificate it did not sign are refused.
    pub ca_file: String,
}

/// One peer gateway.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct PeerEntry {
    /// Its `[gateway] name`.
    pub name: String,
    /// Its `[peer_link] listen` address, `host:port`.
    pub address: String,
    /// Whether it runs on this machine (same-host plugins such as shm and NVLink become eligible).
    pub same_host: bool,
    /// The name in its TLS certificate, when TLS is on; default: the host part of `address`.
    pub tls_name: String,
}

/// Peers found through etcd: this gateway registers itself under `key_prefix` with a lease and
/// watches the prefix for the others. Off while `etcd_endpoints` is empty.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DiscoverySection {
    /// etcd client URLs (`http://10.0.0.5:2379`, `https://` with `tls`); empty turns discovery off.
    pub etcd_endpoints: Vec<String>,
    /// etcd user this gateway authenticates as; empty: no authentication.
    pub username: String,
    /// File holding that user's password (read at start; one trailing newline is dropped).
    pub password_file: String,
    /// TLS to etcd: the CA that signed etcd's certificate, and optionally a client certificate.
    pub tls: Option<EtcdTlsSection>,
    /// Every gateway of one deployment registers under this prefix as `<prefix><gateway.name>`.
    pub key_prefix: String,
    /// The lease on this gateway's record: it disappears this long after the gateway stops renewing it.
    pub lease_ttl_s: u64,
    /// Bound on connecting to etcd, on each etcd request and on each lease keep-alive's answer.
    pub request_timeout_ms: u64,
    /// Wait after a failed etcd call before connecting and registering again.
    pub retry_interval_ms: u64,
    /// Most peers discovery may add; records past it are refused (`peer_limit`) and logged.
    pub max_peers: u64,
    /// The peer-link address peers dial, published in the record; default `peer_link.listen`.
    pub advertise_address: String,
    /// The name in this gateway's TLS certificate, published in the record; default: the host part of
    /// the advertised address.
    pub tls_name: String,
}

impl Default for DiscoverySection {
    fn default() -> Self {
        DiscoverySection {
            etcd_endpoints: vec![],
            username: String::new(),
            password_file: String::new(),
            tls: None,
            key_prefix: "/kvgate/peers/".to_string(),
            lease_ttl_s: 10,
            request_timeout_ms: 3000,
            retry_interval_ms: 1000,
            max_peers: 256,
            advertise_address: String::new(),
            tls_name: String::new(),
        }
    }
}

/// PEM files for TLS between the gateway and etcd.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct EtcdTlsSection {
    /// The CA that signed etcd's server certificate.
    pub ca_file: String,
    /// This gateway's client certificate, for etcd's `--client-cert-auth`; with `key_file`, or neither.
    pub cert_file: String,
    pub key_file: String,
}

/// Most peers `discovery.max_peers` may allow (as many as static `[[peers]]` entries).
pub const MAX_DISCOVERED_PEERS: u64 = 1024;

/// Which plugins to load and how to open them.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct PluginsSection {
    /// Plugin names in order of preference; the first one both peers opened that fits is used.
    pub preference: Vec<String>,
    /// Extra plugin libraries (`.so`) to load through the stable ABI.
    pub libraries: Vec<String>,
    /// Per-plugin config, passed to the plugin's `open` as TOML (keys are the plugin's own).
    pub config: BTreeMap<String, toml::Table>,
    /// Most plugin libraries this process maps over its life. Libraries loaded through abi_stable
    /// are never unloaded, so each plugin reload that names a new library path maps one more; a
    /// reload that would pass this is refused (restart the gateway to start afresh).
    pub max_mapped_libraries: u64,
    /// After a plugin reload retired an instance, how long it may take to finish what it holds
    /// before it is shut down anyway (what it still holds then fails with the plugin's reason).
    pub drain_timeout_ms: u64,
    /// An instance whose worker died is replaced by a new one after `restart_backoff_ms` (doubled
    /// for each restart already made within `restart_window_ms`), at most `restart_max_attempts`
    /// times within `restart_window_ms`; past that it stays down and `/healthz` says why.
    pub restart_max_attempts: u64,
    pub restart_window_ms: u64,
    pub restart_backoff_ms: u64,
}

/// Most plugin instances one gateway process opens over its life (a part names its plugin in one
/// byte, `kvgate_core`'s slot limit): each plugin reload that opens an instance uses one.
pub const MAX_PLUGIN_INSTANCES: usize = 255;

impl Default for PluginsSection {
    fn default() -> Self {
        PluginsSection {
            preference: vec!["shm".to_string(), "quic".to_string()],
            libraries: vec![],
            config: BTreeMap::new(),
            max_mapped_libraries: 16,
            drain_timeout_ms: 120_000,
            restart_max_attempts: 3,
            restart_window_ms: 600_000,
            restart_backoff_ms: 1_000,
        }
    }
}

/// The driver task's queues.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DriverSection {
    /// Events (engine calls, peer frames) queued towards the driver before callers wait.
    pub event_queue_len: u64,
    /// Plugin events queued towards the driver; past it an event is dropped and counted
    /// (`kvgate_plugin_events_dropped_total`) and the core's plugin grace ends the transfer.
    pub plugin_event_queue_len: u64,
    /// At shutdown, how long the driver waits for plugins to quiesce the transfers of the rooms it
    /// aborted before it shuts them down (their shutdown then quiesces the rest).
    pub shutdown_grace_ms: u64,
    /// Threads of the runtime that serves the engine API, the peer links and the admin listener (the
    /// driver has its own thread, plugins their own): 0 = one per CPU. On a machine with few cores,
    /// 1 costs less CPU per room (fewer hand-offs between threads; see gateway/README.md).
    pub io_threads: u64,
    /// When the driver wakes for a deadline this much later than it asked (the process was stopped
    /// or starved), it first reads what arrived meanwhile, for this long, and only then acts on the
    /// deadlines that passed: frames already waiting in a socket (a peer's `PartDone`) are not
    /// overtaken by timeouts the stall caused. 0 acts on deadlines at once.
    pub stall_catch_up_ms: u64,
    /// Inputs (plugin events, engine calls, peer frames) already queued that the driver handles in
    /// one step before it sends the peer messages they caused (together, in `CoreBatch` frames with
    /// `peer_link.core_batch`). 1 sends after every input. A deadline waits for at most one step.
    pub inputs_per_step: u64,
}

/// Most inputs one driver step takes (`driver.inputs_per_step`).
pub const MAX_INPUTS_PER_STEP: u64 = 4096;

/// Most runtime threads `driver.io_threads` accepts.
pub const MAX_IO_THREADS: u64 = 256;

impl Default for DriverSection {
    fn default() -> Self {
        DriverSection {
            event_queue_len: 4096,
            plugin_event_queue_len: 65536,
            shutdown_grace_ms: 2000,
            io_threads: 0,
            stall_catch_up_ms: 500,
            inputs_per_step: 64,
        }
    }
}

/// The admin HTTP listener and health rules.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct AdminSection {
    /// `127.0.0.1:9100`; empty disables the listener.
    pub listen: String,
    /// A room still live at each of these ages gets one warning log line (per room, per age).
    pub stuck_room_warn_ms: Vec<u64>,
    /// At most this many of those lines per second (a burst of one second's worth); past it, the
    /// rooms that reach an age together are counted in one summary line instead of named one by one,
    /// so that many rooms stuck at once never stall the driver writing their lines.
    pub stuck_room_warn_lines_per_s: u64,
    /// `/healthz` answers 503 while a room has been quarantined (its memory held, waiting for the word
    /// that no byte can land any more) for longer than this.
    pub quarantine_unhealthy_ms: u64,
    /// Connections of the admin listener (`/metrics`, `/healthz`, ...).
    pub connections: ConnectionLimits,
}

/// The engine socket when the config names none: in the user's runtime directory
/// (`$XDG_RUNTIME_DIR/kvgate/engine.sock`, a directory only that user may enter), else in a folder
/// of the user's own under /tmp (`/tmp/kvgate-<uid>/engine.sock`, made with mode 0700, refused when
/// another user made it first). The Python client (`kvgate.default_socket()`) looks in the same place.
pub fn default_engine_socket() -> String {
    match std::env::var("XDG_RUNTIME_DIR") {
        Ok(dir) if dir.starts_with('/') => format!("{}/kvgate/engine.sock", dir.trim_end_matches('/')),
        _ => format!("/tmp/kvgate-{}/engine.sock", nix::unistd::getuid()),
    }
}

/// The bounds of one listener's connections (`[engine_api.connections]`, `[peer_link.connections]`,
/// `[admin.connections]`).
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct ConnectionLimits {
    /// Connections held open at once; one more is closed as soon as it is accepted.
    pub max_connections: u64,
    /// A connection that sends nothing this long after it is accepted is closed.
    pub handshake_timeout_ms: u64,
    /// A connection that then sends nothing this long is closed (gRPC listeners ping at a third of
    /// it, so a live client's answers keep its connection).
    pub idle_timeout_ms: u64,
}

impl ConnectionLimits {
    pub const fn new(max_connections: u64, handshake_timeout_ms: u64, idle_timeout_ms: u64) -> Self {
        ConnectionLimits { max_connections, handshake_timeout_ms, idle_timeout_ms }
    }
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits::new(1024, 10_000, 300_000)
    }
}

/// Most `admin.stuck_room_warn_lines_per_s` accepts.
pub const MAX_STUCK_ROOM_WARN_LINES_PER_S: u64 = 100_000;

impl Default for AdminSection {
    fn default() -> Self {
        AdminSection {
            listen: "127.0.0.1:9100".to_string(),
            stuck_room_warn_ms: vec![5_000, 30_000],
            stuck_room_warn_lines_per_s: 100,
            quarantine_unhealthy_ms: 10_000,
            connections: ConnectionLimits::new(64, 5_000, 60_000),
        }
    }
}

/// Logging.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct LogSection {
    /// `text` or `json`.
    pub format: String,
    /// A tracing filter (`info`, `kvgate=debug`); `RUST_LOG` wins when set.
    pub level: String,
}

impl Default for LogSection {
    fn default() -> Self {
        LogSection { format: "text".to_string(), level: "info".to_string() }
    }
}
