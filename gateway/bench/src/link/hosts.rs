//! Two `kvgate serve` gateways on the two hosts of a `kvgate_netbed::Link`: prefill on host 0, decode
//! on host 1, each configured from the shipped two-host config (`configs/quic-two-hosts`,
//! `configs/ucx-two-hosts`) with only addresses, paths and names changed, and certificates from
//! `kvgate keygen tls`. Used by `kvgate bench --link-profile` and the gateway's netbed tests.

use anyhow::{bail, Context};
use kvgate_netbed::Link;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

/// Which shipped two-host deployment the gateways run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Deployment {
    /// `configs/quic-two-hosts`: the QUIC plugin.
    Quic,
    /// `configs/ucx-two-hosts`: the UCX plugin (its `.so`), over TCP on the bed's device.
    UcxTcp,
}

impl Deployment {
    pub fn name(self) -> &'static str {
        match self {
            Deployment::Quic => "quic",
            Deployment::UcxTcp => "ucx-tcp",
        }
    }
    /// The shipped (prefill, decode) configs.
    pub fn shipped(self) -> (&'static str, &'static str) {
        match self {
            Deployment::Quic => (
                include_str!("../../../../configs/quic-two-hosts/prefill.toml"),
                include_str!("../../../../configs/quic-two-hosts/decode.toml"),
            ),
            Deployment::UcxTcp => (
                include_str!("../../../../configs/ucx-two-hosts/prefill.toml"),
                include_str!("../../../../configs/ucx-two-hosts/decode.toml"),
            ),
        }
    }
}

/// The names the gateways take on the bed (the demo engines address their peers by these).
pub const NAMES: [&str; 2] = [kvgate_demo::gateways::PREFILL_NAME, kvgate_demo::gateways::DECODE_NAME];
/// The peer-link port on each host.
pub const PEER_PORT: u16 = 7100;
/// The QUIC plugin's first UDP port on each host.
pub const QUIC_PORT: u16 = 7200;
/// The admin listener inside each host (each host has its own loopback).
pub const ADMIN: &str = "127.0.0.1:9100";

/// What the bed changes in a shipped config, besides addresses and paths.
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    /// The UCX plugin library (UcxTcp only).
    pub ucx_library: Option<PathBuf>,
    /// Extra keys of the plugin's own table (`[plugins.config.<plugin>]`), as TOML, e.g.
    /// `congestion_controller = "bbr"`.
    pub plugin_config: String,
    /// `[scheduler]` keys replaced (e.g. `min_bandwidth_bytes_per_s`), as TOML.
    pub scheduler: String,
}

fn table<'a>(v: &'a mut toml::Value, key: &str) -> &'a mut toml::value::Table {
    let root = v.as_table_mut().expect("a TOML document is a table");
    root.entry(key.to_string())
        .or_insert_with(|| toml::Value::Table(Default::default()))
        .as_table_mut()
        .expect("a table")
}

fn merge(into: &mut toml::value::Table, extra: &str) -> anyhow::Result<()> {
    let extra: toml::value::Table = toml::from_str(extra).with_context(|| format!("override {extra:?}"))?;
    into.extend(extra);
    Ok(())
}

