//! Google's Gemini API (the Developer API's REST shape, `generativelanguage.googleapis.com`):
//! `generateContent` and `streamGenerateContent?alt=sse` under `/v1beta` and `/v1`.
//!
//! What sets it apart from the other providers (SPEC GM-1..GM-5): the model is in the URL path
//! (`/v1beta/models/{model}:generateContent`), the key travels in `x-goog-api-key`, the stream
//! is chosen by the path rather than the body, and a stream has no final event: it is complete
//! when a chunk carrying a `finishReason` (or a blocked prompt's `promptFeedback.blockReason`)
//! has arrived and the body then ends cleanly (GM-3).

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode};
use serde_json::value::RawValue;
use serde_json::{Value, json};

use super::{Count, EventParts, Json, Route, Usage};

/// None: no client header changes what the Gemini API answers to a key-authenticated call
/// (GM-2, decision 57). `x-goog-api-client` is the SDK's telemetry and `X-Server-Timeout` the
/// SDK's own deadline, which a durable request must not inherit.
pub(super) const FORWARDED_HEADERS: &[&str] = &[];

/// None.
pub(super) const DEFAULT_HEADERS: &[(&str, &str)] = &[];

/// The header Google's SDKs send the key in, and holdfast sends the backend's key in.
pub(super) const KEY_HEADER: &str = "x-goog-api-key";

/// The answer's result members: `candidates`, or `promptFeedback` alone for a prompt that was
/// blocked before any candidate was generated, or `usageMetadata` alone for an answer in which
/// the model generated nothing: Google leaves empty members out, and Gemini 2.5 answers some
/// prompts with no candidate and no feedback, only the usage it bills (GM-3, decision 90).
pub(super) const RESULT_MEMBERS: &[(&str, Json)] = &[
    ("candidates", Json::Array),
    ("promptFeedback", Json::Object),
    ("usageMetadata", Json::Object),
];

/// The members a stream chunk carries: a chunk with none of them is not this route's (GM-3).
pub(super) const STREAM_EVENT_MEMBERS: &[&str] = &["candidates", "promptFeedback", "usageMetadata"];

/// How messages name what completes a Gemini stream.
pub(super) const STREAM_END: &str = "a chunk with `finishReason`, then the end of the body";

/// The API versions holdfast serves, as the first path segment.
pub(super) const VERSIONS: [&str; 2] = ["/v1beta", "/v1"];

/// The client path of each route, in the documentation's `{model}` form.
pub(super) fn client_path(route: Route) -> &'static str {
    match route {
        Route::GeminiGenerate => "/v1beta/models/{model}:generateContent",
        Route::GeminiStream => "/v1beta/models/{model}:streamGenerateContent",
        Route::GeminiV1Generate => "/v1/models/{model}:generateContent",
        Route::GeminiV1Stream => "/v1/models/{model}:streamGenerateContent",
        Route::OpenaiChat
        | Route::OpenaiCompletions
        | Route::OpenaiEmbeddings
        | Route::OpenaiResponses
        | Route::AnthropicMessages => "",
        #[cfg(test)]
        Route::EchoSay => "",
    }
}

/// The path a route is routed under: `{call}` is `{model}:{method}` (the router cannot match a
/// parameter followed by a literal in one segment).
pub(super) fn router_path(route: Route) -> &'static str {
    if client_path(route).starts_with("/v1beta/") {
        "/v1beta/models/{call}"
    } else {
        "/v1/models/{call}"
    }
}

/// Whether the route streams (`streamGenerateContent`): chosen by the path, not the body.
pub(super) fn streams(route: Route) -> bool {
    matches!(route, Route::GeminiStream | Route::GeminiV1Stream)
}

/// The upstream path and query for `model`: the client's path with the model in it, under the
/// backend's `base_url`, which has no version prefix (decision 57); a stream asks for SSE.
///
/// Every model that reaches here passed [`is_path_model`] (GM-1, decision 153); any other byte
/// would still be percent-encoded, so that no model can name another path or add a query.
pub(super) fn upstream_path(route: Route, model: &str) -> String {
    let segment = percent_encoding::utf8_percent_encode(model, NOT_IN_PATH_MODEL);
    let path = client_path(route).replace("{model}", &segment.to_string());
    if streams(route) {
        format!("{path}?alt=sse")
    } else {
        path
    }
}

