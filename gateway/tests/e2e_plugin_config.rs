//! Plugin sections are checked with each plugin's own parser: `kvgate config check` refuses a bad
//! value, a misspelt key, a preferred plugin nobody has and a section naming no plugin; `kvgate
//! serve` refuses to start rather than run without a plugin whose config is wrong.

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

fn run(args: &[&str], config: &Path) -> (i32, String) {
    let mut child = Command::new(binary())
        .args(args)
        .arg(config)
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // `serve` on a valid config would run for ever: give it a bounded time to refuse.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            child.kill().unwrap();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)),
    )
}

/// A gateway config that is valid apart from `plugins` (no peers, loopback, its own socket folder).
fn config(dir: &Path, name: &str, plugins: &str) -> PathBuf {
    let socket = dir.join(format!("{name}-sock")).join("engine.sock");
    let text = format!(
        "[gateway]\nname = {name:?}\n[engine_api]\nunix_socket = {:?}\n[peer_link]\nauth = \"none\"\nlisten = \"127.0.0.1:0\"\n[admin]\nlisten = \"\"\n{plugins}",
        socket.display().to_string()
    );
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn config_check_refuses_what_a_plugin_would_refuse() {
    let dir = work_dir();
    let cases = [
        (
            "zero-workers",
            "[plugins]\npreference = [\"shm\"]\n[plugins.config.shm]\nworkers = 0\n",
            "workers = 0 is outside 1..=64",
        ),
        ("misspelt-key", "[plugins]\npreference = [\"shm\"]\n[plugins.config.shm]\nworkerz = 2\n", "workerz"),
        (
            "no-such-plugin",
            "[plugins]\npreference = [\"nosuch\"]\n",
            "\"nosuch\", which is neither built in nor in plugins.libraries",
        ),
        (
            "orphan-section",
            "[plugins]\npreference = [\"shm\"]\n[plugins.config.shmm]\nworkers = 2\n",
            "[plugins.config.shmm] names no plugin",
        ),
        // A plugin that is not preferred still has its section checked.
        (
            "unused-but-bad",
            "[plugins]\npreference = [\"shm\"]\n[plugins.config.quic]\nno_such_key = 1\n",
            "[plugins.config.quic]",
        ),
    ];
    for (name, plugins, expected) in cases {
        let (code, out) = run(&["config", "check"], &config(dir.path(), name, plugins));
        assert_eq!(code, 2, "{name}: {out}");
        assert!(out.contains(expected), "{name}: expected {expected:?} in {out}");
    }
    // Just inside the range, and a valid section for a plugin that is not preferred: accepted,
    // the latter with a note.
    let good = "[plugins]\npreference = [\"shm\"]\n[plugins.config.shm]\nworkers = 1\n[plugins.config.quic]\n";
    let (code, out) = run(&["config", "check"], &config(dir.path(), "good", good));
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("not in plugins.preference"), "{out}");
    let (code, out) = run(&["config", "check"], &config(dir.path(), "max", "[plugins.config.shm]\nworkers = 64\n"));
    assert_eq!(code, 0, "{out}");
    let (code, out) =
        run(&["config", "check"], &config(dir.path(), "past-max", "[plugins.config.shm]\nworkers = 65\n"));
    assert_eq!(code, 2, "{out}");
}

#[test]
fn serve_refuses_to_start_when_one_of_several_plugins_has_a_bad_config() {
    let dir = work_dir();
    let plugins = "[plugins]\npreference = [\"shm\", \"quic\"]\n[plugins.config.quic]\nmax_streams = \"many\"\n";
    let path = config(dir.path(), "bad-quic", plugins);
    let (code, out) = run(&["serve", "--config"], &path);
    assert_ne!(code, 0, "serve started with a plugin whose config is invalid: {out}");
    assert!(out.contains("invalid plugin configuration") && out.contains("[plugins.config.quic]"), "{out}");
    assert!(
        !dir.path().join("bad-quic-sock").join("engine.sock").exists(),
        "the engine socket was bound before the refusal"
    );
}

#[test]
fn every_shipped_config_passes_its_plugin_checks() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join("configs");
    let mut checked = 0;
    for entry in std::fs::read_dir(&root).unwrap() {
        let folder = entry.unwrap().path();
        for file in std::fs::read_dir(&folder).into_iter().flatten() {
            let path = file.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                let config: toml::Value = toml::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
                let plugins = config.get("plugins").cloned().unwrap_or(toml::Value::Table(Default::default()));
                let mut text = String::from("[plugins]\n");
                text.push_str(&toml::to_string(&plugins).unwrap().replace("[config.", "[plugins.config."));
                let dir = work_dir();
                let (code, out) = run(&["config", "check"], &config_with_plugins(dir.path(), &text));
                assert_eq!(code, 0, "{}: {out}", path.display());
                checked += 1;
            }
        }
    }
    assert!(checked >= 8, "only {checked} shipped configs found under {}", root.display());
}

fn config_with_plugins(dir: &Path, plugins: &str) -> PathBuf {
    config(dir, "shipped", plugins)
}
