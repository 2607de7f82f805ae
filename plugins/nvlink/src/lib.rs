//! kvgate-plugin-nvlink: KV-cache transfers between GPUs of one node (NVLink/NVSwitch, PCIe peer
//! copies, or one GPU shared by several processes) through CUDA IPC handles or CUDA VMM descriptors
//! and `cuMemcpyDtoDAsync`, on cudarc with the driver loaded at run time.
//!
//! Without a CUDA driver `open` fails with `UNAVAILABLE` and the reason; nothing else touches CUDA
//! before that check (cudarc panics when libcuda is missing). The GPU path is exercised by
//! `tests/gpu/run.sh` on a machine with an NVIDIA GPU.

pub mod admission;
pub mod chunk_plan;
pub mod config;
pub mod cuda;
pub mod device_buffer;
pub mod engine;
pub mod fd_socket;
pub mod plugin;
pub mod segments;
mod state;
pub mod vmm;
pub mod wire;
mod worker;

pub use config::NvlinkConfig;
pub use plugin::{open_with_probe, NvlinkPlugin, PLUGIN_NAME};

use kvgate_abi::sdk::{PluginFactory, Sink};
use kvgate_abi::{PluginError, PluginInfo, PluginModRef};

/// Opens NVLink plugin instances (the ABI module is built from it).
pub struct NvlinkFactory;

impl PluginFactory for NvlinkFactory {
    type Plugin = NvlinkPlugin;

    fn info() -> PluginInfo {
        plugin::plugin_info(&NvlinkConfig::default())
    }

    fn open(config: &str, sink: Sink) -> Result<NvlinkPlugin, PluginError> {
        open_with_probe(config, sink, cuda::driver_library_present)
    }

    fn check_config(config: &str) -> Result<(), PluginError> {
        NvlinkConfig::parse(config).map(|_| ())
    }
}

/// The plugin's ABI module, for built-in registration (`builtin:nvlink`). Call once per process.
pub fn module() -> PluginModRef {
    kvgate_abi::sdk::module::<NvlinkFactory>()
}
