//! Callbacks (SPEC CB-1..CB-7): a signed webhook when a request finishes, delivered from the
//! log.
//!
//! The delivery is a row of the store written with the request (CB-1); it falls due in the
//! transaction that makes the request terminal (CB-4). [`Deliverer::run`] leases due deliveries
//! like the worker pool leases attempts — any node, one try in flight per delivery, each
//! outcome fenced on the try's lease — renders the record (`http` renders it, through
//! [`Render`]), signs it ([`sign`]) and sends it with a client that refuses internal addresses
//! after resolving them ([`safety`]). A node that dies mid-try leaves its lease to expire; the
//! next lease sends the same `webhook-id` again. Each namespace has its share of the node's
//! slots ([`NamespaceSlots`], CB-7), so a receiver that hangs delays only its own tenant.

mod safety;
mod sign;

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use rand::Rng;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::config::{Config, ConfigError};
use crate::slots::{Keep, NamespaceSlots};
use crate::store::{CallbackLease, CallbackOutcome, DynStore, StoreError, now_ms};

pub(crate) use safety::{Allow, check_url};

/// Most bytes of a receiver's answer read (CB-5).
const MAX_ANSWER_BYTES: usize = 4096;
/// Characters of a receiver's answer kept in `last_error`.
const ANSWER_IN_ERROR: usize = 200;

/// A finished request's webhook, rendered: its namespace (whose secrets sign it) and the body
/// (CB-3).
#[derive(Debug, Clone)]
pub(crate) struct Webhook {
    /// The request's namespace.
    pub namespace: String,
    /// The JSON body, as sent and signed.
    pub body: Vec<u8>,
}

/// Renders request `id`'s webhook; `None` when the request is no longer stored.
pub(crate) type Render =
    Arc<dyn Fn(Uuid) -> BoxFuture<'static, Result<Option<Webhook>, StoreError>> + Send + Sync>;

/// The configured default callback URLs (`[callbacks] url`, each namespace's `callback_url`)
/// checked as admission checks a header's (CB-2): a default admission would refuse would make
/// every call of its namespace a 400, so it stops the start instead, naming its key.
///
/// # Errors
/// [`ConfigError::Invalid`] naming the first refused default.
pub(crate) fn check_defaults(config: &Config) -> Result<(), ConfigError> {
    let allow = Allow::new(&config.callbacks.allow);
    let defaults = std::iter::once(("callbacks.url".to_string(), config.callbacks.url.as_ref()))
        .chain(config.namespaces.iter().enumerate().map(|(i, n)| {
            (
                format!("namespaces[{i}].callback_url"),
                n.callback_url.as_ref(),
            )
        }));
    for (key, url) in defaults {
        if let Some(url) = url {
            check_url(url, &allow).map_err(|e| ConfigError::Invalid {
                key,
                message: e.to_string(),
            })?;
        }
    }
    Ok(())
}

/// The `webhook-id` of request `id`'s terminal event: the same on every try (CB-3).
pub(crate) fn webhook_id(id: Uuid) -> String {
    format!("msg_{id}")
}

/// Leases due callbacks and sends them, until shut down.
pub(crate) struct Deliverer {
    store: DynStore,
    config: Arc<Config>,
    render: Render,
    client: reqwest::Client,
    allow: Allow,
    /// This node's delivery slots, shared between namespaces (CB-7): a try's slot counts it from
    /// its lease until its task ends, however it ends.
    slots: NamespaceSlots,
}

impl Deliverer {
    /// A deliverer for `store` with `[callbacks]` of `config`.
    ///
    /// # Errors
    /// When the HTTP client cannot be built (its TLS setup).
    pub(crate) fn new(
        store: DynStore,
        config: Arc<Config>,
        render: Render,
    ) -> anyhow::Result<Deliverer> {
        let c = &config.callbacks;
        let allow = Allow::new(&c.allow);
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .dns_resolver(Arc::new(safety::Guarded(allow.clone())))
            .connect_timeout(Duration::from_millis(c.connect_timeout_ms))
            .timeout(Duration::from_millis(c.timeout_ms))
            .user_agent(concat!("holdfast/", env!("CARGO_PKG_VERSION")))
            .build()?;
        Ok(Deliverer {
            store,
            render,
            client,
            allow,
            slots: NamespaceSlots::new(
                c.concurrency,
                c.concurrency_per_namespace,
                &config.namespaces,
                Keep::OneShare,
            ),
            config,
        })
    }

    /// How long a try's lease lasts: twice the try's own bound and a margin, so a live try
    /// never loses it (CB-4).
    fn lease_ms(&self) -> i64 {
        let timeout = i64::try_from(self.config.callbacks.timeout_ms).unwrap_or(i64::MAX / 4);
        timeout.saturating_mul(2).saturating_add(2_000)
    }

