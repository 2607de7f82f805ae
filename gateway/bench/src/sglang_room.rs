//! The per-room cost of an SGLang-shaped room through two gateways and the engine API: 61 layers x
//! (K, V) = 122 parts (one per layer buffer, as SGLang's paged pools are laid out), 16-token pages
//! scattered over the pools, sent in 4 chunks (chunked prefill). Measured twice in the same run: with
//! one `Send` per part per chunk (engine API version 1: 1 + 122 x 4 calls a room) and with one
//! `SendBatch` per chunk (version 2: 1 + 4 calls). Pages are scaled down to `SGLANG_PAGE_BYTES` so
//! the figure is the control path's (calls, time, CPU), not the copy. Measures only.

use super::datapath::{fresh_room, Rig};
use super::results::{SglangMode, SglangRoom};
use super::stats::{millis, percentile};
use anyhow::bail;
use kvgate_client::{proto, room_key, slice, Slice};
use kvgate_demo::engine::{wait_reusable, wait_terminal, Engine};
use kvgate_demo::gateways::{DECODE_NAME, PREFILL_NAME};
use std::time::{Duration, Instant};

/// Layers of the model (DeepSeek-V3-sized).
pub const SGLANG_LAYERS: u64 = 61;
/// One part per layer and K/V buffer.
pub const SGLANG_PARTS: u64 = 2 * SGLANG_LAYERS;
/// Chunks of a chunked prefill.
pub const SGLANG_CHUNKS: u64 = 4;
/// Pages (of 16 tokens) each chunk adds to each part.
pub const SGLANG_PAGES_PER_CHUNK: u64 = 4;
/// Bytes of one page of one part here (scaled down: the figure is the control path's).
pub const SGLANG_PAGE_BYTES: u64 = 256;
/// How long one room may take before it is counted failed.
pub const SGLANG_ROOM_WAIT_MS: u64 = 30_000;

const PAGES_PER_PART: u64 = SGLANG_CHUNKS * SGLANG_PAGES_PER_CHUNK;

/// Where page `page` of part `part` lives: every part's pages interleaved over the pool, so no two
/// pages of a part are adjacent (slices are never merged, as in a paged pool).
fn page_offset(part: u64, page: u64) -> u64 {
    (page * SGLANG_PARTS + part) * SGLANG_PAGE_BYTES
}

/// The pool bytes one room uses.
pub fn sglang_room_bytes() -> u64 {
    SGLANG_PARTS * PAGES_PER_PART * SGLANG_PAGE_BYTES
}

fn pages(region: u64, part: u64, pages: std::ops::Range<u64>) -> Vec<Slice> {
    pages.map(|page| slice(region, page_offset(part, page), SGLANG_PAGE_BYTES)).collect()
}

fn chunk_sends(prefill: &Engine, room: u64, chunk: u64) -> Vec<proto::SendRequest> {
    let first = chunk * SGLANG_PAGES_PER_CHUNK;
    (0..SGLANG_PARTS)
        .map(|part| proto::SendRequest {
            offset: None,
            key: Some(room_key(room, 0)),
            part: part as u32,
            chunk: chunk as u32,
            slices: pages(prefill.region, part, first..first + SGLANG_PAGES_PER_CHUNK),
            last: chunk + 1 == SGLANG_CHUNKS,
            peer: DECODE_NAME.to_string(),
        })
        .collect()
}

