//! Namespaces, model routing, explicit keys, cancel and list (CLI-5, ID-3, ID-5, ID-6, LC-9,
//! RD-7).

use std::time::Duration;

use holdfast::config::ModelRewrite;
use holdfast::mock::MockConfig;

use crate::helpers::*;

fn two_tenants(c: &mut holdfast::config::Config) {
    c.namespaces = two_namespaces("team-a", "team-b");
}

#[tokio::test]
async fn same_body_from_two_namespaces_is_two_requests_and_b_never_sees_a_cli5() {
    let app = spawn_app(MockConfig::default(), two_tenants).await;
    let body = chat_body("shared prompt");
    let a = app
        .post(
            "/v1/chat/completions",
            body.clone(),
            &[("authorization", "Bearer key-a")],
        )
        .await;
    let b = app
        .post(
            "/v1/chat/completions",
            body.clone(),
            &[("x-api-key", "key-b")],
        )
        .await;
    assert_eq!(a.status(), 200);
    assert_eq!(b.status(), 200);
    let id_a = header(&a, "holdfast-request-id");
    assert_ne!(id_a, header(&b, "holdfast-request-id"));
    assert_eq!(header(&b, "idempotent-replayed"), "false");
    assert_eq!(app.mock.calls(), 2);

    let get = |path: String, key: &'static str, accept: &'static str| {
        app.http
            .get(format!("{}{path}", app.base))
            .header("authorization", format!("Bearer {key}"))
            .header("accept", accept)
            .send()
    };
    assert_eq!(
        get(format!("/requests/{id_a}"), "key-a", "application/json")
            .await
            .unwrap()
            .status(),
        200
    );
    assert_eq!(
        get(format!("/requests/{id_a}"), "key-b", "application/json")
            .await
            .unwrap()
            .status(),
        404
    );
    assert_eq!(
        get(format!("/requests/{id_a}"), "key-b", "text/event-stream")
            .await
            .unwrap()
            .status(),
        404
    );
    let cancel = app
        .http
        .post(format!("{}/requests/{id_a}/cancel", app.base))
        .header("authorization", "Bearer key-b")
        .send()
        .await
        .unwrap();
    assert_eq!(cancel.status(), 404);
    let list: serde_json::Value = get("/requests".into(), "key-b", "application/json")
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids.len(), 1);
    assert!(!ids.contains(&id_a.as_str()));
    app.stop().await;
}

#[tokio::test]
async fn unknown_or_missing_key_gets_401_and_is_not_recorded_cli5_id8() {
    let app = spawn_app(MockConfig::default(), two_tenants).await;
    for headers in [
        vec![],
        vec![("authorization", "Bearer nope")],
        vec![("x-api-key", "key-a ")],
    ] {
        let r = app
            .post("/v1/chat/completions", chat_body("who am i"), &headers)
            .await;
        if headers.first().is_some_and(|h| h.1 == "key-a ") {
            // Surrounding whitespace is not part of a key, but the key itself must match.
            assert_eq!(r.status(), 200);
            continue;
        }
        assert_eq!(r.status(), 401);
        let err: serde_json::Value = r.json().await.unwrap();
        assert_eq!(err["error"]["code"], "invalid_api_key");
    }
    let r = app.post("/v1/messages", "{}", &[]).await;
    assert_eq!(r.status(), 401);
    let err: serde_json::Value = r.json().await.unwrap();
    assert_eq!(
        err["error"]["type"], "authentication_error",
        "Anthropic shape"
    );
    assert_eq!(app.mock.calls(), 1);
    app.stop().await;
}

/// An admin key reads every namespace's log but sends nothing: on a proxied route its 401 says
/// so, rather than calling a configured key unknown (CLI-5).
#[tokio::test]
async fn an_admin_key_on_a_proxied_route_is_told_it_needs_a_namespace_key_cli5() {
    let app = spawn_app(MockConfig::default(), |c| {
        two_tenants(c);
        c.admin_api_keys = vec!["admin-key".into()];
    })
    .await;
    let r = app
        .post(
            "/v1/chat/completions",
            chat_body("admin sends"),
            &[("authorization", "Bearer admin-key")],
        )
        .await;
    assert_eq!(r.status(), 401);
    let err: serde_json::Value = r.json().await.unwrap();
    assert_eq!(err["error"]["code"], "invalid_api_key");
    let message = err["error"]["message"].as_str().unwrap();
    assert!(message.contains("admin key"), "{message}");
    assert!(message.contains("namespace's key"), "{message}");
    assert_eq!(app.mock.calls(), 0);
    app.stop().await;
}

