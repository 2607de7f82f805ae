//! `kvgate bench`: the data path (every available plugin x block size x blocks per transfer, through
//! two `kvgate serve` gateways and the engine API) and the control path, each measured against its
//! reference in the same run; a progress bar, a table, `--json`, `--plot` (SVG), `--png`, `--markdown`.
//! It only measures and reports: never a pass/fail on timing, except the named targets it prints.

pub mod control;
pub mod copy_limit;
pub mod core_abort;
pub mod datapath;
pub mod lane_cost;
pub mod link;
pub mod matrix;
pub mod peers;
pub mod plan;
pub mod plot;
pub mod png_plot;
pub mod reference;
pub mod report;
pub mod results;
pub mod room_cost;
pub mod rounds;
pub mod sglang_room;
pub mod stats;
pub mod svg;
pub mod syscalls;
pub mod system;

use anyhow::Context;
use datapath::{run_cell, Rig};
use indicatif::{ProgressBar, ProgressStyle};
use plan::{parse_size, Plan};
use reference::CopyBudget;
use results::{BenchReport, ControlPath, PluginResult};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// The short matrix (under 2 minutes on 2 cores); without it the full one (under 15).
    #[arg(long)]
    pub quick: bool,
    /// Plugins to measure, in order (`ucx` = `ucx-sm,ucx-tcp`: UCX over shared memory and over TCP);
    /// one that cannot run here is reported as skipped with why.
    #[arg(long, value_delimiter = ',', default_value = "shm,quic,ucx,nvlink")]
    pub plugins: Vec<String>,
    /// The UCX plugin library (default: `libkvgate_ucx.so` next to this `kvgate`, where
    /// `cargo build --release -p kvgate-plugin-ucx-so` puts it).
    #[arg(long)]
    pub ucx_library: Option<PathBuf>,
    /// Write the results as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write throughput against block size per plugin (reference dashed) as SVG.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Write the same plot as PNG (drawn without text labels; the SVG has them).
    #[arg(long)]
    pub png: Option<PathBuf>,
    /// Write the BENCHMARKS.md page (figures, this command, ratios against the targets).
    #[arg(long)]
    pub markdown: Option<PathBuf>,
    /// Override the block sizes (e.g. `4K,1M,64M`).
    #[arg(long, value_delimiter = ',', value_parser = parse_size)]
    pub block_sizes: Option<Vec<u64>>,
    /// Override the blocks per transfer (e.g. `1,100,10000`).
    #[arg(long, value_delimiter = ',')]
    pub blocks: Option<Vec<u64>>,
    /// Cells moving more than this many MiB per transfer are not run.
    #[arg(long)]
    pub max_transfer_mib: Option<u64>,
    /// Each cell (and its reference) runs at least this long.
    #[arg(long)]
    pub cell_ms: Option<u64>,
    /// Most rooms in flight at once in a data-path cell (fewer when fewer transfers fit the pools).
    #[arg(long)]
    pub inflight: Option<u64>,
    /// Each round of a plugin's target cell (and its reference) runs at least this long.
    #[arg(long)]
    pub target_cell_ms: Option<u64>,
    /// How many rounds each plugin's target cell runs, each with its own reference (the median
    /// round is reported; 1..=15); the engine-API abort target runs as many rounds of `--api-aborts`
    /// (the round with the median p99 is reported).
    #[arg(long)]
    pub target_rounds: Option<u64>,
    /// Rooms for the rooms-per-second figure.
    #[arg(long)]
    pub control_rooms: Option<u64>,
    /// Rooms held in flight in the in-process core while aborts are timed (target: 100 000).
    #[arg(long)]
    pub core_rooms: Option<u64>,
    /// Aborts timed in the core.
    #[arg(long)]
    pub core_aborts: Option<u64>,
    /// Rooms held in flight through the engine API while aborts are timed.
    #[arg(long)]
    pub api_rooms: Option<u64>,
    /// Aborts timed through the engine API, per round (see `--target-rounds`).
    #[arg(long)]
    pub api_aborts: Option<u64>,
    /// Rooms in flight when the decode gateway is frozen.
    #[arg(long)]
    pub frozen_rooms: Option<u64>,
    /// SGLang-shaped rooms (122 parts, 4 chunks) moved each way: one call per part per chunk, and batched.
    #[arg(long)]
    pub sglang_rooms: Option<u64>,
    /// 4 KiB rooms moved one after the other for the per-room cost (latency, CPU per room).
    #[arg(long)]
    pub room_cost_rooms: Option<u64>,
    /// Minimal rooms moved through batched calls for the batched rooms-per-second figure.
    #[arg(long)]
    pub batched_rooms: Option<u64>,
    /// Side by side with other transfer layers on this host: `nixl`, `mooncake` (run from the source
    /// tree's bench/peers in a virtual environment created once under target/peers-venv). The same
    /// cells through kvgate (shm, UCX over TCP, QUIC) and each peer, one transfer in flight, in
    /// alternating rounds; prints the table and nothing else.
    #[arg(long, value_delimiter = ',')]
    pub peers: Option<Vec<String>>,
    /// Measure only the per-room cost and the batched rooms per second (and print them), nothing else.
    #[arg(long)]
    pub room_cost_only: bool,
    /// Where pools, configs and gateway logs go (default: a fresh folder in /dev/shm, removed after).
    /// It must be on a shared-memory filesystem (tmpfs): the shm plugin refuses other pool files.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Instead of the loopback matrix: QUIC and UCX-TCP between two gateways on the two-host test bed
    /// (two network namespaces joined by a shaped link; root and iperf3 needed), against iperf3 over
    /// the same link. `a`, `b`, `c` or e.g. `delay=1ms,loss=0.1%,rate=10gbit` (docs/netbed.md).
    #[arg(long, value_parser = kvgate_netbed::Profile::parse)]
    pub link_profile: Option<kvgate_netbed::Profile>,
}

