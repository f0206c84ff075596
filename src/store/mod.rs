//! The durable request log: the [`Store`] trait and its record types.
//!
//! Everything holdfast promises is a property of this log: a claim makes a re-send land on the
//! same request (ID-4, ID-5, ID-7), a lease lets exactly one worker run an attempt (LC-2), every
//! worker write is fenced on that lease (LC-3), and an expired lease is swept back to `pending`
//! (LC-4). Two adapters implement it — [`sqlite::SqliteStore`] (embedded default) and, for many
//! nodes, [`postgres::PostgresStore`] (DU-3) — and both pass one conformance suite
//! (`tests/api/store_conformance.rs`).
//!
//! All timestamps are milliseconds since the Unix epoch ([`Millis`]).

#[macro_use]
mod row;

mod callback;
pub mod postgres;
mod quota;
mod rules;
pub mod sqlite;

pub use callback::{Callback, CallbackLease, CallbackOutcome, CallbackState};
pub use quota::LeaseQuota;
pub use rules::{
    FAILURE_WINDOW_MS, end_chunk, end_data, failure_releases_claim, released_claim_expiry,
};
pub(crate) use rules::{holds_outcome, releases_claim};

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::Serialize;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::provider::Route;
pub use crate::provider::Usage;

/// Milliseconds since the Unix epoch.
pub type Millis = i64;

/// Now, in [`Millis`].
pub fn now_ms() -> Millis {
    chrono::Utc::now().timestamp_millis()
}

/// A shared store handle.
pub type DynStore = Arc<dyn Store>;

/// The record of a request just inserted by [`Store::submit`], as a store's column defaults make
/// it: pending and due now, or `leased` (running its first attempt); no chunks.
pub(crate) fn created_record(new: NewRequest, leased: bool) -> RequestRecord {
    RequestRecord {
        id: new.id,
        namespace: new.namespace,
        route: new.route,
        backend: new.backend,
        model: new.model,
        stream: new.stream,
        body: new.body,
        headers: new.headers,
        claim: new.claim,
        status: if leased {
            Status::Running
        } else {
            Status::Pending
        },
        attempts: u32::from(leased),
        recoveries: 0,
        next_retry_at: new.now,
        error: None,
        response_status: None,
        response_body: None,
        upstream_request_id: None,
        last_seq: 0,
        reset_seq: 0,
        created_at: new.now,
        updated_at: new.now,
        finished_at: None,
        attached: 0,
        replayed: 0,
        log_reads: 0,
        usage: Usage::default(),
        trace_parent: new.trace_parent,
        replay_of: new.replay_of,
    }
}

/// Lifecycle status (LC-1). The database enforces the same set with a CHECK constraint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Waiting for a worker (possibly until `next_retry_at`).
    Pending,
    /// Leased by a worker.
    Running,
    /// Finished with a provider answer.
    Succeeded,
    /// Finished without one; see [`ErrorInfo`].
    Failed,
}

impl Status {
    /// The database spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Pending => "pending",
            Status::Running => "running",
            Status::Succeeded => "succeeded",
            Status::Failed => "failed",
        }
    }

    /// Parses the database spelling.
    pub fn parse(s: &str) -> Option<Status> {
        Some(match s {
            "pending" => Status::Pending,
            "running" => Status::Running,
            "succeeded" => Status::Succeeded,
            "failed" => Status::Failed,
            _ => return None,
        })
    }

    /// `succeeded` or `failed`.
    pub fn is_terminal(self) -> bool {
        matches!(self, Status::Succeeded | Status::Failed)
    }
}

/// Why a request failed (LC-11). The spelling is the public `error.type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorType {
    /// The provider refused the request with a terminal 4xx (LC-6).
    UpstreamRefused,
    /// Transient failures used up `max_attempts` (LC-5).
    AttemptsExhausted,
    /// The provider failed after the first chunk of a stream was stored (LC-7).
    StreamInterrupted,
    /// The last lease expired and no attempts were left (LC-4).
    LeaseExpired,
    /// Cancelled through `POST /requests/{id}/cancel` (LC-9).
    Cancelled,
    /// A 2xx whose body or stream could not be parsed.
    UpstreamInvalid,
}

impl ErrorType {
    /// The database and API spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorType::UpstreamRefused => "upstream_refused",
            ErrorType::AttemptsExhausted => "attempts_exhausted",
            ErrorType::StreamInterrupted => "stream_interrupted",
            ErrorType::LeaseExpired => "lease_expired",
            ErrorType::Cancelled => "cancelled",
            ErrorType::UpstreamInvalid => "upstream_invalid",
        }
    }

    /// Parses the database spelling.
    pub fn parse(s: &str) -> Option<ErrorType> {
        Some(match s {
            "upstream_refused" => ErrorType::UpstreamRefused,
            "attempts_exhausted" => ErrorType::AttemptsExhausted,
            "stream_interrupted" => ErrorType::StreamInterrupted,
            "lease_expired" => ErrorType::LeaseExpired,
            "cancelled" => ErrorType::Cancelled,
            "upstream_invalid" => ErrorType::UpstreamInvalid,
            _ => return None,
        })
    }
}

/// `error` of a record (RD-1): `{"type","message","status"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ErrorInfo {
    /// Cause.
    #[serde(rename = "type")]
    pub kind: ErrorType,
    /// What happened, in plain words.
    pub message: String,
    /// The provider's HTTP status, when there was one.
    pub status: Option<u16>,
}

/// How a request is identified for deduplication.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimKind {
    /// (namespace, body hash), valid for `dedupe_window_secs` (ID-4).
    BodyHash,
    /// (namespace, route, Idempotency-Key), valid for `idempotency_key_ttl_secs` (ID-5).
    Key,
}

impl ClaimKind {
    /// The database spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            ClaimKind::BodyHash => "hash",
            ClaimKind::Key => "key",
        }
    }

    /// Parses the database spelling.
    pub fn parse(s: &str) -> Option<ClaimKind> {
        match s {
            "hash" => Some(ClaimKind::BodyHash),
            "key" => Some(ClaimKind::Key),
            _ => None,
        }
    }
}

