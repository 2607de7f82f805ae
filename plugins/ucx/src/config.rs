//! The plugin's TOML configuration: UCX settings an operator needs and the plugin's own limits.
//! Owns parsing and validation (every error names its key); never touches UCX itself.

use kvgate_abi::{PluginError, ReasonCode};
use serde::Deserialize;
use std::collections::BTreeMap;

/// How bytes move to a peer.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum TransferMode {
    /// `put` when every configured transport has real one-sided put lanes (RDMA verbs), else `am`.
    #[default]
    Auto,
    /// One-sided `ucp_put_nbx` + `ucp_ep_flush_nbx`. The receiver enforces nothing.
    Put,
    /// Active messages; the receiver validates every segment against its tickets and acknowledges.
    Am,
}

/// The resolved mode of an instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResolvedMode {
    Put,
    Am,
}

/// Transports on which UCX 1.13 has real one-sided put lanes (RDMA verbs). Its TCP put collapses
/// above 1 MiB, and on shared memory (posix, sysv, cma) it has no RMA lane for user memory at all:
/// puts are emulated with active messages that need the receiver's progress, so `am` (which also
/// validates at the receiver) is as fast there and safer.
const PUT_FRIENDLY_TRANSPORTS: &[&str] =
    &["rc", "rc_v", "rc_x", "rc_mlx5", "rc_verbs", "dc", "dc_x", "dc_mlx5", "ud", "ud_v", "ud_x", "ud_mlx5", "ib"];

/// The `config` string of `open`, e.g. `tls = "tcp"\ndevices = "lo"\nmode = "am"`.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct UcxConfig {
    /// UCX transports (`UCX_TLS`), e.g. `"tcp"`, `"sm"`, `"posix,sysv,cma"`, `"rc,sm"`. Default: UCX's own (all).
    pub tls: Option<String>,
    /// Network devices (`UCX_NET_DEVICES`), e.g. `"lo"`, `"mlx5_0:1"`. Default: UCX's own (all).
    pub devices: Option<String>,
    /// Rendezvous threshold (`UCX_RNDV_THRESH`), e.g. `"8K"` or `"auto"`. Default: UCX's own.
    pub rndv_thresh: Option<String>,
    /// Keep-alive interval in milliseconds (`UCX_KEEPALIVE_INTERVAL`): how fast a silent dead peer is
    /// noticed on transports without a connection (shared memory). Default 1000; 1..=600000.
    pub keepalive_interval_ms: u64,
    /// Any further UCX setting, by its name without the `UCX_` prefix (`{ "TCP_SNDBUF" = "4M" }`).
    pub ucx_options: BTreeMap<String, String>,
    /// `auto`, `put` or `am`. Default `auto`.
    pub mode: TransferMode,
    /// Most live outgoing transfers; a submit past it fails `RESOURCE_EXHAUSTED`. Default 4096; 1..=1048576.
    pub max_inflight_transfers: u64,
    /// Most segments one submit may carry. Default 65536; 1..=1048576.
    pub max_segments_per_submit: u64,
    /// Most UCX operations one transfer keeps posted at once (the rest wait in its queue). Default 256; 1..=65536.
    pub max_posted_ops_per_transfer: u64,
    /// Most bytes of data messages (or puts) this instance keeps posted to UCX at once, over all its
    /// transfers; the rest wait in their transfers' queues (a message is posted whatever its size when
    /// nothing is posted). It bounds the work one `ucp_worker_progress` call can do: over TCP, UCX
    /// sends a posted message's fragments inside the progress call that takes its receiver's go-ahead,
    /// for as long as the socket takes them, so with 1.6 GiB posted one call ran 340 ms and every
    /// cancel queued behind it waited that long. Default 33554432 (32 MiB); 1..=1099511627776.
    pub max_posted_bytes: u64,
    /// Most live incoming tickets. Default 65536; 1..=1048576.
    pub max_live_tickets: u64,
    /// How long the progress thread keeps polling after its last activity while operations are in flight,
    /// before it sleeps on the worker's event fd. Default 200; 0..=100000.
    pub busy_poll_us: u64,
    /// After a cancel or failure, how long the peer may take to confirm that nothing more can land
    /// before a warning is logged (the transfer stays unquiesced until the peer answers or dies: closing
    /// the endpoint would not stop bytes already in its buffers). Default 2000; 1..=600000.
    pub quiesce_timeout_ms: u64,
    /// How long `shutdown` waits for receivers to confirm that the transfers it cancels can land nothing
    /// more (those are reported `QUIESCED` before it returns; the rest end `FAILED` without it). Goodbye
    /// messages and endpoint closes get their own small fixed bounds after it. Default 500; 0..=60000.
    pub shutdown_grace_ms: u64,
    /// Most bytes one joined message may carry: segments that continue each other are joined while the
    /// sum stays at or under it (a longer segment alone is sent as it is); a cancel waits at most for
    /// the joined message in flight. 0 turns joining off. Default 4194304 (4 MiB); 0..=1073741824.
    pub join_segments_max_bytes: u64,
    /// How many finished incoming transfers one reply message may answer. While a burst of incoming
    /// writes is being taken, a transfer's reply waits until this many are due, or until no other
    /// write is still landing, or until the burst ends (at most 64 progress rounds), whichever comes
    /// first; its sender sees `SUCCEEDED` that much later. 1 answers every transfer on its own.
    /// Default 2; 1..=64 (the most replies one message carries).
    pub reply_batch_transfers: u64,
    /// How long `deregister` waits for the UCX requests still reading or writing the region (a send
    /// whose endpoint is being torn down, a rendezvous receive) to be handed back before it returns.
    /// Past it the region is quarantined: the plugin keeps its UCX registration until the last of those
    /// requests completes, and `deregister` fails `TRANSPORT_ERROR` so that the host keeps the memory
    /// mapped. It never waits on the network: requests on a live endpoint end at the pace of the peer,
    /// so the bound stays under the host's call bound. Default 50; 0..=60000.
    pub deregister_wait_ms: u64,
    /// How long an endpoint stays open after the host disconnected the last peer id using it (UCX
    /// having reported no failure), for a `connect` to the same remote instance to take it up again:
    /// a gateway whose peer link dropped and came back reconnects the same instance, and over TCP a
    /// black-holed connection resumes once the network does. Closing it and creating a second
    /// endpoint to the same remote worker instead crashed UCX 1.13's TCP transport (README, Requests,
    /// endpoints and memory). An endpoint UCX reports failed is closed at once, whatever this says;
    /// 0 closes at every disconnect. Default 30000; 0..=3600000.
    pub endpoint_linger_ms: u64,
}

