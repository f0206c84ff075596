//! One attempt: the provider call beside its heartbeat, the answer read and classified
//! (LC-5, LC-6, LC-7, LC-11), a stream stored chunk by chunk, and the fenced outcome write
//! (LC-3).

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use tracing::{Instrument, debug, error, info, warn};

use super::WorkerPool;
use super::chunks::AppendError;
use super::retry::{self, WriteRetry};
use crate::hub::HubEvent;
use crate::ledger;
use crate::metrics as m;
use crate::provider::{Route, excerpt};
use crate::sse::SseParser;
use crate::store::{
    Chunk, ChunkBatch, ErrorInfo, ErrorType, Lease, Millis, NewChunk, Outcome, RequestRecord,
    StoreError, Usage, holds_outcome, now_ms,
};
use crate::upstream::{Call, CallError};

/// How soon a heartbeat that failed (the database unavailable) is tried again: the lease is
/// renewed within about this long of the database's return, well inside the sweeps' hold
/// (decision 52).
pub(super) const HEARTBEAT_RETRY: Duration = Duration::from_secs(1);

/// What an attempt records: its outcome and, for a stream the provider finished, the last
/// batch of events, stored with the outcome in one commit ([`Store::finish_with_chunks`]).
///
/// [`Store::finish_with_chunks`]: crate::store::Store::finish_with_chunks
struct Ending {
    outcome: Outcome,
    last: Option<ChunkBatch>,
}

impl From<Outcome> for Ending {
    fn from(outcome: Outcome) -> Ending {
        Ending {
            outcome,
            last: None,
        }
    }
}

