//! Following a request's chunk log: replay, then live tail, with no gap and no duplicate
//! (SPEC RS-2, RD-4), rendered either as the provider's own stream (proxied routes, RS-4) or as
//! holdfast's numbered event stream (`GET /requests/{id}`, RD-2..RD-6).
//!
//! [`follow`] subscribes to the hub *first*, then reads the stored backlog, then takes live
//! chunks from the hub, dropping any it already sent. Whenever the hub skips ahead (a lagged
//! subscriber), says only "changed", or stays quiet for [`POLL`], it re-reads the store from its
//! position, so the store, never the hub, decides what a reader sees.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::Stream;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::hub::{Handed, Hub, HubEvent, Subscription};
use crate::provider::Provider;
use crate::sse;
use crate::store::{Chunk, ChunkKind, DynStore, StoreError};

/// Re-read the store at least this often while following.
pub(super) const POLL: Duration = Duration::from_millis(500);
/// Chunks read from the store at a time.
const PAGE: i64 = 512;
/// Most chunks whose room a follower's queue keeps from event to event (issue 30): a live
/// event or a few; the room of a page read from the store is let go.
const OUT_KEEP: usize = 16;

/// An item of a followed chunk log.
#[derive(Debug, Clone)]
pub(super) enum Followed {
    /// The next chunk.
    Chunk(Chunk),
    /// Nothing new for a keep-alive interval.
    KeepAlive,
}

/// How a reader follows a chunk log.
#[derive(Debug)]
pub(super) struct Follow {
    /// The seq it starts after.
    pub(super) after: i64,
    /// A keep-alive after this long without a chunk.
    pub(super) keepalive: Duration,
    /// A proxied stream, which has no position (RS-4): it takes events handed on ahead of the
    /// log (RS-11) and holds back the last data chunk it reads from the store until the next
    /// chunk (RS-12). Every other reader sees committed chunks only (RD-4).
    pub(super) proxied: bool,
    /// How long reads of the store may keep failing before the stream ends with
    /// `store_unavailable` (RS-4, decision 93): as long as the writers try theirs
    /// ([`crate::worker::write_window`]).
    pub(super) read_retry: Duration,
}

/// Where a reader is in a chunk log, and what it does with each chunk it is offered: the
/// handoff rules of RD-4, RS-11 and RS-12, kept apart from the store and the hub so that they
/// are unit-tested.
#[derive(Debug)]
struct Position {
    /// The seq of the last chunk sent (or dropped after a reset).
    sent: i64,
    /// The highest seq known to be committed.
    committed: i64,
    /// The attempt that wrote the last chunk sent.
    attempt: u32,
    proxied: bool,
    /// A proxied stream's last data chunk read from the store, at `sent + 1`: it may be the
    /// route's final event, committed before its outcome, so it waits for the next chunk.
    held: Option<Chunk>,
}

/// Where an offered chunk comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    /// Read from the store: committed.
    Store,
    /// Published by the hub once committed.
    Committed,
    /// Handed on by an attempt, not yet committed (RS-11).
    Ahead,
}

impl Position {
    fn new(follow: &Follow) -> Position {
        Position {
            sent: follow.after,
            committed: follow.after,
            attempt: 0,
            proxied: follow.proxied,
            held: None,
        }
    }

    /// Offers `chunk`; what to send goes to `out`, in order. `false` when it leaves a gap
    /// that only the store can fill.
    /// A chunk the store handed over is moved, a hub's is cloned only when it is sent.
    fn offer(&mut self, chunk: Cow<'_, Chunk>, source: Source, out: &mut Vec<Chunk>) -> bool {
        if source == Source::Ahead && !self.proxied {
            return true;
        }
        let known = self.committed;
        let next = self.sent + 1 + i64::from(self.held.is_some());
        if chunk.seq > next {
            // Handed-on events after a gap wait for their commit; a committed gap is read
            // from the store, from where this reader is.
            return source == Source::Ahead;
        }
        if source != Source::Ahead {
            self.committed = known.max(chunk.seq);
        }
        if chunk.seq < next {
            // Sent already, ahead of the log: where the log now says something else, the
            // events sent since never reached it (their attempt was abandoned), and the
            // stream ends with the abandoned attempt's error (RS-11) — or, where the log
            // says the request failed for good (a cancel from another node, an expired last
            // lease), with that failure: nothing re-runs it and a retry is a new request
            // (ID-6), which `attempt_abandoned` would tell the client otherwise (decision 92).
            let diverged = source != Source::Ahead
                && chunk.seq > known
                && chunk.seq <= self.sent
                && (chunk.kind != ChunkKind::Data || chunk.attempt != self.attempt);
            if diverged {
                self.held = None;
                self.sent = chunk.seq;
                if chunk.kind == ChunkKind::End && !ends_in_success(&chunk.data) {
                    out.push(chunk.into_owned());
                } else {
                    out.push(Chunk {
                        kind: ChunkKind::Reset,
                        event: None,
                        data: "".into(),
                        ..chunk.into_owned()
                    });
                }
            }
            return true;
        }
        if let Some(held) = self.held.take() {
            self.sent = held.seq;
            // A held final event is not an answer when a reset follows it.
            if chunk.kind != ChunkKind::Reset {
                self.attempt = held.attempt;
                out.push(held);
            }
        }
        if self.proxied && source == Source::Store && chunk.kind == ChunkKind::Data {
            self.held = Some(chunk.into_owned());
            return true;
        }
        self.sent = chunk.seq;
        self.attempt = chunk.attempt;
        out.push(chunk.into_owned());
        true
    }

