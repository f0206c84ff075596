//! The group-commit writer: its jobs and their lock order, the writer tasks, and the
//! statements a group's submissions and successful outcomes share.

use std::borrow::Cow;
use std::sync::Arc;

use futures::FutureExt;
use futures::future::BoxFuture;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnection, PgPool};
use sqlx::{Connection, Executor, Postgres, Row};
use tokio::sync::{mpsc, oneshot};
use tracing::warn;
use uuid::Uuid;

use super::sql::{
    FINISH_SUCCEEDED_MANY, SUBMIT_MANY, attempt_number, finish_in, opt_text, record_from_row,
    submit_in, text,
};
use super::{IDS_PER_NOTIFY, PostgresStore};
use crate::store::row::tokens_of;
use crate::store::rules;
use crate::store::{
    Lease, Millis, NewRequest, Outcome, RequestRecord, Status, StoreError, Submitted,
};

impl PostgresStore {
    /// Runs `work` as one job of the writer's next group commit and returns its result once
    /// that commit is durable (RS-1). `work` may run twice: a group whose transaction fails is
    /// run again job by job, so one failing write fails alone.
    pub(super) async fn write<T, F>(&self, key: LockKey, work: F) -> Result<T, StoreError>
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
}

/// Most jobs in one group commit: bounds a transaction's length (and the wait of the first job
/// in it), not its correctness.
const MAX_JOBS_PER_COMMIT: usize = 512;
/// Group-commit writers per process, each on a connection of its own: while one waits for its
/// commit the next group is already being written, and the server works on both at once.
pub(super) const WRITERS: u32 = 2;

/// What a job locks first, to order the jobs of a group in the adapter's one global lock order
/// (module notes): requests by id, then claims by namespace and key in byte order. A write that
/// locks a request and then its claims is committed alone, before the group's others, so no
/// group holds a claim while it waits for a request row; and no two transactions take the same
/// rows in opposite orders (issue 28).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum LockKey {
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
    pub(super) fn outcome(id: Uuid, outcome: &Outcome) -> LockKey {
        if matches!(outcome, Outcome::Failed { .. }) {
            LockKey::Releasing(id)
        } else {
            LockKey::Request(id)
        }
    }
}

/// One write of a group commit, type-erased for the writer's queue.
pub(super) trait WriteJob: Send {
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
pub(super) struct SubmitJob {
    pub(super) key: LockKey,
    pub(super) new: NewRequest,
    /// The headers as stored.
    pub(super) headers: String,
    /// The lease to take on a request it creates.
    pub(super) owner: Option<String>,
    pub(super) expires_at: Option<Millis>,
    pub(super) origin: String,
    pub(super) result: Option<Result<Submitted, StoreError>>,
    pub(super) reply: oneshot::Sender<Result<Submitted, StoreError>>,
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
pub(super) struct FinishJob {
    pub(super) key: LockKey,
    pub(super) lease: Lease,
    pub(super) outcome: Outcome,
    pub(super) now: Millis,
    /// The notification payload naming the request, for [`finish_in`].
    pub(super) changed: String,
    pub(super) result: Option<Result<Option<RequestRecord>, StoreError>>,
    pub(super) reply: oneshot::Sender<Result<Option<RequestRecord>, StoreError>>,
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
pub(super) async fn write_loop(
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
    // Writes that lock a request and then its claims run first (the sort puts them there),
    // each in a transaction of its own: inside a group they would hold a claim while the group
    // waits for request rows.
    let alone = group
        .iter()
        .take_while(|job| matches!(job.key(), LockKey::Releasing(_)))
        .count();
    let (releasing, group) = group.split_at_mut(alone);
    for job in releasing {
        run_in_own_transaction(conn, job).await?;
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
        run_in_own_transaction(conn, job).await?;
    }
    Ok(())
}

/// Runs `job` between a `BEGIN` and its `COMMIT` (`ROLLBACK` when it fails), so a job of
/// several statements is stored whole or not at all. `Err`: the connection failed.
async fn run_in_own_transaction(
    conn: &mut PgConnection,
    job: &mut Box<dyn WriteJob>,
) -> Result<(), String> {
    conn.execute("BEGIN").await.map_err(|e| e.to_string())?;
    let end = if job.run(conn).await {
        "COMMIT"
    } else {
        "ROLLBACK"
    };
    conn.execute(end).await.map_err(|e| e.to_string())?;
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
        .bind(&a.callbacks)
        .bind(&a.trace_parents)
        .bind(&a.replay_ofs)
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
    callbacks: Vec<Option<String>>,
    trace_parents: Vec<Option<String>>,
    replay_ofs: Vec<Option<Uuid>>,
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
        self.callbacks.push(new.callback_url.clone());
        self.trace_parents.push(new.trace_parent.clone());
        self.replay_ofs.push(new.replay_of);
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
        .bind(&a.tokens[5])
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
            let record = records.remove(&(job.lease.id, job.lease.owner.to_string()));
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
    tokens: [Vec<Option<i64>>; 6],
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
        self.owners.push(job.lease.owner.to_string());
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
