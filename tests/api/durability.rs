//! Crash recovery with a real process: SIGKILL during an attempt (DU-1, LC-4).

use std::time::Duration;

use holdfast::mock::MockConfig;
use serde_json::Value;

use crate::helpers::*;

fn config_toml(dir: &std::path::Path, mock_base: &str) -> String {
    let db = format!("sqlite://{}", dir.join("holdfast.db").display());
    fault_test_toml(&db, "", 2, mock_base)
}

/// Submits stream `body` with `Prefer: respond-async` and follows its log until the first
/// attempt has stored a few events; returns the request's id and the last event's seq.
async fn stream_a_few_events(http: &reqwest::Client, base: &str, body: String) -> (String, String) {
    let id = submit_async(http, base, body).await;
    let seen = wait_for_events(http, base, &id, 4).await;
    let position = seen.last().unwrap().id.clone().unwrap();
    (id, position)
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

#[tokio::test]
async fn stream_killed_mid_attempt_reruns_and_a_resume_reader_gets_reset_then_the_whole_new_attempt_lc8_rd6()
 {
    let mock = start_mock(MockConfig {
        chunks: 60,
        chunk_delay_ms: 50,
        ..MockConfig::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let toml = config_toml(dir.path(), &mock.base_url());
    let mut first = Process::serve(dir.path(), &toml, free_addr()).await;
    let http = reqwest::Client::new();
    // A log reader follows the first attempt for a few events.
    let (id, position) = stream_a_few_events(
        &http,
        &first.base,
        stream_body("survive a crash mid-stream"),
    )
    .await;
    first.kill9();

    let second = Process::serve(dir.path(), &toml, free_addr()).await;
    let record = wait_terminal(&http, &second.base, &id, Duration::from_secs(60)).await;
    assert_eq!(record["status"], "succeeded", "{record}");
    assert_eq!(record["recoveries"], 1, "{record}");
    assert_eq!(record["attempts"], 2, "{record}");
    assert_eq!(mock.calls(), 2);

    let resumed = get_events(&http, &second.base, &id, Some(&position)).await;
    let (_, events) = read_events(resumed).await;
    assert_eq!(
        events[0].event.as_deref(),
        Some("reset"),
        "RD-6: reset comes next"
    );
    assert_eq!(events[0].data, "2", "reset data is the new attempt number");
    let end = events.last().unwrap();
    assert_eq!(end.event.as_deref(), Some("end"));
    let attempt2 = &events[1..events.len() - 1];
    assert_eq!(
        attempt2.len(),
        63,
        "role + 60 pieces + finish + [DONE], from the first chunk"
    );
    assert_eq!(attempt2.last().unwrap().data, "[DONE]");
    let ids: Vec<i64> = events
        .iter()
        .map(|e| e.id.as_deref().unwrap().parse().unwrap())
        .collect();
    assert!(
        ids.windows(2).all(|w| w[1] == w[0] + 1),
        "seqs continue without gaps (LC-8)"
    );
    assert!(ids[0] > position.parse::<i64>().unwrap());

    // A reader without a position gets the current (second) attempt only.
    let fresh = get_events(&http, &second.base, &id, None).await;
    let (_, fresh) = read_events(fresh).await;
    assert_eq!(fresh.len(), 64, "the second attempt and its end");
    assert_eq!(fresh[0].data, attempt2[0].data);
    drop(second);
    mock.shutdown().await;
}

/// Decision 41: a restarted process recovers the requests its killed predecessor left running
/// before it serves, not `lease_secs` later (DU-2 makes it the file's only process). With a
/// 60 s lease: the first read after the restart already shows the recovery, and the SDK-style
/// retry of the stream — sent as soon as the node answers — gets the new attempt's whole
/// stream, not the dead attempt's events and an `attempt_abandoned` error.
#[tokio::test]
async fn requests_a_killed_process_left_running_are_recovered_before_its_restart_serves_du1_du2_decision41()
 {
    let mock = start_mock(MockConfig {
        chunks: 40,
        chunk_delay_ms: 50,
        ..MockConfig::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("holdfast.db").display());
    let toml = fault_test_toml(&db, "", 60, &mock.base_url());
    let mut first = Process::serve(dir.path(), &toml, free_addr()).await;
    let http = reqwest::Client::new();
    let body = stream_body("recovered at once");
    // The first attempt stores a few events, then dies with its process.
    let (id, _) = stream_a_few_events(&http, &first.base, body.clone()).await;
    first.kill9();

    let second = Process::serve(dir.path(), &toml, free_addr()).await;
    let record = get_json(&http, &format!("{}/requests/{id}", second.base)).await;
    assert_eq!(
        record["recoveries"], 1,
        "recovered before the restart served: {record}"
    );
    let retry = http
        .post(format!("{}/v1/chat/completions", second.base))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(
        header(&retry, "holdfast-request-id"),
        id,
        "the retry attaches"
    );
    let (text, events) = read_events(retry).await;
    assert!(!text.contains("attempt_abandoned"), "{text}");
    assert_eq!(
        events.last().map(|e| e.data.as_str()),
        Some("[DONE]"),
        "{text}"
    );
    let record = wait_terminal(&http, &second.base, &id, Duration::from_secs(30)).await;
    assert_eq!(record["status"], "succeeded", "{record}");
    assert_eq!(
        (record["attempts"].as_u64(), record["recoveries"].as_u64()),
        (Some(2), Some(1))
    );
    assert_eq!(mock.calls(), 2, "each attempt called the provider once");
    drop(second);
    mock.shutdown().await;
}

/// DU-2: one process per SQLite file. A second `holdfast serve` on the same database is refused
/// with a message naming the file — it would otherwise run the first one's requests — and the
/// first keeps serving.
#[tokio::test]
async fn a_second_process_on_one_sqlite_file_is_refused_and_the_first_keeps_serving_du2() {
    let mock = start_mock(MockConfig::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let toml = config_toml(dir.path(), &mock.base_url());
    let first = Process::serve(dir.path(), &toml, free_addr()).await;
    let stderr = refused_serve(dir.path());
    assert!(stderr.contains("another holdfast process"), "{stderr}");
    assert!(stderr.contains("holdfast.db"), "{stderr}");
    // The same file under another name — a symbolic link in another directory — is the same
    // database, refused too.
    let other = tempfile::tempdir().unwrap();
    let link = other.path().join("link.db");
    std::os::unix::fs::symlink(dir.path().join("holdfast.db"), &link).unwrap();
    let linked = fault_test_toml(
        &format!("sqlite://{}", link.display()),
        "",
        2,
        &mock.base_url(),
    );
    std::fs::write(other.path().join("holdfast.toml"), linked).unwrap();
    let stderr = refused_serve(other.path());
    assert!(stderr.contains("another holdfast process"), "{stderr}");
    let http = reqwest::Client::new();
    let ready = http
        .get(format!("{}/readyz", first.base))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 200);
    drop(first);
    mock.shutdown().await;
}

/// Runs `holdfast serve --config holdfast.toml` in `dir` on a free port and asserts it exits 1
/// within 30 s (a process that starts serving instead is killed and the test fails); returns
/// its stderr.
fn refused_serve(dir: &std::path::Path) -> String {
    let log = dir.join("refused.log");
    let mut child = std::process::Command::new(holdfast_bin())
        .args(["serve", "--config", "holdfast.toml", "--listen"])
        .arg(free_addr().to_string())
        .current_dir(dir)
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "a second process on the database was not refused: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stderr = std::fs::read_to_string(&log).unwrap_or_default();
    assert_eq!(status.code(), Some(1), "{stderr}");
    stderr
}

fn with_grace(toml: String, grace_ms: u64) -> String {
    format!("shutdown_grace_ms = {grace_ms}\n{toml}")
}

#[tokio::test]
async fn sigterm_lets_a_running_stream_finish_within_the_grace_period_du5() {
    let mock = start_mock(MockConfig {
        chunks: 20,
        chunk_delay_ms: 75,
        ..MockConfig::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let toml = with_grace(config_toml(dir.path(), &mock.base_url()), 20_000);
    let mut node = Process::serve(dir.path(), &toml, free_addr()).await;
    let http = reqwest::Client::new();
    let mut response = http
        .post(format!("{}/v1/chat/completions", node.base))
        .header("content-type", "application/json")
        .body(stream_body("finish before you go"))
        .send()
        .await
        .unwrap();
    let mut parser = holdfast::sse::SseParser::new();
    let mut events = Vec::new();
    while events.len() < 2 {
        let piece = response.chunk().await.unwrap().unwrap();
        events.extend(parser.push(&piece).unwrap());
    }
    let pid = node.child.id().to_string();
    std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    while let Some(piece) = response.chunk().await.unwrap() {
        events.extend(parser.push(&piece).unwrap());
    }
    assert_eq!(
        events.last().unwrap().data,
        "[DONE]",
        "the stream finished during the grace period"
    );
    assert!(node.sigterm_and_wait(Duration::from_secs(20)), "clean exit");
    assert_eq!(mock.calls(), 1);
    mock.shutdown().await;
}

#[tokio::test]
async fn sigterm_with_a_short_grace_hands_the_request_back_without_a_recovery_du5() {
    let mock = start_mock(MockConfig {
        chunks: 40,
        chunk_delay_ms: 75,
        ..MockConfig::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let toml = with_grace(config_toml(dir.path(), &mock.base_url()), 200);
    let mut first = Process::serve(dir.path(), &toml, free_addr()).await;
    let http = reqwest::Client::new();
    let r = http
        .post(format!("{}/v1/chat/completions", first.base))
        .header("content-type", "application/json")
        .header("prefer", "respond-async")
        .body(stream_body("hand me back"))
        .send()
        .await
        .unwrap();
    let id = header(&r, "holdfast-request-id");
    let started = std::time::Instant::now();
    loop {
        let record = get_record(&http, &first.base, &id).await;
        if record["last_seq"].as_i64().unwrap_or(0) >= 3 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "stream never started: {record}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(first.sigterm_and_wait(Duration::from_secs(10)));

    let second = Process::serve(dir.path(), &toml, free_addr()).await;
    let record = wait_terminal(&http, &second.base, &id, Duration::from_secs(30)).await;
    assert_eq!(record["status"], "succeeded", "{record}");
    assert_eq!(
        record["recoveries"], 0,
        "a hand-back is not a recovery: {record}"
    );
    assert_eq!(record["attempts"], 2, "{record}");
    assert_eq!(mock.calls(), 2);
    let resumed = get_events(&http, &second.base, &id, Some("1")).await;
    let (_, events) = read_events(resumed).await;
    assert_eq!(
        events[0].event.as_deref(),
        Some("reset"),
        "the new attempt follows a reset"
    );
    drop(second);
    mock.shutdown().await;
}

/// DU-5, RS-11, RD-9: an attempt handed back at shutdown first commits what it already
/// showed its stream's client, as a cancel does (decision 77), so the input tokens Anthropic's
/// `message_start` reported stay on the record as the first attempt's. Held by the chunk
/// writer while nobody followed the stream (DU-7, up to 50 ms), they were fenced out by the
/// hand-back.
#[tokio::test]
async fn a_stream_handed_back_at_shutdown_keeps_the_usage_it_already_showed_du5_rd9() {
    let mock = start_mock(MockConfig {
        chunks: 20,
        chunk_delay_ms: 1_000,
        ..MockConfig::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("holdfast.db").display());
    let anthropic = format!(
        "[[backends]]\nname = \"mock-anthropic\"\nkind = \"anthropic\"\nbase_url = \"{}\"",
        mock.base_url()
    );
    let toml = with_grace(fault_test_toml(&db, &anthropic, 2, &mock.base_url()), 1);
    let mut first = Process::serve(dir.path(), &toml, free_addr()).await;
    let http = reqwest::Client::new();
    let body = r#"{"model":"claude-sonnet-4-5","max_tokens":64,"stream":true,"messages":[{"role":"user","content":"hand me back once billed"}]}"#;
    let mut r = http
        .post(format!("{}/v1/messages", first.base))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let id = header(&r, "holdfast-request-id");
    let shown = first_events(&mut r, 1).await;
    assert_eq!(shown[0].event.as_deref(), Some("message_start"));
    assert!(first.sigterm_and_wait(Duration::from_secs(10)));
    drop(r);

    let second = Process::serve(dir.path(), &toml, free_addr()).await;
    let record = get_record(&http, &second.base, &id).await;
    let first_attempt = record["usage_by_attempt"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|u| u["attempt"] == 1);
    assert!(
        first_attempt.is_some_and(|u| u["input_tokens"].as_u64() > Some(0)),
        "the input the first attempt showed, billed: {record}"
    );
    drop(second);
    mock.shutdown().await;
}

/// DU-5: a hand-back at shutdown of attempt `max_attempts` fails the request with
/// `lease_expired` (what the sweep would do had the node crashed) instead of leaving it for an
/// attempt beyond the maximum: `attempts` stays 1 and the provider is called once.
#[tokio::test]
async fn sigterm_on_the_last_attempt_fails_the_request_so_attempts_never_exceed_the_maximum_du5() {
    let mock = start_mock(MockConfig {
        header_delay_ms: 10_000,
        ..MockConfig::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let toml =
        config_toml(dir.path(), &mock.base_url()).replace("max_attempts = 50", "max_attempts = 1");
    let toml = with_grace(toml, 200);
    let mut first = Process::serve(dir.path(), &toml, free_addr()).await;
    let http = reqwest::Client::new();
    let id = submit_async(&http, &first.base, chat_body("my only attempt")).await;
    wait_until(Duration::from_secs(10), "the provider call started", || {
        mock.calls() == 1
    })
    .await;
    assert!(
        first.sigterm_and_wait(Duration::from_secs(10)),
        "clean exit"
    );

    let second = Process::serve(dir.path(), &toml, free_addr()).await;
    let record = wait_terminal(&http, &second.base, &id, Duration::from_secs(10)).await;
    assert_eq!(record["status"], "failed", "{record}");
    assert_eq!(record["error"]["type"], "lease_expired", "{record}");
    assert_eq!(record["attempts"], 1, "never above max_attempts: {record}");
    assert_eq!(record["recoveries"], 0, "{record}");
    assert_eq!(mock.calls(), 1, "no second provider call");
    drop(second);
    mock.shutdown().await;
}

/// Starts Responses stream `body` on `node`, reads `n` of its events and SIGKILLs the node
/// mid-stream: the request's id and the killed attempt's response id.
async fn responses_stream_killed_after(
    node: &mut Process,
    http: &reqwest::Client,
    body: &'static str,
    n: usize,
) -> (String, String) {
    let mut response = http
        .post(format!("{}/v1/responses", node.base))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    let id = header(&response, "holdfast-request-id");
    let events = first_events(&mut response, n).await;
    let first: Value = serde_json::from_str(&events[0].data).unwrap();
    let response_id = first["response"]["id"].as_str().unwrap().to_string();
    node.kill9();
    drop(response);
    (id, response_id)
}

/// LC-8 with OpenAI's retrieval protocol (decision 25): after a SIGKILL mid-stream the request
/// re-runs as a new attempt with a new provider id. Retrieving the old id answers the request's
/// current response object (the new id, completed); streaming the old id from a position inside
/// the abandoned attempt gives that attempt's remaining stored events, then an error event in
/// OpenAI's shape, never a splice of two attempts (RS-4, RD-6).
#[tokio::test]
async fn a_response_id_of_an_abandoned_attempt_points_to_the_request_and_never_splices_lc8_rd6() {
    let mock = start_mock(MockConfig {
        chunks: 30,
        chunk_delay_ms: 60,
        ..MockConfig::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let toml = config_toml(dir.path(), &mock.base_url());
    let addr = free_addr();
    let mut first = Process::serve(dir.path(), &toml, addr).await;
    let http = reqwest::Client::new();
    let (id, old_id) = responses_stream_killed_after(
        &mut first,
        &http,
        r#"{"model":"gpt-4o-mini","input":"survive as a response","stream":true}"#,
        8,
    )
    .await;

    let second = Process::serve(dir.path(), &toml, free_addr()).await;
    let record = wait_terminal(&http, &second.base, &id, Duration::from_secs(30)).await;
    assert_eq!(record["status"], "succeeded", "{record}");
    assert_eq!(record["recoveries"], 1, "{record}");

    let object: Value = http
        .get(format!("{}/v1/responses/{old_id}", second.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_ne!(
        object["id"],
        old_id.as_str(),
        "the current attempt's response: {object}"
    );
    assert_eq!(object["status"], "completed", "{object}");

    let r = http
        .get(format!(
            "{}/v1/responses/{old_id}?stream=true&starting_after=3",
            second.base
        ))
        .send()
        .await
        .unwrap();
    let (_, replay) = read_events(r).await;
    let last: Value = serde_json::from_str(&replay.last().unwrap().data).unwrap();
    assert_eq!(last["error"]["code"], "attempt_abandoned", "{replay:?}");
    let numbers: Vec<i64> = replay[..replay.len() - 1]
        .iter()
        .map(|e| {
            let v: Value = serde_json::from_str(&e.data).unwrap();
            v["sequence_number"].as_i64().unwrap()
        })
        .collect();
    assert!(
        !numbers.is_empty(),
        "the abandoned attempt's stored events after 3"
    );
    assert_eq!(numbers[0], 4);
    assert_eq!(numbers, (4..4 + numbers.len() as i64).collect::<Vec<_>>());
    assert!(
        replay[..replay.len() - 1].iter().all(|e| {
            let v: Value = serde_json::from_str(&e.data).unwrap();
            v["response"]["id"].as_str().is_none_or(|r| r == old_id)
        }),
        "only the abandoned attempt's events"
    );
    drop(second);
    mock.shutdown().await;
}

/// RD-8 across an attempt that stored nothing: attempt 1 streams and is SIGKILLed (a reset
/// naming attempt 2 follows its events), attempt 2 gets a 503, attempt 3 answers. Each id is
/// served from its own attempt's events, and the abandoned id follows the request to attempt 3's
/// completed response, never to attempt 1's `in_progress` one (LC-8, RD-6, decision 25).
#[tokio::test]
async fn a_response_id_is_served_from_its_own_attempt_after_an_attempt_that_stored_nothing_lc8_rd8()
{
    let mock = start_mock(MockConfig {
        chunks: 30,
        chunk_delay_ms: 60,
        ..MockConfig::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let toml = config_toml(dir.path(), &mock.base_url());
    let mut first = Process::serve(dir.path(), &toml, free_addr()).await;
    let http = reqwest::Client::new();
    let (id, old_id) = responses_stream_killed_after(
        &mut first,
        &http,
        r#"{"model":"gpt-4o-mini","input":"a 503 between two attempts","stream":true}"#,
        4,
    )
    .await;

    // The next call fails with a 503 before any event; the one after answers.
    mock.set_config(MockConfig {
        chunks: 5,
        fail_first: 1,
        fail_status: 503,
        ..MockConfig::default()
    });
    let second = Process::serve(dir.path(), &toml, free_addr()).await;
    let record = wait_terminal(&http, &second.base, &id, Duration::from_secs(30)).await;
    assert_eq!(record["status"], "succeeded", "{record}");
    assert_eq!(record["attempts"], 3, "the 503 was an attempt: {record}");

    let followed = get_json(&http, &format!("{}/v1/responses/{old_id}", second.base)).await;
    assert_eq!(followed["status"], "completed", "{followed}");
    let new_id = followed["id"].as_str().unwrap().to_string();
    assert_ne!(new_id, old_id, "the latest attempt's response: {followed}");

    let own = get_json(&http, &format!("{}/v1/responses/{new_id}", second.base)).await;
    assert_eq!(own["id"], new_id.as_str(), "{own}");
    assert_eq!(own["status"], "completed", "{own}");

    let r = http
        .get(format!("{}/v1/responses/{new_id}?stream=true", second.base))
        .send()
        .await
        .unwrap();
    let (text, replay) = read_events(r).await;
    assert_eq!(
        replay.last().and_then(|e| e.event.as_deref()),
        Some("response.completed"),
        "{text}"
    );
    assert!(
        replay.iter().all(|e| {
            let v: Value = serde_json::from_str(&e.data).unwrap();
            v["response"]["id"].as_str().is_none_or(|r| r == new_id)
        }),
        "only the answering attempt's events: {text}"
    );
    drop(second);
    mock.shutdown().await;
}

/// Usage ledger across a crash (docs/usage.md): a Messages stream SIGKILLed after
/// `message_start` reported its input tokens re-runs; the record counts both attempts' usage
/// and shows each attempt's (the first was billed for its input).
#[tokio::test]
async fn a_request_recovered_after_sigkill_counts_the_usage_of_both_attempts_du1() {
    let mock = start_mock(MockConfig {
        chunks: 30,
        chunk_delay_ms: 60,
        ..MockConfig::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let toml = config_toml(dir.path(), &mock.base_url())
        + "[[backends]]\nname = \"mock-anthropic\"\nkind = \"anthropic\"\nbase_url = \""
        + &mock.base_url()
        + "\"\n";
    let mut first = Process::serve(dir.path(), &toml, free_addr()).await;
    let http = reqwest::Client::new();
    let body = r#"{"model":"claude-sonnet-4-5","max_tokens":64,"stream":true,"messages":[{"role":"user","content":"bill me twice"}]}"#;
    let mut response = http
        .post(format!("{}/v1/messages", first.base))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    let id = header(&response, "holdfast-request-id");
    first_events(&mut response, 6).await;
    first.kill9();
    drop(response);
    let second = Process::serve(dir.path(), &toml, free_addr()).await;
    let record = wait_terminal(&http, &second.base, &id, Duration::from_secs(30)).await;
    assert_eq!(record["status"], "succeeded", "{record}");
    assert_eq!(record["attempts"], 2, "{record}");
    let by_attempt = record["usage_by_attempt"].as_array().unwrap();
    assert_eq!(
        by_attempt.len(),
        2,
        "both attempts reported usage: {record}"
    );
    let first_input = by_attempt[0]["input_tokens"].as_u64().unwrap();
    assert!(first_input > 0, "{record}");
    assert_eq!(by_attempt[1]["input_tokens"].as_u64().unwrap(), first_input);
    assert_eq!(record["usage"]["input_tokens"], 2 * first_input, "{record}");
    assert_eq!(
        record["usage"]["output_tokens"],
        by_attempt[0]["output_tokens"].as_u64().unwrap_or(0) + 30
    );
    drop(second);
    mock.shutdown().await;
}
