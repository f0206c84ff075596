//! PostgreSQL adapter of [`Store`]: one database shared by any number of `holdfast serve`
//! processes (SPEC DU-3).
//!
//! Every method keeps the semantics of [`super::sqlite::SqliteStore`]; the conformance suite
//! (`tests/api/store_conformance.rs`) runs the same tests against both. What differs is how
//! atomicity is reached: SQLite serialises all writes through one connection, PostgreSQL runs
//! many writers at once under READ COMMITTED and relies on row locks.
//!
//! # Group commit
//!
//! The writes on every request's path are one statement each (CTEs whose first part is the
//! fenced write and whose other parts hang off its `RETURNING` row): `submit_and_lease`,
//! `finish_read`, `heartbeat`, the delivery counters, and a whole chunk group commit (every
//! stream's batches as arrays). All but the chunk groups queue for `WRITERS` (two) writer
//! tasks, each on a connection it holds: a writer takes everything queued, orders it by what
//! it locks (claims, then requests by id), runs it between one `BEGIN` and one `COMMIT`, and
//! answers the callers only after the commit (RS-1); the submissions of a group share one
//! statement, and so do its successful outcomes. A failing write makes the group run again
//! write by write, so it fails alone. Chunk groups run on a held connection of their own.
//! docs/postgres.md has the statement and round-trip counts.
//!
//! # Locking notes
//!
//! - **Claim** (ID-7): `INSERT ... ON CONFLICT (namespace, claim_key) DO UPDATE ... WHERE
//!   claims.expires_at <= now RETURNING`. A submission racing an uncommitted insert of the same
//!   claim waits for it; once it commits, the condition is evaluated against the committed row
//!   (live, so no update and no row returned) and the loser attaches. PostgreSQL locks the
//!   conflicting row even when the `DO UPDATE` condition is false, so the claim cannot change
//!   between the upsert and the loser's read of it.
//! - **Lease** (LC-2): one `UPDATE ... WHERE id = (SELECT ... FOR UPDATE SKIP LOCKED LIMIT 1)`.
//!   Concurrent leasers skip each other's candidate rows instead of queueing on them.
//! - **Fencing** (LC-3): every worker write is `UPDATE ... WHERE id = $id AND lease_owner = $owner`.
//!   A write that waited for a concurrent sweep or cancel re-checks the condition on the new row
//!   version and matches nothing.
//! - **Sweep** (LC-4, LC-8): the expired leases are selected `FOR UPDATE SKIP LOCKED`, so sweepers
//!   on several nodes never recover the same request twice or append two `reset` chunks, and
//!   never wait on each other.
//! - **Lock order** (one global order, issue 28): request rows by id, then claim rows by
//!   namespace and key in byte order. The sweep selects its expired rows `ORDER BY id` and
//!   releases the failed ones' claims last, sorted ([`release_claims_in_order`], as prune and
//!   every settlement do); a writer group runs its request writes before its submissions, and
//!   an outcome that fails a request (locking it, then its claims) commits alone, first;
//!   `append_chunks` locks its requests in id order. No deadlock cycles.
//!
//! # Cross-node wake-ups (LISTEN/NOTIFY)
//!
//! Writes that other nodes' readers or workers wait for send a notification from inside their
//! transaction, so it is delivered only if and after the write commits:
//!
//! - channel [`CHANGED_CHANNEL`], payload `"<origin> <id>,<id>,..."`: chunks were appended
//!   (one notification per group-commit transaction, never one per chunk) or the status
//!   changed (`finish`, `sweep`, `cancel`, `release`). Payloads stay under PostgreSQL's
//!   8000-byte limit by splitting the ids into groups of [`IDS_PER_NOTIFY`]; one statement
//!   sends them all.
//! - channel [`WORK_CHANNEL`], payload `"<origin>"`: a request became due (`submit` created
//!   one, `sweep` recovered one, `release` handed one back).
//!
//! `<origin>` identifies the [`PostgresStore`] that wrote; its own listener skips those, because
//! the writing process already told its hub directly. [`Store::listen`] holds one dedicated
//! connection (outside the query pool) on `LISTEN` and reports the rest as [`Notification`]s,
//! which `app.rs` turns into reader and worker wake-ups. PostgreSQL drops notifications for a listener whose connection is gone; the
//! listener then reconnects and carries on, and the polling that readers and workers do anyway
//! covers the gap.
//!
//! # NUL characters
//!
//! PostgreSQL `TEXT` cannot hold U+0000. The request body and the provider's response body are
//! `BYTEA` and stay byte-exact; in the free-text columns (`model`, `error_message`, a chunk's
//! `event` and `data`) a NUL is stored as U+FFFD, so input such as `{"model":"a\u0000"}` or a
//! provider error body holding NUL bytes never makes a write fail (IN-2). Data chunks are JSON
//! or `[DONE]` (checked by the worker), which cannot hold a raw NUL.

use std::borrow::Cow;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::FutureExt;
use futures::future::BoxFuture;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgListener, PgPool, PgPoolOptions, PgRow};
use sqlx::{Connection, Executor, Postgres, Row, Transaction};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};
use uuid::Uuid;

use super::row::RawRecord;
use super::row::tokens_of;
use super::rules::{self, Expired, Settle, failure_releases_claim};
use super::{
    Chunk, ChunkBatch, ChunkKind, ClaimKind, Counts, ErrorInfo, Lease, LeaseTo, ListFilter, Millis,
    NewRequest, Notification, Outcome, RequestRecord, ResponseRef, Status, Store, StoreError,
    Submitted, Swept, Usage, UsageGroup, UsageQuery, UsageRow,
};
use crate::provider::Route;

/// Connections per process unless [`PostgresStore::open_with`] says otherwise.
pub const DEFAULT_MAX_CONNECTIONS: u32 = 16;
/// How long a pool waits for a connection unless [`PostgresStore::open_with_limits`] says
/// otherwise (`database_timeout_ms`'s default).
pub const DEFAULT_ACQUIRE_TIMEOUT: Duration = Duration::from_millis(1_500);

/// Channel of "these requests changed" notifications; payload `"<origin> <id>,<id>,..."`.
pub const CHANGED_CHANNEL: &str = "holdfast_changed";
/// Channel of "new work is due" notifications; payload `"<origin>"`.
pub const WORK_CHANNEL: &str = "holdfast_work";
/// Request ids per notification: 200 × 37 bytes plus the origin stays well under PostgreSQL's
/// 8000-byte payload limit.
pub const IDS_PER_NOTIFY: usize = 200;
/// Pause before the listener reconnects after a failure.
const LISTEN_RETRY: Duration = Duration::from_secs(1);

/// Session settings of every connection, so that a node that vanishes without closing its
/// sockets (power loss, a network partition) cannot hold row locks for the hours the OS's own
/// keepalive takes: the server drops a connection idle inside a transaction for a minute (a
/// group transaction runs its statements back to back) and probes a silent peer after 30 s, 3
/// times 10 s apart. Set after connecting rather than as startup parameters, which connection
/// poolers such as PgBouncer refuse (docs/postgres.md).
const SESSION_SETTINGS: [&str; 4] = [
    "SET idle_in_transaction_session_timeout = '60s'",
    "SET tcp_keepalives_idle = 30",
    "SET tcp_keepalives_interval = 10",
    "SET tcp_keepalives_count = 3",
];

/// Applies [`SESSION_SETTINGS`] to a new connection.
fn apply_session_settings<'c>(
    conn: &'c mut PgConnection,
    _: sqlx::pool::PoolConnectionMetadata,
) -> BoxFuture<'c, Result<(), sqlx::Error>> {
    Box::pin(async move {
        for setting in SESSION_SETTINGS {
            conn.execute(setting).await?;
        }
        Ok(())
    })
}

/// The shared store for several nodes.
#[derive(Debug, Clone)]
pub struct PostgresStore {
    pool: PgPool,
    /// A pool of one connection, opened lazily, for [`Store::listen`]: a `LISTEN` connection
    /// is held for good, so it must not take a query connection away.
    listen_pool: PgPool,
    /// Random per store, sent with every notification, so the listener can skip this store's
    /// own (the writer already woke its local hub).
    origin: String,
    /// The group-commit writers' queue: submissions, finishes, heartbeats and the delivery
    /// counters of this process, many to a transaction, on [`WRITERS`] held connections.
    writes: mpsc::UnboundedSender<Box<dyn WriteJob>>,
    /// The connection chunk groups are appended on, held between appends (the chunk writer
    /// sends one group at a time).
    appends: Arc<tokio::sync::Mutex<Held>>,
}

/// A connection of a pool of its own, taken on first use and kept until it fails.
#[derive(Debug)]
struct Held {
    pool: PgPool,
    conn: Option<PoolConnection<Postgres>>,
}

/// The migrations of `migrations/postgres`, compiled in.
static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/postgres");

/// The newest schema version this binary knows.
pub(crate) fn latest_schema() -> i64 {
    MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0)
}

/// The schema version of the database at `url`, read without changing it (0: not migrated yet).
///
/// # Errors
/// [`StoreError`] when the server cannot be reached.
pub(crate) async fn schema_version(url: &str) -> Result<i64, StoreError> {
    let options = PgConnectOptions::from_str(url)?.application_name("holdfast-version");
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(options)
        .await?;
    let migrated: bool = sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL")
        .fetch_one(&pool)
        .await?;
    let version: i64 = if migrated {
        sqlx::query_scalar("SELECT COALESCE(MAX(version), 0) FROM _sqlx_migrations WHERE success")
            .fetch_one(&pool)
            .await?
    } else {
        0
    };
    pool.close().await;
    Ok(version)
}

impl PostgresStore {
    /// Connects to `url` (`postgres://` or `postgresql://`) with a pool of
    /// [`DEFAULT_MAX_CONNECTIONS`] and applies the migrations in `migrations/postgres`.
    ///
    /// # Errors
    /// [`StoreError`] when the server cannot be reached or the schema cannot be migrated. The
    /// messages never contain the URL (IN-3).
    pub async fn open(url: &str) -> Result<Self, StoreError> {
        Self::open_with(url, DEFAULT_MAX_CONNECTIONS).await
    }

    /// [`PostgresStore::open`] with a pool of at most `max_connections`.
    ///
    /// # Errors
    /// As [`PostgresStore::open`].
    pub async fn open_with(url: &str, max_connections: u32) -> Result<Self, StoreError> {
        Self::open_with_limits(url, max_connections, DEFAULT_ACQUIRE_TIMEOUT).await
    }

    /// [`PostgresStore::open_with`], waiting at most `acquire_timeout` for a connection of any
    /// of its pools (a connection attempt included): past it the caller gets
    /// [`StoreError::Unavailable`] (`database_timeout_ms`, RS-10).
    ///
    /// # Errors
    /// As [`PostgresStore::open`].
    pub async fn open_with_limits(
        url: &str,
        max_connections: u32,
        acquire_timeout: Duration,
    ) -> Result<Self, StoreError> {
        let options = PgConnectOptions::from_str(url)?.application_name("holdfast");
        let pool_of = |size: u32| {
            PgPoolOptions::new()
                .max_connections(size)
                .acquire_timeout(acquire_timeout)
                .after_connect(apply_session_settings)
        };
        let listen_pool =
            pool_of(1).connect_lazy_with(options.clone().application_name("holdfast-listen"));
        let writer_pool =
            pool_of(WRITERS).connect_lazy_with(options.clone().application_name("holdfast-writer"));
        let append_pool =
            pool_of(1).connect_lazy_with(options.clone().application_name("holdfast-chunks"));
        let pool = pool_of(max_connections.max(1))
            .connect_with(options)
            .await?;
        // Concurrent starts of several nodes are fine: the migrator takes an advisory lock.
        MIGRATOR.run(&pool).await?;
        let (writes, queue) = mpsc::unbounded_channel();
        let queue = Arc::new(tokio::sync::Mutex::new(queue));
        for _ in 0..WRITERS {
            tokio::spawn(write_loop(writer_pool.clone(), Arc::clone(&queue)));
        }
        Ok(PostgresStore {
            pool,
            listen_pool,
            origin: Uuid::new_v4().simple().to_string(),
            writes,
            appends: Arc::new(tokio::sync::Mutex::new(Held {
                pool: append_pool,
                conn: None,
            })),
        })
    }

