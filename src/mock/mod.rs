//! The mock provider (SPEC CLI-3): a fake OpenAI + Anthropic + Gemini HTTP server.
//!
//! Used in-process by `holdfast serve --demo` and by tests (bound to port 0), as a separate
//! process by `holdfast mock-upstream --listen ADDR`, and by the benchmarks. It answers
//! deterministically (the reply text is a function of the request body), fast (no lock is held
//! across an await, nothing is logged per request above `debug`), and is steered at run time
//! through [`MockServer`] methods or the `/_mock/*` control routes on the same listener.
//!
//! # Map
//!
//! - this file: [`MockConfig`], [`MockServer`], [`run`], shared state, the accept loop, the model
//!   call pipeline (record → connection faults → provider answer) and the control routes.
//! - `openai.rs`, `anthropic.rs`, `gemini.rs`: the providers' bodies, stream events and error
//!   shapes. Gemini's routes take the model in the path (`/v1beta/models/{model}:generateContent`,
//!   also under `/v1`): a Gemini backend's `base_url` is the mock's address without `/v1`
//!   ([`MockServer::root_url`]).
//! - `sse.rs`: event framing and the streamed body with its faults (delay, stall, garbage, drop).
//! - `text.rs`: the deterministic reply text, token counts, embeddings and base64.
//!
//! # Fault windows
//!
//! Every model call gets a position `k` (1-based), counted since the last [`MockServer::reset`]
//! or config change. A fault whose count is `N` applies to calls with `k <= N` (for `drop_first`
//! and `hang_first`, 0 means every call); all windows start at the same call, so
//! `fail_first = 2, reset_before_headers = 1` resets call 1 and fails call 2.
//! In one call the order is: reset, hang, header delay, injected failure, body validation
//! (malformed JSON → 400), answer (stream faults apply while the body streams).
//!
//! # Connection-level faults
//!
//! The server runs its own accept loop over hyper so that a handler can close its TCP connection
//! without writing any response (`reset_before_headers`): each connection carries a [`Notify`]
//! in the request extensions, the handler fires it and never returns, and the connection task
//! drops the connection. A mid-stream drop is a body stream that yields an error: hyper then ends
//! the connection without the chunked terminator, and the client sees a body error.

mod anthropic;
mod gemini;
mod openai;
mod sse;
mod text;

#[cfg(test)]
mod tests;

use std::collections::VecDeque;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Extension, Path, State};
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE, HeaderName};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use hyper::service::Service as _;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use serde_json::{Value, json};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio::task::{JoinHandle, JoinSet};

use sse::{StreamFaults, stream_body};

/// Run-time behaviour of the mock. Every field has a default (`#[serde(default)]`), so a JSON
/// object with only the fields to change is a complete config.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq)]
#[serde(default)]
pub struct MockConfig {
    /// Content pieces per response: one delta event each when streaming; the non-stream text is
    /// the same pieces joined. Default 8.
    pub chunks: u32,
    /// Milliseconds slept before each content event of a stream. Default 0.
    pub chunk_delay_ms: u64,
    /// Milliseconds slept before the response headers, on every model call. Default 0.
    pub header_delay_ms: u64,
    /// The first N calls (since the last reset or config change) answer `fail_status` with the
    /// route's provider error body. Default 0.
    pub fail_first: u32,
    /// Status of injected failures. Default 500; an invalid code falls back to 500.
    pub fail_status: u16,
    /// When set, injected failures carry `retry-after: <value>` (seconds or an HTTP date).
    pub retry_after: Option<String>,
    /// When set, injected failures carry `retry-after-ms: <value>`.
    pub retry_after_ms: Option<u64>,
    /// When set, injected failures on Gemini routes carry a `google.rpc.RetryInfo` detail
    /// with this `retryDelay` (`"1.5s"`) in their body, which is where Google says how long
    /// to wait (no `retry-after`).
    pub retry_delay: Option<String>,
    /// Streams only: after K content events, end the connection abruptly (no terminator, no
    /// `[DONE]` / `message_stop`). K at or past the last piece drops right after the content.
    pub drop_after_chunks: Option<u32>,
    /// Apply `drop_after_chunks` only to the first N calls; 0 means every call. Default 0.
    pub drop_first: u32,
    /// The first N calls: read the request, then close the TCP connection without any
    /// response bytes. Default 0.
    pub reset_before_headers: u32,
    /// Milliseconds slept before the headers of the first `hang_first` calls (to trip header
    /// timeouts). Adds to `header_delay_ms`.
    pub hang_before_headers_ms: Option<u64>,
    /// How many calls `hang_before_headers_ms` applies to; 0 means every call. Default 0.
    pub hang_first: u32,
    /// Streams only: `(K, M)` — after K content events, pause M milliseconds once, then go on
    /// (to trip idle timeouts). JSON form `[K, M]`.
    pub stall_after_chunks: Option<(u32, u64)>,
    /// Streams only: emit a garbage event (`data: {not json` and a line without a colon)
    /// halfway through the content.
    pub malformed_sse: bool,
    /// Non-stream only: answer 200 with `content-type: text/plain` and body `this is not json`.
    pub non_json_200: bool,
    /// Non-stream only: pad the reply text with more words to at least this many bytes.
    pub oversized_bytes: Option<usize>,
    /// Streams only: after K content events, end the body cleanly (a proper end of the
    /// chunked body) without the events that follow the content: no finish chunk, no
    /// `[DONE]` / `message_stop` / `response.completed`.
    pub end_after_chunks: Option<u32>,
    /// Streams only: send every event but the one that completes the stream (`[DONE]`,
    /// `message_stop`, `response.completed`), then end the body cleanly.
    pub omit_stream_end: bool,
    /// Answer a stream request with the complete non-stream JSON body
    /// (`content-type: application/json`), as a provider that ignores `"stream": true` does.
    pub ignore_stream: bool,
}

