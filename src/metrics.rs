//! Prometheus metrics (SPEC HTTP-3): names, labels and the process-wide recorder.
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `holdfast_requests_total` | counter | `route`, `outcome` = `new` \| `attached` \| `replayed` \| `refused` |
//! | `holdfast_refusals_total` | counter | `namespace` (of the caller's key), `code` (holdfast's cause: `overloaded`, `invalid_json`, ...): the refused sends above but the 401s (decision 121) |
//! | `holdfast_upstream_calls_total` | counter | `backend`, `status` (HTTP status, or `error`) |
//! | `holdfast_attempts_total` | counter | `backend` |
//! | `holdfast_recoveries_total` | counter | — (attempts re-run after a lease expired) |
//! | `holdfast_lease_expirations_total` | counter | — |
//! | `holdfast_queue_depth` | gauge | `status` (read from the store at scrape time) |
//! | `holdfast_chunk_commit_seconds` | histogram | — (one group commit of stream chunks) |
//! | `holdfast_sqlite_commit_seconds` | histogram | — (one SQLite writer transaction, every write in it) |
//! | `holdfast_sqlite_commit_jobs` | histogram | — (store writes sharing that transaction) |
//! | `holdfast_postgres_commit_seconds` | histogram | — (one PostgreSQL writer transaction) |
//! | `holdfast_postgres_commit_jobs` | histogram | — (store writes sharing that transaction) |
//! | `holdfast_attempt_write_retries_total` | counter | `write` = `chunks` \| `outcome` (tries of a failed write of an attempt after its first, decision 37) |
//! | `holdfast_attempt_writes_abandoned_total` | counter | `write` (writes of an attempt given up: failing for a lease length, not worth a retry, or at shutdown) |
//! | `holdfast_upstream_tokens_total` | counter | `provider` (the backend's kind), `backend`, `model`, `kind` = `input` \| `output` \| `cached_input` \| `cache_write` \| `reasoning` \| `cache_write_1h` |
//! | `holdfast_cost_usd_total` | gauge that only grows (USD is not an integer) | `provider` (the backend's kind), `backend`, `model` (priced usage, `[[prices]]`) |
//! | `holdfast_saved_calls_total` | counter | `provider` (the backend's kind), `backend`, `model` |
//! | `holdfast_saved_tokens_total` | counter | `provider` (the backend's kind), `backend`, `model`, `kind` |
//! | `holdfast_saved_cost_usd_total` | gauge that only grows | `provider` (the backend's kind), `backend`, `model` |
//! | `holdfast_otel_spans_exported_total` | counter | — (spans a collector accepted, OT-1) |
//! | `holdfast_otel_spans_dropped_total` | counter | `reason` = `queue_full` \| `export_failed` (spans lost, never waited for, OT-1) |
//! | `holdfast_callbacks_total` | counter | `outcome` = `delivered` \| `retried` \| `failed` (callback tries, CB-6) |
//! | `holdfast_callbacks_backlog` | gauge | — (pending callbacks of finished requests, read from the store at scrape time) |

use std::borrow::Borrow;
use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, LazyLock, OnceLock, PoisonError, RwLock};

