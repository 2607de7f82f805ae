//! The plugin is chosen per part from the memory it moves, not once per peer: a peer connected
//! through a host-memory plugin and a device-memory plugin gets each part of a room through the
//! plugin that serves the part's destination regions and its source kind; the sender follows the
//! receiver's choice, refuses a chunk whose source the chosen plugin cannot read, and events from
//! the wrong plugin are violations.

use kvgate_abi::{Event, MemoryKind};
use kvgate_core::*;

const HOST_PLUGIN: PluginSlot = PluginSlot(0);
const DEVICE_PLUGIN: PluginSlot = PluginSlot(1);
const PEER: PeerId = PeerId(7);
const LEN: u64 = 1 << 16;

/// Host memory through slot 0 only; device memory through slot 1, which also serves host memory
/// (a plugin like UCX that moves both).
fn plugins() -> [PeerPlugin; 2] {
    [
        PeerPlugin { slot: HOST_PLUGIN, memory_kinds: MemoryKind::HOST.bit() },
        PeerPlugin { slot: DEVICE_PLUGIN, memory_kinds: MemoryKind::HOST.bit() | MemoryKind::CUDA_DEVICE.bit() },
    ]
}

fn now() -> At {
    At::from_origin(Span::from_ms(1_000))
}

fn register(core: &mut Core, id: u64, kind: MemoryKind, keys: &[PluginSlot]) {
    let keys = keys.iter().map(|&slot| (slot, LocalKey(id * 10 + slot.0 as u64))).collect();
    core.handle_region_registered(now(), RegionInfo { id: RegionId(id), len: LEN, memory_kind: kind, keys });
}

fn part(region: u64, len: u64) -> Vec<Slice> {
    vec![Slice::new(RegionId(region), 0, len)]
}

fn drain(core: &mut Core) -> Vec<Command> {
    std::iter::from_fn(|| core.poll_command()).collect()
}

/// Decode side: a host region (1) registered with the host plugin, a device region (2) with the
/// device plugin, a host region (3) with both.
fn decode() -> Core {
    let mut core = Core::new(CoreConfig::default()).unwrap();
    core.handle_peer_up_with(now(), PEER, 1, &plugins());
    register(&mut core, 1, MemoryKind::HOST, &[HOST_PLUGIN]);
    register(&mut core, 2, MemoryKind::CUDA_DEVICE, &[DEVICE_PLUGIN]);
    register(&mut core, 3, MemoryKind::HOST, &[HOST_PLUGIN, DEVICE_PLUGIN]);
    core
}

/// Prefill side: the same three regions as sources (11, 12, 13), and the decode side's regions
/// imported into the plugins each is registered with.
fn prefill() -> Core {
    let mut core = Core::new(CoreConfig::default()).unwrap();
    core.handle_peer_up_with(now(), PEER, 1, &plugins());
    register(&mut core, 11, MemoryKind::HOST, &[HOST_PLUGIN]);
    register(&mut core, 12, MemoryKind::CUDA_DEVICE, &[DEVICE_PLUGIN]);
    register(&mut core, 13, MemoryKind::HOST, &[HOST_PLUGIN, DEVICE_PLUGIN]);
    for (region, slots) in [(1u64, &[HOST_PLUGIN][..]), (2, &[DEVICE_PLUGIN]), (3, &[HOST_PLUGIN, DEVICE_PLUGIN])] {
        for &slot in slots {
            core.handle_remote_region_key(
                now(),
                PEER,
                RegionId(region),
                LEN,
                slot,
                RemoteKey(region * 100 + slot.0 as u64),
            );
        }
    }
    core
}

fn opened_tickets(commands: &[Command]) -> Vec<(PluginSlot, Ticket)> {
    commands
        .iter()
        .filter_map(|c| match c {
            Command::ExpectIncoming { plugin, ticket, .. } => Some((*plugin, *ticket)),
            _ => None,
        })
        .collect()
}

fn notice(commands: Vec<Command>) -> PeerMessage {
    commands
        .into_iter()
        .find_map(|c| match c {
            Command::ToPeer { message: message @ PeerMessage::ExpectNotice { .. }, .. } => Some(message),
            _ => None,
        })
        .expect("an expect notice")
}

