//! The shm plugin against a plain memcpy of the same bytes, in the same run: 1024 × 64 KiB and
//! 64 × 4 MiB blocks from one shared region into another (buffers pre-faulted). The plugin is timed
//! from submit until its SUCCEEDED event reaches the sink. Prints criterion's report per shape, then
//! the throughput ratio plugin / memcpy from interleaved rounds (targets: ≥ 0.80 at 64 KiB blocks,
//! ≥ 0.90 at 4 MiB blocks).
//!
//! Run: `cargo bench -p kvgate-plugin-shm --bench shm_copy` (`-- --ratio-only` skips criterion;
//! `KVGATE_SHM_BENCH_CONFIG="workers = 1"` replaces the plugin config for experiments).

use criterion::{Criterion, Throughput};
use kvgate_abi::abi_stable::std_types::{RSlice, RStr};
use kvgate_abi::sdk::sink_from_fn;
use kvgate_abi::{EventKind, PeerId, Segment, SubmitRequest, Ticket, TransportBox, XferId};
use kvgate_plugin_shm::SharedRegion;
use std::sync::mpsc;
use std::time::{Duration, Instant};

struct Shape {
    name: &'static str,
    block_bytes: usize,
    blocks: usize,
    target_ratio: f64,
}

const SHAPES: [Shape; 2] = [
    Shape { name: "64KiB_x1024", block_bytes: 64 << 10, blocks: 1024, target_ratio: 0.80 },
    Shape { name: "4MiB_x64", block_bytes: 4 << 20, blocks: 64, target_ratio: 0.90 },
];
const PLUGIN_CONFIG: &str = "workers = 2\nchunk_bytes = 1048576";
const TIMEOUT_NS: u64 = 60_000_000_000;
const RATIO_ROUNDS: usize = 15;

/// Two shm instances (sender, receiver), a source and a destination region, and the segment list.
struct Bench {
    sender: TransportBox,
    _receiver: TransportBox,
    done: mpsc::Receiver<(XferId, EventKind)>,
    src: SharedRegion,
    dst: SharedRegion,
    segments: Vec<Segment>,
    next_xfer: u64,
}

fn ok<T>(r: kvgate_abi::abi_stable::std_types::RResult<T, kvgate_abi::PluginError>) -> T {
    r.into_result().unwrap_or_else(|e| panic!("shm plugin call failed: {e}"))
}

impl Bench {
    fn new(shape: &Shape) -> Bench {
        let (tx, done) = mpsc::channel();
        let tx = std::sync::Mutex::new(tx);
        let sink = sink_from_fn(move |e| {
            if e.is_terminal() {
                let _ = tx.lock().unwrap().send((e.xfer, e.kind));
            }
        });
        let module = kvgate_plugin_shm::module();
        let config = std::env::var("KVGATE_SHM_BENCH_CONFIG").unwrap_or_else(|_| PLUGIN_CONFIG.to_string());
        let sender = ok((module.open())(RStr::from_str(&config), sink));
        let receiver = ok((module.open())(RStr::from_str(""), sink_from_fn(|_| {})));
        let peer = PeerId(1);
        ok(sender.connect(peer, RSlice::from_slice(&receiver.local_endpoint())));
        let total = shape.block_bytes * shape.blocks;
        let (src, dst) = (SharedRegion::memfd(total).unwrap(), SharedRegion::memfd(total).unwrap());
        for (i, b) in src.as_mut_slice().iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(31);
        }
        let local = ok(sender.register(&src.desc())).key;
        let dest = ok(receiver.register(&dst.desc()));
        let remote = ok(sender.import_remote_key(peer, RSlice::from_slice(&dest.remote_key)));
        let block = shape.block_bytes as u64;
        let segments = (0..shape.blocks as u64)
            .map(|i| Segment { local, local_offset: i * block, remote, remote_offset: i * block, len: block })
            .collect();
        Bench { sender, _receiver: receiver, done, src, dst, segments, next_xfer: 1 }
    }

    /// One transfer through the plugin, from submit to SUCCEEDED.
    fn plugin_copy(&mut self) -> Duration {
        let xfer = XferId(self.next_xfer);
        self.next_xfer += 1;
        let request = SubmitRequest {
            xfer,
            peer: PeerId(1),
            ticket: Ticket(xfer.0),
            timeout_ns: TIMEOUT_NS,
            segments: RSlice::from_slice(&self.segments),
        };
        let start = Instant::now();
        ok(self.sender.submit(request));
        let (done, kind) = self.done.recv_timeout(Duration::from_secs(60)).expect("SUCCEEDED within 60 s");
        let elapsed = start.elapsed();
        assert_eq!((done, kind), (xfer, EventKind::SUCCEEDED));
        elapsed
    }

    /// The same bytes with a plain memcpy per block, one thread.
    fn memcpy_copy(&mut self) -> Duration {
        let (src, dst) = (self.src.addr(), self.dst.addr());
        let start = Instant::now();
        for s in &self.segments {
            // SAFETY: both regions are mapped and hold every segment; they do not overlap.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    (src + s.local_offset as usize) as *const u8,
                    (dst + s.remote_offset as usize) as *mut u8,
                    s.len as usize,
                )
            };
        }
        start.elapsed()
    }

    fn verify(&self) {
        assert!(self.src.as_slice() == self.dst.as_slice(), "destination differs from source");
    }
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

