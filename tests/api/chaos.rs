//! Chaos: a bounded workload while holdfast is SIGKILLed and restarted at random moments, then
//! a checker over the invariants of DU-1, ID-4, ID-7, LC-3, LC-8 and RD-4..RD-6. The counts are
//! printed (run with `--nocapture`) and recorded in docs/reliability.md. Every submission asks
//! for a callback: every logged request's webhook must reach the receiver, signed (CB-4).
//!
//! The workload ([`Workload`], [`run`]) and the checker ([`check`]) are shared with the cluster
//! chaos test (`multinode::chaos`), which runs them against three nodes on PostgreSQL while it
//! kills and pauses nodes and restarts the database.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::future::join_all;
use holdfast::mock::{MockConfig, MockServer};
use holdfast::sse::{SseEvent, SseParser};
use rand::Rng;
use tokio::sync::Mutex;

use crate::helpers::*;

const LOGICAL: usize = 100; // distinct bodies
const COPIES: usize = 3; // each sent this many times, concurrently
const KILLS: usize = 5;

/// No client or reader may take longer than this to finish.
const DEADLINE: Duration = Duration::from_secs(120);
/// Any one HTTP exchange longer than this is abandoned and retried, as an SDK's timeout does
/// (a paused node holds its connections until it is continued).
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(30);
/// How often the provider calls the mock recorded are collected while the workload runs (it
/// keeps the last 1,000 only, far more than arrive in this time).
const COLLECT_EVERY: Duration = Duration::from_millis(250);
/// Node log lines [`run_reporting`] prints when the workload fails.
const PROBLEM_LINES: usize = 40;

/// A bounded workload: `logical` distinct bodies (every third streaming), each sent `copies`
/// times at once by clients that retry like SDKs do, plus a log reader following every stream.
#[derive(Debug, Clone)]
pub struct Workload {
    /// Each body's content is `"{prefix} {i}"` (how the mock's record is matched to it).
    pub prefix: &'static str,
    pub logical: usize,
    pub copies: usize,
    /// Body `i` starts at `spread * i / logical` (its copies at the same moment).
    pub spread: Duration,
    /// The nodes. Copy `c` of body `i` is sent first to node `(i + c) % n`, and each retry to
    /// the next node (a load balancer in front of the cluster); a log reader reconnects to the
    /// next node too, with its `Last-Event-ID`.
    pub bases: Vec<String>,
    /// The error codes a stream broken by a fault may end with (RS-4), on which an SDK raises
    /// and retries: `attempt_abandoned` always; `store_unavailable` where the database goes away.
    pub stream_errors: &'static [&'static str],
    /// How many of a stream's clients (at most `copies`) also follow its log, each starting on
    /// the node after its client's.
    pub readers_per_stream: usize,
    /// Every submission asks for a callback to this URL (CB-1, CB-4).
    pub callback_url: Option<String>,
    /// A provider call may start before its submission's commit (ID-9, SQLite): a kill in
    /// between leaves a call for a request the log never held, made before the request that
    /// the body's retry created. Not on PostgreSQL, where the claim commits before the call.
    pub early_start: bool,
}

impl Workload {
    fn body(&self, i: usize) -> String {
        serde_json::json!({
            "model": "gpt-4o-mini",
            "stream": Workload::streams(i),
            "messages": [{"role": "user", "content": self.content(i)}],
        })
        .to_string()
    }

    fn content(&self, i: usize) -> String {
        format!("{} {i}", self.prefix)
    }

    fn streams(i: usize) -> bool {
        i.is_multiple_of(3)
    }

    pub fn base(&self, node: usize) -> &str {
        &self.bases[node % self.bases.len()]
    }
}

/// One client's body, the id it ended with, and what its log reader read (id and events).
type ClientResult = (usize, String, Option<(String, Vec<SseEvent>)>);

