//! Prometheus metrics (prometheus-client): the driver's own histograms and counters kept here, and a
//! text rendering that adds the core's plain-data `Metrics` and the room views of one snapshot.
//! Never influences an outcome: a metric that cannot be recorded is simply not recorded.

use crate::channels::AdminSnapshot;
use kvgate_core::{FailReason, HarmlessAbort, LateSource, Phase, RefusalReason, RoomState, Span, ViolationClause};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;

type Labels = Vec<(String, String)>;

fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

fn bytes_histogram() -> Histogram {
    // 64 KiB .. 64 GiB
    Histogram::new(exponential_buckets(65_536.0, 4.0, 11))
}

fn seconds_histogram() -> Histogram {
    // 100 us .. ~100 s
    Histogram::new(exponential_buckets(0.0001, 2.5, 16))
}

/// Metrics the gateway keeps itself (the core keeps the rest as plain data).
pub struct GatewayMetrics {
    transfer_bytes: Family<Labels, Histogram, fn() -> Histogram>,
    transfer_seconds: Family<Labels, Histogram, fn() -> Histogram>,
    bootstrap_seconds: Family<Labels, Histogram, fn() -> Histogram>,
    failures: Family<Labels, Counter>,
    stuck_rooms: Family<Labels, Counter>,
    peer_up: Family<Labels, Gauge>,
    /// Incremented from plugin threads when the driver's plugin event queue is full.
    pub plugin_events_dropped: Counter<u64, AtomicU64>,
    bad_peer_frames: Counter,
    /// Core messages sent to peers, alone or in batches, and the `CoreBatch` frames among the frames.
    peer_core_messages: Counter,
    peer_core_batches: Counter,
    discovery_registered: Gauge,
    discovery_errors: Family<Labels, Counter>,
    listener_connections: Family<Labels, Gauge>,
    listener_refused: Family<Labels, Counter>,
    /// Each plugin's three per-room histograms, looked up by name without building a label set
    /// (the families above hold the same series: a cached handle shares its family's storage).
    per_plugin: std::sync::RwLock<Vec<(Box<str>, PluginHistograms)>>,
}

/// The histograms observed once per room, for one plugin label.
#[derive(Clone)]
struct PluginHistograms {
    transfer_bytes: Histogram,
    transfer_seconds: Histogram,
    bootstrap_seconds: Histogram,
}

impl Default for GatewayMetrics {
    fn default() -> Self {
        GatewayMetrics {
            transfer_bytes: Family::new_with_constructor(bytes_histogram as fn() -> Histogram),
            transfer_seconds: Family::new_with_constructor(seconds_histogram as fn() -> Histogram),
            bootstrap_seconds: Family::new_with_constructor(seconds_histogram as fn() -> Histogram),
            failures: Family::default(),
            stuck_rooms: Family::default(),
            peer_up: Family::default(),
            plugin_events_dropped: Counter::default(),
            bad_peer_frames: Counter::default(),
            peer_core_messages: Counter::default(),
            peer_core_batches: Counter::default(),
            discovery_registered: Gauge::default(),
            discovery_errors: Family::default(),
            listener_connections: Family::default(),
            listener_refused: Family::default(),
            per_plugin: Default::default(),
        }
    }
}

fn seconds(n: Span) -> f64 {
    n.0 as f64 / 1e9
}

impl GatewayMetrics {
    pub fn observe_transfer(&self, plugin: &str, bytes: u64, elapsed: Span) {
        self.with_plugin(plugin, |h| {
            h.transfer_bytes.observe(bytes as f64);
            h.transfer_seconds.observe(seconds(elapsed));
        });
    }
    pub fn observe_bootstrap(&self, plugin: &str, elapsed: Span) {
        self.with_plugin(plugin, |h| h.bootstrap_seconds.observe(seconds(elapsed)));
    }

