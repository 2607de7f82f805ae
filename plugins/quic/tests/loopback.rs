//! Two QUIC plugin instances in one process over loopback: data integrity, refusals, cancel, timeout,
//! authentication, version mismatch and peer loss, each ending with the stats back to baseline.

mod common;
use common::*;
use kvgate_abi::sdk::Plugin;
use kvgate_abi::{EventKind, LocalRange, ReasonCode, Segment, Ticket, XferId};
use std::time::{Duration, Instant};

fn one_segment(r: &Route, src_off: u64, dst_off: u64, len: u64) -> Segment {
    Segment { local: r.src_key, local_offset: src_off, remote: r.remote, remote_offset: dst_off, len }
}

/// Move `len` bytes from an unaligned source offset to an unaligned destination offset and compare.
fn move_and_check(a: &Node, b: &Node, len: usize, xfer: u64) {
    let (src_off, dst_off) = (3usize, 7usize);
    let src = Buffer::random(len + src_off + 5, xfer * 7919 + 1);
    let dst = Buffer::zeroed(len + dst_off + 9);
    let r = route(a, PEER_B, b, &src, &dst);
    let ticket = Ticket(1000 + xfer);
    expect(b, PEER_A, ticket, &[LocalRange { key: r.dst_key, offset: dst_off as u64, len: len as u64 }], WAIT);
    submit(a, PEER_B, XferId(xfer), ticket, &[one_segment(&r, src_off as u64, dst_off as u64, len as u64)], WAIT)
        .unwrap();
    let done = a.events.terminal(XferId(xfer), WAIT);
    assert_eq!(done.kind, EventKind::SUCCEEDED, "transfer of {len} bytes: {done:?}");
    assert_eq!(done.bytes, len as u64);
    let s = src.snapshot();
    let d = dst.snapshot();
    assert_eq!(checksum(&d[dst_off..dst_off + len]), checksum(&s[src_off..src_off + len]), "{len} bytes differ");
    assert!(
        d[..dst_off].iter().all(|&x| x == 0) && d[dst_off + len..].iter().all(|&x| x == 0),
        "bytes outside the range were written"
    );
    b.plugin.cancel_incoming(PEER_A, ticket);
    b.plugin.deregister(r.dst_key).unwrap();
    a.plugin.deregister(r.src_key).unwrap();
    a.plugin.release_remote_key(r.remote);
}

#[test]
fn data_arrives_intact_for_odd_sizes() {
    let (a, b) = pair(test_config());
    for (i, len) in [0usize, 1, 4095, 64 << 10, 4 << 20].into_iter().enumerate() {
        move_and_check(&a, &b, len, i as u64 + 1);
    }
    for node in [&a, &b] {
        let s = wait_baseline(node, WAIT);
        assert_eq!((s.registered_regions, s.registered_bytes, s.imported_remote_keys), (0, 0, 0), "{s:?}");
        assert_eq!(s.healthy, 1);
    }
}

#[test]
fn loopback_sized_datagrams_carry_data_from_the_first_packet() {
    let big = kvgate_plugin_quic::QuicConfig {
        initial_mtu_bytes: 65507,
        min_mtu_bytes: 16000,
        mtu_discovery_upper_bound_bytes: 65507,
        segmentation_offload: false,
        ..test_config()
    };
    let (a, b) = pair(big);
    move_and_check(&a, &b, 4 << 20, 1);
    move_and_check(&a, &b, 1, 2);
    wait_baseline(&a, WAIT);
}

