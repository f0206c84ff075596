//! The statements and the `*_in` functions that run them (submit, finish, append chunks,
//! settle, fail, release claims), and the reading of rows.

use std::borrow::Cow;
use std::sync::Arc;

use sqlx::postgres::{PgConnection, PgRow};
use sqlx::{Postgres, Row, Transaction};
use uuid::Uuid;

use super::{IDS_PER_NOTIFY, PostgresStore};
use crate::store::row::tokens_of;
use crate::store::row::{RawRecord, RawState};
use crate::store::rules::{self, Settle, failure_releases_claim};
use crate::store::{
    Chunk, ChunkBatch, ChunkKind, ClaimKind, ErrorInfo, Lease, Millis, NewRequest, Outcome,
    RequestRecord, Status, StoreError, Submitted, Usage,
};

impl PostgresStore {
    pub(super) async fn fetch_in(
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

pub(super) fn corrupt(what: impl std::fmt::Display) -> StoreError {
    StoreError::corrupt(None, what)
}

/// `s` as PostgreSQL `TEXT` can hold it: NUL becomes U+FFFD (see the module notes).
pub(super) fn text(s: &str) -> Cow<'_, str> {
    if s.contains('\0') {
        Cow::Owned(s.replace('\0', "\u{FFFD}"))
    } else {
        Cow::Borrowed(s)
    }
}

/// A shared text as PostgreSQL stores it ([`text`]): the same one, unless it holds a NUL.
fn stored_text(s: &Arc<str>) -> Arc<str> {
    match text(s) {
        Cow::Borrowed(_) => Arc::clone(s),
        Cow::Owned(replaced) => replaced.into(),
    }
}

pub(super) fn opt_text(s: Option<&str>) -> Option<Cow<'_, str>> {
    s.map(text)
}

pub(super) fn count(n: i32, what: &str) -> Result<u32, StoreError> {
    u32::try_from(n).map_err(|_| corrupt(format!("{what} {n}")))
}

/// A token count column by name.
fn tokens(row: &PgRow, name: &str) -> Result<Option<u64>, StoreError> {
    Ok(row
        .try_get::<Option<i64>, _>(name)?
        .and_then(|v| u64::try_from(v).ok()))
}

/// Reads a [`RequestRecord`] from `row` by column name (checks in [`RawRecord::into_record`]).
pub(super) fn record_from_row(row: &PgRow) -> Result<RequestRecord, StoreError> {
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
        created_at: row.try_get("created_at")?,
        trace_parent: row.try_get("trace_parent")?,
        replay_of: row.try_get("replay_of")?,
        state: RawState {
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
                cache_write_1h_tokens: tokens(row, "usage_cache_write_1h_tokens")?,
            },
        },
    }
    .into_record()
}

pub(super) fn chunk_from_row(row: &PgRow) -> Result<Chunk, StoreError> {
    let kind: String = row.try_get("kind")?;
    Ok(Chunk {
        seq: row.try_get("seq")?,
        attempt: count(row.try_get("attempt")?, "chunk attempt")?,
        kind: ChunkKind::parse(&kind).ok_or_else(|| corrupt(format!("chunk kind {kind:?}")))?,
        event: row
            .try_get::<Option<&str>, _>("event")?
            .map(std::sync::Arc::from),
        data: row.try_get::<&str, _>("data")?.into(),
    })
}

pub(super) fn attempt_number(attempt: u32) -> Result<i32, StoreError> {
    i32::try_from(attempt).map_err(|_| corrupt(format!("attempt {attempt}")))
}

