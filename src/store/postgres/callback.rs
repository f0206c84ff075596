//! The callback statements of the PostgreSQL adapter (SPEC CB-4, CB-6). The callback row is
//! inserted by the submission's statement (`called` in `submit_sql!` and `SUBMIT_MANY`); these
//! run on the query pool, outside the writers' queue: a try's lease and outcome lock only its
//! `callbacks` row, never a request or a claim, so they take no part in the lock order.

use sqlx::Row;
use uuid::Uuid;

use super::PostgresStore;
use super::sql::{corrupt, opt_text};
use crate::store::callback::callback_of;
use crate::store::{Callback, CallbackLease, CallbackOutcome, Millis, StoreError};

/// Leases up to `$4` due callbacks (of terminal requests, next try passed, no live lease) to
/// `$2/<request id>` until `$1 + $3`. `SKIP LOCKED`: nodes leasing at once take different rows,
/// and a row another node leased meanwhile is re-checked on its new version (LC-2's pattern).
const LEASE_SQL: &str = "WITH due AS (
         SELECT c.request_id FROM callbacks c JOIN requests r ON r.id = c.request_id
         WHERE c.state = 'pending' AND c.next_try_at <= $1 AND r.finished_at IS NOT NULL
             AND (c.lease_owner IS NULL OR c.lease_expires_at < $1)
         ORDER BY c.next_try_at, c.request_id LIMIT $4
         FOR UPDATE OF c SKIP LOCKED)
     UPDATE callbacks c SET lease_owner = $2 || '/' || c.request_id::text,
         lease_expires_at = $1 + $3, attempts = c.attempts + 1, updated_at = $1
     FROM due, requests r
     WHERE c.request_id = due.request_id AND r.id = c.request_id
     RETURNING c.request_id, c.lease_owner, c.attempts, c.url, r.finished_at";

impl PostgresStore {
    pub(super) async fn lease_callbacks_in(
        &self,
        owner_prefix: &str,
        now: Millis,
        lease_ms: i64,
        limit: usize,
    ) -> Result<Vec<CallbackLease>, StoreError> {
        let rows = sqlx::query(LEASE_SQL)
            .bind(now)
            .bind(owner_prefix)
            .bind(lease_ms)
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|row| {
                let attempts: i32 = row.try_get(2)?;
                Ok(CallbackLease {
                    request_id: row.try_get(0)?,
                    owner: row.try_get(1)?,
                    attempt: u32::try_from(attempts).map_err(corrupt)?,
                    url: row.try_get(3)?,
                    finished_at: row.try_get::<Option<i64>, _>(4)?.unwrap_or(now),
                })
            })
            .collect()
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
