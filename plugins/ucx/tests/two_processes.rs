//! The UCX plugin across two processes: data moves with checksums, and killing the receiver
//! process (SIGKILL) mid-transfer fails the sender's transfers fast with PEER_LOST — over TCP through
//! UCX's endpoint error handler, over shared memory (where UCX 1.13 has no peer-failure handling)
//! through the pidfd the plugin holds on a same-host peer's process. Both well inside the transfers'
//! 5 s deadlines. The receiver is this test binary re-run as a child process.

mod support;

use kvgate_abi::sdk::Plugin;
use kvgate_abi::*;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use support::*;

const CHILD_ENV: &str = "KVGATE_UCX_TEST_CHILD_CONFIG";
const REGION_BYTES: usize = 64 << 20;
/// How long the child lives at most if its parent forgets it.
const CHILD_LIFETIME: Duration = Duration::from_secs(60);

/// The child: a receiver that prints its endpoint and remote key, connects back, authorises ticket 1,
/// answers `sum OFFSET LEN` with a checksum, and lives until killed (or `CHILD_LIFETIME`).
#[test]
fn child_receiver() {
    let Ok(config) = std::env::var(CHILD_ENV) else { return };
    let b = open(&config);
    let dst = buffer(&b, REGION_BYTES, 99);
    let mut out = std::io::stdout();
    writeln!(out, "endpoint {}", hex(&b.plugin.local_endpoint())).unwrap();
    writeln!(out, "rkey {}", hex(&dst.remote_key_bytes)).unwrap();
    out.flush().unwrap();
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    let parent_endpoint = unhex(lines.next().unwrap().unwrap().trim());
    b.plugin.connect(PEER_A, &parent_endpoint).unwrap();
    expect(&b, 1, PEER_A, CHILD_LIFETIME, &[LocalRange { key: dst.key, offset: 0, len: REGION_BYTES as u64 }]);
    writeln!(out, "ready").unwrap();
    out.flush().unwrap();
    for line in lines {
        let line = line.unwrap();
        let words: Vec<&str> = line.split_whitespace().collect();
        if words.first() == Some(&"sum") {
            let (offset, len): (usize, usize) = (words[1].parse().unwrap(), words[2].parse().unwrap());
            writeln!(out, "sum {}", checksum(&dst.bytes[offset..offset + len])).unwrap();
            out.flush().unwrap();
        }
    }
    std::thread::sleep(CHILD_LIFETIME);
}

struct ChildReceiver {
    child: Child,
    /// The child's stdout lines, read by a thread so that every wait here is bounded.
    stdout: std::sync::mpsc::Receiver<String>,
    endpoint: Vec<u8>,
    rkey: Vec<u8>,
}

impl ChildReceiver {
    fn spawn(config: &str, parent_endpoint: &[u8]) -> ChildReceiver {
        let exe = std::env::current_exe().unwrap();
        let mut child = Command::new(exe)
            .args(["--exact", "child_receiver", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, config)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let (tx, stdout) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let field = |name: &str| loop {
            let line = stdout.recv_timeout(WAIT_LIMIT).expect("child silent or ended early");
            // The test harness may print its own words before ours on the same line.
            if let Some(at) = line.find(name) {
                return unhex(line[at + name.len()..].trim());
            }
        };
        let endpoint = field("endpoint ");
        let rkey = field("rkey ");
        let stdin = child.stdin.as_mut().unwrap();
        writeln!(stdin, "{}", hex(parent_endpoint)).unwrap();
        stdin.flush().unwrap();
        let mut receiver = ChildReceiver { child, stdout, endpoint, rkey };
        receiver.wait_line("ready");
        receiver
    }

    fn wait_line(&mut self, prefix: &str) -> String {
        loop {
            let line = self.stdout.recv_timeout(WAIT_LIMIT).expect("child silent or ended early");
            if let Some(at) = line.find(prefix) {
                return line[at..].to_string();
            }
        }
    }

    fn checksum(&mut self, offset: usize, len: usize) -> u64 {
        let stdin = self.child.stdin.as_mut().unwrap();
        writeln!(stdin, "sum {offset} {len}").unwrap();
        stdin.flush().unwrap();
        self.wait_line("sum ")[4..].trim().parse().unwrap()
    }
}

impl Drop for ChildReceiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn kill_receiver_mid_transfer(config: &str, expected: ReasonCode, bound: Duration) {
    let a = open(config);
    let mut child = ChildReceiver::spawn(config, &a.plugin.local_endpoint());
    a.plugin.connect(PEER_B, &child.endpoint).unwrap();
    let remote = a.plugin.import_remote_key(PEER_B, &child.rkey).unwrap();
    let src = buffer(&a, REGION_BYTES, 7);
    // Data integrity across processes first.
    let seg = Segment { local: src.key, local_offset: 13, remote, remote_offset: 101, len: (4 << 20) + 3 };
    submit(&a, 1, PEER_B, 1, Duration::from_secs(20), &[seg]).unwrap();
    let end = a.log.terminal_of(XferId(1), WAIT_LIMIT);
    assert_eq!(end.kind, EventKind::SUCCEEDED, "{end:?}");
    assert_eq!(child.checksum(101, (4 << 20) + 3), checksum(&src.bytes[13..13 + (4 << 20) + 3]));
    // Then a stream of large transfers, and the receiver dies in the middle of it.
    let whole = Segment { local: src.key, local_offset: 0, remote, remote_offset: 0, len: REGION_BYTES as u64 };
    for xfer in 2..6u64 {
        submit(&a, xfer, PEER_B, 1, Duration::from_secs(5), &[whole]).unwrap();
    }
    std::thread::sleep(Duration::from_millis(5));
    let killed_at = Instant::now();
    child.child.kill().unwrap();
    child.child.wait().unwrap();
    for xfer in 2..6u64 {
        let end = a.log.terminal_of(XferId(xfer), WAIT_LIMIT);
        let waited = killed_at.elapsed();
        if end.kind == EventKind::SUCCEEDED {
            continue; // landed before the kill
        }
        assert_eq!(end.reason, expected, "{end:?}");
        assert!(waited <= bound, "transfer {xfer} ended {waited:?} after the kill (bound {bound:?})");
    }
    a.plugin.shutdown();
}

#[test]
fn tcp_receiver_killed_fails_transfers_with_peer_lost() {
    kill_receiver_mid_transfer(&tcp_config(), ReasonCode::PEER_LOST, Duration::from_secs(2));
}

#[test]
fn sm_receiver_killed_fails_transfers_with_peer_lost() {
    kill_receiver_mid_transfer(&sm_am_config(), ReasonCode::PEER_LOST, Duration::from_secs(2));
}
