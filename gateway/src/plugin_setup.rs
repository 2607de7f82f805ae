//! Plugin start-up for the gateway: register the built-in plugins, load configured libraries, open
//! every plugin named in `plugins.preference` with its sink wired to the driver's bounded plugin
//! queue, and describe all of them for `/plugins` and `kvgate plugins list`. Never opens a plugin
//! that was not asked for.

use crate::config::GatewayConfig;
use crate::driver::{PluginEventMsg, PluginStatus};
use crate::metrics::GatewayMetrics;
use kvgate_abi::{scope, sdk::sink_from_fn, Capabilities, MemoryKind, PluginInfo};
use kvgate_core::PluginSlot;
use kvgate_host::{OpenedPlugin, PluginHost, PluginListing};
use std::sync::Arc;
use tokio::sync::mpsc;

/// A host with every built-in plugin registered.
pub fn host_with_builtins() -> PluginHost {
    let mut host = PluginHost::new();
    // The shm plugin is always built in (same-host shared memory, the reference plugin).
    if let Err(e) = host.register_builtin("shm", kvgate_plugin_shm::module()) {
        tracing::error!("built-in shm plugin refused: {e}");
    }
    crate::builtin_extra::register(&mut host);
    host
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

fn status_of(info: &PluginInfo, name: &str, origin: String, status: &str, reason: String) -> PluginStatus {
    PluginStatus {
        name: name.to_string(),
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

/// Load libraries and open the preferred plugins. Slot numbers are positions in the returned vector.
pub fn open_plugins(
    config: &GatewayConfig,
    events: mpsc::Sender<PluginEventMsg>,
    metrics: Arc<GatewayMetrics>,
) -> (Vec<OpenedPlugin>, Vec<PluginStatus>) {
    let mut host = host_with_builtins();
    for result in host.load_all(&config.plugins.libraries) {
        if let Err(e) = result {
            tracing::error!(reason = e.code(), "plugin library not loaded: {e}");
        }
    }
    let mut opened = Vec::new();
    let mut outcomes = Vec::new();
    for name in &config.plugins.preference {
        let slot = PluginSlot(opened.len() as u32);
        let tx = events.clone();
        let dropped = metrics.clone();
        let sink = sink_from_fn(move |event| {
            // Never block a plugin thread: a full queue drops the event, counted; the core's
            // plugin grace then ends the transfer.
            if tx.try_send((slot, event)).is_err() {
                dropped.plugin_events_dropped.inc();
            }
        });
        let plugin_config = config.plugins.config.get(name).map(|t| toml::to_string(t).unwrap_or_default()).unwrap_or_default();
        match host.open(name, &plugin_config, sink) {
            Ok(plugin) => {
                tracing::info!(plugin = %name, slot = slot.0, "plugin opened");
                opened.push(plugin);
                outcomes.push((name.clone(), Ok(())));
            }
            Err(e) => {
                tracing::warn!(plugin = %name, reason = e.code(), "plugin not opened: {e}");
                outcomes.push((name.clone(), Err(format!("{}: {e}", e.code()))));
            }
        }
    }
    let listing = describe(&host.plugins(), &outcomes);
    (opened, listing)
}
