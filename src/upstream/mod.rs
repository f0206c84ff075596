//! Provider clients: one HTTP client for every backend, provider auth, forwarded headers and the
//! three separate timeouts of SPEC LC-10 (connect, time to headers, idle gap in the body).
//!
//! A call sends the stored body bytes exactly as recorded (ID-3b). Client auth headers are never
//! forwarded; the backend's own key is used (ID-3a, IN-3).
//!
//! Two clients, one per way a backend is reached (decision 132). A backend reached directly is
//! called through hyper's pooled client (hyper-util's, with rustls), as the bench's floor
//! proxy calls its upstream: reqwest's layers around the same client parsed every call's URL
//! twice more and cost about a tenth of a non-stream request's instructions on the tokio
//! workers (issue 30). A backend that the environment routes through an HTTP proxy
//! (`HTTPS_PROXY`, `HTTP_PROXY`, `ALL_PROXY`, `NO_PROXY`, decided once at start) is called
//! through reqwest, which speaks to proxies. Both answer as one [`Response`].
//!
//! What reqwest did for every call, the direct client does too: one connect timeout over DNS,
//! TCP and TLS; TCP keep-alive and a user timeout on the socket; credentials in a `base_url`
//! sent as Basic auth and never printed; a call an HTTP/2 provider refused before processing
//! it (`REFUSED_STREAM`, a graceful `GOAWAY`) sent again, at most twice.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue};
use http::{Method, StatusCode, Uri};
use http_body_util::{BodyExt, Full};
use hyper_rustls::{HttpsConnector, MaybeHttpsStream};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::proxy::matcher::Matcher;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::time::{Instant, Sleep};

use crate::config::{Backend, Config};
use crate::provider::{Provider, Route};

/// One provider call: what is sent, and to which backend and route.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Call<'a> {
    /// Backend name (a `[[backends]]` entry).
    pub backend: &'a str,
    /// The route: its provider and upstream path.
    pub route: Route,
    /// The body bytes, exactly as recorded (ID-3b).
    pub body: &'a [u8],
    /// Forwarded and default headers, as recorded (ID-3a).
    pub headers: &'a [(String, String)],
    /// The model as recorded: part of the URL for a route that takes it in the path (GM-1).
    pub model: Option<&'a str>,
    /// The attempt span's W3C `traceparent`, when traces are on (OT-3).
    pub traceparent: Option<&'a str>,
}

/// Why a call produced no usable HTTP response. All of these are transient (LC-5) when they
/// happen before the first chunk.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CallError {
    /// The backend named by the request is not configured (any more).
    #[error("backend {0:?} is not configured")]
    UnknownBackend(String),
    /// TCP/TLS connect failed or timed out, or the request could not be sent.
    #[error("could not reach the provider: {0}")]
    Connect(String),
    /// No response headers within `header_timeout_ms`.
    #[error("the provider sent no response headers within {0} ms")]
    HeaderTimeout(u64),
    /// The body stopped for longer than `idle_timeout_ms`.
    #[error("the provider sent nothing for {0} ms")]
    IdleTimeout(u64),
    /// The connection broke while reading the body.
    #[error("the provider connection broke: {0}")]
    Read(String),
    /// The body exceeded `max_response_bytes`.
    #[error("the provider response exceeded {0} bytes")]
    TooLarge(usize),
}

/// How long an idle connection to a provider is kept, by either client (reqwest's default).
const POOL_IDLE: Duration = Duration::from_secs(90);

/// The client of backends reached directly: hyper's pooled client over TCP or TLS.
type DirectClient = hyper_util::client::legacy::Client<Connector, Full<Bytes>>;

/// An error as the body of a forwarded answer carries it.
pub(crate) type BodyError = Box<dyn std::error::Error + Send + Sync>;

/// The direct client's connector: TCP or TLS, with one timeout over the whole connect (DNS,
/// TCP and the TLS handshake), as reqwest's `connect_timeout` was.
#[derive(Clone)]
struct Connector {
    inner: HttpsConnector<HttpConnector>,
    timeout: Duration,
}

impl tower::Service<Uri> for Connector {
    type Response = MaybeHttpsStream<TokioIo<tokio::net::TcpStream>>;
    type Error = BodyError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BodyError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BodyError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let connecting = self.inner.call(uri);
        let timeout = self.timeout;
        Box::pin(async move {
            match tokio::time::timeout(timeout, connecting).await {
                Ok(connected) => connected,
                Err(_) => Err(format!("connect timed out after {} ms", timeout.as_millis()).into()),
            }
        })
    }
}

