//! Leased workers: take due requests from the log, call the provider once per attempt, record
//! the outcome under the attempt's lease (SPEC LC-2..LC-6).
//!
//! One dispatcher loop per process holds `workers.concurrency` permits. For each permit it
//! leases a request (one atomic write in the store) and spawns the attempt. An attempt renews
//! its lease by heartbeat from a separate task and never holds a database transaction across
//! the provider call (LC-2). A lost lease (swept, cancelled) aborts the provider call and the
//! attempt writes nothing more (LC-3). A separate sweeper sends expired leases back to
//! `pending` (LC-4).

mod chunks;
mod retry;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};
use uuid::Uuid;

use crate::config::{Config, Workers};
use crate::hub::{Hub, HubEvent};
use crate::metrics as m;
use crate::provider::Route;
use crate::sse::{SseEvent, SseParser};
use crate::store::{
    ChunkBatch, DynStore, ErrorInfo, ErrorType, Lease, LeaseTo, NewChunk, NewRequest, Outcome,
    RequestRecord, StoreError, Submitted, now_ms,
};
use crate::upstream::{Call, CallError, Upstreams};
use chunks::AppendError;
pub use chunks::ChunkWriter;

/// How often expired terminal requests are pruned (DU-4).
const PRUNE_EVERY: Duration = Duration::from_secs(60);
/// Requests deleted per prune transaction.
const PRUNE_BATCH: i64 = 500;
/// Most requests leased by one store call.
const LEASE_BATCH: usize = 256;
/// Tries of an attempt's outcome write before it is left to the lease's expiry.
const FINISH_TRIES: u32 = 3;

/// What a worker pool needs.
#[derive(Clone)]
pub(crate) struct WorkerPool {
    store: DynStore,
    hub: Arc<Hub>,
    /// Shared: the pool is cloned for every request (HTTP state) and attempt.
    upstreams: Arc<Upstreams>,
    config: Arc<Config>,
    /// Woken when new work is recorded or a retry comes due.
    wake: Arc<Notify>,
    /// Prefix of lease owners: identifies this process in the log.
    node: Arc<str>,
    /// Group commit of stream chunks.
    chunks: ChunkWriter,
    /// Cancelled when the shutdown grace period is over: running attempts hand back (DU-5).
    abandon: CancellationToken,
    /// One per attempt this process may run at once (`workers.concurrency`). Every running
    /// attempt holds one, whether the dispatcher or admission ([`WorkerPool::try_permit`])
    /// started it, so shutdown drains by taking them all back.
    permits: Arc<Semaphore>,
    /// Cancelled when shutdown begins: no new attempts start.
    stopping: CancellationToken,
    /// The abort switch of every attempt this process is running, by request id (LC-9).
    running: Arc<Mutex<HashMap<Uuid, CancellationToken>>>,
}

/// A running attempt's entry in [`WorkerPool::running`]; removed on drop.
struct Running {
    pool: WorkerPool,
    id: Uuid,
    /// Cancelled when the request is cancelled through this process.
    abort: CancellationToken,
}

impl Drop for Running {
    fn drop(&mut self) {
        let mut running = self.pool.running.lock().unwrap_or_else(|e| e.into_inner());
        running.remove(&self.id);
    }
}

/// How a streamed attempt ended, before it becomes an [`Outcome`].
enum StreamEnd {
    /// The attempt lost its lease while streaming: write nothing more (LC-3).
    LeaseLost,
    /// A classified outcome.
    Outcome(Outcome),
}

impl WorkerPool {
    /// A pool for this process.
    pub(crate) fn new(
        store: DynStore,
        hub: Arc<Hub>,
        upstreams: Upstreams,
        config: Arc<Config>,
    ) -> WorkerPool {
        let node = format!("{}-{}", hostname(), std::process::id());
        let chunks = ChunkWriter::spawn(store.clone());
        WorkerPool {
            permits: Arc::new(Semaphore::new(config.workers.concurrency)),
            stopping: CancellationToken::new(),
            abandon: CancellationToken::new(),
            chunks,
            store,
            hub,
            upstreams: Arc::new(upstreams),
            config,
            wake: Arc::new(Notify::new()),
            node: node.into(),
            running: Arc::default(),
        }
    }

