//! kvgate: the gateway daemon and its CLI. One module per concern: `config`, `channels` (what
//! crosses the driver's queues), `engine_api`,
//! `peer_link`, `discovery`, `driver`, `admin`, `metrics`, `demo`, `bench`, `serve`, `plugin_setup`,
//! `logging`, `cli` (gateway/README.md has what each owns). The binary (`main.rs`) only calls [`cli::main`].

pub mod admin;
pub mod bench;
mod builtin_extra;
pub mod channels;
pub mod cli;
mod cli_keygen;
mod cli_plugins;
mod cli_remote;
pub mod config;
pub mod demo;
pub mod discovery;
pub mod driver;
pub mod engine_api;
pub mod logging;
pub mod metrics;
pub mod listeners;
pub mod peer_link;
pub mod plugin_reload;
pub mod plugin_setup;
pub mod serve;
