//! Anthropic shapes: Messages API (non-stream and named-event stream) and errors.
//!
//! Field names follow the anthropic python SDK types (`anthropic/types/message.py`,
//! `raw_message_*_event.py`, `raw_content_block_*_event.py`, `text_delta.py`,
//! `shared/*_error.py`).

use serde::Serialize;
use serde_json::{Value, json};

use bytes::Bytes;

use super::json_bytes;
use super::sse::{StreamParts, named_event};

/// What every Anthropic body of one call shares.
pub(crate) struct Reply<'a> {
    /// Call number (1-based since the last reset), used in ids.
    pub n: u64,
    /// The request's `model`, echoed back.
    pub model: &'a str,
    pub input_tokens: u64,
    pub output_tokens: u64,
}

/// The `error.type` Anthropic uses for an HTTP status.
pub(crate) fn error_type(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        402 => "billing_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        504 => "timeout_error",
        400..=499 => "invalid_request_error",
        _ => "api_error",
    }
}

/// `{"type":"error","error":{"type","message"}}`.
pub(crate) fn error_body(status: u16, message: &str) -> Value {
    json!({
        "type": "error",
        "error": {"type": error_type(status), "message": message},
    })
}

/// A `Message`. Typed (not `json!`): with the deltas, the shape benchmarks hit most.
#[derive(Serialize)]
struct Message<'a> {
    id: String,
    #[serde(rename = "type")]
    kind: &'static str,
    role: &'static str,
    model: &'a str,
    content: Vec<TextBlock<'a>>,
    stop_reason: Option<&'static str>,
    /// Always `null`.
    stop_sequence: (),
    usage: MessageUsage,
}

#[derive(Serialize)]
struct TextBlock<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    text: &'a str,
}

#[derive(Serialize)]
struct MessageUsage {
    input_tokens: u64,
    output_tokens: u64,
}

/// The message; `text` `None` gives `message_start`'s snapshot (no content, no stop reason, one
/// output token, as the API sends it).
fn message_object<'a>(r: &Reply<'a>, text: Option<&'a str>) -> Message<'a> {
    Message {
        id: format!("msg_mock_{}", r.n),
        kind: "message",
        role: "assistant",
        model: r.model,
        content: text
            .map(|t| TextBlock {
                kind: "text",
                text: t,
            })
            .into_iter()
            .collect(),
        stop_reason: text.map(|_| "end_turn"),
        stop_sequence: (),
        usage: MessageUsage {
            input_tokens: r.input_tokens,
            output_tokens: if text.is_some() { r.output_tokens } else { 1 },
        },
    }
}

pub(crate) fn message_json(r: &Reply<'_>, text: &str) -> Bytes {
    json_bytes(&message_object(r, Some(text)))
}

/// `content_block_delta` with a `text_delta` (typed: one per content piece).
#[derive(Serialize)]
struct ContentBlockDelta<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    index: u32,
    delta: TextDelta<'a>,
}

#[derive(Serialize)]
struct TextDelta<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    text: &'a str,
}

/// `message_start`, `content_block_start`, `ping`, one `content_block_delta` (`text_delta`) per
/// piece, `content_block_stop`, `message_delta` (stop reason, and the usage so far: input and
/// output tokens, cumulative, as the API reports them; langchain-anthropic reads a stream's usage
/// from this event alone), `message_stop`.
pub(crate) fn message_stream(r: &Reply<'_>, pieces: &[String]) -> StreamParts {
    let head = vec![
        named_event(
            "message_start",
            &json!({"type": "message_start", "message": message_object(r, None)}),
        ),
        named_event(
            "content_block_start",
            &json!({
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            }),
        ),
        named_event("ping", &json!({"type": "ping"})),
    ];
    let pieces = pieces
        .iter()
        .map(|p| {
            named_event(
                "content_block_delta",
                &ContentBlockDelta {
                    kind: "content_block_delta",
                    index: 0,
                    delta: TextDelta {
                        kind: "text_delta",
                        text: p,
                    },
                },
            )
        })
        .collect();
    let tail = vec![
        named_event(
            "content_block_stop",
            &json!({"type": "content_block_stop", "index": 0}),
        ),
        named_event(
            "message_delta",
            &json!({
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": null},
                "usage": {"input_tokens": r.input_tokens, "output_tokens": r.output_tokens},
            }),
        ),
        named_event("message_stop", &json!({"type": "message_stop"})),
    ];
    StreamParts { head, pieces, tail }
}
