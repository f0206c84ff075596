//! SQLite adapter of [`Store`]: one file in WAL mode, one writer thread that group-commits,
//! read connections on the blocking pool (SPEC DU-2).
//!
//! **Writes.** Every write method becomes a job for one dedicated thread that owns the only
//! writing connection. The thread takes every job queued at that moment (up to
//! 1,024), runs them in one `BEGIN IMMEDIATE` transaction, commits once, and only then answers
//! the callers. So:
//! - SQLite's single-writer rule never shows up as `SQLITE_BUSY`, and every job is atomic with
//!   respect to every other: the claim (an upsert on the `claims` primary key, ID-7) and the
//!   lease (due ids chosen, then updated, in one job, LC-2) need no further locking;
//! - a job that fails fails alone: the group is rolled back and run again without it, each
//!   other job in its own `SAVEPOINT` ([`commit_group`]); a commit that fails fails every job
//!   of the group, and nothing of any of them is stored;
//! - no caller hears "stored" before the commit that stored it (with `synchronous = full`,
//!   before its `fsync`), and under load one commit (one `fsync`) serves many requests — the
//!   group commit of `docs/architecture.md`, for requests as well as stream chunks;
//! - a group made only of writes that may wait (chunks handed on ahead of the log, a stream's
//!   ending) is held open for more, up to the last commit's duration and at most 2 ms, until a
//!   write that may not wait joins it (DU-7): a commit costs nearly the same whatever it holds;
//! - the jobs run on a [`held::Tx`], the connection with the writer's statements held beside
//!   it, each prepared once (decision 130).
//!
//! **Reads** run on a small pool of read-only connections on tokio's blocking threads and see
//! every committed write (WAL snapshot per statement).
//!
//! **Checkpoints.** SQLite's automatic WAL checkpoint runs inside whichever commit crosses the
//! threshold, so a request now and then pays for copying the WAL back into the database. A
//! background thread runs `PRAGMA wal_checkpoint(PASSIVE)` every 100 ms, beside
//! the writer rather than in its way, so under ordinary load the WAL never reaches that
//! threshold; under writes that never pause the automatic checkpoint still bounds it.
//!
//! Why rusqlite and not sqlx here: sqlx's SQLite driver runs each statement on the connection's
//! own thread and hands rows back over a channel, a thread hop per statement; a request made
//! about a dozen of them (docs/benchmarks-history.md, docs/decisions.md). Here a whole job — several
//! statements — is one hop, and a group of jobs is one commit.

/// The tables a whole record is read from: the request row and its body, written once.
macro_rules! record_tables {
    () => {
        " FROM requests JOIN request_bodies USING (id)"
    };
}

mod callback;
mod held;
/// The filter of `GET /requests` and of an export (RD-7, EX-1, EX-8), after `SELECT columns
/// FROM tables`.
macro_rules! list_where {
    () => {
        " WHERE (?1 IS NULL OR namespace = ?1) AND (?2 IS NULL OR status = ?2)
             AND (?3 IS NULL OR route = ?3) AND (?4 IS NULL OR model = ?4)
             AND (?5 IS NULL OR backend = ?5) AND (?6 IS NULL OR created_at >= ?6)
             AND (?7 IS NULL OR created_at < ?7)
             AND (?8 IS NULL OR instr(body, CAST(?8 AS BLOB)) > 0)
             AND (?9 = 0 OR attached + replayed > 0)
             AND (?10 IS NULL OR id < ?10)
             AND (?12 IS NULL OR id IN (SELECT request_id FROM callbacks WHERE state = ?12))
             AND (?13 IS NULL OR id > ?13) AND (?14 IS NULL OR replay_of = ?14)"
    };
}

/// `GET /requests`: newest first.
const LIST_SQL: &str = concat!(
    "SELECT ",
    request_columns!(),
    record_tables!(),
    list_where!(),
    " ORDER BY id DESC LIMIT ?11"
);

/// An export: oldest first (EX-1).
const LIST_OLDEST_FIRST_SQL: &str = concat!(
    "SELECT ",
    request_columns!(),
    record_tables!(),
    list_where!(),
    " ORDER BY id ASC LIMIT ?11"
);

mod open;
mod sql;
mod writer;

use std::sync::Arc;

use async_trait::async_trait;
use rusqlite::{OptionalExtension, params};
use uuid::Uuid;

