//! `GET /openapi.json`: the OpenAPI 3.1 description of every route [`super::router`] serves.
//!
//! The document is a static file, `src/http/openapi.json`, compiled in with `include_str!`, so
//! what is served is exactly what is reviewed. It describes holdfast's own shapes (the record of
//! `GET /requests/{id}`, the list, errors, headers) precisely and the provider routes'
//! bodies permissively: those belong to the provider.
//!
//! Nothing derives the document from the router. Instead [`ROUTES`] lists every (method, path)
//! the router serves, by hand, and the black-box test `tests/api/openapi.rs` checks both ways:
//! each entry of [`ROUTES`] is in the document and is served (not the 404 fallback, not 405),
//! and each operation in the document is served. Adding a route to `router()` without adding it
//! here and to the document is caught only if you add it to [`ROUTES`]; keep the three in step.

use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};

/// The OpenAPI 3.1 document, as served.
pub(crate) const DOCUMENT: &str = include_str!("openapi.json");

/// Every (method, path) the router serves, paths in the router's `{param}` syntax.
/// Not used by the router; kept for the test that checks the document against the server.
pub const ROUTES: &[(&str, &str)] = &[
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/embeddings"),
    ("POST", "/v1/responses"),
    ("POST", "/v1/messages"),
    ("GET", "/requests"),
    ("GET", "/requests/{id}"),
    ("POST", "/requests/{id}/cancel"),
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/metrics"),
    ("GET", "/openapi.json"),
];

/// `GET /openapi.json`: [`DOCUMENT`] as `application/json`. Needs no API key.
pub(crate) async fn serve() -> Response {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        DOCUMENT,
    )
        .into_response()
}
