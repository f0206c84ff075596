//! `GET /requests` filters and `GET /requests/{id}?include=body` (issue 16, RD-7, RD-1): every
//! filter narrows the list to what it names, bad input is a 400 naming the parameter, bodies
//! are read by their own namespace and admin keys only.

use holdfast::mock::MockConfig;
use serde_json::Value;

use crate::helpers::*;

/// Two namespaces with one key each, and an admin key.
fn tenants(config: &mut holdfast::config::Config) {
    config.namespaces = two_namespaces("a", "b");
    config.admin_api_keys = vec!["admin-key".into()];
}

async fn send(app: &TestApp, key: &str, path: &str, body: String) -> (u16, String) {
    let auth = format!("Bearer {key}");
    let r = app
        .post(path, body, &[("authorization", auth.as_str())])
        .await;
    let status = r.status().as_u16();
    let id = header(&r, "holdfast-request-id");
    let _ = r.bytes().await;
    (status, id)
}

async fn get(app: &TestApp, key: &str, query: &str) -> (u16, Value) {
    let r = app
        .http
        .get(format!("{}{query}", app.base))
        .header("authorization", format!("Bearer {key}"))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// The ids of a `GET /requests{query}` page, newest first.
async fn ids(app: &TestApp, key: &str, query: &str) -> Vec<String> {
    let (status, page) = get(app, key, &format!("/requests{query}")).await;
    assert_eq!(status, 200, "{query}: {page}");
    page["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["id"].as_str().unwrap().to_owned())
        .collect()
}

fn messages_body(text: &str) -> String {
    serde_json::json!({
        "model": "claude-3-5-haiku-latest",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": text}],
    })
    .to_string()
}

#[tokio::test]
async fn every_list_filter_narrows_to_what_it_names_rd7() {
    // The first call of the mock is refused with a 400: the first request fails.
    let app = spawn_app(
        MockConfig {
            fail_first: 1,
            fail_status: 400,
            ..MockConfig::default()
        },
        tenants,
    )
    .await;
    let (status, failed) = send(&app, "key-a", "/v1/chat/completions", chat_body("refused")).await;
    assert_eq!(status, 400);
    let (_, chat) = send(
        &app,
        "key-a",
        "/v1/chat/completions",
        chat_body("the quick fox"),
    )
    .await;
    // Sent twice: the second submission is a replay.
    let (_, twice) = send(
        &app,
        "key-a",
        "/v1/chat/completions",
        chat_body("said twice"),
    )
    .await;
    let (_, again) = send(
        &app,
        "key-a",
        "/v1/chat/completions",
        chat_body("said twice"),
    )
    .await;
    assert_eq!(twice, again);
    wait_deliveries(&app.base, &twice, Some("key-a"), 2).await;
    let (status, messages) = send(&app, "key-a", "/v1/messages", messages_body("a message")).await;
    assert_eq!(status, 200);
    let (_, other) = send(
        &app,
        "key-b",
        "/v1/chat/completions",
        chat_body("namespace b"),
    )
    .await;

    // No filter: the key's own namespace, newest first.
    assert_eq!(
        ids(&app, "key-a", "").await,
        [
            messages.as_str(),
            twice.as_str(),
            chat.as_str(),
            failed.as_str()
        ]
    );
    assert_eq!(ids(&app, "key-b", "").await, [other.as_str()]);
    assert_eq!(
        ids(&app, "key-a", "?status=failed").await,
        [failed.as_str()]
    );
    assert_eq!(
        ids(&app, "key-a", "?status=succeeded").await,
        [messages.as_str(), twice.as_str(), chat.as_str()]
    );
    assert!(ids(&app, "key-a", "?status=running").await.is_empty());
    assert_eq!(
        ids(&app, "key-a", "?route=anthropic.messages").await,
        [messages.as_str()]
    );
    assert_eq!(
        ids(&app, "key-a", "?route=openai.chat").await,
        [twice.as_str(), chat.as_str(), failed.as_str()]
    );
    assert_eq!(
        ids(&app, "key-a", "?model=claude-3-5-haiku-latest").await,
        [messages.as_str()]
    );
    assert!(ids(&app, "key-a", "?model=gpt-4o").await.is_empty());
    assert_eq!(
        ids(&app, "key-a", "?backend=mock-anthropic").await,
        [messages.as_str()]
    );
    assert_eq!(ids(&app, "key-a", "?q=quick%20fox").await, [chat.as_str()]);
    assert!(ids(&app, "key-a", "?q=nowhere").await.is_empty());
    assert_eq!(ids(&app, "key-a", "?replayed=true").await, [twice.as_str()]);
    assert_eq!(ids(&app, "key-a", "?replayed=false").await.len(), 4);
    // Filters combine.
    assert_eq!(
        ids(
            &app,
            "key-a",
            "?route=openai.chat&status=succeeded&replayed=true"
        )
        .await,
        [twice.as_str()]
    );

    // since/until: submission time in [since, until), RFC 3339. Requests a millisecond apart
    // share a time, so the expected pages come from the records' own times.
    let (_, all) = get(&app, "key-a", "/requests").await;
    let times: Vec<(String, String)> = all["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let at = r["created_at"].as_str().unwrap();
            (r["id"].as_str().unwrap().to_owned(), at.to_owned())
        })
        .collect();
    let created = times.iter().find(|(id, _)| *id == twice).unwrap().1.clone();
    let at_or_after: Vec<&str> = times
        .iter()
        .filter(|(_, at)| *at >= created)
        .map(|(id, _)| id.as_str())
        .collect();
    let before: Vec<&str> = times
        .iter()
        .filter(|(_, at)| *at < created)
        .map(|(id, _)| id.as_str())
        .collect();
    assert!(at_or_after.contains(&twice.as_str()) && !before.contains(&twice.as_str()));
    assert!(at_or_after.contains(&messages.as_str()) && before.len() <= 2);
    let encoded = created.replace('+', "%2B");
    assert_eq!(
        ids(&app, "key-a", &format!("?since={encoded}")).await,
        at_or_after
    );
    assert_eq!(
        ids(&app, "key-a", &format!("?until={encoded}")).await,
        before
    );
    assert!(
        ids(&app, "key-a", "?since=2999-01-01T00:00:00Z")
            .await
            .is_empty()
    );
    // A date is its start in UTC.
    assert!(ids(&app, "key-a", "?since=2999-01-01").await.is_empty());
    assert_eq!(
        ids(&app, "key-a", "?since=2000-01-01").await.len(),
        at_or_after.len() + before.len()
    );
    assert!(ids(&app, "key-a", "?until=2000-01-01").await.is_empty());

    // Cursor paging: limit per page, next_cursor until the last page.
    let mut pages = Vec::new();
    let mut query = "?limit=3".to_owned();
    loop {
        let (status, page) = get(&app, "key-a", &format!("/requests{query}")).await;
        assert_eq!(status, 200, "{page}");
        let ids: Vec<String> = page["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["id"].as_str().unwrap().to_owned())
            .collect();
        pages.push(ids);
        match page["next_cursor"].as_str() {
            Some(cursor) => query = format!("?limit=3&cursor={cursor}"),
            None => break,
        }
        assert!(pages.len() < 5, "paging does not end: {pages:?}");
    }
    assert_eq!(
        pages.concat(),
        [
            messages.as_str(),
            twice.as_str(),
            chat.as_str(),
            failed.as_str()
        ],
        "{pages:?}"
    );
    assert_eq!(pages[0].len(), 3);

    // namespace=: an admin key reads any namespace, or all of them; a namespace key may not.
    assert_eq!(
        ids(&app, "admin-key", "?namespace=b").await,
        [other.as_str()]
    );
    assert_eq!(ids(&app, "admin-key", "").await.len(), 5);
    let (status, body) = get(&app, "key-a", "/requests?namespace=b").await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("namespace:")
    );
    app.stop().await;
}

#[tokio::test]
async fn an_unknown_list_parameter_or_a_bad_value_is_a_400_naming_it_rd7() {
    let app = spawn_app(MockConfig::default(), |_| {}).await;
    for (query, name) in [
        ("colour=red", "colour"),
        ("status=bogus", "status"),
        ("route=openai.chatt", "route"),
        ("since=yesterday", "since"),
        ("until=2026-13-01", "until"),
        ("since=2026-12-03&until=2026-12-01", "until"),
        ("replayed=maybe", "replayed"),
        ("cursor=page-2", "cursor"),
        ("limit=ten", "limit"),
        ("include=body", "include"),
    ] {
        let r = app
            .http
            .get(format!("{}/requests?{query}", app.base))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{query}");
        let body: Value = r.json().await.unwrap();
        assert_eq!(
            body["error"]["code"], "invalid_parameter",
            "{query}: {body}"
        );
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.starts_with(&format!("{name}: ")),
            "{query}: {message}"
        );
        if name == "colour" {
            // The known ones are the ones the list takes.
            assert!(
                message.contains("status") && !message.contains("include"),
                "{message}"
            );
        }
    }
    app.stop().await;
}