#[test]
fn transfers_share_long_lived_lanes_and_stop_no_stream() {
    let config = kvgate_plugin_quic::QuicConfig { connections_per_peer: 2, lanes_per_connection: 3, ..test_config() };
    let (a, b) = pair(config);
    const TRANSFERS: u64 = 40;
    for i in 0..TRANSFERS {
        move_and_check(&a, &b, if i % 2 == 0 { 4096 } else { 300 << 10 }, i + 1);
    }
    wait_baseline(&a, WAIT);
    // One stream per lane for the life of the connections, whatever the number of transfers.
    assert_eq!(a.plugin.lane_streams_opened(), 2 * 3, "lanes were reopened");
    assert!(b.plugin.lane_streams_opened() <= 2 * 3, "b reopened its lanes to a");
    // Lanes are never stopped or reset: at most the control streams' STOP_SENDING remain (one per
    // connection and side).
    let stop_sending = |stats: Vec<quinn::ConnectionStats>| {
        stats.iter().map(|s| s.frame_tx.stop_sending + s.frame_tx.reset_stream).sum::<u64>()
    };
    let connections = a.plugin.outgoing_connection_stats().len() as u64;
    assert_eq!(connections, 2);
    let sent_by_sender = stop_sending(a.plugin.outgoing_connection_stats());
    let sent_by_receiver = stop_sending(b.plugin.incoming_connection_stats());
    assert!(
        sent_by_sender <= connections,
        "sender stopped or reset {sent_by_sender} streams for {TRANSFERS} transfers"
    );
    assert!(
        sent_by_receiver <= connections,
        "receiver stopped or reset {sent_by_receiver} streams for {TRANSFERS} transfers"
    );
}

#[test]
fn a_single_lane_carries_every_transfer() {
    let config = kvgate_plugin_quic::QuicConfig {
        connections_per_peer: 1,
        endpoints: 1,
        lanes_per_connection: 1,
        ..test_config()
    };
    let (a, b) = pair(config);
    for (i, len) in [1usize, 64 << 10, 1 << 20, 0, 4095].into_iter().enumerate() {
        move_and_check(&a, &b, len, i as u64 + 1);
    }
    wait_baseline(&a, WAIT);
    assert_eq!(a.plugin.lane_streams_opened(), 1);
}

#[test]
fn peers_preferring_different_cipher_suites_still_connect() {
    use kvgate_plugin_quic::CipherSuite;
    let a = kvgate_plugin_quic::QuicConfig { cipher_suite: CipherSuite::Aes256gcm, ..test_config() };
    let b = kvgate_plugin_quic::QuicConfig { cipher_suite: CipherSuite::Chacha20poly1305, ..test_config() };
    // Each side is the client once (the client's order decides).
    for (first, second) in [(a.clone(), b.clone()), (b, a)] {
        let (x, y) = pair_with(first, second);
        move_and_check(&x, &y, 64 << 10, 1);
        wait_baseline(&x, WAIT);
        wait_baseline(&y, WAIT);
    }
}

#[test]
fn ten_thousand_scattered_segments_land_in_place() {
    let (a, b) = pair(test_config());
    const N: usize = 10_000;
    const SEG: usize = 37;
    let src = Buffer::random(N * SEG, 42);
    let dst = Buffer::zeroed(N * SEG);
    let r = route(&a, PEER_B, &b, &src, &dst);
    // Source piece i lands at destination slot (N - 1 - i): the order is reversed, every offset odd-sized.
    let segments: Vec<Segment> =
        (0..N).map(|i| one_segment(&r, (i * SEG) as u64, ((N - 1 - i) * SEG) as u64, SEG as u64)).collect();
    expect(&b, PEER_A, Ticket(7), &[LocalRange { key: r.dst_key, offset: 0, len: (N * SEG) as u64 }], WAIT);
    submit(&a, PEER_B, XferId(1), Ticket(7), &segments, WAIT).unwrap();
    let done = a.events.terminal(XferId(1), WAIT);
    assert_eq!(done.kind, EventKind::SUCCEEDED, "{done:?}");
    let (s, d) = (src.snapshot(), dst.snapshot());
    for i in 0..N {
        let want = &s[i * SEG..(i + 1) * SEG];
        let got = &d[(N - 1 - i) * SEG..(N - i) * SEG];
        assert_eq!(got, want, "segment {i} misplaced");
    }
    b.plugin.cancel_incoming(PEER_A, Ticket(7));
    wait_baseline(&a, WAIT);
    wait_baseline(&b, WAIT);
}

