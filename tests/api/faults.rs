//! The fault matrix: each provider fault, the final record, and the number of upstream calls
//! (LC-5..LC-7, LC-10, LC-11, IN-2). docs/reliability.md lists the same rows.

use std::time::{Duration, Instant};

use holdfast::config::Config;
use holdfast::mock::MockConfig;

use crate::helpers::*;

struct Row {
    name: &'static str,
    mock: MockConfig,
    tweak: fn(&mut Config),
    stream: bool,
    status: &'static str,
    error: Option<&'static str>,
    attempts: u64,
    calls: u64,
}

fn none(_: &mut Config) {}

fn rows() -> Vec<Row> {
    vec![
        Row {
            name: "429 twice with retry-after, then 200",
            mock: MockConfig {
                fail_first: 2,
                fail_status: 429,
                retry_after: Some("0.3".into()),
                ..MockConfig::default()
            },
            tweak: |c| c.workers.backoff_max_ms = 5_000,
            stream: false,
            status: "succeeded",
            error: None,
            attempts: 3,
            calls: 3,
        },
        Row {
            name: "503 twice, then 200",
            mock: MockConfig {
                fail_first: 2,
                fail_status: 503,
                ..MockConfig::default()
            },
            tweak: none,
            stream: false,
            status: "succeeded",
            error: None,
            attempts: 3,
            calls: 3,
        },
        Row {
            name: "connection reset before headers",
            mock: MockConfig {
                reset_before_headers: 1,
                ..MockConfig::default()
            },
            tweak: none,
            stream: true,
            status: "succeeded",
            error: None,
            attempts: 2,
            calls: 2,
        },
        Row {
            name: "hang before headers past header_timeout_ms",
            mock: MockConfig {
                hang_before_headers_ms: Some(3_000),
                hang_first: 1,
                ..MockConfig::default()
            },
            tweak: |c| c.upstream.header_timeout_ms = 300,
            stream: false,
            status: "succeeded",
            error: None,
            attempts: 2,
            calls: 2,
        },
        Row {
            name: "drop mid-stream",
            mock: MockConfig {
                chunks: 10,
                drop_after_chunks: Some(3),
                ..MockConfig::default()
            },
            tweak: none,
            stream: true,
            status: "failed",
            error: Some("stream_interrupted"),
            attempts: 1,
            calls: 1,
        },
        Row {
            name: "stall between chunks past idle_timeout_ms",
            mock: MockConfig {
                chunks: 10,
                stall_after_chunks: Some((3, 3_000)),
                ..MockConfig::default()
            },
            tweak: |c| c.upstream.idle_timeout_ms = 300,
            stream: true,
            status: "failed",
            error: Some("stream_interrupted"),
            attempts: 1,
            calls: 1,
        },
        // LC-10: the idle limit is per gap, not a deadline: a stream longer than it whose
        // pieces come more often than it runs to its end.
        Row {
            name: "stream longer than idle_timeout_ms with shorter gaps",
            mock: MockConfig {
                chunks: 8,
                chunk_delay_ms: 100,
                ..MockConfig::default()
            },
            tweak: |c| c.upstream.idle_timeout_ms = 300,
            stream: true,
            status: "succeeded",
            error: None,
            attempts: 1,
            calls: 1,
        },
        Row {
            name: "malformed SSE",
            mock: MockConfig {
                malformed_sse: true,
                ..MockConfig::default()
            },
            tweak: none,
            stream: true,
            status: "failed",
            error: Some("upstream_invalid"),
            attempts: 1,
            calls: 1,
        },
        Row {
            name: "non-JSON 200",
            mock: MockConfig {
                non_json_200: true,
                ..MockConfig::default()
            },
            tweak: none,
            stream: false,
            status: "failed",
            error: Some("upstream_invalid"),
            attempts: 1,
            calls: 1,
        },
        Row {
            name: "oversized response",
            mock: MockConfig {
                oversized_bytes: Some(2_000_000),
                ..MockConfig::default()
            },
            tweak: |c| c.max_response_bytes = 1_000_000,
            stream: false,
            status: "failed",
            error: Some("upstream_invalid"),
            attempts: 1,
            calls: 1,
        },
        Row {
            name: "500 on every call",
            mock: MockConfig {
                fail_first: 1_000,
                fail_status: 500,
                ..MockConfig::default()
            },
            tweak: |c| c.workers.max_attempts = 4,
            stream: false,
            status: "failed",
            error: Some("attempts_exhausted"),
            attempts: 4,
            calls: 4,
        },
        Row {
            name: "400 refusal",
            mock: MockConfig {
                fail_first: 1,
                fail_status: 400,
                ..MockConfig::default()
            },
            tweak: none,
            stream: true,
            status: "failed",
            error: Some("upstream_refused"),
            attempts: 1,
            calls: 1,
        },
    ]
}

