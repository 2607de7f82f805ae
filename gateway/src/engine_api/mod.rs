//! The engine API: the `EngineApi` gRPC service (decoding protobuf into driver calls and answering
//! with the driver's reply), served on a Unix socket (mode 0600) and optionally on TCP behind a
//! bearer token; and the same calls on the engine fast lane (`lane`: length-prefixed frames on
//! `<unix_socket>.lane`). Never touches the core directly and never carries KV bytes.

mod auth;
pub mod fd_pass;
pub mod lane;
mod listen;
mod service;
mod watch_feed;

pub use auth::BearerCheck;
pub use listen::{bind_unix_socket, serve_engine_api};
pub use service::EngineApiService;
pub use watch_feed::WatchFeed;

/// The engine-API version `Info` reports (gateway/README.md says what each version added).
pub const ENGINE_API_VERSION: u32 = 2;
