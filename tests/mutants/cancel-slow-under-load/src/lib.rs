//! Conformance mutant `cancel-slow-under-load`: while more than 64 transfers are live, a cancel of a
//! transfer not being copied is queued for the worker, which ends one queued transfer per
//! millisecond. One cancel is fast; the last of a few hundred cancelled under load ends hundreds of
//! milliseconds after its cancel returned. Breaks ABORT-4 (its loaded case times every cancel against
//! G). Test code only: it exists to prove the harness catches this defect, and never ships.

use kvgate_mutant_base::{mutant, Faults};

mutant!(Factory, "mutant-cancel-slow-under-load", Faults { cancel_queued_when_busy: true, ..Faults::default() });

kvgate_abi::export_plugin!(Factory);
