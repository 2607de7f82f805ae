//! Plugin reload: apply the plugin part of a newly read configuration (libraries, preference,
//! per-plugin settings) while rooms move. Everything that can refuse is checked before anything
//! changes: a library that does not load, an ABI mismatch, an invalid setting, a plugin that reports
//! unavailable, a limit (`plugins.max_mapped_libraries`, `MAX_PLUGIN_INSTANCES`) leaves the running
//! instances in service and says why. Then new instances open beside the old ones, peers learn them
//! over their links (`PluginsChanged`, then the regions' new keys), new rooms go to them, and each
//! retired instance closes once it holds nothing, its plugin reports nothing live, and every peer
//! connected with it has applied the change (or after `plugins.drain_timeout_ms`).
//! Libraries loaded through abi_stable are never unloaded: a closed instance's library stays mapped.

use super::instances::{Instance, InstanceState};
use super::Driver;
use crate::channels::admin::unix_ms;
pub use crate::channels::ReloadOutcome;
use crate::config::{PluginsSection, MAX_PLUGIN_INSTANCES};
use crate::plugin_setup;
use kvgate_abi::PeerId;
use kvgate_client::proto::peer_frame::Frame;
use kvgate_core::{PeerPlugin, PluginSlot, RoomState};
use kvgate_host::OpenedPlugin;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A file's (device, inode): a library rebuilt in place at a mapped path has another.
pub type FileIdentity = (u64, u64);

pub fn file_identity(path: &Path) -> FileIdentity {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).map_or((0, 0), |m| (m.dev(), m.ino()))
}

/// The instances a reload opens: plugin name, config text, origin.
struct ToOpen {
    name: String,
    config_text: String,
    origin: String,
}

impl Driver {
    pub(super) fn reload_plugins(&mut self, plugins: PluginsSection) -> ReloadOutcome {
        let outcome = match self.try_reload(plugins) {
            Ok(outcome) => {
                tracing::info!(opened = ?outcome.opened, kept = ?outcome.kept, retired = ?outcome.retired, preference = ?outcome.preference, "plugin reload applied");
                outcome
            }
            Err(error) => {
                tracing::error!(
                    reason = "plugin_reload_refused",
                    "plugin reload refused, the running plugins stay in service: {error}"
                );
                ReloadOutcome::refused(error)
            }
        };
        self.last_reload = Some(outcome.clone());
        outcome
    }

    fn active_slot(&self, name: &str) -> Option<usize> {
        (0..self.plugins.len()).find(|&s| self.instances[s].is_active() && self.plugins[s].name() == name)
    }

    /// Check the libraries against `plugins.max_mapped_libraries` and in-place rebuilds; returns
    /// the libraries this reload maps for the first time.
    fn libraries_to_map(&self, plugins: &PluginsSection) -> Result<Vec<(std::path::PathBuf, FileIdentity)>, String> {
        let mut new_maps = Vec::new();
        for library in &plugins.libraries {
            let canonical =
                std::fs::canonicalize(library).map_err(|e| format!("plugins.libraries: {library}: not_found: {e}"))?;
            let identity = file_identity(&canonical);
            match self.mapped_libraries.get(&canonical) {
                Some(known) if *known != identity => {
                    return Err(format!(
                        "plugins.libraries: {library} was rebuilt in place: a mapped library is never unloaded, so a new build needs a new path (copy it beside the old one)"
                    ))
                }
                Some(_) => {}
                None if new_maps.iter().any(|(p, _)| *p == canonical) => {}
                None => new_maps.push((canonical, identity)),
            }
        }
        let limit = plugins.max_mapped_libraries as usize;
        if self.mapped_libraries.len() + new_maps.len() > limit {
            return Err(format!(
                "plugins.max_mapped_libraries = {limit}: {} libraries are mapped and this reload would map {} more (libraries are never unloaded; restart the gateway to start afresh)",
                self.mapped_libraries.len(),
                new_maps.len()
            ));
        }
        Ok(new_maps)
    }

