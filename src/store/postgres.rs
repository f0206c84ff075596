//! PostgreSQL adapter of [`Store`]: one database shared by any number of `holdfast serve`
//! processes (SPEC DU-3).
//!
//! Every method keeps the semantics of [`super::sqlite::SqliteStore`]; the conformance suite
//! (`tests/api/store_conformance.rs`) runs the same tests against both. What differs is how
//! atomicity is reached: SQLite serialises all writes through one connection, PostgreSQL runs
//! many writers at once under READ COMMITTED and relies on row locks.
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
//! - **Lock order**: a transaction that touches both tables locks the `requests` row before
//!   `claims` rows; `append_chunks` locks its requests in id order. No deadlock cycles.
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
use std::time::Duration;

use async_trait::async_trait;
use sqlx::postgres::{PgConnectOptions, PgListener, PgPool, PgPoolOptions, PgRow};
use sqlx::{Postgres, Row, Transaction};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};
use uuid::Uuid;

use super::row::RawRecord;
use super::row::tokens_of;
use super::rules::{self, Expired, Settle};
use super::{
    Chunk, ChunkBatch, ChunkKind, ClaimKind, Lease, LeaseTo, ListFilter, Millis, NewRequest,
    Notification, Outcome, RequestRecord, ResponseRef, Status, Store, StoreError, Submitted, Swept,
    Usage, UsageGroup, UsageQuery, UsageRow,
};
use crate::provider::Route;

/// Connections per process unless [`PostgresStore::open_with`] says otherwise.
pub const DEFAULT_MAX_CONNECTIONS: u32 = 16;

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
        let options = PgConnectOptions::from_str(url)?.application_name("holdfast");
        let listen_pool = PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(Duration::from_secs(30))
            .connect_lazy_with(options.clone().application_name("holdfast-listen"));
        let pool = PgPoolOptions::new()
            .max_connections(max_connections.max(1))
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(options)
            .await?;
        // Concurrent starts of several nodes are fine: the migrator takes an advisory lock.
        MIGRATOR.run(&pool).await?;
        Ok(PostgresStore {
            pool,
            listen_pool,
            origin: Uuid::new_v4().simple().to_string(),
        })
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
        sqlx::query("DELETE FROM claims WHERE request_id = $1")
            .bind(id)
            .execute(&mut **tx)
            .await?;
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

/// Records that `response_id` is the provider's id of attempt `attempt` of request `id`. An id
/// already recorded keeps its first owner (providers do not reuse ids).
async fn insert_response_id(
    tx: &mut Transaction<'_, Postgres>,
    response_id: &str,
    id: Uuid,
    attempt: u32,
) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO response_ids (response_id, namespace, request_id, attempt)
         SELECT $1, namespace, id, $3 FROM requests WHERE id = $2
         ON CONFLICT (response_id) DO NOTHING",
    )
    .bind(text(response_id))
    .bind(id)
    .bind(attempt_number(attempt)?)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Records `usage` as attempt `attempt`'s of request `id`, replacing what was recorded before
