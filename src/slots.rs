//! A node's slots shared between namespaces: worker slots for attempts (SPEC LC-2a) and
//! delivery slots for webhook tries (CB-7). Each configured namespace has a share of them it
//! gets first; what the shares leave is lent to the oldest due work of any namespace, but for a
//! share's worth kept free while more than one namespace is configured. Work in flight cannot
//! be taken back, so this is what keeps one tenant's flood, or its slow provider or receiver,
//! from holding the slot the next tenant needs.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

use crate::config::Namespace;
use crate::store::LeaseQuota;

/// The slots of one pool (`concurrency` of them) and what each namespace holds of them on this
/// node. Cloned handles share the counts.
#[derive(Clone)]
pub(crate) struct NamespaceSlots {
    shared: Arc<Shared>,
}

struct Shared {
    /// Work in flight per namespace; only counted when [`Shared::one_pool`] is false.
    running: Mutex<HashMap<String, usize>>,
    /// The configured namespaces, `default` without `[[namespaces]]`.
    namespaces: Vec<String>,
    /// Each namespace's share: `concurrency_per_namespace`, at most `concurrency`.
    share: usize,
    /// All work shares one pool, oldest due first: fewer than two namespaces, or a share of
    /// every slot.
    one_pool: bool,
    /// Set while a lease left due work for a slot to free ([`NamespaceSlots::wait_for_a_slot`]).
    waiting: AtomicBool,
    /// Told when work ends while [`Shared::waiting`] is set.
    freed: Notify,
    /// Counted work ended so far: a wait that begins after some ended returns at once.
    ended: AtomicU64,
}

/// One piece of work counted against its namespace while it lives.
pub(crate) struct Counted {
    shared: Arc<Shared>,
    namespace: String,
}

impl Drop for Counted {
    fn drop(&mut self) {
        {
            let mut running = self.shared.running();
            if let Some(n) = running.get_mut(&self.namespace) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    running.remove(&self.namespace);
                }
            }
        }
        self.shared.ended.fetch_add(1, Ordering::SeqCst);
        if self.shared.waiting.swap(false, Ordering::SeqCst) {
            self.shared.freed.notify_one();
        }
    }
}

/// A slot taken: its permit of the pool's semaphore and, when namespaces share the pool, its
/// count against its namespace. Dropped when the work ends.
pub(crate) struct Slot {
    _permit: OwnedSemaphorePermit,
    _counted: Option<Counted>,
}

impl Shared {
    fn running(&self) -> std::sync::MutexGuard<'_, HashMap<String, usize>> {
        self.running.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The slots a lease lends none of while the shares leave them free.
    fn keep_free(&self) -> usize {
        if self.one_pool { 0 } else { self.share }
    }
}

impl NamespaceSlots {
    /// `concurrency` slots, each of `namespaces` (none: `default` alone) with a share of
    /// `per_namespace` of them.
    pub(crate) fn new(
        concurrency: usize,
        per_namespace: usize,
        namespaces: &[Namespace],
    ) -> NamespaceSlots {
        let namespaces: Vec<String> = if namespaces.is_empty() {
            vec!["default".to_string()]
        } else {
            namespaces.iter().map(|n| n.name.clone()).collect()
        };
        let share = per_namespace.min(concurrency);
        NamespaceSlots {
            shared: Arc::new(Shared {
                running: Mutex::default(),
                one_pool: namespaces.len() < 2 || share >= concurrency,
                namespaces,
                share,
                waiting: AtomicBool::new(false),
                freed: Notify::new(),
                ended: AtomicU64::new(0),
            }),
        }
    }

    /// The slot `permit` gives work of `namespace`, counted against it.
    pub(crate) fn slot(&self, permit: OwnedSemaphorePermit, namespace: &str) -> Slot {
        Slot {
            _permit: permit,
            _counted: (!self.shared.one_pool).then(|| self.count(namespace)),
        }
    }

    /// A free slot of `permits` for work of `namespace` started outside a lease (an attempt
    /// at admission, decision 20), on a lease's terms: while the namespace holds less than its
    /// share, or more than a share's worth is free. `None` otherwise.
    pub(crate) fn try_slot(&self, permits: &Arc<Semaphore>, namespace: &str) -> Option<Slot> {
        let shared = &self.shared;
        if shared.one_pool {
            return Arc::clone(permits)
                .try_acquire_owned()
                .ok()
                .map(|permit| Slot {
                    _permit: permit,
                    _counted: None,
                });
        }
        // Checked and taken under the counts' lock, so two admissions never both take the
        // last slot a share keeps free.
        let mut running = shared.running();
        let held = running.get(namespace).copied().unwrap_or(0);
        if held >= shared.share && permits.available_permits() <= shared.keep_free() {
            return None;
        }
        let permit = Arc::clone(permits).try_acquire_owned().ok()?;
        *running.entry(namespace.to_string()).or_default() += 1;
        drop(running);
        Some(Slot {
            _permit: permit,
            _counted: Some(Counted {
                shared: Arc::clone(shared),
                namespace: namespace.to_string(),
            }),
        })
    }

    /// Counts one piece of work of `namespace` until the result is dropped.
    pub(crate) fn count(&self, namespace: &str) -> Counted {
        *self
            .shared
            .running()
            .entry(namespace.to_string())
            .or_default() += 1;
        Counted {
            shared: Arc::clone(&self.shared),
            namespace: namespace.to_string(),
        }
    }

