//! Receiver side of the active-message protocol: every incoming segment is checked against the
//! sender's identity, a live ticket and the registered region before a byte is copied, and the
//! sender gets exactly one final reply per transfer. Runs only on the progress thread, inside UCX
//! callbacks; never blocks and never writes outside a ticket's ranges.

use crate::config::ResolvedMode;
use crate::fast_map::FastMap;
use crate::shared::{RegionHold, Shared};
use crate::token_slab::TokenSlab;
use crate::ucp::{self, ucp_ep_h, ucs_status_t, Posted};
use crate::wire::{CommitHeader, DataHeader, ReplyHeader};
use kvgate_abi::{Event, PeerId, ReasonCode, Ticket};
use kvgate_ucx_sys as sys;
use std::cell::RefCell;
use std::collections::hash_map::Entry;
use std::ffi::c_void;
use std::sync::Arc;
use std::time::Instant;

/// Tokens of receive requests carry this bit (send-side tokens never do).
pub const RECV_TOKEN_BIT: u64 = 1 << 63;
/// A reply code with this bit is an early refusal; the sender still ends with `AM_CANCEL`.
pub const REPLY_EARLY_BIT: u32 = 1 << 31;

thread_local! {
    /// Completions of UCX requests, pushed by callbacks during progress, drained by the engine.
    pub static COMPLETIONS: RefCell<Vec<(u64, ucs_status_t)>> = const { RefCell::new(Vec::new()) };
    /// Endpoint failures: (endpoint token, status).
    pub static EP_ERRORS: RefCell<Vec<(u64, ucs_status_t)>> = const { RefCell::new(Vec::new()) };
}

/// UCX send-completion callback: records (token, status) for the engine's drain.
///
/// # Safety
/// Called by UCX on the progress thread, with the `user_data` the operation was posted with.
pub unsafe extern "C" fn send_done(_request: *mut c_void, status: ucs_status_t, user_data: *mut c_void) {
    COMPLETIONS.with(|c| c.borrow_mut().push((user_data as u64, status)));
}

/// UCX receive-completion callback: records (token, status) for the engine's drain.
///
/// # Safety
/// Called by UCX on the progress thread, with the `user_data` the receive was posted with.
pub unsafe extern "C" fn recv_done(
    _request: *mut c_void,
    status: ucs_status_t,
    _length: usize,
    user_data: *mut c_void,
) {
    COMPLETIONS.with(|c| c.borrow_mut().push((user_data as u64, status)));
}

/// UCX endpoint error handler: records (endpoint token, status) for the engine's drain.
///
/// # Safety
/// Called by UCX on the progress thread, with the endpoint's token as `arg`.
pub unsafe extern "C" fn ep_failed(arg: *mut c_void, _ep: ucp_ep_h, status: ucs_status_t) {
    EP_ERRORS.with(|c| c.borrow_mut().push((arg as u64, status)));
}

/// One incoming transfer, keyed by (sender instance, xfer).
struct IncomingXfer {
    ticket: u64,
    peer: PeerId,
    landed_bytes: u64,
    landed_segments: u64,
    pending: u64,
    expected: Option<(u64, u64)>,
    failed: Option<(ReasonCode, String)>,
    early_refusal_sent: bool,
    cancelled: bool,
    final_reply_sent: bool,
}

impl IncomingXfer {
    fn new(ticket: u64, peer: PeerId) -> IncomingXfer {
        IncomingXfer {
            ticket,
            peer,
            landed_bytes: 0,
            landed_segments: 0,
            pending: 0,
            expected: None,
            failed: None,
            early_refusal_sent: false,
            cancelled: false,
            final_reply_sent: false,
        }
    }
}

struct PendingRecv {
    request: *mut c_void,
    key: (u64, u64),
    ticket: u64,
    len: u64,
    /// The destination region, held registered (and the host's mapping with it) until UCX hands the
    /// receive back.
    _hold: Option<RegionHold>,
}

