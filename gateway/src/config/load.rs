//! Builds a [`GatewayConfig`] from its layers: built-in defaults (the `Default` impls) < TOML file <
//! `KVGATE__SECTION__KEY` environment variables, then validates it. Never reads any other source.

use super::validate::{check_files, validate, LimitError};
use super::GatewayConfig;
use config::{Config, Environment, File, FileFormat};
use std::fmt;
use std::path::Path;

/// Why a configuration could not be used.
#[derive(Debug)]
pub enum ConfigError {
    /// The file could not be read.
    Read { path: String, error: std::io::Error },
    /// The TOML is malformed, a key is unknown (typo) or a value has the wrong type.
    Parse(String),
    /// Values parse but break limits or rules; every problem is listed.
    Invalid(Vec<LimitError>),
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::Read { path, error } => write!(f, "cannot read config file {path}: {error}"),
            ConfigError::Parse(message) => write!(f, "invalid configuration: {message}"),
            ConfigError::Invalid(errors) => {
                writeln!(
                    f,
                    "invalid configuration ({} problem{}):",
                    errors.len(),
                    if errors.len() == 1 { "" } else { "s" }
                )?;
                for e in errors {
                    writeln!(f, "  {e}")?;
                }
                Ok(())
            }
        }
    }
}

impl std::error::Error for ConfigError {}

/// The prefix of overriding environment variables: `KVGATE__PEER_LINK__HEARTBEAT_MS=100`.
pub const ENV_PREFIX: &str = "KVGATE";
/// Between the prefix, the section and the key.
pub const ENV_SEPARATOR: &str = "__";

/// Load `path` (or only defaults when `None`) with environment overrides, then validate.
pub fn load_config(path: Option<&Path>) -> Result<GatewayConfig, ConfigError> {
    let text = match path {
        Some(p) => {
            std::fs::read_to_string(p).map_err(|error| ConfigError::Read { path: p.display().to_string(), error })?
        }
        None => String::new(),
    };
    let origin = path.map(|p| p.display().to_string()).unwrap_or_else(|| "built-in defaults".to_string());
    let mut config = build(&text, &origin, true)?;
    resolve_relative_paths(&mut config, path.and_then(Path::parent));
    let errors = check_files(&config);
    if errors.is_empty() {
        Ok(config)
    } else {
        Err(ConfigError::Invalid(errors))
    }
}

/// `peer_link.psk_file` given as a relative path names a file in the config file's folder (so a
/// deployment's configs and its key travel together).
fn resolve_relative_paths(config: &mut GatewayConfig, folder: Option<&Path>) {
    let psk = &mut config.peer_link.psk_file;
    if let Some(folder) = folder {
        if !psk.is_empty() && Path::new(psk.as_str()).is_relative() {
            *psk = folder.join(psk.as_str()).display().to_string();
        }
    }
}

/// Load from TOML text without the environment layer (tests, `config check` of generated text).
pub fn load_config_from_str(text: &str) -> Result<GatewayConfig, ConfigError> {
    build(text, "<string>", false)
}

fn build(text: &str, origin: &str, with_env: bool) -> Result<GatewayConfig, ConfigError> {
    // The toml crate first: its errors carry line and column, and it rejects unknown keys with the
    // section they appear in (the config crate alone would report them without a path).
    let from_file: GatewayConfig =
        toml::from_str(text).map_err(|e| ConfigError::Parse(format!("{origin}: {}", e.to_string().trim_end())))?;
    let mut config = from_file;
    if with_env {
        let env_errors = check_env_overrides(std::env::vars());
        if !env_errors.is_empty() {
            return Err(ConfigError::Invalid(env_errors));
        }
        let mut builder = Config::builder().add_source(File::from_str(text, FileFormat::Toml));
        builder = builder.add_source(environment());
        let layered = builder.build().map_err(|e| ConfigError::Parse(format!("environment override: {e}")))?;
        config = layered
            .try_deserialize()
            .map_err(|e| ConfigError::Parse(format!("{origin} with KVGATE__ overrides: {e}")))?;
    }
    let errors = validate(&config);
    if errors.is_empty() {
        Ok(config)
    } else {
        Err(ConfigError::Invalid(errors))
    }
}

/// What the `KVGATE__SECTION__KEY` variables among `vars` would do wrong, each naming the variable:
/// a value that is not a whole number for an integer key (the config layer would round `1.9`), a number
/// too large for any key, an empty item in a list key, and `[[peers]]` (a list of tables, which an
/// environment variable cannot spell). Keys that exist nowhere are left to the layer's own refusal.
pub fn check_env_overrides(vars: impl Iterator<Item = (String, String)>) -> Vec<LimitError> {
    let defaults = toml::Value::try_from(GatewayConfig::default()).expect("the defaults serialise");
    let mut errors = Vec::new();
    let mut vars: Vec<(String, String)> = vars.filter(|(k, _)| k.starts_with("KVGATE__")).collect();
    vars.sort();
    for (var, value) in vars {
        let path: Vec<String> = var["KVGATE__".len()..].split(ENV_SEPARATOR).map(str::to_ascii_lowercase).collect();
        let key = path.join(".");
        let rule = |allowed: String| LimitError { key: var.clone(), value: format!("{value:?}"), allowed };
        if path.first().map(String::as_str) == Some("peers") {
            errors.push(rule(
                "no such variable: [[peers]] entries are written in the config file, not the environment".into(),
            ));
            continue;
        }
        if ENV_LIST_KEYS.contains(&key.as_str()) {
            if value.split(',').any(|item| item.trim().is_empty()) {
                errors.push(rule(format!("a comma-separated list of non-empty items ({key})")));
            }
            continue;
        }
        let default = path.iter().try_fold(&defaults, |v, part| v.get(part.as_str()));
        if let Some(toml::Value::Integer(_)) = default {
            match value.trim().parse::<u64>() {
                Ok(n) if n <= i64::MAX as u64 => {}
                Ok(_) => errors.push(rule(format!("a whole number up to {} ({key})", i64::MAX))),
                Err(_) => errors.push(rule(format!("a whole number ({key} is an integer)"))),
            }
        }
    }
    errors
}

