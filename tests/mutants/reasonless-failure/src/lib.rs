//! Conformance mutant `reasonless-failure`: reports failures with reason 0 and no message; breaks OBS-1.
//! Test code only: it exists to prove the harness catches this defect, and never ships.

use kvgate_mutant_base::{mutant, Faults};

mutant!(Factory, "mutant-reasonless-failure", Faults { reasonless_failures: true, ..Faults::default() });

kvgate_abi::export_plugin!(Factory);