use metrics::{Counter, Gauge};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Requests by route and outcome.
pub(crate) const REQUESTS: &str = "holdfast_requests_total";
/// Refused proxied calls by the namespace of their key and holdfast's cause (decision 121).
pub(crate) const REFUSALS: &str = "holdfast_refusals_total";
/// Provider calls by backend and status.
pub(crate) const UPSTREAM_CALLS: &str = "holdfast_upstream_calls_total";
/// Attempts started, by backend.
pub(crate) const ATTEMPTS: &str = "holdfast_attempts_total";
/// Attempts re-run because a lease expired.
pub(crate) const RECOVERIES: &str = "holdfast_recoveries_total";
/// Leases found expired by the sweep.
pub(crate) const LEASE_EXPIRATIONS: &str = "holdfast_lease_expirations_total";
/// Requests per status.
pub(crate) const QUEUE_DEPTH: &str = "holdfast_queue_depth";
/// Gauge of the calls waiting for their namespace's budget of large bodies, by namespace
/// (LC-2b).
pub(crate) const LARGE_BODIES_WAITING: &str = "holdfast_large_bodies_waiting";
/// Duration of one commit that stored stream chunks, in seconds: a group commit of the chunk
/// writer, or a stream's last batch stored with its outcome.
pub(crate) const CHUNK_COMMIT_SECONDS: &str = "holdfast_chunk_commit_seconds";
/// Duration of one SQLite writer transaction (a group of store writes), in seconds.
pub(crate) const SQLITE_COMMIT_SECONDS: &str = "holdfast_sqlite_commit_seconds";
/// Store writes (submit, lease, finish, chunk batches, ...) sharing one SQLite transaction.
pub(crate) const SQLITE_COMMIT_JOBS: &str = "holdfast_sqlite_commit_jobs";
/// Duration of one PostgreSQL writer transaction (a group of store writes), in seconds.
pub(crate) const POSTGRES_COMMIT_SECONDS: &str = "holdfast_postgres_commit_seconds";
/// Store writes sharing one PostgreSQL writer transaction.
pub(crate) const POSTGRES_COMMIT_JOBS: &str = "holdfast_postgres_commit_jobs";
/// Tries of a failed write of an attempt after its first, by `write` (`chunks`: a group commit
/// of stream chunks; `outcome`: an attempt's outcome), decision 37.
pub(crate) const ATTEMPT_WRITE_RETRIES: &str = "holdfast_attempt_write_retries_total";
/// Writes of an attempt given up (failing for a lease length, not worth a retry, or at
/// shutdown), by `write`; for `chunks` one per stream whose batch was in the failed commit.
/// Each leaves its request to the sweep.
pub(crate) const ATTEMPT_WRITES_ABANDONED: &str = "holdfast_attempt_writes_abandoned_total";

/// Tokens providers reported, by backend, model and kind.
pub(crate) const UPSTREAM_TOKENS: &str = "holdfast_upstream_tokens_total";
/// USD of the reported tokens at the configured prices.
pub(crate) const COST_USD: &str = "holdfast_cost_usd_total";
/// Provider calls deliveries did not make.
pub(crate) const SAVED_CALLS: &str = "holdfast_saved_calls_total";
/// Tokens the saved calls would have cost.
pub(crate) const SAVED_TOKENS: &str = "holdfast_saved_tokens_total";
/// Callback tries by outcome (CB-6).
pub(crate) const CALLBACKS: &str = "holdfast_callbacks_total";
/// Pending callbacks of finished requests (CB-6).
pub(crate) const CALLBACKS_BACKLOG: &str = "holdfast_callbacks_backlog";
/// USD the saved calls would have cost.
pub(crate) const SAVED_COST_USD: &str = "holdfast_saved_cost_usd_total";
/// Spans a collector accepted (OT-1).
pub(crate) const OTEL_SPANS_EXPORTED: &str = "holdfast_otel_spans_exported_total";
/// Spans lost by `reason`: `queue_full` (the export queue was full when the span ended) or
/// `export_failed` (the collector refused, failed or did not answer in time), OT-1.
pub(crate) const OTEL_SPANS_DROPPED: &str = "holdfast_otel_spans_dropped_total";

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// How often the recorder's upkeep drains histogram samples into their buckets.
const UPKEEP_EVERY: std::time::Duration = std::time::Duration::from_secs(5);
/// The name of the thread that runs the upkeep.
const UPKEEP_THREAD: &str = "metrics-upkeep";

/// Installs the process-wide Prometheus recorder once and returns its handle. `None` when
/// another recorder was installed first (then `/metrics` says so).
pub(crate) fn handle() -> Option<&'static PrometheusHandle> {
    HANDLE
        .get_or_init(|| {
            let buckets = [
                0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
            ];
            let jobs = [
                1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0,
            ];
            let recorder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Full(CHUNK_COMMIT_SECONDS.into()), &buckets)
                .ok()?
                .set_buckets_for_metric(Matcher::Full(SQLITE_COMMIT_SECONDS.into()), &buckets)
                .ok()?
                .set_buckets_for_metric(Matcher::Full(SQLITE_COMMIT_JOBS.into()), &jobs)
                .ok()?
                .set_buckets_for_metric(Matcher::Full(POSTGRES_COMMIT_SECONDS.into()), &buckets)
                .ok()?
                .set_buckets_for_metric(Matcher::Full(POSTGRES_COMMIT_JOBS.into()), &jobs)
                .ok()?
                .install_recorder()
                .ok()?;
            describe();
            // Exported at 0 from the start, so an `increase()` alert sees the first failure.
            for write in ["chunks", "outcome"] {
                metrics::counter!(ATTEMPT_WRITE_RETRIES, "write" => write).increment(0);
                metrics::counter!(ATTEMPT_WRITES_ABANDONED, "write" => write).increment(0);
            }
            // A recorder installed with `install_recorder` keeps every histogram sample until
            // something drains it: a scrape of `/metrics`, or `run_upkeep`. Without a scraper
            // the samples of every commit piled up (about 300 bytes per request; the soak
            // test's 30-minute run grew 6 MiB). The recorder is process-wide, so is this thread.
            let upkept = recorder.clone();
            let spawned = std::thread::Builder::new()
                .name(UPKEEP_THREAD.into())
                .spawn(move || {
                    loop {
                        std::thread::sleep(UPKEEP_EVERY);
                        upkept.run_upkeep();
                    }
                });
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "could not start the metrics upkeep thread");
            }
            Some(recorder)
        })
        .as_ref()
}

