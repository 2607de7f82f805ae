//! The daemon's commands: the arguments of `serve`, `config check|default`, `plugins
//! list|inspect|reload`, `rooms`, `abort` and what `serve` and `config` do. The `kvgate` binary
//! (gateway/cli) parses the whole command line, the tools `demo`, `bench` and `conformance` included,
//! and calls these; exit codes: 0 ok, 1 failure, 2 bad usage or bad configuration.

use crate::config::{default_toml, load_config, single_underscore_env_warnings, GatewayConfig};
use clap::{Args, Subcommand};
use std::path::PathBuf;

#[derive(Subcommand, Debug)]
pub enum ConfigCommand {
    /// Load a config file (with KVGATE__ overrides) and report every problem.
    Check { file: PathBuf },
    /// Print the built-in defaults as TOML.
    Default,
}

#[derive(Subcommand, Debug)]
pub enum PluginsCommand {
    /// Every built-in plugin and configured library, with ABI version and capabilities.
    List {
        #[arg(long, short)]
        config: Option<PathBuf>,
    },
    /// Load one plugin library and describe it (or say why it does not load).
    Inspect { path: PathBuf },
    /// Make a running gateway read the `[plugins]` part of its configuration file again and apply
    /// it without failing a room (the same as `POST /plugins/reload` or SIGHUP). Exit 0 when applied,
    /// 1 when refused (the running plugins stay in service; the reason is printed).
    Reload {
        /// The gateway's admin listener (`127.0.0.1:9090`); default: `admin.listen` of --config.
        #[arg(long)]
        admin: Option<String>,
        #[arg(long, short)]
        config: Option<PathBuf>,
    },
}

/// Which running gateway to talk to.
#[derive(Args, Debug, Clone)]
pub struct Target {
    /// The gateway's engine socket (default: the one in --config, or the built-in default).
    #[arg(long)]
    pub socket: Option<PathBuf>,
    #[arg(long, short)]
    pub config: Option<PathBuf>,
}

fn load_or_exit(path: Option<&std::path::Path>) -> Result<GatewayConfig, i32> {
    for warning in single_underscore_env_warnings() {
        eprintln!("warning: {warning}");
    }
    load_config(path).map_err(|e| {
        eprintln!("{e}");
        2
    })
}

/// The gateway's runtime: `driver.io_threads` worker threads (0: tokio's default, one per CPU).
fn serve_runtime(io_threads: u64) -> tokio::runtime::Runtime {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if io_threads > 0 {
        builder.worker_threads(io_threads as usize);
    }
    builder.enable_all().build().expect("tokio runtime")
}

/// `kvgate serve [--config FILE]`: run a gateway until it is stopped.
pub fn serve(config: Option<PathBuf>) -> i32 {
    let config_path = config.clone();
    let config = match load_or_exit(config.as_deref()) {
        Ok(c) => c,
        Err(code) => return code,
    };
    crate::logging::init(&config.log);
    for warning in single_underscore_env_warnings() {
        tracing::warn!("{warning}");
    }
    let path = config_path.as_ref().map(|p| std::fs::canonicalize(p).unwrap_or_else(|_| p.clone()));
    match serve_runtime(config.driver.io_threads).block_on(crate::serve::serve_from(config, path)) {
        Ok(()) => 0,
        Err(e) => {
            tracing::error!("gateway failed: {e:#}");
            eprintln!("kvgate serve: {e:#}");
            1
        }
    }
}

/// `kvgate config check FILE` and `kvgate config default`.
pub fn config(command: ConfigCommand) -> i32 {
    match command {
        ConfigCommand::Check { file } => match load_or_exit(Some(&file)) {
            Ok(c) => {
                let auth = match c.peer_link.auth_mode() {
                    crate::config::PeerAuthMode::Psk => {
                        format!("peer links authenticated by pre-shared key {}", c.peer_link.psk_file)
                    }
                    crate::config::PeerAuthMode::Tls => "peer links authenticated by mutual TLS".to_string(),
                    crate::config::PeerAuthMode::None => {
                        "peer links NOT authenticated (peer_link.auth = \"none\")".to_string()
                    }
                };
                let findings = crate::plugin_setup::check_config_file_plugins(&c);
                for note in &findings.notes {
                    println!("note: {note}");
                }
                if !findings.errors.is_empty() {
                    for error in &findings.errors {
                        eprintln!("{}: {error}", file.display());
                    }
                    return 2;
                }
                println!(
                    "{}: ok (gateway {:?}, {} peer(s), plugins {:?}; {auth})",
                    file.display(),
                    c.gateway.name,
                    c.peers.len(),
                    c.plugins.preference
                );
                0
            }
            Err(code) => code,
        },
        ConfigCommand::Default => {
            print!("{}", default_toml());
            0
        }
    }
}
