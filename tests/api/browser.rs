//! A real browser's EventSource against `GET /requests/{id}` (RD-2..RD-6): headless Chromium
//! (Debian package `chromium`), resuming after the server drops the connection and stopping at
//! the 204. The web page at `/ui` is driven in [`ui`], over the DevTools protocol ([`cdp`]).
//!
//! The page is served by a small front server on loopback that also forwards `/requests/...` to
//! holdfast (so the page and the stream share an origin) and drops the first stream connection
//! after ten events.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use futures::StreamExt;
use holdfast::mock::MockConfig;
use tokio::sync::mpsc;

use crate::helpers::*;

mod cdp;
mod ui;

const CHROMIUM: &str = "/usr/bin/chromium";

#[derive(Clone)]
struct Front {
    holdfast: String,
    request_id: String,
    connects: Arc<AtomicUsize>,
    report: mpsc::UnboundedSender<String>,
}

async fn page(State(front): State<Front>) -> Html<String> {
    Html(format!(
        r#"<!doctype html><title>holdfast EventSource</title><script>
const got = []; let opens = 0;
const es = new EventSource('/requests/{id}');
es.onopen = () => {{ opens++; }};
const keep = (e) => got.push({{id: e.lastEventId, type: e.type, data: e.data}});
es.onmessage = keep;
es.addEventListener('reset', keep);
es.addEventListener('end', keep);
es.onerror = () => {{
  if (es.readyState === EventSource.CLOSED) {{
    fetch('/report', {{method: 'POST', body: JSON.stringify({{got, opens}})}});
  }}
}};
</script>"#,
        id = front.request_id
    ))
}

async fn report(State(front): State<Front>, body: String) -> StatusCode {
    let _ = front.report.send(body);
    StatusCode::NO_CONTENT
}

/// Forwards to holdfast; the first connection is cut after ten events.
async fn forward(
    State(front): State<Front>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let n = front.connects.fetch_add(1, Ordering::SeqCst);
    let mut req = reqwest::Client::new()
        .get(format!("{}/requests/{id}", front.holdfast))
        .header("accept", "text/event-stream");
    if let Some(v) = headers.get("last-event-id") {
        req = req.header("last-event-id", v.as_bytes());
    }
    let upstream = req.send().await.expect("holdfast answers");
    let status = upstream.status();
    if status == 204 {
        return StatusCode::NO_CONTENT.into_response();
    }
    let mut bytes = upstream.bytes_stream();
    let body = async_stream::stream! {
        let mut events = 0;
        while let Some(piece) = bytes.next().await {
            let Ok(piece) = piece else { break };
            events += piece.windows(2).filter(|w| w == b"\n\n").count();
            yield Ok::<_, std::io::Error>(piece);
            if n == 0 && events >= 10 {
                yield Err(std::io::Error::other("front drops the first connection"));
                return;
            }
        }
    };
    (
        [
            ("content-type", "text/event-stream"),
            ("cache-control", "no-cache"),
        ],
        Body::from_stream(body),
    )
        .into_response()
}

/// Fails the calling test unless Debian's Chromium is installed.
#[track_caller]
fn require_chromium() {
    if !std::path::Path::new(CHROMIUM).exists() {
        missing_dependency(
            "browser",
            &format!("{CHROMIUM} is not installed"),
            "apt-get install chromium (Debian's package; scripts/test installs it when run as root)",
        );
    }
}

#[tokio::test]
async fn browser_eventsource_resumes_after_a_dropped_connection_and_stops_at_204_rd3_rd5() {
    require_chromium();
    let app = spawn_app(
        MockConfig {
            chunks: 40,
            chunk_delay_ms: 30,
            ..MockConfig::default()
        },
        |_| {},
    )
    .await;
    let r = app
        .post(
            "/v1/chat/completions",
            stream_body("for the browser"),
            &[("prefer", "respond-async")],
        )
        .await;
    let request_id = header(&r, "holdfast-request-id");

    let (tx, mut rx) = mpsc::unbounded_channel();
    let front = Front {
        holdfast: app.base.clone(),
        request_id: request_id.clone(),
        connects: Arc::default(),
        report: tx,
    };
    let connects = Arc::clone(&front.connects);
    let router = Router::new()
        .route("/", get(page))
        .route("/report", post(report))
        .route("/requests/{id}", get(forward))
        .with_state(front);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let front_addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await });

    let profile = tempfile::tempdir().unwrap();
    let mut browser = Command::new(CHROMIUM)
        .args([
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg(format!("http://{front_addr}/"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start chromium");
    let reported = tokio::time::timeout(Duration::from_secs(90), rx.recv()).await;
    let _ = browser.kill();
    let _ = browser.wait();
    let reported: serde_json::Value =
        serde_json::from_str(&reported.expect("the page reports").expect("report")).unwrap();

    let got = reported["got"].as_array().unwrap();
    let ids: Vec<i64> = got
        .iter()
        .map(|e| e["id"].as_str().unwrap().parse().unwrap())
        .collect();
    assert!(
        ids.len() > 10,
        "the stream went on after the drop: {reported}"
    );
    assert_eq!(
        ids,
        (1..=ids.len() as i64).collect::<Vec<_>>(),
        "no gap, no duplicate across the reconnect"
    );
    assert_eq!(got.last().unwrap()["type"], "end");
    assert_eq!(
        reported["opens"], 2,
        "one reconnect after the drop; the 204 opens nothing"
    );

    // The stored log, read directly, is exactly what the browser assembled.
    let full = get_events(&app.http, &app.base, &request_id, Some("0")).await;
    let (_, stored) = read_events(full).await;
    let stored: Vec<&str> = stored.iter().map(|e| e.data.as_str()).collect();
    let browser_data: Vec<&str> = got.iter().map(|e| e["data"].as_str().unwrap()).collect();
    assert_eq!(browser_data, stored);
    assert_eq!(
        connects.load(Ordering::SeqCst),
        3,
        "first, after the drop, and the 204 that stops it"
    );
    app.stop().await;
}
