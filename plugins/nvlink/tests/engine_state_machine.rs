//! The transfer engine against a host-memory fake of the GPU: one terminal event per transfer,
//! SUCCEEDED only after every copy finished, cancel and timeout between chunks, QUIESCED once the
//! issued copies finished, bounded copies in flight, device errors reported, and a seeded random
//! run of many lifecycles that must end with nothing live.

use kvgate_abi::{event_flags, Event, EventKind, PeerId, ReasonCode, XferId};
use kvgate_plugin_nvlink::chunk_plan::CopyOp;
use kvgate_plugin_nvlink::engine::*;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// A fake GPU: copies land in `memory` when their fence completes, `polls_to_complete` polls
/// after issue. Failures can be injected.
#[derive(Default)]
struct FakeGpu {
    memory: HashMap<u64, u8>,
    next_fence: u64,
    polls_to_complete: u32,
    pending: HashMap<u64, (CopyOp, u32)>,
    issued: Vec<CopyOp>,
    fail_issue_at: Option<usize>,
    fail_poll_of_issue: Option<usize>,
    issue_index_of: HashMap<u64, usize>,
    max_outstanding: usize,
    /// Completion after 0..=4 polls, varying per fence (copies finish out of order).
    vary_polls: bool,
}

impl CopyBackend for FakeGpu {
    type Fence = u64;
    fn issue(&mut self, op: &CopyOp, _lane: Lane) -> Result<u64, String> {
        if self.fail_issue_at == Some(self.issued.len()) {
            return Err("injected issue failure".into());
        }
        let id = self.next_fence;
        self.next_fence += 1;
        self.issue_index_of.insert(id, self.issued.len());
        self.issued.push(*op);
        let polls = if self.vary_polls { (id.wrapping_mul(2_654_435_761) % 5) as u32 } else { self.polls_to_complete };
        self.pending.insert(id, (*op, polls));
        self.max_outstanding = self.max_outstanding.max(self.pending.len());
        Ok(id)
    }
    fn poll(&mut self, fence: &u64) -> Result<bool, String> {
        if self.fail_poll_of_issue == Some(self.issue_index_of[fence]) {
            self.pending.remove(fence);
            return Err("injected device fault".into());
        }
        let (op, left) = self.pending.get_mut(fence).expect("polled an unknown fence");
        if *left > 0 {
            *left -= 1;
            return Ok(false);
        }
        let op = *op;
        for i in 0..op.len {
            let v = self.memory.get(&(op.src + i)).copied().unwrap_or(0);
            self.memory.insert(op.dst + i, v);
        }
        self.pending.remove(fence);
        Ok(true)
    }
    fn recycle(&mut self, _fence: u64) {}
}

fn ops(n: u64, chunk: u64) -> Vec<CopyOp> {
    (0..n).map(|i| CopyOp { src: i * chunk, dst: 1_000_000 + i * chunk, len: chunk, device_index: 0 }).collect()
}

fn transfer(xfer: u64, peer: u64, ops: Vec<CopyOp>, deadline: Option<Instant>) -> NewTransfer {
    let total_bytes = ops.iter().map(|o| o.len).sum();
    NewTransfer { xfer: XferId(xfer), peer: PeerId(peer), deadline, ops, total_bytes, holds: Box::new(()) }
}

fn later() -> Option<Instant> {
    Some(Instant::now() + Duration::from_secs(3600))
}

/// Steps until idle (or `max_steps`), collecting events.
fn run(engine: &mut Engine<FakeGpu>, max_steps: usize) -> Vec<Event> {
    let mut events = Vec::new();
    for _ in 0..max_steps {
        if engine.is_idle() {
            break;
        }
        engine.step(Instant::now(), &mut events);
    }
    events
}

fn kinds(events: &[Event], xfer: u64) -> Vec<(EventKind, ReasonCode, bool)> {
    events
        .iter()
        .filter(|e| e.xfer == XferId(xfer))
        .map(|e| (e.kind, e.reason, e.flags & event_flags::QUIESCED != 0))
        .collect()
}

#[test]
fn a_transfer_succeeds_once_every_copy_finished_and_the_bytes_landed() {
    let mut gpu = FakeGpu { polls_to_complete: 2, ..FakeGpu::default() };
    for i in 0..40 {
        gpu.memory.insert(i, (i * 3 + 1) as u8);
    }
    let mut engine = Engine::new(gpu, 2, 2);
    engine.admit(transfer(1, 1, ops(4, 10), later()));
    let events = run(&mut engine, 100);
    assert_eq!(kinds(&events, 1), vec![(EventKind::SUCCEEDED, ReasonCode(0), false)]);
    assert_eq!(events[0].bytes, 40);
    let gpu = engine.backend_mut();
    for i in 0..40 {
        assert_eq!(gpu.memory[&(1_000_000 + i)], (i * 3 + 1) as u8, "byte {i}");
    }
    assert_eq!(gpu.max_outstanding, 2, "max_copies_in_flight_per_transfer bounds the window");
    assert!(engine.is_idle());
}

