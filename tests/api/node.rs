//! Real JavaScript clients against holdfast (tests/clients/*.mjs): the official OpenAI and
//! Anthropic Node SDKs, @google/genai and the Vercel AI SDK (with its OpenAI and Anthropic
//! providers) on the proxied routes, and a WHATWG-faithful `EventSource` on the log stream. All
//! need `npm ci --prefix tests/clients` (`scripts/test` runs it); without it they fail, naming
//! what is missing (`HOLDFAST_TEST_SKIP=node` opts out of them).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use holdfast::config::ModelRewrite;
use holdfast::mock::MockConfig;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout};

use crate::helpers::*;

/// `tests/clients`, where the drivers and their `node_modules` live.
fn clients_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/clients")
}

/// Fails the calling test unless `node` runs and the npm package `pkg` is installed under
/// `tests/clients`.
#[track_caller]
fn require_node(pkg: &str) {
    let version = Command::new("node")
        .arg("--version")
        .stderr(Stdio::null())
        .output();
    match version {
        Ok(out) if out.status.success() => {}
        Ok(out) => missing_dependency(
            "node",
            &format!("`node --version` failed ({})", out.status),
            "install Node.js 20 or later (Debian: apt-get install nodejs npm)",
        ),
        Err(e) => missing_dependency(
            "node",
            &format!("`node` is not on PATH ({e})"),
            "install Node.js 20 or later (Debian: apt-get install nodejs npm)",
        ),
    }
    let manifest = clients_dir()
        .join("node_modules")
        .join(pkg)
        .join("package.json");
    if !manifest.is_file() {
        missing_dependency(
            "node",
            &format!(
                "npm package `{pkg}` is not installed ({} is missing)",
                manifest.display()
            ),
            "npm ci --prefix tests/clients",
        );
    }
}

/// Runs `node tests/clients/SCRIPT ARGS` with `env` and parses the JSON object it prints; panics
/// with its stderr when it fails.
async fn run_node(script: &str, args: &[&str], env: &[(&str, &str)]) -> Value {
    let mut cmd = tokio::process::Command::new("node");
    cmd.arg(clients_dir().join(script))
        .args(args)
        .kill_on_drop(true);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = tokio::time::timeout(Duration::from_secs(60), cmd.output())
        .await
        .unwrap_or_else(|_| panic!("{script} {args:?} ran over 60 s"))
        .expect("run node");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{script} {args:?} failed ({}):\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{script} printed {stdout}: {e}"))
}

/// Runs `python tests/clients/SCRIPT` ([`python()`]) off the runtime and parses the JSON object
/// it prints.
async fn python_json(script: &'static str, env: Vec<(&'static str, String)>) -> Value {
    let out = tokio::task::spawn_blocking(move || {
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        run_python(script, &env)
    })
    .await
    .expect("python driver");
    serde_json::from_str(out.trim()).expect("driver prints JSON")
}

/// Runs the openai-node driver in `mode` against `app`.
async fn openai_node(app: &TestApp, mode: &str, env: &[(&str, &str)]) -> Value {
    let mut env = env.to_vec();
    env.push(("HOLDFAST_URL", &app.base));
    run_node("openai_node.mjs", &[mode], &env).await
}

/// `tests/clients/eventsource.mjs`, loaded and waiting for a request id on stdin, so the
/// `EventSource` opens within milliseconds of [`EventSourceReader::open`].
struct EventSourceReader {
    child: Child,
    stdout: Lines<BufReader<ChildStdout>>,
}

impl EventSourceReader {
    /// Starts the driver for `{base}/requests/{id}{query}` with `env` and waits until it is
    /// loaded.
    async fn start(base: &str, query: &str, env: &[(&str, &str)]) -> Self {
        let mut child = tokio::process::Command::new("node")
            .arg(clients_dir().join("eventsource.mjs"))
            .args([base, query])
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn node");
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let ready = tokio::time::timeout(Duration::from_secs(30), stdout.next_line())
            .await
            .expect("eventsource.mjs loads")
            .expect("read stdout");
        assert_eq!(ready.as_deref(), Some("ready"));
        EventSourceReader { child, stdout }
    }

    /// Opens the `EventSource` on request `id`.
    async fn open(&mut self, id: &str) {
        let mut stdin = self.child.stdin.take().expect("stdin");
        stdin
            .write_all(format!("{id}\n").as_bytes())
            .await
            .expect("write id");
    }

    /// Waits for the driver's report (see eventsource.mjs).
    async fn report(mut self) -> Value {
        let line = tokio::time::timeout(Duration::from_secs(60), self.stdout.next_line())
            .await
            .expect("eventsource.mjs reports within 60 s")
            .expect("read stdout")
            .expect("a report line");
        let status = self.child.wait().await.expect("wait node");
        assert!(status.success(), "eventsource.mjs exited {status}");
        serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("eventsource.mjs printed {line}: {e}"))
    }
}

/// The stored log of request `id` from seq 1 as `(seq, event type, data)`, the type as an
/// `EventSource` dispatches it (`message` when the chunk has no `event:` name).
async fn stored_log(app: &TestApp, id: &str) -> Vec<(String, String, String)> {
    let r = get_events(&app.http, &app.base, id, Some("0")).await;
    assert_eq!(r.status(), 200);
    let (_, events) = read_events(r).await;
    events
        .into_iter()
        .map(|e| {
            (
                e.id.unwrap_or_default(),
                e.event.unwrap_or_else(|| "message".into()),
                e.data,
            )
        })
        .collect()
}

