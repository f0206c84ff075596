//! Callbacks (SPEC CB-1..CB-6): signed webhooks when a request finishes, delivered from the log.
//! Receivers run on loopback, admitted by `[callbacks] allow`: an in-process one scripted per
//! test (it answers each delivery as told and signals every one it gets), and real ones in
//! Python and Node (`tests/clients/webhook_receiver.*`) verifying with the Standard Webhooks
//! reference libraries.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use holdfast::config::Config;
use holdfast::mock::MockConfig;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::Notify;

use crate::helpers::*;

/// The secrets the tests sign with: an old and a new one, as during a rotation.
pub const OLD_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
pub const NEW_SECRET: &str = "whsec_dGhlIG5ldyBrZXkgb2YgdGhlIHRlc3Rz";

/// `[callbacks]` for tests: both secrets, loopback allowed, fast polls and backoff.
pub fn callback_config(config: &mut Config) {
    let c = &mut config.callbacks;
    c.secrets = vec![OLD_SECRET.into(), NEW_SECRET.into()];
    c.allow = vec!["127.0.0.0/8".into()];
    c.poll_interval_ms = 20;
    c.backoff_initial_ms = 100;
    c.backoff_max_ms = 1_000;
    c.timeout_ms = 2_000;
}

/// What the in-process receiver does with delivery number `n` (0-based).
#[derive(Debug, Clone, Copy)]
pub enum Answer {
    /// Answer this status.
    Status(u16),
    /// Never answer (until the test ends).
    Hang,
    /// Answer this status with this body.
    Body(u16, &'static str),
}

/// One delivery as the receiver got it.
#[derive(Debug, Clone)]
pub struct Delivery {
    pub id: String,
    pub timestamp: i64,
    pub signature: String,
    pub body: Value,
    /// The body as sent (what the signature covers).
    pub raw: String,
    pub at: Instant,
}

/// An in-process webhook receiver on loopback.
pub struct Receiver {
    pub url: String,
    got: Arc<Mutex<Vec<Delivery>>>,
    arrived: Arc<Notify>,
}

impl Receiver {
    /// Starts one that answers delivery `n` with `script(n)`.
    pub async fn start(script: impl Fn(usize) -> Answer + Send + Sync + 'static) -> Receiver {
        let got: Arc<Mutex<Vec<Delivery>>> = Arc::default();
        let arrived = Arc::new(Notify::new());
        let script = Arc::new(script);
        let (store, signal) = (Arc::clone(&got), Arc::clone(&arrived));
        let hook = move |headers: HeaderMap, body: String| {
            let (store, signal, script) = (store.clone(), signal.clone(), script.clone());
            async move {
                let h = |name: &str| {
                    headers
                        .get(name)
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or_default()
                        .to_string()
                };
                let n = {
                    let mut got = store.lock().unwrap();
                    got.push(Delivery {
                        id: h("webhook-id"),
                        timestamp: h("webhook-timestamp").parse().unwrap_or(0),
                        signature: h("webhook-signature"),
                        body: serde_json::from_str(&body).unwrap_or(Value::Null),
                        raw: body.clone(),
                        at: Instant::now(),
                    });
                    got.len() - 1
                };
                signal.notify_waiters();
                match script(n) {
                    Answer::Status(s) => StatusCode::from_u16(s).unwrap().into_response(),
                    Answer::Body(s, body) => {
                        (StatusCode::from_u16(s).unwrap(), body).into_response()
                    }
                    Answer::Hang => std::future::pending().await,
                }
            }
        };
        let app = axum::Router::new().route("/hook", axum::routing::post(hook));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        Receiver {
            url: format!("http://{addr}/hook"),
            got,
            arrived,
        }
    }

    /// Every delivery so far.
    pub fn deliveries(&self) -> Vec<Delivery> {
        self.got.lock().unwrap().clone()
    }

