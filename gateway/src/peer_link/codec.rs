//! Serialises the core's `PeerMessage`s to and from peer-link frames. Pure conversion: an
//! undecodable frame is an error the driver counts and logs; it never guesses a missing field.

use kvgate_abi::Ticket;
use kvgate_client::proto::{self, core_message::Message as Wire};
use kvgate_core::api::{FailReason, PeerMessage, PluginSlot, RegionId, Role, RoomKey, Slice, Span};

/// How one peer session names plugin instances: `own[slot]` is this gateway's wire name of each
/// local instance; `partner[slot]` the peer's instance that local one is connected with in the
/// session (empty: none). Before any plugin reload both are the plugin names.
#[derive(Clone, Copy, Debug)]
pub struct InstanceNames<'a> {
    pub own: &'a [String],
    pub partner: &'a [String],
}

/// `plugin_names[slot]`: the name of each local plugin instance, by which an expect notice names
/// the plugin of each part on the wire.
pub fn encode(message: &PeerMessage, plugin_names: &[String]) -> proto::CoreMessage {
    encode_in(message, InstanceNames { own: plugin_names, partner: &[] })
}

/// `encode` for a session whose instances may have been reloaded: an expect notice also names,
/// per part, the peer's instance its ticket was opened for (`names.partner`).
pub fn encode_in(message: &PeerMessage, names: InstanceNames<'_>) -> proto::CoreMessage {
    let plugin_names = names.own;
    let key = Some(proto::RoomKey { room: message.room().room, generation: message.room().generation });
    let body = match message {
        PeerMessage::ExpectNotice { parts, tickets, plugins, timeout, .. } => Wire::ExpectNotice(proto::ExpectNotice {
            part_plugins: plugins
                .iter()
                .map(|slot| plugin_names.get(slot.0 as usize).cloned().unwrap_or_default())
                .collect(),
            parts: parts
                .iter()
                .map(|part| proto::RemoteParts {
                    slices: part
                        .iter()
                        .map(|s| proto::RemoteSlice { region: s.region.0, offset: s.offset, len: s.len })
                        .collect(),
                })
                .collect(),
            tickets: tickets.iter().map(|t| t.0).collect(),
            timeout_ns: timeout.0,
            // Only once a reload made the two sides' names differ: until then the wire is as before.
            part_sender_plugins: match plugins.iter().any(|slot| {
                names.partner.get(slot.0 as usize).is_some_and(|p| Some(p) != plugin_names.get(slot.0 as usize))
            }) {
                false => Vec::new(),
                true => {
                    plugins.iter().map(|slot| names.partner.get(slot.0 as usize).cloned().unwrap_or_default()).collect()
                }
            },
        }),
        PeerMessage::Matched { .. } => Wire::Matched(proto::Matched {}),
        PeerMessage::PartDone { part, bytes, .. } => Wire::PartDone(proto::PartDone { part: *part, bytes: *bytes }),
        PeerMessage::Abort { reason, to, .. } => {
            Wire::Abort(proto::AbortNotice { reason: reason.as_str().into(), to: to.as_str().into() })
        }
        PeerMessage::RoomFailed { reason, to, .. } => {
            Wire::RoomFailed(proto::RoomFailed { reason: reason.as_str().into(), to: to.as_str().into() })
        }
        PeerMessage::Quiesced { .. } => Wire::Quiesced(proto::Quiesced {}),
    };
    proto::CoreMessage { key, message: Some(body) }
}

/// Room key, deadline, ticket headers, the `CoreMessage` and `PeerFrame` envelopes and a MAC: an
/// upper bound of what an `ExpectNotice` frame carries beside its slices and tickets.
const EXPECT_NOTICE_OVERHEAD_BYTES: usize = 160;