    /// Runs `work` as one job of the writer's next group commit and returns its result once
    /// that commit is durable (RS-1). `work` may run twice: a group whose transaction fails is
    /// run again job by job, so one failing write fails alone.
    async fn write<T, F>(&self, key: LockKey, work: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: for<'c> Fn(&'c mut PgConnection) -> BoxFuture<'c, Result<T, StoreError>>
            + Send
            + 'static,
    {
        let (reply, answer) = oneshot::channel();
        let job = Job {
            key,
            work: Some(work),
            result: None,
            reply,
        };
        self.writes
            .send(Box::new(job))
            .map_err(|_| StoreError::Unavailable("the PostgreSQL writer has stopped".into()))?;
        answer.await.map_err(|_| {
            StoreError::Unavailable("the PostgreSQL writer stopped before answering".into())
        })?
    }

    /// Runs [`APPEND_CHUNKS`] for `plan` on the held append connection.
    async fn append_held(&self, plan: &AppendPlan) -> Result<Vec<i32>, StoreError> {
        let mut held = self.appends.lock().await;
        let mut conn = match held.conn.take() {
            Some(conn) => conn,
            None => held.pool.acquire().await?,
        };
        let result = append_in(&mut conn, plan, &self.origin).await;
        // A failure may be the connection's: keep it only if it still answers.
        if result.is_ok() || conn.ping().await.is_ok() {
            held.conn = Some(conn);
        }
        result
    }

    /// Notifies [`CHANGED_CHANNEL`] that `ids` changed, delivered when `tx` commits. One
    /// statement however many ids; nothing when there are none.
    async fn notify_changed(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        ids: &[Uuid],
    ) -> Result<(), StoreError> {
        if ids.is_empty() {
            return Ok(());
        }
        let payloads: Vec<String> = ids
            .chunks(IDS_PER_NOTIFY)
            .map(|group| {
                let ids: Vec<String> = group.iter().map(Uuid::to_string).collect();
                format!("{} {}", self.origin, ids.join(","))
            })
            .collect();
        sqlx::query("SELECT pg_notify($1, p) FROM UNNEST($2::text[]) AS p")
            .bind(CHANGED_CHANNEL)
            .bind(&payloads)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    /// Notifies [`WORK_CHANNEL`] that a request is due, delivered when `tx` commits.
    async fn notify_work(&self, tx: &mut Transaction<'_, Postgres>) -> Result<(), StoreError> {
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(WORK_CHANNEL)
            .bind(&self.origin)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    /// One `LISTEN` session: connects, listens on both channels and dispatches notifications
    /// until `shutdown` (returns `Ok`) or the connection fails for good (returns the error).
    /// sqlx reconnects a dropped connection by itself on the next receive and re-issues the
    /// `LISTEN`s; what was sent meanwhile is lost (the polling fallback covers it).
    async fn listen_session(
        &self,
        notifications: &mpsc::UnboundedSender<Notification>,
        shutdown: &CancellationToken,
    ) -> Result<(), sqlx::Error> {
        let mut listener = PgListener::connect_with(&self.listen_pool).await?;
        listener.listen_all([CHANGED_CHANNEL, WORK_CHANNEL]).await?;
        info!("listening for cross-node wake-ups");
        loop {
            let received = tokio::select! {
                () = shutdown.cancelled() => return Ok(()),
                received = listener.try_recv() => received?,
            };
            let Some(notification) = received else {
                warn!(
                    "LISTEN connection lost; reconnecting (wake-ups sent meanwhile are lost, polling covers them)"
                );
                continue;
            };
            let payload = notification.payload();
            let (origin, ids) = payload.split_once(' ').unwrap_or((payload, ""));
            if origin == self.origin {
                continue;
            }
            if notification.channel() == WORK_CHANNEL {
                let _ = notifications.send(Notification::Work);
                continue;
            }
            for id in ids.split(',') {
                match Uuid::parse_str(id) {
                    Ok(id) => {
                        let _ = notifications.send(Notification::Changed(id));
                    }
                    Err(_) => debug!(payload, "ignoring a malformed wake-up"),
                }
            }
        }
    }

    async fn fetch_in(
        tx: &mut Transaction<'_, Postgres>,
        id: Uuid,
    ) -> Result<Option<RequestRecord>, StoreError> {
        let row = sqlx::query(concat!(
            "SELECT ",
            request_columns!(),
            " FROM requests WHERE id = $1"
        ))
        .bind(id)
        .fetch_optional(&mut **tx)
        .await?;
        row.as_ref().map(record_from_row).transpose()
    }
}

/// Most jobs in one group commit: bounds a transaction's length (and the wait of the first job
/// in it), not its correctness.
const MAX_JOBS_PER_COMMIT: usize = 512;
/// Group-commit writers per process, each on a connection of its own: while one waits for its
/// commit the next group is already being written, and the server works on both at once.
const WRITERS: u32 = 2;

/// What a job locks first, to order the jobs of a group in the adapter's one global lock order
/// (module notes): requests by id, then claims by namespace and key in byte order. A write that
/// locks a request and then its claims is committed alone, before the group's others, so no
/// group holds a claim while it waits for a request row; and no two transactions take the same
/// rows in opposite orders (issue 28).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum LockKey {
    /// An outcome that fails request `0`, which may release its claims (ID-6): committed in a
    /// transaction of its own, first.
    Releasing(Uuid),
    /// A write to one request's row.
    Request(Uuid),
    /// A submission: the claim `(namespace, claim_key)`.
    Claim(String, String),
}

impl LockKey {
    /// The key of an outcome write of request `id`: [`LockKey::Releasing`] when it fails the
    /// request.
    fn outcome(id: Uuid, outcome: &Outcome) -> LockKey {
        if matches!(outcome, Outcome::Failed { .. }) {
            LockKey::Releasing(id)
        } else {
            LockKey::Request(id)
        }
    }
}

/// One write of a group commit, type-erased for the writer's queue.
trait WriteJob: Send {
    /// What it locks first.
    fn key(&self) -> &LockKey;
    /// Runs the write on `conn` (inside the group's transaction, or alone) and keeps its
    /// result. `false`: it failed, and the group's transaction with it.
    fn run<'c>(&'c mut self, conn: &'c mut PgConnection) -> BoxFuture<'c, bool>;
    /// Answers the caller once its write is settled; `commit` is the failure of the commit
    /// that was to store it.
    fn reply(self: Box<Self>, commit: Result<(), &str>);
    /// The successful outcome this job records, which can share one statement with the
    /// group's others ([`FINISH_SUCCEEDED_MANY`]).
    fn succeeded(&mut self) -> Option<&mut FinishJob> {
        None
    }
    /// The submission this job records, which can share one statement with the group's
    /// others ([`SUBMIT_MANY`]).
    fn submission(&mut self) -> Option<&mut SubmitJob> {
        None
    }
}

/// [`Store::submit_and_lease`]: run alone it is [`submit_in`]; with others of its group, one
/// [`SUBMIT_MANY`] (and [`submit_in`] again for those that found a live claim).
struct SubmitJob {
    key: LockKey,
    new: NewRequest,
    /// The headers as stored.
    headers: String,
    /// The lease to take on a request it creates.
    owner: Option<String>,
    expires_at: Option<Millis>,
    origin: String,
    result: Option<Result<Submitted, StoreError>>,
    reply: oneshot::Sender<Result<Submitted, StoreError>>,
}

impl WriteJob for SubmitJob {
    fn key(&self) -> &LockKey {
        &self.key
    }

    fn run<'c>(&'c mut self, conn: &'c mut PgConnection) -> BoxFuture<'c, bool> {
        Box::pin(async move {
            let result = unpanicked(submit_in(
                conn,
                &self.new,
                &self.headers,
                self.owner.as_deref(),
                self.expires_at,
                &self.origin,
            ))
            .await;
            keep(&mut self.result, result)
        })
    }

    fn reply(self: Box<Self>, commit: Result<(), &str>) {
        let _ = self.reply.send(answer(self.result, commit));
    }

    fn submission(&mut self) -> Option<&mut SubmitJob> {
        Some(self)
    }
}

/// `write`'s result, or a failure when it panicked: a panicking write fails alone (its group
/// is rolled back and run again write by write) and the writer carries on.
async fn unpanicked<T>(
    write: impl std::future::Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    std::panic::AssertUnwindSafe(write)
        .catch_unwind()
        .await
        .unwrap_or_else(|_| {
            Err(StoreError::Unavailable(
                "the write panicked and was rolled back".into(),
            ))
        })
}

/// Keeps a job's `result` for its answer; whether it succeeded (`false` fails the group).
fn keep<T>(slot: &mut Option<Result<T, StoreError>>, result: Result<T, StoreError>) -> bool {
    let ok = result.is_ok();
    *slot = Some(result);
    ok
}

/// What a job answers: its own failure wins (nothing of it was stored), then the commit's.
fn answer<T>(
    result: Option<Result<T, StoreError>>,
    commit: Result<(), &str>,
) -> Result<T, StoreError> {
    match (result, commit) {
        (Some(Err(e)), _) => Err(e),
        (Some(Ok(_)), Err(e)) | (None, Err(e)) => Err(StoreError::Unavailable(format!(
            "commit failed, nothing was stored: {e}"
        ))),
        (Some(Ok(value)), Ok(())) => Ok(value),
        (None, Ok(())) => Err(StoreError::Unavailable("the write never ran".into())),
    }
}

/// [`Store::finish_read`] of an [`Outcome::Succeeded`], the commonest write after submissions:
/// run alone it is [`finish_in`]; with others of its group, one [`FINISH_SUCCEEDED_MANY`].
struct FinishJob {
    key: LockKey,
    lease: Lease,
    outcome: Outcome,
    now: Millis,
    /// The notification payload naming the request, for [`finish_in`].
    changed: String,
    result: Option<Result<Option<RequestRecord>, StoreError>>,
    reply: oneshot::Sender<Result<Option<RequestRecord>, StoreError>>,
}

impl WriteJob for FinishJob {
    fn key(&self) -> &LockKey {
        &self.key
    }

    fn run<'c>(&'c mut self, conn: &'c mut PgConnection) -> BoxFuture<'c, bool> {
        Box::pin(async move {
            let result = unpanicked(finish_in(
                conn,
                &self.lease,
                &self.outcome,
                self.now,
                &self.changed,
            ))
            .await;
            keep(&mut self.result, result)
        })
    }

    fn reply(self: Box<Self>, commit: Result<(), &str>) {
        let _ = self.reply.send(answer(self.result, commit));
    }

    fn succeeded(&mut self) -> Option<&mut FinishJob> {
        Some(self)
    }
}

struct Job<T, F> {
    key: LockKey,
    /// Dropped before the answer is sent, so whatever it shares with the caller is the
    /// caller's alone again.
    work: Option<F>,
    result: Option<Result<T, StoreError>>,
    reply: oneshot::Sender<Result<T, StoreError>>,
}

impl<T, F> WriteJob for Job<T, F>
where
    T: Send + 'static,
    F: for<'c> Fn(&'c mut PgConnection) -> BoxFuture<'c, Result<T, StoreError>> + Send + 'static,
{
    fn key(&self) -> &LockKey {
        &self.key
    }

    fn run<'c>(&'c mut self, conn: &'c mut PgConnection) -> BoxFuture<'c, bool> {
        Box::pin(async move {
            let Some(work) = &self.work else {
                return false;
            };
            keep(&mut self.result, unpanicked(work(conn)).await)
        })
    }

    fn reply(self: Box<Self>, commit: Result<(), &str>) {
        let Job {
            work,
            result,
            reply,
            ..
        } = *self;
        drop(work);
        // A dropped receiver is a caller that gave up.
        let _ = reply.send(answer(result, commit));
    }
}

/// One writer task: takes everything queued (while holding the queue, so the writers take
/// turns) as one group and commits it on its held connection, until every sender is gone. A
/// connection that fails is given back (the pool tests it and drops it) and a fresh one is
/// taken for the next group.
async fn write_loop(
    pool: PgPool,
    queue: Arc<tokio::sync::Mutex<mpsc::UnboundedReceiver<Box<dyn WriteJob>>>>,
) {
    let mut group: Vec<Box<dyn WriteJob>> = Vec::with_capacity(MAX_JOBS_PER_COMMIT);
    let mut held: Option<PoolConnection<Postgres>> = None;
    loop {
        {
            let mut queue = queue.lock().await;
            let Some(job) = queue.recv().await else {
                return;
            };
            group.push(job);
            while group.len() < MAX_JOBS_PER_COMMIT {
                match queue.try_recv() {
                    Ok(job) => group.push(job),
                    Err(_) => break,
                }
            }
        }
        // Jobs in a group are concurrent (each caller waits for its answer before its next
        // write), so any order is theirs; this one keeps writers from deadlocking.
        group.sort_by(|a, b| a.key().cmp(b.key()));
        let mut conn = match held.take() {
            Some(conn) => conn,
            None => match pool.acquire().await {
                Ok(conn) => conn,
                Err(e) => {
                    let e = e.to_string();
                    warn!(error = %e, jobs = group.len(), "the PostgreSQL writer cannot connect");
                    for job in group.drain(..) {
                        job.reply(Err(&e));
                    }
                    continue;
                }
            },
        };
        let started = std::time::Instant::now();
        let jobs = group.len();
        let committed = commit_group(&mut conn, &mut group).await;
        metrics::histogram!(crate::metrics::POSTGRES_COMMIT_SECONDS)
            .record(started.elapsed().as_secs_f64());
        metrics::histogram!(crate::metrics::POSTGRES_COMMIT_JOBS).record(jobs as f64);
        let commit = match &committed {
            Ok(()) => {
                held = Some(conn);
                Ok(())
            }
            Err(e) => {
                warn!(
                    error = %e,
                    jobs = group.len(),
                    "PostgreSQL group commit failed; its writes were rolled back"
                );
                Err(e.as_str())
            }
        };
        for job in group.drain(..) {
            job.reply(commit);
        }
    }
}