    /// Waits for at least `n` deliveries (at most `limit`), woken by each one.
    pub async fn wait_for(&self, n: usize, limit: Duration) -> Vec<Delivery> {
        let deadline = Instant::now() + limit;
        loop {
            let waiting = self.arrived.notified();
            let got = self.deliveries();
            if got.len() >= n {
                return got;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(
                tokio::time::timeout(left, waiting).await.is_ok(),
                "{} of {n} deliveries after {limit:?}: {got:?}",
                got.len()
            );
        }
    }
}

/// POSTs a chat body with `Holdfast-Callback-Url: url` (and `extra` headers); the answer.
pub async fn chat_with_callback(
    http: &reqwest::Client,
    base: &str,
    body: &str,
    url: &str,
    extra: &[(&str, &str)],
) -> reqwest::Response {
    let mut req = http
        .post(format!("{base}/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("holdfast-callback-url", url);
    for (k, v) in extra {
        req = req.header(*k, *v);
    }
    req.body(body.to_string()).send().await.expect("POST")
}

/// Sends chat body `text` to `app` asking for a callback to `url`; asserts the 200 and returns
/// the request's id.
pub async fn told(app: &TestApp, text: &str, url: &str) -> String {
    let r = chat_with_callback(&app.http, &app.base, &chat_body(text), url, &[]).await;
    assert_eq!(r.status(), 200, "{text}");
    let id = header(&r, "holdfast-request-id");
    let _ = r.bytes().await;
    id
}

/// Polls request `id`'s record until its callback's state is `state` (every 50 ms, at most
/// `limit`); the record.
pub async fn wait_callback(
    http: &reqwest::Client,
    base: &str,
    id: &str,
    state: &str,
    limit: Duration,
) -> Value {
    let start = Instant::now();
    loop {
        let record = get_record(http, base, id).await;
        if record["callback"]["state"] == state {
            return record;
        }
        assert!(
            start.elapsed() < limit,
            "callback of {id} not {state} after {limit:?}: {}",
            record["callback"]
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A receiver script (`tests/clients/webhook_receiver.*`) run by `program`: verifies every
/// delivery of three requests — a refused one, a plain success and a stream — with `secret`,
/// and rejects each tampered body and old timestamp (CB-3).
pub async fn reference_receiver_verifies_every_delivery(
    mut program: tokio::process::Command,
    secret: &str,
) {
    let mut child = program
        .env("WEBHOOK_SECRET", secret)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start the receiver");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let next = async |lines: &mut tokio::io::Lines<BufReader<tokio::process::ChildStdout>>| {
        let line = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
            .await
            .expect("the receiver printed nothing within 20 s")
            .expect("read the receiver")
            .expect("the receiver ended");
        serde_json::from_str::<Value>(&line).expect("a JSON line")
    };
    let port = next(&mut lines).await["port"].as_u64().expect("port");
    let url = format!("http://127.0.0.1:{port}/hook");

    let app = spawn_app(
        MockConfig {
            fail_first: 1,
            fail_status: 400,
            ..MockConfig::default()
        },
        callback_config,
    )
    .await;
    let mut ids = Vec::new();
    for body in [
        chat_body("refused, then told"),
        chat_body("plain, then told"),
        stream_body("streamed, then told"),
    ] {
        let r = chat_with_callback(&app.http, &app.base, &body, &url, &[]).await;
        let id = header(&r, "holdfast-request-id");
        let _ = r.bytes().await;
        ids.push(id);
    }
    let mut reports = Vec::new();
    for _ in 0..ids.len() {
        reports.push(next(&mut lines).await);
    }
    for id in &ids {
        let report = reports
            .iter()
            .find(|r| r["data_id"] == id.as_str())
            .unwrap_or_else(|| panic!("no verified delivery of {id}: {reports:?}"));
        assert_eq!(report["verified"], true, "{report}");
        assert_eq!(report["tampered_rejected"], true, "{report}");
        assert_eq!(report["old_rejected"], true, "{report}");
        assert_eq!(report["id"], format!("msg_{id}"), "{report}");
        let record = wait_callback(
            &app.http,
            &app.base,
            id,
            "delivered",
            Duration::from_secs(10),
        )
        .await;
        let expected = format!("request.{}", record["status"].as_str().unwrap());
        assert_eq!(report["type"], expected.as_str(), "{report}");
        assert_eq!(report["data_status"], record["status"], "{report}");
        assert_eq!(record["callback"]["last_status"], 204, "{record}");
        assert_eq!(record["callback"]["attempts"], 1, "{record}");
    }
    assert_eq!(
        reports
            .iter()
            .filter(|r| r["data_status"] == "failed")
            .count(),
        1,
        "{reports:?}"
    );
    child.stdin.take().unwrap().shutdown().await.ok();
    app.stop().await;
}

/// CB-3: the Python reference library verifies every webhook (the receiver knows only the new
/// secret of a rotation); tampering and an old timestamp fail it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_standardwebhooks_receiver_verifies_every_delivery_and_rejects_tampering_cb3() {
    require_python(&["standardwebhooks"]);
    let mut program = tokio::process::Command::new(python());
    program.arg(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/clients/webhook_receiver.py"),
    );
    reference_receiver_verifies_every_delivery(program, NEW_SECRET).await;
}

/// CB-4, CB-6: 500 three times, then 200: four tries, the delays between them growing, the
/// same webhook-id and body each time; delivered; counted in `/metrics`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_answering_500_three_times_then_200_gets_four_tries_with_growing_delays_cb4() {
    let receiver = Receiver::start(|n| Answer::Status(if n < 3 { 500 } else { 200 })).await;
    let app = spawn_app(MockConfig::default(), callback_config).await;
    let id = told(&app, "retry me", &receiver.url).await;
    let got = receiver.wait_for(4, Duration::from_secs(20)).await;
    let record = wait_callback(
        &app.http,
        &app.base,
        &id,
        "delivered",
        Duration::from_secs(10),
    )
    .await;
    let cb = &record["callback"];
    assert_eq!(cb["attempts"], 4, "{cb}");
    assert_eq!(cb["last_status"], 200, "{cb}");
    assert!(
        cb["delivered_at"].is_string() && cb["next_try_at"].is_null(),
        "{cb}"
    );
    assert_eq!(cb["url"], receiver.url.as_str());
    assert_eq!(got.len(), 4, "no fifth try after the 200");
    assert!(
        got.iter().all(|d| d.id == format!("msg_{id}")),
        "one webhook-id"
    );
    assert!(got.iter().all(|d| d.body["data"]["id"] == id.as_str()));
    assert!(
        got.iter().all(|d| d.signature.split(' ').count() == 2),
        "one signature per secret"
    );
    let gaps: Vec<Duration> = got.windows(2).map(|w| w[1].at - w[0].at).collect();
    assert!(gaps[0] >= Duration::from_millis(100), "{gaps:?}");
    assert!(
        gaps[1] > gaps[0] && gaps[2] > gaps[1],
        "growing delays: {gaps:?}"
    );
    let page = app.metrics_text().await;
    assert_eq!(
        metric(&page, "holdfast_callbacks_total", r#"outcome="retried""#),
        3.0,
        "{page}"
    );
    assert_eq!(
        metric(&page, "holdfast_callbacks_total", r#"outcome="delivered""#),
        1.0
    );
    assert_eq!(metric(&page, "holdfast_callbacks_backlog", ""), 0.0);
    app.stop().await;
}

/// CB-4, CB-6: 410 is the receiver refusing for good: one try, failed, listed by
/// `?callback=failed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_410_is_tried_once_and_fails_the_callback_which_the_list_and_the_cli_show_cb4_cb6() {
    let receiver = Receiver::start(|_| Answer::Status(410)).await;
    let app = spawn_app(MockConfig::default(), callback_config).await;
    let id = told(&app, "gone", &receiver.url).await;
    let plain = header(
        &app.chat(&chat_body("no callback")).await,
        "holdfast-request-id",
    );
    let record = wait_callback(&app.http, &app.base, &id, "failed", Duration::from_secs(10)).await;
    let cb = &record["callback"];
    assert_eq!(
        (cb["attempts"].as_u64(), cb["last_status"].as_u64()),
        (Some(1), Some(410)),
        "{cb}"
    );
    assert!(cb["last_error"].as_str().unwrap().contains("410"), "{cb}");
    assert_eq!(receiver.deliveries().len(), 1);
    assert!(app.record(&plain).await["callback"].is_null());
    let failed = get_json(&app.http, &format!("{}/requests?callback=failed", app.base)).await;
    let listed: Vec<&str> = failed["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["id"].as_str().unwrap())
        .collect();
    assert_eq!(listed, vec![id.as_str()]);
    assert_eq!(failed["data"][0]["callback"]["state"], "failed");
    // The CLI shows it too.
    let (base, shown) = (app.base.clone(), id.clone());
    let (show, list) = tokio::task::spawn_blocking(move || {
        let dir = tempfile::tempdir().unwrap();
        let env = [("HOLDFAST_URL", base.as_str())];
        (
            run_holdfast(dir.path(), &["requests", "show", &shown], &env),
            run_holdfast(
                dir.path(),
                &["requests", "list", "--callback", "failed"],
                &env,
            ),
        )
    })
    .await
    .unwrap();
    assert_eq!(show.0, 0, "{show:?}");
    let line = show
        .1
        .lines()
        .find(|l| l.starts_with("callback"))
        .unwrap_or_default();
    assert!(
        line.contains("failed after 1 tries, last HTTP 410"),
        "{}",
        show.1
    );
    assert!(line.contains(&receiver.url), "{line}");
    assert_eq!(list.0, 0, "{list:?}");
    assert!(
        list.1.contains(&id) && !list.1.contains(&plain),
        "{}",
        list.1
    );
    let bad = app
        .http
        .get(format!("{}/requests?callback=lost", app.base))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    app.stop().await;
}

/// CB-4, CB-6: a receiver that never answers is tried again after each timeout until the next
/// try would fall past `give_up_after_secs`, then the callback fails and the list shows it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_that_never_answers_is_tried_until_the_bound_then_failed_cb4_cb6() {
    let receiver = Receiver::start(|_| Answer::Hang).await;
    let app = spawn_app(MockConfig::default(), |c| {
        callback_config(c);
        c.callbacks.timeout_ms = 200;
        c.callbacks.backoff_initial_ms = 100;
        c.callbacks.backoff_max_ms = 400;
        c.callbacks.give_up_after_secs = 2;
    })
    .await;
    let id = told(&app, "silence", &receiver.url).await;
    let record = wait_callback(&app.http, &app.base, &id, "failed", Duration::from_secs(15)).await;
    let cb = &record["callback"];
    let tries = cb["attempts"].as_u64().unwrap();
    assert!(tries >= 3, "retried before giving up: {cb}");
    assert!(
        cb["last_error"].as_str().unwrap().contains("gave up"),
        "{cb}"
    );
    assert_eq!(
        receiver.deliveries().len() as u64,
        tries,
        "every try reached the receiver"
    );
    let failed = get_json(&app.http, &format!("{}/requests?callback=failed", app.base)).await;
    assert_eq!(failed["data"][0]["id"], id.as_str());
    app.stop().await;
}

/// CB-2: the metadata address and loopback are refused at admission by default, in the
/// provider's error shape and unrecorded; the allow-list admits them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_and_loopback_callbacks_are_refused_unless_the_allow_list_names_them_cb2() {
    let receiver = Receiver::start(|_| Answer::Status(204)).await;
    let app = spawn_app(MockConfig::default(), |c| {
        callback_config(c);
        c.callbacks.allow.clear();
    })
    .await;
    for url in [
        "http://169.254.169.254/latest/meta-data/",
        receiver.url.as_str(),
        "http://localhost:9/hook",
        "http://[::ffff:127.0.0.1]:9/hook",
        "file:///etc/passwd",
    ] {
        let r = chat_with_callback(&app.http, &app.base, &chat_body(url), url, &[]).await;
        assert_eq!(r.status(), 400, "{url}");
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["error"]["code"], "invalid_callback_url", "{body}");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("holdfast-callback-url"),
            "{body}"
        );
    }
    // Anthropic's shape on its route.
    let r = app
        .post(
            "/v1/messages",
            r#"{"model":"claude-x","max_tokens":5,"messages":[{"role":"user","content":"x"}]}"#,
            &[("holdfast-callback-url", "http://169.254.169.254/")],
        )
        .await;
    assert_eq!(r.status(), 400);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["type"], "error", "{body}");
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    let listed = get_json(&app.http, &format!("{}/requests", app.base)).await;
    assert!(
        listed["data"].as_array().unwrap().is_empty(),
        "nothing recorded: {listed}"
    );
    app.stop().await;

