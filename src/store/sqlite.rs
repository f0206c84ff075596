//! SQLite adapter of [`Store`]: one file, WAL mode, one writer connection beside a read pool
//! (SPEC DU-2).
//!
//! All writes go through a pool of exactly one connection, so SQLite's single-writer rule never
//! shows up as `SQLITE_BUSY` and every write statement is atomic with respect to every other:
//! the claim (an upsert on the `claims` primary key) and the lease (one `UPDATE ... RETURNING`)
//! need no further locking. Reads use a separate pool of read-only connections and see every
//! committed write (WAL).

use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteRow,
    SqliteSynchronous as Sync,
};
use sqlx::{Row, Sqlite, Transaction};
use uuid::Uuid;

use super::{
    Chunk, ChunkBatch, ChunkKind, ClaimKind, ErrorInfo, ErrorType, Lease, Millis, NewChunk,
    NewRequest, Outcome, RequestRecord, Status, Store, StoreError, Submitted, Swept, end_data,
    failure_releases_claim,
};
use crate::config::SqliteSynchronous;

/// The embedded store.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    writer: SqlitePool,
    reader: SqlitePool,
}

const COLUMNS: &str = "id, namespace, route, backend, model, stream, body, headers, claim_kind, \
    status, attempts, recoveries, next_retry_at, error_type, error_message, error_status, \
    response_status, response_body, upstream_request_id, last_seq, reset_seq, created_at, updated_at, \
    finished_at";

impl SqliteStore {
    /// Opens (creating when missing) the database at `url` (`sqlite://PATH` or `sqlite:PATH`)
    /// and applies the migrations in `migrations/sqlite`.
    ///
    /// # Errors
    /// [`StoreError`] when the file cannot be opened or migrated.
    pub async fn open(url: &str, synchronous: SqliteSynchronous) -> Result<Self, StoreError> {
        let base = SqliteConnectOptions::from_str(url)?
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(match synchronous {
                SqliteSynchronous::Full => Sync::Full,
                SqliteSynchronous::Normal => Sync::Normal,
            })
            .busy_timeout(Duration::from_secs(10))
            .foreign_keys(true);
        // `test_before_acquire(false)` on both pools: sqlx's default pings every connection
        // on every checkout, one more round trip to the connection's worker thread per store
        // call; an embedded file connection has nothing to go stale (docs/benchmarks.md).
        let writer = SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .test_before_acquire(false)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(base.clone().create_if_missing(true))
            .await?;
        sqlx::migrate!("./migrations/sqlite").run(&writer).await?;
        let reader = SqlitePoolOptions::new()
            .max_connections(8)
            .test_before_acquire(false)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(base.read_only(true))
            .await?;
        Ok(SqliteStore { writer, reader })
    }

    async fn fetch_in(
        tx: &mut Transaction<'_, Sqlite>,
        id: &str,
    ) -> Result<Option<RequestRecord>, StoreError> {
        let row = sqlx::query(&format!("SELECT {COLUMNS} FROM requests WHERE id = ?1"))
            .bind(id)
            .fetch_optional(&mut **tx)
            .await?;
        row.as_ref().map(record_from_row).transpose()
    }
}

fn corrupt(what: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(what.to_string())
}