impl BenchArgs {
    pub fn plan(&self) -> Plan {
        let mut plan = if self.quick { Plan::quick() } else { Plan::full() };
        if let Some(v) = &self.block_sizes {
            plan.block_sizes_bytes = v.clone();
        }
        if let Some(v) = &self.blocks {
            plan.blocks_per_transfer = v.clone();
        }
        if let Some(v) = self.max_transfer_mib {
            plan.max_transfer_bytes = v.saturating_mul(1 << 20);
        }
        let set = |field: &mut u64, v: Option<u64>| {
            if let Some(v) = v {
                *field = v;
            }
        };
        set(&mut plan.cell_budget_ms, self.cell_ms);
        set(&mut plan.target_cell_budget_ms, self.target_cell_ms);
        set(&mut plan.inflight_rooms, self.inflight);
        set(&mut plan.target_rounds, self.target_rounds);
        set(&mut plan.control_rooms, self.control_rooms);
        set(&mut plan.core_rooms_in_flight, self.core_rooms);
        set(&mut plan.core_aborts, self.core_aborts);
        set(&mut plan.api_rooms_in_flight, self.api_rooms);
        set(&mut plan.api_aborts, self.api_aborts);
        set(&mut plan.frozen_rooms, self.frozen_rooms);
        set(&mut plan.sglang_rooms, self.sglang_rooms);
        set(&mut plan.room_cost_rooms, self.room_cost_rooms);
        set(&mut plan.batched_rooms, self.batched_rooms);
        plan.control_concurrency = plan.control_concurrency.min(plan.control_rooms);
        plan.api_aborts = plan.api_aborts.min(plan.api_rooms_in_flight);
        plan
    }
}

pub fn run(args: BenchArgs) -> i32 {
    if let Some(profile) = &args.link_profile {
        return run_link(&args, profile);
    }
    let plan = args.plan();
    let problems = plan.validate();
    if !problems.is_empty() {
        for p in problems {
            eprintln!("kvgate bench: {p}");
        }
        return 2;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    if args.room_cost_only {
        return runtime.block_on(run_room_cost_only(&args, &plan));
    }
    if let Some(wanted) = &args.peers {
        return runtime.block_on(run_peers(&args, &plan, wanted));
    }
    match runtime.block_on(run_async(&args, &plan)) {
        Ok(report) => {
            let broken = report.data_path.iter().flat_map(|p| &p.cells).any(|c| c.failures > 0 || !c.verified);
            match write_outputs(&args, &report) {
                Ok(()) if broken => {
                    eprintln!("kvgate bench: some rooms failed or moved wrong bytes (see the table)");
                    1
                }
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("kvgate bench: {e:#}");
                    1
                }
            }
        }
        Err(e) => {
            eprintln!("kvgate bench failed: {e:#}");
            1
        }
    }
}

