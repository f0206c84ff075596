//! The statements and the `*_in` functions that run inside the writer's transaction (submit,
//! lease, finish, sweep, cancel, release, prune, append chunks), and the reading of rows.

use rusqlite::{Connection, OptionalExtension, Row, params};
use uuid::Uuid;

use super::held::Tx;
use crate::store::row::tokens_of;
use crate::store::row::{RawRecord, RawState, State, col, error_of};
use crate::store::rules::{self, Expired};
use crate::store::{
    Chunk, ChunkBatch, ChunkKind, ClaimKind, ErrorInfo, Lease, LeaseQuota, LeaseTo, Millis,
    NewRequest, Outcome, RequestRecord, Status, StoreError, Usage,
};

pub(super) fn corrupt(what: impl std::fmt::Display) -> StoreError {
    StoreError::corrupt(None, what)
}

/// Reads a [`RequestRecord`] from `row`, whose columns from `at` on are `request_columns!()`
/// (positions in [`col`], checks in [`RawRecord::into_record`]).
pub(super) fn record_from_row(row: &Row<'_>, at: usize) -> Result<RequestRecord, StoreError> {
    let id: String = row.get(at + col::ID)?;
    RawRecord {
        id: parse_id(&id)?,
        namespace: row.get(at + col::NAMESPACE)?,
        route: row.get(at + col::ROUTE)?,
        backend: row.get(at + col::BACKEND)?,
        model: row.get(at + col::MODEL)?,
        stream: row.get::<_, i64>(at + col::STREAM)? != 0,
        body: row.get(at + col::BODY)?,
        headers: row.get(at + col::HEADERS)?,
        claim_kind: row.get(at + col::CLAIM_KIND)?,
        created_at: row.get(at + col::CREATED_AT)?,
        trace_parent: row.get(at + col::TRACE_PARENT)?,
        replay_of: row
            .get::<_, Option<String>>(at + col::REPLAY_OF)?
            .as_deref()
            .map(parse_id)
            .transpose()?,
        state: state_from_row(row, at + col::STATE)?,
    }
    .into_record()
}

/// Reads a request's [`RawState`] from `row`, whose columns from `at` on are `state_columns!()`
/// (positions in [`col::state`]).
fn state_from_row(row: &Row<'_>, at: usize) -> Result<RawState, StoreError> {
    use col::state as c;
    Ok(RawState {
        status: row.get(at + c::STATUS)?,
        attempts: row.get(at + c::ATTEMPTS)?,
        recoveries: row.get(at + c::RECOVERIES)?,
        next_retry_at: row.get(at + c::NEXT_RETRY_AT)?,
        error_type: row.get(at + c::ERROR_TYPE)?,
        error_message: row.get(at + c::ERROR_MESSAGE)?,
        error_status: row.get(at + c::ERROR_STATUS)?,
        response_status: row.get(at + c::RESPONSE_STATUS)?,
        response_body: row.get(at + c::RESPONSE_BODY)?,
        upstream_request_id: row.get(at + c::UPSTREAM_REQUEST_ID)?,
        last_seq: row.get(at + c::LAST_SEQ)?,
        reset_seq: row.get(at + c::RESET_SEQ)?,
        updated_at: row.get(at + c::UPDATED_AT)?,
        finished_at: row.get(at + c::FINISHED_AT)?,
        attached: row.get(at + c::ATTACHED)?,
        replayed: row.get(at + c::REPLAYED)?,
        log_reads: row.get(at + c::LOG_READS)?,
        usage: usage_from_row(row, at + c::USAGE)?,
    })
}

const FETCH_SQL: &str = concat!(
    "SELECT ",
    request_columns!(),
    record_tables!(),
    " WHERE id = ?1"
);

/// Reads request `id`, any namespace.
pub(super) fn fetch(conn: &Connection, id: &str) -> Result<Option<RequestRecord>, StoreError> {
    record_by(conn, FETCH_SQL, id)
}

/// Request `id` as `sql` reads it (a `SELECT` of the record's columns by `id = ?1`).
fn record_by(conn: &Connection, sql: &str, id: &str) -> Result<Option<RequestRecord>, StoreError> {
    let mut stmt = conn.prepare_cached(sql)?;
    let mut rows = stmt.query(params![id])?;
    match rows.next()? {
        Some(row) => Ok(Some(record_from_row(row, 0)?)),
        None => Ok(None),
    }
}

const PEEK_SQL: &str = concat!(
    "SELECT ",
    peek_columns!("X''"),
    " FROM requests WHERE id = ?1"
);

/// Reads request `id` for a waiter's re-read, any namespace ([`Store::peek`]): the `requests`
/// row alone, not its body's.
///
/// [`Store::peek`]: crate::store::Store::peek
pub(super) fn peek(conn: &Connection, id: &str) -> Result<Option<RequestRecord>, StoreError> {
    record_by(conn, PEEK_SQL, id)
}

/// Releases the claims pointing at `id`, whose failure is recorded at `now`: each expires a
/// minute on, or sooner where its own window ends sooner (ID-6, ID-6a). Until then an
/// identical send attaches to the failure; after, [`CLAIM_SQL`] takes the claim over.
fn release_claims(conn: &Tx<'_>, id: &str, now: Millis) -> Result<(), StoreError> {
    conn.prepare_held("UPDATE claims SET expires_at = MIN(expires_at, ?2) WHERE request_id = ?1")?
        .execute(params![id, rules::released_claim_expiry(now)])?;
    Ok(())
}

