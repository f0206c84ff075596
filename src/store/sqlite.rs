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
//!   group commit of `docs/architecture.md`, for requests as well as stream chunks.
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
//! about a dozen of them (docs/benchmarks.md, docs/decisions.md). Here a whole job — several
//! statements — is one hop, and a group of jobs is one commit.

use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use rusqlite::{Connection, OpenFlags, OptionalExtension, Row, params};
use tokio::sync::{mpsc, oneshot};
use uuid::Uuid;

use super::row::tokens_of;
use super::row::{RawRecord, col};
use super::rules::{self, Expired, Settle};
use super::{
    Chunk, ChunkBatch, ChunkKind, ClaimKind, Counts, ErrorInfo, Lease, LeaseTo, ListFilter, Millis,
    NewRequest, Outcome, RequestRecord, ResponseRef, Status, Store, StoreError, Submitted, Swept,
    Usage, UsageGroup, UsageQuery, UsageRow,
};
use crate::config::SqliteSynchronous;
use crate::provider::Route;

/// Most write jobs in one transaction. Bounds a commit's duration (and the delay of the first
/// job in it), not its correctness.
const MAX_JOBS_PER_COMMIT: usize = 1024;
/// Reads running at once, and read connections kept open.
const MAX_READERS: usize = 8;
/// WAL file size past which the writer checkpoints it itself ([`bound_wal`]): 1.5 times the
/// automatic checkpoint's 8,192 pages.
const WAL_HARD_LIMIT: u64 = 48 << 20;
/// How often the background thread checkpoints the WAL into the database file.
const CHECKPOINT_EVERY: Duration = Duration::from_millis(100);
/// How long a connection waits for a lock held by another process before failing.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// Schema migrations, applied in order; `PRAGMA user_version` holds the last one applied.
const MIGRATIONS: &[(i64, &str)] = &[
    (1, include_str!("../../migrations/sqlite/0001_requests.sql")),
    (2, include_str!("../../migrations/sqlite/0002_chunks.sql")),
    (
        3,
        include_str!("../../migrations/sqlite/0003_response_ids.sql"),
    ),
    (4, include_str!("../../migrations/sqlite/0004_usage.sql")),
    (
        5,
        include_str!("../../migrations/sqlite/0005_chunks_rowid.sql"),
    ),
    (
        6,
        include_str!("../../migrations/sqlite/0006_request_rows_rebuilt.sql"),
    ),
];

/// The embedded store. Cloning is cheap; the writer and checkpoint threads stop when the last
/// clone is dropped.
#[derive(Clone)]
pub struct SqliteStore {
    inner: Arc<Inner>,
}

struct Inner {
    /// Jobs for the writer thread.
    jobs: mpsc::UnboundedSender<Box<dyn WriteJob>>,
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

/// The file a `sqlite:` URL names ([`crate::config::sqlite_path`]).
fn path_of(url: &str) -> Result<PathBuf, StoreError> {
    crate::config::sqlite_path(url).map_err(StoreError::Config)
}

/// DU-2: one process per SQLite file, enforced by an exclusive lock on `PATH.lock` for as long
/// as the store's writer runs (the kernel releases it when the process dies, however it dies).
/// A second process is refused rather than left to run the first one's requests.
fn lock_database(path: &Path) -> Result<std::fs::File, StoreError> {
    // The file's own name, links resolved: a symbolic link to the database, or a path through
    // one, names the same lock.
    let real = std::fs::canonicalize(path).or_else(|_| {
        // Not created yet: its directory's real path, and its name.
        let parent = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let name = path.file_name().unwrap_or(path.as_os_str());
        std::fs::canonicalize(parent).map(|dir| dir.join(name))
    });
    let real = real.map_err(|e| {
        StoreError::Unavailable(format!("{}: cannot resolve its path: {e}", path.display()))
    })?;
    let mut name = real.into_os_string();
    name.push(".lock");
    let lock_path = PathBuf::from(name);
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|e| {
            StoreError::Unavailable(format!(
                "{}: cannot open its lock file: {e}",
                path.display()
            ))
        })?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(StoreError::Unavailable(format!(
            "{}: another holdfast process is using this database (it holds {}); one process \
             per SQLite file — stop it first, or use PostgreSQL to run several nodes",
            path.display(),
            lock_path.display()
        ))),
        Err(std::fs::TryLockError::Error(e)) => Err(StoreError::Unavailable(format!(
            "{}: cannot lock {}: {e}",
            path.display(),
            lock_path.display()
        ))),
    }
}

/// Under [`lock_database`]'s lock no other process runs anything, so a request still `running`
/// belongs to an attempt of a process that stopped without handing it back (a crash, a kill):
/// its lease is expired now, for the first sweep to recover the request at once instead of
/// `lease_secs` later (decision 41). The sweep applies LC-4 as ever: a `reset`, a recovery
/// counted, or `lease_expired` with no attempts left.
fn expire_orphaned_leases(conn: &Connection) -> Result<(), StoreError> {
    let expired = conn.execute(
        "UPDATE requests SET lease_expires_at = 0 WHERE status = 'running'",
        [],
    )?;
    if expired > 0 {
        tracing::info!(
            requests = expired,
            "requests left running by a stopped holdfast process: their leases expired now, \
             for the first sweep to recover them"
        );
    }
    Ok(())
}

fn configure(conn: &Connection) -> Result<(), StoreError> {
    conn.busy_timeout(BUSY_TIMEOUT)?;
    conn.set_prepared_statement_cache_capacity(64);
    Ok(())
}

fn open_writer(path: &Path, synchronous: SqliteSynchronous) -> Result<Connection, StoreError> {
    let mut conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_WRITE
            | OpenFlags::SQLITE_OPEN_CREATE
            | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    configure(&conn)?;
    let mode: String = conn.query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(StoreError::Config(format!(
            "{}: could not switch to WAL mode (got {mode:?})",
            path.display()
        )));
    }
    conn.execute_batch(match synchronous {
        SqliteSynchronous::Full => "PRAGMA synchronous = FULL",
        SqliteSynchronous::Normal => "PRAGMA synchronous = NORMAL",
    })?;
    // The checkpoint thread copies the WAL back while the writer goes on. Under writes that
    // never pause its PASSIVE rounds never catch up with the commits made meanwhile, and only
    // a checkpoint run by the writer itself lets the WAL start over: SQLite's automatic one
    // stays on as that bound (test `the_wal_stays_bounded_while_writes_never_pause_du2`), at
    // 8,192 pages (32 MiB) so that it is rare and the background rounds have already copied
    // most of what it covers (the measurements behind the number: docs/benchmarks.md). After
    // a burst the file is cut back to `journal_size_limit`.
    // The savepoints of a group run again after a failed write (`commit_group`) journal in
    // memory, not in a temporary file.
    conn.execute_batch(
        "PRAGMA foreign_keys = ON; PRAGMA wal_autocheckpoint = 8192;
         PRAGMA journal_size_limit = 67108864; PRAGMA temp_store = MEMORY",
    )?;
    migrate(&mut conn)?;
    Ok(conn)
}

fn open_reader(path: &Path) -> Result<Connection, StoreError> {
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    configure(&conn)?;
    Ok(conn)
}

/// Applies the [`MIGRATIONS`] newer than the file's `user_version`, each in its own
/// transaction. A file created by an earlier holdfast (sqlx's migrator) records its migrations
/// in `_sqlx_migrations` instead; those count as applied.
fn migrate(conn: &mut Connection) -> Result<(), StoreError> {
    let version = applied_version(conn)?;
    let latest = LATEST_SCHEMA;
    if version > latest {
        return Err(StoreError::Migration(format!(
            "the database is at schema version {version}, newer than this holdfast knows \
             ({latest}); run the newer holdfast"
        )));
    }
    for (n, sql) in MIGRATIONS.iter().filter(|(n, _)| *n > version) {
        let tx = conn.transaction()?;
        tx.execute_batch(sql)?;
        tx.pragma_update(None, "user_version", n)?;
        tx.commit()?;
    }
    Ok(())
}

/// The newest schema version this binary knows.
pub(crate) const LATEST_SCHEMA: i64 = MIGRATIONS[MIGRATIONS.len() - 1].0;

/// The last migration applied to the database on `conn`: `PRAGMA user_version`, or for a file
/// created by the sqlx-based holdfast, its `_sqlx_migrations` table.
fn applied_version(conn: &Connection) -> Result<i64, StoreError> {
    let version: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
    if version != 0 {
        return Ok(version);
    }
    let sqlx_table: bool = conn.query_row(
        "SELECT EXISTS (SELECT 1 FROM sqlite_master
                        WHERE type = 'table' AND name = '_sqlx_migrations')",
        [],
        |r| r.get(0),
    )?;
    if !sqlx_table {
        return Ok(0);
    }
    Ok(conn.query_row(
        "SELECT COALESCE(MAX(version), 0) FROM _sqlx_migrations WHERE success",
        [],
        |r| r.get(0),
    )?)
}

