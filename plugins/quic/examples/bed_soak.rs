//! The stuck-connection soak: many runs of two plugin instances across the two-host test bed
//! (`tests/netbed`), configured as the shipped two-host deployment (`configs/quic-two-hosts`: BBR and
//! the stuck-connection watchdog's settings), each run on fresh instances (fresh connections, as a
//! fresh pair of gateways would have). A run moves `--transfers` x `--transfer-mib` MiB from host 0 to
//! host 1, `--in-flight` at a time. A transfer that fails (the watchdog failing the parts of a stuck
//! connection, `TRANSPORT_ERROR`) is retried once quiesced, as the host retries a failed transfer.
//!
//! Beside the watchdog, the soak watches the sender on its own: every `MONITOR_STEP_MS` it reads the
//! UDP bytes sent by the outgoing connections, and while transfers are outstanding it computes their
//! rate over the last `stuck_after_ms`. A window below the watchdog's bar (the larger of
//! `stuck_min_bytes_per_s` and `stuck_below_best_percent` of the best such window since the
//! connections were opened) is a slow window; a stall lasting longer than the watchdog's bound
//! (`stuck_after_ms` plus its sampling step, `stuck_after_ms / 4`, plus `SLACK_MS`) with no replacement
//! in between is a stuck connection that survived: the run fails. So does a run whose transfers do not
//! all complete. Per run it prints the rate, its ratio to iperf3 (TCP BBR) over the same link
//! before and after the profile's runs, the replacements, the retried transfers, the longest stall,
//! and the transfers slower than the shipped deadline (`transfer_base_ms + bytes in flight /
//! min_bandwidth_bytes_per_s` of `configs/quic-two-hosts`); then a summary per profile. Exits 1 when a
//! run failed. Needs root and iperf3.
//!
//! `cargo run --release -p kvgate-plugin-quic --example bed_soak -- --profiles b,c --runs 50`
//!
//! Options: `--profiles b,c` (netbed profiles, comma-separated), `--runs 50` (per profile),
//! `--transfers 8`, `--transfer-mib 64`, `--in-flight 4`, `--config 'key = value;...'` (added to the
//! shipped plugin table, for experiments), `--fresh-link` (a new link per run, not per profile).

#[path = "../tests/common/mod.rs"]
mod common;
use common::*;
use kvgate_abi::sdk::Plugin;
use kvgate_abi::{EventKind, LocalRange, Segment, Ticket, XferId};
use kvgate_netbed::{Link, Profile};
use kvgate_plugin_quic::QuicConfig;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The shipped deployment whose plugin settings every run uses.
const SHIPPED: &str = include_str!("../../../configs/quic-two-hosts/prefill.toml");
/// How often the soak reads the sender's counters.
const MONITOR_STEP_MS: u64 = 100;
/// Allowance on top of the watchdog's bound for the two samplings' misalignment.
const SLACK_MS: u64 = 500;
/// The deadline handed to each transfer: far beyond any bound, so the watchdog ends a stuck one.
const TRANSFER_TIMEOUT: Duration = Duration::from_secs(120);
/// A run still incomplete after this long fails.
const RUN_LIMIT: Duration = Duration::from_secs(600);
/// A transfer failing more often than this in one run ends the run (incomplete).
const MAX_RETRIES_PER_TRANSFER: u32 = 5;

struct Options {
    profiles: Vec<String>,
    runs: usize,
    transfers: u64,
    transfer_bytes: u64,
    in_flight: u64,
    extra: String,
    fresh_link: bool,
}

fn options() -> Options {
    let mut o = Options {
        profiles: vec!["b".into(), "c".into()],
        runs: 50,
        transfers: 8,
        transfer_bytes: 64 << 20,
        in_flight: 4,
        extra: String::new(),
        fresh_link: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--fresh-link" {
            o.fresh_link = true;
            continue;
        }
        let value = args.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        let number = |v: &str| v.parse::<u64>().unwrap_or_else(|_| panic!("{flag}: not a number: {v}"));
        match flag.as_str() {
            "--profiles" => o.profiles = value.split(',').map(str::to_string).collect(),
            "--runs" => o.runs = number(&value) as usize,
            "--transfers" => o.transfers = number(&value).max(1),
            "--transfer-mib" => o.transfer_bytes = number(&value).max(1) << 20,
            "--in-flight" => o.in_flight = number(&value).max(1),
            "--config" => o.extra = value.replace(';', "\n"),
            other => panic!("unknown option {other}"),
        }
    }
    o
}