/// `--room-cost-only`: the per-room cost line and nothing else (for profiling the per-room path).
async fn run_room_cost_only(args: &BenchArgs, plan: &Plan) -> i32 {
    let measured = async {
        let binary = std::env::current_exe().context("locate the kvgate binary")?;
        let (dir, _guard) = work_dir(args)?;
        let cost = room_cost::measure(&binary, &dir, plan.room_cost_rooms).await?;
        let batched = room_cost::measure_batched(&binary, &dir, plan.batched_rooms).await?;
        let lane_cost = lane_cost::measure(&binary, &dir, plan.room_cost_rooms).await?;
        let lane_batched = lane_cost::measure_batched(&binary, &dir, plan.batched_rooms).await?;
        anyhow::Ok(ControlPath {
            room_cost: Some(cost),
            batched_rooms: Some(batched),
            lane_room_cost: Some(lane_cost),
            lane_batched_rooms: Some(lane_batched),
            ..ControlPath::default()
        })
    };
    match measured.await {
        Ok(control) => {
            print!("{}", report::control_lines_of(&control));
            if let Some(path) = &args.json {
                if let Err(e) = std::fs::write(path, serde_json::to_string_pretty(&control).unwrap_or_default() + "\n")
                {
                    eprintln!("kvgate bench: write {}: {e}", path.display());
                    return 1;
                }
            }
            let failed = [&control.room_cost, &control.lane_room_cost].into_iter().flatten().any(|c| c.failures > 0);
            i32::from(failed)
        }
        Err(e) => {
            eprintln!("kvgate bench --room-cost-only failed: {e:#}");
            1
        }
    }
}

/// `--peers`: kvgate beside NIXL and Mooncake (`peers.rs`).
async fn run_peers(args: &BenchArgs, plan: &Plan, wanted: &[String]) -> i32 {
    let cells: Vec<(u64, u64)> = match (&args.block_sizes, &args.blocks) {
        (None, None) => peers::PEER_CELLS.to_vec(),
        _ => plan.cells(),
    };
    let result = async {
        let binary = std::env::current_exe().context("locate the kvgate binary")?;
        let (dir, _guard) = work_dir(args)?;
        let ucx = matrix::ucx_library(args.ucx_library.as_deref());
        peers::run(&binary, &dir, wanted, plan, &cells, &ucx).await
    };
    match result.await {
        Ok(rows) => {
            print!("{}", peers::table(&rows));
            if let Some(path) = &args.markdown {
                let m = system::machine();
                let machine =
                    format!("{} CPUs ({}), {:.0} GiB memory, kernel {}", m.cpus, m.cpu_model, m.memory_gib, m.kernel);
                let load = system::load_average();
                let section =
                    peers::markdown_section(&rows, &system::command_line(), &machine, &system::utc_now(), &load);
                let page = std::fs::read_to_string(path).unwrap_or_default();
                if let Err(e) = std::fs::write(path, peers::splice_section(&page, &section)) {
                    eprintln!("kvgate bench: write {}: {e}", path.display());
                    return 1;
                }
                println!("wrote the side-by-side section of {}", path.display());
            }
            if let Some(path) = &args.json {
                if let Err(e) = std::fs::write(path, serde_json::to_string_pretty(&rows).unwrap_or_default() + "\n") {
                    eprintln!("kvgate bench: write {}: {e}", path.display());
                    return 1;
                }
            }
            i32::from(rows.iter().any(|r| !r.verified))
        }
        Err(e) => {
            eprintln!("kvgate bench --peers failed: {e:#}");
            1
        }
    }
}

/// `--link-profile`: the two-host bench (`link.rs`).
fn run_link(args: &BenchArgs, profile: &kvgate_netbed::Profile) -> i32 {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    let result = runtime.block_on(async {
        let binary = std::env::current_exe().context("locate the kvgate binary")?;
        let (dir, _guard) = work_dir(args)?;
        let plugins = if args.plugins == BenchArgs::default_plugins() {
            vec!["quic".to_string(), "ucx-tcp".to_string()]
        } else {
            args.plugins.clone()
        };
        let inflight = args.inflight.unwrap_or(4);
        link::run(
            &binary,
            &dir,
            profile,
            &plugins,
            &matrix::ucx_library(args.ucx_library.as_deref()),
            inflight,
            args.quick,
            args.json.as_deref(),
        )
        .await
    });
    result.unwrap_or_else(|e| {
        eprintln!("kvgate bench --link-profile failed: {e:#}");
        1
    })
}

impl BenchArgs {
    fn default_plugins() -> Vec<String> {
        ["shm", "quic", "ucx", "nvlink"].map(String::from).to_vec()
    }
}

