//! Turns resolved segments into the copies actually issued: adjacent segments merged, large ones
//! split at `chunk_bytes` so a cancel takes effect between chunks. Pure planning; never issues.

use crate::segments::ResolvedSegment;

/// One `cuMemcpyDtoDAsync` the engine issues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyOp {
    pub src: u64,
    pub dst: u64,
    pub len: u64,
    /// Index of the source device; the copy runs on that device's streams.
    pub device_index: usize,
}

/// Plans the copies for `segments`: a segment that continues the previous one on both sides (same
/// device) is merged into it, and no copy exceeds `chunk_bytes`. The copies cover exactly the
/// segments' bytes, in order.
pub fn plan_copies(segments: &[ResolvedSegment], chunk_bytes: u64) -> Vec<CopyOp> {
    assert!(chunk_bytes > 0, "chunk_bytes is validated > 0 at config load");
    let mut runs: Vec<CopyOp> = Vec::new();
    for s in segments.iter().filter(|s| s.len > 0) {
        if let Some(last) = runs.last_mut() {
            let continues = last.device_index == s.device_index
                && last.src.checked_add(last.len) == Some(s.src)
                && last.dst.checked_add(last.len) == Some(s.dst);
            if continues {
                last.len += s.len;
                continue;
            }
        }
        runs.push(CopyOp { src: s.src, dst: s.dst, len: s.len, device_index: s.device_index });
    }
    let mut ops = Vec::with_capacity(runs.len());
    for run in runs {
        let mut done = 0;
        while done < run.len {
            let len = (run.len - done).min(chunk_bytes);
            ops.push(CopyOp { src: run.src + done, dst: run.dst + done, len, device_index: run.device_index });
            done += len;
        }
    }
    ops
}
