//! Peer discovery through etcd (`[discovery]`): registers this gateway as `<key_prefix><name>` under a
//! lease it keeps alive, reads the prefix, then watches it, adding each peer it finds to the
//! [`PeerDirectory`] (which starts its link) and withdrawing those whose record goes. Every failure is
//! logged with its reason code and counted (`kvgate_discovery_errors_total{reason}`), then retried
//! after `retry_interval_ms` from a fresh connection and a fresh lease. Never ends a live link: a peer
//! whose record expired keeps its link until heartbeats say it is gone, so an etcd outage does not
//! stop traffic between gateways that already know each other.

use crate::config::{DiscoverySection, GatewayConfig, PeerEntry};
use crate::metrics::GatewayMetrics;
use crate::peer_link::{LocalIdentity, PeerLinks, Upsert};
use anyhow::Context;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, KeyValue, PutOptions, Txn, TxnOp, TxnOpResponse,
    WatchOptions,
};
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// What a gateway publishes about itself: enough for a peer to dial it and check its certificate.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct Record {
    pub name: String,
    /// Its peer-link address, `host:port`.
    pub address: String,
    /// The name in its TLS certificate; empty: the host part of `address`.
    #[serde(default)]
    pub tls_name: String,
    /// Its host name: a peer with the same one may use same-host plugins with it.
    #[serde(default)]
    pub host: String,
    #[serde(default)]
    pub incarnation: u64,
}

impl Record {
    /// The peer entry this record gives a gateway on `local_host`, or why the record is unusable.
    pub fn to_peer(&self, key_name: &str, local_host: &str) -> Result<PeerEntry, String> {
        if self.name != key_name {
            return Err(format!("the record names {:?} but sits under the key of {key_name:?}", self.name));
        }
        let valid_address =
            self.address.rsplit_once(':').is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
        if !valid_address {
            return Err(format!("address {:?} is not host:port", self.address));
        }
        Ok(PeerEntry {
            name: self.name.clone(),
            address: self.address.clone(),
            same_host: !self.host.is_empty() && self.host == local_host,
            tls_name: self.tls_name.clone(),
        })
    }
}

/// What the admin `/discovery` shows: this gateway's registration as it stands now.
#[derive(Clone, Debug, Default, Serialize)]
pub struct DiscoveryView {
    /// Whether `[discovery]` is configured at all.
    pub enabled: bool,
    pub registered: bool,
    /// This gateway's key, `<key_prefix><gateway.name>`.
    pub key: String,
    /// The etcd member the current session talks to (or last tried).
    pub endpoint: String,
    /// The lease of the record; 0 while unregistered.
    pub lease_id: i64,
    /// When this session registered, Unix milliseconds; 0 while unregistered.
    pub registered_at_unix_ms: u64,
    /// The last failure: reason code, what happened, through which member, when.
    pub last_error: Option<LastError>,
}

#[derive(Clone, Debug, Serialize)]
pub struct LastError {
    pub reason: &'static str,
    pub detail: String,
    pub endpoint: String,
    pub at_unix_ms: u64,
}

/// Shared between the discovery task (writes) and the admin listener (reads).
pub type DiscoveryStatus = Arc<Mutex<DiscoveryView>>;

fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// A failure with its reason code (the `reason` label and log field).
#[derive(Debug)]
pub struct DiscoveryError {
    pub reason: &'static str,
    pub detail: String,
}

fn failed(reason: &'static str, detail: impl Into<String>) -> DiscoveryError {
    DiscoveryError { reason, detail: detail.into() }
}

