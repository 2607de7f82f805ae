//! `kvgate bench --link-profile P`: QUIC and UCX-TCP between two gateways on the two-host test bed
//! (`kvgate_netbed`: two network namespaces joined by a shaped link), each against iperf3 over the
//! same link in the same run. The gateways run the shipped two-host configs (addresses, paths and
//! names changed; `hosts.rs`), with the transfer deadline loosened so that slow rooms are measured
//! rather than failed; how many rooms would have missed the shipped deadline is reported per row.
//! Needs root (namespaces and TUN devices) and iperf3.

pub mod hosts;
pub mod workload;

use hosts::{BedPair, Deployment, Overrides};
use kvgate_netbed::{Link, Profile};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use workload::{Engines, Workload};

/// Room sizes every transport is measured at (the two).
pub const ROOM_SIZES: [u64; 2] = [64 << 20, 4 << 20];
/// Bytes moved per room size and transport (`--quick` moves a quarter).
pub const BYTES_PER_ROW: u64 = 1 << 30;
/// Seconds of each iperf3 run.
pub const IPERF3_SECONDS: f64 = 4.0;
/// The bench's transfer deadline floor (as the loopback bench's `BENCH_MIN_BANDWIDTH_BYTES_PER_S`).
pub const BED_MIN_BANDWIDTH_BYTES_PER_S: u64 = crate::matrix::BENCH_MIN_BANDWIDTH_BYTES_PER_S;

/// One transport variant on the bed: the bench name and what it changes in the shipped config.
#[derive(Clone, Debug)]
pub struct Variant {
    pub name: String,
    pub deployment: Deployment,
    pub plugin_config: String,
}

/// `--plugins` in link mode: `quic` (the plugin's defaults), `quic-bbr` / `quic-cubic` /
/// `quic-newreno` (that congestion controller), `ucx` or `ucx-tcp`; the rest are skipped with why.
pub fn variants(names: &[String]) -> (Vec<Variant>, Vec<(String, String)>) {
    let mut out: Vec<Variant> = Vec::new();
    let mut skipped = Vec::new();
    for name in names {
        let v = match name.as_str() {
            "quic" => Variant { name: "quic".into(), deployment: Deployment::Quic, plugin_config: String::new() },
            n if n.starts_with("quic-") => {
                let cc = &n["quic-".len()..];
                if !["bbr", "cubic", "newreno"].contains(&cc) {
                    skipped
                        .push((n.to_string(), "unknown QUIC congestion controller (bbr, cubic, newreno)".to_string()));
                    continue;
                }
                Variant {
                    name: n.to_string(),
                    deployment: Deployment::Quic,
                    plugin_config: format!("congestion_controller = \"{cc}\"\n"),
                }
            }
            "ucx" | "ucx-tcp" => {
                Variant { name: "ucx-tcp".into(), deployment: Deployment::UcxTcp, plugin_config: String::new() }
            }
            other => {
                skipped.push((
                    other.to_string(),
                    "not a transport between hosts (the link bench runs quic, quic-<cc>, ucx-tcp)".to_string(),
                ));
                continue;
            }
        };
        if !out.iter().any(|o| o.name == v.name) {
            out.push(v);
        }
    }
    (out, skipped)
}