impl WorkerPool {
    /// Runs one attempt: heartbeat beside the provider call, then the fenced outcome write.
    pub(super) async fn run_attempt(&self, lease: Lease, record: RequestRecord) {
        let lost = CancellationToken::new();
        // Renews the lease until the outcome is written; stopped with this function, however
        // it ends. In the attempt's span, so its log lines name the request.
        let heartbeat = AbortOnDropHandle::new(tokio::spawn(
            self.clone()
                .heartbeat(lease.clone(), record.updated_at, lost.clone())
                .in_current_span(),
        ));
        let registration = self.register(lease.id);
        debug!("attempt started");
        let outcome = tokio::select! {
            outcome = self.call(&lease, &record) => outcome,
            () = lost.cancelled() => None,
            () = registration.abort.cancelled() => None,
            () = self.abandon.cancelled() => {
                // Shutdown grace is over (DU-5): hand the request back without a recovery.
                let max = self.workers().max_attempts;
                match self.store.release(&lease, now_ms(), max).await {
                    Ok(true) if lease.attempt >= max => warn!(
                        error_type = "lease_expired",
                        "request failed: its last attempt was handed back at shutdown"
                    ),
                    Ok(true) => info!("handed back to pending at shutdown"),
                    Ok(false) => {}
                    Err(e) => warn!(error = %e, "could not hand back; the lease will expire"),
                }
                self.hub.publish(lease.id, HubEvent::Changed);
                None
            }
        };
        drop(registration);
        let Some(Ending { outcome, last }) = outcome else {
            info!("attempt ended without an outcome");
            return;
        };
        let retry_at = match &outcome {
            Outcome::Retry { next_retry_at, .. } => Some(*next_retry_at),
            _ => None,
        };
        log_attempt(&outcome);
        let reported = match &outcome {
            Outcome::Succeeded { usage, .. } | Outcome::Failed { usage, .. } => *usage,
            Outcome::Retry { .. } => None,
        };
        // The provider has answered: losing the outcome now would cost a second provider call
        // when the sweep re-runs the request, so a failed write is tried again for
        // `write_retry_secs`, at least one lease length (decisions 37, 52), the heartbeat still
        // renewing the lease, until the lease is found lost or shutdown's grace is over. The write is fenced (LC-3): a try after the
        // lease was lost stores nothing, and a failed try stored nothing, the last batch
        // included.
        let mut retry: Option<WriteRetry> = None;
        let mut tries = 0;
        let finished = loop {
            tries += 1;
            let written = match &last {
                Some(last) => {
                    let started = std::time::Instant::now();
                    let written = self
                        .store
                        .finish_with_chunks(last, &outcome, now_ms())
                        .await;
                    if written.is_ok() {
                        metrics::histogram!(m::CHUNK_COMMIT_SECONDS)
                            .record(started.elapsed().as_secs_f64());
                    }
                    written
                }
                None => self
                    .store
                    .finish_read(&lease, &outcome, now_ms())
                    .await
                    .map(|settled| settled.map(|settled| (Vec::new(), settled))),
            };
            let Err(e) = written else { break written };
            if !retry::is_transient(&e) {
                break Err(e);
            }
            self.health.failed();
            let retry = retry.get_or_insert_with(|| {
                warn!(error = %e, "could not record the outcome; retrying");
                WriteRetry::new(super::write_window(&self.config))
            });
            let again = tokio::select! {
                again = retry.wait() => again,
                () = lost.cancelled() => false,
                () = self.abandon.cancelled() => false,
            };
            if !again {
                break Err(e);
            }
            metrics::counter!(m::ATTEMPT_WRITE_RETRIES, "write" => "outcome").increment(1);
        };
        drop(heartbeat);
        let finished = match finished {
            // After a failed try, "not under this lease" may be that try's own commit — found
            // by the next try, or by the heartbeat while the next try waited.
            Ok(None) if retry.is_some() => self.own_earlier_commit(&lease, &outcome, tries).await,
            Err(_) if retry.is_some() && lost.is_cancelled() => {
                self.own_earlier_commit(&lease, &outcome, tries).await
            }
            Ok(Some(_)) if retry.is_some() => {
                info!(tries, "the outcome was recorded after retries");
                finished
            }
            finished => finished,
        };
        match finished {
            Ok(Some((chunks, settled))) => {
                for chunk in chunks {
                    self.hub.publish(lease.id, HubEvent::Chunk(Arc::new(chunk)));
                }
                if let Some(usage) = &reported {
                    ledger::count_upstream(
                        &self.config,
                        &settled.backend,
                        settled.model.as_deref(),
                        usage,
                    );
                }
                if settled.status.is_terminal() {
                    log_finished(&settled);
                    // Deliveries that attached while it ran saved calls whose cost is known now.
                    ledger::count_saved(
                        &self.config,
                        &settled.backend,
                        settled.model.as_deref(),
                        u64::from(settled.saved_calls_while_running()),
                        &settled.usage,
                    );
                }
                self.hub
                    .publish(lease.id, HubEvent::Settled(Arc::new(settled)));
                if let Some(at) = retry_at {
                    let wake = Arc::clone(&self.wake);
                    let delay = u64::try_from(at - now_ms()).unwrap_or(0);
                    tokio::spawn(async move {
                        tokio::time::sleep(Duration::from_millis(delay)).await;
                        wake.notify_one();
                    });
                }
                return;
            }
            Err(e) if !lost.is_cancelled() => {
                // The lease will expire and the sweep re-runs the request.
                metrics::counter!(m::ATTEMPT_WRITES_ABANDONED, "write" => "outcome").increment(1);
                error!(error = %e, tries, "could not record the outcome; the lease will expire and the request re-run");
            }
            _ => info!("lease lost before the outcome was written"),
        }
        // Not settled here: readers on this node re-read the store now, not at their next poll.
        self.hub.publish(lease.id, HubEvent::Changed);
    }

    /// An outcome write tried again after a failure found the request no longer under this
    /// lease: an earlier try committed it and only the database's answer was lost, or the
    /// lease was lost. In the first case the request holds this attempt's outcome, which is
    /// then settled here as if that try had answered — counted, logged and announced (decision
    /// 38); its chunks reach readers from the store.
    async fn own_earlier_commit(
        &self,
        lease: &Lease,
        outcome: &Outcome,
        tries: u32,
    ) -> Result<Option<(Vec<Chunk>, RequestRecord)>, StoreError> {
        match self.store.get_any(lease.id).await {
            Ok(Some(record)) if holds_outcome(&record, lease.attempt, outcome) => {
                info!(
                    tries,
                    "the outcome was recorded by an earlier try whose answer was lost"
                );
                Ok(Some((Vec::new(), record)))
            }
            Ok(_) => Ok(None),
            Err(e) => {
                warn!(error = %e, tries, "the outcome write found the request no longer under this lease, and reading it back failed: an earlier try may have recorded it");
                Ok(None)
            }
        }
    }

