//! The data-path matrix of one plugin through the real gateway path: a prefill and a decode
//! `kvgate serve` (demo::gateways), two engines on the engine API (demo::engine) with shared-memory
//! pools, one room per transfer (one part, one chunk of `blocks` slices). After each cell its
//! reference copies the same bytes between the same pool files. Never decides an outcome itself.

use super::reference::{memcpy_copies, tcp_copies, CopyBudget, ReferenceKind};
use super::results::CellResult;
use super::stats::{gbps, millis, percentile, ratio};
use crate::demo::engine::{wait_reusable, wait_terminal, Engine};
use crate::demo::gateways::{GatewayPair, PairSettings, DECODE_NAME, PREFILL_NAME};
use crate::demo::pool::KvPool;
use anyhow::{bail, Context};
use kvgate_client::{proto, room_key, slice, Slice};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long one room may take before the bench calls it lost (bounded even for 512 MiB over QUIC).
pub const BENCH_ROOM_WAIT_MS: u64 = 60_000;
/// How long a finished room's slot may wait for `Reusable` before it is used again anyway.
pub const BENCH_REUSABLE_WAIT_MS: u64 = 5_000;

static NEXT_ROOM: AtomicU64 = AtomicU64::new(0);

/// A room id never used before in this process (distinct from the demo's ranges).
pub fn fresh_room() -> u64 {
    7_000_000_000 + u64::from(std::process::id()) * 10_000_000 + NEXT_ROOM.fetch_add(1, Ordering::Relaxed)
}

/// A started pair with its two engines and this process's own mappings of the pool files.
pub struct Rig {
    pub pair: GatewayPair,
    pub prefill: Arc<Engine>,
    pub decode: Arc<Engine>,
    pub slot_bytes: u64,
    pub slots: u64,
    src_map: Arc<Mutex<memmap2::MmapMut>>,
    dst_map: Arc<Mutex<memmap2::MmapMut>>,
}

fn map_file(path: &Path, len: u64) -> anyhow::Result<memmap2::MmapMut> {
    let file = std::fs::OpenOptions::new().read(true).write(true).open(path).with_context(|| format!("open {}", path.display()))?;
    // SAFETY: the pool file belongs to this process; the gateways only write into it inside rooms the
    // bench started and waited for, and the reference copies run between rooms.
    Ok(unsafe { memmap2::MmapOptions::new().len(len as usize).map_mut(&file)? })
}

impl Rig {
    /// Start a pair for `settings.plugin`, create pools of `slots` x `slot_bytes` and register them.
    pub async fn start(binary: &Path, dir: &Path, settings: &PairSettings, slot_bytes: u64, slots: u64) -> anyhow::Result<Rig> {
        let pair = GatewayPair::start(binary, dir, settings).await?;
        let tag = format!("{}-{}", settings.plugin, fresh_room());
        let src = KvPool::create(dir, &format!("bench-src-{tag}"), slot_bytes, slots)?;
        let dst = KvPool::create(dir, &format!("bench-dst-{tag}"), slot_bytes, slots)?;
        let (src_path, dst_path) = (src.path.clone(), dst.path.clone());
        let mut src = src;
        for s in 0..slots {
            src.fill(s, s + 1);
        }
        let prefill = Arc::new(Engine::connect(&pair.prefill.socket, src, "bench source pool").await?);
        let decode = Arc::new(Engine::connect(&pair.decode.socket, dst, "bench destination pool").await?);
        let src_map = Arc::new(Mutex::new(map_file(&src_path, slot_bytes * slots)?));
        let dst_map = Arc::new(Mutex::new(map_file(&dst_path, slot_bytes * slots)?));
        Ok(Rig { pair, prefill, decode, slot_bytes, slots, src_map, dst_map })
    }

    pub fn stop(&mut self) {
        self.pair.stop();
    }
}