    let app = spawn_app(MockConfig::default(), |c| {
        callback_config(c);
        c.callbacks.allow = vec!["127.0.0.1/32".into(), "169.254.169.254".into()];
    })
    .await;
    let id = told(&app, "allowed", &receiver.url).await;
    wait_callback(
        &app.http,
        &app.base,
        &id,
        "delivered",
        Duration::from_secs(10),
    )
    .await;
    let r = chat_with_callback(
        &app.http,
        &app.base,
        &chat_body("meta"),
        "http://169.254.169.254:1/x",
        &[],
    )
    .await;
    assert_eq!(r.status(), 200, "admitted by the allow-list");
    app.stop().await;
}

/// CB-2: a namespace without a signing secret cannot ask for callbacks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callback_without_a_signing_secret_is_refused_cb2() {
    let app = spawn_app(MockConfig::default(), |c| {
        callback_config(c);
        c.callbacks.secrets.clear();
    })
    .await;
    let r = chat_with_callback(
        &app.http,
        &app.base,
        &chat_body("unsigned"),
        "http://127.0.0.1:9/",
        &[],
    )
    .await;
    assert_eq!(r.status(), 400);
    let body: Value = r.json().await.unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("secret"),
        "{body}"
    );
    app.stop().await;
}

/// CB-1, CB-3: each namespace's own settings: one includes the request and its answer in its
/// webhooks and signs with its own secret; the other has the defaults (no bodies, both secrets)
/// and a default URL that serves its requests without the header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_chooses_its_bodies_secrets_and_default_url_cb1_cb3() {
    let receiver = Receiver::start(|_| Answer::Status(204)).await;
    let url = receiver.url.clone();
    let app = spawn_app(MockConfig::default(), move |c| {
        callback_config(c);
        c.namespaces = vec![
            holdfast::config::Namespace {
                name: "a".into(),
                api_keys: vec!["key-a".into()],
                callback_url: None,
                callback_secrets: vec![NEW_SECRET.into()],
                callback_include_body: Some(true),
                max_held_requests: None,
            },
            holdfast::config::Namespace {
                name: "b".into(),
                api_keys: vec!["key-b".into()],
                callback_url: Some(url),
                callback_secrets: Vec::new(),
                callback_include_body: None,
                max_held_requests: None,
            },
        ];
    })
    .await;
    let bearer = |k: &str| format!("Bearer {k}");
    let a = chat_with_callback(
        &app.http,
        &app.base,
        &chat_body("with bodies"),
        &receiver.url,
        &[("authorization", &bearer("key-a"))],
    )
    .await;
    let a = header(&a, "holdfast-request-id");
    let b = app
        .post(
            "/v1/chat/completions",
            chat_body("by default"),
            &[("authorization", &bearer("key-b"))],
        )
        .await;
    let b = header(&b, "holdfast-request-id");
    let got = receiver.wait_for(2, Duration::from_secs(10)).await;
    let of = |id: &str| {
        got.iter()
            .find(|d| d.id == format!("msg_{id}"))
            .unwrap_or_else(|| panic!("no webhook of {id}: {got:?}"))
    };
    let (da, db) = (of(&a), of(&b));
    assert_eq!(da.signature.split(' ').count(), 1, "a's own secret only");
    assert_eq!(db.signature.split(' ').count(), 2, "the default secrets");
    let data = &da.body["data"];
    assert!(data["request"]["body"]["messages"].is_array(), "{data}");
    assert!(data["answer"]["choices"].is_array(), "{data}");
    assert!(data.get("callback").is_none(), "{data}");
    assert!(db.body["data"].get("request").is_none() && db.body["data"].get("answer").is_none());
    assert_eq!(db.body["type"], "request.succeeded");
    app.stop().await;
}

