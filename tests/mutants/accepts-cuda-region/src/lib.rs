//! Conformance mutant `accepts-cuda-region`: accepts CUDA device memory at register although it serves host memory only; breaks HANDSHAKE-3.
//! Test code only: it exists to prove the harness catches this defect, and never ships.

use kvgate_mutant_base::{mutant, Faults};

mutant!(Factory, "mutant-accepts-cuda-region", Faults { accept_any_memory_kind: true, ..Faults::default() });

kvgate_abi::export_plugin!(Factory);