    fn try_reload(&mut self, plugins: PluginsSection) -> Result<ReloadOutcome, String> {
        let new_maps = self.libraries_to_map(&plugins)?;
        let (host, failures) = plugin_setup::host_for_reload(&plugins.libraries);
        // What loaded is mapped for good, whatever happens next.
        for (path, identity) in new_maps {
            if host.plugins().iter().any(|l| l.status.is_ok() && l.origin.to_string() == path.display().to_string()) {
                self.mapped_libraries.insert(path, identity);
            }
        }
        if !failures.is_empty() {
            return Err(failures.join("; "));
        }
        let mut candidate = (*self.config).clone();
        candidate.plugins = plugins.clone();
        let findings = plugin_setup::check_plugin_configs(&candidate, &host);
        if !findings.errors.is_empty() {
            return Err(findings.errors.join("; "));
        }
        let listing = host.plugins();
        let mut kept = Vec::new();
        let mut to_open = Vec::new();
        for name in &plugins.preference {
            let config_text = plugin_setup::plugin_config_text_of(&plugins, name);
            let origin = listing
                .iter()
                .find(|l| &l.name == name && l.status.is_ok())
                .map(|l| l.origin.to_string())
                .unwrap_or_default();
            match self.active_slot(name) {
                Some(slot)
                    if self.instances[slot].config_text == config_text && self.instances[slot].origin == origin =>
                {
                    kept.push(slot)
                }
                _ => to_open.push(ToOpen { name: name.clone(), config_text, origin }),
            }
        }
        let retire: Vec<usize> =
            (0..self.plugins.len()).filter(|s| self.instances[*s].is_active() && !kept.contains(s)).collect();
        if self.plugins.len() + to_open.len() > MAX_PLUGIN_INSTANCES {
            return Err(format!(
                "this process has opened {} plugin instances and may open {MAX_PLUGIN_INSTANCES} in its life; restart the gateway to reload again",
                self.plugins.len()
            ));
        }
        let opened = self.open_new_instances(&host, &to_open)?;
        Ok(self.commit_reload(candidate, &host, kept, retire, opened, to_open))
    }

    /// Open every instance of `to_open`, each with the next slot. On any failure, close those
    /// opened (their slots stay used, closed: a late event of theirs can never reach another).
    fn open_new_instances(
        &mut self,
        host: &kvgate_host::PluginHost,
        to_open: &[ToOpen],
    ) -> Result<Vec<OpenedPlugin>, String> {
        let base = self.plugins.len();
        let mut opened: Vec<OpenedPlugin> = Vec::new();
        let mut failure = None;
        for (i, want) in to_open.iter().enumerate() {
            let slot = PluginSlot((base + i) as u32);
            let sink = plugin_setup::slot_sink(slot, self.plugin_events.clone(), self.metrics.clone());
            match host.open(&want.name, &want.config_text, sink) {
                Ok(plugin) if plugin.transport().stats().healthy == 0 => {
                    opened.push(plugin);
                    failure = Some(format!("plugin {}: opened unhealthy", want.name));
                    break;
                }
                Ok(plugin) => opened.push(plugin),
                Err(e) => {
                    failure = Some(format!("plugin {}: {}: {e}", want.name, e.code()));
                    break;
                }
            }
        }
        let Some(failure) = failure else { return Ok(opened) };
        for (plugin, want) in opened.into_iter().zip(to_open) {
            let plugin = plugin.into_closed();
            let generation = self.next_generation(&want.name);
            let mut instance = Instance::new(&want.name, generation, want.config_text.clone(), want.origin.clone());
            instance.state = InstanceState::Closed;
            instance.closed_reason = "reload_refused".into();
            self.push_instance(plugin, instance);
        }
        Err(failure)
    }

    fn next_generation(&self, name: &str) -> u32 {
        self.plugins
            .iter()
            .zip(&self.instances)
            .filter(|(p, _)| p.name() == name)
            .map(|(_, i)| i.generation)
            .max()
            .unwrap_or(0)
            + 1
    }

