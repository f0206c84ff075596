//! The callback statements of the SQLite adapter (SPEC CB-1, CB-4, CB-6): recorded with the
//! submission ([`insert_in`]), leased and finished by the writer, read on the read pool.

use rusqlite::{Connection, params};
use uuid::Uuid;

use super::SqliteStore;
use super::held::Tx;
use super::sql::{corrupt, parse_id};
use crate::store::callback::callback_of;
use crate::store::{
    Callback, CallbackLease, CallbackOutcome, CallbackState, LeaseQuota, Millis, StoreError,
};

/// Records request `id`'s callback to `url`, pending, inside the submission's transaction
/// (CB-1), with the request's namespace (CB-7). It becomes due when the request's
/// `finished_at` is set (CB-4).
pub(super) fn insert_in(
    conn: &Tx<'_>,
    id: &str,
    namespace: &str,
    url: &str,
    now: Millis,
) -> Result<(), StoreError> {
    conn.prepare_held(
        "INSERT INTO callbacks (request_id, namespace, url, updated_at) VALUES (?1, ?2, ?3, ?4)",
    )?
    .execute(params![id, namespace, url, now])?;
    Ok(())
}

/// Namespace `?3`'s due callbacks (of terminal requests, next try passed, no live lease),
/// oldest due first, read in that order from `callbacks_namespace_due` (named, as in
/// [`DUE_SQL`], so no statistics can turn it into a scan): `?2` of them cost
/// about `?2` rows, plus the tries in flight and the unfinished requests' deliveries the scan
/// steps over, whatever the backlog (CB-7).
const SHARE_SQL: &str = "SELECT c.request_id, c.url, r.finished_at, c.next_try_at, c.namespace
     FROM callbacks c INDEXED BY callbacks_namespace_due JOIN requests r ON r.id = c.request_id
     WHERE c.namespace = ?3 AND c.state = 'pending' AND c.next_try_at <= ?1
         AND r.finished_at IS NOT NULL
         AND (c.lease_owner IS NULL OR c.lease_expires_at < ?1)
     ORDER BY c.next_try_at, c.request_id LIMIT ?2";

/// [`SHARE_SQL`] of any namespace, read from `callbacks_due` in its order. `INDEXED BY`: left
/// to itself the planner reads every pending row through `callbacks_state` and sorts them.
const DUE_SQL: &str = "SELECT c.request_id, c.url, r.finished_at, c.next_try_at, c.namespace
     FROM callbacks c INDEXED BY callbacks_due JOIN requests r ON r.id = c.request_id
     WHERE c.state = 'pending' AND c.next_try_at <= ?1 AND r.finished_at IS NOT NULL
         AND (c.lease_owner IS NULL OR c.lease_expires_at < ?1)
     ORDER BY c.next_try_at, c.request_id LIMIT ?2";

/// A due callback as [`SHARE_SQL`] and [`DUE_SQL`] read it: request id, URL, when the request
/// finished, next try, namespace.
type Due = (String, String, i64, i64, String);

fn due_of(r: &rusqlite::Row<'_>) -> rusqlite::Result<Due> {
    Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
}

const LEASE_SQL: &str = "UPDATE callbacks SET lease_owner = ?1, lease_expires_at = ?2,
         attempts = attempts + 1, updated_at = ?3
     WHERE request_id = ?4
     RETURNING attempts";

const FINISH_SQL: &str = "UPDATE callbacks SET state = ?1, last_status = ?2, last_error = ?3,
         next_try_at = ?4, delivered_at = ?5, lease_owner = NULL, lease_expires_at = NULL,
         updated_at = ?6
     WHERE request_id = ?7 AND lease_owner = ?8 AND state = 'pending'";

const SELECT_SQL: &str = "SELECT url, state, attempts, next_try_at, last_status, last_error,
         delivered_at FROM callbacks WHERE request_id = ?1";

