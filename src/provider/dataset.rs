//! The log as a dataset (issue 34): a stream's stored events reassembled into the answer its
//! provider gives without streaming (EX-3), the text of an answer, and a request with its
//! answer as an OpenAI chat fine-tuning example (EX-5, decision 63). One function per
//! provider; `Route` dispatches to them (`mod.rs`).

use std::collections::BTreeMap;

use serde_json::{Map, Value, json};

use super::Route;

/// Appends the string `piece` (if it is one) to the string member `key` of `object`, creating it.
fn append(object: &mut Map<String, Value>, key: &str, piece: &Value) {
    let Some(piece) = piece.as_str() else { return };
    match object.get_mut(key) {
        Some(Value::String(s)) => s.push_str(piece),
        _ => {
            object.insert(key.to_owned(), Value::String(piece.to_owned()));
        }
    }
}

/// Copies `data[key]` into `into[key]` when it is set (not absent, not null).
fn keep(into: &mut Map<String, Value>, data: &Value, key: &str) {
    if let Some(v) = data.get(key).filter(|v| !v.is_null()) {
        into.insert(key.to_owned(), v.clone());
    }
}

/// Parses each event's data; `[DONE]` and non-objects are skipped.
fn objects<'a>(events: impl IntoIterator<Item = &'a str>) -> impl Iterator<Item = Value> {
    events
        .into_iter()
        .filter_map(|data| serde_json::from_str::<Value>(data).ok())
        .filter(Value::is_object)
}

// ------------------------------------------------------------------------------------------
// OpenAI
// ------------------------------------------------------------------------------------------

/// One chat choice being put together.
#[derive(Default)]
struct ChatChoice {
    message: Map<String, Value>,
    /// Tool calls by their `index`.
    tool_calls: BTreeMap<u64, Map<String, Value>>,
    finish_reason: Value,
}

/// EX-3 for OpenAI's routes: chat into a `chat.completion`, completions into a
/// `text_completion`, Responses into its final event's `response`. Embeddings never stream.
pub(super) fn openai_assemble<'a>(
    route: Route,
    events: impl IntoIterator<Item = &'a str>,
) -> Option<Value> {
    match route {
        Route::OpenaiResponses => {
            // Every `response.*` lifecycle event carries the whole object; the last is final.
            objects(events)
                .filter_map(|mut e| e.get_mut("response").map(Value::take))
                .filter(Value::is_object)
                .last()
        }
        Route::OpenaiCompletions => Some(openai_completions(events)),
        _ => Some(openai_chat(events)),
    }
}

fn openai_chat<'a>(events: impl IntoIterator<Item = &'a str>) -> Value {
    let mut top = Map::new();
    let mut choices: BTreeMap<u64, ChatChoice> = BTreeMap::new();
    for event in objects(events) {
        for key in [
            "id",
            "created",
            "model",
            "system_fingerprint",
            "service_tier",
            "usage",
        ] {
            keep(&mut top, &event, key);
        }
        for choice in event["choices"].as_array().into_iter().flatten() {
            let acc = choices
                .entry(choice["index"].as_u64().unwrap_or(0))
                .or_default();
            let delta = &choice["delta"];
            append(&mut acc.message, "content", &delta["content"]);
            append(&mut acc.message, "refusal", &delta["refusal"]);
            for call in delta["tool_calls"].as_array().into_iter().flatten() {
                let c = acc
                    .tool_calls
                    .entry(call["index"].as_u64().unwrap_or(0))
                    .or_default();
                keep(c, call, "id");
                keep(c, call, "type");
                let function = c
                    .entry("function")
                    .or_insert_with(|| json!({}))
                    .as_object_mut();
                if let Some(function) = function {
                    keep(function, &call["function"], "name");
                    append(function, "arguments", &call["function"]["arguments"]);
                }
            }
            if !choice["finish_reason"].is_null() {
                acc.finish_reason = choice["finish_reason"].clone();
            }
        }
    }
    let choices: Vec<Value> = choices
        .into_iter()
        .map(|(index, c)| {
            let mut message = Map::new();
            message.insert("role".into(), json!("assistant"));
            message.insert(
                "content".into(),
                c.message.get("content").cloned().unwrap_or(Value::Null),
            );
            message.insert(
                "refusal".into(),
                c.message.get("refusal").cloned().unwrap_or(Value::Null),
            );
            if !c.tool_calls.is_empty() {
                let calls: Vec<Value> = c
                    .tool_calls
                    .into_values()
                    .map(|mut call| {
                        call.entry("type").or_insert_with(|| json!("function"));
                        Value::Object(call)
                    })
                    .collect();
                message.insert("tool_calls".into(), Value::Array(calls));
            }
            json!({
                "index": index,
                "message": message,
                "logprobs": null,
                "finish_reason": c.finish_reason,
            })
        })
        .collect();
    top.insert("object".into(), json!("chat.completion"));
    top.insert("choices".into(), Value::Array(choices));
    Value::Object(top)
}

fn openai_completions<'a>(events: impl IntoIterator<Item = &'a str>) -> Value {
    let mut top = Map::new();
    let mut choices: BTreeMap<u64, (Map<String, Value>, Value)> = BTreeMap::new();
    for event in objects(events) {
        for key in ["id", "created", "model", "system_fingerprint", "usage"] {
            keep(&mut top, &event, key);
        }
        for choice in event["choices"].as_array().into_iter().flatten() {
            let (text, finish) = choices
                .entry(choice["index"].as_u64().unwrap_or(0))
                .or_default();
            append(text, "text", &choice["text"]);
            if !choice["finish_reason"].is_null() {
                *finish = choice["finish_reason"].clone();
            }
        }
    }
    let choices: Vec<Value> = choices
        .into_iter()
        .map(|(index, (text, finish))| {
            json!({
                "index": index,
                "text": text.get("text").cloned().unwrap_or(json!("")),
                "logprobs": null,
                "finish_reason": finish,
            })
        })
        .collect();
    top.insert("object".into(), json!("text_completion"));
    top.insert("choices".into(), Value::Array(choices));
    Value::Object(top)
}

/// The text of an answer as an operator reads it (EX-9, decision 96): its `text`, then one line
/// per tool call it makes, `[tool call] NAME(ARGUMENTS)`, the arguments as the model wrote them
/// (a string as it is, JSON compact), so an answer that is only tool calls does not read as
/// blank.
fn with_tool_calls<'a>(
    mut text: String,
    calls: impl IntoIterator<Item = (&'a Value, &'a Value)>,
) -> String {
    for (name, arguments) in calls {
        if !text.is_empty() {
            text.push('\n');
        }
        let arguments = match arguments {
            Value::String(s) => s.clone(),
            Value::Null => String::new(),
            other => other.to_string(),
        };
        text.push_str(&format!(
            "[tool call] {}({arguments})",
            name.as_str().unwrap_or("?")
        ));
    }
    text
}

/// The text of an OpenAI answer: chat's first choice's content and tool calls, completions'
/// text, Responses' output text and function calls (decision 96).
pub(super) fn openai_text(route: Route, answer: &Value) -> Option<String> {
    match route {
        Route::OpenaiResponses => {
            let output = answer["output"].as_array()?;
            let text: String = output
                .iter()
                .flat_map(|item| item["content"].as_array().into_iter().flatten())
                .filter(|part| part["type"] == "output_text")
                .filter_map(|part| part["text"].as_str())
                .collect();
            Some(with_tool_calls(text, openai_tool_calls(route, answer)))
        }
        Route::OpenaiCompletions => answer["choices"][0]["text"].as_str().map(str::to_owned),
        Route::OpenaiEmbeddings => None,
        _ => {
            let message = &answer["choices"][0]["message"];
            let text = match &message["content"] {
                Value::String(s) => s.clone(),
                Value::Array(parts) => text_parts(parts),
                _ => String::new(),
            };
            Some(with_tool_calls(text, openai_tool_calls(route, answer)))
        }
    }
}

