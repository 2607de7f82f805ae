//! The gateway side of a plugin reload (`kvgate plugins reload`, `POST /plugins/reload` on the
//! admin listener, SIGHUP): read the configuration file again, refuse a change outside `[plugins]`
//! (naming the sections that need a restart), and hand the plugin part to the driver, which applies
//! it or says why not (`driver::reload`). Never changes anything itself.

use crate::channels::{DriverInput, ReloadOutcome};
use crate::config::{load_config, GatewayConfig};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// How long a reload waits for the driver to open the new instances and answer.
pub const RELOAD_TIMEOUT_MS: u64 = 30_000;

/// Re-reads the configuration the gateway was started with and asks the driver to apply it.
#[derive(Clone)]
pub struct Reloader {
    /// The `--config` file (none: started on built-in defaults, nothing to re-read).
    pub config_path: Option<PathBuf>,
    /// The configuration the gateway runs (its non-plugin part is what a reload may not change).
    pub running: Arc<GatewayConfig>,
    pub driver: mpsc::Sender<DriverInput>,
}

/// The sections of `new` (other than `[plugins]`) that differ from `running`.
pub fn sections_needing_restart(running: &GatewayConfig, new: &GatewayConfig) -> Vec<&'static str> {
    let checks: [(&'static str, bool); 9] = [
        ("gateway", running.gateway == new.gateway),
        ("engine_api", running.engine_api == new.engine_api),
        ("peer_link", running.peer_link == new.peer_link),
        ("peers", running.peers == new.peers),
        ("discovery", running.discovery == new.discovery),
        ("scheduler", running.scheduler == new.scheduler),
        ("driver", running.driver == new.driver),
        ("admin", running.admin == new.admin),
        ("log", running.log == new.log),
    ];
    let mut named: Vec<&'static str> = checks.iter().filter(|(_, same)| !same).map(|(name, _)| *name).collect();
    // A section added to the configuration later and not listed above is still caught.
    let (mut a, mut b) = (running.clone(), new.clone());
    a.plugins = Default::default();
    b.plugins = Default::default();
    if named.is_empty() && a != b {
        named.push("(a section outside plugins)");
    }
    named
}

impl Reloader {
    /// Read the file, check it, and apply its plugin part. Every refusal is logged with its reason.
    pub async fn reload(&self) -> ReloadOutcome {
        let (outcome, from_driver) = self.reload_inner().await;
        if !outcome.applied && !from_driver {
            // The driver logs and keeps its own refusals; these it is told about for `/plugins`.
            tracing::error!(
                reason = "plugin_reload_refused",
                "plugin reload refused, the running plugins stay in service: {}",
                outcome.error
            );
            let _ = self.driver.send(DriverInput::ReloadRefused(outcome.clone())).await;
        }
        outcome
    }

    /// The outcome, and whether the driver gave it.
    async fn reload_inner(&self) -> (ReloadOutcome, bool) {
        let refused = |error: String| (ReloadOutcome::refused(error), false);
        let Some(path) = &self.config_path else {
            return refused("the gateway was started without --config: there is no file to read again".into());
        };
        let new = match load_config(Some(path)) {
            Ok(c) => c,
            Err(e) => return refused(format!("{}: {}", path.display(), e.to_string().trim_end())),
        };
        let restart = sections_needing_restart(&self.running, &new);
        if !restart.is_empty() {
            return refused(format!(
                "{} changed outside [plugins]: [{}] need a restart of the gateway; nothing was applied",
                path.display(),
                restart.join("], [")
            ));
        }
        let (tx, rx) = oneshot::channel();
        if self.driver.send(DriverInput::ReloadPlugins(Box::new(new.plugins), tx)).await.is_err() {
            return refused("the gateway is stopping".into());
        }
        match tokio::time::timeout(Duration::from_millis(RELOAD_TIMEOUT_MS), rx).await {
            Ok(Ok(outcome)) => (outcome, true),
            Ok(Err(_)) => refused("the gateway is stopping".into()),
            Err(_) => refused(format!(
                "no answer from the driver within {RELOAD_TIMEOUT_MS} ms (the reload may still complete: see /plugins)"
            )),
        }
    }
}

/// One line saying what a reload did (the CLI prints it; the log says the same).
pub fn describe(outcome: &ReloadOutcome) -> String {
    if !outcome.applied {
        return format!("plugin reload refused (the running plugins stay in service): {}", outcome.error);
    }
    let list = |v: &[String]| if v.is_empty() { "-".to_string() } else { v.join(", ") };
    format!(
        "plugin reload applied: opened {}; kept {}; retired {} (each closes once drained); preference {}",
        list(&outcome.opened),
        list(&outcome.kept),
        list(&outcome.retired),
        list(&outcome.preference)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::load_config_from_str;

    #[test]
    fn only_a_change_outside_plugins_needs_a_restart_and_each_section_is_named() {
        let running = load_config_from_str("[plugins]\npreference = [\"shm\"]\n").unwrap();
        let plugins_only =
            load_config_from_str("[plugins]\npreference = [\"quic\", \"shm\"]\n[plugins.config.shm]\nworkers = 2\n")
                .unwrap();
        assert!(sections_needing_restart(&running, &plugins_only).is_empty());
        let other = load_config_from_str(
            "[plugins]\npreference = [\"shm\"]\n[peer_link]\nheartbeat_misses = 7\n[gateway]\nname = \"other\"\n",
        )
        .unwrap();
        assert_eq!(sections_needing_restart(&running, &other), ["gateway", "peer_link"]);
    }
}
