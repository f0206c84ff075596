//! Traces (OT-1..OT-6, issue 32): what holdfast exports over OTLP/HTTP, read back by an
//! in-suite receiver that decodes the protobuf, span by span.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::routing::post;
use holdfast::mock::MockConfig;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{AnyValue, any_value};
use prost::Message;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::Notify;

use crate::helpers::*;

/// One exported span, as the receiver decoded it.
#[derive(Debug, Clone)]
pub(crate) struct Span {
    pub(crate) trace_id: String,
    pub(crate) span_id: String,
    pub(crate) parent: String,
    pub(crate) name: String,
    /// OTLP `SpanKind`: 2 server, 3 client.
    pub(crate) kind: i32,
    attrs: HashMap<String, Value>,
    events: Vec<(String, HashMap<String, Value>)>,
    /// (trace id, span id, attributes) of each link.
    pub(crate) links: Vec<(String, String, HashMap<String, Value>)>,
    /// OTLP status code: 0 unset, 1 ok, 2 error.
    status: i32,
    /// The status's message.
    status_message: String,
    service: String,
}

impl Span {
    pub(crate) fn attr(&self, key: &str) -> &Value {
        self.attrs.get(key).unwrap_or(&Value::Null)
    }
}

fn value(v: Option<&AnyValue>) -> Value {
    match v.and_then(|v| v.value.as_ref()) {
        Some(any_value::Value::StringValue(s)) => json!(s),
        Some(any_value::Value::BoolValue(b)) => json!(b),
        Some(any_value::Value::IntValue(i)) => json!(i),
        Some(any_value::Value::DoubleValue(d)) => json!(d),
        Some(any_value::Value::ArrayValue(a)) => {
            Value::Array(a.values.iter().map(|v| value(Some(v))).collect())
        }
        _ => Value::Null,
    }
}

fn attrs(kvs: &[opentelemetry_proto::tonic::common::v1::KeyValue]) -> HashMap<String, Value> {
    kvs.iter()
        .map(|kv| (kv.key.clone(), value(kv.value.as_ref())))
        .collect()
}

/// An OTLP/HTTP traces receiver on 127.0.0.1:0 that keeps every span it is sent.
pub(crate) struct Receiver {
    pub(crate) url: String,
    spans: Arc<Mutex<Vec<Span>>>,
    arrived: Arc<Notify>,
}

impl Receiver {
    pub(crate) async fn start() -> Receiver {
        let spans: Arc<Mutex<Vec<Span>>> = Arc::default();
        let arrived = Arc::new(Notify::new());
        let (kept, told) = (Arc::clone(&spans), Arc::clone(&arrived));
        let app = axum::Router::new().route(
            "/v1/traces",
            post(move |body: Bytes| {
                let (kept, told) = (Arc::clone(&kept), Arc::clone(&told));
                async move {
                    let request = ExportTraceServiceRequest::decode(body).expect("OTLP protobuf");
                    let mut decoded = Vec::new();
                    for resource in request.resource_spans {
                        let service = resource
                            .resource
                            .as_ref()
                            .map(|r| attrs(&r.attributes))
                            .and_then(|a| a.get("service.name").cloned())
                            .and_then(|v| v.as_str().map(str::to_owned))
                            .unwrap_or_default();
                        for scope in resource.scope_spans {
                            for s in scope.spans {
                                decoded.push(Span {
                                    trace_id: hex::encode(&s.trace_id),
                                    span_id: hex::encode(&s.span_id),
                                    parent: hex::encode(&s.parent_span_id),
                                    name: s.name.clone(),
                                    kind: s.kind,
                                    attrs: attrs(&s.attributes),
                                    events: s
                                        .events
                                        .iter()
                                        .map(|e| (e.name.clone(), attrs(&e.attributes)))
                                        .collect(),
                                    links: s
                                        .links
                                        .iter()
                                        .map(|l| {
                                            (
                                                hex::encode(&l.trace_id),
                                                hex::encode(&l.span_id),
                                                attrs(&l.attributes),
                                            )
                                        })
                                        .collect(),
                                    status: s.status.as_ref().map_or(0, |st| st.code),
                                    status_message: s
                                        .status
                                        .as_ref()
                                        .map(|st| st.message.clone())
                                        .unwrap_or_default(),
                                    service: service.clone(),
                                });
                            }
                        }
                    }
                    kept.lock().unwrap().extend(decoded);
                    told.notify_waiters();
                    // An empty ExportTraceServiceResponse.
                    (
                        [("content-type", "application/x-protobuf")],
                        Vec::<u8>::new(),
                    )
                }
            }),
        );
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/v1/traces", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Receiver {
            url,
            spans,
            arrived,
        }
    }

    /// The spans received once `done` holds for them (waits for each export; 15 s at most).
    pub(crate) async fn wait(&self, what: &str, done: impl Fn(&[Span]) -> bool) -> Vec<Span> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        loop {
            let arrived = self.arrived.notified();
            {
                let spans = self.spans.lock().unwrap();
                if done(&spans) {
                    return spans.clone();
                }
            }
            if tokio::time::timeout_at(deadline, arrived).await.is_err() {
                panic!(
                    "never received {what}; got {:#?}",
                    self.spans.lock().unwrap()
                );
            }
        }
    }
}

/// Runs openai-python with `timeout=1` and `max_retries=2` against `app`, every send carrying
/// a `traceparent` of `trace` with parent span `parent`; what the driver prints.
async fn sdk_retry_in_trace(app: &TestApp, trace: &str, parent: &str) -> Value {
    let base = format!("{}/v1", app.base);
    let traceparent = format!("00-{trace}-{parent}-01");
    let out = tokio::task::spawn_blocking(move || {
        run_python(
            "openai_timeout_retry.py",
            &[
                ("HOLDFAST_BASE_URL", &base),
                ("SDK_MAX_RETRIES", "2"),
                ("TRACEPARENT", &traceparent),
            ],
        )
    })
    .await
    .unwrap();
    serde_json::from_str(out.trim()).expect("driver prints JSON")
}

fn traced(receiver: &Receiver) -> impl FnOnce(&mut holdfast::config::Config) + '_ {
    |c| {
        c.otel.enabled = true;
        c.otel.endpoint = Some(receiver.url.clone());
    }
}

