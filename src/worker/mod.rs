//! Leased workers: take due requests from the log, call the provider once per attempt, record
//! the outcome under the attempt's lease (SPEC LC-2..LC-6).
//!
//! One dispatcher loop per process holds `workers.concurrency` permits. For each permit it
//! leases a request (one atomic write in the store) and spawns the attempt. An attempt renews
//! its lease by heartbeat from a separate task and never holds a database transaction across
//! the provider call (LC-2). A lost lease (swept, cancelled) aborts the provider call and the
//! attempt writes nothing more (LC-3). A separate sweeper sends expired leases back to
//! `pending` (LC-4).

mod answers;
mod attempt;
mod bookkeeping;
mod chunks;
mod retry;
mod stream;

use foldhash::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, Semaphore};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, warn};
use uuid::Uuid;

use crate::config::{Config, Workers};
use crate::hub::{Hub, HubEvent};
use crate::metrics::{self as m, AttemptMeters};
use crate::otel::{AttemptSpan, Traces};
use crate::slots::{Keep, NamespaceSlots, Slot};
use crate::store::{
    DynStore, ErrorType, Lease, LeaseTo, NewRequest, RequestRecord, Started, StoreError, Submitted,
    now_ms,
};
use crate::upstream::Upstreams;
pub(crate) use answers::ClaimRef;
use answers::RecentAnswers;
use bookkeeping::Bookkeeping;
pub use chunks::{AppendError, ChunkWriter};
use stream::HandOnGate;

/// How often expired terminal requests are pruned (DU-4).
const PRUNE_EVERY: Duration = Duration::from_secs(60);
/// Requests deleted per prune transaction.
const PRUNE_BATCH: i64 = 500;
/// Most requests leased by one store call.
const LEASE_BATCH: usize = 256;
/// How long the dispatcher waits, when a lease left a request that is due already, before it
/// asks again (a request that came due between the lease and its check).
const DUE_NOW: Duration = Duration::from_millis(1);
/// Longest a cancel waits for the chunks its attempt handed on to be committed (LC-9).
pub(crate) const CANCEL_SETTLES_FOR: Duration = Duration::from_secs(2);

/// How long a failed write of an attempt is tried again (decision 37, decision 52):
/// `workers.write_retry_secs`, at least one lease length. Readers of a stream try their reads
/// as long (RS-4, decision 93).
pub(crate) fn write_window(config: &Config) -> Duration {
    Duration::from_secs(
        config
            .workers
            .write_retry_secs
            .max(config.workers.lease_secs),
    )
}

/// How long a node holds its sweeps once the store answers again after failing (decision 52):
/// every live attempt's heartbeat, tried every [`attempt::HEARTBEAT_RETRY`] while it fails,
/// renews its lease first, so a lease that ran out during the outage is not taken over from an
/// attempt that holds, or is still receiving, the provider's answer.
const SWEEP_HOLD_AFTER_OUTAGE: Duration = Duration::from_secs(3);
/// Longest wait for one sweep: a statement hung on a silent network counts as a failure.
const SWEEP_LIMIT: Duration = Duration::from_secs(5);

/// This node's worker pool: a handle cloned for every request and attempt, so it is one
/// shared allocation and a clone is one reference count rather than one per field (a
/// `--profile-dwarf` of the non-stream row put 2.7 % of the workers' CPU in cloning and
/// dropping the pool's fields one by one, and 4 % in the HTTP state's, which holds a pool;
/// issue 30).
#[derive(Clone)]
pub(crate) struct WorkerPool(Arc<Pool>);

impl std::ops::Deref for WorkerPool {
    type Target = Pool;

    fn deref(&self) -> &Pool {
        &self.0
    }
}