fn submits(commands: &[Command]) -> Vec<(PluginSlot, XferId, u64, Vec<kvgate_abi::Segment>)> {
    commands
        .iter()
        .filter_map(|c| match c {
            Command::Submit { plugin, xfer, ticket, segments, .. } => {
                Some((*plugin, *xfer, ticket.0, segments.clone()))
            }
            _ => None,
        })
        .collect()
}

#[test]
fn each_part_of_a_room_goes_through_the_plugin_that_serves_its_memory() {
    let (mut decode, mut prefill) = (decode(), prefill());
    let room = RoomKey::new(1, 0);
    decode.handle_expect(now(), room, PEER, &[part(1, 4096), part(2, 8192)], None).unwrap();
    let commands = drain(&mut decode);
    let tickets = opened_tickets(&commands);
    assert_eq!(
        tickets.iter().map(|t| t.0).collect::<Vec<_>>(),
        [HOST_PLUGIN, DEVICE_PLUGIN],
        "one ticket per part, on its plugin"
    );
    let notice = notice(commands);
    let PeerMessage::ExpectNotice { plugins: named, .. } = &notice else { unreachable!() };
    assert_eq!(named, &[HOST_PLUGIN, DEVICE_PLUGIN], "the notice names each part's plugin");
    prefill.handle_peer_message(now(), PEER, &notice);
    drain(&mut prefill);

    // Part 1's plugin cannot read host region 11: refused with the reason, nothing changes.
    let refused = prefill.handle_send(now(), room, Some(PEER), 1, 0, &part(11, 8192), true).unwrap_err();
    assert_eq!(refused.reason, RefusalReason::NoPluginForMemory);
    assert!(drain(&mut prefill).is_empty(), "a refusal changes nothing");

    prefill.handle_send(now(), room, Some(PEER), 0, 0, &part(11, 4096), true).unwrap();
    prefill.handle_send(now(), room, Some(PEER), 1, 0, &part(12, 8192), true).unwrap();
    let sent = submits(&drain(&mut prefill));
    assert_eq!(sent.len(), 2);
    assert_eq!(
        (sent[0].0, sent[0].2),
        (HOST_PLUGIN, tickets[0].1 .0),
        "part 0 through the host plugin under its ticket"
    );
    assert_eq!(
        (sent[1].0, sent[1].2),
        (DEVICE_PLUGIN, tickets[1].1 .0),
        "part 1 through the device plugin under its ticket"
    );
    assert_eq!(sent[0].3[0].remote, RemoteKey(100), "the destination key is the region's key in the part's plugin");
    assert_eq!(sent[1].3[0].remote, RemoteKey(201));
    assert_eq!(sent[0].3[0].local, LocalKey(110));
    assert_eq!(sent[1].3[0].local, LocalKey(121));

    // An event for part 1's transfer from the host plugin is a violation and changes nothing.
    let wrong = prefill.metrics().violations.iter().sum::<u64>();
    prefill.handle_plugin_event(now(), HOST_PLUGIN, &Event::succeeded(sent[1].1, 8192));
    assert_eq!(prefill.metrics().violations.iter().sum::<u64>(), wrong + 1);
    for (plugin, xfer, _, _) in &sent {
        let bytes = if *plugin == HOST_PLUGIN { 4096 } else { 8192 };
        prefill.handle_plugin_event(now(), *plugin, &Event::succeeded(*xfer, bytes));
    }
    let mut succeeded = false;
    for command in drain(&mut prefill) {
        match command {
            Command::ToPeer { message, .. } => decode.handle_peer_message(now(), PEER, &message),
            Command::ToEngine(RoomEvent::Terminal { outcome, .. }) => succeeded = outcome == Outcome::Succeeded,
            _ => {}
        }
    }
    assert!(succeeded, "the sender room succeeded");
    let revoked: Vec<PluginSlot> = drain(&mut decode)
        .into_iter()
        .filter_map(|c| match c {
            Command::CancelIncoming { plugin, .. } => Some(plugin),
            _ => None,
        })
        .collect();
    assert_eq!(revoked, [HOST_PLUGIN, DEVICE_PLUGIN], "each ticket is revoked on the plugin it was open on");
    assert_eq!(decode.room(now(), room, Role::Receiver).unwrap().state, RoomState::Succeeded);
}

