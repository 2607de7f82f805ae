//! Two kvgate cores wired back to back with a plugin that succeeds every submit at once: the
//! no-op pair that `benches/core_bench.rs` and `examples/lifecycle_loop.rs` both drive.
//! Included by path from each (`#[path = ..] mod noop_pair;`); it owns no measurement.
//! It can also record every input one side's core receives (`record`), so that a second core of
//! that side can replay them alone (`one_side.rs`): one gateway's share of a lifecycle.

use kvgate_core::*;

pub const A: PeerId = PeerId(1);
pub const B: PeerId = PeerId(2);
pub const SLOT: PluginSlot = PluginSlot(0);
pub const REGION: RegionId = RegionId(1);

/// Two cores wired back to back with a plugin that succeeds every submit at once.
pub struct NoopPair {
    pub now: At,
    pub receiver: Core,
    pub sender: Core,
    pub next_room: u64,
    /// While `Some`, every input of that side's core is appended to `recorded`.
    pub record: Option<Side>,
    pub recorded: Vec<Input>,
}

/// Which core of the pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The decode side: expects, then receives.
    Receiver,
    /// The prefill side: sends, submits to the plugin.
    Sender,
}

/// One input to one core, as the pair delivered it.
pub enum Input {
    Expect { now: At, room: RoomKey },
    Send { now: At, room: RoomKey },
    PeerMessage { now: At, from: PeerId, message: PeerMessage },
    PluginEvent { now: At, event: Event },
    Timeout { now: At },
}

/// The expect's one part: a page of the registered region.
pub const EXPECT_PART: [Slice; 1] = [Slice { region: REGION, offset: 0, len: 4096 }];
/// The send's one chunk: the same page on the sender.
pub const SEND_SLICES: [Slice; 1] = [Slice { region: REGION, offset: 0, len: 4096 }];

/// A core of `side` as the pair sets it up: peer up, region registered, remote region known.
pub fn new_side(config: CoreConfig, now: At, side: Side) -> Core {
    let mut core = Core::new(config).unwrap();
    let peer = match side {
        Side::Receiver => B,
        Side::Sender => A,
    };
    core.handle_peer_up(now, peer, 1, SLOT);
    let info = RegionInfo {
        id: REGION,
        len: 1 << 40,
        memory_kind: kvgate_abi::MemoryKind::HOST,
        keys: vec![(SLOT, LocalKey(1))],
    };
    core.handle_region_registered(now, info);
    if side == Side::Sender {
        core.handle_remote_region(now, A, REGION, 1 << 40, RemoteKey(2));
    }
    core
}

impl NoopPair {
    pub fn new(config: CoreConfig) -> NoopPair {
        let now = Self::START;
        let receiver = new_side(config.clone(), now, Side::Receiver);
        let sender = new_side(config, now, Side::Sender);
        NoopPair { now, receiver, sender, next_room: 0, record: None, recorded: Vec::new() }
    }

    /// The clock of a new pair.
    pub const START: At = At(1_000_000);

    fn recording(&self, side: Side) -> bool {
        self.record == Some(side)
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
                        if self.recording(Side::Sender) {
                            self.recorded.push(Input::PeerMessage { now: self.now, from: A, message: message.clone() });
                        }
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
                    Command::ToPeer { ref message, .. } => {
                        if self.recording(Side::Receiver) {
                            self.recorded.push(Input::PeerMessage { now: self.now, from: B, message: message.clone() });
                        }
                        self.receiver.handle_peer_message(self.now, B, message)
                    }
                    Command::Submit { xfer, ref segments, .. } => {
                        let bytes = segments.iter().map(|s| s.len).sum();
                        let event = Event::succeeded(xfer, bytes);
                        if self.recording(Side::Sender) {
                            self.recorded.push(Input::PluginEvent { now: self.now, event: event.clone() });
                        }
                        self.sender.handle_plugin_event(self.now, SLOT, &event);
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
        self.now = self.now.saturating_add(Span(1_000));
        let now = self.now;
        // The expect's parts borrowed (`handle_expect`), as from an engine's own buffer.
        if self.recording(Side::Receiver) {
            self.recorded.push(Input::Expect { now, room });
        }
        self.receiver.handle_expect(now, room, B, &[&EXPECT_PART[..]], None).unwrap();
        self.pump();
        // The send's slices borrowed (`handle_send`), as from an engine's own buffer.
        if self.recording(Side::Sender) {
            self.recorded.push(Input::Send { now, room });
        }
        self.sender.handle_send(now, room, Some(A), 0, 0, &SEND_SLICES, true).unwrap();
        self.pump();
        if self.record.is_some() {
            self.recorded.push(Input::Timeout { now });
        }
        self.receiver.handle_timeout(now);
        self.sender.handle_timeout(now);
    }

    /// Rooms that wait for a sender that never comes (receiver side only).
    pub fn add_idle_rooms(&mut self, count: u64) {
        for n in 0..count {
            let room = RoomKey::new(u64::MAX / 2 + n, 0);
            let parts = vec![vec![Slice::new(REGION, n * 64, 64)]];
            self.receiver
                .handle_engine(self.now, EngineRequest::Expect { room, peer: B, parts, timeout_ms: None })
                .unwrap();
            while self.receiver.poll_command().is_some() {}
        }
    }
}
