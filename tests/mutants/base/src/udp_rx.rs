//! The UDP variant's receiving side: data datagrams staged in order per (sender, transfer), answered
//! with a cumulative `GOT`; on the sender's commit the staged bytes are written into the local regions
//! and answered `ACK`, or refused with `NACK` (data missing, deadline passed, a region gone). Nothing
//! is written before the commit, so a sender that stops before committing leaves the destination as
//! it was. FAULT: `unchecked_payloads` stages datagrams without checking their checksum.

use crate::plugin::{Shared, State};
use crate::udp_wire::{decode_data, mono_ns};
use crate::wire::Msg;
use std::time::{Duration, Instant};

/// A staged transfer untouched this long is dropped (its sender gave up before committing).
const STALE_INCOMING_MS: u64 = 30_000;

pub(crate) struct Incoming {
    /// Data datagrams staged so far (the next sequence number expected).
    pub next: u32,
    /// (local key, offset, bytes) in arrival order.
    records: Vec<(u64, u64, Vec<u8>)>,
    touched: Instant,
}

fn fits(st: &State, key: u64, offset: u64, len: usize) -> bool {
    st.regions
        .get(&key)
        .is_some_and(|&(_, region_len)| offset.checked_add(len as u64).is_some_and(|end| end <= region_len))
}

/// Stage one data datagram from `from`; returns the transfer to answer with a `GOT`.
pub(crate) fn stage(shared: &Shared, st: &mut State, from: &str, datagram: &[u8]) -> Option<u64> {
    // FAULT: `unchecked_payloads` trusts the bytes the network delivered.
    let data = decode_data(datagram, !shared.faults.unchecked_payloads)?;
    let in_range = data.records.iter().all(|r| fits(st, r.key, r.offset, r.bytes.len()));
    let entry = st.incoming.entry((from.to_string(), data.xfer)).or_insert_with(|| Incoming {
        next: 0,
        records: Vec::new(),
        touched: Instant::now(),
    });
    entry.touched = Instant::now();
    // In order only: a datagram past a gap, or seen already, is dropped and the GOT says where we are.
    if data.seq == entry.next && in_range {
        entry.records.extend(data.records.iter().map(|r| (r.key, r.offset, r.bytes.to_vec())));
        entry.next += 1;
    }
    Some(data.xfer)
}

/// The `GOT` answering a staged transfer.
pub(crate) fn got(st: &State, from: &str, xfer: u64) -> Option<Msg> {
    st.incoming.get(&(from.to_string(), xfer)).map(|e| Msg::Got(xfer, e.next))
}

/// Write a committed transfer into its regions, all or nothing, unless its deadline has passed. The
/// sender reports a transfer failed with its commit unanswered quiesced at the deadline plus
/// `COMMIT_GRACE_MS`; the write follows the deadline check within microseconds, so only a receiver
/// stopped between the two for longer than that grace could write after that report (the one window
/// this test plugin leaves open).
pub(crate) fn commit(st: &mut State, from: &str, xfer: u64, datagrams: u32, expiry_ns: u64) -> Msg {
    let Some(entry) = st.incoming.remove(&(from.to_string(), xfer)) else { return Msg::Nack(xfer) };
    let whole = entry.next == datagrams;
    let in_time = mono_ns() < expiry_ns;
    let in_range = entry.records.iter().all(|(key, offset, bytes)| fits(st, *key, *offset, bytes.len()));
    if !(whole && in_time && in_range) {
        return Msg::Nack(xfer);
    }
    for (key, offset, bytes) in &entry.records {
        let &(addr, _) = st.regions.get(key).expect("checked above");
        // SAFETY: the range was checked against the registered region just above, and the region
        // cannot be deregistered meanwhile: deregister takes the state lock held here.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), (addr + offset) as *mut u8, bytes.len()) };
    }
    Msg::Ack(xfer)
}

/// Drop staged transfers whose sender went quiet.
pub(crate) fn purge(st: &mut State) {
    let stale = Duration::from_millis(STALE_INCOMING_MS);
    st.incoming.retain(|_, e| e.touched.elapsed() < stale);
}