/// What the workload saw.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Every request id each body's clients were given (the checker wants exactly one).
    ids: HashMap<usize, HashSet<String>>,
    /// Per client: its body, the id it ended with, and (one client per stream) what its log
    /// reader read.
    results: Vec<ClientResult>,
    /// Answers that made a client send again: broken connections, timeouts, 5xx, streams that
    /// ended with an error event.
    pub retries: u64,
    /// Log reader reconnections.
    pub reconnects: u64,
    /// Every provider call's body content, by the mock's call number.
    calls: ProviderCalls,
    /// Per body, the mock's call count when a client first held its complete answer (a
    /// stream's final event, or a non-stream answer): no call for the body may come after it
    /// (RS-12).
    answered: HashMap<usize, u64>,
}

/// The provider calls the mock recorded, collected while the workload runs: by call number,
/// the content of the call's first message and when the call arrived (Unix ms).
#[derive(Debug, Default)]
struct ProviderCalls {
    by_number: std::collections::BTreeMap<u64, (String, i64)>,
    /// Whether a collection found calls gone that were never collected (then per-body call
    /// counts are not known, only the total).
    missed: bool,
}

impl ProviderCalls {
    fn collect(&mut self, mock: &MockServer) {
        let recorded = mock.recorded();
        let next = self.by_number.keys().next_back().map_or(1, |n| n + 1);
        if recorded.first().is_some_and(|c| c.n > next) {
            self.missed = true;
        }
        for call in recorded {
            let content = call.body["messages"][0]["content"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            self.by_number.insert(call.n, (content, call.at_ms));
        }
    }
}

/// The HTTP client of the workload and the checker: no pooled connections (a restarted node
/// must not inherit a dead one), and [`EXCHANGE_TIMEOUT`].
pub fn chaos_http() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .timeout(EXCHANGE_TIMEOUT)
        .build()
        .unwrap()
}

/// Runs the workload to its end: every client has a complete answer, every reader its `end`.
/// Collects `mock`'s provider calls meanwhile.
pub async fn run(workload: &Workload, mock: &MockServer) -> Outcome {
    let http = chaos_http();
    let ids: Arc<Mutex<HashMap<usize, HashSet<String>>>> = Arc::default();
    let retries = Arc::new(AtomicU64::new(0));
    let reconnects = Arc::new(AtomicU64::new(0));
    let answered: Arc<std::sync::Mutex<HashMap<usize, u64>>> = Arc::default();
    let clients = (0..workload.logical * workload.copies).map(|n| {
        let (http, ids) = (http.clone(), Arc::clone(&ids));
        let answered = Arc::clone(&answered);
        let (retries, reconnects) = (Arc::clone(&retries), Arc::clone(&reconnects));
        async move {
            let i = n % workload.logical;
            let copy = n / workload.logical;
            tokio::time::sleep(workload.spread.mul_f64(i as f64 / workload.logical as f64)).await;
            // The mock's call count once this client holds the answer.
            let answered = |_: &str| {
                let calls = mock.calls();
                let mut answered = answered.lock().unwrap();
                let first = answered.entry(i).or_insert(calls);
                *first = (*first).min(calls);
            };
            if !(Workload::streams(i) && copy < workload.readers_per_stream) {
                let id = client(&http, workload, i, copy, ids, &retries, None).await;
                answered(&id);
                return (i, id, None);
            }
            // A reader follows the stream live from the moment its id is known, on another
            // node than the client's.
            let (tx, rx) = tokio::sync::oneshot::channel();
            let (id, events) = tokio::join!(
                async {
                    let id = client(&http, workload, i, copy, ids, &retries, Some(tx)).await;
                    answered(&id);
                    id
                },
                async {
                    let id = rx.await.expect("the client learns an id");
                    let first = i + copy + 1;
                    let events = log_reader(&http, workload, first, &id, &reconnects).await;
                    (id, events)
                }
            );
            (i, id, Some(events))
        }
    });
    let mut calls = ProviderCalls::default();
    let results = {
        let mut clients = std::pin::pin!(join_all(clients));
        let mut tick = tokio::time::interval(COLLECT_EVERY);
        loop {
            tokio::select! {
                results = &mut clients => break results,
                _ = tick.tick() => calls.collect(mock),
            }
        }
    };
    let ids = std::mem::take(&mut *ids.lock().await);
    let answered = std::mem::take(&mut *answered.lock().unwrap());
    Outcome {
        ids,
        calls,
        answered,
        results,
        retries: retries.load(Ordering::SeqCst),
        reconnects: reconnects.load(Ordering::SeqCst),
    }
}

