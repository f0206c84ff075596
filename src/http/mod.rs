//! The HTTP surface: proxied provider routes (HTTP-1), the request log (HTTP-2) and operations
//! (HTTP-3). Handlers are thin: admission and responses live in [`proxy`], reading back in
//! [`requests`], provider-shaped errors in [`errors`].

pub(crate) mod callbacks;
mod errors;
mod export;
mod gemini;
pub(crate) mod large_bodies;
pub(crate) mod openapi;
mod ops;
mod passthrough;
mod proxy;
mod replay;
mod requests;
mod responses;
mod stream;
mod ui;
mod usage;

use std::sync::Arc;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, any, delete, get, post};
use subtle::ConstantTimeEq;

use crate::config::Config;
use crate::hub::Hub;
use crate::provider::Provider;
use crate::provider::Route;
use crate::store::DynStore;
use crate::upstream::Upstreams;
use crate::worker::WorkerPool;
use errors::ApiError;

/// The identity headers' names (RS-5), parsed once: a name given as a string is parsed at every
/// insert (issue 30).
const REQUEST_ID: header::HeaderName = header::HeaderName::from_static("holdfast-request-id");
const CLAIM_EXPIRES_AT: header::HeaderName =
    header::HeaderName::from_static("holdfast-claim-expires-at");
const IDEMPOTENT_REPLAYED: header::HeaderName =
    header::HeaderName::from_static("idempotent-replayed");
pub(crate) use proxy::Held;

/// Shared state of every handler: a handle, cloned for every call (axum's `State`), so it is
/// one shared allocation and a clone is one reference count rather than one per field (issue
/// 30; as [`WorkerPool`]).
#[derive(Clone)]
pub(crate) struct AppState(Arc<Shared>);

impl AppState {
    pub(crate) fn new(shared: Shared) -> AppState {
        AppState(Arc::new(shared))
    }
}

impl std::ops::Deref for AppState {
    type Target = Shared;

    fn deref(&self) -> &Shared {
        &self.0
    }
}

/// What every handler shares ([`AppState`]).
pub(crate) struct Shared {
    /// Validated configuration.
    pub config: Arc<Config>,
    /// The durable log.
    pub store: DynStore,
    /// Wake-ups for waiting readers.
    pub hub: Arc<Hub>,
    /// This node's workers: admission ([`WorkerPool::admit`]) and cancel.
    pub workers: WorkerPool,
    /// Provider clients, for the calls that are forwarded without being logged.
    pub upstreams: Arc<Upstreams>,
    /// Each backend's model list, fetched briefly ago (`GET /v1/models`).
    pub models: Arc<passthrough::ModelsCache>,
    /// Proxied calls this node is holding open right now, in all and per capped namespace
    /// (RS-8, RS-13 overload limits).
    pub held: Arc<Held>,
    /// Each namespace's budget of large bodies in admission on this node (LC-2b).
    pub large_bodies: Arc<large_bodies::LargeBodies>,
    /// Cancelled by `app::Running::shutdown` about 2 s after the workers stop (DU-5):
    /// every event stream and held call of this node ends then. Without it they would outlive
    /// the shutdown, since each connection runs in a task of its own.
    pub cut: tokio_util::sync::CancellationToken,
    /// Traces, when `otel.enabled` (OT-2).
    pub traces: crate::otel::Traces,
}

/// The router with every route of SPEC §1.
pub(crate) fn router(state: AppState) -> Router {
    let cors = cors(&state.config.cors_allow_origins);
    let mut router = Router::new();
    for (_, _, path, handler) in fixed_routes() {
        if let Some(handler) = handler {
            router = router.route(path, handler);
        }
    }
    for (i, rule) in state.config.passthrough.iter().enumerate() {
        let (base, prefix) = rule.base();
        let handler = any(
            move |State(state): State<AppState>, method, uri, headers, body| {
                passthrough::configured(state, i, method, uri, headers, body)
            },
        );
        router = router.route(base, handler.clone());
        if prefix {
            router = router.route(&format!("{base}/{{*rest}}"), handler);
        }
    }
    router
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::disable())
        .layer(tower::util::option_layer(cors))
        .with_state(state)
}