fn work_dir(args: &BenchArgs) -> anyhow::Result<(PathBuf, Option<tempfile::TempDir>)> {
    if let Some(d) = &args.dir {
        std::fs::create_dir_all(d)?;
        return Ok((d.clone(), None));
    }
    let base = if Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
    let dir = tempfile::Builder::new().prefix("kvgate-bench-").tempdir_in(base)?;
    Ok((dir.path().to_path_buf(), Some(dir)))
}

async fn run_async(args: &BenchArgs, plan: &Plan) -> anyhow::Result<BenchReport> {
    let started = Instant::now();
    let load_at_start = system::load_average();
    let binary = std::env::current_exe().context("locate the kvgate binary")?;
    let (dir, _guard) = work_dir(args)?;
    let cells = plan.cells();
    let ucx_library = matrix::ucx_library(args.ucx_library.as_deref());
    let names = matrix::expand_names(&args.plugins);
    let entries: Vec<(String, Result<matrix::MatrixEntry, String>)> =
        names.iter().map(|n| (n.clone(), matrix::entry(n, &ucx_library))).collect();
    let runnable = entries.iter().filter(|(_, e)| e.is_ok()).count() as u64;
    let bar = ProgressBar::new(runnable * cells.len() as u64 + 4);
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} {msg}").expect("template"),
    );
    bar.enable_steady_tick(Duration::from_millis(200));
    println!(
        "kvgate bench{}: {} cells per plugin (transfers up to {}), up to {} rooms in flight per cell, >= {} ms per cell ({} target-cell rounds of >= {} ms); work dir {}",
        if args.quick { " --quick" } else { "" },
        cells.len(),
        stats::size_label(plan.slot_bytes()),
        plan.inflight_rooms,
        plan.cell_budget_ms,
        plan.target_rounds,
        plan.target_cell_budget_ms,
        dir.display()
    );
    if !plan.left_out().is_empty() {
        let left: Vec<String> = plan.left_out().iter().map(|(b, n)| format!("{}x{n}", stats::size_label(*b))).collect();
        println!("not run (over {} per transfer): {}", stats::size_label(plan.max_transfer_bytes), left.join(", "));
    }
    let mut data_path = Vec::new();
    for (name, entry) in &entries {
        data_path.push(match entry {
            Ok(entry) => bench_plugin(&binary, &dir, entry, plan, &bar).await,
            Err(why) => PluginResult {
                plugin: name.clone(),
                reference: "none".into(),
                status: "skipped".into(),
                skip_reason: why.clone(),
                cells: vec![],
            },
        });
    }
    let control_path = bench_control(&binary, &dir, plan, &bar).await;
    bar.finish_and_clear();
    let mut report = BenchReport {
        command: system::command_line(),
        kvgate_version: env!("CARGO_PKG_VERSION").to_string(),
        machine: results::Machine { load_average_start: load_at_start, ..system::machine() },
        finished_utc: system::utc_now(),
        wall_seconds: started.elapsed().as_secs_f64(),
        data_path,
        control_path,
        targets: vec![],
    };
    report.targets = report::targets(&report);
    println!();
    print!("{}", report::table(&report));
    println!(
        "wall time {:.1} s; load average at the start {}, at the end {}",
        report.wall_seconds, report.machine.load_average_start, report.machine.load_average_end
    );
    Ok(report)
}

