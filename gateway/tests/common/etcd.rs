//! A real etcd server (Debian's `etcd-server`, which `.ci/run` installs) on loopback ports of its own,
//! with its data in a temp folder; killed when dropped.

use kvgate::demo::gateways::free_port;
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
}

impl Etcd {
    /// The URL gateways put in `discovery.etcd_endpoints`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// A server on a free client port (not started yet: see `start`).
    pub fn on_free_port(dir: &Path) -> Etcd {
        let data_dir = dir.join(format!("etcd-{}", std::process::id()));
        let log_path = dir.join(format!("etcd-{}.log", std::process::id()));
        Etcd { child: None, client_port: free_port(), peer_port: free_port(), data_dir, log_path }
    }

    /// Starts etcd (a missing binary fails the test, naming the package) and waits until it answers.
    pub async fn start(&mut self) {
        let log = std::fs::File::create(&self.log_path).unwrap();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let child = Command::new("etcd")
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
        let options = etcd_client::ConnectOptions::new().with_connect_timeout(Duration::from_secs(2)).with_timeout(Duration::from_secs(2));
        etcd_client::Client::connect([self.url()], Some(options)).await
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

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
    }
}
