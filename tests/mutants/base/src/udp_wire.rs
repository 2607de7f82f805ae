//! The UDP variant's wire: its endpoint (a loopback IPv4 address and port, in bytes a fault proxy can
//! find and rewrite), control datagrams that survive one damaged byte, and checksummed data datagrams.
//! Never trusts a byte from the peer: a datagram that does not parse or check is dropped.

use kvgate_abi::{PluginError, ReasonCode};

const ENDPOINT_PREFIX: &[u8] = b"kvgate-refplugin-udp:";
const CONTROL_TAG: u8 = b'C';
const DATA_TAG: u8 = b'D';
/// tag, length (u16), crc32 (u32)
const CONTROL_HEADER: usize = 7;
/// tag, xfer (u64), seq (u32), records (u16), crc32 (u32)
const DATA_HEADER: usize = 19;
/// owner key (u64), offset (u64), length (u32)
const RECORD_HEADER: usize = 20;

/// The endpoint bytes: prefix, 127.0.0.1, port (big endian).
pub fn encode_endpoint(port: u16) -> Vec<u8> {
    let mut out = ENDPOINT_PREFIX.to_vec();
    out.extend_from_slice(&[127, 0, 0, 1]);
    out.extend_from_slice(&port.to_be_bytes());
    out
}

/// The socket address text ("127.0.0.1:port") an endpoint names.
pub fn parse_endpoint(bytes: &[u8]) -> Result<String, PluginError> {
    let invalid = || {
        PluginError::new(
            ReasonCode::INVALID_ARGUMENT,
            format!("endpoint of {} bytes is not a kvgate-refplugin-udp endpoint", bytes.len()),
        )
    };
    let rest = bytes.strip_prefix(ENDPOINT_PREFIX).ok_or_else(invalid)?;
    let [a, b, c, d, p0, p1] = <[u8; 6]>::try_from(rest).map_err(|_| invalid())?;
    if [a, b, c, d] != [127, 0, 0, 1] {
        return Err(invalid());
    }
    Ok(format!("127.0.0.1:{}", u16::from_be_bytes([p0, p1])))
}

/// Control text framed twice, each copy with its own checksum: one damaged byte never loses a message.
pub fn frame_control(text: &str) -> Vec<u8> {
    let mut one = vec![CONTROL_TAG];
    one.extend_from_slice(&(text.len() as u16).to_le_bytes());
    one.extend_from_slice(&crc32fast::hash(text.as_bytes()).to_le_bytes());
    one.extend_from_slice(text.as_bytes());
    let mut out = one.clone();
    out.extend_from_slice(&one);
    out
}

/// The text of the first intact copy, or `None` (not a control datagram, or both copies damaged).
pub fn unframe_control(datagram: &[u8]) -> Option<String> {
    let mut at = 0;
    for _ in 0..2 {
        let header = datagram.get(at..at + CONTROL_HEADER)?;
        let len = u16::from_le_bytes([header[1], header[2]]) as usize;
        let crc = u32::from_le_bytes([header[3], header[4], header[5], header[6]]);
        let text = datagram.get(at + CONTROL_HEADER..at + CONTROL_HEADER + len);
        if header[0] == CONTROL_TAG {
            if let Some(text) = text.filter(|t| crc32fast::hash(t) == crc) {
                return String::from_utf8(text.to_vec()).ok();
            }
        }
        at += CONTROL_HEADER + len;
    }
    None
}

pub fn is_data(datagram: &[u8]) -> bool {
    datagram.first() == Some(&DATA_TAG)
}

/// One record of a data datagram: bytes for the owner's region `key` at `offset`.
pub struct Record<'a> {
    pub key: u64,
    pub offset: u64,
    pub bytes: &'a [u8],
}

/// Bytes a record adds to a datagram besides its payload.
pub const RECORD_OVERHEAD: usize = RECORD_HEADER;

