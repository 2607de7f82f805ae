//! What one bench run measures: the data-path cells (block size x blocks per transfer, capped in
//! bytes per transfer) and the control-path sizes, for `--quick` and the full run, each limit named
//! with its unit and validated. Never measures anything.

use super::stats::size_label;

/// Most bytes one data-path transfer may move in the full run (pools hold `inflight` of them, twice).
pub const FULL_MAX_TRANSFER_BYTES: u64 = 512 << 20;
/// The same for `--quick`.
pub const QUICK_MAX_TRANSFER_BYTES: u64 = 128 << 20;
/// Upper bound accepted for `--max-transfer-mib` (two pools of this times `inflight` live in /dev/shm).
pub const MAX_MAX_TRANSFER_BYTES: u64 = 4 << 30;
/// Most rooms one cell may time, however fast it is (bounds memory for latency samples).
pub const MAX_ROOMS_PER_CELL: u64 = 2_000;
/// Longest budget a cell (or a target cell's round) may be given, in milliseconds.
pub const MAX_CELL_BUDGET_MS: u64 = 60_000;
/// Most rooms in flight through the engine API at once in a data-path cell.
pub const MAX_INFLIGHT_ROOMS: u64 = 16;
/// The pools hold this many of the plan's largest transfer; a cell with smaller transfers cuts them
/// into more slots (up to `inflight_rooms`), so the pools' size does not grow with `inflight_rooms`.
pub const POOL_LARGEST_TRANSFERS: u64 = 2;
/// Most rooms the in-process core abort measurement may hold in flight.
pub const MAX_CORE_ROOMS_IN_FLIGHT: u64 = 1_000_000;

/// The sizes of one run. `Plan::quick()` and `Plan::full()` are the defaults; flags override fields.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    pub block_sizes_bytes: Vec<u64>,
    pub blocks_per_transfer: Vec<u64>,
    pub max_transfer_bytes: u64,
    /// How long each cell keeps starting rooms (and its reference keeps copying), at least.
    pub cell_budget_ms: u64,
    /// How long each round of a target cell keeps starting rooms (and its reference keeps copying),
    /// at least: longer than a matrix cell, because a target is decided on it. At 250 ms a 64 MiB
    /// UCX TCP cell times about 12 rooms and its rounds spread 0.49-1.31 here; at 1 000 ms about
    /// 50 rooms, and 0.78-1.07.
    pub target_cell_budget_ms: u64,
    /// Rooms each cell times at least, however long they take.
    pub min_rooms_per_cell: u64,
    /// How many times each plugin's target cell runs (each round with its own reference); the
    /// median round is reported, so one burst of other work on the machine cannot decide a target.
    pub target_rounds: u64,
    /// Most rooms in flight at once in a data-path cell (each on its own pool slot; fewer when fewer
    /// transfers of the cell's size fit the pools, see [`POOL_LARGEST_TRANSFERS`]).
    pub inflight_rooms: u64,
    /// Rooms for the rooms-per-second figure, and how many run at once.
    pub control_rooms: u64,
    pub control_concurrency: u64,
    /// Rooms held in flight in the in-process core while aborts are timed, and how many aborts.
    pub core_rooms_in_flight: u64,
    pub core_aborts: u64,
    /// Rooms held in flight through the engine API while aborts are timed, and how many aborts.
    pub api_rooms_in_flight: u64,
    pub api_aborts: u64,
    /// Rooms in flight when the decode gateway is frozen.
    pub frozen_rooms: u64,
    /// SGLang-shaped rooms moved each way (one call per part per chunk, and batched).
    pub sglang_rooms: u64,
    /// 4 KiB rooms moved one after the other for the per-room cost (latency and CPU per room).
    pub room_cost_rooms: u64,
    /// Minimal rooms moved through batched calls (`ExpectBatch` / `SendBatch`) for rooms per second.
    pub batched_rooms: u64,
}

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

