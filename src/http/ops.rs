//! Operations endpoints (SPEC HTTP-3): liveness and readiness.

use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::AppState;
use crate::store::Status;

/// `GET /healthz`: 200 as soon as the server accepts requests (CLI-4a).
pub(super) async fn healthz() -> Response {
    axum::Json(json!({"status": "ok"})).into_response()
}

/// How long `/readyz` and `/metrics` wait for the database. A database that is down can keep a
/// query waiting for a connection for the pool's whole acquire timeout (30 s on PostgreSQL);
/// a probe or a scrape must hear sooner that it is not answering.
const DATABASE_WAIT: Duration = Duration::from_secs(2);

/// `GET /readyz`: 200 when the database answers within [`DATABASE_WAIT`], else 503.
pub(super) async fn readyz(State(state): State<AppState>) -> Response {
    let error = match tokio::time::timeout(DATABASE_WAIT, state.store.ping()).await {
        Ok(Ok(())) => return axum::Json(json!({"status": "ready"})).into_response(),
        Ok(Err(e)) => e.to_string(),
        Err(_) => format!(
            "the database did not answer within {} s",
            DATABASE_WAIT.as_secs()
        ),
    };
    (
        StatusCode::SERVICE_UNAVAILABLE,
        axum::Json(json!({"status": "unavailable", "error": error})),
    )
        .into_response()
}

/// `GET /metrics`: Prometheus text format (HTTP-3). Queue depth is read from the store now.
pub(super) async fn metrics(State(state): State<AppState>) -> Response {
    let Some(handle) = crate::metrics::handle() else {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "another metrics recorder is installed\n",
        )
            .into_response();
    };
    // The queue depths are read now; a database that does not answer in time leaves them at
    // their last values and the rest of the page is served.
    if let Ok(Ok(counts)) = tokio::time::timeout(DATABASE_WAIT, state.store.counts()).await {
        for status in [
            Status::Pending,
            Status::Running,
            Status::Succeeded,
            Status::Failed,
        ] {
            let n = counts
                .iter()
                .find(|(s, _)| *s == status)
                .map_or(0, |(_, n)| *n);
            metrics::gauge!(crate::metrics::QUEUE_DEPTH, "status" => status.as_str()).set(n as f64);
        }
    }
    if let Ok(Ok(n)) = tokio::time::timeout(DATABASE_WAIT, state.store.callback_backlog()).await {
        metrics::gauge!(crate::metrics::CALLBACKS_BACKLOG).set(n as f64);
    }
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        handle.render(),
    )
        .into_response()
}
