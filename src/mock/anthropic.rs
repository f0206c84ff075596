//! Anthropic shapes: Messages API (non-stream and named-event stream) and errors.
//!
//! Field names follow the anthropic python SDK types (`anthropic/types/message.py`,
//! `raw_message_*_event.py`, `raw_content_block_*_event.py`, `text_delta.py`,
//! `shared/*_error.py`).

use serde_json::{Value, json};

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

fn message_object(r: &Reply<'_>, text: Option<&str>) -> Value {
    let (content, stop_reason, output_tokens) = match text {
        Some(t) => (
            json!([{"type": "text", "text": t}]),
            json!("end_turn"),
            r.output_tokens,
        ),
        None => (json!([]), Value::Null, 1),
    };
    json!({
        "id": format!("msg_mock_{}", r.n),
        "type": "message",
        "role": "assistant",
        "model": r.model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": null,
        "usage": {"input_tokens": r.input_tokens, "output_tokens": output_tokens},
    })
}

pub(crate) fn message_json(r: &Reply<'_>, text: &str) -> Value {
    message_object(r, Some(text))
}

/// `message_start`, `content_block_start`, `ping`, one `content_block_delta` (`text_delta`) per
/// piece, `content_block_stop`, `message_delta` (stop reason, output tokens), `message_stop`.
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
                &json!({
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": p},
                }),
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
                "usage": {"output_tokens": r.output_tokens},
            }),
        ),
        named_event("message_stop", &json!({"type": "message_stop"})),
    ];
    StreamParts { head, pieces, tail }
}
