//! Conformance mutant `loses-terminal-event`: every hundredth `SUCCEEDED` is never delivered (the
//! transfer is done and forgotten, its terminal event lost); breaks RES-1.
//! Test code only: it exists to prove the harness catches this defect, and never ships.

use kvgate_mutant_base::{mutant, Faults};

mutant!(Factory, "mutant-loses-terminal-event", Faults { lose_some_successes: true, ..Faults::default() });

kvgate_abi::export_plugin!(Factory);