/// Runs every job of `group` in one transaction and commits it; a lone job runs as its own
/// statement without `BEGIN`/`COMMIT`. When a job fails, the transaction is rolled back and
/// each job runs again in a transaction of its own, so only the failing one fails. `Err`: the
/// connection failed, and no job's write is known to be stored.
async fn commit_group(
    conn: &mut PgConnection,
    group: &mut [Box<dyn WriteJob>],
) -> Result<(), String> {
    // Writes that lock a request and then its claims run alone, first (the sort puts them
    // there): inside a group they would hold a claim while the group waits for request rows.
    let alone = group
        .iter()
        .take_while(|job| matches!(job.key(), LockKey::Releasing(_)))
        .count();
    let (releasing, group) = group.split_at_mut(alone);
    for job in releasing {
        run_alone(conn, job).await?;
    }
    if let [job] = group {
        return run_alone(conn, job).await;
    }
    if group.is_empty() {
        return Ok(());
    }
    match in_one_transaction(conn, group).await {
        Ok(true) => return Ok(()),
        Ok(false) => {}
        Err(e) => return Err(e.to_string()),
    }
    for job in group.iter_mut() {
        conn.execute("BEGIN").await.map_err(|e| e.to_string())?;
        let end = if job.run(conn).await {
            "COMMIT"
        } else {
            "ROLLBACK"
        };
        conn.execute(end).await.map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Runs `job` as its own transaction (each job's write is one statement). `Err`: it failed and
/// so did the connection (found out before the connection is kept).
async fn run_alone(conn: &mut PgConnection, job: &mut Box<dyn WriteJob>) -> Result<(), String> {
    if job.run(conn).await {
        return Ok(());
    }
    conn.ping().await.map_err(|e| e.to_string())
}

/// Runs the submissions `shared` of `group` (one per claim) as one [`SUBMIT_MANY`]; those that
/// found a live claim then run alone, to attach. `false` when a statement failed.
async fn submit_many(
    conn: &mut PgConnection,
    group: &mut [Box<dyn WriteJob>],
    shared: &[usize],
) -> bool {
    let mut a = SubmitArrays::default();
    let mut origin = String::new();
    for &i in shared {
        let Some(job) = group[i].submission() else {
            return false;
        };
        a.add(job);
        if origin.is_empty() {
            origin.clone_from(&job.origin);
        }
    }
    let rows = sqlx::query(SUBMIT_MANY)
        .bind(&a.ids)
        .bind(&a.namespaces)
        .bind(&a.routes)
        .bind(&a.backends)
        .bind(&a.models)
        .bind(&a.streams)
        .bind(&a.bodies)
        .bind(&a.headers)
        .bind(&a.hashes)
        .bind(&a.kinds)
        .bind(&a.nows)
        .bind(&a.owners)
        .bind(&a.expires)
        .bind(&a.claim_keys)
        .bind(&a.claim_expires)
        .bind(&origin)
        .fetch_all(&mut *conn)
        .await;
    let Ok(rows) = rows else { return false };
    let mut created = std::collections::HashMap::with_capacity(rows.len());
    for row in &rows {
        let Ok(record) = record_from_row(row) else {
            return false;
        };
        created.insert(record.id, record);
    }
    for &i in shared {
        let Some(job) = group[i].submission() else {
            return false;
        };
        match created.remove(&job.new.id) {
            Some(record) => job.result = Some(Ok(Submitted::Created(Box::new(record)))),
            None => {
                if !group[i].run(conn).await {
                    return false;
                }
            }
        }
    }
    true
}

/// The arrays of [`SUBMIT_MANY`], one element per submission.
#[derive(Default)]
struct SubmitArrays {
    ids: Vec<Uuid>,
    namespaces: Vec<String>,
    routes: Vec<&'static str>,
    backends: Vec<String>,
    models: Vec<Option<String>>,
    streams: Vec<bool>,
    bodies: Vec<Vec<u8>>,
    headers: Vec<String>,
    hashes: Vec<Vec<u8>>,
    kinds: Vec<&'static str>,
    nows: Vec<Millis>,
    owners: Vec<Option<String>>,
    expires: Vec<Option<Millis>>,
    claim_keys: Vec<String>,
    claim_expires: Vec<Millis>,
}

impl SubmitArrays {
    fn add(&mut self, job: &SubmitJob) {
        let new = &job.new;
        self.ids.push(new.id);
        self.namespaces.push(new.namespace.clone());
        self.routes.push(new.route.name());
        self.backends.push(new.backend.clone());
        self.models
            .push(opt_text(new.model.as_deref()).map(Cow::into_owned));
        self.streams.push(new.stream);
        self.bodies.push(new.body.clone());
        self.headers.push(job.headers.clone());
        self.hashes.push(new.hash.to_vec());
        self.kinds.push(new.claim.as_str());
        self.nows.push(new.now);
        self.owners.push(job.owner.clone());
        self.expires.push(job.expires_at);
        self.claim_keys.push(new.claim_key.clone());
        self.claim_expires.push(new.claim_expires_at);
    }
}

/// Runs the successful outcomes `shared` of `group` as one [`FINISH_SUCCEEDED_MANY`] and
/// gives each its record (`None`: its lease was lost). `false` when the statement failed.
async fn finish_many(
    conn: &mut PgConnection,
    group: &mut [Box<dyn WriteJob>],
    shared: &[usize],
) -> bool {
    let mut a = FinishArrays::default();
    let mut origin = String::new();
    for &i in shared {
        let Some(job) = group[i].succeeded() else {
            return false;
        };
        if !a.add(job) {
            return false;
        }
        if origin.is_empty() {
            origin = job
                .changed
                .split(' ')
                .next()
                .unwrap_or_default()
                .to_string();
        }
    }
    let rows = sqlx::query(FINISH_SUCCEEDED_MANY)
        .bind(&a.ids)
        .bind(&a.owners)
        .bind(&a.statuses)
        .bind(&a.bodies)
        .bind(&a.upstream_request_ids)
        .bind(&a.nows)
        .bind(&a.tokens[0])
        .bind(&a.tokens[1])
        .bind(&a.tokens[2])
        .bind(&a.tokens[3])
        .bind(&a.tokens[4])
        .bind(&a.reported)
        .bind(&a.attempts)
        .bind(&a.response_ids)
        .bind(rules::end_data(Status::Succeeded, None))
        .bind(&origin)
        .bind(i64::try_from(IDS_PER_NOTIFY).unwrap_or(i64::MAX))
        .fetch_all(&mut *conn)
        .await;
    let Ok(rows) = rows else { return false };
    let mut records = std::collections::HashMap::with_capacity(rows.len());
    for row in &rows {
        let (Ok(owner), Ok(record)) = (row.try_get::<String, _>("f_owner"), record_from_row(row))
        else {
            return false;
        };
        records.insert((record.id, owner), record);
    }
    for &i in shared {
        if let Some(job) = group[i].succeeded() {
            let record = records.remove(&(job.lease.id, job.lease.owner.clone()));
            job.result = Some(Ok(record));
        }
    }
    true
}

/// The arrays of [`FINISH_SUCCEEDED_MANY`], one element per outcome.
#[derive(Default)]
struct FinishArrays {
    ids: Vec<Uuid>,
    owners: Vec<String>,
    statuses: Vec<i32>,
    bodies: Vec<Vec<u8>>,
    upstream_request_ids: Vec<Option<String>>,
    nows: Vec<i64>,
    tokens: [Vec<Option<i64>>; 5],
    reported: Vec<bool>,
    attempts: Vec<i32>,
    response_ids: Vec<Option<String>>,
}

impl FinishArrays {
    /// Adds `job`'s outcome; `false` when it is not a success or its attempt is out of range.
    fn add(&mut self, job: &FinishJob) -> bool {
        let Outcome::Succeeded {
            status,
            body,
            upstream_request_id,
            response_id,
            usage,
        } = &job.outcome
        else {
            return false;
        };
        let Ok(attempt) = attempt_number(job.lease.attempt) else {
            return false;
        };
        self.ids.push(job.lease.id);
        self.owners.push(job.lease.owner.clone());
        self.statuses.push(i32::from(*status));
        self.bodies.push(body.clone());
        self.upstream_request_ids
            .push(opt_text(upstream_request_id.as_deref()).map(Cow::into_owned));
        self.nows.push(job.now);
        for (column, value) in self.tokens.iter_mut().zip(tokens_of(usage.as_ref())) {
            column.push(value);
        }
        self.reported.push(usage.is_some());
        self.attempts.push(attempt);
        self.response_ids
            .push(response_id.as_deref().map(|r| text(r).into_owned()));
        true
    }
}

/// `BEGIN`, every job of `group`, `COMMIT`: `Ok(false)` when a job failed (then rolled back).
async fn in_one_transaction(
    conn: &mut PgConnection,
    group: &mut [Box<dyn WriteJob>],
) -> Result<bool, sqlx::Error> {
    conn.execute("BEGIN").await?;
    // Two or more successful outcomes share one statement, run where the first of them is in
    // the group's order.
    let shared: Vec<usize> = (0..group.len())
        .filter(|&i| group[i].succeeded().is_some())
        .collect();
    let shared = if shared.len() >= 2 {
        shared
    } else {
        Vec::new()
    };
    // So do two or more submissions, one per claim (a second one for a claim runs after them
    // and attaches).
    let mut claims = std::collections::HashSet::new();
    let submitted: Vec<usize> = (0..group.len())
        .filter(|&i| {
            group[i].submission().is_some_and(|job| {
                claims.insert((job.new.namespace.clone(), job.new.claim_key.clone()))
            })
        })
        .collect();
    let submitted = if submitted.len() >= 2 {
        submitted
    } else {
        Vec::new()
    };
    for i in 0..group.len() {
        let ok = if shared.first() == Some(&i) {
            finish_many(conn, group, &shared).await
        } else if submitted.first() == Some(&i) {
            submit_many(conn, group, &submitted).await
        } else if shared.contains(&i) || submitted.contains(&i) {
            true
        } else {
            group[i].run(conn).await
        };
        if !ok {
            conn.execute("ROLLBACK").await?;
            return Ok(false);
        }
    }
    conn.execute("COMMIT").await?;
    Ok(true)
}

fn corrupt(what: impl std::fmt::Display) -> StoreError {
    StoreError::corrupt(None, what)
}

/// `s` as PostgreSQL `TEXT` can hold it: NUL becomes U+FFFD (see the module notes).
fn text(s: &str) -> Cow<'_, str> {
    if s.contains('\0') {
        Cow::Owned(s.replace('\0', "\u{FFFD}"))
    } else {
        Cow::Borrowed(s)
    }
}

fn opt_text(s: Option<&str>) -> Option<Cow<'_, str>> {
    s.map(text)
}

fn count(n: i32, what: &str) -> Result<u32, StoreError> {
    u32::try_from(n).map_err(|_| corrupt(format!("{what} {n}")))
}

/// A token count column by name.
fn tokens(row: &PgRow, name: &str) -> Result<Option<u64>, StoreError> {
    Ok(row
        .try_get::<Option<i64>, _>(name)?
        .and_then(|v| u64::try_from(v).ok()))
}

/// Reads a [`RequestRecord`] from `row` by column name (checks in [`RawRecord::into_record`]).
fn record_from_row(row: &PgRow) -> Result<RequestRecord, StoreError> {
    RawRecord {
        id: row.try_get("id")?,
        namespace: row.try_get("namespace")?,
        route: row.try_get("route")?,
        backend: row.try_get("backend")?,
        model: row.try_get("model")?,
        stream: row.try_get("stream")?,
        body: row.try_get("body")?,
        headers: row.try_get("headers")?,
        claim_kind: row.try_get("claim_kind")?,
        status: row.try_get("status")?,
        attempts: i64::from(row.try_get::<i32, _>("attempts")?),
        recoveries: i64::from(row.try_get::<i32, _>("recoveries")?),
        next_retry_at: row.try_get("next_retry_at")?,
        error_type: row.try_get("error_type")?,
        error_message: row.try_get("error_message")?,
        error_status: row
            .try_get::<Option<i32>, _>("error_status")?
            .map(i64::from),
        response_status: row
            .try_get::<Option<i32>, _>("response_status")?
            .map(i64::from),
        response_body: row.try_get("response_body")?,
        upstream_request_id: row.try_get("upstream_request_id")?,
        last_seq: row.try_get("last_seq")?,
        reset_seq: row.try_get("reset_seq")?,
        created_at: row.try_get("created_at")?,
        updated_at: row.try_get("updated_at")?,
        finished_at: row.try_get("finished_at")?,
        attached: i64::from(row.try_get::<i32, _>("attached")?),
        replayed: i64::from(row.try_get::<i32, _>("replayed")?),
        log_reads: i64::from(row.try_get::<i32, _>("log_reads")?),
        usage: Usage {
            input_tokens: tokens(row, "usage_input_tokens")?,
            output_tokens: tokens(row, "usage_output_tokens")?,
            cached_input_tokens: tokens(row, "usage_cached_input_tokens")?,
            cache_write_tokens: tokens(row, "usage_cache_write_tokens")?,
            reasoning_tokens: tokens(row, "usage_reasoning_tokens")?,
        },
    }
    .into_record()
}

fn chunk_from_row(row: &PgRow) -> Result<Chunk, StoreError> {
    let kind: String = row.try_get("kind")?;
    Ok(Chunk {
        seq: row.try_get("seq")?,
        attempt: count(row.try_get("attempt")?, "chunk attempt")?,
        kind: ChunkKind::parse(&kind).ok_or_else(|| corrupt(format!("chunk kind {kind:?}")))?,
        event: row.try_get("event")?,
        data: row.try_get("data")?,
    })
}

fn attempt_number(attempt: u32) -> Result<i32, StoreError> {
    i32::try_from(attempt).map_err(|_| corrupt(format!("attempt {attempt}")))
}

/// [`Store::submit_and_lease`] on `conn`: `owner` and `expires_at` are the lease to take on a
/// request it creates, `headers` the request's headers as stored.
async fn submit_in(
    conn: &mut PgConnection,
    new: &NewRequest,
    headers: &str,
    owner: Option<&str>,
    expires_at: Option<Millis>,
    origin: &str,
) -> Result<Submitted, StoreError> {
    // A claim that is live when we look but gone when we read it (released by a failure,
    // pruned) sends us round again; each round is one statement.
    for _ in 0..SUBMIT_ROUNDS {
        // One statement, its own transaction: the claim and the request it points at
        // commit together. A request leased here is run by this node, so only a queued
        // one wakes other nodes' workers.
        let sql = if owner.is_some() {
            SUBMIT_LEASED
        } else {
            SUBMIT_QUEUED
        };
        let row = sqlx::query(sql)
            .bind(new.id)
            .bind(&new.namespace)
            .bind(new.route.name())
            .bind(&new.backend)
            .bind(opt_text(new.model.as_deref()))
            .bind(new.stream)
            .bind(&new.body)
            .bind(headers)
            .bind(&new.hash[..])
            .bind(new.claim.as_str())
            .bind(new.now)
            .bind(owner)
            .bind(expires_at)
            .bind(&new.claim_key)
            .bind(new.claim_expires_at)
            .bind(origin)
            .fetch_optional(&mut *conn)
            .await?;
        if let Some(row) = row {
            return Ok(Submitted::Created(Box::new(record_from_row(&row)?)));
        }
        // A live claim stood (a racer's uncommitted insert made the upsert wait for it to
        // commit). This fresh statement (READ COMMITTED: a fresh snapshot) sees it.
        let row = sqlx::query(
            "SELECT c.request_id AS claim_request_id, c.fingerprint AS claim_fingerprint, r.*
             FROM claims c LEFT JOIN requests r ON r.id = c.request_id
             WHERE c.namespace = $1 AND c.claim_key = $2",
        )
        .bind(&new.namespace)
        .bind(&new.claim_key)
        .fetch_optional(&mut *conn)
        .await?;
        let Some(row) = row else { continue };
        let existing: Uuid = row.try_get("claim_request_id")?;
        let fingerprint: Vec<u8> = row.try_get("claim_fingerprint")?;
        if fingerprint != new.hash {
            return Ok(Submitted::KeyMismatch { existing });
        }
        if row.try_get::<Option<Uuid>, _>("id")?.is_none() {
            return Err(StoreError::corrupt(
                Some(existing),
                "a live claim points at a missing request",
            ));
        }
        let record = record_from_row(&row)?;
        return Ok(Submitted::Attached(Box::new(record)));
    }
    Err(StoreError::Unavailable(format!(
        "the claim of request {} kept changing under {SUBMIT_ROUNDS} submissions",
        new.id
    )))
}

/// [`Store::finish_read`] on `conn`, `changed` the notification payload naming the request.
async fn finish_in(
    conn: &mut PgConnection,
    lease: &Lease,
    outcome: &Outcome,
    now: Millis,
    changed: &str,
) -> Result<Option<RequestRecord>, StoreError> {
    let id = lease.id;
    let attempt = attempt_number(lease.attempt)?;
    let row = match outcome {
        Outcome::Succeeded {
            status,
            body,
            upstream_request_id,
            usage,
            response_id,
        } => {
            let u = tokens_of(usage.as_ref());
            let end = rules::end_data(Status::Succeeded, None);
            sqlx::query(FINISH_SUCCEEDED)
                .bind(i32::from(*status))
                .bind(body)
                .bind(opt_text(upstream_request_id.as_deref()))
                .bind(now)
                .bind(id)
                .bind(&lease.owner)
                .bind(u[0])
                .bind(u[1])
                .bind(u[2])
                .bind(u[3])
                .bind(u[4])
                .bind(usage.is_some())
                .bind(attempt)
                .bind(response_id.as_deref().map(text))
                .bind(end)
                .bind(changed)
                .fetch_optional(&mut *conn)
                .await?
        }
        Outcome::Retry {
            next_retry_at,
            error,
        } => {
            sqlx::query(concat!(
                "WITH done AS (
                     UPDATE requests SET status = 'pending', next_retry_at = $1,
                         error_type = $2, error_message = $3, error_status = $4,
                         lease_owner = NULL, lease_expires_at = NULL, updated_at = $5
                     WHERE id = $6 AND lease_owner = $7 AND status = 'running'
                     RETURNING ",
                request_columns!(),
                ") SELECT ",
                request_columns!(),
                ", pg_notify('holdfast_changed', $8) FROM done"
            ))
            .bind(next_retry_at)
            .bind(error.kind.as_str())
            .bind(text(&error.message))
            .bind(error.status.map(i32::from))
            .bind(now)
            .bind(id)
            .bind(&lease.owner)
            .bind(changed)
            .fetch_optional(&mut *conn)
            .await?
        }
        Outcome::Failed {
            error,
            response,
            upstream_request_id,
            usage,
        } => {
            let u = tokens_of(usage.as_ref());
            // As stored: the end chunk carries the message the record will read back.
            let stored = ErrorInfo {
                message: text(&error.message).into_owned(),
                ..error.clone()
            };
            let end = rules::end_data(Status::Failed, Some(&stored));
            sqlx::query(FINISH_FAILED)
                .bind(error.kind.as_str())
                .bind(&stored.message)
                .bind(error.status.map(i32::from))
                .bind(response.as_ref().map(|(s, _)| i32::from(*s)))
                .bind(response.as_ref().map(|(_, b)| b.as_slice()))
                .bind(opt_text(upstream_request_id.as_deref()))
                .bind(now)
                .bind(id)
                .bind(&lease.owner)
                .bind(u[0])
                .bind(u[1])
                .bind(u[2])
                .bind(u[3])
                .bind(u[4])
                .bind(usage.is_some())
                .bind(attempt)
                .bind(end)
                .bind(failure_releases_claim(ClaimKind::BodyHash, error.kind))
                .bind(failure_releases_claim(ClaimKind::Key, error.kind))
                .bind(changed)
                .fetch_optional(&mut *conn)
                .await?
        }
    };
    row.as_ref().map(record_from_row).transpose()
}

/// Rounds of [`Store::submit_and_lease`] before it gives up on a claim that keeps changing.
const SUBMIT_ROUNDS: usize = 5;

/// `submit_and_lease` as one statement: the claim upsert (ID-7) and, when it won, the request
/// insert. Parameters: `$1` id, `$2` namespace, `$3` route, `$4` backend, `$5` model, `$6`
/// stream, `$7` body, `$8` headers, `$9` hash (also the claim's fingerprint), `$10` claim kind,
/// `$11` now, `$12` lease owner or NULL, `$13` lease expiry or NULL, `$14` claim key, `$15`
/// claim expiry, `$16` origin. No row: a live claim stood.
macro_rules! submit_sql {
    ($notify:literal) => {
        concat!(
            "WITH claimed AS (
                 INSERT INTO claims (namespace, claim_key, kind, request_id, fingerprint,
                     expires_at)
                 VALUES ($2, $14, $10, $1, $9, $15)
                 ON CONFLICT (namespace, claim_key) DO UPDATE SET
                     kind = EXCLUDED.kind, request_id = EXCLUDED.request_id,
                     fingerprint = EXCLUDED.fingerprint, expires_at = EXCLUDED.expires_at
                 WHERE claims.expires_at <= $11
                 RETURNING request_id),
             created AS (
                 INSERT INTO requests (id, namespace, route, backend, model, stream, body, headers,
                     hash, claim_kind, status, attempts, lease_owner, lease_expires_at,
                     next_retry_at, created_at, updated_at)
                 SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, $10,
                     CASE WHEN $12::text IS NULL THEN 'pending' ELSE 'running' END,
                     CASE WHEN $12::text IS NULL THEN 0 ELSE 1 END, $12, $13, $11, $11, $11
                 FROM claimed WHERE request_id = $1
                 RETURNING ",
            request_columns!(),
            ")
             SELECT ",
            request_columns!(),
            $notify,
            " FROM created"
        )
    };
}

/// [`submit_sql!`] for many submissions, one per claim, each element of the arrays one
/// submission (the parameters of [`submit_sql!`] in the same order, `$16` the origin). Each
/// claim's takeover is checked against its own submission's time. Returns the records it
/// created; a submission missing from them found a live claim.
const SUBMIT_MANY: &str = concat!(
    "WITH s AS (
         SELECT * FROM UNNEST($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[],
             $6::bool[], $7::bytea[], $8::text[], $9::bytea[], $10::text[], $11::bigint[],
             $12::text[], $13::bigint[], $14::text[], $15::bigint[]) WITH ORDINALITY
         AS s(s_id, s_namespace, s_route, s_backend, s_model, s_stream, s_body, s_headers,
             s_hash, s_kind, s_now, s_owner, s_expires, s_claim_key, s_claim_expires, s_ord)),
     claimed AS (
         INSERT INTO claims (namespace, claim_key, kind, request_id, fingerprint, expires_at)
         SELECT s_namespace, s_claim_key, s_kind, s_id, s_hash, s_claim_expires
         FROM s ORDER BY s_ord
         ON CONFLICT (namespace, claim_key) DO UPDATE SET
             kind = EXCLUDED.kind, request_id = EXCLUDED.request_id,
             fingerprint = EXCLUDED.fingerprint, expires_at = EXCLUDED.expires_at
         WHERE claims.expires_at <= (SELECT s_now FROM s
                                     WHERE s_namespace = EXCLUDED.namespace
                                         AND s_claim_key = EXCLUDED.claim_key)
         RETURNING request_id),
     created AS (
         INSERT INTO requests (id, namespace, route, backend, model, stream, body, headers,
             hash, claim_kind, status, attempts, lease_owner, lease_expires_at,
             next_retry_at, created_at, updated_at)
         SELECT s_id, s_namespace, s_route, s_backend, s_model, s_stream, s_body, s_headers,
             s_hash, s_kind, CASE WHEN s_owner IS NULL THEN 'pending' ELSE 'running' END,
             CASE WHEN s_owner IS NULL THEN 0 ELSE 1 END, s_owner, s_expires, s_now, s_now,
             s_now
         FROM s JOIN claimed ON claimed.request_id = s_id
         RETURNING ",
    request_columns!(),
    "),
     woken AS (
         SELECT pg_notify('holdfast_work', $16)
         FROM (SELECT 1 FROM created WHERE status = 'pending' LIMIT 1) AS due)
     SELECT ",
    request_columns!(),
    ", (SELECT count(*) FROM woken) AS notifications FROM created"
);

/// [`submit_sql!`] for a request leased at once: no other node needs waking (`$16` unused but
/// typed, so both variants bind the same parameters).
const SUBMIT_LEASED: &str = submit_sql!(", $16::text AS origin");
/// [`submit_sql!`] for a queued request: wakes other nodes' workers ([`WORK_CHANNEL`]) when it
/// commits.
const SUBMIT_QUEUED: &str = submit_sql!(", pg_notify('holdfast_work', $16)");

/// The attempt's usage row (when `$flag` says it reported usage; the five token placeholders
/// follow `$u0`), upserted from the `done` row of a finish (usage is reported cumulatively).
macro_rules! finish_usage_cte {
    ($flag:literal, $attempt:literal,
     $u0:literal, $u1:literal, $u2:literal, $u3:literal, $u4:literal) => {
        concat!(
            "used AS (
                 INSERT INTO attempt_usage (request_id, attempt, input_tokens, output_tokens,
                     cached_input_tokens, cache_write_tokens, reasoning_tokens)
                 SELECT id, ", $attempt, ", ", $u0, ", ", $u1, ", ", $u2, ", ", $u3, ", ", $u4,
            " FROM done WHERE ", $flag,
            " ON CONFLICT (request_id, attempt) DO UPDATE SET
                     input_tokens = EXCLUDED.input_tokens, output_tokens = EXCLUDED.output_tokens,
                     cached_input_tokens = EXCLUDED.cached_input_tokens,
                     cache_write_tokens = EXCLUDED.cache_write_tokens,
                     reasoning_tokens = EXCLUDED.reasoning_tokens)"
        )
    };
}

