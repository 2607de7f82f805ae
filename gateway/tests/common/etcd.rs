//! A real etcd server (Debian's `etcd-server`, which `.ci/run` installs) on loopback ports of its own,
//! with its data in a temp folder, optionally serving TLS, alone or as a member of a cluster on
//! loopback; killed when dropped.

use kvgate_demo::gateways::{free_port, Cluster, GatewayProcess, PairSettings};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// How long a fresh etcd may take to answer its first request.
const ETCD_READY_TIMEOUT: Duration = Duration::from_secs(20);

pub struct Etcd {
    child: Option<Child>,
    /// Its member name, and the whole cluster (`name=peer-url,...`) when it is one of several.
    member: String,
    initial_cluster: Option<String>,
    pub client_port: u16,
    peer_port: u16,
    data_dir: std::path::PathBuf,
    log_path: std::path::PathBuf,
    /// Server certificate, key and client CA files (serving `https://` and requiring client certificates).
    tls: Option<EtcdServerTls>,
    /// How the test's own client connects (TLS, a user once auth is on).
    pub client_options: etcd_client::ConnectOptions,
}

/// PEM files etcd serves TLS with.
pub struct EtcdServerTls {
    pub cert_file: std::path::PathBuf,
    pub key_file: std::path::PathBuf,
    pub client_ca_file: std::path::PathBuf,
}

impl Etcd {
    /// The URL gateways put in `discovery.etcd_endpoints`.
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    /// A server on a free client port (not started yet: see `start`).
    pub fn on_free_port(dir: &Path) -> Etcd {
        let client_port = free_port();
        let data_dir = dir.join(format!("etcd-{client_port}"));
        let log_path = dir.join(format!("etcd-{client_port}.log"));
        let client_options = etcd_client::ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(2))
            .with_timeout(Duration::from_secs(2));
        let member = "kvgate-test".to_string();
        Etcd {
            child: None,
            member,
            initial_cluster: None,
            client_port,
            peer_port: free_port(),
            data_dir,
            log_path,
            tls: None,
            client_options,
        }
    }

    /// A server on a free port that serves TLS with `tls` and requires client certificates; the test's
    /// client presents `client_options`' TLS.
    pub fn with_tls(dir: &Path, tls: EtcdServerTls, client_tls: etcd_client::TlsOptions) -> Etcd {
        let mut etcd = Etcd::on_free_port(dir);
        etcd.tls = Some(tls);
        etcd.client_options = etcd.client_options.clone().with_tls(client_tls);
        etcd
    }

    fn peer_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.peer_port)
    }

    /// Starts etcd (a missing binary fails the test, naming the package) and waits until it answers.
    pub async fn start(&mut self) {
        self.spawn();
        self.wait_ready().await;
    }

    /// Starts the process without waiting: a cluster's members answer only once a quorum is up.
    fn spawn(&mut self) {
        let log = std::fs::File::create(&self.log_path).unwrap();
        let peer = self.peer_url();
        let initial_cluster = self.initial_cluster.clone().unwrap_or_else(|| format!("{}={peer}", self.member));
        let mut command = Command::new("etcd");
        if let Some(tls) = &self.tls {
            command.arg("--cert-file").arg(&tls.cert_file).arg("--key-file").arg(&tls.key_file);
            command.arg("--client-cert-auth").arg("--trusted-ca-file").arg(&tls.client_ca_file);
        }
        let child = command
            .args(["--name", &self.member, "--data-dir"])
            .arg(&self.data_dir)
            .args(["--listen-client-urls", &self.url(), "--advertise-client-urls", &self.url()])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &initial_cluster, "--logger", "zap", "--log-level", "error"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start etcd ({e}): install Debian's etcd-server (.ci/run does)"));
        self.child = Some(child);
    }

    async fn wait_ready(&self) {
        let deadline = tokio::time::Instant::now() + ETCD_READY_TIMEOUT;
        loop {
            if let Ok(mut client) = self.client().await {
                if client.get("/", None).await.is_ok() {
                    return;
                }
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "etcd did not answer within {ETCD_READY_TIMEOUT:?}:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub async fn started(dir: &Path) -> Etcd {
        let mut etcd = Etcd::on_free_port(dir);
        etcd.start().await;
        etcd
    }

    pub async fn client(&self) -> Result<etcd_client::Client, etcd_client::Error> {
        etcd_client::Client::connect([self.url()], Some(self.client_options.clone())).await
    }

    /// The keys under `prefix`, as strings, sorted.
    pub async fn keys(&self, prefix: &str) -> Vec<String> {
        let mut client = self.client().await.unwrap();
        let answer =
            client.get(prefix, Some(etcd_client::GetOptions::new().with_prefix().with_keys_only())).await.unwrap();
        let mut keys: Vec<String> =
            answer.kvs().iter().map(|kv| String::from_utf8_lossy(kv.key()).into_owned()).collect();
        keys.sort();
        keys
    }

    /// Kills the server (SIGKILL); `start` brings it back on the same ports and data.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops the process (SIGSTOP): it holds its connections and answers nothing until `thaw`.
    pub fn freeze(&self) {
        self.signal(nix::sys::signal::Signal::SIGSTOP);
    }

    pub fn thaw(&self) {
        self.signal(nix::sys::signal::Signal::SIGCONT);
    }

    fn signal(&self, signal: nix::sys::signal::Signal) {
        let pid = self.child.as_ref().expect("a running etcd").id();
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), signal).unwrap();
    }

    /// The value at `key` as this member alone knows it (a serializable read: no leader needed).
    pub async fn local_value(&self, key: &str) -> Option<String> {
        let answer = self
            .client()
            .await
            .unwrap()
            .get(key, Some(etcd_client::GetOptions::new().with_serializable()))
            .await
            .unwrap();
        answer.kvs().first().map(|kv| String::from_utf8_lossy(kv.value()).into_owned())
    }

    /// The value at `key`, as text, if the key exists.
    pub async fn value(&self, key: &str) -> Option<String> {
        let answer = self.client().await.unwrap().get(key, None).await.unwrap();
        answer.kvs().first().map(|kv| String::from_utf8_lossy(kv.value()).into_owned())
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }
}