/// What a worker pool needs, shared by every handle to it ([`WorkerPool`]).
pub(crate) struct Pool {
    store: DynStore,
    hub: Arc<Hub>,
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
    /// attempt holds one, whether the dispatcher or admission ([`WorkerPool::try_slot`])
    /// started it, so shutdown drains by taking them all back.
    permits: Arc<Semaphore>,
    /// Who may take a permit: each namespace its share first, every unused share held for its
    /// namespace (LC-2a).
    slots: NamespaceSlots,
    /// Cancelled when shutdown begins, as the signal arrives: no new attempts start, whatever
    /// the dispatcher is waiting for (a child of the process's shutdown token, DU-5).
    stopping: CancellationToken,
    /// The attempts this process is running, and the hand-on gates cancels hold shut (LC-9).
    running: Arc<Mutex<Running>>,
    /// Succeeded requests by claim: duplicates answered without a database write.
    answers: Arc<RecentAnswers>,
    /// Deliveries and log reads, counted apart from the answers and written in bulk (DU-6).
    books: Arc<Bookkeeping>,
    /// When the store last failed this node (decision 52).
    health: Arc<StoreHealth>,
    /// Traces, when `otel.enabled` (OT-3).
    traces: Traces,
    /// The series each attempt counts into, kept once registered (issue 30).
    meters: AttemptMeters,
    /// The runtime attempts run on, for the threads outside it that start them.
    runtime: tokio::runtime::Handle,
}

/// What a cancel through this process works on (LC-9).
#[derive(Default)]
struct Running {
    /// Each attempt running here, by request id.
    attempts: HashMap<Uuid, Switches>,
    /// The hand-on gate of each request a cancel holds shut, and how many cancels hold it: an
    /// attempt of the request that starts meanwhile (a retry) passes the same gate (decision
    /// 127).
    shut: HashMap<Uuid, (HandOnGate, usize)>,
}

/// A running attempt's switches.
#[derive(Clone)]
struct Switches {
    /// The attempt's number: a registration removes only its own entry.
    attempt: u32,
    /// Cancelled when the request is cancelled: the attempt is dropped.
    abort: CancellationToken,
    /// Cancelled with `abort`, and by shutdown's abandon (a child of it): what the attempt
    /// waits on, one wait for both at each of its wakes (issue 30).
    stop: CancellationToken,
    /// Shut while a cancel settles what was handed on (decision 127).
    hand_on: HandOnGate,
}

/// A running attempt's entry in [`Running`]; removed on drop.
struct Registration {
    pool: WorkerPool,
    id: Uuid,
    switches: Switches,
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut running = self.pool.running.lock().unwrap_or_else(|e| e.into_inner());
        running.unregister(self.id, self.switches.attempt);
    }
}

/// A cancel's hold on request `id`'s hand-on gate, counted in [`Running::shut`].
struct Shut {
    pool: WorkerPool,
    id: Uuid,
    gate: HandOnGate,
}

impl Drop for Shut {
    fn drop(&mut self) {
        let mut running = self.pool.running.lock().unwrap_or_else(|e| e.into_inner());
        running.let_go(self.id);
    }
}

impl Running {
    /// Registers attempt `lease`: its hand-ons pass the gate a cancel of the request holds
    /// shut, if one does.
    fn register(&mut self, lease: &Lease, stop: CancellationToken) -> Switches {
        let switches = Switches {
            attempt: lease.attempt,
            abort: CancellationToken::new(),
            stop,
            hand_on: self
                .shut
                .get(&lease.id)
                .map(|(gate, _)| gate.clone())
                .unwrap_or_default(),
        };
        self.attempts.insert(lease.id, switches.clone());
        switches
    }

    /// Removes attempt `attempt` of request `id`, unless a later one took its place.
    fn unregister(&mut self, id: Uuid, attempt: u32) {
        if self.attempts.get(&id).is_some_and(|s| s.attempt == attempt) {
            self.attempts.remove(&id);
        }
    }

    /// Request `id`'s hand-on gate, held for a cancel: its running attempt's, or the one
    /// another cancel holds.
    fn hold(&mut self, id: Uuid) -> HandOnGate {
        let attempts_gate = self.attempts.get(&id).map(|s| s.hand_on.clone());
        let (gate, holders) = self
            .shut
            .entry(id)
            .or_insert_with(|| (attempts_gate.unwrap_or_default(), 0));
        *holders += 1;
        gate.clone()
    }

    /// A cancel lets go of request `id`'s gate.
    fn let_go(&mut self, id: Uuid) {
        if let Some((_, holders)) = self.shut.get_mut(&id) {
            *holders -= 1;
            if *holders == 0 {
                self.shut.remove(&id);
            }
        }
    }
}