#[tokio::test]
async fn include_body_shows_the_request_as_sent_and_the_answer_to_its_own_namespace_and_admins_rd1()
{
    let app = spawn_app(MockConfig::default(), tenants).await;
    let (status, plain) = send(
        &app,
        "key-a",
        "/v1/chat/completions",
        chat_body("secret plan"),
    )
    .await;
    assert_eq!(status, 200);
    let (status, streamed) = send(
        &app,
        "key-a",
        "/v1/chat/completions",
        stream_body("streamed plan"),
    )
    .await;
    // The stream's body has ended: its `end` was stored with the outcome.
    assert_eq!(status, 200);

    // Without include=body the record holds no body.
    let (_, record) = get(&app, "key-a", &format!("/requests/{plain}")).await;
    assert!(record.get("request").is_none() && record.get("answer").is_none());

    for key in ["key-a", "admin-key"] {
        let (status, record) = get(&app, key, &format!("/requests/{plain}?include=body")).await;
        assert_eq!(status, 200, "{key}: {record}");
        assert_eq!(
            record["request"]["body"]["messages"][0]["content"], "secret plan",
            "{record}"
        );
        let answer = &record["answer"];
        assert_eq!(answer["object"], "chat.completion", "{answer}");
        assert!(answer["choices"][0]["message"]["content"].is_string());
        // The client's key is not part of what was sent upstream.
        assert!(!record["request"].to_string().contains("key-a"), "{record}");
    }
    // Another namespace's key: the request does not exist for it.
    let (status, _) = get(&app, "key-b", &format!("/requests/{plain}?include=body")).await;
    assert_eq!(status, 404);

    // A stream's answer is the text reassembled from its events.
    let (_, record) = get(&app, "key-a", &format!("/requests/{streamed}?include=body")).await;
    let log = app
        .http
        .get(format!("{}/requests/{streamed}", app.base))
        .header("accept", "text/event-stream")
        .header("authorization", "Bearer key-a")
        .send()
        .await
        .unwrap();
    let (_, events) = read_events(log).await;
    assert!(record["answer"]["events"].as_u64().unwrap() > 0, "{record}");
    assert_eq!(
        record["answer"]["text"].as_str().unwrap(),
        openai_text(&events),
        "{record}"
    );
    assert!(!openai_text(&events).is_empty());

    let (status, body) = get(&app, "key-a", &format!("/requests/{plain}?include=headers")).await;
    assert_eq!(status, 400, "{body}");
    app.stop().await;
}
