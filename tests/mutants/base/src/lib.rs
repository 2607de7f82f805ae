//! kvgate-mutant-base: a small, faithful same-host plugin that the conformance mutants break in
//! exactly one way each (a [`Faults`] switch). The sender copies into the receiver's shared file
//! once the receiver has granted the transfer's ticket over a Unix datagram socket, then waits for
//! the receiver's acknowledgement. With no fault switched on it passes every clause of CONFORMANCE.md;
//! it is test code and never ships in the gateway.
//!
//! Its network variant ([`Faults::udp`]) moves bytes and control over loopback UDP instead: the
//! sender sends checksummed data datagrams a window at a time, the receiver stages them and writes
//! them into its region when the sender commits, then acknowledges. A fault proxy can stand between
//! the two, so the network clauses (TIME-12, DATA-7) apply to it.

pub mod defects;
mod link;
mod plugin;
mod udp_rx;
mod udp_tx;
mod udp_wire;
mod wire;
mod worker;

pub use defects::{defect, Defect, DEFECTS, DEFECT_ENV};
pub use plugin::RefPlugin;

use kvgate_abi::sdk::Sink;
use kvgate_abi::{scope, Capabilities, MemoryKind, PluginError, PluginInfo, ReasonCode, ABI_VERSION};

/// The one thing a mutant breaks. Every switch off is the faithful plugin.
#[derive(Clone, Copy, Debug, Default)]
pub struct Faults {
    /// `cancel` looks the transfer up only among those whose ticket the receiver granted (the
    /// SGLang/NIXL silent pin): a transfer still waiting for the peer stays waiting.
    pub ignore_cancel_while_waiting_for_ticket: bool,
    /// No deadline while waiting for the receiver's acknowledgement (hangs under a frozen peer).
    pub no_deadline_while_waiting_for_ack: bool,
    /// `submit` notifies the receiver on a blocking socket (blocks once a frozen peer leaves a few notes unread).
    pub blocking_send_in_submit: bool,
    /// Report `SUCCEEDED` twice.
    pub double_success: bool,
    /// `cancel` reports the failure but keeps the transfer in its table for ever.
    pub leak_on_cancel: bool,
    /// `cancel` mid-copy reports failed-and-quiesced at once, but the copy goes on.
    pub write_after_cancel: bool,
    /// Report `SUCCEEDED` before the last segment is copied.
    pub succeed_before_last_segment: bool,
    /// `submit` checks no segment range; the copy fails on the first bad one, after moving bytes.
    pub skip_segment_range_checks: bool,
    /// `register` accepts any memory kind.
    pub accept_any_memory_kind: bool,
    /// Failures carry reason 0 and no message.
    pub reasonless_failures: bool,
    /// `submit` computes `offset + len` with an `expect` (panics on overflow).
    pub panic_on_offset_overflow: bool,
    /// `open` fails with `UNAVAILABLE`.
    pub unavailable: bool,
    /// `stats()` reports no live transfer, whatever is live.
    pub stale_live_transfers: bool,
    /// `open` falls back to the default settings when its config does not parse.
    pub ignore_config_errors: bool,
    /// `connect` takes any bytes as the peer's endpoint.
    pub accept_any_endpoint: bool,
    /// `shutdown` drops live transfers without their terminal events.
    pub shutdown_without_terminal_events: bool,
    /// `cancel` is dropped while more than [`BUSY_LIVE_TRANSFERS`] transfers are live (a bounded
    /// cancel queue that overflows silently).
    pub drop_cancels_when_busy: bool,
    /// Only the first [`COPIED_SEGMENTS_LIMIT`] segments of a transfer are copied; it succeeds anyway
    /// (a fixed-size scatter list truncated).
    pub copy_first_segments_only: bool,
    /// A transfer waiting for the receiver to grant its ticket times out up to
    /// [`COARSE_SWEEP_MS`] late (a sweep of stale requests on a coarse timer).
    pub coarse_deadline_while_waiting_for_ticket: bool,
    /// The deadline is not checked during a copy, only before it starts.
    pub no_deadline_during_copy: bool,
    /// A cancel that arrives while the transfer waits for the receiver's acknowledgement is dropped,
    /// left to the acknowledgement (which a frozen or dead receiver never sends).
    pub cancel_left_to_ack: bool,
    /// `deregister` of a source region mid-copy stops the copy and reports `SUCCEEDED` for what was
    /// copied (fail-open).
    pub deregister_succeeds_partial_copy: bool,
    /// `cancel` of an id it does not know reports a failure event for it.
    pub fail_unknown_cancels: bool,
    /// `disconnect` forgets the peer but leaves its transfers to their deadlines.
    pub disconnect_keeps_transfers: bool,
    /// The receiver writes data datagrams without checking their checksum (UDP variant only).
    pub unchecked_payloads: bool,
    /// No deadline while the sender waits for the receiver to take a window of data datagrams; it
    /// sends them again for ever (UDP variant only).
    pub no_deadline_while_waiting_for_window: bool,
    /// The receiver never answers `DONE` (its acknowledgement is never sent).
    pub never_acknowledge: bool,
    /// A watchdog thread aborts the whole process when it finds it was not scheduled for
    /// [`WATCHDOG_STALL_MS`] (a process frozen and resumed, say), as training stacks' collective
    /// watchdogs do: the host dies with no call in progress.
    pub abort_after_stall: bool,
    /// Every [`LOST_SUCCESS_EVERY`]th `SUCCEEDED` is never delivered: the transfer is done and
    /// forgotten, its terminal event lost (an event queue that drops an entry now and then).
    pub lose_some_successes: bool,
    /// Not a fault: emits `PROGRESS` after each copied segment, with the running total of bytes moved
    /// (same-host variant), and advertises `PROGRESS_EVENTS`.
    pub progress_events: bool,
    /// With `progress_events`: each `PROGRESS` carries the bytes of the segment just copied instead
    /// of the running total, so it goes backwards whenever a shorter segment follows a longer one.
    pub progress_per_segment: bool,
    /// `cancel` mid-copy reports `FAILED` with the quiesced flag as soon as it has asked the copy to
    /// stop, but the copy notices the request only between segments: the segment in progress is
    /// written on after the report (a worker that checks its stop flag per segment, not per piece).
    pub quiesce_before_copy_stops: bool,
    /// A cancel that arrives once the copy has started is ignored: the copy finishes and the
    /// transfer reports `SUCCEEDED` (a "too late to cancel" shortcut taken while bytes still move).
    pub ignore_cancel_mid_copy: bool,
    /// While more than [`QUEUED_CANCEL_LIVE_TRANSFERS`] transfers are live, a cancel of a transfer
    /// not being copied is queued for the worker, which ends one queued transfer per
    /// [`QUEUED_CANCEL_TICK_MS`]: a cancel is fast with few transfers live and its latency grows with
    /// the number cancelled under load (a cancel path handed to a worker loop that drains it one entry
    /// per turn).
    pub cancel_queued_when_busy: bool,
    /// Not a fault: the same-host copy moves at most this many bytes per millisecond (a rate limit;
    /// 0 for none), so a large segment takes a while to write.
    pub copy_bytes_per_ms: u64,
    /// Not a fault: the network variant, over loopback UDP.
    pub udp: bool,
    /// Pacing of the copy, per segment, unless the config sets `segment_delay_us`.
    pub default_segment_delay_us: u64,
}

