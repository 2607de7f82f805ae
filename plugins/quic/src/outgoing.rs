//! The sending side of a transfer: split it into parts (one per lane, spread over the peer's
//! connections), hand each part to the least loaded lanes, and enforce the transfer's deadline. Never
//! writes to the wire itself (`lanes` does) and never reports success (`Transfer` does, once every
//! part is confirmed).

use crate::lanes::Part;
use crate::peers::{self, Links, PeerEntry};
use crate::shared::Shared;
use crate::transfers::Transfer;
use kvgate_abi::ReasonCode;
use std::sync::Arc;
use tokio::sync::watch;
use tokio::time::Instant;

/// One contiguous piece, already resolved to the receiver's key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlannedSegment {
    pub local_key: u64,
    pub local_offset: u64,
    pub remote_key: u64,
    pub remote_offset: u64,
    pub len: u64,
}

/// The segments one stream carries.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LanePlan {
    pub segments: Vec<PlannedSegment>,
    pub bytes: u64,
}

/// Split `segments` into at most `max_lanes` lanes of nearly equal bytes, none below `min_lane_bytes`
/// (except a single lane). Zero-length segments move nothing and are dropped. Always one lane at least.
pub fn plan_lanes(segments: &[PlannedSegment], total: u64, max_lanes: usize, min_lane_bytes: u64) -> Vec<LanePlan> {
    let lanes = (total / min_lane_bytes.max(1)).clamp(1, max_lanes.max(1) as u64) as usize;
    let target = total.div_ceil(lanes as u64).max(1);
    let mut plans: Vec<LanePlan> = vec![LanePlan::default()];
    for seg in segments.iter().filter(|s| s.len > 0) {
        let mut seg = *seg;
        while seg.len > 0 {
            let is_last_lane = plans.len() == lanes;
            let current = plans.last_mut().expect("one lane");
            let room = if is_last_lane { u64::MAX } else { target - current.bytes };
            let take = seg.len.min(room);
            current.segments.push(PlannedSegment { len: take, ..seg });
            current.bytes += take;
            seg.local_offset += take;
            seg.remote_offset += take;
            seg.len -= take;
            if current.bytes >= target && !is_last_lane {
                plans.push(LanePlan::default());
            }
        }
    }
    if plans.len() > 1 && plans.last().is_some_and(|p| p.bytes == 0) {
        plans.pop();
    }
    plans
}

async fn stopped(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|stop| *stop).await;
}

/// Hand each part of `t` to one of the peer's lanes (least loaded first), until the transfer stops.
/// With `defer` (called on the host's thread), a part a dead lane refuses is failed on that runtime.
pub fn dispatch(
    t: &Arc<Transfer>,
    links: &Links,
    entry: &PeerEntry,
    parts: Vec<LanePlan>,
    ticket: u64,
    defer: Option<&tokio::runtime::Handle>,
) {
    let count = parts.len() as u32;
    let lanes = links.pick_lanes(parts.len(), entry.first_connection_for(parts.len()));
    for (index, (plan, lane)) in parts.into_iter().zip(lanes).enumerate() {
        if !t.lane_opening() {
            break;
        }
        lane.submit(Part { t: t.clone(), ticket, index: index as u32, count, plan }, defer);
    }
}

/// Drive one transfer whose peer was not ready at submit: wait for the peer's connections, hand each part to a lane, enforce the deadline.
pub async fn run_transfer(
    shared: Arc<Shared>,
    t: Arc<Transfer>,
    entry: Arc<PeerEntry>,
    parts: Vec<LanePlan>,
    ticket: u64,
    deadline: Instant,
) {
    let mut stop = t.stop_signal();
    let timeout_ms = deadline.saturating_duration_since(Instant::now()).as_millis();
    let links = tokio::select! {
        r = peers::ready(&shared, &entry) => r,
        _ = tokio::time::sleep_until(deadline) => {
            t.fail(ReasonCode::TIMEOUT, "the transfer timeout passed while connecting to the peer");
            return;
        }
        _ = stopped(&mut stop) => return,
    };
    let links = match links {
        Ok(l) => l,
        Err(e) => {
            t.fail(e.code, format!("peer {}: {}", entry.id.0, e.message));
            return;
        }
    };
    dispatch(&t, &links, &entry, parts, ticket, None);
    tokio::select! {
        _ = tokio::time::sleep_until(deadline) => {
            t.fail(ReasonCode::TIMEOUT, format!("the transfer timeout ({timeout_ms} ms from submit) passed"));
        }
        _ = stopped(&mut stop) => {}
    }
}