/// Provider HTTP clients and keys for every configured backend.
#[derive(Clone)]
pub(crate) struct Upstreams {
    /// Backends reached directly (decision 132).
    direct: DirectClient,
    /// Backends the environment routes through a proxy (decision 132).
    proxied: reqwest::Client,
    /// Per backend name.
    backends: HashMap<String, Target>,
    header_timeout: Duration,
    idle_timeout: Duration,
    max_response_bytes: usize,
}

/// One backend as calls need it.
#[derive(Debug, Clone)]
struct Target {
    backend: Backend,
    /// The key header and its value, if the backend has a key.
    key: Option<(HeaderName, HeaderValue)>,
    /// The provider URL of every route whose path has no model in it, parsed once (parsing per
    /// call showed in profiles).
    urls: Vec<(Route, Uri)>,
    /// Whether the environment routes this backend's calls through a proxy (decision 132).
    through_proxy: bool,
    /// Basic auth from the user information of the `base_url`, which its URLs no longer hold.
    basic_auth: Option<HeaderValue>,
}

impl std::fmt::Debug for Upstreams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Backend names only: a `base_url` may hold credentials.
        f.debug_struct("Upstreams")
            .field("backends", &self.backends.keys().collect::<Vec<_>>())
            .field("header_timeout", &self.header_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .field("max_response_bytes", &self.max_response_bytes)
            .finish_non_exhaustive()
    }
}

/// A provider URL as a call sends it, without user information (a `base_url`'s credentials
/// go as [`basic_auth_of`]): parsed as a URL first, which normalises it as reqwest did
/// (percent-encoding, an IDN host), then as the request's URI. An error names the URL only
/// once its credentials are gone.
fn provider_uri(url: &str) -> Result<Uri, String> {
    let mut url = reqwest::Url::parse(url).map_err(|e| format!("is not a URL ({e})"))?;
    let _ = url.set_username("");
    let _ = url.set_password(None);
    url.as_str()
        .parse::<Uri>()
        .map_err(|e| format!("{url}: {e}"))
}

/// The `Authorization` a URL's user information asks for (`https://user:pass@host/...`), as
/// reqwest sent it: Basic, with the name and password percent-decoded, marked sensitive.
fn basic_auth_of(url: &str) -> Option<HeaderValue> {
    use base64::Engine;
    let url = reqwest::Url::parse(url).ok()?;
    if url.username().is_empty() && url.password().is_none() {
        return None;
    }
    // The bytes as escaped, UTF-8 or not: what the provider compares is the pair's bytes.
    let mut pair: Vec<u8> = percent_encoding::percent_decode_str(url.username()).collect();
    pair.push(b':');
    pair.extend(percent_encoding::percent_decode_str(
        url.password().unwrap_or_default(),
    ));
    let encoded = base64::engine::general_purpose::STANDARD.encode(pair);
    let mut value = HeaderValue::from_str(&format!("Basic {encoded}")).ok()?;
    value.set_sensitive(true);
    Some(value)
}

/// The client of backends reached directly, from `builder`: one timeout over the whole
/// connect, no Nagle delay, TCP keep-alive (15 s, probes every 15 s, 3 of them) and a 30 s
/// user timeout as reqwest set them, HTTP/2 where the provider's TLS offers it, idle
/// connections kept 90 s, the web PKI's roots with the ring provider (as reqwest's
/// `rustls-tls` had them).
fn direct_client(
    builder: &hyper_util::client::legacy::Builder,
    connect_timeout: Duration,
) -> anyhow::Result<DirectClient> {
    let mut tcp = HttpConnector::new();
    // Shared out among a host's addresses, so that one that drops packets leaves time for the
    // next; the connector's own timeout bounds the whole connect.
    tcp.set_connect_timeout(Some(connect_timeout));
    tcp.set_nodelay(true);
    tcp.set_keepalive(Some(Duration::from_secs(15)));
    tcp.set_keepalive_interval(Some(Duration::from_secs(15)));
    tcp.set_keepalive_retries(Some(3));
    #[cfg(any(target_os = "android", target_os = "fuchsia", target_os = "linux"))]
    tcp.set_tcp_user_timeout(Some(Duration::from_secs(30)));
    tcp.enforce_http(false);
    let inner = hyper_rustls::HttpsConnectorBuilder::new()
        .with_provider_and_webpki_roots(rustls::crypto::ring::default_provider())?
        .https_or_http()
        .enable_http1()
        .enable_http2()
        .wrap_connector(tcp);
    let mut builder = builder.clone();
    builder
        .pool_idle_timeout(POOL_IDLE)
        .pool_timer(TokioTimer::new());
    Ok(builder.build(Connector {
        inner,
        timeout: connect_timeout,
    }))
}

