//! The data-path matrix of one plugin through the real gateway path: a prefill and a decode
//! `kvgate serve` (demo::gateways), two engines on the engine API (demo::engine) with shared-memory
//! pools, one room per transfer (one part, one chunk of `blocks` slices), several rooms in flight on
//! distinct pool slots. Each cell's reference runs half just before the rooms and half just after
//! (moving the same bytes over the same slots in the same order where it copies memory). Never
//! decides an outcome itself.

use super::copy_limit::{LimitBuffers, LimitSamples};
use super::reference::{memcpy_copies, perftest_messages, tcp_copies, ucx_perftest_gbps, CopyBudget, ReferenceKind};
use super::results::{CellResult, CopyLimit};
use super::stats::{gbps, millis, percentile, ratio};
use anyhow::{bail, Context};
use kvgate_client::{proto, room_key, slice, Slice};
use kvgate_demo::engine::{wait_reusable, wait_terminal, Engine};
use kvgate_demo::gateways::{GatewayPair, PairSettings, DECODE_NAME, PREFILL_NAME};
use kvgate_demo::pool::KvPool;
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

/// A started pair with its two engines and this process's own mappings of the pool files (each pool
/// `slot_bytes x slots` long; a cell cuts it into as many transfer-sized slots as fit).
pub struct Rig {
    pub pair: GatewayPair,
    pub prefill: Arc<Engine>,
    pub decode: Arc<Engine>,
    pub slot_bytes: u64,
    pub slots: u64,
    src_map: Arc<Mutex<memmap2::MmapMut>>,
    dst_map: Arc<Mutex<memmap2::MmapMut>>,
    /// The buffers of the machine's copy limit, measured around every cell when set (shm).
    pub copy_limit: Option<Arc<Mutex<LimitBuffers>>>,
}

fn map_file(path: &Path, len: u64) -> anyhow::Result<memmap2::MmapMut> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .with_context(|| format!("open {}", path.display()))?;
    // SAFETY: the pool file belongs to this process; the gateways only write into it inside rooms the
    // bench started and waited for, and the reference copies run between rooms.
    Ok(unsafe { memmap2::MmapOptions::new().len(len as usize).map_mut(&file)? })
}

impl Rig {
    /// Start a pair for `settings.plugin`, create pools of `slots` x `slot_bytes` and register them.
    pub async fn start(
        binary: &Path,
        dir: &Path,
        settings: &PairSettings,
        slot_bytes: u64,
        slots: u64,
    ) -> anyhow::Result<Rig> {
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
        Ok(Rig { pair, prefill, decode, slot_bytes, slots, src_map, dst_map, copy_limit: None })
    }

    pub fn stop(&mut self) {
        self.pair.stop();
    }

    /// Measure the machine's copy limit around every cell from now on: `threads` threads (the
    /// plugin's copy threads), buffers sized for a last-level cache of `llc_kib` KiB.
    pub async fn measure_copy_limit(&mut self, threads: usize, llc_kib: u64) -> anyhow::Result<()> {
        let bytes = super::copy_limit::limit_buffer_bytes(llc_kib);
        let buffers = tokio::task::spawn_blocking(move || LimitBuffers::new(bytes, threads)).await?;
        self.copy_limit = Some(Arc::new(Mutex::new(buffers)));
        Ok(())
    }

    /// Context switches so far of (both gateways, this process).
    pub fn context_switches(&self) -> SwitchCounts {
        SwitchCounts::of(self.pair.prefill.pid(), self.pair.decode.pid())
    }

