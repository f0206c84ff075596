//! The web page at `/ui` (docs/ui.md) in a real headless Chromium, driven over the DevTools
//! protocol ([`super::cdp`]): what it lists and filters, a stream followed live, the usage
//! totals, untrusted text rendered as text, and one namespace's key seeing nothing of another's.
//!
//! Screenshots go to `<target>/debug/ui-screenshots/` (test artifacts); with
//! `UI_SCREENSHOTS_TO_DOCS=1` those that docs/ui.md shows also replace the ones in `docs/ui/`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use holdfast::config::{Namespace, Price};
use holdfast::mock::MockConfig;
use serde_json::{Value, json};

use super::cdp::{Browser, Page};
use crate::helpers::*;

const WAIT: Duration = Duration::from_secs(20);
const WIDTH: u32 = 1100;
const HEIGHT: u32 = 640;
/// The screenshots docs/ui.md shows.
const DOCS_SHOTS: [&str; 4] = ["login.png", "list.png", "stream.png", "detail.png"];

/// Where a screenshot named `name` is kept: the target directory of this test binary.
fn artifact(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    // <target>/<profile>/deps/<test binary>
    let profile_dir = exe.parent().and_then(Path::parent).unwrap();
    profile_dir.join("ui-screenshots").join(name)
}

/// Takes a screenshot as a test artifact (and for docs/ui/ when `UI_SCREENSHOTS_TO_DOCS` is set
/// and docs/ui.md shows it).
async fn shoot(page: &Page<'_>, name: &str) {
    let path = artifact(name);
    page.screenshot(&path).await;
    if std::env::var_os("UI_SCREENSHOTS_TO_DOCS").is_some() && DOCS_SHOTS.contains(&name) {
        let docs = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("docs/ui")
            .join(name);
        std::fs::create_dir_all(docs.parent().unwrap()).unwrap();
        std::fs::copy(&path, docs).unwrap();
    }
}

/// The request ids the list shows, top to bottom.
async fn rows(page: &Page<'_>) -> Vec<String> {
    let ids = page
        .eval("[...document.querySelectorAll('#rows tr')].map(tr => tr.dataset.id)")
        .await;
    serde_json::from_value(ids).unwrap()
}

/// Waits until the list shows exactly `expected` (in any order).
async fn wait_rows(page: &Page<'_>, expected: &[&str], what: &str) {
    let mut want: Vec<String> = expected.iter().map(|s| s.to_string()).collect();
    want.sort();
    let expression = format!(
        "(() => {{ const ids = [...document.querySelectorAll('#rows tr')].map(tr => tr.dataset.id).sort(); \
         return !document.getElementById('list').hidden && JSON.stringify(ids) === {}; }})()",
        json!(serde_json::to_string(&want).unwrap())
    );
    page.wait_for(&expression, what, WAIT).await;
}

async fn set_status_filter(page: &Page<'_>, status: &str) {
    page.eval(&format!(
        "(() => {{ const s = document.getElementById('f-status'); s.value = {}; \
         s.dispatchEvent(new Event('change', {{bubbles: true}})); return true; }})()",
        json!(status)
    ))
    .await;
}

/// The header's totals as the page shows them: name -> value.
async fn page_totals(page: &Page<'_>) -> Value {
    page.eval(
        "Object.fromEntries([...document.querySelectorAll('#totals-list [data-total]')]\
         .map(d => [d.dataset.total, JSON.parse(d.dataset.value)]))",
    )
    .await
}

/// `GET /usage`'s totals in the page's terms.
async fn usage_totals(app: &TestApp, key: Option<&str>) -> Value {
    let mut req = app.http.get(format!("{}/usage", app.base));
    if let Some(key) = key {
        req = req.header("authorization", format!("Bearer {key}"));
    }
    let usage: Value = req.send().await.unwrap().json().await.unwrap();
    let t = &usage["totals"];
    let saved = &t["saved_tokens"];
    let tokens =
        saved["input_tokens"].as_u64().unwrap_or(0) + saved["output_tokens"].as_u64().unwrap_or(0);
    json!({
        "requests": t["requests"],
        "upstream_calls": t["upstream_calls"],
        "saved_calls": t["saved_calls"],
        "saved_tokens": tokens,
        "cost_usd": t["cost_usd"],
        "saved_cost_usd": t["saved_cost_usd"],
    })
}

