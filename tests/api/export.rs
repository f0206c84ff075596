//! The log as a dataset (issue 34): `GET /requests/export` (EX-1..EX-5), its cursor, its
//! namespace scope, and `holdfast requests export` with the `openai-chat` format checked by a
//! Python validator of OpenAI's fine-tuning format (EX-6).

use std::collections::HashSet;

use futures::StreamExt;
use holdfast::mock::MockConfig;
use serde_json::{Value, json};

use crate::helpers::*;

/// The lines of an NDJSON body.
fn lines(body: &str) -> Vec<Value> {
    body.lines()
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("line {l:?}: {e}")))
        .collect()
}

async fn export(app: &TestApp, query: &str, key: Option<&str>) -> (u16, String) {
    let mut req = app
        .http
        .get(format!("{}/requests/export?{query}", app.base));
    if let Some(key) = key {
        req = req.bearer_auth(key);
    }
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    if status == 200 {
        assert_eq!(header(&r, "content-type"), "application/x-ndjson");
    }
    (status, r.text().await.unwrap())
}

/// Sends `body` to `path` (with `key`), reads the whole answer; the request id.
async fn send(app: &TestApp, path: &str, body: Value, key: Option<&str>) -> String {
    let auth = key.map(|key| format!("Bearer {key}"));
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", a.as_str())).collect();
    let r = app.post(path, body.to_string(), &headers).await;
    assert!(r.status().is_success(), "{}", r.status());
    let id = header(&r, "holdfast-request-id");
    let _ = r.bytes().await.unwrap();
    id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_is_oldest_first_with_each_answer_and_a_cut_export_resumes_exactly_once_ex1_ex2_ex4()
{
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    // More than one page (200) of requests, some streamed.
    let mut ids = Vec::new();
    for batch in 0..9 {
        let sends = (0..50).map(|i| {
            let n = batch * 50 + i;
            let stream = n % 7 == 0;
            let body = json!({"model": "gpt-4o-mini", "stream": stream,
                "messages": [{"role": "user", "content": format!("export {n}")}]});
            let app = &app;
            async move { send(app, "/v1/chat/completions", body, None).await }
        });
        ids.extend(futures::future::join_all(sends).await);
    }
    let mut sorted = ids.clone();
    sorted.sort();

    let (status, body) = export(&app, "", None).await;
    assert_eq!(status, 200, "{body}");
    let all = lines(&body);
    let cursors: Vec<String> = all
        .iter()
        .map(|l| l["cursor"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        cursors, sorted,
        "every request once, oldest first (EX-1, EX-4)"
    );
    for line in &all {
        assert_eq!(line["cursor"], line["record"]["id"]);
        assert_eq!(line["record"]["status"], "succeeded");
        let asked = line["request"]["body"]["messages"][0]["content"]
            .as_str()
            .unwrap();
        let answer = &line["answer"];
        // A streamed answer is reassembled into the non-stream shape (EX-3); the mock's stream
        // pieces concatenate to the non-stream text of the same body.
        assert_eq!(answer["object"], "chat.completion", "{line}");
        let text = answer["choices"][0]["message"]["content"].as_str().unwrap();
        assert!(
            text.starts_with("mock reply to gpt-4o-mini:"),
            "{asked}: {text}"
        );
        if line["record"]["stream"] == false {
            assert!(line["record"]["usage"]["output_tokens"].as_u64().unwrap() > 0);
        }
    }
    // Cut the connection after some lines, resume after the last whole line's cursor.
    let mut got: Vec<String> = Vec::new();
    let r = app
        .http
        .get(format!("{}/requests/export", app.base))
        .send()
        .await
        .unwrap();
    let mut stream = r.bytes_stream();
    let mut buffer = Vec::new();
    while got.len() < 150 {
        let bytes = stream.next().await.expect("more bytes").unwrap();
        buffer.extend_from_slice(&bytes);
        while let Some(end) = buffer.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = buffer.drain(..=end).collect();
            let v: Value = serde_json::from_slice(&line).unwrap();
            got.push(v["cursor"].as_str().unwrap().to_string());
        }
    }
    drop(stream); // the connection is cut mid-export
    let last = got.last().unwrap().clone();
    let (_, rest) = export(&app, &format!("after={last}"), None).await;
    got.extend(
        lines(&rest)
            .iter()
            .map(|l| l["cursor"].as_str().unwrap().to_string()),
    );
    assert!(
        got == sorted,
        "the cut export and its resumption: every request exactly once ({} lines, {} requests)",
        got.len(),
        sorted.len()
    );

    // RD-7's search, before the call below adds a request with one of these bodies.
    let (_, streams) = export(&app, "q=export%2014%22", None).await;
    assert_eq!(lines(&streams).len(), 1);

    // A streamed request's reassembled answer equals what the same body answers without a
    // stream (its body is any of the first batch's streamed ones: they were sent at once).
    let streamed = all.iter().find(|l| l["record"]["stream"] == true).unwrap();
    let mut plain_body = streamed["request"]["body"].clone();
    plain_body["stream"] = json!(false);
    let r = app.chat(&plain_body.to_string()).await;
    let plain: Value = r.json().await.unwrap();
    assert_eq!(
        streamed["answer"]["choices"][0]["message"]["content"],
        plain["choices"][0]["message"]["content"]
    );
    assert_eq!(streamed["answer"]["choices"][0]["finish_reason"], "stop");

    // `limit` bounds the lines; filters are RD-7's; a bad parameter is 400 naming it.
    let (_, some) = export(&app, "limit=3&status=succeeded", None).await;
    assert_eq!(lines(&some).len(), 3);
    for (query, name) in [
        ("cursor=x", "cursor"),
        ("after=nope", "after"),
        ("format=csv", "format"),
        ("status=done", "status"),
        ("colour=red", "colour"),
    ] {
        let (status, body) = export(&app, query, None).await;
        assert_eq!(status, 400, "{query}: {body}");
        assert!(body.contains(name), "{query}: {body}");
    }
    app.stop().await;
}

/// EX-1: an unknown parameter's 400 lists the export's own parameters — its `after`, `limit`
/// and `format` included, not the list's `cursor`, which it refuses — and every one it lists
/// is one the export takes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_export_parameter_lists_the_exports_own_parameters_ex1() {
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    let (status, body) = export(&app, "bogus=1", None).await;
    assert_eq!(status, 400, "{body}");
    let body: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(body["error"]["code"], "invalid_parameter", "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    let known: Vec<&str> = message
        .strip_prefix("bogus: unknown parameter; known: ")
        .unwrap_or_else(|| panic!("{message}"))
        .split(", ")
        .collect();
    for own in ["after", "limit", "format", "namespace", "status", "q"] {
        assert!(known.contains(&own), "{own} missing: {message}");
    }
    assert!(!known.contains(&"cursor"), "{message}");
    for name in known {
        let (_, body) = export(&app, &format!("{name}=x"), None).await;
        assert!(
            !body.contains("unknown parameter"),
            "{name} is listed but refused as unknown: {body}"
        );
    }
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_key_exports_only_its_namespace_and_an_admin_key_every_one_ex1() {
    let app = spawn_app(MockConfig::default(), |c| {
        c.namespaces = two_namespaces("team-a", "team-b");
        c.admin_api_keys = vec!["admin".into()];
    })
    .await;
    let mut a = HashSet::new();
    let mut b = HashSet::new();
    for i in 0..3 {
        a.insert(
            send(
                &app,
                "/v1/chat/completions",
                json!({"model": "gpt-4o-mini",
            "messages": [{"role": "user", "content": format!("same {i}")}]}),
                Some("key-a"),
            )
            .await,
        );
        b.insert(
            send(
                &app,
                "/v1/chat/completions",
                json!({"model": "gpt-4o-mini",
            "messages": [{"role": "user", "content": format!("same {i}")}]}),
                Some("key-b"),
            )
            .await,
        );
    }
    let ids = |body: &str| -> HashSet<String> {
        lines(body)
            .iter()
            .map(|l| l["cursor"].as_str().unwrap().to_string())
            .collect()
    };
    let (_, of_a) = export(&app, "", Some("key-a")).await;
    assert_eq!(ids(&of_a), a);
    let (_, of_b) = export(&app, "format=openai-chat", Some("key-b")).await;
    assert_eq!(ids(&of_b), b);
    // A cursor of another namespace's request shows nothing of it either.
    let b_first = b.iter().min().unwrap();
    let (_, after_b) = export(&app, &format!("after={b_first}"), Some("key-a")).await;
    assert!(ids(&after_b).is_subset(&a));
    let (_, all) = export(&app, "", Some("admin")).await;
    assert_eq!(ids(&all), a.union(&b).cloned().collect());
    let (_, only_b) = export(&app, "namespace=team-b", Some("admin")).await;
    assert_eq!(ids(&only_b), b);
    let (status, body) = export(&app, "namespace=team-b", Some("key-a")).await;
    assert_eq!(status, 400, "{body}");
    let (status, _) = export(&app, "", None).await;
    assert_eq!(status, 401);
    let (status, _) = export(&app, "", Some("wrong")).await;
    assert_eq!(status, 401);
    app.stop().await;
}

/// EX-5, decision 63: a fine-tuning example says what the model saw, so the text blocks of one
/// message of the request (Anthropic's `system` and content blocks, OpenAI's content parts,
/// Gemini's parts and `systemInstruction`, a tool result's parts) become one string with a
/// newline between two, never run together. The answer's text parts are joined with nothing,
/// as a streamed answer's are (EX-3): a non-stream answer in several parts (Anthropic's and
/// Gemini's here, from providers that answer so) gains no newline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_chat_export_joins_a_requests_text_blocks_with_a_newline_and_an_answers_with_nothing_ex5()
 {
    let answer_in_parts = |body: Value| async move {
        RawProvider::start(raw_200("application/json", &body.to_string(), false)).await
    };
    let anthropic_provider = answer_in_parts(json!({"id": "msg_1", "type": "message",
        "role": "assistant", "model": "claude-mock-small",
        "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world."}],
        "stop_reason": "end_turn", "usage": {"input_tokens": 3, "output_tokens": 2}}))
    .await;
    let gemini_provider = answer_in_parts(json!({"candidates": [{"content": {"role": "model",
        "parts": [{"text": "Hello, "}, {"text": "wor"}, {"text": "ld."}]}, "finishReason": "STOP"}],
        "usageMetadata": {"promptTokenCount": 3, "candidatesTokenCount": 3, "totalTokenCount": 6}}))
    .await;
    let app = spawn_app(MockConfig::default(), |c| {
        for b in &mut c.backends {
            match b.name.as_str() {
                "mock-anthropic" => b.base_url = anthropic_provider.base_url(),
                "mock-gemini" => b.base_url = format!("http://{}", gemini_provider.addr),
                _ => {}
            }
        }
    })
    .await;
    let anthropic = send(
        &app,
        "/v1/messages",
        json!({"model": "claude-mock-small", "max_tokens": 64,
            "system": [{"type": "text", "text": "You are terse."},
                       {"type": "text", "text": "Second system block."}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Look it up."},
                    {"type": "text", "text": "Then answer."}]},
                {"role": "assistant", "content": [{"type": "text", "text": "Looking."},
                    {"type": "tool_use", "id": "tu_1", "name": "lookup", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu_1",
                    "content": [{"type": "text", "text": "row 1"}, {"type": "text", "text": "row 2"}]}]}],
            "tools": [{"name": "lookup", "input_schema": {"type": "object"}}]}),
        None,
    )
    .await;
    let openai = send(
        &app,
        "/v1/chat/completions",
        json!({"model": "gpt-4o-mini", "messages": [
            {"role": "system", "content": [{"type": "text", "text": "You are terse."},
                {"type": "text", "text": "Second system block."}]},
            {"role": "user", "content": [{"type": "text", "text": "first part"},
                {"type": "text", "text": ""}, {"type": "text", "text": "second part"}]}]}),
        None,
    )
    .await;
    let gemini = send(
        &app,
        "/v1beta/models/gemini-mock:generateContent",
        json!({"systemInstruction": {"parts": [{"text": "You are terse."},
                {"text": "Second system block."}]},
            "contents": [{"role": "user", "parts": [{"text": "one"}, {"text": "two"}]}]}),
        None,
    )
    .await;

    let (status, body) = export(&app, "format=openai-chat", None).await;
    assert_eq!(status, 200, "{body}");
    let examples: std::collections::HashMap<String, Value> = lines(&body)
        .into_iter()
        .map(|l| (l["id"].as_str().unwrap().to_string(), l["example"].clone()))
        .collect();
    let messages = |id: &str| examples[id]["messages"].clone();
    let system = json!({"role": "system", "content": "You are terse.\nSecond system block."});

    let a = messages(&anthropic);
    assert_eq!(a[0], system, "{a}");
    assert_eq!(a[1]["content"], "Look it up.\nThen answer.", "{a}");
    assert_eq!(a[2]["content"], "Looking.", "{a}");
    assert_eq!(
        a[3],
        json!({"role": "tool", "tool_call_id": "tu_1", "content": "row 1\nrow 2"}),
        "{a}"
    );

    let o = messages(&openai);
    assert_eq!(o[0], system, "{o}");
    assert_eq!(
        o[1]["content"], "first part\nsecond part",
        "an empty part adds no line: {o}"
    );

    let g = messages(&gemini);
    assert_eq!(g[0], system, "{g}");
    assert_eq!(g[1], json!({"role": "user", "content": "one\ntwo"}), "{g}");

    // The answers, in parts, run together as streamed.
    let hello = json!({"role": "assistant", "content": "Hello, world."});
    assert_eq!(a.as_array().unwrap().last(), Some(&hello), "{a}");
    assert_eq!(g.as_array().unwrap().last(), Some(&hello), "{g}");
    assert_eq!(
        (anthropic_provider.calls(), gemini_provider.calls()),
        (1, 1)
    );
    app.stop().await;
}