/// The tool calls of an OpenAI answer, `(name, arguments)`: chat's first choice's
/// `tool_calls` (a `custom` tool's `input` for arguments), Responses' `function_call` and
/// `custom_tool_call` items.
fn openai_tool_calls(route: Route, answer: &Value) -> Vec<(&Value, &Value)> {
    match route {
        Route::OpenaiResponses => answer["output"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|item| match item["type"].as_str() {
                Some("function_call") => Some((&item["name"], &item["arguments"])),
                Some("custom_tool_call") => Some((&item["name"], &item["input"])),
                _ => None,
            })
            .collect(),
        Route::OpenaiChat => answer["choices"][0]["message"]["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|call| match call["type"].as_str() {
                Some("custom") => (&call["custom"]["name"], &call["custom"]["input"]),
                _ => (&call["function"]["name"], &call["function"]["arguments"]),
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// A streamed answer's `text` (its text events, EX-3's `{"text"}`), then the tool calls of its
/// events reassembled, `assembled` (decision 96). The text is the events', not the
/// reassembly's: a Responses stream cut before its final event reassembles to an earlier
/// lifecycle event's `response`, without the text that came after it.
pub(super) fn stream_text(route: Route, text: String, assembled: &Value) -> String {
    let calls = match route.provider() {
        super::Provider::Openai => openai_tool_calls(route, assembled),
        super::Provider::Anthropic => anthropic_tool_calls(assembled),
        super::Provider::Gemini => gemini_tool_calls(assembled),
        #[cfg(test)]
        super::Provider::Echo => Vec::new(),
    };
    with_tool_calls(text, calls)
}

/// The text of OpenAI content parts (`{"type":"text","text"}`), joined.
fn text_parts(parts: &[Value]) -> String {
    parts.iter().filter_map(|p| p["text"].as_str()).collect()
}

// ------------------------------------------------------------------------------------------
// Anthropic
// ------------------------------------------------------------------------------------------

/// EX-3 for Anthropic: `message_start`'s message, its content blocks filled in by their deltas
/// (a tool's input parsed from the concatenated `partial_json`), the `message_delta`'s stop
/// reason and usage merged.
pub(super) fn anthropic_assemble<'a>(events: impl IntoIterator<Item = &'a str>) -> Option<Value> {
    let mut message: Option<Map<String, Value>> = None;
    let mut blocks: BTreeMap<u64, Map<String, Value>> = BTreeMap::new();
    let mut partial: BTreeMap<u64, String> = BTreeMap::new();
    for event in objects(events) {
        let index = event["index"].as_u64().unwrap_or(0);
        match event["type"].as_str() {
            Some("message_start") => message = event["message"].as_object().cloned(),
            Some("content_block_start") => {
                if let Some(block) = event["content_block"].as_object() {
                    blocks.insert(index, block.clone());
                }
            }
            Some("content_block_delta") => {
                let block = blocks.entry(index).or_default();
                let delta = &event["delta"];
                match delta["type"].as_str() {
                    Some("text_delta") => append(block, "text", &delta["text"]),
                    Some("thinking_delta") => append(block, "thinking", &delta["thinking"]),
                    Some("signature_delta") => keep(block, delta, "signature"),
                    Some("input_json_delta") => {
                        if let Some(piece) = delta["partial_json"].as_str() {
                            partial.entry(index).or_default().push_str(piece);
                        }
                    }
                    Some("citations_delta") => {
                        let list = block.entry("citations").or_insert_with(|| json!([]));
                        if let Some(list) = list.as_array_mut() {
                            list.push(delta["citation"].clone());
                        }
                    }
                    _ => {}
                }
            }
            Some("message_delta") => {
                if let Some(m) = message.as_mut() {
                    for key in ["stop_reason", "stop_sequence"] {
                        if let Some(v) = event["delta"].get(key) {
                            m.insert(key.to_owned(), v.clone());
                        }
                    }
                    if let Some(usage) = event["usage"].as_object() {
                        let into = m.entry("usage").or_insert_with(|| json!({}));
                        if let Some(into) = into.as_object_mut() {
                            for (k, v) in usage {
                                if !v.is_null() {
                                    into.insert(k.clone(), v.clone());
                                }
                            }
                        }
                    }
                }
            }
            _ => {}
        }
    }
    let mut message = message?;
    let content: Vec<Value> = blocks
        .into_iter()
        .map(|(index, mut block)| {
            if let Some(json) = partial.remove(&index) {
                let input = if json.trim().is_empty() {
                    json!({})
                } else {
                    serde_json::from_str(&json).unwrap_or(Value::String(json))
                };
                block.insert("input".into(), input);
            }
            Value::Object(block)
        })
        .collect();
    message.insert("content".into(), Value::Array(content));
    Some(Value::Object(message))
}

/// The text of an Anthropic message: its text blocks, joined, then its tool calls
/// (`tool_use`, `server_tool_use`; decision 96).
pub(super) fn anthropic_text(answer: &Value) -> Option<String> {
    let blocks = answer["content"].as_array()?;
    let text = blocks
        .iter()
        .filter(|b| b["type"] == "text")
        .filter_map(|b| b["text"].as_str())
        .collect();
    Some(with_tool_calls(text, anthropic_tool_calls(answer)))
}

/// The tool calls of an Anthropic message, `(name, input)`: its `tool_use` and
/// `server_tool_use` blocks.
fn anthropic_tool_calls(answer: &Value) -> Vec<(&Value, &Value)> {
    answer["content"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|b| b["type"] == "tool_use" || b["type"] == "server_tool_use")
        .map(|b| (&b["name"], &b["input"]))
        .collect()
}

// ------------------------------------------------------------------------------------------
// Gemini
// ------------------------------------------------------------------------------------------

/// One Gemini candidate being put together: its members but `content`, its parts, its role.
type GeminiCandidate = (Map<String, Value>, Vec<Value>, Value);

/// EX-3 for Gemini: the chunks as one `GenerateContentResponse`: each candidate's parts in
/// order, adjacent text parts (of the same `thought` kind) joined, its last `finishReason` and
/// other members; the last `usageMetadata`, `modelVersion`, `responseId`, any
/// `promptFeedback`.
pub(super) fn gemini_assemble<'a>(events: impl IntoIterator<Item = &'a str>) -> Option<Value> {
    let mut top = Map::new();
    let mut candidates: BTreeMap<u64, GeminiCandidate> = BTreeMap::new();
    let mut any = false;
    for event in objects(events) {
        any = true;
        for key in [
            "usageMetadata",
            "modelVersion",
            "responseId",
            "promptFeedback",
        ] {
            keep(&mut top, &event, key);
        }
        for (position, candidate) in event["candidates"]
            .as_array()
            .into_iter()
            .flatten()
            .enumerate()
        {
            let index = candidate["index"].as_u64().unwrap_or(position as u64);
            let (members, parts, role) = candidates.entry(index).or_default();
            if let Some(object) = candidate.as_object() {
                for (k, v) in object {
                    if k != "content" {
                        members.insert(k.clone(), v.clone());
                    }
                }
            }
            if !candidate["content"]["role"].is_null() {
                *role = candidate["content"]["role"].clone();
            }
            for part in candidate["content"]["parts"]
                .as_array()
                .into_iter()
                .flatten()
            {
                // A text part's only other members are `thought` and `thoughtSignature`; two
                // join when of one kind and carrying one signature between them, which the
                // joined part keeps: Google streams a signature on a part of its own, often
                // with empty text, after the text it signs (decision 89).
                let text_part = |p: &Value| {
                    p.as_object().is_some_and(|p| {
                        p.get("text").is_some_and(Value::is_string)
                            && p.keys().all(|k| {
                                matches!(k.as_str(), "text" | "thought" | "thoughtSignature")
                            })
                    })
                };
                let joins = |last: &Value| {
                    text_part(last)
                        && text_part(part)
                        && last["thought"] == part["thought"]
                        && (last.get("thoughtSignature").is_none()
                            || part.get("thoughtSignature").is_none())
                };
                match parts.last_mut() {
                    Some(last) if joins(last) => {
                        if let Some(last) = last.as_object_mut() {
                            append(last, "text", &part["text"]);
                            keep(last, part, "thoughtSignature");
                        }
                    }
                    _ => parts.push(part.clone()),
                }
            }
        }
    }
    if !any {
        return None;
    }
    let candidates: Vec<Value> = candidates
        .into_values()
        .map(|(mut members, parts, role)| {
            let role = if role.is_null() { json!("model") } else { role };
            members.insert("content".into(), json!({"role": role, "parts": parts}));
            Value::Object(members)
        })
        .collect();
    top.insert("candidates".into(), Value::Array(candidates));
    Some(Value::Object(top))
}

/// The text of a Gemini answer: the first candidate's non-thought text parts.
pub(super) fn gemini_text(answer: &Value) -> Option<String> {
    let parts = answer["candidates"][0]["content"]["parts"].as_array();
    let text = parts
        .into_iter()
        .flatten()
        .filter(|p| p["thought"] != true)
        .filter_map(|p| p["text"].as_str())
        .collect();
    Some(with_tool_calls(text, gemini_tool_calls(answer)))
}

/// The tool calls of a Gemini answer, `(name, args)`: its first candidate's `functionCall`
/// parts (`function_call` under the proto name, decision 84).
fn gemini_tool_calls(answer: &Value) -> Vec<(&Value, &Value)> {
    answer["candidates"][0]["content"]["parts"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p.get("functionCall").or_else(|| p.get("function_call")))
        .map(|call| (&call["name"], &call["args"]))
        .collect()
}

// ------------------------------------------------------------------------------------------
// OpenAI chat fine-tuning examples (EX-5, decision 63)
// ------------------------------------------------------------------------------------------

/// Why a request is not an example.
pub(crate) type Skip = String;

/// What goes between two text blocks (or parts) of one message when they become one string
/// (decision 63).
#[derive(Clone, Copy)]
enum Join {
    /// A message of the request: a newline. They are separate texts to the model, and run
    /// together they would read as one (`"You are terse." + "Be kind."` is not
    /// `"You are terse.Be kind."`).
    Request,
    /// The answer: nothing. A streamed answer's adjacent texts are joined with nothing (EX-3),
    /// so the same answer, streamed or not, is the same example.
    Answer,
}

/// `texts` as one string, `join`'s separator between two of them; empty ones are left out.
fn join_blocks<'a>(texts: impl IntoIterator<Item = &'a str>, join: Join) -> String {
    let separator = match join {
        Join::Request => "\n",
        Join::Answer => "",
    };
    texts
        .into_iter()
        .filter(|t| !t.is_empty())
        .collect::<Vec<_>>()
        .join(separator)
}

/// A message's content as a string: a string as it is, text parts joined ([`join_blocks`]);
/// an image, audio or file part cannot be carried (decision 63).
fn openai_content(content: &Value, join: Join) -> Result<Value, Skip> {
    match content {
        Value::Null => Ok(Value::Null),
        Value::String(_) => Ok(content.clone()),
        Value::Array(parts) => {
            let mut texts = Vec::new();
            for part in parts {
                match part["type"].as_str() {
                    Some("text") => texts.push(part["text"].as_str().unwrap_or("")),
                    other => {
                        return Err(format!(
                            "a content part of type {} (only text can be carried)",
                            other.unwrap_or("?")
                        ));
                    }
                }
            }
            Ok(Value::String(join_blocks(texts, join)))
        }
        _ => Err("a message content that is neither text nor parts".into()),
    }
}

/// OpenAI chat's `tools`, function tools only.
fn openai_tools(tools: &Value) -> Result<Option<Value>, Skip> {
    let Some(list) = tools.as_array() else {
        return Ok(None);
    };
    for tool in list {
        if tool["type"] != "function" {
            return Err(format!(
                "a tool of type {} (only function tools can be carried)",
                tool["type"]
            ));
        }
    }
    Ok((!list.is_empty()).then(|| tools.clone()))
}

