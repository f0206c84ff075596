//! Every call an SDK makes works through holdfast (issue 14): model lists, token counting,
//! configured pass-through paths, and OpenAI's Responses retrieval protocol served from the log
//! (RS-4, RD-3, RD-6, LC-9). Tests that drive Python have `python` in their name.

use std::time::{Duration, Instant};

use holdfast::config::{ModelRewrite, Passthrough};
use holdfast::mock::MockConfig;
use serde_json::Value;

use crate::helpers::*;

/// Runs `python tests/clients/SCRIPT ARGS...` (args through `HOLDFAST_MODE`) off the runtime and
/// parses the JSON object it prints.
async fn python_json(script: &'static str, mode: &str, base: &str) -> Value {
    let (mode, base) = (mode.to_string(), base.to_string());
    let out = tokio::task::spawn_blocking(move || {
        run_python_args(script, &[&mode], &[("HOLDFAST_URL", &base)])
    })
    .await
    .unwrap();
    serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{script} printed {out}: {e}"))
}

#[tokio::test]
async fn python_sdks_list_models_with_aliases_and_count_tokens_and_nothing_is_recorded() {
    require_python(&["openai", "anthropic"]);
    let app = spawn_app(MockConfig::default(), |c| {
        c.model_rewrites = vec![
            ModelRewrite {
                pattern: "fast".into(),
                backend: "mock-openai".into(),
                model: Some("mock-small".into()),
            },
            ModelRewrite {
                pattern: "claude-fast".into(),
                backend: "mock-anthropic".into(),
                model: None,
            },
            ModelRewrite {
                pattern: "gpt-*".into(),
                backend: "mock-openai".into(),
                model: None,
            },
        ];
    })
    .await;
    let out = python_json("sdk_surface.py", "", &app.base).await;
    let openai: Vec<&str> = out["openai_models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(
        openai,
        ["mock-small", "mock-large", "gpt-4o-mini", "fast"],
        "{out}"
    );
    let anthropic: Vec<&str> = out["anthropic_models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(
        anthropic,
        [
            "claude-mock-small",
            "claude-mock-large",
            "claude-gpt-4o-mini",
            "claude-fast"
        ],
        "{out}"
    );
    assert!(out["count_tokens"].as_u64().unwrap() > 0, "{out}");
    assert!(records(&app).await.is_empty(), "nothing is recorded");
    assert_eq!(app.mock.calls(), 0, "no model call");
    // The client's key never reaches the provider; the provider's default version header does.
    for call in app.mock.other_calls() {
        assert!(
            !call
                .headers
                .iter()
                .any(|(n, v)| n == "authorization" && v.contains("unused")),
            "{call:?}"
        );
    }
    app.stop().await;
}

#[tokio::test]
async fn configured_pass_through_paths_are_forwarded_with_the_backends_key_only() {
    let app = spawn_app(MockConfig::default(), |c| {
        c.passthrough = vec![Passthrough {
            path: "/v1/responses_extra/*".into(),
            backend: "mock-openai".into(),
        }];
    })
    .await;
    // The mock has no such route: its 404 comes back as it is, from the backend.
    let r = app
        .http
        .get(format!("{}/v1/responses_extra/abc?x=1", app.base))
        .header("authorization", "Bearer client-secret")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let body: Value = r.json().await.unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("mock: no route for GET /v1/responses_extra/abc"),
        "{body}"
    );
    // Not configured: holdfast's own 404.
    let r = app
        .http
        .get(format!("{}/v1/moderations", app.base))
        .send()
        .await
        .unwrap();
    assert_eq!(header(&r, "holdfast-error"), "not_found");
    assert!(records(&app).await.is_empty());
    app.stop().await;
}

/// A slow Responses stream: 30 content events, 60 ms apart.
fn slow_responses() -> MockConfig {
    MockConfig {
        chunks: 30,
        chunk_delay_ms: 60,
        ..MockConfig::default()
    }
}

/// The assertions of acceptance 2: after the drop, exactly the remaining events, consecutive
/// `sequence_number`s from 11, ending in `response.completed`; the text before and after the
/// drop is the uninterrupted text; one upstream call.
fn assert_resumed(out: &Value, app: &TestApp) {
    let before = out["before"].as_array().unwrap();
    let after = out["after"].as_array().unwrap();
    let seqs: Vec<i64> = before
        .iter()
        .chain(after)
        .map(|e| e["sequence_number"].as_i64().unwrap())
        .collect();
    assert_eq!(
        seqs,
        (0..seqs.len() as i64).collect::<Vec<_>>(),
        "consecutive sequence numbers, none repeated: {out}"
    );
    assert_eq!(before.last().unwrap()["sequence_number"], 10, "{out}");
    assert_eq!(after.first().unwrap()["sequence_number"], 11, "{out}");
    assert_eq!(after.last().unwrap()["type"], "response.completed", "{out}");
    let text: String = before
        .iter()
        .chain(after)
        .filter_map(|e| e["delta"].as_str())
        .collect();
    assert_eq!(text, out["final_text"].as_str().unwrap(), "{out}");
    assert!(text.starts_with("mock reply"), "{out}");
    assert_eq!(out["status"], "completed");
    assert_eq!(app.mock.calls(), 1, "one upstream call");
}