impl WorkerPool {
    /// A pool for this process, which stops taking leases as `shutdown` is cancelled.
    pub(crate) fn new(
        store: DynStore,
        hub: Arc<Hub>,
        upstreams: Arc<Upstreams>,
        config: Arc<Config>,
        traces: Traces,
        shutdown: &CancellationToken,
    ) -> WorkerPool {
        let node = format!("{}-{}", hostname(), std::process::id());
        // Several nodes share a PostgreSQL store: a positioned reader may follow from another
        // node, which this node's hub does not see (DU-7).
        let chunks = ChunkWriter::spawn_publishing(
            store.clone(),
            Arc::clone(&hub),
            write_window(&config),
            is_postgres(&config),
        );
        WorkerPool(Arc::new(Pool {
            permits: Arc::new(Semaphore::new(config.workers.concurrency)),
            slots: NamespaceSlots::new(
                config.workers.concurrency,
                config.worker_share(),
                &config.namespaces,
                Keep::EveryUnusedShare,
            ),
            stopping: shutdown.child_token(),
            abandon: CancellationToken::new(),
            chunks,
            books: Bookkeeping::spawn(store.clone(), Arc::clone(&config)),
            health: Arc::new(StoreHealth::new(is_postgres(&config))),
            store,
            hub,
            upstreams,
            config,
            wake: Arc::new(Notify::new()),
            node: node.into(),
            running: Arc::default(),
            answers: Arc::default(),
            traces,
            meters: AttemptMeters::default(),
            runtime: tokio::runtime::Handle::current(),
        }))
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
    /// A client that goes away while its submission waits for the store strands nothing the
    /// write commits (LC-9: a client disconnecting never cancels or delays execution): a
    /// request leased to an attempt that never started would only move again when its lease
    /// expired, as a recovery that never happened. On SQLite the store itself starts the
    /// attempt ([`WorkerPool::admit_here`]); on PostgreSQL the admission runs as a task of its
    /// own ([`WorkerPool::admit_in_task`]).
    ///
    /// # Errors
    /// [`StoreError`] when the request could not be recorded; nothing was then.
    pub(crate) async fn admit(&self, new: NewRequest) -> Result<Submitted, StoreError> {
        // A duplicate of a request this process saw succeed: what the store would answer.
        if let Some(mut record) =
            self.answers
                .replay(&new.namespace, &new.claim_key, &new.hash, new.now)
        {
            self.count_delivery(&mut record);
            return Ok(Submitted::Attached(Box::new(record)));
        }
        let slot = self.try_slot(&new.namespace);
        match (self.admission_limit(), slot) {
            (None, Some(slot)) => self.admit_here(new, slot).await,
            (limit, slot) => self.admit_in_task(new, slot, limit).await,
        }
    }

    /// Admission where one process arbitrates claims (SQLite) and a worker is free: the store
    /// calls back with the lease as soon as it has decided the submission, before its commit,
    /// or once it is durable
    /// ([`Store::submit_and_lease_started`](crate::store::Store::submit_and_lease_started)), and
    /// the attempt starts from there, from the store's writer thread. So the provider call need
    /// not wait for the commit (ID-9), the answer still does, and the wait needs no task of its
    /// own: one task and two hand-offs fewer per request (issue 30).
    async fn admit_here(&self, new: NewRequest, slot: Slot) -> Result<Submitted, StoreError> {
        let owner = self.lease_owner();
        let lease = LeaseTo {
            owner: &owner,
            lease_ms: self.lease_ms(),
        };
        // The attempt's copy of the request, made here rather than on the writer's thread.
        let record = crate::store::created_record(new.clone(), true);
        let pool = self.clone();
        let started: Started = Box::new(move |lease| pool.spawn_attempt(lease, record, slot));
        let (mut submitted, _) = self
            .store
            .submit_and_lease_started(new, Some(lease), started)
            .await?;
        // Created: leased, and the store has started its attempt.
        if let Submitted::Attached(record) = &mut submitted {
            self.count_delivery(record);
        }
        Ok(submitted)
    }

    /// Admission as a task of its own, which starts the attempt (or wakes the dispatcher) once
    /// the submission is durable, even if its client has gone: on PostgreSQL, where the claim's
    /// commit arbitrates between nodes and comes before the call, and on SQLite when no worker
    /// is free (the dispatcher leases the request, and must hear of it). A database that does
    /// not answer within `limit` refuses the call, retryable (RS-10); the task goes on, and a
    /// retry attaches to what it records after all.
    async fn admit_in_task(
        &self,
        new: NewRequest,
        slot: Option<Slot>,
        limit: Option<Duration>,
    ) -> Result<Submitted, StoreError> {
        let pool = self.clone();
        let admission = tokio::spawn(async move {
            let owner = slot.as_ref().map(|_| pool.lease_owner());
            let lease = owner.as_deref().map(|owner| LeaseTo {
                owner,
                lease_ms: pool.lease_ms(),
            });
            let (mut submitted, lease) = pool.store.submit_and_lease(new, lease).await?;
            match (&mut submitted, lease, slot) {
                (Submitted::Created(record), Some(lease), Some(slot)) => {
                    pool.spawn_attempt(lease, (**record).clone(), slot);
                }
                (Submitted::Created(_), None, _) => pool.wake(),
                (Submitted::Attached(record), ..) => pool.count_delivery(record),
                _ => {}
            }
            Ok(submitted)
        });
        let joined = match limit {
            None => admission.await,
            Some(limit) => match tokio::time::timeout(limit, admission).await {
                Ok(joined) => joined,
                Err(_) => {
                    return Err(StoreError::Unavailable(format!(
                        "the database did not record the request within database_timeout_ms \
                         ({} ms)",
                        limit.as_millis()
                    )));
                }
            },
        };
        joined.unwrap_or_else(|e| Err(StoreError::Unavailable(format!("admission task: {e}"))))
    }

    /// How long a new call waits for the store to record it (`database_timeout_ms`, RS-10):
    /// PostgreSQL only; SQLite's writer is in the process.
    fn admission_limit(&self) -> Option<Duration> {
        is_postgres(&self.config).then(|| Duration::from_millis(self.config.database_timeout_ms))
    }

    /// Keeps `record`, the answer to a submission holding `claim`, for the claim's duplicates
    /// when it succeeded ([`RecentAnswers`]).
    pub(crate) fn remember(&self, claim: &ClaimRef<'_>, record: &Arc<RequestRecord>) {
        self.answers.remember(claim, record);
    }

    /// Counts a delivery that attached or replayed (docs/usage.md). A replay of a finished
    /// request whose deliveries now exceed its attempts is a saved call, counted at once with
    /// its tokens; an attachment is counted when the request finishes, since an attempt after it
    /// (a retry, a recovery) can still spend the call it seemed to save.
    ///
    /// The count is written after the answer, in bulk with the others ([`Bookkeeping`], DU-6):
    /// a duplicate is answered even when nothing can be written, and counting it never delays
    /// another request.
    fn count_delivery(&self, record: &mut RequestRecord) {
        let replayed = record.status.is_terminal();
        if replayed {
            record.replayed += 1;
        } else {
            record.attached += 1;
        }
        self.books.delivery(record.id, replayed);
        if replayed && record.saved_calls() > 0 {
            crate::ledger::count_saved(
                &self.config,
                &record.backend,
                record.model.as_deref(),
                1,
                &record.usage,
            );
        }
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
        // A task of its own: a caller that goes away mid-way (its connection closed) does not
        // leave the hand-on shut, or opened again with the attempt not aborted (decision 127).
        let (pool, namespace) = (self.clone(), namespace.to_owned());
        match tokio::spawn(async move { pool.cancel_here(&namespace, id).await }).await {
            Ok(cancelled) => cancelled,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            // The runtime is shutting down; what the cancel wrote, if anything, stays.
            Err(_) => Err(StoreError::Unavailable("holdfast is shutting down".into())),
        }
    }

    async fn cancel_here(
        &self,
        namespace: &str,
        id: Uuid,
    ) -> Result<Option<RequestRecord>, StoreError> {
        // An attempt running here shows its streams' events before they are committed (RS-11):
        // what it handed on is committed first, so that the usage those events reported, which
        // the provider bills, is stored before the cancel fences the attempt out (RD-9,
        // decision 77). Its hand-on stays shut from before that wait until the attempt is
        // aborted, so no event reaches a client that the wait did not commit (decision 127).
        // Only for the caller's own request (a read, so that another namespace cannot hurry
        // this node's commits or time them to learn what runs here), and bounded: a failing
        // store does not hold the cancel for its retry window.
        let runs_here = self
            .running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .attempts
            .contains_key(&id);
        let shut = if runs_here && self.store.get(namespace, id).await?.is_some() {
            let hold = self.shut(id);
            let shut = hold.gate.close().await;
            debug!(request_id = %id, "cancel: hand-on shut; committing what the attempt handed on");
            let _ = tokio::time::timeout(CANCEL_SETTLES_FOR, self.chunks.settle_handed_on()).await;
            Some((shut, hold))
        } else {
            None
        };
        let now = now_ms();
        let record = self.store.cancel(namespace, id, now).await?;
        // Finished by this call (an already terminal request comes back unchanged; one an
        // attempt settled in the same millisecond is not `cancelled`).
        if let Some(r) = &record
            && r.finished_at == Some(now)
            && r.error
                .as_ref()
                .is_some_and(|e| e.kind == ErrorType::Cancelled)
        {
            attempt::log_finished(r);
            // Deliveries that attached while it ran saved what the attempts did not spend.
            crate::ledger::count_saved(
                &self.config,
                &r.backend,
                r.model.as_deref(),
                u64::from(r.saved_calls_while_running()),
                &r.usage,
            );
        }
        if record.is_some() {
            let running = self.running.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(switches) = running.attempts.get(&id) {
                // The abort before the stop it wakes the attempt with: the attempt tells them
                // apart by it.
                switches.abort.cancel();
                switches.stop.cancel();
            }
            drop(running);
            self.hub.publish(id, HubEvent::Changed);
        }
        // Only now, with the attempt aborted, does the hand-on open again (for an attempt that
        // finished before the cancel could fence it, nothing waits on it).
        drop(shut);
        Ok(record)
    }

    /// Counts a reader of request `id`'s log as an event stream, written like the deliveries
    /// (DU-6).
    pub(crate) fn count_log_read(&self, id: Uuid) {
        self.books.log_read(id);
    }

    /// Holds request `id`'s hand-on gate for a cancel: the gate of its attempt running here,
    /// or the one another cancel holds, which an attempt starting meanwhile passes too.
    fn shut(&self, id: Uuid) -> Shut {
        let gate = self
            .running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .hold(id);
        Shut {
            pool: self.clone(),
            id,
            gate,
        }
    }

    /// Registers attempt `lease` as running here, for [`WorkerPool::cancel`].
    fn register(&self, lease: &Lease) -> Registration {
        let switches = self
            .running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .register(lease, self.abandon.child_token());
        Registration {
            pool: self.clone(),
            id: lease.id,
            switches,
        }
    }

    /// Whether an attempt of request `id` runs on this node now. Every end of one wakes the
    /// request's waiters here through the hub (settled, lost, handed back or ended without an
    /// outcome), so a held call need not re-read the request as often (decision 148).
    pub(crate) fn runs_here(&self, id: Uuid) -> bool {
        self.running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .attempts
            .contains_key(&id)
    }

    fn workers(&self) -> &Workers {
        &self.config.workers
    }

    /// A free worker slot for an attempt of `namespace` started at admission (see
    /// [`Store::submit_and_lease`](crate::store::Store::submit_and_lease)), or `None` when all
    /// are busy, when the namespace holds its share and the free slots are the other
    /// namespaces' unused shares (LC-2a), or when shutdown has begun.
    fn try_slot(&self, namespace: &str) -> Option<Slot> {
        if self.stopping.is_cancelled() {
            return None;
        }
        self.slots.try_slot(&self.permits, namespace)
    }

    /// A lease owner unique to one attempt (or, for `lease_many`, one call): `<host>-<pid>/<uuid>`.
    pub(crate) fn lease_owner(&self) -> String {
        owner_text(&self.node, Uuid::new_v4())
    }

    /// Lease length in milliseconds (`workers.lease_secs`).
    pub(crate) fn lease_ms(&self) -> i64 {
        i64::try_from(self.workers().lease_secs.saturating_mul(1000)).unwrap_or(i64::MAX / 4)
    }

    /// Runs the attempt `lease` holds, keeping `slot` until it ends, as a task of its own.
    /// Callable from any thread (the SQLite writer's starts attempts, see
    /// [`WorkerPool::admit_here`]): it only spawns, and the attempt's span and trace are made in
    /// the task.
    pub(crate) fn spawn_attempt(&self, lease: Lease, record: RequestRecord, slot: Slot) {
        // The attempt's future is kilobytes (every state it can await in); boxed, the task
        // holds a pointer, so spawning it (often from the SQLite writer thread, decision 70)
        // and ending it, when tokio overwrites the task's whole stage, copy a few bytes
        // instead of the future (issue 30, docs/benchmarks.md).
        let pool = self.clone();
        let attempt = Box::pin(async move { pool.attempt(lease, record).await });
        self.runtime.spawn(async move {
            attempt.await;
            drop(slot);
        });
    }

    /// Runs the attempt `lease` holds, in a span that names its request (and its trace, when
    /// traces are on).
    async fn attempt(&self, lease: Lease, record: RequestRecord) {
        // DU-5: leased before shutdown's signal (a lease or a submission the store returned
        // late) and started after it: no provider call on a stopping node, and no attempt spent.
        if self.stopping.is_cancelled() {
            self.hand_back_unstarted(&lease).await;
            return;
        }
        self.meters.backend(&record.backend).attempts().increment(1);
        let trace = self.traces.as_ref().map(|traces| {
            traces.attempt(
                &record,
                lease.attempt,
                backend_address(&self.config, &record),
            )
        });
        // Every log line of the attempt names its request, and its trace when traces are on.
        let span = tracing::info_span!(
            "attempt",
            id = %lease.id,
            attempt = lease.attempt,
            namespace = %record.namespace,
            route = record.route.name(),
            backend = %record.backend,
            trace_id = tracing::field::Empty,
            span_id = tracing::field::Empty,
        );
        if let Some((trace_id, span_id)) = trace.as_ref().and_then(AttemptSpan::ids) {
            span.record("trace_id", trace_id.as_str());
            span.record("span_id", span_id.as_str());
        }
        self.run_attempt(lease, record, trace)
            .instrument(span)
            .await;
    }

    /// Runs the dispatcher and the sweeper until shutdown begins (the token given to
    /// [`WorkerPool::new`]), then waits for in-flight attempts to finish: at most
    /// `shutdown_grace_ms` from the signal, even if the dispatcher was then waiting for the
    /// store (DU-5).
    pub(crate) async fn run(self) {
        let shutdown = self.stopping.clone();
        // When the signal came: a dispatcher held in a store call (a locked database) sees it
        // only once the call returns, and the grace runs from the signal, not from then.
        let signalled = tokio::spawn({
            let shutdown = shutdown.clone();
            async move {
                shutdown.cancelled().await;
                tokio::time::Instant::now()
            }
        });
        let sweeper = tokio::spawn(self.clone().sweep_loop(shutdown.clone()));
        let permits = Arc::clone(&self.permits);
        let poll = Duration::from_millis(self.workers().poll_interval_ms);
        loop {
            let permit = tokio::select! {
                // Shutdown first: with permits free, a signal that came during a lease still
                // ends the loop before another lease.
                biased;
                () = shutdown.cancelled() => break,
                p = Arc::clone(&permits).acquire_owned() => match p {
                    Ok(p) => p,
                    Err(_) => break,
                },
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
            // Each namespace its share first (LC-2a); the free permits beyond the batch count
            // towards the share's worth kept free.
            let quota = self.slots.quota(asked, permits.available_permits());
            let ended = self.slots.ended();
            match self
                .store
                .lease_many(&self.lease_owner(), now_ms(), self.lease_ms(), &quota)
                .await
            {
                Ok(leased) => {
                    let drained = leased.len() < asked;
                    for ((lease, record), permit) in leased.into_iter().zip(batch) {
                        let slot = self.slots.slot(permit, &record.namespace);
                        self.spawn_attempt(lease, record, slot);
                    }
                    // Fewer due requests than free permits: nothing more is due now, so wait
                    // for a wake-up instead of asking again at once (which costs an empty
                    // write per request at low load). A request recorded
                    // meanwhile is not missed: `notify_one` keeps its permit for the next
                    // `notified()`.
                    if drained {
                        // Something due was left (LC-2a: its namespace over its share, only
                        // the share kept free left): wait for a slot to free as well.
                        let wait = self.idle_wait(poll).await;
                        let held_back = wait.is_none() && self.slots.shared_by_namespaces();
                        let wait = wait.unwrap_or(if held_back { poll } else { DUE_NOW });
                        tokio::select! {
                            () = self.wake.notified() => {}
                            () = self.slots.wait_for_a_slot(ended), if held_back => {}
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
        // DU-5: no new attempts (`stopping` was cancelled with the signal, so admission has
        // started none since); in-flight ones get the grace period, then hand back. Every
        // attempt holds a permit until it ends, so taking all of them back is the drain.
        let signalled = signalled
            .await
            .unwrap_or_else(|_| tokio::time::Instant::now());
        let all = u32::try_from(self.workers().concurrency).unwrap_or(u32::MAX);
        let grace = Duration::from_millis(self.config.shutdown_grace_ms);
        let drained = tokio::time::timeout_at(signalled + grace, permits.acquire_many(all)).await;
        if drained.is_err() {
            info!(
                running = self.workers().concurrency - permits.available_permits(),
                "shutdown grace over; handing running attempts back"
            );
            self.abandon.cancel();
            let _ = permits.acquire_many(all).await;
        }
        let _ = sweeper.await;
        self.books.close(&self.store).await;
    }

    /// How long to sleep when nothing is due: until the earliest scheduled retry, at most
    /// `poll`; `None` when a request is due already.
    async fn idle_wait(&self, poll: Duration) -> Option<Duration> {
        match self.store.next_due().await {
            Ok(Some(due)) => {
                let ms = due - now_ms();
                (ms > 0).then(|| poll.min(Duration::from_millis(u64::try_from(ms).unwrap_or(1))))
            }
            _ => Some(poll),
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
            // Decision 52: no sweep while the store fails, nor until it has not failed this
            // node for a hold: every live attempt's heartbeat renews its lease first.
            if self.health.failed_within(SWEEP_HOLD_AFTER_OUTAGE) {
                continue;
            }
            match tokio::time::timeout(SWEEP_LIMIT, self.sweep_once()).await {
                Ok(true) => {}
                Ok(false) => self.health.failed(),
                Err(_) => {
                    warn!("sweep timed out");
                    self.health.failed();
                }
            }
        }
    }

    /// The sweep before a node serves (decision 41): recovers what a stopped process left
    /// running, so a retry of it attaches to its recovery. Skipped on PostgreSQL, where this
    /// node may start as the database returns from an outage and other nodes' live attempts
    /// have yet to renew their leases; the loop sweeps after the hold (decision 52).
    pub(crate) async fn sweep_at_start(&self) {
        if !self.health.failed_within(SWEEP_HOLD_AFTER_OUTAGE) {
            self.sweep_once().await;
        }
    }

    /// One sweep (LC-4): expired leases back to `pending` or failed, counted, logged, and their
    /// readers and the workers woken. `app::start` runs one before it serves, so requests a
    /// stopped process left behind are recovered before any retry of them arrives. `false`
    /// when the store failed.
    pub(crate) async fn sweep_once(&self) -> bool {
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
                for id in &swept.failed {
                    warn!(
                        %id,
                        error_type = "lease_expired",
                        "request failed: its last attempt's lease expired and no attempts are left"
                    );
                }
                true
            }
            Err(e) => {
                warn!(error = %e, "sweep failed");
                false
            }
        }
    }

    /// Deletes terminal requests older than `retention_secs`, in rounds of [`PRUNE_BATCH`]; one
    /// whose webhook delivery is still pending only `give_up_after_secs` later (DU-4, decision
    /// 82). Running on every node at once is harmless.
    async fn prune(&self) {
        let ms = |secs: u64| i64::try_from(secs.saturating_mul(1000)).unwrap_or(i64::MAX);
        let before = now_ms().saturating_sub(ms(self.config.retention_secs));
        let pending_callback_before =
            before.saturating_sub(ms(self.config.callbacks.give_up_after_secs));
        loop {
            match self
                .store
                .prune(before, pending_callback_before, PRUNE_BATCH)
                .await
            {
                Ok(n) if n > 0 => info!(pruned = n, "pruned requests past retention"),
                Ok(_) => return,
                Err(e) => {
                    warn!(error = %e, "prune failed");
                    return;
                }
            }
        }
    }
}

/// When this node's store last failed a write it needed: a sweep, a heartbeat, an attempt's
/// outcome (decision 52). Leases may have run out during the failure only because their
/// attempts could not renew them, so sweeps wait until the store has not failed for a hold.
#[derive(Debug)]
pub(crate) struct StoreHealth {
    /// Milliseconds since `start` of the last failure; `i64::MIN`: none yet.
    last_failure: std::sync::atomic::AtomicI64,
    start: std::time::Instant,
}

impl StoreHealth {
    /// No failure yet, or (`held`) one at once: a PostgreSQL node that starts as the database
    /// returns holds its sweeps too, while the other nodes' attempts renew their leases.
    fn new(held: bool) -> StoreHealth {
        let health = StoreHealth {
            last_failure: std::sync::atomic::AtomicI64::new(i64::MIN),
            start: std::time::Instant::now(),
        };
        if held {
            health.failed();
        }
        health
    }

    fn elapsed_ms(&self) -> i64 {
        i64::try_from(self.start.elapsed().as_millis()).unwrap_or(i64::MAX)
    }

    /// Records a failure now.
    pub(crate) fn failed(&self) {
        self.last_failure
            .store(self.elapsed_ms(), std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether the store failed within `hold`.
    fn failed_within(&self, hold: Duration) -> bool {
        let last = self.last_failure.load(std::sync::atomic::Ordering::Relaxed);
        last != i64::MIN
            && self.elapsed_ms().saturating_sub(last)
                < i64::try_from(hold.as_millis()).unwrap_or(i64::MAX)
    }
}

/// Whether the store is PostgreSQL (shared by nodes, reached over a network).
fn is_postgres(config: &Config) -> bool {
    let url = config.database_url.as_str();
    url.starts_with("postgres://") || url.starts_with("postgresql://")
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

/// `server.address` and `server.port` of the backend that runs `record` (OT-3).
fn backend_address(config: &Config, record: &RequestRecord) -> Option<(String, u16)> {
    let backend = config.backends.iter().find(|b| b.name == record.backend)?;
    let url = reqwest::Url::parse(&backend.base_url).ok()?;
    Some((url.host_str()?.to_owned(), url.port_or_known_default()?))
}

/// `<node>/<unique>`, the text of a lease owner ([`WorkerPool::lease_owner`]), pushed rather
/// than `format!`ed: one per proxied request (issue 30).
fn owner_text(node: &str, unique: Uuid) -> String {
    let mut owner = String::with_capacity(node.len() + 1 + uuid::fmt::Hyphenated::LENGTH);
    owner.push_str(node);
    owner.push('/');
    owner.push_str(unique.hyphenated().encode_lower(&mut Uuid::encode_buffer()));
    owner
}

#[cfg(test)]
mod tests {
    use super::*;

    /// LC-3: every worker write is fenced on the owner; its text is the node's and a fresh
    /// UUID's, as `format!` would write them (the cluster chaos test reads the pid from it).
    #[test]
    fn a_lease_owner_is_the_node_and_a_fresh_uuid_lc3() {
        let unique = Uuid::new_v4();
        let owner = owner_text("host-a-4242", unique);
        assert_eq!(owner, format!("host-a-4242/{unique}"));
        assert_ne!(
            owner_text("n", Uuid::new_v4()),
            owner_text("n", Uuid::new_v4())
        );
    }

    #[test]
    fn sweeps_hold_while_the_store_fails_and_for_a_while_after_decision52() {
        let hold = Duration::from_secs(3);
        let fresh = StoreHealth::new(false);
        assert!(!fresh.failed_within(hold), "no failure yet: sweep");
        fresh.failed();
        assert!(fresh.failed_within(hold), "just failed: hold");
        assert!(
            !fresh.failed_within(Duration::ZERO),
            "a hold of nothing is over"
        );
        // A PostgreSQL node starts holding: the database may just have come back.
        assert!(StoreHealth::new(true).failed_within(hold));
    }

    /// LC-9, decision 127: a cancel holds its request's hand-on gate, not one attempt's: an
    /// attempt of the request that starts while the cancel settles (a retry) waits at the
    /// same gate, and the registration of an attempt that is over removes nothing of a later
    /// one's.
    #[tokio::test]
    async fn an_attempt_that_starts_while_a_cancel_holds_its_requests_gate_waits_at_it_lc9() {
        use futures::FutureExt;
        let lease = |attempt| Lease {
            id: Uuid::nil(),
            owner: format!("node/{attempt}").into(),
            attempt,
        };
        let mut running = Running::default();
        running.register(&lease(1), CancellationToken::new());
        let gate = running.hold(Uuid::nil());
        let shut = gate.close().await;
        // The first attempt ends with a retry; the second starts before the cancel fences it.
        let second = running.register(&lease(2), CancellationToken::new());
        running.unregister(Uuid::nil(), 1);
        assert!(
            running.attempts.contains_key(&Uuid::nil()),
            "the first attempt's end leaves the second registered"
        );
        assert!(
            second.hand_on.pass().now_or_never().is_none(),
            "the second attempt hands nothing on while the cancel holds the gate"
        );
        drop(shut);
        running.let_go(Uuid::nil());
        assert!(running.shut.is_empty());
        let third = running.register(&lease(3), CancellationToken::new());
        assert!(third.hand_on.pass().now_or_never().is_some());
    }
}
