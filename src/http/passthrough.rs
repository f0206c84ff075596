//! Calls an SDK makes around the logged routes, forwarded without being logged: the model
//! lists (`GET /v1/models`, merged over the backends, with the rewrite aliases), Anthropic's
//! token counting, and the `[[passthrough]]` paths of the configuration. The backend's key is
//! sent; the client's credentials never reach the provider.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderName, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde_json::Value;

use super::errors::ApiError;
use super::{AppState, namespace};
use crate::config::Config;
use crate::provider::{Provider, Route};

/// How long a backend's model list is reused before it is fetched again.
const MODELS_TTL: Duration = Duration::from_secs(60);

/// Each backend's model list, as fetched at a time.
#[derive(Debug, Default)]
pub(crate) struct ModelsCache {
    lists: Mutex<HashMap<String, (Instant, Vec<Value>)>>,
}

impl ModelsCache {
    fn get(&self, backend: &str) -> Option<Vec<Value>> {
        let lists = self.lists.lock().unwrap_or_else(|e| e.into_inner());
        lists
            .get(backend)
            .filter(|(at, _)| at.elapsed() < MODELS_TTL)
            .map(|(_, list)| list.clone())
    }

    fn put(&self, backend: &str, list: Vec<Value>) {
        let mut lists = self.lists.lock().unwrap_or_else(|e| e.into_inner());
        lists.insert(backend.to_string(), (Instant::now(), list));
    }
}

/// `GET /v1/models`: the models of every backend of the caller's provider — Anthropic's shape
/// when the call carries `anthropic-version` (Anthropic's SDKs send it), else OpenAI's — plus
/// every exact `model_rewrites` alias served by such a backend. Each backend's list is fetched
/// with its own key and kept for a minute; a backend that fails is skipped and logged. Not
/// recorded in the log.
pub(super) async fn models(
    State(state): State<AppState>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    let provider = Provider::of_shared_call(&headers);
    models_of(&state, provider, &query, &headers)
        .await
        .into_response()
}

/// The model list of `provider`'s backends and aliases, in its shape, paged as `query` asks
/// (GM-4 for Gemini's).
///
/// # Errors
/// 401 `invalid_api_key` as [`namespace`]; 400 `invalid_page_token` for a Gemini `pageToken`
/// holdfast did not issue, `invalid_page_size` for a `pageSize` that is not a non-negative
/// integer (GM-4).
pub(super) async fn models_of(
    state: &AppState,
    provider: Provider,
    query: &HashMap<String, String>,
    headers: &HeaderMap,
) -> Result<axum::Json<Value>, ApiError> {
    namespace(&state.config, headers, provider)?;
    let models = merged_models(state, provider).await;
    provider
        .models_answer(models, query)
        .map(axum::Json)
        .map_err(|(code, why)| ApiError::bad_request(provider, code, why))
}

/// `GET /v1/models/{model}` (and Gemini's `/v1beta/models/{model}`): the entry of the merged
/// list ([`models_of`]) whose id is `model` (Gemini's `models/` prefix optional), in the
/// caller's provider's shape; else the same lookup forwarded to the backend the model routes
/// to (CLI-5), the rewritten model in its path, and its answer relayed (GM-4, decision 76): a
/// provider may serve a model its list does not name, and a list is up to a minute old. 404
/// when no backend serves the caller's provider. Not recorded.
pub(super) async fn model(
    State(state): State<AppState>,
    axum::extract::Path(model): axum::extract::Path<String>,
    uri: Uri,
    mut headers: HeaderMap,
) -> Response {
    // `GET /v1beta/models/{model}:generateContent` is a call with the wrong method.
    if super::gemini::is_post_call(&model) {
        return super::method_not_allowed(uri).await;
    }
    super::gemini::key_from_query(&uri, &mut headers);
    let provider = if uri.path().starts_with("/v1beta/") {
        Provider::Gemini
    } else {
        Provider::of_shared_call(&headers)
    };
    if let Err(e) = namespace(&state.config, &headers, provider) {
        return e.into_response();
    }
    let wanted = model.strip_prefix("models/").unwrap_or(&model);
    let found = merged_models(&state, provider)
        .await
        .into_iter()
        .find(|m| provider.model_id(m) == Some(wanted));
    if let Some(entry) = found {
        return axum::Json(entry).into_response();
    }
    let not_found =
        || ApiError::not_found(provider, format!("model {wanted:?} is not found")).into_response();
    if !forwardable_model_id(provider, wanted) {
        return not_found();
    }
    let Some((backend, rewritten)) = Route::ALL
        .into_iter()
        .find(|r| r.provider() == provider)
        .and_then(|route| super::proxy::choose_backend(&state.config, route, Some(wanted)))
    else {
        return not_found();
    };
    let model = rewritten.as_deref().unwrap_or(wanted);
    let path = provider.model_path(&path_segment(model));
    let forwarded = client_headers(&headers, provider);
    relay(
        &state,
        &backend,
        provider,
        Method::GET,
        &path,
        forwarded,
        Bytes::new(),
    )
    .await
}

