//! Reading the log back: `GET /requests/{id}` as JSON (SPEC RD-1).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use chrono::{SecondsFormat, TimeZone, Utc};
use futures::StreamExt;
use serde::Serialize;
use serde_json::value::RawValue;
use uuid::Uuid;

use super::errors::ApiError;
use super::{AppState, namespace, stream};
use crate::provider::Provider;
use crate::store::{ErrorInfo, Millis, RequestRecord, Status};

/// The JSON record of RD-1.
#[derive(Debug, Serialize)]
pub(super) struct RecordView {
    id: Uuid,
    status: Status,
    route: &'static str,
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
    /// `{"status","body"}` once the provider answered a non-stream request, or answered a
    /// request in a way that failed it (a refusal, or what it sent instead of an event stream,
    /// LC-11); `body` is the provider's JSON, or a string when it was not JSON.
    #[serde(skip_serializing_if = "Option::is_none")]
    response: Option<ResponseView>,
}

#[derive(Debug, Serialize)]
struct ResponseView {
    status: u16,
    body: Option<Box<RawValue>>,
}

/// RFC 3339 with milliseconds, UTC.
pub(super) fn rfc3339(ms: Millis) -> String {
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
            route: r.route.name(),
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
            response: match (r.response_status, &r.response_body) {
                // A streamed answer lives in the chunks; a failed stream may keep what the
                // provider sent instead.
                (Some(status), Some(body)) if !r.stream || r.status == Status::Failed => {
                    Some(ResponseView {
                        status,
                        body: body_json(body),
                    })
                }
                _ => None,
            },
        }
    }
}

/// `GET /requests/{id}`: the record as JSON (RD-1), or with `Accept: text/event-stream` its
/// chunk log as a numbered event stream (RD-2..RD-6). Unknown, malformed or another
/// namespace's id: 404.
pub(super) async fn get_one(
    State(state): State<AppState>,
    Path(id): Path<String>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    let shape = Provider::Openai;
    let (namespace, uuid) = match addressed(&state, &headers, &id) {
        Ok(found) => found,
        Err(e) => return e.into_response(),
    };
    let not_found = || ApiError::not_found(shape, format!("no request {id}")).into_response();
    let wants_events = headers
        .get_all(header::ACCEPT)
        .iter()
        .any(|v| v.to_str().is_ok_and(|v| v.contains("text/event-stream")));
    let position = if wants_events {
        match position(&headers, &query) {
            Ok(p) => p,
            Err(e) => return e.into_response(),
        }
    } else {
        None
    };
    match state.store.get(&namespace, uuid).await {
        Ok(Some(record)) if wants_events => event_stream(&state, &record, position),
        Ok(Some(record)) => axum::Json(RecordView::from(&record)).into_response(),
        Ok(None) => not_found(),
        Err(e) => ApiError::store(shape, &e).into_response(),
    }
}

/// The caller's namespace and the request id of a `/requests/{id}` path.
///
/// # Errors
/// 401 for an unknown key (when namespaces are configured); 404 for a malformed id, which can
/// name no request.
fn addressed(state: &AppState, headers: &HeaderMap, id: &str) -> Result<(String, Uuid), ApiError> {
    let namespace = namespace(&state.config, headers, Provider::Openai)?;
    let uuid = Uuid::parse_str(id)
        .map_err(|_| ApiError::not_found(Provider::Openai, format!("no request {id}")))?;
    Ok((namespace, uuid))
}

/// `POST /requests/{id}/cancel` (LC-9): a request that is not terminal fails with `cancelled`,
/// its upstream call is aborted (at once on this node; on another node at its next heartbeat),
/// its claim released. Answers 200 with the record — also when it was already terminal, in which
/// case nothing changed. Unknown or another namespace's id: 404.
pub(super) async fn cancel(
    State(state): State<AppState>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let shape = Provider::Openai;
    let (namespace, uuid) = match addressed(&state, &headers, &id) {
        Ok(found) => found,
        Err(e) => return e.into_response(),
    };
    let not_found = || ApiError::not_found(shape, format!("no request {id}")).into_response();
    match state.workers.cancel(&namespace, uuid).await {
        Ok(Some(record)) => axum::Json(RecordView::from(&record)).into_response(),
        Ok(None) => not_found(),
        Err(e) => ApiError::store(shape, &e).into_response(),
    }
}

/// Query of `GET /requests`.
#[derive(Debug, serde::Deserialize)]
pub(super) struct ListQuery {
    status: Option<String>,
    cursor: Option<String>,
    limit: Option<i64>,
}