#[test]
fn receiver_refuses_writes_without_a_ticket_or_outside_it() {
    let (a, b) = pair(test_config());
    let src = Buffer::random(8192, 5);
    let dst = Buffer::zeroed(8192);
    let r = route(&a, PEER_B, &b, &src, &dst);
    // No ticket at all.
    submit(&a, PEER_B, XferId(1), Ticket(99), &[one_segment(&r, 0, 0, 4096)], WAIT).unwrap();
    let e = a.events.terminal(XferId(1), WAIT);
    assert_failed(&e, ReasonCode::NOT_EXPECTED);
    // A ticket for the first half; the write goes to the second half.
    expect(&b, PEER_A, Ticket(5), &[LocalRange { key: r.dst_key, offset: 0, len: 4096 }], WAIT);
    submit(&a, PEER_B, XferId(2), Ticket(5), &[one_segment(&r, 0, 4096, 4096)], WAIT).unwrap();
    let e = a.events.terminal(XferId(2), WAIT);
    assert_failed(&e, ReasonCode::NOT_EXPECTED);
    assert!(dst.snapshot().iter().all(|&x| x == 0), "a refused write touched the destination");
    // The receiver reports the refusal of a live ticket.
    let incoming =
        b.events.wait_for("incoming failure", WAIT, |e| e.is_incoming() && e.kind == EventKind::INCOMING_FAILED);
    assert_eq!((incoming.xfer.0, incoming.reason), (5, ReasonCode::NOT_EXPECTED));
    // A cancelled ticket refuses too, and its cancel is answered by an incoming QUIESCED.
    b.plugin.cancel_incoming(PEER_A, Ticket(5));
    let q = b.events.wait_for("incoming quiesced", WAIT, |e| e.is_incoming() && e.kind == EventKind::QUIESCED);
    assert_eq!((q.xfer.0, q.peer), (5, PEER_A));
    submit(&a, PEER_B, XferId(3), Ticket(5), &[one_segment(&r, 0, 0, 4096)], WAIT).unwrap();
    assert_failed(&a.events.terminal(XferId(3), WAIT), ReasonCode::NOT_EXPECTED);
    assert!(dst.snapshot().iter().all(|&x| x == 0));
    wait_baseline(&a, WAIT);
    wait_baseline(&b, WAIT);
}

#[test]
fn submit_refuses_bad_segments_before_anything_moves() {
    let (a, b) = pair(test_config());
    let src = Buffer::random(4096, 1);
    let dst = Buffer::zeroed(4096);
    let r = route(&a, PEER_B, &b, &src, &dst);
    let cases = [
        (one_segment(&r, 1, 0, 4096), ReasonCode::OUT_OF_RANGE),
        (one_segment(&r, 0, 1, 4096), ReasonCode::OUT_OF_RANGE),
        (one_segment(&r, u64::MAX, 0, 2), ReasonCode::OUT_OF_RANGE),
        (Segment { local: kvgate_abi::LocalKey(999), ..one_segment(&r, 0, 0, 1) }, ReasonCode::UNKNOWN_KEY),
        (Segment { remote: kvgate_abi::RemoteKey(999), ..one_segment(&r, 0, 0, 1) }, ReasonCode::UNKNOWN_KEY),
    ];
    for (i, (seg, reason)) in cases.into_iter().enumerate() {
        let err = submit(&a, PEER_B, XferId(i as u64), Ticket(1), &[seg], WAIT).unwrap_err();
        assert_eq!(err.code, reason, "case {i}: {err}");
    }
    let err = submit(&a, kvgate_abi::PeerId(77), XferId(50), Ticket(1), &[], WAIT).unwrap_err();
    assert_eq!(err.code, ReasonCode::PEER_UNREACHABLE);
    // A duplicate live id is refused; the first transfer is unaffected.
    expect(&b, PEER_A, Ticket(1), &[LocalRange { key: r.dst_key, offset: 0, len: 4096 }], WAIT);
    submit(&a, PEER_B, XferId(60), Ticket(1), &[one_segment(&r, 0, 0, 4096)], WAIT).unwrap();
    if let Err(e) = submit(&a, PEER_B, XferId(60), Ticket(1), &[one_segment(&r, 0, 0, 4096)], WAIT) {
        assert_eq!(e.code, ReasonCode::DUPLICATE_ID);
    }
    assert_eq!(a.events.terminal(XferId(60), WAIT).kind, EventKind::SUCCEEDED);
    // Ids are never reused: once closed, the same id is refused too (no second life, no second report).
    a.events.quiesced(XferId(60), WAIT);
    wait_baseline(&a, WAIT);
    let err = submit(&a, PEER_B, XferId(60), Ticket(1), &[one_segment(&r, 0, 0, 4096)], WAIT).unwrap_err();
    assert_eq!(err.code, ReasonCode::DUPLICATE_ID, "{err}");
    assert!(
        a.events.all().iter().all(|e| e.xfer.0 >= 50 || e.kind == EventKind::PEER_DOWN),
        "a refused submit produced an event"
    );
    b.plugin.cancel_incoming(PEER_A, Ticket(1));
    wait_baseline(&a, WAIT);
}