#[tokio::test]
async fn every_fault_matrix_row_ends_in_its_documented_record_and_call_count() {
    for row in rows() {
        let app = spawn_app(row.mock.clone(), row.tweak).await;
        let body = if row.stream {
            stream_body(row.name)
        } else {
            chat_body(row.name)
        };
        let started = Instant::now();
        let r = app
            .post("/v1/chat/completions", body, &[("prefer", "respond-async")])
            .await;
        assert_eq!(r.status(), 202, "{}", row.name);
        let id = header(&r, "holdfast-request-id");
        let record = wait_terminal(&app.http, &app.base, &id, Duration::from_secs(30)).await;
        assert_eq!(record["status"], row.status, "{}: {record}", row.name);
        assert_eq!(
            record["error"]["type"].as_str(),
            row.error,
            "{}: {record}",
            row.name
        );
        assert_eq!(
            record["attempts"].as_u64(),
            Some(row.attempts),
            "{}: {record}",
            row.name
        );
        assert_eq!(app.mock.calls(), row.calls, "{}", row.name);
        if row.name.starts_with("429") {
            assert!(
                started.elapsed() >= Duration::from_millis(600),
                "retry-after 0.3 s was honoured twice"
            );
        }
        app.stop().await;
    }
}

/// Where a row's provider answer comes from.
enum Provider {
    /// The mock, with this fault.
    Mock(MockConfig),
    /// A scripted raw HTTP answer, the same for every call.
    Raw(Vec<u8>),
}

/// What the record and the client must show.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Expect {
    /// Events were stored, then the stream ended without its final event (LC-7): `failed` /
    /// `stream_interrupted`, chunks kept, the submitter's stream ends with an error event in
    /// the provider's stream shape.
    Interrupted,
    /// The 2xx answer is not what it claims to be (LC-11): `failed` / `upstream_invalid`, not
    /// retried, a 502 in the provider's error shape with `x-should-retry: false`, and the
    /// provider's answer kept on the record (`kept` is part of its body; `""`: the kept body is
    /// exactly empty), its content type `answered` named in the record's error message
    /// (decision 21).
    Invalid {
        kept: &'static str,
        answered: &'static str,
    },
    /// The provider's own final event ended the stream (`terminal`, e.g. `response.incomplete`):
    /// its answer, stored as `succeeded` and passed on as sent; a re-send is replayed.
    Succeeded { terminal: &'static str },
    /// The provider's 2xx answer says it failed (LC-7a, a Responses object whose `status` is
    /// `failed`): passed on as it came with `x-should-retry: false`, the request `failed` /
    /// `upstream_refused` with the answer kept on the record.
    FailedAnswer,
}

struct AnswerRow {
    name: &'static str,
    provider: Provider,
    path: &'static str,
    stream: bool,
    expect: Expect,
}

/// A body for `path`, streamed or not, unique to `name`.
fn route_body(path: &str, name: &str, stream: bool) -> String {
    let v = match path {
        "/v1/messages" => serde_json::json!({
            "model": "claude-sonnet-4-5", "max_tokens": 64, "stream": stream,
            "messages": [{"role": "user", "content": name}],
        }),
        "/v1/responses" => {
            serde_json::json!({"model": "gpt-4o-mini", "stream": stream, "input": name})
        }
        _ => serde_json::json!({
            "model": "gpt-4o-mini", "stream": stream,
            "messages": [{"role": "user", "content": name}],
        }),
    };
    v.to_string()
}

const TWO_CHAT_EVENTS: &str = "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"Hel\"},\"finish_reason\":null}]}\n\n\
data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo\"},\"finish_reason\":null}]}\n\n";

const CHAT_COMPLETION_JSON: &str = "{\"id\":\"chatcmpl-paid\",\"object\":\"chat.completion\",\"created\":1,\"model\":\"gpt-4o-mini\",\"choices\":[{\"index\":0,\"message\":{\"role\":\"assistant\",\"content\":\"a paid answer\"},\"finish_reason\":\"stop\"}],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":3,\"total_tokens\":6}}";

/// A Responses-API event stream: `response.created`, two text deltas, then the provider's own
/// final event `terminal` (`response.incomplete` or `response.failed`), as OpenAI sends them.
fn responses_events_ending(terminal: &str) -> String {
    let status = terminal.trim_start_matches("response.");
    let detail = match terminal {
        "response.failed" => {
            r#","error":{"code":"server_error","message":"The model failed to finish"}"#
        }
        _ => r#","incomplete_details":{"reason":"max_output_tokens"}"#,
    };
    let event = |name: &str, data: String| format!("event: {name}\ndata: {data}\n\n");
    let delta = |seq: u32, text: &str| {
        event(
            "response.output_text.delta",
            format!(
                r#"{{"type":"response.output_text.delta","sequence_number":{seq},"item_id":"msg_raw","output_index":0,"content_index":0,"delta":"{text}"}}"#
            ),
        )
    };
    [
        event(
            "response.created",
            r#"{"type":"response.created","sequence_number":0,"response":{"id":"resp_raw_1","object":"response","status":"in_progress","output":[]}}"#.into(),
        ),
        delta(1, "Hel"),
        delta(2, "lo"),
        event(
            terminal,
            format!(
                r#"{{"type":"{terminal}","sequence_number":3,"response":{{"id":"resp_raw_1","object":"response","status":"{status}","output":[]{detail}}}}}"#
            ),
        ),
    ]
    .concat()
}

const HTML_PAGE: &str =
    "<html><head><title>502 Bad Gateway</title></head><body>upstream gone</body></html>\n";