/// One served route: (method, path as documented, path in the router's `{param}` syntax,
/// handler). Several documented routes may share one router path and handler (Gemini's
/// `/v1beta/models/{call}`): the first carries it, the others `None`.
type Served = (
    &'static str,
    &'static str,
    &'static str,
    Option<MethodRouter<AppState>>,
);

/// Every route holdfast serves whatever the configuration says. The router is built from this
/// table and `/openapi.json` is checked against it (`tests/api/openapi.rs`), so a route cannot
/// be added undocumented.
fn fixed_routes() -> Vec<Served> {
    let mut routes: Vec<Served> = Vec::new();
    let mut routed = std::collections::HashSet::new();
    for route in Route::ALL {
        let path = route.router_path();
        let handler = routed.insert(path).then(|| {
            if route.model_in_path() {
                post(
                    move |State(state), Path(call): Path<String>, uri, headers, body| {
                        gemini::call(state, path, call, uri, headers, body)
                    },
                )
            } else {
                post(move |state, headers, body| proxy::handle(state, route, None, headers, body))
            }
        });
        routes.push(("POST", route.client_path(), path, handler));
    }
    // Gemini's calls around its logged routes (GM-4): token counting shares the routes'
    // handler, the model list and one model are answered from the backends.
    for version in Provider::Gemini.path_prefixes() {
        let call = Route::ALL
            .into_iter()
            .find(|r| r.model_in_path() && r.client_path().starts_with(&format!("{version}/")))
            .map_or("", |r| r.router_path());
        for path in forwarded_paths(version) {
            routes.push(("POST", path, call, None));
        }
        routes.push((
            "GET",
            model_path(version),
            call,
            Some(get(passthrough::model)),
        ));
    }
    routes.push((
        "GET",
        "/v1beta/models",
        "/v1beta/models",
        Some(get(gemini::models)),
    ));
    let same = |(method, path, handler): (&'static str, &'static str, MethodRouter<AppState>)| {
        (method, path, path, Some(handler))
    };
    routes.extend(
        [
            ("GET", "/v1/models", get(passthrough::models)),
            (
                "POST",
                "/v1/messages/count_tokens",
                post(passthrough::count_tokens),
            ),
            ("GET", "/v1/responses/{id}", get(responses::retrieve)),
            ("DELETE", "/v1/responses/{id}", delete(responses::delete)),
            (
                "GET",
                "/v1/responses/{id}/input_items",
                get(responses::input_items),
            ),
            ("POST", "/v1/responses/{id}/cancel", post(responses::cancel)),
            ("GET", "/usage", get(usage::usage)),
            ("GET", "/requests", get(requests::list)),
            ("GET", "/requests/export", get(export::export)),
            ("GET", "/requests/{id}", get(requests::get_one)),
            ("POST", "/requests/{id}/cancel", post(requests::cancel)),
            ("POST", "/requests/{id}/replay", post(replay::replay)),
            ("GET", "/healthz", get(ops::healthz)),
            ("GET", "/readyz", get(ops::readyz)),
            ("GET", "/metrics", get(ops::metrics)),
            ("GET", "/openapi.json", get(openapi::serve)),
        ]
        .map(same),
    );
    // The web page is always routed and answers 404 itself when `ui` is off, so the table (and
    // `/openapi.json`) does not depend on the configuration.
    routes.extend(ui::routes().map(|(path, handler)| same(("GET", path, handler))));
    routes
}

/// `POST {version}/models/{model}:{method}` of each method forwarded unlogged (GM-4), as
/// documented.
fn forwarded_paths(version: &str) -> [&'static str; 3] {
    if version == "/v1beta" {
        [
            "/v1beta/models/{model}:countTokens",
            "/v1beta/models/{model}:embedContent",
            "/v1beta/models/{model}:batchEmbedContents",
        ]
    } else {
        [
            "/v1/models/{model}:countTokens",
            "/v1/models/{model}:embedContent",
            "/v1/models/{model}:batchEmbedContents",
        ]
    }
}

