//! The entries of the data-path matrix: which gateway plugin each bench name starts (`shm`, `quic`,
//! `ucx-sm`, `ucx-tcp`, `nvlink`), the library and plugin config its generated gateways load, and its
//! reference. Decides what can run here and says why not; never starts a gateway or measures.

use super::reference::{ReferenceKind, UcxTransport};
use super::system;
use kvgate_demo::gateways::PairSettings;
use std::path::{Path, PathBuf};

/// The cargo package and lib name of the loadable UCX plugin (`libkvgate_ucx.so`).
pub const UCX_SO_PACKAGE: &str = "kvgate-plugin-ucx-so";
pub const UCX_SO_LIB_NAME: &str = "kvgate_ucx";

/// The data-path gateways' `scheduler.min_bandwidth_bytes_per_s`: a room's transfer deadline is
/// `transfer_base_ms + bytes / this`, and up to `--inflight` rooms share the plugin, so the default
/// (100 MB/s per room) would fail slow cells (`transfer_timeout`) that only measure throughput.
pub const BENCH_MIN_BANDWIDTH_BYTES_PER_S: u64 = 10_000_000;

/// One matrix entry that can run: the gateways' settings and the reference to measure against.
#[derive(Clone, Debug)]
pub struct MatrixEntry {
    /// The bench name (`ucx-sm`), shown in every table.
    pub name: String,
    pub settings: PairSettings,
    /// `None` with the reason when the reference cannot run here (the plugin is still measured).
    pub reference: Result<ReferenceKind, String>,
}

/// `ucx` stands for both UCX entries; every other name stays as it is. Duplicates are dropped.
pub fn expand_names(requested: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for name in requested {
        let names: Vec<String> = if name == "ucx" {
            UcxTransport::ALL.iter().map(|t| t.bench_name().to_string()).collect()
        } else {
            vec![name.clone()]
        };
        for n in names {
            if !out.contains(&n) {
                out.push(n);
            }
        }
    }
    out
}

/// The QUIC plugin's loopback settings: the demo's gateway pairs use them too, so they live there.
pub use kvgate_demo::gateways::QUIC_LOOPBACK_CONFIG;

/// How many threads the shm plugin of `entry` copies with (its `workers`, from its plugin config or
/// the plugin's default): the thread count of the machine's copy limit it is measured against.
pub fn copy_threads(entry: &MatrixEntry) -> usize {
    kvgate_plugin_shm::ShmConfig::parse(&entry.settings.plugin_config)
        .map(|c| c.workers)
        .unwrap_or(kvgate_plugin_shm::config::DEFAULT_WORKERS) as usize
}

/// Where the UCX plugin library is: `--ucx-library`, else next to the running `kvgate` (where cargo
/// builds it: `cargo build --release -p kvgate-plugin-ucx-so`). The error says how to get it.
pub fn ucx_library(explicit: Option<&Path>) -> Result<PathBuf, String> {
    match explicit {
        Some(path) if path.is_file() => Ok(path.to_path_buf()),
        Some(path) => Err(format!("--ucx-library {} is not a file", path.display())),
        None => kvgate_host::artifacts::built_cdylib_path(UCX_SO_PACKAGE, UCX_SO_LIB_NAME),
    }
}