impl Default for MockConfig {
    fn default() -> Self {
        MockConfig {
            chunks: 8,
            chunk_delay_ms: 0,
            header_delay_ms: 0,
            fail_first: 0,
            fail_status: 500,
            retry_after: None,
            retry_after_ms: None,
            retry_delay: None,
            drop_after_chunks: None,
            drop_first: 0,
            reset_before_headers: 0,
            hang_before_headers_ms: None,
            hang_first: 0,
            stall_after_chunks: None,
            malformed_sse: false,
            non_json_200: false,
            oversized_bytes: None,
            end_after_chunks: None,
            omit_stream_end: false,
            ignore_stream: false,
        }
    }
}

/// One model call as the mock received it (faults and malformed bodies included).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct RecordedCall {
    /// Request path with its query, if any (`/v1/messages?beta=true`).
    pub path: String,
    /// Every request header, in arrival order; names lowercase, values lossily UTF-8.
    pub headers: Vec<(String, String)>,
    /// The parsed body, `Null` if it was not JSON.
    pub body: Value,
    /// 1-based call number since the last reset.
    pub n: u64,
    /// When the call arrived, in Unix milliseconds (the clock request records use).
    pub at_ms: i64,
}

/// How many calls [`MockServer::recorded`] keeps.
const RECORDED_MAX: usize = 1000;

/// Request bodies above this are refused by the mock itself (holdfast's own limit is lower).
const MAX_BODY_BYTES: usize = 256 << 20;

/// A running mock. Dropping it does NOT stop the server; call [`MockServer::shutdown`].
pub struct MockServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: Arc<Notify>,
    task: JoinHandle<()>,
}

impl MockServer {
    /// Serves on `listener` (already bound; port 0 is fine) until [`MockServer::shutdown`].
    ///
    /// # Errors
    /// Only if the listener's local address cannot be read.
    pub async fn start(listener: TcpListener, config: MockConfig) -> std::io::Result<MockServer> {
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared::new(config));
        let app = router(shared.clone());
        let stop = Arc::new(Notify::new());
        let task = tokio::spawn(accept_loop(listener, app, stop.clone()));
        Ok(MockServer {
            addr,
            shared,
            stop,
            task,
        })
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT/v1`: the `base_url` of a holdfast backend (either kind) or an SDK
    /// client. An unspecified bind address (`0.0.0.0`, `::`) is given as loopback.
    pub fn base_url(&self) -> String {
        let ip = match self.addr.ip() {
            IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
            ip => ip,
        };
        format!("http://{}/v1", SocketAddr::new(ip, self.addr.port()))
    }

    /// `http://127.0.0.1:PORT`: the `base_url` of a Gemini backend, which carries no version
    /// prefix (the client's goes upstream).
    pub fn root_url(&self) -> String {
        self.base_url().trim_end_matches("/v1").to_string()
    }

    /// Model calls received since the last reset (every route, faults included; not `/_mock/*`).
    pub fn calls(&self) -> u64 {
        self.shared.calls.load(Ordering::SeqCst)
    }

    /// Paced streamed bodies (with `chunk_delay_ms` or a stream fault) still being sent; a
    /// client that closes its connection ends its stream.
    pub fn open_streams(&self) -> u64 {
        self.shared.open_streams.load(Ordering::SeqCst)
    }

    /// The last 1000 model calls, oldest first.
    pub fn recorded(&self) -> Vec<RecordedCall> {
        self.shared.recorded()
    }

    /// Calls that are not model calls (`GET /v1/models`, `POST /v1/messages/count_tokens`,
    /// `GET /v1/responses/{id}`), oldest first, with `n = 0`.
    pub fn other_calls(&self) -> Vec<RecordedCall> {
        let raw: Vec<RawCall> = self
            .shared
            .others
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .cloned()
            .collect();
        raw.into_iter().map(RawCall::into_recorded).collect()
    }

    /// Replaces the config and restarts the fault windows (call positions count from 1 again).
    pub fn set_config(&self, config: MockConfig) {
        self.shared.set_config(config);
    }