pub(crate) fn attempts(spans: &[Span]) -> Vec<&Span> {
    spans.iter().filter(|s| s.kind == 3).collect()
}

pub(crate) fn servers(spans: &[Span]) -> Vec<&Span> {
    spans.iter().filter(|s| s.kind == 2).collect()
}

#[tokio::test]
async fn openai_python_retries_past_its_timeout_show_one_trace_one_attempt_and_two_linked_answers_from_the_log_ot2_ot3_ot4()
 {
    require_python(&["openai"]);
    let receiver = Receiver::start().await;
    let app = spawn_app(
        MockConfig {
            header_delay_ms: 3_000,
            ..MockConfig::default()
        },
        traced(&receiver),
    )
    .await;
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let out = sdk_retry_in_trace(&app, trace, "00f067aa0ba902b7").await;
    assert_eq!(
        out["timeouts_seen"], 2,
        "the first two sends timed out: {out}"
    );
    assert_eq!(app.mock.calls(), 1);
    let spans = receiver
        .wait("three server spans and the attempt", |s| {
            servers(s).len() >= 3 && !attempts(s).is_empty()
        })
        .await;
    // One trace: the SDK's.
    assert!(spans.iter().all(|s| s.trace_id == trace), "{spans:#?}");
    assert!(spans.iter().all(|s| s.service == "holdfast"), "{spans:#?}");
    let attempts = attempts(&spans);
    assert_eq!(attempts.len(), 1, "exactly one attempt: {spans:#?}");
    let attempt = attempts[0];
    assert_eq!(attempt.name, "chat gpt-4o-mini");
    assert_eq!(attempt.attr("gen_ai.operation.name"), "chat");
    assert_eq!(attempt.attr("gen_ai.provider.name"), "openai");
    assert_eq!(attempt.attr("gen_ai.request.model"), "gpt-4o-mini");
    assert!(
        attempt.attr("gen_ai.response.id").is_string(),
        "{attempt:#?}"
    );
    assert_eq!(
        attempt.attr("gen_ai.response.finish_reasons"),
        &json!(["stop"])
    );
    assert!(attempt.attr("gen_ai.usage.input_tokens").as_i64().unwrap() > 0);
    assert!(attempt.attr("gen_ai.usage.output_tokens").as_i64().unwrap() > 0);
    assert_eq!(attempt.attr("holdfast.attempt"), 1);
    assert_eq!(attempt.attr("server.address"), "127.0.0.1");
    // The attempt sits under the server span of the call that created the request.
    let servers = servers(&spans);
    let created = servers
        .iter()
        .find(|s| s.attr("holdfast.delivery") == "new")
        .expect("the first send's span");
    assert_eq!(attempt.parent, created.span_id);
    assert_eq!(
        created.parent, "00f067aa0ba902b7",
        "the SDK's span is its parent"
    );
    // The provider was called with the attempt's traceparent.
    let sent = &app.mock.recorded()[0];
    let carried = sent
        .headers
        .iter()
        .find(|(n, _)| n == "traceparent")
        .map(|(_, v)| v.clone())
        .expect("the provider call carries traceparent");
    assert_eq!(carried, format!("00-{trace}-{}-01", attempt.span_id));
    // The two retries were answered from the log: no attempt of their own, a link to the one.
    let answered: Vec<_> = servers
        .iter()
        .filter(|s| s.attr("holdfast.delivery") != "new")
        .collect();
    assert_eq!(answered.len(), 2, "{servers:#?}");
    for span in answered {
        assert!(
            span.attr("holdfast.attached") == true || span.attr("holdfast.replayed") == true,
            "{span:#?}"
        );
        assert_eq!(
            span.links
                .iter()
                .map(|(t, s, _)| (t.as_str(), s.as_str()))
                .collect::<Vec<_>>(),
            vec![(trace, attempt.span_id.as_str())],
            "{span:#?}"
        );
        assert_eq!(
            span.attr("holdfast.request_id"),
            attempt.attr("holdfast.request_id")
        );
    }
    app.stop().await;
}

#[tokio::test]
async fn an_anthropic_stream_has_an_attempt_span_with_its_first_chunk_time_finish_reason_and_usage_ot3()
 {
    let receiver = Receiver::start().await;
    let app = spawn_app(
        MockConfig {
            chunks: 5,
            ..MockConfig::default()
        },
        traced(&receiver),
    )
    .await;
    let body = json!({
        "model": "claude-3-5-haiku-latest",
        "max_tokens": 64,
        "stream": true,
        "messages": [{"role": "user", "content": "trace this stream"}],
    });
    let response = app
        .post(
            "/v1/messages",
            body.to_string(),
            &[("anthropic-version", "2023-06-01")],
        )
        .await;
    assert_eq!(response.status(), 200);
    let (_, events) = read_events(response).await;
    let spans = receiver
        .wait("the attempt and the server span", |s| {
            attempts(s).len() == 1 && servers(s).len() == 1
        })
        .await;
    let attempt = attempts(&spans)[0];
    assert_eq!(attempt.name, "chat claude-3-5-haiku-latest");
    assert_eq!(attempt.attr("gen_ai.provider.name"), "anthropic");
    assert_eq!(attempt.attr("holdfast.stream"), true);
    assert!(
        attempt.attr("gen_ai.response.id").is_string(),
        "{attempt:#?}"
    );
    assert!(
        attempt
            .attr("gen_ai.response.finish_reasons")
            .as_array()
            .is_some_and(|r| !r.is_empty()),
        "{attempt:#?}"
    );
    assert!(attempt.attr("gen_ai.usage.output_tokens").as_i64().unwrap() > 0);
    assert_eq!(
        attempt.attr("holdfast.events").as_u64().unwrap(),
        events.len() as u64,
        "{attempt:#?}"
    );
    let first = attempt
        .events
        .iter()
        .find(|(name, _)| name == "gen_ai.first_chunk")
        .expect("a first-chunk event");
    assert!(
        first.1["gen_ai.response.time_to_first_chunk"]
            .as_f64()
            .unwrap()
            > 0.0
    );
    let server = servers(&spans)[0];
    assert_eq!(attempt.parent, server.span_id);
    assert_eq!(server.attr("http.response.status_code"), 200);
    assert_eq!(server.attr("http.route"), "/v1/messages");
    app.stop().await;
}

