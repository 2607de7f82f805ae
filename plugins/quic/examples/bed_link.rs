//! Two plugin instances across the two-host test bed (`tests/netbed`), without gateways: the plugin's
//! own cost per byte and what quinn settled on. Moves `rounds` x 64 MiB from host 0 to host 1 with 4
//! transfers in flight, then prints GB/s, the CPU seconds per GB of the plugin's threads (the relay's
//! are counted apart), and per connection quinn's path MTU, datagrams per send call (segmentation
//! offload), datagrams per receive call, lost packets, congestion window and RTT; iperf3 over the same
//! link before and after. Needs root and iperf3.
//!
//! `cargo run --release -p kvgate-plugin-quic --example bed_link -- a 'congestion_controller = "bbr"' 16`

#[path = "../tests/common/mod.rs"]
mod common;
use common::*;
use kvgate_abi::sdk::Plugin;
use kvgate_abi::{EventKind, LocalRange, Segment, Ticket, XferId};
use kvgate_netbed::{Link, Profile};
use kvgate_plugin_quic::QuicConfig;
use std::time::Instant;

const TRANSFER_BYTES: u64 = 64 << 20;
const IN_FLIGHT: u64 = 4;

/// CPU seconds of this process's threads whose name starts with `prefix`.
fn thread_cpu_s(prefix: &str) -> f64 {
    let ticks = 100.0; // USER_HZ
    let mut total = 0.0;
    for task in std::fs::read_dir("/proc/self/task").expect("proc").flatten() {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else { continue };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else { continue };
        if !stat[open + 1..close].starts_with(prefix) {
            continue;
        }
        let fields: Vec<&str> = stat[close + 2..].split(' ').collect();
        let utime: f64 = fields[11].parse().unwrap_or(0.0);
        let stime: f64 = fields[12].parse().unwrap_or(0.0);
        total += (utime + stime) / ticks;
    }
    total
}

fn open_on(link: &Link, host: usize, config: QuicConfig) -> Node {
    let address = link.host(host).address;
    let config = QuicConfig { listen_address: format!("{address}:0").parse().unwrap(), ..config };
    kvgate_netbed::in_namespace(&link.host(host).namespace, move || open(config)).expect("namespace")
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let profile = Profile::parse(args.get(1).map_or("a", |s| s.as_str())).expect("profile");
    let extra = args.get(2).cloned().unwrap_or_default().replace(';', "\n");
    let rounds: u64 = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(16);
    let config = QuicConfig::parse(&format!("malloc_trim_threshold_bytes = 67108864\n{extra}")).expect("config");
    let link = Link::start(&profile).expect("start the link");
    let iperf = |link: &Link| link.iperf3(4.0, 1, None).map(|r| r.bytes_per_s / 1e9).unwrap_or(f64::NAN);
    let iperf_before = iperf(&link);
    let a = open_on(&link, 0, config.clone());
    let b = open_on(&link, 1, config);
    a.plugin.connect(PEER_B, &b.plugin.local_endpoint()).unwrap();
    b.plugin.connect(PEER_A, &a.plugin.local_endpoint()).unwrap();
    let src = Buffer::random((TRANSFER_BYTES * IN_FLIGHT) as usize, 1);
    let dst = Buffer::zeroed((TRANSFER_BYTES * IN_FLIGHT) as usize);
    let r = route(&a, PEER_B, &b, &src, &dst);
    let run = |first: u64, count: u64| {
        let mut next = first;
        let end = first + count;
        let mut live: Vec<u64> = Vec::new();
        while next < end || !live.is_empty() {
            while next < end && (live.len() as u64) < IN_FLIGHT {
                let slot = next % IN_FLIGHT;
                let off = slot * TRANSFER_BYTES;
                expect(
                    &b,
                    PEER_A,
                    Ticket(next),
                    &[LocalRange { key: r.dst_key, offset: off, len: TRANSFER_BYTES }],
                    WAIT,
                );
                let seg = Segment {
                    local: r.src_key,
                    local_offset: off,
                    remote: r.remote,
                    remote_offset: off,
                    len: TRANSFER_BYTES,
                };
                submit(&a, PEER_B, XferId(next), Ticket(next), &[seg], WAIT).unwrap();
                live.push(next);
                next += 1;
            }
            let done = live.remove(0);
            let e = a.events.terminal(XferId(done), WAIT);
            assert_eq!(e.kind, EventKind::SUCCEEDED, "{e:?}");
            b.plugin.cancel_incoming(PEER_A, Ticket(done));
        }
    };
    run(1_000_000, IN_FLIGHT); // warm-up
    let (cpu0, relay0, t0) = (thread_cpu_s("kvgate-quic"), thread_cpu_s("netbed-"), Instant::now());
    run(0, rounds);
    let secs = t0.elapsed().as_secs_f64();
    let (cpu, relay) = (thread_cpu_s("kvgate-quic") - cpu0, thread_cpu_s("netbed-") - relay0);
    let gb = (rounds * TRANSFER_BYTES) as f64 / 1e9;
    let iperf_after = iperf(&link);
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "profile {} | {:.3} GB/s | of iperf3 best {:.2} ({:.3} / {:.3} GB/s) | plugin CPU {:.2} s/GB | relay CPU {:.2} s/GB | load {}",
        profile.name,
        gb / secs,
        gb / secs / iperf_before.max(iperf_after),
        iperf_before,
        iperf_after,
        cpu / gb,
        relay / gb,
        load.split(' ').next().unwrap_or("?")
    );
    for host in 0..2 {
        // Where datagrams were dropped inside each host: the TUN device's queue, the UDP sockets' buffers.
        let ns = link.host(host).namespace.clone();
        let dev =
            std::process::Command::new("ip").args(["-n", &ns, "-s", "link", "show", kvgate_netbed::DEVICE]).output();
        let udp = std::process::Command::new("ip")
            .args(["netns", "exec", &ns, "nstat", "-az", "UdpRcvbufErrors", "UdpSndbufErrors", "UdpInErrors"])
            .output();
        for out in [dev, udp].into_iter().flatten() {
            let text = String::from_utf8_lossy(&out.stdout);
            println!("  host {host}: {}", text.split_whitespace().collect::<Vec<_>>().join(" "));
        }
    }
    for (side, stats) in
        [("sender", a.plugin.outgoing_connection_stats()), ("receiver", b.plugin.incoming_connection_stats())]
    {
        for s in stats {
            println!(
                "  {side}: mtu {} | tx {} datagrams in {} calls ({:.1}/call) | rx {} datagrams in {} calls ({:.1}/call) | lost {} | cwnd {} | rtt {:?} | congestion events {}",
                s.path.current_mtu,
                s.udp_tx.datagrams,
                s.udp_tx.ios,
                s.udp_tx.datagrams as f64 / s.udp_tx.ios.max(1) as f64,
                s.udp_rx.datagrams,
                s.udp_rx.ios,
                s.udp_rx.datagrams as f64 / s.udp_rx.ios.max(1) as f64,
                s.path.lost_packets,
                s.path.cwnd,
                s.path.rtt,
                s.path.congestion_events,
            );
        }
    }
}
