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

/// The root module as ABI v1 first published it: the prefix fields only, before any field was
/// appended. Hosts never build one; they check a library against it when the library's module has
/// exactly these fields (a plugin built before the first appended field, `check_config`), because
/// abi_stable refuses a library whose module has fewer fields than the host's [`PluginMod`]. Such a
/// library is then read as a [`PluginModRef`], whose appended fields read as `None` (ABI.md,
/// "Versions: the compatibility rule"). Never changes.
pub mod first_release {
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

    /// How many fields the first release's module has.
    pub const FIELDS: usize = 3;

    /// [`super::PluginMod`] without its appended fields (same name, so abi_stable compares them).
    #[repr(C)]
    #[derive(StableAbi)]
    #[sabi(kind(Prefix(prefix_ref = PluginModRef)))]
    #[sabi(missing_field(option))]
    pub struct PluginMod {
        pub abi_version: extern "C" fn() -> u32,
        pub info: extern "C" fn() -> PluginInfo,
        #[sabi(last_prefix_field)]
        pub open: extern "C" fn(config: RStr<'_>, sink: EventSinkBox) -> RResult<TransportBox, PluginError>,
    }

    impl RootModule for PluginModRef {
        declare_root_module_statics! {PluginModRef}
        const BASE_NAME: &'static str = "kvgate_plugin";
        const NAME: &'static str = "kvgate_plugin";
        const VERSION_STRINGS: VersionStrings = package_version_strings!();
    }

    impl PluginModRef {
        /// This module read as the current [`super::PluginModRef`], whose appended fields then read as
        /// `None`; `None` when the module has more fields than the first release (a plugin with an
        /// appended field must pass the layout check against the current module instead, which
        /// checks that field too).
        pub fn into_current(self) -> Option<super::PluginModRef> {
            if self.0.type_layout().get_field_names().count() != FIELDS {
                return None;
            }
            // SAFETY: a `PluginModRef` of this module comes from a library whose module abi_stable
            // checked against `first_release::PluginMod` field by field, or from this crate; it has
            // exactly those fields (counted above). Its prefix is the current `PluginMod`'s prefix
            // (every field appended since comes after `open`, the last prefix field), and the current
            // `PluginModRef` reads an appended field only when the module's own field accessibility
            // (its metadata, written where it was built) has it, so each reads as `None`. This is the
            // cast abi_stable's `LibHeader::unchecked_layout` makes for a checked module.
            Some(super::PluginModRef(unsafe { self.0.cast() }))
        }
    }
}