/// A request to record, produced by admission (http) after canonicalisation and routing.
#[derive(Debug, Clone)]
pub struct NewRequest {
    /// Fresh id (UUID v7, so ids sort by creation).
    pub id: Uuid,
    /// Namespace of the caller (CLI-5).
    pub namespace: String,
    /// The proxied endpoint (stored by its name, e.g. `openai.chat`).
    pub route: Route,
    /// Backend name chosen by routing.
    pub backend: String,
    /// Model sent upstream (after rewriting), if the body named one.
    pub model: Option<String>,
    /// Whether the client asked for a stream.
    pub stream: bool,
    /// Bytes sent upstream: the client's body, model rewritten in place (ID-3b).
    pub body: Vec<u8>,
    /// Forwarded client headers (ID-3a), lower-cased names, sorted.
    pub headers: Vec<(String, String)>,
    /// Request hash (ID-3); the claim key for body-hash claims, the fingerprint for keyed ones.
    pub hash: [u8; 32],
    /// Claim identity.
    pub claim: ClaimKind,
    /// The claim key: hex hash for [`ClaimKind::BodyHash`], `route + " " + key` for
    /// [`ClaimKind::Key`].
    pub claim_key: String,
    /// When the claim stops being valid.
    pub claim_expires_at: Millis,
    /// Submission time.
    pub now: Millis,
    /// The W3C `traceparent` of the call's server span, when traces are on (OT-2).
    pub trace_parent: Option<String>,
    /// Where to POST the finished record (CB-1), recorded only with a request this submission
    /// creates.
    pub callback_url: Option<String>,
    /// The request this one replays (EX-7), `None` for a client's call.
    pub replay_of: Option<Uuid>,
}

/// Outcome of [`Store::submit`].
#[derive(Debug, Clone)]
pub enum Submitted {
    /// A new request was recorded; this caller started the execution.
    Created(Box<RequestRecord>),
    /// A live claim pointed at an existing request with the same fingerprint.
    Attached(Box<RequestRecord>),
    /// A live explicit-key claim exists for a different body (ID-5: 422).
    KeyMismatch {
        /// The request the key belongs to.
        existing: Uuid,
    },
}

/// A stored request, as read back (RD-1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestRecord {
    /// Request id.
    pub id: Uuid,
    /// Namespace it belongs to.
    pub namespace: String,
    /// The proxied endpoint.
    pub route: Route,
    /// Backend name.
    pub backend: String,
    /// Model sent upstream.
    pub model: Option<String>,
    /// Streamed request.
    pub stream: bool,
    /// Bytes sent upstream.
    pub body: Vec<u8>,
    /// Forwarded headers.
    pub headers: Vec<(String, String)>,
    /// Claim identity kind.
    pub claim: ClaimKind,
    /// LC-1 status.
    pub status: Status,
    /// Times a worker took it up.
    pub attempts: u32,
    /// Attempts that began because a previous lease expired.
    pub recoveries: u32,
    /// When it may next be leased (meaningful while pending).
    pub next_retry_at: Millis,
    /// Terminal (or last transient) error.
    pub error: Option<ErrorInfo>,
    /// Provider HTTP status of the stored answer.
    pub response_status: Option<u16>,
    /// Provider body of the stored answer, byte for byte.
    pub response_body: Option<Vec<u8>>,
    /// Provider's request id header of the execution (RS-5).
    pub upstream_request_id: Option<String>,
    /// Highest chunk seq stored.
    pub last_seq: i64,
    /// Seq of the latest `reset` chunk, 0 when none: the current attempt's chunks follow it.
    pub reset_seq: i64,
    /// Submission time.
    pub created_at: Millis,
    /// Last change.
    pub updated_at: Millis,
    /// When it became terminal.
    pub finished_at: Option<Millis>,
    /// Client submissions that attached to it while it ran (deliveries beyond the first).
    pub attached: u32,
    /// Client submissions answered from storage after it ended.
    pub replayed: u32,
    /// Readers of its log as an event stream (`GET /requests/{id}`).
    pub log_reads: u32,
    /// What the attempt that gave its answer reported it cost (the last one that reported
    /// usage): what each saved call would have cost.
    pub usage: Usage,
    /// The W3C `traceparent` of the call that created it, when traces were on (OT-2): the
    /// parent of its attempts' spans on any node.
    pub trace_parent: Option<String>,
    /// The request this one replays (EX-8).
    pub replay_of: Option<Uuid>,
}

#[cfg(test)]
impl NewRequest {
    /// A non-stream request submitted at `now`, its body and hash told apart by `i`, for unit
    /// tests.
    pub(crate) fn example(i: u8, now: Millis) -> NewRequest {
        let mut hash = [0u8; 32];
        hash[0] = i;
        NewRequest {
            id: uuid::Uuid::now_v7(),
            namespace: "default".into(),
            route: Route::OpenaiChat,
            backend: "mock".into(),
            model: Some("m".into()),
            stream: false,
            body: format!("{{\"n\":{i}}}").into_bytes(),
            headers: vec![("openai-beta".into(), "x".into())],
            hash,
            claim: ClaimKind::BodyHash,
            claim_key: hex::encode(hash),
            claim_expires_at: now + 600_000,
            now,
            trace_parent: None,
            callback_url: None,
            replay_of: None,
        }
    }
}

#[cfg(test)]
impl RequestRecord {
    /// A non-stream record of attempt 1 with `status`, for unit tests.
    pub(crate) fn example(status: Status) -> RequestRecord {
        RequestRecord {
            id: uuid::Uuid::now_v7(),
            namespace: "default".into(),
            route: Route::OpenaiChat,
            backend: "b".into(),
            model: None,
            stream: false,
            body: b"{}".to_vec(),
            headers: Vec::new(),
            claim: ClaimKind::BodyHash,
            status,
            attempts: 1,
            recoveries: 0,
            next_retry_at: 0,
            error: None,
            response_status: Some(200),
            response_body: Some(b"{}".to_vec()),
            upstream_request_id: None,
            last_seq: 0,
            reset_seq: 0,
            created_at: 0,
            updated_at: 0,
            finished_at: Some(0),
            attached: 0,
            replayed: 0,
            log_reads: 0,
            usage: Usage::default(),
            trace_parent: None,
            replay_of: None,
        }
    }
}

impl RequestRecord {
    /// Client submissions this request answered: the one that created it, and every one that
    /// attached or was replayed.
    pub fn deliveries(&self) -> u32 {
        1 + self.attached + self.replayed
    }

