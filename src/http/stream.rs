//! Following a request's chunk log: replay, then live tail, with no gap and no duplicate
//! (SPEC RS-2, RD-4), rendered either as the provider's own stream (proxied routes, RS-4) or as
//! holdfast's numbered event stream (`GET /requests/{id}`, RD-2..RD-6).
//!
//! [`follow`] subscribes to the hub *first*, then reads the stored backlog, then takes live
//! chunks from the hub, dropping any it already sent. Whenever the hub skips ahead (a lagged
//! subscriber), says only "changed", or stays quiet for [`POLL`], it re-reads the store from its
//! position, so the store, never the hub, decides what a reader sees.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::Stream;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::hub::{Hub, HubEvent};
use crate::provider::Provider;
use crate::sse;
use crate::store::{Chunk, ChunkKind, DynStore, StoreError};

/// Re-read the store at least this often while following.
pub(super) const POLL: Duration = Duration::from_millis(500);
/// Chunks read from the store at a time.
const PAGE: i64 = 512;

/// An item of a followed chunk log.
#[derive(Debug, Clone)]
pub(super) enum Followed {
    /// The next chunk.
    Chunk(Chunk),
    /// Nothing new for a keep-alive interval.
    KeepAlive,
}

/// Chunks of request `id` after seq `after`, stored then live, ending after the `end` chunk.
/// Yields [`Followed::KeepAlive`] every `keepalive` without a chunk.
pub(super) fn follow(
    store: DynStore,
    hub: Arc<Hub>,
    id: Uuid,
    after: i64,
    keepalive: Duration,
) -> impl Stream<Item = Result<Followed, StoreError>> + Send + 'static {
    async_stream::try_stream! {
        let mut subscription = hub.subscribe(id);
        let mut pos = after;
        let mut quiet_since = tokio::time::Instant::now();
        loop {
            // Backlog from the store.
            let page = store.chunks_after(id, pos, PAGE).await?;
            let full = page.len() as i64 == PAGE;
            for chunk in page {
                pos = chunk.seq;
                let end = chunk.kind == ChunkKind::End;
                quiet_since = tokio::time::Instant::now();
                yield Followed::Chunk(chunk);
                if end {
                    return;
                }
            }
            if full {
                continue;
            }
            // Live from the hub until it skips ahead, says "changed", or goes quiet. The store
            // is re-read after POLL without a chunk, however often keep-alives go out between.
            let mut poll_at = tokio::time::Instant::now() + POLL;
            loop {
                let keepalive_at = quiet_since + keepalive;
                tokio::select! {
                    event = subscription.recv() => match event {
                        HubEvent::Chunk(chunk) if chunk.seq <= pos => {}
                        HubEvent::Chunk(chunk) if chunk.seq == pos + 1 => {
                            pos = chunk.seq;
                            let end = chunk.kind == ChunkKind::End;
                            quiet_since = tokio::time::Instant::now();
                            poll_at = quiet_since + POLL;
                            yield Followed::Chunk((*chunk).clone());
                            if end {
                                return;
                            }
                        }
                        _ => break,
                    },
                    () = tokio::time::sleep_until(keepalive_at) => {
                        quiet_since = tokio::time::Instant::now();
                        yield Followed::KeepAlive;
                    }
                    () = tokio::time::sleep_until(poll_at) => break,
                }
            }
        }
    }
}

/// The `data` of an `end` chunk.
#[derive(Debug, serde::Deserialize)]
struct EndData {
    status: String,
    error: Option<EndError>,
}

#[derive(Debug, serde::Deserialize)]
struct EndError {
    #[serde(rename = "type")]
    kind: String,
    message: String,
}

