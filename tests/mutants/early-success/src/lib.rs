//! Conformance mutant `early-success`: reports SUCCEEDED before the last segment lands; breaks DATA-1.
//! Test code only: it exists to prove the harness catches this defect, and never ships.

use kvgate_mutant_base::{mutant, Faults};

mutant!(Factory, "mutant-early-success", Faults { succeed_before_last_segment: true, ..Faults::default() });

kvgate_abi::export_plugin!(Factory);
