//! The bytes kvgate-quic puts on the wire or hands to its host: endpoint bytes, remote-key bytes and the
//! frames of the stream protocol. Pure encode/decode with explicit lengths; never trusts a length field
//! beyond the limits named here and never panics on hostile input.

use crate::tls::Fingerprint;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// The stream protocol version carried by HELLO. Both sides must speak the same one. Version 2: long-lived
/// lanes carrying parts back to back (version 1 opened a stream per transfer and lane).
pub const WIRE_VERSION: u16 = 2;
/// First bytes of a HELLO frame body.
pub const HELLO_MAGIC: u32 = 0x4b56_5131; // "KVQ1"
/// Most bytes of a refusal message on the wire.
pub const MAX_REFUSAL_MESSAGE_BYTES: usize = 1024;
/// Most addresses in endpoint bytes.
pub const MAX_ENDPOINT_ADDRESSES: usize = 64;

const ENDPOINT_MAGIC: &[u8; 4] = b"KVQE";
const ENDPOINT_FORMAT: u16 = 1;
const REMOTE_KEY_MAGIC: &[u8; 4] = b"KVQK";

/// Why bytes could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError(pub String);

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A little-endian reader that reports, never panics, on short input.
struct Reader<'a> {
    bytes: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.bytes.len() < n {
            return Err(DecodeError(format!("{} truncated", self.what)));
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2 bytes")))
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }
    fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }
    fn finish(self) -> Result<(), DecodeError> {
        if self.bytes.is_empty() {
            Ok(())
        } else {
            Err(DecodeError(format!("{} has {} trailing bytes", self.what, self.bytes.len())))
        }
    }
}

/// What `local_endpoint()` returns: how to reach this instance and which certificate it presents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointInfo {
    pub wire_version: u16,
    /// Random per `open`: a restarted peer has a new one.
    pub instance: u64,
    pub fingerprint: Fingerprint,
    pub addresses: Vec<SocketAddr>,
}

impl EndpointInfo {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + 19 * self.addresses.len());
        out.extend_from_slice(ENDPOINT_MAGIC);
        out.extend_from_slice(&ENDPOINT_FORMAT.to_le_bytes());
        out.extend_from_slice(&self.wire_version.to_le_bytes());
        out.extend_from_slice(&self.instance.to_le_bytes());
        out.extend_from_slice(&self.fingerprint);
        out.extend_from_slice(&(self.addresses.len() as u16).to_le_bytes());
        for addr in &self.addresses {
            match addr.ip() {
                IpAddr::V4(ip) => {
                    out.push(4);
                    out.extend_from_slice(&ip.octets());
                }
                IpAddr::V6(ip) => {
                    out.push(6);
                    out.extend_from_slice(&ip.octets());
                }
            }
            out.extend_from_slice(&addr.port().to_le_bytes());
        }
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<EndpointInfo, DecodeError> {
        let mut r = Reader { bytes, what: "quic endpoint bytes" };
        if r.take(4)? != ENDPOINT_MAGIC {
            return Err(DecodeError("not kvgate-quic endpoint bytes (bad magic)".into()));
        }
        let format = r.u16()?;
        if format != ENDPOINT_FORMAT {
            return Err(DecodeError(format!("endpoint format {format}, this side reads {ENDPOINT_FORMAT}")));
        }
        let wire_version = r.u16()?;
        let instance = r.u64()?;
        let fingerprint: Fingerprint = r.take(32)?.try_into().expect("32 bytes");
        let count = r.u16()? as usize;
        if count == 0 || count > MAX_ENDPOINT_ADDRESSES {
            return Err(DecodeError(format!("endpoint has {count} addresses, expected 1..={MAX_ENDPOINT_ADDRESSES}")));
        }
        let mut addresses = Vec::with_capacity(count);
        for _ in 0..count {
            let ip = match r.u8()? {
                4 => IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(r.take(4)?).expect("4 bytes"))),
                6 => IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(r.take(16)?).expect("16 bytes"))),
                other => return Err(DecodeError(format!("endpoint address family {other} unknown"))),
            };
            addresses.push(SocketAddr::new(ip, r.u16()?));
        }
        r.finish()?;
        Ok(EndpointInfo { wire_version, instance, fingerprint, addresses })
    }
}

/// What `register` hands out as remote-key bytes: the receiver's key and the region's length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteKeyInfo {
    /// The registering instance (see [`EndpointInfo::instance`]).
    pub instance: u64,
    /// The receiver's `LocalKey` number.
    pub key: u64,
    pub len: u64,
}

