//! Graceful degradation under load and database trouble (issue 28): one tenant's duplicates never
//! stall another's new work (DU-6), each case on both stores. The PostgreSQL cases are in
//! module `degradation::postgres` (the `postgres` group of `scripts/test`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use holdfast::config::Config;
use holdfast::mock::MockConfig;

use crate::helpers::*;

mod relay;

/// Clients re-sending one body at once.
const REPLAYERS: usize = 64;
/// How long they re-send it.
const REPLAY_FOR: Duration = Duration::from_secs(5);
/// A liveness bound, not a speed target: before DU-6, 13 s on PostgreSQL.
const NEW_WORK_LIMIT: Duration = Duration::from_secs(1);

/// DU-6: after 5 s of replays of one body at c=64, a new request's answer and a new stream's
/// first event arrive within a second, and the record counts every answer it gave.
async fn replays_of_one_body_do_not_delay_new_work(tweak: impl FnOnce(&mut Config)) {
    let app = spawn_app(MockConfig::default(), tweak).await;
    let body = chat_body("the popular prompt");
    let first = app.chat(&body).await;
    assert_eq!(first.status(), 200);
    let id = header(&first, "holdfast-request-id");

    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicU64::new(0));
    let mut replayers = Vec::new();
    for _ in 0..REPLAYERS {
        let (http, url, body) = (
            app.http.clone(),
            format!("{}/v1/chat/completions", app.base),
            body.clone(),
        );
        let (stop, answered, id) = (Arc::clone(&stop), Arc::clone(&answered), id.clone());
        replayers.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let r = http
                    .post(&url)
                    .header("content-type", "application/json")
                    .body(body.clone())
                    .send()
                    .await
                    .expect("POST");
                assert_eq!(r.status(), 200);
                assert_eq!(header(&r, "idempotent-replayed"), "true");
                assert_eq!(header(&r, "holdfast-request-id"), id);
                r.bytes().await.expect("replayed body");
                answered.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    tokio::time::sleep(REPLAY_FOR).await;
    stop.store(true, Ordering::Relaxed);
    for r in replayers {
        r.await.expect("replayer");
    }
    let replays = answered.load(Ordering::Relaxed);
    assert!(replays > 1_000, "the load ran: {replays} replays");

    let started = Instant::now();
    let r = app.chat(&chat_body("a new request after the burst")).await;
    assert_eq!(r.status(), 200);
    r.bytes().await.unwrap();
    let answer = started.elapsed();

    let started = Instant::now();
    let mut r = app
        .post(
            "/v1/chat/completions",
            stream_body("a new stream after the burst"),
            &[],
        )
        .await;
    assert_eq!(r.status(), 200);
    first_events(&mut r, 1).await;
    let first_event = started.elapsed();
    assert!(
        answer < NEW_WORK_LIMIT && first_event < NEW_WORK_LIMIT,
        "after {replays} replays a new answer took {answer:?} and a new stream's first event \
         {first_event:?} (bound {NEW_WORK_LIMIT:?})"
    );
    // Every answer is counted: the first delivery and each replay.
    wait_deliveries(&app.base, &id, None, replays + 1).await;
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_replays_of_one_body_at_c64_never_delay_a_new_request_or_stream_du6() {
    replays_of_one_body_do_not_delay_new_work(|_| {}).await;
}

pub mod postgres {
    use super::relay::SilentRelay;
    use super::*;
    use crate::multinode::pg_server::PrivatePostgres;
    use crate::store_conformance::TestDatabase;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_replays_of_one_body_at_c64_never_delay_a_new_request_or_stream_du6() {
        let db = TestDatabase::create().await;
        let url = db.url.clone();
        replays_of_one_body_do_not_delay_new_work(move |c| c.database_url = url).await;
        drop(db);
    }

    /// Two nodes (as processes) on `url`, with a small pool; their bases.
    async fn two_nodes(dir: &std::path::Path, url: &str, mock: &str) -> (Process, Process) {
        let toml = fault_test_toml(url, "database_pool_size = 2", 2, mock);
        let a = Process::serve(dir, &toml, free_addr()).await;
        let b = Process::serve(dir, &toml, free_addr()).await;
        (a, b)
    }

    /// RS-10: with the server stopped (connections refused), every node refuses a new call
    /// within 2 s, retryable; once it is back they answer again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_new_call_is_refused_within_2s_on_every_node_while_postgres_is_stopped_rs10() {
        let mut pg = PrivatePostgres::create().await;
        let mock = start_mock(MockConfig::default()).await;
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = two_nodes(dir.path(), &pg.url(), &mock.base_url()).await;
        let bases = [a.base.clone(), b.base.clone()];
        let http = reqwest::Client::new();
        every_node_answers_again(&http, &bases, "before the stop").await;
        pg.stop(libc::SIGINT).await;
        every_node_refuses_in_time(&http, &bases, "server stopped").await;
        pg.start().await;
        every_node_answers_again(&http, &bases, "after the restart").await;
    }

    /// RS-10: with the server's network silent (nothing answers, nothing is refused: the
    /// connections held by the pool hang, new ones never complete), every node refuses a new
    /// call within 2 s, retryable; once the network heals they answer again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_new_call_is_refused_within_2s_on_every_node_while_postgres_is_silent_rs10() {
        let db = TestDatabase::create().await;
        let (relay, url) = SilentRelay::in_front_of(&db.url).await;
        let mock = start_mock(MockConfig::default()).await;
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = two_nodes(dir.path(), &url, &mock.base_url()).await;
        let bases = [a.base.clone(), b.base.clone()];
        let http = reqwest::Client::new();
        every_node_answers_again(&http, &bases, "before the silence").await;
        relay.pause();
        every_node_refuses_in_time(&http, &bases, "network silent").await;
        relay.resume();
        every_node_answers_again(&http, &bases, "after the silence").await;
    }
}

