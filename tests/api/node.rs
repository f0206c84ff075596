//! Real JavaScript clients against holdfast (tests/clients/*.mjs): the official OpenAI Node SDK
//! on the proxied routes. It needs
//! `npm ci --prefix tests/clients`; without it these tests print a loud `SKIPPED` line (in CI,
//! `CI` is set and they fail instead).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use holdfast::mock::MockConfig;
use serde_json::Value;

use crate::helpers::*;

/// `tests/clients`, where the drivers and their `node_modules` live.
fn clients_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/clients")
}

/// Whether `node` runs and the npm package `pkg` is installed under `tests/clients`. In CI (`CI`
/// set) a missing one fails the test; elsewhere the caller skips loudly.
fn node_has(pkg: &str) -> bool {
    let node = Command::new("node")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    let installed = clients_dir()
        .join("node_modules")
        .join(pkg)
        .join("package.json")
        .is_file();
    let ok = node && installed;
    if !ok {
        let what = if node {
            format!("npm package `{pkg}` is not installed")
        } else {
            "`node` is not on PATH".to_string()
        };
        assert!(
            std::env::var_os("CI").is_none(),
            "{what} in CI: .ci/run must run `npm ci --prefix tests/clients`"
        );
        eprintln!("\n*** SKIPPED: {what}; run npm ci --prefix tests/clients ***\n");
    }
    ok
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

/// Runs `python3 tests/clients/SCRIPT` off the runtime and parses the JSON object it prints.
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

// ---------------------------------------------------------------------------------------------
// openai-node on the proxied routes

#[tokio::test]
async fn openai_node_repeat_create_replays_the_stored_answer_rs3_rs5() {
    if !node_has("openai") {
        return;
    }
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
    if !node_has("openai") {
        return;
    }
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
    if !node_has("openai") {
        return;
    }
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
    if !node_has("openai") {
        return;
    }
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
    if !node_has("openai") {
        return;
    }
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
    if !node_has("openai") {
        return;
    }
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
    if !python_has("openai") || !node_has("openai") {
        return;
    }
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
    if !python_has("openai") || !node_has("openai") {
        return;
    }
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