impl Default for UcxConfig {
    fn default() -> Self {
        UcxConfig {
            tls: None,
            devices: None,
            rndv_thresh: None,
            keepalive_interval_ms: 1000,
            ucx_options: BTreeMap::new(),
            mode: TransferMode::Auto,
            max_inflight_transfers: 4096,
            max_segments_per_submit: 65536,
            max_posted_ops_per_transfer: 256,
            max_posted_bytes: 32 << 20,
            max_live_tickets: 65536,
            busy_poll_us: 200,
            quiesce_timeout_ms: 2000,
            shutdown_grace_ms: 500,
            join_segments_max_bytes: 4 << 20,
            reply_batch_transfers: 2,
            deregister_wait_ms: 50,
            endpoint_linger_ms: 30_000,
        }
    }
}

fn invalid(message: String) -> PluginError {
    tracing::warn!(reason = "invalid_argument", "ucx plugin config refused: {message}");
    PluginError::new(ReasonCode::INVALID_ARGUMENT, message)
}

fn check_range(key: &str, value: u64, min: u64, max: u64) -> Result<(), PluginError> {
    if value < min || value > max {
        return Err(invalid(format!("ucx config: `{key}` = {value} is outside {min}..={max}")));
    }
    Ok(())
}

impl UcxConfig {
    /// Parse and validate. Errors are `INVALID_ARGUMENT` and name the key.
    pub fn parse(text: &str) -> Result<UcxConfig, PluginError> {
        let config: UcxConfig = toml::from_str(text).map_err(|e| invalid(format!("ucx config: {e}")))?;
        config.validate()?;
        Ok(config)
    }

