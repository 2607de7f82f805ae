//! The plugin registry: built-in modules and loaded libraries by name, every load failure kept for
//! listing, `open` of an instance, and the per-peer selection among opened instances.
//! Never decides a room's fate and never depends on a plugin crate (the gateway registers built-ins).

use crate::error::{ConfigCheck, LoadError, OpenError, PluginOrigin, SkipReason};
use crate::library::{canonical_plugin_path, load_root_module};
use crate::opened::OpenedPlugin;
use kvgate_abi::abi_stable::std_types::{RErr, ROk, RStr};
use kvgate_abi::{scope, EventSinkBox, MemoryKind, PluginInfo, PluginModRef, ReasonCode, ABI_VERSION};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// One line of [`PluginHost::plugins`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PluginListing {
    /// The plugin's name; for a library that failed to load, the path as given.
    pub name: String,
    pub origin: PluginOrigin,
    /// The module's ABI version, when it could be read.
    pub abi_version: Option<u32>,
    /// The module's static info, or why it did not load.
    pub status: Result<PluginInfo, LoadError>,
}

struct LoadedPlugin {
    name: String,
    origin: PluginOrigin,
    module: PluginModRef,
    info: PluginInfo,
}

/// Registry of plugin modules. Load every plugin at start-up, then `open` instances from it.
#[derive(Default)]
pub struct PluginHost {
    loaded: Vec<LoadedPlugin>,
    failed: Vec<(PathBuf, LoadError)>,
    by_canonical_path: HashMap<PathBuf, String>,
    /// The last `Unavailable` reason per plugin name, for `select`'s explanations.
    unavailable: Mutex<HashMap<String, String>>,
}

impl PluginHost {
    pub fn new() -> Self {
        PluginHost::default()
    }

    /// Register a module linked into the host. `name` must equal the module's `info().name`.
    pub fn register_builtin(&mut self, name: &str, module: PluginModRef) -> Result<(), LoadError> {
        let result = self.admit(name, PluginOrigin::Builtin, module);
        if let Err(e) = &result {
            tracing::warn!(plugin = name, reason = e.code(), "built-in plugin refused: {e}");
        }
        result
    }

    /// Load a plugin library. Returns the plugin's name; loading the same canonical path again
    /// returns the same name without loading anything. Every failure is logged and kept for
    /// [`PluginHost::plugins`].
    // CONFORMANCE: HYGIENE-2
    pub fn load_library(&mut self, path: impl AsRef<Path>) -> Result<String, LoadError> {
        let path = path.as_ref();
        let result = self.load_library_inner(path);
        if let Err(e) = &result {
            tracing::warn!(path = %path.display(), reason = e.code(), "plugin library refused: {e}");
            self.failed.retain(|(p, _)| p != path);
            self.failed.push((path.to_path_buf(), e.clone()));
        }
        result
    }

    fn load_library_inner(&mut self, path: &Path) -> Result<String, LoadError> {
        let canonical = canonical_plugin_path(path)?;
        if let Some(name) = self.by_canonical_path.get(&canonical) {
            return Ok(name.clone());
        }
        let module = load_root_module(&canonical)?;
        let origin = PluginOrigin::Library(canonical.clone());
        let name = (module.info())().name.to_string();
        self.admit(&name, origin, module)?;
        self.by_canonical_path.insert(canonical, name.clone());
        Ok(name)
    }

    /// Load every library; one result per path, in order, so every bad plugin is reported.
    // CONFORMANCE: HYGIENE-2 (every bad plugin reported, not only the first)
    pub fn load_all<P: AsRef<Path>>(&mut self, paths: &[P]) -> Vec<Result<String, LoadError>> {
        paths.iter().map(|p| self.load_library(p)).collect()
    }

