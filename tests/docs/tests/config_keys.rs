//! Every configuration key the code accepts is named where an operator looks for it, and every key
//! those tables name is one the code accepts: the gateway's keys in gateway/README.md (the
//! scheduler's in the top-level README's table), including those of the optional tables the defaults
//! leave out (`[peer_link.tls]`, `[discovery.tls]`, `[[peers]]`), each plugin's in its own README.

use kvgate_docs_check::{dotted_keys, expand_key_pattern, keys_in_refusal, section, table_keys};
use std::collections::BTreeSet;

const TOP_README: &str = include_str!("../../../README.md");
const GATEWAY_README: &str = include_str!("../../../gateway/README.md");

/// Keys the code accepts that `readme` does not name between backticks.
fn undocumented<'a>(keys: impl IntoIterator<Item = &'a String>, readme: &str) -> Vec<String> {
    keys.into_iter().filter(|key| !readme.contains(&format!("`{key}`"))).cloned().collect()
}

/// Every key of the gateway's configuration, as `section.key`.
fn gateway_keys() -> Vec<String> {
    dotted_keys(&kvgate::config::default_toml()).into_iter().map(|(section, key)| format!("{section}.{key}")).collect()
}

#[test]
fn every_gateway_key_is_in_the_gateway_readme() {
    let keys: Vec<String> = gateway_keys().into_iter().filter(|k| !k.starts_with("scheduler.")).collect();
    assert!(keys.len() >= 20, "too few gateway keys read: {keys:?}");
    let missing = undocumented(&keys, GATEWAY_README);
    assert!(missing.is_empty(), "gateway keys missing from gateway/README.md: {missing:?}");
}

#[test]
fn every_scheduler_key_is_in_the_top_level_readme() {
    let keys: Vec<String> =
        gateway_keys().iter().filter_map(|k| k.strip_prefix("scheduler.")).map(str::to_string).collect();
    assert!(keys.len() >= 10, "too few scheduler keys read: {keys:?}");
    let missing = undocumented(&keys, TOP_README);
    assert!(missing.is_empty(), "scheduler keys missing from README.md's [scheduler] table: {missing:?}");
}

/// Keys whose default is "unset" (so `kvgate config default` does not print them), each with a value
/// that proves the gateway accepts it.
const UNSET_BY_DEFAULT: [(&str, &str, &str); 2] =
    [("peer_link", "auth", "\"none\""), ("peer_link", "transport", "\"grpc\"")];

#[test]
fn every_gateway_key_the_readme_table_names_is_accepted() {
    let mut accepted = gateway_keys();
    for (section, key, value) in UNSET_BY_DEFAULT {
        kvgate::config::load_config_from_str(&format!("[{section}]\n{key} = {value}\n"))
            .unwrap_or_else(|e| panic!("{section}.{key}: {e}"));
        accepted.push(format!("{section}.{key}"));
    }
    // Plain `section.key` rows; the patterned ones of the optional tables (`peer_link.tls.{cert,key,ca}_file`,
    // `[[peers]] ...`) are checked below, `plugins.config.NAME` against each plugin's README.
    let named: Vec<String> = table_keys(section(GATEWAY_README, "## Configuration reference"))
        .into_iter()
        .filter(|k| k.split('.').count() == 2 && k.chars().all(|c| c.is_ascii_lowercase() || c == '_' || c == '.'))
        .collect();
    assert!(named.len() >= 20, "too few keys read from gateway/README.md's table: {named:?}");
    let unknown: Vec<&String> = named.iter().filter(|k| !accepted.contains(k)).collect();
    assert!(unknown.is_empty(), "gateway/README.md names keys the gateway refuses: {unknown:?}");
}

/// The tables the defaults do not write (absent unless configured), each as its dotted name and its
/// TOML header: their keys are read from the gateway's refusal of an unknown key in them.
const OPTIONAL_TABLES: [(&str, &str); 3] =
    [("peers", "[[peers]]"), ("peer_link.tls", "[peer_link.tls]"), ("discovery.tls", "[discovery.tls]")];