/// What [`upstream_path`] encodes in a model: all but what [`is_path_model`] allows.
const NOT_IN_PATH_MODEL: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'.')
    .remove(b'-')
    .remove(b'_');

/// Whether `model` can stand in a path segment as sent: letters, digits, `.`, `-`, `_`, at
/// most 256 characters (GM-1).
pub(super) fn is_path_model(model: &str) -> bool {
    !model.is_empty()
        && model.len() <= 256
        && model
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'))
}

/// A call from Google's SDKs to a path other providers serve too (`GET /v1/models`): they send
/// `x-goog-api-key` (GM-4).
pub(super) fn owns_call(headers: &HeaderMap) -> bool {
    headers.contains_key(KEY_HEADER)
}

/// The methods Google's API calls on a model, `models/{model}:{method}` (v1beta's and v1's).
/// A Gemini model name has no colon (GM-1), so the method is what follows the last one; an
/// OpenAI fine-tuned model id has colons of its own (`ft:gpt-4o-mini-2024-07-18:my-org::abc123`)
/// and ends in none of these (IN-1, decision 75).
const MODEL_METHODS: [&str; 16] = [
    "generateContent",
    "streamGenerateContent",
    "countTokens",
    "embedContent",
    "batchEmbedContents",
    "batchGenerateContent",
    "asyncBatchEmbedContent",
    "predict",
    "predictLongRunning",
    "generateAnswer",
    "generateMessage",
    "countMessageTokens",
    "generateText",
    "countTextTokens",
    "embedText",
    "batchEmbedText",
];

/// Paths whose clients are Google's SDKs: everything under `/v1beta`, and `/v1/models/...`
/// calls whose suffix after the last colon is one of Google's model methods (IN-1). Any other
/// `/v1/models/{id}` is OpenAI's (or Anthropic's, told apart by headers), colons and all.
pub(super) fn owns_path(path: &str) -> bool {
    path.starts_with("/v1beta/")
        || path
            .strip_prefix("/v1/models/")
            .and_then(|call| call.rsplit_once(':'))
            .is_some_and(|(_, method)| MODEL_METHODS.contains(&method))
}

/// A Gemini model call without its version (`/models/{model}:generateContent`): a client whose
/// base URL carries the version (the Vercel AI SDK's `@ai-sdk/google`) given holdfast's address
/// alone, as Google's own SDKs take it (IN-1).
pub(super) fn lacks_version(path: &str) -> bool {
    path.strip_prefix("/models/")
        .and_then(|call| call.rsplit_once(':'))
        .is_some_and(|(_, method)| MODEL_METHODS.contains(&method))
}

/// A proxied Gemini stream's keep-alive (RS-4): a blank line, which google-genai for Python
/// skips; it parses any other line that does not start with `data: ` as JSON, comments too.
pub(super) const STREAM_KEEPALIVE: &[u8] = b"\n";

/// `x-goog-api-key: KEY`.
pub(super) fn auth_header(key: &str) -> (&'static str, String) {
    (KEY_HEADER, key.to_string())
}

/// One page of the model list, up to 1,000 models, from `pageToken` `after`.
pub(super) fn models_page_path(after: Option<&str>) -> String {
    match after {
        Some(token) => format!("/v1beta/models?pageSize=1000&pageToken={token}"),
        None => "/v1beta/models?pageSize=1000".to_string(),
    }
}

/// One model's entry, from `v1beta` as the list is ([`models_page_path`]): the same `Model`
/// whichever version the client called.
pub(super) fn model_path(segment: &str) -> String {
    format!("/v1beta/models/{segment}")
}

/// The page's `nextPageToken`, when it has a non-empty one.
pub(super) fn next_models_page(page: &Value) -> Option<String> {
    page["nextPageToken"]
        .as_str()
        .filter(|t| !t.is_empty())
        .map(str::to_owned)
}

/// The models of a fetched page (`models`).
pub(super) fn models_of_page(page: &Value) -> Option<&Vec<Value>> {
    page["models"].as_array()
}

/// A model's id in the merged list: its `name` without the `models/` prefix.
pub(super) fn model_id(model: &Value) -> Option<&str> {
    let name = model["name"].as_str()?;
    Some(name.strip_prefix("models/").unwrap_or(name))
}

/// A model-list entry for an alias.
pub(super) fn model_entry(id: &str) -> Value {
    json!({
        "name": format!("models/{id}"),
        "displayName": id,
        "supportedGenerationMethods": ["generateContent", "streamGenerateContent", "countTokens"],
    })
}