/// Waits until the page's totals equal `GET /usage`'s (the page polls every 2 s).
async fn wait_totals_match(app: &TestApp, page: &Page<'_>, key: Option<&str>) -> Value {
    let start = std::time::Instant::now();
    loop {
        let expected = usage_totals(app, key).await;
        let shown = page_totals(page).await;
        if shown == expected {
            return shown;
        }
        assert!(
            start.elapsed() < WAIT,
            "the page's totals {shown} never matched GET /usage's {expected}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Opens the detail of `id` by clicking its row.
async fn open_detail(page: &Page<'_>, id: &str) {
    page.eval(&format!(
        "document.querySelector('#rows tr[data-id=\"{id}\"]').click()"
    ))
    .await;
    page.wait_for(
        &format!(
            "!document.getElementById('detail').hidden && \
             document.querySelector('#cards [data-card=\"Request\"]') !== null && \
             document.getElementById('detail-title').textContent.includes('{id}')"
        ),
        "the detail view",
        WAIT,
    )
    .await;
}

/// Opens the live view of the stream whose detail `page` shows ("watch").
async fn watch(page: &Page<'_>) {
    page.wait_for(
        "!document.getElementById('watch').hidden",
        "the stream's detail",
        WAIT,
    )
    .await;
    page.eval("document.getElementById('watch').click()").await;
}

/// Opens the live view of the stream whose detail `page` shows, and waits for the whole stored
/// stream to be replayed into it.
async fn watch_to_its_end(page: &Page<'_>) {
    watch(page).await;
    page.wait_for(
        "document.getElementById('live').dataset.state === 'ended'",
        "the replayed stream",
        WAIT,
    )
    .await;
}

async fn text_of(page: &Page<'_>, id: &str) -> String {
    page.eval(&format!("document.getElementById('{id}').textContent"))
        .await
        .as_str()
        .unwrap()
        .to_string()
}

/// The stored answer text of request `id` (`?include=body`).
async fn stored_answer_text(app: &TestApp, id: &str, key: Option<&str>) -> String {
    let mut req = app
        .http
        .get(format!("{}/requests/{id}?include=body", app.base));
    if let Some(key) = key {
        req = req.header("authorization", format!("Bearer {key}"));
    }
    let full: Value = req.send().await.unwrap().json().await.unwrap();
    full["answer"]["text"].as_str().unwrap().to_string()
}

#[tokio::test]
async fn ui_lists_filters_follows_a_running_stream_live_and_its_totals_equal_usage() {
    let app = spawn_app(
        MockConfig {
            chunks: 60,
            chunk_delay_ms: 150,
            fail_first: 1,
            fail_status: 400,
            ..MockConfig::default()
        },
        |c| {
            c.ui = true;
            c.inject_stream_usage = true;
            c.prices = vec![Price {
                backend: "mock-openai".into(),
                model: "gpt-4o-*".into(),
                input_per_mtok: 0.15,
                output_per_mtok: 0.60,
                cached_input_per_mtok: None,
                cache_write_per_mtok: None,
                cache_write_1h_per_mtok: None,
            }];
        },
    )
    .await;
    // One refused by the provider (failed), one answered and then replayed (a saved call).
    let failed = app.chat(&chat_body("the provider refuses this one")).await;
    assert_eq!(failed.status(), 400);
    let failed = header(&failed, "holdfast-request-id");
    let ok_body = chat_body("summarise the durable log");
    let ok = app.chat(&ok_body).await;
    assert_eq!(ok.status(), 200);
    let ok = header(&ok, "holdfast-request-id");
    assert_eq!(
        header(&app.chat(&ok_body).await, "idempotent-replayed"),
        "true"
    );

    let browser = Browser::launch();
    let page = browser.new_page(WIDTH, HEIGHT).await;
    page.goto(&format!("{}/ui", app.base)).await;
    wait_rows(&page, &[&failed, &ok], "the two finished requests").await;
    assert_eq!(
        page.eval("document.getElementById('login').hidden").await,
        true,
        "no namespaces: no key prompt"
    );

    // A slow stream starts after the page loaded: the live refresh lists it while it runs.
    let started = app
        .post(
            "/v1/chat/completions",
            stream_body("stream a long answer slowly"),
            &[("prefer", "respond-async")],
        )
        .await;
    assert_eq!(started.status(), 202);
    let streaming = header(&started, "holdfast-request-id");
    wait_rows(&page, &[&failed, &ok, &streaming], "the stream to appear").await;
    let shown_status = page
        .eval(&format!(
            "document.querySelector('#rows tr[data-id=\"{streaming}\"]').dataset.status"
        ))
        .await;
    assert!(
        matches!(shown_status.as_str(), Some("running" | "pending")),
        "listed while it runs: {shown_status}"
    );

    // Filtering by status shows one.
    set_status_filter(&page, "failed").await;
    wait_rows(&page, &[&failed], "status=failed").await;
    set_status_filter(&page, "succeeded").await;
    wait_rows(&page, &[&ok], "status=succeeded").await;
    set_status_filter(&page, "").await;
    wait_rows(&page, &[&failed, &ok, &streaming], "no filter").await;
    shoot(&page, "list.png").await;

    // The streaming one's detail: chunks arrive live, then the final text.
    open_detail(&page, &streaming).await;
    page.eval("document.getElementById('watch').click()").await;
    let first = page
        .wait_for(
            "Number(document.getElementById('live').dataset.events || 0)",
            "the first chunks",
            WAIT,
        )
        .await
        .as_u64()
        .unwrap();
    let first_text = text_of(&page, "live-text").await;
    assert_eq!(
        app.record(&streaming).await["status"],
        "running",
        "the first chunks were shown while the request ran"
    );
    page.wait_for(
        &format!(
            "Number(document.getElementById('live').dataset.events) >= {} && \
             document.getElementById('live').dataset.state !== 'ended'",
            first + 5
        ),
        "more chunks, live",
        WAIT,
    )
    .await;
    let later_text = text_of(&page, "live-text").await;
    assert!(
        later_text.len() > first_text.len() && later_text.starts_with(&first_text),
        "the text grows as chunks arrive: {first_text:?} then {later_text:?}"
    );
    shoot(&page, "stream.png").await;
    page.wait_for(
        "document.getElementById('live').dataset.state === 'ended'",
        "the end event",
        Duration::from_secs(40),
    )
    .await;
    assert_eq!(text_of(&page, "live-state").await, "ended: succeeded");
    let final_text = text_of(&page, "live-text").await;
    let stored = stored_answer_text(&app, &streaming, None).await;
    assert!(!stored.is_empty());
    assert_eq!(final_text, stored, "the live text is the final answer");
    page.wait_for(
        "document.querySelector('#detail-title [data-status]').dataset.status === 'succeeded'",
        "the detail to show the stream succeeded",
        WAIT,
    )
    .await;

    // The prompt and the answer, on demand.
    assert_eq!(
        page.eval("document.getElementById('bodies').hidden").await,
        true
    );
    page.eval("document.getElementById('show-body').click()")
        .await;
    page.wait_for(
        "document.getElementById('prompt').textContent.includes('stream a long answer slowly')",
        "the prompt",
        WAIT,
    )
    .await;
    assert_eq!(text_of(&page, "answer").await, stored);

    // The failed one's detail shows its error.
    page.eval("location.hash = '#/'").await;
    wait_rows(&page, &[&failed, &ok, &streaming], "back to the list").await;
    open_detail(&page, &failed).await;
    let error_card = page
        .eval("document.querySelector('#cards [data-card=\"Error\"]').textContent")
        .await;
    assert!(
        error_card.as_str().unwrap().contains("upstream_refused"),
        "{error_card}"
    );

    // The header's totals are GET /usage's: three requests, one saved call, priced.
    let totals = wait_totals_match(&app, &page, None).await;
    assert_eq!(totals["requests"], 3, "{totals}");
    assert_eq!(totals["saved_calls"], 1, "{totals}");
    assert!(totals["cost_usd"].as_f64().unwrap() > 0.0, "{totals}");
    assert!(totals["saved_cost_usd"].as_f64().unwrap() > 0.0, "{totals}");

    // The detail with its bodies, for the docs.
    page.eval(&format!("location.hash = '#/r/{ok}'")).await;
    page.wait_for(
        "document.querySelector('#cards [data-card=\"Deliveries and savings\"]') !== null",
        "the succeeded request's detail",
        WAIT,
    )
    .await;
    page.eval("document.getElementById('show-body').click()")
        .await;
    page.wait_for(
        "!document.getElementById('bodies').hidden",
        "the bodies",
        WAIT,
    )
    .await;
    page.resize(WIDTH, 900).await;
    shoot(&page, "detail.png").await;

    let errors = browser.errors();
    assert!(
        errors.is_empty(),
        "the page ran without errors: {errors:#?}"
    );
    app.stop().await;
}

const IMG: &str = r#"<img src=x onerror="document.title='pwned'">"#;
const SCRIPT: &str = "<script>document.title='pwned'</script>";

#[tokio::test]
async fn ui_renders_markup_in_prompts_answers_and_streams_as_text() {
    // The provider's answers carry markup: a chat answer, and a Messages stream.
    let answer = json!({
        "id": "chatcmpl-xss", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "finish_reason": "stop",
            "message": {"role": "assistant", "content": format!("{SCRIPT} and {IMG}")}}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12},
    })
    .to_string();
    let chat = RawProvider::start(raw_200("application/json", &answer, false)).await;
    let delta = json!({"type": "content_block_delta", "index": 0,
        "delta": {"type": "text_delta", "text": SCRIPT}});
    let events = [
        (
            "message_start",
            json!({"type": "message_start", "message": {"id": "msg_x", "type": "message",
            "role": "assistant", "content": [], "model": "m", "stop_reason": null,
            "usage": {"input_tokens": 5, "output_tokens": 0}}}),
        ),
        (
            "content_block_start",
            json!({"type": "content_block_start", "index": 0,
            "content_block": {"type": "text", "text": ""}}),
        ),
        ("content_block_delta", delta),
        (
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 0}),
        ),
        (
            "message_delta",
            json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"},
            "usage": {"output_tokens": 3}}),
        ),
        ("message_stop", json!({"type": "message_stop"})),
    ];
    let sse: String = events
        .iter()
        .map(|(name, data)| format!("event: {name}\ndata: {data}\n\n"))
        .collect();
    let messages = RawProvider::start(raw_200("text/event-stream", &sse, false)).await;
    let (chat_url, messages_url) = (chat.base_url(), messages.base_url());
    let app = spawn_app(MockConfig::default(), move |c| {
        c.ui = true;
        c.backends[0].base_url = chat_url;
        c.backends[1].base_url = messages_url;
    })
    .await;

    let r = app
        .chat(
            &json!({"model": r#"<svg onload="document.title='pwned'">"#,
                "messages": [{"role": "user", "content": IMG}]})
            .to_string(),
        )
        .await;
    assert_eq!(r.status(), 200);
    let chat_id = header(&r, "holdfast-request-id");
    let r = app
        .post(
            "/v1/messages",
            json!({"model": "claude-x", "max_tokens": 10, "stream": true,
                "messages": [{"role": "user", "content": IMG}]})
            .to_string(),
            &[],
        )
        .await;
    assert_eq!(r.status(), 200);
    let stream_id = header(&r, "holdfast-request-id");
    let _ = r.text().await;

    let browser = Browser::launch();
    let page = browser.new_page(WIDTH, HEIGHT).await;
    page.goto(&format!("{}/ui", app.base)).await;
    wait_rows(&page, &[&chat_id, &stream_id], "both requests").await;

    // Nothing from the log became an element, and nothing ran.
    // The page's own SVG is the usage charts' (EX-10): bars and legend swatches, nothing else.
    let untouched = "document.title === 'holdfast' && \
        document.querySelectorAll('img, iframe, object, embed').length === 0 && \
        [...document.querySelectorAll('svg')].every(s => s.closest('#chart-grid, #chart-legend')) && \
        [...document.querySelectorAll('#chart-legend li')].every(li => li.querySelectorAll('svg').length === 1) && \
        document.querySelectorAll('script').length === 1 && \
        ![...document.querySelectorAll('*')].some(e => [...e.attributes].some(a => a.name.startsWith('on')))";
    let check = |what: &'static str| {
        let page = &page;
        async move {
            // Give a handler that slipped through the time to run.
            tokio::time::sleep(Duration::from_millis(500)).await;
            assert_eq!(
                page.eval(untouched).await,
                true,
                "{what}: markup stayed text"
            );
        }
    };
    let list_text = text_of(&page, "rows").await;
    assert!(
        list_text.contains("<svg onload="),
        "the model shows as text: {list_text}"
    );
    check("the list").await;

    open_detail(&page, &chat_id).await;
    page.eval("document.getElementById('show-body').click()")
        .await;
    page.wait_for(
        "!document.getElementById('bodies').hidden",
        "the chat's bodies",
        WAIT,
    )
    .await;
    assert_eq!(text_of(&page, "prompt").await, format!("user: {IMG}"));
    assert_eq!(
        text_of(&page, "answer").await,
        format!("{SCRIPT} and {IMG}")
    );
    check("the chat's prompt and answer").await;
    shoot(&page, "markup.png").await;

    page.eval(&format!("location.hash = '#/r/{stream_id}'"))
        .await;
    watch_to_its_end(&page).await;
    assert_eq!(text_of(&page, "live-text").await, SCRIPT);
    let events_text = text_of(&page, "live-events").await;
    assert!(events_text.contains("content_block_delta"), "{events_text}");
    page.eval("document.getElementById('show-body').click()")
        .await;
    page.wait_for(
        "!document.getElementById('bodies').hidden",
        "the stream's bodies",
        WAIT,
    )
    .await;
    assert_eq!(text_of(&page, "answer").await, SCRIPT);
    check("the stream's live view and bodies").await;

    let errors = browser.errors();
    assert!(
        errors.is_empty(),
        "the page ran without errors: {errors:#?}"
    );
    app.stop().await;
}