/// `etcd_tls_failed` for a TLS handshake either side refused (certificate, alert),
/// `etcd_unreachable` for a failure to reach etcd at all (no connection, etcd unavailable),
/// `etcd_auth_failed` for a refused user, password or permission, else `reason`.
fn classify(e: &etcd_client::Error, reason: &'static str) -> &'static str {
    use tonic::Code;
    // rustls' errors reach here only as text: tokio-rustls hands hyper an io::Error holding the
    // rustls error's message, not the error itself, so no downcast finds it.
    let text = format!("{e:?}").to_ascii_lowercase();
    if ["certificate", "received fatal alert", "handshake"].iter().any(|m| text.contains(m)) {
        return "etcd_tls_failed";
    }
    match e {
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => "etcd_unreachable",
        etcd_client::Error::GRpcStatus(status) => match status.code() {
            Code::Unavailable => "etcd_unreachable",
            Code::Unauthenticated | Code::PermissionDenied => "etcd_auth_failed",
            Code::InvalidArgument if status.message().contains("authentication failed") => "etcd_auth_failed",
            _ => reason,
        },
        _ => reason,
    }
}

/// How to reach etcd: timeouts, the user and password (read from `password_file`), TLS material.
/// Read once at start-up, so that a missing file stops the gateway with the key that names it.
pub fn connect_options(d: &DiscoverySection) -> anyhow::Result<ConnectOptions> {
    let limit = Duration::from_millis(d.request_timeout_ms);
    let mut options = ConnectOptions::new().with_connect_timeout(limit).with_timeout(limit);
    if !d.username.is_empty() {
        let text = std::fs::read_to_string(&d.password_file)
            .with_context(|| format!("discovery.password_file: cannot read {}", d.password_file))?;
        let password = text.strip_suffix('\n').unwrap_or(&text);
        anyhow::ensure!(!password.is_empty(), "discovery.password_file: {} is empty", d.password_file);
        options = options.with_user(d.username.clone(), password);
    }
    if let Some(tls) = &d.tls {
        let read = |key: &str, path: &str| {
            std::fs::read(path).with_context(|| format!("discovery.tls.{key}: cannot read {path}"))
        };
        let mut config = tonic::transport::ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(read("ca_file", &tls.ca_file)?));
        if !tls.cert_file.is_empty() {
            config = config.identity(tonic::transport::Identity::from_pem(
                read("cert_file", &tls.cert_file)?,
                read("key_file", &tls.key_file)?,
            ));
        }
        options = options.with_tls(config);
    }
    Ok(options)
}

/// Runs `call` for at most `limit`; a failed call is a `reason` failure naming `what` (unless
/// `classify` finds a more precise reason), a late one `etcd_unreachable`.
async fn bounded<T>(
    limit: Duration,
    reason: &'static str,
    what: &str,
    call: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, DiscoveryError> {
    match tokio::time::timeout(limit, call).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(failed(classify(&e, reason), format!("{what}: {e}"))),
        Err(_) => Err(failed(
            "etcd_unreachable",
            format!("{what}: no answer within discovery.request_timeout_ms ({} ms)", limit.as_millis()),
        )),
    }
}

/// `record_lost` when an event on this gateway's own key is not its own write: the record was deleted,
/// or overwritten under another lease, while this gateway's lease was live (peers can no longer find
/// it as it is; registering again restores it, or finds who holds the name).
fn own_record_lost(kind: EventType, kv: &KeyValue, lease: i64, own_key: &str) -> Option<DiscoveryError> {
    match kind {
        EventType::Put if kv.lease() == lease => None,
        EventType::Put => Some(failed(
            "record_lost",
            format!("{own_key} was overwritten by another writer (lease {} instead of {lease})", kv.lease()),
        )),
        EventType::Delete => Some(failed("record_lost", format!("{own_key} was deleted while its lease was live"))),
    }
}

/// Resolves once `stop` is true (the watch guard is dropped here, so callers' futures stay `Send`).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// The discovery task of one gateway.
pub struct Discovery {
    pub config: Arc<GatewayConfig>,
    /// From [`connect_options`].
    pub options: ConnectOptions,
    pub identity: Arc<LocalIdentity>,
    pub links: PeerLinks,
    pub metrics: Arc<GatewayMetrics>,
    /// What `/discovery` shows.
    pub status: DiscoveryStatus,
}

impl Discovery {
    fn update(&self, change: impl FnOnce(&mut DiscoveryView)) {
        change(&mut self.status.lock().unwrap_or_else(|e| e.into_inner()));
    }

    /// Registered under `lease`, or (`None`) not registered: in the metric and in `/discovery`.
    fn set_registered(&self, lease: Option<i64>) {
        self.metrics.set_discovery_registered(lease.is_some());
        let since = lease.map_or(0, |_| unix_ms());
        self.update(|v| {
            (v.registered, v.lease_id, v.registered_at_unix_ms) = (lease.is_some(), lease.unwrap_or(0), since)
        });
    }

    fn key_of(&self, name: &str) -> String {
        format!("{}{name}", self.config.discovery.key_prefix)
    }

    fn own_record(&self) -> Record {
        let d = &self.config.discovery;
        let address = if d.advertise_address.is_empty() {
            self.config.peer_link.listen.clone()
        } else {
            d.advertise_address.clone()
        };
        Record {
            name: self.identity.name.clone(),
            address,
            tls_name: d.tls_name.clone(),
            host: self.identity.host.clone(),
            incarnation: self.identity.incarnation,
        }
    }