    /// Provider calls deliveries beyond them did not make: deliveries minus attempts, when
    /// positive (docs/usage.md). At least one attempt is subtracted: the submission that created
    /// the request saved nothing, even when it was cancelled before any attempt ran.
    pub fn saved_calls(&self) -> u32 {
        self.deliveries().saturating_sub(self.attempts.max(1))
    }

    /// [`RequestRecord::saved_calls`] of the deliveries made while it ran: the first and the
    /// attached ones. Replays are counted as they are answered, so the attempt that settles the
    /// request counts only these (after a lost answer it may settle it late, replays already
    /// counted; decision 38).
    pub(crate) fn saved_calls_while_running(&self) -> u32 {
        (1 + self.attached).saturating_sub(self.attempts.max(1))
    }

    /// The saved calls of `added` attachments whose count reached the store after the request
    /// finished, when `before` had: what [`RequestRecord::saved_calls_while_running`] would
    /// have grown by had they come before (RD-9).
    pub(crate) fn saved_calls_of_late_attachments(&self, before: u32, added: u32) -> u32 {
        let attempts = self.attempts.max(1);
        (1 + before + added)
            .saturating_sub(attempts)
            .saturating_sub((1 + before).saturating_sub(attempts))
    }
}

/// Which requests [`Store::list`] returns. Every `None` matches everything.
#[derive(Debug, Clone, Default)]
pub struct ListFilter {
    /// Only this namespace's; `None`: every namespace (admin keys).
    pub namespace: Option<String>,
    /// Only this status.
    pub status: Option<Status>,
    /// Only this route.
    pub route: Option<Route>,
    /// Only this model (as sent upstream).
    pub model: Option<String>,
    /// Only this backend.
    pub backend: Option<String>,
    /// Submitted at or after.
    pub since: Option<Millis>,
    /// Submitted before.
    pub until: Option<Millis>,
    /// Only those whose body (as sent upstream) holds these bytes: a substring of the prompt,
    /// best effort (the body is JSON, so text with escapes must be searched as escaped).
    pub text: Option<String>,
    /// Only those that answered more than one submission (attached or replayed).
    pub replayed: bool,
    /// Only those whose callback is in this state (CB-6).
    pub callback: Option<CallbackState>,
    /// Only ids below this one (the paging cursor).
    pub before: Option<Uuid>,
    /// Only ids above this one (an export's cursor, EX-4).
    pub after: Option<Uuid>,
    /// Oldest first instead of newest first (an export, EX-1).
    pub oldest_first: bool,
    /// Only the replays of this request (EX-8).
    pub replay_of: Option<Uuid>,
    /// At most this many.
    pub limit: i64,
}

/// How `GET /usage` groups requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UsageGroup {
    /// By the model sent upstream.
    Model,
    /// By backend.
    Backend,
    /// By namespace.
    Namespace,
    /// By UTC day of submission (`YYYY-MM-DD`).
    Day,
    /// By provider: the first segment of the route's name (`openai`, `anthropic`, `gemini`).
    Provider,
}

/// Which requests `Store::usage` sums: submitted in `[since, until)`, of one namespace or all.
#[derive(Debug, Clone)]
pub struct UsageQuery {
    /// Only this namespace's requests; `None`: every namespace.
    pub namespace: Option<String>,
    /// Submitted at or after.
    pub since: Millis,
    /// Submitted before.
    pub until: Millis,
    /// The grouping.
    pub group_by: UsageGroup,
    /// Also by time: buckets of this many milliseconds since the epoch (an hour, a UTC day;
    /// EX-10); `None`: the whole window.
    pub bucket_ms: Option<Millis>,
}

/// One group of `Store::usage`, split by (backend, model) so prices can apply.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UsageRow {
    /// The group's key (a model, backend, namespace, or `YYYY-MM-DD`).
    pub key: String,
    /// Backend of these requests.
    pub backend: String,
    /// Model of these requests.
    pub model: Option<String>,
    /// Requests.
    pub requests: u64,
    /// Attempts (provider calls).
    pub attempts: u64,
    /// Client submissions answered (created, attached, replayed).
    pub deliveries: u64,
    /// Of which attached to a running execution.
    pub attached: u64,
    /// Of which replayed from storage.
    pub replayed: u64,
    /// Provider calls saved: per request, deliveries minus attempts when positive.
    pub saved_calls: u64,
    /// Tokens the provider reported, every attempt.
    pub usage: Usage,
    /// Tokens the saved calls would have cost: per request, saved calls times the usage of its
    /// answering (last) attempt.
    pub saved: Usage,
    /// The start of the time bucket (EX-10), when the query asked for buckets.
    pub bucket: Option<Millis>,
    /// Succeeded requests none of whose attempts reported tokens (RD-9a): their tokens and cost
    /// are in no sum.
    pub unmetered: u64,
}

/// What a stored chunk is (SPEC §0 "chunk", RD-5, RD-6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkKind {
    /// One provider SSE event.
    Data,
    /// Control: a new attempt starts after this; data is its number (LC-8, RD-6).
    Reset,
    /// Control: the request settled; data is `{"status","error"}` (RD-5).
    End,
}

impl ChunkKind {
    /// The database spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            ChunkKind::Data => "data",
            ChunkKind::Reset => "reset",
            ChunkKind::End => "end",
        }
    }

    /// Parses the database spelling.
    pub fn parse(s: &str) -> Option<ChunkKind> {
        Some(match s {
            "data" => ChunkKind::Data,
            "reset" => ChunkKind::Reset,
            "end" => ChunkKind::End,
            _ => return None,
        })
    }
}

/// One stored chunk, numbered by `seq` (1, 2, 3, ... per request).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    /// Position in the request's chunk log.
    pub seq: i64,
    /// Attempt that wrote it (for `reset`, the attempt that starts after it).
    pub attempt: u32,
    /// Data or control.
    pub kind: ChunkKind,
    /// The provider's `event:` name (data chunks), or `None`; shared as `data` is (decision 136).
    pub event: Option<Arc<str>>,
    /// The event's data (lines joined with `\n`), shared: the hub, the log's writer and
    /// every reader of an event hold the one text (decision 136).
    pub data: Arc<str>,
}