/// `finish_read` of [`Outcome::Succeeded`]: `$1` status, `$2` body, `$3` upstream request id,
/// `$4` now, `$5` id, `$6` owner, `$7`..`$11` usage, `$12` usage reported, `$13` attempt, `$14`
/// response id or NULL, `$15` end chunk data, `$16` changed payload. A success releases no
/// claim (ID-6).
const FINISH_SUCCEEDED: &str = concat!(
    "WITH done AS (
         UPDATE requests SET status = 'succeeded', response_status = $1,
             response_body = $2, upstream_request_id = $3, error_type = NULL,
             error_message = NULL, error_status = NULL, lease_owner = NULL,
             lease_expires_at = NULL, finished_at = $4, updated_at = $4,
             last_seq = last_seq + 1, ",
    usage_assignments!("$7", "$8", "$9", "$10", "$11"),
    " WHERE id = $5 AND lease_owner = $6 AND status = 'running'
         RETURNING ",
    request_columns!(),
    "), ",
    finish_usage_cte!("$12", "$13", "$7", "$8", "$9", "$10", "$11"),
    ",
     responded AS (
         INSERT INTO response_ids (response_id, namespace, request_id, attempt)
         SELECT $14, namespace, id, $13 FROM done WHERE $14::text IS NOT NULL
         ON CONFLICT (response_id) DO NOTHING),
     ended AS (
         INSERT INTO chunks (request_id, seq, attempt, kind, event, data)
         SELECT id, last_seq, attempts, 'end', NULL, $15 FROM done)
     SELECT ",
    request_columns!(),
    ", pg_notify('holdfast_changed', $16) FROM done"
);

