//! Gemini shapes: `generateContent` (non-stream), `streamGenerateContent?alt=sse` chunks, a
//! model of the list, `countTokens`, `embedContent`, `batchEmbedContents`, and Google's error
//! body.
//!
//! Field names follow google-genai's REST types (`GenerateContentResponse`, `Candidate`,
//! `UsageMetadata`, `ListModelsResponse`). Streams end without a final event: the last chunk
//! carries `finishReason` and `usageMetadata` (it is the tail, so `omit_stream_end` drops it).

use bytes::Bytes;
use serde_json::{Value, json};

use super::json_bytes;
use super::sse::StreamParts;

/// What every Gemini body of one call shares.
pub(crate) struct Reply<'a> {
    /// Call number (1-based since the last reset), used in ids.
    pub n: u64,
    /// The model in the path, echoed back as `modelVersion`.
    pub model: &'a str,
    pub prompt_tokens: u64,
    pub candidates_tokens: u64,
}

/// Google's canonical status name for an HTTP status.
fn status_name(status: u16) -> &'static str {
    match status {
        400 => "INVALID_ARGUMENT",
        401 => "UNAUTHENTICATED",
        403 => "PERMISSION_DENIED",
        404 => "NOT_FOUND",
        429 => "RESOURCE_EXHAUSTED",
        503 => "UNAVAILABLE",
        504 => "DEADLINE_EXCEEDED",
        _ if (400..500).contains(&status) => "FAILED_PRECONDITION",
        _ => "INTERNAL",
    }
}

/// `{"error":{"code","message","status"}}`.
pub(crate) fn error_body(status: u16, message: &str) -> Value {
    json!({"error": {"code": status, "message": message, "status": status_name(status)}})
}

fn usage(r: &Reply<'_>) -> Value {
    json!({
        "promptTokenCount": r.prompt_tokens,
        "candidatesTokenCount": r.candidates_tokens,
        "totalTokenCount": r.prompt_tokens + r.candidates_tokens,
    })
}

fn candidate(text: &str, finish: bool) -> Value {
    let mut c = json!({"content": {"parts": [{"text": text}], "role": "model"}, "index": 0});
    if finish {
        c["finishReason"] = json!("STOP");
    }
    c
}

/// The whole answer.
pub(crate) fn generate_json(r: &Reply<'_>, text: &str) -> Bytes {
    json_bytes(&json!({
        "candidates": [candidate(text, true)],
        "usageMetadata": usage(r),
        "modelVersion": r.model,
        "responseId": format!("mock_resp_{}", r.n),
    }))
}

/// `data: <json>\r\n\r\n`, as Google frames its events.
fn event(v: &Value) -> Bytes {
    let mut out = b"data: ".to_vec();
    let _ = serde_json::to_writer(&mut out, v);
    out.extend_from_slice(b"\r\n\r\n");
    Bytes::from(out)
}

/// One chunk per piece, then the finishing chunk (empty text, `finishReason`, usage).
pub(crate) fn generate_stream(r: &Reply<'_>, pieces: &[String]) -> StreamParts {
    let id = format!("mock_resp_{}", r.n);
    let chunk = |text: &str, finish: bool| {
        let mut v = json!({
            "candidates": [candidate(text, finish)],
            "modelVersion": r.model,
            "responseId": id,
        });
        if finish {
            v["usageMetadata"] = usage(r);
        }
        event(&v)
    };
    StreamParts {
        head: Vec::new(),
        pieces: pieces.iter().map(|p| chunk(p, false)).collect(),
        tail: vec![chunk("", true)],
    }
}

/// One `Model` of `GET /v1beta/models` (`{"models": [...]}`, one page) and of
/// `GET /v1beta/models/{id}`.
pub(crate) fn model_json(id: &str) -> Value {
    json!({
        "name": format!("models/{id}"),
        "displayName": id,
        "supportedGenerationMethods": ["generateContent", "countTokens"],
    })
}

/// `countTokens`: `{"totalTokens": N}`.
pub(crate) fn count_json(tokens: u64) -> Value {
    json!({"totalTokens": tokens})
}

/// `embedContent` (`{"embedding": {"values": [...]}}`) or `batchEmbedContents` (`{"embeddings":
/// [...]}`, one per entry of `requests`): 8 values each, chosen by the text.
pub(crate) fn embed_json(method: &str, body: &Value) -> Value {
    let values = |request: &Value| {
        let seed = super::text::seed_of(request).prompt_tokens;
        (0..8u64)
            .map(|i| json!(((seed + i) % 7) as f64 / 7.0))
            .collect::<Vec<_>>()
    };
    if method == "batchEmbedContents" {
        let requests = body["requests"].as_array().cloned().unwrap_or_default();
        json!({"embeddings": requests.iter().map(|r| json!({"values": values(r)})).collect::<Vec<_>>()})
    } else {
        json!({"embedding": {"values": values(body)}})
    }
}