#[tokio::test]
async fn two_aliases_rewriting_to_one_model_make_one_upstream_call_with_the_rewritten_model_id3() {
    let app = spawn_app(MockConfig::default(), |c| {
        c.model_rewrites = vec![
            ModelRewrite {
                pattern: "fast".into(),
                backend: "mock-openai".into(),
                model: Some("gpt-4o-mini".into()),
            },
            ModelRewrite {
                pattern: "quick-*".into(),
                backend: "mock-openai".into(),
                model: Some("gpt-4o-mini".into()),
            },
        ];
    })
    .await;
    let fast = r#"{"model":"fast","messages":[{"role":"user","content":"alias"}]}"#;
    let quick = r#"{"messages":[{"role":"user","content":"alias"}],  "model" : "quick-v2"}"#;
    let r1 = app.chat(fast).await;
    let r2 = app.chat(quick).await;
    assert_eq!(r1.status(), 200);
    assert_eq!(
        header(&r1, "holdfast-request-id"),
        header(&r2, "holdfast-request-id")
    );
    assert_eq!(app.mock.calls(), 1);
    let recorded = app.mock.recorded();
    assert_eq!(
        recorded[0].body["model"], "gpt-4o-mini",
        "the provider saw the rewritten model"
    );
    let record = app.record(&header(&r1, "holdfast-request-id")).await;
    assert_eq!(record["model"], "gpt-4o-mini");
    assert_eq!(record["backend"], "mock-openai");
    app.stop().await;
}

/// RS-5, ID-4: a call that finishes after its claim's window has passed is answered without
/// `Holdfast-Claim-Expires-At` (the time is past: a re-send is a new request), and a re-send
/// is indeed a new request.
#[tokio::test]
async fn an_answer_after_its_window_names_no_claim_expiry_rs5_id4() {
    let app = spawn_app(
        MockConfig {
            header_delay_ms: 1_200,
            ..MockConfig::default()
        },
        |c| c.dedupe_window_secs = 1,
    )
    .await;
    let body = chat_body("longer than its window");
    let first = app.post("/v1/chat/completions", body.clone(), &[]).await;
    assert_eq!(first.status(), 200);
    assert_eq!(
        header(&first, "holdfast-claim-expires-at"),
        "",
        "no expiry in the past"
    );
    let again = app.post("/v1/chat/completions", body, &[]).await;
    assert_eq!(header(&again, "idempotent-replayed"), "false");
    assert_ne!(
        header(&again, "holdfast-request-id"),
        header(&first, "holdfast-request-id"),
        "a re-send after the window is a new request"
    );
    app.stop().await;
}

#[tokio::test]
async fn idempotency_keys_replay_refuse_reuse_and_split_id5() {
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    let body = chat_body("keyed");
    let k1 = app
        .post(
            "/v1/chat/completions",
            body.clone(),
            &[("idempotency-key", "k-1")],
        )
        .await;
    assert_eq!(k1.status(), 200);
    let id = header(&k1, "holdfast-request-id");
    let expires = header(&k1, "holdfast-claim-expires-at");
    let created = app.record(&id).await["created_at"]
        .as_str()
        .unwrap()
        .to_string();
    let expires =
        chrono::DateTime::parse_from_rfc3339(&expires).expect("the claim's expiry is advertised");
    let created = chrono::DateTime::parse_from_rfc3339(&created).unwrap();
    assert_eq!(
        (expires - created).num_seconds(),
        86_400,
        "idempotency_key_ttl_secs"
    );
    let replay = app
        .post(
            "/v1/chat/completions",
            body.clone(),
            &[("idempotency-key", "\"k-1\"")],
        )
        .await;
    assert_eq!(
        header(&replay, "holdfast-request-id"),
        id,
        "same key, same body: replay"
    );
    assert_eq!(header(&replay, "idempotent-replayed"), "true");

    let other_body = app
        .post(
            "/v1/chat/completions",
            chat_body("different"),
            &[("idempotency-key", "k-1")],
        )
        .await;
    assert_eq!(other_body.status(), 422, "same key, other body");
    assert_eq!(header(&other_body, "x-should-retry"), "false");
    let err: serde_json::Value = other_body.json().await.unwrap();
    assert_eq!(err["error"]["code"], "idempotency_key_reused");

    let k2 = app
        .post(
            "/v1/chat/completions",
            body.clone(),
            &[("idempotency-key", "k-2")],
        )
        .await;
    assert_ne!(
        header(&k2, "holdfast-request-id"),
        id,
        "two keys, same body: two requests"
    );
    assert_eq!(app.mock.calls(), 2);

    for bad in ["", "has space", "\"unterminated"] {
        let r = app
            .post(
                "/v1/chat/completions",
                body.clone(),
                &[("idempotency-key", bad)],
            )
            .await;
        assert_eq!(r.status(), 400, "key {bad:?}");
    }
    let long = "x".repeat(256);
    let r = app
        .post(
            "/v1/chat/completions",
            body.clone(),
            &[("idempotency-key", long.as_str())],
        )
        .await;
    assert_eq!(r.status(), 400);
    assert_eq!(app.mock.calls(), 2);
    app.stop().await;
}

