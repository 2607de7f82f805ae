//! Shared helpers of the GPU tests and the bandwidth benchmark: a pair of plugin instances in one
//! process wired to each other, event waiting with a bound, and the "no GPU here" refusal (these
//! tests fail loudly without a GPU; they are `#[ignore]`d so the CPU-only suite never runs them).
#![allow(dead_code)]

use kvgate_abi::sdk::{sink_from_fn, Plugin, Sink};
use kvgate_abi::*;
use kvgate_plugin_nvlink::{cuda, open_with_probe, NvlinkPlugin};
use std::sync::mpsc::{channel, Receiver};
use std::sync::Mutex;
use std::time::Duration;

pub const NEEDS_GPU: &str = "needs an NVIDIA GPU: run tests/gpu/run.sh";

/// Panics (the test fails, never passes) when this machine has no CUDA driver.
pub fn require_gpu() {
    if !cuda::driver_library_present() {
        panic!("DID NOT RUN: {} ({NEEDS_GPU})", cuda::NO_DRIVER_REASON);
    }
}

/// Opens one instance whose events go to the returned channel.
pub fn open_instance(config: &str) -> (NvlinkPlugin, Receiver<Event>) {
    let (tx, rx) = channel();
    let tx = Mutex::new(tx);
    let sink = Sink::new(sink_from_fn(move |e| {
        let _ = tx.lock().unwrap().send(e);
    }));
    let plugin = open_with_probe(config, sink, cuda::driver_library_present).unwrap_or_else(|e| panic!("open: {e}"));
    (plugin, rx)
}

/// Sender `a` and receiver `b` in this process; `a` knows `b` as [`B_PEER`].
pub struct Pair {
    pub a: NvlinkPlugin,
    pub a_events: Receiver<Event>,
    pub b: NvlinkPlugin,
    pub b_events: Receiver<Event>,
}

pub const B_PEER: PeerId = PeerId(2);

impl Pair {
    pub fn open(config: &str) -> Pair {
        let (a, a_events) = open_instance(config);
        let (b, b_events) = open_instance(config);
        a.connect(B_PEER, &b.local_endpoint()).expect("connect a -> b");
        b.connect(PeerId(1), &a.local_endpoint()).expect("connect b -> a");
        Pair { a, a_events, b, b_events }
    }
}

pub fn cuda_region(device: i32, addr: u64, len: u64) -> RegionDesc {
    RegionDesc { kind: MemoryKind::CUDA_DEVICE, device, addr, len, ..RegionDesc::default() }
}

/// The next event, within `secs` seconds.
pub fn next_event(rx: &Receiver<Event>, secs: u64) -> Event {
    rx.recv_timeout(Duration::from_secs(secs)).unwrap_or_else(|_| panic!("no event within {secs} s"))
}

/// Waits for the terminal event of `xfer` (other transfers' events are returned too).
pub fn wait_terminal(rx: &Receiver<Event>, xfer: XferId, secs: u64) -> Event {
    loop {
        let e = next_event(rx, secs);
        if e.xfer == xfer && e.is_terminal() {
            return e;
        }
    }
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn unhex(text: &str) -> Vec<u8> {
    (0..text.len()).step_by(2).map(|i| u8::from_str_radix(&text[i..i + 2], 16).expect("hex")).collect()
}

/// How long a two-process test waits for each tagged line of its child.
pub const CHILD_STEP_TIMEOUT_S: u64 = 45;

/// This test binary started again as the child half of two-process test `test` (`child_env` set), its
/// stdin to write commands to, and its `tag`ged output lines.
pub fn spawn_child(
    test: &str,
    child_env: &str,
    tag: &'static str,
) -> (std::process::Child, std::process::ChildStdin, ChildLines) {
    use std::process::{Command, Stdio};
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--ignored", "--nocapture", "--test-threads=1"])
        .env(child_env, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the child process");
    let to_child = child.stdin.take().unwrap();
    let lines = ChildLines::new(child.stdout.take().unwrap(), tag);
    (child, to_child, lines)
}

/// The tagged lines a two-process test's child prints on its stdout (`<TAG> <NAME> <value>`), read on
/// a thread so that every wait is bounded and names what it waited for.
pub struct ChildLines {
    lines: Receiver<String>,
    tag: &'static str,
    started: std::time::Instant,
}

impl ChildLines {
    pub fn new(stdout: std::process::ChildStdout, tag: &'static str) -> ChildLines {
        use std::io::BufRead;
        let (tx, lines) = std::sync::mpsc::channel::<String>();
        let reader = std::io::BufReader::new(stdout);
        std::thread::spawn(move || reader.lines().map_while(Result::ok).try_for_each(|l| tx.send(l)));
        ChildLines { lines, tag, started: std::time::Instant::now() }
    }

    /// The value of the next `<tag> <name> ` line. Found anywhere in a line: the child's test harness
    /// prints `test <name> ... ` without a line end before the test's own first line.
    pub fn value(&self, name: &str) -> String {
        let wanted = format!("{} {name} ", self.tag);
        loop {
            let line = match self.lines.recv_timeout(Duration::from_secs(CHILD_STEP_TIMEOUT_S)) {
                Ok(line) => line,
                Err(e) => panic!(
                    "child: no line within {CHILD_STEP_TIMEOUT_S} s waiting for {name} ({e}; {:?} in)",
                    self.started.elapsed()
                ),
            };
            if let Some(at) = line.find(&wanted) {
                eprintln!("parent: child's {name} after {:?}", self.started.elapsed());
                return line[at + wanted.len()..].trim().to_string();
            }
        }
    }

    /// `value(name)` decoded from hex.
    pub fn bytes(&self, name: &str) -> Vec<u8> {
        unhex(&self.value(name))
    }
}