    /// Offers `chunks` in order, stopping at a gap only the store can fill (`false`).
    fn offer_all(&mut self, chunks: &[Chunk], source: Source, out: &mut Vec<Chunk>) -> bool {
        chunks
            .iter()
            .all(|chunk| self.offer(Cow::Borrowed(chunk), source, out))
    }

    /// Where a store read starts: after what is known committed, so that a reset or an end
    /// stored where a proxied stream went ahead is seen.
    fn read_from(&self) -> i64 {
        self.committed.min(self.sent)
    }
}

/// Chunks of request `id` after seq `follow.after`, stored then live, ending after the `end`
/// chunk (and, for a proxied stream, after a `reset`). Yields [`Followed::KeepAlive`] every
/// `follow.keepalive` without a chunk. `start` is a subscription the caller took before and
/// the handed-on batches it already received from it.
pub(super) fn follow(
    store: DynStore,
    hub: Arc<Hub>,
    id: Uuid,
    follow: Follow,
    start: Option<(Subscription, Vec<Arc<Handed>>)>,
) -> impl Stream<Item = Result<Followed, StoreError>> + Send + 'static {
    async_stream::try_stream! {
        let mut position = Position::new(&follow);
        let (mut subscription, early) = match start {
            Some((subscription, early)) => (subscription, early),
            None => (hub.subscribe(id), Vec::new()),
        };
        // What to send next; its room kept from event to event (issue 30).
        let mut out = Vec::new();
        for handed in &early {
            position.offer_all(&handed.chunks, Source::Ahead, &mut out);
        }
        // A subscription taken before the request existed, which brought its first events:
        // the store holds nothing of it that the hub has not told, so the first read is
        // skipped (one store read less per new stream, issue 30).
        let mut told_everything = subscription.saw_every_event() && !early.is_empty();
        let mut quiet_since = tokio::time::Instant::now();
        // Since when reads of the store have failed, while they do.
        let mut failing_since: Option<tokio::time::Instant> = None;
        // One timer for the earlier of two deadlines, the next keep-alive and the next read of
        // the store (issue 30). Each chunk moves both later, and the timer is not moved with
        // them: when it fires early it is set again, and it is set sooner only when a wait needs
        // it. Timers moved on before every wait cost two resets and two polls per event, and a
        // timer made for each wait was registered and removed per event.
        let wake = tokio::time::sleep_until(quiet_since + POLL.min(follow.keepalive));
        tokio::pin!(wake);
        loop {
            // Backlog from the store.
            let page = if std::mem::take(&mut told_everything) {
                Vec::new()
            } else {
                match store.chunks_after(id, position.read_from(), PAGE).await {
                    Ok(page) => {
                        failing_since = None;
                        page
                    }
                    // RS-4, decision 93: a read that fails for want of the database is tried
                    // again at the next poll, keep-alives and the hub's events going on
                    // meanwhile, for as long as the writers try theirs; a database back within
                    // it costs the reader nothing. (A row it cannot read fails it at once.)
                    Err(e @ StoreError::Unavailable(_))
                        if failing_since
                            .get_or_insert_with(tokio::time::Instant::now)
                            .elapsed()
                            < follow.read_retry =>
                    {
                        tracing::debug!(%id, error = %e, "reading stored chunks failed; tried again");
                        Vec::new()
                    }
                    Err(e) => Err(e)?,
                }
            };
            let full = page.len() as i64 == PAGE;
            for chunk in page {
                position.offer(Cow::Owned(chunk), Source::Store, &mut out);
            }
            for chunk in out.drain(..) {
                let last = is_last(&chunk, follow.proxied);
                quiet_since = tokio::time::Instant::now();
                yield Followed::Chunk(chunk);
                if last {
                    return;
                }
            }
            let_go_of_a_page(&mut out);
            if full {
                continue;
            }
            // Live from the hub until it skips ahead, says "changed", or goes quiet. The store
            // is re-read after POLL without a chunk, however often keep-alives go out between.
            let mut poll_at = tokio::time::Instant::now() + POLL;
            loop {
                let due = (quiet_since + follow.keepalive).min(poll_at);
                if due < wake.deadline() || wake.is_elapsed() {
                    wake.as_mut().reset(due);
                }
                let mut reread = false;
                tokio::select! {
                    event = subscription.recv() => match event {
                        HubEvent::Chunks(chunks) | HubEvent::Logged(chunks) => {
                            reread = !position.offer_all(&chunks, Source::Committed, &mut out);
                        }
                        HubEvent::Ahead(handed) => {
                            position.offer_all(&handed.chunks, Source::Ahead, &mut out);
                        }
                        HubEvent::Changed | HubEvent::Settled(..) => reread = true,
                    },
                    // Set again at the next wait. A deadline that moved on since it was set
                    // is not due yet; a read of the store goes before a keep-alive.
                    () = &mut wake => {
                        let now = tokio::time::Instant::now();
                        if now >= poll_at {
                            reread = true;
                        } else if now >= quiet_since + follow.keepalive {
                            quiet_since = now;
                            yield Followed::KeepAlive;
                        }
                    }
                }
                for chunk in out.drain(..) {
                    let last = is_last(&chunk, follow.proxied);
                    quiet_since = tokio::time::Instant::now();
                    poll_at = quiet_since + POLL;
                    yield Followed::Chunk(chunk);
                    if last {
                        return;
                    }
                }
                let_go_of_a_page(&mut out);
                if reread {
                    break;
                }
            }
        }
    }
}