use self::open::ReadPool;
use self::sql::{
    ROW_CHUNKS_MAX, SubmittedIn, USAGE_SQL_HEAD, USAGE_SQL_TAIL, append_in, cancel_in,
    chunks_from_row, corrupt, due_ids, end_of, fetch, finish_in, lease_due, lease_in, parse_id,
    prune_in, record_from_row, release_in, release_unstarted_in, submit_in, sweep_in,
    usage_from_row,
};
use self::writer::WriteJob;
use super::row::State;
use super::{
    AddedCounts, Callback, CallbackLease, CallbackOutcome, Chunk, ChunkBatch, Counts, Lease,
    LeaseQuota, LeaseTo, ListFilter, Millis, NewRequest, Outcome, RequestRecord, ResponseRef,
    Started, Status, Store, StoreError, Submitted, Swept, Usage, UsageGroup, UsageQuery, UsageRow,
    created_record,
};
use crate::provider::Route;

pub use self::open::{CHECKPOINT_THREAD, WRITER_THREAD};
pub(crate) use self::open::{LATEST_SCHEMA, schema_version};

/// The embedded store. Cloning is cheap; the writer and checkpoint threads stop when the last
/// clone is dropped.
#[derive(Clone)]
pub struct SqliteStore {
    inner: Arc<Inner>,
}

struct Inner {
    /// Jobs for the writer thread.
    jobs: std::sync::mpsc::Sender<Box<dyn WriteJob>>,
    /// Read-only connections.
    readers: ReadPool,
    /// Dropping it stops the checkpoint thread.
    _stop_checkpoints: std::sync::mpsc::Sender<()>,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("path", &self.inner.readers.path)
            .finish_non_exhaustive()
    }
}

impl SqliteStore {
    /// [`Store::submit_and_lease`], and with `started` [`Store::submit_and_lease_started`]: it
    /// is called with the lease once the writer has run the submission, before its commit, or
    /// after a failed commit once the submission is durable (ID-9).
    async fn submit_leasing(
        &self,
        new: NewRequest,
        lease: Option<LeaseTo<'_>>,
        started: Option<Started>,
    ) -> Result<(Submitted, Option<Lease>), StoreError> {
        let lease = lease.map(|l| (l.owner.to_string(), l.lease_ms));
        // Shared with the write, which may run more than once, and whole again once it has
        // run: the created record is built from it without a copy.
        let new = Arc::new(new);
        let shared = Arc::clone(&new);
        let hook = started.map(|started| -> writer::Early<(SubmittedIn, Option<Lease>)> {
            Box::new(move |(submitted, lease)| {
                if let (SubmittedIn::Created, Some(lease)) = (submitted, lease) {
                    started(lease.clone());
                }
            })
        });
        let (submitted, lease) = self
            .write_hooked(
                move |conn| {
                    let lease = lease.as_ref().map(|(owner, lease_ms)| LeaseTo {
                        owner,
                        lease_ms: *lease_ms,
                    });
                    submit_in(conn, &shared, lease)
                },
                hook,
            )
            .await?;
        let submitted = match submitted {
            SubmittedIn::Created => {
                let new = Arc::try_unwrap(new).unwrap_or_else(|new| (*new).clone());
                Submitted::Created(Box::new(created_record(new, lease.is_some())))
            }
            SubmittedIn::Attached(record) => Submitted::Attached(record),
            SubmittedIn::KeyMismatch { existing } => Submitted::KeyMismatch { existing },
        };
        Ok((submitted, lease))
    }

    /// [`Store::append_chunks`] as one job; with `may_wait` its commit may be held open for
    /// more writes (DU-7: only positioned readers wait on these batches).
    async fn append(
        &self,
        batches: &[ChunkBatch],
        may_wait: bool,
    ) -> Result<Vec<Option<Vec<Chunk>>>, StoreError> {
        if batches.is_empty() {
            return Ok(Vec::new());
        }
        let batches = batches.to_vec();
        let job = move |conn: &held::Tx<'_>| append_in(conn, &batches);
        if may_wait {
            self.write_may_wait(job).await
        } else {
            self.write(job).await
        }
    }
}

impl SqliteStore {
    /// [`Store::finish_read`] as one job: the request's state as the write left it, `None`
    /// when the lease was lost.
    async fn finish_state(
        &self,
        lease: &Lease,
        outcome: &Outcome,
        now: Millis,
    ) -> Result<Option<State>, StoreError> {
        let (lease, outcome) = (lease.clone(), outcome.clone());
        self.write(move |conn| finish_in(conn, &lease, &outcome, now))
            .await
    }
}

