//! The UCX plugin against `ucx_perftest` (Debian ucx-utils) in the same run: same transport, message
//! size, message count and direction (client/sender → server/receiver on 127.0.0.1), ratio printed.
//! TCP and shared memory: the plugin moves active messages (its `auto` mode there) and is compared
//! with `ucp_am_bw`; `sm-put`: the plugin forced to put + flush, compared with `ucp_put_bw`.
//!
//! `cargo bench -p kvgate-plugin-ucx --bench ucx_vs_perftest`
//! Environment: `KVGATE_UCX_BENCH_BYTES` (bytes per measurement, default 512 MiB),
//! `KVGATE_UCX_BENCH_WINDOW` (plugin transfers in flight, default 8), `KVGATE_UCX_BENCH_ONLY` (`tcp`|`sm`|`sm-put`).

use kvgate_abi::sdk::{sink_from_fn, Plugin, PluginFactory, Sink};
use kvgate_abi::*;
use kvgate_plugin_ucx::UcxFactory;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

struct Transport {
    name: &'static str,
    ucx_env: &'static [(&'static str, &'static str)],
    plugin_config: &'static str,
    perftest_test: &'static str,
}

const TRANSPORTS: &[Transport] = &[
    Transport {
        name: "tcp",
        ucx_env: &[("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", "lo")],
        plugin_config: "tls = \"tcp\"\ndevices = \"lo\"\n",
        perftest_test: "ucp_am_bw",
    },
    Transport {
        name: "sm-put",
        ucx_env: &[("UCX_TLS", "posix,sysv,cma")],
        plugin_config: "tls = \"posix,sysv,cma\"\nmode = \"put\"\n",
        perftest_test: "ucp_put_bw",
    },
    Transport {
        name: "sm",
        ucx_env: &[("UCX_TLS", "posix,sysv,cma")],
        plugin_config: "tls = \"posix,sysv,cma\"\n",
        perftest_test: "ucp_am_bw",
    },
];

const SIZES: &[usize] = &[64 << 10, 1 << 20, 4 << 20];
/// The longest one ucx_perftest run may take before it is killed and reported as failed.
const PERFTEST_TIMEOUT_S: u64 = 120;
/// The longest one plugin completion may take before the benchmark gives up.
const PLUGIN_EVENT_TIMEOUT: Duration = Duration::from_secs(60);

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).unwrap_or(13337)
}

