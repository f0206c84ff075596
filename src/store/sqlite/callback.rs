//! The callback statements of the SQLite adapter (SPEC CB-1, CB-4, CB-6): recorded with the
//! submission ([`insert_in`]), leased and finished by the writer, read on the read pool.

use rusqlite::{Connection, params};
use uuid::Uuid;

use super::SqliteStore;
use super::sql::{corrupt, parse_id};
use crate::store::callback::callback_of;
use crate::store::{Callback, CallbackLease, CallbackOutcome, CallbackState, Millis, StoreError};

/// Records request `id`'s callback to `url`, pending, inside the submission's transaction
/// (CB-1). It becomes due when the request's `finished_at` is set (CB-4).
pub(super) fn insert_in(
    conn: &Connection,
    id: &str,
    url: &str,
    now: Millis,
) -> Result<(), StoreError> {
    conn.prepare_cached("INSERT INTO callbacks (request_id, url, updated_at) VALUES (?1, ?2, ?3)")?
        .execute(params![id, url, now])?;
    Ok(())
}

/// Due callbacks: of terminal requests, next try passed, no live lease; oldest due first.
const DUE_SQL: &str = "SELECT c.request_id, c.url, r.finished_at FROM callbacks c
     JOIN requests r ON r.id = c.request_id
     WHERE c.state = 'pending' AND c.next_try_at <= ?1 AND r.finished_at IS NOT NULL
         AND (c.lease_owner IS NULL OR c.lease_expires_at < ?1)
     ORDER BY c.next_try_at, c.request_id LIMIT ?2";

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
    limit: usize,
) -> Result<Vec<CallbackLease>, StoreError> {
    let owner_prefix = owner_prefix.to_string();
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    // Chosen, then leased, in one job of the only writer: no other leaser comes in between.
    store
        .write(move |conn| {
            let due: Vec<(String, String, i64)> = conn
                .prepare_cached(DUE_SQL)?
                .query_map(params![now, limit], |r| {
                    Ok((r.get(0)?, r.get(1)?, r.get(2)?))
                })?
                .collect::<Result<_, _>>()?;
            let mut lease = conn.prepare_cached(LEASE_SQL)?;
            due.into_iter()
                .map(|(id, url, finished_at)| {
                    let owner = format!("{owner_prefix}/{id}");
                    let attempts: i64 =
                        lease.query_row(params![owner, now + lease_ms, now, id], |r| r.get(0))?;
                    Ok(CallbackLease {
                        request_id: parse_id(&id)?,
                        owner,
                        attempt: u32::try_from(attempts).map_err(corrupt)?,
                        url,
                        finished_at,
                    })
                })
                .collect()
        })
        .await
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
            let changed = conn.prepare_cached(FINISH_SQL)?.execute(params![
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
