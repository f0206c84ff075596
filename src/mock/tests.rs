//! Black-box tests of the mock over real sockets (reqwest, and raw TCP where the bytes matter).

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::{MockConfig, MockServer, text};

async fn start(config: MockConfig) -> MockServer {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    MockServer::start(listener, config).await.expect("start")
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .expect("client")
}

async fn post(server: &MockServer, route: &str, body: &Value) -> reqwest::Response {
    client()
        .post(format!("{}{route}", server.base_url()))
        .json(body)
        .send()
        .await
        .expect("send")
}

async fn post_json(server: &MockServer, route: &str, body: &Value) -> (u16, Value) {
    let resp = post(server, route, body).await;
    let status = resp.status().as_u16();
    (status, resp.json().await.expect("json body"))
}

/// One parsed SSE event: its `event:` name (if any) and its `data:` text.
#[derive(Debug, Clone, PartialEq)]
struct Event {
    name: Option<String>,
    data: String,
}

fn parse_sse(text: &str) -> Vec<Event> {
    text.split("\n\n")
        .filter(|block| !block.trim().is_empty())
        .map(|block| {
            let mut name = None;
            let mut data = Vec::new();
            for line in block.lines() {
                if let Some(v) = line.strip_prefix("event: ") {
                    name = Some(v.to_owned());
                } else if let Some(v) = line.strip_prefix("data: ") {
                    data.push(v);
                }
            }
            Event {
                name,
                data: data.join("\n"),
            }
        })
        .collect()
}

async fn stream_events(server: &MockServer, route: &str, body: &Value) -> Vec<Event> {
    let resp = post(server, route, body).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()["content-type"],
        "text/event-stream; charset=utf-8"
    );
    parse_sse(&resp.text().await.expect("stream body"))
}

fn data_json(e: &Event) -> Value {
    serde_json::from_str(&e.data).expect("event data is JSON")
}

/// Reads a stream until it ends or breaks: the complete events received and whether it broke.
async fn read_until_break(resp: reqwest::Response) -> (Vec<Event>, bool) {
    let mut buf = Vec::new();
    let mut body = resp.bytes_stream();
    let mut broke = false;
    while let Some(item) = body.next().await {
        match item {
            Ok(bytes) => buf.extend_from_slice(&bytes),
            Err(_) => {
                broke = true;
                break;
            }
        }
    }
    let text = String::from_utf8(buf).expect("utf8");
    // Only blocks terminated by a blank line are complete events.
    let complete = match text.rfind("\n\n") {
        Some(end) => &text[..end + 2],
        None => "",
    };
    (parse_sse(complete), broke)
}

/// Chat stream events in `text` that carry a non-empty `delta.content`.
fn content_chunks(text: &str) -> usize {
    parse_sse(text)
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(&e.data).ok())
        .filter(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .is_some_and(|c| !c.is_empty())
        })
        .count()
}

fn chat_body(content: &str) -> Value {
    json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": content}]})
}

fn with_stream(mut body: Value) -> Value {
    body["stream"] = json!(true);
    body
}

// ---- shapes ----

#[tokio::test]
async fn chat_non_stream_has_openai_shape_and_request_id() {
    let server = start(MockConfig::default()).await;
    let resp = post(&server, "/chat/completions", &chat_body("hi")).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-request-id"], "req_mock_1");
    assert_eq!(resp.headers()["content-type"], "application/json");
    let v: Value = resp.json().await.expect("json");
    assert_eq!(v["id"], "chatcmpl-mock-1");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "gpt-4o-mini");
    assert!(v["created"].is_u64());
    assert_eq!(v["choices"][0]["index"], 0);
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let text = v["choices"][0]["message"]["content"]
        .as_str()
        .expect("text");
    assert!(text.starts_with("mock reply to gpt-4o-mini: "));
    assert_eq!(text.split(' ').count(), 4 + 8);
    let usage = &v["usage"];
    assert_eq!(usage["completion_tokens"], 8);
    assert_eq!(
        usage["total_tokens"].as_u64(),
        Some(usage["prompt_tokens"].as_u64().expect("prompt") + 8)
    );
    server.shutdown().await;
}

