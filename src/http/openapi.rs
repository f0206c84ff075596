//! `GET /openapi.json`: the OpenAPI 3.1 description of every route [`super::router`] serves.
//!
//! The document is a static file, `src/http/openapi.json`, compiled in with `include_str!`, so
//! what is served is exactly what is reviewed. It describes holdfast's own shapes (the record of
//! `GET /requests/{id}`, the list, errors, headers) precisely and the provider routes'
//! bodies permissively: those belong to the provider.
//!
//! The router is built from one table (`fixed_routes` in `http/mod.rs`), and the black-box test
//! `tests/api/openapi.rs` checks the document against it both ways: every route of the table is
//! in the document and is served (not the 404 fallback, not 405), and every operation in the
//! document is served. A route added to the table without the document fails that test.

use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};

/// The OpenAPI 3.1 document, as served.
pub(crate) const DOCUMENT: &str = include_str!("openapi.json");

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