    /// The current config.
    pub fn config(&self) -> MockConfig {
        (*self.shared.config()).clone()
    }

    /// Calls back to 0, recorded calls cleared, fault windows restarted; the config is kept.
    pub fn reset(&self) {
        self.shared.reset();
    }

    /// Stops accepting, closes every open connection (in-flight responses are cut), and waits
    /// for the server task to end.
    pub async fn shutdown(self) {
        self.stop.notify_one();
        let _ = self.task.await;
    }
}

/// `holdfast mock-upstream`: serves on `listen` until ctrl-c.
///
/// # Errors
/// Binding `listen` fails, or the ctrl-c handler cannot be installed.
pub async fn run(listen: SocketAddr, config: MockConfig) -> std::io::Result<()> {
    let listener = TcpListener::bind(listen).await?;
    let server = MockServer::start(listener, config).await?;
    tracing::info!(addr = %server.addr(), base_url = %server.base_url(), "mock upstream listening");
    let waited = tokio::signal::ctrl_c().await;
    server.shutdown().await;
    waited
}

// ---- shared state ----

/// State shared by every connection. Locks are std locks held for a few instructions, never
/// across an await.
struct Shared {
    /// The config; the fault counter is restarted while the write lock is held, so a call reads
    /// its config and takes its position consistently.
    config: RwLock<Arc<MockConfig>>,
    /// Model calls since the last reset; a call's `n` is this after its increment.
    calls: AtomicU64,
    /// Model calls since the last reset or config change; a call's fault position `k`.
    fault_seq: AtomicU64,
    /// The last [`RECORDED_MAX`] calls.
    recorded: Mutex<VecDeque<RawCall>>,
    /// Streamed response bodies being sent right now (paced streams only): drops to zero when
    /// the client closes its connection, which is how tests see an upstream call aborted.
    open_streams: Arc<AtomicU64>,
    /// Calls that are not model calls (models list, token counting, response retrieval), last
    /// [`RECORDED_MAX`]; not counted in `calls`.
    others: Mutex<VecDeque<RawCall>>,
}

impl Shared {
    fn new(config: MockConfig) -> Shared {
        Shared {
            config: RwLock::new(Arc::new(config)),
            calls: AtomicU64::new(0),
            fault_seq: AtomicU64::new(0),
            recorded: Mutex::new(VecDeque::with_capacity(64)),
            open_streams: Arc::default(),
            others: Mutex::new(VecDeque::new()),
        }
    }

    fn record_other(&self, call: RawCall) {
        let mut others = self.others.lock().unwrap_or_else(PoisonError::into_inner);
        if others.len() >= RECORDED_MAX {
            others.pop_front();
        }
        others.push_back(call);
    }

    fn config(&self) -> Arc<MockConfig> {
        self.config
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn set_config(&self, config: MockConfig) {
        let mut slot = self.config.write().unwrap_or_else(PoisonError::into_inner);
        *slot = Arc::new(config);
        self.fault_seq.store(0, Ordering::SeqCst);
    }

    fn reset(&self) {
        let _slot = self.config.write().unwrap_or_else(PoisonError::into_inner);
        self.calls.store(0, Ordering::SeqCst);
        self.fault_seq.store(0, Ordering::SeqCst);
        self.recorded
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }

    /// Counts a model call: its number `n`, its fault position `k`, and the config it runs with.
    fn begin_call(&self) -> (u64, u64, Arc<MockConfig>) {
        let slot = self.config.read().unwrap_or_else(PoisonError::into_inner);
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        let k = self.fault_seq.fetch_add(1, Ordering::SeqCst) + 1;
        (n, k, slot.clone())
    }

    fn record(&self, call: RawCall) {
        let mut recorded = self.recorded.lock().unwrap_or_else(PoisonError::into_inner);
        if recorded.len() >= RECORDED_MAX {
            recorded.pop_front();
        }
        recorded.push_back(call);
    }

    fn recorded(&self) -> Vec<RecordedCall> {
        let raw: Vec<RawCall> = self
            .recorded
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .cloned()
            .collect();
        raw.into_iter().map(RawCall::into_recorded).collect()
    }
}

/// A call as stored on the hot path: three flat allocations, turned into a [`RecordedCall`]
/// only when someone reads the recording.
///
/// Nothing here may borrow from the request (its `Uri`, `HeaderMap` and body `Bytes` point into
/// hyper's connection read buffer; keeping 1000 of them alive would pin 1000 such buffers and
/// make hyper allocate a fresh one for almost every request).
#[derive(Clone)]
struct RawCall {
    n: u64,
    at_ms: i64,
    path: String,
    /// `name \0 value \0` for each header, in arrival order.
    headers: Vec<u8>,
    body: Box<[u8]>,
}

impl RawCall {
    fn new(n: u64, uri: &Uri, headers: &HeaderMap, body: &[u8]) -> RawCall {
        let size = headers
            .iter()
            .map(|(k, v)| k.as_str().len() + v.len() + 2)
            .sum();
        let mut flat = Vec::with_capacity(size);
        for (name, value) in headers {
            flat.extend_from_slice(name.as_str().as_bytes());
            flat.push(0);
            flat.extend_from_slice(value.as_bytes());
            flat.push(0);
        }
        // The mock stands alone (the dependency rule in lib.rs): its own clock, in the Unix
        // milliseconds request records use.
        let at_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        RawCall {
            n,
            at_ms,
            path: uri
                .path_and_query()
                .map_or_else(|| uri.path().to_owned(), |pq| pq.as_str().to_owned()),
            headers: flat,
            body: body.into(),
        }
    }