#[tokio::test]
async fn chat_stream_concatenates_to_non_stream_text_with_usage_before_done() {
    let server = start(MockConfig::default()).await;
    let (_, plain) = post_json(&server, "/chat/completions", &chat_body("hi")).await;
    let mut body = with_stream(chat_body("hi"));
    body["stream_options"] = json!({"include_usage": true});
    let events = stream_events(&server, "/chat/completions", &body).await;

    assert!(events.iter().all(|e| e.name.is_none()));
    let last = events.last().expect("events");
    assert_eq!(last.data, "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(data_json).collect();
    // role, 8 content, finish, usage
    assert_eq!(chunks.len(), 1 + 8 + 1 + 1);
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk")
    );
    assert!(chunks.iter().all(|c| c["id"] == "chatcmpl-mock-2"));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, plain["choices"][0]["message"]["content"]);
    assert_eq!(chunks[9]["choices"][0]["finish_reason"], "stop");
    let usage_chunk = &chunks[10];
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(usage_chunk["usage"]["completion_tokens"], 8);
    assert_eq!(usage_chunk["usage"], plain["usage"]);
    assert!(chunks[..10].iter().all(|c| c["usage"].is_null()));

    // Without include_usage there is no usage chunk and no usage key.
    let events = stream_events(&server, "/chat/completions", &with_stream(chat_body("hi"))).await;
    assert_eq!(events.len(), 1 + 8 + 1 + 1);
    assert!(data_json(&events[1]).get("usage").is_none());
    server.shutdown().await;
}

#[tokio::test]
async fn completions_non_stream_and_stream_agree() {
    let server = start(MockConfig::default()).await;
    let body = json!({"model": "gpt-3.5-turbo-instruct", "prompt": "Say hi"});
    let (status, v) = post_json(&server, "/completions", &body).await;
    assert_eq!(status, 200);
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["id"], "cmpl-mock-1");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let text = v["choices"][0]["text"].as_str().expect("text").to_owned();

    let events = stream_events(&server, "/completions", &with_stream(body)).await;
    assert_eq!(events.last().map(|e| e.data.as_str()), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(data_json).collect();
    assert_eq!(chunks.len(), 8 + 1);
    assert!(chunks.iter().all(|c| c["object"] == "text_completion"));
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(streamed, text);
    assert_eq!(chunks[8]["choices"][0]["finish_reason"], "stop");
    server.shutdown().await;
}

