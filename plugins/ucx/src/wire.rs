//! Byte formats this plugin exchanges with its peers: endpoint bytes, remote-key bytes and the
//! active-message headers. Owns encoding and strict decoding; never trusts a length it did not check.

use kvgate_abi::{PluginError, ReasonCode};

/// Bumped with each change to the messages peers exchange or accept (3: `AM_REPLY` carries up to 64
/// replies; 4: a data message may cover several touching ranges of a ticket, as senders join adjacent
/// segments), so that instances of different versions refuse each other's endpoint bytes at `connect`
/// instead of refusing or dropping messages later.
const ENDPOINT_MAGIC: &[u8; 8] = b"KVUCXEP4";
const RKEY_MAGIC: &[u8; 8] = b"KVUCXRK1";

/// Active-message ids registered on every worker.
pub const AM_DATA: u32 = 0x4b56_0001;
pub const AM_COMMIT: u32 = 0x4b56_0002;
pub const AM_CANCEL: u32 = 0x4b56_0003;
pub const AM_REPLY: u32 = 0x4b56_0004;
/// Sent to every peer by a shutting-down instance (header: its instance id) so peers fail fast.
pub const AM_BYE: u32 = 0x4b56_0005;

pub fn encode_bye(instance: u64) -> Vec<u8> {
    instance.to_le_bytes().to_vec()
}

pub fn decode_bye(bytes: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(bytes.try_into().ok()?))
}

fn take_u64(bytes: &[u8], at: usize) -> Option<u64> {
    bytes.get(at..at + 8).map(|b| u64::from_le_bytes(b.try_into().unwrap()))
}

fn invalid(what: &str) -> PluginError {
    PluginError::new(ReasonCode::INVALID_ARGUMENT, format!("malformed {what}"))
}

/// What `local_endpoint` returns: the instance id, the process that owns it (its pid and the host's
/// boot id, so that a peer on the same host can watch the process: UCX 1.13 reports no peer failure
/// over shared memory) and the worker address. `pid` 0 means "do not watch".
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointBytes {
    pub instance: u64,
    pub pid: u32,
    pub boot_id: [u8; 16],
    pub worker_address: Vec<u8>,
}

/// magic, instance, pid (as u64), boot id, address length.
const ENDPOINT_HEADER_BYTES: usize = 8 + 8 + 8 + 16 + 8;

impl EndpointBytes {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = ENDPOINT_MAGIC.to_vec();
        out.extend_from_slice(&self.instance.to_le_bytes());
        out.extend_from_slice(&(self.pid as u64).to_le_bytes());
        out.extend_from_slice(&self.boot_id);
        out.extend_from_slice(&(self.worker_address.len() as u64).to_le_bytes());
        out.extend_from_slice(&self.worker_address);
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<EndpointBytes, PluginError> {
        if bytes.get(..8) != Some(ENDPOINT_MAGIC) {
            return Err(invalid("ucx endpoint (bad magic)"));
        }
        let instance = take_u64(bytes, 8).ok_or_else(|| invalid("ucx endpoint (short)"))?;
        let pid = take_u64(bytes, 16).ok_or_else(|| invalid("ucx endpoint (short)"))?;
        let pid = u32::try_from(pid).map_err(|_| invalid("ucx endpoint (pid)"))?;
        let boot_id: [u8; 16] = bytes.get(24..40).ok_or_else(|| invalid("ucx endpoint (short)"))?.try_into().unwrap();
        let len = take_u64(bytes, 40).ok_or_else(|| invalid("ucx endpoint (short)"))?;
        if len == 0 || bytes.len() as u64 != ENDPOINT_HEADER_BYTES as u64 + len {
            return Err(invalid("ucx endpoint (length)"));
        }
        Ok(EndpointBytes { instance, pid, boot_id, worker_address: bytes[ENDPOINT_HEADER_BYTES..].to_vec() })
    }
}