impl RemoteKeyInfo {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(28);
        out.extend_from_slice(REMOTE_KEY_MAGIC);
        out.extend_from_slice(&self.instance.to_le_bytes());
        out.extend_from_slice(&self.key.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
        out
    }
    pub fn decode(bytes: &[u8]) -> Result<RemoteKeyInfo, DecodeError> {
        let mut r = Reader { bytes, what: "quic remote key bytes" };
        if r.take(4)? != REMOTE_KEY_MAGIC {
            return Err(DecodeError("not kvgate-quic remote key bytes (bad magic)".into()));
        }
        let info = RemoteKeyInfo { instance: r.u64()?, key: r.u64()?, len: r.u64()? };
        r.finish()?;
        Ok(info)
    }
}

/// Frame type bytes. Version 2 retired version 1's per-transfer stream frames (0x10, 0x12, 0x20..=0x22):
/// they are unknown frame types now.
pub mod frame_type {
    pub const HELLO: u8 = 0x01;
    pub const HELLO_REPLY: u8 = 0x02;
    pub const SEGMENT: u8 = 0x11;
    pub const PART_BEGIN: u8 = 0x13;
    pub const PART_END: u8 = 0x14;
    pub const PART_ABORT: u8 = 0x15;
    pub const DONE: u8 = 0x23;
    pub const REFUSED: u8 = 0x24;
    pub const CANCEL_ACK: u8 = 0x25;
}

/// One frame of the stream protocol. A `Segment` header is followed on the stream by `len` raw bytes.
///
/// A lane is one long-lived bidirectional stream. The sender puts parts on it back to back (a part is
/// the share of one transfer that travels on this lane): `PART_BEGIN`, then `SEGMENT`s with their bytes,
/// then `PART_END` (every byte sent) or `PART_ABORT` (the sender stopped the part between two segments).
/// The receiver answers every part exactly once, in order, on the same stream: `DONE`, `REFUSED` (it
/// writes nothing more for the part and discards the part's remaining bytes) or `CANCEL_ACK` (answer
/// to `PART_ABORT`). Replies of several parts may travel in one write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// Client → server, first frame of the control stream.
    Hello { magic: u32, version: u16, instance: u64 },
    /// Server → client: `status` 0 accepts; otherwise a `ReasonCode` number.
    HelloReply { version: u16, status: u32, instance: u64 },
    /// Sender → receiver: a part of transfer `xfer` under `ticket` starts; `bytes` payload bytes follow
    /// in its segments. `part_index` < `part_count` (the transfer's parts over all lanes).
    PartBegin { xfer: u64, ticket: u64, part_index: u32, part_count: u32, bytes: u64 },
    /// Sender → receiver: `len` (at least 1) bytes for the receiver's region `key` at `offset` follow.
    Segment { key: u64, offset: u64, len: u64 },
    /// Sender → receiver, last frame of a part: repeats the count of segments and the bytes.
    PartEnd { segments: u64, bytes: u64 },
    /// Sender → receiver, last frame of a part the sender stopped (cancel, timeout, local failure).
    PartAbort { xfer: u64 },
    /// Receiver → sender: every byte of part `xfer` is in place.
    Done { xfer: u64, bytes: u64 },
    /// Receiver → sender: part `xfer` was refused or broke (`reason` is a `ReasonCode` number); the
    /// receiver writes nothing more for it.
    Refused { xfer: u64, reason: u32, message: String },
    /// Receiver → sender: the aborted part `xfer` will write nothing more (`bytes` were written).
    CancelAck { xfer: u64, bytes: u64 },
}

/// Body length of a fixed-size frame type; `None` for a variable one (`REFUSED`) or an unknown type.
pub fn fixed_body_len(frame_type: u8) -> Option<usize> {
    Some(match frame_type {
        frame_type::HELLO => 14,
        frame_type::HELLO_REPLY => 14,
        frame_type::PART_BEGIN => 32,
        frame_type::SEGMENT => 24,
        frame_type::PART_END => 16,
        frame_type::PART_ABORT => 8,
        frame_type::DONE => 16,
        frame_type::CANCEL_ACK => 16,
        _ => return None,
    })
}

/// Header bytes of a `REFUSED` frame before its message: type, xfer, reason, message length.
pub const REFUSED_HEADER_BYTES: usize = 1 + 8 + 4 + 2;

