//! Checks every limit and cross-field rule of a loaded [`GatewayConfig`], reporting all problems at
//! once, each naming the key, the value and what is allowed. Never fixes a value silently.

use super::{GatewayConfig, PeerAuthMode, PeerTransport};
use std::fmt;
use std::net::SocketAddr;

/// One setting that is out of its allowed range or inconsistent with another.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LimitError {
    /// Dotted key path, e.g. `peer_link.heartbeat_interval_ms`.
    pub key: String,
    /// The value as configured.
    pub value: String,
    /// What is allowed, e.g. `10..=60000`.
    pub allowed: String,
}

impl fmt::Display for LimitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} = {} is not allowed (allowed: {})", self.key, self.value, self.allowed)
    }
}

/// `Some(error)` unless `min <= value <= max`.
pub fn check_range(key: &str, value: u64, min: u64, max: u64) -> Option<LimitError> {
    (value < min || value > max).then(|| LimitError {
        key: key.to_string(),
        value: value.to_string(),
        allowed: format!("{min}..={max}"),
    })
}

fn rule(key: &str, value: impl fmt::Display, allowed: &str) -> LimitError {
    LimitError { key: key.to_string(), value: value.to_string(), allowed: allowed.to_string() }
}

/// Every problem of `config`; empty when it is usable.
pub fn validate(config: &GatewayConfig) -> Vec<LimitError> {
    let mut errors = Vec::new();
    check_gateway_and_engine_api(config, &mut errors);
    check_peer_link(config, &mut errors);
    check_peers(config, &mut errors);
    check_discovery(config, &mut errors);
    check_plugins_driver_admin_log(config, &mut errors);
    // The scheduler's own ranges (kvgate-core's `CoreConfig::ranges`), every one reported; then its
    // cross-field rules through `CoreConfig::validate`.
    let scheduler = &config.scheduler;
    for (key, value, min, max) in scheduler.ranges() {
        errors.extend(check_range(&format!("scheduler.{key}"), value, min, max));
    }
    if let Err(e) = scheduler.validate() {
        let key = format!("scheduler.{}", e.key);
        if !errors.iter().any(|x| x.key == key) {
            errors.push(LimitError { key, value: e.value.to_string(), allowed: format!("{}..={}", e.min, e.max) });
        }
    }
    errors
}

fn check_gateway_and_engine_api(config: &GatewayConfig, errors: &mut Vec<LimitError>) {
    let name = &config.gateway.name;
    if name.is_empty() || name.len() > 64 || !name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
        errors.push(rule("gateway.name", format!("{name:?}"), "1 to 64 characters of [A-Za-z0-9._-]"));
    }
    let api = &config.engine_api;
    if api.unix_socket.is_empty() && api.tcp_listen.is_empty() {
        errors.push(rule("engine_api.unix_socket", "\"\"", "a socket path, or engine_api.tcp_listen set"));
    }
    if !api.tcp_listen.is_empty() {
        if api.tcp_listen.parse::<SocketAddr>().is_err() {
            errors.push(rule("engine_api.tcp_listen", format!("{:?}", api.tcp_listen), "an ip:port address"));
        }
        if api.bearer_token_file.is_empty() {
            errors.push(rule(
                "engine_api.bearer_token_file",
                "\"\"",
                "a token file whenever engine_api.tcp_listen is set",
            ));
        }
    }
    errors.extend(check_range("engine_api.max_regions", api.max_regions, 1, 1 << 20));
    errors.extend(check_range("engine_api.max_watchers", api.max_watchers, 1, 65_536));
    errors.extend(check_range("engine_api.max_watchers_per_connection", api.max_watchers_per_connection, 1, 65_536));
    errors.extend(check_range("engine_api.watch_buffer_events", api.watch_buffer_events, 16, 1 << 20));
    errors.extend(check_range("engine_api.watch_replay_events", api.watch_replay_events, 16, 1 << 24));
    errors.extend(check_range("engine_api.max_request_bytes", api.max_request_bytes, 4096, 1 << 30));
    errors.extend(check_range("engine_api.max_batch_calls", api.max_batch_calls, 1, 1 << 20));
    errors.extend(check_range("engine_api.session_grace_ms", api.session_grace_ms, 100, 3_600_000));
    errors.extend(check_range("engine_api.max_sessions", api.max_sessions, 1, 65_536));
    errors.extend(check_range("engine_api.max_text_bytes", api.max_text_bytes, 16, 65_536));
    errors.extend(check_range("engine_api.max_passed_fds", api.max_passed_fds, 1, 4096));
    errors.extend(check_range("engine_api.passed_fd_ttl_ms", api.passed_fd_ttl_ms, 100, 3_600_000));
    errors.extend(check_range("engine_api.lane_max_frame_bytes", api.lane_max_frame_bytes, 1024, 1 << 30));
    errors.extend(check_range("engine_api.lane_max_calls_in_flight", api.lane_max_calls_in_flight, 1, 1 << 20));
    errors.extend(check_range(
        "engine_api.lane_max_queued_reply_bytes",
        api.lane_max_queued_reply_bytes,
        64 * 1024,
        1 << 30,
    ));
    errors.extend(check_range(
        "engine_api.http2_max_pending_reset_streams",
        api.http2_max_pending_reset_streams,
        20,
        1 << 20,
    ));
    check_connections("engine_api", &api.connections, errors);
}

