//! The physical references each plugin is measured against, in the same run and on the same bytes:
//! memcpy (shm), a plain blocking TCP loopback copy (QUIC), `ucx_perftest` on the same UCX transport
//! (UCX). memcpy and TCP return per-copy latencies; `ucx_perftest` a rate. Never touches a gateway.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Most copies one reference measurement makes (a 4 KiB memcpy takes about a microsecond).
pub const MAX_REFERENCE_COPIES: u64 = 200_000;

/// How long and how often a reference copies: at least `min_copies`, then until `budget` passed.
#[derive(Clone, Copy, Debug)]
pub struct CopyBudget {
    pub min_copies: u64,
    pub budget: Duration,
}

impl CopyBudget {
    fn more(&self, done: u64, started: Instant) -> bool {
        done < MAX_REFERENCE_COPIES && (done < self.min_copies || started.elapsed() < self.budget)
    }
}

/// Which reference a plugin is measured against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReferenceKind {
    /// One thread copying block by block between the same two pool files the gateways map.
    Memcpy,
    /// One blocking TCP connection on 127.0.0.1, block by block, with a one-byte acknowledgement.
    TcpLoopback,
    /// `ucx_perftest` server + client on 127.0.0.1 over the same UCX transport, messages of one block.
    UcxPerftest(UcxTransport),
}

impl ReferenceKind {
    /// Whether it copies between the bench's own mappings of the pool files (memcpy, TCP).
    pub fn copies_memory(self) -> bool {
        matches!(self, ReferenceKind::Memcpy | ReferenceKind::TcpLoopback)
    }

    pub fn describe(self) -> &'static str {
        match self {
            ReferenceKind::Memcpy => "memcpy, 1 thread, block by block between the same two pool files",
            ReferenceKind::TcpLoopback => "TCP loopback, 1 blocking connection (std::net, TCP_NODELAY), block by block, 1-byte ack per transfer",
            ReferenceKind::UcxPerftest(UcxTransport::SharedMemory) => {
                "ucx_perftest -t ucp_am_bw, UCX_TLS=posix,sysv,cma, server + client on 127.0.0.1, buffers written first (MALLOC_PERTURB_), one message per block, all from one block-sized buffer, \
                 as many outstanding (-O) as the cell's rooms in flight (a rate: ref p50 is the transfer's bytes at that rate)"
            }
            ReferenceKind::UcxPerftest(UcxTransport::Tcp) => {
                "ucx_perftest -t ucp_am_bw -e, UCX_TLS=tcp, UCX_NET_DEVICES=lo, server + client on 127.0.0.1, buffers written first (MALLOC_PERTURB_), one message per block, all from one block-sized buffer, \
                 as many outstanding (-O) as the cell's rooms in flight (a rate: ref p50 is the transfer's bytes at that rate)"
            }
        }
    }
}

/// The UCX transports the bench measures, each as its own matrix entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UcxTransport {
    /// UCX's shared-memory transports (`posix,sysv,cma`).
    SharedMemory,
    /// UCX's TCP transport on the loopback device.
    Tcp,
}

impl UcxTransport {
    pub const ALL: [UcxTransport; 2] = [UcxTransport::SharedMemory, UcxTransport::Tcp];

    /// The matrix entry's name (`--plugins ucx-sm,ucx-tcp`; `ucx` means both).
    pub fn bench_name(self) -> &'static str {
        match self {
            UcxTransport::SharedMemory => "ucx-sm",
            UcxTransport::Tcp => "ucx-tcp",
        }
    }
    /// The plugin's own config (`[plugins.config.ucx]`), as in plugins/ucx/conformance/{sm,tcp}.toml.
    /// The plugin's `auto` mode moves active messages on both, so the reference is `ucp_am_bw`.
    pub fn plugin_config(self) -> &'static str {
        match self {
            UcxTransport::SharedMemory => "tls = \"posix,sysv,cma\"\n",
            UcxTransport::Tcp => "tls = \"tcp\"\ndevices = \"lo\"\n",
        }
    }
    /// The same transport for `ucx_perftest`, through UCX's environment.
    pub fn ucx_env(self) -> &'static [(&'static str, &'static str)] {
        match self {
            UcxTransport::SharedMemory => &[("UCX_TLS", "posix,sysv,cma")],
            UcxTransport::Tcp => &[("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", "lo")],
        }
    }
    pub fn perftest_test(self) -> &'static str {
        "ucp_am_bw"
    }
    /// Extra `ucx_perftest` arguments that give its endpoints the mode the plugin's use. Over TCP the
    /// plugin's endpoints handle peer failure (`UCP_ERR_HANDLING_MODE_PEER`: a dead peer fails its
    /// transfers), and `-e` asks the same of the reference; without it UCX 1.13 picks other
    /// large-message protocols, so the reference would measure a different path. Shared memory has
    /// no peer-failure mode in UCX 1.13, on either side. The plugin's own benchmark does the same.
    pub fn perftest_extra_args(self) -> &'static [&'static str] {
        match self {
            UcxTransport::SharedMemory => &[],
            UcxTransport::Tcp => &["-e"],
        }
    }
}

