//! Chaos: a bounded workload while holdfast is SIGKILLed and restarted at random moments, then
//! a checker over the invariants of DU-1, ID-4, ID-7, LC-3, LC-8 and RD-4..RD-6. The counts are
//! printed (run with `--nocapture`) and recorded in docs/reliability.md.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use futures::future::join_all;
use holdfast::mock::MockConfig;
use holdfast::sse::{SseEvent, SseParser};
use rand::Rng;
use tokio::sync::Mutex;

use crate::helpers::*;

const LOGICAL: usize = 100; // distinct bodies
const COPIES: usize = 3; // each sent this many times, concurrently
const KILLS: usize = 5;
const DEADLINE: Duration = Duration::from_secs(120);

fn body(i: usize) -> String {
    serde_json::json!({
        "model": "gpt-4o-mini",
        "stream": i.is_multiple_of(3),
        "messages": [{"role": "user", "content": format!("chaos {i}")}],
    })
    .to_string()
}

/// A client that behaves like an SDK: on a broken connection, a 5xx that says retry, or an
/// abandoned stream, it sends the same body again. Returns the request id it ended with.
async fn client(
    http: reqwest::Client,
    base: String,
    i: usize,
    ids: Arc<Mutex<HashMap<usize, HashSet<String>>>>,
) -> String {
    let start = Instant::now();
    loop {
        assert!(start.elapsed() < DEADLINE, "client {i} never finished");
        let sent = http
            .post(format!("{base}/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(body(i))
            .send()
            .await;
        let Ok(response) = sent else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let id = header(&response, "holdfast-request-id");
        if !id.is_empty() {
            ids.lock().await.entry(i).or_default().insert(id.clone());
        }
        let status = response.status().as_u16();
        let Ok(bytes) = response.bytes().await else {
            continue; // killed mid-answer
        };
        if status != 200 {
            assert!(
                status >= 500,
                "client {i}: unexpected {status}: {}",
                String::from_utf8_lossy(&bytes)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        if i.is_multiple_of(3) {
            let text = String::from_utf8_lossy(&bytes);
            if !text.contains("data: [DONE]") {
                assert!(
                    text.contains("attempt_abandoned"),
                    "client {i}: a broken stream must say why: {text}"
                );
                continue;
            }
        }
        return id;
    }
}

/// A log reader that follows `GET /requests/{id}` across restarts with `Last-Event-ID`.
async fn log_reader(http: reqwest::Client, base: String, id: String) -> Vec<SseEvent> {
    let mut events: Vec<SseEvent> = Vec::new();
    let start = Instant::now();
    loop {
        assert!(
            start.elapsed() < DEADLINE,
            "log reader of {id} never finished"
        );
        let position = events.last().and_then(|e| e.id.clone());
        let mut req = http
            .get(format!("{base}/requests/{id}"))
            .header("accept", "text/event-stream");
        if let Some(p) = &position {
            req = req.header("last-event-id", p);
        }
        let Ok(mut response) = req.send().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        if response.status() == 204 {
            return events;
        }
        if response.status() != 200 {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        let mut parser = SseParser::new();
        while let Ok(Some(piece)) = response.chunk().await {
            for event in parser.push(&piece).expect("holdfast sends valid SSE") {
                let end = event.event.as_deref() == Some("end");
                events.push(event);
                if end {
                    return events;
                }
            }
        }
    }
}

#[tokio::test]
async fn chaos_sigkill_restarts_keep_every_invariant_du1() {
    let mock = start_mock(MockConfig {
        chunks: 10,
        chunk_delay_ms: 20,
        header_delay_ms: 50,
        ..MockConfig::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let toml = format!(
        r#"
database_url = "sqlite://{db}"
[workers]
lease_secs = 1
sweep_interval_ms = 100
max_attempts = 50
backoff_initial_ms = 20
backoff_max_ms = 200
[[backends]]
name = "mock"
kind = "openai"
base_url = "{mock}"
"#,
        db = dir.path().join("holdfast.db").display(),
        mock = mock.base_url()
    );
    let addr: SocketAddr = free_addr();
    let base = format!("http://{addr}");
    let node = Arc::new(Mutex::new(Process::serve(dir.path(), &toml, addr).await));
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let ids: Arc<Mutex<HashMap<usize, HashSet<String>>>> = Arc::default();

    // The killer: SIGKILL at random moments, restart on the same address at once.
    let done = Arc::new(AtomicBool::new(false));
    let killer = {
        let node = Arc::clone(&node);
        let done = Arc::clone(&done);
        let dir = dir.path().to_path_buf();
        let toml = toml.clone();
        tokio::spawn(async move {
            let mut kills = 0;
            while kills < KILLS && !done.load(Ordering::SeqCst) {
                let pause = rand::rng().random_range(100..500);
                tokio::time::sleep(Duration::from_millis(pause)).await;
                let mut guard = node.lock().await;
                guard.kill9();
                kills += 1;
                *guard = Process::serve(&dir, &toml, addr).await;
            }
            kills
        })
    };

    // The workload: every body COPIES times at once, plus a log reader per stream.
    let clients = (0..LOGICAL * COPIES).map(|n| {
        let (http, base, ids) = (http.clone(), base.clone(), Arc::clone(&ids));
        async move {
            tokio::time::sleep(Duration::from_millis((n as u64 % 100) * 30)).await;
            let i = n % LOGICAL;
            let id = client(http.clone(), base.clone(), i, ids).await;
            let log = if i.is_multiple_of(3) && n < LOGICAL {
                Some((id.clone(), log_reader(http, base, id.clone()).await))
            } else {
                None
            };
            (i, id, log)
        }
    });
    let results = join_all(clients).await;
    done.store(true, Ordering::SeqCst);
    let kills = killer.await.unwrap();

    // Checker.
    let ids = ids.lock().await;
    let (mut attempts, mut recoveries, mut resets) = (0u64, 0u64, 0usize);
    let mut calls_by_content: HashMap<String, u64> = HashMap::new();
    for call in mock.recorded() {
        let content = call.body["messages"][0]["content"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        *calls_by_content.entry(content).or_default() += 1;
    }
    for i in 0..LOGICAL {
        let seen = &ids[&i];
        assert_eq!(
            seen.len(),
            1,
            "duplicates and retries of body {i} all landed on one request: {seen:?}"
        );
        let id = seen.iter().next().unwrap();
        let record = get_record(&http, &base, id).await;
        assert_eq!(
            record["status"], "succeeded",
            "every accepted request ends terminal: {record}"
        );
        let a = record["attempts"].as_u64().unwrap();
        attempts += a;
        recoveries += record["recoveries"].as_u64().unwrap();
        let calls = calls_by_content
            .get(&format!("chaos {i}"))
            .copied()
            .unwrap_or(0);
        assert!(
            calls >= 1 && calls <= a,
            "body {i}: {calls} upstream calls for {a} attempts"
        );
        if i.is_multiple_of(3) {
            let full = get_events(&http, &base, id, Some("0")).await;
            let (_, log) = read_events(full).await;
            resets += log
                .iter()
                .filter(|e| e.event.as_deref() == Some("reset"))
                .count();
            assert!(
                log.iter()
                    .filter(|e| e.event.as_deref() == Some("reset"))
                    .count() as u64
                    <= record["recoveries"].as_u64().unwrap(),
                "a reset only where an attempt was abandoned"
            );
        }
    }
    for (i, id, log) in results {
        assert_eq!(ids[&i].iter().next(), Some(&id));
        let Some((id, events)) = log else { continue };
        // The reader's sequence, across reconnects, is the stored log from where it started:
        // consecutive seqs, no gap, no duplicate, ending with `end`.
        let seqs: Vec<i64> = events
            .iter()
            .map(|e| e.id.as_deref().unwrap().parse().unwrap())
            .collect();
        assert!(
            seqs.windows(2).all(|w| w[1] == w[0] + 1),
            "{id}: seqs {seqs:?}"
        );
        // Read back from where the reader started. A position inside an abandoned attempt
        // resumes at the latest `reset` (RD-6), so the stored log read back may start later
        // than the reader did: compare from the first seq the read-back holds.
        let full = get_events(&http, &base, &id, Some(&(seqs[0] - 1).to_string())).await;
        let (_, stored) = read_events(full).await;
        let from: i64 = stored
            .first()
            .and_then(|e| e.id.as_deref())
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("{id}: nothing stored after {}", seqs[0] - 1));
        assert!(
            seqs.contains(&from),
            "{id}: the read-back starts at {from}, which the reader never saw ({seqs:?})"
        );
        let stored: Vec<(Option<String>, String)> =
            stored.into_iter().map(|e| (e.event, e.data)).collect();
        let got: Vec<(Option<String>, String)> = events
            .into_iter()
            .zip(&seqs)
            .filter(|(_, seq)| **seq >= from)
            .map(|(e, _)| (e.event, e.data))
            .collect();
        assert_eq!(got, stored, "{id}: the reader saw exactly the stored log");
    }
    // Every request in the log, including any a client never learned the id of.
    let (mut logged_attempts, mut cursor) = (0u64, None::<String>);
    for _page in 0..100 {
        let mut url = format!("{base}/requests?limit=500");
        if let Some(c) = &cursor {
            url.push_str(&format!("&cursor={c}"));
        }
        let page: serde_json::Value = http.get(&url).send().await.unwrap().json().await.unwrap();
        for record in page["data"].as_array().unwrap() {
            logged_attempts += record["attempts"].as_u64().unwrap();
            let id = record["id"].as_str().unwrap();
            if !ids.values().any(|seen| seen.contains(id)) {
                println!("chaos: request no client learned of: {record}");
            }
        }
        cursor = page["next_cursor"].as_str().map(str::to_owned);
        if cursor.is_none() {
            break;
        }
    }
    let upstream = mock.calls();
    println!("chaos: attempts of every logged request: {logged_attempts}");
    println!(
        "chaos: requests={} (logical {LOGICAL} x {COPIES}) kills={kills} attempts={attempts} recoveries={recoveries} resets={resets} upstream_calls={upstream}",
        LOGICAL * COPIES
    );
    assert!(
        upstream <= logged_attempts,
        "each attempt called the provider at most once: {upstream} calls, {logged_attempts} attempts"
    );
    assert_eq!(kills, KILLS);
    drop(node);
    mock.shutdown().await;
}
