//! `kvgate demo`: starts a prefill and a decode gateway on this machine (two `kvgate serve` child
//! processes with generated configs), synthetic engines that register KV pools and move realistic
//! KV caches through every plugin available here, verifies checksums, prints a table, then runs a
//! short fault act (abort storm, frozen decode gateway) and a swap act (the transport changed under
//! traffic by plugin reloads, no room lost). Never needs anything but this binary.

pub mod cpu;
pub mod engine;
pub mod faults;
pub mod gateways;
pub mod pool;
pub mod report;
pub mod swap;

use anyhow::Context;
use engine::{run_room, Engine};
use gateways::{GatewayPair, PairSettings};
use pool::{KvPool, KvShape};
use report::PluginRun;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug, Clone)]
pub struct DemoArgs {
    /// Requests (rooms) per plugin.
    #[arg(long, default_value_t = 16)]
    pub rooms: u64,
    /// Tokens per request (128 KiB of KV per token: 32 layers x K,V x 8 heads x 128 x bf16).
    #[arg(long, default_value_t = 512)]
    pub tokens: u64,
    /// Chunks per part (chunked prefill); every request has 2 parts (tensor-parallel ranks).
    #[arg(long, default_value_t = 4)]
    pub chunks: u64,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 4)]
    pub inflight: u64,
    /// Plugins to run, in order.
    #[arg(long, value_delimiter = ',', default_value = "shm,quic")]
    pub plugins: Vec<String>,
    /// Skip the fault act.
    #[arg(long)]
    pub no_faults: bool,
    /// Skip the swap act (shm -> quic -> shm by plugin reloads under traffic).
    #[arg(long)]
    pub no_swap: bool,
    /// Where pools, configs and gateway logs go (default: a fresh folder in /dev/shm or the temp dir).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

fn work_dir(args: &DemoArgs) -> anyhow::Result<(PathBuf, Option<tempfile::TempDir>)> {
    if let Some(d) = &args.dir {
        std::fs::create_dir_all(d)?;
        return Ok((d.clone(), None));
    }
    let base = if Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
    let dir = tempfile::Builder::new().prefix("kvgate-demo-").tempdir_in(base)?;
    Ok((dir.path().to_path_buf(), Some(dir)))
}

pub fn run(args: DemoArgs) -> i32 {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    match runtime.block_on(run_async(args)) {
        Ok(true) => 0,
        Ok(false) => 1,
        Err(e) => {
            eprintln!("kvgate demo failed: {e:#}");
            1
        }
    }
}

async fn run_async(args: DemoArgs) -> anyhow::Result<bool> {
    let binary = std::env::current_exe().context("locate the kvgate binary")?;
    let (dir, _guard) = work_dir(&args)?;
    let shape = KvShape::llama_8b_like(args.tokens, args.chunks);
    println!(
        "kvgate demo: {} rooms per plugin, each {} tokens = {:.1} MiB of KV (32 layers x K,V x 8 heads x 128 x bf16), 2 parts x {} chunks, {} in flight",
        args.rooms,
        args.tokens,
        shape.request_bytes() as f64 / (1 << 20) as f64,
        args.chunks,
        args.inflight
    );
    println!("work dir: {}", dir.display());
    let mut runs = Vec::new();
    for plugin in &args.plugins {
        runs.push(run_plugin(&binary, &dir, plugin, &shape, &args).await);
    }
    println!();
    print!("{}", report::table(&runs));
    println!();
    print!("{}", report::legend(std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1), args.inflight));
    let transfers_ok =
        runs.iter().all(|r| r.unavailable.is_some() || (r.errors.is_empty() && r.verified() == r.results.len()));
    let faults_ok = if args.no_faults { true } else { faults::run(&binary, &dir, &shape).await? };
    let swap_ok = if args.no_swap { true } else { swap::run(&binary, &dir).await? };
    Ok(transfers_ok && faults_ok && swap_ok)
}

