//! Errors in the route's provider shape (SPEC RS-6, RS-7, RS-8, IN-1, DU-5).
//!
//! OpenAI routes: `{"error":{"message","type","param","code"}}`. Anthropic routes:
//! `{"type":"error","error":{"type","message"}}` with Anthropic's documented `type` for the
//! status. Every error response also carries `Holdfast-Error: <code>`, the stable holdfast cause
//! (the OpenAI shape repeats it in `code`), so one client can tell causes apart on both shapes.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

use crate::provider::Provider;
use crate::store::StoreError;

/// An error answer. Build with the constructors; render with [`IntoResponse`].
#[derive(Debug, Clone)]
pub(crate) struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Stable holdfast cause, e.g. `invalid_json`.
    pub code: &'static str,
    /// Plain-words explanation.
    pub message: String,
    /// Provider shape.
    pub shape: Provider,
    /// `x-should-retry` value, when the answer takes a position (RS-7, RS-8).
    pub should_retry: Option<bool>,
    /// `retry-after-ms` (and `retry-after` in whole seconds), at most 60 000 (RS-8).
    pub retry_after_ms: Option<u64>,
    /// Request id, when the error concerns a recorded request.
    pub request_id: Option<String>,
}

impl ApiError {
    /// A new error of `status` and `code`.
    pub(crate) fn new(
        shape: Provider,
        status: StatusCode,
        code: &'static str,
        message: impl Into<String>,
    ) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
            shape,
            should_retry: None,
            retry_after_ms: None,
            request_id: None,
        }
    }

    /// 400 with `code`.
    pub(crate) fn bad_request(
        shape: Provider,
        code: &'static str,
        message: impl Into<String>,
    ) -> Self {
        Self::new(shape, StatusCode::BAD_REQUEST, code, message)
    }

    /// 404 `not_found`.
    pub(crate) fn not_found(shape: Provider, message: impl Into<String>) -> Self {
        Self::new(shape, StatusCode::NOT_FOUND, "not_found", message)
    }

    /// The answer for a store failure, by what the client can do about it (the map in
    /// docs/architecture.md, "Store errors"): 503 `store_unavailable` with `x-should-retry:
    /// true` when a retry can succeed (RS-8; nothing was recorded); 500 `store_corrupt` with
    /// `x-should-retry: false` for a row this version cannot read (retrying cannot help), logged
    /// with the request's id; 500 `store_error` for anything else.
    pub(crate) fn store(shape: Provider, e: &StoreError) -> Self {
        match e {
            StoreError::Unavailable(_) => {
                tracing::error!(error = %e, "store unavailable");
                let mut err = Self::new(
                    shape,
                    StatusCode::SERVICE_UNAVAILABLE,
                    "store_unavailable",
                    // Not "reach": SQLite is in the process; a full disk or an I/O error is
                    // this too. Not "nothing was recorded": on PostgreSQL a recording past its
                    // deadline may still commit, and the retry attaches to it (RS-10).
                    "holdfast's database failed or did not answer in time; retry shortly (a \
                     retry of the same call never runs it twice)",
                );
                err.should_retry = Some(true);
                err.retry_after_ms = Some(1_000);
                err
            }
            StoreError::Corrupt { id, what } => {
                let id_text = id.map(|id| id.to_string()).unwrap_or_default();
                tracing::error!(id = %id_text, what = %what, "corrupt stored row");
                let mut err = Self::new(
                    shape,
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "store_corrupt",
                    "holdfast found a stored request it cannot read; the operator was told \
                     (see the server log)",
                )
                .final_answer();
                err.request_id = id.map(|id| id.to_string());
                err
            }
            StoreError::Config(_) | StoreError::Migration(_) => {
                tracing::error!(error = %e, "store error");
                Self::new(
                    shape,
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "store_error",
                    "holdfast's database is not usable; see the server log",
                )
                .final_answer()
            }
        }
    }

    /// 503 `shutting_down` for a call this node was holding when it shut down (DU-5): the
    /// request is recorded, so a retry (`x-should-retry: true`, after `retry-after-ms`) attaches
    /// to it on whichever node answers.
    pub(crate) fn shutting_down(shape: Provider) -> Self {
        Self::shutting_down_saying(shape, SHUTTING_DOWN_MESSAGE)
    }

    /// [`ApiError::shutting_down`] for a call the cut found before it was recorded (LC-2b).
    pub(crate) fn shutting_down_unrecorded(shape: Provider) -> Self {
        Self::shutting_down_saying(
            shape,
            "this holdfast node is shutting down; nothing was recorded, send the request again",
        )
    }

    fn shutting_down_saying(shape: Provider, message: &str) -> Self {
        let mut err = Self::new(
            shape,
            StatusCode::SERVICE_UNAVAILABLE,
            "shutting_down",
            message,
        );
        err.should_retry = Some(true);
        err.retry_after_ms = Some(SHUTTING_DOWN_RETRY_AFTER_MS);
        err
    }

    /// Marks the answer as final for the SDK (`x-should-retry: false`, RS-7).
    pub(crate) fn final_answer(mut self) -> Self {
        self.should_retry = Some(false);
        self
    }

    /// Attaches the request id header.
    pub(crate) fn for_request(mut self, id: impl ToString) -> Self {
        self.request_id = Some(id.to_string());
        self
    }
}

/// What a call or stream this node ends at shutdown is told (DU-5): the 503's message and the
/// proxied stream's closing error event's.
pub(crate) const SHUTTING_DOWN_MESSAGE: &str = "this holdfast node is shutting down; the request \
     is recorded, and sending it again attaches to it";

/// `retry-after-ms` on a 503 `shutting_down`.
const SHUTTING_DOWN_RETRY_AFTER_MS: u64 = 1_000;

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = self.shape.error_body(self.status, self.code, &self.message);
        let mut response = (self.status, axum::Json(body)).into_response();
        let headers = response.headers_mut();
        headers.insert("holdfast-error", HeaderValue::from_static(self.code));
        if let Some(retry) = self.should_retry {
            headers.insert(
                "x-should-retry",
                HeaderValue::from_static(if retry { "true" } else { "false" }),
            );
        }
        if let Some(ms) = self.retry_after_ms {
            let ms = ms.min(60_000);
            headers.insert("retry-after-ms", HeaderValue::from(ms));
            headers.insert("retry-after", HeaderValue::from(ms.div_ceil(1000)));
        }
        if let Some(id) = self
            .request_id
            .and_then(|id| HeaderValue::from_str(&id).ok())
        {
            headers.insert(super::REQUEST_ID, id);
        }
        response
    }
}
