//! Core memory per in-flight room, measured with a counting global allocator: 100 000 receiver
//! rooms waiting for their sender (one part, one slice) and 100 000 sender rooms holding one chunk
//! (sent before the expect notice) must each cost at most 512 bytes; the benchmark reports both.

use kvgate_core::*;
use std::sync::atomic::Ordering;

#[path = "../benches/support/counting_alloc.rs"]
mod counting_alloc;
use counting_alloc::{CountingAllocator, LIVE_BYTES};
#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

const ROOMS: u64 = 100_000;
/// The allocator counts every thread: the tests measure one at a time.
static MEASURING: std::sync::Mutex<()> = std::sync::Mutex::new(());
const BYTES_PER_ROOM_LIMIT: isize = 512;

#[test]
fn receiver_room_costs_at_most_512_bytes() {
    let _one_at_a_time = MEASURING.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let now = At::from_origin(Span::from_ms(1));
    let config = CoreConfig { max_inflight_rooms: 1_000_000, ..CoreConfig::default() };
    let mut core = Core::new(config).unwrap();
    core.handle_peer_up(now, PeerId(2), 1, PluginSlot(0));
    let info = RegionInfo {
        id: RegionId(1),
        len: 1 << 40,
        memory_kind: kvgate_abi::MemoryKind::HOST,
        keys: vec![(PluginSlot(0), LocalKey(1))],
    };
    core.handle_region_registered(now, info);
    let before = LIVE_BYTES.load(Ordering::Relaxed);
    for n in 0..ROOMS {
        let parts = vec![vec![Slice::new(RegionId(1), n * 64, 64)]];
        let expect = EngineRequest::Expect { room: RoomKey::new(n, 0), peer: PeerId(2), parts, timeout_ms: None };
        core.handle_engine(now, expect).unwrap();
        while core.poll_command().is_some() {}
    }
    let per_room = (LIVE_BYTES.load(Ordering::Relaxed) - before) / ROOMS as isize;
    println!("memory per in-flight receiver room: {per_room} B");
    assert_eq!(core.live_rooms(), ROOMS);
    assert!(per_room <= BYTES_PER_ROOM_LIMIT, "{per_room} B per room > {BYTES_PER_ROOM_LIMIT} B");
}

#[test]
fn sender_room_holding_one_chunk_costs_at_most_512_bytes() {
    let _one_at_a_time = MEASURING.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let now = At::from_origin(Span::from_ms(1));
    let config = CoreConfig { max_inflight_rooms: 1_000_000, max_pending_sends: 1_000_000, ..CoreConfig::default() };
    let mut core = Core::new(config).unwrap();
    core.handle_peer_up(now, PeerId(1), 1, PluginSlot(0));
    let info = RegionInfo {
        id: RegionId(1),
        len: 1 << 40,
        memory_kind: kvgate_abi::MemoryKind::HOST,
        keys: vec![(PluginSlot(0), LocalKey(1))],
    };
    core.handle_region_registered(now, info);
    let before = LIVE_BYTES.load(Ordering::Relaxed);
    for n in 0..ROOMS {
        let slices = vec![Slice::new(RegionId(1), 0, 64)];
        let send = EngineRequest::Send {
            room: RoomKey::new(n, 0),
            peer: Some(PeerId(1)),
            part: 0,
            chunk: 0,
            slices,
            last: true,
        };
        core.handle_engine(now, send).unwrap();
        while core.poll_command().is_some() {}
    }
    let per_room = (LIVE_BYTES.load(Ordering::Relaxed) - before) / ROOMS as isize;
    println!("memory per in-flight sender room (one held chunk): {per_room} B");
    assert_eq!(core.live_rooms(), ROOMS);
    assert_eq!(core.metrics().pending_sends, ROOMS);
    assert!(per_room <= BYTES_PER_ROOM_LIMIT, "{per_room} B per room > {BYTES_PER_ROOM_LIMIT} B");
}

/// A settled room costs far less than a live one: 200 000 tombstones (engine aborts of rooms not
/// yet here, one per role) must each cost at most 192 bytes (key entry and FIFO growth included).
const BYTES_PER_TOMBSTONE_LIMIT: isize = 192;

#[test]
fn tombstone_costs_at_most_192_bytes() {
    let _one_at_a_time = MEASURING.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let now = At::from_origin(Span::from_ms(1));
    let config = CoreConfig { max_tombstones: 1_000_000, ..CoreConfig::default() };
    let mut core = Core::new(config).unwrap();
    let before = LIVE_BYTES.load(Ordering::Relaxed);
    for n in 0..ROOMS {
        core.handle_engine(now, EngineRequest::Abort { room: RoomKey::new(n, 0), role: None }).unwrap();
        while core.poll_command().is_some() {}
    }
    let tombstones = 2 * ROOMS;
    let per_tombstone = (LIVE_BYTES.load(Ordering::Relaxed) - before) / tombstones as isize;
    println!("memory per tombstone: {per_tombstone} B");
    assert_eq!(core.metrics().tombstones, tombstones);
    assert_eq!(core.live_rooms(), 0);
    assert!(
        per_tombstone <= BYTES_PER_TOMBSTONE_LIMIT,
        "{per_tombstone} B per tombstone > {BYTES_PER_TOMBSTONE_LIMIT} B"
    );
}
