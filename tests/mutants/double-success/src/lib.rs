//! Conformance mutant `double-success`: reports SUCCEEDED twice; breaks RES-1.
//! Test code only: it exists to prove the harness catches this defect, and never ships.

use kvgate_mutant_base::{mutant, Faults};

mutant!(Factory, "mutant-double-success", Faults { double_success: true, ..Faults::default() });

kvgate_abi::export_plugin!(Factory);
