//! Deterministic simulation of two cores, a simulated plugin on each and a faulty peer link.
//! Safety phase: faults on (drops, delays, reordering, duplicates, late and unknown plugin events,
//! silent plugins, frozen and killed peers, abort storms), invariants checked after every step.
//! Liveness phase: faults healed, every room must reach terminal and reusable within its bound, and
//! both cores must return to empty (no room, no timer, no quarantined byte).
//!
//! Replay a run with `KVGATE_SIM_SEED=<seed>`; run more rooms with `KVGATE_SIM_ROOMS=<n>`.
// CONFORMANCE: ABORT-5, ABORT-6, ABORT-8, ABORT-9, TIME-6, TIME-7, RES-4

use kvgate_abi::EventKind;
use kvgate_core::*;
use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap, VecDeque};

const TICK: u64 = 1_000_000;
const REGION: RegionId = RegionId(1);
const REGION_LEN: u64 = 1 << 40;
const SLOT: PluginSlot = PluginSlot(0);

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn chance(&mut self, per_million: u64) -> bool {
        self.below(1_000_000) < per_million
    }
    fn range(&mut self, low: u64, high: u64) -> u64 {
        low + self.below(high - low + 1)
    }
}

fn config() -> CoreConfig {
    CoreConfig {
        max_inflight_rooms: 1_000_000,
        bootstrap_timeout_ms: 200,
        transfer_base_ms: 100,
        min_bandwidth_bytes_per_s: 1_000_000_000,
        room_timeout_ms: 1_000,
        max_room_timeout_ms: 1_000,
        plugin_grace_ms: 20,
        quarantine_timeout_ms: 500,
        tombstone_ttl_ms: 2_000,
        max_tombstones: 1_000_000,
        max_pending_sends: 1_000_000,
        ..CoreConfig::default()
    }
}

/// Fault rates in parts per million (0 when healed).
#[derive(Clone, Copy)]
struct Faults {
    drop_message: u64,
    duplicate_message: u64,
    late_message: u64,
    plugin_fail: u64,
    plugin_silent: u64,
    plugin_duplicate: u64,
    plugin_unknown_kind: u64,
    separate_quiesce_lost: u64,
    cancel_ignored: u64,
    freeze: u64,
    kill: u64,
    abort: u64,
    abort_storm: u64,
}

const FAULTS_ON: Faults = Faults {
    drop_message: 5_000,
    duplicate_message: 5_000,
    late_message: 10_000,
    plugin_fail: 20_000,
    plugin_silent: 5_000,
    plugin_duplicate: 5_000,
    plugin_unknown_kind: 1_000,
    separate_quiesce_lost: 100_000,
    cancel_ignored: 20_000,
    freeze: 300,
    kill: 100,
    abort: 20_000,
    abort_storm: 50,
};

const HEALED: Faults = Faults {
    drop_message: 0,
    duplicate_message: 0,
    late_message: 0,
    plugin_fail: 0,
    plugin_silent: 0,
    plugin_duplicate: 0,
    plugin_unknown_kind: 0,
    separate_quiesce_lost: 0,
    cancel_ignored: 0,
    freeze: 0,
    kill: 0,
    abort: 0,
    abort_storm: 0,
};

enum Action {
    Engine { node: usize, request: EngineRequest },
    Message { to: usize, link_epoch: u64, message: PeerMessage },
    Plugin { node: usize, event: Event },
    PeerBack { node: usize },
}

