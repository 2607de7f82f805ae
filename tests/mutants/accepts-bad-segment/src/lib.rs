//! Conformance mutant `accepts-bad-segment`: accepts out-of-range segments and fails them during the copy, after moving bytes; breaks DATA-3.
//! Test code only: it exists to prove the harness catches this defect, and never ships.

use kvgate_mutant_base::{mutant, Faults};

mutant!(Factory, "mutant-accepts-bad-segment", Faults { skip_segment_range_checks: true, ..Faults::default() });

kvgate_abi::export_plugin!(Factory);
