//! kvgate-core: the sans-IO scheduler. It owns every room's lifecycle, deadline, tombstone and
//! quarantine, and its metrics, as plain data driven by `handle_*(now, ..)` and drained by `poll_*()`.
//! It never reads a clock, spawns a thread, does IO or calls a plugin.

pub mod api;
pub mod config;
mod core;
pub mod metrics;
pub mod table;
pub mod timer;
mod wheel;

pub use crate::api::*;
pub use crate::config::{ConfigError, CoreConfig};
pub use crate::core::Core;
pub use crate::metrics::{HarmlessAbort, LateSource, Metrics, ViolationClause};
pub use crate::table::{render_table, transition, IllegalTransition, RoomInput};
pub use crate::timer::TimerKind;
pub use kvgate_abi::{Event, LocalKey, LocalRange, PeerId, ReasonCode, RemoteKey, Segment, Ticket, XferId};