/// [`run`], telling what went wrong if the workload panics: the warnings and errors the nodes
/// logged (every `*.log` under `logs`), then the panic's message once more, last, where a
/// shortened test output still shows it (the first report is above the node logs and the
/// backtrace).
pub async fn run_reporting(workload: &Workload, mock: &MockServer, logs: &Path) -> Outcome {
    use futures::FutureExt;
    match std::panic::AssertUnwindSafe(run(workload, mock))
        .catch_unwind()
        .await
    {
        Ok(outcome) => outcome,
        Err(payload) => {
            print_node_problems(logs);
            let message = payload
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| payload.downcast_ref::<&str>().copied())
                .unwrap_or("(a panic without a message)");
            eprintln!("chaos: the workload failed: {message}");
            std::panic::resume_unwind(payload)
        }
    }
}

/// Prints the `WARN` and `ERROR` lines of every `*.log` under `dir`, and the lines of a node
/// that could not start (`holdfast: ...`), at most [`PROBLEM_LINES`].
fn print_node_problems(dir: &Path) {
    let mut logs = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for entry in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "log") {
                logs.push(path);
            }
        }
    }
    logs.sort();
    let mut printed = 0;
    for log in logs {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        for line in text
            .lines()
            .filter(|l| l.contains(" WARN ") || l.contains(" ERROR ") || l.starts_with("holdfast:"))
        {
            if printed == PROBLEM_LINES {
                eprintln!("chaos: (more node warnings left out)");
                return;
            }
            eprintln!("chaos: {}: {line}", log.display());
            printed += 1;
        }
    }
}

