//! Conformance mutant `abort-after-stall`: a watchdog thread aborts the whole process once it finds it
//! was not scheduled for 250 ms (the receiver frozen, then resumed); the host dies with no call in
//! progress, between the harness's calls; breaks HYGIENE-1.
//! Test code only: it exists to prove the harness catches this defect, and never ships.

use kvgate_mutant_base::{mutant, Faults};

mutant!(Factory, "mutant-abort-after-stall", Faults { abort_after_stall: true, ..Faults::default() });

kvgate_abi::export_plugin!(Factory);
