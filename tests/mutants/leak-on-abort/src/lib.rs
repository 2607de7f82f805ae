//! Conformance mutant `leak-on-abort`: keeps every cancelled transfer in its table for ever; breaks RES-2.
//! Test code only: it exists to prove the harness catches this defect, and never ships.

use kvgate_mutant_base::{mutant, Faults};

mutant!(Factory, "mutant-leak-on-abort", Faults { leak_on_cancel: true, ..Faults::default() });

kvgate_abi::export_plugin!(Factory);
