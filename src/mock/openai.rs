//! OpenAI shapes: chat completions, legacy completions, embeddings, Responses API, errors.
//!
//! Field names follow the openai-python SDK types (`openai/types/chat/chat_completion*.py`,
//! `completion.py`, `create_embedding_response.py`, `responses/response*.py`): every field the
//! SDK declares as required is present, so its models parse these bodies and events.

use std::cell::Cell;

use bytes::Bytes;
use serde::Serialize;
use serde_json::{Value, json};

use super::json_bytes;
use super::sse::{StreamParts, data_event, named_event};
use super::text;

/// What every OpenAI body of one call shares.
pub(crate) struct Reply<'a> {
    /// Call number (1-based since the last reset), used in ids.
    pub n: u64,
    /// The request's `model`, echoed back.
    pub model: &'a str,
    /// Unix seconds.
    pub created: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

impl Reply<'_> {
    fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.completion_tokens,
            total_tokens: self.prompt_tokens + self.completion_tokens,
        }
    }
}

/// `usage` of chat and legacy completions.
#[derive(Serialize)]
struct Usage {
    prompt_tokens: u64,
    completion_tokens: u64,
    total_tokens: u64,
}

/// The `error.type` OpenAI-style for an HTTP status (the SDK maps status, not type, to its
/// exception classes; these names mirror those classes).
pub(crate) fn error_type(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        409 => "conflict_error",
        422 => "unprocessable_entity_error",
        429 => "rate_limit_error",
        400..=499 => "invalid_request_error",
        500..=599 => "server_error",
        _ => "api_error",
    }
}

/// `{"error":{"message","type","param":null,"code":null}}`.
pub(crate) fn error_body(status: u16, message: &str) -> Value {
    json!({
        "error": {
            "message": message,
            "type": error_type(status),
            "param": null,
            "code": null,
        }
    })
}

// ---- chat completions ----

/// A `chat.completion`. Typed (not `json!`) because it is the route benchmarks hit most.
#[derive(Serialize)]
struct ChatCompletion<'a> {
    id: String,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: [ChatChoice<'a>; 1],
    usage: Usage,
}

#[derive(Serialize)]
struct ChatChoice<'a> {
    index: u32,
    message: ChatMessage<'a>,
    /// Always `null`.
    logprobs: (),
    finish_reason: &'static str,
}

#[derive(Serialize)]
struct ChatMessage<'a> {
    role: &'static str,
    content: &'a str,
    /// Always `null`.
    refusal: (),
    /// Always `[]`.
    annotations: [(); 0],
}

pub(crate) fn chat_json(r: &Reply<'_>, text: &str) -> Bytes {
    json_bytes(&ChatCompletion {
        id: format!("chatcmpl-mock-{}", r.n),
        object: "chat.completion",
        created: r.created,
        model: r.model,
        choices: [ChatChoice {
            index: 0,
            message: ChatMessage {
                role: "assistant",
                content: text,
                refusal: (),
                annotations: [],
            },
            logprobs: (),
            finish_reason: "stop",
        }],
        usage: r.usage(),
    })
}

/// A `chat.completion.chunk` with one choice. Typed (not `json!`) because one is built per
/// content piece. With `stream_options.include_usage`, every chunk carries `"usage": null`.
#[derive(Serialize)]
struct ChatChunk<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: [ChatChunkChoice<'a>; 1],
    /// `Some(())` serialises as `"usage": null`; `None` leaves the key out.
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<()>,
}

#[derive(Serialize)]
struct ChatChunkChoice<'a> {
    index: u32,
    delta: ChatDelta<'a>,
    /// Always `null`.
    logprobs: (),
    finish_reason: Option<&'static str>,
}

#[derive(Serialize)]
struct ChatDelta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a str>,
}

/// Role chunk, one `delta.content` chunk per piece, a `finish_reason: "stop"` chunk, the usage
/// chunk (`choices: []`) when `stream_options.include_usage`, then `data: [DONE]`.
pub(crate) fn chat_stream(r: &Reply<'_>, pieces: &[String], include_usage: bool) -> StreamParts {
    let id = format!("chatcmpl-mock-{}", r.n);
    let chunk = |delta: ChatDelta<'_>, finish_reason: Option<&'static str>| {
        data_event(&ChatChunk {
            id: &id,
            object: "chat.completion.chunk",
            created: r.created,
            model: r.model,
            choices: [ChatChunkChoice {
                index: 0,
                delta,
                logprobs: (),
                finish_reason,
            }],
            usage: include_usage.then_some(()),
        })
    };
    let head = vec![chunk(
        ChatDelta {
            role: Some("assistant"),
            content: Some(""),
        },
        None,
    )];
    let pieces = pieces
        .iter()
        .map(|p| {
            chunk(
                ChatDelta {
                    role: None,
                    content: Some(p),
                },
                None,
            )
        })
        .collect();
    let finish = ChatDelta {
        role: None,
        content: None,
    };
    let mut tail = vec![chunk(finish, Some("stop"))];
    if include_usage {
        tail.push(data_event(&json!({
            "id": id,
            "object": "chat.completion.chunk",
            "created": r.created,
            "model": r.model,
            "choices": [],
            "usage": r.usage(),
        })));
    }
    tail.push(Bytes::from_static(b"data: [DONE]\n\n"));
    StreamParts { head, pieces, tail }
}

