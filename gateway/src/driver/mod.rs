//! The driver: one tokio task per core instance. It owns the `Core`, the clock origin, the opened
//! plugins, local regions and peer sessions; it feeds the core (engine calls, peer frames, plugin
//! events, one timer re-armed from `poll_timeout()`) and executes its commands. It never awaits the
//! network while holding the core: peer frames go out through non-blocking queues, plugin calls are
//! non-blocking by contract, and engine replies are oneshot sends.

mod commands;
mod engine;
pub mod instances;
mod outbox;
mod pairing;
mod peers;
mod region_use;
mod regions;
pub mod reload;
mod session_calls;
pub mod sessions;
mod shutdown;
mod stuck;
pub mod supervision;
mod views;
mod violations;

use crate::channels::{DriverInput, PluginEventMsg, PluginStatus};
use crate::config::GatewayConfig;
use crate::metrics::GatewayMetrics;
use crate::plugin_setup;
use kvgate_abi::{Event, EventKind};
use kvgate_core::{At, Core, PluginSlot};
use kvgate_host::OpenedPlugin;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// What the driver needs at start.
pub struct DriverParts {
    pub config: Arc<GatewayConfig>,
    pub core: Core,
    pub plugins: Vec<OpenedPlugin>,
    pub plugin_listing: Vec<PluginStatus>,
    /// Where opened instances send their events (a plugin reload opens new ones on it).
    pub plugin_events: mpsc::Sender<PluginEventMsg>,
    /// The plugin instances every Hello advertises (a plugin reload changes them).
    pub advertised: crate::peer_link::AdvertisedPlugins,
    pub watch: crate::engine_api::WatchFeed,
    pub metrics: Arc<GatewayMetrics>,
    /// The peers this gateway knows (static and discovered), shared with the peer links.
    pub directory: Arc<crate::peer_link::PeerDirectory>,
}

/// How often the driver pops due stuck-room warnings (`stuck.rs`) and logs new plugin contract
/// violations.
pub const HOUSEKEEPING_INTERVAL_MS: u64 = 250;

pub struct Driver {
    core: Core,
    origin: Instant,
    config: Arc<GatewayConfig>,
    plugins: Vec<OpenedPlugin>,
    /// Each instance's wire name, by slot: how peer messages name a plugin instance on the wire.
    plugin_names: Vec<String>,
    /// Generation and lifecycle of each instance, by slot.
    instances: Vec<instances::Instance>,
    plugin_listing: Vec<PluginStatus>,
    plugin_events: mpsc::Sender<PluginEventMsg>,
    advertised: crate::peer_link::AdvertisedPlugins,
    /// Plugin peer ids above `pairing::VIRTUAL_PEER_BASE` handed out so far, and their sessions.
    next_plugin_peer_id: u64,
    plugin_peer_sessions: HashMap<u64, u64>,
    /// Tickets opened for a plugin peer id other than their session's: where to revoke them.
    ticket_routes: HashMap<(PluginSlot, kvgate_abi::Ticket), kvgate_abi::PeerId>,
    /// How many plugin changes (reloads, closed instances) this gateway made.
    plugin_change_seq: u64,
    /// Libraries mapped by this process (never unmapped), by canonical path, with the file's
    /// identity when mapped (a file rebuilt in place at a mapped path cannot be loaded again).
    mapped_libraries: std::collections::BTreeMap<std::path::PathBuf, (u64, u64)>,
    /// The latest plugin reload's outcome, for `/plugins`.
    last_reload: Option<reload::ReloadOutcome>,
    /// Restarts of dead instances, by plugin name; restarts waiting for their back-off (when, slot);
    /// instances past the restart limit, with why (by slot).
    restart_history: HashMap<String, supervision::RestartHistory>,
    pending_restarts: Vec<(std::time::Instant, usize)>,
    restart_given_up: HashMap<usize, String>,
    /// `Some(reason)` once a plugin reported itself unhealthy.
    plugin_unhealthy: Vec<Option<String>>,
    regions: regions::Regions,
    /// Which rooms hold which local regions (an unregister of a held region is refused).
    region_use: region_use::RegionUse,
    /// Engine sessions and what they own.
    sessions: sessions::Sessions,
    /// Regions of ended sessions, released once no room holds them.
    orphan_regions: std::collections::BTreeSet<u64>,
    peers: peers::Peers,
    directory: Arc<crate::peer_link::PeerDirectory>,
    watch: crate::engine_api::WatchFeed,
    metrics: Arc<GatewayMetrics>,
    /// Plugin events produced by the driver itself (a submit refused synchronously), fed back in order.
    feedback: VecDeque<PluginEventMsg>,
    /// Rooms waiting for their next stuck-room warning age.
    stuck: stuck::StuckQueues,
    /// Plugin contract violations reported by the core and not yet logged.
    violation_log: violations::ViolationLog,
    /// After a stall: deadlines are acted on only from this instant (see `driver.stall_catch_up_ms`).
    catch_up_until: Option<Instant>,
}

