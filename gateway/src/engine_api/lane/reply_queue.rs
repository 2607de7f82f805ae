//! The reply frames of one lane connection, encoded and waiting for its writer: the reader appends,
//! the writer takes everything queued at once and writes it in one `write`. Bounded in bytes
//! (`engine_api.lane_max_queued_reply_bytes`): at the bound the reader stops taking new calls until
//! the writer has drained it.

use kvgate_client::lane_frame::encode_frame;
use kvgate_client::proto::LaneReply;
use std::sync::Mutex;
use tokio::sync::Notify;

#[derive(Default)]
struct Queued {
    bytes: Vec<u8>,
    /// The reader is done: the writer flushes what is queued and ends the connection.
    closing: bool,
    /// The writer ended (the engine is gone): nothing is queued any more.
    writer_gone: bool,
}

pub struct ReplyQueue {
    queued: Mutex<Queued>,
    /// Wakes the writer: something was queued, or the connection closes.
    pub ready: Notify,
    /// Wakes the reader: the writer took the queue.
    pub drained: Notify,
    max_bytes: usize,
}

impl ReplyQueue {
    pub fn new(max_bytes: u64) -> ReplyQueue {
        ReplyQueue {
            queued: Mutex::new(Queued::default()),
            ready: Notify::new(),
            drained: Notify::new(),
            max_bytes: max_bytes as usize,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queued> {
        self.queued.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queue one reply frame (dropped once the writer is gone).
    pub fn push(&self, reply: &LaneReply) {
        let mut queued = self.lock();
        if queued.writer_gone {
            return;
        }
        let was_empty = queued.bytes.is_empty();
        encode_frame(reply, &mut queued.bytes);
        drop(queued);
        if was_empty {
            self.ready.notify_one();
        }
    }

    /// Whether the reader may take more calls: fewer than the bound's bytes queued.
    pub fn has_room(&self) -> bool {
        let queued = self.lock();
        queued.writer_gone || queued.bytes.len() < self.max_bytes
    }

    /// Move everything queued to the end of `out`; whether the connection is closing.
    pub fn take_into(&self, out: &mut Vec<u8>) -> bool {
        let mut queued = self.lock();
        if out.is_empty() {
            std::mem::swap(out, &mut queued.bytes);
        } else {
            out.extend_from_slice(&queued.bytes);
            queued.bytes.clear();
        }
        let closing = queued.closing;
        drop(queued);
        self.drained.notify_one();
        closing
    }

    /// The reader is done; the writer flushes and ends.
    pub fn close(&self) {
        self.lock().closing = true;
        self.ready.notify_one();
    }

    /// The writer is done (its socket failed); queued replies are dropped.
    pub fn writer_gone(&self) {
        let mut queued = self.lock();
        queued.writer_gone = true;
        queued.bytes = Vec::new();
        drop(queued);
        self.drained.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_client::proto::{lane_reply::Reply, ExpectReply};

    fn reply(id: u64) -> LaneReply {
        LaneReply { id, reply: Some(Reply::Expect(ExpectReply {})) }
    }

    #[test]
    fn the_reader_may_take_calls_below_the_bound_and_not_at_it() {
        let mut one = Vec::new();
        encode_frame(&reply(1), &mut one);
        let frame = one.len() as u64;
        let queue = ReplyQueue::new(3 * frame);
        queue.push(&reply(1));
        queue.push(&reply(2));
        assert!(queue.has_room(), "one byte less than the bound queued... and more: room");
        queue.push(&reply(3));
        assert!(!queue.has_room(), "exactly the bound queued: no room");
        let mut out = Vec::new();
        assert!(!queue.take_into(&mut out));
        assert_eq!(out.len() as u64, 3 * frame, "all three in one take");
        assert!(queue.has_room(), "drained");
        let just_below = ReplyQueue::new(frame + 1);
        just_below.push(&reply(1));
        assert!(just_below.has_room(), "one byte below the bound");
    }

    #[test]
    fn a_gone_writer_drops_replies_and_never_blocks_the_reader() {
        let queue = ReplyQueue::new(1);
        queue.push(&reply(1));
        assert!(!queue.has_room());
        queue.writer_gone();
        assert!(queue.has_room());
        queue.push(&reply(2));
        let mut out = Vec::new();
        queue.take_into(&mut out);
        assert!(out.is_empty());
    }
}
