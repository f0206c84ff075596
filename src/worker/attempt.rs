//! One attempt: the provider call beside its heartbeat, the answer read and classified
//! (LC-5, LC-6, LC-7, LC-11), a stream stored chunk by chunk, and the fenced outcome write
//! (LC-3).

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use tracing::{Instrument, debug, error, info, warn};

use super::WorkerPool;
use super::retry::{self, WriteRetry};
use super::stream::StreamRead;
use crate::hub::HubEvent;
use crate::ledger;
use crate::metrics as m;
use crate::provider::{BodyParts, EventParts, Route};
use crate::sse::SseEvent;
use crate::store::{
    Chunk, ChunkBatch, ErrorInfo, ErrorType, Lease, Millis, Outcome, RequestRecord, StoreError,
    Usage, holds_outcome, now_ms,
};
use crate::upstream::{Call, CallError};

/// How soon a heartbeat that failed (the database unavailable) is tried again: the lease is
/// renewed within about this long of the database's return, well inside the sweeps' hold
/// (decision 52).
pub(super) const HEARTBEAT_RETRY: Duration = Duration::from_secs(1);
use serde_json::value::RawValue;

/// What an attempt records: its outcome and, for a stream the provider finished, the last
/// batch of events, stored with the outcome in one commit ([`Store::finish_with_chunks`]).
///
/// [`Store::finish_with_chunks`]: crate::store::Store::finish_with_chunks
#[derive(Debug)]
pub(super) struct Ending {
    pub(super) outcome: Outcome,
    pub(super) last: Option<ChunkBatch>,
    /// The stream's last batch when it was stored before the outcome (PostgreSQL): published
    /// only once the outcome is committed (RS-12).
    pub(super) withheld: Vec<Chunk>,
}

