//! The per-room cost over the engine fast lane (`<engine socket>.lane`): the same pair of gateways
//! as the gRPC figure (a fresh one), engines that speak only the lane (`LaneClient`: session, pool
//! registration, watch, calls), and the same measures (`room_cost::EnginePath`). Measures only.

use super::control::{control_settings, CONTROL_POOL_BYTES};
use super::datapath::{fresh_room, RoomRun, SwitchCounts, BENCH_REUSABLE_WAIT_MS, BENCH_ROOM_WAIT_MS};
use super::results::{BatchedRooms, RoomCost};
use super::room_cost::{EnginePath, ROOM_COST_BYTES};
use anyhow::Context;
use kvgate_client::{lane::lane_socket_path, proto, room_key, slice, LaneClient};
use kvgate_demo::engine::{wait_reusable, wait_terminal, EventRouter};
use kvgate_demo::gateways::{GatewayPair, DECODE_NAME, PREFILL_NAME};
use kvgate_demo::pool::KvPool;
use std::path::Path;
use std::time::{Duration, Instant};

/// One engine on the lane: its client (in its session), its pool's region, its room events.
pub struct LaneEngine {
    pub client: LaneClient,
    pub region: u64,
    pub events: EventRouter,
    _pool: KvPool,
}

impl LaneEngine {
    /// Open a session on `engine_socket`'s lane, register `pool` in it and watch its rooms' outcomes.
    pub async fn connect(engine_socket: &Path, pool: KvPool, label: &str) -> anyhow::Result<LaneEngine> {
        let lane = lane_socket_path(engine_socket);
        let client = LaneClient::connect(&lane).await.with_context(|| format!("connect {}", lane.display()))?;
        let name = format!("bench-lane-{}-{}", label.replace(' ', "-"), fresh_room());
        let session = client.open_session(&name).await.context("open a lane session")?.session;
        let client = client.in_session(session);
        let memory = proto::register_memory_request::Memory::SharedMemory(proto::SharedMemoryFile {
            path: pool.path.display().to_string(),
            offset: 0,
            len: pool.len(),
        });
        let region = client
            .register_memory(proto::RegisterMemoryRequest { memory: Some(memory), label: label.to_string() })
            .await
            .with_context(|| format!("register {label} over the lane"))?;
        let events = EventRouter::from_events(client.watch_outcomes(None).await.context("lane watch")?);
        Ok(LaneEngine { client, region, events, _pool: pool })
    }
}

/// A fresh control pair whose engines use only the lane.
pub struct LaneRig {
    pub pair: GatewayPair,
    pub prefill: LaneEngine,
    pub decode: LaneEngine,
}

impl LaneRig {
    pub async fn start(binary: &Path, dir: &Path) -> anyhow::Result<LaneRig> {
        let pair = GatewayPair::start(binary, dir, &control_settings()).await?;
        let tag = fresh_room();
        let src = KvPool::create(dir, &format!("bench-lane-src-{tag}"), CONTROL_POOL_BYTES, 1)?;
        let dst = KvPool::create(dir, &format!("bench-lane-dst-{tag}"), CONTROL_POOL_BYTES, 1)?;
        let prefill = LaneEngine::connect(&pair.prefill.socket, src, "bench lane source pool").await?;
        let decode = LaneEngine::connect(&pair.decode.socket, dst, "bench lane destination pool").await?;
        Ok(LaneRig { pair, prefill, decode })
    }

    pub fn stop(&mut self) {
        self.pair.stop();
    }
}

impl EnginePath for LaneRig {
    async fn one_room(&self) -> anyhow::Result<RoomRun> {
        let room = fresh_room();
        let (mut p_rx, mut d_rx) = (self.prefill.events.listen(room), self.decode.events.listen(room));
        let started = Instant::now();
        let send = proto::SendRequest {
            key: Some(room_key(room, 0)),
            slices: vec![slice(self.prefill.region, 0, ROOM_COST_BYTES)],
            last: true,
            peer: DECODE_NAME.to_string(),
            ..Default::default()
        };
        let expect = proto::ExpectRequest {
            key: Some(room_key(room, 0)),
            peer: PREFILL_NAME.to_string(),
            parts: vec![proto::PartSlices {
                slices: vec![slice(self.decode.region, 0, ROOM_COST_BYTES)],
                ..Default::default()
            }],
            ..Default::default()
        };
        let (e, s) = tokio::join!(self.decode.client.expect(expect), self.prefill.client.send(send));
        if let Err(why) = e.map_err(|e| format!("expect refused: {e}")).and(s.map_err(|e| format!("send refused: {e}")))
        {
            let _ = self.prefill.client.abort(room_key(room, 0), "bench: counterpart refused").await;
            let _ = self.decode.client.abort(room_key(room, 0), "bench: counterpart refused").await;
            self.prefill.events.forget(room);
            self.decode.events.forget(room);
            anyhow::bail!("room {room}: {why}");
        }
        let wait = Duration::from_millis(BENCH_ROOM_WAIT_MS);
        let (p, d) = tokio::join!(wait_terminal(&mut p_rx, started, wait), wait_terminal(&mut d_rx, started, wait));
        let latency = started.elapsed();
        let run = match (p, d) {
            (Ok(p), Ok(d)) => {
                let reason = if !d.reason.is_empty() { d.reason } else { p.reason };
                RoomRun { latency, succeeded: p.succeeded && d.succeeded, reason }
            }
            (Err(e), _) | (_, Err(e)) => {
                RoomRun { latency, succeeded: false, reason: format!("no terminal event: {e:#}") }
            }
        };
        let reuse = Duration::from_millis(BENCH_REUSABLE_WAIT_MS);
        let _ = tokio::join!(wait_reusable(&mut p_rx, reuse), wait_reusable(&mut d_rx, reuse));
        self.prefill.events.forget(room);
        self.decode.events.forget(room);
        Ok(run)
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
        let of = |pid: Option<i32>| pid.and_then(super::system::process_cpu).unwrap_or_default();
        (of(self.pair.prefill.pid()) + of(self.pair.decode.pid()), of(Some(std::process::id() as i32)))
    }

    fn switches(&self) -> SwitchCounts {
        SwitchCounts::of(self.pair.prefill.pid(), self.pair.decode.pid())
    }

    fn gateway_pids(&self) -> Vec<i32> {
        [self.pair.prefill.pid(), self.pair.decode.pid()].into_iter().flatten().collect()
    }
}

/// The per-room cost over the lane, on a fresh pair.
pub async fn measure(binary: &Path, dir: &Path, rooms: u64) -> anyhow::Result<RoomCost> {
    let mut rig = LaneRig::start(binary, dir).await?;
    let result = super::room_cost::measure_on(&rig, rooms).await;
    rig.stop();
    result
}

/// The batched figure over the lane, on a fresh pair.
pub async fn measure_batched(binary: &Path, dir: &Path, rooms: u64) -> anyhow::Result<BatchedRooms> {
    let mut rig = LaneRig::start(binary, dir).await?;
    let result = super::room_cost::batched_rooms_per_second(&rig, rooms).await;
    rig.stop();
    result
}
