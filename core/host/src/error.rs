//! The host's error types: why a plugin did not load, did not open, or was skipped by selection.
//! Every variant has a stable snake_case `code()` for logs and metrics; messages stay short (a layout
//! mismatch is trimmed to its `Error:` lines before it gets here). Never holds a plugin object.

use kvgate_abi::{MemoryKind, ReasonCode};
use std::fmt;
use std::path::PathBuf;

/// Where a plugin came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PluginOrigin {
    /// Linked into the host binary and registered with [`crate::PluginHost::register_builtin`].
    Builtin,
    /// Loaded from a shared library; the canonical path (or, for a load failure before
    /// canonicalisation, the path as given).
    Library(PathBuf),
}

impl fmt::Display for PluginOrigin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PluginOrigin::Builtin => f.write_str("builtin"),
            PluginOrigin::Library(path) => write!(f, "{}", path.display()),
        }
    }
}

/// Why a plugin could not be loaded or registered.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LoadError {
    /// The path does not exist or cannot be canonicalised.
    NotFound { path: PathBuf, message: String },
    /// The dynamic loader refused the file (not an ELF object, wrong architecture, missing
    /// dependency).
    OpenFailed { path: PathBuf, message: String },
    /// The library exports no abi_stable root module: it is not a kvgate plugin.
    NotAPlugin { path: PathBuf, message: String },
    /// The root module's layout differs from this host's `PluginMod` (built against another ABI).
    /// `summary` holds only the `Error:` lines of abi_stable's report.
    AbiInstability { path: PathBuf, summary: String },
    /// The library's abi_stable version strings are incompatible with the host's.
    LibraryVersionMismatch { path: PathBuf, message: String },
    /// The module reports an ABI version other than [`kvgate_abi::ABI_VERSION`].
    AbiVersionMismatch { origin: PluginOrigin, plugin_abi_version: u32, host_abi_version: u32 },
    /// The library's root-module constructor failed or panicked.
    RootModuleFailed { path: PathBuf, message: String },
    /// A built-in was registered under a name other than the one its module reports.
    NameMismatch { registered_as: String, module_name: String },
    /// Another plugin with this name is already registered.
    DuplicateName { name: String, existing: PluginOrigin, rejected: PluginOrigin },
}

impl LoadError {
    /// Machine-readable reason code.
    pub fn code(&self) -> &'static str {
        match self {
            LoadError::NotFound { .. } => "not_found",
            LoadError::OpenFailed { .. } => "open_failed",
            LoadError::NotAPlugin { .. } => "not_a_plugin",
            LoadError::AbiInstability { .. } => "abi_instability",
            LoadError::LibraryVersionMismatch { .. } => "library_version_mismatch",
            LoadError::AbiVersionMismatch { .. } => "abi_version_mismatch",
            LoadError::RootModuleFailed { .. } => "root_module_failed",
            LoadError::NameMismatch { .. } => "name_mismatch",
            LoadError::DuplicateName { .. } => "duplicate_name",
        }
    }
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let code = self.code();
        match self {
            LoadError::NotFound { path, message }
            | LoadError::OpenFailed { path, message }
            | LoadError::NotAPlugin { path, message }
            | LoadError::LibraryVersionMismatch { path, message }
            | LoadError::RootModuleFailed { path, message } => {
                write!(f, "{code}: {}: {message}", path.display())
            }
            LoadError::AbiInstability { path, summary } => {
                write!(f, "{code}: {}: incompatible plugin ABI layout:\n{summary}", path.display())
            }
            LoadError::AbiVersionMismatch { origin, plugin_abi_version, host_abi_version } => write!(
                f,
                "{code}: {origin}: plugin ABI version {plugin_abi_version}, host ABI version {host_abi_version}"
            ),
            LoadError::NameMismatch { registered_as, module_name } => {
                write!(f, "{code}: built-in registered as {registered_as:?} reports name {module_name:?}")
            }
            LoadError::DuplicateName { name, existing, rejected } => {
                write!(f, "{code}: plugin {name:?} from {rejected} is already loaded from {existing}")
            }
        }
    }
}

impl std::error::Error for LoadError {}

/// What [`crate::PluginHost::check_config`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConfigCheck {
    /// The plugin parsed the config and accepts every value.
    Valid,
    /// The config was not checked (the plugin cannot check without opening); says why.
    NotChecked { reason: String },
    /// The config, or the plugin name, is refused.
    Invalid(OpenError),
}

