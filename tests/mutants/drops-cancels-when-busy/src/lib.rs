//! Conformance mutant `drops-cancels-when-busy`: drops cancels while more than 256 transfers are live (a bounded cancel queue overflowing silently); breaks ABORT-4.
//! Test code only: it exists to prove the harness catches this defect, and never ships.

use kvgate_mutant_base::{mutant, Faults};

mutant!(Factory, "mutant-drops-cancels-when-busy", Faults { drop_cancels_when_busy: true, ..Faults::default() });

kvgate_abi::export_plugin!(Factory);
