//! holdfast: a durable proxy for LLM APIs.
//!
//! Unmodified vendor SDKs point their `base_url` at holdfast. Every request is written to a
//! durable log before anything else happens, keyed by a hash of its canonical JSON body, so an
//! SDK's own retry of a call lands on the first execution instead of paying for a second one.
//! The contract is `docs/spec.md` (rule ids like `ID-3` are cited throughout); the tour is
//! `docs/architecture.md`.
//!
//! One request flows one way:
//!
//! ```text
//! client ─► http (admit: auth, size, JSON) ─► canonical (hash) ─► worker.admit ─► store.submit_and_lease (claim)
//!                                                                                      │
//!              worker (attempt, started at admission or by the dispatcher's lease) ◄───┘
//!                │
//!                └─► upstream (provider call; provider rules) ─► store.append_chunks / finish_read
//!                                                                  │
//! client ◄── http (hold / stream / replay) ◄── hub (live chunks, settled record) ◄──┘
//! ```
//!
//! # The dependency rule
//!
//! Modules depend downwards only, never on a module above them:
//!
//! ```text
//! main ─► app ─► http ─► worker ─► upstream ─► provider
//!  │               │        │         │
//!  cli             └────────┴──► hub ─┴──► store ─► provider
//!                  (http, worker) ─► ledger ─► config ─► provider
//!                  (app, http, worker) ─► otel ─► store
//!                                  leaves: canonical, sse, metrics, mock, provider, logging
//! ```
//!
//! Each module uses only these (`tests/api/docs.rs` reads this table and checks every
//! `crate::` path in `src/` against it, and that it has no cycle):
//!
//! | module | uses |
//! |---|---|
//! | `app` | `callback` `config` `http` `hub` `metrics` `otel` `store` `upstream` `worker` |
//! | `http` | `callback` `canonical` `config` `hub` `ledger` `metrics` `otel` `provider` `sse` `store` `upstream` `worker` |
//! | `callback` | `config` `metrics` `slots` `store` |
//! | `worker` | `config` `hub` `ledger` `metrics` `otel` `provider` `slots` `sse` `store` `upstream` |
//! | `slots` | `config` `store` |
//! | `upstream` | `config` `provider` |
//! | `otel` | `config` `metrics` `provider` `store` |
//! | `hub` | `provider` `store` |
//! | `store` | `config` `metrics` `provider` |
//! | `ledger` | `config` `metrics` `provider` |
//! | `config` | `provider` |
//! | `cli` | `sse` |
//! | `canonical` | |
//! | `sse` | |
//! | `metrics` | |
//! | `mock` | |
//! | `logging` | |
//! | `provider` | |
//!
//! - [`store`] knows nothing of readers or workers: it reports other nodes' changes as
//!   [`store::Notification`]s, and `app` bridges them into the hub and the worker pool.
//! - `http` admits and cancels through the worker pool's methods (`WorkerPool::admit`,
//!   `WorkerPool::cancel`); the pool's permits, dispatcher and attempt registry are its own.
//! - [`provider`] is the only place that spells a provider rule; everything else asks it.
//!
//! Modules, in the order of the flow:
//! - [`config`]: TOML + `HOLDFAST_*` environment, validated once at start.
//! - [`cli`]: the `holdfast requests` and `holdfast usage` commands, clients of the HTTP API.
//! - `http`: router, admission, provider-shaped errors, `/requests`, operations.
//! - [`canonical`]: canonical JSON and the request hash (ID-1..ID-3).
//! - [`provider`]: provider kinds and routes, and every rule that differs between providers.
//! - `worker`: admission, dispatcher, attempts (call, classify, stream), heartbeat, sweep,
//!   retry classification and backoff, the group-commit chunk writer.
//! - `upstream`: provider HTTP calls with their three timeouts.
//! - [`sse`]: the event-stream parser and encoder.
//! - `ledger`: prices, costs and what deduplication saved (docs/usage.md).
//! - `callback`: signed webhooks when a request finishes, leased and retried from the log
//!   (CB-1..CB-7).
//! - `slots`: a node's worker and delivery slots shared between namespaces (LC-2a, CB-7).
//! - `hub`: in-process fan-out of chunks and settled records to waiting readers.
//! - [`store`]: the durable log behind the [`store::Store`] trait (SQLite and PostgreSQL).
//! - [`mock`]: the fake provider of `holdfast mock-upstream` and `--demo` (CLI-3).
//! - `metrics`: Prometheus metric names and the recorder.
//! - [`logging`]: the text log's field and line formatters, the library's text for less
//!   (decision 133), and the timestamp of both logs, the library's text without `fmt`.
//! - [`otel`]: OpenTelemetry traces of calls and attempts, exported over OTLP (OT-1..OT-6).
//! - [`app`]: wiring it all together.

#![forbid(unsafe_code)]
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

pub mod app;
mod callback;
pub mod canonical;
pub mod cli;
pub mod config;
mod http;
mod hub;
mod ledger;
pub mod logging;
mod metrics;
pub mod mock;
mod otel;
pub mod provider;
mod slots;
pub mod sse;
pub mod store;
mod upstream;
mod worker;

/// Every (method, path) holdfast serves whatever its configuration says, paths in the router's
/// `{param}` syntax: the table the router is built from (for the test that checks
/// `/openapi.json` against the server).
pub fn openapi_routes() -> Vec<(&'static str, &'static str)> {
    http::route_list()
}
pub use worker::{AppendError, ChunkWriter};