/// The record of a request its attempt finished: the request as `leased` (what its submission
/// set, which nothing changes), with the state the finish left it in (issue 30).
fn settled(leased: &RequestRecord, state: State) -> RequestRecord {
    let mut record = leased.clone();
    state.apply_to(&mut record);
    record
}

#[async_trait]
impl Store for SqliteStore {
    async fn submit_and_lease(
        &self,
        new: NewRequest,
        lease: Option<LeaseTo<'_>>,
    ) -> Result<(Submitted, Option<Lease>), StoreError> {
        self.submit_leasing(new, lease, None).await
    }

    async fn submit_and_lease_started(
        &self,
        new: NewRequest,
        lease: Option<LeaseTo<'_>>,
        started: Started,
    ) -> Result<(Submitted, Option<Lease>), StoreError> {
        self.submit_leasing(new, lease, Some(started)).await
    }

    async fn get(&self, namespace: &str, id: Uuid) -> Result<Option<RequestRecord>, StoreError> {
        let namespace = namespace.to_string();
        self.read(
            move |conn| Ok(fetch(conn, &id.to_string())?.filter(|r| r.namespace == namespace)),
        )
        .await
    }

    async fn peek(&self, namespace: &str, id: Uuid) -> Result<Option<RequestRecord>, StoreError> {
        let namespace = namespace.to_string();
        self.read(move |conn| {
            Ok(sql::peek(conn, &id.to_string())?.filter(|r| r.namespace == namespace))
        })
        .await
    }

    async fn lease(
        &self,
        owner: &str,
        now: Millis,
        lease_ms: i64,
    ) -> Result<Option<(Lease, RequestRecord)>, StoreError> {
        let owner = owner.to_string();
        self.write(move |conn| {
            // Chosen, then leased: one writer, so nothing comes in between.
            let Some(id) = due_ids(conn, now, 1)?.pop() else {
                return Ok(None);
            };
            lease_in(conn, &id, owner.clone(), now, lease_ms).map(Some)
        })
        .await
    }

    async fn lease_many(
        &self,
        owner_prefix: &str,
        now: Millis,
        lease_ms: i64,
        quota: &LeaseQuota,
    ) -> Result<Vec<(Lease, RequestRecord)>, StoreError> {
        let owner_prefix = owner_prefix.to_string();
        let quota = quota.clone();
        self.write(move |conn| {
            // Chosen, then leased, in one job of the only writer: atomic like `lease`, for up
            // to `quota.limit` rows.
            lease_due(conn, now, &quota, |id| {
                let owner = format!("{owner_prefix}/{id}");
                lease_in(conn, id, owner, now, lease_ms)
            })
        })
        .await
    }

    async fn heartbeat(
        &self,
        lease: &Lease,
        now: Millis,
        lease_ms: i64,
    ) -> Result<bool, StoreError> {
        let lease = lease.clone();
        self.write(move |conn| {
            let done = conn
                .prepare_held(
                    "UPDATE requests SET lease_expires_at = ?1
                     WHERE id = ?2 AND lease_owner = ?3 AND status = 'running'",
                )?
                .execute(params![now + lease_ms, lease.id.to_string(), lease.owner])?;
            Ok(done == 1)
        })
        .await
    }

    async fn finish_read(
        &self,
        lease: &Lease,
        leased: &RequestRecord,
        outcome: &Outcome,
        now: Millis,
    ) -> Result<Option<RequestRecord>, StoreError> {
        debug_assert_eq!(leased.id, lease.id, "the record of the leased request");
        let state = self.finish_state(lease, outcome, now).await?;
        Ok(state.map(|state| settled(leased, state)))
    }

    async fn finish(
        &self,
        lease: &Lease,
        outcome: Outcome,
        now: Millis,
    ) -> Result<bool, StoreError> {
        Ok(self.finish_state(lease, &outcome, now).await?.is_some())
    }

    async fn sweep(&self, now: Millis, max_attempts: u32) -> Result<Swept, StoreError> {
        let (recovered, failed) = self
            .write(move |conn| sweep_in(conn, now, max_attempts))
            .await?;
        Ok(Swept {
            recovered: recovered
                .iter()
                .map(|id| parse_id(id))
                .collect::<Result<_, _>>()?,
            failed: failed
                .iter()
                .map(|id| parse_id(id))
                .collect::<Result<_, _>>()?,
        })
    }

    async fn append_chunks(
        &self,
        batches: &[ChunkBatch],
    ) -> Result<Vec<Option<Vec<Chunk>>>, StoreError> {
        self.append(batches, false).await
    }

