//! Conformance mutant `reference-udp`: the faithful base plugin over loopback UDP, with no fault: passes every clause, the network ones included.
//! Test code only: it shows the harness passes a faithful network plugin, and never ships.

use kvgate_mutant_base::{mutant, Faults};

mutant!(Factory, "mutant-reference-udp", Faults { udp: true, ..Faults::default() });

kvgate_abi::export_plugin!(Factory);
