//! Non-stream proxying: claims, attach, replay, retries, refusals (ID-*, RS-*, LC-5, LC-6).

use std::time::Duration;

use futures::future::join_all;
use holdfast::mock::MockConfig;

use crate::helpers::*;

async fn count_requests(app: &TestApp) -> i64 {
    let path = app.dir.path().join("holdfast.db");
    let db =
        rusqlite::Connection::open_with_flags(&path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .expect("open test db");
    db.query_row("SELECT COUNT(*) FROM requests", [], |row| row.get(0))
        .expect("count")
}

#[tokio::test]
async fn same_body_twice_calls_upstream_once_and_replays_byte_identical_rs3() {
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    let body = chat_body("same body twice");

    let first = app.chat(&body).await;
    assert_eq!(first.status(), 200);
    let first_id = header(&first, "holdfast-request-id");
    assert_eq!(header(&first, "idempotent-replayed"), "false");
    assert!(
        header(&first, "x-request-id").starts_with("req_mock_"),
        "RS-5 provider request id"
    );
    let first_bytes = first.bytes().await.unwrap();

    let second = app.chat(&body).await;
    assert_eq!(second.status(), 200);
    assert_eq!(header(&second, "idempotent-replayed"), "true");
    assert_eq!(header(&second, "holdfast-request-id"), first_id);
    let second_bytes = second.bytes().await.unwrap();

    assert_eq!(first_bytes, second_bytes, "replay must be byte-identical");
    assert_eq!(app.mock.calls(), 1);
    let record = app.record(&first_id).await;
    assert_eq!(record["status"], "succeeded");
    assert_eq!(record["attempts"], 1);
    assert_eq!(record["response"]["status"], 200);
    let stored: serde_json::Value = serde_json::from_slice(&first_bytes).unwrap();
    assert_eq!(
        record["response"]["body"], stored,
        "RD-1 response.body is the provider JSON"
    );
    app.stop().await;
}

#[tokio::test]
async fn fifty_concurrent_identical_requests_make_one_upstream_call_id7_rs2() {
    let app = spawn_app(
        MockConfig {
            header_delay_ms: 300,
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    let body = chat_body("fifty at once");
    let answers = join_all((0..50).map(|_| async {
        let r = app.chat(&body).await;
        let status = r.status().as_u16();
        let id = header(&r, "holdfast-request-id");
        let replayed = header(&r, "idempotent-replayed");
        (status, id, replayed, r.bytes().await.unwrap())
    }))
    .await;
    assert_eq!(app.mock.calls(), 1, "exactly one upstream call");
    let (_, id0, _, body0) = &answers[0];
    for (status, id, _, bytes) in &answers {
        assert_eq!(*status, 200);
        assert_eq!(id, id0);
        assert_eq!(bytes, body0);
    }
    let originals = answers.iter().filter(|a| a.2 == "false").count();
    assert_eq!(originals, 1, "exactly one answer started the execution");
    app.stop().await;
}

/// Issue 30, decision 55: with the default `workers.concurrency`, 300 slow calls (more than the
/// old pool of 64) all reach the provider at once: none waits for another to finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_default_configuration_hundreds_of_slow_calls_run_at_once_decision55() {
    const CALLS: u64 = 300;
    let app = spawn_app(
        MockConfig {
            header_delay_ms: 30_000,
            ..MockConfig::default()
        },
        // The default pool; a short grace, so that stopping does not wait out the calls.
        |c| c.shutdown_grace_ms = 100,
    )
    .await;
    let calls: Vec<_> = (0..CALLS)
        .map(|i| {
            let (http, url) = (
                app.http.clone(),
                format!("{}/v1/chat/completions", app.base),
            );
            tokio::spawn(async move {
                http.post(url)
                    .header("content-type", "application/json")
                    .body(chat_body(&format!("slow call {i}")))
                    .send()
                    .await
            })
        })
        .collect();
    // The provider answers none of them within the wait: only running at once gets there.
    wait_until(
        Duration::from_secs(20),
        "every call reached the provider",
        || app.mock.calls() == CALLS,
    )
    .await;
    for call in calls {
        call.abort();
    }
    app.stop().await;
}

#[tokio::test]
async fn transient_500s_are_retried_until_success_and_counted_as_attempts_lc5() {
    let app = spawn_app(
        MockConfig {
            fail_first: 2,
            fail_status: 500,
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    let r = app.chat(&chat_body("500 500 200")).await;
    assert_eq!(r.status(), 200);
    let id = header(&r, "holdfast-request-id");
    assert_eq!(app.mock.calls(), 3);
    let record = app.record(&id).await;
    assert_eq!(record["status"], "succeeded");
    assert_eq!(record["attempts"], 3);
    assert_eq!(record["recoveries"], 0);
    assert!(
        record["error"].is_null(),
        "a success clears the transient error"
    );
    app.stop().await;
}

#[tokio::test]
async fn provider_400_is_terminal_final_and_releases_the_body_claim_a_minute_later_lc6_id6_id6a_rs7()
 {
    let app = spawn_app(
        MockConfig {
            fail_first: 1,
            fail_status: 400,
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    let body = chat_body("refused once");
    let r = app.chat(&body).await;
    assert_eq!(r.status(), 400);
    assert_eq!(header(&r, "x-should-retry"), "false");
    let id = header(&r, "holdfast-request-id");
    let refusal: serde_json::Value = r.json().await.unwrap();
    assert!(
        refusal["error"]["message"].is_string(),
        "the provider's own body: {refusal}"
    );
    let record = app.record(&id).await;
    assert_eq!(record["status"], "failed");
    assert_eq!(record["error"]["type"], "upstream_refused");
    assert_eq!(record["error"]["status"], 400);
    assert_eq!(record["attempts"], 1);

    // The claim is released a minute after the failure (ID-6a): until then the same body is
    // the failed request, and the refusal is answered again without a provider call.
    let again = app.chat(&body).await;
    assert_eq!(again.status(), 400, "the refusal, replayed");
    assert_eq!(header(&again, "holdfast-request-id"), id);
    assert_eq!(header(&again, "x-should-retry"), "false");
    let finished = record["finished_at"].as_str().expect("finished_at");
    let finished = chrono::DateTime::parse_from_rfc3339(finished).expect("RFC 3339");
    let expires = header(&again, "holdfast-claim-expires-at");
    let expires = chrono::DateTime::parse_from_rfc3339(&expires).expect("RFC 3339");
    assert_eq!((expires - finished).num_milliseconds(), 60_000);
    assert_eq!(app.mock.calls(), 1);
    app.stop().await;
}

#[tokio::test]
async fn exhausted_transient_failures_answer_502_with_should_retry_false_rs7() {
    let app = spawn_app(
        MockConfig {
            fail_first: 100,
            fail_status: 503,
            ..MockConfig::default()
        },
        |c| c.workers.max_attempts = 3,
    )
    .await;
    let r = app.chat(&chat_body("always 503")).await;
    assert_eq!(r.status(), 502);
    assert_eq!(header(&r, "x-should-retry"), "false");
    assert_eq!(header(&r, "holdfast-error"), "attempts_exhausted");
    let err: serde_json::Value = r.json().await.unwrap();
    assert_eq!(
        err["error"]["code"], "attempts_exhausted",
        "RS-6 OpenAI shape"
    );
    assert_eq!(app.mock.calls(), 3);
    app.stop().await;
}

/// RS-7a: retries that end on the provider's 429 answer 429 in each provider's shape (the
/// SDKs' rate-limit error), not 502, and still tell the SDK not to retry.
#[tokio::test]
async fn exhausted_rate_limits_answer_429_in_the_routes_shape_with_should_retry_false_rs7a() {
    let app = spawn_app(
        MockConfig {
            fail_first: 100,
            fail_status: 429,
            ..MockConfig::default()
        },
        |c| {
            c.workers.max_attempts = 2;
            c.workers.backoff_initial_ms = 1;
            c.workers.backoff_max_ms = 5;
        },
    )
    .await;
    let cases = [
        (
            "/v1/chat/completions",
            serde_json::json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "rl"}]}),
        ),
        (
            "/v1/messages",
            serde_json::json!({"model": "claude-3-5-haiku", "max_tokens": 8,
                   "messages": [{"role": "user", "content": "rl"}]}),
        ),
        (
            "/v1beta/models/gemini-2.0-flash:generateContent",
            serde_json::json!({"contents": [{"role": "user", "parts": [{"text": "rl"}]}]}),
        ),
    ];
    for (path, body) in cases {
        let r = app.post(path, body.to_string(), &[]).await;
        assert_eq!(r.status(), 429, "{path}");
        assert_eq!(header(&r, "x-should-retry"), "false", "{path}");
        assert_eq!(header(&r, "holdfast-error"), "attempts_exhausted", "{path}");
        let err: serde_json::Value = r.json().await.unwrap();
        match path {
            "/v1/chat/completions" => {
                assert_eq!(err["error"]["type"], "rate_limit_error", "{err}");
                assert_eq!(err["error"]["code"], "attempts_exhausted", "{err}");
            }
            "/v1/messages" => assert_eq!(err["error"]["type"], "rate_limit_error", "{err}"),
            _ => assert_eq!(err["error"]["status"], "RESOURCE_EXHAUSTED", "{err}"),
        }
    }
    assert_eq!(app.mock.calls(), 6, "two attempts each");
    app.stop().await;
}

#[tokio::test]
async fn key_order_and_whitespace_do_not_split_a_request_id1() {
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    let a =
        r#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}],"temperature":1}"#;
    let b = "{ \"temperature\" : 1 ,\n \"messages\" : [ { \"content\" : \"hi\" , \"role\" : \"user\" } ] , \"model\" : \"gpt-4o-mini\" }";
    let ra = app.chat(a).await;
    let rb = app.chat(b).await;
    assert_eq!(ra.status(), 200);
    assert_eq!(
        header(&ra, "holdfast-request-id"),
        header(&rb, "holdfast-request-id")
    );
    assert_eq!(header(&rb, "idempotent-replayed"), "true");
    assert_eq!(app.mock.calls(), 1);
    app.stop().await;
}

#[tokio::test]
async fn number_spelling_splits_a_request_id1() {
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    let one = r#"{"model":"gpt-4o-mini","messages":[],"temperature":1}"#;
    let one_point_oh = r#"{"model":"gpt-4o-mini","messages":[],"temperature":1.0}"#;
    let r1 = app.chat(one).await;
    let r2 = app.chat(one_point_oh).await;
    assert_ne!(
        header(&r1, "holdfast-request-id"),
        header(&r2, "holdfast-request-id")
    );
    assert_eq!(app.mock.calls(), 2);
    app.stop().await;
}

#[tokio::test]
async fn invalid_bodies_get_400_in_provider_shape_and_are_not_recorded_id2_id8() {
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    let cases: [(&[u8], &str); 6] = [
        (br#"{"model":"m","model":"n"}"#, "duplicate_key"),
        (b"{\"model\": \"m\"", "invalid_json"),
        (b"[1,2]", "body_not_object"),
        (b"{\"a\":\"\xff\"}", "invalid_unicode"),
        (br#"{"a":"\ud800"}"#, "invalid_unicode"),
        (b"", "invalid_json"),
    ];
    for (body, code) in cases {
        let r = app.post("/v1/chat/completions", body.to_vec(), &[]).await;
        assert_eq!(r.status(), 400, "{}", String::from_utf8_lossy(body));
        assert_eq!(header(&r, "holdfast-error"), code);
        let err: serde_json::Value = r.json().await.unwrap();
        assert_eq!(err["error"]["code"], code);
        assert_eq!(err["error"]["type"], "invalid_request_error");
    }
    let deep = format!("{{\"a\":{}{}}}", "[".repeat(10_000), "]".repeat(10_000));
    let r = app.post("/v1/chat/completions", deep, &[]).await;
    assert_eq!(r.status(), 400);
    assert_eq!(header(&r, "holdfast-error"), "too_deep");
    // Anthropic routes answer in Anthropic's shape.
    let r = app.post("/v1/messages", "nope", &[]).await;
    assert_eq!(r.status(), 400);
    let err: serde_json::Value = r.json().await.unwrap();
    assert_eq!(err["type"], "error");
    assert_eq!(err["error"]["type"], "invalid_request_error");

    assert_eq!(count_requests(&app).await, 0, "ID-8: nothing recorded");
    assert_eq!(app.mock.calls(), 0);
    app.stop().await;
}

/// IN-1: a compressed body on a logged route is refused, unread, with 415
/// `unsupported_content_encoding` in the route's provider shape, not read as JSON and refused
/// as `invalid_unicode` (a new-user trial's gzip body); nothing is recorded or called, and
/// `Content-Encoding: identity` is a plain body.
#[tokio::test]
async fn a_compressed_body_is_refused_with_415_in_the_providers_shape_in1() {
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    let gzipped = [
        0x1f_u8, 0x8b, 0x08, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x03,
    ]
    .to_vec();
    let r = app
        .post(
            "/v1/chat/completions",
            gzipped.clone(),
            &[("content-encoding", "gzip")],
        )
        .await;
    assert_eq!(r.status(), 415);
    assert_eq!(header(&r, "holdfast-error"), "unsupported_content_encoding");
    let err: serde_json::Value = r.json().await.unwrap();
    assert_eq!(err["error"]["code"], "unsupported_content_encoding");
    assert!(
        err["error"]["message"].as_str().unwrap().contains("gzip"),
        "{err}"
    );
    let r = app
        .post("/v1/messages", gzipped, &[("content-encoding", "gzip")])
        .await;
    assert_eq!(r.status(), 415);
    let err: serde_json::Value = r.json().await.unwrap();
    assert_eq!(err["type"], "error", "Anthropic's shape: {err}");
    assert_eq!(count_requests(&app).await, 0, "ID-8: nothing recorded");
    assert_eq!(app.mock.calls(), 0);
    let r = app
        .post(
            "/v1/chat/completions",
            chat_body("identity is plain"),
            &[("content-encoding", "identity")],
        )
        .await;
    assert_eq!(r.status(), 200);
    app.stop().await;
}

#[tokio::test]
async fn oversized_body_gets_413_unknown_route_404_wrong_method_405_in1() {
    let app = spawn_app(MockConfig::default(), |c| c.max_body_bytes = 1024).await;
    let big = chat_body(&"x".repeat(2048));
    let r = app.chat(&big).await;
    assert_eq!(r.status(), 413);
    let err: serde_json::Value = r.json().await.unwrap();
    assert_eq!(err["error"]["code"], "request_too_large");

    let r = app.post("/v1/nope", "{}", &[]).await;
    assert_eq!(r.status(), 404);
    let err: serde_json::Value = r.json().await.unwrap();
    assert_eq!(err["error"]["code"], "not_found");

    let r = app
        .http
        .get(format!("{}/v1/chat/completions", app.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 405);
    let err: serde_json::Value = r.json().await.unwrap();
    assert_eq!(err["error"]["code"], "method_not_allowed");
    assert_eq!(count_requests(&app).await, 0);
    app.stop().await;
}

/// IN-1: an SDK pointed at the wrong prefix gets a 404 it can read (its provider's shape) that
/// says what to change: a version given twice (Anthropic's or Google's SDK with a base_url
/// ending in `/v1`), an OpenAI route without its `/v1`, a Gemini call without a version (the
/// Vercel AI SDK's `@ai-sdk/google` given holdfast's address alone, as Google's own SDKs take
/// it; with OpenAI's shape it showed only "Not Found"), or Google's `v1alpha`.
#[tokio::test]
async fn a_404_for_an_sdk_at_the_wrong_prefix_says_what_to_change_in1() {
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    let anthropic = app.post("/v1/v1/messages", "{}", &[]).await;
    assert_eq!(anthropic.status(), 404);
    let body: serde_json::Value = anthropic.json().await.unwrap();
    assert_eq!(body["type"], "error", "Anthropic's shape: {body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("take `/v1` off"), "{message}");

    // A Gemini path under a doubled version (a base_url ending in `/v1`, or google-genai's
    // ending in `/v1beta`, its own version coming after it), or google-genai with
    // `api_version="v1alpha"`: Google's shape, and what to change.
    for (path, hint) in [
        (
            "/v1/v1beta/models/gemini-2.5-flash:generateContent",
            "take `/v1` off",
        ),
        (
            "/v1beta/v1beta/models/gemini-2.5-flash:generateContent",
            "take `/v1beta` off",
        ),
        (
            "/v1beta/v1/models/gemini-2.5-flash:streamGenerateContent",
            "take `/v1beta` off",
        ),
        (
            "/v1alpha/models/gemini-2.5-flash:generateContent",
            "holdfast serves Google's `v1beta` and `v1` APIs",
        ),
        (
            "/models/gemini-2.5-flash:generateContent",
            "take a base URL ending in `/v1beta`",
        ),
        (
            "/models/gemini-2.5-flash:streamGenerateContent?alt=sse",
            "take a base URL ending in `/v1beta`",
        ),
    ] {
        let google = app.post(path, "{}", &[]).await;
        assert_eq!(google.status(), 404);
        let body: serde_json::Value = google.json().await.unwrap();
        assert_eq!(
            body["error"]["status"], "NOT_FOUND",
            "Google's shape: {body}"
        );
        assert!(
            body["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains(hint)),
            "{path}: {body}"
        );
    }

    let openai = app.post("/chat/completions", chat_body("no v1"), &[]).await;
    assert_eq!(openai.status(), 404);
    let body: serde_json::Value = openai.json().await.unwrap();
    assert_eq!(body["error"]["code"], "not_found", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("ending in `/v1`")),
        "{body}"
    );

    // An Anthropic route without its `/v1` (`@ai-sdk/anthropic` given holdfast's address
    // alone, as Anthropic's own SDK takes it), and OpenAI's model list without it: the
    // route's shape and what to change (a new-user trial, decision 165).
    let anthropic = app.post("/messages", "{}", &[]).await;
    assert_eq!(anthropic.status(), 404);
    let body: serde_json::Value = anthropic.json().await.unwrap();
    assert_eq!(body["type"], "error", "Anthropic's shape: {body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("`@ai-sdk/anthropic`) take a base URL ending in `/v1`"),
        "{body}"
    );
    let models = app
        .http
        .get(format!("{}/models", app.base))
        .send()
        .await
        .unwrap();
    assert_eq!(models.status(), 404);
    let body: serde_json::Value = models.json().await.unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("take a base_url ending in `/v1`")),
        "{body}"
    );

    // Another of the provider's APIs: where to forward it (a new-user trial's
    // `images.generate` was told only that there was no route).
    let other = app.post("/v1/images/generations", "{}", &[]).await;
    let body: serde_json::Value = other.json().await.unwrap();
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.starts_with("holdfast has no route /v1/images/generations")
            && message.contains("[[passthrough]]"),
        "{body}"
    );
    assert_eq!(count_requests(&app).await, 0);
    app.stop().await;
}

/// IN-1, GM-4: an OpenAI fine-tuned model id has colons (`ft:<base>:<org>::<id>`), and
/// `/v1/models/{id}` is a path OpenAI's and Google's SDKs share. Only one of Google's model
/// methods after the last colon makes it Google's: the OpenAI SDK's `models.retrieve` of a
/// fine-tuned model is answered like any other OpenAI model lookup, and a wrong method on it
/// gets OpenAI's error shape, while Gemini's `/v1/models/{model}:generateContent` stays
/// Google's.
#[tokio::test]
async fn an_openai_fine_tuned_model_id_with_colons_is_an_openai_model_lookup_not_a_gemini_call_in1_gm4()
 {
    let ft = "ft:gpt-4o-mini-2024-07-18:my-org::abc123";
    let app = spawn_app(MockConfig::default(), |c| {
        // An exact alias is listed with the OpenAI backends' models (HTTP-4).
        c.model_rewrites = vec![holdfast::config::ModelRewrite {
            pattern: ft.into(),
            backend: "mock-openai".into(),
            model: None,
        }];
    })
    .await;
    let call = |method: &str, path: &str| {
        app.http
            .request(method.parse().unwrap(), format!("{}{path}", app.base))
            .bearer_auth("sk-openai-sdk")
            .header("content-type", "application/json")
            .body("{}")
            .send()
    };

    let found = call("GET", &format!("/v1/models/{ft}")).await.unwrap();
    assert_eq!(found.status(), 200);
    let found: serde_json::Value = found.json().await.unwrap();
    assert_eq!(found["id"], ft, "{found}");
    assert_eq!(found["object"], "model", "OpenAI's model object: {found}");

    // A wrong method on it is OpenAI's 405, as on a model id without colons.
    for method in ["DELETE", "POST"] {
        for path in [format!("/v1/models/{ft}"), "/v1/models/gpt-4o-mini".into()] {
            let r = call(method, &path).await.unwrap();
            assert_eq!(r.status(), 405, "{method} {path}");
            assert_eq!(header(&r, "holdfast-error"), "method_not_allowed");
            let body: serde_json::Value = r.json().await.unwrap();
            assert_eq!(
                body["error"]["type"], "invalid_request_error",
                "OpenAI's shape for {method} {path}: {body}"
            );
            assert_eq!(body["error"]["code"], "method_not_allowed", "{body}");
        }
    }

    // Google's calls on the same prefix are still Google's.
    let gemini = app
        .post(
            "/v1/models/gemini-2.5-flash:generateContent",
            gemini_body("still gemini"),
            &[],
        )
        .await;
    assert_eq!(gemini.status(), 200);
    let gemini: serde_json::Value = gemini.json().await.unwrap();
    assert!(gemini["candidates"].is_array(), "{gemini}");
    for (method, path) in [
        ("DELETE", "/v1/models/gemini-2.5-flash:generateContent"),
        ("POST", "/v1/models/imagen-4.0-generate-001:predict"),
    ] {
        let r = call(method, path).await.unwrap();
        let status = r.status();
        let body: serde_json::Value = r.json().await.unwrap();
        assert!(status == 405 || status == 404, "{method} {path}: {status}");
        assert!(
            body["error"]["status"].is_string(),
            "Google's shape for {method} {path}: {body}"
        );
    }
    assert_eq!(
        count_requests(&app).await,
        1,
        "only the Gemini call is recorded"
    );
    app.stop().await;
}

#[tokio::test]
async fn respond_async_answers_202_with_location_and_runs_anyway_rs9() {
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    let r = app
        .post(
            "/v1/chat/completions",
            chat_body("async please"),
            &[("prefer", "respond-async")],
        )
        .await;
    assert_eq!(r.status(), 202);
    let location = header(&r, "location");
    let id = header(&r, "holdfast-request-id");
    assert_eq!(location, format!("/requests/{id}"));
    let record: serde_json::Value = r.json().await.unwrap();
    assert_eq!(record["id"], id.as_str());
    let done = wait_terminal(&app.http, &app.base, &id, Duration::from_secs(10)).await;
    assert_eq!(done["status"], "succeeded");
    assert_eq!(app.mock.calls(), 1);
    app.stop().await;
}

#[tokio::test]
async fn record_has_every_rd1_field_and_unknown_ids_are_404() {
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    let r = app.chat(&chat_body("fields")).await;
    let id = header(&r, "holdfast-request-id");
    let record = app.record(&id).await;
    for field in [
        "id",
        "status",
        "route",
        "model",
        "backend",
        "stream",
        "attempts",
        "recoveries",
        "next_retry_at",
        "error",
        "created_at",
        "updated_at",
        "finished_at",
        "last_seq",
        "response",
    ] {
        assert!(
            record.get(field).is_some(),
            "RD-1 field {field} missing: {record}"
        );
    }
    assert_eq!(record["route"], "openai.chat");
    assert_eq!(record["backend"], "mock-openai");
    assert_eq!(record["stream"], false);
    assert!(chrono::DateTime::parse_from_rfc3339(record["created_at"].as_str().unwrap()).is_ok());
    for bad in ["not-a-uuid", "0190a1b2-0000-7000-8000-000000000000"] {
        let r = app
            .http
            .get(format!("{}/requests/{bad}", app.base))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 404);
    }
    app.stop().await;
}

/// ID-3, ID-3a: holdfast sends `anthropic-version: 2023-06-01` when the client sends none, so
/// leaving the header out and sending that value are the same upstream request: one request,
/// one provider call, and the provider sees the header either way.
#[tokio::test]
async fn default_anthropic_version_and_the_same_value_sent_are_one_request_id3a() {
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    let body = serde_json::json!({
        "model": "claude-sonnet-4-5", "max_tokens": 16,
        "messages": [{"role": "user", "content": "which version?"}],
    })
    .to_string();
    let first = app.post("/v1/messages", body.clone(), &[]).await;
    assert_eq!(first.status(), 200);
    let second = app
        .post(
            "/v1/messages",
            body.clone(),
            &[("anthropic-version", "2023-06-01")],
        )
        .await;
    assert_eq!(second.status(), 200);
    assert_eq!(
        header(&first, "holdfast-request-id"),
        header(&second, "holdfast-request-id")
    );
    assert_eq!(header(&second, "idempotent-replayed"), "true");
    assert_eq!(app.mock.calls(), 1);
    let sent = &app.mock.recorded()[0];
    assert!(
        sent.headers
            .iter()
            .any(|(n, v)| n == "anthropic-version" && v == "2023-06-01"),
        "{:?}",
        sent.headers
    );
    // Another version is another request.
    let third = app
        .post("/v1/messages", body, &[("anthropic-version", "2024-01-01")])
        .await;
    assert_ne!(
        header(&first, "holdfast-request-id"),
        header(&third, "holdfast-request-id")
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_of_a_succeeded_request_is_answered_without_waiting_for_a_database_write_id4() {
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    let body = chat_body("answered from memory");
    let first = app.chat(&body).await;
    assert_eq!(first.status(), 200);
    let id = header(&first, "holdfast-request-id");
    let first_bytes = first.bytes().await.unwrap();

    // Another process takes the database's write lock: every write holdfast makes now waits.
    let path = app.dir.path().join("holdfast.db");
    let blocker = rusqlite::Connection::open(&path).unwrap();
    blocker.execute_batch("BEGIN IMMEDIATE").unwrap();

    // The duplicate is still answered: the claim's answer is known (a write would wait for the
    // lock, which is only released after this answer arrives).
    let second = tokio::time::timeout(Duration::from_secs(8), app.chat(&body))
        .await
        .expect("the duplicate waited for the database's write lock");
    assert_eq!(second.status(), 200);
    assert_eq!(header(&second, "idempotent-replayed"), "true");
    assert_eq!(header(&second, "holdfast-request-id"), id);
    assert_eq!(second.bytes().await.unwrap(), first_bytes);
    // A different body needs its write: it is not answered while the lock is held.
    let other = tokio::time::timeout(
        Duration::from_millis(300),
        app.chat(&chat_body("needs a write")),
    )
    .await;
    assert!(
        other.is_err(),
        "a new request was answered without being recorded"
    );

    blocker.execute_batch("ROLLBACK").unwrap();
    drop(blocker);
    // The delivery is counted once the lock is gone.
    wait_until(Duration::from_secs(10), "the replay counted", || {
        let db = rusqlite::Connection::open(&path).unwrap();
        db.query_row("SELECT replayed FROM requests WHERE id = ?1", [&id], |r| {
            r.get::<_, i64>(0)
        })
        .unwrap()
            == 1
    })
    .await;
    app.stop().await;
}

/// A provider's forwarded headers are one list in its module (docs/architecture.md, "How to add
/// a provider"): every name on it reaches the provider and is part of the request (ID-3a), with
/// nothing else to change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_forwarded_header_of_each_provider_reaches_it_and_splits_the_request_id3a() {
    use holdfast::provider::{Provider, Route};
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    for provider in Provider::ALL {
        let (route, body) = match provider {
            Provider::Openai => (Route::OpenaiChat, chat_body("forwarded headers")),
            Provider::Anthropic => (
                Route::AnthropicMessages,
                serde_json::json!({
                    "model": "claude-sonnet-4-5", "max_tokens": 16,
                    "messages": [{"role": "user", "content": "forwarded headers"}],
                })
                .to_string(),
            ),
            Provider::Gemini => {
                // None (decision 57): the SDK's telemetry and deadline headers neither reach
                // the provider nor split the request.
                assert!(provider.forwarded_headers().is_empty());
                let path = "/v1beta/models/gemini-2.5-flash:generateContent";
                let body = gemini_body("forwarded headers");
                let mut ids = Vec::new();
                for value in ["1", "2"] {
                    let headers = [("x-goog-api-client", value), ("x-server-timeout", value)];
                    let answer = app.post(path, body.clone(), &headers).await;
                    assert_eq!(answer.status(), 200);
                    ids.push(header(&answer, "holdfast-request-id"));
                }
                assert_eq!(
                    ids[0], ids[1],
                    "the SDK's own headers are not the request's"
                );
                let sent = app.mock.recorded().last().cloned().expect("a call");
                assert!(
                    sent.headers
                        .iter()
                        .all(|(n, _)| n != "x-goog-api-client" && n != "x-server-timeout"),
                    "{:?}",
                    sent.headers
                );
                continue;
            }
        };
        assert!(!provider.forwarded_headers().is_empty());
        for name in provider.forwarded_headers() {
            let mut ids = Vec::new();
            for value in ["first-value", "second-value"] {
                let calls = app.mock.calls();
                let answer = app
                    .post(route.client_path(), body.clone(), &[(name, value)])
                    .await;
                assert_eq!(answer.status(), 200, "{name}: {value}");
                ids.push(header(&answer, "holdfast-request-id"));
                assert_eq!(
                    app.mock.calls(),
                    calls + 1,
                    "{name}: {value} is a new request"
                );
                let sent = app.mock.recorded().last().cloned().expect("a call");
                assert!(
                    sent.headers.iter().any(|(n, v)| n == name && v == value),
                    "{name}: {value} did not reach the provider: {:?}",
                    sent.headers
                );
            }
            assert_ne!(ids[0], ids[1], "{name}: another value is another request");
        }
    }
    app.stop().await;
}

/// Decision 132: a `holdfast serve` whose environment names an HTTP proxy (`HTTP_PROXY`) calls
/// its `http://` backend through it, as holdfast did through reqwest's defaults. The backend's
/// own address refuses connections, so only the proxy can answer; it gets the call once and
/// the client gets its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_the_environments_proxy_names_is_called_through_that_proxy_decision132() {
    let answer = r#"{"id":"chatcmpl-proxy","object":"chat.completion","model":"gpt-4o-mini","choices":[{"index":0,"message":{"role":"assistant","content":"via the proxy"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":3,"total_tokens":4}}"#;
    let proxy = RawProvider::start(raw_200("application/json", answer, false)).await;
    let refused = free_addr();
    let dir = tempfile::tempdir().expect("tempdir");
    let toml = fault_test_toml(
        &format!("sqlite://{}", dir.path().join("holdfast.db").display()),
        "",
        30,
        &format!("http://{refused}/v1"),
    );
    let proxy_url = format!("http://{}", proxy.addr);
    let addr = free_addr();
    let node = Process::serve_logged(
        dir.path(),
        &toml,
        addr,
        &[
            ("HTTP_PROXY", proxy_url.as_str()),
            ("http_proxy", proxy_url.as_str()),
            ("NO_PROXY", ""),
            ("no_proxy", ""),
        ],
    )
    .await;
    let r = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", node.base))
        .header("content-type", "application/json")
        .body(chat_body("through the environment's proxy"))
        .send()
        .await
        .expect("call");
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.expect("body"), answer);
    assert_eq!(proxy.calls(), 1, "the proxy got the call, once");
    assert!(
        node.log_text()
            .contains("calls go through the proxy the environment names"),
        "the start names the proxied backend"
    );
}