/// Renders one followed item for a proxied route (RS-4): provider events as the provider sent
/// them (keeping `event:`, adding no `id:`); a failed `end` or a `reset` (this reader's attempt
/// was abandoned) becomes an error event in the provider's stream shape, after which the
/// caller ends the connection. Returns the bytes and whether the stream is over.
pub(super) fn provider_bytes(item: &Followed, shape: Provider) -> (Bytes, bool) {
    match item {
        Followed::KeepAlive => (sse::comment("keep-alive"), false),
        Followed::Chunk(chunk) => match chunk.kind {
            ChunkKind::Data => (
                sse::encode(None, chunk.event.as_deref(), &chunk.data),
                false,
            ),
            ChunkKind::Reset => (
                provider_error(
                    shape,
                    "attempt_abandoned",
                    "the holdfast worker running this stream stopped; the request is being re-run \
                     as a new attempt, and a retry of the same request will attach to it",
                ),
                true,
            ),
            ChunkKind::End => {
                let end: Option<EndData> = serde_json::from_str(&chunk.data).ok();
                match end {
                    Some(EndData { status, .. }) if status == "succeeded" => (Bytes::new(), true),
                    Some(EndData {
                        error: Some(error), ..
                    }) => (provider_error(shape, &error.kind, &error.message), true),
                    _ => (
                        provider_error(shape, "upstream_invalid", "the request failed"),
                        true,
                    ),
                }
            }
        },
    }
}

/// An error event in the provider's stream shape, which its SDKs raise on (RS-4, LC-7).
pub(super) fn provider_error(shape: Provider, code: &str, message: &str) -> Bytes {
    let (event, data) = shape.error_event(code, message);
    sse::encode(None, event, &data)
}

/// Renders one followed item for `GET /requests/{id}` (RD-2): `id: <seq>`, the stored `event:`
/// name (or `reset` / `end` for control chunks), and its data.
pub(super) fn log_bytes(item: &Followed) -> Bytes {
    match item {
        Followed::KeepAlive => sse::comment("keep-alive"),
        Followed::Chunk(chunk) => {
            let event = match chunk.kind {
                ChunkKind::Data => chunk.event.as_deref(),
                ChunkKind::Reset => Some("reset"),
                ChunkKind::End => Some("end"),
            };
            sse::encode(u64::try_from(chunk.seq).ok(), event, &chunk.data)
        }
    }
}

/// The closing error event of a proxied stream this node ends at shutdown (DU-5, RS-4): in the
/// provider's stream shape, so that its SDK raises and its retry attaches to the request
/// elsewhere, where a clean end would read as a complete, truncated answer.
pub(super) fn shutting_down_event(shape: Provider) -> Bytes {
    provider_error(shape, "shutting_down", super::errors::SHUTTING_DOWN_MESSAGE)
}

/// A `200 text/event-stream` response around `body`, uncached and unbuffered by proxies.
///
/// When `cut` fires (shutdown, DU-5) the body ends between two of its items, after `farewell`
/// when given (a proxied stream's [`shutting_down_event`]); without one (`GET /requests/{id}`)
/// it just ends, without `end`, so its reader reconnects with its position, as after a store
/// failure (RD-6). Dropping `body` then drops whatever it holds (a proxied call's slot).
pub(super) fn event_stream_response<S>(
    body: S,
    cut: CancellationToken,
    farewell: Option<Bytes>,
) -> axum::response::Response
where
    S: Stream<Item = Result<Bytes, std::convert::Infallible>> + Send + 'static,
{
    use axum::http::{HeaderValue, header};
    let body = async_stream::stream! {
        let mut body = std::pin::pin!(body);
        // One waiter for the whole stream, not one registered per event.
        let mut cancelled = std::pin::pin!(cut.cancelled_owned());
        loop {
            tokio::select! {
                biased;
                () = &mut cancelled => {
                    if let Some(farewell) = farewell {
                        yield Ok(farewell);
                    }
                    return;
                }
                // `next` is cancel-safe: an item is either taken whole or left in `body`.
                item = futures::StreamExt::next(&mut body) => match item {
                    Some(item) => yield item,
                    None => return,
                },
            }
        }
    };
    let mut response = axum::response::Response::new(axum::body::Body::from_stream(body));
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    response
}

