//! Conformance mutant `cancel-waits-for-ack`: drops a cancel while the transfer waits for the receiver's acknowledgement; breaks ABORT-2.
//! Test code only: it exists to prove the harness catches this defect, and never ships.

use kvgate_mutant_base::{mutant, Faults};

mutant!(Factory, "mutant-cancel-waits-for-ack", Faults { cancel_left_to_ack: true, ..Faults::default() });

kvgate_abi::export_plugin!(Factory);