/// [`Store::submit_and_lease`] on `conn`: `owner` and `expires_at` are the lease to take on a
/// request it creates, `headers` the request's headers as stored.
pub(super) async fn submit_in(
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
            .bind(new.callback_url.as_deref())
            .bind(new.trace_parent.as_deref())
            .bind(new.replay_of)
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
pub(super) async fn finish_in(
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
                .bind(&*lease.owner)
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
                .bind(u[5])
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
            .bind(&*lease.owner)
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
                .bind(&*lease.owner)
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
                .bind(u[5])
                .bind(rules::released_claim_expiry(now))
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
/// claim expiry, `$16` origin, `$17` callback URL or NULL (CB-1), `$18` trace context or NULL
/// (OT-2), `$19` the request it replays or NULL (EX-8). No row: a live claim stood.
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
                     AND NOT EXISTS (SELECT 1 FROM requests
                                     WHERE requests.id = claims.request_id
                                         AND requests.finished_at IS NULL)
                 RETURNING request_id),
             created AS (
                 INSERT INTO requests (id, namespace, route, backend, model, stream, body, headers,
                     hash, claim_kind, status, attempts, lease_owner, lease_expires_at,
                     next_retry_at, created_at, updated_at, trace_parent, replay_of)
                 SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, $10,
                     CASE WHEN $12::text IS NULL THEN 'pending' ELSE 'running' END,
                     CASE WHEN $12::text IS NULL THEN 0 ELSE 1 END, $12, $13, $11, $11, $11, $18,
                     $19::uuid
                 FROM claimed WHERE request_id = $1
                 RETURNING ",
            request_columns!(),
            "),
             called AS (
                 INSERT INTO callbacks (request_id, namespace, url, updated_at)
                 SELECT id, namespace, $17, $11 FROM created WHERE $17::text IS NOT NULL)
             SELECT ",
            request_columns!(),
            $notify,
            " FROM created"
        )
    };
}

/// [`submit_sql!`] for many submissions, one per claim, each element of the arrays one
/// submission (the parameters of [`submit_sql!`] in the same order, `$16` the origin, `$17`
/// the callback URLs, `$18` the trace contexts, `$19` the requests replayed). Each
/// claim's takeover is checked against its own submission's time. Returns the records it
/// created; a submission missing from them found a live claim.
pub(super) const SUBMIT_MANY: &str = concat!(
    "WITH s AS (
         SELECT * FROM UNNEST($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[],
             $6::bool[], $7::bytea[], $8::text[], $9::bytea[], $10::text[], $11::bigint[],
             $12::text[], $13::bigint[], $14::text[], $15::bigint[], $17::text[],
             $18::text[], $19::uuid[])
         WITH ORDINALITY
         AS s(s_id, s_namespace, s_route, s_backend, s_model, s_stream, s_body, s_headers,
             s_hash, s_kind, s_now, s_owner, s_expires, s_claim_key, s_claim_expires,
             s_callback, s_trace_parent, s_replay_of, s_ord)),
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
             AND NOT EXISTS (SELECT 1 FROM requests
                             WHERE requests.id = claims.request_id
                                 AND requests.finished_at IS NULL)
         RETURNING request_id),
     created AS (
         INSERT INTO requests (id, namespace, route, backend, model, stream, body, headers,
             hash, claim_kind, status, attempts, lease_owner, lease_expires_at,
             next_retry_at, created_at, updated_at, trace_parent, replay_of)
         SELECT s_id, s_namespace, s_route, s_backend, s_model, s_stream, s_body, s_headers,
             s_hash, s_kind, CASE WHEN s_owner IS NULL THEN 'pending' ELSE 'running' END,
             CASE WHEN s_owner IS NULL THEN 0 ELSE 1 END, s_owner, s_expires, s_now, s_now,
             s_now, s_trace_parent, s_replay_of
         FROM s JOIN claimed ON claimed.request_id = s_id
         RETURNING ",
    request_columns!(),
    "),
     called AS (
         INSERT INTO callbacks (request_id, namespace, url, updated_at)
         SELECT s_id, s_namespace, s_callback, s_now FROM s JOIN created ON created.id = s_id
         WHERE s_callback IS NOT NULL),
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
     $u0:literal, $u1:literal, $u2:literal, $u3:literal, $u4:literal, $u5:literal) => {
        concat!(
            "used AS (
                 INSERT INTO attempt_usage (request_id, attempt, input_tokens, output_tokens,
                     cached_input_tokens, cache_write_tokens, reasoning_tokens,
                     cache_write_1h_tokens)
                 SELECT id, ", $attempt, ", ", $u0, ", ", $u1, ", ", $u2, ", ", $u3, ", ", $u4,
            ", ", $u5, " FROM done WHERE ", $flag,
            " ON CONFLICT (request_id, attempt) DO UPDATE SET
                     input_tokens = EXCLUDED.input_tokens, output_tokens = EXCLUDED.output_tokens,
                     cached_input_tokens = EXCLUDED.cached_input_tokens,
                     cache_write_tokens = EXCLUDED.cache_write_tokens,
                     reasoning_tokens = EXCLUDED.reasoning_tokens,
                     cache_write_1h_tokens = EXCLUDED.cache_write_1h_tokens)"
        )
    };
}

