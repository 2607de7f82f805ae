//! Core memory per in-flight room, measured with a counting global allocator: 100 000 receiver
//! rooms waiting for their sender (one part, one slice) must cost at most 512 bytes each. The
//! sender-side figure (one held chunk) is printed; the benchmark reports both.

use kvgate_core::*;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

struct CountingAllocator;
static LIVE_BYTES: AtomicIsize = AtomicIsize::new(0);
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE_BYTES.fetch_add(layout.size() as isize, Ordering::Relaxed);
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE_BYTES.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE_BYTES.fetch_add(new_size as isize - layout.size() as isize, Ordering::Relaxed);
        System.realloc(ptr, layout, new_size)
    }
}
#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

const ROOMS: u64 = 100_000;
const BYTES_PER_ROOM_LIMIT: isize = 512;

#[test]
fn receiver_room_costs_at_most_512_bytes() {
    let now = Nanos::from_ms(1);
    let config = CoreConfig { max_inflight_rooms: 1_000_000, ..CoreConfig::default() };
    let mut core = Core::new(config).unwrap();
    core.handle_peer_up(now, PeerId(2), 1, PluginSlot(0));
    let info = RegionInfo { id: RegionId(1), len: 1 << 40, memory_kind: kvgate_abi::MemoryKind::HOST, keys: vec![(PluginSlot(0), LocalKey(1))] };
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
