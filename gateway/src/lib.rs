//! kvgate: the gateway daemon (package kvgate-gateway, library `kvgate`). One module per concern:
//! `config`, `channels` (what crosses the driver's queues), `engine_api`, `peer_link`, `discovery`,
//! `driver`, `admin`, `admin_client`, `metrics`, `serve`, `plugin_setup`, `logging`, and the
//! daemon's commands `cli`, `cli_keygen`, `cli_plugins`, `cli_remote` (gateway/README.md has what
//! each owns). The `kvgate` binary is gateway/cli; the
//! tools it also offers, `demo`, `bench` and `conformance`, are crates of their own.

// No unsafe code, but for the two places that need it, each allowed where it stands: receiving
// passed descriptors (engine_api::fd_pass) and mapping engines' memory (driver::regions).
#![deny(unsafe_code)]

pub mod admin;
pub mod admin_client;
mod builtin_extra;
pub mod channels;
pub mod cli;
pub mod cli_keygen;
pub mod cli_plugins;
pub mod cli_remote;
pub mod config;
pub mod discovery;
pub mod driver;
pub mod engine_api;
pub mod listeners;
pub mod logging;
pub mod metrics;
pub mod peer_link;
pub mod plugin_reload;
pub mod plugin_setup;
pub mod serve;
