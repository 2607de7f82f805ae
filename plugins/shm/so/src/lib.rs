//! The shm plugin exported through the stable ABI (`libkvgate_shm.so`), for hosts that load plugins
//! from files. All behaviour lives in `kvgate-plugin-shm`; this crate only exports its factory.

kvgate_abi::export_plugin!(kvgate_plugin_shm::ShmFactory);
