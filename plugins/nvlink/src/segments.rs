//! Checks a submit's segments against the instance's regions, imported keys and limits, and
//! resolves them to device addresses. Owns "refused before any byte moves"; never issues a copy
//! and never touches CUDA (lookups are passed in, so this runs in unit tests without a GPU).

use kvgate_abi::{LocalKey, PeerId, PluginError, ReasonCode, RemoteKey, Segment};

/// A registered local region, as the validator needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalView {
    /// Device address of the region's first byte in this process.
    pub addr: u64,
    pub len: u64,
    /// Index of the region's device in the instance's device list.
    pub device_index: usize,
}

/// An imported remote region, as the validator needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteView {
    /// The peer the key was imported from.
    pub peer: PeerId,
    /// Device address of the region's first byte, mapped into this process.
    pub addr: u64,
    pub len: u64,
}

/// One validated segment with its device addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResolvedSegment {
    pub src: u64,
    pub dst: u64,
    pub len: u64,
    /// Index of the source device (the copy runs on its streams).
    pub device_index: usize,
}

/// The limits a submit is checked against.
#[derive(Debug, Clone, Copy)]
pub struct SubmitLimits {
    pub max_segments_per_submit: u64,
    pub max_transfer_bytes: u64,
}

fn refuse(code: ReasonCode, message: String) -> PluginError {
    PluginError::new(code, format!("nvlink submit: {message}"))
}

/// `offset + len <= region_len`, without overflow.
pub fn range_fits(offset: u64, len: u64, region_len: u64) -> bool {
    offset.checked_add(len).is_some_and(|end| end <= region_len)
}

/// Validates every segment (count, keys, peer, ranges, total) and resolves addresses. Zero-length
/// segments are valid and produce no copy.
// CONFORMANCE: DATA-2 (every segment checked against both regions)
pub fn resolve_segments(
    segments: &[Segment],
    peer: PeerId,
    limits: SubmitLimits,
    local: impl Fn(LocalKey) -> Option<LocalView>,
    remote: impl Fn(RemoteKey) -> Option<RemoteView>,
) -> Result<Vec<ResolvedSegment>, PluginError> {
    if segments.len() as u64 > limits.max_segments_per_submit {
        return Err(refuse(
            ReasonCode::RESOURCE_EXHAUSTED,
            format!("{} segments, max_segments_per_submit is {}", segments.len(), limits.max_segments_per_submit),
        ));
    }
    let mut total: u64 = 0;
    let mut resolved = Vec::with_capacity(segments.len());
    for (i, s) in segments.iter().enumerate() {
        let l = local(s.local).ok_or_else(|| {
            refuse(ReasonCode::UNKNOWN_KEY, format!("segment {i}: local key {} is not registered", s.local.0))
        })?;
        let r = remote(s.remote).ok_or_else(|| {
            refuse(ReasonCode::UNKNOWN_KEY, format!("segment {i}: remote key {} is not imported", s.remote.0))
        })?;
        if r.peer != peer {
            return Err(refuse(
                ReasonCode::UNKNOWN_KEY,
                format!("segment {i}: remote key {} belongs to peer {}, not peer {}", s.remote.0, r.peer.0, peer.0),
            ));
        }
        if !range_fits(s.local_offset, s.len, l.len) {
            return Err(refuse(
                ReasonCode::OUT_OF_RANGE,
                format!("segment {i}: local {}+{} exceeds region length {}", s.local_offset, s.len, l.len),
            ));
        }
        if !range_fits(s.remote_offset, s.len, r.len) {
            return Err(refuse(
                ReasonCode::OUT_OF_RANGE,
                format!("segment {i}: remote {}+{} exceeds region length {}", s.remote_offset, s.len, r.len),
            ));
        }
        total = total.checked_add(s.len).filter(|t| *t <= limits.max_transfer_bytes).ok_or_else(|| {
            refuse(
                ReasonCode::RESOURCE_EXHAUSTED,
                format!("transfer exceeds max_transfer_bytes {}", limits.max_transfer_bytes),
            )
        })?;
        if s.len > 0 {
            resolved.push(ResolvedSegment {
                src: l.addr + s.local_offset,
                dst: r.addr + s.remote_offset,
                len: s.len,
                device_index: l.device_index,
            });
        }
    }
    Ok(resolved)
}