fn answer_rows() -> Vec<AnswerRow> {
    use Expect::*;
    let chat = "/v1/chat/completions";
    vec![
        AnswerRow {
            name: "chat stream: content events, then a clean chunked end without [DONE]",
            provider: Provider::Mock(MockConfig {
                chunks: 8,
                end_after_chunks: Some(3),
                ..MockConfig::default()
            }),
            path: chat,
            stream: true,
            expect: Interrupted,
        },
        AnswerRow {
            name: "chat stream: finish_reason on the last chunk, then a clean end without [DONE]",
            provider: Provider::Mock(MockConfig {
                omit_stream_end: true,
                ..MockConfig::default()
            }),
            path: chat,
            stream: true,
            expect: Interrupted,
        },
        AnswerRow {
            name: "chat stream: a close-delimited body the provider closes after two events",
            provider: Provider::Raw(raw_200("text/event-stream", TWO_CHAT_EVENTS, true)),
            path: chat,
            stream: true,
            expect: Interrupted,
        },
        AnswerRow {
            name: "messages stream without message_stop",
            provider: Provider::Mock(MockConfig {
                omit_stream_end: true,
                ..MockConfig::default()
            }),
            path: "/v1/messages",
            stream: true,
            expect: Interrupted,
        },
        AnswerRow {
            name: "messages stream: a clean end after three content events",
            provider: Provider::Mock(MockConfig {
                end_after_chunks: Some(3),
                ..MockConfig::default()
            }),
            path: "/v1/messages",
            stream: true,
            expect: Interrupted,
        },
        AnswerRow {
            name: "responses stream without a terminal response.* event",
            provider: Provider::Mock(MockConfig {
                omit_stream_end: true,
                ..MockConfig::default()
            }),
            path: "/v1/responses",
            stream: true,
            expect: Interrupted,
        },
        AnswerRow {
            name: "stream request answered 200 text/html",
            provider: Provider::Raw(raw_200("text/html; charset=utf-8", HTML_PAGE, false)),
            path: chat,
            stream: true,
            expect: Invalid {
                kept: "502 Bad Gateway",
                answered: "text/html; charset=utf-8",
            },
        },
        AnswerRow {
            name: "stream request answered an HTML page labelled text/event-stream",
            provider: Provider::Raw(raw_200("text/event-stream", HTML_PAGE, false)),
            path: chat,
            stream: true,
            expect: Invalid {
                kept: "upstream gone",
                answered: "text/event-stream",
            },
        },
        AnswerRow {
            name: "stream request answered an empty event stream",
            provider: Provider::Raw(raw_200("text/event-stream", "", false)),
            path: chat,
            stream: true,
            expect: Invalid {
                kept: "",
                answered: "text/event-stream",
            },
        },
        AnswerRow {
            name: "stream request answered lines that hold no event",
            provider: Provider::Raw(raw_200(
                "text/event-stream",
                ": keep-alive\n\nevent: ping\n\nretry: 100\n\n",
                false,
            )),
            path: chat,
            stream: true,
            expect: Invalid {
                kept: "keep-alive",
                answered: "text/event-stream",
            },
        },
        AnswerRow {
            name: "stream request answered a complete JSON completion",
            provider: Provider::Mock(MockConfig {
                ignore_stream: true,
                ..MockConfig::default()
            }),
            path: chat,
            stream: true,
            expect: Invalid {
                kept: "chat.completion",
                answered: "application/json",
            },
        },
        AnswerRow {
            name: "stream request answered a JSON completion with a trailing newline",
            provider: Provider::Raw(raw_200(
                "application/json",
                &format!("{CHAT_COMPLETION_JSON}\n"),
                false,
            )),
            path: chat,
            stream: true,
            expect: Invalid {
                kept: "a paid answer",
                answered: "application/json",
            },
        },
        AnswerRow {
            name: "stream request answered a JSON completion labelled text/event-stream",
            provider: Provider::Raw(raw_200(
                "text/event-stream",
                &format!("{CHAT_COMPLETION_JSON}\n"),
                false,
            )),
            path: chat,
            stream: true,
            expect: Invalid {
                kept: "a paid answer",
                answered: "text/event-stream",
            },
        },
        AnswerRow {
            name: "messages stream answered a complete JSON message",
            provider: Provider::Mock(MockConfig {
                ignore_stream: true,
                ..MockConfig::default()
            }),
            path: "/v1/messages",
            stream: true,
            expect: Invalid {
                kept: "message",
                answered: "application/json",
            },
        },
        AnswerRow {
            name: "responses stream: content events, then the provider's response.incomplete",
            provider: Provider::Raw(raw_200(
                "text/event-stream",
                &responses_events_ending("response.incomplete"),
                false,
            )),
            path: "/v1/responses",
            stream: true,
            expect: Succeeded {
                terminal: "response.incomplete",
            },
        },
        AnswerRow {
            // Reading stops at the final event (LC-7): what follows it in the same read neither
            // fails nor re-runs (a second bill for) an answer the provider completed.
            name: "responses stream: the final event, then an error event in the same read",
            provider: Provider::Raw(raw_200(
                "text/event-stream",
                &(responses_events_ending("response.incomplete")
                    + "event: error\ndata: {\"type\":\"error\",\"code\":\"server_error\",\"message\":\"late\",\"sequence_number\":4}\n\n"),
                false,
            )),
            path: "/v1/responses",
            stream: true,
            expect: Succeeded {
                terminal: "response.incomplete",
            },
        },
        AnswerRow {
            name: "responses stream: content events, then the provider's response.failed (LC-7a)",
            provider: Provider::Raw(raw_200(
                "text/event-stream",
                &responses_events_ending("response.failed"),
                false,
            )),
            path: "/v1/responses",
            stream: true,
            expect: Interrupted,
        },
        AnswerRow {
            name: "non-stream responses 200 whose status is failed (LC-7a)",
            provider: Provider::Raw(raw_200(
                "application/json",
                r#"{"id":"resp_failed_1","object":"response","status":"failed","output":[],"error":{"code":"server_error","message":"The model failed to finish"}}"#,
                false,
            )),
            path: "/v1/responses",
            stream: false,
            expect: FailedAnswer,
        },
        AnswerRow {
            name: "non-stream 200 whose body is an error object",
            provider: Provider::Raw(raw_200(
                "application/json",
                "{\"error\":{\"message\":\"The server is overloaded\",\"type\":\"server_error\",\"param\":null,\"code\":null}}",
                false,
            )),
            path: chat,
            stream: false,
            expect: Invalid {
                kept: "The server is overloaded",
                answered: "application/json",
            },
        },
        AnswerRow {
            name: "non-stream 200 whose body is an object without choices (decision 39)",
            provider: Provider::Raw(raw_200(
                "application/json",
                "{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion\"}",
                false,
            )),
            path: chat,
            stream: false,
            expect: Invalid {
                kept: "chatcmpl-1",
                answered: "application/json",
            },
        },
        AnswerRow {
            name: "non-stream 200 whose choices are empty (decision 143)",
            provider: Provider::Raw(raw_200(
                "application/json",
                "{\"id\":\"chatcmpl-empty\",\"object\":\"chat.completion\",\"choices\":[],\"usage\":{\"prompt_tokens\":4,\"completion_tokens\":0}}",
                false,
            )),
            path: chat,
            stream: false,
            expect: Invalid {
                kept: "chatcmpl-empty",
                answered: "application/json",
            },
        },
        AnswerRow {
            name: "stream request answered [DONE] and nothing before it (decision 39)",
            provider: Provider::Raw(raw_200("text/event-stream", "data: [DONE]\n\n", false)),
            path: chat,
            stream: true,
            expect: Invalid {
                kept: "[DONE]",
                answered: "text/event-stream",
            },
        },
        AnswerRow {
            name: "chat stream of events without choices, then [DONE] (decision 42)",
            provider: Provider::Raw(raw_200(
                "text/event-stream",
                "data: {\"id\":\"chatcmpl-nochoices\",\"object\":\"chat.completion.chunk\"}\n\ndata: [DONE]\n\n",
                false,
            )),
            path: chat,
            stream: true,
            expect: Invalid {
                kept: "chatcmpl-nochoices",
                answered: "text/event-stream",
            },
        },
        AnswerRow {
            name: "messages stream whose content comes before any message_start (decision 44)",
            provider: Provider::Raw(raw_200(
                "text/event-stream",
                "event: ping\ndata: {\"type\":\"ping\"}\n\n\
                 event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"no-start\"}}\n\n\
                 event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
                false,
            )),
            path: "/v1/messages",
            stream: true,
            expect: Invalid {
                kept: "no-start",
                answered: "text/event-stream",
            },
        },
        AnswerRow {
            name: "messages stream with a second message_start (decision 44)",
            provider: Provider::Raw(raw_200(
                "text/event-stream",
                "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_first\"}}\n\n\
                 event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"a\"}}\n\n\
                 event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_second\"}}\n\n\
                 event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
                false,
            )),
            path: "/v1/messages",
            stream: true,
            expect: Invalid {
                kept: "msg_second",
                answered: "text/event-stream",
            },
        },
        AnswerRow {
            name: "non-stream 200 whose body is a JSON array",
            provider: Provider::Raw(raw_200("application/json", "[1,2,3]", false)),
            path: chat,
            stream: false,
            expect: Invalid {
                kept: "[1,2,3]",
                answered: "application/json",
            },
        },
    ]
}