/// The `end` chunk of request `id` as its row gives it, `None` while the request is not
/// terminal or when there is no such request (decision 134: on SQLite the terminal write
/// reserves the `end` chunk's seq and stores no row for it; a database written before stores
/// one, which its readers find first).
pub(super) fn end_of(conn: &Connection, id: &str) -> Result<Option<Chunk>, StoreError> {
    type Row = (
        String,
        i64,
        i64,
        Option<String>,
        Option<String>,
        Option<i64>,
    );
    let row: Option<Row> = conn
        .prepare_cached(
            "SELECT status, attempts, last_seq, error_type, error_message, error_status
             FROM requests WHERE id = ?1",
        )?
        .query_row(params![id], |r| {
            Ok((
                r.get(0)?,
                r.get(1)?,
                r.get(2)?,
                r.get(3)?,
                r.get(4)?,
                r.get(5)?,
            ))
        })
        .optional()?;
    let Some((status, attempts, last_seq, error_type, message, error_status)) = row else {
        return Ok(None);
    };
    let bad = |what: String| StoreError::corrupt(parse_id(id).ok(), what);
    let status = Status::parse(&status).ok_or_else(|| bad(format!("status {status:?}")))?;
    let attempts = u32::try_from(attempts).map_err(|_| bad(format!("attempts {attempts}")))?;
    let error = error_of(error_type, message, error_status).map_err(bad)?;
    Ok(rules::end_chunk_of(
        status,
        error.as_ref(),
        attempts,
        last_seq,
    ))
}

/// Appends a `reset` chunk after the request's last seq and moves `reset_seq` to it (LC-8,
/// RD-6). The only control chunk stored as a row: the `end` is read from the request's row
/// (decision 134).
fn append_reset(conn: &Tx<'_>, id: &str, attempt: i64, data: &str) -> Result<(), StoreError> {
    let seq: i64 = conn
        .prepare_held(
            "UPDATE requests SET last_seq = last_seq + 1, reset_seq = last_seq + 1
             WHERE id = ?1
             RETURNING last_seq",
        )?
        .query_row(params![id], |r| r.get(0))?;
    conn.prepare_held(INSERT_RESET_SQL)?
        .execute(params![id, seq, attempt, data])?;
    Ok(())
}

const INSERT_RESET_SQL: &str = "INSERT INTO chunks (request_id, seq, attempt, kind, event, data)
     VALUES (?1, ?2, ?3, 'reset', NULL, ?4)";

/// The most chunks one row of `chunks` holds (decision 123): a stream's batch is stored as rows
/// of up to this many. Readers that start inside a row look back at most this far.
pub(super) const ROW_CHUNKS_MAX: usize = 64;

/// Reads a row of `chunks` (`seq, count, attempt, kind, event, data`) and appends to `out` the
/// chunks it holds after seq `after`: one, or those a packed row holds (decision 123).
pub(super) fn chunks_from_row(
    row: &Row<'_>,
    after: i64,
    out: &mut Vec<Chunk>,
) -> Result<(), StoreError> {
    let seq: i64 = row.get(0)?;
    let count: i64 = row.get(1)?;
    let attempt = u32::try_from(row.get::<_, i64>(2)?).map_err(corrupt)?;
    let kind: String = row.get(3)?;
    let kind = ChunkKind::parse(&kind).ok_or_else(|| corrupt(format!("chunk kind {kind:?}")))?;
    if count == 1 {
        if seq > after {
            out.push(Chunk {
                seq,
                attempt,
                kind,
                event: row.get(4)?,
                data: row.get(5)?,
            });
        }
        return Ok(());
    }
    let packed = row.get_ref(5)?.as_str().map_err(corrupt)?;
    let mut rest = packed;
    for seq in seq..seq + count {
        let (event, data, tail) = unpack_one(rest)
            .ok_or_else(|| corrupt(format!("chunk {seq}: a packed row that does not parse")))?;
        rest = tail;
        if seq > after {
            out.push(Chunk {
                seq,
                attempt,
                kind,
                event: event.map(std::sync::Arc::from),
                data: data.into(),
            });
        }
    }
    if !rest.is_empty() {
        return Err(corrupt(format!(
            "chunk {seq}: a packed row longer than its count"
        )));
    }
    Ok(())
}

/// The `data` of a row holding several chunks (decision 123): each as `<event length or
/// ->:<data length>:`, then the event's bytes and the data's. Lengths are in bytes; the text
/// stays the chunks' own, so the row reads as what it holds.
pub(super) fn pack(chunks: &[Chunk]) -> String {
    let mut packed = String::with_capacity(chunks.iter().map(|c| c.data.len() + 16).sum::<usize>());
    let mut length = itoa::Buffer::new();
    for chunk in chunks {
        match &chunk.event {
            Some(event) => {
                packed.push_str(length.format(event.len()));
                packed.push(':');
                packed.push_str(length.format(chunk.data.len()));
                packed.push(':');
                packed.push_str(event);
            }
            None => {
                packed.push_str("-:");
                packed.push_str(length.format(chunk.data.len()));
                packed.push(':');
            }
        }
        packed.push_str(&chunk.data);
    }
    packed
}

/// A request id as the `requests` and `chunks` tables hold it (hyphenated, lower case: `Uuid`'s
/// `Display`), written into a buffer of its own without `fmt`, on the writer's path.
struct IdText([u8; uuid::fmt::Hyphenated::LENGTH]);

impl Default for IdText {
    fn default() -> IdText {
        IdText([0; uuid::fmt::Hyphenated::LENGTH])
    }
}

