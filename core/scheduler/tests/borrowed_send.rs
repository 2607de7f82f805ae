//! `Core::handle_send` / `handle_expect` (slices borrowed, executed commands recycled) against
//! `handle_engine(EngineRequest::Send / Expect {..})` (owned, nothing recycled): the same script of
//! expects and sends, held before and after the expect notice, accepted and refused, must give the
//! same results, the same commands in the same order and the same metrics.

use kvgate_core::*;

const A: PeerId = PeerId(1);
const B: PeerId = PeerId(2);
const SLOT: PluginSlot = PluginSlot(0);
const REGION: RegionId = RegionId(1);
const UNKNOWN_REGION: RegionId = RegionId(9);

struct Pair {
    now: At,
    receiver: Core,
    sender: Core,
    /// Every command of both cores, in the order the driver saw them.
    log: Vec<Command>,
    borrowed: bool,
}

impl Pair {
    fn new(borrowed: bool) -> Pair {
        let now = At::from_origin(Span::from_ms(1));
        let config = CoreConfig { max_chunks_per_part: 4, ..CoreConfig::default() };
        let mut receiver = Core::new(config.clone()).unwrap();
        let mut sender = Core::new(config).unwrap();
        receiver.handle_peer_up(now, B, 1, SLOT);
        sender.handle_peer_up(now, A, 1, SLOT);
        for core in [&mut receiver, &mut sender] {
            let info = RegionInfo {
                id: REGION,
                len: 1 << 20,
                memory_kind: kvgate_abi::MemoryKind::HOST,
                keys: vec![(SLOT, LocalKey(1))],
            };
            core.handle_region_registered(now, info);
        }
        sender.handle_remote_region(now, A, REGION, 1 << 20, RemoteKey(2));
        Pair { now, receiver, sender, log: Vec::new(), borrowed }
    }

    fn send(&mut self, room: RoomKey, part: u32, chunk: u32, slices: &[Slice], last: bool) -> Result<(), Refusal> {
        let result = if self.borrowed {
            self.sender.handle_send(self.now, room, Some(A), part, chunk, slices, last)
        } else {
            let request = EngineRequest::Send { room, peer: Some(A), part, chunk, slices: slices.to_vec(), last };
            self.sender.handle_engine(self.now, request)
        };
        self.pump();
        result
    }

    fn expect(&mut self, room: RoomKey, parts: Vec<Vec<Slice>>, timeout_ms: Option<u64>) -> Result<(), Refusal> {
        let result = if self.borrowed {
            let borrowed: Vec<&[Slice]> = parts.iter().map(|part| &part[..]).collect();
            self.receiver.handle_expect(self.now, room, B, &borrowed, timeout_ms)
        } else {
            self.receiver.handle_engine(self.now, EngineRequest::Expect { room, peer: B, parts, timeout_ms })
        };
        self.pump();
        result
    }

    /// Deliver peer messages both ways and succeed every submit.
    fn pump(&mut self) {
        loop {
            let mut moved = false;
            while let Some(command) = self.receiver.poll_command() {
                moved = true;
                self.log.push(command.clone());
                if let Command::ToPeer { message, .. } = &command {
                    self.sender.handle_peer_message(self.now, A, message);
                }
                // The borrowed run hands executed commands back, so later notices reuse buffers.
                if self.borrowed {
                    self.receiver.recycle_command(command);
                }
            }
            while let Some(command) = self.sender.poll_command() {
                moved = true;
                self.log.push(command.clone());
                match command {
                    Command::ToPeer { message, .. } => self.receiver.handle_peer_message(self.now, B, &message),
                    Command::Submit { xfer, segments, .. } => {
                        let bytes = segments.iter().map(|s| s.len).sum();
                        self.sender.handle_plugin_event(self.now, SLOT, &kvgate_abi::Event::succeeded(xfer, bytes));
                    }
                    _ => {}
                }
            }
            if !moved {
                return;
            }
        }
    }
}

