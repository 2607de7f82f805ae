//! A workload of rooms between the bed's two gateways: `rooms` KV caches of `room_bytes` each, at most
//! `inflight` at once (one slot each), moved through the engine API like a real prefill and decode
//! engine would, every outcome recorded with when it arrived. It reports what the gateways said and
//! whether the bytes landed; judging is the caller's.

use kvgate_demo::engine::{expect_into, send_all, wait_reusable, wait_terminal, Engine, SideOutcome};
use kvgate_demo::gateways::{DECODE_NAME, PREFILL_NAME};
use kvgate_demo::pool::{checksum, KvPool, KvShape};
use std::path::Path;
use std::time::{Duration, Instant};

/// KV bytes per token of `KvShape::llama_8b_like` (room sizes are whole tokens).
pub const TOKEN_BYTES: u64 = 128 << 10;
/// How long a room may go without a terminal event on a side before the workload calls it lost.
pub const ROOM_WAIT_MS: u64 = 60_000;

#[derive(Clone, Copy, Debug)]
pub struct Workload {
    pub room_bytes: u64,
    pub rooms: u64,
    pub inflight: u64,
    /// Clear the destination before and check it after every room (`false`: the fill and the check
    /// happen once per slot, outside the timed part, so the figure is the gateways' alone).
    pub verify_each_room: bool,
}

impl Workload {
    pub fn shape(&self) -> KvShape {
        let tokens = (self.room_bytes / TOKEN_BYTES).max(2);
        KvShape::llama_8b_like(tokens, tokens.min(4))
    }
}

/// One room, as both sides reported it.
#[derive(Clone, Debug)]
pub struct RoomRecord {
    pub room: u64,
    /// When the room started, since the workload started.
    pub started: Duration,
    /// When each side's terminal event arrived, since the workload started (`None`: none within
    /// `ROOM_WAIT_MS`, or the engine API refused the room).
    pub prefill: Option<(SideOutcome, Duration)>,
    pub decode: Option<(SideOutcome, Duration)>,
    /// Refusals or a lost event stream, in words.
    pub error: Option<String>,
    /// The destination held the source's bytes (checked only when both sides succeeded, and only
    /// with `verify_each_room`).
    pub verified: Option<bool>,
}

impl RoomRecord {
    pub fn succeeded(&self) -> bool {
        self.error.is_none()
            && self.prefill.as_ref().is_some_and(|p| p.0.succeeded)
            && self.decode.as_ref().is_some_and(|d| d.0.succeeded)
    }
    /// Both sides' terminal events arrived.
    pub fn terminal(&self) -> bool {
        self.prefill.is_some() && self.decode.is_some()
    }
    /// The later terminal event, since the workload started.
    pub fn ended(&self) -> Option<Duration> {
        Some(self.prefill.as_ref()?.1.max(self.decode.as_ref()?.1))
    }
}

#[derive(Clone, Debug)]
pub struct WorkloadResult {
    pub rooms: Vec<RoomRecord>,
    pub elapsed: Duration,
    /// Every slot's destination held the source's bytes at the end (`None` with `verify_each_room`,
    /// where each room says so itself; `Some(false)` also when no room into a slot succeeded).
    pub slots_verified: Option<bool>,
    pub bytes_per_room: u64,
}

impl WorkloadResult {
    pub fn succeeded(&self) -> usize {
        self.rooms.iter().filter(|r| r.succeeded()).count()
    }
    pub fn failed(&self) -> Vec<&RoomRecord> {
        self.rooms.iter().filter(|r| !r.succeeded()).collect()
    }
    /// Bytes of succeeded rooms per second of the whole workload.
    pub fn bytes_per_s(&self) -> f64 {
        self.succeeded() as f64 * self.bytes_per_room as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
    /// Every room succeeded and every check of the bytes passed.
    pub fn all_good(&self) -> bool {
        self.rooms.iter().all(|r| r.succeeded() && r.verified != Some(false)) && self.slots_verified != Some(false)
    }
    /// One line per room that did not succeed, for failure messages and reports.
    pub fn describe_failures(&self) -> String {
        let side = |s: &Option<(SideOutcome, Duration)>| match s {
            Some((o, at)) if o.succeeded => format!("ok at {:.2}s", at.as_secs_f64()),
            Some((o, at)) => format!("{} ({}) at {:.2}s", o.reason, o.phase, at.as_secs_f64()),
            None => "no terminal event".to_string(),
        };
        self.rooms
            .iter()
            .filter(|r| !r.succeeded() || r.verified == Some(false))
            .map(|r| {
                format!(
                    "room {} started {:.2}s: prefill {}, decode {}{}{}\n",
                    r.room,
                    r.started.as_secs_f64(),
                    side(&r.prefill),
                    side(&r.decode),
                    r.error.as_ref().map(|e| format!(", {e}")).unwrap_or_default(),
                    if r.verified == Some(false) { ", WRONG BYTES" } else { "" }
                )
            })
            .collect()
    }
}

/// Two engines connected to the bed's gateways, each with a pool of `slots` rooms.
pub struct Engines {
    pub prefill: Engine,
    pub decode: Engine,
    pub shape: KvShape,
    pub slots: u64,
    /// The checksum of each source slot (filled once).
    sources: Vec<u64>,
}

impl Engines {
    pub async fn connect(
        dir: &Path,
        prefill_socket: &Path,
        decode_socket: &Path,
        w: &Workload,
    ) -> anyhow::Result<Engines> {
        let shape = w.shape();
        let slots = w.inflight.max(1);
        let tag = crate::datapath::fresh_room();
        let p_pool = KvPool::create(dir, &format!("bed-prefill-{tag}"), shape.request_bytes(), slots)?;
        let d_pool = KvPool::create(dir, &format!("bed-decode-{tag}"), shape.request_bytes(), slots)?;
        let prefill = Engine::connect(prefill_socket, p_pool, "bed-prefill").await?;
        let decode = Engine::connect(decode_socket, d_pool, "bed-decode").await?;
        let pool = prefill.pool.clone();
        let sources = tokio::task::spawn_blocking(move || {
            let mut p = pool.lock().unwrap_or_else(|e| e.into_inner());
            (0..slots).map(|s| p.fill(s, 1000 + s)).collect::<Vec<u64>>()
        })
        .await?;
        Ok(Engines { prefill, decode, shape, slots, sources })
    }

