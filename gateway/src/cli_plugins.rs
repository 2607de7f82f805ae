//! `kvgate plugins list|inspect`: what the plugin host sees, printed as a table. Opens nothing
//! (listing reads static module info only).

use crate::cli::PluginsCommand;
use crate::plugin_setup::{describe, host_with_builtins};

fn print(statuses: &[crate::driver::PluginStatus]) {
    println!("{:<10} {:<8} {:<12} {:<22} {:<22} origin / reason", "plugin", "abi", "status", "memory", "scope");
    for s in statuses {
        let abi = s.abi_version.map(|v| v.to_string()).unwrap_or_else(|| "-".into());
        let detail = if s.reason.is_empty() { s.origin.clone() } else { format!("{} ({})", s.origin, s.reason) };
        println!("{:<10} {:<8} {:<12} {:<22} {:<22} {}", s.name, abi, s.status, s.memory_kinds.join(","), s.scope.join(","), detail);
    }
}

pub fn run(command: PluginsCommand) -> i32 {
    match command {
        PluginsCommand::List { config } => {
            let config = match crate::config::load_config(config.as_deref()) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("{e}");
                    return 2;
                }
            };
            let mut host = host_with_builtins();
            host.load_all(&config.plugins.libraries);
            let statuses = describe(&host.plugins(), &[]);
            print(&statuses);
            0
        }
        PluginsCommand::Inspect { path } => {
            let mut host = kvgate_host::PluginHost::new();
            match host.load_library(&path) {
                Ok(name) => {
                    let statuses = describe(&host.plugins(), &[]);
                    print(&statuses);
                    println!("{} loads as plugin {name:?}", path.display());
                    0
                }
                Err(e) => {
                    eprintln!("{}: not loadable ({}): {e}", path.display(), e.code());
                    1
                }
            }
        }
    }
}
