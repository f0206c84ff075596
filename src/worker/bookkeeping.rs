//! The writes that follow an answer, coalesced (SPEC DU-6): the deliveries of a request
//! (submissions that attached to it or were replayed from its log) and the readers of its log.
//!
//! Counting each one with a write of its own put one statement per answered duplicate in the
//! database's queue, ahead of the submissions, leases, chunks and outcomes of every other
//! tenant: a client re-sending one body at c=64 stalled new work on PostgreSQL for seconds.
//! Here a count is added to an in-memory tally per request, and one task writes the whole tally
//! with one [`Store::add_counts`](crate::store::Store::add_counts) call at a time. While that
//! write runs, new counts gather for the next one; a failed write puts its counts back and is
//! tried again after a pause, so a database back from an outage still gets every count. On
//! PostgreSQL a row another write holds is skipped rather than waited for, and its counts go
//! into the next write: counting never waits on, nor deadlocks with, the work it counts.
//!
//! An attachment is a saved call once its request has finished (RD-9): the attempt that
//! finishes it counts those its row holds then, and a write here that adds attachments to a
//! request already finished counts those itself ([`AddedCounts::late`]), so a burst of
//! duplicates answered as the request finishes is counted whichever commit comes first.

use foldhash::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::warn;
use uuid::Uuid;

use crate::config::Config;
use crate::store::{AddedCounts, Counts, DynStore, ErrorType, RequestRecord};

/// Requests with counts not yet written, at most: past it, counts of further requests are
/// dropped (and warned about once per failing period) rather than grow memory without bound
/// during a long outage. Far above what one write interval gathers under any real load.
const MAX_PENDING: usize = 100_000;
/// Pause after a failed write before the counts are tried again.
const RETRY_AFTER: Duration = Duration::from_secs(1);
/// Pause before counts whose rows other writes held are tried again.
const BUSY_RETRY: Duration = Duration::from_millis(20);

/// What one write of the tally did.
enum Written {
    /// Every count is stored.
    All,
    /// Some rows were held by other writes: their counts were put back.
    Busy,
    /// The store failed: every count was put back.
    Failed,
}
/// How long shutdown waits for the last write.
const LAST_WRITE: Duration = Duration::from_secs(2);

/// The pending counts of this process, written by one background task.
#[derive(Debug, Default)]
pub(crate) struct Bookkeeping {
    pending: Mutex<HashMap<Uuid, Counts>>,
    /// Woken when counts are added.
    added: Notify,
    /// Whether the loss of a count past [`MAX_PENDING`] was warned about since the last
    /// successful write.
    warned_full: AtomicBool,
    /// Cancelled when the pool stops: the task ends ([`Bookkeeping::close`] writes what is left).
    closed: CancellationToken,
    /// Prices and backends, for the saved calls of late attachments; `None` in unit tests.
    config: Option<Arc<Config>>,
}

impl Bookkeeping {
    /// A tally and its writer task over `store`.
    pub(crate) fn spawn(store: DynStore, config: Arc<Config>) -> Arc<Bookkeeping> {
        let books = Arc::new(Bookkeeping {
            config: Some(config),
            ..Bookkeeping::default()
        });
        tokio::spawn(Arc::clone(&books).write_loop(store));
        books
    }

    /// Counts one delivery of request `id`: `replayed` (answered from its log after it ended)
    /// or attached (while it ran).
    pub(crate) fn delivery(&self, id: Uuid, replayed: bool) {
        self.add(id, |c| {
            if replayed {
                c.replayed += 1;
            } else {
                c.attached += 1;
            }
        });
    }

    /// Counts a reader of request `id`'s log as an event stream.
    pub(crate) fn log_read(&self, id: Uuid) {
        self.add(id, |c| c.log_reads += 1);
    }

    fn add(&self, id: Uuid, count: impl FnOnce(&mut Counts)) {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let full = pending.len() >= MAX_PENDING;
        match pending.get_mut(&id) {
            Some(c) => count(c),
            None if full => {
                drop(pending);
                if !self.warned_full.swap(true, Ordering::Relaxed) {
                    warn!(
                        max = MAX_PENDING,
                        "too many requests with unwritten delivery counts while the database \
                         fails; counts of further requests are lost until a write succeeds"
                    );
                }
                return;
            }
            None => {
                let mut c = Counts {
                    id,
                    ..Counts::default()
                };
                count(&mut c);
                pending.insert(id, c);
            }
        }
        drop(pending);
        self.added.notify_one();
    }

    /// Everything counted so far, taken out of the tally.
    fn take(&self) -> Vec<Counts> {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let mut counts: Vec<Counts> = pending.drain().map(|(_, c)| c).collect();
        // One order for every write: rows are locked in id order.
        counts.sort_unstable_by_key(|c| c.id);
        counts
    }

    /// Puts back `counts` that could not be written, adding to what came meanwhile.
    fn restore(&self, counts: Vec<Counts>) {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        for c in counts {
            let entry = pending.entry(c.id).or_insert(Counts {
                id: c.id,
                ..Counts::default()
            });
            entry.attached += c.attached;
            entry.replayed += c.replayed;
            entry.log_reads += c.log_reads;
        }
    }

    /// Writes what is pending with one store call; what it could not write is put back.
    async fn write(&self, store: &DynStore) -> Written {
        let counts = self.take();
        if counts.is_empty() {
            return Written::All;
        }
        match store.add_counts(&counts).await {
            Ok(AddedCounts { busy, late }) if busy.is_empty() => {
                self.warned_full.store(false, Ordering::Relaxed);
                self.count_late(store, &counts, &late).await;
                Written::All
            }
            Ok(AddedCounts { busy, late }) => {
                self.count_late(store, &counts, &late).await;
                self.warned_full.store(false, Ordering::Relaxed);
                self.restore(
                    counts
                        .into_iter()
                        .filter(|c| busy.contains(&c.id))
                        .collect(),
                );
                Written::Busy
            }
            Err(e) => {
                warn!(requests = counts.len(), error = %e, "could not write delivery counts; trying again");
                self.restore(counts);
                Written::Failed
            }
        }
    }

