//! libkvgate_nvlink.so: the NVLink plugin exported through the stable ABI (kvgate-abi v1).
//! Holds no code of its own; loading it on a machine without CUDA is fine (`open` says unavailable).

kvgate_abi::export_plugin!(kvgate_plugin_nvlink::NvlinkFactory);