/// A cluster of etcd members on loopback; each member can be killed and started again alone.
pub struct EtcdCluster {
    pub members: Vec<Etcd>,
}

impl EtcdCluster {
    /// `size` members, started together, once every one of them answers.
    pub async fn started(dir: &Path, size: usize) -> EtcdCluster {
        let mut members: Vec<Etcd> = (0..size).map(|_| Etcd::on_free_port(dir)).collect();
        for (i, m) in members.iter_mut().enumerate() {
            m.member = format!("kvgate-test-{i}");
        }
        let initial = members.iter().map(|m| format!("{}={}", m.member, m.peer_url())).collect::<Vec<_>>().join(",");
        for m in &mut members {
            m.initial_cluster = Some(initial.clone());
            m.spawn();
        }
        for m in &members {
            m.wait_ready().await;
        }
        EtcdCluster { members }
    }

    /// Waits until every running member grants a lease: after a member is killed, until the others
    /// have a leader again (calls made during the election wait for it, past any short timeout).
    pub async fn settle(&self) {
        let deadline = tokio::time::Instant::now() + ETCD_READY_TIMEOUT;
        for m in self.members.iter().filter(|m| m.child.is_some()) {
            loop {
                let granted = match m.client().await {
                    Ok(mut client) => client.lease_grant(5, None).await.is_ok(),
                    Err(_) => false,
                };
                if granted {
                    break;
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "member {} grants no lease within {ETCD_READY_TIMEOUT:?}:\n{}",
                    m.member,
                    self.logs()
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }

    /// The index of the member that leads the cluster now.
    pub async fn leader(&self) -> usize {
        let mut ids = Vec::new();
        let mut leader = 0;
        for m in &self.members {
            let status = m.client().await.unwrap().status().await.unwrap();
            ids.push(status.header().map_or(0, |h| h.member_id()));
            leader = status.leader();
        }
        ids.iter().position(|id| *id == leader).expect("the leader is one of the members")
    }

    /// Every member's client URL, in member order.
    pub fn urls(&self) -> Vec<String> {
        self.members.iter().map(Etcd::url).collect()
    }

    /// Every member's log, for a failing test's message.
    pub fn logs(&self) -> String {
        self.members.iter().map(|m| format!("--- {}:\n{}", m.member, m.log())).collect::<Vec<_>>().join("\n")
    }
}

/// Gateways that know no peer but those discovery finds, started without waiting for any link.
pub fn discovery_only_settings() -> PairSettings {
    PairSettings { static_peers: false, wait_for_peers: false, ..PairSettings::default() }
}

/// One gateway named `name`, with the `[discovery]` table `table` and no static peer (not waiting for
/// it to register: see `wait_registered`).
pub async fn discovery_gateway(dir: &Path, name: &str, table: &str) -> Cluster {
    Cluster::start(&super::binary(), dir, &discovery_only_settings(), &[(name, table, vec![])]).await.unwrap()
}

/// Waits (at most `within`) until `gw` says it is registered.
pub async fn wait_registered(gw: &GatewayProcess, within: Duration) {
    super::eventually(
        within,
        &format!("{} registered", gw.name),
        || async { super::metric(&gw.admin, "kvgate_discovery_registered").await == 1.0 },
        &|| gw.log(),
    )
    .await;
}

/// This machine's host name, as a gateway publishes it in its record.
pub fn this_host() -> String {
    nix::unistd::gethostname().unwrap().into_string().unwrap()
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
    }
}