impl IdText {
    /// `id` as stored.
    fn of(&mut self, id: &Uuid) -> &str {
        id.hyphenated().encode_lower(&mut self.0)
    }
}

/// The first chunk of a packed row's `data`: its event, its data and what follows; `None` when
/// it does not parse.
fn unpack_one(packed: &str) -> Option<(Option<&str>, &str, &str)> {
    let (event_len, rest) = packed.split_once(':')?;
    let (data_len, rest) = rest.split_once(':')?;
    let data_len: usize = data_len.parse().ok()?;
    let (event, rest) = if event_len == "-" {
        (None, rest)
    } else {
        let event_len: usize = event_len.parse().ok()?;
        (Some(rest.get(..event_len)?), rest.get(event_len..)?)
    };
    Some((event, rest.get(..data_len)?, rest.get(data_len..)?))
}

pub(super) fn parse_id(s: &str) -> Result<Uuid, StoreError> {
    Uuid::parse_str(s).map_err(|e| corrupt(format!("id {s:?}: {e}")))
}

/// Inserts a claim, takes over an expired one, or leaves a live one untouched (ID-7). A claim
/// whose request has not finished lives past its expiry (ID-4): an SDK's retry after a timeout
/// while the call still runs attaches to it rather than paying for a second call.
const CLAIM_SQL: &str =
    "INSERT INTO claims (namespace, claim_key, kind, request_id, fingerprint, expires_at)
     VALUES (?1, ?2, ?3, ?4, ?5, ?6)
     ON CONFLICT (namespace, claim_key) DO UPDATE SET
         kind = excluded.kind, request_id = excluded.request_id,
         fingerprint = excluded.fingerprint, expires_at = excluded.expires_at
     WHERE claims.expires_at <= ?7
         AND NOT EXISTS (SELECT 1 FROM requests
                         WHERE requests.id = claims.request_id AND requests.finished_at IS NULL)";

/// Inserts a request, pending, or running its first attempt when `?10` (the lease owner) is set.
const INSERT_REQUEST_SQL: &str =
    "INSERT INTO requests (id, namespace, route, backend, model, stream, hash, claim_kind,
         status, attempts, lease_owner, lease_expires_at, next_retry_at, created_at, updated_at)
     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8,
         CASE WHEN ?10 IS NULL THEN 'pending' ELSE 'running' END,
         CASE WHEN ?10 IS NULL THEN 0 ELSE 1 END, ?10, ?11, ?9, ?9, ?9)";

/// Stores a request's body and headers, apart from its row: the row is rewritten at every
/// update, they never change (decision 35).
const INSERT_BODY_SQL: &str =
    "INSERT INTO request_bodies (id, body, headers, trace_parent, replay_of)
     VALUES (?1, ?2, ?3, ?4, ?5)";

/// What [`submit_in`] did: [`Submitted`] without the created record, which is `new` as
/// inserted ([`created_record`](crate::store::created_record)).
pub(super) enum SubmittedIn {
    Created,
    Attached(Box<RequestRecord>),
    KeyMismatch { existing: Uuid },
}

/// [`Store::submit_and_lease`] inside the writer's transaction: with `lease`, a created
/// request is inserted already leased.
pub(super) fn submit_in(
    conn: &Tx<'_>,
    new: &NewRequest,
    lease: Option<LeaseTo<'_>>,
) -> Result<(SubmittedIn, Option<Lease>), StoreError> {
    let mut text = IdText::default();
    let id = text.of(&new.id);
    // The upsert inserts our claim or takes over an expired one — one row changed, the claim
    // is ours — or leaves a live one untouched. One statement on the only writer, so two racing
    // submissions cannot both win (ID-7). The count of changed rows says which, not a
    // `RETURNING`, which SQLite serves through a temporary b-tree per statement.
    let won = conn.prepare_held(CLAIM_SQL)?.execute(params![
        new.namespace,
        new.claim_key,
        new.claim.as_str(),
        id,
        &new.hash[..],
        new.claim_expires_at,
        new.now
    ])? == 1;

    if won {
        let headers = serde_json::to_string(&new.headers).map_err(corrupt)?;
        let (owner, expires_at) = match lease {
            Some(LeaseTo { owner, lease_ms }) => (Some(owner), Some(new.now + lease_ms)),
            None => (None, None),
        };
        conn.prepare_held(INSERT_REQUEST_SQL)?.execute(params![
            id,
            new.namespace,
            new.route.name(),
            new.backend,
            new.model,
            i64::from(new.stream),
            &new.hash[..],
            new.claim.as_str(),
            new.now,
            owner,
            expires_at
        ])?;
        conn.prepare_held(INSERT_BODY_SQL)?.execute(params![
            id,
            new.body,
            headers,
            new.trace_parent,
            new.replay_of.map(|r| r.to_string())
        ])?;
        if let Some(url) = &new.callback_url {
            super::callback::insert_in(conn, id, &new.namespace, url, new.now)?;
        }
        let lease = owner.map(|owner| Lease {
            id: new.id,
            owner: owner.into(),
            attempt: 1,
        });
        // The row is exactly what was just inserted: the caller builds the record from `new`.
        return Ok((SubmittedIn::Created, lease));
    }

    let (existing, fingerprint): (String, Vec<u8>) = conn
        .prepare_held(
            "SELECT request_id, fingerprint FROM claims WHERE namespace = ?1 AND claim_key = ?2",
        )?
        .query_row(params![new.namespace, new.claim_key], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })?;
    let existing_id = parse_id(&existing)?;
    if fingerprint != new.hash {
        return Ok((
            SubmittedIn::KeyMismatch {
                existing: existing_id,
            },
            None,
        ));
    }
    let record = fetch(conn, &existing)?.ok_or_else(|| {
        StoreError::corrupt(
            Some(existing_id),
            "a live claim points at a missing request",
        )
    })?;
    Ok((SubmittedIn::Attached(Box::new(record)), None))
}