/// [`FINISH_SUCCEEDED`] for many outcomes at once, each element of the arrays one outcome:
/// `$1` id, `$2` owner, `$3` status, `$4` body, `$5` upstream request id, `$6` now, `$7`..`$11`
/// usage, `$12` usage reported, `$13` attempt, `$14` response id; `$15` end chunk data, `$16`
/// origin, `$17` ids per notification. Returns the record of each request whose lease held,
/// with its `f_owner`.
const FINISH_SUCCEEDED_MANY: &str = concat!(
    "WITH f AS (
         SELECT * FROM UNNEST($1::uuid[], $2::text[], $3::int[], $4::bytea[], $5::text[],
             $6::bigint[], $7::bigint[], $8::bigint[], $9::bigint[], $10::bigint[],
             $11::bigint[], $12::bool[], $13::int[], $14::text[])
         AS f(f_id, f_owner, f_status, f_body, f_upstream, f_now, f_u0, f_u1, f_u2, f_u3,
             f_u4, f_reported, f_attempt, f_response_id)),
     done AS (
         UPDATE requests SET status = 'succeeded', response_status = f_status,
             response_body = f_body, upstream_request_id = f_upstream, error_type = NULL,
             error_message = NULL, error_status = NULL, lease_owner = NULL,
             lease_expires_at = NULL, finished_at = f_now, updated_at = f_now,
             last_seq = last_seq + 1, ",
    usage_assignments!("f_u0", "f_u1", "f_u2", "f_u3", "f_u4"),
    " FROM f WHERE id = f_id AND lease_owner = f_owner AND status = 'running'
         RETURNING ",
    request_columns!(),
    ", f_owner, f_reported, f_attempt, f_response_id, f_u0, f_u1, f_u2, f_u3, f_u4),
     used AS (
         INSERT INTO attempt_usage (request_id, attempt, input_tokens, output_tokens,
             cached_input_tokens, cache_write_tokens, reasoning_tokens)
         SELECT id, f_attempt, f_u0, f_u1, f_u2, f_u3, f_u4 FROM done WHERE f_reported
         ON CONFLICT (request_id, attempt) DO UPDATE SET
             input_tokens = EXCLUDED.input_tokens, output_tokens = EXCLUDED.output_tokens,
             cached_input_tokens = EXCLUDED.cached_input_tokens,
             cache_write_tokens = EXCLUDED.cache_write_tokens,
             reasoning_tokens = EXCLUDED.reasoning_tokens),
     responded AS (
         INSERT INTO response_ids (response_id, namespace, request_id, attempt)
         SELECT f_response_id, namespace, id, f_attempt FROM done
         WHERE f_response_id IS NOT NULL
         ON CONFLICT (response_id) DO NOTHING),
     ended AS (
         INSERT INTO chunks (request_id, seq, attempt, kind, event, data)
         SELECT id, last_seq, attempts, 'end', NULL, $15 FROM done),
     notified AS (
         SELECT pg_notify('holdfast_changed', $16 || ' ' || string_agg(id::text, ','))
         FROM (SELECT id, (row_number() OVER (ORDER BY id) - 1) / $17 AS part FROM done) AS p
         GROUP BY part)
     SELECT ",
    request_columns!(),
    ", f_owner, (SELECT count(*) FROM notified) AS notifications FROM done"
);

/// `finish_read` of [`Outcome::Failed`]: `$1` error type, `$2` message, `$3` error status,
/// `$4` response status, `$5` response body, `$6` upstream request id, `$7` now, `$8` id, `$9`
/// owner, `$10`..`$14` usage, `$15` usage reported, `$16` attempt, `$17` end chunk data,
/// `$18`/`$19` whether a `hash`/`key` claim is released ([`failure_releases_claim`]), `$20`
/// changed payload.
const FINISH_FAILED: &str = concat!(
    "WITH done AS (
         UPDATE requests SET status = 'failed', error_type = $1, error_message = $2,
             error_status = $3, response_status = $4, response_body = $5,
             upstream_request_id = $6, lease_owner = NULL, lease_expires_at = NULL,
             finished_at = $7, updated_at = $7, last_seq = last_seq + 1, ",
    usage_assignments!("$10", "$11", "$12", "$13", "$14"),
    " WHERE id = $8 AND lease_owner = $9 AND status = 'running'
         RETURNING ",
    request_columns!(),
    "), ",
    finish_usage_cte!("$15", "$16", "$10", "$11", "$12", "$13", "$14"),
    ",
     released AS (
         DELETE FROM claims WHERE request_id = $8
             AND EXISTS (SELECT 1 FROM done
                         WHERE CASE done.claim_kind WHEN 'key' THEN $19 ELSE $18 END)),
     ended AS (
         INSERT INTO chunks (request_id, seq, attempt, kind, event, data)
         SELECT id, last_seq, attempts, 'end', NULL, $17 FROM done)
     SELECT ",
    request_columns!(),
    ", pg_notify('holdfast_changed', $20) FROM done"
);

/// The arrays [`APPEND_CHUNKS`] takes: one group per attempt `(id, owner)` whose batches are
/// in the commit, and every chunk, usage report and response id naming its group.
#[derive(Default)]
struct AppendPlan {
    /// Per group: request id, lease owner, chunks in it, upstream request id to record, the
    /// seq its first chunk follows.
    ids: Vec<Uuid>,
    owners: Vec<String>,
    counts: Vec<i64>,
    upstream_request_ids: Vec<Option<String>>,
    afters: Vec<i64>,
    /// Per chunk: its group, its 1-based position in the group, attempt, event, data.
    chunk_groups: Vec<i32>,
    chunk_pos: Vec<i64>,
    chunk_attempts: Vec<i32>,
    events: Vec<Option<String>>,
    data: Vec<String>,
    /// Per group that reported usage (the last report of the commit wins).
    usage_groups: Vec<i32>,
    usage_attempts: Vec<i32>,
    usage_tokens: [Vec<Option<i64>>; 5],
    /// Per response id (the first of the commit wins).
    response_groups: Vec<i32>,
    response_attempts: Vec<i32>,
    response_ids: Vec<String>,
}

impl AppendPlan {
    /// Adds `batch` to its attempt's group (made on first sight) and returns the group, or
    /// `None` when the batch does not follow the group's last chunk (it is then left out: not
    /// written, answered as fenced). Batches must come sorted by (request id, owner).
    fn add(&mut self, batch: &ChunkBatch) -> Result<Option<usize>, StoreError> {
        let lease = &batch.lease;
        // Batches come sorted by (id, owner): an attempt's group, if any, is the last one.
        let last = self.ids.len().checked_sub(1);
        let group = match last.filter(|&g| self.ids[g] == lease.id && self.owners[g] == lease.owner)
        {
            Some(g) if self.afters[g] + self.counts[g] == batch.after => g,
            Some(_) => return Ok(None),
            None => {
                self.ids.push(lease.id);
                self.owners.push(lease.owner.clone());
                self.counts.push(0);
                self.upstream_request_ids.push(None);
                self.afters.push(batch.after);
                self.ids.len() - 1
            }
        };
        let tag = i32::try_from(group).map_err(corrupt)?;
        let attempt = attempt_number(lease.attempt)?;
        if let Some(id) = &batch.upstream_request_id {
            self.upstream_request_ids[group] = Some(text(id).into_owned());
        }
        for chunk in &batch.chunks {
            self.counts[group] += 1;
            self.chunk_groups.push(tag);
            self.chunk_pos.push(self.counts[group]);
            self.chunk_attempts.push(attempt);
            self.events
                .push(opt_text(chunk.event.as_deref()).map(Cow::into_owned));
            self.data.push(text(&chunk.data).into_owned());
        }
        if let Some(usage) = &batch.usage {
            let u = tokens_of(Some(usage));
            let at = match self.usage_groups.iter().position(|&g| g == tag) {
                Some(at) => at,
                None => {
                    self.usage_groups.push(tag);
                    self.usage_attempts.push(attempt);
                    for column in &mut self.usage_tokens {
                        column.push(None);
                    }
                    self.usage_groups.len() - 1
                }
            };
            for (column, value) in self.usage_tokens.iter_mut().zip(u) {
                column[at] = value;
            }
        }
        if let Some(response_id) = &batch.response_id {
            let response_id = text(response_id).into_owned();
            if !self.response_ids.contains(&response_id) {
                self.response_groups.push(tag);
                self.response_attempts.push(attempt);
                self.response_ids.push(response_id);
            }
        }
        Ok(Some(group))
    }
}

