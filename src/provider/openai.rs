//! OpenAI and OpenAI-compatible servers: chat completions, completions, embeddings, Responses.

use axum::http::StatusCode;
use serde_json::{Value, json};

use super::{BodyParts, EventParts, Route};

/// Client headers forwarded upstream and covered by the hash (ID-3a).
pub(super) const FORWARDED_HEADERS: &[&str] =
    &["openai-beta", "openai-organization", "openai-project"];

/// None: OpenAI needs no header the client may leave out.
pub(super) const DEFAULT_HEADERS: &[(&str, &str)] = &[];

/// The request-id response header (RS-5).
pub(super) const REQUEST_ID_HEADER: &str = "x-request-id";

/// `Authorization: Bearer KEY`.
pub(super) fn auth_header(key: &str) -> (&'static str, String) {
    ("authorization", format!("Bearer {key}"))
}

/// `{"error":{"message","type","param","code"}}`; `type` is OpenAI's for the status, `code`
/// holdfast's cause.
pub(super) fn error_body(status: StatusCode, code: &str, message: &str) -> Value {
    let kind = match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        429 => "rate_limit_error",
        400..=499 => "invalid_request_error",
        _ => "server_error",
    };
    json!({"error": {"message": message, "type": kind, "param": null, "code": code}})
}

/// A `data:` object with an `error` member: the OpenAI SDKs raise on it.
pub(super) fn error_event(code: &str, message: &str) -> (Option<&'static str>, String) {
    let data =
        json!({"error": {"message": message, "type": "server_error", "param": null, "code": code}});
    (None, data.to_string())
}

/// A non-null `error` member, or a Responses `event: error`.
pub(super) fn is_error_event(event: Option<&str>, error: bool) -> bool {
    error || event == Some("error")
}

/// Chat, completions and embeddings end with `data: [DONE]`; the Responses API with a
/// `response.completed`, `response.incomplete` or `response.failed` event (the last two are
/// the provider's own final answers).
pub(super) fn ends_stream(route: Route, data: &str, kind: Option<&str>) -> bool {
    match route {
        Route::OpenaiResponses => matches!(
            kind,
            Some("response.completed" | "response.incomplete" | "response.failed")
        ),
        _ => data == "[DONE]",
    }
}

pub(super) fn stream_end_name(route: Route) -> &'static str {
    match route {
        Route::OpenaiResponses => "response.completed",
        _ => "data: [DONE]",
    }
}

pub(super) fn result_members(route: Route) -> &'static [&'static str] {
    match route {
        Route::OpenaiEmbeddings => &["data"],
        Route::OpenaiResponses => &["output"],
        _ => &["choices"],
    }
}

/// The Responses API's answers have ids its API retrieves them by (`GET /v1/responses/{id}`).
pub(super) fn keeps_answer_ids(route: Route) -> bool {
    route == Route::OpenaiResponses
}

/// A Responses lifecycle event (`response.created`, `response.queued`, ...) carries the
/// response object, whose `id` is the answer's.
pub(super) fn answer_id_of_event(route: Route, event: &EventParts<'_>) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Response<'a> {
        #[serde(borrow)]
        id: Option<std::borrow::Cow<'a, str>>,
    }
    if route != Route::OpenaiResponses || !event.kind.is_some_and(|k| k.starts_with("response.")) {
        return None;
    }
    let response: Response<'_> = serde_json::from_str(event.response?.get()).ok()?;
    response.id.map(std::borrow::Cow::into_owned)
}

/// A Responses body is the response object: `{"object": "response", "id": ...}`.
pub(super) fn answer_id_of_body(route: Route, body: &BodyParts<'_>) -> Option<String> {
    (route == Route::OpenaiResponses && body.object == Some("response"))
        .then(|| body.id.map(str::to_owned))
        .flatten()
}
