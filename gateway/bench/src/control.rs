//! Control-path figures through two gateways and the engine API: rooms per second with minimal
//! transfers, abort-to-terminal latency with many rooms in flight, and the time from a frozen
//! (SIGSTOP) decode gateway to every affected room terminal on the prefill side. Measures only.

use super::datapath::{fresh_room, move_room, Rig};
use super::results::{AbortLatency, FrozenPeer, RoomsPerSecond};
use super::rounds::median_abort_round;
use super::stats::{millis, percentile};
use anyhow::{bail, Context};
use futures_util::{stream, StreamExt};
use kvgate_client::{proto, room_key, slice};
use kvgate_demo::engine::wait_terminal;
use kvgate_demo::gateways::{PairSettings, DECODE_NAME, PREFILL_NAME};
use std::path::Path;
use std::time::{Duration, Instant};

/// The smallest transfer the engine API accepts (a zero-length slice is refused as `slice_out_of_range`).
pub const MINIMAL_ROOM_BYTES: u64 = 8;
/// Pool of the control-path rig: room i uses bytes `[8 i, 8 i + 8)` modulo this.
pub const CONTROL_POOL_BYTES: u64 = 1 << 20;
/// How long an aborted room's terminal event may take before it is counted missing.
pub const ABORT_TERMINAL_WAIT_MS: u64 = 10_000;
/// Extra wait, past the heartbeat bound, for a frozen peer's rooms before they are counted missing.
pub const FROZEN_PEER_EXTRA_WAIT_MS: u64 = 10_000;
/// Engine-API calls in flight at once while rooms are being put in flight.
pub const SETUP_CALLS_IN_FLIGHT: usize = 32;

/// Settings of the control-path pair: long bootstrap and room deadlines so held rooms stay live, and
/// a watch buffer large enough for every room's events.
pub fn control_settings() -> PairSettings {
    let env = vec![
        ("KVGATE__ENGINE_API__WATCH_BUFFER_EVENTS".to_string(), (1u64 << 20).to_string()),
        ("KVGATE__SCHEDULER__ROOM_TIMEOUT_MS".to_string(), "600000".to_string()),
    ];
    PairSettings {
        plugin: "shm".into(),
        bootstrap_timeout_ms: 600_000,
        env_prefill: env.clone(),
        env_decode: env,
        ..PairSettings::default()
    }
}

pub async fn start_control_rig(binary: &Path, dir: &Path, settings: &PairSettings) -> anyhow::Result<Rig> {
    Rig::start(binary, dir, settings, CONTROL_POOL_BYTES, 1).await
}

fn minimal_offset(i: u64) -> u64 {
    (i * MINIMAL_ROOM_BYTES) % CONTROL_POOL_BYTES
}

/// `rooms` minimal rooms, `concurrency` at once, each waited for on both sides.
pub async fn rooms_per_second(rig: &Rig, rooms: u64, concurrency: u64) -> anyhow::Result<RoomsPerSecond> {
    let cpu_before = rig.cpu_used();
    let started = Instant::now();
    let runs: Vec<_> = stream::iter(0..rooms)
        .map(|i| {
            let (p, d) = (rig.prefill.clone(), rig.decode.clone());
            async move {
                let offset = minimal_offset(i % concurrency);
                let src = vec![slice(p.region, offset, MINIMAL_ROOM_BYTES)];
                let dst = vec![slice(d.region, offset, MINIMAL_ROOM_BYTES)];
                move_room(&p, &d, fresh_room(), src, dst).await
            }
        })
        .buffer_unordered(concurrency as usize)
        .collect()
        .await;
    let wall = started.elapsed();
    let cpu_after = rig.cpu_used();
    let per_room_us =
        |after: Duration, before: Duration| after.saturating_sub(before).as_secs_f64() * 1e6 / rooms.max(1) as f64;
    let latencies: Vec<Duration> =
        runs.iter().filter_map(|r| r.as_ref().ok().filter(|r| r.succeeded).map(|r| r.latency)).collect();
    let failures = rooms - latencies.len() as u64;
    Ok(RoomsPerSecond {
        rooms,
        bytes_per_room: MINIMAL_ROOM_BYTES,
        concurrency,
        failures,
        rooms_per_second: latencies.len() as f64 / wall.as_secs_f64().max(1e-9),
        latency_p50_ms: millis(percentile(&latencies, 50.0)),
        latency_p99_ms: millis(percentile(&latencies, 99.0)),
        gateway_cpu_us_per_room: per_room_us(cpu_after.0, cpu_before.0),
        engine_cpu_us_per_room: per_room_us(cpu_after.1, cpu_before.1),
    })
}