/// One page of the list shape: `pageSize` (absent, empty or 0: 50; above 1000: 1000) from
/// `pageToken` (the position, as holdfast writes it; empty or absent: the first page), with
/// `nextPageToken` while more follow.
///
/// # Errors
/// The code and message of a 400: `invalid_page_size` for a `pageSize` that is not a
/// non-negative integer, `invalid_page_token` for a `pageToken` that is not a position holdfast
/// writes — Google refuses both with `INVALID_ARGUMENT` rather than guess or start over (GM-4).
/// A position past the end (the list shrank since the token was issued) is an empty last page.
pub(super) fn models_page(
    models: Vec<Value>,
    query: &HashMap<String, String>,
) -> Result<Value, (&'static str, String)> {
    let size = match query.get("pageSize").map(String::as_str) {
        None | Some("") => 50,
        Some(size) => match size.parse::<i64>() {
            Ok(0) => 50,
            Ok(n) if n > 0 => usize::try_from(n).unwrap_or(1000).min(1000),
            _ => {
                return Err((
                    "invalid_page_size",
                    format!("pageSize {size:?} is not a non-negative integer"),
                ));
            }
        },
    };
    let start = match query.get("pageToken").map(String::as_str) {
        None | Some("") => 0,
        Some(token) => token
            .parse::<usize>()
            .ok()
            .filter(|_| token.bytes().all(|b| b.is_ascii_digit()))
            .ok_or_else(|| {
                (
                    "invalid_page_token",
                    format!(
                        "pageToken {token:?} is not a page token holdfast issued: pass a \
                         nextPageToken of this list, or none for the first page"
                    ),
                )
            })?
            .min(models.len()),
    };
    let end = (start + size).min(models.len());
    let mut page = json!({"models": models[start..end].to_vec()});
    if end < models.len() {
        page["nextPageToken"] = Value::String(end.to_string());
    }
    Ok(page)
}

/// Google's canonical status name for an HTTP status (`google.rpc.Code`).
fn status_name(status: u16) -> &'static str {
    match status {
        400 | 413 | 422 => "INVALID_ARGUMENT",
        401 => "UNAUTHENTICATED",
        403 => "PERMISSION_DENIED",
        404 => "NOT_FOUND",
        405 | 501 => "UNIMPLEMENTED",
        409 => "ABORTED",
        429 => "RESOURCE_EXHAUSTED",
        499 => "CANCELLED",
        503 => "UNAVAILABLE",
        504 => "DEADLINE_EXCEEDED",
        _ if (400..500).contains(&status) => "FAILED_PRECONDITION",
        _ => "INTERNAL",
    }
}

/// `{"error":{"code","message","status","details"}}` (GM-5): Google's shape, with holdfast's
/// cause as the `reason` of a `google.rpc.ErrorInfo` detail, where Google puts machine-readable
/// causes.
pub(super) fn error_body(status: StatusCode, code: &str, message: &str) -> Value {
    json!({"error": {
        "code": status.as_u16(),
        "message": message,
        "status": status_name(status.as_u16()),
        "details": [{
            "@type": "type.googleapis.com/google.rpc.ErrorInfo",
            "reason": code,
            "domain": "holdfast",
        }],
    }})
}