#[cfg(test)]
mod tests {
    use futures::StreamExt;

    use super::*;
    use crate::config::SqliteSynchronous;
    use crate::store::sqlite::SqliteStore;
    use crate::store::{ChunkBatch, NewChunk, NewRequest, now_ms};

    /// A reader re-reads the store at least every POLL without a chunk, however often its
    /// keep-alives go out (here every 20 ms): a chunk whose hub event it never got — another
    /// node's, whose NOTIFY was lost — still reaches it (RD-4, docs/postgres.md).
    #[tokio::test]
    async fn a_reader_whose_keepalives_are_frequent_still_polls_the_store_for_chunks_rd4() {
        let dir = tempfile::tempdir().expect("tempdir");
        let url = format!("sqlite://{}", dir.path().join("t.db").display());
        let store: DynStore = Arc::new(
            SqliteStore::open(&url, SqliteSynchronous::Normal)
                .await
                .expect("open"),
        );
        let now = now_ms();
        let request = NewRequest {
            stream: true,
            ..NewRequest::example(7, now)
        };
        store.submit(request).await.expect("submit");
        let (lease, record) = store
            .lease_many("node", now, 30_000, 1)
            .await
            .expect("lease")
            .pop()
            .expect("leased");
        let items = follow(
            Arc::clone(&store),
            Hub::new(),
            record.id,
            0,
            Duration::from_millis(20),
        );
        let mut items = std::pin::pin!(items);
        // A first keep-alive: the reader read the (empty) log and waits live.
        assert!(matches!(items.next().await, Some(Ok(Followed::KeepAlive))));
        // Stored without a word to this node's hub.
        let batch = ChunkBatch {
            lease,
            after: 0,
            chunks: vec![NewChunk {
                event: None,
                data: "{}".into(),
            }],
            upstream_request_id: None,
            response_id: None,
            usage: None,
        };
        store.append_chunks(&[batch]).await.expect("append");
        // POLL is 500 ms: 25 keep-alives at most before the re-read; 200 (4 s) bound the test.
        for _ in 0..200 {
            match items.next().await {
                Some(Ok(Followed::KeepAlive)) => {}
                Some(Ok(Followed::Chunk(chunk))) => {
                    assert_eq!(chunk.seq, 1);
                    return;
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        panic!("the stored chunk never reached the reader");
    }

    /// DU-5: at the shutdown cut an event stream that would never end on its own ends between
    /// two events — a proxied one after its closing error event `shutting_down` (RS-4), a log
    /// stream with nothing more (no `end`, RD-6).
    #[tokio::test]
    async fn a_cut_event_stream_ends_after_its_farewell_du5() {
        for farewell in [Some(shutting_down_event(Provider::Openai)), None] {
            let cut = CancellationToken::new();
            let first = Bytes::from_static(b"data: {}\n\n");
            let endless = futures::stream::once(std::future::ready(Ok(first.clone())))
                .chain(futures::stream::pending());
            let response = event_stream_response(endless, cut.clone(), farewell.clone());
            let mut body = response.into_body().into_data_stream();
            let piece = body.next().await.expect("first event").expect("bytes");
            assert_eq!(piece, first);
            cut.cancel();
            let rest = tokio::time::timeout(Duration::from_secs(5), body.collect::<Vec<_>>())
                .await
                .expect("the cut ends the stream");
            let rest: Vec<Bytes> = rest.into_iter().map(|r| r.expect("bytes")).collect();
            assert_eq!(rest, farewell.into_iter().collect::<Vec<_>>());
        }
        let event = String::from_utf8(shutting_down_event(Provider::Openai).to_vec()).unwrap();
        assert!(event.contains("\"shutting_down\""), "{event}");
    }
}
