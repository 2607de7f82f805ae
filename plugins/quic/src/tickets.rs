//! Receiver-side tickets: which peer may write which local ranges, until when. Owns the check every
//! incoming segment passes before a byte is written, and the revocation that `cancel_incoming` waits
//! for; never writes memory itself except through `Regions::copy_in` under the ticket's read lock.

use crate::regions::Regions;
use kvgate_abi::{LocalRange, PeerId, PluginError, ReasonCode, Ticket};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

/// One ticket's authorisation. Held read-locked while a write under it is in progress.
pub struct TicketGrant {
    revoked: bool,
    deadline: Instant,
    /// Sorted by (key, offset), overlapping or adjacent ranges merged.
    ranges: Vec<LocalRange>,
}

pub type SharedGrant = Arc<RwLock<TicketGrant>>;

/// Why a write under a ticket was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub reason: ReasonCode,
    pub message: String,
}

impl From<PluginError> for Refusal {
    fn from(e: PluginError) -> Refusal {
        Refusal { reason: e.code, message: e.message.to_string() }
    }
}

fn merge_ranges(mut ranges: Vec<LocalRange>) -> Vec<LocalRange> {
    ranges.retain(|r| r.len > 0);
    ranges.sort_by_key(|r| (r.key.0, r.offset));
    let mut merged: Vec<LocalRange> = Vec::with_capacity(ranges.len());
    for r in ranges {
        if let Some(last) = merged.last_mut() {
            let last_end = last.offset.saturating_add(last.len);
            if last.key == r.key && r.offset <= last_end {
                let end = last_end.max(r.offset.saturating_add(r.len));
                last.len = end - last.offset;
                continue;
            }
        }
        merged.push(r);
    }
    merged
}

impl TicketGrant {
    /// Whether `[offset, offset+len)` of `key` lies inside one authorised range.
    fn authorises(&self, key: u64, offset: u64, len: u64) -> bool {
        let Some(end) = offset.checked_add(len) else { return false };
        // The last range of `key` starting at or before `offset`.
        let idx = self.ranges.partition_point(|r| (r.key.0, r.offset) <= (key, offset));
        if idx == 0 {
            return false;
        }
        let r = &self.ranges[idx - 1];
        r.key.0 == key && end <= r.offset.saturating_add(r.len)
    }

    fn usable(&self, now: Instant) -> Result<(), Refusal> {
        if self.revoked {
            return Err(Refusal {
                reason: ReasonCode::NOT_EXPECTED,
                message: "the ticket was cancelled by the receiver".into(),
            });
        }
        if now >= self.deadline {
            return Err(Refusal {
                reason: ReasonCode::NOT_EXPECTED,
                message: "the ticket expired at the receiver".into(),
            });
        }
        Ok(())
    }
}

/// Check a whole segment against the ticket and the region before any of its bytes is read.
pub fn authorise_segment(
    grant: &SharedGrant,
    regions: &Regions,
    key: u64,
    offset: u64,
    len: u64,
) -> Result<(), Refusal> {
    let g = grant.read().expect("ticket lock");
    g.usable(Instant::now())?;
    regions.check_destination(key, offset, len)?;
    if !g.authorises(key, offset, len) {
        return Err(Refusal {
            reason: ReasonCode::NOT_EXPECTED,
            message: format!("segment {offset}+{len} of region {key} is outside the ranges the ticket authorises"),
        });
    }
    Ok(())
}

/// Write `data` at `offset` of `key` under the ticket: re-checks revocation, expiry and bounds, and
/// holds the ticket's read lock for the copy so `cancel_incoming` returns only once it is done.
pub fn write_under(grant: &SharedGrant, regions: &Regions, key: u64, offset: u64, data: &[u8]) -> Result<(), Refusal> {
    let g = grant.read().expect("ticket lock");
    g.usable(Instant::now())?;
    if !g.authorises(key, offset, data.len() as u64) {
        return Err(Refusal {
            reason: ReasonCode::NOT_EXPECTED,
            message: format!("write {offset}+{} of region {key} is outside the ticket's ranges", data.len()),
        });
    }
    regions.copy_in(key, offset, data)?;
    Ok(())
}

#[derive(Default)]
pub struct Tickets {
    live: Mutex<HashMap<(PeerId, Ticket), SharedGrant>>,
}

impl Tickets {
    pub fn expect(
        &self,
        peer: PeerId,
        ticket: Ticket,
        deadline: Instant,
        ranges: &[LocalRange],
        regions: &Regions,
        max_live_tickets: u64,
    ) -> Result<SharedGrant, PluginError> {
        for r in ranges {
            let len = regions.local_len(r.key).ok_or_else(|| {
                PluginError::new(ReasonCode::UNKNOWN_KEY, format!("ticket range names unknown local key {}", r.key.0))
            })?;
            if !crate::regions::in_bounds(r.offset, r.len, len) {
                return Err(PluginError::new(
                    ReasonCode::OUT_OF_RANGE,
                    format!("ticket range {}+{} outside local region {} of {len} bytes", r.offset, r.len, r.key.0),
                ));
            }
        }
        let mut live = self.live.lock().expect("tickets lock");
        if live.contains_key(&(peer, ticket)) {
            return Err(PluginError::new(
                ReasonCode::DUPLICATE_ID,
                format!("ticket {} from peer {} is already expected", ticket.0, peer.0),
            ));
        }
        if live.len() as u64 >= max_live_tickets {
            return Err(PluginError::new(
                ReasonCode::RESOURCE_EXHAUSTED,
                format!("{} live tickets reached max_live_tickets ({max_live_tickets})", live.len()),
            ));
        }
        let grant =
            Arc::new(RwLock::new(TicketGrant { revoked: false, deadline, ranges: merge_ranges(ranges.to_vec()) }));
        live.insert((peer, ticket), grant.clone());
        Ok(grant)
    }

    pub fn lookup(&self, peer: PeerId, ticket: Ticket) -> Option<SharedGrant> {
        self.live.lock().expect("tickets lock").get(&(peer, ticket)).cloned()
    }

    /// Revoke a ticket; returns once no write under it is in progress (none can start afterwards).
    pub fn revoke(&self, peer: PeerId, ticket: Ticket) -> bool {
        let grant = self.live.lock().expect("tickets lock").remove(&(peer, ticket));
        match grant {
            Some(g) => {
                g.write().expect("ticket lock").revoked = true;
                true
            }
            None => false,
        }
    }

    /// Drop a ticket whose deadline passed (if it is still this grant).
    pub fn expire(&self, peer: PeerId, ticket: Ticket, grant: &SharedGrant) -> bool {
        let mut live = self.live.lock().expect("tickets lock");
        if live.get(&(peer, ticket)).is_some_and(|g| Arc::ptr_eq(g, grant)) {
            live.remove(&(peer, ticket));
            drop(live);
            grant.write().expect("ticket lock").revoked = true;
            return true;
        }
        false
    }

    pub fn count(&self) -> u64 {
        self.live.lock().expect("tickets lock").len() as u64
    }

    /// Revoke every ticket (shutdown).
    pub fn revoke_all(&self) {
        let all: Vec<SharedGrant> = self.live.lock().expect("tickets lock").drain().map(|(_, g)| g).collect();
        for g in all {
            g.write().expect("ticket lock").revoked = true;
        }
    }
}
