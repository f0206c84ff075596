//! Google's Gemini API as a provider (GM-1..GM-5), against the mock on SQLite: routes, identity
//! with the model in the path, truthful stream endings, usage, Google's error shape, and the
//! calls around the logged routes.

use std::time::Duration;

use holdfast::config::ModelRewrite;
use holdfast::mock::MockConfig;
use serde_json::{Value, json};

use crate::helpers::*;

const GENERATE: &str = "/v1beta/models/gemini-2.5-flash:generateContent";
const STREAM: &str = "/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse";

#[tokio::test]
async fn gemini_generate_content_is_logged_and_a_resend_is_replayed_gm1_id4() {
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    let body = gemini_body("gemini replay");
    let first = app.post(GENERATE, body.clone(), &[]).await;
    assert_eq!(first.status(), 200);
    assert_eq!(header(&first, "idempotent-replayed"), "false");
    let id = header(&first, "holdfast-request-id");
    let answer: Value = first.json().await.unwrap();
    assert_eq!(answer["candidates"][0]["finishReason"], "STOP");

    let again = app.post(GENERATE, body.clone(), &[]).await;
    assert_eq!(again.status(), 200);
    assert_eq!(header(&again, "idempotent-replayed"), "true");
    assert_eq!(header(&again, "holdfast-request-id"), id);
    assert_eq!(again.json::<Value>().await.unwrap(), answer);
    assert_eq!(app.mock.calls(), 1, "the re-send is answered from the log");

    let record = app.record(&id).await;
    assert_eq!(record["route"], "gemini.v1beta.generate");
    assert_eq!(record["model"], "gemini-2.5-flash");
    assert_eq!(record["backend"], "mock-gemini");
    assert_eq!(record["stream"], false);
    let recorded = app.mock.recorded();
    assert_eq!(
        recorded[0].path, GENERATE,
        "the path goes upstream as called"
    );
    assert_eq!(
        recorded[0].body,
        serde_json::from_str::<Value>(&body).unwrap()
    );
    app.stop().await;
}

#[tokio::test]
async fn the_model_and_version_in_the_path_are_part_of_the_identity_gm1_id3() {
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    let body = gemini_body("same body");
    let mut ids = Vec::new();
    for path in [
        "/v1beta/models/gemini-2.5-flash:generateContent",
        "/v1beta/models/gemini-2.5-pro:generateContent",
        "/v1/models/gemini-2.5-flash:generateContent",
    ] {
        let r = app.post(path, body.clone(), &[]).await;
        assert_eq!(r.status(), 200, "{path}");
        ids.push(header(&r, "holdfast-request-id"));
    }
    assert_ne!(ids[0], ids[1], "same body, other model: another request");
    assert_ne!(
        ids[0], ids[2],
        "same body, other API version: another request"
    );
    assert_eq!(app.mock.calls(), 3);
    assert_eq!(app.record(&ids[2]).await["route"], "gemini.v1.generate");
    let paths: Vec<String> = app.mock.recorded().into_iter().map(|c| c.path).collect();
    assert!(paths.contains(&"/v1/models/gemini-2.5-flash:generateContent".to_string()));
    // With an Idempotency-Key (ID-5) the path's model is part of the key's fingerprint too: the
    // same key and body for another model is refused, and the refusal names the model, not
    // only the body, since the body is the same.
    let key = [("idempotency-key", "gemini-key-1")];
    let first = app
        .post(
            "/v1beta/models/gemini-2.5-flash:generateContent",
            body.clone(),
            &key,
        )
        .await;
    assert_eq!(first.status(), 200);
    let other = app
        .post("/v1beta/models/gemini-2.5-pro:generateContent", body, &key)
        .await;
    assert_eq!(other.status(), 422);
    let err: serde_json::Value = other.json().await.unwrap();
    assert_eq!(err["error"]["status"], "INVALID_ARGUMENT", "{err}");
    let message = err["error"]["message"].as_str().unwrap();
    assert!(message.contains("another model"), "{message}");
    app.stop().await;
}

#[tokio::test]
async fn model_rewrites_apply_to_the_path_model_gm1_cli5() {
    let app = spawn_app(MockConfig::default(), |c| {
        c.model_rewrites = vec![ModelRewrite {
            pattern: "fast".into(),
            backend: "mock-gemini".into(),
            model: Some("gemini-2.5-flash-lite".into()),
        }];
    })
    .await;
    let r = app
        .post(
            "/v1beta/models/fast:generateContent",
            gemini_body("rewritten"),
            &[],
        )
        .await;
    assert_eq!(r.status(), 200);
    let id = header(&r, "holdfast-request-id");
    assert_eq!(app.record(&id).await["model"], "gemini-2.5-flash-lite");
    assert_eq!(
        app.mock.recorded()[0].path,
        "/v1beta/models/gemini-2.5-flash-lite:generateContent"
    );
    // The alias and the model it is rewritten to are one request (ID-3).
    let direct = app
        .post(
            "/v1beta/models/gemini-2.5-flash-lite:generateContent",
            gemini_body("rewritten"),
            &[],
        )
        .await;
    assert_eq!(header(&direct, "holdfast-request-id"), id);
    assert_eq!(app.mock.calls(), 1);
    app.stop().await;
}

