//! Anthropic's Messages API.

use std::collections::HashMap;

use axum::http::{HeaderMap, StatusCode};
use serde_json::value::RawValue;
use serde_json::{Value, json};

use super::{Count, EventParts, Json, Usage, readable};

/// Client headers forwarded upstream and covered by the hash (ID-3a).
pub(super) const FORWARDED_HEADERS: &[&str] = &["anthropic-beta", "anthropic-version"];

/// `anthropic-version` is required upstream; holdfast sends this one when the client sent none.
pub(super) const DEFAULT_HEADERS: &[(&str, &str)] = &[("anthropic-version", "2023-06-01")];

/// The request-id response header (RS-5).
pub(super) const REQUEST_ID_HEADER: &str = "request-id";

/// The event that completes a Messages stream.
pub(super) const STREAM_END: &str = "message_stop";

/// The event a Messages stream opens with, once: it carries the message every later event
/// adds to (decision 44).
pub(super) const STREAM_START: &str = "message_start";

/// The event that says how the message ended, once, before `message_stop`: its `stop_reason`
/// (non-null in every event after `message_start`, the SDKs document) and the final usage.
pub(super) const STREAM_RESULT: &str = "message_delta";

/// `ping`, which may come anywhere in a Messages stream; the SDKs skip it.
pub(super) fn is_keepalive_event(kind: Option<&str>) -> bool {
    kind == Some("ping")
}

/// A Messages answer holds `content`, an array of content blocks.
pub(super) const RESULT_MEMBERS: &[(&str, Json)] = &[("content", Json::Array)];

/// Paths whose clients are Anthropic's SDKs.
pub(super) fn owns_path(path: &str) -> bool {
    path.starts_with("/v1/messages")
}

/// A call from Anthropic's SDKs to a path both providers serve: they send `anthropic-version`.
pub(super) fn owns_call(headers: &HeaderMap) -> bool {
    headers.contains_key("anthropic-version")
}

/// One page of the model list, at most 1,000 models, after the model id `after`.
pub(super) fn models_page_path(after: Option<&str>) -> String {
    match after {
        Some(after) => format!("/models?limit=1000&after_id={after}"),
        None => "/models?limit=1000".to_string(),
    }
}

/// The page's `last_id` when it says `has_more`.
pub(super) fn next_models_page(page: &Value) -> Option<String> {
    (page["has_more"] == true)
        .then(|| page["last_id"].as_str().map(str::to_owned))
        .flatten()
}

/// A model-list entry.
pub(super) fn model_entry(id: &str) -> Value {
    json!({
        "type": "model", "id": id, "display_name": id, "created_at": "1970-01-01T00:00:00Z",
    })
}

/// One page of the list shape: `limit` (default 20, at most 1000), after `after_id` or before
/// `before_id`, with `has_more`, `first_id` and `last_id`.
pub(super) fn models_page(models: Vec<Value>, query: &HashMap<String, String>) -> Value {
    let limit = query
        .get("limit")
        .and_then(|l| l.parse::<usize>().ok())
        .unwrap_or(20)
        .clamp(1, 1000);
    let position = |id: &String| models.iter().position(|m| m["id"] == id.as_str());
    let (start, end) = match (query.get("after_id"), query.get("before_id")) {
        (Some(after), _) => {
            let start = position(after).map_or(models.len(), |i| i + 1);
            (start, (start + limit).min(models.len()))
        }
        (None, Some(before)) => {
            let end = position(before).unwrap_or(0);
            (end.saturating_sub(limit), end)
        }
        (None, None) => (0, limit.min(models.len())),
    };
    let has_more = match query.get("before_id") {
        Some(_) if query.get("after_id").is_none() => start > 0,
        _ => end < models.len(),
    };
    let page: Vec<Value> = models[start..end].to_vec();
    let first = page.first().map(|m| m["id"].clone()).unwrap_or(Value::Null);
    let last = page.last().map(|m| m["id"].clone()).unwrap_or(Value::Null);
    json!({"data": page, "has_more": has_more, "first_id": first, "last_id": last})
}

/// The header that carries the key (`Provider::credential_header`).
pub(super) const KEY_HEADER: &str = "x-api-key";

/// `x-api-key: KEY`.
pub(super) fn auth_header(key: &str) -> (&'static str, String) {
    (KEY_HEADER, key.to_string())
}

/// `{"type":"error","error":{"type","message"}}` with Anthropic's documented `type` for the
/// status (its shape has no room for holdfast's cause: that travels in `Holdfast-Error`).
pub(super) fn error_body(status: StatusCode, message: &str) -> Value {
    let kind = match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        400..=499 => "invalid_request_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    };
    json!({"type": "error", "error": {"type": kind, "message": message}})
}

/// `event: error` with an error body: the Anthropic SDKs raise on it.
pub(super) fn error_event(message: &str) -> (Option<&'static str>, String) {
    let data = json!({"type": "error", "error": {"type": "api_error", "message": message}});
    (Some("error"), data.to_string())
}

/// `event: error` (data `type` `error`), or a non-null `error` member.
pub(super) fn is_error_event(event: Option<&str>, kind: Option<&str>, error: bool) -> bool {
    error || event == Some("error") || kind == Some("error")
}

/// `message_stop`, by its `event:` name or its data's `type`.
pub(super) fn ends_stream(kind: Option<&str>) -> bool {
    kind == Some(STREAM_END)
}

