//! Runs N full room lifecycles (expect, notice, send, submit, success, part done, both terminal)
//! through two cores wired back to back with a no-op plugin, for instruction counting under
//! `valgrind --tool=callgrind`: `lifecycle_loop [N] [WARMUP]` (defaults 100 000 and 110 000, past `max_tombstones` so the slab is at its steady size).

use kvgate_core::*;

const A: PeerId = PeerId(1);
const B: PeerId = PeerId(2);
const SLOT: PluginSlot = PluginSlot(0);
const REGION: RegionId = RegionId(1);

struct Pair {
    now: Nanos,
    receiver: Core,
    sender: Core,
    next_room: u64,
}

impl Pair {
    fn new() -> Pair {
        let config = CoreConfig { max_inflight_rooms: 4_000_000, max_tombstones: 100_000, max_pending_sends: 1_000_000, ..CoreConfig::default() };
        let now = Nanos::from_ms(1);
        let mut receiver = Core::new(config.clone()).unwrap();
        let mut sender = Core::new(config).unwrap();
        receiver.handle_peer_up(now, B, 1, SLOT);
        sender.handle_peer_up(now, A, 1, SLOT);
        for core in [&mut receiver, &mut sender] {
            let info = RegionInfo { id: REGION, len: 1 << 40, memory_kind: kvgate_abi::MemoryKind::HOST, keys: vec![(SLOT, LocalKey(1))] };
            core.handle_region_registered(now, info);
        }
        sender.handle_remote_region(now, A, REGION, 1 << 40, RemoteKey(2));
        Pair { now, receiver, sender, next_room: 0 }
    }

    fn pump(&mut self) {
        loop {
            let mut moved = false;
            while let Some(command) = self.receiver.poll_command() {
                moved = true;
                if let Command::ToPeer { message, .. } = command {
                    self.sender.handle_peer_message(self.now, A, message);
                }
            }
            while let Some(command) = self.sender.poll_command() {
                moved = true;
                match command {
                    Command::ToPeer { message, .. } => self.receiver.handle_peer_message(self.now, B, message),
                    Command::Submit { xfer, segments, .. } => {
                        let bytes = segments.iter().map(|s| s.len).sum();
                        self.sender.handle_plugin_event(self.now, SLOT, &Event::succeeded(xfer, bytes));
                    }
                    _ => {}
                }
            }
            if !moved {
                return;
            }
        }
    }

    fn lifecycle(&mut self) {
        let room = RoomKey::new(self.next_room, 0);
        self.next_room += 1;
        self.now = self.now.saturating_add(Nanos(1_000));
        let parts = vec![vec![Slice::new(REGION, 0, 4096)]];
        self.receiver.handle_engine(self.now, EngineRequest::Expect { room, peer: B, parts, timeout_ms: None }).unwrap();
        self.pump();
        let slices = vec![Slice::new(REGION, 0, 4096)];
        let send = EngineRequest::Send { room, peer: Some(A), part: 0, chunk: 0, slices, last: true };
        self.sender.handle_engine(self.now, send).unwrap();
        self.pump();
        self.receiver.handle_timeout(self.now);
        self.sender.handle_timeout(self.now);
    }
}

fn main() {
    let mut args = std::env::args().skip(1).map(|a| a.parse::<u64>().expect("a count"));
    let count = args.next().unwrap_or(100_000);
    let warmup = args.next().unwrap_or(110_000);
    let mut pair = Pair::new();
    for _ in 0..warmup {
        pair.lifecycle();
    }
    let start = std::time::Instant::now();
    for _ in 0..count {
        pair.lifecycle();
    }
    let elapsed = start.elapsed();
    assert_eq!(pair.receiver.metrics().rooms_succeeded, count + warmup);
    assert_eq!(pair.sender.metrics().rooms_succeeded, count + warmup);
    println!("{count} lifecycles in {elapsed:?}: {:.0} ns each", elapsed.as_nanos() as f64 / count as f64);
}