    /// Run `f` on `plugin`'s histograms, created in the families (and cached) on first use.
    fn with_plugin(&self, plugin: &str, f: impl FnOnce(&PluginHistograms)) {
        {
            let cached = self.per_plugin.read().unwrap_or_else(|e| e.into_inner());
            if let Some((_, h)) = cached.iter().find(|(name, _)| &**name == plugin) {
                return f(h);
            }
        }
        let label = labels(&[("plugin", plugin)]);
        let handles = PluginHistograms {
            transfer_bytes: self.transfer_bytes.get_or_create(&label).clone(),
            transfer_seconds: self.transfer_seconds.get_or_create(&label).clone(),
            bootstrap_seconds: self.bootstrap_seconds.get_or_create(&label).clone(),
        };
        f(&handles);
        self.per_plugin.write().unwrap_or_else(|e| e.into_inner()).push((plugin.into(), handles));
    }
    pub fn count_failure(&self, reason: &str, phase: &str, plugin: &str) {
        self.failures.get_or_create(&labels(&[("reason", reason), ("phase", phase), ("plugin", plugin)])).inc();
    }
    /// `rooms` more rooms found still live at the stuck-room warning age `age_ms`.
    pub fn count_stuck_rooms(&self, age_ms: u64, rooms: u64) {
        self.stuck_rooms.get_or_create(&labels(&[("age_ms", &age_ms.to_string())])).inc_by(rooms);
    }
    pub fn set_peer_up(&self, peer: &str, up: bool) {
        self.peer_up.get_or_create(&labels(&[("peer", peer)])).set(up as i64);
    }
    pub fn count_bad_peer_frame(&self) {
        self.bad_peer_frames.inc();
    }
    pub fn count_core_message(&self) {
        self.peer_core_messages.inc();
    }
    pub fn count_core_batches(&self, batches: u64) {
        if batches > 0 {
            self.peer_core_batches.inc_by(batches);
        }
    }
    /// Whether this gateway's discovery record is in etcd under a live lease.
    pub fn set_discovery_registered(&self, registered: bool) {
        self.discovery_registered.set(registered as i64);
    }
    pub fn count_discovery_error(&self, reason: &str) {
        self.discovery_errors.get_or_create(&labels(&[("reason", reason)])).inc();
    }

    /// A connection a listener refused or closed (`connection_limit`, `accept_error`,
    /// `handshake_timeout`, `idle_timeout`).
    pub fn count_listener_refusal(&self, listener: &str, reason: &str) {
        self.listener_refused.get_or_create(&labels(&[("listener", listener), ("reason", reason)])).inc();
    }
    pub fn listener_refusals(&self, listener: &str, reason: &str) -> u64 {
        self.listener_refused.get_or_create(&labels(&[("listener", listener), ("reason", reason)])).get()
    }
    /// `delta` connections opened (1) or closed (-1) on `listener`.
    pub fn listener_opened(&self, listener: &str, delta: i64) {
        self.listener_connections.get_or_create(&labels(&[("listener", listener)])).inc_by(delta);
    }