    async fn append_chunks_unawaited(
        &self,
        batches: &[ChunkBatch],
    ) -> Result<Vec<Option<Vec<Chunk>>>, StoreError> {
        self.append(batches, true).await
    }

    fn ends_streams_in_one_write(&self) -> bool {
        true
    }

    async fn finish_with_chunks(
        &self,
        leased: &RequestRecord,
        last: &ChunkBatch,
        outcome: &Outcome,
        now: Millis,
    ) -> Result<Option<(Vec<Chunk>, RequestRecord)>, StoreError> {
        debug_assert_eq!(leased.id, last.lease.id, "the record of the leased request");
        let (last, outcome) = (last.clone(), outcome.clone());
        // A stream's ending may be held for more writes (DU-7).
        self.write_may_wait(move |conn| {
            let Some(chunks) = append_in(conn, std::slice::from_ref(&last))?
                .pop()
                .flatten()
            else {
                return Ok(None);
            };
            // The same transaction holds the lease the append was fenced on; an error rolls
            // the chunks back with it.
            let state = finish_in(conn, &last.lease, &outcome, now)?.ok_or_else(|| {
                StoreError::corrupt(Some(last.lease.id), "the lease was lost inside one write")
            })?;
            Ok(Some((chunks, state)))
        })
        .await
        .map(|written| written.map(|(chunks, state)| (chunks, settled(leased, state))))
    }

    async fn chunks_after(
        &self,
        id: Uuid,
        after: i64,
        limit: i64,
    ) -> Result<Vec<Chunk>, StoreError> {
        self.read(move |conn| {
            let id = id.to_string();
            // The `end` chunk is the row's (decision 134), read before the chunks: a request
            // read terminal stores nothing more, so every chunk before its `end` is there to
            // be read next.
            let end = end_of(conn, &id)?;
            // A row holds up to ROW_CHUNKS_MAX chunks from its seq on (decision 123): the rows
            // that hold one after `after`, each at least one, so `limit` rows are enough.
            let mut stmt = conn.prepare_cached(
                "SELECT seq, count, attempt, kind, event, data FROM chunks
                 WHERE request_id = ?1 AND seq > ?2 - ?4 AND seq + count - 1 > ?2
                 ORDER BY seq LIMIT ?3",
            )?;
            let mut rows = stmt.query(params![id, after, limit, ROW_CHUNKS_MAX])?;
            let mut chunks = Vec::new();
            while let Some(row) = rows.next()? {
                chunks_from_row(row, after, &mut chunks)?;
            }
            let limit = usize::try_from(limit).unwrap_or(0);
            chunks.truncate(limit);
            // The `end` follows the page only when the page reaches the seq before it: not
            // when a database written before decision 134 stored it as a row (read above), nor
            // when a prune between the two reads took the chunks.
            if let Some(end) = end
                && chunks.len() < limit
                && chunks.last().map_or(after, |last| last.seq) + 1 == end.seq
            {
                chunks.push(end);
            }
            Ok(chunks)
        })
        .await
    }

    async fn cancel(
        &self,
        namespace: &str,
        id: Uuid,
        now: Millis,
    ) -> Result<Option<RequestRecord>, StoreError> {
        let namespace = namespace.to_string();
        self.write(move |conn| cancel_in(conn, &namespace, &id.to_string(), now))
            .await
    }

    async fn list(&self, filter: &ListFilter) -> Result<Vec<RequestRecord>, StoreError> {
        let f = filter.clone();
        self.read(move |conn| {
            // Two statements, so each walks the id index in its own direction (EX-1).
            let sql = if f.oldest_first {
                LIST_OLDEST_FIRST_SQL
            } else {
                LIST_SQL
            };
            let mut stmt = conn.prepare_cached(sql)?;
            let mut rows = stmt.query(params![
                f.namespace,
                f.status.map(Status::as_str),
                f.route.map(Route::name),
                f.model,
                f.backend,
                f.since,
                f.until,
                f.text,
                f.replayed,
                f.before.map(|b| b.to_string()),
                f.limit,
                f.callback.map(super::CallbackState::as_str),
                f.after.map(|a| a.to_string()),
                f.replay_of.map(|r| r.to_string()),
            ])?;
            let mut records = Vec::new();
            while let Some(row) = rows.next()? {
                records.push(record_from_row(row, 0)?);
            }
            Ok(records)
        })
        .await
    }