    fn into_recorded(self) -> RecordedCall {
        let mut fields = self.headers.split(|b| *b == 0);
        let mut headers = Vec::new();
        while let (Some(name), Some(value)) = (fields.next(), fields.next()) {
            headers.push((
                String::from_utf8_lossy(name).into_owned(),
                String::from_utf8_lossy(value).into_owned(),
            ));
        }
        RecordedCall {
            path: self.path,
            headers,
            body: serde_json::from_slice(&self.body).unwrap_or(Value::Null),
            n: self.n,
            at_ms: self.at_ms,
        }
    }
}

// ---- accept loop ----

/// Per-connection kill switch, found in every request's extensions. Firing it makes the
/// connection task drop the connection, closing the socket with no further bytes.
#[derive(Clone)]
struct ConnKill(Arc<Notify>);

async fn accept_loop(listener: TcpListener, app: Router, stop: Arc<Notify>) {
    let mut conns = JoinSet::new();
    let stopped = stop.notified();
    tokio::pin!(stopped);
    loop {
        tokio::select! {
            biased;
            () = &mut stopped => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => {
                    conns.spawn(serve_connection(stream, app.clone()));
                }
                Err(e) => {
                    // Per-connection failures and fd exhaustion alike: back off a moment.
                    tracing::debug!(error = %e, "mock: accept failed");
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            },
        }
    }
    // Abort every connection task (dropping its connection closes the socket) and wait for them.
    conns.shutdown().await;
}

async fn serve_connection(stream: TcpStream, app: Router) {
    let _ = stream.set_nodelay(true);
    let kill = ConnKill(Arc::new(Notify::new()));
    let svc = TowerToHyperService::new(app);
    let ext = kill.clone();
    let svc = hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
        req.extensions_mut().insert(ext.clone());
        svc.call(req)
    });
    // No header-read timeout: hyper would otherwise close idle keep-alive connections after
    // 30 s, and a client's pooled request racing that close would see a spurious error.
    let conn = hyper::server::conn::http1::Builder::new()
        .header_read_timeout(None)
        .serve_connection(TokioIo::new(stream), svc);
    tokio::select! {
        res = conn => {
            if let Err(e) = res {
                tracing::trace!(error = %e, "mock: connection ended with an error");
            }
        }
        () = kill.0.notified() => {
            // Dropping `conn` here drops the socket: the client gets EOF and no response.
        }
    }
}

// ---- routes ----

/// The model routes, all under `/v1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Chat,
    Completions,
    Embeddings,
    Responses,
    Messages,
    GeminiGenerate,
    GeminiStream,
}

/// Whose shapes (error body, request-id header) a route speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Provider {
    OpenAi,
    Anthropic,
    Gemini,
}

impl Route {
    fn provider(self) -> Provider {
        match self {
            Route::Chat | Route::Completions | Route::Embeddings | Route::Responses => {
                Provider::OpenAi
            }
            Route::Messages => Provider::Anthropic,
            Route::GeminiGenerate | Route::GeminiStream => Provider::Gemini,
        }
    }
}

impl Provider {
    /// Google documents no request-id header; the mock sends none for Gemini.
    fn request_id_header(self) -> Option<HeaderName> {
        match self {
            Provider::OpenAi => Some(HeaderName::from_static("x-request-id")),
            Provider::Anthropic => Some(HeaderName::from_static("request-id")),
            Provider::Gemini => None,
        }
    }

    fn error_body(self, status: StatusCode, message: &str) -> Value {
        match self {
            Provider::OpenAi => openai::error_body(status.as_u16(), message),
            Provider::Anthropic => anthropic::error_body(status.as_u16(), message),
            Provider::Gemini => gemini::error_body(status.as_u16(), message),
        }
    }
}

fn router(shared: Arc<Shared>) -> Router {
    let model = |route: Route| post(model_call).layer(Extension(route));
    Router::new()
        .route("/v1/chat/completions", model(Route::Chat))
        .route("/v1/completions", model(Route::Completions))
        .route("/v1/embeddings", model(Route::Embeddings))
        .route("/v1/responses", model(Route::Responses))
        .route("/v1/messages", model(Route::Messages))
        .route("/v1beta/models/{call}", post(gemini_call).get(get_model))
        .route("/v1/models/{call}", post(gemini_call).get(get_model))
        .route("/v1beta/models", get(list_models))
        .route("/v1/models", get(list_models))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .route(
            "/v1/responses/{id}",
            get(unknown_response).delete(unknown_response),
        )
        .route("/v1/responses/{id}/input_items", get(unknown_response))
        .route("/v1/responses/{id}/cancel", post(unknown_response))
        .route("/_mock/calls", get(control_calls))
        .route("/_mock/recorded", get(control_recorded))
        .route(
            "/_mock/config",
            get(control_get_config)
                .put(control_put_config)
                .patch(control_patch_config),
        )
        .route("/_mock/reset", post(control_reset))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(shared)
}

