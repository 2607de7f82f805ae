//! Engine calls as the driver receives them (already decoded from protobuf by `engine_api`), and
//! their translation into core requests. Every refusal carries a reason code; a refused call changes
//! nothing. Never blocks: each call is answered through its oneshot before the next event.

use super::{views, Driver};
use crate::channels::{ApiError, EngineCall, ExpectCall, SendCall};
use kvgate_core::{EngineRequest, PeerId, RefusalReason, Role, RoomKey, Slice};

/// `text` cut to at most `max` bytes (at a character boundary), saying how much was cut: free text
/// from engines goes into logs and error messages, never unbounded.
pub fn clip(text: &str, max: usize) -> std::borrow::Cow<'_, str> {
    if text.len() <= max {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    std::borrow::Cow::Owned(format!("{}... ({} bytes more)", &text[..end], text.len() - end))
}

/// Longest path a registration may name (Linux `PATH_MAX`).
pub const MAX_PATH_BYTES: usize = 4096;

fn refusal_code(reason: RefusalReason) -> tonic::Code {
    use tonic::Code;
    match reason {
        RefusalReason::DuplicateExpect => Code::AlreadyExists,
        RefusalReason::RoomTerminal
        | RefusalReason::StaleGeneration
        | RefusalReason::PeerNotConnected
        | RefusalReason::PeerMismatch => Code::FailedPrecondition,
        RefusalReason::TooManyRooms | RefusalReason::TooManyPendingSends => Code::ResourceExhausted,
        _ => Code::InvalidArgument,
    }
}

impl Driver {
    pub(super) fn on_engine_call(&mut self, call: EngineCall) {
        match call {
            EngineCall::Register { memory, label, session, reply } => {
                let result = self.check_session(session).and_then(|()| self.register_region(memory, label));
                if let (Ok(registered), Some(id)) = (&result, session) {
                    self.sessions.own_region(id, registered.region);
                }
                let _ = reply.send(result);
            }
            EngineCall::OpenSession { name, reply } => {
                let _ = reply.send(self.open_session(&name));
            }
            EngineCall::CloseSession { session, reply } => {
                let _ = reply.send(self.close_session(session));
            }
            EngineCall::AttachSession { session, reply } => {
                let _ = reply.send(self.attach_session(session));
            }
            EngineCall::DetachSession { session } => self.detach_session(session),
            EngineCall::Unregister { region, reply } => {
                let _ = reply.send(self.unregister_region(region));
            }
            EngineCall::Expect { call, reply } => {
                let _ = reply.send(self.expect_call(call));
            }
            EngineCall::Send { call, reply } => {
                let _ = reply.send(self.send_call(call));
            }
            EngineCall::ExpectBatch { calls, reply } => {
                let results = calls.into_iter().map(|call| call.and_then(|call| self.expect_call(call))).collect();
                let _ = reply.send(Ok(results));
            }
            EngineCall::SendBatch { calls, reply } => {
                let results = calls.into_iter().map(|call| call.and_then(|call| self.send_call(call))).collect();
                let _ = reply.send(Ok(results));
            }
            EngineCall::Abort { room, why, reply } => {
                let now = self.now();
                let was_live = Role::ALL
                    .iter()
                    .any(|role| self.core.room(now, room, *role).is_some_and(|v| !v.state.is_terminal()));
                let why = clip(&why, self.config.engine_api.max_text_bytes as usize);
                tracing::info!(room = %room, was_live, "engine abort: {why}");
                let result = self.submit_engine(EngineRequest::Abort { room, role: None }).map(|()| was_live);
                let _ = reply.send(result);
            }
            EngineCall::GetRoom { room, reply } => {
                let now = self.now();
                let view = [Role::Receiver, Role::Sender].iter().find_map(|role| self.core.room(now, room, *role));
                let result = match view {
                    Some(v) => Ok(views::room_info(&v, &self.peers, &self.plugins)),
                    None => Err(ApiError::new(
                        tonic::Code::NotFound,
                        "unknown_room",
                        format!("room {room} is not known here"),
                    )),
                };
                let _ = reply.send(result);
            }
            EngineCall::ListRooms { include_terminal, reply } => {
                let now = self.now();
                let rooms = self
                    .core
                    .rooms(now)
                    .filter(|v| include_terminal || !v.state.is_terminal())
                    .map(|v| views::room_info(&v, &self.peers, &self.plugins))
                    .collect();
                // The driver publishes every room event itself: no event is half-published here.
                let _ = reply.send(Ok((rooms, self.watch.last_seq())));
            }
        }
    }

