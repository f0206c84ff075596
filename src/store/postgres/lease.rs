//! The leases of requests on the PostgreSQL adapter (SPEC LC-2, LC-2a): each namespace's share
//! of the node's free worker slots, then what the quota lends to the oldest due of any.

use sqlx::Row;

use super::PostgresStore;
use super::sql::record_from_row;
use crate::store::{Lease, LeaseQuota, Millis, RequestRecord, StoreError};

/// Leases the requests the `picked` CTE (written before it) names: `running`, `attempts + 1`,
/// each owner `$1/<id>`, until `$2`, updated at `$3` (LC-2).
macro_rules! lease_picked {
    ($picked:expr) => {
        concat!(
            $picked,
            " UPDATE requests SET status = 'running', attempts = attempts + 1,
                 lease_owner = $1 || '/' || id::text, lease_expires_at = $2, updated_at = $3
             FROM picked WHERE id = picked_id
             RETURNING lease_owner, ",
            request_columns!()
        )
    };
}

/// The oldest due pending requests of the namespaces `$4`, up to `$5` of each (their shares,
/// LC-2a), and of those at most `$6`, oldest due first. Each namespace's are read in order from
/// `requests_namespace_due`, so the statement reads about as many rows as its shares take,
/// however many of another namespace's are due. The namespace is matched as a range of that
/// index's leading pair, not by `=`, as in the callbacks' lease: with `=` the planner may read
/// `requests_due` in lease order and filter the namespace, and so read a busy namespace's whole
/// backlog to find a quiet one's few. `SKIP LOCKED` as in [`LEND_SQL`].
const SHARE_SQL: &str = lease_picked!(
    "WITH picked AS MATERIALIZED (
         SELECT d.id AS picked_id FROM unnest($4::text[], $5::bigint[]) AS q(namespace, n)
         CROSS JOIN LATERAL (
             SELECT r.id, r.next_retry_at FROM requests r
             WHERE (r.namespace, r.next_retry_at) >= (q.namespace, (-9223372036854775807)::bigint)
                 AND (r.namespace, r.next_retry_at) <= (q.namespace, $3)
                 AND r.status = 'pending'
             ORDER BY r.namespace, r.next_retry_at, r.id LIMIT q.n
             FOR UPDATE OF r SKIP LOCKED) AS d
         ORDER BY d.next_retry_at, d.id LIMIT $6)"
);

/// Up to `$4` due pending requests of any namespace, oldest first (LC-2). `SKIP LOCKED`: a row
/// another leaser is taking is passed over, and a row that stopped being due after our
/// snapshot is re-checked and skipped. The candidates are picked once, in a materialized CTE:
/// an `IN (subquery)` the planner turns into a semi-join may run the subquery again per row,
/// and with SKIP LOCKED each run picks other rows, leasing more than `$4` — more than there
/// are workers to run them.
const LEND_SQL: &str = lease_picked!(
    "WITH picked AS MATERIALIZED (
         SELECT id AS picked_id FROM requests
         WHERE status = 'pending' AND next_retry_at <= $3
         ORDER BY next_retry_at, id LIMIT $4
         FOR UPDATE SKIP LOCKED)"
);