/// A reply from a receiver about one of our outgoing transfers.
pub struct SenderNotice {
    pub xfer: u64,
    pub code: u32,
}

pub struct Receiver {
    shared: Arc<Shared>,
    worker: sys::ucp_worker_h,
    records: FastMap<(u64, u64), IncomingXfer>,
    /// Rendezvous receives in flight, by token (without [`RECV_TOKEN_BIT`]).
    pending: TokenSlab<PendingRecv>,
    /// Replies to send once progress returns: (sender instance, header). They go out on this
    /// instance's own endpoint to that sender (never on UCX's reply endpoint, which UCX may destroy
    /// when the connection drops while a reply is still queued).
    pub replies: Vec<(u64, ReplyHeader)>,
    pub notices: Vec<SenderNotice>,
    /// Instances that said goodbye (shut down).
    pub byes: Vec<u64>,
}

impl Receiver {
    pub fn new(shared: Arc<Shared>, worker: sys::ucp_worker_h) -> Receiver {
        Receiver {
            shared,
            worker,
            records: FastMap::default(),
            pending: TokenSlab::default(),
            replies: Vec::new(),
            notices: Vec::new(),
            byes: Vec::new(),
        }
    }

    pub fn pending_receives(&self) -> usize {
        self.pending.len()
    }

    fn record(&mut self, sender: u64, xfer: u64, ticket: u64) -> &mut IncomingXfer {
        let shared = &self.shared;
        self.records.entry((sender, xfer)).or_insert_with(|| {
            let peer = shared.lock().instance_to_peer.get(&sender).copied().unwrap_or(PeerId(0));
            IncomingXfer::new(ticket, peer)
        })
    }

    fn fail(&mut self, key: (u64, u64), reason: ReasonCode, message: String) {
        let Some(rec) = self.records.get_mut(&key) else { return };
        if rec.failed.is_some() || rec.cancelled {
            return;
        }
        tracing::warn!(
            reason = reason.as_str(),
            peer = rec.peer.0,
            ticket = rec.ticket,
            xfer = key.1,
            "ucx incoming write refused: {message}"
        );
        self.shared.sink.deliver(Event::incoming_failed(rec.peer, Ticket(rec.ticket), reason, message.clone()));
        rec.failed = Some((reason, message));
    }

