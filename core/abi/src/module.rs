//! The root module a plugin library exports, and the ABI version check both sides run.

use crate::transport::{EventSinkBox, TransportBox};
use crate::types::{PluginError, PluginInfo};
use abi_stable::{
    declare_root_module_statics,
    library::RootModule,
    package_version_strings,
    sabi_types::VersionStrings,
    std_types::{RResult, RStr},
    StableAbi,
};

/// The root module of a kvgate plugin library (`.so`) or built-in plugin.
///
/// Fields are only appended after `open` (the last prefix field); a host reads appended fields as
/// `Option`s, so an older plugin still loads.
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = PluginModRef)))]
#[sabi(missing_field(option))]
pub struct PluginMod {
    /// The ABI version the plugin was built against; the host refuses a different one.
    pub abi_version: extern "C" fn() -> u32,
    /// Static information, available without opening.
    pub info: extern "C" fn() -> PluginInfo,
    /// Open an instance from a config string (TOML, plugin-defined keys) and an event sink.
    /// A malformed config is an `INVALID_ARGUMENT` error naming the key; a machine that cannot
    /// run the plugin is `UNAVAILABLE` with the reason.
    #[sabi(last_prefix_field)]
    pub open: extern "C" fn(config: RStr<'_>, sink: EventSinkBox) -> RResult<TransportBox, PluginError>,
    /// Check a config string without opening anything (no thread, socket or device touched), with
    /// the same errors `open` would give for it. Absent in plugins built before it was added: the
    /// host then says the config was not checked.
    pub check_config: extern "C" fn(config: RStr<'_>) -> RResult<(), PluginError>,
}

impl RootModule for PluginModRef {
    declare_root_module_statics! {PluginModRef}
    const BASE_NAME: &'static str = "kvgate_plugin";
    const NAME: &'static str = "kvgate_plugin";
    const VERSION_STRINGS: VersionStrings = package_version_strings!();
}