    /// Runs until `stop` turns true: then revokes this gateway's lease, so that peers see it leave at once.
    /// Each session talks to one endpoint; after a failed session the next one dials the next
    /// endpoint in the list, so a dead or cut-off member costs one session, not every one (a client
    /// balancing over all endpoints would keep sending some calls to the dead member).
    pub async fn run(self, mut stop: watch::Receiver<bool>) {
        let d = &self.config.discovery;
        let retry = Duration::from_millis(d.retry_interval_ms);
        for attempt in 0usize.. {
            let endpoint = &d.etcd_endpoints[attempt % d.etcd_endpoints.len()];
            self.update(|v| {
                (v.enabled, v.key, v.endpoint) = (true, self.key_of(&self.identity.name), endpoint.clone())
            });
            let outcome = self.session(endpoint, &mut stop).await;
            self.set_registered(None);
            let Err(e) = outcome else { return };
            self.metrics.count_discovery_error(e.reason);
            let last = LastError {
                reason: e.reason,
                detail: e.detail.clone(),
                endpoint: endpoint.clone(),
                at_unix_ms: unix_ms(),
            };
            self.update(|v| v.last_error = Some(last));
            tracing::warn!(reason = e.reason, endpoint = %endpoint, "discovery: {}; again in {} ms, through the next endpoint", e.detail, retry.as_millis());
            tokio::select! {
                _ = tokio::time::sleep(retry) => {}
                _ = stopped(&mut stop) => return,
            }
        }
    }

    /// One connection to `endpoint` and one lease: register, read the peers, follow them. `Ok` when stopped.
    async fn session(&self, endpoint: &str, stop: &mut watch::Receiver<bool>) -> Result<(), DiscoveryError> {
        let d = &self.config.discovery;
        let limit = Duration::from_millis(d.request_timeout_ms);
        let ttl = Duration::from_secs(d.lease_ttl_s);
        let mut client =
            bounded(limit, "etcd_unreachable", "connect", Client::connect([endpoint], Some(self.options.clone())))
                .await?;
        let lease =
            bounded(limit, "etcd_request_failed", "lease grant", client.lease_grant(d.lease_ttl_s as i64, None))
                .await?
                .id();
        self.register(&mut client, lease, limit).await?;
        self.set_registered(Some(lease));
        let own_key = self.key_of(&self.identity.name);
        tracing::info!(key = %own_key, %endpoint, lease_ttl_s = d.lease_ttl_s, "discovery: registered");
        let (mut keeper, mut acks) =
            bounded(limit, "etcd_request_failed", "lease keep-alive", client.lease_keep_alive(lease)).await?;
        let snapshot = bounded(
            limit,
            "etcd_request_failed",
            "read peers",
            client.get(d.key_prefix.as_str(), Some(GetOptions::new().with_prefix())),
        )
        .await?;
        let revision = snapshot.header().map_or(0, |h| h.revision());
        self.apply_snapshot(snapshot.kvs());
        let watch_options = WatchOptions::new().with_prefix().with_start_revision(revision + 1);
        let mut changes = bounded(
            limit,
            "etcd_request_failed",
            "watch peers",
            client.watch(d.key_prefix.as_str(), Some(watch_options)),
        )
        .await?;
        let mut renew = tokio::time::interval(ttl / 3);
        let mut last_ack = Instant::now();
        // When the oldest keep-alive still unanswered was sent: a member that stops answering (frozen,
        // or cut off from the leader) is left after request_timeout_ms, well before the lease it no
        // longer renews can run out on the other members.
        let mut unanswered_since: Option<Instant> = None;
        let outcome = loop {
            let lease_due = last_ack + ttl;
            let answer_due = unanswered_since.map(|sent| sent + limit);
            tokio::select! {
                _ = stopped(stop) => break Ok(()),
                _ = renew.tick() => {
                    if let Err(e) = bounded(limit, "etcd_request_failed", "lease keep-alive", keeper.keep_alive()).await {
                        break Err(e);
                    }
                    unanswered_since.get_or_insert_with(Instant::now);
                }
                ack = acks.message() => match ack {
                    Ok(Some(answer)) if answer.ttl() > 0 => (last_ack, unanswered_since) = (Instant::now(), None),
                    Ok(Some(_)) => break Err(failed("lease_expired", format!("etcd says the lease of {own_key} has expired"))),
                    Ok(None) => break Err(failed("etcd_request_failed", "the lease keep-alive stream closed")),
                    Err(e) => break Err(failed(classify(&e, "etcd_request_failed"), format!("lease keep-alive: {e}"))),
                },
                _ = tokio::time::sleep_until(answer_due.map_or(lease_due, |due| due.min(lease_due))) => {
                    if answer_due.is_some_and(|due| due < lease_due) {
                        break Err(failed("etcd_unreachable", format!("{endpoint} did not answer a lease keep-alive within discovery.request_timeout_ms ({} ms)", limit.as_millis())));
                    }
                    break Err(failed("lease_expired", format!("no keep-alive answer for discovery.lease_ttl_s ({} s): {own_key} may be gone", d.lease_ttl_s)));
                }
                message = changes.message() => match message {
                    Ok(Some(response)) if response.canceled() => {
                        break Err(failed("watch_canceled", format!("etcd cancelled the watch: {:?} (compacted at revision {})", response.cancel_reason(), response.compact_revision())));
                    }
                    Ok(Some(response)) => {
                        let mut lost = None;
                        for event in response.events() {
                            let Some(kv) = event.kv() else { continue };
                            match event.event_type() {
                                _ if kv.key() == own_key.as_bytes() => lost = lost.or(own_record_lost(event.event_type(), kv, lease, &own_key)),
                                EventType::Put => self.apply_put(kv),
                                EventType::Delete => self.apply_delete(kv.key()),
                            }
                        }
                        if let Some(e) = lost {
                            break Err(e);
                        }
                    }
                    Ok(None) => break Err(failed("etcd_request_failed", "the watch stream closed")),
                    Err(e) => break Err(failed(classify(&e, "etcd_request_failed"), format!("watch: {e}"))),
                },
            }
        };
        if outcome.is_ok() {
            match bounded(limit, "etcd_request_failed", "lease revoke", client.lease_revoke(lease)).await {
                Ok(_) => tracing::info!(key = %own_key, "discovery: record withdrawn (lease revoked)"),
                Err(e) => tracing::warn!(
                    reason = e.reason,
                    "discovery: {} (the record goes when its lease expires)",
                    e.detail
                ),
            }
        }
        outcome
    }

