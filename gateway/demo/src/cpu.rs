//! The CPU time a process (a gateway, an engine) has used, read from `/proc`: the demo's table and
//! the bench's per-room CPU figures. Reads only.

/// CPU time (user + system) a process has used so far, from `/proc/<pid>/stat`; `None` when it is gone.
pub fn process_cpu(pid: i32) -> Option<std::time::Duration> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    cpu_of_stat_line(&text, clock_ticks_per_second())
}

/// utime + stime (fields 14 and 15) of a `/proc/<pid>/stat` line; the command name in parentheses
/// may hold spaces, so fields are counted after its closing parenthesis.
pub fn cpu_of_stat_line(line: &str, ticks_per_second: u64) -> Option<std::time::Duration> {
    let after_name = &line[line.rfind(')')? + 1..];
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    // after the name: state is field 3, so utime (14) and stime (15) are at 11 and 12 here.
    let ticks = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(std::time::Duration::from_secs_f64(ticks as f64 / ticks_per_second.max(1) as f64))
}

/// `/proc` counts CPU time in USER_HZ ticks, which Linux fixes at 100 on every architecture it
/// exports to user space (the kernel's own HZ may differ; `/proc` converts).
fn clock_ticks_per_second() -> u64 {
    100
}