/// Whether a failed call was refused by an HTTP/2 provider before it processed it, so that
/// sending it again cannot run it twice: a stream reset with `REFUSED_STREAM`, or a graceful
/// `GOAWAY` (RFC 9113, 8.7). reqwest sent these again on its own, at most twice.
fn refused_unprocessed(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut source = Some(error);
    while let Some(e) = source {
        if let Some(h2) = e.downcast_ref::<h2::Error>() {
            return h2.is_remote()
                && ((h2.is_go_away() && h2.reason() == Some(h2::Reason::NO_ERROR))
                    || (h2.is_reset() && h2.reason() == Some(h2::Reason::REFUSED_STREAM)));
        }
        source = e.source();
    }
    false
}

impl Upstreams {
    /// Builds the client and reads each backend's key from the environment variable its
    /// `api_key_env` names. A missing variable means no key is sent (useful for local servers).
    ///
    /// # Errors
    /// When the HTTP client cannot be built, a `base_url` is not a URL or a key is not a valid
    /// header value.
    pub(crate) fn new(config: &Config) -> anyhow::Result<Upstreams> {
        // The proxies the environment names, as reqwest itself reads them for its client.
        Upstreams::with_clients(
            config,
            &Matcher::from_system(),
            reqwest::Client::builder(),
            &hyper_util::client::legacy::Client::builder(TokioExecutor::new()),
        )
    }