/// Set on both `ucx_perftest` processes: glibc then writes this byte's complement into every block it
/// hands out (`MALLOC_PERTURB_`, glibc's documented malloc tunable). Over TCP `ucx_perftest` takes
/// its buffers from `posix_memalign` and never writes its send buffer, so without it every byte it
/// sends is read from the kernel's shared zero page; the gateways send from written pool pages. With
/// it both sides move bytes from written memory. Shared-memory buffers come from `shmget`, not malloc:
/// no change there. `ucx_perftest` mallocs nothing per message, so the cost is at setup only.
pub const PERFTEST_WRITTEN_BUFFERS_ENV: (&str, &str) = ("MALLOC_PERTURB_", "165");

/// The longest one `ucx_perftest` run (server or client) may take before `timeout` kills it.
pub const PERFTEST_TIMEOUT_S: u64 = 120;
/// How long the `ucx_perftest` server may take to say it waits for its client.
pub const PERFTEST_SERVER_READY_MS: u64 = 10_000;
/// Most messages one `ucx_perftest` measurement sends.
pub const MAX_PERFTEST_MESSAGES: u64 = 1_000_000;
/// Fewest bytes one `ucx_perftest` measurement moves (short runs are dominated by noise).
pub const MIN_PERFTEST_BYTES: u64 = 64 << 20;

/// How many `block`-byte messages a `ucx_perftest` measurement sends: at least `blocks x min_copies`,
/// at least [`MIN_PERFTEST_BYTES`], and about what the plugin moved in the cell's budget.
pub fn perftest_messages(block: u64, blocks: u64, min_copies: u64, plugin_bytes_in_budget: u64) -> u64 {
    let block = block.max(1);
    let wanted =
        (blocks.saturating_mul(min_copies)).max(MIN_PERFTEST_BYTES / block).max(plugin_bytes_in_budget / block);
    wanted.clamp(16, MAX_PERFTEST_MESSAGES)
}