    /// Counts the saved calls of attachments added to requests that had already finished
    /// (`late`, each with its attachments before), which the attempt that finished them could
    /// not count (RD-9).
    async fn count_late(&self, store: &DynStore, counts: &[Counts], late: &[(Uuid, u32)]) {
        let Some(config) = &self.config else { return };
        for (record, saved) in late_savings(store, counts, late).await {
            crate::ledger::count_saved(
                config,
                &record.backend,
                record.model.as_deref(),
                u64::from(saved),
                &record.usage,
            );
        }
    }

    async fn write_loop(self: Arc<Self>, store: DynStore) {
        loop {
            tokio::select! {
                () = self.added.notified() => {}
                () = self.closed.cancelled() => break,
            }
            let pause = match self.write(&store).await {
                Written::All => continue,
                Written::Busy => BUSY_RETRY,
                Written::Failed => RETRY_AFTER,
            };
            tokio::select! {
                () = tokio::time::sleep(pause) => {}
                () = self.closed.cancelled() => break,
            }
            // Counts put back wait for no new one to be tried again.
            self.added.notify_one();
        }
    }

    /// Stops the writer task and writes what is pending one last time (shutdown).
    pub(crate) async fn close(&self, store: &DynStore) {
        self.closed.cancel();
        let _ = tokio::time::timeout(LAST_WRITE, self.write(store)).await;
    }
}

/// The requests of late attachments ([`AddedCounts::late`]) and the calls those saved.
async fn late_savings(
    store: &DynStore,
    counts: &[Counts],
    late: &[(Uuid, u32)],
) -> Vec<(RequestRecord, u32)> {
    let mut saved = Vec::new();
    for &(id, before) in late {
        let Some(added) = counts.iter().find(|c| c.id == id).map(|c| c.attached) else {
            continue;
        };
        match store.get_any(id).await {
            // A request the sweep failed stays out of the counter, as its attachments that
            // came in time do (docs/usage.md).
            Ok(Some(record))
                if record
                    .error
                    .as_ref()
                    .is_some_and(|e| e.kind == ErrorType::LeaseExpired) => {}
            Ok(Some(record)) => {
                let calls = record.saved_calls_of_late_attachments(before, added);
                saved.push((record, calls));
            }
            Ok(None) => {}
            Err(e) => {
                warn!(request = %id, error = %e, "could not read a request to count its saved calls");
            }
        }
    }
    saved
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RD-9, DU-6: attachments whose count is written after their request finished are saved
    /// calls, counted by that write (the attempt that finished it saw none of them).
    #[tokio::test]
    async fn attachments_written_after_their_request_finished_are_saved_calls_rd9_du6() {
        use crate::store::sqlite::scratch;
        use crate::store::{LeaseTo, NewRequest, Outcome, Submitted};

        let dir = tempfile::tempdir().expect("tempdir");
        let store: DynStore = Arc::new(scratch(dir.path()).await);
        let lease_to = LeaseTo {
            owner: "test/1",
            lease_ms: 60_000,
        };
        let (Submitted::Created(created), Some(lease)) = store
            .submit_and_lease(NewRequest::example(1, 1_000), Some(lease_to))
            .await
            .expect("submit")
        else {
            panic!("a new, leased request");
        };
        let books = Bookkeeping::default();
        books.delivery(created.id, false);
        let counts = books.take();
        let added = store.add_counts(&counts).await.expect("add");
        assert!(
            late_savings(&store, &counts, &added.late).await.is_empty(),
            "written while it ran: the attempt that finishes it counts it"
        );
        let outcome = Outcome::Succeeded {
            status: 200,
            body: b"{}".to_vec(),
            upstream_request_id: None,
            response_id: None,
            usage: None,
        };
        assert!(store.finish(&lease, outcome, 2_000).await.expect("finish"));
        for _ in 0..3 {
            books.delivery(created.id, false);
        }
        books.delivery(created.id, true);
        let counts = books.take();
        let added = store.add_counts(&counts).await.expect("add");
        let saved = late_savings(&store, &counts, &added.late).await;
        assert_eq!(saved.len(), 1);
        assert_eq!(saved[0].0.id, created.id);
        assert_eq!(
            saved[0].1, 3,
            "three attachments after the outcome, one attempt"
        );
    }

    #[test]
    fn counts_of_a_request_add_up_and_a_failed_write_puts_them_back_du6() {
        let books = Bookkeeping::default();
        let (a, b) = (Uuid::now_v7(), Uuid::now_v7());
        books.delivery(a, true);
        books.delivery(a, true);
        books.delivery(a, false);
        books.log_read(b);
        let taken = books.take();
        assert_eq!(
            taken,
            [
                Counts {
                    id: a,
                    attached: 1,
                    replayed: 2,
                    log_reads: 0
                },
                Counts {
                    id: b,
                    attached: 0,
                    replayed: 0,
                    log_reads: 1
                },
            ],
            "one entry per request, in id order"
        );
        assert!(books.take().is_empty(), "taken out");
        // The write failed; one more replay came meanwhile.
        books.delivery(a, true);
        books.restore(taken);
        let again = books.take();
        assert_eq!(again[0].replayed, 3);
        assert_eq!(again[0].attached, 1);
        assert_eq!(again[1].log_reads, 1);
    }
}