    /// `AM_DATA`: validate, then copy (eager) or start a receive straight into the region (rendezvous).
    /// Per message this takes the registry lock once and looks the record up once (a 64 KiB stream
    /// spends a few per cent of the receiving thread here; the copy itself is the rest).
    fn on_data(&mut self, header: DataHeader, data: *mut c_void, length: usize, rndv: bool) -> ucs_status_t {
        let key = (header.sender, header.xfer);
        let refuse = if rndv { ucs_status_t::UCS_ERR_REJECTED } else { ucs_status_t::UCS_OK };
        // One lock for the whole check (the record's peer, the region, the ticket).
        let mut registry = self.shared.lock();
        let sender_peer = registry.instance_to_peer.get(&header.sender).copied();
        let rec = self
            .records
            .entry(key)
            .or_insert_with(|| IncomingXfer::new(header.ticket, sender_peer.unwrap_or(PeerId(0))));
        if let Some(commit) = header.commit {
            // The transfer's last message: every other one has arrived (messages keep their order).
            rec.expected = Some(commit);
        }
        if rec.failed.is_some() || rec.cancelled || rec.final_reply_sent {
            drop(registry);
            if header.commit.is_some() {
                self.check_complete(key);
            }
            return refuse;
        }
        let verdict = check_write(&mut registry, &header, sender_peer, length, rndv, Instant::now());
        drop(registry);
        let mut dest = match verdict {
            Ok(v) => v,
            Err((reason, message)) => {
                self.fail(key, reason, message);
                self.check_complete(key);
                return refuse;
            }
        };
        if !rndv {
            // Eager: the bytes are in `data` for the duration of this callback only.
            // SAFETY: `check_write` placed `[dest.addr, dest.addr + length)` inside a registered region of
            // this instance (bounds checked against the ticket and the region), held by `dest.hold` until
            // the copy is over (`deregister` waits for it); `data` holds `length` bytes
            // for this callback's duration (eager message); the two cannot overlap (UCX's receive buffer is
            // not user memory).
            unsafe { std::ptr::copy_nonoverlapping(data as *const u8, dest.addr as *mut u8, length) };
            rec.landed_bytes += header.len;
            rec.landed_segments += 1;
            if settle(rec, key, &mut self.replies) {
                self.records.remove(&key);
            }
            return ucs_status_t::UCS_OK;
        }
        rec.pending += 1;
        let slot = self.pending.insert(PendingRecv {
            request: std::ptr::null_mut(),
            key,
            ticket: header.ticket,
            len: header.len,
            _hold: dest.hold.take(),
        });
        let param = ucp::recv_am_param(Some(recv_done), RECV_TOKEN_BIT | slot, dest.memh);
        // SAFETY: `data` is the rendezvous descriptor UCX handed this callback; the destination range was
        // checked inside a registered region, kept registered and mapped by the hold the pending receive
        // keeps until UCX hands it back (`deregister` waits for it); the request is tracked in `pending`
        // until its completion.
        let posted = ucp::classify(unsafe {
            ucp::ucp_am_recv_data_nbx(self.worker, data, dest.addr as *mut c_void, length, &param)
        });
        match posted {
            Posted::Pending(request) => self.pending.get_mut(slot).expect("just inserted").request = request,
            Posted::Done => {
                let receive = self.pending.remove(slot).expect("just inserted");
                self.receive_ended(receive, ucs_status_t::UCS_OK);
            }
            Posted::Failed(status) => {
                let receive = self.pending.remove(slot).expect("just inserted");
                self.receive_ended(receive, status);
            }
        }
        ucs_status_t::UCS_INPROGRESS
    }

    /// A rendezvous receive finished (`status`), from the engine's completion drain.
    pub fn on_recv_done(&mut self, token: u64, status: ucs_status_t) {
        let Some(p) = self.pending.remove(token & !RECV_TOKEN_BIT) else { return };
        if !p.request.is_null() {
            // SAFETY: removed from `pending` above, so freed once.
            unsafe { ucp::request_free(p.request) };
        }
        self.receive_ended(p, status);
    }

    /// A rendezvous receive is over (no longer in `pending`): count it or fail its transfer.
    fn receive_ended(&mut self, p: PendingRecv, status: ucs_status_t) {
        self.release_ticket_write(p.ticket);
        let Entry::Occupied(mut entry) = self.records.entry(p.key) else { return };
        let rec = entry.get_mut();
        rec.pending -= 1;
        if !ucp::is_ok(status) {
            let message = format!("rendezvous receive failed: {}", ucp::status_text(status));
            self.fail(p.key, ReasonCode::TRANSPORT_ERROR, message);
            self.check_complete(p.key);
            return;
        }
        rec.landed_bytes += p.len;
        rec.landed_segments += 1;
        if settle(rec, p.key, &mut self.replies) {
            entry.remove();
        }
    }

    fn release_ticket_write(&mut self, ticket: u64) {
        let mut registry = self.shared.lock();
        let Some(t) = registry.tickets.get_mut(&ticket) else { return };
        t.pending_writes = t.pending_writes.saturating_sub(1);
        if t.cancelled && t.pending_writes == 0 {
            let peer = t.peer;
            registry.tickets.remove(&ticket);
            drop(registry);
            if self.shared.mode == ResolvedMode::Am {
                self.shared.sink.deliver(Event::incoming_quiesced(peer, Ticket(ticket)));
            }
        }
    }

