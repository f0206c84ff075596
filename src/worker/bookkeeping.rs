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

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::warn;
use uuid::Uuid;

use crate::store::{Counts, DynStore};

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
}

impl Bookkeeping {
    /// A tally and its writer task over `store`.
    pub(crate) fn spawn(store: DynStore) -> Arc<Bookkeeping> {
        let books = Arc::new(Bookkeeping::default());
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
            Ok(busy) if busy.is_empty() => {
                self.warned_full.store(false, Ordering::Relaxed);
                Written::All
            }
            Ok(busy) => {
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

#[cfg(test)]
mod tests {
    use super::*;

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