#[tokio::test]
async fn embeddings_float_and_base64_encode_the_same_vectors() {
    let server = start(MockConfig::default()).await;
    let body = json!({"model": "text-embedding-3-small", "input": ["alpha", "beta"]});
    let (status, v) = post_json(&server, "/embeddings", &body).await;
    assert_eq!(status, 200);
    assert_eq!(v["object"], "list");
    assert_eq!(v["model"], "text-embedding-3-small");
    let data = v["data"].as_array().expect("data");
    assert_eq!(data.len(), 2);
    assert_eq!(data[1]["index"], 1);
    assert_eq!(data[0]["object"], "embedding");
    let first: Vec<f32> = serde_json::from_value(data[0]["embedding"].clone()).expect("floats");
    assert_eq!(first.len(), 8);
    assert_ne!(data[0]["embedding"], data[1]["embedding"]);
    assert!(v["usage"]["prompt_tokens"].is_u64() && v["usage"]["total_tokens"].is_u64());

    // A single string gives the same vector as the same string in an array.
    let (_, single) = post_json(
        &server,
        "/embeddings",
        &json!({"model": "text-embedding-3-small", "input": "alpha"}),
    )
    .await;
    assert_eq!(single["data"][0]["embedding"], data[0]["embedding"]);

    let mut b64 = body.clone();
    b64["encoding_format"] = json!("base64");
    let (_, v) = post_json(&server, "/embeddings", &b64).await;
    assert_eq!(
        v["data"][0]["embedding"].as_str(),
        Some(text::base64_f32_le(&first).as_str())
    );

    let (status, v) = post_json(
        &server,
        "/embeddings",
        &json!({"model": "m", "input": "x", "dimensions": 3}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(v["data"][0]["embedding"].as_array().map(Vec::len), Some(3));

    let (status, v) = post_json(&server, "/embeddings", &json!({"model": "m"})).await;
    assert_eq!(status, 400);
    assert_eq!(v["error"]["type"], "invalid_request_error");
    server.shutdown().await;
}

#[tokio::test]
async fn responses_non_stream_and_stream_follow_the_sdk_types() {
    let server = start(MockConfig::default()).await;
    let body = json!({"model": "gpt-4.1", "input": "Tell me a story"});
    let (status, v) = post_json(&server, "/responses", &body).await;
    assert_eq!(status, 200);
    assert_eq!(v["id"], "resp_mock_1");
    assert_eq!(v["object"], "response");
    assert_eq!(v["status"], "completed");
    assert!(v["created_at"].is_u64());
    for required in [
        "parallel_tool_calls",
        "tool_choice",
        "tools",
        "output",
        "model",
    ] {
        assert!(v.get(required).is_some(), "missing {required}");
    }
    let msg = &v["output"][0];
    assert_eq!(msg["type"], "message");
    assert_eq!(msg["role"], "assistant");
    assert_eq!(msg["status"], "completed");
    assert!(msg["id"].as_str().is_some_and(|id| id.starts_with("msg_")));
    assert_eq!(msg["content"][0]["type"], "output_text");
    assert_eq!(msg["content"][0]["annotations"], json!([]));
    let text = msg["content"][0]["text"].as_str().expect("text").to_owned();
    let usage = &v["usage"];
    assert_eq!(usage["output_tokens"], 8);
    assert!(usage["input_tokens_details"]["cached_tokens"].is_u64());
    assert!(usage["output_tokens_details"]["reasoning_tokens"].is_u64());

    let events = stream_events(&server, "/responses", &with_stream(body)).await;
    let names: Vec<&str> = events.iter().filter_map(|e| e.name.as_deref()).collect();
    let mut want = vec![
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ];
    want.extend(std::iter::repeat_n("response.output_text.delta", 8));
    want.extend([
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]);
    assert_eq!(names, want);
    let datas: Vec<Value> = events.iter().map(data_json).collect();
    for (i, (d, name)) in datas.iter().zip(&names).enumerate() {
        assert_eq!(d["type"], *name);
        assert_eq!(d["sequence_number"], i);
    }
    let streamed: String = datas
        .iter()
        .filter(|d| d["type"] == "response.output_text.delta")
        .filter_map(|d| d["delta"].as_str())
        .collect();
    assert_eq!(streamed, text);
    assert_eq!(datas[0]["response"]["status"], "in_progress");
    let done = &datas[datas.len() - 1]["response"];
    assert_eq!(done["status"], "completed");
    assert_eq!(done["output"][0]["content"][0]["text"], text.as_str());
    assert_eq!(datas[datas.len() - 4]["text"], text.as_str());
    server.shutdown().await;
}

#[tokio::test]
async fn messages_non_stream_and_stream_follow_anthropic_events() {
    let server = start(MockConfig::default()).await;
    let body = json!({"model": "claude-sonnet-4-5", "max_tokens": 64,
        "messages": [{"role": "user", "content": "hello"}]});
    let resp = post(&server, "/messages", &body).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["request-id"], "req_mock_1");
    assert!(resp.headers().get("x-request-id").is_none());
    let v: Value = resp.json().await.expect("json");
    assert_eq!(v["id"], "msg_mock_1");
    assert_eq!(v["type"], "message");
    assert_eq!(v["role"], "assistant");
    assert_eq!(v["model"], "claude-sonnet-4-5");
    assert_eq!(v["stop_reason"], "end_turn");
    assert!(v["stop_sequence"].is_null());
    assert_eq!(v["content"][0]["type"], "text");
    assert_eq!(v["usage"]["output_tokens"], 8);
    assert!(v["usage"]["input_tokens"].is_u64());
    let text = v["content"][0]["text"].as_str().expect("text").to_owned();

    let events = stream_events(&server, "/messages", &with_stream(body)).await;
    let names: Vec<&str> = events.iter().filter_map(|e| e.name.as_deref()).collect();
    let mut want = vec!["message_start", "content_block_start", "ping"];
    want.extend(std::iter::repeat_n("content_block_delta", 8));
    want.extend(["content_block_stop", "message_delta", "message_stop"]);
    assert_eq!(names, want);
    let datas: Vec<Value> = events.iter().map(data_json).collect();
    for (d, name) in datas.iter().zip(&names) {
        assert_eq!(d["type"], *name);
    }
    assert_eq!(datas[0]["message"]["id"], "msg_mock_2");
    assert_eq!(datas[0]["message"]["content"], json!([]));
    let streamed: String = datas
        .iter()
        .filter(|d| d["type"] == "content_block_delta")
        .map(|d| {
            assert_eq!(d["delta"]["type"], "text_delta");
            d["delta"]["text"].as_str().expect("delta text")
        })
        .collect();
    assert_eq!(streamed, text);
    assert_eq!(datas[12]["delta"]["stop_reason"], "end_turn");
    assert_eq!(datas[12]["usage"]["output_tokens"], 8);
    server.shutdown().await;
}

/// Anthropic documents a stream's `message_delta` usage as cumulative, input included, and
/// langchain-anthropic takes a streamed answer's usage from that event alone: without
/// `input_tokens` there, a streamed call through the demo reported 0 input tokens (CLI-3).
#[tokio::test]
async fn a_messages_streams_message_delta_reports_the_whole_usage_as_the_api_does() {
    let server = start(MockConfig::default()).await;
    let body = json!({"model": "claude-sonnet-4-5", "max_tokens": 64,
        "messages": [{"role": "user", "content": "count me"}]});
    let (_, plain) = post_json(&server, "/messages", &body).await;
    let events = stream_events(&server, "/messages", &with_stream(body)).await;
    let delta = events
        .iter()
        .map(data_json)
        .find(|d| d["type"] == "message_delta")
        .expect("a message_delta");
    assert_eq!(delta["usage"], plain["usage"], "{delta}");
    assert!(
        delta["usage"]["input_tokens"].as_u64().unwrap() > 0,
        "{delta}"
    );
    server.shutdown().await;
}

// ---- determinism ----

#[tokio::test]
async fn same_body_gives_same_text_and_different_body_different_text() {
    let server = start(MockConfig::default()).await;
    let text_of = |v: Value| {
        v["choices"][0]["message"]["content"]
            .as_str()
            .map(str::to_owned)
    };
    let (_, a) = post_json(&server, "/chat/completions", &chat_body("one")).await;
    let (_, b) = post_json(&server, "/chat/completions", &chat_body("one")).await;
    let (_, c) = post_json(&server, "/chat/completions", &chat_body("two")).await;
    assert_eq!(text_of(a.clone()), text_of(b));
    assert_ne!(text_of(a), text_of(c));

    // A restarted mock answers the same.
    let other = start(MockConfig::default()).await;
    let (_, d) = post_json(&other, "/chat/completions", &chat_body("one")).await;
    let (_, e) = post_json(&server, "/chat/completions", &chat_body("one")).await;
    assert_eq!(text_of(d), text_of(e));
    other.shutdown().await;
    server.shutdown().await;
}

#[tokio::test]
async fn chunks_setting_controls_the_number_of_pieces() {
    let server = start(MockConfig {
        chunks: 3,
        ..MockConfig::default()
    })
    .await;
    let events = stream_events(&server, "/chat/completions", &with_stream(chat_body("x"))).await;
    assert_eq!(events.len(), 1 + 3 + 1 + 1);
    server.set_config(MockConfig {
        chunks: 0,
        ..MockConfig::default()
    });
    let (_, v) = post_json(&server, "/chat/completions", &chat_body("x")).await;
    assert_eq!(v["choices"][0]["message"]["content"], "");
    server.shutdown().await;
}

// ---- counters and control ----

#[tokio::test]
async fn call_counter_counts_model_calls_only() {
    let server = start(MockConfig::default()).await;
    assert_eq!(server.calls(), 0);
    post(&server, "/chat/completions", &chat_body("a")).await;
    post(&server, "/messages", &json!({"model": "c"})).await;
    post(&server, "/embeddings", &json!({"model": "e", "input": "x"})).await;
    let base = format!("http://{}", server.addr());
    let calls: Value = client()
        .get(format!("{base}/_mock/calls"))
        .send()
        .await
        .expect("calls")
        .json()
        .await
        .expect("json");
    assert_eq!(calls, json!({"calls": 3}));
    // Control and unknown routes are not calls.
    let resp = client()
        .get(format!("{base}/v1/nothing"))
        .send()
        .await
        .expect("404");
    assert_eq!(resp.status(), 404);
    let v: Value = resp.json().await.expect("json");
    assert_eq!(v["error"]["type"], "not_found_error");
    let resp = client()
        .get(format!("{base}/v1/chat/completions"))
        .send()
        .await
        .expect("405");
    assert_eq!(resp.status(), 405);
    assert_eq!(server.calls(), 3);
    server.reset();
    assert_eq!(server.calls(), 0);
    assert!(server.recorded().is_empty());
    let (_, v) = post_json(&server, "/chat/completions", &chat_body("a")).await;
    assert_eq!(v["id"], "chatcmpl-mock-1");
    server.shutdown().await;
}

/// CLI-3: a model call answers any model name, so a lookup of one model does too, in the
/// list's shape (google-genai's `models.get`, openai's `models.retrieve`, anthropic's
/// `models.retrieve`), though the list names only the mock's own models.
#[tokio::test]
async fn a_model_lookup_answers_any_name_in_the_callers_shape() {
    let server = start(MockConfig::default()).await;
    let base = format!("http://{}", server.addr());
    let get = |path: &str, header: Option<(&str, &str)>| {
        let mut req = client().get(format!("{base}{path}"));
        if let Some((name, value)) = header {
            req = req.header(name, value);
        }
        async move {
            let resp = req.send().await.expect("get model");
            assert_eq!(resp.status(), 200);
            resp.json::<Value>().await.expect("json")
        }
    };
    for (path, header) in [
        ("/v1beta/models/gemini-2.0-flash", None),
        ("/v1beta/models/models%2Fgemini-2.0-flash", None),
        ("/v1/models/gemini-2.0-flash", Some(("x-goog-api-key", "k"))),
    ] {
        let m = get(path, header).await;
        assert_eq!(m["name"], "models/gemini-2.0-flash", "{path}: {m}");
        assert!(m["supportedGenerationMethods"].is_array(), "{m}");
    }
    let m = get("/v1/models/ft:gpt-4o-mini-2024-07-18:my-org::abc123", None).await;
    assert_eq!(m["id"], "ft:gpt-4o-mini-2024-07-18:my-org::abc123");
    assert_eq!(m["object"], "model");
    let m = get(
        "/v1/models/claude-sonnet-4-5",
        Some(("anthropic-version", "2023-06-01")),
    )
    .await;
    assert_eq!(m["type"], "model");
    assert_eq!(m["id"], "claude-sonnet-4-5");
    assert_eq!(server.calls(), 0, "not a model call");
    assert_eq!(
        server.other_calls().len(),
        5,
        "recorded with the other calls"
    );
    server.shutdown().await;
}

#[tokio::test]
async fn recorded_calls_keep_path_headers_and_body() {
    let server = start(MockConfig::default()).await;
    client()
        .post(format!("{}/messages?beta=true", server.base_url()))
        .header("x-api-key", "sk-ant-test")
        .header("anthropic-version", "2023-06-01")
        .json(&json!({"model": "claude", "max_tokens": 5}))
        .send()
        .await
        .expect("send");
    client()
        .post(format!("{}/chat/completions", server.base_url()))
        .body("{not json")
        .send()
        .await
        .expect("send");
    let rec = server.recorded();
    assert_eq!(rec.len(), 2);
    assert_eq!(rec[0].n, 1);
    assert_eq!(rec[0].path, "/v1/messages?beta=true");
    assert_eq!(rec[0].body, json!({"model": "claude", "max_tokens": 5}));
    let header = |name: &str| {
        rec[0]
            .headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    assert_eq!(header("x-api-key").as_deref(), Some("sk-ant-test"));
    assert_eq!(header("anthropic-version").as_deref(), Some("2023-06-01"));
    assert_eq!(rec[1].n, 2);
    assert_eq!(rec[1].body, Value::Null);
    server.shutdown().await;
}

#[tokio::test]
async fn recording_keeps_only_the_last_thousand_calls() {
    let server = start(MockConfig {
        chunks: 1,
        ..MockConfig::default()
    })
    .await;
    let c = client();
    let url = format!("{}/embeddings", server.base_url());
    for i in 0..1005 {
        c.post(&url)
            .json(&json!({"model": "e", "input": format!("{i}")}))
            .send()
            .await
            .expect("send");
    }
    let rec = server.recorded();
    assert_eq!(rec.len(), 1000);
    assert_eq!(rec[0].n, 6);
    assert_eq!(rec[999].n, 1005);
    server.shutdown().await;
}

#[tokio::test]
async fn control_api_round_trips_config_calls_recorded_and_reset() {
    let server = start(MockConfig::default()).await;
    let base = format!("http://{}/_mock", server.addr());
    let c = client();

    let got: MockConfig = c
        .get(format!("{base}/config"))
        .send()
        .await
        .expect("get")
        .json()
        .await
        .expect("json");
    assert_eq!(got, MockConfig::default());

    // PUT: a whole config, missing fields default.
    let put = json!({"chunks": 3, "fail_first": 1, "fail_status": 429, "retry_after": "2",
        "stall_after_chunks": [1, 5]});
    let resp = c
        .put(format!("{base}/config"))
        .json(&put)
        .send()
        .await
        .expect("put");
    assert_eq!(resp.status(), 200);
    let want = MockConfig {
        chunks: 3,
        fail_first: 1,
        fail_status: 429,
        retry_after: Some("2".into()),
        stall_after_chunks: Some((1, 5)),
        ..MockConfig::default()
    };
    assert_eq!(resp.json::<MockConfig>().await.expect("json"), want);
    assert_eq!(server.config(), want);
    let got: MockConfig = c
        .get(format!("{base}/config"))
        .send()
        .await
        .expect("get")
        .json()
        .await
        .expect("json");
    assert_eq!(got, want);

    // PATCH keeps the other fields.
    let resp = c
        .patch(format!("{base}/config"))
        .json(&json!({"fail_first": 0}))
        .send()
        .await
        .expect("patch");
    assert_eq!(
        resp.json::<MockConfig>().await.expect("json"),
        MockConfig {
            fail_first: 0,
            ..want.clone()
        }
    );

    // Typos, bad JSON and bad statuses are refused and change nothing.
    for bad in [r#"{"chunk": 3}"#, "{nope", "[1]", r#"{"fail_status": 7}"#] {
        let resp = c
            .put(format!("{base}/config"))
            .body(bad)
            .send()
            .await
            .expect("put");
        assert_eq!(resp.status(), 400, "{bad}");
        let v: Value = resp.json().await.expect("json");
        assert!(v["error"]["message"].is_string());
    }
    assert_eq!(server.config().chunks, 3);

    post(&server, "/chat/completions", &chat_body("a")).await;
    let calls: Value = c
        .get(format!("{base}/calls"))
        .send()
        .await
        .expect("calls")
        .json()
        .await
        .expect("json");
    assert_eq!(calls["calls"], 1);
    let rec: Value = c
        .get(format!("{base}/recorded"))
        .send()
        .await
        .expect("recorded")
        .json()
        .await
        .expect("json");
    assert_eq!(rec[0]["path"], "/v1/chat/completions");
    assert_eq!(rec[0]["n"], 1);
    assert_eq!(rec[0]["body"], chat_body("a"));
    assert!(rec[0]["headers"].as_array().is_some_and(|h| !h.is_empty()));

    let resp = c.post(format!("{base}/reset")).send().await.expect("reset");
    assert_eq!(resp.status(), 200);
    assert_eq!(server.calls(), 0);
    assert!(server.recorded().is_empty());
    assert_eq!(server.config().chunks, 3, "reset keeps the config");
    server.shutdown().await;
}

// ---- faults ----

#[tokio::test]
async fn fail_first_answers_the_status_with_retry_headers_then_recovers() {
    let server = start(MockConfig {
        fail_first: 2,
        fail_status: 429,
        retry_after: Some("3".into()),
        retry_after_ms: Some(1500),
        ..MockConfig::default()
    })
    .await;
    for n in 1..=2 {
        let resp = post(&server, "/chat/completions", &chat_body("a")).await;
        assert_eq!(resp.status(), 429);
        assert_eq!(resp.headers()["retry-after"], "3");
        assert_eq!(resp.headers()["retry-after-ms"], "1500");
        assert_eq!(
            resp.headers()["x-request-id"],
            format!("req_mock_{n}").as_str()
        );
        let v: Value = resp.json().await.expect("json");
        assert_eq!(v["error"]["type"], "rate_limit_error");
        assert!(v["error"]["message"].is_string());
        assert!(v["error"]["param"].is_null() && v["error"]["code"].is_null());
    }
    let resp = post(&server, "/chat/completions", &chat_body("a")).await;
    assert_eq!(resp.status(), 200);
    assert!(resp.headers().get("retry-after").is_none());

    // A new config restarts the window; Anthropic's shape for 529.
    server.set_config(MockConfig {
        fail_first: 1,
        fail_status: 529,
        ..MockConfig::default()
    });
    let resp = post(&server, "/messages", &json!({"model": "claude"})).await;
    assert_eq!(resp.status(), 529);
    assert!(resp.headers().get("retry-after").is_none());
    let v: Value = resp.json().await.expect("json");
    assert_eq!(
        v,
        json!({"type": "error", "error": {"type": "overloaded_error",
            "message": v["error"]["message"]}})
    );
    let (status, _) = post_json(&server, "/messages", &json!({"model": "claude"})).await;
    assert_eq!(status, 200);
    assert_eq!(server.calls(), 5);
    server.shutdown().await;
}

#[tokio::test]
async fn provider_error_types_follow_the_status() {
    for (status, openai, anthropic) in [
        (400, "invalid_request_error", "invalid_request_error"),
        (429, "rate_limit_error", "rate_limit_error"),
        (500, "server_error", "api_error"),
        (503, "server_error", "overloaded_error"),
        (529, "server_error", "overloaded_error"),
    ] {
        assert_eq!(super::openai::error_type(status), openai);
        assert_eq!(super::anthropic::error_type(status), anthropic);
    }
}

#[tokio::test]
async fn malformed_json_gets_400_in_the_provider_shape() {
    let server = start(MockConfig::default()).await;
    let c = client();
    let resp = c
        .post(format!("{}/chat/completions", server.base_url()))
        .body("{\"model\": ")
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 400);
    let v: Value = resp.json().await.expect("json");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    let resp = c
        .post(format!("{}/messages", server.base_url()))
        .body("[1, 2]")
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 400);
    assert_eq!(resp.headers()["request-id"], "req_mock_2");
    let v: Value = resp.json().await.expect("json");
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert_eq!(server.calls(), 2);
    server.shutdown().await;
}

