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
use super::{AppState, Caller, caller_of_key, presented_key, stream};
use crate::config::Config;
use crate::ledger;
use crate::provider::Provider;
use crate::provider::Route;
use crate::store::{CallbackState, ErrorInfo, ListFilter, Millis, RequestRecord, Status, Usage};

/// The JSON record of RD-1.
#[derive(Debug, Serialize)]
pub(super) struct RecordView {
    id: Uuid,
    /// The namespace it was recorded in (CLI-5): an admin key's lists span several.
    namespace: String,
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
    /// Tokens the provider reported: every attempt's summed in the record, the answering
    /// attempt's in a list (docs/usage.md).
    usage: Usage,
    /// Each attempt's usage (the record only; an attempt that reported nothing is absent).
    #[serde(skip_serializing_if = "Option::is_none")]
    usage_by_attempt: Option<Vec<AttemptUsage>>,
    /// `usage` at the configured price; `null` without a matching `[[prices]]` entry.
    cost_usd: Option<f64>,
    /// Client submissions this request answered.
    deliveries: Deliveries,
    /// Provider calls the deliveries did not make: deliveries minus attempts, when positive.
    saved_calls: u32,
    /// What the saved calls would have cost in tokens: `saved_calls` times the answering
    /// attempt's usage.
    saved_tokens: Usage,
    /// `saved_tokens` at the configured price.
    saved_cost_usd: Option<f64>,
    /// The request this one replays (EX-8), or `null`.
    replay_of: Option<Uuid>,
}

/// One attempt's reported usage.
#[derive(Debug, Serialize)]
struct AttemptUsage {
    attempt: u32,
    #[serde(flatten)]
    usage: Usage,
}

/// Who a request answered (docs/usage.md).
#[derive(Debug, Serialize)]
struct Deliveries {
    /// Client submissions answered: the one that created it, and every duplicate.
    total: u32,
    /// Of which attached to the running execution.
    attached: u32,
    /// Of which replayed from storage after it ended.
    replayed: u32,
    /// Readers of its log as an event stream, counted apart (not deliveries).
    log_reads: u32,
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

/// The provider body as embedded JSON, or as a JSON string when it is not JSON or holds a
/// number beyond a double's range (`1e400`: valid JSON, admitted by ID-1, but a
/// `serde_json::Value`, which every record answer is made into, cannot hold it; IN-2), or
/// nests as deep as ID-2 admits (128; a `Value` holds 127), which the same check finds.
pub(super) fn body_json(body: &[u8]) -> Option<Box<RawValue>> {
    std::str::from_utf8(body)
        .ok()
        .filter(|s| serde_json::from_str::<Representable>(s).is_ok())
        .and_then(|s| RawValue::from_string(s.to_owned()).ok())
        .or_else(|| serde_json::value::to_raw_value(&String::from_utf8_lossy(body)).ok())
}

/// A JSON document that a `serde_json::Value` can hold: every number within a double's range.
/// Checked without building the value (record lists carry their answers' bodies).
struct Representable;

impl<'de> serde::Deserialize<'de> for Representable {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(Representable)
    }
}

