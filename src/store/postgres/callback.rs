//! The callback statements of the PostgreSQL adapter (SPEC CB-4, CB-6). The callback row is
//! inserted by the submission's statement (`called` in `submit_sql!` and `SUBMIT_MANY`); these
//! run on the query pool, outside the writers' queue: a try's lease and outcome lock only its
//! `callbacks` row, never a request or a claim, so they take no part in the lock order.

use sqlx::Row;
use sqlx::postgres::PgRow;
use uuid::Uuid;

use super::PostgresStore;
use super::sql::{corrupt, opt_text};
use crate::store::callback::callback_of;
use crate::store::{Callback, CallbackLease, CallbackOutcome, LeaseQuota, Millis, StoreError};

/// Leases the oldest due callbacks (of terminal requests, next try passed, no live lease) of
/// the namespaces `$4`, up to `$5` of each (their shares, CB-7), and of those at most `$6`,
/// oldest due first, to `$2/<request id>` until `$1 + $3`. Each namespace's are read in order
/// from `callbacks_namespace_due`, so the statement reads about as many rows as its shares
/// take, whatever the backlog. The namespace is matched as a range of that index's leading
/// pair, `(q.namespace, 0)` to `(q.namespace, $1)` (a next try is 0 or a time), not by `=`:
/// with `=` the planner may read `callbacks_due` in lease order and filter the namespace, its
/// estimate the same for every namespace, and so read a busy namespace's whole backlog to
/// find a quiet one's few. `SKIP LOCKED`: nodes leasing at once take different rows, and
/// a row another node leased meanwhile is re-checked on its new version (LC-2's pattern).
const SHARE_SQL: &str = "WITH due AS (
         SELECT d.request_id FROM unnest($4::text[], $5::bigint[]) AS q(namespace, n)
         CROSS JOIN LATERAL (
             SELECT c.request_id, c.next_try_at FROM callbacks c
             JOIN requests r ON r.id = c.request_id
             WHERE (c.namespace, c.next_try_at) >= (q.namespace, 0)
                 AND (c.namespace, c.next_try_at) <= (q.namespace, $1)
                 AND c.state = 'pending' AND r.finished_at IS NOT NULL
                 AND (c.lease_owner IS NULL OR c.lease_expires_at < $1)
             ORDER BY c.namespace, c.next_try_at, c.request_id LIMIT q.n
             FOR UPDATE OF c SKIP LOCKED) AS d
         ORDER BY d.next_try_at, d.request_id LIMIT $6)
     UPDATE callbacks c SET lease_owner = $2 || '/' || c.request_id::text,
         lease_expires_at = $1 + $3, attempts = c.attempts + 1, updated_at = $1
     FROM due, requests r
     WHERE c.request_id = due.request_id AND r.id = c.request_id
     RETURNING c.request_id, c.lease_owner, c.attempts, c.url, r.finished_at, c.namespace";

/// Leases up to `$4` due callbacks of any namespace, oldest due first, as [`SHARE_SQL`] does,
/// read in order from `callbacks_due` (CB-4, CB-7).
const LEND_SQL: &str = "WITH due AS (
         SELECT c.request_id FROM callbacks c JOIN requests r ON r.id = c.request_id
         WHERE c.state = 'pending' AND c.next_try_at <= $1 AND r.finished_at IS NOT NULL
             AND (c.lease_owner IS NULL OR c.lease_expires_at < $1)
         ORDER BY c.next_try_at, c.request_id LIMIT $4
         FOR UPDATE OF c SKIP LOCKED)
     UPDATE callbacks c SET lease_owner = $2 || '/' || c.request_id::text,
         lease_expires_at = $1 + $3, attempts = c.attempts + 1, updated_at = $1
     FROM due, requests r
     WHERE c.request_id = due.request_id AND r.id = c.request_id
     RETURNING c.request_id, c.lease_owner, c.attempts, c.url, r.finished_at, c.namespace";

