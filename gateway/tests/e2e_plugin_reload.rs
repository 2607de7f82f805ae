//! Plugin reload under traffic, through real `kvgate serve` processes: while many rooms move between
//! two gateways, both reload their plugins (`POST /plugins/reload`) four times: shm to a copy of
//! its own library, preference shm -> QUIC, QUIC -> shm, a changed shm setting. No room fails,
//! every byte is checked, each retired generation drains and is shut down ("drained", not by its
//! drain timeout), and new rooms run on the new generation. A reload naming a library that does not
//! load is refused with the reason (reply, `/plugins`, log) and changes nothing.

mod common;

use common::*;
use kvgate_demo::engine::{run_room, Engine};
use kvgate_demo::gateways::{GatewayPair, GatewayProcess, PairSettings};
use kvgate_demo::pool::KvShape;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Rooms in flight at once (one engine slot each).
const WORKERS: u64 = 256;
/// A retired generation must be closed within this (it holds only rooms of a few ms each).
const DRAIN_WAIT: Duration = Duration::from_secs(60);
const RELOAD_TIMEOUT: Duration = Duration::from_secs(40);

fn shm_library() -> PathBuf {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    kvgate_host::artifacts::built_or_build_cdylib("kvgate-plugin-shm-so", "kvgate_shm", &workspace)
        .unwrap_or_else(|e| panic!("{e}"))
}

fn rewrite_plugins(config: &Path, plugins: &str) {
    kvgate_demo::gateways::rewrite_plugins(config, plugins).unwrap()
}

async fn reload(gateway: &GatewayProcess) -> (u16, serde_json::Value) {
    let (code, body) = kvgate::admin_client::post(&gateway.admin, "/plugins/reload", RELOAD_TIMEOUT).await.unwrap();
    (code, serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}")))
}

