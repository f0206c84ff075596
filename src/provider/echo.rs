//! A provider compiled only in the library's tests: it proves the provider boundary
//! (docs/architecture.md, "How to add a provider"). Everything it needs is this file, one arm per
//! `Provider` and `Route` method in `mod.rs`, and `kind = "echo"` in a config; no line in `http`,
//! `worker`, `upstream` or `store` knows it. `app::tests` runs it through the whole pipeline
//! against a tiny upstream of its own.
//!
//! Its API: `POST /echo/say` with `{"model", "text", "stream"?}` answers `{"say", "usage"}`; a
//! stream is named events `piece` (`{"say"}`), ended by `said` (`{"usage"}`); errors are
//! `{"oops", "code"}`, in a stream `event: oops`; the key travels in `x-echo-key`.

use axum::http::HeaderMap;
use serde_json::{Value, json};

use super::{EventParts, Json, Usage};

/// Changes what the echo says, so it is forwarded and hashed (ID-3a).
pub(super) const FORWARDED_HEADERS: &[&str] = &["echo-mood"];

/// None.
pub(super) const DEFAULT_HEADERS: &[(&str, &str)] = &[];

/// The request-id response header (RS-5).
pub(super) const REQUEST_ID_HEADER: &str = "echo-request-id";

/// The event that completes a stream.
pub(super) const STREAM_END: &str = "said";

/// An answer holds what was said.
pub(super) const RESULT_MEMBERS: &[(&str, Json)] = &[("say", Json::String)];

/// The client path of its one route.
pub(super) const SAY_PATH: &str = "/echo/say";

/// Paths whose clients speak echo.
pub(super) fn owns_path(path: &str) -> bool {
    path.starts_with("/echo")
}

/// A call from an echo client to a shared path carries its key header.
pub(super) fn owns_call(headers: &HeaderMap) -> bool {
    headers.contains_key(KEY_HEADER)
}

/// The header that carries the key (`Provider::credential_header`).
pub(super) const KEY_HEADER: &str = "x-echo-key";

/// `x-echo-key: KEY`.
pub(super) fn auth_header(key: &str) -> (&'static str, String) {
    (KEY_HEADER, key.to_string())
}

/// A model-list entry.
pub(super) fn model_entry(id: &str) -> Value {
    json!({"id": id})
}

/// The list shape.
pub(super) fn models_answer(models: Vec<Value>) -> Value {
    json!({"data": models})
}

/// `{"oops", "code"}`.
pub(super) fn error_body(code: &str, message: &str) -> Value {
    json!({"oops": message, "code": code})
}

/// `event: oops`.
pub(super) fn error_event(code: &str, message: &str) -> (Option<&'static str>, String) {
    (Some("oops"), error_body(code, message).to_string())
}

/// `event: oops`, or a non-null `error` member.
pub(super) fn is_error_event(event: Option<&str>, error: bool) -> bool {
    error || event == Some("oops")
}

/// `said`, by its event name.
pub(super) fn ends_stream(kind: Option<&str>) -> bool {
    kind == Some(STREAM_END)
}

/// `{"in", "out"}`.
pub(super) fn usage_of(raw: &str) -> Option<Usage> {
    #[derive(serde::Deserialize)]
    struct Raw {
        #[serde(rename = "in")]
        input: Option<u64>,
        #[serde(rename = "out")]
        output: Option<u64>,
    }
    let raw: Raw = serde_json::from_str(raw).ok()?;
    let usage = Usage {
        input_tokens: raw.input,
        output_tokens: raw.output,
        ..Usage::default()
    };
    (!usage.is_empty()).then_some(usage)
}

/// `said` carries the usage.
pub(super) fn usage_of_event(event: &EventParts<'_>) -> Option<Usage> {
    (event.kind == Some(STREAM_END))
        .then(|| usage_of(event.usage?))
        .flatten()
}

/// A `piece`'s `say`.
pub(super) fn text_of_event(data: &Value) -> Option<String> {
    data["say"].as_str().map(str::to_owned)
}