impl Driver {
    pub fn new(parts: DriverParts) -> Driver {
        let slots = parts.plugins.len();
        let instances = parts
            .plugins
            .iter()
            .map(|p| {
                instances::Instance::new(
                    p.name(),
                    1,
                    plugin_setup::plugin_config_text_of(&parts.config.plugins, p.name()),
                    p.origin().to_string(),
                )
            })
            .collect();
        let admin = &parts.config.admin;
        let stuck = stuck::StuckQueues::new(&admin.stuck_room_warn_ms, admin.stuck_room_warn_lines_per_s, At::ZERO);
        Driver {
            core: parts.core,
            origin: Instant::now(),
            regions: regions::Regions::new(parts.config.engine_api.max_regions),
            region_use: region_use::RegionUse::default(),
            sessions: sessions::Sessions::default(),
            orphan_regions: Default::default(),
            peers: peers::Peers::default(),
            directory: parts.directory,
            config: parts.config,
            plugin_names: parts.plugins.iter().map(|p| p.name().to_string()).collect(),
            instances,
            mapped_libraries: parts
                .plugins
                .iter()
                .filter_map(|p| match p.origin() {
                    kvgate_host::PluginOrigin::Library(path) => Some((path.clone(), reload::file_identity(path))),
                    _ => None,
                })
                .collect(),
            plugins: parts.plugins,
            plugin_listing: parts.plugin_listing,
            plugin_events: parts.plugin_events,
            advertised: parts.advertised,
            next_plugin_peer_id: 0,
            plugin_peer_sessions: HashMap::new(),
            ticket_routes: HashMap::new(),
            plugin_change_seq: 0,
            last_reload: None,
            restart_history: HashMap::new(),
            pending_restarts: Vec::new(),
            restart_given_up: HashMap::new(),
            plugin_unhealthy: vec![None; slots],
            watch: parts.watch,
            metrics: parts.metrics,
            feedback: VecDeque::new(),
            stuck,
            violation_log: Default::default(),
            catch_up_until: None,
        }
    }

    fn now(&self) -> At {
        At(self.origin.elapsed().as_nanos() as u64)
    }

    fn instant_of(&self, at: At) -> Instant {
        self.origin + Duration::from_nanos(at.0)
    }

    /// Runs until `Shutdown` or every input sender is gone.
    pub async fn run(
        mut self,
        mut inputs: mpsc::Receiver<DriverInput>,
        mut plugin_events: mpsc::Receiver<PluginEventMsg>,
    ) {
        let mut housekeeping = tokio::time::interval(Duration::from_millis(HOUSEKEEPING_INTERVAL_MS));
        housekeeping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let per_step = self.config.driver.inputs_per_step.max(1);
        loop {
            let wake =
                self.core.poll_timeout().map(|t| self.instant_of(t).max(self.catch_up_until.unwrap_or(Instant::now())));
            tokio::select! {
                biased;
                Some((slot, event)) = plugin_events.recv() => self.on_plugin_event(slot, event),
                input = inputs.recv() => match input {
                    Some(input) => if !self.on_input(input) { break },
                    None => break,
                },
                _ = tokio::time::sleep_until(wake.unwrap_or_else(Instant::now)), if wake.is_some() => {
                    if !self.caught_up_after_stall(wake.unwrap_or_else(Instant::now)) {
                        continue;
                    }
                    let now = self.now();
                    self.core.handle_timeout(now);
                }
                _ = housekeeping.tick() => self.housekeeping(),
            }
            self.execute_commands();
            // The rest of the step: inputs already queued, plugin events first, each executed before
            // the next is taken; then the peer messages of the whole step leave together.
            let mut stop = false;
            for _ in 1..per_step {
                if let Ok((slot, event)) = plugin_events.try_recv() {
                    self.on_plugin_event(slot, event);
                } else if let Ok(input) = inputs.try_recv() {
                    stop = !self.on_input(input);
                } else {
                    break;
                }
                self.execute_commands();
                if stop {
                    break;
                }
            }
            self.peers.flush(&self.metrics);
            if stop {
                break;
            }
        }
        self.shut_down(&mut inputs, &mut plugin_events).await;
    }

