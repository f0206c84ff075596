//! Group commit of stream chunks.
//!
//! Every attempt that streams hands its parsed events to one writer task per process. The
//! writer takes everything queued at that moment — from any number of streams — and stores it
//! with one [`Store::append_chunks`](crate::store::Store::append_chunks) call, one
//! transaction, each batch fenced on its own lease (LC-3). So the per-chunk cost falls as load
//! rises instead of being one commit per chunk. A stream's events are handed on
//! ([`ChunkWriter::hand_on`]): the attempt shows them to its proxied streams at once and reads on
//! while the writer commits them, within a bounded window (RS-11); the writer publishes them to
//! positioned readers once committed (RD-4). While nobody waits on a commit but those readers,
//! the writer holds it open briefly for more ([`MAX_HOLD`]), and tells the store so, which may
//! hold it again with other writes (DU-7); while no positioned reader follows any of its
//! streams either, it holds it longer ([`UNFOLLOWED_HOLD`]) and a stream's batches handed on
//! meanwhile become one. An attempt that waits for what it handed on asks for the commit at
//! once ([`ChunkWriter::flush`]). A stream's last batch, which
//! ends it, is appended and waited for ([`ChunkWriter::append`]) and published only with the
//! outcome (RS-12). A commit that fails is tried again for `write_retry_secs` ([`WriteRetry`],
//! decisions 37, 52) before its batches are failed.

use foldhash::{HashMap, HashSet, HashSetExt};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::sync::futures::Notified;
use tokio::sync::{Notify, mpsc, oneshot};
use tracing::{debug, info, warn};

use super::retry::{WriteRetry, is_transient};
use crate::hub::{Hub, HubEvent};
use crate::metrics as m;
use crate::store::{Chunk, ChunkBatch, DynStore, Lease, StoreError};

/// Largest number of batches stored in one transaction.
const MAX_BATCHES_PER_COMMIT: usize = 1024;

type Ack = oneshot::Sender<Result<Option<Vec<Chunk>>, Arc<StoreError>>>;

/// What the writer is sent.
// A batch is what almost every message is: boxing it would cost an allocation per batch to
// save bytes on the rare flush.
#[allow(clippy::large_enum_variant)]
enum Queued {
    /// A batch to store, with whom to tell.
    Batch {
        batch: ChunkBatch,
        ack: Ack,
        /// Publish the stored chunks on the hub (the writer does, at once) instead of handing
        /// them back: a batch handed on ahead of the log (RS-11).
        publish: bool,
    },
    /// A cancel waits for what every attempt handed on: commit what is queued now, and tell
    /// the ack once that commit is settled ([`ChunkWriter::settle_handed_on`]).
    Flush(oneshot::Sender<()>),
    /// An attempt waits for what it handed on ([`ChunkWriter::flush`]): commit its batches now.
    /// Other streams' batches held for [`UNFOLLOWED_HOLD`] stay held (decision 124).
    FlushOf(uuid::Uuid),
    /// An attempt about to write its stream's outcome takes back the batches it handed on that
    /// the writer still holds, to store them with that outcome (decision 126).
    TakeBack(Lease, oneshot::Sender<TakenBack>),
    /// The outcome write of an attempt that took batches back is settled ([`EndingWrite`]).
    Settled(uuid::Uuid),
}

/// What an attempt took back from the writer ([`ChunkWriter::take_back`]).
#[derive(Debug)]
pub(super) struct TakenBack {
    /// Its held batches, in order: consecutive seqs of its attempt, not yet stored.
    pub(super) batches: Vec<ChunkBatch>,
    /// How many of its hand-ons they hold: the newest ones, whose [`Pending`] will never be
    /// answered.
    pub(super) handed: usize,
    /// Held until the outcome write that stores them is settled; `None` when nothing was taken.
    pub(super) ending: Option<EndingWrite>,
}

/// Held by an attempt that took its batches back while it writes its outcome with them; when
/// dropped, tells the writer that write is settled. Until then a cancel's
/// [`ChunkWriter::settle_handed_on`] waits for it, as it waits for what the writer holds:
/// those events were shown to the stream's clients, and the usage they carry is billed (LC-9).
#[derive(Debug)]
pub(super) struct EndingWrite {
    queue: mpsc::UnboundedSender<Queued>,
    /// Wakes a hold: a settle may wait for this.
    urgent: Arc<Notify>,
    id: uuid::Uuid,
}

impl Drop for EndingWrite {
    fn drop(&mut self) {
        if self.queue.send(Queued::Settled(self.id)).is_ok() {
            self.urgent.notify_one();
        }
    }
}

/// Longest time the writer holds a commit open for more batches while nobody waits on it
/// (issue 30): at most the last commit's duration, so a fast disk holds briefly.
const MAX_HOLD: Duration = Duration::from_millis(2);

/// Longest time the writer holds a commit open while, besides, no positioned reader follows
/// any of its streams (DU-7): only the streams' own clients read them, and they took every
/// event ahead of the log (RS-11). The log of such a stream lags it by at most this much, and a
/// stream's batches handed on meanwhile are stored as one (one fenced seq reservation and one
/// publish for several events; docs/benchmarks.md, lever 6). A positioned reader that starts
/// following, a batch of a stream one follows, an attempt that waits and a stream's ending
/// each shorten or end the hold.
const UNFOLLOWED_HOLD: Duration = Duration::from_millis(50);

/// Handle to the writer task. Cloning is cheap; the task ends when the last handle is dropped.
#[derive(Clone, Debug)]
pub struct ChunkWriter {
    queue: mpsc::UnboundedSender<Queued>,
    /// Ends a hold: someone waits on the next commit. Batches handed on during a hold only
    /// queue up, without waking the writer for each (issue 30).
    urgent: Arc<Notify>,
    /// Shortens a long hold to a short one: a batch was handed on of a stream that a
    /// positioned reader follows (DU-7).
    followed: Arc<Notify>,
    /// Where positioned readers subscribe: whether one follows a stream.
    hub: Arc<Hub>,
}

/// A batch handed to the writer by [`ChunkWriter::hand_on`], until it is committed.
#[derive(Debug)]
pub(super) struct Pending {
    done: oneshot::Receiver<Result<Option<Vec<Chunk>>, Arc<StoreError>>>,
    /// The batch's events and data bytes: what it holds of the attempt's window (RS-11).
    pub(super) events: usize,
    pub(super) bytes: usize,
}

impl Pending {
    /// Waits for the batch's commit.
    ///
    /// # Errors
    /// [`AppendError`]: lease lost, database failure, or writer stopped.
    pub(super) async fn stored(self) -> Result<(), AppendError> {
        answer(self.done.await).map(drop)
    }

    /// The batch's commit, if it has been answered: `None` while it waits.
    pub(super) fn try_stored(&mut self) -> Option<Result<(), AppendError>> {
        match self.done.try_recv() {
            Err(oneshot::error::TryRecvError::Empty) => None,
            Ok(answered) => Some(answer(Ok(answered)).map(drop)),
            Err(oneshot::error::TryRecvError::Closed) => Some(Err(AppendError::Stopped)),
        }
    }
}

/// What the writer answered, as an append's result.
fn answer(
    answered: Result<Result<Option<Vec<Chunk>>, Arc<StoreError>>, oneshot::error::RecvError>,
) -> Result<Vec<Chunk>, AppendError> {
    match answered {
        Ok(Ok(Some(chunks))) => Ok(chunks),
        Ok(Ok(None)) => Err(AppendError::LeaseLost),
        Ok(Err(e)) => Err(AppendError::Store(e)),
        Err(_) => Err(AppendError::Stopped),
    }
}

