//! Bad inputs are refused synchronously, with the right reason code, before any byte moves; limits are
//! accepted at their value and refused just past it; peers' keys are checked against their nonce.

mod common;
use common::*;
use kvgate_abi::abi_stable::std_types::RSlice;
use kvgate_abi::{EventKind, LocalKey, MemoryKind, PeerId, ReasonCode, RegionDesc, RemoteKey, XferId};
use std::time::Duration;

/// A submit refused: no event follows, stats do not move, the destination is untouched.
fn assert_refused(
    pair: &Pair,
    dst: &kvgate_plugin_shm::SharedRegion,
    code: ReasonCode,
    segments: &[kvgate_abi::Segment],
) {
    let before = (pair.sender.stats(), pair.sender.events.all().len(), checksum(dst.as_slice()));
    let e = err(pair.submit(77, NO_TIMEOUT_NS, segments));
    assert_eq!(e.code, code, "{e}");
    std::thread::sleep(Duration::from_millis(10));
    assert_eq!((pair.sender.stats(), pair.sender.events.all().len(), checksum(dst.as_slice())), before);
}

/// A file on disk (in the target directory, next to this test binary), which is not shared memory.
fn disk_file(tag: &str) -> std::path::PathBuf {
    let path =
        std::env::current_exe().unwrap().with_file_name(format!("kvgate-shm-disk-file-{tag}-{}", std::process::id()));
    std::fs::write(&path, vec![0u8; 16384]).unwrap();
    path
}

// CONFORMANCE: DATA-3
#[test]
fn segments_are_checked_against_both_regions_before_any_byte_moves() {
    let pair = Pair::new("");
    let (src, dst) = (region(4096), region(8192));
    src.as_mut_slice().fill(1);
    let (l, _, r) = pair.regions(&src, &dst);
    let good = segment(l, 0, r, 0, 16);
    // Each bad segment comes after a good one: the good one must not be copied either.
    let cases = [
        (ReasonCode::UNKNOWN_KEY, segment(LocalKey(9999), 0, r, 0, 1)),
        (ReasonCode::UNKNOWN_KEY, segment(l, 0, RemoteKey(9999), 0, 1)),
        (ReasonCode::OUT_OF_RANGE, segment(l, 1, r, 0, 4096)),
        (ReasonCode::OUT_OF_RANGE, segment(l, 4097, r, 0, 0)),
        (ReasonCode::OUT_OF_RANGE, segment(l, 0, r, 8191, 2)),
        (ReasonCode::OUT_OF_RANGE, segment(l, u64::MAX, r, 0, 2)),
        (ReasonCode::OUT_OF_RANGE, segment(l, 0, r, 1, u64::MAX)),
    ];
    for (code, bad) in cases {
        assert_refused(&pair, &dst, code, &[good, bad]);
    }
    // Exactly at the end of both regions is fine.
    ok(pair.submit(1, NO_TIMEOUT_NS, &[segment(l, 4095, r, 8191, 1), segment(l, 0, r, 4096, 4096)]));
    assert_eq!(pair.sender.events.settled(XferId(1)).kind, EventKind::SUCCEEDED);
}

#[test]
fn a_remote_key_is_used_only_for_the_peer_it_was_imported_from() {
    let pair = Pair::new("");
    let (src, dst) = (region(4096), region(4096));
    let (l, _, r) = pair.regions(&src, &dst);
    let segments = [segment(l, 0, r, 0, 8)];
    // A peer never connected is refused as such, even with no segment at all.
    let unknown_peer = kvgate_abi::SubmitRequest { peer: PeerId(42), ..request(1, NO_TIMEOUT_NS, &[]) };
    assert_eq!(err(pair.sender.transport.submit(unknown_peer)).code, ReasonCode::PEER_UNREACHABLE);
    // A connected peer cannot be written through another peer's key.
    ok(pair.sender.transport.connect(PeerId(42), RSlice::from_slice(&pair.receiver.transport.local_endpoint())));
    let wrong_peer = kvgate_abi::SubmitRequest { peer: PeerId(42), ..request(1, NO_TIMEOUT_NS, &segments) };
    assert_eq!(err(pair.sender.transport.submit(wrong_peer)).code, ReasonCode::UNKNOWN_KEY);
    pair.sender.transport.release_remote_key(r);
    assert_eq!(err(pair.submit(1, NO_TIMEOUT_NS, &segments)).code, ReasonCode::UNKNOWN_KEY);
    assert_eq!(pair.sender.stats().imported_remote_keys, 0);
}