#[test]
fn a_transfer_without_copies_succeeds_at_once() {
    let mut engine = Engine::new(FakeGpu::default(), 4, 1);
    engine.admit(transfer(5, 1, vec![], later()));
    let events = run(&mut engine, 2);
    assert_eq!(kinds(&events, 5), vec![(EventKind::SUCCEEDED, ReasonCode(0), false)]);
    assert_eq!(events[0].bytes, 0);
}

#[test]
fn cancel_mid_transfer_fails_at_once_stops_issuing_and_quiesces_after_the_issued_copies() {
    let mut engine = Engine::new(FakeGpu { polls_to_complete: 3, ..FakeGpu::default() }, 2, 2);
    engine.admit(transfer(1, 1, ops(10, 100), later()));
    let mut events = Vec::new();
    engine.step(Instant::now(), &mut events);
    assert!(events.is_empty());
    assert_eq!(engine.counts(), EngineCounts { live: 1, unquiesced: 0, copies_in_flight: 2 });
    engine.fail(XferId(1), ReasonCode::CANCELLED, "host cancel");
    engine.step(Instant::now(), &mut events);
    assert_eq!(kinds(&events, 1), vec![(EventKind::FAILED, ReasonCode::CANCELLED, false)], "terminal at the next step");
    assert_eq!(engine.counts().unquiesced, 1);
    let rest = run(&mut engine, 100);
    events.extend(rest);
    assert_eq!(
        kinds(&events, 1),
        vec![(EventKind::FAILED, ReasonCode::CANCELLED, false), (EventKind::QUIESCED, ReasonCode(0), false)]
    );
    assert_eq!(engine.backend_mut().issued.len(), 2, "no chunk issued after the cancel");
    assert!(engine.backend_mut().pending.is_empty(), "quiesced only after every issued copy finished");
}

#[test]
fn cancel_with_nothing_on_the_device_is_failed_and_quiesced_in_one_event() {
    let mut engine = Engine::new(FakeGpu::default(), 2, 1);
    engine.admit(transfer(1, 1, ops(3, 10), later()));
    engine.fail(XferId(1), ReasonCode::CANCELLED, "before any copy");
    let events = run(&mut engine, 10);
    assert_eq!(kinds(&events, 1), vec![(EventKind::FAILED, ReasonCode::CANCELLED, true)]);
    assert!(engine.backend_mut().issued.is_empty());
}

#[test]
fn the_first_cause_wins_and_late_cancels_are_ignored() {
    let mut engine = Engine::new(FakeGpu { polls_to_complete: 5, ..FakeGpu::default() }, 1, 1);
    engine.admit(transfer(1, 1, ops(3, 10), later()));
    engine.admit(transfer(2, 1, ops(1, 10), later()));
    let mut events = Vec::new();
    engine.step(Instant::now(), &mut events);
    engine.fail(XferId(1), ReasonCode::CANCELLED, "first");
    engine.fail(XferId(1), ReasonCode::TIMEOUT, "second");
    events.extend(run(&mut engine, 100));
    assert_eq!(kinds(&events, 1)[0].1, ReasonCode::CANCELLED);
    engine.fail(XferId(2), ReasonCode::CANCELLED, "after success");
    engine.fail(XferId(99), ReasonCode::CANCELLED, "unknown");
    events.extend(run(&mut engine, 10));
    assert_eq!(kinds(&events, 2), vec![(EventKind::SUCCEEDED, ReasonCode(0), false)]);
}

#[test]
fn the_own_timeout_fails_the_transfer() {
    let mut engine = Engine::new(FakeGpu { polls_to_complete: 1_000_000, ..FakeGpu::default() }, 1, 1);
    // Far enough ahead that the first step is before it however slowly this thread runs.
    let deadline = Instant::now() + Duration::from_secs(60);
    engine.admit(transfer(1, 1, ops(2, 10), Some(deadline)));
    assert_eq!(engine.next_deadline(), Some(deadline));
    let mut events = Vec::new();
    engine.step(Instant::now(), &mut events);
    assert!(events.is_empty(), "not before the deadline");
    engine.step(deadline, &mut events);
    assert_eq!(kinds(&events, 1), vec![(EventKind::FAILED, ReasonCode::TIMEOUT, false)]);
    assert_eq!(engine.next_deadline(), None, "a failed transfer has no deadline left");
    assert_eq!(engine.backend_mut().issued.len(), 1);
}