/// The script: every outcome it produced.
fn run(borrowed: bool) -> (Vec<Result<(), Refusal>>, Vec<Command>, Metrics) {
    let mut pair = Pair::new(borrowed);
    let slice = |offset, len| Slice::new(REGION, offset, len);
    let held = RoomKey::new(1, 0);
    let direct = RoomKey::new(2, 0);
    let mut results = vec![
        // Held before the expect notice (the core copies borrowed slices), in two chunks.
        pair.send(held, 0, 0, &[slice(0, 100), slice(4096, 28)], false),
        pair.send(held, 0, 1, &[slice(8192, 128)], true),
        // Refused: empty, unknown region, out of range, duplicate, after last.
        pair.send(held, 0, 2, &[], true),
        pair.send(held, 0, 2, &[Slice::new(UNKNOWN_REGION, 0, 8)], true),
        pair.send(held, 0, 2, &[slice(1 << 20, 8)], true),
        pair.send(held, 0, 0, &[slice(0, 8)], false),
        pair.send(held, 0, 2, &[slice(0, 8)], true),
    ];
    // The expect arrives: the held chunks are submitted and the room succeeds.
    results.extend([
        pair.expect(held, vec![vec![slice(0, 200), slice(1000, 56)]], None),
        pair.expect(direct, vec![vec![slice(0, 64)], vec![slice(64, 64)]], Some(5_000)),
        // Refused expects: duplicate, empty part, no parts, unknown region, out of range, zero timeout.
        pair.expect(direct, vec![vec![slice(0, 64)]], None),
        pair.expect(RoomKey::new(7, 0), vec![vec![slice(0, 8)], vec![]], None),
        pair.expect(RoomKey::new(7, 0), vec![], None),
        pair.expect(RoomKey::new(7, 0), vec![vec![Slice::new(UNKNOWN_REGION, 0, 8)]], None),
        pair.expect(RoomKey::new(7, 0), vec![vec![slice(1 << 20, 8)]], None),
        pair.expect(RoomKey::new(7, 0), vec![vec![slice(0, 8)]], Some(0)),
        // A third room with three parts of different sizes, after the buffers of two notices were
        // handed back (borrowed run): the reused buffers must carry exactly this room's slices.
        pair.expect(
            RoomKey::new(8, 0),
            vec![vec![slice(0, 8), slice(16, 8), slice(32, 8)], vec![slice(64, 8)], vec![slice(128, 8)]],
            None,
        ),
    ]);
    results.extend([
        // After the notice: placed and submitted at once.
        pair.send(direct, 0, 0, &[slice(500, 64)], true),
        // Refused: a length that overflows the destination, a part past the notice's count.
        pair.send(direct, 1, 0, &[slice(500, 65)], true),
        pair.send(direct, 2, 0, &[slice(500, 8)], true),
        pair.send(direct, 1, 0, &[slice(0, 32), slice(900, 32)], true),
        // Late: the room is over, then a stale generation.
        pair.send(held, 0, 2, &[slice(0, 8)], true),
        pair.send(RoomKey::new(2, 0), 1, 1, &[slice(0, 8)], true),
    ]);
    results.push(pair.expect(RoomKey::new(3, 5), vec![vec![slice(0, 8)]], None));
    results.push(pair.send(RoomKey::new(3, 4), 0, 0, &[slice(0, 8)], true));
    // One part after notices of three parts: the reused part list must shrink to one.
    results.push(pair.expect(RoomKey::new(9, 0), vec![vec![slice(256, 8)]], None));
    let mut metrics = pair.sender.metrics().clone();
    // Both cores' counters (refusals of expects live in the receiver's).
    let receiver = pair.receiver.metrics();
    for (sum, add) in metrics.refusals.iter_mut().zip(&receiver.refusals) {
        *sum += add;
    }
    metrics.rooms_created += receiver.rooms_created;
    (results, pair.log, metrics)
}

#[test]
fn borrowed_and_owned_sends_and_expects_give_the_same_results_commands_and_metrics() {
    let (owned_results, owned_log, owned_metrics) = run(false);
    let (borrowed_results, borrowed_log, borrowed_metrics) = run(true);
    assert_eq!(borrowed_results, owned_results);
    assert_eq!(borrowed_log, owned_log);
    assert_eq!(borrowed_metrics, owned_metrics);
    // The script exercised what it claims: held and direct submits, refusals and late sends.
    let refused: Vec<RefusalReason> = owned_results.iter().filter_map(|r| r.err().map(|e| e.reason)).collect();
    for reason in [
        RefusalReason::EmptyRequest,
        RefusalReason::UnknownRegion,
        RefusalReason::SliceOutOfRange,
        RefusalReason::DuplicateChunk,
        RefusalReason::ChunkAfterLast,
        RefusalReason::LengthMismatch,
        RefusalReason::UnknownPart,
        RefusalReason::RoomTerminal,
        RefusalReason::StaleGeneration,
        RefusalReason::DuplicateExpect,
        RefusalReason::InvalidTimeout,
    ] {
        assert!(refused.contains(&reason), "{reason:?} not exercised: {refused:?}");
    }
    assert_eq!(owned_metrics.submits, 4, "two held chunks and two direct chunks submitted");
    assert_eq!(owned_metrics.rooms_succeeded, 2);
    assert!(owned_metrics.late_total() >= 2);
}