// CONFORMANCE: DATA-3
#[test]
fn bad_submit_arguments_are_refused() {
    let pair = Pair::new("max_segments_per_submit = 4\nmax_transfer_bytes = 100");
    let (src, dst) = (region(4096), region(4096));
    let (l, _, r) = pair.regions(&src, &dst);
    assert_eq!(err(pair.submit(1, 0, &[segment(l, 0, r, 0, 1)])).code, ReasonCode::INVALID_ARGUMENT);
    // max_segments_per_submit: 4 accepted, 5 refused.
    let four = vec![segment(l, 0, r, 0, 1); 4];
    ok(pair.submit(2, NO_TIMEOUT_NS, &four));
    let five = vec![segment(l, 0, r, 0, 1); 5];
    let e = err(pair.submit(3, NO_TIMEOUT_NS, &five));
    assert!(e.code == ReasonCode::RESOURCE_EXHAUSTED && e.message.contains("max_segments_per_submit"), "{e}");
    // max_transfer_bytes: 100 accepted, 101 refused.
    ok(pair.submit(4, NO_TIMEOUT_NS, &[segment(l, 0, r, 0, 60), segment(l, 0, r, 100, 40)]));
    let e = err(pair.submit(5, NO_TIMEOUT_NS, &[segment(l, 0, r, 0, 60), segment(l, 0, r, 100, 41)]));
    assert!(e.code == ReasonCode::RESOURCE_EXHAUSTED && e.message.contains("max_transfer_bytes"), "{e}");
    for x in [2, 4] {
        assert_eq!(pair.sender.events.settled(XferId(x)).kind, EventKind::SUCCEEDED);
    }
    assert!(pair.sender.events.of(XferId(3)).is_empty() && pair.sender.events.of(XferId(5)).is_empty());
}

// CONFORMANCE: TIME-11, DATA-3
/// The only worker is held inside the sink, so queued transfers stay live deterministically.
#[test]
fn max_inflight_transfers_and_duplicate_ids() {
    let pair = Pair::new("workers = 1\nmax_inflight_transfers = 2\ninline_copy_bytes = 0");
    let (src, dst) = (region(4096), region(4096));
    let (l, _, r) = pair.regions(&src, &dst);
    let seg = [segment(l, 0, r, 0, 100)];
    pair.sender.events.hold();
    ok(pair.submit(1, NO_TIMEOUT_NS, &seg));
    pair.sender.events.wait_count(1);
    ok(pair.submit(2, NO_TIMEOUT_NS, &seg));
    assert_eq!(err(pair.submit(2, NO_TIMEOUT_NS, &seg)).code, ReasonCode::DUPLICATE_ID);
    ok(pair.submit(3, NO_TIMEOUT_NS, &seg));
    assert_eq!(pair.sender.stats().live_transfers, 2);
    let e = err(pair.submit(4, NO_TIMEOUT_NS, &seg));
    assert!(e.code == ReasonCode::RESOURCE_EXHAUSTED && e.message.contains("max_inflight_transfers"), "{e}");
    pair.sender.events.release();
    for x in [1, 2, 3] {
        assert_eq!(pair.sender.events.settled(XferId(x)).kind, EventKind::SUCCEEDED);
    }
    // A finished id may be used again.
    ok(pair.submit(1, NO_TIMEOUT_NS, &seg));
    pair.sender.events.wait_count(4);
    let last = pair.sender.events.all().pop().unwrap();
    assert_eq!((last.xfer, last.kind), (XferId(1), EventKind::SUCCEEDED));
}

