//! kvgate-conformance: the harness that runs any kvgate plugin through CONFORMANCE.md.
//! It loads the plugin through `kvgate-host` in separate sender and receiver peer processes (so it
//! can freeze, kill and restart them), checks every clause a plugin must meet, and reports pass,
//! fail (with evidence) or unsupported per clause. It never changes a plugin's outcome.
//!
//! Entry points: [`ConformanceArgs`] and [`run`] (`kvgate conformance`, `kvgate-conformance`).

pub mod clauses;
pub mod cli;
pub mod config;
pub mod controller;
pub mod peer;
pub mod plugin_spec;
pub mod proxy;
pub mod registry;
pub mod report;
pub mod rng;
pub mod runner;
pub mod tcp_proxy;
pub mod world;
pub mod xref;

pub use cli::{run, ConformanceArgs};
