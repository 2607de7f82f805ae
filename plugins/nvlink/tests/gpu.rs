//! GPU tests of the NVLink plugin: real device memory, real CUDA IPC, CUDA VMM allocations registered
//! by descriptor (one process, and two through the descriptor socket), two processes on one GPU.
//! Every test is `#[ignore]`d (the CPU-only suite must not count them as passed) and fails loudly
//! when run without a GPU. Run them with `tests/gpu/run.sh` (or `cargo test -p
//! kvgate-plugin-nvlink --release --test gpu -- --ignored --test-threads=1`).

mod gpu_support;

use cudarc::driver::{result, sys, CudaContext};
use gpu_support::*;
use kvgate_abi::cuda_vmm::CudaVmmBacking;
use kvgate_abi::sdk::Plugin;
use kvgate_abi::*;
use kvgate_plugin_nvlink::cuda;
use kvgate_plugin_nvlink::device_buffer::{pattern, DeviceBuffer};
use std::io::{BufRead, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
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
        [(0u64, 0u64, 0u64), (1, 3, 5), (4095, 1, 7), (65536, 4096, 3), (4 * MIB, 17, 1), (64 * MIB, 5, 9)]
            .iter()
            .enumerate()
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
        .map(|i| Segment {
            local: s.key,
            local_offset: i * piece,
            remote,
            remote_offset: (n - 1 - i) * 2 * piece,
            len: piece,
        })
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
    assert_eq!(
        (stats.live_transfers, stats.registered_regions, stats.imported_remote_keys, stats.healthy),
        (0, 0, 0, 0)
    );
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
    let (mut child, mut to_child, from_child) =
        spawn_child("gpu_two_processes_on_one_gpu_through_ipc_handles", CHILD_ENV, "NVLINK-CHILD");
    let started = std::time::Instant::now();
    let child_endpoint = from_child.bytes("ENDPOINT");
    let child_key = from_child.bytes("KEY");
    let engine_handle = from_child.bytes("ENGINE-HANDLE");

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
    let verdict = from_child.value("VERDICT");
    assert_eq!(verdict, "OK", "the child saw other bytes than were sent");

    // 2. The child as an engine: its memory, handed over as an IPC handle, is a local source here.
    let (b, _b_events) = open_instance("");
    a.connect(PeerId(3), &b.local_endpoint()).unwrap();
    let dst = DeviceBuffer::alloc(&ctx, 8 * MIB).unwrap();
    let d = b.register(&cuda_region(0, dst.ptr, 8 * MIB)).unwrap();
    let engine_region =
        RegionDesc { addr: 0, ipc_handle: engine_handle.into(), backing_offset: 4096, ..cuda_region(0, 0, 8 * MIB) };
    let from_engine = a.register(&engine_region).unwrap();
    let remote_b = a.import_remote_key(PeerId(3), &d.remote_key).unwrap();
    a.submit(&SubmitRequest {
        xfer: XferId(2),
        peer: PeerId(3),
        ticket: Ticket(2),
        timeout_ns: TEN_S,
        segments: (&[Segment {
            local: from_engine.key,
            local_offset: 0,
            remote: remote_b,
            remote_offset: 0,
            len: 8 * MIB,
        }][..])
            .into(),
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
                let (seed, offset, len): (u64, u64, u64) =
                    (seed.parse().unwrap(), offset.parse().unwrap(), len.parse().unwrap());
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

// ---- CUDA VMM (cuMemCreate) memory, registered by descriptor ------------------------------------

/// A VMM allocation made as an engine would (`cuMemCreate` with a POSIX-descriptor handle type,
/// granularity-rounded), mapped read/write for its device in this process; unmapped and released on
/// drop.
struct VmmBuffer {
    ctx: Arc<CudaContext>,
    handle: sys::CUmemGenericAllocationHandle,
    ptr: u64,
    /// The allocation's size (a multiple of the minimum granularity).
    size: u64,
}

fn check(what: &str, r: sys::CUresult) {
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "{what} failed");
}

fn device_location(ordinal: i32) -> sys::CUmemLocation {
    sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: ordinal }
}

impl VmmBuffer {
    fn create(ctx: &Arc<CudaContext>, min_len: u64) -> VmmBuffer {
        ctx.bind_to_thread().expect("bind context");
        let ordinal = ctx.ordinal() as i32;
        // SAFETY: all-zero is a valid value of this plain C struct; the fields that matter are set next.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        prop.location = device_location(ordinal);
        let mut granularity = 0usize;
        let minimum = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
        // SAFETY: out-pointer to a local; `prop` is initialised above.
        check("cuMemGetAllocationGranularity", unsafe {
            sys::cuMemGetAllocationGranularity(&mut granularity, &prop, minimum)
        });
        assert!(granularity > 0, "granularity 0");
        let size = min_len.div_ceil(granularity as u64) * granularity as u64;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: out-pointer to a local; size is a multiple of the granularity; no flags.
        check("cuMemCreate", unsafe { sys::cuMemCreate(&mut handle, size as usize, &prop, 0) });
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: out-pointer to a local; any address, aligned to the granularity.
        check("cuMemAddressReserve", unsafe { sys::cuMemAddressReserve(&mut ptr, size as usize, granularity, 0, 0) });
        // SAFETY: the range was just reserved; the whole allocation is mapped at offset 0.
        check("cuMemMap", unsafe { sys::cuMemMap(ptr, size as usize, 0, handle, 0) });
        let access = sys::CUmemAccessDesc {
            location: device_location(ordinal),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the range is mapped; one descriptor read from a local.
        check("cuMemSetAccess", unsafe { sys::cuMemSetAccess(ptr, size as usize, &access, 1) });
        VmmBuffer { ctx: ctx.clone(), handle, ptr, size }
    }

    /// A new POSIX descriptor of the allocation (`cuMemExportToShareableHandle`).
    fn export_fd(&self) -> OwnedFd {
        self.ctx.bind_to_thread().expect("bind context");
        let mut fd: i32 = -1;
        let kind = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        // SAFETY: for the POSIX descriptor type the driver writes an `int` through the pointer.
        check("cuMemExportToShareableHandle", unsafe {
            sys::cuMemExportToShareableHandle(&mut fd as *mut i32 as *mut std::ffi::c_void, self.handle, kind, 0)
        });
        assert!(fd >= 0, "exported descriptor {fd}");
        // SAFETY: the driver just created this descriptor for this process; it is owned once, here.
        unsafe { OwnedFd::from_raw_fd(fd) }
    }

    /// The region an engine's gateway would hand the plugin for `len` bytes at `offset` of this
    /// allocation, reached through `fd`.
    fn region(&self, fd: &OwnedFd, offset: u64, len: u64) -> RegionDesc {
        let backing = CudaVmmBacking { fd: fd.as_raw_fd(), allocation_size: self.size };
        RegionDesc {
            addr: 0,
            backing_path: backing.to_backing_path().into(),
            backing_offset: offset,
            ..cuda_region(self.ctx.ordinal() as i32, 0, len)
        }
    }

    fn write(&self, offset: u64, bytes: &[u8]) {
        assert!(offset + bytes.len() as u64 <= self.size);
        self.ctx.bind_to_thread().expect("bind context");
        // SAFETY: in bounds (checked above) of a live, mapped allocation.
        unsafe { result::memcpy_htod_sync(self.ptr + offset, bytes) }.expect("cuMemcpyHtoD");
    }

    fn read(&self, offset: u64, len: u64) -> Vec<u8> {
        assert!(offset + len <= self.size);
        self.ctx.bind_to_thread().expect("bind context");
        let mut out = vec![0u8; len as usize];
        // SAFETY: in bounds (checked above) of a live, mapped allocation.
        unsafe { result::memcpy_dtoh_sync(&mut out, self.ptr + offset) }.expect("cuMemcpyDtoH");
        out
    }
}

impl Drop for VmmBuffer {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_err() {
            return;
        }
        // SAFETY: the range is mapped by this value alone and no copy uses it any more (every test
        // waits for its transfers' terminal events first); the handle is released once.
        unsafe {
            let _ = sys::cuMemUnmap(self.ptr, self.size as usize);
            let _ = sys::cuMemAddressFree(self.ptr, self.size as usize);
            let _ = sys::cuMemRelease(self.handle);
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run tests/gpu/run.sh"]
fn gpu_vmm_regions_by_descriptor_in_one_process_arrive_intact() {
    let ctx = device0();
    let pair = Pair::open("chunk_bytes = 1048576");
    let src = VmmBuffer::create(&ctx, 8 * MIB + 123);
    let dst = VmmBuffer::create(&ctx, 8 * MIB + 4567);
    assert!(src.size >= 8 * MIB + 123 && dst.size >= 8 * MIB + 4567);
    let data = pattern(31, src.size as usize);
    src.write(0, &data);
    dst.write(0, &vec![0u8; dst.size as usize]);
    let (src_fd, dst_fd) = (src.export_fd(), dst.export_fd());
    // Regions start at odd offsets inside their allocations, as sub-allocated tensors do.
    let (src_base, dst_base) = (3u64, 4099u64);
    let len = 8 * MIB;
    let s = pair.a.register(&src.region(&src_fd, src_base, len)).unwrap();
    let d = pair.b.register(&dst.region(&dst_fd, dst_base, len)).unwrap();
    assert_eq!(d.remote_key[8], 2, "a VMM region's key is the version-2 form");
    // The importer gets the descriptor from b's socket and maps the allocation itself.
    let remote = pair.a.import_remote_key(B_PEER, &d.remote_key).unwrap();
    for (i, &(len, src_off, dst_off)) in
        [(1u64, 0u64, 0u64), (4095, 1, 7), (65537, 4096, 3), (4 * MIB + 5, 17, 11)].iter().enumerate()
    {
        let seg = Segment { local: s.key, local_offset: src_off, remote, remote_offset: dst_off, len };
        submit(&pair.a, i as u64 + 1, &[seg], TEN_S).unwrap();
        let e = wait_terminal(&pair.a_events, XferId(i as u64 + 1), 30);
        assert_eq!((e.kind, e.bytes), (EventKind::SUCCEEDED, len), "{len} bytes: {e:?}");
        let want = &data[(src_base + src_off) as usize..(src_base + src_off + len) as usize];
        assert!(dst.read(dst_base + dst_off, len) == want, "{len} bytes at {src_off}->{dst_off} differ");
    }
    // Out of the allocation: refused at register. A deregistered region's descriptor is not served.
    let past = pair.b.register(&dst.region(&dst_fd, dst.size - 10, 11)).unwrap_err();
    assert_eq!(past.code, ReasonCode::OUT_OF_RANGE, "{past}");
    pair.a.release_remote_key(remote);
    pair.b.deregister(d.key).unwrap();
    let gone = pair.a.import_remote_key(B_PEER, &d.remote_key).unwrap_err();
    assert_eq!(gone.code, ReasonCode::UNKNOWN_KEY, "{gone}");
    // A descriptor that is not a CUDA one is refused at register, saying why.
    let not_cuda = std::fs::File::open("/proc/self/stat").unwrap();
    let bogus = RegionDesc {
        backing_path: format!("cuda-vmm-fd:{}:{}", not_cuda.as_raw_fd(), dst.size).into(),
        ..dst.region(&dst_fd, 0, 1)
    };
    let e = pair.b.register(&bogus).unwrap_err();
    assert_eq!(e.code, ReasonCode::UNSUPPORTED_MEMORY, "{e}");
    pair.a.deregister(s.key).unwrap();
    let stats = pair.a.stats();
    assert_eq!((stats.live_transfers, stats.unquiesced_transfers, stats.registered_regions), (0, 0, 0));
}

/// Environment variable that turns the two-process VMM test into its child half.
const VMM_CHILD_ENV: &str = "KVGATE_NVLINK_GPU_VMM_CHILD";

#[test]
#[ignore = "needs an NVIDIA GPU: run tests/gpu/run.sh"]
fn gpu_two_processes_through_a_vmm_descriptor_socket() {
    if std::env::var_os(VMM_CHILD_ENV).is_some() {
        return vmm_child();
    }
    let ctx = device0();
    let (mut child, mut to_child, from_child) =
        spawn_child("gpu_two_processes_through_a_vmm_descriptor_socket", VMM_CHILD_ENV, "NVLINK-VMM-CHILD");
    let child_endpoint = from_child.bytes("ENDPOINT");
    let child_key = from_child.bytes("KEY");

    let (a, a_events) = open_instance("chunk_bytes = 4194304");
    a.connect(B_PEER, &child_endpoint).unwrap();
    let remote = a.import_remote_key(B_PEER, &child_key).unwrap();
    let len = 24 * MIB + 5;
    let src = DeviceBuffer::alloc(&ctx, len).unwrap();
    src.write(0, &pattern(41, len as usize)).unwrap();
    let s = a.register(&cuda_region(0, src.ptr, len)).unwrap();
    submit(&a, 1, &[Segment { local: s.key, local_offset: 0, remote, remote_offset: 9, len }], TEN_S).unwrap();
    let e = wait_terminal(&a_events, XferId(1), 30);
    assert_eq!(e.kind, EventKind::SUCCEEDED, "{e:?}");
    writeln!(to_child, "CHECK 41 9 {len}").unwrap();
    let verdict = from_child.value("VERDICT");
    assert_eq!(verdict, "OK", "the child saw other bytes than were sent");
    a.release_remote_key(remote);
    writeln!(to_child, "EXIT").unwrap();
    assert!(child.wait().unwrap().success(), "the child process failed");
}

/// The child half: a VMM allocation of its own, registered by descriptor with its own instance (the
/// gateway's way), endpoint and key printed; then checks what the parent wrote.
fn vmm_child() {
    let ctx = CudaContext::new(0).expect("child: CUDA device 0");
    let (plugin, _events) = open_instance("");
    let region = VmmBuffer::create(&ctx, 32 * MIB);
    region.write(0, &vec![0u8; region.size as usize]);
    let fd = region.export_fd();
    let reg = plugin.register(&region.region(&fd, 0, region.size)).unwrap();
    println!("NVLINK-VMM-CHILD ENDPOINT {}", hex(&plugin.local_endpoint()));
    println!("NVLINK-VMM-CHILD KEY {}", hex(&reg.remote_key));
    std::io::stdout().flush().unwrap();
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["CHECK", seed, offset, len] => {
                let (seed, offset, len): (u64, u64, u64) =
                    (seed.parse().unwrap(), offset.parse().unwrap(), len.parse().unwrap());
                let ok = region.read(offset, len) == pattern(seed, len as usize);
                println!("NVLINK-VMM-CHILD VERDICT {}", if ok { "OK" } else { "MISMATCH" });
                std::io::stdout().flush().unwrap();
            }
            ["EXIT"] => break,
            other => panic!("child: unknown command {other:?}"),
        }
    }
    drop(plugin);
}
