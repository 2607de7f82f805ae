//! Facts about this machine and this invocation for the report: CPUs, memory, GPU presence, kernel,
//! the command line, the UTC time, where a tool is installed. Reads only; never changes anything.

use super::results::Machine;
use std::path::{Path, PathBuf};

pub fn has_nvidia_gpu() -> bool {
    Path::new("/dev/nvidiactl").exists()
}

/// The first `name` on `PATH`.
pub fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| std::env::split_paths(&paths).map(|d| d.join(name)).find(|p| p.is_file()))
}

/// The 1, 5 and 15 minute load averages (`0.52 0.70 1.10`), or empty when unreadable.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|t| t.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

pub fn machine() -> Machine {
    let memory_kib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<f64>().ok())
        })
        .unwrap_or(0.0);
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").ok();
    Machine {
        cpus: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        memory_gib: memory_kib / (1024.0 * 1024.0),
        gpu: if has_nvidia_gpu() { "nvidia (present, not used by this bench)".into() } else { "none".into() },
        kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease").map(|s| s.trim().to_string()).unwrap_or_default(),
        cpu_model: cpuinfo.as_deref().and_then(cpu_model_of).unwrap_or_default(),
        cpu_features: cpuinfo.as_deref().map(cpu_features_of).unwrap_or_default(),
        last_level_cache_kib: last_level_cache_kib(Path::new("/sys/devices/system/cpu/cpu0/cache")),
        load_average_start: String::new(),
        load_average_end: load_average(),
    }
}

/// The first `model name` of a `/proc/cpuinfo` text.
pub fn cpu_model_of(cpuinfo: &str) -> Option<String> {
    cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
}

/// The instruction-set extensions the figures depend on, by their `/proc/cpuinfo` flag and the name
/// the report gives them: AES-GCM (QUIC's packet protection) runs on AES-NI, on VAES with wide
/// registers, and fastest with AVX-512; copies use AVX2 or AVX-512.
const FEATURES: &[(&str, &str)] = &[("aes", "AES-NI"), ("vaes", "VAES"), ("avx2", "AVX2"), ("avx512f", "AVX-512")];

/// `family 25 model 17; AES-NI, VAES, AVX2, AVX-512` from the first CPU of a `/proc/cpuinfo`
/// text; `no AVX-512` is said outright, since it is the one that moves QUIC's figures. Empty when
/// the text names neither family nor flags.
pub fn cpu_features_of(cpuinfo: &str) -> String {
    let first_cpu = cpuinfo.split("\n\n").next().unwrap_or("");
    let field = |name: &str| {
        first_cpu.lines().find_map(|l| {
            let (key, value) = l.split_once(':')?;
            (key.trim() == name).then(|| value.trim().to_string())
        })
    };
    let mut parts = Vec::new();
    if let (Some(family), Some(model)) = (field("cpu family"), field("model")) {
        parts.push(format!("family {family} model {model}"));
    }
    if let Some(flags) = field("flags") {
        let flags: Vec<&str> = flags.split_whitespace().collect();
        let mut present: Vec<&str> =
            FEATURES.iter().filter(|(flag, _)| flags.contains(flag)).map(|(_, name)| *name).collect();
        if !flags.contains(&"avx512f") {
            present.push("no AVX-512");
        }
        parts.push(present.join(", "));
    }
    parts.join("; ")
}

/// The size of the highest-level cache listed under `dir` (`/sys/devices/system/cpu/cpu0/cache`:
/// `index*/level` and `index*/size`, sizes such as `32768K`), in KiB; 0 when none can be read.
pub fn last_level_cache_kib(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    let mut best = (0u64, 0u64);
    for entry in entries.flatten() {
        let read = |name: &str| std::fs::read_to_string(entry.path().join(name)).ok();
        let level = read("level").and_then(|t| t.trim().parse::<u64>().ok());
        let size = read("size").and_then(|t| cache_size_kib(t.trim()));
        if let (Some(level), Some(size)) = (level, size) {
            best = best.max((level, size));
        }
    }
    best.1
}

/// `32768K` (sysfs' form), `32M` or a plain byte count, in KiB.
fn cache_size_kib(text: &str) -> Option<u64> {
    if let Some(k) = text.strip_suffix('K') {
        k.parse().ok()
    } else if let Some(m) = text.strip_suffix('M') {
        m.parse::<u64>().ok().map(|m| m * 1024)
    } else {
        text.parse::<u64>().ok().map(|b| b / 1024)
    }
}

