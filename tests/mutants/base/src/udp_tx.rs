//! The UDP variant's sending side: a transfer's segments packed into data datagrams of at most
//! [`DATAGRAM_BYTES`], sent [`WINDOW_DATAGRAMS`] ahead of the receiver's cumulative `GOT`, the
//! window sent again after [`RETRANSMIT_AFTER_MS`] without progress. Stops on cancel and at the
//! deadline, and keeps the worker's other duties (reading, deadlines, the outbox) going while it
//! waits. FAULT: `no_deadline_while_waiting_for_window` waits for a window for ever.

use crate::plugin::{Piece, Shared};
use crate::udp_wire::{encode_data, Record, RECORD_OVERHEAD};
use crate::worker::Stopped;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Most payload and record-header bytes in one data datagram.
const DATAGRAM_BYTES: usize = 16 * 1024;
/// Data datagrams sent ahead of the receiver's cumulative acknowledgement.
const WINDOW_DATAGRAMS: u32 = 4;
/// Without progress this long, the window is sent again from its first datagram.
const RETRANSMIT_AFTER_MS: u64 = 200;

/// (piece, offset in it, length) of each record of each datagram.
type Plan = Vec<Vec<(usize, u64, u64)>>;

fn plan(pieces: &[Piece]) -> Result<Plan, usize> {
    let (mut plan, mut current, mut used) = (Vec::new(), Vec::new(), 0usize);
    for (i, p) in pieces.iter().enumerate() {
        if !p.in_range {
            return Err(i);
        }
        let mut off = 0;
        loop {
            if DATAGRAM_BYTES - used <= RECORD_OVERHEAD {
                plan.push(std::mem::take(&mut current));
                used = 0;
            }
            let n = (p.len - off).min((DATAGRAM_BYTES - used - RECORD_OVERHEAD) as u64);
            current.push((i, off, n));
            used += RECORD_OVERHEAD + n as usize;
            off += n;
            if off >= p.len {
                break;
            }
        }
    }
    if !current.is_empty() {
        plan.push(current);
    }
    Ok(plan)
}

/// Send every datagram of the transfer and wait until the receiver has staged them all. On
/// `Completed`, returns how many datagrams the commit must name.
pub(crate) fn copy(
    shared: &Shared,
    xfer: u64,
    peer: u64,
    pieces: &[Piece],
    stop: &AtomicBool,
    deadline: Instant,
    buf: &mut [u8],
) -> (Stopped, u32) {
    let plan = match plan(pieces) {
        Ok(plan) => plan,
        Err(i) => return (Stopped::OutOfRange(i), 0),
    };
    let total = plan.len() as u32;
    let (mut next, mut acked, mut progress_at) = (0u32, 0u32, Instant::now());
    loop {
        let (staged, dest) = {
            let st = shared.lock();
            (st.got.get(&xfer).copied().unwrap_or(0), st.peers.get(&peer).cloned())
        };
        if staged > acked {
            acked = staged;
            progress_at = Instant::now();
        }
        if acked >= total {
            return (Stopped::Completed, total);
        }
        let Some(dest) = dest else { return (Stopped::Cancelled, 0) };
        if stop.load(Ordering::SeqCst) {
            return (Stopped::Cancelled, 0);
        }
        let waiting = next > acked;
        // FAULT: a window the receiver never takes is waited for past the deadline.
        if Instant::now() >= deadline && !(shared.faults.no_deadline_while_waiting_for_window && waiting) {
            return (Stopped::Timeout, 0);
        }
        if waiting && progress_at.elapsed() >= Duration::from_millis(RETRANSMIT_AFTER_MS) {
            next = acked;
            progress_at = Instant::now();
        }
        while next < total && next < acked + WINDOW_DATAGRAMS && !stop.load(Ordering::SeqCst) {
            let records: Vec<Record<'_>> = plan[next as usize]
                .iter()
                .map(|&(i, off, n)| {
                    let p = &pieces[i];
                    // SAFETY: checked against the local region at submit; the host keeps it mapped
                    // until deregister, which waits for this copy to stop.
                    let bytes = unsafe { std::slice::from_raw_parts((p.src + off) as *const u8, n as usize) };
                    Record { key: p.remote_key, offset: p.remote_offset + off, bytes }
                })
                .collect();
            // A send that fails is a datagram lost: the window goes again.
            let _ = shared.socket.send_to(&encode_data(xfer, next, &records), &dest);
            next += 1;
            if shared.segment_delay_us > 0 {
                std::thread::sleep(Duration::from_micros(shared.segment_delay_us * records.len() as u64));
            }
        }
        crate::worker::wait_readable(shared);
        crate::worker::receive(shared, buf);
        crate::worker::fire_deadlines(shared, &mut shared.lock());
        crate::worker::flush(shared);
    }
}