/// The concatenated text of an Anthropic stream's `text_delta` events.
fn anthropic_stream_text(events: &[holdfast::sse::SseEvent]) -> String {
    events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(&e.data).ok())
        .filter(|d| d["type"] == "content_block_delta" && d["delta"]["type"] == "text_delta")
        .map(|d| d["delta"]["text"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_chat_export_passes_a_python_fine_tuning_format_check_with_whole_streamed_answers_python_ex5_ex6()
 {
    require_python(&["json"]);
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    // By id: UUID v7 strings sort as the export orders its lines.
    let mut expected = std::collections::BTreeMap::new();
    // A streamed OpenAI chat call with an earlier tool call in its conversation.
    let chat = json!({"model": "gpt-4o-mini", "stream": true, "messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "weather", "arguments": "{\"city\":\"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4 C"},
        {"role": "user", "content": [{"type": "text", "text": "and tomorrow?"}]}],
        "tools": [{"type": "function", "function": {"name": "weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]});
    let r = app.chat(&chat.to_string()).await;
    let id = header(&r, "holdfast-request-id");
    let (_, events) = read_events(r).await;
    expected.insert(id, json!(openai_text(&events)));
    // A streamed Anthropic call with a system prompt and a tool round in its history.
    let messages = json!({"model": "claude-mock-small", "max_tokens": 64, "stream": true,
        "system": "answer in one line",
        "messages": [
            {"role": "user", "content": "look it up"},
            {"role": "assistant", "content": [{"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "tu_1", "name": "lookup", "input": {"q": "x"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu_1",
                "content": "found"}]}],
        "tools": [{"name": "lookup", "description": "find", "input_schema": {"type": "object"}}]});
    let r = app.post("/v1/messages", messages.to_string(), &[]).await;
    let id = header(&r, "holdfast-request-id");
    let (_, events) = read_events(r).await;
    expected.insert(id, json!(anthropic_stream_text(&events)));
    // A streamed Responses call, stateless (the Agents SDK's way), with a tool round in its
    // input (decision 87).
    let responses = json!({"model": "gpt-4o-mini", "stream": true, "instructions": "be brief",
        "input": [
            {"role": "user", "content": "weather in Oslo?"},
            {"type": "function_call", "call_id": "call_1", "name": "weather",
                "arguments": "{\"city\":\"Oslo\"}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "4 C"}],
        "tools": [{"type": "function", "name": "weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]});
    let r = app.post("/v1/responses", responses.to_string(), &[]).await;
    let id = header(&r, "holdfast-request-id");
    let (_, events) = read_events(r).await;
    let text: String = events
        .iter()
        .filter(|e| e.event.as_deref() == Some("response.output_text.delta"))
        .filter_map(|e| serde_json::from_str::<Value>(&e.data).ok())
        .filter_map(|v| v["delta"].as_str().map(str::to_owned))
        .collect();
    assert!(!text.is_empty(), "{events:?}");
    expected.insert(id, json!(text));
    // A non-stream Gemini call.
    let r = app
        .post(
            "/v1beta/models/gemini-mock:generateContent",
            json!({"contents": [{"role": "user", "parts": [{"text": "hi gemini"}]}]}).to_string(),
            &[],
        )
        .await;
    let id = header(&r, "holdfast-request-id");
    let answer: Value = r.json().await.unwrap();
    expected.insert(
        id,
        answer["candidates"][0]["content"]["parts"][0]["text"].clone(),
    );
    // Skipped: an image in the prompt, and a completions call.
    send(
        &app,
        "/v1/chat/completions",
        json!({"model": "gpt-4o-mini", "messages": [{"role": "user",
        "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}),
        None,
    )
    .await;
    send(
        &app,
        "/v1/completions",
        json!({"model": "gpt-4o-mini", "prompt": "x"}),
        None,
    )
    .await;

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("train.jsonl");
    let (code, out, err) = run_holdfast(
        dir.path(),
        &[
            "requests",
            "export",
            "--format",
            "openai-chat",
            "-o",
            file.to_str().unwrap(),
        ],
        &[("HOLDFAST_URL", &app.base)],
    );
    assert_eq!(code, 0, "{out}{err}");
    assert!(err.contains("exported 4 examples"), "{err}");
    assert!(err.contains("skipped 2 requests"), "{err}");
    assert!(
        err.contains("image_url") && err.contains("openai.completions"),
        "{err}"
    );
    assert!(
        !err.contains('\r') && !err.contains("rows"),
        "no progress bar when piped: {err}"
    );

    // The lines are in request order, like the expected answers' ids (UUID v7, sorted).
    let texts: Vec<Value> = expected.values().cloned().collect();
    let expected_file = dir.path().join("expected.json");
    std::fs::write(&expected_file, serde_json::to_string(&texts).unwrap()).unwrap();
    let report = run_python_args(
        "finetune_format.py",
        &[file.to_str().unwrap(), expected_file.to_str().unwrap()],
        &[],
    );
    assert!(report.contains("4 examples ok"), "{report}");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_export_writes_records_to_stdout_counts_them_in_words_and_refuses_a_wrong_key_cli_ex6()
 {
    let app = spawn_app(MockConfig::default(), |c| {
        c.namespaces = two_namespaces("team-a", "team-b");
    })
    .await;
    let mine = send(
        &app,
        "/v1/chat/completions",
        json!({"model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "cli export"}]}),
        Some("key-a"),
    )
    .await;
    send(
        &app,
        "/v1/chat/completions",
        json!({"model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "cli export"}]}),
        Some("key-b"),
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let env = [
        ("HOLDFAST_URL", app.base.as_str()),
        ("HOLDFAST_API_KEY", "key-a"),
    ];
    let (code, out, err) = run_holdfast(dir.path(), &["requests", "export"], &env);
    assert_eq!(code, 0, "{err}");
    let got = lines(&out);
    assert_eq!(got.len(), 1, "{out}");
    assert_eq!(got[0]["cursor"], mine.as_str());
    // EX-6: the report counts in words, singular for one.
    assert!(err.contains("exported 1 record\n"), "{err}");
    let (code, _, err) = run_holdfast(
        dir.path(),
        &["requests", "export", "--format", "openai-chat"],
        &env,
    );
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("exported 1 example\n"), "{err}");
    assert!(err.contains("skipped 0 requests\n"), "{err}");
    // The examples hold no cursor: the report says where to continue (decision 169).
    assert!(
        err.contains(&format!("to continue after it: --after {mine}\n")),
        "{err}"
    );
    let (code, out, err) =
        run_holdfast(dir.path(), &["requests", "export", "--after", &mine], &env);
    assert_eq!((code, out.as_str()), (0, ""));
    assert!(err.contains("exported 0 records\n"), "{err}");
    let bad = [
        ("HOLDFAST_URL", app.base.as_str()),
        ("HOLDFAST_API_KEY", "nope"),
    ];
    let (code, _, err) = run_holdfast(dir.path(), &["requests", "export"], &bad);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("401"), "{err}");
    app.stop().await;
}

/// EX-6: `--limit N` writes the N oldest (with `--after`, the next N), and the report counts
/// only those; `--limit 0` is a usage error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_export_limit_writes_at_most_that_many_oldest_first_cli_ex6() {
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    let mut ids = Vec::new();
    for i in 0..3 {
        ids.push(
            send(
                &app,
                "/v1/chat/completions",
                json!({"model": "gpt-4o-mini",
                "messages": [{"role": "user", "content": format!("limit {i}")}]}),
                None,
            )
            .await,
        );
    }
    let base = app.base.clone();
    let after = ids[1].clone();
    let (first, second, zero) = tokio::task::spawn_blocking(move || {
        let dir = tempfile::tempdir().unwrap();
        let env = [("HOLDFAST_URL", base.as_str())];
        let run = |args: &[&str]| run_holdfast(dir.path(), args, &env);
        (
            run(&["requests", "export", "--limit", "2"]),
            run(&["requests", "export", "--limit", "5", "--after", &after]),
            run(&["requests", "export", "--limit", "0"]),
        )
    })
    .await
    .unwrap();
    let (code, out, err) = first;
    assert_eq!(code, 0, "{err}");
    let cursors: Vec<Value> = lines(&out).iter().map(|l| l["cursor"].clone()).collect();
    assert_eq!(cursors, vec![json!(ids[0]), json!(ids[1])], "{out}");
    assert!(err.contains("exported 2 records\n"), "{err}");
    let (code, out, err) = second;
    assert_eq!(code, 0, "{err}");
    let cursors: Vec<Value> = lines(&out).iter().map(|l| l["cursor"].clone()).collect();
    assert_eq!(cursors, vec![json!(ids[2])], "{out}");
    let (code, _, err) = zero;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--limit"), "{err}");
    app.stop().await;
}

#[tokio::test]
async fn usage_answers_hour_and_day_buckets_with_their_groups_and_refuses_another_bucket_ex10() {
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    for (i, model) in ["gpt-4o-mini", "gpt-4o-mini", "mock-large"]
        .iter()
        .enumerate()
    {
        send(
            &app,
            "/v1/chat/completions",
            json!({"model": model,
            "messages": [{"role": "user", "content": format!("bucket {i}")}]}),
            None,
        )
        .await;
    }
    for bucket in ["hour", "day"] {
        let usage = get_json(&app.http, &format!("{}/usage?bucket={bucket}", app.base)).await;
        assert_eq!(usage["bucket"], bucket);
        let buckets = usage["buckets"].as_array().unwrap();
        // All three were sent just now: one bucket (or two across an hour's turn).
        assert!(!buckets.is_empty() && buckets.len() <= 2, "{usage}");
        let sum = |model: &str| -> u64 {
            buckets
                .iter()
                .flat_map(|b| b["groups"].as_array().unwrap())
                .filter(|g| g["key"] == model)
                .map(|g| g["requests"].as_u64().unwrap())
                .sum()
        };
        assert_eq!((sum("gpt-4o-mini"), sum("mock-large")), (2, 1), "{usage}");
        let start = chrono::DateTime::parse_from_rfc3339(buckets[0]["start"].as_str().unwrap())
            .unwrap()
            .timestamp();
        let width = if bucket == "hour" { 3600 } else { 86_400 };
        assert_eq!(start % width, 0, "a UTC {bucket}'s start: {usage}");
        assert_eq!(usage["totals"]["requests"], 3);
    }
    let plain = get_json(&app.http, &format!("{}/usage", app.base)).await;
    assert!(plain.get("buckets").is_none(), "{plain}");
    let r = app
        .http
        .get(format!("{}/usage?bucket=week", app.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert!(r.text().await.unwrap().contains("bucket"));
    app.stop().await;
}

/// IN-2, EX-2, RD-1: a number beyond a double's range (`1e400`) is valid JSON, so the request
/// that sends one is recorded, and a provider may answer one. The record still reads back as
/// itself, with `?include=body`, and in the export (its body then a JSON string of the exact
/// bytes): before, the export and `include=body` panicked on it (every resume of the export
/// stopping at the same line) and `GET /requests/{id}` answered `null`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_number_beyond_a_doubles_range_neither_breaks_the_export_nor_hides_the_record_in2_ex2_rd1()
 {
    let answer = r#"{"id":"chatcmpl-big","object":"chat.completion","model":"gpt-4o-mini","choices":[{"index":0,"message":{"role":"assistant","content":"big"},"finish_reason":"stop","logprob":-1e400}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#;
    let provider = RawProvider::start(raw_200("application/json", answer, false)).await;
    let app = spawn_app(MockConfig::default(), |c| {
        use_backend_url(c, &provider.base_url())
    })
    .await;
    let body = r#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"big numbers"}],"seed_hint":1e400}"#;
    let r = app.chat(body).await;
    assert_eq!(r.status(), 200);
    let id = header(&r, "holdfast-request-id");
    assert_eq!(
        r.text().await.unwrap(),
        answer,
        "the answer goes back as it came"
    );

    let record = app.record(&id).await;
    assert_eq!(record["id"], id.as_str(), "GET /requests/{{id}}: {record}");
    assert_eq!(record["status"], "succeeded");
    let shown = record["response"]["body"].as_str().unwrap_or_default();
    assert!(shown.contains("-1e400"), "{record}");

    let r = app
        .http
        .get(format!("{}/requests/{id}?include=body", app.base))
        .send()
        .await
        .expect("include=body answers");
    assert_eq!(r.status(), 200);
    let full: Value = r.json().await.unwrap();
    assert_eq!(full["id"], id.as_str());
    assert_eq!(
        full["request"]["body"], body,
        "the body as sent, as a string"
    );
    assert_eq!(full["answer"], answer);

    // One more request after it: the export goes past the line.
    app.chat(&chat_body("after the big one"))
        .await
        .bytes()
        .await
        .unwrap();
    let (status, text) = export(&app, "", None).await;
    assert_eq!(status, 200);
    let lines = lines(&text);
    assert_eq!(lines.len(), 2, "{text}");
    assert_eq!(lines[0]["cursor"], id.as_str());
    assert_eq!(lines[0]["record"]["id"], id.as_str());
    assert_eq!(lines[0]["request"]["body"], body);
    assert_eq!(lines[0]["answer"], answer);
}

/// EX-4, decision 80: an export's memory is bounded by its page, and a page of wide requests
/// (long prompts; a body may be `max_body_bytes`, 32 MiB) holds fewer of them. Before, every
/// page read 200 requests whatever their size, each held at once as its record, its body and
/// its line: exporting a log of 1 MiB prompts grew the process by about three times 200 MiB,
/// and one of 32 MiB bodies by gigabytes. The export still yields every request once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_export_of_wide_requests_reads_them_in_pages_its_memory_holds_ex4() {
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    const WIDE: usize = 1 << 20;
    const N: usize = 100;
    let mut ids = Vec::new();
    for i in 0..N {
        let prompt = format!("wide {i} {}", "w".repeat(WIDE));
        let r = app.chat(&chat_body(&prompt)).await;
        assert_eq!(r.status(), 200);
        ids.push(header(&r, "holdfast-request-id"));
        r.bytes().await.unwrap();
    }
    let pid = std::process::id();
    let before = rss_kib(pid);
    let peak = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(before));
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (peak, done) = (peak.clone(), done.clone());
        std::thread::spawn(move || {
            while !done.load(std::sync::atomic::Ordering::SeqCst) {
                peak.fetch_max(rss_kib(pid), std::sync::atomic::Ordering::SeqCst);
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        })
    };
    // Read line by line, as a client writing a file does, so the test holds one line at a time.
    let r = app
        .http
        .get(format!("{}/requests/export", app.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut body = r.bytes_stream();
    let (mut pending, mut cursors) = (Vec::new(), Vec::new());
    while let Some(piece) = body.next().await {
        pending.extend_from_slice(&piece.unwrap());
        while let Some(end) = pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            let value: Value = serde_json::from_slice(&line).unwrap();
            cursors.push(value["cursor"].as_str().unwrap().to_string());
        }
    }
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    sampler.join().unwrap();
    assert_eq!(cursors, ids, "every request once, oldest first");
    let grew_mib = peak
        .load(std::sync::atomic::Ordering::SeqCst)
        .saturating_sub(before)
        / 1024;
    assert!(
        grew_mib < 96,
        "the export grew the process by {grew_mib} MiB for {N} requests of 1 MiB"
    );
}