/// The schema version of the database `url` names, read without creating or changing it;
/// `None` when the file does not exist yet.
///
/// # Errors
/// [`StoreError`] when the URL is not usable or the file cannot be read.
pub(crate) fn schema_version(url: &str) -> Result<Option<i64>, StoreError> {
    let path = path_of(url)?;
    if !path.exists() {
        return Ok(None);
    }
    let conn = open_reader(&path)?;
    applied_version(&conn).map(Some)
}

impl SqliteStore {
    /// Opens (creating when missing) the database at `url` (`sqlite://PATH` or `sqlite:PATH`),
    /// applies the migrations in `migrations/sqlite` and starts the writer and checkpoint
    /// threads.
    ///
    /// # Errors
    /// [`StoreError`] when the file cannot be opened, switched to WAL, or migrated.
    pub async fn open(url: &str, synchronous: SqliteSynchronous) -> Result<Self, StoreError> {
        let path = path_of(url)?;
        let opened = {
            let path = path.clone();
            tokio::task::spawn_blocking(move || -> Result<_, StoreError> {
                let lock = lock_database(&path)?;
                let writer = open_writer(&path, synchronous)?;
                expire_orphaned_leases(&writer)?;
                let checkpointer = open_writer(&path, synchronous)?;
                let reader = open_reader(&path)?;
                Ok((lock, writer, checkpointer, reader))
            })
            .await
            .map_err(|e| StoreError::Unavailable(format!("opening the database: {e}")))??
        };
        let (lock, writer, checkpointer, reader) = opened;
        let mut wal = path.clone().into_os_string();
        wal.push("-wal");
        let wal = PathBuf::from(wal);
        let (jobs, queue) = mpsc::unbounded_channel();
        // One checkpoint round at a time: the checkpoint thread's, or the writer's at the WAL's
        // hard limit ([`bound_wal`]).
        let rounds = Arc::new(Mutex::new(()));
        let writer_rounds = Arc::clone(&rounds);
        std::thread::Builder::new()
            .name("holdfast-sqlite-writer".into())
            .spawn(move || {
                // Held until the last write is done.
                let _lock = lock;
                write_loop(writer, queue, wal, &writer_rounds);
            })
            .map_err(|e| StoreError::Unavailable(format!("starting the writer thread: {e}")))?;
        let (stop, stopped) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("holdfast-sqlite-checkpoint".into())
            .spawn(move || checkpoint_loop(checkpointer, stopped, &rounds))
            .map_err(|e| StoreError::Unavailable(format!("starting the checkpoint thread: {e}")))?;
        Ok(SqliteStore {
            inner: Arc::new(Inner {
                jobs,
                readers: ReadPool {
                    path,
                    idle: Mutex::new(vec![reader]),
                    permits: Arc::new(tokio::sync::Semaphore::new(MAX_READERS)),
                },
                _stop_checkpoints: stop,
            }),
        })
    }

    /// Runs `f` as one job of the writer's next group commit and returns its result once that
    /// commit is durable. `f` may run more than once: when another job of its group fails, the
    /// group is rolled back and run again without that job ([`commit_group`]); only the last
    /// run's result counts, and `f` is dropped before its caller is answered.
    async fn write<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnMut(&Connection) -> Result<T, StoreError> + Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        let job = Job {
            run: f,
            result: None,
            reply,
        };
        self.inner
            .jobs
            .send(Box::new(job))
            .map_err(|_| StoreError::Unavailable("the SQLite writer has stopped".into()))?;
        answer.await.map_err(|_| {
            StoreError::Unavailable("the SQLite writer stopped before answering".into())
        })?
    }

    /// Runs `f` on a read-only connection on the blocking pool.
    async fn read<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> Result<T, StoreError> + Send + 'static,
    {
        // At most MAX_READERS reads at once, so every connection opened is kept: opening one
        // (and re-preparing its statements) costs far more than waiting for a free one.
        let permit = Arc::clone(&self.inner.readers.permits)
            .acquire_owned()
            .await
            .map_err(|_| StoreError::Unavailable("the read pool is closed".into()))?;
        let inner = Arc::clone(&self.inner);
        tokio::task::spawn_blocking(move || {
            let result = inner.readers.with(f);
            drop(permit);
            result
        })
        .await
        .map_err(|e| StoreError::Unavailable(format!("read task: {e}")))?
    }
}

/// Read-only connections, opened on demand, at most [`MAX_READERS`] of them.
struct ReadPool {
    path: PathBuf,
    idle: Mutex<Vec<Connection>>,
    /// One per connection that may be in use.
    permits: Arc<tokio::sync::Semaphore>,
}

impl ReadPool {
    fn with<T>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let idle = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let conn = match idle {
            Some(conn) => conn,
            None => open_reader(&self.path)?,
        };
        let result = f(&conn);
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() < MAX_READERS {
            idle.push(conn);
        }
        result
    }
}

/// One write of the group commit, type-erased for the writer's queue.
trait WriteJob: Send {
    /// Runs the write inside the group's transaction, replacing what an earlier run of it
    /// returned. `false`: it failed, roll it back.
    fn run(&mut self, conn: &Connection) -> bool;
    /// Answers the caller once the group is settled; `commit` is the group commit's failure.
    fn reply(self: Box<Self>, commit: Result<(), &str>);
}

struct Job<T, F> {
    run: F,
    /// The last run's result; `None` before the first and after a panic.
    result: Option<Result<T, StoreError>>,
    reply: oneshot::Sender<Result<T, StoreError>>,
}

impl<T, F> WriteJob for Job<T, F>
where
    T: Send + 'static,
    F: FnMut(&Connection) -> Result<T, StoreError> + Send + 'static,
{
    fn run(&mut self, conn: &Connection) -> bool {
        self.result = None;
        let result = (self.run)(conn);
        let keep = result.is_ok();
        self.result = Some(result);
        keep
    }

    fn reply(self: Box<Self>, commit: Result<(), &str>) {
        let Job { run, result, reply } = *self;
        // What the write captured goes first, so its caller gets back sole ownership of what it
        // shared with it.
        drop(run);
        let result = match (result, commit) {
            // The job's own failure wins: it was rolled back whatever the group did.
            (Some(Err(e)), _) => Err(e),
            (Some(Ok(_)), Err(e)) | (None, Err(e)) => Err(StoreError::Unavailable(format!(
                "commit failed, nothing was stored: {e}"
            ))),
            (Some(Ok(value)), Ok(())) => Ok(value),
            (None, Ok(())) => Err(StoreError::Unavailable(
                "the write panicked and was rolled back".into(),
            )),
        };
        // A dropped receiver is a caller that gave up (its request was cancelled).
        let _ = reply.send(result);
    }
}

/// The writer thread: drains the queue into group commits until every sender is gone. After a
/// commit that left the WAL file (`wal`) over [`WAL_HARD_LIMIT`] it checkpoints the WAL itself.
fn write_loop(
    conn: Connection,
    mut queue: mpsc::UnboundedReceiver<Box<dyn WriteJob>>,
    wal: PathBuf,
    rounds: &Mutex<()>,
) {
    let mut group: Vec<Box<dyn WriteJob>> = Vec::with_capacity(MAX_JOBS_PER_COMMIT);
    while let Some(job) = queue.blocking_recv() {
        group.push(job);
        while group.len() < MAX_JOBS_PER_COMMIT {
            match queue.try_recv() {
                Ok(job) => group.push(job),
                Err(_) => break,
            }
        }
        let started = std::time::Instant::now();
        let jobs = group.len();
        let committed = commit_group(&conn, &mut group);
        metrics::histogram!(crate::metrics::SQLITE_COMMIT_SECONDS)
            .record(started.elapsed().as_secs_f64());
        metrics::histogram!(crate::metrics::SQLITE_COMMIT_JOBS).record(jobs as f64);
        match &committed {
            Err(e) => {
                tracing::warn!(error = %e, jobs, "SQLite group commit failed; its writes were rolled back");
            }
            Ok(Committed::WithoutTheFailedJob) => {
                tracing::debug!(jobs, "a write failed; its group was committed without it");
            }
            Ok(Committed::InOnePass) => {}
        }
        let commit = committed.as_ref().map(|_| ()).map_err(String::as_str);
        for job in group.drain(..) {
            job.reply(commit);
        }
        bound_wal(&conn, &wal, rounds);
    }
}