/// Most rows a limit can name.
fn sql_limit(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// The leases of the rows [`SHARE_SQL`] or [`LEND_SQL`] returned.
fn leases_of(rows: &[sqlx::postgres::PgRow]) -> Result<Vec<(Lease, RequestRecord)>, StoreError> {
    rows.iter()
        .map(|row| {
            let record = record_from_row(row)?;
            let lease = Lease {
                id: record.id,
                owner: row.try_get::<&str, _>("lease_owner")?.into(),
                attempt: record.attempts,
            };
            Ok((lease, record))
        })
        .collect()
}

impl PostgresStore {
    /// [`crate::store::Store::lease_many`]: the shares in one statement, then what the quota
    /// lends in another (its own `SKIP LOCKED` scan; the first one's leases are live by then,
    /// so it skips them).
    pub(super) async fn lease_many_in(
        &self,
        owner_prefix: &str,
        now: Millis,
        lease_ms: i64,
        quota: &LeaseQuota,
    ) -> Result<Vec<(Lease, RequestRecord)>, StoreError> {
        let (namespaces, shares): (Vec<&str>, Vec<i64>) = quota
            .nonzero_shares()
            .map(|(namespace, n)| (namespace, sql_limit(n)))
            .unzip();
        let mut leased = Vec::new();
        if !namespaces.is_empty() {
            let rows = sqlx::query(SHARE_SQL)
                .bind(owner_prefix)
                .bind(now + lease_ms)
                .bind(now)
                .bind(&namespaces)
                .bind(&shares)
                .bind(sql_limit(quota.limit))
                .fetch_all(&self.pool)
                .await?;
            leased = leases_of(&rows)?;
        }
        let lent = quota.lendable(leased.len());
        if lent > 0 {
            let rows = sqlx::query(LEND_SQL)
                .bind(owner_prefix)
                .bind(now + lease_ms)
                .bind(now)
                .bind(sql_limit(lent))
                .fetch_all(&self.pool)
                .await;
            match rows {
                Ok(rows) => leased.extend(leases_of(&rows)?),
                // The shares' leases are live: run them rather than leave them to expire.
                Err(e) if !leased.is_empty() => {
                    tracing::warn!(error = %e, "leasing requests beyond their shares failed");
                }
                Err(e) => return Err(e.into()),
            }
        }
        // RETURNING has no order; run the oldest first.
        leased.sort_by_key(|(_, r)| (r.next_retry_at, r.id));
        Ok(leased)
    }
}

#[cfg(test)]
mod tests {
    use super::super::plans::{assert_reads_about, run_plan, scratch_database};
    use super::*;

    /// Due requests of namespace `a`; 3 more are `b`'s.
    const BACKLOG: i64 = 200_000;

    /// LC-2a: a lease's work is bounded by the slots it fills, not by the due backlog: from
    /// 200,000 pending requests of one namespace (a flood of `Prefer: respond-async` calls),
    /// the shares' statement and the lending one read each namespace's oldest due, and the
    /// oldest of any, through their indexes in lease order: no sequential scan, no node reads
    /// more than a few times the rows leased.
    #[tokio::test]
    async fn a_lease_of_requests_reads_about_the_rows_it_leases_from_a_backlog_of_200000_lc2a() {
        let database = scratch_database().await;
        let store = &database.store;
        sqlx::query(
            "INSERT INTO requests (id, namespace, route, backend, stream, body, headers, hash,
                 claim_kind, status, next_retry_at, created_at, updated_at)
             SELECT ('00000000-0000-7000-8000-' || lpad(to_hex(i), 12, '0'))::uuid,
                 CASE WHEN i > $1 THEN 'b' ELSE 'a' END, 'openai.chat', 'openai', false,
                 '\\x00', '[]', '\\x00', 'hash', 'pending', i, i, i
             FROM generate_series(1, $1 + 3) AS i",
        )
        .bind(BACKLOG)
        .execute(&store.pool)
        .await
        .expect("seed");
        sqlx::query("ANALYZE requests")
            .execute(&store.pool)
            .await
            .expect("analyze");
        let now = BACKLOG + 10;

        let shares = run_plan(store, SHARE_SQL, |q| {
            q.bind("n")
                .bind(now + 30_000)
                .bind(now)
                .bind(vec!["a", "b"])
                .bind(vec![8_i64, 8])
                .bind(64_i64)
        })
        .await;
        let lent = run_plan(store, LEND_SQL, |q| {
            q.bind("n").bind(now + 30_000).bind(now).bind(45_i64)
        })
        .await;
        database.drop().await;
        assert_reads_about("shares", &shares, 11.0);
        assert_reads_about("lent", &lent, 45.0);
    }
}
