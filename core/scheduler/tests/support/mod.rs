//! An in-memory pair of cores with a fake clock: a decode gateway (receiver) and a prefill gateway
//! (sender), a peer link that can be cut, and a fake plugin that copies bytes between two buffers.
//! Tests read as short scripts; `drive` fails on livelock instead of hanging.
#![allow(dead_code)]

use kvgate_core::*;
use std::collections::BTreeMap;

pub const DECODE_ID: PeerId = PeerId(1);
pub const PREFILL_ID: PeerId = PeerId(2);
pub const SLOT: PluginSlot = PluginSlot(0);
pub const DST_REGION: RegionId = RegionId(10);
pub const SRC_REGION: RegionId = RegionId(20);
pub const REGION_LEN: u64 = 1 << 20;
const DST_LOCAL_KEY: LocalKey = LocalKey(110);
const DST_REMOTE_KEY: RemoteKey = RemoteKey(210);
const SRC_LOCAL_KEY: LocalKey = LocalKey(120);

pub fn key(room: u64) -> RoomKey {
    RoomKey::new(room, 0)
}

pub fn slices(region: RegionId, list: &[(u64, u64)]) -> Vec<Slice> {
    list.iter().map(|&(offset, len)| Slice::new(region, offset, len)).collect()
}

#[derive(Clone, Debug)]
pub struct Submitted {
    pub xfer: XferId,
    pub ticket: Ticket,
    pub timeout: Span,
    pub segments: Vec<Segment>,
}

/// One gateway: its core and everything its driver saw come out.
pub struct Node {
    pub core: Core,
    pub id: PeerId,
    pub events: Vec<RoomEvent>,
    pub submits: BTreeMap<u64, Submitted>,
    pub cancels: Vec<XferId>,
    pub tickets_opened: Vec<Ticket>,
    pub tickets_cancelled: Vec<Ticket>,
    pub to_peer: Vec<PeerMessage>,
    /// Plugin contract violations the core reported (`Command::Violation`).
    pub violations: Vec<Violation>,
    pub memory: Vec<u8>,
}

impl Node {
    fn new(config: CoreConfig, id: PeerId) -> Node {
        Node {
            core: Core::new(config).expect("valid config"),
            id,
            events: Vec::new(),
            submits: BTreeMap::new(),
            cancels: Vec::new(),
            tickets_opened: Vec::new(),
            tickets_cancelled: Vec::new(),
            to_peer: Vec::new(),
            violations: Vec::new(),
            memory: vec![0; REGION_LEN as usize],
        }
    }

    pub fn terminal(&self, room: RoomKey) -> Option<Outcome> {
        self.events.iter().find_map(|e| match e {
            RoomEvent::Terminal { room: r, outcome, .. } if *r == room => Some(*outcome),
            _ => None,
        })
    }

    pub fn terminal_count(&self, room: RoomKey) -> usize {
        self.events.iter().filter(|e| matches!(e, RoomEvent::Terminal { room: r, .. } if *r == room)).count()
    }

    pub fn failure(&self, room: RoomKey) -> Option<FailReason> {
        match self.terminal(room) {
            Some(Outcome::Failed(failure)) => Some(failure.reason),
            _ => None,
        }
    }

    pub fn reusable(&self, room: RoomKey) -> Option<ReleaseCause> {
        self.events.iter().find_map(|e| match e {
            RoomEvent::Reusable { room: r, cause, .. } if *r == room => Some(*cause),
            _ => None,
        })
    }

    pub fn state(&self, now: At, room: RoomKey, role: Role) -> Option<RoomState> {
        self.core.room(now, room, role).map(|v| v.state)
    }

    pub fn live_submits(&self) -> Vec<u64> {
        self.submits.keys().copied().collect()
    }
}

/// The pair. `auto_complete`: the fake plugin finishes every submit (copying bytes) on the next
/// `drive`; otherwise the test completes or fails transfers itself.
pub struct Pair {
    pub now: At,
    pub decode: Node,
    pub prefill: Node,
    pub link_up: bool,
    pub auto_complete: bool,
    /// Whether the decode side's plugin answers `CancelIncoming` with an incoming `QUIESCED`.
    pub receiver_enforced: bool,
    /// Whether the prefill side's plugin answers `Cancel` with `FAILED(cancelled)` + quiesced.
    pub cancel_answers: bool,
}

