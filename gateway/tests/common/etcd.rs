//! A real etcd server (Debian's `etcd-server`, which `.ci/run` installs) on loopback ports of its own,
//! with its data in a temp folder, optionally serving TLS; killed when dropped.

use kvgate::demo::gateways::{free_port, PairSettings};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// How long a fresh etcd may take to answer its first request.
const ETCD_READY_TIMEOUT: Duration = Duration::from_secs(20);

pub struct Etcd {
    child: Option<Child>,
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
        let data_dir = dir.join(format!("etcd-{}", std::process::id()));
        let log_path = dir.join(format!("etcd-{}.log", std::process::id()));
        let client_options = etcd_client::ConnectOptions::new().with_connect_timeout(Duration::from_secs(2)).with_timeout(Duration::from_secs(2));
        Etcd { child: None, client_port: free_port(), peer_port: free_port(), data_dir, log_path, tls: None, client_options }
    }

    /// A server on a free port that serves TLS with `tls` and requires client certificates; the test's
    /// client presents `client_options`' TLS.
    pub fn with_tls(dir: &Path, tls: EtcdServerTls, client_tls: etcd_client::TlsOptions) -> Etcd {
        let mut etcd = Etcd::on_free_port(dir);
        etcd.tls = Some(tls);
        etcd.client_options = etcd.client_options.clone().with_tls(client_tls);
        etcd
    }

    /// Starts etcd (a missing binary fails the test, naming the package) and waits until it answers.
    pub async fn start(&mut self) {
        let log = std::fs::File::create(&self.log_path).unwrap();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let mut command = Command::new("etcd");
        if let Some(tls) = &self.tls {
            command.arg("--cert-file").arg(&tls.cert_file).arg("--key-file").arg(&tls.key_file);
            command.arg("--client-cert-auth").arg("--trusted-ca-file").arg(&tls.client_ca_file);
        }
        let child = command
            .args(["--name", "kvgate-test", "--data-dir"])
            .arg(&self.data_dir)
            .args(["--listen-client-urls", &self.url(), "--advertise-client-urls", &self.url()])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("kvgate-test={peer}"), "--logger", "zap", "--log-level", "error"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start etcd ({e}): install Debian's etcd-server (.ci/run does)"));
        self.child = Some(child);
        let deadline = tokio::time::Instant::now() + ETCD_READY_TIMEOUT;
        loop {
            if let Ok(mut client) = self.client().await {
                if client.get("/", None).await.is_ok() {
                    return;
                }
            }
            assert!(tokio::time::Instant::now() < deadline, "etcd did not answer within {ETCD_READY_TIMEOUT:?}:\n{}", self.log());
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
        let answer = client.get(prefix, Some(etcd_client::GetOptions::new().with_prefix().with_keys_only())).await.unwrap();
        let mut keys: Vec<String> = answer.kvs().iter().map(|kv| String::from_utf8_lossy(kv.key()).into_owned()).collect();
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

    /// The value at `key`, as text, if the key exists.
    pub async fn value(&self, key: &str) -> Option<String> {
        let answer = self.client().await.unwrap().get(key, None).await.unwrap();
        answer.kvs().first().map(|kv| String::from_utf8_lossy(kv.value()).into_owned())
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }
}

/// Gateways that know no peer but those discovery finds, started without waiting for any link.
pub fn discovery_only_settings() -> PairSettings {
    PairSettings { static_peers: false, wait_for_peers: false, ..PairSettings::default() }
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