// ---- legacy completions ----

pub(crate) fn completion_json(r: &Reply<'_>, text: &str) -> Bytes {
    json_bytes(&json!({
        "id": format!("cmpl-mock-{}", r.n),
        "object": "text_completion",
        "created": r.created,
        "model": r.model,
        "choices": [{"text": text, "index": 0, "logprobs": null, "finish_reason": "stop"}],
        "usage": r.usage(),
    }))
}

/// A legacy `text_completion` stream chunk with one choice (typed: one per content piece).
#[derive(Serialize)]
struct CompletionChunk<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: [CompletionChunkChoice<'a>; 1],
    /// `Some(())` serialises as `"usage": null`; `None` leaves the key out.
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<()>,
}

#[derive(Serialize)]
struct CompletionChunkChoice<'a> {
    text: &'a str,
    index: u32,
    /// Always `null`.
    logprobs: (),
    finish_reason: Option<&'static str>,
}

/// One `choices[0].text` chunk per piece, a final chunk with `finish_reason: "stop"`, the usage
/// chunk when asked, then `data: [DONE]`. No head: the legacy API has no role chunk.
pub(crate) fn completion_stream(
    r: &Reply<'_>,
    pieces: &[String],
    include_usage: bool,
) -> StreamParts {
    let id = format!("cmpl-mock-{}", r.n);
    let chunk = |text: &str, finish_reason: Option<&'static str>| {
        data_event(&CompletionChunk {
            id: &id,
            object: "text_completion",
            created: r.created,
            model: r.model,
            choices: [CompletionChunkChoice {
                text,
                index: 0,
                logprobs: (),
                finish_reason,
            }],
            usage: include_usage.then_some(()),
        })
    };
    let pieces = pieces.iter().map(|p| chunk(p, None)).collect();
    let mut tail = vec![chunk("", Some("stop"))];
    if include_usage {
        tail.push(data_event(&json!({
            "id": id,
            "object": "text_completion",
            "created": r.created,
            "model": r.model,
            "choices": [],
            "usage": r.usage(),
        })));
    }
    tail.push(Bytes::from_static(b"data: [DONE]\n\n"));
    StreamParts {
        head: Vec::new(),
        pieces,
        tail,
    }
}

// ---- embeddings ----

/// Default embedding width.
pub(crate) const EMBEDDING_DIMS: usize = 8;
/// Largest `dimensions` honoured.
pub(crate) const MAX_EMBEDDING_DIMS: usize = 4096;

/// What an embeddings request asks for, read before the body is handed to the recorder.
#[derive(Debug)]
pub(crate) struct EmbeddingsAsk {
    /// One hash per input (a string, or a token array).
    pub inputs: Vec<u64>,
    pub base64: bool,
    pub dims: usize,
}

/// Reads `input` (string, array of strings, array of token ids, array of token arrays),
/// `encoding_format` and `dimensions`. `Err` holds the message for a 400.
pub(crate) fn embeddings_ask(body: &Value) -> Result<EmbeddingsAsk, String> {
    let input = body
        .get("input")
        .ok_or_else(|| "'input' is a required property".to_owned())?;
    let one = |v: &Value| -> Option<u64> {
        match v {
            Value::String(s) => Some(text::hash_bytes(s.as_bytes())),
            Value::Array(tokens) if !tokens.is_empty() && tokens.iter().all(Value::is_u64) => {
                Some(text::hash_bytes(v.to_string().as_bytes()))
            }
            _ => None,
        }
    };
    let inputs = match input {
        Value::String(_) => one(input).into_iter().collect(),
        Value::Array(items) if !items.is_empty() && items.iter().all(Value::is_u64) => {
            one(input).into_iter().collect()
        }
        Value::Array(items) if !items.is_empty() => items
            .iter()
            .map(one)
            .collect::<Option<Vec<u64>>>()
            .ok_or_else(|| "'input' items must be strings or token arrays".to_owned())?,
        _ => return Err("'input' must be a string or a non-empty array".to_owned()),
    };
    let base64 = match body.get("encoding_format") {
        None | Some(Value::Null) => false,
        Some(Value::String(s)) if s == "float" => false,
        Some(Value::String(s)) if s == "base64" => true,
        Some(_) => return Err("'encoding_format' must be \"float\" or \"base64\"".to_owned()),
    };
    let dims = match body.get("dimensions") {
        None | Some(Value::Null) => EMBEDDING_DIMS,
        Some(v) => match v.as_u64() {
            Some(d) if (1..=MAX_EMBEDDING_DIMS as u64).contains(&d) => d as usize,
            _ => return Err(format!("'dimensions' must be 1..={MAX_EMBEDDING_DIMS}")),
        },
    };
    Ok(EmbeddingsAsk {
        inputs,
        base64,
        dims,
    })
}

