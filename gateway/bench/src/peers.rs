//! `kvgate bench --peers nixl,mooncake`: the same transfers through NVIDIA NIXL and Mooncake's
//! Transfer Engine on this host, beside kvgate's, in alternating rounds (kvgate then the peers, then
//! the peers then kvgate), each cell one transfer in flight, every cell's bytes verified by whoever
//! moved them. The peers run from `bench/peers` of the source tree in a virtual environment it
//! creates once (`target/peers-venv`); their runners print one JSON object per cell. Measures only.

use super::datapath::{run_cell, Rig};
use super::matrix::{self, MatrixEntry};
use super::plan::Plan;
use super::reference::CopyBudget;
use super::stats::size_label;
use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Rounds of each side (kvgate, then every peer; then the other way round).
pub const PEER_ROUNDS: usize = 2;
/// The cells of the side-by-side run when `--block-sizes` / `--blocks` do not say: the 4 KiB
/// latency row, 100 blocks of 64 KiB (a chunk of layers), one 4 MiB and one 64 MiB block.
pub const PEER_CELLS: [(u64, u64); 4] = [(4 << 10, 1), (64 << 10, 100), (4 << 20, 1), (64 << 20, 1)];

/// One cell as a peer runner reports it (`bench/peers/README.md`).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct PeerCell {
    pub peer: String,
    pub transport: String,
    pub block_bytes: u64,
    pub blocks: u64,
    pub transfers: u64,
    pub gbps: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub verified: bool,
    #[serde(default)]
    pub error: Option<String>,
}

/// What one system moved in one cell over the rounds (the round figures, in run order).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct SideBySide {
    /// `kvgate shm`, `nixl ucx`, `mooncake tcp`, ...
    pub system: String,
    pub block_bytes: u64,
    pub blocks: u64,
    pub gbps: Vec<f64>,
    pub p50_ms: Vec<f64>,
    pub verified: bool,
    pub errors: Vec<String>,
}

/// The peers and the transports each is run with; kvgate's plugins compared with each.
const PEER_TRANSPORTS: [(&str, &str); 3] = [("nixl", "ucx"), ("nixl", "tcp"), ("mooncake", "tcp")];
const KVGATE_PLUGINS: [&str; 3] = ["shm", "ucx-tcp", "quic"];

/// The source tree's `bench/peers` (holding `run.sh` and `setup.sh`), found upwards from this binary
/// or the working directory.
pub fn peers_dir() -> anyhow::Result<PathBuf> {
    let starts = [std::env::current_exe().ok(), std::env::current_dir().ok()];
    for start in starts.into_iter().flatten() {
        for dir in start.ancestors() {
            let candidate = dir.join("bench").join("peers");
            if candidate.join("run.sh").is_file() && candidate.join("setup.sh").is_file() {
                return Ok(candidate);
            }
        }
    }
    bail!("kvgate bench --peers needs the source tree's bench/peers (run.sh, setup.sh): run it from a clone of kvgate")
}

/// Create (or reuse) the peers' virtual environment next to the build (`target/peers-venv`).
pub fn prepare_venv(peers: &Path) -> anyhow::Result<PathBuf> {
    let root = peers.parent().and_then(Path::parent).context("bench/peers has no repository root")?;
    let venv = root.join("target").join("peers-venv");
    println!(
        "peers: preparing the virtual environment {} (first time: downloads NIXL and Mooncake from PyPI)",
        venv.display()
    );
    let status = std::process::Command::new("bash")
        .arg(peers.join("setup.sh"))
        .arg(&venv)
        .status()
        .context("run bench/peers/setup.sh")?;
    if !status.success() {
        bail!("bench/peers/setup.sh {} failed ({status}); see its output above", venv.display());
    }
    Ok(venv)
}

/// `cells` through one peer and transport: its runner's JSON lines.
pub fn run_peer(
    peers: &Path,
    venv: &Path,
    peer: &str,
    transport: &str,
    cells: &[(u64, u64)],
    cell_ms: u64,
) -> Vec<PeerCell> {
    let spec: Vec<String> = cells.iter().map(|(b, n)| format!("{}:{n}", cell_size(*b))).collect();
    let output = std::process::Command::new("bash")
        .arg(peers.join("run.sh"))
        .arg(venv)
        .arg(peer)
        .args(["--cells", &spec.join(","), "--cell-ms", &cell_ms.to_string(), "--transport", transport])
        .stderr(std::process::Stdio::inherit())
        .output();
    let failed = |why: String| {
        cells
            .iter()
            .map(|(b, n)| PeerCell {
                peer: peer.into(),
                transport: transport.into(),
                block_bytes: *b,
                blocks: *n,
                error: Some(why.clone()),
                ..Default::default()
            })
            .collect()
    };
    let output = match output {
        Ok(o) => o,
        Err(e) => return failed(format!("run.sh did not start: {e}")),
    };
    let parsed: Vec<PeerCell> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter(|l| l.trim_start().starts_with('{'))
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    if parsed.is_empty() {
        return failed(format!("run.sh {peer} --transport {transport} printed no cell ({})", output.status));
    }
    parsed
}