/// Whether a model id a lookup names may go upstream in a path (decision 76): at most 256
/// bytes, no control byte, no `.` or `..` between slashes and no `\`, plain or escaped, as for a
/// pass-through path ([`stays_where_it_points`]: a server that decodes `%2F` would read it as a
/// relative path, with the backend's key), and for Google a model name as GM-1
/// spells it. Anything else no provider serves: 404 without a call.
fn forwardable_model_id(provider: Provider, id: &str) -> bool {
    let plain = !id.is_empty()
        && id.len() <= 256
        && !id.bytes().any(|b| b.is_ascii_control())
        && stays_where_it_points(id);
    plain && (provider != Provider::Gemini || Route::is_path_model(id))
}

/// `segment` as one path segment: RFC 3986's unreserved bytes, `:` and `@` as they are (an
/// OpenAI fine-tuned model id keeps its colons), every other byte percent-encoded (a `/` in an
/// OpenAI-compatible server's model id, `meta-llama/Llama-3-8B`, included).
fn path_segment(segment: &str) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(segment.len());
    for b in segment.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~' | b':' | b'@') {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// Every model of `provider`'s backends (each list kept for a minute; a backend that fails is
/// skipped and logged), then the exact aliases, each id once.
async fn merged_models(state: &AppState, provider: Provider) -> Vec<Value> {
    let mut models: Vec<Value> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for backend in state.config.backends.iter().filter(|b| b.kind == provider) {
        let list = match state.models.get(&backend.name) {
            Some(list) => list,
            None => match fetch_models(state, &backend.name, provider).await {
                Ok(list) => {
                    state.models.put(&backend.name, list.clone());
                    list
                }
                Err(why) => {
                    tracing::warn!(backend = %backend.name, %why, "skipping a backend's model list");
                    continue;
                }
            },
        };
        for model in list {
            let id = provider.model_id(&model).unwrap_or_default().to_string();
            if !id.is_empty() && seen.insert(id) {
                models.push(model);
            }
        }
    }
    for alias in aliases(&state.config, provider) {
        if seen.insert(alias.clone()) {
            models.push(provider.model_entry(&alias));
        }
    }
    models
}

/// Exact model names that `model_rewrites` send to a backend of `provider`.
fn aliases(config: &Config, provider: Provider) -> Vec<String> {
    config
        .model_rewrites
        .iter()
        .filter(|r| !r.pattern.ends_with('*'))
        .filter(|r| {
            config
                .backend(&r.backend)
                .is_some_and(|b| b.kind == provider)
        })
        .map(|r| r.pattern.clone())
        .collect()
}

/// A backend's model list: its `GET /models`, every page of it.
async fn fetch_models(
    state: &AppState,
    backend: &str,
    provider: Provider,
) -> Result<Vec<Value>, String> {
    let mut models = Vec::new();
    let mut after: Option<String> = None;
    // Bounded: a provider that pages forever is cut at 50 pages.
    for _ in 0..50 {
        let path = provider.models_page_path(after.as_deref());
        let mut response = state
            .upstreams
            .forward(backend, Method::GET, &path, HeaderMap::new(), Bytes::new())
            .await
            .map_err(|e| e.to_string())?;
        let status = response.status();
        let (body, cut) = state.upstreams.read_capped(&mut response).await;
        if !status.is_success() || cut {
            return Err(format!("GET /models answered {status}"));
        }
        let page: Value =
            serde_json::from_slice(&body).map_err(|e| format!("GET /models: not JSON: {e}"))?;
        let data = provider
            .models_of_page(&page)
            .ok_or("GET /models: no list of models")?;
        models.extend(data.iter().cloned());
        match provider.next_models_page(&page) {
            Some(next) => after = Some(next),
            None => return Ok(models),
        }
    }
    Ok(models)
}

/// `POST /v1/messages/count_tokens`: forwarded to the backend the body's model is routed to
/// (CLI-5), not logged.
pub(super) async fn count_tokens(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let route = Route::AnthropicMessages;
    let shape = route.provider();
    if let Err(e) = namespace(&state.config, &headers, shape) {
        return e.into_response();
    }
    let body = match super::proxy::read_body(&state.config, &headers, body, shape).await {
        Ok(body) => body,
        Err(e) => return e.into_response(),
    };
    let model = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| v["model"].as_str().map(str::to_owned));
    let Some((backend, _)) = super::proxy::choose_backend(&state.config, route, model.as_deref())
    else {
        return ApiError::bad_request(shape, "no_backend", "no backend serves /v1/messages")
            .into_response();
    };
    let forwarded = client_headers(&headers, shape);
    relay(
        &state,
        &backend,
        shape,
        Method::POST,
        "/messages/count_tokens",
        forwarded,
        body,
    )
    .await
}

