//! Outcomes an engine can rely on: [`OutcomeWatch`] delivers the `Terminal` and then the `Reusable`
//! of every room the engine tracks exactly once each, however often its `Watch` stream is cut.
//!
//! The rule (gateway/README.md, "Losing no outcome"):
//! 1. Remember the `seq` of the last event handled and the gateway's incarnation (the cursor).
//! 2. After any stream loss, `Watch` again with `after_seq` = the cursor: the gateway replays every
//!    later event from its log, then goes on live. Nothing is lost and nothing comes twice.
//!    A restarted gateway (another incarnation) refuses the cursor as in 3.
//! 3. If the gateway answers `watch_cursor_expired` (the log moved past the cursor), take a snapshot
//!    with `ListRooms(include_terminal)`: it reflects every event up to its own `seq`. Each tracked room
//!    the snapshot shows terminal (or reusable) gets the outcomes it had not had yet; a tracked room
//!    the gateway no longer knows at all ended long ago and is reported failed with reason
//!    [`UNKNOWN_AFTER_RECONNECT`] and reusable (its tombstone expired: nothing can land any more).
//!    Then `Watch` with `after_seq` = the snapshot's `seq`.

use crate::proto::{self, room_event::Event};
use crate::{reason_of, Client, Cursor, RoomKey};
use std::collections::{HashMap, VecDeque};
use tonic::Status;

/// The failure reason reported for a tracked room the gateway no longer knows after a reconnect.
pub const UNKNOWN_AFTER_RECONNECT: &str = "unknown_after_reconnect";

/// A room as seen by one side: `(room, generation, role)`, role `sender` or `receiver`.
pub type TrackedKey = (u64, u32, String);

/// One outcome of one tracked room.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    Terminal { room: RoomKey, role: String, terminal: proto::Terminal },
    Reusable { room: RoomKey, role: String, reason: String },
}

impl Outcome {
    pub fn room(&self) -> RoomKey {
        match self {
            Outcome::Terminal { room, .. } | Outcome::Reusable { room, .. } => *room,
        }
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct Delivered {
    terminal: bool,
    reusable: bool,
}

/// What a resume cost, for tests and metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ResumeCounts {
    /// Streams reopened after the cursor (replayed from the log).
    pub resumed: u64,
    /// Snapshots taken because the cursor had expired.
    pub reconciled: u64,
}

/// The tracked rooms' outcomes from one gateway, exactly once each.
pub struct OutcomeWatch {
    client: Client,
    stream: Option<tonic::Streaming<proto::RoomEvent>>,
    cursor: Cursor,
    tracked: HashMap<TrackedKey, Delivered>,
    ready: VecDeque<Outcome>,
    counts: ResumeCounts,
}

fn tracked_key(room: RoomKey, role: &str) -> TrackedKey {
    (room.room, room.generation, role.to_string())
}

impl OutcomeWatch {
    /// Start watching outcomes live (nothing before this call is replayed: track rooms before
    /// making the calls that create them).
    pub async fn start(client: Client) -> Result<OutcomeWatch, Status> {
        let (_, cursor) = client.list_rooms_at(false).await?;
        let mut watch = OutcomeWatch {
            client,
            stream: None,
            cursor,
            tracked: HashMap::new(),
            ready: VecDeque::new(),
            counts: ResumeCounts::default(),
        };
        watch.reopen().await?;
        Ok(watch)
    }

    /// Deliver this room's outcomes (on `role`'s side: `sender` or `receiver`).
    pub fn track(&mut self, room: RoomKey, role: &str) {
        self.tracked.entry(tracked_key(room, role)).or_default();
    }

    /// Rooms tracked whose `Reusable` has not been handed out by `next` yet.
    pub fn pending(&self) -> usize {
        self.tracked.len()
    }

    pub fn counts(&self) -> ResumeCounts {
        self.counts
    }

    /// The cursor: the `seq` of the last event handled, in which gateway incarnation.
    pub fn cursor(&self) -> Cursor {
        self.cursor
    }

    /// Drop the stream as a network cut would; the next `next()` resumes.
    pub fn cut(&mut self) {
        self.stream = None;
    }