/// A provider event to store as a data chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewChunk {
    /// `event:` name, if any; shared as `data` is.
    pub event: Option<Arc<str>>,
    /// Data, shared as [`Chunk::data`] is.
    pub data: Arc<str>,
}

/// Data chunks of one attempt to append, fenced on its lease (LC-3) and on the seq they
/// follow, so that a batch is stored at most once however often its write is tried.
#[derive(Debug, Clone)]
pub struct ChunkBatch {
    /// The attempt's lease.
    pub lease: Lease,
    /// The seq the batch's first chunk follows: the request's `last_seq` as the attempt last
    /// saw it stored (its lease record's, then the last seq of each append). A write whose
    /// answer was lost (the database restarted after its commit) is tried again; finding
    /// `last_seq` already at `after` plus the batch's length under the same lease, the store
    /// answers with what the first try stored instead of storing the events twice.
    pub after: i64,
    /// Events in order.
    pub chunks: Vec<NewChunk>,
    /// The provider's request id, recorded with the first batch of an attempt (RS-5).
    pub upstream_request_id: Option<String>,
    /// The provider's own id of this answer (a Responses `resp_...`), recorded with the batch
    /// that carried it, so the provider's retrieval protocol can be served from the log.
    pub response_id: Option<String>,
    /// The attempt's usage as reported so far, when this batch changed it: recorded with the
    /// batch, so an attempt that is abandoned keeps what the provider reported (it was billed).
    pub usage: Option<Usage>,
}

impl ChunkBatch {
    /// The batch's events as chunks at the seqs it takes: `after + 1` onwards.
    #[must_use]
    pub fn stored(&self) -> Vec<Chunk> {
        (self.after + 1..)
            .zip(&self.chunks)
            .map(|(seq, c)| Chunk {
                seq,
                attempt: self.lease.attempt,
                kind: ChunkKind::Data,
                event: c.event.clone(),
                data: c.data.clone(),
            })
            .collect()
    }
}

/// The right to run one attempt (LC-2). Every write for the attempt names it (LC-3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// Request id.
    pub id: Uuid,
    /// Unique per attempt: `<node>/<uuid>`; shared by every write the attempt makes (decision
    /// 136).
    pub owner: Arc<str>,
    /// The attempt number this lease runs (1-based).
    pub attempt: u32,
}

/// What [`Store::submit_and_lease_started`] calls with the lease of the request it created.
pub type Started = Box<dyn FnOnce(Lease) + Send>;

/// The lease [`Store::submit_and_lease`] takes on a request it creates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseTo<'a> {
    /// Lease owner, unique to the attempt (LC-3).
    pub owner: &'a str,
    /// Lease length in milliseconds.
    pub lease_ms: i64,
}

/// What a worker reports at the end of an attempt.
#[derive(Debug, Clone)]
pub enum Outcome {
    /// The provider answered; store it (non-stream: status and body).
    Succeeded {
        /// Provider HTTP status.
        status: u16,
        /// Provider body bytes.
        body: Vec<u8>,
        /// Provider request id header.
        upstream_request_id: Option<String>,
        /// The provider's own id of a non-stream answer (a Responses `resp_...`), if any.
        response_id: Option<String>,
        /// What the provider reported the attempt cost.
        usage: Option<Usage>,
    },
    /// Transient failure with attempts left: back to pending until `next_retry_at` (LC-5).
    Retry {
        /// When to try again.
        next_retry_at: Millis,
        /// What went wrong, kept on the record for readers.
        error: ErrorInfo,
    },
    /// Terminal failure (LC-5, LC-6, LC-7, LC-11).
    Failed {
        /// Why.
        error: ErrorInfo,
        /// The provider's status and body, stored and replayed for a terminal refusal (RS-7).
        response: Option<(u16, Vec<u8>)>,
        /// Provider request id header.
        upstream_request_id: Option<String>,
        /// What the provider reported before the attempt failed (an interrupted stream was
        /// billed for what it produced).
        usage: Option<Usage>,
    },
}

/// Deliveries and log reads of one request counted since the last write of them
/// ([`Store::add_counts`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// The request.
    pub id: Uuid,
    /// Submissions that attached to it while it ran.
    pub attached: u32,
    /// Submissions answered from its log after it ended.
    pub replayed: u32,
    /// Readers of its log as an event stream.
    pub log_reads: u32,
}

/// What [`Store::add_counts`] did besides adding.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AddedCounts {
    /// Requests whose rows other writes held (PostgreSQL): nothing was added to them.
    pub busy: Vec<Uuid>,
    /// Requests already finished when attachments were added to them, each with its
    /// `attached` count before this write.
    pub late: Vec<(Uuid, u32)>,
}

/// Where a provider's answer id was recorded ([`Store::find_response`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseRef {
    /// The request it answered.
    pub request_id: Uuid,
    /// That request's namespace.
    pub namespace: String,
    /// The attempt that produced it.
    pub attempt: u32,
}

/// What a sweep did (LC-4).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Swept {
    /// Requests put back to `pending` with `recoveries + 1`.
    pub recovered: Vec<Uuid>,
    /// Requests failed with `lease_expired` (no attempts left).
    pub failed: Vec<Uuid>,
}

/// What went wrong in the store, by what a caller can do about it (docs/architecture.md,
/// "Store errors").
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database could not do the work now: unreachable, I/O, a full disk, a lost
    /// connection, the SQLite writer stopped. Nothing of the write was stored, and a retry can
    /// succeed: HTTP 503 with `x-should-retry: true`.
    #[error("database unavailable: {0}")]
    Unavailable(String),
    /// A stored row holds a value this version cannot read. Retrying cannot help: HTTP 500
    /// with `x-should-retry: false`, logged with the request's id.
    #[error("corrupt row{}: {what}", id.map(|id| format!(" {id}")).unwrap_or_default())]
    Corrupt {
        /// The request whose row it is, when known.
        id: Option<Uuid>,
        /// The value that could not be read.
        what: String,
    },
    /// `database_url` names a database that cannot be used (found at start-up).
    #[error("configuration key `database_url`: {0}")]
    Config(String),
    /// The schema could not be migrated (found at start-up).
    #[error("database migration: {0}")]
    Migration(String),
}

