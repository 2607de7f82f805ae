//! Child gateway processes for the demo and the end-to-end tests: generated configs in a temp dir,
//! `kvgate serve` started with its log in a file, readiness awaited (engine socket answers, peer link
//! up), SIGSTOP/SIGCONT/SIGKILL for fault injection, and a kill on drop so no gateway outlives its owner.

use anyhow::{bail, Context};
use kvgate::admin_client as http;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The QUIC plugin's settings for loopback (plugins/quic/README.md, "For loopback or jumbo-frame links"):
/// the defaults are sized for real networks (1200-byte datagrams until MTU discovery proves more), while
/// the demo, the bench and its TCP reference run on 127.0.0.1, where 64 KiB datagrams are the path's own limit.
pub const QUIC_LOOPBACK_CONFIG: &str = "initial_mtu_bytes = 65507
min_mtu_bytes = 16000
mtu_discovery_upper_bound_bytes = 65507
segmentation_offload = false
initial_congestion_window_bytes = 1048576
write_chunk_bytes = 1048576
send_window_bytes = 4194304
malloc_trim_threshold_bytes = 67108864
";

/// How long a started gateway may take to become ready.
pub const GATEWAY_READY_TIMEOUT_MS: u64 = 20_000;

/// Settings of generated gateways.
#[derive(Clone, Debug)]
pub struct PairSettings {
    /// `plugins.preference` of every gateway: one plugin name, or several separated by commas.
    pub plugin: String,
    pub heartbeat_interval_ms: u64,
    pub heartbeat_misses: u64,
    pub bootstrap_timeout_ms: u64,
    /// Extra TOML appended to the prefill / decode config (new tables only, e.g. `[peer_link.tls]`).
    pub extra_prefill: String,
    pub extra_decode: String,
    /// Extra environment of the prefill / decode process (`KVGATE__SECTION__KEY` overrides).
    pub env_prefill: Vec<(String, String)>,
    pub env_decode: Vec<(String, String)>,
    /// Wait until every gateway's peer links are up (false when a test expects them not to be).
    pub wait_for_peers: bool,
    /// `admin.stuck_room_warn_ms` of every gateway.
    pub stuck_room_warn_ms: Vec<u64>,
    /// `plugins.libraries` of every gateway: plugin `.so` files to load (UCX, NVLink).
    pub plugin_libraries: Vec<PathBuf>,
    /// The body of `[plugins.config.<plugin>]` of every gateway (the plugin's own TOML keys, e.g.
    /// `tls = "tcp"`); empty writes no such table.
    pub plugin_config: String,
    /// Write every other gateway as a `[[peers]]` entry (false: they must find each other through
    /// `[discovery]`, given in the extra TOML).
    pub static_peers: bool,
}

impl Default for PairSettings {
    fn default() -> Self {
        PairSettings {
            plugin: "shm".into(),
            heartbeat_interval_ms: 200,
            heartbeat_misses: 5,
            bootstrap_timeout_ms: 10_000,
            extra_prefill: String::new(),
            extra_decode: String::new(),
            env_prefill: vec![],
            env_decode: vec![],
            wait_for_peers: true,
            stuck_room_warn_ms: vec![5_000],
            plugin_libraries: vec![],
            plugin_config: String::new(),
            static_peers: true,
        }
    }
}

/// Stop a gateway process as a service manager would: `SIGCONT` (a frozen one must run to exit),
/// `SIGTERM`, up to `timeout` for it to drain and exit, then `SIGKILL`; always reaped.
pub fn stop_child(mut child: Child, timeout: Duration) {
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT);
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// One running `kvgate serve`.
pub struct GatewayProcess {
    pub name: String,
    pub socket: PathBuf,
    pub admin: String,
    pub peer_listen: String,
    pub config_path: PathBuf,
    pub log_path: PathBuf,
    child: Option<Child>,
}

