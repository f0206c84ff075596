//! OpenAI and OpenAI-compatible servers: chat completions, completions, embeddings, Responses.

use std::sync::LazyLock;

use axum::http::StatusCode;
use memchr::memmem;
use serde_json::{Value, json};

use serde_json::value::RawValue;

use super::{BodyParts, Count, EventParts, Json, Route, Usage, readable};

/// Client headers forwarded upstream and covered by the hash (ID-3a).
pub(super) const FORWARDED_HEADERS: &[&str] =
    &["openai-beta", "openai-organization", "openai-project"];

/// None: OpenAI needs no header the client may leave out.
pub(super) const DEFAULT_HEADERS: &[(&str, &str)] = &[];

/// The request-id response header (RS-5).
pub(super) const REQUEST_ID_HEADER: &str = "x-request-id";

/// The model list, one page.
pub(super) const MODELS_PATH: &str = "/models";

/// A model-list entry.
pub(super) fn model_entry(id: &str) -> Value {
    json!({"id": id, "object": "model", "created": 0, "owned_by": "holdfast"})
}

/// The list shape: every model, unpaged.
pub(super) fn models_answer(models: Vec<Value>) -> Value {
    json!({"object": "list", "data": models})
}

/// The header that carries the key (`Provider::credential_header`).
pub(super) const KEY_HEADER: &str = "authorization";

/// `Authorization: Bearer KEY`.
pub(super) fn auth_header(key: &str) -> (&'static str, String) {
    (KEY_HEADER, format!("Bearer {key}"))
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

/// A non-null `error` member, a Responses `event: error`, or a Responses `response.failed`
/// (by its `event:` name or its data's `type`): the provider's own final answer, saying the
/// response failed, is an error event, never a success (LC-7a).
pub(super) fn is_error_event(event: Option<&str>, kind: Option<&str>, error: bool) -> bool {
    error || event == Some("error") || kind == Some("response.failed")
}

/// Chat, completions and embeddings end with `data: [DONE]`; the Responses API with a
/// `response.completed`, `response.incomplete` or `response.failed` event (the provider's own
/// final answers; `response.failed` is also an error event, LC-7a).
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

/// Embeddings hold `data`, Responses `output`, chat and completions `choices`: arrays, all.
pub(super) fn result_members(route: Route) -> &'static [(&'static str, Json)] {
    match route {
        Route::OpenaiEmbeddings => &[("data", Json::Array)],
        Route::OpenaiResponses => &[("output", Json::Array)],
        _ => &[("choices", Json::Array)],
    }
}

/// A chat or completions answer holds at least one choice (`n` is at least 1): one whose
/// `choices` is empty answered nothing, and `choices[0]` raises in every SDK (decision 143).
pub(super) fn empty_result_answers_nothing(route: Route) -> bool {
    matches!(route, Route::OpenaiChat | Route::OpenaiCompletions)
}

/// Chat and completions chunks all carry `choices`; Responses events are told by their `type`.
pub(super) fn stream_events_carry_choices(route: Route) -> bool {
    matches!(route, Route::OpenaiChat | Route::OpenaiCompletions)
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
    let response: Response<'_> = serde_json::from_str(event.response?).ok()?;
    response.id.map(std::borrow::Cow::into_owned)
}

/// A Responses body is the response object: `{"object": "response", "id": ...}`.
pub(super) fn answer_id_of_body(route: Route, body: &BodyParts<'_>) -> Option<String> {
    (route == Route::OpenaiResponses && body.object == Some("response"))
        .then(|| body.id.map(str::to_owned))
        .flatten()
}