    /// Leases and sends due callbacks until `shutdown`, at most `[callbacks] concurrency` at
    /// once and each namespace its share first ([`NamespaceSlots::quota`], CB-7), looking for due
    /// ones every `poll_interval_ms` (at once again while it finds a full batch, and when a try
    /// ends). Tries in flight at shutdown are dropped: their leases expire and another lease
    /// sends them again (CB-4).
    pub(crate) async fn run(self, shutdown: CancellationToken) {
        let this = Arc::new(self);
        let c = &this.config.callbacks;
        let permits = Arc::new(Semaphore::new(c.concurrency));
        let poll = Duration::from_millis(c.poll_interval_ms);
        let prefix = format!("callback-{}", Uuid::new_v4());
        let mut tries = JoinSet::new();
        loop {
            let free = permits.available_permits();
            let mut full = false;
            if free > 0 {
                let quota = this.slots.quota(free, 0);
                match this
                    .store
                    .lease_callbacks(&prefix, now_ms(), this.lease_ms(), &quota)
                    .await
                {
                    Ok(leases) => {
                        full = leases.len() == free;
                        for lease in leases {
                            let Ok(permit) = Arc::clone(&permits).try_acquire_owned() else {
                                break;
                            };
                            let slot = this.slots.slot(permit, &lease.namespace);
                            let this = Arc::clone(&this);
                            tries.spawn(async move {
                                this.deliver(lease).await;
                                drop(slot);
                            });
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "leasing due callbacks failed; retrying"),
                }
            }
            if full {
                continue;
            }
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = tokio::time::sleep(poll) => {}
                Some(_) = tries.join_next(), if !tries.is_empty() => {}
            }
        }
        tries.shutdown().await;
    }

    /// One try of `lease`, its outcome recorded under the lease.
    async fn deliver(&self, lease: CallbackLease) {
        let outcome = self.try_once(&lease).await;
        let label = match &outcome {
            CallbackOutcome::Delivered { .. } => "delivered",
            CallbackOutcome::Retry { .. } => "retried",
            CallbackOutcome::Failed { .. } => "failed",
        };
        metrics::counter!(crate::metrics::CALLBACKS, "outcome" => label).increment(1);
        match &outcome {
            CallbackOutcome::Delivered { status } => {
                tracing::info!(request_id = %lease.request_id, attempt = lease.attempt, status, "callback delivered");
            }
            CallbackOutcome::Retry { error, .. } | CallbackOutcome::Failed { error, .. } => {
                tracing::warn!(request_id = %lease.request_id, attempt = lease.attempt, outcome = label, error = %error, "callback not delivered");
            }
        }
        match self.store.finish_callback(&lease, &outcome, now_ms()).await {
            Ok(true) => {}
            Ok(false) => {
                tracing::warn!(request_id = %lease.request_id, "callback lease lost before its outcome was recorded");
            }
            // Left to the lease's expiry: the delivery is tried again (at least once, CB-4).
            Err(e) => {
                tracing::warn!(request_id = %lease.request_id, error = %e, "recording a callback outcome failed");
            }
        }
    }

    /// Renders, signs and sends `lease`'s webhook; what happened (CB-4).
    async fn try_once(&self, lease: &CallbackLease) -> CallbackOutcome {
        let failed = |error: String| CallbackOutcome::Failed {
            status: None,
            error,
        };
        let webhook = match (self.render)(lease.request_id).await {
            Ok(Some(webhook)) => webhook,
            Ok(None) => return failed("the request is no longer stored".into()),
            Err(e) => return self.retry(lease, None, format!("reading the record: {e}")),
        };
        let keys: Vec<Vec<u8>> = self
            .config
            .callbacks_of(&webhook.namespace)
            .secrets
            .iter()
            .filter_map(|s| crate::config::webhook_key(s))
            .collect();
        if keys.is_empty() {
            return failed("the namespace has no callback signing secret".into());
        }
        let url = match check_url(&lease.url, &self.allow) {
            Ok(url) => url,
            Err(e) => return failed(format!("refused: {e}")),
        };
        let id = webhook_id(lease.request_id);
        let timestamp = now_ms() / 1000;
        let signature = sign::signature(&keys, &id, timestamp, &webhook.body);
        let sent = self
            .client
            .post(url)
            .header("content-type", "application/json")
            .header("webhook-id", &id)
            .header("webhook-timestamp", timestamp.to_string())
            .header("webhook-signature", signature)
            .body(webhook.body)
            .send()
            .await;
        let mut answer = match sent {
            Ok(answer) => answer,
            Err(e) => {
                if let Some(refused) = find_source::<safety::Refused>(&e) {
                    return failed(format!("refused: {refused}"));
                }
                let what = if e.is_timeout() {
                    "no answer in time".to_string()
                } else {
                    format!("not sent: {}", error_chain(&e))
                };
                return self.retry(lease, None, what);
            }
        };
        let status = answer.status().as_u16();
        let mut read = Vec::new();
        while read.len() < MAX_ANSWER_BYTES {
            match answer.chunk().await {
                Ok(Some(chunk)) => read.extend_from_slice(&chunk),
                Ok(None) | Err(_) => break,
            }
        }
        if answer.status().is_success() {
            return CallbackOutcome::Delivered { status };
        }
        let text: String = String::from_utf8_lossy(&read)
            .chars()
            .take(ANSWER_IN_ERROR)
            .collect();
        let error = format!("HTTP {status}: {text}");
        if status == 410 {
            return CallbackOutcome::Failed {
                status: Some(status),
                error,
            };
        }
        self.retry(lease, Some(status), error)
    }

