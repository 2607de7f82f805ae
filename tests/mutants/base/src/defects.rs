//! The conformance mutants' defects, one row each: the name a test and CONFORMANCE.md's table of
//! mutants call it by, and the [`Faults`] it switches on. One library (`tests/mutants/library`)
//! serves every row; the row is chosen when the library loads ([`DEFECT_ENV`]), not by the plugin's
//! config, because HYGIENE-3 opens the plugin with configs that do not parse.

use crate::Faults;

/// The environment variable that names the defect a loaded mutant library carries (a row's `name`);
/// unset, it is `reference`, the faithful plugin.
pub const DEFECT_ENV: &str = "KVGATE_MUTANT";

/// One deliberately broken variant of the base plugin.
#[derive(Clone, Copy, Debug)]
pub struct Defect {
    /// The name tests and CONFORMANCE.md use (`silent-pin`).
    pub name: &'static str,
    /// The plugin name the library reports with this defect (`mutant-silent-pin`).
    pub plugin: &'static str,
    pub faults: Faults,
}

macro_rules! defect {
    ($name:literal, $faults:expr) => {
        Defect { name: $name, plugin: concat!("mutant-", $name), faults: $faults }
    };
}

/// Every defect, and the two faithful variants (`reference`, `reference-udp`), by name.
pub const DEFECTS: &[Defect] = &[
    // A watchdog thread aborts the whole process once it finds it was not scheduled for 250 ms (the receiver
    // frozen, then resumed); the host dies with no call in progress, between the harness's calls; breaks
    // HYGIENE-1.
    defect!("abort-after-stall", Faults { abort_after_stall: true, ..Faults::NONE }),
    // Takes any bytes as a peer's endpoint at connect; breaks HANDSHAKE-4.
    defect!("accepts-bad-endpoint", Faults { accept_any_endpoint: true, ..Faults::NONE }),
    // Accepts out-of-range segments and fails them during the copy, after moving bytes; breaks DATA-3.
    defect!("accepts-bad-segment", Faults { skip_segment_range_checks: true, ..Faults::NONE }),
    // Accepts CUDA device memory at register although it serves host memory only; breaks HANDSHAKE-3.
    defect!("accepts-cuda-region", Faults { accept_any_memory_kind: true, ..Faults::NONE }),
    // Submit sends to the peer on a blocking socket: blocks once a frozen peer leaves a few notes unread;
    // breaks TIME-5.
    defect!("block-in-submit", Faults { blocking_send_in_submit: true, ..Faults::NONE }),
    // While more than 64 transfers are live, a cancel of a transfer not being copied is queued for the worker,
    // which ends one queued transfer per millisecond. One cancel is fast; the last of a few hundred cancelled
    // under load ends hundreds of milliseconds after its cancel returned. Breaks ABORT-4 (its loaded case
    // times every cancel against G).
    defect!("cancel-slow-under-load", Faults { cancel_queued_when_busy: true, ..Faults::NONE }),
    // Drops a cancel while the transfer waits for the receiver's acknowledgement; breaks ABORT-2.
    defect!("cancel-waits-for-ack", Faults { cancel_left_to_ack: true, ..Faults::NONE }),
    // Checks the deadline only before a copy starts, never during it; breaks TIME-4.
    defect!("copies-past-deadline", Faults { no_deadline_during_copy: true, ..Faults::NONE }),
    // Leaves a disconnected peer's transfers to their deadlines; breaks TIME-3 and HANDSHAKE-2.
    defect!("disconnect-keeps-transfers", Faults { disconnect_keeps_transfers: true, ..Faults::NONE }),
    // Reports SUCCEEDED twice; breaks RES-1.
    defect!("double-success", Faults { double_success: true, ..Faults::NONE }),
    // Drops cancels while more than 256 transfers are live (a bounded cancel queue overflowing silently);
    // breaks ABORT-4.
    defect!("drops-cancels-when-busy", Faults { drop_cancels_when_busy: true, ..Faults::NONE }),
    // Reports SUCCEEDED before the last segment lands; breaks DATA-1.
    defect!("early-success", Faults { succeed_before_last_segment: true, ..Faults::NONE }),
    // Stops a copy whose source region is deregistered and reports SUCCEEDED for what was copied; breaks
    // DATA-4.
    defect!("fail-open-deregister", Faults { deregister_succeeds_partial_copy: true, ..Faults::NONE }),
    // Reports a failure event when cancel names a transfer it does not know; breaks ABORT-3 and RES-1.
    defect!("fails-unknown-cancels", Faults { fail_unknown_cancels: true, ..Faults::NONE }),
    // No deadline while waiting for the receiver's acknowledgement: hangs under a frozen peer; breaks TIME-2.
    defect!("frozen-peer-hang", Faults { no_deadline_while_waiting_for_ack: true, ..Faults::NONE }),
    // Opens with its defaults when its config does not parse; breaks HYGIENE-3.
    defect!("ignores-bad-config", Faults { ignore_config_errors: true, ..Faults::NONE }),
    // A cancel that arrives once the copy has started is ignored; the copy finishes after the cancel returned
    // and the transfer reports `SUCCEEDED`; breaks RES-3 (a success after a cancel whose bytes landed after
    // the cancel was accepted).
    defect!("ignores-cancel-mid-transfer", Faults { ignore_cancel_mid_copy: true, ..Faults::NONE }),
    // Times a transfer waiting for the receiver's grant out a second late (a coarse sweep); breaks TIME-1.
    defect!("late-ticket-deadline", Faults { coarse_deadline_while_waiting_for_ticket: true, ..Faults::NONE }),
    // Keeps every cancelled transfer in its table for ever; breaks RES-2.
    defect!("leak-on-abort", Faults { leak_on_cancel: true, ..Faults::NONE }),
    // Every hundredth `SUCCEEDED` is never delivered (the transfer is done and forgotten, its terminal event
    // lost); breaks RES-1.
    defect!("loses-terminal-event", Faults { lose_some_successes: true, ..Faults::NONE }),
    // Panics in submit on an offset overflow (the SDK turns it into a PANIC error); breaks HYGIENE-1.
    defect!("panic-in-submit", Faults { panic_on_offset_overflow: true, ..Faults::NONE }),
    // A cancel mid-copy reports `FAILED` with the quiesced flag at once, while its copy worker notices the
    // stop only at the next segment boundary and writes the rest of the segment in progress (at most 64 KiB
    // per millisecond) after the report; breaks RES-3.
    defect!(
        "premature-quiesce",
        Faults { quiesce_before_copy_stops: true, copy_bytes_per_ms: 64 << 10, ..Faults::NONE }
    ),
    // Emits `PROGRESS` after each copied segment, but with the bytes of that segment instead of the running
    // total, so progress goes backwards whenever a shorter segment follows a longer one; breaks OBS-5.
    defect!("progress-backwards", Faults { progress_events: true, progress_per_segment: true, ..Faults::NONE }),
    // Reports failures with reason 0 and no message; breaks OBS-1.
    defect!("reasonless-failure", Faults { reasonless_failures: true, ..Faults::NONE }),
    // The faithful base plugin with no fault: passes every clause.
    defect!("reference", Faults::NONE),
    // The faithful base plugin over loopback UDP, with no fault: passes every clause, the network ones
    // included.
    defect!("reference-udp", Faults { udp: true, ..Faults::NONE }),
    // Cancel is dropped while the receiver has not granted the ticket (the SGLang/NIXL silent pin); breaks
    // ABORT-1.
    defect!("silent-pin", Faults { ignore_cancel_while_waiting_for_ticket: true, ..Faults::NONE }),
    // Drops live transfers at shutdown without their terminal events; breaks RES-5.
    defect!("silent-shutdown", Faults { shutdown_without_terminal_events: true, ..Faults::NONE }),
    // Reports no live transfer in stats(), whatever is live; breaks OBS-2.
    defect!("stale-stats", Faults { stale_live_transfers: true, ..Faults::NONE }),
    // Copies only the first 1024 segments of a transfer and succeeds anyway; breaks DATA-2.
    defect!("truncated-scatter-list", Faults { copy_first_segments_only: true, ..Faults::NONE }),
    // Open fails with UNAVAILABLE: every clause must be reported unsupported, never pass.
    defect!("unavailable", Faults { unavailable: true, ..Faults::NONE }),
    // Over UDP, the receiver writes data datagrams without checking their checksum; breaks DATA-7.
    defect!("unchecked-payloads", Faults { udp: true, unchecked_payloads: true, ..Faults::NONE }),
    // Over UDP, the sender waits for the receiver to take a window of data for ever, sending it again past the
    // deadline; breaks TIME-12.
    defect!(
        "window-without-deadline",
        Faults { udp: true, no_deadline_while_waiting_for_window: true, ..Faults::NONE }
    ),
    // Reports quiesced at cancel but keeps copying; breaks RES-3.
    defect!("write-after-cancel", Faults { write_after_cancel: true, default_segment_delay_us: 50, ..Faults::NONE }),
];

/// The row named `name`.
pub fn defect(name: &str) -> Option<&'static Defect> {
    DEFECTS.iter().find(|d| d.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_only_the_references_carry_no_fault() {
        for (i, d) in DEFECTS.iter().enumerate() {
            assert!(DEFECTS[..i].iter().all(|e| e.name != d.name), "{} twice", d.name);
            assert_eq!(d.plugin, format!("mutant-{}", d.name));
            let faithful = format!("{:?}", Faults { udp: d.faults.udp, ..Faults::NONE }) == format!("{:?}", d.faults);
            assert_eq!(faithful, d.name.starts_with("reference"), "{}", d.name);
        }
        assert_eq!(format!("{:?}", Faults::NONE), format!("{:?}", Faults::default()));
    }
}
