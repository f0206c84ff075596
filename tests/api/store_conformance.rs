//! The store conformance suite: every test is written once, against [`DynStore`], and runs on
//! both adapters — `store_conformance::sqlite::<name>` on a fresh SQLite file and
//! `store_conformance::postgres::<name>` on a fresh PostgreSQL database (SPEC DU-3: the two
//! adapters keep identical semantics). Time is synthetic: every call takes its `now`.
//!
//! PostgreSQL comes from `HOLDFAST_TEST_DATABASE_URL`, else
//! `postgres://postgres@127.0.0.1:5432/test`; each test creates its own database there and drops
//! it afterwards. When the server is unreachable the PostgreSQL tests fail, naming it
//! (`scripts/test` starts the local server; `HOLDFAST_TEST_SKIP=postgres` opts out of them).

#![allow(dead_code)]

use std::collections::HashSet;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use holdfast::config::SqliteSynchronous;
use holdfast::provider::Route;
use holdfast::store::postgres::PostgresStore;
use holdfast::store::sqlite::SqliteStore;
use holdfast::store::{
    Chunk, ChunkBatch, ChunkKind, ClaimKind, Counts, DynStore, ErrorInfo, ErrorType,
    FAILURE_WINDOW_MS, Lease, LeaseQuota, LeaseTo, Millis, NewChunk, NewRequest, Outcome,
    RequestRecord, Status, Submitted, Usage, end_chunk, end_data,
};
use sha2::{Digest, Sha256};
use sqlx::Connection;
use sqlx::postgres::{PgConnectOptions, PgConnection};
use tempfile::TempDir;
use tokio::sync::Barrier;
use uuid::Uuid;

// ---------------------------------------------------------------------------------------------
// Stores under test
// ---------------------------------------------------------------------------------------------

/// A store under test and whatever has to live as long as it.
pub struct TestStore {
    /// The store.
    pub store: DynStore,
    _sqlite_dir: Option<TempDir>,
    _postgres_db: Option<TestDatabase>,
}

/// A fresh SQLite store in a temporary directory.
pub async fn sqlite_store() -> TestStore {
    let dir = tempfile::tempdir().expect("tempdir");
    let url = format!("sqlite://{}", dir.path().join("holdfast.db").display());
    let store = SqliteStore::open(&url, SqliteSynchronous::Normal)
        .await
        .expect("open SQLite store");
    TestStore {
        store: Arc::new(store),
        _sqlite_dir: Some(dir),
        _postgres_db: None,
    }
}

/// A fresh PostgreSQL store on its own database; fails the test when PostgreSQL is unreachable.
pub async fn postgres_store() -> TestStore {
    let db = TestDatabase::create().await;
    let store = PostgresStore::open(&db.url)
        .await
        .expect("open PostgreSQL store");
    TestStore {
        store: Arc::new(store),
        _sqlite_dir: None,
        _postgres_db: Some(db),
    }
}

/// The server the PostgreSQL tests use: `HOLDFAST_TEST_DATABASE_URL`, else the local one.
pub fn test_database_admin_url() -> String {
    std::env::var("HOLDFAST_TEST_DATABASE_URL")
        .ok()
        .filter(|u| !u.is_empty())
        .unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/test".to_string())
}

/// A database of its own for one test, `holdfast_test_<uuid>`, dropped (best effort, with
/// `FORCE`) when this value is dropped — also when the test panics.
pub struct TestDatabase {
    /// URL of the fresh database.
    pub url: String,
    /// Its name.
    pub name: String,
    admin: PgConnectOptions,
}

impl TestDatabase {
    /// Creates the database; fails the test, naming the server, when PostgreSQL is unreachable.
    pub async fn create() -> TestDatabase {
        let admin_url = test_database_admin_url();
        let shown = holdfast::store::redact_url(&admin_url);
        let admin = PgConnectOptions::from_str(&admin_url)
            .unwrap_or_else(|e| panic!("HOLDFAST_TEST_DATABASE_URL {shown}: {e}"));
        let connected =
            tokio::time::timeout(Duration::from_secs(5), PgConnection::connect_with(&admin)).await;
        let mut conn = match connected {
            Ok(Ok(conn)) => conn,
            Ok(Err(e)) => postgres_unreachable(&shown, &e.to_string()),
            Err(_) => postgres_unreachable(&shown, "timed out after 5 s"),
        };
        let name = format!("holdfast_test_{}", Uuid::new_v4().simple());
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("CREATE DATABASE {name} on {shown}: {e}"));
        let _ = conn.close().await;
        let mut url = reqwest::Url::parse(&admin_url)
            .unwrap_or_else(|e| panic!("HOLDFAST_TEST_DATABASE_URL {shown}: {e}"));
        url.set_path(&format!("/{name}"));
        TestDatabase {
            url: url.to_string(),
            name,
            admin,
        }
    }
}

fn postgres_unreachable(shown: &str, why: &str) -> ! {
    crate::helpers::missing_dependency(
        "postgres",
        &format!("PostgreSQL not reachable at {shown} ({why})"),
        "start PostgreSQL on 127.0.0.1:5432 (Debian: pg_ctlcluster --skip-systemctl-redirect \
         VERSION main start), or set HOLDFAST_TEST_DATABASE_URL to a server where this user may \
         CREATE DATABASE",
    )
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        let admin = self.admin.clone();
        let name = self.name.clone();
        // Drop runs inside the test's runtime; use a thread with a runtime of its own.
        let dropper = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            runtime.block_on(async move {
                if let Ok(mut conn) = PgConnection::connect_with(&admin).await {
                    let sql = format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)");
                    let _ = sqlx::query(&sql).execute(&mut conn).await;
                    let _ = conn.close().await;
                }
            });
        });
        let _ = dropper.join();
    }
}

/// Runs each named `async fn(DynStore)` against both adapters.
macro_rules! conformance {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    let t = super::sqlite_store().await;
                    super::$name(t.store.clone()).await;
                }
            )*
        }

        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    let t = super::postgres_store().await;
                    super::$name(t.store.clone()).await;
                }
            )*
        }
    };
}

conformance!(
    submit_creates_then_attaches_id4,
    submit_and_lease_leases_only_what_it_creates_lc2_id7,
    body_hash_claims_are_per_namespace_id4,
    expired_claim_is_taken_over_by_a_new_request_id4,
    a_claim_lives_past_its_window_while_its_request_runs_id4,
    keyed_claim_with_another_fingerprint_is_key_mismatch_id5,
    racing_identical_submits_create_exactly_one_request_id7,
    racing_takeovers_of_an_expired_claim_create_exactly_one_request_id7,
    racing_keyed_submits_create_one_request_and_mismatch_the_rest_id5_id7,
    get_reads_only_its_own_namespace,
    a_peek_reads_what_get_reads_but_the_request_and_its_answer_rs1,
    lease_takes_only_due_pending_requests_oldest_first_lc2,
    concurrent_leasers_never_share_a_request_lc2,
    heartbeat_extends_the_lease_and_fails_once_it_is_lost_lc3,
    stale_owner_writes_nothing_lc3,
    retry_goes_back_to_pending_until_next_retry_at_lc5,
    failure_releases_a_body_hash_claim_a_minute_later_id6_id6a,
    keyed_claim_survives_upstream_refused_and_replays_id6,
    keyed_claim_is_released_a_minute_after_transient_exhaustion_id6_id6a,
    a_failure_never_extends_a_claim_past_its_own_window_id6a,
    sweep_recovers_expired_leases_and_resets_only_after_stored_chunks_lc4_lc8,
    sweep_fails_with_lease_expired_when_attempts_are_used_up_lc4,
    racing_sweeps_recover_each_request_once_lc4,
    racing_sweeps_fail_each_request_once_lc4,
    append_chunks_assigns_consecutive_seqs_across_batches,
    append_chunks_group_commit_keeps_each_requests_order,
    append_chunks_returns_none_for_a_lost_lease_lc3,
    append_chunks_fences_each_attempt_of_one_request_in_one_commit_lc3,
    append_chunks_tried_again_after_a_lost_answer_stores_each_event_once_lc3_rd4,
    chunks_after_pages_in_seq_order,
    every_terminal_outcome_appends_exactly_one_end_chunk_rd5,
    finish_read_returns_the_record_as_stored_and_none_for_a_lost_lease_lc3,
    finish_with_chunks_stores_the_last_batch_and_the_outcome_together_or_nothing_lc3_rd5,
    concurrent_successes_each_settle_fenced_on_their_own_lease_lc3_rd5,
    finish_refuses_a_request_that_is_not_running_lc3,
    cancel_fails_pending_and_running_requests_lc9,
    cancel_leaves_terminal_requests_and_other_namespaces_alone_lc9,
    list_is_newest_first_with_status_filter_and_cursor_rd7,
    export_pages_oldest_first_after_a_cursor_and_lists_replays_ex1_ex4_ex8,
    data_chunks_of_reads_each_requests_events_after_its_seq_in_one_call_ex4,
    usage_buckets_split_the_window_by_hour_ex10,
    one_hour_cache_writes_are_kept_by_every_write_and_summed_by_usage_rd10,
    every_list_filter_narrows_to_what_it_names_in_both_orders_rd7_ex1,
    release_hands_back_without_counting_a_recovery_du5,
    an_unstarted_attempt_is_handed_back_uncounted_du5,
    a_hand_back_of_the_last_attempt_fails_it_so_attempts_never_exceed_the_maximum_du5,
    prune_deletes_only_terminal_rows_with_their_chunks_and_claims_du4,
    prune_keeps_a_request_whose_webhook_delivery_is_pending_until_no_try_is_left_du4_cb4,
    counts_and_next_due_follow_the_lifecycle,
    nul_characters_in_text_never_fail_a_write_in2,
    a_callback_falls_due_when_its_request_ends_and_each_try_is_fenced_cb1_cb4_cb6,
    racing_callback_leasers_never_share_a_delivery_cb4,
    a_callback_lease_takes_each_namespaces_share_first_then_lends_the_oldest_due_cb7,
    a_lease_takes_each_namespaces_share_of_due_requests_first_then_lends_the_oldest_lc2a,
    a_callback_falls_due_however_its_request_ends_cb4,
    attachments_added_after_a_request_finished_are_reported_late_rd9_du6,
    usage_counts_the_successes_that_reported_no_tokens_as_unmetered_rd9a,
);

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

const NS: &str = "default";
/// A fixed "now": every test runs on synthetic time.
const T0: Millis = 1_700_000_000_000;
/// Body-hash claim window (ID-4), as `dedupe_window_secs = 600`.
const WINDOW: Millis = 600_000;
/// Keyed claim lifetime (ID-5), as `idempotency_key_ttl_secs = 86400`.
const KEY_TTL: Millis = 86_400_000;
const LEASE_MS: i64 = 30_000;
const MAX_ATTEMPTS: u32 = 5;

fn body(text: &str) -> Vec<u8> {
    serde_json::json!({
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": text}],
    })
    .to_string()
    .into_bytes()
}

fn hash_of(body: &[u8]) -> [u8; 32] {
    Sha256::digest(body).into()
}

/// A body-hash claimed submission of `text` in `namespace` at `now`.
fn by_hash_in(namespace: &str, text: &str, now: Millis) -> NewRequest {
    let body = body(text);
    let hash = hash_of(&body);
    NewRequest {
        id: Uuid::now_v7(),
        namespace: namespace.to_string(),
        route: Route::OpenaiChat,
        backend: "mock-openai".into(),
        model: Some("gpt-4o-mini".into()),
        stream: true,
        body,
        headers: vec![("openai-beta".into(), "assistants=v2".into())],
        hash,
        claim: ClaimKind::BodyHash,
        claim_key: hex::encode(hash),
        claim_expires_at: now + WINDOW,
        now,
        trace_parent: None,
        callback_url: None,
        replay_of: None,
    }
}

fn by_hash(text: &str, now: Millis) -> NewRequest {
    by_hash_in(NS, text, now)
}

/// An `Idempotency-Key` claimed submission (ID-5): `text` is the fingerprinted body.
fn by_key(key: &str, text: &str, now: Millis) -> NewRequest {
    let mut new = by_hash(text, now);
    new.claim = ClaimKind::Key;
    new.claim_key = format!("{} {key}", new.route.name());
    new.claim_expires_at = now + KEY_TTL;
    new
}

async fn create(store: &DynStore, new: NewRequest) -> RequestRecord {
    match store.submit(new).await.expect("submit") {
        Submitted::Created(record) => *record,
        other => panic!("expected Created, got {other:?}"),
    }
}

async fn attach(store: &DynStore, new: NewRequest) -> RequestRecord {
    match store.submit(new).await.expect("submit") {
        Submitted::Attached(record) => *record,
        other => panic!("expected Attached, got {other:?}"),
    }
}

async fn lease_at(store: &DynStore, owner: &str, now: Millis) -> (Lease, RequestRecord) {
    store
        .lease(owner, now, LEASE_MS)
        .await
        .expect("lease")
        .unwrap_or_else(|| panic!("nothing to lease at {now}"))
}

/// `Store::list` of `namespace` with only a status filter and the cursor (RD-7).
async fn list_of(
    store: &DynStore,
    namespace: &str,
    status: Option<Status>,
    before: Option<Uuid>,
    limit: i64,
) -> Result<Vec<RequestRecord>, holdfast::store::StoreError> {
    store
        .list(&holdfast::store::ListFilter {
            namespace: Some(namespace.to_string()),
            status,
            before,
            limit,
            ..Default::default()
        })
        .await
}

async fn get(store: &DynStore, id: Uuid) -> RequestRecord {
    store
        .get(NS, id)
        .await
        .expect("get")
        .unwrap_or_else(|| panic!("request {id} missing"))
}

async fn all_chunks(store: &DynStore, id: Uuid) -> Vec<Chunk> {
    store.chunks_after(id, 0, 100_000).await.expect("chunks")
}

/// The seq of request `id`'s last chunk (0 without any): every seq taken has its chunk.
async fn last_seq_of(store: &DynStore, id: Uuid) -> i64 {
    all_chunks(store, id).await.last().map_or(0, |c| c.seq)
}

fn new_chunks(prefix: &str, n: usize) -> Vec<NewChunk> {
    (0..n)
        .map(|i| NewChunk {
            event: (i % 2 == 1).then(|| "delta".into()),
            data: format!("{{\"part\":\"{prefix}-{i}\"}}").into(),
        })
        .collect()
}

/// Appends `chunks` after the request's last chunk, as its attempt would.
async fn append(store: &DynStore, lease: &Lease, chunks: Vec<NewChunk>) -> Option<Vec<Chunk>> {
    let after = last_seq_of(store, lease.id).await;
    let batch = ChunkBatch {
        lease: lease.clone(),
        after,
        chunks,
        upstream_request_id: None,
        response_id: None,
        usage: None,
    };
    let mut out = store.append_chunks(&[batch]).await.expect("append_chunks");
    assert_eq!(out.len(), 1);
    out.pop().flatten()
}

fn succeeded() -> Outcome {
    Outcome::Succeeded {
        status: 200,
        body: br#"{"id":"chatcmpl-1","choices":[]}"#.to_vec(),
        upstream_request_id: Some("req_up_1".into()),
        response_id: None,
        usage: None,
    }
}

fn error(kind: ErrorType, status: Option<u16>) -> ErrorInfo {
    ErrorInfo {
        kind,
        message: format!("{} happened", kind.as_str()),
        status,
    }
}

fn failed(kind: ErrorType) -> Outcome {
    Outcome::Failed {
        error: error(kind, None),
        response: None,
        upstream_request_id: None,
        usage: None,
    }
}

