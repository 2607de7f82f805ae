//! A receiver's replies to its senders: grouped per sender into `AM_REPLY` messages, held within a
//! progress burst up to `reply_batch_transfers`, and kept for a sender whose endpoint is still coming.

use super::*;

impl Engine {
    /// Send `replies` (emptied): one `AM_REPLY` message per sender for up to
    /// `MAX_REPLIES_PER_MESSAGE` of them, each sender's replies in the order they were made.
    pub(super) fn send_replies(&mut self, replies: &mut Vec<(u64, ReplyHeader)>) {
        if replies.len() > 1 {
            replies.sort_by_key(|(sender, _)| *sender); // stable
        }
        let mut start = 0;
        while start < replies.len() {
            let sender = replies[start].0;
            let mut end = start + 1;
            while end < replies.len() && replies[end].0 == sender && end - start < wire::MAX_REPLIES_PER_MESSAGE {
                end += 1;
            }
            self.send_reply_message(sender, &replies[start..end]);
            start = end;
        }
        replies.clear();
    }

    /// One message carrying `replies` (all to `sender`).
    fn send_reply_message(&mut self, sender: u64, replies: &[(u64, ReplyHeader)]) {
        // The endpoint to the sender's instance, whichever peer id (or ids) the host knows it by.
        let Some((ep, conn)) = self.conns.get(&sender).map(|c| (c.ep, c.token)) else {
            if self.endpoint_coming(sender) {
                self.replies_awaiting_endpoint.extend_from_slice(replies);
            } else {
                for (_, header) in replies {
                    tracing::warn!(
                        reason = "peer_unreachable",
                        xfer = header.xfer,
                        "ucx reply dropped: no endpoint to sender {sender:#x}"
                    );
                }
            }
            return;
        };
        // One buffer for every reply message: UCX reads it until the send completes, which is
        // mostly at once (a short message); a send still pending keeps it and the next takes a new one.
        let mut bytes = std::mem::take(&mut self.reply_bytes);
        bytes.clear();
        wire::encode_replies(replies.iter().map(|(_, h)| h), &mut bytes);
        let token = self.token();
        let param = ucp::send_param(Some(receiver::send_done), token, 0, std::ptr::null_mut());
        // SAFETY: `ep` is a live endpoint of this worker; `bytes` is kept with the request in `requests` (or
        // reused only once the send completed at once), so UCX may read it until completion.
        let posted = ucp::classify(unsafe {
            ucp::ucp_am_send_nbx(
                ep,
                wire::AM_REPLY,
                bytes.as_ptr() as *const c_void,
                bytes.len(),
                std::ptr::null(),
                0,
                &param,
            )
        });
        if let Posted::Done = posted {
            self.reply_bytes = bytes;
            return;
        }
        if let Err(status) = self.track(token, posted, ReqKind::Other, bytes, conn, None) {
            tracing::warn!(reason = "transport_error", "ucx reply to a sender failed: {}", ucp::status_text(status));
        }
    }

    /// Whether the host connected a peer id naming `instance` (not down) whose endpoint is not made
    /// yet: its `Connect` command is queued (the registry and the queue change under one lock).
    fn endpoint_coming(&self, instance: u64) -> bool {
        !self.conns.contains_key(&instance)
            && self.shared.lock().peers.values().any(|p| p.instance == instance && !p.down)
    }

    /// After a batch of commands: send the replies whose endpoint now exists; drop (logged) those
    /// whose endpoint will not come (the connect failed or was undone).
    pub(super) fn retry_replies_awaiting_endpoint(&mut self) {
        // `send_replies` sends, queues again while the endpoint is still coming, or drops.
        let mut waiting = std::mem::take(&mut self.replies_awaiting_endpoint);
        self.send_replies(&mut waiting);
    }
}

/// Whether the replies gathered so far go out now: at once outside a progress burst, and inside one
/// as soon as no write is still landing (nothing more would join them) or `batch` of them are due.
/// So a reply waits at most until the next write in flight lands or the burst ends, and one message
/// answers up to `batch` transfers (on shared memory at 64 KiB, 2 a message instead of 1 moved the
/// plugin from 0.94 to 0.97 of `ucx_perftest`: docs/ucx-performance-record.md).
pub(super) fn replies_go_now(due: usize, receives_in_flight: usize, batch: usize, in_progress_burst: bool) -> bool {
    !in_progress_burst || receives_in_flight == 0 || due >= batch
}

#[cfg(test)]
mod tests {
    use super::replies_go_now;

    #[test]
    fn replies_are_held_in_a_burst_until_the_batch_is_due() {
        // In a burst with writes still landing: held below the batch, sent at it and past it.
        assert!(!replies_go_now(1, 3, 2, true));
        assert!(replies_go_now(2, 3, 2, true));
        assert!(replies_go_now(3, 3, 2, true));
        assert!(!replies_go_now(3, 1, 4, true));
        assert!(replies_go_now(4, 1, 4, true));
        // A batch of 1 never holds.
        assert!(replies_go_now(1, 5, 1, true));
    }

    #[test]
    fn replies_go_once_nothing_else_is_landing_or_the_burst_ends() {
        assert!(replies_go_now(1, 0, 2, true), "no write in flight: nothing would join them");
        assert!(replies_go_now(1, 3, 2, false), "after the burst every held reply goes");
        assert!(replies_go_now(0, 0, 64, false));
    }
}