    /// Puts this gateway's record under `lease` unless another gateway holds the name. A record of
    /// the same name from this host (this gateway's previous run, its lease not yet expired) is taken over.
    async fn register(&self, client: &mut Client, lease: i64, limit: Duration) -> Result<(), DiscoveryError> {
        let key = self.key_of(&self.identity.name);
        let value = serde_json::to_vec(&self.own_record()).expect("a record serialises");
        let put = || TxnOp::put(key.as_str(), value.clone(), Some(PutOptions::new().with_lease(lease)));
        let create = Txn::new()
            .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
            .and_then([put()])
            .or_else([TxnOp::get(key.as_str(), None)]);
        let answer = bounded(limit, "etcd_request_failed", "register", client.txn(create)).await?;
        if answer.succeeded() {
            return Ok(());
        }
        let held = answer.op_responses().into_iter().find_map(|r| match r {
            TxnOpResponse::Get(g) => {
                g.kvs().first().map(|kv| (kv.mod_revision(), serde_json::from_slice::<Record>(kv.value())))
            }
            _ => None,
        });
        let Some((revision, record)) = held else {
            return Err(failed("etcd_request_failed", format!("register {key}: the key exists but could not be read")));
        };
        match record {
            Ok(r) if r.host == self.identity.host => {
                let take_over = Txn::new().when([Compare::mod_revision(key.as_str(), CompareOp::Equal, revision)]).and_then([put()]);
                let answer = bounded(limit, "etcd_request_failed", "register", client.txn(take_over)).await?;
                if !answer.succeeded() {
                    return Err(failed("name_taken", format!("{key} changed while this gateway was taking over its own earlier record")));
                }
                tracing::info!(key = %key, previous_incarnation = r.incarnation, "discovery: took over this host's earlier record of the same name");
                Ok(())
            }
            Ok(r) => Err(failed(
                "name_taken",
                format!("{key} is held by another gateway (host {:?}, address {}): gateway.name must be unique in the deployment", r.host, r.address),
            )),
            Err(e) => Err(failed("name_taken", format!("{key} holds a record this gateway cannot read ({e}): not overwritten"))),
        }
    }

