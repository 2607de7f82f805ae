//! Conformance mutant `reference`: the faithful base plugin with no fault: passes every clause.
//! Test code only: it exists to prove the harness catches this defect, and never ships.

use kvgate_mutant_base::{mutant, Faults};

mutant!(Factory, "mutant-reference", Faults::default());

kvgate_abi::export_plugin!(Factory);
