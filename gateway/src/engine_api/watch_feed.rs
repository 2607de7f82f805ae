//! The room-event feed behind `Watch`: every room event gets the next per-gateway sequence number
//! (`RoomEvent.seq`, strictly increasing), goes into a bounded replay log
//! (`engine_api.watch_replay_events`) and out on one broadcast read straight by each stream; plus the
//! count of streams that want progress events (state changes, parts done) beside the outcomes
//! (`Terminal`, `Reusable`). A stream may start after a sequence number (`WatchRequest.after_seq`)
//! and is then replayed from the log first; a stream that falls behind the broadcast catches up from
//! the log. Only a cursor older than the log ends a stream (`watch_cursor_expired`), and the engine
//! then reconciles from `ListRooms`, whose `seq` says which events its snapshot already reflects.
//! Lets the driver skip building progress events nobody reads; never drops an outcome silently.
//! An event is built once and shared (`Arc`) by the log and the broadcast; each stream copies it
//! once, when it hands it to tonic.

use crate::channels::ApiError;
use kvgate_client::proto;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::broadcast;

/// The sending side, shared by the driver (which publishes) and the engine API (which subscribes).
#[derive(Clone)]
pub struct WatchFeed {
    events: broadcast::Sender<SharedEvent>,
    log: Arc<Mutex<ReplayLog>>,
    progress_watchers: Arc<AtomicUsize>,
    /// This gateway process: cursors of another incarnation are refused.
    incarnation: u64,
}

/// One published event, held by the log and every stream's broadcast slot at once.
type SharedEvent = Arc<proto::RoomEvent>;

/// The latest events, oldest first, and the sequence number of the last one published.
struct ReplayLog {
    events: VecDeque<SharedEvent>,
    capacity: usize,
    last_seq: u64,
}

impl ReplayLog {
    /// The oldest sequence number still held (`last_seq + 1` when empty).
    fn oldest(&self) -> u64 {
        self.events.front().map_or(self.last_seq + 1, |e| e.seq)
    }

    /// The events after `after`, in order, or None when some of them were evicted already.
    fn after(&self, after: u64) -> Option<Vec<SharedEvent>> {
        if after + 1 < self.oldest() {
            return None;
        }
        let skip = self.events.partition_point(|e| e.seq <= after);
        Some(self.events.range(skip..).cloned().collect())
    }
}

/// Whether an event is an outcome (`Terminal`, `Reusable`), which every stream gets, or progress.
pub fn is_outcome(event: &proto::RoomEvent) -> bool {
    matches!(event.event, Some(proto::room_event::Event::Terminal(_)) | Some(proto::room_event::Event::Reusable(_)))
}

/// Why a stream could not start from the cursor it asked for.
pub fn cursor_expired(after: u64, oldest: u64, last: u64) -> ApiError {
    ApiError::new(
        tonic::Code::OutOfRange,
        "watch_cursor_expired",
        format!(
            "events after seq {after} are no longer held (the replay log holds {oldest}..={last}, engine_api.watch_replay_events): \
             reconcile from ListRooms (its seq) and watch after that seq"
        ),
    )
}

/// A cursor that belongs to another gateway process: everything must be re-read.
fn restarted(why: String) -> ApiError {
    ApiError::new(
        tonic::Code::OutOfRange,
        "watch_cursor_expired",
        format!("{why}; reconcile from ListRooms and watch after its seq"),
    )
}

impl WatchFeed {
    /// A feed whose streams may fall `buffer_events` events behind the broadcast (then they catch
    /// up from the log), replaying up to `replay_events` past events.
    pub fn new(buffer_events: usize, replay_events: usize, incarnation: u64) -> WatchFeed {
        let log = ReplayLog {
            events: VecDeque::with_capacity(replay_events.min(4096)),
            capacity: replay_events,
            last_seq: 0,
        };
        let progress_watchers = Arc::new(AtomicUsize::new(0));
        WatchFeed {
            events: broadcast::channel(buffer_events).0,
            log: Arc::new(Mutex::new(log)),
            progress_watchers,
            incarnation,
        }
    }

    /// Whether any open stream wants progress events. A stream opening while this reads false
    /// may miss the progress events of that instant, as if it had opened a moment later.
    pub fn wants_progress(&self) -> bool {
        self.progress_watchers.load(Ordering::Relaxed) > 0
    }

