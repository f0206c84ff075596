//! Replaying a logged call (issue 34): `POST /requests/{id}/replay` and `holdfast requests
//! replay` against the mock (EX-7..EX-9), and namespace isolation.

use holdfast::mock::MockConfig;
use serde_json::{Value, json};

use crate::helpers::*;

async fn send(app: &TestApp, body: Value, key: Option<&str>) -> String {
    let auth = key.map(|key| format!("Bearer {key}"));
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", a.as_str())).collect();
    let r = app
        .post("/v1/chat/completions", body.to_string(), &headers)
        .await;
    assert!(r.status().is_success(), "{}", r.status());
    let id = header(&r, "holdfast-request-id");
    let _ = r.bytes().await.unwrap();
    id
}

async fn replay_api(app: &TestApp, id: &str, body: &str, key: Option<&str>) -> (u16, Value) {
    let mut req = app
        .http
        .post(format!("{}/requests/{id}/replay", app.base))
        .header("content-type", "application/json")
        .body(body.to_string());
    if let Some(key) = key {
        req = req.bearer_auth(key);
    }
    let r = req.send().await.unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

async fn replays_of(app: &TestApp, id: &str, key: Option<&str>) -> Vec<Value> {
    let mut req = app
        .http
        .get(format!("{}/requests?replay_of={id}", app.base));
    if let Some(key) = key {
        req = req.bearer_auth(key);
    }
    let list: Value = req.send().await.unwrap().json().await.unwrap();
    list["data"].as_array().unwrap().clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_with_another_model_calls_the_provider_again_links_the_new_request_and_shows_both_answers_ex7_ex8_ex9()
 {
    let app = spawn_app(MockConfig::default(), |c| {
        c.prices = vec![holdfast::config::Price {
            backend: "mock-openai".into(),
            model: "gpt-4o-mini".into(),
            input_per_mtok: 0.15,
            output_per_mtok: 0.6,
            cached_input_per_mtok: None,
            cache_write_per_mtok: None,
            cache_write_1h_per_mtok: None,
        }];
    })
    .await;
    let body = json!({"model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "replay me"}]});
    let original = send(&app, body.clone(), None).await;
    let calls = app.mock.calls();

    let dir = tempfile::tempdir().unwrap();
    let env = [("HOLDFAST_URL", app.base.as_str())];
    let (code, out, err) = run_holdfast(
        dir.path(),
        &["requests", "replay", &original, "--model", "mock-large"],
        &env,
    );
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(
        app.mock.calls(),
        calls + 1,
        "a replay calls the provider (EX-7)"
    );
    assert!(out.contains("ORIGINAL") && out.contains("REPLAY"), "{out}");
    assert!(out.contains("mock reply to gpt-4o-mini:"), "{out}");
    assert!(out.contains("mock reply to mock-large:"), "{out}");
    assert!(out.contains('$'), "the original's cost: {out}");

    let replays = replays_of(&app, &original, None).await;
    assert_eq!(replays.len(), 1);
    let replay = &replays[0];
    assert_eq!(replay["replay_of"], original.as_str());
    assert_eq!(replay["model"], "mock-large");
    assert_eq!(replay["status"], "succeeded");
    assert!(out.contains(replay["id"].as_str().unwrap()), "{out}");
    assert_eq!(app.record(&original).await["replay_of"], Value::Null);
    // The body went out again with only its model changed (ID-3b).
    let shown: Value = app
        .http
        .get(format!(
            "{}/requests/{}?include=body",
            app.base,
            replay["id"].as_str().unwrap()
        ))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(shown["request"]["body"]["messages"], body["messages"]);
    assert_eq!(shown["request"]["body"]["model"], "mock-large");

    // Same model again, a streamed original, `--json`: another provider call even though the
    // original's claim lives (its identity is new), the stream reassembled for the texts.
    let streamed = send(
        &app,
        json!({"model": "gpt-4o-mini", "stream": true,
            "messages": [{"role": "user", "content": "replay my stream"}]}),
        None,
    )
    .await;
    let calls = app.mock.calls();
    let (code, out, err) = run_holdfast(
        dir.path(),
        &["requests", "replay", &streamed, "--json"],
        &env,
    );
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(app.mock.calls(), calls + 1);
    let both: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(both["original"]["id"], streamed.as_str());
    assert_eq!(both["replay"]["replay_of"], streamed.as_str());
    assert_eq!(both["replay"]["stream"], true);
    assert_eq!(
        both["original"]["answer_text"],
        both["replay"]["answer_text"]
    );
    assert!(
        both["replay"]["answer_text"]
            .as_str()
            .unwrap()
            .starts_with("mock reply to gpt-4o-mini:")
    );

    // What the API refuses, naming it.
    for (body, name) in [
        (r#"{"backend":"nope"}"#, "backend"),
        (r#"{"backend":"mock-anthropic"}"#, "backend"),
        (r#"{"colour":"red"}"#, "colour"),
        (r#"{"model":5}"#, "model"),
        ("[1]", "body"),
    ] {
        let (status, answer) = replay_api(&app, &original, body, None).await;
        assert_eq!(status, 400, "{body}: {answer}");
        assert!(
            answer["error"]["message"].as_str().unwrap().contains(name),
            "{body}: {answer}"
        );
    }
    let (status, answer) = replay_api(&app, &original, r#"{"backend":"mock-openai"}"#, None).await;
    assert_eq!(status, 201, "{answer}");
    assert_eq!(answer["backend"], "mock-openai");
    assert_eq!(answer["replay_of"], original.as_str());
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_key_replays_only_its_own_requests_and_an_unknown_or_foreign_id_exits_1_ex7_ex9()
 {
    let app = spawn_app(MockConfig::default(), |c| {
        c.namespaces = two_namespaces("team-a", "team-b");
        c.admin_api_keys = vec!["admin".into()];
    })
    .await;
    let of_a = send(
        &app,
        json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "mine"}]}),
        Some("key-a"),
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let as_b = [
        ("HOLDFAST_URL", app.base.as_str()),
        ("HOLDFAST_API_KEY", "key-b"),
    ];
    let calls = app.mock.calls();
    let (code, out, err) = run_holdfast(dir.path(), &["requests", "replay", &of_a], &as_b);
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains("404") && err.contains(&format!("no request {of_a}")),
        "{err}"
    );
    let unknown = uuid::Uuid::now_v7().to_string();
    let as_a = [
        ("HOLDFAST_URL", app.base.as_str()),
        ("HOLDFAST_API_KEY", "key-a"),
    ];
    let (code, _, err) = run_holdfast(dir.path(), &["requests", "replay", &unknown], &as_a);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("404") && err.contains(&unknown), "{err}");
    assert_eq!(app.mock.calls(), calls, "nothing was sent");
    let (status, _) = replay_api(&app, &of_a, "{}", Some("key-b")).await;
    assert_eq!(status, 404);
    let (status, _) = replay_api(&app, "not-an-id", "{}", Some("key-a")).await;
    assert_eq!(status, 404);

    // An admin replays it into its own namespace: team-a sees the replay, team-b does not.
    let (status, replay) = replay_api(&app, &of_a, "{}", Some("admin")).await;
    assert_eq!(status, 201, "{replay}");
    assert_eq!(replays_of(&app, &of_a, Some("key-a")).await.len(), 1);
    assert!(replays_of(&app, &of_a, Some("key-b")).await.is_empty());
    // Its own key replays it too.
    let (code, out, err) = run_holdfast(dir.path(), &["requests", "replay", &of_a], &as_a);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(replays_of(&app, &of_a, Some("key-a")).await.len(), 2);
    app.stop().await;
}

/// EX-7, decision 86: a replay that names neither a model nor a backend goes to the original's
/// backend; once a restart has removed that backend it is refused with a 400 naming it, and
/// nothing is recorded or sent, instead of a record whose attempts fail without a provider
/// call. Naming a model routes it as a new call would. Processes of their own: the restart is
/// the second process, started once the first has exited and let go of the database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_whose_original_backend_is_no_longer_configured_is_refused_ex7() {
    let mock = start_mock(MockConfig::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("holdfast.db").display());
    let config = |retired: bool| {
        let mut toml = fault_test_toml(&db, "", 30, &mock.base_url());
        if retired {
            toml.push_str(&format!(
                "[[backends]]\nname = \"retired\"\nkind = \"openai\"\nbase_url = \"{}\"\n\
                 [[model_rewrites]]\nmatch = \"gpt-4o-mini\"\nbackend = \"retired\"\n",
                mock.base_url()
            ));
        }
        toml
    };
    let http = reqwest::Client::new();
    let mut node = Process::serve(dir.path(), &config(true), free_addr()).await;
    let r = http
        .post(format!("{}/v1/chat/completions", node.base))
        .header("content-type", "application/json")
        .body(chat_body("replay after the backend went"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let id = header(&r, "holdfast-request-id");
    assert_eq!(
        get_record(&http, &node.base, &id).await["backend"],
        "retired"
    );
    assert!(node.sigterm_and_wait(std::time::Duration::from_secs(30)));

    let node = Process::serve(dir.path(), &config(false), free_addr()).await;
    let base = node.base.clone();
    let replay = |body: &'static str| {
        http.post(format!("{base}/requests/{id}/replay"))
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    let calls = mock.calls();
    let r = replay("{}").await.unwrap();
    assert_eq!(r.status(), 400);
    let answer: Value = r.json().await.unwrap();
    assert_eq!(answer["error"]["code"], "invalid_parameter", "{answer}");
    assert!(
        answer["error"]["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("backend:") && m.contains("\"retired\"")),
        "{answer}"
    );
    let listed: Value = http
        .get(format!("{base}/requests?replay_of={id}"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(listed["data"], json!([]), "nothing recorded");
    assert_eq!(mock.calls(), calls, "nothing sent");

    let r = replay(r#"{"model":"gpt-4o-mini"}"#).await.unwrap();
    assert_eq!(r.status(), 201);
    let record: Value = r.json().await.unwrap();
    assert_eq!(record["backend"], "mock", "{record}");
}

/// EX-9, decision 96: an answer that is only tool calls (an agent's turn) reads as its calls in
/// `answer_text`, which `holdfast requests replay` prints side by side and the web page shows,
/// not as a blank: a Messages stream's `tool_use` (its input from `input_json_delta` pieces) and
/// a chat answer's `tool_calls`, each as `[tool call] NAME(ARGUMENTS)`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_of_an_answer_that_is_only_tool_calls_shows_the_calls_ex9() {
    let events = [
        r#"{"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","model":"claude-mock-small","content":[],"stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":9,"output_tokens":1}}}"#,
        r#"{"type":"content_block_start","index":0,"content_block":{"type":"tool_use","id":"toolu_1","name":"get_weather","input":{}}}"#,
        r#"{"type":"content_block_delta","index":0,"delta":{"type":"input_json_delta","partial_json":""}}"#,
        r#"{"type":"content_block_delta","index":0,"delta":{"type":"input_json_delta","partial_json":"{\"city\": "}}"#,
        r#"{"type":"content_block_delta","index":0,"delta":{"type":"input_json_delta","partial_json":"\"Paris\"}"}}"#,
        r#"{"type":"content_block_stop","index":0}"#,
        r#"{"type":"message_delta","delta":{"stop_reason":"tool_use","stop_sequence":null},"usage":{"output_tokens":12}}"#,
        r#"{"type":"message_stop"}"#,
    ];
    let sse: String = events
        .iter()
        .map(|data| {
            let name = serde_json::from_str::<Value>(data).unwrap()["type"]
                .as_str()
                .unwrap()
                .to_owned();
            format!("event: {name}\ndata: {data}\n\n")
        })
        .collect();
    let anthropic = RawProvider::start(raw_200("text/event-stream", &sse, true)).await;
    let chat_answer = json!({"id": "chatcmpl-1", "object": "chat.completion",
        "model": "gpt-4o-mini", "choices": [{"index": 0, "finish_reason": "tool_calls",
            "message": {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1",
                "type": "function", "function": {"name": "get_weather",
                    "arguments": "{\"city\":\"Oslo\"}"}}]}}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21}});
    let openai =
        RawProvider::start(raw_200("application/json", &chat_answer.to_string(), false)).await;
    let app = spawn_app(MockConfig::default(), |c| {
        for b in &mut c.backends {
            match b.name.as_str() {
                "mock-anthropic" => b.base_url = anthropic.base_url(),
                "mock-openai" => b.base_url = openai.base_url(),
                _ => {}
            }
        }
    })
    .await;
    let tools = json!([{"name": "get_weather",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]);
    let r = app
        .post(
            "/v1/messages",
            json!({"model": "claude-mock-small", "max_tokens": 64, "stream": true,
                "tools": tools,
                "messages": [{"role": "user", "content": "weather in Paris?"}]})
            .to_string(),
            &[],
        )
        .await;
    assert_eq!(r.status(), 200);
    let streamed = header(&r, "holdfast-request-id");
    let _ = r.bytes().await.unwrap();
    let plain = send(
        &app,
        json!({"model": "gpt-4o-mini",
            "messages": [{"role": "user", "content": "weather in Oslo?"}],
            "tools": [{"type": "function", "function": {"name": "get_weather",
                "parameters": {"type": "object"}}}]}),
        None,
    )
    .await;

    let dir = tempfile::tempdir().unwrap();
    let env = [("HOLDFAST_URL", app.base.as_str())];
    for (id, call) in [
        (&streamed, r#"[tool call] get_weather({"city":"Paris"})"#),
        (&plain, r#"[tool call] get_weather({"city":"Oslo"})"#),
    ] {
        let (code, out, err) =
            run_holdfast(dir.path(), &["requests", "replay", id, "--json"], &env);
        assert_eq!(code, 0, "{out}{err}");
        let both: Value = serde_json::from_str(&out).unwrap();
        for side in ["original", "replay"] {
            assert_eq!(both[side]["status"], "succeeded", "{out}");
            assert_eq!(both[side]["answer_text"], call, "{side}: {out}");
        }
        let (code, out, err) = run_holdfast(dir.path(), &["requests", "replay", id], &env);
        assert_eq!(code, 0, "{out}{err}");
        // The columns wrap at spaces: the call's name and arguments are one word.
        let (_, name_and_arguments) = call.split_once(' ').unwrap();
        let name_and_arguments = name_and_arguments.split_once(' ').unwrap().1;
        assert!(out.contains("[tool call]"), "{out}");
        assert_eq!(out.matches(name_and_arguments).count(), 2, "{out}");
    }
    // A stream's own text, `answer.text`, keeps its meaning: the text its events carry.
    let shown: Value = app
        .http
        .get(format!("{}/requests/{streamed}?include=body", app.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(shown["answer"]["text"], "");
    let (code, out, err) =
        run_holdfast(dir.path(), &["requests", "show", &streamed, "--body"], &env);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains(r#"[tool call] get_weather({"city":"Paris"})"#),
        "{out}"
    );
    app.stop().await;
}

/// EX-7a: a replay the database did not record in time may still be recorded and run, and no
/// later send can attach to it: its 503 says not to retry and where to look (it said "retry
/// shortly (a retry of the same call never runs it twice)" with `x-should-retry: true`, and
/// the CLI's retry ran, and paid for, a second replay).
#[tokio::test]
async fn a_replay_refused_by_a_database_that_did_not_answer_says_to_look_before_replaying_again_ex7a()
 {
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    let original = send(
        &app,
        json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "look first"}]}),
        None,
    )
    .await;
    // Another connection holds SQLite's write lock: the replay's recording waits past its
    // deadline, and commits once the lock goes.
    let db = rusqlite::Connection::open(app.dir.path().join("holdfast.db")).expect("open db");
    db.execute_batch("BEGIN IMMEDIATE")
        .expect("take the write lock");
    let r = post_replay(&app, &original).await;
    assert_eq!(r.status(), 503);
    assert_eq!(header(&r, "x-should-retry"), "false");
    assert_eq!(header(&r, "holdfast-error"), "store_unavailable");
    let body: Value = r.json().await.unwrap();
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(&format!("GET /requests?replay_of={original}")),
        "{body}"
    );
    db.execute_batch("COMMIT").expect("release the write lock");
    // What the message sends the caller to: on PostgreSQL a recording past its deadline may
    // still commit and run (the trial's case); SQLite's writer gives the job up. Either way the
    // listing answers, and no more than the one replay ran.
    let replays = replays_of(&app, &original, None).await;
    assert!(replays.len() <= 1, "{replays:?}");
    for replay in &replays {
        let id = replay["id"].as_str().unwrap();
        let record =
            wait_terminal(&app.http, &app.base, id, std::time::Duration::from_secs(15)).await;
        assert_eq!(record["status"], "succeeded", "{record}");
    }
    assert_eq!(app.mock.calls(), 1 + replays.len() as u64);
    app.stop().await;
}
