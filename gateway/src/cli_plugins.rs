//! `kvgate plugins list|inspect|reload`: what the plugin host sees, printed as a table (opens
//! nothing: listing reads static module info only); `reload` asks a running gateway to re-read
//! the plugin part of its configuration and prints what it did or why it refused.

use crate::cli::PluginsCommand;
use crate::plugin_setup::{describe, host_with_builtins};

fn print(statuses: &[crate::channels::PluginStatus]) {
    println!("{:<10} {:<8} {:<12} {:<22} {:<22} origin / reason", "plugin", "abi", "status", "memory", "scope");
    for s in statuses {
        let abi = s.abi_version.map(|v| v.to_string()).unwrap_or_else(|| "-".into());
        let detail = if s.reason.is_empty() { s.origin.clone() } else { format!("{} ({})", s.origin, s.reason) };
        println!(
            "{:<10} {:<8} {:<12} {:<22} {:<22} {}",
            s.name,
            abi,
            s.status,
            s.memory_kinds.join(","),
            s.scope.join(","),
            detail
        );
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
        PluginsCommand::Reload { admin, config } => reload(admin, config),
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

fn reload(admin: Option<String>, config: Option<std::path::PathBuf>) -> i32 {
    let admin = match admin {
        Some(a) => a,
        None => match crate::config::load_config(config.as_deref()) {
            Ok(c) if !c.admin.listen.is_empty() => c.admin.listen,
            Ok(_) => {
                eprintln!("kvgate plugins reload: no --admin and admin.listen is empty in the config");
                return 2;
            }
            Err(e) => {
                eprintln!("{e}");
                return 2;
            }
        },
    };
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime");
    let timeout = std::time::Duration::from_millis(crate::plugin_reload::RELOAD_TIMEOUT_MS + 5_000);
    match runtime.block_on(crate::admin_client::post(&admin, "/plugins/reload", timeout)) {
        Ok((code, body)) => match serde_json::from_str::<crate::channels::ReloadOutcome>(&body) {
            Ok(outcome) => {
                println!("{}", crate::plugin_reload::describe(&outcome));
                if outcome.applied {
                    0
                } else {
                    1
                }
            }
            Err(_) => {
                eprintln!("kvgate plugins reload: {admin} answered {code}: {}", body.trim());
                1
            }
        },
        Err(e) => {
            eprintln!("kvgate plugins reload: cannot reach the admin listener {admin}: {e}");
            1
        }
    }
}