impl From<Outcome> for Ending {
    fn from(outcome: Outcome) -> Ending {
        Ending {
            outcome,
            last: None,
            withheld: Vec::new(),
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
        let ending = tokio::select! {
            ending = self.call(&lease, &record) => ending,
            () = lost.cancelled() => None,
            () = registration.abort.cancelled() => None,
            () = self.abandon.cancelled() => {
                self.hand_back(&lease).await;
                None
            }
        };
        drop(registration);
        let Some(ending) = ending else {
            info!("attempt ended without an outcome");
            return;
        };
        log_attempt(&ending.outcome);
        let written = self.write_outcome(&lease, &ending, &lost).await;
        drop(heartbeat);
        match written {
            Ok(Some((chunks, settled))) => {
                let Ending {
                    outcome,
                    mut withheld,
                    ..
                } = ending;
                withheld.extend(chunks);
                self.settle(&lease, &outcome, withheld, settled);
            }
            written => {
                if written.is_ok() || lost.is_cancelled() {
                    info!("lease lost before the outcome was written");
                }
                // Not settled here: readers on this node re-read the store now, not at their
                // next poll.
                self.hub.publish(lease.id, HubEvent::Changed);
            }
        }
    }

    /// Shutdown grace is over (DU-5): hands the request back without a recovery.
    async fn hand_back(&self, lease: &Lease) {
        let max = self.workers().max_attempts;
        match self.store.release(lease, now_ms(), max).await {
            Ok(true) if lease.attempt >= max => warn!(
                error_type = "lease_expired",
                "request failed: its last attempt was handed back at shutdown"
            ),
            Ok(true) => info!("handed back to pending at shutdown"),
            Ok(false) => {}
            Err(e) => warn!(error = %e, "could not hand back; the lease will expire"),
        }
        self.hub.publish(lease.id, HubEvent::Changed);
    }

    /// Writes the attempt's outcome (with a stream's last batch), fenced on its lease (LC-3):
    /// the stored chunks and the request as settled, `None` when the lease was lost.
    ///
    /// The provider has answered: losing the outcome now would cost a second provider call
    /// when the sweep re-runs the request, so a failed write is tried again for
    /// `write_retry_secs`, at least one lease length (decisions 37, 52), the heartbeat still
    /// renewing the lease, until the lease is found lost or shutdown's grace is over. A try
    /// after the lease was lost stores nothing, and a failed try stored nothing, the last batch
    /// included.
    async fn write_outcome(
        &self,
        lease: &Lease,
        ending: &Ending,
        lost: &CancellationToken,
    ) -> Result<Option<(Vec<Chunk>, RequestRecord)>, StoreError> {
        let outcome = &ending.outcome;
        let mut retry: Option<WriteRetry> = None;
        let mut tries = 0;
        let written = loop {
            tries += 1;
            let written = match &ending.last {
                Some(last) => {
                    let started = std::time::Instant::now();
                    let written = self.store.finish_with_chunks(last, outcome, now_ms()).await;
                    if written.is_ok() {
                        metrics::histogram!(m::CHUNK_COMMIT_SECONDS)
                            .record(started.elapsed().as_secs_f64());
                    }
                    written
                }
                None => self
                    .store
                    .finish_read(lease, outcome, now_ms())
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
        let written = match written {
            // After a failed try, "not under this lease" may be that try's own commit — found
            // by the next try, or by the heartbeat while the next try waited.
            Ok(None) if retry.is_some() => self.own_earlier_commit(lease, outcome, tries).await,
            Err(_) if retry.is_some() && lost.is_cancelled() => {
                self.own_earlier_commit(lease, outcome, tries).await
            }
            Ok(Some(_)) if retry.is_some() => {
                info!(tries, "the outcome was recorded after retries");
                written
            }
            written => written,
        };
        if let Err(e) = &written
            && !lost.is_cancelled()
        {
            // The lease will expire and the sweep re-runs the request.
            metrics::counter!(m::ATTEMPT_WRITES_ABANDONED, "write" => "outcome").increment(1);
            error!(error = %e, tries, "could not record the outcome; the lease will expire and the request re-run");
        }
        written
    }

    /// Announces a written outcome: its chunks and the settled request to readers, its usage
    /// and saved calls to the ledger, and a wake-up for the retry it schedules.
    fn settle(&self, lease: &Lease, outcome: &Outcome, chunks: Vec<Chunk>, settled: RequestRecord) {
        if !chunks.is_empty() {
            self.hub
                .publish(lease.id, HubEvent::Chunks(Arc::new(chunks)));
        }
        let reported = match outcome {
            Outcome::Succeeded { usage, .. } | Outcome::Failed { usage, .. } => *usage,
            Outcome::Retry { .. } => None,
        };
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
        if let Outcome::Retry { next_retry_at, .. } = outcome {
            let wake = Arc::clone(&self.wake);
            let delay = u64::try_from(next_retry_at - now_ms()).unwrap_or(0);
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(delay)).await;
                wake.notify_one();
            });
        }
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
        let request_id = response
            .headers()
            .get(route.provider().request_id_header())
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        if record.stream && (200..300).contains(&status) {
            let read = StreamRead::new(
                lease.clone(),
                route,
                status,
                content_type_of(&response),
                request_id,
                record.last_seq,
                self.store.ends_streams_in_one_write(),
            );
            return self.stream(lease, response, read).await;
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
            return match check_answer(route, &body) {
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

    /// A transient failure: retry after backoff while attempts are left (LC-5), else
    /// `attempts_exhausted`.
    pub(super) fn transient(
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

/// What [`inspect_event`] found in one provider event.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(super) struct Seen {
    /// The event reports an error (LC-7).
    pub(super) error: bool,
    /// The event completes the route's stream ([`Route::ends_stream`]).
    pub(super) ends_stream: bool,
    /// The event is the one the route's stream opens with ([`Route::stream_start_name`]).
    pub(super) starts_stream: bool,
    /// The event only keeps the stream open ([`Route::is_keepalive_event`]).
    pub(super) keepalive: bool,
    /// The provider's id of the answer, when the event announces it
    /// ([`Route::answer_id_of_event`]).
    pub(super) answer_id: Option<String>,
    /// What the event reports the attempt has cost ([`Route::usage_of_event`]).
    pub(super) usage: Option<Usage>,
}

/// Checks a provider event before it is stored: its data must be JSON or `[DONE]` (otherwise
/// `Err` with the reason). Says whether it reports an error and whether it is the route's final
/// event, as the route's provider defines them.
///
/// One parse per event: an object is read into a struct that keeps only `error` (as raw JSON,
/// so nothing is allocated for the rest, which is still fully validated) and `type`. Only what
/// that cannot read (a duplicated key) takes the slower path through `serde_json::Value`.
pub(super) fn inspect_event(route: Route, event: &SseEvent) -> Result<Seen, String> {
    #[derive(serde::Deserialize, Default)]
    struct Probe<'a> {
        #[serde(borrow)]
        error: Option<&'a RawValue>,
        #[serde(borrow, rename = "type")]
        kind: Option<std::borrow::Cow<'a, str>>,
        #[serde(borrow)]
        response: Option<&'a RawValue>,
        #[serde(borrow)]
        message: Option<&'a RawValue>,
        #[serde(borrow)]
        usage: Option<&'a RawValue>,
        #[serde(borrow)]
        choices: Option<&'a RawValue>,
    }
    let provider = route.provider();
    let name = event.event.as_deref();
    if event.data == "[DONE]" {
        return Ok(Seen {
            error: provider.is_error_event(name, None, false),
            ends_stream: route.ends_stream(&event.data, name),
            ..Seen::default()
        });
    }
    /// What the slower path read, owned: whether `error` is set, `type`, whether `choices` is
    /// there.
    struct Owned {
        error: bool,
        kind: Option<String>,
        choices: bool,
    }
    // The slower path owns what it read; the fast one borrows from the data.
    let fallback: Option<Owned>;
    let probe = match serde_json::from_str::<Probe<'_>>(&event.data) {
        Ok(probe) if event.data.starts_with('{') => {
            fallback = None;
            probe
        }
        _ => match serde_json::from_str::<serde_json::Value>(&event.data) {
            Ok(value) => {
                fallback = Some(Owned {
                    error: value.get("error").is_some_and(|e| !e.is_null()),
                    kind: value
                        .get("type")
                        .and_then(|t| t.as_str())
                        .map(str::to_owned),
                    choices: value.get("choices").is_some(),
                });
                Probe::default()
            }
            Err(_) => {
                return Err(format!(
                    "the provider sent an event whose data is not JSON: {}",
                    excerpt(event.data.as_bytes())
                ));
            }
        },
    };
    let (error, kind, has_choices) = match &fallback {
        Some(owned) => (owned.error, owned.kind.as_deref(), owned.choices),
        None => (
            probe.error.is_some_and(|e| e.get() != "null"),
            probe.kind.as_deref(),
            probe.choices.is_some(),
        ),
    };
    let parts = EventParts {
        kind: name.or(kind),
        response: probe.response,
        message: probe.message,
        usage: probe.usage.filter(|u| u.get() != "null"),
    };
    let error = provider.is_error_event(name, parts.kind, error);
    if !error && !has_choices && route.stream_events_carry_choices() {
        // Not a chunk of this route's answer: no SDK can read it (decision 42).
        return Err(format!(
            "the provider sent a stream event without `choices`: {}",
            excerpt(event.data.as_bytes())
        ));
    }
    Ok(Seen {
        error,
        ends_stream: route.ends_stream(&event.data, parts.kind),
        starts_stream: parts.kind.is_some() && parts.kind == route.stream_start_name(),
        keepalive: route.is_keepalive_event(parts.kind),
        answer_id: route.answer_id_of_event(&parts),
        usage: route.usage_of_event(&parts),
    })
}

/// Checks that `event` (`seen`) keeps the order of a stream that has an opening event
/// ([`Route::stream_start_name`]): `Err` with the reason when it is a second opening event, or
/// comes before the first and is neither a keep-alive nor an error (decision 44). `opened`
/// says whether the opening event has come, and is set by it.
pub(super) fn in_order(
    route: Route,
    seen: &Seen,
    opened: &mut bool,
    event: &SseEvent,
) -> Result<(), String> {
    let Some(start) = route.stream_start_name() else {
        return Ok(());
    };
    let why = if seen.starts_stream {
        if !std::mem::replace(opened, true) {
            return Ok(());
        }
        "sent a second"
    } else if *opened || seen.keepalive || seen.error {
        return Ok(());
    } else {
        "began with an event other than"
    };
    Err(format!(
        "the provider stream {why} `{start}`: {}",
        excerpt(event.data.as_bytes())
    ))
}

/// Whether a `content-type` value names an event stream (`text/event-stream`, any parameters).
pub(super) fn is_event_stream(content_type: &str) -> bool {
    content_type
        .split(';')
        .next()
        .is_some_and(|t| t.trim().eq_ignore_ascii_case("text/event-stream"))
}

/// Checks a 2xx non-stream answer (LC-11): it must be one JSON object, and not an error object
/// (a non-null top-level `error` with none of the route's [`Route::result_members`]). `Err`
/// says what it is instead; `Ok` carries the provider's id of the answer, if it has one.
fn check_answer(
    route: Route,
    body: &[u8],
) -> Result<(Option<String>, Option<Usage>), &'static str> {
    #[derive(serde::Deserialize)]
    struct Probe<'a> {
        #[serde(borrow)]
        error: Option<&'a RawValue>,
        choices: Option<serde::de::IgnoredAny>,
        data: Option<serde::de::IgnoredAny>,
        output: Option<serde::de::IgnoredAny>,
        content: Option<serde::de::IgnoredAny>,
        #[serde(borrow)]
        id: Option<std::borrow::Cow<'a, str>>,
        #[serde(borrow)]
        object: Option<std::borrow::Cow<'a, str>>,
        #[serde(borrow)]
        usage: Option<&'a RawValue>,
    }
    let has = |member: &str| route.result_members().contains(&member);
    let (error, answered, (answer_id, usage)) = match serde_json::from_slice::<Probe<'_>>(body) {
        Ok(p) if body.trim_ascii_start().starts_with(b"{") => (
            p.error.is_some_and(|e| e.get() != "null"),
            (p.choices.is_some() && has("choices"))
                || (p.data.is_some() && has("data"))
                || (p.output.is_some() && has("output"))
                || (p.content.is_some() && has("content")),
            {
                let parts = BodyParts {
                    id: p.id.as_deref(),
                    object: p.object.as_deref(),
                    usage: p.usage,
                };
                (route.answer_id_of_body(&parts), route.usage_of_body(&parts))
            },
        ),
        // A duplicated key (serde_json::Value keeps the last), or not an object at all.
        _ => match serde_json::from_slice::<serde_json::Value>(body) {
            Ok(serde_json::Value::Object(map)) => (
                map.get("error").is_some_and(|e| !e.is_null()),
                map.keys().any(|k| has(k)),
                {
                    let usage = map
                        .get("usage")
                        .and_then(|u| serde_json::value::to_raw_value(u).ok());
                    let parts = BodyParts {
                        id: map.get("id").and_then(|v| v.as_str()),
                        object: map.get("object").and_then(|v| v.as_str()),
                        usage: usage.as_deref(),
                    };
                    (route.answer_id_of_body(&parts), route.usage_of_body(&parts))
                },
            ),
            Ok(_) => return Err("JSON that is not an object"),
            Err(_) => return Err("a body that is not JSON"),
        },
    };
    if !answered {
        // No SDK can read an answer without its route's result member (decision 39).
        return Err(if error {
            "an error object instead of an answer"
        } else {
            match route.result_members() {
                ["choices"] => {
                    "a JSON object without `choices`, which every answer of this route has"
                }
                ["data"] => "a JSON object without `data`, which every answer of this route has",
                ["output"] => {
                    "a JSON object without `output`, which every answer of this route has"
                }
                _ => "a JSON object without `content`, which every answer of this route has",
            }
        });
    }
    Ok((answer_id, usage))
}

