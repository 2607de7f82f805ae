//! A gateway stopped (SIGSTOP) while its peer finishes rooms: on SIGCONT it reads what arrived
//! meanwhile before it acts on the deadlines the stall made pass, so every room the peer saw succeed
//! succeeds here too, with its bytes, and none waits for the quarantine bound.

mod common;

use common::*;
use kvgate_demo::engine::{expect_into, prepare_slots, send_all, slot_checksum, wait_reusable, wait_terminal};
use kvgate_demo::gateways::{GatewayPair, PairSettings, DECODE_NAME, PREFILL_NAME};
use std::time::{Duration, Instant};

const ROOMS: u64 = 6;
const FREEZE: Duration = Duration::from_secs(3);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_decode_gateway_finishes_the_rooms_its_peer_finished_while_it_was_stopped() {
    let _serial = serial().await;
    let dir = work_dir();
    // Every deadline of these rooms passes during the stop; the quarantine bound is far beyond it.
    let env = vec![
        ("KVGATE__SCHEDULER__BOOTSTRAP_TIMEOUT_MS".to_string(), "1000".to_string()),
        ("KVGATE__SCHEDULER__TRANSFER_BASE_MS".to_string(), "1000".to_string()),
        ("KVGATE__SCHEDULER__ROOM_TIMEOUT_MS".to_string(), "1500".to_string()),
        ("KVGATE__SCHEDULER__QUARANTINE_TIMEOUT_MS".to_string(), "30000".to_string()),
    ];
    let settings = PairSettings { env_prefill: env.clone(), env_decode: env, ..PairSettings::default() };
    let mut pair = GatewayPair::start(&binary(), dir.path(), &settings).await.unwrap();
    let shape = small_shape();
    let prefill = engine(dir.path(), &pair.prefill.socket, "prefill", &shape, ROOMS).await;
    let decode = engine(dir.path(), &pair.decode.socket, "decode", &shape, ROOMS).await;
    let mut rooms = Vec::new();
    for i in 0..ROOMS {
        let room = 8800 + i;
        let expected = prepare_slots(&prefill, &decode, room, i, i).await.unwrap();
        let rx = (prefill.events.listen(room), decode.events.listen(room));
        expect_into(&decode, &shape, room, i, PREFILL_NAME, 0).await.unwrap();
        rooms.push((room, i, expected, rx));
    }
    // The decode gateway knows every room; stop it, and let the prefill side move every byte
    // (same-host shared memory needs nothing from the stopped process) and report each part done.
    tokio::time::sleep(Duration::from_millis(200)).await;
    pair.decode.freeze().unwrap();
    let frozen_at = Instant::now();
    for (room, slot, _, _) in &rooms {
        send_all(&prefill, &shape, *room, *slot, DECODE_NAME, None).await.unwrap();
    }
    let mut prefill_succeeded = Vec::new();
    for (room, _, _, (p_rx, _)) in rooms.iter_mut() {
        let o = wait_terminal(p_rx, frozen_at, Duration::from_secs(10)).await.unwrap();
        prefill_succeeded.push((*room, o.succeeded));
    }
    assert!(prefill_succeeded.iter().all(|(_, ok)| *ok), "the prefill side finished every room: {prefill_succeeded:?}");
    let remaining = FREEZE.saturating_sub(frozen_at.elapsed());
    tokio::time::sleep(remaining).await;
    pair.decode.thaw().unwrap();
    let thawed_at = Instant::now();
    for (room, slot, expected, (_, d_rx)) in rooms.iter_mut() {
        let o = wait_terminal(d_rx, thawed_at, Duration::from_secs(10)).await.unwrap();
        assert!(
            o.succeeded,
            "room {room} succeeded on the prefill side but not on the stopped decode: {o:?}\n{}",
            pair.decode.log()
        );
        assert_eq!(slot_checksum(&decode, *slot).await.unwrap(), *expected, "room {room}: bytes");
        assert!(
            wait_reusable(d_rx, Duration::from_secs(5)).await,
            "room {room}: memory not reusable within 5 s (quarantine bound 30 s)"
        );
    }
    // Noticed by the driver (a deadline woke late) or by the link (its silence bound woke late):
    // when the peer's messages for every room arrive in one batch, the driver may finish them all
    // before any deadline of theirs is due, and then only the link saw the stall.
    let log = pair.decode.log();
    assert!(
        log.contains("the gateway was stalled") || log.contains("stalled past this link's silence bound"),
        "the stall was not noticed:\n{log}"
    );
    pair.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rooms_cut_by_a_stop_end_on_both_sides_and_free_their_memory_before_the_quarantine_bound() {
    let _serial = serial().await;
    let dir = work_dir();
    let env = vec![("KVGATE__SCHEDULER__QUARANTINE_TIMEOUT_MS".to_string(), "30000".to_string())];
    let settings = PairSettings { env_prefill: env.clone(), env_decode: env, ..PairSettings::default() };
    let mut pair = GatewayPair::start(&binary(), dir.path(), &settings).await.unwrap();
    let shape = small_shape();
    let prefill = engine(dir.path(), &pair.prefill.socket, "prefill", &shape, ROOMS).await;
    let decode = engine(dir.path(), &pair.decode.socket, "decode", &shape, ROOMS).await;
    let mut rooms = Vec::new();
    for i in 0..ROOMS {
        let room = 8900 + i;
        let rx = (prefill.events.listen(room), decode.events.listen(room));
        expect_into(&decode, &shape, room, i, PREFILL_NAME, 0).await.unwrap();
        // Half of each room's chunks: the rooms are mid-transfer when the decode gateway stops.
        send_all(&prefill, &shape, room, i, DECODE_NAME, Some(1)).await.unwrap();
        rooms.push((room, rx));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    pair.decode.freeze().unwrap();
    let frozen_at = Instant::now();
    for (room, (p_rx, _)) in rooms.iter_mut() {
        let o = wait_terminal(p_rx, frozen_at, Duration::from_secs(10)).await.unwrap();
        assert!(!o.succeeded, "room {room} on the prefill side: {o:?}");
        assert!(wait_reusable(p_rx, Duration::from_secs(10)).await, "room {room}: prefill memory");
    }
    tokio::time::sleep(FREEZE.saturating_sub(frozen_at.elapsed())).await;
    pair.decode.thaw().unwrap();
    let thawed_at = Instant::now();
    for (room, (_, d_rx)) in rooms.iter_mut() {
        let o = wait_terminal(d_rx, thawed_at, Duration::from_secs(10)).await.unwrap();
        assert!(!o.succeeded, "room {room} on the decode side: {o:?}");
        assert!(
            wait_reusable(d_rx, Duration::from_secs(10)).await,
            "room {room}: decode memory still quarantined {:?} after the thaw (bound 30 s); its peer can answer",
            thawed_at.elapsed()
        );
    }
    pair.stop();
}