#[test]
fn cancel_mid_transfer_fails_then_quiesces_and_nothing_lands_after() {
    let (a, b) = pair(slow_config());
    let len = 128usize << 20;
    let src = Buffer::random(len, 9);
    let dst = Buffer::zeroed(len);
    let r = route(&a, PEER_B, &b, &src, &dst);
    expect(&b, PEER_A, Ticket(3), &[LocalRange { key: r.dst_key, offset: 0, len: len as u64 }], WAIT);
    submit(&a, PEER_B, XferId(1), Ticket(3), &[one_segment(&r, 0, 0, len as u64)], WAIT).unwrap();
    std::thread::sleep(Duration::from_millis(30));
    let asked = Instant::now();
    a.plugin.cancel(XferId(1));
    // Prompt, with room for a loaded two-core machine; a cancel that was not acted on ends the
    // transfer as SUCCEEDED (or not at all) and fails below either way.
    let prompt = Duration::from_secs(1);
    let failed = a.events.terminal(XferId(1), prompt);
    assert!(asked.elapsed() < prompt, "cancel took {:?}", asked.elapsed());
    assert_failed(&failed, ReasonCode::CANCELLED);
    a.events.quiesced(XferId(1), WAIT);
    let after_quiesce = dst.snapshot();
    std::thread::sleep(Duration::from_millis(200));
    assert!(dst.snapshot() == after_quiesce, "bytes landed after the transfer was quiesced");
    // Exactly one terminal event, then one QUIESCED (or the flag).
    let events = a.events.of_xfer(XferId(1));
    assert_eq!(events.iter().filter(|e| e.is_terminal()).count(), 1, "{events:?}");
    assert!(events.len() <= 2, "{events:?}");
    // A second cancel is harmless.
    a.plugin.cancel(XferId(1));
    b.plugin.cancel_incoming(PEER_A, Ticket(3));
    wait_baseline(&a, WAIT);
    wait_baseline(&b, WAIT);
    assert_eq!(a.events.of_xfer(XferId(1)).len(), events.len());
}

#[test]
fn cancelled_ticket_stops_the_receiver_and_reports_quiesced() {
    let (a, b) = pair(slow_config());
    let len = 128usize << 20;
    let src = Buffer::random(len, 10);
    let dst = Buffer::zeroed(len);
    let r = route(&a, PEER_B, &b, &src, &dst);
    expect(&b, PEER_A, Ticket(4), &[LocalRange { key: r.dst_key, offset: 0, len: len as u64 }], WAIT);
    submit(&a, PEER_B, XferId(1), Ticket(4), &[one_segment(&r, 0, 0, len as u64)], WAIT).unwrap();
    std::thread::sleep(Duration::from_millis(30));
    b.plugin.cancel_incoming(PEER_A, Ticket(4));
    // cancel_incoming returns only once no write is in progress: nothing changes from here on.
    let frozen = dst.snapshot();
    let q = b.events.wait_for("incoming quiesced", WAIT, |e| e.is_incoming() && e.kind == EventKind::QUIESCED);
    assert_eq!(q.xfer.0, 4);
    let e = a.events.terminal(XferId(1), WAIT);
    assert_failed(&e, ReasonCode::NOT_EXPECTED);
    a.events.quiesced(XferId(1), WAIT);
    std::thread::sleep(Duration::from_millis(100));
    assert!(dst.snapshot() == frozen, "a write landed after cancel_incoming returned");
    wait_baseline(&a, WAIT);
    wait_baseline(&b, WAIT);
}

