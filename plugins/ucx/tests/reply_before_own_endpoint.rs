//! A receiver that takes a sender's writes before it has made its own endpoint to that sender (the
//! host's `connect` was made, but the progress thread had not run it yet, as happens on a loaded
//! machine): the reply must wait for the endpoint, not be dropped, or the sender's transfer would
//! hang to its deadline. The plugin's test hook holds the receiver's commands to order this.

mod support;

use kvgate_abi::sdk::Plugin;
use kvgate_abi::*;
use std::time::{Duration, Instant};
use support::*;

const LONG: Duration = Duration::from_secs(30);
const PIECE: usize = 4096;

/// Whether `dst` holds `src`'s bytes (read volatile: the receiver's progress thread writes `dst`).
fn landed(dst: &[u8], src: &[u8]) -> bool {
    // SAFETY: `i < src.len() <= dst.len()` (checked by the caller's equal lengths), inside `dst`.
    (0..src.len()).all(|i| unsafe { std::ptr::read_volatile(dst.as_ptr().add(i)) } == src[i])
}
/// The receiver takes a sender's writes before it has made its own endpoint to that sender (its
/// `connect` was made but its progress thread had not run the command yet): the reply waits for
/// the endpoint instead of being dropped, so the transfer succeeds rather than hanging to its deadline.
fn reply_waits_for_the_receivers_endpoint(config: &str) {
    let a = open(config);
    let b = open(config);
    let dst = buffer(&b, 1 << 16, 41);
    let src = buffer(&a, 1 << 16, 42);
    b.plugin.hold_commands_for_tests(true);
    a.plugin.connect(PEER_B, &b.plugin.local_endpoint()).unwrap();
    b.plugin.connect(PEER_A, &a.plugin.local_endpoint()).unwrap();
    expect(&b, 7, PEER_A, LONG, &[LocalRange { key: dst.key, offset: 0, len: 1 << 16 }]);
    let remote = a.plugin.import_remote_key(PEER_B, &dst.remote_key_bytes).unwrap();
    let seg = Segment { local: src.key, local_offset: 0, remote, remote_offset: 0, len: PIECE as u64 };
    submit(&a, 1, PEER_B, 7, LONG, &[seg]).unwrap();
    // B lands the bytes while its connect is still queued.
    let until = Instant::now() + WAIT_LIMIT;
    while !landed(&dst.bytes[..PIECE], &src.bytes[..PIECE]) {
        assert!(Instant::now() < until, "B never landed the bytes");
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        a.log.count(|e| e.is_terminal() && e.xfer == XferId(1)),
        0,
        "ended before B could answer: {:?}",
        a.log.all()
    );
    b.plugin.hold_commands_for_tests(false);
    let end = a.log.terminal_of(XferId(1), WAIT_LIMIT);
    assert_eq!(end.kind, EventKind::SUCCEEDED, "{end:?}");
    a.plugin.release_remote_key(remote);
    for side in [&a, &b] {
        side.plugin.shutdown();
    }
}

#[test]
fn tcp_reply_waits_for_the_receivers_endpoint() {
    reply_waits_for_the_receivers_endpoint(&tcp_config());
}

#[test]
fn sm_am_reply_waits_for_the_receivers_endpoint() {
    reply_waits_for_the_receivers_endpoint(&sm_am_config());
}