#[tokio::test]
async fn keyed_request_refused_by_the_provider_replays_the_refusal_id6() {
    let app = spawn_app(
        MockConfig {
            fail_first: 1,
            fail_status: 400,
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    let body = chat_body("refused with a key");
    let first = app
        .post(
            "/v1/chat/completions",
            body.clone(),
            &[("idempotency-key", "refused")],
        )
        .await;
    assert_eq!(first.status(), 400);
    let again = app
        .post(
            "/v1/chat/completions",
            body.clone(),
            &[("idempotency-key", "refused")],
        )
        .await;
    assert_eq!(again.status(), 400, "the refusal is replayed");
    assert_eq!(header(&again, "idempotent-replayed"), "true");
    assert_eq!(app.mock.calls(), 1);
    // Without the key the body-hash claim was released: a new request.
    let unkeyed = app.chat(&body).await;
    assert_eq!(unkeyed.status(), 200);
    app.stop().await;
}

/// An app whose provider streams 100 events 50 ms apart: a stream runs for 5 s, time to cancel
/// it.
async fn app_with_five_second_streams() -> TestApp {
    spawn_app(
        MockConfig {
            chunks: 100,
            chunk_delay_ms: 50,
            ..MockConfig::default()
        },
        |_| {},
    )
    .await
}

/// LC-9, decision 127: a cancel received whole takes effect even when its caller closes the
/// connection the moment it has sent it (a fire-and-forget script). Before, hyper dropped the
/// handler with the connection, most times before it reached the cancel, and the stream ran on
/// to its end, billed.
#[tokio::test]
async fn a_cancel_whose_caller_hangs_up_at_once_still_cancels_lc9() {
    use tokio::io::AsyncWriteExt;
    let app = app_with_five_second_streams().await;
    let submitter = app.chat(&stream_body("cancel me and hang up")).await;
    let id = header(&submitter, "holdfast-request-id");
    let mut caller = tokio::net::TcpStream::connect(app.addr).await.unwrap();
    caller
        .write_all(
            format!(
                "POST /requests/{id}/cancel HTTP/1.1\r\nhost: {}\r\ncontent-length: 0\r\n\r\n",
                app.addr
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    drop(caller);
    // Without the cancel the stream ends `succeeded` after 5 s.
    let record = wait_terminal(&app.http, &app.base, &id, Duration::from_secs(30)).await;
    assert_eq!(record["error"]["type"], "cancelled", "{record}");
    drop(submitter);
    app.stop().await;
}

#[tokio::test]
async fn cancel_during_a_stream_fails_it_and_ends_every_reader_lc9() {
    let app = app_with_five_second_streams().await;
    let body = stream_body("cancel me");
    let submitter = app.chat(&body).await;
    let id = header(&submitter, "holdfast-request-id");
    let log_reader = get_events(&app.http, &app.base, &id, None).await;
    wait_until(
        Duration::from_secs(10),
        "the provider stream to be open",
        || app.mock.open_streams() == 1,
    )
    .await;
    let cancelled = app
        .http
        .post(format!("{}/requests/{id}/cancel", app.base))
        .send()
        .await
        .unwrap();
    assert_eq!(cancelled.status(), 200);
    let record: serde_json::Value = cancelled.json().await.unwrap();
    assert_eq!(record["status"], "failed");
    assert_eq!(record["error"]["type"], "cancelled");
    // docs/api.md quotes the message literally: the quote is the code's.
    let message = record["error"]["message"].as_str().unwrap();
    let api = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/api.md")).unwrap();
    assert!(
        api.contains(&format!("`{message}`, literally")),
        "docs/api.md quotes {message:?}"
    );
    // The upstream call is aborted: the provider sees its connection close within a second.
    wait_until(
        Duration::from_secs(1),
        "the upstream connection to close",
        || app.mock.open_streams() == 0,
    )
    .await;

    let (_, events) = tokio::time::timeout(Duration::from_secs(5), read_events(submitter))
        .await
        .expect("submitter ends");
    let last: serde_json::Value = serde_json::from_str(&events.last().unwrap().data).unwrap();
    assert_eq!(last["error"]["code"], "cancelled");
    let (_, log) = tokio::time::timeout(Duration::from_secs(5), read_events(log_reader))
        .await
        .expect("log reader ends");
    assert_eq!(log.last().unwrap().event.as_deref(), Some("end"));
    let calls_at_cancel = app.mock.recorded().len();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let record = app.record(&id).await;
    assert_eq!(
        record["status"], "failed",
        "the aborted attempt wrote nothing after the cancel"
    );
    assert_eq!(app.mock.recorded().len(), calls_at_cancel);
    // The claim is released a minute after the cancel (ID-6a): until then the same body is the
    // cancelled request, and no call is made for it.
    let again = app.chat(&stream_body("cancel me")).await;
    assert_eq!(header(&again, "holdfast-request-id"), id);
    drop(again);
    assert_eq!(app.mock.recorded().len(), calls_at_cancel);
    app.stop().await;
}

#[tokio::test]
async fn list_is_newest_first_filtered_by_status_and_paged_by_cursor_rd7() {
    let app = spawn_app(
        MockConfig {
            fail_first: 2,
            fail_status: 400,
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    let mut ids = Vec::new();
    for i in 0..5 {
        let r = app.chat(&chat_body(&format!("list {i}"))).await;
        ids.push(header(&r, "holdfast-request-id"));
    }
    ids.reverse();
    let page = |q: &str| {
        let url = format!("{}/requests{q}", app.base);
        let http = app.http.clone();
        async move {
            http.get(url)
                .send()
                .await
                .unwrap()
                .json::<serde_json::Value>()
                .await
                .unwrap()
        }
    };
    let all = page("").await;
    let got: Vec<String> = all["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(got, ids, "newest first");
    let failed = page("?status=failed").await;
    assert_eq!(failed["data"].as_array().unwrap().len(), 2);
    let first = page("?limit=2").await;
    assert_eq!(first["data"].as_array().unwrap().len(), 2);
    let cursor = first["next_cursor"].as_str().unwrap().to_string();
    let second = page(&format!("?limit=2&cursor={cursor}")).await;
    let second_ids: Vec<&str> = second["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["id"].as_str().unwrap())
        .collect();
    assert_eq!(second_ids, vec![ids[2].as_str(), ids[3].as_str()]);
    let r = app
        .http
        .get(format!("{}/requests?status=bogus", app.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    app.stop().await;
}

/// RS-13, ID-8: a namespace holding its cap of calls on a node (`max_held_requests_per_namespace`)
/// gets RS-8's retryable 503 `overloaded` in its route's provider shape, with nothing recorded
/// and no provider call, while another namespace's calls are still admitted and answered.
#[tokio::test]
async fn a_namespace_at_its_cap_of_held_calls_is_refused_while_another_is_still_admitted_rs13_id8()
{
    // The first two provider calls hang: team-a's two holders keep their slots.
    let app = spawn_app(
        MockConfig {
            hang_before_headers_ms: Some(60_000),
            hang_first: 2,
            ..MockConfig::default()
        },
        |c| {
            two_tenants(c);
            c.max_held_requests = 3;
            c.max_held_requests_per_namespace = Some(2);
        },
    )
    .await;
    let holders: Vec<_> = (0..2)
        .map(|i| {
            let (http, base) = (app.http.clone(), app.base.clone());
            tokio::spawn(async move {
                let _ = http
                    .post(format!("{base}/v1/chat/completions"))
                    .header("content-type", "application/json")
                    .header("authorization", "Bearer key-a")
                    .body(chat_body(&format!("holder {i}")))
                    .send()
                    .await;
            })
        })
        .collect();
    wait_until(
        Duration::from_secs(10),
        "team-a's holders to reach the provider",
        || app.mock.calls() == 2,
    )
    .await;

    let refused = [
        ("/v1/chat/completions", chat_body("a third")),
        (
            "/v1/messages",
            r#"{"model":"claude-x","max_tokens":8,"messages":[{"role":"user","content":"a third"}]}"#
                .to_string(),
        ),
    ];
    for (path, body) in refused {
        let r = app
            .post(path, body, &[("authorization", "Bearer key-a")])
            .await;
        assert_eq!(r.status(), 503, "{path}");
        assert_eq!(header(&r, "x-should-retry"), "true", "{path}");
        let ms: u64 = header(&r, "retry-after-ms")
            .parse()
            .expect("retry-after-ms");
        assert!(ms > 0 && ms <= 60_000, "{path}: {ms}");
        assert_eq!(header(&r, "holdfast-error"), "overloaded", "{path}");
        assert!(header(&r, "holdfast-request-id").is_empty(), "{path}");
        let body: serde_json::Value = r.json().await.expect("JSON");
        if path == "/v1/messages" {
            assert_eq!(body["type"], "error", "Anthropic's shape: {body}");
            assert_eq!(body["error"]["type"], "overloaded_error", "{body}");
        } else {
            assert_eq!(
                body["error"]["code"], "overloaded",
                "OpenAI's shape: {body}"
            );
        }
    }

    let b = app
        .post(
            "/v1/chat/completions",
            chat_body("team-b is still served"),
            &[("authorization", "Bearer key-b")],
        )
        .await;
    assert_eq!(b.status(), 200, "another namespace is admitted");
    assert_eq!(
        app.mock.calls(),
        3,
        "the refusals reached no provider; team-b's call did"
    );
    let listed = |key: &'static str| {
        let app = &app;
        async move {
            listed_by_namespace(app, key, "")
                .await
                .values()
                .sum::<usize>()
        }
    };
    assert_eq!(
        listed("key-a").await,
        2,
        "nothing recorded for the refusals"
    );
    assert_eq!(listed("key-b").await, 1);
    for holder in holders {
        holder.abort();
    }
    app.stop().await;
}

/// RS-13, decision 121: an operator sees which tenant is refused. Each refused call whose key
/// names a namespace is counted under that namespace and holdfast's cause in
/// `holdfast_refusals_total`, so team-a held at its cap shows as `overloaded` refusals of
/// team-a, not of team-b, whose own bad body is its own; a call with no valid key names no
/// namespace and is not counted there. Before, `/metrics` had only
/// `holdfast_requests_total{outcome="refused"}` by route: every tenant's refusals in one sum.
#[tokio::test]
async fn each_refusal_is_counted_under_the_namespace_of_its_key_and_its_cause_rs13() {
    let app = spawn_app(
        MockConfig {
            hang_before_headers_ms: Some(60_000),
            hang_first: 1,
            ..MockConfig::default()
        },
        |c| {
            two_tenants(c);
            c.max_held_requests_per_namespace = Some(1);
        },
    )
    .await;
    let holder = {
        let (http, base) = (app.http.clone(), app.base.clone());
        tokio::spawn(async move {
            let _ = http
                .post(format!("{base}/v1/chat/completions"))
                .header("content-type", "application/json")
                .header("authorization", "Bearer key-a")
                .body(chat_body("holder"))
                .send()
                .await;
        })
    };
    wait_until(
        Duration::from_secs(10),
        "team-a's holder to reach the provider",
        || app.mock.calls() == 1,
    )
    .await;
    for i in 0..2 {
        let r = app
            .post(
                "/v1/chat/completions",
                chat_body(&format!("over the cap {i}")),
                &[("authorization", "Bearer key-a")],
            )
            .await;
        assert_eq!(r.status(), 503);
    }
    let r = app
        .post(
            "/v1/chat/completions",
            "{not json".to_string(),
            &[("authorization", "Bearer key-b")],
        )
        .await;
    assert_eq!(r.status(), 400);
    let r = app
        .post(
            "/v1/chat/completions",
            chat_body("no key"),
            &[("authorization", "Bearer nobody")],
        )
        .await;
    assert_eq!(r.status(), 401);

    let page = app.metrics_text().await;
    let sample = |labels: &str| {
        let series = format!("holdfast_refusals_total{{{labels}}} ");
        page.lines()
            .find_map(|line| line.strip_prefix(series.as_str()))
            .map(|v| v.trim().to_string())
    };
    assert_eq!(
        sample(r#"namespace="team-a",code="overloaded""#).as_deref(),
        Some("2"),
        "{page}"
    );
    assert_eq!(
        sample(r#"namespace="team-b",code="invalid_json""#).as_deref(),
        Some("1"),
        "{page}"
    );
    assert_eq!(
        sample(r#"namespace="team-b",code="overloaded""#),
        None,
        "{page}"
    );
    assert!(
        !page.contains("invalid_api_key"),
        "a call without a valid key names no namespace: {page}"
    );
    holder.abort();
    app.stop().await;
}

/// Sends `n` `Prefer: respond-async` calls with `key`, each answered 202 (RS-9).
async fn send_async_calls(app: &TestApp, key: &str, n: usize) {
    let bearer = format!("Bearer {key}");
    for i in 0..n {
        let r = app
            .post(
                "/v1/chat/completions",
                chat_body(&format!("{key}'s flood {i}")),
                &[("authorization", &bearer), ("prefer", "respond-async")],
            )
            .await;
        assert_eq!(r.status(), 202, "{key} call {i}");
    }
}

/// Waits until `held` calls reach the provider, which holds every call until told otherwise,
/// then lets the calls after them through and sends one call with `key`: answered 200, and
/// not after 20 s of waiting for the held ones.
async fn held_calls_do_not_stall_a_call_of(app: &TestApp, held: u64, key: &str) {
    wait_until(
        Duration::from_secs(10),
        "the floods' calls to reach the provider",
        || app.mock.calls() >= held,
    )
    .await;
    app.mock.set_config(MockConfig::default());
    let answered = tokio::time::timeout(
        Duration::from_secs(20),
        app.post(
            "/v1/chat/completions",
            chat_body(&format!("{key} is not stalled")),
            &[("authorization", &format!("Bearer {key}"))],
        ),
    )
    .await
    .unwrap_or_else(|_| panic!("{key}'s call waited for the floods"));
    assert_eq!(answered.status(), 200);
}

/// How many requests `GET /requests` lists for `key` (of status `status`, any when empty), by
/// namespace.
async fn listed_by_namespace(
    app: &TestApp,
    key: &str,
    status: &str,
) -> std::collections::BTreeMap<String, usize> {
    let filter = if status.is_empty() {
        String::new()
    } else {
        format!("&status={status}")
    };
    let list: serde_json::Value = app
        .http
        .get(format!("{}/requests?limit=100{filter}", app.base))
        .header("authorization", format!("Bearer {key}"))
        .send()
        .await
        .expect("GET /requests")
        .json()
        .await
        .expect("JSON");
    let mut seen = std::collections::BTreeMap::new();
    for record in list["data"].as_array().expect("data") {
        let namespace = record["namespace"].as_str().expect("RD-1: its namespace");
        *seen.entry(namespace.to_string()).or_insert(0) += 1;
    }
    seen
}

/// A provider that holds every call for a minute (until the test lets calls through).
fn holding_provider() -> MockConfig {
    MockConfig {
        hang_before_headers_ms: Some(60_000),
        ..MockConfig::default()
    }
}

/// LC-2a, decision 144: one namespace's flood of `Prefer: respond-async` calls, each hanging at
/// the provider, holds its share of the node's worker slots and what was lent to it, never the
/// slot another namespace's call needs. With 6 slots and shares of 2, team-a's ten calls run
/// four at once (its share and two lent; team-b's share held) and the rest wait in the log;
/// team-b's call is then answered at once. Before, team-a's calls took every slot and
/// team-b's call waited in the log behind them for as long as the provider held them.
#[tokio::test]
async fn one_namespaces_flood_of_async_calls_never_holds_the_worker_slot_another_namespace_needs_lc2a()
 {
    let app = spawn_app(holding_provider(), |c| {
        two_tenants(c);
        c.workers.concurrency = 6;
        c.workers.concurrency_per_namespace = Some(2);
    })
    .await;
    send_async_calls(&app, "key-a", 10).await;
    held_calls_do_not_stall_a_call_of(&app, 4, "key-b").await;
    assert_eq!(
        app.mock.calls(),
        5,
        "team-a got no slot team-b's share holds"
    );
    let running = listed_by_namespace(&app, "key-a", "running").await;
    let pending = listed_by_namespace(&app, "key-a", "pending").await;
    assert_eq!(
        (running.get("team-a"), pending.get("team-a")),
        (Some(&4), Some(&6)),
        "team-a runs its share and two lent; the rest wait in the log"
    );
    app.stop().await;
}

/// LC-2a: a namespace over its share runs its queued calls as its own slots free, without
/// waiting for the dispatcher's poll: a lease that left due work for a slot waits for one to
/// free. With the poll an hour away, team-a's twelve async calls, four at a time, all finish.
#[tokio::test]
async fn a_namespace_over_its_share_runs_its_queued_calls_as_its_slots_free_lc2a() {
    let app = spawn_app(
        MockConfig {
            header_delay_ms: 50,
            ..MockConfig::default()
        },
        |c| {
            two_tenants(c);
            c.workers.concurrency = 6;
            c.workers.concurrency_per_namespace = Some(2);
            c.workers.poll_interval_ms = 3_600_000;
        },
    )
    .await;
    send_async_calls(&app, "key-a", 12).await;
    let started = std::time::Instant::now();
    loop {
        let succeeded = listed_by_namespace(&app, "key-a", "succeeded").await;
        if succeeded.get("team-a") == Some(&12) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "team-a's queued calls did not run as slots freed: {succeeded:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(app.mock.calls(), 12);
    app.stop().await;
}

/// LC-2a, decision 144: every namespace's unused share is held for it, so two namespaces
/// flooding at once, their calls hanging at the provider, still leave a third its share. With
/// 6 slots, shares of 2 and three namespaces, team-a and team-b run two each and team-c's call
/// is answered at once. With one share's worth kept free (CB-7's rule, the first cut of
/// LC-2a), team-b took it and team-c's call waited for as long as the provider held theirs.
/// An admin key's list names each record's namespace (RD-1): whose calls run, whose wait.
#[tokio::test]
async fn two_namespaces_flooding_at_once_still_leave_a_third_its_share_lc2a_rd1() {
    let app = spawn_app(holding_provider(), |c| {
        c.namespaces = two_namespaces("team-a", "team-b");
        let mut team_c = c.namespaces[0].clone();
        team_c.name = "team-c".into();
        team_c.api_keys = vec!["key-c".into()];
        c.namespaces.push(team_c);
        c.workers.concurrency = 6;
        c.workers.concurrency_per_namespace = Some(2);
        c.admin_api_keys = vec!["admin-key".into()];
    })
    .await;
    send_async_calls(&app, "key-a", 6).await;
    send_async_calls(&app, "key-b", 6).await;
    held_calls_do_not_stall_a_call_of(&app, 4, "key-c").await;
    assert_eq!(
        app.mock.calls(),
        5,
        "team-a and team-b ran their shares, nothing lent: the shares add up to every slot"
    );
    let running = listed_by_namespace(&app, "admin-key", "running").await;
    let pending = listed_by_namespace(&app, "admin-key", "pending").await;
    let two_each: std::collections::BTreeMap<String, usize> =
        [("team-a".to_string(), 2), ("team-b".to_string(), 2)].into();
    let four_each: std::collections::BTreeMap<String, usize> =
        [("team-a".to_string(), 4), ("team-b".to_string(), 4)].into();
    assert_eq!((running, pending), (two_each, four_each));
    app.stop().await;
}

/// LC-2b, decision 145: one namespace's burst of large bodies queues behind its own, so the
/// log's writer never holds more than its budget of them (`max_body_bytes`, here 3 MiB: one
/// 2 MiB body) and its large bodies are canonicalised off the runtime. With the database's
/// write lock taken by another process, team-a's first 2 MiB call waits for the lock; its next
/// two wait for the first, counted by namespace, while one over `max_body_bytes` is refused at
/// once. Once the lock is gone every call is answered (a small
/// one sent meanwhile too), each executed once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespaces_burst_of_large_bodies_waits_behind_its_own_lc2b() {
    let app = spawn_app(MockConfig::default(), |c| {
        two_tenants(c);
        c.max_body_bytes = 3 << 20;
    })
    .await;
    let path = app.dir.path().join("holdfast.db");
    let blocker = rusqlite::Connection::open(&path).unwrap();
    blocker.execute_batch("BEGIN IMMEDIATE").unwrap();
    let send = |key: &'static str, content: String| {
        let (http, base) = (app.http.clone(), app.base.clone());
        tokio::spawn(async move {
            let r = http
                .post(format!("{base}/v1/chat/completions"))
                .header("content-type", "application/json")
                .header("authorization", format!("Bearer {key}"))
                .body(chat_body(&content))
                .send()
                .await
                .expect("answered");
            (r.status().as_u16(), r.bytes().await.map(|b| b.len()))
        })
    };
    let large = |i: usize| format!("large {i} {}", "x".repeat(2 << 20));
    let calls: Vec<_> = (0..3).map(|i| send("key-a", large(i))).collect();
    let waiting = |page: &str| {
        metric(
            page,
            "holdfast_large_bodies_waiting",
            "namespace=\"team-a\"",
        )
    };
    let mut page = String::new();
    for _ in 0..200 {
        page = app.metrics_text().await;
        if waiting(&page) == 2.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        waiting(&page),
        2.0,
        "two of team-a's large calls wait for its first to be recorded: {page}"
    );
    // One declared over `max_body_bytes` is refused at once, unread, not after team-a's earlier
    // ones (IN-1): its headers alone get the 413.
    let oversized = tokio::time::timeout(Duration::from_secs(10), async {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut socket = tokio::net::TcpStream::connect(app.addr).await.unwrap();
        let head = "POST /v1/chat/completions HTTP/1.1\r\nhost: holdfast\r\n\
                    authorization: Bearer key-a\r\ncontent-type: application/json\r\n\
                    content-length: 4194304\r\n\r\n";
        socket.write_all(head.as_bytes()).await.unwrap();
        let mut answer = vec![0; 64];
        let n = socket.read(&mut answer).await.unwrap();
        String::from_utf8_lossy(&answer[..n]).into_owned()
    })
    .await
    .expect("an oversized body waited for the namespace's budget");
    assert!(oversized.starts_with("HTTP/1.1 413"), "{oversized}");
    let small = send("key-a", "small, beside team-a's large ones".into());
    blocker.execute_batch("ROLLBACK").unwrap();
    drop(blocker);
    for call in calls.into_iter().chain([small]) {
        let (status, body) = call.await.unwrap();
        assert_eq!(status, 200);
        assert!(body.is_ok());
    }
    assert_eq!(app.mock.calls(), 4, "each call executed once");
    let page = app.metrics_text().await;
    assert_eq!(waiting(&page), 0.0, "{page}");
    assert!(
        !page.contains("holdfast_large_bodies_waiting{namespace=\"team-b\"}"),
        "team-b never waited: {page}"
    );
    app.stop().await;
}

/// LC-2c: a namespace holds at most four `max_body_bytes` of large bodies in memory on a node,
/// counted from before each is read. A trial's tenant sent 80 bodies of 31 MB at once, each
/// under `max_body_bytes` and within its cap of held calls: holdfast grew to 4.2 GB (an
/// allocation failure under a 4 GB limit took every tenant down). Here team-a's four uploads of
/// 2 MiB that have sent their headers and stall hold its 8 MiB: its next large call is refused
/// at once, retryably, while its small calls and team-b's large ones are answered; once the
/// uploads go, its large calls are answered again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_holds_at_most_four_budgets_of_large_bodies_in_memory_lc2c() {
    use tokio::io::AsyncWriteExt;
    let app = spawn_app(MockConfig::default(), |c| {
        two_tenants(c);
        c.max_body_bytes = 2 << 20;
    })
    .await;
    let mut stalled = Vec::new();
    for _ in 0..4 {
        let mut socket = tokio::net::TcpStream::connect(app.addr).await.unwrap();
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: holdfast\r\n\
             authorization: Bearer key-a\r\ncontent-type: application/json\r\n\
             content-length: {}\r\n\r\n{{\"model\"",
            2 << 20
        );
        socket.write_all(head.as_bytes()).await.unwrap();
        stalled.push(socket);
    }
    let send = |key: &'static str, content: String| {
        let (http, base) = (app.http.clone(), app.base.clone());
        async move {
            http.post(format!("{base}/v1/chat/completions"))
                .header("content-type", "application/json")
                .header("authorization", format!("Bearer {key}"))
                .body(chat_body(&content))
                .send()
                .await
                .expect("answered")
        }
    };
    let large = |i: usize| format!("large {i} {}", "x".repeat((1 << 20) + 1000));
    // The stalled uploads' handlers run as their headers arrive: until all four hold their
    // bytes, a large call may still fit.
    let mut refused = None;
    for i in 0..200 {
        let r = send("key-a", large(i)).await;
        if r.status() == 503 {
            refused = Some(r);
            break;
        }
        assert_eq!(r.status(), 200);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let refused = refused.expect("team-a's large call past its memory was refused");
    assert_eq!(header(&refused, "holdfast-error"), "overloaded");
    assert_eq!(header(&refused, "x-should-retry"), "true");
    let body: serde_json::Value = refused.json().await.unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("bytes of large request bodies")),
        "{body}"
    );
    assert_eq!(
        send("key-a", "small beside them".into()).await.status(),
        200
    );
    assert_eq!(send("key-b", large(1_000)).await.status(), 200);
    drop(stalled);
    let mut status = 0;
    for i in 0..200 {
        status = send("key-a", large(2_000 + i)).await.status().as_u16();
        if status == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        status, 200,
        "team-a's memory came back with its uploads gone"
    );
    app.stop().await;
}

/// LC-2b: a large body is read before it waits for its namespace's budget. Two of team-a's
/// 2 MiB bodies on one HTTP/2 connection, more than its 3 MiB budget together, are both
/// answered; when the second waited unread, its data held the connection's flow-control
/// window, the first's upload could not finish, and neither call ever ended (found by a trial).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_large_bodies_on_one_http2_connection_past_the_budget_are_both_answered_lc2b() {
    let app = spawn_app(MockConfig::default(), |c| {
        two_tenants(c);
        c.max_body_bytes = 3 << 20;
    })
    .await;
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let send = |i: usize| {
        let (h2, base) = (h2.clone(), app.base.clone());
        async move {
            let r = h2
                .post(format!("{base}/v1/chat/completions"))
                .header("content-type", "application/json")
                .header("authorization", "Bearer key-a")
                .body(chat_body(&format!("over h2 {i} {}", "x".repeat(2 << 20))))
                .send()
                .await
                .expect("answered");
            assert_eq!(r.version(), reqwest::Version::HTTP_2);
            r.status().as_u16()
        }
    };
    let both = tokio::time::timeout(
        Duration::from_secs(30),
        futures::future::join(send(0), send(1)),
    )
    .await
    .expect("the two uploads waited for each other");
    assert_eq!(both, (200, 200));
    assert_eq!(app.mock.calls(), 2);
    app.stop().await;
}