/// The outcome writes of [`finish_in`], each fenced on the lease (LC-3). A terminal one reserves
/// the `end` chunk's seq in the same statement (RD-5), so the row is rewritten once.
const FINISH_SUCCEEDED_SQL: &str = concat!(
    "UPDATE requests SET status = 'succeeded', response_status = ?1,
         response_body = ?2, upstream_request_id = ?3, error_type = NULL,
         error_message = NULL, error_status = NULL, lease_owner = NULL,
         lease_expires_at = NULL, finished_at = ?4, updated_at = ?4,
         last_seq = last_seq + 1, ",
    usage_assignments!("?7", "?8", "?9", "?10", "?11", "?12"),
    " WHERE id = ?5 AND lease_owner = ?6 AND status = 'running'"
);
const FINISH_RETRY_SQL: &str = "UPDATE requests SET status = 'pending', next_retry_at = ?1,
         error_type = ?2, error_message = ?3, error_status = ?4,
         lease_owner = NULL, lease_expires_at = NULL, updated_at = ?5
     WHERE id = ?6 AND lease_owner = ?7 AND status = 'running'";
const FINISH_FAILED_SQL: &str = concat!(
    "UPDATE requests SET status = 'failed', error_type = ?1, error_message = ?2,
         error_status = ?3, response_status = ?4, response_body = ?5,
         upstream_request_id = ?6, lease_owner = NULL, lease_expires_at = NULL,
         finished_at = ?7, updated_at = ?7, last_seq = last_seq + 1, ",
    usage_assignments!("?10", "?11", "?12", "?13", "?14", "?15"),
    " WHERE id = ?8 AND lease_owner = ?9 AND status = 'running'"
);

/// What a finish reads back of the row it changed: its claim kind and its state, by primary
/// key. Not the whole record: the rest is what the submission set, which the attempt holds as
/// it leased it (issue 30); the read skips the request's body and headers and their table. A
/// read rather than an `UPDATE ... RETURNING`: SQLite buffers `RETURNING` rows in a temporary
/// b-tree it creates and drops for every statement, which costs more than the read.
const FINISHED_SQL: &str = concat!(
    "SELECT claim_kind, ",
    state_columns!(),
    " FROM requests WHERE id = ?1"
);

/// [`Store::finish_read`] inside the writer's transaction: the request's state as the write
/// left it, or `None` when the lease was lost and nothing was written.
pub(super) fn finish_in(
    conn: &Tx<'_>,
    lease: &Lease,
    outcome: &Outcome,
    now: Millis,
) -> Result<Option<State>, StoreError> {
    let mut text = IdText::default();
    let id = text.of(&lease.id);
    let changed = match outcome {
        Outcome::Succeeded {
            status,
            body,
            upstream_request_id,
            usage,
            ..
        } => {
            let u = tokens_of(usage.as_ref());
            conn.prepare_held(FINISH_SUCCEEDED_SQL)?.execute(params![
                i64::from(*status),
                body,
                upstream_request_id,
                now,
                id,
                lease.owner,
                u[0],
                u[1],
                u[2],
                u[3],
                u[4],
                u[5]
            ])?
        }
        Outcome::Retry {
            next_retry_at,
            error,
        } => conn.prepare_held(FINISH_RETRY_SQL)?.execute(params![
            next_retry_at,
            error.kind.as_str(),
            error.message,
            error.status.map(i64::from),
            now,
            id,
            lease.owner
        ])?,
        Outcome::Failed {
            error,
            response,
            upstream_request_id,
            usage,
        } => {
            let u = tokens_of(usage.as_ref());
            conn.prepare_held(FINISH_FAILED_SQL)?.execute(params![
                error.kind.as_str(),
                error.message,
                error.status.map(i64::from),
                response.as_ref().map(|(s, _)| i64::from(*s)),
                response.as_ref().map(|(_, b)| b.as_slice()),
                upstream_request_id,
                now,
                id,
                lease.owner,
                u[0],
                u[1],
                u[2],
                u[3],
                u[4],
                u[5]
            ])?
        }
    };
    if changed == 0 {
        return Ok(None);
    }
    let (claim, state) = {
        let mut stmt = conn.prepare_held(FINISHED_SQL)?;
        let mut rows = stmt.query(params![id])?;
        let row = rows
            .next()?
            .ok_or_else(|| StoreError::corrupt(Some(lease.id), "the finished row is gone"))?;
        let claim: String = row.get(0)?;
        let claim = ClaimKind::parse(&claim)
            .ok_or_else(|| StoreError::corrupt(Some(lease.id), format!("claim_kind {claim:?}")))?;
        (claim, state_from_row(row, 1)?.check(lease.id)?)
    };
    if let Outcome::Succeeded {
        response_id: Some(response_id),
        ..
    } = outcome
    {
        insert_response_id(conn, response_id, id, lease.attempt)?;
    }
    if let Outcome::Succeeded {
        usage: Some(usage), ..
    }
    | Outcome::Failed {
        usage: Some(usage), ..
    } = outcome
    {
        upsert_usage(conn, id, lease.attempt, usage)?;
    }
    // A terminal UPDATE above reserved the `end` chunk's seq; the chunk is the row's (RD-5,
    // decision 134).
    if rules::releases_claim(state.status, state.error.as_ref(), claim) {
        release_claims(conn, id, now)?;
    }
    Ok(Some(state))
}