    /// The Prometheus text exposition of everything, for `/metrics`.
    pub fn render(&self, snapshot: &AdminSnapshot) -> String {
        let mut registry = Registry::with_prefix("kvgate");
        registry.register("transfer_bytes", "Bytes per succeeded room, by plugin", self.transfer_bytes.clone());
        registry.register(
            "transfer_seconds",
            "Time from first transfer to success, by plugin",
            self.transfer_seconds.clone(),
        );
        registry.register(
            "bootstrap_seconds",
            "Time from room creation to bytes moving, by plugin",
            self.bootstrap_seconds.clone(),
        );
        registry.register("room_failures", "Failed rooms by reason, phase and plugin", self.failures.clone());
        registry.register(
            "stuck_rooms",
            "Rooms found still live at each admin.stuck_room_warn_ms age, named in the log or not",
            self.stuck_rooms.clone(),
        );
        registry.register("peer_up", "1 while the peer link is up", self.peer_up.clone());
        registry.register(
            "plugin_events_dropped",
            "Plugin events dropped because driver.plugin_event_queue_len was full",
            self.plugin_events_dropped.clone(),
        );
        registry.register("bad_peer_frames", "Peer frames that could not be decoded", self.bad_peer_frames.clone());
        registry.register(
            "peer_core_messages",
            "Core messages sent to peers, alone or in CoreBatch frames",
            self.peer_core_messages.clone(),
        );
        registry.register(
            "peer_core_batches",
            "CoreBatch frames sent to peers (each several core messages)",
            self.peer_core_batches.clone(),
        );
        registry.register(
            "discovery_registered",
            "1 while this gateway's discovery record is in etcd under a live lease",
            self.discovery_registered.clone(),
        );
        let discovered =
            snapshot.peers.iter().filter(|p| p.source == crate::peer_link::PeerSource::Discovered.as_str()).count();
        registry.register(
            "discovery_peers",
            "Peers discovery added and still knows (withdrawn ones with a live link included)",
            gauge(discovered as i64),
        );
        registry.register(
            "discovery_errors",
            "Discovery failures by reason (etcd calls, records refused)",
            self.discovery_errors.clone(),
        );
        registry.register(
            "peer_tls_handshake_failures",
            "TLS handshakes that failed on the peer-link listener (wrong or no client certificate, not TLS at all)",
            counter(crate::logging::TLS_HANDSHAKE_FAILURES.load(std::sync::atomic::Ordering::Relaxed)),
        );
        registry.register(
            "listener_connections",
            "Connections open now, by listener (engine_api, peer_link, admin)",
            self.listener_connections.clone(),
        );
        registry.register("listener_refused", "Connections refused or closed by a listener: reason connection_limit, accept_error (e.g. out of descriptors), handshake_timeout, idle_timeout", self.listener_refused.clone());
        register_core(&mut registry, snapshot);
        let mut text = String::new();
        encode(&mut text, &registry).expect("writing to a String cannot fail");
        text
    }
}

fn counter(value: u64) -> Counter {
    let c = Counter::default();
    c.inc_by(value);
    c
}

fn gauge(value: i64) -> Gauge {
    let g = Gauge::default();
    g.set(value);
    g
}