async fn bench_plugin(
    binary: &Path,
    dir: &Path,
    entry: &matrix::MatrixEntry,
    plan: &Plan,
    bar: &ProgressBar,
) -> PluginResult {
    let plugin = entry.name.as_str();
    let mut result = PluginResult {
        plugin: plugin.to_string(),
        reference: entry.reference.as_ref().map(|r| r.describe().to_string()).unwrap_or_else(|_| "none".into()),
        status: "skipped".into(),
        ..PluginResult::default()
    };
    bar.set_message(format!("{plugin}: starting two gateways"));
    // One folder per entry: ucx-sm and ucx-tcp both run the plugin `ucx`, and each keeps its own logs.
    let dir = dir.join(plugin);
    if let Err(e) = std::fs::create_dir_all(&dir) {
        result.skip_reason = format!("cannot create {}: {e}", dir.display());
        return result;
    }
    let mut rig = match Rig::start(binary, &dir, &entry.settings, plan.slot_bytes(), plan::POOL_LARGEST_TRANSFERS).await
    {
        Ok(rig) => rig,
        Err(e) => {
            let text = format!("{e:#}");
            let first_line = text.lines().next().unwrap_or_default();
            let cause = text
                .lines()
                .find(|l| l.contains("unavailable") || l.contains("not opened"))
                .unwrap_or(first_line)
                .trim();
            result.skip_reason = format!("the gateways did not start: {cause}");
            bar.println(format!("{plugin}: skipped, the gateways did not start:\n{text}"));
            return result;
        }
    };
    let reference = entry.reference.as_ref().ok().copied();
    if reference == Some(reference::ReferenceKind::Memcpy) {
        bar.set_message(format!("{plugin}: allocating the copy-limit buffers"));
        if let Err(e) =
            rig.measure_copy_limit(matrix::copy_threads(entry), system::machine().last_level_cache_kib).await
        {
            bar.println(format!("{plugin}: the copy limit cannot be measured: {e:#}"));
        }
    }
    if let Err(why) = &entry.reference {
        result.skip_reason = format!("reference not measured, ratios are 0: {why}");
    }
    let budget = CopyBudget { min_copies: plan.min_rooms_per_cell, budget: Duration::from_millis(plan.cell_budget_ms) };
    let target_budget = CopyBudget { budget: Duration::from_millis(plan.target_cell_budget_ms), ..budget };
    let cells = plan.cells();
    let target = rounds::target_cell(plugin, &cells);
    for (block, blocks) in cells {
        let label = format!("{plugin}: {} x {blocks}", stats::size_label(block));
        let is_target = target == Some((block, blocks));
        let (round_count, budget) = if is_target { (plan.target_rounds, target_budget) } else { (1, budget) };
        let mut done = Vec::new();
        let mut error = None;
        for round in 0..round_count {
            bar.set_message(if round_count > 1 {
                format!("{label} (target cell, round {} of {round_count})", round + 1)
            } else {
                label.clone()
            });
            match run_cell(&rig, reference, block, blocks, plan.inflight_rooms, budget).await {
                Ok(cell) => done.push(cell),
                Err(e) => {
                    bar.println(format!("{label}: {e:#}"));
                    error = Some(e);
                    break;
                }
            }
        }
        let mut cell = rounds::median_round(done).unwrap_or_else(|| results::CellResult {
            block_bytes: block,
            blocks,
            transfer_bytes: block * blocks,
            ..Default::default()
        });
        if let Some(e) = error {
            // A round that could not run is a failure of the cell, beside whatever rounds did run.
            cell.failures += 1;
            cell.failure_reasons.push(format!("{e:#}"));
        }
        result.cells.push(cell);
        bar.inc(1);
    }
    rig.stop();
    result.status = "measured".into();
    result
}