#[tokio::test]
async fn drop_after_chunks_breaks_the_body_after_k_content_chunks() {
    let server = start(MockConfig {
        drop_after_chunks: Some(3),
        drop_first: 1,
        ..MockConfig::default()
    })
    .await;
    let body = with_stream(chat_body("drop me"));
    let resp = post(&server, "/chat/completions", &body).await;
    assert_eq!(resp.status(), 200);
    let (events, broke) = read_until_break(resp).await;
    assert!(broke, "the client must see a body error");
    assert_eq!(events.len(), 1 + 3, "role chunk and 3 content chunks");
    assert!(events.iter().all(|e| e.data != "[DONE]"));

    // drop_first = 1: the next call streams to the end.
    let resp = post(&server, "/chat/completions", &body).await;
    let (events, broke) = read_until_break(resp).await;
    assert!(!broke);
    assert_eq!(events.last().map(|e| e.data.as_str()), Some("[DONE]"));

    // drop_first = 0: every call, every route; K = 0 drops before any content.
    server.set_config(MockConfig {
        drop_after_chunks: Some(0),
        ..MockConfig::default()
    });
    for _ in 0..3 {
        let resp = post(
            &server,
            "/messages",
            &json!({"model": "claude", "stream": true}),
        )
        .await;
        let (events, broke) = read_until_break(resp).await;
        assert!(broke);
        let names: Vec<_> = events.iter().filter_map(|e| e.name.as_deref()).collect();
        assert_eq!(names, ["message_start", "content_block_start", "ping"]);
    }
    // K past the last piece drops after all content, before the tail.
    server.set_config(MockConfig {
        drop_after_chunks: Some(100),
        ..MockConfig::default()
    });
    let resp = post(
        &server,
        "/responses",
        &json!({"model": "m", "input": "x", "stream": true}),
    )
    .await;
    let (events, broke) = read_until_break(resp).await;
    assert!(broke);
    assert_eq!(events.len(), 4 + 8);
    server.shutdown().await;
}

