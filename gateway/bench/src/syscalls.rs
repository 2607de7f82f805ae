//! System calls of some processes over a span, counted by `perf stat` on the `raw_syscalls:sys_enter`
//! tracepoint (nearly free: a counter, no trace), when perf is installed and allowed to attach;
//! `None` otherwise. `/proc` has no such count. Measures only.

use std::process::{Child, Command, Stdio};

/// A running count; [`SyscallCount::stop`] ends it.
pub struct SyscallCount {
    child: Child,
}

/// How long `perf stat` is given to attach before the span it counts starts, in milliseconds.
pub const PERF_ATTACH_MS: u64 = 300;

impl SyscallCount {
    /// Start counting the system calls of every thread of `pids` (wait [`PERF_ATTACH_MS`] before
    /// the span begins).
    pub fn start(pids: &[i32]) -> Option<SyscallCount> {
        let perf = super::system::which("perf")?;
        let list = pids.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(",");
        let child = Command::new(perf)
            .args(["stat", "-x", ",", "-e", "raw_syscalls:sys_enter", "-p", &list])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .ok()?;
        Some(SyscallCount { child })
    }

    /// Stop and read the count (`None` when perf could not count).
    pub fn stop(self) -> Option<u64> {
        let pid = self.child.id().to_string();
        Command::new("kill").args(["-INT", &pid]).status().ok()?;
        let out = self.child.wait_with_output().ok()?;
        let text = String::from_utf8_lossy(&out.stderr);
        text.lines()
            .find(|l| l.contains("raw_syscalls:sys_enter"))
            .and_then(|l| l.split(',').next())
            .and_then(|v| v.trim().parse().ok())
    }
}
