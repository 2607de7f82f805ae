//! The bench's results as plain serialisable data: the `--json` document, read back by the table,
//! the markdown page and the plots. Holds figures only; never measures and never formats.

use serde::{Deserialize, Serialize};

/// The whole `--json` document.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct BenchReport {
    /// The command line that produced it (program name normalised to `kvgate`).
    pub command: String,
    pub kvgate_version: String,
    pub machine: Machine,
    /// UTC, `YYYY-MM-DD HH:MM:SS`.
    pub finished_utc: String,
    pub wall_seconds: f64,
    /// One entry per requested plugin, measured or skipped with its reason.
    pub data_path: Vec<PluginResult>,
    pub control_path: ControlPath,
    pub targets: Vec<TargetCheck>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Machine {
    pub cpus: usize,
    pub memory_gib: f64,
    /// Always `none` today: the bench has no GPU path here.
    pub gpu: String,
    pub kernel: String,
    /// `model name` from `/proc/cpuinfo` (empty when unreadable).
    #[serde(default)]
    pub cpu_model: String,
    /// The largest CPU cache of CPU 0 (its last level), in KiB; 0 when sysfs does not say. Blocks that
    /// fit it are read from cache by a reference that sends every message from one buffer.
    #[serde(default)]
    pub last_level_cache_kib: u64,
    /// `cpu family` and `model` from `/proc/cpuinfo`, then which of the instruction-set extensions
    /// the figures depend on the CPU has (`AES-NI`, `VAES`, `AVX2`, `AVX-512`): QUIC's packet
    /// protection runs about twice as fast with AVX-512. Empty when unreadable.
    #[serde(default)]
    pub cpu_features: String,
    /// `/proc/loadavg` (1, 5, 15 minutes) when the run started and when it ended: other work on the
    /// machine while it measured.
    pub load_average_start: String,
    pub load_average_end: String,
}

/// One plugin's data-path matrix.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PluginResult {
    pub plugin: String,
    /// What the reference is (`memcpy, 1 thread, same pool files`, ...).
    pub reference: String,
    /// `measured` or `skipped`.
    pub status: String,
    /// Why it was skipped (or why its reference was); empty when everything ran.
    pub skip_reason: String,
    pub cells: Vec<CellResult>,
}

/// One (block size, blocks per transfer) cell of one plugin.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct CellResult {
    pub block_bytes: u64,
    pub blocks: u64,
    pub transfer_bytes: u64,
    /// Rooms kept in flight at once (each on its own pool slot): `--inflight`, or fewer when fewer
    /// transfers of this size fit the pools.
    pub rooms_in_flight: u64,
    /// Rooms that moved the bytes through the two gateways (timed ones, warm-up excluded).
    pub transfers: u64,
    /// Untimed rooms before the timed ones: the verified room, then one on every other slot the cell
    /// uses, so the timed rooms find every slot already moved once (`rooms_in_flight` in all).
    #[serde(default)]
    pub warm_up_rooms: u64,
    /// Rooms that did not succeed on both sides, or whose bytes did not match.
    pub failures: u64,
    /// The distinct reasons of those failures (reason codes from the gateways, or the bench's own
    /// error), at most `MAX_FAILURE_REASONS_PER_CELL`.
    pub failure_reasons: Vec<String>,
    /// The warm-up room's destination bytes equal the source bytes, and so does every destination
    /// slot the timed rooms wrote (compared after the timed window, each slot having been
    /// overwritten with the complement of its source before it): false fails the cell.
    pub verified: bool,
    /// Destination slots the timed rooms wrote and the bench compared with their source after them.
    #[serde(default)]
    pub verified_slots: u64,
    pub throughput_gbps: f64,
    pub latency_p50_ms: f64,
    pub latency_p99_ms: f64,
    pub reference_gbps: f64,
    pub reference_latency_p50_ms: f64,
    pub reference_latency_p99_ms: f64,
    /// `throughput_gbps / reference_gbps` (0 when there is no reference).
    pub ratio: f64,
    /// Why the reference of this cell has no figure (empty when it ran).
    pub reference_error: String,
    /// Wall seconds of the timed rooms.
    pub wall_seconds: f64,
    /// CPU seconds (user + system) both gateway processes used meanwhile (plugin copy threads included).
    pub gateway_cpu_seconds: f64,
    /// CPU seconds the bench process (both engines' engine-API clients) used meanwhile.
    pub engine_cpu_seconds: f64,
    /// For a target cell run in rounds (`--target-rounds`): every round's ratio, in the order they
    /// ran; the figures above are the median round's. Empty for a cell run once.
    #[serde(default)]
    pub round_ratios: Vec<f64>,
    /// Every round's kvgate and reference throughput (GB/s), in the same order: a reference that
    /// moves a lot between rounds makes the ratio an unsteady reading (`rounds::rounds_note`).
    #[serde(default)]
    pub round_throughput_gbps: Vec<f64>,
    #[serde(default)]
    pub round_reference_gbps: Vec<f64>,
    /// The machine's copy limit measured around this cell (shm only; `bench::copy_limit`).
    #[serde(default)]
    pub copy_limit: Option<CopyLimit>,
    /// `throughput_gbps / copy_limit.gbps` (0 without a limit): shm's target ratio.
    #[serde(default)]
    pub limit_ratio: f64,
    /// Every round's ratio to the copy limit and the limit itself (GB/s), in the order they ran.
    #[serde(default)]
    pub round_limit_ratios: Vec<f64>,
    #[serde(default)]
    pub round_limit_gbps: Vec<f64>,
}

