//! Opening the SQLite file: the one-process lock, the connections and their pragmas, the
//! schema migrations, and the pool of read-only connections.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rusqlite::{Connection, OpenFlags};

use super::writer::{checkpoint_loop, write_loop};
use super::{Inner, SqliteStore};
use crate::config::SqliteSynchronous;
use crate::store::StoreError;

/// Reads running at once, and read connections kept open.
const MAX_READERS: usize = 8;
/// The writer thread's name (15 bytes at most: Linux cuts longer ones).
pub const WRITER_THREAD: &str = "sqlite-writer";
/// The name of the WAL checkpoint thread (the e2e bench splits the process's CPU by thread).
pub const CHECKPOINT_THREAD: &str = "wal-checkpoint";
/// How long a connection waits for a lock held by another process before failing.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// Schema migrations, applied in order; `PRAGMA user_version` holds the last one applied.
const MIGRATIONS: &[(i64, &str)] = &[
    (
        1,
        include_str!("../../../migrations/sqlite/0001_requests.sql"),
    ),
    (
        2,
        include_str!("../../../migrations/sqlite/0002_chunks.sql"),
    ),
    (
        3,
        include_str!("../../../migrations/sqlite/0003_response_ids.sql"),
    ),
    (4, include_str!("../../../migrations/sqlite/0004_usage.sql")),
    (
        5,
        include_str!("../../../migrations/sqlite/0005_chunks_rowid.sql"),
    ),
    (
        6,
        include_str!("../../../migrations/sqlite/0006_request_rows_rebuilt.sql"),
    ),
    (
        7,
        include_str!("../../../migrations/sqlite/0007_callbacks.sql"),
    ),
    (
        8,
        include_str!("../../../migrations/sqlite/0008_trace_parent.sql"),
    ),
    (
        9,
        include_str!("../../../migrations/sqlite/0009_replay_of.sql"),
    ),
    (
        10,
        include_str!("../../../migrations/sqlite/0010_cache_write_1h.sql"),
    ),
    (
        11,
        include_str!("../../../migrations/sqlite/0011_callback_namespace.sql"),
    ),
    (
        12,
        include_str!("../../../migrations/sqlite/0012_chunks_packed.sql"),
    ),
    (
        13,
        include_str!("../../../migrations/sqlite/0013_end_from_row.sql"),
    ),
    (
        14,
        include_str!("../../../migrations/sqlite/0014_requests_namespace_due.sql"),
    ),
];

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

/// The callback tries a stopped process left in flight, like [`expire_orphaned_leases`]'s
/// attempts: their leases are expired now, for the deliverer to send them again at once instead
/// of a lease later (CB-4, decision 60).
fn expire_orphaned_callback_tries(conn: &Connection) -> Result<(), StoreError> {
    let tries = conn.execute(
        "UPDATE callbacks SET lease_expires_at = 0 WHERE lease_owner IS NOT NULL",
        [],
    )?;
    if tries > 0 {
        tracing::info!(
            callbacks = tries,
            "callback tries left in flight by a stopped holdfast process: sent again now"
        );
    }
    Ok(())
}

fn configure(conn: &Connection) -> Result<(), StoreError> {
    conn.busy_timeout(BUSY_TIMEOUT)?;
    conn.set_prepared_statement_cache_capacity(64);
    Ok(())
}

pub(super) fn open_writer(
    path: &Path,
    synchronous: SqliteSynchronous,
) -> Result<Connection, StoreError> {
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
    // most of what it covers (the measurements behind the number: docs/benchmarks-history.md). After
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
                expire_orphaned_callback_tries(&writer)?;
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
        let (jobs, queue) = std::sync::mpsc::channel();
        // One checkpoint round at a time: the checkpoint thread's, or the writer's at the WAL's
        // hard limit ([`bound_wal`]).
        let rounds = Arc::new(Mutex::new(()));
        let writer_rounds = Arc::clone(&rounds);
        // Thread names are what `top -H`, `perf` and `/proc/<pid>/task/*/comm` show, cut to 15
        // bytes: these two fit, so the writer's CPU can be told from the checkpointer's (the e2e
        // bench splits a row's CPU by them).
        std::thread::Builder::new()
            .name(WRITER_THREAD.into())
            .spawn(move || {
                // Held until the last write is done.
                let _lock = lock;
                write_loop(writer, queue, wal, &writer_rounds);
            })
            .map_err(|e| StoreError::Unavailable(format!("starting the writer thread: {e}")))?;
        let (stop, stopped) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name(CHECKPOINT_THREAD.into())
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

    /// Runs `f` on a read-only connection on the blocking pool.
    pub(super) async fn read<T, F>(&self, f: F) -> Result<T, StoreError>
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
pub(super) struct ReadPool {
    pub(super) path: PathBuf,
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

#[cfg(test)]
mod tests {
    use rusqlite::params;

    use super::super::tests::ephemeral_tables;
    use super::*;
    use crate::store::{NewRequest, Store, Submitted};

    /// `.cargo/config.toml` builds the bundled SQLite without its memory manager and memory
    /// statistics (decision 137): no process-wide mutex at each page fetch or allocation on
    /// the writer's path (issue 30). A build that lost the flags would still pass every other
    /// test, only slower; this one says so.
    #[test]
    fn sqlite_is_built_without_the_memory_managers_mutexes_decision137() {
        let conn = Connection::open_in_memory().expect("an in-memory database");
        let mut options = conn
            .prepare("PRAGMA compile_options")
            .expect("compile_options");
        let options: Vec<String> = options
            .query_map([], |r| r.get(0))
            .expect("compile_options rows")
            .collect::<Result<_, _>>()
            .expect("compile_options rows");
        assert!(
            options.iter().any(|o| o == "DEFAULT_MEMSTATUS=0"),
            "SQLite keeps memory statistics: {options:?}"
        );
        assert!(
            !options.iter().any(|o| o == "ENABLE_MEMORY_MANAGEMENT"),
            "SQLite is built with its memory manager: {options:?}"
        );
    }

    #[tokio::test]
    async fn a_database_migrated_by_the_sqlx_version_opens_without_reapplying_migrations() {
        let dir = tempfile::tempdir().expect("tempdir");
        for applied in [1_i64, 2] {
            // A file of its own per version: the store opened for the previous one closes its
            // connections after it is dropped (its checkpoint thread at its next round), and
            // the last to close checkpoints and deletes the WAL of that name, which a new file
            // at the same path would be using by then.
            let db = dir.path().join(format!("t{applied}.db"));
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
        assert_eq!(
            all_rows(
                &conn,
                "SELECT request_id, seq, attempt, kind, event, data FROM chunks"
            ),
            before_chunks
        );
        // Each row written before holds one chunk (decision 123).
        let packed: i64 = conn
            .query_row("SELECT count(*) FROM chunks WHERE count != 1", [], |r| {
                r.get(0)
            })
            .expect("count");
        assert_eq!(packed, 0, "a chunk row from before holds one chunk");
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
        assert_eq!(
            indexes, 8,
            "requests: 5, its primary key and requests_namespace_due (migration 14); chunks: 1"
        );
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
        assert_eq!(&*chunks[1].data, r#"{"n":3}"#);
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