    /// What a lease filling `free` slots may take, with `also_free` more slots free that it
    /// does not fill (they count towards the share's worth kept free): each configured
    /// namespace up to its share less its work in flight, then what is left, to the oldest due
    /// of any namespace (one no longer configured too), but for a share's worth kept free.
    /// One pool: the oldest due, whatever their namespace.
    pub(crate) fn quota(&self, free: usize, also_free: usize) -> LeaseQuota {
        let shared = &self.shared;
        if shared.one_pool {
            return LeaseQuota::any(free);
        }
        let running = shared.running();
        let shares = shared
            .namespaces
            .iter()
            .map(|namespace| {
                let held = running.get(namespace).copied().unwrap_or(0);
                (
                    namespace.clone(),
                    shared.share.saturating_sub(held).min(free),
                )
            })
            .collect();
        LeaseQuota {
            shares,
            limit: free,
            keep_free: shared.keep_free().saturating_sub(also_free),
        }
    }

    /// Whether namespaces share the slots (else one pool, oldest first).
    pub(crate) fn shared_by_namespaces(&self) -> bool {
        !self.shared.one_pool
    }

    /// How much counted work has ended: [`NamespaceSlots::wait_for_a_slot`]'s mark.
    pub(crate) fn ended(&self) -> u64 {
        self.shared.ended.load(Ordering::SeqCst)
    }

    /// Waits until counted work ends after `since` (what [`NamespaceSlots::ended`] said before
    /// a lease that left due work waiting for a slot: a namespace over its share while only
    /// the kept share's worth is free). Work that ended since returns at once, so an end
    /// between the lease and this wait is not missed.
    pub(crate) async fn wait_for_a_slot(&self, since: u64) {
        let shared = &self.shared;
        shared.waiting.store(true, Ordering::SeqCst);
        if shared.ended.load(Ordering::SeqCst) != since {
            return;
        }
        shared.freed.notified().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn namespaces(names: &[&str]) -> Vec<Namespace> {
        names
            .iter()
            .map(|name| Namespace {
                name: (*name).into(),
                api_keys: vec![format!("key-{name}")],
                callback_url: None,
                callback_secrets: Vec::new(),
                callback_include_body: None,
                max_held_requests: None,
            })
            .collect()
    }

    /// LC-2a, CB-7: with several namespaces, each gets its share first and a share's worth is
    /// kept free of what is lent; a namespace at its share starts nothing at admission once
    /// only that worth is free, while another still does.
    #[test]
    fn each_namespace_gets_its_share_and_a_shares_worth_is_kept_free_lc2a_cb7() {
        let slots = NamespaceSlots::new(6, 2, &namespaces(&["a", "b"]));
        let permits = Arc::new(Semaphore::new(6));
        let quota = slots.quota(6, 0);
        assert_eq!(
            quota.shares,
            vec![("a".to_string(), 2), ("b".to_string(), 2)]
        );
        assert_eq!((quota.keep_free, quota.lendable(2)), (2, 2), "{quota:?}");
        let a: Vec<Slot> = (0..4)
            .map(|_| slots.try_slot(&permits, "a").expect("a slot for a"))
            .collect();
        assert!(
            slots.try_slot(&permits, "a").is_none(),
            "a holds its share and what was lent; the last two are b's share"
        );
        let quota = slots.quota(2, 0);
        assert_eq!(
            quota.shares,
            vec![("a".to_string(), 0), ("b".to_string(), 2)]
        );
        assert_eq!(quota.lendable(0), 0, "nothing is lent: {quota:?}");
        let b = slots.try_slot(&permits, "b").expect("b's share is free");
        drop(a);
        drop(b);
        assert_eq!(permits.available_permits(), 6);
        assert!(slots.shared.running().is_empty(), "every count ended");
    }

    /// LC-2a, CB-7: one namespace, or a share of every slot, is one pool: nothing kept free,
    /// nothing counted.
    #[test]
    fn one_namespace_or_a_share_of_every_slot_is_one_pool_lc2a_cb7() {
        for slots in [
            NamespaceSlots::new(4, 2, &[]),
            NamespaceSlots::new(4, 8, &namespaces(&["a", "b"])),
        ] {
            assert!(!slots.shared_by_namespaces());
            assert_eq!(slots.quota(3, 1), LeaseQuota::any(3));
            let permits = Arc::new(Semaphore::new(4));
            let taken: Vec<Slot> = (0..4)
                .map(|_| slots.try_slot(&permits, "a").expect("a slot"))
                .collect();
            assert_eq!(taken.len(), 4, "a namespace alone may use every slot");
            assert!(slots.shared.running().is_empty());
        }
    }

    /// A lease that fills some of the free slots counts the others towards the share's worth
    /// kept free: a dispatcher taking its batch of permits still lends what is beyond it.
    #[test]
    fn slots_free_beyond_a_lease_count_towards_what_is_kept_free_lc2a() {
        let slots = NamespaceSlots::new(10, 3, &namespaces(&["a", "b"]));
        let quota = slots.quota(4, 2);
        assert_eq!((quota.keep_free, quota.lendable(0)), (1, 3), "{quota:?}");
        let quota = slots.quota(4, 5);
        assert_eq!((quota.keep_free, quota.lendable(0)), (0, 4), "{quota:?}");
    }
}
