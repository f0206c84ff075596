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
//!   claims.expires_at <= now AND` its request has finished (ID-4, decision 71) `RETURNING`.
//!   A submission racing an uncommitted insert of the same
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
//!   releases the failed ones' claims last, sorted ([`expire_claims_in_order`], as prune and
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

mod callback;
mod connection;
mod lease;
#[cfg(test)]
mod plans;
mod sql;
mod writer;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::Row;
use sqlx::postgres::PgPool;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::warn;
use uuid::Uuid;

use self::connection::Held;
use self::sql::{
    AppendPlan, USAGE_SQL_TAIL, append_control, append_in, attempt_number, chunk_from_row,
    claim_of, corrupt, count, expire_claims_in_order, fail_abandoned_in, finish_in,
    record_from_row, release_claims_in_order, settle_in, text, usage_from_row,
};
use self::writer::{FinishJob, LockKey, SubmitJob, WriteJob};
use super::rules::{self, Expired};
use super::{
    AddedCounts, Callback, CallbackLease, CallbackOutcome, Chunk, ChunkBatch, ChunkKind, Counts,
    Lease, LeaseQuota, LeaseTo, ListFilter, Millis, NewRequest, Notification, Outcome,
    RequestRecord, ResponseRef, Status, Store, StoreError, Submitted, Swept, Usage, UsageGroup,
    UsageQuery, UsageRow,
};

pub(crate) use self::connection::{latest_schema, schema_version};

/// Connections per process unless [`PostgresStore::open_with`] says otherwise.
pub const DEFAULT_MAX_CONNECTIONS: u32 = 16;
/// How long a pool waits for a connection unless [`PostgresStore::open_with_limits`] says
/// otherwise (`database_timeout_ms`'s default).
pub const DEFAULT_ACQUIRE_TIMEOUT: Duration = Duration::from_millis(1_500);

/// How long a ping whose pool timed out tries one connection of its own to say why: with the
/// pool's 1.5 s, inside `/readyz`'s 2 s.
const PING_DIAGNOSIS: Duration = Duration::from_millis(400);

/// Channel of "these requests changed" notifications; payload `"<origin> <id>,<id>,..."`.
pub const CHANGED_CHANNEL: &str = "holdfast_changed";
/// Channel of "new work is due" notifications; payload `"<origin>"`.
pub const WORK_CHANNEL: &str = "holdfast_work";
/// Request ids per notification: 200 × 37 bytes plus the origin stays well under PostgreSQL's
/// 8000-byte payload limit.
pub const IDS_PER_NOTIFY: usize = 200;
/// Pause before the listener reconnects after a failure.
const LISTEN_RETRY: Duration = Duration::from_secs(1);

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

/// The condition of a read of one request of one namespace: `$1` its id, `$2` the namespace.
macro_rules! one_of_namespace {
    () => {
        " WHERE id = $1 AND namespace = $2"
    };
}

impl PostgresStore {
    /// Request `id` of `namespace` as `sql` reads it (a `SELECT` of the record's columns
    /// ending in [`one_of_namespace!`]).
    async fn record_of(
        &self,
        sql: &'static str,
        namespace: &str,
        id: Uuid,
    ) -> Result<Option<RequestRecord>, StoreError> {
        let row = sqlx::query(sql)
            .bind(id)
            .bind(namespace)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(record_from_row).transpose()
    }

