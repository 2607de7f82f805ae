//! Plugin start-up for the gateway: register the built-in plugins, load configured libraries, open
//! every plugin named in `plugins.preference` with its sink wired to the driver's bounded plugin
//! queue, and describe all of them for `/plugins` and `kvgate plugins list`. Never opens a plugin
//! that was not asked for. Every plugin's config section is checked before anything is opened:
//! `config check` reports the findings, `serve` refuses to start on any invalid one.

use crate::channels::{PluginEventMsg, PluginStatus};
use crate::config::GatewayConfig;
use crate::metrics::GatewayMetrics;
use kvgate_abi::{scope, sdk::sink_from_fn, Capabilities, MemoryKind, PluginInfo};
use kvgate_core::PluginSlot;
use kvgate_host::{ConfigCheck, OpenError, OpenedPlugin, PluginHost, PluginListing};
use std::sync::Arc;
use tokio::sync::mpsc;

/// The shm module, built once per process (each build leaks one small allocation).
fn shm_module() -> kvgate_abi::PluginModRef {
    static MODULE: std::sync::OnceLock<kvgate_abi::PluginModRef> = std::sync::OnceLock::new();
    *MODULE.get_or_init(kvgate_plugin_shm::module)
}

/// A host with every built-in plugin registered.
pub fn host_with_builtins() -> PluginHost {
    let mut host = PluginHost::new();
    // The shm plugin is always built in (same-host shared memory, the reference plugin).
    if let Err(e) = host.register_builtin("shm", shm_module()) {
        tracing::error!("built-in shm plugin refused: {e}");
    }
    crate::builtin_extra::register(&mut host);
    host
}

/// For a plugin reload: a host with `plugins.libraries` loaded first, then every built-in plugin
/// that no library replaces (a library carrying `shm` takes the place of the built-in one). Every
/// library that does not load is returned with why.
pub fn host_for_reload(libraries: &[String]) -> (PluginHost, Vec<String>) {
    let mut host = PluginHost::new();
    let mut failures = Vec::new();
    for result in host.load_all(libraries) {
        if let Err(e) = result {
            failures.push(format!("plugins.libraries: not loaded: {e}"));
        }
    }
    let builtins = std::iter::once(("shm", shm_module())).chain(crate::builtin_extra::modules());
    for (name, module) in builtins {
        if host.module(name).is_none() {
            if let Err(e) = host.register_builtin(name, module) {
                failures.push(format!("built-in {name}: {e}"));
            }
        }
    }
    (host, failures)
}

/// The config text plugin `name` is opened with.
pub fn plugin_config_text_of(plugins: &crate::config::PluginsSection, name: &str) -> String {
    plugins.config.get(name).map(|t| toml::to_string(t).unwrap_or_default()).unwrap_or_default()
}

/// A sink that tags each event with `slot` and queues it for the driver without ever blocking a
/// plugin thread: a full queue drops the event, counted; the core's plugin grace then ends it.
pub fn slot_sink(
    slot: PluginSlot,
    events: mpsc::Sender<PluginEventMsg>,
    metrics: Arc<GatewayMetrics>,
) -> kvgate_abi::EventSinkBox {
    sink_from_fn(move |event| {
        if events.try_send((slot, event)).is_err() {
            metrics.plugin_events_dropped.inc();
        }
    })
}

pub fn memory_kinds(caps: &Capabilities) -> Vec<&'static str> {
    MemoryKind::ALL.iter().filter(|k| caps.serves(**k)).map(|k| k.as_str()).collect()
}

pub fn scopes(caps: &Capabilities) -> Vec<&'static str> {
    let mut v = Vec::new();
    if caps.scope & scope::SAME_HOST != 0 {
        v.push("same_host");
    }
    if caps.scope & scope::CROSS_HOST != 0 {
        v.push("cross_host");
    }
    v
}

pub fn status_of(info: &PluginInfo, name: &str, origin: String, status: &str, reason: String) -> PluginStatus {
    PluginStatus {
        name: name.to_string(),
        generation: 0,
        wire_name: String::new(),
        state: String::new(),
        origin,
        status: status.to_string(),
        reason,
        abi_version: Some(info.abi_version),
        version: info.version.to_string(),
        memory_kinds: memory_kinds(&info.capabilities),
        scope: scopes(&info.capabilities),
        max_inflight_transfers: info.capabilities.max_inflight_transfers,
        max_segments_per_submit: info.capabilities.max_segments_per_submit,
    }
}

/// One status line per known plugin (loaded or not), with `opened` describing what was opened.
pub fn describe(listing: &[PluginListing], opened: &[(String, Result<(), String>)]) -> Vec<PluginStatus> {
    listing
        .iter()
        .map(|l| match &l.status {
            Ok(info) => {
                let (status, reason) = match opened.iter().find(|(n, _)| n == &l.name) {
                    Some((_, Ok(()))) => ("opened", String::new()),
                    Some((_, Err(e))) if e.starts_with("unavailable") => ("unavailable", e.clone()),
                    Some((_, Err(e))) => ("open_failed", e.clone()),
                    None => ("not_opened", "not in plugins.preference".to_string()),
                };
                status_of(info, &l.name, l.origin.to_string(), status, reason)
            }
            Err(e) => PluginStatus {
                name: l.name.clone(),
                generation: 0,
                wire_name: String::new(),
                state: String::new(),
                origin: l.origin.to_string(),
                status: "load_failed".into(),
                reason: e.to_string(),
                abi_version: l.abi_version,
                version: String::new(),
                memory_kinds: vec![],
                scope: vec![],
                max_inflight_transfers: 0,
                max_segments_per_submit: 0,
            },
        })
        .collect()
}

