//! Conformance mutant `truncated-scatter-list`: copies only the first 1024 segments of a transfer and succeeds anyway; breaks DATA-2.
//! Test code only: it exists to prove the harness catches this defect, and never ships.

use kvgate_mutant_base::{mutant, Faults};

mutant!(Factory, "mutant-truncated-scatter-list", Faults { copy_first_segments_only: true, ..Faults::default() });

kvgate_abi::export_plugin!(Factory);
