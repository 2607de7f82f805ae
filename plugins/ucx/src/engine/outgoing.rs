//! Outgoing transfers: posting their messages or puts within `max_posted_ops_per_transfer`, the commit
//! or flush that ends them, and their way to a terminal event (`SUCCEEDED` on the receiver's reply or
//! the flush, `FAILED` once, `QUIESCED` once nothing of theirs can land any more). The events
//! themselves come from the SDK's ledger: a transfer holds one ledger hold while anything of it may
//! land, released by `maybe_finish`.

use super::*;

impl Engine {
    pub(super) fn start(&mut self, job: Box<OutgoingJob>) {
        let xfer = job.xfer.0;
        let admission = Admission { peer: job.peer, total_bytes: job.total_bytes, deadline: Some(job.deadline) };
        let peer = job.peer;
        let connected = self.peers.contains_key(&job.peer);
        let tokens = self.token_lists.take();
        if let Err(e) = self.xfers.admit(job.xfer, admission, Outgoing::new(job, tokens)) {
            // The registry refuses an id still live or unquiesced at submit, so this cannot happen.
            tracing::error!(reason = "internal", xfer, "ucx transfer admitted twice: {}", e.message);
            return;
        }
        self.xfers.hold(XferId(xfer));
        if !connected {
            self.fail(xfer, ReasonCode::PEER_LOST, format!("no endpoint to peer {}", peer.0));
            self.maybe_finish(xfer);
            return;
        }
        self.pump(xfer);
    }

    /// Pump the stalled transfers again (those still stalled list themselves anew).
    pub(super) fn pump_all(&mut self) {
        if self.stalled.is_empty() {
            return;
        }
        let spare = std::mem::take(&mut self.pump_buffer);
        let mut ready = std::mem::replace(&mut self.stalled, spare);
        for xfer in ready.drain(..) {
            if let Some(x) = self.xfers.get_mut(XferId(xfer)) {
                x.stalled = false;
                self.pump(xfer);
            }
        }
        self.pump_buffer = ready;
    }

    /// List `xfer` as stalled (once).
    fn stall(&mut self, xfer: u64) {
        if let Some(x) = self.xfers.get_mut(XferId(xfer)) {
            if !x.stalled {
                x.stalled = true;
                self.stalled.push(xfer);
            }
        }
    }

    /// Post as many operations of `xfer` as its window allows, then its commit or flush; listed as
    /// stalled when it has to stop with operations left.
    fn pump(&mut self, xfer: u64) {
        let max_posted = self.shared.config.max_posted_ops_per_transfer;
        let mode = self.shared.mode;
        loop {
            if self.is_ending(xfer) {
                return;
            }
            let Some(x) = self.xfers.get(XferId(xfer)) else { return };
            let ep = match self.conn_of(x.job.peer) {
                Some(conn) if x.posted < max_posted => (conn.ep, conn.token),
                // At the posted-operations bound, or no endpoint yet: pumped again after activity.
                _ => {
                    if x.next_segment < x.job.segments.len() || !x.final_sent {
                        self.stall(xfer);
                    }
                    return;
                }
            };
            if x.next_segment >= x.job.segments.len() {
                if !x.final_sent {
                    match mode {
                        ResolvedMode::Am => self.send_commit(xfer, ep, wire::AM_COMMIT),
                        ResolvedMode::Put => self.post_flush(xfer, ep),
                    }
                }
                return;
            }
            let index = x.next_segment;
            let carries_commit = x.last_data_segment == Some(index);
            let segment = x.job.segments[index];
            if segment.len > 0 && !self.window_takes(segment.len) {
                // The instance's posted bytes are at `max_posted_bytes`: pumped again after activity.
                self.stall(xfer);
                return;
            }
            self.xfers.get_mut(XferId(xfer)).unwrap().next_segment += 1;
            if segment.len == 0 {
                continue;
            }
            let result = match mode {
                ResolvedMode::Am => self.post_data(xfer, ep, &segment, carries_commit),
                ResolvedMode::Put => self.post_put(xfer, ep, &segment),
            };
            if let Err((reason, message)) = result {
                self.fail(xfer, reason, message);
                self.maybe_finish(xfer);
                return;
            }
        }
    }

    /// Whether a message of `len` bytes may be posted now (see [`window_takes`]).
    fn window_takes(&self, len: u64) -> bool {
        window_takes(self.posted_bytes, len, self.shared.config.max_posted_bytes)
    }

    /// Count a posted, still pending data request's bytes until its completion (`on_complete`).
    fn count_posted_bytes(&mut self, token: u64, len: u64) {
        if let Some(req) = self.requests.get_mut(&token) {
            req.bytes = len;
            self.posted_bytes += len;
            self.shared.posted_bytes_peak.fetch_max(self.posted_bytes, Ordering::Relaxed);
        }
    }