/// `blocks` consecutive slices of `block` bytes from the start of `slot`.
fn block_slices(region: u64, slot_offset: u64, block: u64, blocks: u64) -> Vec<Slice> {
    (0..blocks).map(|i| slice(region, slot_offset + i * block, block)).collect()
}

/// What one room did.
pub struct RoomRun {
    pub latency: Duration,
    pub succeeded: bool,
    /// The failure reason of the side that failed (empty on success).
    pub reason: String,
}

/// One room through both gateways: expect (decode) and one last chunk (prefill) in parallel, then
/// both terminal events, then (bounded) both `Reusable` so the slot may be used again.
pub async fn move_room(prefill: &Engine, decode: &Engine, room: u64, src: Vec<Slice>, dst: Vec<Slice>) -> anyhow::Result<RoomRun> {
    let mut p_rx = prefill.events.listen(room);
    let mut d_rx = decode.events.listen(room);
    let started = Instant::now();
    let request = proto::SendRequest { key: Some(room_key(room, 0)), part: 0, chunk: 0, slices: src, last: true, peer: DECODE_NAME.to_string() };
    let (expect, send) = tokio::join!(decode.client.expect(room_key(room, 0), PREFILL_NAME, vec![dst], 0), prefill.client.send(request));
    let refused = match (expect, send) {
        (Err(s), _) => Some(format!("expect refused: {}", kvgate_client::reason_of(&s).unwrap_or_else(|| s.message().to_string()))),
        (_, Err(s)) => Some(format!("send refused: {}", kvgate_client::reason_of(&s).unwrap_or_else(|| s.message().to_string()))),
        _ => None,
    };
    if let Some(why) = refused {
        let _ = prefill.client.abort(room_key(room, 0), "bench: counterpart refused").await;
        let _ = decode.client.abort(room_key(room, 0), "bench: counterpart refused").await;
        prefill.events.forget(room);
        decode.events.forget(room);
        bail!("room {room}: {why}");
    }
    let wait = Duration::from_millis(BENCH_ROOM_WAIT_MS);
    let (p, d) = tokio::join!(wait_terminal(&mut p_rx, started, wait), wait_terminal(&mut d_rx, started, wait));
    let latency = started.elapsed();
    let outcome = match (p, d) {
        (Ok(p), Ok(d)) => {
            let reason = if !d.reason.is_empty() { d.reason } else { p.reason };
            RoomRun { latency, succeeded: p.succeeded && d.succeeded, reason }
        }
        (Err(e), _) | (_, Err(e)) => RoomRun { latency, succeeded: false, reason: format!("no terminal event: {e:#}") },
    };
    let reuse = Duration::from_millis(BENCH_REUSABLE_WAIT_MS);
    let _ = tokio::join!(wait_reusable(&mut p_rx, reuse), wait_reusable(&mut d_rx, reuse));
    prefill.events.forget(room);
    decode.events.forget(room);
    Ok(outcome)
}

/// Zero `len` bytes of the destination slot, move one room into it and compare with the source.
async fn verified_room(rig: &Rig, block: u64, blocks: u64) -> anyhow::Result<bool> {
    let len = (block * blocks) as usize;
    rig.dst_map.lock().unwrap_or_else(|e| e.into_inner())[..len].fill(0);
    let src = block_slices(rig.prefill.region, 0, block, blocks);
    let dst = block_slices(rig.decode.region, 0, block, blocks);
    let run = move_room(&rig.prefill, &rig.decode, fresh_room(), src, dst).await?;
    let (s, d) = (rig.src_map.clone(), rig.dst_map.clone());
    let same = tokio::task::spawn_blocking(move || {
        let (s, d) = (s.lock().unwrap_or_else(|e| e.into_inner()), d.lock().unwrap_or_else(|e| e.into_inner()));
        s[..len] == d[..len]
    })
    .await?;
    Ok(run.succeeded && same)
}