/// The hard bound on the WAL. SQLite's automatic checkpoint (at 8,192 pages) is `PASSIVE`: it
/// gives up silently while the checkpoint thread holds the checkpoint lock, and under writes
/// that never pause the WAL then grows for as long as that thread's round takes. Past
/// [`WAL_HARD_LIMIT`] the writer waits for that round to end — on `rounds`, which the
/// checkpoint thread holds for each round, because SQLite answers a `RESTART` or `TRUNCATE`
/// checkpoint `busy` at once while another checkpoint runs instead of waiting for it — and
/// runs a `TRUNCATE` checkpoint, so the next commit writes the WAL from its start again and
/// the file's size says how much it holds (a `RESTART` leaves it at its high-water mark).
fn bound_wal(conn: &Connection, wal: &Path, rounds: &Mutex<()>) {
    let over = std::fs::metadata(wal).is_ok_and(|m| m.len() > WAL_HARD_LIMIT);
    if !over {
        return;
    }
    let _round = rounds.lock().unwrap_or_else(|e| e.into_inner());
    match conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| {
        r.get::<_, i64>(0)
    }) {
        Ok(0) => {}
        Ok(_) => tracing::warn!(
            "WAL checkpoint at the hard limit was busy (a reader held the WAL); retrying after the next commit"
        ),
        Err(e) => {
            tracing::warn!(error = %e, "WAL checkpoint at the hard limit failed; retrying after the next commit")
        }
    }
}

/// How [`commit_group`] committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Committed {
    /// Every job succeeded in one pass, with no savepoints.
    InOnePass,
    /// A job failed: the group was rolled back and run again without it, each other job in its
    /// own savepoint.
    WithoutTheFailedJob,
}

/// Runs every job of `group` in one transaction and commits it.
///
/// Almost every group succeeds whole, so the first pass runs the jobs with no savepoints: a
/// savepoint makes SQLite copy every page a job touches into its statement journal first,
/// which cost about a tenth of the writer's instructions per request (docs/benchmarks.md).
/// When a job fails or panics, the pass is rolled back and the group is run again without that
/// job, each other job in its own savepoint as before, so a write fails alone and the rest of
/// its group commits (DU-1). Jobs may therefore run twice; only what commits is answered.
fn commit_group(conn: &Connection, group: &mut [Box<dyn WriteJob>]) -> Result<Committed, String> {
    // Prepared once and cached: these run once or twice per write.
    let exec = |sql: &str| conn.prepare_cached(sql)?.execute([]).map(|_| ());
    let run_caught = |job: &mut Box<dyn WriteJob>| {
        std::panic::catch_unwind(AssertUnwindSafe(|| job.run(conn))).unwrap_or(false)
    };
    let rollback = || {
        if !conn.is_autocommit() {
            let _ = conn.execute_batch("ROLLBACK");
        }
    };
    let mut one_pass = || -> rusqlite::Result<Option<usize>> {
        exec("BEGIN IMMEDIATE")?;
        for (i, job) in group.iter_mut().enumerate() {
            if !run_caught(job) {
                return Ok(Some(i));
            }
        }
        exec("COMMIT").map(|()| None)
    };
    let failed = match one_pass() {
        Ok(None) => return Ok(Committed::InOnePass),
        Ok(Some(failed)) => failed,
        Err(e) => {
            rollback();
            return Err(e.to_string());
        }
    };
    rollback();
    let mut without_it = || -> rusqlite::Result<()> {
        exec("BEGIN IMMEDIATE")?;
        for (i, job) in group.iter_mut().enumerate() {
            if i == failed {
                continue;
            }
            exec("SAVEPOINT job")?;
            if !run_caught(job) {
                exec("ROLLBACK TO job")?;
            }
            exec("RELEASE job")?;
        }
        exec("COMMIT")
    };
    without_it()
        .map(|()| Committed::WithoutTheFailedJob)
        .map_err(|e| {
            rollback();
            e.to_string()
        })
}

/// The checkpoint thread: copies committed WAL frames into the database file every
/// [`CHECKPOINT_EVERY`] without blocking the writer's commits (`PASSIVE`), until `stop` is
/// dropped. Each round holds `rounds`, which the writer waits on only past the WAL's hard limit
/// ([`bound_wal`]).
fn checkpoint_loop(conn: Connection, stop: std::sync::mpsc::Receiver<()>, rounds: &Mutex<()>) {
    while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = stop.recv_timeout(CHECKPOINT_EVERY)
    {
        // Held for the round, so the writer's checkpoint at the hard limit waits for it.
        let _round = rounds.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(e) = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(())) {
            tracing::warn!(error = %e, "WAL checkpoint failed; retrying later");
        }
    }
}

fn corrupt(what: impl std::fmt::Display) -> StoreError {
    StoreError::corrupt(None, what)
}

/// Reads a [`RequestRecord`] from `row`, whose columns from `at` on are `request_columns!()`
/// (positions in [`col`], checks in [`RawRecord::into_record`]).
fn record_from_row(row: &Row<'_>, at: usize) -> Result<RequestRecord, StoreError> {
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
        status: row.get(at + col::STATUS)?,
        attempts: row.get(at + col::ATTEMPTS)?,
        recoveries: row.get(at + col::RECOVERIES)?,
        next_retry_at: row.get(at + col::NEXT_RETRY_AT)?,
        error_type: row.get(at + col::ERROR_TYPE)?,
        error_message: row.get(at + col::ERROR_MESSAGE)?,
        error_status: row.get(at + col::ERROR_STATUS)?,
        response_status: row.get(at + col::RESPONSE_STATUS)?,
        response_body: row.get(at + col::RESPONSE_BODY)?,
        upstream_request_id: row.get(at + col::UPSTREAM_REQUEST_ID)?,
        last_seq: row.get(at + col::LAST_SEQ)?,
        reset_seq: row.get(at + col::RESET_SEQ)?,
        created_at: row.get(at + col::CREATED_AT)?,
        updated_at: row.get(at + col::UPDATED_AT)?,
        finished_at: row.get(at + col::FINISHED_AT)?,
        attached: row.get(at + col::ATTACHED)?,
        replayed: row.get(at + col::REPLAYED)?,
        log_reads: row.get(at + col::LOG_READS)?,
        usage: usage_from_row(row, at + col::USAGE)?,
    }
    .into_record()
}

/// The tables a whole record is read from: the request row and its body, written once.
macro_rules! record_tables {
    () => {
        " FROM requests JOIN request_bodies USING (id)"
    };
}

const FETCH_SQL: &str = concat!(
    "SELECT ",
    request_columns!(),
    record_tables!(),
    " WHERE id = ?1"
);

/// Reads request `id`, any namespace.
fn fetch(conn: &Connection, id: &str) -> Result<Option<RequestRecord>, StoreError> {
    let mut stmt = conn.prepare_cached(FETCH_SQL)?;
    let mut rows = stmt.query(params![id])?;
    match rows.next()? {
        Some(row) => Ok(Some(record_from_row(row, 0)?)),
        None => Ok(None),
    }
}

/// Deletes the claims pointing at `id` (ID-6).
fn release_claims(conn: &Connection, id: &str) -> Result<(), StoreError> {
    conn.prepare_cached("DELETE FROM claims WHERE request_id = ?1")?
        .execute(params![id])?;
    Ok(())
}

/// The rest of a write that made request `id` terminal ([`rules::settle`]): its claims released
/// if the rule says so, its `end` chunk at `end_seq` when the seq is already reserved, else
/// after the last seq.
fn settle_in(
    conn: &Connection,
    id: &str,
    attempt: i64,
    settle: &Settle,
    end_seq: Option<i64>,
) -> Result<(), StoreError> {
    if settle.release_claim {
        release_claims(conn, id)?;
    }
    match end_seq {
        Some(seq) => insert_control(conn, id, seq, attempt, ChunkKind::End, &settle.end),
        None => append_control(conn, id, attempt, ChunkKind::End, &settle.end).map(|_| ()),
    }
}

/// Appends one control chunk (`reset` or `end`) after the request's last seq; a `reset` also
/// moves `reset_seq` (LC-8, RD-5, RD-6). Returns its seq.
fn append_control(
    conn: &Connection,
    id: &str,
    attempt: i64,
    kind: ChunkKind,
    data: &str,
) -> Result<i64, StoreError> {
    let seq: i64 = conn
        .prepare_cached(
            "UPDATE requests SET last_seq = last_seq + 1,
                 reset_seq = CASE WHEN ?2 = 'reset' THEN last_seq + 1 ELSE reset_seq END
             WHERE id = ?1
             RETURNING last_seq",
        )?
        .query_row(params![id, kind.as_str()], |r| r.get(0))?;
    insert_control(conn, id, seq, attempt, kind, data)?;
    Ok(seq)
}

const INSERT_CONTROL_SQL: &str = "INSERT INTO chunks (request_id, seq, attempt, kind, event, data)
     VALUES (?1, ?2, ?3, ?4, NULL, ?5)";

/// Inserts a control chunk at `seq`, already reserved in `last_seq` by the caller.
fn insert_control(
    conn: &Connection,
    id: &str,
    seq: i64,
    attempt: i64,
    kind: ChunkKind,
    data: &str,
) -> Result<(), StoreError> {
    conn.prepare_cached(INSERT_CONTROL_SQL)?.execute(params![
        id,
        seq,
        attempt,
        kind.as_str(),
        data
    ])?;
    Ok(())
}

