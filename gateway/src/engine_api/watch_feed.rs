//! The room-event feed behind `Watch`: one broadcast of every room event, read straight by each
//! stream, and the count of streams that want progress events (state changes, parts done) beside
//! the outcomes (`Terminal`, `Reusable`). Lets the driver skip building progress events nobody reads;
//! never drops an outcome.

use crate::driver::ApiError;
use kvgate_client::proto;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::sync::broadcast;

/// The sending side, shared by the driver (which publishes) and the engine API (which subscribes).
#[derive(Clone)]
pub struct WatchFeed {
    events: broadcast::Sender<proto::RoomEvent>,
    progress_watchers: Arc<AtomicUsize>,
}

/// Whether an event is an outcome (`Terminal`, `Reusable`), which every stream gets, or progress.
pub fn is_outcome(event: &proto::RoomEvent) -> bool {
    matches!(event.event, Some(proto::room_event::Event::Terminal(_)) | Some(proto::room_event::Event::Reusable(_)))
}

impl WatchFeed {
    /// A feed whose streams may fall `buffer_events` events behind before they are ended.
    pub fn new(buffer_events: usize) -> WatchFeed {
        WatchFeed { events: broadcast::channel(buffer_events).0, progress_watchers: Arc::new(AtomicUsize::new(0)) }
    }

    /// Whether any open stream wants progress events. A stream opening while this reads false
    /// may miss the progress events of that instant, as if it had opened a moment later.
    pub fn wants_progress(&self) -> bool {
        self.progress_watchers.load(Ordering::Relaxed) > 0
    }

    /// Publish one event; with no stream open it goes nowhere (not an error: nobody is watching).
    pub fn publish(&self, event: proto::RoomEvent) {
        let _ = self.events.send(event);
    }

    /// A new stream: every room, or only `room`; outcomes only, or progress too.
    pub fn subscribe(&self, room: Option<proto::RoomKey>, outcomes_only: bool, permit: tokio::sync::OwnedSemaphorePermit) -> Watcher {
        let progress = (!outcomes_only).then(|| ProgressWatcher::count_in(&self.progress_watchers));
        Watcher { events: self.events.subscribe(), room, _progress: progress, _permit: permit, ended: false }
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
    events: broadcast::Receiver<proto::RoomEvent>,
    room: Option<proto::RoomKey>,
    /// `None` for an outcomes-only stream.
    _progress: Option<ProgressWatcher>,
    _permit: tokio::sync::OwnedSemaphorePermit,
    /// Set after the `watch_lagged` error: the stream ends with it.
    ended: bool,
}

impl Watcher {
    fn wants(&self, event: &proto::RoomEvent) -> bool {
        (self.room.is_none() || event.key == self.room) && (self._progress.is_some() || is_outcome(event))
    }

    pub async fn next_item(mut self) -> Option<(Result<proto::RoomEvent, tonic::Status>, Self)> {
        if self.ended {
            return None;
        }
        loop {
            match self.events.recv().await {
                Ok(event) if self.wants(&event) => return Some((Ok(event), self)),
                Ok(_) => continue,
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    let status = ApiError::new(
                        tonic::Code::ResourceExhausted,
                        "watch_lagged",
                        format!("{n} events were missed (engine_api.watch_buffer_events); re-read rooms with ListRooms and watch again"),
                    );
                    self.ended = true;
                    return Some((Err(status.to_status()), self));
                }
                Err(broadcast::error::RecvError::Closed) => return None,
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
        let feed = WatchFeed::new(16);
        assert!(!feed.wants_progress());
        let outcomes = feed.subscribe(None, true, permit());
        assert!(!feed.wants_progress(), "an outcomes-only stream wants no progress events");
        let full = feed.subscribe(None, false, permit());
        let second = feed.subscribe(None, false, permit());
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
        let feed = WatchFeed::new(16);
        let outcomes = feed.subscribe(None, true, permit());
        let full = feed.subscribe(None, false, permit());
        let room_7 = feed.subscribe(Some(proto::RoomKey { room: 7, generation: 0 }), true, permit());
        for e in [state(1), terminal(1), state(7), reusable(1), terminal(7), reusable(7)] {
            feed.publish(e);
        }
        drop(feed);
        assert_eq!(drain(outcomes).await, ["terminal:1", "reusable:1", "terminal:7", "reusable:7"]);
        assert_eq!(drain(full).await, ["state:1", "terminal:1", "state:7", "reusable:1", "terminal:7", "reusable:7"]);
        assert_eq!(drain(room_7).await, ["terminal:7", "reusable:7"]);
    }
}