impl Frame {
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Frame::Hello { magic, version, instance } => {
                out.push(frame_type::HELLO);
                out.extend_from_slice(&magic.to_le_bytes());
                out.extend_from_slice(&version.to_le_bytes());
                out.extend_from_slice(&instance.to_le_bytes());
            }
            Frame::HelloReply { version, status, instance } => {
                out.push(frame_type::HELLO_REPLY);
                out.extend_from_slice(&version.to_le_bytes());
                out.extend_from_slice(&status.to_le_bytes());
                out.extend_from_slice(&instance.to_le_bytes());
            }
            Frame::PartBegin { xfer, ticket, part_index, part_count, bytes } => {
                out.push(frame_type::PART_BEGIN);
                out.extend_from_slice(&xfer.to_le_bytes());
                out.extend_from_slice(&ticket.to_le_bytes());
                out.extend_from_slice(&part_index.to_le_bytes());
                out.extend_from_slice(&part_count.to_le_bytes());
                out.extend_from_slice(&bytes.to_le_bytes());
            }
            Frame::Segment { key, offset, len } => {
                out.push(frame_type::SEGMENT);
                for v in [key, offset, len] {
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
            Frame::PartEnd { segments, bytes } => {
                out.push(frame_type::PART_END);
                out.extend_from_slice(&segments.to_le_bytes());
                out.extend_from_slice(&bytes.to_le_bytes());
            }
            Frame::PartAbort { xfer } => {
                out.push(frame_type::PART_ABORT);
                out.extend_from_slice(&xfer.to_le_bytes());
            }
            Frame::Done { xfer, bytes } => {
                out.push(frame_type::DONE);
                out.extend_from_slice(&xfer.to_le_bytes());
                out.extend_from_slice(&bytes.to_le_bytes());
            }
            Frame::CancelAck { xfer, bytes } => {
                out.push(frame_type::CANCEL_ACK);
                out.extend_from_slice(&xfer.to_le_bytes());
                out.extend_from_slice(&bytes.to_le_bytes());
            }
            Frame::Refused { xfer, reason, message } => {
                let text = truncate_utf8(message, MAX_REFUSAL_MESSAGE_BYTES);
                out.push(frame_type::REFUSED);
                out.extend_from_slice(&xfer.to_le_bytes());
                out.extend_from_slice(&reason.to_le_bytes());
                out.extend_from_slice(&(text.len() as u16).to_le_bytes());
                out.extend_from_slice(text.as_bytes());
            }
        }
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(48);
        self.encode(&mut out);
        out
    }

    /// Decode a fixed-size frame from its type byte and exactly its body.
    pub fn decode_fixed(frame_type: u8, body: &[u8]) -> Result<Frame, DecodeError> {
        let expected =
            fixed_body_len(frame_type).ok_or_else(|| DecodeError(format!("unknown frame type 0x{frame_type:02x}")))?;
        if body.len() != expected {
            return Err(DecodeError(format!(
                "frame 0x{frame_type:02x} body is {} bytes, expected {expected}",
                body.len()
            )));
        }
        let mut r = Reader { bytes: body, what: "frame" };
        let frame = match frame_type {
            frame_type::HELLO => Frame::Hello { magic: r.u32()?, version: r.u16()?, instance: r.u64()? },
            frame_type::HELLO_REPLY => Frame::HelloReply { version: r.u16()?, status: r.u32()?, instance: r.u64()? },
            frame_type::PART_BEGIN => Frame::PartBegin {
                xfer: r.u64()?,
                ticket: r.u64()?,
                part_index: r.u32()?,
                part_count: r.u32()?,
                bytes: r.u64()?,
            },
            frame_type::SEGMENT => Frame::Segment { key: r.u64()?, offset: r.u64()?, len: r.u64()? },
            frame_type::PART_END => Frame::PartEnd { segments: r.u64()?, bytes: r.u64()? },
            frame_type::PART_ABORT => Frame::PartAbort { xfer: r.u64()? },
            frame_type::DONE => Frame::Done { xfer: r.u64()?, bytes: r.u64()? },
            frame_type::CANCEL_ACK => Frame::CancelAck { xfer: r.u64()?, bytes: r.u64()? },
            other => return Err(DecodeError(format!("unknown frame type 0x{other:02x}"))),
        };
        r.finish()?;
        Ok(frame)
    }

    /// Decode a `REFUSED` frame from its header fields and message bytes (not UTF-8: replaced).
    pub fn decode_refused(xfer: u64, reason: u32, text: &[u8]) -> Frame {
        Frame::Refused { xfer, reason, message: String::from_utf8_lossy(text).into_owned() }
    }
}

fn truncate_utf8(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}