impl Faults {
    /// Every switch off: the faithful plugin (equal to `Faults::default()`, usable in a `const`).
    pub const NONE: Faults = Faults {
        ignore_cancel_while_waiting_for_ticket: false,
        no_deadline_while_waiting_for_ack: false,
        blocking_send_in_submit: false,
        double_success: false,
        leak_on_cancel: false,
        write_after_cancel: false,
        succeed_before_last_segment: false,
        skip_segment_range_checks: false,
        accept_any_memory_kind: false,
        reasonless_failures: false,
        panic_on_offset_overflow: false,
        unavailable: false,
        stale_live_transfers: false,
        ignore_config_errors: false,
        accept_any_endpoint: false,
        shutdown_without_terminal_events: false,
        drop_cancels_when_busy: false,
        copy_first_segments_only: false,
        coarse_deadline_while_waiting_for_ticket: false,
        no_deadline_during_copy: false,
        cancel_left_to_ack: false,
        deregister_succeeds_partial_copy: false,
        fail_unknown_cancels: false,
        disconnect_keeps_transfers: false,
        unchecked_payloads: false,
        no_deadline_while_waiting_for_window: false,
        never_acknowledge: false,
        abort_after_stall: false,
        lose_some_successes: false,
        progress_events: false,
        progress_per_segment: false,
        quiesce_before_copy_stops: false,
        ignore_cancel_mid_copy: false,
        cancel_queued_when_busy: false,
        copy_bytes_per_ms: 0,
        udp: false,
        default_segment_delay_us: 0,
    };
}

