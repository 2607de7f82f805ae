//! Conformance mutant `write-after-cancel`: reports quiesced at cancel but keeps copying; breaks RES-3.
//! Test code only: it exists to prove the harness catches this defect, and never ships.

use kvgate_mutant_base::{mutant, Faults};

mutant!(Factory, "mutant-write-after-cancel", Faults { write_after_cancel: true, default_segment_delay_us: 50, ..Faults::default() });

kvgate_abi::export_plugin!(Factory);