impl Pair {
    pub fn new() -> Pair {
        Pair::with_config(CoreConfig::default())
    }

    pub fn with_config(config: CoreConfig) -> Pair {
        let mut pair = Pair {
            now: At::ZERO.saturating_add(Span::from_ms(1_000)),
            decode: Node::new(config.clone(), DECODE_ID),
            prefill: Node::new(config, PREFILL_ID),
            link_up: true,
            auto_complete: true,
            receiver_enforced: false,
            cancel_answers: true,
        };
        let now = pair.now;
        pair.decode.core.handle_peer_up(now, PREFILL_ID, 1, SLOT);
        pair.prefill.core.handle_peer_up(now, DECODE_ID, 1, SLOT);
        pair.decode.core.handle_region_registered(
            now,
            RegionInfo {
                id: DST_REGION,
                len: REGION_LEN,
                memory_kind: kvgate_abi::MemoryKind::HOST,
                keys: vec![(SLOT, DST_LOCAL_KEY)],
            },
        );
        pair.prefill.core.handle_region_registered(
            now,
            RegionInfo {
                id: SRC_REGION,
                len: REGION_LEN,
                memory_kind: kvgate_abi::MemoryKind::HOST,
                keys: vec![(SLOT, SRC_LOCAL_KEY)],
            },
        );
        pair.prefill.core.handle_remote_region(now, DECODE_ID, DST_REGION, REGION_LEN, DST_REMOTE_KEY);
        for (i, byte) in pair.prefill.memory.iter_mut().enumerate() {
            *byte = (i.wrapping_mul(31) % 251) as u8;
        }
        pair
    }

    pub fn expect(&mut self, room: RoomKey, parts: &[&[(u64, u64)]]) -> Result<(), Refusal> {
        let parts = parts.iter().map(|p| slices(DST_REGION, p)).collect();
        let result = self
            .decode
            .core
            .handle_engine(self.now, EngineRequest::Expect { room, peer: PREFILL_ID, parts, timeout_ms: None });
        self.drive();
        result
    }

    pub fn send(
        &mut self,
        room: RoomKey,
        part: u32,
        chunk: u32,
        list: &[(u64, u64)],
        last: bool,
    ) -> Result<(), Refusal> {
        let result = self.prefill.core.handle_engine(
            self.now,
            EngineRequest::Send { room, peer: None, part, chunk, slices: slices(SRC_REGION, list), last },
        );
        self.drive();
        result
    }

    /// A chunk placed at byte `at` of the part's destination stream.
    pub fn send_at(
        &mut self,
        room: RoomKey,
        part: u32,
        chunk: u32,
        at: u64,
        list: &[(u64, u64)],
        last: bool,
    ) -> Result<(), Refusal> {
        let slices = slices(SRC_REGION, list);
        let result = self.prefill.core.handle_send_at(self.now, room, None, part, chunk, at, &slices, last);
        self.drive();
        result
    }

    pub fn abort_decode(&mut self, room: RoomKey) {
        let result =
            self.decode.core.handle_engine(self.now, EngineRequest::Abort { room, role: Some(Role::Receiver) });
        assert!(result.is_ok(), "abort is never refused");
        self.drive();
    }

    pub fn abort_prefill(&mut self, room: RoomKey) {
        let result = self.prefill.core.handle_engine(self.now, EngineRequest::Abort { room, role: Some(Role::Sender) });
        assert!(result.is_ok(), "abort is never refused");
        self.drive();
    }

    /// Copy a submitted transfer's bytes and report it succeeded.
    pub fn complete(&mut self, xfer: u64) {
        let submitted = self.prefill.submits.remove(&xfer).expect("live submit");
        let mut bytes = 0;
        for segment in &submitted.segments {
            assert_eq!(segment.local, SRC_LOCAL_KEY);
            assert_eq!(segment.remote, DST_REMOTE_KEY);
            let (src, dst, len) = (segment.local_offset as usize, segment.remote_offset as usize, segment.len as usize);
            let chunk = self.prefill.memory[src..src + len].to_vec();
            self.decode.memory[dst..dst + len].copy_from_slice(&chunk);
            bytes += segment.len;
        }
        self.prefill.core.handle_plugin_event(self.now, SLOT, &Event::succeeded(XferId(xfer), bytes));
    }

