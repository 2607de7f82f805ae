//! Gateway shutdown (CONFORMANCE RES-6): every live room ends here `aborted` (its peer is told and ends
//! `aborted_by_peer`), the driver waits up to `driver.shutdown_grace_ms` for the plugins to quiesce
//! what they had in flight, then releases every engine registration and shuts every plugin down.
//! Never returns with a room live or a region still mapped.

use super::reload;
use super::Driver;
use crate::channels::{ApiError, DriverInput, EngineCall, PluginEventMsg};
use kvgate_core::{EngineRequest, RoomKey, RoomState};
use std::collections::BTreeSet;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// What shutdown did (its last log line, which the RES-6 test reads, carries every field).
#[derive(Debug, Default)]
pub struct ShutdownReport {
    pub rooms_aborted: usize,
    pub rooms_still_quarantined: usize,
    pub regions_released: usize,
}

impl Driver {
    fn quarantined_rooms(&self) -> usize {
        let now = self.now();
        self.core.rooms(now).filter(|v| v.state == RoomState::Quarantined).count()
    }

    pub(super) async fn shut_down(
        &mut self,
        inputs: &mut mpsc::Receiver<DriverInput>,
        plugin_events: &mut mpsc::Receiver<PluginEventMsg>,
    ) -> ShutdownReport {
        let mut report = ShutdownReport::default();
        let now = self.now();
        let live: BTreeSet<RoomKey> = self.core.rooms(now).filter(|v| !v.state.is_terminal()).map(|v| v.room).collect();
        for room in &live {
            match self.core.handle_engine(now, EngineRequest::Abort { room: *room, role: None }) {
                Ok(()) => report.rooms_aborted += 1,
                Err(refusal) => {
                    tracing::warn!(room = %room, reason = refusal.reason.as_str(), "shutdown: abort refused")
                }
            }
        }
        self.drain();
        tracing::info!(rooms = report.rooms_aborted, "shutdown: every live room aborted (reason aborted; peers told)");

        // Wait (bounded) until nothing of the aborted transfers can land: the plugins' quiesced events
        // and the peers' (a receiver's room is released by its sender's `Quiesced`). Engine calls that
        // arrive meanwhile are refused.
        let deadline = Instant::now() + Duration::from_millis(self.config.driver.shutdown_grace_ms);
        while self.quarantined_rooms() > 0 && Instant::now() < deadline {
            let wake = self.core.poll_timeout().map(|t| self.instant_of(t)).map_or(deadline, |t| t.min(deadline));
            tokio::select! {
                event = plugin_events.recv() => match event {
                    Some((slot, event)) => self.on_plugin_event(slot, event),
                    None => break,
                },
                input = inputs.recv() => match input {
                    Some(DriverInput::Peer(event)) => self.on_peer_event(event),
                    Some(DriverInput::Engine(call)) => refuse_while_stopping(call),
                    Some(DriverInput::Admin(reply)) => { let _ = reply.send(self.snapshot()); }
                    Some(DriverInput::ReloadPlugins(_, reply)) => {
                        let _ = reply.send(reload::ReloadOutcome { error: "the gateway is shutting down".into(), ..Default::default() });
                    }
                    Some(DriverInput::ReloadRefused(_)) | Some(DriverInput::Shutdown) | None => {}
                },
                _ = tokio::time::sleep_until(wake) => {
                    let now = self.now();
                    self.core.handle_timeout(now);
                }
            }
            self.drain();
        }
        report.rooms_still_quarantined = self.quarantined_rooms();

        let regions: Vec<u64> = self.regions.ids().collect();
        report.regions_released = regions.len();
        if report.rooms_still_quarantined == 0 {
            // Nothing can land any more: deregister from every plugin (peers are told the region is gone).
            for id in regions {
                let _ = self.release_region(id);
            }
            self.shut_down_plugins();
        } else {
            // Something may still land: the plugins' own shutdown quiesces it before the memory goes.
            tracing::warn!(
                rooms = report.rooms_still_quarantined,
                grace_ms = self.config.driver.shutdown_grace_ms,
                "shutdown: rooms still quarantined after driver.shutdown_grace_ms; shutting the plugins down before unmapping"
            );
            self.shut_down_plugins();
            self.regions.forget_all();
        }
        tracing::info!(
            rooms_aborted = report.rooms_aborted,
            rooms_still_quarantined = report.rooms_still_quarantined,
            regions_released = report.regions_released,
            "driver stopped, plugins shut down, registrations released"
        );
        report
    }

    fn shut_down_plugins(&mut self) {
        for (plugin, instance) in self.plugins.iter().zip(&self.instances) {
            if !instance.is_open() {
                continue;
            }
            plugin.shutdown();
            tracing::info!(plugin = %plugin.name(), "plugin shut down");
        }
    }
}

fn refuse_while_stopping(call: EngineCall) {
    fn no<T>() -> Result<T, ApiError> {
        Err(ApiError::new(tonic::Code::Unavailable, "gateway_stopping", "the gateway is shutting down"))
    }
    match call {
        EngineCall::Register { reply, .. } => drop(reply.send(no())),
        EngineCall::OpenSession { reply, .. } => drop(reply.send(no())),
        EngineCall::CloseSession { reply, .. } => drop(reply.send(no())),
        EngineCall::AttachSession { reply, .. } => drop(reply.send(no())),
        EngineCall::DetachSession { .. } => {}
        EngineCall::Unregister { reply, .. } => drop(reply.send(no())),
        EngineCall::Expect { reply, .. } => drop(reply.send(no())),
        EngineCall::Send { reply, .. } => drop(reply.send(no())),
        EngineCall::ExpectBatch { reply, .. } => drop(reply.send(no())),
        EngineCall::SendBatch { reply, .. } => drop(reply.send(no())),
        EngineCall::Abort { reply, .. } => drop(reply.send(no())),
        EngineCall::GetRoom { reply, .. } => drop(reply.send(no())),
        EngineCall::ListRooms { reply, .. } => drop(reply.send(no())),
    }
}