/// Why an append did not store anything.
#[derive(Debug, thiserror::Error)]
pub enum AppendError {
    /// The attempt no longer holds its lease (LC-3).
    #[error("the attempt's lease was lost")]
    LeaseLost,
    /// The database failed, tried again for the whole retry window.
    #[error("storing chunks failed: {0}")]
    Store(Arc<StoreError>),
    /// The writer task is gone (shutting down).
    #[error("the chunk writer stopped")]
    Stopped,
}

impl ChunkWriter {
    /// Starts the writer task over `store`. A failed commit is tried again for `retry_for`
    /// (`write_retry_secs`, at least a lease length) before its batches are failed.
    pub fn spawn(store: DynStore, retry_for: Duration) -> ChunkWriter {
        ChunkWriter::spawn_over(store, Hub::new(), retry_for)
    }

    /// [`ChunkWriter::spawn`], publishing handed-on batches on `hub` once committed.
    /// `readers_elsewhere`: positioned readers may follow this node's streams from other nodes
    /// (a store several nodes share, DU-3), which `hub` does not count, so no commit is held
    /// longer than [`MAX_HOLD`] (DU-7).
    pub(crate) fn spawn_publishing(
        store: DynStore,
        hub: Arc<Hub>,
        retry_for: Duration,
        readers_elsewhere: bool,
    ) -> ChunkWriter {
        ChunkWriter::spawn_holding(store, hub, retry_for, !readers_elsewhere)
    }

    /// [`ChunkWriter::spawn`] over anything that appends chunks (a test's scripted store).
    fn spawn_over(store: impl Appends, hub: Arc<Hub>, retry_for: Duration) -> ChunkWriter {
        ChunkWriter::spawn_holding(store, hub, retry_for, true)
    }

    /// [`ChunkWriter::spawn_over`]; `hold_unfollowed`: whether a commit of streams no
    /// positioned reader on this node follows may be held for [`UNFOLLOWED_HOLD`] (DU-7).
    fn spawn_holding(
        store: impl Appends,
        hub: Arc<Hub>,
        retry_for: Duration,
        hold_unfollowed: bool,
    ) -> ChunkWriter {
        let (queue, rx) = mpsc::unbounded_channel();
        let urgent = Arc::new(Notify::new());
        let followed = Arc::new(Notify::new());
        let signals = Signals {
            urgent: Arc::clone(&urgent),
            followed: Arc::clone(&followed),
            hold_unfollowed,
        };
        let endings = Endings {
            queue: queue.downgrade(),
            urgent: Arc::clone(&urgent),
            writing: HashSet::new(),
            flushes: Vec::new(),
        };
        tokio::spawn(run(
            store,
            Arc::clone(&hub),
            rx,
            signals,
            endings,
            retry_for,
        ));
        ChunkWriter {
            queue,
            urgent,
            followed,
            hub,
        }
    }

    /// Stores `batch` (in a shared transaction with whatever else is queued) and returns the
    /// stored chunks with their seqs, unpublished.
    ///
    /// # Errors
    /// [`AppendError`]: lease lost, database failure, or writer stopped.
    pub async fn append(&self, batch: ChunkBatch) -> Result<Vec<Chunk>, AppendError> {
        let (ack, done) = oneshot::channel();
        self.queue
            .send(Queued::Batch {
                batch,
                ack,
                publish: false,
            })
            .map_err(|_| AppendError::Stopped)?;
        self.urgent.notify_one();
        answer(done.await)
    }

    /// Hands `batch` to the writer without waiting for its commit (RS-11): the writer
    /// publishes its chunks on the hub once they are stored; [`Pending`] tells the attempt when.
    ///
    /// # Errors
    /// [`AppendError::Stopped`] when the writer is gone.
    pub(super) fn hand_on(&self, batch: ChunkBatch) -> Result<Pending, AppendError> {
        let (ack, done) = oneshot::channel();
        let events = batch.chunks.len();
        let bytes = batch.chunks.iter().map(|c| c.data.len()).sum();
        let followed = self.hub.log_followed(batch.lease.id);
        self.queue
            .send(Queued::Batch {
                batch,
                ack,
                publish: true,
            })
            .map_err(|_| AppendError::Stopped)?;
        // After the batch is queued: the writer takes what is queued only after it listens.
        if followed {
            self.followed.notify_waiters();
        }
        Ok(Pending {
            done,
            events,
            bytes,
        })
    }

    /// Asks the writer to commit what request `id`'s attempt handed on without holding it
    /// open for more: the attempt is about to wait for it.
    pub(super) fn flush(&self, id: uuid::Uuid) {
        let _ = self.queue.send(Queued::FlushOf(id));
        self.urgent.notify_one();
    }

    /// Takes back what the attempt of `lease` handed on and the writer still holds (decision
    /// 126): the attempt stores it with its outcome, one commit instead of two. Nothing is
    /// taken when a settle asked for the commit those batches are in (LC-9). `None` when the
    /// writer is gone.
    pub(super) async fn take_back(&self, lease: &Lease) -> Option<TakenBack> {
        let (reply, taken) = oneshot::channel();
        self.queue
            .send(Queued::TakeBack(lease.clone(), reply))
            .ok()?;
        // Heard during a hold, which goes on for the other streams.
        self.urgent.notify_one();
        taken.await.ok()
    }

    /// Commits what is queued now and returns once that commit is settled (stored, or failed
    /// for good): every batch handed on before the call has then been tried, stored by the
    /// writer or with its attempt's outcome (an attempt that took its batches back). A cancel waits for
    /// it, so that the usage its attempt's streams have already shown is stored before the
    /// cancel fences the attempt out (LC-9, RD-9). Returns at once when the writer is gone.
    pub(super) async fn settle_handed_on(&self) {
        let (ack, settled) = oneshot::channel();
        if self.queue.send(Queued::Flush(ack)).is_err() {
            return;
        }
        self.urgent.notify_one();
        let _ = settled.await;
    }
}

/// What the writer needs of a store: [`Store::append_chunks`](crate::store::Store::append_chunks).
trait Appends: Send + Sync + 'static {
    /// Appends `batches` in one commit; `awaited`: someone waits on it besides positioned
    /// readers (else the store may hold the commit for more, DU-7).
    fn append_chunks<'a>(
        &'a self,
        batches: &'a [ChunkBatch],
        awaited: bool,
    ) -> BoxFuture<'a, Result<Vec<Option<Vec<Chunk>>>, StoreError>>;
}

impl Appends for DynStore {
    fn append_chunks<'a>(
        &'a self,
        batches: &'a [ChunkBatch],
        awaited: bool,
    ) -> BoxFuture<'a, Result<Vec<Option<Vec<Chunk>>>, StoreError>> {
        if awaited {
            self.as_ref().append_chunks(batches)
        } else {
            self.as_ref().append_chunks_unawaited(batches)
        }
    }
}

/// One commit of `batches`, timed in `holdfast_chunk_commit_seconds` when it stored them.
async fn append_timed(
    store: &impl Appends,
    batches: &[ChunkBatch],
    awaited: bool,
) -> Result<Vec<Option<Vec<Chunk>>>, StoreError> {
    let started = std::time::Instant::now();
    let result = store.append_chunks(batches, awaited).await;
    if result.is_ok() {
        metrics::histogram!(m::CHUNK_COMMIT_SECONDS).record(started.elapsed().as_secs_f64());
    }
    result
}