    fn push_instance(&mut self, plugin: OpenedPlugin, instance: Instance) {
        self.plugin_names.push(instance.wire_name.clone());
        self.instances.push(instance);
        self.plugin_unhealthy.push(None);
        self.plugins.push(plugin);
        for state in self.peers.by_session.values_mut() {
            state.refresh_partner_names(self.plugins.len());
        }
    }

    fn commit_reload(
        &mut self,
        candidate: crate::config::GatewayConfig,
        host: &kvgate_host::PluginHost,
        kept: Vec<usize>,
        retire: Vec<usize>,
        opened: Vec<OpenedPlugin>,
        to_open: Vec<ToOpen>,
    ) -> ReloadOutcome {
        self.plugin_change_seq += 1;
        let change = self.plugin_change_seq;
        for &slot in &retire {
            self.instances[slot].state = InstanceState::Draining { since: Instant::now(), change };
        }
        let mut new_slots = Vec::new();
        for (plugin, want) in opened.into_iter().zip(&to_open) {
            let generation = self.next_generation(&want.name);
            new_slots.push(self.plugins.len());
            tracing::info!(plugin = %want.name, generation, slot = self.plugins.len(), origin = %want.origin, "plugin instance opened by a reload");
            self.push_instance(
                plugin,
                Instance::new(&want.name, generation, want.config_text.clone(), want.origin.clone()),
            );
        }
        let opened_names: Vec<(String, Result<(), String>)> = to_open
            .iter()
            .map(|w| (w.name.clone(), Ok(())))
            .chain(kept.iter().map(|&s| (self.plugins[s].name().to_string(), Ok(()))))
            .collect();
        self.plugin_listing = plugin_setup::describe(&host.plugins(), &opened_names);
        self.config = Arc::new(candidate);
        self.register_regions_with(&new_slots);
        self.announce_plugin_change();
        let names = |slots: &[usize]| slots.iter().map(|&s| self.instances[s].wire_name.clone()).collect::<Vec<_>>();
        ReloadOutcome {
            applied: true,
            error: String::new(),
            opened: names(&new_slots),
            kept: names(&kept),
            retired: names(&retire),
            preference: self.config.plugins.preference.clone(),
            at_unix_ms: unix_ms(),
        }
    }

    /// After this gateway's instances changed: advertise them, pair every session again, tell each
    /// peer (the change, then every region with its keys now).
    fn announce_plugin_change(&mut self) {
        self.advertised.set(self.advertised_plugins());
        for session in self.peers.sessions() {
            self.repair_session(session);
            self.send_plugins_changed(session);
            if let Some(state) = self.peers.by_session.get_mut(&session) {
                for announce in self.regions.announcements() {
                    state.send_frame(Frame::RegionAnnounce(announce.clone()), &self.metrics);
                }
            }
        }
    }

    /// Pair `session` again and tell the core; keys are imported into instances paired anew.
    pub(super) fn repair_session(&mut self, session: u64) {
        let now = self.now();
        let Some(state) = self.peers.by_session.get(&session) else { return };
        let before: Vec<(PluginSlot, String)> = state.partner.iter().map(|(s, w)| (*s, w.clone())).collect();
        let (offered, retired) = self.pair_session(session);
        let Some(state) = self.peers.by_session.get(&session) else { return };
        let changed: Vec<PluginSlot> = state
            .partner
            .iter()
            .filter(|(s, w)| !before.iter().any(|(bs, bw)| bs == *s && bw == *w))
            .map(|(s, _)| *s)
            .collect();
        let (name, incarnation) = (state.name.clone(), state.incarnation);
        self.import_announced(session, &changed);
        if self.peers.current(&name) == Some(PeerId(session)) {
            self.core.handle_peer_plugins(now, PeerId(session), &offered, &retired);
        } else if !offered.is_empty() {
            // No plugin reached this peer before; one does now.
            self.peers.set_current(&name, session);
            self.core.handle_peer_up_with(now, PeerId(session), incarnation, &offered);
            self.import_announced(session, &offered.iter().map(|p| p.slot).collect::<Vec<_>>());
        }
        let offered_names: Vec<&str> =
            offered.iter().map(|p: &PeerPlugin| self.instances[p.slot.0 as usize].wire_name.as_str()).collect();
        tracing::info!(peer = %name, offered = ?offered_names, retired = retired.len(), "peer plugins paired again");
        if offered.is_empty() {
            tracing::error!(peer = %name, "no plugin usable with this peer after the plugin change: new rooms with it will be refused (peer_not_connected)");
        }
    }

