//! Listeners of the engine API: the Unix socket (stale file replaced, mode 0600 before any client can
//! connect) and the optional TCP listener with its bearer token. Never serves TCP without a token.

use super::{BearerCheck, EngineApiService};
use crate::config::GatewayConfig;
use crate::listeners::GuardedListener;
use anyhow::Context;
use kvgate_client::proto::engine_api_server::EngineApiServer;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::Path;
use tokio::net::UnixListener;
use tonic::transport::Server;

/// Whether the socket's folder is safe: owned by this user (or root) and not writable by anyone else
/// unless sticky (like /tmp, where nobody else may remove or rename what is ours). Another user who
/// owns the folder, or may write into it, could swap the socket and receive the engines' calls.
pub fn check_socket_dir(dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(dir).with_context(|| format!("engine_api.unix_socket: stat {}", dir.display()))?;
    let euid = nix::unistd::geteuid().as_raw();
    if meta.uid() != euid && meta.uid() != 0 {
        anyhow::bail!(
            "engine_api.unix_socket: the folder {} is owned by uid {}, not by this gateway's uid {euid} (or root): another user could replace the socket",
            dir.display(),
            meta.uid()
        );
    }
    let sticky = meta.mode() & 0o1000 != 0;
    if meta.mode() & 0o022 != 0 && !sticky {
        anyhow::bail!(
            "engine_api.unix_socket: the folder {} has mode {:o}: writable by other users, who could replace the socket (chmod go-w, or use a folder of this user's)",
            dir.display(),
            meta.mode() & 0o7777
        );
    }
    Ok(())
}

/// Bind the Unix socket with mode 0600 (umask-independent: the file is chmodded before `listen` returns),
/// in a folder only this user can change (made with mode 0700 when it does not exist).
pub fn bind_unix_socket(path: &Path) -> anyhow::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        if !dir.exists() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .with_context(|| format!("engine_api.unix_socket: create {}", dir.display()))?;
        }
        check_socket_dir(dir)?;
    }
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        // Only ever replace a socket: a regular file (or anything else) named by mistake is left alone.
        use std::os::unix::fs::FileTypeExt;
        if !meta.file_type().is_socket() {
            anyhow::bail!(
                "engine_api.unix_socket: {} exists and is not a socket; refusing to replace it",
                path.display()
            );
        }
        // A socket left by a previous run: refuse to steal one that answers.
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            anyhow::bail!("engine_api.unix_socket: {} is in use by a running gateway", path.display());
        }
        std::fs::remove_file(path).with_context(|| format!("remove stale socket {}", path.display()))?;
    }
    let old_umask = nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o177));
    let listener = UnixListener::bind(path);
    nix::sys::stat::umask(old_umask);
    let listener = listener.with_context(|| format!("engine_api.unix_socket: bind {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// Serve the engine API on every configured listener until `shutdown` resolves.
pub async fn serve_engine_api(
    config: &GatewayConfig,
    service: EngineApiService,
    unix: Option<UnixListener>,
    metrics: std::sync::Arc<crate::metrics::GatewayMetrics>,
    shutdown: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let limits = config.engine_api.connections;
    let keepalive = Some(crate::listeners::keepalive_interval(&limits));
    let max = config.engine_api.max_request_bytes as usize;
    let resets = Some(config.engine_api.http2_max_pending_reset_streams as usize);
    let mut tasks = Vec::new();
    if let Some(listener) = unix {
        let incoming = GuardedListener::new(listener, "engine_api", limits, metrics.clone()).into_numbered_stream();
        let svc = EngineApiServer::new(service.clone()).max_decoding_message_size(max);
        let mut stop = shutdown.clone();
        tasks.push(tokio::spawn(async move {
            Server::builder()
                .http2_max_pending_accept_reset_streams(resets)
                .http2_keepalive_interval(keepalive)
                .http2_keepalive_timeout(keepalive)
                .add_service(tonic::service::interceptor::InterceptedService::new(svc, BearerCheck::new(None)))
                .serve_with_incoming_shutdown(incoming, async move {
                    let _ = stop.wait_for(|s| *s).await;
                })
                .await
        }));
    }
    if !config.engine_api.tcp_listen.is_empty() {
        let token = std::fs::read_to_string(&config.engine_api.bearer_token_file).with_context(|| {
            format!("engine_api.bearer_token_file: cannot read {}", config.engine_api.bearer_token_file)
        })?;
        if token.trim().is_empty() {
            anyhow::bail!("engine_api.bearer_token_file: {} is empty", config.engine_api.bearer_token_file);
        }
        let listener = tokio::net::TcpListener::bind(&config.engine_api.tcp_listen)
            .await
            .with_context(|| format!("engine_api.tcp_listen: bind {}", config.engine_api.tcp_listen))?;
        let incoming = GuardedListener::new(listener, "engine_api_tcp", limits, metrics.clone()).into_numbered_stream();
        let svc = EngineApiServer::new(service.clone()).max_decoding_message_size(max);
        let check = BearerCheck::new(Some(token.trim().to_string()));
        let mut stop = shutdown.clone();
        tasks.push(tokio::spawn(async move {
            Server::builder()
                .http2_max_pending_accept_reset_streams(resets)
                .http2_keepalive_interval(keepalive)
                .http2_keepalive_timeout(keepalive)
                .add_service(tonic::service::interceptor::InterceptedService::new(svc, check))
                .serve_with_incoming_shutdown(incoming, async move {
                    let _ = stop.wait_for(|s| *s).await;
                })
                .await
        }));
    }
    for task in tasks {
        task.await??;
    }
    Ok(())
}
