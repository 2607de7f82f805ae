//! Succeeded means every byte landed: checksums of random data over odd sizes, unaligned offsets and
//! scatter lists of 10 000 segments, between two shm instances acting as two gateways.

mod common;
use common::*;
use kvgate_abi::{EventKind, XferId};

const SEED: u64 = 0x6b76_6761_7465;

/// Copy `len` bytes from `src_offset` to `dst_offset` in one segment and compare checksums, and that
/// the bytes around the destination range were left alone.
fn one_segment_copy(pair: &Pair, xfer: u64, len: usize, src_offset: usize, dst_offset: usize) {
    let src = region(src_offset + len + 64);
    let dst = region(dst_offset + len + 64);
    let seed = SEED ^ xfer;
    fill(src.as_mut_slice(), seed);
    dst.as_mut_slice().fill(0xA5);
    let (local, _, remote) = pair.regions(&src, &dst);
    ok(pair.submit(xfer, NO_TIMEOUT_NS, &[segment(local, src_offset as u64, remote, dst_offset as u64, len as u64)]));
    let done = pair.sender.events.settled(XferId(xfer));
    assert_eq!(done.kind, EventKind::SUCCEEDED, "len {len} seed {seed:#x}: {done:?}");
    assert_eq!(done.bytes, len as u64);
    let want = checksum(&src.as_slice()[src_offset..src_offset + len]);
    let got = checksum(&dst.as_slice()[dst_offset..dst_offset + len]);
    assert_eq!(got, want, "len {len} src+{src_offset} dst+{dst_offset} seed {seed:#x}");
    assert!(dst.as_slice()[..dst_offset].iter().all(|&b| b == 0xA5), "bytes before the destination untouched");
    assert!(dst.as_slice()[dst_offset + len..].iter().all(|&b| b == 0xA5), "bytes after the destination untouched");
}

// CONFORMANCE: DATA-1
#[test]
fn odd_sizes_arrive_intact() {
    let pair = Pair::new("chunk_bytes = 65536");
    for (i, len) in [0usize, 1, 4095, 64 << 10, 4 << 20, (4 << 20) + 3].into_iter().enumerate() {
        one_segment_copy(&pair, i as u64 + 1, len, 0, 0);
    }
}

// CONFORMANCE: DATA-1
#[test]
fn unaligned_offsets_arrive_intact() {
    let pair = Pair::new("");
    for (i, (src_off, dst_off, len)) in
        [(1, 3, 4095), (7, 0, 65_537), (4093, 4099, 1), (0, 13, (1 << 20) + 11)].into_iter().enumerate()
    {
        one_segment_copy(&pair, 100 + i as u64, len, src_off, dst_off);
    }
}

// CONFORMANCE: DATA-2
/// 10 000 segments of varied sizes, scattered in reverse order over the destination.
#[test]
fn ten_thousand_segment_scatter_list_arrives_intact() {
    let pair = Pair::new("chunk_bytes = 16384");
    let count = 10_000usize;
    let lens: Vec<u64> = (0..count).map(|i| 1 + (i as u64 * 7919) % 600).collect();
    let total: u64 = lens.iter().sum();
    let src = region(total as usize);
    let dst = region(total as usize);
    fill(src.as_mut_slice(), SEED);
    let (local, _, remote) = pair.regions(&src, &dst);
    let mut segments = Vec::with_capacity(count);
    let (mut src_at, mut dst_end) = (0u64, total);
    for &len in &lens {
        dst_end -= len;
        segments.push(segment(local, src_at, remote, dst_end, len));
        src_at += len;
    }
    ok(pair.submit(7, NO_TIMEOUT_NS, &segments));
    let done = pair.sender.events.settled(XferId(7));
    assert_eq!((done.kind, done.bytes), (EventKind::SUCCEEDED, total), "{done:?}");
    for s in segments.iter().step_by(1).take(count) {
        let want = &src.as_slice()[s.local_offset as usize..(s.local_offset + s.len) as usize];
        let got = &dst.as_slice()[s.remote_offset as usize..(s.remote_offset + s.len) as usize];
        assert!(
            want == got,
            "segment at src {} dst {} len {} differs (seed {SEED:#x})",
            s.local_offset,
            s.remote_offset,
            s.len
        );
    }
}

