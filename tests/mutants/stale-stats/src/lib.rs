//! Conformance mutant `stale-stats`: reports no live transfer in stats(), whatever is live; breaks OBS-2.
//! Test code only: it exists to prove the harness catches this defect, and never ships.

use kvgate_mutant_base::{mutant, Faults};

mutant!(Factory, "mutant-stale-stats", Faults { stale_live_transfers: true, ..Faults::default() });

kvgate_abi::export_plugin!(Factory);