/// Start a pair for `plugin`, create and register pools, run `args.rooms` rooms, stop the pair.
async fn run_plugin(binary: &Path, dir: &Path, plugin: &str, shape: &KvShape, args: &DemoArgs) -> PluginRun {
    let mut run = PluginRun {
        plugin: plugin.to_string(),
        results: vec![],
        errors: vec![],
        wall: Duration::ZERO,
        unavailable: None,
        gateway_cpu: Duration::ZERO,
        engine_cpu: Duration::ZERO,
    };
    // Both gateways are on this machine: QUIC gets its loopback tuning (its defaults are for real networks).
    let plugin_config = if plugin == "quic" { gateways::QUIC_LOOPBACK_CONFIG.to_string() } else { String::new() };
    let settings = PairSettings { plugin: plugin.to_string(), plugin_config, ..PairSettings::default() };
    let mut pair = match GatewayPair::start(binary, dir, &settings).await {
        Ok(p) => p,
        Err(e) => {
            let text = format!("{e:#}");
            run.unavailable = Some(
                text.lines()
                    .find(|l| l.contains("unavailable") || l.contains("not opened"))
                    .unwrap_or("gateways did not start")
                    .trim()
                    .to_string(),
            );
            eprintln!("{plugin}: {text}");
            return run;
        }
    };
    let cpu = || {
        let of = |pid: Option<i32>| pid.and_then(cpu::process_cpu).unwrap_or_default();
        (of(pair.prefill.pid()) + of(pair.decode.pid()), of(Some(std::process::id() as i32)))
    };
    let cpu_before = cpu();
    let moved = move_rooms(&pair, dir, plugin, shape, args).await;
    let cpu_after = cpu();
    run.gateway_cpu = cpu_after.0.saturating_sub(cpu_before.0);
    run.engine_cpu = cpu_after.1.saturating_sub(cpu_before.1);
    match moved {
        Ok((results, errors, wall)) => {
            run.results = results;
            run.errors = errors;
            run.wall = wall;
        }
        Err(e) => run.errors.push(format!("{e:#}")),
    }
    for e in &run.errors {
        eprintln!("{plugin}: {e}");
    }
    pair.stop();
    run
}

async fn move_rooms(
    pair: &GatewayPair,
    dir: &Path,
    plugin: &str,
    shape: &KvShape,
    args: &DemoArgs,
) -> anyhow::Result<(Vec<engine::RoomResult>, Vec<String>, Duration)> {
    let slots = args.inflight.max(1);
    let src_pool = KvPool::create(dir, &format!("prefill-pool-{plugin}"), shape.request_bytes(), slots)?;
    let dst_pool = KvPool::create(dir, &format!("decode-pool-{plugin}"), shape.request_bytes(), slots)?;
    let prefill = Arc::new(Engine::connect(&pair.prefill.socket, src_pool, "prefill KV pool").await?);
    let decode = Arc::new(Engine::connect(&pair.decode.socket, dst_pool, "decode KV pool").await?);
    let (slot_tx, slot_rx) = async_channel_of_slots(slots);
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let terminal = std::io::IsTerminal::is_terminal(&std::io::stdout());
    let progress =
        tokio::spawn(progress_line(plugin.to_string(), done.clone(), args.rooms, shape.request_bytes(), terminal));
    let mut tasks = Vec::new();
    for i in 0..args.rooms {
        let slot = slot_rx.lock().await.recv().await.context("slot queue")?;
        let (prefill, decode, shape, slot_tx, done) =
            (prefill.clone(), decode.clone(), *shape, slot_tx.clone(), done.clone());
        let room = room_id(plugin, i);
        tasks.push(tokio::spawn(async move {
            let result = run_room(&prefill, &decode, &shape, room, slot, slot).await;
            done.fetch_add(1, Ordering::Relaxed);
            let _ = slot_tx.send(slot).await;
            result
        }));
    }
    let mut results = Vec::new();
    let mut errors = Vec::new();
    for t in tasks {
        match t.await? {
            Ok(r) => results.push(r),
            Err(e) => errors.push(format!("{e:#}")),
        }
    }
    let wall = started.elapsed();
    progress.abort();
    let finished =
        format!("{plugin}: {}/{} rooms done in {:.2} s", results.len() + errors.len(), args.rooms, wall.as_secs_f64());
    if terminal {
        println!("\r{finished:60}");
    } else {
        println!("{finished}");
    }
    Ok((results, errors, wall))
}

/// Room ids: distinct per plugin run so logs are unambiguous.
fn room_id(plugin: &str, i: u64) -> u64 {
    let base = plugin.bytes().fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(b as u64)) % 1000;
    (base + 1) * 1_000_000 + i
}

type SlotQueue = (tokio::sync::mpsc::Sender<u64>, Arc<tokio::sync::Mutex<tokio::sync::mpsc::Receiver<u64>>>);

fn async_channel_of_slots(slots: u64) -> SlotQueue {
    let (tx, rx) = tokio::sync::mpsc::channel(slots as usize);
    for s in 0..slots {
        tx.try_send(s).expect("capacity");
    }
    (tx, Arc::new(tokio::sync::Mutex::new(rx)))
}

/// Progress while a plugin's rooms run: one line rewritten in place every 500 ms on a terminal; a
/// line of its own every 2 s when the output goes to a file or a pipe (no carriage returns there).
async fn progress_line(plugin: String, done: Arc<AtomicU64>, total: u64, bytes_per_room: u64, terminal: bool) {
    use std::io::Write;
    let started = Instant::now();
    let every = Duration::from_millis(if terminal { 500 } else { 2000 });
    loop {
        tokio::time::sleep(every).await;
        let n = done.load(Ordering::Relaxed);
        let gb = (n * bytes_per_room) as f64 / 1e9;
        let line = format!("{plugin}: {n}/{total} rooms, {gb:.2} GB, {:.1} s", started.elapsed().as_secs_f64());
        if terminal {
            print!("\r{line}");
            let _ = std::io::stdout().flush();
        } else {
            println!("{line}");
        }
    }
}
