//! Conformance mutant `silent-pin`: cancel is dropped while the receiver has not granted the ticket (the SGLang/NIXL silent pin); breaks ABORT-1.
//! Test code only: it exists to prove the harness catches this defect, and never ships.

use kvgate_mutant_base::{mutant, Faults};

mutant!(Factory, "mutant-silent-pin", Faults { ignore_cancel_while_waiting_for_ticket: true, ..Faults::default() });

kvgate_abi::export_plugin!(Factory);
