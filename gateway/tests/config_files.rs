//! Every example in configs/ loads, and its plugin tables parse with the plugin's own parser;
//! `kvgate config check|default` work from the command line, including `KVGATE__SECTION__KEY`
//! overrides and the warning for single-underscore variables.

use std::path::{Path, PathBuf};
use std::process::Command;

fn configs_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs")
}

fn toml_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            toml_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "toml") {
            out.push(path);
        }
    }
}

#[test]
fn every_example_config_loads_and_names_its_peer_consistently() {
    let mut files = Vec::new();
    toml_files(&configs_dir(), &mut files);
    assert!(files.len() >= 8, "expected four deployments of two gateways, found {files:?}");
    let mut names = std::collections::BTreeMap::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        let config = kvgate::config::load_config_from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        assert!(
            text.lines().filter(|l| l.trim_start().starts_with('#')).count() >= 3,
            "{} needs comments",
            file.display()
        );
        for (plugin, table) in &config.plugins.config {
            let table = toml::to_string(table).unwrap();
            let parsed = match plugin.as_str() {
                "shm" => kvgate_plugin_shm::ShmConfig::parse(&table).map(drop),
                "quic" => kvgate_plugin_quic::QuicConfig::parse(&table).map(drop),
                _ => Ok(()),
            };
            parsed.unwrap_or_else(|e| panic!("{}: [plugins.config.{plugin}]: {e:?}", file.display()));
        }
        names.insert(file.clone(), config);
    }
    // Within a deployment, each gateway lists the other by its name.
    for (file, config) in &names {
        for peer in &config.peers {
            let sibling = names.iter().find(|(f, c)| f.parent() == file.parent() && c.gateway.name == peer.name);
            let (_, other) = sibling
                .unwrap_or_else(|| panic!("{}: peer {} is no gateway of this deployment", file.display(), peer.name));
            assert!(
                other.peers.iter().any(|p| p.name == config.gateway.name),
                "{}: not listed back by {}",
                file.display(),
                peer.name
            );
            assert_eq!(peer.address, other.peer_link.listen, "{}: address of {}", file.display(), peer.name);
        }
    }
}

/// The `kvgate` binary (package `kvgate`, gateway/cli), built or found up to date first.
fn kvgate_binary() -> PathBuf {
    kvgate_host::artifacts::built_or_build_binary("kvgate", "kvgate", Path::new(env!("CARGO_MANIFEST_DIR")))
        .unwrap_or_else(|e| panic!("{e}"))
}

/// A peer-link key for the shipped configs (they name `peer.key` beside themselves, which a clone
/// does not have): made once per test process, handed over as `KVGATE__PEER_LINK__PSK_FILE`.
fn test_key() -> &'static Path {
    static KEY: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    KEY.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("kvgate-config-files-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let key = dir.join("peer.key");
        let out = Command::new(kvgate_binary()).args(["keygen", "psk"]).arg(&key).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        key
    })
}

fn kvgate() -> Command {
    let mut c = Command::new(kvgate_binary());
    c.env_remove("RUST_LOG");
    c.env("KVGATE__PEER_LINK__PSK_FILE", test_key());
    c
}

#[test]
fn config_check_accepts_an_example_and_reports_a_typo_with_exit_code_2() {
    let good = configs_dir().join("shm-one-host/prefill.toml");
    let out = kvgate().args(["config", "check"]).arg(&good).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[peer_link]\nheartbeat_interval_ms = 5\nheartbeat_mises = 3\n").unwrap();
    let out = kvgate().args(["config", "check"]).arg(&bad).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("heartbeat_mises"), "{stderr}");
}

#[test]
fn environment_overrides_the_file_and_is_validated() {
    let good = configs_dir().join("shm-one-host/prefill.toml");
    let out = kvgate()
        .args(["config", "check"])
        .arg(&good)
        .env("KVGATE__PEER_LINK__HEARTBEAT_INTERVAL_MS", "5")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "the override must reach validation");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("peer_link.heartbeat_interval_ms = 5"), "{stderr}");
    let out = kvgate()
        .args(["config", "check"])
        .arg(&good)
        .env("KVGATE__PEER_LINK__HEARTBEAT_INTERVAL_MS", "10")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = kvgate()
        .args(["config", "check"])
        .arg(&good)
        .env("KVGATE_PEER_LINK_HEARTBEAT_INTERVAL_MS", "5")
        .output()
        .unwrap();
    assert!(out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("KVGATE_PEER_LINK_HEARTBEAT_INTERVAL_MS is ignored"), "{stderr}");
}

#[test]
fn list_keys_are_overridden_by_comma_separated_environment_values() {
    let good = configs_dir().join("shm-one-host/prefill.toml");
    let out =
        kvgate().args(["config", "check"]).arg(&good).env("KVGATE__PLUGINS__PREFERENCE", "quic,shm").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains(r#"plugins ["quic", "shm"]"#), "{stdout}");
    // One value is a list of one; each element is validated on its own, by its index.
    let out =
        kvgate().args(["config", "check"]).arg(&good).env("KVGATE__PLUGINS__PREFERENCE", "quic").output().unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains(r#"plugins ["quic"]"#));
    let out = kvgate()
        .args(["config", "check"])
        .arg(&good)
        .env("KVGATE__DISCOVERY__ETCD_ENDPOINTS", "http://10.0.0.5:2379,10.0.0.6:2379")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("discovery.etcd_endpoints[1]") && !stderr.contains("discovery.etcd_endpoints[0]"),
        "{stderr}"
    );
    // A key that is not a list keeps its commas.
    let out = kvgate().args(["config", "check"]).arg(&good).env("KVGATE__GATEWAY__NAME", "a,b").output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("sequence"), "{stderr}");
}

#[test]
fn config_default_prints_a_loadable_document() {
    let out = kvgate().args(["config", "default"]).output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("heartbeat_interval_ms"));
    kvgate::config::load_config_from_str(&text).unwrap();
}

#[test]
fn a_bad_environment_override_is_refused_naming_the_variable() {
    let good = configs_dir().join("shm-one-host/prefill.toml");
    for (var, value, expected) in [
        ("KVGATE__PEER_LINK__HEARTBEAT_MISSES", "1.9", "whole number"),
        ("KVGATE__PEER_LINK__HEARTBEAT_MISSES", "18446744073709551615", "up to 9223372036854775807"),
        ("KVGATE__PLUGINS__PREFERENCE", "", "non-empty items"),
        ("KVGATE__PEERS__0__NAME", "decode", "[[peers]]"),
    ] {
        let out = kvgate().args(["config", "check"]).arg(&good).env(var, value).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{var}={value:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(var) && stderr.contains(expected), "{var}={value:?}: {stderr}");
    }
}