/// The events an `EventSource` received, in the shape of [`stored_log`].
fn received(report: &Value) -> Vec<(String, String, String)> {
    report["events"]
        .as_array()
        .expect("events")
        .iter()
        .map(|e| {
            (
                e["last_event_id"].as_str().unwrap().to_string(),
                e["type"].as_str().unwrap().to_string(),
                e["data"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// RD-5 as a browser sees it: `streams` connections answered 200 (each break made
/// `EventSource` fire `error` and reconnect), the server closed the last one after `end`; then
/// one reconnect with `Last-Event-ID` = the `end` seq got 204, fired `error`, and `EventSource`
/// stayed `CLOSED` for good.
fn assert_stops_after_end_with_204(report: &Value, streams: usize, last_seq: i64) {
    assert_eq!(report["timed_out"], false, "{report}");
    let fetches = report["fetches"].as_array().unwrap();
    assert_eq!(
        fetches.len(),
        streams + 1,
        "{streams} streams, one reconnect after end, then nothing: {report}"
    );
    for fetch in &fetches[..streams] {
        assert_eq!(fetch["status"], 200, "{report}");
        assert_eq!(fetch["accept"], "text/event-stream");
    }
    let last = &fetches[streams];
    assert_eq!(
        last["last_event_id"],
        last_seq.to_string(),
        "the reconnect carries the end seq: {report}"
    );
    assert_eq!(last["status"], 204, "RD-5: {report}");
    let errors = report["errors"].as_array().unwrap();
    assert_eq!(errors.len(), streams + 1, "{report}");
    for error in &errors[..streams] {
        assert_eq!(error["ready_state"], 0, "a closed stream: CONNECTING again");
    }
    assert_eq!(errors[streams]["ready_state"], 2, "after 204: CLOSED");
    assert_eq!(errors[streams]["code"], 204);
    assert_eq!(
        report["ready_state"], 2,
        "still CLOSED after the quiet wait"
    );
    assert_eq!(report["opens"], streams);
}

// ---------------------------------------------------------------------------------------------
// openai-node on the proxied routes

#[tokio::test]
async fn openai_node_repeat_create_replays_the_stored_answer_rs3_rs5() {
    require_node("openai");
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    let out = openai_node(&app, "create", &[]).await;
    let calls = out["calls"].as_array().unwrap();
    assert_eq!(calls[0]["status"], 200, "{out}");
    assert!(
        calls[0]["content"]
            .as_str()
            .unwrap()
            .starts_with("mock reply to gpt-4o-mini:"),
        "{out}"
    );
    assert_eq!(calls[0]["replayed"], "false", "{out}");
    assert_eq!(calls[1]["replayed"], "true", "RS-5: {out}");
    assert_eq!(calls[1]["request_id"], calls[0]["request_id"]);
    assert_eq!(calls[1]["content"], calls[0]["content"], "RS-3");
    assert!(
        calls[1]["upstream_request_id"]
            .as_str()
            .unwrap()
            .starts_with("req_mock_"),
        "RS-5: the provider's request id of the execution: {out}"
    );
    assert_eq!(
        out["idempotency_keys"],
        serde_json::json!([null, null]),
        "openai-node sends no Idempotency-Key, so identity is the body hash (ID-4)"
    );
    assert_eq!(app.mock.calls(), 1, "the repeat did not call the provider");
    app.stop().await;
}

#[tokio::test]
async fn openai_node_stream_reassembles_the_text_and_a_repeat_replays_rs3_rs4() {
    require_node("openai");
    // Keep-alive comments between slow chunks must not confuse the SDK's SSE decoder.
    let app = spawn_app(
        MockConfig {
            chunks: 6,
            chunk_delay_ms: 60,
            ..MockConfig::default()
        },
        |c| c.sse_keepalive_ms = 25,
    )
    .await;
    let out = openai_node(&app, "stream", &[]).await;
    let non_stream = out["non_stream"].as_str().unwrap();
    assert!(
        non_stream.starts_with("mock reply to gpt-4o-mini:"),
        "{out}"
    );
    let streams = out["streams"].as_array().unwrap();
    assert_eq!(
        streams[0]["text"], non_stream,
        "the stream's pieces reassemble the text: {out}"
    );
    assert_eq!(streams[0]["replayed"], "false");
    assert_eq!(streams[1]["text"], streams[0]["text"], "RS-3");
    assert_eq!(streams[1]["chunks"], streams[0]["chunks"]);
    assert_eq!(streams[1]["replayed"], "true");
    assert_eq!(streams[1]["request_id"], streams[0]["request_id"]);
    assert_eq!(
        app.mock.calls(),
        2,
        "one non-stream and one stream execution; the repeat replayed"
    );
    app.stop().await;
}

#[tokio::test]
async fn openai_node_timeout_retries_attach_to_the_first_execution_rs2() {
    require_node("openai");
    // The provider answers after 3 s; the SDK gives up after 1 s and retries the same body.
    let app = spawn_app(
        MockConfig {
            header_delay_ms: 3_000,
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    let out = openai_node(&app, "timeout", &[]).await;
    assert!(
        out["content"]
            .as_str()
            .unwrap()
            .starts_with("mock reply to gpt-4o-mini:"),
        "{out}"
    );
    assert!(
        out["timeouts"].as_u64().unwrap() >= 1,
        "the SDK did time out: {out}"
    );
    assert_eq!(
        out["attempts"].as_u64().unwrap(),
        out["timeouts"].as_u64().unwrap() + 1,
        "every try but the last timed out: {out}"
    );
    assert_eq!(
        out["response"]["replayed"], "true",
        "the answering try did not start the execution: {out}"
    );
    let bodies = out["bodies"].as_array().unwrap();
    assert!(
        bodies.iter().all(|b| *b == bodies[0]),
        "every retry sent the same bytes: {out}"
    );
    assert_eq!(
        app.mock.calls(),
        1,
        "the SDK's retries attached to one execution"
    );
    app.stop().await;
}

#[tokio::test]
async fn openai_node_raises_api_error_when_the_provider_drops_mid_stream_lc7() {
    require_node("openai");
    let app = spawn_app(
        MockConfig {
            chunks: 20,
            drop_after_chunks: Some(5),
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    let out = openai_node(&app, "broken", &[]).await;
    assert_eq!(
        out["raised"], "APIError",
        "RS-4: an error in the provider's stream shape: {out}"
    );
    assert!(out["message"].as_str().unwrap().contains("stream"), "{out}");
    assert!(
        out["text"].as_str().unwrap().starts_with("mock reply"),
        "the chunks before the break arrived: {out}"
    );
    app.stop().await;
}

#[tokio::test]
async fn openai_node_stream_abandoned_mid_way_and_sent_again_gets_the_whole_text_rs2_lc9() {
    require_node("openai");
    let app = spawn_app(
        MockConfig {
            chunks: 20,
            chunk_delay_ms: 50,
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    let out = openai_node(&app, "abort", &[]).await;
    let streams = out["streams"].as_array().unwrap();
    let (partial, whole) = (
        streams[0]["text"].as_str().unwrap(),
        streams[1]["text"].as_str().unwrap(),
    );
    assert!(
        whole.starts_with(partial) && whole.len() > partial.len(),
        "{out}"
    );
    assert_eq!(whole, out["non_stream"], "the whole text, no gap: {out}");
    assert_eq!(streams[1]["request_id"], streams[0]["request_id"]);
    assert_eq!(streams[1]["replayed"], "true", "{out}");
    let id = streams[0]["request_id"].as_str().unwrap();
    let record = app.record(id).await;
    assert_eq!(
        record["status"], "succeeded",
        "LC-9: the drop cancelled nothing"
    );
    assert_eq!(record["attempts"], 1);
    assert_eq!(
        app.mock.calls(),
        2,
        "one stream execution, one non-stream call"
    );
    app.stop().await;
}

#[tokio::test]
async fn openai_node_responses_api_streams_named_events_and_replays_them_rs3_rs4() {
    require_node("openai");
    let app = spawn_app(
        MockConfig {
            chunks: 5,
            chunk_delay_ms: 20,
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    let out = openai_node(&app, "responses", &[]).await;
    let non_stream = out["non_stream"].as_str().unwrap();
    assert!(
        non_stream.starts_with("mock reply to gpt-4o-mini:"),
        "{out}"
    );
    let streams = out["streams"].as_array().unwrap();
    assert_eq!(streams[0]["text"], non_stream, "{out}");
    assert_eq!(
        streams[0]["types"].as_array().unwrap().last().unwrap(),
        "response.completed",
        "RS-4: the provider's named events reach the SDK: {out}"
    );
    assert_eq!(streams[1]["types"], streams[0]["types"], "RS-3");
    assert_eq!(streams[1]["text"], streams[0]["text"]);
    assert_eq!(streams[1]["replayed"], "true");
    assert_eq!(
        out["helper"], non_stream,
        "responses.stream() helper: {out}"
    );
    assert_eq!(
        app.mock.calls(),
        2,
        "one non-stream and one stream execution; the rest replayed"
    );
    app.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Identity across SDKs (ID-1)
//
// openai-python writes its body with `json.dumps` in its own key order (messages, model,
// temperature); openai-node writes `JSON.stringify` of the caller's object in the caller's key
// order. Key order never matters: canonical JSON sorts keys. Numbers are another matter: ID-1
// keeps them exactly as spelled, and the two languages spell the float 1.0 differently —
// Python's `json.dumps(1.0)` is `1.0`, JavaScript's `JSON.stringify(1.0)` is `1` (JS has no
// separate float type). So `temperature=1.0` in Python and `temperature: 1` in JS are two
// different requests, and each pays for its own upstream call. Python's int `1` (or no
// temperature at all) matches JS exactly. This is SPEC behaviour, not a bug: a proxy that
// re-spelled numbers would have to decide that `1.0` == `1` for every provider, and would break
// ID-3b's promise to forward the client's bytes; users who mix SDKs should pass integral values
// as ints in Python.

#[tokio::test]
async fn python_and_node_openai_calls_with_the_same_numbers_are_one_request_id1() {
    require_python(&["openai"]);
    require_node("openai");
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    let base_v1 = format!("{}/v1", app.base);
    for temperature in ["1", "none"] {
        let py = python_json(
            "openai_identity.py",
            vec![
                ("HOLDFAST_BASE_URL", base_v1.clone()),
                ("HOLDFAST_TEMPERATURE", temperature.into()),
            ],
        )
        .await;
        let js = openai_node(&app, "identity", &[("HOLDFAST_TEMPERATURE", temperature)]).await;
        let (py_body, js_body) = (
            py["bodies"][0].as_str().unwrap(),
            js["bodies"][0].as_str().unwrap(),
        );
        assert_ne!(
            py_body, js_body,
            "the SDKs' bytes differ (key order), temperature {temperature}"
        );
        let (py_json, js_json): (Value, Value) = (
            serde_json::from_str(py_body).unwrap(),
            serde_json::from_str(js_body).unwrap(),
        );
        assert_eq!(py_json, js_json, "same logical request");
        if temperature == "1" {
            assert!(
                py_body.contains(r#""temperature":1,"#) || py_body.ends_with(r#""temperature":1}"#),
                "{py_body}"
            );
        }
        assert_eq!(py["response"]["replayed"], "false", "{py}");
        assert_eq!(
            js["response"]["request_id"], py["response"]["request_id"],
            "ID-1: key order is irrelevant (temperature {temperature}): {py} {js}"
        );
        assert_eq!(js["response"]["replayed"], "true", "{js}");
        assert_eq!(js["content"], py["content"]);
    }
    assert_eq!(app.mock.calls(), 2, "one upstream call per logical request");
    app.stop().await;
}

#[tokio::test]
async fn python_float_1_0_and_node_1_are_two_requests_numbers_kept_as_spelled_id1() {
    require_python(&["openai"]);
    require_node("openai");
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    let py = python_json(
        "openai_identity.py",
        vec![
            ("HOLDFAST_BASE_URL", format!("{}/v1", app.base)),
            ("HOLDFAST_TEMPERATURE", "1.0".into()),
        ],
    )
    .await;
    let js = openai_node(&app, "identity", &[("HOLDFAST_TEMPERATURE", "1.0")]).await;
    let (py_body, js_body) = (
        py["bodies"][0].as_str().unwrap(),
        js["bodies"][0].as_str().unwrap(),
    );
    assert!(py_body.contains(r#""temperature":1.0"#), "{py_body}");
    assert!(
        js_body.contains(r#""temperature":1,"#),
        "JSON.stringify(1.0) is 1: {js_body}"
    );
    assert_ne!(
        js["response"]["request_id"], py["response"]["request_id"],
        "ID-1: `1.0` and `1` are different values: {py} {js}"
    );
    assert_eq!(py["response"]["replayed"], "false");
    assert_eq!(js["response"]["replayed"], "false");
    assert_eq!(app.mock.calls(), 2, "two requests, two upstream calls");
    let temperatures: Vec<String> = app
        .mock
        .recorded()
        .iter()
        .map(|c| c.body["temperature"].to_string())
        .collect();
    assert_eq!(
        temperatures,
        ["1.0", "1"],
        "ID-3b: each provider call got its client's spelling"
    );
    app.stop().await;
}

// ---------------------------------------------------------------------------------------------
// A WHATWG EventSource on `GET /requests/{id}` (RD-2..RD-6)

#[tokio::test]
async fn eventsource_reads_a_finished_stream_then_stops_for_good_on_204_rd2_rd5() {
    require_node("eventsource");
    let app = spawn_app(
        MockConfig {
            chunks: 6,
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    let r = app.chat(&stream_body("read me back")).await;
    let id = header(&r, "holdfast-request-id");
    read_events(r).await;
    let last_seq = app.record(&id).await["last_seq"].as_i64().unwrap();

    let mut reader = EventSourceReader::start(&app.base, "", &[]).await;
    reader.open(&id).await;
    let report = reader.report().await;

    let got = received(&report);
    let stored = stored_log(&app, &id).await;
    assert_eq!(got, stored, "every stored event, in order: {report}");
    let seqs: Vec<String> = got.iter().map(|(seq, _, _)| seq.clone()).collect();
    let expected: Vec<String> = (1..=last_seq).map(|s| s.to_string()).collect();
    assert_eq!(seqs, expected, "lastEventId = seq");
    let (_, kind, data) = got.last().unwrap();
    assert_eq!(kind, "end", "the named `end` event comes last");
    let end: Value = serde_json::from_str(data).unwrap();
    assert_eq!(end["status"], "succeeded");
    assert_eq!(got[got.len() - 2].2, "[DONE]");
    assert_stops_after_end_with_204(&report, 1, last_seq);
    app.stop().await;
}

#[tokio::test]
async fn eventsource_opened_on_a_running_stream_gets_every_chunk_once_rd4() {
    require_node("eventsource");
    let app = spawn_app(
        MockConfig {
            chunks: 50,
            chunk_delay_ms: 20,
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    let mut reader = EventSourceReader::start(&app.base, "", &[]).await;
    let submitter = app.chat(&stream_body("follow me live")).await;
    let id = header(&submitter, "holdfast-request-id");
    reader.open(&id).await;
    let (report, (_, submitted)) = tokio::join!(reader.report(), read_events(submitter));
    assert_eq!(
        report["open_record"]["status"], "running",
        "the EventSource opened while the stream ran: {report}"
    );
    let open_seq = report["open_record"]["last_seq"].as_i64().unwrap();
    let last_seq = app.record(&id).await["last_seq"].as_i64().unwrap();
    assert!(
        open_seq < last_seq - 10,
        "most chunks arrived live ({open_seq} of {last_seq} stored at open)"
    );

    let got = received(&report);
    let stored = stored_log(&app, &id).await;
    assert_eq!(got, stored, "RD-4: no gap, no duplicate: {report}");
    assert_eq!(
        got.len() as i64,
        last_seq,
        "seq 1..={last_seq}, each exactly once"
    );
    let data: Vec<&str> = got
        .iter()
        .filter(|(_, kind, _)| kind == "message")
        .map(|(_, _, d)| d.as_str())
        .collect();
    let proxied: Vec<&str> = submitted.iter().map(|e| e.data.as_str()).collect();
    assert_eq!(data, proxied, "the log carries the submitter's events");
    assert_stops_after_end_with_204(&report, 1, last_seq);
    assert_eq!(app.mock.calls(), 1);
    app.stop().await;
}

#[tokio::test]
async fn eventsource_first_connect_resumes_from_the_last_event_id_query_parameter_rd3() {
    require_node("eventsource");
    let app = spawn_app(
        MockConfig {
            chunks: 6,
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    let r = app.chat(&stream_body("resume me in a browser")).await;
    let id = header(&r, "holdfast-request-id");
    read_events(r).await;
    let last_seq = app.record(&id).await["last_seq"].as_i64().unwrap();

    // The query parameter stays in the URL on the reconnect; the header must win then (RD-3),
    // or the browser would replay from 3 forever.
    let mut reader = EventSourceReader::start(&app.base, "?last_event_id=3", &[]).await;
    reader.open(&id).await;
    let report = reader.report().await;
    assert_eq!(report["fetches"][0]["last_event_id"], Value::Null);
    let got = received(&report);
    let stored = stored_log(&app, &id).await;
    assert_eq!(got, stored[3..], "exactly the chunks after seq 3: {report}");
    assert_eq!(got.last().unwrap().1, "end");
    assert_stops_after_end_with_204(&report, 1, last_seq);
    app.stop().await;
}

#[tokio::test]
async fn eventsource_gets_a_failed_end_after_an_interrupted_stream_then_stops_rd5_lc7() {
    require_node("eventsource");
    let app = spawn_app(
        MockConfig {
            chunks: 20,
            drop_after_chunks: Some(5),
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    let r = app.chat(&stream_body("break me")).await;
    let id = header(&r, "holdfast-request-id");
    read_events(r).await;
    let record = wait_terminal(&app.http, &app.base, &id, Duration::from_secs(10)).await;
    assert_eq!(record["status"], "failed");
    let last_seq = record["last_seq"].as_i64().unwrap();

    let mut reader = EventSourceReader::start(&app.base, "", &[]).await;
    reader.open(&id).await;
    let report = reader.report().await;
    let got = received(&report);
    assert_eq!(got, stored_log(&app, &id).await, "{report}");
    let (_, kind, data) = got.last().unwrap();
    assert_eq!(kind, "end");
    let end: Value = serde_json::from_str(data).unwrap();
    assert_eq!(end["status"], "failed", "{end}");
    assert_eq!(end["error"]["type"], "stream_interrupted", "{end}");
    assert_stops_after_end_with_204(&report, 1, last_seq);
    app.stop().await;
}

/// A browser whose connection dies part-way into an event (mid-frame): the partial event is
/// dropped, `EventSource` reconnects with the last complete event's id, and holdfast continues
/// from there — across the stored/live handoff, since the stream is still running.
#[tokio::test]
async fn eventsource_dropped_mid_event_resumes_from_last_event_id_without_gap_or_duplicate_rd3_rd4()
{
    require_node("eventsource");
    let app = spawn_app(
        MockConfig {
            chunks: 80,
            chunk_delay_ms: 25,
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    let mut reader =
        EventSourceReader::start(&app.base, "", &[("HOLDFAST_DROP_AFTER_EVENTS", "5")]).await;
    let submitter = app.chat(&stream_body("drop my browser")).await;
    let id = header(&submitter, "holdfast-request-id");
    reader.open(&id).await;
    let (report, (_, submitted)) = tokio::join!(reader.report(), read_events(submitter));
    let last_seq = app.record(&id).await["last_seq"].as_i64().unwrap();
    let fetches = report["fetches"].as_array().unwrap();
    assert_eq!(
        fetches[1]["last_event_id"], "5",
        "the reconnect resumes after the last complete event: {report}"
    );
    let resumed_at = fetches[1]["at_ms"].as_i64().unwrap();
    let end_at = report["events"].as_array().unwrap().last().unwrap()["at_ms"]
        .as_i64()
        .unwrap();
    assert!(
        end_at > resumed_at + 100,
        "the resumed connection went on live ({resumed_at} ms vs end at {end_at} ms): {report}"
    );
    let got = received(&report);
    assert_eq!(
        got,
        stored_log(&app, &id).await,
        "RD-3/RD-4: no gap, no duplicate: {report}"
    );
    let data: Vec<&str> = got
        .iter()
        .filter(|(_, kind, _)| kind == "message")
        .map(|(_, _, d)| d.as_str())
        .collect();
    let proxied: Vec<&str> = submitted.iter().map(|e| e.data.as_str()).collect();
    assert_eq!(data, proxied);
    assert_stops_after_end_with_204(&report, 2, last_seq);
    assert_eq!(app.mock.calls(), 1);
    app.stop().await;
}

/// Issue 14 with openai-node: `models.list()` lists the backends' models and nothing is
/// recorded; a Responses stream dropped after `sequence_number` 10 resumes from the log with
/// `responses.retrieve(id, {stream, starting_after: 10})` and with the `responses.stream`
/// helper — the remaining events, consecutive numbers, the uninterrupted text, one upstream call.
#[tokio::test]
async fn openai_node_lists_models_and_resumes_a_responses_stream_from_the_log_rd3() {
    require_node("openai");
    let app = spawn_app(MockConfig::default(), |c| {
        c.model_rewrites = vec![
            ModelRewrite {
                pattern: "fast".into(),
                backend: "mock-openai".into(),
                model: Some("mock-small".into()),
            },
            // A pattern is no model id: not listed.
            ModelRewrite {
                pattern: "gpt-*".into(),
                backend: "mock-openai".into(),
                model: None,
            },
        ];
    })
    .await;
    let out = run_node(
        "responses_resume.mjs",
        &["models"],
        &[("HOLDFAST_URL", &app.base)],
    )
    .await;
    assert_eq!(
        out["ids"],
        serde_json::json!(["mock-small", "mock-large", "gpt-4o-mini", "fast"]),
        "the backend's models, then the exact alias"
    );
    assert_eq!(app.mock.calls(), 0);
    assert!(
        records(&app).await.is_empty(),
        "the models call is not recorded"
    );
    app.stop().await;
    for mode in ["retrieve", "helper"] {
        let app = spawn_app(
            MockConfig {
                chunks: 30,
                chunk_delay_ms: 60,
                ..MockConfig::default()
            },
            |_| {},
        )
        .await;
        let out = run_node(
            "responses_resume.mjs",
            &[mode],
            &[("HOLDFAST_URL", &app.base)],
        )
        .await;
        let before = out["before"].as_array().unwrap();
        let after = out["after"].as_array().unwrap();
        let seqs: Vec<i64> = before
            .iter()
            .chain(after)
            .map(|e| e["sequence_number"].as_i64().unwrap())
            .collect();
        assert_eq!(
            seqs,
            (0..seqs.len() as i64).collect::<Vec<_>>(),
            "{mode}: {out}"
        );
        assert_eq!(
            after.first().unwrap()["sequence_number"],
            11,
            "{mode}: {out}"
        );
        assert_eq!(
            after.last().unwrap()["type"],
            "response.completed",
            "{mode}: {out}"
        );
        let text: String = before
            .iter()
            .chain(after)
            .filter_map(|e| e["delta"].as_str())
            .collect();
        assert_eq!(text, out["final_text"].as_str().unwrap(), "{mode}: {out}");
        assert_eq!(app.mock.calls(), 1, "{mode}: one upstream call");
        app.stop().await;
    }
}

/// The Vercel AI SDK's `streamText` (default provider call: the Responses API) aborted by its
/// timeout against a slower provider, then called again as an application retries: the retry
/// attaches to the first execution and gets its text; one upstream call.
#[tokio::test]
async fn vercel_ai_sdk_stream_text_retried_after_its_timeout_makes_one_upstream_call() {
    require_node("ai");
    require_node("@ai-sdk/openai");
    let app = spawn_app(
        MockConfig {
            header_delay_ms: 2_000,
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    let out = run_node(
        "responses_resume.mjs",
        &["aisdk"],
        &[("HOLDFAST_URL", &app.base)],
    )
    .await;
    // The first call was cut by its own timeout (1 s), before the provider's answer (2 s).
    assert_eq!(out["first"]["text"], "", "the first call timed out: {out}");
    assert_eq!(out["first"]["aborted"], true, "its signal fired: {out}");
    assert_eq!(out["first"]["abort_reason"], "TimeoutError", "{out}");
    assert!(
        out["first"]["elapsed_ms"].as_u64().unwrap() < 2_000,
        "it ended at its timeout, not at the provider's answer: {out}"
    );
    assert_eq!(out["second"]["aborted"], false, "{out}");
    assert!(
        out["second"]["text"]
            .as_str()
            .unwrap()
            .starts_with("mock reply"),
        "{out}"
    );
    assert_eq!(app.mock.calls(), 1, "one upstream call: {out}");
    // Both calls were answered by the one request: the timed-out first, and the retry.
    let all = records(&app).await;
    assert_eq!(all.len(), 1, "one request: {all:?}");
    wait_deliveries_at_least(&app.base, all[0]["id"].as_str().unwrap(), 2).await;
    app.stop().await;
}

/// ID-6a with the Vercel AI SDK: it retries a 5xx whatever `x-should-retry` says. Its retry of
/// a request that failed (holdfast's two attempts, then 502) attaches to the failure within
/// the minute instead of paying for two more attempts.
#[tokio::test]
async fn vercel_ai_sdk_retrying_a_failed_request_makes_no_new_provider_call_id6a() {
    require_node("ai");
    require_node("@ai-sdk/openai");
    let app = spawn_always_failing_app().await;
    let out = run_node(
        "responses_resume.mjs",
        &["aisdk-failed"],
        &[("HOLDFAST_URL", &app.base)],
    )
    .await;
    assert_eq!(
        out["statuses"],
        serde_json::json!([502, 502]),
        "it tried twice and got the failure twice: {out}"
    );
    assert_eq!(app.mock.calls(), 2, "holdfast's two attempts only: {out}");
    let all = records(&app).await;
    assert_eq!(all.len(), 1, "one request: {all:?}");
    wait_deliveries_at_least(&app.base, all[0]["id"].as_str().unwrap(), 2).await;
    app.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Anthropic's Node SDK (@anthropic-ai/sdk) and the Vercel AI SDK's @ai-sdk/anthropic on
// /v1/messages

/// The model the Anthropic drivers ask for; the mock's reply names it.
const CLAUDE: &str = "claude-sonnet-4-5";

/// Runs the @anthropic-ai/sdk driver (tests/clients/anthropic_node.mjs) in `mode` against `app`.
async fn anthropic_node(app: &TestApp, mode: &str) -> Value {
    run_node(
        "anthropic_node.mjs",
        &[mode],
        &[("HOLDFAST_URL", &app.base)],
    )
    .await
}

/// The mock's reply text for [`CLAUDE`] starts so.
fn is_claude_reply(text: &Value) -> bool {
    text.as_str()
        .is_some_and(|t| t.starts_with(&format!("mock reply to {CLAUDE}: ")))
}

/// The event types @anthropic-ai/sdk yields for a complete mock stream of `chunks` pieces (it
/// consumes `ping` itself).
fn anthropic_stream_types(chunks: usize) -> Vec<String> {
    let mut types = vec!["message_start", "content_block_start"];
    types.extend(std::iter::repeat_n("content_block_delta", chunks));
    types.extend(["content_block_stop", "message_delta", "message_stop"]);
    types.into_iter().map(String::from).collect()
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap_or_else(|| panic!("an array: {v}"))
        .iter()
        .map(|s| {
            s.as_str()
                .unwrap_or_else(|| panic!("a string: {s}"))
                .to_string()
        })
        .collect()
}

/// RS-3, RS-5 with Anthropic's Node SDK: `messages.create` through holdfast gets the provider's
/// message (text, stop reason, usage) and its `request-id` (the SDK's `_request_id`); the same
/// call again is answered from the log with the same message, without a provider call; the log
/// holds one request, with the usage the SDK was told.
#[tokio::test]
async fn anthropic_node_repeat_messages_create_is_answered_from_the_log_rs3_rs5() {
    require_node("@anthropic-ai/sdk");
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    let out = anthropic_node(&app, "create").await;
    let calls = out["calls"].as_array().unwrap();
    let (first, second) = (&calls[0], &calls[1]);
    assert_eq!(first["status"], 200, "{out}");
    assert_eq!(first["type"], "message", "{out}");
    assert_eq!(first["role"], "assistant");
    assert_eq!(first["model"], CLAUDE);
    assert!(is_claude_reply(&first["text"]), "{out}");
    assert_eq!(first["stop_reason"], "end_turn");
    assert_eq!(
        first["usage"]["output_tokens"], 8,
        "the mock's 8 pieces: {out}"
    );
    assert!(
        first["usage"]["input_tokens"].as_u64().unwrap() >= 1,
        "{out}"
    );
    assert_eq!(first["replayed"], "false", "{out}");
    let upstream = first["upstream_request_id"].as_str().unwrap();
    assert!(upstream.starts_with("req_mock_"), "RS-5: {out}");
    assert_eq!(
        first["sdk_request_id"], upstream,
        "the SDK reads Anthropic's request-id: {out}"
    );

    assert_eq!(second["replayed"], "true", "RS-5: {out}");
    assert_eq!(second["request_id"], first["request_id"], "one request");
    assert_eq!(
        second["upstream_request_id"], upstream,
        "RS-5: the provider's request id of the execution: {out}"
    );
    for field in ["id", "text", "stop_reason", "usage", "model"] {
        assert_eq!(second[field], first[field], "RS-3: {field}: {out}");
    }
    assert_eq!(out["bodies"][0], out["bodies"][1], "the same bytes twice");
    assert_eq!(
        out["idempotency_keys"],
        serde_json::json!([null, null]),
        "@anthropic-ai/sdk sends no Idempotency-Key, so identity is the body hash (ID-4)"
    );
    assert_eq!(app.mock.calls(), 1, "the repeat did not call the provider");

    let recorded = app.mock.recorded();
    assert_eq!(recorded[0].path, "/v1/messages", "{recorded:?}");
    let sent = out["anthropic_versions"][0].as_str().unwrap();
    assert!(
        recorded[0]
            .headers
            .iter()
            .any(|(k, v)| k == "anthropic-version" && v == sent),
        "ID-3a: the SDK's anthropic-version {sent} went upstream: {:?}",
        recorded[0].headers
    );
    let list = records(&app).await;
    assert_eq!(list.len(), 1, "one request in the log: {list:?}");
    let id = list[0]["id"].as_str().unwrap();
    assert_eq!(id, first["request_id"]);
    let record = wait_deliveries_at_least(&app.base, id, 2).await;
    assert_eq!(record["route"], "anthropic.messages", "{record}");
    assert_eq!(record["status"], "succeeded", "{record}");
    assert_eq!(record["stream"], false, "{record}");
    assert_eq!(record["upstream_request_id"], upstream, "{record}");
    assert_eq!(
        record["usage"]["input_tokens"], first["usage"]["input_tokens"],
        "RD-9: the ledger counts what the SDK was told: {record}"
    );
    assert_eq!(
        record["usage"]["output_tokens"],
        first["usage"]["output_tokens"]
    );
    assert_eq!(
        record["response"]["body"]["content"][0]["text"], first["text"],
        "{record}"
    );
    app.stop().await;
}

/// RS-4, RS-3 with Anthropic's Node SDK: `messages.create({stream: true})` yields the provider's
/// events in order from `message_start` to `message_stop` (keep-alive comments between slow
/// events do not disturb its SSE decoder); the `messages.stream()` helper sending the same
/// request is answered from the log: one `text` event per piece in order, each snapshot the one
/// before plus its delta, `finalMessage()` the whole message, `end` after it, no error.
#[tokio::test]
async fn anthropic_node_stream_helper_and_raw_events_get_the_whole_answer_in_order_rs3_rs4() {
    require_node("@anthropic-ai/sdk");
    let app = spawn_app(
        MockConfig {
            chunks: 6,
            chunk_delay_ms: 60,
            ..MockConfig::default()
        },
        |c| c.sse_keepalive_ms = 25,
    )
    .await;
    let out = anthropic_node(&app, "stream").await;
    let non_stream = &out["non_stream"];
    assert!(is_claude_reply(&non_stream["text"]), "{out}");

    let raw = &out["raw"];
    assert!(raw["error"].is_null(), "{out}");
    assert_eq!(
        strings(&raw["types"]),
        anthropic_stream_types(6),
        "RS-4: every provider event in order, through message_stop: {out}"
    );
    assert_eq!(
        raw["text"], non_stream["text"],
        "the deltas reassemble the text: {out}"
    );
    assert_eq!(raw["replayed"], "false", "{out}");
    assert!(
        raw["upstream_request_id"]
            .as_str()
            .unwrap()
            .starts_with("req_mock_"),
        "RS-5: {out}"
    );

    let helper = &out["helper"];
    assert!(helper["error"].is_null(), "{out}");
    let deltas = strings(&helper["deltas"]);
    assert_eq!(deltas.len(), 6, "one text event per piece: {out}");
    assert_eq!(
        deltas.concat(),
        raw["text"].as_str().unwrap(),
        "in order: {out}"
    );
    assert_eq!(helper["snapshots_grow"], true, "{out}");
    assert_eq!(
        strings(&helper["lifecycle"]),
        ["connect", "message", "finalMessage", "end"],
        "ended cleanly: {out}"
    );
    let fin = &helper["final"];
    assert_eq!(fin["text"], raw["text"], "finalMessage(): {out}");
    assert_eq!(fin["stop_reason"], "end_turn");
    assert_eq!(fin["usage"]["output_tokens"], 6, "{out}");
    assert_eq!(
        fin["usage"]["input_tokens"],
        non_stream["usage"]["input_tokens"]
    );
    assert_eq!(
        helper["replayed"], "true",
        "RS-3: the helper's request is the raw stream's (key order and the helper's own \
         headers do not count, ID-1, ID-3a): {out}"
    );
    assert_eq!(helper["request_id"], raw["request_id"]);
    assert_eq!(
        helper["sdk_request_id"], raw["upstream_request_id"],
        "{out}"
    );

    assert_eq!(
        non_stream["replayed"], "false",
        "stream is part of the body"
    );
    assert_eq!(
        app.mock.calls(),
        2,
        "one stream execution and one non-stream; the helper replayed"
    );
    let id = raw["request_id"].as_str().unwrap();
    let record = app.record(id).await;
    assert_eq!(record["status"], "succeeded", "{record}");
    assert_eq!(record["stream"], true);
    assert_eq!(record["usage"]["output_tokens"], 6, "{record}");
    app.stop().await;
}

/// LC-7, RS-4 with Anthropic's Node SDK: a provider stream that does not reach `message_stop` —
/// cut mid-stream, ended cleanly after a few deltas, or missing only `message_stop` — ends with
/// holdfast's error event, so iterating `messages.create({stream: true})` throws `APIError` and
/// the `messages.stream()` helper rejects `finalMessage()` (its `error` event fires, no
/// `message`): the SDK never hands the truncated text over as a finished answer. Each send is its
/// own failed request (`stream_interrupted`), one provider call each.
#[tokio::test]
async fn anthropic_node_raises_when_the_provider_stream_does_not_finish_lc7_rs4() {
    require_node("@anthropic-ai/sdk");
    let cases = [
        (
            "connection cut after 3 deltas",
            MockConfig {
                drop_after_chunks: Some(3),
                ..MockConfig::default()
            },
        ),
        (
            "body ended cleanly after 3 deltas",
            MockConfig {
                end_after_chunks: Some(3),
                ..MockConfig::default()
            },
        ),
        (
            "every event but message_stop",
            MockConfig {
                omit_stream_end: true,
                ..MockConfig::default()
            },
        ),
    ];
    for (name, mock) in cases {
        let app = spawn_app(mock, |_| {}).await;
        let out = anthropic_node(&app, "broken").await;
        for (how, run) in [("raw events", &out["raw"]), ("helper", &out["helper"])] {
            let error = &run["error"];
            assert_eq!(
                error["api_error"], true,
                "{name}, {how}: the SDK raised its APIError: {out}"
            );
            assert_eq!(error["class"], "APIError", "{name}, {how}: {out}");
            assert_eq!(error["type"], "api_error", "RS-4: {name}, {how}: {out}");
        }
        let raw = &out["raw"];
        assert!(
            is_claude_reply(&raw["text"]),
            "{name}: the deltas before the end arrived: {out}"
        );
        let types = strings(&raw["types"]);
        assert_eq!(types[0], "message_start", "{name}: {out}");
        assert!(
            !types.iter().any(|t| t == "message_stop"),
            "{name}: no message_stop was made up: {out}"
        );
        let helper = &out["helper"];
        assert!(helper["final"].is_null(), "{name}: {out}");
        assert!(
            !strings(&helper["deltas"]).is_empty(),
            "{name}: text events came first: {out}"
        );
        assert_eq!(
            strings(&helper["lifecycle"]),
            ["connect", "error", "end"],
            "{name}: no message, no finalMessage: {out}"
        );
        assert_eq!(app.mock.calls(), 2, "{name}: one provider call per send");
        let list = records(&app).await;
        assert_eq!(list.len(), 2, "{name}: {list:?}");
        for record in &list {
            let id = record["id"].as_str().unwrap();
            let record = wait_terminal(&app.http, &app.base, id, Duration::from_secs(10)).await;
            assert_eq!(record["status"], "failed", "{name}: {record}");
            assert_eq!(
                record["error"]["type"], "stream_interrupted",
                "LC-7: {name}: {record}"
            );
            let message = record["error"]["message"].as_str().unwrap();
            for run in [raw, helper] {
                if run["request_id"] == record["id"] {
                    assert!(
                        run["error"]["message"].as_str().unwrap().contains(message),
                        "{name}: the SDK's error carries holdfast's message: {out} {record}"
                    );
                }
            }
        }
        app.stop().await;
    }
}

/// The Vercel AI SDK with `@ai-sdk/anthropic` (`createAnthropic({baseURL})`) on holdfast:
/// `generateText` gets the message's text, finish reason and usage, and the same call again is
/// answered from the log (RS-3, RS-5); `streamText` gets every piece in order and a clean
/// `stop` finish (RS-4), and its repeat replays the stored events.
#[tokio::test]
async fn vercel_ai_sdk_anthropic_generate_text_and_stream_text_through_holdfast_rs3_rs4() {
    require_node("ai");
    require_node("@ai-sdk/anthropic");
    let app = spawn_app(
        MockConfig {
            chunks: 5,
            chunk_delay_ms: 20,
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    let out = anthropic_node(&app, "aisdk").await;
    let generate = out["generate"].as_array().unwrap();
    let text = &generate[0]["text"];
    assert!(is_claude_reply(text), "{out}");
    assert_eq!(generate[0]["finish_reason"], "stop", "{out}");
    assert_eq!(generate[0]["replayed"], "false", "{out}");
    assert_eq!(generate[1]["replayed"], "true", "RS-5: {out}");
    assert_eq!(generate[1]["request_id"], generate[0]["request_id"]);
    assert_eq!(generate[1]["text"], *text, "RS-3: {out}");
    assert_eq!(generate[1]["usage"], generate[0]["usage"], "{out}");
    assert_eq!(generate[0]["usage"]["outputTokens"], 5, "{out}");
    let id = generate[0]["request_id"].as_str().unwrap();
    let record = wait_deliveries_at_least(&app.base, id, 2).await;
    assert_eq!(record["route"], "anthropic.messages", "{record}");
    assert_eq!(
        record["usage"]["input_tokens"], generate[0]["usage"]["inputTokens"],
        "RD-9: {record}"
    );

    let streams = out["streams"].as_array().unwrap();
    for (i, s) in streams.iter().enumerate() {
        assert!(s["error"].is_null(), "stream {i}: {out}");
        assert!(s["thrown"].is_null(), "stream {i}: {out}");
        assert_eq!(s["finish_reason"], "stop", "stream {i}: {out}");
        assert_eq!(
            s["text"], *text,
            "stream {i}: the pieces make the text: {out}"
        );
        assert_eq!(
            strings(&s["deltas"]).concat(),
            text.as_str().unwrap(),
            "stream {i}: in order: {out}"
        );
        assert_eq!(s["usage"]["outputTokens"], 5, "stream {i}: {out}");
    }
    assert_eq!(streams[0]["replayed"], "false", "{out}");
    assert_eq!(streams[1]["replayed"], "true", "RS-3: {out}");
    assert_eq!(streams[1]["request_id"], streams[0]["request_id"]);
    assert_eq!(streams[1]["deltas"], streams[0]["deltas"], "{out}");
    assert_eq!(
        app.mock.calls(),
        2,
        "one generate and one stream execution; the repeats replayed"
    );
    let recorded = app.mock.recorded();
    assert!(
        recorded.iter().all(|c| c.path == "/v1/messages"),
        "{recorded:?}"
    );
    app.stop().await;
}

/// LC-7 with the Vercel AI SDK's `@ai-sdk/anthropic`: `streamText` against a provider stream
/// cut mid-way gets holdfast's error event as an error (its `onError`, holdfast's message) and
/// finishes with `error`, not `stop`. (The AI SDK raises nothing here by design: `result.text`
/// resolves to the text so far, so an application must look at `onError` or `finishReason`.)
#[tokio::test]
async fn vercel_ai_sdk_anthropic_stream_text_reports_a_cut_stream_as_an_error_lc7() {
    require_node("ai");
    require_node("@ai-sdk/anthropic");
    let app = spawn_app(
        MockConfig {
            chunks: 8,
            drop_after_chunks: Some(3),
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    let out = anthropic_node(&app, "aisdk-broken").await;
    let s = &out["stream"];
    assert_eq!(
        s["error"]["type"], "api_error",
        "RS-4: onError got the error event: {out}"
    );
    assert_eq!(s["finish_reason"], "error", "not a finished answer: {out}");
    assert!(
        strings(&s["deltas"])
            .concat()
            .starts_with(&format!("mock reply to {CLAUDE}: ")),
        "the text before the cut arrived: {out}"
    );
    assert_eq!(app.mock.calls(), 1, "maxRetries: 0, one send");
    let list = records(&app).await;
    assert_eq!(list.len(), 1, "{list:?}");
    let id = list[0]["id"].as_str().unwrap();
    assert_eq!(s["request_id"], id, "{out}");
    let record = wait_terminal(&app.http, &app.base, id, Duration::from_secs(10)).await;
    assert_eq!(record["status"], "failed", "{record}");
    assert_eq!(
        record["error"]["type"], "stream_interrupted",
        "LC-7: {record}"
    );
    assert!(
        s["error"]["message"]
            .as_str()
            .unwrap()
            .contains(record["error"]["message"].as_str().unwrap()),
        "holdfast's message reached the caller: {out} {record}"
    );
    app.stop().await;
}

/// Runs the @google/genai driver in `mode` against `app`.
async fn gemini_node(app: &TestApp, mode: &str) -> Value {
    require_node("@google/genai");
    run_node("gemini_node.mjs", &[mode], &[("HOLDFAST_URL", &app.base)]).await
}

#[tokio::test]
async fn google_genai_node_generates_streams_counts_and_lists_through_holdfast_gm1_gm4() {
    // Blank-line keep-alives between slow chunks (RS-4) must not confuse the SDK either.
    let app = spawn_app(
        MockConfig {
            chunk_delay_ms: 60,
            ..MockConfig::default()
        },
        |c| c.sse_keepalive_ms = 25,
    )
    .await;
    let out = gemini_node(&app, "surface").await;
    let text = out["text"].as_str().unwrap();
    assert!(text.starts_with("mock reply"), "{out}");
    assert_eq!(out["again"], out["text"], "the re-send is the same answer");
    assert!(
        out["stream_text"]
            .as_str()
            .unwrap()
            .starts_with("mock reply"),
        "{out}"
    );
    assert!(out["total_tokens"].as_u64().unwrap() >= 1, "{out}");
    let models: Vec<&str> = out["models"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(models.contains(&"models/gemini-mock-small"), "{out}");
    assert_eq!(out["one_model"], "models/gemini-mock-small");
    assert_eq!(app.mock.calls(), 2, "the re-send was replayed: {out}");
    let routes: Vec<String> = records(&app)
        .await
        .iter()
        .filter_map(|r| r["route"].as_str().map(str::to_owned))
        .collect();
    assert!(
        routes.contains(&"gemini.v1beta.stream".to_string()),
        "@google/genai calls /v1beta: {routes:?}"
    );
    app.stop().await;
}

#[tokio::test]
async fn google_genai_node_retries_past_its_timeout_attach_to_one_provider_call_rs2() {
    let app = spawn_app(
        MockConfig {
            header_delay_ms: 2_500,
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    let out = gemini_node(&app, "retry").await;
    assert!(out["error"].is_null(), "the SDK call succeeded: {out}");
    assert!(out["text"].as_str().unwrap().starts_with("mock reply"));
    assert_eq!(
        app.mock.calls(),
        1,
        "one provider call for every SDK attempt"
    );
    let list = records(&app).await;
    assert_eq!(list.len(), 1);
    let id = list[0]["id"].as_str().unwrap().to_string();
    let record = wait_deliveries_at_least(&app.base, &id, 2).await;
    assert!(record["saved_calls"].as_u64().unwrap() >= 1, "{record}");
    app.stop().await;
}

#[tokio::test]
async fn google_genai_node_throws_when_the_provider_stream_is_cut_lc7_gm5() {
    let app = spawn_app(
        MockConfig {
            chunks: 6,
            drop_after_chunks: Some(3),
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    let out = gemini_node(&app, "cut").await;
    assert!(!out["error"].is_null(), "the SDK threw: {out}");
    assert!(
        out["error"]["message"].as_str().unwrap().contains("broke"),
        "{out}"
    );
    assert!(
        !out["text"].as_str().unwrap().is_empty(),
        "text came first: {out}"
    );
    app.stop().await;
}

/// CB-3: the Node reference library (`standardwebhooks` on npm) verifies every webhook (the
/// receiver knows only the old secret of a rotation); tampering and an old timestamp fail it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standardwebhooks_node_receiver_verifies_every_delivery_and_rejects_tampering_cb3() {
    require_node("standardwebhooks");
    let mut program = tokio::process::Command::new("node");
    program.arg(clients_dir().join("webhook_receiver.mjs"));
    crate::callbacks::reference_receiver_verifies_every_delivery(
        program,
        crate::callbacks::OLD_SECRET,
    )
    .await;
}
