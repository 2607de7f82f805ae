//! Outgoing transfers and their one declared lifecycle: Live → Terminal (succeeded or failed) →
//! Closed once every lane settled (the receiver acknowledged, or the connection is gone). Owns the
//! events of each transfer: exactly one terminal event, then at most one QUIESCED; never any after Closed.

use kvgate_abi::{sdk::Sink, Event, PeerId, ReasonCode, XferId};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use tokio::sync::watch;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Submitted, not yet terminal.
    Live,
    /// Terminal event sent; some lane may still cause writes at the receiver.
    Terminal,
    /// Terminal and quiesced; nothing more will ever be reported.
    Closed,
}

struct State {
    phase: Phase,
    /// Lanes opened and not yet settled.
    lanes_unsettled: usize,
    lanes_done: usize,
    lane_count: usize,
}

/// One outgoing transfer.
pub struct Transfer {
    pub xfer: XferId,
    pub peer: PeerId,
    pub total_bytes: u64,
    state: Mutex<State>,
    /// Becomes true at the terminal transition; lanes stop writing, the timer stops.
    stop: watch::Sender<bool>,
    table: Arc<Transfers>,
}

impl Transfer {
    pub fn stop_signal(&self) -> watch::Receiver<bool> {
        self.stop.subscribe()
    }

    /// Whether the transfer was stopped (terminal): parts not yet sent are skipped, parts being sent end
    /// with PART_ABORT.
    pub fn is_stopped(&self) -> bool {
        *self.stop.borrow()
    }

    /// Reserve one part before handing it to a lane; false once the transfer is terminal.
    pub fn lane_opening(&self) -> bool {
        let mut s = self.state.lock().expect("transfer lock");
        if s.phase != Phase::Live {
            return false;
        }
        s.lanes_unsettled += 1;
        true
    }

    /// Fail the transfer (first cause wins). Reported every time it happens.
    pub fn fail(&self, reason: ReasonCode, message: impl Into<String>) {
        let message = message.into();
        let mut s = self.state.lock().expect("transfer lock");
        if s.phase != Phase::Live {
            return;
        }
        tracing::warn!(xfer = self.xfer.0, peer = self.peer.0, reason = %reason, %message, "quic transfer failed");
        let sink = &self.table.sink;
        if s.lanes_unsettled == 0 {
            s.phase = Phase::Closed;
            sink.deliver(Event { peer: self.peer, ..Event::failed_quiesced(self.xfer, reason, message) });
            self.table.remove(self.xfer);
        } else {
            s.phase = Phase::Terminal;
            sink.deliver(Event { peer: self.peer, ..Event::failed(self.xfer, reason, message) });
        }
        drop(s);
        self.stop.send_replace(true);
    }

    /// A lane's receiver confirmed every byte of the lane.
    pub fn lane_done(&self) {
        let mut s = self.state.lock().expect("transfer lock");
        s.lanes_unsettled = s.lanes_unsettled.saturating_sub(1);
        s.lanes_done += 1;
        if s.phase == Phase::Live && s.lanes_done == s.lane_count {
            s.phase = Phase::Closed;
            self.table.sink.deliver(Event { peer: self.peer, ..Event::succeeded(self.xfer, self.total_bytes) });
            self.table.remove(self.xfer);
            drop(s);
            self.stop.send_replace(true);
            return;
        }
        self.close_if_settled(&mut s);
    }

    /// A lane ended without success, and its receiver can no longer write (it acknowledged, refused,
    /// or the connection is gone).
    pub fn lane_settled(&self) {
        let mut s = self.state.lock().expect("transfer lock");
        s.lanes_unsettled = s.lanes_unsettled.saturating_sub(1);
        self.close_if_settled(&mut s);
    }

    fn close_if_settled(&self, s: &mut State) {
        if s.phase == Phase::Terminal && s.lanes_unsettled == 0 {
            s.phase = Phase::Closed;
            self.table.sink.deliver(Event { peer: self.peer, ..Event::quiesced(self.xfer) });
            self.table.remove(self.xfer);
        }
    }

    /// Shutdown: end the transfer at once, with nothing more to follow.
    fn close_for_shutdown(&self) {
        let mut s = self.state.lock().expect("transfer lock");
        match s.phase {
            Phase::Live => {
                tracing::warn!(xfer = self.xfer.0, peer = self.peer.0, reason = "shutdown", "quic transfer failed: plugin shut down");
                self.table.sink.deliver(Event {
                    peer: self.peer,
                    ..Event::failed_quiesced(self.xfer, ReasonCode::SHUTDOWN, "the quic plugin shut down")
                });
            }
            Phase::Terminal => self.table.sink.deliver(Event { peer: self.peer, ..Event::quiesced(self.xfer) }),
            Phase::Closed => {}
        }
        s.phase = Phase::Closed;
        drop(s);
        self.stop.send_replace(true);
    }