/// Runs [`APPEND_CHUNKS`] for `plan` on `conn`: the groups stored, now or by an earlier try
/// (each at the seqs after its `after`).
async fn append_in(
    conn: &mut PgConnection,
    plan: &AppendPlan,
    origin: &str,
) -> Result<Vec<i32>, StoreError> {
    let rows = sqlx::query(APPEND_CHUNKS)
        .bind(&plan.ids)
        .bind(&plan.owners)
        .bind(&plan.counts)
        .bind(&plan.upstream_request_ids)
        .bind(&plan.chunk_groups)
        .bind(&plan.chunk_pos)
        .bind(&plan.chunk_attempts)
        .bind(&plan.events)
        .bind(&plan.data)
        .bind(&plan.usage_groups)
        .bind(&plan.usage_attempts)
        .bind(&plan.usage_tokens[0])
        .bind(&plan.usage_tokens[1])
        .bind(&plan.usage_tokens[2])
        .bind(&plan.usage_tokens[3])
        .bind(&plan.usage_tokens[4])
        .bind(&plan.response_groups)
        .bind(&plan.response_attempts)
        .bind(&plan.response_ids)
        .bind(origin)
        .bind(i64::try_from(IDS_PER_NOTIFY).unwrap_or(i64::MAX))
        .bind(&plan.afters)
        .fetch_all(&mut *conn)
        .await?;
    rows.iter().map(|row| Ok(row.try_get("grp")?)).collect()
}

/// `append_chunks` as one statement over [`AppendPlan`]'s arrays. Each group's `UPDATE` is
/// fenced on its lease (LC-3) and on the seq it follows (`$22`), and reserves its seqs;
/// chunks, usage and response ids are written only for the groups it matched; one
/// notification per [`IDS_PER_NOTIFY`] requests names them (`$20` origin, `$21` ids per
/// notification). A group the fence left out whose request is already `n` seqs past `after`
/// under the same lease was stored by an earlier try whose answer was lost (`stored`). Returns
/// `grp` of each group written now or before. The groups are given in
/// request-id order, which the plan's join follows, so concurrent appends lock rows in one
/// order.
const APPEND_CHUNKS: &str = "WITH b AS (
         SELECT (g.ord - 1)::int AS grp, g.id, g.owner, g.n, g.upstream_request_id, g.after
         FROM UNNEST($1::uuid[], $2::text[], $3::bigint[], $4::text[], $22::bigint[])
             WITH ORDINALITY AS g(id, owner, n, upstream_request_id, after, ord)),
     upd AS (
         UPDATE requests r SET last_seq = r.last_seq + b.n,
             upstream_request_id = COALESCE(b.upstream_request_id, r.upstream_request_id)
         FROM b
         WHERE r.id = b.id AND r.lease_owner = b.owner AND r.status = 'running'
             AND r.last_seq = b.after
         RETURNING b.grp, r.id, r.namespace, r.last_seq, b.n),
     stored AS (
         SELECT b.grp FROM b JOIN requests r ON r.id = b.id
         WHERE r.lease_owner = b.owner AND r.status = 'running' AND b.n > 0
             AND r.last_seq = b.after + b.n),
     ins AS (
         INSERT INTO chunks (request_id, seq, attempt, kind, event, data)
         SELECT upd.id, upd.last_seq - upd.n + c.pos, c.attempt, 'data', c.event, c.data
         FROM UNNEST($5::int[], $6::bigint[], $7::int[], $8::text[], $9::text[])
             AS c(grp, pos, attempt, event, data)
         JOIN upd ON upd.grp = c.grp),
     used AS (
         INSERT INTO attempt_usage (request_id, attempt, input_tokens, output_tokens,
             cached_input_tokens, cache_write_tokens, reasoning_tokens)
         SELECT upd.id, u.attempt, u.i, u.o, u.ci, u.cw, u.r
         FROM UNNEST($10::int[], $11::int[], $12::bigint[], $13::bigint[], $14::bigint[],
                     $15::bigint[], $16::bigint[]) AS u(grp, attempt, i, o, ci, cw, r)
         JOIN upd ON upd.grp = u.grp
         ON CONFLICT (request_id, attempt) DO UPDATE SET
             input_tokens = EXCLUDED.input_tokens, output_tokens = EXCLUDED.output_tokens,
             cached_input_tokens = EXCLUDED.cached_input_tokens,
             cache_write_tokens = EXCLUDED.cache_write_tokens,
             reasoning_tokens = EXCLUDED.reasoning_tokens),
     responded AS (
         INSERT INTO response_ids (response_id, namespace, request_id, attempt)
         SELECT x.response_id, upd.namespace, upd.id, x.attempt
         FROM UNNEST($17::int[], $18::int[], $19::text[]) AS x(grp, attempt, response_id)
         JOIN upd ON upd.grp = x.grp
         ON CONFLICT (response_id) DO NOTHING),
     notified AS (
         SELECT pg_notify('holdfast_changed', $20 || ' ' || string_agg(id::text, ','))
         FROM (SELECT id, (row_number() OVER (ORDER BY id) - 1) / $21 AS part FROM upd) AS p
         GROUP BY part)
     SELECT grp, (SELECT count(*) FROM notified) AS notifications FROM upd
     UNION ALL SELECT grp, 0 FROM stored";

/// Fails request `id`, whose last attempt was abandoned (its lease expired, or it was handed
/// back at shutdown), with `error`: the lease cleared, the current attempt's usage copied, its
/// `end` chunk. The caller holds the row's lock, and releases its claims
/// ([`release_claims_in_order`]) when this answers `true` ([`rules::settle`]).
async fn fail_abandoned_in(
    tx: &mut Transaction<'_, Postgres>,
    id: Uuid,
    claim: ClaimKind,
    attempts: i32,
    error: &ErrorInfo,
    now: Millis,
) -> Result<bool, StoreError> {
    sqlx::query(concat!(
        "UPDATE requests SET status = 'failed', error_type = $2, error_message = $3,
             error_status = NULL, lease_owner = NULL, lease_expires_at = NULL,
             finished_at = $1, updated_at = $1, ",
        usage_from_current_attempt!(),
        " WHERE id = $4"
    ))
    .bind(now)
    .bind(error.kind.as_str())
    .bind(text(&error.message))
    .bind(id)
    .execute(&mut **tx)
    .await?;
    let mut settle = rules::settle(Status::Failed, Some(error), claim);
    let release = std::mem::take(&mut settle.release_claim);
    settle_in(tx, id, attempts, &settle, None).await?;
    Ok(release)
}

/// Deletes the claims of requests `ids`, locking them first in the global claim order:
/// namespace and key in byte order (`COLLATE "C"`, Rust's `String` order, as the writer's
/// [`LockKey`] sorts submissions). A claim taken over meanwhile no longer names its request
/// and is left alone.
async fn release_claims_in_order(
    tx: &mut Transaction<'_, Postgres>,
    ids: &[Uuid],
) -> Result<(), StoreError> {
    if ids.is_empty() {
        return Ok(());
    }
    sqlx::query(
        "WITH locked AS MATERIALIZED (
             SELECT namespace, claim_key FROM claims WHERE request_id = ANY($1)
             ORDER BY namespace COLLATE \"C\", claim_key COLLATE \"C\"
             FOR UPDATE)
         DELETE FROM claims c USING locked l
         WHERE c.namespace = l.namespace AND c.claim_key = l.claim_key
           AND c.request_id = ANY($1)",
    )
    .bind(ids)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// The rest of a write that made request `id` terminal ([`rules::settle`]): its claims released
/// if the rule says so, and its `end` chunk — at `end_seq` when the seq is already reserved,
/// else after the last seq.
async fn settle_in(
    tx: &mut Transaction<'_, Postgres>,
    id: Uuid,
    attempt: i32,
    settle: &Settle,
    end_seq: Option<i64>,
) -> Result<(), StoreError> {
    if settle.release_claim {
        release_claims_in_order(tx, &[id]).await?;
    }
    match end_seq {
        Some(seq) => {
            sqlx::query(
                "INSERT INTO chunks (request_id, seq, attempt, kind, event, data)
                 VALUES ($1, $2, $3, 'end', NULL, $4)",
            )
            .bind(id)
            .bind(seq)
            .bind(attempt)
            .bind(text(&settle.end))
            .execute(&mut **tx)
            .await?;
        }
        None => {
            append_control(tx, id, attempt, ChunkKind::End, &settle.end).await?;
        }
    }
    Ok(())
}

/// A usage row's five token columns from `at` on.
fn usage_from_row(row: &PgRow, at: usize) -> Result<Usage, StoreError> {
    let n = |i: usize| -> Result<Option<u64>, StoreError> {
        Ok(row
            .try_get::<Option<i64>, _>(at + i)?
            .and_then(|v| u64::try_from(v).ok()))
    };
    Ok(Usage {
        input_tokens: n(0)?,
        output_tokens: n(1)?,
        cached_input_tokens: n(2)?,
        cache_write_tokens: n(3)?,
        reasoning_tokens: n(4)?,
    })
}

/// `Store::usage`'s statement around its group key (as the SQLite adapter's; sums are cast to
/// BIGINT, since PostgreSQL sums BIGINT as NUMERIC).
const USAGE_SQL_TAIL: &str = " AS key, r.backend, r.model,
        COUNT(*)::bigint, SUM(r.attempts)::bigint, SUM(1 + r.attached + r.replayed)::bigint,
        SUM(r.attached)::bigint, SUM(r.replayed)::bigint, SUM(r.saved)::bigint,
        SUM(u.input_tokens)::bigint, SUM(u.output_tokens)::bigint,
        SUM(u.cached_input_tokens)::bigint, SUM(u.cache_write_tokens)::bigint,
        SUM(u.reasoning_tokens)::bigint,
        SUM(r.saved * a.input_tokens)::bigint, SUM(r.saved * a.output_tokens)::bigint,
        SUM(r.saved * a.cached_input_tokens)::bigint,
        SUM(r.saved * a.cache_write_tokens)::bigint, SUM(r.saved * a.reasoning_tokens)::bigint
    FROM (SELECT *, GREATEST(1 + attached + replayed - GREATEST(attempts, 1), 0) AS saved
          FROM requests) r
    LEFT JOIN (SELECT request_id, SUM(input_tokens) AS input_tokens,
                   SUM(output_tokens) AS output_tokens,
                   SUM(cached_input_tokens) AS cached_input_tokens,
                   SUM(cache_write_tokens) AS cache_write_tokens,
                   SUM(reasoning_tokens) AS reasoning_tokens
               FROM attempt_usage GROUP BY request_id) u ON u.request_id = r.id
    LEFT JOIN attempt_usage a ON a.request_id = r.id AND a.attempt = r.attempts
    WHERE ($1::text IS NULL OR r.namespace = $1) AND r.created_at >= $2 AND r.created_at < $3
    GROUP BY 1, r.backend, r.model
    ORDER BY 1, r.backend, r.model";

/// `claim_kind` of request `id` as stored.
fn claim_of(id: Uuid, s: &str) -> Result<ClaimKind, StoreError> {
    ClaimKind::parse(s).ok_or_else(|| StoreError::corrupt(Some(id), format!("claim_kind {s:?}")))
}

/// Appends one control chunk (`reset` or `end`) after the request's last seq; a `reset` also
/// moves `reset_seq` (LC-8, RD-5, RD-6). One statement; the `UPDATE` locks the request row, so
/// concurrent appends to one request serialise on it. Returns the chunk's seq.
async fn append_control(
    tx: &mut Transaction<'_, Postgres>,
    id: Uuid,
    attempt: i32,
    kind: ChunkKind,
    data: &str,
) -> Result<i64, StoreError> {
    let seq: i64 = sqlx::query_scalar(
        "WITH bumped AS (
             UPDATE requests SET last_seq = last_seq + 1,
                 reset_seq = CASE WHEN $2 = 'reset' THEN last_seq + 1 ELSE reset_seq END
             WHERE id = $1
             RETURNING last_seq)
         INSERT INTO chunks (request_id, seq, attempt, kind, event, data)
         SELECT $1, last_seq, $3, $2, NULL, $4 FROM bumped
         RETURNING seq",
    )
    .bind(id)
    .bind(kind.as_str())
    .bind(attempt)
    .bind(text(data))
    .fetch_optional(&mut **tx)
    .await?
    .ok_or_else(|| corrupt(format!("control chunk for missing request {id}")))?;
    Ok(seq)
}

#[async_trait]
impl Store for PostgresStore {
    async fn listen(
        &self,
        notifications: mpsc::UnboundedSender<Notification>,
        shutdown: CancellationToken,
    ) {
        loop {
            let session = tokio::select! {
                () = shutdown.cancelled() => return,
                session = self.listen_session(&notifications, &shutdown) => session,
            };
            match session {
                Ok(()) => return,
                Err(e) => warn!(
                    error = %e,
                    "LISTEN for cross-node wake-ups failed; retrying (polling covers the gap)"
                ),
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(LISTEN_RETRY) => {}
            }
        }
    }

