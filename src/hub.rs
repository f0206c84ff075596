//! In-process fan-out of request changes to waiting readers.
//!
//! The hub is only a wake-up: the store is the truth. A reader subscribes *before* it reads
//! the store, then re-reads after every signal, so a signal can never fall between its read and
//! its wait (SPEC RD-4). A lost or lagged signal costs latency, never correctness: readers also
//! re-read on a timer, so a reader on one node follows a request run by another even without
//! cross-node wake-ups; with PostgreSQL those arrive as LISTEN/NOTIFY through
//! [`Store::listen`](crate::store::Store::listen) notifications, which `app.rs` publishes here
//! as [`HubEvent::Changed`].

use foldhash::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::broadcast;
use uuid::Uuid;

use crate::store::{Chunk, RequestRecord};

/// What happened to a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum HubEvent {
    /// Status, attempts or result changed: re-read the record (and chunks).
    Changed,
    /// Chunks were stored (durably, before they are published), in seq order.
    Chunks(Arc<Vec<Chunk>>),
    /// An attempt handed these data chunks to the chunk writer: not yet committed, and maybe
    /// never (RS-11). Only a proxied stream takes them; every positioned reader waits for
    /// [`HubEvent::Logged`] (RD-4).
    Ahead(Arc<Handed>),
    /// Chunks handed on ahead of the log ([`HubEvent::Ahead`]) are now committed, in seq
    /// order. A reader treats them as [`HubEvent::Chunks`]; only those that may lack them are
    /// woken for them ([`Hub::subscribe_to_new`]).
    Logged(Arc<Vec<Chunk>>),
    /// This node's worker recorded an attempt's outcome: the record as that committed write
    /// left it, so a waiter can answer without reading it back, with the provider's headers
    /// that the answer came with (RS-5a). Anyone else treats it as [`HubEvent::Changed`].
    Settled(Arc<RequestRecord>, Option<crate::provider::PassedHeaders>),
}

/// Data chunks an attempt handed on ahead of their commit (RS-11).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Handed {
    /// In seq order.
    pub(crate) chunks: Vec<Chunk>,
    /// The provider's request id, with the attempt's first batch (RS-5).
    pub(crate) upstream_request_id: Option<String>,
    /// The provider's rate-limit and timing headers, with the attempt's first batch (RS-5a).
    pub(crate) passed_headers: Option<crate::provider::PassedHeaders>,
}

/// Per-request broadcast channels, created on first subscription and dropped with the last.
#[derive(Debug, Default)]
pub(crate) struct Hub {
    channels: Mutex<HashMap<Uuid, Channel>>,
    /// Woken whenever a subscription starts to take [`HubEvent::Logged`]: the chunk writer,
    /// holding a commit that no such reader waited on, commits it at once (DU-7).
    log_reader_joined: tokio::sync::Notify,
}

/// One request's channel.
#[derive(Debug)]
struct Channel {
    tx: broadcast::Sender<HubEvent>,
    /// Subscriptions that take [`HubEvent::Logged`]: while there are none it is not sent, so
    /// that a stream's own submitter, which took every event ahead, is not woken again for
    /// each commit (issue 30).
    log_readers: usize,
}

/// A reader's subscription to one request; unsubscribes on drop.
#[derive(Debug)]
pub(crate) struct Subscription {
    hub: Arc<Hub>,
    id: Uuid,
    rx: broadcast::Receiver<HubEvent>,
    /// Counted in the channel's `log_readers`: taken on a request that existed already, or
    /// lagged since. Otherwise it was taken before the request existed and has received every
    /// event of it.
    reads_log: bool,
}

/// Events a request's channel holds for its slowest reader. A reader further behind gets
/// [`HubEvent::Changed`] and re-reads the store, so this bounds memory, not correctness. Every
/// request (streamed or not) gets a channel while someone waits on it, allocated and zeroed at
/// subscription, so the capacity is also a per-request cost (docs/benchmarks-history.md).
const CHANNEL_CAPACITY: usize = 128;
/// [`CHANNEL_CAPACITY`] for a channel its request's submitter opens for a non-stream request,
/// which carries a few events (its outcome, a cancel; issue 30). A later reader shares it while
/// it lives: a non-stream request's log has no chunk but its `end`.
const ANSWER_CHANNEL_CAPACITY: usize = 8;

impl Hub {
    /// A new, empty hub.
    pub(crate) fn new() -> Arc<Hub> {
        Arc::new(Hub::default())
    }

    /// Subscribes to every event of request `id`.
    pub(crate) fn subscribe(self: &Arc<Self>, id: Uuid) -> Subscription {
        self.subscribe_as(id, false, CHANNEL_CAPACITY)
    }

    /// Subscribes to request `id` before it exists, so that no event of it can be missed: such
    /// a subscription is not woken for [`HubEvent::Logged`] (it took those chunks ahead, or
    /// reads them with the request's outcome) until it lags behind the channel. `stream` says
    /// whether the request streams: the channel of one that does not holds fewer events.
    pub(crate) fn subscribe_to_new(self: &Arc<Self>, id: Uuid, stream: bool) -> Subscription {
        let capacity = if stream {
            CHANNEL_CAPACITY
        } else {
            ANSWER_CHANNEL_CAPACITY
        };
        self.subscribe_as(id, true, capacity)
    }

