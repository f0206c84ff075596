//! The one mapping from a stored `requests` row to a [`RequestRecord`], shared by both
//! adapters: the column list every statement names, the position of each column in it, and
//! the checks that turn stored values into typed ones. A value this version does not know is
//! [`StoreError::Corrupt`] naming the request, never a silent default.

use uuid::Uuid;

use super::{ClaimKind, ErrorInfo, ErrorType, RequestRecord, Status, StoreError, Usage};
use crate::provider::Route;

/// The columns of a [`RequestRecord`], in the order of [`col`]. A macro, so the statements
/// that name them are `concat!`ed at compile time instead of formatted on every call (they
/// run per request).
macro_rules! request_columns {
    () => {
        concat!(
            "id, namespace, route, backend, model, stream, body, headers, claim_kind, created_at, \
             trace_parent, replay_of, ",
            state_columns!()
        )
    };
}

/// The columns of a request that change over its life (its status, attempts, outcome and
/// counters), in the order of [`col::state`]; the others are what its submission set, and
/// nothing changes them. A finish reads these back of the row it wrote and takes the rest from
/// the record as leased (issue 30).
macro_rules! state_columns {
    () => {
        "status, attempts, recoveries, next_retry_at, error_type, error_message, error_status, \
         response_status, response_body, upstream_request_id, last_seq, reset_seq, updated_at, \
         finished_at, attached, replayed, log_reads, usage_input_tokens, usage_output_tokens, \
         usage_cached_input_tokens, usage_cache_write_tokens, usage_reasoning_tokens, \
         usage_cache_write_1h_tokens"
    };
}

/// [`request_columns!`] for [`Store::peek`](super::Store::peek): the row of `requests` alone,
/// with what a waiter does not read as empty literals (the body, the headers, the trace
/// parent, the request it replays and the answer), so neither the body's table nor the large
/// values are read. `$empty_bytes` is the dialect's empty byte string. A test holds it to
/// [`request_columns!`].
macro_rules! peek_columns {
    ($empty_bytes:literal) => {
        concat!(
            "id, namespace, route, backend, model, stream, ",
            $empty_bytes,
            " AS body, '[]' AS headers, claim_kind, created_at, NULL AS trace_parent, \
             NULL AS replay_of, status, attempts, recoveries, next_retry_at, error_type, \
             error_message, error_status, response_status, NULL AS response_body, \
             upstream_request_id, last_seq, reset_seq, updated_at, finished_at, attached, \
             replayed, log_reads, usage_input_tokens, usage_output_tokens, \
             usage_cached_input_tokens, usage_cache_write_tokens, usage_reasoning_tokens, \
             usage_cache_write_1h_tokens"
        )
    };
}

/// `SET` assignments of the six answer-usage columns from six placeholders, keeping what was
/// stored where the new value is `NULL` (the attempt reported nothing).
macro_rules! usage_assignments {
    ($input:literal, $output:literal, $cached:literal, $write:literal, $reasoning:literal,
     $write_1h:literal) => {
        concat!(
            "usage_input_tokens = COALESCE(",
            $input,
            ", usage_input_tokens), ",
            "usage_output_tokens = COALESCE(",
            $output,
            ", usage_output_tokens), ",
            "usage_cached_input_tokens = COALESCE(",
            $cached,
            ", usage_cached_input_tokens), ",
            "usage_cache_write_tokens = COALESCE(",
            $write,
            ", usage_cache_write_tokens), ",
            "usage_reasoning_tokens = COALESCE(",
            $reasoning,
            ", usage_reasoning_tokens), ",
            "usage_cache_write_1h_tokens = COALESCE(",
            $write_1h,
            ", usage_cache_write_1h_tokens)"
        )
    };
}

/// A `SET` assignment of answer-usage column `usage_<kind>` from the current attempt's
/// `attempt_usage` row, keeping what was stored where that row has nothing.
macro_rules! current_attempt_usage {
    ($kind:literal) => {
        concat!(
            "usage_",
            $kind,
            " = COALESCE((SELECT a.",
            $kind,
            " FROM attempt_usage a WHERE a.request_id = requests.id \
             AND a.attempt = requests.attempts), usage_",
            $kind,
            ")"
        )
    };
}

/// `SET` assignments of the six answer-usage columns from the current attempt's reported usage,
/// for a request settled without its attempt's outcome (cancelled, or failed by the sweep): the
/// record shows what the provider reported before that, as `/usage` counts it (docs/usage.md).
macro_rules! usage_from_current_attempt {
    () => {
        concat!(
            current_attempt_usage!("input_tokens"),
            ", ",
            current_attempt_usage!("output_tokens"),
            ", ",
            current_attempt_usage!("cached_input_tokens"),
            ", ",
            current_attempt_usage!("cache_write_tokens"),
            ", ",
            current_attempt_usage!("reasoning_tokens"),
            ", ",
            current_attempt_usage!("cache_write_1h_tokens")
        )
    };
}