impl StoreError {
    /// A corrupt value of request `id`.
    pub(crate) fn corrupt(id: Option<Uuid>, what: impl std::fmt::Display) -> StoreError {
        StoreError::Corrupt {
            id,
            what: what.to_string(),
        }
    }
}

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> StoreError {
        use sqlx::Error as E;
        match e {
            E::Configuration(e) => StoreError::Config(e.to_string()),
            E::Migrate(e) => StoreError::Migration(e.to_string()),
            E::TypeNotFound { .. }
            | E::ColumnIndexOutOfBounds { .. }
            | E::ColumnNotFound(_)
            | E::ColumnDecode { .. }
            | E::Decode(_)
            | E::Encode(_) => StoreError::corrupt(None, e),
            e => StoreError::Unavailable(e.to_string()),
        }
    }
}

impl From<sqlx::migrate::MigrateError> for StoreError {
    fn from(e: sqlx::migrate::MigrateError) -> StoreError {
        StoreError::Migration(e.to_string())
    }
}

impl From<rusqlite::Error> for StoreError {
    fn from(e: rusqlite::Error) -> StoreError {
        use rusqlite::Error as E;
        use rusqlite::ErrorCode;
        match &e {
            E::SqliteFailure(f, _)
                if matches!(f.code, ErrorCode::DatabaseCorrupt | ErrorCode::NotADatabase) =>
            {
                StoreError::corrupt(None, e)
            }
            E::FromSqlConversionFailure(..)
            | E::IntegralValueOutOfRange(..)
            | E::Utf8Error(_)
            | E::InvalidColumnType(..)
            | E::InvalidColumnIndex(_)
            | E::InvalidColumnName(_) => StoreError::corrupt(None, e),
            _ => StoreError::Unavailable(e.to_string()),
        }
    }
}

