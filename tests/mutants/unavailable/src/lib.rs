//! Conformance mutant `unavailable`: open fails with UNAVAILABLE: every clause must be reported unsupported, never pass.
//! Test code only: it exists to prove the harness catches this defect, and never ships.

use kvgate_mutant_base::{mutant, Faults};

mutant!(Factory, "mutant-unavailable", Faults { unavailable: true, ..Faults::default() });

kvgate_abi::export_plugin!(Factory);