struct Scheduled {
    at: u64,
    seq: u64,
    action: Action,
}
impl PartialEq for Scheduled {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Scheduled {}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Scheduled {
    fn cmp(&self, other: &Self) -> Ordering {
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}

#[derive(Default)]
struct Observation {
    created: u64,
    terminal_at: Option<u64>,
    terminals: u32,
    reusables: u32,
    succeeded: bool,
}

struct Node {
    core: Core,
    peer_incarnation: u64,
    frozen_until: u64,
    live_submits: HashMap<u64, u64>,
}

struct Sim {
    rng: Rng,
    now: u64,
    seq: u64,
    heap: BinaryHeap<Scheduled>,
    nodes: [Node; 2],
    faults: Faults,
    link_epoch: u64,
    observations: HashMap<(usize, RoomKey, Role), Observation>,
    live_fifo: VecDeque<(u64, usize, RoomKey, Role)>,
    quarantine_fifo: VecDeque<(u64, usize, RoomKey, Role)>,
    live_bound: u64,
    reusable_bound: u64,
    steps: u64,
    rooms_started: u64,
}

fn peer_of(node: usize) -> PeerId {
    PeerId(node as u64 + 1)
}

impl Sim {
    fn new(seed: u64) -> Sim {
        let config = config();
        let live_bound = (config.max_room_timeout_ms + 1) * TICK;
        let reusable_bound = (config.quarantine_timeout_ms + 1) * TICK;
        let make = || Node {
            core: Core::new(config.clone()).unwrap(),
            peer_incarnation: 1,
            frozen_until: 0,
            live_submits: HashMap::new(),
        };
        let mut sim = Sim {
            rng: Rng(seed),
            now: 0,
            seq: 0,
            heap: BinaryHeap::new(),
            nodes: [make(), make()],
            faults: FAULTS_ON,
            link_epoch: 0,
            observations: HashMap::new(),
            live_fifo: VecDeque::new(),
            quarantine_fifo: VecDeque::new(),
            live_bound,
            reusable_bound,
            steps: 0,
            rooms_started: 0,
        };
        for node in 0..2 {
            sim.connect(node);
            let info = RegionInfo {
                id: REGION,
                len: REGION_LEN,
                memory_kind: kvgate_abi::MemoryKind::HOST,
                keys: vec![(SLOT, LocalKey(node as u64 + 100))],
            };
            sim.nodes[node].core.handle_region_registered(At(0), info);
        }
        sim
    }

    fn connect(&mut self, node: usize) {
        let other = 1 - node;
        let incarnation = self.nodes[other].peer_incarnation;
        let now = At(self.now);
        self.nodes[node].core.handle_peer_up(now, peer_of(other), incarnation, SLOT);
        self.nodes[node].core.handle_remote_region(
            now,
            peer_of(other),
            REGION,
            REGION_LEN,
            RemoteKey(other as u64 + 200),
        );
    }

    fn schedule(&mut self, delay: u64, action: Action) {
        self.seq += 1;
        self.heap.push(Scheduled { at: self.now + delay, seq: self.seq, action });
    }

    /// A new room: random direction, parts, chunks, slices, order and abort.
    fn start_room(&mut self, id: u64) {
        self.rooms_started += 1;
        let receiver = self.rng.below(2) as usize;
        let sender = 1 - receiver;
        let generation = self.rng.below(2) as u32;
        let room = RoomKey::new(id, generation);
        let parts = self.rng.range(1, 3) as usize;
        let mut expect_parts = Vec::new();
        let expect_delay = self.rng.below(3 * TICK);
        let mut send_delay = self.rng.below(3 * TICK);
        for part in 0..parts {
            let chunks = self.rng.range(1, 3);
            let sizes: Vec<u64> = (0..chunks).map(|_| self.rng.range(1, 4096)).collect();
            let total: u64 = sizes.iter().sum();
            // The destination: 1-3 slices covering `total` bytes.
            let mut dest = Vec::new();
            let mut left = total;
            while left > 0 {
                let len = if dest.len() == 2 { left } else { self.rng.range(1, left) };
                dest.push(Slice::new(REGION, self.rng.below(1 << 30), len));
                left -= len;
            }
            expect_parts.push(dest);
            for (chunk, &size) in sizes.iter().enumerate() {
                let split = self.rng.range(1, size);
                let mut slices = vec![Slice::new(REGION, self.rng.below(1 << 30), split)];
                if split < size {
                    slices.push(Slice::new(REGION, self.rng.below(1 << 30), size - split));
                }
                let request = EngineRequest::Send {
                    room,
                    peer: if self.rng.chance(500_000) { Some(peer_of(receiver)) } else { None },
                    part: part as u32,
                    chunk: chunk as u32,
                    slices,
                    last: chunk as u64 == chunks - 1,
                };
                send_delay += self.rng.below(TICK);
                self.schedule(send_delay, Action::Engine { node: sender, request });
            }
        }
        let timeout_ms = if self.rng.chance(100_000) { Some(self.rng.range(1, 1_000)) } else { None };
        let request = EngineRequest::Expect { room, peer: peer_of(sender), parts: expect_parts, timeout_ms };
        self.schedule(expect_delay, Action::Engine { node: receiver, request });
        if self.rng.chance(self.faults.abort) {
            let node = self.rng.below(2) as usize;
            let role = if node == receiver { Role::Receiver } else { Role::Sender };
            let request = EngineRequest::Abort { room, role: Some(role) };
            let delay = self.rng.below(6 * TICK);
            self.schedule(delay, Action::Engine { node, request });
        }
    }

