//! Conformance mutant `fail-open-deregister`: stops a copy whose source region is deregistered and reports SUCCEEDED for what was copied; breaks DATA-4.
//! Test code only: it exists to prove the harness catches this defect, and never ships.

use kvgate_mutant_base::{mutant, Faults};

mutant!(Factory, "mutant-fail-open-deregister", Faults { deregister_succeeds_partial_copy: true, ..Faults::default() });

kvgate_abi::export_plugin!(Factory);
