//! `GET /usage`: the usage and savings ledger, aggregated from the database (so it survives
//! restarts and covers every node), priced with the configured `[[prices]]` (docs/usage.md).

use std::collections::BTreeMap;

use axum::extract::{Query, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use super::errors::ApiError;
use super::requests::{bad_parameter, time_parameter, time_window};
use super::{AppState, caller};
use crate::ledger;
use crate::provider::{Provider, Usage};
use crate::store::{UsageGroup, UsageQuery, UsageRow, now_ms};

/// One group's (or the totals') ledger.
#[derive(Debug, Default, Serialize)]
struct Ledger {
    requests: u64,
    /// Succeeded requests whose provider reported no tokens (RD-9a).
    unmetered: u64,
    upstream_calls: u64,
    deliveries: u64,
    attached: u64,
    replayed: u64,
    saved_calls: u64,
    usage: Usage,
    saved_tokens: Usage,
    /// `null` when no request of the group had a matching price.
    cost_usd: Option<f64>,
    saved_cost_usd: Option<f64>,
}

impl Ledger {
    fn add(&mut self, row: &UsageRow, cost: Option<f64>, saved_cost: Option<f64>) {
        self.requests += row.requests;
        self.unmetered += row.unmetered;
        self.upstream_calls += row.attempts;
        self.deliveries += row.deliveries;
        self.attached += row.attached;
        self.replayed += row.replayed;
        self.saved_calls += row.saved_calls;
        self.usage = self.usage.plus(row.usage);
        self.saved_tokens = self.saved_tokens.plus(row.saved);
        let sum = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (None, None) => None,
            (a, b) => Some(a.unwrap_or(0.0) + b.unwrap_or(0.0)),
        };
        self.cost_usd = sum(self.cost_usd, cost);
        self.saved_cost_usd = sum(self.saved_cost_usd, saved_cost);
    }
}

#[derive(Debug, Serialize)]
struct Group {
    key: String,
    #[serde(flatten)]
    ledger: Ledger,
}

/// The grouping a `group_by` value names.
fn group(value: &str) -> Result<UsageGroup, ApiError> {
    match value {
        "model" => Ok(UsageGroup::Model),
        "backend" => Ok(UsageGroup::Backend),
        "namespace" => Ok(UsageGroup::Namespace),
        "day" => Ok(UsageGroup::Day),
        "provider" => Ok(UsageGroup::Provider),
        _ => Err(bad_parameter(
            "group_by",
            format!("{value:?} is not one of model, backend, namespace, day, provider"),
        )),
    }
}

/// An hour and a day, in milliseconds.
const HOUR_MS: i64 = 3_600_000;
const DAY_MS: i64 = 86_400_000;

/// The bucket width a `bucket` value names (EX-10).
fn bucket_of(value: &str) -> Result<i64, ApiError> {
    match value {
        "hour" => Ok(HOUR_MS),
        "day" => Ok(DAY_MS),
        _ => Err(bad_parameter(
            "bucket",
            format!("{value:?} is not one of hour, day"),
        )),
    }
}

fn bucket_name(ms: Option<i64>) -> &'static str {
    if ms == Some(HOUR_MS) { "hour" } else { "day" }
}

/// `GET /usage?since=&until=&group_by=model|backend|namespace|day|provider[&namespace=]`: requests
/// submitted in `[since, until)` (RFC 3339; default the last 30 days up to now), grouped, with
/// totals. A namespace key sees its namespace; an admin key every namespace, or `namespace=`'s.
/// `bucket=hour|day` adds `buckets`, the groups per UTC hour or day (EX-10, decision 65).
pub(super) async fn usage(
    State(state): State<AppState>,
    Query(query): Query<Vec<(String, String)>>,
    headers: HeaderMap,
) -> Response {
    let shape = Provider::Openai;
    let caller = match caller(&state.config, &headers, shape) {
        Ok(caller) => caller,
        Err(e) => return e.into_response(),
    };
    let now = now_ms();
    let mut since = now - 30 * 86_400_000;
    let mut until = now + 1;
    let mut group_by = UsageGroup::Model;
    let mut namespace = None;
    let mut bucket_ms = None;
    for (name, value) in &query {
        let parsed: Result<(), ApiError> = match name.as_str() {
            "since" => time_parameter("since", value).map(|t| since = t),
            "until" => time_parameter("until", value).map(|t| until = t),
            "group_by" => group(value).map(|g| group_by = g),
            "bucket" => bucket_of(value).map(|b| bucket_ms = Some(b)),
            "namespace" => {
                namespace = Some(value.clone());
                Ok(())
            }
            other => Err(bad_parameter(
                other,
                "unknown parameter; known: since, until, group_by, bucket, namespace",
            )),
        };
        if let Err(e) = parsed {
            return e.into_response();
        }
    }
    if let Err(e) = time_window(Some(since), Some(until)) {
        return e.into_response();
    }
    if namespace.is_some() && caller != super::Caller::Admin {
        return bad_parameter("namespace", "only admin keys choose a namespace").into_response();
    }
    let store_query = UsageQuery {
        namespace: caller.scope(namespace.as_deref()),
        since,
        until,
        group_by,
        bucket_ms,
    };
    let rows = match state.store.usage(&store_query).await {
        Ok(rows) => rows,
        Err(e) => return ApiError::store(shape, &e).into_response(),
    };
    let mut groups: BTreeMap<String, Ledger> = BTreeMap::new();
    let mut totals = Ledger::default();
    let mut buckets: BTreeMap<i64, BTreeMap<String, Ledger>> = BTreeMap::new();
    for row in &rows {
        let price = ledger::price(&state.config, &row.backend, row.model.as_deref());
        let cost = price.and_then(|p| ledger::cost(p, &row.usage));
        let saved_cost = price.and_then(|p| ledger::cost(p, &row.saved));
        groups
            .entry(row.key.clone())
            .or_default()
            .add(row, cost, saved_cost);
        totals.add(row, cost, saved_cost);
        if let Some(start) = row.bucket {
            buckets
                .entry(start)
                .or_default()
                .entry(row.key.clone())
                .or_default()
                .add(row, cost, saved_cost);
        }
    }
    let groups: Vec<Group> = groups
        .into_iter()
        .map(|(key, ledger)| Group { key, ledger })
        .collect();
    let mut answer = serde_json::json!({
        "since": super::requests::rfc3339(since),
        "until": super::requests::rfc3339(until),
        "group_by": match group_by {
            UsageGroup::Model => "model",
            UsageGroup::Backend => "backend",
            UsageGroup::Namespace => "namespace",
            UsageGroup::Day => "day",
            UsageGroup::Provider => "provider",
        },
        "namespace": store_query.namespace,
        "groups": groups,
        "totals": totals,
    });
    if bucket_ms.is_some()
        && let Some(object) = answer.as_object_mut()
    {
        // EX-10: the non-empty buckets, oldest first, each with its groups.
        let buckets: Vec<serde_json::Value> = buckets
            .into_iter()
            .map(|(start, groups)| {
                let groups: Vec<Group> = groups
                    .into_iter()
                    .map(|(key, ledger)| Group { key, ledger })
                    .collect();
                serde_json::json!({"start": super::requests::rfc3339(start), "groups": groups})
            })
            .collect();
        object.insert("bucket".into(), serde_json::json!(bucket_name(bucket_ms)));
        object.insert("buckets".into(), serde_json::Value::Array(buckets));
    }
    axum::Json(answer).into_response()
}
