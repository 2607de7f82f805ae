//! Conformance mutant `progress-backwards`: emits `PROGRESS` after each copied segment, but with the
//! bytes of that segment instead of the running total, so progress goes backwards whenever a shorter
//! segment follows a longer one; breaks OBS-5.
//! Test code only: it exists to prove the harness catches this defect, and never ships.

use kvgate_mutant_base::{mutant, Faults};

mutant!(Factory, "mutant-progress-backwards", Faults { progress_events: true, progress_per_segment: true, ..Faults::default() });

kvgate_abi::export_plugin!(Factory);
