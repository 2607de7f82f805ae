//! The stuck-connection watchdog on the two-host test bed: two plugin instances, one in each host's
//! network namespace, and a link that stops carrying anything (a black hole) under a transfer. The
//! connection keeps parts outstanding while it sends only loss probes, far below `stuck_min_bytes_per_s`,
//! so after `stuck_after_ms` the transfer fails `TRANSPORT_ERROR` with a message naming the stuck
//! connection, no PEER_DOWN is reported, and once the link carries packets again a new transfer
//! succeeds over new connections. Needs root: without it the test says SKIPPED (not passed), and
//! fails under `KVGATE_NETBED=require`.

mod common;
use common::*;
use kvgate_abi::sdk::Plugin;
use kvgate_abi::{EventKind, LocalRange, ReasonCode, Segment, Ticket, XferId};
use kvgate_netbed::{Link, Profile};
use kvgate_plugin_quic::QuicConfig;
use std::time::Duration;

fn bed_unavailable() -> bool {
    match kvgate_netbed::available() {
        Ok(()) => false,
        Err(why) if kvgate_netbed::required() => panic!("KVGATE_NETBED=require, but {why}"),
        Err(why) => {
            eprintln!("SKIPPED (not passed): {why}");
            true
        }
    }
}

/// A plugin instance opened inside `host`'s namespace (its UDP sockets live there).
fn open_on(link: &Link, host: usize, config: QuicConfig) -> Node {
    let address = link.host(host).address;
    let config = QuicConfig { listen_address: format!("{address}:0").parse().unwrap(), ..config };
    kvgate_netbed::in_namespace(&link.host(host).namespace, move || open(config)).expect("enter the host's namespace")
}

fn move_bytes(
    a: &Node,
    b: &Node,
    src: &Buffer,
    dst: &Buffer,
    xfer: u64,
    len: u64,
    timeout: Duration,
) -> kvgate_abi::Event {
    let r = route(a, PEER_B, b, src, dst);
    let ticket = Ticket(xfer);
    expect(b, PEER_A, ticket, &[LocalRange { key: r.dst_key, offset: 0, len }], timeout);
    let seg = Segment { local: r.src_key, local_offset: 0, remote: r.remote, remote_offset: 0, len };
    submit(a, PEER_B, XferId(xfer), ticket, &[seg], timeout).unwrap();
    a.events.terminal(XferId(xfer), timeout + WAIT)
}

#[test]
fn a_connection_that_stops_delivering_is_replaced_and_the_next_transfer_succeeds() {
    black_hole_under_a_transfer(QuicConfig {
        // Unacknowledged bytes a connection may send into the black hole: with no acknowledgement
        // nothing more than this and loss probes leaves, 2 MB/s over a window at most, below the floor.
        // The transfer is larger, so its lanes are held back waiting for quinn.
        send_window_bytes: 1 << 20,
        ..stuck_config()
    })
}

/// The transfer fits in the connections' send windows (the default 64 MiB): quinn takes every byte at
/// once and no lane is ever held back, so only the parts left unanswered (16 MiB per connection, above
/// the floor's 4 MiB a window) show the connections busy.
#[test]
fn a_connection_whose_transfer_fits_in_its_send_window_is_replaced_when_it_stops_delivering() {
    let config = stuck_config();
    assert!(config.send_window_bytes >= 32 << 20, "the transfer must fit in one connection's send window");
    black_hole_under_a_transfer(config)
}

/// The watchdog's window and floor; the idle timeout stays well beyond them, so it is the watchdog,
/// not the loss of the peer, that ends the transfer.
fn stuck_config() -> QuicConfig {
    QuicConfig {
        stuck_after_ms: 500,
        stuck_min_bytes_per_s: 8 << 20,
        idle_timeout_ms: 60_000,
        keep_alive_interval_ms: 200,
        ..test_config()
    }
}

fn black_hole_under_a_transfer(config: QuicConfig) {
    if bed_unavailable() {
        return;
    }
    let link = Link::start(&Profile::a()).expect("start the link");
    let a = open_on(&link, 0, config.clone());
    let b = open_on(&link, 1, config);
    a.plugin.connect(PEER_B, &b.plugin.local_endpoint()).unwrap();
    b.plugin.connect(PEER_A, &a.plugin.local_endpoint()).unwrap();

    let len = 32u64 << 20;
    let src = Buffer::random(len as usize, 7);
    let dst = Buffer::zeroed(len as usize);
    // A first transfer over the healthy link: the connections are up and moved bytes.
    let first = move_bytes(&a, &b, &src, &dst, 1, 1 << 20, WAIT);
    assert_eq!(first.kind, EventKind::SUCCEEDED, "{first:?}");
    assert_eq!(a.plugin.stuck_connections_replaced(), 0);

    link.set_black_hole(true);
    let stuck = move_bytes(&a, &b, &src, &dst, 2, len, Duration::from_secs(30));
    link.set_black_hole(false);
    assert_failed(&stuck, ReasonCode::TRANSPORT_ERROR);
    assert!(stuck.message.contains("stuck"), "the failure names the stuck connection: {}", stuck.message);
    assert_eq!(a.plugin.stuck_connections_replaced(), 1);
    assert!(
        !a.events.all().iter().any(|e| e.kind == EventKind::PEER_DOWN),
        "a replaced connection is not a lost peer: {:?}",
        a.events.all()
    );

    // The link carries packets again: a new transfer goes over new connections, every byte in place.
    let dst2 = Buffer::zeroed(len as usize);
    let after = move_bytes(&a, &b, &src, &dst2, 3, len, WAIT);
    assert_eq!(after.kind, EventKind::SUCCEEDED, "{after:?}");
    assert_eq!(checksum(&dst2.snapshot()), checksum(&src.snapshot()));
    assert_eq!(a.plugin.stuck_connections_replaced(), 1, "a healthy connection is not replaced");
}