pub use kvgate_demo::cpu::{cpu_of_stat_line, process_cpu};

/// The command line with the program shown as `kvgate`.
pub fn command_line() -> String {
    let mut parts = vec!["kvgate".to_string()];
    parts.extend(std::env::args().skip(1));
    parts.join(" ")
}

/// `YYYY-MM-DD HH:MM:SS` in UTC.
pub fn utc_now() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    format_utc(secs)
}

/// Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
pub fn format_utc(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// Context switches (voluntary and not) a process's live threads have made so far, summed over
/// `/proc/<pid>/task/*/status`; 0 when unreadable. (`/proc` has no count of system calls: its `syscr`
/// and `syscw` miss socket `recv` / `send`, which is what the engine paths make.)
pub fn process_context_switches(pid: i32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return 0 };
    let field = |text: &str, name: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim_start_matches(':').trim().parse().ok())
            .unwrap_or(0)
    };
    let mut switches = 0;
    for task in tasks.flatten() {
        if let Ok(status) = std::fs::read_to_string(task.path().join("status")) {
            switches += field(&status, "voluntary_ctxt_switches") + field(&status, "nonvoluntary_ctxt_switches");
        }
    }
    switches
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_time_is_read_after_the_command_name() {
        let line = "42 (tokio rt) S 1 42 42 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 8 0 100 0 0";
        assert_eq!(cpu_of_stat_line(line, 100), Some(std::time::Duration::from_secs(3)));
        assert!(process_cpu(std::process::id() as i32).is_some(), "this process has a stat line");
        assert_eq!(load_average().split(' ').count(), 3, "three load averages");
        assert_eq!(cpu_of_stat_line("garbage", 100), None);
    }

    #[test]
    fn the_last_level_cache_is_the_highest_level_listed() {
        let dir = std::env::temp_dir().join(format!("kvgate-cache-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for (index, level, size) in
            [("index0", "1", "32K"), ("index2", "2", "512K"), ("index3", "3", "32768K"), ("index1", "1", "32K")]
        {
            std::fs::create_dir_all(dir.join(index)).unwrap();
            std::fs::write(dir.join(index).join("level"), format!("{level}\n")).unwrap();
            std::fs::write(dir.join(index).join("size"), format!("{size}\n")).unwrap();
        }
        assert_eq!(last_level_cache_kib(&dir), 32 * 1024);
        // A level without a readable size is skipped, not taken as 0 KiB.
        std::fs::create_dir_all(dir.join("index4")).unwrap();
        std::fs::write(dir.join("index4").join("level"), "4\n").unwrap();
        assert_eq!(last_level_cache_kib(&dir), 32 * 1024);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(last_level_cache_kib(&dir), 0, "no directory, no figure");
        assert_eq!(cache_size_kib("8M"), Some(8192));
        assert_eq!(cache_size_kib("1048576"), Some(1024));
        assert_eq!(cache_size_kib("big"), None);
        assert_eq!(cpu_model_of("processor\t: 0\nmodel name\t: AMD EPYC\n").as_deref(), Some("AMD EPYC"));
        assert_eq!(cpu_model_of("processor\t: 0\n"), None);
    }

    #[test]
    fn cpu_features_name_family_model_and_the_extensions_that_matter() {
        let zen4 = "processor\t: 0\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 aes avx2 vaes avx512f avx512bw\n\n\
                    processor\t: 1\ncpu family\t: 99\nmodel\t\t: 1\nflags\t\t: fpu\n";
        assert_eq!(cpu_features_of(zen4), "family 25 model 17; AES-NI, VAES, AVX2, AVX-512");
        let zen3 = "cpu family\t: 25\nmodel\t\t: 1\nflags\t\t: aes avx2 vaes vpclmulqdq\n";
        assert_eq!(cpu_features_of(zen3), "family 25 model 1; AES-NI, VAES, AVX2, no AVX-512");
        // `model name` must not be read as `model`.
        assert_eq!(cpu_features_of("model name\t: X\ncpu family\t: 6\nmodel\t\t: 143\n"), "family 6 model 143");
        assert_eq!(cpu_features_of("processor\t: 0\n"), "");
    }

    #[test]
    fn utc_dates_are_civil() {
        assert_eq!(format_utc(0), "1970-01-01 00:00:00");
        assert_eq!(format_utc(951_782_400), "2000-02-29 00:00:00");
        assert_eq!(format_utc(1_798_761_599), "2026-12-31 23:59:59");
    }
}