/// [`Store::sweep`] inside the writer's transaction: each expired lease gets the verdict of
/// [`rules::expired`]. Ids as stored.
pub(super) fn sweep_in(
    conn: &Tx<'_>,
    now: Millis,
    max_attempts: u32,
) -> Result<(Vec<String>, Vec<String>), StoreError> {
    let expired: Vec<(String, String, i64, i64, i64)> = conn
        .prepare_held(
            "SELECT id, claim_kind, attempts, last_seq, reset_seq FROM requests
             WHERE status = 'running' AND lease_expires_at < ?1",
        )?
        .query_map(params![now], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
        })?
        .collect::<Result<_, _>>()?;
    let (mut recovered, mut failed) = (Vec::new(), Vec::new());
    for (id, claim, attempts, last_seq, reset_seq) in expired {
        let request = Some(parse_id(&id)?);
        let claim = ClaimKind::parse(&claim)
            .ok_or_else(|| StoreError::corrupt(request, format!("claim_kind {claim:?}")))?;
        let attempts = u32::try_from(attempts)
            .map_err(|_| StoreError::corrupt(request, format!("attempts {attempts}")))?;
        match rules::expired(attempts, max_attempts, last_seq, reset_seq) {
            Expired::Fail(error) => {
                fail_abandoned_in(conn, &id, claim, &error, now)?;
                failed.push(id);
            }
            Expired::Recover { reset } => {
                conn.prepare_held(
                    "UPDATE requests SET status = 'pending', recoveries = recoveries + 1,
                         next_retry_at = ?1, lease_owner = NULL, lease_expires_at = NULL,
                         updated_at = ?1
                     WHERE id = ?2",
                )?
                .execute(params![now, id])?;
                if let Some((attempt, data)) = reset {
                    append_reset(conn, &id, i64::from(attempt), &data)?;
                }
                recovered.push(id);
            }
        }
    }
    Ok((recovered, failed))
}

/// Reserves `?1` seqs for a batch of chunks after seq `?5`, fenced on the lease (LC-3) and on
/// that seq: the batch's first chunk is `?5 + 1`, or nothing is written.
const APPEND_FENCE_SQL: &str = "UPDATE requests SET last_seq = last_seq + ?1,
         upstream_request_id = COALESCE(?2, upstream_request_id)
     WHERE id = ?3 AND lease_owner = ?4 AND status = 'running' AND last_seq = ?5";

/// The last seq of a request while lease `?2` runs it: what a batch that did not pass
/// [`APPEND_FENCE_SQL`] is compared with, to tell a batch already stored from a lost lease.
const LEASED_LAST_SEQ_SQL: &str = "SELECT last_seq FROM requests
     WHERE id = ?1 AND lease_owner = ?2 AND status = 'running'";

/// Stores `?6` provider events from a reserved seq on: one, or several packed (decision 123).
const APPEND_CHUNK_SQL: &str = "INSERT INTO chunks (request_id, seq, attempt, kind, event, data,
         count)
     VALUES (?1, ?2, ?3, 'data', ?4, ?5, ?6)";

/// [`Store::append_chunks`] inside the writer's transaction. With the statements prepared once
/// and no thread hop per statement, a fenced `UPDATE` per batch and an `INSERT` per chunk cost
/// microseconds each; the commit, shared by every batch, is the expensive part.
pub(super) fn append_in(
    conn: &Tx<'_>,
    batches: &[ChunkBatch],
) -> Result<Vec<Option<Vec<Chunk>>>, StoreError> {
    let mut fence = conn.prepare_held(APPEND_FENCE_SQL)?;
    let mut leased_last_seq = conn.prepare_held(LEASED_LAST_SEQ_SQL)?;
    let mut insert = conn.prepare_held(APPEND_CHUNK_SQL)?;
    let mut results = Vec::with_capacity(batches.len());
    let mut text = IdText::default();
    for batch in batches {
        let id = text.of(&batch.lease.id);
        let n = i64::try_from(batch.chunks.len()).map_err(corrupt)?;
        // Fenced (LC-3): seqs are reserved only while the attempt holds its lease, and only
        // right after the seq the batch follows.
        let reserve = params![
            n,
            batch.upstream_request_id,
            id,
            batch.lease.owner,
            batch.after
        ];
        if fence.execute(reserve)? == 0 {
            // Stored by an earlier try of this write, or not at all (the lease is lost).
            let last: Option<i64> = leased_last_seq
                .query_row(params![id, batch.lease.owner], |r| r.get(0))
                .optional()?;
            let already = n > 0 && last == Some(batch.after + n);
            results.push(already.then(|| batch.stored()));
            continue;
        }
        let stored = batch.stored();
        // Rows of up to ROW_CHUNKS_MAX events: a row and an index entry per row, not per event,
        // was a third of the writer's instructions per proxied event (decision 123).
        let attempt = i64::from(batch.lease.attempt);
        for row in stored.chunks(ROW_CHUNKS_MAX) {
            match row {
                [] => 0,
                [one] => insert.execute(params![id, one.seq, attempt, one.event, one.data, 1])?,
                [first, ..] => insert.execute(params![
                    id,
                    first.seq,
                    attempt,
                    None::<&str>,
                    pack(row),
                    row.len()
                ])?,
            };
        }
        if let Some(response_id) = &batch.response_id {
            insert_response_id(conn, response_id, id, batch.lease.attempt)?;
        }
        if let Some(usage) = &batch.usage {
            upsert_usage(conn, id, batch.lease.attempt, usage)?;
        }
        results.push(Some(stored));
    }
    Ok(results)
}

