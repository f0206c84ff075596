//! Operations endpoints (SPEC HTTP-3): liveness and readiness.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::AppState;

/// `GET /healthz`: 200 as soon as the server accepts requests (CLI-4a).
pub async fn healthz() -> Response {
    axum::Json(json!({"status": "ok"})).into_response()
}

/// `GET /readyz`: 200 when the database answers, else 503.
pub async fn readyz(State(state): State<AppState>) -> Response {
    match state.store.ping().await {
        Ok(()) => axum::Json(json!({"status": "ready"})).into_response(),
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({"status": "unavailable", "error": e.to_string()})),
        )
            .into_response(),
    }
}
