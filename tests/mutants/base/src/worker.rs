//! The worker thread: reads control datagrams, promotes transfers whose ticket was granted, copies
//! one transfer at a time (stopping between pieces on cancel or deadline), flushes the outbox and
//! fires deadlines. Never blocks: the socket is non-blocking and the idle wait is a 1 ms poll. The
//! UDP variant's copy and receiving side are in `udp_tx.rs` and `udp_rx.rs`.

use crate::plugin::{Phase, Piece, Shared, State, COMMIT_GRACE_MS};
use crate::wire::Msg;
use kvgate_abi::{Event, ReasonCode, XferId};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Largest piece copied between two checks of the stop flag and the deadline.
const COPY_PIECE_BYTES: u64 = 1 << 20;
/// Messages packed into one datagram.
const MESSAGES_PER_DATAGRAM: usize = 256;

pub(crate) enum Stopped {
    Completed,
    Cancelled,
    Timeout,
    OutOfRange(usize),
}

pub(crate) fn run(shared: &Arc<Shared>) {
    let mut buf = vec![0u8; 65536];
    while !shared.stop_worker.load(Ordering::SeqCst) {
        receive(shared, &mut buf);
        let job = {
            let mut st = shared.lock();
            fire_deadlines(shared, &mut st);
            end_one_queued_cancel(shared, &mut st);
            pick_job(&mut st)
        };
        let busy = job.is_some();
        if let Some((xfer, peer, pieces, stop, deadline)) = job {
            if shared.socket.is_udp() {
                let (stopped, datagrams) = crate::udp_tx::copy(shared, xfer, peer, &pieces, &stop, deadline, &mut buf);
                finish(shared, xfer, stopped, datagrams, deadline);
            } else {
                let stopped = copy(shared, xfer, &pieces, &stop, deadline);
                finish(shared, xfer, stopped, 0, deadline);
            }
        }
        flush(shared);
        if !busy {
            wait_readable(shared);
        }
    }
    shared.worker_alive.store(false, Ordering::SeqCst);
}

