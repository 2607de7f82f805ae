//! The plugin's TOML configuration: every knob with its unit in its name, a documented default and a
//! check at open that names the offending key. Owns parsing and validation only; never opens sockets.

use kvgate_abi::{PluginError, ReasonCode};
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::PathBuf;

/// Largest `min_mtu_bytes`: quinn pads handshake (long-header) packets to the minimum MTU and asserts
/// their length stays below 2^14 bytes.
pub const MAX_MIN_MTU_BYTES: u16 = 16000;

/// Smallest non-zero `malloc_trim_threshold_bytes`: glibc's own default (128 KiB).
pub const MIN_MALLOC_TRIM_THRESHOLD_BYTES: u64 = 128 << 10;

/// Largest `malloc_trim_threshold_bytes` (1 GiB; `mallopt` takes an `int`).
pub const MAX_MALLOC_TRIM_THRESHOLD_BYTES: u64 = 1 << 30;

/// Largest datagram `segmentation_offload` may be combined with (see there).
pub const MAX_GSO_DATAGRAM_BYTES: u16 = 1500;

/// Congestion controller of every connection (`congestion_controller`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CongestionController {
    Cubic,
    Bbr,
    Newreno,
}

/// The TLS 1.3 cipher suite offered first (`cipher_suite`); the others stay offered after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CipherSuite {
    /// TLS_AES_128_GCM_SHA256: the cheapest per byte on CPUs with AES-NI/VAES (10 AES rounds, not 14).
    Aes128gcm,
    /// TLS_AES_256_GCM_SHA384.
    Aes256gcm,
    /// TLS_CHACHA20_POLY1305_SHA256: for CPUs without AES instructions.
    Chacha20poly1305,
}