/// The HTTP status an error event carries for holdfast's cause `code`: 503 where a retry
/// attaches to the request's next attempt, 500 otherwise.
fn event_status(code: &str) -> StatusCode {
    match code {
        "attempt_abandoned" | "shutting_down" | "store_unavailable" => {
            StatusCode::SERVICE_UNAVAILABLE
        }
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// A `data:` chunk that is an error object, `error` first: google-genai raises `APIError` on a
/// chunk whose JSON starts with `{"error":` (GM-5).
pub(super) fn error_event(code: &str, message: &str) -> (Option<&'static str>, String) {
    (
        None,
        error_body(event_status(code), code, message).to_string(),
    )
}

/// The `retryDelay` of a `google.rpc.RetryInfo` detail in an error body (`{"error": {"details":
/// [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "45.837906927s"}]}}`):
/// Google answers a quota 429 without `retry-after` and says there how long to wait (LC-5,
/// decision 88). A protobuf `Duration` in its JSON form: decimal seconds, up to nine fractional
/// digits, then `s`. `None` when the body has no such detail or it cannot be read.
pub(super) fn retry_delay_of_body(body: &[u8]) -> Option<Duration> {
    #[derive(serde::Deserialize)]
    struct Body {
        error: Error,
    }
    #[derive(serde::Deserialize)]
    struct Error {
        #[serde(default)]
        details: Vec<Value>,
    }
    let body: Body = serde_json::from_slice(body).ok()?;
    body.error.details.iter().find_map(|detail| {
        let kind = detail["@type"].as_str()?;
        if kind.rsplit('/').next() != Some("google.rpc.RetryInfo") {
            return None;
        }
        parse_duration(detail["retryDelay"].as_str()?)
    })
}

/// A protobuf `Duration` in JSON (`"3s"`, `"45.837906927s"`): non-negative only.
fn parse_duration(text: &str) -> Option<Duration> {
    let number = text.strip_suffix('s')?;
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty()
        || !whole.bytes().all(|b| b.is_ascii_digit())
        || fraction.len() > 9
        || !fraction.bytes().all(|b| b.is_ascii_digit())
    {
        return None;
    }
    let secs: u64 = whole.parse().ok()?;
    let nanos: u32 = if fraction.is_empty() {
        0
    } else {
        format!("{fraction:0<9}").parse().ok()?
    };
    Some(Duration::new(secs, nanos))
}

/// Whether an event reports an error: a non-null `error` member.
pub(super) fn is_error_event(error: bool) -> bool {
    error
}

/// What one stream chunk tells of the answer (GM-3), its `candidates` read once.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct AnswerMarks {
    /// It finishes the answer: a candidate with a `finishReason`, or a prompt feedback with a
    /// `blockReason`. The stream is complete when the body then ends cleanly.
    pub finishes: bool,
    /// It shows part of the answer a reader is given: a candidate with a part that is not a
    /// thought and holds more than an empty text (a `thoughtSignature` carrier, `{"text":""}`,
    /// shows nothing). Once such a part has come, only a `finishReason` finishes the answer: a
    /// usage report after it is no ending, since Google ends a visible answer with its reason
    /// and leaves the reason out only on a turn of thoughts only (decision 119).
    pub shows: bool,
    /// The candidates it finishes and leaves open, one bit per `index` (decision 142).
    pub candidates: Candidates,
}

/// The candidates a chunk finishes and those it leaves open, one bit per `index` (0 when
/// absent; 63 stands for any index past it): a candidate with a `finishReason` is finished, one
/// that shows part of the answer without one is open, until a later chunk finishes it. With
/// `candidateCount` above 1 each candidate ends with its own reason, so a stream is complete
/// only when none is left open (GM-3, decision 142).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Candidates {
    pub finished: u64,
    pub open: u64,
}

/// What one stream chunk tells of the answer ([`AnswerMarks`]), each of its candidates read
/// once. A `candidates` whose parts are not the shape a reader is shown still finishes the
/// answer by its reasons, as it always did: read again for them alone.
pub(super) fn answer_marks(event: &EventParts<'_>) -> AnswerMarks {
    #[derive(serde::Deserialize)]
    struct Feedback<'a> {
        #[serde(rename = "blockReason", borrow)]
        block_reason: Option<&'a RawValue>,
    }
    let mut marks = AnswerMarks::default();
    if let Some(raw) = event.candidates {
        match serde_json::from_str::<Vec<Candidate<'_>>>(raw) {
            Ok(candidates) => {
                for candidate in &candidates {
                    let index = candidate
                        .index
                        .and_then(|i| i.get().parse::<u64>().ok())
                        .unwrap_or(0);
                    let bit = 1u64 << index.min(63);
                    let shows = candidate.shows();
                    marks.shows |= shows;
                    if is_set(candidate.finish_reason) {
                        marks.finishes = true;
                        marks.candidates.finished |= bit;
                    } else if shows {
                        marks.candidates.open |= bit;
                    }
                }
            }
            Err(_) => {
                #[derive(serde::Deserialize)]
                struct Reason<'a> {
                    #[serde(rename = "finishReason", borrow)]
                    finish_reason: Option<&'a RawValue>,
                }
                marks.finishes = serde_json::from_str::<Vec<Reason<'_>>>(raw)
                    .is_ok_and(|c| c.iter().any(|c| is_set(c.finish_reason)));
            }
        }
    }
    marks.finishes = marks.finishes
        || event.prompt_feedback.is_some_and(|raw| {
            serde_json::from_str::<Feedback<'_>>(raw).is_ok_and(|f| is_set(f.block_reason))
        });
    marks
}