    /// [`Upstreams::new`] with the proxies and the clients' builders given: `proxies` says
    /// which backends go through one, `proxied` builds the reqwest client that reaches them,
    /// `direct` the client of the others.
    fn with_clients(
        config: &Config,
        proxies: &Matcher,
        proxied: reqwest::ClientBuilder,
        direct: &hyper_util::client::legacy::Builder,
    ) -> anyhow::Result<Upstreams> {
        let connect_timeout = Duration::from_millis(config.upstream.connect_timeout_ms);
        let proxied = proxied
            .connect_timeout(connect_timeout)
            .pool_idle_timeout(POOL_IDLE)
            .tcp_nodelay(true)
            // A redirect would turn the POST into a body-less GET; a 3xx fails the attempt
            // as `upstream_invalid` instead, which names the problem (the direct client
            // follows none either).
            .redirect(reqwest::redirect::Policy::none())
            .build()?;
        let mut backends = HashMap::new();
        for b in &config.backends {
            let key = match b.api_key_env.as_deref().map(|v| (v, std::env::var(v))) {
                Some((variable, Ok(key))) if !key.is_empty() => {
                    let (name, value) = b.kind.auth_header(&key);
                    let mut value = HeaderValue::from_str(&value).map_err(|_| {
                        anyhow::anyhow!(
                            "backends.{}: the key in ${variable} is not a valid header value",
                            b.name
                        )
                    })?;
                    value.set_sensitive(true);
                    Some((HeaderName::from_static(name), value))
                }
                Some((variable, _)) => {
                    // Allowed (a local server needs no key), but a provider answers 401 to
                    // every call: said once here rather than first by the provider.
                    tracing::warn!(
                        backend = %b.name,
                        %variable,
                        "${variable} is not set or empty: backend {} sends no key upstream",
                        b.name
                    );
                    None
                }
                None => None,
            };
            let urls = Route::ALL
                .into_iter()
                .filter(|route| !route.model_in_path())
                .map(|route| {
                    let url = format!(
                        "{}{}",
                        b.base_url.trim_end_matches('/'),
                        route.upstream_path(None)
                    );
                    provider_uri(&url)
                        .map(|uri| (route, uri))
                        .map_err(|e| anyhow::anyhow!("backends.{}: base_url {e}", b.name))
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            let base = provider_uri(&b.base_url)
                .map_err(|e| anyhow::anyhow!("backends.{}: base_url {e}", b.name))?;
            let through_proxy = proxies.intercept(&base).is_some();
            if through_proxy {
                tracing::info!(backend = %b.name, "calls go through the proxy the environment names");
            }
            backends.insert(
                b.name.clone(),
                Target {
                    backend: b.clone(),
                    key,
                    urls,
                    through_proxy,
                    basic_auth: basic_auth_of(&b.base_url),
                },
            );
        }
        Ok(Upstreams {
            direct: direct_client(direct, connect_timeout)?,
            proxied,
            backends,
            header_timeout: Duration::from_millis(config.upstream.header_timeout_ms),
            idle_timeout: Duration::from_millis(config.upstream.idle_timeout_ms),
            max_response_bytes: config.max_response_bytes,
        })
    }

    /// Sends the request and waits for the response headers (at most `header_timeout_ms`).
    ///
    /// # Errors
    /// [`CallError`] when no response headers arrived.
    pub(crate) async fn send(&self, call: &Call<'_>) -> Result<Response, CallError> {
        let target = self
            .backends
            .get(call.backend)
            .ok_or_else(|| CallError::UnknownBackend(call.backend.to_string()))?;
        let Target {
            backend, key, urls, ..
        } = target;
        let route = call.route;
        let uri = if route.model_in_path() {
            let url = format!(
                "{}{}",
                backend.base_url.trim_end_matches('/'),
                route.upstream_path(call.model)
            );
            provider_uri(&url).map_err(CallError::Connect)?
        } else {
            urls.iter()
                .find(|(r, _)| *r == route)
                .map(|(_, uri)| uri.clone())
                .ok_or_else(|| CallError::UnknownBackend(call.backend.to_string()))?
        };
        let request = || {
            let mut headers = HeaderMap::new();
            headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            for (name, value) in call.headers {
                if let (Ok(name), Ok(value)) = (
                    HeaderName::from_bytes(name.as_bytes()),
                    HeaderValue::from_str(value),
                ) {
                    headers.insert(name, value);
                }
            }
            if let Some((name, value)) = key {
                headers.insert(name.clone(), value.clone());
            }
            if let Some(traceparent) = call.traceparent.and_then(|v| HeaderValue::from_str(v).ok())
            {
                headers.insert("traceparent", traceparent);
            }
            // Defaults the client did not send (already in `call.headers` for requests
            // admitted by this version, which hashes them; kept for records admitted before).
            for (name, value) in backend.kind.default_headers() {
                if !headers.contains_key(*name) {
                    headers.insert(*name, HeaderValue::from_static(value));
                }
            }
            (headers, Bytes::copy_from_slice(call.body))
        };
        self.call(target, Method::POST, uri, request).await
    }

    /// Sends one request to `target` through the client that reaches it and waits for the
    /// response headers, at most `header_timeout_ms`. `request` gives the headers and body of
    /// each try: built again for a call sent again, not copied for every call in case.
    async fn call(
        &self,
        target: &Target,
        method: Method,
        uri: Uri,
        request: impl Fn() -> (HeaderMap, Bytes),
    ) -> Result<Response, CallError> {
        let request = || {
            let (mut headers, body) = request();
            // What reqwest sent by default, kept for providers that look at it.
            if !headers.contains_key(ACCEPT) {
                headers.insert(ACCEPT, HeaderValue::from_static("*/*"));
            }
            // The backend's own key, when it is an `authorization` header, wins (as with
            // reqwest).
            if let Some(auth) = &target.basic_auth
                && !headers.contains_key(AUTHORIZATION)
            {
                headers.insert(AUTHORIZATION, auth.clone());
            }
            (headers, body)
        };
        let sent = async {
            if target.through_proxy {
                let (headers, body) = request();
                return self
                    .proxied
                    .request(method, uri.to_string())
                    .headers(headers)
                    .body(body)
                    .send()
                    .await
                    .map(|r| Response(Answer::Proxied(r)))
                    .map_err(|e| CallError::Connect(error_chain(&e)));
            }
            // Bounded: a refused call is sent again at most twice.
            let mut refused = 0;
            loop {
                let (headers, body) = request();
                let mut sent = http::Request::new(Full::new(body));
                *sent.method_mut() = method.clone();
                *sent.uri_mut() = uri.clone();
                *sent.headers_mut() = headers;
                match self.direct.request(sent).await {
                    Ok(r) => return Ok(Response(Answer::Direct(r))),
                    Err(e) if refused < 2 && refused_unprocessed(&e) => refused += 1,
                    Err(e) => {
                        return Err(CallError::Connect(format!("{uri}: {}", error_chain(&e))));
                    }
                }
            }
        };
        match tokio::time::timeout(self.header_timeout, sent).await {
            Err(_) => Err(CallError::HeaderTimeout(
                self.header_timeout.as_millis() as u64
            )),
            Ok(result) => result,
        }
    }

    /// Forwards a call that is not logged (models, token counting, configured pass-through
    /// paths, retrieval of answers holdfast does not hold) to `backend`: `path_and_query` is
    /// appended to its `base_url` (so it starts after the version prefix, e.g. `/models`),
    /// `headers` are the client's allowed ones; the backend's key and default headers are
    /// added, the client's credentials never reach the provider. Waits for the response
    /// headers at most `header_timeout_ms`.
    ///
    /// # Errors
    /// [`CallError`] when the backend is unknown or no response headers arrived.
    pub(crate) async fn forward(
        &self,
        backend: &str,
        method: Method,
        path_and_query: &str,
        mut headers: HeaderMap,
        body: Bytes,
    ) -> Result<Response, CallError> {
        let target = self
            .backends
            .get(backend)
            .ok_or_else(|| CallError::UnknownBackend(backend.to_string()))?;
        let Target {
            backend: config,
            key,
            ..
        } = target;
        let url = format!("{}{path_and_query}", config.base_url.trim_end_matches('/'));
        let uri = provider_uri(&url).map_err(CallError::Connect)?;
        // The client's credentials, for any provider, never reach the backend.
        for provider in Provider::ALL {
            headers.remove(provider.credential_header());
        }
        for name in ["cookie", "host"] {
            headers.remove(name);
        }
        if let Some((name, value)) = key {
            headers.insert(name.clone(), value.clone());
        }
        for (name, value) in config.kind.default_headers() {
            if !headers.contains_key(*name) {
                headers.insert(*name, HeaderValue::from_static(value));
            }
        }
        self.call(target, method, uri, || (headers.clone(), body.clone()))
            .await
    }

    /// Reads `response`'s body piece by piece, each read waiting at most `idle_timeout_ms`
    /// (LC-10).
    pub(crate) fn pieces<'r>(&self, response: &'r mut Response) -> Pieces<'r> {
        Pieces {
            response,
            idle_for: self.idle_timeout,
            idle: Box::pin(tokio::time::sleep(self.idle_timeout)),
        }
    }

