//! Proxied provider routes: admission, claim, and the answer (SPEC HTTP-1, ID-*, RS-*).
//!
//! Admission refuses what cannot be recorded before anything is written (ID-8): auth, body
//! size (IN-1), JSON (ID-2), routing (CLI-5), `Idempotency-Key` syntax (ID-5). Then the request
//! is claimed and recorded in one atomic store call (ID-7), the worker pool is woken, and the
//! connection is held until the request settles (RS-1), or answered at once with 202 when the
//! client prefers (RS-9).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures::StreamExt;
use tracing::Instrument;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use uuid::Uuid;

use super::errors::ApiError;
use super::large_bodies::{InMemory, LARGE_BODY_BYTES, on_the_blocking_pool};
use super::{AppState, namespace, requests, stream};
use crate::canonical::{self, CanonError};
use crate::config::Config;
use crate::hub::{Handed, HubEvent, Subscription};
use crate::metrics as m;
use crate::otel::{Delivery, ServerSpan};
use crate::provider::Route;
use crate::provider::{PassedHeaders, Provider};
use crate::store::{
    ChunkKind, ClaimKind, ErrorType, NewRequest, RequestRecord, Status, StoreError, Submitted,
    now_ms, released_claim_expiry, releases_claim,
};
use crate::worker::ClaimRef;

/// Most characters of a refusal's cause in its log line.
const REFUSAL_CAUSE_CHARS: usize = 300;

/// How often a waiting reader re-reads the record even without a wake-up (so a request run by
/// another node, or a lost wake-up, still settles the wait).
const WAIT_POLL: Duration = Duration::from_millis(500);
/// [`WAIT_POLL`] while the request's attempt runs on this node, whose every end wakes the
/// waiter through the hub: the re-read is only a backstop there, and a node may hold a
/// thousand such calls (decision 148).
const WAIT_POLL_RUNNING_HERE: Duration = Duration::from_secs(5);

/// Handles one proxied call. `path_model` is the model a route that takes it in the path was
/// called with (GM-1).
pub(super) async fn handle(
    State(state): State<AppState>,
    route: Route,
    path_model: Option<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    // Every log line of the call names its request once it is known. At `debug`: the lines a
    // proxied call logs at `info` and above already name their request, and a span per call
    // costs more than a replay's whole answer at the default level (docs/benchmarks-history.md).
    let span = tracing::debug_span!(
        "request",
        route = route.name(),
        id = tracing::field::Empty,
        namespace = tracing::field::Empty,
        backend = tracing::field::Empty,
    );
    // OT-2: the call's server span, when traces are on; a stream's body holds it to its end.
    let server = state
        .traces
        .as_ref()
        .map(|t| t.server(route, path_model.as_deref(), &headers));
    match admit_and_answer(&state, route, path_model, &headers, body, server.as_ref())
        .instrument(span)
        .await
    {
        Ok(response) => {
            if let Some(server) = &server {
                server.responded(response.status().as_u16());
            }
            response
        }
        Err(e) => {
            if let Some(server) = &server {
                server.responded(e.status.as_u16());
            }
            m::requests(route.name(), "refused").increment(1);
            // Whose call it was: the key's namespace, read again (refusals only; a 401 names
            // none). Counted by it and the cause, so an operator sees which tenant is refused
            // (RS-13's cap, decision 121); configured names and holdfast's own causes only.
            let namespace = (e.status != StatusCode::UNAUTHORIZED)
                .then(|| namespace(&state.config, &headers, route.provider()).ok())
                .flatten();
            if let Some(namespace) = &namespace {
                metrics::counter!(m::REFUSALS, "namespace" => namespace.clone(), "code" => e.code)
                    .increment(1);
            }
            // What the client sent wrong, for the operator: one line per refusal, its cause
            // cut short (it may quote the client's model). A missing or unknown key is a
            // `debug` line: anyone who finds the port can send those. The 5xx refusals
            // (`overloaded`, the store's) are counted, and the store's are logged where they
            // happen.
            let cause: String = e.message.chars().take(REFUSAL_CAUSE_CHARS).collect();
            if e.status == StatusCode::UNAUTHORIZED {
                tracing::debug!(route = route.name(), status = 401, code = e.code, %cause, "request refused");
            } else if e.status.is_client_error() {
                let trace_id = server.as_ref().and_then(ServerSpan::ids).map(|(t, _)| t);
                tracing::info!(
                    route = route.name(),
                    namespace = namespace.as_deref(),
                    trace_id,
                    status = e.status.as_u16(),
                    code = e.code,
                    request_id = e.request_id.as_deref(),
                    %cause,
                    "request refused"
                );
            }
            e.into_response()
        }
    }
}

async fn admit_and_answer(
    state: &AppState,
    route: Route,
    path_model: Option<String>,
    headers: &HeaderMap,
    body: Body,
    server: Option<&ServerSpan>,
) -> Result<Response, ApiError> {
    let admitted = admit(state, route, path_model, headers, body, server).await?;
    answer_admitted(state, route, headers, admitted, server).await
}

/// A call admitted into the log: the request as recorded (new, or the one its claim found),
/// and what answering it needs.
struct Admitted {
    record: RequestRecord,
    namespace: String,
    /// Answered from an execution that already existed (RS-5's `Idempotent-Replayed`).
    replayed: bool,
    /// The new request's wake-ups, subscribed before it existed; `None` for an existing one.
    fresh: Option<Subscription>,
    held: HeldSlot,
    /// The claim this call took or found.
    claim: Claim,
}

/// What a call claims: its key and fingerprint, and how long the claim lasts.
struct Claim {
    key: String,
    fingerprint: [u8; 32],
    ttl_ms: i64,
    /// holdfast asked the provider for the stream's usage chunk, the client did not (decision
    /// 40).
    hide_usage: bool,
}

