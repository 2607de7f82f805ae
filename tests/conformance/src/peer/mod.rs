//! The peer process side of the harness: the control protocol, the regions, and the request loop.
//! Runs the plugin; never judges it.

pub mod memory;
pub mod protocol;
pub mod region;
pub mod server;
