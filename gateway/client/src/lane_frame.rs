//! The engine fast lane's framing, shared by the gateway and the client: each frame is a u32
//! little-endian length, then that many bytes of one protobuf message (`LaneRequest` one way,
//! `LaneReply` the other). Owns the length prefix and its bound; knows nothing of the calls.

/// Bytes of the length prefix in front of every frame.
pub const LANE_LENGTH_BYTES: usize = 4;

/// Append `message` to `out` as one frame.
pub fn encode_frame<M: prost::Message>(message: &M, out: &mut Vec<u8>) {
    let len = message.encoded_len();
    out.reserve(LANE_LENGTH_BYTES + len);
    out.extend_from_slice(&(len as u32).to_le_bytes());
    message.encode_raw(out);
}

/// A frame whose announced length is past the receiver's bound: `len` bytes, at most `max`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameTooLarge {
    pub len: u64,
    pub max: u64,
}

/// The first complete frame at the front of `buf`: the byte range of its body, or `None` while it is
/// still incomplete. A length past `max` bytes is refused as soon as its prefix has arrived.
pub fn next_frame(buf: &[u8], max: usize) -> Result<Option<std::ops::Range<usize>>, FrameTooLarge> {
    let Some(prefix) = buf.get(..LANE_LENGTH_BYTES) else { return Ok(None) };
    let len = u32::from_le_bytes(prefix.try_into().expect("four bytes")) as usize;
    if len > max {
        return Err(FrameTooLarge { len: len as u64, max: max as u64 });
    }
    let end = LANE_LENGTH_BYTES + len;
    Ok((buf.len() >= end).then_some(LANE_LENGTH_BYTES..end))
}

/// Frames read from a byte stream: bytes are appended at the back (`spare`), complete frames taken
/// from the front (`take`), and consumed bytes dropped once per read (`compact`).
#[derive(Default)]
pub struct FrameBuffer {
    bytes: Vec<u8>,
    start: usize,
}

/// Bytes a read asks the socket for at least (one read usually carries many small frames).
pub const LANE_READ_CHUNK_BYTES: usize = 64 * 1024;

impl FrameBuffer {
    /// The buffer to read into (at least [`LANE_READ_CHUNK_BYTES`] of spare capacity), after dropping
    /// the frames already taken.
    pub fn spare(&mut self) -> &mut Vec<u8> {
        if self.start > 0 {
            self.bytes.drain(..self.start);
            self.start = 0;
        }
        self.bytes.reserve(LANE_READ_CHUNK_BYTES);
        &mut self.bytes
    }

    /// The body of the next complete frame, if one has arrived.
    pub fn take(&mut self, max: usize) -> Result<Option<&[u8]>, FrameTooLarge> {
        match next_frame(&self.bytes[self.start..], max)? {
            None => Ok(None),
            Some(range) => {
                let body = self.start + range.start..self.start + range.end;
                self.start += range.end;
                Ok(Some(&self.bytes[body]))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto;

    #[test]
    fn frames_round_trip_and_wait_for_their_last_byte() {
        let mut out = Vec::new();
        let a = proto::LaneRequest {
            id: 7,
            session: Some(3),
            call: Some(proto::lane_request::Call::Info(proto::InfoRequest {})),
        };
        encode_frame(&a, &mut out);
        encode_frame(&proto::LaneRequest { id: 8, ..Default::default() }, &mut out);
        let mut buf = FrameBuffer::default();
        buf.spare().extend_from_slice(&out[..out.len() - 1]);
        let first = buf.take(1024).unwrap().expect("the first frame is whole");
        assert_eq!(<proto::LaneRequest as prost::Message>::decode(first).unwrap(), a);
        assert!(buf.take(1024).unwrap().is_none(), "the second lacks its last byte");
        buf.spare().push(*out.last().unwrap());
        let second = buf.take(1024).unwrap().unwrap();
        assert_eq!(<proto::LaneRequest as prost::Message>::decode(second).unwrap().id, 8);
    }

    #[test]
    fn a_length_at_the_bound_is_taken_and_one_past_it_refused() {
        let mut frame = 10u32.to_le_bytes().to_vec();
        frame.extend_from_slice(&[0; 10]);
        assert_eq!(next_frame(&frame, 10).unwrap(), Some(4..14));
        assert_eq!(next_frame(&frame, 9).unwrap_err(), FrameTooLarge { len: 10, max: 9 });
        assert_eq!(next_frame(&frame[..3], 9).unwrap(), None, "a prefix not yet whole decides nothing");
    }
}