fn refused() -> Outcome {
    Outcome::Failed {
        error: error(ErrorType::UpstreamRefused, Some(400)),
        response: Some((400, br#"{"error":{"message":"bad"}}"#.to_vec())),
        upstream_request_id: Some("req_up_400".into()),
        usage: None,
    }
}

/// Asserts the request's chunk log ends with exactly one `end` chunk carrying `end_data`.
async fn assert_single_end(store: &DynStore, record: &RequestRecord) {
    let chunks = all_chunks(store, record.id).await;
    let ends: Vec<&Chunk> = chunks.iter().filter(|c| c.kind == ChunkKind::End).collect();
    assert_eq!(ends.len(), 1, "exactly one end chunk: {chunks:?}");
    let end = ends[0];
    assert_eq!(Some(end), chunks.last(), "end is the last chunk");
    assert_eq!(end.seq, record.last_seq, "end is at last_seq");
    assert_eq!(end.event, None);
    assert_eq!(&*end.data, end_data(record.status, record.error.as_ref()));
    // What the worker hands a stream's readers with its last batch instead of their reading
    // the log back (issue 30): the stored chunk, field for field.
    assert_eq!(
        Some(end),
        end_chunk(record).as_ref(),
        "end_chunk of the record"
    );
    let seqs: Vec<i64> = chunks.iter().map(|c| c.seq).collect();
    let expected: Vec<i64> = (1..=record.last_seq).collect();
    assert_eq!(seqs, expected, "seqs are 1..=last_seq without gaps");
}

// ---------------------------------------------------------------------------------------------
// Claims (ID-4 .. ID-7)
// ---------------------------------------------------------------------------------------------

async fn submit_creates_then_attaches_id4(store: DynStore) {
    let new = by_hash("hello", T0);
    let expected = new.clone();
    let first = create(&store, new).await;
    assert_eq!(first.id, expected.id);
    assert_eq!(first.namespace, NS);
    assert_eq!(first.route, Route::OpenaiChat);
    assert_eq!(first.backend, "mock-openai");
    assert_eq!(first.model.as_deref(), Some("gpt-4o-mini"));
    assert!(first.stream);
    assert_eq!(first.body, expected.body);
    assert_eq!(first.headers, expected.headers);
    assert_eq!(first.claim, ClaimKind::BodyHash);
    assert_eq!(first.status, Status::Pending);
    assert_eq!((first.attempts, first.recoveries), (0, 0));
    assert_eq!(first.next_retry_at, T0);
    assert_eq!((first.created_at, first.updated_at), (T0, T0));
    assert_eq!(first.finished_at, None);
    assert_eq!(first.error, None);
    assert_eq!((first.last_seq, first.reset_seq), (0, 0));
    assert_eq!(first.response_status, None);
    assert_eq!(first.response_body, None);

    // Same body inside the window: the same request.
    let again = attach(&store, by_hash("hello", T0 + WINDOW - 1)).await;
    assert_eq!(again.id, first.id);
    assert_eq!(again.status, Status::Pending);

    // Another body: another request.
    let other = create(&store, by_hash("world", T0 + 1)).await;
    assert_ne!(other.id, first.id);

    // Reads back as stored.
    let read = get(&store, first.id).await;
    assert_eq!(read.body, expected.body);
    assert_eq!(read.headers, expected.headers);
}

async fn body_hash_claims_are_per_namespace_id4(store: DynStore) {
    let a = create(&store, by_hash_in("team-a", "same", T0)).await;
    let b = create(&store, by_hash_in("team-b", "same", T0)).await;
    assert_ne!(a.id, b.id, "nothing crosses a namespace");
    let again = match store
        .submit(by_hash_in("team-b", "same", T0 + 1))
        .await
        .expect("submit")
    {
        Submitted::Attached(r) => r,
        other => panic!("expected Attached, got {other:?}"),
    };
    assert_eq!(again.id, b.id);
}

/// RD-9, DU-6: counts added while a request runs are added and nothing more; attachments added
/// after it finished are added and reported late, with the attachments it had before them
/// (the attempt that finished it counted only those as saved calls); replays and log reads
/// alone are not.
async fn attachments_added_after_a_request_finished_are_reported_late_rd9_du6(store: DynStore) {
    let rec = create(&store, by_hash("counted late", T0)).await;
    let count = |attached, replayed| holdfast::store::Counts {
        id: rec.id,
        attached,
        replayed,
        log_reads: 0,
    };
    let added = store.add_counts(&[count(2, 0)]).await.expect("add_counts");
    assert_eq!(added, holdfast::store::AddedCounts::default(), "it runs");
    run_to_success(&store, rec.id, T0 + 1).await;
    let added = store.add_counts(&[count(3, 1)]).await.expect("add_counts");
    assert!(added.busy.is_empty());
    assert_eq!(added.late, [(rec.id, 2)], "finished before these three");
    let added = store.add_counts(&[count(0, 4)]).await.expect("add_counts");
    assert!(added.late.is_empty(), "replays only: {added:?}");
    let stored = get(&store, rec.id).await;
    assert_eq!((stored.attached, stored.replayed), (5, 5));
}

/// Runs request `id` (the only one due) to success at `now`.
async fn run_to_success(store: &DynStore, id: Uuid, now: Millis) {
    let (lease, leased) = lease_at(store, "node/a", now).await;
    assert_eq!(leased.id, id);
    assert!(
        store
            .finish(&lease, succeeded(), now)
            .await
            .expect("finish")
    );
}

async fn expired_claim_is_taken_over_by_a_new_request_id4(store: DynStore) {
    let first = create(&store, by_hash("hello", T0)).await;
    run_to_success(&store, first.id, T0 + 1).await;
    // The window is counted from the claimed request's submission; at its end it is over.
    let second = create(&store, by_hash("hello", T0 + WINDOW)).await;
    assert_ne!(second.id, first.id);
    // The new claim runs from the new submission.
    let third = attach(&store, by_hash("hello", T0 + WINDOW + 1)).await;
    assert_eq!(third.id, second.id);
    // The old request is still there, untouched.
    assert_eq!(get(&store, first.id).await.status, Status::Succeeded);
}

/// ID-4: a claim lives past its window while its request has not finished, so an SDK's retry
/// after a client-side timeout, sent while the provider call still runs, attaches to that call
/// instead of paying for a second one; once the request has finished, the window decides.
async fn a_claim_lives_past_its_window_while_its_request_runs_id4(store: DynStore) {
    let first = create(&store, by_hash("long call", T0)).await;
    // Pending (due, or waiting out a backoff) past the window: still the same request.
    let again = attach(&store, by_hash("long call", T0 + WINDOW + 1)).await;
    assert_eq!(again.id, first.id);
    // Running past the window: the same.
    let (lease, _) = lease_at(&store, "node/a", T0 + WINDOW + 2).await;
    let again = attach(&store, by_hash("long call", T0 + 2 * WINDOW)).await;
    assert_eq!(again.id, first.id);
    // Keyed claims too, past the key's lifetime.
    let keyed = create(&store, by_key("k-long", "body", T0)).await;
    let again = attach(&store, by_key("k-long", "body", T0 + KEY_TTL + 1)).await;
    assert_eq!(again.id, keyed.id);
    // Finished: the window counted from the submission is over, and the next send is new.
    assert!(
        store
            .finish(&lease, succeeded(), T0 + 2 * WINDOW + 1)
            .await
            .expect("finish")
    );
    let next = create(&store, by_hash("long call", T0 + 2 * WINDOW + 2)).await;
    assert_ne!(next.id, first.id);
}

async fn keyed_claim_with_another_fingerprint_is_key_mismatch_id5(store: DynStore) {
    let first = create(&store, by_key("k-1", "body A", T0)).await;
    assert_eq!(first.claim, ClaimKind::Key);
    match store
        .submit(by_key("k-1", "body B", T0 + 1))
        .await
        .expect("submit")
    {
        Submitted::KeyMismatch { existing } => assert_eq!(existing, first.id),
        other => panic!("expected KeyMismatch, got {other:?}"),
    }
    // Same key, same body: the same request.
    assert_eq!(
        attach(&store, by_key("k-1", "body A", T0 + 2)).await.id,
        first.id
    );
    // A fresh key with the same body asks for a second sample.
    let second = create(&store, by_key("k-2", "body A", T0 + 3)).await;
    assert_ne!(second.id, first.id);
    // The body hash is only a fingerprint under a key: no body-hash claim was made.
    let plain = create(&store, by_hash("body A", T0 + 4)).await;
    assert_ne!(plain.id, first.id);
    // After the key's lifetime another body may take it, once its request has finished.
    let (lease, leased) = lease_at(&store, "node/a", T0 + 5).await;
    assert_eq!(leased.id, first.id);
    assert!(
        store
            .finish(&lease, succeeded(), T0 + 5)
            .await
            .expect("finish")
    );
    let later = create(&store, by_key("k-1", "body B", T0 + KEY_TTL)).await;
    assert_ne!(later.id, first.id);
}

/// Spawns `n` tasks that submit what `make` returns at the same moment.
async fn race_submits(
    store: &DynStore,
    n: usize,
    make: impl Fn(usize) -> NewRequest,
) -> Vec<Submitted> {
    let barrier = Arc::new(Barrier::new(n));
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        let store = store.clone();
        let barrier = barrier.clone();
        let new = make(i);
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            store
                .submit(new)
                .await
                .expect("racing submit must not error")
        }));
    }
    let mut out = Vec::with_capacity(n);
    for task in tasks {
        out.push(task.await.expect("task"));
    }
    out
}

fn created_and_attached(results: &[Submitted]) -> (Vec<Uuid>, Vec<Uuid>) {
    let mut created = Vec::new();
    let mut attached = Vec::new();
    for r in results {
        match r {
            Submitted::Created(rec) => created.push(rec.id),
            Submitted::Attached(rec) => attached.push(rec.id),
            Submitted::KeyMismatch { existing } => panic!("unexpected mismatch with {existing}"),
        }
    }
    (created, attached)
}

async fn racing_identical_submits_create_exactly_one_request_id7(store: DynStore) {
    let results = race_submits(&store, 50, |_| by_hash("race", T0)).await;
    let (created, attached) = created_and_attached(&results);
    assert_eq!(created.len(), 1, "exactly one Created");
    assert_eq!(attached.len(), 49);
    assert!(attached.iter().all(|id| *id == created[0]));
    let listed = list_of(&store, NS, None, None, 100).await.expect("list");
    assert_eq!(listed.len(), 1, "exactly one request recorded");
}

async fn racing_takeovers_of_an_expired_claim_create_exactly_one_request_id7(store: DynStore) {
    let old = create(&store, by_hash("race", T0)).await;
    run_to_success(&store, old.id, T0 + 1).await;
    let now = T0 + WINDOW + 5;
    let results = race_submits(&store, 50, |_| by_hash("race", now)).await;
    let (created, attached) = created_and_attached(&results);
    assert_eq!(created.len(), 1, "exactly one takeover");
    assert_ne!(created[0], old.id);
    assert!(attached.iter().all(|id| *id == created[0]));
    assert_eq!(
        list_of(&store, NS, None, None, 100)
            .await
            .expect("list")
            .len(),
        2
    );
}

async fn racing_keyed_submits_create_one_request_and_mismatch_the_rest_id5_id7(store: DynStore) {
    // Half send body A, half body B, all under one key: one request; its body's senders attach,
    // the others get KeyMismatch naming it.
    let results = race_submits(&store, 40, |i| {
        by_key("shared", if i % 2 == 0 { "A" } else { "B" }, T0)
    })
    .await;
    let mut created = Vec::new();
    let mut attached = 0;
    let mut mismatched = Vec::new();
    for r in &results {
        match r {
            Submitted::Created(rec) => created.push(rec.id),
            Submitted::Attached(_) => attached += 1,
            Submitted::KeyMismatch { existing } => mismatched.push(*existing),
        }
    }
    assert_eq!(created.len(), 1);
    assert_eq!(attached, 19);
    assert_eq!(mismatched.len(), 20);
    assert!(mismatched.iter().all(|id| *id == created[0]));
}

async fn get_reads_only_its_own_namespace(store: DynStore) {
    let rec = create(&store, by_hash_in("team-a", "mine", T0)).await;
    assert!(store.get("team-a", rec.id).await.expect("get").is_some());
    assert!(store.get("team-b", rec.id).await.expect("get").is_none());
    assert!(
        store
            .get("team-a", Uuid::now_v7())
            .await
            .expect("get")
            .is_none()
    );
}

/// A held call's periodic re-read peeks (RS-1): the record as `get` reads it, status, outcome
/// and counters, without the request's body and headers, its trace parent and replay origin,
/// or the stored answer; scoped to its namespace as `get` is.
async fn a_peek_reads_what_get_reads_but_the_request_and_its_answer_rs1(store: DynStore) {
    let mut new = by_hash("peeked", T0);
    new.trace_parent = Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into());
    let rec = create(&store, new).await;
    let without_the_request = |mut r: RequestRecord| {
        r.body.clear();
        r.headers.clear();
        r.trace_parent = None;
        r.replay_of = None;
        r.response_body = None;
        r
    };
    let peek = |namespace: &'static str| {
        let store = store.clone();
        async move { store.peek(namespace, rec.id).await.expect("peek") }
    };
    let pending = get(&store, rec.id).await;
    assert!(!pending.body.is_empty() && !pending.headers.is_empty());
    assert_eq!(peek(NS).await, Some(without_the_request(pending)));
    run_to_success(&store, rec.id, T0 + 5).await;
    let settled = get(&store, rec.id).await;
    assert!(settled.response_body.is_some());
    assert_eq!(peek(NS).await, Some(without_the_request(settled)));
    assert_eq!(peek("elsewhere").await, None, "another namespace's id");
}

// ---------------------------------------------------------------------------------------------
// Leases and fencing (LC-2, LC-3, LC-5)
// ---------------------------------------------------------------------------------------------

async fn lease_takes_only_due_pending_requests_oldest_first_lc2(store: DynStore) {
    let late = create(&store, by_hash("late", T0 + 100)).await;
    let early = create(&store, by_hash("early", T0)).await;
    assert!(
        store
            .lease("w", T0 - 1, LEASE_MS)
            .await
            .expect("lease")
            .is_none(),
        "nothing is due before next_retry_at"
    );
    let (lease, rec) = lease_at(&store, "node/a", T0 + 100).await;
    assert_eq!(lease.id, early.id, "oldest next_retry_at first");
    assert_eq!(&*lease.owner, "node/a");
    assert_eq!(lease.attempt, 1);
    assert_eq!(rec.status, Status::Running);
    assert_eq!(rec.attempts, 1);
    assert_eq!(rec.updated_at, T0 + 100);
    assert_eq!(get(&store, early.id).await.status, Status::Running);

    let (lease2, rec2) = lease_at(&store, "node/b", T0 + 100).await;
    assert_eq!(lease2.id, late.id);
    assert_eq!(rec2.attempts, 1);
    // A running request is not pending: nothing left.
    assert!(
        store
            .lease("node/c", T0 + 10_000_000, LEASE_MS)
            .await
            .expect("lease")
            .is_none()
    );
}

async fn concurrent_leasers_never_share_a_request_lc2(store: DynStore) {
    for i in 0..10 {
        create(&store, by_hash(&format!("job {i}"), T0 + i)).await;
    }
    let barrier = Arc::new(Barrier::new(20));
    let mut tasks = Vec::new();
    for w in 0..20 {
        let store = store.clone();
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            store
                .lease(&format!("node/{w}"), T0 + 1000, LEASE_MS)
                .await
                .expect("concurrent lease must not error")
        }));
    }
    let mut leased = Vec::new();
    for task in tasks {
        if let Some((lease, rec)) = task.await.expect("task") {
            assert_eq!(rec.attempts, 1);
            assert_eq!(lease.attempt, 1);
            leased.push(lease.id);
        }
    }
    assert_eq!(leased.len(), 10, "every request leased once");
    let distinct: HashSet<Uuid> = leased.iter().copied().collect();
    assert_eq!(distinct.len(), 10, "no request leased twice");
}

async fn heartbeat_extends_the_lease_and_fails_once_it_is_lost_lc3(store: DynStore) {
    create(&store, by_hash("beat", T0)).await;
    let (lease, _) = store
        .lease("node/a", T0, 1_000)
        .await
        .expect("lease")
        .expect("due");
    assert!(store.heartbeat(&lease, T0 + 500, 1_000).await.expect("hb"));
    // Without the heartbeat the lease would have expired at T0 + 1000.
    let swept = store.sweep(T0 + 1_200, MAX_ATTEMPTS).await.expect("sweep");
    assert!(swept.recovered.is_empty() && swept.failed.is_empty());
    assert_eq!(get(&store, lease.id).await.status, Status::Running);

    let swept = store.sweep(T0 + 1_501, MAX_ATTEMPTS).await.expect("sweep");
    assert_eq!(swept.recovered, vec![lease.id]);
    assert!(
        !store
            .heartbeat(&lease, T0 + 1_600, 1_000)
            .await
            .expect("hb"),
        "a swept lease is lost"
    );
    // Another owner's heartbeat does not renew someone else's lease either.
    let (lease2, _) = lease_at(&store, "node/b", T0 + 2_000).await;
    let impostor = Lease {
        owner: "node/a".into(),
        ..lease2.clone()
    };
    assert!(
        !store
            .heartbeat(&impostor, T0 + 2_001, 1_000)
            .await
            .expect("hb")
    );
    assert!(
        store
            .heartbeat(&lease2, T0 + 2_001, 1_000)
            .await
            .expect("hb")
    );
}

async fn stale_owner_writes_nothing_lc3(store: DynStore) {
    create(&store, by_hash("stale", T0)).await;
    let (stale, _) = lease_at(&store, "node/a", T0).await;
    assert!(append(&store, &stale, new_chunks("a", 2)).await.is_some());
    store
        .sweep(T0 + LEASE_MS + 1, MAX_ATTEMPTS)
        .await
        .expect("sweep");
    let (fresh, _) = lease_at(&store, "node/b", T0 + LEASE_MS + 1).await;
    assert_eq!(fresh.attempt, 2);
    let before = get(&store, stale.id).await;
    let chunks_before = all_chunks(&store, stale.id).await;

    assert!(append(&store, &stale, new_chunks("x", 3)).await.is_none());
    assert!(
        !store
            .finish(&stale, succeeded(), T0 + LEASE_MS + 2)
            .await
            .expect("finish")
    );
    assert!(
        !store
            .finish(&stale, refused(), T0 + LEASE_MS + 2)
            .await
            .expect("finish")
    );
    let retry = Outcome::Retry {
        next_retry_at: T0 + 1,
        error: error(ErrorType::AttemptsExhausted, Some(503)),
    };
    assert!(
        !store
            .finish(&stale, retry, T0 + LEASE_MS + 2)
            .await
            .expect("finish")
    );
    assert!(
        !store
            .release(&stale, T0 + LEASE_MS + 2, MAX_ATTEMPTS)
            .await
            .expect("release")
    );
    assert!(
        !store
            .heartbeat(&stale, T0 + LEASE_MS + 2, LEASE_MS)
            .await
            .expect("hb")
    );

    let after = get(&store, stale.id).await;
    assert_eq!(after.status, Status::Running);
    assert_eq!(after.attempts, 2);
    assert_eq!(after.last_seq, before.last_seq);
    assert_eq!(after.updated_at, before.updated_at);
    assert_eq!(after.response_body, None);
    assert_eq!(all_chunks(&store, stale.id).await, chunks_before);

    // The current owner still can.
    assert!(
        store
            .finish(&fresh, succeeded(), T0 + LEASE_MS + 3)
            .await
            .expect("finish")
    );
    assert_eq!(get(&store, stale.id).await.status, Status::Succeeded);
}

