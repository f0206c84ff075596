//! Wiring: open the store, start the worker pool and the HTTP server, shut both down.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::serve::ListenerExt;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::callback::Deliverer;
use crate::config::Config;
use crate::http::large_bodies::LargeBodies;
use crate::http::{AppState, Held, Shared, router};
use crate::hub::{Hub, HubEvent};
use crate::otel::{Otel, Traces};
use crate::store::{self, DynStore, Notification};
use crate::upstream::Upstreams;
use crate::worker::WorkerPool;

/// A running holdfast: HTTP server and worker pool.
pub struct Running {
    /// Where the HTTP API listens.
    pub addr: SocketAddr,
    shutdown: CancellationToken,
    /// Ends what the HTTP server still holds after the workers stop ([`Shared::cut`], DU-5).
    cut: CancellationToken,
    server: JoinHandle<()>,
    workers: JoinHandle<()>,
    /// Cross-node wake-ups ([`crate::store::Store::listen`] and its bridge).
    wakeups: JoinHandle<()>,
    /// Traces, flushed at shutdown (OT-1).
    traces: Traces,
    /// The callback deliverer (CB-4).
    callbacks: JoinHandle<()>,
    /// The longest the workers, wake-ups and deliveries get to stop after the signal (DU-5a).
    settle_within: Duration,
}

/// How a shutdown ended ([`Running::shutdown`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stopped {
    /// Every attempt ended, recorded or handed back, and the server stopped.
    Settled,
    /// The store did not answer within the bound (DU-5a): what was still waiting on it was
    /// dropped, and its leases expire as after a crash.
    Unsettled,
}

/// Opens the store named by `config`, then serves on `listener` and runs workers until
/// [`Running::shutdown`].
///
/// # Errors
/// When the store cannot be opened or migrated, or the upstream client cannot be built.
pub async fn start(config: Config, listener: TcpListener) -> anyhow::Result<Running> {
    crate::callback::check_defaults(&config)?;
    if config.worker_shares_exceed_concurrency() {
        tracing::warn!(
            namespaces = config.namespaces.len(),
            share = config.worker_share(),
            concurrency = config.workers.concurrency,
            "the namespaces' worker shares add up to more than workers.concurrency: floods of \
             some namespaces can take every slot, and another's call waits for one to free \
             (LC-2a); lower workers.concurrency_per_namespace or raise workers.concurrency"
        );
    }
    let config = Arc::new(config);
    let settle_within = settle_within(&config);
    crate::metrics::handle();
    let store = store::open(&config).await?;
    let hub = Hub::new();
    let upstreams = Arc::new(Upstreams::new(&config)?);
    let shutdown = CancellationToken::new();
    let traces = Otel::start(&config.otel)?;
    let pool = WorkerPool::new(
        store.clone(),
        Arc::clone(&hub),
        Arc::clone(&upstreams),
        Arc::clone(&config),
        traces.clone(),
        &shutdown,
    );
    let wakeups = bridge_notifications(&store, Arc::clone(&hub), pool.clone(), &shutdown);
    // Before serving: a retry of a request a stopped process left running attaches to its
    // recovery, not to the dead attempt (decision 41).
    pool.sweep_at_start().await;
    let workers = tokio::spawn(pool.clone().run());
    let deliverer = Deliverer::new(
        store.clone(),
        Arc::clone(&config),
        crate::http::callbacks::renderer(store.clone(), Arc::clone(&config)),
    )?;
    let callbacks = tokio::spawn(deliverer.run(shutdown.child_token()));

    let cut = CancellationToken::new();
    let held = Arc::new(Held::new(&config));
    let large_bodies = Arc::new(LargeBodies::new(&config));
    let state = AppState::new(Shared {
        config,
        store,
        hub,
        workers: pool,
        upstreams,
        models: Arc::default(),
        held,
        large_bodies,
        cut: cut.clone(),
        traces: traces.clone(),
    });
    let addr = listener.local_addr()?;
    // TCP_NODELAY on every accepted connection: a stream's events are small writes after the
    // headers, and with Nagle each one would wait for the client's delayed ACK whenever the
    // previous write is still unacknowledged.
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "could not set TCP_NODELAY");
        }
    });
    let app = router(state);
    let stop = shutdown.clone();
    let server = tokio::spawn(async move {
        let serve = axum::serve(listener, app).with_graceful_shutdown(async move {
            stop.cancelled().await;
        });
        if let Err(e) = serve.await {
            tracing::error!(error = %e, "HTTP server failed");
        }
    });
    Ok(Running {
        addr,
        shutdown,
        cut,
        server,
        workers,
        wakeups,
        traces,
        callbacks,
        settle_within,
    })
}