#[tokio::test]
async fn a_gemini_stream_has_an_attempt_span_in_the_genai_conventions_ot3() {
    let receiver = Receiver::start().await;
    let app = spawn_app(MockConfig::default(), traced(&receiver)).await;
    let response = app
        .post(
            "/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse",
            gemini_body("trace gemini"),
            &[],
        )
        .await;
    assert_eq!(response.status(), 200);
    read_events(response).await;
    let spans = receiver
        .wait("the attempt", |s| attempts(s).len() == 1)
        .await;
    let attempt = attempts(&spans)[0];
    assert_eq!(attempt.name, "generate_content gemini-2.5-flash");
    assert_eq!(attempt.attr("gen_ai.provider.name"), "gcp.gemini");
    assert_eq!(
        attempt.attr("gen_ai.response.finish_reasons"),
        &json!(["STOP"])
    );
    assert!(attempt.attr("gen_ai.usage.input_tokens").as_i64().unwrap() > 0);
    assert!(
        attempt
            .events
            .iter()
            .any(|(n, _)| n == "gen_ai.first_chunk")
    );
    app.stop().await;
}

/// OT-3: an attempt span carries the request's parameters under the GenAI conventions' names
/// and types, as the reference instrumentations set them and as Langfuse and Phoenix read them:
/// `max_tokens` and `seed` ints, a temperature written `1` the double 1.0, a lone stop string
/// an array of one; `gen_ai.request.stream` on a stream and on nothing else.
#[tokio::test]
async fn an_attempt_span_carries_the_request_parameters_in_the_genai_conventions_types_ot3() {
    let receiver = Receiver::start().await;
    let app = spawn_app(MockConfig::default(), traced(&receiver)).await;
    let chat = json!({
        "model": "gpt-4o-mini",
        "stream": true,
        "messages": [{"role": "user", "content": "parameters, streamed"}],
        "max_tokens": 50,
        "temperature": 1,
        "top_p": 0.5,
        "seed": 7,
        "stop": "END",
    });
    let response = app.chat(&chat.to_string()).await;
    assert_eq!(response.status(), 200);
    read_events(response).await;
    let anthropic = json!({
        "model": "claude-3-5-haiku-latest",
        "max_tokens": 64,
        "temperature": 0.3,
        "stop_sequences": ["\n\nHuman:"],
        "messages": [{"role": "user", "content": "parameters, whole"}],
    });
    let response = app
        .post(
            "/v1/messages",
            anthropic.to_string(),
            &[("anthropic-version", "2023-06-01")],
        )
        .await;
    assert_eq!(response.status(), 200);
    let _ = response.bytes().await;
    let spans = receiver
        .wait("both attempts", |s| attempts(s).len() == 2)
        .await;
    let attempts = attempts(&spans);
    let chat = attempts
        .iter()
        .find(|s| s.attr("gen_ai.provider.name") == "openai")
        .expect("the chat attempt");
    assert_eq!(
        chat.attr("gen_ai.request.max_tokens"),
        &json!(50),
        "{chat:#?}"
    );
    assert_eq!(chat.attr("gen_ai.request.seed"), &json!(7), "{chat:#?}");
    assert!(
        chat.attr("gen_ai.request.temperature").is_f64(),
        "a double, as the conventions type it: {chat:#?}"
    );
    assert_eq!(chat.attr("gen_ai.request.temperature"), &json!(1.0));
    assert_eq!(chat.attr("gen_ai.request.top_p"), &json!(0.5));
    assert_eq!(chat.attr("gen_ai.request.stop_sequences"), &json!(["END"]));
    assert_eq!(chat.attr("gen_ai.request.stream"), &json!(true));
    let messages = attempts
        .iter()
        .find(|s| s.attr("gen_ai.provider.name") == "anthropic")
        .expect("the Anthropic attempt");
    assert_eq!(messages.attr("gen_ai.request.max_tokens"), &json!(64));
    assert_eq!(messages.attr("gen_ai.request.temperature"), &json!(0.3));
    assert_eq!(
        messages.attr("gen_ai.request.stop_sequences"),
        &json!(["\n\nHuman:"])
    );
    assert_eq!(
        messages.attr("gen_ai.request.stream"),
        &Value::Null,
        "set if and only if the request streams: {messages:#?}"
    );
    app.stop().await;
}

/// OT-2: a server span carries what the HTTP server conventions require beside the method:
/// `url.scheme` and `url.path`, the path as called (a Gemini call's model in it), never its
/// query (which may carry a key, GM-2).
#[tokio::test]
async fn a_server_span_carries_the_url_scheme_and_path_the_http_conventions_require_ot2() {
    let receiver = Receiver::start().await;
    let app = spawn_app(MockConfig::default(), traced(&receiver)).await;
    let response = app
        .post(
            "/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse&key=query-key-1",
            gemini_body("url path"),
            &[],
        )
        .await;
    assert_eq!(response.status(), 200);
    read_events(response).await;
    assert_eq!(app.chat(&chat_body("url path")).await.status(), 200);
    let spans = receiver
        .wait("both server spans", |s| servers(s).len() == 2)
        .await;
    let servers = servers(&spans);
    let gemini = servers
        .iter()
        .find(|s| s.attr("http.route") == "/v1beta/models/{call}")
        .expect("the Gemini call's span");
    assert_eq!(gemini.attr("url.scheme"), "http", "{gemini:#?}");
    assert_eq!(
        gemini.attr("url.path"),
        "/v1beta/models/gemini-2.5-flash:streamGenerateContent"
    );
    let chat = servers
        .iter()
        .find(|s| s.attr("http.route") == "/v1/chat/completions")
        .expect("the chat call's span");
    assert_eq!(chat.attr("url.scheme"), "http");
    assert_eq!(chat.attr("url.path"), "/v1/chat/completions");
    assert!(
        !format!("{spans:?}").contains("query-key-1"),
        "the query's key is in no span"
    );
    app.stop().await;
}

