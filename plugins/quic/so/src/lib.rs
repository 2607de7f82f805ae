//! The QUIC plugin as a `cdylib`: exports kvgate-plugin-quic's factory through the stable ABI.
//! Holds no logic of its own; everything lives in the `kvgate-plugin-quic` rlib.

kvgate_abi::export_plugin!(kvgate_plugin_quic::QuicFactory);
