//! GPU tests of the NVLink plugin: real device memory, real CUDA IPC, two processes on one GPU.
//! Every test is `#[ignore]`d (the CPU-only suite must not count them as passed) and fails loudly
//! when run without a GPU. Run them with `tests/gpu/run.sh` (or `cargo test -p
//! kvgate-plugin-nvlink --release --test gpu -- --ignored --test-threads=1`).

mod gpu_support;

use cudarc::driver::CudaContext;
use gpu_support::*;
use kvgate_abi::sdk::Plugin;
use kvgate_abi::*;
use kvgate_plugin_nvlink::device_buffer::{pattern, DeviceBuffer};
use kvgate_plugin_nvlink::cuda;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;

const MIB: u64 = 1 << 20;

fn device0() -> Arc<CudaContext> {
    require_gpu();
    CudaContext::new(0).expect("CUDA device 0")
}

fn submit(p: &impl Plugin, xfer: u64, segments: &[Segment], timeout_ns: u64) -> Result<(), PluginError> {
    p.submit(&SubmitRequest {
        xfer: XferId(xfer),
        peer: B_PEER,
        ticket: Ticket(xfer),
        timeout_ns,
        segments: segments.into(),
    })
}

const TEN_S: u64 = 10_000_000_000;

#[test]
#[ignore = "needs an NVIDIA GPU: run tests/gpu/run.sh"]
fn gpu_odd_sizes_and_unaligned_offsets_arrive_intact() {
    let ctx = device0();
    let pair = Pair::open("chunk_bytes = 1048576\nstreams_per_peer = 2");
    let cap = 64 * MIB + 4096;
    let src = DeviceBuffer::alloc(&ctx, cap).unwrap();
    let dst = DeviceBuffer::alloc(&ctx, cap).unwrap();
    let data = pattern(11, cap as usize);
    src.write(0, &data).unwrap();
    let src_reg = pair.a.register(&cuda_region(0, src.ptr, cap)).unwrap();
    let dst_reg = pair.b.register(&cuda_region(0, dst.ptr, cap)).unwrap();
    let remote = pair.a.import_remote_key(B_PEER, &dst_reg.remote_key).unwrap();
    for (i, &(len, src_off, dst_off)) in
        [(0u64, 0u64, 0u64), (1, 3, 5), (4095, 1, 7), (65536, 4096, 3), (4 * MIB, 17, 1), (64 * MIB, 5, 9)].iter().enumerate()
    {
        let seg = Segment { local: src_reg.key, local_offset: src_off, remote, remote_offset: dst_off, len };
        submit(&pair.a, i as u64 + 1, &[seg], TEN_S).unwrap();
        let e = wait_terminal(&pair.a_events, XferId(i as u64 + 1), 30);
        assert_eq!((e.kind, e.bytes), (EventKind::SUCCEEDED, len), "{len} bytes: {e:?}");
        let got = dst.read(dst_off, len).unwrap();
        assert!(got == data[src_off as usize..(src_off + len) as usize], "{len} bytes at {src_off}->{dst_off} differ");
    }
    let stats = pair.a.stats();
    assert_eq!((stats.live_transfers, stats.unquiesced_transfers), (0, 0));
}