    fn admit(&mut self, name: &str, origin: PluginOrigin, module: PluginModRef) -> Result<(), LoadError> {
        let plugin_abi_version = (module.abi_version())();
        if plugin_abi_version != ABI_VERSION {
            return Err(LoadError::AbiVersionMismatch { origin, plugin_abi_version, host_abi_version: ABI_VERSION });
        }
        let info = (module.info())();
        if info.name.as_str() != name {
            return Err(LoadError::NameMismatch {
                registered_as: name.to_string(),
                module_name: info.name.to_string(),
            });
        }
        if let Some(existing) = self.loaded.iter().find(|p| p.name == name) {
            return Err(LoadError::DuplicateName {
                name: name.to_string(),
                existing: existing.origin.clone(),
                rejected: origin,
            });
        }
        self.loaded.push(LoadedPlugin { name: name.to_string(), origin, module, info });
        Ok(())
    }

    /// Every plugin known to the host: loaded ones first (in registration order), then failed loads.
    pub fn plugins(&self) -> Vec<PluginListing> {
        let loaded = self.loaded.iter().map(|p| PluginListing {
            name: p.name.clone(),
            origin: p.origin.clone(),
            abi_version: Some(p.info.abi_version),
            status: Ok(p.info.clone()),
        });
        let failed = self.failed.iter().map(|(path, e)| PluginListing {
            name: path.display().to_string(),
            origin: PluginOrigin::Library(path.clone()),
            abi_version: match e {
                LoadError::AbiVersionMismatch { plugin_abi_version, .. } => Some(*plugin_abi_version),
                _ => None,
            },
            status: Err(e.clone()),
        });
        loaded.chain(failed).collect()
    }

    /// The module registered under `name`.
    pub fn module(&self, name: &str) -> Option<PluginModRef> {
        self.find(name).map(|p| p.module)
    }

    fn find(&self, name: &str) -> Option<&LoadedPlugin> {
        self.loaded.iter().find(|p| p.name == name)
    }

    /// Open an instance of `name` with its TOML config string, reporting through `sink`.
    /// `UNAVAILABLE` from the plugin becomes [`OpenError::Unavailable`]; every failure is logged.
    // CONFORMANCE: HYGIENE-3, HYGIENE-4
    pub fn open(&self, name: &str, config_toml: &str, sink: EventSinkBox) -> Result<OpenedPlugin, OpenError> {
        let result = self.open_inner(name, config_toml, sink);
        match &result {
            Ok(_) => {
                self.unavailable.lock().unwrap_or_else(|e| e.into_inner()).remove(name);
            }
            Err(e) => {
                tracing::warn!(plugin = name, reason = e.code(), "plugin open failed: {e}");
                if let OpenError::Unavailable { reason, .. } = e {
                    self.unavailable.lock().unwrap_or_else(|e| e.into_inner()).insert(name.to_string(), reason.clone());
                }
            }
        }
        result
    }

    /// Check `config_toml` for plugin `name` without opening it (see `PluginMod::check_config`).
    /// A plugin built before the check existed, one that can only check by opening, or one whose
    /// library did not load gives [`ConfigCheck::NotChecked`], never `Valid`.
    pub fn check_config(&self, name: &str, config_toml: &str) -> ConfigCheck {
        let Some(plugin) = self.find(name) else {
            return match self.why_not_opened(name) {
                SkipReason::LoadFailed(why) => {
                    ConfigCheck::NotChecked { reason: format!("its library did not load: {why}") }
                }
                _ => ConfigCheck::Invalid(OpenError::UnknownPlugin { plugin: name.to_string() }),
            };
        };
        let Some(check) = plugin.module.check_config() else {
            return ConfigCheck::NotChecked { reason: "the plugin was built before config checks existed".into() };
        };
        match check(RStr::from_str(config_toml)) {
            ROk(()) => ConfigCheck::Valid,
            RErr(e) => {
                let (plugin, message) = (name.to_string(), e.message.to_string());
                match e.code {
                    ReasonCode::UNAVAILABLE => ConfigCheck::NotChecked { reason: message },
                    ReasonCode::INVALID_ARGUMENT => ConfigCheck::Invalid(OpenError::InvalidConfig { plugin, message }),
                    code => ConfigCheck::Invalid(OpenError::Failed { plugin, code, message }),
                }
            }
        }
    }