/// The example of an OpenAI chat request and its answer.
fn openai_chat_example(body: &Value, answer: &Value) -> Result<Value, Skip> {
    let mut messages = Vec::new();
    for m in body["messages"].as_array().ok_or("no messages")? {
        let role = match m["role"].as_str() {
            Some("developer" | "system") => "system",
            Some(role @ ("user" | "assistant" | "tool")) => role,
            Some(other) => return Err(format!("a message of role {other}")),
            None => return Err("a message without a role".into()),
        };
        let mut out = Map::new();
        out.insert("role".into(), json!(role));
        out.insert(
            "content".into(),
            openai_content(&m["content"], Join::Request)?,
        );
        for key in ["name", "tool_call_id"] {
            keep(&mut out, m, key);
        }
        keep_tool_calls(&mut out, m)?;
        if role == "assistant" && out["content"].is_null() && !out.contains_key("tool_calls") {
            return Err("an assistant message with neither content nor tool calls".into());
        }
        messages.push(Value::Object(out));
    }
    let answer = &answer["choices"][0]["message"];
    let mut reply = Map::new();
    reply.insert("role".into(), json!("assistant"));
    reply.insert(
        "content".into(),
        openai_content(&answer["content"], Join::Answer)?,
    );
    keep_tool_calls(&mut reply, answer)?;
    // A refusal (`content` null, `refusal` set) or no message at all: the format's assistant
    // turn holds text, or null only beside tool calls.
    if reply["content"].is_null() && !reply.contains_key("tool_calls") {
        return Err("an answer without text or tool calls".into());
    }
    messages.push(Value::Object(reply));
    answered_calls(&messages)?;
    Ok(with_tools(messages, openai_tools(&body["tools"])?))
}

/// Each `tool` message must answer a tool call made before it: the format refuses one that
/// answers none (a history trimmed between a call and its output, which OpenAI refuses too but
/// an OpenAI-compatible server may answer).
fn answered_calls(messages: &[Value]) -> Result<(), Skip> {
    let mut calls = std::collections::HashSet::new();
    for m in messages {
        for call in m["tool_calls"].as_array().into_iter().flatten() {
            calls.extend(call["id"].as_str());
        }
        if m["role"] == "tool"
            && !m["tool_call_id"]
                .as_str()
                .is_some_and(|id| calls.contains(id))
        {
            // No call id in the reason: the CLI counts skips by reason (EX-6).
            return Err("a tool output answering no earlier tool call".into());
        }
    }
    Ok(())
}

/// A chat message's `tool_calls`, when it holds any: OpenAI-compatible servers write `[]` on a
/// message without calls, which the format refuses (a `tool_calls` list is never empty). Each
/// must be a function call with JSON arguments ([`json_arguments`]).
fn keep_tool_calls(into: &mut Map<String, Value>, message: &Value) -> Result<(), Skip> {
    let Some(calls) = message["tool_calls"].as_array().filter(|c| !c.is_empty()) else {
        return Ok(());
    };
    for call in calls {
        if call["type"] != "function" {
            return Err(format!(
                "a tool call of type {} (only function calls can be carried)",
                call["type"].as_str().unwrap_or("?")
            ));
        }
        json_arguments(&call["function"]["arguments"])?;
    }
    into.insert("tool_calls".into(), message["tool_calls"].clone());
    Ok(())
}

/// A function call's `arguments` must be a string holding JSON: the format's tool calls carry
/// JSON, and a call cut short by the token limit (chat's `finish_reason: "length"`, a Responses
/// answer `incomplete` for `max_output_tokens`) holds only the start of it.
fn json_arguments(arguments: &Value) -> Result<(), Skip> {
    match arguments.as_str() {
        Some(s) if serde_json::from_str::<Value>(s).is_ok() => Ok(()),
        Some(_) => Err(
            "a tool call whose arguments are not JSON (a call cut short by the token limit)".into(),
        ),
        None => Err("a tool call without arguments".into()),
    }
}

fn with_tools(messages: Vec<Value>, tools: Option<Value>) -> Value {
    let mut example = json!({ "messages": messages });
    if let Some(tools) = tools {
        example["tools"] = tools;
    }
    example
}

/// Anthropic content (a string, or blocks) as OpenAI messages of `role`: text joined into one
/// message ([`join_blocks`]), `tool_use` as its `tool_calls`, `tool_result` as `tool` messages
/// before it.
fn anthropic_blocks(role: &str, content: &Value, join: Join) -> Result<Vec<Value>, Skip> {
    if let Some(text) = content.as_str() {
        return Ok(vec![json!({"role": role, "content": text})]);
    }
    let blocks = content
        .as_array()
        .ok_or("a message content that is neither text nor blocks")?;
    let mut texts = Vec::new();
    let mut calls = Vec::new();
    let mut out = Vec::new();
    for block in blocks {
        match block["type"].as_str() {
            Some("text") => texts.push(block["text"].as_str().unwrap_or("")),
            // No place for reasoning in the format (decision 63).
            Some("thinking" | "redacted_thinking") => {}
            Some("tool_use") => calls.push(json!({
                "id": block["id"],
                "type": "function",
                "function": {
                    "name": block["name"],
                    "arguments": serde_json::to_string(&block["input"]).unwrap_or_default(),
                },
            })),
            Some("tool_result") => {
                let result = match &block["content"] {
                    Value::String(s) => s.clone(),
                    Value::Null => String::new(),
                    Value::Array(parts) => {
                        for p in parts {
                            if p["type"] != "text" {
                                return Err(format!(
                                    "a tool result part of type {}",
                                    p["type"].as_str().unwrap_or("?")
                                ));
                            }
                        }
                        join_blocks(parts.iter().filter_map(|p| p["text"].as_str()), join)
                    }
                    _ => return Err("a tool result that is neither text nor parts".into()),
                };
                out.push(json!({
                    "role": "tool",
                    "tool_call_id": block["tool_use_id"],
                    "content": result,
                }));
            }
            other => {
                return Err(format!(
                    "a content block of type {} (only text and tools can be carried)",
                    other.unwrap_or("?")
                ));
            }
        }
    }
    let text = join_blocks(texts, join);
    if !text.is_empty() || !calls.is_empty() {
        let mut message = json!({"role": role, "content": if text.is_empty() { Value::Null } else { json!(text) }});
        if !calls.is_empty() {
            message["tool_calls"] = Value::Array(calls);
        }
        out.push(message);
    }
    Ok(out)
}

/// The example of an Anthropic messages request and its answer.
fn anthropic_example(body: &Value, answer: &Value) -> Result<Value, Skip> {
    let mut messages = Vec::new();
    match &body["system"] {
        Value::Null => {}
        Value::String(s) => messages.push(json!({"role": "system", "content": s})),
        Value::Array(blocks) => {
            let text = join_blocks(
                blocks.iter().filter_map(|b| b["text"].as_str()),
                Join::Request,
            );
            messages.push(json!({"role": "system", "content": text}));
        }
        _ => return Err("a system prompt that is neither text nor blocks".into()),
    }
    for m in body["messages"].as_array().ok_or("no messages")? {
        let role = match m["role"].as_str() {
            Some(role @ ("user" | "assistant")) => role,
            other => return Err(format!("a message of role {}", other.unwrap_or("?"))),
        };
        messages.extend(anthropic_blocks(role, &m["content"], Join::Request)?);
    }
    let reply = anthropic_blocks("assistant", &answer["content"], Join::Answer)?;
    if reply.is_empty() {
        return Err("an answer without text or tool calls".into());
    }
    messages.extend(reply);
    answered_calls(&messages)?;
    let tools = match body["tools"].as_array() {
        None => None,
        Some(list) => {
            let mut out = Vec::new();
            for tool in list {
                if tool.get("input_schema").is_none() {
                    return Err(format!(
                        "a server tool {} (only custom tools can be carried)",
                        tool["type"].as_str().unwrap_or("?")
                    ));
                }
                out.push(json!({"type": "function", "function": {
                    "name": tool["name"],
                    "description": tool.get("description").cloned().unwrap_or(json!("")),
                    "parameters": tool["input_schema"],
                }}));
            }
            (!out.is_empty()).then_some(Value::Array(out))
        }
    };
    Ok(with_tools(messages, tools))
}

/// Gemini parts as OpenAI messages of `role`, their texts joined as `join` says; `calls`
/// numbers the made-up call ids (Gemini has none, decision 63) and `pending` holds the ids of
/// calls not yet answered, by name.
fn gemini_parts(
    role: &str,
    parts: &Value,
    join: Join,
    calls: &mut u64,
    pending: &mut Vec<(String, String)>,
) -> Result<Vec<Value>, Skip> {
    let mut texts = Vec::new();
    let mut tool_calls = Vec::new();
    let mut out = Vec::new();
    for part in parts.as_array().ok_or("content without parts")? {
        if part["thought"] == true {
            continue;
        }
        if let Some(t) = part["text"].as_str() {
            texts.push(t);
        } else if let Some(call) = gemini_member(part, "functionCall") {
            *calls += 1;
            let id = format!("call_{calls}");
            let name = call["name"].as_str().unwrap_or("").to_owned();
            pending.push((name.clone(), id.clone()));
            tool_calls.push(json!({
                "id": id,
                "type": "function",
                "function": {
                    "name": name,
                    "arguments": serde_json::to_string(&call["args"]).unwrap_or_default(),
                },
            }));
        } else if let Some(response) = gemini_member(part, "functionResponse") {
            let name = response["name"].as_str().unwrap_or("");
            let at = pending.iter().position(|(n, _)| n == name);
            let id = at.map_or_else(|| format!("call_{name}"), |at| pending.remove(at).1);
            out.push(json!({
                "role": "tool",
                "tool_call_id": id,
                "content": serde_json::to_string(&response["response"]).unwrap_or_default(),
            }));
        } else {
            let kind = part
                .as_object()
                .and_then(|p| p.keys().find(|k| *k != "thought").cloned())
                .unwrap_or_default();
            return Err(format!(
                "a part of kind {kind} (only text and functions can be carried)"
            ));
        }
    }
    let text = join_blocks(texts, join);
    if !text.is_empty() || !tool_calls.is_empty() {
        let mut message = json!({"role": role, "content": if text.is_empty() { Value::Null } else { json!(text) }});
        if !tool_calls.is_empty() {
            message["tool_calls"] = Value::Array(tool_calls);
        }
        out.push(message);
    }
    Ok(out)
}

/// A member of a Gemini request object by its JSON name (`functionDeclarations`), else by its
/// proto field name (`function_declarations`): Google's JSON parser takes both, its REST
/// examples write the second, and google-genai for Python passes a declaration given as a dict
/// on as it is (pydantic-ai's `GoogleModel` sends `parameters_json_schema`; decision 84).
fn gemini_member<'a>(object: &'a Value, json_name: &str) -> Option<&'a Value> {
    object.get(json_name).or_else(|| {
        let mut proto_name = String::with_capacity(json_name.len() + 4);
        for c in json_name.chars() {
            if c.is_ascii_uppercase() {
                proto_name.push('_');
            }
            proto_name.push(c.to_ascii_lowercase());
        }
        object.get(proto_name)
    })
}

