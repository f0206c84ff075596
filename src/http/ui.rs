//! The web page at `GET /ui` (docs/ui.md): one HTML file, one script and one stylesheet,
//! compiled into the binary. The page has no data of its own: its script reads the API
//! (`/requests`, `/requests/{id}`, `/usage`, cancel) with the key its user types, so it sees what
//! that key sees.
//!
//! Off unless `ui = true`: then every `/ui` path answers exactly as an unknown path does (the
//! routes stay in the route table so that `/openapi.json` documents them). Every answer carries
//! a Content-Security-Policy that allows only this origin's script, style and connections — no
//! inline script or style, no framing — so text from prompts and answers, which the script
//! renders as text nodes only, cannot run even if a rendering mistake let markup through.

use axum::extract::State;
use axum::http::{HeaderName, HeaderValue, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, get};

use super::{AppState, method_not_allowed, not_found};

/// The page.
const INDEX_HTML: &str = include_str!("ui/index.html");
/// Its script (plain modern JavaScript, no build step, no library).
const APP_JS: &str = include_str!("ui/app.js");
/// Its stylesheet.
const APP_CSS: &str = include_str!("ui/app.css");
/// Its icon (so the browser does not ask for a `/favicon.ico` that is not there).
const FAVICON_SVG: &str = include_str!("ui/favicon.svg");

/// The Content-Security-Policy of every `/ui` answer: this origin only, nothing inline.
pub(crate) const CONTENT_SECURITY_POLICY: &str = "default-src 'self'; script-src 'self'; \
     style-src 'self'; img-src 'self'; connect-src 'self'; object-src 'none'; base-uri 'none'; \
     form-action 'none'; frame-ancestors 'none'";

/// The `/ui` routes of the route table: (path, handler). A method other than GET and HEAD is
/// 405 when the page is on, and 404 like any unknown path when it is off.
pub(super) fn routes() -> [(&'static str, MethodRouter<AppState>); 4] {
    [
        ("/ui", asset("text/html; charset=utf-8", INDEX_HTML)),
        (
            "/ui/app.js",
            asset("text/javascript; charset=utf-8", APP_JS),
        ),
        ("/ui/app.css", asset("text/css; charset=utf-8", APP_CSS)),
        ("/ui/favicon.svg", asset("image/svg+xml", FAVICON_SVG)),
    ]
}

fn asset(content_type: &'static str, body: &'static str) -> MethodRouter<AppState> {
    get(move |State(state): State<AppState>, uri: Uri| async move {
        if !state.config.ui {
            return not_found(uri).await;
        }
        serve(content_type, body)
    })
    .fallback(|State(state): State<AppState>, uri: Uri| async move {
        if state.config.ui {
            method_not_allowed(uri).await
        } else {
            not_found(uri).await
        }
    })
}

/// One asset with the page's security headers. No cookies are ever set.
fn serve(content_type: &'static str, body: &'static str) -> Response {
    let headers = [
        (header::CONTENT_TYPE, content_type),
        (header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::REFERRER_POLICY, "no-referrer"),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::CACHE_CONTROL, "no-cache"),
        (
            HeaderName::from_static("cross-origin-resource-policy"),
            "same-origin",
        ),
    ]
    .map(|(name, value)| (name, HeaderValue::from_static(value)));
    (headers, body).into_response()
}
