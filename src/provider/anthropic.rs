//! Anthropic's Messages API.

use axum::http::StatusCode;
use serde_json::{Value, json};

/// Client headers forwarded upstream and covered by the hash (ID-3a).
pub(super) const FORWARDED_HEADERS: &[&str] = &["anthropic-beta", "anthropic-version"];

/// `anthropic-version` is required upstream; holdfast sends this one when the client sent none.
pub(super) const DEFAULT_HEADERS: &[(&str, &str)] = &[("anthropic-version", "2023-06-01")];

/// The request-id response header (RS-5).
pub(super) const REQUEST_ID_HEADER: &str = "request-id";

/// The event that completes a Messages stream.
pub(super) const STREAM_END: &str = "message_stop";

/// A Messages answer holds `content`.
pub(super) const RESULT_MEMBERS: &[&str] = &["content"];

/// Paths whose clients are Anthropic's SDKs.
pub(super) fn owns_path(path: &str) -> bool {
    path.starts_with("/v1/messages")
}

/// `x-api-key: KEY`.
pub(super) fn auth_header(key: &str) -> (&'static str, String) {
    ("x-api-key", key.to_string())
}

/// `{"type":"error","error":{"type","message"}}` with Anthropic's documented `type` for the
/// status (its shape has no room for holdfast's cause: that travels in `Holdfast-Error`).
pub(super) fn error_body(status: StatusCode, message: &str) -> Value {
    let kind = match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        400..=499 => "invalid_request_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    };
    json!({"type": "error", "error": {"type": kind, "message": message}})
}

/// `event: error` with an error body: the Anthropic SDKs raise on it.
pub(super) fn error_event(message: &str) -> (Option<&'static str>, String) {
    let data = json!({"type": "error", "error": {"type": "api_error", "message": message}});
    (Some("error"), data.to_string())
}

/// `event: error` (data `type` `error`), or a non-null `error` member.
pub(super) fn is_error_event(event: Option<&str>, kind: Option<&str>, error: bool) -> bool {
    error || event == Some("error") || kind == Some("error")
}

/// `message_stop`, by its `event:` name or its data's `type`.
pub(super) fn ends_stream(kind: Option<&str>) -> bool {
    kind == Some(STREAM_END)
}