/// Run one cell: a verified warm-up room, then timed rooms (`inflight` at once, each on its own
/// slot) for at least `budget`, then the reference on the same bytes for as long.
pub async fn run_cell(rig: &Rig, reference: Option<ReferenceKind>, block: u64, blocks: u64, budget: CopyBudget) -> anyhow::Result<CellResult> {
    let verified = verified_room(rig, block, blocks).await?;
    let started = Instant::now();
    let mut latencies = Vec::new();
    let mut failures = 0u64;
    let mut reasons = std::collections::BTreeSet::new();
    let mut started_rooms = 0u64;
    let mut tasks = tokio::task::JoinSet::new();
    let more = |n: u64| n < super::plan::MAX_ROOMS_PER_CELL && (n < budget.min_copies || started.elapsed() < budget.budget);
    for slot in 0..rig.slots {
        if !more(started_rooms) {
            break;
        }
        tasks.spawn(slot_room(rig.prefill.clone(), rig.decode.clone(), rig.slot_bytes, slot, block, blocks));
        started_rooms += 1;
    }
    while let Some(joined) = tasks.join_next().await {
        let (slot, run) = joined.context("bench room task")?;
        match run {
            Ok(r) if r.succeeded => latencies.push(r.latency),
            Ok(r) => {
                failures += 1;
                reasons.insert(r.reason);
            }
            Err(e) => {
                failures += 1;
                reasons.insert(format!("{e:#}"));
            }
        }
        if more(started_rooms) {
            tasks.spawn(slot_room(rig.prefill.clone(), rig.decode.clone(), rig.slot_bytes, slot, block, blocks));
            started_rooms += 1;
        }
    }
    let wall = started.elapsed();
    for r in &reasons {
        tracing::warn!(reason = %r, block, blocks, "bench room failed");
    }
    let bytes = block * blocks;
    let mut cell = CellResult {
        block_bytes: block,
        blocks,
        transfer_bytes: bytes,
        transfers: latencies.len() as u64,
        failures,
        verified,
        throughput_gbps: gbps(bytes * latencies.len() as u64, wall),
        latency_p50_ms: millis(percentile(&latencies, 50.0)),
        latency_p99_ms: millis(percentile(&latencies, 99.0)),
        ..CellResult::default()
    };
    if let Some(kind) = reference {
        let copies = reference_copies(rig, kind, block, blocks, budget).await?;
        let total: Duration = copies.iter().sum();
        cell.reference_gbps = gbps(bytes * copies.len() as u64, total);
        cell.reference_latency_p50_ms = millis(percentile(&copies, 50.0));
        cell.reference_latency_p99_ms = millis(percentile(&copies, 99.0));
        cell.ratio = ratio(cell.throughput_gbps, cell.reference_gbps);
    }
    Ok(cell)
}

async fn slot_room(prefill: Arc<Engine>, decode: Arc<Engine>, slot_bytes: u64, slot: u64, block: u64, blocks: u64) -> (u64, anyhow::Result<RoomRun>) {
    let offset = slot * slot_bytes;
    let src = block_slices(prefill.region, offset, block, blocks);
    let dst = block_slices(decode.region, offset, block, blocks);
    (slot, move_room(&prefill, &decode, fresh_room(), src, dst).await)
}

async fn reference_copies(rig: &Rig, kind: ReferenceKind, block: u64, blocks: u64, budget: CopyBudget) -> anyhow::Result<Vec<Duration>> {
    let (s, d) = (rig.src_map.clone(), rig.dst_map.clone());
    tokio::task::spawn_blocking(move || {
        let s = s.lock().unwrap_or_else(|e| e.into_inner());
        let mut d = d.lock().unwrap_or_else(|e| e.into_inner());
        match kind {
            ReferenceKind::Memcpy => Ok(memcpy_copies(&s, &mut d, block as usize, blocks as usize, budget)),
            ReferenceKind::TcpLoopback => tcp_copies(&s, &mut d, block as usize, blocks as usize, budget).context("TCP loopback reference"),
        }
    })
    .await?
}