    async fn submit_and_lease(
        &self,
        new: NewRequest,
        lease: Option<LeaseTo<'_>>,
    ) -> Result<(Submitted, Option<Lease>), StoreError> {
        let headers = serde_json::to_string(&new.headers).map_err(corrupt)?;
        let (owner, expires_at) = match lease {
            Some(LeaseTo { owner, lease_ms }) => {
                (Some(owner.to_string()), Some(new.now + lease_ms))
            }
            None => (None, None),
        };
        let (reply, answer) = oneshot::channel();
        let job = SubmitJob {
            key: LockKey::Claim(new.namespace.clone(), new.claim_key.clone()),
            new,
            headers,
            owner,
            expires_at,
            origin: self.origin.clone(),
            result: None,
            reply,
        };
        self.writes
            .send(Box::new(job))
            .map_err(|_| StoreError::Unavailable("the PostgreSQL writer has stopped".into()))?;
        let submitted = answer.await.map_err(|_| {
            StoreError::Unavailable("the PostgreSQL writer stopped before answering".into())
        })??;
        let lease = match (&submitted, lease) {
            (Submitted::Created(record), Some(lease)) => Some(Lease {
                id: record.id,
                owner: lease.owner.to_string(),
                attempt: record.attempts,
            }),
            _ => None,
        };
        Ok((submitted, lease))
    }

    async fn get(&self, namespace: &str, id: Uuid) -> Result<Option<RequestRecord>, StoreError> {
        let row = sqlx::query(concat!(
            "SELECT ",
            request_columns!(),
            " FROM requests WHERE id = $1 AND namespace = $2"
        ))
        .bind(id)
        .bind(namespace)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(record_from_row).transpose()
    }

    async fn lease(
        &self,
        owner: &str,
        now: Millis,
        lease_ms: i64,
    ) -> Result<Option<(Lease, RequestRecord)>, StoreError> {
        // One statement (LC-2). SKIP LOCKED: a row another leaser is taking is passed over, and
        // a row that stopped being due after our snapshot is re-checked and skipped.
        let row = sqlx::query(concat!(
            "UPDATE requests SET status = 'running', attempts = attempts + 1,
                 lease_owner = $1, lease_expires_at = $2, updated_at = $3
             WHERE id = (SELECT id FROM requests
                         WHERE status = 'pending' AND next_retry_at <= $3
                         ORDER BY next_retry_at, id LIMIT 1
                         FOR UPDATE SKIP LOCKED)
             RETURNING ",
            request_columns!()
        ))
        .bind(owner)
        .bind(now + lease_ms)
        .bind(now)
        .fetch_optional(&self.pool)
        .await?;
        let Some(row) = row else { return Ok(None) };
        let record = record_from_row(&row)?;
        let lease = Lease {
            id: record.id,
            owner: owner.to_string(),
            attempt: record.attempts,
        };
        Ok(Some((lease, record)))
    }

    async fn lease_many(
        &self,
        owner_prefix: &str,
        now: Millis,
        lease_ms: i64,
        limit: usize,
    ) -> Result<Vec<(Lease, RequestRecord)>, StoreError> {
        // One statement for up to `limit` rows (LC-2): SKIP LOCKED as in `lease`, each row's
        // owner made unique by its id. The candidates are picked once, in a materialized CTE:
        // an `IN (subquery)` the planner turns into a semi-join may run the subquery again per
        // row, and with SKIP LOCKED each run picks other rows, leasing more than `limit` — more
        // than there are workers to run them.
        let rows = sqlx::query(concat!(
            "WITH picked AS MATERIALIZED (
                 SELECT id AS picked_id FROM requests
                 WHERE status = 'pending' AND next_retry_at <= $3
                 ORDER BY next_retry_at, id LIMIT $4
                 FOR UPDATE SKIP LOCKED)
             UPDATE requests SET status = 'running', attempts = attempts + 1,
                 lease_owner = $1 || '/' || id::text, lease_expires_at = $2, updated_at = $3
             FROM picked WHERE id = picked_id
             RETURNING lease_owner, ",
            request_columns!()
        ))
        .bind(owner_prefix)
        .bind(now + lease_ms)
        .bind(now)
        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
        .fetch_all(&self.pool)
        .await?;
        let mut leased = rows
            .iter()
            .map(|row| {
                let record = record_from_row(row)?;
                let lease = Lease {
                    id: record.id,
                    owner: row.try_get("lease_owner")?,
                    attempt: record.attempts,
                };
                Ok((lease, record))
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        // RETURNING has no order; run the oldest first.
        leased.sort_by_key(|(_, r)| (r.next_retry_at, r.id));
        Ok(leased)
    }

    async fn heartbeat(
        &self,
        lease: &Lease,
        now: Millis,
        lease_ms: i64,
    ) -> Result<bool, StoreError> {
        let (id, owner) = (lease.id, lease.owner.clone());
        self.write(LockKey::Request(id), move |conn| {
            let owner = owner.clone();
            Box::pin(async move {
                let done = sqlx::query(
                    "UPDATE requests SET lease_expires_at = $1
                     WHERE id = $2 AND lease_owner = $3 AND status = 'running'",
                )
                .bind(now + lease_ms)
                .bind(id)
                .bind(owner)
                .execute(&mut *conn)
                .await?;
                Ok(done.rows_affected() == 1)
            })
        })
        .await
    }

    // One statement, so one transaction and one round trip: the `UPDATE ... RETURNING`,
    // fenced on the lease (LC-3), reserves the `end` chunk's seq (RD-5); the rest of the
    // settlement ([`rules::settle`]) and the wake-up hang off its row, so nothing happens when
    // the lease was lost, and what it returns is the final record.
    async fn finish_read(
        &self,
        lease: &Lease,
        outcome: &Outcome,
        now: Millis,
    ) -> Result<Option<RequestRecord>, StoreError> {
        let changed = format!("{} {}", self.origin, lease.id);
        if matches!(outcome, Outcome::Succeeded { .. }) {
            let (reply, answer) = oneshot::channel();
            let job = FinishJob {
                key: LockKey::Request(lease.id),
                lease: lease.clone(),
                outcome: outcome.clone(),
                now,
                changed,
                result: None,
                reply,
            };
            self.writes
                .send(Box::new(job))
                .map_err(|_| StoreError::Unavailable("the PostgreSQL writer has stopped".into()))?;
            return answer.await.map_err(|_| {
                StoreError::Unavailable("the PostgreSQL writer stopped before answering".into())
            })?;
        }
        let args = Arc::new((lease.clone(), outcome.clone(), changed));
        self.write(LockKey::outcome(lease.id, outcome), move |conn| {
            let args = Arc::clone(&args);
            Box::pin(async move {
                let (lease, outcome, changed) = &*args;
                finish_in(conn, lease, outcome, now, changed).await
            })
        })
        .await
    }

    async fn sweep(&self, now: Millis, max_attempts: u32) -> Result<Swept, StoreError> {
        let mut tx = self.pool.begin().await?;
        // SKIP LOCKED: a request another sweeper (or a heartbeat, finish, cancel) holds is left
        // to it; whatever we lock is ours alone until commit, so each expired lease is handled
        // by exactly one sweeper (DU-3). Each gets the verdict of `rules::expired`.
        let expired: Vec<(Uuid, String, i32, i64, i64)> = sqlx::query_as(
            "SELECT id, claim_kind, attempts, last_seq, reset_seq FROM requests
             WHERE status = 'running' AND lease_expires_at < $1
             ORDER BY id
             FOR UPDATE SKIP LOCKED",
        )
        .bind(now)
        .fetch_all(&mut *tx)
        .await?;
        let mut swept = Swept::default();
        // Claims last, all at once in the global order, after every request row (issue 28).
        let mut releasing = Vec::new();
        for (id, claim, attempts, last_seq, reset_seq) in expired {
            let claim = claim_of(id, &claim)?;
            let count = u32::try_from(attempts)
                .map_err(|_| StoreError::corrupt(Some(id), format!("attempts {attempts}")))?;
            match rules::expired(count, max_attempts, last_seq, reset_seq) {
                Expired::Fail(error) => {
                    if fail_abandoned_in(&mut tx, id, claim, attempts, &error, now).await? {
                        releasing.push(id);
                    }
                    swept.failed.push(id);
                }
                Expired::Recover { reset } => {
                    sqlx::query(
                        "UPDATE requests SET status = 'pending', recoveries = recoveries + 1,
                             next_retry_at = $1, lease_owner = NULL, lease_expires_at = NULL,
                             updated_at = $1
                         WHERE id = $2",
                    )
                    .bind(now)
                    .bind(id)
                    .execute(&mut *tx)
                    .await?;
                    if let Some((attempt, data)) = reset {
                        let attempt = attempt_number(attempt)?;
                        append_control(&mut tx, id, attempt, ChunkKind::Reset, &data).await?;
                    }
                    swept.recovered.push(id);
                }
            }
        }
        release_claims_in_order(&mut tx, &releasing).await?;
        let changed: Vec<Uuid> = swept
            .failed
            .iter()
            .chain(&swept.recovered)
            .copied()
            .collect();
        self.notify_changed(&mut tx, &changed).await?;
        if !swept.recovered.is_empty() {
            self.notify_work(&mut tx).await?;
        }
        tx.commit().await?;
        Ok(swept)
    }

    async fn append_chunks(
        &self,
        batches: &[ChunkBatch],
    ) -> Result<Vec<Option<Vec<Chunk>>>, StoreError> {
        // One statement for every batch, however many (group commit): the batches of one
        // attempt are merged into one seq reservation, so the `UPDATE` touches each request
        // once; everything travels as arrays.
        // Groups in (request id, owner) order (stable, so one attempt's batches keep theirs):
        // the `UPDATE` then locks rows in id order, and two group commits touching the same
        // requests cannot deadlock.
        let mut order: Vec<usize> = (0..batches.len()).collect();
        order.sort_by(|&a, &b| {
            let (a, b) = (&batches[a].lease, &batches[b].lease);
            (a.id, &a.owner).cmp(&(b.id, &b.owner))
        });
        let mut plan = AppendPlan::default();
        let mut group_of: Vec<Option<usize>> = Vec::with_capacity(batches.len());
        for &i in &order {
            group_of.push(plan.add(&batches[i])?);
        }
        // Its own transaction, apart from the writers': it locks many requests (in id order).
        let stored = self.append_held(&plan).await?;
        // Each batch's first seq, for the groups stored: its group's first (right after the
        // seq the group follows), plus the batches of it before this one.
        let mut next: Vec<Option<i64>> = vec![None; plan.ids.len()];
        for group in stored {
            let group = usize::try_from(group).map_err(corrupt)?;
            *next
                .get_mut(group)
                .ok_or_else(|| corrupt(format!("append group {group}")))? =
                Some(plan.afters[group] + 1);
        }
        let mut results: Vec<Option<Vec<Chunk>>> = vec![None; batches.len()];
        let mut data = plan.data.into_iter();
        let mut events = plan.events.into_iter();
        for (&i, group) in order.iter().zip(group_of) {
            let batch = &batches[i];
            // Left out of the plan: nothing of it is in the arrays.
            let Some(group) = group else { continue };
            let taken: Vec<(Option<String>, String)> = events
                .by_ref()
                .zip(data.by_ref())
                .take(batch.chunks.len())
                .collect();
            let Some(first) = next[group] else { continue };
            let n = i64::try_from(taken.len()).map_err(corrupt)?;
            next[group] = Some(first + n);
            let stored = taken
                .into_iter()
                .zip(first..)
                .map(|((event, data), seq)| Chunk {
                    seq,
                    attempt: batch.lease.attempt,
                    kind: ChunkKind::Data,
                    event,
                    data,
                })
                .collect();
            results[i] = Some(stored);
        }
        Ok(results)
    }

    async fn finish_with_chunks(
        &self,
        last: &ChunkBatch,
        outcome: &Outcome,
        now: Millis,
    ) -> Result<Option<(Vec<Chunk>, RequestRecord)>, StoreError> {
        let mut plan = AppendPlan::default();
        plan.add(last)?;
        let lease = last.lease.clone();
        let changed = format!("{} {}", self.origin, lease.id);
        let args = Arc::new((plan, lease, outcome.clone(), changed, self.origin.clone()));
        self.write(LockKey::outcome(last.lease.id, outcome), move |conn| {
            let args = Arc::clone(&args);
            Box::pin(async move {
                let (plan, lease, outcome, changed, origin) = &*args;
                if append_in(conn, plan, origin).await?.is_empty() {
                    return Ok(None);
                }
                // The same transaction holds the lease the append was fenced on; an error
                // rolls the chunks back with it.
                let record = finish_in(conn, lease, outcome, now, changed)
                    .await?
                    .ok_or_else(|| {
                        StoreError::corrupt(Some(lease.id), "the lease was lost inside one write")
                    })?;
                let first = plan.afters[0] + 1;
                let chunks = plan
                    .events
                    .iter()
                    .zip(&plan.data)
                    .zip(first..)
                    .map(|((event, data), seq)| Chunk {
                        seq,
                        attempt: lease.attempt,
                        kind: ChunkKind::Data,
                        event: event.clone(),
                        data: data.clone(),
                    })
                    .collect();
                Ok(Some((chunks, record)))
            })
        })
        .await
    }

    async fn chunks_after(
        &self,
        id: Uuid,
        after: i64,
        limit: i64,
    ) -> Result<Vec<Chunk>, StoreError> {
        let rows = sqlx::query(
            "SELECT seq, attempt, kind, event, data FROM chunks
             WHERE request_id = $1 AND seq > $2 ORDER BY seq LIMIT $3",
        )
        .bind(id)
        .bind(after)
        .bind(limit.max(0))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(chunk_from_row).collect()
    }

    async fn cancel(
        &self,
        namespace: &str,
        id: Uuid,
        now: Millis,
    ) -> Result<Option<RequestRecord>, StoreError> {
        let mut tx = self.pool.begin().await?;
        // A finish racing this waits for us (or we for it) on the row lock; the loser re-checks
        // its condition against the winner's row and changes nothing.
        let error = rules::cancelled();
        // The row is locked first, so the update's own snapshot (a statement's, under READ
        // COMMITTED) sees every chunk batch committed before the lock was granted: the usage it
        // copies from `attempt_usage` is the latest (an update that waited on the row lock would
        // re-check the row, but read `attempt_usage` as of before the wait).
        sqlx::query("SELECT 1 FROM requests WHERE id = $1 FOR UPDATE")
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?;
        let cancelled: Option<(String, i32)> = sqlx::query_as(concat!(
            "UPDATE requests SET status = 'failed', error_type = $5,
                 error_message = $1, error_status = NULL,
                 lease_owner = NULL, lease_expires_at = NULL, finished_at = $2, updated_at = $2, ",
            usage_from_current_attempt!(),
            " WHERE id = $3 AND namespace = $4 AND status IN ('pending', 'running')
             RETURNING claim_kind, attempts"
        ))
        .bind(text(&error.message))
        .bind(now)
        .bind(id)
        .bind(namespace)
        .bind(error.kind.as_str())
        .fetch_optional(&mut *tx)
        .await?;
        if let Some((claim, attempts)) = &cancelled {
            let settle = rules::settle(Status::Failed, Some(&error), claim_of(id, claim)?);
            settle_in(&mut tx, id, *attempts, &settle, None).await?;
            self.notify_changed(&mut tx, &[id]).await?;
        }
        let record = Self::fetch_in(&mut tx, id)
            .await?
            .filter(|r| r.namespace == namespace);
        tx.commit().await?;
        Ok(record)
    }

    async fn list(&self, filter: &ListFilter) -> Result<Vec<RequestRecord>, StoreError> {
        let rows = sqlx::query(concat!(
            "SELECT ",
            request_columns!(),
            " FROM requests
             WHERE ($1::text IS NULL OR namespace = $1) AND ($2::text IS NULL OR status = $2)
                 AND ($3::text IS NULL OR route = $3) AND ($4::text IS NULL OR model = $4)
                 AND ($5::text IS NULL OR backend = $5)
                 AND ($6::bigint IS NULL OR created_at >= $6)
                 AND ($7::bigint IS NULL OR created_at < $7)
                 AND ($8::text IS NULL OR position(convert_to($8, 'UTF8') IN body) > 0)
                 AND (NOT $9 OR attached + replayed > 0)
                 AND ($10::uuid IS NULL OR id < $10)
             ORDER BY id DESC LIMIT $11"
        ))
        .bind(&filter.namespace)
        .bind(filter.status.map(Status::as_str))
        .bind(filter.route.map(Route::name))
        .bind(&filter.model)
        .bind(&filter.backend)
        .bind(filter.since)
        .bind(filter.until)
        .bind(filter.text.as_deref().map(text))
        .bind(filter.replayed)
        .bind(filter.before)
        .bind(filter.limit.max(0))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(record_from_row).collect()
    }

    async fn get_any(&self, id: Uuid) -> Result<Option<RequestRecord>, StoreError> {
        let row = sqlx::query(concat!(
            "SELECT ",
            request_columns!(),
            " FROM requests WHERE id = $1"
        ))
        .bind(id)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(record_from_row).transpose()
    }

    async fn release(
        &self,
        lease: &Lease,
        now: Millis,
        max_attempts: u32,
    ) -> Result<bool, StoreError> {
        let mut tx = self.pool.begin().await?;
        // Fenced and locked first: the verdict needs `attempts`, and a failure copies the usage
        // committed before the lock (as `cancel` does).
        let held: Option<(String, i32, i64, i64)> = sqlx::query_as(
            "SELECT claim_kind, attempts, last_seq, reset_seq FROM requests
             WHERE id = $1 AND lease_owner = $2 AND status = 'running'
             FOR UPDATE",
        )
        .bind(lease.id)
        .bind(&lease.owner)
        .fetch_optional(&mut *tx)
        .await?;
        let Some((claim, attempts, last_seq, reset_seq)) = held else {
            tx.commit().await?;
            return Ok(false);
        };
        let claim = claim_of(lease.id, &claim)?;
        let count = u32::try_from(attempts).map_err(corrupt)?;
        let due = match rules::handed_back(count, max_attempts, last_seq, reset_seq) {
            Expired::Fail(error) => {
                if fail_abandoned_in(&mut tx, lease.id, claim, attempts, &error, now).await? {
                    release_claims_in_order(&mut tx, &[lease.id]).await?;
                }
                false
            }
            Expired::Recover { reset } => {
                sqlx::query(
                    "UPDATE requests SET status = 'pending', next_retry_at = $1,
                         lease_owner = NULL, lease_expires_at = NULL, updated_at = $1
                     WHERE id = $2",
                )
                .bind(now)
                .bind(lease.id)
                .execute(&mut *tx)
                .await?;
                if let Some((attempt, data)) = reset {
                    let attempt = attempt_number(attempt)?;
                    append_control(&mut tx, lease.id, attempt, ChunkKind::Reset, &data).await?;
                }
                true
            }
        };
        self.notify_changed(&mut tx, &[lease.id]).await?;
        if due {
            self.notify_work(&mut tx).await?;
        }
        tx.commit().await?;
        Ok(true)
    }

    async fn prune(&self, before: Millis, limit: i64) -> Result<u64, StoreError> {
        let mut tx = self.pool.begin().await?;
        // SKIP LOCKED: pruners on several nodes split the work instead of deleting one row twice.
        let ids: Vec<Uuid> = sqlx::query_scalar(
            "SELECT id FROM requests
             WHERE finished_at IS NOT NULL AND finished_at < $1
             ORDER BY finished_at LIMIT $2
             FOR UPDATE SKIP LOCKED",
        )
        .bind(before)
        .bind(limit.max(0))
        .fetch_all(&mut *tx)
        .await?;
        if ids.is_empty() {
            tx.commit().await?;
            return Ok(0);
        }
        sqlx::query("DELETE FROM chunks WHERE request_id = ANY($1)")
            .bind(&ids)
            .execute(&mut *tx)
            .await?;
        sqlx::query("DELETE FROM attempt_usage WHERE request_id = ANY($1)")
            .bind(&ids)
            .execute(&mut *tx)
            .await?;
        sqlx::query("DELETE FROM response_ids WHERE request_id = ANY($1)")
            .bind(&ids)
            .execute(&mut *tx)
            .await?;
        release_claims_in_order(&mut tx, &ids).await?;
        let deleted = sqlx::query("DELETE FROM requests WHERE id = ANY($1)")
            .bind(&ids)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        tx.commit().await?;
        Ok(deleted)
    }

    async fn find_response(&self, response_id: &str) -> Result<Option<ResponseRef>, StoreError> {
        let found: Option<(Uuid, String, i32)> = sqlx::query_as(
            "SELECT request_id, namespace, attempt FROM response_ids WHERE response_id = $1",
        )
        .bind(response_id)
        .fetch_optional(&self.pool)
        .await?;
        found
            .map(|(request_id, namespace, attempt)| {
                Ok(ResponseRef {
                    request_id,
                    namespace,
                    attempt: u32::try_from(attempt).map_err(|_| {
                        StoreError::corrupt(Some(request_id), format!("attempt {attempt}"))
                    })?,
                })
            })
            .transpose()
    }

    async fn attempt_usage(&self, id: Uuid) -> Result<Vec<(u32, Usage)>, StoreError> {
        let rows = sqlx::query(
            "SELECT attempt, input_tokens, output_tokens, cached_input_tokens,
                 cache_write_tokens, reasoning_tokens
             FROM attempt_usage WHERE request_id = $1 ORDER BY attempt",
        )
        .bind(id)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| {
                let attempt = count(row.try_get("attempt")?, "usage attempt")?;
                Ok((attempt, usage_from_row(row, 1)?))
            })
            .collect()
    }