    /// [`Store::finish_read`]: one statement, so one transaction and one round trip: the `UPDATE ... RETURNING`,
    /// fenced on the lease (LC-3), reserves the `end` chunk's seq (RD-5); the rest of the
    /// settlement ([`rules::settle`]) and the wake-up hang off its row, so nothing happens when
    /// the lease was lost, and what it returns is the final record.
    async fn finish_returning(
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
                owner: lease.owner.into(),
                attempt: record.attempts,
            }),
            _ => None,
        };
        Ok((submitted, lease))
    }

    async fn get(&self, namespace: &str, id: Uuid) -> Result<Option<RequestRecord>, StoreError> {
        let sql = concat!(
            "SELECT ",
            request_columns!(),
            " FROM requests",
            one_of_namespace!()
        );
        self.record_of(sql, namespace, id).await
    }

    async fn peek(&self, namespace: &str, id: Uuid) -> Result<Option<RequestRecord>, StoreError> {
        let sql = concat!(
            "SELECT ",
            peek_columns!("''::bytea"),
            " FROM requests",
            one_of_namespace!()
        );
        self.record_of(sql, namespace, id).await
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
            owner: owner.into(),
            attempt: record.attempts,
        };
        Ok(Some((lease, record)))
    }

    async fn lease_many(
        &self,
        owner_prefix: &str,
        now: Millis,
        lease_ms: i64,
        quota: &LeaseQuota,
    ) -> Result<Vec<(Lease, RequestRecord)>, StoreError> {
        self.lease_many_in(owner_prefix, now, lease_ms, quota).await
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
                .bind(&*owner)
                .execute(&mut *conn)
                .await?;
                Ok(done.rows_affected() == 1)
            })
        })
        .await
    }

    // Its `UPDATE ... RETURNING` returns the whole record: `leased` saves it nothing.
    async fn finish_read(
        &self,
        lease: &Lease,
        _leased: &RequestRecord,
        outcome: &Outcome,
        now: Millis,
    ) -> Result<Option<RequestRecord>, StoreError> {
        self.finish_returning(lease, outcome, now).await
    }

    async fn finish(
        &self,
        lease: &Lease,
        outcome: Outcome,
        now: Millis,
    ) -> Result<bool, StoreError> {
        Ok(self.finish_returning(lease, &outcome, now).await?.is_some())
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
        expire_claims_in_order(&mut tx, &releasing, now).await?;
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
            let taken: Vec<(Option<Arc<str>>, Arc<str>)> = events
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
        _leased: &RequestRecord,
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
                        data: Arc::clone(data),
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
            settle_in(&mut tx, id, *attempts, &settle, None, now).await?;
            self.notify_changed(&mut tx, &[id]).await?;
        }
        let record = Self::fetch_in(&mut tx, id)
            .await?
            .filter(|r| r.namespace == namespace);
        tx.commit().await?;
        Ok(record)
    }

    async fn list(&self, filter: &ListFilter) -> Result<Vec<RequestRecord>, StoreError> {
        // Only the filters given, each bound: a statement of `$n IS NULL OR ...` terms gets a
        // generic plan that cannot walk the id index from a cursor, and an export's pages then
        // sort the namespace's rows once per page (decision 62).
        let f = filter;
        let mut q = sqlx::QueryBuilder::<sqlx::Postgres>::new(concat!(
            "SELECT ",
            request_columns!(),
            " FROM requests WHERE TRUE"
        ));
        if let Some(namespace) = &f.namespace {
            q.push(" AND namespace = ").push_bind(namespace.clone());
        }
        if let Some(status) = f.status {
            q.push(" AND status = ").push_bind(status.as_str());
        }
        if let Some(route) = f.route {
            q.push(" AND route = ").push_bind(route.name());
        }
        if let Some(model) = &f.model {
            q.push(" AND model = ").push_bind(model.clone());
        }
        if let Some(backend) = &f.backend {
            q.push(" AND backend = ").push_bind(backend.clone());
        }
        if let Some(since) = f.since {
            q.push(" AND created_at >= ").push_bind(since);
        }
        if let Some(until) = f.until {
            q.push(" AND created_at < ").push_bind(until);
        }
        if let Some(t) = &f.text {
            q.push(" AND position(convert_to(")
                .push_bind(text(t).into_owned())
                .push(", 'UTF8') IN body) > 0");
        }
        if f.replayed {
            q.push(" AND attached + replayed > 0");
        }
        if let Some(before) = f.before {
            q.push(" AND id < ").push_bind(before);
        }
        if let Some(after) = f.after {
            q.push(" AND id > ").push_bind(after);
        }
        if let Some(replay_of) = f.replay_of {
            q.push(" AND replay_of = ").push_bind(replay_of);
        }
        if let Some(state) = f.callback {
            q.push(" AND id IN (SELECT request_id FROM callbacks WHERE state = ")
                .push_bind(state.as_str())
                .push(")");
        }
        // Two orders, so each walks the id index in its own direction (EX-1).
        q.push(if f.oldest_first {
            " ORDER BY id ASC LIMIT "
        } else {
            " ORDER BY id DESC LIMIT "
        })
        .push_bind(f.limit.max(0));
        let rows = q.build().fetch_all(&self.pool).await?;
        rows.iter().map(record_from_row).collect()
    }

    async fn data_chunks_of(
        &self,
        wanted: &[(Uuid, i64)],
    ) -> Result<Vec<(Uuid, Vec<Chunk>)>, StoreError> {
        // One statement for the page: a round trip per request would bound an export's rate
        // by the network's latency (decision 62).
        // `= ANY` walks the primary key per id whatever the statistics say; a join with the
        // ids as a set was planned as a scan of every chunk while the table was unanalysed.
        // Each request's `after` is applied here.
        let ids: Vec<Uuid> = wanted.iter().map(|(id, _)| *id).collect();
        let after: std::collections::HashMap<Uuid, i64> = wanted.iter().copied().collect();
        let rows = sqlx::query(
            "SELECT request_id, seq, attempt, kind, event, data FROM chunks
             WHERE request_id = ANY($1::uuid[]) AND kind = 'data'
             ORDER BY request_id, seq",
        )
        .bind(&ids)
        .fetch_all(&self.pool)
        .await?;
        let mut by_id: std::collections::HashMap<Uuid, Vec<Chunk>> =
            std::collections::HashMap::with_capacity(wanted.len());
        for row in &rows {
            let id: Uuid = row.try_get("request_id")?;
            let chunk = chunk_from_row(row)?;
            if chunk.seq > after.get(&id).copied().unwrap_or(0) {
                by_id.entry(id).or_default().push(chunk);
            }
        }
        Ok(wanted
            .iter()
            .map(|(id, _)| (*id, by_id.remove(id).unwrap_or_default()))
            .collect())
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
        .bind(&*lease.owner)
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
                    expire_claims_in_order(&mut tx, &[lease.id], now).await?;
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

    async fn release_unstarted(&self, lease: &Lease, now: Millis) -> Result<bool, StoreError> {
        let mut tx = self.pool.begin().await?;
        let changed = sqlx::query(
            "UPDATE requests SET status = 'pending', next_retry_at = $1, lease_owner = NULL,
                 lease_expires_at = NULL, attempts = attempts - 1, updated_at = $1
             WHERE id = $2 AND lease_owner = $3 AND status = 'running' AND attempts > 0",
        )
        .bind(now)
        .bind(lease.id)
        .bind(&*lease.owner)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if changed == 1 {
            self.notify_changed(&mut tx, &[lease.id]).await?;
            self.notify_work(&mut tx).await?;
        }
        tx.commit().await?;
        Ok(changed == 1)
    }

    async fn prune(
        &self,
        before: Millis,
        pending_callback_before: Millis,
        limit: i64,
    ) -> Result<u64, StoreError> {
        let mut tx = self.pool.begin().await?;
        // SKIP LOCKED: pruners on several nodes split the work instead of deleting one row twice.
        let ids: Vec<Uuid> = sqlx::query_scalar(
            "SELECT id FROM requests
             WHERE finished_at IS NOT NULL AND finished_at < $1
               AND (finished_at < $3 OR NOT EXISTS (SELECT 1 FROM callbacks
                    WHERE callbacks.request_id = requests.id AND callbacks.state = 'pending'))
             ORDER BY finished_at LIMIT $2
             FOR UPDATE SKIP LOCKED",
        )
        .bind(before)
        .bind(limit.max(0))
        .bind(pending_callback_before)
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
        sqlx::query("DELETE FROM callbacks WHERE request_id = ANY($1)")
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
                 cache_write_tokens, reasoning_tokens, cache_write_1h_tokens
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

    async fn add_counts(&self, counts: &[Counts]) -> Result<AddedCounts, StoreError> {
        // On the query pool, autocommit: never queued behind or ahead of the writers' groups.
        // Rows another write holds are skipped, not waited for (so counting can neither delay
        // nor deadlock with real work) and reported back, unless the request is gone.
        let ids: Vec<Uuid> = counts.iter().map(|c| c.id).collect();
        let column = |f: fn(&Counts) -> u32| -> Vec<i32> {
            counts
                .iter()
                .map(|c| i32::try_from(f(c)).unwrap_or(i32::MAX))
                .collect()
        };
        // Each row answered is busy (`before` NULL), or finished before its attachments were
        // added (the row lock orders this update after the outcome's commit, whose
        // `finished_at` it then reads), with its `attached` before them.
        let rows: Vec<(Uuid, Option<i32>)> = sqlx::query_as(
            "WITH c AS (SELECT * FROM UNNEST($1::uuid[], $2::int[], $3::int[], $4::int[])
                          AS c(id, attached, replayed, log_reads)),
                  locked AS MATERIALIZED (SELECT r.id FROM requests r JOIN c ON c.id = r.id
                             ORDER BY r.id FOR UPDATE OF r SKIP LOCKED),
                  done AS (UPDATE requests r SET attached = r.attached + c.attached,
                               replayed = r.replayed + c.replayed,
                               log_reads = r.log_reads + c.log_reads
                           FROM c JOIN locked ON locked.id = c.id
                           WHERE r.id = c.id
                           RETURNING r.id, r.finished_at IS NOT NULL AND c.attached > 0 AS late,
                               r.attached - c.attached AS before)
             SELECT c.id, NULL::int FROM c
             WHERE c.id NOT IN (SELECT id FROM done)
               AND EXISTS (SELECT 1 FROM requests r WHERE r.id = c.id)
             UNION ALL
             SELECT id, before FROM done WHERE late",
        )
        .bind(&ids)
        .bind(column(|c| c.attached))
        .bind(column(|c| c.replayed))
        .bind(column(|c| c.log_reads))
        .fetch_all(&self.pool)
        .await?;
        let mut added = AddedCounts::default();
        for (id, before) in rows {
            match before {
                None => added.busy.push(id),
                Some(before) => added.late.push((id, u32::try_from(before).unwrap_or(0))),
            }
        }
        Ok(added)
    }

    async fn usage(&self, query: &UsageQuery) -> Result<Vec<UsageRow>, StoreError> {
        let key = match query.group_by {
            UsageGroup::Model => "COALESCE(r.model, '')",
            UsageGroup::Backend => "r.backend",
            UsageGroup::Namespace => "r.namespace",
            UsageGroup::Day => {
                "to_char(to_timestamp(r.created_at / 1000.0) AT TIME ZONE 'UTC', 'YYYY-MM-DD')"
            }
            UsageGroup::Provider => "split_part(r.route, '.', 1)",
        };
        let sql = format!("SELECT {key}{USAGE_SQL_TAIL}");
        let rows = sqlx::query(&sql)
            .bind(&query.namespace)
            .bind(query.since)
            .bind(query.until)
            .bind(query.bucket_ms)
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
                    saved: usage_from_row(row, 15)?,
                    bucket: row.try_get(21)?,
                    unmetered: n(22)?,
                })
            })
            .collect()
    }

    async fn lease_callbacks(
        &self,
        owner_prefix: &str,
        now: Millis,
        lease_ms: i64,
        quota: &LeaseQuota,
    ) -> Result<Vec<CallbackLease>, StoreError> {
        self.lease_callbacks_in(owner_prefix, now, lease_ms, quota)
            .await
    }

    async fn finish_callback(
        &self,
        lease: &CallbackLease,
        outcome: &CallbackOutcome,
        now: Millis,
    ) -> Result<bool, StoreError> {
        self.finish_callback_in(lease, outcome, now).await
    }

    async fn callbacks(&self, ids: &[Uuid]) -> Result<Vec<Callback>, StoreError> {
        self.callbacks_in(ids).await
    }

    async fn callback_backlog(&self) -> Result<i64, StoreError> {
        self.callback_backlog_in().await
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
        match sqlx::query("SELECT 1").execute(&self.pool).await {
            Ok(_) => Ok(()),
            // The pool says only that it waited; `/readyz` says why (refused, no answer, a
            // rejected password), within its own two seconds (HTTP-3).
            Err(sqlx::Error::PoolTimedOut) => {
                Err(connection::why_unreachable(&self.pool.connect_options(), PING_DIAGNOSIS).await)
            }
            Err(e) => Err(e.into()),
        }
    }
}
