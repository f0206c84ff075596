//! Server-sent-event framing and the streamed body, with the stream faults applied.
//!
//! A provider module describes a stream as [`StreamParts`]: the events before the content, one
//! event per content piece, and the events after it. [`stream_body`] turns that into a response
//! body, inserting delays, stalls, a garbage event, or an abrupt connection drop between content
//! pieces as [`StreamFaults`] asks.

use std::io;
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use serde::Serialize;

/// A provider stream, split where faults may be injected.
#[derive(Debug, Default)]
pub(crate) struct StreamParts {
    /// Events before the first content piece (role chunk, `message_start`, `response.created`...).
    pub head: Vec<Bytes>,
    /// One event per content piece.
    pub pieces: Vec<Bytes>,
    /// Events after the last content piece (finish, usage, `[DONE]`, `message_stop`...).
    pub tail: Vec<Bytes>,
}

/// Stream faults for one call, resolved from the config and the call's position.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct StreamFaults {
    /// Sleep before every content piece.
    pub chunk_delay: Duration,
    /// End the connection without a terminator once this many content pieces went out
    /// (a value past the last piece drops right after it, before the tail).
    pub drop_after: Option<u32>,
    /// After K content pieces, sleep M once, then go on.
    pub stall: Option<(u32, Duration)>,
    /// Emit a garbage event halfway through the content.
    pub malformed: bool,
    /// End the body cleanly once this many content pieces went out, without the tail.
    pub end_after: Option<u32>,
}

impl StreamFaults {
    fn is_clean(&self) -> bool {
        self.chunk_delay.is_zero()
            && self.drop_after.is_none()
            && self.stall.is_none()
            && !self.malformed
            && self.end_after.is_none()
    }
}

/// The garbage event of `malformed_sse`: a `data:` line that is not JSON, and a line without a
/// colon (which SSE reads as a field name with an empty value).
pub(crate) const GARBAGE_EVENT: &[u8] = b"data: {not json\nthis line has no colon\n\n";

/// `data: <json>\n\n` (OpenAI chat and completions streams).
pub(crate) fn data_event<T: Serialize + ?Sized>(v: &T) -> Bytes {
    let mut out = Vec::with_capacity(128);
    out.extend_from_slice(b"data: ");
    // Serialising our own shapes (string keys only) into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut out, v);
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

/// `event: <name>\ndata: <json>\n\n` (Anthropic and OpenAI Responses streams).
pub(crate) fn named_event<T: Serialize + ?Sized>(name: &str, v: &T) -> Bytes {
    let mut out = Vec::with_capacity(160);
    out.extend_from_slice(b"event: ");
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(b"\ndata: ");
    let _ = serde_json::to_writer(&mut out, v);
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

/// The response body for a stream. Without faults every event is ready at once, so they go out
/// as one chunk (still `transfer-encoding: chunked`, as providers send it; SSE parsers must not
/// care how events fall into chunks). With faults, a generator sends one chunk per event and
/// sleeps and breaks as asked.
///
/// A drop yields an `Err` from the body: hyper then closes the connection without the final
/// zero-length chunk, so the client sees a truncated chunked body, not a clean end.
pub(crate) fn stream_body(
    parts: StreamParts,
    faults: StreamFaults,
    open: std::sync::Arc<std::sync::atomic::AtomicU64>,
) -> Body {
    if faults.is_clean() {
        // Everything is ready at once: one data frame, one chunk on the wire, one write.
        let all: Vec<Bytes> = parts
            .head
            .into_iter()
            .chain(parts.pieces)
            .chain(parts.tail)
            .collect();
        let whole = Bytes::from(all.concat());
        return Body::from_stream(futures::stream::once(
            async move { Ok::<_, io::Error>(whole) },
        ));
    }
    let StreamParts { head, pieces, tail } = parts;
    let total = u32::try_from(pieces.len()).unwrap_or(u32::MAX);
    let garbage_at = total / 2;
    let guard = OpenStream::new(open);
    let stream = async_stream::stream! {
        let _open = guard;
        for event in head {
            yield Ok(event);
        }
        let mut sent: u32 = 0;
        let mut pieces = pieces.into_iter();
        loop {
            // At a boundary: `sent` content pieces are out.
            let last = sent >= total;
            if let Some(k) = faults.drop_after && (k == sent || (last && k > sent)) {
                // Let hyper flush what is buffered, so the client really gets `sent` pieces.
                tokio::task::yield_now().await;
                tokio::time::sleep(Duration::from_millis(1)).await;
                yield Err(io::Error::new(
                    io::ErrorKind::ConnectionAborted,
                    "mock: drop_after_chunks",
                ));
                return;
            }
            if let Some(k) = faults.end_after && (k == sent || (last && k > sent)) {
                return;
            }
            if let Some((k, pause)) = faults.stall && (k == sent || (last && k > sent)) {
                tokio::time::sleep(pause).await;
            }
            if faults.malformed && sent == garbage_at {
                yield Ok(Bytes::from_static(GARBAGE_EVENT));
            }
            let Some(piece) = pieces.next() else { break };
            if !faults.chunk_delay.is_zero() {
                tokio::time::sleep(faults.chunk_delay).await;
            }
            yield Ok(piece);
            sent += 1;
        }
        for event in tail {
            yield Ok(event);
        }
    };
    Body::from_stream(stream)
}

/// Counts a paced stream as open from creation until its body is dropped (sent or cut).
struct OpenStream(std::sync::Arc<std::sync::atomic::AtomicU64>);

impl OpenStream {
    fn new(open: std::sync::Arc<std::sync::atomic::AtomicU64>) -> OpenStream {
        open.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        OpenStream(open)
    }
}

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}