// CONFORMANCE: HANDSHAKE-3
#[test]
fn unservable_or_malformed_regions_are_refused_at_register() {
    let i = Instance::open("");
    let r = region(8192);
    let good = r.desc();
    let disk_file: kvgate_abi::abi_stable::std_types::RString =
        disk_file("register").to_string_lossy().into_owned().into();
    let cases = [
        (ReasonCode::UNSUPPORTED_MEMORY, RegionDesc { kind: MemoryKind::CUDA_DEVICE, device: 0, ..good.clone() }),
        (ReasonCode::UNSUPPORTED_MEMORY, RegionDesc { kind: MemoryKind(99), ..good.clone() }),
        (ReasonCode::INVALID_ARGUMENT, RegionDesc { len: 0, ..good.clone() }),
        (ReasonCode::INVALID_ARGUMENT, RegionDesc { addr: 0, ..good.clone() }),
        (ReasonCode::INVALID_ARGUMENT, RegionDesc { backing_path: "".into(), ..good.clone() }),
        (ReasonCode::INVALID_ARGUMENT, RegionDesc { backing_path: "relative/file".into(), ..good.clone() }),
        (ReasonCode::INVALID_ARGUMENT, RegionDesc { backing_path: "/nonexistent/kvgate/file".into(), ..good.clone() }),
        (ReasonCode::INVALID_ARGUMENT, RegionDesc { backing_path: disk_file.clone(), ..good.clone() }),
        (ReasonCode::INVALID_ARGUMENT, RegionDesc { backing_path: "/dev/shm".into(), ..good.clone() }),
        (ReasonCode::OUT_OF_RANGE, RegionDesc { len: 8193, ..good.clone() }),
        (ReasonCode::OUT_OF_RANGE, RegionDesc { backing_offset: 1, ..good.clone() }),
    ];
    for (code, desc) in cases {
        let e = err(i.transport.register(&desc));
        assert_eq!(e.code, code, "{desc:?}: {e}");
    }
    assert_eq!(i.stats().registered_regions, 0);
    std::fs::remove_file(disk_file.as_str()).unwrap();
    ok(i.transport.register(&RegionDesc { backing_offset: 4096, len: 4096, ..good }));
    assert_eq!(i.stats().registered_bytes, 4096);
}

// CONFORMANCE: HANDSHAKE-4
#[test]
fn endpoints_and_keys_are_checked() {
    let pair = Pair::new("");
    let dst = region(4096);
    let key = ok(pair.receiver.transport.register(&dst.desc())).remote_key;
    let t = &pair.sender.transport;
    // A key for a peer never connected.
    assert_eq!(err(t.import_remote_key(PeerId(5), RSlice::from_slice(&key))).code, ReasonCode::PEER_UNREACHABLE);
    // Malformed key and endpoint bytes.
    assert_eq!(err(t.import_remote_key(RECEIVER, RSlice::from_slice(&key[..10]))).code, ReasonCode::INVALID_ARGUMENT);
    assert_eq!(err(t.connect(PeerId(6), RSlice::from_slice(b"nonsense"))).code, ReasonCode::INVALID_ARGUMENT);
    // An endpoint from another host (other boot id).
    let mut foreign = pair.receiver.transport.local_endpoint().to_vec();
    foreign[8] ^= 0xFF;
    assert_eq!(err(t.connect(PeerId(7), RSlice::from_slice(&foreign))).code, ReasonCode::PEER_UNREACHABLE);
    // Connecting again with the same endpoint keeps the imported keys.
    let imported = ok(t.import_remote_key(RECEIVER, RSlice::from_slice(&key)));
    let same = pair.receiver.transport.local_endpoint();
    ok(t.connect(RECEIVER, RSlice::from_slice(&same)));
    assert_eq!(pair.sender.stats().imported_remote_keys, 1);
    t.release_remote_key(imported);
    // A key naming a file that is not shared memory (a peer trying to make us write to disk): even
    // held open by the peer's own process, it is refused.
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::MetadataExt;
    let real = kvgate_plugin_shm::wire::RemoteKeyBytes::decode(&key).unwrap();
    let disk_file = disk_file("import");
    let disk = std::fs::File::open(&disk_file).unwrap();
    let hostile = kvgate_plugin_shm::wire::RemoteKeyBytes {
        region_id: 1,
        backing_path: disk_file.to_string_lossy().into_owned(),
        backing_offset: 0,
        len: 1,
        owner_fd: disk.as_raw_fd() as u32,
        dev: disk.metadata().unwrap().dev(),
        ino: disk.metadata().unwrap().ino(),
        ..real.clone()
    };
    let e = err(t.import_remote_key(RECEIVER, RSlice::from_slice(&hostile.encode())));
    assert!(e.code == ReasonCode::INVALID_ARGUMENT && e.message.contains("not shared memory"), "{e}");
    drop(disk);
    std::fs::remove_file(&disk_file).unwrap();
    // A key naming a shared-memory file the peer never registered: the path in a key is never
    // opened, only the descriptor the peer's process holds, so a file it does not hold is refused.
    let name = format!("kvgate-shm-unregistered-{}", std::process::id());
    let stranger = kvgate_plugin_shm::SharedRegion::in_dir(std::path::Path::new("/dev/shm"), &name, 4096).unwrap();
    let named = kvgate_plugin_shm::wire::RemoteKeyBytes {
        backing_path: stranger.path().to_string(),
        owner_fd: 999_999,
        ..real.clone()
    };
    let e = err(t.import_remote_key(RECEIVER, RSlice::from_slice(&named.encode())));
    assert!(e.code == ReasonCode::UNKNOWN_KEY && e.message.contains("/fd/999999"), "{e}");
    // The peer's real descriptor but another file's identity (a descriptor number reused): refused.
    let reused = kvgate_plugin_shm::wire::RemoteKeyBytes { ino: real.ino ^ 1, ..real.clone() };
    let e = err(t.import_remote_key(RECEIVER, RSlice::from_slice(&reused.encode())));
    assert!(e.code == ReasonCode::UNKNOWN_KEY && e.message.contains("no longer the file the peer registered"), "{e}");
    drop(stranger);
    // A memfd region's size is sealed: nobody can shrink it under a peer's mapping.
    let sealed = region(4096);
    assert!(std::fs::OpenOptions::new().write(true).open(sealed.path()).unwrap().set_len(100).is_err());
    // A /dev/shm file can be shrunk: a key whose file shrank below the region is refused at import.
    let name = format!("kvgate-shm-shrink-{}", std::process::id());
    let src = kvgate_plugin_shm::SharedRegion::in_dir(std::path::Path::new("/dev/shm"), &name, 4096).unwrap();
    let short_key = ok(pair.receiver.transport.register(&src.desc())).remote_key;
    std::fs::OpenOptions::new().write(true).open(src.path()).unwrap().set_len(100).unwrap();
    assert_eq!(err(t.import_remote_key(RECEIVER, RSlice::from_slice(&short_key))).code, ReasonCode::OUT_OF_RANGE);
}