/// RS-10's bound: a new call is refused within this while the database is out of reach.
const REFUSAL_LIMIT: Duration = Duration::from_secs(2);

/// Sends a new call to `base` and checks it is refused as RS-10 says, within [`REFUSAL_LIMIT`]:
/// 503 `store_unavailable` with `x-should-retry: true` and a `retry-after-ms` (RS-8).
async fn refused_in_time(http: &reqwest::Client, base: &str, text: &str) {
    let started = Instant::now();
    let r = http
        .post(format!("{base}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(chat_body(text))
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .unwrap_or_else(|e| panic!("{base}: {text} was not answered: {e}"));
    let took = started.elapsed();
    assert_eq!(r.status(), 503, "{base}: {text}");
    assert_eq!(header(&r, "holdfast-error"), "store_unavailable");
    assert_eq!(header(&r, "x-should-retry"), "true");
    let after: u64 = header(&r, "retry-after-ms")
        .parse()
        .expect("retry-after-ms");
    assert!(after <= 60_000, "retry-after-ms {after}");
    assert!(
        took < REFUSAL_LIMIT,
        "{base}: {text} was refused after {took:?} (bound {REFUSAL_LIMIT:?})"
    );
}

/// Sends calls to every base, 8 at once per node (more than the test pool's connections, so
/// the pool is exhausted as well as cut off), each refused in time.
async fn every_node_refuses_in_time(http: &reqwest::Client, bases: &[String], what: &str) {
    let mut calls = Vec::new();
    for (n, base) in bases.iter().enumerate() {
        for i in 0..8 {
            let (http, base) = (http.clone(), base.clone());
            let text = format!("{what}: node {n} call {i}");
            calls.push(tokio::spawn(async move {
                refused_in_time(&http, &base, &text).await;
            }));
        }
    }
    for call in calls {
        call.await.expect("refused in time");
    }
}

/// Waits (at most 60 s) until a new call to each base succeeds again.
async fn every_node_answers_again(http: &reqwest::Client, bases: &[String], what: &str) {
    for (n, base) in bases.iter().enumerate() {
        let started = Instant::now();
        loop {
            let r = http
                .post(format!("{base}/v1/chat/completions"))
                .header("content-type", "application/json")
                .body(chat_body(&format!("{what}: node {n} again")))
                .send()
                .await
                .expect("POST");
            if r.status() == 200 {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "node {n} still answers {} after {what}",
                r.status()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}