    /// Renews the lease every third of its length; cancels `lost` when the store says the lease
    /// is gone. A database error is not a lost lease: the lease may still be valid.
    ///
    /// The lease runs from `granted` (the time the write that granted it was dated with) and
    /// each renewal from the time it was sent, not from when it committed: a grant or a renewal
    /// that waited long in a stalled database queue is renewed again at once rather than a
    /// third of a lease later, before the sweeps' hold after an outage ends (decision 52).
    async fn heartbeat(self, lease: Lease, granted: Millis, lost: CancellationToken) {
        let third = (self.lease_ms() / 3).max(1);
        let retry = i64::try_from(HEARTBEAT_RETRY.as_millis()).unwrap_or(1_000);
        let mut next = granted.saturating_add(third);
        loop {
            let wait = (next - now_ms()).clamp(0, third);
            tokio::time::sleep(Duration::from_millis(u64::try_from(wait).unwrap_or(0))).await;
            let sent = now_ms();
            match self.store.heartbeat(&lease, sent, self.lease_ms()).await {
                Ok(true) => next = sent.saturating_add(third),
                Ok(false) => {
                    lost.cancel();
                    return;
                }
                Err(e) => {
                    warn!(error = %e, "heartbeat failed");
                    self.health.failed();
                    next = now_ms().saturating_add(third.min(retry));
                }
            }
        }
    }

    /// One provider call, classified into an [`Ending`] (LC-5, LC-6, LC-11). `None` when the
    /// lease was lost on the way.
    async fn call(&self, lease: &Lease, record: &RequestRecord) -> Option<Ending> {
        let route = record.route;
        let call = Call {
            backend: &record.backend,
            route,
            body: &record.body,
            headers: &record.headers,
            model: record.model.as_deref(),
        };
        let mut response = match self.upstreams.send(&call).await {
            Ok(r) => r,
            Err(e) => {
                metrics::counter!(m::UPSTREAM_CALLS, "backend" => record.backend.clone(), "status" => "error")
                    .increment(1);
                return Some(self.transient(lease, None, e.to_string(), None).into());
            }
        };
        let status = response.status().as_u16();
        metrics::counter!(m::UPSTREAM_CALLS, "backend" => record.backend.clone(), "status" => status.to_string())
            .increment(1);
        let request_id = route
            .provider()
            .request_id_header()
            .and_then(|name| response.headers().get(name))
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        if record.stream && (200..300).contains(&status) {
            return self
                .stream(lease, route, response, status, request_id, record.last_seq)
                .await;
        }
        let outcome = self
            .classify(lease, route, &mut response, status, request_id)
            .await;
        Some(outcome.into())
    }

    /// Classifies a whole-body answer: success, transient, refusal or invalid.
    async fn classify(
        &self,
        lease: &Lease,
        route: Route,
        response: &mut reqwest::Response,
        status: u16,
        request_id: Option<String>,
    ) -> Outcome {
        let hint = retry::retry_after(response.headers());
        let content_type = content_type_of(response);
        let body = match self.upstreams.read_body(response).await {
            Ok(b) => b,
            Err(e @ CallError::TooLarge(_)) if (200..300).contains(&status) => {
                return Outcome::Failed {
                    error: ErrorInfo {
                        kind: ErrorType::UpstreamInvalid,
                        message: e.to_string(),
                        status: Some(status),
                    },
                    response: None,
                    upstream_request_id: request_id,
                    usage: None,
                };
            }
            Err(e) => return self.transient(lease, Some(status), e.to_string(), hint),
        };
        if (200..300).contains(&status) {
            return match route.check_answer(&body) {
                Ok((response_id, usage)) => Outcome::Succeeded {
                    status,
                    body,
                    upstream_request_id: request_id,
                    response_id,
                    usage,
                },
                // Kept on the record so the operator sees what came back; never replayed.
                Err(why) => Outcome::Failed {
                    error: ErrorInfo {
                        kind: ErrorType::UpstreamInvalid,
                        message: format!(
                            "the provider answered {status} with {why} (content-type {content_type:?})"
                        ),
                        status: Some(status),
                    },
                    response: Some((status, body)),
                    upstream_request_id: request_id,
                    usage: None,
                },
            };
        }
        if retry::is_transient_status(status) {
            let message = format!("the provider answered {status}: {}", excerpt(&body));
            return match self.transient(lease, Some(status), message, hint) {
                // Keep the provider's last answer on an exhausted request for readers.
                Outcome::Failed { error, .. } => Outcome::Failed {
                    error,
                    response: Some((status, body)),
                    upstream_request_id: request_id,
                    usage: None,
                },
                other => other,
            };
        }
        if (400..500).contains(&status) {
            return Outcome::Failed {
                error: ErrorInfo {
                    kind: ErrorType::UpstreamRefused,
                    message: format!("the provider refused the request with {status}"),
                    status: Some(status),
                },
                response: Some((status, body)),
                upstream_request_id: request_id,
                usage: None,
            };
        }
        Outcome::Failed {
            error: ErrorInfo {
                kind: ErrorType::UpstreamInvalid,
                message: format!("the provider answered with unexpected status {status}"),
                status: Some(status),
            },
            response: None,
            upstream_request_id: request_id,
            usage: None,
        }
    }

