//! Conformance mutant `panic-in-submit`: panics in submit on an offset overflow (the SDK turns it into a PANIC error); breaks HYGIENE-1.
//! Test code only: it exists to prove the harness catches this defect, and never ships.

use kvgate_mutant_base::{mutant, Faults};

mutant!(Factory, "mutant-panic-in-submit", Faults { panic_on_offset_overflow: true, ..Faults::default() });

kvgate_abi::export_plugin!(Factory);
