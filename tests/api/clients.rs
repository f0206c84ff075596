//! Official SDKs and the README, driven as a user would (tests/clients/*.py).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use holdfast::mock::MockConfig;
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::helpers::*;

#[tokio::test]
async fn openai_python_timeout_retry_attaches_to_the_first_execution_rs2() {
    require_python(&["openai"]);
    // The provider answers after 3 s; the SDK gives up after 1 s and retries the same body.
    let app = spawn_app(
        MockConfig {
            header_delay_ms: 3_000,
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    let base = format!("{}/v1", app.base);
    let out = tokio::task::spawn_blocking(move || {
        run_python("openai_timeout_retry.py", &[("HOLDFAST_BASE_URL", &base)])
    })
    .await
    .unwrap();
    let result: serde_json::Value = serde_json::from_str(out.trim()).expect("driver prints JSON");
    assert!(
        result["content"]
            .as_str()
            .unwrap()
            .starts_with("mock reply"),
        "{result}"
    );
    assert!(
        result["timeouts_seen"].as_u64().unwrap() >= 1,
        "the SDK did time out: {result}"
    );
    assert_eq!(
        app.mock.calls(),
        1,
        "the SDK's retries attached to one execution"
    );
    app.stop().await;
}

#[tokio::test]
async fn openai_python_without_retries_gets_200_after_two_upstream_500s_lc5() {
    require_python(&["openai"]);
    let app = spawn_app(
        MockConfig {
            fail_first: 2,
            fail_status: 500,
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    let base = format!("{}/v1", app.base);
    let out = tokio::task::spawn_blocking(move || {
        run_python("openai_no_retries.py", &[("HOLDFAST_BASE_URL", &base)])
    })
    .await
    .unwrap();
    let result: serde_json::Value = serde_json::from_str(out.trim()).expect("driver prints JSON");
    let id = result["holdfast_request_id"].as_str().unwrap().to_string();
    assert_eq!(app.record(&id).await["attempts"], 3);
    assert_eq!(app.mock.calls(), 3);
    app.stop().await;
}

/// The README's demo command and its curl example, run as written (port aside).
#[tokio::test]
async fn readme_demo_and_curl_example_work_on_a_fresh_directory_cli2() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    assert!(
        readme.contains("cargo run --release -- serve --demo"),
        "README gives the demo command"
    );
    let curl = readme
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("curl "))
        .take_while(|l| !l.trim().is_empty() && !l.starts_with("```"))
        .collect::<Vec<_>>()
        .join("\n");
    assert!(
        curl.contains("127.0.0.1:8080/v1/chat/completions"),
        "README curl example: {curl}"
    );

    let dir = tempfile::tempdir().unwrap();
    let addr = free_addr();
    let mut child = start_demo(dir.path(), addr).await;

    // Pasted twice, as the README says: the second answer is replayed, and -i shows it.
    let curl = curl.replace("127.0.0.1:8080", &addr.to_string());
    let mut outputs = Vec::new();
    for _ in 0..2 {
        let out = Command::new("sh").args(["-c", &curl]).output().unwrap();
        assert!(
            out.status.success(),
            "curl failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        outputs.push(String::from_utf8(out.stdout).unwrap());
    }
    for (output, replayed) in outputs.iter().zip(["false", "true"]) {
        let (head, body) = output
            .split_once("\r\n\r\n")
            .unwrap_or_else(|| panic!("curl -i prints the headers: {output}"));
        assert!(
            head.to_ascii_lowercase()
                .contains(&format!("idempotent-replayed: {replayed}")),
            "{head}"
        );
        let answer: serde_json::Value = serde_json::from_str(body).expect("then the JSON");
        assert_eq!(answer["object"], "chat.completion", "{answer}");
    }
    assert!(
        dir.path().join("holdfast-demo.db").exists(),
        "CLI-4a: the SQLite file is created"
    );
    child.kill().await.unwrap();
}

/// `holdfast serve --demo --listen ADDR` in `dir`, once its banner (naming the address) is out.
/// Its stdout is closed after the first line, as `| head -1` would: the demo keeps serving.
async fn start_demo(dir: &Path, addr: std::net::SocketAddr) -> tokio::process::Child {
    let mut child = tokio::process::Command::new(holdfast_bin())
        .args(["serve", "--demo", "--listen", &addr.to_string()])
        .current_dir(dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let banner = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .expect("demo starts")
        .unwrap()
        .unwrap_or_default();
    assert!(banner.contains(&addr.to_string()), "{banner}");
    child
}

/// The first thing a new user streams: OpenAI's own loop (`chunk.choices[0]`) over the demo,
/// which asks the provider for every stream's usage; the usage chunk, which has no choices,
/// stays out of the client's stream (decision 40).
#[tokio::test]
async fn python_sdk_streams_from_the_demo_with_the_loop_every_openai_example_writes_rs4() {
    let dir = tempfile::tempdir().unwrap();
    let addr = free_addr();
    let mut child = start_demo(dir.path(), addr).await;
    let url = format!("http://{addr}");
    let text = tokio::task::spawn_blocking(move || {
        run_python("demo_stream.py", &[("HOLDFAST_URL", url.as_str())])
    })
    .await
    .unwrap();
    assert!(!text.trim().is_empty(), "the story streamed");
    child.kill().await.unwrap();
}

async fn run_streams_mode(app: &TestApp, mode: &'static str) -> serde_json::Value {
    let url = app.base.clone();
    let out = tokio::task::spawn_blocking(move || {
        let out = python_command("sdk_streams.py")
            .arg(mode)
            .env("HOLDFAST_URL", url)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "sdk_streams.py {mode}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    })
    .await
    .unwrap();
    serde_json::from_str(out.trim()).expect("driver prints JSON")
}

#[tokio::test]
async fn openai_python_streams_through_holdfast_and_a_repeat_replays_despite_keepalives_rs3_rs4() {
    require_python(&["openai"]);
    // A slow stream with keep-alive comments between the chunks.
    let app = spawn_app(
        MockConfig {
            chunks: 5,
            chunk_delay_ms: 150,
            ..MockConfig::default()
        },
        |c| c.sse_keepalive_ms = 40,
    )
    .await;
    let result = run_streams_mode(&app, "openai").await;
    let texts = result["texts"].as_array().unwrap();
    assert!(
        texts[0]
            .as_str()
            .unwrap()
            .starts_with("mock reply to gpt-4o-mini:"),
        "{result}"
    );
    assert_eq!(texts[0], texts[1]);
    assert_eq!(
        app.mock.calls(),
        1,
        "the repeat replayed without an upstream call"
    );
    app.stop().await;
}

#[tokio::test]
async fn anthropic_python_streams_through_holdfast_and_a_repeat_replays() {
    require_python(&["anthropic"]);
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    let result = run_streams_mode(&app, "anthropic").await;
    let texts = result["texts"].as_array().unwrap();
    assert!(
        texts[0]
            .as_str()
            .unwrap()
            .starts_with("mock reply to claude-sonnet-4-5:"),
        "{result}"
    );
    assert_eq!(
        texts[0], texts[1],
        "messages.stream replays the raw stream's text"
    );
    assert_eq!(
        result["non_stream"], texts[0],
        "non-stream text equals the streamed text"
    );
    assert_eq!(app.mock.calls(), 2, "one stream execution, one non-stream");
    let recorded = app.mock.recorded();
    assert!(
        recorded.iter().all(|c| c.path.ends_with("/v1/messages")),
        "{recorded:?}"
    );
    app.stop().await;
}

#[tokio::test]
async fn openai_python_raises_api_error_when_the_provider_drops_mid_stream_lc7() {
    require_python(&["openai"]);
    let app = spawn_app(
        MockConfig {
            chunks: 20,
            drop_after_chunks: Some(5),
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    let result = run_streams_mode(&app, "broken").await;
    assert_eq!(result["raised"], "APIError", "{result}");
    let partial = result["texts"][0].as_str().unwrap();
    assert!(
        partial.starts_with("mock reply"),
        "chunks before the break arrived: {result}"
    );
    app.stop().await;
}

#[tokio::test]
async fn every_route_works_through_its_official_python_sdk_method_and_replays_http1() {
    require_python(&["openai", "anthropic"]);
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    let url = app.base.clone();
    let out =
        tokio::task::spawn_blocking(move || run_python("all_routes.py", &[("HOLDFAST_URL", &url)]))
            .await
            .unwrap();
    let result: serde_json::Value = serde_json::from_str(out.trim()).expect("driver prints JSON");
    for route in [
        "openai.chat",
        "openai.completions",
        "openai.embeddings",
        "openai.responses",
        "anthropic.messages",
    ] {
        let r = &result[route];
        assert_eq!(
            r["replayed"],
            serde_json::json!(["false", "true"]),
            "{route}: {r}"
        );
        assert_eq!(r["ids_equal"], true, "{route}");
        assert_eq!(r["same_answer"], true, "{route}");
    }
    assert!(
        result["openai.chat"]["summary"]
            .as_str()
            .unwrap()
            .starts_with("mock reply")
    );
    assert_eq!(
        result["openai.embeddings"]["summary"],
        serde_json::json!([8, 8])
    );
    assert!(
        result["openai.responses.stream"]["summary"]
            .as_str()
            .unwrap()
            .starts_with("mock reply"),
        "{result}"
    );
    assert!(
        result["openai.completions.stream"]["summary"]
            .as_str()
            .unwrap()
            .starts_with("mock reply"),
        "{result}"
    );
    assert_eq!(app.mock.calls(), 7, "five routes once each, two streams");
    app.stop().await;
}

fn run_retries(base: String, mode: &'static str) -> serde_json::Value {
    let out = python_command("sdk_retries.py")
        .arg(mode)
        .env("HOLDFAST_BASE_URL", base)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "sdk_retries.py {mode}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("driver prints JSON")
}

#[tokio::test]
async fn should_retry_false_stops_the_python_sdk_from_retrying_a_failed_request_rs7() {
    require_python(&["openai"]);
    let app = spawn_app(
        MockConfig {
            fail_first: 1_000,
            fail_status: 500,
            ..MockConfig::default()
        },
        |c| c.workers.max_attempts = 2,
    )
    .await;
    let base = format!("{}/v1", app.base);
    let result = tokio::task::spawn_blocking(move || run_retries(base, "final"))
        .await
        .unwrap();
    assert_eq!(result["status"], 502, "{result}");
    assert_eq!(result["should_retry"], "false");
    assert_eq!(app.mock.calls(), 2, "holdfast's own two attempts");
    // An SDK retry would attach to the failure within the minute of ID-6a, costing no call:
    // the driver counts what the SDK sent.
    assert_eq!(result["sends"], 1, "no SDK retry: {result}");
    app.stop().await;
}

#[tokio::test]
async fn python_sdk_waits_retry_after_ms_on_an_overload_refusal_and_then_succeeds_rs8() {
    require_python(&["openai"]);
    // The first provider call hangs, so its caller holds the only slot until we cancel it.
    let app = spawn_app(
        MockConfig {
            hang_before_headers_ms: Some(60_000),
            hang_first: 1,
            ..MockConfig::default()
        },
        |c| c.max_held_requests = 1,
    )
    .await;
    let holder = {
        let (http, base) = (app.http.clone(), app.base.clone());
        tokio::spawn(async move {
            http.post(format!("{base}/v1/chat/completions"))
                .header("content-type", "application/json")
                .body(chat_body("holding the slot"))
                .send()
                .await
                .unwrap()
                .status()
        })
    };
    wait_until(
        Duration::from_secs(10),
        "the holder to reach the provider",
        || app.mock.calls() == 1,
    )
    .await;
    let base = format!("{}/v1", app.base);
    let sdk = tokio::task::spawn_blocking(move || run_retries(base, "overload"));

    // Once the SDK has been refused, free the slot by cancelling the holder's request.
    let refused = || async {
        let metrics = app.metrics_text().await;
        metrics
            .lines()
            .find(|l| {
                l.starts_with("holdfast_requests_total{") && l.contains("outcome=\"refused\"")
            })
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let start = std::time::Instant::now();
    while refused().await < 1.0 {
        assert!(
            start.elapsed() < Duration::from_secs(90),
            "the SDK was never refused"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let list: serde_json::Value = app
        .http
        .get(format!("{}/requests", app.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let holder_id = list["data"][0]["id"].as_str().unwrap().to_string();
    app.http
        .post(format!("{}/requests/{holder_id}/cancel", app.base))
        .send()
        .await
        .unwrap();

    let result = sdk.await.unwrap();
    assert_eq!(
        result["status"], 200,
        "the SDK retried after retry-after-ms and succeeded: {result}"
    );
    assert_eq!(
        holder.await.unwrap(),
        503,
        "the holder's request was cancelled"
    );
    assert_eq!(
        app.mock.calls(),
        2,
        "the refused tries left no record and no call"
    );
    app.stop().await;
}

#[tokio::test]
async fn overload_refusal_is_503_with_retry_hints_and_records_nothing_rs8_id8() {
    let app = spawn_app(
        MockConfig {
            header_delay_ms: 800,
            ..MockConfig::default()
        },
        |c| c.max_held_requests = 1,
    )
    .await;
    let holder = {
        let (http, base) = (app.http.clone(), app.base.clone());
        tokio::spawn(async move {
            http.post(format!("{base}/v1/chat/completions"))
                .header("content-type", "application/json")
                .body(chat_body("holder"))
                .send()
                .await
                .unwrap()
                .status()
        })
    };
    wait_until(
        Duration::from_secs(10),
        "the holder to reach the provider",
        || app.mock.calls() == 1,
    )
    .await;
    let r = app.chat(&chat_body("refused")).await;
    assert_eq!(r.status(), 503);
    assert_eq!(header(&r, "x-should-retry"), "true");
    let ms: u64 = header(&r, "retry-after-ms").parse().unwrap();
    assert!(ms > 0 && ms <= 60_000);
    assert_eq!(header(&r, "holdfast-error"), "overloaded");
    assert_eq!(holder.await.unwrap(), 200);
    let list: serde_json::Value = app
        .http
        .get(format!("{}/requests", app.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        list["data"].as_array().unwrap().len(),
        1,
        "nothing recorded for the refusal"
    );
    app.stop().await;
}

/// LC-7: a provider stream that ends without its final event (`[DONE]`, `message_stop`,
/// `response.completed`) is not a finished answer: the official SDK's iteration raises, the
/// record is `stream_interrupted`, and the provider was called once.
#[tokio::test]
async fn official_python_sdks_raise_when_the_provider_stream_ends_without_its_final_event_lc7() {
    require_python(&["openai", "anthropic"]);
    let two_events = "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"Hel\"},\"finish_reason\":null}]}\n\n\
data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo\"},\"finish_reason\":null}]}\n\n";
    let cases: Vec<(&str, &'static str, MockConfig, Option<Vec<u8>>)> = vec![
        (
            "chat: clean chunked end without [DONE]",
            "chat",
            MockConfig {
                end_after_chunks: Some(3),
                ..MockConfig::default()
            },
            None,
        ),
        (
            "chat: finish_reason set, no [DONE]",
            "chat",
            MockConfig {
                omit_stream_end: true,
                ..MockConfig::default()
            },
            None,
        ),
        (
            "chat: close-delimited body closed after two events",
            "chat",
            MockConfig::default(),
            Some(raw_200("text/event-stream", two_events, true)),
        ),
        (
            "messages: no message_stop",
            "messages",
            MockConfig {
                omit_stream_end: true,
                ..MockConfig::default()
            },
            None,
        ),
        (
            "responses: no response.completed",
            "responses",
            MockConfig {
                omit_stream_end: true,
                ..MockConfig::default()
            },
            None,
        ),
    ];
    for (name, route, mock, raw) in cases {
        let raw = match raw {
            Some(bytes) => Some(RawProvider::start(bytes).await),
            None => None,
        };
        let raw_url = raw.as_ref().map(RawProvider::base_url);
        let app = spawn_app(mock, move |c| {
            if let Some(url) = &raw_url {
                use_backend_url(c, url);
            }
        })
        .await;
        let url = app.base.clone();
        let out = tokio::task::spawn_blocking(move || {
            run_python(
                "truncated_streams.py",
                &[("HOLDFAST_URL", &url), ("HOLDFAST_ROUTE", route)],
            )
        })
        .await
        .expect("python");
        let result: serde_json::Value = serde_json::from_str(out.trim()).expect("JSON");
        assert!(
            result["raised"].is_string(),
            "{name}: the SDK raised: {result}"
        );
        assert!(
            !result["text"].as_str().unwrap_or_default().is_empty(),
            "{name}: the events before the end arrived: {result}"
        );
        let calls = raw
            .as_ref()
            .map_or_else(|| app.mock.calls(), RawProvider::calls);
        assert_eq!(calls, 1, "{name}");
        let list: serde_json::Value = app
            .http
            .get(format!("{}/requests", app.base))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let record = &list["data"][0];
        assert_eq!(record["status"], "failed", "{name}: {record}");
        assert_eq!(
            record["error"]["type"], "stream_interrupted",
            "{name}: {record}"
        );
        app.stop().await;
    }
}