    /// Reads a 2xx event stream, storing each event as a chunk through the group-commit writer
    /// and publishing it to live readers once durable.
    ///
    /// The stream succeeds only with the route's final event ([`Route::ends_stream`]); reading
    /// stops there. A failure before the first stored chunk is transient (LC-5); after it,
    /// terminal `stream_interrupted` (LC-7), and so is a body that ends without the final
    /// event. An answer that is not an event stream at all — another content type, or a body
    /// that ends without a single event — is `upstream_invalid` and kept on the record
    /// (capped): the provider answered and was paid, so it is not retried (LC-11). Garbage
    /// inside a stream fails it as `upstream_invalid` without storing the garbage.
    ///
    /// `last_seq` is the request's last seq when the lease was taken; each batch names the seq
    /// it follows, so a batch is stored once even when its write is tried again.
    async fn stream(
        &self,
        lease: &Lease,
        route: Route,
        mut response: reqwest::Response,
        status: u16,
        request_id: Option<String>,
        mut last_seq: i64,
    ) -> Option<Ending> {
        // What the provider reported the attempt has cost so far: kept on every ending, since
        // an interrupted stream was billed for what it produced.
        let mut usage = Usage::default();
        let fail = |kind: ErrorType, message: String, response: Option<Vec<u8>>, usage: &Usage| {
            Some(Ending::from(Outcome::Failed {
                error: ErrorInfo {
                    kind,
                    message,
                    status: Some(status),
                },
                response: response.map(|body| (status, body)),
                upstream_request_id: request_id.clone(),
                usage: (!usage.is_empty()).then_some(*usage),
            }))
        };
        let content_type = content_type_of(&response);
        if !is_event_stream(&content_type) {
            let (body, _) = self.upstreams.read_capped(&mut response).await;
            return fail(
                ErrorType::UpstreamInvalid,
                format!(
                    "the provider answered {status} to a stream request with content-type \
                     {content_type:?} instead of an event stream"
                ),
                Some(body),
                &usage,
            );
        }
        let mut parser = SseParser::new();
        let mut stored = 0usize;
        let mut request_id_to_store = request_id.clone();
        // The body as received while no event has been seen, kept (capped) for the record if
        // none ever arrives.
        let mut unseen = Vec::new();
        // The answer's provider id is recorded once, with the batch that announced it.
        let mut answer_id_seen = !route.keeps_answer_ids();
        // Events before the route's final one: a stream of its final event alone answered
        // nothing (decision 39).
        let mut before_final = 0usize;
        // Whether the route's opening event has come (decision 44).
        let mut opened = false;
        // Whether an event finished the answer: complete if the body ends cleanly (GM-3).
        let mut finished = false;
        loop {
            let piece = match self.upstreams.next_piece(&mut response).await {
                Ok(piece) => piece,
                Err(e) if stored == 0 => {
                    return Some(Ending::from(self.transient(
                        lease,
                        Some(status),
                        e.to_string(),
                        None,
                    )));
                }
                Err(e) => {
                    return fail(
                        ErrorType::StreamInterrupted,
                        format!("the provider stream broke after {stored} events: {e}"),
                        None,
                        &usage,
                    );
                }
            };
            let Some(bytes) = piece else { break };
            if stored == 0 {
                keep_capped(&mut unseen, &bytes);
            }
            let events = match parser.push(&bytes) {
                Ok(events) => events,
                Err(e) => {
                    let kept = (stored == 0).then(|| std::mem::take(&mut unseen));
                    return fail(
                        ErrorType::UpstreamInvalid,
                        format!(
                            "the provider stream (content-type {content_type:?}) is not valid \
                             SSE: {e}"
                        ),
                        kept,
                        &usage,
                    );
                }
            };
            if events.is_empty() {
                continue;
            }
            let mut chunks = Vec::with_capacity(events.len());
            let mut provider_error = None;
            let mut ended = false;
            let mut response_id = None;
            let mut usage_changed = false;
            for event in events {
                if ended {
                    // Reading stops at the final event (LC-7): what a provider sends after it in
                    // the same read is neither stored nor allowed to fail a complete answer.
                    break;
                }
                let inspected = route
                    .inspect_event(event.event.as_deref(), &event.data)
                    .and_then(|seen| {
                        route
                            .in_order(&seen, &mut opened, &event.data)
                            .map(|()| seen)
                    });
                match inspected {
                    Ok(seen) => {
                        if seen.error {
                            provider_error = Some(event.data.clone());
                        }
                        if !seen.ends_stream {
                            before_final += 1;
                        }
                        ended |= seen.ends_stream;
                        finished |= seen.finishes_answer;
                        if !answer_id_seen && seen.answer_id.is_some() {
                            answer_id_seen = true;
                            response_id = seen.answer_id;
                        }
                        if let Some(reported) = seen.usage {
                            usage.update(reported);
                            usage_changed = true;
                        }
                    }
                    Err(why) => {
                        let kept = (stored == 0).then(|| std::mem::take(&mut unseen));
                        let why = format!("{why} (content-type {content_type:?})");
                        return fail(ErrorType::UpstreamInvalid, why, kept, &usage);
                    }
                }
                chunks.push(NewChunk {
                    event: event.event,
                    data: event.data,
                });
            }
            if let Some(error) = &provider_error
                && stored == 0
            {
                // The provider failed before anything was stored: as transient as a 5xx.
                let message = format!("the provider sent an error event: {error}");
                return Some(self.transient(lease, Some(status), message, None).into());
            }
            let batch = ChunkBatch {
                lease: lease.clone(),
                after: last_seq,
                chunks,
                upstream_request_id: request_id_to_store.take(),
                response_id,
                usage: usage_changed.then_some(usage),
            };
            // The provider's final event: the answer is complete, whatever follows.
            let succeeded = ended && provider_error.is_none();
            if succeeded && before_final == 0 {
                // Nothing was stored yet: what came is all in `unseen`.
                return fail(
                    ErrorType::UpstreamInvalid,
                    format!(
                        "the provider stream (content-type {content_type:?}) held its final \
                         event and nothing before it: no answer"
                    ),
                    Some(std::mem::take(&mut unseen)),
                    &usage,
                );
            }
            if succeeded && self.store.ends_streams_in_one_write() {
                // Its batch is stored with the outcome: one commit for both.
                return Some(Ending {
                    outcome: stream_success(status, request_id, usage),
                    last: Some(batch),
                });
            }
            match self.chunks.append(batch).await {
                Ok(stored_chunks) => {
                    stored += stored_chunks.len();
                    last_seq = stored_chunks.last().map_or(last_seq, |chunk| chunk.seq);
                    unseen = Vec::new();
                    for chunk in stored_chunks {
                        self.hub.publish(lease.id, HubEvent::Chunk(Arc::new(chunk)));
                    }
                }
                Err(AppendError::LeaseLost) => return None,
                Err(e) => {
                    // Nothing more can be stored; the lease will expire and the sweep re-runs
                    // the request as a new attempt after a reset (LC-8).
                    warn!(error = %e, "abandoning attempt: chunks cannot be stored");
                    return None;
                }
            }
            if succeeded {
                return Some(stream_success(status, request_id, usage).into());
            }
            if let Some(error) = provider_error {
                return fail(
                    ErrorType::StreamInterrupted,
                    format!("the provider failed mid-stream: {error}"),
                    None,
                    &usage,
                );
            }
        }
        match parser.finish() {
            Err(e) => {
                let kept = (stored == 0).then_some(unseen);
                fail(
                    ErrorType::UpstreamInvalid,
                    format!(
                        "the provider stream (content-type {content_type:?}) is not valid SSE: {e}"
                    ),
                    kept,
                    &usage,
                )
            }
            Ok(_) if finished && stored > 0 => {
                Some(stream_success(status, request_id, usage).into())
            }
            Ok(_) if stored == 0 => fail(
                ErrorType::UpstreamInvalid,
                format!(
                    "the provider answered {status} with content-type {content_type:?} and a body \
                     that ended without any event"
                ),
                Some(unseen),
                &usage,
            ),
            Ok(_) => fail(
                ErrorType::StreamInterrupted,
                format!(
                    "the provider stream ended after {stored} events without its final event ({})",
                    route.stream_end_name()
                ),
                None,
                &usage,
            ),
        }
    }