/// The entry for `name`, or why it cannot run on this machine (a skip, never a pass).
pub fn entry(name: &str, ucx_library: &Result<PathBuf, String>) -> Result<MatrixEntry, String> {
    let env =
        vec![("KVGATE__SCHEDULER__MIN_BANDWIDTH_BYTES_PER_S".to_string(), BENCH_MIN_BANDWIDTH_BYTES_PER_S.to_string())];
    let base = |plugin: &str| PairSettings {
        plugin: plugin.to_string(),
        env_prefill: env.clone(),
        env_decode: env.clone(),
        ..PairSettings::default()
    };
    match name {
        "shm" => Ok(MatrixEntry { name: name.into(), settings: base("shm"), reference: Ok(ReferenceKind::Memcpy) }),
        "quic" => Ok(MatrixEntry {
            name: name.into(),
            settings: PairSettings { plugin_config: QUIC_LOOPBACK_CONFIG.to_string(), ..base("quic") },
            reference: Ok(ReferenceKind::TcpLoopback),
        }),
        "ucx-sm" | "ucx-tcp" => {
            let transport = if name == "ucx-sm" { UcxTransport::SharedMemory } else { UcxTransport::Tcp };
            let library =
                ucx_library.clone().map_err(|why| format!("the UCX plugin library is not available: {why}"))?;
            let settings = PairSettings {
                plugin_libraries: vec![library],
                plugin_config: transport.plugin_config().to_string(),
                ..base("ucx")
            };
            let reference = match system::which("ucx_perftest") {
                Some(_) => Ok(ReferenceKind::UcxPerftest(transport)),
                None => Err("ucx_perftest (Debian ucx-utils) is not installed: no reference, so no ratio".to_string()),
            };
            Ok(MatrixEntry { name: name.into(), settings, reference })
        }
        "nvlink" => Err(if system::has_nvidia_gpu() {
            "the NVLink plugin's gateway wiring and its raw cuMemcpyDtoD reference are not in the bench yet".into()
        } else {
            "no NVIDIA GPU on this machine (no /dev/nvidiactl): neither the NVLink plugin nor its raw device-copy reference can run".into()
        }),
        other => Err(format!("unknown plugin {other:?} (known: shm, quic, ucx-sm, ucx-tcp, ucx = both, nvlink)")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ucx_expands_to_both_transports_once() {
        let names = expand_names(&["shm".into(), "ucx".into(), "ucx-tcp".into()]);
        assert_eq!(names, vec!["shm", "ucx-sm", "ucx-tcp"]);
    }

    #[test]
    fn ucx_entries_load_the_library_with_their_transport() {
        let lib = Ok(PathBuf::from("/x/libkvgate_ucx.so"));
        let sm = entry("ucx-sm", &lib).expect("ucx-sm");
        assert_eq!(sm.settings.plugin, "ucx");
        assert_eq!(sm.settings.plugin_libraries, vec![PathBuf::from("/x/libkvgate_ucx.so")]);
        assert!(sm.settings.plugin_config.contains("posix,sysv,cma"));
        let tcp = entry("ucx-tcp", &lib).expect("ucx-tcp");
        assert!(tcp.settings.plugin_config.contains("devices = \"lo\""));
        let bandwidth =
            ("KVGATE__SCHEDULER__MIN_BANDWIDTH_BYTES_PER_S".to_string(), BENCH_MIN_BANDWIDTH_BYTES_PER_S.to_string());
        assert!(tcp.settings.env_prefill.contains(&bandwidth) && tcp.settings.env_decode.contains(&bandwidth));
        if let Ok(r) = tcp.reference {
            assert_eq!(r, ReferenceKind::UcxPerftest(UcxTransport::Tcp));
        }
    }

    #[test]
    fn quic_runs_with_the_loopback_tuning_and_the_plugin_accepts_it() {
        let quic = entry("quic", &Ok(PathBuf::new())).expect("quic");
        assert_eq!(quic.settings.plugin_config, QUIC_LOOPBACK_CONFIG);
        let parsed = kvgate_plugin_quic::QuicConfig::parse(QUIC_LOOPBACK_CONFIG)
            .expect("the QUIC plugin accepts the bench's config");
        assert_eq!(parsed.initial_mtu_bytes, 65507);
        assert_eq!(parsed.malloc_trim_threshold_bytes, 64 << 20, "the README's loopback block, whole");
    }

    #[test]
    fn a_missing_ucx_library_is_a_skip_with_its_reason() {
        let why = entry("ucx-sm", &Err("libkvgate_ucx.so not found in /t".into())).unwrap_err();
        assert!(why.contains("libkvgate_ucx.so not found"), "{why}");
        let why = ucx_library(Some(Path::new("/nonexistent/libkvgate_ucx.so"))).unwrap_err();
        assert!(why.contains("not a file"), "{why}");
        assert!(entry("bogus", &Ok(PathBuf::new())).unwrap_err().contains("unknown plugin"));
    }
}