#[derive(Clone, Debug, Serialize)]
pub struct IperfRow {
    pub congestion: String,
    pub gbps: f64,
    pub retransmits: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub transport: String,
    pub room_bytes: u64,
    pub rooms: u64,
    pub succeeded: u64,
    pub gbps: f64,
    /// Of the best iperf3 figure of the run.
    pub of_iperf3: f64,
    /// CPU seconds of both gateways per GB moved.
    pub cpu_s_per_gb: f64,
    /// Rooms whose latency exceeded the shipped config's transfer bound for a room with the others in
    /// flight ahead of it (`transfer_base_ms + inflight x bytes / min_bandwidth_bytes_per_s`): rooms
    /// the shipped deadline would have failed.
    pub over_shipped_bound: u64,
    pub slowest_room_s: f64,
    pub shipped_bound_s: f64,
    pub failures: String,
    pub bytes_verified: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct LinkReport {
    pub profile: String,
    pub inflight: u64,
    pub iperf3: Vec<IperfRow>,
    pub rows: Vec<Row>,
    pub skipped: Vec<(String, String)>,
}

/// The shipped config's transfer bound for one room of `bytes`.
fn shipped_bound(d: Deployment, bytes: u64) -> Duration {
    let prefill: toml::Value = toml::from_str(d.shipped().0).expect("shipped configs parse");
    let s = &prefill["scheduler"];
    let base = s.get("transfer_base_ms").and_then(|v| v.as_integer()).unwrap_or(0) as f64 / 1e3;
    let bw = s.get("min_bandwidth_bytes_per_s").and_then(|v| v.as_integer()).unwrap_or(i64::MAX) as f64;
    Duration::from_secs_f64(base + bytes as f64 / bw)
}

async fn iperf3_all(link: &Arc<Link>) -> Vec<IperfRow> {
    let mut rows = Vec::new();
    for cc in [None, Some("cubic"), Some("bbr")] {
        let l = link.clone();
        match tokio::task::spawn_blocking(move || l.iperf3(IPERF3_SECONDS, 1, cc)).await {
            Ok(Ok(r)) => rows.push(IperfRow {
                congestion: if cc.is_none() { format!("default ({})", r.congestion) } else { r.congestion.clone() },
                gbps: r.bytes_per_s / 1e9,
                retransmits: r.retransmits,
            }),
            Ok(Err(e)) => eprintln!("kvgate bench: iperf3 ({}): {e}", cc.unwrap_or("default")),
            Err(e) => eprintln!("kvgate bench: iperf3: {e}"),
        }
    }
    rows
}

async fn measure(
    binary: &Path,
    link: &Arc<Link>,
    dir: &Path,
    v: &Variant,
    ucx_library: &Result<PathBuf, String>,
    inflight: u64,
    quick: bool,
) -> anyhow::Result<Vec<Row>> {
    // Experiments: extra keys of the plugin's own table for every variant of this deployment
    // (`KVGATE_BED_QUIC_CONFIG='socket_buffer_bytes = 8388608'`, `KVGATE_BED_UCX_CONFIG=...`).
    let env_key = match v.deployment {
        Deployment::Quic => "KVGATE_BED_QUIC_CONFIG",
        Deployment::UcxTcp => "KVGATE_BED_UCX_CONFIG",
    };
    let extra = std::env::var(env_key).map(|e| e.replace(';', "\n") + "\n").unwrap_or_default();
    let o = Overrides {
        ucx_library: ucx_library.as_ref().ok().cloned(),
        plugin_config: v.plugin_config.clone() + &extra,
        scheduler: format!("min_bandwidth_bytes_per_s = {BED_MIN_BANDWIDTH_BYTES_PER_S}\n"),
    };
    if v.deployment == Deployment::UcxTcp {
        if let Err(why) = ucx_library {
            anyhow::bail!("the UCX plugin library is not available: {why}");
        }
    }
    let mut pair = BedPair::start(binary, link, dir, v.deployment, &o).await?;
    let mut rows = Vec::new();
    for &room_bytes in &ROOM_SIZES {
        let total = if quick { BYTES_PER_ROW / 4 } else { BYTES_PER_ROW };
        let w = Workload { room_bytes, rooms: (total / room_bytes).max(inflight), inflight, verify_each_room: false };
        let engines = Engines::connect(dir, &pair.prefill().socket, &pair.decode().socket, &w).await?;
        // One room first: connections warm, pages of both pools touched.
        engines.run(&Workload { rooms: inflight, ..w }).await?;
        let cpu0 = pair.cpu_used();
        let r = engines.run(&w).await?;
        let cpu = pair.cpu_used().saturating_sub(cpu0);
        // With `inflight` rooms sharing the link, the last to start counts the others' bytes ahead of
        // its own (the core's transfer bound): the most any of them is given.
        let bound = shipped_bound(v.deployment, room_bytes * inflight);
        let latencies: Vec<Duration> = r.rooms.iter().filter_map(|x| x.ended().map(|e| e - x.started)).collect();
        let moved_gb = (r.succeeded() as u64 * room_bytes) as f64 / 1e9;
        rows.push(Row {
            transport: v.name.clone(),
            room_bytes,
            rooms: r.rooms.len() as u64,
            succeeded: r.succeeded() as u64,
            gbps: r.bytes_per_s() / 1e9,
            of_iperf3: 0.0,
            cpu_s_per_gb: if moved_gb > 0.0 { cpu.as_secs_f64() / moved_gb } else { f64::NAN },
            over_shipped_bound: latencies.iter().filter(|l| **l > bound).count() as u64,
            slowest_room_s: latencies.iter().max().copied().unwrap_or_default().as_secs_f64(),
            shipped_bound_s: bound.as_secs_f64(),
            failures: r.describe_failures(),
            bytes_verified: r.slots_verified == Some(true),
        });
    }
    pair.stop();
    Ok(rows)
}

/// The link bench: returns the process exit code.
#[allow(clippy::too_many_arguments)]
pub async fn run(
    binary: &Path,
    dir: &Path,
    profile: &Profile,
    names: &[String],
    ucx_library: &Result<PathBuf, String>,
    inflight: u64,
    quick: bool,
    json: Option<&Path>,
) -> anyhow::Result<i32> {
    kvgate_netbed::available().map_err(|why| anyhow::anyhow!("--link-profile: {why}"))?;
    if !kvgate_netbed::iperf3_available() {
        anyhow::bail!(
            "--link-profile: iperf3 is not installed (the reference every figure is a ratio of; Debian iperf3)"
        );
    }
    let link = Arc::new(Link::start(profile)?);
    println!("kvgate bench --link-profile {}: {}; {} rooms in flight", profile.name, profile.describe(), inflight);
    let (variants, skipped) = variants(names);
    for (n, why) in &skipped {
        println!("  {n}: skipped: {why}");
    }
    // iperf3 before and after the transports: the reference brackets them in the same window.
    let mut iperf3 = iperf3_all(&link).await;
    let mut rows = Vec::new();
    let mut broken = false;
    for v in &variants {
        match measure(binary, &link, dir, v, ucx_library, inflight, quick).await {
            Ok(r) => rows.extend(r),
            Err(e) => {
                broken = true;
                println!("  {}: failed: {e:#}", v.name);
            }
        }
    }
    iperf3.extend(iperf3_all(&link).await);
    let best = iperf3.iter().map(|r| r.gbps).fold(0.0, f64::max);
    for r in &mut rows {
        r.of_iperf3 = if best > 0.0 { r.gbps / best } else { f64::NAN };
    }
    println!("\niperf3 over the same link (TCP, 1 stream, {IPERF3_SECONDS} s each, before and after):");
    for r in &iperf3 {
        println!("  {:<16} {:>6.3} GB/s  {:>6} retransmits", r.congestion, r.gbps, r.retransmits);
    }
    println!("\n| transport | room | rooms ok | GB/s | of best iperf3 | gateway CPU s/GB | over shipped bound (slowest / bound) | bytes |");
    println!("|---|---|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {} MiB | {}/{} | {:.3} | {:.2} | {:.2} | {} ({:.2} s / {:.2} s) | {} |",
            r.transport,
            r.room_bytes >> 20,
            r.succeeded,
            r.rooms,
            r.gbps,
            r.of_iperf3,
            r.cpu_s_per_gb,
            r.over_shipped_bound,
            r.slowest_room_s,
            r.shipped_bound_s,
            if r.bytes_verified { "verified" } else { "NOT VERIFIED" }
        );
        if !r.failures.is_empty() {
            print!("{}", r.failures.lines().take(5).map(|l| format!("    {l}\n")).collect::<String>());
        }
        broken |= r.succeeded < r.rooms || !r.bytes_verified;
    }
    let c = link.counts(0);
    println!(
        "\nrelay, host 0 to 1: {} packets forwarded, {} lost at random, {} queue drops",
        c.forwarded_packets, c.lost_packets, c.queue_drops
    );
    let report = LinkReport { profile: profile.describe(), inflight, iperf3, rows, skipped };
    if let Some(path) = json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)?;
    }
    Ok(if broken { 1 } else { 0 })
}
