//! Conformance mutant `fails-unknown-cancels`: reports a failure event when cancel names a transfer it does not know; breaks ABORT-3 and RES-1.
//! Test code only: it exists to prove the harness catches this defect, and never ships.

use kvgate_mutant_base::{mutant, Faults};

mutant!(Factory, "mutant-fails-unknown-cancels", Faults { fail_unknown_cancels: true, ..Faults::default() });

kvgate_abi::export_plugin!(Factory);