/// Records that `response_id` is the provider's id of attempt `attempt` of request `id`. An id
/// already recorded keeps its first owner (providers do not reuse ids).
fn insert_response_id(
    conn: &Tx<'_>,
    response_id: &str,
    id: &str,
    attempt: u32,
) -> Result<(), StoreError> {
    conn.prepare_held(
        "INSERT INTO response_ids (response_id, namespace, request_id, attempt)
         SELECT ?1, namespace, id, ?3 FROM requests WHERE id = ?2
         ON CONFLICT (response_id) DO NOTHING",
    )?
    .execute(params![response_id, id, i64::from(attempt)])?;
    Ok(())
}

const UPSERT_USAGE_SQL: &str = "INSERT INTO attempt_usage (request_id, attempt, input_tokens,
         output_tokens, cached_input_tokens, cache_write_tokens, reasoning_tokens,
         cache_write_1h_tokens)
     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)
     ON CONFLICT (request_id, attempt) DO UPDATE SET
         input_tokens = excluded.input_tokens, output_tokens = excluded.output_tokens,
         cached_input_tokens = excluded.cached_input_tokens,
         cache_write_tokens = excluded.cache_write_tokens,
         reasoning_tokens = excluded.reasoning_tokens,
         cache_write_1h_tokens = excluded.cache_write_1h_tokens";

/// Records `usage` as attempt `attempt`'s of request `id`, replacing what was recorded before
/// (usage is reported cumulatively).
fn upsert_usage(conn: &Tx<'_>, id: &str, attempt: u32, usage: &Usage) -> Result<(), StoreError> {
    let u = tokens_of(Some(usage));
    conn.prepare_held(UPSERT_USAGE_SQL)?.execute(params![
        id,
        i64::from(attempt),
        u[0],
        u[1],
        u[2],
        u[3],
        u[4],
        u[5]
    ])?;
    Ok(())
}