/// What checking every plugin's config found: `notes` are fine to start with (a plugin that can
/// check only by opening, a section for a plugin not in the preference list), `errors` are not.
#[derive(Debug, Default)]
pub struct PluginConfigFindings {
    pub notes: Vec<String>,
    pub errors: Vec<String>,
}

fn plugin_config_text(config: &GatewayConfig, name: &str) -> String {
    plugin_config_text_of(&config.plugins, name)
}

/// Check the config of every preferred plugin and of every `[plugins.config.NAME]` section with
/// the plugin's own parser, opening nothing. A preferred name no plugin has, a section naming no
/// plugin, or a config the plugin refuses is an error.
pub fn check_plugin_configs(config: &GatewayConfig, host: &PluginHost) -> PluginConfigFindings {
    let mut findings = PluginConfigFindings::default();
    let mut names: Vec<&String> = config.plugins.preference.iter().collect();
    names.extend(config.plugins.config.keys().filter(|k| !config.plugins.preference.contains(k)));
    for name in names {
        let preferred = config.plugins.preference.contains(name);
        match host.check_config(name, &plugin_config_text(config, name)) {
            ConfigCheck::Valid if preferred => {}
            ConfigCheck::Valid => findings.notes.push(format!(
                "[plugins.config.{name}] is valid but {name} is not in plugins.preference, so it is not opened"
            )),
            ConfigCheck::NotChecked { reason } => {
                findings.notes.push(format!("plugin {name}: config not checked before start ({reason})"))
            }
            ConfigCheck::Invalid(OpenError::UnknownPlugin { .. }) if preferred => findings.errors.push(format!(
                "plugins.preference names {name:?}, which is neither built in nor in plugins.libraries (known: {})",
                host.plugins().iter().map(|p| p.name.as_str()).collect::<Vec<_>>().join(", ")
            )),
            ConfigCheck::Invalid(OpenError::UnknownPlugin { .. }) => findings
                .errors
                .push(format!("[plugins.config.{name}] names no plugin that is built in or in plugins.libraries")),
            ConfigCheck::Invalid(e) => findings.errors.push(format!("[plugins.config.{name}]: {e}")),
        }
    }
    findings
}

/// `config check`'s plugin part: load the configured libraries and check every plugin section.
pub fn check_config_file_plugins(config: &GatewayConfig) -> PluginConfigFindings {
    let (host, library_failures) = host_for_reload(&config.plugins.libraries);
    let mut findings = check_plugin_configs(config, &host);
    findings.notes.splice(0..0, library_failures);
    findings
}

/// Load libraries and open the preferred plugins. Slot numbers are positions in the returned vector.
/// Refuses (before opening anything) when any plugin's config is invalid, and (after closing what
/// it opened) when a preferred plugin refuses its config at open; a plugin this machine cannot run
/// (`unavailable`) is listed and skipped.
pub fn open_plugins(
    config: &GatewayConfig,
    events: mpsc::Sender<PluginEventMsg>,
    metrics: Arc<GatewayMetrics>,
) -> anyhow::Result<(Vec<OpenedPlugin>, Vec<PluginStatus>)> {
    // A library that does not load is logged; the plugin it carried is then an unknown name below
    // if it is preferred. A library carrying a built-in plugin's name replaces the built-in one.
    let (host, library_failures) = host_for_reload(&config.plugins.libraries);
    for failure in &library_failures {
        tracing::error!("plugin library not loaded: {failure}");
    }
    let findings = check_plugin_configs(config, &host);
    for note in &findings.notes {
        tracing::info!("{note}");
    }
    if !findings.errors.is_empty() {
        for error in &findings.errors {
            tracing::error!(reason = "invalid_config", "{error}");
        }
        anyhow::bail!("invalid plugin configuration: {}", findings.errors.join("; "));
    }
    let mut opened: Vec<OpenedPlugin> = Vec::new();
    let mut outcomes = Vec::new();
    for name in &config.plugins.preference {
        let slot = PluginSlot(opened.len() as u32);
        let sink = slot_sink(slot, events.clone(), metrics.clone());
        match host.open(name, &plugin_config_text(config, name), sink) {
            Ok(plugin) => {
                tracing::info!(plugin = %name, slot = slot.0, "plugin opened");
                opened.push(plugin);
                outcomes.push((name.clone(), Ok(())));
            }
            Err(e @ OpenError::InvalidConfig { .. }) => {
                for plugin in &opened {
                    plugin.shutdown();
                }
                anyhow::bail!("invalid plugin configuration: {e}");
            }
            Err(e) => {
                tracing::warn!(plugin = %name, reason = e.code(), "plugin not opened: {e}");
                outcomes.push((name.clone(), Err(format!("{}: {e}", e.code()))));
            }
        }
    }
    let listing = describe(&host.plugins(), &outcomes);
    Ok((opened, listing))
}