pub(crate) fn embeddings_json(model: &str, ask: &EmbeddingsAsk, prompt_tokens: u64) -> Bytes {
    let data: Vec<Value> = ask
        .inputs
        .iter()
        .enumerate()
        .map(|(i, h)| {
            let vector = text::embedding(*h, ask.dims);
            let embedding = if ask.base64 {
                Value::String(text::base64_f32_le(&vector))
            } else {
                json!(vector)
            };
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    json_bytes(&json!({
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }))
}

// ---- Responses API ----

fn response_usage(r: &Reply<'_>) -> Value {
    json!({
        "input_tokens": r.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": r.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": r.prompt_tokens + r.completion_tokens,
    })
}

fn output_message(r: &Reply<'_>, text: Option<&str>) -> Value {
    let (status, content) = match text {
        Some(t) => (
            "completed",
            json!([{"type": "output_text", "text": t, "annotations": [], "logprobs": []}]),
        ),
        None => ("in_progress", json!([])),
    };
    json!({
        "type": "message",
        "id": format!("msg_mock_{}", r.n),
        "status": status,
        "role": "assistant",
        "content": content,
    })
}

/// The `Response` object; `text` `None` gives the in-progress snapshot (no output, no usage).
fn response_object(r: &Reply<'_>, text: Option<&str>) -> Value {
    let done = text.is_some();
    json!({
        "id": format!("resp_mock_{}", r.n),
        "object": "response",
        "created_at": r.created,
        "status": if done { "completed" } else { "in_progress" },
        "completed_at": if done { json!(r.created) } else { Value::Null },
        "error": null,
        "incomplete_details": null,
        "instructions": null,
        "max_output_tokens": null,
        "model": r.model,
        "output": if done { json!([output_message(r, text)]) } else { json!([]) },
        "parallel_tool_calls": true,
        "previous_response_id": null,
        "reasoning": {"effort": null, "summary": null},
        "store": true,
        "temperature": 1.0,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": 1.0,
        "truncation": "disabled",
        "usage": if done { response_usage(r) } else { Value::Null },
        "user": null,
        "metadata": {},
    })
}

pub(crate) fn responses_json(r: &Reply<'_>, text: &str) -> Bytes {
    json_bytes(&response_object(r, Some(text)))
}

/// `response.output_text.delta` (typed: one per content piece).
#[derive(Serialize)]
struct OutputTextDelta<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    sequence_number: u64,
    item_id: &'a str,
    output_index: u32,
    content_index: u32,
    delta: &'a str,
    logprobs: [(); 0],
}

/// `response.created`, `response.in_progress`, `response.output_item.added`,
/// `response.content_part.added`, one `response.output_text.delta` per piece,
/// `response.output_text.done`, `response.content_part.done`, `response.output_item.done`,
/// `response.completed`; each `event: <type>` with `type` and `sequence_number` (from 0) in data.
pub(crate) fn responses_stream(r: &Reply<'_>, pieces: &[String]) -> StreamParts {
    let text = pieces.concat();
    let item_id = format!("msg_mock_{}", r.n);
    // Events are built in emission order, so numbering them as built numbers them as sent.
    let seq = Cell::new(0u64);
    let next_seq = || seq.replace(seq.get() + 1);
    let event = |kind: &str, mut data: Value| {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(next_seq());
        named_event(kind, &data)
    };
    let head = vec![
        event(
            "response.created",
            json!({"response": response_object(r, None)}),
        ),
        event(
            "response.in_progress",
            json!({"response": response_object(r, None)}),
        ),
        event(
            "response.output_item.added",
            json!({"output_index": 0, "item": output_message(r, None)}),
        ),
        event(
            "response.content_part.added",
            json!({
                "item_id": item_id, "output_index": 0, "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []},
            }),
        ),
    ];
    let pieces = pieces
        .iter()
        .map(|p| {
            named_event(
                "response.output_text.delta",
                &OutputTextDelta {
                    kind: "response.output_text.delta",
                    sequence_number: next_seq(),
                    item_id: &item_id,
                    output_index: 0,
                    content_index: 0,
                    delta: p,
                    logprobs: [],
                },
            )
        })
        .collect();
    let tail = vec![
        event(
            "response.output_text.done",
            json!({
                "item_id": item_id, "output_index": 0, "content_index": 0,
                "text": text, "logprobs": [],
            }),
        ),
        event(
            "response.content_part.done",
            json!({
                "item_id": item_id, "output_index": 0, "content_index": 0,
                "part": {"type": "output_text", "text": text, "annotations": [], "logprobs": []},
            }),
        ),
        event(
            "response.output_item.done",
            json!({"output_index": 0, "item": output_message(r, Some(&text))}),
        ),
        event(
            "response.completed",
            json!({"response": response_object(r, Some(&text))}),
        ),
    ];
    StreamParts { head, pieces, tail }
}