    /// `AM_COMMIT`: the sender posted every segment.
    fn on_commit(&mut self, header: CommitHeader) {
        let key = (header.sender, header.xfer);
        let rec = self.record(header.sender, header.xfer, header.ticket);
        rec.expected = Some((header.segments, header.bytes));
        if header.segments == 0 {
            // Nothing to land: still check that the ticket authorises this sender.
            let now = Instant::now();
            let registry = self.shared.lock();
            let peer = registry.instance_to_peer.get(&header.sender).copied();
            let ok = peer.is_some()
                && registry.tickets.get(&header.ticket).is_some_and(|t| {
                    (Some(t.peer) == peer || registry.sender_is_peer(header.sender, t.peer)) && t.authorises(now)
                });
            drop(registry);
            if !ok {
                self.fail(
                    key,
                    ReasonCode::NOT_EXPECTED,
                    format!("empty transfer under unknown or revoked ticket {}", header.ticket),
                );
            }
        }
        self.check_complete(key);
    }

    /// `AM_CANCEL`: the sender's last message; drop anything more and answer once nothing can land.
    fn on_cancel(&mut self, header: CommitHeader) {
        let key = (header.sender, header.xfer);
        let rec = self.record(header.sender, header.xfer, header.ticket);
        rec.cancelled = true;
        self.check_complete(key);
    }

    fn check_complete(&mut self, key: (u64, u64)) {
        let Entry::Occupied(mut entry) = self.records.entry(key) else { return };
        if settle(entry.get_mut(), key, &mut self.replies) {
            entry.remove();
        }
    }

    /// Drop finished tombstones and records whose ticket is gone with nothing in flight.
    pub fn sweep(&mut self, now: Instant) {
        let registry = self.shared.lock();
        self.records.retain(|_, rec| {
            let ticket_live = registry.tickets.get(&rec.ticket).is_some_and(|t| t.authorises(now));
            rec.pending > 0 || ticket_live
        });
    }

    /// Every live rendezvous receive request (for shutdown).
    pub fn pending_requests(&self) -> Vec<*mut c_void> {
        self.pending.values().map(|p| p.request).filter(|r| !r.is_null()).collect()
    }
}

/// Where a checked write lands.
struct Destination {
    addr: u64,
    memh: sys::ucp_mem_h,
    /// The write's hold on the region (a rendezvous receive keeps it until UCX hands it back).
    hold: Option<RegionHold>,
}

/// Whether `header`'s write may land: a known sender, the length it claims, a registered region
/// that holds it, and a live ticket of that sender covering it. Counts a rendezvous write as pending
/// on its ticket.
fn check_write(
    registry: &mut crate::shared::Registry,
    header: &DataHeader,
    sender_peer: Option<PeerId>,
    length: usize,
    rndv: bool,
    now: Instant,
) -> Result<Destination, (ReasonCode, String)> {
    let peer = sender_peer.ok_or_else(|| {
        (ReasonCode::NOT_EXPECTED, format!("write from unknown sender instance {:#x}", header.sender))
    })?;
    if header.len != length as u64 {
        return Err((
            ReasonCode::PROTOCOL_VIOLATION,
            format!("header says {} bytes, message has {length}", header.len),
        ));
    }
    let region = registry
        .regions
        .get(&header.region)
        .ok_or_else(|| (ReasonCode::UNKNOWN_KEY, format!("no registered region {}", header.region)))?;
    if header.offset.checked_add(header.len).is_none_or(|end| end > region.len) {
        return Err((
            ReasonCode::OUT_OF_RANGE,
            format!("{}+{} outside region {} of {} bytes", header.offset, header.len, header.region, region.len),
        ));
    }
    // The write holds the region (taken under the registry lock, which `deregister` closes the
    // region to new requests under): an eager copy for the callback's duration (it runs after the
    // lock is dropped), a rendezvous receive until UCX hands it back.
    let hold = RegionHold::try_new(region)
        .ok_or_else(|| (ReasonCode::UNKNOWN_KEY, format!("region {} is being deregistered", header.region)))?;
    let dest = Destination { addr: region.addr + header.offset, memh: region.map.memh, hold: Some(hold) };
    let crate::shared::Registry { tickets, peers, .. } = registry;
    let ticket = tickets
        .get_mut(&header.ticket)
        .ok_or_else(|| (ReasonCode::NOT_EXPECTED, format!("no ticket {}", header.ticket)))?;
    // Several peer ids may name one instance: the ticket's peer must be one of them.
    if ticket.peer != peer && !crate::shared::sender_is_peer(peers, header.sender, ticket.peer) {
        return Err((
            ReasonCode::NOT_EXPECTED,
            format!("ticket {} belongs to peer {}, write came from peer {}", header.ticket, ticket.peer.0, peer.0),
        ));
    }
    if !ticket.authorises(now) {
        return Err((ReasonCode::NOT_EXPECTED, format!("ticket {} cancelled or expired", header.ticket)));
    }
    if !ticket.allows(header.region, header.offset, header.len) {
        return Err((
            ReasonCode::OUT_OF_RANGE,
            format!(
                "{}+{} of region {} not covered by ticket {}",
                header.offset, header.len, header.region, header.ticket
            ),
        ));
    }
    if rndv {
        ticket.pending_writes += 1;
    }
    Ok(dest)
}

