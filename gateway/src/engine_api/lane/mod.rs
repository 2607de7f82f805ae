//! The engine fast lane: the engine API's calls as length-prefixed protobuf frames on a second Unix
//! socket (`<engine_api.unix_socket>.lane`, mode 0600, the same folder checks), beside gRPC. Same
//! calls, same checks, same reason codes: each call goes through [`EngineApiService`]'s own method
//! (`dispatch`). What it saves is HTTP/2 (framing, HPACK, the tower stack) and the thread hand-offs
//! of a task per stream: one reader task per connection starts every call and one writer task
//! writes every reply and room event (`connection`). Authentication is the socket's file mode, as for
//! the gRPC Unix socket; there is no TCP lane.

mod connection;
mod dispatch;
mod reply_queue;

use super::EngineApiService;
use crate::config::EngineApiSection;
use crate::listeners::GuardedListener;
pub use kvgate_client::lane::lane_socket_path;
use tokio::net::UnixListener;

/// The lane's per-connection bounds (`engine_api.lane_*`).
#[derive(Clone, Copy, Debug)]
pub struct LaneLimits {
    pub max_frame_bytes: u64,
    pub max_calls_in_flight: u64,
    pub max_queued_reply_bytes: u64,
}

impl LaneLimits {
    pub fn of(config: &EngineApiSection) -> LaneLimits {
        LaneLimits {
            max_frame_bytes: config.lane_max_frame_bytes,
            max_calls_in_flight: config.lane_max_calls_in_flight,
            max_queued_reply_bytes: config.lane_max_queued_reply_bytes,
        }
    }
}

/// Accept lane connections (within `engine_api.connections`, counted as listener `engine_api_lane`)
/// until `shutdown` turns true; each is served on a task of its own.
pub async fn serve_lane(
    listener: UnixListener,
    service: EngineApiService,
    config: &EngineApiSection,
    metrics: std::sync::Arc<crate::metrics::GatewayMetrics>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let limits = LaneLimits::of(config);
    let mut listener = GuardedListener::new(listener, "engine_api_lane", config.connections, metrics);
    loop {
        tokio::select! {
            (io, _) = listener.next() => {
                let id = crate::listeners::next_connection_id();
                tokio::spawn(connection::serve(io, id, service.clone(), limits));
            }
            _ = shutdown.wait_for(|s| *s) => return,
        }
    }
}