/// The record of a request just inserted by [`Store::submit`], as the row's column defaults
/// make it: pending and due now, or `leased` (running its first attempt); no chunks.
fn created_record(new: NewRequest, leased: bool) -> RequestRecord {
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
        status: if leased {
            Status::Running
        } else {
            Status::Pending
        },
        attempts: u32::from(leased),
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
        attached: 0,
        replayed: 0,
        log_reads: 0,
        usage: Usage::default(),
    }
}

fn chunk_from_row(row: &Row<'_>) -> Result<Chunk, StoreError> {
    let kind: String = row.get(2)?;
    Ok(Chunk {
        seq: row.get(0)?,
        attempt: u32::try_from(row.get::<_, i64>(1)?).map_err(corrupt)?,
        kind: ChunkKind::parse(&kind).ok_or_else(|| corrupt(format!("chunk kind {kind:?}")))?,
        event: row.get(3)?,
        data: row.get(4)?,
    })
}

fn parse_id(s: &str) -> Result<Uuid, StoreError> {
    Uuid::parse_str(s).map_err(|e| corrupt(format!("id {s:?}: {e}")))
}

/// Inserts a claim, takes over an expired one, or leaves a live one untouched (ID-7).
const CLAIM_SQL: &str =
    "INSERT INTO claims (namespace, claim_key, kind, request_id, fingerprint, expires_at)
     VALUES (?1, ?2, ?3, ?4, ?5, ?6)
     ON CONFLICT (namespace, claim_key) DO UPDATE SET
         kind = excluded.kind, request_id = excluded.request_id,
         fingerprint = excluded.fingerprint, expires_at = excluded.expires_at
     WHERE claims.expires_at <= ?7";

/// Inserts a request, pending, or running its first attempt when `?10` (the lease owner) is set.
const INSERT_REQUEST_SQL: &str =
    "INSERT INTO requests (id, namespace, route, backend, model, stream, hash, claim_kind,
         status, attempts, lease_owner, lease_expires_at, next_retry_at, created_at, updated_at)
     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8,
         CASE WHEN ?10 IS NULL THEN 'pending' ELSE 'running' END,
         CASE WHEN ?10 IS NULL THEN 0 ELSE 1 END, ?10, ?11, ?9, ?9, ?9)";

/// Stores a request's body and headers, apart from its row: the row is rewritten at every
/// update, they never change (decision 35).
const INSERT_BODY_SQL: &str = "INSERT INTO request_bodies (id, body, headers) VALUES (?1, ?2, ?3)";

/// What [`submit_in`] did: [`Submitted`] without the created record, which is `new` as
/// inserted ([`created_record`]).
enum SubmittedIn {
    Created,
    Attached(Box<RequestRecord>),
    KeyMismatch { existing: Uuid },
}