/// The durable log. Implementations must make `submit` and `lease` atomic in the database (a
/// unique constraint and a single conditional write respectively), never hold a transaction
/// across an await on anything but the database, and fence every lease-holding write on
/// [`Lease::owner`].
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Claims `(namespace, claim_key)` for a new request, or finds the live claim's request.
    /// Atomic: of two racing identical submissions exactly one gets [`Submitted::Created`]
    /// (ID-7). An expired claim is taken over. A keyed claim whose stored fingerprint differs
    /// from `new.hash` gives [`Submitted::KeyMismatch`].
    ///
    /// With `lease`, a request this call creates is leased in the same transaction (LC-2:
    /// `running`, `attempts = 1`): the node that accepted it and has a free worker runs it
    /// without a round trip through the dispatcher. The lease comes back only with
    /// [`Submitted::Created`]; a submission that attaches or mismatches leases nothing. A request
    /// leased this way skips ahead of older due ones — only ever when this node has a free
    /// worker, which the dispatcher would otherwise have used for them already.
    ///
    /// # Errors
    /// [`StoreError`] when the database is unavailable; nothing is recorded then.
    async fn submit_and_lease(
        &self,
        new: NewRequest,
        lease: Option<LeaseTo<'_>>,
    ) -> Result<(Submitted, Option<Lease>), StoreError>;

    /// [`Store::submit_and_lease`], calling `started` with the lease of the request it created
    /// (never for one it attached to) as soon as it has decided it, where one process alone
    /// arbitrates claims (SQLite; ID-9): before the commit, so that the provider call need not
    /// wait for it, or, after a failed commit, once the request is durable. So it is called
    /// whenever the answer is [`Submitted::Created`] with a lease, also when the caller is gone
    /// by then. It runs on the store's own thread and must only hand the attempt on. A store
    /// that decides only at the commit (PostgreSQL) calls it once the answer is durable, from
    /// the caller's own future.
    ///
    /// # Errors
    /// As [`Store::submit_and_lease`]; after a call ahead of the commit, a failed commit
    /// recorded nothing, and the lease it gave is not held.
    async fn submit_and_lease_started(
        &self,
        new: NewRequest,
        lease: Option<LeaseTo<'_>>,
        started: Started,
    ) -> Result<(Submitted, Option<Lease>), StoreError> {
        let (submitted, lease) = self.submit_and_lease(new, lease).await?;
        if let (Submitted::Created(_), Some(lease)) = (&submitted, &lease) {
            started(lease.clone());
        }
        Ok((submitted, lease))
    }

    /// [`Store::submit_and_lease`] without a lease: the dispatcher leases the request.
    ///
    /// # Errors
    /// [`StoreError`] when the database is unavailable; nothing is recorded then.
    async fn submit(&self, new: NewRequest) -> Result<Submitted, StoreError> {
        Ok(self.submit_and_lease(new, None).await?.0)
    }

    /// Reads one request of `namespace`. Another namespace's id reads as `None`.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails or the row is unreadable.
    async fn get(&self, namespace: &str, id: Uuid) -> Result<Option<RequestRecord>, StoreError>;

    /// [`Store::get`] for a held call's periodic re-read (RS-1), which asks only whether the
    /// request settled or began streaming: its status, outcome and counters as `get` reads
    /// them, but with an empty body and header list, no trace parent or replay origin, and no
    /// stored answer, none of which are read. A waiter reads the whole record with `get` once
    /// the peek shows what it waits for.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails or the row is unreadable.
    async fn peek(&self, namespace: &str, id: Uuid) -> Result<Option<RequestRecord>, StoreError> {
        self.get(namespace, id).await
    }

    /// Atomically takes the oldest due pending request: status `running`, `attempts + 1`,
    /// lease owner and expiry set (LC-2). `None` when nothing is due.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    async fn lease(
        &self,
        owner: &str,
        now: Millis,
        lease_ms: i64,
    ) -> Result<Option<(Lease, RequestRecord)>, StoreError>;

    /// Takes up to `quota.limit` due pending requests at once, each leased as by
    /// [`Store::lease`] with an owner unique to its attempt: `owner_prefix` (itself unique to
    /// the call), `/`, and the request id. First each namespace of `quota.shares` its oldest
    /// due, up to its share, the oldest of them all when the shares exceed the limit; then
    /// [`LeaseQuota::lendable`] more of the oldest due of any namespace (LC-2a). Empty when
    /// nothing is due. One job of the writer on SQLite, two statements on PostgreSQL (one
    /// when the quota has no shares), so a burst of new requests costs one write instead of
    /// one each (docs/benchmarks-history.md); each reads about as many rows as it leases.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails; nothing was leased then (PostgreSQL: the
    /// shares' leases stand when the second statement fails, and are returned then).
    async fn lease_many(
        &self,
        owner_prefix: &str,
        now: Millis,
        lease_ms: i64,
        quota: &LeaseQuota,
    ) -> Result<Vec<(Lease, RequestRecord)>, StoreError>;

    /// Extends the lease to `now + lease_ms`. `false` when the lease was lost (swept,
    /// cancelled): the worker must stop and write nothing more (LC-3).
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    async fn heartbeat(
        &self,
        lease: &Lease,
        now: Millis,
        lease_ms: i64,
    ) -> Result<bool, StoreError>;

    /// Records the end of an attempt, fenced on the lease (LC-3), and returns the record as that
    /// write left it — the worker hands it to this node's waiters, so they need not read it
    /// back. `leased` is the request as the attempt's lease returned it: what its submission
    /// set, which nothing changes, may be taken from it rather than read back (issue 30). A
    /// terminal outcome appends the `end` chunk (RD-5) in the same transaction; a terminal
    /// failure releases the claim as [`failure_releases_claim`] says (ID-6). `None` when the
    /// lease was lost and nothing was written.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails; then nothing was written.
    async fn finish_read(
        &self,
        lease: &Lease,
        leased: &RequestRecord,
        outcome: &Outcome,
        now: Millis,
    ) -> Result<Option<RequestRecord>, StoreError>;

    /// [`Store::finish_read`] without the record: `false` when the lease was lost and nothing
    /// was written.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    async fn finish(
        &self,
        lease: &Lease,
        outcome: Outcome,
        now: Millis,
    ) -> Result<bool, StoreError>;

    /// Sends `running` requests whose lease expired before `now` back to `pending` with
    /// `recoveries + 1`, or to `failed`/`lease_expired` when `attempts >= max_attempts` (LC-4).
    /// A recovered request whose abandoned attempt stored chunks gets a `reset` chunk (LC-8);
    /// a failed one gets its `end` chunk.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    async fn sweep(&self, now: Millis, max_attempts: u32) -> Result<Swept, StoreError>;

    /// Appends each batch's chunks after the request's `last_seq`, each batch fenced on its
    /// lease and on its `after` seq, all in one transaction (group commit). Returns, per batch,
    /// the stored chunks with their seqs, or `None` when that batch's lease was lost (or its
    /// `after` is not the request's last seq) and nothing of it was written. A batch an earlier
    /// call already stored (`last_seq` is `after` plus its length, same lease) is not stored
    /// again: its chunks are returned as that call stored them.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails; then nothing was written.
    async fn append_chunks(
        &self,
        batches: &[ChunkBatch],
    ) -> Result<Vec<Option<Vec<Chunk>>>, StoreError>;

    /// [`Store::append_chunks`] for batches that only positioned readers wait on (handed on
    /// ahead of the log, RS-11): the store may hold their commit open briefly for more writes
    /// (DU-7). By default they are appended at once.
    ///
    /// # Errors
    /// As [`Store::append_chunks`].
    async fn append_chunks_unawaited(
        &self,
        batches: &[ChunkBatch],
    ) -> Result<Vec<Option<Vec<Chunk>>>, StoreError> {
        self.append_chunks(batches).await
    }

    /// A stream's last batch and its attempt's outcome in one transaction: `last` appended as
    /// [`Store::append_chunks`] would, then `outcome` recorded as [`Store::finish_read`] would (of `leased`),
    /// so the final events, the outcome and the `end` chunk become durable with one commit
    /// instead of two. Returns the stored chunks of `last` and the record as the write left it;
    /// `None` when `last.lease` was lost and nothing was written.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails; then nothing was written.
    async fn finish_with_chunks(
        &self,
        leased: &RequestRecord,
        last: &ChunkBatch,
        outcome: &Outcome,
        now: Millis,
    ) -> Result<Option<(Vec<Chunk>, RequestRecord)>, StoreError>;

    /// Whether a worker should end a stream with [`Store::finish_with_chunks`] rather than an
    /// append and a [`Store::finish_read`]. SQLite: yes, one commit instead of two. PostgreSQL:
    /// no — it stores the appends of many streams in one statement and their successes in
    /// another, and a combined write per stream would run alone beside them (measured in
    /// docs/benchmarks-history.md: fewer streams per second, later first events).
    fn ends_streams_in_one_write(&self) -> bool {
        false
    }

    /// Chunks of request `id` with `seq > after`, in order, at most `limit`.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    async fn chunks_after(
        &self,
        id: Uuid,
        after: i64,
        limit: i64,
    ) -> Result<Vec<Chunk>, StoreError>;

    /// Cancels request `id` of `namespace` if it is not terminal (LC-9): `failed` with
    /// `cancelled`, lease cleared (so its worker's next fenced write or heartbeat fails and it
    /// aborts the provider call), claim released (ID-6), `end` chunk appended. Returns the
    /// record afterwards — unchanged if it was already terminal — or `None` if there is no such
    /// request in the namespace.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    async fn cancel(
        &self,
        namespace: &str,
        id: Uuid,
        now: Millis,
    ) -> Result<Option<RequestRecord>, StoreError>;

    /// The requests `filter` selects, newest first (ids are UUID v7), at most `filter.limit`
    /// (RD-7).
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    async fn list(&self, filter: &ListFilter) -> Result<Vec<RequestRecord>, StoreError>;

    /// The data chunks of each `(id, after)` in `wanted` with `seq > after`, in order, each
    /// request's in one entry: an export's streamed answers of a page in one call (EX-4).
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    async fn data_chunks_of(
        &self,
        wanted: &[(Uuid, i64)],
    ) -> Result<Vec<(Uuid, Vec<Chunk>)>, StoreError>;

    /// Reads request `id` whatever its namespace (for admin keys).
    ///
    /// # Errors
    /// [`StoreError`] when the database fails or the row is unreadable.
    async fn get_any(&self, id: Uuid) -> Result<Option<RequestRecord>, StoreError>;

    /// Hands a running attempt back at shutdown (DU-5), fenced on the lease, with the sweep's
    /// verdict and no recovery counted (`rules::handed_back`): `pending`, due at once, with a
    /// `reset` chunk if the attempt stored chunks; or, when it was attempt `max_attempts`,
    /// `failed` with `lease_expired` (its `end` chunk, its claim released as ID-6 says), so
    /// `attempts` never exceeds `max_attempts`. `false` when the lease was already lost.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    async fn release(
        &self,
        lease: &Lease,
        now: Millis,
        max_attempts: u32,
    ) -> Result<bool, StoreError>;

    /// Hands back an attempt that never called its provider (DU-5: leased before shutdown's
    /// signal and started after it), fenced on the lease: `pending`, due at once, with its
    /// attempt uncounted (`attempts` back by one), so a request is never failed, nor its
    /// attempts spent, by a lease no call followed. `false` when the lease was already lost.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    async fn release_unstarted(&self, lease: &Lease, now: Millis) -> Result<bool, StoreError>;

    /// Deletes at most `limit` terminal requests that finished before `before`, with their
    /// chunks and claims, except those whose webhook delivery is still pending and that finished
    /// at or after `pending_callback_before` (DU-4, decision 82). Returns how many were deleted.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    async fn prune(
        &self,
        before: Millis,
        pending_callback_before: Millis,
        limit: i64,
    ) -> Result<u64, StoreError>;

    /// Which request, namespace and attempt a provider's answer id belongs to, in any
    /// namespace (the caller checks it); `None` for an id holdfast never recorded.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    async fn find_response(&self, response_id: &str) -> Result<Option<ResponseRef>, StoreError>;

    /// The usage each attempt of request `id` reported, by attempt number.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    async fn attempt_usage(&self, id: Uuid) -> Result<Vec<(u32, Usage)>, StoreError>;

    /// Adds deliveries (submissions that attached to a request while it ran, or were answered
    /// from its log after it ended) and readers of its log to each request `counts` names, with
    /// one write for all of them (DU-6). Apart from the submissions' own transactions and off
    /// the writer queue of submissions, leases, chunks and outcomes, so a duplicate is answered
    /// even when nothing can be written, and counting never delays other work. `counts` is
    /// sorted by id, the order rows are locked in. A request no longer stored is skipped.
    /// Answers the ids whose rows other writes held at that moment (PostgreSQL skips them
    /// rather than wait): their counts were not added, to be tried again; and the requests
    /// that had already finished when attachments were added to them, with their attachments
    /// before: the attempt that finished one counted only those as saved calls (RD-9), so
    /// these are counted by the caller.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails; nothing was added then.
    async fn add_counts(&self, counts: &[Counts]) -> Result<AddedCounts, StoreError>;

    /// The usage ledger of the requests `query` selects, one row per (group, backend, model).
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    async fn usage(&self, query: &UsageQuery) -> Result<Vec<UsageRow>, StoreError>;

    /// Leases up to `quota.limit` due callbacks (CB-4): of terminal requests, `next_try_at`
    /// passed, no live lease (an expired one is taken over). Each gets `attempts + 1` and an
    /// owner unique to the try, `owner_prefix/<request id>`, until `now + lease_ms`. First each
    /// namespace of `quota.shares` its oldest due, up to its share, the oldest of them all
    /// when the shares exceed the limit; then [`LeaseQuota::lendable`] more of the oldest
    /// due of any namespace (CB-7). Reads about as many rows as it leases, not the backlog.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails; nothing was leased then (PostgreSQL: the first
    /// step's leases stand when the second fails, and are returned then).
    async fn lease_callbacks(
        &self,
        owner_prefix: &str,
        now: Millis,
        lease_ms: i64,
        quota: &LeaseQuota,
    ) -> Result<Vec<CallbackLease>, StoreError>;

    /// Records a try's outcome, fenced on its lease: `false` when the lease was lost (taken
    /// over after it expired) and nothing was written.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    async fn finish_callback(
        &self,
        lease: &CallbackLease,
        outcome: &CallbackOutcome,
        now: Millis,
    ) -> Result<bool, StoreError>;

    /// The callbacks of the requests `ids` that have one, in no particular order (CB-6).
    ///
    /// # Errors
    /// [`StoreError`] when the database fails or a row is unreadable.
    async fn callbacks(&self, ids: &[Uuid]) -> Result<Vec<Callback>, StoreError>;

    /// Pending callbacks of terminal requests: due, retrying or in flight (CB-6's backlog).
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    async fn callback_backlog(&self) -> Result<i64, StoreError>;

    /// Number of requests per status (for queue-depth metrics).
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    async fn counts(&self) -> Result<Vec<(Status, i64)>, StoreError>;

    /// Earliest `next_retry_at` of any pending request, to sleep until it.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    async fn next_due(&self) -> Result<Option<Millis>, StoreError>;

    /// Whether the database answers (for `/readyz`).
    ///
    /// # Errors
    /// [`StoreError`] when it does not.
    async fn ping(&self) -> Result<(), StoreError>;

    /// Reports changes made by *other* processes sharing this store until `shutdown` is
    /// cancelled: [`Notification::Changed`] for a request whose chunks or status changed (its
    /// readers re-read the store), [`Notification::Work`] when new work was recorded (an idle
    /// worker pool looks for it). The store only reports; `app.rs` turns notifications into
    /// wake-ups of readers and workers.
    ///
    /// A notification is only a shortcut: readers re-read the store every half second and idle
    /// workers every `workers.poll_interval_ms`, so an implementation may lose notifications (a
    /// dropped connection) and must then just carry on. Errors are logged, never returned.
    ///
    /// The default reports nothing and returns at once: a store used by one process (SQLite)
    /// has no other writers to report.
    async fn listen(
        &self,
        notifications: mpsc::UnboundedSender<Notification>,
        shutdown: CancellationToken,
    ) {
        let _ = (notifications, shutdown);
    }
}

