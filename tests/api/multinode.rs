//! Several `holdfast serve` processes on one PostgreSQL database (SPEC DU-3): any node accepts,
//! any worker executes, any node live-tails, a dead node's lease is recovered by the others,
//! and lost LISTEN/NOTIFY wake-ups only cost latency (polling covers them).
//!
//! Each test creates a fresh database (`store_conformance::TestDatabase`) and starts real child
//! processes in front of one mock provider. Without a reachable PostgreSQL the tests fail, naming
//! it (`scripts/test` starts the local server; `HOLDFAST_TEST_SKIP=postgres` opts out of them).

use std::sync::Arc;
use std::time::{Duration, Instant};

use holdfast::mock::{MockConfig, MockServer};
use holdfast::provider::Route;
use holdfast::sse::{SseEvent, SseParser};
use holdfast::store::postgres::{IDS_PER_NOTIFY, PostgresStore};
use holdfast::store::{
    ChunkBatch, ClaimKind, Lease, NewChunk, NewRequest, Notification, Store, Submitted, now_ms,
};
use serde_json::Value;
use sha2::{Digest, Sha256};
use sqlx::Connection;
use sqlx::postgres::PgConnection;
use tempfile::TempDir;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::helpers::*;
use crate::store_conformance::TestDatabase;

mod chaos;
mod lost_answer;
mod outage;
pub mod pg_server;

/// `application_name` of each node's LISTEN connection.
const LISTEN_APP: &str = "holdfast-listen";

/// Nodes sharing one fresh database, in front of one mock provider. Field order is drop
/// order: the processes die before their database is dropped.
struct Cluster {
    nodes: Vec<Process>,
    http: reqwest::Client,
    mock: MockServer,
    toml: String,
    dir: TempDir,
    db: TestDatabase,
}

impl Cluster {
    /// A fresh database and mock, and `started` nodes; fails the test when PostgreSQL is
    /// unreachable (`TestDatabase::create`).
    async fn start(mock: MockConfig, started: usize) -> Cluster {
        let db = TestDatabase::create().await;
        let mock = start_mock(mock).await;
        let dir = tempfile::tempdir().expect("tempdir");
        let toml = fault_test_toml(&db.url, "database_pool_size = 6", 2, &mock.base_url());
        let mut cluster = Cluster {
            nodes: Vec::new(),
            http: reqwest::Client::new(),
            mock,
            toml,
            dir,
            db,
        };
        for _ in 0..started {
            cluster.add_node().await;
        }
        cluster
    }

    /// A traced cluster (OT-1: every node exports to `endpoint`, `top` put before its
    /// configuration's tables) whose node A (index 0) streams `text`, 60 events 50 ms apart:
    /// the cluster and the request's id, once A has stored a few events.
    async fn traced_stream_on_node_a(endpoint: &str, top: &str, text: &str) -> (Cluster, String) {
        let mock = MockConfig {
            chunks: 60,
            chunk_delay_ms: 50,
            ..MockConfig::default()
        };
        let mut cluster = Cluster::start(mock, 0).await;
        cluster.toml = format!(
            "{top}\n{}\n[otel]\nenabled = true\nendpoint = \"{endpoint}\"\n",
            cluster.toml
        );
        let a = cluster.add_node().await;
        let id = cluster.submit_async(a, &stream_body(text)).await;
        cluster
            .wait_record(a, &id, "chunks to flow on node A", |r| {
                r["last_seq"].as_i64().unwrap_or(0) >= 3
            })
            .await;
        (cluster, id)
    }

    /// Starts one more node; returns its index.
    async fn add_node(&mut self) -> usize {
        let node = Process::serve(self.dir.path(), &self.toml, free_addr()).await;
        self.nodes.push(node);
        self.nodes.len() - 1
    }

    fn base(&self, node: usize) -> &str {
        &self.nodes[node].base
    }

    /// POSTs `body` to `/v1/chat/completions` on `node` with `Prefer: respond-async`; the id.
    async fn submit_async(&self, node: usize, body: &str) -> String {
        let r = self
            .http
            .post(format!("{}/v1/chat/completions", self.base(node)))
            .header("content-type", "application/json")
            .header("prefer", "respond-async")
            .body(body.to_string())
            .send()
            .await
            .expect("POST");
        assert_eq!(r.status(), 202);
        header(&r, "holdfast-request-id")
    }