impl GatewayProcess {
    pub fn pid(&self) -> Option<i32> {
        self.child.as_ref().map(|c| c.id() as i32)
    }
    fn signal(&self, signal: nix::sys::signal::Signal) -> anyhow::Result<()> {
        let pid = self.pid().context("gateway not running")?;
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), signal)?;
        Ok(())
    }
    /// Freeze the process (its sockets stay open; it answers nothing).
    pub fn freeze(&self) -> anyhow::Result<()> {
        self.signal(nix::sys::signal::Signal::SIGSTOP)
    }
    pub fn thaw(&self) -> anyhow::Result<()> {
        self.signal(nix::sys::signal::Signal::SIGCONT)
    }
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGCONT,
            );
            let _ = child.kill();
            let _ = child.wait();
        }
    }
    /// SIGTERM, then wait for a clean exit (SIGKILL after `timeout`).
    pub fn stop(&mut self, timeout: Duration) {
        if let Some(child) = self.child.take() {
            stop_child(child, timeout);
        }
    }
    /// Start the gateway again with the same config (a new process: a new incarnation to its peers).
    pub fn restart(&mut self, binary: &Path) -> anyhow::Result<()> {
        self.kill();
        let log = std::fs::OpenOptions::new().append(true).open(&self.log_path)?;
        let child = Command::new(binary)
            .arg("serve")
            .arg("--config")
            .arg(&self.config_path)
            .env("RUST_LOG", std::env::var("KVGATE_DEMO_LOG").unwrap_or_else(|_| "info".into()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()?;
        self.child = Some(child);
        Ok(())
    }
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }
}

impl Drop for GatewayProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Lowest port `free_port` picks from: below it are the well-known and registered services.
pub const PICKED_PORT_MIN: u16 = 10_000;
/// How many random ports `free_port` tries before it takes one from the kernel instead.
pub const PORT_PICK_ATTEMPTS: u32 = 64;

/// A port free on 127.0.0.1 for a gateway about to start. Picked at random below the kernel's
/// ephemeral range (`net.ipv4.ip_local_port_range`), because a port the kernel hands out for `:0` is
/// also what it hands to outgoing connections: one of those (a peer link dialling, an admin request)
/// could take it before the gateway binds it, and the gateway then fails with `Address already in
/// use`. Falls back to the kernel's choice when no port below the range is free after
/// `PORT_PICK_ATTEMPTS` tries, or when the range leaves no room below it. A port is handed out once
/// per process: the test binaries start many gateways at once, and a port picked for one and not yet
/// bound is still free to the next pick (two gateways, or a gateway and its etcd, given the same port).
pub fn free_port() -> u16 {
    static HANDED_OUT: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    let ephemeral_start = ephemeral_port_range().map_or(32_768, |(low, _)| low);
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
    pick_free_port(PICKED_PORT_MIN..ephemeral_start, PORT_PICK_ATTEMPTS, &mut handed_out)
}

/// A free port of `candidates` not in `handed_out` (then added to it), or the kernel's choice.
fn pick_free_port(
    candidates: std::ops::Range<u16>,
    attempts: u32,
    handed_out: &mut std::collections::BTreeSet<u16>,
) -> u16 {
    let free = |port: u16| std::net::TcpListener::bind(("127.0.0.1", port)).is_ok();
    let port = (0..if candidates.is_empty() { 0 } else { attempts })
        .map(|_| rand::random_range(candidates.clone()))
        .find(|port| !handed_out.contains(port) && free(*port))
        .unwrap_or_else(|| {
            // The kernel's choice: fresh ports first, so one handed out before is not given twice.
            (0..attempts.max(1))
                .map(|_| {
                    std::net::TcpListener::bind("127.0.0.1:0")
                        .and_then(|l| l.local_addr())
                        .map(|a| a.port())
                        .expect("a free port")
                })
                .find(|port| !handed_out.contains(port))
                .unwrap_or_else(|| std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port())
        });
    handed_out.insert(port);
    port
}

/// The kernel's ephemeral port range, if it can be read.
fn ephemeral_port_range() -> Option<(u16, u16)> {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    let mut bounds = text.split_whitespace().map(|v| v.parse::<u16>().ok());
    Some((bounds.next()??, bounds.next()??))
}

/// `["a", "b"]` with each path quoted as a TOML basic string.
fn toml_string_list(paths: &[PathBuf]) -> String {
    let quoted: Vec<String> = paths.iter().map(|p| toml::Value::String(p.display().to_string()).to_string()).collect();
    format!("[{}]", quoted.join(", "))
}