    /// The sequence number of the last event published (0: none yet). Read on the driver, between
    /// two publishes, it is the cursor a snapshot taken there is consistent with.
    pub fn last_seq(&self) -> u64 {
        self.lock().last_seq
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ReplayLog> {
        self.log.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Publish one event under the next sequence number (kept in the log even while nobody watches).
    pub fn publish(&self, mut event: proto::RoomEvent) {
        let mut log = self.lock();
        log.last_seq += 1;
        event.seq = log.last_seq;
        if log.events.len() == log.capacity {
            log.events.pop_front();
        }
        let event = Arc::new(event);
        log.events.push_back(event.clone());
        // Sent under the lock: a subscriber that read the log then sees exactly the later events.
        let _ = self.events.send(event);
    }

    /// A new stream: every room, or only `room`; outcomes only, or progress too; live only, or
    /// replayed from the log after a cursor `(seq, incarnation)` first (incarnation 0: unchecked).
    pub fn subscribe(
        &self,
        room: Option<proto::RoomKey>,
        outcomes_only: bool,
        cursor: Option<(u64, u64)>,
        permit: tokio::sync::OwnedSemaphorePermit,
    ) -> Result<Watcher, ApiError> {
        let log = self.lock();
        let (replay, delivered) = match cursor {
            Some((after, incarnation)) => {
                if incarnation != 0 && incarnation != self.incarnation {
                    return Err(restarted(format!(
                        "the cursor is from incarnation {incarnation}, this gateway is incarnation {} (it restarted)",
                        self.incarnation
                    )));
                }
                if after > log.last_seq {
                    return Err(restarted(format!(
                        "seq {after} was never published here (the last is {}): the cursor is from before a restart",
                        log.last_seq
                    )));
                }
                let Some(replay) = log.after(after) else {
                    return Err(cursor_expired(after, log.oldest(), log.last_seq));
                };
                (replay.into(), after)
            }
            None => (VecDeque::new(), log.last_seq),
        };
        let events = self.events.subscribe();
        drop(log);
        let progress = (!outcomes_only).then(|| ProgressWatcher::count_in(&self.progress_watchers));
        Ok(Watcher {
            log: self.log.clone(),
            events,
            replay,
            delivered,
            room,
            _progress: progress,
            _permit: permit,
            ended: false,
            _held: None,
        })
    }
}

/// Counted in `progress_watchers` while the stream that holds it is open.
struct ProgressWatcher(Arc<AtomicUsize>);

impl ProgressWatcher {
    fn count_in(count: &Arc<AtomicUsize>) -> ProgressWatcher {
        count.fetch_add(1, Ordering::Relaxed);
        ProgressWatcher(count.clone())
    }
}

impl Drop for ProgressWatcher {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One `Watch` stream, read straight from the broadcast by the RPC's own response stream (no
/// forwarding task or second queue per event: tonic drains every event already queued into one
/// write). Holds its `max_watchers` permit until the client goes away.
pub struct Watcher {
    /// The feed's log (not the feed: a stream must not keep the broadcast open).
    log: Arc<Mutex<ReplayLog>>,
    events: broadcast::Receiver<SharedEvent>,
    /// Events from the log still to send before the broadcast's.
    replay: VecDeque<SharedEvent>,
    /// The sequence number of the last event this stream passed (sent or filtered out).
    delivered: u64,
    room: Option<proto::RoomKey>,
    /// `None` for an outcomes-only stream.
    _progress: Option<ProgressWatcher>,
    _permit: tokio::sync::OwnedSemaphorePermit,
    /// Set after an error: the stream ends with it.
    ended: bool,
    /// Held while the stream is open, dropped when it ends (e.g. an engine session's attachment).
    _held: Option<Box<dyn std::any::Any + Send + Sync>>,
}

impl Watcher {
    /// Keep `value` alive exactly as long as this stream.
    pub fn holding(mut self, value: Box<dyn std::any::Any + Send + Sync>) -> Watcher {
        self._held = Some(value);
        self
    }

    fn wants(&self, event: &proto::RoomEvent) -> bool {
        (self.room.is_none() || event.key == self.room) && (self._progress.is_some() || is_outcome(event))
    }

    pub async fn next_item(mut self) -> Option<(Result<proto::RoomEvent, tonic::Status>, Self)> {
        if self.ended {
            return None;
        }
        loop {
            let event = match self.replay.pop_front() {
                Some(event) => event,
                None => match self.events.recv().await {
                    Ok(event) => event,
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        // Behind the broadcast: catch up from the log, unless it moved past us too.
                        let log = self.log.lock().unwrap_or_else(|e| e.into_inner());
                        match log.after(self.delivered) {
                            Some(replay) => {
                                self.replay = replay.into();
                                continue;
                            }
                            None => {
                                let status = cursor_expired(self.delivered, log.oldest(), log.last_seq);
                                drop(log);
                                self.ended = true;
                                return Some((Err(status.to_status()), self));
                            }
                        }
                    }
                    Err(broadcast::error::RecvError::Closed) => return None,
                },
            };
            // Events replayed from the log may also come again through the broadcast.
            if event.seq <= self.delivered {
                continue;
            }
            self.delivered = event.seq;
            if self.wants(&event) {
                return Some((Ok(Arc::unwrap_or_clone(event)), self));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::Semaphore;

    fn event(room: u64, event: proto::room_event::Event) -> proto::RoomEvent {
        proto::RoomEvent { key: Some(proto::RoomKey { room, generation: 0 }), event: Some(event), ..Default::default() }
    }
    fn state(room: u64) -> proto::RoomEvent {
        event(room, proto::room_event::Event::StateChanged(proto::StateChanged { state: "transferring".into() }))
    }
    fn terminal(room: u64) -> proto::RoomEvent {
        event(room, proto::room_event::Event::Terminal(proto::Terminal { succeeded: true, ..Default::default() }))
    }
    fn reusable(room: u64) -> proto::RoomEvent {
        event(room, proto::room_event::Event::Reusable(proto::Reusable { reason: "quiesced".into() }))
    }
    fn permit() -> tokio::sync::OwnedSemaphorePermit {
        Arc::new(Semaphore::new(1)).try_acquire_owned().unwrap()
    }
    /// Every event a stream yields until the feed is gone, as `kind:room`.
    async fn drain(mut watcher: Watcher) -> Vec<String> {
        let mut got = Vec::new();
        while let Some((event, next)) = watcher.next_item().await {
            let event = event.expect("not an error");
            let name = match event.event.unwrap() {
                proto::room_event::Event::StateChanged(_) => "state",
                proto::room_event::Event::Terminal(_) => "terminal",
                proto::room_event::Event::Reusable(_) => "reusable",
            };
            got.push(format!("{name}:{}", event.key.unwrap().room));
            watcher = next;
        }
        got
    }

    /// Progress is wanted exactly while a full stream is open; outcomes-only streams do not count.
    #[tokio::test]
    async fn progress_is_wanted_only_while_a_full_stream_is_open() {
        let feed = WatchFeed::new(16, 64, 7);
        assert!(!feed.wants_progress());
        let outcomes = feed.subscribe(None, true, None, permit()).unwrap();
        assert!(!feed.wants_progress(), "an outcomes-only stream wants no progress events");
        let full = feed.subscribe(None, false, None, permit()).unwrap();
        let second = feed.subscribe(None, false, None, permit()).unwrap();
        assert!(feed.wants_progress());
        drop(full);
        assert!(feed.wants_progress(), "one full stream is still open");
        drop(second);
        assert!(!feed.wants_progress());
        drop(outcomes);
    }

    /// An outcomes-only stream skips progress and keeps every outcome, in order; a full stream gets
    /// everything; a room filter applies to both.
    #[tokio::test]
    async fn streams_get_what_they_asked_for() {
        let feed = WatchFeed::new(16, 64, 7);
        let outcomes = feed.subscribe(None, true, None, permit()).unwrap();
        let full = feed.subscribe(None, false, None, permit()).unwrap();
        let room_7 = feed.subscribe(Some(proto::RoomKey { room: 7, generation: 0 }), true, None, permit()).unwrap();
        for e in [state(1), terminal(1), state(7), reusable(1), terminal(7), reusable(7)] {
            feed.publish(e);
        }
        drop(feed);
        assert_eq!(drain(outcomes).await, ["terminal:1", "reusable:1", "terminal:7", "reusable:7"]);
        assert_eq!(drain(full).await, ["state:1", "terminal:1", "state:7", "reusable:1", "terminal:7", "reusable:7"]);
        assert_eq!(drain(room_7).await, ["terminal:7", "reusable:7"]);
    }

    fn seqs(events: &[String]) -> Vec<u64> {
        events.iter().map(|e| e.rsplit('@').next().unwrap().parse().unwrap()).collect()
    }

    /// Every event as `kind:room@seq` until the feed is gone, or the error's reason code last.
    async fn drain_seq(mut watcher: Watcher) -> Vec<String> {
        let mut got = Vec::new();
        while let Some((event, next)) = watcher.next_item().await {
            match event {
                Ok(event) => got.push(format!(
                    "{}:{}@{}",
                    if is_outcome(&event) { "outcome" } else { "state" },
                    event.key.unwrap().room,
                    event.seq
                )),
                Err(status) => got.push(format!("error:{}", kvgate_client::reason_of(&status).unwrap_or_default())),
            }
            watcher = next;
        }
        got
    }

    /// Sequence numbers are strictly increasing from 1; a stream started after one replays exactly
    /// the later events from the log, then goes on live, with nothing twice.
    #[tokio::test]
    async fn a_stream_resumes_after_its_cursor_with_nothing_lost_or_repeated() {
        let feed = WatchFeed::new(16, 64, 7);
        for room in 1..=5 {
            feed.publish(terminal(room));
        }
        assert_eq!(feed.last_seq(), 5);
        let resumed = feed.subscribe(None, true, Some((2, 7)), permit()).unwrap();
        let from_start = feed.subscribe(None, true, Some((0, 0)), permit()).unwrap();
        let live = feed.subscribe(None, true, None, permit()).unwrap();
        feed.publish(terminal(6));
        drop(feed);
        let got = drain_seq(resumed).await;
        assert_eq!(seqs(&got), [3, 4, 5, 6], "{got:?}");
        assert_eq!(seqs(&drain_seq(from_start).await), [1, 2, 3, 4, 5, 6]);
        assert_eq!(seqs(&drain_seq(live).await), [6]);
    }

    /// A cursor at the log's edge is served; one just past it (an evicted event would be missed)
    /// is refused with `watch_cursor_expired`, naming what the log holds.
    #[tokio::test]
    async fn a_cursor_older_than_the_log_is_refused_at_and_just_past_the_edge() {
        let feed = WatchFeed::new(16, 4, 7);
        for room in 1..=10 {
            feed.publish(terminal(room));
        }
        // The log holds 7..=10: after 6 is complete, after 5 would miss 6.
        let edge = feed.subscribe(None, true, Some((6, 7)), permit()).unwrap();
        let e = feed.subscribe(None, true, Some((5, 7)), permit()).err().expect("refused");
        assert_eq!(e.reason, "watch_cursor_expired");
        assert!(e.message.contains("7..=10"), "{}", e.message);
        drop(feed);
        assert_eq!(seqs(&drain_seq(edge).await), [7, 8, 9, 10]);
    }

    /// A stream that falls behind the broadcast catches up from the log (no error, no gap); one that
    /// falls behind the log too ends with `watch_cursor_expired`.
    #[tokio::test]
    async fn a_lagging_stream_catches_up_from_the_log_or_is_told_to_reconcile() {
        let feed = WatchFeed::new(16, 1024, 7);
        let slow = feed.subscribe(None, true, None, permit()).unwrap();
        for room in 1..=200 {
            feed.publish(terminal(room));
        }
        let small = WatchFeed::new(16, 32, 7);
        let lost = small.subscribe(None, true, None, permit()).unwrap();
        for room in 1..=200 {
            small.publish(terminal(room));
        }
        drop((feed, small));
        assert_eq!(seqs(&drain_seq(slow).await), (1..=200).collect::<Vec<u64>>());
        let got = drain_seq(lost).await;
        assert_eq!(got, ["error:watch_cursor_expired"]);
    }

    /// A cursor from another incarnation, or past the last event published, is refused: after a
    /// restart the numbers start again and would silently skip events.
    #[tokio::test]
    async fn a_cursor_from_another_incarnation_or_from_the_future_is_refused() {
        let feed = WatchFeed::new(16, 64, 7);
        for room in 1..=3 {
            feed.publish(terminal(room));
        }
        let e = feed.subscribe(None, true, Some((2, 8)), permit()).err().expect("refused");
        assert!(e.reason == "watch_cursor_expired" && e.message.contains("incarnation 8"), "{}", e.message);
        let e = feed.subscribe(None, true, Some((4, 0)), permit()).err().expect("refused");
        assert!(e.reason == "watch_cursor_expired" && e.message.contains("never published"), "{}", e.message);
        // At the last event exactly: nothing to replay, live from there.
        let at_last = feed.subscribe(None, true, Some((3, 7)), permit()).unwrap();
        feed.publish(terminal(4));
        drop(feed);
        assert_eq!(seqs(&drain_seq(at_last).await), [4]);
    }
}