#[test]
fn a_device_fault_fails_the_transfer_as_a_transport_error() {
    let mut engine = Engine::new(FakeGpu { fail_poll_of_issue: Some(1), ..FakeGpu::default() }, 4, 1);
    engine.admit(transfer(1, 1, ops(6, 10), later()));
    let events = run(&mut engine, 100);
    let k = kinds(&events, 1);
    assert_eq!(k[0].0, EventKind::FAILED);
    assert_eq!(k[0].1, ReasonCode::TRANSPORT_ERROR);
    assert!(k.len() == 1 && k[0].2 || k.len() == 2 && k[1].0 == EventKind::QUIESCED, "{k:?}");
    assert!(engine.is_idle());
}

#[test]
fn an_issue_failure_fails_the_transfer_and_quiesces_the_copies_already_issued() {
    let mut engine = Engine::new(FakeGpu { fail_issue_at: Some(2), polls_to_complete: 2, ..FakeGpu::default() }, 4, 1);
    engine.admit(transfer(1, 1, ops(6, 10), later()));
    let events = run(&mut engine, 100);
    assert_eq!(
        kinds(&events, 1),
        vec![(EventKind::FAILED, ReasonCode::TRANSPORT_ERROR, false), (EventKind::QUIESCED, ReasonCode(0), false)]
    );
}

#[test]
fn failing_a_peer_fails_only_its_transfers() {
    let mut engine = Engine::new(FakeGpu { polls_to_complete: 2, ..FakeGpu::default() }, 1, 1);
    engine.admit(transfer(1, 1, ops(2, 10), later()));
    engine.admit(transfer(2, 2, ops(2, 10), later()));
    engine.fail_all(Some(PeerId(1)), ReasonCode::PEER_LOST, "gone");
    let events = run(&mut engine, 100);
    assert_eq!(kinds(&events, 1)[0].1, ReasonCode::PEER_LOST);
    assert_eq!(kinds(&events, 2), vec![(EventKind::SUCCEEDED, ReasonCode(0), false)]);
}

#[test]
fn ten_thousand_random_lifecycles_end_with_one_terminal_each_and_nothing_live() {
    let seed: u64 = std::env::var("NVLINK_ENGINE_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x5eed_1234);
    println!("seed {seed} (replay with NVLINK_ENGINE_SEED={seed})");
    let mut state = seed | 1;
    let mut rnd = move |m: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % m
    };
    let mut engine = Engine::new(FakeGpu { vary_polls: true, ..FakeGpu::default() }, 3, 2);
    let mut events = Vec::new();
    let start = Instant::now();
    let mut submitted = 0u64;
    let mut now = start;
    while submitted < 10_000 || !engine.is_idle() {
        if submitted < 10_000 {
            for _ in 0..1 + rnd(4) {
                submitted += 1;
                let deadline = if rnd(20) == 0 { Some(now) } else { Some(now + Duration::from_secs(60)) };
                engine.admit(transfer(submitted, rnd(4), ops(rnd(6), 8), deadline));
            }
        }
        if rnd(3) == 0 && submitted > 0 {
            engine.fail(XferId(1 + rnd(submitted)), ReasonCode::CANCELLED, "random cancel");
        }
        if rnd(200) == 0 {
            engine.fail_all(Some(PeerId(rnd(4))), ReasonCode::PEER_LOST, "random peer loss");
        }
        now += Duration::from_micros(10);
        engine.step(now, &mut events);
        assert!(now < start + Duration::from_secs(3600), "livelock");
    }
    let mut per: HashMap<XferId, Vec<&Event>> = HashMap::new();
    for e in &events {
        per.entry(e.xfer).or_default().push(e);
    }
    assert_eq!(per.len() as u64, submitted, "every transfer reported");
    for (xfer, evs) in per {
        let terminals = evs.iter().filter(|e| e.is_terminal()).count();
        assert_eq!(terminals, 1, "transfer {xfer:?}: {evs:?}");
        assert!(evs[0].is_terminal(), "terminal comes first: {evs:?}");
        let quiesced = evs.iter().filter(|e| e.kind == EventKind::QUIESCED).count();
        match evs[0].kind {
            EventKind::SUCCEEDED => assert_eq!(evs.len(), 1),
            _ if evs[0].flags & event_flags::QUIESCED != 0 => assert_eq!(evs.len(), 1),
            _ => assert_eq!((evs.len(), quiesced), (2, 1), "{evs:?}"),
        }
    }
    assert_eq!(engine.counts(), EngineCounts::default());
    assert!(engine.backend_mut().pending.is_empty());
}