/// `[plugins.config.<plugin>]` followed by `body`, or nothing when `body` is empty.
fn plugin_config_table(plugin: &str, body: &str) -> String {
    if body.trim().is_empty() {
        return String::new();
    }
    format!("[plugins.config.{plugin}]\n{}\n", body.trim_end())
}

/// `psk_file = ...` for the `[peer_link]` table (the default authentication), unless `extra` configures
/// mutual TLS instead.
fn psk_line(psk_file: &Path, extra: &str) -> String {
    if extra.contains("[peer_link.tls]") {
        return String::new();
    }
    format!("psk_file = {}\n", toml::Value::String(psk_file.display().to_string()))
}

#[allow(clippy::too_many_arguments)]
fn config_text(
    name: &str,
    socket: &Path,
    peer_listen: &str,
    admin: &str,
    peers: &[(String, String)],
    s: &PairSettings,
    extra: &str,
    psk_file: &Path,
) -> String {
    let peers: String = peers
        .iter()
        .map(|(peer, address)| {
            format!(
                "[[peers]]\nname = \"{peer}\"\naddress = \"{address}\"\nsame_host = true\ntls_name = \"localhost\"\n"
            )
        })
        .collect();
    format!(
        r#"# generated by kvgate demo
[gateway]
name = "{name}"
[engine_api]
unix_socket = "{socket}"
[peer_link]
listen = "{peer_listen}"
heartbeat_interval_ms = {hb}
heartbeat_misses = {misses}
connect_timeout_ms = 2000
reconnect_interval_ms = 100
{psk}{peers}
[plugins]
preference = {preference}
libraries = {libraries}
{plugin_config}[scheduler]
bootstrap_timeout_ms = {bootstrap}
# Long enough that a frozen peer is detected by heartbeats (peer_lost), not by this deadline.
transfer_base_ms = 5000
[admin]
listen = "{admin}"
stuck_room_warn_ms = {stuck:?}
{extra}
"#,
        socket = socket.display(),
        hb = s.heartbeat_interval_ms,
        misses = s.heartbeat_misses,
        preference =
            toml::Value::Array(s.plugin.split(',').map(|p| toml::Value::String(p.trim().to_string())).collect()),
        libraries = toml_string_list(&s.plugin_libraries),
        plugin_config = plugin_config_table(s.plugin.split(',').next().unwrap_or_default().trim(), &s.plugin_config),
        bootstrap = s.bootstrap_timeout_ms,
        stuck = s.stuck_room_warn_ms,
        psk = psk_line(psk_file, extra),
    )
}

/// Replace the `[plugins]` part of a generated config (up to `[scheduler]`) with `plugins`, as an
/// operator edits it before `kvgate plugins reload`.
pub fn rewrite_plugins(config: &Path, plugins: &str) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(config)?;
    let start = text.find("[plugins]\n").ok_or_else(|| anyhow::anyhow!("{}: no [plugins] table", config.display()))?;
    let end =
        text.find("[scheduler]\n").ok_or_else(|| anyhow::anyhow!("{}: no [scheduler] table", config.display()))?;
    std::fs::write(config, format!("{}[plugins]\n{}\n{}", &text[..start], plugins.trim_end(), &text[end..]))?;
    Ok(())
}

/// Several gateways on this machine, each linked to all the others.
pub struct Cluster {
    pub gateways: Vec<GatewayProcess>,
}

/// One gateway to start: its name, extra TOML, and extra environment variables.
pub type Member<'a> = (&'a str, &'a str, Vec<(String, String)>);