    async fn data_chunks_of(
        &self,
        wanted: &[(Uuid, i64)],
    ) -> Result<Vec<(Uuid, Vec<Chunk>)>, StoreError> {
        let wanted = wanted.to_vec();
        // One read job for the page: the statements run back to back on one connection.
        self.read(move |conn| {
            let mut stmt = conn.prepare_cached(
                "SELECT seq, count, attempt, kind, event, data FROM chunks
                 WHERE request_id = ?1 AND seq > ?2 - ?3 AND seq + count - 1 > ?2
                     AND kind = 'data'
                 ORDER BY seq",
            )?;
            let mut out = Vec::with_capacity(wanted.len());
            for (id, after) in wanted {
                let mut rows = stmt.query(params![id.to_string(), after, ROW_CHUNKS_MAX])?;
                let mut chunks = Vec::new();
                while let Some(row) = rows.next()? {
                    chunks_from_row(row, after, &mut chunks)?;
                }
                out.push((id, chunks));
            }
            Ok(out)
        })
        .await
    }

    async fn get_any(&self, id: Uuid) -> Result<Option<RequestRecord>, StoreError> {
        self.read(move |conn| fetch(conn, &id.to_string())).await
    }

    async fn release(
        &self,
        lease: &Lease,
        now: Millis,
        max_attempts: u32,
    ) -> Result<bool, StoreError> {
        let lease = lease.clone();
        self.write(move |conn| release_in(conn, &lease, now, max_attempts))
            .await
    }

    async fn release_unstarted(&self, lease: &Lease, now: Millis) -> Result<bool, StoreError> {
        let lease = lease.clone();
        self.write(move |conn| release_unstarted_in(conn, &lease, now))
            .await
    }

    async fn prune(
        &self,
        before: Millis,
        pending_callback_before: Millis,
        limit: i64,
    ) -> Result<u64, StoreError> {
        self.write(move |conn| prune_in(conn, before, pending_callback_before, limit))
            .await
    }