fn record_from_row(row: &SqliteRow) -> Result<RequestRecord, StoreError> {
    let id: String = row.try_get("id")?;
    let status: String = row.try_get("status")?;
    let claim_kind: String = row.try_get("claim_kind")?;
    let headers: String = row.try_get("headers")?;
    let error_type: Option<String> = row.try_get("error_type")?;
    let error = match error_type {
        Some(t) => Some(ErrorInfo {
            kind: ErrorType::parse(&t).ok_or_else(|| corrupt(format!("error_type {t:?}")))?,
            message: row
                .try_get::<Option<String>, _>("error_message")?
                .unwrap_or_default(),
            status: row
                .try_get::<Option<i64>, _>("error_status")?
                .and_then(|s| u16::try_from(s).ok()),
        }),
        None => None,
    };
    Ok(RequestRecord {
        id: Uuid::parse_str(&id).map_err(|e| corrupt(format!("id {id:?}: {e}")))?,
        namespace: row.try_get("namespace")?,
        route: row.try_get("route")?,
        backend: row.try_get("backend")?,
        model: row.try_get("model")?,
        stream: row.try_get::<i64, _>("stream")? != 0,
        body: row.try_get("body")?,
        headers: serde_json::from_str(&headers).map_err(|e| corrupt(format!("headers: {e}")))?,
        claim: match claim_kind.as_str() {
            "key" => ClaimKind::Key,
            _ => ClaimKind::BodyHash,
        },
        status: Status::parse(&status).ok_or_else(|| corrupt(format!("status {status:?}")))?,
        attempts: u32::try_from(row.try_get::<i64, _>("attempts")?).map_err(corrupt)?,
        recoveries: u32::try_from(row.try_get::<i64, _>("recoveries")?).map_err(corrupt)?,
        next_retry_at: row.try_get("next_retry_at")?,
        error,
        response_status: row
            .try_get::<Option<i64>, _>("response_status")?
            .and_then(|s| u16::try_from(s).ok()),
        response_body: row.try_get("response_body")?,
        upstream_request_id: row.try_get("upstream_request_id")?,
        last_seq: row.try_get("last_seq")?,
        reset_seq: row.try_get("reset_seq")?,
        created_at: row.try_get("created_at")?,
        updated_at: row.try_get("updated_at")?,
        finished_at: row.try_get("finished_at")?,
    })
}

/// Deletes the claims pointing at `id` when a failure of `kind` releases them (ID-6).
async fn release_claims(
    tx: &mut Transaction<'_, Sqlite>,
    id: &str,
    claim: ClaimKind,
    kind: ErrorType,
) -> Result<(), StoreError> {
    if failure_releases_claim(claim, kind) {
        sqlx::query("DELETE FROM claims WHERE request_id = ?1")
            .bind(id)
            .execute(&mut **tx)
            .await?;
    }
    Ok(())
}

/// Appends one control chunk (`reset` or `end`) after the request's last seq; a `reset` also
/// moves `reset_seq` (LC-8, RD-5, RD-6). Returns its seq.
async fn append_control(
    tx: &mut Transaction<'_, Sqlite>,
    id: &str,
    attempt: i64,
    kind: ChunkKind,
    data: &str,
) -> Result<i64, StoreError> {
    let seq: i64 = sqlx::query_scalar(
        "UPDATE requests SET last_seq = last_seq + 1,
             reset_seq = CASE WHEN ?2 = 'reset' THEN last_seq + 1 ELSE reset_seq END
         WHERE id = ?1
         RETURNING last_seq",
    )
    .bind(id)
    .bind(kind.as_str())
    .fetch_one(&mut **tx)
    .await?;
    sqlx::query(
        "INSERT INTO chunks (request_id, seq, attempt, kind, event, data)
         VALUES (?1, ?2, ?3, ?4, NULL, ?5)",
    )
    .bind(id)
    .bind(seq)
    .bind(attempt)
    .bind(kind.as_str())
    .bind(data)
    .execute(&mut **tx)
    .await?;
    Ok(seq)
}

/// The record of a request just inserted by [`Store::submit`], as the row's column defaults
/// make it: pending, due now, no attempts, no chunks.
fn created_record(new: NewRequest) -> RequestRecord {
    RequestRecord {
        id: new.id,
        namespace: new.namespace,
        route: new.route,
        backend: new.backend,
        model: new.model,
        stream: new.stream,
        body: new.body,
        headers: new.headers,
        claim: new.claim,
        status: Status::Pending,
        attempts: 0,
        recoveries: 0,
        next_retry_at: new.now,
        error: None,
        response_status: None,
        response_body: None,
        upstream_request_id: None,
        last_seq: 0,
        reset_seq: 0,
        created_at: new.now,
        updated_at: new.now,
        finished_at: None,
    }
}