/// One connection with one lane: every transfer queues on the same stream.
fn one_lane_slow_config() -> kvgate_plugin_quic::QuicConfig {
    kvgate_plugin_quic::QuicConfig { connections_per_peer: 1, endpoints: 1, lanes_per_connection: 1, ..slow_config() }
}

#[test]
fn cancelling_one_transfer_leaves_the_next_on_its_lane_intact() {
    let (a, b) = pair(one_lane_slow_config());
    let (big, small) = (128usize << 20, 64usize << 10);
    let src = Buffer::random(big + small, 21);
    let dst = Buffer::zeroed(big + small);
    let r = route(&a, PEER_B, &b, &src, &dst);
    expect(&b, PEER_A, Ticket(5), &[LocalRange { key: r.dst_key, offset: 0, len: (big + small) as u64 }], WAIT);
    submit(&a, PEER_B, XferId(1), Ticket(5), &[one_segment(&r, 0, 0, big as u64)], WAIT).unwrap();
    std::thread::sleep(Duration::from_millis(30));
    // Queued behind the big transfer on the only lane.
    submit(&a, PEER_B, XferId(2), Ticket(5), &[one_segment(&r, big as u64, big as u64, small as u64)], WAIT).unwrap();
    std::thread::sleep(Duration::from_millis(30));
    a.plugin.cancel(XferId(1));
    assert_failed(&a.events.terminal(XferId(1), WAIT), ReasonCode::CANCELLED);
    a.events.quiesced(XferId(1), WAIT);
    let after_quiesce = dst.snapshot()[..big].to_vec();
    let second = a.events.terminal(XferId(2), WAIT);
    assert_eq!(second.kind, EventKind::SUCCEEDED, "{second:?}");
    let d = dst.snapshot();
    assert_eq!(checksum(&d[big..]), checksum(&src.snapshot()[big..]), "the second transfer's bytes differ");
    std::thread::sleep(Duration::from_millis(100));
    assert!(dst.snapshot()[..big] == after_quiesce[..], "bytes of the cancelled transfer landed after QUIESCED");
    assert_eq!(a.plugin.lane_streams_opened(), 1, "the lane was reopened");
    b.plugin.cancel_incoming(PEER_A, Ticket(5));
    wait_baseline(&a, WAIT);
    wait_baseline(&b, WAIT);
}

#[test]
fn a_revoked_ticket_discards_its_part_and_the_lane_goes_on() {
    let (a, b) = pair(one_lane_slow_config());
    let (big, small) = (128usize << 20, 64usize << 10);
    let src = Buffer::random(big + small, 22);
    let dst = Buffer::zeroed(big + small);
    let r = route(&a, PEER_B, &b, &src, &dst);
    expect(&b, PEER_A, Ticket(6), &[LocalRange { key: r.dst_key, offset: 0, len: big as u64 }], WAIT);
    expect(&b, PEER_A, Ticket(7), &[LocalRange { key: r.dst_key, offset: big as u64, len: small as u64 }], WAIT);
    submit(&a, PEER_B, XferId(1), Ticket(6), &[one_segment(&r, 0, 0, big as u64)], WAIT).unwrap();
    std::thread::sleep(Duration::from_millis(30));
    submit(&a, PEER_B, XferId(2), Ticket(7), &[one_segment(&r, big as u64, big as u64, small as u64)], WAIT).unwrap();
    std::thread::sleep(Duration::from_millis(30));
    b.plugin.cancel_incoming(PEER_A, Ticket(6));
    // Nothing under the revoked ticket is written from here on: the rest of its part is discarded.
    let frozen = dst.snapshot()[..big].to_vec();
    assert_failed(&a.events.terminal(XferId(1), WAIT), ReasonCode::NOT_EXPECTED);
    a.events.quiesced(XferId(1), WAIT);
    let second = a.events.terminal(XferId(2), WAIT);
    assert_eq!(second.kind, EventKind::SUCCEEDED, "{second:?}");
    assert_eq!(
        checksum(&dst.snapshot()[big..]),
        checksum(&src.snapshot()[big..]),
        "the second transfer's bytes differ"
    );
    std::thread::sleep(Duration::from_millis(100));
    assert!(dst.snapshot()[..big] == frozen[..], "a write under the revoked ticket landed");
    assert_eq!(a.plugin.lane_streams_opened(), 1, "the lane was reopened");
    b.plugin.cancel_incoming(PEER_A, Ticket(7));
    wait_baseline(&a, WAIT);
    wait_baseline(&b, WAIT);
}