    fn is_live(&self) -> bool {
        self.state.lock().expect("transfer lock").phase == Phase::Live
    }
}

/// How many closed transfer ids are remembered so that a reused id is refused (`DUPLICATE_ID`) instead
/// of starting a second life whose events the host would take for the first one's. Ids are unique per
/// instance by contract; this bounds the memory spent checking it.
pub const REMEMBERED_CLOSED_IDS: usize = 65536;

/// Closed ids, oldest first, bounded by [`REMEMBERED_CLOSED_IDS`].
#[derive(Default)]
struct ClosedIds {
    set: HashSet<XferId>,
    order: VecDeque<XferId>,
}

impl ClosedIds {
    fn remember(&mut self, xfer: XferId) {
        if self.set.insert(xfer) {
            self.order.push_back(xfer);
            if self.order.len() > REMEMBERED_CLOSED_IDS {
                if let Some(old) = self.order.pop_front() {
                    self.set.remove(&old);
                }
            }
        }
    }
}

/// Every transfer not yet closed.
pub struct Transfers {
    map: Mutex<HashMap<XferId, Arc<Transfer>>>,
    closed: Mutex<ClosedIds>,
    sink: Sink,
}

impl Transfers {
    pub fn new(sink: Sink) -> Arc<Transfers> {
        Arc::new(Transfers { map: Mutex::new(HashMap::new()), closed: Mutex::new(ClosedIds::default()), sink })
    }

    /// Admit a transfer of `lane_count` lanes, or refuse it (`DUPLICATE_ID`, `RESOURCE_EXHAUSTED`).
    pub fn admit(
        self: &Arc<Self>,
        xfer: XferId,
        peer: PeerId,
        total_bytes: u64,
        lane_count: usize,
        max_inflight: u64,
    ) -> Result<Arc<Transfer>, kvgate_abi::PluginError> {
        let mut map = self.map.lock().expect("transfers lock");
        if map.contains_key(&xfer) {
            return Err(kvgate_abi::PluginError::new(ReasonCode::DUPLICATE_ID, format!("transfer {} is already live", xfer.0)));
        }
        if self.closed.lock().expect("closed ids lock").set.contains(&xfer) {
            return Err(kvgate_abi::PluginError::new(
                ReasonCode::DUPLICATE_ID,
                format!("transfer id {} was already used by this instance (ids are never reused)", xfer.0),
            ));
        }
        if map.len() as u64 >= max_inflight {
            return Err(kvgate_abi::PluginError::new(
                ReasonCode::RESOURCE_EXHAUSTED,
                format!("{} transfers in flight reached max_inflight_transfers ({max_inflight})", map.len()),
            ));
        }
        let (stop, _) = watch::channel(false);
        let t = Arc::new(Transfer {
            xfer,
            peer,
            total_bytes,
            state: Mutex::new(State { phase: Phase::Live, lanes_unsettled: 0, lanes_done: 0, lane_count }),
            stop,
            table: self.clone(),
        });
        map.insert(xfer, t.clone());
        Ok(t)
    }

    fn remove(&self, xfer: XferId) {
        self.map.lock().expect("transfers lock").remove(&xfer);
        self.closed.lock().expect("closed ids lock").remember(xfer);
    }

    pub fn get(&self, xfer: XferId) -> Option<Arc<Transfer>> {
        self.map.lock().expect("transfers lock").get(&xfer).cloned()
    }

    /// Live transfers to `peer`.
    pub fn of_peer(&self, peer: PeerId) -> Vec<Arc<Transfer>> {
        self.map.lock().expect("transfers lock").values().filter(|t| t.peer == peer).cloned().collect()
    }

    /// (live, terminal but not yet quiesced)
    pub fn counts(&self) -> (u64, u64) {
        let all: Vec<Arc<Transfer>> = self.map.lock().expect("transfers lock").values().cloned().collect();
        let live = all.iter().filter(|t| t.is_live()).count() as u64;
        (live, all.len() as u64 - live)
    }

    pub fn close_all_for_shutdown(&self) {
        let all: Vec<Arc<Transfer>> = self.map.lock().expect("transfers lock").drain().map(|(_, t)| t).collect();
        for t in all {
            t.close_for_shutdown();
        }
    }
}