#[tokio::test]
async fn drop_after_chunks_delivers_exactly_k_chunks_every_time() {
    let server = start(MockConfig {
        drop_after_chunks: Some(5),
        ..MockConfig::default()
    })
    .await;
    let body = with_stream(chat_body("again"));
    for _ in 0..30 {
        let resp = post(&server, "/chat/completions", &body).await;
        let (events, broke) = read_until_break(resp).await;
        assert!(broke);
        assert_eq!(events.len(), 1 + 5);
    }
    server.shutdown().await;
}

#[tokio::test]
async fn dropped_stream_has_no_chunked_terminator_on_the_wire() {
    let server = start(MockConfig {
        drop_after_chunks: Some(2),
        ..MockConfig::default()
    })
    .await;
    let raw = raw_exchange(&server, &with_stream(chat_body("wire"))).await;
    let text = String::from_utf8_lossy(&raw);
    assert!(text.starts_with("HTTP/1.1 200"));
    assert!(text.contains("transfer-encoding: chunked"));
    assert!(!text.ends_with("0\r\n\r\n"), "no terminator: {text:?}");
    assert!(!text.contains("[DONE]"));

    server.set_config(MockConfig::default());
    let raw = raw_exchange(&server, &with_stream(chat_body("wire"))).await;
    assert!(String::from_utf8_lossy(&raw).ends_with("0\r\n\r\n"));
    server.shutdown().await;
}