    /// A transient failure: retry after backoff while attempts are left (LC-5), else
    /// `attempts_exhausted`.
    fn transient(
        &self,
        lease: &Lease,
        status: Option<u16>,
        message: String,
        hint: Option<Duration>,
    ) -> Outcome {
        let w = self.workers();
        if lease.attempt >= w.max_attempts {
            return Outcome::Failed {
                error: ErrorInfo {
                    kind: ErrorType::AttemptsExhausted,
                    message: format!("{} attempts failed; the last: {message}", lease.attempt),
                    status,
                },
                response: None,
                upstream_request_id: None,
                usage: None,
            };
        }
        let delay = retry::backoff(w, lease.attempt, hint);
        Outcome::Retry {
            next_retry_at: now_ms() + i64::try_from(delay.as_millis()).unwrap_or(i64::MAX / 4),
            error: ErrorInfo {
                kind: ErrorType::AttemptsExhausted,
                message: format!("attempt {} failed: {message}", lease.attempt),
                status,
            },
        }
    }
}

/// The outcome of a stream that ended with the provider's final event: its body is the chunk
/// log, not a stored body.
fn stream_success(status: u16, upstream_request_id: Option<String>, usage: Usage) -> Outcome {
    Outcome::Succeeded {
        status,
        body: Vec::new(),
        upstream_request_id,
        response_id: None,
        usage: (!usage.is_empty()).then_some(usage),
    }
}

