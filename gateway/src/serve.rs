//! `kvgate serve`: wires one gateway together (plugins, core, driver, peer links, engine API, admin)
//! and runs it until SIGINT/SIGTERM, then stops the listeners and shuts the plugins down. Owns no
//! logic of its own beyond start-up order.

use crate::admin::{serve_admin, AdminState};
use crate::channels::{DriverInput, PluginEventMsg};
use crate::config::GatewayConfig;
use crate::driver::{Driver, DriverParts};
use crate::engine_api::{bind_unix_socket, serve_engine_api, EngineApiService};
use crate::listeners::{keepalive_interval, GuardedListener};
use crate::metrics::GatewayMetrics;
use crate::peer_link::{server_tls, AdvertisedPlugins, LocalIdentity, PeerDirectory, PeerLinks};
use anyhow::Context;
use kvgate_client::proto;
use kvgate_client::proto::peer_link_server::PeerLinkServer;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::sync::{mpsc, watch};

fn hostname() -> String {
    nix::unistd::gethostname().ok().and_then(|h| h.into_string().ok()).unwrap_or_else(|| "localhost".into())
}

/// After the driver stopped, how long the peer-link and watch tasks get to write the frames it sent
/// last (the aborts). Not a correctness bound: a peer that misses them ends its rooms on link loss.
const SHUTDOWN_FLUSH_MS: u64 = 100;

/// Runs the driver on its own thread with its own single-threaded runtime. Plugin calls are
/// synchronous (registering a large region maps and faults it in, which takes seconds for GiBs); on
/// a shared runtime they would stall the peer links' and the engine API's tasks (a link starved of
/// its heartbeats is declared lost). The engine fast lane runs on this runtime too (`handle`): its
/// calls and events reach the driver, and its replies the connection, without waking another thread;
/// so does the reading of live framed peer links (their heartbeats and silence bound stay on the
/// multi-threaded runtime, `peer_link/session.rs`).
/// The returned receiver fires when the driver has stopped; the runtime keeps serving the lane's
/// last frames until `stop` turns true.
fn spawn_driver_thread(
    driver: Driver,
    inputs: mpsc::Receiver<DriverInput>,
    plugin_events: mpsc::Receiver<PluginEventMsg>,
    mut stop: watch::Receiver<bool>,
) -> anyhow::Result<(tokio::sync::oneshot::Receiver<()>, tokio::runtime::Handle)> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().context("driver runtime")?;
    let handle = runtime.handle().clone();
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("kvgate-driver".into())
        .spawn(move || {
            runtime.block_on(async move {
                driver.run(inputs, plugin_events).await;
                let _ = done_tx.send(());
                let _ = stop.wait_for(|s| *s).await;
            });
        })
        .context("spawn the driver thread")?;
    Ok((done_rx, handle))
}

/// Run one gateway until a signal arrives.
pub async fn serve(config: GatewayConfig) -> anyhow::Result<()> {
    serve_from(config, None).await
}

