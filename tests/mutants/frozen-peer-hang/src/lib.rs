//! Conformance mutant `frozen-peer-hang`: no deadline while waiting for the receiver's acknowledgement: hangs under a frozen peer; breaks TIME-2.
//! Test code only: it exists to prove the harness catches this defect, and never ships.

use kvgate_mutant_base::{mutant, Faults};

mutant!(Factory, "mutant-frozen-peer-hang", Faults { no_deadline_while_waiting_for_ack: true, ..Faults::default() });

kvgate_abi::export_plugin!(Factory);