/// CB-1: the namespace's default URL serves a request without the header; a duplicate that
/// attaches while it runs and one replayed after it ended (with other URLs) send no second
/// webhook: one delivery per request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_that_attach_or_replay_send_no_second_webhook_cb1() {
    let receiver = Receiver::start(|_| Answer::Status(200)).await;
    let other = Receiver::start(|_| Answer::Status(200)).await;
    let url = receiver.url.clone();
    let app = spawn_app(
        MockConfig {
            header_delay_ms: 300,
            ..MockConfig::default()
        },
        move |c| {
            callback_config(c);
            c.callbacks.url = Some(url);
        },
    )
    .await;
    let body = chat_body("once");
    let (first, attached) = tokio::join!(app.chat(&body), async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        chat_with_callback(&app.http, &app.base, &body, &other.url, &[]).await
    });
    let id = header(&first, "holdfast-request-id");
    assert_eq!(header(&attached, "holdfast-request-id"), id);
    let replayed = chat_with_callback(&app.http, &app.base, &body, &other.url, &[]).await;
    assert_eq!(header(&replayed, "idempotent-replayed"), "true");
    let record = wait_callback(
        &app.http,
        &app.base,
        &id,
        "delivered",
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(record["callback"]["url"], receiver.url.as_str());
    // The duplicates are counted by a write after their answers (DU-6), not with them.
    let record = wait_deliveries_at_least(&app.base, &id, 3).await;
    assert_eq!(record["deliveries"]["total"], 3, "{record}");
    // A later request's delivery: by then a second webhook of the first would have been due.
    let later = header(&app.chat(&chat_body("later")).await, "holdfast-request-id");
    wait_callback(
        &app.http,
        &app.base,
        &later,
        "delivered",
        Duration::from_secs(10),
    )
    .await;
    let got = receiver.deliveries();
    assert_eq!(
        got.iter().filter(|d| d.id == format!("msg_{id}")).count(),
        1,
        "{got:?}"
    );
    assert!(other.deliveries().is_empty());
    app.stop().await;
}