/// A Gemini request's prompt and answer show on demand as every other provider's do: its
/// `systemInstruction` and `contents`, and a non-stream answer's first candidate's text. The
/// page read OpenAI's and Anthropic's members only, so it showed "(no text found in the request
/// body)" and "(no answer text stored)" for an answered Gemini call.
#[tokio::test]
async fn ui_shows_a_gemini_requests_prompt_and_answer_gm1() {
    let app = spawn_app(MockConfig::default(), |c| c.ui = true).await;
    let body = json!({
        "systemInstruction": {"parts": [{"text": "answer like a pirate"}]},
        "contents": [{"role": "user", "parts": [{"text": "where is the treasure"}]}],
    });
    let r = app
        .post(
            "/v1beta/models/gemini-2.5-flash:generateContent",
            body.to_string(),
            &[],
        )
        .await;
    assert_eq!(r.status(), 200);
    let id = header(&r, "holdfast-request-id");
    let answer: Value = r.json().await.unwrap();
    let text = answer["candidates"][0]["content"]["parts"][0]["text"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(!text.is_empty());

    let browser = Browser::launch();
    let page = browser.new_page(WIDTH, HEIGHT).await;
    page.goto(&format!("{}/ui", app.base)).await;
    wait_rows(&page, &[&id], "the Gemini request").await;
    open_detail(&page, &id).await;
    page.eval("document.getElementById('show-body').click()")
        .await;
    page.wait_for(
        "!document.getElementById('bodies').hidden",
        "the Gemini request's bodies",
        WAIT,
    )
    .await;
    assert_eq!(
        text_of(&page, "prompt").await,
        "system: answer like a pirate\nuser: where is the treasure"
    );
    assert_eq!(text_of(&page, "answer").await, text);

    // A body the page's reading does not expect (a `role` no template can make text of) is
    // stored as it came: the prompt still shows, its role as Google's default, and the page
    // throws nothing.
    let odd = json!({"contents": [{"role": {"toString": 1}, "parts": [{"text": "odd role"}]}]});
    let r = app
        .post(
            "/v1beta/models/gemini-2.5-flash:generateContent",
            odd.to_string(),
            &[],
        )
        .await;
    let odd_id = header(&r, "holdfast-request-id");
    page.goto(&format!("{}/ui", app.base)).await;
    wait_rows(&page, &[&id, &odd_id], "both Gemini requests").await;
    open_detail(&page, &odd_id).await;
    page.eval("document.getElementById('show-body').click()")
        .await;
    page.wait_for(
        "!document.getElementById('bodies').hidden",
        "the odd request's bodies",
        WAIT,
    )
    .await;
    assert_eq!(text_of(&page, "prompt").await, "user: odd role");
    let errors = browser.errors();
    assert!(
        errors.is_empty(),
        "the page ran without errors: {errors:#?}"
    );
    app.stop().await;
}

#[tokio::test]
async fn ui_with_one_namespaces_key_shows_nothing_of_another_and_without_a_key_only_the_prompt() {
    let app = spawn_app(
        MockConfig {
            chunks: 40,
            chunk_delay_ms: 100,
            ..MockConfig::default()
        },
        |c| {
            c.ui = true;
            c.namespaces = vec![
                Namespace {
                    name: "team-a".into(),
                    api_keys: vec!["key-a".into()],
                    callback_url: None,
                    callback_secrets: Vec::new(),
                    callback_include_body: None,
                    max_held_requests: None,
                },
                Namespace {
                    name: "team-b".into(),
                    api_keys: vec!["key-b".into()],
                    callback_url: None,
                    callback_secrets: Vec::new(),
                    callback_include_body: None,
                    max_held_requests: None,
                },
            ];
        },
    )
    .await;
    let send = |body: String, key: &'static str, extra: Option<(&'static str, &'static str)>| {
        let mut headers = vec![("authorization", key)];
        headers.extend(extra);
        let app = &app;
        async move {
            let r = app.post("/v1/chat/completions", body, &headers).await;
            assert!(r.status().is_success(), "{}", r.status());
            header(&r, "holdfast-request-id")
        }
    };
    let a = send(chat_body("alpha asks"), "Bearer key-a", None).await;
    let b = send(chat_body("bravo asks"), "Bearer key-b", None).await;
    let b_stream = send(
        stream_body("bravo streams"),
        "Bearer key-b",
        Some(("prefer", "respond-async")),
    )
    .await;

    let browser = Browser::launch();
    let page = browser.new_page(WIDTH, HEIGHT).await;
    page.goto(&format!("{}/ui", app.base)).await;

    // Without a key: the prompt for one, and nothing else.
    let only_prompt = "!document.getElementById('login').hidden && \
        ['list', 'detail', 'totals', 'banner', 'forget'].every(id => document.getElementById(id).hidden) && \
        document.querySelectorAll('#rows tr, #totals-list *, #cards *').length === 0";
    page.wait_for(only_prompt, "the key prompt", WAIT).await;
    let visible = page.eval("document.body.innerText").await;
    for id in [&a, &b, &b_stream] {
        assert!(
            !visible.as_str().unwrap().contains(id.as_str()),
            "{visible}"
        );
    }
    shoot(&page, "login.png").await;

    // A wrong key is refused and the prompt stays.
    let type_key = |key: &'static str| {
        let page = &page;
        async move {
            page.eval(&format!(
                "document.getElementById('key').value = '{key}'; \
                 document.getElementById('login-form').requestSubmit(); true"
            ))
            .await;
        }
    };
    type_key("key-c").await;
    page.wait_for(
        "document.getElementById('login-error').textContent.includes('refused')",
        "the refusal",
        WAIT,
    )
    .await;
    page.wait_for(only_prompt, "the prompt, still", WAIT).await;

    // Namespace A's key: A's request only, in the list and the totals, across live refreshes.
    type_key("key-a").await;
    wait_rows(&page, &[&a], "A's requests").await;
    assert_eq!(
        page.eval("sessionStorage.getItem('holdfast.key')").await,
        "key-a",
        "the key is kept in session storage"
    );
    assert_eq!(page.eval("document.cookie").await, "", "no cookies");
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(
        rows(&page).await,
        vec![a.clone()],
        "still only A's after a refresh"
    );
    let totals = wait_totals_match(&app, &page, Some("key-a")).await;
    assert_eq!(totals["requests"], 1, "A's totals only: {totals}");
    assert_ne!(totals, usage_totals(&app, Some("key-b")).await);

    // B's request by its id: not found, nothing of it shown.
    for id in [&b, &b_stream] {
        page.eval(&format!("location.hash = '#/r/{id}'")).await;
        page.wait_for(
            &format!(
                "!document.getElementById('detail-error').hidden && \
                 document.getElementById('detail-error').textContent.includes('{id}') && \
                 document.getElementById('detail-body').hidden && \
                 document.querySelectorAll('#cards *').length === 0"
            ),
            "B's request refused",
            WAIT,
        )
        .await;
    }
    // B's running stream through the page's live view with A's key: nothing arrives.
    page.eval(&format!(
        "view.record = {{id: '{b_stream}', route: 'openai.chat', stream: true, status: 'running'}}; \
         startLive(); true"
    ))
    .await;
    page.wait_for(
        "document.getElementById('live').dataset.state === 'gone'",
        "the live view to give up on B's stream",
        WAIT,
    )
    .await;
    assert_eq!(
        page.eval("document.getElementById('live').dataset.events")
            .await,
        "0"
    );
    assert_eq!(text_of(&page, "live-text").await, "");
    // And the same with a bare EventSource carrying A's key.
    let direct = page
        .eval(&format!(
            "new Promise(resolve => {{ const got = []; \
               const es = new EventSource('/requests/{b_stream}?key=key-a'); \
               es.onmessage = e => got.push(e.data); \
               es.onerror = () => {{ resolve({{closed: es.readyState === EventSource.CLOSED, got: got.length}}); es.close(); }}; }})"
        ))
        .await;
    assert_eq!(direct, json!({"closed": true, "got": 0}));
    // B's key sees the stream, so the refusal above was the namespace, not the stream.
    let with_b = page
        .eval(&format!(
            "new Promise(resolve => {{ const got = []; \
               const es = new EventSource('/requests/{b_stream}?key=key-b'); \
               es.onmessage = e => {{ got.push(e.data); es.close(); resolve(got.length); }}; \
               es.onerror = () => {{ es.close(); resolve(-1); }}; }})"
        ))
        .await;
    assert_eq!(with_b, 1);

    // Forgetting the key clears what A's key showed and brings back the prompt.
    page.eval("location.hash = '#/'").await;
    wait_rows(&page, &[&a], "A's list again").await;
    page.eval("document.getElementById('forget').click()").await;
    page.wait_for(only_prompt, "the prompt after forgetting the key", WAIT)
        .await;
    assert_eq!(
        page.eval("sessionStorage.getItem('holdfast.key')").await,
        Value::Null
    );
    type_key("key-b").await;
    wait_rows(&page, &[&b, &b_stream], "B's requests with B's key").await;
    // Switching keys at once: the reads sent with B's key (and the keyless read the click
    // makes) answer after A's key is in, and none of them may forget A's key or paint B's rows.
    page.eval(
        "document.getElementById('forget').click(); \
         document.getElementById('key').value = 'key-a'; \
         document.getElementById('login-form').requestSubmit(); true",
    )
    .await;
    wait_rows(
        &page,
        &[&a],
        "A's requests right after a switch from B's key",
    )
    .await;
    assert_eq!(
        page.eval("sessionStorage.getItem('holdfast.key')").await,
        "key-a"
    );

    let errors: Vec<String> = browser
        .errors()
        .into_iter()
        // The refused key and B's stream read with A's key answer 401 and 404 on purpose.
        .filter(|e| !e.contains("401") && !e.contains("404"))
        .collect();
    assert!(
        errors.is_empty(),
        "the page ran without errors: {errors:#?}"
    );
    app.stop().await;
}