    fn peer_id_of(&self, name: &str) -> Result<PeerId, ApiError> {
        // A peer withdrawn from discovery whose link is still up keeps taking rooms until the link goes.
        if let Some(peer) = self.peers.current(name) {
            return Ok(peer);
        }
        if self.directory.entry(name).is_none() {
            return Err(ApiError::invalid(
                "unknown_peer",
                format!("{name:?} is not a configured peer (see [[peers]]) nor one discovery found"),
            ));
        }
        Err(ApiError::new(
            tonic::Code::Unavailable,
            "peer_not_connected",
            format!("peer {name:?} is known but its link is down"),
        ))
    }

    fn expect_call(&mut self, call: ExpectCall) -> Result<(), ApiError> {
        self.check_session(call.session)?;
        let peer = self.peer_id_of(&call.peer)?;
        let mut part_peers = Vec::with_capacity(call.part_peers.len());
        for name in &call.part_peers {
            part_peers.push(if name.is_empty() { peer } else { self.peer_id_of(name)? });
        }
        self.expect(call.room, peer, call.parts, &part_peers, &call.source_kinds, call.timeout_ms)?;
        if let Some(id) = call.session {
            self.sessions.own_room(id, call.room, Role::Receiver);
        }
        Ok(())
    }

    fn send_call(&mut self, call: SendCall) -> Result<(), ApiError> {
        self.check_session(call.session)?;
        let peer = match call.peer.as_deref().filter(|p| !p.is_empty()) {
            Some(name) => Some(self.peer_id_of(name)?),
            None => None,
        };
        self.send(call.room, peer, call.part, call.chunk, call.at, call.slices, call.last)?;
        if let Some(id) = call.session {
            self.sessions.own_room(id, call.room, Role::Sender);
        }
        Ok(())
    }

    /// An expect: once the core accepts it, the room holds its destination regions.
    fn expect(
        &mut self,
        room: RoomKey,
        peer: PeerId,
        parts: Vec<Vec<Slice>>,
        part_peers: &[PeerId],
        source_kinds: &[Option<kvgate_abi::MemoryKind>],
        timeout_ms: Option<u64>,
    ) -> Result<(), ApiError> {
        let longest_name = self.plugin_names.iter().map(String::len).max().unwrap_or(0);
        let frame_bytes = crate::peer_link::codec::expect_notice_frame_bytes(&parts, longest_name);
        let max_frame_bytes = self.config.peer_link.max_frame_bytes as usize;
        if frame_bytes > max_frame_bytes {
            tracing::info!(room = %room, reason = "frame_too_large", "engine request refused");
            return Err(ApiError::invalid(
                "frame_too_large",
                format!("room {room}: its expect would need a peer-link frame of up to {frame_bytes} bytes, over peer_link.max_frame_bytes = {max_frame_bytes}; use fewer, larger slices"),
            ));
        }
        let now = self.now();
        let shape = kvgate_core::ExpectShape { part_peers, source_kinds };
        let result = self.core.handle_expect_from(now, room, peer, &parts, shape, timeout_ms);
        self.refusal_to_api(result)?;
        self.region_use.hold(room, Role::Receiver, parts.iter().flatten());
        Ok(())
    }

    /// A send: once the core accepts it, the room holds its source regions.
    #[allow(clippy::too_many_arguments)]
    fn send(
        &mut self,
        room: RoomKey,
        peer: Option<PeerId>,
        part: u32,
        chunk: u32,
        at: Option<u64>,
        slices: Vec<Slice>,
        last: bool,
    ) -> Result<(), ApiError> {
        let now = self.now();
        let result = match at {
            Some(at) => self.core.handle_send_at(now, room, peer, part, chunk, at, &slices, last),
            None => self.core.handle_send(now, room, peer, part, chunk, &slices, last),
        };
        self.refusal_to_api(result)?;
        self.region_use.hold(room, Role::Sender, &slices);
        Ok(())
    }

    fn refusal_to_api(&self, result: Result<(), kvgate_core::Refusal>) -> Result<(), ApiError> {
        result.map_err(|refusal| {
            tracing::info!(room = %refusal.room, reason = refusal.reason.as_str(), "engine request refused");
            ApiError::new(refusal_code(refusal.reason), refusal.reason.as_str(), refusal.to_string())
        })
    }

    fn submit_engine(&mut self, request: EngineRequest) -> Result<(), ApiError> {
        let now = self.now();
        let result = self.core.handle_engine(now, request);
        self.refusal_to_api(result)
    }
}