/// Sends one request over a fresh TCP connection that asks to be closed after it, and returns
/// every byte received until EOF (or a reset).
async fn raw_exchange(server: &MockServer, body: &Value) -> Vec<u8> {
    let mut tcp = TcpStream::connect(server.addr()).await.expect("connect");
    let body = body.to_string();
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: mock\r\ncontent-type: application/json\r\n\
         connection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    tcp.write_all(request.as_bytes()).await.expect("write");
    let mut out = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match tcp.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
        }
    }
    out
}

#[tokio::test]
async fn reset_before_headers_closes_the_connection_without_a_status_line() {
    let server = start(MockConfig {
        reset_before_headers: 2,
        ..MockConfig::default()
    })
    .await;
    // Call 1: raw TCP sees the connection end with zero bytes.
    let raw = raw_exchange(&server, &chat_body("reset")).await;
    assert!(raw.is_empty(), "got {:?}", String::from_utf8_lossy(&raw));
    // Call 2: reqwest reports a request error, not a status.
    let err = client()
        .post(format!("{}/chat/completions", server.base_url()))
        .json(&chat_body("reset"))
        .send()
        .await
        .expect_err("the connection must fail");
    assert!(err.status().is_none());
    assert!(!err.is_timeout());
    // Call 3 answers normally; every call was counted and recorded.
    let (status, _) = post_json(&server, "/chat/completions", &chat_body("reset")).await;
    assert_eq!(status, 200);
    assert_eq!(server.calls(), 3);
    assert_eq!(server.recorded().len(), 3);
    server.shutdown().await;
}