/// The plugin's configuration. Unknown keys are refused (`deny_unknown_fields`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QuicConfig {
    /// Address the first UDP endpoint binds; endpoint `i` binds port `port + i` (or an ephemeral port
    /// when the port is 0). Default `127.0.0.1:0`.
    pub listen_address: SocketAddr,
    /// IP put in `local_endpoint()` instead of the bound one (needed when binding `0.0.0.0`). Default none.
    pub advertise_ip: Option<std::net::IpAddr>,
    /// UDP endpoints (sockets, each with its own driver task). Default 2, range 1..=16.
    pub endpoints: usize,
    /// Connections opened to each peer (connection `i` leaves from endpoint `i % endpoints` and goes to the
    /// peer's endpoint `i % its count`). Default 2, range 1..=16.
    pub connections_per_peer: usize,
    /// Lanes per connection: long-lived bidirectional streams, opened once per connection, that carry
    /// the parts of many transfers back to back (the receiver's confirmations come back on the same
    /// stream). A transfer is split over at most `connections_per_peer * lanes_per_connection` lanes;
    /// each lane has its own sending and receiving task, so two lanes per connection keep both sides of
    /// a two-core machine busy (one copies into a region while the other's bytes arrive). Default 2,
    /// range 1..=64, and below `max_concurrent_streams_per_connection` (the control stream needs one).
    pub lanes_per_connection: usize,
    /// A transfer is split into parts (one per lane) of at least this many bytes. Default 262144
    /// (256 KiB), min 4096.
    pub min_lane_bytes: u64,
    /// Most concurrent streams a peer may open on one connection. Default 1024, range 16..=65536.
    pub max_concurrent_streams_per_connection: u32,
    /// Worker threads of the plugin's tokio runtime. Default 2, range 1..=64.
    pub worker_threads: usize,
    /// QUIC initial MTU (UDP payload bytes) before discovery. Default 1200, range 1200..=65527.
    /// Over IPv4 no UDP payload exceeds 65507 bytes (65535 minus the IP and UDP headers); a larger
    /// value is refused by the kernel and only black-hole detection brings it down.
    pub initial_mtu_bytes: u16,
    /// The UDP payload the path is known to carry: Initial packets are padded to it and black-hole
    /// detection never falls below it. Default 1200 (any IP path). On loopback set it with
    /// `initial_mtu_bytes` (e.g. 65507), so one dropped burst cannot pin the MTU at 1200 bytes.
    /// Range 1200..=16000 (quinn pads handshake packets to it, and a long-header packet must stay below
    /// 16384 bytes: a larger value would make quinn panic), at most `initial_mtu_bytes`.
    pub min_mtu_bytes: u16,
    /// Upper bound of MTU discovery, also the largest UDP payload accepted. Default 1452 (a 1500-byte
    /// Ethernet path). Loopback and jumbo-frame links: 65507 (the IPv4 maximum) with
    /// `segmentation_offload = false`. Range 1200..=65527, at least `initial_mtu_bytes`.
    pub mtu_discovery_upper_bound_bytes: u16,
    /// After a black hole (large datagrams lost), MTU discovery falls back to 1200 bytes and probes
    /// upwards again after this long. Default 2000 (quinn's own is 60000, which leaves a loopback that
    /// dropped one burst at 1200-byte datagrams for a minute). Range 100..=3600000.
    pub mtu_black_hole_cooldown_ms: u64,
    /// Disable MTU discovery (keep `initial_mtu_bytes`). Default false.
    pub disable_mtu_discovery: bool,
    /// Generic segmentation offload (several datagrams per send call) where the kernel supports it.
    /// Default true. Only with `mtu_discovery_upper_bound_bytes` up to `MAX_GSO_DATAGRAM_BYTES`: measured
    /// on loopback, batches of larger datagrams lost a third or more of them (9000 bytes) or stalled.
    pub segmentation_offload: bool,
    /// Flow-control window of one stream. Default 16777216 (16 MiB), range 65536..=1073741824.
    pub stream_window_bytes: u64,
    /// Flow-control window of one connection. Default 67108864 (64 MiB), range 65536..=4294967296.
    pub connection_window_bytes: u64,
    /// Unacknowledged bytes a connection may have in flight. Default 67108864 (64 MiB), range 65536..=4294967296.
    pub send_window_bytes: u64,
    /// `cubic`, `bbr` or `newreno`. Default `cubic`.
    pub congestion_controller: CongestionController,
    /// TLS 1.3 cipher suite offered first: `aes128gcm` (default), `aes256gcm` or `chacha20poly1305`.
    /// The client's order decides; all three stay offered, so differently configured peers still connect.
    pub cipher_suite: CipherSuite,
    /// Initial congestion window. 0 (the default) picks the larger of 14720 bytes (quinn's default) and
    /// ten initial-MTU datagrams: a window below one datagram would block the very first packet.
    /// Otherwise at least two `initial_mtu_bytes` datagrams, at most 1073741824.
    pub initial_congestion_window_bytes: u64,
    /// A connection silent this long is dead (its transfers fail `PEER_LOST`). Default 3000, range 100..=600000.
    pub idle_timeout_ms: u64,
    /// Keep-alive ping interval; must be below `idle_timeout_ms`. Default 500, range 10..=60000.
    pub keep_alive_interval_ms: u64,
    /// Bound on establishing the connections to a peer (handshake + version exchange). Default 5000,
    /// range 100..=600000.
    pub connect_timeout_ms: u64,
    /// Timeout used when a submit carries `timeout_ns == 0`. Default 30000, range 1..=3600000.
    pub default_transfer_timeout_ms: u64,
    /// Bytes staged per stream write (one copy out of the source region). Default 262144, range 4096..=16777216.
    pub write_chunk_bytes: usize,
    /// Staging buffers (`write_chunk_bytes` each) kept for reuse once quinn has dropped them, in bytes;
    /// the rest are freed. Reuse spares the page faults of fresh memory on every chunk (measured on
    /// loopback: a sixth of all the CPU a transfer took). Idle memory of an instance stays below this.
    /// Default 67108864 (64 MiB), range 0..=4294967296 (0 frees every buffer).
    pub staging_pool_bytes: u64,
    /// SO_RCVBUF / SO_SNDBUF requested for each UDP socket (the kernel caps it at `net.core.rmem_max`).
    /// Default 4194304, range 65536..=1073741824.
    pub socket_buffer_bytes: usize,
    /// Process-wide, opt-in: glibc's `M_TRIM_THRESHOLD` (`mallopt`), set at open when non-zero: free
    /// memory at the top of a malloc heap is kept up to this many bytes instead of being handed back to
    /// the kernel. quinn copies every received datagram into a fresh buffer (64 KiB on loopback), which
    /// glibc's default (128 KiB, dynamic) hands back and faults in again: measured on loopback, a tenth
    /// of all the CPU went to those page faults. It is the host process's allocator, so it stays the
    /// host's choice (the gateway or the operator's config); the same as the environment
    /// `GLIBC_TUNABLES=glibc.malloc.trim_threshold=N`. Default 0 (leave the allocator alone), range 0 or
    /// 131072..=1073741824; refused when non-zero on a target without glibc.
    pub malloc_trim_threshold_bytes: u64,
    /// A peer's outgoing connection whose sending rate stays below the stuck bar for this long while it
    /// is busy (a lane's writer waits for quinn, parts queue on a lane, or its unanswered parts carry
    /// at least the bar's bytes over this window) is replaced (`src/stuck.rs`): its parts fail
    /// `TRANSPORT_ERROR`, it is closed, and the peer is connected afresh. 0 disables the watchdog.
    /// Default 3000, range 0 or 100..=600000.
    pub stuck_after_ms: u64,
    /// The stuck bar's floor: a busy connection sending fewer bytes per second than this over
    /// `stuck_after_ms` is stuck. Default 0 (no floor), range 0..=1099511627776.
    pub stuck_min_bytes_per_s: u64,
    /// The stuck bar's share of the best rate a connection to the same peer (this one or another)
    /// reached over a `stuck_after_ms` window, in percent: a busy connection sending below it for
    /// `stuck_after_ms` is stuck. Default 10, range 0..=100 (0: only the floor).
    pub stuck_below_best_percent: u64,
    /// Most segments one submit may carry. Default 1048576, range 1..=16777216.
    pub max_segments_per_submit: u64,
    /// Most live outgoing transfers. Default 65536, range 1..=16777216.
    pub max_inflight_transfers: u64,
    /// Most live incoming tickets. Default 65536, range 1..=16777216.
    pub max_live_tickets: u64,
    /// PEM certificate chain of this instance; with `private_key_path`. Default: a self-signed
    /// certificate generated at open (its SHA-256 travels in `local_endpoint()`).
    pub certificate_path: Option<PathBuf>,
    /// PEM private key matching `certificate_path`.
    pub private_key_path: Option<PathBuf>,
    /// Wire protocol version this instance speaks; tests set it to check the version refusal.
    #[serde(skip)]
    #[doc(hidden)]
    pub wire_version_override: Option<u16>,
}

