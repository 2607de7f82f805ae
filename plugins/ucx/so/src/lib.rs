//! The UCX plugin exported as a `cdylib` through the stable plugin ABI (v1).
//! Owns nothing but the export; all behaviour lives in `kvgate-plugin-ucx`.

kvgate_abi::export_plugin!(kvgate_plugin_ucx::UcxFactory);