async fn retry_goes_back_to_pending_until_next_retry_at_lc5(store: DynStore) {
    let rec = create(&store, by_hash("flaky", T0)).await;
    let (lease, _) = lease_at(&store, "node/a", T0).await;
    let err = error(ErrorType::AttemptsExhausted, Some(503));
    let retry = Outcome::Retry {
        next_retry_at: T0 + 5_000,
        error: err.clone(),
    };
    assert!(store.finish(&lease, retry, T0 + 10).await.expect("finish"));
    let after = get(&store, rec.id).await;
    assert_eq!(after.status, Status::Pending);
    assert_eq!(after.next_retry_at, T0 + 5_000);
    assert_eq!(
        after.error,
        Some(err),
        "the last transient error stays readable"
    );
    assert_eq!(after.attempts, 1);
    assert_eq!(after.recoveries, 0);
    assert_eq!(after.finished_at, None);
    assert_eq!(after.updated_at, T0 + 10);
    assert!(
        all_chunks(&store, rec.id).await.is_empty(),
        "not terminal: no end"
    );
    // The claim is kept: a re-send attaches.
    assert_eq!(attach(&store, by_hash("flaky", T0 + 20)).await.id, rec.id);
    // The lease is gone.
    assert!(
        !store
            .heartbeat(&lease, T0 + 20, LEASE_MS)
            .await
            .expect("hb")
    );

    assert!(
        store
            .lease("node/b", T0 + 4_999, LEASE_MS)
            .await
            .expect("lease")
            .is_none()
    );
    let (again, rec2) = lease_at(&store, "node/b", T0 + 5_000).await;
    assert_eq!(again.id, rec.id);
    assert_eq!(again.attempt, 2);
    assert_eq!(rec2.attempts, 2);
    assert!(
        store
            .finish(&again, succeeded(), T0 + 5_001)
            .await
            .expect("finish")
    );
    let done = get(&store, rec.id).await;
    assert_eq!(done.status, Status::Succeeded);
    assert_eq!(done.error, None, "success clears the transient error");
}

async fn failure_releases_a_body_hash_claim_a_minute_later_id6_id6a(store: DynStore) {
    for (i, outcome) in [
        failed(ErrorType::AttemptsExhausted),
        refused(),
        failed(ErrorType::StreamInterrupted),
        failed(ErrorType::UpstreamInvalid),
    ]
    .into_iter()
    .enumerate()
    {
        let text = format!("doomed {i}");
        let now = T0 + 2 * FAILURE_WINDOW_MS * i as i64;
        let rec = create(&store, by_hash(&text, now)).await;
        let (lease, _) = lease_at(&store, "node/a", now).await;
        assert!(
            store
                .finish(&lease, outcome, now + 1)
                .await
                .expect("finish")
        );
        // Within the minute an identical send is the failed request: a client's retry of the
        // failure costs no provider call (ID-6a).
        let retried = attach(&store, by_hash(&text, now + 2)).await;
        assert_eq!(retried.id, rec.id);
        assert_eq!(retried.status, Status::Failed);
        let last = attach(&store, by_hash(&text, now + FAILURE_WINDOW_MS)).await;
        assert_eq!(last.id, rec.id, "the minute counts from the failure");
        let again = create(&store, by_hash(&text, now + 1 + FAILURE_WINDOW_MS)).await;
        assert_ne!(again.id, rec.id, "then the same body starts a new request");
        // Lease the new one too, so the next round's lease picks its own request.
        let (l, _) = lease_at(&store, "node/a", now + 1 + FAILURE_WINDOW_MS).await;
        assert_eq!(l.id, again.id);
    }
}

async fn keyed_claim_survives_upstream_refused_and_replays_id6(store: DynStore) {
    let rec = create(&store, by_key("k", "bad request", T0)).await;
    let (lease, _) = lease_at(&store, "node/a", T0).await;
    assert!(
        store
            .finish(&lease, refused(), T0 + 1)
            .await
            .expect("finish")
    );
    let replay = attach(&store, by_key("k", "bad request", T0 + 2)).await;
    assert_eq!(replay.id, rec.id);
    assert_eq!(replay.status, Status::Failed);
    assert_eq!(replay.response_status, Some(400));
    assert_eq!(
        replay.response_body.as_deref(),
        Some(&br#"{"error":{"message":"bad"}}"#[..])
    );
    assert_eq!(replay.upstream_request_id.as_deref(), Some("req_up_400"));
    let err = replay.error.expect("error");
    assert_eq!(err.kind, ErrorType::UpstreamRefused);
    assert_eq!(err.status, Some(400));
    assert_eq!(replay.finished_at, Some(T0 + 1));
}

async fn a_failure_never_extends_a_claim_past_its_own_window_id6a(store: DynStore) {
    // A claim whose window ends 10 s after its submission, failed at 5 s: it expires at 10 s,
    // not at 5 s plus the minute.
    let mut new = by_hash("short window", T0);
    new.claim_expires_at = T0 + 10_000;
    let rec = create(&store, new).await;
    let (lease, _) = lease_at(&store, "node/a", T0).await;
    assert!(
        store
            .finish(&lease, failed(ErrorType::AttemptsExhausted), T0 + 5_000)
            .await
            .expect("finish")
    );
    assert_eq!(
        attach(&store, by_hash("short window", T0 + 9_999)).await.id,
        rec.id
    );
    let again = create(&store, by_hash("short window", T0 + 10_000)).await;
    assert_ne!(again.id, rec.id);
}

async fn keyed_claim_is_released_a_minute_after_transient_exhaustion_id6_id6a(store: DynStore) {
    let rec = create(&store, by_key("k", "flaky", T0)).await;
    let (lease, _) = lease_at(&store, "node/a", T0).await;
    assert!(
        store
            .finish(&lease, failed(ErrorType::AttemptsExhausted), T0 + 1)
            .await
            .expect("finish")
    );
    assert_eq!(
        attach(&store, by_key("k", "flaky", T0 + 2)).await.id,
        rec.id
    );
    let again = create(&store, by_key("k", "flaky", T0 + 2 + FAILURE_WINDOW_MS)).await;
    assert_ne!(again.id, rec.id);
}

// ---------------------------------------------------------------------------------------------
// Sweep (LC-4, LC-8)
// ---------------------------------------------------------------------------------------------

async fn sweep_recovers_expired_leases_and_resets_only_after_stored_chunks_lc4_lc8(
    store: DynStore,
) {
    let streamed = create(&store, by_hash("streamed", T0)).await;
    let quiet = create(&store, by_hash("quiet", T0 + 1)).await;
    let (l1, _) = lease_at(&store, "node/a", T0 + 1).await;
    let (l2, _) = lease_at(&store, "node/a", T0 + 1).await;
    assert_eq!((l1.id, l2.id), (streamed.id, quiet.id));
    append(&store, &l1, new_chunks("a1", 2)).await.expect("own");

    // Not yet expired: nothing happens.
    let none = store
        .sweep(T0 + 1 + LEASE_MS - 1, MAX_ATTEMPTS)
        .await
        .expect("sweep");
    assert_eq!(none, Default::default());

    let t1 = T0 + 1 + LEASE_MS + 1;
    let swept = store.sweep(t1, MAX_ATTEMPTS).await.expect("sweep");
    let recovered: HashSet<Uuid> = swept.recovered.iter().copied().collect();
    assert_eq!(recovered, HashSet::from([streamed.id, quiet.id]));
    assert!(swept.failed.is_empty());

    for id in [streamed.id, quiet.id] {
        let rec = get(&store, id).await;
        assert_eq!(rec.status, Status::Pending);
        assert_eq!(rec.recoveries, 1);
        assert_eq!(rec.attempts, 1, "the abandoned attempt still counts");
        assert_eq!(rec.next_retry_at, t1, "due at once");
        assert_eq!(rec.updated_at, t1);
    }
    // The streamed one: data 1, 2, then a reset naming attempt 2 (LC-8).
    let chunks = all_chunks(&store, streamed.id).await;
    assert_eq!(chunks.len(), 3);
    assert_eq!(chunks[2].kind, ChunkKind::Reset);
    assert_eq!(chunks[2].seq, 3);
    assert_eq!(chunks[2].attempt, 2);
    assert_eq!(&*chunks[2].data, "2");
    assert_eq!(chunks[2].event, None);
    let rec = get(&store, streamed.id).await;
    assert_eq!((rec.last_seq, rec.reset_seq), (3, 3));
    // The quiet one stored nothing: no reset.
    assert!(all_chunks(&store, quiet.id).await.is_empty());
    assert_eq!(get(&store, quiet.id).await.reset_seq, 0);

    // Attempt 2 continues the numbering after the reset.
    let (l1b, _) = lease_at(&store, "node/b", t1).await;
    assert_eq!((l1b.id, l1b.attempt), (streamed.id, 2));
    let stored = append(&store, &l1b, new_chunks("a2", 1))
        .await
        .expect("own");
    assert_eq!(stored[0].seq, 4);
    assert_eq!(stored[0].attempt, 2);
    let (l2b, _) = lease_at(&store, "node/b", t1).await;
    assert_eq!(l2b.id, quiet.id);

    // Attempt 2 dies too: a second reset, naming attempt 3.
    let t2 = t1 + LEASE_MS + 1;
    store.sweep(t2, MAX_ATTEMPTS).await.expect("sweep");
    let chunks = all_chunks(&store, streamed.id).await;
    assert_eq!(chunks.len(), 5);
    assert_eq!(
        (chunks[4].kind, chunks[4].seq, &*chunks[4].data),
        (ChunkKind::Reset, 5, "3")
    );
    assert_eq!(get(&store, streamed.id).await.recoveries, 2);

    // Attempt 3 stores nothing and dies: no reset after a reset.
    let (l1c, _) = lease_at(&store, "node/c", t2).await;
    assert_eq!((l1c.id, l1c.attempt), (streamed.id, 3));
    store
        .sweep(t2 + LEASE_MS + 1, MAX_ATTEMPTS)
        .await
        .expect("sweep");
    assert_eq!(all_chunks(&store, streamed.id).await.len(), 5);
    let rec = get(&store, streamed.id).await;
    assert_eq!((rec.recoveries, rec.last_seq, rec.reset_seq), (3, 5, 5));
}

async fn sweep_fails_with_lease_expired_when_attempts_are_used_up_lc4(store: DynStore) {
    let hashed = create(&store, by_hash("last try", T0)).await;
    let keyed = create(&store, by_key("k", "last keyed try", T0 + 1)).await;
    let (l1, _) = lease_at(&store, "node/a", T0 + 1).await;
    lease_at(&store, "node/a", T0 + 1).await;
    append(&store, &l1, new_chunks("a", 2)).await.expect("own");
    let now = T0 + 1 + LEASE_MS + 1;
    // max_attempts = 1: the one attempt is used up.
    let swept = store.sweep(now, 1).await.expect("sweep");
    assert!(swept.recovered.is_empty());
    let failed: HashSet<Uuid> = swept.failed.iter().copied().collect();
    assert_eq!(failed, HashSet::from([hashed.id, keyed.id]));
    for id in [hashed.id, keyed.id] {
        let rec = get(&store, id).await;
        assert_eq!(rec.status, Status::Failed);
        assert_eq!(rec.finished_at, Some(now));
        assert_eq!(rec.recoveries, 0);
        let err = rec.error.clone().expect("error");
        assert_eq!(err.kind, ErrorType::LeaseExpired);
        assert!(!err.message.is_empty());
        assert_eq!(err.status, None);
        assert_single_end(&store, &rec).await;
        assert!(
            !all_chunks(&store, id)
                .await
                .iter()
                .any(|c| c.kind == ChunkKind::Reset),
            "no reset before a final end"
        );
    }
    assert_eq!(get(&store, hashed.id).await.last_seq, 3, "data 1, 2, end 3");
    // Both claims are released (ID-6: lease_expired is not a provider refusal), a minute later
    // (ID-6a).
    assert_eq!(
        attach(&store, by_hash("last try", now + 1)).await.id,
        hashed.id
    );
    let later = now + 1 + FAILURE_WINDOW_MS;
    assert_ne!(
        create(&store, by_hash("last try", later)).await.id,
        hashed.id
    );
    assert_ne!(
        create(&store, by_key("k", "last keyed try", later))
            .await
            .id,
        keyed.id
    );
}

/// Leases `n` requests, gives each a stored chunk, and sweeps them with 8 racing sweepers.
async fn race_sweeps(store: &DynStore, n: usize, max_attempts: u32) -> (Vec<Uuid>, Vec<Uuid>) {
    let mut ids = Vec::new();
    for i in 0..n {
        let rec = create(store, by_hash(&format!("swept {i}"), T0 + i as i64)).await;
        ids.push(rec.id);
    }
    for _ in 0..n {
        let (lease, _) = lease_at(store, "node/dead", T0 + n as i64).await;
        append(store, &lease, new_chunks("d", 1))
            .await
            .expect("own");
    }
    let now = T0 + n as i64 + LEASE_MS + 1;
    let barrier = Arc::new(Barrier::new(8));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let store = store.clone();
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            store
                .sweep(now, max_attempts)
                .await
                .expect("racing sweep must not error")
        }));
    }
    let mut recovered = Vec::new();
    let mut failed = Vec::new();
    for task in tasks {
        let swept = task.await.expect("task");
        recovered.extend(swept.recovered);
        failed.extend(swept.failed);
    }
    (recovered, failed)
}

async fn racing_sweeps_recover_each_request_once_lc4(store: DynStore) {
    let (mut recovered, failed) = race_sweeps(&store, 10, MAX_ATTEMPTS).await;
    assert!(failed.is_empty());
    assert_eq!(
        recovered.len(),
        10,
        "each request recovered by exactly one sweeper"
    );
    recovered.sort();
    recovered.dedup();
    assert_eq!(recovered.len(), 10);
    for id in recovered {
        let rec = get(&store, id).await;
        assert_eq!(rec.status, Status::Pending);
        assert_eq!(rec.recoveries, 1);
        let chunks = all_chunks(&store, id).await;
        let resets = chunks.iter().filter(|c| c.kind == ChunkKind::Reset).count();
        assert_eq!(resets, 1, "one reset, not one per sweeper: {chunks:?}");
        assert_eq!(rec.last_seq, 2);
    }
}

async fn racing_sweeps_fail_each_request_once_lc4(store: DynStore) {
    let (recovered, mut failed) = race_sweeps(&store, 10, 1).await;
    assert!(recovered.is_empty());
    assert_eq!(
        failed.len(),
        10,
        "each request failed by exactly one sweeper"
    );
    failed.sort();
    failed.dedup();
    assert_eq!(failed.len(), 10);
    for id in failed {
        let rec = get(&store, id).await;
        assert_eq!(rec.status, Status::Failed);
        assert_single_end(&store, &rec).await;
    }
}

// ---------------------------------------------------------------------------------------------
// Chunks (LC-7, LC-8, RD-2..RD-6)
// ---------------------------------------------------------------------------------------------