    pub fn fail(&mut self, xfer: u64, reason: ReasonCode) {
        self.prefill.submits.remove(&xfer).expect("live submit");
        self.prefill.core.handle_plugin_event(self.now, SLOT, &Event::failed_quiesced(XferId(xfer), reason, "test"));
    }

    pub fn plugin_event(&mut self, event: Event) {
        self.prefill.core.handle_plugin_event(self.now, SLOT, &event);
        self.drive();
    }

    /// Run every command until nothing moves. Panics after a bounded number of rounds (livelock).
    pub fn drive(&mut self) {
        for _round in 0..10_000 {
            let mut moved = false;
            while let Some(command) = self.decode.core.poll_command() {
                moved = true;
                self.execute_decode(command);
            }
            while let Some(command) = self.prefill.core.poll_command() {
                moved = true;
                self.execute_prefill(command);
            }
            if self.auto_complete && !self.prefill.submits.is_empty() {
                moved = true;
                for xfer in self.prefill.live_submits() {
                    self.complete(xfer);
                }
            }
            if !moved {
                return;
            }
        }
        panic!("livelock: commands kept coming for 10 000 rounds");
    }

    fn execute_decode(&mut self, command: Command) {
        match command {
            Command::ToEngine(event) => self.decode.events.push(event),
            Command::Violation(violation) => self.decode.violations.push(violation),
            Command::ToPeer { peer, message } => {
                self.decode.to_peer.push(message.clone());
                if self.link_up && peer == PREFILL_ID {
                    self.prefill.core.handle_peer_message(self.now, DECODE_ID, &message);
                }
            }
            Command::ExpectIncoming { ticket, .. } => self.decode.tickets_opened.push(ticket),
            Command::CancelIncoming { ticket, peer, .. } => {
                self.decode.tickets_cancelled.push(ticket);
                if self.receiver_enforced {
                    let event = Event::incoming_quiesced(peer, ticket);
                    self.decode.core.handle_plugin_event(self.now, SLOT, &event);
                }
            }
            other => panic!("the decode side never submits: {other:?}"),
        }
    }

    fn execute_prefill(&mut self, command: Command) {
        match command {
            Command::ToEngine(event) => self.prefill.events.push(event),
            Command::Violation(violation) => self.prefill.violations.push(violation),
            Command::ToPeer { peer, message } => {
                assert_eq!(peer, DECODE_ID);
                self.prefill.to_peer.push(message.clone());
                if self.link_up {
                    self.decode.core.handle_peer_message(self.now, PREFILL_ID, &message);
                }
            }
            Command::Submit { xfer, ticket, timeout, segments, .. } => {
                self.prefill.submits.insert(xfer.0, Submitted { xfer, ticket, timeout, segments });
            }
            Command::Cancel { xfer, .. } => {
                self.prefill.cancels.push(xfer);
                if self.cancel_answers && self.prefill.submits.remove(&xfer.0).is_some() {
                    let event = Event::failed_quiesced(xfer, ReasonCode::CANCELLED, "cancelled");
                    self.prefill.core.handle_plugin_event(self.now, SLOT, &event);
                }
            }
            other => panic!("the prefill side never expects incoming: {other:?}"),
        }
    }

    /// Move the clock and fire due timers on both sides.
    pub fn advance_ms(&mut self, ms: u64) {
        let target = self.now.saturating_add(Span::from_ms(ms));
        // Step through every wake-up the cores ask for, the way a driver would.
        loop {
            let next = [self.decode.core.poll_timeout(), self.prefill.core.poll_timeout()]
                .into_iter()
                .flatten()
                .filter(|&t| t <= target)
                .min();
            let Some(next) = next else { break };
            self.now = next.max(self.now);
            self.decode.core.handle_timeout(self.now);
            self.prefill.core.handle_timeout(self.now);
            self.drive();
        }
        self.now = target;
        self.decode.core.handle_timeout(self.now);
        self.prefill.core.handle_timeout(self.now);
        self.drive();
    }

    pub fn decode_bytes(&self, offset: u64, len: u64) -> &[u8] {
        &self.decode.memory[offset as usize..(offset + len) as usize]
    }
    pub fn prefill_bytes(&self, offset: u64, len: u64) -> &[u8] {
        &self.prefill.memory[offset as usize..(offset + len) as usize]
    }
}
