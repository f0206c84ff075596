//! Large request bodies, kept from stalling other namespaces' calls (LC-2b, decision 145).
//!
//! A body of a few megabytes (a prompt carrying images or documents) costs the node tens of
//! milliseconds of CPU to canonicalise and hash, and the log's writer as long again to store.
//! Done on the runtime's workers, which serve every namespace's calls and streams, and queued
//! without bound at the writer, a burst of them from one namespace held another's small call
//! for seconds. So a large body is canonicalised on the blocking pool ([`on_the_blocking_pool`]),
//! and each namespace admits at most one budget's worth of large bodies at a time
//! ([`LargeBodies::admit`]); the rest of its large calls wait behind its own, read (unread,
//! one would hold its HTTP/2 connection's window and the upload of the call it waits for).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::Config;

/// A body larger than this is large (LC-2b): 1 MiB.
pub(crate) const LARGE_BODY_BYTES: usize = 1 << 20;

/// Each configured namespace's budget of large bodies in admission on this node.
pub(crate) struct LargeBodies {
    /// The budget in bytes (`max_body_bytes`, at most `u32::MAX`).
    budget: u32,
    /// Each namespace's bytes of large bodies free to admit; fixed by the configuration.
    namespaces: HashMap<String, Arc<Semaphore>>,
    /// Each namespace's bytes of large bodies in memory, from their reading to their
    /// recording (LC-2c).
    in_memory: HashMap<String, Arc<AtomicU64>>,
    /// The most each namespace may hold in memory: [`IN_MEMORY_BUDGETS`] budgets.
    memory_cap: u64,
}

/// How many `max_body_bytes` of large bodies a namespace may hold in memory on a node (LC-2c):
/// one budget in admission and more read and waiting for it, without one tenant's burst
/// growing the node's memory by its count.
pub(crate) const IN_MEMORY_BUDGETS: u64 = 4;

impl LargeBodies {
    /// A budget of `max_body_bytes` for each of `config`'s namespaces (`default` when it has
    /// none, CLI-5).
    pub(crate) fn new(config: &Config) -> LargeBodies {
        let budget = u32::try_from(config.max_body_bytes).unwrap_or(u32::MAX);
        let namespaces = config
            .namespace_names()
            .into_iter()
            .map(|name| {
                let free = Arc::new(Semaphore::new(budget as usize));
                (name.to_owned(), free)
            })
            .collect();
        let in_memory = config
            .namespace_names()
            .into_iter()
            .map(|name| (name.to_owned(), Arc::new(AtomicU64::new(0))))
            .collect();
        LargeBodies {
            budget,
            namespaces,
            in_memory,
            memory_cap: u64::try_from(config.max_body_bytes)
                .unwrap_or(u64::MAX)
                .saturating_mul(IN_MEMORY_BUDGETS),
        }
    }

    /// Counts a large body of `bytes` (its declared length before it is read, else its length
    /// as read) against `namespace`'s memory until the returned hold is dropped; `Ok(None)` for
    /// a body of [`LARGE_BODY_BYTES`] or less, `Err(cap)` when the namespace already holds so
    /// much that this one would pass its cap (LC-2c).
    pub(crate) fn hold(&self, namespace: &str, bytes: u64) -> Result<Option<InMemory>, u64> {
        if bytes <= LARGE_BODY_BYTES as u64 {
            return Ok(None);
        }
        let Some(held) = self.in_memory.get(namespace) else {
            return Ok(None);
        };
        let cap = self.memory_cap;
        held.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |now| {
            now.checked_add(bytes).filter(|after| *after <= cap)
        })
        .map_err(|_| cap)?;
        Ok(Some(InMemory {
            held: Arc::clone(held),
            bytes,
        }))
    }

    /// Waits until `namespace` may admit a body of `bytes` and returns what holds its share of
    /// the budget until dropped; `None` at once for a body of [`LARGE_BODY_BYTES`] or less
    /// (LC-2b). A body over the whole budget takes all of it. Waiters are served in order.
    pub(crate) async fn admit(&self, namespace: &str, bytes: usize) -> Option<LargeAdmission> {
        if bytes <= LARGE_BODY_BYTES {
            return None;
        }
        let free = Arc::clone(self.namespaces.get(namespace)?);
        let wanted = u32::try_from(bytes).unwrap_or(u32::MAX).min(self.budget);
        let permit = match Arc::clone(&free).try_acquire_many_owned(wanted) {
            Ok(permit) => permit,
            Err(_) => {
                let gauge = metrics::gauge!(crate::metrics::LARGE_BODIES_WAITING, "namespace" => namespace.to_owned());
                gauge.increment(1.0);
                let _waiting = scopeguard(move || gauge.decrement(1.0));
                // The semaphore is never closed.
                free.acquire_many_owned(wanted).await.ok()?
            }
        };
        Some(LargeAdmission { _permit: permit })
    }
}