/// Keys whose environment override is a comma-separated list (`KVGATE__PLUGINS__PREFERENCE=ucx,quic`).
pub const ENV_LIST_KEYS: &[&str] = &["plugins.preference", "plugins.libraries", "discovery.etcd_endpoints"];

fn environment() -> Environment {
    let env = Environment::with_prefix(ENV_PREFIX)
        .prefix_separator(ENV_SEPARATOR)
        .separator(ENV_SEPARATOR)
        .try_parsing(true)
        .list_separator(",");
    ENV_LIST_KEYS.iter().fold(env, |env, key| env.with_list_parse_key(key))
}

/// Environment variables that look meant for kvgate but would be ignored (`KVGATE_X` instead of
/// `KVGATE__SECTION__KEY`): one warning text each.
pub fn single_underscore_env_warnings() -> Vec<String> {
    env_warnings(std::env::vars().map(|(k, _)| k))
}

fn env_warnings(names: impl Iterator<Item = String>) -> Vec<String> {
    names
        .filter(|k| {
            k.starts_with("KVGATE_") && !k.starts_with("KVGATE__") && !IGNORED_KVGATE_VARS.contains(&k.as_str())
        })
        .map(|k| {
            format!("environment variable {k} is ignored: overrides are spelled KVGATE__SECTION__KEY (two underscores)")
        })
        .collect()
}

/// Variables with a single underscore that kvgate reads on purpose (not config overrides).
const IGNORED_KVGATE_VARS: &[&str] =
    &["KVGATE_LOG", "KVGATE_BIN", "KVGATE_ENGINE_API", "KVGATE_SGLANG_VENV", "KVGATE_SGLANG_PYTHON"];

/// The built-in defaults as a commented-free TOML document (`kvgate config default`).
pub fn default_toml() -> String {
    toml::to_string(&GatewayConfig::default()).expect("the default config serialises")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_errors(vars: &[(&str, &str)]) -> Vec<String> {
        check_env_overrides(vars.iter().map(|(k, v)| (k.to_string(), v.to_string())))
            .iter()
            .map(|e| e.to_string())
            .collect()
    }

    #[test]
    fn an_override_that_is_not_a_whole_number_too_large_or_an_empty_list_item_is_refused_naming_the_variable() {
        assert!(env_errors(&[
            ("KVGATE__PEER_LINK__HEARTBEAT_MISSES", "3"),
            ("KVGATE__PLUGINS__PREFERENCE", "shm,quic"),
            ("KVGATE__GATEWAY__NAME", "1.9")
        ])
        .is_empty());
        let e = env_errors(&[("KVGATE__PEER_LINK__HEARTBEAT_MISSES", "1.9")]);
        assert!(
            e.len() == 1 && e[0].contains("KVGATE__PEER_LINK__HEARTBEAT_MISSES") && e[0].contains("whole number"),
            "{e:?}"
        );
        let e = env_errors(&[("KVGATE__SCHEDULER__ROOM_TIMEOUT_MS", "18446744073709551615")]);
        assert!(
            e.len() == 1
                && e[0].contains("KVGATE__SCHEDULER__ROOM_TIMEOUT_MS")
                && e[0].contains("up to 9223372036854775807"),
            "{e:?}"
        );
        assert!(
            env_errors(&[("KVGATE__SCHEDULER__ROOM_TIMEOUT_MS", "9223372036854775807")]).is_empty(),
            "at the limit"
        );
        for list in ["", "shm,", ",shm", "shm,,quic"] {
            let e = env_errors(&[("KVGATE__PLUGINS__PREFERENCE", list)]);
            assert!(
                e.len() == 1 && e[0].contains("KVGATE__PLUGINS__PREFERENCE") && e[0].contains("non-empty items"),
                "{list:?}: {e:?}"
            );
        }
        let e = env_errors(&[("KVGATE__PEERS__0__NAME", "decode")]);
        assert!(e.len() == 1 && e[0].contains("KVGATE__PEERS__0__NAME") && e[0].contains("[[peers]]"), "{e:?}");
        // Not ours: left alone.
        assert!(env_errors(&[("PATH", "x"), ("KVGATE_LOG", "1.9")]).is_empty());
    }

    #[test]
    fn single_underscore_variables_are_reported_and_double_are_not() {
        let names = ["KVGATE_SCHEDULER_ABORT_GRACE_MS", "KVGATE__SCHEDULER__ABORT_GRACE_MS", "PATH", "KVGATE_LOG"];
        let warnings = env_warnings(names.iter().map(|s| s.to_string()));
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].contains("KVGATE_SCHEDULER_ABORT_GRACE_MS"));
    }
}
