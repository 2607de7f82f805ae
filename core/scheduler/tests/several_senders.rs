//! A receiver room whose parts come from different peers (tensor-parallel prefill ranks behind two
//! gateways feeding one decode rank): each sender gets a notice naming only its own parts, sends
//! only those, and the room succeeds once every part is done; it fails as a whole when any part's
//! sender fails or is lost (every other sender is told), and its memory is released only once
//! every sender said nothing more can land.

use kvgate_abi::{Event, MemoryKind};
use kvgate_core::*;

const DECODE: PeerId = PeerId(1);
const A: PeerId = PeerId(2);
const B: PeerId = PeerId(3);
const PLUGIN: PluginSlot = PluginSlot(0);
const LEN: u64 = 1 << 16;
const PART: u64 = 4096;

fn now() -> At {
    At::from_origin(Span::from_ms(1_000))
}

fn region(core: &mut Core, id: u64) {
    let info =
        RegionInfo { id: RegionId(id), len: LEN, memory_kind: MemoryKind::HOST, keys: vec![(PLUGIN, LocalKey(id))] };
    core.handle_region_registered(now(), info);
}

fn drain(core: &mut Core) -> Vec<Command> {
    std::iter::from_fn(|| core.poll_command()).collect()
}

/// The decode gateway (linked to A and B) and the two prefill gateways (each linked to decode).
fn cluster() -> (Core, Core, Core) {
    let mut decode = Core::new(CoreConfig::default()).unwrap();
    decode.handle_peer_up(now(), A, 1, PLUGIN);
    decode.handle_peer_up(now(), B, 1, PLUGIN);
    region(&mut decode, 1);
    let mut prefills = [A, B].map(|_| {
        let mut core = Core::new(CoreConfig::default()).unwrap();
        core.handle_peer_up(now(), DECODE, 1, PLUGIN);
        core.handle_remote_region(now(), DECODE, RegionId(1), LEN, RemoteKey(1));
        region(&mut core, 10);
        core
    });
    let [a, b] = std::mem::replace(
        &mut prefills,
        [Core::new(CoreConfig::default()).unwrap(), Core::new(CoreConfig::default()).unwrap()],
    );
    (decode, a, b)
}

/// A two-part room: part 0 from A, part 1 from B. Returns each sender's notice.
fn expect(decode: &mut Core, room: RoomKey) -> (PeerMessage, PeerMessage) {
    let parts = [vec![Slice::new(RegionId(1), 0, PART)], vec![Slice::new(RegionId(1), PART, PART)]];
    decode
        .handle_expect_from(now(), room, A, &parts, ExpectShape { part_peers: &[A, B], ..Default::default() }, None)
        .unwrap();
    let commands = drain(decode);
    let incoming: Vec<PeerId> = commands
        .iter()
        .filter_map(|c| match c {
            Command::ExpectIncoming { peer, .. } => Some(*peer),
            _ => None,
        })
        .collect();
    assert_eq!(incoming, [A, B], "each part's ticket admits its own sender");
    let mut notices = commands.into_iter().filter_map(|c| match c {
        Command::ToPeer { peer, message: message @ PeerMessage::ExpectNotice { .. } } => Some((peer, message)),
        _ => None,
    });
    let (to_a, a) = notices.next().expect("a notice to A");
    let (to_b, b) = notices.next().expect("a notice to B");
    assert_eq!((to_a, to_b), (A, B));
    assert!(notices.next().is_none());
    (a, b)
}

fn own_parts(notice: &PeerMessage) -> Vec<usize> {
    let PeerMessage::ExpectNotice { parts, .. } = notice else { unreachable!() };
    parts.iter().enumerate().filter(|(_, p)| !p.is_empty()).map(|(i, _)| i).collect()
}

fn to_decode(decode: &mut Core, from: PeerId, sender: &mut Core) {
    for command in drain(sender) {
        if let Command::ToPeer { message, .. } = command {
            decode.handle_peer_message(now(), from, &message);
        }
    }
}

fn terminal(commands: &[Command]) -> Option<Outcome> {
    commands.iter().find_map(|c| match c {
        Command::ToEngine(RoomEvent::Terminal { outcome, .. }) => Some(*outcome),
        _ => None,
    })
}

#[test]
fn each_sender_moves_its_own_parts_and_the_room_succeeds_when_all_are_done() {
    let (mut decode, mut a, mut b) = cluster();
    let room = RoomKey::new(1, 0);
    let (notice_a, notice_b) = expect(&mut decode, room);
    assert_eq!(
        (own_parts(&notice_a), own_parts(&notice_b)),
        (vec![0], vec![1]),
        "each notice names only its sender's parts"
    );
    a.handle_peer_message(now(), DECODE, &notice_a);
    b.handle_peer_message(now(), DECODE, &notice_b);
    drain(&mut a);
    drain(&mut b);
    let src = [Slice::new(RegionId(10), 0, PART)];
    assert_eq!(
        a.handle_send(now(), room, Some(DECODE), 1, 0, &src, true).unwrap_err().reason,
        RefusalReason::UnknownPart,
        "B's part"
    );
    a.handle_send(now(), room, Some(DECODE), 0, 0, &src, true).unwrap();
    b.handle_send(now(), room, Some(DECODE), 1, 0, &src, true).unwrap();
    for sender in [&mut a, &mut b] {
        let xfer = drain(sender)
            .into_iter()
            .find_map(|c| match c {
                Command::Submit { xfer, .. } => Some(xfer),
                _ => None,
            })
            .expect("one submit");
        sender.handle_plugin_event(now(), PLUGIN, &Event::succeeded(xfer, PART));
    }
    // A's part done: the room goes on, waiting for B's. A's own room is complete.
    let mut a_out = drain(&mut a);
    assert_eq!(terminal(&a_out), Some(Outcome::Succeeded), "A sent all it had to");
    for command in a_out.drain(..) {
        if let Command::ToPeer { message, .. } = command {
            decode.handle_peer_message(now(), A, &message);
        }
    }
    assert_eq!(terminal(&drain(&mut decode)), None);
    // A part done for B's part, from A, changes nothing (late).
    let late = decode.metrics().late_messages.iter().sum::<u64>();
    decode.handle_peer_message(now(), A, &PeerMessage::PartDone { room, part: 1, bytes: PART });
    assert_eq!(decode.metrics().late_messages.iter().sum::<u64>(), late + 1);
    to_decode(&mut decode, B, &mut b);
    assert_eq!(terminal(&drain(&mut decode)), Some(Outcome::Succeeded));
}

