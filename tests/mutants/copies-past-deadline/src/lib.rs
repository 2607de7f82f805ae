//! Conformance mutant `copies-past-deadline`: checks the deadline only before a copy starts, never during it; breaks TIME-4.
//! Test code only: it exists to prove the harness catches this defect, and never ships.

use kvgate_mutant_base::{mutant, Faults};

mutant!(Factory, "mutant-copies-past-deadline", Faults { no_deadline_during_copy: true, ..Faults::default() });

kvgate_abi::export_plugin!(Factory);