/// One room, `batched` or one call per part per chunk. Returns (latency, engine-API calls).
async fn one_room(prefill: &Engine, decode: &Engine, batched: bool) -> anyhow::Result<(Duration, u64)> {
    let room = fresh_room();
    let mut p_rx = prefill.events.listen(room);
    let mut d_rx = decode.events.listen(room);
    let started = Instant::now();
    let parts: Vec<Vec<Slice>> = (0..SGLANG_PARTS).map(|part| pages(decode.region, part, 0..PAGES_PER_PART)).collect();
    decode
        .client
        .expect(room_key(room, 0), PREFILL_NAME, parts, 0)
        .await
        .map_err(|s| anyhow::anyhow!("expect refused: {}", s.message()))?;
    let mut calls = 1;
    for chunk in 0..SGLANG_CHUNKS {
        let sends = chunk_sends(prefill, room, chunk);
        if batched {
            let reply = prefill
                .client
                .send_batch(sends)
                .await
                .map_err(|s| anyhow::anyhow!("send batch refused: {}", s.message()))?;
            if let Some(r) = reply.results.iter().find(|r| !r.reason.is_empty()) {
                bail!("a send of the batch was refused: {}: {}", r.reason, r.message);
            }
            calls += 1;
        } else {
            for send in sends {
                prefill.client.send(send).await.map_err(|s| anyhow::anyhow!("send refused: {}", s.message()))?;
                calls += 1;
            }
        }
    }
    let wait = Duration::from_millis(SGLANG_ROOM_WAIT_MS);
    let (p, d) = tokio::join!(wait_terminal(&mut p_rx, started, wait), wait_terminal(&mut d_rx, started, wait));
    let latency = started.elapsed();
    let (p, d) = (p?, d?);
    if !(p.succeeded && d.succeeded) {
        bail!("room failed: prefill {:?}, decode {:?}", p.reason, d.reason);
    }
    // The pages are reused by the next room: wait until neither side can still touch them.
    let _ = tokio::join!(wait_reusable(&mut p_rx, wait), wait_reusable(&mut d_rx, wait));
    prefill.events.forget(room);
    decode.events.forget(room);
    Ok((latency, calls))
}

async fn mode(rig: &Rig, rooms: u64, batched: bool) -> SglangMode {
    let cpu_before = rig.cpu_used();
    let mut latencies = Vec::new();
    let (mut calls, mut failures, mut first_error) = (0u64, 0u64, None);
    for _ in 0..rooms {
        match one_room(&rig.prefill, &rig.decode, batched).await {
            Ok((latency, n)) => {
                latencies.push(latency);
                calls = n;
            }
            Err(e) => {
                failures += 1;
                first_error.get_or_insert_with(|| format!("{e:#}"));
            }
        }
    }
    let cpu_after = rig.cpu_used();
    let per_room_us =
        |after: Duration, before: Duration| after.saturating_sub(before).as_secs_f64() * 1e6 / rooms.max(1) as f64;
    SglangMode {
        calls_per_room: calls,
        rooms: latencies.len() as u64,
        failures,
        first_error,
        latency_p50_ms: millis(percentile(&latencies, 50.0)),
        latency_p99_ms: millis(percentile(&latencies, 99.0)),
        gateway_cpu_us_per_room: per_room_us(cpu_after.0, cpu_before.0),
        engine_cpu_us_per_room: per_room_us(cpu_after.1, cpu_before.1),
    }
}

/// `rooms` SGLang-shaped rooms one after the other, each way (per-part calls first, then batched).
pub async fn sglang_shaped_rooms(rig: &Rig, rooms: u64) -> anyhow::Result<SglangRoom> {
    if sglang_room_bytes() > rig.slot_bytes * rig.slots {
        bail!(
            "the rig's pools ({} B) are smaller than one SGLang-shaped room ({} B)",
            rig.slot_bytes * rig.slots,
            sglang_room_bytes()
        );
    }
    let per_part = mode(rig, rooms, false).await;
    let batched = mode(rig, rooms, true).await;
    Ok(SglangRoom {
        layers: SGLANG_LAYERS,
        parts: SGLANG_PARTS,
        chunks: SGLANG_CHUNKS,
        pages_per_chunk: SGLANG_PAGES_PER_CHUNK,
        page_bytes: SGLANG_PAGE_BYTES,
        per_part,
        batched,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_of_a_part_never_touch_and_the_room_fits_its_bytes() {
        let mut all: Vec<u64> =
            (0..SGLANG_PARTS).flat_map(|p| (0..PAGES_PER_PART).map(move |g| page_offset(p, g))).collect();
        all.sort();
        assert!(all.windows(2).all(|w| w[1] - w[0] == SGLANG_PAGE_BYTES), "every page once, none overlapping");
        assert_eq!(all.last().unwrap() + SGLANG_PAGE_BYTES, sglang_room_bytes());
        assert!(page_offset(0, 1) - page_offset(0, 0) > SGLANG_PAGE_BYTES, "a part's pages are not adjacent");
    }
}