/// The shipped `[plugins.config.quic]` table (its `listen_address` dropped: each host sets its own),
/// plus `extra`; and the shipped scheduler's deadline terms (`transfer_base_ms`, `min_bandwidth_bytes_per_s`).
fn shipped_config(extra: &str) -> (QuicConfig, String, u64, u64) {
    let v: toml::Value = toml::from_str(SHIPPED).expect("the shipped config parses");
    let mut quic = v["plugins"]["config"]["quic"].as_table().expect("[plugins.config.quic]").clone();
    quic.remove("listen_address");
    let text = format!("{}\n{extra}", toml::to_string(&quic).expect("toml"));
    let config = QuicConfig::parse(&text).expect("the shipped plugin settings are valid");
    let base_ms = v["scheduler"]["transfer_base_ms"].as_integer().expect("transfer_base_ms") as u64;
    let min_bw = v["scheduler"]["min_bandwidth_bytes_per_s"].as_integer().expect("min_bandwidth_bytes_per_s") as u64;
    (config, text, base_ms, min_bw)
}

fn open_on(link: &Link, host: usize, config: QuicConfig) -> Node {
    let address = link.host(host).address;
    let config = QuicConfig { listen_address: format!("{address}:0").parse().unwrap(), ..config };
    kvgate_netbed::in_namespace(&link.host(host).namespace, move || open(config)).expect("namespace")
}

/// What the soak's own watch of the sender saw in one run.
#[derive(Default)]
struct Watch {
    /// Monitor readings whose window was below the bar.
    slow_windows: u64,
    /// The longest stall (from the start of the first slow window to its end or a replacement), ms.
    longest_stall_ms: u64,
    /// Stalls longer than the bound with no replacement in them.
    survived: u64,
}

/// Reads the sender's counters until `stop`; `live` says whether transfers are outstanding.
fn monitor(
    plugin: &kvgate_plugin_quic::QuicPlugin,
    config: &QuicConfig,
    live: &AtomicBool,
    stop: &AtomicBool,
) -> Watch {
    let window_ms = config.stuck_after_ms.max(1);
    let bound_ms = config.stuck_after_ms + config.stuck_after_ms / 4 + SLACK_MS;
    let start = Instant::now();
    let mut w = Watch::default();
    // (when, UDP bytes sent by all outgoing connections, by each).
    let mut samples: VecDeque<(u64, u64, Vec<u64>)> = VecDeque::new();
    let mut best = 0u64;
    let mut replaced = plugin.stuck_connections_replaced();
    let mut last_tx = 0u64;
    // The start of the current stall (the start of its first slow window), and whether it was counted.
    let mut stall_since: Option<u64> = None;
    let mut stall_counted = false;
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(MONITOR_STEP_MS));
        let at = start.elapsed().as_millis() as u64;
        let stats = plugin.outgoing_connection_stats();
        let each: Vec<u64> = stats.iter().map(|s| s.udp_tx.bytes).collect();
        let tx: u64 = each.iter().sum();
        let now_replaced = plugin.stuck_connections_replaced();
        if now_replaced != replaced || tx < last_tx || samples.back().is_some_and(|s| s.2.len() != each.len()) {
            // New connections: the watchdog starts afresh on them, so does the soak.
            replaced = now_replaced;
            samples.clear();
            best = 0;
            stall_since = None;
            stall_counted = false;
        }
        last_tx = tx;
        if !live.load(Ordering::Relaxed) {
            samples.clear();
            stall_since = None;
            stall_counted = false;
            continue;
        }
        samples.push_back((at, tx, each.clone()));
        while samples.len() >= 2 && at - samples[1].0 >= window_ms {
            samples.pop_front();
        }
        let (t0, b0) = (samples[0].0, samples[0].1);
        if at - t0 < window_ms {
            continue;
        }
        let rate = (tx - b0) * 1000 / (at - t0);
        let bar = (best * config.stuck_below_best_percent / 100).max(config.stuck_min_bytes_per_s);
        if rate < bar {
            w.slow_windows += 1;
            let since = *stall_since.get_or_insert(t0);
            let stall = at - since;
            w.longest_stall_ms = w.longest_stall_ms.max(stall);
            if stall > bound_ms && !stall_counted {
                stall_counted = true;
                w.survived += 1;
                eprintln!(
                    "  stall of {stall} ms without replacement: {rate} B/s over {} ms, bar {bar} B/s, best {best} B/s",
                    at - t0
                );
                for (i, s) in stats.iter().enumerate() {
                    eprintln!(
                        "    connection {i}: {} B/s over the window | cwnd {} | rtt {:?} | lost {} | congestion events {} | mtu {}",
                        (each[i] - samples[0].2[i]) * 1000 / (at - t0),
                        s.path.cwnd,
                        s.path.rtt,
                        s.path.lost_packets,
                        s.path.congestion_events,
                        s.path.current_mtu
                    );
                }
            }
        } else {
            stall_since = None;
            stall_counted = false;
            best = best.max(rate);
        }
    }
    w
}