/// (usage is reported cumulatively).
async fn upsert_usage(
    tx: &mut Transaction<'_, Postgres>,
    id: Uuid,
    attempt: u32,
    usage: &Usage,
) -> Result<(), StoreError> {
    let u = tokens_of(Some(usage));
    sqlx::query(
        "INSERT INTO attempt_usage (request_id, attempt, input_tokens, output_tokens,
             cached_input_tokens, cache_write_tokens, reasoning_tokens)
         VALUES ($1, $2, $3, $4, $5, $6, $7)
         ON CONFLICT (request_id, attempt) DO UPDATE SET
             input_tokens = EXCLUDED.input_tokens, output_tokens = EXCLUDED.output_tokens,
             cached_input_tokens = EXCLUDED.cached_input_tokens,
             cache_write_tokens = EXCLUDED.cache_write_tokens,
             reasoning_tokens = EXCLUDED.reasoning_tokens",
    )
    .bind(id)
    .bind(attempt_number(attempt)?)
    .bind(u[0])
    .bind(u[1])
    .bind(u[2])
    .bind(u[3])
    .bind(u[4])
    .execute(&mut **tx)
    .await?;
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
        SUM(r.attached)::bigint, SUM(r.replayed)::bigint,
        SUM(GREATEST(1 + r.attached + r.replayed - r.attempts, 0))::bigint,
        SUM(u.input_tokens)::bigint, SUM(u.output_tokens)::bigint,
        SUM(u.cached_input_tokens)::bigint, SUM(u.cache_write_tokens)::bigint,
        SUM(u.reasoning_tokens)::bigint,
        SUM(GREATEST(1 + r.attached + r.replayed - r.attempts, 0) * a.input_tokens)::bigint,
        SUM(GREATEST(1 + r.attached + r.replayed - r.attempts, 0) * a.output_tokens)::bigint,
        SUM(GREATEST(1 + r.attached + r.replayed - r.attempts, 0) * a.cached_input_tokens)::bigint,
        SUM(GREATEST(1 + r.attached + r.replayed - r.attempts, 0) * a.cache_write_tokens)::bigint,
        SUM(GREATEST(1 + r.attached + r.replayed - r.attempts, 0) * a.reasoning_tokens)::bigint
    FROM requests r
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
        // A request leased here is run by this node: no other node is woken for it.
        let mut tx = self.pool.begin().await?;
        // Inserts our claim, takes over an expired one, or leaves a live one untouched (locked)
        // and returns no row. A concurrent uncommitted insert of the same claim makes this wait
        // and then see the committed row: the loser gets no row, never a unique violation.
        let won: Option<Uuid> = sqlx::query_scalar(
            "INSERT INTO claims (namespace, claim_key, kind, request_id, fingerprint, expires_at)
             VALUES ($1, $2, $3, $4, $5, $6)
             ON CONFLICT (namespace, claim_key) DO UPDATE SET
                 kind = EXCLUDED.kind, request_id = EXCLUDED.request_id,
                 fingerprint = EXCLUDED.fingerprint, expires_at = EXCLUDED.expires_at
             WHERE claims.expires_at <= $7
             RETURNING request_id",
        )
        .bind(&new.namespace)
        .bind(&new.claim_key)
        .bind(new.claim.as_str())
        .bind(new.id)
        .bind(&new.hash[..])
        .bind(new.claim_expires_at)
        .bind(new.now)
        .fetch_optional(&mut *tx)
        .await?;

        if won == Some(new.id) {
            let headers = serde_json::to_string(&new.headers).map_err(corrupt)?;
            let (owner, expires_at) = match lease {
                Some(LeaseTo { owner, lease_ms }) => (Some(owner), Some(new.now + lease_ms)),
                None => (None, None),
            };
            let row = sqlx::query(concat!(
                "INSERT INTO requests (id, namespace, route, backend, model, stream, body, headers,
                     hash, claim_kind, status, attempts, lease_owner, lease_expires_at,
                     next_retry_at, created_at, updated_at)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10,
                     CASE WHEN $12::text IS NULL THEN 'pending' ELSE 'running' END,
                     CASE WHEN $12::text IS NULL THEN 0 ELSE 1 END, $12, $13, $11, $11, $11)
                 RETURNING ",
                request_columns!()
            ))
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
            .fetch_one(&mut *tx)
            .await?;
            let record = record_from_row(&row)?;
            if owner.is_none() {
                self.notify_work(&mut tx).await?;
            }
            tx.commit().await?;
            let lease = owner.map(|owner| Lease {
                id: record.id,
                owner: owner.to_string(),
                attempt: record.attempts,
            });
            return Ok((Submitted::Created(Box::new(record)), lease));
        }

        // A fresh statement (READ COMMITTED: a fresh snapshot) sees the committed live claim,
        // which our upsert locked, so it is still there.
        let (existing, fingerprint): (Uuid, Vec<u8>) = sqlx::query_as(
            "SELECT request_id, fingerprint FROM claims WHERE namespace = $1 AND claim_key = $2",
        )
        .bind(&new.namespace)
        .bind(&new.claim_key)
        .fetch_optional(&mut *tx)
        .await?
        .ok_or_else(|| corrupt("a live claim vanished while locked"))?;
        if fingerprint != new.hash {
            tx.commit().await?;
            return Ok((Submitted::KeyMismatch { existing }, None));
        }
        let record = Self::fetch_in(&mut tx, existing).await?.ok_or_else(|| {
            StoreError::corrupt(Some(existing), "a live claim points at a missing request")
        })?;
        tx.commit().await?;
        Ok((Submitted::Attached(Box::new(record)), None))
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
        // owner made unique by its id.
        let rows = sqlx::query(concat!(
            "UPDATE requests SET status = 'running', attempts = attempts + 1,
                 lease_owner = $1 || '/' || id::text, lease_expires_at = $2, updated_at = $3
             WHERE id IN (SELECT id FROM requests
                          WHERE status = 'pending' AND next_retry_at <= $3
                          ORDER BY next_retry_at, id LIMIT $4
                          FOR UPDATE SKIP LOCKED)
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
        let done = sqlx::query(
            "UPDATE requests SET lease_expires_at = $1
             WHERE id = $2 AND lease_owner = $3 AND status = 'running'",
        )
        .bind(now + lease_ms)
        .bind(lease.id)
        .bind(&lease.owner)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    // One transaction. One `UPDATE ... RETURNING` per outcome,
    // fenced on the lease (LC-3), reserves the `end` chunk's seq in the same statement (RD-5),
    // so what it returns is the final record and nothing is read back.
    async fn finish_read(
        &self,
        lease: &Lease,
        outcome: &Outcome,
        now: Millis,
    ) -> Result<Option<RequestRecord>, StoreError> {
        let id = lease.id;
        let mut tx = self.pool.begin().await?;
        let row = match outcome {
            Outcome::Succeeded {
                status,
                body,
                upstream_request_id,
                usage,
                ..
            } => {
                let u = tokens_of(usage.as_ref());
                sqlx::query(concat!(
                    "UPDATE requests SET status = 'succeeded', response_status = $1,
                         response_body = $2, upstream_request_id = $3, error_type = NULL,
                         error_message = NULL, error_status = NULL, lease_owner = NULL,
                         lease_expires_at = NULL, finished_at = $4, updated_at = $4,
                         last_seq = last_seq + 1, ",
                    usage_assignments!("$7", "$8", "$9", "$10", "$11"),
                    " WHERE id = $5 AND lease_owner = $6 AND status = 'running'
                     RETURNING ",
                    request_columns!()
                ))
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
                .fetch_optional(&mut *tx)
                .await?
            }
            Outcome::Retry {
                next_retry_at,
                error,
            } => {
                sqlx::query(concat!(
                    "UPDATE requests SET status = 'pending', next_retry_at = $1,
                         error_type = $2, error_message = $3, error_status = $4,
                         lease_owner = NULL, lease_expires_at = NULL, updated_at = $5
                     WHERE id = $6 AND lease_owner = $7 AND status = 'running'
                     RETURNING ",
                    request_columns!()
                ))
                .bind(next_retry_at)
                .bind(error.kind.as_str())
                .bind(text(&error.message))
                .bind(error.status.map(i32::from))
                .bind(now)
                .bind(id)
                .bind(&lease.owner)
                .fetch_optional(&mut *tx)
                .await?
            }
            Outcome::Failed {
                error,
                response,
                upstream_request_id,
                usage,
            } => {
                let u = tokens_of(usage.as_ref());
                sqlx::query(concat!(
                    "UPDATE requests SET status = 'failed', error_type = $1, error_message = $2,
                         error_status = $3, response_status = $4, response_body = $5,
                         upstream_request_id = $6, lease_owner = NULL, lease_expires_at = NULL,
                         finished_at = $7, updated_at = $7, last_seq = last_seq + 1, ",
                    usage_assignments!("$10", "$11", "$12", "$13", "$14"),
                    " WHERE id = $8 AND lease_owner = $9 AND status = 'running'
                     RETURNING ",
                    request_columns!()
                ))
                .bind(error.kind.as_str())
                .bind(text(&error.message))
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
                .fetch_optional(&mut *tx)
                .await?
            }
        };
        let Some(row) = row else {
            tx.commit().await?;
            return Ok(None);
        };
        let record = record_from_row(&row)?;
        if let Outcome::Succeeded {
            response_id: Some(response_id),
            ..
        } = outcome
        {
            insert_response_id(&mut tx, response_id, id, lease.attempt).await?;
        }
        if let Outcome::Succeeded {
            usage: Some(usage), ..
        }
        | Outcome::Failed {
            usage: Some(usage), ..
        } = outcome
        {
            upsert_usage(&mut tx, id, lease.attempt, usage).await?;
        }
        if record.status.is_terminal() {
            let settle = rules::settle(record.status, record.error.as_ref(), record.claim);
            // The end chunk's seq was reserved by the UPDATE above.
            let attempt = attempt_number(record.attempts)?;
            settle_in(&mut tx, id, attempt, &settle, Some(record.last_seq)).await?;
        }
        self.notify_changed(&mut tx, &[id]).await?;
        tx.commit().await?;
        Ok(Some(record))
    }

    async fn sweep(&self, now: Millis, max_attempts: u32) -> Result<Swept, StoreError> {
        let mut tx = self.pool.begin().await?;
        // SKIP LOCKED: a request another sweeper (or a heartbeat, finish, cancel) holds is left
        // to it; whatever we lock is ours alone until commit, so each expired lease is handled
        // by exactly one sweeper (DU-3). Each gets the verdict of `rules::expired`.
        let expired: Vec<(Uuid, String, i32, i64, i64)> = sqlx::query_as(
            "SELECT id, claim_kind, attempts, last_seq, reset_seq FROM requests
             WHERE status = 'running' AND lease_expires_at < $1
             FOR UPDATE SKIP LOCKED",
        )
        .bind(now)
        .fetch_all(&mut *tx)
        .await?;
        let mut swept = Swept::default();
        for (id, claim, attempts, last_seq, reset_seq) in expired {
            let claim = claim_of(id, &claim)?;
            let count = u32::try_from(attempts)
                .map_err(|_| StoreError::corrupt(Some(id), format!("attempts {attempts}")))?;
            match rules::expired(count, max_attempts, last_seq, reset_seq) {
                Expired::Fail(error) => {
                    sqlx::query(
                        "UPDATE requests SET status = 'failed', error_type = $2,
                             error_message = $3, error_status = NULL, lease_owner = NULL,
                             lease_expires_at = NULL, finished_at = $1, updated_at = $1
                         WHERE id = $4",
                    )
                    .bind(now)
                    .bind(error.kind.as_str())
                    .bind(text(&error.message))
                    .bind(id)
                    .execute(&mut *tx)
                    .await?;
                    let settle = rules::settle(Status::Failed, Some(&error), claim);
                    settle_in(&mut tx, id, attempts, &settle, None).await?;
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
        // Lock the requests in id order (stable, so one request's batches keep their order):
        // two group commits touching the same requests can then never deadlock.
        let mut order: Vec<usize> = (0..batches.len()).collect();
        order.sort_by_key(|&i| batches[i].lease.id);
        let mut results: Vec<Option<Vec<Chunk>>> = vec![None; batches.len()];
        let mut tx = self.pool.begin().await?;
        for i in order {
            let batch = &batches[i];
            let n = i64::try_from(batch.chunks.len()).map_err(corrupt)?;
            // Fenced (LC-3): the seqs are reserved only while this attempt holds its lease.
            let last: Option<i64> = sqlx::query_scalar(
                "UPDATE requests SET last_seq = last_seq + $1,
                     upstream_request_id = COALESCE($2, upstream_request_id)
                 WHERE id = $3 AND lease_owner = $4 AND status = 'running'
                 RETURNING last_seq",
            )
            .bind(n)
            .bind(opt_text(batch.upstream_request_id.as_deref()))
            .bind(batch.lease.id)
            .bind(&batch.lease.owner)
            .fetch_optional(&mut *tx)
            .await?;
            let Some(last) = last else { continue };
            if let Some(response_id) = &batch.response_id {
                insert_response_id(&mut tx, response_id, batch.lease.id, batch.lease.attempt)
                    .await?;
            }
            if let Some(usage) = &batch.usage {
                upsert_usage(&mut tx, batch.lease.id, batch.lease.attempt, usage).await?;
            }
            let first = last - n + 1;
            let events: Vec<Option<String>> = batch
                .chunks
                .iter()
                .map(|c| opt_text(c.event.as_deref()).map(Cow::into_owned))
                .collect();
            let data: Vec<String> = batch
                .chunks
                .iter()
                .map(|c| text(&c.data).into_owned())
                .collect();
            if n > 0 {
                // One statement per batch, whatever its size: the rows travel as two arrays.
                sqlx::query(
                    "INSERT INTO chunks (request_id, seq, attempt, kind, event, data)
                     SELECT $1, $2 + t.ord - 1, $3, 'data', t.event, t.data
                     FROM UNNEST($4::text[], $5::text[]) WITH ORDINALITY AS t(event, data, ord)",
                )
                .bind(batch.lease.id)
                .bind(first)
                .bind(attempt_number(batch.lease.attempt)?)
                .bind(&events)
                .bind(&data)
                .execute(&mut *tx)
                .await?;
            }
            let stored = events
                .into_iter()
                .zip(data)
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
        // One wake-up per group commit for every request that got chunks, never one per chunk.
        let mut changed: Vec<Uuid> = batches
            .iter()
            .zip(&results)
            .filter(|(_, stored)| stored.is_some())
            .map(|(batch, _)| batch.lease.id)
            .collect();
        changed.dedup();
        self.notify_changed(&mut tx, &changed).await?;
        tx.commit().await?;
        Ok(results)
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
        let cancelled: Option<(String, i32)> = sqlx::query_as(
            "UPDATE requests SET status = 'failed', error_type = $5,
                 error_message = $1, error_status = NULL,
                 lease_owner = NULL, lease_expires_at = NULL, finished_at = $2, updated_at = $2
             WHERE id = $3 AND namespace = $4 AND status IN ('pending', 'running')
             RETURNING claim_kind, attempts",
        )
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

    async fn release(&self, lease: &Lease, now: Millis) -> Result<bool, StoreError> {
        let mut tx = self.pool.begin().await?;
        let released: Option<(i32, i64, i64)> = sqlx::query_as(
            "UPDATE requests SET status = 'pending', next_retry_at = $1, lease_owner = NULL,
                 lease_expires_at = NULL, updated_at = $1
             WHERE id = $2 AND lease_owner = $3 AND status = 'running'
             RETURNING attempts, last_seq, reset_seq",
        )
        .bind(now)
        .bind(lease.id)
        .bind(&lease.owner)
        .fetch_optional(&mut *tx)
        .await?;
        if let Some((attempts, last_seq, reset_seq)) = released {
            let attempts = u32::try_from(attempts).map_err(corrupt)?;
            if let Some((attempt, data)) = rules::reset_after(attempts, last_seq, reset_seq) {
                let attempt = attempt_number(attempt)?;
                append_control(&mut tx, lease.id, attempt, ChunkKind::Reset, &data).await?;
            }
        }
        if released.is_some() {
            self.notify_changed(&mut tx, &[lease.id]).await?;
            self.notify_work(&mut tx).await?;
        }
        tx.commit().await?;
        Ok(released.is_some())
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
        sqlx::query("DELETE FROM claims WHERE request_id = ANY($1)")
            .bind(&ids)
            .execute(&mut *tx)
            .await?;
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

    async fn count_delivery(&self, id: Uuid, replayed: bool) -> Result<(), StoreError> {
        sqlx::query(
            "UPDATE requests SET attached = attached + (NOT $2)::int, replayed = replayed + $2::int
             WHERE id = $1",
        )
        .bind(id)
        .bind(replayed)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn count_log_read(&self, id: Uuid) -> Result<(), StoreError> {
        sqlx::query("UPDATE requests SET log_reads = log_reads + 1 WHERE id = $1")
            .bind(id)
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