    async fn clear(&self, slot: u64) -> anyhow::Result<()> {
        let pool = self.decode.pool.clone();
        tokio::task::spawn_blocking(move || pool.lock().unwrap_or_else(|e| e.into_inner()).clear(slot)).await?;
        Ok(())
    }

    async fn destination_matches(&self, slot: u64) -> anyhow::Result<bool> {
        let pool = self.decode.pool.clone();
        let sum =
            tokio::task::spawn_blocking(move || checksum(pool.lock().unwrap_or_else(|e| e.into_inner()).slot(slot)))
                .await?;
        Ok(sum == self.sources[slot as usize])
    }

    /// Run `w` (its shape must be this pair's; `w.inflight` at most `slots`).
    pub async fn run(&self, w: &Workload) -> anyhow::Result<WorkloadResult> {
        let inflight = w.inflight.clamp(1, self.slots);
        if !w.verify_each_room {
            for slot in 0..inflight {
                self.clear(slot).await?;
            }
        }
        let started = Instant::now();
        let workers = (0..inflight).map(|slot| async move {
            let mut records = Vec::new();
            let mut i = slot;
            while i < w.rooms {
                records.push(self.one_room(slot, started, w.verify_each_room).await?);
                i += inflight;
            }
            anyhow::Ok(records)
        });
        let mut rooms = Vec::new();
        for r in futures_util::future::join_all(workers).await {
            rooms.extend(r?);
        }
        let elapsed = started.elapsed();
        rooms.sort_by_key(|r| r.started);
        let slots_verified = if w.verify_each_room {
            None
        } else {
            let mut all = true;
            for slot in 0..inflight {
                all &= self.destination_matches(slot).await?;
            }
            Some(all)
        };
        Ok(WorkloadResult { rooms, elapsed, slots_verified, bytes_per_room: self.shape.request_bytes() })
    }

    async fn one_room(&self, slot: u64, t0: Instant, verify: bool) -> anyhow::Result<RoomRecord> {
        if verify {
            self.clear(slot).await?;
        }
        let room = crate::datapath::fresh_room();
        let mut p_rx = self.prefill.events.listen(room);
        let mut d_rx = self.decode.events.listen(room);
        let begun = Instant::now();
        let mut record =
            RoomRecord { room, started: t0.elapsed(), prefill: None, decode: None, error: None, verified: None };
        let (expect, send) = tokio::join!(
            expect_into(&self.decode, &self.shape, room, slot, PREFILL_NAME, 0),
            send_all(&self.prefill, &self.shape, room, slot, DECODE_NAME, None)
        );
        let refused: Vec<String> = [("expect", expect), ("send", send)]
            .into_iter()
            .filter_map(|(what, r)| r.err().map(|s| format!("{what} refused: {}", s.message())))
            .collect();
        if !refused.is_empty() {
            record.error = Some(refused.join("; "));
        }
        // A refused side sends no event: the other side's (if it took the room) ends by its deadline.
        let timeout = Duration::from_millis(if record.error.is_some() { ROOM_WAIT_MS / 6 } else { ROOM_WAIT_MS });
        let (p, d) = tokio::join!(wait_terminal(&mut p_rx, begun, timeout), wait_terminal(&mut d_rx, begun, timeout));
        let offset = record.started;
        let mut lost = Vec::new();
        for (side, r, slot_) in [("prefill", p, &mut record.prefill), ("decode", d, &mut record.decode)] {
            match r {
                Ok(o) => {
                    let at = offset + o.seen_after;
                    *slot_ = Some((o, at));
                }
                Err(e) => lost.push(format!("{side}: {e:#}")),
            }
        }
        if !lost.is_empty() {
            let before = record.error.take().map(|e| format!("{e}; ")).unwrap_or_default();
            record.error = Some(format!("{before}{}", lost.join("; ")));
        }
        if verify && record.succeeded() {
            record.verified = Some(self.destination_matches(slot).await?);
        }
        let reuse = Duration::from_millis(crate::datapath::BENCH_REUSABLE_WAIT_MS);
        let _ = tokio::join!(wait_reusable(&mut p_rx, reuse), wait_reusable(&mut d_rx, reuse));
        self.prefill.events.forget(room);
        self.decode.events.forget(room);
        Ok(record)
    }
}