    /// Reads a whole (non-stream) body, bounded by `max_response_bytes`.
    ///
    /// # Errors
    /// [`CallError`] on timeout, a broken connection or an oversized body.
    pub(crate) async fn read_body(&self, response: &mut Response) -> Result<Vec<u8>, CallError> {
        let mut body = Vec::new();
        let mut pieces = self.pieces(response);
        while let Some(piece) = pieces.next().await? {
            if body.len() + piece.len() > self.max_response_bytes {
                return Err(CallError::TooLarge(self.max_response_bytes));
            }
            body.extend_from_slice(&piece);
        }
        Ok(body)
    }
}

impl Upstreams {
    /// Reads what a body holds, up to `max_response_bytes`, for a record that keeps an answer
    /// that could not be used: whatever arrived before the end, a failure or the cap. The flag
    /// says whether the body was cut short (by the cap or a failure).
    pub(crate) async fn read_capped(&self, response: &mut Response) -> (Vec<u8>, bool) {
        let mut body = Vec::new();
        let mut pieces = self.pieces(response);
        loop {
            match pieces.next().await {
                Ok(Some(piece)) => {
                    let room = self.max_response_bytes.saturating_sub(body.len());
                    body.extend_from_slice(&piece[..piece.len().min(room)]);
                    if piece.len() > room {
                        return (body, true);
                    }
                }
                Ok(None) => return (body, false),
                Err(_) => return (body, true),
            }
        }
    }
}

/// A provider response's body read piece by piece ([`Upstreams::pieces`]). Every read waits at
/// most the idle timeout, counted from the read's start (LC-10: per gap, not a deadline). One
/// timer serves every read, and is not moved at each: when it fires before the read's deadline
/// it is set to it. A timeout per read registered and removed a timer for every stream event,
/// and a timer moved at each read cost a reset per read, about two per event (issue 30).
pub(crate) struct Pieces<'r> {
    response: &'r mut Response,
    idle_for: Duration,
    idle: Pin<Box<Sleep>>,
}

impl Pieces<'_> {
    /// The next piece of the body; `None` at its end.
    ///
    /// # Errors
    /// [`CallError::IdleTimeout`] or [`CallError::Read`].
    pub(crate) async fn next(&mut self) -> Result<Option<Bytes>, CallError> {
        let due = Instant::now() + self.idle_for;
        loop {
            tokio::select! {
                // A piece that is there wins over a deadline that passed meanwhile.
                biased;
                piece = self.response.chunk() => return piece.map_err(CallError::Read),
                () = self.idle.as_mut() => {
                    if Instant::now() >= due {
                        return Err(CallError::IdleTimeout(self.idle_for.as_millis() as u64));
                    }
                    // Set at an earlier read: this one's deadline is later.
                    self.idle.as_mut().reset(due);
                }
            }
        }
    }
}

/// A provider's answer: its status and headers, and its body read piece by piece.
pub(crate) struct Response(Answer);

/// The answer as the client that got it holds it (decision 132).
enum Answer {
    Direct(http::Response<hyper::body::Incoming>),
    Proxied(reqwest::Response),
}