impl Claim {
    /// The claim's duplicates may be answered from memory once it succeeded: until the claim
    /// expires (counted from the request that holds it, which may be an earlier one), and never
    /// past the moment pruning may delete the request with its claim (DU-4).
    fn of<'a>(
        &'a self,
        namespace: &'a str,
        record: &RequestRecord,
        config: &Config,
    ) -> ClaimRef<'a> {
        let retention_ms =
            i64::try_from(config.retention_secs.saturating_mul(1000)).unwrap_or(i64::MAX);
        ClaimRef {
            namespace,
            claim_key: &self.key,
            fingerprint: self.fingerprint,
            expires_at: record.created_at.saturating_add(self.ttl_ms).min(
                record
                    .finished_at
                    .unwrap_or(record.created_at)
                    .saturating_add(retention_ms),
            ),
        }
    }
}

/// Admission (ID-8, ID-7): refuses what cannot be recorded, then records the request with its
/// claim in one store call, or finds the request the claim already holds.
async fn admit(
    state: &AppState,
    route: Route,
    path_model: Option<String>,
    headers: &HeaderMap,
    body: Body,
    server: Option<&ServerSpan>,
) -> Result<Admitted, ApiError> {
    let shape = route.provider();
    let namespace = namespace(&state.config, headers, shape)?;
    tracing::Span::current().record("namespace", namespace.as_str());
    let held = HeldSlot::take(state, &namespace, shape)?;
    refuse_encoded_body(headers, shape)?;
    // LC-2c: a large body counts against its namespace's memory from before it is read (by
    // its declared length), or once read when it declares none, until it is recorded.
    // One declared past `max_body_bytes` is refused with 413 as it is read (IN-1).
    let declared = declared_length(headers)
        .filter(|n| *n <= state.config.max_body_bytes)
        .map_or(0, |n| n as u64);
    let mut in_memory = hold_in_memory(state, &namespace, declared, shape)?;
    let body = read_body(&state.config, headers, body, shape).await?;
    if in_memory.is_none() {
        in_memory = hold_in_memory(state, &namespace, body.len() as u64, shape)?;
    }
    if route == Route::OpenaiResponses && !state.config.namespaces.is_empty() {
        continues_its_own_response(state, &namespace, &body).await?;
    }
    let (large, (mut new, claim)) = if body.len() > LARGE_BODY_BYTES {
        // LC-2b: a namespace's large bodies are admitted a budget at a time, each held until
        // it is recorded. Read first, by its length as read: a body left unread would hold its
        // connection's HTTP/2 window, and with it the upload of the one it waits for.
        let large = tokio::select! {
            large = state.large_bodies.admit(&namespace, body.len()) => large,
            // Nothing is recorded yet: the SDK's retry goes to another node (DU-5).
            () = state.cut.cancelled() => return Err(ApiError::shutting_down_unrecorded(shape)),
        };
        // Off the runtime's workers, which serve every namespace's calls.
        let (config, headers) = (Arc::clone(&state.config), headers.clone());
        let (namespace, body) = (namespace.clone(), body.clone());
        let made = on_the_blocking_pool(move || {
            new_request(&config, route, path_model, &headers, &namespace, &body)
        });
        (large, made.await?)
    } else {
        let made = new_request(&state.config, route, path_model, headers, &namespace, &body)?;
        (None, made)
    };
    drop(body);
    new.trace_parent = server.and_then(ServerSpan::traceparent);
    // Subscribed before the request exists, so a new request's waiter cannot miss a wake-up
    // and need not re-read the record it was just handed (one store read less per request).
    let early = state.hub.subscribe_to_new(new.id, new.stream);
    let submitted = state.workers.admit(new).await;
    drop(large);
    drop(in_memory);
    let (record, replayed, fresh) = match submitted {
        Ok(Submitted::Created(record)) => {
            m::requests(route.name(), "new").increment(1);
            (*record, false, Some(early))
        }
        Ok(Submitted::Attached(record)) => {
            let outcome = if record.status.is_terminal() {
                "replayed"
            } else {
                "attached"
            };
            m::requests(route.name(), outcome).increment(1);
            (*record, true, None)
        }
        Ok(Submitted::KeyMismatch { existing }) => {
            return Err(ApiError::new(
                shape,
                StatusCode::UNPROCESSABLE_ENTITY,
                "idempotency_key_reused",
                // The fingerprint is the request hash (ID-5): for Gemini it covers the model
                // named in the path, not only the body.
                "this Idempotency-Key was already used with a different request (another body, \
                 or for Gemini another model); send a new key for a new request",
            )
            .for_request(existing)
            .final_answer());
        }
        Err(e) => return Err(ApiError::store(shape, &e)),
    };
    let span = tracing::Span::current();
    span.record("id", tracing::field::display(record.id));
    span.record("backend", record.backend.as_str());
    if let Some(server) = server {
        let delivery = match (replayed, record.status.is_terminal()) {
            (false, _) => Delivery::New,
            (true, false) => Delivery::Attached,
            (true, true) => Delivery::Replayed,
        };
        server.admitted(&record, delivery);
    }
    Ok(Admitted {
        record,
        namespace,
        replayed,
        fresh,
        held,
        claim,
    })
}

