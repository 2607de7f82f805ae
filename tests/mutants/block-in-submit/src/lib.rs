//! Conformance mutant `block-in-submit`: submit sends to the peer on a blocking socket: blocks once a frozen peer leaves a few notes unread; breaks TIME-5.
//! Test code only: it exists to prove the harness catches this defect, and never ships.

use kvgate_mutant_base::{mutant, Faults};

mutant!(Factory, "mutant-block-in-submit", Faults { blocking_send_in_submit: true, ..Faults::default() });

kvgate_abi::export_plugin!(Factory);