impl Default for QuicConfig {
    fn default() -> Self {
        QuicConfig {
            listen_address: "127.0.0.1:0".parse().expect("literal address"),
            advertise_ip: None,
            endpoints: 2,
            connections_per_peer: 2,
            lanes_per_connection: 2,
            min_lane_bytes: 256 * 1024,
            max_concurrent_streams_per_connection: 1024,
            worker_threads: 2,
            initial_mtu_bytes: 1200,
            min_mtu_bytes: 1200,
            mtu_discovery_upper_bound_bytes: 1452,
            mtu_black_hole_cooldown_ms: 2000,
            disable_mtu_discovery: false,
            segmentation_offload: true,
            stream_window_bytes: 16 << 20,
            connection_window_bytes: 64 << 20,
            send_window_bytes: 64 << 20,
            congestion_controller: CongestionController::Cubic,
            cipher_suite: CipherSuite::Aes128gcm,
            initial_congestion_window_bytes: 0,
            idle_timeout_ms: 3000,
            keep_alive_interval_ms: 500,
            connect_timeout_ms: 5000,
            default_transfer_timeout_ms: 30_000,
            write_chunk_bytes: 256 * 1024,
            staging_pool_bytes: 64 << 20,
            socket_buffer_bytes: 4 << 20,
            malloc_trim_threshold_bytes: 0,
            stuck_after_ms: 3000,
            stuck_min_bytes_per_s: 0,
            stuck_below_best_percent: 10,
            max_segments_per_submit: 1 << 20,
            max_inflight_transfers: 65536,
            max_live_tickets: 65536,
            certificate_path: None,
            private_key_path: None,
            wire_version_override: None,
        }
    }
}