/// `usage.cache_creation`: the prompt-cache writes by lifetime, which sum to
/// `cache_creation_input_tokens` (RD-10).
#[derive(serde::Deserialize, Default)]
#[serde(default)]
struct CacheCreation {
    ephemeral_1h_input_tokens: Count,
}

/// `usage.output_tokens_details`: the output by category, its thinking part the reasoning
/// (RD-9, decision 122).
#[derive(serde::Deserialize, Default)]
#[serde(default)]
struct OutputDetails {
    thinking_tokens: Count,
}

/// The counts of Anthropic's usage object holdfast reads, each on its own: a member that
/// cannot be read (a `cache_creation` that is not an object, a count that is not one) costs
/// only itself (RD-9).
#[derive(serde::Deserialize, Default)]
#[serde(default)]
struct RawUsage {
    input_tokens: Count,
    output_tokens: Count,
    cache_creation_input_tokens: Count,
    cache_read_input_tokens: Count,
    #[serde(deserialize_with = "readable")]
    cache_creation: Option<CacheCreation>,
    #[serde(deserialize_with = "readable")]
    output_tokens_details: Option<OutputDetails>,
}

impl RawUsage {
    /// The one-hour writes, absent when `cache_creation` is (RD-10).
    fn cache_write_1h(&self) -> Option<u64> {
        self.cache_creation
            .as_ref()
            .and_then(|c| c.ephemeral_1h_input_tokens.get())
    }

    /// The thinking part of the output, absent when `output_tokens_details` is (decision 122).
    fn reasoning(&self) -> Option<u64> {
        self.output_tokens_details
            .as_ref()
            .and_then(|d| d.thinking_tokens.get())
    }
}

/// Anthropic's usage object. Its `input_tokens` leaves out the prompt-cache reads and writes
/// (`cache_read_input_tokens`, `cache_creation_input_tokens`); the normalised `input_tokens`
/// counts every input token, so they are added (absent, they add nothing; unreadable, the sum
/// is unknown, not guessed). The one-hour writes are
/// `cache_creation.ephemeral_1h_input_tokens`, absent when the object is (RD-10); the reasoning
/// is `output_tokens_details.thinking_tokens`, part of `output_tokens` (decision 122).
pub(super) fn usage_of(raw: &str) -> Option<Usage> {
    let raw: RawUsage = serde_json::from_str(raw).ok()?;
    let input = raw.input_tokens.get().and_then(|n| {
        Some(
            n.saturating_add(raw.cache_creation_input_tokens.part()?)
                .saturating_add(raw.cache_read_input_tokens.part()?),
        )
    });
    let usage = Usage {
        input_tokens: input,
        output_tokens: raw.output_tokens.get(),
        cached_input_tokens: raw.cache_read_input_tokens.get(),
        cache_write_tokens: raw.cache_creation_input_tokens.get(),
        reasoning_tokens: raw.reasoning(),
        cache_write_1h_tokens: raw.cache_write_1h(),
    };
    (!usage.is_empty()).then_some(usage)
}

/// `message_start` carries the message's usage (the input, and the first output count);
/// `message_delta` the usage so far, cumulative (Anthropic's documented semantics, which the
/// SDKs apply by overwriting): its output, and the input and prompt-cache counts, which grow
/// past `message_start`'s when server tools (web search, code execution) run within the turn.
/// The input replaces `message_start`'s only when the delta reports all three of
/// `input_tokens`, `cache_creation_input_tokens` and `cache_read_input_tokens`: the normalised
/// input is their sum, and a delta that leaves one out cannot be normalised without guessing
/// (RD-9, decision 83); nor when they sum to 0: every call reads some input, and compatible
/// servers that take the delta for output alone write zeros there (a typed usage without
/// omitted fields), which would erase `message_start`'s count. The one-hour part of the cache
/// writes comes with `message_start`'s usage (`cache_creation`); Anthropic's delta carries no
/// `cache_creation`, so `message_start`'s stands, unless a delta that replaces the counts
/// carries one (RD-10).
pub(super) fn usage_of_event(event: &EventParts<'_>) -> Option<Usage> {
    match event.kind {
        Some("message_start") => {
            #[derive(serde::Deserialize)]
            struct Message<'a> {
                #[serde(borrow)]
                usage: Option<&'a RawValue>,
            }
            let message: Message<'_> = serde_json::from_str(event.message?).ok()?;
            usage_of(message.usage?.get())
        }
        Some("message_delta") => {
            let delta: RawUsage = serde_json::from_str(event.usage?).ok()?;
            let mut usage = Usage {
                output_tokens: Some(delta.output_tokens.get()?),
                reasoning_tokens: delta.reasoning(),
                ..Usage::default()
            };
            if let (Some(input), Some(write), Some(read)) = (
                delta.input_tokens.get(),
                delta.cache_creation_input_tokens.get(),
                delta.cache_read_input_tokens.get(),
            ) && let total @ 1.. = input.saturating_add(write).saturating_add(read)
            {
                usage.input_tokens = Some(total);
                usage.cache_write_tokens = Some(write);
                usage.cached_input_tokens = Some(read);
                usage.cache_write_1h_tokens = delta.cache_write_1h();
            }
            Some(usage)
        }
        _ => None,
    }
}

/// A `content_block_delta`'s `text_delta` text.
pub(super) fn text_of_event(data: &Value) -> Option<String> {
    (data["type"] == "content_block_delta" && data["delta"]["type"] == "text_delta")
        .then(|| data["delta"]["text"].as_str().map(str::to_owned))
        .flatten()
}