/// One `warn` line for an attempt that failed: the cause, and what happens next.
fn log_attempt(outcome: &Outcome) {
    match outcome {
        Outcome::Succeeded { .. } => {}
        Outcome::Retry {
            next_retry_at,
            error,
        } => warn!(
            cause = %error.message,
            upstream_status = error.status,
            retry_in_ms = (next_retry_at - now_ms()).max(0),
            "attempt failed; the request is retried"
        ),
        Outcome::Failed { error, .. } => warn!(
            error_type = error.kind.as_str(),
            cause = %error.message,
            upstream_status = error.status,
            "attempt failed; the request failed for good"
        ),
    }
}

/// One `info` line for a request that became terminal: what it was, how it ended, how many
/// client submissions it answered so far (`deliveries`: the first, `attached` while it ran,
/// `replayed` from storage — replays of a finished request come later and are not in it), how
/// long it took (the request and attempt spans around it name the id, namespace, route and
/// backend).
pub(super) fn log_finished(record: &RequestRecord) {
    let error = record.error.as_ref();
    info!(
        id = %record.id,
        namespace = %record.namespace,
        route = record.route.name(),
        model = record.model.as_deref().unwrap_or(""),
        backend = %record.backend,
        status = record.status.as_str(),
        error_type = error.map(|e| e.kind.as_str()),
        attempts = record.attempts,
        recoveries = record.recoveries,
        deliveries = record.deliveries(),
        attached = record.attached,
        replayed = record.replayed,
        duration_ms = record.finished_at.unwrap_or(record.updated_at) - record.created_at,
        upstream_status = record.response_status.or(error.and_then(|e| e.status)),
        "request finished"
    );
}

/// Whether a `content-type` value names an event stream (`text/event-stream`, any parameters).
fn is_event_stream(content_type: &str) -> bool {
    content_type
        .split(';')
        .next()
        .is_some_and(|t| t.trim().eq_ignore_ascii_case("text/event-stream"))
}

/// Most bytes of a stream body kept on the record when the body held no event.
const KEEP_UNSEEN: usize = 64 * 1024;

/// Appends `bytes` to `kept` up to [`KEEP_UNSEEN`].
fn keep_capped(kept: &mut Vec<u8>, bytes: &[u8]) {
    let room = KEEP_UNSEEN.saturating_sub(kept.len());
    kept.extend_from_slice(&bytes[..bytes.len().min(room)]);
}

/// The provider's `Content-Type` as sent, `none` when absent: named in every
/// `upstream_invalid` message so the operator sees what came back (decision 21).
fn content_type_of(response: &reqwest::Response) -> String {
    response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .map_or_else(
            || "none".into(),
            |v| String::from_utf8_lossy(v.as_bytes()).into_owned(),
        )
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn content_types_of_event_streams_are_recognised() {
        assert!(is_event_stream("text/event-stream"));
        assert!(is_event_stream("Text/Event-Stream; charset=utf-8"));
        assert!(!is_event_stream("application/json"));
        assert!(!is_event_stream("text/html"));
    }
}
