//! Rooms moving bytes with the same peer share its link, so each room's transfer bound counts the
//! bytes of the rooms already moving with that peer ahead of its own (`transfer_base_ms` + all of
//! them at `min_bandwidth_bytes_per_s`): four large rooms started together no longer fail healthy on
//! a link that gives each a quarter. The bound stays finite, so a frozen peer still ends every room.

use kvgate_abi::MemoryKind;
use kvgate_core::*;

const A: PeerId = PeerId(2);
const B: PeerId = PeerId(3);
const PLUGIN: PluginSlot = PluginSlot(0);
const ROOM_BYTES: u64 = 64 << 20;

fn config() -> CoreConfig {
    // 1 s base, 64 MiB/s floor: a lone 64 MiB room gets 2 s, the fourth sharing the link 5 s.
    CoreConfig {
        transfer_base_ms: 1_000,
        min_bandwidth_bytes_per_s: ROOM_BYTES,
        room_timeout_ms: 60_000,
        ..CoreConfig::default()
    }
}

fn decode() -> Core {
    let mut core = Core::new(config()).unwrap();
    core.handle_peer_up(At::ZERO, A, 1, PLUGIN);
    core.handle_peer_up(At::ZERO, B, 1, PLUGIN);
    let info = RegionInfo {
        id: RegionId(1),
        len: 16 * ROOM_BYTES,
        memory_kind: MemoryKind::HOST,
        keys: vec![(PLUGIN, LocalKey(1))],
    };
    core.handle_region_registered(At::ZERO, info);
    core
}

/// Expect room `id` from `peer` in slot `slot`, and the sender's word that bytes move.
fn start(core: &mut Core, now: At, id: u64, peer: PeerId, slot: u64) -> RoomKey {
    let key = RoomKey::new(id, 0);
    core.handle_expect(now, key, peer, &[vec![Slice::new(RegionId(1), slot * ROOM_BYTES, ROOM_BYTES)]], None).unwrap();
    core.handle_peer_message(now, peer, &PeerMessage::Matched { room: key });
    while core.poll_command().is_some() {}
    key
}

fn transfer_bound(core: &Core, now: At, key: RoomKey) -> u64 {
    core.room(now, key, Role::Receiver).unwrap().next_deadline.unwrap().saturating_since(now).0 / 1_000_000
}

#[test]
fn each_room_moving_with_a_peer_counts_the_bytes_ahead_of_it_and_others_peers_do_not() {
    let mut core = decode();
    let now = At::from_origin(Span::from_ms(10));
    let rooms: Vec<RoomKey> = (0..4).map(|i| start(&mut core, now, i, A, i)).collect();
    let bounds: Vec<u64> = rooms.iter().map(|&key| transfer_bound(&core, now, key)).collect();
    // Rounded up to the timer wheel's tick.
    for (i, bound) in bounds.iter().enumerate() {
        let wanted = 1_000 + 1_000 * (i as u64 + 1);
        assert!((wanted..wanted + 10).contains(bound), "room {i}: {bound} ms, wanted {wanted}: {bounds:?}");
    }
    assert_eq!(core.bytes_moving_with(A), 4 * ROOM_BYTES);
    // Another peer's link is its own.
    let other = start(&mut core, now, 10, B, 8);
    assert!((2_000..2_010).contains(&transfer_bound(&core, now, other)));

    // Ended rooms leave the link: a room started after two of them finished counts only the rest.
    for key in &rooms[..2] {
        core.handle_peer_message(now, A, &PeerMessage::PartDone { room: *key, part: 0, bytes: ROOM_BYTES });
    }
    core.handle_engine(now, EngineRequest::Abort { room: rooms[2], role: Some(Role::Receiver) }).unwrap();
    assert_eq!(core.bytes_moving_with(A), ROOM_BYTES, "succeeded and failed rooms are off the link");
    let later = start(&mut core, now, 20, A, 4);
    assert!((3_000..3_010).contains(&transfer_bound(&core, now, later)), "one room ahead");

    // Still a bound: nothing arrives, and every room ends at its own deadline.
    let end = now.saturating_add(Span::from_ms(10_000));
    core.handle_timeout(end);
    for key in [rooms[3], later] {
        let view = core.room(end, key, Role::Receiver).unwrap();
        assert!(view.state.is_terminal(), "{key}: {view:?}");
    }
    assert_eq!(core.bytes_moving_with(A), 0, "nothing left on the link");
}
