//! Formatting of a finished [`BenchReport`]: the end-of-run table, the target checks and the
//! `BENCHMARKS.md` page. Pure functions of the measured figures; never measures and never rounds a
//! figure before it is stored.

use super::results::{
    AbortLatency, BenchReport, CellResult, ControlPath, CopyLimit, PluginResult, RoomCost, TargetCheck,
};
use super::stats::size_label;
use std::fmt::Write;

/// The header of `BENCHMARKS.md`: what every data-path figure measures, exactly.
pub const WHAT_IS_MEASURED: &str = "\
Every figure is measured against its reference in the same run (the machine is shared and noisy); read the ratios, \
not the absolute numbers. GB/s = 1e9 bytes/s.

What the data path measures:

- **kvgate**: two `kvgate serve` gateways on this machine (peer link on 127.0.0.1), one engine on each engine API \
(gRPC on a unix socket); the gateways' room deadlines allow 10 MB/s per room, since rooms share the plugin. \
One transfer is one room: the decode engine's `Expect` and the prefill engine's `Send` \
(one part, one chunk of `blocks` slices of `block` bytes) issued together, then both sides' `Terminal` events \
(latency = from the two calls to the later terminal event), then both `Reusable` events before its pool slot is used \
again. Up to `in flight` rooms run at once, each on its own slot of the pools (fewer for transfers so large that fewer \
fit the pools). Every cell is a write (the prefill gateway's plugin moves the bytes into the decode side's pool): the \
plugin interface is a write engine with no read operation, so no plugin has read cells. GB/s = bytes of the timed rooms / wall time of the cell. Outside the timed window: filling the source \
pool, a warm-up room whose destination bytes are compared with the source, one untimed room on \
every other slot the cell uses (so that no timed room is the first to touch its slot's pages), the reference, and \
the verification of every timed room's bytes: before the timed rooms every destination slot they may write is \
overwritten with the complement of its source, and after them every slot they wrote is compared with its source; \
a slot that differs fails the cell (`verified` = NO, and `kvgate bench` exits 1). `CPU gw / eng`: cores the two gateway processes (plugin threads \
included) and the engines' process kept busy meanwhile (from /proc, 10 ms ticks); 2 cores is all this machine has.
- **Plugin settings**: shm and the gateways at their defaults; QUIC with its loopback tuning (64 KiB datagrams from the first packet, 4 MiB in flight per connection, glibc's trim threshold at 64 MiB: plugins/quic/README.md; its defaults are sized for real networks); UCX with the transports of plugins/ucx/conformance/sm.toml and tcp.toml.
- **References** move the same bytes in the same run, one transfer after the other, with no pipelining (except \
ucx_perftest, below); each runs half just before the cell's rooms and half just after (memcpy and TCP half their time; \
ucx_perftest, which is sized in messages, a first half sized by the cell's verified room and a second by what the rooms \
moved, its rate being both halves' bytes over their time): \
**memcpy** (shm) is one thread copying block by block between this process's mappings of the same pool files, over \
the same slots in the same order as the rooms used them. The shm plugin copies with its worker threads (`workers`, \
default 2), with non-temporal stores for transfers of 1 MiB and more (`streaming_stores_min_bytes`; glibc's memcpy \
uses cached stores at these sizes), and the gateway overlaps rooms, so a ratio above 1 is structural (two threads \
and streaming stores against one thread of cached stores), not a speed-up: that ratio says how close the whole path \
gets to one core's memcpy. shm's target is therefore read against the **machine's copy limit**, measured around \
every shm cell (half just before its rooms, half just after): the best of memcpy and streaming-store copies \
(the plugin's own non-temporal copy), each on as many threads as the plugin copies with, between two buffers of \
this process that are each at least as large as the last-level cache (so the working set is at least twice it and \
no pass is served from cache); `limit ratio` = the cell's GB/s / that limit. A cell whose slots fit the cache can \
pass 1 against it. **TCP loopback** (QUIC) is one blocking \
connection, block by block, a 1-byte acknowledgement per transfer. **ucx_perftest** (UCX) is `ucp_am_bw` server + \
client on 127.0.0.1 over the same UCX transport as the plugin's config, with `-e` on TCP (the peer-failure endpoint \
mode the plugin's TCP endpoints use), one message per block, as many messages outstanding (`-O`) as the cell had \
rooms in flight (the one reference that pipelines: UCX doing the same job with the same concurrency), with \
`MALLOC_PERTURB_` set so that glibc writes its \
buffers (over TCP it never writes its send buffer otherwise, and sends the kernel's cached zero page where the \
gateways send written pool pages); it reports a rate, so its p50 is the transfer's bytes at that rate. It sends every \
message from one buffer of one block (it has no way to cycle through a pool), so a block that fits the CPU's caches is \
read from cache, while the gateways cycle through their pools' slots; over shared memory that alone halves the \
plugin's rate (docs/ucx-performance-record.md, section \"Cache-resident references\"), so UCX ratios below the bulk cell read low. The \
UCX targets are taken at the bulk cell (64 MiB blocks): where that is larger than the last-level cache named above, \
neither side reads from cache. A room's blocks are adjacent in both pools, and the UCX plugin joins segments that \
continue each other into messages of up to 4 MiB (`join_segments_max_bytes`), so in cells of more than one block it \
sends one message per 4 MiB of a room where `ucx_perftest` sends one per block: those ratios include what joining \
gains. The targets are single-block cells.
- **Target cells** (shm 4 MiB x 1; the largest single-block cell of the others) run in rounds (`--target-rounds`, \
default 5), each round a whole cell with its own reference (shm's rounds with their own copy limit, and shm's median \
round is taken by the ratio to it), and each round runs longer than a matrix cell \
(`--target-cell-ms`: 1 000 ms with `--quick`, 2 000 ms in the full run); the round with the median ratio is reported, with every \
round's ratio beside it, the range of kvgate's and the reference's throughput over the rounds and the ratio of their \
medians, and a failure in any round counts. When the reference's fastest round is more than 1.5 times its slowest, the \
target line says that its ratio is not a steady reading (seen on one host: TCP loopback references at 64 MiB moving \
1.4 GB/s in one round and 3.6 in another while kvgate's rounds stayed within 10 %). The engine-API abort target runs as many rounds of `--api-aborts` aborts over the same rooms in flight; the round with the median p99 is reported, with every round's p99 and the p99 and max of all aborts pooled beside it, and a missing terminal in any round counts.

";

/// CPU the gateways and the engines used while a cell's rooms ran, in cores (`1.20 / 0.35`).
pub fn cpu_share(c: &CellResult) -> String {
    if c.wall_seconds <= 0.0 {
        return "-".into();
    }
    format!("{:.2} / {:.2}", c.gateway_cpu_seconds / c.wall_seconds, c.engine_cpu_seconds / c.wall_seconds)
}

/// The shm target cell: one 4 MiB block per transfer.
pub const SHM_TARGET_CELL: (u64, u64) = (4 << 20, 1);

fn cell(plugin: &PluginResult, block: u64, blocks: u64) -> Option<&CellResult> {
    plugin.cells.iter().find(|c| c.block_bytes == block && c.blocks == blocks)
}

/// The bulk cell of a plugin: the largest single-block transfer that ran (with its reference).
fn bulk_cell(plugin: &PluginResult) -> Option<&CellResult> {
    let single: Vec<&CellResult> = plugin.cells.iter().filter(|c| c.blocks == 1).collect();
    single
        .iter()
        .copied()
        .filter(|c| c.reference_gbps > 0.0)
        .max_by_key(|c| c.block_bytes)
        .or_else(|| single.into_iter().max_by_key(|c| c.block_bytes))
}

fn check(name: &str, figure: String, measured: Option<f64>, min: f64, why_not: String) -> TargetCheck {
    let verdict = match measured {
        Some(m) if m >= min => "met".to_string(),
        Some(_) => "missed".to_string(),
        None => format!("not measured: {why_not}"),
    };
    TargetCheck { name: name.into(), figure, measured, target: format!(">= {min:.2}"), verdict }
}

fn ratio_target(
    report: &BenchReport,
    plugin: &str,
    name: &str,
    min: f64,
    pick: impl Fn(&PluginResult) -> Option<&CellResult>,
) -> TargetCheck {
    let Some(p) = report.data_path.iter().find(|p| p.plugin == plugin) else {
        return check(name, "ratio".into(), None, min, format!("{plugin} was not requested (--plugins)"));
    };
    if p.status != "measured" {
        return check(name, "ratio".into(), None, min, p.skip_reason.clone());
    }
    match pick(p) {
        Some(c) if c.reference_gbps > 0.0 => {
            let mut figure = format!(
                "ratio at {} x {} ({:.2} / {:.2} GB/s)",
                size_label(c.block_bytes),
                c.blocks,
                c.throughput_gbps,
                c.reference_gbps
            );
            let rounds = super::rounds::rounds_note(c);
            if !rounds.is_empty() {
                figure = format!("{figure}; {rounds}");
            }
            check(name, figure, Some(c.ratio), min, String::new())
        }
        _ if !p.skip_reason.is_empty() => check(name, "ratio".into(), None, min, p.skip_reason.clone()),
        _ => check(name, "ratio".into(), None, min, "the target cell was not in this run's matrix".into()),
    }
}

/// The shm target: at least this share of the machine's copy limit at 4 MiB x 1.
pub const SHM_LIMIT_TARGET: f64 = 0.90;

/// `the best of memcpy (16.10) and streaming stores (17.20 GB/s), 2 threads, 1 GiB working set`.
pub fn limit_text(l: &CopyLimit) -> String {
    format!(
        "the best of memcpy ({:.2}) and streaming stores ({:.2} GB/s), {} thread{}, {} working set",
        l.memcpy_gbps,
        l.streaming_gbps,
        l.threads,
        if l.threads == 1 { "" } else { "s" },
        size_label(l.working_set_bytes)
    )
}

/// shm's target: its ratio to the machine's copy limit at 4 MiB x 1, with its ratio to one thread of
/// memcpy beside it.
fn limit_target(report: &BenchReport) -> TargetCheck {
    let name = "shm >= 90 % of the machine's copy limit at 4 MiB";
    let Some(p) = report.data_path.iter().find(|p| p.plugin == "shm") else {
        return check(name, "ratio".into(), None, SHM_LIMIT_TARGET, "shm was not requested (--plugins)".into());
    };
    if p.status != "measured" {
        return check(name, "ratio".into(), None, SHM_LIMIT_TARGET, p.skip_reason.clone());
    }
    match cell(p, SHM_TARGET_CELL.0, SHM_TARGET_CELL.1) {
        Some(c) => match &c.copy_limit {
            Some(l) if l.gbps > 0.0 => {
                let mut figure = format!(
                    "ratio to the copy limit at {} x {} ({:.2} / {:.2} GB/s: {}); against one thread of memcpy {:.3} ({:.2} GB/s)",
                    size_label(c.block_bytes),
                    c.blocks,
                    c.throughput_gbps,
                    l.gbps,
                    limit_text(l),
                    c.ratio,
                    c.reference_gbps
                );
                let rounds = super::rounds::rounds_note(c);
                if !rounds.is_empty() {
                    figure = format!("{figure}; {rounds}");
                }
                check(name, figure, Some(c.limit_ratio), SHM_LIMIT_TARGET, String::new())
            }
            _ => check(
                name,
                "ratio".into(),
                None,
                SHM_LIMIT_TARGET,
                "the copy limit was not measured around the target cell".into(),
            ),
        },
        None => {
            check(name, "ratio".into(), None, SHM_LIMIT_TARGET, "the target cell was not in this run's matrix".into())
        }
    }
}

/// Rooms that must be in flight for an abort-to-terminal figure to count against its target.
pub const ABORT_TARGET_ROOMS_IN_FLIGHT: u64 = 100_000;
/// The abort-to-terminal target: p99 at most this many microseconds.
pub const ABORT_TARGET_P99_US: f64 = 1_000.0;

/// The abort-to-terminal target for one measurement (`path`: where it was measured; `flag`: the
/// option that sets its rooms in flight).
fn abort_target(abort: Option<&AbortLatency>, path: &str, absent: &str, flag: &str) -> TargetCheck {
    let measured = abort
        .filter(|a| a.rooms_in_flight >= ABORT_TARGET_ROOMS_IN_FLIGHT && a.missing_terminal == 0)
        .map(|a| a.p99_us);
    let figure = abort
        .map(|a| {
            let note = super::rounds::abort_rounds_note(a);
            let rounds = if note.is_empty() { String::new() } else { format!("; {note}") };
            format!("p99 of {} aborts, {} rooms in flight, {path} (us){rounds}", a.aborts, a.rooms_in_flight)
        })
        .unwrap_or_else(|| "p99 (us)".into());
    let why = match abort {
        None => absent.to_string(),
        Some(a) if a.missing_terminal > 0 => format!("{} aborts had no terminal event", a.missing_terminal),
        Some(a) => format!("only {} rooms in flight ({flag})", a.rooms_in_flight),
    };
    let verdict = match measured {
        Some(us) if us <= ABORT_TARGET_P99_US => "met".to_string(),
        Some(_) => "missed".to_string(),
        None => format!("not measured: {why}"),
    };
    TargetCheck {
        name: format!("abort-to-terminal p99 <= 1 ms, 100 000 rooms in flight, {path}"),
        figure,
        measured,
        target: "<= 1000 us".into(),
        verdict,
    }
}

/// The targets of the plugin issues, read from this run (UCX once per transport; abort last: in the
/// core, then through the engine API).
pub fn targets(report: &BenchReport) -> Vec<TargetCheck> {
    let mut out = vec![
        limit_target(report),
        ratio_target(report, "quic", "QUIC >= 50 % of TCP loopback (bulk)", 0.50, bulk_cell),
        ratio_target(report, "ucx-sm", "UCX (shared memory) >= 95 % of ucx_perftest (bulk)", 0.95, bulk_cell),
        ratio_target(report, "ucx-tcp", "UCX (TCP) >= 95 % of ucx_perftest (bulk)", 0.95, bulk_cell),
    ];
    let c = &report.control_path;
    out.push(abort_target(
        c.abort_to_terminal_core.as_ref(),
        "in kvgate-core",
        "the in-process core measurement did not run",
        "--core-rooms",
    ));
    out.push(abort_target(
        c.abort_to_terminal_engine_api.as_ref(),
        "through the engine API and two gateways",
        "the engine-API measurement did not run",
        "--api-rooms",
    ));
    out
}

/// The end-of-run table: every cell with its ratio, then the control path and the targets.
pub fn table(report: &BenchReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<7} {:>8} {:>7} {:>9} {:>9} {:>8} {:>8} {:>8} {:>9} {:>7} {:>6}  notes",
        "plugin", "block", "blocks", "transfer", "in flight", "GB/s", "p50 ms", "p99 ms", "ref GB/s", "ratio", "rooms"
    );
    for p in &report.data_path {
        if p.status != "measured" {
            let _ = writeln!(out, "{:<7} skipped: {}", p.plugin, p.skip_reason);
            continue;
        }
        for c in &p.cells {
            let mut notes = Vec::new();
            if !c.verified {
                notes.push("BYTES NOT VERIFIED".to_string());
            }
            if c.failures > 0 {
                notes.push(format!("{} failed ({})", c.failures, c.failure_reasons.join(", ")));
            }
            if !c.reference_error.is_empty() {
                notes.push(format!("reference failed: {}", c.reference_error.lines().next().unwrap_or_default()));
            }
            if let Some(l) = &c.copy_limit {
                notes.push(format!("copy limit {:.2} GB/s, ratio to it {:.3}", l.gbps, c.limit_ratio));
            }
            let rounds = super::rounds::rounds_note(c);
            if !rounds.is_empty() {
                notes.push(rounds);
            }
            let _ = writeln!(
                out,
                "{:<7} {:>8} {:>7} {:>9} {:>9} {:>8.3} {:>8.3} {:>8.3} {:>9.3} {:>7.3} {:>6}  {}",
                p.plugin,
                size_label(c.block_bytes),
                c.blocks,
                size_label(c.transfer_bytes),
                c.rooms_in_flight,
                c.throughput_gbps,
                c.latency_p50_ms,
                c.latency_p99_ms,
                c.reference_gbps,
                c.ratio,
                c.transfers,
                notes.join(", ")
            );
        }
        let _ = writeln!(out, "{:<7} reference: {}", "", p.reference);
        if !p.skip_reason.is_empty() {
            let _ = writeln!(out, "{:<7} note: {}", "", p.skip_reason);
        }
    }
    out.push('\n');
    out.push_str(&control_lines(report));
    out.push('\n');
    for t in &report.targets {
        let measured = t.measured.map(|m| format!("{m:.3}")).unwrap_or_else(|| "-".into());
        let _ = writeln!(out, "target  {:<58} {:>9} {:<10} {}  [{}]", t.name, measured, t.target, t.verdict, t.figure);
    }
    out
}

fn control_lines(report: &BenchReport) -> String {
    control_lines_of(&report.control_path)
}

/// The control-path lines of the table (also printed alone by `--room-cost-only`).
pub fn control_lines_of(c: &ControlPath) -> String {
    let mut out = String::new();
    for (path, cost) in [("gRPC", &c.room_cost), ("lane", &c.lane_room_cost)] {
        let Some(r) = cost else { continue };
        let _ = writeln!(
            out,
            "control  per-room cost [{path}], {} rooms of {} B one at a time: p50 {:.3} ms, p99 {:.3} ms, wall {:.0} us a room; CPU per room: gateways {:.0} us, engines {:.0} us, together {:.0} us; reference Info round trip [{path}]: p50 {:.3} ms, CPU {:.0} us; ratios to it: p50 {:.1}x, CPU {:.1}x ({} failed{})",
            r.rooms, r.bytes_per_room, r.latency_p50_ms, r.latency_p99_ms, r.wall_us_per_room, r.gateway_cpu_us_per_room, r.engine_cpu_us_per_room,
            r.gateway_cpu_us_per_room + r.engine_cpu_us_per_room, r.call_p50_ms, r.call_cpu_us,
            r.latency_p50_ms / r.call_p50_ms.max(1e-9), (r.gateway_cpu_us_per_room + r.engine_cpu_us_per_room) / r.call_cpu_us.max(1e-9),
            r.failures, r.failure_reasons.first().map(|e| format!(": {e}")).unwrap_or_default()
        );
        let _ = writeln!(
            out,
            "         per room [{path}]: context switches gateways {:.1}, engines {:.1} (/proc); system calls gateways {}, engines {} (perf stat)",
            r.gateway_switches_per_room, r.engine_switches_per_room,
            r.gateway_syscalls_per_room.map(|n| format!("{n:.1}")).unwrap_or_else(|| "n/a".into()),
            r.engine_syscalls_per_room.map(|n| format!("{n:.1}")).unwrap_or_else(|| "n/a".into())
        );
    }
    if let (Some(g), Some(l)) = (&c.room_cost, &c.lane_room_cost) {
        let cpu = |r: &RoomCost| r.gateway_cpu_us_per_room + r.engine_cpu_us_per_room;
        let _ = writeln!(
            out,
            "         lane / gRPC, same run: p50 {:.2}, CPU per room {:.2} (gateways {:.2}, engines {:.2}), context switches {:.2}",
            l.latency_p50_ms / g.latency_p50_ms.max(1e-9), cpu(l) / cpu(g).max(1e-9),
            l.gateway_cpu_us_per_room / g.gateway_cpu_us_per_room.max(1e-9), l.engine_cpu_us_per_room / g.engine_cpu_us_per_room.max(1e-9),
            (l.gateway_switches_per_room + l.engine_switches_per_room) / (g.gateway_switches_per_room + g.engine_switches_per_room).max(1e-9)
        );
    }
    for (path, batched) in [("gRPC", &c.batched_rooms), ("lane", &c.lane_batched_rooms)] {
        let Some(r) = batched else { continue };
        let _ = writeln!(
            out,
            "control  rooms/s with batched calls [{path}]: {:.0} ({} rooms of 8 B, {} a batch (one ExpectBatch + one SendBatch), {} batches at once, {} failed{}; batch p50 {:.2} ms; CPU per room: gateways {:.1} us, engines {:.1} us)",
            r.rooms_per_second, r.rooms, r.batch_rooms, r.batches_in_flight, r.failures,
            r.first_error.as_deref().map(|e| format!(": {e}")).unwrap_or_default(), r.batch_p50_ms, r.gateway_cpu_us_per_room, r.engine_cpu_us_per_room
        );
    }
    if let (Some(g), Some(l)) = (&c.batched_rooms, &c.lane_batched_rooms) {
        let _ = writeln!(
            out,
            "         lane / gRPC, same run: batched rooms/s {:.2}",
            l.rooms_per_second / g.rooms_per_second.max(1e-9)
        );
    }
    if let Some(r) = &c.rooms_per_second {
        let _ = writeln!(
            out,
            "control  rooms/s through the engine API: {:.0} ({} rooms of {} B, {} at once, {} failed; room p50 {:.2} ms, p99 {:.2} ms; CPU per room: gateways {:.0} us, engines {:.0} us)",
            r.rooms_per_second, r.rooms, r.bytes_per_room, r.concurrency, r.failures, r.latency_p50_ms, r.latency_p99_ms, r.gateway_cpu_us_per_room, r.engine_cpu_us_per_room
        );
    }
    if let Some(r) = &c.sglang_room {
        for (how, m) in [("one Send per part per chunk", &r.per_part), ("one SendBatch per chunk", &r.batched)] {
            let _ = writeln!(
                out,
                "control  SGLang-shaped room ({} layers x K,V = {} parts, {} chunks of {} pages of {} B), {how}: {} calls a room, p50 {:.2} ms, p99 {:.2} ms; CPU per room: gateways {:.0} us, engines {:.0} us ({} rooms, {} failed{})",
                r.layers, r.parts, r.chunks, r.pages_per_chunk, r.page_bytes, m.calls_per_room, m.latency_p50_ms, m.latency_p99_ms,
                m.gateway_cpu_us_per_room, m.engine_cpu_us_per_room, m.rooms, m.failures,
                m.first_error.as_deref().map(|e| format!(": {e}")).unwrap_or_default()
            );
        }
    }
    for a in [&c.abort_to_terminal_core, &c.abort_to_terminal_engine_api].into_iter().flatten() {
        let _ = writeln!(
            out,
            "control  abort-to-terminal, {} rooms in flight, {} aborts: p50 {:.1} us, p99 {:.1} us, max {:.1} us, missing {}  [{}]",
            a.rooms_in_flight, a.aborts, a.p50_us, a.p99_us, a.max_us, a.missing_terminal, a.path
        );
        let note = super::rounds::abort_rounds_note(a);
        if !note.is_empty() {
            let _ = writeln!(out, "         {note}");
        }
    }
    if let Some(f) = &c.frozen_peer {
        let _ = writeln!(
            out,
            "control  frozen decode gateway (SIGSTOP), {} rooms mid-transfer: first {:.0} ms, p50 {:.0} ms, all terminal {:.0} ms (heartbeat {} ms x {} = {} ms); peer_lost {}, other {:?}, missing {}",
            f.rooms, f.first_terminal_ms, f.p50_terminal_ms, f.all_terminal_ms, f.heartbeat_interval_ms, f.heartbeat_misses, f.detection_bound_ms, f.peer_lost, f.other_reasons, f.missing_terminal
        );
    }
    for e in &c.errors {
        let _ = writeln!(out, "control  not measured: {e}");
    }
    out
}

/// ` (AMD EPYC; family 25 model 17; AES-NI, AVX-512)`, or what of it is known.
fn cpu_text(model: &str, features: &str) -> String {
    let known: Vec<&str> = [model, features].into_iter().filter(|t| !t.is_empty()).collect();
    if known.is_empty() {
        String::new()
    } else {
        format!(" ({})", known.join("; "))
    }
}

/// `32 MiB last-level cache, ` (or nothing when unknown).
fn cache_text(kib: u64) -> String {
    match kib {
        0 => String::new(),
        k if k % 1024 == 0 => format!("{} MiB last-level cache, ", k / 1024),
        k => format!("{k} KiB last-level cache, "),
    }
}

/// The machine's copy limit over the run (shm's cells), named for the page's header; `None` when no
/// cell measured it.
pub fn copy_limit_line(report: &BenchReport) -> Option<String> {
    let limits: Vec<&CopyLimit> = report
        .data_path
        .iter()
        .flat_map(|p| &p.cells)
        .filter_map(|c| c.copy_limit.as_ref())
        .filter(|l| l.gbps > 0.0)
        .collect();
    let first = limits.first()?;
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[(v.len() - 1) / 2]
    };
    let best = median(limits.iter().map(|l| l.gbps).collect());
    let memcpy = median(limits.iter().map(|l| l.memcpy_gbps).collect());
    let streaming = median(limits.iter().map(|l| l.streaming_gbps).collect());
    Some(format!(
        "The limit shm is measured against: this machine's copy limit, **{best:.2} GB/s** (median over the {} shm cells it was measured around; memcpy {memcpy:.2}, streaming stores {streaming:.2} GB/s): {}.",
        limits.len(),
        super::copy_limit::describe(first.threads, first.working_set_bytes)
    ))
}

/// `BENCHMARKS.md`, generated from one report.
pub fn markdown(report: &BenchReport, plot_svg: Option<&str>) -> String {
    let mut out = String::new();
    let m = &report.machine;
    let _ = writeln!(out, "# kvgate benchmarks\n");
    let _ =
        writeln!(out, "<!-- generated by `kvgate bench --markdown`; do not edit by hand, run the command again -->\n");
    let _ = writeln!(
        out,
        "Latest figures from this machine: {} CPUs{}, {}{:.0} GiB memory, GPU: {}, kernel {}. Finished {} UTC, {:.0} s of wall time, kvgate {}. \
         Load average (1, 5, 15 min) at the start: {}; at the end: {}.\n",
        m.cpus,
        cpu_text(&m.cpu_model, &m.cpu_features),
        cache_text(m.last_level_cache_kib),
        m.memory_gib,
        m.gpu,
        m.kernel,
        report.finished_utc,
        report.wall_seconds,
        report.kvgate_version,
        m.load_average_start,
        m.load_average_end
    );
    if let Some(line) = copy_limit_line(report) {
        let _ = writeln!(out, "{line}\n");
    }
    let _ = writeln!(out, "Produced by:\n\n```\n{}\n```\n", report.command);
    out.push_str(WHAT_IS_MEASURED);
    let _ = writeln!(out, "## Targets\n\n| target | measured | wanted | verdict | figure |\n|---|---|---|---|---|");
    for t in &report.targets {
        let measured = t.measured.map(|v| format!("{v:.3}")).unwrap_or_else(|| "-".into());
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} |",
            t.name,
            measured,
            t.target.replace('<', "&lt;").replace('>', "&gt;"),
            t.verdict,
            t.figure
        );
    }
    let _ = writeln!(out, "\n## Control path\n\n```\n{}```\n", control_lines(report));
    let _ = writeln!(out, "## Data path\n");
    if let Some(svg) = plot_svg {
        let _ = writeln!(out, "![throughput against block size]({svg})\n");
    }
    for p in &report.data_path {
        let _ = writeln!(out, "### {}\n", p.plugin);
        if p.status != "measured" {
            let _ = writeln!(out, "Skipped: {}\n", p.skip_reason);
            continue;
        }
        let _ = writeln!(out, "Reference: {}.\n", p.reference);
        if !p.skip_reason.is_empty() {
            let _ = writeln!(out, "Note: {}.\n", p.skip_reason);
        }
        let limits: Vec<&CopyLimit> = p.cells.iter().filter_map(|c| c.copy_limit.as_ref()).collect();
        if let Some(first) = limits.first() {
            let mut best: Vec<f64> = limits.iter().map(|l| l.gbps).collect();
            best.sort_by(f64::total_cmp);
            let _ = writeln!(
                out,
                "Copy limit (the target's reference): {}, measured half just before and half just after each cell, {:.2}-{:.2} GB/s over the cells (median {:.2}); `limit ratio` = GB/s / the cell's limit.\n",
                super::copy_limit::describe(first.threads, first.working_set_bytes),
                best[0],
                best[best.len() - 1],
                best[(best.len() - 1) / 2]
            );
        }
        let with_limit = !limits.is_empty();
        let (limit_head, limit_rule) =
            if with_limit { (" limit GB/s | limit ratio |", "---:|---:|") } else { ("", "") };
        let _ = writeln!(out, "| block | blocks | transfer | in flight | GB/s | p50 ms | p99 ms | reference GB/s | ref p50 ms | ratio |{limit_head} rooms | CPU gw / eng | verified |");
        let _ = writeln!(out, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|{limit_rule}---:|---:|---|");
        for c in &p.cells {
            let limit_cells = match (&c.copy_limit, with_limit) {
                (Some(l), _) => format!(" {:.3} | {:.3} |", l.gbps, c.limit_ratio),
                (None, true) => " - | - |".to_string(),
                (None, false) => String::new(),
            };
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} |{limit_cells} {} | {} | {} |",
                size_label(c.block_bytes),
                c.blocks,
                size_label(c.transfer_bytes),
                c.rooms_in_flight,
                c.throughput_gbps,
                c.latency_p50_ms,
                c.latency_p99_ms,
                c.reference_gbps,
                c.reference_latency_p50_ms,
                c.ratio,
                c.transfers,
                cpu_share(c),
                if !c.failed() { "yes" } else { "NO" }
            );
        }
        for c in p.cells.iter().filter(|c| c.failures > 0) {
            let _ = writeln!(
                out,
                "\n{} x {}: {} rooms failed: {}",
                size_label(c.block_bytes),
                c.blocks,
                c.failures,
                c.failure_reasons.join(", ")
            );
        }
        for c in p.cells.iter().filter(|c| c.round_ratios.len() > 1) {
            let _ = writeln!(
                out,
                "\n{} x {} (a target cell): {}.",
                size_label(c.block_bytes),
                c.blocks,
                super::rounds::rounds_note(c)
            );
        }
        for c in p.cells.iter().filter(|c| !c.reference_error.is_empty()) {
            let first = c.reference_error.lines().next().unwrap_or_default();
            let _ = writeln!(out, "\n{} x {}: reference failed: {first}", size_label(c.block_bytes), c.blocks);
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::results::{AbortLatency, ControlPath};

    fn report_with(shm_ratio: f64, abort_p99_us: f64, rooms: u64) -> BenchReport {
        // One thread of memcpy at 0.5 GB/s, the copy limit at 1 GB/s: the target reads the latter.
        let limit =
            CopyLimit { threads: 2, working_set_bytes: 1 << 30, memcpy_gbps: 0.8, streaming_gbps: 1.0, gbps: 1.0 };
        let c = CellResult {
            block_bytes: 4 << 20,
            blocks: 1,
            transfer_bytes: 4 << 20,
            throughput_gbps: shm_ratio,
            reference_gbps: 0.5,
            ratio: shm_ratio * 2.0,
            limit_ratio: shm_ratio,
            copy_limit: Some(limit),
            verified: true,
            ..CellResult::default()
        };
        BenchReport {
            data_path: vec![PluginResult {
                plugin: "shm".into(),
                status: "measured".into(),
                cells: vec![c],
                ..PluginResult::default()
            }],
            control_path: ControlPath {
                abort_to_terminal_core: Some(AbortLatency {
                    rooms_in_flight: rooms,
                    aborts: 10,
                    p99_us: abort_p99_us,
                    ..AbortLatency::default()
                }),
                abort_to_terminal_engine_api: Some(AbortLatency {
                    rooms_in_flight: rooms,
                    aborts: 10,
                    p99_us: abort_p99_us,
                    ..AbortLatency::default()
                }),
                ..ControlPath::default()
            },
            ..BenchReport::default()
        }
    }

    #[test]
    fn the_method_text_quotes_the_steady_reference_bound() {
        let bound = super::super::rounds::STEADY_REFERENCE_SPREAD;
        assert!(WHAT_IS_MEASURED.contains(&format!("more than {bound} times its slowest")));
    }

    #[test]
    fn the_machine_line_names_the_cpu_and_its_extensions() {
        let mut report = report_with(1.0, 1.0, 100_000);
        report.machine.cpus = 2;
        report.machine.cpu_model = "AMD EPYC".into();
        report.machine.cpu_features = "family 25 model 17; AES-NI, AVX-512".into();
        let page = markdown(&report, None);
        assert!(page.contains("2 CPUs (AMD EPYC; family 25 model 17; AES-NI, AVX-512), "), "{page}");
        report.machine.cpu_model.clear();
        assert!(markdown(&report, None).contains("2 CPUs (family 25 model 17; AES-NI, AVX-512), "));
        report.machine.cpu_features.clear();
        assert!(markdown(&report, None).contains("2 CPUs, "));
    }

    #[test]
    fn targets_are_met_at_the_bound_and_missed_just_past_it() {
        let at = targets(&report_with(0.90, 1_000.0, 100_000));
        assert_eq!(at.len(), 6);
        assert_eq!(at[0].verdict, "met");
        assert_eq!(at[4].verdict, "met");
        assert_eq!(at[5].verdict, "met", "{:?}", at[5]);
        let past = targets(&report_with(0.899, 1_000.1, 100_000));
        assert_eq!(past[0].verdict, "missed");
        assert_eq!(past[4].verdict, "missed");
        assert_eq!(past[5].verdict, "missed");
        assert!(past[1].verdict.starts_with("not measured: quic was not requested"));
        assert!(past[2].verdict.starts_with("not measured: ucx-sm was not requested"));
        let few = targets(&report_with(0.95, 10.0, 99_999));
        assert!(few[4].verdict.starts_with("not measured: only 99999 rooms"));
        assert!(few[5].verdict.contains("(--api-rooms)"), "{}", few[5].verdict);
        let mut lost = report_with(0.95, 10.0, 100_000);
        lost.control_path.abort_to_terminal_engine_api.as_mut().unwrap().missing_terminal = 1;
        assert!(targets(&lost)[5].verdict.starts_with("not measured: 1 aborts had no terminal event"));
    }

    #[test]
    fn a_measured_plugin_without_its_reference_says_why_its_target_is_not_measured() {
        let mut r = report_with(0.95, 10.0, 100_000);
        let c = CellResult {
            block_bytes: 64 << 20,
            blocks: 1,
            transfer_bytes: 64 << 20,
            throughput_gbps: 1.0,
            verified: true,
            ..CellResult::default()
        };
        r.data_path.push(PluginResult {
            plugin: "ucx-tcp".into(),
            status: "measured".into(),
            skip_reason: "reference not measured, ratios are 0: ucx_perftest (Debian ucx-utils) is not installed"
                .into(),
            cells: vec![c],
            ..PluginResult::default()
        });
        let t = targets(&r);
        assert!(t[3].verdict.contains("ucx_perftest (Debian ucx-utils) is not installed"), "{}", t[3].verdict);
        assert_eq!(t[3].measured, None, "no ratio without a reference");
    }

    #[test]
    fn the_shm_target_reads_the_copy_limit_and_names_it_beside_one_thread_of_memcpy() {
        let r = report_with(0.8, 5.0, 100_000);
        let t = &targets(&r)[0];
        assert_eq!(
            (t.measured, t.verdict.as_str()),
            (Some(0.8), "missed"),
            "1.6 against one thread of memcpy does not meet it"
        );
        assert!(t.figure.contains("0.80 / 1.00 GB/s: the best of memcpy (0.80) and streaming stores (1.00 GB/s), 2 threads, 1 GiB working set"), "{}", t.figure);
        assert!(t.figure.contains("against one thread of memcpy 1.600 (0.50 GB/s)"), "{}", t.figure);
        let page = markdown(&r, None);
        assert!(page.contains("this machine's copy limit, **1.00 GB/s**"), "{page}");
        assert!(page.contains("| limit GB/s | limit ratio |") && page.contains("| 1.000 | 0.800 |"), "{page}");
        let mut no_limit = report_with(0.95, 5.0, 100_000);
        no_limit.data_path[0].cells[0].copy_limit = None;
        assert!(
            targets(&no_limit)[0].verdict.starts_with("not measured: the copy limit was not measured"),
            "{:?}",
            targets(&no_limit)[0]
        );
        assert!(!markdown(&no_limit, None).contains("| limit GB/s |"), "no limit columns without a limit");
    }

    #[test]
    fn the_rooms_per_second_line_carries_the_cpu_per_room() {
        let mut r = report_with(0.5, 5.0, 100_000);
        r.control_path.rooms_per_second = Some(crate::results::RoomsPerSecond {
            rooms: 1000,
            rooms_per_second: 6500.0,
            gateway_cpu_us_per_room: 148.4,
            engine_cpu_us_per_room: 97.0,
            ..Default::default()
        });
        let line = control_lines(&r);
        assert!(line.contains("rooms/s through the engine API: 6500"), "{line}");
        assert!(line.contains("CPU per room: gateways 148 us, engines 97 us"), "{line}");
    }

    #[test]
    fn the_markdown_names_the_command_and_every_ratio() {
        let mut r = report_with(0.5, 5.0, 100_000);
        r.command = "kvgate bench --quick --markdown BENCHMARKS.md".into();
        r.targets = targets(&r);
        let page = markdown(&r, Some("bench.svg"));
        assert!(page.contains("kvgate bench --quick --markdown BENCHMARKS.md"));
        assert!(page.contains("| 0.500 |"));
        assert!(page.contains("missed"));
        assert!(page.contains("What the data path measures") && page.contains("one thread"));
    }
}