    async fn find_response(&self, response_id: &str) -> Result<Option<ResponseRef>, StoreError> {
        let response_id = response_id.to_string();
        self.read(move |conn| {
            let found: Option<(String, String, i64)> = conn
                .prepare_cached(
                    "SELECT request_id, namespace, attempt FROM response_ids WHERE response_id = ?1",
                )?
                .query_row(params![response_id], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
                .optional()?;
            found
                .map(|(id, namespace, attempt)| {
                    Ok(ResponseRef {
                        request_id: parse_id(&id)?,
                        namespace,
                        attempt: u32::try_from(attempt).map_err(corrupt)?,
                    })
                })
                .transpose()
        })
        .await
    }

    async fn attempt_usage(&self, id: Uuid) -> Result<Vec<(u32, Usage)>, StoreError> {
        self.read(move |conn| {
            let mut stmt = conn.prepare_cached(
                "SELECT attempt, input_tokens, output_tokens, cached_input_tokens,
                     cache_write_tokens, reasoning_tokens, cache_write_1h_tokens
                 FROM attempt_usage WHERE request_id = ?1 ORDER BY attempt",
            )?;
            let mut rows = stmt.query(params![id.to_string()])?;
            let mut out = Vec::new();
            while let Some(row) = rows.next()? {
                let attempt = u32::try_from(row.get::<_, i64>(0)?).map_err(corrupt)?;
                out.push((attempt, usage_from_row(row, 1)?));
            }
            Ok(out)
        })
        .await
    }

    async fn add_counts(&self, counts: &[Counts]) -> Result<AddedCounts, StoreError> {
        let counts: Arc<[Counts]> = counts.into();
        self.write(move |conn| {
            const ADD_SQL: &str = "UPDATE requests SET attached = attached + ?2,
                     replayed = replayed + ?3, log_reads = log_reads + ?4
                 WHERE id = ?1";
            // Where attachments are added, the request's `finished_at` as this job finds it:
            // set, its outcome committed before, without them. Read, not returned by the
            // update: a `RETURNING` costs SQLite a temporary b-tree per statement.
            const FINISHED_SQL: &str =
                "SELECT attached FROM requests WHERE id = ?1 AND finished_at IS NOT NULL";
            // The one writer holds every row: none is ever busy.
            let mut added = AddedCounts::default();
            for c in counts.iter() {
                let id = c.id.to_string();
                if c.attached > 0
                    && let Some(before) = conn
                        .prepare_held(FINISHED_SQL)?
                        .query_row(params![id], |r| r.get::<_, u32>(0))
                        .optional()?
                {
                    added.late.push((c.id, before));
                }
                conn.prepare_held(ADD_SQL)?.execute(params![
                    id,
                    c.attached,
                    c.replayed,
                    c.log_reads
                ])?;
            }
            Ok(added)
        })
        .await
    }

    async fn usage(&self, query: &UsageQuery) -> Result<Vec<UsageRow>, StoreError> {
        let query = query.clone();
        self.read(move |conn| {
            let key = match query.group_by {
                UsageGroup::Model => "COALESCE(r.model, '')",
                UsageGroup::Backend => "r.backend",
                UsageGroup::Namespace => "r.namespace",
                UsageGroup::Day => "strftime('%Y-%m-%d', r.created_at / 1000, 'unixepoch')",
                UsageGroup::Provider => "substr(r.route, 1, instr(r.route, '.') - 1)",
            };
            let sql = format!("{}{key}{}", USAGE_SQL_HEAD, USAGE_SQL_TAIL);
            let mut stmt = conn.prepare_cached(&sql)?;
            let mut rows = stmt.query(params![
                query.namespace,
                query.since,
                query.until,
                query.bucket_ms
            ])?;
            let mut out = Vec::new();
            while let Some(row) = rows.next()? {
                let count = |i: usize| -> Result<u64, StoreError> {
                    Ok(u64::try_from(row.get::<_, Option<i64>>(i)?.unwrap_or(0)).unwrap_or(0))
                };
                out.push(UsageRow {
                    key: row.get(0)?,
                    backend: row.get(1)?,
                    model: row.get(2)?,
                    requests: count(3)?,
                    attempts: count(4)?,
                    deliveries: count(5)?,
                    attached: count(6)?,
                    replayed: count(7)?,
                    saved_calls: count(8)?,
                    usage: usage_from_row(row, 9)?,
                    saved: usage_from_row(row, 15)?,
                    bucket: row.get(21)?,
                    unmetered: count(22)?,
                });
            }
            Ok(out)
        })
        .await
    }

    async fn lease_callbacks(
        &self,
        owner_prefix: &str,
        now: Millis,
        lease_ms: i64,
        quota: &LeaseQuota,
    ) -> Result<Vec<CallbackLease>, StoreError> {
        callback::lease(self, owner_prefix, now, lease_ms, quota).await
    }

    async fn finish_callback(
        &self,
        lease: &CallbackLease,
        outcome: &CallbackOutcome,
        now: Millis,
    ) -> Result<bool, StoreError> {
        callback::finish(self, lease, outcome, now).await
    }

    async fn callbacks(&self, ids: &[Uuid]) -> Result<Vec<Callback>, StoreError> {
        callback::read(self, ids).await
    }

    async fn callback_backlog(&self) -> Result<i64, StoreError> {
        callback::backlog(self).await
    }

    async fn counts(&self) -> Result<Vec<(Status, i64)>, StoreError> {
        self.read(|conn| {
            let rows: Vec<(String, i64)> = conn
                .prepare_cached("SELECT status, COUNT(*) FROM requests GROUP BY status")?
                .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
                .collect::<Result<_, _>>()?;
            rows.into_iter()
                .map(|(s, n)| {
                    Status::parse(&s)
                        .map(|s| (s, n))
                        .ok_or_else(|| corrupt(format!("status {s:?}")))
                })
                .collect()
        })
        .await
    }

    async fn next_due(&self) -> Result<Option<Millis>, StoreError> {
        self.read(|conn| {
            Ok(conn
                .prepare_cached("SELECT MIN(next_retry_at) FROM requests WHERE status = 'pending'")?
                .query_row([], |r| r.get(0))?)
        })
        .await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.read(|conn| {
            conn.prepare_cached("SELECT 1")?.query_row([], |_| Ok(()))?;
            Ok(())
        })
        .await?;
        // The writer thread must be alive and able to take its lock, too: an empty job is a
        // `BEGIN IMMEDIATE` / `COMMIT` with nothing to write (no fsync).
        self.write(|_| Ok(())).await
    }
}

/// A store in `dir` (file `t.db`, `synchronous = NORMAL`), for unit tests.
#[cfg(test)]
pub(crate) async fn scratch(dir: &std::path::Path) -> SqliteStore {
    let url = format!("sqlite://{}", dir.join("t.db").display());
    SqliteStore::open(&url, crate::config::SqliteSynchronous::Normal)
        .await
        .expect("open")
}

#[cfg(test)]
mod tests {
    use super::*;
    use rusqlite::Connection;

    use crate::config::SqliteSynchronous;
    use crate::store::{ChunkKind, NewChunk};