fn check_peer_link(config: &GatewayConfig, errors: &mut Vec<LimitError>) {
    let link = &config.peer_link;
    if link.listen.parse::<SocketAddr>().is_err() {
        errors.push(rule("peer_link.listen", format!("{:?}", link.listen), "an ip:port address"));
    }
    errors.extend(check_range("peer_link.heartbeat_interval_ms", link.heartbeat_interval_ms, 10, 60_000));
    errors.extend(check_range("peer_link.heartbeat_misses", link.heartbeat_misses, 2, 100));
    errors.extend(check_range("peer_link.connect_timeout_ms", link.connect_timeout_ms, 10, 120_000));
    errors.extend(check_range("peer_link.reconnect_interval_ms", link.reconnect_interval_ms, 10, 60_000));
    errors.extend(check_range("peer_link.send_queue_frames", link.send_queue_frames, 16, 1 << 24));
    errors.extend(check_range("peer_link.max_frame_bytes", link.max_frame_bytes, 1 << 20, 1 << 30));
    errors.extend(check_range("peer_link.frame_fragment_bytes", link.frame_fragment_bytes, 4 << 10, 16 << 20));
    errors.extend(check_range("peer_link.parked_outcomes", link.parked_outcomes, 0, 1 << 20));
    if config.engine_api.max_request_bytes > link.max_frame_bytes {
        errors.push(rule(
            "engine_api.max_request_bytes",
            config.engine_api.max_request_bytes.to_string(),
            &format!(
                "at most peer_link.max_frame_bytes = {} (an engine call may become one peer-link frame)",
                link.max_frame_bytes
            ),
        ));
    }
    if let Some(tls) = &link.tls {
        for (key, value) in [("cert_file", &tls.cert_file), ("key_file", &tls.key_file), ("ca_file", &tls.ca_file)] {
            if value.is_empty() {
                errors.push(rule(
                    &format!("peer_link.tls.{key}"),
                    "\"\"",
                    "a PEM file path (all three are needed for mutual TLS)",
                ));
            }
        }
    }
    check_connections("peer_link", &link.connections, errors);
    let two_heartbeats_ms = link.heartbeat_interval_ms.saturating_mul(2);
    if link.connections.idle_timeout_ms < two_heartbeats_ms {
        errors.push(rule(
            "peer_link.connections.idle_timeout_ms",
            link.connections.idle_timeout_ms,
            &format!("at least 2 x peer_link.heartbeat_interval_ms = {two_heartbeats_ms} (a live peer sends a heartbeat every interval)"),
        ));
    }
    check_peer_auth(config, errors);
}