/// The `Schema` keywords [`gemini_json_schema`] reads whose proto field names differ from
/// their JSON names, which are JSON Schema's: a schema written with the proto names (decision
/// 84) gets JSON Schema's.
const GEMINI_PROTO_KEYWORDS: [(&str, &str); 7] = [
    ("any_of", "anyOf"),
    ("min_items", "minItems"),
    ("max_items", "maxItems"),
    ("min_length", "minLength"),
    ("max_length", "maxLength"),
    ("min_properties", "minProperties"),
    ("max_properties", "maxProperties"),
];

/// Google's integer bounds, which its JSON writes as strings (`"maxItems": "5"`, int64).
const GEMINI_INT64_KEYWORDS: [&str; 6] = [
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
    "minProperties",
    "maxProperties",
];

/// A Gemini `Schema` (a subset of OpenAPI 3.0's schema, with Google's upper-case `Type` names:
/// `STRING`, `NUMBER`, `INTEGER`, `BOOLEAN`, `ARRAY`, `OBJECT`, `NULL`) as the JSON Schema an
/// OpenAI function's `parameters` holds (EX-5, decision 63): each `type` lower-cased
/// (`TYPE_UNSPECIFIED` left out), `nullable: true` as a `"null"` type (and a `null` among an
/// `enum`'s values), an integer bound written as a string as a number; through every
/// sub-schema (`properties`' values, `items`, `anyOf`), never through data (`enum`, `default`,
/// `example`). Those keywords written with their proto field names (`any_of`, `max_items`)
/// take their JSON names. Other keywords pass as they are. A declaration's
/// `parametersJsonSchema` is JSON Schema already and is not read with this.
fn gemini_json_schema(schema: &Value) -> Value {
    let Value::Object(map) = schema else {
        return schema.clone();
    };
    let mut out = Map::new();
    for (key, value) in map {
        let key = GEMINI_PROTO_KEYWORDS
            .iter()
            .find(|(proto, _)| proto == key)
            .map_or(key.as_str(), |(_, json)| json);
        let value = match (key, value) {
            ("type", Value::String(t)) if t == "TYPE_UNSPECIFIED" => continue,
            ("type", Value::String(t)) => Value::String(t.to_ascii_lowercase()),
            ("nullable", _) => continue,
            ("properties", Value::Object(properties)) => Value::Object(
                properties
                    .iter()
                    .map(|(name, s)| (name.clone(), gemini_json_schema(s)))
                    .collect(),
            ),
            ("items", items) => gemini_json_schema(items),
            ("anyOf", Value::Array(list)) => {
                Value::Array(list.iter().map(gemini_json_schema).collect())
            }
            (k, Value::String(n)) if GEMINI_INT64_KEYWORDS.contains(&k) => n
                .parse::<u64>()
                .map_or_else(|_| value.clone(), |n| json!(n)),
            _ => value.clone(),
        };
        out.insert(key.to_owned(), value);
    }
    if map.get("nullable") == Some(&Value::Bool(true)) {
        match out.get_mut("type") {
            Some(Value::String(t)) if t != "null" => {
                let t = std::mem::take(t);
                out.insert("type".into(), json!([t, "null"]));
            }
            None => {
                if let Some(Value::Array(any_of)) = out.get_mut("anyOf") {
                    any_of.push(json!({"type": "null"}));
                }
            }
            _ => {}
        }
        if let Some(Value::Array(values)) = out.get_mut("enum")
            && !values.contains(&Value::Null)
        {
            values.push(Value::Null);
        }
    }
    Value::Object(out)
}

/// The example of a Gemini request and its answer.
fn gemini_example(body: &Value, answer: &Value) -> Result<Value, Skip> {
    let mut messages = Vec::new();
    let (mut calls, mut pending) = (0u64, Vec::new());
    if let Some(parts) = gemini_member(body, "systemInstruction").and_then(|s| s.get("parts")) {
        let text = join_blocks(
            parts
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|p| p["text"].as_str()),
            Join::Request,
        );
        messages.push(json!({"role": "system", "content": text}));
    }
    let contents = match &body["contents"] {
        Value::Array(list) => list.clone(),
        Value::Object(_) => vec![body["contents"].clone()],
        _ => return Err("no contents".into()),
    };
    for content in &contents {
        let role = match content["role"].as_str() {
            Some("model") => "assistant",
            Some("user") | None => "user",
            Some(other) => return Err(format!("a content of role {other}")),
        };
        messages.extend(gemini_parts(
            role,
            &content["parts"],
            Join::Request,
            &mut calls,
            &mut pending,
        )?);
    }
    if answer["candidates"][0].is_null() {
        // A blocked prompt is answered with no candidate, and says why (GM-3).
        let blocked = gemini_member(answer, "promptFeedback")
            .and_then(|f| gemini_member(f, "blockReason"))
            .and_then(Value::as_str);
        return Err(match blocked {
            Some(reason) => format!("a blocked prompt ({reason}): nothing was answered"),
            None => "an answer without candidates".into(),
        });
    }
    let reply = gemini_parts(
        "assistant",
        &answer["candidates"][0]["content"]["parts"],
        Join::Answer,
        &mut calls,
        &mut pending,
    )?;
    if reply.is_empty() {
        return Err("an answer without text or function calls".into());
    }
    messages.extend(reply);
    answered_calls(&messages)?;
    let mut tools = Vec::new();
    for tool in body["tools"].as_array().into_iter().flatten() {
        let Some(declarations) =
            gemini_member(tool, "functionDeclarations").and_then(Value::as_array)
        else {
            return Err("a tool other than function declarations".into());
        };
        for d in declarations {
            let mut function = json!({"name": d["name"]});
            keep(function.as_object_mut().ok_or("?")?, d, "description");
            if let Some(p) = d.get("parameters") {
                function["parameters"] = gemini_json_schema(p);
            } else if let Some(p) = gemini_member(d, "parametersJsonSchema") {
                function["parameters"] = p.clone();
            }
            tools.push(json!({"type": "function", "function": function}));
        }
    }
    Ok(with_tools(
        messages,
        (!tools.is_empty()).then_some(Value::Array(tools)),
    ))
}

/// A Responses message item's `content` (a string, or parts) as one string: `input_text`,
/// `output_text` and `refusal` parts joined as `join` says; an image, audio or file part cannot
/// be carried (decision 63).
fn responses_content(content: &Value, join: Join) -> Result<String, Skip> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut texts = Vec::new();
            for part in parts {
                let text = match part["type"].as_str() {
                    Some("input_text" | "output_text" | "text") => &part["text"],
                    Some("refusal") => &part["refusal"],
                    other => {
                        return Err(format!(
                            "a content part of type {} (only text can be carried)",
                            other.unwrap_or("?")
                        ));
                    }
                };
                texts.push(text.as_str().unwrap_or(""));
            }
            Ok(join_blocks(texts, join))
        }
        _ => Err("a message content that is neither text nor parts".into()),
    }
}

/// Responses items (the request's `input`, or the answer's `output`) as OpenAI chat messages:
/// messages by role, `function_call` items as the `tool_calls` of the assistant message they
/// follow (or of one of their own), `function_call_output` items as `tool` messages, reasoning
/// dropped (decision 87).
fn responses_items(items: &[Value], join: Join) -> Result<Vec<Value>, Skip> {
    let mut messages: Vec<Value> = Vec::new();
    for item in items {
        // A message item's `type` may be left out (the SDKs' "easy" input message).
        match item["type"].as_str().unwrap_or("message") {
            "message" => {
                let role = match item["role"].as_str() {
                    Some("developer" | "system") => "system",
                    Some(role @ ("user" | "assistant")) => role,
                    other => return Err(format!("a message of role {}", other.unwrap_or("?"))),
                };
                let text = responses_content(&item["content"], join)?;
                // An assistant turn without text is its tool calls' (null, as in chat).
                let content = if role == "assistant" && text.is_empty() {
                    Value::Null
                } else {
                    json!(text)
                };
                messages.push(json!({"role": role, "content": content}));
            }
            "function_call" => {
                let call = json!({
                    "id": item["call_id"],
                    "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]},
                });
                let named = |v: &Value| v.as_str().is_some_and(|s| !s.is_empty());
                if !named(&call["id"]) || !named(&item["name"]) || !item["arguments"].is_string() {
                    return Err("a function call without a call id, name or arguments".into());
                }
                json_arguments(&item["arguments"])?;
                // Calls made together, and a call right after the assistant's text, are one
                // assistant turn.
                match messages.last_mut() {
                    Some(last) if last["role"] == "assistant" => {
                        match last.get_mut("tool_calls").and_then(Value::as_array_mut) {
                            Some(calls) => calls.push(call),
                            None => last["tool_calls"] = json!([call]),
                        }
                    }
                    _ => messages
                        .push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
                }
            }
            "function_call_output" => {
                let output = match &item["output"] {
                    Value::String(s) => s.clone(),
                    parts @ Value::Array(_) => responses_content(parts, join)?,
                    _ => return Err("a function call output that is neither text nor parts".into()),
                };
                messages.push(json!({
                    "role": "tool",
                    "tool_call_id": item["call_id"],
                    "content": output,
                }));
            }
            // No place for reasoning in the format (decision 63).
            "reasoning" => {}
            other => {
                return Err(format!(
                    "an item of type {other} (only messages and function calls can be carried)"
                ));
            }
        }
    }
    // (An answer's items are one turn, checked as a whole by the caller.)
    let empty_turn = |m: &Value| {
        m["role"] == "assistant" && m["content"].is_null() && m.get("tool_calls").is_none()
    };
    if matches!(join, Join::Request) && messages.iter().any(empty_turn) {
        return Err("an assistant message with neither content nor tool calls".into());
    }
    Ok(messages)
}