fn gbps(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64() / 1e9
}

/// Interleaved rounds of both copies; prints medians and the ratio.
fn ratio_report() {
    let config = std::env::var("KVGATE_SHM_BENCH_CONFIG").unwrap_or_else(|_| PLUGIN_CONFIG.to_string());
    println!(
        "shm_copy: plugin config {:?}; streaming stores (transfers >= streaming_stores_min_bytes) use {}; memcpy is glibc's",
        config,
        kvgate_plugin_shm::stream_copy::streaming_instructions()
    );
    for shape in &SHAPES {
        let mut bench = Bench::new(shape);
        for _ in 0..3 {
            bench.memcpy_copy();
            bench.plugin_copy();
        }
        bench.dst.as_mut_slice().fill(0);
        bench.plugin_copy();
        bench.verify();
        let (mut memcpy, mut plugin) = (Vec::new(), Vec::new());
        for _ in 0..RATIO_ROUNDS {
            memcpy.push(bench.memcpy_copy());
            plugin.push(bench.plugin_copy());
        }
        let bytes = shape.block_bytes * shape.blocks;
        let (m, p) = (median(memcpy), median(plugin));
        let ratio = m.as_secs_f64() / p.as_secs_f64();
        let verdict = if ratio >= shape.target_ratio { "meets" } else { "BELOW" };
        println!(
            "shm_copy ratio {}: memcpy {:.2} GB/s, plugin {:.2} GB/s, ratio {:.2} ({verdict} target {:.2}; medians of {RATIO_ROUNDS})",
            shape.name,
            gbps(bytes, m),
            gbps(bytes, p),
            ratio,
            shape.target_ratio
        );
    }
}

fn criterion_report() {
    let mut c = Criterion::default().sample_size(10).measurement_time(Duration::from_secs(3)).configure_from_args();
    for shape in &SHAPES {
        let mut bench = Bench::new(shape);
        let mut group = c.benchmark_group(format!("shm_copy/{}", shape.name));
        group.throughput(Throughput::Bytes((shape.block_bytes * shape.blocks) as u64));
        group.bench_function("memcpy", |b| b.iter_custom(|n| (0..n).map(|_| bench.memcpy_copy()).sum()));
        group.bench_function("plugin", |b| b.iter_custom(|n| (0..n).map(|_| bench.plugin_copy()).sum()));
        group.finish();
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    // `cargo test --benches` runs bench binaries with `--bench` absent: keep that quick.
    let ratio_only = args.iter().any(|a| a == "--ratio-only");
    if !ratio_only && args.iter().any(|a| a == "--bench") {
        criterion_report();
    }
    ratio_report();
}