#[tokio::test]
async fn header_delay_holds_back_the_response_headers() {
    let server = start(MockConfig {
        header_delay_ms: 150,
        ..MockConfig::default()
    })
    .await;
    let started = Instant::now();
    let resp = post(&server, "/embeddings", &json!({"model": "e", "input": "x"})).await;
    assert_eq!(resp.status(), 200);
    assert!(started.elapsed() >= Duration::from_millis(150));
    server.shutdown().await;
}

#[tokio::test]
async fn hang_before_headers_trips_a_client_timeout_for_the_first_calls_only() {
    let server = start(MockConfig {
        hang_before_headers_ms: Some(5_000),
        hang_first: 1,
        ..MockConfig::default()
    })
    .await;
    let c = reqwest::Client::builder()
        .timeout(Duration::from_millis(200))
        .build()
        .expect("client");
    let url = format!("{}/chat/completions", server.base_url());
    let err = c
        .post(&url)
        .json(&chat_body("h"))
        .send()
        .await
        .expect_err("timeout");
    assert!(err.is_timeout());
    let resp = c.post(&url).json(&chat_body("h")).send().await.expect("ok");
    assert_eq!(resp.status(), 200);
    server.shutdown().await;
}

#[tokio::test]
async fn chunk_delay_and_stall_slow_the_stream_down() {
    let server = start(MockConfig {
        chunks: 4,
        chunk_delay_ms: 30,
        ..MockConfig::default()
    })
    .await;
    let body = with_stream(chat_body("slow"));
    let started = Instant::now();
    let events = stream_events(&server, "/chat/completions", &body).await;
    assert_eq!(events.len(), 1 + 4 + 1 + 1);
    assert!(started.elapsed() >= Duration::from_millis(120));

    server.set_config(MockConfig {
        chunks: 4,
        stall_after_chunks: Some((2, 250)),
        ..MockConfig::default()
    });
    let resp = post(&server, "/chat/completions", &body).await;
    let mut stream = resp.bytes_stream();
    let mut seen = String::new();
    let mut gap_after_two = None;
    let mut last = Instant::now();
    while let Some(bytes) = stream.next().await {
        let bytes = bytes.expect("chunk");
        let now = Instant::now();
        seen.push_str(&String::from_utf8_lossy(&bytes));
        if content_chunks(&seen) == 3 && gap_after_two.is_none() {
            gap_after_two = Some(now - last);
        }
        last = now;
    }
    assert!(seen.ends_with("data: [DONE]\n\n"));
    let gap = gap_after_two.expect("third content chunk seen");
    assert!(gap >= Duration::from_millis(200), "stall gap {gap:?}");
    server.shutdown().await;
}