/// What the writer's next commit stores.
#[derive(Default)]
struct Group {
    batches: Vec<ChunkBatch>,
    /// For each batch, whom to tell (more than one when a stream's batches were stored as one)
    /// and whether its chunks are published on the hub (handed on ahead of the log, RS-11).
    acks: Vec<(Vec<Ack>, bool)>,
    /// Each stream's last handed-on batch in `batches`, which the stream's next may join.
    last_of: HashMap<uuid::Uuid, usize>,
    /// Told once the group is settled; dropped (which tells them too) at the end of each round.
    flushes: Vec<oneshot::Sender<()>>,
    /// The streams whose attempts wait on the group's commit (their ending, their window, an
    /// appended batch); with `flushes`, every stream does.
    waited_by: Vec<uuid::Uuid>,
    /// A settle ([`Queued::Flush`]) asked for this round's commit: everything in the group is
    /// committed in it, none of it split off or taken back (LC-9).
    settling: bool,
}

/// What the writer keeps across commits of the batches attempts took back (decision 126).
struct Endings {
    /// The writer's own queue, for the [`EndingWrite`]s it hands out; weak, so that the
    /// writer still ends with its last handle.
    queue: mpsc::WeakUnboundedSender<Queued>,
    /// What an [`EndingWrite`] wakes.
    urgent: Arc<Notify>,
    /// Requests whose attempt took batches back and has not settled its outcome write.
    writing: HashSet<uuid::Uuid>,
    /// Settle flushes ([`Queued::Flush`]) waiting for some of those, with whom they wait for.
    flushes: Vec<(HashSet<uuid::Uuid>, oneshot::Sender<()>)>,
}

impl Group {
    /// Adds `queued`; whether someone waits on the group's commit besides positioned readers.
    /// A batch handed on right after the same attempt's last one in the group joins it (DU-7):
    /// one seq reservation and one publish for both. A batch that names the provider's ids
    /// stays apart, as does an appended one (a stream's ending, answered with its chunks).
    fn take(&mut self, queued: Queued, endings: &mut Endings) -> bool {
        let (batch, ack, publish) = match queued {
            Queued::Batch {
                batch,
                ack,
                publish,
            } => (batch, ack, publish),
            // A settle waits, besides this commit, for the outcome writes holding batches
            // that attempts took back before it (LC-9).
            Queued::Flush(ack) if endings.writing.is_empty() => {
                self.settling = true;
                self.flushes.push(ack);
                return true;
            }
            Queued::Flush(ack) => {
                self.settling = true;
                endings.flushes.push((endings.writing.clone(), ack));
                return true;
            }
            Queued::FlushOf(id) => {
                self.waited_by.push(id);
                return true;
            }
            Queued::Settled(id) => {
                endings.writing.remove(&id);
                let mut released = false;
                for (mut waits_for, ack) in std::mem::take(&mut endings.flushes) {
                    waits_for.remove(&id);
                    if waits_for.is_empty() {
                        // Told once this round's commit is settled, which it need not wait for.
                        self.flushes.push(ack);
                        released = true;
                    } else {
                        endings.flushes.push((waits_for, ack));
                    }
                }
                return released;
            }
            Queued::TakeBack(lease, reply) => {
                let id = lease.id;
                let (batches, handed) = if self.settling {
                    (Vec::new(), 0)
                } else {
                    self.take_back(&lease)
                };
                let ending = if batches.is_empty() {
                    None
                } else {
                    endings.queue.upgrade().map(|queue| EndingWrite {
                        queue,
                        urgent: Arc::clone(&endings.urgent),
                        id,
                    })
                };
                let tracked = ending.is_some();
                match reply.send(TakenBack {
                    batches,
                    handed,
                    ending,
                }) {
                    Ok(()) if tracked => {
                        endings.writing.insert(id);
                    }
                    Ok(()) => {}
                    // The attempt is gone: what it handed on is committed here after all.
                    Err(taken) => self.restore(taken),
                }
                return false;
            }
        };
        let id = batch.lease.id;
        if !publish {
            self.waited_by.push(id);
            self.last_of.remove(&id);
        } else if batch.upstream_request_id.is_none()
            && batch.response_id.is_none()
            && let Some(&i) = self.last_of.get(&id)
            && let last = &mut self.batches[i]
            && last.lease == batch.lease
            && i64::try_from(last.chunks.len()).is_ok_and(|n| last.after + n == batch.after)
        {
            last.chunks.extend(batch.chunks);
            if batch.usage.is_some() {
                last.usage = batch.usage;
            }
            self.acks[i].0.push(ack);
            return false;
        }
        self.push(batch, (vec![ack], publish));
        !publish
    }

    /// Takes the held batches of `lease`'s attempt out of the group (decision 126): its
    /// handed-on batches, in order, and how many hand-ons they answer for. Nothing when a batch
    /// of its request in the group is an appended one or another attempt's (not its to take).
    fn take_back(&mut self, lease: &Lease) -> (Vec<ChunkBatch>, usize) {
        let id = lease.id;
        let mut its = self
            .batches
            .iter()
            .zip(&self.acks)
            .filter(|(batch, _)| batch.lease.id == id)
            .map(|(batch, (_, publish))| *publish && batch.lease == *lease)
            .peekable();
        if its.peek().is_none() || !its.all(|its_own| its_own) {
            return (Vec::new(), 0);
        }
        let taken = self.take_out(|batch| batch.lease.id == id);
        self.waited_by.retain(|waiting| *waiting != id);
        let handed = taken.acks.iter().map(|(acks, _)| acks.len()).sum();
        (taken.batches, handed)
    }

    /// Puts back batches an attempt took back and did not receive (it is gone).
    fn restore(&mut self, taken: TakenBack) {
        for batch in taken.batches {
            self.push(batch, (Vec::new(), true));
        }
    }

    /// Adds `batch` at the end, with whom to tell; a handed-on one is its stream's last.
    fn push(&mut self, batch: ChunkBatch, acks: (Vec<Ack>, bool)) {
        if acks.1 {
            self.last_of.insert(batch.lease.id, self.batches.len());
        }
        self.batches.push(batch);
        self.acks.push(acks);
    }

    /// Moves the batches `out` picks, in order, into a group of their own, and keeps the rest.
    fn take_out(&mut self, mut out: impl FnMut(&ChunkBatch) -> bool) -> Group {
        let (mut taken, mut kept) = (Group::default(), Group::default());
        for (batch, acks) in self.batches.drain(..).zip(self.acks.drain(..)) {
            let to = if out(&batch) { &mut taken } else { &mut kept };
            to.push(batch, acks);
        }
        self.batches = kept.batches;
        self.acks = kept.acks;
        self.last_of = kept.last_of;
        taken
    }

    /// Splits off the batches of the streams whose attempts wait (decision 124), when only
    /// some streams wait and others' batches are in the group too: those stay, held. `None`
    /// when the whole group is to be committed.
    fn split_waited(&mut self) -> Option<Group> {
        if self.settling
            || self.waited_by.is_empty()
            || self
                .batches
                .iter()
                .all(|b| self.waited_by.contains(&b.lease.id))
        {
            return None;
        }
        let waited_by = std::mem::take(&mut self.waited_by);
        Some(self.take_out(|batch| waited_by.contains(&batch.lease.id)))
    }