/// Wait up to 1 ms for a datagram.
pub(crate) fn wait_readable(shared: &Shared) {
    let mut pfd = libc::pollfd { fd: shared.socket.raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd, 1 ms timeout.
    unsafe { libc::poll(&mut pfd, 1, 1) };
}

pub(crate) fn receive(shared: &Shared, buf: &mut [u8]) {
    let mut gots: Vec<(String, u64)> = Vec::new();
    while let Ok((n, from)) = shared.socket.recv_from(buf) {
        let Some(from) = from else { continue };
        let datagram = &buf[..n];
        if shared.socket.is_udp() && crate::udp_wire::is_data(datagram) {
            if let Some(xfer) = crate::udp_rx::stage(shared, &mut shared.lock(), &from, datagram) {
                if !gots.contains(&(from.clone(), xfer)) {
                    gots.push((from, xfer));
                }
            }
            continue;
        }
        let Some(text) = shared.socket.unframe(datagram) else { continue };
        let mut st = shared.lock();
        let peers = Shared::peers_at(&st, &from);
        for msg in text.lines().filter_map(Msg::parse) {
            match msg {
                Msg::Ticket(t) => peers.iter().for_each(|p| {
                    st.granted.insert((*p, t));
                }),
                Msg::Revoke(t) => peers.iter().for_each(|p| {
                    st.granted.remove(&(*p, t));
                }),
                // FAULT: `never_acknowledge` leaves the sender waiting.
                Msg::Done(x) if !shared.faults.never_acknowledge => st.outbox.push((from.clone(), Msg::Ack(x))),
                Msg::Done(_) => {}
                Msg::Ack(x) => acknowledge(shared, &mut st, x, &peers, true),
                Msg::Nack(x) => acknowledge(shared, &mut st, x, &peers, false),
                Msg::Note(_) => {}
                Msg::Hello(port) => {
                    for p in Shared::peers_at(&st, &format!("127.0.0.1:{port}")) {
                        st.routes.insert(p, from.clone());
                        // Tickets granted before the hello went to the endpoint; send them this way too.
                        let tickets: Vec<u64> = st.tickets.keys().filter(|(tp, _)| *tp == p).map(|(_, t)| *t).collect();
                        st.outbox.extend(tickets.into_iter().map(|t| (from.clone(), Msg::Ticket(t))));
                    }
                }
                Msg::Got(x, n) => {
                    if st.transfers.get(&x).is_some_and(|t| peers.contains(&t.peer)) {
                        let staged = st.got.entry(x).or_insert(0);
                        *staged = (*staged).max(n);
                    }
                }
                Msg::Commit(x, n, expiry_ns) => {
                    let answer = crate::udp_rx::commit(&mut st, &from, x, n, expiry_ns);
                    st.outbox.push((from.clone(), answer));
                }
            }
        }
    }
    if !gots.is_empty() {
        let mut st = shared.lock();
        for (from, xfer) in gots {
            if let Some(msg) = crate::udp_rx::got(&st, &from, xfer) {
                st.outbox.push((from, msg));
            }
        }
    }
}

/// The receiver's answer to `Done` (`ACK`) or to a commit (`ACK` or `NACK`).
fn acknowledge(shared: &Shared, st: &mut State, xfer: u64, from: &[u64], written: bool) {
    let Some(t) = st.transfers.get(&xfer) else { return };
    if !from.contains(&t.peer) {
        return;
    }
    if t.phase == Phase::Unquiesced {
        // Failed while its commit was out: written or refused, nothing more can land.
        st.transfers.remove(&xfer);
        shared.sink.deliver(Event::quiesced(XferId(xfer)));
        return;
    }
    if t.reported || t.phase != Phase::WaitingForAck {
        return;
    }
    st.transfers.remove(&xfer);
    if !written {
        shared.failed(xfer, ReasonCode::TRANSPORT_ERROR, "the receiver refused the commit".into(), true);
        return;
    }
    let nth = shared.successes.fetch_add(1, Ordering::SeqCst) + 1;
    // FAULT: the transfer is done and forgotten, and its terminal event never leaves.
    if shared.faults.lose_some_successes && nth.is_multiple_of(crate::LOST_SUCCESS_EVERY) {
        return;
    }
    shared.sink.deliver(Event::succeeded(XferId(xfer), 0));
    if shared.faults.double_success {
        // FAULT: a second terminal event.
        shared.sink.deliver(Event::succeeded(XferId(xfer), 0));
    }
}

pub(crate) fn fire_deadlines(shared: &Shared, st: &mut State) {
    let now = Instant::now();
    st.tickets.retain(|_, expiry| *expiry > now);
    crate::udp_rx::purge(st);
    let grace = Duration::from_millis(COMMIT_GRACE_MS);
    let settled: Vec<u64> = st
        .transfers
        .iter()
        .filter(|(_, t)| t.phase == Phase::Unquiesced && t.deadline + grace <= now)
        .map(|(x, _)| *x)
        .collect();
    for x in settled {
        // Past the deadline the receiver refuses the commit: nothing more can land.
        st.transfers.remove(&x);
        shared.sink.deliver(Event::quiesced(XferId(x)));
    }
    let due: Vec<u64> = st
        .transfers
        .iter()
        .filter(|(_, t)| {
            !t.reported && t.deadline <= now && !matches!(t.phase, Phase::Leaked | Phase::Copying | Phase::Unquiesced)
        })
        // FAULT: a transfer waiting for its ticket is swept a coarse timer's period late.
        .filter(|(_, t)| {
            let coarse = shared.faults.coarse_deadline_while_waiting_for_ticket && t.phase == Phase::WaitingForTicket;
            !coarse || t.deadline + Duration::from_millis(crate::COARSE_SWEEP_MS) <= now
        })
        // FAULT: no deadline while waiting for the receiver's acknowledgement.
        .filter(|(_, t)| !(shared.faults.no_deadline_while_waiting_for_ack && t.phase == Phase::WaitingForAck))
        .map(|(x, _)| *x)
        .collect();
    for x in due {
        let t = st.transfers.get_mut(&x).expect("listed");
        if shared.awaits_verdict(t) {
            shared.fail_unquiesced(t, x, ReasonCode::TIMEOUT, "transfer deadline passed with its commit unanswered");
        } else {
            st.transfers.remove(&x);
            shared.failed(x, ReasonCode::TIMEOUT, "transfer deadline passed".into(), true);
        }
    }
    let granted = st.granted.clone();
    for t in st.transfers.values_mut() {
        if t.phase == Phase::WaitingForTicket && granted.contains(&(t.peer, t.ticket)) {
            t.phase = Phase::Ready;
        }
    }
}

/// `cancel_queued_when_busy`: end the oldest queued cancelled transfer, at most one per
/// [`crate::QUEUED_CANCEL_TICK_MS`].
fn end_one_queued_cancel(shared: &Shared, st: &mut State) {
    let tick = Duration::from_millis(crate::QUEUED_CANCEL_TICK_MS);
    if st.queued_cancels.is_empty() || st.last_queued_cancel.is_some_and(|t| t.elapsed() < tick) {
        return;
    }
    st.last_queued_cancel = Some(Instant::now());
    while let Some(x) = st.queued_cancels.pop_front() {
        let Some(t) = st.transfers.get_mut(&x) else { continue };
        if t.reported {
            continue;
        }
        if shared.awaits_verdict(t) {
            shared.fail_unquiesced(t, x, ReasonCode::CANCELLED, "cancelled with its commit unanswered");
        } else {
            st.transfers.remove(&x);
            shared.failed(x, ReasonCode::CANCELLED, "cancelled".into(), true);
        }
        return;
    }
}

type Job = (u64, u64, Arc<Vec<Piece>>, Arc<AtomicBool>, Instant);

fn pick_job(st: &mut State) -> Option<Job> {
    let (x, t) = st
        .transfers
        .iter_mut()
        .filter(|(_, t)| t.phase == Phase::Ready && !t.reported && !t.cancel_queued)
        .min_by_key(|(x, _)| **x)?;
    t.phase = Phase::Copying;
    Some((*x, t.peer, Arc::clone(&t.pieces), Arc::clone(&t.stop), t.deadline))
}

fn copy(shared: &Shared, xfer: u64, pieces: &[Piece], stop: &Arc<AtomicBool>, deadline: Instant) -> Stopped {
    let mut stopped = Stopped::Completed;
    let mut moved = 0u64;
    let started = Instant::now();
    let rate = shared.faults.copy_bytes_per_ms;
    let mut paced = 0u64;
    'pieces: for (i, p) in pieces.iter().enumerate() {
        // FAULT: `quiesce_before_copy_stops` looks at the stop flag here only, between segments.
        if shared.faults.quiesce_before_copy_stops && stop.load(Ordering::SeqCst) {
            stopped = Stopped::Cancelled;
            break 'pieces;
        }
        // FAULT: the segments past a fixed-size list are never copied; the transfer succeeds anyway.
        if shared.faults.copy_first_segments_only && i == crate::COPIED_SEGMENTS_LIMIT {
            break;
        }
        if !p.in_range {
            stopped = Stopped::OutOfRange(i);
            break;
        }
        if shared.faults.succeed_before_last_segment && i + 1 == pieces.len() {
            // FAULT: success reported before the last segment is written.
            {
                let mut st = shared.lock();
                if let Some(t) = st.transfers.get_mut(&xfer) {
                    if !t.reported {
                        t.reported = true;
                        t.phase = Phase::Finishing;
                        shared.sink.deliver(Event::succeeded(XferId(xfer), 0));
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let mut done = 0;
        while done < p.len {
            if stop.load(Ordering::SeqCst) && !shared.faults.quiesce_before_copy_stops {
                stopped = Stopped::Cancelled;
                break 'pieces;
            }
            // FAULT: `no_deadline_during_copy` copies on past the deadline.
            if Instant::now() >= deadline && !shared.faults.no_deadline_during_copy {
                stopped = Stopped::Timeout;
                break 'pieces;
            }
            let piece = if rate > 0 { rate.clamp(1, COPY_PIECE_BYTES) } else { COPY_PIECE_BYTES };
            let n = (p.len - done).min(piece);
            // SAFETY: both ranges were checked against their regions at submit and the mappings
            // are kept alive by the transfer; the host keeps local memory mapped until deregister,
            // which waits for this copy to stop.
            unsafe {
                std::ptr::copy_nonoverlapping((p.src + done) as *const u8, (p.dst + done) as *mut u8, n as usize)
            };
            done += n;
            // The rate limit: no faster than `rate` bytes per millisecond since the copy began.
            paced += n;
            if let Some(us) = (paced * 1000).checked_div(rate) {
                let due = started + Duration::from_micros(us);
                if let Some(wait) = due.checked_duration_since(Instant::now()) {
                    std::thread::sleep(wait);
                }
            }
        }
        moved += p.len;
        if shared.faults.progress_events {
            // FAULT: `progress_per_segment` reports the segment's own bytes, not the running total.
            let bytes = if shared.faults.progress_per_segment { p.len } else { moved };
            // Under the lock, and only while the transfer is not yet reported: never after its
            // terminal event.
            let st = shared.lock();
            if st.transfers.get(&xfer).is_some_and(|t| !t.reported) {
                shared.sink.deliver(Event::progress(XferId(xfer), bytes));
            }
        }
        if shared.segment_delay_us > 0 {
            std::thread::sleep(Duration::from_micros(shared.segment_delay_us));
        }
    }
    stopped
}

/// Report how a copy ended; a completed one waits for the receiver (`DONE`, or a UDP commit naming
/// `datagrams`).
fn finish(shared: &Shared, xfer: u64, mut stopped: Stopped, datagrams: u32, deadline: Instant) {
    let mut st = shared.lock();
    st.got.remove(&xfer);
    let Some(t) = st.transfers.get_mut(&xfer) else { return };
    // FAULT: a copy stopped because its source went counts as complete.
    if t.fail_open {
        stopped = Stopped::Completed;
    }
    match stopped {
        _ if t.phase == Phase::Finishing => {
            st.transfers.remove(&xfer);
        }
        Stopped::Cancelled => {
            st.transfers.remove(&xfer);
            shared.sink.deliver(Event::quiesced(XferId(xfer)));
        }
        Stopped::Timeout => {
            st.transfers.remove(&xfer);
            shared.failed(xfer, ReasonCode::TIMEOUT, "transfer deadline passed mid-copy".into(), true);
        }
        Stopped::OutOfRange(i) => {
            st.transfers.remove(&xfer);
            shared.failed(xfer, ReasonCode::OUT_OF_RANGE, format!("segment {i} outside its region"), true);
        }
        Stopped::Completed if t.reported => {
            // Cancelled after the last piece: the failure is out, nothing more can land.
            st.transfers.remove(&xfer);
            shared.sink.deliver(Event::quiesced(XferId(xfer)));
        }
        Stopped::Completed => {
            t.phase = Phase::WaitingForAck;
            let peer = t.peer;
            let msg = if shared.socket.is_udp() {
                let expiry_ns =
                    crate::udp_wire::mono_ns() + deadline.saturating_duration_since(Instant::now()).as_nanos() as u64;
                Msg::Commit(xfer, datagrams, expiry_ns)
            } else {
                Msg::Done(xfer)
            };
            if let Some(endpoint) = st.peers.get(&peer).cloned() {
                st.outbox.push((endpoint, msg));
            }
        }
    }
}

pub(crate) fn flush(shared: &Shared) {
    let outbox = std::mem::take(&mut shared.lock().outbox);
    if outbox.is_empty() {
        return;
    }
    let mut by_endpoint: Vec<(String, Vec<String>)> = Vec::new();
    for (endpoint, msg) in &outbox {
        match by_endpoint.iter_mut().find(|(e, _)| e == endpoint) {
            Some((_, list)) => list.push(msg.encode()),
            None => by_endpoint.push((endpoint.clone(), vec![msg.encode()])),
        }
    }
    let mut keep: Vec<(String, Msg)> = Vec::new();
    let mut unreachable: Vec<String> = Vec::new();
    for (endpoint, lines) in by_endpoint {
        let chunks: Vec<&[String]> = lines.chunks(MESSAGES_PER_DATAGRAM).collect();
        for (i, chunk) in chunks.iter().enumerate() {
            match shared.socket.send_to(&shared.socket.frame(&chunk.join("\n")), &endpoint) {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    // The peer is slow or frozen: keep the rest for the next round.
                    for rest in &chunks[i..] {
                        keep.extend(rest.iter().filter_map(|l| Msg::parse(l)).map(|m| (endpoint.clone(), m)));
                    }
                    break;
                }
                Err(_) => {
                    unreachable.push(endpoint.clone());
                    break;
                }
            }
        }
    }
    let mut st = shared.lock();
    keep.append(&mut st.outbox);
    st.outbox = keep;
    for endpoint in unreachable {
        let peers = Shared::peers_at(&st, &endpoint);
        shared.fail_where(&mut st, ReasonCode::PEER_LOST, "peer unreachable (its socket is gone)", |t| {
            peers.contains(&t.peer)
        });
    }
}
