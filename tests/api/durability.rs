//! Crash recovery with a real process: SIGKILL during an attempt (DU-1, LC-4).

use std::time::Duration;

use holdfast::mock::MockConfig;

use crate::helpers::*;

fn config_toml(dir: &std::path::Path, mock_base: &str) -> String {
    format!(
        r#"
database_url = "sqlite://{db}"
[workers]
lease_secs = 2
sweep_interval_ms = 100
backoff_initial_ms = 20
backoff_max_ms = 200
[[backends]]
name = "mock"
kind = "openai"
base_url = "{mock_base}"
"#,
        db = dir.join("holdfast.db").display()
    )
}

#[tokio::test]
async fn request_running_at_sigkill_succeeds_after_restart_with_a_recovery_du1_lc4() {
    // The provider takes 1.5 s to answer, so the request is mid-attempt when we kill.
    let mock = start_mock(MockConfig {
        header_delay_ms: 1_500,
        ..MockConfig::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let toml = config_toml(dir.path(), &mock.base_url());
    let addr = free_addr();
    let mut first = Process::serve(dir.path(), &toml, addr).await;

    let http = reqwest::Client::new();
    let r = http
        .post(format!("{}/v1/chat/completions", first.base))
        .header("content-type", "application/json")
        .header("prefer", "respond-async")
        .body(chat_body("survive a crash"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let id = header(&r, "holdfast-request-id");

    wait_until(
        Duration::from_secs(10),
        "the first attempt to reach the provider",
        || mock.calls() == 1,
    )
    .await;
    first.kill9();

    let second = Process::serve(dir.path(), &toml, free_addr()).await;
    let record = wait_terminal(&http, &second.base, &id, Duration::from_secs(30)).await;
    assert_eq!(record["status"], "succeeded", "{record}");
    assert!(record["recoveries"].as_u64().unwrap() >= 1, "{record}");
    assert_eq!(record["attempts"], 2, "{record}");
    assert_eq!(mock.calls(), 2, "each attempt called the provider once");
    drop(second);
    mock.shutdown().await;
}