/// OpenAI's usage objects, both conventions: chat, completions and embeddings
/// (`prompt_tokens`, `completion_tokens`, `*_details`) and the Responses API (`input_tokens`,
/// `output_tokens`, `*_details`). Each member is read on its own: a `*_details` that is `null`
/// or not an object, or a count that is not one, costs only itself (RD-9).
pub(super) fn usage_of(raw: &str) -> Option<Usage> {
    #[derive(serde::Deserialize, Default)]
    #[serde(default)]
    struct Details {
        cached_tokens: Count,
        cache_write_tokens: Count,
        reasoning_tokens: Count,
    }
    #[derive(serde::Deserialize, Default)]
    #[serde(default)]
    struct Raw {
        prompt_tokens: Count,
        completion_tokens: Count,
        input_tokens: Count,
        output_tokens: Count,
        #[serde(deserialize_with = "readable")]
        prompt_tokens_details: Option<Details>,
        #[serde(deserialize_with = "readable")]
        completion_tokens_details: Option<Details>,
        #[serde(deserialize_with = "readable")]
        input_tokens_details: Option<Details>,
        #[serde(deserialize_with = "readable")]
        output_tokens_details: Option<Details>,
    }
    let raw: Raw = serde_json::from_str(raw).ok()?;
    let input = raw
        .prompt_tokens_details
        .or(raw.input_tokens_details)
        .unwrap_or_default();
    let output = raw
        .completion_tokens_details
        .or(raw.output_tokens_details)
        .unwrap_or_default();
    let usage = Usage {
        input_tokens: raw.prompt_tokens.get().or(raw.input_tokens.get()),
        output_tokens: raw.completion_tokens.get().or(raw.output_tokens.get()),
        cached_input_tokens: input.cached_tokens.get(),
        cache_write_tokens: input.cache_write_tokens.get(),
        reasoning_tokens: output.reasoning_tokens.get(),
        cache_write_1h_tokens: None,
    };
    (!usage.is_empty()).then_some(usage)
}

/// Chat and completions streams report usage in a chunk of their own (when the request asked
/// with `stream_options.include_usage`); Responses streams in the response object of their final
/// event (`response.completed`, `.incomplete`, `.failed`).
pub(super) fn usage_of_event(route: Route, event: &EventParts<'_>) -> Option<Usage> {
    match route {
        Route::OpenaiResponses => {
            #[derive(serde::Deserialize)]
            struct Response<'a> {
                #[serde(borrow)]
                usage: Option<&'a RawValue>,
            }
            let response: Response<'_> = serde_json::from_str(event.response?).ok()?;
            usage_of(response.usage?.get())
        }
        _ => usage_of(event.usage?),
    }
}

/// A chat chunk's `choices[0].delta.content`, a completion chunk's `choices[0].text`, a
/// Responses `response.output_text.delta`'s `delta`.
pub(super) fn text_of_event(route: Route, kind: Option<&str>, data: &Value) -> Option<String> {
    let text = match route {
        Route::OpenaiResponses if kind == Some("response.output_text.delta") => &data["delta"],
        Route::OpenaiResponses => return None,
        Route::OpenaiCompletions => &data["choices"][0]["text"],
        _ => &data["choices"][0]["delta"]["content"],
    };
    text.as_str().map(str::to_owned)
}

/// Whether a chat or completions stream event is the usage chunk `include_usage` asks for:
/// `choices` an empty array and `usage` set. Scans for the empty `choices` before parsing, so
/// the other events of a stream cost a substring search.
pub(super) fn is_usage_chunk(data: &str) -> bool {
    static CHOICES: LazyLock<memmem::Finder<'static>> =
        LazyLock::new(|| memmem::Finder::new(b"\"choices\""));
    let Some(at) = CHOICES.find(data.as_bytes()) else {
        return false;
    };
    let rest = data[at + "\"choices\"".len()..].trim_start();
    let Some(rest) = rest.strip_prefix(':') else {
        return false;
    };
    let Some(rest) = rest.trim_start().strip_prefix('[') else {
        return false;
    };
    if !rest.trim_start().starts_with(']') {
        return false;
    }
    serde_json::from_str::<Value>(data).is_ok_and(|event| {
        event["choices"].as_array().is_some_and(Vec::is_empty) && event["usage"].is_object()
    })
}

/// Chat and completions streams carry a usage chunk only with
/// `stream_options.include_usage: true`.
pub(super) fn stream_usage_request(route: Route) -> Option<&'static str> {
    matches!(route, Route::OpenaiChat | Route::OpenaiCompletions)
        .then_some(r#""stream_options":{"include_usage":true}"#)
}