#[test]
fn losing_one_sender_fails_the_room_and_the_other_sender_is_told() {
    let (mut decode, mut a, _) = cluster();
    let room = RoomKey::new(2, 0);
    let (notice_a, _) = expect(&mut decode, room);
    a.handle_peer_message(now(), DECODE, &notice_a);
    drain(&mut a);
    decode.handle_peer_lost(now(), B, PeerLoss::LinkClosed);
    let commands = drain(&mut decode);
    match terminal(&commands) {
        Some(Outcome::Failed(failure)) => assert_eq!(failure.reason, FailReason::PeerLost),
        other => panic!("{other:?}"),
    }
    let told: Vec<_> = commands
        .iter()
        .filter_map(|c| match c {
            Command::ToPeer { peer, message: PeerMessage::RoomFailed { reason, to, .. } } => {
                Some((*peer, *reason, *to))
            }
            _ => None,
        })
        .collect();
    assert_eq!(told, [(A, FailReason::PeerLost, Role::Sender)], "the sender still there is told why");
    for command in commands {
        if let Command::ToPeer { peer: A, message } = command {
            a.handle_peer_message(now(), DECODE, &message);
        }
    }
    match terminal(&drain(&mut a)) {
        Some(Outcome::Failed(failure)) => {
            assert_eq!((failure.reason, failure.peer_reason), (FailReason::ReceiverFailed, Some(FailReason::PeerLost)))
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_failure_from_one_sender_reaches_the_other_and_memory_waits_for_both_quiesces() {
    let (mut decode, _, _) = cluster();
    let room = RoomKey::new(3, 0);
    expect(&mut decode, room);
    decode.handle_peer_message(
        now(),
        A,
        &PeerMessage::RoomFailed { room, reason: FailReason::TransferTimeout, to: Role::Receiver },
    );
    let commands = drain(&mut decode);
    assert!(matches!(terminal(&commands), Some(Outcome::Failed(f)) if f.reason == FailReason::SenderFailed));
    assert!(
        commands.iter().any(|c| matches!(
            c,
            Command::ToPeer { peer: B, message: PeerMessage::RoomFailed { reason: FailReason::SenderFailed, .. } }
        )),
        "B is told: {commands:?}"
    );
    assert!(
        !commands.iter().any(|c| matches!(c, Command::ToPeer { peer: A, .. })),
        "A, which failed it, is not told again"
    );
    assert_eq!(decode.room(now(), room, Role::Receiver).unwrap().state, RoomState::Quarantined);
    decode.handle_peer_message(now(), A, &PeerMessage::Quiesced { room });
    assert_eq!(decode.room(now(), room, Role::Receiver).unwrap().state, RoomState::Quarantined, "B may still write");
    decode.handle_peer_message(now(), B, &PeerMessage::Quiesced { room });
    let released = drain(&mut decode)
        .iter()
        .any(|c| matches!(c, Command::ToEngine(RoomEvent::Reusable { cause: ReleaseCause::Quiesced, .. })));
    assert!(released, "reusable once both senders quiesced");
}

#[test]
fn an_engine_abort_reaches_every_sender_and_a_notice_without_own_parts_is_refused() {
    let (mut decode, mut a, _) = cluster();
    let room = RoomKey::new(4, 0);
    expect(&mut decode, room);
    decode.handle_engine(now(), EngineRequest::Abort { room, role: Some(Role::Receiver) }).unwrap();
    let told: Vec<PeerId> = drain(&mut decode)
        .into_iter()
        .filter_map(|c| match c {
            Command::ToPeer { peer, message: PeerMessage::Abort { .. } } => Some(peer),
            _ => None,
        })
        .collect();
    assert_eq!(told.len(), 2);
    assert!(told.contains(&A) && told.contains(&B));
    // A notice whose every part is another sender's cannot be served.
    let notice = PeerMessage::ExpectNotice {
        room: RoomKey::new(5, 0),
        parts: vec![vec![]],
        tickets: vec![Ticket(0)],
        plugins: vec![PluginSlot::NONE],
        timeout: Span::from_ms(1_000),
    };
    a.handle_peer_message(now(), DECODE, &notice);
    let commands = drain(&mut a);
    assert!(
        commands.iter().any(|c| matches!(
            c,
            Command::ToPeer { message: PeerMessage::RoomFailed { reason: FailReason::LayoutMismatch, .. }, .. }
        )),
        "{commands:?}"
    );
}