    /// Close every draining instance that holds nothing any more (or past `plugins.drain_timeout_ms`).
    pub(super) fn close_drained_instances(&mut self) {
        let draining: Vec<(usize, Instant, u64)> = self
            .instances
            .iter()
            .enumerate()
            .filter_map(|(s, i)| match i.state {
                InstanceState::Draining { since, change } => Some((s, since, change)),
                _ => None,
            })
            .collect();
        if draining.is_empty() {
            return;
        }
        let now = self.now();
        let mut rooms_on = vec![0u64; self.plugins.len()];
        for view in self.core.rooms(now) {
            if matches!(view.state, RoomState::Succeeded | RoomState::Failed) {
                continue;
            }
            if let Some(slot) = view.plugin.filter(|s| (s.0 as usize) < rooms_on.len()) {
                rooms_on[slot.0 as usize] += 1;
            }
        }
        let timeout = Duration::from_millis(self.config.plugins.drain_timeout_ms);
        for (slot, since, change) in draining {
            let stats = self.plugins[slot].transport().stats();
            let live = stats.live_transfers + stats.unquiesced_transfers + stats.live_tickets;
            let unacked = self
                .peers
                .by_session
                .values()
                .filter(|s| s.acked_change_seq < change && s.links.iter().any(|(l, _)| l.0 as usize == slot))
                .count();
            if rooms_on[slot] == 0 && live == 0 && unacked == 0 {
                self.close_instance(slot, "drained");
            } else if since.elapsed() >= timeout {
                tracing::warn!(
                    plugin = %self.instances[slot].wire_name, rooms = rooms_on[slot], live, unacked_peers = unacked,
                    drain_timeout_ms = self.config.plugins.drain_timeout_ms, reason = "drain_timeout",
                    "a retired plugin instance did not drain in time: shut down with what it still holds (those transfers fail)"
                );
                self.close_instance(slot, "drain_timeout");
            }
        }
    }

    /// Close instance `slot`: drop its connections and keys, deregister regions, shut it down, and
    /// tell the peers.
    pub(super) fn close_instance(&mut self, slot: usize, reason: &str) {
        let plugin_slot = PluginSlot(slot as u32);
        let transport = self.plugins[slot].transport_arc();
        for state in self.peers.by_session.values_mut() {
            let links: Vec<(PluginSlot, String)> =
                state.links.iter().filter(|(s, _)| *s == plugin_slot).cloned().collect();
            for link in links {
                if let Some(id) = state.remote_ids.get(&link.1) {
                    transport.disconnect(*id);
                }
                state.links.remove(&link);
            }
            state.partner.remove(&plugin_slot);
            let keys: Vec<(u64, PluginSlot)> =
                state.remote_keys.keys().filter(|(_, s)| *s == plugin_slot).copied().collect();
            for entry in keys {
                state.key_source.remove(&entry);
                if let Some(key) = state.remote_keys.remove(&entry) {
                    transport.release_remote_key(key);
                }
            }
            state.superseded_keys.retain(|(s, key)| {
                *s != plugin_slot || {
                    transport.release_remote_key(*key);
                    false
                }
            });
            state.key_routes.retain(|(s, _), _| *s != plugin_slot);
        }
        self.ticket_routes.retain(|(s, _), _| *s != plugin_slot);
        self.deregister_regions_from(plugin_slot);
        self.instances[slot].state = InstanceState::Closed;
        self.instances[slot].closed_reason = reason.to_string();
        drop(transport);
        // Shut down, and its transport object dropped: its threads, sockets and buffers go.
        let placeholder = self.plugins[slot].clone();
        self.plugins[slot] = std::mem::replace(&mut self.plugins[slot], placeholder).into_closed();
        tracing::info!(plugin = %self.instances[slot].wire_name, generation = self.instances[slot].generation, reason, "plugin instance shut down (its library stays mapped)");
        self.plugin_change_seq += 1;
        self.announce_plugin_change();
    }
}

