//! A provider's event stream read into the log (LC-5, LC-7, LC-11): [`StreamRead`] holds what a
//! stream has shown so far and turns each read into a [`Step`]; [`WorkerPool::stream`] drives it
//! with the provider's body and the chunk writer.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;
use uuid::Uuid;

use tracing::warn;

use super::WorkerPool;
use super::attempt::{Ending, is_event_stream};
use super::chunks::{AppendError, ChunkWriter, Pending};
use crate::hub::{Handed, HubEvent};
use crate::otel::AttemptSpan;
use crate::provider::{Order, Route};
use crate::sse::{Dispatch, SseParser};
use crate::store::{Chunk, ChunkBatch, ErrorInfo, ErrorType, Lease, NewChunk, Outcome, Usage};
use crate::upstream::Response;

/// What the attempt does next, as [`StreamRead`] decides it.
#[derive(Debug)]
pub(super) enum Step {
    /// Nothing to store yet: read on.
    Read,
    /// Store `batch`; once it is stored, end with `then` if set, or read on.
    Store {
        batch: ChunkBatch,
        then: Option<Outcome>,
    },
    /// End the attempt (with its last batch when the store writes it with the outcome).
    End(Ending),
    /// The provider failed before anything was stored: retried like a 5xx (LC-5), not before
    /// the delay its error asked for, if it asked for one.
    Transient(String, Option<Duration>),
}

/// One stream's reading state: the SSE parser, what has been stored, and what the events have
/// shown (usage, the answer's id, the opening event). Takes the provider's bytes and the chunk
/// writer's answers; touches no socket and no store, so every ending is unit-tested.
///
/// The stream succeeds only with the route's final event ([`Route::ends_stream`]); reading
/// stops there. A route without one (Gemini's) succeeds when an event finished the answer
/// ([`Route::answer_marks`]) and the body then ended cleanly (GM-3). A failure before the first stored chunk is transient (LC-5); after it,
/// terminal `stream_interrupted` (LC-7), and so is a body that ends without the final event.
/// An answer that is not an event stream at all (a body that ends without a single event) is
/// `upstream_invalid` and kept on the record (capped): the provider answered and was paid, so
/// it is not retried (LC-11). Garbage inside a stream fails it as `upstream_invalid` without
/// storing the garbage.
pub(super) struct StreamRead {
    lease: Lease,
    route: Route,
    status: u16,
    content_type: String,
    /// The provider's request id, for the outcome.
    request_id: Option<String>,
    /// The provider's request id, until the first batch records it (RS-5).
    request_id_to_store: Option<String>,
    /// The store writes a stream's last batch with its outcome in one commit.
    ends_in_one_write: bool,
    /// The provider's rate-limit and timing headers, until the first batch handed on takes
    /// them to the stream's live clients (RS-5a).
    pub(super) passed_headers: Option<crate::provider::PassedHeaders>,
    parser: SseParser,
    /// The parser's events of one read, made chunks as they are dispatched; the vector is kept
    /// from read to read (issue 30).
    events: Vec<NewChunk>,
    /// What the provider reported the attempt has cost so far: kept on every ending, since an
    /// interrupted stream was billed for what it produced.
    usage: Usage,
    /// Events stored by this attempt.
    stored: usize,
    /// The request's last seq as stored: each batch names the seq it follows, so a batch is
    /// stored once even when its write is tried again.
    last_seq: i64,
    /// The body as received while no event has been stored, kept (capped) for the record if
    /// none ever is.
    unseen: Vec<u8>,
    /// The answer's provider id is recorded once, with the batch that announced it.
    answer_id_seen: bool,
    /// Events before the route's final one: a stream of its final event alone answered nothing
    /// (decision 39).
    before_final: usize,
    /// What the stream has shown of its order: its opening event, the event saying how the
    /// answer ended (decisions 44, 108).
    order: Order,
    /// Whether an event finished the answer and no candidate it did not finish is open:
    /// complete if the body ends cleanly (GM-3).
    finished: bool,
    /// The candidates that showed part of the answer and have not finished since, a bit per
    /// index (GM-3, decision 142).
    open: u64,
    /// Whether the last event read reported the usage alone, and no part of the answer was
    /// shown before it: complete if the body ends cleanly right after it (GM-3, decisions 110,
    /// 119).
    summed_up: bool,
    /// Whether an event showed part of the answer: from then on only a finishing event ends
    /// the stream, a usage report no longer (GM-3, decision 119).
    shown: bool,
    /// The events from the one that finished the answer on, or from a usage report that may be
    /// the last event, held until the body ends or, after a usage report, until an event of the
    /// answer follows: then stored with the outcome and shown only with it, like a final event
    /// (GM-3, RS-12).
    held: Option<ChunkBatch>,
    /// Keep-alive events (Anthropic's `ping`) that came while nothing is stored, held to go
    /// with the next other event: stored alone they would make an error event that follows
    /// them terminal instead of transient, as they came in one read or two (LC-5, decision 97).
    leading: Vec<NewChunk>,
}

/// Most keep-alive events held before a stream's first other event (decision 97): past it they
/// are stored, and an error after them is the stream's own, no longer transient.
const MAX_LEADING_KEEPALIVES: usize = 64;

/// A provider's event becomes a chunk as the parser dispatches it: its texts are copied once,
/// into the shared form the log and the readers keep (issue 30). The provider's event ids and
/// `retry` are its own stream's framing and are not kept (proxied streams carry no `id:`, RS-4).
impl Dispatch for NewChunk {
    fn dispatch(event: Option<&str>, data: &str, _: Option<&str>, _: Option<u64>) -> Self {
        NewChunk {
            event: event.map(Arc::from),
            data: Arc::from(data),
        }
    }
}

impl StreamRead {
    /// The state of a 2xx answer to a stream request, before its body is read. `last_seq` is
    /// the request's last seq when the lease was taken.
    pub(super) fn new(
        lease: Lease,
        route: Route,
        status: u16,
        content_type: String,
        request_id: Option<String>,
        last_seq: i64,
        ends_in_one_write: bool,
    ) -> StreamRead {
        StreamRead {
            lease,
            route,
            status,
            content_type,
            request_id_to_store: request_id.clone(),
            request_id,
            ends_in_one_write,
            passed_headers: None,
            parser: SseParser::new(),
            events: Vec::new(),
            usage: Usage::default(),
            stored: 0,
            last_seq,
            unseen: Vec::new(),
            answer_id_seen: !route.keeps_answer_ids(),
            before_final: 0,
            order: Order::default(),
            finished: false,
            open: 0,
            summed_up: false,
            shown: false,
            held: None,
            leading: Vec::new(),
        }
    }

    /// Whether the answer's content type names an event stream; if not, the attempt ends with
    /// [`StreamRead::not_an_event_stream`] and its (capped) body.
    pub(super) fn is_event_stream(&self) -> bool {
        is_event_stream(&self.content_type)
    }

    /// The ending of an answer of another content type than an event stream (LC-11).
    pub(super) fn not_an_event_stream(&self, body: Vec<u8>) -> Ending {
        let message = format!(
            "the provider answered {} to a stream request with content-type {:?} instead of an \
             event stream",
            self.status, self.content_type
        );
        self.fail(ErrorType::UpstreamInvalid, message, Some(body))
    }