#[tokio::test]
async fn a_retried_attempt_is_a_second_span_linked_to_the_first_with_the_backoff_as_an_event_ot3() {
    let receiver = Receiver::start().await;
    let app = spawn_app(
        MockConfig {
            fail_first: 1,
            fail_status: 503,
            ..MockConfig::default()
        },
        traced(&receiver),
    )
    .await;
    let response = app.chat(&chat_body("retry me")).await;
    assert_eq!(response.status(), 200);
    let spans = receiver
        .wait("two attempts", |s| attempts(s).len() == 2)
        .await;
    let mut attempts = attempts(&spans);
    attempts.sort_by_key(|s| s.attr("holdfast.attempt").as_i64());
    let (first, second) = (attempts[0], attempts[1]);
    assert_eq!(first.attr("error.type"), "503");
    assert_eq!(first.status, 2, "an error status");
    assert!(
        first
            .events
            .iter()
            .any(|(n, a)| n == "holdfast.retry" && a.contains_key("holdfast.backoff_ms")),
        "{first:#?}"
    );
    assert_eq!(second.links.len(), 1);
    assert_eq!(second.links[0].1, first.span_id);
    assert_eq!(second.parent, first.parent, "both under the call's span");
    app.stop().await;
}

/// OT-5 (decision 154): a failed attempt's span status says its error type and the provider's
/// status, not the provider's words, which may echo the prompt (a 5xx body quoting the
/// request, a stream's error chunk), unless content is captured. Before, the stored error
/// message, with the provider's body in it, was every failed attempt's status message (a
/// break-it trial of the thirty-second session found a prompt's text in five spans).
#[tokio::test]
async fn a_failed_attempts_span_status_quotes_the_provider_only_when_content_is_captured_ot5() {
    for capture in [false, true] {
        let receiver = Receiver::start().await;
        let app = spawn_app(
            MockConfig {
                fail_first: 1,
                fail_status: 503,
                ..MockConfig::default()
            },
            |c| {
                traced(&receiver)(c);
                c.otel.capture_content = capture;
            },
        )
        .await;
        assert_eq!(app.chat(&chat_body("fail me once")).await.status(), 200);
        let spans = receiver
            .wait("two attempts", |s| attempts(s).len() == 2)
            .await;
        let failed = attempts(&spans)
            .into_iter()
            .find(|s| s.status == 2)
            .expect("the failed attempt's span");
        let quoted = failed.status_message.contains("injected failure");
        assert_eq!(quoted, capture, "{:?}", failed.status_message);
        if !capture {
            assert_eq!(failed.status_message, "retried: the provider answered 503");
        }
        app.stop().await;
    }
}

/// OT-4, RD-9 (decision 155): a call answered from the log says the request's deliveries so
/// far, its own included, and the provider calls they saved, replays counted as attachments
/// are. Before, `holdfast.saved_calls` left replays out (it was the count the settling
/// attempt adds, decision 38) and `holdfast.deliveries` counted log reads too: the third send
/// of one body read 0 saved calls where the record said 2 (a break-it trial of the
/// thirty-second session).
#[tokio::test]
async fn a_replayed_calls_span_counts_the_deliveries_and_saved_calls_the_record_does_ot4_rd9() {
    let receiver = Receiver::start().await;
    let app = spawn_app(MockConfig::default(), traced(&receiver)).await;
    let body = chat_body("sent three times");
    let mut id = String::new();
    for _ in 0..3 {
        let answer = app.chat(&body).await;
        assert_eq!(answer.status(), 200);
        id = header(&answer, "holdfast-request-id");
    }
    let spans = receiver
        .wait("three server spans", |s| servers(s).len() == 3)
        .await;
    let mut counted: Vec<(i64, i64)> = servers(&spans)
        .into_iter()
        .filter(|s| s.attr("holdfast.replayed") == &json!(true))
        .map(|s| {
            (
                s.attr("holdfast.deliveries").as_i64().unwrap(),
                s.attr("holdfast.saved_calls").as_i64().unwrap(),
            )
        })
        .collect();
    counted.sort_unstable();
    assert_eq!(counted, [(2, 1), (3, 2)]);
    let record = app.record(&id).await;
    assert_eq!(record["saved_calls"], 2, "{record}");
    assert_eq!(app.mock.calls(), 1);
    app.stop().await;
}