    /// Takes what is queued now, up to [`MAX_BATCHES_PER_COMMIT`]; whether any of it is waited on.
    fn take_queued(
        &mut self,
        rx: &mut mpsc::UnboundedReceiver<Queued>,
        endings: &mut Endings,
    ) -> bool {
        let mut awaited = false;
        while self.batches.len() < MAX_BATCHES_PER_COMMIT {
            match rx.try_recv() {
                Ok(queued) => awaited |= self.take(queued, endings),
                Err(_) => break,
            }
        }
        awaited
    }
}

/// What shortens or ends the writer's hold ([`ChunkWriter`]).
struct Signals {
    urgent: Arc<Notify>,
    followed: Arc<Notify>,
    /// Whether the hub sees every positioned reader: else a reader on another node may
    /// follow any stream, and no hold is long.
    hold_unfollowed: bool,
}

/// Why a [`hold`] ended.
#[derive(Debug, PartialEq, Eq)]
enum Held {
    /// Its time is out.
    Out,
    /// Someone may wait on the commit: what is queued says who.
    Urgent,
    /// A positioned reader started following a stream.
    Joined,
}

/// DU-7: holds the commit of a group nobody waits on open for more, from `started`, as long as
/// `long` says; what arrives meanwhile queues up. Returns early when someone may wait on the
/// commit (`urgent`), or a positioned reader starts following a stream (`joined`); a batch
/// handed on of a followed stream (`followed`) shortens a long hold to `short` and clears
/// `long`. `joined` and `followed` listen from before the group took what was queued, so
/// nothing falls between.
async fn hold(
    urgent: &Notify,
    mut followed: Pin<&mut Notified<'_>>,
    mut joined: Pin<&mut Notified<'_>>,
    long: &mut bool,
    started: tokio::time::Instant,
    short: Duration,
) -> Held {
    let mut until = started + if *long { UNFOLLOWED_HOLD } else { short };
    loop {
        tokio::select! {
            () = tokio::time::sleep_until(until) => return Held::Out,
            () = urgent.notified() => return Held::Urgent,
            () = joined.as_mut(), if *long => return Held::Joined,
            () = followed.as_mut(), if *long => {
                *long = false;
                until = until.min(started + short);
            }
        }
    }
}