    fn subscribe_as(
        self: &Arc<Self>,
        id: Uuid,
        from_creation: bool,
        capacity: usize,
    ) -> Subscription {
        let mut channels = self.channels.lock().unwrap_or_else(|e| e.into_inner());
        let channel = channels.entry(id).or_insert_with(|| Channel {
            tx: broadcast::channel(capacity).0,
            log_readers: 0,
        });
        let reads_log = !from_creation;
        channel.log_readers += usize::from(reads_log);
        if reads_log {
            self.log_reader_joined.notify_waiters();
        }
        Subscription {
            hub: Arc::clone(self),
            id,
            rx: channel.tx.subscribe(),
            reads_log,
        }
    }

    /// Publishes `event` to the subscribers of `id`, if there are any (for
    /// [`HubEvent::Logged`], any that take it).
    pub(crate) fn publish(&self, id: Uuid, event: HubEvent) {
        let channels = self.channels.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(channel) = channels.get(&id) {
            if matches!(event, HubEvent::Logged(_)) && channel.log_readers == 0 {
                return;
            }
            // No receivers left is not an error: the last one is about to unsubscribe.
            let _ = channel.tx.send(event);
        }
    }

    /// Whether a subscriber of `id` takes [`HubEvent::Logged`]: a positioned reader follows
    /// its log (RD-4), or a reader that lagged.
    pub(crate) fn log_followed(&self, id: Uuid) -> bool {
        let channels = self.channels.lock().unwrap_or_else(|e| e.into_inner());
        channels.get(&id).is_some_and(|c| c.log_readers > 0)
    }

    /// Resolves when a subscription next starts to take [`HubEvent::Logged`] (once polled or
    /// enabled: a subscription made before that is not seen).
    pub(crate) fn log_reader_joined(&self) -> tokio::sync::futures::Notified<'_> {
        self.log_reader_joined.notified()
    }

    /// Number of requests with at least one subscriber.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.channels
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }

    /// Whether no request has a subscriber.
    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Subscription {
    /// Waits for the next event. A lagged receiver gets [`HubEvent::Changed`], which makes the
    /// reader re-read the store, and from then on takes [`HubEvent::Logged`] too: events it
    /// missed may be waiting for their commit. A closed channel never happens while this
    /// subscription lives.
    pub(crate) async fn recv(&mut self) -> HubEvent {
        match self.rx.recv().await {
            Ok(event) => event,
            Err(broadcast::error::RecvError::Lagged(_)) => {
                if !self.reads_log {
                    self.reads_log = true;
                    let mut channels = self.hub.channels.lock().unwrap_or_else(|e| e.into_inner());
                    if let Some(channel) = channels.get_mut(&self.id) {
                        channel.log_readers += 1;
                    }
                    drop(channels);
                    self.hub.log_reader_joined.notify_waiters();
                }
                HubEvent::Changed
            }
            Err(broadcast::error::RecvError::Closed) => std::future::pending().await,
        }
    }

    /// Whether this subscription was taken before its request existed and has received every
    /// event of it since ([`Hub::subscribe_to_new`]): what the store holds of the request, it
    /// has been told.
    pub(crate) fn saw_every_event(&self) -> bool {
        !self.reads_log
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let mut channels = self.hub.channels.lock().unwrap_or_else(|e| e.into_inner());
        let Some(channel) = channels.get_mut(&self.id) else {
            return;
        };
        channel.log_readers -= usize::from(self.reads_log);
        // Our own receiver is still alive here, so "1" means nobody else listens.
        if channel.tx.receiver_count() <= 1 {
            channels.remove(&self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn subscriber_receives_published_event_and_channel_is_dropped_with_last_subscriber() {
        let hub = Hub::new();
        let id = Uuid::now_v7();
        let mut a = hub.subscribe(id);
        let b = hub.subscribe(id);
        hub.publish(id, HubEvent::Changed);
        assert_eq!(a.recv().await, HubEvent::Changed);
        drop(b);
        assert_eq!(hub.len(), 1);
        drop(a);
        assert!(hub.is_empty());
    }

    /// Issue 30: a subscription taken before its request existed is not woken for chunks it
    /// took ahead of the log; any other subscriber is, and a lagged one from then on.
    #[tokio::test]
    async fn logged_chunks_wake_only_subscribers_that_may_lack_them_rs11() {
        let hub = Hub::new();
        let id = Uuid::now_v7();
        let logged = || HubEvent::Logged(Arc::new(Vec::new()));
        let mut fresh = hub.subscribe_to_new(id, true);
        assert!(fresh.saw_every_event());
        hub.publish(id, logged());
        hub.publish(id, HubEvent::Changed);
        assert_eq!(fresh.recv().await, HubEvent::Changed, "Logged was not sent");
        let mut reader = hub.subscribe(id);
        assert!(!reader.saw_every_event());
        hub.publish(id, logged());
        assert_eq!(reader.recv().await, logged());
        assert_eq!(fresh.recv().await, logged(), "one channel: sent to all");
        drop(reader);
        hub.publish(id, logged());
        hub.publish(id, HubEvent::Changed);
        assert_eq!(fresh.recv().await, HubEvent::Changed, "not sent again");
        // Lagging behind the channel: events may be waiting for their commit.
        for _ in 0..=CHANNEL_CAPACITY {
            hub.publish(id, HubEvent::Changed);
        }
        assert_eq!(fresh.recv().await, HubEvent::Changed);
        assert!(!fresh.saw_every_event());
        while fresh.rx.try_recv().is_ok() {}
        hub.publish(id, logged());
        assert_eq!(fresh.recv().await, logged(), "taken after a lag");
        drop(fresh);
        assert!(hub.is_empty());
    }
}