impl Response {
    /// The answer's HTTP status.
    pub(crate) fn status(&self) -> StatusCode {
        match &self.0 {
            Answer::Direct(r) => r.status(),
            Answer::Proxied(r) => r.status(),
        }
    }

    /// The answer's headers.
    pub(crate) fn headers(&self) -> &HeaderMap {
        match &self.0 {
            Answer::Direct(r) => r.headers(),
            Answer::Proxied(r) => r.headers(),
        }
    }

    /// The body's next piece of data; `None` at its end (trailers are skipped).
    async fn chunk(&mut self) -> Result<Option<Bytes>, String> {
        match &mut self.0 {
            Answer::Direct(r) => loop {
                match r.body_mut().frame().await {
                    None => return Ok(None),
                    Some(Err(e)) => return Err(error_chain(&e)),
                    Some(Ok(frame)) => {
                        if let Ok(data) = frame.into_data() {
                            return Ok(Some(data));
                        }
                    }
                }
            },
            Answer::Proxied(r) => r.chunk().await.map_err(|e| error_chain(&e)),
        }
    }

    /// The body, for an answer forwarded to the client as it comes.
    pub(crate) fn into_body(self) -> http_body_util::combinators::UnsyncBoxBody<Bytes, BodyError> {
        match self.0 {
            Answer::Direct(r) => r.into_body().map_err(BodyError::from).boxed_unsync(),
            Answer::Proxied(r) => reqwest::Body::from(r)
                .map_err(BodyError::from)
                .boxed_unsync(),
        }
    }
}

