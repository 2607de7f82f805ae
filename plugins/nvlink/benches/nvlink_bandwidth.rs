//! Bandwidth of the NVLink plugin against a raw `cuMemcpyDtoD` of the same bytes, in the same run,
//! for blocks of 1 MiB to 256 MiB on device 0 (target: plugin >= 90 % of raw). Needs a GPU; prints
//! DID NOT RUN and exits 2 without one. Run: `cargo bench -p kvgate-plugin-nvlink --bench
//! nvlink_bandwidth` (tests/gpu/run.sh does). Extra plugin config: env NVLINK_BENCH_CONFIG (TOML).

#[path = "../tests/gpu_support/mod.rs"]
mod gpu_support;

use cudarc::driver::CudaContext;
use gpu_support::*;
use kvgate_abi::sdk::Plugin;
use kvgate_abi::*;
use kvgate_plugin_nvlink::cuda;
use kvgate_plugin_nvlink::device_buffer::DeviceBuffer;
use std::time::Instant;

const MIB: u64 = 1 << 20;
/// Bytes moved per measurement (per side), so small blocks are timed over many copies.
const BYTES_PER_MEASUREMENT: u64 = 8 << 30;
/// Transfers the plugin is given at once (the host pipelines submits like this in serving).
const PLUGIN_WINDOW: u64 = 16;

fn raw_gbps(
    ctx: &std::sync::Arc<CudaContext>,
    src: &DeviceBuffer,
    dst: &DeviceBuffer,
    block: u64,
    iterations: u64,
) -> f64 {
    ctx.synchronize().unwrap();
    let start = Instant::now();
    for _ in 0..iterations {
        src.copy_to(dst, block).unwrap(); // cuMemcpyDtoD: does not wait for the copy; sync below
    }
    ctx.synchronize().unwrap();
    (block * iterations) as f64 / start.elapsed().as_secs_f64() / 1e9
}

fn plugin_gbps(pair: &Pair, local: LocalKey, remote: RemoteKey, block: u64, iterations: u64, first_id: u64) -> f64 {
    let segment = [Segment { local, local_offset: 0, remote, remote_offset: 0, len: block }];
    let submit = |id: u64| {
        pair.a
            .submit(&SubmitRequest {
                xfer: XferId(id),
                peer: B_PEER,
                ticket: Ticket(id),
                timeout_ns: 60_000_000_000,
                segments: (&segment[..]).into(),
            })
            .unwrap_or_else(|e| panic!("submit: {e}"))
    };
    let start = Instant::now();
    let (mut issued, mut done) = (0u64, 0u64);
    while issued < iterations.min(PLUGIN_WINDOW) {
        submit(first_id + issued);
        issued += 1;
    }
    while done < iterations {
        let e = next_event(&pair.a_events, 60);
        if e.is_terminal() {
            assert_eq!(e.kind, EventKind::SUCCEEDED, "{e:?}");
            done += 1;
            if issued < iterations {
                submit(first_id + issued);
                issued += 1;
            }
        }
    }
    (block * iterations) as f64 / start.elapsed().as_secs_f64() / 1e9
}

fn main() {
    if !cuda::driver_library_present() {
        println!("nvlink_bandwidth: DID NOT RUN: {}", cuda::NO_DRIVER_REASON);
        std::process::exit(2);
    }
    let extra = std::env::var("NVLINK_BENCH_CONFIG").unwrap_or_default();
    let ctx = CudaContext::new(0).expect("CUDA device 0");
    println!("nvlink_bandwidth on device 0 ({}), plugin config: {:?}", ctx.name().unwrap_or_default(), extra);
    let pair = Pair::open(&format!("max_inflight_transfers = 4096\n{extra}"));
    let cap = 256 * MIB;
    let src = DeviceBuffer::alloc(&ctx, cap).unwrap();
    let dst = DeviceBuffer::alloc(&ctx, cap).unwrap();
    src.write(0, &vec![0x5a; cap as usize]).unwrap();
    let s = pair.a.register(&cuda_region(0, src.ptr, cap)).unwrap();
    let d = pair.b.register(&cuda_region(0, dst.ptr, cap)).unwrap();
    let remote = pair.a.import_remote_key(B_PEER, &d.remote_key).unwrap();
    println!("{:>10} {:>8} {:>12} {:>12} {:>8}  target", "block", "copies", "raw GB/s", "plugin GB/s", "ratio");
    let mut next_id = 1u64;
    let mut below = 0;
    for block in [MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB] {
        let iterations = (BYTES_PER_MEASUREMENT / block).clamp(16, 4096);
        // Warm up both paths once, then alternate raw / plugin twice and keep the best of each.
        raw_gbps(&ctx, &src, &dst, block, 4);
        plugin_gbps(&pair, s.key, remote, block, 4, next_id);
        next_id += 4;
        let (mut raw, mut plugin) = (0f64, 0f64);
        for _ in 0..2 {
            raw = raw.max(raw_gbps(&ctx, &src, &dst, block, iterations));
            plugin = plugin.max(plugin_gbps(&pair, s.key, remote, block, iterations, next_id));
            next_id += iterations;
        }
        let ratio = plugin / raw;
        let verdict = if ratio >= 0.90 { "ok (>= 0.90)" } else { "BELOW 0.90" };
        below += (ratio < 0.90) as u32;
        println!("{:>7} MiB {:>8} {:>12.1} {:>12.1} {:>8.3}  {verdict}", block / MIB, iterations, raw, plugin, ratio);
    }
    println!("nvlink_bandwidth: {} of 5 block sizes below the 90 % target", below);
}
