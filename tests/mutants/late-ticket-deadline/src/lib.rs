//! Conformance mutant `late-ticket-deadline`: times a transfer waiting for the receiver's grant out a second late (a coarse sweep); breaks TIME-1.
//! Test code only: it exists to prove the harness catches this defect, and never ships.

use kvgate_mutant_base::{mutant, Faults};

mutant!(Factory, "mutant-late-ticket-deadline", Faults { coarse_deadline_while_waiting_for_ticket: true, ..Faults::default() });

kvgate_abi::export_plugin!(Factory);