/// This host's boot id (`/proc/sys/kernel/random/boot_id`, 16 bytes); zeros when unreadable (then no
/// peer is ever taken for a process on this host).
pub fn this_boot_id() -> [u8; 16] {
    let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let hex: Vec<u8> = text.trim().bytes().filter(|b| b.is_ascii_hexdigit()).collect();
    let mut id = [0u8; 16];
    if hex.len() != 32 {
        return id;
    }
    for (i, pair) in hex.chunks(2).enumerate() {
        id[i] = u8::from_str_radix(std::str::from_utf8(pair).unwrap_or("00"), 16).unwrap_or(0);
    }
    id
}

/// What `register` hands to peers: owner, region id, bounds and UCX's packed rkey.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteKeyBytes {
    pub owner_instance: u64,
    pub region: u64,
    pub addr: u64,
    pub len: u64,
    pub packed_rkey: Vec<u8>,
}

impl RemoteKeyBytes {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = RKEY_MAGIC.to_vec();
        for v in [self.owner_instance, self.region, self.addr, self.len, self.packed_rkey.len() as u64] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&self.packed_rkey);
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<RemoteKeyBytes, PluginError> {
        if bytes.get(..8) != Some(RKEY_MAGIC) {
            return Err(invalid("ucx remote key (bad magic)"));
        }
        let field = |i: usize| take_u64(bytes, 8 + 8 * i).ok_or_else(|| invalid("ucx remote key (short)"));
        let (owner_instance, region, addr, len, rkey_len) = (field(0)?, field(1)?, field(2)?, field(3)?, field(4)?);
        if bytes.len() as u64 != 48 + rkey_len || addr.checked_add(len).is_none() {
            return Err(invalid("ucx remote key (length)"));
        }
        Ok(RemoteKeyBytes { owner_instance, region, addr, len, packed_rkey: bytes[48..].to_vec() })
    }
}

/// Longest header a sender encodes: a data header with its commit (eight words).
pub const MAX_HEADER_BYTES: usize = 64;

/// Header of an `AM_DATA` message: one segment of one transfer. The transfer's last data message
/// carries its commit (`segments` messages, `bytes` in total), which saves a separate `AM_COMMIT`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataHeader {
    pub sender: u64,
    pub xfer: u64,
    pub ticket: u64,
    pub region: u64,
    pub offset: u64,
    pub len: u64,
    /// `(segments, bytes)` on the last data message of the transfer.
    pub commit: Option<(u64, u64)>,
}

/// Header of `AM_COMMIT` (all data sent: `segments` messages, `bytes` in total) and `AM_CANCEL`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CommitHeader {
    pub sender: u64,
    pub xfer: u64,
    pub ticket: u64,
    pub segments: u64,
    pub bytes: u64,
}

/// Header of `AM_REPLY`: the receiver's word on a transfer. `code` 0 = landed; otherwise a `ReasonCode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplyHeader {
    pub xfer: u64,
    pub code: u32,
}

fn encode_words(words: &[u64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 * words.len());
    push_words(words, &mut out);
    out
}

fn push_words(words: &[u64], out: &mut Vec<u8>) {
    for w in words {
        out.extend_from_slice(&w.to_le_bytes());
    }
}

fn decode_words<const N: usize>(bytes: &[u8]) -> Option<[u64; N]> {
    if bytes.len() != 8 * N {
        return None;
    }
    let mut out = [0u64; N];
    for (i, w) in out.iter_mut().enumerate() {
        *w = take_u64(bytes, 8 * i)?;
    }
    Some(out)
}

/// An active-message header of this plugin's protocol.
pub trait Header {
    /// Its words, appended to `out` (empty).
    fn push_into(&self, out: &mut Vec<u8>);

    /// Encode into `out` (cleared first), reusing its allocation (sized for any header when new).
    fn encode_into(&self, out: &mut Vec<u8>) {
        out.clear();
        out.reserve(MAX_HEADER_BYTES);
        self.push_into(out);
    }

    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode_into(&mut out);
        out
    }
}