/// How long after the signal the workers get to stop (DU-5a, decision 152): the grace for
/// attempts in flight, then LC-3's window for the outcome writes of answers already paid for,
/// and the 2 s a hand-back waits for what its attempt handed on.
fn settle_within(config: &Config) -> Duration {
    Duration::from_millis(config.shutdown_grace_ms)
        + crate::worker::write_window(config)
        + crate::worker::CANCEL_SETTLES_FOR
}

impl Running {
    /// Stops accepting and leasing, lets in-flight attempts finish (`shutdown_grace_ms`), and
    /// returns when both the server and the workers have stopped. Connections still open
    /// [`CUT_AFTER`] after the workers stop are ended (DU-5): event streams end, a proxied one
    /// after an error event `shutting_down`, and held calls answer 503 `shutting_down`; their
    /// requests were handed back to `pending`, and a retry attaches to them elsewhere.
    ///
    /// Bounded whatever the store does (DU-5a): the workers, the wake-ups and the deliveries
    /// get [`settle_within`] of the signal; past it, what still waits on the store is dropped
    /// and the shutdown goes on to the cut, [`Stopped::Unsettled`].
    pub async fn shutdown(mut self) -> Stopped {
        self.shutdown.cancel();
        let deadline = tokio::time::Instant::now() + self.settle_within;
        let settled = tokio::time::timeout_at(deadline, async {
            let _ = (&mut self.workers).await;
            let _ = (&mut self.wakeups).await;
            let _ = (&mut self.callbacks).await;
        })
        .await;
        let stopped = if settled.is_ok() {
            Stopped::Settled
        } else {
            tracing::error!(
                within_ms = u64::try_from(self.settle_within.as_millis()).unwrap_or(u64::MAX),
                "the store did not answer within the shutdown's bound: stopping with attempts \
                 unrecorded; their leases expire and the sweep recovers them, as after a crash \
                 (DU-5a)"
            );
            self.workers.abort();
            self.wakeups.abort();
            self.callbacks.abort();
            Stopped::Unsettled
        };
        if tokio::time::timeout(CUT_AFTER, &mut self.server)
            .await
            .is_err()
        {
            // Aborting the server task alone would leave them open: axum runs each connection
            // in a task of its own, which only the end of the process would drop.
            self.cut.cancel();
            if tokio::time::timeout(CLOSE_AFTER_CUT, &mut self.server)
                .await
                .is_err()
            {
                tracing::warn!("connections still open after the shutdown cut; abandoning them");
                self.server.abort();
            }
        }
        if let Some(traces) = &self.traces {
            traces.shutdown(TRACES_FLUSH).await;
        }
        stopped
    }
}

/// How long after the workers stop open connections are left to end on their own (DU-5).
const CUT_AFTER: Duration = Duration::from_secs(2);
/// How long the last spans get to reach the collector at shutdown.
const TRACES_FLUSH: Duration = Duration::from_secs(2);
/// How long the cut connections get to send their last bytes and close.
const CLOSE_AFTER_CUT: Duration = Duration::from_millis(500);

/// Turns the store's reports of changes made by other nodes (PostgreSQL LISTEN/NOTIFY; SQLite
/// has none) into this node's wake-ups: a changed request wakes its readers on the hub, new work
/// wakes the worker pool. The store knows neither; this is the one place that connects them.
fn bridge_notifications(
    store: &DynStore,
    hub: Arc<Hub>,
    workers: WorkerPool,
    shutdown: &CancellationToken,
) -> JoinHandle<()> {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let listening = {
        let (store, stop) = (store.clone(), shutdown.child_token());
        tokio::spawn(async move { store.listen(tx, stop).await })
    };
    tokio::spawn(async move {
        // Ends when the listener returns (shutdown) and drops its sender.
        while let Some(notification) = rx.recv().await {
            match notification {
                Notification::Changed(id) => hub.publish(id, HubEvent::Changed),
                Notification::Work => workers.wake(),
            }
        }
        let _ = listening.await;
    })
}

#[cfg(test)]
mod tests {
    //! The test-only provider (`provider/echo.rs`, compiled only here) through the whole
    //! pipeline: admission, the claim, a worker's call, the stream's parse and end, replays and
    //! the log — nothing outside `provider/` names it (docs/architecture.md, "How to add a
    //! provider").

    use std::sync::atomic::{AtomicUsize, Ordering};

    use axum::http::HeaderMap;
    use axum::response::IntoResponse;

    use super::*;

