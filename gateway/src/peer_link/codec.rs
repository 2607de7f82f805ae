//! Serialises the core's `PeerMessage`s to and from peer-link frames. Pure conversion: an
//! undecodable frame is an error the driver counts and logs; it never guesses a missing field.

use kvgate_client::proto::{self, core_message::Message as Wire};
use kvgate_core::api::{FailReason, Nanos, PeerMessage, RegionId, Role, RoomKey, Slice};
use kvgate_abi::Ticket;

pub fn encode(message: &PeerMessage) -> proto::CoreMessage {
    let key = Some(proto::RoomKey { room: message.room().room, generation: message.room().generation });
    let body = match message {
        PeerMessage::ExpectNotice { parts, tickets, deadline_remaining, .. } => Wire::ExpectNotice(proto::ExpectNotice {
            parts: parts
                .iter()
                .map(|part| proto::RemoteParts {
                    slices: part.iter().map(|s| proto::RemoteSlice { region: s.region.0, offset: s.offset, len: s.len }).collect(),
                })
                .collect(),
            tickets: tickets.iter().map(|t| t.0).collect(),
            deadline_remaining_ns: deadline_remaining.0,
        }),
        PeerMessage::Matched { .. } => Wire::Matched(proto::Matched {}),
        PeerMessage::PartDone { part, bytes, .. } => Wire::PartDone(proto::PartDone { part: *part, bytes: *bytes }),
        PeerMessage::Abort { reason, to, .. } => Wire::Abort(proto::AbortNotice { reason: reason.as_str().into(), to: to.as_str().into() }),
        PeerMessage::RoomFailed { reason, to, .. } => {
            Wire::RoomFailed(proto::RoomFailed { reason: reason.as_str().into(), to: to.as_str().into() })
        }
        PeerMessage::Quiesced { .. } => Wire::Quiesced(proto::Quiesced {}),
    };
    proto::CoreMessage { key, message: Some(body) }
}

fn role(name: &str) -> Result<Role, String> {
    match name {
        "sender" => Ok(Role::Sender),
        "receiver" => Ok(Role::Receiver),
        other => Err(format!("unknown role {other:?}")),
    }
}

fn reason(name: &str) -> Result<FailReason, String> {
    FailReason::from_name(name).ok_or_else(|| format!("unknown failure reason {name:?}"))
}

pub fn decode(message: proto::CoreMessage) -> Result<PeerMessage, String> {
    let key = message.key.ok_or("core message without a room key")?;
    let room = RoomKey::new(key.room, key.generation);
    Ok(match message.message.ok_or("core message without a body")? {
        Wire::ExpectNotice(n) => PeerMessage::ExpectNotice {
            room,
            parts: n
                .parts
                .into_iter()
                .map(|p| p.slices.into_iter().map(|s| Slice::new(RegionId(s.region), s.offset, s.len)).collect())
                .collect(),
            tickets: n.tickets.into_iter().map(Ticket).collect(),
            deadline_remaining: Nanos(n.deadline_remaining_ns),
        },
        Wire::Matched(_) => PeerMessage::Matched { room },
        Wire::PartDone(d) => PeerMessage::PartDone { room, part: d.part, bytes: d.bytes },
        Wire::Abort(a) => PeerMessage::Abort { room, reason: reason(&a.reason)?, to: role(&a.to)? },
        Wire::RoomFailed(f) => PeerMessage::RoomFailed { room, reason: reason(&f.reason)?, to: role(&f.to)? },
        Wire::Quiesced(_) => PeerMessage::Quiesced { room },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_peer_message_survives_encode_then_decode() {
        let room = RoomKey::new(7, 3);
        let messages = vec![
            PeerMessage::ExpectNotice {
                room,
                parts: vec![vec![Slice::new(RegionId(1), 4096, 100), Slice::new(RegionId(2), 0, 5)], vec![]],
                tickets: vec![Ticket(9), Ticket(10)],
                deadline_remaining: Nanos::from_ms(1234),
            },
            PeerMessage::Matched { room },
            PeerMessage::PartDone { room, part: 1, bytes: 1 << 40 },
            PeerMessage::Abort { room, reason: FailReason::Aborted, to: Role::Sender },
            PeerMessage::RoomFailed { room, reason: FailReason::TransferTimeout, to: Role::Receiver },
            PeerMessage::Quiesced { room },
        ];
        for m in messages {
            assert_eq!(decode(encode(&m)).unwrap(), m);
        }
    }

    #[test]
    fn unknown_reason_and_missing_key_are_errors() {
        let mut m = encode(&PeerMessage::Abort { room: RoomKey::new(1, 0), reason: FailReason::Aborted, to: Role::Sender });
        if let Some(Wire::Abort(a)) = &mut m.message {
            a.reason = "exploded".into();
        }
        assert!(decode(m).unwrap_err().contains("exploded"));
        assert!(decode(proto::CoreMessage { key: None, message: Some(Wire::Matched(proto::Matched {})) }).is_err());
    }
}