/// CB-4: kill -9 after the request finished, while the receiver holds the try unanswered: the
/// restarted process sends the same webhook-id again (on SQLite at once: the dead process's
/// leases are expired when the store opens, decision 60).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill9_while_a_callback_is_in_flight_sends_the_same_webhook_id_after_restart_cb4() {
    let receiver = Receiver::start(|n| {
        if n == 0 {
            Answer::Hang
        } else {
            Answer::Status(200)
        }
    })
    .await;
    let mock = start_mock(MockConfig::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("holdfast.db").display());
    let top = format!(
        "[callbacks]\nsecrets = [\"{OLD_SECRET}\"]\nallow = [\"127.0.0.0/8\"]\n\
         poll_interval_ms = 20\ntimeout_ms = 1000\nbackoff_initial_ms = 100\n"
    );
    // `top` is TOML after the top-level keys: the [callbacks] table goes last.
    let toml = format!("{}\n{top}", fault_test_toml(&db, "", 30, &mock.base_url()));
    let addr = free_addr();
    let mut node = Process::serve(dir.path(), &toml, addr).await;
    let http = reqwest::Client::new();
    let r = chat_with_callback(&http, &node.base, &chat_body("crash"), &receiver.url, &[]).await;
    assert_eq!(r.status(), 200);
    let id = header(&r, "holdfast-request-id");
    let first = receiver.wait_for(1, Duration::from_secs(10)).await;
    node.kill9();
    let mut node = Process::serve(dir.path(), &toml, addr).await;
    let got = receiver.wait_for(2, Duration::from_secs(20)).await;
    assert_eq!(got[1].id, first[0].id, "the same webhook-id");
    assert_eq!(got[1].id, format!("msg_{id}"));
    assert!(got[1].timestamp >= got[0].timestamp);
    let record = wait_callback(&http, &node.base, &id, "delivered", Duration::from_secs(10)).await;
    assert_eq!(record["callback"]["attempts"], 2, "{record}");
    node.kill9();
}