/// RD-8a (decision 161): where namespaces share the backends' keys, a Responses call may continue
/// (`previous_response_id`) only a response its own namespace made through holdfast: the
/// provider gives the model that whole conversation, whoever holds the id. Refused as OpenAI
/// refuses an id it does not hold, before anything is recorded.
async fn continues_its_own_response(
    state: &AppState,
    namespace: &str,
    body: &bytes::Bytes,
) -> Result<(), ApiError> {
    // Read whole, not searched for: an escaped member name is the same member to the provider.
    let id = if body.len() > LARGE_BODY_BYTES {
        // Off the runtime's workers, as a large body's other reading is (LC-2b).
        let body = body.clone();
        on_the_blocking_pool(move || previous_response_id(&body)).await
    } else {
        previous_response_id(body)
    };
    let Some(id) = id else {
        return Ok(());
    };
    match state.store.find_response(&id).await {
        Ok(Some(found)) if found.namespace == namespace => Ok(()),
        Ok(_) => Err(ApiError::bad_request(
            Provider::Openai,
            "previous_response_not_found",
            format!(
                "Previous response with id '{id}' not found. (holdfast: with namespaces, a call \
                 continues only a response its namespace made through holdfast and still logs)"
            ),
        )),
        Err(e) => Err(ApiError::store(Provider::Openai, &e)),
    }
}

/// The `previous_response_id` a Responses body names, if it is an object that names one.
fn previous_response_id(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Continues<'a> {
        #[serde(borrow)]
        previous_response_id: Option<std::borrow::Cow<'a, str>>,
    }
    serde_json::from_slice::<Continues<'_>>(body)
        .ok()?
        .previous_response_id
        .map(std::borrow::Cow::into_owned)
}

/// The request a call's body makes (ID-2, ID-3, ID-5, CLI-5), and its claim: the body
/// canonicalised and hashed with its route, backend and forwarded headers (and the path's
/// model, GM-1); the model rewritten for its backend.
fn new_request(
    config: &Config,
    route: Route,
    path_model: Option<String>,
    headers: &HeaderMap,
    namespace: &str,
    body: &[u8],
) -> Result<(NewRequest, Claim), ApiError> {
    let shape = route.provider();
    let mut canonical = canonical::canonicalize(body).map_err(|e| invalid_body(shape, &e))?;
    if route.model_in_path() {
        // GM-1: the path's model is the request's; the body's bytes are not touched.
        (canonical.model, canonical.model_span) = (path_model, None);
    }
    let (backend, upstream_model) = choose_backend(config, route, canonical.model.as_deref())
        .ok_or_else(|| {
            ApiError::bad_request(
                shape,
                "no_backend",
                format!(
                    "no backend serves route {} for model {:?}",
                    route.name(),
                    canonical.model.as_deref().unwrap_or("")
                ),
            )
        })?;
    let forwarded = forwarded_headers(headers, route, shape)?;
    let key = idempotency_key(headers, shape)?;

    // ID-3b: the provider gets the client's bytes; only the model value changes, in place.
    let rewrite = match (&upstream_model, &canonical.model_span) {
        (Some(model), Some(span)) if canonical.model.as_deref() != Some(model.as_str()) => {
            Some((model.clone(), span.clone()))
        }
        _ => None,
    };
    let (hashed, upstream_body, model) = match rewrite {
        Some((model, span)) => (
            canonical.with_model(&model),
            canonical::rewrite_model(body, span, &model),
            Some(model),
        ),
        None if route.model_in_path() => (
            canonical.bytes,
            body.to_vec(),
            upstream_model.or(canonical.model),
        ),
        None => (canonical.bytes, body.to_vec(), canonical.model),
    };
    let hash = request_hash(route, &backend, &forwarded, &hashed, model.as_deref());
    // After the hash: the identity is the client's body (docs/usage.md).
    // A client that did not ask for the usage chunk must not see one, whether this node asks
    // for it or the node that ran the request did (decision 40). Every delivery of a request
    // has the same body, so all agree.
    let hide_usage =
        canonical.stream && route.stream_usage_request().is_some() && !canonical.stream_options;
    let upstream_body = if config.inject_stream_usage && hide_usage {
        inject_usage_request(route, upstream_body)
    } else {
        upstream_body
    };
    let now = now_ms();
    let (kind, claim_key, ttl_secs) = match key {
        Some(key) => (
            ClaimKind::Key,
            format!("{} {key}", route.name()),
            config.idempotency_key_ttl_secs,
        ),
        None => (
            ClaimKind::BodyHash,
            hash_key(&hash),
            config.dedupe_window_secs,
        ),
    };
    let ttl_ms = i64::try_from(ttl_secs.saturating_mul(1000)).unwrap_or(i64::MAX);
    let new = NewRequest {
        id: Uuid::now_v7(),
        namespace: namespace.to_owned(),
        route,
        backend,
        model,
        stream: route.streams(canonical.stream),
        body: upstream_body,
        headers: forwarded,
        hash,
        claim: kind,
        claim_key: claim_key.clone(),
        claim_expires_at: now.saturating_add(ttl_ms),
        now,
        trace_parent: None,
        callback_url: super::callbacks::requested(config, headers, namespace, shape)?,
        replay_of: None,
    };
    let claim = Claim {
        key: claim_key,
        fingerprint: hash,
        ttl_ms,
        hide_usage,
    };
    Ok((new, claim))
}

/// The claim key of a body-hash claim (ID-4): the request hash in lower-case hex, written
/// into one buffer (`hex::encode` pushes each digit as a `char`; issue 30).
fn hash_key(hash: &[u8; 32]) -> String {
    let mut text = [0; 64];
    // Two digits for each of 32 bytes always fit; were they refused, the library's own way.
    hex::encode_to_slice(hash, &mut text)
        .ok()
        .and_then(|()| std::str::from_utf8(&text).ok())
        .map_or_else(|| hex::encode(hash), str::to_owned)
}