/// Handles of a metric's series kept by their label values once registered. Each
/// `metrics::counter!` call copies its labels into a key and looks that key up in the
/// recorder's registry (about 1.5 k instructions); a path that counts for every request takes
/// its handles from here instead (issue 30, docs/benchmarks-history.md). Nothing is kept until
/// the process's recorder is settled ([`handle`] ran): a handle registered before that would
/// count into nothing for good, so until then every call registers afresh.
///
/// Like the recorder's own registry, it keeps one entry per series it was asked for.
pub(crate) struct Kept<K, H>(RwLock<HashMap<K, H>>);

impl<K, H> Default for Kept<K, H> {
    fn default() -> Self {
        Self(RwLock::new(HashMap::new()))
    }
}

impl<K: Eq + Hash, H: Clone> Kept<K, H> {
    /// The handle kept for `key`, or the one `register` makes (kept from then on).
    pub(crate) fn get<Q>(&self, key: &Q, register: impl FnOnce() -> H) -> H
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        if HANDLE.get().is_none() {
            return register();
        }
        let kept = self.0.read().unwrap_or_else(PoisonError::into_inner);
        if let Some(handle) = kept.get(key) {
            return handle.clone();
        }
        drop(kept);
        let handle = register();
        self.0
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(key.to_owned())
            .or_insert(handle)
            .clone()
    }
}

/// `holdfast_requests_total{route, outcome}`, its handles kept once registered ([`Kept`]).
pub(crate) fn requests(route: &'static str, outcome: &'static str) -> Counter {
    static KEPT: LazyLock<Kept<(&str, &str), Counter>> = LazyLock::new(Kept::default);
    KEPT.get(
        &(route, outcome),
        || metrics::counter!(REQUESTS, "route" => route, "outcome" => outcome),
    )
}

/// What an attempt counts, by backend: `holdfast_attempts_total`,
/// `holdfast_upstream_calls_total`, and the usage its provider reported
/// (`holdfast_upstream_tokens_total`, `holdfast_cost_usd_total`), with every handle kept once
/// registered ([`Kept`]). One per worker pool, whose configuration names each backend's
/// provider.
#[derive(Default)]
pub(crate) struct AttemptMeters {
    backends: Kept<String, Arc<BackendMeters>>,
}

/// One backend's series ([`AttemptMeters`]); each registered when first counted, so a series
/// appears in `/metrics` when it first counts, as with `metrics::counter!`.
pub(crate) struct BackendMeters {
    backend: String,
    attempts: OnceLock<Counter>,
    /// By HTTP status; `None` for a call that got no answer (`status="error"`).
    calls: Kept<Option<u16>, Counter>,
    /// By model (`""` for none).
    usage: Kept<String, Arc<UsageMeters>>,
}

/// A backend's and model's token counters by kind, and its cost ([`AttemptMeters`]).
pub(crate) struct UsageMeters {
    provider: &'static str,
    backend: String,
    model: String,
    tokens: [OnceLock<Counter>; TOKEN_KINDS.len()],
    cost: OnceLock<Gauge>,
}

/// The `kind` label of the token counters, in the order the ledger gives the counts.
pub(crate) const TOKEN_KINDS: [&str; 6] = [
    "input",
    "output",
    "cached_input",
    "cache_write",
    "reasoning",
    "cache_write_1h",
];

impl AttemptMeters {
    /// The series of `backend`.
    pub(crate) fn backend(&self, backend: &str) -> Arc<BackendMeters> {
        self.backends.get(backend, || {
            Arc::new(BackendMeters {
                backend: backend.to_string(),
                attempts: OnceLock::new(),
                calls: Kept::default(),
                usage: Kept::default(),
            })
        })
    }
}