// CONFORMANCE: HANDSHAKE-2
/// A restarted peer (same peer id, new instance) makes the old keys stale: they are dropped when
/// the new endpoint is connected, and importing one again is refused.
#[test]
fn keys_of_a_restarted_peer_are_refused() {
    let pair = Pair::new("");
    let (src, dst) = (region(4096), region(4096));
    let (l, _, r) = pair.regions(&src, &dst);
    let old_key = ok(pair.receiver.transport.register(&dst.desc())).remote_key;
    let restarted = Instance::open("");
    ok(pair.sender.transport.connect(RECEIVER, RSlice::from_slice(&restarted.transport.local_endpoint())));
    assert_eq!(pair.sender.stats().imported_remote_keys, 0, "the old incarnation's keys are dropped");
    assert_eq!(err(pair.submit(1, NO_TIMEOUT_NS, &[segment(l, 0, r, 0, 8)])).code, ReasonCode::UNKNOWN_KEY);
    let e = err(pair.sender.transport.import_remote_key(RECEIVER, RSlice::from_slice(&old_key)));
    assert_eq!(e.code, ReasonCode::PEER_LOST, "{e}");
    let fresh = ok(restarted.transport.register(&dst.desc())).remote_key;
    ok(pair.sender.transport.import_remote_key(RECEIVER, RSlice::from_slice(&fresh)));
}

// CONFORMANCE: HYGIENE-3
#[test]
fn bad_configs_are_refused_at_open_naming_the_key() {
    for (config, key) in [("workers = 0", "workers"), ("chunk_bytes = 1", "chunk_bytes"), ("bogus = 1", "bogus")] {
        let e = Instance::try_open(config).err().expect("refused");
        assert_eq!(e.code, ReasonCode::INVALID_ARGUMENT);
        assert!(e.message.contains(key), "{config}: {e}");
    }
}