/// A usage row's six token columns from `at` on (input, output, cached input, cache write,
/// reasoning, one-hour cache write).
pub(super) fn usage_from_row(row: &Row<'_>, at: usize) -> Result<Usage, StoreError> {
    let n = |i: usize| -> Result<Option<u64>, StoreError> {
        Ok(row
            .get::<_, Option<i64>>(at + i)?
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

/// `Store::usage`'s statement around its group key: per (key, backend, model), the request
/// counts and the token sums of every attempt and of the saved calls (saved calls times the
/// answering attempt's usage). A request's saved calls are `RequestRecord::saved_calls`:
/// deliveries minus attempts, at least one attempt subtracted, never below zero.
pub(super) const USAGE_SQL_HEAD: &str = "SELECT ";
pub(super) const USAGE_SQL_TAIL: &str = " AS key, r.backend, r.model,
        COUNT(*), SUM(r.attempts), SUM(1 + r.attached + r.replayed), SUM(r.attached),
        SUM(r.replayed), SUM(r.saved),
        SUM(u.input_tokens), SUM(u.output_tokens), SUM(u.cached_input_tokens),
        SUM(u.cache_write_tokens), SUM(u.reasoning_tokens), SUM(u.cache_write_1h_tokens),
        SUM(r.saved * a.input_tokens), SUM(r.saved * a.output_tokens),
        SUM(r.saved * a.cached_input_tokens), SUM(r.saved * a.cache_write_tokens),
        SUM(r.saved * a.reasoning_tokens), SUM(r.saved * a.cache_write_1h_tokens),
        (r.created_at / ?4) * ?4 AS bucket,
        SUM(CASE WHEN r.status = 'succeeded' AND u.request_id IS NULL THEN 1 ELSE 0 END)
    FROM (SELECT *, MAX(1 + attached + replayed - MAX(attempts, 1), 0) AS saved
          FROM requests) r
    LEFT JOIN (SELECT request_id, SUM(input_tokens) AS input_tokens,
                   SUM(output_tokens) AS output_tokens,
                   SUM(cached_input_tokens) AS cached_input_tokens,
                   SUM(cache_write_tokens) AS cache_write_tokens,
                   SUM(reasoning_tokens) AS reasoning_tokens,
                   SUM(cache_write_1h_tokens) AS cache_write_1h_tokens
               FROM attempt_usage GROUP BY request_id) u ON u.request_id = r.id
    LEFT JOIN attempt_usage a ON a.request_id = r.id AND a.attempt = r.attempts
    WHERE (?1 IS NULL OR r.namespace = ?1) AND r.created_at >= ?2 AND r.created_at < ?3
    GROUP BY key, r.backend, r.model, bucket
    ORDER BY bucket, key, r.backend, r.model";

/// [`Store::cancel`] inside the writer's transaction.
pub(super) fn cancel_in(
    conn: &Tx<'_>,
    namespace: &str,
    id: &str,
    now: Millis,
) -> Result<Option<RequestRecord>, StoreError> {
    let error = rules::cancelled();
    let cancelled: Option<String> = conn
        .prepare_held(concat!(
            "UPDATE requests SET status = 'failed', error_type = ?4,
                 error_message = ?5, error_status = NULL,
                 lease_owner = NULL, lease_expires_at = NULL, finished_at = ?1, updated_at = ?1,
                 last_seq = last_seq + 1, ",
            usage_from_current_attempt!(),
            " WHERE id = ?2 AND namespace = ?3 AND status IN ('pending', 'running')
             RETURNING claim_kind"
        ))?
        .query_row(
            params![now, id, namespace, error.kind.as_str(), error.message],
            |r| r.get(0),
        )
        .optional()?;
    if let Some(claim) = &cancelled {
        let claim = ClaimKind::parse(claim).ok_or_else(|| {
            StoreError::corrupt(parse_id(id).ok(), format!("claim_kind {claim:?}"))
        })?;
        // The UPDATE above reserved the `end` chunk's seq (decision 134).
        if rules::releases_claim(Status::Failed, Some(&error), claim) {
            release_claims(conn, id, now)?;
        }
    }
    Ok(fetch(conn, id)?.filter(|r| r.namespace == namespace))
}

/// Fails request `id`, whose last attempt was abandoned (its lease expired, or it was handed
/// back at shutdown), with `error`: the lease cleared, the current attempt's usage copied,
/// the `end` chunk's seq reserved (decision 134), the claims released as
/// [`rules::releases_claim`] says (ID-6).
fn fail_abandoned_in(
    conn: &Tx<'_>,
    id: &str,
    claim: ClaimKind,
    error: &ErrorInfo,
    now: Millis,
) -> Result<(), StoreError> {
    conn.prepare_held(concat!(
        "UPDATE requests SET status = 'failed', error_type = ?2, error_message = ?3,
             error_status = NULL, lease_owner = NULL, lease_expires_at = NULL,
             finished_at = ?1, updated_at = ?1, last_seq = last_seq + 1, ",
        usage_from_current_attempt!(),
        " WHERE id = ?4"
    ))?
    .execute(params![now, error.kind.as_str(), error.message, id])?;
    if rules::releases_claim(Status::Failed, Some(error), claim) {
        release_claims(conn, id, now)?;
    }
    Ok(())
}

/// [`Store::release`] inside the writer's transaction.
pub(super) fn release_in(
    conn: &Tx<'_>,
    lease: &Lease,
    now: Millis,
    max_attempts: u32,
) -> Result<bool, StoreError> {
    let id = lease.id.to_string();
    let held: Option<(String, i64, i64, i64)> = conn
        .prepare_held(
            "SELECT claim_kind, attempts, last_seq, reset_seq FROM requests
             WHERE id = ?1 AND lease_owner = ?2 AND status = 'running'",
        )?
        .query_row(params![id, lease.owner], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))
        })
        .optional()?;
    let Some((claim, attempts, last_seq, reset_seq)) = held else {
        return Ok(false);
    };
    let claim = ClaimKind::parse(&claim)
        .ok_or_else(|| StoreError::corrupt(Some(lease.id), format!("claim_kind {claim:?}")))?;
    let attempts = u32::try_from(attempts).map_err(corrupt)?;
    match rules::handed_back(attempts, max_attempts, last_seq, reset_seq) {
        Expired::Fail(error) => fail_abandoned_in(conn, &id, claim, &error, now)?,
        Expired::Recover { reset } => {
            conn.prepare_held(
                "UPDATE requests SET status = 'pending', next_retry_at = ?1, lease_owner = NULL,
                     lease_expires_at = NULL, updated_at = ?1
                 WHERE id = ?2",
            )?
            .execute(params![now, id])?;
            if let Some((attempt, data)) = reset {
                append_reset(conn, &id, i64::from(attempt), &data)?;
            }
        }
    }
    Ok(true)
}

/// [`Store::release_unstarted`] inside the writer's transaction.
pub(super) fn release_unstarted_in(
    conn: &Tx<'_>,
    lease: &Lease,
    now: Millis,
) -> Result<bool, StoreError> {
    let changed = conn
        .prepare_held(
            "UPDATE requests SET status = 'pending', next_retry_at = ?1, lease_owner = NULL,
                 lease_expires_at = NULL, attempts = attempts - 1, updated_at = ?1
             WHERE id = ?2 AND lease_owner = ?3 AND status = 'running' AND attempts > 0",
        )?
        .execute(params![now, lease.id.to_string(), lease.owner])?;
    Ok(changed == 1)
}

/// [`Store::prune`] inside the writer's transaction.
pub(super) fn prune_in(
    conn: &Tx<'_>,
    before: Millis,
    pending_callback_before: Millis,
    limit: i64,
) -> Result<u64, StoreError> {
    let ids: Vec<String> = conn
        .prepare_held(
            "SELECT id FROM requests
             WHERE finished_at IS NOT NULL AND finished_at < ?1
               AND (finished_at < ?3 OR NOT EXISTS (SELECT 1 FROM callbacks
                    WHERE callbacks.request_id = requests.id AND callbacks.state = 'pending'))
             ORDER BY finished_at LIMIT ?2",
        )?
        .query_map(params![before, limit, pending_callback_before], |r| {
            r.get(0)
        })?
        .collect::<Result<_, _>>()?;
    for id in &ids {
        for sql in [
            "DELETE FROM chunks WHERE request_id = ?1",
            "DELETE FROM claims WHERE request_id = ?1",
            "DELETE FROM response_ids WHERE request_id = ?1",
            "DELETE FROM attempt_usage WHERE request_id = ?1",
            "DELETE FROM callbacks WHERE request_id = ?1",
            "DELETE FROM request_bodies WHERE id = ?1",
            "DELETE FROM requests WHERE id = ?1",
        ] {
            conn.prepare_held(sql)?.execute(params![id])?;
        }
    }
    Ok(ids.len() as u64)
}

