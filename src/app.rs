//! Wiring: open the store, start the worker pool and the HTTP server, shut both down.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::serve::ListenerExt;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::http::{AppState, router};
use crate::hub::{Hub, HubEvent};
use crate::store::{self, DynStore, Notification};
use crate::upstream::Upstreams;
use crate::worker::WorkerPool;

/// A running holdfast: HTTP server and worker pool.
pub struct Running {
    /// Where the HTTP API listens.
    pub addr: SocketAddr,
    shutdown: CancellationToken,
    /// Ends what the HTTP server still holds after the workers stop ([`AppState::cut`], DU-5).
    cut: CancellationToken,
    server: JoinHandle<()>,
    workers: JoinHandle<()>,
    /// Cross-node wake-ups ([`crate::store::Store::listen`] and its bridge).
    wakeups: JoinHandle<()>,
}

/// Opens the store named by `config`, then serves on `listener` and runs workers until
/// [`Running::shutdown`].
///
/// # Errors
/// When the store cannot be opened or migrated, or the upstream client cannot be built.
pub async fn start(config: Config, listener: TcpListener) -> anyhow::Result<Running> {
    let config = Arc::new(config);
    crate::metrics::handle();
    let store = store::open(&config).await?;
    let hub = Hub::new();
    let upstreams = Arc::new(Upstreams::new(&config)?);
    let shutdown = CancellationToken::new();
    let pool = WorkerPool::new(
        store.clone(),
        Arc::clone(&hub),
        Arc::clone(&upstreams),
        Arc::clone(&config),
    );
    let wakeups = bridge_notifications(&store, Arc::clone(&hub), pool.clone(), &shutdown);
    // Before serving: a retry of a request a stopped process left running attaches to its
    // recovery, not to the dead attempt (decision 41).
    pool.sweep_at_start().await;
    let workers = tokio::spawn(pool.clone().run(shutdown.child_token()));

    let cut = CancellationToken::new();
    let state = AppState {
        config,
        store,
        hub,
        workers: pool,
        upstreams,
        models: Arc::default(),
        held: Arc::default(),
        cut: cut.clone(),
    };
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
    })
}

impl Running {
    /// Stops accepting and leasing, lets in-flight attempts finish (`shutdown_grace_ms`), and
    /// returns when both the server and the workers have stopped. Connections still open
    /// [`CUT_AFTER`] after the workers stop are ended (DU-5): event streams end, a proxied one
    /// after an error event `shutting_down`, and held calls answer 503 `shutting_down`; their
    /// requests were handed back to `pending`, and a retry attaches to them elsewhere.
    pub async fn shutdown(mut self) {
        self.shutdown.cancel();
        let _ = self.workers.await;
        let _ = self.wakeups.await;
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
    }
}

/// How long after the workers stop open connections are left to end on their own (DU-5).
const CUT_AFTER: Duration = Duration::from_secs(2);
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