/// Tables inside a section (`[engine_api.connections]`...): their keys are checked the same way.
const NESTED_TABLES: [(&str, &str); 3] = [
    ("engine_api.connections", "[engine_api.connections]"),
    ("peer_link.connections", "[peer_link.connections]"),
    ("admin.connections", "[admin.connections]"),
];

#[test]
fn the_readme_row_of_each_optional_table_names_exactly_the_keys_it_accepts() {
    let named: Vec<String> = table_keys(section(GATEWAY_README, "## Configuration reference"))
        .iter()
        .flat_map(|k| expand_key_pattern(k))
        .collect();
    for (table, header) in OPTIONAL_TABLES.into_iter().chain(NESTED_TABLES) {
        let refusal = kvgate::config::load_config_from_str(&format!("{header}\nno_such_key_anywhere = 1\n"))
            .map(drop)
            .map_err(|e| e.to_string());
        let accepted: BTreeSet<String> = keys_in_refusal(&refusal.expect_err("an unknown key is refused"))
            .iter()
            .map(|k| format!("{table}.{k}"))
            .collect();
        let in_readme: BTreeSet<String> =
            named.iter().filter(|k| k.starts_with(&format!("{table}."))).cloned().collect();
        assert_eq!(
            in_readme, accepted,
            "{header}: the keys gateway/README.md's table names (left) are not those the gateway accepts (right)"
        );
    }
}

/// `(plugin, the keys its config accepts, its README)`.
fn plugins() -> Vec<(&'static str, Vec<String>, &'static str)> {
    const UNKNOWN: &str = "no_such_key_anywhere = 1";
    let refusal = |result: Result<(), String>| keys_in_refusal(&result.expect_err("an unknown key is refused"));
    vec![
        (
            "shm",
            refusal(kvgate_plugin_shm::ShmConfig::parse(UNKNOWN).map(drop).map_err(|e| e.to_string())),
            include_str!("../../../plugins/shm/README.md"),
        ),
        (
            "quic",
            refusal(kvgate_plugin_quic::QuicConfig::parse(UNKNOWN).map(drop).map_err(|e| e.to_string())),
            include_str!("../../../plugins/quic/README.md"),
        ),
        (
            "ucx",
            refusal(kvgate_plugin_ucx::UcxConfig::parse(UNKNOWN).map(drop).map_err(|e| e.to_string())),
            include_str!("../../../plugins/ucx/README.md"),
        ),
        (
            "nvlink",
            refusal(kvgate_plugin_nvlink::NvlinkConfig::parse(UNKNOWN).map(drop).map_err(|e| e.to_string())),
            include_str!("../../../plugins/nvlink/README.md"),
        ),
    ]
}

#[test]
fn every_plugin_key_is_in_its_readme() {
    for (plugin, keys, readme) in plugins() {
        assert!(keys.len() >= 5, "{plugin}: too few keys read: {keys:?}");
        // `[ucx_options]` is a table of UCX's own settings, written as a TOML section.
        let missing: Vec<String> =
            undocumented(&keys, readme).into_iter().filter(|k| !readme.contains(&format!("`[{k}]`"))).collect();
        assert!(missing.is_empty(), "{plugin}: keys missing from plugins/{plugin}/README.md: {missing:?}");
    }
}

#[test]
fn every_key_a_plugin_readme_table_names_is_accepted() {
    for (plugin, keys, readme) in plugins() {
        let named: Vec<String> = table_keys(section(readme, "## Conf"))
            .into_iter()
            .map(|k| k.trim_start_matches('[').trim_end_matches(']').to_string())
            .filter(|k| k.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
            .collect();
        assert!(!named.is_empty(), "{plugin}: no configuration table read from its README");
        let unknown: Vec<&String> = named.iter().filter(|k| !keys.contains(k)).collect();
        assert!(unknown.is_empty(), "plugins/{plugin}/README.md names keys the plugin refuses: {unknown:?}");
    }
}