/// `GET {version}/models/{model}`, as documented.
fn model_path(version: &str) -> &'static str {
    if version == "/v1beta" {
        "/v1beta/models/{model}"
    } else {
        "/v1/models/{model}"
    }
}

/// (method, path) of every route of [`fixed_routes`], for the test that checks
/// `/openapi.json` against the server.
pub(crate) fn route_list() -> Vec<(&'static str, &'static str)> {
    fixed_routes()
        .into_iter()
        .map(|(method, path, _, _)| (method, path))
        .collect()
}

/// CORS for browser readers (`EventSource` on `/requests/{id}`, fetch on the proxied routes),
/// only when `cors_allow_origins` is set. Exposes holdfast's and the providers' headers.
fn cors(origins: &[String]) -> Option<tower_http::cors::CorsLayer> {
    use axum::http::{HeaderName, Method};
    use tower_http::cors::{AllowOrigin, CorsLayer};
    if origins.is_empty() {
        return None;
    }
    let allow_origin = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        AllowOrigin::list(origins.iter().filter_map(|o| HeaderValue::from_str(o).ok()))
    };
    let names = |names: &[&'static str]| {
        names
            .iter()
            .map(|n| HeaderName::from_static(n))
            .collect::<Vec<_>>()
    };
    let mut allow_headers = names(&["last-event-id", "idempotency-key", "prefer"]);
    allow_headers.extend(
        Provider::ALL
            .iter()
            .map(|p| p.credential_header())
            .filter(|h| *h != "authorization")
            .map(HeaderName::from_static),
    );
    allow_headers.extend([header::AUTHORIZATION, header::CONTENT_TYPE, header::ACCEPT]);
    allow_headers.extend(
        Provider::ALL
            .iter()
            .flat_map(|p| p.forwarded_headers())
            .map(|n| HeaderName::from_static(n)),
    );
    let mut expose_headers = vec![REQUEST_ID, CLAIM_EXPIRES_AT, IDEMPOTENT_REPLAYED];
    expose_headers.extend(names(&[
        "holdfast-error",
        "x-should-retry",
        "retry-after-ms",
        "retry-after",
        "location",
    ]));
    expose_headers.extend(
        Provider::ALL
            .iter()
            .filter_map(|p| p.request_id_header())
            .map(HeaderName::from_static),
    );
    Some(
        CorsLayer::new()
            .allow_origin(allow_origin)
            .allow_methods([Method::GET, Method::POST])
            .allow_headers(allow_headers)
            .expose_headers(expose_headers),
    )
}

async fn not_found(uri: Uri) -> Response {
    let path = uri.path();
    // An SDK pointed at the wrong prefix is told what to change, in the shape it reads (IN-1):
    // a `base_url` ending in a version (`/v1`, or Gemini's `/v1beta`) for an SDK that adds one
    // itself doubles the version; a Gemini call without one comes from a client whose base URL
    // should carry it; google-genai set to `v1alpha` asks for a version not served.
    let doubled = ["/v1", "/v1beta"].into_iter().find_map(|version| {
        path.strip_prefix(version)
            .filter(|rest| rest.starts_with("/v1/") || rest.starts_with("/v1beta/"))
            .map(|rest| (version, rest))
    });
    let (shape, hint) = match doubled {
        Some((version, rest)) => (
            Provider::for_path(rest),
            format!(": its version comes twice; take `{version}` off the SDK's base_url"),
        ),
        None => match lacks_v1(path) {
            Some(Provider::Anthropic) => (
                Provider::Anthropic,
                ": clients that put no version in the path (the Vercel AI SDK's \
                 `@ai-sdk/anthropic`) take a base URL ending in `/v1`; Anthropic's own SDKs \
                 take holdfast's address alone"
                    .to_string(),
            ),
            Some(provider) => (
                provider,
                ": OpenAI SDKs (and the Vercel AI SDK's `@ai-sdk/openai`) take a base_url \
                 ending in `/v1`"
                    .to_string(),
            ),
            None => unrouted(path),
        },
    };
    ApiError::not_found(shape, format!("holdfast has no route {path}{hint}")).into_response()
}