/// Many transfers at once on several workers, each into its own slice of one destination.
#[test]
fn concurrent_transfers_each_land_in_their_own_slice() {
    let pair = Pair::new("workers = 3\nchunk_bytes = 8192");
    let slice = 100_003usize;
    let count = 40u64;
    let src = region(slice * count as usize);
    let dst = region(slice * count as usize);
    fill(src.as_mut_slice(), SEED + 1);
    let (local, _, remote) = pair.regions(&src, &dst);
    for x in 0..count {
        let at = x * slice as u64;
        ok(pair.submit(1000 + x, NO_TIMEOUT_NS, &[segment(local, at, remote, at, slice as u64)]));
    }
    for x in 0..count {
        assert_eq!(pair.sender.events.settled(XferId(1000 + x)).kind, EventKind::SUCCEEDED);
    }
    assert_eq!(checksum(src.as_slice()), checksum(dst.as_slice()));
}

/// Both instances send to each other: each is a gateway with its own regions and keys.
#[test]
fn two_instances_send_to_each_other() {
    let pair = Pair::new("");
    let (a_src, a_dst, b_src, b_dst) = (region(300_000), region(300_000), region(300_000), region(300_000));
    fill(a_src.as_mut_slice(), 11);
    fill(b_src.as_mut_slice(), 22);
    let (a_local, _, a_remote) = pair.regions(&a_src, &b_dst);
    let b_local = ok(pair.receiver.transport.register(&b_src.desc())).key;
    let a_dst_key = ok(pair.sender.transport.register(&a_dst.desc()));
    let b_remote = ok(pair
        .receiver
        .transport
        .import_remote_key(SENDER, kvgate_abi::abi_stable::std_types::RSlice::from_slice(&a_dst_key.remote_key)));
    ok(pair.submit(1, NO_TIMEOUT_NS, &[segment(a_local, 0, a_remote, 0, 300_000)]));
    let back_segments = [segment(b_local, 0, b_remote, 0, 300_000)];
    let back = kvgate_abi::SubmitRequest { peer: SENDER, ..request(1, NO_TIMEOUT_NS, &back_segments) };
    ok(pair.receiver.transport.submit(back));
    assert_eq!(pair.sender.events.settled(XferId(1)).kind, EventKind::SUCCEEDED);
    assert_eq!(pair.receiver.events.settled(XferId(1)).kind, EventKind::SUCCEEDED);
    assert_eq!(checksum(a_src.as_slice()), checksum(b_dst.as_slice()));
    assert_eq!(checksum(b_src.as_slice()), checksum(a_dst.as_slice()));
}

/// A region backed by a named file in /dev/shm (not a memfd) works the same way.
#[test]
fn dev_shm_file_regions_work_too() {
    let dir = std::path::Path::new("/dev/shm");
    if !dir.is_dir() {
        panic!("/dev/shm is missing on this machine; the shm plugin's named-file regions need it");
    }
    let pair = Pair::new("");
    let name = format!("kvgate-shm-test-{}", std::process::id());
    let src = region(10_000);
    let dst = kvgate_plugin_shm::SharedRegion::in_dir(dir, &name, 10_000).unwrap();
    fill(src.as_mut_slice(), 5);
    let (local, _, remote) = pair.regions(&src, &dst);
    ok(pair.submit(9, NO_TIMEOUT_NS, &[segment(local, 0, remote, 0, 10_000)]));
    assert_eq!(pair.sender.events.settled(XferId(9)).kind, EventKind::SUCCEEDED);
    assert_eq!(src.as_slice(), dst.as_slice());
    let path = dst.path().to_string();
    drop(dst);
    assert!(!std::path::Path::new(&path).exists(), "the named file is removed on drop");
}