    /// Post one data message; `carries_commit`: it is the transfer's last, and tells the receiver how
    /// many messages and bytes to expect (no separate `AM_COMMIT` follows).
    fn post_data(
        &mut self,
        xfer: u64,
        (ep, conn): (ucp_ep_h, u64),
        segment: &crate::shared::ResolvedSegment,
        carries_commit: bool,
    ) -> Result<(), (ReasonCode, String)> {
        let x = self.xfers.get(XferId(xfer)).unwrap();
        let hold = source_hold(&x.job, segment)?;
        let mut header = self.headers.take();
        DataHeader {
            sender: self.shared.instance,
            xfer,
            ticket: x.job.ticket.0,
            region: segment.remote_region,
            offset: segment.remote_offset,
            len: segment.len,
            commit: carries_commit.then_some((x.data_messages + 1, x.job.total_bytes)),
        }
        .encode_into(&mut header);
        let token = self.token();
        let param = ucp::send_param(Some(receiver::send_done), token, 0, segment.local_memh as ucp::ucp_mem_h);
        // SAFETY: `ep` is a live endpoint of this worker (from `conns`, used on the progress thread only);
        // the header and the source bytes stay valid until the request completes: the header and the hold
        // on the source region (its registration, and the host's mapping: `deregister` waits for it) are
        // kept in `requests` with it until UCX hands it back.
        let posted = ucp::classify(unsafe {
            ucp::ucp_am_send_nbx(
                ep,
                wire::AM_DATA,
                header.as_ptr() as *const c_void,
                header.len(),
                segment.local_addr as *const c_void,
                segment.len as usize,
                &param,
            )
        });
        let pending = self
            .track(token, posted, ReqKind::Xfer { xfer }, header, conn, Some(hold))
            .map_err(|s| (reason_for(s), format!("ucp_am_send_nbx: {}", ucp::status_text(s))))?;
        if pending {
            self.count_posted_bytes(token, segment.len);
        }
        let x = self.xfers.get_mut(XferId(xfer)).unwrap();
        x.posted += pending as u64;
        x.data_messages += 1;
        x.awaiting_reply = true;
        x.final_sent |= carries_commit;
        Ok(())
    }

    fn send_commit(&mut self, xfer: u64, (ep, conn): (ucp_ep_h, u64), id: u32) {
        let x = self.xfers.get(XferId(xfer)).unwrap();
        let mut header = self.headers.take();
        CommitHeader {
            sender: self.shared.instance,
            xfer,
            ticket: x.job.ticket.0,
            segments: x.data_messages,
            bytes: x.job.total_bytes,
        }
        .encode_into(&mut header);
        let token = self.token();
        let param = ucp::send_param(Some(receiver::send_done), token, 0, std::ptr::null_mut());
        // SAFETY: `ep` is a live endpoint of this worker, used on the progress thread only; the header is
        // kept in `requests` until the send completes, and no data buffer is passed.
        let posted = ucp::classify(unsafe {
            ucp::ucp_am_send_nbx(ep, id, header.as_ptr() as *const c_void, header.len(), std::ptr::null(), 0, &param)
        });
        let result = self.track(token, posted, ReqKind::Xfer { xfer }, header, conn, None);
        let x = self.xfers.get_mut(XferId(xfer)).unwrap();
        x.final_sent = true;
        if id == wire::AM_CANCEL {
            x.cancel_sent = true;
        }
        match result {
            Ok(pending) => {
                x.posted += pending as u64;
                x.awaiting_reply = true;
            }
            Err(status) => {
                // The receiver will never answer this message; the endpoint is broken.
                x.awaiting_reply = false;
                let message = format!("ucp_am_send_nbx (control): {}", ucp::status_text(status));
                self.fail(xfer, reason_for(status), message);
            }
        }
    }

    fn post_put(
        &mut self,
        xfer: u64,
        (ep, conn): (ucp_ep_h, u64),
        segment: &crate::shared::ResolvedSegment,
    ) -> Result<(), (ReasonCode, String)> {
        let x = self.xfers.get(XferId(xfer)).unwrap();
        let peer = x.job.peer;
        let hold = source_hold(&x.job, segment)?;
        let rkey = self.rkey_for(peer, segment.remote_key, xfer).map_err(|m| (ReasonCode::TRANSPORT_ERROR, m))?;
        let token = self.token();
        let param = ucp::send_param(Some(receiver::send_done), token, 0, segment.local_memh as ucp::ucp_mem_h);
        // SAFETY: `ep` is a live endpoint of this worker; `rkey` was unpacked on it and is destroyed only
        // once every request posted on the endpoint has been handed back (`maybe_retire`); the source
        // bytes are held registered and mapped by the hold kept in `requests` until the put is handed back.
        let posted = ucp::classify(unsafe {
            ucp::ucp_put_nbx(
                ep,
                segment.local_addr as *const c_void,
                segment.len as usize,
                segment.remote_addr,
                rkey,
                &param,
            )
        });
        let pending = self
            .track(token, posted, ReqKind::Xfer { xfer }, Vec::new(), conn, Some(hold))
            .map_err(|s| (reason_for(s), format!("ucp_put_nbx: {}", ucp::status_text(s))))?;
        if pending {
            self.count_posted_bytes(token, segment.len);
        }
        let x = self.xfers.get_mut(XferId(xfer)).unwrap();
        x.posted += pending as u64;
        x.any_put_posted = true;
        Ok(())
    }