    /// The next piece of the provider's body.
    pub(super) fn on_bytes(&mut self, bytes: &[u8]) -> Step {
        if self.stored == 0 {
            keep_capped(&mut self.unseen, bytes);
        }
        let mut events = std::mem::take(&mut self.events);
        let step = match self.parser.push_into(bytes, &mut events) {
            Ok(()) if events.is_empty() => Step::Read,
            Ok(()) => self.on_events(events.drain(..)),
            Err(e) => {
                let message = format!(
                    "the provider stream (content-type {:?}) is not valid SSE: {e}",
                    self.content_type
                );
                Step::End(self.fail_keeping_unseen(ErrorType::UpstreamInvalid, message))
            }
        };
        // Emptied by the drain, its room kept for the next read.
        self.events = events;
        step
    }

    /// The events of one read, in order: checked, then stored as one batch, or the attempt
    /// ends.
    pub(super) fn on_events(&mut self, events: impl ExactSizeIterator<Item = NewChunk>) -> Step {
        let mut chunks = std::mem::take(&mut self.leading);
        chunks.reserve(events.len());
        let mut only_keepalives = true;
        let mut provider_error = None;
        // Whether an event other than a keep-alive came before the provider's error in this
        // read: had the read ended before the error, it would have been stored first.
        let mut answered_before_error = false;
        let mut ended = false;
        let mut response_id = None;
        let mut usage_changed = false;
        for event in events {
            if ended {
                // Reading stops at the final event (LC-7): what a provider sends after it in the
                // same read is neither stored nor allowed to fail a complete answer.
                break;
            }
            let inspected = self
                .route
                .inspect_event(event.event.as_deref(), &event.data)
                .and_then(|seen| {
                    self.route
                        .in_order(&seen, &mut self.order, &event.data)
                        .map(|()| seen)
                });
            let seen = match inspected {
                Ok(seen) => seen,
                Err(why) => {
                    let why = format!("{why} (content-type {:?})", self.content_type);
                    return Step::End(self.fail_keeping_unseen(ErrorType::UpstreamInvalid, why));
                }
            };
            if seen.error {
                if provider_error.is_none() {
                    answered_before_error = !only_keepalives;
                }
                provider_error = Some(event.data.clone());
            }
            if !seen.ends_stream {
                self.before_final += 1;
            }
            ended |= seen.ends_stream;
            // A candidate that shows more of the answer is open again until a reason finishes
            // it; the answer is finished once one was and none is left open (decision 142).
            self.open = (self.open | seen.candidates.open) & !seen.candidates.finished;
            self.finished = (self.finished || seen.finishes_answer) && self.open == 0;
            self.shown |= seen.shows_answer;
            // A usage report after a visible part that no `finishReason` finished is no
            // ending: the answer was cut before its end (decision 119).
            self.summed_up = seen.usage_alone && !self.shown;
            if !self.answer_id_seen && seen.answer_id.is_some() {
                self.answer_id_seen = true;
                response_id = seen.answer_id;
            }
            if let Some(reported) = seen.usage {
                self.usage.update(reported);
                usage_changed = true;
            }
            only_keepalives &= seen.keepalive && !seen.error && !seen.ends_stream;
            chunks.push(event);
        }
        if let Some(error) = &provider_error
            && self.stored == 0
            && self.held.is_none()
            && !answered_before_error
        {
            // The provider failed before anything was stored, held (a Gemini chunk that finished
            // the answer) or came in the read that brought the error (else how the bytes fell
            // into reads would decide whether a paid answer is run again): as transient as a
            // 5xx, and as patient: Google's error chunk says how long to wait as its error body
            // does (LC-5, decisions 111, 141).
            let hint = self.route.provider().retry_delay_of_body(error.as_bytes());
            return Step::Transient(format!("the provider sent an error event: {error}"), hint);
        }
        if only_keepalives
            && self.stored == 0
            && self.held.is_none()
            && chunks.len() <= MAX_LEADING_KEEPALIVES
        {
            // Nothing but keep-alives yet: they wait for the next event (decision 97), up to a
            // bound, past which they are stored as they come so that a provider that only pings
            // cannot grow the attempt's memory.
            self.leading = chunks;
            return Step::Read;
        }
        let batch = ChunkBatch {
            lease: self.lease.clone(),
            after: self.last_seq,
            chunks,
            upstream_request_id: self.request_id_to_store.take(),
            response_id,
            usage: usage_changed.then_some(self.usage),
        };
        // Events after a held batch join it, in order.
        let batch = match self.held.take() {
            Some(held) => joined(held, batch),
            None => batch,
        };
        if (self.finished || self.summed_up) && provider_error.is_none() {
            // Finished, or maybe (a usage report, which an event of the answer may still
            // follow), but complete only at a clean end of the body (GM-3): held until then.
            self.held = Some(batch);
            return Step::Read;
        }
        // The provider's final event: the answer is complete, whatever follows.
        let succeeded = ended && provider_error.is_none();
        if succeeded && self.before_final == 0 {
            // Nothing was stored yet: what came is all in `unseen`.
            let message = format!(
                "the provider stream (content-type {:?}) held its final event and nothing before \
                 it: no answer",
                self.content_type
            );
            return Step::End(self.fail_keeping_unseen(ErrorType::UpstreamInvalid, message));
        }
        if succeeded && self.ends_in_one_write {
            // Its batch is stored with the outcome: one commit for both.
            return Step::End(Ending {
                outcome: self.success(),
                last: Some(batch),
                withheld: Vec::new(),
                writing: None,
                passed_headers: None,
            });
        }
        let then = if succeeded {
            Some(self.success())
        } else {
            provider_error.map(|error| {
                self.failed(
                    ErrorType::StreamInterrupted,
                    format!("the provider failed mid-stream: {error}"),
                    None,
                )
            })
        };
        Step::Store { batch, then }
    }

    /// The chunk writer stored a batch as `chunks`.
    pub(super) fn on_stored(&mut self, chunks: &[Chunk]) {
        self.stored += chunks.len();
        self.last_seq = chunks.last().map_or(self.last_seq, |chunk| chunk.seq);
        self.unseen = Vec::new();
    }

    /// Reading the provider's body failed.
    pub(super) fn on_read_error(&mut self, error: &dyn std::fmt::Display) -> Step {
        if self.stored == 0 {
            return Step::Transient(error.to_string(), None);
        }
        let message = format!(
            "the provider stream broke after {} events: {error}",
            self.stored
        );
        let failed = self.failed(ErrorType::StreamInterrupted, message, None);
        self.then_end(failed)
    }

    /// Ends with `outcome`, after storing a held batch if there is one: what the provider sent
    /// was read and billed, so it stays (LC-7).
    fn then_end(&mut self, outcome: Outcome) -> Step {
        match self.held.take() {
            Some(batch) => Step::Store {
                batch,
                then: Some(outcome),
            },
            None => Step::End(Ending::from(outcome)),
        }
    }