/// The provider calls a row's answer has taken so far.
fn calls_of(
    provider: &Provider,
    mock: &holdfast::mock::MockServer,
    raw: Option<&RawProvider>,
) -> u64 {
    match provider {
        Provider::Mock(_) => mock.calls(),
        Provider::Raw(_) => raw.map_or(0, RawProvider::calls),
    }
}

/// LC-7, LC-11, RS-6, RS-7, ID-6a: an answer is stored as succeeded only when the provider
/// really finished it. Each row: the record, the client's view, one upstream call, and a
/// re-send of the same body that gets the failure again, with no second call.
#[tokio::test]
async fn truncated_and_invalid_provider_answers_are_failed_not_stored_as_success_lc7_lc11() {
    for row in answer_rows() {
        let (mock_config, raw) = match &row.provider {
            Provider::Mock(c) => (c.clone(), None),
            Provider::Raw(bytes) => (
                MockConfig::default(),
                Some(RawProvider::start(bytes.clone()).await),
            ),
        };
        let raw_url = raw.as_ref().map(RawProvider::base_url);
        let app = spawn_app(mock_config, move |c| {
            if let Some(url) = &raw_url {
                use_backend_url(c, url);
            }
        })
        .await;
        let body = route_body(row.path, row.name, row.stream);
        let anthropic = row.path == "/v1/messages";
        let r = app.post(row.path, body.clone(), &[]).await;
        let id = header(&r, "holdfast-request-id");
        match row.expect {
            Expect::Interrupted => {
                assert_eq!(r.status(), 200, "{}", row.name);
                let (text, events) = read_events(r).await;
                let last = events
                    .last()
                    .unwrap_or_else(|| panic!("{}: no events", row.name));
                if anthropic {
                    assert_eq!(last.event.as_deref(), Some("error"), "{}: {text}", row.name);
                } else {
                    let data: serde_json::Value = serde_json::from_str(&last.data).unwrap();
                    assert_eq!(
                        data["error"]["code"], "stream_interrupted",
                        "{}: {text}",
                        row.name
                    );
                }
                assert!(
                    events.iter().all(|e| e.data != "[DONE]"),
                    "{}: {text}",
                    row.name
                );
                assert!(
                    events.len() >= 2,
                    "{}: the stored events came first: {text}",
                    row.name
                );
            }
            Expect::Succeeded { terminal } => {
                assert_eq!(r.status(), 200, "{}", row.name);
                let (text, events) = read_events(r).await;
                assert_eq!(
                    events.len(),
                    4,
                    "{}: every event passed on: {text}",
                    row.name
                );
                let last = events.last().unwrap();
                assert_eq!(
                    last.event.as_deref(),
                    Some(terminal),
                    "{}: {text}",
                    row.name
                );
                let data: serde_json::Value = serde_json::from_str(&last.data).unwrap();
                assert_eq!(data["type"], terminal, "{}: {text}", row.name);
            }
            Expect::FailedAnswer => {
                assert_eq!(r.status(), 200, "{}", row.name);
                assert_eq!(header(&r, "x-should-retry"), "false", "{}", row.name);
                let answer: serde_json::Value = r.json().await.expect("the provider's answer");
                assert_eq!(answer["status"], "failed", "{}: {answer}", row.name);
                assert_eq!(
                    answer["error"]["code"], "server_error",
                    "{}: {answer}",
                    row.name
                );
            }
            Expect::Invalid { .. } => {
                assert_eq!(r.status(), 502, "{}", row.name);
                assert_eq!(header(&r, "x-should-retry"), "false", "{}", row.name);
                assert_eq!(
                    header(&r, "holdfast-error"),
                    "upstream_invalid",
                    "{}",
                    row.name
                );
                let error: serde_json::Value = r.json().await.expect("error JSON");
                if anthropic {
                    assert_eq!(error["type"], "error", "{}: {error}", row.name);
                    assert!(
                        error["error"]["message"].is_string(),
                        "{}: {error}",
                        row.name
                    );
                } else {
                    assert_eq!(
                        error["error"]["code"], "upstream_invalid",
                        "{}: {error}",
                        row.name
                    );
                }
            }
        }
        let record = wait_terminal(&app.http, &app.base, &id, Duration::from_secs(30)).await;
        let status = match row.expect {
            Expect::Succeeded { .. } => "succeeded",
            _ => "failed",
        };
        assert_eq!(record["status"], status, "{}: {record}", row.name);
        assert_eq!(record["attempts"], 1, "{}: {record}", row.name);
        match row.expect {
            Expect::Succeeded { .. } => {
                assert_eq!(
                    record["error"],
                    serde_json::Value::Null,
                    "{}: {record}",
                    row.name
                );
                assert!(
                    record["last_seq"].as_i64() >= Some(4),
                    "{}: every event kept: {record}",
                    row.name
                );
            }
            Expect::Interrupted => {
                assert_eq!(
                    record["error"]["type"], "stream_interrupted",
                    "{}: {record}",
                    row.name
                );
                assert!(
                    record["last_seq"].as_i64() > Some(2),
                    "chunks kept: {record}"
                );
            }
            Expect::FailedAnswer => {
                assert_eq!(
                    record["error"]["type"], "upstream_refused",
                    "{}: {record}",
                    row.name
                );
                assert_eq!(record["response"]["status"], 200, "{}: {record}", row.name);
                assert!(
                    record["response"]["body"]
                        .to_string()
                        .contains("server_error"),
                    "{}: the answer is kept: {record}",
                    row.name
                );
            }
            Expect::Invalid { kept, answered } => {
                assert_eq!(
                    record["error"]["type"], "upstream_invalid",
                    "{}: {record}",
                    row.name
                );
                let message = record["error"]["message"].as_str().unwrap();
                assert!(
                    message.contains(&format!("content-type {answered:?}")),
                    "{}: the error names what came back, {answered:?}: {record}",
                    row.name
                );
                assert_eq!(record["response"]["status"], 200, "{}: {record}", row.name);
                if kept.is_empty() {
                    assert_eq!(
                        record["response"]["body"], "",
                        "{}: the kept body is empty: {record}",
                        row.name
                    );
                } else {
                    let shown = record["response"]["body"].to_string();
                    assert!(
                        shown.contains(kept),
                        "{}: the record keeps {kept:?}: {record}",
                        row.name
                    );
                }
            }
        }
        assert_eq!(
            calls_of(&row.provider, &app.mock, raw.as_ref()),
            1,
            "{}",
            row.name
        );
        let again = app.post(row.path, body, &[]).await;
        let second = header(&again, "holdfast-request-id");
        if let Expect::Succeeded { terminal } = row.expect {
            // ID-4: a stored answer; the same body again is replayed, no new call.
            assert_eq!(second, id, "{}: a re-send is the same request", row.name);
            assert_eq!(
                header(&again, "idempotent-replayed"),
                "true",
                "{}",
                row.name
            );
            let (text, events) = read_events(again).await;
            assert_eq!(
                events.last().and_then(|e| e.event.as_deref()),
                Some(terminal),
                "{}: the replay ends as the provider did: {text}",
                row.name
            );
            assert_eq!(
                calls_of(&row.provider, &app.mock, raw.as_ref()),
                1,
                "{}",
                row.name
            );
            app.stop().await;
            continue;
        }
        // ID-6a: the failure releases the claim a minute later; until then the same body
        // again is the failed request, answered its failure without a provider call.
        let replayed = header(&again, "idempotent-replayed");
        let _ = again.bytes().await;
        assert_eq!(second, id, "{}: a re-send is the failed request", row.name);
        assert_eq!(replayed, "true", "{}", row.name);
        assert_eq!(
            calls_of(&row.provider, &app.mock, raw.as_ref()),
            1,
            "{}",
            row.name
        );
        app.stop().await;
    }
}

