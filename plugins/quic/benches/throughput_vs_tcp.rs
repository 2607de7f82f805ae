//! Moves the same bytes over plain tokio TCP on loopback and through the QUIC plugin (two instances in
//! this process) in one run, and prints QUIC's throughput as a ratio of TCP's for 64 KiB and 4 MiB blocks
//! (one transfer per block; the plugin carries them on its long-lived lanes).
//!
//! `cargo bench -p kvgate-plugin-quic --bench throughput_vs_tcp`
//! Environment: `KVGATE_BENCH_MIB` (bytes per case, default 1024), `KVGATE_QUIC_BENCH_CONFIG` (TOML
//! for both plugin instances, default: the tuned loopback config below), `KVGATE_BENCH_BLOCKS`
//! (comma-separated block sizes in KiB, default `64,4096`), `KVGATE_BENCH_ONLY_QUIC` (set: skip TCP,
//! for profiling), `KVGATE_QUIC_BENCH_FRAMES` (set: print quinn's frame counts per connection).

use kvgate_abi::sdk::{sink_from_fn, Plugin, Sink};
use kvgate_abi::{
    EventKind, IncomingRequest, LocalRange, MemoryKind, PeerId, RegionDesc, Segment, SubmitRequest, Ticket, XferId,
};
use kvgate_plugin_quic::{QuicConfig, QuicPlugin};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The loopback tuning: 64 KiB datagrams from the first packet (and never below 16000 bytes after a
/// dropped burst), no segmentation offload (batches of large datagrams are lost), one connection and
/// endpoint per core, a 1 MiB initial window and 1 MiB staging writes, and at most 4 MiB unacknowledged
/// per connection: a receiving socket buffer (8 MiB where `net.core.rmem_max` is 4 MiB) then never
/// overflows, where 64 MiB in flight lost ~1 % of the datagrams and halved the window each time.
/// `malloc_trim_threshold_bytes` (process-wide, as a host would set it) keeps glibc from handing back
/// and faulting in again the buffer quinn allocates for every received datagram.
const TUNED_LOOPBACK_CONFIG: &str = r#"
initial_mtu_bytes = 65507
min_mtu_bytes = 16000
mtu_discovery_upper_bound_bytes = 65507
segmentation_offload = false
endpoints = 2
connections_per_peer = 2
worker_threads = 2
initial_congestion_window_bytes = 1048576
write_chunk_bytes = 1048576
send_window_bytes = 4194304
malloc_trim_threshold_bytes = 67108864
"#;

/// The region both sides use; each case cycles through it.
const REGION_BYTES: usize = 64 << 20;

/// CPU seconds (user + system) this process used so far, from /proc/self/stat (Linux).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the parenthesised command name; utime and stime are the 12th and 13th of those.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

/// Throughput (GB/s of wall time) and efficiency (GB per CPU second, both sides together).
struct Measured {
    gbps: f64,
    gb_per_cpu_second: f64,
}

fn measure(total: u64, run: impl FnOnce() -> Duration) -> Measured {
    let cpu_before = cpu_seconds();
    let elapsed = run();
    let cpu = (cpu_seconds() - cpu_before).max(0.01);
    Measured { gbps: total as f64 / elapsed.as_secs_f64() / 1e9, gb_per_cpu_second: total as f64 / cpu / 1e9 }
}

fn env_or(key: &str, default: &str) -> String {
    std::env::var(key).unwrap_or_else(|_| default.to_string())
}

fn tcp_run(total: u64, block: usize) -> Duration {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let receiver = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut dst = vec![0u8; REGION_BYTES];
            let mut got: u64 = 0;
            let mut at = 0usize;
            while got < total {
                let end = (at + block).min(REGION_BYTES);
                let n = socket.read(&mut dst[at..end]).await.unwrap();
                assert!(n > 0, "tcp closed early");
                got += n as u64;
                at = if at + n >= REGION_BYTES { 0 } else { at + n };
            }
            socket.write_all(b"k").await.unwrap();
        });
        let src = vec![7u8; REGION_BYTES];
        let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
        socket.set_nodelay(true).unwrap();
        let start = Instant::now();
        let mut sent: u64 = 0;
        let mut at = 0usize;
        while sent < total {
            let n = block.min((total - sent) as usize).min(REGION_BYTES - at);
            socket.write_all(&src[at..at + n]).await.unwrap();
            sent += n as u64;
            at = (at + n) % REGION_BYTES;
        }
        let mut ack = [0u8; 1];
        socket.read_exact(&mut ack).await.unwrap();
        let elapsed = start.elapsed();
        receiver.await.unwrap();
        elapsed
    })
}

struct Node {
    plugin: QuicPlugin,
    done: mpsc::Receiver<(XferId, EventKind, String)>,
}

fn open(config: &QuicConfig) -> Node {
    let (tx, done) = mpsc::channel();
    let tx = std::sync::Mutex::new(tx);
    let sink = Sink::new(sink_from_fn(move |e| {
        if e.is_terminal() {
            let _ = tx.lock().unwrap().send((e.xfer, e.kind, e.message.to_string()));
        }
    }));
    Node { plugin: QuicPlugin::open(config.clone(), sink).expect("open"), done }
}