impl Cluster {
    /// Start `names` (with per-gateway extra TOML and environment) and wait until ready.
    pub async fn start(
        binary: &Path,
        dir: &Path,
        settings: &PairSettings,
        members: &[Member<'_>],
    ) -> anyhow::Result<Cluster> {
        let ports: Vec<(u16, u16)> = members.iter().map(|_| (free_port(), free_port())).collect();
        let tag = format!("{}-{}", settings.plugin, std::process::id());
        // One pre-shared key for the cluster's peer links (kept if a previous cluster in `dir` made it).
        let psk_file = dir.join(format!("peer-{tag}.key"));
        if !psk_file.exists() {
            kvgate::peer_link::psk::Psk::generate(&psk_file, false).context("make the cluster's peer-link key")?;
        }
        let mut gateways = Vec::new();
        for (i, (name, extra, env)) in members.iter().enumerate() {
            let (port, admin) = ports[i];
            let peers: Vec<(String, String)> = members
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i && settings.static_peers)
                .map(|(j, m)| (m.0.to_string(), format!("127.0.0.1:{}", ports[j].0)))
                .collect();
            let socket = dir.join(format!("{name}-{tag}.sock"));
            let config_path = dir.join(format!("{name}-{tag}.toml"));
            let log_path = dir.join(format!("{name}-{tag}.log"));
            let text = config_text(
                name,
                &socket,
                &format!("127.0.0.1:{port}"),
                &format!("127.0.0.1:{admin}"),
                &peers,
                settings,
                extra,
                &psk_file,
            );
            std::fs::write(&config_path, text)?;
            let log = std::fs::File::create(&log_path)?;
            let child = Command::new(binary)
                .arg("serve")
                .arg("--config")
                .arg(&config_path)
                .env("RUST_LOG", std::env::var("KVGATE_DEMO_LOG").unwrap_or_else(|_| "info".into()))
                .envs(env.iter().cloned())
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .with_context(|| format!("start {}", binary.display()))?;
            gateways.push(GatewayProcess {
                name: name.to_string(),
                socket,
                admin: format!("127.0.0.1:{admin}"),
                peer_listen: format!("127.0.0.1:{port}"),
                config_path,
                log_path,
                child: Some(child),
            });
        }
        let mut cluster = Cluster { gateways };
        cluster.wait_ready(settings.wait_for_peers).await?;
        Ok(cluster)
    }

