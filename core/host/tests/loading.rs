//! Loading plugin libraries: the shm cdylib loads, opens and is found again under another spelling of
//! its path; an incompatible layout, a missing file, a non-plugin library and a non-ELF file are each
//! refused with a short message, and all of them at once are all reported.
//!
//! The libraries are the workspace's own cdylibs, in this test binary's target directory. `cargo test`
//! does not build cdylibs, so each is built (or found up to date) first with `cargo build -p <crate>`
//! in the same profile and target directory; `cargo build --workspace` beforehand makes that quick.

use kvgate_abi::sdk::sink_from_fn;
use kvgate_host::artifacts::built_or_build_cdylib;
use kvgate_host::{LoadError, OpenError, PluginHost, PluginOrigin, MAX_ABI_ERROR_LINES};
use std::path::{Path, PathBuf};

fn workspace() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn shm_library() -> PathBuf {
    built_or_build_cdylib("kvgate-plugin-shm-so", "kvgate_shm", workspace()).unwrap_or_else(|e| panic!("{e}"))
}

fn abi_mismatch_library() -> PathBuf {
    built_or_build_cdylib("kvgate-host-fixture-abi-mismatch", "kvgate_fixture_abi_mismatch", workspace())
        .unwrap_or_else(|e| panic!("{e}"))
}

/// A shared library that is not a kvgate plugin (zlib ships on every Debian machine).
fn foreign_library() -> PathBuf {
    let candidates = [
        "/lib/x86_64-linux-gnu/libz.so.1",
        "/usr/lib/x86_64-linux-gnu/libz.so.1",
        "/lib64/libz.so.1",
        "/usr/lib/libz.so.1",
    ];
    candidates
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("no libz.so.1 in {candidates:?}; install zlib1g"))
}

/// A file with a plugin's name that is not an ELF object.
fn text_file_named_like_a_plugin() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvgate-host-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("libkvgate_text.so");
    std::fs::write(&path, "not a shared object\n").unwrap();
    path
}

fn noop_sink() -> kvgate_abi::EventSinkBox {
    sink_from_fn(|_| {})
}

#[test]
fn the_shm_library_loads_opens_and_is_loaded_once() {
    let path = shm_library();
    let mut host = PluginHost::new();
    assert_eq!(host.load_library(&path).unwrap(), "shm");
    // Another spelling of the same file is the same plugin, not a second load or a duplicate.
    let dir = path.parent().unwrap();
    let respelled = dir.join(".").join(path.file_name().unwrap());
    assert_eq!(host.load_library(&respelled).unwrap(), "shm");
    let listing = host.plugins();
    assert_eq!(listing.len(), 1, "{listing:?}");
    assert_eq!(listing[0].origin, PluginOrigin::Library(std::fs::canonicalize(&path).unwrap()));
    assert_eq!(listing[0].abi_version, Some(kvgate_abi::ABI_VERSION));
    assert_eq!(listing[0].status.as_ref().unwrap().name.as_str(), "shm");

    let opened = host.open("shm", "workers = 1", noop_sink()).unwrap();
    assert_eq!(opened.name(), "shm");
    assert!(opened.capabilities().serves(kvgate_abi::MemoryKind::HOST));
    assert!(!opened.capabilities().serves(kvgate_abi::MemoryKind::CUDA_DEVICE));
    assert_eq!(opened.transport().stats().healthy, 1);
    let shared = opened.clone();
    std::thread::spawn(move || assert_eq!(shared.transport().stats().workers_alive, 2)).join().unwrap();
    opened.shutdown();
    assert_eq!(opened.transport().stats().workers_alive, 0);

    match host.open("shm", "workers = 0", noop_sink()) {
        Err(OpenError::InvalidConfig { plugin, message }) => {
            assert_eq!(plugin, "shm");
            assert!(message.contains("workers"), "{message}");
        }
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
}

// CONFORMANCE: HYGIENE-2
#[test]
fn an_incompatible_layout_is_refused_with_a_short_clear_message() {
    let mut host = PluginHost::new();
    let error = host.load_library(abi_mismatch_library()).unwrap_err();
    eprintln!("{error}");
    let LoadError::AbiInstability { summary, .. } = &error else { panic!("expected AbiInstability, got {error}") };
    let lines: Vec<&str> = summary.lines().collect();
    assert!(!lines.is_empty() && lines.len() <= MAX_ABI_ERROR_LINES + 1, "{summary}");
    assert!(lines.iter().take(MAX_ABI_ERROR_LINES).all(|l| l.starts_with("Error:")), "{summary}");
    let shown = error.to_string();
    assert!(shown.starts_with("abi_instability: "), "{shown}");
    assert!(shown.contains("libkvgate_fixture_abi_mismatch"), "names the file: {shown}");
    assert!(shown.lines().count() <= MAX_ABI_ERROR_LINES + 2 && shown.len() < 4000, "short: {shown}");
    assert_eq!(host.plugins().len(), 1);
    assert!(host.plugins()[0].status.is_err());
}

#[test]
fn a_missing_file_is_not_found() {
    let mut host = PluginHost::new();
    let error = host.load_library("/nonexistent/dir/libkvgate_nothing.so").unwrap_err();
    assert_eq!(error.code(), "not_found", "{error}");
}

/// A bare file name is resolved against the current directory, never the loader's search path
/// (where a system library of that name would be found).
#[test]
fn a_bare_file_name_is_not_looked_up_in_the_loader_path() {
    let mut host = PluginHost::new();
    let error = host.load_library("libz.so.1").unwrap_err();
    assert_eq!(error.code(), "not_found", "{error}");
}

// CONFORMANCE: HYGIENE-2
#[test]
fn a_library_that_is_not_a_plugin_is_refused() {
    let mut host = PluginHost::new();
    let error = host.load_library(foreign_library()).unwrap_err();
    assert_eq!(error.code(), "not_a_plugin", "{error}");
    assert!(error.to_string().lines().count() <= 2, "{error}");
}

#[test]
fn a_file_that_is_not_a_shared_object_is_refused() {
    let mut host = PluginHost::new();
    let error = host.load_library(text_file_named_like_a_plugin()).unwrap_err();
    assert_eq!(error.code(), "open_failed", "{error}");
}

// CONFORMANCE: HYGIENE-2
#[test]
fn every_bad_plugin_is_reported_not_only_the_first() {
    let paths: Vec<PathBuf> = vec![
        PathBuf::from("/nonexistent/libkvgate_ucx.so"),
        foreign_library(),
        abi_mismatch_library(),
        shm_library(),
        text_file_named_like_a_plugin(),
    ];
    let mut host = PluginHost::new();
    let results = host.load_all(&paths);
    for r in &results {
        eprintln!("{r:?}");
    }
    let codes: Vec<&str> = results.iter().map(|r| r.as_ref().map(|_| "ok").unwrap_or_else(|e| e.code())).collect();
    assert_eq!(codes, ["not_found", "not_a_plugin", "abi_instability", "ok", "open_failed"]);
    let listing = host.plugins();
    assert_eq!(listing.len(), 5, "{listing:?}");
    assert_eq!(listing.iter().filter(|l| l.status.is_err()).count(), 4);
    for (path, line) in paths.iter().filter(|p| !p.ends_with("libkvgate_shm.so")).zip(listing.iter().skip(1)) {
        assert_eq!(line.origin, PluginOrigin::Library(path.clone()), "{line:?}");
        assert!(Path::new(&line.name) == path.as_path());
    }
}