    /// The echo API's upstream: `POST /say` says the body's `text` back, a stream word by word
    /// ending with `said` (left out when the text contains "cut"). Counts calls.
    async fn echo_upstream(calls: Arc<AtomicUsize>) -> SocketAddr {
        let say = move |headers: HeaderMap, body: String| {
            let calls = Arc::clone(&calls);
            async move {
                let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
                let body: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
                let text = body["text"].as_str().unwrap_or_default().to_string();
                let mood = headers.get("echo-mood").is_some();
                let leaked = headers.get("x-echo-key").is_some();
                let usage = serde_json::json!({"in": 1, "out": text.split(' ').count()});
                let id = [("echo-request-id", format!("echo-{n}"))];
                if body["stream"] != true {
                    let said = serde_json::json!({"say": text, "usage": usage, "mood": mood, "leaked": leaked});
                    return (id, axum::Json(said)).into_response();
                }
                let mut events = String::new();
                for word in text.split(' ') {
                    let data = serde_json::json!({"say": word});
                    events.push_str(&format!("event: piece\ndata: {data}\n\n"));
                }
                if !text.contains("cut") {
                    let data = serde_json::json!({"usage": usage});
                    events.push_str(&format!("event: said\ndata: {data}\n\n"));
                }
                (id, [("content-type", "text/event-stream")], events).into_response()
            }
        };
        let app = axum::Router::new().route("/say", axum::routing::post(say));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move { axum::serve(listener, app).await });
        addr
    }

    #[tokio::test]
    async fn a_provider_compiled_only_in_tests_runs_the_whole_pipeline() {
        let calls = Arc::new(AtomicUsize::new(0));
        let upstream = echo_upstream(Arc::clone(&calls)).await;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("holdfast.toml");
        let toml = format!(
            "database_url = \"sqlite://{}\"\n[[backends]]\nname = \"echo\"\nkind = \"echo\"\nbase_url = \"http://{upstream}\"\n",
            dir.path().join("holdfast.db").display()
        );
        std::fs::write(&path, toml).expect("write the config");
        let config = Config::load(Some(&path)).expect("kind = \"echo\" is a backend kind");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let running = start(config, listener).await.expect("start");
        let base = format!("http://{}", running.addr);
        let http = reqwest::Client::new();
        let post = |body: &'static str| {
            http.post(format!("{base}/echo/say"))
                .header("content-type", "application/json")
                .header("echo-mood", "calm")
                .header("x-echo-key", "the client's key")
                .body(body)
                .send()
        };

        // A whole answer: recorded, called once, replayed.
        let body = r#"{"model":"m","text":"hello there"}"#;
        let first = post(body).await.expect("POST");
        assert_eq!(first.status(), 200);
        let header = |r: &reqwest::Response, name: &str| {
            r.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_string()
        };
        assert_eq!(header(&first, "echo-request-id"), "echo-1", "RS-5");
        let id = header(&first, "holdfast-request-id");
        let said: serde_json::Value = first.json().await.expect("JSON");
        assert_eq!(said["say"], "hello there");
        assert_eq!(said["mood"], true, "its forwarded header reached it");
        assert_eq!(said["leaked"], false, "the client's key did not");
        let again = post(body).await.expect("POST");
        assert_eq!(header(&again, "idempotent-replayed"), "true");
        assert_eq!(header(&again, "holdfast-request-id"), id);
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        let record: serde_json::Value = http
            .get(format!("{base}/requests/{id}"))
            .send()
            .await
            .expect("GET")
            .json()
            .await
            .expect("JSON");
        assert_eq!(record["route"], "echo.say", "{record}");
        assert_eq!(record["usage"]["output_tokens"], 2, "{record}");

        // A stream: complete at `said`, replayed byte for byte.
        let stream = r#"{"model":"m","text":"one two three","stream":true}"#;
        let streamed = post(stream)
            .await
            .expect("POST")
            .text()
            .await
            .expect("body");
        assert!(streamed.contains("event: said"), "{streamed}");
        let replayed = post(stream)
            .await
            .expect("POST")
            .text()
            .await
            .expect("body");
        assert_eq!(replayed, streamed);
        assert_eq!(calls.load(Ordering::SeqCst), 2);

        // A stream without its final event: interrupted, closed with the provider's error event.
        let cut = r#"{"model":"m","text":"cut short","stream":true}"#;
        let answer = post(cut).await.expect("POST");
        let id = header(&answer, "holdfast-request-id");
        let text = answer.text().await.expect("body");
        assert!(text.contains("event: oops"), "{text}");
        assert!(text.contains("stream_interrupted"), "{text}");
        let record: serde_json::Value = http
            .get(format!("{base}/requests/{id}"))
            .send()
            .await
            .expect("GET")
            .json()
            .await
            .expect("JSON");
        assert_eq!(record["error"]["type"], "stream_interrupted", "{record}");
        running.shutdown().await;
    }
}