/// The example of a Responses request and its answer (decision 87): `instructions` as the
/// system message, the `input` items, then the answer's `output` items. A request that
/// continues a conversation the provider stored (`previous_response_id`, `conversation`) or
/// uses a stored prompt (`prompt`) is skipped: part of what the model saw is not in its body.
fn responses_example(body: &Value, answer: &Value) -> Result<Value, Skip> {
    for stored in ["previous_response_id", "conversation", "prompt"] {
        if body.get(stored).is_some_and(|v| !v.is_null()) {
            return Err(format!(
                "a Responses request with {stored} (part of its conversation is stored by \
                 the provider, not in its body)"
            ));
        }
    }
    let mut messages = Vec::new();
    match &body["instructions"] {
        Value::Null => {}
        // An empty `instructions` is no system message.
        Value::String(s) if s.is_empty() => {}
        Value::String(s) => messages.push(json!({"role": "system", "content": s})),
        _ => return Err("instructions that are not text (a stored prompt)".into()),
    }
    match &body["input"] {
        Value::String(s) => messages.push(json!({"role": "user", "content": s})),
        Value::Array(items) => messages.extend(responses_items(items, Join::Request)?),
        _ => return Err("no input".into()),
    }
    let output = answer["output"]
        .as_array()
        .ok_or("an answer without output items")?;
    let reply = responses_items(output, Join::Answer)?;
    if reply.iter().any(|m| m["role"] != "assistant") {
        return Err("an answer with an item that is not the assistant's".into());
    }
    // The answer is one assistant message, its texts joined and its calls together.
    let mut texts = Vec::new();
    let mut calls = Vec::new();
    for m in &reply {
        texts.extend(m["content"].as_str());
        calls.extend(m["tool_calls"].as_array().into_iter().flatten().cloned());
    }
    let text = join_blocks(texts, Join::Answer);
    // Reasoning alone (an answer cut by `max_output_tokens`), or a message of empty text:
    // nothing the format can hold as the assistant's turn (`content` null only beside calls).
    if text.is_empty() && calls.is_empty() {
        return Err("an answer without text or tool calls".into());
    }
    let mut last = json!({"role": "assistant", "content": if text.is_empty() { Value::Null } else { json!(text) }});
    if !calls.is_empty() {
        last["tool_calls"] = Value::Array(calls);
    }
    messages.push(last);
    answered_calls(&messages)?;
    let tools = match body["tools"].as_array() {
        None => None,
        Some(list) => {
            let mut out = Vec::new();
            for tool in list {
                if tool["type"] != "function" {
                    return Err(format!(
                        "a tool of type {} (only function tools can be carried)",
                        tool["type"].as_str().unwrap_or("?")
                    ));
                }
                let mut function = Map::new();
                for key in ["name", "description", "parameters", "strict"] {
                    keep(&mut function, tool, key);
                }
                out.push(json!({"type": "function", "function": function}));
            }
            (!out.is_empty()).then_some(Value::Array(out))
        }
    };
    Ok(with_tools(messages, tools))
}

/// Why an `answer` of `route` is one the provider cut short rather than finished (EX-5,
/// decision 95): its token limit, or a filter that stopped it mid-way. Such an answer is what
/// the provider said, but as a fine-tuning example it would teach a model to stop there.
fn cut_short(route: Route, answer: &Value) -> Option<Skip> {
    let (field, reason) = match route {
        Route::OpenaiChat => ("finish_reason", &answer["choices"][0]["finish_reason"]),
        Route::AnthropicMessages => ("stop_reason", &answer["stop_reason"]),
        Route::GeminiGenerate
        | Route::GeminiStream
        | Route::GeminiV1Generate
        | Route::GeminiV1Stream => ("finishReason", &answer["candidates"][0]["finishReason"]),
        Route::OpenaiResponses => {
            if answer["status"] != "incomplete" {
                return None;
            }
            let why = answer["incomplete_details"]["reason"]
                .as_str()
                .unwrap_or("unknown");
            return Some(format!("an answer cut short (incomplete: {why})"));
        }
        _ => return None,
    };
    let reason = reason.as_str()?;
    let cut = match route.provider() {
        // Gemini: every reason but STOP stops the answer before its end (`MAX_TOKENS`, `SAFETY`,
        // `RECITATION`, `MALFORMED_RESPONSE`, ...; Google adds new ones).
        super::Provider::Gemini => reason != "STOP",
        _ => matches!(
            reason,
            // OpenAI chat.
            "length" | "content_filter"
            // Anthropic; `pause_turn` is a turn its server paused mid-way (a long server
            // tool run), which the client continues by sending it back (decision 105).
            | "max_tokens" | "refusal" | "model_context_window_exceeded" | "pause_turn"
        ),
    };
    cut.then(|| format!("an answer cut short ({field} {reason})"))
}

/// EX-5 for a route: the request `body` with its final `answer` as an example, or why not.
pub(super) fn example(route: Route, body: &Value, answer: &Value) -> Result<Value, Skip> {
    let example = example_of(route, body, answer)?;
    match cut_short(route, answer) {
        Some(why) => Err(why),
        None => Ok(example),
    }
}