/// The request hash (ID-3) of a canonical body `hashed` sent on `route` to `backend` with the
/// forwarded `headers`; a route with the model in its path hashes `model` too (GM-1).
pub(super) fn request_hash(
    route: Route,
    backend: &str,
    headers: &[(String, String)],
    hashed: &[u8],
    model: Option<&str>,
) -> [u8; 32] {
    let header_refs: Vec<(&str, &str)> = headers
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_str()))
        .collect();
    match model {
        Some(model) if route.model_in_path() => canonical::request_hash_with_path_model(
            route.name(),
            backend,
            &header_refs,
            hashed,
            model,
        ),
        _ => canonical::request_hash(route.name(), backend, &header_refs, hashed),
    }
}

/// The answer to an admitted call: 202 at once when the client prefers (RS-9), a stream
/// (RS-1..RS-4), or the settled request's answer.
async fn answer_admitted(
    state: &AppState,
    route: Route,
    headers: &HeaderMap,
    admitted: Admitted,
    server: Option<&ServerSpan>,
) -> Result<Response, ApiError> {
    let Admitted {
        record,
        namespace,
        replayed,
        fresh,
        held,
        claim,
    } = admitted;
    if prefers_async(headers) {
        // The record as `GET /requests/{id}` shows it, with its callback (CB-6).
        let view = requests::RecordView::new(&record, &state.config, None);
        let value = super::callbacks::record_value(&state.store, &record, view)
            .await
            .map_err(|e| ApiError::store(route.provider(), &e))?;
        let mut response = (StatusCode::ACCEPTED, axum::Json(value)).into_response();
        let location = format!("/requests/{}", record.id);
        if let Ok(v) = HeaderValue::from_str(&location) {
            response.headers_mut().insert(header::LOCATION, v);
        }
        response.headers_mut().insert(
            "preference-applied",
            HeaderValue::from_static("respond-async"),
        );
        set_identity_headers(&mut response, &record, replayed, route, &state.config);
        return Ok(response);
    }
    if record.stream {
        if record.status.is_terminal() {
            let claim_ref = claim.of(&namespace, &record, &state.config);
            state
                .workers
                .remember(&claim_ref, &Arc::new(record.clone()));
        }
        let delivery = Answering {
            route,
            replayed,
            hide_usage: claim.hide_usage,
            server: server.cloned(),
        };
        return stream_answer(state, &namespace, record, delivery, held, fresh).await;
    }
    let shape = route.provider();
    let (record, passed) = wait_for(state, &namespace, record, shape, fresh, |r| {
        r.status.is_terminal()
    })
    .await?;
    state
        .workers
        .remember(&claim.of(&namespace, &record, &state.config), &record);
    drop(held);
    let mut response = answer(&record, replayed, route, &state.config);
    pass_on(&mut response, passed.as_deref());
    Ok(response)
}

/// RS-5a: the provider's rate-limit and timing headers that a live answer came with.
fn pass_on(response: &mut Response, passed: Option<&[(HeaderName, HeaderValue)]>) {
    for (name, value) in passed.unwrap_or_default() {
        response.headers_mut().append(name.clone(), value.clone());
    }
}