    /// Post the flush that makes a put-mode transfer's bytes visible remotely (or that quiesces it).
    fn post_flush(&mut self, xfer: u64, (ep, conn): (ucp_ep_h, u64)) {
        let token = self.token();
        let param = ucp::send_param(Some(receiver::send_done), token, 0, std::ptr::null_mut());
        // SAFETY: `ep` is a live endpoint of this worker, used on the progress thread only; a flush reads no
        // caller memory.
        let posted = ucp::classify(unsafe { ucp::ucp_ep_flush_nbx(ep, &param) });
        let result = self.track(token, posted, ReqKind::Flush { xfer }, Vec::new(), conn, None);
        let x = self.xfers.get_mut(XferId(xfer)).unwrap();
        x.final_sent = true;
        match result {
            Ok(true) => x.posted += 1,
            Ok(false) => self.flush_done(xfer, ucs_status_t::UCS_OK),
            Err(status) => self.flush_done(xfer, status),
        }
    }

    pub(super) fn flush_done(&mut self, xfer: u64, status: ucs_status_t) {
        let Some(x) = self.xfers.get_mut(XferId(xfer)) else { return };
        x.flush_done = true;
        if !self.is_ending(xfer) {
            if ucp::is_ok(status) {
                self.succeed(xfer);
            } else {
                self.fail(xfer, reason_for(status), format!("ucp_ep_flush_nbx: {}", ucp::status_text(status)));
            }
        }
        self.maybe_finish(xfer);
    }

    // CONFORMANCE: DATA-1, RES-1 (SUCCEEDED once, on the receiver's reply or the flush)
    fn succeed(&mut self, xfer: u64) {
        if self.xfers.succeed(XferId(xfer)) {
            self.deliver_ledger_events();
        }
    }

    /// Whether `xfer` is terminal, or being failed right now (nothing may succeed it then).
    fn is_ending(&self, xfer: u64) -> bool {
        !self.xfers.is_live(XferId(xfer)) || self.xfers.get(XferId(xfer)).is_some_and(|x| x.failing)
    }

    /// Whether nothing of `x` can land any more.
    fn settled(mode: ResolvedMode, x: &Outgoing) -> bool {
        let flushed = mode == ResolvedMode::Am || !x.any_put_posted || x.flush_done;
        x.posted == 0 && !x.awaiting_reply && flushed && !x.closing
    }

    /// Make `xfer` terminal with `reason` (once) and start quiescing it.
    // CONFORMANCE: ABORT-1, ABORT-2, RES-3 (FAILED at once; QUIESCED only once nothing can land)
    pub(super) fn fail(&mut self, xfer: u64, reason: ReasonCode, message: String) {
        let mode = self.shared.mode;
        if self.is_ending(xfer) {
            return;
        }
        let x = self.xfers.get_mut(XferId(xfer)).expect("live");
        x.failing = true;
        x.next_segment = x.job.segments.len();
        let peer = x.job.peer;
        // Stop what has not started; what is on the wire completes (or fails) through its callback.
        let cancellable: Vec<*mut c_void> =
            x.tokens.iter().filter_map(|t| self.requests.get(t)).map(|r| r.request).collect();
        for request in cancellable {
            // SAFETY: tracked requests are freed only when they leave `requests`.
            unsafe { ucp::request_cancel(&self.worker, request) };
        }
        let ep = self.conn_of(peer).map(|c| (c.ep, c.token));
        let x = self.xfers.get_mut(XferId(xfer)).unwrap();
        let needs_cancel_message = mode == ResolvedMode::Am && x.awaiting_reply && !x.cancel_sent;
        let needs_flush = mode == ResolvedMode::Put && x.any_put_posted && !x.final_sent;
        match ep {
            Some(ep) if needs_cancel_message => self.send_commit(xfer, ep, wire::AM_CANCEL),
            Some(ep) if needs_flush => self.post_flush(xfer, ep),
            None => {
                let x = self.xfers.get_mut(XferId(xfer)).unwrap();
                x.awaiting_reply = false;
            }
            _ => {}
        }
        let x = self.xfers.get_mut(XferId(xfer)).expect("still live: only this call fails it");
        x.failing = false;
        let quiesced = Self::settled(mode, x);
        tracing::warn!(reason = reason.as_str(), xfer, peer = peer.0, quiesced, "ucx transfer failed: {message}");
        if quiesced {
            // Nothing of it can land: its hold goes first, so the failure carries the quiesced flag
            // (and the ledger forgets it at once).
            self.xfers.release(XferId(xfer));
        }
        self.xfers.fail(XferId(xfer), reason, message);
        self.deliver_ledger_events();
    }

