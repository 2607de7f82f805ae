//! Conformance mutant `silent-shutdown`: drops live transfers at shutdown without their terminal events; breaks RES-5.
//! Test code only: it exists to prove the harness catches this defect, and never ships.

use kvgate_mutant_base::{mutant, Faults};

mutant!(Factory, "mutant-silent-shutdown", Faults { shutdown_without_terminal_events: true, ..Faults::default() });

kvgate_abi::export_plugin!(Factory);
