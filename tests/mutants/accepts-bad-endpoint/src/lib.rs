//! Conformance mutant `accepts-bad-endpoint`: takes any bytes as a peer's endpoint at connect; breaks HANDSHAKE-4.
//! Test code only: it exists to prove the harness catches this defect, and never ships.

use kvgate_mutant_base::{mutant, Faults};

mutant!(Factory, "mutant-accepts-bad-endpoint", Faults { accept_any_endpoint: true, ..Faults::default() });

kvgate_abi::export_plugin!(Factory);