/// A large body's share of its namespace's budget, held until its submission is recorded.
pub(crate) struct LargeAdmission {
    _permit: OwnedSemaphorePermit,
}

/// A large body's bytes counted against its namespace's memory (LC-2c), until dropped.
pub(crate) struct InMemory {
    held: Arc<AtomicU64>,
    bytes: u64,
}

impl Drop for InMemory {
    fn drop(&mut self) {
        self.held.fetch_sub(self.bytes, Ordering::SeqCst);
    }
}

/// Runs `f` (a large body's canonicalisation and hash) on the blocking pool, so the runtime's
/// workers go on serving every other call meanwhile (LC-2b). For a small body a hand-off would
/// cost more than the work: its caller runs it in place.
pub(crate) async fn on_the_blocking_pool<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    match tokio::task::spawn_blocking(f).await {
        Ok(done) => done,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

/// Runs `f` when dropped: a waiter that is given up (its client gone) leaves the gauge too.
fn scopeguard(f: impl FnOnce()) -> impl Drop {
    struct Guard<F: FnOnce()>(Option<F>);
    impl<F: FnOnce()> Drop for Guard<F> {
        fn drop(&mut self) {
            if let Some(f) = self.0.take() {
                f();
            }
        }
    }
    Guard(Some(f))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A large body's canonicalisation leaves the runtime free: on a runtime of one thread,
    /// another task runs while it works (here: it waits for that task) (LC-2b).
    #[tokio::test(flavor = "current_thread")]
    async fn a_large_bodys_canonicalisation_leaves_the_runtime_to_other_calls_lc2b() {
        let (tell, told) = std::sync::mpsc::channel::<()>();
        let other = tokio::spawn(async move { tell.send(()).unwrap() });
        let work = on_the_blocking_pool(move || {
            told.recv_timeout(std::time::Duration::from_secs(20))
                .is_ok()
        });
        assert!(
            work.await,
            "another task of the runtime ran while the large body was worked on"
        );
        other.await.unwrap();
    }

    fn config(max_body_bytes: usize, names: &[&str]) -> Config {
        let namespace = |name: &&str| crate::config::Namespace {
            name: (*name).into(),
            api_keys: vec![format!("{name}-key")],
            callback_url: None,
            callback_secrets: Vec::new(),
            callback_include_body: None,
            max_held_requests: None,
        };
        Config {
            max_body_bytes,
            namespaces: names.iter().map(namespace).collect(),
            ..Config::default()
        }
    }

    /// A namespace admits at most its budget of large bodies at once; the next waits until
    /// one is recorded, while another namespace's large body and any small body go at once
    /// (LC-2b).
    #[tokio::test]
    async fn a_namespace_admits_one_budget_of_large_bodies_at_a_time_and_no_other_waits_lc2b() {
        let mib = 1 << 20;
        let large = LargeBodies::new(&config(3 * mib, &["team-a", "team-b"]));
        assert!(large.admit("team-a", LARGE_BODY_BYTES).await.is_none());
        let first = large.admit("team-a", 2 * mib).await.expect("a large body");
        let mut second = Box::pin(large.admit("team-a", 2 * mib));
        assert!(
            futures::poll!(second.as_mut()).is_pending(),
            "team-a's second large body waits for its first"
        );
        let other = large.admit("team-b", 2 * mib);
        assert!(
            futures::poll!(Box::pin(other)).is_ready(),
            "team-b's large body does not wait for team-a's"
        );
        assert!(
            futures::poll!(Box::pin(large.admit("team-a", 100))).is_ready(),
            "team-a's small body does not wait"
        );
        // A body over the whole budget takes all of it, and waits for it.
        let mut whole = Box::pin(large.admit("team-a", 64 * mib));
        drop(first);
        let second = second.await.expect("admitted once the first is recorded");
        assert!(futures::poll!(whole.as_mut()).is_pending());
        drop(second);
        assert!(whole.await.is_some());
        assert!(
            large.admit("nobody", 2 * mib).await.is_none(),
            "a namespace not configured has no budget to wait for"
        );
    }
}