/// Queue the reply `rec` is due, if any: an early refusal while writes are still landing, the final
/// reply once nothing can land any more. True when the record is finished with (succeeded) and
/// should be dropped; a failed or cancelled one stays as a tombstone until swept.
fn settle(rec: &mut IncomingXfer, key: (u64, u64), replies: &mut Vec<(u64, ReplyHeader)>) -> bool {
    if rec.final_reply_sent {
        return false;
    }
    if rec.pending > 0 {
        if let Some((reason, _)) = &rec.failed {
            if !rec.early_refusal_sent {
                rec.early_refusal_sent = true;
                replies.push((key.0, ReplyHeader { xfer: key.1, code: reason.0 | REPLY_EARLY_BIT }));
            }
        }
        return false;
    }
    let code = if rec.cancelled {
        Some(rec.failed.as_ref().map(|f| f.0).unwrap_or(ReasonCode::CANCELLED).0)
    } else if let Some((reason, _)) = &rec.failed {
        if rec.expected.is_some() {
            Some(reason.0)
        } else {
            if !rec.early_refusal_sent {
                rec.early_refusal_sent = true;
                replies.push((key.0, ReplyHeader { xfer: key.1, code: reason.0 | REPLY_EARLY_BIT }));
            }
            None
        }
    } else {
        match rec.expected {
            Some((segments, bytes)) if rec.landed_segments == segments && rec.landed_bytes == bytes => Some(0),
            Some((segments, bytes)) if rec.landed_segments > segments || rec.landed_bytes > bytes => {
                Some(ReasonCode::PROTOCOL_VIOLATION.0)
            }
            _ => None,
        }
    };
    let Some(code) = code else { return false };
    rec.final_reply_sent = true;
    replies.push((key.0, ReplyHeader { xfer: key.1, code }));
    code == 0
}

fn header_bytes<'a>(header: *const c_void, len: usize) -> &'a [u8] {
    if header.is_null() || len == 0 {
        &[]
    } else {
        // SAFETY: UCX hands the handler a header of `len` bytes at `header` (not null here), valid for the
        // callback's duration, which outlives the returned slice's use.
        unsafe { std::slice::from_raw_parts(header as *const u8, len) }
    }
}

unsafe fn receiver_of<'a>(arg: *mut c_void) -> Option<std::cell::RefMut<'a, Receiver>> {
    let cell = &*(arg as *const RefCell<Receiver>);
    cell.try_borrow_mut().ok()
}

fn is_rndv(param: *const sys::ucp_am_recv_param_t) -> bool {
    // SAFETY: UCX passes a valid `ucp_am_recv_param_t` to every active-message handler, read here during the
    // callback.
    unsafe { (*param).recv_attr & ucp::ucp_am_recv_attr_t::UCP_AM_RECV_ATTR_FLAG_RNDV.0 as u64 != 0 }
}

