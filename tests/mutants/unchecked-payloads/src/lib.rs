//! Conformance mutant `unchecked-payloads`: over UDP, the receiver writes data datagrams without checking their checksum; breaks DATA-7.
//! Test code only: it exists to prove the harness catches this defect, and never ships.

use kvgate_mutant_base::{mutant, Faults};

mutant!(Factory, "mutant-unchecked-payloads", Faults { udp: true, unchecked_payloads: true, ..Faults::default() });

kvgate_abi::export_plugin!(Factory);
