//! The controller's handle on one peer process: spawn it, send requests and wait for their replies
//! with a bound, collect its timestamped plugin events, freeze, resume and kill it. Never waits without
//! a bound: a peer that does not answer is reported, not waited on for ever.

use crate::peer::protocol::*;
use crate::peer::region::remove_region_files_of;
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// How to start a peer process: this executable (or `KVGATE_CONFORMANCE_PEER_EXE`) in peer mode.
#[derive(Clone, Debug)]
pub struct PeerCommand {
    pub exe: PathBuf,
    pub args: Vec<String>,
}

impl PeerCommand {
    /// The running executable with its own arguments plus `--peer-mode`, so that both
    /// `kvgate conformance ..` and `kvgate-conformance ..` re-enter the same `run`.
    pub fn from_current_process() -> Result<PeerCommand, String> {
        if let Ok(exe) = std::env::var("KVGATE_CONFORMANCE_PEER_EXE") {
            return Ok(PeerCommand { exe: exe.into(), args: vec!["--peer-mode".into()] });
        }
        let exe = std::env::current_exe().map_err(|e| format!("cannot find the running executable: {e}"))?;
        let mut args: Vec<String> = std::env::args().skip(1).collect();
        args.push("--peer-mode".into());
        Ok(PeerCommand { exe, args })
    }
}

/// Why a request got no reply.
#[derive(Debug, Clone)]
pub enum NoReply {
    /// No reply within the bound; the peer may be blocked inside a plugin call.
    Timeout { waited_ms: u64 },
    /// The peer process exited (crashed, aborted, killed).
    Died { status: String, stderr_tail: String },
}

impl std::fmt::Display for NoReply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NoReply::Timeout { waited_ms } => write!(f, "no reply within {waited_ms} ms (call blocked?)"),
            NoReply::Died { status, stderr_tail } => write!(f, "peer process died ({status}); stderr: {stderr_tail}"),
        }
    }
}

#[derive(Default)]
struct Inbox {
    replies: HashMap<u64, Reply>,
    events: Vec<WireEvent>,
    closed: bool,
}

struct Shared {
    inbox: Mutex<Inbox>,
    changed: Condvar,
}

pub struct PeerProcess {
    pub role: String,
    child: Child,
    pid: u32,
    stdin: ChildStdin,
    shared: Arc<Shared>,
    next_id: AtomicU64,
    stderr_path: PathBuf,
    pub frozen: bool,
    pub dead: bool,
    /// Whether a report of this peer's death has been made (by a call that got no reply).
    death_reported: bool,
}

static SPAWNED: AtomicU64 = AtomicU64::new(0);

/// Set to `1` to keep every peer's stderr log after the peer is dropped (for diagnosing a failure).
pub const KEEP_LOGS_ENV: &str = "KVGATE_CONFORMANCE_KEEP_LOGS";
/// How many of a peer's last stderr lines a failure report quotes.
pub const STDERR_TAIL_LINES: usize = 4;

fn keep_logs() -> bool {
    std::env::var(KEEP_LOGS_ENV).is_ok_and(|v| v == "1")
}

/// The last `lines` lines of a log file, joined with " | " (empty when unreadable or empty).
fn tail_of(path: &std::path::Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let tail: Vec<&str> = text.lines().rev().take(lines).collect();
    tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
}