/// Positions in [`request_columns!`], for adapters that read columns by index.
pub(crate) mod col {
    pub(crate) const ID: usize = 0;
    pub(crate) const NAMESPACE: usize = 1;
    pub(crate) const ROUTE: usize = 2;
    pub(crate) const BACKEND: usize = 3;
    pub(crate) const MODEL: usize = 4;
    pub(crate) const STREAM: usize = 5;
    pub(crate) const BODY: usize = 6;
    pub(crate) const HEADERS: usize = 7;
    pub(crate) const CLAIM_KIND: usize = 8;
    pub(crate) const CREATED_AT: usize = 9;
    /// The request's trace context (OT-2).
    pub(crate) const TRACE_PARENT: usize = 10;
    /// The request this one replays (EX-8).
    pub(crate) const REPLAY_OF: usize = 11;
    /// The first of [`state_columns!`].
    pub(crate) const STATE: usize = 12;

    /// Positions in [`state_columns!`].
    pub(crate) mod state {
        pub(crate) const STATUS: usize = 0;
        pub(crate) const ATTEMPTS: usize = 1;
        pub(crate) const RECOVERIES: usize = 2;
        pub(crate) const NEXT_RETRY_AT: usize = 3;
        pub(crate) const ERROR_TYPE: usize = 4;
        pub(crate) const ERROR_MESSAGE: usize = 5;
        pub(crate) const ERROR_STATUS: usize = 6;
        pub(crate) const RESPONSE_STATUS: usize = 7;
        pub(crate) const RESPONSE_BODY: usize = 8;
        pub(crate) const UPSTREAM_REQUEST_ID: usize = 9;
        pub(crate) const LAST_SEQ: usize = 10;
        pub(crate) const RESET_SEQ: usize = 11;
        pub(crate) const UPDATED_AT: usize = 12;
        pub(crate) const FINISHED_AT: usize = 13;
        pub(crate) const ATTACHED: usize = 14;
        pub(crate) const REPLAYED: usize = 15;
        pub(crate) const LOG_READS: usize = 16;
        /// The first of the six usage columns (input, output, cached input, cache write,
        /// reasoning, one-hour cache write).
        pub(crate) const USAGE: usize = 17;
    }
}

/// A `requests` row as stored, before its values are checked.
#[derive(Debug)]
pub(crate) struct RawRecord {
    pub id: Uuid,
    pub namespace: String,
    pub route: String,
    pub backend: String,
    pub model: Option<String>,
    pub stream: bool,
    pub body: Vec<u8>,
    pub headers: String,
    pub claim_kind: String,
    pub created_at: i64,
    pub trace_parent: Option<String>,
    pub replay_of: Option<Uuid>,
    pub state: RawState,
}

/// The [`state_columns!`] of a `requests` row as stored, before their values are checked.
#[derive(Debug)]
pub(crate) struct RawState {
    pub status: String,
    pub attempts: i64,
    pub recoveries: i64,
    pub next_retry_at: i64,
    pub error_type: Option<String>,
    pub error_message: Option<String>,
    pub error_status: Option<i64>,
    pub response_status: Option<i64>,
    pub response_body: Option<Vec<u8>>,
    pub upstream_request_id: Option<String>,
    pub last_seq: i64,
    pub reset_seq: i64,
    pub updated_at: i64,
    pub finished_at: Option<i64>,
    pub attached: i64,
    pub replayed: i64,
    pub log_reads: i64,
    pub usage: Usage,
}

/// A request's error from its `error_type`, `error_message` and `error_status` columns; `Err`
/// naming an `error_type` this binary does not know.
pub(crate) fn error_of(
    error_type: Option<String>,
    message: Option<String>,
    status: Option<i64>,
) -> Result<Option<ErrorInfo>, String> {
    error_type
        .map(|t| {
            Ok(ErrorInfo {
                kind: ErrorType::parse(&t).ok_or_else(|| format!("error_type {t:?}"))?,
                message: message.unwrap_or_default(),
                status: status.and_then(|s| u16::try_from(s).ok()),
            })
        })
        .transpose()
}