#[tokio::test]
async fn malformed_sse_puts_garbage_in_the_middle_of_the_stream() {
    let server = start(MockConfig {
        malformed_sse: true,
        ..MockConfig::default()
    })
    .await;
    let resp = post(&server, "/chat/completions", &with_stream(chat_body("g"))).await;
    let text = resp.text().await.expect("body");
    let at = text.find("data: {not json\n").expect("garbage present");
    assert!(text.contains("\nthis line has no colon\n"));
    assert_eq!(
        content_chunks(&text[..at]),
        4,
        "half of the 8 pieces before the garbage"
    );
    assert!(text.ends_with("data: [DONE]\n\n"));
    server.shutdown().await;
}

#[tokio::test]
async fn non_json_200_and_oversized_bytes_shape_non_stream_answers() {
    let server = start(MockConfig {
        non_json_200: true,
        ..MockConfig::default()
    })
    .await;
    let resp = post(&server, "/chat/completions", &chat_body("n")).await;
    assert_eq!(resp.status(), 200);
    assert!(
        resp.headers()["content-type"]
            .to_str()
            .is_ok_and(|ct| ct.starts_with("text/plain"))
    );
    assert_eq!(resp.text().await.expect("body"), "this is not json");
    // Streams ignore it.
    let events = stream_events(&server, "/chat/completions", &with_stream(chat_body("n"))).await;
    assert_eq!(events.last().map(|e| e.data.as_str()), Some("[DONE]"));

    server.set_config(MockConfig {
        oversized_bytes: Some(3 << 20),
        ..MockConfig::default()
    });
    let (status, v) = post_json(&server, "/messages", &json!({"model": "claude"})).await;
    assert_eq!(status, 200);
    let text = v["content"][0]["text"].as_str().expect("text");
    assert!(text.len() >= 3 << 20);
    assert!(text.starts_with("mock reply to claude: "));
    server.shutdown().await;
}

// ---- server lifecycle ----

#[tokio::test]
async fn base_url_points_at_v1_on_loopback() {
    let listener = TcpListener::bind("0.0.0.0:0").await.expect("bind");
    let server = MockServer::start(listener, MockConfig::default())
        .await
        .expect("start");
    let port = server.addr().port();
    assert_eq!(server.base_url(), format!("http://127.0.0.1:{port}/v1"));
    let (status, _) = post_json(&server, "/chat/completions", &chat_body("l")).await;
    assert_eq!(status, 200);
    server.shutdown().await;
}

#[tokio::test]
async fn shutdown_closes_the_listener_and_open_streams() {
    let server = start(MockConfig {
        chunk_delay_ms: 10_000,
        ..MockConfig::default()
    })
    .await;
    let addr = server.addr();
    let resp = post(&server, "/chat/completions", &with_stream(chat_body("s"))).await;
    let reading = tokio::spawn(read_until_break(resp));
    server.shutdown().await;
    let (_, broke) = tokio::time::timeout(Duration::from_secs(5), reading)
        .await
        .expect("stream ends promptly")
        .expect("join");
    assert!(broke);
    assert!(TcpStream::connect(addr).await.is_err());
}

#[tokio::test]
async fn dropping_the_handle_keeps_serving() {
    let server = start(MockConfig::default()).await;
    let url = format!("{}/chat/completions", server.base_url());
    drop(server);
    let resp = client()
        .post(url)
        .json(&chat_body("d"))
        .send()
        .await
        .expect("still serving");
    assert_eq!(resp.status(), 200);
}