    fn drain(&mut self, node: usize) {
        while let Some(command) = self.nodes[node].core.poll_command() {
            self.execute(node, command);
        }
    }

    fn execute(&mut self, node: usize, command: Command) {
        let faults = self.faults;
        match command {
            Command::ToEngine(event) => self.observe(node, event),
            Command::ToPeer { message, .. } => {
                if self.rng.chance(faults.drop_message) {
                    return;
                }
                let copies = if self.rng.chance(faults.duplicate_message) { 2 } else { 1 };
                for _ in 0..copies {
                    let mut delay = self.rng.below(2 * TICK);
                    if self.rng.chance(faults.late_message) {
                        delay += self.rng.below(300 * TICK);
                    }
                    let frozen = self.nodes[node].frozen_until.saturating_sub(self.now);
                    let action =
                        Action::Message { to: 1 - node, link_epoch: self.link_epoch, message: message.clone() };
                    self.schedule(delay + frozen, action);
                }
            }
            Command::Submit { xfer, segments, .. } => {
                let bytes: u64 = segments.iter().map(|s| s.len).sum();
                self.nodes[node].live_submits.insert(xfer.0, bytes);
                let frozen = self.nodes[node].frozen_until.saturating_sub(self.now);
                let delay = frozen + self.rng.below(20 * TICK);
                if self.rng.chance(faults.plugin_silent) {
                    return;
                }
                let event = if self.rng.chance(faults.plugin_fail) {
                    self.failure_event(node, xfer)
                } else if self.rng.chance(faults.plugin_unknown_kind) {
                    let mut event = Event::progress(xfer, 0);
                    event.kind = EventKind(77);
                    event
                } else {
                    Event::succeeded(xfer, bytes)
                };
                if self.rng.chance(faults.plugin_duplicate) {
                    let late = delay + self.rng.below(50 * TICK);
                    self.schedule(late, Action::Plugin { node, event: event.clone() });
                }
                self.schedule(delay, Action::Plugin { node, event });
            }
            Command::Cancel { xfer, .. } => {
                if self.rng.chance(faults.cancel_ignored) {
                    return;
                }
                let event = self.failure_event(node, xfer);
                let delay = self.rng.below(5 * TICK);
                self.schedule(delay, Action::Plugin { node, event });
            }
            Command::ExpectIncoming { .. } => {}
            // Counted in the metrics, which the run checks.
            Command::Violation(_) => {}
            Command::CancelIncoming { peer, ticket, .. } => {
                if self.rng.chance(500_000) {
                    let delay = self.rng.below(5 * TICK);
                    self.schedule(delay, Action::Plugin { node, event: Event::incoming_quiesced(peer, ticket) });
                }
            }
        }
    }

    /// A FAILED event, quiesced on it, later, or (faults on) never.
    fn failure_event(&mut self, node: usize, xfer: XferId) -> Event {
        if self.rng.chance(500_000) {
            return Event::failed_quiesced(xfer, ReasonCode::CANCELLED, "sim");
        }
        if !self.rng.chance(self.faults.separate_quiesce_lost) {
            let delay = self.rng.below(30 * TICK);
            self.schedule(delay, Action::Plugin { node, event: Event::quiesced(xfer) });
        }
        Event::failed(xfer, ReasonCode::TRANSPORT_ERROR, "sim")
    }