/// `GET /requests` (RD-7): the caller's namespace's requests, newest first, optionally only
/// one `status`, `limit` per page (default 50, at most 500). The answer is
/// `{"data": [record...], "next_cursor": id | null}`; pass `cursor=<next_cursor>` for the next
/// page. Records in the list leave out `response`.
pub(super) async fn list(
    State(state): State<AppState>,
    Query(query): Query<ListQuery>,
    headers: HeaderMap,
) -> Response {
    let shape = Provider::Openai;
    let namespace = match namespace(&state.config, &headers, shape) {
        Ok(ns) => ns,
        Err(e) => return e.into_response(),
    };
    let status = match query.status.as_deref().map(|s| (s, Status::parse(s))) {
        None => None,
        Some((_, Some(s))) => Some(s),
        Some((s, None)) => {
            return ApiError::bad_request(
                shape,
                "invalid_status",
                format!("status {s:?} is not one of pending, running, succeeded, failed"),
            )
            .into_response();
        }
    };
    let cursor = match query.cursor.as_deref().map(Uuid::parse_str) {
        None => None,
        Some(Ok(c)) => Some(c),
        Some(Err(_)) => {
            return ApiError::bad_request(shape, "invalid_cursor", "cursor must be a request id")
                .into_response();
        }
    };
    let limit = query.limit.unwrap_or(50).clamp(1, 500);
    match state.store.list(&namespace, status, cursor, limit).await {
        Ok(records) => {
            let next_cursor = (records.len() as i64 == limit)
                .then(|| records.last().map(|r| r.id))
                .flatten();
            let data: Vec<RecordView> = records
                .iter()
                .map(|r| {
                    let mut view = RecordView::from(r);
                    view.response = None;
                    view
                })
                .collect();
            axum::Json(serde_json::json!({ "data": data, "next_cursor": next_cursor }))
                .into_response()
        }
        Err(e) => ApiError::store(shape, &e).into_response(),
    }
}

/// The resume position (RD-3): `Last-Event-ID`, else the `last_event_id` query parameter (a
/// browser's `EventSource` cannot set headers on its first connect). An empty header means none.
///
/// # Errors
/// 400 `invalid_last_event_id` for a value that is not a non-negative integer that fits i64.
fn position(headers: &HeaderMap, query: &HashMap<String, String>) -> Result<Option<i64>, ApiError> {
    let header = match headers.get("last-event-id") {
        Some(v) => Some(v.to_str().map_err(|_| bad_position())?.trim().to_owned()),
        None => None,
    };
    let raw = header
        .filter(|h| !h.is_empty())
        .or_else(|| query.get("last_event_id").cloned());
    match raw.as_deref().map(str::trim) {
        None | Some("") => Ok(None),
        Some(raw) if raw.bytes().all(|b| b.is_ascii_digit()) => {
            raw.parse::<i64>().map(Some).map_err(|_| bad_position())
        }
        Some(_) => Err(bad_position()),
    }
}

fn bad_position() -> ApiError {
    ApiError::bad_request(
        Provider::Openai,
        "invalid_last_event_id",
        "Last-Event-ID / last_event_id must be a non-negative integer seq",
    )
}

/// RD-2..RD-6: `retry:` first, then chunks after the position — a reader without one gets the
/// current attempt; a reader whose position lies in an abandoned attempt gets the latest
/// `reset` next — ending with the `end` event. At or past the `end` event: 204.
fn event_stream(state: &AppState, record: &RequestRecord, position: Option<i64>) -> Response {
    if let Some(p) = position
        && record.status.is_terminal()
        && p >= record.last_seq
    {
        return StatusCode::NO_CONTENT.into_response();
    }
    let after = match position {
        None => record.reset_seq,
        Some(p) if p < record.reset_seq => record.reset_seq - 1,
        Some(p) => p,
    };
    let items = stream::follow(
        state.store.clone(),
        Arc::clone(&state.hub),
        record.id,
        after,
        Duration::from_millis(state.config.sse_keepalive_ms),
    );
    let record_id = record.id;
    let body = async_stream::stream! {
        yield Ok::<_, std::convert::Infallible>(Bytes::from_static(b"retry: 1000\n\n"));
        let mut items = std::pin::pin!(items);
        while let Some(item) = items.next().await {
            match item {
                Ok(item) => yield Ok(stream::log_bytes(&item)),
                Err(e) => {
                    tracing::warn!(id = %record_id, error = %e, "reading stored chunks failed");
                    // Ending without `end` makes the reader reconnect with its position.
                    break;
                }
            }
        }
    };
    let mut response = stream::event_stream_response(body);
    if let Ok(v) = HeaderValue::from_str(&record.id.to_string()) {
        response.headers_mut().insert("holdfast-request-id", v);
    }
    response
}