/// toml's report spans lines (it quotes the offending key); a log line wants one.
fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn invalid(key: &str, why: impl std::fmt::Display) -> PluginError {
    PluginError::new(ReasonCode::INVALID_ARGUMENT, format!("quic config: `{key}` {why}"))
}

fn check_range<T: PartialOrd + std::fmt::Display + Copy>(
    key: &str,
    value: T,
    min: T,
    max: T,
) -> Result<(), PluginError> {
    if value < min || value > max {
        return Err(invalid(key, format!("is {value}, must be within {min}..={max}")));
    }
    Ok(())
}

impl QuicConfig {
    /// The initial congestion window in force (see `initial_congestion_window_bytes`).
    pub fn effective_initial_congestion_window_bytes(&self) -> u64 {
        match self.initial_congestion_window_bytes {
            0 => (10 * self.initial_mtu_bytes as u64).max(14720),
            explicit => explicit,
        }
    }

    /// Parse and validate a TOML string; an empty string gives the defaults.
    // CONFORMANCE: HYGIENE-3 (a malformed config fails INVALID_ARGUMENT)
    pub fn parse(text: &str) -> Result<QuicConfig, PluginError> {
        let config: QuicConfig = toml::from_str(text).map_err(|e| {
            PluginError::new(ReasonCode::INVALID_ARGUMENT, format!("quic config: {}", one_line(&e.to_string())))
        })?;
        config.validate()?;
        Ok(config)
    }