/// The shape and hint of a 404 for a path that is not an SDK's at a wrong prefix.
fn unrouted(path: &str) -> (Provider, String) {
    let (shape, hint) = if Provider::is_gemini_call_without_version(path) {
        (
            Provider::Gemini,
            ": clients that put no API version in the path (the Vercel AI SDK's `@ai-sdk/google`) \
             take a base URL ending in `/v1beta`",
        )
    } else if path.starts_with("/v1alpha/") {
        (
            Provider::Gemini,
            ": holdfast serves Google's `v1beta` and `v1` APIs; set the SDK's `api_version` to \
             one of them",
        )
    } else if path.starts_with("/v1/") || path.starts_with("/v1beta/") {
        // Another of the provider's APIs (images, moderations, files, ...): holdfast logs only
        // the model calls, and forwards others a `[[passthrough]]` names, unlogged.
        (
            Provider::for_path(path),
            ": to forward it to the provider unlogged, name it in a `[[passthrough]]` \
             (docs/configuration.md)",
        )
    } else {
        (Provider::for_path(path), "")
    };
    (shape, hint.to_string())
}

/// The provider whose route `path` is without its `/v1`, if any: an OpenAI SDK's `base_url`
/// without it, or `@ai-sdk/anthropic` given holdfast's address alone (decision 165).
fn lacks_v1(path: &str) -> Option<Provider> {
    if path == "/models" {
        return Some(Provider::Openai);
    }
    Route::ALL
        .into_iter()
        .find(|r| {
            matches!(r.provider(), Provider::Openai | Provider::Anthropic)
                && r.client_path().strip_prefix("/v1") == Some(path)
        })
        .map(Route::provider)
}

async fn method_not_allowed(uri: Uri) -> Response {
    let mut response = ApiError::new(
        Provider::for_path(uri.path()),
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!("{} does not accept this method", uri.path()),
    )
    .into_response();
    // The router lists every method of a router path in `Allow` unless the answer has one;
    // `/{version}/models/{x}` serves two resources with methods of their own (IN-1).
    if let Some(allowed) = gemini::methods_of_models_path(uri.path()) {
        response
            .headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static(allowed));
    }
    response
}

/// Runs a handler's `work` as a task of its own and answers with what it answers. For a request
/// that changes what holdfast does (a cancel): once received whole, it takes effect even when
/// its caller closes the connection at once, which makes hyper drop the handler's future
/// (LC-9, decision 127). `shape`: the error's shape when the runtime drops the task, at
/// shutdown.
async fn to_completion(
    shape: Provider,
    work: impl Future<Output = Response> + Send + 'static,
) -> Response {
    match tokio::spawn(work).await {
        Ok(response) => response,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => ApiError::shutting_down(shape).into_response(),
    }
}

/// The key a caller presented: in a provider SDK's key header (`x-api-key`, `x-goog-api-key`;
/// GM-2), else `Authorization: Bearer KEY`.
fn presented_key(headers: &HeaderMap) -> Option<&[u8]> {
    Provider::ALL
        .iter()
        .map(|p| p.credential_header())
        .filter(|name| *name != "authorization")
        .find_map(|name| headers.get(name))
        .map(|v| v.as_bytes())
        .or_else(|| {
            headers
                .get(axum::http::header::AUTHORIZATION)
                .map(|v| v.as_bytes())
                .filter(|v| v.len() > 7 && v[..7].eq_ignore_ascii_case(b"bearer "))
                .map(|v| &v[7..])
        })
        .map(<[u8]>::trim_ascii)
}

/// Whether `presented` is one of `keys`, compared in constant time against every key so the
/// time taken does not say which one matched (IN-3).
fn key_among<'a>(presented: &[u8], keys: impl Iterator<Item = &'a String>) -> bool {
    let mut found = false;
    for key in keys {
        found |= bool::from(key.as_bytes().ct_eq(presented));
    }
    found
}