    /// Wakes the dispatcher: new work may be due (a request recorded by another node).
    pub(crate) fn wake(&self) {
        self.wake.notify_one();
    }

    /// Records `new` and sets it running (the admission of SPEC RS-1): when this node has a
    /// free worker the request is leased in the transaction that records it and its attempt
    /// starts here, saving the dispatcher's round trip (decision 20); otherwise the dispatcher
    /// is woken to lease it. A submission that attaches to an existing request starts nothing.
    ///
    /// Runs as a task of its own, so a client that goes away while the write waits in the
    /// queue cannot strand what the write commits: a request leased to an attempt that never
    /// starts would only move again when its lease expired, as a recovery that never happened
    /// (LC-9: a client disconnecting never cancels or delays execution).
    ///
    /// # Errors
    /// [`StoreError`] when the request could not be recorded; nothing was then.
    pub(crate) async fn admit(&self, new: NewRequest) -> Result<Submitted, StoreError> {
        let pool = self.clone();
        let admission = tokio::spawn(async move {
            let permit = pool.try_permit();
            let owner = permit.as_ref().map(|_| pool.lease_owner());
            let lease = owner.as_deref().map(|owner| LeaseTo {
                owner,
                lease_ms: pool.lease_ms(),
            });
            let (submitted, lease) = pool.store.submit_and_lease(new, lease).await?;
            match (&submitted, lease, permit) {
                (Submitted::Created(record), Some(lease), Some(permit)) => {
                    pool.spawn_attempt(lease, (**record).clone(), permit);
                }
                (Submitted::Created(_), None, _) => pool.wake(),
                _ => {}
            }
            Ok(submitted)
        });
        admission
            .await
            .unwrap_or_else(|e| Err(StoreError::Unavailable(format!("admission task: {e}"))))
    }