/// `4K`, `64K`, `4M` as the runners read sizes.
fn cell_size(bytes: u64) -> String {
    match bytes {
        b if b % (1 << 20) == 0 => format!("{}M", b >> 20),
        b if b % (1 << 10) == 0 => format!("{}K", b >> 10),
        b => b.to_string(),
    }
}

/// kvgate's side of a round: each plugin's cells, one room in flight.
async fn kvgate_round(
    binary: &Path,
    dir: &Path,
    cells: &[(u64, u64)],
    plan: &Plan,
    ucx: &Result<PathBuf, String>,
) -> Vec<PeerCell> {
    let mut out = Vec::new();
    for name in KVGATE_PLUGINS {
        let entry: Result<MatrixEntry, String> = matrix::entry(name, ucx);
        let largest = cells.iter().map(|(b, n)| b * n).max().unwrap_or(1);
        let rig = match &entry {
            Ok(e) => Rig::start(binary, dir, &e.settings, largest, 1).await.map_err(|e| format!("{e:#}")),
            Err(why) => Err(why.clone()),
        };
        let mut rig = match rig {
            Ok(r) => r,
            Err(why) => {
                out.extend(cells.iter().map(|(b, n)| PeerCell {
                    peer: "kvgate".into(),
                    transport: name.into(),
                    block_bytes: *b,
                    blocks: *n,
                    error: Some(why.clone()),
                    ..Default::default()
                }));
                continue;
            }
        };
        let budget =
            CopyBudget { min_copies: plan.min_rooms_per_cell, budget: Duration::from_millis(plan.cell_budget_ms) };
        for &(block, blocks) in cells {
            let cell = PeerCell {
                peer: "kvgate".into(),
                transport: name.into(),
                block_bytes: block,
                blocks,
                ..Default::default()
            };
            // No reference run here: the peers are the comparison.
            out.push(match run_cell(&rig, None, block, blocks, 1, budget).await {
                Ok(c) => PeerCell {
                    transfers: c.transfers,
                    gbps: c.throughput_gbps,
                    p50_ms: c.latency_p50_ms,
                    p99_ms: c.latency_p99_ms,
                    verified: c.verified && c.failures == 0,
                    error: c.failure_reasons.first().cloned(),
                    ..cell
                },
                Err(e) => PeerCell { error: Some(format!("{e:#}")), ..cell },
            });
        }
        rig.stop();
    }
    out
}

/// The whole side-by-side run: rounds alternating kvgate and the peers, gathered per system and cell.
pub async fn run(
    binary: &Path,
    dir: &Path,
    peers_wanted: &[String],
    plan: &Plan,
    cells: &[(u64, u64)],
    ucx: &Result<PathBuf, String>,
) -> anyhow::Result<Vec<SideBySide>> {
    for p in peers_wanted {
        if !matches!(p.as_str(), "nixl" | "mooncake") {
            bail!("--peers: unknown peer {p:?} (nixl, mooncake)");
        }
    }
    let peers = peers_dir()?;
    let venv = prepare_venv(&peers)?;
    let mut all: Vec<PeerCell> = Vec::new();
    for round in 0..PEER_ROUNDS {
        let peer_side = |all: &mut Vec<PeerCell>| {
            for (peer, transport) in PEER_TRANSPORTS.iter().filter(|(p, _)| peers_wanted.iter().any(|w| w == p)) {
                println!("peers: round {} of {PEER_ROUNDS}: {peer} over {transport}", round + 1);
                all.extend(run_peer(&peers, &venv, peer, transport, cells, plan.cell_budget_ms));
            }
        };
        if round % 2 == 1 {
            peer_side(&mut all);
        }
        println!("peers: round {} of {PEER_ROUNDS}: kvgate ({})", round + 1, KVGATE_PLUGINS.join(", "));
        all.extend(kvgate_round(binary, dir, cells, plan, ucx).await);
        if round % 2 == 0 {
            peer_side(&mut all);
        }
    }
    Ok(gather(&all))
}