pub fn encode_data(xfer: u64, seq: u32, records: &[Record<'_>]) -> Vec<u8> {
    let mut body = Vec::with_capacity(records.iter().map(|r| RECORD_HEADER + r.bytes.len()).sum());
    for r in records {
        body.extend_from_slice(&r.key.to_le_bytes());
        body.extend_from_slice(&r.offset.to_le_bytes());
        body.extend_from_slice(&(r.bytes.len() as u32).to_le_bytes());
        body.extend_from_slice(r.bytes);
    }
    let mut out = Vec::with_capacity(DATA_HEADER + body.len());
    out.push(DATA_TAG);
    out.extend_from_slice(&xfer.to_le_bytes());
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&(records.len() as u16).to_le_bytes());
    let mut crc = crc32fast::Hasher::new();
    crc.update(&out[1..]);
    crc.update(&body);
    out.extend_from_slice(&crc.finalize().to_le_bytes());
    out.extend_from_slice(&body);
    out
}

/// A parsed data datagram: transfer, sequence number, records.
pub struct Data<'a> {
    pub xfer: u64,
    pub seq: u32,
    pub records: Vec<Record<'a>>,
}

/// Parse a data datagram; with `check` false its checksum is not verified.
pub fn decode_data(datagram: &[u8], check: bool) -> Option<Data<'_>> {
    let header = datagram.get(..DATA_HEADER)?;
    if header[0] != DATA_TAG {
        return None;
    }
    let u32_at = |i: usize| u32::from_le_bytes(header[i..i + 4].try_into().expect("4 bytes"));
    let xfer = u64::from_le_bytes(header[1..9].try_into().expect("8 bytes"));
    let (seq, count) = (u32_at(9), u16::from_le_bytes([header[13], header[14]]));
    if check {
        let mut crc = crc32fast::Hasher::new();
        crc.update(&header[1..15]);
        crc.update(&datagram[DATA_HEADER..]);
        if crc.finalize() != u32_at(15) {
            return None;
        }
    }
    let mut records = Vec::with_capacity(count as usize);
    let mut rest = &datagram[DATA_HEADER..];
    for _ in 0..count {
        let head = rest.get(..RECORD_HEADER)?;
        let key = u64::from_le_bytes(head[0..8].try_into().expect("8 bytes"));
        let offset = u64::from_le_bytes(head[8..16].try_into().expect("8 bytes"));
        let len = u32::from_le_bytes(head[16..20].try_into().expect("4 bytes")) as usize;
        let bytes = rest.get(RECORD_HEADER..RECORD_HEADER + len)?;
        records.push(Record { key, offset, bytes });
        rest = &rest[RECORD_HEADER + len..];
    }
    rest.is_empty().then_some(Data { xfer, seq, records })
}

/// CLOCK_MONOTONIC in nanoseconds: the clock `Instant` reads, shared by every process on the host.
pub fn mono_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_round_trips_and_garbage_is_refused() {
        assert_eq!(parse_endpoint(&encode_endpoint(4242)).unwrap(), "127.0.0.1:4242");
        assert!(parse_endpoint(&[0xff; 7]).is_err());
        assert!(parse_endpoint(b"").is_err());
        let mut far = encode_endpoint(1);
        far[ENDPOINT_PREFIX.len()] = 10;
        assert!(parse_endpoint(&far).is_err());
    }

    #[test]
    fn a_control_datagram_survives_its_middle_byte_damaged_but_not_both_copies() {
        let mut d = frame_control("GOT 1 2\nACK 3");
        assert_eq!(unframe_control(&d).as_deref(), Some("GOT 1 2\nACK 3"));
        let mid = d.len() / 2;
        d[mid] ^= 0x5a;
        assert_eq!(unframe_control(&d).as_deref(), Some("GOT 1 2\nACK 3"));
        d[CONTROL_HEADER + 2] ^= 0x5a;
        assert_eq!(unframe_control(&d), None);
    }

    #[test]
    fn a_damaged_data_datagram_is_refused_only_when_checked() {
        let payload = vec![7u8; 1000];
        let mut d = encode_data(5, 2, &[Record { key: 3, offset: 8, bytes: &payload }]);
        let ok = decode_data(&d, true).unwrap();
        assert_eq!((ok.xfer, ok.seq, ok.records.len(), ok.records[0].key, ok.records[0].offset), (5, 2, 1, 3, 8));
        let mid = d.len() / 2;
        d[mid] ^= 0x5a;
        assert!(decode_data(&d, true).is_none());
        let unchecked = decode_data(&d, false).unwrap();
        assert_ne!(unchecked.records[0].bytes, &payload[..]);
    }
}