    /// The provider's body ended before the route's final event: complete if an event finished
    /// the answer or the last one reported its usage alone (GM-3) — its held batch is then
    /// stored with the outcome, as a final event's is — else interrupted, or no stream at all.
    pub(super) fn on_body_end(&mut self) -> Step {
        let parsed = std::mem::take(&mut self.parser).finish();
        if parsed.is_ok()
            && let Some(batch) = self.held.take()
        {
            let outcome = self.success();
            if self.ends_in_one_write {
                return Step::End(Ending {
                    outcome,
                    last: Some(batch),
                    withheld: Vec::new(),
                    writing: None,
                    passed_headers: None,
                });
            }
            return Step::Store {
                batch,
                then: Some(outcome),
            };
        }
        let content_type = &self.content_type;
        let (kind, message) = match parsed {
            Err(e) => (
                ErrorType::UpstreamInvalid,
                format!(
                    "the provider stream (content-type {content_type:?}) is not valid SSE: {e}"
                ),
            ),
            Ok(_) if self.stored == 0 => (
                ErrorType::UpstreamInvalid,
                format!(
                    "the provider answered {} with content-type {content_type:?} and a body that \
                     ended without any event{}",
                    self.status,
                    if self.leading.is_empty() {
                        ""
                    } else {
                        " but keep-alives"
                    }
                ),
            ),
            Ok(_) => (
                ErrorType::StreamInterrupted,
                format!(
                    "the provider stream ended after {} events without its final event ({})",
                    self.stored,
                    self.route.stream_end_name()
                ),
            ),
        };
        let kept = (self.stored == 0).then(|| std::mem::take(&mut self.unseen));
        let failed = Outcome::Failed {
            error: ErrorInfo {
                kind,
                message,
                status: Some(self.status),
            },
            response: kept.map(|body| (self.status, body)),
            upstream_request_id: self.request_id.clone(),
            usage: (!self.usage.is_empty()).then_some(self.usage),
        };
        self.then_end(failed)
    }

    /// The outcome of a stream that ended with the provider's final event: its body is the
    /// chunk log, not a stored body.
    fn success(&self) -> Outcome {
        Outcome::Succeeded {
            status: self.status,
            body: Vec::new(),
            upstream_request_id: self.request_id.clone(),
            response_id: None,
            usage: (!self.usage.is_empty()).then_some(self.usage),
        }
    }

    /// A terminal failure with the usage reported so far, keeping `response` on the record.
    /// Without events, the usage is what the kept body reports (a complete JSON answer sent to
    /// a stream request): the provider billed it (RD-9).
    fn failed(&self, kind: ErrorType, message: String, response: Option<Vec<u8>>) -> Outcome {
        let usage = if self.usage.is_empty() {
            response
                .as_deref()
                .and_then(|body| self.route.usage_of_refused_answer(body))
        } else {
            Some(self.usage)
        };
        Outcome::Failed {
            error: ErrorInfo {
                kind,
                message,
                status: Some(self.status),
            },
            response: response.map(|body| (self.status, body)),
            upstream_request_id: self.request_id.clone(),
            usage,
        }
    }

    fn fail(&self, kind: ErrorType, message: String, response: Option<Vec<u8>>) -> Ending {
        Ending::from(self.failed(kind, message, response))
    }

    /// A terminal failure that keeps the body received so far when nothing was stored.
    fn fail_keeping_unseen(&mut self, kind: ErrorType, message: String) -> Ending {
        let kept = (self.stored == 0).then(|| std::mem::take(&mut self.unseen));
        self.fail(kind, message, kept)
    }
}

/// Most bytes of a stream body kept on the record when the body held no event.
const KEEP_UNSEEN: usize = 64 * 1024;

/// `held` followed by `next`: one batch, in order, carrying what either announced.
fn joined(mut held: ChunkBatch, next: ChunkBatch) -> ChunkBatch {
    held.chunks.extend(next.chunks);
    held.upstream_request_id = held.upstream_request_id.or(next.upstream_request_id);
    held.response_id = held.response_id.or(next.response_id);
    held.usage = next.usage.or(held.usage);
    held
}

/// Appends `bytes` to `kept` up to [`KEEP_UNSEEN`].
fn keep_capped(kept: &mut Vec<u8>, bytes: &[u8]) {
    let room = KEEP_UNSEEN.saturating_sub(kept.len());
    kept.extend_from_slice(&bytes[..bytes.len().min(room)]);
}

/// Most events an attempt's log may fall behind its proxied streams (RS-11).
pub(crate) const STREAM_AHEAD_EVENTS: usize = 64;
/// Most event data bytes an attempt's log may fall behind its proxied streams (RS-11).
pub(crate) const STREAM_AHEAD_BYTES: usize = 256 * 1024;

/// The gate a request's hand-ons pass (LC-9, decision 127). A cancel closes it before it
/// waits for what the request's attempt handed on, and keeps it closed until that attempt is
/// fenced out and aborted: no event reaches the stream's clients after that wait began, so
/// every event they were shown is committed by it, with the usage it reported. A hand-on
/// passes it once per read and waits only while a cancel holds it.
#[derive(Clone, Debug, Default)]
pub(super) struct HandOnGate(Arc<tokio::sync::RwLock<()>>);

impl HandOnGate {
    /// Waits while the gate is closed; the hand-on happens while the guard lives.
    pub(super) async fn pass(&self) -> tokio::sync::RwLockReadGuard<'_, ()> {
        // Open, as it nearly always is: taken without setting up a wait (issue 30). A cancel
        // that holds it, or waits for it, fails the try, and the hand-on queues behind it.
        match self.0.try_read() {
            Ok(open) => open,
            Err(_) => self.0.read().await,
        }
    }

    /// Closes the gate once a hand-on passing it now is done; it opens when the guard drops.
    pub(super) async fn close(&self) -> tokio::sync::OwnedRwLockWriteGuard<()> {
        Arc::clone(&self.0).write_owned().await
    }
}

/// The batches an attempt handed on and the writer has not yet committed (RS-11), oldest
/// first.
#[derive(Debug, Default)]
struct Window {
    pending: VecDeque<Pending>,
    events: usize,
    bytes: usize,
}

impl Window {
    fn push(&mut self, pending: Pending) {
        self.events += pending.events;
        self.bytes += pending.bytes;
        self.pending.push_back(pending);
    }

    fn pop(&mut self) -> Option<Pending> {
        let pending = self.pending.pop_front()?;
        self.events -= pending.events;
        self.bytes -= pending.bytes;
        Some(pending)
    }

    /// Lets go of the newest `n` batches: the writer gave them back (decision 126).
    fn forget_newest(&mut self, n: usize) {
        for _ in 0..n {
            let Some(pending) = self.pending.pop_back() else {
                break;
            };
            self.events -= pending.events;
            self.bytes -= pending.bytes;
        }
    }