    /// Release a terminal transfer's hold once nothing of it is in flight (the ledger then reports
    /// `QUIESCED` if owed and forgets it).
    // CONFORMANCE: RES-2 (a terminal transfer is forgotten once nothing of it is in flight)
    pub(super) fn maybe_finish(&mut self, xfer: u64) {
        let mode = self.shared.mode;
        let Some(x) = self.xfers.get(XferId(xfer)) else { return };
        if self.xfers.is_live(XferId(xfer)) || !Self::settled(mode, x) {
            return;
        }
        if let Some(x) = self.xfers.release(XferId(xfer)) {
            self.token_lists.give(x.tokens);
        }
        self.deliver_ledger_events();
    }

    pub(super) fn on_reply(&mut self, xfer: u64, code: u32) {
        let Some(x) = self.xfers.get_mut(XferId(xfer)) else { return };
        if code & REPLY_EARLY_BIT != 0 {
            let reason = ReasonCode(code & !REPLY_EARLY_BIT);
            self.fail(xfer, reason, format!("receiver refused a segment: {reason}"));
            return;
        }
        x.awaiting_reply = false;
        if code == 0 {
            if x.final_sent && !x.cancel_sent {
                self.succeed(xfer);
            }
        } else {
            let reason = ReasonCode(code);
            self.fail(xfer, reason, format!("receiver refused the transfer: {reason}"));
        }
        self.maybe_finish(xfer);
    }

    // CONFORMANCE: DATA-4 (a transfer reading a deregistered region fails)
    pub(super) fn fail_users_of(&mut self, key: LocalKey) {
        let users: Vec<u64> = self
            .xfers
            .iter()
            .filter(|(_, e)| e.is_live() && e.data.job.segments.iter().any(|s| s.local_key == key.0))
            .map(|(id, _)| id.0)
            .collect();
        for xfer in users {
            self.fail(xfer, ReasonCode::UNKNOWN_KEY, format!("source region {} deregistered", key.0));
            self.maybe_finish(xfer);
        }
    }
}

/// A hold on the source region `segment` reads, for one request; refused (`UNKNOWN_KEY`) when the
/// region was deregistered since the submit (its transfer then fails and posts nothing more).
fn source_hold(
    job: &OutgoingJob,
    segment: &crate::shared::ResolvedSegment,
) -> Result<RegionHold, (ReasonCode, String)> {
    job.source_hold(segment.local_key)
        .ok_or_else(|| (ReasonCode::UNKNOWN_KEY, format!("source region {} deregistered", segment.local_key)))
}

/// Whether a message of `len` bytes may be posted with `posted` bytes already posted: the sum stays
/// within `max_posted` (`max_posted_bytes`), or nothing is posted (a message longer than the bound
/// still moves, alone).
fn window_takes(posted: u64, len: u64, max_posted: u64) -> bool {
    posted == 0 || posted.saturating_add(len) <= max_posted
}

impl Outgoing {
    fn new(job: Box<OutgoingJob>, tokens: Vec<u64>) -> Outgoing {
        let last_data_segment = job.segments.iter().rposition(|s| s.len > 0);
        Outgoing {
            job,
            next_segment: 0,
            posted: 0,
            data_messages: 0,
            last_data_segment,
            final_sent: false,
            cancel_sent: false,
            awaiting_reply: false,
            flush_done: false,
            any_put_posted: false,
            failing: false,
            closing: false,
            stalled: false,
            tokens,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::window_takes;

    #[test]
    fn the_posted_bytes_window_takes_a_message_at_its_bound_and_not_past_it() {
        assert!(window_takes(0, 10, 100));
        assert!(window_takes(90, 10, 100), "at the bound");
        assert!(!window_takes(91, 10, 100), "one byte past it");
        assert!(!window_takes(100, 1, 100));
        assert!(window_takes(0, 1000, 100), "a message longer than the bound moves when nothing else is posted");
        assert!(!window_takes(1, 1000, 100), "but never next to another");
        assert!(!window_takes(u64::MAX - 1, 2, u64::MAX - 1), "no overflow");
    }
}