#[test]
fn transfer_timeout_ends_the_transfer_inside_the_plugin() {
    let (a, b) = pair(slow_config());
    let len = 128usize << 20;
    let src = Buffer::random(len, 11);
    let dst = Buffer::zeroed(len);
    let r = route(&a, PEER_B, &b, &src, &dst);
    expect(&b, PEER_A, Ticket(1), &[LocalRange { key: r.dst_key, offset: 0, len: len as u64 }], WAIT);
    let submitted = Instant::now();
    submit(&a, PEER_B, XferId(1), Ticket(1), &[one_segment(&r, 0, 0, len as u64)], Duration::from_millis(20)).unwrap();
    let e = a.events.terminal(XferId(1), WAIT);
    assert_failed(&e, ReasonCode::TIMEOUT);
    assert!(submitted.elapsed() < Duration::from_secs(2), "timeout reported late: {:?}", submitted.elapsed());
    a.events.quiesced(XferId(1), WAIT);
    b.plugin.cancel_incoming(PEER_A, Ticket(1));
    wait_baseline(&a, WAIT);
    wait_baseline(&b, WAIT);
}

#[test]
fn black_holed_peer_times_out_within_the_transfer_deadline() {
    let a = open(test_config());
    let b = open(test_config());
    // b's endpoint bytes, but nothing answers at those ports any more: a UDP black hole.
    let endpoint = b.plugin.local_endpoint();
    drop(b);
    let hole = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let mut info = kvgate_plugin_quic::wire::EndpointInfo::decode(&endpoint).unwrap();
    info.addresses = vec![hole.local_addr().unwrap()];
    a.plugin.connect(PEER_B, &info.encode()).unwrap();
    let submitted = Instant::now();
    submit(&a, PEER_B, XferId(1), Ticket(1), &[], Duration::from_millis(300)).unwrap();
    let e = a.events.terminal(XferId(1), WAIT);
    assert_failed(&e, ReasonCode::TIMEOUT);
    assert!(e.flags & kvgate_abi::event_flags::QUIESCED != 0, "nothing was sent: the failure is quiesced: {e:?}");
    assert!(submitted.elapsed() < Duration::from_millis(1000), "{:?}", submitted.elapsed());
    wait_baseline(&a, WAIT);
}

#[test]
fn wrong_pinned_fingerprint_is_refused_with_auth_failed() {
    let a = open(test_config());
    let b = open(test_config());
    b.plugin.connect(PEER_A, &a.plugin.local_endpoint()).unwrap();
    let mut info = kvgate_plugin_quic::wire::EndpointInfo::decode(&b.plugin.local_endpoint()).unwrap();
    info.fingerprint[0] ^= 0xff;
    a.plugin.connect(PEER_B, &info.encode()).unwrap();
    submit(&a, PEER_B, XferId(1), Ticket(1), &[], WAIT).unwrap();
    let e = a.events.terminal(XferId(1), WAIT);
    assert_failed(&e, ReasonCode::AUTH_FAILED);
    assert!(e.message.contains("fingerprint"), "the reason says why: {e:?}");
    let down = a.events.wait_for("peer down", WAIT, |e| e.kind == EventKind::PEER_DOWN);
    assert_eq!((down.peer, down.reason), (PEER_B, ReasonCode::AUTH_FAILED));
    wait_baseline(&a, WAIT);
}