    /// Check every limit; the error names the key.
    pub fn validate(&self) -> Result<(), PluginError> {
        check_range("endpoints", self.endpoints, 1, 16)?;
        check_range("connections_per_peer", self.connections_per_peer, 1, 16)?;
        check_range("lanes_per_connection", self.lanes_per_connection, 1, 64)?;
        check_range("min_lane_bytes", self.min_lane_bytes, 4096, u64::MAX)?;
        check_range("max_concurrent_streams_per_connection", self.max_concurrent_streams_per_connection, 16, 65536)?;
        if self.lanes_per_connection as u64 >= u64::from(self.max_concurrent_streams_per_connection) {
            return Err(invalid(
                "lanes_per_connection",
                format!(
                    "is {}, must be below max_concurrent_streams_per_connection ({}): the control stream needs one more",
                    self.lanes_per_connection, self.max_concurrent_streams_per_connection
                ),
            ));
        }
        check_range("worker_threads", self.worker_threads, 1, 64)?;
        check_range("initial_mtu_bytes", self.initial_mtu_bytes, 1200, 65527)?;
        check_range("mtu_discovery_upper_bound_bytes", self.mtu_discovery_upper_bound_bytes, 1200, 65527)?;
        check_range("min_mtu_bytes", self.min_mtu_bytes, 1200, MAX_MIN_MTU_BYTES)?;
        if self.min_mtu_bytes > self.initial_mtu_bytes {
            return Err(invalid(
                "min_mtu_bytes",
                format!("is {}, must be at most initial_mtu_bytes ({})", self.min_mtu_bytes, self.initial_mtu_bytes),
            ));
        }
        if self.mtu_discovery_upper_bound_bytes < self.initial_mtu_bytes {
            return Err(invalid(
                "mtu_discovery_upper_bound_bytes",
                format!(
                    "is {}, must be at least initial_mtu_bytes ({})",
                    self.mtu_discovery_upper_bound_bytes, self.initial_mtu_bytes
                ),
            ));
        }
        if self.segmentation_offload && self.mtu_discovery_upper_bound_bytes > MAX_GSO_DATAGRAM_BYTES {
            return Err(invalid(
                "segmentation_offload",
                format!(
                    "must be false when mtu_discovery_upper_bound_bytes ({}) exceeds {MAX_GSO_DATAGRAM_BYTES}: batches of large datagrams are lost",
                    self.mtu_discovery_upper_bound_bytes
                ),
            ));
        }
        check_range("mtu_black_hole_cooldown_ms", self.mtu_black_hole_cooldown_ms, 100, 3_600_000)?;
        check_range("stream_window_bytes", self.stream_window_bytes, 65536, 1 << 30)?;
        check_range("connection_window_bytes", self.connection_window_bytes, 65536, 1 << 32)?;
        check_range("send_window_bytes", self.send_window_bytes, 65536, 1 << 32)?;
        check_range("initial_congestion_window_bytes", self.initial_congestion_window_bytes, 0, 1 << 30)?;
        let two_datagrams = 2 * self.initial_mtu_bytes as u64;
        if self.initial_congestion_window_bytes != 0 && self.initial_congestion_window_bytes < two_datagrams {
            return Err(invalid(
                "initial_congestion_window_bytes",
                format!(
                    "is {}, must be 0 (automatic) or at least two initial_mtu_bytes datagrams ({two_datagrams})",
                    self.initial_congestion_window_bytes
                ),
            ));
        }
        check_range("idle_timeout_ms", self.idle_timeout_ms, 100, 600_000)?;
        check_range("keep_alive_interval_ms", self.keep_alive_interval_ms, 10, 60_000)?;
        if self.keep_alive_interval_ms >= self.idle_timeout_ms {
            return Err(invalid(
                "keep_alive_interval_ms",
                format!("is {}, must be below idle_timeout_ms ({})", self.keep_alive_interval_ms, self.idle_timeout_ms),
            ));
        }
        check_range("connect_timeout_ms", self.connect_timeout_ms, 100, 600_000)?;
        check_range("default_transfer_timeout_ms", self.default_transfer_timeout_ms, 1, 3_600_000)?;
        check_range("write_chunk_bytes", self.write_chunk_bytes, 4096, 16 << 20)?;
        check_range("staging_pool_bytes", self.staging_pool_bytes, 0, 1 << 32)?;
        check_range("socket_buffer_bytes", self.socket_buffer_bytes, 65536, 1 << 30)?;
        if self.malloc_trim_threshold_bytes != 0 {
            check_range(
                "malloc_trim_threshold_bytes",
                self.malloc_trim_threshold_bytes,
                MIN_MALLOC_TRIM_THRESHOLD_BYTES,
                MAX_MALLOC_TRIM_THRESHOLD_BYTES,
            )?;
            if !crate::allocator::TRIM_THRESHOLD_SUPPORTED {
                return Err(invalid(
                    "malloc_trim_threshold_bytes",
                    "is set, but this build does not use glibc's allocator",
                ));
            }
        }
        if self.stuck_after_ms != 0 {
            check_range("stuck_after_ms", self.stuck_after_ms, 100, 600_000)?;
        }
        check_range("stuck_min_bytes_per_s", self.stuck_min_bytes_per_s, 0, 1 << 40)?;
        check_range("stuck_below_best_percent", self.stuck_below_best_percent, 0, 100)?;
        check_range("max_segments_per_submit", self.max_segments_per_submit, 1, 1 << 24)?;
        check_range("max_inflight_transfers", self.max_inflight_transfers, 1, 1 << 24)?;
        check_range("max_live_tickets", self.max_live_tickets, 1, 1 << 24)?;
        match (&self.certificate_path, &self.private_key_path) {
            (Some(_), None) => return Err(invalid("private_key_path", "is missing while certificate_path is set")),
            (None, Some(_)) => return Err(invalid("certificate_path", "is missing while private_key_path is set")),
            _ => {}
        }
        Ok(())
    }
}