/// Lets go of a follower's emptied queue when a page of the backlog or a large batch grew it
/// past [`OUT_KEEP`]: its room is kept only at the size of live events.
fn let_go_of_a_page(out: &mut Vec<Chunk>) {
    if out.capacity() > OUT_KEEP {
        *out = Vec::new();
    }
}

/// Whether a reader's stream ends after `chunk`: the `end`, and for a proxied stream a
/// `reset` too (its attempt was abandoned, RS-4).
fn is_last(chunk: &Chunk, proxied: bool) -> bool {
    chunk.kind == ChunkKind::End || (proxied && chunk.kind == ChunkKind::Reset)
}

/// Whether an `end` chunk's `data` says the request succeeded.
fn ends_in_success(data: &str) -> bool {
    serde_json::from_str::<EndData>(data).is_ok_and(|end| end.status == "succeeded")
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
        Followed::KeepAlive => (
            Bytes::from_static(shape.stream_keepalive().unwrap_or(sse::KEEPALIVE_COMMENT)),
            false,
        ),
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
        Followed::KeepAlive => Bytes::from_static(sse::KEEPALIVE_COMMENT),
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
/// When `cut` fires (shutdown, DU-5) the body ends between two of its items, after the
/// [`shutting_down_event`] in the shape `farewell` names (a proxied stream's, a Responses
/// retrieval stream's); without one (`GET /requests/{id}`) it just ends, without `end`, so its
/// reader reconnects with its position, as after a store failure (RD-6). Dropping `body` then
/// drops whatever it holds (a proxied call's slot). The farewell is encoded only when the cut
/// comes: building it for every stream cost each about 8 k instructions (issue 30,
/// docs/benchmarks-history.md).
pub(super) fn event_stream_response<S>(
    body: S,
    cut: CancellationToken,
    farewell: Option<Provider>,
) -> axum::response::Response
where
    S: Stream<Item = Result<Bytes, std::convert::Infallible>> + Send + 'static,
{
    use axum::http::{HeaderValue, header};
    let body = async_stream::stream! {
        let mut body = std::pin::pin!(body);
        // One waiter for the whole stream, not one registered per event; polled only when the
        // body has nothing ready, and the cut looked at before each item, which costs less
        // than a poll of the waiter (issue 30).
        let mut cancelled = std::pin::pin!(cut.clone().cancelled_owned());
        loop {
            let item = if cut.is_cancelled() {
                None
            } else {
                tokio::select! {
                    biased;
                    // `next` is cancel-safe: an item is either taken whole or left in `body`.
                    item = futures::StreamExt::next(&mut body) => match item {
                        Some(item) => Some(item),
                        None => return,
                    },
                    () = &mut cancelled => None,
                }
            };
            match item {
                Some(item) => yield item,
                None => {
                    if let Some(shape) = farewell {
                        yield Ok(shutting_down_event(shape));
                    }
                    return;
                }
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

    fn data(seq: i64, attempt: u32) -> Chunk {
        Chunk {
            seq,
            attempt,
            kind: ChunkKind::Data,
            event: None,
            data: format!("event {seq}").into(),
        }
    }

    fn control(seq: i64, kind: ChunkKind) -> Chunk {
        Chunk {
            seq,
            attempt: 1,
            kind,
            event: None,
            data: "".into(),
        }
    }

    fn position(proxied: bool) -> Position {
        Position::new(&Follow {
            after: 0,
            keepalive: Duration::from_secs(15),
            proxied,
            read_retry: Duration::ZERO,
        })
    }

    /// Offers `chunks` from `source`; the seqs and kinds sent.
    fn offer(position: &mut Position, source: Source, chunks: &[Chunk]) -> Vec<(i64, ChunkKind)> {
        let mut out = Vec::new();
        position.offer_all(chunks, source, &mut out);
        out.iter().map(|c| (c.seq, c.kind)).collect()
    }

    /// A follower that read a page of the backlog does not keep a page's room for the live
    /// events after it; the room of a few live events is kept.
    #[test]
    fn a_followers_queue_lets_go_of_a_pages_room_and_keeps_a_few_events() {
        let mut out: Vec<Chunk> = Vec::with_capacity(PAGE as usize);
        let_go_of_a_page(&mut out);
        assert_eq!(out.capacity(), 0);
        let mut out: Vec<Chunk> = Vec::with_capacity(4);
        let_go_of_a_page(&mut out);
        assert!(out.capacity() >= 4, "kept");
    }

    #[test]
    fn a_positioned_reader_never_takes_an_event_before_its_commit_rd4() {
        let mut reader = position(false);
        assert_eq!(
            offer(&mut reader, Source::Ahead, &[data(1, 1), data(2, 1)]),
            vec![]
        );
        let committed = offer(&mut reader, Source::Committed, &[data(1, 1), data(2, 1)]);
        assert_eq!(committed, vec![(1, ChunkKind::Data), (2, ChunkKind::Data)]);
        assert_eq!(
            offer(&mut reader, Source::Store, &[data(3, 1)]),
            vec![(3, ChunkKind::Data)]
        );
        assert_eq!(reader.read_from(), 3);
        // A chunk after a gap (a lagged subscription) is read again from the store, from 3.
        let mut out = Vec::new();
        assert!(!reader.offer(Cow::Owned(data(6, 1)), Source::Committed, &mut out));
        assert!(out.is_empty());
        assert_eq!(reader.read_from(), 3);
    }

    #[test]
    fn a_proxied_stream_takes_events_ahead_of_the_log_once_each_rs11() {
        let mut reader = position(true);
        let ahead = offer(&mut reader, Source::Ahead, &[data(1, 1), data(2, 1)]);
        assert_eq!(ahead, vec![(1, ChunkKind::Data), (2, ChunkKind::Data)]);
        assert_eq!(
            reader.read_from(),
            0,
            "the store is read from what is committed"
        );
        assert_eq!(
            offer(&mut reader, Source::Committed, &[data(1, 1), data(2, 1)]),
            vec![]
        );
        assert_eq!(
            offer(&mut reader, Source::Store, &[data(1, 1), data(2, 1)]),
            vec![]
        );
        assert_eq!(reader.read_from(), 2);
        // Handed on after a gap (a lagged subscription): waits for the commit, no re-read.
        let mut out = Vec::new();
        assert!(reader.offer(Cow::Owned(data(5, 1)), Source::Ahead, &mut out));
        assert!(out.is_empty());
        // A committed gap is read from the store.
        assert!(!reader.offer(Cow::Owned(data(5, 1)), Source::Committed, &mut out));
    }

    #[test]
    fn a_proxied_stream_holds_back_the_last_event_it_reads_from_the_store_until_the_next_rs12() {
        let mut reader = position(true);
        let read = offer(&mut reader, Source::Store, &[data(1, 1), data(2, 1)]);
        assert_eq!(
            read,
            vec![(1, ChunkKind::Data)],
            "event 2 may be the final one"
        );
        let ended = offer(
            &mut reader,
            Source::Store,
            &[data(2, 1), control(3, ChunkKind::End)],
        );
        assert_eq!(ended, vec![(2, ChunkKind::Data), (3, ChunkKind::End)]);

        // The final event was committed and its outcome never was (the node died): the reset
        // that follows drops it, and the stream ends with the abandoned attempt's error.
        let mut reader = position(true);
        offer(&mut reader, Source::Store, &[data(1, 1), data(2, 1)]);
        let reset = offer(&mut reader, Source::Store, &[control(3, ChunkKind::Reset)]);
        assert_eq!(reset, vec![(3, ChunkKind::Reset)]);

        // Events handed on release it as well.
        let mut reader = position(true);
        offer(&mut reader, Source::Store, &[data(1, 1)]);
        let next = offer(&mut reader, Source::Ahead, &[data(2, 1)]);
        assert_eq!(next, vec![(1, ChunkKind::Data), (2, ChunkKind::Data)]);
    }

    #[test]
    fn events_sent_ahead_that_never_reached_the_log_end_the_stream_as_abandoned_rs11() {
        // Events 1..3 went out; only 1 was committed before the attempt was abandoned: the
        // sweep stored its reset at seq 2.
        let mut reader = position(true);
        offer(
            &mut reader,
            Source::Ahead,
            &[data(1, 1), data(2, 1), data(3, 1)],
        );
        let read = offer(
            &mut reader,
            Source::Store,
            &[data(1, 1), control(2, ChunkKind::Reset), data(3, 2)],
        );
        assert_eq!(
            read,
            vec![(2, ChunkKind::Reset)],
            "never another attempt's event 3"
        );
        assert!(is_last(&control(2, ChunkKind::Reset), true));

        // Failed for good instead (a cancel from another node, decision 92): its `end` where
        // event 2 went out ends the stream with that failure, not with `attempt_abandoned`,
        // whose "a retry will attach to it" would send the client's retry to the provider
        // again as a new request.
        let mut reader = position(true);
        offer(&mut reader, Source::Ahead, &[data(1, 1), data(2, 1)]);
        let cancelled = Chunk {
            data: r#"{"status":"failed","error":{"type":"cancelled","message":"cancelled through POST /requests/{id}/cancel","status":null}}"#.into(),
            ..control(2, ChunkKind::End)
        };
        let mut out = Vec::new();
        reader.offer_all(std::slice::from_ref(&cancelled), Source::Store, &mut out);
        assert_eq!(out.len(), 1, "{out:?}");
        assert_eq!((out[0].seq, out[0].kind), (2, ChunkKind::End));
        let (bytes, over) = provider_bytes(&Followed::Chunk(out.remove(0)), Provider::Openai);
        let text = String::from_utf8(bytes.to_vec()).unwrap();
        assert!(over && text.contains(r#""code":"cancelled""#), "{text}");
        assert!(!text.contains("attempt_abandoned"), "{text}");
    }

    use crate::store::sqlite::scratch;
    use crate::store::{ChunkBatch, NewChunk, NewRequest, now_ms};

    /// A reader re-reads the store at least every POLL without a chunk, however often its
    /// keep-alives go out (here every 20 ms): a chunk whose hub event it never got — another
    /// node's, whose NOTIFY was lost — still reaches it (RD-4, docs/postgres.md).
    #[tokio::test]
    async fn a_reader_whose_keepalives_are_frequent_still_polls_the_store_for_chunks_rd4() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (store, lease, id) = leased_stream(dir.path()).await;
        let follow_from_start = Follow {
            after: 0,
            keepalive: Duration::from_millis(20),
            proxied: false,
            read_retry: Duration::ZERO,
        };
        let items = follow(Arc::clone(&store), Hub::new(), id, follow_from_start, None);
        let mut items = std::pin::pin!(items);
        // A first keep-alive: the reader read the (empty) log and waits live.
        assert!(matches!(items.next().await, Some(Ok(Followed::KeepAlive))));
        // Stored without a word to this node's hub.
        store
            .append_chunks(&[first_chunk(lease)])
            .await
            .expect("append");
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
        let shapes = [Provider::Openai, Provider::Anthropic, Provider::Gemini];
        let events: std::collections::HashSet<Bytes> =
            shapes.into_iter().map(shutting_down_event).collect();
        assert_eq!(
            events.len(),
            shapes.len(),
            "each shape has its own farewell"
        );
        for farewell in shapes.map(Some).into_iter().chain([None]) {
            let cut = CancellationToken::new();
            let first = Bytes::from_static(b"data: {}\n\n");
            let endless = futures::stream::once(std::future::ready(Ok(first.clone())))
                .chain(futures::stream::pending());
            let response = event_stream_response(endless, cut.clone(), farewell);
            let mut body = response.into_body().into_data_stream();
            let piece = body.next().await.expect("first event").expect("bytes");
            assert_eq!(piece, first);
            cut.cancel();
            let rest = tokio::time::timeout(Duration::from_secs(5), body.collect::<Vec<_>>())
                .await
                .expect("the cut ends the stream");
            let rest: Vec<Bytes> = rest.into_iter().map(|r| r.expect("bytes")).collect();
            assert_eq!(
                rest,
                farewell
                    .map(shutting_down_event)
                    .into_iter()
                    .collect::<Vec<_>>()
            );
        }
        let event = String::from_utf8(shutting_down_event(Provider::Openai).to_vec()).unwrap();
        assert!(event.contains("\"shutting_down\""), "{event}");
    }

    /// The first chunk of the attempt holding `lease`.
    fn first_chunk(lease: crate::store::Lease) -> ChunkBatch {
        ChunkBatch {
            lease,
            after: 0,
            chunks: vec![NewChunk {
                event: None,
                data: "{}".into(),
            }],
            upstream_request_id: None,
            response_id: None,
            usage: None,
        }
    }

    /// A store to read from with request `id` leased, as the follow tests need it.
    async fn leased_stream(dir: &std::path::Path) -> (DynStore, crate::store::Lease, Uuid) {
        let store: DynStore = Arc::new(scratch(dir).await);
        let now = now_ms();
        let request = NewRequest {
            stream: true,
            ..NewRequest::example(7, now)
        };
        store.submit(request).await.expect("submit");
        let (lease, record) = store
            .lease_many("node", now, 30_000, &crate::store::LeaseQuota::any(1))
            .await
            .expect("lease")
            .pop()
            .expect("leased");
        (store, lease, record.id)
    }

    /// RS-4, decision 93: reads of the store that fail (here its `chunks` table renamed away
    /// under it) are tried again at each poll while keep-alives go on, and a store readable
    /// again within `read_retry` costs the reader nothing: the chunk stored meanwhile reaches
    /// it. Past `read_retry` the stream ends with the error.
    #[tokio::test]
    async fn a_reader_outlives_a_store_that_cannot_be_read_for_less_than_read_retry_rs4() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (store, lease, id) = leased_stream(dir.path()).await;
        let other = rusqlite::Connection::open(dir.path().join("t.db")).expect("open");
        let follow_with = |read_retry| Follow {
            after: 0,
            keepalive: Duration::from_millis(20),
            proxied: false,
            read_retry,
        };
        let items = follow(
            Arc::clone(&store),
            Hub::new(),
            id,
            follow_with(Duration::from_secs(600)),
            None,
        );
        let mut items = std::pin::pin!(items);
        assert!(matches!(items.next().await, Some(Ok(Followed::KeepAlive))));
        other
            .execute_batch("ALTER TABLE chunks RENAME TO chunks_away")
            .expect("rename");
        // POLL is 500 ms: 60 keep-alives 20 ms apart span two failing reads at least.
        for _ in 0..60 {
            match items.next().await {
                Some(Ok(Followed::KeepAlive)) => {}
                other => panic!("a failing read ended the reader: {other:?}"),
            }
        }
        other
            .execute_batch("ALTER TABLE chunks_away RENAME TO chunks")
            .expect("rename back");
        store
            .append_chunks(&[first_chunk(lease)])
            .await
            .expect("append");
        let mut reached = false;
        for _ in 0..200 {
            match items.next().await {
                Some(Ok(Followed::KeepAlive)) => {}
                Some(Ok(Followed::Chunk(chunk))) => {
                    assert_eq!(chunk.seq, 1);
                    reached = true;
                    break;
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        assert!(
            reached,
            "the chunk stored after the outage never reached the reader"
        );

        // Without time to wait, the first failing read ends the stream with its error.
        other
            .execute_batch("ALTER TABLE chunks RENAME TO chunks_away")
            .expect("rename");
        let items = follow(store, Hub::new(), id, follow_with(Duration::ZERO), None);
        let mut items = std::pin::pin!(items);
        assert!(matches!(items.next().await, Some(Err(_))));
    }
}