/// Why a model call's body is refused with 400.
#[derive(Debug, thiserror::Error)]
enum BadRequest {
    #[error("mock: request body is not valid JSON: {0}")]
    NotJson(serde_json::Error),
    #[error("mock: request body must be a JSON object")]
    NotObject,
    #[error("mock: {0}")]
    Invalid(String),
}

/// What the answer needs from the body.
struct CallInfo {
    model: String,
    stream: bool,
    include_usage: bool,
    seed: text::Seed,
    embeddings: Option<openai::EmbeddingsAsk>,
}

/// Parses the body into what the answer needs.
fn read_call(route: Route, body: &[u8]) -> Result<CallInfo, BadRequest> {
    let value: Value = serde_json::from_slice(body).map_err(BadRequest::NotJson)?;
    if !value.is_object() {
        return Err(BadRequest::NotObject);
    }
    let embeddings = match route {
        Route::Embeddings => Some(openai::embeddings_ask(&value).map_err(BadRequest::Invalid)?),
        _ => None,
    };
    let info = CallInfo {
        model: value
            .get("model")
            .and_then(Value::as_str)
            .unwrap_or("mock-model")
            .to_owned(),
        stream: match route {
            Route::Embeddings | Route::GeminiGenerate => false,
            Route::GeminiStream => true,
            Route::Chat | Route::Completions | Route::Responses | Route::Messages => {
                value.get("stream") == Some(&Value::Bool(true))
            }
        },
        include_usage: value.pointer("/stream_options/include_usage") == Some(&Value::Bool(true)),
        seed: text::seed_of(&value),
        embeddings,
    };
    Ok(info)
}

/// `POST /{version}/models/{model}:{method}`: Gemini's model calls (`generateContent`,
/// `streamGenerateContent`, the stream chosen by the path), `countTokens`, `embedContent` and
/// `batchEmbedContents`.
async fn gemini_call(
    State(shared): State<Arc<Shared>>,
    Path(call): Path<String>,
    Extension(kill): Extension<ConnKill>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let (model, method) = call.rsplit_once(':').unwrap_or((call.as_str(), ""));
    let route = match method {
        "generateContent" => Route::GeminiGenerate,
        "streamGenerateContent" => Route::GeminiStream,
        "countTokens" => {
            shared.record_other(RawCall::new(0, &uri, &headers, &body));
            return match serde_json::from_slice::<Value>(&body) {
                Ok(value) => axum::Json(gemini::count_json(text::seed_of(&value).prompt_tokens))
                    .into_response(),
                Err(e) => error_response(
                    Provider::Gemini,
                    StatusCode::BAD_REQUEST,
                    &format!("mock: body is not JSON: {e}"),
                    0,
                ),
            };
        }
        "embedContent" | "batchEmbedContents" => {
            shared.record_other(RawCall::new(0, &uri, &headers, &body));
            return match serde_json::from_slice::<Value>(&body) {
                Ok(value) => axum::Json(gemini::embed_json(method, &value)).into_response(),
                Err(e) => error_response(
                    Provider::Gemini,
                    StatusCode::BAD_REQUEST,
                    &format!("mock: body is not JSON: {e}"),
                    0,
                ),
            };
        }
        _ => return not_found(Method::POST, uri).await,
    };
    let info = read_call(route, &body).map(|mut info| {
        model.clone_into(&mut info.model);
        info
    });
    model_call_as(&shared, route, info, kill, uri, headers, body).await
}

/// `POST /v1/...`: record, apply connection faults, then answer in the route's shape.
async fn model_call(
    State(shared): State<Arc<Shared>>,
    Extension(route): Extension<Route>,
    Extension(kill): Extension<ConnKill>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let info = read_call(route, &body);
    model_call_as(&shared, route, info, kill, uri, headers, body).await
}