/// The `[callbacks]` table of a chaos node's TOML: the old secret, loopback allowed, fast polls
/// and retries.
pub fn chaos_callbacks_toml() -> String {
    format!(
        "[callbacks]\nsecrets = [\"{OLD_SECRET}\"]\nallow = [\"127.0.0.0/8\"]\n\
         poll_interval_ms = 50\ntimeout_ms = 2000\nbackoff_initial_ms = 100\n\
         backoff_max_ms = 1000\n"
    )
}

/// A chaos receiver: answers 500 to about one delivery in five, 200 to the rest.
pub async fn chaos_receiver() -> Receiver {
    Receiver::start(|n| {
        if n % 5 == 2 {
            Answer::Status(500)
        } else {
            Answer::Status(200)
        }
    })
    .await
}

/// What [`check_deliveries`] counted.
#[derive(Debug, Default)]
pub struct DeliveryCounts {
    /// Requests with a callback (every logged one).
    pub requests: usize,
    /// Deliveries the receiver got (tries that reached it).
    pub received: usize,
    /// Requests whose webhook reached it more than once (a kill, a 500, a lost lease).
    pub repeated: usize,
}

/// CB-4 over a chaos run: every logged request at `base` has a callback that ends delivered
/// (within 90 s), the receiver got its webhook-id, signed with [`OLD_SECRET`], and got none for
/// a request the log does not hold.
pub async fn check_deliveries(
    http: &reqwest::Client,
    base: &str,
    receiver: &Receiver,
) -> DeliveryCounts {
    use base64::Engine;
    use hmac::{Hmac, Mac};
    let start = Instant::now();
    let records = loop {
        let records = every_record(http, base).await;
        let waiting: Vec<&Value> = records
            .iter()
            .filter(|r| r["callback"]["state"] != "delivered")
            .collect();
        if waiting.is_empty() {
            break records;
        }
        assert!(
            start.elapsed() < Duration::from_secs(90),
            "{} callbacks not delivered after 90 s, e.g. {}",
            waiting.len(),
            waiting[0]
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let got = receiver.deliveries();
    let key = holdfast::config::webhook_key(OLD_SECRET).unwrap();
    for d in &got {
        let mut mac = Hmac::<sha2::Sha256>::new_from_slice(&key).unwrap();
        mac.update(format!("{}.{}.{}", d.id, d.timestamp, d.raw).as_bytes());
        let expected =
            base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes());
        assert_eq!(d.signature, format!("v1,{expected}"), "signed: {}", d.id);
    }
    let mut per_id: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    for d in &got {
        *per_id.entry(d.id.as_str()).or_default() += 1;
    }
    let ids: std::collections::HashSet<String> = records
        .iter()
        .map(|r| format!("msg_{}", r["id"].as_str().unwrap()))
        .collect();
    for record in &records {
        let id = format!("msg_{}", record["id"].as_str().unwrap());
        assert!(per_id.contains_key(id.as_str()), "never received: {record}");
    }
    for id in per_id.keys() {
        assert!(
            ids.contains(*id),
            "a webhook for a request the log does not hold: {id}"
        );
    }
    DeliveryCounts {
        requests: records.len(),
        received: got.len(),
        repeated: per_id.values().filter(|n| **n > 1).count(),
    }
}

/// CB-6: every answer that carries the record shows its `callback` member, as `GET
/// /requests/{id}` does: the 202 of `Prefer: respond-async` (RS-9), the record a cancel answers
/// (LC-9), the new record of a replay (EX-7) and the records of an export (EX-2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_answer_that_carries_the_record_shows_its_callback_cb6() {
    let receiver = Receiver::start(|_| Answer::Status(204)).await;
    let app = spawn_app(MockConfig::default(), callback_config).await;
    let url = receiver.url.as_str();
    let r = chat_with_callback(
        &app.http,
        &app.base,
        &chat_body("recorded now, told later"),
        url,
        &[("prefer", "respond-async")],
    )
    .await;
    assert_eq!(r.status(), 202);
    let accepted: Value = r.json().await.expect("the 202's record");
    assert_eq!(accepted["callback"]["url"], url, "RS-9: {accepted}");
    let id = accepted["id"].as_str().expect("id").to_string();
    wait_callback(
        &app.http,
        &app.base,
        &id,
        "delivered",
        Duration::from_secs(10),
    )
    .await;

    let cancelled: Value = app
        .http
        .post(format!("{}/requests/{id}/cancel", app.base))
        .send()
        .await
        .expect("cancel")
        .json()
        .await
        .expect("the cancel's record");
    assert_eq!(cancelled["callback"]["url"], url, "LC-9: {cancelled}");
    assert_eq!(
        cancelled["callback"]["state"], "delivered",
        "LC-9: {cancelled}"
    );

    let r = app
        .http
        .post(format!("{}/requests/{id}/replay", app.base))
        .send()
        .await
        .expect("replay");
    assert_eq!(r.status(), 201);
    let replayed: Value = r.json().await.expect("the replay's record");
    assert!(
        replayed.get("callback").is_some_and(Value::is_null),
        "EX-7: a replay asks for no callback, and says so: {replayed}"
    );

    let export = app
        .http
        .get(format!("{}/requests/export", app.base))
        .send()
        .await
        .expect("export")
        .text()
        .await
        .expect("export body");
    let lines: Vec<Value> = export
        .lines()
        .map(|l| serde_json::from_str(l).expect("an NDJSON line"))
        .collect();
    let exported = |id: &Value| {
        lines
            .iter()
            .find(|l| l["record"]["id"] == *id)
            .unwrap_or_else(|| panic!("{id} not exported: {export}"))
    };
    let original = exported(&accepted["id"]);
    assert_eq!(
        original["record"]["callback"]["url"], url,
        "EX-2: {original}"
    );
    let replay = exported(&replayed["id"]);
    assert!(
        replay["record"].get("callback").is_some_and(Value::is_null),
        "EX-2: {replay}"
    );
    app.stop().await;
}

