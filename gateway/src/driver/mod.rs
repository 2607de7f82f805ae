//! The driver: one tokio task per core instance. It owns the `Core`, the clock origin, the opened
//! plugins, local regions and peer sessions; it feeds the core (engine calls, peer frames, plugin
//! events, one timer re-armed from `poll_timeout()`) and executes its commands. It never awaits the
//! network while holding the core: peer frames go out through non-blocking queues, plugin calls are
//! non-blocking by contract, and engine replies are oneshot sends.

mod commands;
mod engine;
mod outbox;
mod peers;
mod region_use;
mod regions;
mod session_calls;
pub mod sessions;
mod shutdown;
mod stuck;
mod views;

pub use engine::{ApiError, EngineCall, ExpectCall, MemorySpec, Registered, Reply, SendCall};
pub use views::{AdminSnapshot, PeerStatus, PluginStatus, RoomJson};

use crate::config::GatewayConfig;
use crate::metrics::GatewayMetrics;
use crate::peer_link::PeerEvent;
use kvgate_abi::{Event, EventKind};
use kvgate_core::{Core, Nanos, PluginSlot, Role, RoomKey, ViolationClause};
use kvgate_host::OpenedPlugin;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

/// Everything the driver is asked, except plugin events (which have their own queue).
pub enum DriverInput {
    Engine(EngineCall),
    Peer(PeerEvent),
    Admin(oneshot::Sender<AdminSnapshot>),
    /// Stop: shut the plugins down and return.
    Shutdown,
}

/// A plugin event, tagged with the slot of the instance that delivered it.
pub type PluginEventMsg = (PluginSlot, Event);

/// What the driver needs at start.
pub struct DriverParts {
    pub config: Arc<GatewayConfig>,
    pub core: Core,
    pub plugins: Vec<OpenedPlugin>,
    pub plugin_listing: Vec<PluginStatus>,
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
    /// Each plugin's name, by slot: how peer messages name a plugin on the wire.
    plugin_names: Vec<String>,
    plugin_listing: Vec<PluginStatus>,
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
    /// Per live room: when this driver first saw it, when it started moving bytes, stuck warnings given.
    room_clock: foldhash::HashMap<(RoomKey, Role), RoomClock>,
    /// Rooms waiting for their next stuck-room warning age.
    stuck: stuck::StuckQueues,
    /// Plugin contract violations already logged, by `ViolationClause::ALL` index.
    violations_logged: [u64; ViolationClause::ALL.len()],
    /// `Metrics::illegal_transitions` already logged.
    illegal_transitions_logged: u64,
    /// The plugin event behind the latest violation of each clause, when one was (by the same index).
    violation_sites: [Option<ViolationSite>; ViolationClause::ALL.len()],
    /// After a stall: deadlines are acted on only from this instant (see `driver.stall_catch_up_ms`).
    catch_up_until: Option<Instant>,
}

/// Where a violation came from: the plugin, the event and the room its transfer belongs to.
#[derive(Clone, Debug)]
struct ViolationSite {
    plugin: String,
    kind: &'static str,
    xfer: u64,
    room: Option<(RoomKey, Role)>,
}

#[derive(Clone, Copy, Debug, Default)]
struct RoomClock {
    first_seen: Nanos,
    transfer_started: Option<Nanos>,
}

