//! The per-room cost: 4 KiB rooms one at a time through two gateways (latency p50/p99, CPU per room
//! of both gateways and of the engines' process), against the engine-API round trip over the same
//! sockets in the same run (`Info`, the cheapest call: its p50 and its CPU per call). Measures only.
//! The same measures run over gRPC (`Rig`) and over the engine fast lane (`lane_cost::LaneRig`),
//! through [`EnginePath`].

use super::control::start_control_rig;
use super::datapath::{fresh_room, move_room, Rig, SwitchCounts};
use super::results::RoomCost;
use super::stats::{millis, percentile};
use kvgate_client::{proto, slice};
use kvgate_demo::engine::EventRouter;
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

/// How the engines of a started pair reach their gateways: gRPC (`Rig`) or the lane.
pub trait EnginePath {
    /// One 4 KiB room through both gateways (slot 0 of both pools).
    fn one_room(&self) -> impl std::future::Future<Output = anyhow::Result<super::datapath::RoomRun>>;
    /// One `Info` round trip on the decode (`decode` true) or the prefill engine's connection.
    fn info(&self, decode: bool) -> impl std::future::Future<Output = anyhow::Result<()>>;
    /// One `ExpectBatch` (decode) and one `SendBatch` (prefill) issued together: calls refused.
    fn batches(
        &self,
        expects: Vec<proto::ExpectRequest>,
        sends: Vec<proto::SendRequest>,
    ) -> impl std::future::Future<Output = anyhow::Result<u64>>;
    /// Room events of (prefill, decode).
    fn events(&self) -> (&EventRouter, &EventRouter);
    /// Region ids of the (prefill, decode) pools.
    fn regions(&self) -> (u64, u64);
    /// CPU used so far by (both gateways, this process).
    fn cpu_used(&self) -> (Duration, Duration);
    fn switches(&self) -> SwitchCounts;
    /// Process ids of the two gateways.
    fn gateway_pids(&self) -> Vec<i32>;
}

impl EnginePath for Rig {
    async fn one_room(&self) -> anyhow::Result<super::datapath::RoomRun> {
        one_room(self).await
    }
    async fn info(&self, decode: bool) -> anyhow::Result<()> {
        let engine = if decode { &self.decode } else { &self.prefill };
        engine.client.info().await?;
        Ok(())
    }
    async fn batches(&self, expects: Vec<proto::ExpectRequest>, sends: Vec<proto::SendRequest>) -> anyhow::Result<u64> {
        let (e, s) = tokio::join!(self.decode.client.expect_batch(expects), self.prefill.client.send_batch(sends));
        Ok(e?.results.iter().chain(s?.results.iter()).filter(|r| !r.reason.is_empty()).count() as u64)
    }
    fn events(&self) -> (&EventRouter, &EventRouter) {
        (&self.prefill.events, &self.decode.events)
    }
    fn regions(&self) -> (u64, u64) {
        (self.prefill.region, self.decode.region)
    }
    fn cpu_used(&self) -> (Duration, Duration) {
        Rig::cpu_used(self)
    }
    fn switches(&self) -> SwitchCounts {
        self.context_switches()
    }
    fn gateway_pids(&self) -> Vec<i32> {
        [self.pair.prefill.pid(), self.pair.decode.pid()].into_iter().flatten().collect()
    }
}

/// The per-room cost on any engine path.
pub async fn measure_on(rig: &impl EnginePath, rooms: u64) -> anyhow::Result<RoomCost> {
    for _ in 0..ROOM_COST_WARMUP_ROOMS {
        rig.one_room().await?;
    }
    let half = rooms / 2;
    let mut calls = round_trips(rig, half).await?;
    let gateway_calls = super::syscalls::SyscallCount::start(&rig.gateway_pids());
    let engine_calls = super::syscalls::SyscallCount::start(&[std::process::id() as i32]);
    tokio::time::sleep(Duration::from_millis(super::syscalls::PERF_ATTACH_MS)).await;
    let cpu_before = rig.cpu_used();
    let switches_before = rig.switches();
    let started = Instant::now();
    let mut latencies = Vec::with_capacity(rooms as usize);
    let mut failures = 0u64;
    let mut reasons = Vec::new();
    for _ in 0..rooms {
        let run = rig.one_room().await?;
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
    let (gateway_switches, engine_switches) = rig.switches().per_room_since(&switches_before, rooms);
    let per_room_calls = |count: Option<super::syscalls::SyscallCount>| {
        count.and_then(|c| c.stop()).map(|n| n as f64 / rooms.max(1) as f64)
    };
    let (gateway_syscalls, engine_syscalls) = (per_room_calls(gateway_calls), per_room_calls(engine_calls));
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
        gateway_switches_per_room: gateway_switches,
        engine_switches_per_room: engine_switches,
        gateway_syscalls_per_room: gateway_syscalls,
        engine_syscalls_per_room: engine_syscalls,
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
async fn round_trips(rig: &impl EnginePath, count: u64) -> anyhow::Result<RoundTrips> {
    let before = rig.cpu_used();
    let mut latencies = Vec::with_capacity(count as usize);
    for i in 0..count {
        let started = Instant::now();
        rig.info(i % 2 == 0).await?;
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
pub async fn batched_rooms_per_second(
    rig: &impl EnginePath,
    rooms: u64,
) -> anyhow::Result<super::results::BatchedRooms> {
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
async fn one_batch(rig: &impl EnginePath, slot_base: u64, count: u64) -> anyhow::Result<(u64, Vec<Duration>)> {
    use super::control::MINIMAL_ROOM_BYTES;
    use kvgate_client::room_key;
    use kvgate_demo::gateways::{DECODE_NAME, PREFILL_NAME};
    let (prefill_events, decode_events) = rig.events();
    let (prefill_region, decode_region) = rig.regions();
    let rooms: Vec<u64> = (0..count).map(|_| fresh_room()).collect();
    let mut listeners: Vec<_> = rooms.iter().map(|r| (prefill_events.listen(*r), decode_events.listen(*r))).collect();
    let offset = |i: u64| ((slot_base + i) * MINIMAL_ROOM_BYTES) % super::control::CONTROL_POOL_BYTES;
    let expects = rooms
        .iter()
        .enumerate()
        .map(|(i, r)| proto::ExpectRequest {
            key: Some(room_key(*r, 0)),
            peer: PREFILL_NAME.to_string(),
            parts: vec![proto::PartSlices {
                slices: vec![slice(decode_region, offset(i as u64), MINIMAL_ROOM_BYTES)],
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
            slices: vec![slice(prefill_region, offset(i as u64), MINIMAL_ROOM_BYTES)],
            last: true,
            peer: DECODE_NAME.to_string(),
            ..Default::default()
        })
        .collect();
    let started = Instant::now();
    let refused = rig.batches(expects, sends).await?;
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
        prefill_events.forget(*r);
        decode_events.forget(*r);
    }
    let failed = failed.max(refused);
    Ok((failed, vec![latency; (count - failed) as usize]))
}