async fn run(
    store: impl Appends,
    hub: Arc<Hub>,
    mut rx: mpsc::UnboundedReceiver<Queued>,
    signals: Signals,
    mut endings: Endings,
    retry_for: Duration,
) {
    let mut group = Group::default();
    // Set while commits fail: one window from the first failure covers every group that
    // fails meanwhile, so no stream waits longer than that window for the database.
    let mut failing: Option<WriteRetry> = None;
    // How long the last commit took: what a hold may add.
    let mut last_commit = Duration::ZERO;
    // When the group's hold began: the batches a split left held stay held until its end.
    let mut held_since = tokio::time::Instant::now();
    loop {
        // Whether someone waits on this commit: an appended batch, or a flush.
        let mut awaited = false;
        if group.batches.is_empty() {
            let Some(queued) = rx.recv().await else {
                break;
            };
            awaited = group.take(queued, &mut endings);
            held_since = tokio::time::Instant::now();
        }
        let followed = signals.followed.notified();
        let joined = hub.log_reader_joined();
        tokio::pin!(followed, joined);
        followed.as_mut().enable();
        joined.as_mut().enable();
        awaited |= group.take_queued(&mut rx, &mut endings);
        // Only handed-on batches wait, and only positioned readers wait on them: hold the
        // commit open for more, so that a commit carries many events (issue 30), and longer
        // while no positioned reader follows any of these streams (DU-7). What is handed on
        // meanwhile queues up without waking the writer; an awaited append or a flush ends
        // the hold.
        let mut long =
            signals.hold_unfollowed && !group.batches.iter().any(|b| hub.log_followed(b.lease.id));
        if !awaited && !group.batches.is_empty() && group.batches.len() < MAX_BATCHES_PER_COMMIT {
            let short = last_commit.min(MAX_HOLD);
            loop {
                let held = hold(
                    &signals.urgent,
                    followed.as_mut(),
                    joined.as_mut(),
                    &mut long,
                    held_since,
                    short,
                )
                .await;
                awaited |= group.take_queued(&mut rx, &mut endings);
                // A wake left by a flush the group took already, or by a take-back, says
                // nothing: hold on, unless nothing is left to hold.
                if awaited
                    || held != Held::Urgent
                    || group.batches.is_empty()
                    || group.batches.len() >= MAX_BATCHES_PER_COMMIT
                {
                    break;
                }
            }
        }
        if group.batches.is_empty() {
            group.flushes.clear();
            group.waited_by.clear();
            group.settling = false;
            continue;
        }
        // Decision 124: when only some streams' attempts wait (their ending, their window),
        // their batches are committed now and the others' stay held to the end of a long hold;
        // once it is over, they go with them (else flushes that keep coming would hold them on).
        let split = long && held_since.elapsed() < UNFOLLOWED_HOLD;
        let mut commit = match split.then(|| group.split_waited()).flatten() {
            // The waiting streams' batches were committed while their flushes were queued:
            // nothing to commit, and the rest holds on.
            Some(waited) if waited.batches.is_empty() => continue,
            Some(waited) => waited,
            None => std::mem::take(&mut group),
        };
        let started = tokio::time::Instant::now();
        let mut result = append_timed(&store, &commit.batches, awaited).await;
        if let Err(e) = &result
            && is_transient(e)
        {
            let retry = failing.get_or_insert_with(|| WriteRetry::new(retry_for));
            let mut tries = 1;
            if retry.is_spent() {
                warn!(error = %e, batches = commit.batches.len(), "chunk commit failed, and commits have failed for a lease length");
            } else {
                warn!(error = %e, batches = commit.batches.len(), "chunk commit failed; retrying");
            }
            while retry.wait().await {
                // Batches whose attempt has ended (its lease lost meanwhile) are not worth a try.
                let open: Vec<_> = commit
                    .batches
                    .drain(..)
                    .zip(commit.acks.drain(..))
                    .filter(|(_, (acks, _))| acks.iter().any(|ack| !ack.is_closed()))
                    .collect();
                (commit.batches, commit.acks) = open.into_iter().unzip();
                if commit.batches.is_empty() {
                    break;
                }
                tries += 1;
                metrics::counter!(m::ATTEMPT_WRITE_RETRIES, "write" => "chunks").increment(1);
                // A retry commits at once: these batches have waited a failure already.
                result = append_timed(&store, &commit.batches, true).await;
                match &result {
                    Ok(_) => break,
                    Err(e) if is_transient(e) => {
                        debug!(error = %e, tries, "chunk commit failed again");
                    }
                    Err(_) => break,
                }
            }
            match &result {
                Ok(_) => info!(tries, "chunk commit stored after retries"),
                Err(e) => warn!(error = %e, tries, "chunk commit failed; giving up its batches"),
            }
        }
        last_commit = started.elapsed();
        match result {
            Ok(stored) => {
                failing = None;
                for (((acks, publish), chunks), batch) in
                    commit.acks.drain(..).zip(stored).zip(&commit.batches)
                {
                    // A dropped receiver is an attempt that was abandoned meanwhile.
                    match chunks {
                        Some(chunks) if publish => {
                            let id = batch.lease.id;
                            hub.publish(id, HubEvent::Logged(Arc::new(chunks)));
                            for ack in acks {
                                let _ = ack.send(Ok(Some(Vec::new())));
                            }
                        }
                        chunks => {
                            let mut acks = acks.into_iter();
                            let last = acks.next_back();
                            for ack in acks {
                                let _ = ack.send(Ok(chunks.clone()));
                            }
                            if let Some(ack) = last {
                                let _ = ack.send(Ok(chunks));
                            }
                        }
                    }
                }
            }
            Err(e) => {
                let acks: Vec<Ack> = commit.acks.drain(..).flat_map(|(acks, _)| acks).collect();
                metrics::counter!(m::ATTEMPT_WRITES_ABANDONED, "write" => "chunks")
                    .increment(acks.len() as u64);
                let e = Arc::new(e);
                for ack in acks {
                    let _ = ack.send(Err(Arc::clone(&e)));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::store::NewChunk;

    /// A store whose appends fail as `fail` says for each call (numbered from 1), and otherwise
    /// store every batch, each taking `took`; it keeps how many batches each call held.
    struct Scripted {
        fail: Box<dyn Fn(usize) -> Option<StoreError> + Send + Sync>,
        calls: Mutex<Vec<usize>>,
        /// Whether each call was awaited (else the store may hold it, DU-7).
        awaited: Mutex<Vec<bool>>,
        /// The chunks of each batch of each call.
        chunks: Mutex<Vec<Vec<usize>>>,
        called: Notify,
        took: Duration,
    }

    impl Appends for Arc<Scripted> {
        fn append_chunks<'a>(
            &'a self,
            batches: &'a [ChunkBatch],
            awaited: bool,
        ) -> BoxFuture<'a, Result<Vec<Option<Vec<Chunk>>>, StoreError>> {
            Box::pin(async move {
                self.awaited.lock().unwrap().push(awaited);
                self.chunks
                    .lock()
                    .unwrap()
                    .push(batches.iter().map(|b| b.chunks.len()).collect());
                let n = {
                    let mut calls = self.calls.lock().unwrap();
                    calls.push(batches.len());
                    calls.len()
                };
                self.called.notify_waiters();
                tokio::time::sleep(self.took).await;
                match (self.fail)(n) {
                    Some(e) => Err(e),
                    None => Ok(batches.iter().map(|b| Some(b.stored())).collect()),
                }
            })
        }
    }

    /// A store whose appends all succeed, each taking `took`.
    /// A writer over `store` that has made one commit: its next hold has a commit to measure
    /// itself by (DU-7).
    async fn after_a_first_commit(store: &Arc<Scripted>) -> ChunkWriter {
        let writer = ChunkWriter::spawn_over(Arc::clone(store), Hub::new(), Duration::from_secs(1));
        writer
            .hand_on(batch("first"))
            .unwrap()
            .stored()
            .await
            .unwrap();
        writer
    }

    fn taking(took: Duration) -> Arc<Scripted> {
        Arc::new(Scripted {
            took,
            ..Arc::into_inner(scripted(|_| None)).expect("not shared yet")
        })
    }

    fn scripted(
        fail: impl Fn(usize) -> Option<StoreError> + Send + Sync + 'static,
    ) -> Arc<Scripted> {
        Arc::new(Scripted {
            fail: Box::new(fail),
            calls: Mutex::default(),
            awaited: Mutex::default(),
            chunks: Mutex::default(),
            called: Notify::new(),
            took: Duration::ZERO,
        })
    }

    /// Issue 30: while only handed-on batches wait, a commit is held open for as long as the
    /// last one took (at most MAX_HOLD) and takes what arrives meanwhile; an attempt that
    /// waits (a flush) or an appended batch that ends a stream is committed at once.
    #[tokio::test(start_paused = true)]
    async fn a_commit_nobody_waits_on_is_held_open_for_more_and_a_flush_ends_the_hold_du7() {
        let store = taking(Duration::from_millis(1));
        let writer =
            ChunkWriter::spawn_over(Arc::clone(&store), Hub::new(), Duration::from_secs(1));
        let gap = Duration::from_micros(500);
        // The first commit has nothing to measure a hold by.
        writer.hand_on(batch("a")).unwrap().stored().await.unwrap();
        assert_eq!(calls(&store), vec![1]);
        // Held: a batch handed on 0.5 ms later joins the commit.
        let b = writer.hand_on(batch("b")).unwrap();
        tokio::time::sleep(gap).await;
        let c = writer.hand_on(batch("c")).unwrap();
        b.stored().await.unwrap();
        c.stored().await.unwrap();
        assert_eq!(calls(&store), vec![1, 2]);
        // A flush commits at once: the next batch gets a commit of its own.
        let d = batch("d");
        let id = d.lease.id;
        let d = writer.hand_on(d).unwrap();
        writer.flush(id);
        tokio::time::sleep(gap).await;
        let e = writer.hand_on(batch("e")).unwrap();
        d.stored().await.unwrap();
        e.stored().await.unwrap();
        assert_eq!(calls(&store), vec![1, 2, 1, 1]);
        // So does a batch that ends a stream (appended and waited for); another stream's
        // batch in the hold stays held (decision 124), committed on its own after it.
        let f = writer.hand_on(batch("f")).unwrap();
        writer.append(batch("g")).await.unwrap();
        assert_eq!(calls(&store), vec![1, 2, 1, 1, 1]);
        f.stored().await.unwrap();
        assert_eq!(calls(&store), vec![1, 2, 1, 1, 1, 1]);
        // DU-7: the store is told which commits only positioned readers wait on (it may hold
        // those): not the flushed one, nor the one with an appended batch.
        assert_eq!(
            *store.awaited.lock().unwrap(),
            vec![false, false, true, false, true, false]
        );
    }

    /// LC-9, RD-9: a cancel waits until what its attempt handed on is committed. Batches
    /// handed on during a held commit are committed before `settle_handed_on` returns, in the
    /// one commit it asks for at once; a later batch is not waited for.
    #[tokio::test(start_paused = true)]
    async fn settling_what_was_handed_on_commits_it_at_once_and_returns_after_that_commit_lc9_rd9()
    {
        let store = taking(Duration::from_millis(5));
        let writer =
            ChunkWriter::spawn_over(Arc::clone(&store), Hub::new(), Duration::from_secs(1));
        // A first commit, so that the next one is held open (for as long as this one took).
        writer.hand_on(batch("a")).unwrap().stored().await.unwrap();
        let mut b = writer.hand_on(batch("b")).unwrap();
        let mut c = writer.hand_on(batch("c")).unwrap();
        let started = tokio::time::Instant::now();
        let settle = writer.settle_handed_on();
        tokio::pin!(settle);
        // Once that commit has begun, a batch handed on is left for the next one.
        tokio::select! {
            () = &mut settle => panic!("settled before its commit began"),
            () = store.called.notified() => {}
        }
        let mut d = writer.hand_on(batch("d")).unwrap();
        settle.await;
        assert!(d.try_stored().is_none(), "d is not waited for");
        assert_eq!(
            calls(&store)[..2],
            [1, 2],
            "b and c in one commit, asked for at once"
        );
        assert!(
            matches!(b.try_stored(), Some(Ok(()))),
            "b is committed when it returns"
        );
        assert!(
            matches!(c.try_stored(), Some(Ok(()))),
            "c is committed when it returns"
        );
        assert_eq!(
            started.elapsed(),
            Duration::from_millis(5),
            "the commit's own time, no hold before it"
        );
        // Only the commit asked for is awaited; d's may be held again, and is: the wake
        // that asked for the settled commit does not end d's hold.
        assert_eq!(calls(&store), vec![1, 2]);
        d.stored().await.unwrap();
        assert_eq!(calls(&store), vec![1, 2, 1]);
        assert_eq!(*store.awaited.lock().unwrap(), vec![false, true, false]);
        // With nothing handed on, it returns without a commit.
        writer.settle_handed_on().await;
        assert_eq!(calls(&store), vec![1, 2, 1]);
    }

    /// A batch of one event for `lease`, following seq `after`.
    fn next_of(lease: &Lease, after: i64, text: &str) -> ChunkBatch {
        ChunkBatch {
            lease: lease.clone(),
            after,
            ..batch(text)
        }
    }

    /// DU-7: while no positioned reader follows a stream, its commit is held for up to
    /// UNFOLLOWED_HOLD, and the batches it hands on meanwhile are stored as one; a batch that
    /// does not follow the last (another attempt, a gap) stays apart.
    #[tokio::test(start_paused = true)]
    async fn a_streams_batches_handed_on_while_no_reader_follows_it_are_held_longer_and_stored_as_one_du7()
     {
        let store = taking(Duration::from_millis(1));
        let writer =
            ChunkWriter::spawn_over(Arc::clone(&store), Hub::new(), Duration::from_secs(1));
        let lease = batch("a").lease;
        writer
            .hand_on(next_of(&lease, 0, "a"))
            .unwrap()
            .stored()
            .await
            .unwrap();
        let started = tokio::time::Instant::now();
        let b = writer.hand_on(next_of(&lease, 1, "b")).unwrap();
        // Past the short hold (at most 2 ms), within the long one.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let c = writer.hand_on(next_of(&lease, 2, "c")).unwrap();
        let other = writer.hand_on(batch("other")).unwrap();
        let gap = writer.hand_on(next_of(&lease, 9, "gap")).unwrap();
        b.stored().await.unwrap();
        c.stored().await.unwrap();
        other.stored().await.unwrap();
        assert!(gap.stored().await.is_ok());
        assert_eq!(
            started.elapsed(),
            UNFOLLOWED_HOLD + Duration::from_millis(1),
            "held for the long hold, then committed"
        );
        assert_eq!(
            *store.chunks.lock().unwrap(),
            vec![vec![1], vec![2, 1, 1]],
            "b and c as one batch; another stream's and the one after a gap apart"
        );
    }

    /// DU-7, decision 124: an attempt that waits for what it handed on (its stream ends, or
    /// its window is full) gets its own batches committed at once; another stream's batches in
    /// the same long hold stay held to its end, and what that stream hands on meanwhile joins
    /// them.
    #[tokio::test(start_paused = true)]
    async fn a_streams_flush_commits_its_own_batches_and_leaves_the_others_held_du7() {
        let store = taking(Duration::from_millis(1));
        let writer = after_a_first_commit(&store).await;
        let started = tokio::time::Instant::now();
        let ending = batch("ending");
        let ending_id = ending.lease.id;
        let ending = writer.hand_on(ending).unwrap();
        let other = batch("other");
        let lease = other.lease.clone();
        let other = writer.hand_on(other).unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
        writer.flush(ending_id);
        ending.stored().await.unwrap();
        assert_eq!(
            started.elapsed(),
            Duration::from_millis(6),
            "committed when its attempt asked, in its own 1 ms"
        );
        let more = writer.hand_on(next_of(&lease, 1, "more")).unwrap();
        other.stored().await.unwrap();
        more.stored().await.unwrap();
        assert_eq!(
            started.elapsed(),
            UNFOLLOWED_HOLD + Duration::from_millis(1),
            "the other stream's batches held to the end of the hold"
        );
        assert_eq!(
            *store.chunks.lock().unwrap(),
            vec![vec![1], vec![1], vec![2]],
            "the flushed stream's batch alone; the other's two as one"
        );
    }

    /// DU-7, decision 124: the batches a split left held are committed at the end of their
    /// hold even while other streams' attempts keep waiting on every commit (their windows,
    /// their endings): a flush that comes after the hold is over takes the whole group, so an
    /// unfollowed stream's log lags it by at most the long hold and a commit.
    #[tokio::test(start_paused = true)]
    async fn held_batches_are_committed_at_the_end_of_their_hold_while_other_streams_keep_flushing_du7()
     {
        let commit = Duration::from_millis(10);
        let store = taking(commit);
        let writer = after_a_first_commit(&store).await;
        let started = tokio::time::Instant::now();
        let held = writer.hand_on(batch("held")).unwrap();
        // Another stream whose attempt waits on the log twice per commit, for 300 ms.
        let flusher = tokio::spawn({
            let writer = writer.clone();
            let lease = batch("x").lease;
            async move {
                for after in 0..60 {
                    let pending = writer.hand_on(next_of(&lease, after, "x")).unwrap();
                    writer.flush(lease.id);
                    drop(pending);
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        });
        held.stored().await.unwrap();
        assert!(
            started.elapsed() <= UNFOLLOWED_HOLD + 2 * commit,
            "held {:?}: past the end of its hold and the commit then under way",
            started.elapsed()
        );
        flusher.await.unwrap();
    }

    /// DU-7, decision 124: a flush whose stream has nothing left in the group (its batches
    /// were committed while the flush was queued) commits nothing: no empty commit is timed,
    /// measured as the last commit's duration or taken as the end of a failure, and the
    /// others' batches stay held to the end of their hold.
    #[tokio::test(start_paused = true)]
    async fn a_flush_of_a_stream_with_nothing_in_the_group_makes_no_empty_commit_du7() {
        let store = taking(Duration::from_millis(1));
        let writer =
            ChunkWriter::spawn_over(Arc::clone(&store), Hub::new(), Duration::from_secs(1));
        let flushed = batch("flushed");
        let id = flushed.lease.id;
        writer.hand_on(flushed).unwrap().stored().await.unwrap();
        let started = tokio::time::Instant::now();
        let other = writer.hand_on(batch("other")).unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
        writer.flush(id);
        other.stored().await.unwrap();
        assert_eq!(
            started.elapsed(),
            UNFOLLOWED_HOLD + Duration::from_millis(1),
            "the other stream's batch held to the end of its hold"
        );
        assert_eq!(calls(&store), vec![1, 1], "no commit of nothing");
    }

    /// DU-7: a stream a positioned reader follows keeps the short hold (at most the last
    /// commit's duration), also when it joins a long hold begun for other streams; and a reader
    /// that starts following ends a long hold at once.
    #[tokio::test(start_paused = true)]
    async fn a_stream_a_positioned_reader_follows_is_committed_within_the_short_hold_du7() {
        let store = taking(Duration::from_millis(1));
        let hub = Hub::new();
        let writer =
            ChunkWriter::spawn_over(Arc::clone(&store), Arc::clone(&hub), Duration::from_secs(1));
        writer.hand_on(batch("a")).unwrap().stored().await.unwrap();
        let followed = batch("followed");
        let _reader = hub.subscribe(followed.lease.id);
        let started = tokio::time::Instant::now();
        writer.hand_on(followed).unwrap().stored().await.unwrap();
        assert_eq!(
            started.elapsed(),
            Duration::from_millis(2),
            "the last commit's 1 ms of hold, and its own 1 ms"
        );

        // A long hold begun for a stream nobody follows, joined by one somebody does.
        let started = tokio::time::Instant::now();
        let unfollowed = writer.hand_on(batch("unfollowed")).unwrap();
        tokio::time::sleep(Duration::from_micros(500)).await;
        let also = batch("also followed");
        let _also_reader = hub.subscribe(also.lease.id);
        let also = writer.hand_on(also).unwrap();
        also.stored().await.unwrap();
        unfollowed.stored().await.unwrap();
        assert_eq!(started.elapsed(), Duration::from_millis(2), "shortened");

        // A long hold, ended by a reader that starts following.
        let started = tokio::time::Instant::now();
        let later = batch("later");
        let id = later.lease.id;
        let later = writer.hand_on(later).unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
        let _late_reader = hub.subscribe(id);
        later.stored().await.unwrap();
        assert_eq!(
            started.elapsed(),
            Duration::from_millis(6),
            "ended when the reader came, 5 ms in"
        );
        assert_eq!(calls(&store), vec![1, 1, 2, 1]);
    }

    /// DU-7: where positioned readers may follow from other nodes (PostgreSQL, DU-3), which
    /// this node's hub does not count, a commit nobody here follows keeps the short hold: a
    /// `GET /requests/{id}` stream on another node gets each chunk within a commit, not 50 ms
    /// later.
    #[tokio::test(start_paused = true)]
    async fn where_readers_may_follow_from_another_node_no_commit_is_held_long_du7() {
        let store = taking(Duration::from_millis(1));
        let writer = ChunkWriter::spawn_holding(
            Arc::clone(&store),
            Hub::new(),
            Duration::from_secs(1),
            false,
        );
        let lease = batch("a").lease;
        writer
            .hand_on(next_of(&lease, 0, "a"))
            .unwrap()
            .stored()
            .await
            .unwrap();
        let started = tokio::time::Instant::now();
        writer
            .hand_on(next_of(&lease, 1, "b"))
            .unwrap()
            .stored()
            .await
            .unwrap();
        assert_eq!(
            started.elapsed(),
            Duration::from_millis(2),
            "the last commit's 1 ms of hold, and its own 1 ms"
        );
    }

    fn calls(store: &Scripted) -> Vec<usize> {
        store.calls.lock().unwrap().clone()
    }

    fn unavailable() -> Option<StoreError> {
        Some(StoreError::Unavailable("the disk is full".into()))
    }

    fn batch(text: &str) -> ChunkBatch {
        ChunkBatch {
            lease: Lease {
                id: uuid::Uuid::now_v7(),
                owner: "node/attempt".into(),
                attempt: 1,
            },
            after: 0,
            chunks: vec![NewChunk {
                event: None,
                data: text.into(),
            }],
            upstream_request_id: None,
            response_id: None,
            usage: None,
        }
    }

    #[tokio::test]
    async fn a_commit_failing_for_a_whole_window_fails_its_batches_and_later_groups_get_one_try_decision37()
     {
        let store = scripted(|_| unavailable());
        let writer =
            ChunkWriter::spawn_over(Arc::clone(&store), Hub::new(), Duration::from_millis(500));
        let first = writer.append(batch("a")).await;
        assert!(matches!(first, Err(AppendError::Store(_))), "{first:?}");
        let tried = calls(&store).len();
        assert!(tried >= 2, "tried again within the window: {tried} tries");
        // The database has failed for a lease length: the next group is not held again.
        let second = writer.append(batch("b")).await;
        assert!(matches!(second, Err(AppendError::Store(_))), "{second:?}");
        assert_eq!(calls(&store).len(), tried + 1, "one try for the next group");
    }

    #[tokio::test]
    async fn a_commit_that_fails_then_succeeds_stores_its_batch_and_a_later_failure_gets_a_new_window_decision37()
     {
        let store = scripted(|n| {
            if n <= 2 || n == 4 {
                unavailable()
            } else {
                None
            }
        });
        // Long enough that the two quick tries after the first fit in it on a busy machine.
        let window = Duration::from_secs(1);
        let writer = ChunkWriter::spawn_over(Arc::clone(&store), Hub::new(), window);
        let stored = writer
            .append(batch("a"))
            .await
            .expect("stored on the third try");
        assert_eq!((stored[0].seq, &*stored[0].data), (1, "a"));
        assert_eq!(calls(&store).len(), 3);
        // Past the first failure's window: a success started the next failure's window anew.
        tokio::time::sleep(window + Duration::from_millis(200)).await;
        writer
            .append(batch("b"))
            .await
            .expect("stored on the second try");
        assert_eq!(calls(&store).len(), 5);
    }

    #[tokio::test]
    async fn a_commit_failing_for_a_reason_a_retry_cannot_mend_is_not_tried_again_decision37() {
        let store = scripted(|_| {
            Some(StoreError::Corrupt {
                id: None,
                what: "a route this version does not know".into(),
            })
        });
        let writer =
            ChunkWriter::spawn_over(Arc::clone(&store), Hub::new(), Duration::from_secs(30));
        let result = writer.append(batch("a")).await;
        assert!(matches!(result, Err(AppendError::Store(_))), "{result:?}");
        assert_eq!(calls(&store).len(), 1);
    }

    #[tokio::test]
    async fn a_batch_whose_attempt_ended_is_left_out_of_the_next_try_decision37() {
        let store = scripted(|n| if n == 1 { unavailable() } else { None });
        let writer =
            ChunkWriter::spawn_over(Arc::clone(&store), Hub::new(), Duration::from_secs(30));
        let called = store.called.notified();
        // Both batches are queued before the writer runs: one group.
        let gone = tokio::spawn({
            let writer = writer.clone();
            async move { writer.append(batch("gone")).await }
        });
        let kept = tokio::spawn({
            let writer = writer.clone();
            async move { writer.append(batch("kept")).await }
        });
        called.await;
        // The first try failed (or is failing); the attempt of "gone" ends meanwhile.
        gone.abort();
        let _ = gone.await;
        let stored = kept.await.unwrap().expect("stored on the second try");
        assert_eq!(&*stored[0].data, "kept");
        assert_eq!(
            calls(&store),
            [2, 1],
            "the second try held only the open batch"
        );
    }

    /// The data of each chunk of `batches`, in order.
    fn texts(batches: &[ChunkBatch]) -> Vec<String> {
        batches
            .iter()
            .flat_map(|b| b.chunks.iter().map(|c| c.data.to_string()))
            .collect()
    }

    /// Decision 126: an ending takes back what its attempt handed on and the writer still
    /// holds, in order, with how many hand-ons it answers for, and stores it with its outcome;
    /// another stream's batches stay held to the end of their hold and are committed without
    /// them. A stream with nothing held gets nothing back.
    #[tokio::test(start_paused = true)]
    async fn an_ending_takes_back_its_held_batches_and_the_others_stay_held_du7() {
        let store = taking(Duration::from_millis(1));
        let writer = after_a_first_commit(&store).await;
        let started = tokio::time::Instant::now();
        let ending = batch("first");
        let lease = ending.lease.clone();
        // `first` names the provider's request id, so it is held apart from what follows.
        let first = writer
            .hand_on(ChunkBatch {
                upstream_request_id: Some("req_1".into()),
                ..ending
            })
            .unwrap();
        let second = writer.hand_on(next_of(&lease, 1, "second")).unwrap();
        let third = writer.hand_on(next_of(&lease, 2, "third")).unwrap();
        let other = writer.hand_on(batch("other")).unwrap();
        let taken = writer.take_back(&lease).await.expect("writer running");
        assert_eq!(texts(&taken.batches), ["first", "second", "third"]);
        assert_eq!(
            taken.batches[0].upstream_request_id.as_deref(),
            Some("req_1")
        );
        assert_eq!(taken.handed, 3, "three hand-ons, never to be answered");
        assert!(taken.ending.is_some());
        for pending in [first, second, third] {
            assert!(matches!(pending.stored().await, Err(AppendError::Stopped)));
        }
        // The other stream's batch is held to the end of the long hold, then committed alone.
        other.stored().await.unwrap();
        assert_eq!(
            started.elapsed(),
            UNFOLLOWED_HOLD + Duration::from_millis(1),
            "the take-back did not end the other stream's hold"
        );
        assert_eq!(*store.chunks.lock().unwrap(), vec![vec![1], vec![1]]);
        // Nothing held: nothing taken, nothing to wait for.
        let nothing = writer.take_back(&lease).await.expect("writer running");
        assert!(nothing.batches.is_empty());
        assert_eq!(nothing.handed, 0);
        assert!(nothing.ending.is_none());
    }

    /// LC-9, decision 126: a cancel's settle waits, besides the commit it asks for, for the
    /// outcome write of an attempt that took its batches back before it — those events were
    /// shown, their usage billed — and returns once that write is settled, at once, not at
    /// the end of another stream's hold.
    #[tokio::test(start_paused = true)]
    async fn a_settle_waits_for_an_outcome_write_holding_batches_taken_back_before_it_lc9() {
        let store = taking(Duration::from_millis(1));
        let writer = after_a_first_commit(&store).await;
        let ending = batch("ending");
        let lease = ending.lease.clone();
        let _pending = writer.hand_on(ending).unwrap();
        let taken = writer.take_back(&lease).await.expect("writer running");
        let writing = taken.ending.expect("taken back");
        let settle = writer.settle_handed_on();
        tokio::pin!(settle);
        tokio::select! {
            () = &mut settle => panic!("settled while the outcome write was not"),
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
        // Another stream's batch, held for the long hold, when the write settles.
        let other = writer.hand_on(batch("other")).unwrap();
        drop(writing);
        tokio::time::timeout(Duration::from_millis(2), settle)
            .await
            .expect("settled once the outcome write was");
        assert!(other.stored().await.is_ok());
        // A later settle does not wait for it again.
        tokio::time::timeout(Duration::from_secs(1), writer.settle_handed_on())
            .await
            .expect("nothing to wait for");
    }

    /// Decision 126: batches taken back by an attempt that is gone before it received them
    /// are put back, and committed at the end of their hold as if never taken.
    #[tokio::test(start_paused = true)]
    async fn batches_taken_back_by_an_attempt_that_is_gone_are_committed_after_all_du7() {
        let store = taking(Duration::from_millis(1));
        let writer = after_a_first_commit(&store).await;
        let ending = batch("ending");
        let lease = ending.lease.clone();
        let _pending = writer.hand_on(ending).unwrap();
        let (reply, taken) = oneshot::channel();
        drop(taken);
        writer.queue.send(Queued::TakeBack(lease, reply)).unwrap();
        writer.urgent.notify_one();
        // Settled at the end of the hold, without waiting for an outcome write.
        tokio::time::timeout(UNFOLLOWED_HOLD * 2, writer.settle_handed_on())
            .await
            .expect("settled");
        assert_eq!(*store.chunks.lock().unwrap(), vec![vec![1], vec![1]]);
    }

    /// LC-9, decision 126 (review): a settle asked for before a take-back, in the same round,
    /// commits what was handed on before it; the take-back gets nothing, and the settle does
    /// not wait for that attempt's outcome write.
    #[tokio::test(start_paused = true)]
    async fn a_take_back_after_a_settle_takes_nothing_and_the_settle_commits_it_lc9() {
        let store = taking(Duration::from_millis(1));
        let writer = after_a_first_commit(&store).await;
        // A commit in flight, so that what follows reaches the writer in one round.
        let x = batch("in flight");
        let x_id = x.lease.id;
        let called = store.called.notified();
        tokio::pin!(called);
        called.as_mut().enable();
        let x = writer.hand_on(x).unwrap();
        writer.flush(x_id);
        called.await;
        let shown = batch("shown");
        let lease = shown.lease.clone();
        let shown = writer.hand_on(shown).unwrap();
        let settle = writer.settle_handed_on();
        tokio::pin!(settle);
        assert!(futures::poll!(settle.as_mut()).is_pending());
        let taken = writer.take_back(&lease).await.expect("writer running");
        assert!(taken.batches.is_empty() && taken.ending.is_none());
        assert_eq!(taken.handed, 0);
        tokio::time::timeout(Duration::from_millis(5), settle)
            .await
            .expect("settled with its commit");
        assert!(shown.stored().await.is_ok(), "the settle committed it");
        assert!(x.stored().await.is_ok());
    }

    /// LC-9, decision 126 (review): a settle that waits for another attempt's outcome write
    /// still has its own round's group committed whole: a stream's flush in that round does
    /// not leave another stream's batches held for a take-back the settle would not wait for.
    #[tokio::test(start_paused = true)]
    async fn a_settle_waiting_for_an_outcome_write_commits_its_whole_group_lc9() {
        let store = taking(Duration::from_millis(1));
        let writer = after_a_first_commit(&store).await;
        let b = batch("b");
        let b_lease = b.lease.clone();
        let _b = writer.hand_on(b).unwrap();
        let writing = writer
            .take_back(&b_lease)
            .await
            .expect("writer running")
            .ending
            .expect("taken back");
        let d = batch("d");
        let d_lease = d.lease.clone();
        let mut d = writer.hand_on(d).unwrap();
        let c = batch("c");
        let c_id = c.lease.id;
        let c = writer.hand_on(c).unwrap();
        let settle = writer.settle_handed_on();
        tokio::pin!(settle);
        assert!(futures::poll!(settle.as_mut()).is_pending());
        writer.flush(c_id);
        c.stored().await.unwrap();
        assert!(
            matches!(d.try_stored(), Some(Ok(()))),
            "d went with c, not held"
        );
        let taken = writer.take_back(&d_lease).await.expect("writer running");
        assert!(taken.batches.is_empty(), "nothing of d left to take");
        assert!(
            futures::poll!(settle.as_mut()).is_pending(),
            "b still writes"
        );
        drop(writing);
        tokio::time::timeout(Duration::from_millis(5), settle)
            .await
            .expect("settled once b's write was");
    }

    /// Decision 126: a take-back takes only its own attempt's batches; a batch of an earlier
    /// attempt of the same request (abandoned, still held) stays, and nothing is taken.
    #[tokio::test(start_paused = true)]
    async fn a_take_back_leaves_another_attempts_batches_of_the_request_du7() {
        let store = taking(Duration::from_millis(1));
        let writer = after_a_first_commit(&store).await;
        let old = batch("old");
        let new = ChunkBatch {
            lease: Lease {
                owner: "node/next".into(),
                attempt: 2,
                ..old.lease.clone()
            },
            ..batch("new")
        };
        let new_lease = new.lease.clone();
        let old = writer.hand_on(old).unwrap();
        let _new = writer.hand_on(new).unwrap();
        let taken = writer.take_back(&new_lease).await.expect("writer running");
        assert!(taken.batches.is_empty() && taken.ending.is_none());
        assert!(
            old.stored().await.is_ok(),
            "the earlier attempt's batch is stored"
        );
    }
}
