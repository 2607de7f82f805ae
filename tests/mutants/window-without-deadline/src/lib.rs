//! Conformance mutant `window-without-deadline`: over UDP, the sender waits for the receiver to take a window of data for ever, sending it again past the deadline; breaks TIME-12.
//! Test code only: it exists to prove the harness catches this defect, and never ships.

use kvgate_mutant_base::{mutant, Faults};

mutant!(Factory, "mutant-window-without-deadline", Faults { udp: true, no_deadline_while_waiting_for_window: true, ..Faults::default() });

kvgate_abi::export_plugin!(Factory);