/// One `ucx_perftest` server + client run on 127.0.0.1: `messages` messages of `block` bytes from the
/// client to the server over `transport`; the client's overall bandwidth in GB/s (1e9 bytes/s; UCX
/// prints MiB/s and calls it MB/s). Both run under `timeout`; the server is stopped (through
/// `timeout`, which forwards SIGTERM to it) whatever happens. `outstanding` messages are in flight at
/// once (`-O`, at least 1 and at most `messages`): the cell's rooms in flight, so that UCX itself does
/// the same job with the same concurrency.
pub fn ucx_perftest_gbps(transport: UcxTransport, block: u64, messages: u64, outstanding: u64) -> Result<f64, String> {
    // The same picking as the gateways' ports: below the ephemeral range, out of the way of the
    // outgoing connections the running gateways make meanwhile.
    let port = kvgate_demo::gateways::free_port();
    let owned = perftest_args(transport, block, messages, outstanding, port);
    let args: Vec<&str> = owned.iter().map(String::as_str).collect();
    let server = perftest_command(transport, None, &args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start timeout + ucx_perftest (install ucx-utils): {e}"))?;
    let mut server = StopOnDrop(server);
    // The client fails when it comes before the server listens (its stdout is block-buffered in a
    // pipe, so "Waiting for connection" cannot be relied on): wait for the listening socket itself.
    let deadline = Instant::now() + Duration::from_millis(PERFTEST_SERVER_READY_MS);
    while !tcp_port_listening(port) {
        if let Ok(Some(status)) = server.0.try_wait() {
            return Err(format!("ucx_perftest server exited before listening ({status})"));
        }
        if Instant::now() > deadline {
            return Err(format!(
                "ucx_perftest server did not listen on port {port} within {PERFTEST_SERVER_READY_MS} ms"
            ));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let client = perftest_command(transport, Some("127.0.0.1"), &args)
        .output()
        .map_err(|e| format!("ucx_perftest client: {e}"))?;
    drop(server);
    let text = String::from_utf8_lossy(&client.stdout);
    parse_perftest_overall_mib_s(&text).map(|mib_s| mib_s * 1_048_576.0 / 1e9).ok_or_else(|| {
        format!(
            "no result line in ucx_perftest output ({}):\n{text}\n{}",
            client.status,
            String::from_utf8_lossy(&client.stderr)
        )
    })
}

/// The arguments both `ucx_perftest` processes get: test, message size and count, warm-up (a tenth,
/// at least 10), outstanding messages (`-O`, clamped to 1..=`messages`), port, and the transport's
/// endpoint mode.
fn perftest_args(transport: UcxTransport, block: u64, messages: u64, outstanding: u64, port: u16) -> Vec<String> {
    let (size, count, warmup) = (block.to_string(), messages.to_string(), (messages / 10).max(10).to_string());
    let (outstanding, port) = (outstanding.clamp(1, messages.max(1)).to_string(), port.to_string());
    let fixed = [
        "-t",
        transport.perftest_test(),
        "-s",
        &size,
        "-n",
        &count,
        "-w",
        &warmup,
        "-O",
        &outstanding,
        "-p",
        &port,
        "-f",
    ];
    let mut args: Vec<String> = fixed.iter().map(|a| a.to_string()).collect();
    args.extend(transport.perftest_extra_args().iter().map(|a| a.to_string()));
    args
}

/// `timeout ucx_perftest [server] args` with the transport's UCX environment and written buffers
/// ([`PERFTEST_WRITTEN_BUFFERS_ENV`]), stdin closed: the server when `server` is `None`, else the
/// client of that server.
fn perftest_command(transport: UcxTransport, server: Option<&str>, args: &[&str]) -> Command {
    let mut command = Command::new("timeout");
    command.arg(PERFTEST_TIMEOUT_S.to_string()).arg("ucx_perftest");
    command.args(server).args(args);
    command.envs(transport.ucx_env().iter().copied());
    command.env(PERFTEST_WRITTEN_BUFFERS_ENV.0, PERFTEST_WRITTEN_BUFFERS_ENV.1);
    command.stdin(Stdio::null());
    command
}

/// A `timeout ucx_perftest` server: on drop, SIGTERM to `timeout` (it passes it on to ucx_perftest;
/// SIGKILL would orphan the server), then a bounded wait, then SIGKILL.
struct StopOnDrop(std::process::Child);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        if let Ok(Some(_)) = self.0.try_wait() {
            return;
        }
        let pid = nix::unistd::Pid::from_raw(self.0.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_millis(PERFTEST_SERVER_READY_MS);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Whether some socket listens on TCP `port` (any address), from `/proc/net/tcp` and `tcp6`.
fn tcp_port_listening(port: u16) -> bool {
    let wanted = format!(":{port:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|table| {
        std::fs::read_to_string(table).is_ok_and(|text| {
            text.lines().skip(1).any(|line| {
                let fields: Vec<&str> = line.split_whitespace().collect();
                // fields: sl, local_address, rem_address, st (0A = LISTEN), ...
                fields.len() > 3 && fields[1].ends_with(&wanted) && fields[3] == "0A"
            })
        })
    })
}

/// The overall bandwidth (MiB/s) of `ucx_perftest -f`'s result line: iterations, latency p50, average
/// and overall, bandwidth average and overall, message rate average and overall.
pub fn parse_perftest_overall_mib_s(output: &str) -> Option<f64> {
    output.lines().rev().find_map(|line| {
        let fields: Vec<f64> = line.split_whitespace().filter_map(|f| f.parse().ok()).collect();
        (fields.len() >= 8).then(|| fields[5]).filter(|v| v.is_finite() && *v > 0.0)
    })
}

/// Where transfer `n` of a reference starts: `slots = (stride, depth)` are the pool slots the plugin's
/// rooms used in the same cell, taken in turn (so both touch the same memory, as hot or as cold).
fn slot_offset(n: usize, slots: (u64, u64)) -> usize {
    (n as u64 % slots.1.max(1) * slots.0) as usize
}

fn assert_slots_fit(src: &[u8], dst: &[u8], transfer: usize, slots: (u64, u64)) {
    let end = slot_offset(slots.1.max(1) as usize - 1, slots) + transfer;
    assert!(end <= src.len() && end <= dst.len(), "every slot of the transfer fits both buffers");
}

/// Copy `blocks` blocks of `block` bytes from `src` to `dst` (same offsets), one transfer after the
/// other over the slots `(stride, depth)`, on this one thread; one latency per whole transfer.
pub fn memcpy_copies(
    src: &[u8],
    dst: &mut [u8],
    block: usize,
    blocks: usize,
    slots: (u64, u64),
    budget: CopyBudget,
) -> Vec<Duration> {
    assert_slots_fit(src, dst, block * blocks, slots);
    let mut out = Vec::new();
    let started = Instant::now();
    while budget.more(out.len() as u64, started) {
        let base = slot_offset(out.len(), slots);
        let t0 = Instant::now();
        for i in 0..blocks {
            let range = base + i * block..base + (i + 1) * block;
            dst[range.clone()].copy_from_slice(&src[range]);
        }
        std::hint::black_box(&dst[0]);
        out.push(t0.elapsed());
    }
    out
}

/// Send `blocks` blocks of `block` bytes from `src` over one loopback TCP connection into `dst`,
/// one transfer after the other over the slots `(stride, depth)`; a transfer ends when the receiver
/// acknowledged its last byte.
pub fn tcp_copies(
    src: &[u8],
    dst: &mut [u8],
    block: usize,
    blocks: usize,
    slots: (u64, u64),
    budget: CopyBudget,
) -> std::io::Result<Vec<Duration>> {
    assert_slots_fit(src, dst, block * blocks, slots);
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let address = listener.local_addr()?;
    std::thread::scope(|scope| {
        let receiver = scope.spawn(move || -> std::io::Result<()> {
            let (mut stream, _) = listener.accept()?;
            stream.set_nodelay(true)?;
            let mut go = [0u8; 1];
            // Each round: one byte from the sender says "a transfer follows" (0 = stop).
            let mut round = 0;
            while stream.read(&mut go)? == 1 && go[0] == 1 {
                let base = slot_offset(round, slots);
                for i in 0..blocks {
                    stream.read_exact(&mut dst[base + i * block..base + (i + 1) * block])?;
                }
                stream.write_all(&[1])?;
                round += 1;
            }
            Ok(())
        });
        let mut stream = TcpStream::connect(address)?;
        stream.set_nodelay(true)?;
        let mut out = Vec::new();
        let started = Instant::now();
        let mut ack = [0u8; 1];
        while budget.more(out.len() as u64, started) {
            let base = slot_offset(out.len(), slots);
            let t0 = Instant::now();
            stream.write_all(&[1])?;
            for i in 0..blocks {
                stream.write_all(&src[base + i * block..base + (i + 1) * block])?;
            }
            stream.read_exact(&mut ack)?;
            out.push(t0.elapsed());
        }
        stream.write_all(&[0])?;
        drop(stream);
        receiver.join().map_err(|_| std::io::Error::other("tcp reference receiver panicked"))??;
        Ok(out)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget() -> CopyBudget {
        CopyBudget { min_copies: 4, budget: Duration::from_millis(1) }
    }

    #[test]
    fn memcpy_reference_moves_the_bytes() {
        let src: Vec<u8> = (0..64 * 1024).map(|i| (i % 251) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        let copies = memcpy_copies(&src, &mut dst, 4096, 4, (16384, 4), budget());
        assert!(copies.len() >= 4, "every slot copied at least once");
        assert_eq!(src, dst);
    }

    #[test]
    fn perftest_result_line_is_read_and_headers_are_not() {
        let out = "+------+\n|     Test     | # iterations | 50.0%ile |\n                         200      0.722  2328.005  2328.005     1718.21    1718.21         430         430\n";
        assert_eq!(parse_perftest_overall_mib_s(out), Some(1718.21));
        assert_eq!(parse_perftest_overall_mib_s("Waiting for connection...\n"), None);
        assert_eq!(parse_perftest_overall_mib_s("1 2 3 4 5 0 7 8\n"), None, "a zero rate is not a result");
    }

    #[test]
    fn a_listening_port_is_seen_and_a_connected_one_is_not() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("address").port();
        assert!(tcp_port_listening(port));
        // The client's port stays held (so no other test can start listening on it) but is not
        // listening. A port freed by dropping a listener is not a fixed point: another test binding
        // port 0 at the same moment may be handed it.
        let client = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
        let client_port = client.local_addr().expect("client address").port();
        assert!(!tcp_port_listening(client_port));
    }

    #[test]
    fn perftest_messages_respect_their_bounds() {
        assert_eq!(perftest_messages(4096, 1, 3, 0), MIN_PERFTEST_BYTES / 4096);
        assert_eq!(perftest_messages(64 << 20, 1, 3, 0), 16, "at least 16 messages");
        assert_eq!(perftest_messages(8, 100_000, 3, 0), MAX_PERFTEST_MESSAGES, "capped");
        assert_eq!(perftest_messages(1 << 20, 1, 3, 1 << 30), 1024, "about what the plugin moved");
    }

    #[test]
    fn perftest_outstanding_messages_are_the_rooms_in_flight_within_bounds() {
        let outstanding = |o: u64, messages: u64| {
            let args = perftest_args(UcxTransport::Tcp, 4096, messages, o, 1);
            let at = args.iter().position(|a| a == "-O").expect("-O is passed");
            args[at + 1].parse::<u64>().expect("a count")
        };
        assert_eq!(outstanding(8, 200), 8);
        assert_eq!(outstanding(0, 200), 1, "at least one");
        assert_eq!(outstanding(1, 200), 1);
        assert_eq!(outstanding(200, 200), 200, "at most the messages");
        assert_eq!(outstanding(201, 200), 200);
        assert!(
            perftest_args(UcxTransport::Tcp, 4096, 200, 8, 1).contains(&"-e".to_string()),
            "TCP keeps its endpoint mode"
        );
    }

    #[test]
    fn perftest_processes_run_with_written_buffers_and_the_transport_env() {
        for transport in [UcxTransport::Tcp, UcxTransport::SharedMemory] {
            for server in [None, Some("127.0.0.1")] {
                let command = perftest_command(transport, server, &["-t", "ucp_am_bw"]);
                let envs: Vec<(String, String)> = command
                    .get_envs()
                    .filter_map(|(k, v)| Some((k.to_str()?.to_string(), v?.to_str()?.to_string())))
                    .collect();
                let perturb = envs.iter().find(|(k, _)| k == "MALLOC_PERTURB_").map(|(_, v)| v.parse::<u8>());
                assert!(matches!(perturb, Some(Ok(b)) if b != 0), "{transport:?} {server:?}: {envs:?}");
                for (key, value) in transport.ucx_env() {
                    assert!(envs.contains(&(key.to_string(), value.to_string())), "{transport:?}: {key} missing");
                }
                let args: Vec<_> = command.get_args().map(|a| a.to_string_lossy().into_owned()).collect();
                assert_eq!(args[1], "ucx_perftest");
                assert_eq!(args.get(2).map(String::as_str), Some(server.unwrap_or("-t")));
            }
        }
    }

    #[test]
    fn ucx_perftest_reference_runs_when_installed() {
        // Only on machines with ucx-utils (CI installs it); elsewhere there is nothing to run.
        if std::process::Command::new("ucx_perftest").arg("-h").output().is_err() {
            eprintln!("ucx_perftest not installed: nothing to check");
            return;
        }
        for outstanding in [1, 8] {
            let gbps = ucx_perftest_gbps(UcxTransport::Tcp, 64 << 10, 200, outstanding)
                .expect("ucx_perftest over TCP loopback");
            assert!(gbps > 0.0, "-O {outstanding}");
        }
    }

    #[test]
    fn tcp_reference_moves_the_bytes() {
        let src: Vec<u8> = (0..64 * 1024).map(|i| (i % 241) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        let copies = tcp_copies(&src, &mut dst, 1024, 16, (16384, 4), budget()).expect("loopback");
        assert!(copies.len() >= 4, "every slot sent at least once");
        assert_eq!(src, dst);
    }
}