/// A raw provider answer with the provider's rate-limit, timing and account headers beside
/// the given content type and body.
fn answer_with_provider_headers(extra: &str, content_type: &str, body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\n{extra}set-cookie: __cf_bm=x\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// RS-5a: an answer delivered live carries the provider's rate-limit and timing headers (an app
/// throttling on `x-ratelimit-remaining-*` read nothing through holdfast), never the operator's
/// account headers nor any other; the same answer read from the log carries none.
#[tokio::test]
async fn a_live_answer_carries_the_providers_rate_limit_headers_and_one_from_the_log_none_rs5a() {
    const OPENAI: &str = "x-request-id: req_1\r\nx-ratelimit-remaining-requests: 4999\r\n\
        x-ratelimit-reset-tokens: 6ms\r\nopenai-processing-ms: 321\r\nopenai-version: 2020-10-01\r\n\
        openai-organization: the-operators-org\r\nopenai-project: proj_operator\r\n";
    let chat = "{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion\",\"created\":1,\"model\":\"gpt-4o-mini\",\"choices\":[{\"index\":0,\"message\":{\"role\":\"assistant\",\"content\":\"hi\"},\"finish_reason\":\"stop\"}],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1,\"total_tokens\":4}}";
    let events = format!(
        "data: {}\n\ndata: [DONE]\n\n",
        chat.replace("chat.completion\"", "chat.completion.chunk\"")
            .replace("\"message\"", "\"delta\"")
    );
    let anthropic = "{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"model\":\"claude-3-5-haiku\",\"content\":[{\"type\":\"text\",\"text\":\"hi\"}],\"stop_reason\":\"end_turn\",\"usage\":{\"input_tokens\":3,\"output_tokens\":1}}";
    let cases = [
        (
            "/v1/chat/completions",
            answer_with_provider_headers(OPENAI, "application/json", chat),
            r#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"limits"}]}"#,
            vec![
                ("x-ratelimit-remaining-requests", "4999"),
                ("x-ratelimit-reset-tokens", "6ms"),
                ("openai-processing-ms", "321"),
                ("openai-version", "2020-10-01"),
            ],
        ),
        (
            "/v1/chat/completions",
            answer_with_provider_headers(OPENAI, "text/event-stream", &events),
            r#"{"model":"gpt-4o-mini","stream":true,"messages":[{"role":"user","content":"limits"}]}"#,
            vec![
                ("x-ratelimit-remaining-requests", "4999"),
                ("openai-processing-ms", "321"),
            ],
        ),
        (
            "/v1/messages",
            answer_with_provider_headers(
                "request-id: req_2\r\nanthropic-ratelimit-requests-remaining: 49\r\n\
                 anthropic-organization-id: the-operators-org\r\n",
                "application/json",
                anthropic,
            ),
            r#"{"model":"claude-3-5-haiku","max_tokens":8,"messages":[{"role":"user","content":"limits"}]}"#,
            vec![("anthropic-ratelimit-requests-remaining", "49")],
        ),
    ];
    for (path, raw, body, passed) in cases {
        let provider = RawProvider::start(raw).await;
        let url = provider.base_url();
        let app = spawn_app(MockConfig::default(), move |c| use_backend_url(c, &url)).await;
        let live = app.post(path, body, &[]).await;
        assert_eq!(live.status(), 200, "{path} {body}");
        for (name, value) in &passed {
            assert_eq!(header(&live, name), *value, "{path} {body}: {name}");
        }
        for name in [
            "openai-organization",
            "openai-project",
            "anthropic-organization-id",
            "set-cookie",
        ] {
            assert!(live.headers().get(name).is_none(), "{path} {body}: {name}");
        }
        let _ = live.bytes().await.unwrap();
        let logged = app.post(path, body, &[]).await;
        assert_eq!(logged.status(), 200);
        assert_eq!(header(&logged, "idempotent-replayed"), "true");
        for (name, _) in &passed {
            assert!(
                logged.headers().get(*name).is_none(),
                "{path} {body}: {name}"
            );
        }
        assert_eq!(provider.calls(), 1);
        app.stop().await;
    }
}