async fn append_chunks_assigns_consecutive_seqs_across_batches(store: DynStore) {
    let rec = create(&store, by_hash("stream", T0)).await;
    let (lease, _) = lease_at(&store, "node/a", T0).await;
    let first = ChunkBatch {
        lease: lease.clone(),
        after: 0,
        chunks: new_chunks("one", 3),
        upstream_request_id: Some("req_up_stream".into()),
        response_id: None,
        usage: None,
    };
    let second = ChunkBatch {
        lease: lease.clone(),
        after: 3,
        chunks: new_chunks("two", 2),
        upstream_request_id: None,
        response_id: None,
        usage: None,
    };
    let out = store.append_chunks(&[first, second]).await.expect("append");
    let seqs: Vec<Vec<i64>> = out
        .iter()
        .map(|b| b.as_ref().expect("own").iter().map(|c| c.seq).collect())
        .collect();
    assert_eq!(seqs, vec![vec![1, 2, 3], vec![4, 5]]);
    let returned: Vec<Chunk> = out.into_iter().flatten().flatten().collect();

    // A later call continues; an empty batch stores nothing and still succeeds.
    let third = append(&store, &lease, new_chunks("three", 1))
        .await
        .expect("own");
    assert_eq!(third[0].seq, 6);
    assert_eq!(append(&store, &lease, Vec::new()).await, Some(Vec::new()));

    // A big batch (more rows than one SQLite statement may bind) stays consecutive.
    let big = append(&store, &lease, new_chunks("big", 2_500))
        .await
        .expect("own");
    assert_eq!(big.first().map(|c| c.seq), Some(7));
    assert_eq!(big.last().map(|c| c.seq), Some(2_506));

    let stored = all_chunks(&store, rec.id).await;
    assert_eq!(stored.len(), 2_506);
    assert_eq!(
        &stored[..5],
        &returned[..],
        "returned chunks are what is stored"
    );
    for (i, c) in stored.iter().enumerate() {
        assert_eq!(c.seq, i as i64 + 1);
        assert_eq!(c.kind, ChunkKind::Data);
        assert_eq!(c.attempt, 1);
    }
    assert_eq!(stored[0].event, None);
    assert_eq!(stored[1].event.as_deref(), Some("delta"));
    assert_eq!(&*stored[0].data, r#"{"part":"one-0"}"#);
    let after = get(&store, rec.id).await;
    assert_eq!(after.last_seq, 2_506);
    assert_eq!(after.upstream_request_id.as_deref(), Some("req_up_stream"));
}

async fn append_chunks_group_commit_keeps_each_requests_order(store: DynStore) {
    // One call carrying batches of several requests, interleaved: each request numbers its own.
    let mut leases = Vec::new();
    for i in 0..4 {
        create(&store, by_hash(&format!("s{i}"), T0 + i)).await;
        leases.push(lease_at(&store, &format!("node/{i}"), T0 + 10).await.0);
    }
    let mut batches = Vec::new();
    for round in 0..3 {
        for lease in leases.iter().rev() {
            batches.push(ChunkBatch {
                lease: lease.clone(),
                after: 2 * round,
                chunks: new_chunks(&format!("r{round}"), 2),
                upstream_request_id: None,
                response_id: None,
                usage: None,
            });
        }
    }
    let out = store.append_chunks(&batches).await.expect("append");
    assert_eq!(out.len(), batches.len());
    for (batch, result) in batches.iter().zip(&out) {
        let chunks = result.as_ref().expect("own");
        assert_eq!(chunks.len(), 2);
        assert_eq!(
            chunks[0].data, batch.chunks[0].data,
            "results in batch order"
        );
    }
    for lease in &leases {
        let stored = all_chunks(&store, lease.id).await;
        let data: Vec<&str> = stored.iter().map(|c| &*c.data).collect();
        assert_eq!(
            data,
            vec![
                r#"{"part":"r0-0"}"#,
                r#"{"part":"r0-1"}"#,
                r#"{"part":"r1-0"}"#,
                r#"{"part":"r1-1"}"#,
                r#"{"part":"r2-0"}"#,
                r#"{"part":"r2-1"}"#,
            ]
        );
        let seqs: Vec<i64> = stored.iter().map(|c| c.seq).collect();
        assert_eq!(seqs, vec![1, 2, 3, 4, 5, 6]);
    }
}

async fn append_chunks_returns_none_for_a_lost_lease_lc3(store: DynStore) {
    let a = create(&store, by_hash("a", T0)).await;
    let b = create(&store, by_hash("b", T0 + 1)).await;
    let (la, _) = lease_at(&store, "node/a", T0 + 1).await;
    let (lb, _) = lease_at(&store, "node/b", T0 + 1).await;
    assert_eq!((la.id, lb.id), (a.id, b.id));
    store.cancel(NS, b.id, T0 + 2).await.expect("cancel");
    let b_before = all_chunks(&store, b.id).await;
    let out = store
        .append_chunks(&[
            ChunkBatch {
                lease: lb.clone(),
                after: 0,
                chunks: new_chunks("lost", 2),
                upstream_request_id: Some("nope".into()),
                response_id: None,
                usage: None,
            },
            ChunkBatch {
                lease: la.clone(),
                after: 0,
                chunks: new_chunks("kept", 2),
                upstream_request_id: None,
                response_id: None,
                usage: None,
            },
        ])
        .await
        .expect("append");
    assert!(out[0].is_none(), "lost lease: nothing written");
    assert_eq!(out[1].as_ref().map(Vec::len), Some(2));
    assert_eq!(all_chunks(&store, b.id).await, b_before);
    assert_eq!(get(&store, b.id).await.upstream_request_id, None);
    assert_eq!(all_chunks(&store, a.id).await.len(), 2);
    // A lease naming a request that does not exist is lost too.
    let ghost = Lease {
        id: Uuid::now_v7(),
        owner: "node/a".into(),
        attempt: 1,
    };
    assert_eq!(append(&store, &ghost, new_chunks("g", 1)).await, None);
}

async fn append_chunks_fences_each_attempt_of_one_request_in_one_commit_lc3(store: DynStore) {
    // A stale attempt's batch among the current attempt's, in one commit: only the current
    // attempt's are stored, numbered after the reset, and its usage is the last it reported.
    let rec = create(&store, by_hash("two-attempts", T0)).await;
    let (old, _) = lease_at(&store, "node/old", T0).await;
    append(&store, &old, new_chunks("old", 2))
        .await
        .expect("own");
    let swept = store
        .sweep(T0 + LEASE_MS + 1, MAX_ATTEMPTS)
        .await
        .expect("sweep");
    assert_eq!(swept.recovered, vec![rec.id]);
    let (new, _) = lease_at(&store, "node/new", T0 + LEASE_MS + 2).await;
    assert_eq!(new.attempt, 2);
    let usage = |n| Usage {
        output_tokens: Some(n),
        ..Usage::default()
    };
    let batch = |lease: &Lease, after: i64, prefix: &str, reported: u64| ChunkBatch {
        lease: lease.clone(),
        after,
        chunks: new_chunks(prefix, 2),
        upstream_request_id: None,
        response_id: None,
        usage: Some(usage(reported)),
    };
    let out = store
        .append_chunks(&[
            batch(&new, 3, "a", 1),
            batch(&old, 2, "stale", 99),
            batch(&new, 5, "b", 2),
        ])
        .await
        .expect("append");
    assert!(out[1].is_none(), "the stale attempt writes nothing");
    let seqs: Vec<Vec<i64>> = [&out[0], &out[2]]
        .iter()
        .map(|b| b.as_ref().expect("own").iter().map(|c| c.seq).collect())
        .collect();
    // Two chunks of the first attempt, its reset at 3, then the second attempt's.
    assert_eq!(seqs, vec![vec![4, 5], vec![6, 7]]);
    let stored = all_chunks(&store, rec.id).await;
    assert_eq!(stored.len(), 7);
    assert!(stored.iter().all(|c| !c.data.contains("stale")));
    assert_eq!(stored[2].kind, ChunkKind::Reset);
    assert_eq!(
        store.attempt_usage(rec.id).await.expect("usage"),
        vec![(2, usage(2))]
    );
}

/// The chunk writer tries a commit again when it got no answer; when the database had
/// committed it (PostgreSQL restarted between its commit and the reply), the second try must
/// not store the events again. Each batch names the seq it follows, so the second try finds
/// them stored under its lease and answers with them; a batch that follows nothing stored is
/// refused as a lost lease would be, and writes nothing.
async fn append_chunks_tried_again_after_a_lost_answer_stores_each_event_once_lc3_rd4(
    store: DynStore,
) {
    let rec = create(&store, by_hash("tried again", T0)).await;
    let other = create(&store, by_hash("tried again, other", T0 + 1)).await;
    let (lease, _) = lease_at(&store, "node/a", T0 + 1).await;
    let (lease_b, _) = lease_at(&store, "node/b", T0 + 1).await;
    assert_eq!((lease.id, lease_b.id), (rec.id, other.id));
    let reported = Usage {
        output_tokens: Some(2),
        ..Usage::default()
    };
    let first = [
        ChunkBatch {
            lease: lease.clone(),
            after: 0,
            chunks: new_chunks("first", 2),
            upstream_request_id: Some("req_up_once".into()),
            response_id: None,
            usage: Some(reported),
        },
        ChunkBatch {
            lease: lease_b.clone(),
            after: 0,
            chunks: new_chunks("b", 1),
            upstream_request_id: None,
            response_id: None,
            usage: None,
        },
    ];
    let stored = store.append_chunks(&first).await.expect("append");
    let seqs = |out: &[Option<Vec<Chunk>>]| -> Vec<Option<Vec<i64>>> {
        out.iter()
            .map(|b| b.as_ref().map(|c| c.iter().map(|c| c.seq).collect()))
            .collect()
    };
    assert_eq!(seqs(&stored), vec![Some(vec![1, 2]), Some(vec![1])]);
    let before = (
        all_chunks(&store, rec.id).await,
        all_chunks(&store, other.id).await,
    );

    // The same commit again: answered as the first was, nothing stored twice.
    let again = store.append_chunks(&first).await.expect("append again");
    assert_eq!(
        again, stored,
        "the second try answers with what the first stored"
    );
    assert_eq!(
        (
            all_chunks(&store, rec.id).await,
            all_chunks(&store, other.id).await
        ),
        before
    );
    assert_eq!(get(&store, rec.id).await.last_seq, 2);
    assert_eq!(
        store.attempt_usage(rec.id).await.expect("usage"),
        vec![(1, reported)]
    );

    // Tried again beside a new batch of the other stream: the new one is stored after it.
    let next_b = ChunkBatch {
        lease: lease_b.clone(),
        after: 1,
        chunks: new_chunks("b2", 2),
        upstream_request_id: None,
        response_id: None,
        usage: None,
    };
    let mixed = store
        .append_chunks(&[first[0].clone(), next_b])
        .await
        .expect("append mixed");
    assert_eq!(seqs(&mixed), vec![Some(vec![1, 2]), Some(vec![2, 3])]);
    assert_eq!(all_chunks(&store, rec.id).await, before.0);

    // A batch that neither follows the last stored seq nor ends at it writes nothing. (One
    // that ends at it is taken as stored: only its own attempt moves a leased request's seqs,
    // each batch after the last seq it was answered.)
    for after in [0, 3] {
        let astray = ChunkBatch {
            lease: lease.clone(),
            after,
            chunks: new_chunks("astray", 1),
            upstream_request_id: None,
            response_id: None,
            usage: None,
        };
        let out = store.append_chunks(&[astray]).await.expect("append astray");
        assert_eq!(out, vec![None], "after {after}: not the last seq");
    }
    assert_eq!(all_chunks(&store, rec.id).await, before.0);

    // The batch that does follow is stored next.
    let next = append(&store, &lease, new_chunks("next", 1))
        .await
        .expect("own");
    assert_eq!(next.iter().map(|c| c.seq).collect::<Vec<_>>(), vec![3]);
}

async fn chunks_after_pages_in_seq_order(store: DynStore) {
    let rec = create(&store, by_hash("pages", T0)).await;
    let (lease, _) = lease_at(&store, "node/a", T0).await;
    append(&store, &lease, new_chunks("p", 25))
        .await
        .expect("own");
    let mut pos = 0;
    let mut pages = Vec::new();
    loop {
        let page = store.chunks_after(rec.id, pos, 10).await.expect("page");
        if page.is_empty() {
            break;
        }
        pos = page.last().map(|c| c.seq).unwrap_or(pos);
        pages.push(page.iter().map(|c| c.seq).collect::<Vec<_>>());
    }
    assert_eq!(
        pages,
        vec![
            (1..=10).collect::<Vec<_>>(),
            (11..=20).collect(),
            (21..=25).collect()
        ]
    );
    assert_eq!(
        store
            .chunks_after(rec.id, 23, 100)
            .await
            .expect("tail")
            .iter()
            .map(|c| c.seq)
            .collect::<Vec<_>>(),
        vec![24, 25]
    );
    assert!(
        store
            .chunks_after(Uuid::now_v7(), 0, 10)
            .await
            .expect("none")
            .is_empty()
    );
}

async fn concurrent_successes_each_settle_fenced_on_their_own_lease_lc3_rd5(store: DynStore) {
    // Outcomes written at the same moment (a group commit may write them in one statement):
    // each request gets its own record, end chunk and usage; a lost lease writes nothing.
    let (mut leases, mut leased) = (Vec::new(), Vec::new());
    for i in 0..8 {
        create(&store, by_hash(&format!("together {i}"), T0 + i)).await;
        let (lease, record) = lease_at(&store, "node/a", T0 + 10).await;
        leases.push(lease);
        leased.push(record);
    }
    let lost = Lease {
        owner: "node/stale".into(),
        ..leases[7].clone()
    };
    let outcome = |i: usize| Outcome::Succeeded {
        status: 200,
        body: format!("{{\"answer\":{i}}}").into_bytes(),
        upstream_request_id: Some(format!("req_up_{i}")),
        response_id: i.is_multiple_of(2).then(|| format!("resp_together_{i}")),
        usage: (!i.is_multiple_of(3)).then(|| Usage {
            input_tokens: Some(i as u64),
            output_tokens: Some(10 * i as u64),
            ..Usage::default()
        }),
    };
    let mut writes = Vec::new();
    for (i, lease) in leases.iter().take(7).chain([&lost]).enumerate() {
        let (store, lease, outcome) = (store.clone(), lease.clone(), outcome(i));
        let leased = leased[i].clone();
        writes.push(tokio::spawn(async move {
            store.finish_read(&lease, &leased, &outcome, T0 + 20).await
        }));
    }
    let mut settled = Vec::new();
    for write in writes {
        settled.push(write.await.expect("task").expect("finish_read"));
    }
    assert!(settled[7].is_none(), "the stale owner is fenced out");
    assert_eq!(get(&store, leases[7].id).await.status, Status::Running);
    for (i, lease) in leases.iter().take(7).enumerate() {
        let record = settled[i].clone().expect("lease held");
        assert_eq!(record, get(&store, lease.id).await, "returned as stored");
        assert_eq!(record.status, Status::Succeeded);
        assert_eq!(
            record.response_body,
            Some(format!("{{\"answer\":{i}}}").into_bytes())
        );
        assert_eq!(record.upstream_request_id, Some(format!("req_up_{i}")));
        let chunks = all_chunks(&store, lease.id).await;
        assert_eq!(chunks.len(), 1);
        assert_eq!(chunks[0].kind, ChunkKind::End);
        assert_eq!(chunks[0].seq, record.last_seq);
        let usage = store.attempt_usage(lease.id).await.expect("usage");
        if i.is_multiple_of(3) {
            assert!(usage.is_empty());
        } else {
            assert_eq!(usage.len(), 1);
            assert_eq!(usage[0].1.output_tokens, Some(10 * i as u64));
            assert_eq!(record.usage.output_tokens, Some(10 * i as u64));
        }
        let found = store
            .find_response(&format!("resp_together_{i}"))
            .await
            .expect("find_response");
        assert_eq!(
            found.map(|r| r.request_id),
            (i % 2 == 0).then_some(lease.id)
        );
    }
}

async fn finish_read_returns_the_record_as_stored_and_none_for_a_lost_lease_lc3(store: DynStore) {
    // Terminal: the record a waiter is handed equals what a later read finds, also where the
    // request changed after its lease returned `leased`: deliveries and log reads counted, and
    // chunks stored, while it ran (a store may take the rest from `leased`, issue 30).
    let ok = create(&store, by_hash("finish_read ok", T0)).await;
    let (l, leased) = lease_at(&store, "node/a", T0).await;
    store
        .add_counts(&[Counts {
            id: ok.id,
            attached: 2,
            replayed: 0,
            log_reads: 3,
        }])
        .await
        .expect("add_counts");
    append(&store, &l, new_chunks("while running", 2))
        .await
        .expect("lease held");
    let settled = store
        .finish_read(&l, &leased, &succeeded(), T0 + 1)
        .await
        .expect("finish_read")
        .expect("lease held");
    assert_eq!(settled.status, Status::Succeeded);
    assert_eq!(
        (settled.attached, settled.log_reads),
        (2, 3),
        "counted while it ran"
    );
    assert_eq!(
        settled.last_seq, 3,
        "its chunks and the end chunk are counted"
    );
    assert_eq!(settled, get(&store, ok.id).await);
    // The same lease again is fenced out (LC-3): nothing written, nothing returned.
    assert!(
        store
            .finish_read(&l, &leased, &succeeded(), T0 + 2)
            .await
            .expect("finish_read")
            .is_none()
    );

    // A retry: pending again, with the error and the next due time.
    let r = create(&store, by_hash("finish_read retry", T0 + 10)).await;
    let (l, leased) = lease_at(&store, "node/a", T0 + 10).await;
    let retry = Outcome::Retry {
        next_retry_at: T0 + 5_000,
        error: error(ErrorType::AttemptsExhausted, Some(503)),
    };
    let settled = store
        .finish_read(&l, &leased, &retry, T0 + 11)
        .await
        .expect("finish_read")
        .expect("lease held");
    assert_eq!(
        (settled.status, settled.next_retry_at),
        (Status::Pending, T0 + 5_000)
    );
    assert_eq!(settled, get(&store, r.id).await);

    // Failures, with and without the provider's answer kept: as stored too, with one `end`
    // chunk made of what the record says.
    for (i, outcome) in [failed(ErrorType::UpstreamInvalid), refused()]
        .iter()
        .enumerate()
    {
        let now = T0 + 20 + 10 * i as Millis;
        let f = create(&store, by_hash(&format!("finish_read failed {i}"), now)).await;
        let (l, leased) = lease_at(&store, "node/a", now).await;
        let settled = store
            .finish_read(&l, &leased, outcome, now + 1)
            .await
            .expect("finish_read")
            .expect("lease held");
        assert_eq!(settled.status, Status::Failed);
        assert_eq!(settled, get(&store, f.id).await);
        assert_single_end(&store, &settled).await;
    }
}

/// A stream's last batch and its success are one write: the batch gets the seqs after those
/// already stored, the `end` chunk the one after it, and the record returned is the stored one.
/// A lost lease writes neither the batch nor the outcome (LC-3, RD-5).
async fn finish_with_chunks_stores_the_last_batch_and_the_outcome_together_or_nothing_lc3_rd5(
    store: DynStore,
) {
    let r = create(&store, by_hash("finish_with_chunks", T0)).await;
    let (l, leased) = lease_at(&store, "node/a", T0).await;
    append(&store, &l, new_chunks("first", 2))
        .await
        .expect("lease held");
    let usage = Usage {
        input_tokens: Some(7),
        output_tokens: Some(3),
        ..Usage::default()
    };
    let last = ChunkBatch {
        lease: l.clone(),
        after: 2,
        chunks: new_chunks("last", 3),
        upstream_request_id: None,
        response_id: None,
        usage: Some(usage),
    };
    let outcome = Outcome::Succeeded {
        status: 200,
        body: Vec::new(),
        upstream_request_id: Some("req_up_1".into()),
        response_id: None,
        usage: Some(usage),
    };
    let (chunks, settled) = store
        .finish_with_chunks(&leased, &last, &outcome, T0 + 1)
        .await
        .expect("finish_with_chunks")
        .expect("lease held");
    assert_eq!(
        chunks.iter().map(|c| c.seq).collect::<Vec<_>>(),
        vec![3, 4, 5],
        "after the two stored before"
    );
    assert_eq!(
        chunks.iter().map(|c| &*c.data).collect::<Vec<_>>(),
        last.chunks.iter().map(|c| &*c.data).collect::<Vec<_>>()
    );
    assert_eq!(settled.status, Status::Succeeded);
    assert_eq!(settled.last_seq, 6, "the end chunk follows the last batch");
    assert_eq!(settled.usage, usage);
    assert_eq!(settled, get(&store, r.id).await);
    let stored = all_chunks(&store, r.id).await;
    assert_eq!(stored.len(), 6);
    assert_eq!(&stored[2..5], &chunks[..]);
    assert_eq!(stored[5].kind, ChunkKind::End);
    assert_single_end(&store, &settled).await;

    // A lost lease (cancelled meanwhile): neither the batch nor the outcome is written.
    let c = create(&store, by_hash("finish_with_chunks lost", T0 + 10)).await;
    let (lc, leased_c) = lease_at(&store, "node/a", T0 + 10).await;
    append(&store, &lc, new_chunks("kept", 1))
        .await
        .expect("lease held");
    store.cancel(NS, c.id, T0 + 11).await.expect("cancel");
    let before = (get(&store, c.id).await, all_chunks(&store, c.id).await);
    let lost = ChunkBatch {
        lease: lc.clone(),
        after: 1,
        ..last.clone()
    };
    assert!(
        store
            .finish_with_chunks(&leased_c, &lost, &outcome, T0 + 12)
            .await
            .expect("finish_with_chunks")
            .is_none()
    );
    assert_eq!(
        (get(&store, c.id).await, all_chunks(&store, c.id).await),
        before
    );
}

async fn finish_refuses_a_request_that_is_not_running_lc3(store: DynStore) {
    let outcomes = [succeeded(), failed(ErrorType::UpstreamInvalid), refused()];
    for (i, outcome) in outcomes.iter().enumerate() {
        let now = T0 + 100 * i as Millis;
        // Cancelled while running: the worker's outcome is refused (LC-3, LC-9).
        let cancelled = create(&store, by_hash(&format!("cancelled {i}"), now)).await;
        let (l, leased) = lease_at(&store, "node/a", now).await;
        store
            .cancel(NS, cancelled.id, now + 1)
            .await
            .expect("cancel");
        let before = get(&store, cancelled.id).await;
        assert!(
            store
                .finish_read(&l, &leased, outcome, now + 2)
                .await
                .expect("finish_read")
                .is_none(),
            "a cancelled request is not finished by its worker"
        );
        assert_eq!(get(&store, cancelled.id).await, before, "nothing written");
        assert_single_end(&store, &before).await;

        // Handed back to pending (DU-5): not running, so not finished either.
        let pending = create(&store, by_hash(&format!("pending {i}"), now + 10)).await;
        let (l, leased) = lease_at(&store, "node/a", now + 10).await;
        assert!(
            store
                .release(&l, now + 11, MAX_ATTEMPTS)
                .await
                .expect("release")
        );
        let before = get(&store, pending.id).await;
        assert_eq!(before.status, Status::Pending);
        assert!(
            store
                .finish_read(&l, &leased, outcome, now + 12)
                .await
                .expect("finish_read")
                .is_none()
        );
        assert_eq!(get(&store, pending.id).await, before);
        // Out of the way of the next lease.
        store
            .cancel(NS, pending.id, now + 13)
            .await
            .expect("cancel");

        // Already terminal: a second outcome changes nothing.
        let done = create(&store, by_hash(&format!("done {i}"), now + 20)).await;
        let (l, leased) = lease_at(&store, "node/a", now + 20).await;
        assert!(
            store
                .finish(&l, succeeded(), now + 21)
                .await
                .expect("finish")
        );
        let before = get(&store, done.id).await;
        assert!(
            store
                .finish_read(&l, &leased, outcome, now + 22)
                .await
                .expect("finish_read")
                .is_none()
        );
        assert_eq!(get(&store, done.id).await, before);
        assert_single_end(&store, &before).await;
    }
}

async fn submit_and_lease_leases_only_what_it_creates_lc2_id7(store: DynStore) {
    let new = by_hash("leased at admission", T0);
    let id = new.id;
    let (submitted, lease) = store
        .submit_and_lease(
            new,
            Some(LeaseTo {
                owner: "node/a/admit",
                lease_ms: LEASE_MS,
            }),
        )
        .await
        .expect("submit");
    let Submitted::Created(created) = submitted else {
        panic!("expected Created, got {submitted:?}");
    };
    let lease = lease.expect("a created request is leased");
    assert_eq!(
        (lease.id, &*lease.owner, lease.attempt),
        (id, "node/a/admit", 1)
    );
    let stored = get(&store, id).await;
    assert_eq!((stored.status, stored.attempts), (Status::Running, 1));
    assert_eq!(*created, stored, "the returned record is the stored row");
    // Leased, so no dispatcher can take it (LC-2), and the lease fences like any other.
    assert!(
        store
            .lease_many("node/b", T0 + 1, LEASE_MS, &LeaseQuota::any(10))
            .await
            .expect("lease")
            .is_empty()
    );
    assert!(
        store
            .heartbeat(&lease, T0 + 2, LEASE_MS)
            .await
            .expect("heartbeat")
    );

    // A re-send attaches and leases nothing (ID-4, ID-7); so does a reused key (ID-5).
    let (again, none) = store
        .submit_and_lease(
            by_hash("leased at admission", T0 + 3),
            Some(LeaseTo {
                owner: "node/c/x",
                lease_ms: LEASE_MS,
            }),
        )
        .await
        .expect("submit");
    assert!(matches!(again, Submitted::Attached(ref r) if r.id == id));
    assert!(none.is_none());
    create(&store, by_key("k-admit", "one body", T0)).await;
    let (mismatch, none) = store
        .submit_and_lease(
            by_key("k-admit", "another body", T0 + 4),
            Some(LeaseTo {
                owner: "node/c/y",
                lease_ms: LEASE_MS,
            }),
        )
        .await
        .expect("submit");
    assert!(matches!(mismatch, Submitted::KeyMismatch { .. }));
    assert!(none.is_none());

    // Its lease expires like any other: the sweep recovers it (LC-4).
    let swept = store.sweep(T0 + 2 + LEASE_MS + 1, 3).await.expect("sweep");
    assert!(swept.recovered.contains(&id));
    assert!(
        !store
            .finish(&lease, succeeded(), T0 + LEASE_MS + 10)
            .await
            .expect("finish"),
        "the expired admission lease is fenced out (LC-3)"
    );
}

async fn every_terminal_outcome_appends_exactly_one_end_chunk_rd5(store: DynStore) {
    // Succeeded, after a streamed attempt.
    let ok = create(&store, by_hash("ok", T0)).await;
    let (l, _) = lease_at(&store, "node/a", T0).await;
    append(&store, &l, new_chunks("ok", 3)).await.expect("own");
    assert!(store.finish(&l, succeeded(), T0 + 1).await.expect("finish"));
    let rec = get(&store, ok.id).await;
    assert_eq!(rec.status, Status::Succeeded);
    assert_eq!(rec.response_status, Some(200));
    assert_eq!(rec.upstream_request_id.as_deref(), Some("req_up_1"));
    assert_eq!(rec.finished_at, Some(T0 + 1));
    assert_eq!(rec.last_seq, 4);
    assert_single_end(&store, &rec).await;
    let end = all_chunks(&store, ok.id).await.pop().expect("end");
    assert_eq!(end.attempt, 1);
    assert_eq!(&*end.data, end_data(Status::Succeeded, None));
    // A second finish by the same (now released) lease is fenced out: still one end.
    assert!(!store.finish(&l, succeeded(), T0 + 2).await.expect("finish"));
    assert_single_end(&store, &get(&store, ok.id).await).await;

    // Each terminal failure kind a worker reports.
    for (i, outcome) in [
        refused(),
        failed(ErrorType::AttemptsExhausted),
        failed(ErrorType::StreamInterrupted),
        failed(ErrorType::UpstreamInvalid),
    ]
    .into_iter()
    .enumerate()
    {
        let now = T0 + 100 + i as i64 * 10;
        let r = create(&store, by_hash(&format!("fail {i}"), now)).await;
        let (l, _) = lease_at(&store, "node/a", now).await;
        let expected = match &outcome {
            Outcome::Failed { error, .. } => error.clone(),
            _ => unreachable!(),
        };
        assert!(store.finish(&l, outcome, now + 1).await.expect("finish"));
        let rec = get(&store, r.id).await;
        assert_eq!(rec.status, Status::Failed);
        assert_eq!(rec.error, Some(expected));
        assert_single_end(&store, &rec).await;
        assert!(
            !store
                .finish(&l, succeeded(), now + 2)
                .await
                .expect("finish")
        );
        assert_single_end(&store, &get(&store, r.id).await).await;
    }

    // Cancelled while pending, and while running.
    let p = create(&store, by_hash("cancel pending", T0 + 500)).await;
    let rec = store
        .cancel(NS, p.id, T0 + 501)
        .await
        .expect("cancel")
        .expect("found");
    assert_single_end(&store, &rec).await;
    assert_eq!(all_chunks(&store, p.id).await[0].attempt, 0);
    let r = create(&store, by_hash("cancel running", T0 + 600)).await;
    lease_at(&store, "node/a", T0 + 600).await;
    let rec = store
        .cancel(NS, r.id, T0 + 601)
        .await
        .expect("cancel")
        .expect("found");
    assert_single_end(&store, &rec).await;

    // Lease expired with no attempts left.
    let e = create(&store, by_hash("expire", T0 + 700)).await;
    lease_at(&store, "node/a", T0 + 700).await;
    store
        .sweep(T0 + 700 + LEASE_MS + 1, 1)
        .await
        .expect("sweep");
    assert_single_end(&store, &get(&store, e.id).await).await;
}

// ---------------------------------------------------------------------------------------------
// Cancel, list, release, prune, counts (LC-9, RD-7, DU-4, DU-5)
// ---------------------------------------------------------------------------------------------

async fn cancel_fails_pending_and_running_requests_lc9(store: DynStore) {
    // Pending, keyed: the claim is released even though it is a key (ID-6), a minute after the
    // cancel (ID-6a).
    let pending = create(&store, by_key("k", "wait", T0)).await;
    let rec = store
        .cancel(NS, pending.id, T0 + 5)
        .await
        .expect("cancel")
        .expect("found");
    assert_eq!(rec.status, Status::Failed);
    assert_eq!(
        rec.error.as_ref().map(|e| e.kind),
        Some(ErrorType::Cancelled)
    );
    assert_eq!(rec.finished_at, Some(T0 + 5));
    assert_eq!(rec.updated_at, T0 + 5);
    assert_eq!(get(&store, pending.id).await.status, Status::Failed);
    assert_eq!(
        attach(&store, by_key("k", "wait", T0 + 6)).await.id,
        pending.id
    );
    assert_ne!(
        create(&store, by_key("k", "wait", T0 + 6 + FAILURE_WINDOW_MS))
            .await
            .id,
        pending.id
    );
    // A cancelled request is not leased.
    let (l, _) = lease_at(&store, "node/a", T0 + 6 + FAILURE_WINDOW_MS).await;
    assert_ne!(l.id, pending.id);
    store.cancel(NS, l.id, T0 + 6).await.expect("cancel");

    // Running: the lease is cleared, so the worker's next fenced write fails.
    let running = create(&store, by_hash("run", T0 + 10)).await;
    let (lease, _) = lease_at(&store, "node/a", T0 + 10).await;
    assert_eq!(lease.id, running.id);
    append(&store, &lease, new_chunks("r", 2))
        .await
        .expect("own");
    let rec = store
        .cancel(NS, running.id, T0 + 11)
        .await
        .expect("cancel")
        .expect("found");
    assert_eq!(rec.status, Status::Failed);
    assert_eq!(
        rec.error.as_ref().map(|e| e.kind),
        Some(ErrorType::Cancelled)
    );
    assert_eq!(rec.last_seq, 3, "chunks so far are kept, then end");
    assert!(
        !store
            .heartbeat(&lease, T0 + 12, LEASE_MS)
            .await
            .expect("hb")
    );
    assert!(
        !store
            .finish(&lease, succeeded(), T0 + 12)
            .await
            .expect("finish")
    );
    assert!(
        append(&store, &lease, new_chunks("late", 1))
            .await
            .is_none()
    );
    let after = get(&store, running.id).await;
    assert_eq!(after.status, Status::Failed);
    assert_eq!(
        after.error.as_ref().map(|e| e.kind),
        Some(ErrorType::Cancelled)
    );
    assert_eq!(after.response_body, None);
    assert_single_end(&store, &after).await;
    // The sweep leaves it alone: it is no longer running.
    let swept = store
        .sweep(T0 + 10 + LEASE_MS + 1, MAX_ATTEMPTS)
        .await
        .expect("sweep");
    assert!(!swept.recovered.contains(&running.id) && !swept.failed.contains(&running.id));
    // Its body-hash claim is released, a minute after the cancel (ID-6a).
    assert_eq!(attach(&store, by_hash("run", T0 + 13)).await.id, running.id);
    assert_ne!(
        create(&store, by_hash("run", T0 + 12 + FAILURE_WINDOW_MS))
            .await
            .id,
        running.id
    );
}

async fn cancel_leaves_terminal_requests_and_other_namespaces_alone_lc9(store: DynStore) {
    let done = create(&store, by_hash("done", T0)).await;
    let (lease, _) = lease_at(&store, "node/a", T0).await;
    store
        .finish(&lease, succeeded(), T0 + 1)
        .await
        .expect("finish");
    let before = get(&store, done.id).await;
    let rec = store
        .cancel(NS, done.id, T0 + 2)
        .await
        .expect("cancel")
        .expect("found");
    assert_eq!(rec.status, Status::Succeeded, "terminal is unchanged");
    assert_eq!(rec.updated_at, before.updated_at);
    assert_eq!(rec.finished_at, before.finished_at);
    assert_eq!(rec.last_seq, before.last_seq, "no second end chunk");
    // Its claim still holds.
    assert_eq!(attach(&store, by_hash("done", T0 + 3)).await.id, done.id);

    let theirs = create(&store, by_hash_in("team-b", "theirs", T0 + 4)).await;
    assert!(
        store
            .cancel(NS, theirs.id, T0 + 5)
            .await
            .expect("cancel")
            .is_none(),
        "another namespace's id is not found"
    );
    let untouched = store
        .get("team-b", theirs.id)
        .await
        .expect("get")
        .expect("found");
    assert_eq!(untouched.status, Status::Pending);
    assert!(
        store
            .cancel(NS, Uuid::now_v7(), T0 + 6)
            .await
            .expect("cancel")
            .is_none()
    );
}

async fn export_pages_oldest_first_after_a_cursor_and_lists_replays_ex1_ex4_ex8(store: DynStore) {
    let mut ids = Vec::new();
    for i in 0..7 {
        ids.push(create(&store, by_hash(&format!("x{i}"), T0 + i)).await.id);
    }
    create(&store, by_hash_in("team-b", "elsewhere", T0)).await;
    let replay = NewRequest {
        replay_of: Some(ids[2]),
        ..by_key("replay-1", "x2", T0 + 20)
    };
    let replay = create(&store, replay).await;
    assert_eq!(replay.replay_of, Some(ids[2]));
    assert_eq!(get(&store, replay.id).await.replay_of, Some(ids[2]));
    assert_eq!(get(&store, ids[2]).await.replay_of, None);
    ids.push(replay.id);

    // Oldest first, pages of 3 after each page's last id: each request once, in order.
    let mut seen = Vec::new();
    let mut after = None;
    loop {
        let page = store
            .list(&holdfast::store::ListFilter {
                namespace: Some(NS.to_string()),
                oldest_first: true,
                after,
                limit: 3,
                ..Default::default()
            })
            .await
            .expect("page");
        seen.extend(page.iter().map(|r| r.id));
        if page.len() < 3 {
            break;
        }
        after = page.last().map(|r| r.id);
    }
    assert_eq!(seen, ids);

    let replays = store
        .list(&holdfast::store::ListFilter {
            namespace: Some(NS.to_string()),
            replay_of: Some(ids[2]),
            limit: 10,
            ..Default::default()
        })
        .await
        .expect("replays");
    assert_eq!(
        replays.iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![replay.id]
    );
    let elsewhere = store
        .list(&holdfast::store::ListFilter {
            namespace: Some("team-b".to_string()),
            replay_of: Some(ids[2]),
            limit: 10,
            ..Default::default()
        })
        .await
        .expect("other namespace");
    assert!(elsewhere.is_empty());
}

async fn data_chunks_of_reads_each_requests_events_after_its_seq_in_one_call_ex4(store: DynStore) {
    let a = create(&store, by_hash("chunks a", T0)).await;
    let b = create(&store, by_hash("chunks b", T0 + 1)).await;
    let quiet = create(&store, by_hash("chunks none", T0 + 2)).await;
    let (lease_a, _) = lease_at(&store, "node/a", T0 + 5).await;
    let (lease_b, _) = lease_at(&store, "node/b", T0 + 5).await;
    assert_eq!((lease_a.id, lease_b.id), (a.id, b.id));
    append(&store, &lease_a, new_chunks("a", 4))
        .await
        .expect("a");
    append(&store, &lease_b, new_chunks("b", 3))
        .await
        .expect("b");
    store
        .finish(&lease_b, succeeded(), T0 + 6)
        .await
        .expect("finish b");
    let got = store
        .data_chunks_of(&[(b.id, 1), (quiet.id, 0), (a.id, 0)])
        .await
        .expect("chunks of");
    let seqs: Vec<(Uuid, Vec<i64>)> = got
        .iter()
        .map(|(id, chunks)| (*id, chunks.iter().map(|c| c.seq).collect()))
        .collect();
    // In the order asked; data only (b's `end` chunk is left out); after each one's seq.
    assert_eq!(
        seqs,
        vec![
            (b.id, vec![2, 3]),
            (quiet.id, vec![]),
            (a.id, vec![1, 2, 3, 4])
        ]
    );
    assert!(
        got.iter()
            .flat_map(|(_, c)| c)
            .all(|c| c.kind == ChunkKind::Data)
    );
}

/// `usage` of namespace [`NS`] around `T0`, by model.
async fn usage_by_model(store: &DynStore) -> Vec<holdfast::store::UsageRow> {
    store
        .usage(&holdfast::store::UsageQuery {
            namespace: Some(NS.to_string()),
            since: T0 - 1,
            until: T0 + 100,
            group_by: holdfast::store::UsageGroup::Model,
            bucket_ms: None,
        })
        .await
        .expect("usage")
}

/// RD-9a (decision 157): `usage` counts, per group and row, the requests that succeeded with no
/// attempt reporting tokens: a success with usage is metered, a failure without usage (a
/// refusal the provider did not bill) is not counted, a success without is.
async fn usage_counts_the_successes_that_reported_no_tokens_as_unmetered_rd9a(store: DynStore) {
    let mut ids = Vec::new();
    for i in 0..3 {
        ids.push(
            create(&store, by_hash(&format!("metered {i}"), T0 + i))
                .await
                .id,
        );
    }
    let succeeded = |usage: Option<Usage>| Outcome::Succeeded {
        status: 200,
        body: br#"{"id":"c"}"#.to_vec(),
        upstream_request_id: None,
        response_id: None,
        usage,
    };
    let outcomes = [
        succeeded(Some(Usage {
            input_tokens: Some(3),
            output_tokens: Some(4),
            ..Usage::default()
        })),
        Outcome::Failed {
            error: error(ErrorType::UpstreamRefused, Some(400)),
            response: None,
            upstream_request_id: None,
            usage: None,
        },
        succeeded(None),
    ];
    for outcome in &outcomes {
        let (lease, leased) = lease_at(&store, "node/a", T0 + 10).await;
        store
            .finish_read(&lease, &leased, outcome, T0 + 11)
            .await
            .expect("finish")
            .expect("lease held");
    }
    let rows = usage_by_model(&store).await;
    let requests: u64 = rows.iter().map(|r| r.requests).sum();
    let unmetered: u64 = rows.iter().map(|r| r.unmetered).sum();
    assert_eq!((requests, unmetered), (3, 1), "{rows:?}");
}

/// RD-10: the one-hour part of the prompt-cache writes is stored like every other count, by
/// each write that stores usage (a stream's chunks, a success, a failure, many successes at
/// once, a cancel copying the attempt's usage), read back in the record and by attempt, and
/// summed by `usage` and multiplied into the saved tokens.
async fn one_hour_cache_writes_are_kept_by_every_write_and_summed_by_usage_rd10(store: DynStore) {
    let usage = |written: u64, one_hour: u64| Usage {
        input_tokens: Some(written + 10),
        output_tokens: Some(5),
        cache_write_tokens: Some(written),
        cache_write_1h_tokens: Some(one_hour),
        ..Usage::default()
    };
    let ids: Vec<Uuid> = {
        let mut ids = Vec::new();
        for i in 0..6 {
            ids.push(
                create(&store, by_hash(&format!("one hour {i}"), T0 + i))
                    .await
                    .id,
            );
        }
        ids
    };
    let (mut leases, mut leased) = (Vec::new(), Vec::new());
    for _ in 0..6 {
        let (lease, record) = lease_at(&store, "node/a", T0 + 10).await;
        leases.push(lease);
        leased.push(record);
    }
    assert_eq!(leases.iter().map(|l| l.id).collect::<Vec<_>>(), ids);
    // 0: a stream's usage with its chunks, copied to the record by a cancel.
    let streamed = ChunkBatch {
        lease: leases[0].clone(),
        after: 0,
        chunks: new_chunks("one hour", 2),
        upstream_request_id: None,
        response_id: None,
        usage: Some(usage(1000, 400)),
    };
    store.append_chunks(&[streamed]).await.expect("append");
    store
        .cancel(NS, ids[0], T0 + 11)
        .await
        .expect("cancel")
        .expect("found");
    // 1: a success; 2: a failure; 3..6: successes at once (one statement where the adapter
    // groups them).
    let ok = |u: Usage| Outcome::Succeeded {
        status: 200,
        body: br#"{"id":"msg_1"}"#.to_vec(),
        upstream_request_id: None,
        response_id: None,
        usage: Some(u),
    };
    store
        .finish_read(&leases[1], &leased[1], &ok(usage(600, 300)), T0 + 12)
        .await
        .expect("finish")
        .expect("lease held");
    let failed = Outcome::Failed {
        error: error(ErrorType::StreamInterrupted, None),
        response: None,
        upstream_request_id: None,
        usage: Some(usage(90, 50)),
    };
    store
        .finish_read(&leases[2], &leased[2], &failed, T0 + 12)
        .await
        .expect("finish")
        .expect("lease held");
    let mut together = Vec::new();
    for (lease, leased) in leases.iter().zip(&leased).skip(3) {
        let (store, lease, leased) = (store.clone(), lease.clone(), leased.clone());
        together.push(tokio::spawn(async move {
            store
                .finish_read(&lease, &leased, &ok(usage(20, 7)), T0 + 13)
                .await
        }));
    }
    for finished in together {
        finished
            .await
            .expect("join")
            .expect("finish")
            .expect("lease held");
    }
    let expected = [400, 300, 50, 7, 7, 7];
    for (id, one_hour) in ids.iter().zip(expected) {
        let record = store.get(NS, *id).await.expect("get").expect("found");
        assert_eq!(record.usage.cache_write_1h_tokens, Some(one_hour), "{id}");
        let by_attempt = store.attempt_usage(*id).await.expect("attempt usage");
        assert_eq!(
            by_attempt
                .iter()
                .map(|(_, u)| u.cache_write_1h_tokens)
                .collect::<Vec<_>>(),
            vec![Some(one_hour)],
            "{id}"
        );
    }
    // One replay of the success: a saved call, at its usage.
    store
        .add_counts(&[holdfast::store::Counts {
            id: ids[1],
            attached: 0,
            replayed: 1,
            log_reads: 0,
        }])
        .await
        .expect("counts");
    let rows = usage_by_model(&store).await;
    let total = rows
        .iter()
        .fold(Usage::default(), |sum, r| sum.plus(r.usage));
    let saved = rows
        .iter()
        .fold(Usage::default(), |sum, r| sum.plus(r.saved));
    assert_eq!(total.cache_write_1h_tokens, Some(400 + 300 + 50 + 3 * 7));
    assert_eq!(total.cache_write_tokens, Some(1000 + 600 + 90 + 3 * 20));
    assert_eq!(saved.cache_write_1h_tokens, Some(300));
}

async fn usage_buckets_split_the_window_by_hour_ex10(store: DynStore) {
    const HOUR: Millis = 3_600_000;
    for (i, at) in [T0, T0 + 1_000, T0 + 2 * HOUR].into_iter().enumerate() {
        create(&store, by_hash(&format!("u{i}"), at)).await;
    }
    let query = |bucket_ms| holdfast::store::UsageQuery {
        namespace: Some(NS.to_string()),
        since: T0 - HOUR,
        until: T0 + 3 * HOUR,
        group_by: holdfast::store::UsageGroup::Model,
        bucket_ms,
    };
    let rows = store.usage(&query(Some(HOUR))).await.expect("usage");
    let got: Vec<(Option<Millis>, u64)> = rows.iter().map(|r| (r.bucket, r.requests)).collect();
    let start = |t: Millis| Some(t / HOUR * HOUR);
    assert_eq!(got, vec![(start(T0), 2), (start(T0 + 2 * HOUR), 1)]);
    let whole = store.usage(&query(None)).await.expect("usage");
    assert_eq!(
        whole
            .iter()
            .map(|r| (r.bucket, r.requests))
            .collect::<Vec<_>>(),
        vec![(None, 3)]
    );
}

async fn every_list_filter_narrows_to_what_it_names_in_both_orders_rd7_ex1(store: DynStore) {
    let plain = create(&store, by_hash("filter plain", T0)).await;
    let other = create(
        &store,
        NewRequest {
            model: Some("m2".into()),
            backend: "b2".into(),
            route: Route::AnthropicMessages,
            ..by_hash("filter other needle", T0 + 1_000)
        },
    )
    .await;
    let late = create(&store, by_hash("filter late", T0 + 5_000)).await;
    store
        .add_counts(&[holdfast::store::Counts {
            id: late.id,
            attached: 1,
            replayed: 0,
            log_reads: 0,
        }])
        .await
        .expect("counts");
    let (lease, _) = lease_at(&store, "node/a", T0 + 6_000).await;
    assert_eq!(lease.id, plain.id);
    for oldest_first in [false, true] {
        let ids = |filter: holdfast::store::ListFilter| {
            let store = &store;
            async move {
                let mut got: Vec<Uuid> = store
                    .list(&holdfast::store::ListFilter {
                        namespace: Some(NS.to_string()),
                        oldest_first,
                        limit: 10,
                        ..filter
                    })
                    .await
                    .expect("list")
                    .iter()
                    .map(|r| r.id)
                    .collect();
                got.sort();
                got
            }
        };
        let f = holdfast::store::ListFilter::default;
        use holdfast::store::ListFilter as F;
        assert_eq!(
            ids(F {
                model: Some("m2".into()),
                ..f()
            })
            .await,
            vec![other.id]
        );
        assert_eq!(
            ids(F {
                backend: Some("b2".into()),
                ..f()
            })
            .await,
            vec![other.id]
        );
        assert_eq!(
            ids(F {
                route: Some(Route::AnthropicMessages),
                ..f()
            })
            .await,
            vec![other.id]
        );
        assert_eq!(
            ids(F {
                status: Some(Status::Running),
                ..f()
            })
            .await,
            vec![plain.id]
        );
        assert_eq!(
            ids(F {
                since: Some(T0 + 1_000),
                until: Some(T0 + 5_000),
                ..f()
            })
            .await,
            vec![other.id]
        );
        assert_eq!(
            ids(F {
                text: Some("needle".into()),
                ..f()
            })
            .await,
            vec![other.id]
        );
        assert_eq!(
            ids(F {
                replayed: true,
                ..f()
            })
            .await,
            vec![late.id]
        );
        assert_eq!(
            ids(F {
                before: Some(late.id),
                ..f()
            })
            .await,
            vec![plain.id, other.id]
        );
        assert_eq!(
            ids(F {
                after: Some(plain.id),
                ..f()
            })
            .await,
            vec![other.id, late.id]
        );
        assert_eq!(ids(f()).await.len(), 3);
    }
}

async fn list_is_newest_first_with_status_filter_and_cursor_rd7(store: DynStore) {
    let mut ids = Vec::new();
    for i in 0..5 {
        ids.push(create(&store, by_hash(&format!("l{i}"), T0 + i)).await.id);
    }
    create(&store, by_hash_in("team-b", "elsewhere", T0)).await;
    // Lease the oldest.
    let (lease, _) = lease_at(&store, "node/a", T0 + 10).await;
    assert_eq!(lease.id, ids[0]);

    let mut newest_first = ids.clone();
    newest_first.sort();
    newest_first.reverse();
    let listed: Vec<Uuid> = list_of(&store, NS, None, None, 100)
        .await
        .expect("list")
        .iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(listed, newest_first);

    let running = list_of(&store, NS, Some(Status::Running), None, 100)
        .await
        .expect("list");
    assert_eq!(
        running.iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![ids[0]]
    );
    let pending = list_of(&store, NS, Some(Status::Pending), None, 100)
        .await
        .expect("list");
    assert_eq!(pending.len(), 4);
    assert!(pending.iter().all(|r| r.status == Status::Pending));
    assert!(
        list_of(&store, NS, Some(Status::Failed), None, 100)
            .await
            .expect("list")
            .is_empty()
    );

    // Paging by cursor.
    let mut pages = Vec::new();
    let mut before = None;
    loop {
        let page = list_of(&store, NS, None, before, 2).await.expect("list");
        if page.is_empty() {
            break;
        }
        before = page.last().map(|r| r.id);
        pages.push(page.iter().map(|r| r.id).collect::<Vec<_>>());
    }
    assert_eq!(
        pages,
        vec![
            newest_first[0..2].to_vec(),
            newest_first[2..4].to_vec(),
            newest_first[4..5].to_vec()
        ]
    );
    // Status filter and cursor together.
    let page = list_of(
        &store,
        NS,
        Some(Status::Pending),
        Some(newest_first[1]),
        100,
    )
    .await
    .expect("list");
    assert_eq!(
        page.iter().map(|r| r.id).collect::<Vec<_>>(),
        newest_first[2..4].to_vec()
    );
    // Namespaces do not mix.
    let theirs = list_of(&store, "team-b", None, None, 100)
        .await
        .expect("list");
    assert_eq!(theirs.len(), 1);
    assert!(
        list_of(&store, "team-c", None, None, 100)
            .await
            .expect("list")
            .is_empty()
    );
}

async fn release_hands_back_without_counting_a_recovery_du5(store: DynStore) {
    let rec = create(&store, by_hash("drain", T0)).await;
    let (l1, _) = lease_at(&store, "node/a", T0).await;
    assert!(
        store
            .release(&l1, T0 + 5, MAX_ATTEMPTS)
            .await
            .expect("release")
    );
    let after = get(&store, rec.id).await;
    assert_eq!(after.status, Status::Pending);
    assert_eq!((after.attempts, after.recoveries), (1, 0));
    assert_eq!(after.next_retry_at, T0 + 5, "due at once for another node");
    assert!(
        all_chunks(&store, rec.id).await.is_empty(),
        "no chunks stored: no reset"
    );
    assert!(
        !store
            .release(&l1, T0 + 6, MAX_ATTEMPTS)
            .await
            .expect("release"),
        "already released"
    );
    assert!(!store.heartbeat(&l1, T0 + 6, LEASE_MS).await.expect("hb"));

    // Attempt 2 stores chunks, then is handed back: a reset naming attempt 3 follows.
    let (l2, _) = lease_at(&store, "node/b", T0 + 10).await;
    assert_eq!(l2.attempt, 2);
    append(&store, &l2, new_chunks("b", 2)).await.expect("own");
    assert!(
        store
            .release(&l2, T0 + 11, MAX_ATTEMPTS)
            .await
            .expect("release")
    );
    let chunks = all_chunks(&store, rec.id).await;
    assert_eq!(chunks.len(), 3);
    assert_eq!(
        (chunks[2].kind, chunks[2].seq, chunks[2].attempt),
        (ChunkKind::Reset, 3, 3)
    );
    assert_eq!(&*chunks[2].data, "3");
    let after = get(&store, rec.id).await;
    assert_eq!((after.attempts, after.recoveries), (2, 0));
    assert_eq!((after.last_seq, after.reset_seq), (3, 3));
    // The claim survives a hand-back.
    assert_eq!(attach(&store, by_hash("drain", T0 + 12)).await.id, rec.id);
}

/// DU-5 (decision 151): an attempt leased before shutdown's signal and started after it
/// never called its provider: handed back `pending`, due at once, its attempt uncounted, so
/// at the last attempt too nothing fails and the next lease is that attempt again; fenced.
async fn an_unstarted_attempt_is_handed_back_uncounted_du5(store: DynStore) {
    let rec = create(&store, by_hash("unstarted", T0)).await;
    let (l1, _) = lease_at(&store, "node/a", T0).await;
    assert_eq!(l1.attempt, 1);
    assert!(store.release_unstarted(&l1, T0 + 5).await.expect("release"));
    let after = get(&store, rec.id).await;
    assert_eq!(after.status, Status::Pending);
    assert_eq!((after.attempts, after.recoveries), (0, 0));
    assert_eq!(after.next_retry_at, T0 + 5, "due at once for another node");
    assert_eq!(after.error, None);
    assert!(
        !store.release_unstarted(&l1, T0 + 6).await.expect("release"),
        "already released"
    );
    assert!(!store.heartbeat(&l1, T0 + 6, LEASE_MS).await.expect("hb"));
    let (l2, _) = lease_at(&store, "node/b", T0 + 7).await;
    assert_eq!(l2.attempt, 1, "the uncounted attempt is the next one");
    assert!(
        !store.release_unstarted(&l1, T0 + 8).await.expect("release"),
        "fenced on its own lease"
    );
    assert_eq!(get(&store, rec.id).await.status, Status::Running);
}

/// DU-5: a hand-back of attempt `max_attempts` gets the sweep's verdict at once — `failed`
/// with `lease_expired`, its `end` chunk after what it stored, its body-hash claim released —
/// so no lease can start an attempt beyond the maximum.
async fn a_hand_back_of_the_last_attempt_fails_it_so_attempts_never_exceed_the_maximum_du5(
    store: DynStore,
) {
    let rec = create(&store, by_hash("last one", T0)).await;
    let (l1, _) = lease_at(&store, "node/a", T0).await;
    assert!(store.release(&l1, T0 + 1, 2).await.expect("release"));
    assert_eq!(get(&store, rec.id).await.status, Status::Pending);
    let (l2, _) = lease_at(&store, "node/b", T0 + 2).await;
    assert_eq!(l2.attempt, 2);
    append(&store, &l2, new_chunks("z", 2)).await.expect("own");
    assert!(store.release(&l2, T0 + 3, 2).await.expect("release"));
    let after = get(&store, rec.id).await;
    assert_eq!(after.status, Status::Failed);
    assert_eq!(
        after.error.as_ref().map(|e| e.kind),
        Some(ErrorType::LeaseExpired)
    );
    assert_eq!((after.attempts, after.recoveries), (2, 0));
    assert_eq!(after.finished_at, Some(T0 + 3));
    let chunks = all_chunks(&store, rec.id).await;
    assert_eq!(
        chunks.iter().map(|c| c.kind).collect::<Vec<_>>(),
        [ChunkKind::Data, ChunkKind::Data, ChunkKind::End],
        "no reset: nothing runs after it"
    );
    assert!(
        store
            .lease_many("node/c", T0 + 4, LEASE_MS, &LeaseQuota::any(10))
            .await
            .expect("lease")
            .is_empty(),
        "nothing left to lease"
    );
    assert!(
        !store.release(&l2, T0 + 5, 2).await.expect("release"),
        "already settled"
    );
    // The claim was released a minute after the failure (ID-6a): the same body is a new
    // request then.
    assert_eq!(attach(&store, by_hash("last one", T0 + 6)).await.id, rec.id);
    assert_ne!(
        create(&store, by_hash("last one", T0 + 4 + FAILURE_WINDOW_MS))
            .await
            .id,
        rec.id
    );
}

async fn prune_deletes_only_terminal_rows_with_their_chunks_and_claims_du4(store: DynStore) {
    // Finished early: a success with chunks, a keyed refusal whose claim outlives it.
    let ok = create(&store, by_hash("old ok", T0)).await;
    let (l, _) = lease_at(&store, "node/a", T0).await;
    append(&store, &l, new_chunks("o", 2)).await.expect("own");
    store.finish(&l, succeeded(), T0 + 1).await.expect("finish");
    let refusal = create(&store, by_key("k", "old refusal", T0 + 2)).await;
    let (l, _) = lease_at(&store, "node/a", T0 + 2).await;
    store.finish(&l, refused(), T0 + 3).await.expect("finish");
    // Still live: a running and a pending request; and one finished late.
    let running = create(&store, by_hash("running", T0 + 4)).await;
    lease_at(&store, "node/a", T0 + 4).await;
    let pending = create(&store, by_hash("pending", T0 + 10_000)).await;
    let late = create(&store, by_hash("late", T0 + 5)).await;
    let (l, _) = lease_at(&store, "node/a", T0 + 5).await;
    assert_eq!(l.id, late.id);
    store
        .finish(&l, failed(ErrorType::UpstreamInvalid), T0 + 2_000)
        .await
        .expect("finish");

    assert_eq!(
        store.prune(T0 + 1_000, T0 + 1_000, 1).await.expect("prune"),
        1,
        "limit"
    );
    assert_eq!(
        store
            .prune(T0 + 1_000, T0 + 1_000, 100)
            .await
            .expect("prune"),
        1
    );
    assert_eq!(
        store
            .prune(T0 + 1_000, T0 + 1_000, 100)
            .await
            .expect("prune"),
        0
    );

    for id in [ok.id, refusal.id] {
        assert!(store.get(NS, id).await.expect("get").is_none());
        assert!(all_chunks(&store, id).await.is_empty(), "chunks pruned");
    }
    // The refusal's keyed claim went with it: the key starts a new request.
    assert_ne!(
        create(&store, by_key("k", "old refusal", T0 + 3_000))
            .await
            .id,
        refusal.id
    );
    assert_ne!(
        create(&store, by_hash("old ok", T0 + 3_000)).await.id,
        ok.id
    );
    for id in [running.id, pending.id, late.id] {
        assert!(store.get(NS, id).await.expect("get").is_some());
    }
    assert_eq!(
        all_chunks(&store, late.id).await.len(),
        1,
        "late keeps its end"
    );
}

/// DU-4, CB-4, decision 82: past its retention a request whose webhook delivery is still
/// pending stays until `pending_callback_before`; one delivered, or with no webhook, goes.
async fn prune_keeps_a_request_whose_webhook_delivery_is_pending_until_no_try_is_left_du4_cb4(
    store: DynStore,
) {
    use holdfast::store::CallbackOutcome;
    let retried = create(
        &store,
        with_callback(by_hash("prune retried", T0), "http://a.example/hook"),
    )
    .await;
    let delivered = create(
        &store,
        with_callback(by_hash("prune delivered", T0 + 1), "http://b.example/hook"),
    )
    .await;
    let plain = create(&store, by_hash("prune plain", T0 + 2)).await;
    for at in [T0 + 3, T0 + 4, T0 + 5] {
        let (lease, _) = lease_at(&store, "node/a", at).await;
        store
            .finish(&lease, succeeded(), at + 1)
            .await
            .expect("finish");
    }
    let mut leases = store
        .lease_callbacks("n1", T0 + 10, 1_000, &LeaseQuota::any(10))
        .await
        .expect("lease");
    leases.sort_by_key(|l| l.request_id);
    assert_eq!(leases.len(), 2);
    let retry = CallbackOutcome::Retry {
        next_try_at: T0 + 5_000,
        status: Some(503),
        error: "HTTP 503".into(),
    };
    assert!(
        store
            .finish_callback(&leases[0], &retry, T0 + 11)
            .await
            .expect("finish")
    );
    let ok = CallbackOutcome::Delivered { status: 200 };
    assert!(
        store
            .finish_callback(&leases[1], &ok, T0 + 11)
            .await
            .expect("finish")
    );

    // Past retention, but the retried delivery may still be tried: its request stays.
    assert_eq!(
        store.prune(T0 + 1_000, T0, 100).await.expect("prune"),
        2,
        "the delivered and the plain request go"
    );
    for id in [delivered.id, plain.id] {
        assert!(store.get(NS, id).await.expect("get").is_none());
    }
    assert!(store.get(NS, retried.id).await.expect("get").is_some());
    assert_eq!(callback_of(&store, retried.id).await.attempts, 1);
    // Once no try can be left, it goes too.
    assert_eq!(
        store
            .prune(T0 + 1_000, T0 + 1_000, 100)
            .await
            .expect("prune"),
        1
    );
    assert!(store.get(NS, retried.id).await.expect("get").is_none());
    assert!(
        store
            .callbacks(&[retried.id])
            .await
            .expect("callbacks")
            .is_empty()
    );
}

async fn counts_and_next_due_follow_the_lifecycle(store: DynStore) {
    let counts = |store: DynStore| async move {
        let mut c = store.counts().await.expect("counts");
        c.sort_by_key(|(s, _)| s.as_str());
        c
    };
    assert!(store.counts().await.expect("counts").is_empty());
    assert_eq!(store.next_due().await.expect("next_due"), None);
    store.ping().await.expect("ping");

    for i in 0..4 {
        create(&store, by_hash(&format!("c{i}"), T0 + 100 * i)).await;
    }
    assert_eq!(store.next_due().await.expect("next_due"), Some(T0));
    let (a, _) = lease_at(&store, "node/a", T0 + 300).await;
    let (b, _) = lease_at(&store, "node/a", T0 + 300).await;
    let (c, _) = lease_at(&store, "node/a", T0 + 300).await;
    assert_eq!(store.next_due().await.expect("next_due"), Some(T0 + 300));
    store
        .finish(&a, succeeded(), T0 + 301)
        .await
        .expect("finish");
    store
        .finish(&b, failed(ErrorType::UpstreamInvalid), T0 + 301)
        .await
        .expect("finish");
    let retry = Outcome::Retry {
        next_retry_at: T0 + 50,
        error: error(ErrorType::AttemptsExhausted, None),
    };
    store.finish(&c, retry, T0 + 301).await.expect("finish");
    assert_eq!(store.next_due().await.expect("next_due"), Some(T0 + 50));
    lease_at(&store, "node/a", T0 + 301).await;
    assert_eq!(
        counts(store.clone()).await,
        vec![
            (Status::Failed, 1),
            (Status::Pending, 1),
            (Status::Running, 1),
            (Status::Succeeded, 1),
        ]
    );
}

async fn nul_characters_in_text_never_fail_a_write_in2(store: DynStore) {
    // A client may put "\u0000" in its model name; a provider may send NUL bytes in an error
    // body (kept in the message) or an event name. PostgreSQL TEXT cannot hold NUL; the write
    // must still succeed. Readers see the text, with NUL either kept or shown as U+FFFD.
    let shown = |s: &str| s.replace('\0', "\u{FFFD}");
    let mut new = by_hash("nul", T0);
    new.model = Some("gpt\0x".into());
    let rec = create(&store, new.clone()).await;
    assert_eq!(rec.model.as_deref().map(shown), Some(shown("gpt\0x")));
    assert_eq!(rec.body, new.body, "bodies are bytes and stay exact");

    let (lease, _) = lease_at(&store, "node/a", T0).await;
    let chunks = vec![NewChunk {
        event: Some("odd\0event".into()),
        data: "{\"a\":\"\\u0000\"}".into(),
    }];
    let stored = append(&store, &lease, chunks).await.expect("own");
    let read = all_chunks(&store, rec.id).await;
    assert_eq!(read, stored, "what append returns is what readers get");
    assert_eq!(
        read[0].event.as_deref().map(shown),
        Some(shown("odd\0event"))
    );
    assert_eq!(&*read[0].data, "{\"a\":\"\\u0000\"}");

    let outcome = Outcome::Failed {
        error: ErrorInfo {
            kind: ErrorType::StreamInterrupted,
            message: "the provider said \0\0 and hung up".into(),
            status: Some(500),
        },
        response: Some((500, b"\0\x01binary".to_vec())),
        upstream_request_id: None,
        usage: None,
    };
    assert!(store.finish(&lease, outcome, T0 + 1).await.expect("finish"));
    let rec = get(&store, rec.id).await;
    let err = rec.error.clone().expect("error");
    assert_eq!(
        shown(&err.message),
        shown("the provider said \0\0 and hung up")
    );
    assert_eq!(rec.response_body.as_deref(), Some(&b"\0\x01binary"[..]));
    assert_single_end(&store, &rec).await;
}

/// Counts the statements sqlx runs (its `sqlx::query` log events) on this thread.
#[derive(Default, Clone)]
struct StatementCounter(Arc<std::sync::atomic::AtomicUsize>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for StatementCounter {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        if event.metadata().target().starts_with("sqlx::query") {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }
}

/// LC-2 on PostgreSQL: the dispatcher's batch lease is one statement, however many requests it
/// takes (a round trip per lease would make a burst of requests wait on each other).
#[tokio::test]
async fn postgres_leases_a_batch_in_one_statement_lc2() {
    use tracing_subscriber::layer::SubscriberExt;
    let t = postgres_store().await;
    let store = t.store.clone();
    for i in 0..20 {
        create(&store, by_hash(&format!("batch {i}"), T0)).await;
    }
    let counter = StatementCounter::default();
    let subscriber = tracing_subscriber::registry().with(counter.clone());
    // Current-thread runtime: every future of the call runs on this thread, under this
    // subscriber.
    let leased = {
        let _guard = tracing::subscriber::set_default(subscriber);
        store
            .lease_many("node/batch", T0 + 1, LEASE_MS, &LeaseQuota::any(50))
            .await
            .expect("lease_many")
    };
    assert_eq!(leased.len(), 20);
    let owners: HashSet<&str> = leased.iter().map(|(l, _)| &*l.owner).collect();
    assert_eq!(owners.len(), 20, "an owner per attempt");
    assert_eq!(
        counter.0.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "one statement for the whole batch"
    );
}

/// Issue 28, LC-4 and DU-3 on PostgreSQL: two nodes sweeping the same expired requests at once,
/// while both nodes' writers attach duplicates to their claims, send the dead attempts' late
/// heartbeats and count deliveries on the same rows, take over each request exactly once and
/// meet in no deadlock: every node takes request rows by id, then claim rows in byte order.
/// A writer group that met a deadlock would be re-run silently, so the database's own counter
/// is the check, besides every call succeeding.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_two_nodes_sweeping_the_same_expired_requests_take_each_over_once_without_a_deadlock_lc4_du3()
 {
    const N: usize = 60;
    const MAX: u32 = 2;
    let db = TestDatabase::create().await;
    let a: DynStore = Arc::new(PostgresStore::open(&db.url).await.expect("open a"));
    let b: DynStore = Arc::new(PostgresStore::open(&db.url).await.expect("open b"));
    for round in 0..3i64 {
        let t = T0 + round * 10_000_000;
        // N requests leased by a node that died: odd ones on their last attempt (the sweep
        // fails them and releases their claims), even ones with a stored chunk (recovered
        // with a reset).
        let text = |i: usize| format!("round {round} request {i}");
        for i in 0..N {
            create(&a, by_hash(&text(i), t)).await;
        }
        let mut dead = Vec::new();
        let mut handed_back = 0;
        for i in 0..N {
            let (lease, _) = lease_at(&a, "node/dead", t + 1).await;
            if i % 2 == 1 {
                assert!(a.release(&lease, t + 1, MAX).await.expect("release"));
                handed_back += 1;
            } else {
                append(&a, &lease, new_chunks("d", 1)).await.expect("own");
                dead.push(lease);
            }
        }
        // The handed-back ones again: attempt 2 of 2.
        let last = a
            .lease_many("node/dead", t + 2, LEASE_MS, &LeaseQuota::any(N))
            .await
            .expect("lease");
        assert_eq!(last.len(), handed_back);
        dead.extend(last.into_iter().map(|(lease, _)| lease));
        let now = t + 2 + LEASE_MS + 1;
        let barrier = Arc::new(Barrier::new(2 + 2 * 3 * dead.len()));
        let mut sweeps = Vec::new();
        for store in [a.clone(), b.clone()] {
            let barrier = Arc::clone(&barrier);
            sweeps.push(tokio::spawn(async move {
                barrier.wait().await;
                store.sweep(now, MAX).await
            }));
        }
        let mut traffic = Vec::new();
        for (i, lease) in dead.iter().enumerate() {
            for store in [a.clone(), b.clone()] {
                let barrier = Arc::clone(&barrier);
                let duplicate = by_hash(&text(i), t + 3);
                traffic.push(tokio::spawn(async move {
                    barrier.wait().await;
                    store.submit(duplicate).await.map(|_| ())
                }));
            }
            for store in [a.clone(), b.clone()] {
                let (store, lease, barrier) = (store.clone(), lease.clone(), Arc::clone(&barrier));
                traffic.push(tokio::spawn(async move {
                    barrier.wait().await;
                    // Dated so that the lease stays expired for the sweep.
                    store.heartbeat(&lease, t, LEASE_MS).await.map(|_| ())
                }));
            }
            for store in [a.clone(), b.clone()] {
                let (id, barrier) = (lease.id, Arc::clone(&barrier));
                traffic.push(tokio::spawn(async move {
                    barrier.wait().await;
                    store
                        .add_counts(&[holdfast::store::Counts {
                            id,
                            attached: 1,
                            ..Default::default()
                        }])
                        .await
                        .map(|_| ())
                }));
            }
        }
        let (mut recovered, mut failed) = (Vec::new(), Vec::new());
        for sweep in sweeps {
            let swept = sweep
                .await
                .unwrap()
                .expect("no sweep fails (a deadlock is 40P01)");
            recovered.extend(swept.recovered);
            failed.extend(swept.failed);
        }
        for call in traffic {
            call.await.unwrap().expect("no write fails");
        }
        // A row a late heartbeat held at that moment was skipped by both (SKIP LOCKED): the
        // next sweeps take it.
        for store in [&a, &b, &a, &b] {
            let swept = store.sweep(now, MAX).await.expect("sweep");
            recovered.extend(swept.recovered);
            failed.extend(swept.failed);
        }
        // This round's (the last round's recovered requests, leased below, expire again).
        let ids: HashSet<Uuid> = dead.iter().map(|l| l.id).collect();
        recovered.retain(|id| ids.contains(id));
        failed.retain(|id| ids.contains(id));
        let mut taken: Vec<Uuid> = recovered.iter().chain(&failed).copied().collect();
        taken.sort();
        taken.dedup();
        assert_eq!(
            recovered.len() + failed.len(),
            N,
            "each expired request taken over once"
        );
        assert_eq!(taken.into_iter().collect::<HashSet<_>>(), ids);
        assert_eq!(failed.len(), N / 2, "the ones on their last attempt failed");
        // Every recovered request runs once more: both nodes lease until nothing is due.
        let quota = LeaseQuota::any(2 * N);
        let (la, lb) = tokio::join!(
            a.lease_many("node/a", now, LEASE_MS, &quota),
            b.lease_many("node/b", now, LEASE_MS, &quota)
        );
        let mut leased: Vec<Uuid> = la
            .unwrap()
            .into_iter()
            .chain(lb.unwrap())
            .map(|(l, _)| l.id)
            .filter(|id| ids.contains(id))
            .collect();
        leased.sort();
        recovered.sort();
        assert_eq!(leased, recovered, "each recovered request leased once");
    }
    // The database's count of deadlocks it broke: read once both nodes' connections are gone
    // (a backend reports its statistics when it exits).
    drop((a, b));
    let mut admin = PgConnection::connect(&db.url).await.unwrap();
    let started = std::time::Instant::now();
    loop {
        let others: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND pid <> pg_backend_pid()",
        )
        .fetch_one(&mut admin)
        .await
        .unwrap();
        if others == 0 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{others} connections of the two nodes still open"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let deadlocks: i64 = sqlx::query_scalar(
        "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()",
    )
    .fetch_one(&mut admin)
    .await
    .unwrap();
    assert_eq!(
        deadlocks, 0,
        "PostgreSQL broke a deadlock between the nodes"
    );
}

/// DU-6 on PostgreSQL: counting never waits for a row another write holds — it skips it and
/// says so, and the count lands on the next try; an unknown request is neither counted nor
/// reported busy.
#[tokio::test]
async fn postgres_counts_skip_a_row_another_write_holds_and_report_it_du6() {
    let t = postgres_store().await;
    let store = t.store.clone();
    let rec = create(&store, by_hash("counted", T0)).await;
    // Finished, so the attachment below is late (decision 74): reported once, when it is added.
    run_to_success(&store, rec.id, T0 + 1).await;
    let counts = [
        holdfast::store::Counts {
            id: rec.id,
            attached: 1,
            replayed: 2,
            ..Default::default()
        },
        holdfast::store::Counts {
            id: Uuid::now_v7(),
            replayed: 1,
            ..Default::default()
        },
    ];
    let url = t._postgres_db.as_ref().unwrap().url.clone();
    let mut holder = PgConnection::connect(&url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut holder).await.unwrap();
    sqlx::query("SELECT 1 FROM requests WHERE id = $1 FOR UPDATE")
        .bind(rec.id)
        .execute(&mut holder)
        .await
        .unwrap();
    let added = tokio::time::timeout(Duration::from_secs(5), store.add_counts(&counts))
        .await
        .expect("counting does not wait for the held row")
        .expect("add_counts");
    assert_eq!(
        added.busy,
        [rec.id],
        "the held row is reported, the unknown one is not"
    );
    assert!(added.late.is_empty(), "nothing was added: {added:?}");
    assert_eq!(get(&store, rec.id).await.replayed, 0);
    sqlx::query("COMMIT").execute(&mut holder).await.unwrap();
    let added = store.add_counts(&counts[..1]).await.expect("add_counts");
    assert!(added.busy.is_empty());
    assert_eq!(added.late, [(rec.id, 0)], "the retry adds it, late, once");
    let stored = get(&store, rec.id).await;
    assert_eq!((stored.attached, stored.replayed), (1, 2));
}

// ---------------------------------------------------------------------------------------------
// Callbacks (CB-1, CB-4, CB-6)
// ---------------------------------------------------------------------------------------------

fn with_callback(mut new: NewRequest, url: &str) -> NewRequest {
    new.callback_url = Some(url.into());
    new
}

async fn callback_of(store: &DynStore, id: Uuid) -> holdfast::store::Callback {
    store
        .callbacks(&[id])
        .await
        .expect("callbacks")
        .pop()
        .unwrap_or_else(|| panic!("no callback for {id}"))
}

async fn listed_by_callback(store: &DynStore, state: holdfast::store::CallbackState) -> Vec<Uuid> {
    store
        .list(&holdfast::store::ListFilter {
            namespace: Some(NS.into()),
            callback: Some(state),
            limit: 50,
            ..Default::default()
        })
        .await
        .expect("list")
        .iter()
        .map(|r| r.id)
        .collect()
}

/// CB-1, CB-4, CB-6: recorded with the submission, due only once its request is terminal
/// (a success and a cancel alike), leased one try at a time, every outcome fenced on its try's
/// lease; an expired lease is taken over; an attached duplicate records no callback of its own.
async fn a_callback_falls_due_when_its_request_ends_and_each_try_is_fenced_cb1_cb4_cb6(
    store: DynStore,
) {
    use holdfast::store::{CallbackOutcome, CallbackState};
    let a = create(
        &store,
        with_callback(by_hash("cb a", T0), "http://a.example/hook"),
    )
    .await;
    let b = create(
        &store,
        with_callback(by_hash("cb b", T0 + 1), "http://b.example/hook"),
    )
    .await;
    let c = create(&store, by_hash("cb none", T0 + 2)).await;
    assert!(
        store
            .lease_callbacks("n1", T0 + 3, 1_000, &LeaseQuota::any(10))
            .await
            .expect("lease")
            .is_empty(),
        "nothing is due while the requests run"
    );
    let cb = callback_of(&store, a.id).await;
    assert_eq!(
        (cb.state, cb.attempts, cb.url.as_str()),
        (CallbackState::Pending, 0, "http://a.example/hook")
    );
    assert!(
        store
            .callbacks(&[c.id])
            .await
            .expect("callbacks")
            .is_empty()
    );

    let (lease, _) = lease_at(&store, "node/a", T0 + 4).await;
    assert_eq!(lease.id, a.id);
    store
        .finish(&lease, succeeded(), T0 + 5)
        .await
        .expect("finish");
    store.cancel(NS, b.id, T0 + 6).await.expect("cancel");
    let (lease, _) = lease_at(&store, "node/a", T0 + 7).await;
    store
        .finish(&lease, succeeded(), T0 + 8)
        .await
        .expect("finish");

    // A duplicate of the finished request attaches: no callback of its own (CB-1).
    match store
        .submit(with_callback(
            by_hash("cb a", T0 + 9),
            "http://other.example/",
        ))
        .await
        .expect("submit")
    {
        Submitted::Attached(r) => assert_eq!(r.id, a.id),
        other => panic!("expected Attached, got {other:?}"),
    }
    assert_eq!(callback_of(&store, a.id).await.url, "http://a.example/hook");

    let mut leases = store
        .lease_callbacks("n1", T0 + 10, 1_000, &LeaseQuota::any(10))
        .await
        .expect("lease");
    leases.sort_by_key(|l| l.request_id);
    assert_eq!(
        leases.iter().map(|l| l.request_id).collect::<Vec<_>>(),
        vec![a.id, b.id]
    );
    assert_eq!(leases[0].finished_at, T0 + 5);
    assert_eq!(leases[1].finished_at, T0 + 6);
    assert!(leases.iter().all(|l| l.attempt == 1));
    assert_eq!(leases[0].owner, format!("n1/{}", a.id));
    assert!(
        store
            .lease_callbacks("n2", T0 + 11, 1_000, &LeaseQuota::any(10))
            .await
            .expect("lease")
            .is_empty(),
        "one try in flight"
    );

    let (la, lb) = (leases[0].clone(), leases[1].clone());
    let retry = CallbackOutcome::Retry {
        next_try_at: T0 + 100,
        status: Some(500),
        error: "HTTP 500".into(),
    };
    assert!(
        store
            .finish_callback(&la, &retry, T0 + 12)
            .await
            .expect("finish")
    );
    assert!(
        !store
            .finish_callback(&la, &retry, T0 + 13)
            .await
            .expect("finish"),
        "fenced on its lease"
    );
    let cb = callback_of(&store, a.id).await;
    assert_eq!(
        (cb.state, cb.attempts, cb.last_status, cb.next_try_at),
        (CallbackState::Pending, 1, Some(500), T0 + 100)
    );
    assert!(
        store
            .lease_callbacks("n1", T0 + 50, 1_000, &LeaseQuota::any(10))
            .await
            .expect("lease")
            .is_empty(),
        "not due yet"
    );

    // b's lease expired (at T0 + 1010): taken over as try 2, and a is due again.
    let mut again = store
        .lease_callbacks("n2", T0 + 1_011, 1_000, &LeaseQuota::any(10))
        .await
        .expect("lease");
    again.sort_by_key(|l| l.request_id);
    assert_eq!(
        again
            .iter()
            .map(|l| (l.request_id, l.attempt))
            .collect::<Vec<_>>(),
        vec![(a.id, 2), (b.id, 2)]
    );
    let delivered = CallbackOutcome::Delivered { status: 204 };
    assert!(
        !store
            .finish_callback(&lb, &delivered, T0 + 1_012)
            .await
            .expect("finish"),
        "the expired try lost its lease"
    );
    assert!(
        store
            .finish_callback(&again[1], &delivered, T0 + 1_013)
            .await
            .expect("finish")
    );
    let gone = CallbackOutcome::Failed {
        status: Some(410),
        error: "HTTP 410: gone".into(),
    };
    assert!(
        store
            .finish_callback(&again[0], &gone, T0 + 1_014)
            .await
            .expect("finish")
    );

    let cb = callback_of(&store, b.id).await;
    assert_eq!(
        (cb.state, cb.attempts, cb.last_status, cb.delivered_at),
        (CallbackState::Delivered, 2, Some(204), Some(T0 + 1_013))
    );
    let cb = callback_of(&store, a.id).await;
    assert_eq!(
        (cb.state, cb.last_status, cb.last_error.as_deref()),
        (CallbackState::Failed, Some(410), Some("HTTP 410: gone"))
    );
    assert!(
        store
            .lease_callbacks("n3", T0 + 999_999, 1_000, &LeaseQuota::any(10))
            .await
            .expect("lease")
            .is_empty()
    );
    assert_eq!(store.callback_backlog().await.expect("backlog"), 0);
    assert_eq!(
        listed_by_callback(&store, CallbackState::Failed).await,
        vec![a.id]
    );
    assert_eq!(
        listed_by_callback(&store, CallbackState::Delivered).await,
        vec![b.id]
    );
    assert!(
        listed_by_callback(&store, CallbackState::Pending)
            .await
            .is_empty()
    );

    // Pruned with its request.
    assert!(
        store
            .prune(T0 + 2_000_000, T0 + 2_000_000, 100)
            .await
            .expect("prune")
            >= 3
    );
    assert!(
        store
            .callbacks(&[a.id, b.id])
            .await
            .expect("callbacks")
            .is_empty()
    );
}

/// CB-7: a lease takes each namespace's oldest due deliveries up to its share first (the
/// oldest of them all when the shares exceed the limit), lends nothing of the slots it keeps
/// free, and lends the rest to the oldest due of any namespace, one no longer configured too.
/// A delivery in flight is not taken again; each lease names its namespace.
async fn a_callback_lease_takes_each_namespaces_share_first_then_lends_the_oldest_due_cb7(
    store: DynStore,
) {
    let mut made = Vec::new();
    for (namespace, i) in [
        ("a", 0),
        ("a", 1),
        ("a", 2),
        ("a", 3),
        ("a", 4),
        ("b", 5),
        ("c", 6),
    ] {
        let r = create(
            &store,
            with_callback(
                by_hash_in(namespace, &format!("share {namespace}{i}"), T0 + i),
                &format!("http://{namespace}.example/hook"),
            ),
        )
        .await;
        store
            .cancel(namespace, r.id, T0 + 10)
            .await
            .expect("cancel");
        made.push((namespace, r.id));
    }
    let a: Vec<Uuid> = made.iter().filter(|m| m.0 == "a").map(|m| m.1).collect();
    let (b, c) = (made[5].1, made[6].1);
    let quota = |shares: &[(&str, usize)], limit: usize, keep_free: usize| LeaseQuota {
        shares: shares.iter().map(|(n, k)| ((*n).to_string(), *k)).collect(),
        limit,
        keep_free,
        lend_cap: usize::MAX,
    };
    let made = &made;
    let lease = |quota: LeaseQuota, now: Millis| {
        let store = Arc::clone(&store);
        async move {
            let leases = store
                .lease_callbacks("n1", now, 60_000, &quota)
                .await
                .expect("lease");
            for l in &leases {
                let namespace = made.iter().find(|m| m.1 == l.request_id).expect("made").0;
                assert_eq!(l.namespace, namespace, "the lease names its namespace");
            }
            let mut ids: Vec<Uuid> = leases.iter().map(|l| l.request_id).collect();
            ids.sort();
            ids
        }
    };

    assert_eq!(
        lease(quota(&[("b", 2), ("a", 2)], 2, 0), T0 + 20).await,
        vec![a[0], a[1]],
        "shares beyond the limit: the oldest of what they take"
    );
    assert_eq!(
        lease(quota(&[("a", 2), ("b", 2)], 5, 2), T0 + 21).await,
        vec![a[2], a[3], b],
        "each share; the two slots left are kept free, not lent"
    );
    assert_eq!(
        lease(quota(&[("a", 0), ("b", 2)], 1, 0), T0 + 22).await,
        vec![a[4]],
        "a's share is in flight and b has nothing due: lent to the oldest due"
    );
    assert_eq!(
        lease(quota(&[("a", 2), ("b", 2)], 10, 0), T0 + 23).await,
        vec![c],
        "a namespace no longer configured gets what is lent"
    );
    assert!(
        lease(LeaseQuota::any(10), T0 + 24).await.is_empty(),
        "each delivery is in flight once"
    );
}

/// LC-2a: a lease of requests takes each namespace's oldest due up to its share first (the
/// oldest of them all when the shares exceed the limit), lends nothing of the slots it keeps
/// free, and lends the rest to the oldest due of any namespace, one no longer configured too.
/// A request not yet due, or running, is not taken; each taken one is running, attempt 1.
async fn a_lease_takes_each_namespaces_share_of_due_requests_first_then_lends_the_oldest_lc2a(
    store: DynStore,
) {
    let mut made = Vec::new();
    for (namespace, i) in [
        ("a", 0),
        ("a", 1),
        ("a", 2),
        ("a", 3),
        ("a", 4),
        ("b", 5),
        ("c", 6),
        ("b", 100),
        ("a", 150),
        ("a", 151),
        ("c", 152),
        ("a", 153),
    ] {
        let r = create(
            &store,
            by_hash_in(namespace, &format!("share {namespace}{i}"), T0 + i),
        )
        .await;
        made.push((namespace, r.id));
    }
    let a: Vec<Uuid> = made.iter().filter(|m| m.0 == "a").map(|m| m.1).collect();
    let (b, c, b_later) = (made[5].1, made[6].1, made[7].1);
    let later: Vec<Uuid> = made[8..].iter().map(|m| m.1).collect();
    let quota =
        |shares: &[(&str, usize)], limit: usize, keep_free: usize, lend_cap: usize| LeaseQuota {
            shares: shares.iter().map(|(n, k)| ((*n).to_string(), *k)).collect(),
            limit,
            keep_free,
            lend_cap,
        };
    const MAX: usize = usize::MAX;
    let made = &made;
    let lease = |quota: LeaseQuota, now: Millis| {
        let store = Arc::clone(&store);
        async move {
            let leased = store
                .lease_many("n1", now, LEASE_MS, &quota)
                .await
                .expect("lease");
            for (lease, record) in &leased {
                let namespace = made.iter().find(|m| m.1 == lease.id).expect("made").0;
                assert_eq!(record.namespace, namespace);
                assert_eq!(record.status, Status::Running);
                assert_eq!((lease.attempt, record.attempts), (1, 1));
                assert_eq!(&*lease.owner, format!("n1/{}", lease.id));
            }
            let mut ids: Vec<Uuid> = leased.iter().map(|(l, _)| l.id).collect();
            ids.sort();
            ids
        }
    };

    assert_eq!(
        lease(quota(&[("b", 2), ("a", 2)], 2, 0, MAX), T0 + 20).await,
        vec![a[0], a[1]],
        "shares beyond the limit: the oldest of what they take"
    );
    assert_eq!(
        lease(quota(&[("a", 2), ("b", 2)], 5, 2, MAX), T0 + 21).await,
        vec![a[2], a[3], b],
        "each share, b's later request not yet due; the two slots left are kept free, not lent"
    );
    assert_eq!(
        lease(quota(&[("a", 0), ("b", 2)], 1, 0, MAX), T0 + 22).await,
        vec![a[4]],
        "a's share is running and b has nothing due: lent to the oldest due"
    );
    assert_eq!(
        lease(quota(&[("a", 2), ("b", 2)], 10, 0, MAX), T0 + 23).await,
        vec![c],
        "a namespace no longer configured gets what is lent"
    );
    assert_eq!(
        lease(quota(&[("b", 2)], 10, 0, 0), T0 + 120).await,
        vec![b_later],
        "a's share is its own; nothing may be lent"
    );
    assert_eq!(
        lease(quota(&[("a", 1), ("a", 1)], 10, 0, 1), T0 + 200).await,
        vec![later[0], later[1]],
        "a namespace named twice takes its share once; one more is lent, the oldest due"
    );
    assert_eq!(
        lease(LeaseQuota::any(10), T0 + 300).await,
        vec![later[2], later[3]],
        "each request is running once; one pool takes what is due"
    );
}

/// CB-4: leasers racing on many due deliveries take each exactly once, through a namespace's
/// share and through what is lent (CB-7).
async fn racing_callback_leasers_never_share_a_delivery_cb4(store: DynStore) {
    let mut ids = HashSet::new();
    for i in 0..40 {
        let r = create(
            &store,
            with_callback(by_hash(&format!("race {i}"), T0), "http://x.example/"),
        )
        .await;
        store.cancel(NS, r.id, T0 + 1).await.expect("cancel");
        ids.insert(r.id);
    }
    assert_eq!(store.callback_backlog().await.expect("backlog"), 40);
    let mut tasks = Vec::new();
    for n in 0..4 {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            let mut got = Vec::new();
            let quota = LeaseQuota {
                shares: vec![(NS.to_string(), 2)],
                limit: 3,
                keep_free: 0,
                lend_cap: usize::MAX,
            };
            for _ in 0..10 {
                let leases = store
                    .lease_callbacks(&format!("n{n}"), T0 + 2, 60_000, &quota)
                    .await
                    .expect("lease");
                got.extend(leases.into_iter().map(|l| l.request_id));
            }
            got
        }));
    }
    let mut seen = HashSet::new();
    for t in tasks {
        for id in t.await.expect("task") {
            assert!(seen.insert(id), "{id} leased twice");
        }
    }
    assert_eq!(seen, ids);
}

