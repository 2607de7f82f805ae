//! Conformance mutant `ignores-bad-config`: opens with its defaults when its config does not parse; breaks HYGIENE-3.
//! Test code only: it exists to prove the harness catches this defect, and never ships.

use kvgate_mutant_base::{mutant, Faults};

mutant!(Factory, "mutant-ignores-bad-config", Faults { ignore_config_errors: true, ..Faults::default() });

kvgate_abi::export_plugin!(Factory);