    /// Check every engine event as it comes out.
    fn observe(&mut self, node: usize, event: RoomEvent) {
        let key = (node, event.room(), event.role());
        let now = self.now;
        let seed_note = "replay with KVGATE_SIM_SEED";
        match event {
            RoomEvent::StateChanged { .. } => {
                let obs =
                    self.observations.entry(key).or_insert_with(|| Observation { created: now, ..Default::default() });
                if obs.created == now && obs.terminals == 0 && obs.reusables == 0 {
                    self.live_fifo.push_back((now, key.0, key.1, key.2));
                }
                assert_eq!(obs.terminals, 0, "state change after terminal: {key:?} ({seed_note})");
            }
            RoomEvent::PartSucceeded { .. } => {
                let obs = self.observations.get(&key).expect("part of a known room");
                assert_eq!(obs.terminals, 0, "part after terminal: {key:?}");
            }
            RoomEvent::Terminal { outcome, .. } => {
                let obs = self.observations.get_mut(&key).expect("terminal of a known room");
                obs.terminals += 1;
                assert_eq!(obs.terminals, 1, "exactly one terminal per room: {key:?} ({seed_note})");
                assert!(now - obs.created <= self.live_bound, "room {key:?} terminal past its deadline");
                obs.terminal_at = Some(now);
                obs.succeeded = outcome == Outcome::Succeeded;
                self.quarantine_fifo.push_back((now, key.0, key.1, key.2));
            }
            RoomEvent::Reusable { .. } => {
                let obs = self.observations.get_mut(&key).expect("reusable of a known room");
                obs.reusables += 1;
                assert_eq!(obs.reusables, 1, "exactly one reusable: {key:?}");
                let terminal = obs.terminal_at.expect("reusable only after terminal");
                assert!(now - terminal <= self.reusable_bound, "quarantine past its bound: {key:?}");
            }
        }
    }

    /// The oldest live room and the oldest quarantine must be within their bounds (O(1) amortised).
    fn check_bounds(&mut self) {
        while let Some(&(created, node, room, role)) = self.live_fifo.front() {
            let obs = &self.observations[&(node, room, role)];
            if obs.terminals > 0 || obs.created != created {
                self.live_fifo.pop_front();
                continue;
            }
            assert!(self.now - created <= self.live_bound, "room {room:?} on node {node} live past its deadline");
            break;
        }
        while let Some(&(terminal, node, room, role)) = self.quarantine_fifo.front() {
            let obs = &self.observations[&(node, room, role)];
            if obs.reusables > 0 || obs.terminal_at != Some(terminal) {
                self.quarantine_fifo.pop_front();
                continue;
            }
            assert!(self.now - terminal <= self.reusable_bound, "room {room:?} quarantined past its bound");
            break;
        }
    }

    fn inject_node_faults(&mut self) {
        if self.rng.chance(self.faults.freeze) {
            let node = self.rng.below(2) as usize;
            self.nodes[node].frozen_until = self.now + self.rng.below(400 * TICK);
        }
        if self.rng.chance(self.faults.kill) {
            // The link dies: both sides see the peer lost, the victim restarts with a new incarnation.
            let victim = self.rng.below(2) as usize;
            self.link_epoch += 1;
            self.nodes[victim].peer_incarnation += 1;
            let now = At(self.now);
            for node in 0..2 {
                self.nodes[node].core.handle_peer_lost(now, peer_of(1 - node), PeerLoss::LinkClosed);
                self.drain(node);
            }
            let back = self.rng.below(50 * TICK);
            self.schedule(back, Action::PeerBack { node: 0 });
            self.schedule(back, Action::PeerBack { node: 1 });
        }
        if self.rng.chance(self.faults.abort_storm) {
            let node = self.rng.below(2) as usize;
            let live: Vec<(RoomKey, Role)> = self.nodes[node]
                .core
                .rooms(At(self.now))
                .filter(|view| !view.state.is_terminal())
                .map(|view| (view.room, view.role))
                .collect();
            for (room, role) in live {
                let request = EngineRequest::Abort { room, role: Some(role) };
                let _ = self.nodes[node].core.handle_engine(At(self.now), request);
                self.drain(node);
            }
        }
    }

    /// Run one step: the earliest of a scheduled action and a core timer.
    fn step(&mut self) -> bool {
        let next_action = self.heap.peek().map(|s| s.at);
        let timers = [self.nodes[0].core.poll_timeout(), self.nodes[1].core.poll_timeout()];
        let next_timer = timers.iter().flatten().map(|t| t.0).min();
        let (at, is_timer) = match (next_action, next_timer) {
            (None, None) => return false,
            (Some(a), Some(t)) if t < a => (t, true),
            (Some(a), _) => (a, false),
            (None, Some(t)) => (t, true),
        };
        self.now = self.now.max(at);
        self.steps += 1;
        if is_timer {
            for node in 0..2 {
                self.nodes[node].core.handle_timeout(At(self.now));
                self.drain(node);
            }
        } else {
            let scheduled = self.heap.pop().unwrap();
            self.run(scheduled.action);
        }
        self.check_bounds();
        true
    }

