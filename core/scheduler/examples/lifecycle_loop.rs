//! Runs N full room lifecycles (expect, notice, send, submit, success, part done, both terminal)
//! through two cores wired back to back with a no-op plugin, for instruction counting under
//! `valgrind --tool=callgrind`: `lifecycle_loop [N] [WARMUP]`
//! (defaults 100 000 and 110 000, past `max_tombstones` so the slab is at its steady size);
//! `--toggle-collect='*measured_lifecycles*'` counts the measured loop alone.
//! `KVGATE_LOOP_MAX_TOMBSTONES` overrides `max_tombstones` (default 100 000, as the bench): a small
//! value keeps the slab in cache and shows what the cache misses of a large one cost.
//! `KVGATE_LOOP_IDLE_ROOMS` puts that many idle rooms in flight first (as the bench's
//! `lifecycle_with_idle_rooms`), to count what a lifecycle costs beside them.
//! `KVGATE_LOOP_SIDE=receiver|sender` measures one gateway's share instead: the pair records that
//! side's inputs in batches and a shadow core of that side replays them (`measured_replay`).

use kvgate_core::*;

#[path = "../benches/support/noop_pair.rs"]
mod noop_pair;
use noop_pair::{NoopPair, Side};
#[path = "../benches/support/one_side.rs"]
mod one_side;
use one_side::OneSide;

fn main() {
    let mut args = std::env::args().skip(1).map(|a| a.parse::<u64>().expect("a count"));
    let count = args.next().unwrap_or(100_000);
    let warmup = args.next().unwrap_or(110_000);
    let max_tombstones =
        std::env::var("KVGATE_LOOP_MAX_TOMBSTONES").ok().map(|v| v.parse::<u64>().expect("a count")).unwrap_or(100_000);
    let config = CoreConfig {
        max_inflight_rooms: 4_000_000,
        max_tombstones,
        max_pending_sends: 1_000_000,
        ..CoreConfig::default()
    };
    let idle_rooms =
        std::env::var("KVGATE_LOOP_IDLE_ROOMS").ok().map(|v| v.parse::<u64>().expect("a count")).unwrap_or(0);
    let side = match std::env::var("KVGATE_LOOP_SIDE").as_deref() {
        Err(_) | Ok("") | Ok("both") => None,
        Ok("receiver") => Some(Side::Receiver),
        Ok("sender") => Some(Side::Sender),
        Ok(other) => panic!("KVGATE_LOOP_SIDE={other}: expected receiver, sender or both"),
    };
    if let Some(side) = side {
        assert_eq!(idle_rooms, 0, "KVGATE_LOOP_IDLE_ROOMS applies to the pair only");
        return one_side(config, side, count, warmup);
    }
    let mut pair = NoopPair::new(config);
    pair.add_idle_rooms(idle_rooms);
    for _ in 0..warmup {
        pair.lifecycle();
    }
    let start = std::time::Instant::now();
    measured_lifecycles(&mut pair, count);
    let elapsed = start.elapsed();
    assert_eq!(pair.receiver.metrics().rooms_succeeded, count + warmup);
    assert_eq!(pair.sender.metrics().rooms_succeeded, count + warmup);
    println!("{count} lifecycles in {elapsed:?}: {:.0} ns each", elapsed.as_nanos() as f64 / count as f64);
}

/// The measured loop, kept out of line so callgrind can count it alone.
#[inline(never)]
fn measured_lifecycles(pair: &mut NoopPair, count: u64) {
    for _ in 0..count {
        pair.lifecycle();
    }
}

fn one_side(config: CoreConfig, side: Side, count: u64, warmup: u64) {
    let mut one = OneSide::new(config, side);
    one.in_batches(warmup, OneSide::replay);
    let elapsed = one.in_batches(count, measured_replay);
    one.check_in_step();
    println!(
        "{side:?} side alone, {count} lifecycles replayed in {elapsed:?}: {:.0} ns each",
        elapsed.as_nanos() as f64 / count as f64
    );
}

/// The measured replay, kept out of line so callgrind can count it alone.
#[inline(never)]
fn measured_replay(one: &mut OneSide) {
    one.replay();
}