/// Whether a reason member is set: present, not `null`, not empty.
fn is_set(value: Option<&RawValue>) -> bool {
    value.is_some_and(|v| v.get() != "null" && v.get() != "\"\"")
}

/// A candidate of a stream chunk, as [`answer_marks`] reads it.
#[derive(serde::Deserialize)]
struct Candidate<'a> {
    #[serde(borrow)]
    content: Option<Content<'a>>,
    #[serde(rename = "finishReason", borrow)]
    finish_reason: Option<&'a RawValue>,
    /// Read as it comes: a compatible server's odd `index` must not lose the candidate.
    #[serde(borrow)]
    index: Option<&'a RawValue>,
}

#[derive(serde::Deserialize)]
struct Content<'a> {
    #[serde(borrow)]
    parts: Option<Vec<BTreeMap<Cow<'a, str>, &'a RawValue>>>,
}

impl Candidate<'_> {
    /// Whether it holds a part a reader is shown ([`AnswerMarks::shows`]).
    fn shows(&self) -> bool {
        let shown = |part: &BTreeMap<Cow<'_, str>, &RawValue>| {
            part.get("thought").is_none_or(|t| t.get() != "true")
                && part.iter().any(|(name, value)| match name.as_ref() {
                    "thought" | "thoughtSignature" => false,
                    "text" => !matches!(value.get(), "\"\"" | "null"),
                    _ => value.get() != "null",
                })
        };
        self.content
            .as_ref()
            .and_then(|c| c.parts.as_ref())
            .is_some_and(|parts| parts.iter().any(shown))
    }
}

/// Whether a chunk reports the usage and nothing else: `usageMetadata` holding counts, and
/// neither `candidates` nor `promptFeedback`. Gemini 3 models send one after the answer, the
/// `finishReason` before it or, on a turn of thoughts only, none at all; and a call in which
/// nothing was generated is answered with it alone (decision 90). The stream is complete if the
/// body ends cleanly right after it (GM-3, decision 110).
pub(super) fn is_usage_report(event: &EventParts<'_>) -> bool {
    // An empty list of candidates is none (decision 160): the non-stream answer `{"candidates":
    // [], "usageMetadata": ...}` is a success, and so is the stream of that one chunk.
    let no_candidates = |raw: &str| {
        serde_json::from_str::<Vec<serde::de::IgnoredAny>>(raw).is_ok_and(|c| c.is_empty())
    };
    event.candidates.is_none_or(no_candidates)
        && event.prompt_feedback.is_none()
        && event.usage_metadata.is_some_and(|raw| {
            serde_json::from_str::<serde_json::Map<String, Value>>(raw)
                .is_ok_and(|counts| !counts.is_empty())
        })
}

/// `usageMetadata` normalised (RD-9, GM-3): the input is the prompt (cached content included)
/// plus the tool-use prompt; the output is the candidates plus the thoughts. Each count is read
/// on its own: one that is not a count costs only itself and the sum it is part of.
pub(super) fn usage_of(raw: &str) -> Option<Usage> {
    #[derive(serde::Deserialize, Default)]
    #[serde(default, rename_all = "camelCase")]
    struct Raw {
        prompt_token_count: Count,
        candidates_token_count: Count,
        cached_content_token_count: Count,
        thoughts_token_count: Count,
        tool_use_prompt_token_count: Count,
    }
    let raw: Raw = serde_json::from_str(raw).ok()?;
    let usage = Usage {
        input_tokens: raw.prompt_token_count.plus(raw.tool_use_prompt_token_count),
        output_tokens: raw.candidates_token_count.plus(raw.thoughts_token_count),
        cached_input_tokens: raw.cached_content_token_count.get(),
        cache_write_tokens: None,
        reasoning_tokens: raw.thoughts_token_count.get(),
        cache_write_1h_tokens: None,
    };
    (!usage.is_empty()).then_some(usage)
}

/// Each chunk's `usageMetadata` is the count so far; the last one is the attempt's.
pub(super) fn usage_of_event(event: &EventParts<'_>) -> Option<Usage> {
    usage_of(event.usage_metadata?)
}