/// Per system and cell, the figures of every round in run order.
pub fn gather(all: &[PeerCell]) -> Vec<SideBySide> {
    let mut out: Vec<SideBySide> = Vec::new();
    for c in all {
        let system = format!("{} {}", c.peer, c.transport);
        let at = out.iter().position(|s| s.system == system && s.block_bytes == c.block_bytes && s.blocks == c.blocks);
        let entry = match at {
            Some(i) => &mut out[i],
            None => {
                out.push(SideBySide {
                    system,
                    block_bytes: c.block_bytes,
                    blocks: c.blocks,
                    verified: true,
                    ..Default::default()
                });
                out.last_mut().expect("just pushed")
            }
        };
        match &c.error {
            Some(e) if c.gbps == 0.0 => entry.errors.push(e.clone()),
            _ => {
                entry.gbps.push(c.gbps);
                entry.p50_ms.push(c.p50_ms);
            }
        }
        entry.verified &= c.verified;
    }
    out
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => 0.0,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

/// The table: per cell, each system's median GB/s and p50 over the rounds, and its ratio to the
/// kvgate plugin it is compared with (same host: shm; over TCP: UCX over TCP).
pub fn table(rows: &[SideBySide]) -> String {
    use std::fmt::Write;
    let mut out = String::from("| cell | system | GB/s (median of rounds) | p50 ms | rounds | verified | kvgate / this |\n|---|---|---|---|---|---|---|\n");
    let mut cells: Vec<(u64, u64)> = rows.iter().map(|r| (r.block_bytes, r.blocks)).collect();
    cells.dedup();
    cells.sort();
    cells.dedup();
    for (block, blocks) in cells {
        let of =
            |system: &str| rows.iter().find(|r| r.system == system && r.block_bytes == block && r.blocks == blocks);
        for row in rows.iter().filter(|r| r.block_bytes == block && r.blocks == blocks) {
            let against = if row.system.starts_with("kvgate") {
                None
            } else if row.system == "nixl ucx" {
                of("kvgate shm")
            } else {
                of("kvgate ucx-tcp")
            };
            let ratio = match against {
                Some(k) if !k.gbps.is_empty() && median(&row.gbps) > 0.0 => {
                    format!("{:.2} ({})", median(&k.gbps) / median(&row.gbps), k.system)
                }
                _ => "-".into(),
            };
            let gbps = if row.gbps.is_empty() {
                format!("not run: {}", row.errors.first().map(String::as_str).unwrap_or("?"))
            } else {
                format!("{:.3}", median(&row.gbps))
            };
            let _ = writeln!(
                out,
                "| {} x {blocks} | {} | {gbps} | {:.3} | {} | {} | {ratio} |",
                size_label(block),
                row.system,
                median(&row.p50_ms),
                row.gbps.len(),
                if row.verified { "yes" } else { "NO" },
            );
        }
    }
    out
}

/// Where the side-by-side section starts and ends in BENCHMARKS.md: `--peers --markdown` writes
/// between them, and the main run's `--markdown` keeps what is there.
pub const SECTION_START: &str = "<!-- kvgate bench --peers: start -->";
pub const SECTION_END: &str = "<!-- kvgate bench --peers: end -->";

/// The side-by-side section of BENCHMARKS.md: how it was measured, on what, and the table.
pub fn markdown_section(rows: &[SideBySide], command: &str, machine: &str, finished_utc: &str, load: &str) -> String {
    format!(
        "{SECTION_START}\n## Beside NIXL and Mooncake\n\n`{command}` on {machine}, finished {finished_utc} UTC; load average {load}. \
         The same cells through kvgate (two gateways and the engine API, one room in flight) and through NVIDIA NIXL and \
         Mooncake's Transfer Engine driven through their Python APIs (bench/peers/README.md: versions and caveats), one \
         transfer in flight, {PEER_ROUNDS} rounds alternating kvgate and the peers; every cell's destination bytes are \
         compared with the source. `kvgate / this` is kvgate's median GB/s over the peer's: over shared memory against \
         kvgate shm, over TCP against kvgate's UCX-over-TCP plugin.\n\n{}\n{SECTION_END}\n",
        table(rows)
    )
}

/// `page` with its side-by-side section replaced by `section` (or `section` appended when it has none).
pub fn splice_section(page: &str, section: &str) -> String {
    match (page.find(SECTION_START), page.find(SECTION_END)) {
        (Some(start), Some(end)) if end > start => {
            format!("{}{}{}", &page[..start], section.trim_end_matches('\n'), &page[end + SECTION_END.len()..])
        }
        _ => format!("{}\n{section}", page.trim_end_matches('\n').to_string() + "\n"),
    }
}

/// The side-by-side section of `page`, if it has one.
pub fn section_of(page: &str) -> Option<&str> {
    let start = page.find(SECTION_START)?;
    let end = page.find(SECTION_END)? + SECTION_END.len();
    (end > start).then(|| &page[start..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_section_is_replaced_in_place_or_appended_and_survives_a_regenerated_page() {
        let section = markdown_section(
            &gather(&[cell("nixl", "ucx", 2.0)]),
            "kvgate bench --peers nixl",
            "a host",
            "now",
            "1 1 1",
        );
        let page = "# Benchmarks\n\nfigures\n";
        let once = splice_section(page, &section);
        assert!(once.starts_with(page) && once.contains("| nixl ucx |"), "{once}");
        let newer = markdown_section(
            &gather(&[cell("nixl", "ucx", 5.0)]),
            "kvgate bench --peers nixl",
            "a host",
            "later",
            "1 1 1",
        );
        let twice = splice_section(&once, &newer);
        assert_eq!(twice.matches(SECTION_START).count(), 1, "{twice}");
        assert!(twice.contains("5.000") && !twice.contains("| 2.000 |"), "{twice}");
        let regenerated = splice_section("# Benchmarks\n\nnew figures\n", section_of(&twice).unwrap());
        assert!(regenerated.contains("new figures") && regenerated.contains("5.000"), "{regenerated}");
    }

    fn cell(peer: &str, transport: &str, gbps: f64) -> PeerCell {
        PeerCell {
            peer: peer.into(),
            transport: transport.into(),
            block_bytes: 65536,
            blocks: 100,
            transfers: 5,
            gbps,
            p50_ms: 1.0,
            p99_ms: 1.0,
            verified: true,
            error: None,
        }
    }

    #[test]
    fn the_runners_json_is_read_as_written() {
        let line = r#"{"peer": "nixl", "transport": "ucx", "block_bytes": 4096, "blocks": 1, "transfers": 900, "gbps": 0.8, "p50_ms": 0.004, "p99_ms": 0.01, "verified": true, "error": null}"#;
        let c: PeerCell = serde_json::from_str(line).unwrap();
        assert_eq!((c.peer.as_str(), c.block_bytes, c.transfers, c.verified, c.error), ("nixl", 4096, 900, true, None));
    }

    #[test]
    fn rounds_are_gathered_per_system_and_the_ratio_is_kvgate_over_the_peer() {
        let all = vec![
            cell("kvgate", "shm", 8.0),
            cell("nixl", "ucx", 2.0),
            cell("nixl", "ucx", 4.0),
            cell("kvgate", "shm", 12.0),
            cell("kvgate", "ucx-tcp", 1.0),
            cell("mooncake", "tcp", 0.5),
        ];
        let rows = gather(&all);
        let nixl = rows.iter().find(|r| r.system == "nixl ucx").unwrap();
        assert_eq!(nixl.gbps, vec![2.0, 4.0]);
        let t = table(&rows);
        assert!(t.contains("| 64 KiB x 100 | nixl ucx | 3.000 |"), "{t}");
        assert!(t.contains("3.33 (kvgate shm)"), "kvgate median 10 / nixl median 3:\n{t}");
        assert!(t.contains("2.00 (kvgate ucx-tcp)"), "{t}");
    }

    #[test]
    fn a_cell_that_could_not_run_says_why_and_an_unverified_one_says_no() {
        let mut bad = cell("mooncake", "tcp", 0.0);
        bad.error = Some("no listener".into());
        let mut wrong = cell("nixl", "tcp", 1.0);
        wrong.verified = false;
        let t = table(&gather(&[bad, wrong]));
        assert!(t.contains("not run: no listener"), "{t}");
        assert!(t.contains("| NO |"), "{t}");
    }

    #[test]
    fn sizes_are_written_as_the_runners_read_them() {
        assert_eq!(cell_size(4096), "4K");
        assert_eq!(cell_size(64 << 20), "64M");
        assert_eq!(cell_size(100), "100");
    }
}