/// The machine's copy limit around one cell: the best of memcpy and streaming-store copies on as
/// many threads as the plugin copies with, over a working set larger than the last-level cache,
/// half just before the cell's rooms and half just after.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct CopyLimit {
    pub threads: u64,
    /// Source and destination buffers together.
    pub working_set_bytes: u64,
    pub memcpy_gbps: f64,
    pub streaming_gbps: f64,
    /// The faster of the two: the limit.
    pub gbps: f64,
}

impl CellResult {
    /// Whether the cell failed: a room that did not succeed, or bytes that did not match.
    pub fn failed(&self) -> bool {
        self.failures > 0 || !self.verified
    }
}

/// One way of moving SGLang-shaped rooms: its calls, time and CPU per room.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct SglangMode {
    /// Engine-API calls one room took (the expect included).
    pub calls_per_room: u64,
    /// Rooms that succeeded, and those that did not (with the first reason).
    pub rooms: u64,
    pub failures: u64,
    pub first_error: Option<String>,
    pub latency_p50_ms: f64,
    pub latency_p99_ms: f64,
    pub gateway_cpu_us_per_room: f64,
    pub engine_cpu_us_per_room: f64,
}

/// The SGLang-shaped room figure (`bench::sglang_room`).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct SglangRoom {
    pub layers: u64,
    pub parts: u64,
    pub chunks: u64,
    pub pages_per_chunk: u64,
    pub page_bytes: u64,
    /// One `Send` per part per chunk (engine API v1).
    pub per_part: SglangMode,
    /// One `SendBatch` per chunk (engine API v2).
    pub batched: SglangMode,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ControlPath {
    pub rooms_per_second: Option<RoomsPerSecond>,
    /// kvgate-core in this process: the core's own cost, without the engine API or the peer link.
    pub abort_to_terminal_core: Option<AbortLatency>,
    /// Through two gateways and the engine API, with fewer rooms in flight.
    pub abort_to_terminal_engine_api: Option<AbortLatency>,
    pub frozen_peer: Option<FrozenPeer>,
    /// An SGLang-shaped room (122 parts, 4 chunks), with one call per part per chunk and batched.
    #[serde(default)]
    pub sglang_room: Option<SglangRoom>,
    /// One 4 KiB room at a time: its latency and CPU against an engine-API round trip.
    #[serde(default)]
    pub room_cost: Option<RoomCost>,
    /// Minimal rooms through `ExpectBatch` / `SendBatch`.
    #[serde(default)]
    pub batched_rooms: Option<BatchedRooms>,
    /// The same two figures over the engine fast lane (`<socket>.lane`), each on a fresh pair.
    #[serde(default)]
    pub lane_room_cost: Option<RoomCost>,
    #[serde(default)]
    pub lane_batched_rooms: Option<BatchedRooms>,
    /// Control-path parts that could not run, with why.
    pub errors: Vec<String>,
}