impl BackendMeters {
    /// `holdfast_attempts_total{backend}`.
    pub(crate) fn attempts(&self) -> &Counter {
        self.attempts
            .get_or_init(|| metrics::counter!(ATTEMPTS, "backend" => self.backend.clone()))
    }

    /// `holdfast_upstream_calls_total{backend, status}`: `status` the HTTP status, `None` for a
    /// call that got no answer.
    pub(crate) fn calls(&self, status: Option<u16>) -> Counter {
        self.calls.get(&status, || {
            let status = status.map_or_else(|| "error".to_string(), |s| s.to_string());
            metrics::counter!(UPSTREAM_CALLS, "backend" => self.backend.clone(), "status" => status)
        })
    }

    /// The usage series of this backend (of `provider`) and `model` (`""` for none).
    pub(crate) fn usage(&self, provider: &'static str, model: &str) -> Arc<UsageMeters> {
        self.usage.get(model, || {
            Arc::new(UsageMeters {
                provider,
                backend: self.backend.clone(),
                model: model.to_string(),
                tokens: Default::default(),
                cost: OnceLock::new(),
            })
        })
    }
}

impl UsageMeters {
    /// Adds `counts` (in the order of [`TOKEN_KINDS`]) to `holdfast_upstream_tokens_total`, one
    /// series per kind counted.
    pub(crate) fn count_tokens(&self, counts: [Option<u64>; TOKEN_KINDS.len()]) {
        for ((kind, counter), n) in TOKEN_KINDS.iter().zip(&self.tokens).zip(counts) {
            if let Some(n) = n {
                counter
                    .get_or_init(|| {
                        metrics::counter!(UPSTREAM_TOKENS, "provider" => self.provider, "backend" => self.backend.clone(), "model" => self.model.clone(), "kind" => *kind)
                    })
                    .increment(n);
            }
        }
    }

    /// `holdfast_cost_usd_total`.
    pub(crate) fn cost(&self) -> &Gauge {
        self.cost.get_or_init(|| {
            metrics::gauge!(COST_USD, "provider" => self.provider, "backend" => self.backend.clone(), "model" => self.model.clone())
        })
    }
}

