//! The per-room cost: 4 KiB rooms one at a time through two gateways (latency p50/p99, CPU per room
//! of both gateways and of the engines' process), against the engine-API round trip over the same
//! sockets in the same run (`Info`, the cheapest call: its p50 and its CPU per call). Measures only.

use super::control::start_control_rig;
use super::datapath::{fresh_room, move_room, Rig};
use super::results::RoomCost;
use super::stats::{millis, percentile};
use kvgate_client::slice;
use std::time::{Duration, Instant};

/// Bytes of the room whose cost is measured (one page of KV, the size the field quotes).
pub const ROOM_COST_BYTES: u64 = 4096;
/// Rooms moved before the timed ones (connections, allocator and page tables warm).
pub const ROOM_COST_WARMUP_ROOMS: u64 = 50;

/// `rooms` rooms of [`ROOM_COST_BYTES`], one after the other, on a fresh control rig, and as many
/// `Info` round trips on each engine's socket (alternating halves before and after the rooms).
pub async fn measure(binary: &std::path::Path, dir: &std::path::Path, rooms: u64) -> anyhow::Result<RoomCost> {
    let mut rig = start_control_rig(binary, dir, &super::control::control_settings()).await?;
    let result = measure_on(&rig, rooms).await;
    rig.stop();
    result
}

/// The batched figure on its own fresh control rig.
pub async fn measure_batched(
    binary: &std::path::Path,
    dir: &std::path::Path,
    rooms: u64,
) -> anyhow::Result<super::results::BatchedRooms> {
    let mut rig = start_control_rig(binary, dir, &super::control::control_settings()).await?;
    let result = batched_rooms_per_second(&rig, rooms).await;
    rig.stop();
    result
}

async fn measure_on(rig: &Rig, rooms: u64) -> anyhow::Result<RoomCost> {
    for _ in 0..ROOM_COST_WARMUP_ROOMS {
        one_room(rig).await?;
    }
    let half = rooms / 2;
    let mut calls = round_trips(rig, half).await?;
    let cpu_before = rig.cpu_used();
    let started = Instant::now();
    let mut latencies = Vec::with_capacity(rooms as usize);
    let mut failures = 0u64;
    let mut reasons = Vec::new();
    for _ in 0..rooms {
        let run = one_room(rig).await?;
        if run.succeeded {
            latencies.push(run.latency);
        } else {
            failures += 1;
            if reasons.len() < 4 {
                reasons.push(run.reason);
            }
        }
    }
    let wall = started.elapsed();
    let cpu_after = rig.cpu_used();
    calls.merge(round_trips(rig, rooms - half).await?);
    let per_room =
        |after: Duration, before: Duration| after.saturating_sub(before).as_secs_f64() * 1e6 / rooms.max(1) as f64;
    Ok(RoomCost {
        rooms,
        bytes_per_room: ROOM_COST_BYTES,
        failures,
        failure_reasons: reasons,
        latency_p50_ms: millis(percentile(&latencies, 50.0)),
        latency_p99_ms: millis(percentile(&latencies, 99.0)),
        wall_us_per_room: wall.as_secs_f64() * 1e6 / rooms.max(1) as f64,
        gateway_cpu_us_per_room: per_room(cpu_after.0, cpu_before.0),
        engine_cpu_us_per_room: per_room(cpu_after.1, cpu_before.1),
        call_p50_ms: millis(percentile(&calls.latencies, 50.0)),
        call_cpu_us: calls.cpu_us_per_call(),
    })
}

async fn one_room(rig: &Rig) -> anyhow::Result<super::datapath::RoomRun> {
    let src = vec![slice(rig.prefill.region, 0, ROOM_COST_BYTES)];
    let dst = vec![slice(rig.decode.region, 0, ROOM_COST_BYTES)];
    move_room(&rig.prefill, &rig.decode, fresh_room(), src, dst).await
}

/// Round trips of the reference call and the CPU (gateways + this process) they used.
struct RoundTrips {
    latencies: Vec<Duration>,
    cpu: Duration,
}

impl RoundTrips {
    fn merge(&mut self, other: RoundTrips) {
        self.latencies.extend(other.latencies);
        self.cpu += other.cpu;
    }
    fn cpu_us_per_call(&self) -> f64 {
        self.cpu.as_secs_f64() * 1e6 / self.latencies.len().max(1) as f64
    }
}

/// `count` `Info` calls, alternating between the decode and the prefill engine's socket, one at a time.
async fn round_trips(rig: &Rig, count: u64) -> anyhow::Result<RoundTrips> {
    let before = rig.cpu_used();
    let mut latencies = Vec::with_capacity(count as usize);
    for i in 0..count {
        let engine = if i % 2 == 0 { &rig.decode } else { &rig.prefill };
        let started = Instant::now();
        engine.client.info().await?;
        latencies.push(started.elapsed());
    }
    let after = rig.cpu_used();
    let cpu = after.0.saturating_sub(before.0) + after.1.saturating_sub(before.1);
    Ok(RoundTrips { latencies, cpu })
}

/// Rooms one `ExpectBatch` / `SendBatch` pair carries in the batched rooms-per-second figure.
pub const BATCH_ROOMS: u64 = 1024;
/// Batches in flight at once in that figure (each on its own pool slots).
pub const BATCHES_IN_FLIGHT: u64 = 4;