    /// Cancels request `id` of `namespace` (LC-9): the store fails it with `cancelled` and
    /// releases its claim; an attempt this node runs is aborted at once (one on another node
    /// at its next heartbeat, when it finds its lease gone); readers are woken. Returns the
    /// record afterwards, or `None` when the namespace has no such request.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    pub(crate) async fn cancel(
        &self,
        namespace: &str,
        id: Uuid,
    ) -> Result<Option<RequestRecord>, StoreError> {
        let record = self.store.cancel(namespace, id, now_ms()).await?;
        if record.is_some() {
            let running = self.running.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(abort) = running.get(&id) {
                abort.cancel();
            }
            drop(running);
            self.hub.publish(id, HubEvent::Changed);
        }
        Ok(record)
    }

    /// Registers an attempt of request `id` as running here, for [`WorkerPool::cancel`].
    fn register(&self, id: Uuid) -> Running {
        let abort = CancellationToken::new();
        let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        running.insert(id, abort.clone());
        Running {
            pool: self.clone(),
            id,
            abort,
        }
    }

    fn workers(&self) -> &Workers {
        &self.config.workers
    }

    /// A free worker slot for an attempt started at admission (see
    /// [`Store::submit_and_lease`](crate::store::Store::submit_and_lease)), or `None` when all
    /// are busy or shutdown has begun.
    fn try_permit(&self) -> Option<OwnedSemaphorePermit> {
        if self.stopping.is_cancelled() {
            return None;
        }
        Arc::clone(&self.permits).try_acquire_owned().ok()
    }

    /// A lease owner unique to one attempt (or, for `lease_many`, one call): `<host>-<pid>/<uuid>`.
    pub(crate) fn lease_owner(&self) -> String {
        format!("{}/{}", self.node, uuid::Uuid::new_v4())
    }

    /// Lease length in milliseconds (`workers.lease_secs`).
    pub(crate) fn lease_ms(&self) -> i64 {
        i64::try_from(self.workers().lease_secs.saturating_mul(1000)).unwrap_or(i64::MAX / 4)
    }

    /// Runs the attempt `lease` holds, keeping `permit` until it ends.
    pub(crate) fn spawn_attempt(
        &self,
        lease: Lease,
        record: RequestRecord,
        permit: OwnedSemaphorePermit,
    ) {
        metrics::counter!(m::ATTEMPTS, "backend" => record.backend.clone()).increment(1);
        let pool = self.clone();
        tokio::spawn(async move {
            pool.run_attempt(lease, record).await;
            drop(permit);
        });
    }

    /// Runs the dispatcher and the sweeper until `shutdown` is cancelled, then waits for
    /// in-flight attempts to finish.
    pub(crate) async fn run(self, shutdown: CancellationToken) {
        let sweeper = tokio::spawn(self.clone().sweep_loop(shutdown.clone()));
        let permits = Arc::clone(&self.permits);
        let poll = Duration::from_millis(self.workers().poll_interval_ms);
        loop {
            let permit = tokio::select! {
                p = Arc::clone(&permits).acquire_owned() => match p {
                    Ok(p) => p,
                    Err(_) => break,
                },
                () = shutdown.cancelled() => break,
            };
            // Every free permit (up to LEASE_BATCH): a burst of new requests is leased with one
            // write instead of one write per request, each waiting its turn on the database.
            let mut batch = vec![permit];
            while batch.len() < LEASE_BATCH {
                match Arc::clone(&permits).try_acquire_owned() {
                    Ok(p) => batch.push(p),
                    Err(_) => break,
                }
            }
            let asked = batch.len();
            match self
                .store
                .lease_many(&self.lease_owner(), now_ms(), self.lease_ms(), asked)
                .await
            {
                Ok(leased) => {
                    let drained = leased.len() < asked;
                    for ((lease, record), permit) in leased.into_iter().zip(batch) {
                        self.spawn_attempt(lease, record, permit);
                    }
                    // Fewer due requests than free permits: nothing more is due now, so wait
                    // for a wake-up instead of asking again at once (an empty write per
                    // request at low load, docs/benchmarks.md finding 10). A request recorded
                    // meanwhile is not missed: `notify_one` keeps its permit for the next
                    // `notified()`.
                    if drained {
                        let wait = self.idle_wait(poll).await;
                        tokio::select! {
                            () = self.wake.notified() => {}
                            () = tokio::time::sleep(wait) => {}
                            () = shutdown.cancelled() => break,
                        }
                    }
                }
                Err(e) => {
                    drop(batch);
                    warn!(error = %e, "lease failed; retrying");
                    tokio::select! {
                        () = tokio::time::sleep(poll) => {}
                        () = shutdown.cancelled() => break,
                    }
                }
            }
        }
        // DU-5: no new attempts; in-flight ones get the grace period, then hand back. Every
        // attempt holds a permit until it ends, so taking all of them back is the drain.
        self.stopping.cancel();
        let all = u32::try_from(self.workers().concurrency).unwrap_or(u32::MAX);
        let grace = Duration::from_millis(self.config.shutdown_grace_ms);
        let drained = tokio::time::timeout(grace, permits.acquire_many(all)).await;
        if drained.is_err() {
            info!(
                running = self.workers().concurrency - permits.available_permits(),
                "shutdown grace over; handing running attempts back"
            );
            self.abandon.cancel();
            let _ = permits.acquire_many(all).await;
        }
        let _ = sweeper.await;
    }

    /// How long to sleep when nothing is due: until the earliest scheduled retry, at most `poll`.
    async fn idle_wait(&self, poll: Duration) -> Duration {
        match self.store.next_due().await {
            Ok(Some(due)) => {
                let ms = (due - now_ms()).max(1);
                poll.min(Duration::from_millis(u64::try_from(ms).unwrap_or(1)))
            }
            _ => poll,
        }
    }

    async fn sweep_loop(self, shutdown: CancellationToken) {
        let mut tick =
            tokio::time::interval(Duration::from_millis(self.workers().sweep_interval_ms));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_prune = tokio::time::Instant::now() - PRUNE_EVERY;
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = shutdown.cancelled() => return,
            }
            if last_prune.elapsed() >= PRUNE_EVERY {
                last_prune = tokio::time::Instant::now();
                self.prune().await;
            }
            match self
                .store
                .sweep(now_ms(), self.workers().max_attempts)
                .await
            {
                Ok(swept) => {
                    let expired = swept.recovered.len() + swept.failed.len();
                    metrics::counter!(m::RECOVERIES).increment(swept.recovered.len() as u64);
                    metrics::counter!(m::LEASE_EXPIRATIONS).increment(expired as u64);
                    for id in swept.recovered.iter().chain(&swept.failed) {
                        self.hub.publish(*id, HubEvent::Changed);
                    }
                    if !swept.recovered.is_empty() {
                        info!(
                            recovered = swept.recovered.len(),
                            "expired leases swept back to pending"
                        );
                        self.wake.notify_one();
                    }
                    if !swept.failed.is_empty() {
                        warn!(
                            failed = swept.failed.len(),
                            "expired leases with no attempts left"
                        );
                    }
                }
                Err(e) => warn!(error = %e, "sweep failed"),
            }
        }
    }

    /// Deletes terminal requests older than `retention_secs`, in rounds of [`PRUNE_BATCH`]
    /// (DU-4). Running on every node at once is harmless.
    async fn prune(&self) {
        let retention =
            i64::try_from(self.config.retention_secs.saturating_mul(1000)).unwrap_or(i64::MAX);
        let before = now_ms().saturating_sub(retention);
        loop {
            match self.store.prune(before, PRUNE_BATCH).await {
                Ok(n) if n > 0 => info!(pruned = n, "pruned requests past retention"),
                Ok(_) => return,
                Err(e) => {
                    warn!(error = %e, "prune failed");
                    return;
                }
            }
        }
    }

    /// Runs one attempt: heartbeat beside the provider call, then the fenced outcome write.
    async fn run_attempt(&self, lease: Lease, record: RequestRecord) {
        let lost = CancellationToken::new();
        let heartbeat = tokio::spawn(self.clone().heartbeat(lease.clone(), lost.clone()));
        let registration = self.register(lease.id);
        debug!(id = %lease.id, attempt = lease.attempt, "attempt started");
        let outcome = tokio::select! {
            outcome = self.call(&lease, &record) => outcome,
            () = lost.cancelled() => None,
            () = registration.abort.cancelled() => None,
            () = self.abandon.cancelled() => {
                // Shutdown grace is over (DU-5): hand the request back without a recovery.
                match self.store.release(&lease, now_ms()).await {
                    Ok(true) => info!(id = %lease.id, "handed back to pending at shutdown"),
                    Ok(false) => {}
                    Err(e) => warn!(id = %lease.id, error = %e, "could not hand back; the lease will expire"),
                }
                self.hub.publish(lease.id, HubEvent::Changed);
                None
            }
        };
        heartbeat.abort();
        drop(registration);
        let Some(outcome) = outcome else {
            info!(id = %lease.id, attempt = lease.attempt, "attempt ended without an outcome");
            return;
        };
        let retry_at = match &outcome {
            Outcome::Retry { next_retry_at, .. } => Some(*next_retry_at),
            _ => None,
        };
        // The provider has answered: losing the outcome now would cost a second provider call
        // when the sweep re-runs the request, so a failed write is tried again (fenced, so a
        // lease lost meanwhile makes it a no-op), as the chunk writer does.
        let mut tries = 0;
        let finished = loop {
            tries += 1;
            match self.store.finish_read(&lease, &outcome, now_ms()).await {
                Err(e) if tries < FINISH_TRIES => {
                    warn!(id = %lease.id, error = %e, tries, "could not record the outcome; retrying");
                    tokio::time::sleep(Duration::from_millis(50 * u64::from(tries))).await;
                }
                finished => break finished,
            }
        };
        match finished {
            Ok(Some(settled)) => {
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
            }
            Ok(None) => info!(id = %lease.id, "lease lost before the outcome was written"),
            // The lease will expire and the sweep re-runs the request.
            Err(e) => warn!(id = %lease.id, error = %e, "could not record the outcome"),
        }
    }

    /// Renews the lease every third of its length; cancels `lost` when the store says the lease
    /// is gone. A database error is not a lost lease: the lease may still be valid.
    async fn heartbeat(self, lease: Lease, lost: CancellationToken) {
        let every = Duration::from_millis(u64::try_from(self.lease_ms() / 3).unwrap_or(1).max(1));
        loop {
            tokio::time::sleep(every).await;
            match self
                .store
                .heartbeat(&lease, now_ms(), self.lease_ms())
                .await
            {
                Ok(true) => {}
                Ok(false) => {
                    lost.cancel();
                    return;
                }
                Err(e) => warn!(id = %lease.id, error = %e, "heartbeat failed"),
            }
        }
    }

    /// One provider call, classified into an [`Outcome`] (LC-5, LC-6, LC-11). `None` when the
    /// lease was lost on the way.
    async fn call(&self, lease: &Lease, record: &RequestRecord) -> Option<Outcome> {
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
                return Some(self.transient(lease, None, e.to_string(), None));
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
            return match self
                .stream(lease, route, response, status, request_id)
                .await
            {
                StreamEnd::LeaseLost => None,
                StreamEnd::Outcome(o) => Some(o),
            };
        }
        Some(
            self.classify(lease, route, &mut response, status, request_id)
                .await,
        )
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
                };
            }
            Err(e) => return self.transient(lease, Some(status), e.to_string(), hint),
        };
        if (200..300).contains(&status) {
            if let Err(why) = check_answer(route, &body) {
                // Kept on the record so the operator sees what came back; never replayed.
                return Outcome::Failed {
                    error: ErrorInfo {
                        kind: ErrorType::UpstreamInvalid,
                        message: format!("the provider answered {status} with {why}"),
                        status: Some(status),
                    },
                    response: Some((status, body)),
                    upstream_request_id: request_id,
                };
            }
            return Outcome::Succeeded {
                status,
                body,
                upstream_request_id: request_id,
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
    async fn stream(
        &self,
        lease: &Lease,
        route: Route,
        mut response: reqwest::Response,
        status: u16,
        request_id: Option<String>,
    ) -> StreamEnd {
        let fail = |kind: ErrorType, message: String, response: Option<Vec<u8>>| {
            StreamEnd::Outcome(Outcome::Failed {
                error: ErrorInfo {
                    kind,
                    message,
                    status: Some(status),
                },
                response: response.map(|body| (status, body)),
                upstream_request_id: request_id.clone(),
            })
        };
        let content_type = response
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
        if !content_type.as_deref().is_some_and(is_event_stream) {
            let (body, _) = self.upstreams.read_capped(&mut response).await;
            let shown = content_type.as_deref().unwrap_or("none");
            return fail(
                ErrorType::UpstreamInvalid,
                format!(
                    "the provider answered {status} to a stream request with content-type \
                     {shown:?} instead of an event stream"
                ),
                Some(body),
            );
        }
        let mut parser = SseParser::new();
        let mut stored = 0usize;
        let mut request_id_to_store = request_id.clone();
        // The body as received while no event has been seen, kept (capped) for the record if
        // none ever arrives.
        let mut unseen = Vec::new();
        loop {
            let piece = match self.upstreams.next_piece(&mut response).await {
                Ok(piece) => piece,
                Err(e) if stored == 0 => {
                    return StreamEnd::Outcome(self.transient(
                        lease,
                        Some(status),
                        e.to_string(),
                        None,
                    ));
                }
                Err(e) => {
                    return fail(
                        ErrorType::StreamInterrupted,
                        format!("the provider stream broke after {stored} events: {e}"),
                        None,
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
                        format!("the provider stream is not valid SSE: {e}"),
                        kept,
                    );
                }
            };
            if events.is_empty() {
                continue;
            }
            let mut chunks = Vec::with_capacity(events.len());
            let mut provider_error = None;
            let mut ended = false;
            for event in events {
                match inspect_event(route, &event) {
                    Ok(seen) => {
                        if seen.error {
                            provider_error = Some(event.data.clone());
                        }
                        ended |= seen.ends_stream;
                    }
                    Err(why) => {
                        let kept = (stored == 0).then(|| std::mem::take(&mut unseen));
                        return fail(ErrorType::UpstreamInvalid, why, kept);
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
                return StreamEnd::Outcome(self.transient(lease, Some(status), message, None));
            }
            let batch = ChunkBatch {
                lease: lease.clone(),
                chunks,
                upstream_request_id: request_id_to_store.take(),
            };
            match self.chunks.append(batch).await {
                Ok(stored_chunks) => {
                    stored += stored_chunks.len();
                    unseen = Vec::new();
                    for chunk in stored_chunks {
                        self.hub.publish(lease.id, HubEvent::Chunk(Arc::new(chunk)));
                    }
                }
                Err(AppendError::LeaseLost) => return StreamEnd::LeaseLost,
                Err(e) => {
                    // Nothing more can be stored; the lease will expire and the sweep re-runs
                    // the request as a new attempt after a reset (LC-8).
                    warn!(id = %lease.id, error = %e, "abandoning attempt: chunks cannot be stored");
                    return StreamEnd::LeaseLost;
                }
            }
            if let Some(error) = provider_error {
                return fail(
                    ErrorType::StreamInterrupted,
                    format!("the provider failed mid-stream: {error}"),
                    None,
                );
            }
            if ended {
                // The provider's final event: the answer is complete, whatever follows.
                return StreamEnd::Outcome(Outcome::Succeeded {
                    status,
                    body: Vec::new(),
                    upstream_request_id: request_id,
                });
            }
        }
        match parser.finish() {
            Err(e) => {
                let kept = (stored == 0).then_some(unseen);
                fail(
                    ErrorType::UpstreamInvalid,
                    format!("the provider stream is not valid SSE: {e}"),
                    kept,
                )
            }
            Ok(_) if stored == 0 => fail(
                ErrorType::UpstreamInvalid,
                format!(
                    "the provider answered {status} with an event stream that ended without any event"
                ),
                Some(unseen),
            ),
            Ok(_) => fail(
                ErrorType::StreamInterrupted,
                format!(
                    "the provider stream ended after {stored} events without its final event ({})",
                    route.stream_end_name()
                ),
                None,
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

/// What [`inspect_event`] found in one provider event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Seen {
    /// The event reports an error (LC-7).
    error: bool,
    /// The event completes the route's stream ([`Route::ends_stream`]).
    ends_stream: bool,
}

/// Checks a provider event before it is stored: its data must be JSON or `[DONE]` (otherwise
/// `Err` with the reason). Says whether it reports an error and whether it is the route's final
/// event, as the route's provider defines them.
///
/// One parse per event: an object is read into a struct that keeps only `error` (as raw JSON,
/// so nothing is allocated for the rest, which is still fully validated) and `type`. Only what
/// that cannot read (a duplicated key) takes the slower path through `serde_json::Value`.
fn inspect_event(route: Route, event: &SseEvent) -> Result<Seen, String> {
    #[derive(serde::Deserialize)]
    struct Probe<'a> {
        #[serde(borrow)]
        error: Option<&'a serde_json::value::RawValue>,
        #[serde(borrow, rename = "type")]
        kind: Option<std::borrow::Cow<'a, str>>,
    }
    let provider = route.provider();
    let name = event.event.as_deref();
    if event.data == "[DONE]" {
        return Ok(Seen {
            error: provider.is_error_event(name, None, false),
            ends_stream: route.ends_stream(&event.data, name),
        });
    }
    let (error, kind) = match serde_json::from_str::<Probe<'_>>(&event.data) {
        Ok(probe) if event.data.starts_with('{') => (
            probe.error.is_some_and(|e| e.get() != "null"),
            probe.kind.map(std::borrow::Cow::into_owned),
        ),
        _ => match serde_json::from_str::<serde_json::Value>(&event.data) {
            Ok(value) => (
                value.get("error").is_some_and(|e| !e.is_null()),
                value
                    .get("type")
                    .and_then(|t| t.as_str())
                    .map(str::to_owned),
            ),
            Err(_) => {
                return Err(format!(
                    "the provider sent an event whose data is not JSON: {}",
                    excerpt(event.data.as_bytes())
                ));
            }
        },
    };
    let kind = name.or(kind.as_deref());
    Ok(Seen {
        error: provider.is_error_event(name, kind, error),
        ends_stream: route.ends_stream(&event.data, kind),
    })
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

/// Checks a 2xx non-stream answer (LC-11): it must be one JSON object, and not an error object
/// (a non-null top-level `error` with none of the route's [`Route::result_members`]). `Err`
/// says what it is instead.
fn check_answer(route: Route, body: &[u8]) -> Result<(), &'static str> {
    #[derive(serde::Deserialize)]
    struct Probe<'a> {
        #[serde(borrow)]
        error: Option<&'a serde_json::value::RawValue>,
        choices: Option<serde::de::IgnoredAny>,
        data: Option<serde::de::IgnoredAny>,
        output: Option<serde::de::IgnoredAny>,
        content: Option<serde::de::IgnoredAny>,
    }
    let has = |member: &str| route.result_members().contains(&member);
    let (error, answered) = match serde_json::from_slice::<Probe<'_>>(body) {
        Ok(p) if body.trim_ascii_start().starts_with(b"{") => (
            p.error.is_some_and(|e| e.get() != "null"),
            (p.choices.is_some() && has("choices"))
                || (p.data.is_some() && has("data"))
                || (p.output.is_some() && has("output"))
                || (p.content.is_some() && has("content")),
        ),
        // A duplicated key (serde_json::Value keeps the last), or not an object at all.
        _ => match serde_json::from_slice::<serde_json::Value>(body) {
            Ok(serde_json::Value::Object(map)) => (
                map.get("error").is_some_and(|e| !e.is_null()),
                map.keys().any(|k| has(k)),
            ),
            Ok(_) => return Err("JSON that is not an object"),
            Err(_) => return Err("a body that is not JSON"),
        },
    };
    if error && !answered {
        return Err("an error object instead of an answer");
    }
    Ok(())
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

fn hostname() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/etc/hostname")
                .ok()
                .map(|h| h.trim().to_string())
        })
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "holdfast".into())
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
        assert_eq!(error(chat, None, "[1, 2]"), Ok(false));
        assert_eq!(error(chat, None, r#"{"error":null}"#), Ok(false));
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

    #[test]
    fn a_2xx_answer_must_be_an_object_and_not_an_error_object_lc11() {
        let chat = Route::OpenaiChat;
        assert_eq!(
            check_answer(chat, br#"{"choices":[],"error":null}"#),
            Ok(())
        );
        assert_eq!(check_answer(chat, br#"{"id":"x"}"#), Ok(()));
        assert!(check_answer(chat, br#"{"error":{"message":"overloaded"}}"#).is_err());
        assert!(check_answer(chat, br#" [1,2]"#).is_err());
        assert!(check_answer(chat, br#""text""#).is_err());
        assert!(check_answer(chat, b"not json").is_err());
        // An answer with both is the provider's answer (a failed Responses object has both).
        let failed = br#"{"object":"response","status":"failed","output":[],"error":{"code":"server_error"}}"#;
        assert_eq!(check_answer(Route::OpenaiResponses, failed), Ok(()));
        let refused = br#"{"type":"error","error":{"type":"overloaded_error","message":"x"}}"#;
        assert!(check_answer(Route::AnthropicMessages, refused).is_err());
        assert_eq!(
            check_answer(
                Route::AnthropicMessages,
                br#"{"type":"message","content":[]}"#
            ),
            Ok(())
        );
        assert!(
            check_answer(
                Route::OpenaiEmbeddings,
                br#"{"error":{"m":1},"choices":[]}"#
            )
            .is_err()
        );
        // A duplicated key takes the slower path and the same rule.
        assert!(check_answer(chat, br#"{"error":null,"error":{"m":1}}"#).is_err());
        assert_eq!(check_answer(chat, br#"{"choices":1,"choices":[]}"#), Ok(()));
    }

    #[test]
    fn content_types_of_event_streams_are_recognised() {
        assert!(is_event_stream("text/event-stream"));
        assert!(is_event_stream("Text/Event-Stream; charset=utf-8"));
        assert!(!is_event_stream("application/json"));
        assert!(!is_event_stream("text/html"));
    }
}