/// The text parts of the first candidate, thoughts left out (what the SDKs' `.text` gives).
pub(super) fn text_of_event(data: &Value) -> Option<String> {
    let parts = data["candidates"][0]["content"]["parts"].as_array()?;
    let text: String = parts
        .iter()
        .filter(|p| p["thought"] != true)
        .filter_map(|p| p["text"].as_str())
        .collect();
    (!text.is_empty()).then_some(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chunk_finishes_the_answer_with_a_finish_reason_or_a_block_reason_gm3() {
        let finished = r#"[{"content":{"parts":[{"text":"x"}]},"finishReason":"STOP"}]"#;
        let going = r#"[{"content":{"parts":[{"text":"x"}]}}]"#;
        let blocked = r#"{"blockReason":"SAFETY"}"#;
        fn parts<'a>(c: Option<&'a str>, f: Option<&'a str>) -> EventParts<'a> {
            EventParts {
                candidates: c,
                prompt_feedback: f,
                ..EventParts::default()
            }
        }
        assert!(answer_marks(&parts(Some(finished), None)).finishes);
        assert!(!answer_marks(&parts(Some(going), None)).finishes);
        assert!(answer_marks(&parts(None, Some(blocked))).finishes);
        assert!(!answer_marks(&parts(None, Some("{}"))).finishes);
        assert!(!answer_marks(&parts(None, None)).finishes);
        // Parts of an odd shape: still finished by the reason, showing nothing.
        let odd = r#"[{"content":{"parts":"odd"},"finishReason":"STOP"}]"#;
        assert_eq!(
            answer_marks(&parts(Some(odd), None)),
            AnswerMarks {
                finishes: true,
                ..AnswerMarks::default()
            }
        );
    }

    /// GM-3, decision 119: what a reader is shown of the answer, after which only a
    /// `finishReason` ends the stream; thoughts and signature carriers show nothing.
    #[test]
    fn a_visible_part_shows_the_answer_and_a_thought_does_not_gm3() {
        let shows = |candidates: &str| {
            answer_marks(&EventParts {
                candidates: Some(candidates),
                ..EventParts::default()
            })
            .shows
        };
        assert!(shows(r#"[{"content":{"parts":[{"text":"x"}]}}]"#));
        assert!(shows(
            r#"[{"content":{"parts":[{"functionCall":{"name":"f","args":{}}}]}}]"#
        ));
        assert!(shows(
            r#"[{"content":{"parts":[{"text":"t","thought":true}]}},{"content":{"parts":[{"text":"x"}]}}]"#
        ));
        assert!(!shows(
            r#"[{"content":{"parts":[{"text":"t","thought":true}]}}]"#
        ));
        assert!(!shows(
            r#"[{"content":{"parts":[{"text":"","thoughtSignature":"c2ln"}]}}]"#
        ));
        assert!(!shows(
            r#"[{"content":{"parts":[]}},{"finishReason":"STOP"}]"#
        ));
        assert!(!shows(r#"[{"content":{"role":"model"}}]"#));
        assert!(!answer_marks(&EventParts::default()).shows);
    }

    #[test]
    fn usage_metadata_is_normalised_rd9_gm3() {
        let usage = usage_of(
            r#"{"promptTokenCount":10,"candidatesTokenCount":5,"cachedContentTokenCount":4,
                "thoughtsTokenCount":3,"toolUsePromptTokenCount":2,"totalTokenCount":20}"#,
        )
        .expect("usage");
        assert_eq!(usage.input_tokens, Some(12));
        assert_eq!(usage.output_tokens, Some(8));
        assert_eq!(usage.cached_input_tokens, Some(4));
        assert_eq!(usage.reasoning_tokens, Some(3));
        assert_eq!(usage.cache_write_tokens, None);
        assert_eq!(usage_of("{}"), None);
    }

    #[test]
    fn errors_take_googles_shape_with_the_error_member_first_gm5() {
        let body = error_body(StatusCode::TOO_MANY_REQUESTS, "overloaded", "m");
        assert_eq!(body["error"]["code"], 429);
        assert_eq!(body["error"]["status"], "RESOURCE_EXHAUSTED");
        assert_eq!(body["error"]["details"][0]["reason"], "overloaded");
        let (name, data) = error_event("shutting_down", "bye");
        assert_eq!(name, None);
        assert!(data.starts_with(r#"{"error":"#), "{data}");
        assert!(data.contains("503"), "{data}");
    }

    /// LC-5, decision 88: Google says how long to wait in the body of a 429, as a
    /// `google.rpc.RetryInfo` detail's `retryDelay`, not in `retry-after`.
    #[test]
    fn a_retry_info_details_retry_delay_is_the_providers_hint_lc5() {
        let body = |delay: &str| {
            format!(
                r#"{{"error":{{"code":429,"message":"quota","status":"RESOURCE_EXHAUSTED",
                "details":[{{"@type":"type.googleapis.com/google.rpc.QuotaFailure","violations":[]}},
                {{"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"{delay}"}}]}}}}"#
            )
        };
        for (delay, want) in [
            ("45.837906927s", Some(Duration::new(45, 837_906_927))),
            ("3s", Some(Duration::from_secs(3))),
            ("0.5s", Some(Duration::from_millis(500))),
            ("-1s", None),
            ("3", None),
            ("1.0000000001s", None),
            ("s", None),
            ("1e3s", None),
        ] {
            assert_eq!(
                retry_delay_of_body(body(delay).as_bytes()),
                want,
                "{delay:?}"
            );
        }
        for other in [
            r#"{"error":{"code":429,"message":"m","status":"RESOURCE_EXHAUSTED"}}"#,
            r#"{"error":{"code":503,"details":[{"@type":"type.googleapis.com/google.rpc.ErrorInfo","reason":"x"}]}}"#,
            "not json",
            "[]",
        ] {
            assert_eq!(retry_delay_of_body(other.as_bytes()), None, "{other}");
        }
    }

    #[test]
    fn path_models_are_one_safe_segment_gm1() {
        assert!(is_path_model("gemini-2.5-flash"));
        assert!(is_path_model("gemini-1.5-pro_001"));
        for bad in ["", "a/b", "a%2Fb", "a b", "a:b", "é"] {
            assert!(!is_path_model(bad), "{bad:?}");
        }
    }

    #[test]
    fn the_model_list_pages_by_position() {
        let models: Vec<Value> = (0..5).map(|i| model_entry(&format!("m{i}"))).collect();
        let mut query = HashMap::new();
        query.insert("pageSize".to_string(), "2".to_string());
        let first = models_page(models.clone(), &query).unwrap();
        assert_eq!(first["models"].as_array().map(Vec::len), Some(2));
        assert_eq!(first["nextPageToken"], "2");
        query.insert("pageToken".to_string(), "4".to_string());
        let last = models_page(models.clone(), &query).unwrap();
        assert_eq!(last["models"][0]["name"], "models/m4");
        assert!(last.get("nextPageToken").is_none());
        // GM-4: a token holdfast did not issue is refused, not read as the first page.
        for bad in ["garbage", "-1", "+2", "2.0", " 2"] {
            query.insert("pageToken".to_string(), bad.to_string());
            let (code, refused) = models_page(models.clone(), &query).unwrap_err();
            assert_eq!(code, "invalid_page_token", "{bad:?}");
            assert!(refused.contains("pageToken"), "{bad:?}: {refused}");
        }
        query.insert("pageToken".to_string(), String::new());
        let again = models_page(models.clone(), &query).unwrap();
        assert_eq!(
            again["models"][0]["name"], "models/m0",
            "an empty token: the first page"
        );
    }

    /// GM-4: a `pageSize` that is not a non-negative integer is refused as Google refuses it;
    /// absent, empty or 0 is the default 50, above 1000 is 1000.
    #[test]
    fn a_page_size_that_is_not_a_non_negative_integer_is_refused_gm4() {
        let models: Vec<Value> = (0..1200).map(|i| model_entry(&format!("m{i}"))).collect();
        let page = |size: Option<&str>| {
            let mut query = HashMap::new();
            if let Some(size) = size {
                query.insert("pageSize".to_string(), size.to_string());
            }
            models_page(models.clone(), &query)
        };
        for (size, len) in [
            (None, 50),
            (Some(""), 50),
            (Some("0"), 50),
            (Some("7"), 7),
            (Some("5000"), 1000),
            (Some("99999999999999999999"), 0),
        ] {
            match page(size) {
                Ok(answer) => assert_eq!(
                    answer["models"].as_array().map(Vec::len),
                    Some(len),
                    "{size:?}"
                ),
                Err((code, why)) => assert_eq!(len, 0, "{size:?}: {code} {why}"),
            }
        }
        for bad in ["abc", "-1", "2.5", "1e3", " 5"] {
            let (code, why) = page(Some(bad)).unwrap_err();
            assert_eq!(code, "invalid_page_size", "{bad:?}");
            assert!(why.contains("pageSize"), "{bad:?}: {why}");
        }
    }
}