    pub fn validate(&self) -> Result<(), PluginError> {
        check_range("keepalive_interval_ms", self.keepalive_interval_ms, 1, 600_000)?;
        check_range("max_inflight_transfers", self.max_inflight_transfers, 1, 1 << 20)?;
        check_range("max_segments_per_submit", self.max_segments_per_submit, 1, 1 << 20)?;
        check_range("max_posted_ops_per_transfer", self.max_posted_ops_per_transfer, 1, 65536)?;
        check_range("max_posted_bytes", self.max_posted_bytes, 1, 1 << 40)?;
        check_range("max_live_tickets", self.max_live_tickets, 1, 1 << 20)?;
        check_range("busy_poll_us", self.busy_poll_us, 0, 100_000)?;
        check_range("quiesce_timeout_ms", self.quiesce_timeout_ms, 1, 600_000)?;
        check_range("shutdown_grace_ms", self.shutdown_grace_ms, 0, 60_000)?;
        check_range("join_segments_max_bytes", self.join_segments_max_bytes, 0, 1 << 30)?;
        check_range("deregister_wait_ms", self.deregister_wait_ms, 0, 60_000)?;
        check_range("endpoint_linger_ms", self.endpoint_linger_ms, 0, 3_600_000)?;
        check_range(
            "reply_batch_transfers",
            self.reply_batch_transfers,
            1,
            crate::wire::MAX_REPLIES_PER_MESSAGE as u64,
        )?;
        for (key, value) in [("tls", &self.tls), ("devices", &self.devices), ("rndv_thresh", &self.rndv_thresh)] {
            if let Some(v) = value {
                if v.trim().is_empty() || v.contains('\0') {
                    return Err(invalid(format!("ucx config: `{key}` must be a non-empty string")));
                }
            }
        }
        for (name, value) in &self.ucx_options {
            let valid_name =
                !name.is_empty() && name.chars().all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
            if !valid_name || name.starts_with("UCX_") {
                return Err(invalid(format!(
                    "ucx config: `ucx_options.{name}` must be an upper-case UCX setting name without the UCX_ prefix"
                )));
            }
            if value.contains('\0') {
                return Err(invalid(format!("ucx config: `ucx_options.{name}` contains a NUL byte")));
            }
        }
        Ok(())
    }

    /// The (UCX name, value) pairs handed to `ucp_config_modify`, in order; the key each came from.
    pub fn ucx_settings(&self) -> Vec<(String, String, String)> {
        let mut settings = Vec::new();
        if let Some(v) = &self.tls {
            settings.push(("TLS".into(), v.clone(), "tls".into()));
        }
        if let Some(v) = &self.devices {
            settings.push(("NET_DEVICES".into(), v.clone(), "devices".into()));
        }
        if let Some(v) = &self.rndv_thresh {
            settings.push(("RNDV_THRESH".into(), v.clone(), "rndv_thresh".into()));
        }
        settings.push((
            "KEEPALIVE_INTERVAL".into(),
            format!("{}ms", self.keepalive_interval_ms),
            "keepalive_interval_ms".into(),
        ));
        for (name, value) in &self.ucx_options {
            settings.push((name.clone(), value.clone(), format!("ucx_options.{name}")));
        }
        settings
    }

    /// Whether every configured transport is shared memory (UCX 1.13 offers no peer-failure handling
    /// there, so endpoints are created without it and peer death is caught by deadlines and goodbyes).
    pub fn shared_memory_only(&self) -> bool {
        const SHM: &[&str] = &["sm", "shm", "posix", "sysv", "cma", "knem", "xpmem", "self", "mm"];
        self.tls.as_deref().is_some_and(|tls| {
            !tls.trim_start().starts_with('^')
                && tls.split(',').all(|t| SHM.contains(&t.trim().to_ascii_lowercase().as_str()))
        })
    }