/// The bounds of one listener's connections.
fn check_connections(section: &str, limits: &crate::config::ConnectionLimits, errors: &mut Vec<LimitError>) {
    errors.extend(check_range(&format!("{section}.connections.max_connections"), limits.max_connections, 1, 65_536));
    errors.extend(check_range(
        &format!("{section}.connections.handshake_timeout_ms"),
        limits.handshake_timeout_ms,
        100,
        600_000,
    ));
    errors.extend(check_range(
        &format!("{section}.connections.idle_timeout_ms"),
        limits.idle_timeout_ms,
        1_000,
        86_400_000,
    ));
}

/// The files a config names that must be usable before anything starts (`config check` and
/// `serve`; not the pure `validate`, which reads nothing).
pub fn check_files(config: &GatewayConfig) -> Vec<LimitError> {
    let mut errors = Vec::new();
    let link = &config.peer_link;
    if link.auth_mode() == PeerAuthMode::Psk && !link.psk_file.is_empty() {
        if let Err(e) = crate::peer_link::psk::Psk::load(std::path::Path::new(&link.psk_file)) {
            let allowed = format!(
                "a key file of mode 0600 owned by this user ({e:#}); make one with `kvgate keygen psk {}`",
                link.psk_file
            );
            errors.push(rule("peer_link.psk_file", format!("{:?}", link.psk_file), &allowed));
        }
    }
    errors
}

/// Peer links are authenticated unless the operator wrote `auth = "none"`, and never unauthenticated
/// on an address other hosts can reach.
fn check_peer_auth(config: &GatewayConfig, errors: &mut Vec<LimitError>) {
    let link = &config.peer_link;
    let has_peers = !config.peers.is_empty() || !config.discovery.etcd_endpoints.is_empty();
    match link.auth_mode() {
        PeerAuthMode::Psk => {
            if link.tls.is_some() {
                errors.push(rule(
                    "peer_link.auth",
                    "\"psk\"",
                    "\"tls\" when [peer_link.tls] is given (one authentication per link)",
                ));
            }
            if link.psk_file.is_empty() && has_peers {
                errors.push(rule(
                    "peer_link.psk_file",
                    "\"\"",
                    "a key file (make one with `kvgate keygen psk FILE`, the same file for every gateway of the deployment): \
                     peer links are authenticated by default; or peer_link.auth = \"tls\" with [peer_link.tls], \
                     or peer_link.auth = \"none\" to run them unauthenticated on loopback",
                ));
            }
        }
        PeerAuthMode::Tls => {
            if link.tls.is_none() {
                errors.push(rule(
                    "peer_link.auth",
                    "\"tls\"",
                    "\"tls\" only with [peer_link.tls] (cert_file, key_file, ca_file)",
                ));
            }
        }
        PeerAuthMode::None => {
            let reachable = link.listen.parse::<SocketAddr>().is_ok_and(|a| !a.ip().is_loopback());
            if reachable {
                errors.push(rule(
                    "peer_link.listen",
                    format!("{:?}", link.listen),
                    "a loopback address while peer_link.auth = \"none\" (an unauthenticated link must not be reachable from other hosts)",
                ));
            }
        }
    }
    if link.auth_mode() == PeerAuthMode::Tls && link.transport == Some(PeerTransport::Framed) {
        errors.push(rule(
            "peer_link.transport",
            "\"framed\"",
            "\"grpc\" (or unset) while peer_link.auth = \"tls\": framed links have no TLS yet",
        ));
    }
    if link.auth_mode() != PeerAuthMode::Psk && !link.psk_file.is_empty() {
        errors.push(rule(
            "peer_link.psk_file",
            format!("{:?}", link.psk_file),
            &format!("empty unless peer_link.auth = \"psk\" (it is {:?})", link.auth_mode().as_str()),
        ));
    }
}

fn check_peers(config: &GatewayConfig, errors: &mut Vec<LimitError>) {
    errors.extend(check_range("peers (count)", config.peers.len() as u64, 0, 1024));
    for (i, peer) in config.peers.iter().enumerate() {
        let at = format!("peers[{i}]");
        if peer.name.is_empty() || peer.name == config.gateway.name {
            errors.push(rule(
                &format!("{at}.name"),
                format!("{:?}", peer.name),
                "a non-empty name other than gateway.name",
            ));
        }
        if config.peers[..i].iter().any(|p| p.name == peer.name) {
            errors.push(rule(&format!("{at}.name"), format!("{:?}", peer.name), "a name not used by another peer"));
        }
        let valid_address =
            peer.address.rsplit_once(':').is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
        if !valid_address {
            errors.push(rule(&format!("{at}.address"), format!("{:?}", peer.address), "host:port"));
        }
    }
}