    /// One input from the queue; `false` for `Shutdown`.
    fn on_input(&mut self, input: DriverInput) -> bool {
        match input {
            DriverInput::Engine(call) => self.on_engine_call(call),
            DriverInput::Peer(event) => self.on_peer_event(event),
            DriverInput::Admin(reply) => {
                let _ = reply.send(self.snapshot());
            }
            DriverInput::ReloadPlugins(plugins, reply) => {
                let _ = reply.send(self.reload_plugins(*plugins));
            }
            DriverInput::ReloadRefused(outcome) => self.last_reload = Some(outcome),
            DriverInput::Shutdown => return false,
        }
        true
    }

    /// Whether deadlines may be acted on now, the driver having woken for one at `asked`. A wake
    /// later than `driver.stall_catch_up_ms` means this process was stopped or starved: what peers
    /// and plugins sent meanwhile is still unread, so deadlines wait that long while it is read.
    fn caught_up_after_stall(&mut self, asked: Instant) -> bool {
        let now = Instant::now();
        if let Some(until) = self.catch_up_until {
            if now < until {
                return false;
            }
            self.catch_up_until = None;
            return true;
        }
        let catch_up = Duration::from_millis(self.config.driver.stall_catch_up_ms);
        let late = now.saturating_duration_since(asked);
        if catch_up.is_zero() || late <= catch_up {
            return true;
        }
        tracing::warn!(
            late_ms = late.as_millis() as u64,
            catch_up_ms = catch_up.as_millis() as u64,
            "the gateway was stalled: reading what arrived meanwhile before acting on the deadlines that passed"
        );
        self.catch_up_until = Some(now + catch_up);
        false
    }

    fn on_plugin_event(&mut self, slot: PluginSlot, mut event: Event) {
        // A plugin names a peer's instance by its plugin peer id; the core knows the session.
        if event.peer.0 != 0 {
            if event.kind == EventKind::PEER_DOWN && self.plugin_peer_is_leaving(event.peer) {
                tracing::info!(
                    plugin = self.plugin_name(slot),
                    peer = event.peer.0,
                    "a retiring peer instance went away: {}",
                    event.message
                );
                return;
            }
            event.peer = self.session_of_plugin_peer(event.peer);
        }
        if event.is_incoming() && matches!(event.kind, EventKind::INCOMING_FAILED | EventKind::QUIESCED) {
            self.ticket_routes.remove(&(slot, kvgate_abi::Ticket(event.xfer.0)));
        }
        if event.kind == EventKind::UNHEALTHY && !self.instances.get(slot.0 as usize).is_some_and(|i| i.is_open()) {
            tracing::info!(
                plugin = self.plugin_name(slot),
                "a closed plugin instance reported unhealthy: {}",
                event.message
            );
            return;
        }
        if event.kind == EventKind::UNHEALTHY {
            let reason = format!("{}: {}", event.reason, event.message);
            tracing::error!(plugin = self.plugin_name(slot), reason = %event.reason, "plugin unhealthy: {}", event.message);
            if let Some(h) = self.plugin_unhealthy.get_mut(slot.0 as usize) {
                *h = Some(reason);
            }
            self.supervise(slot.0 as usize);
        }
        self.feed_plugin_event(slot, &event);
    }

    /// Hand a plugin event to the core (a violation it finds comes back as a command).
    fn feed_plugin_event(&mut self, slot: PluginSlot, event: &Event) {
        let now = self.now();
        self.core.handle_plugin_event(now, slot, event);
    }

    /// Executes every pending command, feeding synchronous plugin refusals back, until quiet, and
    /// sends the peer messages they made.
    fn drain(&mut self) {
        self.execute_commands();
        self.peers.flush(&self.metrics);
    }

    /// Executes every pending command, feeding synchronous plugin refusals back, until quiet; peer
    /// messages wait in their session's outbox for `Peers::flush`.
    fn execute_commands(&mut self) {
        loop {
            while let Some(command) = self.core.poll_command() {
                self.execute(command);
            }
            match self.feedback.pop_front() {
                Some((slot, event)) => self.feed_plugin_event(slot, &event),
                None => break,
            }
        }
    }

    /// The wire name of the instance in `slot` (`shm`, `shm@2`).
    fn plugin_name(&self, slot: PluginSlot) -> &str {
        self.instances.get(slot.0 as usize).map(|p| p.wire_name.as_str()).unwrap_or("?")
    }

    fn housekeeping(&mut self) {
        self.restart_due_instances();
        self.close_drained_instances();
        self.warn_stuck_rooms();
        self.log_new_violations();
        self.end_expired_sessions();
    }
}
