//! The connections: the pools and their session settings, opening the store (migrations
//! included), the held append connection, and cross-node notifications (NOTIFY, LISTEN).

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgListener, PgPool, PgPoolOptions};
use sqlx::{Connection, Executor, Postgres, Transaction};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};
use uuid::Uuid;

use super::sql::{AppendPlan, append_in};
use super::writer::{WRITERS, write_loop};
use super::{
    CHANGED_CHANNEL, DEFAULT_ACQUIRE_TIMEOUT, DEFAULT_MAX_CONNECTIONS, IDS_PER_NOTIFY,
    PostgresStore, WORK_CHANNEL,
};
use crate::store::{Notification, StoreError};

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

/// A connection of a pool of its own, taken on first use and kept until it fails.
#[derive(Debug)]
pub(super) struct Held {
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
    let pool = connected(
        PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(options.clone())
            .await,
        &options,
    )
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

/// A pool's first connection to the server of `options`, or why there is none: a pool that
/// timed out is asked [`why_unreachable`].
async fn connected(
    pool: Result<PgPool, sqlx::Error>,
    options: &PgConnectOptions,
) -> Result<PgPool, StoreError> {
    match pool {
        Ok(pool) => Ok(pool),
        Err(sqlx::Error::PoolTimedOut) => {
            Err(why_unreachable(options, DEFAULT_ACQUIRE_TIMEOUT).await)
        }
        Err(e) => Err(e.into()),
    }
}

/// Why the server of `options` could not be connected to, waiting at most `within`. A pool
/// that cannot connect reports only that it timed out (`pool timed out while waiting for an
/// open connection`), which tells an operator starting a node, or reading `/readyz`, nothing:
/// one connection of its own says why — refused, a host that does not resolve, a password the
/// server rejects — in the database driver's words, which never hold the URL (IN-3). A
/// connection made at once means the pool was only full, and its timeout is the answer.
pub(super) async fn why_unreachable(options: &PgConnectOptions, within: Duration) -> StoreError {
    let timed_out = || StoreError::from(sqlx::Error::PoolTimedOut);
    match tokio::time::timeout(within, PgConnection::connect_with(options)).await {
        Ok(Err(e)) => StoreError::Unavailable(format!("cannot connect to PostgreSQL: {e}")),
        Ok(Ok(conn)) => {
            let _ = conn.close().await;
            timed_out()
        }
        Err(_) => StoreError::Unavailable(format!(
            "cannot connect to PostgreSQL: no answer within {} ms",
            within.as_millis()
        )),
    }
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
        let pool = connected(
            pool_of(max_connections.max(1))
                .connect_with(options.clone())
                .await,
            &options,
        )
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

    /// Runs [`APPEND_CHUNKS`] for `plan` on the held append connection.
    pub(super) async fn append_held(&self, plan: &AppendPlan) -> Result<Vec<i32>, StoreError> {
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
    pub(super) async fn notify_changed(
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
    pub(super) async fn notify_work(
        &self,
        tx: &mut Transaction<'_, Postgres>,
    ) -> Result<(), StoreError> {
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
    pub(super) async fn listen_session(
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
}