/// An error and its sources, joined: a client's top-level message alone says little.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;
    use crate::config::Backend;

    /// A listener on a free loopback port, and the port.
    async fn listening() -> (TcpListener, u16) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("address").port();
        (listener, port)
    }

    /// A server that answers one HTTP/1.1 request with `200` and `body`, and reports the
    /// request's head as it arrived.
    async fn answers_once(body: &'static str) -> (u16, tokio::task::JoinHandle<String>) {
        let (listener, port) = listening().await;
        let served = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.expect("accept");
            let mut read = Vec::new();
            let mut buf = [0u8; 4096];
            // Bounded: the head and a short body arrive in a few reads.
            for _ in 0..64 {
                let n = socket.read(&mut buf).await.expect("read");
                read.extend_from_slice(&buf[..n]);
                let text = String::from_utf8_lossy(&read);
                if let Some(end) = text.find("\r\n\r\n") {
                    let length = text[..end]
                        .lines()
                        .find_map(|l| {
                            let l = l.to_ascii_lowercase();
                            let v = l.strip_prefix("content-length:")?;
                            v.trim().parse::<usize>().ok()
                        })
                        .unwrap_or(0);
                    if read.len() >= end + 4 + length {
                        break;
                    }
                }
                if n == 0 {
                    break;
                }
            }
            let answer = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
                 connection: close\r\n\r\n{body}",
                body.len()
            );
            socket.write_all(answer.as_bytes()).await.expect("write");
            let text = String::from_utf8_lossy(&read).into_owned();
            text[..text.find("\r\n\r\n").unwrap_or(text.len())].to_string()
        });
        (port, served)
    }

    fn backend(name: &str, base_url: String) -> Backend {
        Backend {
            name: name.into(),
            kind: Provider::Openai,
            base_url,
            api_key_env: None,
        }
    }

    fn config(backends: Vec<Backend>) -> Config {
        Config {
            backends,
            ..Config::default()
        }
    }

    fn call(backend: &str) -> Call<'_> {
        Call {
            backend,
            route: Route::OpenaiChat,
            body: br#"{"model":"m"}"#,
            headers: &[],
            model: Some("m"),
            traceparent: None,
        }
    }

    fn direct_builder() -> hyper_util::client::legacy::Builder {
        hyper_util::client::legacy::Client::builder(TokioExecutor::new())
    }

    /// Upstreams with no proxy, and `direct` as the direct client's builder.
    fn upstreams(config: &Config, direct: &hyper_util::client::legacy::Builder) -> Upstreams {
        Upstreams::with_clients(
            config,
            &Matcher::builder().build(),
            reqwest::Client::builder().no_proxy(),
            direct,
        )
        .expect("upstreams")
    }

    fn content_type(response: &Response) -> &str {
        response
            .headers()
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }

    /// Decision 132: a backend the environment's proxy settings route through a proxy is
    /// called through it (reqwest's client); a backend they exclude is called directly
    /// (hyper's), not through reqwest, whose client here would send everything to the proxy.
    /// Both answers read the same way.
    #[tokio::test]
    async fn a_backend_routed_through_a_proxy_is_called_through_it_and_another_directly() {
        let (upstream, upstream_saw) = answers_once(r#"{"from":"provider"}"#).await;
        let (proxy, proxy_saw) = answers_once(r#"{"from":"proxy"}"#).await;
        let proxy_url = format!("http://127.0.0.1:{proxy}");
        let config = config(vec![
            backend("direct", format!("http://127.0.0.1:{upstream}/v1")),
            // Never resolved: the proxy is asked for it by name.
            backend("proxied", format!("http://localhost:{upstream}/v1")),
        ]);
        let proxies = Matcher::builder()
            .http(proxy_url.clone())
            .no("127.0.0.1")
            .build();
        let everything_to_the_proxy =
            reqwest::Client::builder().proxy(reqwest::Proxy::all(&proxy_url).expect("proxy"));
        let upstreams = Upstreams::with_clients(
            &config,
            &proxies,
            everything_to_the_proxy,
            &direct_builder(),
        )
        .expect("upstreams");

        let mut response = upstreams
            .send(&call("proxied"))
            .await
            .expect("proxied call");
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(content_type(&response), "application/json");
        let body = upstreams.read_body(&mut response).await.expect("body");
        assert_eq!(body, br#"{"from":"proxy"}"#);
        let head = proxy_saw.await.expect("proxy served");
        assert!(
            head.starts_with(&format!(
                "POST http://localhost:{upstream}/v1/chat/completions HTTP/1.1"
            )),
            "the proxy got an absolute-form request: {head}"
        );

        let mut response = upstreams.send(&call("direct")).await.expect("direct call");
        assert_eq!(response.status(), StatusCode::OK);
        let body = upstreams.read_body(&mut response).await.expect("body");
        assert_eq!(body, br#"{"from":"provider"}"#);
        let head = upstream_saw
            .await
            .expect("provider served")
            .to_ascii_lowercase();
        assert!(
            head.starts_with("post /v1/chat/completions http/1.1"),
            "{head}"
        );
        assert!(
            head.contains("\r\ncontent-type: application/json"),
            "{head}"
        );
        assert!(head.contains("\r\naccept: */*"), "{head}");
        assert!(
            head.contains(&format!("\r\nhost: 127.0.0.1:{upstream}")),
            "{head}"
        );
        assert!(head.contains("\r\ncontent-length: 13"), "{head}");
    }

    /// A `base_url` with credentials: the direct client sends them as Basic auth, as reqwest
    /// did, and neither the request line nor a connect error carries them.
    #[tokio::test]
    async fn credentials_in_a_base_url_go_as_basic_auth_and_are_never_printed() {
        let (upstream, saw) = answers_once(r#"{"ok":true}"#).await;
        let config = config(vec![
            backend(
                "auth",
                format!("http://us%40er:p%3Ass@127.0.0.1:{upstream}/v1"),
            ),
            backend("gone", "http://user:secret@127.0.0.1:1/v1".into()),
        ]);
        let upstreams = upstreams(&config, &direct_builder());
        let mut response = upstreams.send(&call("auth")).await.expect("call");
        upstreams.read_body(&mut response).await.expect("body");
        let head = saw.await.expect("served");
        // base64 of `us@er:p:ss`.
        assert!(
            head.contains("\r\nauthorization: Basic dXNAZXI6cDpzcw=="),
            "{head}"
        );
        assert!(head.starts_with("POST /v1/chat/completions "), "{head}");
        let Err(CallError::Connect(message)) = upstreams.send(&call("gone")).await else {
            panic!("a refused connection is a connect error");
        };
        assert!(!message.contains("secret"), "{message}");
        assert!(
            message.starts_with("http://127.0.0.1:1/v1/chat/completions: "),
            "a connect error names the URL it tried: {message}"
        );
    }

    /// The connect timeout covers the TLS handshake: a provider that accepts the connection
    /// and never answers the handshake fails the call as a connect error once
    /// `connect_timeout_ms` passes, not at the header timeout.
    #[tokio::test]
    async fn a_tls_handshake_that_never_answers_is_a_connect_timeout() {
        let (listener, port) = listening().await;
        let held = tokio::spawn(async move {
            let (socket, _) = listener.accept().await.expect("accept");
            // Held open, unanswered, until the test ends.
            std::future::pending::<()>().await;
            drop(socket);
        });
        let mut config = config(vec![backend(
            "silent",
            format!("https://127.0.0.1:{port}/v1"),
        )]);
        config.upstream.connect_timeout_ms = 200;
        config.upstream.header_timeout_ms = 600_000;
        let upstreams = upstreams(&config, &direct_builder());
        let sent = tokio::time::timeout(Duration::from_secs(60), upstreams.send(&call("silent")))
            .await
            .expect("the call ends well before the header timeout");
        let Err(CallError::Connect(message)) = sent else {
            panic!("a handshake past the connect timeout is a connect error");
        };
        assert!(
            message.contains("connect timed out after 200 ms"),
            "{message}"
        );
        held.abort();
    }

    /// An HTTP/2 provider on `port`'s listener (prior knowledge, no TLS) that answers its
    /// streams in turn as `replies` says: `None` with `200` and `{"n":K}` (K the stream's
    /// number from 1), `Some(reason)` with a reset. Streams past the list are reset with
    /// `CANCEL`. Counts the streams it got.
    async fn http2_provider(
        listener: TcpListener,
        replies: Vec<Option<h2::Reason>>,
    ) -> (
        std::sync::Arc<std::sync::atomic::AtomicUsize>,
        tokio::task::JoinHandle<()>,
    ) {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let streams = std::sync::Arc::new(AtomicUsize::new(0));
        let counted = streams.clone();
        let served = tokio::spawn(async move {
            let (socket, _) = listener.accept().await.expect("accept");
            let mut connection = h2::server::handshake(socket).await.expect("h2 handshake");
            // Until the client closes the connection (the test aborts the task at its end).
            while let Some(Ok((_request, mut respond))) = connection.accept().await {
                let n = counted.fetch_add(1, Ordering::SeqCst);
                match replies.get(n) {
                    Some(None) => {
                        let answer = http::Response::builder()
                            .status(200)
                            .header("content-type", "application/json")
                            .body(())
                            .expect("response");
                        let mut body = respond.send_response(answer, false).expect("respond");
                        let data = Bytes::from(format!(r#"{{"n":{}}}"#, n + 1));
                        body.send_data(data, true).expect("data");
                    }
                    Some(Some(reason)) => respond.send_reset(*reason),
                    None => respond.send_reset(h2::Reason::CANCEL),
                }
            }
        });
        (streams, served)
    }

    fn prior_knowledge(port: u16) -> Upstreams {
        let config = config(vec![backend("h2", format!("http://127.0.0.1:{port}/v1"))]);
        let mut builder = direct_builder();
        builder.http2_only(true);
        upstreams(&config, &builder)
    }

    /// An HTTP/2 provider that refuses a stream before processing it (`REFUSED_STREAM`) gets
    /// the call again, as reqwest sent it: the call succeeds on the second stream.
    #[tokio::test]
    async fn a_call_an_http2_provider_refused_unprocessed_is_sent_again() {
        let (listener, port) = listening().await;
        let (streams, served) =
            http2_provider(listener, vec![Some(h2::Reason::REFUSED_STREAM), None]).await;
        let upstreams = prior_knowledge(port);
        let mut response = upstreams.send(&call("h2")).await.expect("sent again");
        assert_eq!(response.status(), StatusCode::OK);
        let body = upstreams.read_body(&mut response).await.expect("body");
        assert_eq!(body, br#"{"n":2}"#);
        assert_eq!(streams.load(std::sync::atomic::Ordering::SeqCst), 2);
        served.abort();
    }

    /// The guard against paying twice: a stream the provider reset for any other reason
    /// (`INTERNAL_ERROR`: it may have run the call) is never sent again, and a provider that
    /// keeps refusing gets the call three times in all, then the call fails.
    #[tokio::test]
    async fn a_call_an_http2_provider_may_have_processed_is_not_sent_again_and_refusals_stop_at_three()
     {
        let (listener, port) = listening().await;
        let (streams, served) =
            http2_provider(listener, vec![Some(h2::Reason::INTERNAL_ERROR), None]).await;
        let upstreams = prior_knowledge(port);
        let Err(CallError::Connect(_)) = upstreams.send(&call("h2")).await else {
            panic!("a reset stream is a failed call");
        };
        assert_eq!(
            streams.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "a reset that is not a refusal is not sent again"
        );
        served.abort();

        let (listener, port) = listening().await;
        let refused = Some(h2::Reason::REFUSED_STREAM);
        let (streams, served) =
            http2_provider(listener, vec![refused, refused, refused, None]).await;
        let upstreams = prior_knowledge(port);
        let Err(CallError::Connect(_)) = upstreams.send(&call("h2")).await else {
            panic!("a third refusal fails the call");
        };
        assert_eq!(streams.load(std::sync::atomic::Ordering::SeqCst), 3);
        served.abort();
    }
}