    /// An ending whose last batch is stored with its outcome (SQLite) takes back from the
    /// writer what `lease`'s attempt handed on and is still held, and puts it before
    /// that batch: the held events, the last ones and the outcome become durable in one
    /// commit instead of two (decision 126). The ending then holds the writer's
    /// [`EndingWrite`] until its outcome write is settled.
    async fn take_back(
        &mut self,
        writer: &ChunkWriter,
        lease: &Lease,
        mut ending: Ending,
    ) -> Result<Ending, AppendError> {
        // What is committed already needs nothing of the writer.
        self.committed()?;
        if self.pending.is_empty() {
            return Ok(ending);
        }
        let Some(last) = ending.last.take() else {
            return Ok(ending);
        };
        let taken = writer.take_back(lease).await.ok_or(AppendError::Stopped)?;
        self.forget_newest(taken.handed);
        // The writer answered every older batch before it took these back.
        self.committed()?;
        let mut held = taken.batches.into_iter();
        ending.last = Some(match held.next() {
            Some(first) => joined(held.fold(first, joined), last),
            None => last,
        });
        ending.writing = taken.ending;
        Ok(ending)
    }

    /// Lets go of the batches already committed; the first failure, if one failed.
    fn committed(&mut self) -> Result<(), AppendError> {
        while let Some(oldest) = self.pending.front_mut() {
            let Some(stored) = oldest.try_stored() else {
                break;
            };
            self.pop();
            stored?;
        }
        Ok(())
    }

    /// Waits for the writer until the log is within the window's bounds of request `id`'s stream.
    async fn make_room(&mut self, writer: &ChunkWriter, id: Uuid) -> Result<(), AppendError> {
        if self.events > STREAM_AHEAD_EVENTS || self.bytes > STREAM_AHEAD_BYTES {
            writer.flush(id);
        }
        while self.events > STREAM_AHEAD_EVENTS || self.bytes > STREAM_AHEAD_BYTES {
            let Some(oldest) = self.pop() else { break };
            oldest.stored().await?;
        }
        Ok(())
    }

    /// Waits until every batch request `id`'s attempt handed on is committed.
    async fn drain(&mut self, writer: &ChunkWriter, id: Uuid) -> Result<(), AppendError> {
        if !self.pending.is_empty() {
            writer.flush(id);
        }
        while let Some(oldest) = self.pop() {
            oldest.stored().await?;
        }
        Ok(())
    }
}