/// A change another process made to a shared store (DU-3), reported by [`Store::listen`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Notification {
    /// Request `0`'s chunks or status changed.
    Changed(Uuid),
    /// A request became due: an idle worker pool should look for work.
    Work,
}

/// Opens the store named by `database_url` and applies its migrations: `sqlite:` for the
/// embedded store, `postgres://` or `postgresql://` for a database shared by several nodes
/// (DU-3).
///
/// # Errors
/// [`StoreError`] when the database cannot be opened or migrated, or the URL names no known
/// store. Messages never contain a password (IN-3).
pub async fn open(config: &crate::config::Config) -> Result<DynStore, StoreError> {
    let url = config.database_url.as_str();
    if url.starts_with("sqlite:") {
        let store = sqlite::SqliteStore::open(url, config.sqlite_synchronous).await?;
        Ok(Arc::new(store))
    } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        Ok(Arc::new(
            postgres::PostgresStore::open_with_limits(
                url,
                config.database_pool_size,
                Duration::from_millis(config.database_timeout_ms),
            )
            .await?,
        ))
    } else {
        Err(StoreError::Config(format!(
            "{:?}: expected sqlite:, postgres:// or postgresql://",
            redact_url(url)
        )))
    }
}

/// Which schema the database `database_url` names is at, next to the newest this binary
/// knows, read without creating or migrating anything (`holdfast --version`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchemaVersion {
    /// The database's: `None` when holdfast has not created its schema there yet (a SQLite
    /// file that does not exist, a PostgreSQL database never migrated).
    pub database: Option<i64>,
    /// This binary's newest migration.
    pub binary: i64,
}