    /// Try again after the backoff of try `lease.attempt` (CB-4), or fail when that would fall
    /// past `give_up_after_secs` after the request finished.
    fn retry(&self, lease: &CallbackLease, status: Option<u16>, error: String) -> CallbackOutcome {
        let c = &self.config.callbacks;
        let doublings = lease.attempt.saturating_sub(1).min(40);
        let base = c
            .backoff_initial_ms
            .saturating_mul(1u64 << doublings)
            .min(c.backoff_max_ms);
        // Up to a tenth more, so deliveries failing together spread out; the delays still grow.
        let jitter = rand::rng().random_range(0..=base / 10);
        let delay = i64::try_from(base + jitter).unwrap_or(i64::MAX / 4);
        let next_try_at = now_ms().saturating_add(delay);
        let give_up_at = lease.finished_at.saturating_add(
            i64::try_from(c.give_up_after_secs.saturating_mul(1000)).unwrap_or(i64::MAX / 4),
        );
        if next_try_at > give_up_at {
            return CallbackOutcome::Failed {
                status,
                error: format!("gave up after {} tries; last: {error}", lease.attempt),
            };
        }
        CallbackOutcome::Retry {
            next_try_at,
            status,
            error,
        }
    }
}

/// The first error of type `T` in `e`'s source chain.
fn find_source<'e, T: std::error::Error + 'static>(
    e: &'e (dyn std::error::Error + 'static),
) -> Option<&'e T> {
    let mut at: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = at {
        if let Some(found) = err.downcast_ref::<T>() {
            return Some(found);
        }
        at = err.source();
    }
    None
}

/// `e` and its sources, joined with `: `.
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts = vec![e.to_string()];
    let mut at = e.source();
    while let Some(err) = at {
        parts.push(err.to_string());
        at = err.source();
    }
    parts.join(": ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::sqlite::scratch;

    /// A deliverer whose renderer answers a fixed webhook, with `allow` and one secret.
    async fn deliverer(dir: &std::path::Path, allow: &[&str]) -> Deliverer {
        let store: DynStore = Arc::new(scratch(dir).await);
        let mut config = Config::default();
        config.callbacks.secrets = vec!["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw".into()];
        config.callbacks.allow = allow.iter().map(|a| a.to_string()).collect();
        config.callbacks.connect_timeout_ms = 500;
        config.callbacks.timeout_ms = 1_000;
        let render: Render = Arc::new(|_| {
            Box::pin(async {
                Ok(Some(Webhook {
                    namespace: "default".into(),
                    body: b"{}".to_vec(),
                }))
            })
        });
        Deliverer::new(store, Arc::new(config), render).expect("deliverer")
    }

    fn lease(url: &str) -> CallbackLease {
        CallbackLease {
            request_id: Uuid::now_v7(),
            owner: "t/1".into(),
            attempt: 1,
            url: url.into(),
            finished_at: now_ms(),
            namespace: "default".into(),
        }
    }

    /// CB-5: a name that resolves only to internal addresses, and a literal internal address,
    /// fail the delivery at once (`refused`), without a try; allowed, the same address is tried
    /// and a refused connection is retried.
    #[tokio::test]
    async fn internal_destinations_are_refused_without_a_try_and_not_retried_cb5() {
        let dir = tempfile::tempdir().expect("tempdir");
        let strict = deliverer(dir.path(), &[]).await;
        for url in ["http://localhost:9/hook", "http://127.0.0.1:9/hook"] {
            match strict.try_once(&lease(url)).await {
                CallbackOutcome::Failed {
                    status: None,
                    error,
                } => {
                    assert!(error.starts_with("refused"), "{url}: {error}");
                }
                other => panic!("{url}: {other:?}"),
            }
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let open = deliverer(dir.path(), &["127.0.0.0/8", "::1"]).await;
        // Port 9 (discard) is closed on loopback: a refused connection, tried again.
        match open.try_once(&lease("http://localhost:9/hook")).await {
            CallbackOutcome::Retry {
                status: None,
                error,
                ..
            } => {
                assert!(error.starts_with("not sent"), "{error}");
            }
            other => panic!("{other:?}"),
        }
    }
}