fn chunk_from_row(row: &SqliteRow) -> Result<Chunk, StoreError> {
    let kind: String = row.try_get("kind")?;
    Ok(Chunk {
        seq: row.try_get("seq")?,
        attempt: u32::try_from(row.try_get::<i64, _>("attempt")?).map_err(corrupt)?,
        kind: ChunkKind::parse(&kind).ok_or_else(|| corrupt(format!("chunk kind {kind:?}")))?,
        event: row.try_get("event")?,
        data: row.try_get("data")?,
    })
}

fn claim_kind_of(s: &str) -> ClaimKind {
    if s == "key" {
        ClaimKind::Key
    } else {
        ClaimKind::BodyHash
    }
}

#[async_trait]
impl Store for SqliteStore {
    async fn submit(&self, new: NewRequest) -> Result<Submitted, StoreError> {
        let id = new.id.to_string();
        let mut tx = self.writer.begin().await?;
        // The upsert either inserts our claim, takes over an expired one, or leaves a live one
        // untouched and returns no row. One statement, so two racing submissions cannot both win.
        let won: Option<String> = sqlx::query_scalar(
            "INSERT INTO claims (namespace, claim_key, kind, request_id, fingerprint, expires_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)
             ON CONFLICT (namespace, claim_key) DO UPDATE SET
                 kind = excluded.kind, request_id = excluded.request_id,
                 fingerprint = excluded.fingerprint, expires_at = excluded.expires_at
             WHERE claims.expires_at <= ?7
             RETURNING request_id",
        )
        .bind(&new.namespace)
        .bind(&new.claim_key)
        .bind(new.claim.as_str())
        .bind(&id)
        .bind(&new.hash[..])
        .bind(new.claim_expires_at)
        .bind(new.now)
        .fetch_optional(&mut *tx)
        .await?;

        if won.as_deref() == Some(id.as_str()) {
            let headers = serde_json::to_string(&new.headers).map_err(corrupt)?;
            sqlx::query(
                "INSERT INTO requests (id, namespace, route, backend, model, stream, body, headers,
                     hash, claim_kind, status, next_retry_at, created_at, updated_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, 'pending', ?11, ?11, ?11)",
            )
            .bind(&id)
            .bind(&new.namespace)
            .bind(&new.route)
            .bind(&new.backend)
            .bind(&new.model)
            .bind(i64::from(new.stream))
            .bind(&new.body)
            .bind(headers)
            .bind(&new.hash[..])
            .bind(new.claim.as_str())
            .bind(new.now)
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
            // The row is exactly what was just inserted: no need to read it back.
            return Ok(Submitted::Created(Box::new(created_record(new))));
        }