impl Plan {
    pub fn full() -> Plan {
        Plan {
            block_sizes_bytes: vec![4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB],
            blocks_per_transfer: vec![1, 10, 100, 1_000, 10_000],
            max_transfer_bytes: FULL_MAX_TRANSFER_BYTES,
            cell_budget_ms: 1_000,
            target_cell_budget_ms: 2_000,
            min_rooms_per_cell: 5,
            target_rounds: 5,
            inflight_rooms: 8,
            control_rooms: 5_000,
            control_concurrency: 32,
            core_rooms_in_flight: 100_000,
            core_aborts: 10_000,
            api_rooms_in_flight: 100_000,
            api_aborts: 1_000,
            frozen_rooms: 64,
            sglang_rooms: 100,
            room_cost_rooms: 3_000,
            batched_rooms: 100_000,
        }
    }

    pub fn quick() -> Plan {
        Plan {
            block_sizes_bytes: vec![4 * KIB, 64 * KIB, MIB, 4 * MIB, 64 * MIB],
            blocks_per_transfer: vec![1, 100, 10_000],
            max_transfer_bytes: QUICK_MAX_TRANSFER_BYTES,
            cell_budget_ms: 250,
            target_cell_budget_ms: 1_000,
            min_rooms_per_cell: 3,
            target_rounds: 5,
            inflight_rooms: 8,
            control_rooms: 1_000,
            control_concurrency: 16,
            core_rooms_in_flight: 100_000,
            core_aborts: 2_000,
            api_rooms_in_flight: 100_000,
            api_aborts: 500,
            frozen_rooms: 16,
            sglang_rooms: 20,
            room_cost_rooms: 1_000,
            batched_rooms: 20_000,
        }
    }

    /// Every cell to run, in order: block size ascending, then blocks ascending; cells over
    /// `max_transfer_bytes` are left out (see [`Plan::left_out`]).
    pub fn cells(&self) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        for &block in &self.block_sizes_bytes {
            for &blocks in &self.blocks_per_transfer {
                if block.saturating_mul(blocks) <= self.max_transfer_bytes {
                    out.push((block, blocks));
                }
            }
        }
        out
    }

    /// Cells of the matrix not run because they exceed `max_transfer_bytes`.
    pub fn left_out(&self) -> Vec<(u64, u64)> {
        let run = self.cells();
        let mut out = Vec::new();
        for &block in &self.block_sizes_bytes {
            for &blocks in &self.blocks_per_transfer {
                if !run.contains(&(block, blocks)) {
                    out.push((block, blocks));
                }
            }
        }
        out
    }

    /// The largest transfer of the plan: the size of one pool slot.
    pub fn slot_bytes(&self) -> u64 {
        self.cells().iter().map(|(b, n)| b * n).max().unwrap_or(0)
    }

    /// Every problem with the plan (empty when it may run).
    pub fn validate(&self) -> Vec<String> {
        let mut errors = Vec::new();
        let mut range = |name: &str, value: u64, min: u64, max: u64| {
            if value < min || value > max {
                errors.push(format!("{name} = {value} is outside {min}..={max}"));
            }
        };
        range("max_transfer_bytes", self.max_transfer_bytes, 4 * KIB, MAX_MAX_TRANSFER_BYTES);
        range("cell_budget_ms", self.cell_budget_ms, 1, MAX_CELL_BUDGET_MS);
        range("target_cell_budget_ms", self.target_cell_budget_ms, 1, MAX_CELL_BUDGET_MS);
        range("min_rooms_per_cell", self.min_rooms_per_cell, 1, MAX_ROOMS_PER_CELL);
        range("inflight_rooms", self.inflight_rooms, 1, MAX_INFLIGHT_ROOMS);
        range("target_rounds", self.target_rounds, 1, super::rounds::MAX_TARGET_ROUNDS);
        range("control_rooms", self.control_rooms, 1, 1_000_000);
        range("control_concurrency", self.control_concurrency, 1, 1_024);
        range("core_rooms_in_flight", self.core_rooms_in_flight, 1, MAX_CORE_ROOMS_IN_FLIGHT);
        range("core_aborts", self.core_aborts, 1, MAX_CORE_ROOMS_IN_FLIGHT);
        range("api_rooms_in_flight", self.api_rooms_in_flight, 1, 100_000);
        range("api_aborts", self.api_aborts, 1, self.api_rooms_in_flight.max(1));
        range("frozen_rooms", self.frozen_rooms, 1, 4_096);
        range("sglang_rooms", self.sglang_rooms, 1, 100_000);
        range("room_cost_rooms", self.room_cost_rooms, 2, 1_000_000);
        range("batched_rooms", self.batched_rooms, 1, 10_000_000);
        for &b in &self.block_sizes_bytes {
            range("block size (bytes)", b, 8, MAX_MAX_TRANSFER_BYTES);
        }
        for &n in &self.blocks_per_transfer {
            range("blocks per transfer", n, 1, 100_000);
        }
        if self.cells().is_empty() {
            errors.push(format!("no cell fits max_transfer_bytes = {}", size_label(self.max_transfer_bytes)));
        }
        errors
    }
}