/// `finish_read` of [`Outcome::Succeeded`]: `$1` status, `$2` body, `$3` upstream request id,
/// `$4` now, `$5` id, `$6` owner, `$7`..`$11` usage, `$12` usage reported, `$13` attempt, `$14`
/// response id or NULL, `$15` end chunk data, `$16` changed payload, `$17` the one-hour cache
/// writes of the usage (RD-10). A success releases no claim (ID-6).
const FINISH_SUCCEEDED: &str = concat!(
    "WITH done AS (
         UPDATE requests SET status = 'succeeded', response_status = $1,
             response_body = $2, upstream_request_id = $3, error_type = NULL,
             error_message = NULL, error_status = NULL, lease_owner = NULL,
             lease_expires_at = NULL, finished_at = $4, updated_at = $4,
             last_seq = last_seq + 1, ",
    usage_assignments!("$7", "$8", "$9", "$10", "$11", "$17"),
    " WHERE id = $5 AND lease_owner = $6 AND status = 'running'
         RETURNING ",
    request_columns!(),
    "), ",
    finish_usage_cte!("$12", "$13", "$7", "$8", "$9", "$10", "$11", "$17"),
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
/// origin, `$17` ids per notification, `$18` the one-hour cache writes of the usage (RD-10).
/// Returns the record of each request whose lease held, with its `f_owner`.
pub(super) const FINISH_SUCCEEDED_MANY: &str = concat!(
    "WITH f AS (
         SELECT * FROM UNNEST($1::uuid[], $2::text[], $3::int[], $4::bytea[], $5::text[],
             $6::bigint[], $7::bigint[], $8::bigint[], $9::bigint[], $10::bigint[],
             $11::bigint[], $12::bool[], $13::int[], $14::text[], $18::bigint[])
         AS f(f_id, f_owner, f_status, f_body, f_upstream, f_now, f_u0, f_u1, f_u2, f_u3,
             f_u4, f_reported, f_attempt, f_response_id, f_u5)),
     done AS (
         UPDATE requests SET status = 'succeeded', response_status = f_status,
             response_body = f_body, upstream_request_id = f_upstream, error_type = NULL,
             error_message = NULL, error_status = NULL, lease_owner = NULL,
             lease_expires_at = NULL, finished_at = f_now, updated_at = f_now,
             last_seq = last_seq + 1, ",
    usage_assignments!("f_u0", "f_u1", "f_u2", "f_u3", "f_u4", "f_u5"),
    " FROM f WHERE id = f_id AND lease_owner = f_owner AND status = 'running'
         RETURNING ",
    request_columns!(),
    ", f_owner, f_reported, f_attempt, f_response_id, f_u0, f_u1, f_u2, f_u3, f_u4, f_u5),
     used AS (
         INSERT INTO attempt_usage (request_id, attempt, input_tokens, output_tokens,
             cached_input_tokens, cache_write_tokens, reasoning_tokens, cache_write_1h_tokens)
         SELECT id, f_attempt, f_u0, f_u1, f_u2, f_u3, f_u4, f_u5 FROM done WHERE f_reported
         ON CONFLICT (request_id, attempt) DO UPDATE SET
             input_tokens = EXCLUDED.input_tokens, output_tokens = EXCLUDED.output_tokens,
             cached_input_tokens = EXCLUDED.cached_input_tokens,
             cache_write_tokens = EXCLUDED.cache_write_tokens,
             reasoning_tokens = EXCLUDED.reasoning_tokens,
             cache_write_1h_tokens = EXCLUDED.cache_write_1h_tokens),
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
/// changed payload, `$21` the one-hour cache writes of the usage (RD-10), `$22` the expiry a
/// released claim takes ([`rules::released_claim_expiry`], ID-6a).
const FINISH_FAILED: &str = concat!(
    "WITH done AS (
         UPDATE requests SET status = 'failed', error_type = $1, error_message = $2,
             error_status = $3, response_status = $4, response_body = $5,
             upstream_request_id = $6, lease_owner = NULL, lease_expires_at = NULL,
             finished_at = $7, updated_at = $7, last_seq = last_seq + 1, ",
    usage_assignments!("$10", "$11", "$12", "$13", "$14", "$21"),
    " WHERE id = $8 AND lease_owner = $9 AND status = 'running'
         RETURNING ",
    request_columns!(),
    "), ",
    finish_usage_cte!("$15", "$16", "$10", "$11", "$12", "$13", "$14", "$21"),
    ",
     released AS (
         UPDATE claims SET expires_at = LEAST(expires_at, $22) WHERE request_id = $8
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
pub(super) struct AppendPlan {
    /// Per group: request id, lease owner, chunks in it, upstream request id to record, the
    /// seq its first chunk follows.
    pub(super) ids: Vec<Uuid>,
    owners: Vec<String>,
    counts: Vec<i64>,
    upstream_request_ids: Vec<Option<String>>,
    pub(super) afters: Vec<i64>,
    /// Per chunk: its group, its 1-based position in the group, attempt, event, data.
    chunk_groups: Vec<i32>,
    chunk_pos: Vec<i64>,
    chunk_attempts: Vec<i32>,
    /// The texts as stored: the chunk's own, shared, unless a NUL had to be replaced
    /// (decision 136).
    pub(super) events: Vec<Option<Arc<str>>>,
    pub(super) data: Vec<Arc<str>>,
    /// Per group that reported usage (the last report of the commit wins).
    usage_groups: Vec<i32>,
    usage_attempts: Vec<i32>,
    usage_tokens: [Vec<Option<i64>>; 6],
    /// Per response id (the first of the commit wins).
    response_groups: Vec<i32>,
    response_attempts: Vec<i32>,
    response_ids: Vec<String>,
}

impl AppendPlan {
    /// Adds `batch` to its attempt's group (made on first sight) and returns the group, or
    /// `None` when the batch does not follow the group's last chunk (it is then left out: not
    /// written, answered as fenced). Batches must come sorted by (request id, owner).
    pub(super) fn add(&mut self, batch: &ChunkBatch) -> Result<Option<usize>, StoreError> {
        let lease = &batch.lease;
        // Batches come sorted by (id, owner): an attempt's group, if any, is the last one.
        let last = self.ids.len().checked_sub(1);
        let group =
            match last.filter(|&g| self.ids[g] == lease.id && *self.owners[g] == *lease.owner) {
                Some(g) if self.afters[g] + self.counts[g] == batch.after => g,
                Some(_) => return Ok(None),
                None => {
                    self.ids.push(lease.id);
                    self.owners.push(lease.owner.to_string());
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
            self.events.push(chunk.event.as_ref().map(stored_text));
            self.data.push(stored_text(&chunk.data));
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
pub(super) async fn append_in(
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
        .bind(plan.events.iter().map(Option::as_deref).collect::<Vec<_>>())
        .bind(plan.data.iter().map(AsRef::as_ref).collect::<Vec<&str>>())
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
        .bind(&plan.usage_tokens[5])
        .fetch_all(&mut *conn)
        .await?;
    rows.iter().map(|row| Ok(row.try_get("grp")?)).collect()
}

/// `append_chunks` as one statement over [`AppendPlan`]'s arrays. Each group's `UPDATE` is
/// fenced on its lease (LC-3) and on the seq it follows (`$22`), and reserves its seqs;
/// `$23` holds the one-hour cache writes of each usage (RD-10);
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
             cached_input_tokens, cache_write_tokens, reasoning_tokens, cache_write_1h_tokens)
         SELECT upd.id, u.attempt, u.i, u.o, u.ci, u.cw, u.r, u.cw1h
         FROM UNNEST($10::int[], $11::int[], $12::bigint[], $13::bigint[], $14::bigint[],
                     $15::bigint[], $16::bigint[], $23::bigint[])
             AS u(grp, attempt, i, o, ci, cw, r, cw1h)
         JOIN upd ON upd.grp = u.grp
         ON CONFLICT (request_id, attempt) DO UPDATE SET
             input_tokens = EXCLUDED.input_tokens, output_tokens = EXCLUDED.output_tokens,
             cached_input_tokens = EXCLUDED.cached_input_tokens,
             cache_write_tokens = EXCLUDED.cache_write_tokens,
             reasoning_tokens = EXCLUDED.reasoning_tokens,
             cache_write_1h_tokens = EXCLUDED.cache_write_1h_tokens),
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
/// ([`expire_claims_in_order`]) when this answers `true` ([`rules::settle`]).
pub(super) async fn fail_abandoned_in(
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
    settle_in(tx, id, attempts, &settle, None, now).await?;
    Ok(release)
}

/// Locks the claims of requests `ids` in the global claim order (namespace and key in byte
/// order, `COLLATE "C"`, Rust's `String` order, as the writer's [`LockKey`] sorts submissions)
/// and deletes them (`until` `None`: their requests are pruned) or lets them expire at `until`
/// where they would live longer (a failure, ID-6a). A claim taken over meanwhile no longer
/// names its request and is left alone.
async fn claims_in_order(
    tx: &mut Transaction<'_, Postgres>,
    ids: &[Uuid],
    until: Option<Millis>,
) -> Result<(), StoreError> {
    if ids.is_empty() {
        return Ok(());
    }
    macro_rules! in_order {
        ($write:literal) => {
            concat!(
                "WITH locked AS MATERIALIZED (
                     SELECT namespace, claim_key FROM claims WHERE request_id = ANY($1)
                     ORDER BY namespace COLLATE \"C\", claim_key COLLATE \"C\"
                     FOR UPDATE) ",
                $write,
                " WHERE c.namespace = l.namespace AND c.claim_key = l.claim_key
                   AND c.request_id = ANY($1)"
            )
        };
    }
    let query = match until {
        None => sqlx::query(in_order!("DELETE FROM claims c USING locked l")).bind(ids),
        Some(until) => sqlx::query(in_order!(
            "UPDATE claims c SET expires_at = LEAST(c.expires_at, $2) FROM locked l"
        ))
        .bind(ids)
        .bind(until),
    };
    query.execute(&mut **tx).await?;
    Ok(())
}

/// Deletes the claims of requests `ids`, which are pruned ([`claims_in_order`]).
pub(super) async fn release_claims_in_order(
    tx: &mut Transaction<'_, Postgres>,
    ids: &[Uuid],
) -> Result<(), StoreError> {
    claims_in_order(tx, ids, None).await
}

/// Releases the claims of requests `ids`, whose failures are recorded at `now`: each expires a
/// minute on, or sooner where its own window ends sooner (ID-6, ID-6a; [`claims_in_order`]).
pub(super) async fn expire_claims_in_order(
    tx: &mut Transaction<'_, Postgres>,
    ids: &[Uuid],
    now: Millis,
) -> Result<(), StoreError> {
    claims_in_order(tx, ids, Some(rules::released_claim_expiry(now))).await
}

/// The rest of a write that made request `id` terminal at `now` ([`rules::settle`]): its claims
/// released if the rule says so (ID-6a), and its `end` chunk — at `end_seq` when the seq is
/// already reserved, else after the last seq.
pub(super) async fn settle_in(
    tx: &mut Transaction<'_, Postgres>,
    id: Uuid,
    attempt: i32,
    settle: &Settle,
    end_seq: Option<i64>,
    now: Millis,
) -> Result<(), StoreError> {
    if settle.release_claim {
        expire_claims_in_order(tx, &[id], now).await?;
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

/// A usage row's six token columns from `at` on (input, output, cached input, cache write,
/// reasoning, one-hour cache write).
pub(super) fn usage_from_row(row: &PgRow, at: usize) -> Result<Usage, StoreError> {
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
        cache_write_1h_tokens: n(5)?,
    })
}

/// `Store::usage`'s statement around its group key (as the SQLite adapter's; sums are cast to
/// BIGINT, since PostgreSQL sums BIGINT as NUMERIC).
pub(super) const USAGE_SQL_TAIL: &str = " AS key, r.backend, r.model,
        COUNT(*)::bigint, SUM(r.attempts)::bigint, SUM(1 + r.attached + r.replayed)::bigint,
        SUM(r.attached)::bigint, SUM(r.replayed)::bigint, SUM(r.saved)::bigint,
        SUM(u.input_tokens)::bigint, SUM(u.output_tokens)::bigint,
        SUM(u.cached_input_tokens)::bigint, SUM(u.cache_write_tokens)::bigint,
        SUM(u.reasoning_tokens)::bigint, SUM(u.cache_write_1h_tokens)::bigint,
        SUM(r.saved * a.input_tokens)::bigint, SUM(r.saved * a.output_tokens)::bigint,
        SUM(r.saved * a.cached_input_tokens)::bigint,
        SUM(r.saved * a.cache_write_tokens)::bigint, SUM(r.saved * a.reasoning_tokens)::bigint,
        SUM(r.saved * a.cache_write_1h_tokens)::bigint,
        (r.created_at / $4::bigint) * $4::bigint AS bucket,
        SUM(CASE WHEN r.status = 'succeeded' AND u.request_id IS NULL THEN 1 ELSE 0 END)::bigint
    FROM (SELECT *, GREATEST(1 + attached + replayed - GREATEST(attempts, 1), 0) AS saved
          FROM requests) r
    LEFT JOIN (SELECT request_id, SUM(input_tokens) AS input_tokens,
                   SUM(output_tokens) AS output_tokens,
                   SUM(cached_input_tokens) AS cached_input_tokens,
                   SUM(cache_write_tokens) AS cache_write_tokens,
                   SUM(reasoning_tokens) AS reasoning_tokens,
                   SUM(cache_write_1h_tokens) AS cache_write_1h_tokens
               FROM attempt_usage GROUP BY request_id) u ON u.request_id = r.id
    LEFT JOIN attempt_usage a ON a.request_id = r.id AND a.attempt = r.attempts
    WHERE ($1::text IS NULL OR r.namespace = $1) AND r.created_at >= $2 AND r.created_at < $3
    GROUP BY 1, r.backend, r.model, 22
    ORDER BY 22, 1, r.backend, r.model";

/// `claim_kind` of request `id` as stored.
pub(super) fn claim_of(id: Uuid, s: &str) -> Result<ClaimKind, StoreError> {
    ClaimKind::parse(s).ok_or_else(|| StoreError::corrupt(Some(id), format!("claim_kind {s:?}")))
}

/// Appends one control chunk (`reset` or `end`) after the request's last seq; a `reset` also
/// moves `reset_seq` (LC-8, RD-5, RD-6). One statement; the `UPDATE` locks the request row, so
/// concurrent appends to one request serialise on it. Returns the chunk's seq.
pub(super) async fn append_control(
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