/// The shipped config `text` for host `i` of the bed (addresses, paths and names changed).
pub fn bed_config(
    deployment: Deployment,
    text: &str,
    i: usize,
    link: &Link,
    dir: &Path,
    tls_names: [&str; 2],
    o: &Overrides,
) -> anyhow::Result<String> {
    let mut v: toml::Value = toml::from_str(text).context("the shipped config")?;
    let (me, peer) = (link.host(i).address, link.host(1 - i).address);
    table(&mut v, "gateway").insert("name".into(), NAMES[i].into());
    let api = table(&mut v, "engine_api");
    api.insert("unix_socket".into(), dir.join(format!("{}.sock", NAMES[i])).display().to_string().into());
    api.remove("tcp_listen");
    api.remove("bearer_token_file");
    let pl = table(&mut v, "peer_link");
    pl.insert("listen".into(), format!("{me}:{PEER_PORT}").into());
    let tls = pl
        .entry("tls")
        .or_insert_with(|| toml::Value::Table(Default::default()))
        .as_table_mut()
        .context("[peer_link.tls]")?;
    let tls_dir = dir.join("tls");
    tls.insert("cert_file".into(), tls_dir.join(format!("{}.pem", tls_names[i])).display().to_string().into());
    tls.insert("key_file".into(), tls_dir.join(format!("{}.key", tls_names[i])).display().to_string().into());
    tls.insert("ca_file".into(), tls_dir.join("ca.pem").display().to_string().into());
    let peers = v.get_mut("peers").and_then(|p| p.as_array_mut()).context("[[peers]]")?;
    let p = peers.first_mut().and_then(|p| p.as_table_mut()).context("one [[peers]] entry")?;
    p.insert("name".into(), NAMES[1 - i].into());
    p.insert("address".into(), format!("{peer}:{PEER_PORT}").into());
    let plugins = table(&mut v, "plugins");
    let plugin = match deployment {
        Deployment::Quic => "quic",
        Deployment::UcxTcp => {
            let lib = o.ucx_library.as_ref().context("the UCX plugin library")?;
            plugins.insert("libraries".into(), toml::Value::Array(vec![lib.display().to_string().into()]));
            plugins.insert("preference".into(), toml::Value::Array(vec!["ucx".into()]));
            "ucx"
        }
    };
    let configs = plugins
        .entry("config")
        .or_insert_with(|| toml::Value::Table(Default::default()))
        .as_table_mut()
        .context("[plugins.config]")?;
    // A QUIC table (the plugin, or UCX's fallback) listens on this host's address.
    if let Some(quic) = configs.get_mut("quic").and_then(|q| q.as_table_mut()) {
        quic.insert("listen_address".into(), format!("{me}:{QUIC_PORT}").into());
    }
    let own = configs
        .entry(plugin)
        .or_insert_with(|| toml::Value::Table(Default::default()))
        .as_table_mut()
        .context("plugin table")?;
    match deployment {
        Deployment::Quic => {
            own.insert("listen_address".into(), format!("{me}:{QUIC_PORT}").into());
        }
        Deployment::UcxTcp => {
            own.insert("tls".into(), "tcp".into());
            own.insert("devices".into(), kvgate_netbed::DEVICE.into());
        }
    }
    merge(own, &o.plugin_config)?;
    merge(table(&mut v, "scheduler"), &o.scheduler)?;
    table(&mut v, "admin").insert("listen".into(), ADMIN.into());
    if let Some(log) = v.as_table_mut().and_then(|t| t.get_mut("log")).and_then(|l| l.as_table_mut()) {
        log.insert("format".into(), "text".into());
    }
    Ok(toml::to_string(&v)?)
}

/// One gateway process on a host of the bed.
pub struct BedGateway {
    pub host: usize,
    pub socket: PathBuf,
    pub log_path: PathBuf,
    pub config: kvgate::config::GatewayConfig,
    child: Option<Child>,
}

impl BedGateway {
    pub fn pid(&self) -> Option<i32> {
        self.child.as_ref().map(|c| c.id() as i32)
    }
    pub fn log(&self) -> String {
        kvgate::logging::without_colour(&std::fs::read_to_string(&self.log_path).unwrap_or_default())
    }
    /// Whether the process is still running (`Err` with its exit status when it ended).
    pub fn alive(&mut self) -> Result<(), String> {
        match self.child.as_mut().map(|c| c.try_wait()) {
            Some(Ok(None)) => Ok(()),
            Some(Ok(Some(status))) => Err(format!("exited: {status}")),
            Some(Err(e)) => Err(e.to_string()),
            None => Err("stopped".into()),
        }
    }
    pub fn stop(&mut self, timeout: Duration) {
        if let Some(child) = self.child.take() {
            kvgate_demo::gateways::stop_child(child, timeout);
        }
    }
}