/// A model call of `route` whose body was read into `info`.
async fn model_call_as(
    shared: &Shared,
    route: Route,
    info: Result<CallInfo, BadRequest>,
    kill: ConnKill,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let provider = route.provider();
    let (n, k, cfg) = shared.begin_call();
    shared.record(RawCall::new(n, &uri, &headers, &body));
    tracing::trace!(n, k, ?route, "mock: model call");

    if k <= u64::from(cfg.reset_before_headers) {
        kill.0.notify_one();
        // The connection task drops this future together with the connection.
        return std::future::pending::<Response>().await;
    }
    if let Some(ms) = cfg.hang_before_headers_ms
        && within(k, cfg.hang_first)
    {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    if cfg.header_delay_ms > 0 {
        tokio::time::sleep(Duration::from_millis(cfg.header_delay_ms)).await;
    }
    if k <= u64::from(cfg.fail_first) {
        return injected_failure(provider, &cfg, n, k);
    }
    match info {
        Ok(info) => answer(route, &cfg, n, k, info, &shared.open_streams),
        Err(e) => error_response(provider, StatusCode::BAD_REQUEST, &e.to_string(), n),
    }
}

/// Whether position `k` is inside a window of `first` calls, where 0 means every call.
fn within(k: u64, first: u32) -> bool {
    first == 0 || k <= u64::from(first)
}

fn injected_failure(provider: Provider, cfg: &MockConfig, n: u64, k: u64) -> Response {
    let status = StatusCode::from_u16(cfg.fail_status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let message = format!(
        "mock: injected failure (fail_first={}; this is call {k} since the last reset or config change)",
        cfg.fail_first
    );
    let mut body = provider.error_body(status, &message);
    if let (Provider::Gemini, Some(delay)) = (provider, &cfg.retry_delay) {
        body["error"]["details"] = json!([{
            "@type": "type.googleapis.com/google.rpc.RetryInfo",
            "retryDelay": delay,
        }]);
    }
    let mut resp = body_response(provider, status, n, json_bytes(&body));
    let headers = resp.headers_mut();
    if let Some(v) = &cfg.retry_after
        && let Ok(v) = HeaderValue::from_str(v)
    {
        headers.insert(HeaderName::from_static("retry-after"), v);
    }
    if let Some(ms) = cfg.retry_after_ms {
        headers.insert(
            HeaderName::from_static("retry-after-ms"),
            HeaderValue::from(ms),
        );
    }
    resp
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The successful answer (possibly a faulty stream, non-JSON, or oversized, as configured).
fn answer(
    route: Route,
    cfg: &MockConfig,
    n: u64,
    k: u64,
    info: CallInfo,
    open_streams: &Arc<AtomicU64>,
) -> Response {
    let provider = route.provider();
    if let Some(ask) = &info.embeddings {
        if cfg.non_json_200 {
            return not_json_response(provider, n);
        }
        let body = openai::embeddings_json(&info.model, ask, info.seed.prompt_tokens);
        return body_response(provider, StatusCode::OK, n, body);
    }
    let pieces = text::pieces(&info.model, info.seed.hash, cfg.chunks);
    let oa = openai::Reply {
        n,
        model: &info.model,
        created: unix_now(),
        prompt_tokens: info.seed.prompt_tokens,
        completion_tokens: u64::from(cfg.chunks),
    };
    let an = anthropic::Reply {
        n,
        model: &info.model,
        input_tokens: info.seed.prompt_tokens,
        output_tokens: u64::from(cfg.chunks),
    };
    let gm = gemini::Reply {
        n,
        model: &info.model,
        prompt_tokens: info.seed.prompt_tokens,
        candidates_tokens: u64::from(cfg.chunks),
    };
    if info.stream && !cfg.ignore_stream {
        let mut parts = match route {
            Route::Chat => openai::chat_stream(&oa, &pieces, info.include_usage),
            Route::Completions => openai::completion_stream(&oa, &pieces, info.include_usage),
            Route::Responses => openai::responses_stream(&oa, &pieces),
            Route::Messages => anthropic::message_stream(&an, &pieces),
            Route::GeminiGenerate | Route::GeminiStream => gemini::generate_stream(&gm, &pieces),
            Route::Embeddings => sse::StreamParts::default(),
        };
        if cfg.omit_stream_end {
            parts.tail.pop();
        }
        let faults = StreamFaults {
            end_after: cfg.end_after_chunks,
            chunk_delay: Duration::from_millis(cfg.chunk_delay_ms),
            drop_after: cfg.drop_after_chunks.filter(|_| within(k, cfg.drop_first)),
            stall: cfg
                .stall_after_chunks
                .map(|(after, ms)| (after, Duration::from_millis(ms))),
            malformed: cfg.malformed_sse,
        };
        let mut resp = base_response(
            provider,
            StatusCode::OK,
            n,
            "text/event-stream; charset=utf-8",
            stream_body(parts, faults, Arc::clone(open_streams)),
        );
        resp.headers_mut()
            .insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        return resp;
    }
    if cfg.non_json_200 {
        return not_json_response(provider, n);
    }
    let mut text = pieces.concat();
    if let Some(min) = cfg.oversized_bytes {
        text::pad_to(&mut text, min, info.seed.hash);
    }
    let body = match route {
        Route::Chat => openai::chat_json(&oa, &text),
        Route::Completions => openai::completion_json(&oa, &text),
        Route::Responses => openai::responses_json(&oa, &text),
        Route::Messages => anthropic::message_json(&an, &text),
        Route::GeminiGenerate | Route::GeminiStream => gemini::generate_json(&gm, &text),
        Route::Embeddings => Bytes::new(),
    };
    body_response(provider, StatusCode::OK, n, body)
}

fn base_response(
    provider: Provider,
    status: StatusCode,
    n: u64,
    content_type: &'static str,
    body: Body,
) -> Response {
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    let headers = resp.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    if let (Some(name), Ok(id)) = (
        provider.request_id_header(),
        HeaderValue::try_from(format!("req_mock_{n}")),
    ) {
        headers.insert(name, id);
    }
    resp
}

/// Serialises one of the mock's own shapes. They have string keys only, so this cannot fail.
pub(crate) fn json_bytes<T: serde::Serialize + ?Sized>(value: &T) -> Bytes {
    Bytes::from(serde_json::to_vec(value).unwrap_or_default())
}

/// A JSON answer with the provider's request-id header.
fn body_response(provider: Provider, status: StatusCode, n: u64, json: Bytes) -> Response {
    base_response(provider, status, n, "application/json", Body::from(json))
}

fn error_response(provider: Provider, status: StatusCode, message: &str, n: u64) -> Response {
    let body = json_bytes(&provider.error_body(status, message));
    body_response(provider, status, n, body)
}

fn not_json_response(provider: Provider, n: u64) -> Response {
    base_response(
        provider,
        StatusCode::OK,
        n,
        "text/plain; charset=utf-8",
        Body::from("this is not json"),
    )
}

/// Unknown path: 404 in OpenAI's shape; not counted as a call.
async fn not_found(method: Method, uri: Uri) -> Response {
    // With the query: a test sees what a pass-through sent.
    let target = uri.path_and_query().map_or(uri.path(), |p| p.as_str());
    let msg = format!("mock: no route for {method} {target}");
    let body = openai::error_body(404, &msg);
    (StatusCode::NOT_FOUND, axum::Json(body)).into_response()
}

/// The models the mock lists, in both providers' shapes.
const MOCK_MODELS: [&str; 3] = ["mock-small", "mock-large", "gpt-4o-mini"];

/// Whose shape a model-list call takes: Google's under `/v1beta` or with `x-goog-api-key`,
/// Anthropic's with `anthropic-version`, else OpenAI's.
fn models_shape(uri: &Uri, headers: &HeaderMap) -> Provider {
    if uri.path().starts_with("/v1beta") || headers.contains_key("x-goog-api-key") {
        Provider::Gemini
    } else if headers.contains_key("anthropic-version") {
        Provider::Anthropic
    } else {
        Provider::OpenAi
    }
}

/// One model's entry in `shape`'s list shape.
fn model_entry(shape: Provider, id: &str, display: &str) -> Value {
    match shape {
        Provider::Gemini => gemini::model_json(id),
        Provider::Anthropic => json!({"type": "model", "id": id, "display_name": display,
                                      "created_at": "2025-01-01T00:00:00Z"}),
        Provider::OpenAi => {
            json!({"id": id, "object": "model", "created": 1_700_000_000, "owned_by": "mock"})
        }
    }
}

/// `GET /v1/models` (and `/v1beta/models`): [`MOCK_MODELS`] in the shape [`models_shape`]
/// picks, Gemini's and Anthropic's names prefixed. Recorded with the other calls that are not
/// model calls; not counted.
async fn list_models(State(shared): State<Arc<Shared>>, uri: Uri, headers: HeaderMap) -> Response {
    shared.record_other(RawCall::new(0, &uri, &headers, b""));
    let shape = models_shape(&uri, &headers);
    let data: Vec<Value> = MOCK_MODELS
        .iter()
        .map(|id| {
            let name = match shape {
                Provider::Gemini => format!("gemini-{id}"),
                Provider::Anthropic => format!("claude-{id}"),
                Provider::OpenAi => (*id).to_string(),
            };
            model_entry(shape, &name, id)
        })
        .collect();
    let body = match shape {
        Provider::Gemini => json!({"models": data}),
        Provider::Anthropic => {
            let (first, last) = (data[0]["id"].clone(), data[data.len() - 1]["id"].clone());
            json!({"data": data, "has_more": false, "first_id": first, "last_id": last})
        }
        Provider::OpenAi => json!({"object": "list", "data": data}),
    };
    axum::Json(body).into_response()
}

/// `GET /{v1beta,v1}/models/{model}`: that model's entry in the shape of the list
/// ([`models_shape`]), whatever its name, as a model call answers any model (the list names
/// only [`MOCK_MODELS`]; google-genai's `models.get`, openai's `models.retrieve`). Gemini's
/// `models/` prefix is optional. Recorded with the other calls; not counted.
async fn get_model(
    State(shared): State<Arc<Shared>>,
    Path(model): Path<String>,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    shared.record_other(RawCall::new(0, &uri, &headers, b""));
    let id = model.strip_prefix("models/").unwrap_or(&model);
    axum::Json(model_entry(models_shape(&uri, &headers), id, id)).into_response()
}

/// `POST /v1/messages/count_tokens`: `{"input_tokens": N}`, N from the body as the mock counts
/// prompt tokens. Recorded with the other calls; not counted.
async fn count_tokens(
    State(shared): State<Arc<Shared>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    shared.record_other(RawCall::new(0, &uri, &headers, &body));
    match serde_json::from_slice::<Value>(&body) {
        Ok(value) => {
            axum::Json(json!({"input_tokens": text::seed_of(&value).prompt_tokens})).into_response()
        }
        Err(e) => error_response(
            Provider::Anthropic,
            StatusCode::BAD_REQUEST,
            &format!("mock: body is not JSON: {e}"),
            0,
        ),
    }
}

/// `GET /v1/responses/{id}` and its `/cancel`: the mock stores no responses, so 404 in OpenAI's
/// shape, as OpenAI answers for an id it does not hold. Recorded with the other calls.
async fn unknown_response(
    State(shared): State<Arc<Shared>>,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    shared.record_other(RawCall::new(0, &uri, &headers, b""));
    let message = format!("mock: no response found at {}", uri.path());
    (
        StatusCode::NOT_FOUND,
        axum::Json(openai::error_body(404, &message)),
    )
        .into_response()
}

/// Known path, wrong method: 405 in OpenAI's shape; not counted as a call.
async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    let msg = format!("mock: {method} is not allowed on {}", uri.path());
    let body = openai::error_body(405, &msg);
    (StatusCode::METHOD_NOT_ALLOWED, axum::Json(body)).into_response()
}

// ---- control API ----

/// Why a control request was refused (400, `{"error":{"message"}}`).
#[derive(Debug, thiserror::Error)]
enum ControlError {
    #[error("config is not valid JSON for MockConfig: {0}")]
    Json(#[from] serde_json::Error),
    #[error("config must be a JSON object")]
    NotObject,
    #[error("unknown config field(s): {0}")]
    UnknownFields(String),
    #[error("fail_status {0} is not an HTTP status code")]
    BadStatus(u16),
}

impl IntoResponse for ControlError {
    fn into_response(self) -> Response {
        let body = json!({"error": {"message": self.to_string()}});
        (StatusCode::BAD_REQUEST, axum::Json(body)).into_response()
    }
}

/// Overlays the JSON object `patch` on `base` and validates the result. Unknown field names are
/// refused, so a typo does not silently leave a fault off.
fn config_from_json(base: &MockConfig, patch: &[u8]) -> Result<MockConfig, ControlError> {
    let patch: Value = serde_json::from_slice(patch)?;
    let Value::Object(patch) = patch else {
        return Err(ControlError::NotObject);
    };
    let Value::Object(mut merged) = serde_json::to_value(base)? else {
        return Err(ControlError::NotObject);
    };
    let unknown: Vec<&str> = patch
        .keys()
        .filter(|key| !merged.contains_key(key.as_str()))
        .map(String::as_str)
        .collect();
    if !unknown.is_empty() {
        return Err(ControlError::UnknownFields(unknown.join(", ")));
    }
    merged.extend(patch);
    let config: MockConfig = serde_json::from_value(Value::Object(merged))?;
    if StatusCode::from_u16(config.fail_status).is_err() {
        return Err(ControlError::BadStatus(config.fail_status));
    }
    Ok(config)
}

/// `GET /_mock/calls` → `{"calls": n}`.
async fn control_calls(State(shared): State<Arc<Shared>>) -> Response {
    axum::Json(json!({"calls": shared.calls.load(Ordering::SeqCst)})).into_response()
}

/// `GET /_mock/recorded` → array of [`RecordedCall`], oldest first.
async fn control_recorded(State(shared): State<Arc<Shared>>) -> Response {
    axum::Json(shared.recorded()).into_response()
}

/// `GET /_mock/config` → the current [`MockConfig`].
async fn control_get_config(State(shared): State<Arc<Shared>>) -> Response {
    let config = shared.config();
    axum::Json(&*config).into_response()
}

/// `PUT /_mock/config`: the body is a whole config; missing fields take their defaults. Answers
/// the config now in force. Restarts the fault windows.
async fn control_put_config(
    State(shared): State<Arc<Shared>>,
    body: Bytes,
) -> Result<Response, ControlError> {
    let config = config_from_json(&MockConfig::default(), &body)?;
    shared.set_config(config.clone());
    Ok(axum::Json(config).into_response())
}

/// `PATCH /_mock/config`: the body's fields replace those of the current config; the others
/// stay. Answers the config now in force. Restarts the fault windows.
async fn control_patch_config(
    State(shared): State<Arc<Shared>>,
    body: Bytes,
) -> Result<Response, ControlError> {
    let config = config_from_json(&shared.config(), &body)?;
    shared.set_config(config.clone());
    Ok(axum::Json(config).into_response())
}

/// `POST /_mock/reset` → `{"calls": 0}`: counter, recording and fault windows reset.
async fn control_reset(State(shared): State<Arc<Shared>>) -> Response {
    shared.reset();
    axum::Json(json!({"calls": 0})).into_response()
}
