//! Abort-to-terminal latency with 100 000 rooms in flight, measured in kvgate-core in this process
//! (the core's own cost; control.rs measures the same through the engine API). Half the rooms are receivers
//! waiting for their sender, half senders holding a chunk; each timed abort is replaced by a fresh
//! room so the count stays constant. Drives the core like the driver does; never fakes an outcome.

use super::results::AbortLatency;
use super::stats::{micros, percentile};
use kvgate_core::{
    At, Command, Core, CoreConfig, EngineRequest, PeerId, PluginSlot, RegionId, RegionInfo, RoomEvent, RoomKey, Slice,
};
use std::time::{Duration, Instant};

const PEER: PeerId = PeerId(1);
const SLOT: PluginSlot = PluginSlot(0);
const REGION: RegionId = RegionId(1);
/// Bytes each held room names (receiver destination or sender chunk).
const ROOM_BYTES: u64 = 4096;
const REGION_BYTES: u64 = 1 << 30;

/// The core, its clock origin and the next room id.
struct Bench {
    core: Core,
    origin: Instant,
    next_room: u64,
}

impl Bench {
    fn now(&self) -> At {
        At(self.origin.elapsed().as_nanos() as u64)
    }

    /// A fresh live room: even ids are receivers (expect), odd ids senders (one held last chunk).
    fn add_room(&mut self) -> Result<RoomKey, String> {
        let id = self.next_room;
        self.next_room += 1;
        let key = RoomKey::new(id, 0);
        let offset = (id * ROOM_BYTES) % REGION_BYTES;
        let slices = vec![Slice::new(REGION, offset, ROOM_BYTES)];
        let request = if id.is_multiple_of(2) {
            EngineRequest::Expect { room: key, peer: PEER, parts: vec![slices], timeout_ms: None }
        } else {
            EngineRequest::Send { room: key, peer: Some(PEER), part: 0, chunk: 0, slices, last: true }
        };
        let now = self.now();
        self.core.handle_engine(now, request).map_err(|r| format!("room {id} refused: {}", r.reason.as_str()))?;
        while self.core.poll_command().is_some() {}
        Ok(key)
    }
}

/// The config: the defaults, with room limits opened to `rooms_in_flight` and deadlines long enough
/// that no room times out while the measurement runs.
pub fn bench_core_config(rooms_in_flight: u64) -> CoreConfig {
    CoreConfig {
        max_inflight_rooms: rooms_in_flight.max(CoreConfig::default().max_inflight_rooms),
        max_pending_sends: rooms_in_flight.max(CoreConfig::default().max_pending_sends),
        bootstrap_timeout_ms: 600_000,
        room_timeout_ms: 600_000,
        ..CoreConfig::default()
    }
}

/// Hold `rooms_in_flight` rooms, then time `aborts` aborts (spread over the rooms): from the abort
/// entering the core to its `Terminal` event leaving it, including every command emitted before it.
pub fn abort_to_terminal_in_core(rooms_in_flight: u64, aborts: u64) -> Result<AbortLatency, String> {
    let core = Core::new(bench_core_config(rooms_in_flight)).map_err(|e| e.to_string())?;
    let mut bench = Bench { core, origin: Instant::now(), next_room: 1 };
    let now = bench.now();
    bench.core.handle_peer_up(now, PEER, 1, SLOT);
    bench.core.handle_region_registered(
        now,
        RegionInfo {
            id: REGION,
            len: REGION_BYTES,
            memory_kind: kvgate_abi::MemoryKind::HOST,
            keys: vec![(SLOT, kvgate_abi::LocalKey(1))],
        },
    );
    let mut live: Vec<RoomKey> = Vec::with_capacity(rooms_in_flight as usize);
    for _ in 0..rooms_in_flight {
        live.push(bench.add_room()?);
    }
    if bench.core.live_rooms() != rooms_in_flight {
        return Err(format!("{} rooms live, {rooms_in_flight} wanted", bench.core.live_rooms()));
    }
    let step = (rooms_in_flight / aborts.max(1)).max(1) as usize;
    let mut samples: Vec<Duration> = Vec::with_capacity(aborts as usize);
    let mut missing = 0;
    for k in 0..aborts as usize {
        let index = (k * step + k / live.len().max(1)) % live.len();
        let key = live[index];
        let t0 = Instant::now();
        bench
            .core
            .handle_engine(At(bench.origin.elapsed().as_nanos() as u64), EngineRequest::Abort { room: key, role: None })
            .map_err(|r| r.to_string())?;
        let mut terminal = false;
        while let Some(command) = bench.core.poll_command() {
            if matches!(command, Command::ToEngine(RoomEvent::Terminal { room, .. }) if room == key) {
                terminal = true;
                break;
            }
        }
        let elapsed = t0.elapsed();
        while bench.core.poll_command().is_some() {}
        if terminal {
            samples.push(elapsed);
        } else {
            missing += 1;
        }
        live[index] = bench.add_room()?;
    }
    Ok(AbortLatency {
        path: "kvgate-core in process (abort in, Terminal out; no engine API or peer link)".into(),
        rooms_in_flight: bench.core.live_rooms(),
        aborts: samples.len() as u64,
        p50_us: micros(percentile(&samples, 50.0)),
        p99_us: micros(percentile(&samples, 99.0)),
        max_us: micros(percentile(&samples, 100.0)),
        missing_terminal: missing,
        pooled_p99_us: micros(percentile(&samples, 99.0)),
        pooled_max_us: micros(percentile(&samples, 100.0)),
        round_p99_us: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_timed_abort_ends_its_room_and_the_count_stays_constant() {
        let result = abort_to_terminal_in_core(1_000, 50).expect("runs");
        assert_eq!(result.aborts, 50);
        assert_eq!(result.missing_terminal, 0);
        assert_eq!(result.rooms_in_flight, 1_000);
        assert!(result.p50_us > 0.0 && result.p99_us >= result.p50_us);
    }
}
