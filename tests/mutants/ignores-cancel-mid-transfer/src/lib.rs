//! Conformance mutant `ignores-cancel-mid-transfer`: a cancel that arrives once the copy has started
//! is ignored; the copy finishes after the cancel returned and the transfer reports `SUCCEEDED`;
//! breaks RES-3 (a success after a cancel whose bytes landed after the cancel was accepted).
//! Test code only: it exists to prove the harness catches this defect, and never ships.

use kvgate_mutant_base::{mutant, Faults};

mutant!(Factory, "mutant-ignores-cancel-mid-transfer", Faults { ignore_cancel_mid_copy: true, ..Faults::default() });

kvgate_abi::export_plugin!(Factory);