fn quic_run(config: &QuicConfig, total: u64, block: usize) -> Duration {
    let a = open(config);
    let b = open(config);
    a.plugin.connect(PeerId(2), &b.plugin.local_endpoint()).unwrap();
    b.plugin.connect(PeerId(1), &a.plugin.local_endpoint()).unwrap();
    let src = vec![7u8; REGION_BYTES].into_boxed_slice();
    let mut dst = vec![0u8; REGION_BYTES].into_boxed_slice();
    let desc = |addr: u64| RegionDesc {
        kind: MemoryKind::HOST,
        device: -1,
        addr,
        len: REGION_BYTES as u64,
        ..Default::default()
    };
    let src_reg = a.plugin.register(&desc(src.as_ptr() as u64)).unwrap();
    let dst_reg = b.plugin.register(&desc(dst.as_mut_ptr() as u64)).unwrap();
    let remote = a.plugin.import_remote_key(PeerId(2), &dst_reg.remote_key).unwrap();
    let ranges = [LocalRange { key: dst_reg.key, offset: 0, len: REGION_BYTES as u64 }];
    b.plugin
        .expect_incoming(&IncomingRequest {
            ticket: Ticket(1),
            peer: PeerId(1),
            timeout_ns: 600_000_000_000,
            ranges: ranges.as_slice().into(),
        })
        .unwrap();
    let blocks_per_region = REGION_BYTES / block;
    let count = total / block as u64;
    // Keep about 32 MiB in flight, at least two transfers.
    let window = ((32usize << 20) / block).clamp(2, 512) as u64;
    let submit = |i: u64| {
        let slot = (i as usize % blocks_per_region) * block;
        let seg = [Segment {
            local: src_reg.key,
            local_offset: slot as u64,
            remote,
            remote_offset: slot as u64,
            len: block as u64,
        }];
        a.plugin
            .submit(&SubmitRequest {
                xfer: XferId(i),
                peer: PeerId(2),
                ticket: Ticket(1),
                timeout_ns: 60_000_000_000,
                segments: seg.as_slice().into(),
            })
            .unwrap();
    };
    // Warm up the connections (handshake, MTU) before the clock starts.
    submit(u64::MAX - 1);
    let (_, kind, message) = a.done.recv_timeout(Duration::from_secs(30)).unwrap();
    assert_eq!(kind, EventKind::SUCCEEDED, "warm-up failed: {message}");
    let start = Instant::now();
    let mut next = 0u64;
    let mut finished = 0u64;
    while next < count.min(window) {
        submit(next);
        next += 1;
    }
    while finished < count {
        let (xfer, kind, message) = a.done.recv_timeout(Duration::from_secs(60)).expect("transfer stalled");
        assert_eq!(kind, EventKind::SUCCEEDED, "transfer {} failed: {message}", xfer.0);
        finished += 1;
        if next < count {
            submit(next);
            next += 1;
        }
    }
    let elapsed = start.elapsed();
    let stats = a.plugin.outgoing_connection_stats();
    let replies = b.plugin.incoming_connection_stats();
    let sum = |s: &[quinn::ConnectionStats], f: fn(&quinn::ConnectionStats) -> u64| s.iter().map(f).sum::<u64>();
    println!(
        "  quic path: {} connections, {} lane streams for {} transfers, {} datagrams sent ({} back), {} lost, {} congestion events, mtu {:?}, rtt {:?}, cwnd {:?}",
        stats.len(),
        a.plugin.lane_streams_opened(),
        count + 1,
        sum(&stats, |s| s.udp_tx.datagrams),
        sum(&replies, |s| s.udp_tx.datagrams),
        sum(&stats, |s| s.path.lost_packets),
        sum(&stats, |s| s.path.congestion_events),
        stats.iter().map(|s| s.path.current_mtu).collect::<Vec<_>>(),
        stats.iter().map(|s| s.path.rtt).collect::<Vec<_>>(),
        stats.iter().map(|s| s.path.cwnd).collect::<Vec<_>>(),
    );
    if std::env::var("KVGATE_QUIC_BENCH_FRAMES").is_ok() {
        for s in stats.iter().chain(&replies) {
            println!("  frames sent {:?}", s.frame_tx);
        }
    }
    a.plugin.shutdown();
    b.plugin.shutdown();
    elapsed
}

fn main() {
    // `cargo test --benches` runs this with `--bench` absent; keep that run short.
    let quick = !std::env::args().any(|a| a == "--bench");
    let mib: u64 = env_or("KVGATE_BENCH_MIB", if quick { "64" } else { "1024" }).parse().expect("KVGATE_BENCH_MIB");
    let config_text = env_or("KVGATE_QUIC_BENCH_CONFIG", TUNED_LOOPBACK_CONFIG);
    let config = QuicConfig::parse(&config_text).expect("bench config");
    let blocks: Vec<usize> = env_or("KVGATE_BENCH_BLOCKS", "64,4096")
        .split(',')
        .map(|s| s.trim().parse::<usize>().expect("block KiB") << 10)
        .collect();
    let total = mib << 20;
    println!("kvgate-quic vs tokio TCP on loopback, {mib} MiB per case");
    for block in blocks {
        let total = total - total % block as u64;
        if std::env::var("KVGATE_BENCH_ONLY_QUIC").is_ok() {
            let quic = measure(total, || quic_run(&config, total, block));
            println!(
                "block {:>5} KiB: quic {:6.3} GB/s  per CPU-second {:6.3} GB",
                block >> 10,
                quic.gbps,
                quic.gb_per_cpu_second
            );
            continue;
        }
        let tcp = measure(total, || tcp_run(total, block));
        let quic = measure(total, || quic_run(&config, total, block));
        println!(
            "block {:>5} KiB: tcp {:6.3} GB/s  quic {:6.3} GB/s  quic/tcp {:5.1} %   per CPU-second: tcp {:6.3} GB  quic {:6.3} GB  quic/tcp {:5.1} %",
            block >> 10,
            tcp.gbps,
            quic.gbps,
            100.0 * quic.gbps / tcp.gbps,
            tcp.gb_per_cpu_second,
            quic.gb_per_cpu_second,
            100.0 * quic.gb_per_cpu_second / tcp.gb_per_cpu_second,
        );
    }
}