/// OT-3, LC-9: an attempt stopped by a cancel of its request ends its span with the request's
/// stored error type, `cancelled`, not `lease_lost` (which an error dashboard grouped by
/// `error.type` would count as holdfast losing work).
#[tokio::test]
async fn a_cancelled_attempts_span_says_cancelled_not_lease_lost_ot3() {
    let receiver = Receiver::start().await;
    let app = spawn_app(
        MockConfig {
            chunks: 200,
            chunk_delay_ms: 50,
            ..MockConfig::default()
        },
        traced(&receiver),
    )
    .await;
    let response = app.chat(&stream_body("cancel me mid-stream")).await;
    assert_eq!(response.status(), 200);
    let id = header(&response, "holdfast-request-id");
    let reading = tokio::spawn(async move { response.bytes().await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let cancelled = app
        .http
        .post(format!("{}/requests/{id}/cancel", app.base))
        .send()
        .await
        .expect("cancel");
    assert_eq!(cancelled.status(), 200);
    let spans = receiver
        .wait("the attempt", |s| !attempts(s).is_empty())
        .await;
    let attempt = attempts(&spans)[0];
    assert_eq!(attempt.attr("holdfast.request_id"), id.as_str());
    assert_eq!(attempt.attr("error.type"), "cancelled", "{attempt:#?}");
    assert_eq!(attempt.status, 2, "an error status");
    let _ = reading.await;
    app.stop().await;
}

#[tokio::test]
async fn with_the_collector_down_calls_are_answered_and_lost_spans_are_counted_ot1() {
    // A port nothing listens on, and a black hole that accepts and never answers.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let hole = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hole_addr = hole.local_addr().unwrap();
    let held = Arc::new(Mutex::new(Vec::new()));
    let keep = Arc::clone(&held);
    tokio::spawn(async move {
        while let Ok((socket, _)) = hole.accept().await {
            keep.lock().unwrap().push(socket);
        }
    });
    for (endpoint, reason) in [
        (format!("http://{closed}/v1/traces"), "export_failed"),
        (format!("http://{hole_addr}/v1/traces"), "queue_full"),
    ] {
        let app = spawn_app(MockConfig::default(), |c| {
            c.otel.enabled = true;
            c.otel.endpoint = Some(endpoint.clone());
            c.otel.queue_size = 4;
            c.otel.batch_size = 2;
            c.otel.export_timeout_ms = 60_000;
        })
        .await;
        for i in 0..20 {
            let response = app.chat(&chat_body(&format!("collector down {i}"))).await;
            assert_eq!(
                response.status(),
                200,
                "answered while the collector is down"
            );
        }
        let mut dropped = 0.0;
        for _ in 0..150 {
            dropped = metric(
                &app.metrics_text().await,
                "holdfast_otel_spans_dropped_total",
                &format!("reason=\"{reason}\""),
            );
            if dropped > 0.0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(dropped > 0.0, "{endpoint}: spans dropped as {reason}");
        app.stop().await;
    }
}

#[tokio::test]
async fn with_traces_off_no_span_is_made_and_the_provider_gets_no_traceparent_ot1() {
    let receiver = Receiver::start().await;
    let app = spawn_app(MockConfig::default(), |c| {
        // Off (the default), even with an endpoint named.
        c.otel.endpoint = Some(receiver.url.clone());
    })
    .await;
    let response = app
        .post(
            "/v1/chat/completions",
            chat_body("untraced"),
            &[(
                "traceparent",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            )],
        )
        .await;
    assert_eq!(response.status(), 200);
    let sent = &app.mock.recorded()[0];
    assert!(
        sent.headers.iter().all(|(n, _)| n != "traceparent"),
        "{:?}",
        sent.headers
    );
    let page = app.metrics_text().await;
    assert!(
        !page.contains("holdfast_otel_spans"),
        "no trace metrics when off"
    );
    app.stop().await;
    assert!(receiver.spans.lock().unwrap().is_empty());
}

#[tokio::test]
async fn with_traces_on_an_attempts_log_lines_carry_its_trace_and_span_ids_in_both_formats_ot6() {
    let receiver = Receiver::start().await;
    let mock = start_mock(MockConfig::default()).await;
    for format in ["text", "json"] {
        let dir = tempfile::tempdir().unwrap();
        let toml = format!(
            r#"log_format = "{format}"
[otel]
enabled = true
endpoint = "{}"
[[backends]]
name = "mock"
kind = "openai"
base_url = "{}"
"#,
            receiver.url,
            mock.base_url()
        );
        let node =
            Process::serve_logged_at_default_level(dir.path(), &toml, free_addr(), &[]).await;
        let response = reqwest::Client::new()
            .post(format!("{}/v1/chat/completions", node.base))
            .header("content-type", "application/json")
            .body(chat_body(&format!("logged as {format}")))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let id = header(&response, "holdfast-request-id");
        let spans = receiver
            .wait("the attempt", |s| {
                attempts(s)
                    .iter()
                    .any(|a| a.attr("holdfast.request_id") == id.as_str())
            })
            .await;
        let attempt = attempts(&spans)
            .into_iter()
            .find(|a| a.attr("holdfast.request_id") == id.as_str())
            .unwrap()
            .clone();
        let log =
            crate::startup::wait_for_file(&dir.path().join("holdfast.log"), "request finished")
                .await;
        let finished = log
            .lines()
            .find(|l| l.contains("request finished") && l.contains(&id))
            .unwrap_or_else(|| panic!("{format}: no finished line for {id}:\n{log}"));
        assert!(
            finished.contains(&attempt.trace_id) && finished.contains(&attempt.span_id),
            "{format}: the finished line names trace {} and span {}: {finished}",
            attempt.trace_id,
            attempt.span_id
        );
        if format == "json" {
            let line: Value = serde_json::from_str(finished).expect("a JSON line");
            assert_eq!(
                line["span"]["trace_id"],
                attempt.trace_id.as_str(),
                "{line}"
            );
        }
    }
    mock.shutdown().await;
}

/// Arize Phoenix (`phoenix serve`) on loopback ports of its own, with its data in `dir`; killed
/// on drop.
struct Phoenix {
    child: std::process::Child,
    base: String,
}

impl Drop for Phoenix {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Phoenix {
    /// Starts it from `.venv-phoenix` (set up by `scripts/test`) and waits for `/healthz` (60 s
    /// at most a try): fails naming what is missing when it is not installed. Its ports are free when
    /// picked, but Phoenix binds them seconds later, when another test may have taken one: a
    /// start that fails on a port in use is tried again on new ports, three times at most.
    async fn start(dir: &std::path::Path) -> Phoenix {
        let bin =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv-phoenix/bin/phoenix");
        if !bin.exists() {
            missing_dependency(
                "python",
                "Arize Phoenix (.venv-phoenix/bin/phoenix)",
                "run scripts/test, which installs tests/clients/phoenix-requirements.txt into .venv-phoenix",
            );
        }
        let errors = || std::fs::read_to_string(dir.join("phoenix.err")).unwrap_or_default();
        let client = reqwest::Client::new();
        for tries in 1.. {
            let started = std::time::Instant::now();
            let (http, grpc) = (free_addr(), free_addr());
            let child = std::process::Command::new(&bin)
                .arg("serve")
                .env("PHOENIX_HOST", "127.0.0.1")
                .env("PHOENIX_PORT", http.port().to_string())
                .env("PHOENIX_GRPC_PORT", grpc.port().to_string())
                .env("PHOENIX_WORKING_DIR", dir)
                .env("PHOENIX_TELEMETRY_ENABLED", "false")
                .env("PHOENIX_ALLOW_EXTERNAL_RESOURCES", "false")
                .env("PHOENIX_ALLOWED_SANDBOX_PROVIDERS", "NONE")
                .stdout(std::fs::File::create(dir.join("phoenix.log")).unwrap())
                .stderr(std::fs::File::create(dir.join("phoenix.err")).unwrap())
                .spawn()
                .expect("start phoenix");
            let mut phoenix = Phoenix {
                child,
                base: format!("http://{http}"),
            };
            loop {
                let up = client
                    .get(format!("{}/healthz", phoenix.base))
                    .send()
                    .await
                    .is_ok_and(|r| r.status() == 200);
                if up {
                    return phoenix;
                }
                if phoenix
                    .child
                    .try_wait()
                    .is_ok_and(|exited| exited.is_some())
                {
                    let errors = errors();
                    assert!(
                        tries < 3 && errors.contains("address already in use"),
                        "phoenix exited (try {tries}): {errors}"
                    );
                    break;
                }
                // Phoenix migrates its database first: past a minute when the machine's two
                // cores are busy with a release build (seen in the twenty-ninth session).
                assert!(
                    started.elapsed() < Duration::from_secs(180),
                    "phoenix did not come up within 180 s: {}",
                    errors()
                );
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
        unreachable!("the tries end in a return or a failed assertion")
    }

    /// The spans of `trace` in Phoenix's default project, once `done` holds for them (polls its
    /// REST API, which has no push; 30 s at most).
    async fn spans(&self, trace: &str, done: impl Fn(&[Value]) -> bool) -> Vec<Value> {
        let client = reqwest::Client::new();
        let started = std::time::Instant::now();
        loop {
            let page: Value = client
                .get(format!(
                    "{}/v1/projects/default/spans?trace_id={trace}&limit=100",
                    self.base
                ))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap_or(Value::Null);
            let spans = page["data"].as_array().cloned().unwrap_or_default();
            if done(&spans) {
                return spans;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "phoenix never held the spans; last page: {page}"
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

/// A span attribute as Phoenix answers it: flat (`"gen_ai.usage.input_tokens"`) or nested.
fn phoenix_attr<'a>(span: &'a Value, key: &str) -> &'a Value {
    let attributes = &span["attributes"];
    if let Some(v) = attributes.get(key) {
        return v;
    }
    key.split('.').fold(attributes, |v, part| &v[part])
}

#[tokio::test]
async fn phoenix_receives_an_openai_python_retry_as_one_trace_with_one_attempt_ot1_ot2_ot3() {
    require_python(&["openai"]);
    let dir = tempfile::tempdir().unwrap();
    let phoenix = Phoenix::start(dir.path()).await;
    let endpoint = format!("{}/v1/traces", phoenix.base);
    let app = spawn_app(
        MockConfig {
            header_delay_ms: 3_000,
            ..MockConfig::default()
        },
        |c| {
            c.otel.enabled = true;
            c.otel.endpoint = Some(endpoint);
        },
    )
    .await;
    let trace = "5bf92f3577b34da6a3ce929d0e0e4737";
    let out = sdk_retry_in_trace(&app, trace, "00f067aa0ba902b8").await;
    assert_eq!(out["timeouts_seen"], 2, "{out}");
    assert_eq!(app.mock.calls(), 1);
    let spans = phoenix.spans(trace, |spans| spans.len() >= 4).await;
    let calls: Vec<&Value> = spans
        .iter()
        .filter(|s| s["name"] == "POST /v1/chat/completions")
        .collect();
    let attempts: Vec<&Value> = spans
        .iter()
        .filter(|s| s["name"] == "chat gpt-4o-mini")
        .collect();
    assert_eq!(calls.len(), 3, "three calls: {spans:#?}");
    assert_eq!(attempts.len(), 1, "one provider call: {spans:#?}");
    let attempt = attempts[0];
    assert_eq!(
        phoenix_attr(attempt, "gen_ai.provider.name"),
        "openai",
        "{attempt:#}"
    );
    assert!(
        phoenix_attr(attempt, "gen_ai.usage.output_tokens")
            .as_i64()
            .unwrap_or(0)
            > 0,
        "{attempt:#}"
    );
    let created = calls
        .iter()
        .find(|s| phoenix_attr(s, "holdfast.delivery") == "new")
        .expect("the call that created the request");
    assert_eq!(
        attempt["parent_id"], created["context"]["span_id"],
        "{spans:#?}"
    );
    let answered = calls
        .iter()
        .filter(|s| phoenix_attr(s, "holdfast.delivery") != "new")
        .count();
    assert_eq!(answered, 2, "two answered from the log: {spans:#?}");
    app.stop().await;
}

/// OT-5: a Responses answer that did not stream has its text captured: the API's answer holds
/// it in its output items (`output_text` is the SDK's convenience, not a member of the answer),
/// so the captured output was empty for every such call.
#[tokio::test]
async fn a_responses_answer_that_did_not_stream_has_its_text_captured_ot5() {
    let receiver = Receiver::start().await;
    let app = spawn_app(MockConfig::default(), |c| {
        c.otel.enabled = true;
        c.otel.endpoint = Some(receiver.url.clone());
        c.otel.capture_content = true;
    })
    .await;
    let body = json!({"model": "gpt-4o-mini", "input": "capture the whole answer"});
    let response = app.post("/v1/responses", body.to_string(), &[]).await;
    assert_eq!(response.status(), 200);
    let answer: Value = response.json().await.unwrap();
    let text: String = answer["output"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|item| item["content"].as_array().cloned().unwrap_or_default())
        .filter_map(|part| part["text"].as_str().map(str::to_owned))
        .collect();
    assert!(!text.is_empty(), "{answer}");
    let spans = receiver
        .wait("the attempt", |s| !attempts(s).is_empty())
        .await;
    let attempt = attempts(&spans)[0];
    let output = attempt.attr("gen_ai.output.messages");
    assert!(output.is_string(), "an output is captured: {attempt:#?}");
    let output: Value = serde_json::from_str(output.as_str().unwrap()).unwrap();
    assert_eq!(
        output,
        json!([{
            "role": "assistant",
            "parts": [{"type": "text", "content": text}],
            "finish_reason": "stop",
        }])
    );
    app.stop().await;
}

#[tokio::test]
async fn content_is_captured_only_when_asked_cut_to_its_cap_and_keys_never_appear_ot5() {
    let receiver = Receiver::start().await;
    let key = "hf-traced-namespace-key-7c1d";
    let app = spawn_app(MockConfig::default(), |c| {
        c.otel.enabled = true;
        c.otel.endpoint = Some(receiver.url.clone());
        c.otel.capture_content = true;
        c.otel.content_max_bytes = 64;
        c.namespaces = vec![holdfast::config::Namespace {
            name: "team".into(),
            api_keys: vec![key.into()],
            callback_url: None,
            callback_secrets: Vec::new(),
            callback_include_body: None,
            max_held_requests: None,
        }];
    })
    .await;
    let auth = format!("Bearer {key}");
    let body = json!({
        "model": "gpt-4o-mini",
        "stream": true,
        "messages": [{"role": "user", "content": "capture this prompt"}],
    });
    let response = app
        .post(
            "/v1/chat/completions",
            body.to_string(),
            &[("authorization", &auth)],
        )
        .await;
    assert_eq!(response.status(), 200);
    let (_, events) = read_events(response).await;
    let text = openai_text(&events);
    let spans = receiver
        .wait("the attempt", |s| attempts(s).len() == 1)
        .await;
    let attempt = attempts(&spans)[0];
    let input: Value =
        serde_json::from_str(attempt.attr("gen_ai.input.messages").as_str().unwrap()).unwrap();
    assert_eq!(
        input,
        json!([{"role": "user", "parts": [{"type": "text", "content": "capture this prompt"}]}])
    );
    let output: Value =
        serde_json::from_str(attempt.attr("gen_ai.output.messages").as_str().unwrap()).unwrap();
    assert_eq!(output[0]["role"], "assistant");
    assert_eq!(
        output[0]["finish_reason"], "stop",
        "the conventions' output message requires its finish reason: {output}"
    );
    let captured = output[0]["parts"][0]["content"].as_str().unwrap();
    assert!(text.len() > 64, "the answer is longer than the cap: {text}");
    assert_eq!(captured, &text[..64], "the stream's text, cut to the cap");
    let everything = format!("{spans:?}");
    assert!(!everything.contains(key), "the key never appears in a span");
    app.stop().await;

    // Off by default: no content.
    let receiver = Receiver::start().await;
    let app = spawn_app(MockConfig::default(), traced(&receiver)).await;
    assert_eq!(app.chat(&chat_body("not captured")).await.status(), 200);
    let spans = receiver
        .wait("the attempt", |s| attempts(s).len() == 1)
        .await;
    let attempt = attempts(&spans)[0];
    assert!(attempt.attr("gen_ai.input.messages").is_null());
    assert!(attempt.attr("gen_ai.output.messages").is_null());
    assert!(!format!("{spans:?}").contains("not captured"));
    app.stop().await;
}

/// A traced app whose attempt spans capture content.
fn captured(receiver: &Receiver) -> impl FnOnce(&mut holdfast::config::Config) + '_ {
    |c| {
        c.otel.enabled = true;
        c.otel.endpoint = Some(receiver.url.clone());
        c.otel.capture_content = true;
    }
}

/// The attempt span of request `id` among `spans`.
fn attempt_of<'a>(spans: &'a [Span], id: &str) -> &'a Span {
    attempts(spans)
        .into_iter()
        .find(|s| s.attr("holdfast.request_id") == id)
        .expect("the request's attempt")
}

/// A JSON attribute (the conventions' structured content) of `span`, parsed.
fn json_attr(span: &Span, key: &str) -> Value {
    let text = span
        .attr(key)
        .as_str()
        .unwrap_or_else(|| panic!("{key}: {span:#?}"));
    serde_json::from_str(text).unwrap()
}

/// OT-5: instructions an API takes apart from the chat history (Anthropic's `system`, a
/// Responses call's `instructions`, Gemini's `systemInstruction`) are
/// `gen_ai.system_instructions`, as the conventions ask, not a system message in
/// `gen_ai.input.messages`; an OpenAI chat's system message is part of its history and stays
/// there.
#[tokio::test]
async fn instructions_given_apart_from_the_history_are_the_system_instructions_ot5() {
    let receiver = Receiver::start().await;
    let app = spawn_app(MockConfig::default(), captured(&receiver)).await;
    let anthropic = json!({
        "model": "claude-3-5-haiku-latest",
        "max_tokens": 64,
        "system": "answer briefly",
        "messages": [{"role": "user", "content": "system apart"}],
    });
    let responses = json!({
        "model": "gpt-4o-mini",
        "instructions": "answer in French",
        "input": "instructions apart",
    });
    let gemini = json!({
        "systemInstruction": {"parts": [{"text": "answer in haiku"}]},
        "contents": [{"role": "user", "parts": [{"text": "system instruction apart"}]}],
    });
    let chat = json!({
        "model": "gpt-4o-mini",
        "messages": [
            {"role": "system", "content": "answer in German"},
            {"role": "user", "content": "system in the history"},
        ],
    });
    let calls = [
        (
            "/v1/messages",
            anthropic,
            Some("answer briefly"),
            "system apart",
        ),
        (
            "/v1/responses",
            responses,
            Some("answer in French"),
            "instructions apart",
        ),
        (
            "/v1beta/models/gemini-2.5-flash:generateContent",
            gemini,
            Some("answer in haiku"),
            "system instruction apart",
        ),
        ("/v1/chat/completions", chat, None, "system in the history"),
    ];
    let mut ids = Vec::new();
    for (path, body, _, _) in &calls {
        let response = app
            .post(
                path,
                body.to_string(),
                &[("anthropic-version", "2023-06-01")],
            )
            .await;
        assert_eq!(response.status(), 200, "{path}");
        ids.push(header(&response, "holdfast-request-id"));
    }
    let spans = receiver
        .wait("the four attempts", |s| attempts(s).len() == 4)
        .await;
    for ((path, _, system, prompt), id) in calls.iter().zip(&ids) {
        let attempt = attempt_of(&spans, id);
        let input = json_attr(attempt, "gen_ai.input.messages");
        match system {
            Some(system) => {
                assert_eq!(
                    json_attr(attempt, "gen_ai.system_instructions"),
                    json!([{"type": "text", "content": system}]),
                    "{path}"
                );
                assert_eq!(
                    input,
                    json!([{"role": "user", "parts": [{"type": "text", "content": prompt}]}]),
                    "{path}: the history alone"
                );
            }
            None => {
                assert!(
                    attempt.attr("gen_ai.system_instructions").is_null(),
                    "{path}: {attempt:#?}"
                );
                assert_eq!(
                    input,
                    json!([
                        {"role": "system", "parts": [{"type": "text", "content": "answer in German"}]},
                        {"role": "user", "parts": [{"type": "text", "content": prompt}]},
                    ]),
                    "{path}"
                );
            }
        }
    }
    app.stop().await;
}

/// OT-3, OT-5: `gen_ai.response.finish_reasons` keeps the provider's word (the conventions
/// give it no vocabulary, and the word says more than a category: `stop_sequence`, `SAFETY`),
/// while each captured output message says its reason in the output schema's enumerated
/// values where one applies (`stop`, `length`, `content_filter`, `tool_call`, `error`), so a
/// consumer reading the messages sees one vocabulary across providers.
#[tokio::test]
async fn an_output_message_says_its_finish_reason_in_the_conventions_words_the_attribute_in_the_providers_ot3_ot5()
 {
    let receiver = Receiver::start().await;
    let app = spawn_app(MockConfig::default(), captured(&receiver)).await;
    let anthropic = json!({
        "model": "claude-3-5-haiku-latest",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "how did it end"}],
    });
    let calls = [
        ("/v1/messages", anthropic.to_string(), "end_turn"),
        (
            "/v1beta/models/gemini-2.5-flash:generateContent",
            gemini_body("how did it end"),
            "STOP",
        ),
        ("/v1/chat/completions", chat_body("how did it end"), "stop"),
    ];
    let mut ids = Vec::new();
    for (path, body, _) in &calls {
        let response = app
            .post(path, body.clone(), &[("anthropic-version", "2023-06-01")])
            .await;
        assert_eq!(response.status(), 200, "{path}");
        ids.push(header(&response, "holdfast-request-id"));
    }
    let spans = receiver
        .wait("the three attempts", |s| attempts(s).len() == 3)
        .await;
    for ((path, _, word), id) in calls.iter().zip(&ids) {
        let attempt = attempt_of(&spans, id);
        assert_eq!(
            attempt.attr("gen_ai.response.finish_reasons"),
            &json!([word]),
            "{path}: the provider's word"
        );
        let output = json_attr(attempt, "gen_ai.output.messages");
        assert_eq!(output[0]["finish_reason"], "stop", "{path}: {output}");
    }
    app.stop().await;
}

/// OT-3: the attributes the conventions ask of an OpenAI call that the request says:
/// `openai.api.type` (`chat_completions`, `responses`), `openai.request.service_tier` when one
/// other than `auto` is asked for, and `gen_ai.conversation.id` for a Responses call that
/// continues a conversation the provider stores.
#[tokio::test]
async fn an_openai_attempt_span_says_its_api_service_tier_and_conversation_ot3() {
    let receiver = Receiver::start().await;
    let app = spawn_app(MockConfig::default(), traced(&receiver)).await;
    let chat = json!({
        "model": "gpt-4o-mini",
        "service_tier": "flex",
        "messages": [{"role": "user", "content": "which tier"}],
    });
    let responses = json!({
        "model": "gpt-4o-mini",
        "conversation": "conv_689667905b048191b4740501625afd940c7533ace33a2dab",
        "service_tier": "auto",
        "input": "which conversation",
    });
    let mut ids = Vec::new();
    for (path, body) in [("/v1/chat/completions", chat), ("/v1/responses", responses)] {
        let response = app.post(path, body.to_string(), &[]).await;
        assert_eq!(response.status(), 200, "{path}");
        ids.push(header(&response, "holdfast-request-id"));
    }
    let spans = receiver
        .wait("the two attempts", |s| attempts(s).len() == 2)
        .await;
    let chat = attempt_of(&spans, &ids[0]);
    assert_eq!(
        chat.attr("openai.api.type"),
        "chat_completions",
        "{chat:#?}"
    );
    assert_eq!(chat.attr("openai.request.service_tier"), "flex");
    assert!(chat.attr("gen_ai.conversation.id").is_null());
    let responses = attempt_of(&spans, &ids[1]);
    assert_eq!(responses.attr("openai.api.type"), "responses");
    assert!(
        responses.attr("openai.request.service_tier").is_null(),
        "`auto` is not said: {responses:#?}"
    );
    assert_eq!(
        responses.attr("gen_ai.conversation.id"),
        "conv_689667905b048191b4740501625afd940c7533ace33a2dab"
    );
    app.stop().await;
}

/// OT-3: a provider that answers 200 and then fails its stream before anything is stored (an
/// error event, as Anthropic's `overloaded_error` or Google's quota chunk) is tried again; its
/// attempt span's `error.type` is `transient`, never `200`: a 2xx is the status of an answer
/// that began, not the class of the failure, and a dashboard grouping errors by type counted
/// these under a success code.
#[tokio::test]
async fn a_retried_stream_that_failed_after_its_200_says_transient_not_200_ot3() {
    let receiver = Receiver::start().await;
    let provider = RawProvider::start(raw_200(
        "text/event-stream",
        "data: {\"error\":{\"message\":\"overloaded\",\"type\":\"server_error\"}}\n\n",
        false,
    ))
    .await;
    let url = provider.base_url();
    let app = spawn_app(MockConfig::default(), |c| {
        use_backend_url(c, &url);
        c.workers.max_attempts = 2;
        traced(&receiver)(c);
    })
    .await;
    let body = json!({
        "model": "gpt-4o-mini",
        "stream": true,
        "messages": [{"role": "user", "content": "fail after the 200"}],
    });
    let response = app.chat(&body.to_string()).await;
    let id = header(&response, "holdfast-request-id");
    let _ = response.bytes().await;
    let spans = receiver
        .wait("two attempts", |s| attempts(s).len() == 2)
        .await;
    let mut tried = attempts(&spans);
    tried.retain(|s| s.attr("holdfast.request_id") == id.as_str());
    tried.sort_by_key(|s| s.attr("holdfast.attempt").as_i64());
    assert_eq!(tried.len(), 2, "{spans:#?}");
    assert_eq!(tried[0].attr("error.type"), "transient", "{:#?}", tried[0]);
    assert_eq!(
        tried[0].attr("holdfast.status"),
        200,
        "the status stays said"
    );
    assert_eq!(tried[1].attr("error.type"), "attempts_exhausted");
    assert_eq!(provider.calls(), 2);
    app.stop().await;
}