/// [`Store::submit_and_lease`] inside the writer's transaction: with `lease`, a created
/// request is inserted already leased.
fn submit_in(
    conn: &Connection,
    new: &NewRequest,
    lease: Option<LeaseTo<'_>>,
) -> Result<(SubmittedIn, Option<Lease>), StoreError> {
    let id = new.id.to_string();
    // The upsert inserts our claim or takes over an expired one — one row changed, the claim
    // is ours — or leaves a live one untouched. One statement on the only writer, so two racing
    // submissions cannot both win (ID-7). The count of changed rows says which, not a
    // `RETURNING`, which SQLite serves through a temporary b-tree per statement.
    let won = conn.prepare_cached(CLAIM_SQL)?.execute(params![
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
        conn.prepare_cached(INSERT_REQUEST_SQL)?.execute(params![
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
        conn.prepare_cached(INSERT_BODY_SQL)?
            .execute(params![id, new.body, headers])?;
        let lease = owner.map(|owner| Lease {
            id: new.id,
            owner: owner.to_string(),
            attempt: 1,
        });
        // The row is exactly what was just inserted: the caller builds the record from `new`.
        return Ok((SubmittedIn::Created, lease));
    }

    let (existing, fingerprint): (String, Vec<u8>) = conn
        .prepare_cached(
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
    usage_assignments!("?7", "?8", "?9", "?10", "?11"),
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
    usage_assignments!("?10", "?11", "?12", "?13", "?14"),
    " WHERE id = ?8 AND lease_owner = ?9 AND status = 'running'"
);

/// [`Store::finish_read`] inside the writer's transaction: the record as the write left it, or
/// `None` when the lease was lost and nothing was written.
///
/// The fenced `UPDATE` is followed by a read of the row it changed, by primary key, rather than
/// an `UPDATE ... RETURNING`: SQLite buffers `RETURNING` rows in a temporary b-tree it creates
/// and drops for every statement, which costs more than the read.
fn finish_in(
    conn: &Connection,
    lease: &Lease,
    outcome: &Outcome,
    now: Millis,
) -> Result<Option<RequestRecord>, StoreError> {
    let id = lease.id.to_string();
    let changed = match outcome {
        Outcome::Succeeded {
            status,
            body,
            upstream_request_id,
            usage,
            ..
        } => {
            let u = tokens_of(usage.as_ref());
            conn.prepare_cached(FINISH_SUCCEEDED_SQL)?.execute(params![
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
                u[4]
            ])?
        }
        Outcome::Retry {
            next_retry_at,
            error,
        } => conn.prepare_cached(FINISH_RETRY_SQL)?.execute(params![
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
            conn.prepare_cached(FINISH_FAILED_SQL)?.execute(params![
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
                u[4]
            ])?
        }
    };
    if changed == 0 {
        return Ok(None);
    }
    let record = fetch(conn, &id)?
        .ok_or_else(|| StoreError::corrupt(Some(lease.id), "the finished row is gone"))?;
    if let Outcome::Succeeded {
        response_id: Some(response_id),
        ..
    } = outcome
    {
        insert_response_id(conn, response_id, &id, lease.attempt)?;
    }
    if let Outcome::Succeeded {
        usage: Some(usage), ..
    }
    | Outcome::Failed {
        usage: Some(usage), ..
    } = outcome
    {
        upsert_usage(conn, &id, lease.attempt, usage)?;
    }
    if record.status.is_terminal() {
        let settle = rules::settle(record.status, record.error.as_ref(), record.claim);
        // The end chunk's seq was reserved by the UPDATE above.
        let attempt = i64::from(record.attempts);
        settle_in(conn, &id, attempt, &settle, Some(record.last_seq))?;
    }
    Ok(Some(record))
}

/// [`Store::sweep`] inside the writer's transaction: each expired lease gets the verdict of
/// [`rules::expired`]. Ids as stored.
fn sweep_in(
    conn: &Connection,
    now: Millis,
    max_attempts: u32,
) -> Result<(Vec<String>, Vec<String>), StoreError> {
    let expired: Vec<(String, String, i64, i64, i64)> = conn
        .prepare_cached(
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
                fail_abandoned_in(conn, &id, claim, attempts, &error, now)?;
                failed.push(id);
            }
            Expired::Recover { reset } => {
                conn.prepare_cached(
                    "UPDATE requests SET status = 'pending', recoveries = recoveries + 1,
                         next_retry_at = ?1, lease_owner = NULL, lease_expires_at = NULL,
                         updated_at = ?1
                     WHERE id = ?2",
                )?
                .execute(params![now, id])?;
                if let Some((attempt, data)) = reset {
                    append_control(conn, &id, i64::from(attempt), ChunkKind::Reset, &data)?;
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

/// Stores one provider event at a reserved seq.
const APPEND_CHUNK_SQL: &str = "INSERT INTO chunks (request_id, seq, attempt, kind, event, data)
     VALUES (?1, ?2, ?3, 'data', ?4, ?5)";

/// [`Store::append_chunks`] inside the writer's transaction. With the statements prepared once
/// and no thread hop per statement, a fenced `UPDATE` per batch and an `INSERT` per chunk cost
/// microseconds each; the commit, shared by every batch, is the expensive part.
fn append_in(
    conn: &Connection,
    batches: &[ChunkBatch],
) -> Result<Vec<Option<Vec<Chunk>>>, StoreError> {
    let mut fence = conn.prepare_cached(APPEND_FENCE_SQL)?;
    let mut leased_last_seq = conn.prepare_cached(LEASED_LAST_SEQ_SQL)?;
    let mut insert = conn.prepare_cached(APPEND_CHUNK_SQL)?;
    let mut results = Vec::with_capacity(batches.len());
    for batch in batches {
        let id = batch.lease.id.to_string();
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
        for chunk in &stored {
            insert.execute(params![
                id,
                chunk.seq,
                i64::from(chunk.attempt),
                chunk.event,
                chunk.data
            ])?;
        }
        if let Some(response_id) = &batch.response_id {
            insert_response_id(conn, response_id, &id, batch.lease.attempt)?;
        }
        if let Some(usage) = &batch.usage {
            upsert_usage(conn, &id, batch.lease.attempt, usage)?;
        }
        results.push(Some(stored));
    }
    Ok(results)
}

/// Records that `response_id` is the provider's id of attempt `attempt` of request `id`. An id
/// already recorded keeps its first owner (providers do not reuse ids).
fn insert_response_id(
    conn: &Connection,
    response_id: &str,
    id: &str,
    attempt: u32,
) -> Result<(), StoreError> {
    conn.prepare_cached(
        "INSERT INTO response_ids (response_id, namespace, request_id, attempt)
         SELECT ?1, namespace, id, ?3 FROM requests WHERE id = ?2
         ON CONFLICT (response_id) DO NOTHING",
    )?
    .execute(params![response_id, id, i64::from(attempt)])?;
    Ok(())
}

const UPSERT_USAGE_SQL: &str = "INSERT INTO attempt_usage (request_id, attempt, input_tokens,
         output_tokens, cached_input_tokens, cache_write_tokens, reasoning_tokens)
     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)
     ON CONFLICT (request_id, attempt) DO UPDATE SET
         input_tokens = excluded.input_tokens, output_tokens = excluded.output_tokens,
         cached_input_tokens = excluded.cached_input_tokens,
         cache_write_tokens = excluded.cache_write_tokens,
         reasoning_tokens = excluded.reasoning_tokens";

/// Records `usage` as attempt `attempt`'s of request `id`, replacing what was recorded before
/// (usage is reported cumulatively).
fn upsert_usage(
    conn: &Connection,
    id: &str,
    attempt: u32,
    usage: &Usage,
) -> Result<(), StoreError> {
    let u = tokens_of(Some(usage));
    conn.prepare_cached(UPSERT_USAGE_SQL)?.execute(params![
        id,
        i64::from(attempt),
        u[0],
        u[1],
        u[2],
        u[3],
        u[4]
    ])?;
    Ok(())
}

/// A usage row's five token columns from `at` on.
fn usage_from_row(row: &Row<'_>, at: usize) -> Result<Usage, StoreError> {
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
    })
}

/// `Store::usage`'s statement around its group key: per (key, backend, model), the request
/// counts and the token sums of every attempt and of the saved calls (saved calls times the
/// answering attempt's usage). A request's saved calls are `RequestRecord::saved_calls`:
/// deliveries minus attempts, at least one attempt subtracted, never below zero.
const USAGE_SQL_HEAD: &str = "SELECT ";
const USAGE_SQL_TAIL: &str = " AS key, r.backend, r.model,
        COUNT(*), SUM(r.attempts), SUM(1 + r.attached + r.replayed), SUM(r.attached),
        SUM(r.replayed), SUM(r.saved),
        SUM(u.input_tokens), SUM(u.output_tokens), SUM(u.cached_input_tokens),
        SUM(u.cache_write_tokens), SUM(u.reasoning_tokens),
        SUM(r.saved * a.input_tokens), SUM(r.saved * a.output_tokens),
        SUM(r.saved * a.cached_input_tokens), SUM(r.saved * a.cache_write_tokens),
        SUM(r.saved * a.reasoning_tokens)
    FROM (SELECT *, MAX(1 + attached + replayed - MAX(attempts, 1), 0) AS saved
          FROM requests) r
    LEFT JOIN (SELECT request_id, SUM(input_tokens) AS input_tokens,
                   SUM(output_tokens) AS output_tokens,
                   SUM(cached_input_tokens) AS cached_input_tokens,
                   SUM(cache_write_tokens) AS cache_write_tokens,
                   SUM(reasoning_tokens) AS reasoning_tokens
               FROM attempt_usage GROUP BY request_id) u ON u.request_id = r.id
    LEFT JOIN attempt_usage a ON a.request_id = r.id AND a.attempt = r.attempts
    WHERE (?1 IS NULL OR r.namespace = ?1) AND r.created_at >= ?2 AND r.created_at < ?3
    GROUP BY key, r.backend, r.model
    ORDER BY key, r.backend, r.model";

/// [`Store::cancel`] inside the writer's transaction.
fn cancel_in(
    conn: &Connection,
    namespace: &str,
    id: &str,
    now: Millis,
) -> Result<Option<RequestRecord>, StoreError> {
    let error = rules::cancelled();
    let cancelled: Option<(String, i64)> = conn
        .prepare_cached(concat!(
            "UPDATE requests SET status = 'failed', error_type = ?4,
                 error_message = ?5, error_status = NULL,
                 lease_owner = NULL, lease_expires_at = NULL, finished_at = ?1, updated_at = ?1, ",
            usage_from_current_attempt!(),
            " WHERE id = ?2 AND namespace = ?3 AND status IN ('pending', 'running')
             RETURNING claim_kind, attempts"
        ))?
        .query_row(
            params![now, id, namespace, error.kind.as_str(), error.message],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .optional()?;
    if let Some((claim, attempts)) = &cancelled {
        let claim = ClaimKind::parse(claim).ok_or_else(|| {
            StoreError::corrupt(parse_id(id).ok(), format!("claim_kind {claim:?}"))
        })?;
        let settle = rules::settle(Status::Failed, Some(&error), claim);
        settle_in(conn, id, *attempts, &settle, None)?;
    }
    Ok(fetch(conn, id)?.filter(|r| r.namespace == namespace))
}

/// Fails request `id`, whose last attempt was abandoned (its lease expired, or it was handed
/// back at shutdown), with `error`: the lease cleared, the current attempt's usage copied,
/// then [`rules::settle`] (`end` chunk, claim).
fn fail_abandoned_in(
    conn: &Connection,
    id: &str,
    claim: ClaimKind,
    attempts: u32,
    error: &ErrorInfo,
    now: Millis,
) -> Result<(), StoreError> {
    conn.prepare_cached(concat!(
        "UPDATE requests SET status = 'failed', error_type = ?2, error_message = ?3,
             error_status = NULL, lease_owner = NULL, lease_expires_at = NULL,
             finished_at = ?1, updated_at = ?1, ",
        usage_from_current_attempt!(),
        " WHERE id = ?4"
    ))?
    .execute(params![now, error.kind.as_str(), error.message, id])?;
    let settle = rules::settle(Status::Failed, Some(error), claim);
    settle_in(conn, id, i64::from(attempts), &settle, None)
}

/// [`Store::release`] inside the writer's transaction.
fn release_in(
    conn: &Connection,
    lease: &Lease,
    now: Millis,
    max_attempts: u32,
) -> Result<bool, StoreError> {
    let id = lease.id.to_string();
    let held: Option<(String, i64, i64, i64)> = conn
        .prepare_cached(
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
        Expired::Fail(error) => fail_abandoned_in(conn, &id, claim, attempts, &error, now)?,
        Expired::Recover { reset } => {
            conn.prepare_cached(
                "UPDATE requests SET status = 'pending', next_retry_at = ?1, lease_owner = NULL,
                     lease_expires_at = NULL, updated_at = ?1
                 WHERE id = ?2",
            )?
            .execute(params![now, id])?;
            if let Some((attempt, data)) = reset {
                append_control(conn, &id, i64::from(attempt), ChunkKind::Reset, &data)?;
            }
        }
    }
    Ok(true)
}

/// [`Store::prune`] inside the writer's transaction.
fn prune_in(conn: &Connection, before: Millis, limit: i64) -> Result<u64, StoreError> {
    let ids: Vec<String> = conn
        .prepare_cached(
            "SELECT id FROM requests
             WHERE finished_at IS NOT NULL AND finished_at < ?1
             ORDER BY finished_at LIMIT ?2",
        )?
        .query_map(params![before, limit], |r| r.get(0))?
        .collect::<Result<_, _>>()?;
    for id in &ids {
        for sql in [
            "DELETE FROM chunks WHERE request_id = ?1",
            "DELETE FROM claims WHERE request_id = ?1",
            "DELETE FROM response_ids WHERE request_id = ?1",
            "DELETE FROM attempt_usage WHERE request_id = ?1",
            "DELETE FROM request_bodies WHERE id = ?1",
            "DELETE FROM requests WHERE id = ?1",
        ] {
            conn.prepare_cached(sql)?.execute(params![id])?;
        }
    }
    Ok(ids.len() as u64)
}

/// Leases request `?4` ([`lease_in`]).
const LEASE_SQL: &str = "UPDATE requests SET status = 'running', attempts = attempts + 1,
         lease_owner = ?1, lease_expires_at = ?2, updated_at = ?3
     WHERE id = ?4";

/// Leases request `id`, chosen by [`due_ids`] in the same job, to `owner` (LC-2), and reads it.
fn lease_in(
    conn: &Connection,
    id: &str,
    owner: String,
    now: Millis,
    lease_ms: i64,
) -> Result<(Lease, RequestRecord), StoreError> {
    conn.prepare_cached(LEASE_SQL)?
        .execute(params![owner, now + lease_ms, now, id])?;
    let record = fetch(conn, id)?.ok_or_else(|| corrupt(format!("leased request {id} is gone")))?;
    let lease = Lease {
        id: record.id,
        owner,
        attempt: record.attempts,
    };
    Ok((lease, record))
}

/// Up to `?2` pending requests due at `?1`, oldest first, in the order of index `requests_due`.
const DUE_IDS_SQL: &str = "SELECT id FROM requests WHERE status = 'pending' AND next_retry_at <= ?1
     ORDER BY next_retry_at, id LIMIT ?2";

/// Up to `limit` pending requests due at `now`, oldest first.
fn due_ids(conn: &Connection, now: Millis, limit: i64) -> Result<Vec<String>, StoreError> {
    Ok(conn
        .prepare_cached(DUE_IDS_SQL)?
        .query_map(params![now, limit], |r| r.get(0))?
        .collect::<Result<_, _>>()?)
}

#[async_trait]
impl Store for SqliteStore {
    async fn submit_and_lease(
        &self,
        new: NewRequest,
        lease: Option<LeaseTo<'_>>,
    ) -> Result<(Submitted, Option<Lease>), StoreError> {
        let lease = lease.map(|l| (l.owner.to_string(), l.lease_ms));
        // Shared with the write, which may run more than once, and whole again once it has
        // run: the created record is built from it without a copy.
        let new = Arc::new(new);
        let shared = Arc::clone(&new);
        let (submitted, lease) = self
            .write(move |conn| {
                let lease = lease.as_ref().map(|(owner, lease_ms)| LeaseTo {
                    owner,
                    lease_ms: *lease_ms,
                });
                submit_in(conn, &shared, lease)
            })
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

    async fn get(&self, namespace: &str, id: Uuid) -> Result<Option<RequestRecord>, StoreError> {
        let namespace = namespace.to_string();
        self.read(
            move |conn| Ok(fetch(conn, &id.to_string())?.filter(|r| r.namespace == namespace)),
        )
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
        limit: usize,
    ) -> Result<Vec<(Lease, RequestRecord)>, StoreError> {
        let owner_prefix = owner_prefix.to_string();
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        self.write(move |conn| {
            // Chosen, then leased, oldest first, in one job of the only writer: atomic like
            // `lease`, for up to `limit` rows.
            due_ids(conn, now, limit)?
                .into_iter()
                .map(|id| {
                    let owner = format!("{owner_prefix}/{id}");
                    lease_in(conn, &id, owner, now, lease_ms)
                })
                .collect()
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
                .prepare_cached(
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
        outcome: &Outcome,
        now: Millis,
    ) -> Result<Option<RequestRecord>, StoreError> {
        let (lease, outcome) = (lease.clone(), outcome.clone());
        self.write(move |conn| finish_in(conn, &lease, &outcome, now))
            .await
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
        if batches.is_empty() {
            return Ok(Vec::new());
        }
        let batches = batches.to_vec();
        self.write(move |conn| append_in(conn, &batches)).await
    }

    fn ends_streams_in_one_write(&self) -> bool {
        true
    }

    async fn finish_with_chunks(
        &self,
        last: &ChunkBatch,
        outcome: &Outcome,
        now: Millis,
    ) -> Result<Option<(Vec<Chunk>, RequestRecord)>, StoreError> {
        let (last, outcome) = (last.clone(), outcome.clone());
        self.write(move |conn| {
            let Some(chunks) = append_in(conn, std::slice::from_ref(&last))?
                .pop()
                .flatten()
            else {
                return Ok(None);
            };
            // The same transaction holds the lease the append was fenced on; an error rolls
            // the chunks back with it.
            let record = finish_in(conn, &last.lease, &outcome, now)?.ok_or_else(|| {
                StoreError::corrupt(Some(last.lease.id), "the lease was lost inside one write")
            })?;
            Ok(Some((chunks, record)))
        })
        .await
    }

    async fn chunks_after(
        &self,
        id: Uuid,
        after: i64,
        limit: i64,
    ) -> Result<Vec<Chunk>, StoreError> {
        self.read(move |conn| {
            let mut stmt = conn.prepare_cached(
                "SELECT seq, attempt, kind, event, data FROM chunks
                 WHERE request_id = ?1 AND seq > ?2 ORDER BY seq LIMIT ?3",
            )?;
            let mut rows = stmt.query(params![id.to_string(), after, limit])?;
            let mut chunks = Vec::new();
            while let Some(row) = rows.next()? {
                chunks.push(chunk_from_row(row)?);
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
            let mut stmt = conn.prepare_cached(concat!(
                "SELECT ",
                request_columns!(),
                record_tables!(),
                " WHERE (?1 IS NULL OR namespace = ?1) AND (?2 IS NULL OR status = ?2)
                     AND (?3 IS NULL OR route = ?3) AND (?4 IS NULL OR model = ?4)
                     AND (?5 IS NULL OR backend = ?5) AND (?6 IS NULL OR created_at >= ?6)
                     AND (?7 IS NULL OR created_at < ?7)
                     AND (?8 IS NULL OR instr(body, CAST(?8 AS BLOB)) > 0)
                     AND (?9 = 0 OR attached + replayed > 0)
                     AND (?10 IS NULL OR id < ?10)
                 ORDER BY id DESC LIMIT ?11"
            ))?;
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
                f.limit
            ])?;
            let mut records = Vec::new();
            while let Some(row) = rows.next()? {
                records.push(record_from_row(row, 0)?);
            }
            Ok(records)
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

    async fn prune(&self, before: Millis, limit: i64) -> Result<u64, StoreError> {
        self.write(move |conn| prune_in(conn, before, limit)).await
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
                     cache_write_tokens, reasoning_tokens
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

    async fn add_counts(&self, counts: &[Counts]) -> Result<(), StoreError> {
        let counts: Arc<[Counts]> = counts.into();
        self.write(move |conn| {
            let mut stmt = conn.prepare_cached(
                "UPDATE requests SET attached = attached + ?2, replayed = replayed + ?3,
                     log_reads = log_reads + ?4
                 WHERE id = ?1",
            )?;
            for c in counts.iter() {
                stmt.execute(params![
                    c.id.to_string(),
                    c.attached,
                    c.replayed,
                    c.log_reads
                ])?;
            }
            Ok(())
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
            };
            let sql = format!("{}{key}{}", USAGE_SQL_HEAD, USAGE_SQL_TAIL);
            let mut stmt = conn.prepare_cached(&sql)?;
            let mut rows = stmt.query(params![query.namespace, query.since, query.until])?;
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
                    saved: usage_from_row(row, 14)?,
                });
            }
            Ok(out)
        })
        .await
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::NewChunk;

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
        let url = format!("sqlite://{}", dir.path().join("t.db").display());
        let store = SqliteStore::open(&url, SqliteSynchronous::Normal)
            .await
            .expect("open");
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
    type Answer = oneshot::Receiver<Result<i64, StoreError>>;

    /// A job for [`commit_group`] and the receiver of its answer.
    fn job(
        f: impl FnMut(&Connection) -> Result<i64, StoreError> + Send + 'static,
    ) -> (Box<dyn WriteJob>, Answer) {
        let (reply, answer) = oneshot::channel();
        let job = Job {
            run: f,
            result: None,
            reply,
        };
        (Box::new(job), answer)
    }

    fn insert(n: i64) -> impl FnMut(&Connection) -> Result<i64, StoreError> + Send + 'static {
        move |conn| {
            conn.execute("INSERT INTO t (n) VALUES (?1)", params![n])?;
            Ok(n)
        }
    }

    /// Runs `jobs` as one group the way the writer thread does and returns every answer.
    fn run_group(
        conn: &Connection,
        jobs: Vec<(Box<dyn WriteJob>, Answer)>,
    ) -> (Result<Committed, String>, Vec<Result<i64, StoreError>>) {
        let (mut group, mut answers): (Vec<_>, Vec<_>) = jobs.into_iter().unzip();
        let committed = commit_group(conn, &mut group);
        let commit = committed.as_ref().map(|_| ()).map_err(String::as_str);
        for job in group.drain(..) {
            job.reply(commit);
        }
        let answers = answers
            .iter_mut()
            .map(|a| a.try_recv().expect("answered"))
            .collect();
        (committed, answers)
    }

    fn scratch() -> (tempfile::TempDir, Connection) {
        let dir = tempfile::tempdir().expect("tempdir");
        let conn = open_writer(&dir.path().join("t.db"), SqliteSynchronous::Normal).expect("open");
        conn.execute_batch("CREATE TABLE t (n INTEGER NOT NULL, pad BLOB)")
            .expect("table");
        (dir, conn)
    }

    fn stored(conn: &Connection) -> Vec<i64> {
        conn.prepare("SELECT n FROM t ORDER BY n")
            .expect("prepare")
            .query_map([], |r| r.get(0))
            .expect("query")
            .collect::<Result<_, _>>()
            .expect("rows")
    }

    #[test]
    fn a_panicking_job_fails_alone_and_its_group_commits_the_rest_du1() {
        let (_dir, conn) = scratch();
        let (committed, answers) = run_group(
            &conn,
            vec![
                job(insert(1)),
                job(|conn| {
                    conn.execute("INSERT INTO t (n) VALUES (2)", [])?;
                    panic!("a bug in a job");
                }),
                job(insert(3)),
            ],
        );
        assert_eq!(committed, Ok(Committed::WithoutTheFailedJob));
        assert!(matches!(answers[0], Ok(1)), "{:?}", answers[0]);
        assert!(
            matches!(&answers[1], Err(StoreError::Unavailable(m)) if m.contains("panicked")),
            "{:?}",
            answers[1]
        );
        assert!(matches!(answers[2], Ok(3)), "{:?}", answers[2]);
        assert_eq!(
            stored(&conn),
            vec![1, 3],
            "the panicked job's write rolled back"
        );
        assert!(conn.is_autocommit());
    }

    #[test]
    fn a_group_of_good_writes_commits_in_one_pass_and_one_bad_write_is_left_out_of_a_second_du1() {
        let (_dir, conn) = scratch();
        let (committed, answers) = run_group(&conn, vec![job(insert(1)), job(insert(2))]);
        assert_eq!(committed, Ok(Committed::InOnePass));
        assert!(matches!(answers[..], [Ok(1), Ok(2)]), "{answers:?}");
        // The bad write fails in the first pass after job 3 has run; that pass is rolled back
        // and the second stores 3 and 5 once each, and the bad write's first insert not at all.
        let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = Arc::clone(&runs);
        let (committed, answers) = run_group(
            &conn,
            vec![
                job(move |conn| {
                    counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    insert(3)(conn)
                }),
                job(|conn| {
                    conn.execute("INSERT INTO t (n) VALUES (4)", [])?;
                    conn.execute("INSERT INTO t (n) VALUES (NULL)", [])?;
                    Ok(4)
                }),
                job(insert(5)),
            ],
        );
        assert_eq!(committed, Ok(Committed::WithoutTheFailedJob));
        assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 2);
        assert!(matches!(answers[0], Ok(3)), "{:?}", answers[0]);
        assert!(answers[1].is_err(), "{:?}", answers[1]);
        assert!(matches!(answers[2], Ok(5)), "{:?}", answers[2]);
        assert_eq!(stored(&conn), vec![1, 2, 3, 5]);
        assert!(conn.is_autocommit());
    }

    #[test]
    fn a_full_disk_fails_the_write_that_hit_it_and_every_acknowledged_write_is_stored_du1() {
        let (_dir, conn) = scratch();
        // Disk full, simulated: the file may not grow past its current size plus a little.
        let pages: i64 = conn
            .query_row("PRAGMA page_count", [], |r| r.get(0))
            .expect("page_count");
        conn.execute_batch(&format!("PRAGMA max_page_count = {}", pages + 4))
            .expect("cap");
        let big = |n: i64| {
            move |conn: &Connection| -> Result<i64, StoreError> {
                conn.execute(
                    "INSERT INTO t (n, pad) VALUES (?1, zeroblob(1000000))",
                    params![n],
                )?;
                Ok(n)
            }
        };
        let (committed, answers) =
            run_group(&conn, vec![job(insert(1)), job(big(2)), job(insert(3))]);
        let acknowledged: Vec<i64> = answers
            .iter()
            .filter_map(|a| a.as_ref().ok())
            .copied()
            .collect();
        assert!(answers[1].is_err(), "{:?}", answers[1]);
        assert_eq!(
            stored(&conn),
            acknowledged,
            "stored == acknowledged (commit: {committed:?}, answers: {answers:?})"
        );
        assert!(conn.is_autocommit(), "no transaction left open");
        // The writer goes on once space is back.
        conn.execute_batch("PRAGMA max_page_count = 1000000")
            .expect("uncap");
        let (committed, answers) = run_group(&conn, vec![job(insert(4))]);
        assert_eq!(committed, Ok(Committed::InOnePass));
        assert!(matches!(answers[0], Ok(4)));
    }

    #[test]
    fn a_failed_commit_fails_every_job_of_the_group_and_stores_none_of_them_du1() {
        let (dir, conn) = scratch();
        // Deferred foreign keys are checked at COMMIT: the commit itself fails.
        conn.execute_batch(
            "CREATE TABLE parent (id INTEGER PRIMARY KEY);
             CREATE TABLE child (p INTEGER REFERENCES parent (id) DEFERRABLE INITIALLY DEFERRED)",
        )
        .expect("tables");
        let (committed, answers) = run_group(
            &conn,
            vec![
                job(insert(1)),
                job(|conn| {
                    conn.execute("INSERT INTO child (p) VALUES (42)", [])?;
                    Ok(2)
                }),
                job(insert(3)),
            ],
        );
        assert!(committed.is_err(), "{committed:?}");
        for a in &answers {
            assert!(
                matches!(a, Err(StoreError::Unavailable(m)) if m.contains("commit failed")),
                "{a:?}"
            );
        }
        assert_eq!(stored(&conn), Vec::<i64>::new());
        assert!(conn.is_autocommit());
        let other = Connection::open(dir.path().join("t.db")).expect("open");
        assert_eq!(stored(&other), Vec::<i64>::new());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_wal_stays_bounded_while_writes_never_pause_du2() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = dir.path().join("t.db");
        let url = format!("sqlite://{}", db.display());
        let store = SqliteStore::open(&url, SqliteSynchronous::Normal)
            .await
            .expect("open");
        let deadline = std::time::Instant::now() + Duration::from_secs(4);
        let mut tasks = Vec::new();
        for t in 0..16u32 {
            let store = store.clone();
            tasks.push(tokio::spawn(async move {
                let mut n = 0u64;
                while std::time::Instant::now() < deadline {
                    let mut new = NewRequest::example(0, 1_000);
                    let mut hash = [0u8; 32];
                    hash[..4].copy_from_slice(&t.to_be_bytes());
                    hash[4..12].copy_from_slice(&n.to_be_bytes());
                    new.hash = hash;
                    new.claim_key = hex::encode(hash);
                    new.body = vec![b'x'; 1_000];
                    store.submit(new).await.expect("submit");
                    n += 1;
                }
                n
            }));
        }
        let mut written = 0;
        for t in tasks {
            written += t.await.expect("task");
        }
        let size = |p: &std::path::Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
        let wal = size(&dir.path().join("t.db-wal"));
        let main = size(&db);
        eprintln!("{written} requests; database {main} bytes, WAL {wal} bytes");
        // The writer's checkpoints keep the WAL under WAL_HARD_LIMIT (48 MiB) plus one group
        // commit; allow 64 MiB (unbounded, it reached 700 MB here).
        assert!(
            wal < 64 << 20,
            "the WAL grew to {wal} bytes over {written} requests (database: {main} bytes)"
        );
    }

    #[tokio::test]
    async fn a_database_migrated_by_the_sqlx_version_opens_without_reapplying_migrations() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = dir.path().join("t.db");
        for applied in [1_i64, 2] {
            let _ = std::fs::remove_file(&db);
            {
                let conn = Connection::open(&db).expect("open");
                conn.execute_batch(
                    "PRAGMA journal_mode = WAL;
                     CREATE TABLE _sqlx_migrations (version BIGINT PRIMARY KEY,
                         description TEXT NOT NULL, installed_on TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP,
                         success BOOLEAN NOT NULL, checksum BLOB NOT NULL, execution_time BIGINT NOT NULL);",
                )
                .expect("sqlx table");
                for (n, sql) in MIGRATIONS.iter().filter(|(n, _)| *n <= applied) {
                    conn.execute_batch(sql).expect("old migration");
                    conn.execute(
                        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
                         VALUES (?1, 'm', TRUE, x'00', 1)",
                        params![n],
                    )
                    .expect("record");
                }
            }
            let store = SqliteStore::open(
                &format!("sqlite://{}", db.display()),
                SqliteSynchronous::Normal,
            )
            .await
            .unwrap_or_else(|e| panic!("open a file at sqlx version {applied}: {e}"));
            let Submitted::Created(created) = store
                .submit(NewRequest::example(1, 5))
                .await
                .expect("submit")
            else {
                panic!("expected a new request");
            };
            assert_eq!(created.reset_seq, 0);
        }
    }

    /// Every column a request had at schema version 5.
    const EVERY_COLUMN: &str = "id, namespace, route, backend, model, stream, body, headers, hash,
        claim_kind, status, attempts, recoveries, next_retry_at, lease_owner, lease_expires_at,
        error_type, error_message, error_status, response_status, response_body,
        upstream_request_id, last_seq, created_at, updated_at, finished_at, reset_seq, attached,
        replayed, log_reads, usage_input_tokens, usage_output_tokens, usage_cached_input_tokens,
        usage_cache_write_tokens, usage_reasoning_tokens";

    /// Every row `select` gives, sorted.
    fn all_rows(conn: &Connection, select: &str) -> Vec<Vec<rusqlite::types::Value>> {
        let mut stmt = conn
            .prepare(&format!("{select} ORDER BY 1, 2"))
            .expect("select");
        let n = stmt.column_count();
        stmt.query_map([], |r| (0..n).map(|i| r.get(i)).collect())
            .expect("query")
            .collect::<Result<_, _>>()
            .expect("rows")
    }

    #[tokio::test]
    async fn migration_6_keeps_every_row_and_every_rule_and_its_writes_open_no_temporary_btree() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = dir.path().join("t.db");
        let (before_requests, before_chunks) = {
            let conn = Connection::open(&db).expect("open");
            conn.execute_batch("PRAGMA journal_mode = WAL")
                .expect("wal");
            for (n, sql) in MIGRATIONS.iter().filter(|(n, _)| *n <= 5) {
                conn.execute_batch(sql).expect("migration");
                conn.pragma_update(None, "user_version", n)
                    .expect("version");
            }
            // One row per status, every column set where the rules allow it.
            conn.execute_batch(
                "INSERT INTO requests (id, namespace, route, backend, model, stream, body, headers,
                     hash, claim_kind, status, attempts, recoveries, next_retry_at, lease_owner,
                     lease_expires_at, error_type, error_message, error_status, response_status,
                     response_body, upstream_request_id, last_seq, created_at, updated_at,
                     finished_at, reset_seq, attached, replayed, log_reads, usage_input_tokens,
                     usage_output_tokens, usage_cached_input_tokens, usage_cache_write_tokens,
                     usage_reasoning_tokens)
                 VALUES
                 ('a', 'ns', 'openai.chat', 'b', 'm', 0, x'7b7d', '[]', x'01', 'hash', 'succeeded',
                  1, 0, 5, NULL, NULL, NULL, NULL, NULL, 200, x'7b7d', 'req_1', 1, 5, 6, 6, 0, 2,
                  3, 4, 10, 11, 12, 13, 14),
                 ('b', 'ns', 'anthropic.messages', 'b', NULL, 1, x'00', '[[\"a\",\"b\"]]', x'02',
                  'key', 'failed', 3, 1, 5, NULL, NULL, 'stream_interrupted', 'cut', 502, NULL,
                  NULL, NULL, 4, 5, 7, 7, 2, 0, 0, 0, NULL, 5, NULL, NULL, NULL),
                 ('c', 'ns', 'openai.chat', 'b', 'm', 0, x'00', '[]', x'03', 'hash', 'running', 1,
                  0, 5, 'w/1', 9, NULL, NULL, NULL, NULL, NULL, NULL, 0, 5, 5, NULL, 0, 0, 0, 0,
                  NULL, NULL, NULL, NULL, NULL),
                 ('d', 'ns', 'openai.chat', 'b', 'm', 0, x'00', '[]', x'04', 'hash', 'pending', 1,
                  0, 8, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 0, 5, 5, NULL, 0, 0, 0, 0,
                  NULL, NULL, NULL, NULL, NULL);
                 INSERT INTO chunks (request_id, seq, attempt, kind, event, data) VALUES
                 ('b', 1, 1, 'data', 'message_start', '{}'), ('b', 2, 1, 'reset', NULL, '2'),
                 ('b', 3, 2, 'data', NULL, '{}'), ('b', 4, 2, 'end', NULL, '{}'),
                 ('a', 1, 1, 'end', NULL, '{}');",
            )
            .expect("rows at version 5");
            // Opening the store also expires the lease of a request left running (decision
            // 41): the migrated row is the same otherwise.
            expire_orphaned_leases(&conn).expect("expired lease");
            (
                all_rows(&conn, &format!("SELECT {EVERY_COLUMN} FROM requests")),
                all_rows(&conn, "SELECT * FROM chunks"),
            )
        };
        SqliteStore::open(
            &format!("sqlite://{}", db.display()),
            SqliteSynchronous::Normal,
        )
        .await
        .expect("open and migrate");
        let conn = Connection::open(&db).expect("open");
        assert_eq!(
            all_rows(
                &conn,
                &format!("SELECT {EVERY_COLUMN} FROM requests JOIN request_bodies USING (id)")
            ),
            before_requests,
            "every request, body and headers included"
        );
        assert_eq!(all_rows(&conn, "SELECT * FROM chunks"), before_chunks);
        // The rules still hold: values outside the lists are refused.
        for bad in [
            "UPDATE requests SET status = 'done' WHERE id = 'a'",
            "UPDATE requests SET error_type = 'oops' WHERE id = 'b'",
            "UPDATE chunks SET kind = 'other' WHERE request_id = 'a'",
            "INSERT INTO chunks (request_id, seq, attempt, kind, data) VALUES ('a', 1, 1, 'data', '')",
        ] {
            assert!(conn.execute(bad, []).is_err(), "accepted: {bad}");
        }
        // Every index is back.
        let indexes: i64 = conn
            .query_row(
                "SELECT COUNT(*) FROM sqlite_master WHERE type = 'index'
                 AND tbl_name IN ('requests', 'chunks')",
                [],
                |r| r.get(0),
            )
            .expect("indexes");
        assert_eq!(indexes, 7, "requests: 5 and its primary key; chunks: 1");
        // What the migration is for: the row every write rewrites holds no prompt...
        let request_columns: Vec<String> = conn
            .prepare("SELECT name FROM pragma_table_info('requests')")
            .expect("columns")
            .query_map([], |r| r.get(0))
            .expect("query")
            .collect::<Result<_, _>>()
            .expect("names");
        assert!(
            !request_columns
                .iter()
                .any(|c| c == "body" || c == "headers"),
            "{request_columns:?}"
        );
        // ...and a written row's CHECKs build no temporary b-tree.
        for table in ["requests", "request_bodies", "chunks"] {
            let columns: Vec<String> = conn
                .prepare(&format!("SELECT name FROM pragma_table_info('{table}')"))
                .expect("columns")
                .query_map([], |r| r.get(0))
                .expect("query")
                .collect::<Result<_, _>>()
                .expect("names");
            let insert = format!(
                "INSERT INTO {table} ({}) VALUES ({})",
                columns.join(", "),
                vec!["?"; columns.len()].join(", ")
            );
            assert_eq!(ephemeral_tables(&conn, &insert), 0, "{insert}");
        }
    }

    #[tokio::test]
    async fn a_requests_writes_and_a_streams_appends_build_no_temporary_btree() {
        let dir = tempfile::tempdir().expect("tempdir");
        let url = format!("sqlite://{}", dir.path().join("t.db").display());
        SqliteStore::open(&url, SqliteSynchronous::Normal)
            .await
            .expect("open");
        let conn = Connection::open(dir.path().join("t.db")).expect("open");
        for sql in [
            CLAIM_SQL,
            INSERT_REQUEST_SQL,
            INSERT_BODY_SQL,
            DUE_IDS_SQL,
            LEASE_SQL,
            FINISH_SUCCEEDED_SQL,
            FINISH_RETRY_SQL,
            FINISH_FAILED_SQL,
            FETCH_SQL,
            UPSERT_USAGE_SQL,
            INSERT_CONTROL_SQL,
            APPEND_FENCE_SQL,
            LEASED_LAST_SEQ_SQL,
            APPEND_CHUNK_SQL,
        ] {
            assert_eq!(ephemeral_tables(&conn, sql), 0, "{sql}");
        }
    }

    /// How many temporary b-trees `sql` opens (`OpenEphemeral` in its program).
    fn ephemeral_tables(conn: &Connection, sql: &str) -> usize {
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

    #[tokio::test]
    async fn chunks_stored_before_the_rowid_migration_are_read_back_the_same_after_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = dir.path().join("t.db");
        let id = uuid::Uuid::now_v7();
        {
            let conn = Connection::open(&db).expect("open");
            conn.execute_batch("PRAGMA journal_mode = WAL")
                .expect("wal");
            for (n, sql) in MIGRATIONS.iter().filter(|(n, _)| *n <= 4) {
                conn.execute_batch(sql).expect("migration");
                conn.pragma_update(None, "user_version", n)
                    .expect("version");
            }
            for seq in 1..=3_i64 {
                conn.execute(
                    "INSERT INTO chunks (request_id, seq, attempt, kind, event, data)
                     VALUES (?1, ?2, 1, 'data', NULL, ?3)",
                    params![id.to_string(), seq, format!("{{\"n\":{seq}}}")],
                )
                .expect("chunk");
            }
        }
        let store = SqliteStore::open(
            &format!("sqlite://{}", db.display()),
            SqliteSynchronous::Normal,
        )
        .await
        .expect("open and migrate");
        let chunks = store.chunks_after(id, 1, 10).await.expect("read");
        let seqs: Vec<i64> = chunks.iter().map(|c| c.seq).collect();
        assert_eq!(seqs, [2, 3]);
        assert_eq!(chunks[1].data, r#"{"n":3}"#);
        // (request_id, seq) is still unique.
        let conn = Connection::open(&db).expect("open");
        let again = conn.execute(
            "INSERT INTO chunks (request_id, seq, attempt, kind, event, data)
             VALUES (?1, 2, 1, 'data', NULL, '{}')",
            params![id.to_string()],
        );
        assert!(again.is_err(), "a second chunk with seq 2 was stored");
        let version: i64 = conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .expect("version");
        assert_eq!(version, LATEST_SCHEMA);
    }
}