fn register_core(registry: &mut Registry, snapshot: &AdminSnapshot) {
    let m = &snapshot.metrics;
    let rooms: Family<Labels, Gauge> = Family::default();
    let oldest: Family<Labels, Gauge<f64, AtomicU64>> = Family::default();
    for state in RoomState::ALL {
        rooms.get_or_create(&labels(&[("state", state.as_str())])).set(m.rooms_by_state[state.index()] as i64);
        let age = m.oldest_age(state, snapshot.now).map(seconds).unwrap_or(0.0);
        oldest.get_or_create(&labels(&[("state", state.as_str())])).set(age);
    }
    registry.register("rooms", "Rooms per state (terminal states include tombstones)", rooms);
    registry.register("oldest_room_age_seconds", "Age of the oldest room in each state", oldest);
    let mut live: BTreeMap<(String, String), i64> = BTreeMap::new();
    for room in &snapshot.rooms {
        *live.entry((room.state.to_string(), room.plugin.clone())).or_default() += 1;
    }
    let live_family: Family<Labels, Gauge> = Family::default();
    for ((state, plugin), n) in live {
        live_family.get_or_create(&labels(&[("state", &state), ("plugin", &plugin)])).set(n);
    }
    registry.register("live_rooms", "Non-terminal rooms per state and plugin", live_family);
    // One series per plugin instance (generation), 1 while it is open: an operator watches a
    // retired generation drain (live_rooms of its plugin label falls to 0) and close (state closed).
    let instances: Family<Labels, Gauge> = Family::default();
    for p in snapshot.plugins.iter().filter(|p| p.generation > 0) {
        let generation = p.generation.to_string();
        let open = i64::from(p.state != "closed");
        instances
            .get_or_create(&labels(&[("plugin", &p.name), ("generation", &generation), ("state", &p.state)]))
            .set(open);
    }
    registry.register(
        "plugin_instances",
        "Plugin instances by plugin, generation and state (active, draining, closed)",
        instances,
    );
    let failures: Family<Labels, Counter> = Family::default();
    for reason in FailReason::ALL {
        for phase in Phase::ALL {
            let n = m.failures[reason.index()][phase as usize];
            if n > 0 {
                failures.get_or_create(&labels(&[("reason", reason.as_str()), ("phase", phase.as_str())])).inc_by(n);
            }
        }
    }
    registry.register("core_failures", "Failures the core recorded, by reason and phase", failures);
    let refusals: Family<Labels, Counter> = Family::default();
    for reason in RefusalReason::ALL {
        refusals.get_or_create(&labels(&[("reason", reason.as_str())])).inc_by(m.refusal(*reason));
    }
    registry.register("refusals", "Engine requests refused, by reason", refusals);
    registry.register("aborts", "Engine aborts that ended a live room", counter(m.aborts));
    let harmless: Family<Labels, Counter> = Family::default();
    for kind in HarmlessAbort::ALL {
        harmless.get_or_create(&labels(&[("kind", kind.as_str())])).inc_by(m.aborts_harmless[kind.index()]);
    }
    registry.register("aborts_harmless", "Aborts that changed nothing", harmless);
    let violations: Family<Labels, Counter> = Family::default();
    for clause in ViolationClause::ALL {
        violations.get_or_create(&labels(&[("clause", clause.as_str())])).inc_by(m.violation(clause));
    }
    registry.register(
        "plugin_contract_violations",
        "Plugin contract violations seen by the core (expected 0)",
        violations,
    );
    let late: Family<Labels, Counter> = Family::default();
    for source in LateSource::ALL {
        late.get_or_create(&labels(&[("source", source.as_str())])).inc_by(m.late_messages[source.index()]);
    }
    registry.register("late_messages", "Late messages refused, by source", late);
    registry.register(
        "core_illegal_transitions",
        "Inputs a core transition table (room, transfer or ticket) refused (a core bug: expected 0)",
        counter(m.illegal_transitions),
    );
    registry.register("quarantined_bytes", "Bytes of memory quarantined now", gauge(m.quarantined_bytes as i64));
    registry.register("bytes_moved", "Bytes confirmed moved", counter(m.bytes_moved));
    registry.register("rooms_created", "Rooms created", counter(m.rooms_created));
    registry.register("rooms_succeeded", "Rooms succeeded", counter(m.rooms_succeeded));
    registry.register("tombstones", "Tombstones held now", gauge(m.tombstones as i64));
    registry.register("pending_sends", "Chunks held without an expect", gauge(m.pending_sends as i64));
    registry.register("healthy", "1 when /healthz is healthy", gauge(snapshot.problems.is_empty() as i64));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channels::{AdminSnapshot, RoomJson};

    fn snapshot() -> AdminSnapshot {
        let mut metrics = kvgate_core::Metrics::default();
        metrics.rooms_by_state[RoomState::Transferring.index()] = 3;
        metrics.oldest_entered_by_state[RoomState::Transferring.index()] =
            Some(kvgate_core::At::from_origin(Span::from_ms(500)));
        metrics.failures[FailReason::PeerLost.index()][Phase::Transfer as usize] = 2;
        metrics.quarantined_bytes = 4096;
        AdminSnapshot {
            now: kvgate_core::At::from_origin(Span::from_ms(2500)),
            metrics,
            rooms: vec![RoomJson {
                room: 1,
                generation: 0,
                role: "sender",
                state: "transferring",
                age_ms: 2000,
                peer: "decode".into(),
                plugin: "shm".into(),
                plugin_generation: 1,
                last_event: "Submitted".into(),
                last_event_age_ms: 1,
                parts: 2,
                parts_done: 1,
                bytes_total: 10,
                bytes_done: 5,
            }],
            plugins: vec![],
            peers: vec![],
            peer_link_auth: "psk",
            problems: vec!["plugin shm unhealthy".into()],
            warnings: vec![],
            last_reload: None,
        }
    }

    #[test]
    fn render_exposes_core_and_gateway_metrics_with_their_labels() {
        let m = GatewayMetrics::default();
        m.observe_transfer("shm", 1 << 20, Span::from_ms(3));
        m.count_failure("peer_lost", "transfer", "shm");
        m.set_peer_up("decode", true);
        m.listener_opened("admin", 1);
        m.count_listener_refusal("admin", "connection_limit");
        let text = m.render(&snapshot());
        for expected in [
            "kvgate_rooms{state=\"transferring\"} 3",
            "kvgate_oldest_room_age_seconds{state=\"transferring\"} 2.0",
            "kvgate_live_rooms{state=\"transferring\",plugin=\"shm\"} 1",
            "kvgate_core_failures_total{reason=\"peer_lost\",phase=\"transfer\"} 2",
            "kvgate_room_failures_total{reason=\"peer_lost\",phase=\"transfer\",plugin=\"shm\"} 1",
            "kvgate_quarantined_bytes 4096",
            "kvgate_peer_up{peer=\"decode\"} 1",
            "kvgate_transfer_bytes_count{plugin=\"shm\"} 1",
            "kvgate_plugin_contract_violations_total{clause=\"plugin_silent\"} 0",
            "kvgate_healthy 0",
        ] {
            assert!(text.contains(expected), "missing {expected} in\n{text}");
        }
    }

    #[test]
    fn cached_plugin_histograms_count_into_the_rendered_series() {
        let m = GatewayMetrics::default();
        for _ in 0..3 {
            m.observe_transfer("shm", 1 << 20, Span::from_ms(3));
            m.observe_bootstrap("shm", Span::from_ms(1));
        }
        m.observe_transfer("quic", 1 << 20, Span::from_ms(3));
        let text = m.render(&snapshot());
        for expected in [
            "kvgate_transfer_bytes_count{plugin=\"shm\"} 3",
            "kvgate_transfer_seconds_count{plugin=\"shm\"} 3",
            "kvgate_bootstrap_seconds_count{plugin=\"shm\"} 3",
            "kvgate_transfer_bytes_count{plugin=\"quic\"} 1",
        ] {
            assert!(text.contains(expected), "missing {expected} in\n{text}");
        }
    }

    #[test]
    fn every_metric_is_listed_in_the_gateway_readme() {
        let readme = include_str!("../README.md");
        let listed = &readme[readme.find("## Metrics").expect("a Metrics section")..];
        let listed = &listed[..listed[1..].find("\n## ").map_or(listed.len(), |i| i + 1)];
        // A labelled family is rendered only once it has a member: give each one.
        let m = GatewayMetrics::default();
        m.observe_transfer("shm", 1 << 20, Span::from_ms(3));
        m.observe_bootstrap("shm", Span::from_ms(1));
        m.count_failure("peer_lost", "transfer", "shm");
        m.count_stuck_rooms(5000, 1);
        m.set_peer_up("decode", true);
        m.listener_opened("admin", 1);
        m.count_listener_refusal("admin", "connection_limit");
        let text = m.render(&snapshot());
        let mut names = Vec::new();
        for line in text.lines().filter_map(|l| l.strip_prefix("# TYPE kvgate_")) {
            let (name, kind) = line.split_once(' ').expect("# TYPE name kind");
            // Counters are exposed (and listed) with their `_total` suffix.
            names.push(if kind == "counter" { format!("{name}_total") } else { name.to_string() });
        }
        assert!(names.len() >= 24, "too few metrics read: {names:?}");
        let missing: Vec<&String> = names
            .iter()
            .filter(|n| !listed.contains(&format!("`{n}`")) && !listed.contains(&format!("`{n}{{")))
            .collect();
        assert!(missing.is_empty(), "metrics missing from gateway/README.md's Metrics section: {missing:?}");
    }
}