impl Driver {
    pub fn new(parts: DriverParts) -> Driver {
        let slots = parts.plugins.len();
        let admin = &parts.config.admin;
        let stuck = stuck::StuckQueues::new(&admin.stuck_room_warn_ms, admin.stuck_room_warn_lines_per_s, Nanos(0));
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
            plugins: parts.plugins,
            plugin_listing: parts.plugin_listing,
            plugin_unhealthy: vec![None; slots],
            watch: parts.watch,
            metrics: parts.metrics,
            feedback: VecDeque::new(),
            room_clock: Default::default(),
            stuck,
            violations_logged: [0; ViolationClause::ALL.len()],
            illegal_transitions_logged: 0,
            violation_sites: Default::default(),
            catch_up_until: None,
        }
    }

    fn now(&self) -> Nanos {
        Nanos(self.origin.elapsed().as_nanos() as u64)
    }

    fn instant_of(&self, at: Nanos) -> Instant {
        self.origin + Duration::from_nanos(at.0)
    }

    /// Runs until `Shutdown` or every input sender is gone.
    pub async fn run(mut self, mut inputs: mpsc::Receiver<DriverInput>, mut plugin_events: mpsc::Receiver<PluginEventMsg>) {
        let mut housekeeping = tokio::time::interval(Duration::from_millis(HOUSEKEEPING_INTERVAL_MS));
        housekeeping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let per_step = self.config.driver.inputs_per_step.max(1);
        loop {
            let wake = self.core.poll_timeout().map(|t| self.instant_of(t).max(self.catch_up_until.unwrap_or(Instant::now())));
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

    fn on_plugin_event(&mut self, slot: PluginSlot, event: Event) {
        if event.kind == EventKind::UNHEALTHY {
            let reason = format!("{}: {}", event.reason, event.message);
            tracing::error!(plugin = self.plugin_name(slot), reason = %event.reason, "plugin unhealthy: {}", event.message);
            if let Some(h) = self.plugin_unhealthy.get_mut(slot.0 as usize) {
                *h = Some(reason);
            }
        }
        self.feed_plugin_event(slot, &event);
    }

    /// Hand a plugin event to the core, noting which event a violation it counts came from.
    fn feed_plugin_event(&mut self, slot: PluginSlot, event: &Event) {
        let before = self.core.metrics().violations;
        let now = self.now();
        self.core.handle_plugin_event(now, slot, event);
        let after = &self.core.metrics().violations;
        if *after == before {
            return;
        }
        let site = ViolationSite {
            plugin: self.plugin_name(slot).to_string(),
            kind: event.kind.as_str(),
            xfer: event.xfer.0,
            room: self.core.room_of_xfer(event.xfer),
        };
        for (i, (a, b)) in after.iter().zip(before.iter()).enumerate() {
            if a != b {
                self.violation_sites[i] = Some(site.clone());
            }
        }
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

    /// One warning per clause for the plugin contract violations the core counted since the last
    /// call (the core counts them in `kvgate_plugin_contract_violations_total`; the log says so too).
    /// Called from housekeeping, so a plugin flooding bad events costs at most one line per clause
    /// each `HOUSEKEEPING_INTERVAL_MS`, never one per event.
    fn log_new_violations(&mut self) {
        let metrics = self.core.metrics();
        if metrics.illegal_transitions != self.illegal_transitions_logged {
            let new = metrics.illegal_transitions - self.illegal_transitions_logged;
            let latest = metrics.latest_illegal_transition.map(|t| t.to_string()).unwrap_or_default();
            tracing::error!(new, total = metrics.illegal_transitions, latest = %latest, "core transition table refused an input (a kvgate bug; the room kept its state)");
            self.illegal_transitions_logged = metrics.illegal_transitions;
        }
        if metrics.violations_total() == self.violations_logged.iter().sum::<u64>() {
            return;
        }
        for (i, clause) in ViolationClause::ALL.iter().enumerate() {
            let (total, logged) = (metrics.violation(*clause), self.violations_logged[i]);
            if total == logged {
                continue;
            }
            let site = self.violation_sites[i].take().or_else(|| self.silent_site(*clause));
            match site {
                Some(site) => {
                    let (room, role) = match site.room {
                        Some((key, role)) => (key.to_string(), role.as_str()),
                        None => ("-".to_string(), "-"),
                    };
                    tracing::warn!(
                        clause = clause.as_str(), new = total - logged, total, plugin = %site.plugin, event = site.kind,
                        xfer = site.xfer, room = %room, role, "plugin contract violation (the latest named)"
                    );
                }
                None => tracing::warn!(clause = clause.as_str(), new = total - logged, total, "plugin contract violation"),
            }
            self.violations_logged[i] = total;
        }
    }

    /// For `plugin_silent`, which the core finds on a timer rather than in a plugin event: the latest
    /// transfer it forced failed, named like an event's site.
    fn silent_site(&self, clause: ViolationClause) -> Option<ViolationSite> {
        if clause != ViolationClause::PluginSilent {
            return None;
        }
        let silent = self.core.latest_silent_transfer()?;
        Some(ViolationSite {
            plugin: silent.plugin.map_or("?", |slot| self.plugin_name(slot)).to_string(),
            kind: "none",
            xfer: silent.xfer.0,
            room: Some((silent.room, silent.role)),
        })
    }

    fn plugin_name(&self, slot: PluginSlot) -> &str {
        self.plugins.get(slot.0 as usize).map(|p| p.name()).unwrap_or("?")
    }

    fn housekeeping(&mut self) {
        self.warn_stuck_rooms();
        self.log_new_violations();
        self.end_expired_sessions();
    }
}