impl<'de> serde::de::Visitor<'de> for Representable {
    type Value = Representable;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("JSON")
    }
    fn visit_bool<E>(self, _: bool) -> Result<Self, E> {
        Ok(Representable)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Self, E> {
        Ok(Representable)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Self, E> {
        Ok(Representable)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Self, E> {
        Ok(Representable)
    }
    fn visit_str<E>(self, _: &str) -> Result<Self, E> {
        Ok(Representable)
    }
    fn visit_unit<E>(self) -> Result<Self, E> {
        Ok(Representable)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self, A::Error> {
        while seq.next_element::<Representable>()?.is_some() {}
        Ok(Representable)
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self, A::Error> {
        while map
            .next_entry::<serde::de::IgnoredAny, Representable>()?
            .is_some()
        {}
        Ok(Representable)
    }
}

impl RecordView {
    /// The record `r`, priced with `config`; `by_attempt` is each attempt's usage for the full
    /// record (its sum is the record's usage), `None` in a list.
    pub(super) fn new(
        r: &RequestRecord,
        config: &Config,
        by_attempt: Option<Vec<(u32, Usage)>>,
    ) -> Self {
        let price = ledger::price(config, &r.backend, r.model.as_deref());
        let usage = by_attempt.as_ref().map_or(r.usage, |rows| {
            rows.iter()
                .fold(Usage::default(), |sum, (_, u)| sum.plus(*u))
        });
        let saved_calls = r.saved_calls();
        let saved = r.usage.times(u64::from(saved_calls));
        RecordView {
            id: r.id,
            namespace: r.namespace.clone(),
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
            usage,
            usage_by_attempt: by_attempt.map(|rows| {
                rows.into_iter()
                    .map(|(attempt, usage)| AttemptUsage { attempt, usage })
                    .collect()
            }),
            cost_usd: price.and_then(|p| ledger::cost(p, &usage)),
            deliveries: Deliveries {
                total: r.deliveries(),
                attached: r.attached,
                replayed: r.replayed,
                log_reads: r.log_reads,
            },
            saved_calls,
            saved_tokens: saved,
            saved_cost_usd: price.and_then(|p| ledger::cost(p, &saved)),
            replay_of: r.replay_of,
        }
    }
}

/// `GET /requests/{id}`: the record as JSON (RD-1) with its usage by attempt, or with
/// `Accept: text/event-stream` its chunk log as a numbered event stream (RD-2..RD-6).
/// `?include=body` adds the request as sent upstream and the stored answer (bodies can hold
/// secrets: only the request's own namespace keys and admin keys read them, as every read
/// here). Unknown, malformed or another namespace's id: 404.
///
/// The event stream also takes the key as `?key=KEY` (a browser's `EventSource` cannot send
/// headers; the web page follows streams this way, docs/decisions.md 29). A key header, when
/// present, wins; the JSON record refuses `key` (400), so a key is put in a URL only where no
/// header can carry it.
pub(super) async fn get_one(
    State(state): State<AppState>,
    Path(id): Path<String>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    let shape = Provider::Openai;
    let wants_events = headers
        .get_all(header::ACCEPT)
        .iter()
        .any(|v| v.to_str().is_ok_and(|v| v.contains("text/event-stream")));
    let query_key = query.get("key");
    if query_key.is_some() && !wants_events {
        return ApiError::bad_request(
            shape,
            "invalid_parameter",
            "key: only the event stream (Accept: text/event-stream) takes the key as a query \
             parameter; send it as `Authorization: Bearer KEY` or `x-api-key: KEY`",
        )
        .into_response();
    }
    let presented =
        presented_key(&headers).or_else(|| query_key.map(|k| k.as_bytes().trim_ascii()));
    let position = if wants_events {
        match position(&headers, &query) {
            Ok(p) => p,
            Err(e) => return e.into_response(),
        }
    } else {
        None
    };
    let include_body = match query.get("include").map(String::as_str) {
        None => false,
        Some("body") => true,
        Some(other) => {
            return ApiError::bad_request(
                shape,
                "invalid_parameter",
                format!("include={other:?}: the only value is `body`"),
            )
            .into_response();
        }
    };
    let record = match addressed(&state, presented, &id).await {
        Ok(record) => record,
        Err(e) => return e.into_response(),
    };
    if wants_events {
        state.workers.count_log_read(record.id);
        return event_stream(&state, &record, position);
    }
    let by_attempt = match state.store.attempt_usage(record.id).await {
        Ok(rows) => rows,
        Err(e) => return ApiError::store(shape, &e).into_response(),
    };
    let view = RecordView::new(&record, &state.config, Some(by_attempt));
    let mut value = match super::callbacks::record_value(&state.store, &record, view).await {
        Ok(value) => value,
        Err(e) => return ApiError::store(shape, &e).into_response(),
    };
    if !include_body {
        return axum::Json(value).into_response();
    }
    let (request, answer, text) = match bodies_and_text(&state.store, &record, true).await {
        Ok(bodies) => bodies,
        Err(e) => return ApiError::store(shape, &e).into_response(),
    };
    if let Some(object) = value.as_object_mut() {
        object.insert("request".into(), request);
        object.insert("answer".into(), answer);
        object.insert("answer_text".into(), serde_json::json!(text));
    }
    axum::Json(value).into_response()
}

/// The request as sent upstream (`{"headers", "body"}`) and the stored answer: the provider's
/// JSON body, or for a stream `{"text", "events"}` with the text reassembled from the current
/// attempt's events; and the answer's text for people, webhooks and `holdfast requests replay`
/// (EX-9, CB-3): its text and tool calls (decision 96), a stream's read from its events
/// reassembled (EX-3), so that it reads as the same answer not streamed would; `None` for a
/// route without text, or when `with_text` is false (a stream's events are then not kept to
/// reassemble).
pub(super) async fn bodies_and_text(
    store: &crate::store::DynStore,
    record: &RequestRecord,
    with_text: bool,
) -> Result<(serde_json::Value, serde_json::Value, Option<String>), crate::store::StoreError> {
    use serde_json::{Value, json};
    let request = json!({
        "headers": record.headers.iter().map(|(n, v)| json!([n, v])).collect::<Vec<_>>(),
        "body": body_json(&record.body),
    });
    if !record.stream {
        let answer = record.response_body.as_deref().map_or(Value::Null, |b| {
            serde_json::to_value(body_json(b)).unwrap_or_default()
        });
        let text = with_text
            .then(|| record.route.answer_text(&answer))
            .flatten();
        return Ok((request, answer, text));
    }
    let mut text = String::new();
    let mut events = 0u64;
    let mut datas: Vec<Arc<str>> = Vec::new();
    let mut after = record.reset_seq;
    loop {
        let page = store.chunks_after(record.id, after, 512).await?;
        let full = page.len() == 512;
        for chunk in page {
            after = chunk.seq;
            if chunk.kind != crate::store::ChunkKind::Data {
                continue;
            }
            events += 1;
            if let Ok(data) = serde_json::from_str::<Value>(&chunk.data) {
                let kind = chunk.event.as_deref().or(data["type"].as_str());
                if let Some(piece) = record.route.text_of_event(kind, &data) {
                    text.push_str(&piece);
                }
            }
            if with_text {
                datas.push(chunk.data);
            }
        }
        if !full {
            break;
        }
    }
    let answer_text = with_text.then(|| {
        match record
            .route
            .assemble_stream(datas.iter().map(AsRef::as_ref))
        {
            Some(assembled) => record.route.stream_answer_text(text.clone(), &assembled),
            None => text.clone(),
        }
    });
    Ok((
        request,
        json!({"text": text, "events": events}),
        answer_text,
    ))
}

/// The request a `/requests/{id}` path names, as the caller presenting the key `presented` may
/// see it: in its namespace, or in any for an admin key.
///
/// # Errors
/// 401 for an unknown key (when namespaces are configured); 404 for a malformed id, which can
/// name no request, and for one the caller may not see.
pub(super) async fn addressed(
    state: &AppState,
    presented: Option<&[u8]>,
    id: &str,
) -> Result<RequestRecord, ApiError> {
    let shape = Provider::Openai;
    let caller = caller_of_key(&state.config, presented, shape)?;
    let not_found = || ApiError::not_found(shape, format!("no request {id}"));
    let uuid = Uuid::parse_str(id).map_err(|_| not_found())?;
    let found = match &caller {
        Caller::Namespace(ns) => state.store.get(ns, uuid).await,
        Caller::Admin => state.store.get_any(uuid).await,
    };
    match found {
        Ok(Some(record)) => Ok(record),
        Ok(None) => Err(not_found()),
        Err(e) => Err(ApiError::store(shape, &e)),
    }
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
    super::to_completion(shape, cancel_whole(state, id, headers, shape)).await
}

async fn cancel_whole(
    state: AppState,
    id: String,
    headers: HeaderMap,
    shape: Provider,
) -> Response {
    let record = match addressed(&state, presented_key(&headers), &id).await {
        Ok(record) => record,
        Err(e) => return e.into_response(),
    };
    let not_found = || ApiError::not_found(shape, format!("no request {id}")).into_response();
    let record = match state.workers.cancel(&record.namespace, record.id).await {
        Ok(Some(record)) => record,
        Ok(None) => return not_found(),
        Err(e) => return ApiError::store(shape, &e).into_response(),
    };
    // The full record, as `GET /requests/{id}` shows it: every attempt's usage summed, and its
    // callback (CB-6).
    let by_attempt = match state.store.attempt_usage(record.id).await {
        Ok(by_attempt) => by_attempt,
        Err(e) => return ApiError::store(shape, &e).into_response(),
    };
    let view = RecordView::new(&record, &state.config, Some(by_attempt));
    match super::callbacks::record_value(&state.store, &record, view).await {
        Ok(value) => axum::Json(value).into_response(),
        Err(e) => ApiError::store(shape, &e).into_response(),
    }
}

/// RD-7's filters, which `GET /requests` and its export (EX-1) both take: each route's
/// unknown-parameter error names these, then the route's own ([`LIST_PARAMETERS`], the
/// export's).
const FILTER_PARAMETERS: [&str; 11] = [
    "status",
    "callback",
    "route",
    "model",
    "backend",
    "since",
    "until",
    "q",
    "replayed",
    "replay_of",
    "namespace",
];

/// `GET /requests`'s own parameters beside RD-7's filters: its page.
const LIST_PARAMETERS: [&str; 2] = ["cursor", "limit"];

/// `GET /requests` (RD-7): the caller's namespace's requests (an admin key's: every
/// namespace's, or `namespace=`'s), newest first, filtered by `status`, `route`, `model`,
/// `backend`, `since` / `until` (RFC 3339, submission time), `q` (a substring of the request
/// body as sent upstream, best effort), `replayed=true` (answered more than one submission);
/// `limit` per page (default 50, at most 500). The answer is `{"data": [record...],
/// "next_cursor": id | null}`; pass `cursor=<next_cursor>` for the next page. Records in the list
/// leave out `response` and show the answering attempt's usage. An unknown parameter or a bad
/// value is 400 naming it.
pub(super) async fn list(
    State(state): State<AppState>,
    Query(query): Query<Vec<(String, String)>>,
    headers: HeaderMap,
) -> Response {
    let shape = Provider::Openai;
    let caller = match super::caller(&state.config, &headers, shape) {
        Ok(caller) => caller,
        Err(e) => return e.into_response(),
    };
    let filter = match list_filter(&caller, &query, &LIST_PARAMETERS) {
        Ok(filter) => filter,
        Err(e) => return e.into_response(),
    };
    match state.store.list(&filter).await {
        Ok(records) => {
            let next_cursor = (records.len() as i64 == filter.limit)
                .then(|| records.last().map(|r| r.id))
                .flatten();
            let mut data: Vec<serde_json::Value> = records
                .iter()
                .map(|r| {
                    let mut view = RecordView::new(r, &state.config, None);
                    view.response = None;
                    serde_json::to_value(view).unwrap_or_default()
                })
                .collect();
            if let Err(e) = super::callbacks::add_views(&state.store, &records, &mut data).await {
                return ApiError::store(shape, &e).into_response();
            }
            axum::Json(serde_json::json!({ "data": data, "next_cursor": next_cursor }))
                .into_response()
        }
        Err(e) => ApiError::store(shape, &e).into_response(),
    }
}

/// 400 `invalid_parameter` naming the parameter.
pub(super) fn bad_parameter(name: &str, why: impl std::fmt::Display) -> ApiError {
    ApiError::bad_request(
        Provider::Openai,
        "invalid_parameter",
        format!("{name}: {why}"),
    )
}

/// `since` and `until` when both are given: a window that ends before it starts is a mistake,
/// not an empty answer.
pub(super) fn time_window(since: Option<Millis>, until: Option<Millis>) -> Result<(), ApiError> {
    match (since, until) {
        (Some(since), Some(until)) if since > until => {
            Err(bad_parameter("until", "must not be before since"))
        }
        _ => Ok(()),
    }
}

/// A time parameter, in [`Millis`]: an RFC 3339 time, or a date (`2026-12-01`), which is
/// that day's start in UTC.
pub(super) fn time_parameter(name: &str, value: &str) -> Result<Millis, ApiError> {
    if let Ok(day) = chrono::NaiveDate::parse_from_str(value, "%Y-%m-%d") {
        return Ok(day
            .and_time(chrono::NaiveTime::MIN)
            .and_utc()
            .timestamp_millis());
    }
    chrono::DateTime::parse_from_rfc3339(value)
        .map(|t| t.timestamp_millis())
        .map_err(|e| {
            bad_parameter(
                name,
                format!("{value:?} is neither an RFC 3339 time nor a date YYYY-MM-DD ({e})"),
            )
        })
}

/// The store filter of a `GET /requests` query. An unknown parameter's error lists RD-7's
/// filters and `own`, what the route being answered takes beside them (`GET /requests/export`
/// pages and formats with parameters of its own, EX-1).
pub(super) fn list_filter(
    caller: &Caller,
    query: &[(String, String)],
    own: &[&str],
) -> Result<ListFilter, ApiError> {
    let mut filter = ListFilter {
        limit: 50,
        ..ListFilter::default()
    };
    let mut namespace = None;
    for (name, value) in query {
        match name.as_str() {
            "status" => {
                filter.status = Some(Status::parse(value).ok_or_else(|| {
                    bad_parameter(
                        "status",
                        format!("{value:?} is not one of pending, running, succeeded, failed"),
                    )
                })?);
            }
            "route" => {
                filter.route = Some(Route::from_name(value).ok_or_else(|| {
                    let names: Vec<&str> = Route::ALL.iter().map(|r| r.name()).collect();
                    bad_parameter(
                        "route",
                        format!("{value:?} is not one of {}", names.join(", ")),
                    )
                })?);
            }
            "callback" => {
                filter.callback = Some(CallbackState::parse(value).ok_or_else(|| {
                    bad_parameter(
                        "callback",
                        format!("{value:?} is not one of pending, delivered, failed"),
                    )
                })?);
            }
            "model" => filter.model = Some(value.clone()),
            "backend" => filter.backend = Some(value.clone()),
            "since" => filter.since = Some(time_parameter("since", value)?),
            "until" => filter.until = Some(time_parameter("until", value)?),
            "q" if !value.is_empty() => filter.text = Some(value.clone()),
            "q" => {}
            "replayed" => {
                filter.replayed = match value.as_str() {
                    "true" => true,
                    "false" => false,
                    _ => return Err(bad_parameter("replayed", "must be true or false")),
                }
            }
            "replay_of" => {
                filter.replay_of = Some(
                    Uuid::parse_str(value)
                        .map_err(|_| bad_parameter("replay_of", "must be a request id"))?,
                );
            }
            "cursor" => {
                filter.before = Some(
                    Uuid::parse_str(value)
                        .map_err(|_| bad_parameter("cursor", "must be a request id"))?,
                );
            }
            "limit" => {
                filter.limit = value
                    .parse::<i64>()
                    .map_err(|_| bad_parameter("limit", "must be an integer"))?
                    .clamp(1, 500);
            }
            "namespace" => namespace = Some(value.clone()),
            "include" => return Err(bad_parameter("include", "only GET /requests/{id} takes it")),
            other => {
                return Err(bad_parameter(
                    other,
                    format!(
                        "unknown parameter; known: {}",
                        FILTER_PARAMETERS
                            .iter()
                            .chain(own)
                            .copied()
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                ));
            }
        }
    }
    time_window(filter.since, filter.until)?;
    if namespace.is_some() && *caller != Caller::Admin {
        return Err(bad_parameter(
            "namespace",
            "only admin keys choose a namespace",
        ));
    }
    filter.namespace = caller.scope(namespace.as_deref());
    Ok(filter)
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
    // RD-3: no reader can have seen a chunk past `last_seq` (positioned readers see committed
    // chunks only, RD-4); following from there would skip every later chunk, the `end`
    // included, and never close.
    if let Some(p) = position
        && p > record.last_seq
    {
        return ApiError::bad_request(
            Provider::Openai,
            "invalid_last_event_id",
            format!(
                "Last-Event-ID / last_event_id {p} is past this request's last event ({}): \
                 no reader has seen it; resume from a seq this request sent",
                record.last_seq
            ),
        )
        .into_response();
    }
    let after = match position {
        None => record.reset_seq,
        Some(p) if p < record.reset_seq => record.reset_seq - 1,
        Some(p) => p,
    };
    let follow = stream::Follow {
        after,
        keepalive: Duration::from_millis(state.config.sse_keepalive_ms),
        proxied: false,
        read_retry: crate::worker::write_window(&state.config),
    };
    let items = stream::follow(
        state.store.clone(),
        Arc::clone(&state.hub),
        record.id,
        follow,
        None,
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
    // Cut at shutdown without `end`: the reader resumes with its position (DU-5).
    let mut response = stream::event_stream_response(body, state.cut.clone(), None);
    if let Ok(v) = HeaderValue::from_str(&record.id.to_string()) {
        response.headers_mut().insert(super::REQUEST_ID, v);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::body_json;
    use crate::canonical::{MAX_DEPTH, canonicalize};

    /// ID-2 admits a body nested [`MAX_DEPTH`] (128) deep, one level more than a
    /// `serde_json::Value` holds (its parser stops at the 128th open container): such a body
    /// reads back as a JSON string of its text, as one holding `1e400` does, never as a value
    /// that every record answer then fails to build (RD-1, IN-2).
    #[test]
    fn a_body_nested_as_deep_as_id2_admits_reads_back_as_json_or_as_its_text_rd1_in2() {
        let nested = |depth: usize| {
            let arrays = depth - 1;
            format!("{{\"a\":{}{}}}", "[".repeat(arrays), "]".repeat(arrays))
        };
        for depth in [MAX_DEPTH - 1, MAX_DEPTH] {
            let body = nested(depth);
            assert!(canonicalize(body.as_bytes()).is_ok(), "{depth} is admitted");
            let shown = serde_json::to_value(body_json(body.as_bytes())).unwrap();
            if depth < MAX_DEPTH {
                assert_eq!(
                    shown,
                    serde_json::from_str::<serde_json::Value>(&body).unwrap()
                );
            } else {
                assert_eq!(shown, serde_json::Value::String(body), "{depth}");
            }
        }
    }
}