/// CB-3, CB-4, decision 78: a webhook carrying the bodies of a request that holds a number
/// beyond a double's range (`1e400`, valid JSON, recorded) is delivered on its first try, the
/// body as a JSON string of its bytes. Before, rendering it panicked the try, which recorded no
/// outcome: the delivery was leased again at each lease expiry, forever, never giving up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_with_bodies_holding_a_number_beyond_a_doubles_range_is_delivered_cb3_cb4() {
    let body =
        r#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"huge"}],"hint":1e400}"#;
    let (app, id, record, got) = delivered_with_bodies(body).await;
    assert_eq!(record["callback"]["attempts"], 1, "{record}");
    assert_eq!(got[0].id, format!("msg_{id}"));
    assert_eq!(got[0].body["data"]["id"], id.as_str());
    assert_eq!(got[0].body["data"]["request"]["body"], body);
    app.stop().await;
}

/// Sends chat `body` with a callback, in a node whose webhooks include bodies, and waits until
/// its webhook is delivered: the node, the request's id, its record then, and what the
/// receiver got.
async fn delivered_with_bodies(body: &str) -> (TestApp, String, Value, Vec<Delivery>) {
    let receiver = Receiver::start(|_| Answer::Status(200)).await;
    let app = spawn_app(MockConfig::default(), |c| {
        callback_config(c);
        c.callbacks.include_body = true;
    })
    .await;
    let r = chat_with_callback(&app.http, &app.base, body, &receiver.url, &[]).await;
    let id = header(&r, "holdfast-request-id");
    let _ = r.bytes().await;
    let limit = Duration::from_secs(10);
    let record = wait_callback(&app.http, &app.base, &id, "delivered", limit).await;
    let got = receiver.wait_for(1, Duration::from_secs(5)).await;
    (app, id, record, got)
}