impl Drop for BedGateway {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The prefill (host 0) and decode (host 1) gateways of one deployment on the bed.
pub struct BedPair {
    pub deployment: Deployment,
    pub gateways: [BedGateway; 2],
}

/// `(status, body)` of `GET path` on host `i`'s admin listener.
pub async fn admin_get(link: &std::sync::Arc<Link>, i: usize, path: &str) -> std::io::Result<(u16, String)> {
    let (link, path) = (link.clone(), path.to_string());
    let addr: SocketAddr = ADMIN.parse().expect("literal");
    tokio::task::spawn_blocking(move || link.http_get(i, addr, &path, Duration::from_secs(5)))
        .await
        .map_err(std::io::Error::other)?
}

impl BedPair {
    /// Write both configs into `dir` (with a fresh CA and certificates), start both gateways with
    /// `binary`, and wait until each is up and sees the other.
    pub async fn start(
        binary: &Path,
        link: &std::sync::Arc<Link>,
        dir: &Path,
        deployment: Deployment,
        o: &Overrides,
    ) -> anyhow::Result<BedPair> {
        let shipped = deployment.shipped();
        let shipped = [shipped.0, shipped.1];
        // The names each gateway's certificate must carry: its peer's `tls_name` in the other config.
        let mut tls_names = [String::new(), String::new()];
        for i in 0..2 {
            let other: toml::Value = toml::from_str(shipped[1 - i])?;
            tls_names[i] = other["peers"][0].get("tls_name").and_then(|n| n.as_str()).unwrap_or(NAMES[i]).to_string();
        }
        let names = [tls_names[0].as_str(), tls_names[1].as_str()];
        let tls_dir = dir.join("tls");
        let out = std::process::Command::new(binary)
            .args(["keygen", "tls", "--force", "--dir"])
            .arg(&tls_dir)
            .args(["--name", names[0], "--name", names[1]])
            .output()
            .context("kvgate keygen tls")?;
        if !out.status.success() {
            bail!("kvgate keygen tls: {}", String::from_utf8_lossy(&out.stderr));
        }
        let mut gateways = Vec::new();
        for (i, text) in shipped.iter().enumerate() {
            let config_text = bed_config(deployment, text, i, link, dir, names, o)?;
            let config = kvgate::config::load_config_from_str(&config_text)
                .map_err(|e| anyhow::anyhow!("the bed's {} config: {e}", NAMES[i]))?;
            let config_path = dir.join(format!("{}-{}.toml", deployment.name(), NAMES[i]));
            std::fs::write(&config_path, &config_text)?;
            let log_path = dir.join(format!("{}-{}.log", deployment.name(), NAMES[i]));
            let socket = PathBuf::from(&config.engine_api.unix_socket);
            let _ = std::fs::remove_file(&socket);
            let child = link
                .command(i, binary)?
                .arg("serve")
                .arg("--config")
                .arg(&config_path)
                .env("RUST_LOG", std::env::var("KVGATE_DEMO_LOG").unwrap_or_else(|_| "info".into()))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log_path)?)
                .spawn()
                .with_context(|| format!("start {}", binary.display()))?;
            gateways.push(BedGateway { host: i, socket, log_path, config, child: Some(child) });
        }
        let decode = gateways.pop().expect("two");
        let prefill = gateways.pop().expect("two");
        let mut pair = BedPair { deployment, gateways: [prefill, decode] };
        pair.wait_ready(link).await?;
        Ok(pair)
    }

    async fn wait_ready(&mut self, link: &std::sync::Arc<Link>) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_millis(kvgate_demo::gateways::GATEWAY_READY_TIMEOUT_MS);
        for (i, name) in NAMES.iter().enumerate() {
            loop {
                if let Err(e) = self.gateways[i].alive() {
                    bail!("gateway {name} {e} during start-up:\n{}", self.gateways[i].log());
                }
                if let Ok((200, body)) = admin_get(link, i, "/plugins").await {
                    if body.contains("\"up\":true") && !body.contains("\"up\":false") {
                        break;
                    }
                }
                if Instant::now() > deadline {
                    bail!(
                        "gateway {name} not ready within {} ms:\n{}",
                        kvgate_demo::gateways::GATEWAY_READY_TIMEOUT_MS,
                        self.gateways[i].log()
                    );
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        Ok(())
    }

    pub fn prefill(&self) -> &BedGateway {
        &self.gateways[0]
    }
    pub fn decode(&self) -> &BedGateway {
        &self.gateways[1]
    }
    /// CPU time (user + system) both gateway processes have used so far.
    pub fn cpu_used(&self) -> Duration {
        self.gateways.iter().map(|g| g.pid().and_then(crate::system::process_cpu).unwrap_or_default()).sum()
    }
    /// Both logs, for failure messages.
    pub fn logs(&self) -> String {
        format!("--- prefill log ---\n{}\n--- decode log ---\n{}", self.gateways[0].log(), self.gateways[1].log())
    }
    pub fn stop(&mut self) {
        for g in &mut self.gateways {
            g.stop(Duration::from_secs(5));
        }
    }
}