/// One run's outcome.
struct RunResult {
    gb_per_s: f64,
    replaced: u64,
    retries: u64,
    failures: HashMap<String, u64>,
    completed: bool,
    over_shipped_bound: u64,
    watch: Watch,
}

fn one_run(
    link: &Link,
    config: &QuicConfig,
    o: &Options,
    src: &Buffer,
    dst: &Buffer,
    base_ms: u64,
    min_bw: u64,
) -> RunResult {
    let a = open_on(link, 0, config.clone());
    let b = open_on(link, 1, config.clone());
    a.plugin.connect(PEER_B, &b.plugin.local_endpoint()).unwrap();
    b.plugin.connect(PEER_A, &a.plugin.local_endpoint()).unwrap();
    let r = route(&a, PEER_B, &b, src, dst);
    let live_flag = AtomicBool::new(false);
    let stop = AtomicBool::new(false);
    let next_id = AtomicU64::new(1);
    let failures: Mutex<HashMap<String, u64>> = Mutex::default();
    let (mut retries, mut over_bound, mut completed) = (0u64, 0u64, true);
    let t0 = Instant::now();
    let watch = std::thread::scope(|scope| {
        let watcher = scope.spawn(|| monitor(&a.plugin, config, &live_flag, &stop));
        // Per live transfer: its slot, when it was (first) submitted, its shipped bound, retries.
        struct Live {
            slot: u64,
            since: Instant,
            bound: Duration,
            tries: u32,
        }
        let mut live: HashMap<u64, Live> = HashMap::new();
        let mut started = 0u64;
        let mut free_slots: Vec<u64> = (0..o.in_flight).rev().collect();
        let send = |slot: u64| -> u64 {
            let id = next_id.fetch_add(1, Ordering::Relaxed);
            let off = slot * o.transfer_bytes;
            expect(
                &b,
                PEER_A,
                Ticket(id),
                &[LocalRange { key: r.dst_key, offset: off, len: o.transfer_bytes }],
                TRANSFER_TIMEOUT,
            );
            let seg = Segment {
                local: r.src_key,
                local_offset: off,
                remote: r.remote,
                remote_offset: off,
                len: o.transfer_bytes,
            };
            submit(&a, PEER_B, XferId(id), Ticket(id), &[seg], TRANSFER_TIMEOUT).expect("submit");
            id
        };
        while started < o.transfers || !live.is_empty() {
            while started < o.transfers && !free_slots.is_empty() {
                let slot = free_slots.pop().expect("a free slot");
                let ahead = (live.len() as u64 + 1) * o.transfer_bytes;
                let bound = Duration::from_millis(base_ms + ahead * 1000 / min_bw.max(1));
                let id = send(slot);
                live.insert(id, Live { slot, since: Instant::now(), bound, tries: 0 });
                started += 1;
            }
            live_flag.store(!live.is_empty(), Ordering::Relaxed);
            if t0.elapsed() > RUN_LIMIT {
                completed = false;
                break;
            }
            let ids: Vec<u64> = live.keys().copied().collect();
            let Some(e) =
                a.events.try_wait_for(Duration::from_millis(100), |e| e.is_terminal() && ids.contains(&e.xfer.0))
            else {
                continue;
            };
            let id = e.xfer.0;
            let entry = live.remove(&id).expect("a live transfer");
            if e.kind == EventKind::SUCCEEDED {
                b.plugin.cancel_incoming(PEER_A, Ticket(id));
                if entry.since.elapsed() > entry.bound {
                    over_bound += 1;
                }
                free_slots.push(entry.slot);
                continue;
            }
            *failures.lock().unwrap().entry(format!("{}", e.reason)).or_default() += 1;
            eprintln!("  transfer {id} failed ({}): {}", e.reason, e.message);
            // As the host does: wait until no byte of it can land, revoke its ticket, send it again.
            a.events.quiesced(XferId(id), WAIT);
            b.plugin.cancel_incoming(PEER_A, Ticket(id));
            if entry.tries >= MAX_RETRIES_PER_TRANSFER {
                completed = false;
                break;
            }
            retries += 1;
            let again = send(entry.slot);
            live.insert(again, Live { tries: entry.tries + 1, ..entry });
        }
        live_flag.store(false, Ordering::Relaxed);
        stop.store(true, Ordering::Relaxed);
        watcher.join().expect("the monitor")
    });
    let secs = t0.elapsed().as_secs_f64();
    let replaced = a.plugin.stuck_connections_replaced();
    RunResult {
        gb_per_s: (o.transfers * o.transfer_bytes) as f64 / 1e9 / secs,
        replaced,
        retries,
        failures: failures.into_inner().unwrap(),
        completed,
        over_shipped_bound: over_bound,
        watch,
    }
}

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg").unwrap_or_default().split(' ').take(3).collect::<Vec<_>>().join(" ")
}