/// CB-3: with bodies included, a webhook's `data` is the record as `GET /requests/{id}
/// ?include=body` answers it, `answer_text` too (a new-user trial found it missing), without
/// its `callback` member.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_with_bodies_carries_what_get_with_include_body_answers_cb3() {
    let body = r#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"with text"}]}"#;
    let (app, id, _, got) = delivered_with_bodies(body).await;
    let data = got[0].body["data"].as_object().expect("data").clone();
    let read = get_record(&app.http, &app.base, &format!("{id}?include=body")).await;
    let mut read = read.as_object().expect("record").clone();
    read.remove("callback");
    let keys = |o: &serde_json::Map<String, serde_json::Value>| {
        o.keys().cloned().collect::<std::collections::BTreeSet<_>>()
    };
    assert_eq!(keys(&data), keys(&read), "{data:?}");
    let text = data["answer_text"].as_str().expect("answer_text");
    assert!(text.starts_with("mock reply"), "{text}");
    for member in ["answer_text", "answer", "request"] {
        assert_eq!(data[member], read[member], "{member}");
    }
    app.stop().await;
}

/// CB-7: a namespace whose receiver never answers holds at most its share of the node's
/// delivery slots, plus what it borrows while a share's worth stays free, so another
/// namespace's webhooks are delivered at once, not after the slow receiver's tries time out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_that_never_answers_does_not_delay_another_namespaces_webhooks_cb7() {
    let slow = Receiver::start(|_| Answer::Hang).await;
    let fast = Receiver::start(|_| Answer::Status(204)).await;
    let app = spawn_app(MockConfig::default(), |c| {
        callback_config(c);
        c.namespaces = two_namespaces("a", "b");
        // A try of the slow receiver outlasts the test.
        c.callbacks.timeout_ms = 120_000;
        c.callbacks.concurrency = 4;
        c.callbacks.concurrency_per_namespace = 1;
    })
    .await;
    // Namespace a alone: its share (1) and every slot but a share's worth borrowed (2).
    send_with_callbacks(&app, "key-a", &slow.url, 6).await;
    slow.wait_for(3, Duration::from_secs(10)).await;
    // Namespace b's three webhooks go through the slot kept free, long before any of a's
    // tries would end.
    send_with_callbacks(&app, "key-b", &fast.url, 3).await;
    fast.wait_for(3, Duration::from_secs(5)).await;
    assert_eq!(
        slow.deliveries().len(),
        3,
        "a borrows no slot while b could need it"
    );
    app.stop().await;
}

/// CB-7: without `[[namespaces]]` everyone is `default`, alone: its receiver may hold every
/// slot, none is kept for a namespace that does not exist.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_alone_may_use_every_delivery_slot_cb7() {
    let slow = Receiver::start(|_| Answer::Hang).await;
    let app = spawn_app(MockConfig::default(), |c| {
        callback_config(c);
        c.callbacks.timeout_ms = 120_000;
        c.callbacks.concurrency = 4;
        c.callbacks.concurrency_per_namespace = 1;
    })
    .await;
    send_with_callbacks(&app, "unused", &slow.url, 5).await;
    slow.wait_for(4, Duration::from_secs(10)).await;
    app.stop().await;
}

/// Sends `n` chats with key `key`, each with its webhook to `url`; each must answer 200.
async fn send_with_callbacks(app: &TestApp, key: &str, url: &str, n: usize) {
    for i in 0..n {
        let r = chat_with_callback(
            &app.http,
            &app.base,
            &chat_body(&format!("{key} {i}")),
            url,
            &[("authorization", &format!("Bearer {key}"))],
        )
        .await;
        assert_eq!(r.status(), 200, "{key} {i}");
    }
}
