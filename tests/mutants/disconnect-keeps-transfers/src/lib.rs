//! Conformance mutant `disconnect-keeps-transfers`: leaves a disconnected peer's transfers to their deadlines; breaks TIME-3 and HANDSHAKE-2.
//! Test code only: it exists to prove the harness catches this defect, and never ships.

use kvgate_mutant_base::{mutant, Faults};

mutant!(Factory, "mutant-disconnect-keeps-transfers", Faults { disconnect_keeps_transfers: true, ..Faults::default() });

kvgate_abi::export_plugin!(Factory);