impl Header for DataHeader {
    fn push_into(&self, out: &mut Vec<u8>) {
        push_words(&[self.sender, self.xfer, self.ticket, self.region, self.offset, self.len], out);
        if let Some((segments, bytes)) = self.commit {
            push_words(&[segments, bytes], out);
        }
    }
}

impl DataHeader {
    /// Six words, or eight with the commit.
    pub fn decode(bytes: &[u8]) -> Option<DataHeader> {
        let (words, commit) = match bytes.len() {
            48 => (bytes, None),
            64 => {
                let [segments, total] = decode_words::<2>(&bytes[48..])?;
                (&bytes[..48], Some((segments, total)))
            }
            _ => return None,
        };
        let [sender, xfer, ticket, region, offset, len] = decode_words::<6>(words)?;
        Some(DataHeader { sender, xfer, ticket, region, offset, len, commit })
    }
}

impl Header for CommitHeader {
    fn push_into(&self, out: &mut Vec<u8>) {
        push_words(&[self.sender, self.xfer, self.ticket, self.segments, self.bytes], out);
    }
}

impl CommitHeader {
    pub fn decode(bytes: &[u8]) -> Option<CommitHeader> {
        let [sender, xfer, ticket, segments, bytes] = decode_words::<5>(bytes)?;
        Some(CommitHeader { sender, xfer, ticket, segments, bytes })
    }
}

/// Most replies one `AM_REPLY` message carries (16 bytes each, in the message's header).
pub const MAX_REPLIES_PER_MESSAGE: usize = 64;

/// Several replies to one sender in one message: `replies` back to back (1..=`MAX_REPLIES_PER_MESSAGE`).
pub fn encode_replies<'a>(replies: impl IntoIterator<Item = &'a ReplyHeader>, out: &mut Vec<u8>) {
    out.clear();
    for r in replies {
        out.extend_from_slice(&r.xfer.to_le_bytes());
        out.extend_from_slice(&(r.code as u64).to_le_bytes());
    }
    debug_assert!(!out.is_empty() && out.len() <= 16 * MAX_REPLIES_PER_MESSAGE);
}

/// The replies of one `AM_REPLY` message; `None` (the whole message refused) unless it holds 1 to
/// `MAX_REPLIES_PER_MESSAGE` well-formed replies.
pub fn decode_replies(bytes: &[u8]) -> Option<impl Iterator<Item = ReplyHeader> + '_> {
    let count = bytes.len() / 16;
    if !bytes.len().is_multiple_of(16) || count == 0 || count > MAX_REPLIES_PER_MESSAGE {
        return None;
    }
    if bytes.chunks_exact(16).any(|pair| ReplyHeader::decode(pair).is_none()) {
        return None;
    }
    Some(bytes.chunks_exact(16).filter_map(ReplyHeader::decode))
}