/// The cost of one small room through two gateways, rooms one after the other, beside the cheapest
/// engine-API call (`Info`) over the same sockets in the same run.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RoomCost {
    pub rooms: u64,
    pub bytes_per_room: u64,
    pub failures: u64,
    pub failure_reasons: Vec<String>,
    pub latency_p50_ms: f64,
    pub latency_p99_ms: f64,
    /// Wall time of the timed rooms over their count, in microseconds.
    pub wall_us_per_room: f64,
    /// CPU (user + system) of both gateway processes per room, in microseconds.
    pub gateway_cpu_us_per_room: f64,
    /// The same for the bench process (both engines' clients and their event routers).
    pub engine_cpu_us_per_room: f64,
    /// The reference: p50 of one `Info` round trip on an engine's socket.
    pub call_p50_ms: f64,
    /// CPU of one `Info` round trip (gateways + bench process), in microseconds.
    pub call_cpu_us: f64,
    /// Context switches per room of both gateways' threads, and of the bench process (`/proc`).
    #[serde(default)]
    pub gateway_switches_per_room: f64,
    #[serde(default)]
    pub engine_switches_per_room: f64,
    /// System calls per room of both gateways and of the bench process (`perf stat`; `None` without
    /// perf or its permission).
    #[serde(default)]
    pub gateway_syscalls_per_room: Option<f64>,
    #[serde(default)]
    pub engine_syscalls_per_room: Option<f64>,
}

/// Minimal rooms carried by batched engine calls: rooms per second and CPU per room.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct BatchedRooms {
    pub rooms: u64,
    /// Rooms per `ExpectBatch` (and per `SendBatch`).
    pub batch_rooms: u64,
    pub batches_in_flight: u64,
    pub failures: u64,
    pub first_error: Option<String>,
    pub rooms_per_second: f64,
    /// From a batch's two calls to the last terminal event of its rooms.
    pub batch_p50_ms: f64,
    pub gateway_cpu_us_per_room: f64,
    pub engine_cpu_us_per_room: f64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RoomsPerSecond {
    pub rooms: u64,
    /// Bytes each room moved (the engine API refuses a zero-length slice; this is the minimum).
    pub bytes_per_room: u64,
    pub concurrency: u64,
    pub failures: u64,
    pub rooms_per_second: f64,
    pub latency_p50_ms: f64,
    pub latency_p99_ms: f64,
    /// CPU (user + system) both gateway processes spent per room, in microseconds: the control
    /// path's cost, which bounds rooms per second on a machine with few cores.
    #[serde(default)]
    pub gateway_cpu_us_per_room: f64,
    /// The same for the bench process (both engines' engine-API clients).
    #[serde(default)]
    pub engine_cpu_us_per_room: f64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct AbortLatency {
    /// `kvgate-core in process` or `engine API, two gateways`.
    pub path: String,
    pub rooms_in_flight: u64,
    /// Aborts timed (in every round together).
    pub aborts: u64,
    /// p50, p99 and max of the round with the median p99 when the measurement ran in rounds, else of
    /// every sample.
    pub p50_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
    /// Aborted rooms whose terminal event never came within the wait bound, in every round.
    pub missing_terminal: u64,
    /// Each round's p99, in the order they ran (empty for a measurement in one round).
    #[serde(default)]
    pub round_p99_us: Vec<f64>,
    /// p99 and max of every sample of every round pooled (equal to `p99_us`/`max_us` in one round).
    #[serde(default)]
    pub pooled_p99_us: f64,
    #[serde(default)]
    pub pooled_max_us: f64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct FrozenPeer {
    pub rooms: u64,
    pub heartbeat_interval_ms: u64,
    pub heartbeat_misses: u64,
    /// `heartbeat_interval_ms * heartbeat_misses`: the configured detection bound.
    pub detection_bound_ms: u64,
    /// From SIGSTOP of the decode gateway to the first / median / last prefill room terminal.
    pub first_terminal_ms: f64,
    pub p50_terminal_ms: f64,
    pub all_terminal_ms: f64,
    /// Rooms that ended with `peer_lost` (the others' reasons are in `other_reasons`).
    pub peer_lost: u64,
    pub other_reasons: Vec<String>,
    /// Rooms with no terminal event within the wait bound.
    pub missing_terminal: u64,
}

/// One target from the plugin issues, checked against this run.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct TargetCheck {
    pub name: String,
    /// Which figure of this run it reads.
    pub figure: String,
    pub measured: Option<f64>,
    /// `>= 0.9` style comparison text.
    pub target: String,
    /// `met`, `missed`, or `not measured: <why>`.
    pub verdict: String,
}
