//! Two kvgate cores wired back to back with a plugin that succeeds every submit at once: the
//! no-op pair that `benches/core_bench.rs` and `examples/lifecycle_loop.rs` both drive.
//! Included by path from each (`#[path = ..] mod noop_pair;`); it owns no measurement.

use kvgate_core::*;

pub const A: PeerId = PeerId(1);
pub const B: PeerId = PeerId(2);
pub const SLOT: PluginSlot = PluginSlot(0);
pub const REGION: RegionId = RegionId(1);

/// Two cores wired back to back with a plugin that succeeds every submit at once.
pub struct NoopPair {
    pub now: Nanos,
    pub receiver: Core,
    pub sender: Core,
    pub next_room: u64,
}

impl NoopPair {
    pub fn new(config: CoreConfig) -> NoopPair {
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
        NoopPair { now, receiver, sender, next_room: 0 }
    }

    pub fn pump(&mut self) {
        loop {
            let mut moved = false;
            // Executed commands go back to their core (`recycle_command`), as a driver that reuses
            // the buffers of submits, incoming expects and sent notices does. A message is
            // delivered borrowed: the sending core gets its buffers back, as after serialising.
            while let Some(command) = self.receiver.poll_command() {
                moved = true;
                match command {
                    Command::ToPeer { ref message, .. } => {
                        self.sender.handle_peer_message(self.now, A, message);
                        self.receiver.recycle_command(command);
                    }
                    executed @ Command::ExpectIncoming { .. } => self.receiver.recycle_command(executed),
                    _ => {}
                }
            }
            while let Some(command) = self.sender.poll_command() {
                moved = true;
                match command {
                    Command::ToPeer { ref message, .. } => self.receiver.handle_peer_message(self.now, B, message),
                    Command::Submit { xfer, ref segments, .. } => {
                        let bytes = segments.iter().map(|s| s.len).sum();
                        self.sender.handle_plugin_event(self.now, SLOT, &Event::succeeded(xfer, bytes));
                        self.sender.recycle_command(command);
                    }
                    _ => {}
                }
            }
            if !moved {
                return;
            }
        }
    }

    /// One full room: expect, notice, send, submit, success, part done, both terminal.
    pub fn lifecycle(&mut self) {
        let room = RoomKey::new(self.next_room, 0);
        self.next_room += 1;
        self.now = self.now.saturating_add(Nanos(1_000));
        // The expect's parts borrowed (`handle_expect`), as from an engine's own buffer.
        let part = [Slice::new(REGION, 0, 4096)];
        self.receiver.handle_expect(self.now, room, B, &[&part[..]], None).unwrap();
        self.pump();
        // The send's slices borrowed (`handle_send`), as from an engine's own buffer.
        let slices = [Slice::new(REGION, 0, 4096)];
        self.sender.handle_send(self.now, room, Some(A), 0, 0, &slices, true).unwrap();
        self.pump();
        self.receiver.handle_timeout(self.now);
        self.sender.handle_timeout(self.now);
    }

    /// Rooms that wait for a sender that never comes (receiver side only).
    pub fn add_idle_rooms(&mut self, count: u64) {
        for n in 0..count {
            let room = RoomKey::new(u64::MAX / 2 + n, 0);
            let parts = vec![vec![Slice::new(REGION, n * 64, 64)]];
            self.receiver.handle_engine(self.now, EngineRequest::Expect { room, peer: B, parts, timeout_ms: None }).unwrap();
            while self.receiver.poll_command().is_some() {}
        }
    }
}
