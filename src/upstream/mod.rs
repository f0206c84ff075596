//! Provider clients: one HTTP client for every backend, provider auth, forwarded headers and the
//! three separate timeouts of SPEC LC-10 (connect, time to headers, idle gap in the body).
//!
//! A call sends the stored body bytes exactly as recorded (ID-3b). Client auth headers are never
//! forwarded; the backend's own key is used (ID-3a, IN-3).

use std::collections::HashMap;
use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
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

/// Provider HTTP clients and keys for every configured backend.
#[derive(Debug, Clone)]
pub(crate) struct Upstreams {
    client: reqwest::Client,
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
    urls: Vec<(Route, reqwest::Url)>,
}

impl Upstreams {
    /// Builds the client and reads each backend's key from the environment variable its
    /// `api_key_env` names. A missing variable means no key is sent (useful for local servers).
    ///
    /// # Errors
    /// When the HTTP client cannot be built or a key is not a valid header value.
    pub(crate) fn new(config: &Config) -> anyhow::Result<Upstreams> {
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_millis(config.upstream.connect_timeout_ms))
            .pool_idle_timeout(Duration::from_secs(90))
            .tcp_nodelay(true)
            // A redirect would turn the POST into a body-less GET; a 3xx fails the attempt
            // as `upstream_invalid` instead, which names the problem.
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
                    reqwest::Url::parse(&url)
                        .map(|url| (route, url))
                        .map_err(|e| anyhow::anyhow!("backends.{}: base_url {url:?}: {e}", b.name))
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            backends.insert(
                b.name.clone(),
                Target {
                    backend: b.clone(),
                    key,
                    urls,
                },
            );
        }
        Ok(Upstreams {
            client,
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
    pub(crate) async fn send(&self, call: &Call<'_>) -> Result<reqwest::Response, CallError> {
        let Target { backend, key, urls } = self
            .backends
            .get(call.backend)
            .ok_or_else(|| CallError::UnknownBackend(call.backend.to_string()))?;
        let route = call.route;
        let url = if route.model_in_path() {
            let url = format!(
                "{}{}",
                backend.base_url.trim_end_matches('/'),
                route.upstream_path(call.model)
            );
            reqwest::Url::parse(&url).map_err(|e| CallError::Connect(format!("{url}: {e}")))?
        } else {
            urls.iter()
                .find(|(r, _)| *r == route)
                .map(|(_, url)| url.clone())
                .ok_or_else(|| CallError::UnknownBackend(call.backend.to_string()))?
        };
        let mut headers = HeaderMap::new();
        headers.insert(
            reqwest::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
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
        if let Some(traceparent) = call.traceparent.and_then(|v| HeaderValue::from_str(v).ok()) {
            headers.insert("traceparent", traceparent);
        }
        // Defaults the client did not send (already in `call.headers` for requests admitted
        // by this version, which hashes them; kept for records admitted before).
        for (name, value) in backend.kind.default_headers() {
            if !headers.contains_key(*name) {
                headers.insert(*name, HeaderValue::from_static(value));
            }
        }
        let send = self
            .client
            .post(url)
            .headers(headers)
            .body(call.body.to_vec())
            .send();
        match tokio::time::timeout(self.header_timeout, send).await {
            Err(_) => Err(CallError::HeaderTimeout(
                self.header_timeout.as_millis() as u64
            )),
            Ok(Err(e)) => Err(CallError::Connect(error_chain(&e))),
            Ok(Ok(response)) => Ok(response),
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
        method: reqwest::Method,
        path_and_query: &str,
        mut headers: HeaderMap,
        body: Bytes,
    ) -> Result<reqwest::Response, CallError> {
        let Target {
            backend: config,
            key,
            ..
        } = self
            .backends
            .get(backend)
            .ok_or_else(|| CallError::UnknownBackend(backend.to_string()))?;
        let url = format!("{}{path_and_query}", config.base_url.trim_end_matches('/'));
        let url =
            reqwest::Url::parse(&url).map_err(|e| CallError::Connect(format!("{url}: {e}")))?;
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
        let send = self
            .client
            .request(method, url)
            .headers(headers)
            .body(body)
            .send();
        match tokio::time::timeout(self.header_timeout, send).await {
            Err(_) => Err(CallError::HeaderTimeout(
                self.header_timeout.as_millis() as u64
            )),
            Ok(Err(e)) => Err(CallError::Connect(error_chain(&e))),
            Ok(Ok(response)) => Ok(response),
        }
    }

    /// Reads `response`'s body piece by piece, each read waiting at most `idle_timeout_ms`
    /// (LC-10).
    pub(crate) fn pieces<'r>(&self, response: &'r mut reqwest::Response) -> Pieces<'r> {
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
    pub(crate) async fn read_body(
        &self,
        response: &mut reqwest::Response,
    ) -> Result<Vec<u8>, CallError> {
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
    pub(crate) async fn read_capped(&self, response: &mut reqwest::Response) -> (Vec<u8>, bool) {
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
/// timer serves every read: moving its deadline later takes no lock (the timer driver files it
/// anew when the old deadline comes), where a timeout per read registered and removed a timer
/// for every stream event (issue 30).
pub(crate) struct Pieces<'r> {
    response: &'r mut reqwest::Response,
    idle_for: Duration,
    idle: Pin<Box<Sleep>>,
}

impl Pieces<'_> {
    /// The next piece of the body; `None` at its end.
    ///
    /// # Errors
    /// [`CallError::IdleTimeout`] or [`CallError::Read`].
    pub(crate) async fn next(&mut self) -> Result<Option<Bytes>, CallError> {
        self.idle.as_mut().reset(Instant::now() + self.idle_for);
        tokio::select! {
            // A piece that is there wins over a deadline that passed meanwhile.
            biased;
            piece = self.response.chunk() => piece.map_err(|e| CallError::Read(error_chain(&e))),
            () = self.idle.as_mut() => {
                Err(CallError::IdleTimeout(self.idle_for.as_millis() as u64))
            }
        }
    }
}

/// An error and its sources, joined: reqwest's top-level message alone says little.
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