/// Reads [`SchemaVersion`] of the database `url` names.
///
/// # Errors
/// [`StoreError`] when the URL is not usable or the database cannot be read.
pub async fn schema_version(url: &str) -> Result<SchemaVersion, StoreError> {
    if url.starts_with("sqlite:") {
        Ok(SchemaVersion {
            database: sqlite::schema_version(url)?,
            binary: sqlite::LATEST_SCHEMA,
        })
    } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        Ok(SchemaVersion {
            database: migrated(postgres::schema_version(url).await?),
            binary: postgres::latest_schema(),
        })
    } else {
        Err(StoreError::Config(format!(
            "{:?}: expected sqlite:, postgres:// or postgresql://",
            redact_url(url)
        )))
    }
}

/// A PostgreSQL schema version as [`SchemaVersion::database`]: 0, a database holdfast never
/// migrated, is one it has not created yet, as a missing SQLite file is.
fn migrated(version: i64) -> Option<i64> {
    (version > 0).then_some(version)
}

/// A database URL with any password replaced by `***`, for messages and logs (IN-3): the one in
/// the user-info part (`postgres://user:secret@host`) and a `password=` query parameter
/// (`postgres://host/db?password=secret`).
pub fn redact_url(url: &str) -> String {
    let (base, query) = match url.find('?') {
        Some(q) => (&url[..q], Some(&url[q + 1..])),
        None => (url, None),
    };
    let mut out = match (base.find("://"), base.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let creds = &base[scheme + 3..at];
            match creds.find(':') {
                Some(colon) => format!(
                    "{}{}:***{}",
                    &base[..scheme + 3],
                    &creds[..colon],
                    &base[at..]
                ),
                None => base.to_string(),
            }
        }
        _ => base.to_string(),
    };
    if let Some(query) = query {
        out.push('?');
        let params: Vec<String> = query
            .split('&')
            .map(|param| match param.split_once('=') {
                Some((name, _)) if name.eq_ignore_ascii_case("password") => format!("{name}=***"),
                _ => param.to_string(),
            })
            .collect();
        out.push_str(&params.join("&"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{RequestRecord, Status, migrated, redact_url};

    /// CLI-1: `--version` says a PostgreSQL database holdfast never migrated is not created
    /// yet, as it says of a SQLite file that does not exist, not "schema version 0".
    #[test]
    fn a_postgres_database_never_migrated_reads_as_not_created_yet_cli1() {
        assert_eq!(migrated(0), None);
        assert_eq!(migrated(8), Some(8));
    }

    /// RD-9, decision 74: attachments counted after their request finished save what they add
    /// beyond the attempts, never what the attempts spent.
    #[test]
    fn late_attachments_save_what_they_add_beyond_the_attempts_rd9() {
        let mut r = RequestRecord::example(Status::Succeeded);
        r.attempts = 1;
        assert_eq!(r.saved_calls_of_late_attachments(0, 3), 3);
        assert_eq!(r.saved_calls_of_late_attachments(2, 3), 3);
        r.attempts = 3;
        // Two attempts spent what the first two attachments seemed to save.
        assert_eq!(r.saved_calls_of_late_attachments(0, 3), 1);
        assert_eq!(r.saved_calls_of_late_attachments(1, 3), 2);
        assert_eq!(r.saved_calls_of_late_attachments(5, 3), 3);
        assert_eq!(r.saved_calls_of_late_attachments(0, 0), 0);
    }

    /// docs/usage.md: deliveries beyond the attempts, at least one attempt subtracted, so a
    /// request cancelled before it ran saved only its duplicates' calls.
    #[test]
    fn saved_calls_are_deliveries_beyond_the_attempts_never_the_first_submission_rd9() {
        let mut r = RequestRecord::example(Status::Failed);
        (r.attempts, r.attached, r.replayed) = (0, 0, 0);
        assert_eq!((r.saved_calls(), r.saved_calls_while_running()), (0, 0));
        r.attached = 2;
        assert_eq!((r.saved_calls(), r.saved_calls_while_running()), (2, 2));
        r.attempts = 3;
        assert_eq!((r.saved_calls(), r.saved_calls_while_running()), (0, 0));
        (r.attempts, r.replayed) = (1, 1);
        assert_eq!((r.saved_calls(), r.saved_calls_while_running()), (3, 2));
    }

    #[test]
    fn redact_url_hides_passwords_in_userinfo_and_query() {
        assert_eq!(
            redact_url("postgres://holdfast:s3cr:et@db:5432/holdfast"),
            "postgres://holdfast:***@db:5432/holdfast"
        );
        assert_eq!(
            redact_url("postgresql://u@db/x?sslmode=require&password=hunter2"),
            "postgresql://u@db/x?sslmode=require&password=***"
        );
        assert_eq!(
            redact_url("postgres://u:pw@db/x?application_name=a@b"),
            "postgres://u:***@db/x?application_name=a@b"
        );
        assert_eq!(redact_url("sqlite://holdfast.db"), "sqlite://holdfast.db");
        assert_eq!(redact_url("postgres://db/x"), "postgres://db/x");
    }
}