/// ucx_perftest server + client; the client's overall bandwidth in GB/s (UCX prints MiB/s as "MB/s").
fn perftest(t: &Transport, size: usize, iters: u64) -> Result<f64, String> {
    let port = free_port().to_string();
    let (size_s, iters_s, warmup) = (size.to_string(), iters.to_string(), (iters / 10).max(10).to_string());
    let args = ["-t", t.perftest_test, "-s", &size_s, "-n", &iters_s, "-w", &warmup, "-p", &port, "-f"];
    let timeout = PERFTEST_TIMEOUT_S.to_string();
    let mut server = Command::new("timeout")
        .arg(&timeout)
        .arg("ucx_perftest")
        .args(args)
        .envs(t.ucx_env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start ucx_perftest (install ucx-utils): {e}"))?;
    std::thread::sleep(Duration::from_millis(500));
    let client = Command::new("timeout")
        .arg(&timeout)
        .arg("ucx_perftest")
        .arg("127.0.0.1")
        .args(args)
        .envs(t.ucx_env.iter().copied())
        .output()
        .map_err(|e| format!("ucx_perftest client: {e}"))?;
    let _ = server.wait();
    let text = String::from_utf8_lossy(&client.stdout);
    let numbers: Vec<f64> = text
        .lines()
        .rev()
        .find_map(|line| {
            let fields: Vec<f64> = line.split_whitespace().filter_map(|f| f.parse().ok()).collect();
            (fields.len() >= 8).then_some(fields)
        })
        .ok_or_else(|| format!("no result line in ucx_perftest output:\n{text}\n{}", String::from_utf8_lossy(&client.stderr)))?;
    Ok(numbers[5] * 1048576.0 / 1e9)
}

/// The plugin: two instances in this process, `iters` transfers of `size` bytes from A to B with
/// `window` in flight; GB/s from the first submit to the last `SUCCEEDED`.
fn plugin(t: &Transport, size: usize, iters: u64, window: u64) -> Result<f64, String> {
    let (tx_a, rx_a) = mpsc::channel::<Event>();
    let sink_a = Sink::new(sink_from_fn(move |e| {
        let _ = tx_a.send(e);
    }));
    let sink_b = Sink::new(sink_from_fn(|_e| {}));
    let a = UcxFactory::open(t.plugin_config, sink_a).map_err(|e| e.to_string())?;
    let b = UcxFactory::open(t.plugin_config, sink_b).map_err(|e| e.to_string())?;
    a.connect(PeerId(2), &b.local_endpoint()).map_err(|e| e.to_string())?;
    b.connect(PeerId(1), &a.local_endpoint()).map_err(|e| e.to_string())?;
    let mut src = vec![0xa5u8; size];
    let mut dst = vec![0u8; size];
    let desc = |buf: &mut Vec<u8>| RegionDesc {
        kind: MemoryKind::HOST,
        device: -1,
        addr: buf.as_mut_ptr() as u64,
        len: buf.len() as u64,
        ..Default::default()
    };
    let src_reg = a.register(&desc(&mut src)).map_err(|e| e.to_string())?;
    let dst_reg = b.register(&desc(&mut dst)).map_err(|e| e.to_string())?;
    let remote = a.import_remote_key(PeerId(2), &dst_reg.remote_key).map_err(|e| e.to_string())?;
    let ranges = [LocalRange { key: dst_reg.key, offset: 0, len: size as u64 }];
    b.expect_incoming(&IncomingRequest { ticket: Ticket(1), peer: PeerId(1), timeout_ns: 3_600_000_000_000, ranges: ranges[..].into() })
        .map_err(|e| e.to_string())?;
    let segment = [Segment { local: src_reg.key, local_offset: 0, remote, remote_offset: 0, len: size as u64 }];
    let mut next = 1u64;
    let mut run = |count: u64| -> Result<Duration, String> {
        let started = Instant::now();
        let (mut submitted, mut done) = (0u64, 0u64);
        while done < count {
            while submitted < count && submitted - done < window {
                let request = SubmitRequest {
                    xfer: XferId(next),
                    peer: PeerId(2),
                    ticket: Ticket(1),
                    timeout_ns: 60_000_000_000,
                    segments: segment[..].into(),
                };
                a.submit(&request).map_err(|e| e.to_string())?;
                next += 1;
                submitted += 1;
            }
            let event = rx_a.recv_timeout(PLUGIN_EVENT_TIMEOUT).map_err(|_| "plugin event timeout".to_string())?;
            match event.kind {
                EventKind::SUCCEEDED => done += 1,
                EventKind::FAILED => return Err(format!("transfer failed: {event:?}")),
                _ => {}
            }
        }
        Ok(started.elapsed())
    };
    run((iters / 10).max(10))?;
    let elapsed = run(iters)?;
    a.shutdown();
    b.shutdown();
    drop((src, dst));
    Ok((size as u64 * iters) as f64 / elapsed.as_secs_f64() / 1e9)
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test` runs benches with no flag only when asked: skip then.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let total = env_u64("KVGATE_UCX_BENCH_BYTES", 512 << 20);
    let window = env_u64("KVGATE_UCX_BENCH_WINDOW", 8);
    let only = std::env::var("KVGATE_UCX_BENCH_ONLY").ok();
    println!("UCX plugin vs ucx_perftest, {} MiB per measurement, plugin window {window}", total >> 20);
    println!("{:<5} {:<11} {:>9} {:>16} {:>12} {:>8}", "tls", "reference", "size", "ucx_perftest GB/s", "plugin GB/s", "ratio");
    let mut worst: Option<f64> = None;
    for t in TRANSPORTS.iter().filter(|t| only.as_deref().is_none_or(|o| o == t.name)) {
        for &size in SIZES {
            let iters = (total / size as u64).max(16);
            let reference = perftest(t, size, iters);
            let ours = plugin(t, size, iters, window);
            let size_text = if size >= 1 << 20 { format!("{} MiB", size >> 20) } else { format!("{} KiB", size >> 10) };
            match (reference, ours) {
                (Ok(r), Ok(p)) => {
                    let ratio = p / r;
                    worst = Some(worst.map_or(ratio, |w| w.min(ratio)));
                    println!("{:<5} {:<11} {:>9} {:>16.2} {:>12.2} {:>7.0}%", t.name, t.perftest_test, size_text, r, p, ratio * 100.0);
                }
                (r, p) => println!("{:<5} {:<11} {:>9} reference: {:?} plugin: {:?}", t.name, t.perftest_test, size_text, r.err(), p.err()),
            }
        }
    }
    if let Some(w) = worst {
        println!("worst ratio {:.0}% (target >= 95%)", w * 100.0);
    }
}
