//! The ABI crate is versioned on its own (ABI.md, "Versions: the compatibility rule"): a version
//! inherited from the workspace would let a routine workspace bump make every built plugin fail to
//! load. The version series ABI.md promises is the crate's.

#[test]
fn the_abi_crate_sets_its_own_version_and_abi_md_states_its_series() {
    let manifest = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml")).unwrap();
    assert!(!manifest.contains("version.workspace"), "kvgate-abi must not take the workspace version");
    let own = format!("version = \"{}\"", env!("CARGO_PKG_VERSION"));
    assert!(manifest.lines().any(|l| l.trim() == own), "Cargo.toml sets {own}");
    let series = format!("{}.{}", env!("CARGO_PKG_VERSION_MAJOR"), env!("CARGO_PKG_VERSION_MINOR"));
    let rule = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/ABI.md")).unwrap();
    assert!(
        rule.contains(&format!("`kvgate-abi` {series}.y loads every plugin built against {series}.x")),
        "ABI.md states the rule for {series}"
    );
}