fn describe() {
    metrics::describe_counter!(
        REQUESTS,
        "Proxied requests by route and outcome (new, attached, replayed, refused)."
    );
    metrics::describe_counter!(
        REFUSALS,
        "Proxied calls refused, by the namespace of their key and holdfast's cause (401s aside)."
    );
    metrics::describe_counter!(
        UPSTREAM_CALLS,
        "Provider calls by backend and HTTP status (or error)."
    );
    metrics::describe_counter!(ATTEMPTS, "Attempts started by this node, by backend.");
    metrics::describe_counter!(
        OTEL_SPANS_EXPORTED,
        "Trace spans an OTLP collector accepted."
    );
    metrics::describe_counter!(
        OTEL_SPANS_DROPPED,
        "Trace spans lost, by reason (queue_full, export_failed); export never waits."
    );
    metrics::describe_counter!(
        RECOVERIES,
        "Attempts re-run because the previous lease expired."
    );
    metrics::describe_counter!(
        LEASE_EXPIRATIONS,
        "Expired leases found by this node's sweep."
    );
    metrics::describe_gauge!(QUEUE_DEPTH, "Requests in the log by status.");
    metrics::describe_gauge!(
        LARGE_BODIES_WAITING,
        "Calls whose large body waits, unread, for its namespace's earlier ones to be recorded."
    );
    metrics::describe_counter!(
        UPSTREAM_TOKENS,
        "Tokens providers reported for attempts this node ran, by kind."
    );
    metrics::describe_gauge!(
        COST_USD,
        "USD of the reported tokens at the configured prices."
    );
    metrics::describe_counter!(
        SAVED_CALLS,
        "Provider calls that deliveries answered by this node did not make."
    );
    metrics::describe_counter!(
        SAVED_TOKENS,
        "Tokens the saved calls would have cost, by kind."
    );
    metrics::describe_gauge!(SAVED_COST_USD, "USD the saved calls would have cost.");
    metrics::describe_histogram!(
        CHUNK_COMMIT_SECONDS,
        metrics::Unit::Seconds,
        "Duration of one group commit of stream chunks."
    );
    metrics::describe_histogram!(
        SQLITE_COMMIT_SECONDS,
        metrics::Unit::Seconds,
        "Duration of one SQLite writer transaction, every store write in it."
    );
    metrics::describe_histogram!(
        SQLITE_COMMIT_JOBS,
        "Store writes (submit, lease, finish, chunk batches, ...) sharing one SQLite transaction."
    );
    metrics::describe_histogram!(
        POSTGRES_COMMIT_SECONDS,
        metrics::Unit::Seconds,
        "Duration of one PostgreSQL writer group commit (run again write by write when it fails)."
    );
    metrics::describe_histogram!(
        POSTGRES_COMMIT_JOBS,
        "Store writes sharing one PostgreSQL writer group commit."
    );
    metrics::describe_counter!(
        ATTEMPT_WRITE_RETRIES,
        "Tries of a failed write of an attempt after its first, by write (chunks, outcome)."
    );
    metrics::describe_counter!(
        ATTEMPT_WRITES_ABANDONED,
        "Writes of an attempt given up (the database failed for a lease length, or shutdown), by write; each leaves its request to the sweep."
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kept handle counts into the series `metrics::counter!` would, and the recorder is asked
    /// for it once (issue 30: the per-request registration is what keeping saves). The other
    /// path, registering afresh before the recorder is settled, has no test: `HANDLE` is
    /// process-wide, and any test of this binary may have settled it first.
    #[test]
    fn a_kept_handle_is_registered_once_and_counts_into_the_macros_series() {
        let handle = handle().expect("the recorder is installed");
        let kept: Kept<String, Counter> = Kept::default();
        let mut registered = 0;
        for _ in 0..3 {
            kept.get("kept-backend", || {
                registered += 1;
                metrics::counter!(ATTEMPTS, "backend" => "kept-backend")
            })
            .increment(2);
        }
        metrics::counter!(ATTEMPTS, "backend" => "kept-backend").increment(1);
        assert_eq!(registered, 1, "registered at the first count only");
        let rendered = handle.render();
        assert!(
            rendered.contains("holdfast_attempts_total{backend=\"kept-backend\"} 7"),
            "{rendered}"
        );
    }

    /// An attempt's series carry the labels the macros gave them: provider, backend, model and
    /// kind for tokens; a status or `error` for calls (docs/observability.md's table).
    #[test]
    fn attempt_meters_count_tokens_calls_and_cost_under_their_labels() {
        let handle = handle().expect("the recorder is installed");
        let meters = AttemptMeters::default();
        let backend = meters.backend("meters-backend");
        backend.attempts().increment(1);
        backend.calls(Some(429)).increment(1);
        backend.calls(None).increment(1);
        let usage = backend.usage("openai", "m-1");
        usage.count_tokens([None, Some(5), None, None, None, Some(3)]);
        usage.cost().increment(0.5);
        assert!(Arc::ptr_eq(
            &usage,
            &meters.backend("meters-backend").usage("openai", "m-1")
        ));
        let rendered = handle.render();
        for line in [
            "holdfast_attempts_total{backend=\"meters-backend\"} 1",
            "holdfast_upstream_calls_total{backend=\"meters-backend\",status=\"429\"} 1",
            "holdfast_upstream_calls_total{backend=\"meters-backend\",status=\"error\"} 1",
            "holdfast_upstream_tokens_total{provider=\"openai\",backend=\"meters-backend\",model=\"m-1\",kind=\"output\"} 5",
            "holdfast_upstream_tokens_total{provider=\"openai\",backend=\"meters-backend\",model=\"m-1\",kind=\"cache_write_1h\"} 3",
            "holdfast_cost_usd_total{provider=\"openai\",backend=\"meters-backend\",model=\"m-1\"} 0.5",
        ] {
            assert!(rendered.contains(line), "{line} in {rendered}");
        }
        assert!(
            !rendered.contains("model=\"m-1\",kind=\"input\""),
            "a kind never counted has no series: {rendered}"
        );
    }

    /// Histogram samples are drained without a scrape: the recorder comes with its upkeep
    /// thread (the soak test measures the memory it keeps flat).
    #[test]
    fn the_recorder_is_kept_up_by_a_thread_of_its_own_without_any_scrape() {
        assert!(handle().is_some(), "the recorder is installed");
        // The new thread names itself once it runs: look for up to 5 s.
        let start = std::time::Instant::now();
        loop {
            let threads: Vec<String> = std::fs::read_dir("/proc/self/task")
                .expect("/proc/self/task")
                .flatten()
                .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
                .map(|name| name.trim().to_string())
                .collect();
            if threads.iter().any(|name| name == UPKEEP_THREAD) {
                return;
            }
            assert!(
                start.elapsed() < std::time::Duration::from_secs(5),
                "a `{UPKEEP_THREAD}` thread runs: {threads:?}"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
}