    /// CPU time used so far by (both gateways, this process).
    pub fn cpu_used(&self) -> (Duration, Duration) {
        let of = |pid: Option<i32>| pid.and_then(super::system::process_cpu).unwrap_or_default();
        (of(self.pair.prefill.pid()) + of(self.pair.decode.pid()), of(Some(std::process::id() as i32)))
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
pub async fn move_room(
    prefill: &Engine,
    decode: &Engine,
    room: u64,
    src: Vec<Slice>,
    dst: Vec<Slice>,
) -> anyhow::Result<RoomRun> {
    let mut p_rx = prefill.events.listen(room);
    let mut d_rx = decode.events.listen(room);
    let started = Instant::now();
    let request = proto::SendRequest {
        offset: None,
        key: Some(room_key(room, 0)),
        part: 0,
        chunk: 0,
        slices: src,
        last: true,
        peer: DECODE_NAME.to_string(),
    };
    let (expect, send) =
        tokio::join!(decode.client.expect(room_key(room, 0), PREFILL_NAME, vec![dst], 0), prefill.client.send(request));
    let refused = match (expect, send) {
        (Err(s), _) => {
            Some(format!("expect refused: {}", kvgate_client::reason_of(&s).unwrap_or_else(|| s.message().to_string())))
        }
        (_, Err(s)) => {
            Some(format!("send refused: {}", kvgate_client::reason_of(&s).unwrap_or_else(|| s.message().to_string())))
        }
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
/// Whether one room moved the bytes intact, and how long it took.
async fn verified_room(rig: &Rig, block: u64, blocks: u64) -> anyhow::Result<(bool, Duration)> {
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
    Ok((run.succeeded && same, run.latency))
}

/// Most distinct failure reasons one cell keeps for the report (every failure is logged anyway).
pub const MAX_FAILURE_REASONS_PER_CELL: usize = 8;

/// Pool slots of one cell start on this boundary (a page, as an engine's KV blocks would).
pub const CELL_SLOT_ALIGN_BYTES: u64 = 4096;

/// How a cell cuts the pools: the distance between two transfers' slots and how many rooms it keeps
/// in flight (at most `inflight_rooms`, at most as many slots as the pool holds, at least 1).
pub fn cell_slots(pool_bytes: u64, transfer_bytes: u64, inflight_rooms: u64) -> (u64, u64) {
    let stride = transfer_bytes.div_ceil(CELL_SLOT_ALIGN_BYTES).max(1) * CELL_SLOT_ALIGN_BYTES;
    (stride, (pool_bytes / stride).clamp(1, inflight_rooms.max(1)))
}

/// One reference measurement of a cell.
struct ReferenceFigure {
    gbps: f64,
    p50: Duration,
    p99: Duration,
}

/// A `ucx_perftest` run: how many bytes it moved, at what rate (GB/s).
struct PerftestRun {
    bytes: u64,
    gbps: f64,
}

/// Run one cell: a verified warm-up room, one untimed room on every other slot it uses, then timed
/// rooms (up to `inflight_rooms` at once, each on its own pool slot) for at least `budget`; the
/// reference moves the same bytes for about as long, half before the rooms and half after (so does
/// the copy limit, where the rig measures it). Before the timed rooms every slot they may write is
/// overwritten with the complement of its source; after them (outside the timed window) every slot
/// they wrote is compared with its source, and a slot that differs fails the cell.
pub async fn run_cell(
    rig: &Rig,
    reference: Option<ReferenceKind>,
    block: u64,
    blocks: u64,
    inflight_rooms: u64,
    budget: CopyBudget,
) -> anyhow::Result<CellResult> {
    let (verified, verified_latency) = verified_room(rig, block, blocks).await?;
    let bytes = block * blocks;
    let (stride, depth) = cell_slots(rig.slot_bytes * rig.slots, bytes, inflight_rooms);
    let (warm_rooms, warm_up_failures) = warm_slots(rig, stride, depth, block, blocks).await;
    // The reference runs half just before the rooms and half just after, so a change
    // of load on this shared machine during the cell weighs on both sides alike.
    let half = CopyBudget { min_copies: budget.min_copies.div_ceil(2), budget: budget.budget / 2 };
    // The copy limit (shm) likewise, for half the reference's time on each side (at least one pass
    // of each method).
    let limit_before = match &rig.copy_limit {
        Some(buffers) => Some(limit_half(buffers.clone(), half.budget / 2).await?),
        None => None,
    };
    let copies_before = match reference {
        Some(kind) if kind.copies_memory() => {
            Some(memory_reference_copies(rig, kind, block, blocks, (stride, depth), half).await)
        }
        _ => None,
    };
    // `ucx_perftest` is sized by bytes, not time: its first half by the verified room's rate (one
    // room alone, so usually slower than the cell and this half shorter than the second), its second
    // half by what the rooms moved. Its figure is the bytes of both over their time.
    let perftest_before = match reference {
        Some(kind @ ReferenceKind::UcxPerftest(_)) => {
            let guess_bytes =
                (bytes as f64 / verified_latency.as_secs_f64().max(1e-6) * half.budget.as_secs_f64()) as u64;
            Some(perftest_run(kind, block, blocks, depth, half, guess_bytes).await)
        }
        _ => None,
    };
    // No earlier copy (warm-up rooms, the reference) may pass for a timed room's bytes.
    let offsets: Vec<u64> = (0..depth).map(|slot| slot * stride).collect();
    poison_slots(rig, offsets, bytes).await?;
    let cpu_before = rig.cpu_used();
    let started = Instant::now();
    let mut latencies = Vec::new();
    let mut failures = warm_up_failures.len() as u64;
    let mut reasons: std::collections::BTreeSet<String> = warm_up_failures.into_iter().collect();
    // Per slot: whether the last timed room on it succeeded (the slot then holds its bytes).
    let mut last_on_slot: std::collections::BTreeMap<u64, bool> = std::collections::BTreeMap::new();
    let mut started_rooms = 0u64;
    let mut tasks = tokio::task::JoinSet::new();
    let more =
        |n: u64| n < super::plan::MAX_ROOMS_PER_CELL && (n < budget.min_copies || started.elapsed() < budget.budget);
    for slot in 0..depth {
        if !more(started_rooms) {
            break;
        }
        tasks.spawn(slot_room(rig.prefill.clone(), rig.decode.clone(), slot * stride, block, blocks));
        started_rooms += 1;
    }
    while let Some(joined) = tasks.join_next().await {
        let (offset, run) = joined.context("bench room task")?;
        let succeeded = matches!(&run, Ok(r) if r.succeeded);
        last_on_slot.insert(offset, succeeded);
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
            tasks.spawn(slot_room(rig.prefill.clone(), rig.decode.clone(), offset, block, blocks));
            started_rooms += 1;
        }
    }
    let wall = started.elapsed();
    let cpu_after = rig.cpu_used();
    // Outside the timed window, before the reference's second half writes the slots again. A slot
    // whose last room failed is a failure already; its bytes prove nothing.
    let written: Vec<u64> = last_on_slot.iter().filter(|(_, ok)| **ok).map(|(offset, _)| *offset).collect();
    let mismatches = verify_slots(rig, written.clone(), bytes).await?;
    for r in &reasons {
        tracing::warn!(reason = %r, block, blocks, "bench room failed");
    }
    let mut cell = CellResult {
        block_bytes: block,
        blocks,
        transfer_bytes: bytes,
        rooms_in_flight: depth,
        transfers: latencies.len() as u64,
        // The verified room, then the rooms `warm_slots` ran.
        warm_up_rooms: 1 + warm_rooms,
        failures,
        failure_reasons: reasons.iter().take(MAX_FAILURE_REASONS_PER_CELL).cloned().collect(),
        verified,
        verified_slots: written.len() as u64,
        throughput_gbps: gbps(bytes * latencies.len() as u64, wall),
        latency_p50_ms: millis(percentile(&latencies, 50.0)),
        latency_p99_ms: millis(percentile(&latencies, 99.0)),
        wall_seconds: wall.as_secs_f64(),
        gateway_cpu_seconds: cpu_after.0.saturating_sub(cpu_before.0).as_secs_f64(),
        engine_cpu_seconds: cpu_after.1.saturating_sub(cpu_before.1).as_secs_f64(),
        ..CellResult::default()
    };
    record_mismatches(&mut cell, &mismatches);
    if let Some(kind) = reference {
        let figure = match copies_before {
            Some(before) => {
                match (before, memory_reference_copies(rig, kind, block, blocks, (stride, depth), half).await) {
                    (Ok(mut copies), Ok(after)) => {
                        copies.extend(after);
                        Ok(figure_of_copies(bytes, &copies))
                    }
                    (Err(e), _) | (_, Err(e)) => Err(e),
                }
            }
            None => {
                let plugin_bytes_in_half = (cell.throughput_gbps * 1e9 * half.budget.as_secs_f64()) as u64;
                let after = perftest_run(kind, block, blocks, depth, half, plugin_bytes_in_half).await;
                match (perftest_before.unwrap_or_else(|| Err(anyhow::anyhow!("{kind:?} has no first half"))), after) {
                    (Ok(before), Ok(after)) => Ok(perftest_figure(block * blocks, &[before, after])),
                    (Err(e), _) | (_, Err(e)) => Err(e),
                }
            }
        };
        match figure {
            Ok(figure) => {
                cell.reference_gbps = figure.gbps;
                cell.reference_latency_p50_ms = millis(figure.p50);
                cell.reference_latency_p99_ms = millis(figure.p99);
                cell.ratio = ratio(cell.throughput_gbps, cell.reference_gbps);
            }
            Err(e) => {
                // The plugin's figures stand; the missing ratio is said, never guessed.
                tracing::warn!(block, blocks, "bench reference failed: {e:#}");
                cell.reference_error = format!("{e:#}");
            }
        }
    }
    if let (Some(mut samples), Some(buffers)) = (limit_before, &rig.copy_limit) {
        samples.add(&limit_half(buffers.clone(), half.budget / 2).await?);
        let (threads, working_set_bytes) = {
            let b = buffers.lock().unwrap_or_else(|e| e.into_inner());
            (b.threads() as u64, b.working_set_bytes())
        };
        let limit = CopyLimit {
            threads,
            working_set_bytes,
            memcpy_gbps: samples.memcpy_gbps(),
            streaming_gbps: samples.streaming_gbps(),
            gbps: samples.best_gbps(),
        };
        cell.limit_ratio = ratio(cell.throughput_gbps, limit.gbps);
        cell.copy_limit = Some(limit);
    }
    Ok(cell)
}

/// Half of a cell's copy-limit measurement, off the async threads.
async fn limit_half(buffers: Arc<Mutex<LimitBuffers>>, budget: Duration) -> anyhow::Result<LimitSamples> {
    Ok(tokio::task::spawn_blocking(move || buffers.lock().unwrap_or_else(|e| e.into_inner()).measure(budget)).await?)
}

/// A destination slot whose bytes differ from its source after the timed rooms.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotMismatch {
    /// The slot's first byte in the pools.
    pub offset: u64,
    /// How many of its bytes differ, and where the first one is (from the slot's start).
    pub differing_bytes: u64,
    pub first_difference: u64,
}

/// Overwrite `len` bytes at each of `offsets` in `dst` with the complement of `src` there: every
/// byte differs from its source until a room writes it.
pub fn poison(src: &[u8], dst: &mut [u8], offsets: &[u64], len: usize) {
    for &offset in offsets {
        let range = offset as usize..offset as usize + len;
        for (d, s) in dst[range.clone()].iter_mut().zip(&src[range]) {
            *d = !*s;
        }
    }
}

/// The slots at `offsets` (each `len` bytes) whose bytes in `dst` differ from `src`.
pub fn mismatched_slots(src: &[u8], dst: &[u8], offsets: &[u64], len: usize) -> Vec<SlotMismatch> {
    let mut out = Vec::new();
    for &offset in offsets {
        let range = offset as usize..offset as usize + len;
        let (s, d) = (&src[range.clone()], &dst[range]);
        if s == d {
            continue;
        }
        let differing: Vec<usize> = s.iter().zip(d).enumerate().filter(|(_, (a, b))| a != b).map(|(i, _)| i).collect();
        out.push(SlotMismatch {
            offset,
            differing_bytes: differing.len() as u64,
            first_difference: differing.first().copied().unwrap_or(0) as u64,
        });
    }
    out
}

/// Fail `cell` for `mismatches`: not verified, one failure per slot, and the first slot named
/// among the reasons (kept even when the reasons are at their bound).
pub fn record_mismatches(cell: &mut CellResult, mismatches: &[SlotMismatch]) {
    let Some(first) = mismatches.first() else { return };
    cell.verified = false;
    cell.failures += mismatches.len() as u64;
    let reason = format!(
        "bytes_mismatch: {} of {} slots written by the timed rooms differ from their source (slot at pool byte {}: {} bytes differ, the first at +{})",
        mismatches.len(),
        cell.verified_slots.max(mismatches.len() as u64),
        first.offset,
        first.differing_bytes,
        first.first_difference
    );
    if cell.failure_reasons.len() >= MAX_FAILURE_REASONS_PER_CELL {
        cell.failure_reasons.truncate(MAX_FAILURE_REASONS_PER_CELL - 1);
    }
    cell.failure_reasons.insert(0, reason);
}

/// [`poison`] the cell's slots in this process's mappings of the pools, off the async threads.
async fn poison_slots(rig: &Rig, offsets: Vec<u64>, len: u64) -> anyhow::Result<()> {
    let (s, d) = (rig.src_map.clone(), rig.dst_map.clone());
    tokio::task::spawn_blocking(move || {
        let s = s.lock().unwrap_or_else(|e| e.into_inner());
        let mut d = d.lock().unwrap_or_else(|e| e.into_inner());
        poison(&s, &mut d, &offsets, len as usize);
    })
    .await?;
    Ok(())
}

/// [`mismatched_slots`] over this process's mappings of the pools, off the async threads.
async fn verify_slots(rig: &Rig, offsets: Vec<u64>, len: u64) -> anyhow::Result<Vec<SlotMismatch>> {
    let (s, d) = (rig.src_map.clone(), rig.dst_map.clone());
    Ok(tokio::task::spawn_blocking(move || {
        let (s, d) = (s.lock().unwrap_or_else(|e| e.into_inner()), d.lock().unwrap_or_else(|e| e.into_inner()));
        mismatched_slots(&s, &d, &offsets, len as usize)
    })
    .await?)
}

/// One untimed room on each of the cell's slots after the first (the verified room used slot 0), all at
/// once; how many ran, and the reasons of those that failed. A slot's first room is the first to touch its pages through
/// the gateways' and the plugins' own mappings (page faults, UCX's first shared-memory copy from a
/// process that never read them), which a cell timing only a few large rooms would otherwise measure:
/// over UCX shared memory, 5 rooms of 10 000 x 4 KiB took 270 ms each on cold slots and a median
/// 118 ms in steady state.
async fn warm_slots(rig: &Rig, stride: u64, depth: u64, block: u64, blocks: u64) -> (u64, Vec<String>) {
    let mut tasks = tokio::task::JoinSet::new();
    for slot in 1..depth {
        tasks.spawn(slot_room(rig.prefill.clone(), rig.decode.clone(), slot * stride, block, blocks));
    }
    let (mut ran, mut reasons) = (0u64, Vec::new());
    while let Some(joined) = tasks.join_next().await {
        ran += 1;
        match joined {
            Ok((_, Ok(r))) if r.succeeded => {}
            Ok((_, Ok(r))) => reasons.push(r.reason),
            Ok((_, Err(e))) => reasons.push(format!("warm-up room: {e:#}")),
            Err(e) => reasons.push(format!("warm-up room task: {e}")),
        }
    }
    (ran, reasons)
}

async fn slot_room(
    prefill: Arc<Engine>,
    decode: Arc<Engine>,
    offset: u64,
    block: u64,
    blocks: u64,
) -> (u64, anyhow::Result<RoomRun>) {
    let src = block_slices(prefill.region, offset, block, blocks);
    let dst = block_slices(decode.region, offset, block, blocks);
    (offset, move_room(&prefill, &decode, fresh_room(), src, dst).await)
}

/// memcpy or TCP, between this process's mappings of the same pool files, slot after slot over the
/// cell's `(stride, depth)` slots, one transfer at a time; one latency per transfer.
async fn memory_reference_copies(
    rig: &Rig,
    kind: ReferenceKind,
    block: u64,
    blocks: u64,
    slots: (u64, u64),
    budget: CopyBudget,
) -> anyhow::Result<Vec<Duration>> {
    let (s, d) = (rig.src_map.clone(), rig.dst_map.clone());
    tokio::task::spawn_blocking(move || {
        let s = s.lock().unwrap_or_else(|e| e.into_inner());
        let mut d = d.lock().unwrap_or_else(|e| e.into_inner());
        match kind {
            ReferenceKind::Memcpy => Ok(memcpy_copies(&s, &mut d, block as usize, blocks as usize, slots, budget)),
            ReferenceKind::TcpLoopback => {
                tcp_copies(&s, &mut d, block as usize, blocks as usize, slots, budget).context("TCP loopback reference")
            }
            ReferenceKind::UcxPerftest(_) => anyhow::bail!("ucx_perftest copies no pool memory"),
        }
    })
    .await?
}

fn figure_of_copies(bytes: u64, copies: &[Duration]) -> ReferenceFigure {
    let total: Duration = copies.iter().sum();
    ReferenceFigure {
        gbps: gbps(bytes * copies.len() as u64, total),
        p50: percentile(copies, 50.0),
        p99: percentile(copies, 99.0),
    }
}

/// `ucx_perftest` streaming `block`-byte messages between its own buffers, about `wanted_bytes`
/// (within `perftest_messages`' bounds), with as many messages outstanding as the cell has rooms in
/// flight (`in_flight`).
async fn perftest_run(
    kind: ReferenceKind,
    block: u64,
    blocks: u64,
    in_flight: u64,
    budget: CopyBudget,
    wanted_bytes: u64,
) -> anyhow::Result<PerftestRun> {
    let ReferenceKind::UcxPerftest(transport) = kind else { anyhow::bail!("{kind:?} is not a ucx_perftest reference") };
    let messages = perftest_messages(block, blocks, budget.min_copies, wanted_bytes);
    let gbps = tokio::task::spawn_blocking(move || ucx_perftest_gbps(transport, block, messages, in_flight))
        .await?
        .map_err(anyhow::Error::msg)?;
    Ok(PerftestRun { bytes: messages * block, gbps })
}

/// One rate from `ucx_perftest` runs: their bytes over their summed time; p50 = p99 = one
/// transfer's bytes (`transfer_bytes`) at that rate.
fn perftest_figure(transfer_bytes: u64, runs: &[PerftestRun]) -> ReferenceFigure {
    // A run that reported no rate has no time to weigh its bytes by: it is left out of both sums.
    let timed = || runs.iter().filter(|r| r.gbps > 0.0);
    let bytes: u64 = timed().map(|r| r.bytes).sum();
    let seconds: f64 = timed().map(|r| r.bytes as f64 / (r.gbps * 1e9)).sum();
    let gbps = if seconds > 0.0 { bytes as f64 / seconds / 1e9 } else { 0.0 };
    let per_transfer =
        if gbps > 0.0 { Duration::from_secs_f64(transfer_bytes as f64 / (gbps * 1e9)) } else { Duration::ZERO };
    ReferenceFigure { gbps, p50: per_transfer, p99: per_transfer }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn perftest_halves_combine_by_bytes_over_time() {
        // 1 GB at 1 GB/s and 3 GB at 3 GB/s: 4 GB in 2 s.
        let f = perftest_figure(
            1 << 20,
            &[PerftestRun { bytes: 1_000_000_000, gbps: 1.0 }, PerftestRun { bytes: 3_000_000_000, gbps: 3.0 }],
        );
        assert!((f.gbps - 2.0).abs() < 1e-9, "{}", f.gbps);
        assert_eq!(f.p50, Duration::from_secs_f64((1u64 << 20) as f64 / 2e9));
        assert_eq!(perftest_figure(1, &[PerftestRun { bytes: 1, gbps: 0.0 }]).gbps, 0.0, "no rate, no figure");
        let one_unrated = perftest_figure(
            1,
            &[PerftestRun { bytes: 1_000_000_000, gbps: 0.0 }, PerftestRun { bytes: 2_000_000_000, gbps: 2.0 }],
        );
        assert!(
            (one_unrated.gbps - 2.0).abs() < 1e-9,
            "an unrated run's bytes do not inflate the rate: {}",
            one_unrated.gbps
        );
    }

    #[test]
    fn a_slot_that_differs_from_its_source_after_the_timed_rooms_fails_the_cell() {
        let (len, stride) = (3000usize, 4096u64);
        let offsets = [0, stride, 2 * stride];
        let src: Vec<u8> = (0..4 * stride as usize).map(|i| (i % 251) as u8).collect();
        // The warm-up rooms and the reference left right bytes: poisoning must undo them.
        let mut dst = src.clone();
        poison(&src, &mut dst, &offsets, len);
        let untouched = mismatched_slots(&src, &dst, &offsets, len);
        assert_eq!(untouched.len(), 3, "a slot no timed room wrote cannot pass");
        assert!(untouched.iter().all(|m| m.differing_bytes == len as u64 && m.first_difference == 0), "{untouched:?}");
        assert_eq!(&dst[len..stride as usize], &src[len..stride as usize], "bytes past the transfer are left alone");
        // Every room writes its slot: nothing differs, and the cell stands.
        for &o in &offsets {
            let r = o as usize..o as usize + len;
            dst[r.clone()].copy_from_slice(&src[r]);
        }
        assert!(mismatched_slots(&src, &dst, &offsets, len).is_empty());
        let good = CellResult { verified: true, verified_slots: 3, failure_reasons: vec![], ..CellResult::default() };
        let mut cell = good.clone();
        record_mismatches(&mut cell, &[]);
        assert!(!cell.failed());
        // One byte of the middle slot corrupted: that slot, that byte, and the cell fails.
        dst[stride as usize + 1234] ^= 0x40;
        let bad = mismatched_slots(&src, &dst, &offsets, len);
        assert_eq!(bad, vec![SlotMismatch { offset: stride, differing_bytes: 1, first_difference: 1234 }]);
        record_mismatches(&mut cell, &bad);
        assert!(cell.failed() && !cell.verified);
        assert_eq!(cell.failures, 1);
        assert!(cell.failure_reasons[0].starts_with("bytes_mismatch: 1 of 3 slots"), "{:?}", cell.failure_reasons);
        assert!(
            cell.failure_reasons[0].contains("slot at pool byte 4096: 1 bytes differ, the first at +1234"),
            "{:?}",
            cell.failure_reasons
        );
        // The mismatch is named even when the reasons were full.
        let mut full = CellResult {
            failure_reasons: (0..MAX_FAILURE_REASONS_PER_CELL).map(|i| format!("r{i}")).collect(),
            verified: true,
            ..CellResult::default()
        };
        record_mismatches(&mut full, &bad);
        assert_eq!(full.failure_reasons.len(), MAX_FAILURE_REASONS_PER_CELL);
        assert!(full.failure_reasons[0].starts_with("bytes_mismatch"));
        // And the report says so: the table's verified column, the run's exit status.
        let report = crate::results::BenchReport {
            data_path: vec![crate::results::PluginResult {
                plugin: "shm".into(),
                status: "measured".into(),
                cells: vec![cell],
                ..Default::default()
            }],
            ..Default::default()
        };
        let page = crate::report::markdown(&report, None);
        assert!(page.contains("| NO |") && page.contains("bytes_mismatch"), "{page}");
    }

    #[test]
    fn cells_cut_the_pool_into_aligned_slots_up_to_the_inflight_bound() {
        let mib = 1u64 << 20;
        assert_eq!(cell_slots(200 * mib, 4 * mib, 8), (4 * mib, 8), "capped by inflight_rooms");
        assert_eq!(cell_slots(200 * mib, 64 * mib, 8), (64 * mib, 3), "capped by the pool");
        assert_eq!(cell_slots(200 * mib, 200 * mib, 8), (200 * mib, 1));
        assert_eq!(cell_slots(8192, 4097, 8), (8192, 1), "slots start on a page");
        assert_eq!(cell_slots(4096, 8, 16), (4096, 1));
        assert_eq!(cell_slots(mib, 8, 0), (4096, 1), "at least one room");
    }
}

/// Context switches of both gateways and of this process (the engines), from `/proc`
/// (`system::process_context_switches`).
#[derive(Clone, Copy, Debug, Default)]
pub struct SwitchCounts {
    pub gateways: u64,
    pub engines: u64,
}

impl SwitchCounts {
    pub fn of(prefill: Option<i32>, decode: Option<i32>) -> SwitchCounts {
        let of = |pid: Option<i32>| pid.map(super::system::process_context_switches).unwrap_or_default();
        SwitchCounts { gateways: of(prefill) + of(decode), engines: of(Some(std::process::id() as i32)) }
    }

    /// Per room since `before`: (gateways, engines).
    pub fn per_room_since(&self, before: &SwitchCounts, rooms: u64) -> (f64, f64) {
        let per = |a: u64, b: u64| a.saturating_sub(b) as f64 / rooms.max(1) as f64;
        (per(self.gateways, before.gateways), per(self.engines, before.engines))
    }
}