/// UCX active-message handler for `AM_DATA`.
///
/// # Safety
/// Called by UCX on the progress thread: `arg` is the `RefCell<Receiver>` the handler was set with,
/// and `header`/`data` are valid for `header_length`/`length` bytes during the call.
pub unsafe extern "C" fn am_data(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> ucs_status_t {
    let rndv = is_rndv(param);
    let refuse = if rndv { ucs_status_t::UCS_ERR_REJECTED } else { ucs_status_t::UCS_OK };
    let Some(header) = DataHeader::decode(header_bytes(header, header_length)) else { return refuse };
    let Some(mut receiver) = receiver_of(arg) else { return refuse };
    receiver.on_data(header, data, length, rndv)
}

/// UCX active-message handler for `AM_COMMIT`.
///
/// # Safety
/// As for [`am_data`].
pub unsafe extern "C" fn am_commit(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    _data: *mut c_void,
    _length: usize,
    _param: *const sys::ucp_am_recv_param_t,
) -> ucs_status_t {
    if let (Some(header), Some(mut receiver)) =
        (CommitHeader::decode(header_bytes(header, header_length)), receiver_of(arg))
    {
        receiver.on_commit(header);
    }
    ucs_status_t::UCS_OK
}

/// UCX active-message handler for `AM_CANCEL`.
///
/// # Safety
/// As for [`am_data`].
pub unsafe extern "C" fn am_cancel(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    _data: *mut c_void,
    _length: usize,
    _param: *const sys::ucp_am_recv_param_t,
) -> ucs_status_t {
    if let (Some(header), Some(mut receiver)) =
        (CommitHeader::decode(header_bytes(header, header_length)), receiver_of(arg))
    {
        receiver.on_cancel(header);
    }
    ucs_status_t::UCS_OK
}

/// UCX active-message handler for `AM_REPLY`.
///
/// # Safety
/// As for [`am_data`].
pub unsafe extern "C" fn am_reply(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    _data: *mut c_void,
    _length: usize,
    _param: *const sys::ucp_am_recv_param_t,
) -> ucs_status_t {
    if let (Some(replies), Some(mut receiver)) =
        (crate::wire::decode_replies(header_bytes(header, header_length)), receiver_of(arg))
    {
        receiver.notices.extend(replies.map(|r| SenderNotice { xfer: r.xfer, code: r.code }));
    }
    ucs_status_t::UCS_OK
}

/// UCX active-message handler for `AM_BYE`.
///
/// # Safety
/// As for [`am_data`].
pub unsafe extern "C" fn am_bye(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    _data: *mut c_void,
    _length: usize,
    _param: *const sys::ucp_am_recv_param_t,
) -> ucs_status_t {
    if let (Some(instance), Some(mut receiver)) =
        (crate::wire::decode_bye(header_bytes(header, header_length)), receiver_of(arg))
    {
        receiver.byes.push(instance);
    }
    ucs_status_t::UCS_OK
}

#[cfg(test)]
mod tests {
    //! The reply a transfer's record is due (`settle`), case by case: the receiver's side of
    //! "exactly one final reply per transfer, and success only once every byte landed".
    use super::*;

    const KEY: (u64, u64) = (0xa11ce, 7);

    fn record() -> IncomingXfer {
        IncomingXfer::new(1, PeerId(2))
    }

    /// A record whose commit announced `expected` (segments, bytes) and where `landed` has landed.
    fn committed(expected: (u64, u64), landed: (u64, u64)) -> IncomingXfer {
        let mut rec = record();
        rec.expected = Some(expected);
        (rec.landed_segments, rec.landed_bytes) = landed;
        rec
    }

    fn codes(replies: &[(u64, ReplyHeader)]) -> Vec<u32> {
        assert!(
            replies.iter().all(|(sender, r)| *sender == KEY.0 && r.xfer == KEY.1),
            "replies go to the sender, about this transfer"
        );
        replies.iter().map(|(_, r)| r.code).collect()
    }

    #[test]
    fn success_only_once_every_announced_byte_landed() {
        let (mut rec, mut replies) = (record(), Vec::new());
        rec.landed_segments = 2;
        rec.landed_bytes = 2048;
        assert!(!settle(&mut rec, KEY, &mut replies), "no commit yet: nothing to say");
        rec.expected = Some((3, 3072));
        assert!(!settle(&mut rec, KEY, &mut replies), "one message still missing");
        assert!(replies.is_empty());
        rec.landed_segments = 3;
        rec.landed_bytes = 3072;
        assert!(settle(&mut rec, KEY, &mut replies), "done: the record can go");
        assert_eq!(codes(&replies), [0]);
        assert!(!settle(&mut rec, KEY, &mut replies), "a final reply is sent once");
        assert_eq!(replies.len(), 1);
    }

    #[test]
    fn no_final_reply_while_a_receive_is_still_writing() {
        let (mut rec, mut replies) = (committed((1, 64), (1, 64)), Vec::new());
        rec.pending = 1;
        assert!(!settle(&mut rec, KEY, &mut replies));
        assert!(replies.is_empty());
    }

    #[test]
    fn more_than_announced_is_a_protocol_violation() {
        let (mut rec, mut replies) = (committed((1, 64), (2, 128)), Vec::new());
        assert!(!settle(&mut rec, KEY, &mut replies), "a failed record stays as a tombstone");
        assert_eq!(codes(&replies), [ReasonCode::PROTOCOL_VIOLATION.0]);
    }

    #[test]
    fn a_refusal_is_answered_early_once_then_finally_after_the_commit() {
        let (mut rec, mut replies) = (record(), Vec::new());
        rec.failed = Some((ReasonCode::OUT_OF_RANGE, "outside".into()));
        rec.pending = 1;
        assert!(!settle(&mut rec, KEY, &mut replies));
        assert!(!settle(&mut rec, KEY, &mut replies));
        assert_eq!(
            codes(&replies),
            [ReasonCode::OUT_OF_RANGE.0 | REPLY_EARLY_BIT],
            "one early refusal while writes land"
        );
        rec.pending = 0;
        rec.expected = Some((2, 128));
        assert!(!settle(&mut rec, KEY, &mut replies));
        assert_eq!(codes(&replies), [ReasonCode::OUT_OF_RANGE.0 | REPLY_EARLY_BIT, ReasonCode::OUT_OF_RANGE.0]);
        assert!(rec.final_reply_sent);
    }

    #[test]
    fn a_refusal_before_the_commit_and_with_nothing_pending_is_answered_early() {
        let (mut rec, mut replies) = (record(), Vec::new());
        rec.failed = Some((ReasonCode::NOT_EXPECTED, "no ticket".into()));
        assert!(!settle(&mut rec, KEY, &mut replies));
        assert_eq!(codes(&replies), [ReasonCode::NOT_EXPECTED.0 | REPLY_EARLY_BIT]);
        assert!(!rec.final_reply_sent, "the final reply waits for the commit or the cancel");
    }

    #[test]
    fn a_cancel_is_answered_once_nothing_can_land_with_the_refusal_if_any() {
        let (mut rec, mut replies) = (record(), Vec::new());
        rec.cancelled = true;
        rec.pending = 1;
        assert!(!settle(&mut rec, KEY, &mut replies));
        assert!(replies.is_empty(), "a receive still writes: no answer yet");
        rec.pending = 0;
        assert!(!settle(&mut rec, KEY, &mut replies));
        assert_eq!(codes(&replies), [ReasonCode::CANCELLED.0]);

        let (mut refused, mut replies) = (record(), Vec::new());
        refused.cancelled = true;
        refused.failed = Some((ReasonCode::OUT_OF_RANGE, "outside".into()));
        assert!(!settle(&mut refused, KEY, &mut replies));
        assert_eq!(codes(&replies), [ReasonCode::OUT_OF_RANGE.0], "the refusal's reason, not a plain cancel");
    }
}