impl ReplyHeader {
    pub fn encode(&self) -> Vec<u8> {
        encode_words(&[self.xfer, self.code as u64])
    }
    pub fn decode(bytes: &[u8]) -> Option<ReplyHeader> {
        let [xfer, code] = decode_words::<2>(bytes)?;
        Some(ReplyHeader { xfer, code: u32::try_from(code).ok()? })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_round_trips_and_refuses_garbage() {
        let ep = EndpointBytes { instance: 7, pid: 4242, boot_id: [5; 16], worker_address: vec![1, 2, 3] };
        assert_eq!(EndpointBytes::decode(&ep.encode()).unwrap(), ep);
        let mut bytes = ep.encode();
        bytes.pop();
        assert_eq!(EndpointBytes::decode(&bytes).unwrap_err().code, ReasonCode::INVALID_ARGUMENT);
        assert!(EndpointBytes::decode(b"nonsense").is_err());
        assert!(EndpointBytes::decode(&[]).is_err());
        let mut big_pid = ep.encode();
        big_pid[16..24].copy_from_slice(&(1u64 << 32).to_le_bytes());
        assert!(EndpointBytes::decode(&big_pid).is_err());
        // The previous version's endpoint (its receivers refuse joined messages) is refused at connect.
        let mut older = ep.encode();
        older[..8].copy_from_slice(b"KVUCXEP3");
        assert!(EndpointBytes::decode(&older).unwrap_err().message.contains("magic"));
        assert_ne!(this_boot_id(), [0u8; 16], "this host has a boot id");
    }

    #[test]
    fn remote_key_round_trips_and_refuses_overflow() {
        let rk = RemoteKeyBytes { owner_instance: 1, region: 2, addr: 4096, len: 100, packed_rkey: vec![9; 30] };
        assert_eq!(RemoteKeyBytes::decode(&rk.encode()).unwrap(), rk);
        let bad = RemoteKeyBytes { addr: u64::MAX, ..rk.clone() };
        assert!(RemoteKeyBytes::decode(&bad.encode()).is_err());
        assert!(RemoteKeyBytes::decode(&rk.encode()[..40]).is_err());
    }

    #[test]
    fn headers_round_trip_and_refuse_wrong_lengths() {
        let d = DataHeader { sender: 1, xfer: 2, ticket: 3, region: 4, offset: 5, len: 6, commit: None };
        assert_eq!(DataHeader::decode(&d.encode()), Some(d));
        assert_eq!(DataHeader::decode(&d.encode()[1..]), None);
        let last = DataHeader { commit: Some((7, 8)), ..d };
        assert_eq!(last.encode().len(), MAX_HEADER_BYTES);
        let mut reused = vec![0xAA; 70];
        last.encode_into(&mut reused);
        assert_eq!(reused, last.encode(), "encode_into clears what the buffer held");
        d.encode_into(&mut reused);
        assert_eq!(DataHeader::decode(&reused), Some(d));
        assert_eq!(DataHeader::decode(&last.encode()), Some(last));
        assert_eq!(DataHeader::decode(&last.encode()[..56]), None);
        let c = CommitHeader { sender: 1, xfer: 2, ticket: 3, segments: 4, bytes: 5 };
        assert_eq!(CommitHeader::decode(&c.encode()), Some(c));
        c.encode_into(&mut reused);
        assert_eq!(CommitHeader::decode(&reused), Some(c), "encode_into clears what the buffer held");
        let r = ReplyHeader { xfer: 9, code: 6 };
        assert_eq!(ReplyHeader::decode(&r.encode()), Some(r));
        assert_eq!(ReplyHeader::decode(&encode_words(&[1, u64::MAX])), None);
    }

    #[test]
    fn reply_batches_round_trip_and_refuse_bad_lengths_and_codes() {
        let replies: Vec<ReplyHeader> =
            (0..MAX_REPLIES_PER_MESSAGE as u64).map(|i| ReplyHeader { xfer: i + 1, code: i as u32 }).collect();
        let mut bytes = Vec::new();
        encode_replies(&replies, &mut bytes);
        assert_eq!(decode_replies(&bytes).unwrap().collect::<Vec<_>>(), replies);
        encode_replies(&replies[..1], &mut bytes);
        assert_eq!(bytes, replies[0].encode(), "one reply reads as the single-reply format");
        assert_eq!(decode_replies(&bytes).unwrap().collect::<Vec<_>>(), replies[..1]);
        assert!(decode_replies(&[]).is_none());
        assert!(decode_replies(&bytes[..15]).is_none());
        let mut too_many = Vec::new();
        for _ in 0..=MAX_REPLIES_PER_MESSAGE {
            too_many.extend_from_slice(&replies[0].encode());
        }
        assert!(decode_replies(&too_many).is_none());
        let mut bad_code = replies[0].encode();
        bad_code.extend_from_slice(&encode_words(&[2, u64::MAX]));
        assert!(decode_replies(&bad_code).is_none(), "one malformed reply refuses the message");
    }
}