async fn plugins_view(gateway: &GatewayProcess) -> serde_json::Value {
    let (code, body) = kvgate::admin_client::get(&gateway.admin, "/plugins").await.unwrap();
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// Reload both gateways with `plugins`; each must open `opened` and retire `retired`, and the
/// retired instances must then drain and close on both.
async fn reload_both(pair: &GatewayPair, plugins: &str, opened: &str, retired: &str) {
    for gateway in [&pair.prefill, &pair.decode] {
        rewrite_plugins(&gateway.config_path, plugins);
        let (code, outcome) = reload(gateway).await;
        assert_eq!(code, 200, "{}: {outcome}\n{}", gateway.name, gateway.log());
        assert_eq!(outcome["opened"], serde_json::json!([opened]), "{}: {outcome}", gateway.name);
        assert_eq!(outcome["retired"], serde_json::json!([retired]), "{}: {outcome}", gateway.name);
    }
    for gateway in [&pair.prefill, &pair.decode] {
        let what = format!("{} closes {retired} once drained", gateway.name);
        eventually(
            DRAIN_WAIT,
            &what,
            || async { plugin_instances(&gateway.admin).await.iter().any(|(w, s, _)| w == retired && s == "closed") },
            &|| gateway.log(),
        )
        .await;
        let all = plugin_instances(&gateway.admin).await;
        let old = all.iter().find(|(w, _, _)| w == retired).unwrap();
        assert_eq!(old.2, "drained", "{}: closed because it drained, not by its timeout: {all:?}", gateway.name);
        assert!(all.iter().any(|(w, s, _)| w == opened && s == "active"), "{}: {all:?}", gateway.name);
    }
}

/// Runs rooms on `WORKERS` slots until `stop`; counts rooms and keeps every failure.
struct Traffic {
    stop: Arc<AtomicBool>,
    rooms: Arc<AtomicU64>,
    failures: Arc<std::sync::Mutex<Vec<String>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Traffic {
    fn start(prefill: Arc<Engine>, decode: Arc<Engine>, shape: KvShape) -> Traffic {
        let (stop, rooms, failures) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicU64::new(0)),
            Arc::new(std::sync::Mutex::new(Vec::new())),
        );
        let tasks = (0..WORKERS)
            .map(|slot| {
                let (prefill, decode, shape) = (prefill.clone(), decode.clone(), shape);
                let (stop, rooms, failures) = (stop.clone(), rooms.clone(), failures.clone());
                tokio::spawn(async move {
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let room = 1_000_000 * (slot + 1) + n;
                        n += 1;
                        match run_room(&prefill, &decode, &shape, room, slot, slot).await {
                            Ok(r) if r.prefill.succeeded && r.decode.succeeded && r.verified => {}
                            Ok(r) => failures.lock().unwrap().push(format!("room {room}: {r:?}")),
                            Err(e) => failures.lock().unwrap().push(format!("room {room}: {e:#}")),
                        }
                        rooms.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        Traffic { stop, rooms, failures, tasks }
    }

    fn rooms(&self) -> u64 {
        self.rooms.load(Ordering::Relaxed)
    }

    /// Let at least `more` further rooms finish.
    async fn run_for(&self, more: u64) {
        let target = self.rooms() + more;
        eventually(Duration::from_secs(120), "traffic keeps moving", || async { self.rooms() >= target }, &|| {
            format!("{:?}", self.failures.lock().unwrap())
        })
        .await;
    }

    async fn stop(self) -> (u64, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        for task in self.tasks {
            task.await.unwrap();
        }
        let failures = self.failures.lock().unwrap().clone();
        (self.rooms.load(Ordering::Relaxed), failures)
    }
}

/// The log lines about plugin changes and failures (the first 40 failures), for a failed assertion.
fn reload_lines(gateway: &GatewayProcess) -> String {
    let log = plain_log(&gateway.log());
    let mut failed = 0;
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| {
            let failure = l.contains("room failed");
            failed += usize::from(failure);
            (failure && failed <= 40)
                || (!failure
                    && (l.contains("WARN")
                        || l.contains("ERROR")
                        || l.contains("reload")
                        || l.contains("plugin instance")
                        || l.contains("paired")))
        })
        .collect();
    lines.join("\n")
}

fn open_descriptors(gateway: &GatewayProcess) -> usize {
    std::fs::read_dir(format!("/proc/{}/fd", gateway.pid().unwrap())).map_or(0, |d| d.count())
}

/// Bytes of the files under `dir` (the engines' pools) that `gateway` has mapped: each plugin
/// instance maps the pools it moves bytes in or out of, so a closed generation must unmap its own.
/// (The plugin libraries in `dir` are left out: a library, once loaded, stays mapped.)
fn mapped_pool_bytes(gateway: &GatewayProcess, dir: &Path) -> u64 {
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", gateway.pid().unwrap())).unwrap_or_default();
    let dir = dir.display().to_string();
    maps.lines()
        .filter(|l| l.split_whitespace().nth(5).is_some_and(|path| path.starts_with(&dir) && !path.ends_with(".so")))
        .filter_map(|l| {
            l.split_whitespace()
                .next()?
                .split_once('-')
                .and_then(|(a, b)| Some(u64::from_str_radix(b, 16).ok()? - u64::from_str_radix(a, 16).ok()?))
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn plugins_are_swapped_and_reconfigured_under_traffic_without_failing_a_room() {
    let _serial = serial().await;
    let dir = work_dir();
    // A copy of the shm library at a path of its own: what an upgrade installs beside the old one.
    let copy = dir.path().join("libkvgate_shm-upgrade.so");
    std::fs::copy(shm_library(), &copy).unwrap();
    let garbage = dir.path().join("libkvgate_garbage.so");
    std::fs::write(&garbage, b"not a shared library").unwrap();
    let settings = PairSettings { plugin: "shm".into(), ..PairSettings::default() };
    let mut pair = GatewayPair::start(&binary(), dir.path(), &settings).await.unwrap();
    // 2 tokens x 128 KiB in 2 chunks: 256 KiB a room.
    let shape = KvShape::llama_8b_like(2, 2);
    let prefill = Arc::new(engine(dir.path(), &pair.prefill.socket, "prefill", &shape, WORKERS).await);
    let decode = Arc::new(engine(dir.path(), &pair.decode.socket, "decode", &shape, WORKERS).await);
    let traffic = Traffic::start(prefill.clone(), decode.clone(), shape);
    traffic.run_for(WORKERS).await;
    let descriptors_before = (open_descriptors(&pair.prefill), open_descriptors(&pair.decode));
    let mapped_before = (mapped_pool_bytes(&pair.prefill, dir.path()), mapped_pool_bytes(&pair.decode, dir.path()));
    assert!(mapped_before.0 > 0 && mapped_before.1 > 0, "the gateways map the engines' pools: {mapped_before:?}");

    let library = toml::Value::String(copy.display().to_string());
    // 1. shm to a copy of its own library.
    reload_both(&pair, &format!("preference = [\"shm\"]\nlibraries = [{library}]\n"), "shm@2", "shm").await;
    traffic.run_for(WORKERS).await;
    // 2. shm -> QUIC, 3. and back.
    reload_both(&pair, &format!("preference = [\"quic\"]\nlibraries = [{library}]\n"), "quic", "shm@2").await;
    traffic.run_for(WORKERS).await;
    reload_both(&pair, &format!("preference = [\"shm\"]\nlibraries = [{library}]\n"), "shm@3", "quic").await;
    traffic.run_for(WORKERS).await;
    // 4. A changed setting reopens the plugin with it.
    reload_both(
        &pair,
        &format!("preference = [\"shm\"]\nlibraries = [{library}]\n[plugins.config.shm]\nworkers = 2\n"),
        "shm@4",
        "shm@3",
    )
    .await;
    traffic.run_for(WORKERS).await;

    // 5. A library that does not load: refused with the reason, the running plugins keep serving.
    let bad = format!(
        "preference = [\"shm\"]\nlibraries = [{library}, {}]\n[plugins.config.shm]\nworkers = 2\n",
        toml::Value::String(garbage.display().to_string())
    );
    rewrite_plugins(&pair.prefill.config_path, &bad);
    let (code, outcome) = reload(&pair.prefill).await;
    assert_eq!(code, 409, "{outcome}");
    assert_eq!(outcome["applied"], false);
    let error = outcome["error"].as_str().unwrap();
    assert!(error.contains("libkvgate_garbage.so") && error.contains("not loaded"), "{error}");
    let view = plugins_view(&pair.prefill).await;
    assert_eq!(view["last_reload"]["error"].as_str(), Some(error), "{view}");
    assert!(plain_log(&pair.prefill.log()).contains("plugin reload refused"), "the log says why");
    traffic.run_for(WORKERS).await;
    let active: Vec<String> = plugin_instances(&pair.prefill.admin)
        .await
        .into_iter()
        .filter(|(_, s, _)| s == "active")
        .map(|(w, _, _)| w)
        .collect();
    assert_eq!(active, ["shm@4"]);

    let (rooms, failures) = traffic.stop().await;
    assert!(
        failures.is_empty(),
        "{} of {rooms} rooms failed: {:#?}\nprefill:\n{}\ndecode:\n{}",
        failures.len(),
        &failures[..failures.len().min(3)],
        reload_lines(&pair.prefill),
        reload_lines(&pair.decode)
    );
    assert!(rooms >= 6 * WORKERS, "{rooms} rooms");
    eprintln!("{rooms} rooms, {WORKERS} at a time, none failed");
    for gateway in [&pair.prefill, &pair.decode] {
        let text = metrics(&gateway.admin).await;
        assert!(!text.contains("kvgate_room_failures_total{"), "{}: no failure counted\n{text}", gateway.name);
        for (plugin, generation) in [("shm", 1), ("shm", 2), ("quic", 1), ("shm", 3)] {
            let series =
                format!("kvgate_plugin_instances{{plugin=\"{plugin}\",generation=\"{generation}\",state=\"closed\"}}");
            assert_eq!(sample(&text, &series), Some(0.0), "{}: {series}\n{text}", gateway.name);
        }
        assert_eq!(
            sample(&text, "kvgate_plugin_instances{plugin=\"shm\",generation=\"4\",state=\"active\"}"),
            Some(1.0),
            "{text}"
        );
    }
    // Every generation moved rooms (the sender counts a room's bytes under the instance's name).
    let text = metrics(&pair.prefill.admin).await;
    for wire in ["shm", "shm@2", "quic", "shm@3", "shm@4"] {
        let count = sample(&text, &format!("kvgate_transfer_bytes_count{{plugin=\"{wire}\"}}")).unwrap_or(0.0);
        assert!(count > 0.0, "rooms went through {wire}\n{text}");
    }
    // The closed generations gave their descriptors back (their transport objects are dropped; a
    // little slack for a connection of the admin listener still closing).
    let descriptors_after = (open_descriptors(&pair.prefill), open_descriptors(&pair.decode));
    eprintln!("descriptors (prefill, decode): {descriptors_before:?} -> {descriptors_after:?}");
    assert!(
        descriptors_after.0 <= descriptors_before.0 + 2 && descriptors_after.1 <= descriptors_before.1 + 2,
        "{descriptors_before:?} -> {descriptors_after:?}"
    );
    // And their mappings of the pools: the one active generation maps what the first one did.
    let mapped_after = (mapped_pool_bytes(&pair.prefill, dir.path()), mapped_pool_bytes(&pair.decode, dir.path()));
    eprintln!("pool bytes mapped (prefill, decode): {mapped_before:?} -> {mapped_after:?}");
    assert!(
        mapped_after.0 <= mapped_before.0 && mapped_after.1 <= mapped_before.1,
        "{mapped_before:?} -> {mapped_after:?}"
    );
    pair.stop();
}

/// The conformance mutants' library; with `KVGATE_MUTANT=unavailable` in a gateway's environment it
/// is the plugin that reports unavailable everywhere.
fn mutant_library() -> PathBuf {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    kvgate_host::artifacts::built_or_build_cdylib("kvgate-mutants", "kvgate_mutants", &workspace)
        .unwrap_or_else(|e| panic!("{e}"))
}

fn with_mutant(defect: &str) -> PairSettings {
    let env = vec![("KVGATE_MUTANT".to_string(), defect.to_string())];
    PairSettings { env_prefill: env.clone(), env_decode: env, ..PairSettings::default() }
}

/// Reload `gateway` with `plugins`; it must be refused with an error containing every `needle`,
/// leave `active` the one active instance, and a room must still move.
async fn refused(gateway: &GatewayProcess, plugins: &str, needles: &[&str], active: &str) -> String {
    rewrite_plugins(&gateway.config_path, plugins);
    let (code, outcome) = reload(gateway).await;
    assert_eq!(code, 409, "{outcome}");
    let error = outcome["error"].as_str().unwrap().to_string();
    for needle in needles {
        assert!(error.contains(needle), "{needle:?} not in {error}");
    }
    assert_eq!(plugins_view(gateway).await["last_reload"]["error"].as_str(), Some(error.as_str()));
    let all = plugin_instances(&gateway.admin).await;
    let open: Vec<&(String, String, String)> = all.iter().filter(|(_, s, _)| s != "closed").collect();
    assert_eq!(open.len(), 1, "{all:?}");
    assert_eq!((open[0].0.as_str(), open[0].1.as_str()), (active, "active"), "{all:?}");
    error
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_cannot_be_applied_changes_nothing_and_says_why() {
    let _serial = serial().await;
    let dir = work_dir();
    let copy = dir.path().join("libkvgate_shm-next.so");
    std::fs::copy(shm_library(), &copy).unwrap();
    let copy = toml::Value::String(copy.display().to_string());
    let unavailable = toml::Value::String(mutant_library().display().to_string());
    let mut pair = GatewayPair::start(&binary(), dir.path(), &with_mutant("unavailable")).await.unwrap();
    let shape = KvShape::llama_8b_like(2, 2);
    let prefill = engine(dir.path(), &pair.prefill.socket, "prefill", &shape, 1).await;
    let decode = engine(dir.path(), &pair.decode.socket, "decode", &shape, 1).await;
    let gateway = &pair.prefill;
    let config = std::fs::read_to_string(&gateway.config_path).unwrap();

    // A change outside [plugins] names what needs a restart and applies nothing (not even the
    // plugin part beside it).
    std::fs::write(&gateway.config_path, config.replace("heartbeat_misses = 5", "heartbeat_misses = 6")).unwrap();
    let error = refused(
        gateway,
        "preference = [\"shm\"]\n[plugins.config.shm]\nworkers = 2\n",
        &["[peer_link]", "restart"],
        "shm",
    )
    .await;
    assert!(!error.contains("scheduler"), "{error}");
    std::fs::write(&gateway.config_path, &config).unwrap();
    // An invalid setting, named.
    refused(
        gateway,
        "preference = [\"shm\"]\n[plugins.config.shm]\nworkers = \"many\"\n",
        &["plugins.config.shm", "invalid_config"],
        "shm",
    )
    .await;
    // A plugin that reports unavailable on this machine.
    refused(
        gateway,
        &format!("preference = [\"mutant-unavailable\", \"shm\"]\nlibraries = [{unavailable}]\n"),
        &["mutant-unavailable", "unavailable"],
        "shm",
    )
    .await;
    // plugins.max_mapped_libraries, just past it (the mutant's library is mapped already) ...
    let at_most_one = format!("preference = [\"shm\"]\nlibraries = [{copy}]\nmax_mapped_libraries = 1\n");
    refused(gateway, &at_most_one, &["plugins.max_mapped_libraries = 1", "never unloaded"], "shm").await;
    let run = |room| run_room(&prefill, &decode, &shape, room, 0, 0);
    let r = run(1).await.unwrap();
    assert!(r.prefill.succeeded && r.decode.succeeded && r.verified, "{r:?}");
    // ... and at it.
    rewrite_plugins(
        &gateway.config_path,
        &format!("preference = [\"shm\"]\nlibraries = [{copy}]\nmax_mapped_libraries = 2\n"),
    );
    let (code, outcome) = reload(gateway).await;
    assert_eq!((code, &outcome["opened"]), (200, &serde_json::json!(["shm@2"])), "{outcome}");
    let r = run(2).await.unwrap();
    assert!(r.prefill.succeeded && r.decode.succeeded && r.verified, "{r:?}");

    // The command line says the same and exits 1 when refused, 0 when applied.
    let cli = |args: &[&str]| std::process::Command::new(binary()).args(args).output().unwrap();
    rewrite_plugins(&gateway.config_path, &format!("preference = [\"shm\"]\nlibraries = [{copy}]\nmax_mapped_libraries = 2\n[plugins.config.shm]\nworkers = \"many\"\n"));
    let out = cli(&["plugins", "reload", "--admin", &gateway.admin]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.contains("plugin reload refused (the running plugins stay in service)")
            && stdout.contains("invalid_config"),
        "{stdout}"
    );
    rewrite_plugins(&gateway.config_path, &format!("preference = [\"shm\"]\nlibraries = [{copy}]\nmax_mapped_libraries = 2\n[plugins.config.shm]\nworkers = 2\n"));
    let out = cli(&["plugins", "reload", "--config", &gateway.config_path.display().to_string()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("plugin reload applied: opened shm@3; kept -; retired shm@2"), "{stdout}");

    // SIGHUP reloads too.
    rewrite_plugins(&gateway.config_path, &format!("preference = [\"shm\"]\nlibraries = [{copy}]\nmax_mapped_libraries = 2\n[plugins.config.shm]\nworkers = 3\n"));
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(gateway.pid().unwrap()), nix::sys::signal::Signal::SIGHUP)
        .unwrap();
    eventually(
        Duration::from_secs(20),
        "SIGHUP opens shm@4",
        || async { plugin_instances(&gateway.admin).await.iter().any(|(w, s, _)| w == "shm@4" && s == "active") },
        &|| gateway.log(),
    )
    .await;
    let r = run(3).await.unwrap();
    assert!(r.prefill.succeeded && r.decode.succeeded && r.verified, "{r:?}");
    pair.stop();
}
