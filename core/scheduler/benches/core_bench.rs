//! Benchmarks of kvgate-core with a no-op plugin: full room lifecycles per second (both cores of a
//! pair on one CPU, and each side's core alone: one gateway's share), cost of one
//! lifecycle with 10 vs 1 000 000 idle rooms (the ratio is the figure), a 100 000-segment submit
//! against a plain segment-building loop (reference), and core memory per in-flight room (counting
//! global allocator). `KVGATE_BENCH_IDLE_ROOMS` overrides the large idle count.

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use kvgate_core::*;
use std::sync::atomic::Ordering;
use std::time::Duration;

#[path = "support/counting_alloc.rs"]
mod counting_alloc;
use counting_alloc::{CountingAllocator, LIVE_BYTES};
#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

#[path = "support/noop_pair.rs"]
mod noop_pair;
use noop_pair::{NoopPair as Bench, Side, A, B, REGION};
#[path = "support/one_side.rs"]
mod one_side;
use one_side::OneSide;

/// Lifecycles before measuring one side: past `max_tombstones`, so both cores are at steady size.
const ONE_SIDE_WARMUP: u64 = 110_000;

fn bench_config() -> CoreConfig {
    CoreConfig {
        max_inflight_rooms: 4_000_000,
        max_tombstones: 100_000,
        max_pending_sends: 1_000_000,
        ..CoreConfig::default()
    }
}

fn lifecycles(c: &mut Criterion) {
    let mut group = c.benchmark_group("room_lifecycle");
    group.throughput(Throughput::Elements(1));
    let mut bench = Bench::new(bench_config());
    group.bench_function("full_lifecycle_noop_plugin", |b| b.iter(|| bench.lifecycle()));
    // One gateway's share: the inputs one side's core got from the pair, replayed into a core of
    // that side alone (the pair's run is outside the timing).
    for (name, side) in [("receiver_side_alone", Side::Receiver), ("sender_side_alone", Side::Sender)] {
        let mut one = OneSide::new(bench_config(), side);
        one.in_batches(ONE_SIDE_WARMUP, OneSide::replay);
        group.bench_function(name, |b| b.iter_custom(|iters| one.in_batches(iters, OneSide::replay)));
        one.check_in_step();
    }
    group.finish();
}

fn idle_rooms(c: &mut Criterion) {
    let large: u64 = std::env::var("KVGATE_BENCH_IDLE_ROOMS").ok().and_then(|v| v.parse().ok()).unwrap_or(1_000_000);
    let mut group = c.benchmark_group("lifecycle_with_idle_rooms");
    for idle in [10, large] {
        let mut bench = Bench::new(bench_config());
        bench.add_idle_rooms(idle);
        group.bench_function(format!("idle_{idle}"), |b| b.iter(|| bench.lifecycle()));
    }
    group.finish();
}

fn big_submit(c: &mut Criterion) {
    const SEGMENTS: u64 = 100_000;
    let mut group = c.benchmark_group("submit_100k_segments");
    group.throughput(Throughput::Elements(SEGMENTS));
    let config = CoreConfig { max_tombstones: 1_000, ..bench_config() };
    let bench = std::cell::RefCell::new(Bench::new(config));
    group.bench_function("core_send_to_submit", |b| {
        b.iter_batched(
            || {
                let mut guard = bench.borrow_mut();
                let bench = &mut *guard;
                // A destination of 100 000 one-page slices, announced; the chunk is one source slice.
                let room = RoomKey::new(bench.next_room, 0);
                bench.next_room += 1;
                let dest: Vec<Slice> = (0..SEGMENTS).map(|i| Slice::new(REGION, i * 8192, 4096)).collect();
                bench
                    .receiver
                    .handle_engine(
                        bench.now,
                        EngineRequest::Expect { room, peer: B, parts: vec![dest], timeout_ms: None },
                    )
                    .unwrap();
                while let Some(command) = bench.receiver.poll_command() {
                    if let Command::ToPeer { message, .. } = command {
                        bench.sender.handle_peer_message(bench.now, A, &message);
                    }
                }
                while bench.sender.poll_command().is_some() {}
                room
            },
            |room| {
                let mut guard = bench.borrow_mut();
                let bench = &mut *guard;
                let slices = vec![Slice::new(REGION, 0, SEGMENTS * 4096)];
                let send = EngineRequest::Send { room, peer: Some(A), part: 0, chunk: 0, slices, last: true };
                bench.sender.handle_engine(bench.now, send).unwrap();
                let submit = bench.sender.poll_command();
                let abort = EngineRequest::Abort { room, role: None };
                let _ = bench.sender.handle_engine(bench.now, abort);
                let _ = bench.receiver.handle_engine(bench.now, EngineRequest::Abort { room, role: None });
                while bench.sender.poll_command().is_some() {}
                while bench.receiver.poll_command().is_some() {}
                submit
            },
            BatchSize::PerIteration,
        )
    });
    // Reference: building the same 100 000 segments in a plain loop.
    group.bench_function("reference_plain_segment_loop", |b| {
        b.iter(|| {
            let segments: Vec<Segment> = (0..SEGMENTS)
                .map(|i| Segment {
                    local: LocalKey(1),
                    local_offset: i * 4096,
                    remote: RemoteKey(2),
                    remote_offset: i * 8192,
                    len: 4096,
                })
                .collect();
            segments
        })
    });
    group.finish();
}

/// Not a timing: live heap bytes per in-flight room, printed once.
fn memory_per_room(_c: &mut Criterion) {
    const ROOMS: u64 = 100_000;
    let mut bench = Bench::new(bench_config());
    let before = LIVE_BYTES.load(Ordering::Relaxed);
    bench.add_idle_rooms(ROOMS);
    let receiver_bytes = LIVE_BYTES.load(Ordering::Relaxed) - before;
    let before = LIVE_BYTES.load(Ordering::Relaxed);
    for n in 0..ROOMS {
        let room = RoomKey::new(n, 0);
        let send = EngineRequest::Send {
            room,
            peer: Some(A),
            part: 0,
            chunk: 0,
            slices: vec![Slice::new(REGION, 0, 64)],
            last: true,
        };
        bench.sender.handle_engine(bench.now, send).unwrap();
        while bench.sender.poll_command().is_some() {}
    }
    let sender_bytes = LIVE_BYTES.load(Ordering::Relaxed) - before;
    println!(
        "memory per in-flight room: receiver (waiting for sender) {} B, sender (one held chunk) {} B",
        receiver_bytes / ROOMS as isize,
        sender_bytes / ROOMS as isize
    );
}

fn short() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2))
        .sample_size(20)
}

criterion_group! { name = benches; config = short(); targets = memory_per_room, lifecycles, idle_rooms, big_submit }
criterion_main!(benches);
