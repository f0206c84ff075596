//! A node's slots shared between namespaces: worker slots for attempts (SPEC LC-2a) and
//! delivery slots for webhook tries (CB-7). Each configured namespace has a share of them it
//! gets first; what the shares leave is lent to the oldest due work of any namespace, but for
//! what is kept free while more than one namespace is configured ([`Keep`]). Work in flight
//! cannot be taken back, so this is what keeps one tenant's flood, or its slow provider or
//! receiver, from holding the slot another tenant needs.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

use crate::config::Namespace;
use crate::store::LeaseQuota;

/// What a pool keeps free of what it lends while more than one namespace is configured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Keep {
    /// A share's worth, for the next namespace to come (CB-7): a webhook try ends within
    /// `timeout_ms`, so any further namespace waits at most that for a slot.
    OneShare,
    /// Every configured namespace's unused share, but never more than `concurrency` less one
    /// share (LC-2a): an attempt may run for minutes, so each namespace's share is held for
    /// it, and at least a share's worth can always be lent (to a namespace over its share, or
    /// one no longer configured).
    EveryUnusedShare,
}

/// The slots of one pool (`concurrency` of them) and what each namespace holds of them on this
/// node. Cloned handles share the counts.
#[derive(Clone)]
pub(crate) struct NamespaceSlots {
    shared: Arc<Shared>,
}

struct Shared {
    /// Work in flight per namespace; only counted when [`Shared::one_pool`] is false.
    running: Mutex<HashMap<String, usize>>,
    /// The configured namespaces, each once, `default` without `[[namespaces]]`.
    namespaces: Vec<String>,
    /// Each namespace's share: `concurrency_per_namespace`, at most `concurrency`.
    share: usize,
    /// The pool's size.
    concurrency: usize,
    /// What is kept free of what is lent.
    keep: Keep,
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
struct Counted {
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

