//! Test support: the plans PostgreSQL runs the adapter's statements with, read back so a test
//! can hold a lease to reading about the rows it leases (CB-7, LC-2a).

use std::str::FromStr;

use serde_json::Value;
use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection, Row};
use uuid::Uuid;

use super::PostgresStore;

/// A store on a database of its own, dropped by [`ScratchDatabase::drop`].
pub(super) struct ScratchDatabase {
    pub(super) store: PostgresStore,
    admin: PgConnection,
    name: String,
}

/// A fresh database on the tests' server (`HOLDFAST_TEST_DATABASE_URL`, else the local one),
/// migrated.
pub(super) async fn scratch_database() -> ScratchDatabase {
    let admin_url = std::env::var("HOLDFAST_TEST_DATABASE_URL")
        .ok()
        .filter(|u| !u.is_empty())
        .unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/test".to_string());
    let options = PgConnectOptions::from_str(&admin_url).expect("admin url");
    let mut admin = PgConnection::connect_with(&options)
        .await
        .expect("PostgreSQL for the tests (HOLDFAST_TEST_DATABASE_URL)");
    let name = format!("holdfast_test_{}", Uuid::new_v4().simple());
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&mut admin)
        .await
        .expect("create database");
    let mut url = reqwest::Url::parse(&admin_url).expect("admin url");
    url.set_path(&format!("/{name}"));
    let store = PostgresStore::open(url.as_str()).await.expect("open");
    ScratchDatabase { store, admin, name }
}

impl ScratchDatabase {
    /// Closes the store and drops its database.
    pub(super) async fn drop(mut self) {
        drop(self.store);
        let _ = sqlx::query(&format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            self.name
        ))
        .execute(&mut self.admin)
        .await;
    }
}

/// Every plan node under `plan`: its type, its relation, and the rows it read (returned and
/// filtered out, over all its loops).
fn nodes(plan: &Value, out: &mut Vec<(String, String, f64)>) {
    let num = |key: &str| plan.get(key).and_then(Value::as_f64).unwrap_or(0.0);
    let text = |key: &str| {
        plan.get(key)
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string()
    };
    let read = (num("Actual Rows") + num("Rows Removed by Filter")) * num("Actual Loops");
    out.push((text("Node Type"), text("Relation Name"), read));
    for child in plan
        .get("Plans")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        nodes(child, out);
    }
}

/// The nodes of the plan of `sql` with `bind`'s parameters, run (`EXPLAIN (ANALYZE, FORMAT
/// JSON)`) and rolled back.
pub(super) async fn run_plan(
    store: &PostgresStore,
    sql: &str,
    bind: impl for<'q> FnOnce(
        sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
    )
        -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
) -> Vec<(String, String, f64)> {
    let explain = format!("EXPLAIN (ANALYZE, FORMAT JSON) {sql}");
    let mut tx = store.pool.begin().await.expect("begin");
    let plan: Value = bind(sqlx::query(&explain))
        .fetch_one(&mut *tx)
        .await
        .expect("explain")
        .get(0);
    tx.rollback().await.expect("rollback");
    let mut out = Vec::new();
    nodes(&plan[0]["Plan"], &mut out);
    out
}

/// No node of `statement`'s plan `nodes` is a sequential scan or reads more than four times
/// the `leased` rows.
pub(super) fn assert_reads_about(statement: &str, nodes: &[(String, String, f64)], leased: f64) {
    for (kind, relation, read) in nodes {
        assert!(
            kind != "Seq Scan",
            "{statement}: a sequential scan of {relation}: {nodes:?}"
        );
        assert!(
            *read <= 4.0 * leased,
            "{statement}: {kind} {relation} read {read} rows to lease {leased}: {nodes:?}"
        );
    }
}