    /// `put` or `am` for this instance. `auto` picks `put` only when every configured transport is an
    /// RDMA one (see `PUT_FRIENDLY_TRANSPORTS`; with UCX's default "all" a peer may end up on TCP, so
    /// `auto` stays on `am` there).
    pub fn resolved_mode(&self) -> ResolvedMode {
        match self.mode {
            TransferMode::Put => ResolvedMode::Put,
            TransferMode::Am => ResolvedMode::Am,
            TransferMode::Auto => {
                let Some(tls) = &self.tls else { return ResolvedMode::Am };
                let all_put_friendly = tls
                    .split(',')
                    .map(|t| t.trim().trim_start_matches('^').to_ascii_lowercase())
                    .all(|t| PUT_FRIENDLY_TRANSPORTS.contains(&t.as_str()));
                if all_put_friendly && !tls.trim_start().starts_with('^') {
                    ResolvedMode::Put
                } else {
                    ResolvedMode::Am
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_parse_from_empty_text() {
        let c = UcxConfig::parse("").unwrap();
        assert_eq!(c, UcxConfig::default());
        assert_eq!(c.resolved_mode(), ResolvedMode::Am);
    }

    #[test]
    fn unknown_key_is_refused_by_name() {
        let e = UcxConfig::parse("tlss = \"tcp\"").unwrap_err();
        assert_eq!(e.code, ReasonCode::INVALID_ARGUMENT);
        assert!(e.message.contains("tlss"), "{}", e.message);
    }

    #[test]
    fn wrong_type_names_the_key() {
        let e = UcxConfig::parse("max_inflight_transfers = \"many\"").unwrap_err();
        assert!(e.message.contains("max_inflight_transfers"), "{}", e.message);
        let e = UcxConfig::parse("mode = \"fast\"").unwrap_err();
        assert!(e.message.contains("mode") || e.message.contains("fast"), "{}", e.message);
    }

    #[test]
    fn limits_at_and_just_past_their_bounds() {
        let cases: &[(&str, u64, u64)] = &[
            ("keepalive_interval_ms", 1, 600_000),
            ("max_inflight_transfers", 1, 1 << 20),
            ("max_segments_per_submit", 1, 1 << 20),
            ("max_posted_ops_per_transfer", 1, 65536),
            ("max_posted_bytes", 1, 1 << 40),
            ("max_live_tickets", 1, 1 << 20),
            ("busy_poll_us", 0, 100_000),
            ("quiesce_timeout_ms", 1, 600_000),
            ("shutdown_grace_ms", 0, 60_000),
            ("join_segments_max_bytes", 0, 1 << 30),
            ("reply_batch_transfers", 1, 64),
            ("deregister_wait_ms", 0, 60_000),
            ("endpoint_linger_ms", 0, 3_600_000),
        ];
        for &(key, min, max) in cases {
            assert!(UcxConfig::parse(&format!("{key} = {min}")).is_ok(), "{key} at min");
            assert!(UcxConfig::parse(&format!("{key} = {max}")).is_ok(), "{key} at max");
            let e = UcxConfig::parse(&format!("{key} = {}", max + 1)).unwrap_err();
            assert!(e.message.contains(key), "{}", e.message);
            if min > 0 {
                let e = UcxConfig::parse(&format!("{key} = {}", min - 1)).unwrap_err();
                assert!(e.message.contains(key), "{}", e.message);
            }
        }
    }

    #[test]
    fn auto_mode_follows_the_transports() {
        let mode = |tls: &str| UcxConfig::parse(&format!("tls = \"{tls}\"")).unwrap().resolved_mode();
        assert_eq!(mode("rc"), ResolvedMode::Put);
        assert_eq!(mode("rc_mlx5,dc_mlx5"), ResolvedMode::Put);
        assert_eq!(mode("sm"), ResolvedMode::Am);
        assert_eq!(mode("posix,sysv,cma"), ResolvedMode::Am);
        assert_eq!(mode("rc,sm"), ResolvedMode::Am);
        assert_eq!(mode("tcp"), ResolvedMode::Am);
        assert_eq!(mode("sm,tcp"), ResolvedMode::Am);
        assert_eq!(mode("^tcp"), ResolvedMode::Am);
        let forced = UcxConfig::parse("tls = \"tcp\"\nmode = \"put\"").unwrap();
        assert_eq!(forced.resolved_mode(), ResolvedMode::Put);
    }

    #[test]
    fn ucx_options_names_are_checked() {
        assert!(UcxConfig::parse("[ucx_options]\nTCP_SNDBUF = \"4M\"").is_ok());
        let e = UcxConfig::parse("[ucx_options]\nUCX_TLS = \"tcp\"").unwrap_err();
        assert!(e.message.contains("ucx_options.UCX_TLS"), "{}", e.message);
        let e = UcxConfig::parse("[ucx_options]\ntcp_sndbuf = \"4M\"").unwrap_err();
        assert!(e.message.contains("ucx_options.tcp_sndbuf"), "{}", e.message);
    }
}