pub(super) async fn lease(
    store: &SqliteStore,
    owner_prefix: &str,
    now: Millis,
    lease_ms: i64,
    quota: &LeaseQuota,
) -> Result<Vec<CallbackLease>, StoreError> {
    let owner_prefix = owner_prefix.to_string();
    let quota = quota.clone();
    // Chosen, then leased, in one job of the only writer: no other leaser comes in between.
    store
        .write(move |conn| lease_in(conn, &owner_prefix, now, lease_ms, &quota))
        .await
}

/// [`lease`] on the writer's connection: each namespace's share, the oldest of them when
/// they exceed the limit, then what the quota lends to the oldest due of any namespace
/// (CB-7). Every statement reads about as many rows as it returns. Its statements stay in
/// rusqlite's cache (once per lease of many deliveries), where its test reads their step
/// counters by their SQL text.
fn lease_in(
    conn: &Connection,
    owner_prefix: &str,
    now: Millis,
    lease_ms: i64,
    quota: &LeaseQuota,
) -> Result<Vec<CallbackLease>, StoreError> {
    let sql_limit = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
    let mut shares: Vec<Due> = Vec::new();
    {
        let mut share = conn.prepare_cached(SHARE_SQL)?;
        for (namespace, n) in quota.nonzero_shares() {
            let rows = share.query_map(params![now, sql_limit(n), namespace], due_of)?;
            for row in rows {
                shares.push(row?);
            }
        }
    }
    shares.sort_by(|a, b| (a.3, &a.0).cmp(&(b.3, &b.0)));
    shares.truncate(quota.limit);
    let mut leases = lease_rows(conn, owner_prefix, now, lease_ms, shares)?;
    let lent = quota.lendable(leases.len());
    if lent > 0 {
        let due: Vec<Due> = conn
            .prepare_cached(DUE_SQL)?
            .query_map(params![now, sql_limit(lent)], due_of)?
            .collect::<Result<_, _>>()?;
        leases.extend(lease_rows(conn, owner_prefix, now, lease_ms, due)?);
    }
    Ok(leases)
}

/// Leases each of `due` to `owner_prefix/<request id>` until `now + lease_ms`.
fn lease_rows(
    conn: &Connection,
    owner_prefix: &str,
    now: Millis,
    lease_ms: i64,
    due: Vec<Due>,
) -> Result<Vec<CallbackLease>, StoreError> {
    let mut lease = conn.prepare_cached(LEASE_SQL)?;
    due.into_iter()
        .map(|(id, url, finished_at, _, namespace)| {
            let owner = format!("{owner_prefix}/{id}");
            let attempts: i64 =
                lease.query_row(params![owner, now + lease_ms, now, id], |r| r.get(0))?;
            Ok(CallbackLease {
                request_id: parse_id(&id)?,
                owner,
                attempt: u32::try_from(attempts).map_err(corrupt)?,
                url,
                finished_at,
                namespace,
            })
        })
        .collect()
}

pub(super) async fn finish(
    store: &SqliteStore,
    lease: &CallbackLease,
    outcome: &CallbackOutcome,
    now: Millis,
) -> Result<bool, StoreError> {
    let (lease, outcome) = (lease.clone(), outcome.clone());
    store
        .write(move |conn| {
            let (state, status, error, next, delivered) = outcome.columns(now);
            let changed = conn.prepare_held(FINISH_SQL)?.execute(params![
                state.as_str(),
                status,
                error,
                next,
                delivered,
                now,
                lease.request_id.to_string(),
                lease.owner
            ])?;
            Ok(changed == 1)
        })
        .await
}

pub(super) async fn read(store: &SqliteStore, ids: &[Uuid]) -> Result<Vec<Callback>, StoreError> {
    let ids = ids.to_vec();
    store
        .read(move |conn| {
            let mut stmt = conn.prepare_cached(SELECT_SQL)?;
            let mut out = Vec::new();
            for id in ids {
                let mut rows = stmt.query(params![id.to_string()])?;
                if let Some(r) = rows.next()? {
                    let state: String = r.get(1)?;
                    out.push(callback_of(
                        id,
                        r.get(0)?,
                        &state,
                        r.get(2)?,
                        r.get(3)?,
                        r.get(4)?,
                        r.get(5)?,
                        r.get(6)?,
                    )?);
                }
            }
            Ok(out)
        })
        .await
}