/// Put `in_flight` rooms in flight on the decode gateway (expects with no sender), then abort
/// `aborts` of them one by one in each of `rounds` rounds (fewer rounds when fewer fit: every abort
/// takes a room of its own), timing abort call to the `Terminal` event on the watch stream. The
/// figure is the round with the median p99 (`rounds::median_abort_round`): a burst of other work on
/// the machine moves one round, not the figure; the pooled tail of every round is reported beside it.
pub async fn abort_to_terminal_api(
    rig: &Rig,
    in_flight: u64,
    aborts: u64,
    rounds: u64,
) -> anyhow::Result<AbortLatency> {
    let decode = rig.decode.clone();
    let rooms: Vec<u64> = (0..in_flight).map(|_| fresh_room()).collect();
    let refused: Vec<String> = stream::iter(rooms.iter().copied().enumerate())
        .map(|(i, room)| {
            let d = decode.clone();
            async move {
                let dst = vec![slice(d.region, minimal_offset(i as u64), MINIMAL_ROOM_BYTES)];
                d.client
                    .expect(room_key(room, 0), PREFILL_NAME, vec![dst], 0)
                    .await
                    .err()
                    .map(|s| kvgate_client::reason_of(&s).unwrap_or_else(|| s.message().to_string()))
            }
        })
        .buffer_unordered(SETUP_CALLS_IN_FLIGHT)
        .filter_map(|r| async move { r })
        .collect()
        .await;
    if !refused.is_empty() {
        bail!("{} of {in_flight} expects refused (first: {})", refused.len(), refused[0]);
    }
    let aborts = aborts.clamp(1, in_flight.max(1));
    let rounds = rounds.clamp(1, (in_flight / aborts).max(1));
    let step = (in_flight / (aborts * rounds)).max(1);
    let mut samples: Vec<Vec<Duration>> = Vec::new();
    let mut missing = 0;
    for r in 0..rounds {
        let mut round = Vec::with_capacity(aborts as usize);
        for k in 0..aborts {
            let room = rooms[((r * aborts + k) * step) as usize];
            let mut rx = decode.events.listen(room);
            let t0 = Instant::now();
            decode
                .client
                .abort(room_key(room, 0), "bench: abort-to-terminal")
                .await
                .map_err(|s| anyhow::anyhow!("abort refused: {}", s.message()))?;
            match wait_terminal(&mut rx, t0, Duration::from_millis(ABORT_TERMINAL_WAIT_MS)).await {
                Ok(o) => round.push(o.seen_after),
                Err(_) => missing += 1,
            }
            decode.events.forget(room);
        }
        samples.push(round);
    }
    Ok(median_abort_round(
        "engine API, two gateways (abort RPC to Terminal on the watch stream)",
        in_flight,
        &samples,
        missing,
    ))
}

/// `rooms` rooms mid-transfer (expect posted, first of two chunks sent), then SIGSTOP of the decode
/// gateway; time until every room is terminal on the prefill side. Thaws the gateway before returning.
pub async fn frozen_peer(rig: &Rig, settings: &PairSettings, rooms: u64) -> anyhow::Result<FrozenPeer> {
    let (prefill, decode) = (rig.prefill.clone(), rig.decode.clone());
    let mut listeners = Vec::new();
    for i in 0..rooms {
        let room = fresh_room();
        let offset = (i * 2 * MINIMAL_ROOM_BYTES) % CONTROL_POOL_BYTES;
        let rx = prefill.events.listen(room);
        let dst = vec![slice(decode.region, offset, 2 * MINIMAL_ROOM_BYTES)];
        decode
            .client
            .expect(room_key(room, 0), PREFILL_NAME, vec![dst], 0)
            .await
            .map_err(|s| anyhow::anyhow!("expect refused: {}", s.message()))?;
        let first_chunk = proto::SendRequest {
            offset: None,
            key: Some(room_key(room, 0)),
            part: 0,
            chunk: 0,
            slices: vec![slice(prefill.region, offset, MINIMAL_ROOM_BYTES)],
            last: false,
            peer: DECODE_NAME.to_string(),
        };
        prefill.client.send(first_chunk).await.map_err(|s| anyhow::anyhow!("send refused: {}", s.message()))?;
        listeners.push((room, rx));
    }
    // Let the first chunks land so every room is mid-transfer, not bootstrapping.
    tokio::time::sleep(Duration::from_millis(100)).await;
    rig.pair.decode.freeze().context("SIGSTOP the decode gateway")?;
    let frozen_at = Instant::now();
    let bound_ms = settings.heartbeat_interval_ms * settings.heartbeat_misses;
    let wait = Duration::from_millis(bound_ms + FROZEN_PEER_EXTRA_WAIT_MS);
    let outcomes =
        futures_util::future::join_all(listeners.iter_mut().map(|(_, rx)| wait_terminal(rx, frozen_at, wait))).await;
    rig.pair.decode.thaw().context("SIGCONT the decode gateway")?;
    for (room, _) in &listeners {
        prefill.events.forget(*room);
    }
    let mut seen = Vec::new();
    let (mut peer_lost, mut missing, mut other) = (0, 0, std::collections::BTreeSet::new());
    for o in outcomes {
        match o {
            Ok(o) => {
                seen.push(o.seen_after);
                if !o.succeeded && o.reason == "peer_lost" {
                    peer_lost += 1;
                } else {
                    other.insert(if o.succeeded { "succeeded".to_string() } else { o.reason });
                }
            }
            Err(_) => missing += 1,
        }
    }
    Ok(FrozenPeer {
        rooms,
        heartbeat_interval_ms: settings.heartbeat_interval_ms,
        heartbeat_misses: settings.heartbeat_misses,
        detection_bound_ms: bound_ms,
        first_terminal_ms: millis(seen.iter().min().copied().unwrap_or_default()),
        p50_terminal_ms: millis(percentile(&seen, 50.0)),
        all_terminal_ms: millis(percentile(&seen, 100.0)),
        peer_lost,
        other_reasons: other.into_iter().collect(),
        missing_terminal: missing,
    })
}