impl PeerProcess {
    pub fn spawn(cmd: &PeerCommand, role: &str) -> Result<PeerProcess, String> {
        let n = SPAWNED.fetch_add(1, Ordering::Relaxed);
        let stderr_path =
            std::env::temp_dir().join(format!("kvgate-conformance-{}-{role}-{n}.log", std::process::id()));
        let stderr =
            std::fs::File::create(&stderr_path).map_err(|e| format!("create {}: {e}", stderr_path.display()))?;
        let mut child = Command::new(&cmd.exe)
            .args(&cmd.args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(stderr))
            .spawn()
            .map_err(|e| format!("cannot start peer {}: {e}", cmd.exe.display()))?;
        let pid = child.id();
        let stdin = child.stdin.take().expect("piped stdin");
        let stdout = child.stdout.take().expect("piped stdout");
        let shared = Arc::new(Shared { inbox: Mutex::new(Inbox::default()), changed: Condvar::new() });
        let reader_shared = Arc::clone(&shared);
        std::thread::Builder::new()
            .name(format!("peer-{role}-reader"))
            .spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    let Ok(parsed) = serde_json::from_str::<Line>(&line) else { continue };
                    let mut inbox = reader_shared.inbox.lock().unwrap();
                    match parsed {
                        Line::Reply(r) => {
                            inbox.replies.insert(r.id, r);
                        }
                        Line::Event(e) => inbox.events.push(e),
                    }
                    drop(inbox);
                    reader_shared.changed.notify_all();
                }
                reader_shared.inbox.lock().unwrap().closed = true;
                reader_shared.changed.notify_all();
            })
            .map_err(|e| format!("reader thread: {e}"))?;
        Ok(PeerProcess {
            role: role.to_string(),
            child,
            pid,
            stdin,
            shared,
            next_id: AtomicU64::new(1),
            stderr_path,
            frozen: false,
            dead: false,
            death_reported: false,
        })
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Send a request without waiting; returns its id.
    pub fn send(&mut self, op: &Op) -> u64 {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut line = serde_json::to_vec(&Request { id, op: op.clone() }).expect("serialisable request");
        line.push(b'\n');
        // A dead peer shows up as a closed inbox when the reply is awaited.
        let _ = self.stdin.write_all(&line).and_then(|_| self.stdin.flush());
        id
    }

    pub fn wait_reply(&mut self, id: u64, bound: Duration) -> Result<Reply, NoReply> {
        let deadline = Instant::now() + bound;
        let mut inbox = self.shared.inbox.lock().unwrap();
        loop {
            if let Some(r) = inbox.replies.remove(&id) {
                return Ok(r);
            }
            if inbox.closed {
                drop(inbox);
                return Err(self.death());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(NoReply::Timeout { waited_ms: bound.as_millis() as u64 });
            }
            inbox = self.shared.changed.wait_timeout(inbox, deadline - now).unwrap().0;
        }
    }

    pub fn call(&mut self, op: &Op, bound: Duration) -> Result<Reply, NoReply> {
        let id = self.send(op);
        self.wait_reply(id, bound)
    }

    fn death(&mut self) -> NoReply {
        self.death_reported = true;
        let status = match self.child.try_wait() {
            Ok(Some(s)) => format!("{s}"),
            _ => {
                std::thread::sleep(Duration::from_millis(50));
                match self.child.try_wait() {
                    Ok(Some(s)) => format!("{s}"),
                    _ => "stdout closed".to_string(),
                }
            }
        };
        NoReply::Died { status, stderr_tail: self.stderr_tail(STDERR_TAIL_LINES) }
    }

    /// The last `lines` lines the peer wrote to its stderr so far (for a failure report).
    pub fn stderr_tail(&self, lines: usize) -> String {
        tail_of(&self.stderr_path, lines)
    }

    /// Where the peer's stderr goes (kept after the peer is dropped when `KVGATE_CONFORMANCE_KEEP_LOGS=1`).
    pub fn stderr_path(&self) -> &std::path::Path {
        &self.stderr_path
    }

    /// A copy of every event received so far.
    pub fn events(&self) -> Vec<WireEvent> {
        self.shared.inbox.lock().unwrap().events.clone()
    }

    pub fn event_count(&self) -> usize {
        self.shared.inbox.lock().unwrap().events.len()
    }

    /// Wait until `pred` holds over the events, or `bound` passes. Returns whether it held.
    pub fn wait_events(&self, bound: Duration, mut pred: impl FnMut(&[WireEvent]) -> bool) -> bool {
        let deadline = Instant::now() + bound;
        let mut inbox = self.shared.inbox.lock().unwrap();
        loop {
            if pred(&inbox.events) {
                return true;
            }
            let now = Instant::now();
            if now >= deadline || inbox.closed {
                return pred(&inbox.events);
            }
            inbox = self.shared.changed.wait_timeout(inbox, (deadline - now).min(Duration::from_millis(20))).unwrap().0;
        }
    }

    fn signal(&self, sig: libc::c_int) {
        // SAFETY: plain kill(2) on our own child's pid.
        unsafe { libc::kill(self.pid as libc::pid_t, sig) };
    }

    /// Stop the peer (SIGSTOP) and return once every one of its threads is stopped. SIGSTOP is
    /// delivered asynchronously: on a loaded host a peer can run on after kill(2) returns, and a
    /// clause that acts on "the receiver is frozen" would then test nothing. A peer not seen
    /// stopped within `FREEZE_CONFIRM_BOUND_MS` (dead, or stuck in the kernel) is an error, which
    /// the clause reports as a failure rather than judging a plugin on a peer that was not frozen.
    pub fn freeze(&mut self) -> Result<(), String> {
        self.signal(libc::SIGSTOP);
        self.frozen = true;
        let start = Instant::now();
        loop {
            let states = thread_states(self.pid);
            if all_stopped(&states) {
                return Ok(());
            }
            if start.elapsed() >= Duration::from_millis(FREEZE_CONFIRM_BOUND_MS) {
                let seen: String = states.iter().collect();
                return Err(format!(
                    "{} peer (pid {}) not seen stopped {FREEZE_CONFIRM_BOUND_MS} ms after SIGSTOP (thread states {:?})",
                    self.role,
                    self.pid,
                    if seen.is_empty() { "none: process gone" } else { seen.as_str() }
                ));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    pub fn resume(&mut self) {
        self.signal(libc::SIGCONT);
        self.frozen = false;
    }

    /// The peer's death, if it exited without the harness asking (not killed, not closed) and no
    /// call has reported it yet: a peer that crashes between calls is not lost.
    pub fn unreported_death(&mut self) -> Option<NoReply> {
        if self.dead || self.death_reported {
            return None;
        }
        match self.child.try_wait() {
            Ok(Some(_)) => Some(self.death()),
            _ => None,
        }
    }

    /// Whether the process has exited (killed by the harness, or on its own); reports nothing.
    pub fn exited(&mut self) -> bool {
        self.dead || matches!(self.child.try_wait(), Ok(Some(_)))
    }

    pub fn kill(&mut self) {
        self.signal(libc::SIGKILL);
        let _ = self.child.wait();
        self.dead = true;
        remove_region_files_of(self.pid);
    }

    /// Ask the peer to exit; kill it if it does not within `bound`.
    pub fn close(&mut self, bound: Duration) {
        if self.dead {
            return;
        }
        if self.frozen {
            self.resume();
        }
        let id = self.send(&Op::Exit);
        if self.wait_reply(id, bound).is_err() {
            self.kill();
            return;
        }
        let deadline = Instant::now() + bound;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                self.dead = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        if !self.dead {
            self.kill();
        }
        remove_region_files_of(self.pid);
    }
}

impl Drop for PeerProcess {
    fn drop(&mut self) {
        if !self.dead {
            self.kill();
        }
        if keep_logs() {
            eprintln!(
                "kvgate-conformance: {} peer (pid {}) stderr kept at {}",
                self.role,
                self.pid,
                self.stderr_path.display()
            );
        } else {
            let _ = std::fs::remove_file(&self.stderr_path);
        }
    }
}

/// How long `freeze` waits to see every thread of the peer stopped after SIGSTOP.
pub const FREEZE_CONFIRM_BOUND_MS: u64 = 1_000;

/// The state letter of every thread of `pid` ('R', 'S', 'T' stopped, 'Z' dead, ...), read from
/// `/proc/PID/task/TID/stat`; empty when the process is gone or unreadable.
fn thread_states(pid: u32) -> Vec<char> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
    let mut states = Vec::new();
    for task in tasks.flatten() {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else { continue };
        // "TID (COMM) STATE ...": COMM may hold spaces and parentheses, so read after the last ')'.
        if let Some(state) = stat.rsplit_once(')').and_then(|(_, rest)| rest.trim_start().chars().next()) {
            states.push(state);
        }
    }
    states
}

/// Whether `states` (of one process's threads) says the process is stopped ('t': stopped by a tracer).
fn all_stopped(states: &[char]) -> bool {
    !states.is_empty() && states.iter().all(|s| matches!(s, 'T' | 't'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_of_quotes_the_last_lines_in_order() {
        let path = std::env::temp_dir().join(format!("kvgate-conformance-tail-test-{}.log", std::process::id()));
        std::fs::write(&path, "one\ntwo\nthree\nfour\nfive\n").unwrap();
        assert_eq!(tail_of(&path, STDERR_TAIL_LINES), "two | three | four | five");
        assert_eq!(tail_of(&path, 5), "one | two | three | four | five");
        assert_eq!(tail_of(&path, 6), "one | two | three | four | five");
        std::fs::remove_file(&path).unwrap();
        assert_eq!(tail_of(&path, STDERR_TAIL_LINES), "", "an unreadable log quotes nothing");
    }

    #[test]
    fn a_running_process_is_not_stopped_and_a_sigstopped_one_is() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id();
        assert!(!all_stopped(&thread_states(pid)), "a sleeping process is not stopped");
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGSTOP) };
        let start = Instant::now();
        while !all_stopped(&thread_states(pid)) {
            assert!(start.elapsed() < Duration::from_secs(5), "SIGSTOP'd child never seen stopped");
            std::thread::sleep(Duration::from_millis(1));
        }
        // SAFETY: kill(2) on our own child's pid; no memory is involved.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGCONT) };
        let start = Instant::now();
        while all_stopped(&thread_states(pid)) {
            assert!(start.elapsed() < Duration::from_secs(5), "SIGCONT'd child still seen stopped");
            std::thread::sleep(Duration::from_millis(1));
        }
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!all_stopped(&thread_states(pid)), "a reaped process is not stopped");
    }

    /// At and past `FREEZE_CONFIRM_BOUND_MS`: a live peer is frozen well within it; a dead one is
    /// still not stopped when it runs out, and the error says so. Its death is reported once.
    #[test]
    fn freeze_confirms_a_live_peer_and_refuses_a_dead_one_and_a_death_between_calls_is_reported_once() {
        let cmd = PeerCommand { exe: "sleep".into(), args: vec!["30".into()] };
        let mut peer = PeerProcess::spawn(&cmd, "receiver").unwrap();
        assert!(peer.unreported_death().is_none(), "a running peer has not died");
        peer.freeze().unwrap();
        assert!(all_stopped(&thread_states(peer.pid())));
        peer.resume();
        // Dies unbidden: killed behind the harness's back, not reaped (a zombie, state 'Z').
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(peer.pid() as libc::pid_t, libc::SIGKILL) };
        let asked = Instant::now();
        let err = peer.freeze().unwrap_err();
        assert!(asked.elapsed() >= Duration::from_millis(FREEZE_CONFIRM_BOUND_MS), "gave up early: {err}");
        assert!(err.contains("receiver peer") && err.contains("not seen stopped") && err.contains('Z'), "{err}");
        let death = peer.unreported_death().expect("an unbidden exit is reported");
        assert!(death.to_string().contains("signal: 9"), "{death}");
        assert!(peer.unreported_death().is_none(), "and reported once only");
    }
}