    /// Asserts that request `id`'s log reads back as `all` from every seq up to its `end`, in
    /// pages of every size.
    async fn reads_back_from_every_seq(store: &SqliteStore, id: Uuid, all: &[Chunk], case: &str) {
        for after in 0..=all.last().map_or(0, |c| c.seq) {
            for limit in [1, 3, 64, 1000] {
                let read = store.chunks_after(id, after, limit).await.expect("read");
                let expected: Vec<&Chunk> = all
                    .iter()
                    .filter(|c| c.seq > after)
                    .take(usize::try_from(limit).expect("limit"))
                    .collect();
                assert_eq!(
                    read.iter().collect::<Vec<_>>(),
                    expected,
                    "{case}after {after}, limit {limit}"
                );
            }
        }
    }

    /// Decision 123: a stream's batch is stored as rows of up to `ROW_CHUNKS_MAX` chunks, and
    /// every reader gets the same chunks from any seq as if each were a row of its own: names
    /// or none, data with the packing's own separators in it, empty data, text that is not
    /// ASCII; a control chunk after it stays a row of its own.
    #[tokio::test]
    async fn a_batch_is_stored_as_rows_of_up_to_64_chunks_and_read_back_from_any_seq_du7() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = scratch(dir.path()).await;
        let now = 1_000_000;
        let Submitted::Created(created) = store
            .submit(NewRequest::example(0, now))
            .await
            .expect("submit")
        else {
            panic!("expected a new request");
        };
        let leased = store
            .lease_many("node/a", now + 1, 30_000, &LeaseQuota::any(1))
            .await
            .expect("lease");
        let lease = leased[0].0.clone();
        let new = |n: usize| NewChunk {
            event: match n % 3 {
                0 => None,
                1 => Some(format!("event:{n}").into()),
                _ => Some("".into()),
            },
            data: match n % 4 {
                0 => format!("{{\"n\":{n},\"text\":\"12:34:-:\"}}"),
                1 => String::new(),
                2 => format!("é世🙂 {n}\nsecond line"),
                _ => format!("-:{n}:"),
            }
            .into(),
        };
        let batch = |after: i64, chunks: Vec<NewChunk>| ChunkBatch {
            lease: lease.clone(),
            after,
            chunks,
            upstream_request_id: None,
            response_id: None,
            usage: None,
        };
        let first = batch(0, (1..=100).map(new).collect());
        let second = batch(100, vec![new(101)]);
        let third = batch(101, (102..=103).map(new).collect());
        for b in [&first, &second, &third] {
            let stored = store
                .append_chunks(std::slice::from_ref(b))
                .await
                .expect("append");
            assert_eq!(stored[0].as_ref(), Some(&b.stored()), "the stored chunks");
        }
        store
            .cancel("default", created.id, now + 2)
            .await
            .expect("cancel")
            .expect("cancelled");
        let mut all: Vec<Chunk> = [&first, &second, &third]
            .iter()
            .flat_map(|b| b.stored())
            .collect();
        let end = store.chunks_after(created.id, 103, 10).await.expect("read");
        assert_eq!(end.len(), 1, "the end chunk: {end:?}");
        assert_eq!((end[0].seq, end[0].kind), (104, ChunkKind::End));
        let cancelled = crate::store::rules::cancelled();
        assert_eq!(
            &*end[0].data,
            crate::store::rules::end_data(Status::Failed, Some(&cancelled))
        );
        all.extend(end);

        let conn = Connection::open(dir.path().join("t.db")).expect("open");
        let rows: Vec<(i64, i64)> = conn
            .prepare("SELECT seq, count FROM chunks WHERE request_id = ?1 ORDER BY seq")
            .expect("prepare")
            .query_map([created.id.to_string()], |r| Ok((r.get(0)?, r.get(1)?)))
            .expect("query")
            .collect::<Result<_, _>>()
            .expect("rows");
        assert_eq!(
            rows,
            vec![(1, 64), (65, 36), (101, 1), (102, 2)],
            "rows of up to 64 chunks, one chunk a row; the `end` chunk no row (decision 134)"
        );

        reads_back_from_every_seq(&store, created.id, &all, "").await;
        let wanted: Vec<(Uuid, i64)> = (0..=104).map(|after| (created.id, after)).collect();
        for ((id, read), after) in store
            .data_chunks_of(&wanted)
            .await
            .expect("read")
            .into_iter()
            .zip(0..)
        {
            assert_eq!(id, created.id);
            let expected: Vec<&Chunk> = all
                .iter()
                .filter(|c| c.seq > after && c.kind == ChunkKind::Data)
                .collect();
            assert_eq!(
                read.iter().collect::<Vec<_>>(),
                expected,
                "data after {after}"
            );
        }

