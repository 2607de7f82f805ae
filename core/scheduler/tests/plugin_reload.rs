//! A plugin reload changes the plugins a peer is reached through without the peer going down:
//! new rooms get the new instance, a room that started on the retired one keeps it (its notice
//! is still accepted and its tickets are revoked there), and a retired instance is never chosen.

use kvgate_abi::{Event, MemoryKind};
use kvgate_core::*;

const OLD: PluginSlot = PluginSlot(0);
const NEW: PluginSlot = PluginSlot(1);
const PEER: PeerId = PeerId(7);
const LEN: u64 = 1 << 16;

fn now() -> At {
    At::from_origin(Span::from_ms(1_000))
}

fn host(slot: PluginSlot) -> PeerPlugin {
    PeerPlugin { slot, memory_kinds: MemoryKind::HOST.bit() }
}

fn drain(core: &mut Core) -> Vec<Command> {
    std::iter::from_fn(|| core.poll_command()).collect()
}

fn part(region: u64, len: u64) -> Vec<Slice> {
    vec![Slice::new(RegionId(region), 0, len)]
}

fn tickets(commands: &[Command]) -> Vec<PluginSlot> {
    commands
        .iter()
        .filter_map(|c| if let Command::ExpectIncoming { plugin, .. } = c { Some(*plugin) } else { None })
        .collect()
}

/// A receiver whose region 1 is registered with both instances.
fn receiver() -> Core {
    let mut core = Core::new(CoreConfig::default()).unwrap();
    core.handle_peer_up_with(now(), PEER, 1, &[host(OLD)]);
    let keys = vec![(OLD, LocalKey(10)), (NEW, LocalKey(11))];
    core.handle_region_registered(now(), RegionInfo { id: RegionId(1), len: LEN, memory_kind: MemoryKind::HOST, keys });
    core
}

#[test]
fn new_rooms_take_the_new_instance_and_a_started_room_keeps_the_retired_one() {
    let mut core = receiver();
    core.handle_expect(now(), RoomKey::new(1, 0), PEER, &[part(1, 64)], None).unwrap();
    assert_eq!(tickets(&drain(&mut core)), [OLD]);

    core.handle_peer_plugins(now(), PEER, &[host(NEW)], &[OLD]);
    core.handle_expect(now(), RoomKey::new(2, 0), PEER, &[part(1, 64)], None).unwrap();
    assert_eq!(tickets(&drain(&mut core)), [NEW], "a new room is given the new instance");
    assert_eq!(
        core.room(now(), RoomKey::new(1, 0), Role::Receiver).unwrap().plugin,
        Some(OLD),
        "the started room keeps its instance"
    );

    // The started room ends: its ticket is revoked on the instance it was opened on.
    core.handle_peer_message(now(), PEER, &PeerMessage::PartDone { room: RoomKey::new(1, 0), part: 0, bytes: 64 });
    let revoked: Vec<PluginSlot> = drain(&mut core)
        .iter()
        .filter_map(|c| if let Command::CancelIncoming { plugin, .. } = c { Some(*plugin) } else { None })
        .collect();
    assert_eq!(revoked, [OLD]);
    assert_eq!(core.room(now(), RoomKey::new(1, 0), Role::Receiver).unwrap().state, RoomState::Succeeded);
}

#[test]
fn a_notice_may_name_a_retired_instance_but_not_one_the_peer_was_never_given() {
    let mut sender = Core::new(CoreConfig::default()).unwrap();
    sender.handle_peer_up_with(now(), PEER, 1, &[host(OLD)]);
    sender.handle_region_registered(
        now(),
        RegionInfo {
            id: RegionId(5),
            len: LEN,
            memory_kind: MemoryKind::HOST,
            keys: vec![(OLD, LocalKey(50)), (NEW, LocalKey(51))],
        },
    );
    for slot in [OLD, NEW] {
        sender.handle_remote_region_key(now(), PEER, RegionId(1), LEN, slot, RemoteKey(100 + slot.0 as u64));
    }
    sender.handle_peer_plugins(now(), PEER, &[host(NEW)], &[OLD]);
    let notice = |room: u64, plugin: PluginSlot| PeerMessage::ExpectNotice {
        room: RoomKey::new(room, 0),
        parts: vec![part(1, 64)],
        tickets: vec![Ticket(room)],
        plugins: vec![plugin],
        timeout: Span::from_ms(1_000),
    };
    sender.handle_peer_message(now(), PEER, &notice(1, OLD));
    sender.handle_send(now(), RoomKey::new(1, 0), Some(PEER), 0, 0, &part(5, 64), true).unwrap();
    let submitted: Vec<(PluginSlot, RemoteKey)> = drain(&mut sender)
        .iter()
        .filter_map(|c| {
            if let Command::Submit { plugin, segments, .. } = c {
                Some((*plugin, segments[0].remote))
            } else {
                None
            }
        })
        .collect();
    assert_eq!(submitted, [(OLD, RemoteKey(100))], "the retired instance finishes the room it was named for");

    // Once retired instances are dropped too, a notice naming one fails its room with the reason.
    sender.handle_peer_plugins(now(), PEER, &[host(NEW)], &[]);
    sender.handle_peer_message(now(), PEER, &notice(2, OLD));
    let commands = drain(&mut sender);
    assert!(
        commands.iter().any(|c| matches!(
            c,
            Command::ToPeer { message: PeerMessage::RoomFailed { reason: FailReason::NoPluginForMemory, .. }, .. }
        )),
        "{commands:?}"
    );
}

#[test]
fn an_unhealthy_retired_instance_fails_the_rooms_of_its_peers() {
    let mut core = receiver();
    core.handle_expect(now(), RoomKey::new(1, 0), PEER, &[part(1, 64)], None).unwrap();
    drain(&mut core);
    core.handle_peer_plugins(now(), PEER, &[host(NEW)], &[OLD]);
    core.handle_plugin_event(now(), OLD, &Event::unhealthy(kvgate_abi::ReasonCode::PANIC, "worker died"));
    let view = core.room(now(), RoomKey::new(1, 0), Role::Receiver).unwrap();
    assert!(view.state.is_terminal(), "{view:?}");
    assert_eq!(view.failure.map(|f| f.reason), Some(FailReason::PluginFailed));
}

#[test]
fn an_update_for_a_peer_that_is_not_up_changes_nothing() {
    let mut core = receiver();
    core.handle_peer_plugins(now(), PeerId(99), &[host(NEW)], &[]);
    core.handle_expect(now(), RoomKey::new(1, 0), PEER, &[part(1, 64)], None).unwrap();
    assert_eq!(tickets(&drain(&mut core)), [OLD]);
    assert!(core.handle_expect(now(), RoomKey::new(2, 0), PeerId(99), &[part(1, 64)], None).is_err());
}