pub(super) async fn backlog(store: &SqliteStore) -> Result<i64, StoreError> {
    store
        .read(|conn| {
            Ok(conn
                .prepare_cached(
                    "SELECT COUNT(*) FROM callbacks c JOIN requests r ON r.id = c.request_id
                     WHERE c.state = ?1 AND r.finished_at IS NOT NULL",
                )?
                .query_row(params![CallbackState::Pending.as_str()], |r| r.get(0))?)
        })
        .await
}

#[cfg(test)]
mod tests {
    use rusqlite::StatementStatus;

    use super::*;

    /// The lease statements.
    const LEASE_STATEMENTS: [&str; 3] = [SHARE_SQL, DUE_SQL, LEASE_SQL];

    /// One lease as the deliverer makes it for 64 free slots, shares of 8 for namespaces `a`
    /// and `b`, from a backlog of `backlog` due deliveries of `a` and 3 of `b`, every one a
    /// first try (due at 0, as a receiver that hangs leaves them): the virtual-machine steps
    /// and the full-scan steps its statements took, and how many it leased.
    async fn lease_work(backlog: i64) -> (i32, i32, usize) {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = super::super::scratch(dir.path()).await;
        store
            .write(move |conn| {
                conn.execute(
                    "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?1)
                     INSERT INTO requests (id, namespace, route, backend, stream, hash,
                         claim_kind, status, next_retry_at, error_type, created_at, updated_at,
                         finished_at)
                     SELECT printf('00000000-0000-7000-8000-%012x', i),
                         CASE WHEN i > ?1 - 3 THEN 'b' ELSE 'a' END, 'openai.chat', 'openai', 0,
                         x'00', 'hash', 'failed', 0, 'cancelled', i, i, i
                     FROM n",
                    params![backlog + 3],
                )?;
                conn.execute(
                    "INSERT INTO callbacks (request_id, namespace, url, updated_at)
                     SELECT id, namespace, 'http://x.example/hook', 1 FROM requests",
                    [],
                )?;
                Ok(())
            })
            .await
            .expect("seed");
        let quota = LeaseQuota {
            shares: vec![("a".into(), 8), ("b".into(), 8)],
            limit: 64,
            keep_free: 8,
            lend_cap: usize::MAX,
        };
        store
            .write(move |conn| {
                for sql in LEASE_STATEMENTS {
                    let stmt = conn.prepare_cached(sql)?;
                    stmt.reset_status(StatementStatus::VmStep);
                    stmt.reset_status(StatementStatus::FullscanStep);
                }
                let leased = lease_in(conn, "n", 1_000, 60_000, &quota)?.len();
                let (mut steps, mut scans) = (0, 0);
                for sql in LEASE_STATEMENTS {
                    let stmt = conn.prepare_cached(sql)?;
                    steps += stmt.get_status(StatementStatus::VmStep);
                    scans += stmt.get_status(StatementStatus::FullscanStep);
                }
                Ok((steps, scans, leased))
            })
            .await
            .expect("lease")
    }

    /// CB-7: a lease's work is bounded by the slots it fills, not by the due backlog: from
    /// 20,000 due deliveries it takes as many steps as from 200 (an index read in lease order
    /// per namespace and one for what is lent; no scan, no sort of the backlog). The lease
    /// runs on the writer, so a backlog must not cost every tenant's submissions.
    #[tokio::test]
    async fn a_callback_lease_costs_the_same_from_a_backlog_of_20000_as_of_200_cb7() {
        let (small, small_scans, small_leased) = lease_work(200).await;
        let (large, large_scans, large_leased) = lease_work(20_000).await;
        assert_eq!(
            (small_leased, large_leased),
            (56, 56),
            "8 + 3 shared, 45 lent"
        );
        assert_eq!((small_scans, large_scans), (0, 0), "no full scan");
        assert_eq!(
            large, small,
            "virtual-machine steps from a backlog of 20,000, and of 200"
        );
    }
}