/// [`example`] by route, whatever way the answer ended.
fn example_of(route: Route, body: &Value, answer: &Value) -> Result<Value, Skip> {
    match route {
        Route::OpenaiChat => openai_chat_example(body, answer),
        Route::AnthropicMessages => anthropic_example(body, answer),
        Route::GeminiGenerate
        | Route::GeminiStream
        | Route::GeminiV1Generate
        | Route::GeminiV1Stream => gemini_example(body, answer),
        Route::OpenaiResponses => responses_example(body, answer),
        Route::OpenaiCompletions | Route::OpenaiEmbeddings => {
            Err(format!("route {} is not a chat route", route.name()))
        }
        #[cfg(test)]
        Route::EchoSay => Err("route echo.say is not a chat route".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openai_chat_stream_reassembles_text_and_tool_calls_ex3() {
        let events = [
            r#"{"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":"Hel"},"finish_reason":null}]}"#,
            r#"{"id":"c1","choices":[{"index":0,"delta":{"content":"lo"},"finish_reason":null}]}"#,
            r#"{"id":"c1","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"f","arguments":"{\"a\""}}]}}]}"#,
            r#"{"id":"c1","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":":1}"}}]},"finish_reason":"tool_calls"}]}"#,
            r#"{"id":"c1","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}"#,
            "[DONE]",
        ];
        let answer = openai_assemble(Route::OpenaiChat, events).unwrap();
        assert_eq!(answer["object"], "chat.completion");
        let message = &answer["choices"][0]["message"];
        assert_eq!(message["content"], "Hello");
        assert_eq!(
            message["tool_calls"][0]["function"]["arguments"],
            r#"{"a":1}"#
        );
        assert_eq!(message["tool_calls"][0]["id"], "call_1");
        assert_eq!(answer["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(answer["usage"]["completion_tokens"], 2);
        assert_eq!(
            openai_text(Route::OpenaiChat, &answer).unwrap(),
            "Hello\n[tool call] f({\"a\":1})"
        );
    }

    /// EX-2, EX-3: a Messages stream's tool input is kept whole in the records export, whatever
    /// its JSON is: an input that is a string, split across `input_json_delta`s, is that whole
    /// string; one cut short (not JSON) is every byte that came, as a string; one given whole
    /// in `content_block_start` stays as it came. (Checked after a report that the export cut
    /// a string input: it does not.)
    #[test]
    fn a_messages_streams_tool_input_that_is_a_string_is_exported_whole_ex3() {
        let input = |start_input: Value, pieces: &[&str]| {
            let mut events = vec![
                json!({"type": "message_start", "message": {"id": "m", "type": "message",
                    "role": "assistant", "content": [],
                    "usage": {"input_tokens": 1, "output_tokens": 1}}})
                .to_string(),
                json!({"type": "content_block_start", "index": 0, "content_block":
                    {"type": "tool_use", "id": "t", "name": "sh", "input": start_input}})
                .to_string(),
            ];
            for piece in pieces {
                events.push(
                    json!({"type": "content_block_delta", "index": 0,
                        "delta": {"type": "input_json_delta", "partial_json": piece}})
                    .to_string(),
                );
            }
            anthropic_assemble(events.iter().map(String::as_str)).expect("a message")["content"][0]
                ["input"]
                .clone()
        };
        let long = "x".repeat(100_000);
        assert_eq!(
            input(json!({}), &["\"ls -la ", &long, "\""]),
            json!(format!("ls -la {long}"))
        );
        assert_eq!(
            input(json!({}), &["{\"cmd\": \"ls", " -la"]),
            json!("{\"cmd\": \"ls -la")
        );
        assert_eq!(input(json!("whole"), &[]), json!("whole"));
    }

    #[test]
    fn anthropic_stream_reassembles_blocks_tool_input_and_stop_reason_ex3() {
        let events = [
            r#"{"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","model":"claude","content":[],"stop_reason":null,"usage":{"input_tokens":5,"output_tokens":1}}}"#,
            r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hi "}}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"there"}}"#,
            r#"{"type":"content_block_stop","index":0}"#,
            r#"{"type":"content_block_start","index":1,"content_block":{"type":"tool_use","id":"tu_1","name":"f","input":{}}}"#,
            r#"{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"{\"x\":"}}"#,
            r#"{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"2}"}}"#,
            r#"{"type":"content_block_stop","index":1}"#,
            r#"{"type":"message_delta","delta":{"stop_reason":"tool_use","stop_sequence":null},"usage":{"output_tokens":9}}"#,
            r#"{"type":"message_stop"}"#,
        ];
        let answer = anthropic_assemble(events).unwrap();
        assert_eq!(answer["content"][0]["text"], "Hi there");
        assert_eq!(answer["content"][1]["input"], json!({"x": 2}));
        assert_eq!(answer["stop_reason"], "tool_use");
        assert_eq!(
            answer["usage"],
            json!({"input_tokens": 5, "output_tokens": 9})
        );
        assert_eq!(
            anthropic_text(&answer).unwrap(),
            "Hi there\n[tool call] f({\"x\":2})"
        );
        let body = json!({"system": "be brief", "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "f", "input_schema": {"type": "object"}}]});
        let ex = example(Route::AnthropicMessages, &body, &answer).unwrap();
        assert_eq!(
            ex["messages"][0],
            json!({"role": "system", "content": "be brief"})
        );
        assert_eq!(ex["messages"][2]["content"], "Hi there");
        assert_eq!(
            ex["messages"][2]["tool_calls"][0]["function"]["arguments"],
            r#"{"x":2}"#
        );
        assert_eq!(ex["tools"][0]["function"]["name"], "f");
    }

    #[test]
    fn gemini_stream_joins_adjacent_text_parts_and_keeps_the_last_usage_ex3() {
        let events = [
            r#"{"candidates":[{"content":{"role":"model","parts":[{"text":"a"}]},"index":0}],"usageMetadata":{"promptTokenCount":1}}"#,
            r#"{"candidates":[{"content":{"role":"model","parts":[{"text":"b"}]},"finishReason":"STOP","index":0}],"usageMetadata":{"promptTokenCount":1,"candidatesTokenCount":2},"modelVersion":"g"}"#,
        ];
        let answer = gemini_assemble(events).unwrap();
        assert_eq!(
            answer["candidates"][0]["content"]["parts"],
            json!([{"text": "ab"}])
        );
        assert_eq!(answer["candidates"][0]["finishReason"], "STOP");
        assert_eq!(answer["usageMetadata"]["candidatesTokenCount"], 2);
        assert_eq!(gemini_text(&answer).unwrap(), "ab");
    }

    /// EX-3, decision 89: Google streams a thought signature on a part of its own, often with
    /// empty text, after the text it signs; the non-stream answer has it on that text's part.
    /// Joining the parts kept the text and dropped the signature, which a client continuing
    /// the conversation from the export must send back.
    #[test]
    fn a_gemini_streams_thought_signature_survives_the_joining_of_text_parts_ex3() {
        let events = [
            r#"{"candidates":[{"content":{"role":"model","parts":[{"text":"Let me think","thought":true}]},"index":0}]}"#,
            r#"{"candidates":[{"content":{"role":"model","parts":[{"text":"Hello "}]},"index":0}]}"#,
            r#"{"candidates":[{"content":{"role":"model","parts":[{"text":"world"}]},"index":0}]}"#,
            r#"{"candidates":[{"content":{"role":"model","parts":[{"text":"","thoughtSignature":"c2lnMQ=="}]},"finishReason":"STOP","index":0}]}"#,
            r#"{"candidates":[{"content":{"role":"model","parts":[{"text":"more","thoughtSignature":"c2lnMg=="}]},"index":0}]}"#,
        ];
        let answer = gemini_assemble(events).unwrap();
        assert_eq!(
            answer["candidates"][0]["content"]["parts"],
            json!([
                {"text": "Let me think", "thought": true},
                {"text": "Hello world", "thoughtSignature": "c2lnMQ=="},
                {"text": "more", "thoughtSignature": "c2lnMg=="},
            ]),
            "one signature per joined part, none lost"
        );
    }

    /// Google's JSON parser takes a request's members under their proto field names too
    /// (`system_instruction`, `function_declarations`), its REST examples write them so, and
    /// google-genai for Python passes a declaration given as a dict on as it is: pydantic-ai's
    /// `GoogleModel` sends `parameters_json_schema`. Such a request is the same example as its
    /// JSON-named twin; the export used to drop its system prompt and its tools' parameters,
    /// and skip its function calls as parts it could not carry (decision 84).
    #[test]
    fn a_gemini_request_written_with_proto_field_names_exports_as_its_json_named_twin_ex5() {
        let answer = json!({"candidates": [{"content": {"role": "model",
            "parts": [{"text": "It is sunny."}]}, "finishReason": "STOP"}]});
        let json_named = json!({
            "systemInstruction": {"parts": [{"text": "Be brief."}]},
            "contents": [
                {"role": "user", "parts": [{"text": "weather in Paris?"}]},
                {"role": "model", "parts": [{"functionCall": {"name": "lookup", "args": {"q": "Paris"}},
                    "thoughtSignature": "c2ln"}]},
                {"role": "user", "parts": [{"functionResponse": {"name": "lookup",
                    "response": {"return_value": "sunny"}}}]}
            ],
            "tools": [{"functionDeclarations": [
                {"name": "lookup", "description": "look something up", "parametersJsonSchema":
                    {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}},
                {"name": "days", "parameters": {"type": "OBJECT", "properties": {"n": {
                    "anyOf": [{"type": "INTEGER"}, {"type": "STRING"}]},
                    "list": {"type": "ARRAY", "maxItems": "7", "items": {"type": "STRING"}}}}}
            ]}]
        });
        let proto_named = json!({
            "system_instruction": {"parts": [{"text": "Be brief."}]},
            "contents": [
                {"role": "user", "parts": [{"text": "weather in Paris?"}]},
                {"role": "model", "parts": [{"function_call": {"name": "lookup", "args": {"q": "Paris"}},
                    "thought_signature": "c2ln"}]},
                {"role": "user", "parts": [{"function_response": {"name": "lookup",
                    "response": {"return_value": "sunny"}}}]}
            ],
            "tools": [{"function_declarations": [
                {"name": "lookup", "description": "look something up", "parameters_json_schema":
                    {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}},
                {"name": "days", "parameters": {"type": "OBJECT", "properties": {"n": {
                    "any_of": [{"type": "INTEGER"}, {"type": "STRING"}]},
                    "list": {"type": "ARRAY", "max_items": "7", "items": {"type": "STRING"}}}}}
            ]}]
        });
        let want = example(Route::GeminiGenerate, &json_named, &answer).unwrap();
        assert_eq!(
            want["messages"][0],
            json!({"role": "system", "content": "Be brief."})
        );
        assert_eq!(
            want["tools"][0]["function"]["parameters"],
            json_named["tools"][0]["functionDeclarations"][0]["parametersJsonSchema"]
        );
        assert_eq!(
            want["tools"][1]["function"]["parameters"]["properties"],
            json!({"n": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
                "list": {"type": "array", "maxItems": 7, "items": {"type": "string"}}})
        );
        assert_eq!(
            example(Route::GeminiGenerate, &proto_named, &answer),
            Ok(want)
        );
    }

    /// EX-5: a blocked Gemini prompt has no candidate to carry; its skip names the block, not
    /// the missing parts it would find in the first candidate (a new-user trial read "content
    /// without parts").
    #[test]
    fn a_blocked_gemini_prompt_is_skipped_as_blocked_ex5() {
        let body = json!({"contents": [{"role": "user", "parts": [{"text": "something bad"}]}]});
        let blocked = json!({"promptFeedback": {"blockReason": "SAFETY"},
            "usageMetadata": {"promptTokenCount": 4}});
        assert_eq!(
            example(Route::GeminiGenerate, &body, &blocked),
            Err("a blocked prompt (SAFETY): nothing was answered".into())
        );
        let proto = json!({"prompt_feedback": {"block_reason": "OTHER"}});
        assert_eq!(
            example(Route::GeminiGenerate, &body, &proto),
            Err("a blocked prompt (OTHER): nothing was answered".into())
        );
        assert_eq!(
            example(Route::GeminiGenerate, &body, &json!({"candidates": []})),
            Err("an answer without candidates".into())
        );
    }

    /// EX-5, decision 63: a Gemini function declaration's `parameters` is Google's Schema
    /// (upper-case types, `nullable`, int64 bounds as strings); the example's `tools` carry it
    /// as JSON Schema, at every depth, and a `parametersJsonSchema` as it came.
    #[test]
    fn a_gemini_declarations_schema_becomes_json_schema_in_the_openai_chat_example_ex5() {
        let answer = json!({"candidates": [{"content": {"role": "model",
            "parts": [{"text": "ok"}]}, "finishReason": "STOP"}]});
        let parameters = json!({
            "type": "OBJECT",
            "properties": {
                "city": {"type": "STRING", "description": "a city"},
                "type": {"type": "STRING", "enum": ["STRING", "NUMBER"], "nullable": true},
                "days": {"type": "ARRAY", "maxItems": "7",
                    "items": {"type": "INTEGER", "format": "int32"}},
                "where": {"anyOf": [{"type": "NUMBER"}, {"type": "BOOLEAN"}], "nullable": true},
                "nothing": {"type": "NULL"},
                "any": {"type": "TYPE_UNSPECIFIED", "default": "OBJECT"},
                "deep": {"type": "OBJECT", "properties": {"flag": {"type": "BOOLEAN"}}}
            },
            "required": ["city"]
        });
        let schema = json!({"type": "object", "properties": {"x": {"type": "STRING"}}});
        let body = json!({
            "contents": [{"role": "user", "parts": [{"text": "weather?"}]}],
            "tools": [{"functionDeclarations": [
                {"name": "weather", "description": "the weather", "parameters": parameters},
                {"name": "raw", "parametersJsonSchema": schema}
            ]}]
        });
        let ex = example(Route::GeminiGenerate, &body, &answer).unwrap();
        assert_eq!(
            ex["tools"][0],
            json!({"type": "function", "function": {"name": "weather",
                "description": "the weather", "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "a city"},
                    "type": {"type": ["string", "null"], "enum": ["STRING", "NUMBER", null]},
                    "days": {"type": "array", "maxItems": 7,
                        "items": {"type": "integer", "format": "int32"}},
                    "where": {"anyOf": [{"type": "number"}, {"type": "boolean"},
                        {"type": "null"}]},
                    "nothing": {"type": "null"},
                    "any": {"default": "OBJECT"},
                    "deep": {"type": "object", "properties": {"flag": {"type": "boolean"}}}
                },
                "required": ["city"]
            }}})
        );
        assert_eq!(
            ex["tools"][1]["function"]["parameters"], schema,
            "parametersJsonSchema is JSON Schema already"
        );
    }

    #[test]
    fn an_image_part_skips_the_request_and_developer_becomes_system_ex5() {
        let answer = json!({"choices": [{"message": {"role": "assistant", "content": "ok"}}]});
        let body = json!({"messages": [
            {"role": "developer", "content": "rules"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]});
        let ex = example(Route::OpenaiChat, &body, &answer).unwrap();
        assert_eq!(ex["messages"][0]["role"], "system");
        assert_eq!(ex["messages"][1]["content"], "a\nb");
        assert_eq!(
            ex["messages"][2],
            json!({"role": "assistant", "content": "ok"})
        );
        let image = json!({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:..."}}]}]});
        assert!(
            example(Route::OpenaiChat, &image, &answer)
                .unwrap_err()
                .contains("image_url")
        );
        assert!(example(Route::OpenaiEmbeddings, &body, &answer).is_err());
    }

    /// Decision 63: a request's text blocks are joined with a newline, the answer's with
    /// nothing, as EX-3 joins a streamed answer's texts: a non-stream answer in several text
    /// parts is exported as the same answer streamed is.
    #[test]
    fn an_answers_text_blocks_are_joined_with_nothing_a_requests_with_a_newline_ex5() {
        let gemini =
            json!({"contents": [{"role": "user", "parts": [{"text": "a"}, {"text": "b"}]}]});
        let parts = json!({"candidates": [{"content": {"role": "model", "parts": [
            {"text": "Hello, "}, {"text": "wor"}, {"text": "ld."}]}}]});
        let ex = example(Route::GeminiGenerate, &gemini, &parts).unwrap();
        assert_eq!(ex["messages"][0]["content"], "a\nb");
        assert_eq!(ex["messages"][1]["content"], "Hello, world.");
        let streamed = gemini_assemble([
            r#"{"candidates":[{"content":{"role":"model","parts":[{"text":"Hello, "}]}}]}"#,
            r#"{"candidates":[{"content":{"role":"model","parts":[{"text":"wor"},{"text":"ld."}]}}]}"#,
        ])
        .unwrap();
        assert_eq!(
            example(Route::GeminiStream, &gemini, &streamed).unwrap(),
            ex,
            "streamed or not, one example"
        );

        let anthropic = json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]});
        let blocks = json!({"content": [{"type": "text", "text": "Hello, "},
            {"type": "text", "text": "world."}]});
        let ex = example(Route::AnthropicMessages, &anthropic, &blocks).unwrap();
        assert_eq!(ex["messages"][0]["content"], "a\nb");
        assert_eq!(ex["messages"][1]["content"], "Hello, world.");

        let openai = json!({"messages": [{"role": "user", "content": "hi"}]});
        let answer = json!({"choices": [{"message": {"role": "assistant", "content": [
            {"type": "text", "text": "Hello, "}, {"type": "text", "text": "world."}]}}]});
        let ex = example(Route::OpenaiChat, &openai, &answer).unwrap();
        assert_eq!(ex["messages"][1]["content"], "Hello, world.");
    }

    /// EX-5: a chat answer the format's assistant turn cannot hold (a refusal, no message) is a
    /// skip, not an example with a null content; an empty `tool_calls` (OpenAI-compatible
    /// servers write one) is left out rather than refused by the format.
    #[test]
    fn a_chat_refusal_is_skipped_and_an_empty_tool_calls_left_out_ex5() {
        let body = json!({"messages": [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello", "tool_calls": []},
            {"role": "user", "content": "and?"}]});
        let refusal = json!({"choices": [{"message": {"role": "assistant", "content": null,
            "refusal": "I can't help with that."}}]});
        let why = example(Route::OpenaiChat, &body, &refusal).unwrap_err();
        assert!(why.contains("without text or tool calls"), "{why}");
        assert!(example(Route::OpenaiChat, &body, &json!({"choices": []})).is_err());
        let answer = json!({"choices": [{"message": {"role": "assistant", "content": "ok",
            "tool_calls": []}}]});
        let ex = example(Route::OpenaiChat, &body, &answer).unwrap();
        assert_eq!(
            ex["messages"],
            json!([{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "and?"},
                {"role": "assistant", "content": "ok"}])
        );
    }

    /// An answer the provider cut short — its token limit, a filter — is skipped naming how,
    /// on every chat route; the same answer finished is an example (EX-5, decision 95).
    #[test]
    fn an_answer_cut_short_is_skipped_naming_how_ex5() {
        let chat = json!({"messages": [{"role": "user", "content": "tell me"}]});
        let chat_answer = |finish: &str| {
            json!({"choices": [{"finish_reason": finish,
                "message": {"role": "assistant", "content": "Once upon a"}}]})
        };
        let anthropic = json!({"messages": [{"role": "user", "content": "tell me"}]});
        let anthropic_answer = |stop: &str| json!({"content": [{"type": "text", "text": "Once upon a"}], "stop_reason": stop});
        let gemini = json!({"contents": [{"role": "user", "parts": [{"text": "tell me"}]}]});
        let gemini_answer = |finish: &str| {
            json!({"candidates": [{"content": {"role": "model",
                "parts": [{"text": "Once upon a"}]}, "finishReason": finish}]})
        };
        let responses = json!({"input": "tell me"});
        let output = json!([{"type": "message", "role": "assistant",
            "content": [{"type": "output_text", "text": "Once upon a"}]}]);
        let cases = [
            (
                Route::OpenaiChat,
                &chat,
                chat_answer("length"),
                "finish_reason length",
            ),
            (
                Route::OpenaiChat,
                &chat,
                chat_answer("content_filter"),
                "finish_reason content_filter",
            ),
            (
                Route::AnthropicMessages,
                &anthropic,
                anthropic_answer("max_tokens"),
                "stop_reason max_tokens",
            ),
            (
                Route::AnthropicMessages,
                &anthropic,
                anthropic_answer("refusal"),
                "stop_reason refusal",
            ),
            (
                Route::AnthropicMessages,
                &anthropic,
                anthropic_answer("pause_turn"),
                "stop_reason pause_turn",
            ),
            (
                Route::GeminiGenerate,
                &gemini,
                gemini_answer("MAX_TOKENS"),
                "finishReason MAX_TOKENS",
            ),
            (
                Route::GeminiStream,
                &gemini,
                gemini_answer("SAFETY"),
                "finishReason SAFETY",
            ),
            // Any reason but STOP, those Google added after this list was written too.
            (
                Route::GeminiV1Generate,
                &gemini,
                gemini_answer("MALFORMED_RESPONSE"),
                "finishReason MALFORMED_RESPONSE",
            ),
            (
                Route::GeminiGenerate,
                &gemini,
                gemini_answer("FINISH_REASON_UNSPECIFIED"),
                "finishReason FINISH_REASON_UNSPECIFIED",
            ),
            (
                Route::OpenaiResponses,
                &responses,
                json!({"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"},
                    "output": output}),
                "incomplete: max_output_tokens",
            ),
        ];
        for (route, body, answer, how) in cases {
            let why = example(route, body, &answer).unwrap_err();
            assert_eq!(
                why,
                format!("an answer cut short ({how})"),
                "{}",
                route.name()
            );
        }
        let finished = [
            (Route::OpenaiChat, &chat, chat_answer("stop")),
            (
                Route::OpenaiChat,
                &chat,
                json!({"choices": [{"message": {"role": "assistant", "content": "ok"}}]}),
            ),
            (
                Route::AnthropicMessages,
                &anthropic,
                anthropic_answer("end_turn"),
            ),
            (
                Route::AnthropicMessages,
                &anthropic,
                anthropic_answer("stop_sequence"),
            ),
            (Route::GeminiGenerate, &gemini, gemini_answer("STOP")),
            (
                Route::OpenaiResponses,
                &responses,
                json!({"status": "completed", "output": output}),
            ),
        ];
        for (route, body, answer) in finished {
            let example = example(route, body, &answer).unwrap_or_else(|why| panic!("{why}"));
            let last = example["messages"]
                .as_array()
                .unwrap()
                .last()
                .unwrap()
                .clone();
            assert_eq!(last["role"], "assistant", "{}", route.name());
        }
    }

    /// A tool call whose arguments are not JSON — cut short by the token limit, in the answer or
    /// in a turn resent in the request — cannot be the format's tool call (its `arguments` is a
    /// JSON string), on chat and Responses alike; nor can a chat tool call of another type.
    #[test]
    fn a_tool_call_whose_arguments_are_not_json_is_skipped_ex5() {
        let cut = "{\"city\": \"Pa";
        let chat = json!({"messages": [{"role": "user", "content": "weather?"}]});
        let length = json!({"choices": [{"finish_reason": "length", "message": {"role": "assistant",
            "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "weather", "arguments": cut}}]}}]});
        let why = example(Route::OpenaiChat, &chat, &length).unwrap_err();
        assert!(why.contains("arguments are not JSON"), "{why}");
        let resent = json!({"messages": [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1",
                "type": "function", "function": {"name": "weather", "arguments": cut}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "error"}]});
        let ok = json!({"choices": [{"message": {"role": "assistant", "content": "sorry"}}]});
        let why = example(Route::OpenaiChat, &resent, &ok).unwrap_err();
        assert!(why.contains("arguments are not JSON"), "{why}");
        let custom = json!({"choices": [{"message": {"role": "assistant", "content": null,
            "tool_calls": [{"id": "call_1", "type": "custom",
                "custom": {"name": "shell", "input": "ls"}}]}}]});
        let why = example(Route::OpenaiChat, &chat, &custom).unwrap_err();
        assert!(why.contains("of type custom"), "{why}");

        let incomplete = json!({"status": "incomplete",
            "incomplete_details": {"reason": "max_output_tokens"},
            "output": [{"type": "function_call", "call_id": "call_1", "name": "weather",
                "arguments": cut, "status": "incomplete"}]});
        let why = example(
            Route::OpenaiResponses,
            &json!({"input": "weather?"}),
            &incomplete,
        )
        .unwrap_err();
        assert!(why.contains("arguments are not JSON"), "{why}");
        let body = json!({"input": [{"role": "user", "content": "weather?"},
            {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": cut},
            {"type": "function_call_output", "call_id": "call_1", "output": "error"}]});
        let answer = json!({"output": [{"type": "message", "role": "assistant",
            "content": [{"type": "output_text", "text": "sorry"}]}]});
        let why = example(Route::OpenaiResponses, &body, &answer).unwrap_err();
        assert!(why.contains("arguments are not JSON"), "{why}");
        // Whole arguments still export.
        let whole = json!({"output": [{"type": "function_call", "call_id": "call_1",
            "name": "weather", "arguments": "{\"city\": \"Paris\"}"}]});
        assert!(
            example(
                Route::OpenaiResponses,
                &json!({"input": "weather?"}),
                &whole
            )
            .is_ok()
        );
    }

    /// An answer that is only tool calls reads as those calls, not as a blank, on every
    /// provider: chat's `tool_calls`, Responses' `function_call` items, Messages' `tool_use`
    /// blocks (a cut one's input as the string it got), Gemini's `functionCall` parts; a text
    /// comes first, each call on a line of its own (EX-9, decision 96).
    #[test]
    fn an_answer_that_is_only_tool_calls_reads_as_its_calls_ex9() {
        let chat = json!({"choices": [{"message": {"role": "assistant", "content": null,
            "tool_calls": [
                {"id": "call_1", "type": "function",
                    "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}},
                {"id": "call_2", "type": "function",
                    "function": {"name": "time", "arguments": "{}"}}]}}]});
        assert_eq!(
            openai_text(Route::OpenaiChat, &chat).unwrap(),
            "[tool call] weather({\"city\": \"Paris\"})\n[tool call] time({})"
        );
        let responses = json!({"output": [
            {"type": "reasoning", "summary": []},
            {"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": "Looking."}]},
            {"type": "function_call", "call_id": "call_1", "name": "weather",
                "arguments": "{\"city\":\"Paris\"}"}]});
        assert_eq!(
            openai_text(Route::OpenaiResponses, &responses).unwrap(),
            "Looking.\n[tool call] weather({\"city\":\"Paris\"})"
        );
        let messages = json!({"content": [
            {"type": "thinking", "thinking": "hm", "signature": "s"},
            {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_2", "name": "weather", "input": "{\"city\": \"Pa"}]});
        assert_eq!(
            anthropic_text(&messages).unwrap(),
            "[tool call] weather({\"city\":\"Paris\"})\n[tool call] weather({\"city\": \"Pa)"
        );
        let gemini = json!({"candidates": [{"content": {"role": "model", "parts": [
            {"functionCall": {"name": "weather", "args": {"city": "Paris"}}}]}}]});
        assert_eq!(
            gemini_text(&gemini).unwrap(),
            "[tool call] weather({\"city\":\"Paris\"})"
        );
        // Text alone is as it was.
        let plain = json!({"content": [{"type": "text", "text": "Hi"}]});
        assert_eq!(anthropic_text(&plain).unwrap(), "Hi");
    }

    /// A tool output answering no call before it (a history trimmed between the two) cannot be
    /// in the format, on every route (Anthropic's and Gemini's were exported with a `tool`
    /// message naming no call, decision 169).
    #[test]
    fn a_tool_output_answering_no_earlier_call_is_skipped_ex5() {
        let chat = json!({"messages": [{"role": "user", "content": "weather?"},
            {"role": "tool", "tool_call_id": "call_gone", "content": "sunny"}]});
        let ok = json!({"choices": [{"message": {"role": "assistant", "content": "sunny"}}]});
        let why = example(Route::OpenaiChat, &chat, &ok).unwrap_err();
        assert!(why.contains("answering no earlier tool call"), "{why}");
        let body = json!({"input": [{"role": "user", "content": "weather?"},
            {"type": "function_call_output", "call_id": "call_gone", "output": "sunny"}]});
        let answer = json!({"output": [{"type": "message", "role": "assistant",
            "content": [{"type": "output_text", "text": "sunny"}]}]});
        let why = example(Route::OpenaiResponses, &body, &answer).unwrap_err();
        assert!(why.contains("answering no earlier tool call"), "{why}");

        // Anthropic: a result naming no tool use, and one naming another's id.
        let reply = json!({"content": [{"type": "text", "text": "sunny"}]});
        for (called, answered) in [(None, "zz"), (Some("t1"), "OTHER")] {
            let mut messages = vec![json!({"role": "user", "content": "weather?"})];
            if let Some(id) = called {
                messages.push(json!({"role": "assistant", "content": [{"type": "tool_use",
                    "id": id, "name": "weather", "input": {}}]}));
            }
            messages.push(json!({"role": "user", "content": [{"type": "tool_result",
                "tool_use_id": answered, "content": "sunny"}]}));
            let body = json!({"messages": messages});
            let why = example(Route::AnthropicMessages, &body, &reply).unwrap_err();
            assert!(
                why.contains("answering no earlier tool call"),
                "{answered}: {why}"
            );
        }
        // The same with its call: an example, the result answering it.
        let body = json!({"messages": [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "weather",
                "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                "content": "sunny"}]}]});
        let ok = example(Route::AnthropicMessages, &body, &reply).unwrap();
        assert_eq!(ok["messages"][2]["tool_call_id"], "t1", "{ok}");

        // Gemini: a response with no call before it, and one named after another function.
        let reply = json!({"candidates": [{"content": {"role": "model",
            "parts": [{"text": "sunny"}]}, "finishReason": "STOP"}]});
        for (called, answered) in [(None, "f"), (Some("f"), "g")] {
            let mut contents = vec![json!({"role": "user", "parts": [{"text": "weather?"}]})];
            if let Some(name) = called {
                contents.push(json!({"role": "model",
                    "parts": [{"functionCall": {"name": name, "args": {}}}]}));
            }
            contents.push(json!({"role": "user",
                "parts": [{"functionResponse": {"name": answered, "response": {"r": 1}}}]}));
            let body = json!({"contents": contents});
            let why = example(Route::GeminiGenerate, &body, &reply).unwrap_err();
            assert!(
                why.contains("answering no earlier tool call"),
                "{answered}: {why}"
            );
        }
    }

    /// Decision 87: a stateless Responses request (the Agents SDK's, each turn's whole history in
    /// `input`) is one conversation: `instructions` as the system message, function calls and
    /// their outputs as chat's tool calls and tool messages, reasoning dropped, the answer's
    /// items as one assistant message; function tools flattened into chat's shape.
    #[test]
    fn a_responses_request_with_a_tool_round_becomes_a_chat_example_ex5() {
        let body = json!({"model": "gpt-4o-mini", "instructions": "be brief",
            "input": [
                {"role": "developer", "content": "metric units"},
                {"role": "user", "content": [{"type": "input_text", "text": "weather in"},
                    {"type": "input_text", "text": "Oslo?"}]},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "message", "role": "assistant", "content": [
                    {"type": "output_text", "text": "Checking.", "annotations": []}]},
                {"type": "function_call", "call_id": "call_1", "name": "weather",
                    "arguments": "{\"city\":\"Oslo\"}"},
                {"type": "function_call", "call_id": "call_2", "name": "time",
                    "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "4 C"},
                {"type": "function_call_output", "call_id": "call_2",
                    "output": [{"type": "input_text", "text": "noon"}]}],
            "tools": [{"type": "function", "name": "weather", "description": "w",
                "parameters": {"type": "object"}, "strict": true}]});
        let answer = json!({"object": "response", "status": "completed", "output": [
            {"type": "reasoning", "id": "rs_2", "summary": []},
            {"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": "4 C ", "annotations": []},
                {"type": "output_text", "text": "at noon.", "annotations": []}]},
            {"type": "function_call", "call_id": "call_3", "name": "weather",
                "arguments": "{}"}]});
        let ex = example(Route::OpenaiResponses, &body, &answer).unwrap();
        assert_eq!(
            ex,
            json!({"messages": [
                {"role": "system", "content": "be brief"},
                {"role": "system", "content": "metric units"},
                {"role": "user", "content": "weather in\nOslo?"},
                {"role": "assistant", "content": "Checking.", "tool_calls": [
                    {"id": "call_1", "type": "function",
                        "function": {"name": "weather", "arguments": "{\"city\":\"Oslo\"}"}},
                    {"id": "call_2", "type": "function",
                        "function": {"name": "time", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "4 C"},
                {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
                {"role": "assistant", "content": "4 C at noon.", "tool_calls": [
                    {"id": "call_3", "type": "function",
                        "function": {"name": "weather", "arguments": "{}"}}]}],
                "tools": [{"type": "function", "function": {"name": "weather",
                    "description": "w", "parameters": {"type": "object"}, "strict": true}}]})
        );
        // A string input is one user message; empty instructions are no system message.
        let ex = example(
            Route::OpenaiResponses,
            &json!({"input": "hi", "instructions": ""}),
            &json!({"output": [{"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": "hello"}]}]}),
        )
        .unwrap();
        assert_eq!(
            ex["messages"],
            json!([{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}])
        );
    }

    /// Decision 87: what a Responses example cannot carry skips the request, naming it.
    #[test]
    fn a_responses_request_continuing_a_stored_conversation_or_with_an_image_is_skipped_ex5() {
        let answer = json!({"output": [{"type": "message", "role": "assistant",
            "content": [{"type": "output_text", "text": "ok"}]}]});
        let skip = |body: Value| example(Route::OpenaiResponses, &body, &answer).unwrap_err();
        assert!(
            skip(json!({"input": "and then?", "previous_response_id": "resp_1"}))
                .contains("previous_response_id")
        );
        assert!(skip(json!({"input": "x", "conversation": "conv_1"})).contains("conversation"));
        assert!(skip(json!({"input": "x", "prompt": {"id": "pmpt_1"}})).contains("prompt"));
        assert!(
            skip(json!({"input": [{"role": "user", "content": [
                {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]}))
            .contains("input_image")
        );
        assert!(
            skip(json!({"input": [{"type": "item_reference", "id": "msg_1"}]}))
                .contains("item_reference")
        );
        // An assistant turn of no text and no calls is not a turn the format can hold.
        assert!(
            skip(json!({"input": [{"role": "user", "content": "x"},
                {"role": "assistant", "content": [{"type": "output_text", "text": ""}]},
                {"role": "user", "content": "y"}]}))
            .contains("neither content nor tool calls")
        );
        assert!(
            skip(json!({"input": "x", "tools": [{"type": "web_search"}]})).contains("web_search")
        );
        // An answer with nothing the assistant's turn can hold: reasoning alone (cut by
        // `max_output_tokens`), a message of empty text, no output.
        for output in [
            json!([{"type": "reasoning", "id": "rs_1", "summary": []}]),
            json!([{"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "message", "role": "assistant",
                    "content": [{"type": "output_text", "text": ""}]}]),
            json!([{"type": "message", "role": "assistant", "content": []}]),
            json!([]),
        ] {
            let why = example(
                Route::OpenaiResponses,
                &json!({"input": "x"}),
                &json!({"status": "incomplete", "output": output}),
            )
            .unwrap_err();
            assert!(
                why.contains("without text or tool calls"),
                "{output}: {why}"
            );
        }
        // A function call without a name (the format's tool calls need one).
        let unnamed = json!({"output": [{"type": "function_call", "call_id": "call_1",
            "arguments": "{}"}]});
        assert!(
            example(Route::OpenaiResponses, &json!({"input": "x"}), &unnamed)
                .unwrap_err()
                .contains("name")
        );
        // An answer holding a built-in tool's call.
        let searched = json!({"output": [{"type": "web_search_call", "id": "ws_1"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]}]});
        assert!(
            example(Route::OpenaiResponses, &json!({"input": "x"}), &searched)
                .unwrap_err()
                .contains("web_search_call")
        );
    }
}