/// Parse `4K,64KiB,1M,4096` into bytes (K/KiB = 1024, M/MiB = 1024^2, G/GiB = 1024^3).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let digits_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let number: u64 = t[..digits_end].parse().map_err(|_| format!("bad size {text:?}"))?;
    let scale = match t[digits_end..].trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => KIB,
        "m" | "mib" => MIB,
        "g" | "gib" => 1 << 30,
        other => return Err(format!("bad size unit {other:?} in {text:?}")),
    };
    number.checked_mul(scale).ok_or_else(|| format!("size {text:?} overflows"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quick_and_full_plans_are_valid_and_respect_the_byte_cap() {
        for plan in [Plan::quick(), Plan::full()] {
            assert_eq!(plan.validate(), Vec::<String>::new());
            assert!(plan.cells().iter().all(|(b, n)| b * n <= plan.max_transfer_bytes));
            assert_eq!(
                plan.cells().len() + plan.left_out().len(),
                plan.block_sizes_bytes.len() * plan.blocks_per_transfer.len()
            );
            assert!(plan.cells().contains(&(4 * MIB, 1)), "the shm target cell (4 MiB x 1) must run");
        }
        for plan in [Plan::quick(), Plan::full()] {
            assert_eq!(plan.core_rooms_in_flight, 100_000, "the abort target's rooms, in the core");
            assert_eq!(plan.api_rooms_in_flight, 100_000, "the abort target's rooms, through the engine API");
        }
    }

    #[test]
    fn limits_are_checked_at_and_just_past_each_bound() {
        let mut plan = Plan::quick();
        plan.inflight_rooms = MAX_INFLIGHT_ROOMS;
        assert!(plan.validate().is_empty());
        plan.inflight_rooms = MAX_INFLIGHT_ROOMS + 1;
        assert_eq!(plan.validate().len(), 1);
        let mut plan = Plan::quick();
        plan.max_transfer_bytes = MAX_MAX_TRANSFER_BYTES + 1;
        assert!(plan.validate()[0].starts_with("max_transfer_bytes"));
        let mut plan = Plan::quick();
        plan.max_transfer_bytes = 4 * KIB - 1;
        assert!(!plan.validate().is_empty());
        let mut plan = Plan::quick();
        plan.target_rounds = super::super::rounds::MAX_TARGET_ROUNDS;
        assert!(plan.validate().is_empty());
        plan.target_rounds = super::super::rounds::MAX_TARGET_ROUNDS + 1;
        assert!(plan.validate()[0].starts_with("target_rounds"));
        plan.target_rounds = 0;
        assert!(plan.validate()[0].starts_with("target_rounds"));
        for budget in [0, MAX_CELL_BUDGET_MS + 1] {
            let mut plan = Plan::quick();
            plan.target_cell_budget_ms = budget;
            assert!(plan.validate()[0].starts_with("target_cell_budget_ms"), "{budget}");
            plan.target_cell_budget_ms = 1;
            plan.cell_budget_ms = budget;
            assert!(plan.validate()[0].starts_with("cell_budget_ms"), "{budget}");
        }
        let mut plan = Plan::quick();
        plan.target_cell_budget_ms = MAX_CELL_BUDGET_MS;
        plan.cell_budget_ms = MAX_CELL_BUDGET_MS;
        assert!(plan.validate().is_empty());
        let mut plan = Plan::quick();
        plan.api_aborts = plan.api_rooms_in_flight + 1;
        assert!(plan.validate()[0].starts_with("api_aborts"));
    }

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("64MiB"), Ok(64 << 20));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("4X").is_err());
        assert!(parse_size("").is_err());
    }
}