/// CB-4: whatever makes a request terminal makes its callback due in that write: a success, a
/// refusal, a cancel, the sweep's `lease_expired`, a hand-back of the last attempt; a request
/// sent back to `pending` (a retry, a recovery) does not.
async fn a_callback_falls_due_however_its_request_ends_cb4(store: DynStore) {
    let url = "http://x.example/";
    let mut ended = Vec::new();
    let ok = create(&store, with_callback(by_hash("ends ok", T0), url)).await;
    let (l, _) = lease_at(&store, "node/a", T0).await;
    store.finish(&l, succeeded(), T0 + 1).await.expect("finish");
    ended.push(ok.id);
    let no = create(&store, with_callback(by_hash("ends refused", T0 + 2), url)).await;
    let (l, _) = lease_at(&store, "node/a", T0 + 2).await;
    store.finish(&l, refused(), T0 + 3).await.expect("finish");
    ended.push(no.id);
    let cancelled = create(
        &store,
        with_callback(by_hash("ends cancelled", T0 + 4), url),
    )
    .await;
    store
        .cancel(NS, cancelled.id, T0 + 5)
        .await
        .expect("cancel");
    ended.push(cancelled.id);
    let swept = create(&store, with_callback(by_hash("ends swept", T0 + 6), url)).await;
    let (l, _) = lease_at(&store, "node/a", T0 + 6).await;
    assert_eq!(l.id, swept.id);
    let out = store.sweep(T0 + 6 + LEASE_MS + 1, 1).await.expect("sweep");
    assert_eq!(out.failed, vec![swept.id]);
    ended.push(swept.id);
    let handed = create(
        &store,
        with_callback(by_hash("ends handed back", T0 + 7), url),
    )
    .await;
    let (l, _) = lease_at(&store, "node/a", T0 + 7).await;
    assert!(store.release(&l, T0 + 8, 1).await.expect("release"));
    ended.push(handed.id);
    // Sent back to pending: not terminal, not due.
    let retried = create(&store, with_callback(by_hash("retried", T0 + 9), url)).await;
    let (l, _) = lease_at(&store, "node/a", T0 + 9).await;
    let retry = Outcome::Retry {
        next_retry_at: T0 + 1_000_000,
        error: ErrorInfo {
            kind: ErrorType::AttemptsExhausted,
            message: "attempt 1 failed".into(),
            status: Some(503),
        },
    };
    store.finish(&l, retry, T0 + 10).await.expect("finish");

    let mut leased: Vec<Uuid> = store
        .lease_callbacks("n", T0 + LEASE_MS + 100, 1_000, &LeaseQuota::any(50))
        .await
        .expect("lease")
        .iter()
        .map(|l| l.request_id)
        .collect();
    leased.sort();
    ended.sort();
    assert_eq!(leased, ended);
    assert!(!leased.contains(&retried.id));
}