/// Run one gateway read from `config_path` (SIGHUP and `POST /plugins/reload` read its
/// `[plugins]` part again) until SIGINT or SIGTERM.
pub async fn serve_from(config: GatewayConfig, config_path: Option<PathBuf>) -> anyhow::Result<()> {
    let config = Arc::new(config);
    // etcd credentials and TLS files are read before anything starts: a missing one stops start-up.
    let discovery_options = match config.discovery.etcd_endpoints.is_empty() {
        true => None,
        false => Some(crate::discovery::connect_options(&config.discovery)?),
    };
    let discovery_view = crate::discovery::DiscoveryView { enabled: discovery_options.is_some(), ..Default::default() };
    let discovery_status: crate::discovery::DiscoveryStatus = Arc::new(std::sync::Mutex::new(discovery_view));
    let metrics = Arc::new(GatewayMetrics::default());
    // Every configured peer is on /metrics from the start (0 until its link comes up), so an alert
    // sees a peer that never connected.
    for peer in &config.peers {
        metrics.set_peer_up(&peer.name, false);
    }
    let (plugin_tx, plugin_rx) = mpsc::channel(config.driver.plugin_event_queue_len as usize);
    let (plugins, listing) = crate::plugin_setup::open_plugins(&config, plugin_tx.clone(), metrics.clone())?;
    if plugins.is_empty() {
        anyhow::bail!(
            "no plugin could be opened (plugins.preference = {:?}); see the lines above",
            config.plugins.preference
        );
    }
    let core = kvgate_core::Core::new(config.scheduler.clone()).map_err(|e| anyhow::anyhow!("{e}"))?;
    let identity = Arc::new(LocalIdentity {
        name: config.gateway.name.clone(),
        incarnation: rand::random(),
        host: hostname(),
        plugins: AdvertisedPlugins::new(
            plugins
                .iter()
                .map(|p| proto::PluginEndpoint {
                    plugin: p.name().to_string(),
                    endpoint: p.transport().local_endpoint().to_vec(),
                    retiring: false,
                })
                .collect(),
        ),
        features: if config.peer_link.core_batch {
            vec![crate::peer_link::FEATURE_CORE_BATCH.to_string()]
        } else {
            Vec::new()
        },
    });
    let (input_tx, input_rx) = mpsc::channel(config.driver.event_queue_len as usize);
    let watch_tx = crate::engine_api::WatchFeed::new(
        config.engine_api.watch_buffer_events as usize,
        config.engine_api.watch_replay_events as usize,
        identity.incarnation,
    );
    let (stop_tx, stop_rx) = watch::channel(false);

    // Bind every listener before anything is announced, so a bad address fails start-up.
    let unix = if config.engine_api.unix_socket.is_empty() {
        None
    } else {
        Some(bind_unix_socket(&PathBuf::from(&config.engine_api.unix_socket))?)
    };
    // Beside it, the fd socket (same folder checks and 0600 mode): engines pass memory descriptors.
    let fd_socket_path = (!config.engine_api.unix_socket.is_empty())
        .then(|| crate::engine_api::fd_pass::fd_socket_path(Path::new(&config.engine_api.unix_socket)));
    let fd_listener = match &fd_socket_path {
        Some(path) => Some(bind_unix_socket(path)?.into_std()?),
        None => None,
    };
    // And the engine fast lane (same checks, same mode): the same calls without HTTP/2.
    let lane_socket_path = (config.engine_api.lane && !config.engine_api.unix_socket.is_empty())
        .then(|| crate::engine_api::lane::lane_socket_path(Path::new(&config.engine_api.unix_socket)));
    let lane_listener = match &lane_socket_path {
        Some(path) => Some(bind_unix_socket(path)?),
        None => None,
    };
    let peer_listener = tokio::net::TcpListener::bind(&config.peer_link.listen)
        .await
        .with_context(|| format!("peer_link.listen: bind {}", config.peer_link.listen))?;
    let admin_listener = if config.admin.listen.is_empty() {
        None
    } else {
        Some(
            tokio::net::TcpListener::bind(&config.admin.listen)
                .await
                .with_context(|| format!("admin.listen: bind {}", config.admin.listen))?,
        )
    };

    let (directory, static_links) = PeerDirectory::with_static(&config.peers);
    let driver = Driver::new(DriverParts {
        config: config.clone(),
        core,
        plugins,
        plugin_listing: listing,
        plugin_events: plugin_tx,
        advertised: identity.plugins.clone(),
        watch: watch_tx.clone(),
        metrics: metrics.clone(),
        directory: directory.clone(),
    });
    let (driver_done, driver_runtime) = spawn_driver_thread(driver, input_rx, plugin_rx, stop_rx.clone())?;

    let (links, peer_service) = PeerLinks::start(
        config.clone(),
        Some(driver_runtime.clone()),
        identity.clone(),
        input_tx.clone(),
        directory,
        static_links,
    )?;
    // Accepted through `listeners`: a connection cap, timeouts, TCP_NODELAY (tonic ignores
    // `Server::tcp_nodelay` there) and accept back-off.
    let peer_limits = config.peer_link.connections;
    let peer_service = Arc::new(peer_service);
    let peer_incoming = crate::peer_link::listener::route(
        GuardedListener::new(peer_listener, "peer_link", peer_limits, metrics.clone()),
        peer_service.clone(),
        config.clone(),
        stop_rx.clone(),
    );
    let mut peer_server = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(keepalive_interval(&peer_limits)))
        .http2_keepalive_timeout(Some(keepalive_interval(&peer_limits)));
    if let Some(tls) = server_tls(&config)? {
        peer_server = peer_server.tls_config(tls).context("peer_link.tls")?;
    }
    let mut stop = stop_rx.clone();
    let peer_task = tokio::spawn(
        peer_server
            .add_service(
                PeerLinkServer::from_arc(peer_service)
                    .max_decoding_message_size(crate::peer_link::max_decoding_bytes(&config)),
            )
            .serve_with_incoming_shutdown(peer_incoming, async move {
                let _ = stop.wait_for(|s| *s).await;
            }),
    );

    let info = proto::InfoReply {
        api_version: crate::engine_api::ENGINE_API_VERSION,
        gateway: config.gateway.name.clone(),
        plugins: identity.plugins.get().iter().map(|p| p.plugin.clone()).collect(),
        incarnation: identity.incarnation,
    };
    let api = EngineApiService::new(input_tx.clone(), watch_tx, &config.engine_api, info);
    let fd_stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    if let Some(listener) = fd_listener {
        let timeout = std::time::Duration::from_millis(config.engine_api.connections.handshake_timeout_ms);
        crate::engine_api::fd_pass::spawn_fd_socket(listener, api.passed_fds(), timeout, fd_stop.clone())
            .context("start the fd socket thread")?;
    }
    if let Some(listener) = lane_listener {
        // On the driver's runtime (see `spawn_driver_thread`): the listener, and so every connection
        // it accepts, is registered with that runtime's reactor, not this one's.
        let listener = listener.into_std().context("engine_api.lane: take the listener")?;
        listener.set_nonblocking(true).context("engine_api.lane: a non-blocking listener")?;
        let (service, section, metrics, stop) =
            (api.clone(), config.engine_api.clone(), metrics.clone(), stop_rx.clone());
        driver_runtime.spawn(async move {
            match tokio::net::UnixListener::from_std(listener) {
                Ok(listener) => crate::engine_api::lane::serve_lane(listener, service, &section, metrics, stop).await,
                Err(e) => tracing::error!(reason = "lane_listener", "the engine fast lane cannot listen: {e}"),
            }
        });
    }
    let api_config = config.clone();
    let api_stop = stop_rx.clone();
    let api_metrics = metrics.clone();
    let api_task = tokio::spawn(async move { serve_engine_api(&api_config, api, unix, api_metrics, api_stop).await });
    let reloader = crate::plugin_reload::Reloader { config_path, running: config.clone(), driver: input_tx.clone() };
    if let Some(listener) = admin_listener {
        let reloader = Some(reloader.clone());
        let state = AdminState {
            driver: input_tx.clone(),
            metrics: metrics.clone(),
            discovery: discovery_status.clone(),
            reloader,
        };
        let listener = GuardedListener::new(listener, "admin", config.admin.connections, metrics.clone());
        tokio::spawn(serve_admin(listener, state, stop_rx.clone()));
    }
    // Registered only now that every listener is bound: a peer that reads the record can dial at once.
    let discovery_task = discovery_options.map(|options| {
        let status = discovery_status.clone();
        let discovery = crate::discovery::Discovery {
            config: config.clone(),
            options,
            identity: identity.clone(),
            links,
            metrics: metrics.clone(),
            status,
        };
        tokio::spawn(discovery.run(stop_rx.clone()))
    });
    tracing::info!(
        name = %config.gateway.name, incarnation = identity.incarnation, engine_socket = %config.engine_api.unix_socket,
        peer_listen = %config.peer_link.listen, admin = %config.admin.listen, "gateway ready"
    );

    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
    let (mut api_task, mut peer_task) = (api_task, peer_task);
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => { tracing::info!("SIGINT: stopping"); break }
            _ = term.recv() => { tracing::info!("SIGTERM: stopping"); break }
            _ = hangup.recv() => {
                tracing::info!("SIGHUP: reloading the plugin part of the configuration");
                let reloader = reloader.clone();
                tokio::spawn(async move {
                    let outcome = reloader.reload().await;
                    tracing::info!("{}", crate::plugin_reload::describe(&outcome));
                });
            }
            r = &mut api_task => { r??; anyhow::bail!("engine API stopped unexpectedly") }
            r = &mut peer_task => { r??; anyhow::bail!("peer-link server stopped unexpectedly") }
        }
    }
    // The driver first (it aborts every live room, tells peers and engines, waits for the plugins
    // to quiesce, releases registrations), with the listeners still up so those frames go out.
    let _ = input_tx.send(DriverInput::Shutdown).await;
    let _ = driver_done.await;
    tokio::time::sleep(std::time::Duration::from_millis(SHUTDOWN_FLUSH_MS)).await;
    let _ = stop_tx.send(true);
    if let Some(task) = discovery_task {
        // It revokes this gateway's lease (bounded by discovery.request_timeout_ms).
        let _ = task.await;
    }
    fd_stop.store(true, std::sync::atomic::Ordering::Relaxed);
    if !config.engine_api.unix_socket.is_empty() {
        let _ = std::fs::remove_file(&config.engine_api.unix_socket);
    }
    if let Some(path) = fd_socket_path {
        let _ = std::fs::remove_file(path);
    }
    if let Some(path) = lane_socket_path {
        let _ = std::fs::remove_file(path);
    }
    Ok(())
}