/// One Gemini fault: what the provider does, and what the record and the client show.
struct GeminiRow {
    name: &'static str,
    provider: Provider,
    stream: bool,
    tweak: fn(&mut Config),
    /// The client's status (200 for a stream that started).
    answered: u16,
    status: &'static str,
    error: Option<&'static str>,
    attempts: u64,
    calls: u64,
}

const GEMINI_ERROR_CHUNK: &str = "data: {\"error\":{\"code\":503,\"message\":\"overloaded\",\"status\":\"UNAVAILABLE\"}}\r\n\r\n";

fn gemini_rows() -> Vec<GeminiRow> {
    let html = raw_200("text/html; charset=utf-8", HTML_PAGE, false);
    vec![
        GeminiRow {
            name: "gemini stream: the body ends cleanly without a finishReason chunk",
            provider: Provider::Mock(MockConfig {
                omit_stream_end: true,
                ..MockConfig::default()
            }),
            stream: true,
            tweak: none,
            answered: 200,
            status: "failed",
            error: Some("stream_interrupted"),
            attempts: 1,
            calls: 1,
        },
        GeminiRow {
            name: "gemini stream: TCP reset mid-stream",
            provider: Provider::Mock(MockConfig {
                chunks: 10,
                drop_after_chunks: Some(3),
                ..MockConfig::default()
            }),
            stream: true,
            tweak: none,
            answered: 200,
            status: "failed",
            error: Some("stream_interrupted"),
            attempts: 1,
            calls: 1,
        },
        GeminiRow {
            name: "gemini stream: connection reset before headers, then the stream",
            provider: Provider::Mock(MockConfig {
                reset_before_headers: 1,
                ..MockConfig::default()
            }),
            stream: true,
            tweak: none,
            answered: 200,
            status: "succeeded",
            error: None,
            attempts: 2,
            calls: 2,
        },
        GeminiRow {
            name: "gemini: 200 text/html",
            provider: Provider::Raw(html.clone()),
            stream: false,
            tweak: none,
            answered: 502,
            status: "failed",
            error: Some("upstream_invalid"),
            attempts: 1,
            calls: 1,
        },
        GeminiRow {
            name: "gemini stream: 200 text/html",
            provider: Provider::Raw(html),
            stream: true,
            tweak: none,
            answered: 502,
            status: "failed",
            error: Some("upstream_invalid"),
            attempts: 1,
            calls: 1,
        },
        GeminiRow {
            name: "gemini: a JSON error inside a 200",
            provider: Provider::Raw(raw_200(
                "application/json",
                r#"{"error":{"code":500,"message":"internal","status":"INTERNAL"}}"#,
                false,
            )),
            stream: false,
            tweak: none,
            answered: 502,
            status: "failed",
            error: Some("upstream_invalid"),
            attempts: 1,
            calls: 1,
        },
        GeminiRow {
            name: "gemini stream: an error chunk in a 200 before any answer, every time",
            provider: Provider::Raw(raw_200("text/event-stream", GEMINI_ERROR_CHUNK, false)),
            stream: true,
            tweak: |c| c.workers.max_attempts = 2,
            answered: 502,
            status: "failed",
            error: Some("attempts_exhausted"),
            attempts: 2,
            calls: 2,
        },
        GeminiRow {
            name: "gemini: 429 with retry-after, then 200",
            provider: Provider::Mock(MockConfig {
                fail_first: 1,
                fail_status: 429,
                retry_after: Some("0.3".into()),
                ..MockConfig::default()
            }),
            stream: false,
            tweak: |c| c.workers.backoff_max_ms = 5_000,
            answered: 200,
            status: "succeeded",
            error: None,
            attempts: 2,
            calls: 2,
        },
        GeminiRow {
            name: "gemini: 400 with Google's error body",
            provider: Provider::Mock(MockConfig {
                fail_first: 1,
                fail_status: 400,
                ..MockConfig::default()
            }),
            stream: true,
            tweak: none,
            answered: 400,
            status: "failed",
            error: Some("upstream_refused"),
            attempts: 1,
            calls: 1,
        },
        GeminiRow {
            name: "gemini: a blocked prompt (promptFeedback, no candidates)",
            provider: Provider::Raw(raw_200(
                "application/json",
                r#"{"promptFeedback":{"blockReason":"SAFETY"},"usageMetadata":{"promptTokenCount":4,"totalTokenCount":4}}"#,
                false,
            )),
            stream: false,
            tweak: none,
            answered: 200,
            status: "succeeded",
            error: None,
            attempts: 1,
            calls: 1,
        },
        GeminiRow {
            name: "gemini stream: a blocked prompt (promptFeedback, no candidates)",
            provider: Provider::Raw(raw_200(
                "text/event-stream",
                "data: {\"promptFeedback\":{\"blockReason\":\"SAFETY\"},\"usageMetadata\":{\"promptTokenCount\":4}}\r\n\r\n",
                false,
            )),
            stream: true,
            tweak: none,
            answered: 200,
            status: "succeeded",
            error: None,
            attempts: 1,
            calls: 1,
        },
        GeminiRow {
            // Decision 90: Gemini 2.5 answers some prompts so; google-genai returns it as a
            // response without text, and the prompt's tokens are billed.
            name: "gemini: nothing generated (usageMetadata alone, no candidates or feedback)",
            provider: Provider::Raw(raw_200(
                "application/json",
                r#"{"usageMetadata":{"promptTokenCount":9291,"totalTokenCount":9291},"modelVersion":"gemini-2.5-pro","responseId":"r1"}"#,
                false,
            )),
            stream: false,
            tweak: none,
            answered: 200,
            status: "succeeded",
            error: None,
            attempts: 1,
            calls: 1,
        },
    ]
}

