//! The usage and savings ledger (issue 15, docs/usage.md): what every request cost, what
//! deduplication saved, in the record, `/usage` and `/metrics`. Tests that drive Python have
//! `python` in their name.

use std::time::{Duration, Instant};

use holdfast::config::Price;
use holdfast::mock::MockConfig;
use serde_json::Value;

use crate::helpers::*;

fn price(backend: &str, model: &str) -> Price {
    Price {
        backend: backend.into(),
        model: model.into(),
        input_per_mtok: 0.15,
        output_per_mtok: 0.60,
        cached_input_per_mtok: Some(0.075),
        cache_write_per_mtok: None,
        cache_write_1h_per_mtok: None,
    }
}

async fn json_get(app_http: &reqwest::Client, url: String, key: Option<&str>) -> Value {
    let mut req = app_http.get(url);
    if let Some(key) = key {
        req = req.header("authorization", format!("Bearer {key}"));
    }
    let r = req.send().await.unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

#[tokio::test]
async fn python_sdk_retries_become_deliveries_and_saved_calls_in_the_record_metrics_and_usage() {
    require_python(&["openai"]);
    let app = spawn_app(
        MockConfig {
            header_delay_ms: 3_000,
            ..MockConfig::default()
        },
        |c| c.prices = vec![price("mock-openai", "gpt-4o-*")],
    )
    .await;
    let base = format!("{}/v1", app.base);
    // Issue 15 acceptance 1: the SDK with timeout=1 and max_retries=2.
    let out = tokio::task::spawn_blocking(move || {
        run_python(
            "openai_timeout_retry.py",
            &[("HOLDFAST_BASE_URL", &base), ("SDK_MAX_RETRIES", "2")],
        )
    })
    .await
    .unwrap();
    let out: Value = serde_json::from_str(out.trim()).expect("driver prints JSON");
    assert_eq!(out["max_retries"], 2, "{out}");
    let timeouts = out["timeouts_seen"].as_u64().unwrap();
    assert!(
        (1..=2).contains(&timeouts),
        "the SDK timed out and retried: {out}"
    );
    assert_eq!(app.mock.calls(), 1);
    let list = json_get(&app.http, format!("{}/requests", app.base), None).await;
    let id = list["data"][0]["id"].as_str().unwrap().to_string();
    // Every submission the SDK made is a delivery: the timed-out ones and the answered one. A
    // delivery is counted just after its answer, so wait for the last one.
    wait_deliveries(&app.base, &id, None, timeouts + 1).await;
    let record = app.record(&id).await;
    assert_eq!(record["attempts"], 1, "{record}");
    let deliveries = record["deliveries"]["total"].as_u64().unwrap();
    assert!(deliveries >= 2, "{record}");
    let saved = record["saved_calls"].as_u64().unwrap();
    assert_eq!(saved, deliveries - 1, "{record}");
    // The provider's own usage, as it reported it in its answer.
    let reported = &record["response"]["body"]["usage"];
    let (input, output) = (
        reported["prompt_tokens"].as_u64().unwrap(),
        reported["completion_tokens"].as_u64().unwrap(),
    );
    assert_eq!(record["usage"]["input_tokens"], input, "{record}");
    assert_eq!(record["usage"]["output_tokens"], output, "{record}");
    assert_eq!(
        record["saved_tokens"]["input_tokens"],
        input * saved,
        "{record}"
    );
    let one_call = (input as f64 * 0.15 + output as f64 * 0.60) / 1e6;
    let saved_cost = record["saved_cost_usd"].as_f64().unwrap();
    assert!(
        (saved_cost - saved as f64 * one_call).abs() < 1e-12,
        "{record}"
    );
    assert!(
        (record["cost_usd"].as_f64().unwrap() - one_call).abs() < 1e-12,
        "{record}"
    );

    let usage = json_get(&app.http, format!("{}/usage", app.base), None).await;
    let totals = &usage["totals"];
    assert_eq!(totals["saved_calls"], saved, "{usage}");
    assert_eq!(totals["deliveries"], deliveries, "{usage}");
    assert_eq!(totals["upstream_calls"], 1, "{usage}");
    assert!((totals["saved_cost_usd"].as_f64().unwrap() - saved_cost).abs() < 1e-12);

    let page = app.metrics_text().await;
    let labels = r#"backend="mock-openai",model="gpt-4o-mini""#;
    assert_eq!(
        metric(&page, "holdfast_saved_calls_total", labels),
        saved as f64,
        "{page}"
    );
    assert_eq!(
        metric(
            &page,
            "holdfast_saved_tokens_total",
            &format!(r#"{labels},kind="input""#)
        ),
        (input * saved) as f64
    );
    assert_eq!(
        metric(
            &page,
            "holdfast_upstream_tokens_total",
            &format!(r#"{labels},kind="output""#)
        ),
        output as f64
    );
    let metric_cost = metric(&page, "holdfast_saved_cost_usd_total", labels);
    assert!(
        (metric_cost - saved_cost).abs() < 1e-9,
        "{metric_cost} vs {saved_cost}"
    );
    let cost = record["cost_usd"].as_f64().unwrap();
    let metric_cost = metric(&page, "holdfast_cost_usd_total", labels);
    assert!(
        (metric_cost - cost).abs() < 1e-9,
        "holdfast_cost_usd_total {metric_cost} vs the record's {cost}: {page}"
    );
    app.stop().await;
}

#[tokio::test]
async fn python_sdks_calls_on_every_route_record_the_providers_usage() {
    require_python(&["openai", "anthropic"]);
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    let url = app.base.clone();
    let out = tokio::task::spawn_blocking(move || {
        run_python("usage_routes.py", &[("HOLDFAST_URL", &url)])
    })
    .await
    .unwrap();
    let ids: Value = serde_json::from_str(out.trim()).unwrap();
    for (name, id) in ids.as_object().unwrap() {
        let record = wait_terminal(
            &app.http,
            &app.base,
            id.as_str().unwrap(),
            Duration::from_secs(10),
        )
        .await;
        assert_eq!(record["status"], "succeeded", "{name}: {record}");
        let usage = &record["usage"];
        assert!(
            usage["input_tokens"].as_u64().unwrap_or(0) > 0,
            "{name}: {record}"
        );
        if name != "embeddings" {
            assert_eq!(
                usage["output_tokens"], 8,
                "{name}: the mock's 8 pieces: {record}"
            );
        }
        assert_eq!(
            record["usage_by_attempt"].as_array().map(Vec::len),
            Some(1),
            "{name}"
        );
    }
    app.stop().await;
}

#[tokio::test]
async fn a_messages_stream_interrupted_after_message_start_keeps_its_input_tokens() {
    let app = spawn_app(
        MockConfig {
            chunks: 10,
            drop_after_chunks: Some(3),
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    let body = r#"{"model":"claude-sonnet-4-5","max_tokens":64,"stream":true,"messages":[{"role":"user","content":"cut me"}]}"#;
    let r = app.post("/v1/messages", body, &[]).await;
    let id = header(&r, "holdfast-request-id");
    let _ = r.bytes().await;
    let record = wait_terminal(&app.http, &app.base, &id, Duration::from_secs(10)).await;
    assert_eq!(record["error"]["type"], "stream_interrupted", "{record}");
    assert!(
        record["usage"]["input_tokens"].as_u64().unwrap() > 0,
        "it was billed: {record}"
    );
    app.stop().await;
}

/// The usage chunk of a chat stream: no choices, the usage.
fn is_usage_chunk(event: &holdfast::sse::SseEvent) -> bool {
    serde_json::from_str::<Value>(&event.data)
        .is_ok_and(|d| d["choices"].as_array().is_some_and(Vec::is_empty) && d["usage"].is_object())
}

/// RD-9, decision 40: holdfast asks for the usage of a stream whose client did not, stores and
/// counts it, and leaves the usage chunk out of that client's stream — a chunk without choices
/// breaks the loop every OpenAI example writes (`chunk.choices[0]`). A client that asked for it
/// gets it, and the request log shows every stored event.
#[tokio::test]
async fn inject_stream_usage_asks_the_provider_after_hashing_the_clients_body_and_shows_the_usage_chunk_only_to_who_asked_rs4_rd9()
 {
    let app = spawn_app(MockConfig::default(), |c| c.inject_stream_usage = true).await;
    let body = stream_body("count my tokens");
    let r = app.chat(&body).await;
    let id = header(&r, "holdfast-request-id");
    let (text, events) = read_events(r).await;
    assert!(
        !events.iter().any(is_usage_chunk),
        "the client did not ask for the usage chunk: {text}"
    );
    assert_eq!(
        events.last().map(|e| e.data.as_str()),
        Some("[DONE]"),
        "{text}"
    );
    let sent = &app.mock.recorded()[0].body;
    assert_eq!(sent["stream_options"]["include_usage"], true, "{sent}");
    // Only that member was added: the rest is the client's.
    let mut expected: Value = serde_json::from_str(&body).unwrap();
    expected["stream_options"] = serde_json::json!({"include_usage": true});
    assert_eq!(sent, &expected);
    let record = wait_terminal(&app.http, &app.base, &id, Duration::from_secs(10)).await;
    assert_eq!(record["usage"]["output_tokens"], 8, "{record}");
    let log = app
        .http
        .get(format!("{}/requests/{id}", app.base))
        .header("accept", "text/event-stream")
        .send()
        .await
        .unwrap();
    let (_, logged) = read_events(log).await;
    assert!(
        logged.iter().any(is_usage_chunk),
        "the log keeps every stored event"
    );
    // The identity is the client's body: the same body replays, without the usage chunk too,
    // and the edited body, sent by a client itself, is another request, which gets it.
    let again = app.chat(&body).await;
    assert_eq!(header(&again, "holdfast-request-id"), id);
    let (text, replayed) = read_events(again).await;
    assert!(!replayed.iter().any(is_usage_chunk), "{text}");
    let edited = app.chat(&expected.to_string()).await;
    assert_ne!(header(&edited, "holdfast-request-id"), id);
    let (text, asked) = read_events(edited).await;
    assert!(
        asked.iter().any(is_usage_chunk),
        "who asked sees it: {text}"
    );
    app.stop().await;
}

fn tenants_toml(mock_base: &str, db: &std::path::Path) -> String {
    format!(
        r#"database_url = "sqlite://{}"
admin_api_keys = ["admin-key"]
[[backends]]
name = "mock"
kind = "openai"
base_url = "{mock_base}"
[[namespaces]]
name = "a"
api_keys = ["key-a"]
[[namespaces]]
name = "b"
api_keys = ["key-b"]
[[prices]]
backend = "mock"
model = "gpt-4o-mini"
input_per_mtok = 0.15
output_per_mtok = 0.60
"#,
        db.display()
    )
}

#[tokio::test]
async fn usage_survives_a_restart_groups_every_way_and_stays_in_its_namespace() {
    let mock = start_mock(MockConfig::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let toml = tenants_toml(&mock.base_url(), &dir.path().join("holdfast.db"));
    let node = Process::serve(dir.path(), &toml, free_addr()).await;
    let http = reqwest::Client::new();
    for (key, text, times) in [
        ("key-a", "a one", 3),
        ("key-a", "a two", 1),
        ("key-b", "b one", 2),
    ] {
        for _ in 0..times {
            let r = http
                .post(format!("{}/v1/chat/completions", node.base))
                .header("authorization", format!("Bearer {key}"))
                .header("content-type", "application/json")
                .body(chat_body(text))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
        }
    }
    let get = |base: &str, query: &str, key: &'static str| {
        json_get(&http, format!("{base}/usage{query}"), Some(key))
    };
    // Duplicates are counted right after their answers: wait for the last count.
    for _ in 0..500 {
        if get(&node.base, "", "admin-key").await["totals"]["deliveries"] == 6 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut before = Vec::new();
    for query in [
        "",
        "?group_by=model",
        "?group_by=backend",
        "?group_by=namespace",
        "?group_by=day",
    ] {
        before.push(get(&node.base, query, "admin-key").await);
    }
    let a = get(&node.base, "", "key-a").await;
    assert_eq!(a["totals"]["requests"], 2, "{a}");
    assert_eq!(a["totals"]["saved_calls"], 2, "{a}");
    assert_eq!(a["namespace"], "a");
    let all = &before[0];
    assert_eq!(all["totals"]["requests"], 3, "{all}");
    assert_eq!(all["totals"]["deliveries"], 6, "{all}");
    assert_eq!(all["totals"]["saved_calls"], 3, "{all}");
    let by_ns = &before[3]["groups"];
    let keys: Vec<&str> = by_ns
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["key"].as_str().unwrap())
        .collect();
    assert_eq!(keys, ["a", "b"]);
    assert_eq!(before[1]["groups"][0]["key"], "gpt-4o-mini");
    assert_eq!(before[2]["groups"][0]["key"], "mock");
    let today = chrono::Utc::now().format("%Y-%m-%d").to_string();
    assert_eq!(before[4]["groups"][0]["key"], today.as_str());
    // A namespace key may not look elsewhere; an admin narrows with namespace=.
    let r = http
        .get(format!("{}/usage?namespace=b", node.base))
        .header("authorization", "Bearer key-a")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    // A window that ends before it starts is a mistake, not an empty ledger.
    let r = http
        .get(format!(
            "{}/usage?since=2026-12-03&until=2026-12-01",
            node.base
        ))
        .header("authorization", "Bearer key-a")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let error: Value = r.json().await.unwrap();
    assert!(
        error["error"]["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("until: ")),
        "{error}"
    );
    let b = get(&node.base, "?namespace=b", "admin-key").await;
    assert_eq!(b["totals"]["requests"], 1, "{b}");
    // The list too: a's key sees a's requests, the admin every namespace.
    let list_a = json_get(&http, format!("{}/requests", node.base), Some("key-a")).await;
    assert_eq!(list_a["data"].as_array().unwrap().len(), 2);
    let list_all = json_get(&http, format!("{}/requests", node.base), Some("admin-key")).await;
    assert_eq!(list_all["data"].as_array().unwrap().len(), 3);
    // The admin key is not a namespace key.
    let r = http
        .post(format!("{}/v1/chat/completions", node.base))
        .header("authorization", "Bearer admin-key")
        .header("content-type", "application/json")
        .body(chat_body("admin"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    drop(node);

    // After a restart the ledger is the same: it is the database's.
    let node = Process::serve(dir.path(), &toml, free_addr()).await;
    for (i, query) in [
        "",
        "?group_by=model",
        "?group_by=backend",
        "?group_by=namespace",
        "?group_by=day",
    ]
    .iter()
    .enumerate()
    {
        let mut after = get(&node.base, query, "admin-key").await;
        let mut was = before[i].clone();
        // `since` and `until` default to a window ending now.
        for field in ["since", "until"] {
            after[field] = Value::Null;
            was[field] = Value::Null;
        }
        assert_eq!(after, was, "{query}");
    }
    drop(node);
    mock.shutdown().await;
}

/// RD-9, DU-6: a burst of identical calls against a fast provider saves every call but the
/// first in `holdfast_saved_calls_total`, whether a duplicate's count reaches the database
/// before its request's outcome (counted by the attempt that finishes it) or after (counted by
/// the write that adds it). A new user's test saw the metric grow by 2 to 18 for 19 saved.
#[tokio::test]
async fn a_burst_of_identical_calls_counts_every_saved_call_in_the_metric_rd9_du6() {
    const ROUNDS: usize = 20;
    const BURST: usize = 20;
    let app = spawn_app(MockConfig::default(), |c| {
        c.prices = vec![price("mock-openai", "gpt-4o-*")];
    })
    .await;
    let labels = r#"backend="mock-openai",model="gpt-4o-mini""#;
    for round in 0..ROUNDS {
        let body = chat_body(&format!("burst {round}"));
        let answers = futures::future::join_all(
            (0..BURST).map(|_| app.post("/v1/chat/completions", body.clone(), &[])),
        )
        .await;
        let mut ids: Vec<String> = answers
            .iter()
            .map(|r| {
                assert_eq!(r.status(), 200);
                header(r, "holdfast-request-id")
            })
            .collect();
        ids.dedup();
        assert_eq!(ids.len(), 1, "one request per burst");
        wait_deliveries(&app.base, &ids[0], None, BURST as u64).await;
        let record = get_record(&app.http, &app.base, &ids[0]).await;
        assert_eq!(record["saved_calls"], BURST as u64 - 1, "{record}");
        // The metric, counted by whichever write came second, a moment after the record's.
        let want = ((round + 1) * (BURST - 1)) as f64;
        let start = Instant::now();
        loop {
            let page = app.metrics_text().await;
            let got = metric(&page, "holdfast_saved_calls_total", labels);
            if got == want {
                break;
            }
            assert!(
                got < want && start.elapsed() < Duration::from_secs(10),
                "round {round}: holdfast_saved_calls_total is {got}, the records say {want}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    app.stop().await;
}

/// `holdfast_saved_calls_total` counts an attachment when its request finishes, not when it
/// attaches: here the attached delivery's call was spent after all by a retry (attempt 1 got a
/// 503), so nothing was saved until a replay (docs/usage.md).
#[tokio::test]
async fn an_attachment_whose_call_a_retry_spent_is_not_counted_as_a_saved_call_rd9() {
    let app = spawn_app(
        MockConfig {
            header_delay_ms: 1_000,
            fail_first: 1,
            fail_status: 503,
            ..MockConfig::default()
        },
        |c| {
            c.prices = vec![price("mock-openai", "gpt-4o-*")];
            c.workers.backoff_initial_ms = 20;
        },
    )
    .await;
    let body = chat_body("attached, then retried");
    let id = submit_async(&app.http, &app.base, body.clone()).await;
    let attached = {
        let (http, url, body) = (
            app.http.clone(),
            format!("{}/v1/chat/completions", app.base),
            body.clone(),
        );
        tokio::spawn(async move {
            let r = http
                .post(url)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap();
            (r.status(), r.bytes().await.unwrap())
        })
    };
    wait_deliveries(&app.base, &id, None, 2).await;
    let record = get_record(&app.http, &app.base, &id).await;
    assert_eq!(
        record["attempts"], 1,
        "the duplicate attached during the first attempt: {record}"
    );
    let (status, _) = attached.await.unwrap();
    assert_eq!(status, 200);
    let record = wait_terminal(&app.http, &app.base, &id, Duration::from_secs(30)).await;
    assert_eq!(record["attempts"], 2, "{record}");
    assert_eq!(record["saved_calls"], 0, "{record}");
    let labels = r#"backend="mock-openai",model="gpt-4o-mini""#;
    let page = app.metrics_text().await;
    assert_eq!(
        metric(&page, "holdfast_saved_calls_total", labels),
        0.0,
        "{page}"
    );

    // A replay of the finished request is a call saved.
    let r = app.post("/v1/chat/completions", body, &[]).await;
    assert_eq!(header(&r, "idempotent-replayed"), "true");
    let page = app.metrics_text().await;
    assert_eq!(
        metric(&page, "holdfast_saved_calls_total", labels),
        1.0,
        "{page}"
    );
    // The replay's count reaches the database beside its answer, a moment later.
    wait_deliveries(&app.base, &id, None, 3).await;
    let record = get_record(&app.http, &app.base, &id).await;
    assert_eq!(record["saved_calls"], 1, "{record}");
    app.stop().await;
}

/// A stream cancelled after `message_start` reported its input tokens: the cancel's answer, the
/// list and `/usage` all show what the provider billed, priced (LC-9, docs/usage.md).
#[tokio::test]
async fn a_cancelled_stream_shows_the_usage_its_provider_reported_in_the_record_list_and_usage_lc9_rd9()
 {
    let app = spawn_app(
        MockConfig {
            chunks: 100,
            chunk_delay_ms: 50,
            ..MockConfig::default()
        },
        |c| c.prices = vec![price("mock-anthropic", "claude-*")],
    )
    .await;
    let body = r#"{"model":"claude-sonnet-4-5","max_tokens":64,"stream":true,"messages":[{"role":"user","content":"cancel me once billed"}]}"#;
    let mut r = app.post("/v1/messages", body, &[]).await;
    let id = header(&r, "holdfast-request-id");
    // The client may see these events before they are committed (RS-11): the cancel commits
    // what the attempt handed on before it fences the attempt out (LC-9, RD-9). Without that
    // the input tokens were lost when the cancel's commit came first (seen once in a loaded
    // full-suite run; the chunk writer's unit test pins the wait).
    first_events(&mut r, 3).await;
    let cancelled = post_json(&app.http, &format!("{}/requests/{id}/cancel", app.base)).await;
    assert_eq!(cancelled["error"]["type"], "cancelled", "{cancelled}");
    let input = cancelled["usage"]["input_tokens"].as_u64();
    assert!(input > Some(0), "the billed input: {cancelled}");
    assert!(cancelled["cost_usd"].as_f64() > Some(0.0), "{cancelled}");
    assert_eq!(
        cancelled["usage_by_attempt"][0]["input_tokens"].as_u64(),
        input,
        "{cancelled}"
    );

    let list = json_get(&app.http, format!("{}/requests", app.base), None).await;
    let listed = &list["data"][0];
    assert_eq!(listed["id"], id.as_str(), "{list}");
    assert_eq!(listed["usage"]["input_tokens"].as_u64(), input, "{listed}");
    assert_eq!(listed["cost_usd"], cancelled["cost_usd"], "{listed}");
    let usage = json_get(&app.http, format!("{}/usage", app.base), None).await;
    assert_eq!(
        usage["totals"]["usage"]["input_tokens"].as_u64(),
        input,
        "{usage}"
    );
    drop(r);
    app.stop().await;
}

/// LC-9, RD-9, decision 127: a cancel shuts its attempt's hand-on before it commits what the
/// attempt handed on, and keeps it shut until the attempt is fenced out, so no event reaches a
/// client that the cancel then loses. Here the provider reports its usage while the cancel
/// waits for the store (another process holds the database's write lock). Before, the usage
/// event was handed on during that wait and shown to the client, and the record kept no usage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_is_shown_no_usage_that_a_cancel_does_not_store_lc9_rd9() {
    let provider = StepwiseStream::start().await;
    let app = spawn_app(MockConfig::default(), |c| {
        use_backend_url(c, &provider.base_url())
    })
    .await;
    let chunk = |delta: &str, usage: &str| {
        format!(
            "data: {{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"model\":\"gpt-4o-mini\",\"choices\":{delta}{usage}}}\n\n"
        )
    };
    // Sent once the provider has the call: holdfast answers its client once the first events
    // are handed on.
    provider.send(&chunk(
        r#"[{"index":0,"delta":{"role":"assistant","content":"Hel"}}]"#,
        "",
    ));
    let mut r = app.chat(&stream_body("usage while cancelled")).await;
    assert_eq!(r.status(), 200);
    let id = header(&r, "holdfast-request-id");
    let shut = log_signal("cancel: hand-on shut", &id);
    let mut parser = holdfast::sse::SseParser::new();
    next_events(&mut r, &mut parser, 1).await;

    // Every commit holdfast makes now waits.
    let blocker = rusqlite::Connection::open(app.dir.path().join("holdfast.db")).unwrap();
    blocker.execute_batch("BEGIN IMMEDIATE").unwrap();
    let cancel = tokio::spawn({
        let (http, url) = (
            app.http.clone(),
            format!("{}/requests/{id}/cancel", app.base),
        );
        async move { post_json(&http, &url).await }
    });
    tokio::time::timeout(Duration::from_secs(30), shut.notified())
        .await
        .expect("the cancel shuts the attempt's hand-on");
    // The provider bills the call: the usage comes while the cancel waits for the store.
    provider.send(&chunk(
        r#"[{"index":0,"delta":{},"finish_reason":"stop"}]"#,
        r#","usage":{"prompt_tokens":11,"completion_tokens":7,"total_tokens":18}"#,
    ));
    // No signal says the attempt has read it (it waits at the gate, unseen): a moment for the
    // read, so that without the gate the event is shown before the store returns.
    tokio::time::sleep(Duration::from_millis(100)).await;
    blocker.execute_batch("ROLLBACK").unwrap();
    let cancelled = cancel.await.unwrap();
    assert_eq!(cancelled["error"]["type"], "cancelled", "{cancelled}");

    // What the client was shown, to the end of its stream.
    let mut shown = Vec::new();
    while let Some(piece) = r.chunk().await.expect("SSE body") {
        shown.extend(parser.push(&piece).expect("valid SSE"));
    }
    let shown_usage = shown
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(&e.data).ok())
        .find(|v| !v["usage"].is_null());
    let record = app.record(&id).await;
    match shown_usage {
        Some(event) => assert_eq!(
            record["usage"]["output_tokens"], event["usage"]["completion_tokens"],
            "the client was shown usage the record does not keep: {record}"
        ),
        None => assert_eq!(record["usage"]["output_tokens"], Value::Null, "{record}"),
    }
    assert_eq!(record["error"]["type"], "cancelled", "{record}");
    app.stop().await;
}

/// RD-9, IN-2, decision 81: a provider reporting a token count no answer can have (near 2^63,
/// a broken or hostile OpenAI-compatible server) gets it kept as not reported; what else it
/// reported stays. Before, two such answers overflowed the ledger's 64-bit sums in the
/// database and `GET /usage` answered 503 `store_unavailable` ("holdfast's database failed or did not answer in time")
/// from then on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_count_no_answer_can_have_is_not_reported_and_usage_still_answers_rd9_in2() {
    let answer = r#"{"id":"chatcmpl-x","object":"chat.completion","model":"gpt-4o-mini","choices":[{"index":0,"message":{"role":"assistant","content":"x"},"finish_reason":"stop"}],"usage":{"prompt_tokens":9223372036854775000,"completion_tokens":3,"total_tokens":9223372036854775003}}"#;
    let provider = RawProvider::start(raw_200("application/json", answer, false)).await;
    let app = spawn_app(MockConfig::default(), |c| {
        use_backend_url(c, &provider.base_url())
    })
    .await;
    let mut ids = Vec::new();
    for text in ["absurd one", "absurd two"] {
        let r = app.chat(&chat_body(text)).await;
        assert_eq!(r.status(), 200);
        ids.push(header(&r, "holdfast-request-id"));
        r.bytes().await.unwrap();
    }
    // A replay from the log: a saved call, whose tokens the ledger multiplies.
    app.chat(&chat_body("absurd one"))
        .await
        .bytes()
        .await
        .unwrap();
    for id in &ids {
        let record = app.record(id).await;
        assert_eq!(record["usage"]["input_tokens"], Value::Null, "{record}");
        assert_eq!(record["usage"]["output_tokens"], 3, "{record}");
    }
    let r = app
        .http
        .get(format!("{}/usage?group_by=model", app.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let usage: Value = r.json().await.unwrap();
    assert_eq!(usage["totals"]["usage"]["output_tokens"], 6, "{usage}");
}

/// RD-10, decision 103: Anthropic bills a one-hour prompt-cache write (`cache_control` with
/// `ttl: "1h"`, as Claude Code sends) at twice the input price and a five-minute one at 1.25
/// times, and splits its writes in `usage.cache_creation`. The ledger kept the total alone and
/// priced every write at `cache_write_per_mtok`: a one-hour write was billed 37.5 % short in
/// the record, `/usage`, its buckets and the saved cost. Now the one-hour part is
/// `cache_write_1h_tokens` everywhere the counts are, priced at `cache_write_1h_per_mtok`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_hour_cache_writes_are_counted_and_priced_apart_in_the_record_usage_and_metrics_rd10() {
    let answer = r#"{"id":"msg_1h","type":"message","role":"assistant","model":"claude-sonnet-4-5","content":[{"type":"text","text":"cached"}],"stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":20,"cache_creation_input_tokens":3000,"cache_read_input_tokens":500,"cache_creation":{"ephemeral_5m_input_tokens":1000,"ephemeral_1h_input_tokens":2000},"output_tokens":40}}"#;
    let provider = RawProvider::start(raw_200("application/json", answer, false)).await;
    let app = spawn_app(MockConfig::default(), |c| {
        use_backend_url(c, &provider.base_url());
        c.prices = vec![Price {
            backend: "mock-anthropic".into(),
            model: "claude-*".into(),
            input_per_mtok: 3.0,
            output_per_mtok: 15.0,
            cached_input_per_mtok: Some(0.30),
            cache_write_per_mtok: Some(3.75),
            cache_write_1h_per_mtok: Some(6.0),
        }];
    })
    .await;
    let body = r#"{"model":"claude-sonnet-4-5","max_tokens":64,"system":[{"type":"text","text":"a long system prompt","cache_control":{"type":"ephemeral","ttl":"1h"}}],"messages":[{"role":"user","content":"hi"}]}"#;
    let mut id = String::new();
    // The second submission is a replay: a saved call at the same usage.
    for _ in 0..2 {
        let r = app
            .post(
                "/v1/messages",
                body.to_string(),
                &[("anthropic-version", "2023-06-01")],
            )
            .await;
        assert_eq!(r.status(), 200);
        id = header(&r, "holdfast-request-id");
        r.bytes().await.unwrap();
    }
    assert_eq!(provider.calls(), 1);
    // 20 uncached at 3, 500 read at 0.30, 1000 five-minute writes at 3.75, 2000 one-hour
    // writes at 6, 40 out at 15 (every write at 3.75 would be 0.01206).
    let cost = (20.0 * 3.0 + 500.0 * 0.30 + 1000.0 * 3.75 + 2000.0 * 6.0 + 40.0 * 15.0) / 1e6;
    let close = |v: &Value, what: &str| {
        let got = v.as_f64().unwrap_or_else(|| panic!("{what}: {v}"));
        assert!((got - cost).abs() < 1e-12, "{what}: {got} != {cost}");
    };
    let record = app.record(&id).await;
    assert_eq!(record["usage"]["cache_write_tokens"], 3000, "{record}");
    assert_eq!(record["usage"]["cache_write_1h_tokens"], 2000, "{record}");
    assert_eq!(record["usage_by_attempt"][0]["cache_write_1h_tokens"], 2000);
    close(&record["cost_usd"], "record cost");
    // Replays are counted right after their answers: wait for the count.
    let mut usage = Value::Null;
    for _ in 0..500 {
        usage = json_get(&app.http, format!("{}/usage?bucket=hour", app.base), None).await;
        if usage["totals"]["saved_calls"] == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let totals = &usage["totals"];
    assert_eq!(totals["usage"]["cache_write_tokens"], 3000, "{usage}");
    assert_eq!(totals["usage"]["cache_write_1h_tokens"], 2000, "{usage}");
    assert_eq!(
        totals["saved_tokens"]["cache_write_1h_tokens"], 2000,
        "{usage}"
    );
    close(&totals["cost_usd"], "totals cost");
    close(&totals["saved_cost_usd"], "saved cost");
    let group = &usage["buckets"][0]["groups"][0];
    assert_eq!(group["usage"]["cache_write_1h_tokens"], 2000, "{usage}");
    close(&group["cost_usd"], "bucket cost");
    let metrics = app.metrics_text().await;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("holdfast_upstream_tokens_total{")
                && l.contains(r#"kind="cache_write_1h""#)
                && l.ends_with(" 2000")),
        "{metrics}"
    );
    app.stop().await;
}

/// RD-9a (decision 157): a stream whose provider reported no tokens (an OpenAI stream without
/// `stream_options.include_usage`, `inject_stream_usage` off) is counted `unmetered` in `GET
/// /usage`, and `holdfast usage` says so, and names a model with tokens and no price while the
/// total cost adds up the priced one. Before, the report showed the requests beside the tokens
/// and cost of fewer of them, with nothing to say why (a new-user trial).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_without_reported_tokens_is_counted_unmetered_and_the_cli_says_so_rd9a() {
    let app = spawn_app(MockConfig::default(), |c| {
        c.prices = vec![price("mock-openai", "gpt-4o-mini")];
    })
    .await;
    assert_eq!(app.chat(&chat_body("metered")).await.status(), 200);
    let unpriced = serde_json::json!({
        "model": "gpt-4o",
        "messages": [{"role": "user", "content": "metered, no price"}],
    });
    assert_eq!(app.chat(&unpriced.to_string()).await.status(), 200);
    let stream = app.chat(&stream_body("not metered")).await;
    let id = header(&stream, "holdfast-request-id");
    read_events(stream).await;
    let record = wait_terminal(&app.http, &app.base, &id, Duration::from_secs(10)).await;
    assert_eq!(record["status"], "succeeded", "{record}");

    let usage = json_get(&app.http, format!("{}/usage", app.base), None).await;
    assert_eq!(usage["totals"]["requests"], 3, "{usage}");
    assert_eq!(usage["totals"]["unmetered"], 1, "{usage}");
    let dir = tempfile::tempdir().unwrap();
    // The CLI runs as a process of its own while this runtime serves it.
    let base = app.base.clone();
    let (code, out, err) = tokio::task::spawn_blocking(move || {
        run_holdfast(dir.path(), &["usage"], &[("HOLDFAST_URL", &base)])
    })
    .await
    .expect("the CLI ran");
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("1 succeeded request(s) reported no tokens")
            && out.contains("inject_stream_usage"),
        "{out}"
    );
    assert!(
        out.contains("none for: gpt-4o\n"),
        "the unpriced model is named: {out}"
    );
    app.stop().await;
}