#[tokio::test]
async fn python_responses_retrieve_resumes_after_sequence_number_10_from_the_log_rd3() {
    require_python(&["openai"]);
    let app = spawn_app(slow_responses(), |_| {}).await;
    let out = python_json("responses_resume.py", "retrieve", &app.base).await;
    assert_resumed(&out, &app);
    app.stop().await;
}

#[tokio::test]
async fn python_responses_stream_helper_resumes_after_sequence_number_10_rd3() {
    require_python(&["openai"]);
    let app = spawn_app(slow_responses(), |_| {}).await;
    let out = python_json("responses_resume.py", "helper", &app.base).await;
    assert_resumed(&out, &app);
    assert_eq!(out["helper_final_text"], out["final_text"], "{out}");
    app.stop().await;
}

#[tokio::test]
async fn python_responses_retrieve_shows_the_status_during_and_after_and_cancel_aborts_the_call_lc9()
 {
    require_python(&["openai"]);
    let app = spawn_app(slow_responses(), |_| {}).await;
    let out = python_json("responses_resume.py", "status", &app.base).await;
    assert_eq!(out["during"], "in_progress", "{out}");
    assert_eq!(out["after"], "completed", "{out}");
    assert_eq!(app.mock.calls(), 1);
    app.stop().await;

    // A stream that pauses 5 s after its first delta, cancelled after its fourth event: it
    // cannot end by itself within a second of the cancel, and no event arrives to be refused
    // by the store, so only the cancel's abort can close it.
    let app = spawn_app(
        MockConfig {
            chunks: 30,
            stall_after_chunks: Some((1, 5_000)),
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    // While the script runs: the moment the record is cancelled (`failed` / `cancelled`), then
    // how long until the provider sees its stream closed.
    let watch = async {
        let start = Instant::now();
        let cancelled_at = loop {
            let all = records(&app).await;
            if all
                .first()
                .is_some_and(|r| r["error"]["type"] == "cancelled")
            {
                break Instant::now();
            }
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "never cancelled: {all:?}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        while app.mock.open_streams() > 0 {
            assert!(
                cancelled_at.elapsed() < Duration::from_secs(1),
                "the upstream stream still open 1 s after the cancel"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        cancelled_at.elapsed()
    };
    let (out, closed_after) = tokio::join!(
        python_json("responses_resume.py", "cancel", &app.base),
        watch
    );
    assert_eq!(out["cancelled"], "cancelled", "{out}");
    assert_eq!(out["after"], "cancelled", "{out}");
    assert!(
        out["cancel_seconds"].as_f64().unwrap() < 1.0,
        "the cancel call answered within 1 s: {out}"
    );
    assert!(closed_after < Duration::from_secs(1), "{closed_after:?}");
    let record = &records(&app).await[0];
    assert_eq!(record["error"]["type"], "cancelled", "{record}");
    // The provider's stream was cut: far fewer events stored than its 38.
    assert!(
        record["last_seq"].as_i64().unwrap() < 20,
        "the stream stopped at the cancel: {record}"
    );
    assert_eq!(app.mock.calls(), 1);
    app.stop().await;
}

/// RD-8 (decision 161): another namespace's response id is 404 and not forwarded; an id holdfast
/// never recorded (or has pruned) is passed to the backend only where no namespaces are
/// configured: where they share the backends' keys it may be another tenant's (a security
/// review found that after pruning, any namespace could read or delete another's responses at
/// the provider, with the backend's key).
#[tokio::test]
async fn an_unknown_response_id_is_passed_on_only_without_namespaces_and_another_namespaces_is_404_rd8()
 {
    let app = spawn_app(MockConfig::default(), |c| {
        c.namespaces = two_namespaces("a", "b");
    })
    .await;
    let body = r#"{"model":"gpt-4o-mini","input":"whose is it"}"#;
    let r = app
        .post("/v1/responses", body, &[("authorization", "Bearer key-a")])
        .await;
    assert_eq!(r.status(), 200);
    let answer: Value = r.json().await.unwrap();
    let id = answer["id"].as_str().unwrap().to_string();
    // Its namespace reads it from the log (no backend call).
    let get = |key: &'static str, id: String| {
        let app = &app;
        async move {
            app.http
                .get(format!("{}/v1/responses/{id}", app.base))
                .header("authorization", format!("Bearer {key}"))
                .send()
                .await
                .unwrap()
        }
    };
    let r = get("key-a", id.clone()).await;
    assert_eq!(r.status(), 200);
    let object: Value = r.json().await.unwrap();
    assert_eq!(object, answer);
    assert!(app.mock.other_calls().is_empty());
    // Another namespace: 404, not forwarded.
    let r = get("key-b", id.clone()).await;
    assert_eq!(r.status(), 404);
    assert!(app.mock.other_calls().is_empty());
    // An id holdfast never recorded, with namespaces: 404, not forwarded.
    let r = get("key-a", "resp_stored_upstream".into()).await;
    assert_eq!(r.status(), 404);
    assert!(app.mock.other_calls().is_empty());
    app.stop().await;
    // Without namespaces: forwarded unchanged, with the backend's key only.
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    let r = app
        .http
        .get(format!("{}/v1/responses/resp_stored_upstream", app.base))
        .header("authorization", "Bearer key-a")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404, "the mock's own answer");
    let calls = app.mock.other_calls();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].path, "/v1/responses/resp_stored_upstream");
    assert!(
        !calls[0].headers.iter().any(|(_, v)| v.contains("key-a")),
        "the client's key is not forwarded: {:?}",
        calls[0].headers
    );
    app.stop().await;
}

