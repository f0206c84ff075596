//! Operations endpoints (SPEC HTTP-3): liveness and readiness.

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

/// `GET /readyz`: 200 when the database answers, else 503.
pub(super) async fn readyz(State(state): State<AppState>) -> Response {
    match state.store.ping().await {
        Ok(()) => axum::Json(json!({"status": "ready"})).into_response(),
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({"status": "unavailable", "error": e.to_string()})),
        )
            .into_response(),
    }
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
    if let Ok(counts) = state.store.counts().await {
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
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        handle.render(),
    )
        .into_response()
}