#[tokio::test]
async fn ui_live_view_survives_a_server_restart_mid_stream_and_shows_the_reset() {
    // holdfast as a child process, stopped (SIGTERM: the running attempt is handed back with a
    // `reset` chunk, every connection is cut) and started again on the same address and
    // database while the page watches.
    let mock = start_mock(MockConfig {
        chunks: 50,
        chunk_delay_ms: 120,
        ..MockConfig::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let toml = format!(
        r#"
ui = true
shutdown_grace_ms = 200
database_url = "sqlite://{db}"
[workers]
poll_interval_ms = 100
[[backends]]
name = "mock"
kind = "openai"
base_url = "{mock}"
"#,
        db = dir.path().join("holdfast.db").display(),
        mock = mock.base_url(),
    );
    let addr = free_addr();
    let mut server = Process::serve(dir.path(), &toml, addr).await;
    let base = server.base.clone();
    let http = reqwest::Client::new();
    let started = http
        .post(format!("{base}/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("prefer", "respond-async")
        .body(stream_body("survive a restart"))
        .send()
        .await
        .unwrap();
    assert_eq!(started.status(), 202);
    let id = header(&started, "holdfast-request-id");

    let browser = Browser::launch();
    let page = browser.new_page(WIDTH, HEIGHT).await;
    page.goto(&format!("{base}/ui#/r/{id}")).await;
    watch(&page).await;
    page.wait_for(
        "Number(document.getElementById('live').dataset.events || 0) >= 10",
        "ten chunks of the first attempt",
        WAIT,
    )
    .await;

    assert!(
        server.sigterm_and_wait(Duration::from_secs(20)),
        "clean exit"
    );
    page.wait_for(
        "['disconnected', 'reconnecting'].includes(document.getElementById('live').dataset.state)",
        "the page to notice",
        WAIT,
    )
    .await;
    let _server = Process::serve(dir.path(), &toml, addr).await;

    page.wait_for(
        "document.getElementById('live').dataset.state === 'ended'",
        "the end of the re-run",
        Duration::from_secs(40),
    )
    .await;
    assert_eq!(text_of(&page, "live-state").await, "ended: succeeded");
    let record = get_record(&http, &base, &id).await;
    assert_eq!(record["status"], "succeeded");
    assert_eq!(record["attempts"], 2, "{record}");
    let notes = text_of(&page, "live-notes").await;
    assert!(notes.contains("attempt 2 started over"), "{notes}");
    let opens = page
        .eval("Number(document.getElementById('live').dataset.opens)")
        .await;
    assert!(opens.as_u64().unwrap() >= 2, "reconnected: {opens}");
    // What the page shows is the stored answer: the second attempt's text, nothing twice.
    let full: Value = http
        .get(format!("{base}/requests/{id}?include=body"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(text_of(&page, "live-text").await, full["answer"]["text"]);
    // Every event seq arrived once, in order, across the reconnect.
    let seqs: Vec<i64> = serde_json::from_value(
        page.eval(
            "[...document.querySelectorAll('#live-events li')].map(li => Number(li.textContent.split(' ')[0]))",
        )
        .await,
    )
    .unwrap();
    assert_eq!(
        seqs,
        (1..=seqs.len() as i64).collect::<Vec<_>>(),
        "no gap, no duplicate"
    );
    assert_eq!(*seqs.last().unwrap(), record["last_seq"].as_i64().unwrap());
}

#[tokio::test]
async fn ui_cancel_button_cancels_a_running_request_lc9() {
    let app = spawn_app(
        MockConfig {
            chunks: 100,
            chunk_delay_ms: 200,
            ..MockConfig::default()
        },
        |c| c.ui = true,
    )
    .await;
    let started = app
        .post(
            "/v1/chat/completions",
            stream_body("cancel me"),
            &[("prefer", "respond-async")],
        )
        .await;
    let id = header(&started, "holdfast-request-id");

    let browser = Browser::launch();
    let page = browser.new_page(WIDTH, HEIGHT).await;
    page.goto(&format!("{}/ui#/r/{id}", app.base)).await;
    page.wait_for(
        "!document.getElementById('cancel').hidden",
        "the cancel button of a running request",
        WAIT,
    )
    .await;
    page.eval("document.getElementById('watch').click()").await;
    page.wait_for(
        "Number(document.getElementById('live').dataset.events || 0) >= 1",
        "the stream",
        WAIT,
    )
    .await;
    page.eval("document.getElementById('cancel').click()").await;
    page.wait_for(
        "document.querySelector('#detail-title [data-status]').dataset.status === 'failed' && \
         document.querySelector('#cards [data-card=\"Error\"]') !== null && \
         document.getElementById('cancel').hidden",
        "the cancelled record",
        WAIT,
    )
    .await;
    let error = page
        .eval("document.querySelector('#cards [data-card=\"Error\"]').textContent")
        .await;
    assert!(error.as_str().unwrap().contains("cancelled"), "{error}");
    // The live view ends with the request's `end` event.
    page.wait_for(
        "document.getElementById('live').dataset.state === 'ended'",
        "the stream's end",
        WAIT,
    )
    .await;
    assert_eq!(text_of(&page, "live-state").await, "ended: failed");
    let record = app.record(&id).await;
    assert_eq!(record["status"], "failed");
    assert_eq!(record["error"]["type"], "cancelled");
    let errors = browser.errors();
    assert!(
        errors.is_empty(),
        "the page ran without errors: {errors:#?}"
    );
    app.stop().await;
}

/// CB-6: the detail shows a request's callback, its URL and the receiver's answer as text
/// (both come from outside: the caller and the receiver), and the list filters by its state.
#[tokio::test]
async fn ui_shows_a_callback_with_its_url_and_the_receivers_answer_as_text_cb6() {
    use crate::callbacks::{Answer, Receiver, callback_config, wait_callback};
    let receiver = Receiver::start(|_| Answer::Body(500, IMG)).await;
    let app = spawn_app(MockConfig::default(), |c| {
        c.ui = true;
        callback_config(c);
        // One try, then a long wait: the page shows it pending with the receiver's answer.
        c.callbacks.backoff_initial_ms = 600_000;
        c.callbacks.backoff_max_ms = 600_000;
    })
    .await;
    let url = format!("{}?to={SCRIPT}", receiver.url);
    let r =
        crate::callbacks::chat_with_callback(&app.http, &app.base, &chat_body("told"), &url, &[])
            .await;
    let id = header(&r, "holdfast-request-id");
    let plain = header(
        &app.chat(&chat_body("not told")).await,
        "holdfast-request-id",
    );
    receiver.wait_for(1, WAIT).await;
    let start = std::time::Instant::now();
    while get_record(&app.http, &app.base, &id).await["callback"]["attempts"] != 1 {
        assert!(start.elapsed() < WAIT, "the try was not recorded");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    wait_callback(&app.http, &app.base, &id, "pending", WAIT).await;

    let browser = Browser::launch();
    let page = browser.new_page(WIDTH, HEIGHT).await;
    page.goto(&format!("{}/ui", app.base)).await;
    wait_rows(&page, &[&id, &plain], "both requests").await;
    page.eval(
        "(() => { const s = document.getElementById('f-callback'); s.value = 'pending'; \
         s.dispatchEvent(new Event('change', {bubbles: true})); return true; })()",
    )
    .await;
    wait_rows(&page, &[&id], "the request with a pending callback").await;
    open_detail(&page, &id).await;
    page.wait_for(
        "document.querySelector('#cards [data-card=\"Callback\"]') !== null",
        "the callback card",
        WAIT,
    )
    .await;
    let shown = page
        .eval("document.querySelector('#cards [data-card=\"Callback\"]').textContent")
        .await;
    let shown = shown.as_str().unwrap();
    assert!(shown.contains(&url), "the URL as text: {shown}");
    assert!(
        shown.contains(IMG) && shown.contains("HTTP 500"),
        "the answer as text: {shown}"
    );
    assert!(shown.contains("pending"), "{shown}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    // The page's own SVG is the usage charts' (EX-10), nothing else.
    let untouched = "document.title === 'holdfast' && \
        document.querySelectorAll('img, iframe, object, embed').length === 0 && \
        [...document.querySelectorAll('svg')].every(s => s.closest('#chart-grid, #chart-legend')) && \
        document.querySelectorAll('script').length === 1";
    assert_eq!(page.eval(untouched).await, true, "markup stayed text");
    assert!(browser.errors().is_empty(), "{:#?}", browser.errors());
    app.stop().await;
}

/// EX-10, EX-8: the usage charts drawn from `GET /usage?bucket=` equal its numbers — the
/// calls chart its upstream calls, as its title says, not its requests (one request here is
/// retried once) — regroup by backend, and a record shows its replays' answers beside its own;
/// the page asks nothing of any other origin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ui_draws_usage_charts_per_bucket_and_a_records_replays_with_no_request_to_another_origin_ex10()
 {
    // The first call fails with a 500: the first request takes two upstream calls.
    let mock = MockConfig {
        fail_first: 1,
        ..MockConfig::default()
    };
    let app = spawn_app(mock, |c| {
        c.ui = true;
        c.prices = vec![Price {
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
    let mut first = String::new();
    for (i, model) in ["gpt-4o-mini", "gpt-4o-mini", "mock-large"]
        .iter()
        .enumerate()
    {
        let body = json!({"model": model, "messages": [{"role": "user", "content": format!("chart {i}")}]});
        let r = app.chat(&body.to_string()).await;
        if i == 0 {
            first = header(&r, "holdfast-request-id");
        }
        let _ = r.bytes().await.unwrap();
    }
    let replay = app
        .http
        .post(format!("{}/requests/{first}/replay", app.base))
        .header("content-type", "application/json")
        .body(r#"{"model":"mock-large"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(replay.status(), 201);
    let replay: Value = replay.json().await.unwrap();
    wait_terminal(&app.http, &app.base, replay["id"].as_str().unwrap(), WAIT).await;

    let browser = Browser::launch();
    let page = browser.new_page(WIDTH, 900).await;
    page.record_network().await;
    page.goto(&format!("{}/ui", app.base)).await;
    page.wait_for(
        "Number(document.getElementById('charts').dataset.buckets || 0) >= 1 && \
         document.querySelector('[data-chart=\"calls\"]')?.dataset.total === '5'",
        "the calls chart with the five upstream calls of the four requests",
        WAIT,
    )
    .await;
    let usage: Value = get_json(&app.http, &format!("{}/usage", app.base)).await;
    let usage = &usage["totals"];
    assert_eq!(
        (&usage["requests"], &usage["upstream_calls"]),
        (&json!(4), &json!(5))
    );
    let drawn = |name: &str| {
        format!("Number(document.querySelector('[data-chart=\"{name}\"]').dataset.total)")
    };
    assert_eq!(page.eval(&drawn("calls")).await, usage["upstream_calls"]);
    let title = page
        .eval("document.querySelector('[data-chart=\"calls\"] h3').firstChild.textContent")
        .await;
    assert_eq!(
        title,
        json!("upstream calls "),
        "the chart says what it counts"
    );
    assert_eq!(page.eval(&drawn("tokens")).await.as_f64(), {
        let u = &usage["usage"];
        Some((u["input_tokens"].as_u64().unwrap() + u["output_tokens"].as_u64().unwrap()) as f64)
    });
    let cost = page.eval(&drawn("cost")).await.as_f64().unwrap();
    assert!(
        (cost - usage["cost_usd"].as_f64().unwrap()).abs() < 1e-12,
        "{cost} {usage}"
    );
    // One bar segment per model in today's bucket, coloured as the legend says.
    let models = page
        .eval("[...document.querySelectorAll('[data-chart=\"calls\"] rect')].map(r => r.dataset.key).sort()")
        .await;
    assert_eq!(models, json!(["gpt-4o-mini", "mock-large"]));
    let legend = page
        .eval("[...document.querySelectorAll('#chart-legend li')].map(l => l.textContent)")
        .await;
    assert_eq!(legend, json!(["gpt-4o-mini", "mock-large"]));
    shoot(&page, "charts.png").await;
    // By backend, per hour.
    page.eval(
        "document.getElementById('c-by').value = 'backend'; \
         document.getElementById('c-bucket').value = 'hour'; \
         document.getElementById('chart-form').dispatchEvent(new Event('change'))",
    )
    .await;
    page.wait_for(
        "[...document.querySelectorAll('#chart-legend li')].map(l => l.textContent).join() === 'mock-openai'",
        "the legend by backend",
        WAIT,
    )
    .await;
    assert_eq!(page.eval(&drawn("calls")).await, json!(5));

    // The original shows its replay side by side.
    page.eval(&format!("location.hash = '#/r/{first}'")).await;
    page.wait_for(
        "document.getElementById('replays').dataset.replays === '1' && \
         !document.getElementById('replays').hidden",
        "the replays of the record",
        WAIT,
    )
    .await;
    let table = text_of(&page, "replay-table").await;
    assert!(table.contains("mock reply to gpt-4o-mini:"), "{table}");
    assert!(table.contains("mock reply to mock-large:"), "{table}");
    shoot(&page, "replays.png").await;
    // The replay names its original.
    let id = replay["id"].as_str().unwrap();
    page.eval(&format!("location.hash = '#/r/{id}'")).await;
    page.wait_for(
        &format!("document.getElementById('cards').textContent.includes('{first}')"),
        "the replay's link to its original",
        WAIT,
    )
    .await;

    let urls = browser.requested_urls();
    assert!(
        urls.iter().any(|u| u.contains("/usage?bucket=")),
        "{urls:#?}"
    );
    // Chromium's own `data:` icons (the date inputs') leave nothing; every network request
    // goes to holdfast.
    let foreign: Vec<&String> = urls
        .iter()
        .filter(|u| !u.starts_with("data:"))
        .filter(|u| !u.starts_with(&format!("{}/", app.base)))
        .collect();
    assert!(
        foreign.is_empty(),
        "requests to another origin: {foreign:#?}"
    );
    let errors = browser.errors();
    assert!(
        errors.is_empty(),
        "the page ran without errors: {errors:#?}"
    );
    app.stop().await;
}

/// The detail cards break a line inside a token only where it would overflow: at a 1300 px
/// window (and others), no ordinary word of theirs (`succeeded`, `openai.chat`, a label) is
/// split across two lines, and a long one (an OpenAI fine-tuned model id, a provider request
/// id, a request id, a long URL in a failed request's error message) wraps inside its card
/// instead of running out of it (docs/ui.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ui_detail_cards_split_no_ordinary_word_and_keep_long_ids_inside_the_card() {
    // The Anthropic backend fails every call with a 500 quoting a 150-character URL, which
    // the request's error message quotes in turn (one attempt: no retry).
    let url = format!(
        "https://storage.example.com/{}.png",
        "a1b2c3d4e5".repeat(12)
    );
    let failure = format!("upstream timed out fetching {url}");
    let failing = RawProvider::start(
        format!(
            "HTTP/1.1 500 Internal Server Error\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{failure}",
            failure.len()
        )
        .into_bytes(),
    )
    .await;
    // Streams end without their final event: a stream that broke after its 200.
    let mock = MockConfig {
        omit_stream_end: true,
        ..MockConfig::default()
    };
    let app = spawn_app(mock, |c| {
        c.ui = true;
        c.workers.max_attempts = 1;
        for b in &mut c.backends {
            if b.name == "mock-anthropic" {
                b.base_url = failing.base_url();
            }
        }
    })
    .await;
    let model = "ft:gpt-4o-mini-2024-07-18:my-org:custom-suffix:abc123def456";
    let body = json!({"model": model, "messages": [{"role": "user", "content": "cards"}]});
    let r = app.chat(&body.to_string()).await;
    assert_eq!(r.status(), 200);
    let original = header(&r, "holdfast-request-id");
    let replay = post_replay(&app, &original).await;
    assert_eq!(replay.status(), 201);
    let replay: Value = replay.json().await.unwrap();
    let replay = replay["id"].as_str().unwrap().to_string();
    wait_terminal(&app.http, &app.base, &replay, WAIT).await;
    let r = app
        .post(
            "/v1/messages",
            json!({"model": "claude-mock-small", "max_tokens": 16,
                "messages": [{"role": "user", "content": "refused"}]})
            .to_string(),
            &[("anthropic-version", "2023-06-01")],
        )
        .await;
    assert_eq!(r.status(), 502);
    let failed = header(&r, "holdfast-request-id");
    let record = wait_terminal(&app.http, &app.base, &failed, WAIT).await;
    assert!(
        record["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains(&url)),
        "the message quotes the URL: {record}"
    );

    // Every word up to 24 characters: the ranges of the lines it lies on (one when whole).
    let split_words = "(() => { const split = []; \
        const walk = document.createTreeWalker(document.getElementById('cards'), NodeFilter.SHOW_TEXT); \
        for (let node; (node = walk.nextNode()); ) { \
          for (const m of node.data.matchAll(/\\S+/g)) { \
            if (m[0].length > 24) continue; \
            const range = document.createRange(); \
            range.setStart(node, m.index); range.setEnd(node, m.index + m[0].length); \
            const lines = new Set([...range.getClientRects()].filter(r => r.width > 0) \
              .map(r => Math.round(r.bottom))); \
            if (lines.size > 1) split.push(m[0]); } } \
        return split; })()";
    // Every value's right edge within its card's.
    let overflowing = "[...document.querySelectorAll('#cards .card dd')].filter(dd => \
        dd.getBoundingClientRect().right > dd.closest('.card').getBoundingClientRect().right + 0.5 \
        || dd.scrollWidth > dd.clientWidth + 1).map(dd => dd.textContent)";

    let browser = Browser::launch();
    let page = browser.new_page(1300, 900).await;
    let shown = [
        (
            replay.as_str(),
            format!(
                "document.querySelector('#cards [data-card=\"Request\"]')?.textContent.includes('{original}') && \
                 document.querySelector('#cards [data-card=\"Request\"]').textContent.includes('succeeded')"
            ),
            "the replay's detail, naming its original",
            "cards",
        ),
        (
            failed.as_str(),
            format!(
                "document.querySelector('#cards [data-card=\"Error\"]')?.textContent.includes('{url}')"
            ),
            "the failed request's detail, its error quoting the URL",
            "error-cards",
        ),
    ];
    for (id, ready, what, shot) in shown {
        page.resize(1300, 900).await;
        page.goto(&format!("{}/ui#/r/{id}", app.base)).await;
        page.wait_for(
            &format!("!document.getElementById('detail').hidden && {ready}"),
            what,
            WAIT,
        )
        .await;
        for width in [1300, 1100, 900, 600, 400] {
            page.resize(width, 900).await;
            page.eval("new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
                .await;
            shoot(&page, &format!("{shot}-{width}.png")).await;
            assert_eq!(
                page.eval(split_words).await,
                json!([]),
                "{what}: words split across lines at {width} px"
            );
            assert_eq!(
                page.eval(overflowing).await,
                json!([]),
                "{what}: values running out of their card at {width} px"
            );
        }
    }
    // A stream that broke after its 200 stored no answer: the Request card's provider status
    // is the failure's, as the Error card shows it (it read "—" beside the Error card's 200).
    let broken = app
        .post(
            "/v1/chat/completions",
            json!({"model": "gpt-4o-mini", "stream": true,
                "messages": [{"role": "user", "content": "broken"}]})
            .to_string(),
            &[("prefer", "respond-async")],
        )
        .await;
    let broken = header(&broken, "holdfast-request-id");
    let record = wait_terminal(&app.http, &app.base, &broken, WAIT).await;
    assert_eq!(record["error"]["type"], "stream_interrupted", "{record}");
    assert!(record["response"].is_null(), "{record}");
    page.goto(&format!("{}/ui#/r/{broken}", app.base)).await;
    page.wait_for(
        "!document.getElementById('detail').hidden && \
         [...document.querySelectorAll('#cards [data-card=\"Request\"] dt')].some(dt => \
           dt.textContent === 'provider status' && dt.nextElementSibling?.textContent === '200')",
        "the broken stream's provider status, 200, in its Request card",
        WAIT,
    )
    .await;
    let errors = browser.errors();
    assert!(errors.is_empty(), "{errors:#?}");
    app.stop().await;
}

/// EX-9, decision 96: an answer that is only tool calls (an agent's turn) shows on demand as its
/// calls, `[tool call] NAME(ARGUMENTS)`, not as "(no answer text stored)": the page shows the
/// server's `answer_text`, which names them.
#[tokio::test]
async fn ui_shows_an_answer_that_is_only_tool_calls_as_its_calls_ex9() {
    let answer = json!({"id": "msg_1", "type": "message", "role": "assistant",
        "model": "claude-mock-small", "stop_reason": "tool_use", "stop_sequence": null,
        "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
            "input": {"city": "Paris"}}],
        "usage": {"input_tokens": 9, "output_tokens": 12}});
    let provider =
        RawProvider::start(raw_200("application/json", &answer.to_string(), false)).await;
    let app = spawn_app(MockConfig::default(), |c| {
        c.ui = true;
        use_backend_url(c, &provider.base_url());
    })
    .await;
    let body = json!({"model": "claude-mock-small", "max_tokens": 64,
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
        "messages": [{"role": "user", "content": "weather in Paris?"}]});
    let r = app.post("/v1/messages", body.to_string(), &[]).await;
    assert_eq!(r.status(), 200);
    let id = header(&r, "holdfast-request-id");

    let browser = Browser::launch();
    let page = browser.new_page(WIDTH, HEIGHT).await;
    page.goto(&format!("{}/ui", app.base)).await;
    wait_rows(&page, &[&id], "the tool call").await;
    open_detail(&page, &id).await;
    page.eval("document.getElementById('show-body').click()")
        .await;
    page.wait_for(
        "!document.getElementById('bodies').hidden",
        "the tool call's bodies",
        WAIT,
    )
    .await;
    assert_eq!(
        text_of(&page, "answer").await,
        r#"[tool call] get_weather({"city":"Paris"})"#
    );
    app.stop().await;
}

/// EX-10, decision 96: a stream that carries only tool calls (an agent's turn) shows them in the
/// live view as the server's answer text does, `[tool call] NAME(ARGUMENTS)`, its arguments
/// growing with their deltas, on chat, Responses, Messages and Gemini streams alike; and the markup in
/// them stays text. The live view read only text deltas and stayed blank for such a stream.
#[tokio::test]
async fn ui_live_view_shows_a_stream_of_tool_calls_only_as_its_calls_ex10() {
    const CALL: &str = r#"[tool call] get_weather({"city":"<b>Paris</b>"})"#;
    let sse = |events: &[(Option<&str>, Value)]| -> String {
        events
            .iter()
            .map(|(name, data)| match name {
                Some(name) => format!("event: {name}\ndata: {data}\n\n"),
                None => format!("data: {data}\n\n"),
            })
            .collect()
    };
    let chat = {
        let chunk = |delta: Value, finish: Value| {
            (
                None,
                json!({"id": "c1", "object": "chat.completion.chunk", "created": 1,
                "model": "gpt-4o-mini", "choices": [{"index": 0, "delta": delta,
                "finish_reason": finish}]}),
            )
        };
        let mut body = sse(&[
            chunk(json!({"role": "assistant", "content": null}), Value::Null),
            chunk(
                json!({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": ""}}]}),
                Value::Null,
            ),
            chunk(
                json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\":"}}]}),
                Value::Null,
            ),
            chunk(
                json!({"tool_calls": [{"index": 0, "function": {"arguments": "\"<b>Paris</b>\"}"}}]}),
                Value::Null,
            ),
            chunk(json!({}), json!("tool_calls")),
        ]);
        body.push_str("data: [DONE]\n\n");
        body
    };
    let messages = sse(&[
        (
            Some("message_start"),
            json!({"type": "message_start", "message": {"id": "msg_1",
            "type": "message", "role": "assistant", "content": [], "model": "claude-x",
            "stop_reason": null, "usage": {"input_tokens": 5, "output_tokens": 1}}}),
        ),
        (
            Some("content_block_start"),
            json!({"type": "content_block_start", "index": 0,
            "content_block": {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
            "input": {}}}),
        ),
        (
            Some("content_block_delta"),
            json!({"type": "content_block_delta", "index": 0,
            "delta": {"type": "input_json_delta", "partial_json": "{\"city\":"}}),
        ),
        (
            Some("content_block_delta"),
            json!({"type": "content_block_delta", "index": 0,
            "delta": {"type": "input_json_delta", "partial_json": "\"<b>Paris</b>\"}"}}),
        ),
        (
            Some("content_block_stop"),
            json!({"type": "content_block_stop", "index": 0}),
        ),
        (
            Some("message_delta"),
            json!({"type": "message_delta",
            "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 9}}),
        ),
        (Some("message_stop"), json!({"type": "message_stop"})),
    ]);
    let gemini = sse(&[(
        None,
        json!({"candidates": [{"content": {"role": "model", "parts": [
        {"functionCall": {"name": "get_weather", "args": {"city": "<b>Paris</b>"}}}]},
        "finishReason": "STOP", "index": 0}],
        "usageMetadata": {"promptTokenCount": 5, "candidatesTokenCount": 4}}),
    )]);
    let responses = {
        let call = |arguments: &str| {
            json!({"type": "function_call", "id": "fc_1", "call_id": "call_1",
                "name": "get_weather", "arguments": arguments, "status": "completed"})
        };
        let object = |status: &str, output: Value| {
            json!({"id": "resp_1", "object": "response", "created_at": 1, "model": "gpt-4o-mini",
                "status": status, "output": output,
                "usage": {"input_tokens": 5, "output_tokens": 9}})
        };
        let full = r#"{"city":"<b>Paris</b>"}"#;
        sse(&[
            (
                Some("response.created"),
                json!({"type": "response.created",
                "sequence_number": 0, "response": object("in_progress", json!([]))}),
            ),
            (
                Some("response.output_item.added"),
                json!({"type": "response.output_item.added",
                "sequence_number": 1, "output_index": 0, "item": call("")}),
            ),
            (
                Some("response.function_call_arguments.delta"),
                json!({"type": "response.function_call_arguments.delta", "sequence_number": 2,
                "output_index": 0, "item_id": "fc_1", "delta": "{\"city\":"}),
            ),
            (
                Some("response.function_call_arguments.delta"),
                json!({"type": "response.function_call_arguments.delta", "sequence_number": 3,
                "output_index": 0, "item_id": "fc_1", "delta": "\"<b>Paris</b>\"}"}),
            ),
            (
                Some("response.function_call_arguments.done"),
                json!({"type": "response.function_call_arguments.done", "sequence_number": 4,
                "output_index": 0, "item_id": "fc_1", "arguments": full}),
            ),
            (
                Some("response.output_item.done"),
                json!({"type": "response.output_item.done",
                "sequence_number": 5, "output_index": 0, "item": call(full)}),
            ),
            (
                Some("response.completed"),
                json!({"type": "response.completed",
                "sequence_number": 6, "response": object("completed", json!([call(full)]))}),
            ),
        ])
    };
    let cases = [
        (
            "/v1/responses",
            json!({"model": "gpt-4o-mini", "stream": true, "input": "weather?"}),
            responses,
        ),
        (
            "/v1/chat/completions",
            json!({"model": "gpt-4o-mini", "stream": true,
                "messages": [{"role": "user", "content": "weather?"}]}),
            chat,
        ),
        (
            "/v1/messages",
            json!({"model": "claude-x", "max_tokens": 64, "stream": true,
                "messages": [{"role": "user", "content": "weather?"}]}),
            messages,
        ),
        (
            "/v1beta/models/gemini-x:streamGenerateContent?alt=sse",
            json!({"contents": [{"role": "user", "parts": [{"text": "weather?"}]}]}),
            gemini,
        ),
    ];
    let browser = Browser::launch();
    let page = browser.new_page(WIDTH, HEIGHT).await;
    for (path, body, stream) in cases {
        let provider = RawProvider::start(raw_200("text/event-stream", &stream, false)).await;
        let url = provider.base_url();
        let app = spawn_app(MockConfig::default(), move |c| {
            c.ui = true;
            use_backend_url(c, &url);
        })
        .await;
        let r = app.post(path, body.to_string(), &[]).await;
        assert_eq!(r.status(), 200, "{path}");
        let id = header(&r, "holdfast-request-id");
        let _ = r.text().await;
        let record = wait_terminal(&app.http, &app.base, &id, WAIT).await;
        assert_eq!(record["status"], "succeeded", "{path}: {record}");

        page.goto(&format!("{}/ui#/r/{id}", app.base)).await;
        watch_to_its_end(&page).await;
        assert_eq!(text_of(&page, "live-text").await, CALL, "{path}");
        assert_eq!(
            page.eval("document.querySelectorAll('#live-text *').length")
                .await,
            0,
            "{path}: the calls are text, no element"
        );
        // The stream holds no text, and the server's text of it is the live view's.
        let full: Value = app
            .http
            .get(format!("{}/requests/{id}?include=body", app.base))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(full["answer"]["text"], "", "{path}: {full}");
        assert_eq!(full["answer_text"], CALL, "{path}: {full}");
        let errors = browser.errors();
        assert!(
            errors.is_empty(),
            "{path}: the page ran without errors: {errors:#?}"
        );
        // Off this server before it stops: the page's refreshes would find it gone.
        page.goto("about:blank").await;
        app.stop().await;
    }
}