impl Driver {
    /// An instance reported a dead worker: stop offering it, and restart it after the back-off or,
    /// past the restart limit, leave it down (see `supervision`).
    pub(super) fn supervise(&mut self, slot: usize) {
        if !self.instances.get(slot).is_some_and(|i| i.is_active())
            || self.pending_restarts.iter().any(|(_, s)| *s == slot)
            || self.restart_given_up.contains_key(&slot)
        {
            return;
        }
        for session in self.peers.sessions() {
            self.repair_session(session);
        }
        self.schedule_restart(slot);
    }

    fn schedule_restart(&mut self, slot: usize) {
        let name = self.plugins[slot].name().to_string();
        let limits = super::supervision::RestartLimits::of(&self.config.plugins);
        match self.restart_history.entry(name.clone()).or_default().decide(Instant::now(), limits) {
            super::supervision::Decision::RestartAfter { backoff, attempt } => {
                tracing::warn!(plugin = %self.instances[slot].wire_name, backoff_ms = backoff.as_millis() as u64, attempt, max_attempts = limits.max_attempts, "plugin instance unhealthy: its rooms failed; restarting it after the back-off");
                self.pending_restarts.push((Instant::now() + backoff, slot));
            }
            super::supervision::Decision::GiveUp(why) => {
                tracing::error!(plugin = %self.instances[slot].wire_name, reason = "plugin_restart_limit", "plugin instance unhealthy and not restarted: {why}");
                self.restart_given_up.insert(slot, why);
            }
        }
    }

    /// Restart every instance whose back-off has passed.
    pub(super) fn restart_due_instances(&mut self) {
        let now = Instant::now();
        let due: Vec<usize> = self.pending_restarts.iter().filter(|(at, _)| *at <= now).map(|(_, s)| *s).collect();
        self.pending_restarts.retain(|(at, _)| *at > now);
        for slot in due {
            self.restart_instance(slot);
        }
    }

    /// Open a new generation of `slot`'s plugin with its settings, then close `slot`.
    fn restart_instance(&mut self, slot: usize) {
        if !self.instances[slot].is_active() {
            return;
        }
        let want = ToOpen {
            name: self.plugins[slot].name().to_string(),
            config_text: self.instances[slot].config_text.clone(),
            origin: self.instances[slot].origin.clone(),
        };
        let (host, _) = plugin_setup::host_for_reload(&self.config.plugins.libraries);
        match self.open_new_instances(&host, std::slice::from_ref(&want)) {
            Ok(opened) => {
                let new_slot = self.plugins.len();
                let generation = self.next_generation(&want.name);
                for plugin in opened {
                    self.push_instance(
                        plugin,
                        Instance::new(&want.name, generation, want.config_text.clone(), want.origin.clone()),
                    );
                }
                tracing::info!(plugin = %want.name, generation, replaces = %self.instances[slot].wire_name, "plugin instance restarted");
                self.register_regions_with(&[new_slot]);
                self.close_instance(slot, "restarted");
            }
            Err(error) => {
                tracing::error!(plugin = %self.instances[slot].wire_name, reason = "plugin_restart_failed", "plugin restart failed: {error}");
                self.schedule_restart(slot);
            }
        }
    }
}