        let (existing, fingerprint): (String, Vec<u8>) = sqlx::query_as(
            "SELECT request_id, fingerprint FROM claims WHERE namespace = ?1 AND claim_key = ?2",
        )
        .bind(&new.namespace)
        .bind(&new.claim_key)
        .fetch_one(&mut *tx)
        .await?;
        let existing_id =
            Uuid::parse_str(&existing).map_err(|e| corrupt(format!("claim {existing:?}: {e}")))?;
        if fingerprint != new.hash {
            tx.commit().await?;
            return Ok(Submitted::KeyMismatch {
                existing: existing_id,
            });
        }
        let record = Self::fetch_in(&mut tx, &existing)
            .await?
            .ok_or_else(|| corrupt(format!("claim points at missing request {existing}")))?;
        tx.commit().await?;
        Ok(Submitted::Attached(Box::new(record)))
    }

    async fn get(&self, namespace: &str, id: Uuid) -> Result<Option<RequestRecord>, StoreError> {
        let row = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM requests WHERE id = ?1 AND namespace = ?2"
        ))
        .bind(id.to_string())
        .bind(namespace)
        .fetch_optional(&self.reader)
        .await?;
        row.as_ref().map(record_from_row).transpose()
    }

    async fn lease(
        &self,
        owner: &str,
        now: Millis,
        lease_ms: i64,
    ) -> Result<Option<(Lease, RequestRecord)>, StoreError> {
        let row = sqlx::query(&format!(
            "UPDATE requests SET status = 'running', attempts = attempts + 1,
                 lease_owner = ?1, lease_expires_at = ?2, updated_at = ?3
             WHERE id = (SELECT id FROM requests
                         WHERE status = 'pending' AND next_retry_at <= ?3
                         ORDER BY next_retry_at, id LIMIT 1)
             RETURNING {COLUMNS}"
        ))
        .bind(owner)
        .bind(now + lease_ms)
        .bind(now)
        .fetch_optional(&self.writer)
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
        // One statement on the single writer: atomic like `lease`, for up to `limit` rows.
        let rows = sqlx::query(&format!(
            "UPDATE requests SET status = 'running', attempts = attempts + 1,
                 lease_owner = ?1 || '/' || id, lease_expires_at = ?2, updated_at = ?3
             WHERE id IN (SELECT id FROM requests
                          WHERE status = 'pending' AND next_retry_at <= ?3
                          ORDER BY next_retry_at, id LIMIT ?4)
             RETURNING lease_owner, {COLUMNS}"
        ))
        .bind(owner_prefix)
        .bind(now + lease_ms)
        .bind(now)
        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
        .fetch_all(&self.writer)
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
            "UPDATE requests SET lease_expires_at = ?1
             WHERE id = ?2 AND lease_owner = ?3 AND status = 'running'",
        )
        .bind(now + lease_ms)
        .bind(lease.id.to_string())
        .bind(&lease.owner)
        .execute(&self.writer)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn finish(
        &self,
        lease: &Lease,
        outcome: Outcome,
        now: Millis,
    ) -> Result<bool, StoreError> {
        let id = lease.id.to_string();
        let mut tx = self.writer.begin().await?;
        let claim: Option<(String, i64)> = match &outcome {
            Outcome::Succeeded {
                status,
                body,
                upstream_request_id,
            } => {
                sqlx::query_as(
                    "UPDATE requests SET status = 'succeeded', response_status = ?1,
                         response_body = ?2, upstream_request_id = ?3, error_type = NULL,
                         error_message = NULL, error_status = NULL, lease_owner = NULL,
                         lease_expires_at = NULL, finished_at = ?4, updated_at = ?4
                     WHERE id = ?5 AND lease_owner = ?6
                     RETURNING claim_kind, attempts",
                )
                .bind(i64::from(*status))
                .bind(body)
                .bind(upstream_request_id)
                .bind(now)
                .bind(&id)
                .bind(&lease.owner)
                .fetch_optional(&mut *tx)
                .await?
            }
            Outcome::Retry {
                next_retry_at,
                error,
            } => {
                sqlx::query_as(
                    "UPDATE requests SET status = 'pending', next_retry_at = ?1,
                         error_type = ?2, error_message = ?3, error_status = ?4,
                         lease_owner = NULL, lease_expires_at = NULL, updated_at = ?5
                     WHERE id = ?6 AND lease_owner = ?7
                     RETURNING claim_kind, attempts",
                )
                .bind(next_retry_at)
                .bind(error.kind.as_str())
                .bind(&error.message)
                .bind(error.status.map(i64::from))
                .bind(now)
                .bind(&id)
                .bind(&lease.owner)
                .fetch_optional(&mut *tx)
                .await?
            }
            Outcome::Failed {
                error,
                response,
                upstream_request_id,
            } => {
                let claim: Option<(String, i64)> = sqlx::query_as(
                    "UPDATE requests SET status = 'failed', error_type = ?1, error_message = ?2,
                         error_status = ?3, response_status = ?4, response_body = ?5,
                         upstream_request_id = ?6, lease_owner = NULL, lease_expires_at = NULL,
                         finished_at = ?7, updated_at = ?7
                     WHERE id = ?8 AND lease_owner = ?9
                     RETURNING claim_kind, attempts",
                )
                .bind(error.kind.as_str())
                .bind(&error.message)
                .bind(error.status.map(i64::from))
                .bind(response.as_ref().map(|(s, _)| i64::from(*s)))
                .bind(response.as_ref().map(|(_, b)| b.as_slice()))
                .bind(upstream_request_id)
                .bind(now)
                .bind(&id)
                .bind(&lease.owner)
                .fetch_optional(&mut *tx)
                .await?;
                if let Some((kind, attempts)) = &claim {
                    release_claims(&mut tx, &id, claim_kind_of(kind), error.kind).await?;
                    let end = end_data(Status::Failed, Some(error));
                    append_control(&mut tx, &id, *attempts, ChunkKind::End, &end).await?;
                }
                claim
            }
        };
        if let (Some((_, attempts)), Outcome::Succeeded { .. }) = (&claim, &outcome) {
            let end = end_data(Status::Succeeded, None);
            append_control(&mut tx, &id, *attempts, ChunkKind::End, &end).await?;
        }
        tx.commit().await?;
        Ok(claim.is_some())
    }

    async fn sweep(&self, now: Millis, max_attempts: u32) -> Result<Swept, StoreError> {
        let mut tx = self.writer.begin().await?;
        let failed: Vec<(String, String, i64)> = sqlx::query_as(
            "UPDATE requests SET status = 'failed', error_type = 'lease_expired',
                 error_message = 'the worker running the last attempt stopped renewing its lease and no attempts are left',
                 error_status = NULL, lease_owner = NULL, lease_expires_at = NULL,
                 finished_at = ?1, updated_at = ?1
             WHERE status = 'running' AND lease_expires_at < ?1 AND attempts >= ?2
             RETURNING id, claim_kind, attempts",
        )
        .bind(now)
        .bind(i64::from(max_attempts))
        .fetch_all(&mut *tx)
        .await?;
        for (id, claim, attempts) in &failed {
            release_claims(&mut tx, id, claim_kind_of(claim), ErrorType::LeaseExpired).await?;
            let record = Self::fetch_in(&mut tx, id).await?;
            let end = end_data(
                Status::Failed,
                record.as_ref().and_then(|r| r.error.as_ref()),
            );
            append_control(&mut tx, id, *attempts, ChunkKind::End, &end).await?;
        }
        let recovered: Vec<(String, i64, i64, i64)> = sqlx::query_as(
            "UPDATE requests SET status = 'pending', recoveries = recoveries + 1,
                 next_retry_at = ?1, lease_owner = NULL, lease_expires_at = NULL, updated_at = ?1
             WHERE status = 'running' AND lease_expires_at < ?1
             RETURNING id, attempts, last_seq, reset_seq",
        )
        .bind(now)
        .fetch_all(&mut *tx)
        .await?;
        for (id, attempts, last_seq, reset_seq) in &recovered {
            // The abandoned attempt stored chunks: the next attempt starts after a reset (LC-8).
            if last_seq > reset_seq {
                let next = (attempts + 1).to_string();
                append_control(&mut tx, id, attempts + 1, ChunkKind::Reset, &next).await?;
            }
        }
        tx.commit().await?;
        let parse = |s: &String| Uuid::parse_str(s).map_err(|e| corrupt(format!("id {s:?}: {e}")));
        Ok(Swept {
            recovered: recovered
                .iter()
                .map(|(id, ..)| parse(id))
                .collect::<Result<_, _>>()?,
            failed: failed
                .iter()
                .map(|(id, ..)| parse(id))
                .collect::<Result<_, _>>()?,
        })
    }

    async fn append_chunks(
        &self,
        batches: &[ChunkBatch],
    ) -> Result<Vec<Option<Vec<Chunk>>>, StoreError> {
        if batches.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<String> = batches.iter().map(|b| b.lease.id.to_string()).collect();
        let mut tx = self.writer.begin().await?;
        // Fenced (LC-3): seqs are reserved only for batches whose attempt still holds its
        // lease. One statement fences every batch of the commit: each statement is a round
        // trip to the connection's thread, and one per batch capped a 1,000-stream commit at
        // ~10 chunks per stream per second (docs/benchmarks.md, finding 6). The join needs one
        // batch per request, which the writer guarantees (an attempt waits for its ack); a
        // commit with two batches of one request takes the statement-per-batch path.
        let mut seen = std::collections::HashSet::with_capacity(ids.len());
        let distinct = ids.iter().all(|id| seen.insert(id.as_str()));
        let mut last_seqs: Vec<Option<i64>> = vec![None; batches.len()];
        if distinct {
            let indices: Vec<usize> = (0..batches.len()).collect();
            // 4 bound variables per batch; SQLite allows 32766 per statement.
            for group in indices.chunks(4096) {
                let mut fence =
                    sqlx::QueryBuilder::<Sqlite>::new("WITH b (bid, bowner, bn, brid) AS (");
                fence.push_values(group, |mut row, &i| {
                    row.push_bind(&ids[i])
                        .push_bind(&batches[i].lease.owner)
                        .push_bind(batches[i].chunks.len() as i64)
                        .push_bind(&batches[i].upstream_request_id);
                });
                fence.push(
                    ") UPDATE requests SET last_seq = last_seq + b.bn,
                         upstream_request_id = COALESCE(b.brid, upstream_request_id)
                     FROM b
                     WHERE requests.id = b.bid AND requests.lease_owner = b.bowner
                         AND requests.status = 'running'
                     RETURNING id, last_seq",
                );
                let fenced: Vec<(String, i64)> = fence.build_query_as().fetch_all(&mut *tx).await?;
                let fenced: std::collections::HashMap<String, i64> = fenced.into_iter().collect();
                for &i in group {
                    last_seqs[i] = fenced.get(&ids[i]).copied();
                }
            }
        } else {
            for (i, batch) in batches.iter().enumerate() {
                last_seqs[i] = sqlx::query_scalar(
                    "UPDATE requests SET last_seq = last_seq + ?1,
                         upstream_request_id = COALESCE(?2, upstream_request_id)
                     WHERE id = ?3 AND lease_owner = ?4 AND status = 'running'
                     RETURNING last_seq",
                )
                .bind(batch.chunks.len() as i64)
                .bind(&batch.upstream_request_id)
                .bind(&ids[i])
                .bind(&batch.lease.owner)
                .fetch_optional(&mut *tx)
                .await?;
            }
        }

        let mut results = Vec::with_capacity(batches.len());
        let mut rows: Vec<(usize, i64, &NewChunk)> = Vec::new();
        for (i, batch) in batches.iter().enumerate() {
            let Some(last) = last_seqs[i] else {
                results.push(None);
                continue;
            };
            let first = last - batch.chunks.len() as i64 + 1;
            let mut stored = Vec::with_capacity(batch.chunks.len());
            for (k, c) in batch.chunks.iter().enumerate() {
                let seq = first + k as i64;
                rows.push((i, seq, c));
                stored.push(Chunk {
                    seq,
                    attempt: batch.lease.attempt,
                    kind: ChunkKind::Data,
                    event: c.event.clone(),
                    data: c.data.clone(),
                });
            }
            results.push(Some(stored));
        }
        // Every fenced chunk of the commit in as few statements as SQLite allows: 6 bound
        // variables per row, at most 32766 per statement.
        for group in rows.chunks(5000) {
            let mut insert = sqlx::QueryBuilder::<Sqlite>::new(
                "INSERT INTO chunks (request_id, seq, attempt, kind, event, data) ",
            );
            insert.push_values(group, |mut row, &(i, seq, c)| {
                row.push_bind(&ids[i])
                    .push_bind(seq)
                    .push_bind(i64::from(batches[i].lease.attempt))
                    .push_bind("data")
                    .push_bind(&c.event)
                    .push_bind(&c.data);
            });
            insert.build().execute(&mut *tx).await?;
        }
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
             WHERE request_id = ?1 AND seq > ?2 ORDER BY seq LIMIT ?3",
        )
        .bind(id.to_string())
        .bind(after)
        .bind(limit)
        .fetch_all(&self.reader)
        .await?;
        rows.iter().map(chunk_from_row).collect()
    }

    async fn cancel(
        &self,
        namespace: &str,
        id: Uuid,
        now: Millis,
    ) -> Result<Option<RequestRecord>, StoreError> {
        let id = id.to_string();
        let mut tx = self.writer.begin().await?;
        let cancelled: Option<(String, i64)> = sqlx::query_as(
            "UPDATE requests SET status = 'failed', error_type = 'cancelled',
                 error_message = 'cancelled through POST /requests/<id>/cancel', error_status = NULL,
                 lease_owner = NULL, lease_expires_at = NULL, finished_at = ?1, updated_at = ?1
             WHERE id = ?2 AND namespace = ?3 AND status IN ('pending', 'running')
             RETURNING claim_kind, attempts",
        )
        .bind(now)
        .bind(&id)
        .bind(namespace)
        .fetch_optional(&mut *tx)
        .await?;
        if let Some((claim, attempts)) = &cancelled {
            release_claims(&mut tx, &id, claim_kind_of(claim), ErrorType::Cancelled).await?;
            let record = Self::fetch_in(&mut tx, &id).await?;
            let end = end_data(
                Status::Failed,
                record.as_ref().and_then(|r| r.error.as_ref()),
            );
            append_control(&mut tx, &id, *attempts, ChunkKind::End, &end).await?;
        }
        let record = Self::fetch_in(&mut tx, &id)
            .await?
            .filter(|r| r.namespace == namespace);
        tx.commit().await?;
        Ok(record)
    }

    async fn list(
        &self,
        namespace: &str,
        status: Option<Status>,
        before: Option<Uuid>,
        limit: i64,
    ) -> Result<Vec<RequestRecord>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM requests
             WHERE namespace = ?1 AND (?2 IS NULL OR status = ?2) AND (?3 IS NULL OR id < ?3)
             ORDER BY id DESC LIMIT ?4"
        ))
        .bind(namespace)
        .bind(status.map(Status::as_str))
        .bind(before.map(|b| b.to_string()))
        .bind(limit)
        .fetch_all(&self.reader)
        .await?;
        rows.iter().map(record_from_row).collect()
    }

    async fn release(&self, lease: &Lease, now: Millis) -> Result<bool, StoreError> {
        let id = lease.id.to_string();
        let mut tx = self.writer.begin().await?;
        let released: Option<(i64, i64, i64)> = sqlx::query_as(
            "UPDATE requests SET status = 'pending', next_retry_at = ?1, lease_owner = NULL,
                 lease_expires_at = NULL, updated_at = ?1
             WHERE id = ?2 AND lease_owner = ?3 AND status = 'running'
             RETURNING attempts, last_seq, reset_seq",
        )
        .bind(now)
        .bind(&id)
        .bind(&lease.owner)
        .fetch_optional(&mut *tx)
        .await?;
        if let Some((attempts, last_seq, reset_seq)) = released
            && last_seq > reset_seq
        {
            let next = (attempts + 1).to_string();
            append_control(&mut tx, &id, attempts + 1, ChunkKind::Reset, &next).await?;
        }
        tx.commit().await?;
        Ok(released.is_some())
    }

    async fn prune(&self, before: Millis, limit: i64) -> Result<u64, StoreError> {
        let mut tx = self.writer.begin().await?;
        let ids: Vec<String> = sqlx::query_scalar(
            "SELECT id FROM requests
             WHERE finished_at IS NOT NULL AND finished_at < ?1
             ORDER BY finished_at LIMIT ?2",
        )
        .bind(before)
        .bind(limit)
        .fetch_all(&mut *tx)
        .await?;
        for id in &ids {
            for sql in [
                "DELETE FROM chunks WHERE request_id = ?1",
                "DELETE FROM claims WHERE request_id = ?1",
                "DELETE FROM requests WHERE id = ?1",
            ] {
                sqlx::query(sql).bind(id).execute(&mut *tx).await?;
            }
        }
        tx.commit().await?;
        Ok(ids.len() as u64)
    }

    async fn counts(&self) -> Result<Vec<(Status, i64)>, StoreError> {
        let rows: Vec<(String, i64)> =
            sqlx::query_as("SELECT status, COUNT(*) FROM requests GROUP BY status")
                .fetch_all(&self.reader)
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
                .fetch_one(&self.reader)
                .await?;
        Ok(due)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT 1").execute(&self.reader).await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn new_request(i: u8, now: Millis) -> NewRequest {
        let mut hash = [0u8; 32];
        hash[0] = i;
        NewRequest {
            id: Uuid::now_v7(),
            namespace: "default".into(),
            route: "openai.chat".into(),
            backend: "mock".into(),
            model: Some("m".into()),
            stream: false,
            body: format!("{{\"n\":{i}}}").into_bytes(),
            headers: vec![("openai-beta".into(), "x".into())],
            hash,
            claim: ClaimKind::BodyHash,
            claim_key: hex::encode(hash),
            claim_expires_at: now + 600_000,
            now,
        }
    }

    #[tokio::test]
    async fn created_record_matches_the_row_lease_many_takes_each_due_request_once_and_one_commit_fences_each_batch_lc2_lc3()
     {
        let dir = tempfile::tempdir().expect("tempdir");
        let url = format!("sqlite://{}", dir.path().join("t.db").display());
        let store = SqliteStore::open(&url, SqliteSynchronous::Normal)
            .await
            .expect("open");
        let now = 1_000_000;
        let mut ids = Vec::new();
        for i in 0..3 {
            let Submitted::Created(created) = store
                .submit(new_request(i, now + i64::from(i)))
                .await
                .expect("submit")
            else {
                panic!("expected a new request");
            };
            let stored = store
                .get("default", created.id)
                .await
                .expect("get")
                .expect("stored");
            assert_eq!(format!("{created:?}"), format!("{stored:?}"));
            ids.push(created.id);
        }

        let first = store
            .lease_many("node/a", now + 10, 30_000, 2)
            .await
            .expect("lease");
        assert_eq!(
            first.iter().map(|(l, _)| l.id).collect::<Vec<_>>(),
            ids[..2].to_vec(),
            "oldest first"
        );
        assert_ne!(first[0].0.owner, first[1].0.owner);
        for (lease, record) in &first {
            assert_eq!(record.status, Status::Running);
            assert_eq!((lease.attempt, record.attempts), (1, 1));
            assert!(store.heartbeat(lease, now + 20, 30_000).await.expect("hb"));
        }
        let rest = store
            .lease_many("node/b", now + 10, 30_000, 10)
            .await
            .expect("lease");
        assert_eq!(rest.len(), 1);
        assert_eq!(rest[0].0.id, ids[2]);
        assert!(
            store
                .lease_many("node/c", now + 10, 30_000, 10)
                .await
                .expect("lease")
                .is_empty()
        );

        // One commit: two fenced batches and one whose lease is not held (LC-3).
        let chunk = |d: &str| NewChunk {
            event: None,
            data: d.into(),
        };
        let mut stale = first[1].0.clone();
        stale.owner.push_str("-lost");
        let batches = vec![
            ChunkBatch {
                lease: first[0].0.clone(),
                chunks: vec![chunk("a1"), chunk("a2")],
                upstream_request_id: Some("req-a".into()),
            },
            ChunkBatch {
                lease: stale,
                chunks: vec![chunk("x")],
                upstream_request_id: None,
            },
            ChunkBatch {
                lease: rest[0].0.clone(),
                chunks: vec![chunk("c1")],
                upstream_request_id: None,
            },
        ];
        let stored = store.append_chunks(&batches).await.expect("append");
        let seqs = |r: &Option<Vec<Chunk>>| {
            r.as_ref().map(|c| {
                c.iter()
                    .map(|c| (c.seq, c.data.clone()))
                    .collect::<Vec<_>>()
            })
        };
        assert_eq!(
            seqs(&stored[0]),
            Some(vec![(1, "a1".into()), (2, "a2".into())])
        );
        assert_eq!(seqs(&stored[1]), None);
        assert_eq!(seqs(&stored[2]), Some(vec![(1, "c1".into())]));
        let again = store.append_chunks(&batches[..1]).await.expect("append");
        assert_eq!(
            seqs(&again[0]),
            Some(vec![(3, "a1".into()), (4, "a2".into())])
        );
        let a = store.get("default", ids[0]).await.expect("get").expect("a");
        assert_eq!(
            (a.last_seq, a.upstream_request_id.as_deref()),
            (4, Some("req-a"))
        );
        let b = store.get("default", ids[1]).await.expect("get").expect("b");
        assert_eq!(b.last_seq, 0);
        let read = store.chunks_after(ids[0], 0, 10).await.expect("chunks");
        assert_eq!(
            read.iter().map(|c| c.seq).collect::<Vec<_>>(),
            vec![1, 2, 3, 4]
        );
    }
}