/// GM-3, GM-5, LC-5..LC-7, LC-11: the fault matrix's Gemini rows. Each row: the client's
/// status and error shape, the final record, and the number of provider calls.
#[tokio::test]
async fn every_gemini_fault_matrix_row_ends_in_its_documented_record_and_call_count_gm3() {
    for row in gemini_rows() {
        let (mock_config, raw) = match &row.provider {
            Provider::Mock(c) => (c.clone(), None),
            Provider::Raw(bytes) => (
                MockConfig::default(),
                Some(RawProvider::start(bytes.clone()).await),
            ),
        };
        let raw_url = raw.as_ref().map(RawProvider::base_url);
        let tweak = row.tweak;
        let app = spawn_app(mock_config, move |c| {
            tweak(c);
            if let Some(url) = &raw_url {
                use_backend_url(c, url);
            }
        })
        .await;
        let path = if row.stream {
            "/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse"
        } else {
            "/v1beta/models/gemini-2.5-flash:generateContent"
        };
        let started = Instant::now();
        let r = app.post(path, gemini_body(row.name), &[]).await;
        assert_eq!(r.status(), row.answered, "{}", row.name);
        let id = header(&r, "holdfast-request-id");
        let text = r.text().await.unwrap();
        match (row.answered, row.stream, row.error) {
            (200, true, Some(cause)) => {
                // A failure after the first chunk: Google's error object closes the stream.
                let last = text.trim_end().rsplit("\n\n").next().unwrap_or_default();
                assert!(
                    last.starts_with(r#"data: {"error":"#),
                    "{}: {text}",
                    row.name
                );
                assert!(last.contains(cause), "{}: {text}", row.name);
            }
            (200, _, None) => {}
            (_, _, Some(cause)) if cause != "upstream_refused" => {
                let error: serde_json::Value = serde_json::from_str(&text).unwrap();
                assert_eq!(error["error"]["code"], row.answered, "{}: {text}", row.name);
                assert_eq!(
                    error["error"]["details"][0]["reason"], cause,
                    "{}: {text}",
                    row.name
                );
            }
            _ => {
                // The provider's refusal, replayed as it came.
                let error: serde_json::Value = serde_json::from_str(&text).unwrap();
                assert_eq!(
                    error["error"]["status"], "INVALID_ARGUMENT",
                    "{}: {text}",
                    row.name
                );
            }
        }
        let record = wait_terminal(&app.http, &app.base, &id, Duration::from_secs(30)).await;
        assert_eq!(record["status"], row.status, "{}: {record}", row.name);
        assert_eq!(
            record["error"]["type"].as_str(),
            row.error,
            "{}: {record}",
            row.name
        );
        assert_eq!(
            record["attempts"].as_u64(),
            Some(row.attempts),
            "{}: {record}",
            row.name
        );
        assert_eq!(
            calls_of(&row.provider, &app.mock, raw.as_ref()),
            row.calls,
            "{}",
            row.name
        );
        if row.name.contains("blocked") {
            assert!(
                text.contains("SAFETY"),
                "{}: the answer is passed on: {text}",
                row.name
            );
            assert_eq!(record["usage"]["input_tokens"], 4, "{}: {record}", row.name);
        }
        if row.name.contains("retry-after") {
            assert!(
                started.elapsed() >= Duration::from_millis(300),
                "retry-after honoured"
            );
        }
        app.stop().await;
    }
}

/// A Messages provider at `body` (a 200 of `content_type`) answers one call of `stream`; the
/// record it ends in, after checking that the client was not handed it as an answer: a 502
/// `upstream_invalid` in Anthropic's shape, or, once events went out, a stream closed by an
/// `error` event. A re-send of the same body within the minute is the failed request (ID-6a).
async fn messages_answer_not_stored_as_success(
    content_type: &str,
    body: &str,
    stream: bool,
) -> serde_json::Value {
    let provider = RawProvider::start(raw_200(content_type, body, false)).await;
    let url = provider.base_url();
    let app = spawn_app(MockConfig::default(), move |c| use_backend_url(c, &url)).await;
    let sent = route_body("/v1/messages", "not a message", stream);
    let r = app.post("/v1/messages", sent.clone(), &[]).await;
    let id = header(&r, "holdfast-request-id");
    if r.status() == 200 {
        assert!(stream, "a non-stream answer is held until it is judged");
        let (text, events) = read_events(r).await;
        let last = events.last().expect("events");
        assert_eq!(last.event.as_deref(), Some("error"), "{text}");
    } else {
        assert_eq!(r.status(), 502);
        assert_eq!(header(&r, "holdfast-error"), "upstream_invalid");
        assert_eq!(header(&r, "x-should-retry"), "false");
        let error: serde_json::Value = r.json().await.expect("error JSON");
        assert_eq!(error["type"], "error", "{error}");
    }
    let record = wait_terminal(&app.http, &app.base, &id, Duration::from_secs(10)).await;
    assert_eq!(record["status"], "failed", "{record}");
    assert_eq!(record["error"]["type"], "upstream_invalid", "{record}");
    let again = app.post("/v1/messages", sent, &[]).await;
    assert_eq!(
        header(&again, "holdfast-request-id"),
        id,
        "the failed request"
    );
    let _ = again.bytes().await;
    assert_eq!(provider.calls(), 1);
    app.stop().await;
    record
}

/// LC-11: the Messages API answers `content` as an array of content blocks, always; a 200
/// whose `content` is a string (a gateway's own shape) was stored as succeeded and replayed
/// for the claim window, though no SDK reads it as the message it claims to be. It fails
/// `upstream_invalid`, as a chat answer without `choices` does, with what came back kept.
#[tokio::test]
async fn a_messages_answer_whose_content_is_not_an_array_of_blocks_is_upstream_invalid_and_keeps_its_usage_lc11_rd9()
 {
    let body = r#"{"id":"msg_str","type":"message","role":"assistant","content":"Hello!","model":"claude-sonnet-4-5","stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":9,"output_tokens":3}}"#;
    let record = messages_answer_not_stored_as_success("application/json", body, false).await;
    let message = record["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("whose `content` is a string"),
        "the error says what came back: {record}"
    );
    assert_eq!(record["response"]["status"], 200, "{record}");
    assert!(
        record["response"]["body"].to_string().contains("msg_str"),
        "{record}"
    );
    // RD-9: the provider billed it; the failed attempt keeps what it reported.
    assert_eq!(
        (
            &record["usage"]["input_tokens"],
            &record["usage"]["output_tokens"]
        ),
        (&serde_json::json!(9), &serde_json::json!(3)),
        "{record}"
    );
}

/// LC-11, RD-9: a provider that ignores `"stream": true` answers a complete JSON body, which
/// fails the stream request `upstream_invalid` with the body kept. That body reports what the
/// call cost, and the provider billed it, so the failed attempt keeps that usage, as a refused
/// non-stream answer does; it was dropped, leaving the record with no tokens and no cost.
#[tokio::test]
async fn a_stream_request_answered_with_a_json_body_keeps_the_usage_it_reports_lc11_rd9() {
    let app = spawn_app(
        MockConfig {
            ignore_stream: true,
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    for (path, name) in [
        ("/v1/chat/completions", "chat ignores stream"),
        ("/v1/messages", "messages ignore stream"),
    ] {
        let r = app.post(path, route_body(path, name, true), &[]).await;
        assert_eq!(r.status(), 502, "{path}");
        let id = header(&r, "holdfast-request-id");
        let record = wait_terminal(&app.http, &app.base, &id, Duration::from_secs(10)).await;
        assert_eq!(record["error"]["type"], "upstream_invalid", "{record}");
        let reported = &record["response"]["body"]["usage"];
        let (input, output) = if path == "/v1/messages" {
            (&reported["input_tokens"], &reported["output_tokens"])
        } else {
            (&reported["prompt_tokens"], &reported["completion_tokens"])
        };
        assert!(input.as_u64().is_some_and(|n| n > 0), "{record}");
        assert_eq!(
            (
                &record["usage"]["input_tokens"],
                &record["usage"]["output_tokens"]
            ),
            (input, output),
            "RD-9: the billed answer's usage is kept: {record}"
        );
    }
    app.stop().await;
}

/// LC-7, LC-11: a Messages stream says how the answer ended in `message_delta` (the stop
/// reason, non-null after `message_start` as the SDKs document, and the final usage), always
/// before `message_stop`. One that reached `message_stop` without it was stored as succeeded:
/// the SDKs' assembled message had no stop reason and only `message_start`'s usage. It is
/// `upstream_invalid` now, as a stream out of Anthropic's order is (decision 44).
#[tokio::test]
async fn a_messages_stream_that_stops_without_message_delta_is_upstream_invalid_lc7_lc11() {
    let events = [
        r#"{"type":"message_start","message":{"id":"msg_nodelta","type":"message","role":"assistant","content":[],"model":"claude-sonnet-4-5","stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":9,"output_tokens":1}}}"#,
        r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
        r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hello"}}"#,
        r#"{"type":"content_block_stop","index":0}"#,
        r#"{"type":"message_stop"}"#,
    ];
    let body: String = events
        .iter()
        .map(|data| {
            let name = serde_json::from_str::<serde_json::Value>(data).unwrap()["type"]
                .as_str()
                .unwrap()
                .to_owned();
            format!("event: {name}\ndata: {data}\n\n")
        })
        .collect();
    let record = messages_answer_not_stored_as_success("text/event-stream", &body, true).await;
    let message = record["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("`message_stop` before any `message_delta`"),
        "{record}"
    );
    assert_eq!(
        record["usage"]["input_tokens"], 9,
        "what message_start reported is kept: {record}"
    );
}
