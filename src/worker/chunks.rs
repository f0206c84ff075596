//! Group commit of stream chunks.
//!
//! Every attempt that streams hands its parsed events to one writer task per process. The
//! writer takes everything queued at that moment — from any number of streams — and stores it
//! with one [`Store::append_chunks`](crate::store::Store::append_chunks) call, one
//! transaction, each batch fenced on its own lease (LC-3). So the per-chunk cost falls as load
//! rises instead of being one commit per chunk, and an attempt learns that its chunks are
//! durable before they are shown to any reader. A commit that fails is tried again for one
//! lease length ([`WriteRetry`], decision 37) before its batches are failed.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tracing::{debug, info, warn};

use super::retry::WriteRetry;
use crate::metrics as m;
use crate::store::{Chunk, ChunkBatch, DynStore, StoreError};

/// Largest number of batches stored in one transaction.
const MAX_BATCHES_PER_COMMIT: usize = 1024;

type Ack = oneshot::Sender<Result<Option<Vec<Chunk>>, Arc<StoreError>>>;

/// Handle to the writer task. Cloning is cheap; the task ends when the last handle is dropped.
#[derive(Clone, Debug)]
pub struct ChunkWriter {
    queue: mpsc::UnboundedSender<(ChunkBatch, Ack)>,
}

/// Why an append did not store anything.
#[derive(Debug, thiserror::Error)]
pub enum AppendError {
    /// The attempt no longer holds its lease (LC-3).
    #[error("the attempt's lease was lost")]
    LeaseLost,
    /// The database failed, tried again for the whole retry window.
    #[error("storing chunks failed: {0}")]
    Store(Arc<StoreError>),
    /// The writer task is gone (shutting down).
    #[error("the chunk writer stopped")]
    Stopped,
}

impl ChunkWriter {
    /// Starts the writer task over `store`. A failed commit is tried again for `retry_for` (one
    /// lease length) before its batches are failed.
    pub fn spawn(store: DynStore, retry_for: Duration) -> ChunkWriter {
        let (queue, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(store, rx, retry_for));
        ChunkWriter { queue }
    }

    /// Stores `batch` (in a shared transaction with whatever else is queued) and returns the
    /// stored chunks with their seqs.
    ///
    /// # Errors
    /// [`AppendError`]: lease lost, database failure, or writer stopped.
    pub async fn append(&self, batch: ChunkBatch) -> Result<Vec<Chunk>, AppendError> {
        let (ack, done) = oneshot::channel();
        self.queue
            .send((batch, ack))
            .map_err(|_| AppendError::Stopped)?;
        match done.await {
            Ok(Ok(Some(chunks))) => Ok(chunks),
            Ok(Ok(None)) => Err(AppendError::LeaseLost),
            Ok(Err(e)) => Err(AppendError::Store(e)),
            Err(_) => Err(AppendError::Stopped),
        }
    }
}

async fn run(
    store: DynStore,
    mut rx: mpsc::UnboundedReceiver<(ChunkBatch, Ack)>,
    retry_for: Duration,
) {
    let mut batches = Vec::new();
    let mut acks = Vec::new();
    while let Some((batch, ack)) = rx.recv().await {
        batches.push(batch);
        acks.push(ack);
        while batches.len() < MAX_BATCHES_PER_COMMIT {
            match rx.try_recv() {
                Ok((batch, ack)) => {
                    batches.push(batch);
                    acks.push(ack);
                }
                Err(_) => break,
            }
        }
        let started = std::time::Instant::now();
        let mut result = store.append_chunks(&batches).await;
        metrics::histogram!(m::CHUNK_COMMIT_SECONDS).record(started.elapsed().as_secs_f64());
        if let Err(e) = &result {
            let mut retry = WriteRetry::new(retry_for);
            let mut tries = 1;
            warn!(error = %e, batches = batches.len(), "chunk commit failed; retrying");
            while result.is_err() && retry.wait().await {
                tries += 1;
                metrics::counter!(m::ATTEMPT_WRITE_RETRIES, "write" => "chunks").increment(1);
                result = store.append_chunks(&batches).await;
                if let Err(e) = &result {
                    debug!(error = %e, tries, "chunk commit failed again");
                }
            }
            match &result {
                Ok(_) => info!(tries, "chunk commit stored after retries"),
                Err(e) => {
                    warn!(error = %e, tries, "chunk commit failed for the whole retry window")
                }
            }
        }
        match result {
            Ok(stored) => {
                for (ack, chunks) in acks.drain(..).zip(stored) {
                    // A dropped receiver is an attempt that was abandoned meanwhile.
                    let _ = ack.send(Ok(chunks));
                }
            }
            Err(e) => {
                metrics::counter!(m::ATTEMPT_WRITES_ABANDONED, "write" => "chunks")
                    .increment(acks.len() as u64);
                let e = Arc::new(e);
                for ack in acks.drain(..) {
                    let _ = ack.send(Err(Arc::clone(&e)));
                }
            }
        }
        batches.clear();
    }
}