/// A `[[passthrough]]` path (the rule's index in the configuration): forwarded with any method,
/// its query included, not logged.
pub(super) async fn configured(
    state: AppState,
    rule: usize,
    method: Method,
    uri: Uri,
    mut headers: HeaderMap,
    body: Body,
) -> Response {
    let shape = Provider::for_path(uri.path());
    if shape == Provider::Gemini {
        // A Google key in the query is the caller's namespace key, as on Gemini's own routes
        // (GM-4), and is not passed on (decision 162).
        super::gemini::key_from_query(&uri, &mut headers);
    }
    if let Err(e) = namespace(&state.config, &headers, shape) {
        return e.into_response();
    }
    let body = match super::proxy::read_body(&state.config, &headers, body, shape).await {
        Ok(body) => body,
        Err(e) => return e.into_response(),
    };
    let Some(rule) = state.config.passthrough.get(rule) else {
        return ApiError::not_found(shape, "no such pass-through rule").into_response();
    };
    if !stays_where_it_points(uri.path()) {
        // `/v1/files/../chat/completions` matched `/v1/files/*` and, its dot segments
        // resolved on the way out, reached a logged route unlogged (decision 159).
        return ApiError::not_found(
            shape,
            format!(
                "{} is not forwarded: a pass-through path has no `.` or `..` segment and no \
                 encoded `/` or `\\`",
                uri.path()
            ),
        )
        .into_response();
    }
    let backend = rule.backend.clone();
    let provider = state.config.backend(&backend).map_or(shape, |b| b.kind);
    // The path after its first segment (the version prefix), which `base_url` carries; the
    // whole path for a provider whose `base_url` has no version (Gemini's, decision 57).
    let without_key;
    let path = match uri.query() {
        Some(query) if shape == Provider::Gemini => {
            without_key = without_query_key(uri.path(), query);
            without_key.as_str()
        }
        _ => uri.path_and_query().map_or(uri.path(), |p| p.as_str()),
    };
    let rest = if provider.base_url_has_version() {
        path.get(1..)
            .and_then(|p| p.find('/').map(|i| &path[i + 1..]))
            .unwrap_or(path)
    } else {
        path
    };
    let forwarded = client_headers(&headers, provider);
    relay(&state, &backend, shape, method, rest, forwarded, body).await
}

/// `path` and `query` with every `key` parameter left out, its name read as Google reads it,
/// escapes decoded (decision 162).
fn without_query_key(path: &str, query: &str) -> String {
    let kept: Vec<&str> = query
        .split('&')
        .filter(|pair| {
            let name = pair.split('=').next().unwrap_or_default();
            percent_encoding::percent_decode_str(name).collect::<Vec<u8>>() != b"key"
        })
        .collect();
    if kept.is_empty() {
        path.to_string()
    } else {
        format!("{path}?{}", kept.join("&"))
    }
}

/// Whether `path`, as forwarded, names what it says: no segment is `.` or `..`, written plainly
/// or percent-encoded, and none hides a `/` or `\` in an escape, which a server that decodes
/// before it resolves would read as more segments (decision 159).
fn stays_where_it_points(path: &str) -> bool {
    path.split('/').all(|segment| {
        let decoded = percent_encoding::percent_decode_str(segment).collect::<Vec<u8>>();
        decoded != b"." && decoded != b".." && !decoded.iter().any(|b| matches!(b, b'/' | b'\\'))
    })
}

