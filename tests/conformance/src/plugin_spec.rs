//! Resolving `--plugin builtin:NAME|PATH.so` into a loaded module, through `kvgate-host` exactly as
//! the gateway loads plugins. Owns the table of built-ins this binary links; never opens an instance.

use kvgate_abi::PluginModRef;
use kvgate_host::PluginHost;

/// A built-in plugin's name and the function that returns its module.
pub type BuiltinModule = (&'static str, fn() -> PluginModRef);

/// Built-in plugins linked into this binary, by name, as `builtin:NAME` selects them. UCX and NVLink
/// only with the crate features `ucx` and `nvlink`.
pub fn builtin_modules() -> Vec<BuiltinModule> {
    #[allow(unused_mut)]
    let mut modules: Vec<BuiltinModule> =
        vec![("shm", kvgate_plugin_shm::module), ("quic", kvgate_plugin_quic::module)];
    #[cfg(feature = "ucx")]
    modules.push(("ucx", kvgate_plugin_ucx::module));
    #[cfg(feature = "nvlink")]
    modules.push(("nvlink", kvgate_plugin_nvlink::module));
    modules
}

/// Built-in plugins the harness knows but this build left out: the crate feature that builds each in.
const OPTIONAL_BUILTINS: [(&str, &str); 2] = [("ucx", "ucx"), ("nvlink", "nvlink")];

/// Load the plugin `spec` into a fresh host; returns the host and the plugin's name.
pub fn load(spec: &str) -> Result<(PluginHost, String), String> {
    let mut host = PluginHost::new();
    if let Some(name) = spec.strip_prefix("builtin:") {
        let Some((_, module)) = builtin_modules().into_iter().find(|(n, _)| *n == name) else {
            let known: Vec<_> = builtin_modules().iter().map(|(n, _)| format!("builtin:{n}")).collect();
            if let Some((_, feature)) = OPTIONAL_BUILTINS.iter().find(|(n, _)| *n == name) {
                return Err(format!(
                    "built-in plugin {name:?} is not in this binary (built without kvgate-conformance's `{feature}` feature); \
                     load its .so instead; this binary has: {}",
                    known.join(", ")
                ));
            }
            return Err(format!("unknown built-in plugin {name:?}; this binary has: {}", known.join(", ")));
        };
        host.register_builtin(name, module()).map_err(|e| format!("built-in {name} refused: {e}"))?;
        return Ok((host, name.to_string()));
    }
    let name = host.load_library(spec).map_err(|e| format!("cannot load {spec}: {e}"))?;
    Ok((host, name))
}