fn unauthorized(shape: Provider) -> ApiError {
    // Named the way the caller's SDK sends it: google-genai uses `x-goog-api-key` (GM-2).
    let how = match shape {
        Provider::Gemini => {
            "`x-goog-api-key: KEY` (google-genai's `api_key`), `?key=KEY`, `Authorization: Bearer KEY` or `x-api-key: KEY`"
        }
        _ => "`Authorization: Bearer KEY` or `x-api-key: KEY`",
    };
    ApiError::new(
        shape,
        StatusCode::UNAUTHORIZED,
        "invalid_api_key",
        format!("missing or unknown API key: send a holdfast namespace key as {how}"),
    )
}

/// The caller's namespace (CLI-5): `default` when no namespaces are configured, else the one
/// whose key the caller sent as `Authorization: Bearer KEY` or `x-api-key: KEY`, compared in
/// constant time (IN-3).
///
/// # Errors
/// 401 `invalid_api_key` when namespaces are configured and the key is missing or unknown.
pub(crate) fn namespace(
    config: &Config,
    headers: &HeaderMap,
    shape: Provider,
) -> Result<String, ApiError> {
    namespace_of_key(config, presented_key(headers), shape)
}

/// [`namespace`] for a key presented some other way than in a header (`?key=` on an event
/// stream, which a browser's `EventSource` cannot send headers on).
fn namespace_of_key(
    config: &Config,
    presented: Option<&[u8]>,
    shape: Provider,
) -> Result<String, ApiError> {
    if config.namespaces.is_empty() {
        return Ok("default".into());
    }
    let presented = presented.ok_or_else(|| unauthorized(shape))?;
    let mut found = None;
    for ns in &config.namespaces {
        if key_among(presented, ns.api_keys.iter()) && found.is_none() {
            found = Some(ns.name.clone());
        }
    }
    found.ok_or_else(|| {
        if key_among(presented, config.admin_api_keys.iter()) {
            ApiError::new(
                shape,
                StatusCode::UNAUTHORIZED,
                "invalid_api_key",
                "this is an admin key, which reads the request log of every namespace; a \
                 proxied request needs a namespace's key (`[[namespaces]] api_keys`)",
            )
        } else {
            unauthorized(shape)
        }
    })
}

/// Who reads the log: one namespace's key, or an admin key (`admin_api_keys`), which reads
/// every namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Caller {
    /// A namespace's key (or anyone, when no namespaces are configured).
    Namespace(String),
    /// An admin key.
    Admin,
}

impl Caller {
    /// The namespace a read is limited to: the caller's own, or for an admin the one it asked
    /// for (`?namespace=`), else none (every namespace).
    pub(crate) fn scope(&self, asked: Option<&str>) -> Option<String> {
        match self {
            Caller::Namespace(ns) => Some(ns.clone()),
            Caller::Admin => asked.map(str::to_owned),
        }
    }
}

/// The caller of a log route: an admin key first, else a namespace key (CLI-5).
///
/// # Errors
/// 401 `invalid_api_key` as [`namespace`].
pub(crate) fn caller(
    config: &Config,
    headers: &HeaderMap,
    shape: Provider,
) -> Result<Caller, ApiError> {
    caller_of_key(config, presented_key(headers), shape)
}

/// [`caller`] for a key already taken from the request (`presented`: `None` when it carried
/// none), compared in constant time like a header's.
///
/// # Errors
/// 401 `invalid_api_key` as [`namespace`].
fn caller_of_key(
    config: &Config,
    presented: Option<&[u8]>,
    shape: Provider,
) -> Result<Caller, ApiError> {
    if !config.admin_api_keys.is_empty()
        && let Some(presented) = presented
        && key_among(presented, config.admin_api_keys.iter())
    {
        return Ok(Caller::Admin);
    }
    namespace_of_key(config, presented, shape).map(Caller::Namespace)
}