    fn open_inner(&self, name: &str, config_toml: &str, sink: EventSinkBox) -> Result<OpenedPlugin, OpenError> {
        let plugin = self.find(name).ok_or_else(|| OpenError::UnknownPlugin { plugin: name.to_string() })?;
        let transport = match (plugin.module.open())(RStr::from_str(config_toml), sink) {
            ROk(t) => t,
            RErr(e) => {
                let (plugin, message) = (name.to_string(), e.message.to_string());
                return Err(match e.code {
                    ReasonCode::UNAVAILABLE => OpenError::Unavailable { plugin, reason: message },
                    ReasonCode::INVALID_ARGUMENT => OpenError::InvalidConfig { plugin, message },
                    code => OpenError::Failed { plugin, code, message },
                });
            }
        };
        let info = transport.info();
        if info.name.as_str() != name || info.abi_version != ABI_VERSION {
            transport.shutdown();
            return Err(OpenError::BadInstance {
                plugin: name.to_string(),
                message: format!("instance reports name {:?}, ABI version {}", info.name.as_str(), info.abi_version),
            });
        }
        Ok(OpenedPlugin::new(name.to_string(), plugin.origin.clone(), info, transport))
    }

    /// Choose the plugin for a peer: the first name of `preferences` that has an instance in
    /// `opened` serving `kind` within the right scope. Returns its index in `opened`, or, when none
    /// fits, every preference with why it was skipped.
    pub fn select<S: AsRef<str>>(
        &self,
        preferences: &[S],
        kind: MemoryKind,
        same_host: bool,
        opened: &[OpenedPlugin],
    ) -> Result<usize, Vec<(String, SkipReason)>> {
        let mut skipped = Vec::new();
        for name in preferences.iter().map(AsRef::as_ref) {
            match self.check_candidate(name, kind, same_host, opened) {
                Ok(slot) => return Ok(slot),
                Err(why) => skipped.push((name.to_string(), why)),
            }
        }
        Err(skipped)
    }

    fn check_candidate(
        &self,
        name: &str,
        kind: MemoryKind,
        same_host: bool,
        opened: &[OpenedPlugin],
    ) -> Result<usize, SkipReason> {
        let Some(slot) = opened.iter().position(|p| p.name() == name) else {
            return Err(self.why_not_opened(name));
        };
        let instance = &opened[slot];
        let caps = instance.capabilities();
        if !caps.serves(kind) {
            return Err(SkipReason::MemoryKindUnsupported(kind));
        }
        let needed_scope = if same_host { scope::SAME_HOST } else { scope::CROSS_HOST };
        if caps.scope & needed_scope == 0 {
            return Err(SkipReason::ScopeMismatch { same_host });
        }
        if instance.transport().stats().healthy == 0 {
            return Err(SkipReason::Unhealthy);
        }
        Ok(slot)
    }

    fn why_not_opened(&self, name: &str) -> SkipReason {
        if self.find(name).is_some() {
            let unavailable = self.unavailable.lock().unwrap_or_else(|e| e.into_inner());
            return match unavailable.get(name) {
                Some(reason) => SkipReason::Unavailable(reason.clone()),
                None => SkipReason::NotOpened,
            };
        }
        let failed = self.failed.iter().find(|(path, _)| {
            path.file_stem()
                .and_then(|s| s.to_str())
                .is_some_and(|stem| stem.trim_start_matches("lib").trim_start_matches("kvgate_") == name)
        });
        match failed {
            Some((_, e)) => SkipReason::LoadFailed(e.to_string()),
            None => SkipReason::NotRegistered,
        }
    }
}
