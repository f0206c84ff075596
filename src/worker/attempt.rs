//! One attempt: the provider call beside its heartbeat, the answer read and classified
//! (LC-5, LC-6, LC-7, LC-11), a stream stored chunk by chunk, and the fenced outcome write
//! (LC-3).

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use super::WorkerPool;
use super::chunks::EndingWrite;
use super::retry::{self, WriteRetry};
use super::stream::{HandOnGate, StreamRead};
use crate::hub::HubEvent;
use crate::ledger;
use crate::metrics as m;
use crate::otel::AttemptSpan;
use crate::provider::{Route, excerpt};
use crate::store::{
    Chunk, ChunkBatch, ErrorInfo, ErrorType, Lease, Millis, Outcome, RequestRecord, StoreError,
    holds_outcome, now_ms,
};
use crate::upstream::{Call, CallError, Response};

/// How soon a heartbeat that failed (the database unavailable) is tried again: the lease is
/// renewed within about this long of the database's return, well inside the sweeps' hold
/// (decision 52).
pub(super) const HEARTBEAT_RETRY: Duration = Duration::from_secs(1);

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
    /// Held while `last` holds batches taken back from the chunk writer, until the outcome
    /// write is settled (decision 126).
    pub(super) writing: Option<EndingWrite>,
    /// The provider's rate-limit and timing headers of the answer, for the clients waiting
    /// for it here (RS-5a).
    pub(super) passed_headers: Option<crate::provider::PassedHeaders>,
}

impl From<Outcome> for Ending {
    fn from(outcome: Outcome) -> Ending {
        Ending {
            outcome,
            last: None,
            withheld: Vec::new(),
            writing: None,
            passed_headers: None,
        }
    }
}