#[tokio::test]
async fn a_gemini_stream_succeeds_at_finish_reason_and_a_clean_end_and_replays_gm3_rs3() {
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    let body = gemini_body("gemini stream");
    let r = app.post(STREAM, body.clone(), &[]).await;
    assert_eq!(r.status(), 200);
    assert!(header(&r, "content-type").starts_with("text/event-stream"));
    let id = header(&r, "holdfast-request-id");
    let (raw, events) = read_events(r).await;
    assert!(
        !raw.contains("id:"),
        "no id lines on a proxied stream (RS-4)"
    );
    let last: Value = serde_json::from_str(&events.last().unwrap().data).unwrap();
    assert_eq!(last["candidates"][0]["finishReason"], "STOP");
    let record = wait_terminal(&app.http, &app.base, &id, Duration::from_secs(10)).await;
    assert_eq!(record["status"], "succeeded", "{record}");
    assert_eq!(record["route"], "gemini.v1beta.stream");
    assert_eq!(record["stream"], true);
    assert!(app.mock.recorded()[0].path.ends_with("?alt=sse"));

    // The stream's text is the provider's: the same as the non-stream answer's.
    let whole: Value = app
        .post(GENERATE, body.clone(), &[])
        .await
        .json()
        .await
        .unwrap();
    let text = whole["candidates"][0]["content"]["parts"][0]["text"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(gemini_text(&events), text);

    let replay = app.post(STREAM, body, &[]).await;
    assert_eq!(header(&replay, "idempotent-replayed"), "true");
    let (again, _) = read_events(replay).await;
    assert_eq!(again, raw, "replayed byte for byte (RS-3)");
    assert_eq!(app.mock.calls(), 2);
    app.stop().await;
}

/// RS-4, decision 73: a silence in a proxied Gemini stream is filled with blank lines, not SSE
/// comments (google-genai for Python parses a comment line as JSON); other providers' streams
/// keep `: keep-alive` comments.
#[tokio::test]
async fn silences_in_a_gemini_stream_are_filled_with_blank_lines_not_comments_rs4() {
    let app = spawn_app(
        MockConfig {
            chunks: 4,
            stall_after_chunks: Some((2, 600)),
            ..MockConfig::default()
        },
        |c| c.sse_keepalive_ms = 100,
    )
    .await;
    let r = app.post(STREAM, gemini_body("a quiet gemini"), &[]).await;
    assert_eq!(r.status(), 200);
    let (raw, events) = read_events(r).await;
    assert!(!raw.contains(": keep-alive"), "no comment lines: {raw:?}");
    assert!(
        raw.contains("\n\n\n"),
        "a blank line filled the silence: {raw:?}"
    );
    let last: Value = serde_json::from_str(&events.last().unwrap().data).unwrap();
    assert_eq!(last["candidates"][0]["finishReason"], "STOP");

    let r = app
        .post("/v1/chat/completions", stream_body("a quiet chat"), &[])
        .await;
    let (raw, _) = read_events(r).await;
    assert!(raw.contains(": keep-alive\n\n"), "{raw:?}");
    app.stop().await;
}

#[tokio::test]
async fn a_gemini_stream_that_ends_without_finish_reason_is_interrupted_gm3_lc7() {
    let app = spawn_app(
        MockConfig {
            omit_stream_end: true,
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    let r = app.post(STREAM, gemini_body("no finish"), &[]).await;
    assert_eq!(r.status(), 200);
    let id = header(&r, "holdfast-request-id");
    let (_, events) = read_events(r).await;
    let closing: Value = serde_json::from_str(&events.last().unwrap().data).unwrap();
    assert!(
        events.last().unwrap().data.starts_with(r#"{"error":"#),
        "the SDK raises on a chunk that starts with an error object: {closing}"
    );
    assert_eq!(
        closing["error"]["details"][0]["reason"],
        "stream_interrupted"
    );
    let record = wait_terminal(&app.http, &app.base, &id, Duration::from_secs(10)).await;
    assert_eq!(record["status"], "failed");
    assert_eq!(record["error"]["type"], "stream_interrupted", "{record}");
    assert!(
        record["error"]["message"]
            .as_str()
            .unwrap()
            .contains("finishReason"),
        "{record}"
    );
    assert_eq!(app.mock.calls(), 1);
    app.stop().await;
}

#[tokio::test]
async fn a_stream_call_without_alt_sse_is_refused_unrecorded_gm1() {
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    let r = app
        .post(
            "/v1beta/models/gemini-2.5-flash:streamGenerateContent",
            gemini_body("json array"),
            &[],
        )
        .await;
    assert_eq!(r.status(), 400);
    assert_eq!(header(&r, "holdfast-error"), "unsupported_stream_format");
    assert_eq!(app.mock.calls(), 0);
    assert!(records(&app).await.is_empty());
    app.stop().await;
}

#[tokio::test]
async fn gemini_usage_metadata_reaches_the_record_rd9_gm3() {
    let app = spawn_app(
        MockConfig {
            chunks: 5,
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    for path in [GENERATE, STREAM] {
        let r = app.post(path, gemini_body("usage"), &[]).await;
        let id = header(&r, "holdfast-request-id");
        let _ = r.bytes().await;
        let record = wait_terminal(&app.http, &app.base, &id, Duration::from_secs(10)).await;
        let usage = &record["usage"];
        assert_eq!(usage["output_tokens"], 5, "{path}: {record}");
        assert!(
            usage["input_tokens"].as_u64().unwrap() >= 1,
            "{path}: {record}"
        );
    }
    app.stop().await;
}

#[tokio::test]
async fn x_goog_api_key_and_the_key_query_are_namespace_keys_never_forwarded_gm2() {
    let app = spawn_app(MockConfig::default(), |c| {
        c.namespaces = two_namespaces("a", "b");
    })
    .await;
    let refused = app.post(GENERATE, gemini_body("keys"), &[]).await;
    assert_eq!(refused.status(), 401);
    let error: Value = refused.json().await.unwrap();
    assert_eq!(error["error"]["status"], "UNAUTHENTICATED", "{error}");
    assert_eq!(error["error"]["code"], 401);
    let message = error["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("x-goog-api-key") && message.contains("?key="),
        "the 401 names the ways google-genai sends a key: {message}"
    );

    let by_header = app
        .post(
            GENERATE,
            gemini_body("keys"),
            &[("x-goog-api-key", "key-a")],
        )
        .await;
    assert_eq!(by_header.status(), 200);
    let id = header(&by_header, "holdfast-request-id");
    let by_query = app
        .post(&format!("{GENERATE}?key=key-a"), gemini_body("keys"), &[])
        .await;
    assert_eq!(by_query.status(), 200);
    assert_eq!(
        header(&by_query, "holdfast-request-id"),
        id,
        "one namespace"
    );
    let other = app
        .post(
            GENERATE,
            gemini_body("keys"),
            &[("x-goog-api-key", "key-b")],
        )
        .await;
    assert_ne!(
        header(&other, "holdfast-request-id"),
        id,
        "another namespace"
    );
    for call in app.mock.recorded() {
        assert!(!call.path.contains("key="), "{}", call.path);
        assert!(
            call.headers
                .iter()
                .all(|(_, v)| v != "key-a" && v != "key-b"),
            "a client key reached the provider: {:?}",
            call.headers
        );
    }
    app.stop().await;
}

#[tokio::test]
async fn holdfasts_own_errors_on_gemini_routes_take_googles_shape_gm5_rs6() {
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    let bad = app.post(GENERATE, "not json", &[]).await;
    assert_eq!(bad.status(), 400);
    assert_eq!(header(&bad, "holdfast-error"), "invalid_json");
    let body: Value = bad.json().await.unwrap();
    assert_eq!(body["error"]["code"], 400);
    assert_eq!(body["error"]["status"], "INVALID_ARGUMENT");
    assert_eq!(body["error"]["details"][0]["reason"], "invalid_json");

    let unknown = app
        .post(
            "/v1beta/models/imagen-4.0-generate-001:predict",
            gemini_body("x"),
            &[],
        )
        .await;
    assert_eq!(unknown.status(), 404);
    let body: Value = unknown.json().await.unwrap();
    assert_eq!(body["error"]["status"], "NOT_FOUND", "{body}");

    // A path under /v1beta that holdfast does not serve: Google's shape too (IN-1).
    let fallback = app
        .http
        .get(format!("{}/v1beta/files", app.base))
        .send()
        .await
        .unwrap();
    assert_eq!(fallback.status(), 404);
    assert_eq!(header(&fallback, "holdfast-error"), "not_found");
    let body: Value = fallback.json().await.unwrap();
    assert_eq!(body["error"]["status"], "NOT_FOUND", "{body}");

    let slash = app
        .post(
            "/v1beta/models/a%2Fb:generateContent",
            gemini_body("x"),
            &[],
        )
        .await;
    assert_eq!(slash.status(), 400);
    assert_eq!(header(&slash, "holdfast-error"), "invalid_model");

    // A call's path with another method is 405 in Google's shape, on both versions, not a
    // lookup of a model named `...:generateContent` (IN-1).
    for path in [
        GENERATE.to_string(),
        "/v1/models/gemini-2.5-flash:streamGenerateContent?alt=sse".into(),
        "/v1beta/models/gemini-2.5-flash:countTokens".into(),
    ] {
        let get = app
            .http
            .get(format!("{}{path}", app.base))
            .send()
            .await
            .unwrap();
        assert_eq!(get.status(), 405, "GET {path}");
        assert_eq!(
            header(&get, "holdfast-error"),
            "method_not_allowed",
            "GET {path}"
        );
        let body: Value = get.json().await.unwrap();
        assert_eq!(body["error"]["code"], 405, "{body}");
    }
    assert_eq!(app.mock.calls(), 0);
    app.stop().await;
}

/// IN-1, RFC 9110 §15.5.6: a 405 names in `Allow` the methods its path takes. `/{v1beta,v1}/
/// models/{x}` is one router path for two resources, a Google model call (`POST`) and a model
/// lookup (`GET`, `HEAD`): a `GET` on a call answered 405 with no `Allow` at all, a `PUT`
/// on either listed `POST,GET,HEAD`, offering a `GET` on a call and a `POST` on a lookup that
/// both answer an error, and a `POST` on a Gemini model's lookup answered 404, as if the path
/// were not served.
#[tokio::test]
async fn a_wrong_method_on_a_models_path_lists_only_the_methods_that_path_takes_in1() {
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    for (path, allowed) in [
        ("/v1beta/models/gemini-2.5-flash:generateContent", "POST"),
        (
            "/v1/models/gemini-2.5-flash:streamGenerateContent?alt=sse",
            "POST",
        ),
        ("/v1beta/models/gemini-2.5-flash:countTokens", "POST"),
        ("/v1beta/models/gemini-2.5-flash", "GET,HEAD"),
        ("/v1/models/gpt-4o-mini", "GET,HEAD"),
        (
            "/v1/models/ft:gpt-4o-mini-2024-07-18:my-org::abc123",
            "GET,HEAD",
        ),
    ] {
        for method in [
            reqwest::Method::GET,
            reqwest::Method::POST,
            reqwest::Method::PUT,
            reqwest::Method::DELETE,
        ] {
            if allowed.split(',').any(|m| m == method.as_str()) {
                continue;
            }
            let r = app
                .http
                .request(method.clone(), format!("{}{path}", app.base))
                .body("{}")
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 405, "{method} {path}");
            assert_eq!(header(&r, "allow"), allowed, "{method} {path}");
        }
    }
    assert_eq!(app.mock.calls(), 0);
    app.stop().await;
}

#[tokio::test]
async fn a_provider_refusal_is_replayed_in_googles_shape_lc6_gm5() {
    let app = spawn_app(
        MockConfig {
            fail_first: 1,
            fail_status: 400,
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    let r = app.post(GENERATE, gemini_body("refused"), &[]).await;
    assert_eq!(r.status(), 400);
    assert_eq!(header(&r, "x-should-retry"), "false");
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["status"], "INVALID_ARGUMENT", "{body}");
    app.stop().await;
}

/// LC-5, decision 88: Google answers a quota 429 without `retry-after`; how long to wait is the
/// `retryDelay` of a `google.rpc.RetryInfo` detail in its body. holdfast waits that long before
/// its next attempt instead of spending its attempts within its own short backoff.
#[tokio::test]
async fn a_gemini_429s_retry_info_delay_is_waited_before_the_next_attempt_lc5() {
    let app = spawn_app(
        MockConfig {
            fail_first: 1,
            fail_status: 429,
            retry_delay: Some("1.500000000s".into()),
            ..MockConfig::default()
        },
        |c| {
            c.workers.backoff_initial_ms = 20;
            c.workers.backoff_max_ms = 10_000;
        },
    )
    .await;
    let r = app.post(GENERATE, gemini_body("quota"), &[]).await;
    assert_eq!(r.status(), 200);
    let id = header(&r, "holdfast-request-id");
    let record = app.record(&id).await;
    assert_eq!(record["attempts"], 2, "{record}");
    let calls = app.mock.recorded();
    assert_eq!(calls.len(), 2);
    let waited = calls[1].at_ms - calls[0].at_ms;
    assert!(
        waited >= 1_400,
        "the second attempt came {waited} ms after the 429 that asked for 1.5 s"
    );
    app.stop().await;
}

/// LC-5, decision 88: Google also fails a stream with a 200 whose first chunk is its error
/// object, the quota's `RetryInfo` in it; holdfast waits that delay before its next attempt, as
/// it does for a 429's body, instead of spending its attempts within its own short backoff.
#[tokio::test]
async fn a_gemini_stream_error_chunks_retry_info_delay_is_waited_before_the_next_attempt_lc5() {
    let quota = "data: {\"error\":{\"code\":429,\"message\":\"quota\",\"status\":\"RESOURCE_EXHAUSTED\",\"details\":[{\"@type\":\"type.googleapis.com/google.rpc.RetryInfo\",\"retryDelay\":\"1.500s\"}]}}\r\n\r\n";
    let provider = RawProvider::start(raw_200("text/event-stream", quota, false)).await;
    let url = provider.base_url();
    let app = spawn_app(MockConfig::default(), move |c| {
        use_backend_url(c, &url);
        c.workers.max_attempts = 2;
        c.workers.backoff_initial_ms = 20;
        c.workers.backoff_max_ms = 10_000;
    })
    .await;
    let started = std::time::Instant::now();
    let r = app.post(STREAM, gemini_body("stream quota"), &[]).await;
    assert_eq!(r.status(), 502);
    let id = header(&r, "holdfast-request-id");
    let record = wait_terminal(&app.http, &app.base, &id, Duration::from_secs(10)).await;
    assert_eq!(record["error"]["type"], "attempts_exhausted", "{record}");
    assert_eq!(provider.calls(), 2);
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(1_400),
        "two attempts in {waited:?}, the first error chunk asking for 1.5 s"
    );
    app.stop().await;
}

#[tokio::test]
async fn count_tokens_and_the_model_list_are_answered_without_a_record_gm4_http4() {
    let app = spawn_app(MockConfig::default(), |c| {
        c.model_rewrites = vec![ModelRewrite {
            pattern: "fast".into(),
            backend: "mock-gemini".into(),
            model: Some("gemini-mock-small".into()),
        }];
    })
    .await;
    let count = app
        .post(
            "/v1beta/models/fast:countTokens",
            gemini_body("count these tokens"),
            &[],
        )
        .await;
    assert_eq!(count.status(), 200);
    let count: Value = count.json().await.unwrap();
    assert!(count["totalTokens"].as_u64().unwrap() >= 1, "{count}");
    let others = app.mock.other_calls();
    assert_eq!(
        others[0].path,
        "/v1beta/models/gemini-mock-small:countTokens"
    );

    let list = get_json(&app.http, &format!("{}/v1beta/models", app.base)).await;
    let names: Vec<&str> = list["models"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["name"].as_str())
        .collect();
    assert!(names.contains(&"models/gemini-mock-small"), "{list}");
    assert!(
        names.contains(&"models/fast"),
        "the alias is listed: {list}"
    );

    // `GET /v1/models` is OpenAI's too: Google's SDKs are told apart by their key header.
    let v1: Value = app
        .http
        .get(format!("{}/v1/models", app.base))
        .header("x-goog-api-key", "anything")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(v1["models"].is_array(), "{v1}");
    let openai = get_json(&app.http, &format!("{}/v1/models", app.base)).await;
    assert_eq!(openai["object"], "list", "{openai}");

    let one = get_json(
        &app.http,
        &format!("{}/v1beta/models/gemini-mock-small", app.base),
    )
    .await;
    assert_eq!(one["name"], "models/gemini-mock-small");

    assert_eq!(app.mock.calls(), 0, "no model call");
    assert!(records(&app).await.is_empty(), "nothing recorded");
    app.stop().await;
}

/// GM-4, decision 91: google-genai's `embed_content` (`batchEmbedContents` on the Developer
/// API) and `embedContent` are forwarded unlogged to the backend the model routes to, the
/// rewritten model in the path, as `countTokens` is; they used to be 404 with no way around it
/// (a `[[passthrough]]` under `/v1beta/models` overlaps holdfast's own routes).
#[tokio::test]
async fn embeddings_are_forwarded_without_a_record_gm4_http4() {
    let app = spawn_app(MockConfig::default(), |c| {
        c.model_rewrites = vec![ModelRewrite {
            pattern: "embed-fast".into(),
            backend: "mock-gemini".into(),
            model: Some("text-embedding-004".into()),
        }];
    })
    .await;
    let batch = app
        .post(
            "/v1beta/models/embed-fast:batchEmbedContents",
            r#"{"requests":[{"model":"models/embed-fast","content":{"parts":[{"text":"a"}]}},
                {"model":"models/embed-fast","content":{"parts":[{"text":"b"}]}}]}"#
                .to_string(),
            &[("x-goog-api-key", "the-clients-key")],
        )
        .await;
    assert_eq!(batch.status(), 200);
    let batch: Value = batch.json().await.unwrap();
    assert_eq!(
        batch["embeddings"].as_array().map(Vec::len),
        Some(2),
        "{batch}"
    );
    let one = app
        .post(
            "/v1/models/text-embedding-004:embedContent",
            r#"{"content":{"parts":[{"text":"a"}]}}"#.to_string(),
            &[],
        )
        .await;
    assert_eq!(one.status(), 200);
    let one: Value = one.json().await.unwrap();
    assert!(one["embedding"]["values"].is_array(), "{one}");

    let others = app.mock.other_calls();
    let paths: Vec<&str> = others.iter().map(|c| c.path.as_str()).collect();
    assert_eq!(
        paths,
        [
            "/v1beta/models/text-embedding-004:batchEmbedContents",
            "/v1/models/text-embedding-004:embedContent",
        ]
    );
    // The batch's own model names follow the path's rewrite: Google refuses a request naming a
    // model other than its path's.
    let sent: Vec<&Value> = others[0].body["requests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| &r["model"])
        .collect();
    assert_eq!(
        sent,
        [
            &json!("models/text-embedding-004"),
            &json!("models/text-embedding-004")
        ],
        "{}",
        others[0].body
    );
    assert!(
        !others[0]
            .headers
            .iter()
            .any(|(_, v)| v.contains("the-clients-key")),
        "the client's key never goes upstream"
    );
    // A GET on such a path is a call with the wrong method, not a model lookup (IN-1).
    let wrong = app
        .http
        .get(format!(
            "{}/v1beta/models/text-embedding-004:embedContent",
            app.base
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 405);
    assert_eq!(app.mock.calls(), 0, "no model call");
    assert!(records(&app).await.is_empty(), "nothing recorded");
    app.stop().await;
}

/// GM-4, GM-5: the Gemini model list pages by `pageSize` and the `nextPageToken` holdfast
/// wrote, and a `pageToken` it did not issue is refused with 400 `INVALID_ARGUMENT` in Google's
/// shape, as Google refuses one, instead of silently starting over at the first page — on
/// `/v1beta/models` and on `/v1/models` called with `x-goog-api-key`; so is a `pageSize` that
/// is not a number.
#[tokio::test]
async fn a_model_list_page_token_holdfast_did_not_issue_is_a_400_in_googles_shape_gm4_gm5() {
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    let first = get_json(&app.http, &format!("{}/v1beta/models?pageSize=1", app.base)).await;
    assert_eq!(first["models"].as_array().map(Vec::len), Some(1), "{first}");
    let token = first["nextPageToken"]
        .as_str()
        .expect("more pages")
        .to_string();
    let second = get_json(
        &app.http,
        &format!("{}/v1beta/models?pageSize=1&pageToken={token}", app.base),
    )
    .await;
    assert_eq!(
        second["models"].as_array().map(Vec::len),
        Some(1),
        "{second}"
    );
    assert_ne!(second["models"][0], first["models"][0], "the next page");

    for (path, key) in [
        ("/v1beta/models?pageSize=1&pageToken=garbage", None),
        ("/v1beta/models?pageToken=-1", None),
        ("/v1/models?pageSize=1&pageToken=garbage", Some("any")),
    ] {
        let mut request = app.http.get(format!("{}{path}", app.base));
        if let Some(key) = key {
            request = request.header("x-goog-api-key", key);
        }
        let r = request.send().await.unwrap();
        assert_eq!(r.status(), 400, "{path}");
        assert_eq!(header(&r, "holdfast-error"), "invalid_page_token", "{path}");
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["error"]["code"], 400, "{path}: {body}");
        assert_eq!(
            body["error"]["status"], "INVALID_ARGUMENT",
            "{path}: {body}"
        );
        assert_eq!(
            body["error"]["details"][0]["reason"], "invalid_page_token",
            "{path}: {body}"
        );
        assert!(
            body["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("pageToken")),
            "{path}: {body}"
        );
    }
    // A page size that is not a number is refused too, as Google refuses it (GM-4).
    let r = app
        .http
        .get(format!("{}/v1beta/models?pageSize=abc", app.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(header(&r, "holdfast-error"), "invalid_page_size");
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["status"], "INVALID_ARGUMENT", "{body}");
    assert!(records(&app).await.is_empty(), "nothing recorded");
    app.stop().await;
}

/// GM-4, decision 76: a model the merged list lacks is looked up at the backend it routes to
/// (CLI-5), the rewritten model in the path, with the backend's key and not the client's, and
/// its answer relayed: google-genai's `models.get` of a model the provider serves but does not
/// list (the mock generates for any name and lists three), the OpenAI SDK's `models.retrieve`
/// of a fine-tuned model newer than the cached list, Anthropic's of an alias; and a Gemini
/// embedding, forwarded the same way (decision 91). Nothing recorded. A process of its own:
/// each backend's key is read from the variable its `api_key_env` names.
#[tokio::test]
async fn a_model_lookup_the_merged_list_lacks_is_answered_by_the_backend_it_routes_to_gm4_http4() {
    let mock = start_mock(MockConfig::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let toml = format!(
        r#"database_url = "sqlite://{db}"
[[backends]]
name = "mock-openai"
kind = "openai"
base_url = "{base}"
api_key_env = "HF_TEST_OPENAI_KEY"
[[backends]]
name = "mock-anthropic"
kind = "anthropic"
base_url = "{base}"
api_key_env = "HF_TEST_ANTHROPIC_KEY"
[[backends]]
name = "mock-gemini"
kind = "gemini"
base_url = "{root}"
api_key_env = "HF_TEST_GEMINI_KEY"
[[namespaces]]
name = "team-a"
api_keys = ["key-a"]
[[namespaces]]
name = "team-b"
api_keys = ["key-b"]
[[model_rewrites]]
match = "fast-*"
backend = "mock-gemini"
model = "gemini-2.5-flash"
"#,
        db = dir.path().join("holdfast.db").display(),
        base = mock.base_url(),
        root = mock.root_url(),
    );
    let mut node = Process::serve_logged(
        dir.path(),
        &toml,
        free_addr(),
        &[
            ("HF_TEST_OPENAI_KEY", "sk-openai-backend"),
            ("HF_TEST_ANTHROPIC_KEY", "sk-ant-backend"),
            ("HF_TEST_GEMINI_KEY", "goog-backend"),
        ],
    )
    .await;
    node.show_log_on_failure = true;
    let http = reqwest::Client::new();
    let get = |path: &str, headers: &[(&str, &str)]| {
        let mut req = http.get(format!("{}{path}", node.base));
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        let path = path.to_string();
        async move {
            let r = req.send().await.unwrap();
            let status = r.status();
            let body: Value = r.json().await.unwrap();
            assert_eq!(status, 200, "GET {path}: {body}");
            body
        }
    };
    // The lookup that reached `upstream` (the merged list's own calls come before it) carries
    // the backend's key in its provider's header.
    let lookup_carries_the_backends_key = |upstream: &str, key: (&str, &str)| {
        let call = mock
            .other_calls()
            .into_iter()
            .rfind(|call| call.path == upstream)
            .unwrap_or_else(|| panic!("no upstream call to {upstream}"));
        assert!(
            call.headers
                .iter()
                .any(|(name, value)| name == key.0 && value == key.1),
            "{upstream}: the backend's {} header: {:?}",
            key.0,
            call.headers
        );
    };
    let google = [("x-goog-api-key", "key-a")];
    for (path, upstream, name) in [
        (
            "/v1beta/models/gemini-2.0-flash",
            "/v1beta/models/gemini-2.0-flash",
            "models/gemini-2.0-flash",
        ),
        // From the version the list is read from, whichever the client called.
        (
            "/v1/models/gemini-2.0-flash",
            "/v1beta/models/gemini-2.0-flash",
            "models/gemini-2.0-flash",
        ),
        (
            "/v1beta/models/fast-one",
            "/v1beta/models/gemini-2.5-flash",
            "models/gemini-2.5-flash",
        ),
    ] {
        let model = get(path, &google).await;
        assert_eq!(model["name"], name, "{path}: {model}");
        assert_eq!(mock.other_calls().pop().unwrap().path, upstream, "{path}");
        lookup_carries_the_backends_key(upstream, ("x-goog-api-key", "goog-backend"));
    }

    let ft = "ft:gpt-4o-mini-2024-07-18:my-org::made-a-second-ago";
    let openai = get(
        &format!("/v1/models/{ft}"),
        &[("authorization", "Bearer key-a")],
    )
    .await;
    assert_eq!(openai["id"], ft, "{openai}");
    let upstream = format!("/v1/models/{ft}");
    assert_eq!(mock.other_calls().pop().unwrap().path, upstream);
    lookup_carries_the_backends_key(&upstream, ("authorization", "Bearer sk-openai-backend"));
    let anthropic = get(
        "/v1/models/claude-sonnet-4-5",
        &[("x-api-key", "key-a"), ("anthropic-version", "2023-06-01")],
    )
    .await;
    assert_eq!(anthropic["type"], "model", "{anthropic}");
    assert_eq!(anthropic["id"], "claude-sonnet-4-5", "{anthropic}");
    assert_eq!(
        mock.other_calls().pop().unwrap().path,
        "/v1/models/claude-sonnet-4-5"
    );
    lookup_carries_the_backends_key(
        "/v1/models/claude-sonnet-4-5",
        ("x-api-key", "sk-ant-backend"),
    );
    // An embedding (decision 91), its key in the query: forwarded with the backend's key, the
    // rewritten model in its path and in its body, the client's `?key=` not in the URL.
    let embedded = http
        .post(format!(
            "{}/v1beta/models/fast-embed:batchEmbedContents?key=key-a",
            node.base
        ))
        .header("content-type", "application/json")
        .body(r#"{"requests":[{"model":"models/fast-embed","content":{"parts":[{"text":"a"}]}}]}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(embedded.status(), 200);
    let upstream = "/v1beta/models/gemini-2.5-flash:batchEmbedContents";
    lookup_carries_the_backends_key(upstream, ("x-goog-api-key", "goog-backend"));
    let call = mock.other_calls().pop().unwrap();
    assert_eq!(
        call.path, upstream,
        "no query, so no key, in the upstream URL"
    );
    assert_eq!(
        call.body["requests"][0]["model"], "models/gemini-2.5-flash",
        "{}",
        call.body
    );
    // The client's key stays here: in no header of any upstream call (lookups and the merged
    // list's reads), not even inside another value (`Bearer key-a`).
    let calls = mock.other_calls();
    assert!(calls.len() >= 5, "{calls:?}");
    for call in &calls {
        assert!(
            call.headers.iter().all(|(_, v)| !v.contains("key-a")),
            "{}: the client's key went upstream: {:?}",
            call.path,
            call.headers
        );
    }

    // Still a namespace key first (CLI-5), and no upstream call without one.
    let before = mock.other_calls().len();
    let refused = http
        .get(format!("{}/v1beta/models/gemini-2.0-flash", node.base))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 401);
    let refused = http
        .post(format!(
            "{}/v1beta/models/gemini-2.0-flash:embedContent",
            node.base
        ))
        .body(r#"{"content":{"parts":[{"text":"a"}]}}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 401);
    assert_eq!(mock.other_calls().len(), before);
    assert_eq!(mock.calls(), 0, "no model call");
    let list: Value = http
        .get(format!("{}/requests", node.base))
        .bearer_auth("key-a")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list["data"], serde_json::json!([]), "nothing recorded");
    drop(node);
    mock.shutdown().await;
}

/// GM-4: the backend's own "no such model" reaches the SDK as the backend said it.
#[tokio::test]
async fn a_backends_404_for_an_unknown_model_is_relayed_gm4() {
    let body =
        r#"{"error":{"code":404,"message":"models/nope is not found","status":"NOT_FOUND"}}"#;
    let provider = RawProvider::start(
        format!(
            "HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
        .into_bytes(),
    )
    .await;
    let app = spawn_app(MockConfig::default(), |c| {
        use_backend_url(c, &provider.base_url());
    })
    .await;
    let r = app
        .http
        .get(format!("{}/v1beta/models/nope", app.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(r.text().await.unwrap(), body);
    // One call for the list (which failed, so it is skipped), one for the model.
    assert_eq!(provider.calls(), 2);
    app.stop().await;
}

#[tokio::test]
async fn a_storm_of_identical_gemini_calls_costs_one_provider_call_id7() {
    let app = spawn_app(
        MockConfig {
            header_delay_ms: 300,
            ..MockConfig::default()
        },
        |c| c.max_held_requests = 1_000,
    )
    .await;
    let body = gemini_body("storm");
    let answers = futures::future::join_all((0..100).map(|_| async {
        let r = app.post(GENERATE, body.clone(), &[]).await;
        assert_eq!(r.status(), 200);
        (
            header(&r, "holdfast-request-id"),
            r.json::<Value>().await.unwrap(),
        )
    }))
    .await;
    assert!(answers.iter().all(|a| a == &answers[0]), "one answer");
    assert_eq!(app.mock.calls(), 1);
    app.stop().await;
}

#[tokio::test]
async fn a_gemini_stream_attached_mid_way_and_read_back_gets_every_event_rs2_rd3() {
    let app = spawn_app(
        MockConfig {
            chunks: 6,
            chunk_delay_ms: 100,
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    let body = gemini_body("attach");
    let mut first = app.post(STREAM, body.clone(), &[]).await;
    let id = header(&first, "holdfast-request-id");
    let early = first_events(&mut first, 2).await;
    let second = app.post(STREAM, body, &[]).await;
    assert_eq!(header(&second, "idempotent-replayed"), "true");
    let (_, attached) = read_events(second).await;
    let (_, rest) = read_events(first).await;
    let whole: Vec<String> = early.iter().chain(&rest).map(|e| e.data.clone()).collect();
    let joined: Vec<String> = attached.iter().map(|e| e.data.clone()).collect();
    assert_eq!(
        joined, whole,
        "the attached stream has every event from the first"
    );
    assert_eq!(app.mock.calls(), 1);

    // The log replays it with ids, and resumes after a position.
    let (_, logged) = read_events(get_events(&app.http, &app.base, &id, None).await).await;
    assert_eq!(logged.last().unwrap().event.as_deref(), Some("end"));
    let (_, resumed) = read_events(get_events(&app.http, &app.base, &id, Some("3")).await).await;
    assert_eq!(resumed.len(), logged.len() - 3);
    assert_eq!(resumed[0].id.as_deref(), Some("4"));
    app.stop().await;
}

/// Runs `tests/clients/gemini_sdk.py MODE` against `base` off the runtime and parses the JSON
/// object it prints.
async fn gemini_python(mode: &'static str, base: &str) -> Value {
    require_python(&["google.genai"]);
    let base = base.to_string();
    let out = tokio::task::spawn_blocking(move || {
        run_python_args("gemini_sdk.py", &[mode], &[("HOLDFAST_URL", &base)])
    })
    .await
    .unwrap();
    serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("gemini_sdk.py printed {out}: {e}"))
}

#[tokio::test]
async fn google_genai_python_generates_streams_counts_and_lists_through_holdfast_gm1_gm4() {
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    let out = gemini_python("surface", &app.base).await;
    let text = out["text"].as_str().unwrap();
    assert!(text.starts_with("mock reply"), "{out}");
    assert_eq!(out["again"], out["text"], "the re-send is the same answer");
    assert!(
        out["stream_text"]
            .as_str()
            .unwrap()
            .starts_with("mock reply"),
        "{out}"
    );
    assert!(out["total_tokens"].as_u64().unwrap() >= 1, "{out}");
    assert_eq!(out["embedding"], 8, "embed_content is forwarded: {out}");
    let models: Vec<&str> = out["models"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(models.contains(&"models/gemini-mock-small"), "{out}");
    assert_eq!(out["one_model"], "models/gemini-mock-small");
    // Two model calls (the non-stream and the stream); the re-send was replayed.
    assert_eq!(app.mock.calls(), 2, "{out}");
    let list = records(&app).await;
    assert_eq!(
        list.len(),
        2,
        "count_tokens, embed_content and the model list are not recorded"
    );
    let routes: Vec<&str> = list.iter().filter_map(|r| r["route"].as_str()).collect();
    assert!(routes.contains(&"gemini.v1.generate"), "{routes:?}");
    assert!(routes.contains(&"gemini.v1.stream"), "{routes:?}");
    app.stop().await;
}

#[tokio::test]
async fn google_genai_python_stream_text_equals_the_providers_on_v1beta_gm3() {
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    let out = gemini_python("beta", &app.base).await;
    // The mock's text is a function of the body: ask the provider directly for the stream's.
    let direct: Value = app
        .http
        .post(format!(
            "{}/v1beta/models/gemini-2.5-flash:generateContent",
            app.mock.root_url()
        ))
        .body(
            serde_json::json!({"contents": [{"parts": [{"text": "gemini beta stream"}], "role": "user"}]})
                .to_string(),
        )
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        out["stream_text"], direct["candidates"][0]["content"]["parts"][0]["text"],
        "{out}"
    );
    let routes: Vec<String> = records(&app)
        .await
        .iter()
        .filter_map(|r| r["route"].as_str().map(str::to_owned))
        .collect();
    assert!(
        routes.contains(&"gemini.v1beta.stream".to_string()),
        "{routes:?}"
    );
    app.stop().await;
}

#[tokio::test]
async fn google_genai_python_retries_past_its_timeout_attach_to_one_provider_call_rs2_rd9() {
    // The provider answers after 3.2 s; the SDK gives up after 1 s and, with
    // HttpRetryOptions(attempts=3, delays 0.2..0.5 s), sends the same body again: each lands on
    // the first execution. Its second send times out by about 2.5 s and its third starts by
    // about 3 s, so the third is answered, attached or (started late) replayed. At 2.5 s the
    // second send's timeout raced the answer; at 4 s all three timed out.
    let app = spawn_app(
        MockConfig {
            header_delay_ms: 3_200,
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    let out = gemini_python("retry", &app.base).await;
    assert!(out["error"].is_null(), "the SDK call succeeded: {out}");
    assert!(out["text"].as_str().unwrap().starts_with("mock reply"));
    assert_eq!(
        app.mock.calls(),
        1,
        "one provider call for every SDK attempt"
    );
    let list = records(&app).await;
    assert_eq!(list.len(), 1);
    let id = list[0]["id"].as_str().unwrap().to_string();
    let record = wait_deliveries_at_least(&app.base, &id, 3).await;
    assert_eq!(record["attempts"], 1);
    assert!(record["saved_calls"].as_u64().unwrap() >= 2, "{record}");
    app.stop().await;
}

#[tokio::test]
async fn google_genai_python_with_retries_costs_only_holdfasts_own_retry_of_a_503_lc5() {
    let app = spawn_app(
        MockConfig {
            fail_first: 1,
            fail_status: 503,
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    let out = gemini_python("retry", &app.base).await;
    assert!(out["error"].is_null(), "the SDK call succeeded: {out}");
    assert_eq!(
        app.mock.calls(),
        2,
        "holdfast's retry of the 503, nothing more"
    );
    let list = records(&app).await;
    assert_eq!(list.len(), 1, "one request");
    assert_eq!(list[0]["attempts"], 2);
    app.stop().await;
}

#[tokio::test]
async fn google_genai_python_retrying_a_failed_request_makes_no_new_provider_call_id6a() {
    // The provider fails every call; holdfast makes its two attempts and answers 502 with
    // `x-should-retry: false`, which google-genai ignores: with HttpRetryOptions(attempts=3) it
    // sends the same body twice more. Within the minute of ID-6a each lands on the failed
    // request and gets its failure; before, each was a new request of two more paid calls.
    let app = spawn_always_failing_app().await;
    let out = gemini_python("retry", &app.base).await;
    let error = out["error"].as_str().unwrap_or_default();
    assert!(error.contains("502"), "the SDK raised the failure: {out}");
    assert_eq!(
        app.mock.calls(),
        2,
        "holdfast's two attempts, none for the SDK's retries: {out}"
    );
    let list = records(&app).await;
    assert_eq!(list.len(), 1, "one request: {list:?}");
    let id = list[0]["id"].as_str().unwrap().to_string();
    let record = wait_deliveries_at_least(&app.base, &id, 3).await;
    assert_eq!(record["status"], "failed");
    assert_eq!(record["error"]["type"], "attempts_exhausted");
    assert_eq!(record["attempts"], 2);
    app.stop().await;
}

#[tokio::test]
async fn google_genai_python_raises_when_the_provider_stream_is_cut_lc7_gm5() {
    let app = spawn_app(
        MockConfig {
            chunks: 6,
            drop_after_chunks: Some(3),
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    let out = gemini_python("interrupted", &app.base).await;
    assert_eq!(out["error"]["status"], "INTERNAL", "the SDK raised: {out}");
    assert!(
        out["error"]["message"].as_str().unwrap().contains("broke"),
        "{out}"
    );
    assert!(
        !out["text"].as_str().unwrap().is_empty(),
        "text came first: {out}"
    );
    app.stop().await;
}

/// RS-4, decision 73: google-genai for Python reads a Gemini stream with silences longer than
/// `sse_keepalive_ms` to its end (it raised on the `: keep-alive` comments that filled them).
#[tokio::test]
async fn google_genai_python_reads_a_stream_with_silences_to_its_end_rs4() {
    let app = spawn_app(
        MockConfig {
            chunks: 4,
            stall_after_chunks: Some((2, 500)),
            ..MockConfig::default()
        },
        |c| c.sse_keepalive_ms = 50,
    )
    .await;
    let out = gemini_python("quiet", &app.base).await;
    assert!(out.get("error").is_none(), "the SDK raised: {out}");
    assert!(
        out["text"].as_str().unwrap().starts_with("mock reply"),
        "{out}"
    );
    assert_eq!(app.mock.calls(), 1);
    app.stop().await;
}

#[tokio::test]
async fn usage_groups_by_provider_and_metrics_carry_it_rd9() {
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    let r = app.post(GENERATE, gemini_body("by provider"), &[]).await;
    assert_eq!(r.status(), 200);
    let again = app.post(GENERATE, gemini_body("by provider"), &[]).await;
    assert_eq!(header(&again, "idempotent-replayed"), "true");
    assert_eq!(app.chat(&chat_body("by provider")).await.status(), 200);
    let id = header(&again, "holdfast-request-id");
    wait_deliveries_at_least(&app.base, &id, 2).await;
    let usage = get_json(&app.http, &format!("{}/usage?group_by=provider", app.base)).await;
    assert_eq!(usage["group_by"], "provider");
    let groups = usage["groups"].as_array().unwrap();
    let of = |key: &str| {
        groups
            .iter()
            .find(|g| g["key"] == key)
            .unwrap_or_else(|| panic!("no {key} group: {usage}"))
    };
    assert_eq!(of("gemini")["requests"], 1, "{usage}");
    assert_eq!(of("gemini")["saved_calls"], 1, "{usage}");
    assert_eq!(of("openai")["requests"], 1, "{usage}");
    let page = app.metrics_text().await;
    assert!(
        metric(
            &page,
            "holdfast_upstream_tokens_total",
            r#"provider="gemini",backend="mock-gemini",kind="output""#
        ) > 0.0,
        "{page}"
    );
    assert_eq!(
        metric(&page, "holdfast_saved_calls_total", r#"provider="gemini""#),
        1.0
    );
    app.stop().await;
}

#[tokio::test]
async fn a_pass_through_path_to_a_gemini_backend_keeps_its_version_decision57() {
    let app = spawn_app(MockConfig::default(), |c| {
        c.passthrough = vec![holdfast::config::Passthrough {
            path: "/v1beta/files/*".into(),
            backend: "mock-gemini".into(),
        }];
    })
    .await;
    let r = app
        .http
        .get(format!("{}/v1beta/files/abc", app.base))
        .send()
        .await
        .unwrap();
    // The mock has no such route: its 404 names the path it was called with.
    assert_eq!(r.status(), 404);
    let body = r.text().await.unwrap();
    assert!(body.contains("GET /v1beta/files/abc"), "{body}");
    app.stop().await;
}

/// GM-3: Gemini 3 models send their usage in a chunk of its own, `usageMetadata` without
/// `candidates` (google-genai yields it as a response without text): after the chunk with
/// the `finishReason`, or with no `finishReason` at all on a turn of thoughts only (proto3
/// leaves an unspecified reason out); and a call that generated nothing streams that chunk
/// alone (decision 90's answer, streamed). Each is the provider's whole answer, which ended as
/// it always does, with a clean end of the body: it succeeds with that chunk's usage, is passed
/// on whole and replayed, where such a stream without a `finishReason` ended
/// `stream_interrupted`, a false failure the SDK's retry paid for again.
#[tokio::test]
async fn a_gemini_stream_ended_by_a_usage_report_of_its_own_succeeds_with_its_usage_gm3() {
    let chunk = |data: &str| format!("data: {data}\r\n\r\n");
    let text = chunk(
        r#"{"candidates":[{"content":{"parts":[{"text":"Hello"}],"role":"model"},"index":0}],"usageMetadata":{"promptTokenCount":7,"totalTokenCount":7},"modelVersion":"gemini-3-flash-preview","responseId":"r1"}"#,
    );
    let finish = chunk(
        r#"{"candidates":[{"content":{"parts":[{"text":" there."}],"role":"model"},"finishReason":"STOP","index":0}],"modelVersion":"gemini-3-flash-preview","responseId":"r1"}"#,
    );
    let thought = chunk(
        r#"{"candidates":[{"content":{"parts":[{"text":"Planning.","thought":true}],"role":"model"},"index":0}],"usageMetadata":{"promptTokenCount":7,"totalTokenCount":7},"modelVersion":"gemini-3-flash-preview","responseId":"r1"}"#,
    );
    let usage = |output: u32, thoughts: u32| {
        chunk(&format!(
            r#"{{"usageMetadata":{{"promptTokenCount":7,"candidatesTokenCount":{output},"thoughtsTokenCount":{thoughts},"totalTokenCount":{}}},"modelVersion":"gemini-3-flash-preview","responseId":"r1"}}"#,
            7 + output + thoughts
        ))
    };
    for (name, body, events, said, output) in [
        (
            "usage after the finishing chunk",
            [text.clone(), finish.clone(), usage(3, 11)].concat(),
            3,
            "Hello there.",
            14,
        ),
        (
            "a turn of thoughts only, its usage last and no finishReason",
            [thought.clone(), usage(0, 11)].concat(),
            2,
            "Planning.",
            11,
        ),
        ("nothing generated: the usage alone", usage(0, 0), 1, "", 0),
    ] {
        let provider = RawProvider::start(raw_200("text/event-stream", &body, false)).await;
        let url = provider.base_url();
        let app = spawn_app(MockConfig::default(), move |c| use_backend_url(c, &url)).await;
        let r = app.post(STREAM, gemini_body(name), &[]).await;
        assert_eq!(r.status(), 200, "{name}");
        let id = header(&r, "holdfast-request-id");
        let (raw, passed) = read_events(r).await;
        assert_eq!(passed.len(), events, "{name}: every chunk passed on: {raw}");
        assert_eq!(gemini_text(&passed), said, "{name}");
        let record = wait_terminal(&app.http, &app.base, &id, Duration::from_secs(10)).await;
        assert_eq!(record["status"], "succeeded", "{name}: {record}");
        assert_eq!(record["usage"]["input_tokens"], 7, "{name}: {record}");
        assert_eq!(record["usage"]["output_tokens"], output, "{name}: {record}");
        let again = app.post(STREAM, gemini_body(name), &[]).await;
        assert_eq!(header(&again, "idempotent-replayed"), "true", "{name}");
        let (_, replayed) = read_events(again).await;
        assert_eq!(replayed.len(), events, "{name}");
        assert_eq!(provider.calls(), 1, "{name}");
        app.stop().await;
    }
}

/// GM-3, LC-7, decision 119: a stream cut after a usage report by a gateway that then ends the
/// body cleanly, the answer's text shown and no `finishReason` ever sent, is not the
/// provider's whole answer: it fails `stream_interrupted` with the usage reported, and the
/// client's stream closes with the error chunk. The usage report passed for Gemini's ending
/// (decision 110) and the cut answer was stored as a success, replayed for the claim window.
#[tokio::test]
async fn a_gemini_stream_cut_after_a_usage_report_before_its_finish_reason_is_interrupted_gm3_lc7()
{
    let chunk = |data: &str| format!("data: {data}\r\n\r\n");
    let body = [
        chunk(
            r#"{"candidates":[{"content":{"parts":[{"text":"The answer is"}],"role":"model"},"index":0}],"usageMetadata":{"promptTokenCount":7,"totalTokenCount":7},"modelVersion":"gemini-3-flash-preview","responseId":"r1"}"#,
        ),
        chunk(
            r#"{"usageMetadata":{"promptTokenCount":7,"candidatesTokenCount":3,"totalTokenCount":10},"modelVersion":"gemini-3-flash-preview","responseId":"r1"}"#,
        ),
    ]
    .concat();
    let provider = RawProvider::start(raw_200("text/event-stream", &body, false)).await;
    let url = provider.base_url();
    let app = spawn_app(MockConfig::default(), move |c| use_backend_url(c, &url)).await;
    let r = app.post(STREAM, gemini_body("cut"), &[]).await;
    assert_eq!(r.status(), 200);
    let id = header(&r, "holdfast-request-id");
    let (raw, events) = read_events(r).await;
    let last = events.last().expect("events");
    assert!(last.data.starts_with(r#"{"error":"#), "{raw}");
    let record = wait_terminal(&app.http, &app.base, &id, Duration::from_secs(10)).await;
    assert_eq!(record["status"], "failed", "{record}");
    assert_eq!(record["error"]["type"], "stream_interrupted", "{record}");
    assert_eq!(record["usage"]["output_tokens"], 3, "{record}");
    app.stop().await;
}

/// GM-1, EX-7 (decision 153): a replay's `model` for a Gemini request goes in the upstream path,
/// so it is held to what a client's path may name there: one segment of letters, digits, `.`,
/// `-`, `_`. Before, a replay named any string, and `../../v1beta/cachedContents?x=` made
/// holdfast POST, with the backend's key, to another path of the provider's (a break-it trial
/// of the thirty-second session), and a `:streamGenerateContent` suffix had a stream answered,
/// and billed, into a request stored as failed.
#[tokio::test]
async fn a_replay_naming_a_gemini_model_that_is_not_one_path_segment_is_refused_and_calls_nothing_gm1_ex7()
 {
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    let first = app
        .post(GENERATE, gemini_body("replayed with a bad model"), &[])
        .await;
    assert_eq!(first.status(), 200);
    let id = header(&first, "holdfast-request-id");
    for model in [
        "../../v1beta/cachedContents?x=",
        "gemini-2.5-flash:streamGenerateContent?alt=sse&",
        "has space",
        "a/b",
        &"g".repeat(300),
    ] {
        let replay = app
            .post(
                &format!("/requests/{id}/replay"),
                json!({ "model": model }).to_string(),
                &[],
            )
            .await;
        assert_eq!(replay.status(), 400, "{model:?}");
        let error: Value = replay.json().await.unwrap();
        assert!(
            error.to_string().contains("cannot be a Gemini model"),
            "{model:?}: {error}"
        );
    }
    assert_eq!(app.mock.calls(), 1, "no replay reached the provider");
    // A model of the path's form is replayed, in the path.
    let replay = app
        .post(
            &format!("/requests/{id}/replay"),
            json!({ "model": "gemini-2.5-pro" }).to_string(),
            &[],
        )
        .await;
    assert_eq!(replay.status(), 201);
    let replayed: Value = replay.json().await.unwrap();
    let new_id = replayed["id"]
        .as_str()
        .expect("the replay's id")
        .to_string();
    let done = wait_terminal(&app.http, &app.base, &new_id, Duration::from_secs(10)).await;
    assert_eq!(done["status"], "succeeded", "{done}");
    assert_eq!(
        app.mock.recorded()[1].path,
        "/v1beta/models/gemini-2.5-pro:generateContent"
    );
    app.stop().await;
}