impl WorkerPool {
    /// Reads a 2xx event stream into the log ([`StreamRead`] decides what each read means).
    /// Each read's events are handed on at once: to the chunk writer, which commits them and
    /// then publishes them to positioned readers, and to the proxied streams, within a bounded
    /// window (RS-11). The batch that ends the stream is stored after all of them and shown
    /// only with the outcome (RS-12). `None` when the lease was lost or chunks cannot be
    /// stored (the lease then expires and the sweep re-runs the request after a reset, LC-8).
    pub(super) async fn stream(
        &self,
        lease: &Lease,
        mut response: Response,
        mut read: StreamRead,
        trace: &mut Option<AttemptSpan>,
        gate: &HandOnGate,
    ) -> Option<Ending> {
        if !read.is_event_stream() {
            let (body, _) = self.upstreams.read_capped(&mut response).await;
            return Some(read.not_an_event_stream(body));
        }
        let mut window = Window::default();
        let mut pieces = self.upstreams.pieces(&mut response);
        let stored = loop {
            let step = match pieces.next().await {
                Ok(Some(bytes)) => read.on_bytes(&bytes),
                Ok(None) => read.on_body_end(),
                Err(e) => read.on_read_error(&e),
            };
            match (&step, trace.as_mut()) {
                (Step::Store { batch, .. }, Some(trace))
                | (
                    Step::End(Ending {
                        last: Some(batch), ..
                    }),
                    Some(trace),
                ) => trace.events(&batch.chunks),
                _ => {}
            }
            match step {
                Step::Read => {}
                Step::End(ending) => break Ok(ending),
                Step::Transient(message, hint) => {
                    let status = Some(read.status);
                    break Ok(self.transient(lease, status, message, hint).into());
                }
                // An answer id a client may retrieve or resume by (a Responses `resp_...`,
                // RD-8) is in the log before any client learns it: its batch is committed
                // first (RS-11).
                Step::Store { batch, then: None } if batch.response_id.is_some() => {
                    match self.chunks.append(batch).await {
                        Ok(stored) => {
                            read.on_stored(&stored);
                            self.hub
                                .publish(lease.id, HubEvent::Chunks(Arc::new(stored)));
                        }
                        Err(e) => break Err(e),
                    }
                }
                Step::Store { batch, then: None } => {
                    // Shut while a cancel settles what was handed on (LC-9, decision 127).
                    let open = gate.pass().await;
                    let handed = Handed {
                        chunks: batch.stored(),
                        upstream_request_id: batch.upstream_request_id.clone(),
                        passed_headers: read.passed_headers.take(),
                    };
                    read.on_stored(&handed.chunks);
                    // Queued for its commit before anyone sees it: a cancel that waits for what
                    // was handed on (LC-9) cannot fall between the two.
                    let pending = match self.chunks.hand_on(batch) {
                        Ok(pending) => pending,
                        Err(e) => break Err(e),
                    };
                    self.hub
                        .publish(lease.id, HubEvent::Ahead(Arc::new(handed)));
                    drop(open);
                    window.push(pending);
                    if let Err(e) = window.make_room(&self.chunks, lease.id).await {
                        break Err(e);
                    }
                }
                Step::Store {
                    batch,
                    then: Some(outcome),
                } => {
                    break self.chunks.append(batch).await.map(|withheld| Ending {
                        outcome,
                        last: None,
                        withheld,
                        writing: None,
                        passed_headers: None,
                    });
                }
            }
            if let Err(e) = window.committed() {
                break Err(e);
            }
        };
        // Every ending waits for what was handed on before it: stored chunks stay (LC-7), and
        // a last batch written with the outcome follows them, with what the writer still held
        // of them (decision 126).
        let stored = match stored {
            Ok(ending) => match window.take_back(&self.chunks, lease, ending).await {
                Ok(ending) => window.drain(&self.chunks, lease.id).await.map(|()| ending),
                Err(e) => Err(e),
            },
            Err(e) => Err(e),
        };
        match stored {
            Ok(ending) => Some(ending),
            Err(AppendError::LeaseLost) => None,
            Err(e) => {
                warn!(error = %e, "abandoning attempt: chunks cannot be stored");
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROLE: &str = "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\"}}]}\n\n";
    const TEXT: &str = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n";
    const USAGE: &str =
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":5}}\n\n";
    const DONE: &str = "data: [DONE]\n\n";
    const ERROR: &str = "data: {\"error\":{\"message\":\"overloaded\"}}\n\n";

    fn chat(ends_in_one_write: bool) -> StreamRead {
        let lease = Lease {
            id: uuid::Uuid::nil(),
            owner: "node/attempt".into(),
            attempt: 1,
        };
        let content_type = "text/event-stream; charset=utf-8".into();
        StreamRead::new(
            lease,
            Route::OpenaiChat,
            200,
            content_type,
            Some("req_1".into()),
            0,
            ends_in_one_write,
        )
    }

    /// Reads `bytes` and stores the batch they make, as the chunk writer would; returns the
    /// batch and the outcome it ends with.
    fn store(read: &mut StreamRead, bytes: &str) -> (ChunkBatch, Option<Outcome>) {
        let step = read.on_bytes(bytes.as_bytes());
        let Step::Store { batch, then } = step else {
            panic!("expected a batch to store, got {step:?}");
        };
        read.on_stored(&batch.stored());
        (batch, then)
    }

    fn failed(ending: &Ending) -> (ErrorType, Option<&[u8]>) {
        match &ending.outcome {
            Outcome::Failed {
                error, response, ..
            } => (
                error.kind,
                response.as_ref().map(|(_, body)| body.as_slice()),
            ),
            other => panic!("expected a failure, got {other:?}"),
        }
    }

    fn ended(step: Step) -> Ending {
        match step {
            Step::End(ending) => ending,
            other => panic!("expected the attempt to end, got {other:?}"),
        }
    }

    #[test]
    fn each_read_is_one_batch_and_the_final_event_succeeds_the_stream_lc7() {
        let mut read = chat(false);
        let (first, then) = store(&mut read, &format!("{ROLE}{TEXT}"));
        assert!(then.is_none());
        assert_eq!((first.after, first.chunks.len()), (0, 2));
        assert_eq!(
            first.upstream_request_id.as_deref(),
            Some("req_1"),
            "RS-5: with the first batch"
        );
        let (last, then) = store(&mut read, &format!("{USAGE}{DONE}"));
        assert_eq!(
            (last.after, last.chunks.len()),
            (2, 2),
            "follows the stored seq"
        );
        assert_eq!(last.upstream_request_id, None, "recorded once");
        let usage = last
            .usage
            .expect("the batch that reported usage carries it");
        assert_eq!(
            (usage.input_tokens, usage.output_tokens),
            (Some(3), Some(5))
        );
        match then {
            Some(Outcome::Succeeded {
                status: 200,
                usage: Some(u),
                ..
            }) => assert_eq!(u, usage),
            other => panic!("expected success with usage, got {other:?}"),
        }
    }

    #[test]
    fn where_the_store_ends_streams_in_one_write_the_last_batch_goes_with_the_outcome() {
        let mut read = chat(true);
        store(&mut read, ROLE);
        let ending = ended(read.on_bytes(format!("{TEXT}{DONE}").as_bytes()));
        assert!(matches!(ending.outcome, Outcome::Succeeded { .. }));
        let last = ending.last.expect("the last batch rides with the outcome");
        assert_eq!((last.after, last.chunks.len()), (1, 2));
    }

    #[test]
    fn an_event_split_across_reads_is_stored_once_whole() {
        let mut read = chat(false);
        let (head, tail) = TEXT.split_at(20);
        assert!(matches!(read.on_bytes(head.as_bytes()), Step::Read));
        let (batch, _) = store(&mut read, tail);
        assert_eq!(batch.chunks.len(), 1);
        assert!(batch.chunks[0].data.contains("\"hi\""));
    }

    #[test]
    fn what_follows_the_final_event_in_the_same_read_is_not_stored_lc7() {
        let mut read = chat(false);
        let (batch, then) = store(&mut read, &format!("{TEXT}{DONE}data: not json\n\n"));
        assert_eq!(batch.chunks.len(), 2);
        assert!(matches!(then, Some(Outcome::Succeeded { .. })));
    }

    #[test]
    fn an_error_event_is_transient_before_anything_is_stored_and_interrupts_after_lc5_lc7() {
        let mut read = chat(false);
        assert!(
            matches!(read.on_bytes(ERROR.as_bytes()), Step::Transient(m, _) if m.contains("overloaded"))
        );

        let mut read = chat(false);
        store(&mut read, ROLE);
        let (batch, then) = store(&mut read, ERROR);
        assert_eq!(
            batch.chunks.len(),
            1,
            "the error event is stored for readers"
        );
        match then {
            Some(Outcome::Failed { error, .. }) => {
                assert_eq!(error.kind, ErrorType::StreamInterrupted)
            }
            other => panic!("expected stream_interrupted, got {other:?}"),
        }
    }

    /// LC-5, LC-7, RD-9: an error event after events of the answer interrupts the stream
    /// whether they came in an earlier read or in the read that brought the error. Before, in
    /// the same read the error counted as coming before anything was stored: the paid attempt
    /// was run again, up to `max_attempts` times, and the usage it reported was lost (a
    /// break-it trial of the twenty-eighth session, with Anthropic's `overloaded_error`).
    #[test]
    fn an_error_event_in_the_read_of_the_answers_first_events_interrupts_the_stream_lc5_lc7() {
        let mut read = chat(false);
        let (batch, then) = store(&mut read, &format!("{ROLE}{TEXT}{ERROR}"));
        assert_eq!(batch.chunks.len(), 3, "the answer so far and the error");
        match then {
            Some(Outcome::Failed { error, .. }) => {
                assert_eq!(error.kind, ErrorType::StreamInterrupted)
            }
            other => panic!("expected stream_interrupted, got {other:?}"),
        }

        const START: &str = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"usage\":{\"input_tokens\":3,\"output_tokens\":1}}}\n\n";
        const OVERLOADED: &str = "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n";
        let mut read = chat(false);
        read.route = Route::AnthropicMessages;
        let (batch, then) = store(&mut read, &format!("{START}{OVERLOADED}"));
        assert_eq!(batch.chunks.len(), 2);
        assert_eq!(
            batch.usage.and_then(|u| u.input_tokens),
            Some(3),
            "the usage it reported is kept"
        );
        assert!(matches!(
            then,
            Some(Outcome::Failed { error, .. }) if error.kind == ErrorType::StreamInterrupted
        ));
    }

    /// LC-5, decision 88: Google says how long to wait in a `google.rpc.RetryInfo` detail of its
    /// error, and an error chunk in a 200 stream is that error in a chunk: before anything is
    /// stored it is transient, and its delay is the hint of the next attempt, as a 429's body's
    /// is. The stream's error was retried after holdfast's own short backoff instead.
    #[test]
    fn a_gemini_error_chunks_retry_info_is_the_hint_of_the_next_attempt_lc5() {
        const QUOTA: &str = "data: {\"error\":{\"code\":429,\"message\":\"quota\",\"status\":\"RESOURCE_EXHAUSTED\",\"details\":[{\"@type\":\"type.googleapis.com/google.rpc.RetryInfo\",\"retryDelay\":\"45.837906927s\"}]}}\r\n\r\n";
        let mut read = chat(false);
        read.route = Route::GeminiStream;
        match read.on_bytes(QUOTA.as_bytes()) {
            Step::Transient(message, hint) => {
                assert!(message.contains("RESOURCE_EXHAUSTED"), "{message}");
                assert_eq!(hint, Some(Duration::new(45, 837_906_927)));
            }
            other => panic!("expected a transient failure, got {other:?}"),
        }
        // Without the detail, no hint: holdfast's own backoff.
        let mut read = chat(false);
        read.route = Route::GeminiStream;
        let plain = "data: {\"error\":{\"code\":503,\"message\":\"overloaded\",\"status\":\"UNAVAILABLE\"}}\r\n\r\n";
        assert!(matches!(
            read.on_bytes(plain.as_bytes()),
            Step::Transient(_, None)
        ));
    }

    /// LC-5, decisions 7 and 44: Anthropic's `ping` may come before `message_start`. An error
    /// event after leading pings is the provider failing before it answered anything, transient,
    /// whether the pings came in the same read or an earlier one: they wait for the next event
    /// instead of being stored alone (decision 97).
    #[test]
    fn an_error_event_after_leading_pings_is_transient_however_the_reads_fall_lc5() {
        const PING: &str = "event: ping\ndata: {\"type\":\"ping\"}\n\n";
        const OVERLOADED: &str = "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n";
        const START: &str = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"usage\":{\"input_tokens\":3,\"output_tokens\":1}}}\n\n";
        let messages = || {
            let mut read = chat(false);
            read.route = Route::AnthropicMessages;
            read
        };
        let transient =
            |step: Step| matches!(step, Step::Transient(m, _) if m.contains("Overloaded"));
        let mut read = messages();
        assert!(transient(
            read.on_bytes(format!("{PING}{OVERLOADED}").as_bytes())
        ));
        let mut read = messages();
        assert!(matches!(read.on_bytes(PING.as_bytes()), Step::Read));
        assert!(matches!(read.on_bytes(PING.as_bytes()), Step::Read));
        assert!(
            transient(read.on_bytes(OVERLOADED.as_bytes())),
            "pings in an earlier read store nothing"
        );
        // A broken connection after pings alone is transient too.
        let mut read = messages();
        assert!(matches!(read.on_bytes(PING.as_bytes()), Step::Read));
        assert!(matches!(read.on_read_error(&"reset"), Step::Transient(..)));
        // The pings go with the event that follows them, in order.
        let mut read = messages();
        assert!(matches!(read.on_bytes(PING.as_bytes()), Step::Read));
        let (batch, then) = store(&mut read, START);
        assert!(then.is_none());
        let names: Vec<_> = batch.chunks.iter().map(|c| c.event.as_deref()).collect();
        assert_eq!(names, [Some("ping"), Some("message_start")]);
        // Held keep-alives are bounded: past the bound they are stored, as before decision 97.
        let mut read = messages();
        for _ in 0..MAX_LEADING_KEEPALIVES {
            assert!(matches!(read.on_bytes(PING.as_bytes()), Step::Read));
        }
        let (batch, _) = store(&mut read, PING);
        assert_eq!(batch.chunks.len(), MAX_LEADING_KEEPALIVES + 1);
        // A body of pings alone answered nothing: kept on the record, not retried (LC-11).
        let mut read = messages();
        assert!(matches!(read.on_bytes(PING.as_bytes()), Step::Read));
        let ending = ended(read.on_body_end());
        assert_eq!(
            failed(&ending),
            (ErrorType::UpstreamInvalid, Some(PING.as_bytes()))
        );
    }

    #[test]
    fn a_read_error_is_transient_before_anything_is_stored_and_interrupts_after_lc5_lc7() {
        let mut read = chat(false);
        assert!(matches!(
            read.on_read_error(&"connection reset"),
            Step::Transient(..)
        ));
        store(&mut read, ROLE);
        let ending = ended(read.on_read_error(&"connection reset"));
        assert_eq!(failed(&ending), (ErrorType::StreamInterrupted, None));
    }

    #[test]
    fn a_body_that_ends_before_the_final_event_is_interrupted_or_no_stream_at_all_lc7_lc11() {
        let mut read = chat(false);
        store(&mut read, ROLE);
        let ending = ended(read.on_body_end());
        assert_eq!(failed(&ending), (ErrorType::StreamInterrupted, None));

        let mut read = chat(false);
        assert!(matches!(read.on_bytes(b": just a comment\n\n"), Step::Read));
        let ending = ended(read.on_body_end());
        assert_eq!(
            failed(&ending),
            (
                ErrorType::UpstreamInvalid,
                Some(&b": just a comment\n\n"[..])
            ),
            "what came is kept on the record"
        );
    }

    /// GM-3, decision 142: with `candidateCount` above 1 every candidate ends with its own
    /// `finishReason`, so a stream whose body ends cleanly while a candidate that showed part of
    /// the answer has none is cut, not complete; so is one whose candidate shows more after its
    /// reason. Before, the first `finishReason` of any candidate finished the answer (a new-user
    /// trial of the twenty-eighth session stored such a stream as succeeded).
    #[test]
    fn a_gemini_stream_is_complete_only_when_every_candidate_shown_has_finished_gm3() {
        let chunk = |candidates: &str| format!("data: {{\"candidates\":[{candidates}]}}\r\n\r\n");
        let text = |i: u32, t: &str| {
            format!("{{\"index\":{i},\"content\":{{\"parts\":[{{\"text\":\"{t}\"}}]}}}}")
        };
        let done = |i: u32, t: &str| {
            format!(
                "{{\"index\":{i},\"content\":{{\"parts\":[{{\"text\":\"{t}\"}}]}},\"finishReason\":\"STOP\"}}"
            )
        };
        let ending_of = |chunks: &[String]| {
            let mut read = chat(false);
            read.route = Route::GeminiStream;
            for c in chunks {
                match read.on_bytes(c.as_bytes()) {
                    Step::Store { batch, then: None } => read.on_stored(&batch.stored()),
                    Step::Read => {}
                    other => panic!("unexpected {other:?}"),
                }
            }
            match read.on_body_end() {
                Step::Store {
                    then: Some(outcome),
                    ..
                } => outcome,
                step => ended(step).outcome,
            }
        };
        let succeeded = |o: &Outcome| matches!(o, Outcome::Succeeded { .. });
        // The trial's stream: candidate 0 finished, candidate 1 cut.
        let cut = ending_of(&[
            chunk(&format!("{},{}", done(0, "one done"), text(1, "two-a"))),
            chunk(&text(1, " two-b")),
        ]);
        assert!(!succeeded(&cut), "{cut:?}");
        // Candidate 1 shown in a chunk of its own, then only candidate 0 finishes.
        let cut = ending_of(&[
            chunk(&text(0, "a")),
            chunk(&text(1, "b")),
            chunk(&done(0, "")),
        ]);
        assert!(!succeeded(&cut), "{cut:?}");
        // More of the answer after the only candidate's reason.
        let cut = ending_of(&[chunk(&done(0, "A")), chunk(&text(0, "B"))]);
        assert!(!succeeded(&cut), "{cut:?}");
        // An error chunk in a read after a held finishing chunk interrupts the stream: the
        // held answer is not run again (decision 141).
        let mut read = chat(false);
        read.route = Route::GeminiStream;
        assert!(matches!(
            read.on_bytes(chunk(&done(0, "A")).as_bytes()),
            Step::Read
        ));
        let error = "data: {\"error\":{\"code\":503,\"message\":\"overloaded\",\"status\":\"UNAVAILABLE\"}}\r\n\r\n";
        match read.on_bytes(error.as_bytes()) {
            Step::Store {
                batch,
                then: Some(Outcome::Failed { error, .. }),
            } => {
                assert_eq!(error.kind, ErrorType::StreamInterrupted);
                assert_eq!(batch.chunks.len(), 2, "the held answer and the error");
            }
            other => panic!("expected stream_interrupted, got {other:?}"),
        }
        // Both finished, in one chunk or in turn: complete.
        let whole = ending_of(&[
            chunk(&format!("{},{}", text(0, "a"), text(1, "b"))),
            chunk(&format!("{},{}", done(0, ""), done(1, ""))),
        ]);
        assert!(succeeded(&whole), "{whole:?}");
        let whole = ending_of(&[
            chunk(&format!("{},{}", done(0, "one"), text(1, "two-a"))),
            chunk(&done(1, " two-b")),
        ]);
        assert!(succeeded(&whole), "{whole:?}");
    }

    #[test]
    fn a_gemini_stream_succeeds_at_a_clean_end_after_a_finish_reason_and_not_before_gm3_rs12() {
        const CHUNK: &str =
            "data: {\"candidates\":[{\"content\":{\"parts\":[{\"text\":\"hi\"}]}}]}\r\n\r\n";
        const LAST: &str = "data: {\"candidates\":[{\"content\":{\"parts\":[{\"text\":\"\"}]},\"finishReason\":\"STOP\"}],\"usageMetadata\":{\"promptTokenCount\":2,\"candidatesTokenCount\":1}}\r\n\r\n";
        let gemini = |ends_in_one_write: bool| {
            let mut read = chat(ends_in_one_write);
            read.route = Route::GeminiStream;
            read
        };
        let interrupted = |o: &Option<Outcome>| matches!(o, Some(Outcome::Failed { error, .. }) if error.kind == ErrorType::StreamInterrupted);
        // SQLite: the finishing chunk is held, not handed on, and stored with the outcome.
        let mut read = gemini(true);
        store(&mut read, CHUNK);
        assert!(matches!(read.on_bytes(LAST.as_bytes()), Step::Read), "held");
        let ending = ended(read.on_body_end());
        match &ending.outcome {
            Outcome::Succeeded { usage, .. } => {
                assert_eq!(usage.and_then(|u| u.output_tokens), Some(1));
            }
            other => panic!("expected a success, got {other:?}"),
        }
        assert_eq!(ending.last.map(|b| (b.after, b.chunks.len())), Some((1, 1)));
        // PostgreSQL: stored, then the success (RS-12 publishes it with the outcome).
        let mut read = gemini(false);
        store(&mut read, CHUNK);
        assert!(matches!(read.on_bytes(LAST.as_bytes()), Step::Read), "held");
        match read.on_body_end() {
            Step::Store { batch, then } => {
                assert_eq!(batch.chunks.len(), 1);
                assert!(matches!(then, Some(Outcome::Succeeded { .. })), "{then:?}");
            }
            other => panic!("expected the held batch, then the success: {other:?}"),
        }
        // No finishing chunk: interrupted.
        let mut read = gemini(true);
        store(&mut read, CHUNK);
        let ending = ended(read.on_body_end());
        assert_eq!(failed(&ending), (ErrorType::StreamInterrupted, None));
        // A broken connection after the finishing chunk is no clean end; what was read stays.
        let mut read = gemini(true);
        store(&mut read, CHUNK);
        assert!(matches!(read.on_bytes(LAST.as_bytes()), Step::Read));
        match read.on_read_error(&"connection reset") {
            Step::Store { batch, then } => {
                assert_eq!(batch.chunks.len(), 1);
                assert!(interrupted(&then), "{then:?}");
            }
            other => panic!("expected the held batch, then the failure: {other:?}"),
        }
    }

    /// GM-3: a chunk that reports the usage alone may be Gemini's last (Gemini 3 sends one after
    /// the answer, with no `finishReason` before it on a turn of thoughts only): held like a
    /// finishing chunk, complete at a clean end right after it; an event of the answer after it
    /// releases it, and the stream needs its ending again.
    #[test]
    fn a_gemini_stream_is_complete_at_a_clean_end_right_after_a_usage_report_gm3() {
        const CHUNK: &str =
            "data: {\"candidates\":[{\"content\":{\"parts\":[{\"text\":\"hi\"}]}}]}\r\n\r\n";
        const USAGE: &str = "data: {\"usageMetadata\":{\"promptTokenCount\":2,\"thoughtsTokenCount\":5,\"totalTokenCount\":7}}\r\n\r\n";
        const THOUGHT: &str = "data: {\"candidates\":[{\"content\":{\"parts\":[{\"text\":\"hm\",\"thought\":true},{\"text\":\"\",\"thoughtSignature\":\"c2ln\"}]}}]}\r\n\r\n";
        let gemini = || {
            let mut read = chat(true);
            read.route = Route::GeminiStream;
            read
        };
        // A turn of thoughts only, no `finishReason`, then the usage.
        let mut read = gemini();
        store(&mut read, THOUGHT);
        assert!(
            matches!(read.on_bytes(USAGE.as_bytes()), Step::Read),
            "held"
        );
        let ending = ended(read.on_body_end());
        match &ending.outcome {
            Outcome::Succeeded { usage, .. } => {
                assert_eq!(usage.and_then(|u| u.output_tokens), Some(5));
            }
            other => panic!("expected a success, got {other:?}"),
        }
        assert_eq!(ending.last.map(|b| b.chunks.len()), Some(1));
        // The usage alone, and nothing generated: the provider's answer (decision 90).
        let mut read = gemini();
        assert!(matches!(read.on_bytes(USAGE.as_bytes()), Step::Read));
        let ending = ended(read.on_body_end());
        assert!(matches!(ending.outcome, Outcome::Succeeded { .. }));
        // A usage report the answer goes on after: released with what follows, in order, and
        // the stream is complete only at its own ending.
        let mut read = gemini();
        assert!(matches!(read.on_bytes(USAGE.as_bytes()), Step::Read));
        let (batch, then) = store(&mut read, CHUNK);
        assert!(then.is_none());
        assert_eq!(batch.chunks.len(), 2);
        assert!(batch.chunks[0].data.contains("usageMetadata"));
        let ending = ended(read.on_body_end());
        assert_eq!(failed(&ending), (ErrorType::StreamInterrupted, None));
        // An empty list of candidates is none (decision 160): the chunk is a usage report, as
        // the same object answered without streaming is a success.
        let mut read = gemini();
        let empty = "data: {\"candidates\":[],\"usageMetadata\":{\"promptTokenCount\":2,\"totalTokenCount\":2}}\r\n\r\n";
        assert!(matches!(read.on_bytes(empty.as_bytes()), Step::Read));
        let ending = ended(read.on_body_end());
        assert!(matches!(ending.outcome, Outcome::Succeeded { .. }));
        // Empty counts are no usage report.
        let mut read = gemini();
        store(&mut read, CHUNK);
        store(&mut read, "data: {\"usageMetadata\":{}}\r\n\r\n");
        let ending = ended(read.on_body_end());
        assert_eq!(failed(&ending), (ErrorType::StreamInterrupted, None));
    }

    /// LC-7, GM-3, decision 119: a stream whose last event reports the usage, cut before the
    /// provider's own ending (a gateway that closes the body cleanly), is interrupted, whatever
    /// the provider: chat and completions without `[DONE]`, Messages without `message_stop`
    /// (the Responses API reports its usage in its final event only), and Gemini after a
    /// visible part no `finishReason` finished. A Gemini usage report passed for Gemini's
    /// ending there, and the cut answer was stored as a success.
    #[test]
    fn a_stream_cut_after_its_usage_report_before_its_providers_ending_is_interrupted_lc7_gm3() {
        let interrupted_with_usage = |mut read: StreamRead, reads: &[&str]| {
            for bytes in reads {
                match read.on_bytes(bytes.as_bytes()) {
                    Step::Read => {}
                    Step::Store { batch, then: None } => read.on_stored(&batch.stored()),
                    other => panic!("expected the stream to go on, got {other:?}: {reads:?}"),
                }
            }
            let outcome = match read.on_body_end() {
                Step::End(ending) => ending.outcome,
                Step::Store { then: Some(o), .. } => o,
                other => panic!("expected the attempt to end, got {other:?}"),
            };
            match outcome {
                Outcome::Failed { error, usage, .. } => {
                    assert_eq!(error.kind, ErrorType::StreamInterrupted, "{reads:?}");
                    assert!(usage.is_some(), "the usage reported is kept: {reads:?}");
                }
                other => panic!("expected stream_interrupted, got {other:?}: {reads:?}"),
            }
        };
        let on = |route: Route| {
            let mut read = chat(false);
            read.route = route;
            read
        };
        interrupted_with_usage(on(Route::OpenaiChat), &[ROLE, TEXT, USAGE]);
        interrupted_with_usage(
            on(Route::OpenaiCompletions),
            &[
                "data: {\"choices\":[{\"index\":0,\"text\":\"hi\",\"finish_reason\":\"stop\"}]}\n\n",
                "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1}}\n\n",
            ],
        );
        interrupted_with_usage(
            on(Route::AnthropicMessages),
            &[
                "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"usage\":{\"input_tokens\":3,\"output_tokens\":1}}}\n\n",
                "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"hi\"}}\n\n",
                "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":5}}\n\n",
            ],
        );
        const TEXT_SO_FAR: &str = "data: {\"candidates\":[{\"content\":{\"parts\":[{\"text\":\"The answer is\"}],\"role\":\"model\"}}]}\r\n\r\n";
        const CALL_SO_FAR: &str = "data: {\"candidates\":[{\"content\":{\"parts\":[{\"functionCall\":{\"name\":\"f\",\"args\":{}}}],\"role\":\"model\"}}]}\r\n\r\n";
        const USAGE_ALONE: &str = "data: {\"usageMetadata\":{\"promptTokenCount\":2,\"candidatesTokenCount\":3,\"totalTokenCount\":5}}\r\n\r\n";
        for route in [Route::GeminiStream, Route::GeminiV1Stream] {
            interrupted_with_usage(on(route), &[TEXT_SO_FAR, USAGE_ALONE]);
            interrupted_with_usage(on(route), &[&format!("{TEXT_SO_FAR}{USAGE_ALONE}")]);
            interrupted_with_usage(on(route), &[CALL_SO_FAR, USAGE_ALONE]);
        }
    }

    /// GM-3, decision 120: a chunk of thoughts without a `finishReason` is what every chunk of
    /// a thinking phase looks like; a clean end right after one, with no usage report, is a
    /// stream cut while the model thought, not an ending. What was read is kept.
    #[test]
    fn a_gemini_stream_that_ends_on_a_thought_with_no_finish_reason_or_usage_report_is_interrupted_gm3()
     {
        const THOUGHT: &str = "data: {\"candidates\":[{\"content\":{\"parts\":[{\"text\":\"Planning.\",\"thought\":true}],\"role\":\"model\"},\"index\":0}],\"usageMetadata\":{\"promptTokenCount\":7,\"thoughtsTokenCount\":11,\"totalTokenCount\":18}}\r\n\r\n";
        let mut read = chat(true);
        read.route = Route::GeminiStream;
        store(&mut read, THOUGHT);
        store(&mut read, THOUGHT);
        let ending = ended(read.on_body_end());
        assert_eq!(failed(&ending), (ErrorType::StreamInterrupted, None));
        match &ending.outcome {
            Outcome::Failed { usage, .. } => {
                assert_eq!(usage.and_then(|u| u.reasoning_tokens), Some(11));
            }
            other => panic!("expected a failure, got {other:?}"),
        }
    }

    #[test]
    fn a_final_event_alone_answered_nothing_decision39() {
        let mut read = chat(false);
        let ending = ended(read.on_bytes(DONE.as_bytes()));
        assert_eq!(
            failed(&ending),
            (ErrorType::UpstreamInvalid, Some(DONE.as_bytes()))
        );
    }

    #[test]
    fn garbage_inside_a_stream_is_upstream_invalid_and_not_stored_lc11() {
        let mut read = chat(false);
        let ending = ended(read.on_bytes(b"data: <html>\n\n"));
        assert_eq!(
            failed(&ending),
            (ErrorType::UpstreamInvalid, Some(&b"data: <html>\n\n"[..]))
        );

        let mut read = chat(false);
        store(&mut read, ROLE);
        let ending = ended(read.on_bytes(b"data: <html>\n\n"));
        assert_eq!(
            failed(&ending),
            (ErrorType::UpstreamInvalid, None),
            "only an unstored body is kept"
        );
    }

    #[test]
    fn another_content_type_is_not_an_event_stream_lc11() {
        let lease = Lease {
            id: uuid::Uuid::nil(),
            owner: "node/attempt".into(),
            attempt: 1,
        };
        let read = StreamRead::new(
            lease,
            Route::OpenaiChat,
            200,
            "text/html".into(),
            None,
            0,
            false,
        );
        assert!(!read.is_event_stream());
        let ending = read.not_an_event_stream(b"<html>".to_vec());
        assert_eq!(
            failed(&ending),
            (ErrorType::UpstreamInvalid, Some(&b"<html>"[..]))
        );
    }

    /// LC-9, decision 127: a cancel's close waits for a hand-on passing the gate, and a hand-on
    /// waits while the gate is shut, until the cancel lets go.
    #[tokio::test]
    async fn a_hand_on_waits_while_a_cancel_holds_its_gate_shut_lc9() {
        use futures::FutureExt;
        let gate = HandOnGate::default();
        let passing = gate.pass().await;
        let close = gate.close();
        tokio::pin!(close);
        assert!(
            (&mut close).now_or_never().is_none(),
            "the hand-on under way ends first"
        );
        drop(passing);
        let shut = close.await;
        assert!(
            gate.pass().now_or_never().is_none(),
            "no hand-on while the cancel holds it shut"
        );
        let waiting = tokio::spawn({
            let gate = gate.clone();
            async move {
                let _open = gate.pass().await;
            }
        });
        drop(shut);
        waiting
            .await
            .expect("the hand-on goes on once the cancel lets go");
    }
}
