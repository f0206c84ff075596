//! Reading the log back: `GET /requests/{id}` as JSON (SPEC RD-1).

use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use chrono::{SecondsFormat, TimeZone, Utc};
use serde::Serialize;
use serde_json::value::RawValue;
use uuid::Uuid;

use super::errors::{ApiError, Shape};
use super::{AppState, namespace};
use crate::store::{ErrorInfo, Millis, RequestRecord, Status};

/// The JSON record of RD-1.
#[derive(Debug, Serialize)]
pub struct RecordView {
    id: Uuid,
    status: Status,
    route: String,
    model: Option<String>,
    backend: String,
    stream: bool,
    attempts: u32,
    recoveries: u32,
    /// RFC 3339; `null` unless the request is pending.
    next_retry_at: Option<String>,
    error: Option<ErrorInfo>,
    created_at: String,
    updated_at: String,
    finished_at: Option<String>,
    last_seq: i64,
    upstream_request_id: Option<String>,
    /// `{"status","body"}` once the provider answered a non-stream request; `body` is the
    /// provider's JSON, or a string when it was not JSON.
    #[serde(skip_serializing_if = "Option::is_none")]
    response: Option<ResponseView>,
}

#[derive(Debug, Serialize)]
struct ResponseView {
    status: u16,
    body: Option<Box<RawValue>>,
}

/// RFC 3339 with milliseconds, UTC.
pub fn rfc3339(ms: Millis) -> String {
    Utc.timestamp_millis_opt(ms)
        .single()
        .unwrap_or_default()
        .to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// The provider body as embedded JSON, or as a JSON string when it is not JSON.
fn body_json(body: &[u8]) -> Option<Box<RawValue>> {
    std::str::from_utf8(body)
        .ok()
        .and_then(|s| RawValue::from_string(s.to_owned()).ok())
        .or_else(|| serde_json::value::to_raw_value(&String::from_utf8_lossy(body)).ok())
}

impl From<&RequestRecord> for RecordView {
    fn from(r: &RequestRecord) -> Self {
        RecordView {
            id: r.id,
            status: r.status,
            route: r.route.clone(),
            model: r.model.clone(),
            backend: r.backend.clone(),
            stream: r.stream,
            attempts: r.attempts,
            recoveries: r.recoveries,
            next_retry_at: (r.status == Status::Pending).then(|| rfc3339(r.next_retry_at)),
            error: r.error.clone(),
            created_at: rfc3339(r.created_at),
            updated_at: rfc3339(r.updated_at),
            finished_at: r.finished_at.map(rfc3339),
            last_seq: r.last_seq,
            upstream_request_id: r.upstream_request_id.clone(),
            response: match (r.stream, r.response_status, &r.response_body) {
                (false, Some(status), Some(body)) => Some(ResponseView {
                    status,
                    body: body_json(body),
                }),
                _ => None,
            },
        }
    }
}

/// `GET /requests/{id}`: the record as JSON. Unknown, malformed or another namespace's id: 404.
pub async fn get_one(
    State(state): State<AppState>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let shape = Shape::Openai;
    let namespace = match namespace(&state.config, &headers, shape) {
        Ok(ns) => ns,
        Err(e) => return e.into_response(),
    };
    let not_found = || ApiError::not_found(shape, format!("no request {id}")).into_response();
    let Ok(uuid) = Uuid::parse_str(&id) else {
        return not_found();
    };
    match state.store.get(&namespace, uuid).await {
        Ok(Some(record)) => axum::Json(RecordView::from(&record)).into_response(),
        Ok(None) => not_found(),
        Err(e) => ApiError::unavailable(shape, &e).into_response(),
    }
}
