//! One lane call: the frame's request becomes a `tonic::Request` carrying what the gRPC path would
//! carry (the session in `kvgate-session` metadata, the connection in the extensions), and goes
//! through the same `EngineApi` method of [`EngineApiService`]; its answer becomes a reply frame.
//! So the lane has no engine-API logic of its own: checks, refusals and reason codes are gRPC's.

use super::super::EngineApiService;
use crate::driver::sessions::SESSION_METADATA_KEY;
use crate::listeners::ConnectionId;
use kvgate_client::proto::{self, engine_api_server::EngineApi, lane_reply::Reply, lane_request::Call};
use tonic::{Request, Status};

/// The room events of an accepted `watch`.
pub type EventStream = <EngineApiService as EngineApi>::WatchStream;

/// What a call ends in: a reply, or (an accepted watch) its stream of events. Not boxed: an answer
/// is moved once, into its frame, and a box would be an allocation per call.
#[allow(clippy::large_enum_variant)]
pub enum Answer {
    Reply(Reply),
    Watch(EventStream),
}

fn request<T>(message: T, session: Option<u64>, connection: ConnectionId) -> Request<T> {
    let mut request = Request::new(message);
    if let Some(id) = session {
        request.metadata_mut().insert(SESSION_METADATA_KEY, id.into());
    }
    request.extensions_mut().insert(connection);
    request
}

/// Run `call` through the service. `None` call: refused `unknown_call` (a call this gateway does not
/// know decodes as none).
pub async fn dispatch(
    service: &EngineApiService,
    connection: ConnectionId,
    session: Option<u64>,
    call: Option<Call>,
) -> Result<Answer, Status> {
    let Some(call) = call else {
        let message = "the frame names no call this gateway knows (a newer client, or none at all)";
        return Err(crate::channels::ApiError::new(tonic::Code::Unimplemented, "unknown_call", message).to_status());
    };
    let reply = match call {
        Call::OpenSession(m) => {
            Reply::OpenSession(service.open_session(request(m, session, connection)).await?.into_inner())
        }
        Call::CloseSession(m) => {
            Reply::CloseSession(service.close_session(request(m, session, connection)).await?.into_inner())
        }
        Call::RegisterMemory(m) => {
            Reply::RegisterMemory(service.register_memory(request(m, session, connection)).await?.into_inner())
        }
        Call::UnregisterMemory(m) => {
            Reply::UnregisterMemory(service.unregister_memory(request(m, session, connection)).await?.into_inner())
        }
        Call::Expect(m) => Reply::Expect(service.expect(request(m, session, connection)).await?.into_inner()),
        Call::Send(m) => Reply::Send(service.send(request(m, session, connection)).await?.into_inner()),
        Call::ExpectBatch(m) => {
            Reply::ExpectBatch(service.expect_batch(request(m, session, connection)).await?.into_inner())
        }
        Call::SendBatch(m) => Reply::SendBatch(service.send_batch(request(m, session, connection)).await?.into_inner()),
        Call::Info(m) => Reply::Info(service.info(request(m, session, connection)).await?.into_inner()),
        Call::Abort(m) => Reply::Abort(service.abort(request(m, session, connection)).await?.into_inner()),
        Call::GetRoom(m) => Reply::GetRoom(service.get_room(request(m, session, connection)).await?.into_inner()),
        Call::ListRooms(m) => Reply::ListRooms(service.list_rooms(request(m, session, connection)).await?.into_inner()),
        Call::Watch(m) => return Ok(Answer::Watch(service.watch(request(m, session, connection)).await?.into_inner())),
    };
    Ok(Answer::Reply(reply))
}

/// A refusal as the lane carries it: the gRPC code, the reason code (the `kvgate-reason` metadata,
/// else the message's leading `reason:`), the message.
pub fn lane_error(status: &Status) -> proto::LaneError {
    let reason = kvgate_client::reason_of(status).unwrap_or_else(|| {
        let head = status.message().split(':').next().unwrap_or_default();
        if !head.is_empty() && head.bytes().all(|b| b.is_ascii_lowercase() || b == b'_') {
            head.to_string()
        } else {
            "internal".to_string()
        }
    });
    proto::LaneError { code: status.code() as i32, reason, message: status.message().to_string() }
}

/// A reply frame refusing call `id`.
pub fn refusal(id: u64, code: tonic::Code, reason: &str, message: String) -> proto::LaneReply {
    let error = proto::LaneError { code: code as i32, reason: reason.to_string(), message };
    proto::LaneReply { id, reply: Some(Reply::Error(error)) }
}