    async fn wait_ready(&mut self, wait_for_peers: bool) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_millis(GATEWAY_READY_TIMEOUT_MS);
        for g in self.gateways.iter_mut() {
            loop {
                if let Some(child) = g.child.as_mut() {
                    if let Ok(Some(status)) = child.try_wait() {
                        bail!("gateway {} exited ({status}) during start-up:\n{}", g.name, g.log());
                    }
                }
                if let Ok((200, body)) = http::get(&g.admin, "/plugins").await {
                    if !wait_for_peers || !body.contains("\"up\":false") {
                        break;
                    }
                }
                if Instant::now() > deadline {
                    bail!("gateway {} not ready within {GATEWAY_READY_TIMEOUT_MS} ms:\n{}", g.name, g.log());
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        Ok(())
    }

    pub fn get(&self, name: &str) -> &GatewayProcess {
        self.gateways.iter().find(|g| g.name == name).expect("a gateway of this cluster")
    }
    pub fn get_mut(&mut self, name: &str) -> &mut GatewayProcess {
        self.gateways.iter_mut().find(|g| g.name == name).expect("a gateway of this cluster")
    }
    pub fn stop(&mut self) {
        for g in &mut self.gateways {
            g.stop(Duration::from_secs(5));
        }
    }
}

/// A prefill and a decode gateway on this machine, linked to each other.
pub struct GatewayPair {
    pub prefill: GatewayProcess,
    pub decode: GatewayProcess,
}

pub const PREFILL_NAME: &str = "prefill";
pub const DECODE_NAME: &str = "decode";

impl GatewayPair {
    /// Write both configs into `dir`, start both gateways with `binary`, wait until ready.
    pub async fn start(binary: &Path, dir: &Path, settings: &PairSettings) -> anyhow::Result<GatewayPair> {
        let members = [
            (PREFILL_NAME, settings.extra_prefill.as_str(), settings.env_prefill.clone()),
            (DECODE_NAME, settings.extra_decode.as_str(), settings.env_decode.clone()),
        ];
        let mut cluster = Cluster::start(binary, dir, settings, &members).await?;
        let decode = cluster.gateways.pop().expect("two gateways");
        let prefill = cluster.gateways.pop().expect("two gateways");
        Ok(GatewayPair { prefill, decode })
    }

    pub fn stop(&mut self) {
        self.prefill.stop(Duration::from_secs(5));
        self.decode.stop(Duration::from_secs(5));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The generated config, and the folder holding its key file (keep it while loading).
    fn generated(settings: &PairSettings) -> (tempfile::TempDir, String) {
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("peer.key");
        kvgate::peer_link::psk::Psk::generate(&key, false).unwrap();
        let peers = vec![("decode".to_string(), "127.0.0.1:7101".to_string())];
        let text = config_text(
            "prefill",
            Path::new("/tmp/x.sock"),
            "127.0.0.1:7100",
            "127.0.0.1:9100",
            &peers,
            settings,
            "",
            &key,
        );
        (dir, text)
    }

    #[test]
    fn generated_config_loads_plugin_libraries_and_the_plugins_own_section() {
        let settings = PairSettings {
            plugin: "ucx".into(),
            plugin_libraries: vec![PathBuf::from("/opt/kv gate/libkvgate_ucx.so")],
            plugin_config: "tls = \"tcp\"\ndevices = \"lo\"\n".into(),
            ..PairSettings::default()
        };
        let (_dir, text) = generated(&settings);
        let config = kvgate::config::load_config_from_str(&text).expect("the generated config loads");
        assert_eq!(config.plugins.preference, vec!["ucx".to_string()]);
        assert_eq!(config.plugins.libraries, vec!["/opt/kv gate/libkvgate_ucx.so".to_string()]);
        let section = config.plugins.config.get("ucx").expect("[plugins.config.ucx]");
        assert_eq!(section.get("tls").and_then(|v| v.as_str()), Some("tcp"));
        assert_eq!(section.get("devices").and_then(|v| v.as_str()), Some("lo"));
    }

    #[test]
    fn default_settings_load_no_library_and_no_plugin_section() {
        let (_dir, text) = generated(&PairSettings::default());
        let config = kvgate::config::load_config_from_str(&text).expect("the generated config loads");
        assert!(config.plugins.libraries.is_empty());
        // Peer links are authenticated with the cluster's key.
        assert_eq!(config.peer_link.auth_mode(), kvgate::config::PeerAuthMode::Psk);
        assert!(config.peer_link.psk_file.ends_with("peer.key"));
        assert!(config.plugins.config.is_empty());
    }

    #[test]
    fn a_picked_port_is_below_the_ephemeral_range() {
        // That it was free when picked is `pick_free_port`'s own bind, and that a taken one is passed
        // over is the next test; binding it again here would race every other process on the host.
        let (low, high) = ephemeral_port_range().expect("/proc/sys/net/ipv4/ip_local_port_range");
        assert!(low <= high);
        for _ in 0..20 {
            let port = free_port();
            assert!(low <= PICKED_PORT_MIN || (PICKED_PORT_MIN..low).contains(&port), "{port} not below {low}");
        }
    }

    #[test]
    fn port_picking_falls_back_to_the_kernel_after_its_attempts() {
        // The only candidate is taken: every attempt fails and the kernel's choice comes back.
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = taken.local_addr().unwrap().port();
        let fresh = || std::collections::BTreeSet::new();
        assert_ne!(pick_free_port(port..port + 1, PORT_PICK_ATTEMPTS, &mut fresh()), port);
        // Zero attempts, or no candidates, go straight to the kernel.
        assert_ne!(pick_free_port(port..port + 1, 0, &mut fresh()), port);
        assert_ne!(pick_free_port(port..port, PORT_PICK_ATTEMPTS, &mut fresh()), port);
        // One attempt at a free candidate finds it. The candidate is free when the kernel hands it
        // out, but another process may take it before the pick: a few tries tell that race from a
        // pick that never takes a free candidate.
        let found = (0..5).any(|_| {
            let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
            pick_free_port(free..free + 1, 1, &mut fresh()) == free
        });
        assert!(found, "a free single candidate was never picked in 5 tries");
    }

    #[test]
    fn a_port_is_handed_out_once_even_while_it_is_still_free() {
        // One free candidate: the first pick takes it; it is still free (nobody bound it), and the
        // second pick must not hand it out again.
        let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let mut handed_out = std::collections::BTreeSet::new();
        let first = pick_free_port(free..free + 1, 1, &mut handed_out);
        let second = pick_free_port(free..free + 1, PORT_PICK_ATTEMPTS, &mut handed_out);
        assert_ne!(first, second);
        assert!(handed_out.contains(&first) && handed_out.contains(&second));
        // Through free_port: many picks, no repeats.
        let picks: Vec<u16> = (0..200).map(|_| free_port()).collect();
        let distinct: std::collections::BTreeSet<u16> = picks.iter().copied().collect();
        assert_eq!(distinct.len(), picks.len(), "free_port handed a port out twice");
    }
}