/// An upper bound (exact for the slices) of the encoded size of the peer-link frame carrying the
/// `ExpectNotice` of `parts`, computed without building it: an expect whose notice would exceed
/// `peer_link.max_frame_bytes` is refused before the core sees it. `max_plugin_name`: the longest
/// name of a local plugin (each part may name its own).
pub fn expect_notice_frame_bytes(parts: &[Vec<Slice>], max_plugin_name: usize) -> usize {
    use prost::encoding::encoded_len_varint as varint;
    let field = |v: u64| if v == 0 { 0 } else { 1 + varint(v) };
    let mut total = EXPECT_NOTICE_OVERHEAD_BYTES + 1 + varint(parts.len() as u64 * 10) + parts.len() * 10;
    // Each part may name its plugin instance and, after a plugin reload, the sender's instance too.
    total += 2 * parts.len() * (1 + varint(max_plugin_name as u64) + max_plugin_name);
    for part in parts {
        let body: usize = part
            .iter()
            .map(|s| {
                let inner = field(s.region.0) + field(s.offset) + field(s.len);
                1 + varint(inner as u64) + inner
            })
            .sum();
        total += 1 + varint(body as u64) + body;
    }
    total + 1 + varint(total as u64)
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

/// `plugin_names` as for `encode`: a plugin name this gateway did not open decodes to
/// `PluginSlot::NONE` (the core fails such a room `no_plugin_for_memory`).
pub fn decode(message: proto::CoreMessage, plugin_names: &[String]) -> Result<PeerMessage, String> {
    decode_in(message, InstanceNames { own: plugin_names, partner: plugin_names })
}

/// The local instance each part of an expect notice uses: the one the receiver opened its ticket
/// for (`part_sender_plugins`, by this gateway's wire name), or, from a gateway that does not name
/// it, the local instance connected with the receiver's named one.
fn part_slots(notice: &proto::ExpectNotice, names: InstanceNames<'_>) -> Vec<PluginSlot> {
    let position = |list: &[String], name: &str| {
        list.iter().position(|p| !p.is_empty() && p == name).map(|slot| PluginSlot(slot as u32))
    };
    if !notice.part_sender_plugins.is_empty() && notice.part_sender_plugins.len() == notice.part_plugins.len() {
        return notice
            .part_sender_plugins
            .iter()
            .map(|name| position(names.own, name).unwrap_or(PluginSlot::NONE))
            .collect();
    }
    notice
        .part_plugins
        .iter()
        .map(|name| position(names.partner, name).or_else(|| position(names.own, name)).unwrap_or(PluginSlot::NONE))
        .collect()
}

/// `decode` in a session whose instances may have been reloaded (see `InstanceNames`).
pub fn decode_in(message: proto::CoreMessage, names: InstanceNames<'_>) -> Result<PeerMessage, String> {
    let key = message.key.ok_or("core message without a room key")?;
    let room = RoomKey::new(key.room, key.generation);
    Ok(match message.message.ok_or("core message without a body")? {
        Wire::ExpectNotice(n) => PeerMessage::ExpectNotice {
            plugins: part_slots(&n, names),
            room,
            parts: n
                .parts
                .into_iter()
                .map(|p| p.slices.into_iter().map(|s| Slice::new(RegionId(s.region), s.offset, s.len)).collect())
                .collect(),
            tickets: n.tickets.into_iter().map(Ticket).collect(),
            timeout: Span(n.timeout_ns),
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
    fn the_expect_notice_bound_covers_the_real_frame_and_stays_close_to_it() {
        use prost::Message;
        let shapes: Vec<Vec<Vec<Slice>>> = vec![
            vec![vec![Slice::new(RegionId(1), 0, 1)]],
            vec![(0..1000).map(|i| Slice::new(RegionId(3), i * 4096, 4096)).collect(), vec![]],
            (0..122)
                .map(|p| {
                    (0..8)
                        .map(|i| Slice::new(RegionId(u64::MAX), u64::MAX - i, 1 << 40))
                        .collect::<Vec<_>>()
                        .into_iter()
                        .take(p % 9)
                        .collect()
                })
                .collect(),
        ];
        let names = vec!["shm".to_string(), "a-plugin-with-a-long-name".to_string()];
        for parts in shapes {
            let message = PeerMessage::ExpectNotice {
                room: RoomKey::new(u64::MAX, u32::MAX),
                tickets: (0..parts.len()).map(|_| Ticket(u64::MAX)).collect(),
                plugins: (0..parts.len()).map(|p| PluginSlot(p as u32 % 2)).collect(),
                parts: parts.clone(),
                timeout: Span::MAX,
            };
            // After a reload: the sender's instances named too (the longest case).
            let partner = vec!["shm@2".to_string(), "a-plugin-with-a-long-name@2".to_string()];
            let wire = encode_in(&message, InstanceNames { own: &names, partner: &partner });
            let frame = proto::PeerFrame { frame: Some(proto::peer_frame::Frame::Core(wire)), mac: vec![0; 32] };
            let real = frame.encoded_len();
            let bound = expect_notice_frame_bytes(&parts, partner[1].len());
            assert!(bound >= real, "bound {bound} < real {real}");
            // The bound allows a name per part; a notice names one for all when they share it.
            let names_allowance = 2 * parts.len() * (2 + names[1].len());
            assert!(
                bound <= real + 2 * EXPECT_NOTICE_OVERHEAD_BYTES + names_allowance,
                "bound {bound} far above real {real}"
            );
        }
    }

    #[test]
    fn every_peer_message_survives_encode_then_decode() {
        let room = RoomKey::new(7, 3);
        let messages = vec![
            PeerMessage::ExpectNotice {
                room,
                parts: vec![vec![Slice::new(RegionId(1), 4096, 100), Slice::new(RegionId(2), 0, 5)], vec![]],
                tickets: vec![Ticket(9), Ticket(10)],
                plugins: vec![PluginSlot(1), PluginSlot(0)],
                timeout: Span::from_ms(1234),
            },
            PeerMessage::Matched { room },
            PeerMessage::PartDone { room, part: 1, bytes: 1 << 40 },
            PeerMessage::Abort { room, reason: FailReason::Aborted, to: Role::Sender },
            PeerMessage::RoomFailed { room, reason: FailReason::TransferTimeout, to: Role::Receiver },
            PeerMessage::Quiesced { room },
        ];
        let names = vec!["shm".to_string(), "quic".to_string()];
        for m in messages {
            assert_eq!(decode(encode(&m, &names), &names).unwrap(), m);
        }
    }

    #[test]
    fn a_plugin_name_the_receiving_gateway_did_not_open_decodes_to_none() {
        let message = PeerMessage::ExpectNotice {
            room: RoomKey::new(1, 0),
            parts: vec![vec![Slice::new(RegionId(1), 0, 8)]],
            tickets: vec![Ticket(1)],
            plugins: vec![PluginSlot(1)],
            timeout: Span::from_ms(1),
        };
        let wire = encode(&message, &["shm".to_string(), "nvlink".to_string()]);
        let PeerMessage::ExpectNotice { plugins, .. } = decode(wire, &["shm".to_string(), "quic".to_string()]).unwrap()
        else {
            unreachable!()
        };
        assert_eq!(plugins, [PluginSlot::NONE]);
    }

    #[test]
    fn after_a_reload_the_notice_names_the_sender_instance_its_ticket_is_for() {
        let message = PeerMessage::ExpectNotice {
            room: RoomKey::new(1, 0),
            parts: vec![vec![Slice::new(RegionId(1), 0, 8)], vec![Slice::new(RegionId(2), 0, 8)]],
            tickets: vec![Ticket(1), Ticket(2)],
            plugins: vec![PluginSlot(0), PluginSlot(1)],
            timeout: Span::from_ms(1),
        };
        // Receiver: slot 0 is its first shm (connected with the sender's shm@2), slot 1 its shm@3
        // (connected with the sender's first shm).
        let (own, partner) = (["shm".to_string(), "shm@3".to_string()], ["shm@2".to_string(), "shm".to_string()]);
        let wire = encode_in(&message, InstanceNames { own: &own, partner: &partner });
        let Some(Wire::ExpectNotice(notice)) = &wire.message else { unreachable!() };
        assert_eq!(notice.part_sender_plugins, ["shm@2", "shm"]);
        // Sender: slot 0 is its first shm, slot 1 its shm@2; each part goes to the named instance
        // even though both are connected with receiver instances of the same plugin.
        let (own, partner) = (["shm".to_string(), "shm@2".to_string()], ["shm@3".to_string(), "shm@3".to_string()]);
        let PeerMessage::ExpectNotice { plugins, .. } =
            decode_in(wire.clone(), InstanceNames { own: &own, partner: &partner }).unwrap()
        else {
            unreachable!()
        };
        assert_eq!(plugins, [PluginSlot(1), PluginSlot(0)]);
        // A gateway that does not name the sender's instance: the one connected with the named one.
        let mut old = wire;
        if let Some(Wire::ExpectNotice(n)) = &mut old.message {
            n.part_sender_plugins.clear();
        }
        let partner = ["shm@3".to_string(), "shm".to_string()];
        let PeerMessage::ExpectNotice { plugins, .. } =
            decode_in(old, InstanceNames { own: &own, partner: &partner }).unwrap()
        else {
            unreachable!()
        };
        assert_eq!(plugins, [PluginSlot(1), PluginSlot(0)]);
    }

    #[test]
    fn unknown_reason_and_missing_key_are_errors() {
        let mut m = encode(
            &PeerMessage::Abort { room: RoomKey::new(1, 0), reason: FailReason::Aborted, to: Role::Sender },
            &[],
        );
        if let Some(Wire::Abort(a)) = &mut m.message {
            a.reason = "exploded".into();
        }
        assert!(decode(m, &[]).unwrap_err().contains("exploded"));
        assert!(decode(proto::CoreMessage { key: None, message: Some(Wire::Matched(proto::Matched {})) }, &[]).is_err());
    }
}