/// Why [`crate::PluginHost::open`] failed.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum OpenError {
    /// No plugin of that name was registered or loaded.
    UnknownPlugin { plugin: String },
    /// The plugin cannot run on this machine (no driver, no device); reported by the plugin with
    /// `ReasonCode::UNAVAILABLE`. A harness reports this as *unsupported*, not *failed*.
    Unavailable { plugin: String, reason: String },
    /// The config string was refused (`ReasonCode::INVALID_ARGUMENT`); the message names the key.
    InvalidConfig { plugin: String, message: String },
    /// Any other failure of the plugin's `open`.
    Failed { plugin: String, code: ReasonCode, message: String },
    /// The plugin's `open` returned an instance whose info breaks the contract (other name or ABI).
    BadInstance { plugin: String, message: String },
}

impl OpenError {
    /// Machine-readable reason code.
    pub fn code(&self) -> &'static str {
        match self {
            OpenError::UnknownPlugin { .. } => "unknown_plugin",
            OpenError::Unavailable { .. } => "unavailable",
            OpenError::InvalidConfig { .. } => "invalid_config",
            OpenError::Failed { .. } => "open_failed",
            OpenError::BadInstance { .. } => "bad_instance",
        }
    }
    /// The plugin this error is about.
    pub fn plugin(&self) -> &str {
        match self {
            OpenError::UnknownPlugin { plugin }
            | OpenError::Unavailable { plugin, .. }
            | OpenError::InvalidConfig { plugin, .. }
            | OpenError::Failed { plugin, .. }
            | OpenError::BadInstance { plugin, .. } => plugin,
        }
    }
}

impl fmt::Display for OpenError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let code = self.code();
        match self {
            OpenError::UnknownPlugin { plugin } => write!(f, "{code}: no plugin named {plugin:?}"),
            OpenError::Unavailable { plugin, reason } => write!(f, "{code}: plugin {plugin:?}: {reason}"),
            OpenError::InvalidConfig { plugin, message } => write!(f, "{code}: plugin {plugin:?}: {message}"),
            OpenError::Failed { plugin, code: reason, message } => {
                write!(f, "{code}: plugin {plugin:?}: {reason}: {message}")
            }
            OpenError::BadInstance { plugin, message } => write!(f, "{code}: plugin {plugin:?}: {message}"),
        }
    }
}

impl std::error::Error for OpenError {}

/// Why [`crate::PluginHost::select`] passed over a preferred plugin.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SkipReason {
    /// No plugin of that name is registered or loaded.
    NotRegistered,
    /// The plugin failed to load.
    LoadFailed(String),
    /// The plugin is known but its `open` failed as unavailable (the reason it gave).
    Unavailable(String),
    /// The plugin is known but not among the opened instances passed to `select`.
    NotOpened,
    /// The instance does not serve this memory kind.
    MemoryKindUnsupported(MemoryKind),
    /// The instance cannot reach a peer on the same host / on another host.
    ScopeMismatch { same_host: bool },
    /// The instance reported itself unhealthy (`Stats::healthy == 0`).
    Unhealthy,
}

impl SkipReason {
    /// Machine-readable reason code.
    pub fn code(&self) -> &'static str {
        match self {
            SkipReason::NotRegistered => "not_registered",
            SkipReason::LoadFailed(_) => "load_failed",
            SkipReason::Unavailable(_) => "unavailable",
            SkipReason::NotOpened => "not_opened",
            SkipReason::MemoryKindUnsupported(_) => "memory_kind_unsupported",
            SkipReason::ScopeMismatch { .. } => "scope_mismatch",
            SkipReason::Unhealthy => "unhealthy",
        }
    }
}

impl fmt::Display for SkipReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let code = self.code();
        match self {
            SkipReason::LoadFailed(why) | SkipReason::Unavailable(why) => write!(f, "{code}: {why}"),
            SkipReason::MemoryKindUnsupported(kind) => write!(f, "{code}: does not serve {kind} memory"),
            SkipReason::ScopeMismatch { same_host: true } => write!(f, "{code}: cannot reach same-host peers"),
            SkipReason::ScopeMismatch { same_host: false } => write!(f, "{code}: cannot reach other hosts"),
            _ => f.write_str(code),
        }
    }
}