#[test]
#[ignore = "needs an NVIDIA GPU: run tests/gpu/run.sh"]
fn gpu_ten_thousand_segment_scatter_gather_arrives_intact() {
    let ctx = device0();
    let pair = Pair::open("max_segments_per_submit = 20000");
    let n = 10_000u64;
    let piece = 1000u64; // not a power of two: segments never align
    let src = DeviceBuffer::alloc(&ctx, n * piece).unwrap();
    let dst = DeviceBuffer::alloc(&ctx, n * piece * 2).unwrap();
    let data = pattern(12, (n * piece) as usize);
    src.write(0, &data).unwrap();
    let s = pair.a.register(&cuda_region(0, src.ptr, n * piece)).unwrap();
    let d = pair.b.register(&cuda_region(0, dst.ptr, n * piece * 2)).unwrap();
    let remote = pair.a.import_remote_key(B_PEER, &d.remote_key).unwrap();
    // Source piece i goes to destination slot (n - 1 - i) * 2: reversed and spread out.
    let segments: Vec<Segment> = (0..n)
        .map(|i| Segment { local: s.key, local_offset: i * piece, remote, remote_offset: (n - 1 - i) * 2 * piece, len: piece })
        .collect();
    submit(&pair.a, 1, &segments, TEN_S).unwrap();
    let e = wait_terminal(&pair.a_events, XferId(1), 60);
    assert_eq!((e.kind, e.bytes), (EventKind::SUCCEEDED, n * piece), "{e:?}");
    let got = dst.read(0, n * piece * 2).unwrap();
    for i in 0..n {
        let want = &data[(i * piece) as usize..((i + 1) * piece) as usize];
        let at = ((n - 1 - i) * 2 * piece) as usize;
        assert!(&got[at..at + piece as usize] == want, "piece {i} differs");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run tests/gpu/run.sh"]
fn gpu_cancel_mid_transfer_fails_then_quiesces_and_stops_between_chunks() {
    let ctx = device0();
    let pair = Pair::open("chunk_bytes = 65536\nmax_copies_in_flight_per_transfer = 1\nstreams_per_peer = 1");
    let len = 512 * MIB;
    let src = DeviceBuffer::alloc(&ctx, len).unwrap();
    let dst = DeviceBuffer::alloc(&ctx, len).unwrap();
    src.write(len - 4096, &[0xab; 4096]).unwrap();
    dst.write(len - 4096, &[0x00; 4096]).unwrap();
    let s = pair.a.register(&cuda_region(0, src.ptr, len)).unwrap();
    let d = pair.b.register(&cuda_region(0, dst.ptr, len)).unwrap();
    let remote = pair.a.import_remote_key(B_PEER, &d.remote_key).unwrap();
    submit(&pair.a, 7, &[Segment { local: s.key, local_offset: 0, remote, remote_offset: 0, len }], TEN_S).unwrap();
    pair.a.cancel(XferId(7));
    let e = wait_terminal(&pair.a_events, XferId(7), 5);
    assert_eq!((e.kind, e.reason), (EventKind::FAILED, ReasonCode::CANCELLED), "{e:?}");
    if e.flags & event_flags::QUIESCED == 0 {
        let q = next_event(&pair.a_events, 5);
        assert_eq!((q.kind, q.xfer), (EventKind::QUIESCED, XferId(7)), "{q:?}");
    }
    // 8192 chunks of 64 KiB with one in flight: the cancel stopped the copy long before the end.
    assert_eq!(dst.read(len - 4096, 4096).unwrap(), vec![0u8; 4096], "the last chunk was copied despite the cancel");
    let stats = pair.a.stats();
    assert_eq!((stats.live_transfers, stats.unquiesced_transfers), (0, 0));
    pair.a.cancel(XferId(7)); // cancel after terminal: harmless, no event
    assert!(pair.a_events.recv_timeout(std::time::Duration::from_millis(100)).is_err());
}

#[test]
#[ignore = "needs an NVIDIA GPU: run tests/gpu/run.sh"]
fn gpu_own_timeout_fails_a_transfer_that_cannot_finish_in_time() {
    let ctx = device0();
    let pair = Pair::open("chunk_bytes = 65536\nmax_copies_in_flight_per_transfer = 1");
    let len = 512 * MIB;
    let src = DeviceBuffer::alloc(&ctx, len).unwrap();
    let dst = DeviceBuffer::alloc(&ctx, len).unwrap();
    let s = pair.a.register(&cuda_region(0, src.ptr, len)).unwrap();
    let d = pair.b.register(&cuda_region(0, dst.ptr, len)).unwrap();
    let remote = pair.a.import_remote_key(B_PEER, &d.remote_key).unwrap();
    submit(&pair.a, 8, &[Segment { local: s.key, local_offset: 0, remote, remote_offset: 0, len }], 1_000).unwrap();
    let e = wait_terminal(&pair.a_events, XferId(8), 5);
    assert_eq!((e.kind, e.reason), (EventKind::FAILED, ReasonCode::TIMEOUT), "{e:?}");
}

#[test]
#[ignore = "needs an NVIDIA GPU: run tests/gpu/run.sh"]
fn gpu_register_refuses_host_memory_foreign_pointers_and_overlong_regions() {
    let ctx = device0();
    let pair = Pair::open("");
    let buf = DeviceBuffer::alloc(&ctx, MIB).unwrap();
    let host = RegionDesc { kind: MemoryKind::HOST, device: -1, addr: 0x1000, len: 4096, ..RegionDesc::default() };
    assert_eq!(pair.a.register(&host).unwrap_err().code, ReasonCode::UNSUPPORTED_MEMORY);
    let on_stack = [0u8; 64];
    let e = pair.a.register(&cuda_region(0, on_stack.as_ptr() as u64, 64)).unwrap_err();
    assert_eq!(e.code, ReasonCode::UNSUPPORTED_MEMORY, "{e}");
    pair.a.register(&cuda_region(0, buf.ptr, MIB)).unwrap();
    assert_eq!(pair.a.register(&cuda_region(0, buf.ptr + 1, MIB)).unwrap_err().code, ReasonCode::OUT_OF_RANGE);
    let mut bad_key = pair.b.register(&cuda_region(0, buf.ptr, MIB)).unwrap().remote_key.to_vec();
    bad_key[20] ^= 1;
    assert_eq!(pair.a.import_remote_key(B_PEER, &bad_key).unwrap_err().code, ReasonCode::INVALID_ARGUMENT);
    // A key made by `a` itself, presented as `b`'s: foreign to that peer.
    let own = pair.a.register(&cuda_region(0, buf.ptr, MIB)).unwrap();
    assert_eq!(pair.a.import_remote_key(B_PEER, &own.remote_key).unwrap_err().code, ReasonCode::INVALID_ARGUMENT);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run tests/gpu/run.sh"]
fn gpu_shutdown_with_live_transfers_fails_them_and_releases_everything() {
    let ctx = device0();
    let pair = Pair::open("chunk_bytes = 65536\nmax_copies_in_flight_per_transfer = 1");
    let len = 256 * MIB;
    let src = DeviceBuffer::alloc(&ctx, len).unwrap();
    let dst = DeviceBuffer::alloc(&ctx, len).unwrap();
    let s = pair.a.register(&cuda_region(0, src.ptr, len)).unwrap();
    let d = pair.b.register(&cuda_region(0, dst.ptr, len)).unwrap();
    let remote = pair.a.import_remote_key(B_PEER, &d.remote_key).unwrap();
    for x in 1..=4 {
        submit(&pair.a, x, &[Segment { local: s.key, local_offset: 0, remote, remote_offset: 0, len }], TEN_S).unwrap();
    }
    pair.a.shutdown();
    let mut terminal = std::collections::HashMap::new();
    while let Ok(e) = pair.a_events.try_recv() {
        if e.is_terminal() {
            assert!(terminal.insert(e.xfer, e.clone()).is_none(), "second terminal event {e:?}");
        }
    }
    assert_eq!(terminal.len(), 4, "every live transfer got its terminal event before shutdown returned");
    let stats = pair.a.stats();
    assert_eq!((stats.live_transfers, stats.registered_regions, stats.imported_remote_keys, stats.healthy), (0, 0, 0, 0));
    assert_eq!(submit(&pair.a, 9, &[], TEN_S).unwrap_err().code, ReasonCode::SHUTDOWN);
}

/// Environment variable that turns the two-process test into its child half.
const CHILD_ENV: &str = "KVGATE_NVLINK_GPU_CHILD";

#[test]
#[ignore = "needs an NVIDIA GPU: run tests/gpu/run.sh"]
fn gpu_two_processes_on_one_gpu_through_ipc_handles() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return ipc_child();
    }
    let ctx = device0();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "gpu_two_processes_on_one_gpu_through_ipc_handles", "--ignored", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the child process");
    let mut to_child = child.stdin.take().unwrap();
    // The child's lines through a channel, so that every wait for it is bounded and names its stage.
    let (lines_tx, lines) = std::sync::mpsc::channel::<String>();
    let from_child = BufReader::new(child.stdout.take().unwrap());
    std::thread::spawn(move || from_child.lines().map_while(Result::ok).try_for_each(|l| lines_tx.send(l)));
    let started = std::time::Instant::now();
    let next_line = |stage: &str| -> String {
        match lines.recv_timeout(std::time::Duration::from_secs(CHILD_STEP_TIMEOUT_S)) {
            Ok(line) => line,
            Err(e) => panic!("child: no line within {CHILD_STEP_TIMEOUT_S} s waiting for {stage} ({e}; {:?} in)", started.elapsed()),
        }
    };
    let field = |name: &str| -> Vec<u8> {
        loop {
            // Anywhere in the line: the child's test harness prints `test <name> ... ` without a
            // line end before the test's own first line.
            let line = next_line(name);
            let tag = format!("NVLINK-CHILD {name} ");
            if let Some(at) = line.find(&tag) {
                eprintln!("parent: child's {name} after {:?}", started.elapsed());
                return unhex(line[at + tag.len()..].trim());
            }
        }
    };
    let child_endpoint = field("ENDPOINT");
    let child_key = field("KEY");
    let engine_handle = field("ENGINE-HANDLE");

    // 1. Write into the child's region through its remote key (cuIpcOpenMemHandle in this process).
    let (a, a_events) = open_instance("chunk_bytes = 4194304");
    a.connect(B_PEER, &child_endpoint).unwrap();
    let remote = a.import_remote_key(B_PEER, &child_key).unwrap();
    let len = 48 * MIB + 3;
    let src = DeviceBuffer::alloc(&ctx, len).unwrap();
    let data = pattern(21, len as usize);
    src.write(0, &data).unwrap();
    let s = a.register(&cuda_region(0, src.ptr, len)).unwrap();
    submit(&a, 1, &[Segment { local: s.key, local_offset: 0, remote, remote_offset: 5, len }], TEN_S).unwrap();
    let e = wait_terminal(&a_events, XferId(1), 30);
    assert_eq!(e.kind, EventKind::SUCCEEDED, "{e:?}");
    writeln!(to_child, "CHECK 21 5 {len}").unwrap();
    eprintln!("parent: 48 MiB written into the child's region after {:?}", started.elapsed());
    let verdict = loop {
        let line = next_line("VERDICT");
        if let Some(at) = line.find("NVLINK-CHILD VERDICT ") {
            break line[at + "NVLINK-CHILD VERDICT ".len()..].trim().to_string();
        }
    };
    assert_eq!(verdict, "OK", "the child saw other bytes than were sent");

    // 2. The child as an engine: its memory, handed over as an IPC handle, is a local source here.
    let (b, _b_events) = open_instance("");
    a.connect(PeerId(3), &b.local_endpoint()).unwrap();
    let dst = DeviceBuffer::alloc(&ctx, 8 * MIB).unwrap();
    let d = b.register(&cuda_region(0, dst.ptr, 8 * MIB)).unwrap();
    let engine_region = RegionDesc { addr: 0, ipc_handle: engine_handle.into(), backing_offset: 4096, ..cuda_region(0, 0, 8 * MIB) };
    let from_engine = a.register(&engine_region).unwrap();
    let remote_b = a.import_remote_key(PeerId(3), &d.remote_key).unwrap();
    a.submit(&SubmitRequest {
        xfer: XferId(2),
        peer: PeerId(3),
        ticket: Ticket(2),
        timeout_ns: TEN_S,
        segments: (&[Segment { local: from_engine.key, local_offset: 0, remote: remote_b, remote_offset: 0, len: 8 * MIB }][..]).into(),
    })
    .unwrap();
    let e = wait_terminal(&a_events, XferId(2), 30);
    assert_eq!(e.kind, EventKind::SUCCEEDED, "{e:?}");
    assert!(dst.read(0, 8 * MIB).unwrap() == pattern(22, (8 * MIB + 4096) as usize)[4096..], "engine bytes differ");

    a.release_remote_key(remote);
    a.deregister(from_engine.key).unwrap();
    writeln!(to_child, "EXIT").unwrap();
    eprintln!("parent: engine bytes checked after {:?}; waiting for the child to exit", started.elapsed());
    assert!(child.wait().unwrap().success(), "the child process failed");
}

/// How long the parent waits for each line of the two-process test's child.
const CHILD_STEP_TIMEOUT_S: u64 = 45;

/// The child half: registers 64 MiB with its own instance, exports a second buffer as an engine
/// would, prints endpoint, key and handle, then checks what the parent wrote.
fn ipc_child() {
    let started = std::time::Instant::now();
    let ctx = CudaContext::new(0).expect("child: CUDA device 0");
    eprintln!("child: CUDA context after {:?}", started.elapsed());
    let (plugin, _events) = open_instance("");
    let region = DeviceBuffer::alloc(&ctx, 64 * MIB).unwrap();
    let reg = plugin.register(&cuda_region(0, region.ptr, 64 * MIB)).unwrap();
    let engine = DeviceBuffer::alloc(&ctx, 8 * MIB + 4096).unwrap();
    engine.write(0, &pattern(22, (8 * MIB + 4096) as usize)).unwrap();
    let handle = cuda::export_ipc_handle(&ctx, engine.ptr).unwrap();
    eprintln!("child: registered and exported after {:?}", started.elapsed());
    println!("NVLINK-CHILD ENDPOINT {}", hex(&plugin.local_endpoint()));
    println!("NVLINK-CHILD KEY {}", hex(&reg.remote_key));
    println!("NVLINK-CHILD ENGINE-HANDLE {}", hex(&handle));
    std::io::stdout().flush().unwrap();
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["CHECK", seed, offset, len] => {
                let (seed, offset, len): (u64, u64, u64) = (seed.parse().unwrap(), offset.parse().unwrap(), len.parse().unwrap());
                let ok = region.read(offset, len).unwrap() == pattern(seed, len as usize);
                println!("NVLINK-CHILD VERDICT {}", if ok { "OK" } else { "MISMATCH" });
                std::io::stdout().flush().unwrap();
            }
            ["EXIT"] => break,
            other => panic!("child: unknown command {other:?}"),
        }
    }
    drop(plugin);
}
