//! OpenAI's Responses retrieval protocol, served from the log: `GET /v1/responses/{id}` (the
//! response object, or with `stream=true` its events, `starting_after` the provider's
//! `sequence_number`) and `POST /v1/responses/{id}/cancel`. holdfast records the provider's
//! response id of every Responses request it runs, so this works for any Responses-compatible
//! backend, stored upstream or not. An id holdfast never recorded is passed to the backend
//! unchanged; another namespace's is 404.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, Method};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::StreamExt;
use serde_json::{Value, json};
use uuid::Uuid;

use super::errors::ApiError;
use super::{AppState, namespace, passthrough, stream};
use crate::provider::{Provider, Route};
use crate::store::{Chunk, ChunkKind, ErrorType, RequestRecord, ResponseRef, Status};

const SHAPE: Provider = Provider::Openai;

/// Chunks read from the store at a time while looking for an attempt's events.
const PAGE: i64 = 512;

/// A response id, found in the log or not.
enum Located {
    /// Recorded in the caller's namespace: the request and the attempt that produced the id.
    Known(Box<RequestRecord>, u32),
    /// Never recorded here: the backend may know it (a response it stores itself).
    Unknown,
}

async fn locate(state: &AppState, namespace: &str, response_id: &str) -> Result<Located, Response> {
    let not_found = || {
        ApiError::not_found(SHAPE, format!("No response found with id '{response_id}'."))
            .into_response()
    };
    // The id goes into a path sent to the backend with its key: one segment, as OpenAI's ids
    // are (`resp_...`), or no provider holds it (RD-8, decision 158).
    if !is_response_id(response_id) {
        return Err(not_found());
    }
    let found = state
        .store
        .find_response(response_id)
        .await
        .map_err(|e| ApiError::store(SHAPE, &e).into_response())?;
    let Some(ResponseRef {
        request_id,
        namespace: owner,
        attempt,
    }) = found
    else {
        // Where namespaces share the backends' keys, an id holdfast never recorded, or has
        // pruned, may be another tenant's: not passed on with the key (decision 161).
        if !state.config.namespaces.is_empty() {
            return Err(not_found());
        }
        return Ok(Located::Unknown);
    };
    if owner != namespace {
        return Err(not_found());
    }
    match state.store.get(namespace, request_id).await {
        Ok(Some(record)) => Ok(Located::Known(Box::new(record), attempt)),
        Ok(None) => Err(not_found()),
        Err(e) => Err(ApiError::store(SHAPE, &e).into_response()),
    }
}