/// Leases request `?4` ([`lease_in`]).
const LEASE_SQL: &str = "UPDATE requests SET status = 'running', attempts = attempts + 1,
         lease_owner = ?1, lease_expires_at = ?2, updated_at = ?3
     WHERE id = ?4";

/// Leases request `id`, chosen by [`due_ids`] in the same job, to `owner` (LC-2), and reads it.
pub(super) fn lease_in(
    conn: &Tx<'_>,
    id: &str,
    owner: String,
    now: Millis,
    lease_ms: i64,
) -> Result<(Lease, RequestRecord), StoreError> {
    conn.prepare_held(LEASE_SQL)?
        .execute(params![owner, now + lease_ms, now, id])?;
    let record = fetch(conn, id)?.ok_or_else(|| corrupt(format!("leased request {id} is gone")))?;
    let lease = Lease {
        id: record.id,
        owner: owner.into(),
        attempt: record.attempts,
    };
    Ok((lease, record))
}

/// Up to `?2` pending requests due at `?1`, oldest first, in the order of index `requests_due`.
const DUE_IDS_SQL: &str = "SELECT id FROM requests WHERE status = 'pending' AND next_retry_at <= ?1
     ORDER BY next_retry_at, id LIMIT ?2";

/// Up to `limit` pending requests due at `now`, oldest first.
pub(super) fn due_ids(conn: &Tx<'_>, now: Millis, limit: i64) -> Result<Vec<String>, StoreError> {
    Ok(conn
        .prepare_held(DUE_IDS_SQL)?
        .query_map(params![now, limit], |r| r.get(0))?
        .collect::<Result<_, _>>()?)
}

/// Up to `?2` pending requests of namespace `?3` due at `?1`, oldest first, with when each was
/// due, in the order of index `requests_namespace_due` (LC-2a). Named, as in the callbacks'
/// lease, so no statistics turn it into a scan of `requests_due` filtering the namespace.
const NAMESPACE_DUE_IDS_SQL: &str = "SELECT id, next_retry_at FROM requests
         INDEXED BY requests_namespace_due
     WHERE namespace = ?3 AND status = 'pending' AND next_retry_at <= ?1
     ORDER BY next_retry_at, id LIMIT ?2";

/// The requests one lease takes under `quota` at `now` (LC-2a), oldest first within each
/// step: each namespace's share of its own due ones, the oldest of them when the shares exceed
/// the limit, then what the quota lends of the oldest due of any namespace. Leased as they
/// are chosen, by `lease` (so the second step, run after the first's leases, skips them).
pub(super) fn lease_due<T>(
    conn: &Tx<'_>,
    now: Millis,
    quota: &LeaseQuota,
    mut lease: impl FnMut(&str) -> Result<T, StoreError>,
) -> Result<Vec<T>, StoreError> {
    let sql_limit = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
    let mut shares: Vec<(Millis, String)> = Vec::new();
    if !quota.shares.is_empty() {
        let mut share = conn.prepare_held(NAMESPACE_DUE_IDS_SQL)?;
        for (namespace, n) in quota.nonzero_shares() {
            let rows = share.query_map(params![now, sql_limit(n), namespace], |r| {
                Ok((r.get(1)?, r.get(0)?))
            })?;
            for row in rows {
                shares.push(row?);
            }
        }
    }
    shares.sort();
    shares.truncate(quota.limit);
    let mut leased = shares
        .iter()
        .map(|(_, id)| lease(id))
        .collect::<Result<Vec<T>, StoreError>>()?;
    let lent = quota.lendable(leased.len());
    if lent > 0 {
        for id in due_ids(conn, now, sql_limit(lent))? {
            leased.push(lease(&id)?);
        }
    }
    Ok(leased)
}

#[cfg(test)]
mod tests {
    use super::super::scratch;
    use super::super::tests::ephemeral_tables;
    use super::*;

    /// The writer's ids are the text every reader of the tables looks them up by.
    #[test]
    fn a_request_id_is_written_as_its_display_text() {
        let mut text = IdText::default();
        for id in [Uuid::nil(), Uuid::max(), Uuid::now_v7(), Uuid::new_v4()] {
            assert_eq!(text.of(&id), id.to_string());
        }
    }

    #[tokio::test]
    async fn a_requests_writes_and_a_streams_appends_build_no_temporary_btree() {
        let dir = tempfile::tempdir().expect("tempdir");
        scratch(dir.path()).await;
        let conn = Connection::open(dir.path().join("t.db")).expect("open");
        for sql in [
            CLAIM_SQL,
            INSERT_REQUEST_SQL,
            INSERT_BODY_SQL,
            DUE_IDS_SQL,
            NAMESPACE_DUE_IDS_SQL,
            LEASE_SQL,
            FINISH_SUCCEEDED_SQL,
            FINISH_RETRY_SQL,
            FINISH_FAILED_SQL,
            FETCH_SQL,
            UPSERT_USAGE_SQL,
            INSERT_RESET_SQL,
            APPEND_FENCE_SQL,
            LEASED_LAST_SEQ_SQL,
            APPEND_CHUNK_SQL,
        ] {
            assert_eq!(ephemeral_tables(&conn, sql), 0, "{sql}");
        }
    }
}
