//! Official SDKs and the README, driven as a user would (tests/clients/*.py).

use std::process::{Command, Stdio};
use std::time::Duration;

use holdfast::mock::MockConfig;
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::helpers::*;

#[tokio::test]
async fn openai_python_timeout_retry_attaches_to_the_first_execution_rs2() {
    if !python_has("openai") {
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
    if !python_has("openai") {
        return;
    }
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
    let mut child = tokio::process::Command::new(holdfast_bin())
        .args(["serve", "--demo", "--listen", &addr.to_string()])
        .current_dir(dir.path())
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

    let curl = curl.replace("127.0.0.1:8080", &addr.to_string());
    let out = Command::new("sh").args(["-c", &curl]).output().unwrap();
    assert!(
        out.status.success(),
        "curl failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let answer: serde_json::Value = serde_json::from_slice(&out.stdout).expect("curl prints JSON");
    assert_eq!(answer["object"], "chat.completion", "{answer}");
    assert!(
        dir.path().join("holdfast-demo.db").exists(),
        "CLI-4a: the SQLite file is created"
    );
    child.kill().await.unwrap();
}

async fn run_streams_mode(app: &TestApp, mode: &'static str) -> serde_json::Value {
    let url = app.base.clone();
    let out = tokio::task::spawn_blocking(move || {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/clients/sdk_streams.py");
        let out = Command::new("python3")
            .arg(path)
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
    if !python_has("openai") {
        return;
    }
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
    if !python_has("anthropic") {
        return;
    }
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
    if !python_has("openai") {
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
    if !python_has("openai") || !python_has("anthropic") {
        return;
    }
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