/// Live transfers past which `drop_cancels_when_busy` drops a cancel.
pub const BUSY_LIVE_TRANSFERS: usize = 256;
/// Live transfers past which `cancel_queued_when_busy` queues a cancel for the worker.
pub const QUEUED_CANCEL_LIVE_TRANSFERS: usize = 64;
/// How often, in milliseconds, the worker of `cancel_queued_when_busy` ends one queued transfer.
pub const QUEUED_CANCEL_TICK_MS: u64 = 1;
/// How late `coarse_deadline_while_waiting_for_ticket` times a waiting transfer out, in milliseconds.
pub const COARSE_SWEEP_MS: u64 = 1_000;
/// Longest stall, in milliseconds, `abort_after_stall`'s watchdog lets pass before it aborts.
pub const WATCHDOG_STALL_MS: u64 = 250;
/// How often, in milliseconds, that watchdog looks at the clock.
pub const WATCHDOG_TICK_MS: u64 = 5;
/// Segments `copy_first_segments_only` copies of a transfer.
pub const COPIED_SEGMENTS_LIMIT: usize = 1024;
/// `lose_some_successes` drops one `SUCCEEDED` in this many (the 100th, the 200th, ...): reached in
/// every run of the harness (TIME-5 alone completes 200 transfers after its freeze).
pub const LOST_SUCCESS_EVERY: u64 = 100;

/// Config keys (TOML, unknown keys refused).
#[derive(serde::Deserialize, Debug, Clone, Default)]
#[serde(deny_unknown_fields)]
pub struct RefConfig {
    /// Pause after each copied segment, in microseconds (0..=100000): makes transfers slow on
    /// purpose so that cancels land mid-copy.
    pub segment_delay_us: Option<u64>,
}

/// Largest accepted `segment_delay_us`.
pub const MAX_SEGMENT_DELAY_US: u64 = 100_000;
/// Most segments one submit may carry.
pub const MAX_SEGMENTS_PER_SUBMIT: u64 = 100_000;
/// Most live transfers.
pub const MAX_INFLIGHT_TRANSFERS: u64 = 1_000_000;

pub fn info(name: &str) -> PluginInfo {
    info_with(name, &Faults::default())
}

/// The plugin's info with what `faults` changes in it (`progress_events` advertises `PROGRESS_EVENTS`).
pub fn info_with(name: &str, faults: &Faults) -> PluginInfo {
    let flags = if faults.progress_events { kvgate_abi::cap_flags::PROGRESS_EVENTS } else { 0 };
    PluginInfo {
        name: name.into(),
        version: env!("CARGO_PKG_VERSION").into(),
        abi_version: ABI_VERSION,
        capabilities: Capabilities {
            memory_kinds: MemoryKind::HOST.bit(),
            scope: scope::SAME_HOST,
            // No receiver enforcement; progress events only when switched on.
            flags,
            max_segments_per_submit: MAX_SEGMENTS_PER_SUBMIT,
            max_inflight_transfers: MAX_INFLIGHT_TRANSFERS,
            max_transfer_bytes: 0,
        },
    }
}

/// Open an instance named `name` with `faults` switched on.
pub fn open(name: &'static str, config: &str, sink: Sink, faults: Faults) -> Result<RefPlugin, PluginError> {
    let config: RefConfig = match toml::from_str(config) {
        Ok(config) => config,
        // FAULT: a config that does not parse is ignored.
        Err(_) if faults.ignore_config_errors => RefConfig::default(),
        Err(e) => return Err(PluginError::new(ReasonCode::INVALID_ARGUMENT, format!("{name} config: {e}"))),
    };
    let delay = config.segment_delay_us.unwrap_or(faults.default_segment_delay_us);
    if delay > MAX_SEGMENT_DELAY_US {
        return Err(PluginError::new(
            ReasonCode::INVALID_ARGUMENT,
            format!("{name} config: segment_delay_us = {delay} exceeds {MAX_SEGMENT_DELAY_US}"),
        ));
    }
    if faults.unavailable {
        return Err(PluginError::new(
            ReasonCode::UNAVAILABLE,
            format!("{name}: this plugin never runs anywhere (a conformance mutant)"),
        ));
    }
    RefPlugin::start(name, sink, faults, delay)
}

/// Define a mutant's factory: `mutant!(Factory, "name", Faults { .. })`.
#[macro_export]
macro_rules! mutant {
    ($factory:ident, $name:expr, $faults:expr) => {
        pub struct $factory;
        impl ::kvgate_abi::sdk::PluginFactory for $factory {
            type Plugin = $crate::RefPlugin;
            fn info() -> ::kvgate_abi::PluginInfo {
                $crate::info_with($name, &$faults)
            }
            fn open(
                config: &str,
                sink: ::kvgate_abi::sdk::Sink,
            ) -> Result<$crate::RefPlugin, ::kvgate_abi::PluginError> {
                $crate::open($name, config, sink, $faults)
            }
        }
    };
}