/// `rooms` minimal rooms through the engine API in batches of [`BATCH_ROOMS`] (one `ExpectBatch` on
/// the decode engine and one `SendBatch` on the prefill engine per batch, issued together),
/// [`BATCHES_IN_FLIGHT`] batches at once; a batch is done when every room of it is terminal and
/// reusable on both sides. Rooms per second over the wall time, CPU per room.
pub async fn batched_rooms_per_second(rig: &Rig, rooms: u64) -> anyhow::Result<super::results::BatchedRooms> {
    use futures_util::{stream, StreamExt};
    let batches = rooms.div_ceil(BATCH_ROOMS);
    let cpu_before = rig.cpu_used();
    let started = Instant::now();
    let runs: Vec<anyhow::Result<(u64, Vec<Duration>)>> = stream::iter(0..batches)
        .map(|b| {
            let count = BATCH_ROOMS.min(rooms - b * BATCH_ROOMS);
            let slot_base = (b % BATCHES_IN_FLIGHT) * BATCH_ROOMS;
            one_batch(rig, slot_base, count)
        })
        .buffer_unordered(BATCHES_IN_FLIGHT as usize)
        .collect()
        .await;
    let wall = started.elapsed();
    let cpu_after = rig.cpu_used();
    let mut latencies = Vec::new();
    let mut failures = 0;
    let mut first_error = None;
    for run in runs {
        match run {
            Ok((failed, l)) => {
                failures += failed;
                latencies.extend(l);
            }
            Err(e) => {
                failures += BATCH_ROOMS;
                first_error.get_or_insert_with(|| format!("{e:#}"));
            }
        }
    }
    let per_room =
        |after: Duration, before: Duration| after.saturating_sub(before).as_secs_f64() * 1e6 / rooms.max(1) as f64;
    Ok(super::results::BatchedRooms {
        rooms,
        batch_rooms: BATCH_ROOMS,
        batches_in_flight: BATCHES_IN_FLIGHT,
        failures,
        first_error,
        rooms_per_second: latencies.len() as f64 / wall.as_secs_f64().max(1e-9),
        batch_p50_ms: millis(percentile(&latencies, 50.0)),
        gateway_cpu_us_per_room: per_room(cpu_after.0, cpu_before.0),
        engine_cpu_us_per_room: per_room(cpu_after.1, cpu_before.1),
    })
}

/// One batch of `count` minimal rooms on slots `slot_base..slot_base + count`: how many failed, and
/// the batch's latency once per successful room.
async fn one_batch(rig: &Rig, slot_base: u64, count: u64) -> anyhow::Result<(u64, Vec<Duration>)> {
    use super::control::MINIMAL_ROOM_BYTES;
    use kvgate_client::{proto, room_key};
    use kvgate_demo::gateways::{DECODE_NAME, PREFILL_NAME};
    let rooms: Vec<u64> = (0..count).map(|_| fresh_room()).collect();
    let mut listeners: Vec<_> =
        rooms.iter().map(|r| (rig.prefill.events.listen(*r), rig.decode.events.listen(*r))).collect();
    let offset = |i: u64| ((slot_base + i) * MINIMAL_ROOM_BYTES) % super::control::CONTROL_POOL_BYTES;
    let expects = rooms
        .iter()
        .enumerate()
        .map(|(i, r)| proto::ExpectRequest {
            key: Some(room_key(*r, 0)),
            peer: PREFILL_NAME.to_string(),
            parts: vec![proto::PartSlices {
                slices: vec![slice(rig.decode.region, offset(i as u64), MINIMAL_ROOM_BYTES)],
                ..Default::default()
            }],
            ..Default::default()
        })
        .collect();
    let sends = rooms
        .iter()
        .enumerate()
        .map(|(i, r)| proto::SendRequest {
            key: Some(room_key(*r, 0)),
            slices: vec![slice(rig.prefill.region, offset(i as u64), MINIMAL_ROOM_BYTES)],
            last: true,
            peer: DECODE_NAME.to_string(),
            ..Default::default()
        })
        .collect();
    let started = Instant::now();
    let (e, s) = tokio::join!(rig.decode.client.expect_batch(expects), rig.prefill.client.send_batch(sends));
    let refused = e?.results.iter().chain(s?.results.iter()).filter(|r| !r.reason.is_empty()).count() as u64;
    let wait = Duration::from_millis(super::datapath::BENCH_ROOM_WAIT_MS);
    let mut failed = 0;
    for (p, d) in listeners.iter_mut() {
        let (pt, dt) = tokio::join!(
            kvgate_demo::engine::wait_terminal(p, started, wait),
            kvgate_demo::engine::wait_terminal(d, started, wait)
        );
        if !matches!((pt, dt), (Ok(p), Ok(d)) if p.succeeded && d.succeeded) {
            failed += 1;
        }
    }
    let latency = started.elapsed();
    let reuse = Duration::from_millis(super::datapath::BENCH_REUSABLE_WAIT_MS);
    for (p, d) in listeners.iter_mut() {
        let _ =
            tokio::join!(kvgate_demo::engine::wait_reusable(p, reuse), kvgate_demo::engine::wait_reusable(d, reuse));
    }
    for r in &rooms {
        rig.prefill.events.forget(*r);
        rig.decode.events.forget(*r);
    }
    let failed = failed.max(refused);
    Ok((failed, vec![latency; (count - failed) as usize]))
}