    async fn add_counts(&self, counts: &[Counts]) -> Result<(), StoreError> {
        // On the query pool, autocommit: never queued behind or ahead of the writers' groups.
        // The rows are locked in id order (the CTE), as every other multi-row write does.
        let ids: Vec<Uuid> = counts.iter().map(|c| c.id).collect();
        let column = |f: fn(&Counts) -> u32| -> Vec<i32> {
            counts
                .iter()
                .map(|c| i32::try_from(f(c)).unwrap_or(i32::MAX))
                .collect()
        };
        sqlx::query(
            "WITH c AS (SELECT * FROM UNNEST($1::uuid[], $2::int[], $3::int[], $4::int[])
                          AS c(id, attached, replayed, log_reads)),
                  locked AS (SELECT r.id FROM requests r JOIN c ON c.id = r.id
                             ORDER BY r.id FOR UPDATE OF r)
             UPDATE requests r SET attached = r.attached + c.attached,
                 replayed = r.replayed + c.replayed, log_reads = r.log_reads + c.log_reads
             FROM c JOIN locked ON locked.id = c.id
             WHERE r.id = c.id",
        )
        .bind(&ids)
        .bind(column(|c| c.attached))
        .bind(column(|c| c.replayed))
        .bind(column(|c| c.log_reads))
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn usage(&self, query: &UsageQuery) -> Result<Vec<UsageRow>, StoreError> {
        let key = match query.group_by {
            UsageGroup::Model => "COALESCE(r.model, '')",
            UsageGroup::Backend => "r.backend",
            UsageGroup::Namespace => "r.namespace",
            UsageGroup::Day => {
                "to_char(to_timestamp(r.created_at / 1000.0) AT TIME ZONE 'UTC', 'YYYY-MM-DD')"
            }
        };
        let sql = format!("SELECT {key}{USAGE_SQL_TAIL}");
        let rows = sqlx::query(&sql)
            .bind(&query.namespace)
            .bind(query.since)
            .bind(query.until)
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|row| {
                let n = |i: usize| -> Result<u64, StoreError> {
                    Ok(u64::try_from(row.try_get::<Option<i64>, _>(i)?.unwrap_or(0)).unwrap_or(0))
                };
                Ok(UsageRow {
                    key: row.try_get(0)?,
                    backend: row.try_get(1)?,
                    model: row.try_get(2)?,
                    requests: n(3)?,
                    attempts: n(4)?,
                    deliveries: n(5)?,
                    attached: n(6)?,
                    replayed: n(7)?,
                    saved_calls: n(8)?,
                    usage: usage_from_row(row, 9)?,
                    saved: usage_from_row(row, 14)?,
                })
            })
            .collect()
    }

    async fn counts(&self) -> Result<Vec<(Status, i64)>, StoreError> {
        let rows: Vec<(String, i64)> =
            sqlx::query_as("SELECT status, COUNT(*) FROM requests GROUP BY status")
                .fetch_all(&self.pool)
                .await?;
        rows.into_iter()
            .map(|(s, n)| {
                Status::parse(&s)
                    .map(|s| (s, n))
                    .ok_or_else(|| corrupt(format!("status {s:?}")))
            })
            .collect()
    }

    async fn next_due(&self) -> Result<Option<Millis>, StoreError> {
        let due: Option<i64> =
            sqlx::query_scalar("SELECT MIN(next_retry_at) FROM requests WHERE status = 'pending'")
                .fetch_one(&self.pool)
                .await?;
        Ok(due)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }
}
