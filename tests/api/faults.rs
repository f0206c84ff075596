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