    /// The free slots nothing is lent from while `running` runs: one share's worth, or every
    /// namespace's unused share, at most `concurrency` less one share ([`Keep`]).
    fn kept(&self, running: &HashMap<String, usize>) -> usize {
        match self.keep {
            Keep::OneShare => self.share,
            Keep::EveryUnusedShare => self
                .namespaces
                .iter()
                .map(|n| {
                    self.share
                        .saturating_sub(running.get(n).copied().unwrap_or(0))
                })
                .sum::<usize>()
                .min(self.concurrency - self.share),
        }
    }
}

impl NamespaceSlots {
    /// `concurrency` slots, each of `namespaces` (none: `default` alone; a name configured
    /// twice is one namespace) with a share of `per_namespace` of them, keeping `keep` free.
    pub(crate) fn new(
        concurrency: usize,
        per_namespace: usize,
        namespaces: &[Namespace],
        keep: Keep,
    ) -> NamespaceSlots {
        let mut names: Vec<String> = Vec::new();
        for n in namespaces {
            if !names.contains(&n.name) {
                names.push(n.name.clone());
            }
        }
        if names.is_empty() {
            names.push("default".to_string());
        }
        let share = per_namespace.min(concurrency);
        NamespaceSlots {
            shared: Arc::new(Shared {
                running: Mutex::default(),
                one_pool: names.len() < 2 || share >= concurrency,
                namespaces: names,
                share,
                concurrency,
                keep,
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
    /// share, or while more slots are free than are kept ([`Keep`]). `None` otherwise.
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
        if held >= shared.share && permits.available_permits() <= shared.kept(&running) {
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
    fn count(&self, namespace: &str) -> Counted {
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
    /// does not fill (they count towards what is kept free): each configured namespace up to
    /// its share less its work in flight, then what is left, to the oldest due of any
    /// namespace (one no longer configured too), but for what [`Keep`] keeps free. One pool:
    /// the oldest due, whatever their namespace.
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
        let kept = shared.kept(&running);
        match shared.keep {
            // A share's worth beyond what the shares take.
            Keep::OneShare => LeaseQuota {
                shares,
                limit: free,
                keep_free: kept.saturating_sub(also_free),
                lend_cap: usize::MAX,
            },
            // What the unused shares hold, whatever the shares take of it.
            Keep::EveryUnusedShare => LeaseQuota {
                shares,
                limit: free,
                keep_free: 0,
                lend_cap: (free + also_free).saturating_sub(kept),
            },
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

    /// CB-7: with several namespaces, each gets its share first and a share's worth is kept
    /// free of what is lent; a namespace at its share starts nothing at admission once only
    /// that worth is free, while another still does.
    #[test]
    fn each_namespace_gets_its_share_and_a_shares_worth_is_kept_free_cb7() {
        let slots = NamespaceSlots::new(6, 2, &namespaces(&["a", "b"]), Keep::OneShare);
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

    /// LC-2a: every namespace's unused share is held for it, so with two namespaces over
    /// their shares a third still finds its own free; at least a share's worth can always be
    /// lent, so with shares that add up to every slot a namespace no longer configured is
    /// still run. (With one share's worth kept, as CB-7 keeps, the third waited for a slot to
    /// free.)
    #[test]
    fn every_unused_share_is_held_for_its_namespace_but_a_shares_worth_is_always_lendable_lc2a() {
        let slots =
            NamespaceSlots::new(8, 2, &namespaces(&["a", "b", "c"]), Keep::EveryUnusedShare);
        let permits = Arc::new(Semaphore::new(8));
        let quota = slots.quota(8, 0);
        assert_eq!(
            quota.lendable(0),
            2,
            "b's and c's shares are held: {quota:?}"
        );
        let mut held: Vec<Slot> = Vec::new();
        while let Some(slot) = slots.try_slot(&permits, "a") {
            held.push(slot);
        }
        assert_eq!(held.len(), 4, "a: its share and the 2 no share holds");
        held.extend((0..2).map(|_| slots.try_slot(&permits, "b").expect("b's share")));
        assert!(slots.try_slot(&permits, "b").is_none(), "c's share is held");
        assert_eq!(slots.quota(2, 0).lendable(0), 0);
        let c = slots.try_slot(&permits, "c").expect("c's share is free");
        drop(c);
        drop(held);

        // Shares that add up to every slot: a share's worth is still lent.
        let slots = NamespaceSlots::new(4, 2, &namespaces(&["a", "b"]), Keep::EveryUnusedShare);
        let quota = slots.quota(4, 0);
        assert_eq!(quota.lendable(0), 2, "{quota:?}");
        let quota = slots.quota(1, 3);
        assert_eq!(
            quota.lendable(0),
            1,
            "free slots beyond the lease count: {quota:?}"
        );
    }

    /// LC-2a, CB-7: a namespace configured twice is one namespace: its share is asked for
    /// once (twice, SQLite's lease chose its requests twice and ran each in two attempts), and
    /// with no other namespace there is one pool.
    #[test]
    fn a_namespace_configured_twice_is_one_namespace_lc2a_cb7() {
        let slots =
            NamespaceSlots::new(6, 2, &namespaces(&["a", "b", "a"]), Keep::EveryUnusedShare);
        assert_eq!(
            slots.quota(6, 0).shares,
            vec![("a".to_string(), 2), ("b".to_string(), 2)]
        );
        let slots = NamespaceSlots::new(6, 2, &namespaces(&["a", "a"]), Keep::OneShare);
        assert!(!slots.shared_by_namespaces());
        let quota = LeaseQuota {
            shares: vec![("a".into(), 2), ("b".into(), 1), ("a".into(), 2)],
            limit: 4,
            keep_free: 0,
            lend_cap: usize::MAX,
        };
        assert_eq!(
            quota.nonzero_shares().collect::<Vec<_>>(),
            vec![("a", 2), ("b", 1)]
        );
    }

    /// LC-2a, CB-7: one namespace, or a share of every slot, is one pool: nothing kept free,
    /// nothing counted.
    #[test]
    fn one_namespace_or_a_share_of_every_slot_is_one_pool_lc2a_cb7() {
        for keep in [Keep::OneShare, Keep::EveryUnusedShare] {
            for slots in [
                NamespaceSlots::new(4, 2, &[], keep),
                NamespaceSlots::new(4, 8, &namespaces(&["a", "b"]), keep),
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
    }

    /// CB-7: a lease that fills some of the free slots counts the others towards the share's
    /// worth kept free: a leaser taking a batch of permits still lends what is beyond it.
    #[test]
    fn slots_free_beyond_a_lease_count_towards_what_is_kept_free_cb7() {
        let slots = NamespaceSlots::new(10, 3, &namespaces(&["a", "b"]), Keep::OneShare);
        let quota = slots.quota(4, 2);
        assert_eq!((quota.keep_free, quota.lendable(0)), (1, 3), "{quota:?}");
        let quota = slots.quota(4, 5);
        assert_eq!((quota.keep_free, quota.lendable(0)), (0, 4), "{quota:?}");
    }
}