/// A client that behaves like an SDK: on a broken connection, a timeout, a 5xx that says
/// retry, or an abandoned stream, it sends the same body again (to the next node). Returns the
/// request id it ended with; the first id it is given goes to `first_id`.
#[allow(clippy::too_many_arguments)]
async fn client(
    http: &reqwest::Client,
    workload: &Workload,
    i: usize,
    copy: usize,
    ids: Arc<Mutex<HashMap<usize, HashSet<String>>>>,
    retries: &AtomicU64,
    mut first_id: Option<tokio::sync::oneshot::Sender<String>>,
) -> String {
    let start = Instant::now();
    for attempt in 0.. {
        assert!(start.elapsed() < DEADLINE, "client {i} never finished");
        if attempt > 0 {
            retries.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let base = workload.base(i + copy + attempt);
        let mut request = http
            .post(format!("{base}/v1/chat/completions"))
            .header("content-type", "application/json");
        if let Some(url) = &workload.callback_url {
            request = request.header("holdfast-callback-url", url);
        }
        let sent = request.body(workload.body(i)).send().await;
        let Ok(response) = sent else {
            continue;
        };
        let id = header(&response, "holdfast-request-id");
        if !id.is_empty() {
            ids.lock().await.entry(i).or_default().insert(id.clone());
            if let Some(tx) = first_id.take() {
                let _ = tx.send(id.clone());
            }
        }
        let status = response.status().as_u16();
        let Ok(bytes) = response.bytes().await else {
            continue; // killed mid-answer, or timed out
        };
        if status != 200 {
            assert!(
                status >= 500,
                "client {i}: unexpected {status}: {}",
                String::from_utf8_lossy(&bytes)
            );
            continue;
        }
        if Workload::streams(i) {
            let text = String::from_utf8_lossy(&bytes);
            if !text.contains("data: [DONE]") {
                assert!(
                    workload.stream_errors.iter().any(|e| text.contains(e)),
                    "client {i}: a broken stream must say why ({:?}): {text}",
                    workload.stream_errors
                );
                continue;
            }
        }
        return id;
    }
    unreachable!()
}

/// A log reader that follows `GET /requests/{id}` across restarts with `Last-Event-ID`, each
/// reconnection on the next node.
async fn log_reader(
    http: &reqwest::Client,
    workload: &Workload,
    first_node: usize,
    id: &str,
    reconnects: &AtomicU64,
) -> Vec<SseEvent> {
    let mut events: Vec<SseEvent> = Vec::new();
    let start = Instant::now();
    for connection in 0.. {
        assert!(
            start.elapsed() < DEADLINE,
            "log reader of {id} never finished"
        );
        if connection > 0 {
            reconnects.fetch_add(1, Ordering::SeqCst);
        }
        let base = workload.base(first_node + connection);
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
    unreachable!()
}

/// The numbers of the provider calls with `content` made after call `after`.
fn calls_after(
    by_number: &std::collections::BTreeMap<u64, (String, i64)>,
    after: u64,
    content: &str,
) -> Vec<u64> {
    by_number
        .range(after + 1..)
        .filter(|(_, (c, _))| c.as_str() == content)
        .map(|(n, _)| *n)
        .collect()
}

/// The checker's counts of one run.
#[derive(Debug, Default)]
pub struct Counts {
    /// Requests the clients sent (first sends, not retries).
    pub sent: usize,
    /// Requests in the log (one per body when the claim window held).
    pub logged: usize,
    /// Attempts, recoveries and `reset` chunks over every logged request.
    pub attempts: u64,
    pub recoveries: u64,
    pub resets: u64,
    /// Provider calls the mock answered.
    pub provider_calls: u64,
    /// Of them, calls for a body made before its request existed: submissions a kill cut off
    /// between their early start and their commit (ID-9).
    pub orphan_calls: u64,
    /// Log readers and the events they read.
    pub readers: usize,
    pub reader_events: usize,
    /// Logged requests no client was told about.
    pub unknown_to_clients: usize,
    /// How long after the faults stopped every logged request was terminal.
    pub settled: Duration,
}

/// Checks the invariants after a run (the faults have stopped; every node answers) and
/// returns the counts; panics on the first violation:
/// - every logged request reaches a terminal status (within 90 s), every body's ends
///   `succeeded`;
/// - all copies and retries of one body landed on one request (ID-4, ID-7);
/// - provider calls ≤ attempts, per body and in total: an attempt calls the provider at most
///   once, and a node fenced out of a request (LC-3) does not call again;
/// - once a client held a body's complete answer, the provider is not called for it again
///   (RS-12: a stream's final event reaches a client only after its outcome is committed);
/// - `reset` chunks ≤ recoveries (LC-8);
/// - a stream's stored log after its last `reset` is exactly the provider's answer (the mock,
///   asked again at the end, answers a body with the same text): nothing of a fenced-off
///   attempt in it, nothing lost (LC-3, DU-1);
/// - every log reader's sequence across reconnects has consecutive seqs and equals the stored
///   log from where it started (RD-4..RD-6).
///
/// Records are read from every node in turn.
pub async fn check(workload: &Workload, outcome: Outcome, mock: &MockServer) -> Counts {
    let http = chaos_http();
    let mut counts = Counts {
        sent: workload.logical * workload.copies,
        provider_calls: mock.calls(),
        ..Counts::default()
    };

    // Every logged request terminal (including any no client learned of).
    let (records, settled) = every_record_terminal(&http, workload.base(0)).await;
    counts.settled = settled;
    counts.logged = records.len();
    for record in &records {
        counts.attempts += record["attempts"].as_u64().unwrap();
        counts.recoveries += record["recoveries"].as_u64().unwrap();
        let id = record["id"].as_str().unwrap();
        if !outcome.ids.values().any(|seen| seen.contains(id)) {
            counts.unknown_to_clients += 1;
            println!("chaos: request no client learned of: {record}");
        }
    }

    // Per body.
    let mut calls = outcome.calls;
    calls.collect(mock);
    let per_body_calls = !calls.missed;
    // Each body's calls, by arrival time.
    let mut calls_by_content: HashMap<String, Vec<i64>> = HashMap::new();
    for (content, at_ms) in calls.by_number.values() {
        calls_by_content
            .entry(content.clone())
            .or_default()
            .push(*at_ms);
    }
    let calls_by_number = calls.by_number;
    let mut final_texts: Vec<(usize, String, String)> = Vec::new();
    for i in 0..workload.logical {
        let seen = &outcome.ids[&i];
        assert_eq!(
            seen.len(),
            1,
            "duplicates and retries of body {i} all landed on one request: {seen:?}"
        );
        let id = seen.iter().next().unwrap();
        let base = workload.base(i);
        let record = get_record(&http, base, id).await;
        assert_eq!(
            record["status"], "succeeded",
            "every accepted request ends terminal: {record}"
        );
        let attempts = record["attempts"].as_u64().unwrap();
        let created_at = chrono::DateTime::parse_from_rfc3339(
            record["created_at"].as_str().expect("created_at"),
        )
        .expect("created_at is RFC 3339")
        .timestamp_millis();
        let arrivals = calls_by_content
            .get(&workload.content(i))
            .map_or(&[][..], Vec::as_slice);
        // Calls that arrived before the request existed were made for a submission the log
        // never held: allowed only where an attempt may start before its commit (ID-9).
        let orphans = arrivals.iter().filter(|&&at| at < created_at).count() as u64;
        let calls = arrivals.len() as u64 - orphans;
        if per_body_calls {
            assert!(
                orphans == 0 || workload.early_start,
                "body {i}: {orphans} upstream calls before its request {id} was created \
                 ({record})"
            );
            counts.orphan_calls += orphans;
            assert!(
                calls >= 1 && calls <= attempts,
                "body {i}: {calls} upstream calls for {attempts} attempts (and {orphans} calls \
                 before its request existed)"
            );
            // RS-12: once a client held the complete answer, the request never ran again.
            let answered_at = outcome.answered[&i];
            let content = workload.content(i);
            let later: Vec<u64> = calls_after(&calls_by_number, answered_at, &content);
            assert!(
                later.is_empty(),
                "body {i}: provider calls {later:?} after a client held its answer (call {answered_at})"
            );
        }
        if Workload::streams(i) {
            let full = get_events(&http, base, id, Some("0")).await;
            let (_, log) = read_events(full).await;
            let resets = log
                .iter()
                .filter(|e| e.event.as_deref() == Some("reset"))
                .count() as u64;
            // The attempt that succeeded: everything after the last `reset`.
            let last_reset = log
                .iter()
                .rposition(|e| e.event.as_deref() == Some("reset"))
                .map_or(0, |p| p + 1);
            final_texts.push((i, id.clone(), openai_text(&log[last_reset..])));
            counts.resets += resets;
            assert!(
                resets <= record["recoveries"].as_u64().unwrap(),
                "{id}: a reset only where an attempt was abandoned: {resets} resets, {record}"
            );
        }
    }

    // Per log reader.
    for (i, id, log) in outcome.results {
        assert_eq!(outcome.ids[&i].iter().next(), Some(&id));
        let Some((id, events)) = log else { continue };
        counts.readers += 1;
        counts.reader_events += events.len();
        // The reader's sequence, across reconnects, is the stored log from where it started:
        // consecutive seqs, no duplicate, ending with `end` — and where it reconnected from
        // inside an attempt abandoned meanwhile, the latest `reset` next (RD-6): the rest of
        // the abandoned attempt is skipped, so the only gap allowed is one a `reset` ends.
        let seqs: Vec<i64> = events
            .iter()
            .map(|e| e.id.as_deref().unwrap().parse().unwrap())
            .collect();
        for (k, w) in seqs.windows(2).enumerate() {
            let resumed_at_reset =
                w[1] > w[0] + 1 && events[k + 1].event.as_deref() == Some("reset");
            assert!(
                w[1] == w[0] + 1 || resumed_at_reset,
                "{id}: seqs {seqs:?} (after {} comes {}, not a reset)",
                w[0],
                w[1]
            );
        }
        assert_eq!(
            events.last().and_then(|e| e.event.as_deref()),
            Some("end"),
            "{id}: the reader ends with `end`"
        );
        // Read back from where the reader started. A position inside an abandoned attempt
        // resumes at the latest `reset` (RD-6), so the stored log read back may start later
        // than the reader did: compare from the first seq the read-back holds.
        let base = workload.base(i + 2);
        let full = get_events(&http, base, &id, Some(&(seqs[0] - 1).to_string())).await;
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
    // The stored stream of the attempt that succeeded is exactly the provider's answer: no
    // chunk of a fenced-off attempt in it, none lost (LC-3, DU-1). The mock answers a body
    // with the same text every time; asked again here, after the calls were counted.
    let references = join_all(final_texts.iter().map(|(i, _, _)| {
        let http = http.clone();
        let body = workload.body(*i);
        let url = format!("{}/chat/completions", mock.base_url());
        async move {
            let response = http
                .post(url)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .expect("the mock answers");
            openai_text(&read_events(response).await.1)
        }
    }))
    .await;
    for ((i, id, stored), reference) in final_texts.iter().zip(references) {
        assert!(
            !reference.is_empty(),
            "the mock's answer to body {i} has text"
        );
        assert_eq!(
            stored, &reference,
            "body {i} ({id}): the stored stream after its last reset is the provider's answer"
        );
    }
    assert!(
        counts.provider_calls <= counts.attempts + counts.orphan_calls,
        "each attempt called the provider at most once: {} calls, {} attempts, {} calls for \
         submissions a kill cut off before their commit (ID-9)",
        counts.provider_calls,
        counts.attempts,
        counts.orphan_calls
    );
    if !per_body_calls {
        println!(
            "chaos: the mock dropped calls before they were collected: {} provider calls checked \
             in total only",
            counts.provider_calls
        );
    }
    counts
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
    let db = format!("sqlite://{}", dir.path().join("holdfast.db").display());
    let toml = fault_test_toml(
        &db,
        &crate::callbacks::chaos_callbacks_toml(),
        1,
        &mock.base_url(),
    );
    let receiver = crate::callbacks::chaos_receiver().await;
    let addr: SocketAddr = free_addr();
    // Each run of the node logs to a file of its own (a failure prints their warnings).
    let log = |dir: &Path, run: usize| dir.join(format!("holdfast-{run}.log"));
    let node = Arc::new(Mutex::new(
        Process::serve_logged_to(dir.path(), &toml, addr, log(dir.path(), 0)).await,
    ));
    let workload = Workload {
        prefix: "chaos",
        logical: LOGICAL,
        copies: COPIES,
        spread: Duration::from_secs(3),
        bases: vec![format!("http://{addr}")],
        stream_errors: &["attempt_abandoned"],
        readers_per_stream: 1,
        callback_url: Some(receiver.url.clone()),
        early_start: true,
    };

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
                *guard = Process::serve_logged_to(&dir, &toml, addr, log(&dir, kills)).await;
            }
            kills
        })
    };

    let outcome = run_reporting(&workload, &mock, dir.path()).await;
    done.store(true, Ordering::SeqCst);
    let kills = killer.await.unwrap();
    let retries = outcome.retries;
    let counts = check(&workload, outcome, &mock).await;
    let told =
        crate::callbacks::check_deliveries(&chaos_http(), &format!("http://{addr}"), &receiver)
            .await;
    println!(
        "chaos: requests={} (logical {LOGICAL} x {COPIES}) kills={kills} logged={} attempts={} \
         recoveries={} resets={} upstream_calls={} calls_cut_off_before_commit={} \
         client_retries={retries} readers={} callbacks={} webhooks_received={} \
         webhook_ids_repeated={} violations=0",
        counts.sent,
        counts.logged,
        counts.attempts,
        counts.recoveries,
        counts.resets,
        counts.provider_calls,
        counts.orphan_calls,
        counts.readers,
        told.requests,
        told.received,
        told.repeated,
    );
    assert_eq!(kills, KILLS);
    drop(node);
    mock.shutdown().await;
}