fn main() {
    let o = options();
    let (config, text, base_ms, min_bw) = shipped_config(&o.extra);
    println!("plugin settings (configs/quic-two-hosts):\n{}", text.trim());
    let src = Buffer::random((o.transfer_bytes * o.in_flight) as usize, 1);
    let dst = Buffer::zeroed((o.transfer_bytes * o.in_flight) as usize);
    let iperf = |link: &Link| link.iperf3(4.0, 1, Some("bbr")).map(|r| r.bytes_per_s / 1e9).unwrap_or(f64::NAN);
    let mut any_failed = false;
    for name in &o.profiles {
        let profile = Profile::parse(name).expect("profile");
        let mut link = Link::start(&profile).expect("start the link");
        let iperf_before = iperf(&link);
        println!(
            "profile {} ({}) | iperf3 bbr {:.3} GB/s | load {}",
            profile.name,
            profile.describe(),
            iperf_before,
            load()
        );
        let mut results = Vec::new();
        for run in 0..o.runs {
            if o.fresh_link && run > 0 {
                drop(link);
                link = Link::start(&profile).expect("start the link");
            }
            let r = one_run(&link, &config, &o, &src, &dst, base_ms, min_bw);
            let failed = !r.completed || r.watch.survived > 0;
            println!(
                "run {run:3} {} | {:.3} GB/s ({:.2} of iperf3 before) | replaced {} | retried {} {:?} | slow windows {} | longest stall {} ms | survived {} | completed {} | over shipped bound {} | load {}{}",
                profile.name,
                r.gb_per_s,
                r.gb_per_s / iperf_before,
                r.replaced,
                r.retries,
                r.failures,
                r.watch.slow_windows,
                r.watch.longest_stall_ms,
                r.watch.survived,
                r.completed,
                r.over_shipped_bound,
                load(),
                if failed { " | FAILED" } else { "" }
            );
            results.push(r);
        }
        let iperf_after = iperf(&link);
        let reference = iperf_before.max(iperf_after);
        let mut rates: Vec<f64> = results.iter().map(|r| r.gb_per_s / reference).collect();
        rates.sort_by(f64::total_cmp);
        let count = |f: &dyn Fn(&RunResult) -> bool| results.iter().filter(|r| f(r)).count();
        let failed = count(&|r| !r.completed || r.watch.survived > 0);
        any_failed |= failed > 0;
        println!(
            "summary {} | runs {} | with a slow window {} | stuck replaced in {} runs ({} replacements) | retried transfers {} | survived stalls {} | incomplete {} | failed runs {} | over shipped bound {} transfers in {} runs | of iperf3 best ({:.3} / {:.3} GB/s): min {:.2} median {:.2} max {:.2} | load {}",
            profile.name,
            results.len(),
            count(&|r| r.watch.slow_windows > 0),
            count(&|r| r.replaced > 0),
            results.iter().map(|r| r.replaced).sum::<u64>(),
            results.iter().map(|r| r.retries).sum::<u64>(),
            results.iter().map(|r| r.watch.survived).sum::<u64>(),
            count(&|r| !r.completed),
            failed,
            results.iter().map(|r| r.over_shipped_bound).sum::<u64>(),
            count(&|r| r.over_shipped_bound > 0),
            iperf_before,
            iperf_after,
            rates.first().copied().unwrap_or(f64::NAN),
            rates.get(rates.len() / 2).copied().unwrap_or(f64::NAN),
            rates.last().copied().unwrap_or(f64::NAN),
            load()
        );
    }
    if any_failed {
        std::process::exit(1);
    }
}