#[test]
fn the_source_kind_picks_among_plugins_that_hold_the_destination() {
    let mut decode = decode();
    // Region 3 is in both plugins: a host source takes the preferred host plugin, a device source
    // the device plugin.
    decode.handle_expect(now(), RoomKey::new(1, 0), PEER, &[part(3, 64)], None).unwrap();
    assert_eq!(opened_tickets(&drain(&mut decode))[0].0, HOST_PLUGIN);
    decode
        .handle_expect_from(
            now(),
            RoomKey::new(2, 0),
            PEER,
            &[part(3, 64)],
            ExpectShape { source_kinds: &[Some(MemoryKind::CUDA_DEVICE)], ..Default::default() },
            None,
        )
        .unwrap();
    let commands = drain(&mut decode);
    assert_eq!(opened_tickets(&commands)[0].0, DEVICE_PLUGIN);
    let PeerMessage::ExpectNotice { plugins, .. } = notice(commands) else { unreachable!() };
    assert_eq!(plugins, [DEVICE_PLUGIN], "one entry when every part uses the same plugin");
    // Device memory as destination with a host source: the device plugin serves host too.
    decode
        .handle_expect_from(
            now(),
            RoomKey::new(3, 0),
            PEER,
            &[part(2, 64)],
            ExpectShape { source_kinds: &[Some(MemoryKind::HOST)], ..Default::default() },
            None,
        )
        .unwrap();
    assert_eq!(opened_tickets(&drain(&mut decode))[0].0, DEVICE_PLUGIN);
}

#[test]
fn memory_no_connected_plugin_serves_is_refused_with_its_reason() {
    let mut decode = Core::new(CoreConfig::default()).unwrap();
    // This peer is reached through the host plugin only.
    decode.handle_peer_up_with(now(), PEER, 1, &plugins()[..1]);
    register(&mut decode, 1, MemoryKind::HOST, &[HOST_PLUGIN]);
    register(&mut decode, 2, MemoryKind::CUDA_DEVICE, &[DEVICE_PLUGIN]);
    let room = RoomKey::new(1, 0);
    let refused = decode.handle_expect(now(), room, PEER, &[part(1, 64), part(2, 64)], None).unwrap_err();
    assert_eq!(refused.reason, RefusalReason::NoPluginForMemory);
    let refused = decode
        .handle_expect_from(
            now(),
            room,
            PEER,
            &[part(1, 64)],
            ExpectShape { source_kinds: &[Some(MemoryKind::CUDA_DEVICE)], ..Default::default() },
            None,
        )
        .unwrap_err();
    assert_eq!(refused.reason, RefusalReason::NoPluginForMemory, "the host plugin cannot read a device source");
    assert!(drain(&mut decode).is_empty(), "refusals change nothing");
    assert_eq!(decode.live_rooms(), 0);
    // A slice out of range is reported before the plugin question.
    let refused = decode.handle_expect(now(), room, PEER, &[part(2, LEN + 1)], None).unwrap_err();
    assert_eq!(refused.reason, RefusalReason::SliceOutOfRange);
    decode.handle_expect(now(), room, PEER, &[part(1, 64)], None).unwrap();
}

#[test]
fn a_notice_naming_a_plugin_the_sender_lacks_fails_the_room_with_its_reason() {
    let mut prefill = prefill();
    let room = RoomKey::new(1, 0);
    let notice = PeerMessage::ExpectNotice {
        room,
        parts: vec![part(1, 64)],
        tickets: vec![Ticket(1)],
        plugins: vec![PluginSlot::NONE],
        timeout: Span::from_ms(1_000),
    };
    prefill.handle_peer_message(now(), PEER, &notice);
    let commands = drain(&mut prefill);
    assert!(
        commands.iter().any(|c| matches!(
            c,
            Command::ToPeer { message: PeerMessage::RoomFailed { reason: FailReason::NoPluginForMemory, .. }, .. }
        )),
        "the receiver is told why: {commands:?}"
    );
    // A notice whose part names a region only imported into the other plugin: unknown there.
    let notice = PeerMessage::ExpectNotice {
        room: RoomKey::new(2, 0),
        parts: vec![part(2, 64)],
        tickets: vec![Ticket(2)],
        plugins: vec![HOST_PLUGIN],
        timeout: Span::from_ms(1_000),
    };
    prefill.handle_peer_message(now(), PEER, &notice);
    let commands = drain(&mut prefill);
    assert!(
        commands.iter().any(|c| matches!(
            c,
            Command::ToPeer { message: PeerMessage::RoomFailed { reason: FailReason::UnknownRemoteRegion, .. }, .. }
        )),
        "{commands:?}"
    );
}
