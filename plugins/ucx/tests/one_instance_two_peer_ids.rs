//! Two peer ids naming one remote plugin instance (what the conformance clause OBS-2 does): the
//! second id is connected and disconnected while the first carries transfers both ways. Checks that
//! the first id's transfers still complete in both directions, that nobody reports a peer down, and
//! that the second id's own transfers end. Every wait is bounded (support::WAIT_LIMIT).

mod support;

use kvgate_abi::sdk::Plugin;
use kvgate_abi::*;
use std::time::Duration;
use support::*;

const LONG: Duration = Duration::from_secs(30);
/// The second peer id, as in OBS-2.
const SECOND: PeerId = PeerId(12);
/// Connect/disconnect rounds of the second id; each is followed by transfers under the first.
const ROUNDS: u64 = 6;
/// Transfers A → B per round (OBS-2 submits five).
const TRANSFERS_PER_ROUND: u64 = 5;
const PIECE: u64 = 4096;

fn segment(local: LocalKey, remote: RemoteKey, offset: u64) -> Segment {
    Segment { local, local_offset: offset, remote, remote_offset: offset, len: PIECE }
}

fn second_peer_id_for_the_same_instance(config: &str) {
    let (a, b) = pair(config);
    let receiver_enforced = a.plugin.info().capabilities.flags & cap_flags::RECEIVER_ENFORCED != 0;
    let len = (ROUNDS * TRANSFERS_PER_ROUND * PIECE) as usize;
    let src_a = buffer(&a, len, 31);
    let dst_b = buffer(&b, len, 32);
    let src_b = buffer(&b, len, 33);
    let dst_a = buffer(&a, len, 34);
    let remote_b = a.plugin.import_remote_key(PEER_B, &dst_b.remote_key_bytes).unwrap();
    let remote_a = b.plugin.import_remote_key(PEER_A, &dst_a.remote_key_bytes).unwrap();
    for round in 0..ROUNDS {
        // The second id: connected to B's endpoint, one transfer waiting on a ticket B never opens,
        // then disconnected.
        a.plugin.connect(SECOND, &b.plugin.local_endpoint()).unwrap();
        assert_eq!(a.plugin.stats().connected_peers, 2, "round {round}");
        let remote_second = a.plugin.import_remote_key(SECOND, &dst_b.remote_key_bytes).unwrap();
        let orphan = 9_000 + round;
        if receiver_enforced {
            submit(&a, orphan, SECOND, 9_999, LONG, &[segment(src_a.key, remote_second, 0)]).unwrap();
        }
        a.plugin.disconnect(SECOND);
        a.plugin.release_remote_key(remote_second);
        assert_eq!(a.plugin.stats().connected_peers, 1, "round {round}");
        if receiver_enforced {
            let end = a.log.terminal_of(XferId(orphan), WAIT_LIMIT);
            // PEER_LOST at the disconnect, or B's refusal of the unknown ticket if it came first.
            let ended = end.kind == EventKind::FAILED
                && [ReasonCode::PEER_LOST, ReasonCode::NOT_EXPECTED].contains(&end.reason);
            assert!(ended, "round {round}: {end:?}");
        }

        // The first id, both ways: A → B and B → A (A's receiver side must still know B's instance).
        let ticket = 100 + round;
        let first = round * TRANSFERS_PER_ROUND;
        let span = LocalRange { key: dst_b.key, offset: first * PIECE, len: TRANSFERS_PER_ROUND * PIECE };
        expect(&b, ticket, PEER_A, LONG, &[span]);
        expect(&a, ticket, PEER_B, LONG, &[LocalRange { key: dst_a.key, ..span }]);
        for i in first..first + TRANSFERS_PER_ROUND {
            submit(&a, 1_000 + i, PEER_B, ticket, LONG, &[segment(src_a.key, remote_b, i * PIECE)]).unwrap();
            submit(&b, 5_000 + i, PEER_A, ticket, LONG, &[segment(src_b.key, remote_a, i * PIECE)]).unwrap();
        }
        for i in first..first + TRANSFERS_PER_ROUND {
            let there = a.log.terminal_of(XferId(1_000 + i), WAIT_LIMIT);
            assert_eq!(there.kind, EventKind::SUCCEEDED, "round {round}, A → B transfer {i}: {there:?}");
            let back = b.log.terminal_of(XferId(5_000 + i), WAIT_LIMIT);
            assert_eq!(back.kind, EventKind::SUCCEEDED, "round {round}, B → A transfer {i}: {back:?}");
        }
        b.plugin.cancel_incoming(PEER_A, Ticket(ticket));
        a.plugin.cancel_incoming(PEER_B, Ticket(ticket));
    }
    let moved = (ROUNDS * TRANSFERS_PER_ROUND * PIECE) as usize;
    assert_eq!(checksum(&src_a.bytes[..moved]), checksum(&dst_b.bytes[..moved]), "A → B bytes differ");
    assert_eq!(checksum(&src_b.bytes[..moved]), checksum(&dst_a.bytes[..moved]), "B → A bytes differ");
    assert_eq!(b.log.count(|e| e.kind == EventKind::PEER_DOWN), 0, "B lost its peer: {:?}", b.log.all());
    assert_eq!(a.log.count(|e| e.kind == EventKind::PEER_DOWN), 0, "A lost its peer: {:?}", a.log.all());
    for side in [&a, &b] {
        wait_stats(side, "nothing live", |s| s.live_transfers == 0 && s.unquiesced_transfers == 0);
    }
    a.plugin.release_remote_key(remote_b);
    b.plugin.release_remote_key(remote_a);
    for side in [&a, &b] {
        side.plugin.shutdown();
        let s = side.plugin.stats();
        assert_eq!((s.registered_regions, s.imported_remote_keys, s.workers_alive), (0, 0, 0), "{s:?}");
    }
}

#[test]
fn tcp_second_peer_id_for_the_same_instance() {
    second_peer_id_for_the_same_instance(&tcp_config());
}

#[test]
fn sm_am_second_peer_id_for_the_same_instance() {
    second_peer_id_for_the_same_instance(&sm_am_config());
}

#[test]
fn sm_put_second_peer_id_for_the_same_instance() {
    second_peer_id_for_the_same_instance(&sm_config());
}