/// The answer for a stream request (RS-1..RS-4): once the current attempt has stored its first
/// chunk, a 200 event stream that replays the attempt's chunks and then live-tails them. A
/// request that settled without streaming anything (a refusal, exhausted retries) answers like a
/// non-stream one, with its status code.
async fn stream_answer(
    state: &AppState,
    namespace: &str,
    record: RequestRecord,
    delivery: Answering,
    held: HeldSlot,
    fresh: Option<Subscription>,
) -> Result<Response, ApiError> {
    let Answering {
        route,
        replayed,
        hide_usage,
        server,
    } = delivery;
    let shape = route.provider();
    // Until the current attempt stored or handed on its first event (RS-1, RS-11).
    let ready = |r: &RequestRecord| r.status.is_terminal() || r.last_seq > r.reset_seq;
    let (record, start, passed) = wait(state, namespace, record, shape, fresh, true, ready).await?;
    let only_end = record.status.is_terminal() && record.last_seq == record.reset_seq + 1;
    if only_end && record.status == Status::Failed {
        let mut response = answer(&record, replayed, route, &state.config);
        pass_on(&mut response, passed.as_deref());
        return Ok(response);
    }
    let follow = stream::Follow {
        after: record.reset_seq,
        keepalive: Duration::from_millis(state.config.sse_keepalive_ms),
        proxied: true,
        read_retry: crate::worker::write_window(&state.config),
    };
    let items = stream::follow(
        state.store.clone(),
        Arc::clone(&state.hub),
        record.id,
        follow,
        start,
    );
    let id = record.id;
    let body = async_stream::stream! {
        // The slot is held for as long as the stream is, and so is the call's span (OT-2).
        let _held = held;
        let _server = server;
        let mut items = std::pin::pin!(items);
        while let Some(item) = items.next().await {
            let (bytes, done) = match item {
                Ok(stream::Followed::Chunk(chunk))
                    if hide_usage && route.is_requested_usage_event(&chunk.data) =>
                {
                    continue;
                }
                Ok(item) => stream::provider_bytes(&item, shape),
                Err(e) => {
                    tracing::warn!(id = %id, error = %e, "reading stored chunks failed");
                    let message = "holdfast could not read the stored stream; retry the request to attach to it again";
                    (stream::provider_error(shape, "store_unavailable", message), true)
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
    let mut response = stream::event_stream_response(body, state.cut.clone(), Some(shape));
    set_identity_headers(&mut response, &record, replayed, route, &state.config);
    pass_on(&mut response, passed.as_deref());
    Ok(response)
}

/// How a stream is delivered to this client.
struct Answering {
    route: Route,
    /// Answered from an execution that already existed (RS-5's `Idempotent-Replayed`).
    replayed: bool,
    /// holdfast asked the provider for the stream's usage chunk, the client did not
    /// (`inject_stream_usage`): it is stored and counted, and left out of this client's stream
    /// (decision 40).
    hide_usage: bool,
    /// The call's server span, ended with the stream (OT-2).
    server: Option<ServerSpan>,
}

/// The proxied calls this node holds open (RS-8): in all, and per namespace for each one with
/// a cap (RS-13). Namespaces are fixed by the configuration, so the counters are made once.
pub(crate) struct Held {
    /// Every held call of this node, against `max_held_requests`.
    node: AtomicUsize,
    /// The held calls of each namespace that has a cap, and that cap.
    namespaces: HashMap<String, Arc<NamespaceHeld>>,
}

/// One namespace's held calls and its cap (RS-13).
struct NamespaceHeld {
    calls: AtomicUsize,
    cap: usize,
}

impl Held {
    /// Counters for `config`'s namespaces (`default` when it has none, CLI-5).
    pub(crate) fn new(config: &Config) -> Held {
        let namespaces = config
            .namespace_names()
            .into_iter()
            .filter_map(|name| {
                let cap = config.held_cap_of(name)?;
                let calls = AtomicUsize::new(0);
                Some((name.to_string(), Arc::new(NamespaceHeld { calls, cap })))
            })
            .collect();
        Held {
            node: AtomicUsize::new(0),
            namespaces,
        }
    }
}

/// One of the node's `max_held_requests` slots, and of its namespace's cap when it has one,
/// released on drop (RS-8, RS-13).
struct HeldSlot {
    held: Arc<Held>,
    namespace: Option<Arc<NamespaceHeld>>,
}

impl HeldSlot {
    /// Takes a slot of `namespace` and one of the node, or refuses with 503 `overloaded`,
    /// `x-should-retry: true` and `retry-after-ms` (at most 60 000, RS-8) before anything is
    /// recorded (ID-8). The namespace's comes first, so a namespace over its cap never takes,
    /// even for a moment, a slot of the node another namespace's call needs (RS-13).
    fn take(state: &AppState, namespace: &str, shape: Provider) -> Result<HeldSlot, ApiError> {
        let held = Arc::clone(&state.held);
        let own = held.namespaces.get(namespace).cloned();
        if let Some(own) = &own
            && own.calls.fetch_add(1, Ordering::SeqCst) >= own.cap
        {
            own.calls.fetch_sub(1, Ordering::SeqCst);
            return Err(overloaded(
                shape,
                format!(
                    "this namespace holds as many calls on this holdfast node as it may ({}); \
                     nothing was recorded, retry shortly",
                    own.cap
                ),
            ));
        }
        if held.node.fetch_add(1, Ordering::SeqCst) >= state.config.max_held_requests {
            held.node.fetch_sub(1, Ordering::SeqCst);
            if let Some(own) = &own {
                own.calls.fetch_sub(1, Ordering::SeqCst);
            }
            return Err(overloaded(
                shape,
                "holdfast is holding as many calls as it is configured to; nothing was \
                 recorded, retry shortly",
            ));
        }
        Ok(HeldSlot {
            held,
            namespace: own,
        })
    }
}

impl Drop for HeldSlot {
    fn drop(&mut self) {
        self.held.node.fetch_sub(1, Ordering::SeqCst);
        if let Some(own) = &self.namespace {
            own.calls.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// LC-2c: counts a large body against its namespace's memory, or refuses the call with 503
/// `overloaded` before its body is read.
fn hold_in_memory(
    state: &AppState,
    namespace: &str,
    bytes: u64,
    shape: Provider,
) -> Result<Option<InMemory>, ApiError> {
    state.large_bodies.hold(namespace, bytes).map_err(|cap| {
        overloaded(
            shape,
            format!(
                "this namespace holds as many bytes of large request bodies on this holdfast \
                 node as it may ({cap}); nothing was recorded, retry shortly"
            ),
        )
    })
}

/// RS-8's refusal: 503 `overloaded`, retryable after [`OVERLOAD_RETRY_AFTER_MS`].
fn overloaded(shape: Provider, message: impl Into<String>) -> ApiError {
    let mut e = ApiError::new(
        shape,
        StatusCode::SERVICE_UNAVAILABLE,
        "overloaded",
        message,
    );
    e.should_retry = Some(true);
    e.retry_after_ms = Some(OVERLOAD_RETRY_AFTER_MS);
    e
}

/// `retry-after-ms` on an overload refusal.
const OVERLOAD_RETRY_AFTER_MS: u64 = 500;

/// Reads the body, refusing one over `max_body_bytes` with 413 before reading it when
/// `Content-Length` says so (IN-1).
pub(super) async fn read_body(
    config: &Config,
    headers: &HeaderMap,
    body: Body,
    shape: Provider,
) -> Result<bytes::Bytes, ApiError> {
    let too_large = || {
        ApiError::new(
            shape,
            StatusCode::PAYLOAD_TOO_LARGE,
            "request_too_large",
            format!(
                "request body exceeds max_body_bytes ({} bytes)",
                config.max_body_bytes
            ),
        )
    };
    if declared_length(headers).is_some_and(|n| n > config.max_body_bytes) {
        return Err(too_large());
    }
    axum::body::to_bytes(body, config.max_body_bytes)
        .await
        .map_err(|e| {
            // http-body's Limited reports "length limit exceeded" through the source chain.
            let mut source: Option<&dyn std::error::Error> = Some(&e);
            while let Some(s) = source {
                if s.is::<http_body_util::LengthLimitError>() {
                    return too_large();
                }
                source = s.source();
            }
            ApiError::bad_request(
                shape,
                "body_read_failed",
                format!("could not read the request body: {e}"),
            )
        })
}

/// 415 `unsupported_content_encoding` for a logged call whose body is compressed
/// (`Content-Encoding` other than `identity`), before it is read (IN-1): its hash is of the
/// canonical JSON, which a compressed body is not, and reading it as JSON would answer a
/// misleading `invalid_unicode` (found by a new-user trial).
fn refuse_encoded_body(headers: &HeaderMap, shape: Provider) -> Result<(), ApiError> {
    let Some(encoding) = headers.get(header::CONTENT_ENCODING) else {
        return Ok(());
    };
    let encoding = String::from_utf8_lossy(encoding.as_bytes());
    if encoding.trim().eq_ignore_ascii_case("identity") {
        return Ok(());
    }
    Err(ApiError::new(
        shape,
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "unsupported_content_encoding",
        format!(
            "holdfast does not read compressed request bodies (Content-Encoding: {encoding}); \
             send the JSON body uncompressed"
        ),
    ))
}

/// The body's length as `Content-Length` declares it (saturated to `usize`).
fn declared_length(headers: &HeaderMap) -> Option<usize> {
    let declared = headers.get(header::CONTENT_LENGTH)?.to_str().ok()?;
    let n = declared.parse::<u64>().ok()?;
    Some(usize::try_from(n).unwrap_or(usize::MAX))
}

fn invalid_body(shape: Provider, e: &CanonError) -> ApiError {
    let code = match e {
        CanonError::NotObject => "body_not_object",
        CanonError::DuplicateKey { .. } => "duplicate_key",
        CanonError::InvalidUtf8 { .. } | CanonError::LoneSurrogate { .. } => "invalid_unicode",
        CanonError::TooDeep => "too_deep",
        CanonError::Syntax { .. } => "invalid_json",
    };
    ApiError::bad_request(shape, code, format!("request body refused: {e}"))
}

/// CLI-5: the first matching rewrite rule whose backend serves the route, else the first
/// backend of the route's kind. Returns the backend name and the model to send upstream
/// (`None`: keep the client's).
pub(super) fn choose_backend(
    config: &Config,
    route: Route,
    model: Option<&str>,
) -> Option<(String, Option<String>)> {
    if let Some(model) = model {
        for rule in &config.model_rewrites {
            let serves = config
                .backend(&rule.backend)
                .is_some_and(|b| b.kind == route.provider());
            if serves && rule.matches(model) {
                return Some((rule.backend.clone(), rule.model.clone()));
            }
        }
    }
    config
        .backends
        .iter()
        .find(|b| b.kind == route.provider())
        .map(|b| (b.name.clone(), None))
}

/// `inject_stream_usage`: the member that asks the route's provider to report a stream's usage,
/// added at the end of the top-level object of a body without `stream_options`. Only that
/// edit: the rest of the bytes stay the client's (ID-3b).
fn inject_usage_request(route: Route, mut body: Vec<u8>) -> Vec<u8> {
    let Some(member) = route.stream_usage_request() else {
        return body;
    };
    let Some(end) = body.iter().rposition(|b| *b == b'}') else {
        return body;
    };
    let empty = body[..end].iter().rev().find(|b| !b.is_ascii_whitespace()) == Some(&b'{');
    let insert = if empty {
        member.to_string()
    } else {
        format!(",{member}")
    };
    body.splice(end..end, insert.into_bytes());
    body
}

/// The route's provider's allow-listed client headers (ID-3a), lower-cased names, sorted,
/// repeated values joined with `,`, plus the provider's default headers the client did not
/// send (Anthropic's `anthropic-version`): what is sent upstream is what is hashed, so leaving a
/// default out and sending it are one request.
fn forwarded_headers(
    headers: &HeaderMap,
    route: Route,
    shape: Provider,
) -> Result<Vec<(String, String)>, ApiError> {
    let provider = route.provider();
    let mut out = Vec::new();
    for name in provider.forwarded_headers() {
        let mut values = Vec::new();
        for v in headers.get_all(*name) {
            let v = v.to_str().map_err(|_| {
                ApiError::bad_request(
                    shape,
                    "invalid_header",
                    format!("header {name} is not visible ASCII"),
                )
            })?;
            values.push(v.trim());
        }
        if !values.is_empty() {
            out.push((name.to_string(), values.join(",")));
        }
    }
    for (name, value) in provider.default_headers() {
        if !out.iter().any(|(n, _)| n == name) {
            out.push((name.to_string(), value.to_string()));
        }
    }
    out.sort();
    Ok(out)
}

/// Parses `Idempotency-Key` (ID-5): 1–255 visible ASCII characters, bare or as a quoted
/// structured-field string (RFC 8941 §3.3.3).
///
/// # Errors
/// 400 `invalid_idempotency_key` when empty, too long, not visible ASCII, or repeated.
pub(super) fn idempotency_key(
    headers: &HeaderMap,
    shape: Provider,
) -> Result<Option<String>, ApiError> {
    let mut values = headers.get_all("idempotency-key").iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    let bad = |why: &str| {
        ApiError::bad_request(
            shape,
            "invalid_idempotency_key",
            format!("Idempotency-Key {why}"),
        )
    };
    if values.next().is_some() {
        return Err(bad("must be sent once"));
    }
    let raw = value.as_bytes().trim_ascii();
    let key: Vec<u8> = match raw.strip_prefix(b"\"") {
        Some(rest) => {
            let inner = rest
                .strip_suffix(b"\"")
                .ok_or_else(|| bad("has an unterminated quoted string"))?;
            let mut key = Vec::with_capacity(inner.len());
            let mut bytes = inner.iter();
            while let Some(&b) = bytes.next() {
                match b {
                    b'\\' => match bytes.next() {
                        Some(&e @ (b'"' | b'\\')) => key.push(e),
                        _ => return Err(bad("has an invalid escape in its quoted string")),
                    },
                    b'"' => return Err(bad("has a stray quote")),
                    _ => key.push(b),
                }
            }
            key
        }
        None => raw.to_vec(),
    };
    if key.is_empty() {
        return Err(bad("must not be empty"));
    }
    if key.len() > 255 {
        return Err(bad("must be at most 255 characters"));
    }
    if !key.iter().all(|b| (0x21..=0x7e).contains(b)) {
        return Err(bad("must be visible ASCII characters only"));
    }
    Ok(String::from_utf8(key).ok())
}

fn prefers_async(headers: &HeaderMap) -> bool {
    headers.get_all("prefer").iter().any(|v| {
        v.to_str().is_ok_and(|v| {
            v.split(',')
                .any(|p| p.trim().eq_ignore_ascii_case("respond-async"))
        })
    })
}

/// Holds until `ready` holds for the record (RS-1, RS-2): subscribe first, then re-read the
/// record after every wake-up and at least every [`WAIT_POLL`] ([`WAIT_POLL_RUNNING_HERE`]
/// while its attempt runs on this node). At the shutdown cut
/// ([`Shared::cut`](super::Shared::cut)) it gives up with 503 `shutting_down` (DU-5).
///
/// `fresh` is a subscription taken before `record` was created (and `record` is the state at
/// creation): nothing can have changed unseen, so the first re-read is skipped.
async fn wait_for(
    state: &AppState,
    namespace: &str,
    record: RequestRecord,
    shape: Provider,
    fresh: Option<Subscription>,
    ready: impl Fn(&RequestRecord) -> bool,
) -> Result<(Arc<RequestRecord>, Option<PassedHeaders>), ApiError> {
    let (record, _, passed) = wait(state, namespace, record, shape, fresh, false, ready).await?;
    Ok((record, passed))
}

/// [`wait_for`], and with `take_ahead` also until the attempt hands on its first events
/// (RS-11): then the record as admitted (with the provider's request id those events came
/// with), the subscription that received them, and the events. The record is shared: one this
/// node's worker settled is the very one it published (issue 30). With it, the provider's
/// headers that a live answer came with (RS-5a): none for one read from the log.
async fn wait(
    state: &AppState,
    namespace: &str,
    record: RequestRecord,
    shape: Provider,
    fresh: Option<Subscription>,
    take_ahead: bool,
    ready: impl Fn(&RequestRecord) -> bool,
) -> Result<(Arc<RequestRecord>, Option<Start>, Option<PassedHeaders>), ApiError> {
    if ready(&record) {
        return Ok((Arc::new(record), None, None));
    }
    let (mut subscription, mut read) = match fresh {
        Some(subscription) => (subscription, false),
        None => (state.hub.subscribe(record.id), true),
    };
    loop {
        if read {
            // A peek, not the whole record (its body may be megabytes, and a node may hold
            // a thousand calls, each re-read twice a second); the whole once it is ready.
            let peeked = match state.store.peek(namespace, record.id).await {
                Ok(Some(r)) if ready(&r) => state.store.get(namespace, record.id).await,
                peeked => peeked,
            };
            match peeked {
                Ok(Some(r)) if ready(&r) => return Ok((Arc::new(r), None, None)),
                Ok(Some(_)) => {}
                Ok(None) => {
                    return Err(
                        ApiError::not_found(shape, "the request was pruned").for_request(record.id)
                    );
                }
                // Retrying cannot make a corrupt row readable.
                Err(e @ StoreError::Corrupt { .. }) => {
                    return Err(ApiError::store(shape, &e).for_request(record.id));
                }
                Err(e) => {
                    tracing::warn!(id = %record.id, error = %e, "re-reading a waited request failed")
                }
            }
        }
        read = true;
        let poll = if state.workers.runs_here(record.id) {
            WAIT_POLL_RUNNING_HERE
        } else {
            WAIT_POLL
        };
        tokio::select! {
            event = subscription.recv() => match event {
                // This node's worker settled it and handed over the record it wrote.
                HubEvent::Settled(settled, passed) if ready(&settled) => {
                    return Ok((settled, None, passed));
                }
                HubEvent::Settled(..) => read = false,
                HubEvent::Ahead(handed) if take_ahead => {
                    let mut record = record;
                    if record.upstream_request_id.is_none() {
                        record.upstream_request_id.clone_from(&handed.upstream_request_id);
                    }
                    let passed = handed.passed_headers.clone();
                    return Ok((Arc::new(record), Some((subscription, vec![handed])), passed));
                }
                // Not committed: nothing a re-read would find.
                HubEvent::Ahead(_) => read = false,
                // An outcome's last chunks, ending with its `end`: this node's worker publishes
                // the settled record right after them, with the headers of the answer (RS-5a),
                // which a re-read would not have.
                HubEvent::Chunks(chunks)
                    if chunks.last().is_some_and(|c| c.kind == ChunkKind::End) =>
                {
                    read = false;
                }
                HubEvent::Changed | HubEvent::Chunks(_) | HubEvent::Logged(_) => {}
            },
            () = tokio::time::sleep(poll) => {}
            // Shutdown (DU-5): this node's workers handed the request back; another node's
            // take it, and the caller's retry attaches to it there.
            () = state.cut.cancelled() => {
                return Err(ApiError::shutting_down(shape).for_request(record.id));
            }
        }
    }
}

/// A stream's subscription, taken while waiting, and the events handed on it already brought.
type Start = (Subscription, Vec<Arc<Handed>>);

/// The answer for a settled non-stream request (RS-3, RS-5, RS-7).
fn answer(record: &RequestRecord, replayed: bool, route: Route, config: &Config) -> Response {
    let mut response = match (record.status, &record.error) {
        (Status::Succeeded, _) => stored_response(record),
        (_, Some(error))
            if error.kind == ErrorType::UpstreamRefused && record.response_status.is_some() =>
        {
            let mut r = stored_response(record);
            r.headers_mut()
                .insert("x-should-retry", HeaderValue::from_static("false"));
            r
        }
        (_, error) => {
            let kind = error
                .as_ref()
                .map_or(ErrorType::UpstreamInvalid, |e| e.kind);
            let message = error
                .as_ref()
                .map_or_else(|| "the request failed".to_string(), |e| e.message.clone());
            ApiError::new(
                route.provider(),
                failure_status(kind, error.as_ref().and_then(|e| e.status)),
                kind.as_str(),
                message,
            )
            .final_answer()
            .into_response()
        }
    };
    set_identity_headers(&mut response, record, replayed, route, config);
    response
}

/// RS-7: the status for a failure that is not a provider refusal, given the provider's status
/// of the last attempt; retries that ended on the provider's 429 answer 429 (RS-7a).
pub(super) fn failure_status(kind: ErrorType, last_status: Option<u16>) -> StatusCode {
    match kind {
        ErrorType::LeaseExpired | ErrorType::Cancelled => StatusCode::SERVICE_UNAVAILABLE,
        ErrorType::AttemptsExhausted if last_status == Some(429) => StatusCode::TOO_MANY_REQUESTS,
        _ => StatusCode::BAD_GATEWAY,
    }
}

fn stored_response(record: &RequestRecord) -> Response {
    let status = record
        .response_status
        .and_then(|s| StatusCode::from_u16(s).ok())
        .unwrap_or(StatusCode::OK);
    let body = record.response_body.clone().unwrap_or_default();
    let mut response = (status, body).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// RS-5: `Holdfast-Request-Id`, `Idempotent-Replayed`, and the provider's request id.
fn set_identity_headers(
    response: &mut Response,
    record: &RequestRecord,
    replayed: bool,
    route: Route,
    config: &Config,
) {
    let headers = response.headers_mut();
    // While the claim lives, a re-send lands here (ID-4, ID-5); say until when. A finished
    // request's claim lives until its window ends, and a failure's a minute at most (ID-6a):
    // once it has (or a call outlasted the window), a re-send is a new request, and nothing is
    // said.
    let ttl_secs = match record.claim {
        ClaimKind::BodyHash => config.dedupe_window_secs,
        ClaimKind::Key => config.idempotency_key_ttl_secs,
    };
    let ttl_ms = i64::try_from(ttl_secs.saturating_mul(1000)).unwrap_or(i64::MAX);
    let mut expires_at = record.created_at.saturating_add(ttl_ms);
    if releases_claim(record.status, record.error.as_ref(), record.claim) {
        let failed_at = record.finished_at.unwrap_or(record.updated_at);
        expires_at = expires_at.min(released_claim_expiry(failed_at));
    }
    let lapsed = record.status.is_terminal() && expires_at <= now_ms();
    if !lapsed {
        let expires = requests::rfc3339(expires_at);
        if let Ok(v) = HeaderValue::from_str(&expires) {
            headers.insert(super::CLAIM_EXPIRES_AT, v);
        }
    }
    let id = record.id.hyphenated();
    if let Ok(v) = HeaderValue::from_str(id.encode_lower(&mut Uuid::encode_buffer())) {
        headers.insert(super::REQUEST_ID, v);
    }
    headers.insert(
        super::IDEMPOTENT_REPLAYED,
        HeaderValue::from_static(if replayed { "true" } else { "false" }),
    );
    if let (Some(name), Some(v)) = (
        route.provider().request_id_header(),
        record
            .upstream_request_id
            .as_deref()
            .and_then(|v| HeaderValue::from_str(v).ok()),
    ) {
        headers.insert(name, v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(v: &'static str) -> Result<Option<String>, ApiError> {
        let mut h = HeaderMap::new();
        h.insert("idempotency-key", HeaderValue::from_static(v));
        idempotency_key(&h, Provider::Openai)
    }

    /// ID-4: a body-hash claim's key is the request hash's lower-case hex, as stored before.
    #[test]
    fn a_body_hash_claims_key_is_the_hashs_lower_case_hex_id4() {
        let mut hash = [0u8; 32];
        for (i, b) in hash.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(37) ^ 0xa5;
        }
        assert_eq!(hash_key(&hash), hex::encode(hash));
        assert_eq!(hash_key(&[0xff; 32]), "f".repeat(64));
        assert_eq!(hash_key(&[0; 32]), "0".repeat(64));
    }

    #[test]
    fn idempotency_key_accepts_bare_and_quoted_forms_id5() {
        assert_eq!(key("abc-123").unwrap().as_deref(), Some("abc-123"));
        assert_eq!(key("\"abc-123\"").unwrap().as_deref(), Some("abc-123"));
        assert_eq!(key("\"a\\\"b\"").unwrap().as_deref(), Some("a\"b"));
    }

    #[test]
    fn idempotency_key_refuses_empty_long_spaces_and_repeats_id5() {
        assert!(key("").is_err());
        assert!(key("\"\"").is_err());
        assert!(key("a b").is_err());
        assert!(key(Box::leak("x".repeat(256).into_boxed_str())).is_err());
        assert!(key(Box::leak("x".repeat(255).into_boxed_str())).is_ok());
        let mut h = HeaderMap::new();
        h.append("idempotency-key", HeaderValue::from_static("a"));
        h.append("idempotency-key", HeaderValue::from_static("b"));
        assert!(idempotency_key(&h, Provider::Openai).is_err());
    }
}