impl RawRecord {
    /// The typed record.
    ///
    /// # Errors
    /// [`StoreError::Corrupt`] naming the request and the value it cannot read.
    pub(crate) fn into_record(self) -> Result<RequestRecord, StoreError> {
        let id = self.id;
        let bad = |what: String| StoreError::Corrupt { id: Some(id), what };
        let mut record = RequestRecord {
            id,
            route: Route::from_name(&self.route)
                .ok_or_else(|| bad(format!("route {:?}", self.route)))?,
            claim: ClaimKind::parse(&self.claim_kind)
                .ok_or_else(|| bad(format!("claim_kind {:?}", self.claim_kind)))?,
            headers: serde_json::from_str(&self.headers)
                .map_err(|e| bad(format!("headers: {e}")))?,
            namespace: self.namespace,
            backend: self.backend,
            model: self.model,
            stream: self.stream,
            body: self.body,
            created_at: self.created_at,
            trace_parent: self.trace_parent,
            replay_of: self.replay_of,
            // Set from the row's state below.
            status: Status::Pending,
            attempts: 0,
            recoveries: 0,
            next_retry_at: 0,
            error: None,
            response_status: None,
            response_body: None,
            upstream_request_id: None,
            last_seq: 0,
            reset_seq: 0,
            updated_at: 0,
            finished_at: None,
            attached: 0,
            replayed: 0,
            log_reads: 0,
            usage: Usage::default(),
        };
        self.state.check(id)?.apply_to(&mut record);
        Ok(record)
    }
}

impl RawState {
    /// The typed state of request `id`.
    ///
    /// # Errors
    /// [`StoreError::Corrupt`] naming the request and the value it cannot read.
    pub(crate) fn check(self, id: Uuid) -> Result<State, StoreError> {
        let bad = |what: String| StoreError::Corrupt { id: Some(id), what };
        let count = |n: i64, what: &str| u32::try_from(n).map_err(|_| bad(format!("{what} {n}")));
        let error =
            error_of(self.error_type, self.error_message, self.error_status).map_err(bad)?;
        Ok(State {
            status: Status::parse(&self.status)
                .ok_or_else(|| bad(format!("status {:?}", self.status)))?,
            attempts: count(self.attempts, "attempts")?,
            recoveries: count(self.recoveries, "recoveries")?,
            next_retry_at: self.next_retry_at,
            error,
            response_status: self.response_status.and_then(|s| u16::try_from(s).ok()),
            response_body: self.response_body,
            upstream_request_id: self.upstream_request_id,
            last_seq: self.last_seq,
            reset_seq: self.reset_seq,
            updated_at: self.updated_at,
            finished_at: self.finished_at,
            attached: count(self.attached, "attached")?,
            replayed: count(self.replayed, "replayed")?,
            log_reads: count(self.log_reads, "log_reads")?,
            usage: self.usage,
        })
    }
}

/// The [`state_columns!`] of a request, checked: the fields of its [`RequestRecord`] that change
/// over its life.
#[derive(Debug)]
pub(crate) struct State {
    pub status: Status,
    pub attempts: u32,
    pub recoveries: u32,
    pub next_retry_at: i64,
    pub error: Option<ErrorInfo>,
    pub response_status: Option<u16>,
    pub response_body: Option<Vec<u8>>,
    pub upstream_request_id: Option<String>,
    pub last_seq: i64,
    pub reset_seq: i64,
    pub updated_at: i64,
    pub finished_at: Option<i64>,
    pub attached: u32,
    pub replayed: u32,
    pub log_reads: u32,
    pub usage: Usage,
}

impl State {
    /// Sets the state on `record`, which holds the rest of the row.
    pub(crate) fn apply_to(self, record: &mut RequestRecord) {
        record.status = self.status;
        record.attempts = self.attempts;
        record.recoveries = self.recoveries;
        record.next_retry_at = self.next_retry_at;
        record.error = self.error;
        record.response_status = self.response_status;
        record.response_body = self.response_body;
        record.upstream_request_id = self.upstream_request_id;
        record.last_seq = self.last_seq;
        record.reset_seq = self.reset_seq;
        record.updated_at = self.updated_at;
        record.finished_at = self.finished_at;
        record.attached = self.attached;
        record.replayed = self.replayed;
        record.log_reads = self.log_reads;
        record.usage = self.usage;
    }
}

/// The six token counts of `usage` as stored (`NULL` when not reported), in the order of the
/// usage columns: input, output, cached input, cache write, reasoning, one-hour cache write.
pub(crate) fn tokens_of(usage: Option<&Usage>) -> [Option<i64>; 6] {
    let n = |v: Option<u64>| v.and_then(|v| i64::try_from(v).ok());
    match usage {
        Some(u) => [
            n(u.input_tokens),
            n(u.output_tokens),
            n(u.cached_input_tokens),
            n(u.cache_write_tokens),
            n(u.reasoning_tokens),
            n(u.cache_write_1h_tokens),
        ],
        None => [None; 6],
    }
}

#[cfg(test)]
mod tests {
    /// The peek's columns are the record's, in the same places, with the values a waiter does
    /// not read replaced by empty literals.
    #[test]
    fn a_peek_reads_the_records_columns_in_their_places() {
        let peek = peek_columns!("X''")
            .replace("X'' AS body", "body")
            .replace("'[]' AS headers", "headers");
        let peek = ["trace_parent", "replay_of", "response_body"]
            .iter()
            .fold(peek, |p, c| p.replace(&format!("NULL AS {c}"), c));
        let squeeze = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
        assert_eq!(squeeze(&peek), squeeze(request_columns!()));
    }
}
