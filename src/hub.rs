//! In-process fan-out of request changes to waiting readers.
//!
//! The hub is only a wake-up: the store is the truth. A reader subscribes *before* it reads
//! the store, then re-reads after every signal, so a signal can never fall between its read and
//! its wait (SPEC RD-4). A lost or lagged signal costs latency, never correctness: readers also
//! re-read on a timer, so a reader on one node follows a request run by another even without
//! cross-node wake-ups; with PostgreSQL those arrive as LISTEN/NOTIFY through
//! [`Store::listen`](crate::store::Store::listen) notifications, which `app.rs` publishes here
//! as [`HubEvent::Changed`].

use std::collections::HashMap;
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
    /// [`HubEvent::Chunks`] (RD-4).
    Ahead(Arc<Handed>),
    /// This node's worker recorded an attempt's outcome: the record as that committed write
    /// left it, so a waiter can answer without reading it back. Anyone else treats it as
    /// [`HubEvent::Changed`].
    Settled(Arc<RequestRecord>),
}

/// Data chunks an attempt handed on ahead of their commit (RS-11).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Handed {
    /// In seq order.
    pub(crate) chunks: Vec<Chunk>,
    /// The provider's request id, with the attempt's first batch (RS-5).
    pub(crate) upstream_request_id: Option<String>,
}

/// Per-request broadcast channels, created on first subscription and dropped with the last.
#[derive(Debug, Default)]
pub(crate) struct Hub {
    channels: Mutex<HashMap<Uuid, broadcast::Sender<HubEvent>>>,
}

/// A reader's subscription to one request; unsubscribes on drop.
#[derive(Debug)]
pub(crate) struct Subscription {
    hub: Arc<Hub>,
    id: Uuid,
    rx: broadcast::Receiver<HubEvent>,
}

/// Events a request's channel holds for its slowest reader. A reader further behind gets
/// [`HubEvent::Changed`] and re-reads the store, so this bounds memory, not correctness. Every
/// request (streamed or not) gets a channel while someone waits on it, allocated and zeroed at
/// subscription, so the capacity is also a per-request cost (docs/benchmarks.md).
const CHANNEL_CAPACITY: usize = 128;

impl Hub {
    /// A new, empty hub.
    pub(crate) fn new() -> Arc<Hub> {
        Arc::new(Hub::default())
    }

    /// Subscribes to events of request `id`.
    pub(crate) fn subscribe(self: &Arc<Self>, id: Uuid) -> Subscription {
        let mut channels = self.channels.lock().unwrap_or_else(|e| e.into_inner());
        let rx = channels
            .entry(id)
            .or_insert_with(|| broadcast::channel(CHANNEL_CAPACITY).0)
            .subscribe();
        Subscription {
            hub: Arc::clone(self),
            id,
            rx,
        }
    }

    /// Publishes `event` to the subscribers of `id`, if there are any.
    pub(crate) fn publish(&self, id: Uuid, event: HubEvent) {
        let channels = self.channels.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(tx) = channels.get(&id) {
            // No receivers left is not an error: the last one is about to unsubscribe.
            let _ = tx.send(event);
        }
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
    /// reader re-read the store; a closed channel never happens while this subscription lives.
    pub(crate) async fn recv(&mut self) -> HubEvent {
        match self.rx.recv().await {
            Ok(event) => event,
            Err(broadcast::error::RecvError::Lagged(_)) => HubEvent::Changed,
            Err(broadcast::error::RecvError::Closed) => std::future::pending().await,
        }
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let mut channels = self.hub.channels.lock().unwrap_or_else(|e| e.into_inner());
        // Our own receiver is still alive here, so "1" means nobody else listens.
        if channels
            .get(&self.id)
            .is_some_and(|tx| tx.receiver_count() <= 1)
        {
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
}