#[test]
fn unknown_client_certificate_is_refused_with_auth_failed() {
    let a = open(test_config());
    let b = open(test_config());
    // b never learns a's endpoint: a's certificate is unknown to it.
    a.plugin.connect(PEER_B, &b.plugin.local_endpoint()).unwrap();
    submit(&a, PEER_B, XferId(1), Ticket(1), &[], WAIT).unwrap();
    let e = a.events.terminal(XferId(1), WAIT);
    assert_failed(&e, ReasonCode::AUTH_FAILED);
    wait_baseline(&a, WAIT);
}

#[test]
fn a_peer_that_learns_our_endpoint_late_is_retried_not_refused() {
    let a = open(test_config());
    let b = open(test_config());
    // a dials b before b knows a: b refuses a's certificate until it learns a's endpoint.
    a.plugin.connect(PEER_B, &b.plugin.local_endpoint()).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    b.plugin.connect(PEER_A, &a.plugin.local_endpoint()).unwrap();
    move_and_check(&a, &b, 1000, 1);
    assert!(a.events.all().iter().all(|e| e.kind != EventKind::PEER_DOWN), "spurious peer down: {:?}", a.events.all());
}

#[test]
fn configured_certificates_authenticate_like_generated_ones() {
    let dir = std::env::temp_dir().join(format!("kvgate-quic-certs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let certified = rcgen::generate_simple_self_signed(vec!["node-a".to_string()]).unwrap();
    let (cert_path, key_path) = (dir.join("a.pem"), dir.join("a.key"));
    std::fs::write(&cert_path, certified.cert.pem()).unwrap();
    std::fs::write(&key_path, certified.signing_key.serialize_pem()).unwrap();
    let config_a = kvgate_plugin_quic::QuicConfig::parse(&format!(
        "certificate_path = {:?}\nprivate_key_path = {:?}\nidle_timeout_ms = 1500\nkeep_alive_interval_ms = 200",
        cert_path, key_path
    ))
    .unwrap();
    let (a, b) = pair_with(config_a, test_config());
    let fp = kvgate_plugin_quic::tls::fingerprint_of(certified.cert.der());
    assert_eq!(kvgate_plugin_quic::wire::EndpointInfo::decode(&a.plugin.local_endpoint()).unwrap().fingerprint, fp);
    move_and_check(&a, &b, 1000, 1);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn wire_version_mismatch_is_refused() {
    let newer = kvgate_plugin_quic::QuicConfig { wire_version_override: Some(99), ..test_config() };
    let (a, _b) = pair_with(newer, test_config());
    submit(&a, PEER_B, XferId(1), Ticket(1), &[], WAIT).unwrap();
    let e = a.events.terminal(XferId(1), WAIT);
    assert_failed(&e, ReasonCode::VERSION_MISMATCH);
    assert!(e.message.contains("99"), "the message names the versions: {e:?}");
    wait_baseline(&a, WAIT);
}

#[test]
fn peer_shutdown_fails_its_transfers_with_peer_lost() {
    let (a, b) = pair(slow_config());
    let len = 128usize << 20;
    let src = Buffer::random(len, 12);
    let dst = Buffer::zeroed(len);
    let r = route(&a, PEER_B, &b, &src, &dst);
    expect(&b, PEER_A, Ticket(1), &[LocalRange { key: r.dst_key, offset: 0, len: len as u64 }], WAIT);
    submit(&a, PEER_B, XferId(1), Ticket(1), &[one_segment(&r, 0, 0, len as u64)], WAIT).unwrap();
    std::thread::sleep(Duration::from_millis(30));
    let stopped = Instant::now();
    b.plugin.shutdown();
    assert_eq!(b.plugin.stats().healthy, 0);
    assert_eq!(b.plugin.stats().workers_alive, 0);
    let e = a.events.terminal(XferId(1), WAIT);
    assert_failed(&e, ReasonCode::PEER_LOST);
    let down = a.events.wait_for("peer down", WAIT, |e| e.kind == EventKind::PEER_DOWN);
    assert_eq!((down.peer, down.reason), (PEER_B, ReasonCode::PEER_LOST));
    a.events.quiesced(XferId(1), WAIT);
    assert!(stopped.elapsed() < Duration::from_secs(3), "{:?}", stopped.elapsed());
    wait_baseline(&a, WAIT);
    // After shutdown, calls are refused and nothing is held.
    let err = b.plugin.register(&src.desc()).unwrap_err();
    assert_eq!(err.code, ReasonCode::SHUTDOWN);
    assert_eq!(b.plugin.stats().registered_regions, 0);
}

#[test]
fn shutdown_ends_every_live_transfer() {
    let (a, b) = pair(slow_config());
    let len = 64usize << 20;
    let src = Buffer::random(len, 13);
    let dst = Buffer::zeroed(len);
    let r = route(&a, PEER_B, &b, &src, &dst);
    expect(&b, PEER_A, Ticket(1), &[LocalRange { key: r.dst_key, offset: 0, len: len as u64 }], WAIT);
    submit(&a, PEER_B, XferId(1), Ticket(1), &[one_segment(&r, 0, 0, len as u64)], WAIT).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    a.plugin.shutdown();
    let events = a.events.of_xfer(XferId(1));
    assert_eq!(events.iter().filter(|e| e.is_terminal()).count(), 1, "{events:?}");
    a.events.quiesced(XferId(1), Duration::from_millis(1));
    let s = a.plugin.stats();
    assert_eq!(
        (s.live_transfers, s.unquiesced_transfers, s.registered_regions, s.workers_alive, s.healthy),
        (0, 0, 0, 0, 0),
        "{s:?}"
    );
    drop(b);
}

#[test]
fn device_memory_is_refused_at_register() {
    let a = open(test_config());
    let desc = kvgate_abi::RegionDesc {
        kind: kvgate_abi::MemoryKind::CUDA_DEVICE,
        device: 0,
        addr: 0x1000,
        len: 4096,
        ..Default::default()
    };
    assert_eq!(a.plugin.register(&desc).unwrap_err().code, ReasonCode::UNSUPPORTED_MEMORY);
    let unknown = kvgate_abi::RegionDesc { kind: kvgate_abi::MemoryKind(77), ..desc };
    assert_eq!(a.plugin.register(&unknown).unwrap_err().code, ReasonCode::UNSUPPORTED_MEMORY);
    assert_eq!(a.plugin.stats().registered_regions, 0);
}

#[test]
fn extreme_timeouts_neither_panic_nor_expire_early() {
    let (a, b) = pair(test_config());
    let src = Buffer::random(4096, 3);
    let dst = Buffer::zeroed(4096);
    let r = route(&a, PEER_B, &b, &src, &dst);
    b.plugin
        .expect_incoming(&kvgate_abi::IncomingRequest {
            ticket: Ticket(1),
            peer: PEER_A,
            timeout_ns: u64::MAX,
            ranges: [LocalRange { key: r.dst_key, offset: 0, len: 4096 }].as_slice().into(),
        })
        .unwrap();
    a.plugin
        .submit(&kvgate_abi::SubmitRequest {
            xfer: XferId(1),
            peer: PEER_B,
            ticket: Ticket(1),
            timeout_ns: u64::MAX,
            segments: [one_segment(&r, 0, 0, 4096)].as_slice().into(),
        })
        .unwrap();
    assert_eq!(a.events.terminal(XferId(1), WAIT).kind, EventKind::SUCCEEDED);
    assert_eq!(checksum(&dst.snapshot()), checksum(&src.snapshot()));
    b.plugin.cancel_incoming(PEER_A, Ticket(1));
    wait_baseline(&a, WAIT);
    wait_baseline(&b, WAIT);
}
