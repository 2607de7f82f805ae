//! The admin HTTP listener: `/metrics` (Prometheus text), `/rooms` (JSON, every non-terminal room),
//! `/healthz` (503 with the reasons when a plugin worker died or a room outlived its deadline),
//! `/plugins` and `/discovery` (this gateway's etcd registration), all read-only (a snapshot from the
//! driver), and `POST /plugins/reload`, the one call that changes something: it re-reads the plugin
//! part of the configuration (`plugin_reload`). Bind the listener where only operators reach it.

use crate::channels::{AdminSnapshot, DriverInput};
use crate::metrics::GatewayMetrics;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// How long an admin request waits for the driver's snapshot.
pub const ADMIN_SNAPSHOT_TIMEOUT_MS: u64 = 2_000;

#[derive(Clone)]
pub struct AdminState {
    pub driver: mpsc::Sender<DriverInput>,
    pub metrics: Arc<GatewayMetrics>,
    /// What discovery reports (`enabled: false` while `[discovery]` is off).
    pub discovery: crate::discovery::DiscoveryStatus,
    /// Re-reads the configuration for `POST /plugins/reload`.
    pub reloader: Option<crate::plugin_reload::Reloader>,
}

async fn snapshot(state: &AdminState) -> Result<AdminSnapshot, Response> {
    let (tx, rx) = oneshot::channel();
    let unavailable = || (StatusCode::SERVICE_UNAVAILABLE, "driver not answering\n").into_response();
    state.driver.send(DriverInput::Admin(tx)).await.map_err(|_| unavailable())?;
    match tokio::time::timeout(Duration::from_millis(ADMIN_SNAPSHOT_TIMEOUT_MS), rx).await {
        Ok(Ok(s)) => Ok(s),
        _ => Err(unavailable()),
    }
}

async fn metrics(State(state): State<AdminState>) -> Response {
    match snapshot(&state).await {
        Ok(s) => (
            [(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")],
            state.metrics.render(&s),
        )
            .into_response(),
        Err(r) => r,
    }
}

async fn rooms(State(state): State<AdminState>) -> Response {
    match snapshot(&state).await {
        Ok(s) => Json(s.rooms).into_response(),
        Err(r) => r,
    }
}

async fn healthz(State(state): State<AdminState>) -> Response {
    match snapshot(&state).await {
        Ok(s) if s.problems.is_empty() => {
            (StatusCode::OK, Json(serde_json::json!({"healthy": true, "problems": [], "warnings": s.warnings})))
                .into_response()
        }
        Ok(s) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({"healthy": false, "problems": s.problems, "warnings": s.warnings})),
        )
            .into_response(),
        Err(r) => r,
    }
}

async fn plugins(State(state): State<AdminState>) -> Response {
    match snapshot(&state).await {
        Ok(s) => Json(serde_json::json!({"plugins": s.plugins, "peers": s.peers, "peer_link_auth": s.peer_link_auth, "last_reload": s.last_reload})).into_response(),
        Err(r) => r,
    }
}

/// `POST /plugins/reload`: 200 with what was applied, 409 with why nothing was.
async fn reload(State(state): State<AdminState>) -> Response {
    let Some(reloader) = &state.reloader else {
        return (StatusCode::NOT_FOUND, "plugin reload is not available on this listener\n").into_response();
    };
    let outcome = reloader.reload().await;
    let code = if outcome.applied { StatusCode::OK } else { StatusCode::CONFLICT };
    (code, Json(outcome)).into_response()
}

async fn discovery(State(state): State<AdminState>) -> Response {
    let view = state.discovery.lock().unwrap_or_else(|e| e.into_inner()).clone();
    Json(view).into_response()
}

pub fn router(state: AdminState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/rooms", get(rooms))
        .route("/healthz", get(healthz))
        .route("/plugins/reload", axum::routing::post(reload))
        .route("/plugins", get(plugins))
        .route("/discovery", get(discovery))
        .with_state(state)
}

/// Serve the admin listener until `shutdown` flips.
pub async fn serve_admin(
    listener: crate::listeners::GuardedListener<tokio::net::TcpListener>,
    state: AdminState,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) -> std::io::Result<()> {
    axum::serve(listener, router(state))
        .with_graceful_shutdown(async move {
            let _ = shutdown.wait_for(|s| *s).await;
        })
        .await
}