/// The client headers a forwarded call keeps: its content type and accept, and the provider's
/// forwarded headers (ID-3a). Never its credentials.
pub(super) fn client_headers(headers: &HeaderMap, provider: Provider) -> HeaderMap {
    let mut out = HeaderMap::new();
    let keep = ["content-type", "accept"]
        .into_iter()
        .chain(provider.forwarded_headers().iter().copied());
    for name in keep {
        for value in headers.get_all(name) {
            out.append(HeaderName::from_static(name), value.clone());
        }
    }
    out
}

/// Forwards to `backend` and streams its answer back as it comes: status, body, content type
/// and the provider's request-id header. A backend that cannot be reached is 502
/// `upstream_unreachable` (nothing was recorded; a retry may succeed).
pub(super) async fn relay(
    state: &AppState,
    backend: &str,
    shape: Provider,
    method: Method,
    path_and_query: &str,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let response = match state
        .upstreams
        .forward(backend, method, path_and_query, headers, body)
        .await
    {
        Ok(response) => response,
        Err(e) => {
            tracing::warn!(%backend, path = %path_and_query, error = %e, "pass-through call failed");
            let mut err = ApiError::new(
                shape,
                StatusCode::BAD_GATEWAY,
                "upstream_unreachable",
                format!("the backend {backend} could not be reached: {e}"),
            );
            err.should_retry = Some(true);
            return err.into_response();
        }
    };
    let status = response.status();
    let kept: Vec<(HeaderName, axum::http::HeaderValue)> = response
        .headers()
        .iter()
        .filter(|(name, _)| {
            let name = name.as_str();
            name == "content-type"
                || name == "retry-after"
                || name == "retry-after-ms"
                || name == "x-should-retry"
                || Provider::ALL
                    .iter()
                    .any(|p| p.request_id_header() == Some(name))
        })
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect();
    let body = Body::new(response.into_body());
    let mut out = Response::new(body);
    *out.status_mut() = status;
    out.headers_mut().extend(kept);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Decision 76: a looked-up model id goes upstream as one path segment; a fine-tuned id
    /// keeps its colons, a `/` and every byte a URL would read otherwise are encoded.
    #[test]
    fn a_model_id_goes_upstream_as_one_path_segment_gm4() {
        assert_eq!(
            path_segment("ft:gpt-4o-mini-2024-07-18:my-org::abc123"),
            "ft:gpt-4o-mini-2024-07-18:my-org::abc123"
        );
        assert_eq!(
            path_segment("meta-llama/Llama-3-8B"),
            "meta-llama%2FLlama-3-8B"
        );
        assert_eq!(path_segment("a?b#c%d e"), "a%3Fb%23c%25d%20e");
        assert_eq!(path_segment("x@y.z~_"), "x@y.z~_");
        assert_eq!(path_segment("modèle"), "mod%C3%A8le");
    }

    /// Decision 76: what no provider serves is 404 without a call: an empty, overlong or
    /// control-byte id, a `.` or `..` between slashes (a server that decodes `%2F` reads it as
    /// a relative path, with the backend's key), and for Google a name outside GM-1's.
    #[test]
    fn a_model_id_that_could_reach_another_path_is_not_forwarded_gm4() {
        for id in [
            "gpt-4o-mini",
            "ft:gpt-4o-mini:org::abc",
            "meta-llama/Llama-3-8B",
            "accounts/fireworks/models/llama-v3",
            "..a",
            "v1.5",
        ] {
            assert!(forwardable_model_id(Provider::Openai, id), "{id}");
        }
        let long = "m".repeat(257);
        for id in [
            "",
            ".",
            "..",
            "..\\..\\files",
            "a/../../x",
            "../admin",
            "a/./b",
            "a/..",
            "tab\there",
            "new\nline",
            long.as_str(),
        ] {
            assert!(!forwardable_model_id(Provider::Openai, id), "{id:?}");
            assert!(!forwardable_model_id(Provider::Anthropic, id), "{id:?}");
        }
        assert!(forwardable_model_id(Provider::Gemini, "gemini-2.0-flash"));
        for id in ["gemini/../x", "gemini 2", "gemini:x", "ft:gemini"] {
            assert!(!forwardable_model_id(Provider::Gemini, id), "{id}");
        }
    }
}