/// A background Responses call (`"background": true`) is answered at once with the response
/// `queued`: the provider finishes it, so retrieving or cancelling its id reaches the provider
/// (the backend that ran it), never a stale `queued` object from the log; another namespace's
/// retrieval is still 404 and not forwarded (RD-8, decision 46).
#[tokio::test]
async fn a_background_responses_id_is_the_providers_to_retrieve_and_cancel_rd8_decision46() {
    let queued =
        r#"{"id":"resp_bg_1","object":"response","status":"queued","background":true,"output":[]}"#;
    let raw = RawProvider::start(raw_200("application/json", queued, false)).await;
    let url = raw.base_url();
    let app = spawn_app(MockConfig::default(), move |c| {
        use_backend_url(c, &url);
        c.namespaces = two_namespaces("a", "b");
    })
    .await;
    let key_a = [("authorization", "Bearer key-a")];
    let body = r#"{"model":"gpt-4o-mini","input":"run in the background","background":true}"#;
    let r = app.post("/v1/responses", body, &key_a).await;
    assert_eq!(r.status(), 200);
    let answer: Value = r.json().await.unwrap();
    assert_eq!(answer["status"], "queued", "{answer}");
    assert_eq!(raw.calls(), 1);
    // An SDK's retry of the same call is still the one background job.
    let again = app.post("/v1/responses", body, &key_a).await;
    assert_eq!(header(&again, "idempotent-replayed"), "true");
    assert_eq!(raw.calls(), 1);

    let call = |method: reqwest::Method, path: &str, key: &str| {
        app.http
            .request(method, format!("{}{path}", app.base))
            .header("authorization", format!("Bearer {key}"))
            .send()
    };
    let r = call(reqwest::Method::GET, "/v1/responses/resp_bg_1", "key-b")
        .await
        .unwrap();
    assert_eq!(r.status(), 404, "another namespace's job");
    assert_eq!(raw.calls(), 1, "and not forwarded");
    let r = call(reqwest::Method::GET, "/v1/responses/resp_bg_1", "key-a")
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(raw.calls(), 2, "the retrieval went to the provider");
    let r = call(
        reqwest::Method::POST,
        "/v1/responses/resp_bg_1/cancel",
        "key-a",
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(raw.calls(), 3, "so did the cancel");
    app.stop().await;
}

#[tokio::test]
async fn langchain_python_chat_openai_retries_attach_to_one_upstream_call() {
    require_python(&["langchain_openai"]);
    for mode in ["invoke", "stream"] {
        let app = spawn_app(
            MockConfig {
                header_delay_ms: 2_500,
                ..MockConfig::default()
            },
            |_| {},
        )
        .await;
        let out = python_json("langchain_retry.py", mode, &app.base).await;
        assert_eq!(out["error"], Value::Null, "{mode}: {out}");
        assert!(
            out["text"].as_str().unwrap().starts_with("mock reply"),
            "{mode}: {out}"
        );
        assert_eq!(
            app.mock.calls(),
            1,
            "{mode}: one upstream call under retries"
        );
        let all = records(&app).await;
        assert_eq!(all.len(), 1, "{mode}: one request");
        assert_eq!(all[0]["stream"], mode == "stream");
        // The SDK retried after its 1 s timeout, and the retry was answered by this request:
        // the first submission plus at least one attached or replayed.
        let id = all[0]["id"].as_str().unwrap();
        let record = wait_deliveries_at_least(&app.base, id, 2).await;
        let d = &record["deliveries"];
        assert_eq!(
            d["total"].as_u64(),
            Some(1 + d["attached"].as_u64().unwrap() + d["replayed"].as_u64().unwrap()),
            "{mode}: {record}"
        );
        app.stop().await;
    }
}

/// RD-8 (decision 158): a response id goes into a path sent to a backend with its key, so only
/// an id of one segment's form is looked up or passed on: `..%2F`, `%3F` and the like are 404
/// without a call (before, `GET /v1/responses/..%2Ffiles` reached the backend as `GET
/// /v1/files`, which lists an account's files, with the backend's key). `DELETE
/// /v1/responses/{id}` and `GET /v1/responses/{id}/input_items`, which the OpenAI SDKs call,
/// are passed to the backend that produced the response (they were 405 and 404, and a
/// `[[passthrough]]` for them is refused as overlapping holdfast's own route), and another
/// namespace's id is 404 without a call.
#[tokio::test]
async fn a_response_id_is_one_segment_and_delete_and_input_items_go_to_the_backend_that_made_it_rd8()
 {
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    let r = app
        .post(
            "/v1/responses",
            r#"{"model":"gpt-4o-mini","input":"delete me later"}"#,
            &[],
        )
        .await;
    assert_eq!(r.status(), 200);
    let answer: Value = r.json().await.unwrap();
    let id = answer["id"].as_str().unwrap().to_string();
    let send = |method: reqwest::Method, path: String| {
        let app = &app;
        async move {
            app.http
                .request(method, format!("{}{path}", app.base))
                .send()
                .await
                .unwrap()
        }
    };
    for path in [
        "/v1/responses/..%2Ffiles",
        "/v1/responses/..%2F..%2Fv1%2Ffiles",
        "/v1/responses/resp_1%3Flimit=1",
        "/v1/responses/resp%2F1/cancel",
        "/v1/responses/..%2Ffiles/input_items",
    ] {
        let method = if path.ends_with("/cancel") {
            reqwest::Method::POST
        } else {
            reqwest::Method::GET
        };
        let r = send(method, path.to_string()).await;
        assert_eq!(r.status(), 404, "{path}");
    }
    let r = send(reqwest::Method::DELETE, "/v1/responses/..%2Ffiles".into()).await;
    assert_eq!(r.status(), 404);
    assert!(
        app.mock.other_calls().is_empty(),
        "nothing reached the backend: {:?}",
        app.mock.other_calls()
    );

    let r = send(
        reqwest::Method::GET,
        format!("/v1/responses/{id}/input_items?limit=2"),
    )
    .await;
    assert_eq!(r.status(), 404, "the mock's own answer: it stores nothing");
    let r = send(reqwest::Method::DELETE, format!("/v1/responses/{id}")).await;
    assert_eq!(r.status(), 404, "the mock's own answer");
    let paths: Vec<String> = app.mock.other_calls().into_iter().map(|c| c.path).collect();
    assert_eq!(
        paths,
        [
            format!("/v1/responses/{id}/input_items?limit=2"),
            format!("/v1/responses/{id}"),
        ]
    );
    // The log keeps its record.
    let r = send(reqwest::Method::GET, format!("/v1/responses/{id}")).await;
    assert_eq!(r.status(), 200);
    app.stop().await;
}

/// HTTP-4 (decision 159): a `[[passthrough]]` path under a `*` rule is forwarded only when it
/// names what it says: a `.` or `..` segment, plain or encoded, or an encoded `/` or `\`, is
/// 404 without a call. Before, `/v1/files/../chat/completions` matched `/v1/files/*`, its dot
/// segments were resolved on the way out, and a chat completion ran at the provider unlogged:
/// no record, no claim, no usage (found checking decision 158's traversal).
#[tokio::test]
async fn a_pass_through_path_with_dot_segments_is_refused_unforwarded_http4() {
    let app = spawn_app(MockConfig::default(), |c| {
        c.passthrough = vec![Passthrough {
            path: "/v1/files/*".into(),
            backend: "mock-openai".into(),
        }];
    })
    .await;
    let body = chat_body("unlogged?");
    let raw = |path: &'static str| {
        let (addr, body) = (app.addr, body.clone());
        async move {
            // reqwest would resolve the dot segments itself: the bytes go as written.
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
            let request = format!(
                "POST {path} HTTP/1.1\r\nhost: holdfast\r\ncontent-type: application/json\r\n\
                 content-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            socket.write_all(request.as_bytes()).await.unwrap();
            let mut answer = String::new();
            socket.read_to_string(&mut answer).await.unwrap();
            answer
        }
    };
    for path in [
        "/v1/files/../chat/completions",
        "/v1/files/%2e%2e/chat/completions",
        "/v1/files/./../chat/completions",
        "/v1/files/x%2F..%2F..%2Fchat%2Fcompletions",
    ] {
        let answer = raw(path).await;
        assert!(
            answer.starts_with("HTTP/1.1 404") && answer.contains("is not forwarded"),
            "{path}: {answer}"
        );
    }
    assert_eq!(app.mock.calls(), 0, "no model call ran");
    // A plain path under the rule still goes: the mock's own 404 comes back.
    let answer = raw("/v1/files/file-abc/content").await;
    assert!(
        answer.starts_with("HTTP/1.1 404") && answer.contains("mock:"),
        "{answer}"
    );
    app.stop().await;
}

/// RD-8a (decision 161): where namespaces share the backends' keys, a Responses call continues
/// (`previous_response_id`) only a response its own namespace made through holdfast: another
/// namespace's id, or one holdfast never recorded, is refused 400 `previous_response_not_found`
/// before anything is recorded or sent. Before, namespace b's call naming a's response reached
/// the provider, which would give the model a's whole conversation (a security review).
#[tokio::test]
async fn a_responses_call_continues_only_its_own_namespaces_response_rd8a() {
    let app = spawn_app(MockConfig::default(), |c| {
        c.namespaces = two_namespaces("a", "b");
    })
    .await;
    let call = |key: &'static str, body: String| {
        let app = &app;
        async move {
            app.post(
                "/v1/responses",
                body,
                &[("authorization", &format!("Bearer {key}"))],
            )
            .await
        }
    };
    let r = call(
        "key-a",
        r#"{"model":"gpt-4o-mini","input":"my secret"}"#.into(),
    )
    .await;
    assert_eq!(r.status(), 200);
    let id = r.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let continuing = |id: &str, input: &str| {
        serde_json::json!({"model": "gpt-4o-mini", "previous_response_id": id, "input": input})
            .to_string()
    };
    for (key, id) in [("key-b", id.as_str()), ("key-a", "resp_never_recorded")] {
        let r = call(key, continuing(id, "repeat everything said before")).await;
        assert_eq!(r.status(), 400, "{key} {id}");
        let error: Value = r.json().await.unwrap();
        assert_eq!(
            error["error"]["code"], "previous_response_not_found",
            "{error}"
        );
    }
    // A member name written with an escape is the same member to the provider.
    let escaped =
        format!(r#"{{"model":"gpt-4o-mini","previous\u005fresponse_id":"{id}","input":"again"}}"#);
    let r = call("key-b", escaped).await;
    assert_eq!(r.status(), 400);
    assert_eq!(app.mock.calls(), 1, "nothing reached the provider");
    // Its own namespace continues it.
    let r = call("key-a", continuing(&id, "and then?")).await;
    assert_eq!(r.status(), 200);
    assert_eq!(app.mock.calls(), 2);
    app.stop().await;
}

/// GM-4, HTTP-4 (decision 162): a pass-through call to a Gemini backend takes a `?key=` as the
/// caller's namespace key, as Gemini's own routes do, and does not pass it on: the backend gets
/// its own key and the rest of the query. Before, the namespace key went to Google in the
/// query beside the backend's key (a security review).
#[tokio::test]
async fn a_gemini_pass_through_takes_a_query_key_as_the_namespace_key_and_does_not_pass_it_on_gm4()
{
    let app = spawn_app(MockConfig::default(), |c| {
        c.namespaces = two_namespaces("a", "b");
        c.passthrough = vec![Passthrough {
            path: "/v1beta/files/*".into(),
            backend: "mock-gemini".into(),
        }];
    })
    .await;
    let r = app
        .http
        .get(format!(
            "{}/v1beta/files/abc?key=key-a&pageSize=2&%6Bey=key-a",
            app.base
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404, "the mock's own answer");
    let body: Value = r.json().await.unwrap();
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("no route for GET /v1beta/files/abc?pageSize=2"),
        "{message}"
    );
    assert!(!message.contains("key-a"), "{message}");
    app.stop().await;
}