/// The provider's `Content-Type` as sent, `none` when absent: named in every
/// `upstream_invalid` message so the operator sees what came back (decision 21).
pub(super) fn content_type_of(response: &reqwest::Response) -> String {
    response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .map_or_else(
            || "none".into(),
            |v| String::from_utf8_lossy(v.as_bytes()).into_owned(),
        )
}

/// The first 200 characters of a provider body, for messages.
fn excerpt(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let mut out: String = text.chars().take(200).collect();
    if text.chars().count() > 200 {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(name: Option<&str>, data: &str) -> SseEvent {
        SseEvent {
            event: name.map(str::to_owned),
            data: data.to_owned(),
            ..SseEvent::default()
        }
    }

    fn error(route: Route, name: Option<&str>, data: &str) -> Result<bool, String> {
        inspect_event(route, &event(name, data)).map(|seen| seen.error)
    }

    fn ends(route: Route, name: Option<&str>, data: &str) -> bool {
        inspect_event(route, &event(name, data)).is_ok_and(|seen| seen.ends_stream)
    }

    #[test]
    fn inspect_event_validates_json_once_and_finds_error_events_lc7() {
        let chat = Route::OpenaiChat;
        assert_eq!(error(chat, None, r#"{"choices":[]}"#), Ok(false));
        assert_eq!(error(chat, None, "[DONE]"), Ok(false));
        assert_eq!(
            error(chat, None, r#"{"error":null,"choices":[]}"#),
            Ok(false)
        );
        assert_eq!(
            error(chat, None, r#"{"error":{"message":"overloaded"}}"#),
            Ok(true)
        );
        assert_eq!(error(chat, Some("error"), r#"{"type":"error"}"#), Ok(true));
        // A duplicated key is JSON serde_json::Value accepts (last one wins).
        assert_eq!(
            error(chat, None, r#"{"error":null,"error":{"m":1}}"#),
            Ok(true)
        );
        assert!(error(chat, None, r#"{"choices":[]"#).is_err());
        assert!(error(chat, None, r#"{"a":1} trailing"#).is_err());
        assert!(error(chat, None, "hello").is_err());
    }

    #[test]
    fn a_chat_or_completions_stream_event_without_choices_is_not_the_routes_lc7_lc11_decision42() {
        for route in [Route::OpenaiChat, Route::OpenaiCompletions] {
            // Every chunk carries `choices`, the usage-only chunk an empty one.
            assert_eq!(
                error(route, None, r#"{"choices":[],"usage":{}}"#),
                Ok(false)
            );
            for data in [
                r#"{"id":"x","object":"chat.completion.chunk"}"#,
                "[1, 2]",
                "3",
                r#"{"error":null}"#,
            ] {
                let refused = error(route, None, data).expect_err(data);
                assert!(refused.contains("without `choices`"), "{refused}");
            }
            // An error event is an error, not a malformed chunk; `[DONE]` ends the stream.
            assert_eq!(
                error(route, None, r#"{"error":{"message":"overloaded"}}"#),
                Ok(true)
            );
            assert!(ends(route, None, "[DONE]"));
        }
        // Other routes' events are told by their type, not by `choices`.
        assert_eq!(
            error(
                Route::OpenaiResponses,
                None,
                r#"{"type":"response.output_text.delta","delta":"hi"}"#
            ),
            Ok(false)
        );
        assert_eq!(
            error(Route::AnthropicMessages, Some("ping"), r#"{"type":"ping"}"#),
            Ok(false)
        );
    }

    /// The events of one stream, in order, through [`in_order`]: the reason of the first one
    /// out of place, if any.
    fn first_misplaced(route: Route, events: &[(Option<&str>, &str)]) -> Option<String> {
        let mut opened = false;
        events.iter().find_map(|(name, data)| {
            let event = event(*name, data);
            let seen = inspect_event(route, &event).expect("valid event");
            in_order(route, &seen, &mut opened, &event).err()
        })
    }

    #[test]
    fn a_messages_stream_opens_with_message_start_once_lc7_lc11_decision44() {
        let route = Route::AnthropicMessages;
        let start = (
            Some("message_start"),
            r#"{"type":"message_start","message":{}}"#,
        );
        let ping = (Some("ping"), r#"{"type":"ping"}"#);
        let delta = (
            Some("content_block_delta"),
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"x"}}"#,
        );
        let stop = (Some("message_stop"), r#"{"type":"message_stop"}"#);
        let error = (
            Some("error"),
            r#"{"type":"error","error":{"type":"overloaded_error","message":"busy"}}"#,
        );
        // What Anthropic sends: pings and errors may come before `message_start`.
        assert_eq!(
            first_misplaced(route, &[ping, start, delta, ping, stop]),
            None
        );
        assert_eq!(first_misplaced(route, &[error]), None);
        // By its data's `type` when it has no `event:` name.
        assert_eq!(
            first_misplaced(route, &[(None, start.1), (None, delta.1), (None, stop.1)]),
            None
        );
        for (events, why) in [
            (
                &[delta, stop][..],
                "began with an event other than `message_start`",
            ),
            (
                &[ping, delta, stop][..],
                "began with an event other than `message_start`",
            ),
            (
                &[stop][..],
                "began with an event other than `message_start`",
            ),
            (&[start, delta, start, stop][..], "a second `message_start`"),
        ] {
            let found = first_misplaced(route, events).expect(why);
            assert!(found.contains(why), "{found}");
        }
        // The OpenAI routes have no opening event to check.
        for route in [
            Route::OpenaiChat,
            Route::OpenaiCompletions,
            Route::OpenaiResponses,
        ] {
            assert_eq!(route.stream_start_name(), None);
        }
    }

    #[test]
    fn each_route_is_completed_only_by_its_own_final_event_lc7() {
        for route in [Route::OpenaiChat, Route::OpenaiCompletions] {
            assert!(ends(route, None, "[DONE]"));
            let last = r#"{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#;
            assert!(
                !ends(route, None, last),
                "finish_reason alone is not the end"
            );
        }
        let responses = Route::OpenaiResponses;
        for kind in [
            "response.completed",
            "response.incomplete",
            "response.failed",
        ] {
            let data = format!(r#"{{"type":"{kind}","sequence_number":9,"response":{{}}}}"#);
            assert!(ends(responses, Some(kind), &data), "{kind}");
            assert!(ends(responses, None, &data), "{kind} by its data's type");
        }
        assert!(!ends(
            responses,
            Some("response.output_text.done"),
            r#"{"type":"response.output_text.done"}"#
        ));
        assert!(!ends(responses, None, "[DONE]"));
        let messages = Route::AnthropicMessages;
        assert!(ends(
            messages,
            Some("message_stop"),
            r#"{"type":"message_stop"}"#
        ));
        assert!(!ends(
            messages,
            Some("message_delta"),
            r#"{"type":"message_delta"}"#
        ));
        assert!(!ends(messages, None, "[DONE]"));
    }

    /// [`check_answer`]'s verdict and the answer's id, without the usage.
    fn answer_id(route: Route, body: &[u8]) -> Result<Option<String>, &'static str> {
        check_answer(route, body).map(|(id, _)| id)
    }

    #[test]
    fn a_2xx_answer_must_be_an_object_with_the_routes_result_member_lc11_decision39() {
        let chat = Route::OpenaiChat;
        assert_eq!(answer_id(chat, br#"{"choices":[],"error":null}"#), Ok(None));
        // An object without the route's result member is no answer (decision 39).
        assert_eq!(
            answer_id(chat, br#"{"id":"x"}"#),
            Err("a JSON object without `choices`, which every answer of this route has")
        );
        assert!(answer_id(chat, b"{}").is_err());
        assert!(answer_id(Route::OpenaiEmbeddings, br#"{"object":"list"}"#).is_err());
        assert!(answer_id(Route::OpenaiResponses, br#"{"id":"resp_1"}"#).is_err());
        assert!(answer_id(Route::AnthropicMessages, br#"{"type":"message"}"#).is_err());
        assert_eq!(
            answer_id(
                Route::AnthropicMessages,
                br#"{"type":"message","content":[]}"#
            ),
            Ok(None)
        );
        assert!(answer_id(chat, br#"{"error":{"message":"overloaded"}}"#).is_err());
        assert!(answer_id(chat, br#" [1,2]"#).is_err());
        assert!(answer_id(chat, br#""text""#).is_err());
        assert!(answer_id(chat, b"not json").is_err());
        // An answer with both is the provider's answer (a failed Responses object has both).
        let failed = br#"{"object":"response","id":"resp_1","status":"failed","output":[],"error":{"code":"server_error"}}"#;
        assert_eq!(
            answer_id(Route::OpenaiResponses, failed),
            Ok(Some("resp_1".into())),
            "and its id is kept"
        );
        let refused = br#"{"type":"error","error":{"type":"overloaded_error","message":"x"}}"#;
        assert!(answer_id(Route::AnthropicMessages, refused).is_err());
        assert_eq!(
            answer_id(
                Route::AnthropicMessages,
                br#"{"type":"message","content":[]}"#
            ),
            Ok(None)
        );
        assert!(
            answer_id(
                Route::OpenaiEmbeddings,
                br#"{"error":{"m":1},"choices":[]}"#
            )
            .is_err()
        );
        // A duplicated key takes the slower path and the same rule.
        assert!(answer_id(chat, br#"{"error":null,"error":{"m":1}}"#).is_err());
        assert_eq!(answer_id(chat, br#"{"choices":1,"choices":[]}"#), Ok(None));
    }

    #[test]
    fn content_types_of_event_streams_are_recognised() {
        assert!(is_event_stream("text/event-stream"));
        assert!(is_event_stream("Text/Event-Stream; charset=utf-8"));
        assert!(!is_event_stream("application/json"));
        assert!(!is_event_stream("text/html"));
    }
}