    /// POSTs `body` to `/v1/chat/completions` on `node` and holds for the answer.
    async fn chat(&self, node: usize, body: &str) -> reqwest::Response {
        self.http
            .post(format!("{}/v1/chat/completions", self.base(node)))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .expect("POST")
    }

    /// Polls the record on `node` until `cond` holds (at most 20 s); returns it.
    async fn wait_record(
        &self,
        node: usize,
        id: &str,
        what: &str,
        cond: impl Fn(&Value) -> bool,
    ) -> Value {
        let start = Instant::now();
        loop {
            let record = get_record(&self.http, self.base(node), id).await;
            if cond(&record) {
                return record;
            }
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "timed out waiting for {what}: {record}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// An admin connection to the cluster's database.
    async fn admin(&self) -> PgConnection {
        PgConnection::connect(&self.db.url)
            .await
            .expect("connect to the test database")
    }
}

/// Number of LISTEN connections open on `db`.
async fn listeners(conn: &mut PgConnection, db: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = $1 AND application_name = $2",
    )
    .bind(db)
    .bind(LISTEN_APP)
    .fetch_one(conn)
    .await
    .expect("count listeners")
}

/// Waits until `db` has `n` LISTEN connections (at most 20 s).
async fn wait_listeners(conn: &mut PgConnection, db: &str, n: i64) {
    let start = Instant::now();
    loop {
        let now = listeners(conn, db).await;
        if now == n {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "expected {n} LISTEN connections, have {now}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// An SSE response read incrementally.
struct Reader {
    response: reqwest::Response,
    parser: SseParser,
    events: Vec<SseEvent>,
}

impl Reader {
    fn new(response: reqwest::Response) -> Reader {
        assert_eq!(response.status(), 200);
        Reader {
            response,
            parser: SseParser::new(),
            events: Vec::new(),
        }
    }

    /// Reads until at least `n` events arrived (at most 20 s).
    async fn read_at_least(&mut self, n: usize) {
        let read = async {
            while self.events.len() < n {
                let piece = self
                    .response
                    .chunk()
                    .await
                    .expect("read SSE")
                    .expect("the stream continues");
                self.events
                    .extend(self.parser.push(&piece).expect("valid SSE"));
            }
        };
        tokio::time::timeout(Duration::from_secs(20), read)
            .await
            .expect("events arrive");
    }

    /// Reads to the end of the response (at most 60 s); returns every event.
    async fn finish(mut self) -> Vec<SseEvent> {
        let read = async {
            while let Some(piece) = self.response.chunk().await.expect("read SSE") {
                self.events
                    .extend(self.parser.push(&piece).expect("valid SSE"));
            }
        };
        tokio::time::timeout(Duration::from_secs(60), read)
            .await
            .expect("the stream ends");
        self.events
    }
}

/// `(id, event, data)` of each event: what a log reader compares (not `retry:`).
fn log_of(events: &[SseEvent]) -> Vec<(Option<String>, Option<String>, String)> {
    events
        .iter()
        .map(|e| (e.id.clone(), e.event.clone(), e.data.clone()))
        .collect()
}

/// The seqs of log events.
fn seqs(events: &[SseEvent]) -> Vec<i64> {
    events
        .iter()
        .map(|e| e.id.as_deref().expect("id").parse().expect("numeric id"))
        .collect()
}

fn assert_consecutive(events: &[SseEvent]) {
    let seqs = seqs(events);
    assert!(
        seqs.windows(2).all(|w| w[1] == w[0] + 1),
        "RD-4: no gap and no duplicate: {seqs:?}"
    );
}

/// The whole stored log of `id`, read from `node` from position 0.
async fn stored_log(cluster: &Cluster, node: usize, id: &str) -> Vec<SseEvent> {
    let r = get_events(&cluster.http, cluster.base(node), id, Some("0")).await;
    read_events(r).await.1
}

#[tokio::test]
async fn hundred_identical_requests_across_three_nodes_make_one_upstream_call_id7_du3() {
    let mock = MockConfig {
        header_delay_ms: 700,
        ..MockConfig::default()
    };
    let cluster = Cluster::start(mock, 3).await;
    let body = chat_body("one call for the whole cluster");
    let answers = futures::future::join_all((0..100).map(|i| {
        let cluster = &cluster;
        let body = &body;
        async move {
            let r = cluster.chat(i % 3, body).await;
            let status = r.status().as_u16();
            let replayed = header(&r, "idempotent-replayed");
            let id = header(&r, "holdfast-request-id");
            (status, replayed, id, r.bytes().await.expect("body"))
        }
    }))
    .await;
    assert_eq!(cluster.mock.calls(), 1, "ID-7: one upstream call");
    let (_, _, id, body) = &answers[0];
    for (status, _, other_id, other_body) in &answers {
        assert_eq!(*status, 200);
        assert_eq!(other_id, id, "one request");
        assert_eq!(other_body, body, "identical answers");
    }
    let started = answers.iter().filter(|a| a.1 == "false").count();
    assert_eq!(
        started, 1,
        "exactly one answer started the execution (RS-5)"
    );
    // Each node's PostgreSQL writer shows its group commits (api.md, `/metrics`).
    for node in 0..3 {
        let page = metrics_page(&cluster.http, cluster.base(node)).await;
        let commits = metric(&page, "holdfast_postgres_commit_seconds_count", "");
        let jobs = metric(&page, "holdfast_postgres_commit_jobs_sum", "");
        assert!(
            commits >= 1.0 && jobs >= commits,
            "node {node}: {commits} PostgreSQL commits of {jobs} writes"
        );
        assert_eq!(
            metric(&page, "holdfast_sqlite_commit_seconds_count", ""),
            0.0,
            "node {node} has no SQLite writer"
        );
    }
}

#[tokio::test]
async fn stream_run_on_one_node_is_live_tailed_from_another_without_gap_rd4_du3() {
    let mock = MockConfig {
        chunks: 40,
        chunk_delay_ms: 50,
        ..MockConfig::default()
    };
    let cluster = Cluster::start(mock, 3).await;
    let (a, b, c) = (0, 1, 2);
    let body = stream_body("tail me from elsewhere");
    let id = cluster.submit_async(a, &body).await;
    let record = cluster
        .wait_record(c, &id, "the first chunk", |r| {
            r["last_seq"].as_i64().unwrap_or(0) >= 1 || r["status"] != "pending"
        })
        .await;
    assert_eq!(
        record["status"], "running",
        "opened while running: {record}"
    );
    let tail = Reader::new(get_events(&cluster.http, cluster.base(c), &id, None).await);

    // A proxied duplicate on the third node attaches to the same execution.
    let dup = cluster.chat(b, &body).await;
    assert_eq!(dup.status(), 200);
    assert_eq!(header(&dup, "holdfast-request-id"), id);
    assert_eq!(header(&dup, "idempotent-replayed"), "true");

    let tailed = tail.finish().await;
    let (_, provider_events) = read_events(dup).await;
    let record = wait_terminal(&cluster.http, cluster.base(a), &id, Duration::from_secs(30)).await;
    assert_eq!(record["status"], "succeeded", "{record}");
    assert_eq!(cluster.mock.calls(), 1);

    let stored = stored_log(&cluster, a, &id).await;
    assert_eq!(
        log_of(&tailed),
        log_of(&stored),
        "the tail is the stored log"
    );
    assert_eq!(seqs(&tailed)[0], 1);
    assert_consecutive(&tailed);
    assert_eq!(tailed.last().unwrap().event.as_deref(), Some("end"));
    let data: Vec<&str> = stored[..stored.len() - 1]
        .iter()
        .map(|e| e.data.as_str())
        .collect();
    let got: Vec<&str> = provider_events.iter().map(|e| e.data.as_str()).collect();
    assert_eq!(
        got, data,
        "the attached duplicate got the provider's events"
    );
    assert_eq!(got.last().copied(), Some("[DONE]"));
}

/// DU-7, decision 117: a positioned reader on another node is one the running node's hub
/// cannot count, so the running node holds no commit for its stream longer than the short
/// hold: the tail gets each chunk a commit and a notification after the stream's own client,
/// not the 50 ms a stream nobody follows may be held.
#[tokio::test]
async fn a_reader_on_another_node_gets_each_chunk_without_the_long_hold_du7() {
    let mock = MockConfig {
        chunks: 30,
        chunk_delay_ms: 150,
        ..MockConfig::default()
    };
    let cluster = Cluster::start(mock, 2).await;
    let (a, b) = (0, 1);
    let proxied = cluster
        .chat(a, &stream_body("follow me from elsewhere"))
        .await;
    assert_eq!(proxied.status(), 200);
    let id = header(&proxied, "holdfast-request-id");
    let tail = get_events(&cluster.http, cluster.base(b), &id, None).await;
    assert_eq!(tail.status(), 200);
    // Each event with when it arrived.
    let read = |mut response: reqwest::Response| async move {
        let mut parser = SseParser::new();
        let mut seen = Vec::new();
        while let Ok(Some(piece)) = response.chunk().await {
            let at = Instant::now();
            for event in parser.push(&piece).expect("valid SSE") {
                seen.push((event, at));
            }
        }
        seen
    };
    let (proxied, tailed) = tokio::join!(read(proxied), read(tail));
    // The proxied stream's event i is the log's seq i + 1; from the fifth on, the tail was
    // following.
    let mut lags: Vec<Duration> = proxied
        .iter()
        .enumerate()
        .skip(4)
        .filter(|(_, (event, _))| event.data != "[DONE]")
        .filter_map(|(i, (_, shown))| {
            let seq = (i + 1).to_string();
            let (_, logged) = tailed
                .iter()
                .find(|(event, _)| event.id.as_deref() == Some(seq.as_str()))?;
            Some(logged.saturating_duration_since(*shown))
        })
        .collect();
    assert!(lags.len() >= 20, "tailed {} of the events", lags.len());
    lags.sort();
    let median = lags[lags.len() / 2];
    assert!(
        median < Duration::from_millis(40),
        "the tail on another node got chunks {median:?} after the stream's client: {lags:?}"
    );
}

#[tokio::test]
async fn sigkilled_node_stream_is_recovered_by_another_and_surviving_readers_see_reset_then_the_new_attempt_lc4_lc8_du3()
 {
    let mock = MockConfig {
        chunks: 60,
        chunk_delay_ms: 50,
        ..MockConfig::default()
    };
    let mut cluster = Cluster::start(mock, 1).await;
    let a = 0;
    let id = cluster
        .submit_async(a, &stream_body("recover me on another node"))
        .await;
    cluster
        .wait_record(a, &id, "chunks to flow on node A", |r| {
            r["last_seq"].as_i64().unwrap_or(0) >= 3
        })
        .await;
    let b = cluster.add_node().await;
    let c = cluster.add_node().await;
    let mut readers = Vec::new();
    for node in [b, c] {
        let mut reader =
            Reader::new(get_events(&cluster.http, cluster.base(node), &id, None).await);
        reader.read_at_least(2).await;
        readers.push(reader);
    }
    let record = get_record(&cluster.http, cluster.base(b), &id).await;
    assert_eq!(record["status"], "running", "A still runs it: {record}");
    assert_eq!(record["attempts"], 1, "{record}");
    cluster.nodes[a].kill9();

    let mut logs = Vec::new();
    for reader in readers {
        logs.push(reader.finish().await);
    }
    let record = wait_terminal(&cluster.http, cluster.base(b), &id, Duration::from_secs(30)).await;
    assert_eq!(record["status"], "succeeded", "{record}");
    assert_eq!(record["recoveries"], 1, "{record}");
    assert_eq!(record["attempts"], 2, "{record}");
    assert_eq!(cluster.mock.calls(), 2, "one provider call per attempt");

    // A reader without a position now gets the current (second) attempt and its end.
    let current = read_events(get_events(&cluster.http, cluster.base(c), &id, None).await)
        .await
        .1;
    for events in &logs {
        assert_consecutive(events);
        assert_eq!(seqs(events)[0], 1, "from the first chunk of attempt 1");
        let reset = events
            .iter()
            .position(|e| e.event.as_deref() == Some("reset"))
            .expect("RD-6: a reset between the attempts");
        assert_eq!(events[reset].data, "2", "reset data is the new attempt");
        assert_eq!(
            log_of(&events[reset + 1..]),
            log_of(&current),
            "then the whole new attempt, ending with end"
        );
        assert_eq!(events.last().unwrap().event.as_deref(), Some("end"));
    }
}

#[tokio::test]
async fn killed_listen_connections_cost_only_latency_readers_and_workers_still_progress_du3() {
    let mock = MockConfig {
        chunks: 40,
        chunk_delay_ms: 50,
        ..MockConfig::default()
    };
    let cluster = Cluster::start(mock, 3).await;
    let (a, b, c) = (0, 1, 2);
    let mut admin = cluster.admin().await;
    wait_listeners(&mut admin, &cluster.db.name, 3).await;

    let id = cluster
        .submit_async(a, &stream_body("lose my wake-ups"))
        .await;
    let mut reader = Reader::new(get_events(&cluster.http, cluster.base(c), &id, None).await);
    reader.read_at_least(2).await;

    let killed: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
         WHERE datname = $1 AND application_name = $2) AS t",
    )
    .bind(&cluster.db.name)
    .bind(LISTEN_APP)
    .fetch_one(&mut admin)
    .await
    .expect("terminate listeners");
    assert_eq!(killed, 3, "every node's LISTEN connection was cut");

    // Work recorded while (or right after) the listeners are gone still completes.
    let answers = futures::future::join_all((0..6).map(|i| {
        let cluster = &cluster;
        async move {
            let r = cluster
                .chat(i % 3, &chat_body(&format!("after the cut {i}")))
                .await;
            r.status().as_u16()
        }
    }))
    .await;
    assert!(answers.iter().all(|s| *s == 200), "{answers:?}");

    let tailed = reader.finish().await;
    assert_consecutive(&tailed);
    assert_eq!(tailed.last().unwrap().event.as_deref(), Some("end"));
    let record = wait_terminal(&cluster.http, cluster.base(b), &id, Duration::from_secs(30)).await;
    assert_eq!(record["status"], "succeeded", "{record}");
    assert_eq!(log_of(&tailed), log_of(&stored_log(&cluster, b, &id).await));

    // Each listener reconnects by itself.
    wait_listeners(&mut admin, &cluster.db.name, 3).await;
    assert_eq!(cluster.mock.calls(), 7);
}

// ---------------------------------------------------------------------------------------------
// The wake-up mechanism itself, on two stores in this process
// ---------------------------------------------------------------------------------------------

fn new_request(text: &str) -> NewRequest {
    let body = chat_body(text).into_bytes();
    let hash: [u8; 32] = Sha256::digest(&body).into();
    let now = now_ms();
    NewRequest {
        id: Uuid::now_v7(),
        namespace: "default".into(),
        route: Route::OpenaiChat,
        backend: "mock".into(),
        model: Some("gpt-4o-mini".into()),
        stream: true,
        body,
        headers: Vec::new(),
        hash,
        claim: ClaimKind::BodyHash,
        claim_key: hash.iter().map(|b| format!("{b:02x}")).collect(),
        claim_expires_at: now + 600_000,
        now,
        trace_parent: None,
        callback_url: None,
        replay_of: None,
    }
}

async fn submit(store: &PostgresStore, text: &str) -> Uuid {
    match store.submit(new_request(text)).await.expect("submit") {
        Submitted::Created(r) => r.id,
        other => panic!("expected a new request, got {other:?}"),
    }
}

#[tokio::test]
async fn notifications_from_one_store_wake_another_stores_workers_and_readers_in_batches_du3() {
    let db = TestDatabase::create().await;
    let writer = PostgresStore::open(&db.url).await.expect("open writer");
    let other = Arc::new(PostgresStore::open(&db.url).await.expect("open listener"));
    let (tx, mut notifications) = mpsc::unbounded_channel();
    let stop = CancellationToken::new();
    let listening = {
        let (other, stop) = (Arc::clone(&other), stop.clone());
        tokio::spawn(async move { other.listen(tx, stop).await })
    };

    // New work is reported to the other store's node. The listener connects in the background,
    // so submit until a report arrives (bounded).
    let start = Instant::now();
    let mut n = 0;
    loop {
        n += 1;
        submit(&writer, &format!("work {n}")).await;
        if let Ok(Some(Notification::Work)) =
            tokio::time::timeout(Duration::from_millis(500), notifications.recv()).await
        {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "no work notification"
        );
    }

    // One group commit over more requests than fit in one payload wakes a reader of each.
    let count = IDS_PER_NOTIFY + 20;
    let mut leases: Vec<Lease> = Vec::new();
    for i in 0..count {
        submit(&writer, &format!("chunked {i}")).await;
    }
    while let Some((lease, _)) = writer
        .lease("test-owner", now_ms(), 60_000)
        .await
        .expect("lease")
    {
        leases.push(lease);
    }
    assert_eq!(leases.len(), count + n);
    let batches: Vec<ChunkBatch> = leases
        .iter()
        .map(|lease| ChunkBatch {
            lease: lease.clone(),
            after: 0,
            chunks: vec![NewChunk {
                event: None,
                data: "{}".into(),
            }],
            upstream_request_id: None,
            response_id: None,
            usage: None,
        })
        .collect();
    // Drop what the submissions reported so far, then append.
    while notifications.try_recv().is_ok() {}
    let stored = writer.append_chunks(&batches).await.expect("append");
    assert!(stored.iter().all(Option::is_some));
    let mut changed = std::collections::HashSet::new();
    while changed.len() < leases.len() {
        match tokio::time::timeout(Duration::from_secs(10), notifications.recv()).await {
            Ok(Some(Notification::Changed(id))) => {
                changed.insert(id);
            }
            Ok(Some(Notification::Work)) => {}
            other => panic!(
                "every request's change is reported ({} of {}): {other:?}",
                changed.len(),
                leases.len()
            ),
        }
    }
    assert!(leases.iter().all(|l| changed.contains(&l.id)));

    // A status change wakes a reader too.
    let lease = &leases[0];
    writer
        .finish(
            lease,
            holdfast::store::Outcome::Succeeded {
                status: 200,
                body: Vec::new(),
                upstream_request_id: None,
                response_id: None,
                usage: None,
            },
            now_ms(),
        )
        .await
        .expect("finish");
    let event = tokio::time::timeout(Duration::from_secs(10), notifications.recv())
        .await
        .expect("finish is reported");
    assert_eq!(event, Some(Notification::Changed(lease.id)));

    stop.cancel();
    tokio::time::timeout(Duration::from_secs(10), listening)
        .await
        .expect("the listener stops on shutdown")
        .expect("listener task");
}

/// A cluster whose nodes also have a Gemini backend (`mock-gemini`, the mock's root URL), and
/// `started` nodes.
async fn gemini_cluster(mock: MockConfig, started: usize) -> Cluster {
    let mut cluster = Cluster::start(mock, 0).await;
    cluster.toml.push_str(&format!(
        "[[backends]]\nname = \"mock-gemini\"\nkind = \"gemini\"\nbase_url = \"{}\"\n",
        cluster.mock.root_url()
    ));
    for _ in 0..started {
        cluster.add_node().await;
    }
    cluster
}

const GEMINI_GENERATE: &str = "/v1beta/models/gemini-2.5-flash:generateContent";
const GEMINI_STREAM: &str = "/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse";

/// POSTs a Gemini `body` to `path` on `node`, with `headers`.
async fn gemini_post(
    cluster: &Cluster,
    node: usize,
    path: &str,
    body: &str,
    headers: &[(&str, &str)],
) -> reqwest::Response {
    let mut request = cluster
        .http
        .post(format!("{}{path}", cluster.base(node)))
        .header("content-type", "application/json")
        .body(body.to_string());
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.send().await.expect("POST")
}

#[tokio::test]
async fn hundred_identical_gemini_calls_across_three_nodes_make_one_upstream_call_id7_du3_gm1() {
    let mock = MockConfig {
        header_delay_ms: 700,
        ..MockConfig::default()
    };
    let cluster = gemini_cluster(mock, 3).await;
    let body = gemini_body("one Gemini call for the whole cluster");
    let answers = futures::future::join_all((0..100).map(|i| {
        let (cluster, body) = (&cluster, &body);
        async move {
            let r = gemini_post(cluster, i % 3, GEMINI_GENERATE, body, &[]).await;
            assert_eq!(r.status(), 200);
            let id = header(&r, "holdfast-request-id");
            (id, r.bytes().await.expect("body"))
        }
    }))
    .await;
    assert_eq!(cluster.mock.calls(), 1, "ID-7: one upstream call");
    assert!(
        answers.iter().all(|a| a == &answers[0]),
        "one request, one answer"
    );
    let record = get_record(&cluster.http, cluster.base(2), &answers[0].0).await;
    assert_eq!(record["route"], "gemini.v1beta.generate", "{record}");
    assert_eq!(record["model"], "gemini-2.5-flash", "{record}");
    // The ledger by provider, from PostgreSQL (the provider is the route name's first part).
    let usage = get_json(
        &cluster.http,
        &format!("{}/usage?group_by=provider", cluster.base(1)),
    )
    .await;
    let groups = usage["groups"].as_array().expect("groups");
    assert_eq!(groups.len(), 1, "{usage}");
    assert_eq!(groups[0]["key"], "gemini", "{usage}");
    assert_eq!(groups[0]["requests"], 1, "{usage}");
}

#[tokio::test]
async fn sigkilled_node_gemini_stream_resets_and_resumes_on_another_node_lc8_du3_gm3() {
    let mock = MockConfig {
        chunks: 60,
        chunk_delay_ms: 50,
        ..MockConfig::default()
    };
    let mut cluster = gemini_cluster(mock, 1).await;
    let a = 0;
    let r = gemini_post(
        &cluster,
        a,
        GEMINI_STREAM,
        &gemini_body("recover this Gemini stream"),
        &[("prefer", "respond-async")],
    )
    .await;
    assert_eq!(r.status(), 202);
    let id = header(&r, "holdfast-request-id");
    cluster
        .wait_record(a, &id, "chunks to flow on node A", |r| {
            r["last_seq"].as_i64().unwrap_or(0) >= 3
        })
        .await;
    let b = cluster.add_node().await;
    let c = cluster.add_node().await;
    let mut reader = Reader::new(get_events(&cluster.http, cluster.base(b), &id, None).await);
    reader.read_at_least(2).await;
    cluster.nodes[a].kill9();

    let events = reader.finish().await;
    let record = wait_terminal(&cluster.http, cluster.base(c), &id, Duration::from_secs(30)).await;
    assert_eq!(record["status"], "succeeded", "{record}");
    assert_eq!(record["attempts"], 2, "{record}");
    assert_eq!(record["recoveries"], 1, "{record}");
    assert_eq!(cluster.mock.calls(), 2, "one provider call per attempt");
    assert_consecutive(&events);
    let reset = events
        .iter()
        .position(|e| e.event.as_deref() == Some("reset"))
        .expect("RD-6: a reset between the attempts");
    let current = read_events(get_events(&cluster.http, cluster.base(c), &id, None).await)
        .await
        .1;
    assert_eq!(log_of(&events[reset + 1..]), log_of(&current));
    // The new attempt ends with the finishing chunk, then `end` (GM-3).
    let finishing = &current[current.len() - 2];
    assert!(
        finishing.data.contains("finishReason"),
        "{}",
        finishing.data
    );
    // Resumed with `Last-Event-ID` inside the abandoned attempt: its reset, then the whole new
    // attempt (RD-6).
    let resumed = read_events(get_events(&cluster.http, cluster.base(b), &id, Some("2")).await)
        .await
        .1;
    assert_eq!(log_of(&resumed), log_of(&events[reset..]));
}

/// The span id attempt `attempt` of request `id` has on every node (OT-3): the first 8 bytes
/// of a SHA-256 of both.
fn attempt_span_id(id: &str, attempt: u32) -> String {
    let id = Uuid::parse_str(id).unwrap();
    let digest = Sha256::new()
        .chain_update(b"holdfast attempt span\0")
        .chain_update(id.as_bytes())
        .chain_update(attempt.to_be_bytes())
        .finalize();
    hex::encode(&digest[..8])
}

#[tokio::test]
async fn a_stream_recovered_on_another_node_is_a_second_attempt_span_under_the_same_call_linked_to_the_first_ot2_ot3()
 {
    let receiver = crate::traces::Receiver::start().await;
    let (mut cluster, id) =
        Cluster::traced_stream_on_node_a(&receiver.url, "", "trace my recovery").await;
    let a = 0;
    // The call's server span (ended with its 202) reached the receiver from node A.
    let spans = receiver
        .wait("node A's server span", |s| {
            crate::traces::servers(s)
                .iter()
                .any(|s| s.attr("holdfast.request_id") == id.as_str())
        })
        .await;
    let call = crate::traces::servers(&spans)
        .into_iter()
        .find(|s| s.attr("holdfast.request_id") == id.as_str())
        .unwrap()
        .clone();
    let b = cluster.add_node().await;
    cluster.nodes[a].kill9();
    let record = wait_terminal(&cluster.http, cluster.base(b), &id, Duration::from_secs(30)).await;
    assert_eq!(record["status"], "succeeded", "{record}");
    assert_eq!(record["attempts"], 2, "{record}");
    let spans = receiver
        .wait("attempt 2's span from node B", |s| {
            crate::traces::attempts(s).iter().any(|s| {
                s.attr("holdfast.request_id") == id.as_str() && s.attr("holdfast.attempt") == 2
            })
        })
        .await;
    let second = crate::traces::attempts(&spans)
        .into_iter()
        .find(|s| s.attr("holdfast.request_id") == id.as_str() && s.attr("holdfast.attempt") == 2)
        .unwrap();
    // Node B read the call's trace context from the log: same trace, same parent.
    assert_eq!(second.trace_id, call.trace_id);
    assert_eq!(second.parent, call.span_id);
    assert_eq!(second.span_id, attempt_span_id(&id, 2));
    // Linked to the abandoned attempt, whose span died with node A: its id is derived, not stored.
    assert_eq!(
        second
            .links
            .iter()
            .map(|(t, s, _)| (t.clone(), s.clone()))
            .collect::<Vec<_>>(),
        vec![(call.trace_id.clone(), attempt_span_id(&id, 1))]
    );
    assert!(
        second.attr("holdfast.events").as_i64().unwrap_or(0) > 0,
        "the stream's events: {second:#?}"
    );
}

// Multi-threaded: `sigterm_and_wait` blocks its thread, and the receiver must answer node A's
// last export meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_handed_back_at_shutdown_and_finished_on_another_node_is_two_linked_attempt_spans_ot3_du5()
 {
    let receiver = crate::traces::Receiver::start().await;
    // Shutdown's grace is short: the running attempt is handed back (DU-5) and ends its span.
    let (mut cluster, id) = Cluster::traced_stream_on_node_a(
        &receiver.url,
        "shutdown_grace_ms = 200",
        "trace my hand-back",
    )
    .await;
    let a = 0;
    let b = cluster.add_node().await;
    assert!(cluster.nodes[a].sigterm_and_wait(Duration::from_secs(20)));
    let record = wait_terminal(&cluster.http, cluster.base(b), &id, Duration::from_secs(30)).await;
    assert_eq!(record["status"], "succeeded", "{record}");
    assert_eq!(record["attempts"], 2, "{record}");
    let ours = |s: &crate::traces::Span| s.attr("holdfast.request_id") == id.as_str();
    let spans = receiver
        .wait("both attempts' spans", |s| {
            crate::traces::attempts(s)
                .iter()
                .filter(|s| ours(s))
                .count()
                == 2
        })
        .await;
    let mut attempts: Vec<_> = crate::traces::attempts(&spans)
        .into_iter()
        .filter(|s| ours(s))
        .collect();
    attempts.sort_by_key(|s| s.attr("holdfast.attempt").as_i64());
    let (first, second) = (attempts[0], attempts[1]);
    assert_eq!(first.span_id, attempt_span_id(&id, 1));
    assert_eq!(first.attr("error.type"), "lease_lost", "{first:#?}");
    assert_eq!(second.span_id, attempt_span_id(&id, 2));
    assert_eq!(
        (first.trace_id.as_str(), first.parent.as_str()),
        (second.trace_id.as_str(), second.parent.as_str())
    );
    assert_eq!(
        second
            .links
            .iter()
            .map(|(t, s, _)| (t.clone(), s.clone()))
            .collect::<Vec<_>>(),
        vec![(first.trace_id.clone(), first.span_id.clone())],
        "attempt 2 links to the attempt handed back"
    );
}

/// OT-3, LC-9: a cancel made on another node clears the running attempt's lease; node A's
/// attempt then ends without an outcome, and its span says `cancelled`, as for a cancel made
/// on node A itself, not `lease_lost`: the request's stored error says who took it.
#[tokio::test]
async fn a_stream_cancelled_from_another_node_has_an_attempt_span_that_says_cancelled_ot3_lc9() {
    let receiver = crate::traces::Receiver::start().await;
    let (mut cluster, id) =
        Cluster::traced_stream_on_node_a(&receiver.url, "", "cancel me from node B").await;
    let b = cluster.add_node().await;
    let cancelled = cluster
        .http
        .post(format!("{}/requests/{id}/cancel", cluster.base(b)))
        .send()
        .await
        .expect("cancel");
    assert_eq!(cancelled.status(), 200);
    let spans = receiver
        .wait("node A's attempt span", |s| {
            crate::traces::attempts(s)
                .iter()
                .any(|s| s.attr("holdfast.request_id") == id.as_str())
        })
        .await;
    let attempt = crate::traces::attempts(&spans)
        .into_iter()
        .find(|s| s.attr("holdfast.request_id") == id.as_str())
        .unwrap();
    assert_eq!(attempt.attr("holdfast.attempt"), 1);
    assert_eq!(attempt.attr("error.type"), "cancelled", "{attempt:#?}");
}