    fn run(&mut self, action: Action) {
        let now = At(self.now);
        match action {
            Action::Engine { node, request } => {
                let _ = self.nodes[node].core.handle_engine(now, request);
                self.drain(node);
            }
            Action::Message { to, link_epoch, message } => {
                if link_epoch != self.link_epoch {
                    return; // sent on a link that has since died
                }
                self.nodes[to].core.handle_peer_message(now, peer_of(1 - to), &message);
                self.drain(to);
            }
            Action::Plugin { node, event } => {
                if event.is_terminal() {
                    self.nodes[node].live_submits.remove(&event.xfer.0);
                }
                self.nodes[node].core.handle_plugin_event(now, SLOT, &event);
                self.drain(node);
            }
            Action::PeerBack { node } => {
                self.connect(node);
                self.drain(node);
            }
        }
    }
}

fn run_simulation(seed: u64, rooms: u64) {
    println!(
        "kvgate-core simulation: seed {seed}, {rooms} rooms (replay: KVGATE_SIM_SEED={seed} KVGATE_SIM_ROOMS={rooms})"
    );
    let mut sim = Sim::new(seed);
    // Safety phase: rooms arrive every 0-100 µs with every fault on.
    let mut next_room = 0u64;
    let mut next_arrival = 0u64;
    while next_room < rooms {
        if sim.now >= next_arrival {
            sim.start_room(next_room);
            next_room += 1;
            next_arrival = sim.now + sim.rng.below(100_000);
            sim.inject_node_faults();
            continue;
        }
        let before = sim.now;
        if !sim.step() || sim.now > next_arrival {
            sim.now = sim.now.max(before).max(next_arrival);
        }
    }
    // Liveness phase: heal everything, then every room must end within its bounds.
    sim.faults = HEALED;
    for node in 0..2 {
        sim.nodes[node].frozen_until = 0;
    }
    let heal_at = sim.now;
    while sim.step() {
        assert!(sim.steps < 100 * rooms + 10_000_000, "livelock ({seed})");
    }
    let settle_bound = heal_at + 10 * sim.live_bound + 2 * sim.reusable_bound + 3_000 * TICK;
    assert!(sim.now <= settle_bound, "the simulation did not settle in time (seed {seed})");
    let mut succeeded = 0u64;
    let mut failed = 0u64;
    for ((node, room, role), obs) in &sim.observations {
        assert_eq!(obs.terminals, 1, "room {room:?} ({role:?}) on node {node} never terminal (seed {seed})");
        assert_eq!(obs.reusables, 1, "room {room:?} ({role:?}) on node {node} never reusable (seed {seed})");
        if obs.succeeded {
            succeeded += 1;
            if *role == Role::Receiver {
                // No fail-open: a receiver success means the sender's transfers all succeeded.
                let sender = sim.observations.get(&(1 - node, *room, Role::Sender));
                assert!(sender.is_some_and(|s| s.succeeded), "receiver {room:?} succeeded without its sender");
            }
        } else {
            failed += 1;
        }
    }
    for node in 0..2 {
        let core = &sim.nodes[node].core;
        assert_eq!(core.live_rooms(), 0, "live rooms left (seed {seed})");
        assert_eq!(core.metrics().quarantined_bytes, 0);
        assert_eq!(core.metrics().pending_sends, 0);
        assert_eq!(core.held_rooms(), 0, "tombstones left after their ttl (seed {seed})");
        assert_eq!(core.armed_timers(), 0, "timers left (seed {seed})");
    }
    let metrics = [sim.nodes[0].core.metrics(), sim.nodes[1].core.metrics()];
    let violations: u64 = metrics.iter().map(|m| m.violations_total()).sum();
    let late: u64 = metrics.iter().map(|m| m.late_total()).sum();
    println!(
        "rooms started {}, room sides observed {}: succeeded {succeeded}, failed {failed}; violations {violations}, late {late}, steps {}",
        sim.rooms_started,
        sim.observations.len(),
        sim.steps
    );
    assert!(succeeded > 0 && failed > 0, "the run exercised both outcomes");
    assert!(violations > 0 && late > 0, "the faults reached the core");
}

#[test]
fn simulation_safety_then_liveness() {
    let seed = std::env::var("KVGATE_SIM_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x6b76_6761_7465);
    let rooms = std::env::var("KVGATE_SIM_ROOMS").ok().and_then(|s| s.parse().ok()).unwrap_or(100_000);
    run_simulation(seed, rooms);
}

#[test]
fn simulation_small_runs_over_several_seeds() {
    for seed in 1..=5u64 {
        run_simulation(seed * 7_919, 2_000);
    }
}