fn check_discovery(config: &GatewayConfig, errors: &mut Vec<LimitError>) {
    let d = &config.discovery;
    if d.etcd_endpoints.is_empty() {
        return;
    }
    errors.extend(check_range("discovery.etcd_endpoints (count)", d.etcd_endpoints.len() as u64, 1, 16));
    let scheme = if d.tls.is_some() { "https://" } else { "http://" };
    for (i, endpoint) in d.etcd_endpoints.iter().enumerate() {
        let valid = endpoint
            .strip_prefix(scheme)
            .is_some_and(|rest| rest.rsplit_once(':').is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok()));
        if !valid {
            let allowed = if d.tls.is_some() {
                "https://host:port (discovery.tls is set)"
            } else {
                "http://host:port (https:// needs discovery.tls)"
            };
            errors.push(rule(&format!("discovery.etcd_endpoints[{i}]"), format!("{endpoint:?}"), allowed));
        }
    }
    if d.username.is_empty() != d.password_file.is_empty() {
        let (key, value) = if d.username.is_empty() {
            ("discovery.username", &d.username)
        } else {
            ("discovery.password_file", &d.password_file)
        };
        errors.push(rule(key, format!("{value:?}"), "both discovery.username and discovery.password_file, or neither"));
    }
    if let Some(tls) = &d.tls {
        if tls.ca_file.is_empty() {
            errors.push(rule("discovery.tls.ca_file", "\"\"", "the PEM file of the CA that signed etcd's certificate"));
        }
        if tls.cert_file.is_empty() != tls.key_file.is_empty() {
            errors.push(rule(
                "discovery.tls.cert_file",
                format!("{:?}", tls.cert_file),
                "with discovery.tls.key_file, or neither (no client certificate)",
            ));
        }
    }
    if d.key_prefix.is_empty() || !d.key_prefix.ends_with('/') {
        errors.push(rule("discovery.key_prefix", format!("{:?}", d.key_prefix), "a non-empty prefix ending in /"));
    }
    errors.extend(check_range("discovery.lease_ttl_s", d.lease_ttl_s, 2, 600));
    errors.extend(check_range("discovery.request_timeout_ms", d.request_timeout_ms, 10, 60_000));
    errors.extend(check_range("discovery.retry_interval_ms", d.retry_interval_ms, 10, 60_000));
    errors.extend(check_range("discovery.max_peers", d.max_peers, 1, super::MAX_DISCOVERED_PEERS));
    // A member that stops answering is noticed a keep-alive period (a third of the lease) plus
    // request_timeout_ms after the last answer; the record must still be renewable after that.
    let lease_third_ms = d.lease_ttl_s.saturating_mul(1000) / 3;
    if d.request_timeout_ms > lease_third_ms {
        let allowed = format!("at most a third of discovery.lease_ttl_s ({lease_third_ms} ms): a member that stops answering must be left before the record expires");
        errors.push(rule("discovery.request_timeout_ms", d.request_timeout_ms, &allowed));
    }
    match d.advertise_address.is_empty() {
        true => {
            if config.peer_link.listen.parse::<SocketAddr>().is_ok_and(|a| a.ip().is_unspecified()) {
                errors.push(rule(
                    "discovery.advertise_address",
                    "\"\"",
                    "the address peers dial (required when peer_link.listen is a wildcard address)",
                ));
            }
        }
        false => {
            let valid =
                d.advertise_address.rsplit_once(':').is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok());
            if !valid {
                errors.push(rule("discovery.advertise_address", format!("{:?}", d.advertise_address), "host:port"));
            }
        }
    }
}

