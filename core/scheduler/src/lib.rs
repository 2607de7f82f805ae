//! kvgate-core: the sans-IO scheduler. It owns every room's lifecycle, deadline, tombstone and
//! quarantine, and its metrics, as plain data driven by `handle_*(now, ..)` and drained by `poll_*()`.
//! It never reads a clock, spawns a thread, does IO or calls a plugin.
//!
//! Driver contract (what the gateway, the conformance harness and the simulation all do):
//! - feed every input with the current monotonic time: `handle_engine`, `handle_peer_message`,
//!   `handle_plugin_event`, `handle_peer_up` / `handle_peer_lost`, region (un)registration;
//! - drain plugin events and peer messages already received *before* calling `handle_timeout`, so
//!   a completion already observable wins over a deadline (CONFORMANCE TIME-9);
//! - after every input, drain `poll_command()` and execute the commands in order, then re-arm one
//!   timer at `poll_timeout()`;
//! - report a synchronous `submit` error as `Event::failed_quiesced(xfer, code, message)`;
//! - call `handle_remote_region` after `handle_peer_up` of the peer's current incarnation;
//! - optionally: send with `handle_send` and expect with `handle_expect` (slices borrowed, no `Vec`
//!   per request) instead of `handle_engine(EngineRequest::Send / Expect {..})`, and hand executed
//!   commands back with `recycle_command` so the core reuses their buffers (segments, ranges, sent
//!   notices' parts and tickets). Peer messages are handed in borrowed (`&PeerMessage`).
//!
//! Decisions: a chunk that maps to more than `max_segments_per_submit` segments is refused
//! (`too_many_segments`), never split; every room gets exactly one `Terminal` then one `Reusable`
//! event; a newer generation of a room id supersedes a live older one (`superseded`); a dropped
//! tombstone (after `tombstone_ttl_ms` or past `max_tombstones`) no longer refuses late messages.
//!
//! Assertion policy. Nothing an engine, a peer or a plugin sends is asserted: untrusted input is
//! refused, counted late or counted as a violation, and never panics the core. What is asserted is
//! the core's own bookkeeping, in three tiers:
//! - `assert!`, on in release: a bound whose breach would silently corrupt state that later code
//!   cannot detect, checked once per insert and not per event: a slab slot or timer-wheel handle
//!   reaching the tag bit that marks a tombstone record or a nursery entry (2^31), the room-key
//!   table's empty marker used as a value or the table growing past `MAX_KEY_TABLE_SLOTS` (past it a
//!   stale key could alias a held tombstone), an id inserted out of order into the sequential id
//!   table. Each is one compare; a panic there is better than answering for the wrong room.
//! - `expect` / `unreachable!`: the core's structural invariants (a slot named by a live reference
//!   holds a room, a transfer belongs to a sender room, a ticket to a receiver room); a failure is a
//!   core bug, and stopping beats acting on another room's data.
//! - `debug_assert!`, off in release: checks whose failure has a safe, observable release
//!   behaviour. An input one of the declared tables (`table`, `lifecycle`) refuses is counted in
//!   `Metrics::illegal_transitions`, the latest kept in `Metrics::latest_illegal_transition`, and the
//!   room or transfer keeps its state; a timer entry for a vanished room is skipped. Debug builds
//!   (and so the tests) stop at the first one.

#![forbid(unsafe_code)]

pub mod api;
pub mod config;
mod core;
pub mod lifecycle;
pub mod metrics;
pub mod table;
pub mod timer;
mod wheel;

/// The unit tests' seeded generator (splitmix64): the wheel and the id table check themselves
/// against reference maps with it.
#[cfg(test)]
pub(crate) fn test_random(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

pub use crate::api::*;
pub use crate::config::{ConfigError, CoreConfig};
pub use crate::core::Core;
pub use crate::lifecycle::{
    render_ticket_table, render_transfer_table, ticket_transition, transfer_transition, RefusedInput, TicketState,
    TransferState,
};
pub use crate::metrics::{HarmlessAbort, LateSource, Metrics};
pub use crate::table::{render_table, transition, IllegalTransition, RoomInput};
pub use crate::timer::TimerKind;
pub use kvgate_abi::{Event, LocalKey, LocalRange, PeerId, ReasonCode, RemoteKey, Segment, Ticket, XferId};