/// Most rows a limit can name.
fn sql_limit(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// A lease as [`SHARE_SQL`] and [`LEND_SQL`] return it.
fn lease_of(row: &PgRow, now: Millis) -> Result<CallbackLease, StoreError> {
    let attempts: i32 = row.try_get(2)?;
    Ok(CallbackLease {
        request_id: row.try_get(0)?,
        owner: row.try_get(1)?,
        attempt: u32::try_from(attempts).map_err(corrupt)?,
        url: row.try_get(3)?,
        finished_at: row.try_get::<Option<i64>, _>(4)?.unwrap_or(now),
        namespace: row.try_get(5)?,
    })
}

impl PostgresStore {
    /// [`crate::store::Store::lease_callbacks`]: the shares in one statement, then what the
    /// quota lends in another (its own `SKIP LOCKED` scan; the first one's leases are live
    /// by then, so it skips them).
    pub(super) async fn lease_callbacks_in(
        &self,
        owner_prefix: &str,
        now: Millis,
        lease_ms: i64,
        quota: &LeaseQuota,
    ) -> Result<Vec<CallbackLease>, StoreError> {
        let (namespaces, shares): (Vec<&str>, Vec<i64>) = quota
            .nonzero_shares()
            .map(|(namespace, n)| (namespace, sql_limit(n)))
            .unzip();
        let mut leases = Vec::new();
        if !namespaces.is_empty() && quota.limit > 0 {
            let rows = sqlx::query(SHARE_SQL)
                .bind(now)
                .bind(owner_prefix)
                .bind(lease_ms)
                .bind(&namespaces)
                .bind(&shares)
                .bind(sql_limit(quota.limit))
                .fetch_all(&self.pool)
                .await?;
            for row in &rows {
                leases.push(lease_of(row, now)?);
            }
        }
        let lent = quota.lendable(leases.len());
        if lent > 0 {
            let rows = sqlx::query(LEND_SQL)
                .bind(now)
                .bind(owner_prefix)
                .bind(lease_ms)
                .bind(sql_limit(lent))
                .fetch_all(&self.pool)
                .await;
            match rows {
                Ok(rows) => {
                    for row in &rows {
                        leases.push(lease_of(row, now)?);
                    }
                }
                // The shares' leases are live: hand them over rather than leave them to expire.
                Err(e) if !leases.is_empty() => {
                    tracing::warn!(error = %e, "leasing callbacks beyond their shares failed");
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(leases)
    }

    pub(super) async fn finish_callback_in(
        &self,
        lease: &CallbackLease,
        outcome: &CallbackOutcome,
        now: Millis,
    ) -> Result<bool, StoreError> {
        let (state, status, error, next, delivered) = outcome.columns(now);
        let done = sqlx::query(
            "UPDATE callbacks SET state = $1, last_status = $2, last_error = $3,
                 next_try_at = $4, delivered_at = $5, lease_owner = NULL,
                 lease_expires_at = NULL, updated_at = $6
             WHERE request_id = $7 AND lease_owner = $8 AND state = 'pending'",
        )
        .bind(state.as_str())
        .bind(status)
        .bind(opt_text(error))
        .bind(next)
        .bind(delivered)
        .bind(now)
        .bind(lease.request_id)
        .bind(&lease.owner)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    pub(super) async fn callbacks_in(&self, ids: &[Uuid]) -> Result<Vec<Callback>, StoreError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let rows = sqlx::query(
            "SELECT request_id, url, state, attempts, next_try_at, last_status, last_error,
                 delivered_at FROM callbacks WHERE request_id = ANY($1)",
        )
        .bind(ids)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                let state: String = r.try_get(2)?;
                callback_of(
                    r.try_get(0)?,
                    r.try_get(1)?,
                    &state,
                    i64::from(r.try_get::<i32, _>(3)?),
                    r.try_get(4)?,
                    r.try_get::<Option<i32>, _>(5)?.map(i64::from),
                    r.try_get(6)?,
                    r.try_get(7)?,
                )
            })
            .collect()
    }

    pub(super) async fn callback_backlog_in(&self) -> Result<i64, StoreError> {
        Ok(sqlx::query_scalar(
            "SELECT COUNT(*) FROM callbacks c JOIN requests r ON r.id = c.request_id
             WHERE c.state = 'pending' AND r.finished_at IS NOT NULL",
        )
        .fetch_one(&self.pool)
        .await?)
    }
}

#[cfg(test)]
mod tests {
    use super::super::plans::{assert_reads_about, run_plan, scratch_database};
    use super::*;

    /// Due deliveries of namespace `a`; 3 more are `b`'s.
    const BACKLOG: i64 = 200_000;

    /// CB-7: a lease's work is bounded by the slots it fills, not by the due backlog: from
    /// 200,000 due deliveries of one namespace (a receiver down for an hour at 60 finished
    /// requests a second), the shares' statement and the lending one read
    /// each namespace's oldest due, and the oldest of any, through their indexes in lease
    /// order: no sequential scan, no node reads more than a few times the rows leased.
    #[tokio::test]
    async fn a_callback_lease_reads_about_the_rows_it_leases_from_a_backlog_of_200000_cb7() {
        let database = scratch_database().await;
        let store = &database.store;
        for sql in [
            "INSERT INTO requests (id, namespace, route, backend, stream, body, headers, hash,
                 claim_kind, status, next_retry_at, error_type, created_at, updated_at,
                 finished_at)
             SELECT ('00000000-0000-7000-8000-' || lpad(to_hex(i), 12, '0'))::uuid,
                 CASE WHEN i > $1 THEN 'b' ELSE 'a' END, 'openai.chat', 'openai', false,
                 '\\x00', '[]', '\\x00', 'hash', 'failed', 0, 'cancelled', i, i, i
             FROM generate_series(1, $1 + 3) AS i",
            "INSERT INTO callbacks (request_id, namespace, url, updated_at)
             SELECT id, namespace, 'http://x.example/hook', 1 FROM requests WHERE $1 > 0",
        ] {
            sqlx::query(sql)
                .bind(BACKLOG)
                .execute(&store.pool)
                .await
                .expect("seed");
        }
        sqlx::query("ANALYZE callbacks, requests")
            .execute(&store.pool)
            .await
            .expect("analyze");

        let shares = run_plan(store, SHARE_SQL, |q| {
            q.bind(1_000_i64)
                .bind("n")
                .bind(60_000_i64)
                .bind(vec!["a", "b"])
                .bind(vec![8_i64, 8])
                .bind(64_i64)
        })
        .await;
        let lent = run_plan(store, LEND_SQL, |q| {
            q.bind(1_000_i64).bind("n").bind(60_000_i64).bind(45_i64)
        })
        .await;
        database.drop().await;
        assert_reads_about("shares", &shares, 11.0);
        assert_reads_about("lent", &lent, 45.0);
    }
}