/// Whether `id` can be a response id: 1 to 256 ASCII letters, digits, `_` and `-`. Anything
/// else (a `/`, `.`, `?` or `%` the router decoded) could name another path of the backend's.
fn is_response_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 256
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// `DELETE /v1/responses/{id}`: deletes the response the provider stores, at the backend that
/// produced it (or, for an id holdfast never recorded, the first OpenAI backend). holdfast's
/// log keeps its record until its retention ends (decision 158).
pub(super) async fn delete(
    State(state): State<AppState>,
    Path(response_id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let path = format!("/responses/{response_id}");
    at_the_provider(&state, &response_id, &headers, Method::DELETE, &path).await
}

/// `GET /v1/responses/{id}/input_items`: the provider's list of the response's input items,
/// from the backend that produced it (decision 158).
pub(super) async fn input_items(
    State(state): State<AppState>,
    Path(response_id): Path<String>,
    headers: HeaderMap,
    uri: axum::http::Uri,
) -> Response {
    let path = format!(
        "/responses/{response_id}/input_items{}",
        uri.query().map(|q| format!("?{q}")).unwrap_or_default()
    );
    at_the_provider(&state, &response_id, &headers, Method::GET, &path).await
}

/// A call about a response that only the provider can answer, passed to the backend that
/// produced it once the caller's namespace is found to own it.
async fn at_the_provider(
    state: &AppState,
    response_id: &str,
    headers: &HeaderMap,
    method: Method,
    path: &str,
) -> Response {
    let namespace = match namespace(&state.config, headers, SHAPE) {
        Ok(ns) => ns,
        Err(e) => return e.into_response(),
    };
    match locate(state, &namespace, response_id).await {
        Ok(Located::Known(record, _)) => {
            pass_through(state, headers, method, path, Some(&record.backend)).await
        }
        Ok(Located::Unknown) => pass_through(state, headers, method, path, None).await,
        Err(response) => response,
    }
}

/// `GET /v1/responses/{id}`: the response object (JSON), or with `stream=true` the stored
/// events after `starting_after`, then live ones until the response ends.
pub(super) async fn retrieve(
    State(state): State<AppState>,
    Path(response_id): Path<String>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
    uri: axum::http::Uri,
) -> Response {
    let namespace = match namespace(&state.config, &headers, SHAPE) {
        Ok(ns) => ns,
        Err(e) => return e.into_response(),
    };
    let streamed = query.get("stream").is_some_and(|v| v == "true");
    let after = match query.get("starting_after").map(|v| v.parse::<i64>()) {
        None => None,
        Some(Ok(n)) => Some(n),
        Some(Err(_)) => {
            return ApiError::bad_request(
                SHAPE,
                "invalid_starting_after",
                "starting_after must be an integer sequence_number",
            )
            .into_response();
        }
    };
    let path = format!(
        "/responses/{response_id}{}",
        uri.query().map(|q| format!("?{q}")).unwrap_or_default()
    );
    let (record, attempt) = match locate(&state, &namespace, &response_id).await {
        Ok(Located::Known(record, _)) if providers_to_finish(&record) => {
            return pass_through(&state, &headers, Method::GET, &path, Some(&record.backend)).await;
        }
        Ok(Located::Known(record, attempt)) => (record, attempt),
        Ok(Located::Unknown) => {
            return pass_through(&state, &headers, Method::GET, &path, None).await;
        }
        Err(response) => return response,
    };
    if streamed {
        if !record.stream {
            return ApiError::bad_request(
                SHAPE,
                "not_streamed",
                "this response was not streamed; retrieve it without stream=true",
            )
            .into_response();
        }
        return match attempt_start(&state, record.id, attempt).await {
            Ok(start) => events(&state, &record, start, after),
            Err(response) => response,
        };
    }
    match response_object(&state, &record, attempt).await {
        Ok(object) => axum::Json(object).into_response(),
        Err(response) => response,
    }
}

/// `POST /v1/responses/{id}/cancel`: holdfast's cancel (LC-9) — the request fails `cancelled`
/// and its upstream call is aborted — answered with the response object, `status:
/// "cancelled"`. A response that already finished is answered as it is.
pub(super) async fn cancel(
    State(state): State<AppState>,
    Path(response_id): Path<String>,
    headers: HeaderMap,
) -> Response {
    super::to_completion(SHAPE, cancel_whole(state, response_id, headers)).await
}

async fn cancel_whole(state: AppState, response_id: String, headers: HeaderMap) -> Response {
    let namespace = match namespace(&state.config, &headers, SHAPE) {
        Ok(ns) => ns,
        Err(e) => return e.into_response(),
    };
    let path = format!("/responses/{response_id}/cancel");
    let (record, attempt) = match locate(&state, &namespace, &response_id).await {
        Ok(Located::Known(record, _)) if providers_to_finish(&record) => {
            return pass_through(&state, &headers, Method::POST, &path, Some(&record.backend))
                .await;
        }
        Ok(Located::Known(record, attempt)) => (record, attempt),
        Ok(Located::Unknown) => {
            return pass_through(&state, &headers, Method::POST, &path, None).await;
        }
        Err(response) => return response,
    };
    let record = match state.workers.cancel(&namespace, record.id).await {
        Ok(Some(record)) => record,
        Ok(None) => *record,
        Err(e) => return ApiError::store(SHAPE, &e).into_response(),
    };
    match response_object(&state, &record, attempt).await {
        Ok(object) => axum::Json(object).into_response(),
        Err(response) => response,
    }
}

/// A background response (`"background": true`) that the provider answered `queued` or
/// `in_progress`: the provider finishes it, so its retrieval and cancel are the provider's to
/// answer, at the backend that ran the request, where a stored answer would stay `queued`
/// (decision 46).
fn providers_to_finish(record: &RequestRecord) -> bool {
    #[derive(serde::Deserialize)]
    struct Object<'a> {
        #[serde(borrow)]
        status: Option<std::borrow::Cow<'a, str>>,
    }
    !record.stream
        && record.status == Status::Succeeded
        && record
            .response_body
            .as_deref()
            .and_then(|body| serde_json::from_slice::<Object<'_>>(body).ok())
            .is_some_and(|o| matches!(o.status.as_deref(), Some("queued" | "in_progress")))
}

/// A call for a response the provider holds: to `backend`, or for an id holdfast does not
/// hold (or whose backend has left the configuration), the first OpenAI backend; unchanged,
/// with the backend's key.
async fn pass_through(
    state: &AppState,
    headers: &HeaderMap,
    method: Method,
    path: &str,
    backend: Option<&str>,
) -> Response {
    // The request's backend, while the configuration still has it; else the first OpenAI one.
    let backends = &state.config.backends;
    let Some(backend) = backend
        .filter(|name| backends.iter().any(|b| b.name == *name))
        .or_else(|| {
            backends
                .iter()
                .find(|b| b.kind == Route::OpenaiResponses.provider())
                .map(|b| b.name.as_str())
        })
    else {
        return ApiError::not_found(SHAPE, "no backend serves /v1/responses").into_response();
    };
    let forwarded = passthrough::client_headers(headers, SHAPE);
    passthrough::relay(state, backend, SHAPE, method, path, forwarded, Bytes::new()).await
}

/// What a request's chunk log says of its attempts, read in seq order. A `reset` chunk carries
/// the number of the attempt expected next, but that attempt may store nothing (a 5xx, a lease
/// lost before its first event) and a later one streams instead, so an attempt is known by its
/// own data chunks: its events begin after the latest `reset` before the first of them.
#[derive(Default)]
struct AttemptLog {
    /// The seq of the latest `reset` chunk read.
    latest_reset: i64,
    /// The seq each attempt that stored events begins after.
    starts: HashMap<u32, i64>,
    /// The attempt of the latest data chunk read.
    latest_attempt: Option<u32>,
    /// The `response` member of each attempt's latest lifecycle event (`response.created`,
    /// `.in_progress`, `.completed`, ...).
    objects: HashMap<u32, Value>,
}

impl AttemptLog {
    fn read(&mut self, chunk: &Chunk) {
        #[derive(serde::Deserialize)]
        struct Lifecycle {
            response: Option<Value>,
        }
        match chunk.kind {
            ChunkKind::Reset => self.latest_reset = chunk.seq,
            ChunkKind::Data => {
                self.starts
                    .entry(chunk.attempt)
                    .or_insert(self.latest_reset);
                self.latest_attempt = Some(chunk.attempt);
                // Only lifecycle events carry the object; skip the rest without parsing them.
                if chunk.data.contains("\"response\"")
                    && let Ok(Lifecycle {
                        response: Some(object @ Value::Object(_)),
                    }) = serde_json::from_str(&chunk.data)
                {
                    self.objects.insert(chunk.attempt, object);
                }
            }
            ChunkKind::End => {}
        }
    }

    /// The seq after which attempt `attempt`'s events begin; for an attempt that stored none,
    /// the latest reset (what comes next).
    fn start_of(&self, attempt: u32) -> i64 {
        self.starts
            .get(&attempt)
            .copied()
            .unwrap_or(self.latest_reset)
    }

    /// The response object a retrieval of attempt `attempt`'s id answers with: the latest
    /// attempt's once a later one has described its response (a poller of an abandoned
    /// attempt's id follows the request to its answer), else the attempt's own.
    fn object_for(&self, attempt: u32) -> Option<&Value> {
        self.latest_attempt
            .filter(|latest| *latest > attempt)
            .and_then(|latest| self.objects.get(&latest))
            .or_else(|| self.objects.get(&attempt))
    }
}

/// Reads request `id`'s chunk log from its start into `log`, a page at a time, until `enough`
/// says so or the log ends.
async fn read_log(
    state: &AppState,
    id: Uuid,
    log: &mut AttemptLog,
    enough: impl Fn(&AttemptLog) -> bool,
) -> Result<(), Response> {
    let mut after = 0;
    loop {
        let page = state
            .store
            .chunks_after(id, after, PAGE)
            .await
            .map_err(|e| ApiError::store(SHAPE, &e).into_response())?;
        for chunk in &page {
            after = chunk.seq;
            log.read(chunk);
        }
        if page.len() < PAGE as usize || enough(log) {
            return Ok(());
        }
    }
}

/// The seq after which attempt `attempt`'s chunks start ([`AttemptLog::start_of`]).
async fn attempt_start(state: &AppState, id: Uuid, attempt: u32) -> Result<i64, Response> {
    let mut log = AttemptLog::default();
    read_log(state, id, &mut log, |log| log.starts.contains_key(&attempt)).await?;
    Ok(log.start_of(attempt))
}

/// The events of the attempt that starts after `start`, as the provider sent them (RS-4): those
/// whose `sequence_number` is above `after`, stored then live. The stream ends with the
/// response; an attempt that was abandoned, or a request that failed, ends with an error event
/// in OpenAI's stream shape (RS-4, RD-6).
fn events(state: &AppState, record: &RequestRecord, start: i64, after: Option<i64>) -> Response {
    let follow = stream::Follow {
        after: start,
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
    let id = record.id;
    let body = async_stream::stream! {
        let mut items = std::pin::pin!(items);
        while let Some(item) = items.next().await {
            let (bytes, done) = match item {
                Ok(stream::Followed::Chunk(chunk))
                    if chunk.kind == ChunkKind::Data && !after_position(&chunk, after) =>
                {
                    continue;
                }
                Ok(item) => stream::provider_bytes(&item, SHAPE),
                Err(e) => {
                    tracing::warn!(%id, error = %e, "reading stored chunks failed");
                    let message = "holdfast could not read the stored stream; retrieve it again";
                    (stream::provider_error(SHAPE, "store_unavailable", message), true)
                }
            };
            if !bytes.is_empty() {
                yield Ok::<_, std::convert::Infallible>(bytes);
            }
            if done {
                break;
            }
        }
    };
    let mut response = stream::event_stream_response(body, state.cut.clone(), Some(SHAPE));
    if let Ok(v) = axum::http::HeaderValue::from_str(&record.id.to_string()) {
        response.headers_mut().insert(super::REQUEST_ID, v);
    }
    response
}

/// Whether a stored event comes after the provider position `after` (its `sequence_number`).
fn after_position(chunk: &Chunk, after: Option<i64>) -> bool {
    #[derive(serde::Deserialize)]
    struct Numbered {
        sequence_number: Option<i64>,
    }
    let Some(after) = after else { return true };
    serde_json::from_str::<Numbered>(&chunk.data)
        .ok()
        .and_then(|n| n.sequence_number)
        .is_none_or(|n| n > after)
}

/// The response object of `record` as the provider last described it in attempt `attempt`,
/// with the status the request has since reached (`cancelled`, or `failed` when holdfast
/// failed it while the provider still said `in_progress`).
async fn response_object(
    state: &AppState,
    record: &RequestRecord,
    attempt: u32,
) -> Result<Value, Response> {
    let mut object = if record.stream {
        // An id of an attempt that was abandoned (LC-8) answers with the request's latest
        // attempt's response once that has one: a poller follows the request to its answer.
        let mut log = AttemptLog::default();
        read_log(state, record.id, &mut log, |_| false).await?;
        log.object_for(attempt).cloned().unwrap_or(Value::Null)
    } else {
        record
            .response_body
            .as_deref()
            .and_then(|body| serde_json::from_slice::<Value>(body).ok())
            .unwrap_or(Value::Null)
    };
    if !object.is_object() {
        return Err(
            ApiError::not_found(SHAPE, "the response holds no response object yet").into_response(),
        );
    }
    if let (Status::Failed, Some(error)) = (record.status, &record.error) {
        let unfinished = matches!(
            object["status"].as_str(),
            Some("in_progress" | "queued") | None
        );
        if error.kind == ErrorType::Cancelled {
            object["status"] = json!("cancelled");
        } else if unfinished {
            object["status"] = json!("failed");
            object["error"] = json!({"code": error.kind.as_str(), "message": error.message});
        }
    }
    Ok(object)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(seq: i64, attempt: u32, kind: ChunkKind, data: &str) -> Chunk {
        Chunk {
            seq,
            attempt,
            kind,
            event: None,
            data: data.into(),
        }
    }

    fn created(id: &str, status: &str) -> String {
        json!({"type": "response.created", "response": {"id": id, "status": status}}).to_string()
    }

    /// Attempt 1 streamed and was abandoned (its reset names attempt 2), attempt 2 stored
    /// nothing (a 503), attempt 3 answered: each id finds its own attempt's events, and the
    /// abandoned id answers with attempt 3's response (LC-8, RD-6, decision 25).
    #[test]
    fn an_attempt_that_stored_nothing_after_a_reset_does_not_hide_the_next_one_lc8_rd6() {
        let log_of = |chunks: &[Chunk]| {
            let mut log = AttemptLog::default();
            for c in chunks {
                log.read(c);
            }
            log
        };
        let chunks = [
            chunk(1, 1, ChunkKind::Data, &created("resp_a", "in_progress")),
            chunk(
                2,
                1,
                ChunkKind::Data,
                r#"{"type":"response.output_text.delta"}"#,
            ),
            chunk(3, 2, ChunkKind::Reset, "2"),
            chunk(4, 3, ChunkKind::Data, &created("resp_b", "in_progress")),
            chunk(5, 3, ChunkKind::Data, &created("resp_b", "completed")),
            chunk(6, 3, ChunkKind::End, r#"{"status":"succeeded"}"#),
        ];
        let log = log_of(&chunks);
        assert_eq!(log.start_of(1), 0);
        assert_eq!(log.start_of(3), 3, "attempt 3's events follow the reset");
        assert_eq!(log.object_for(3).unwrap()["id"], "resp_b");
        assert_eq!(log.object_for(3).unwrap()["status"], "completed");
        assert_eq!(
            log.object_for(1).unwrap()["id"],
            "resp_b",
            "the abandoned id follows the request to its answer"
        );

        // While the next attempt has described nothing, the abandoned id keeps its own object.
        let log = log_of(&chunks[..3]);
        assert_eq!(log.object_for(1).unwrap()["id"], "resp_a");
        assert_eq!(
            log.start_of(2),
            3,
            "an attempt yet to store begins after the reset"
        );
    }
}
