//! holdfast: a durable proxy for LLM APIs.
//!
//! Unmodified vendor SDKs point their `base_url` at holdfast. Every request is written to a
//! durable log before anything else happens, keyed by a hash of its canonical JSON body, so an
//! SDK's own retry of a call lands on the first execution instead of paying for a second one.
//! The contract is `SPEC.md` (rule ids like `ID-3` are cited throughout).
//!
//! One request flows one way:
//!
//! ```text
//! client ─► http (admit: auth, size, JSON) ─► canonical (hash) ─► store.submit (claim) ─► answer (hold / replay)
//!                                                                       │                    ▲
//!                                     worker ◄── store.lease ◄──────────┘                    │
//!                                       │                                                    │
//!                                       └─► upstream (provider call) ─► store.finish ─► hub (wake readers)
//! ```
//!
//! Modules, in the order of that flow:
//! - [`config`]: TOML + `HOLDFAST_*` environment, validated once at start.
//! - [`http`]: router, admission, provider-shaped errors, `/requests`, operations.
//! - [`canonical`]: canonical JSON and the request hash (ID-1..ID-3).
//! - [`route`]: the proxied endpoints.
//! - [`store`]: the durable log behind the [`store::Store`] trait (SQLite and PostgreSQL adapters).
//! - [`worker`]: lease loop, heartbeat, sweep, retry classification and backoff.
//! - [`upstream`]: provider HTTP calls, auth, timeouts, and the SSE parser.
//! - [`hub`]: in-process wake-ups for waiting readers.
//! - [`mock`]: the fake provider of `holdfast mock-upstream` and `--demo` (CLI-3).
//! - [`metrics`]: Prometheus metric names and the recorder.
//! - [`app`]: wiring it all together.

#![cfg_attr(test, allow(clippy::unwrap_used))]

pub mod app;
pub mod canonical;
pub mod config;
mod http;
mod hub;
mod metrics;
pub mod mock;
pub mod provider;
pub mod sse;
pub mod store;
mod upstream;
mod worker;

pub use http::openapi::ROUTES as OPENAPI_ROUTES;
pub use worker::ChunkWriter;