async fn bench_control(binary: &Path, dir: &Path, plan: &Plan, bar: &ProgressBar) -> ControlPath {
    let mut out = ControlPath::default();
    bar.set_message(format!("abort-to-terminal in kvgate-core, {} rooms in flight", plan.core_rooms_in_flight));
    let (rooms, aborts) = (plan.core_rooms_in_flight, plan.core_aborts);
    match tokio::task::spawn_blocking(move || core_abort::abort_to_terminal_in_core(rooms, aborts)).await {
        Ok(Ok(r)) => out.abort_to_terminal_core = Some(r),
        Ok(Err(e)) => out.errors.push(format!("abort-to-terminal in the core: {e}")),
        Err(e) => out.errors.push(format!("abort-to-terminal in the core: {e}")),
    }
    bar.inc(1);
    bar.set_message(format!("per-room cost, {} rooms of 4 KiB one at a time", plan.room_cost_rooms));
    match room_cost::measure(binary, dir, plan.room_cost_rooms).await {
        Ok(r) => out.room_cost = Some(r),
        Err(e) => out.errors.push(format!("per-room cost: {e:#}")),
    }
    bar.set_message(format!("rooms per second with batched calls, {} rooms", plan.batched_rooms));
    match room_cost::measure_batched(binary, dir, plan.batched_rooms).await {
        Ok(r) => out.batched_rooms = Some(r),
        Err(e) => out.errors.push(format!("batched rooms: {e:#}")),
    }
    bar.set_message(format!("per-room cost over the engine lane, {} rooms of 4 KiB", plan.room_cost_rooms));
    match lane_cost::measure(binary, dir, plan.room_cost_rooms).await {
        Ok(r) => out.lane_room_cost = Some(r),
        Err(e) => out.errors.push(format!("per-room cost over the lane: {e:#}")),
    }
    bar.set_message(format!("rooms per second with batched calls over the engine lane, {} rooms", plan.batched_rooms));
    match lane_cost::measure_batched(binary, dir, plan.batched_rooms).await {
        Ok(r) => out.lane_batched_rooms = Some(r),
        Err(e) => out.errors.push(format!("batched rooms over the lane: {e:#}")),
    }
    let settings = control::control_settings();
    bar.set_message("control path: starting two gateways");
    match control::start_control_rig(binary, dir, &settings).await {
        Ok(mut rig) => {
            bar.set_message(format!("rooms per second, {} minimal rooms", plan.control_rooms));
            match control::rooms_per_second(&rig, plan.control_rooms, plan.control_concurrency).await {
                Ok(r) => out.rooms_per_second = Some(r),
                Err(e) => out.errors.push(format!("rooms per second: {e:#}")),
            }
            bar.inc(1);
            bar.set_message(format!("SGLang-shaped rooms (122 parts, 4 chunks), {} each way", plan.sglang_rooms));
            match sglang_room::sglang_shaped_rooms(&rig, plan.sglang_rooms).await {
                Ok(r) => out.sglang_room = Some(r),
                Err(e) => out.errors.push(format!("SGLang-shaped rooms: {e:#}")),
            }
            bar.set_message(format!(
                "abort-to-terminal through the engine API, {} rooms in flight",
                plan.api_rooms_in_flight
            ));
            match control::abort_to_terminal_api(&rig, plan.api_rooms_in_flight, plan.api_aborts, plan.target_rounds)
                .await
            {
                Ok(r) => out.abort_to_terminal_engine_api = Some(r),
                Err(e) => out.errors.push(format!("abort-to-terminal through the engine API: {e:#}")),
            }
            bar.inc(1);
            rig.stop();
        }
        Err(e) => out.errors.push(format!("control-path gateways did not start: {e:#}")),
    }
    bar.set_message(format!("frozen peer, {} rooms mid-transfer", plan.frozen_rooms));
    let frozen_settings = kvgate_demo::gateways::PairSettings::default();
    match Rig::start(binary, dir, &frozen_settings, control::CONTROL_POOL_BYTES, 1).await {
        Ok(mut rig) => {
            match control::frozen_peer(&rig, &frozen_settings, plan.frozen_rooms).await {
                Ok(r) => out.frozen_peer = Some(r),
                Err(e) => out.errors.push(format!("frozen peer: {e:#}")),
            }
            rig.stop();
        }
        Err(e) => out.errors.push(format!("frozen-peer gateways did not start: {e:#}")),
    }
    bar.inc(1);
    out
}

fn write_outputs(args: &BenchArgs, report: &BenchReport) -> anyhow::Result<()> {
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(report)? + "\n")
            .with_context(|| format!("write {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    let panels = plot::panels(report);
    if let Some(path) = &args.plot {
        std::fs::write(path, svg::render(&panels)).with_context(|| format!("write {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    if let Some(path) = &args.png {
        std::fs::write(path, png_plot::render(&panels)?).with_context(|| format!("write {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    if let Some(path) = &args.markdown {
        let svg_link = args.plot.as_ref().and_then(|p| link_in_same_folder(p, path));
        let mut page = report::markdown(report, svg_link.as_deref());
        // The side-by-side section (`--peers --markdown`) is kept from the page being replaced.
        if let Some(section) = std::fs::read_to_string(path).ok().as_deref().and_then(peers::section_of) {
            page = peers::splice_section(&page, section);
        }
        std::fs::write(path, page).with_context(|| format!("write {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// The file name of `target` when it lies in the folder of `page` (so the page can link it); an
/// image elsewhere is not linked, since the link would break wherever the page is read.
fn link_in_same_folder(target: &Path, page: &Path) -> Option<String> {
    let folder = |p: &Path| std::path::absolute(p).ok().and_then(|a| a.parent().map(Path::to_path_buf));
    (folder(target)? == folder(page)?).then(|| target.file_name().map(|n| n.to_string_lossy().into_owned())).flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plot_is_linked_only_from_its_own_folder() {
        assert_eq!(link_in_same_folder(Path::new("out/b.svg"), Path::new("out/B.md")), Some("b.svg".into()));
        assert_eq!(link_in_same_folder(Path::new("/tmp/x/b.svg"), Path::new("B.md")), None);
    }
}