fn check_plugins_driver_admin_log(config: &GatewayConfig, errors: &mut Vec<LimitError>) {
    if config.plugins.preference.is_empty() {
        errors.push(rule("plugins.preference", "[]", "at least one plugin name"));
    }
    errors.extend(check_range("plugins.max_mapped_libraries", config.plugins.max_mapped_libraries, 1, 1024));
    errors.extend(check_range("plugins.drain_timeout_ms", config.plugins.drain_timeout_ms, 100, 86_400_000));
    errors.extend(check_range("plugins.restart_max_attempts", config.plugins.restart_max_attempts, 0, 100));
    errors.extend(check_range("plugins.restart_window_ms", config.plugins.restart_window_ms, 1_000, 86_400_000));
    errors.extend(check_range("plugins.restart_backoff_ms", config.plugins.restart_backoff_ms, 10, 600_000));
    errors.extend(check_range("driver.event_queue_len", config.driver.event_queue_len, 16, 1 << 20));
    errors.extend(check_range("driver.plugin_event_queue_len", config.driver.plugin_event_queue_len, 16, 1 << 24));
    errors.extend(check_range("driver.shutdown_grace_ms", config.driver.shutdown_grace_ms, 0, 60_000));
    errors.extend(check_range("driver.io_threads", config.driver.io_threads, 0, super::MAX_IO_THREADS));
    errors.extend(check_range("driver.stall_catch_up_ms", config.driver.stall_catch_up_ms, 0, 10_000));
    errors.extend(check_range("driver.inputs_per_step", config.driver.inputs_per_step, 1, super::MAX_INPUTS_PER_STEP));
    if !config.admin.listen.is_empty() && config.admin.listen.parse::<SocketAddr>().is_err() {
        errors.push(rule(
            "admin.listen",
            format!("{:?}", config.admin.listen),
            "an ip:port address, or empty to disable",
        ));
    }
    errors.extend(check_range("admin.stuck_room_warn_ms (count)", config.admin.stuck_room_warn_ms.len() as u64, 0, 16));
    for (i, age) in config.admin.stuck_room_warn_ms.iter().enumerate() {
        errors.extend(check_range(&format!("admin.stuck_room_warn_ms[{i}]"), *age, 100, 86_400_000));
    }
    errors.extend(check_range("admin.quarantine_unhealthy_ms", config.admin.quarantine_unhealthy_ms, 100, 86_400_000));
    errors.extend(check_range(
        "admin.stuck_room_warn_lines_per_s",
        config.admin.stuck_room_warn_lines_per_s,
        0,
        super::MAX_STUCK_ROOM_WARN_LINES_PER_S,
    ));
    check_connections("admin", &config.admin.connections, errors);
    if !["text", "json"].contains(&config.log.format.as_str()) {
        errors.push(rule("log.format", format!("{:?}", config.log.format), "\"text\" or \"json\""));
    }
    if let Err(why) = check_log_level(&config.log.level) {
        errors.push(rule("log.level", format!("{:?}", config.log.level), &why));
    }
}

/// Levels a `log.level` directive may name.
pub const LOG_LEVELS: [&str; 6] = ["trace", "debug", "info", "warn", "error", "off"];

/// A `log.level`: comma-separated directives, each a level (`info`) or `target=level`
/// (`kvgate::driver=debug`). Anything else (`warning`, `verbose`, an empty string) would be read by
/// the log filter as a target name with no level and silence the gateway: refused instead.
pub fn check_log_level(level: &str) -> Result<(), String> {
    let allowed = || format!("comma-separated directives, each one of {} or target=LEVEL", LOG_LEVELS.join("|"));
    if level.trim().is_empty() {
        return Err(allowed());
    }
    for directive in level.split(',').map(str::trim) {
        let (target, lvl) = match directive.rsplit_once('=') {
            Some((target, lvl)) => (Some(target.trim()), lvl.trim()),
            None => (None, directive),
        };
        let target_ok = target.is_none_or(|t| !t.is_empty() && !t.contains(char::is_whitespace));
        if !target_ok || !LOG_LEVELS.contains(&lvl.to_ascii_lowercase().as_str()) {
            return Err(format!("{} ({directive:?} is not)", allowed()));
        }
    }
    Ok(())
}