    /// The next outcome of a tracked room. Reconnects (resume, or reconcile) on any stream loss;
    /// returns an error only when the gateway cannot be reached at all.
    pub async fn next(&mut self) -> Result<Outcome, Status> {
        loop {
            if let Some(outcome) = self.ready.pop_front() {
                // A room stops being tracked once its last outcome is handed out.
                if let Outcome::Reusable { room, role, .. } = &outcome {
                    self.tracked.remove(&tracked_key(*room, role));
                }
                return Ok(outcome);
            }
            let Some(stream) = self.stream.as_mut() else {
                self.reopen().await?;
                continue;
            };
            match stream.message().await {
                Ok(Some(event)) => self.handle(event),
                // Ended or cut: resume from the cursor.
                Ok(None) | Err(_) => self.stream = None,
            }
        }
    }

    fn handle(&mut self, event: proto::RoomEvent) {
        if event.seq <= self.cursor.seq {
            return;
        }
        self.cursor.seq = event.seq;
        let Some(key) = event.key else { return };
        let tracked = tracked_key(key, &event.role);
        let Some(delivered) = self.tracked.get_mut(&tracked) else { return };
        match event.event {
            Some(Event::Terminal(terminal)) if !delivered.terminal => {
                delivered.terminal = true;
                self.ready.push_back(Outcome::Terminal { room: key, role: event.role, terminal });
            }
            Some(Event::Reusable(r)) if !delivered.reusable => {
                delivered.reusable = true;
                self.ready.push_back(Outcome::Reusable { room: key, role: event.role, reason: r.reason });
            }
            _ => {}
        }
    }

    /// Open a stream after the cursor; if the gateway's log moved past it, reconcile from a snapshot.
    async fn reopen(&mut self) -> Result<(), Status> {
        match self.client.watch_after(None, true, self.cursor).await {
            Ok(stream) => {
                self.counts.resumed += 1;
                self.stream = Some(stream);
                Ok(())
            }
            Err(status) if reason_of(&status).as_deref() == Some("watch_cursor_expired") => {
                self.reconcile().await?;
                self.stream = Some(self.client.watch_after(None, true, self.cursor).await?);
                Ok(())
            }
            Err(status) => Err(status),
        }
    }

    async fn reconcile(&mut self) -> Result<(), Status> {
        self.counts.reconciled += 1;
        let (rooms, seq) = self.client.list_rooms_at(true).await?;
        let mut known: HashMap<TrackedKey, proto::RoomInfo> = HashMap::new();
        for info in rooms {
            if let Some(key) = info.key {
                known.insert(tracked_key(key, &info.role), info);
            }
        }
        let mut keys: Vec<TrackedKey> = self.tracked.keys().cloned().collect();
        keys.sort();
        for tracked in keys {
            let room = RoomKey { room: tracked.0, generation: tracked.1 };
            let role = tracked.2.clone();
            let delivered = self.tracked[&tracked];
            let (terminal, reusable) = match known.get(&tracked) {
                Some(info) => {
                    let terminal = matches!(info.state.as_str(), "succeeded" | "failed" | "quarantined");
                    let t = proto::Terminal {
                        succeeded: info.state == "succeeded",
                        reason: info.reason.clone(),
                        phase: info.phase.clone(),
                        elapsed_ms: info.age_ms,
                        bytes: info.bytes_done,
                        ..Default::default()
                    };
                    (terminal.then_some(t), info.reusable.then(|| "reconciled".to_string()))
                }
                // Forgotten: it ended (and was released) longer ago than the gateway remembers.
                None => (
                    Some(proto::Terminal {
                        succeeded: false,
                        reason: UNKNOWN_AFTER_RECONNECT.into(),
                        ..Default::default()
                    }),
                    Some(UNKNOWN_AFTER_RECONNECT.to_string()),
                ),
            };
            if let (Some(terminal), false) = (terminal, delivered.terminal) {
                self.ready.push_back(Outcome::Terminal { room, role: role.clone(), terminal });
                if let Some(d) = self.tracked.get_mut(&tracked) {
                    d.terminal = true;
                }
            }
            if let (Some(reason), false) = (reusable, delivered.reusable) {
                if let Some(d) = self.tracked.get_mut(&tracked).filter(|d| d.terminal) {
                    d.reusable = true;
                    self.ready.push_back(Outcome::Reusable { room, role, reason });
                }
            }
        }
        self.cursor = seq;
        Ok(())
    }
}
