//! Operations surface: health, readiness, metrics (HTTP-3).

use std::io::Write;
use std::process::Stdio;

use holdfast::mock::MockConfig;

use crate::helpers::*;

async fn scrape(app: &TestApp) -> serde_json::Value {
    let text = app.metrics_text().await;
    let mut child = python_command("parse_metrics.py")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the Prometheus parser refused:\n{text}"
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn value(samples: &serde_json::Value, key: &str) -> f64 {
    samples[key].as_f64().unwrap_or(0.0)
}

#[tokio::test]
async fn metrics_parse_with_python_prometheus_client_and_move_as_requests_happen_http3() {
    require_python(&["prometheus_client"]);
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    let before = scrape(&app).await;
    let body = chat_body("count me");
    app.chat(&body).await.bytes().await.unwrap();
    app.chat(&body).await.bytes().await.unwrap();
    app.post("/v1/chat/completions", "not json", &[]).await;
    let r = app.chat(&stream_body("count my chunks")).await;
    r.bytes().await.unwrap();
    let after = scrape(&app).await;
    let delta = |k: &str| value(&after, k) - value(&before, k);
    assert_eq!(
        delta("holdfast_requests_total{outcome=new,route=openai.chat}"),
        2.0,
        "{after}"
    );
    assert_eq!(
        delta("holdfast_requests_total{outcome=replayed,route=openai.chat}"),
        1.0
    );
    assert_eq!(
        delta("holdfast_requests_total{outcome=refused,route=openai.chat}"),
        1.0
    );
    assert_eq!(
        delta("holdfast_upstream_calls_total{backend=mock-openai,status=200}"),
        2.0
    );
    assert_eq!(delta("holdfast_attempts_total{backend=mock-openai}"), 2.0);
    assert!(
        delta("holdfast_chunk_commit_seconds_count{}") >= 1.0,
        "{after}"
    );
    assert_eq!(value(&after, "holdfast_queue_depth{status=succeeded}"), 2.0);
    app.stop().await;
}

/// The failure counters an operator alerts on (docs/operations.md) are exported at 0 from the
/// start: Prometheus' `increase()` misses the first count of a series that appears with it.
#[tokio::test]
async fn the_write_failure_counters_are_exported_at_zero_before_any_failure_decision37() {
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    let page = app.metrics_text().await;
    for name in [
        "holdfast_attempt_write_retries_total",
        "holdfast_attempt_writes_abandoned_total",
    ] {
        for write in ["chunks", "outcome"] {
            let series = format!("{name}{{write=\"{write}\"}} 0");
            assert!(
                page.lines().any(|line| line == series),
                "{series} in /metrics:\n{page}"
            );
        }
    }
    app.stop().await;
}

/// The value of the unlabelled sample `name` in holdfast's `/metrics`, 0 before it exists.
async fn sample(app: &TestApp, name: &str) -> f64 {
    let text = app.metrics_text().await;
    text.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

/// With SQLite a stream ends in one commit (decision 34): the batch with the provider's final
/// event, the success and the `end` chunk together. However the provider's bytes were split
/// into batches, the stream's SQLite commits are then its submission plus one per chunk
/// commit — the last of which is the end. Storing the last batch and the outcome apart made
/// one commit more.
#[tokio::test]
async fn a_sqlite_stream_ends_with_one_commit_for_its_last_events_and_its_outcome_rd5() {
    // The sweeper's (and pruner's) first round runs at start; none follows within the test.
    let app = spawn_app(MockConfig::default(), |c| {
        c.workers.sweep_interval_ms = 3_600_000;
    })
    .await;
    let commits = "holdfast_sqlite_commit_seconds_count";
    let chunk_commits = "holdfast_chunk_commit_seconds_count";
    // A non-stream request is two commits (submission, outcome) once nothing else writes: the
    // start's round is then behind us.
    let mut quiet = false;
    for i in 0..50 {
        let before = sample(&app, commits).await;
        let r = app.chat(&chat_body(&format!("quiet {i}"))).await;
        assert_eq!(r.status(), 200);
        if sample(&app, commits).await - before == 2.0 {
            quiet = true;
            break;
        }
    }
    assert!(quiet, "the writer never went quiet");
    let (commits_before, chunks_before) = (
        sample(&app, commits).await,
        sample(&app, chunk_commits).await,
    );
    let r = app.chat(&stream_body("ends in one commit")).await;
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    assert!(text.contains("[DONE]"), "{text}");
    let commits = sample(&app, commits).await - commits_before;
    let chunk_commits = sample(&app, chunk_commits).await - chunks_before;
    assert!(chunk_commits >= 1.0, "the events were stored");
    assert_eq!(
        commits,
        1.0 + chunk_commits,
        "submission, then the chunk commits"
    );
    app.stop().await;
}

#[tokio::test]
async fn healthz_and_readyz_answer_200_cli4a() {
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    for path in ["/healthz", "/readyz"] {
        let r = app
            .http
            .get(format!("{}{path}", app.base))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{path}");
    }
    app.stop().await;
}

#[tokio::test]
async fn cors_is_off_by_default_and_allows_configured_origins_with_last_event_id() {
    let closed = spawn_app(MockConfig::default(), |_| {}).await;
    let r = closed
        .http
        .get(format!("{}/healthz", closed.base))
        .header("origin", "http://app.example")
        .send()
        .await
        .unwrap();
    assert!(r.headers().get("access-control-allow-origin").is_none());
    closed.stop().await;

    let app = spawn_app(MockConfig::default(), |c| {
        c.cors_allow_origins = vec!["http://app.example".into()]
    })
    .await;
    let preflight = app
        .http
        .request(
            reqwest::Method::OPTIONS,
            format!("{}/requests/0190a1b2-0000-7000-8000-000000000000", app.base),
        )
        .header("origin", "http://app.example")
        .header("access-control-request-method", "GET")
        .header("access-control-request-headers", "last-event-id")
        .send()
        .await
        .unwrap();
    assert!(preflight.status().is_success(), "{}", preflight.status());
    assert_eq!(
        header(&preflight, "access-control-allow-origin"),
        "http://app.example"
    );
    assert!(header(&preflight, "access-control-allow-headers").contains("last-event-id"));
    let r = app.chat(&chat_body("cors")).await;
    assert!(
        r.headers().get("access-control-allow-origin").is_none(),
        "no Origin, no CORS headers"
    );
    let r = app
        .http
        .post(format!("{}/v1/chat/completions", app.base))
        .header("origin", "http://app.example")
        .header("content-type", "application/json")
        .body(chat_body("cors"))
        .send()
        .await
        .unwrap();
    assert_eq!(
        header(&r, "access-control-allow-origin"),
        "http://app.example"
    );
    assert!(header(&r, "access-control-expose-headers").contains("holdfast-request-id"));
    let other = app
        .http
        .get(format!("{}/healthz", app.base))
        .header("origin", "http://evil.example")
        .send()
        .await
        .unwrap();
    assert!(other.headers().get("access-control-allow-origin").is_none());
    app.stop().await;
}