    /// The name a key under the prefix stands for; `None` for this gateway's own key and for keys
    /// outside the prefix.
    fn peer_name<'k>(&self, key: &'k [u8]) -> Option<&'k str> {
        let name = std::str::from_utf8(key).ok()?.strip_prefix(self.config.discovery.key_prefix.as_str())?;
        (name != self.identity.name && !name.is_empty()).then_some(name)
    }

    /// Applies a full read of the prefix: every record in it, and a withdrawal for each discovered
    /// peer no longer in it (gone while this gateway was not watching).
    fn apply_snapshot(&self, kvs: &[KeyValue]) {
        let mut present = HashSet::new();
        for kv in kvs {
            if let Some(name) = self.peer_name(kv.key()) {
                present.insert(name.to_string());
            }
            self.apply_put(kv);
        }
        for name in self.links.directory().discovered_names() {
            if !present.contains(&name) {
                self.withdraw(&name);
            }
        }
    }

    fn apply_put(&self, kv: &KeyValue) {
        let Some(name) = self.peer_name(kv.key()) else { return };
        let entry = serde_json::from_slice::<Record>(kv.value())
            .map_err(|e| e.to_string())
            .and_then(|r| r.to_peer(name, &self.identity.host));
        let entry = match entry {
            Ok(entry) => entry,
            Err(why) => {
                self.metrics.count_discovery_error("bad_record");
                tracing::warn!(reason = "bad_record", key = %String::from_utf8_lossy(kv.key()), "discovery: record ignored: {why}");
                return;
            }
        };
        let address = entry.address.clone();
        match self.links.directory().upsert_discovered(entry, self.config.discovery.max_peers) {
            Upsert::Added(new) => {
                tracing::info!(peer = %name, %address, "discovery: peer added");
                self.links.spawn(name.to_string(), new);
            }
            Upsert::Updated => tracing::debug!(peer = %name, %address, "discovery: peer record updated"),
            Upsert::StaticWins => {
                tracing::info!(peer = %name, "discovery: record ignored, [[peers]] configures this peer")
            }
            Upsert::LimitReached => {
                self.metrics.count_discovery_error("peer_limit");
                tracing::warn!(reason = "peer_limit", peer = %name, max_peers = self.config.discovery.max_peers,
                    "discovery: peer refused, discovery.max_peers discovered peers are known already");
            }
        }
    }

    fn apply_delete(&self, key: &[u8]) {
        if let Some(name) = self.peer_name(key) {
            self.withdraw(name);
        }
    }

    fn withdraw(&self, name: &str) {
        if self.links.directory().withdraw(name) {
            tracing::info!(peer = %name, "discovery: peer withdrawn (its record is gone); a live link stays until it is lost");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(name: &str, address: &str, host: &str) -> Record {
        Record {
            name: name.into(),
            address: address.into(),
            tls_name: String::new(),
            host: host.into(),
            incarnation: 7,
        }
    }

    #[test]
    fn a_record_becomes_a_peer_same_host_only_with_the_same_host_name() {
        let peer = record("decode-1", "10.0.0.2:7100", "node-b").to_peer("decode-1", "node-a").unwrap();
        assert_eq!((peer.name.as_str(), peer.address.as_str(), peer.same_host), ("decode-1", "10.0.0.2:7100", false));
        assert!(record("decode-1", "10.0.0.2:7100", "node-a").to_peer("decode-1", "node-a").unwrap().same_host);
        assert!(!record("decode-1", "10.0.0.2:7100", "").to_peer("decode-1", "").unwrap().same_host);
    }

    #[test]
    fn a_record_under_another_name_or_without_a_port_is_refused() {
        let e = record("decode-1", "10.0.0.2:7100", "h").to_peer("decode-2", "h").unwrap_err();
        assert!(e.contains("decode-1") && e.contains("decode-2"), "{e}");
        let e = record("decode-1", "10.0.0.2", "h").to_peer("decode-1", "h").unwrap_err();
        assert!(e.contains("host:port"), "{e}");
    }

    #[test]
    fn a_record_from_a_later_version_with_more_fields_still_reads() {
        let text = r#"{"name":"p","address":"10.0.0.1:7100","zone":"eu-1"}"#;
        let r: Record = serde_json::from_str(text).unwrap();
        assert_eq!(r.to_peer("p", "h").unwrap().address, "10.0.0.1:7100");
    }
}
