//! CONFORMANCE.md against the code: every clause has a test citing it (or a harness check, or a
//! listed exception), and no code cites an id the contract does not define.

use kvgate_conformance::xref;
use std::collections::BTreeSet;
use std::path::PathBuf;

/// Clauses enforced by plugins that a shipped plugin does not implement in its own code, with the
/// reason (`*`: every plugin). Everything else enforced by plugins, each plugin crate cites where it
/// implements it, in its own sources (`plugins/<name>/src`): the rule of
/// `every_plugin_crate_cites_the_clauses_it_implements`. A clause the SDK implements for a plugin (the
/// transfer ledger: exactly-once terminal events, deadlines, cancels, quiescence) is still cited by
/// the plugin, where it hands the ledger its part (its holds, its failures, its deadline task).
const NOT_IN_THE_PLUGIN: &[(&str, &str, &str)] = &[
    ("*", "HYGIENE-1", "the SDK's Guarded wrapper catches panics at every entry (core/abi/src/sdk.rs)"),
    ("*", "OBS-5", "no shipped plugin emits PROGRESS events (the clause is unsupported for them)"),
    ("shm", "TIME-12", "same host: no network to black-hole"),
    ("shm", "DATA-7", "same host: no network to corrupt or delay"),
    ("nvlink", "TIME-12", "same host: no network to black-hole"),
    ("nvlink", "DATA-7", "same host: no network to corrupt or delay"),
    (
        "ucx",
        "DATA-7",
        "UCX's transports deliver bytes intact (TCP's checksum, shared memory); the plugin adds no check",
    ),
    ("quic", "TIME-10", "no worker thread of its own: its work runs as tasks of its tokio runtime"),
];

#[test]
fn every_clause_is_tested_and_every_citation_exists() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let text = std::fs::read_to_string(root.join("CONFORMANCE.md")).expect("CONFORMANCE.md at the repository root");
    let contract = xref::parse_contract(&text);
    assert!(contract.clauses.len() >= 30, "only {} clauses parsed", contract.clauses.len());
    let dirs: Vec<PathBuf> = ["core", "plugins", "gateway", "tests"].iter().map(|d| root.join(d)).collect();
    let mut citations = Vec::new();
    for file in xref::rust_files(&dirs) {
        let Ok(text) = std::fs::read_to_string(&file) else { continue };
        let rel = file.strip_prefix(&root).unwrap_or(&file).to_path_buf();
        citations.extend(xref::citations_in_file(&rel, &text));
    }
    let registry = kvgate_conformance::registry::registry();
    let harness_ids: Vec<&str> = registry.iter().map(|c| c.id).collect();
    let problems = xref::problems(&contract, &citations, &harness_ids);
    assert!(problems.is_empty(), "{} cross-reference problem(s):\n{}", problems.len(), problems.join("\n"));
    let tested: std::collections::BTreeSet<_> = citations.iter().filter(|c| c.in_test).map(|c| c.id.clone()).collect();
    for (id, reason) in &contract.exceptions {
        if tested.contains(id) {
            eprintln!("note: {id} is listed as an exception ({reason}) but a test now cites it; the exception can go");
        }
    }
}

#[test]
fn every_plugin_crate_cites_the_clauses_it_implements() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let text = std::fs::read_to_string(root.join("CONFORMANCE.md")).expect("CONFORMANCE.md at the repository root");
    let contract = xref::parse_contract(&text);
    assert!(
        contract.plugin_enforced.len() >= 20,
        "only {} plugin-enforced clauses parsed",
        contract.plugin_enforced.len()
    );
    let mut plugins: Vec<String> = std::fs::read_dir(root.join("plugins"))
        .expect("plugins/")
        .flatten()
        .filter(|e| e.path().join("src").is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    plugins.sort();
    assert_eq!(plugins, ["nvlink", "quic", "shm", "ucx"], "a new plugin crate needs its exemptions decided here");
    let mut problems = Vec::new();
    for plugin in &plugins {
        let src = root.join("plugins").join(plugin).join("src");
        let mut cited = BTreeSet::new();
        for file in xref::rust_files(&[src]) {
            let Ok(text) = std::fs::read_to_string(&file) else { continue };
            cited.extend(xref::citations_in_file(&file, &text).into_iter().map(|c| c.id));
        }
        let exempt: Vec<&str> =
            NOT_IN_THE_PLUGIN.iter().filter(|(p, _, _)| *p == "*" || p == plugin).map(|(_, id, _)| *id).collect();
        problems.extend(xref::plugin_citation_gaps(&contract, plugin, &cited, &exempt));
    }
    assert!(problems.is_empty(), "{} plugin citation problem(s):\n{}", problems.len(), problems.join("\n"));
}
