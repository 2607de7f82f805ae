//! Conformance mutant `premature-quiesce`: a cancel mid-copy reports `FAILED` with the quiesced flag
//! at once, while its copy worker notices the stop only at the next segment boundary and writes the
//! rest of the segment in progress (at most 64 KiB per millisecond) after the report; breaks RES-3.
//! Test code only: it exists to prove the harness catches this defect, and never ships.

use kvgate_mutant_base::{mutant, Faults};

mutant!(
    Factory,
    "mutant-premature-quiesce",
    Faults { quiesce_before_copy_stops: true, copy_bytes_per_ms: 64 << 10, ..Faults::default() }
);

kvgate_abi::export_plugin!(Factory);