impl WorkerPool {
    /// Runs one attempt: heartbeat beside the provider call, then the fenced outcome write.
    pub(super) async fn run_attempt(
        &self,
        lease: Lease,
        record: RequestRecord,
        mut trace: Option<AttemptSpan>,
    ) {
        let lost = CancellationToken::new();
        // Renews the lease until the outcome is written, polled beside the call and then the
        // outcome write in this task rather than as a task of its own (one spawn and one abort
        // fewer per attempt, issue 30); it ends only when it finds the lease lost.
        // Until when this node's clock says the lease is held: its grant, then each renewal
        // (LC-3, decision 125).
        let held_until = AtomicI64::new(record.updated_at.saturating_add(self.lease_ms()));
        let heartbeat = self.heartbeat(&lease, record.updated_at, &lost, &held_until);
        tokio::pin!(heartbeat);
        let registration = self.register(&lease);
        debug!("attempt started");
        // Boxed: the call (the provider's request, its answer read or streamed into the log)
        // is most of the attempt's future, which is made on the thread that leased it — the
        // SQLite writer's, at admission (decision 70) — and copied as a whole when spawned.
        let ending = tokio::select! {
            // A cancel's abort first: an event read when the cancel lets go of the hand-on
            // gate is not handed on after it (decision 127).
            biased;
            () = registration.switches.stop.cancelled() => {
                if !registration.switches.abort.is_cancelled() {
                    // Shutdown abandons the attempt, and no cancel aborted it.
                    self.hand_back(&lease).await;
                }
                None
            }
            () = &mut heartbeat => None,
            ending = Box::pin(self.call(&lease, &record, &mut trace, &held_until, &registration.switches.hand_on)) => ending,
        };
        // Aborted here: the request was cancelled (LC-9), which its span says.
        let cancelled = registration.switches.abort.is_cancelled();
        let Some(ending) = ending else {
            info!("attempt ended without an outcome");
            // Its waiters here poll slowly while it runs (decision 148): unregistered, it no
            // longer runs here for them, and they re-read now.
            drop(registration);
            self.hub.publish(lease.id, HubEvent::Changed);
            if let Some(trace) = trace {
                if cancelled {
                    trace.cancelled();
                } else {
                    self.end_lost(&lease, &record, trace).await;
                }
            }
            return;
        };
        log_attempt(&ending.outcome);
        let written = {
            let write = self.write_outcome(&lease, &record, &ending, &lost);
            tokio::pin!(write);
            // A lease found lost ends the heartbeat, not the write: it sees `lost` and stops.
            tokio::select! {
                written = &mut write => written,
                () = &mut heartbeat => write.await,
            }
        };
        if let Some(trace) = trace {
            match &written {
                Ok(Some(_)) => trace.end(&ending.outcome),
                Ok(None) => self.end_lost(&lease, &record, trace).await,
                // The store failed: no read of it to wait for.
                Err(_) => trace.lost(),
            }
        }
        // Registered until the outcome write is over: a cancel meanwhile still waits for what
        // an ending took back and writes with it, which its clients were shown (decision 127).
        drop(registration);
        match written {
            Ok(Some((chunks, settled))) => {
                let Ending {
                    outcome,
                    mut withheld,
                    passed_headers,
                    ..
                } = ending;
                withheld.extend(chunks);
                self.settle(&lease, &outcome, withheld, settled, passed_headers);
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

    /// Ends the span of an attempt whose lease was lost: `cancelled` when the request's stored
    /// outcome says a cancel took it from this attempt (one made on another node clears the
    /// lease without reaching this node's attempt, LC-9), else `lease_lost`. One read of the
    /// request, made only with traces on and only for a lost lease; none for a hand-back at
    /// shutdown, and a read that fails says `lease_lost`.
    async fn end_lost(&self, lease: &Lease, record: &RequestRecord, trace: AttemptSpan) {
        let cancelled = !self.abandon.is_cancelled()
            && matches!(
                self.store.get(&record.namespace, record.id).await,
                Ok(Some(now)) if now.attempts == lease.attempt
                    && now.error.as_ref().is_some_and(|e| e.kind == ErrorType::Cancelled)
            );
        if cancelled {
            trace.cancelled();
        } else {
            trace.lost();
        }
    }

    /// Shutdown grace is over (DU-5): hands the request back without a recovery, once what the
    /// attempt handed on is committed (at most [`super::CANCEL_SETTLES_FOR`]), as a cancel does
    /// (LC-9, decision 77): its stream's clients were shown those events, and the usage they
    /// reported was billed (RD-9). The chunk writer may hold them for up to 50 ms while no
    /// positioned reader follows the stream (DU-7); the hand-back, fenced, would refuse them.
    async fn hand_back(&self, lease: &Lease) {
        let _ =
            tokio::time::timeout(super::CANCEL_SETTLES_FOR, self.chunks.settle_handed_on()).await;
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

    /// Hands back an attempt that shutdown's signal came before it started (DU-5, decision
    /// 151): `pending` for another node or the next start, its attempt uncounted. A failed
    /// write leaves the lease to expire, as a crash would.
    pub(super) async fn hand_back_unstarted(&self, lease: &Lease) {
        match self.store.release_unstarted(lease, now_ms()).await {
            Ok(true) => info!(id = %lease.id, "leased as shutdown began; handed back unstarted"),
            Ok(false) => {}
            Err(e) => {
                warn!(id = %lease.id, error = %e, "could not hand back an unstarted attempt; its lease will expire");
            }
        }
        self.hub.publish(lease.id, HubEvent::Changed);
    }

    /// Writes the attempt's outcome (with a stream's last batch), fenced on its lease (LC-3):
    /// the stored chunks and the request as settled, `None` when the lease was lost.
    ///
    /// The provider has answered: losing the outcome now would cost a second provider call
    /// when the sweep re-runs the request, so a failed write is tried again for
    /// `write_retry_secs`, at least one lease length (decisions 37, 52), the heartbeat still
    /// renewing the lease, until the lease is found lost — past shutdown's grace too, which
    /// bounds the shutdown by this window (DU-5a, decision 152). A try after the lease was lost
    /// stores nothing, and a failed try stored nothing, the last batch included.
    async fn write_outcome(
        &self,
        lease: &Lease,
        leased: &RequestRecord,
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
                    let written = self
                        .store
                        .finish_with_chunks(leased, last, outcome, now_ms())
                        .await;
                    if written.is_ok() {
                        metrics::histogram!(m::CHUNK_COMMIT_SECONDS)
                            .record(started.elapsed().as_secs_f64());
                    }
                    written
                }
                None => self
                    .store
                    .finish_read(lease, leased, outcome, now_ms())
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
            // Not ended by shutdown's grace (DU-5a): the answer is paid for, and dropping it
            // would have it paid for again after the restart.
            let again = tokio::select! {
                again = retry.wait() => again,
                () = lost.cancelled() => false,
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
    fn settle(
        &self,
        lease: &Lease,
        outcome: &Outcome,
        mut chunks: Vec<Chunk>,
        settled: RequestRecord,
        passed_headers: Option<crate::provider::PassedHeaders>,
    ) {
        // A stream's last events go out with its `end`, which the same commit stored: its
        // readers finish without reading the log back (issue 30).
        if !chunks.is_empty()
            && let Some(end) = crate::store::end_chunk(&settled)
        {
            chunks.push(end);
        }
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
                &self.meters,
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
        self.hub.publish(
            lease.id,
            HubEvent::Settled(Arc::new(settled), passed_headers),
        );
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
    async fn heartbeat(
        &self,
        lease: &Lease,
        granted: Millis,
        lost: &CancellationToken,
        held_until: &AtomicI64,
    ) {
        let third = (self.lease_ms() / 3).max(1);
        let retry = i64::try_from(HEARTBEAT_RETRY.as_millis()).unwrap_or(1_000);
        let mut next = granted.saturating_add(third);
        loop {
            let wait = (next - now_ms()).clamp(0, third);
            tokio::time::sleep(Duration::from_millis(u64::try_from(wait).unwrap_or(0))).await;
            let sent = now_ms();
            match self.store.heartbeat(lease, sent, self.lease_ms()).await {
                Ok(true) => {
                    held_until.store(sent.saturating_add(self.lease_ms()), Ordering::Relaxed);
                    next = sent.saturating_add(third);
                }
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

    /// Renews `lease`, which has run out by this node's clock before its provider call, with one
    /// heartbeat fenced on its owner (LC-3a, decision 138): `true` when it committed, so no
    /// other node has taken the request over, and committed while the renewed lease is still
    /// held by this node's clock, so none can take it before the call. A submission the
    /// database recorded after a stall longer than the lease (RS-10) starts so.
    async fn renewed(&self, lease: &Lease, held_until: &AtomicI64) -> bool {
        let sent = now_ms();
        let until = sent.saturating_add(self.lease_ms());
        match self.store.heartbeat(lease, sent, self.lease_ms()).await {
            Ok(true) => {
                held_until.fetch_max(until, Ordering::Relaxed);
                let held = now_ms() < until;
                if held {
                    info!("the lease was short before the provider call and was renewed");
                }
                held
            }
            Ok(false) => false,
            Err(e) => {
                warn!(error = %e, "renewing a lease that ran out before the provider call failed");
                self.health.failed();
                false
            }
        }
    }

    /// One provider call, classified into an [`Ending`] (LC-5, LC-6, LC-11). `None` when the
    /// lease was lost on the way, or ran out, by this node's clock, before the call
    /// (`held_until`, decision 125). A stream's hand-ons pass `hand_on` (LC-9, decision 127).
    async fn call(
        &self,
        lease: &Lease,
        record: &RequestRecord,
        trace: &mut Option<AttemptSpan>,
        held_until: &AtomicI64,
        hand_on: &HandOnGate,
    ) -> Option<Ending> {
        let route = record.route;
        let traceparent = trace.as_ref().and_then(AttemptSpan::traceparent);
        let call = Call {
            backend: &record.backend,
            route,
            body: &record.body,
            headers: &record.headers,
            model: record.model.as_deref(),
            traceparent: traceparent.as_deref(),
        };
        // LC-3, decision 125: a node that stalled between its lease and this call (paused,
        // starved of CPU) may have lost the lease meanwhile, and another node's attempt may
        // have answered the request already. Fencing refuses what this attempt would write, but
        // not a provider call: none is made once the lease has run out, unless a renewal fenced
        // on the lease's owner commits first (LC-3a, decision 138). Nor with less than half of
        // it left: a lease granted long before (a submission the database recorded late) could
        // run out before this attempt's first heartbeat commits, queued behind a returning
        // database's backlog, and the sweep would then start a second call (decision 172).
        let left = held_until.load(Ordering::Relaxed) - now_ms();
        if left < self.lease_ms() / 2 && !self.renewed(lease, held_until).await {
            warn!(
                "the lease was short before the provider call and was taken over; no call is made"
            );
            return None;
        }
        let mut response = match self.upstreams.send(&call).await {
            Ok(r) => r,
            Err(e) => {
                self.meters
                    .backend(&record.backend)
                    .calls(None)
                    .increment(1);
                return Some(self.transient(lease, None, e.to_string(), None).into());
            }
        };
        let status = response.status().as_u16();
        self.meters
            .backend(&record.backend)
            .calls(Some(status))
            .increment(1);
        let request_id = route
            .provider()
            .request_id_header()
            .and_then(|name| response.headers().get(name))
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let passed_headers = route.provider().passed_on_headers(response.headers());
        if record.stream && (200..300).contains(&status) {
            let mut read = StreamRead::new(
                lease.clone(),
                route,
                status,
                content_type_of(&response),
                request_id,
                record.last_seq,
                self.store.ends_streams_in_one_write(),
            );
            read.passed_headers.clone_from(&passed_headers);
            let mut ending = self.stream(lease, response, read, trace, hand_on).await?;
            ending.passed_headers = passed_headers;
            return Some(ending);
        }
        let outcome = self
            .classify(lease, route, &mut response, status, request_id)
            .await;
        let mut ending = Ending::from(outcome);
        ending.passed_headers = passed_headers;
        Some(ending)
    }

    /// Classifies a whole-body answer: success, transient, refusal or invalid.
    async fn classify(
        &self,
        lease: &Lease,
        route: Route,
        response: &mut Response,
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
                // The provider's answer, saying it failed: passed on as it came, and the
                // request failed, never a success replayed to every retry (LC-7a).
                Ok((_, usage, Some(why))) => Outcome::Failed {
                    error: ErrorInfo {
                        kind: ErrorType::UpstreamRefused,
                        message: format!("the provider answered {status} with {why}"),
                        status: Some(status),
                    },
                    usage,
                    response: Some((status, body)),
                    upstream_request_id: request_id,
                },
                Ok((response_id, usage, None)) => Outcome::Succeeded {
                    status,
                    body,
                    upstream_request_id: request_id,
                    response_id,
                    usage,
                },
                // Kept on the record so the operator sees what came back; never replayed. What
                // it reports it cost is kept too: it was billed (RD-9).
                Err(why) => Outcome::Failed {
                    error: ErrorInfo {
                        kind: ErrorType::UpstreamInvalid,
                        message: format!(
                            "the provider answered {status} with {why} (content-type {content_type:?})"
                        ),
                        status: Some(status),
                    },
                    usage: route.usage_of_refused_answer(&body),
                    response: Some((status, body)),
                    upstream_request_id: request_id,
                },
            };
        }
        if retry::is_transient_status(status) {
            // Google says how long to wait in the body, not in `retry-after` (decision 88).
            let hint = hint.or_else(|| route.provider().retry_delay_of_body(&body));
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

/// Whether a `content-type` value names an event stream (`text/event-stream`, any parameters).
pub(super) fn is_event_stream(content_type: &str) -> bool {
    content_type
        .split(';')
        .next()
        .is_some_and(|t| t.trim().eq_ignore_ascii_case("text/event-stream"))
}

/// The provider's `Content-Type` as sent, `none` when absent: named in every
/// `upstream_invalid` message so the operator sees what came back (decision 21).
pub(super) fn content_type_of(response: &Response) -> String {
    response
        .headers()
        .get(http::header::CONTENT_TYPE)
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

    /// LC-3, LC-3a, decisions 125 and 138: an attempt whose lease has run out by this node's
    /// clock before its provider call (a node paused or starved between the lease and the call,
    /// whose request another node may have taken meanwhile) renews it first, fenced on its
    /// owner. Taken over (swept and leased by another node), it makes no call; the other
    /// node's attempt makes the one call.
    #[tokio::test]
    async fn an_attempt_whose_lease_ran_out_and_was_taken_over_makes_no_provider_call_lc3() {
        let (_dir, store, pool, calls) = attempt_rig().await;
        let lease_ms = pool.lease_ms();
        let (stale, record) = leased_two_leases_ago(&store, lease_ms).await;
        // Another node's sweep returns it, and that node leases it.
        let (other, other_record) = taken_over(&store, lease_ms, now_ms()).await;
        assert_eq!(other.id, stale.id);
        pool.run_attempt(stale, record, None).await;
        assert_eq!(
            calls.load(Ordering::SeqCst),
            0,
            "a provider call for a request another node took"
        );
        pool.run_attempt(other, other_record, None).await;
        assert_eq!(
            calls.load(Ordering::SeqCst),
            1,
            "the attempt within its lease calls the provider"
        );
    }

    /// LC-3a, decision 138: an attempt whose lease has run out by this node's clock, and that
    /// no other node has taken over (a submission the database recorded after a stall longer
    /// than the lease, RS-10), renews it and makes the request's one provider call as its first
    /// attempt; the request succeeds with one attempt, not a wasted one and a recovery.
    #[tokio::test]
    async fn an_attempt_whose_lease_ran_out_unclaimed_renews_it_and_calls_once_lc3a() {
        let (_dir, store, pool, calls) = attempt_rig().await;
        let (lease, record) = leased_two_leases_ago(&store, pool.lease_ms()).await;
        let id = lease.id;
        pool.run_attempt(lease, record, None).await;
        assert_eq!(calls.load(Ordering::SeqCst), 1, "one provider call");
        let finished = store
            .get("default", id)
            .await
            .expect("get")
            .expect("the request");
        assert_eq!(finished.status, crate::store::Status::Succeeded);
        assert_eq!((finished.attempts, finished.recoveries), (1, 0));
    }

    /// A request submitted three lease lengths ago and leased by `node` by a clock two lease
    /// lengths back: its lease has run out by now, as after a stall between lease and call.
    async fn leased_two_leases_ago(
        store: &crate::store::DynStore,
        lease_ms: i64,
    ) -> (Lease, RequestRecord) {
        leased_ago(store, lease_ms, 2 * lease_ms).await
    }

    /// The only request, swept and leased by `other-node` by a clock reading `at`.
    async fn taken_over(
        store: &crate::store::DynStore,
        lease_ms: i64,
        at: i64,
    ) -> (Lease, RequestRecord) {
        store.sweep(at, 5).await.expect("sweep");
        store
            .lease_many(
                "other-node",
                at,
                lease_ms,
                &crate::store::LeaseQuota::any(1),
            )
            .await
            .expect("lease")
            .pop()
            .expect("leased again")
    }

    /// A request leased by `node` by a clock `ago` ms back (submitted a lease before that).
    async fn leased_ago(
        store: &crate::store::DynStore,
        lease_ms: i64,
        ago: i64,
    ) -> (Lease, RequestRecord) {
        let now = now_ms();
        store
            .submit(crate::store::NewRequest::example(0, now - ago - lease_ms))
            .await
            .expect("submit");
        store
            .lease_many(
                "node",
                now - ago,
                lease_ms,
                &crate::store::LeaseQuota::any(1),
            )
            .await
            .expect("lease")
            .pop()
            .expect("leased")
    }

    /// LC-3a, decision 172: an attempt whose lease has not run out but has less than half of it
    /// left renews it before its call. A frozen PostgreSQL's late commits left attempts a lease
    /// of under 2 s; each called the provider unrenewed, its heartbeat queued behind the
    /// backlog, the sweep took the request over and a second attempt called again. Here the
    /// takeover has happened by the time the attempt would call: the renewal, fenced on its
    /// owner, fails, and no call is made (before, this attempt called, and the other paid
    /// again).
    #[tokio::test]
    async fn an_attempt_with_less_than_half_its_lease_left_renews_before_calling_lc3a() {
        let (_dir, store, pool, calls) = attempt_rig().await;
        let lease_ms = pool.lease_ms();
        let (short, record) = leased_ago(&store, lease_ms, lease_ms * 9 / 10).await;
        // Another node's sweep, once this lease runs out by its clock, and its lease.
        let (other, _) = taken_over(&store, lease_ms, now_ms() + lease_ms).await;
        assert_eq!(other.id, short.id);
        // The database is slow to take writes (its backlog, as it returns): the attempt's first
        // heartbeat, which would find the lease lost, waits, as its renewal does.
        let db = rusqlite::Connection::open(_dir.path().join("t.db")).expect("open");
        db.execute_batch("BEGIN IMMEDIATE")
            .expect("take the write lock");
        let backlog = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(500));
            db.execute_batch("COMMIT").expect("release the write lock");
        });
        pool.run_attempt(short, record, None).await;
        backlog.join().expect("released");
        assert_eq!(
            calls.load(Ordering::SeqCst),
            0,
            "a provider call on a lease with a tenth of it left, the request taken over"
        );
    }

    /// A provider on a local port that counts the calls it is sent and answers each with a chat
    /// completion, a scratch SQLite store and a pool over both.
    async fn attempt_rig() -> (
        tempfile::TempDir,
        crate::store::DynStore,
        WorkerPool,
        Arc<std::sync::atomic::AtomicUsize>,
    ) {
        use std::sync::atomic::AtomicUsize;

        use tokio::io::{AsyncReadExt, AsyncWriteExt};

        use crate::config::{Backend, Config};
        use crate::store::DynStore;

        let dir = tempfile::tempdir().expect("tempdir");
        // A provider that counts the calls it is sent and answers each with a chat completion.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let base_url = format!("http://{}/v1", listener.local_addr().expect("addr"));
        let calls = Arc::new(AtomicUsize::new(0));
        tokio::spawn({
            let calls = Arc::clone(&calls);
            async move {
                while let Ok((mut socket, _)) = listener.accept().await {
                    let mut request = vec![0; 64 * 1024];
                    if socket.read(&mut request).await.unwrap_or(0) == 0 {
                        continue;
                    }
                    calls.fetch_add(1, Ordering::SeqCst);
                    let body = r#"{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}]}"#;
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\
                         content-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = socket.write_all(answer.as_bytes()).await;
                }
            }
        });
        let config = Config {
            backends: vec![Backend {
                name: "mock".into(),
                kind: crate::provider::Provider::Openai,
                base_url,
                api_key_env: None,
            }],
            ..Config::default()
        };
        let store: DynStore = Arc::new(crate::store::sqlite::scratch(dir.path()).await);
        let pool = WorkerPool::new(
            store.clone(),
            crate::hub::Hub::new(),
            Arc::new(crate::upstream::Upstreams::new(&config).expect("upstreams")),
            Arc::new(config),
            None,
            &tokio_util::sync::CancellationToken::new(),
        );
        (dir, store, pool, calls)
    }
}