        // A database written before decision 134 holds the `end` chunk as a row: read once,
        // from any position, in pages of any size.
        let end = all.last().expect("the end chunk");
        conn.execute(
            "INSERT INTO chunks (request_id, seq, attempt, kind, event, data)
             VALUES (?1, ?2, ?3, 'end', NULL, ?4)",
            params![created.id.to_string(), end.seq, end.attempt, end.data],
        )
        .expect("an end row");
        reads_back_from_every_seq(&store, created.id, &all, "with an end row, ").await;
        // Pruned between the read of its row and of its chunks, a request gives no lone `end`:
        // here its chunks are gone and its row stays, as the second read would find them.
        conn.execute(
            "DELETE FROM chunks WHERE request_id = ?1",
            params![created.id.to_string()],
        )
        .expect("chunks gone");
        for after in [0, 50, 102] {
            let read = store
                .chunks_after(created.id, after, 1000)
                .await
                .expect("read");
            assert_eq!(read, Vec::new(), "after {after}: no end without its chunks");
        }
        let read = store.chunks_after(created.id, 103, 10).await.expect("read");
        assert_eq!(
            read.iter().collect::<Vec<_>>(),
            vec![end],
            "the end right after 103"
        );
    }

    #[tokio::test]
    async fn in_memory_and_pathless_urls_are_refused_du1() {
        for url in [
            "sqlite::memory:",
            "sqlite://:memory:",
            "sqlite://",
            "sqlite:?mode=rwc",
        ] {
            let err = SqliteStore::open(url, SqliteSynchronous::Full)
                .await
                .map(|_| ())
                .expect_err(url);
            assert!(
                err.to_string().contains("needs a file path"),
                "{url}: {err}"
            );
        }
    }

    #[tokio::test]
    async fn created_record_matches_the_row_lease_many_takes_each_due_request_once_and_one_commit_fences_each_batch_lc2_lc3()
     {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = scratch(dir.path()).await;
        let now = 1_000_000;
        let mut ids = Vec::new();
        for i in 0..3 {
            let Submitted::Created(created) = store
                .submit(NewRequest::example(i, now + i64::from(i)))
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
            .lease_many("node/a", now + 10, 30_000, &LeaseQuota::any(2))
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
            .lease_many("node/b", now + 10, 30_000, &LeaseQuota::any(10))
            .await
            .expect("lease");
        assert_eq!(rest.len(), 1);
        assert_eq!(rest[0].0.id, ids[2]);
        assert!(
            store
                .lease_many("node/c", now + 10, 30_000, &LeaseQuota::any(10))
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
        stale.owner = format!("{}-lost", stale.owner).into();
        let batches = vec![
            ChunkBatch {
                lease: first[0].0.clone(),
                after: 0,
                chunks: vec![chunk("a1"), chunk("a2")],
                upstream_request_id: Some("req-a".into()),
                response_id: None,
                usage: None,
            },
            ChunkBatch {
                lease: stale,
                after: 0,
                chunks: vec![chunk("x")],
                upstream_request_id: None,
                response_id: None,
                usage: None,
            },
            ChunkBatch {
                lease: rest[0].0.clone(),
                after: 0,
                chunks: vec![chunk("c1")],
                upstream_request_id: None,
                response_id: None,
                usage: None,
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
        // The same batch again (its first write's answer lost) is not stored twice; the next
        // one follows it.
        let again = store.append_chunks(&batches[..1]).await.expect("append");
        assert_eq!(seqs(&again[0]), seqs(&stored[0]));
        let mut next = batches[0].clone();
        next.after = 2;
        let again = store.append_chunks(&[next]).await.expect("append");
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

    /// How many temporary b-trees `sql` opens (`OpenEphemeral` in its program).
    pub(super) fn ephemeral_tables(conn: &Connection, sql: &str) -> usize {
        let mut stmt = conn.prepare(&format!("EXPLAIN {sql}")).expect("explain");
        let n = stmt.parameter_count();
        let params: Vec<rusqlite::types::Value> = vec![rusqlite::types::Value::Null; n];
        stmt.query_map(rusqlite::params_from_iter(params), |r| {
            r.get::<_, String>(1)
        })
        .expect("program")
        .filter(|op| op.as_deref() == Ok("OpenEphemeral"))
        .count()
    }
}
