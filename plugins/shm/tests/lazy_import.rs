//! Importing a peer's region opens and checks its file but maps nothing: the mapping is made when
//! a transfer first writes into the region (so a region never written, such as a peer's source
//! pool, is never mapped), and one peer's imports are bounded by `max_import_bytes_per_peer`.

mod common;
use common::*;
use kvgate_abi::abi_stable::std_types::RSlice;
use kvgate_abi::{EventKind, ReasonCode, XferId};
use std::os::unix::fs::MetadataExt;

/// How many mappings of the file with inode `ino` this process holds.
fn mappings_of(ino: u64) -> usize {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines().filter(|l| l.split_whitespace().nth(4).and_then(|i| i.parse::<u64>().ok()) == Some(ino)).count()
}

#[test]
fn a_peer_region_is_mapped_only_when_a_transfer_first_writes_into_it() {
    let pair = Pair::new("");
    let (src, dst) = (region(1 << 20), region(8 << 20));
    src.as_mut_slice().fill(7);
    let ino = std::fs::metadata(dst.path()).unwrap().ino();
    let owner_mappings = mappings_of(ino);
    assert!(owner_mappings >= 1, "the owner maps its own region");
    let (l, _, r) = pair.regions(&src, &dst);
    assert_eq!(mappings_of(ino), owner_mappings, "importing the key mapped the region");
    ok(pair.submit(1, NO_TIMEOUT_NS, &[segment(l, 0, r, 4096, 1 << 20)]));
    assert_eq!(pair.sender.events.settled(XferId(1)).kind, EventKind::SUCCEEDED);
    assert_eq!(mappings_of(ino), owner_mappings + 1, "the first transfer maps it, once");
    ok(pair.submit(2, NO_TIMEOUT_NS, &[segment(l, 0, r, 2 << 20, 1 << 20)]));
    assert_eq!(pair.sender.events.settled(XferId(2)).kind, EventKind::SUCCEEDED);
    assert_eq!(mappings_of(ino), owner_mappings + 1, "later transfers reuse the mapping");
    assert!(dst.as_slice()[4096..4096 + (1 << 20)].iter().all(|&b| b == 7));
    assert!(dst.as_slice()[2 << 20..(2 << 20) + (1 << 20)].iter().all(|&b| b == 7));
    pair.sender.transport.release_remote_key(r);
}

#[test]
fn one_peers_imports_are_bounded_at_and_just_past_the_limit() {
    let pair = Pair::new("max_import_bytes_per_peer = 1048576");
    let (src, half, other_half, one_more) = (region(4096), region(512 << 10), region(512 << 10), region(4096));
    let (_, _, first) = pair.regions(&src, &half);
    let (_, _, second) = pair.regions(&src, &other_half);
    // Exactly at the bound: accepted. One page past it: refused with the reason.
    let dest = ok(pair.receiver.transport.register(&one_more.desc()));
    let e = err(pair.sender.transport.import_remote_key(RECEIVER, RSlice::from_slice(&dest.remote_key)));
    assert_eq!(e.code, ReasonCode::RESOURCE_EXHAUSTED, "{e}");
    assert!(e.message.contains("max_import_bytes_per_peer"), "{e}");
    // A released key makes room again.
    pair.sender.transport.release_remote_key(first);
    let third = ok(pair.sender.transport.import_remote_key(RECEIVER, RSlice::from_slice(&dest.remote_key)));
    for key in [second, third] {
        pair.sender.transport.release_remote_key(key);
    }
}
