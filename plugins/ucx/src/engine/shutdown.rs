//! Shutdown: fail every transfer, wait (bounded) for receivers to confirm, say goodbye, close every
//! endpoint and hand UCX its requests back. Every wait has its own bound.

use super::*;

/// How long shutdown waits for its goodbye messages to leave (after `shutdown_grace_ms`).
const GOODBYE_MS: u64 = 100;
/// How long shutdown waits for UCX to hand back the endpoint closes it started (after the goodbyes).
const ENDPOINT_CLOSE_WAIT_MS: u64 = 200;
/// How long a shutdown wait sleeps when a progress round found nothing to do (leaves the core to
/// a receiver in the same process).
const SHUTDOWN_IDLE_SLEEP_US: u64 = 50;

impl Engine {
    /// Progress the worker (completions, replies, peers' messages) until `done` or `until`.
    fn progress_until(&mut self, until: Instant, done: impl Fn(&Engine) -> bool) {
        while !done(self) && Instant::now() < until {
            let mut activity = false;
            let mut rounds = 0;
            while rounds < MAX_PROGRESS_ROUNDS_PER_ITERATION && self.worker.progress() > 0 {
                rounds += 1;
                activity = true;
            }
            activity |= self.drain();
            if !activity {
                std::thread::sleep(Duration::from_micros(SHUTDOWN_IDLE_SLEEP_US));
            }
        }
    }

    /// Tell every peer this instance is going away, waiting at most `GOODBYE_MS` for the messages to leave.
    fn say_goodbye(&mut self) {
        let bye = wire::encode_bye(self.shared.instance);
        let mut tokens = Vec::new();
        let eps: Vec<(ucp_ep_h, u64)> = self.conns.values().map(|c| (c.ep, c.token)).collect();
        for (ep, conn) in eps {
            let token = self.token();
            let param = ucp::send_param(Some(receiver::send_done), token, 0, std::ptr::null_mut());
            // SAFETY: `ep` is a live endpoint of this worker (taken from `conns` just above); the goodbye
            // bytes are kept with the request in `requests` until the send completes.
            let posted = ucp::classify(unsafe {
                ucp::ucp_am_send_nbx(
                    ep,
                    wire::AM_BYE,
                    bye.as_ptr() as *const c_void,
                    bye.len(),
                    std::ptr::null(),
                    0,
                    &param,
                )
            });
            if let Ok(true) = self.track(token, posted, ReqKind::Other, bye.clone(), conn, None) {
                tokens.push(token);
            }
        }
        let until = Instant::now() + Duration::from_millis(GOODBYE_MS);
        self.progress_until(until, |e| tokens.iter().all(|t| !e.requests.contains_key(t)));
    }

    /// Fail everything; report `QUIESCED` for what receivers confirm within `shutdown_grace_ms` (and
    /// only for that: a frozen receiver may still apply what it holds, so the rest stay unquiesced);
    /// say goodbye; close every endpoint; wait (bounded) for UCX to hand the requests back.
    /// Every wait is bounded: `shutdown_grace_ms` + `GOODBYE_MS` + `ENDPOINT_CLOSE_WAIT_MS` in all.
    pub(super) fn shutdown(&mut self) {
        let grace_until = Instant::now() + Duration::from_millis(self.shared.config.shutdown_grace_ms);
        let live: Vec<u64> = self.xfers.iter().map(|(id, _)| id.0).collect();
        for xfer in &live {
            self.fail(*xfer, ReasonCode::SHUTDOWN, "plugin shutting down".into());
            self.maybe_finish(*xfer);
        }
        // Receivers answer the cancel messages (am) and flushes complete (put): those transfers quiesce.
        self.progress_until(grace_until, |e| e.xfers.is_empty());
        self.say_goodbye();
        let peers: Vec<PeerId> = self.peers.keys().copied().collect();
        for peer in peers {
            self.drop_peer(peer, "plugin shutting down", false, false, false, false);
        }
        self.close_all_lingering();
        let close_until = Instant::now() + Duration::from_millis(ENDPOINT_CLOSE_WAIT_MS);
        self.progress_until(close_until, |e| e.retiring.is_empty() && e.receiver.borrow().pending_receives() == 0);
        // What no receiver confirmed stays unquiesced: the host's quarantine bound decides for it.
        let unconfirmed: Vec<u64> = self.xfers.iter().map(|(id, _)| id.0).collect();
        for xfer in unconfirmed {
            // Every one failed above, so terminal: forgotten without an event.
            let Some(x) = self.xfers.forget_terminal(XferId(xfer)) else { continue };
            tracing::warn!(
                reason = "quiesce_unconfirmed",
                xfer,
                peer = x.job.peer.0,
                "ucx transfer {xfer} not confirmed quiesced within shutdown_grace_ms = {}: no QUIESCED is reported for it",
                self.shared.config.shutdown_grace_ms
            );
        }
        self.shared.lock().unquiesced_xfers.clear();
        // UCX must get every request back before the worker is destroyed; one still in progress is
        // released by UCX itself when it completes. The regions they read stay registered until the
        // worker is gone (`held_past_shutdown` drops after it), and endpoints still retiring keep
        // their remote keys (leaked: a request may still name them).
        for (_, req) in self.requests.drain() {
            // SAFETY: drained from `requests`, so freed once.
            unsafe { ucp::request_free(req.request) };
            self.held_past_shutdown.extend(req.hold);
        }
        for request in self.receiver.borrow().pending_requests() {
            // SAFETY: each pending receive's request, freed once here at shutdown; no receive
            // completes after this (the worker is no longer progressed).
            unsafe { ucp::request_free(request) };
        }
        for (token, r) in self.retiring.drain() {
            tracing::warn!(
                reason = "endpoint_retire_pending",
                endpoint = token,
                requests = r.outstanding,
                "ucx endpoint still retiring at shutdown: its {} remote key(s) are left to the worker's end",
                r.rkeys.len()
            );
        }
        self.shared.healthy.store(false, Ordering::Release);
    }
}
