//! Server-Sent Events: an incremental byte-level parser and an encoder.
//!
//! The worker feeds a provider's streamed response body to [`SseParser`] as the bytes arrive, in
//! whatever pieces the network delivers, and stores each event it gets back as one chunk
//! (SPEC LC-7): the parser makes each event the caller's type as it dispatches it ([`Dispatch`];
//! [`SseEvent`] is its own). The readers' side writes chunks back out with [`encode`] and keeps connections open
//! with [`comment`] (SPEC RS-4, RD-2).
//!
//! # What it follows
//!
//! The parser follows the WHATWG HTML Standard, §9.2.6 "Interpreting an event stream":
//!
//! - lines end with CRLF, LF or a lone CR; a CR that ends one push and an LF that starts the next
//!   are one line end;
//! - one UTF-8 byte order mark at the very start of the stream is skipped;
//! - a line starting with `:` is a comment; `name:value` loses exactly one space after the colon;
//!   a line without a colon is a field name with an empty value;
//! - `event` sets the event type, `data` appends its value and an LF to the data buffer, `id` sets
//!   the last event id unless the value contains NUL, `retry` counts only if it is all ASCII
//!   digits; other fields are ignored;
//! - a blank line dispatches: with an empty data buffer it only resets the event type, otherwise
//!   the final LF is removed and the event is emitted; the event type then resets, the last event
//!   id does not.
//!
//! # Where it deliberately differs
//!
//! - **Strict UTF-8.** WHATWG decodes with replacement characters; holdfast stores the text, so an
//!   invalid sequence anywhere in a complete line is [`SseError::InvalidUtf8`] instead of a silent
//!   change of the provider's bytes (SPEC IN-2). A multi-byte character split between pushes is
//!   fine: each line is decoded once it is complete.
//! - **Limits.** A line longer than `max_line` bytes or an event whose data exceeds `max_event`
//!   bytes is an error, so a garbage or hostile stream cannot grow memory without bound (IN-2).
//! - **End of stream.** WHATWG drops an event that lacks its closing blank line. [`SseParser::finish`]
//!   returns it as [`Finish::pending`] with `clean: false`, so the caller can decide. A final line
//!   without any line end is still discarded, as in WHATWG: it may be cut anywhere (mid-field,
//!   mid-JSON, mid-character) and must not be stored as if it were complete.
//! - **Errors are sticky.** After an error every later call returns the same error. If a push
//!   completes events before it hits the error, those events are returned and the error comes from
//!   the next call, so which events are delivered never depends on how the bytes were split.
//! - **Event fields.** `event` is `None` where WHATWG would say `"message"`; `id` is the last event
//!   id in force (it persists across events, as `lastEventId` does), `None` while it is empty;
//!   `retry` is the last valid `retry` value received since the previous dispatched event (WHATWG
//!   applies it to the connection at once; a parser has no connection, so it rides on the event).

use bytes::{BufMut, Bytes, BytesMut};

/// The default for both limits of [`SseParser::new`]: 16 MiB.
pub const DEFAULT_LIMIT: usize = 16 * 1024 * 1024;

/// The UTF-8 byte order mark, skipped once at the start of a stream.
const BOM: &[u8] = b"\xEF\xBB\xBF";

/// A partial-line, data or event-name buffer that grew past this many bytes is released after
/// use instead of kept.
const LINE_BUFFER_KEEP: usize = 64 * 1024;

/// One dispatched event.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SseEvent {
    /// The `event:` field; `None` if absent or empty (WHATWG's default type `message`).
    pub event: Option<String>,
    /// The `data:` lines joined with `'\n'`, without a trailing `'\n'`. Never contains CR.
    pub data: String,
    /// The last event id in force at dispatch (it persists across events); `None` while empty.
    pub id: Option<String>,
    /// The last valid `retry:` value (milliseconds) since the previous dispatched event.
    pub retry: Option<u64>,
}

/// Why a stream cannot be parsed. Every error is final for its parser.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SseError {
    /// A complete line is not valid UTF-8.
    #[error("event stream is not valid UTF-8")]
    InvalidUtf8,
    /// A line (without its line end) is longer than the limit, in bytes.
    #[error("event stream line longer than {0} bytes")]
    LineTooLong(usize),
    /// An event's data is longer than the limit, in bytes.
    #[error("event larger than {0} bytes")]
    EventTooLarge(usize),
}

/// What was left when the stream ended; see [`SseParser::finish`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finish {
    /// The event whose data lines were received but whose closing blank line was not.
    pub pending: Option<SseEvent>,
    /// True iff the stream ended on a line end and no event was pending.
    pub clean: bool,
}

/// Incremental event-stream parser: feed it bytes with [`push`](Self::push), end it with
/// [`finish`](Self::finish).
///
/// Memory is bounded by the limits: the partial line and the event name and id are at most
/// `max_line` bytes, the data buffer at most `max_event` bytes (plus one LF per line). Each byte is
/// scanned once however the stream is split.
#[derive(Debug, Clone)]
pub struct SseParser {
    /// Bytes of the line being received, whose line end has not arrived yet.
    line: Vec<u8>,
    /// The last push ended with CR: an LF starting the next push belongs to that line end.
    after_cr: bool,
    /// No line has completed yet, so the next one may start with a BOM.
    at_start: bool,
    /// WHATWG's data buffer: each `data` value followed by LF.
    data: String,
    /// WHATWG's event type buffer; empty means none.
    event: String,
    /// WHATWG's last event ID buffer; empty means none.
    last_id: String,
    /// The last valid `retry` value not yet handed out with an event.
    retry: Option<u64>,
    /// Longest accepted line, in bytes, line end excluded.
    max_line: usize,
    /// Longest accepted event data, in bytes.
    max_event: usize,
    /// The error that ended this parser, returned by every later call.
    failed: Option<SseError>,
}

impl Default for SseParser {
    fn default() -> Self {
        Self::new()
    }
}

impl SseParser {
    /// A parser with the default limits: 16 MiB per line, 16 MiB of data per event.
    pub fn new() -> Self {
        Self::with_limits(DEFAULT_LIMIT, DEFAULT_LIMIT)
    }

    /// A parser that rejects lines longer than `max_line` bytes (line end excluded) and events
    /// whose data is longer than `max_event` bytes.
    pub fn with_limits(max_line: usize, max_event: usize) -> Self {
        Self {
            line: Vec::new(),
            after_cr: false,
            at_start: true,
            data: String::new(),
            event: String::new(),
            last_id: String::new(),
            retry: None,
            max_line,
            max_event,
            failed: None,
        }
    }

    /// Feeds the next bytes of the stream, split anywhere (even inside a CRLF or a multi-byte
    /// character), and returns every event they complete, in order.
    ///
    /// # Errors
    ///
    /// [`SseError::InvalidUtf8`], [`SseError::LineTooLong`] or [`SseError::EventTooLarge`] when the
    /// stream breaks a rule. If these bytes completed events before the fault, they are returned
    /// `Ok` and the error comes from the next call. Once an error has been returned, every later
    /// call returns it again.
    pub fn push(&mut self, bytes: &[u8]) -> Result<Vec<SseEvent>, SseError> {
        let mut out = Vec::new();
        self.push_into(bytes, &mut out).map(|()| out)
    }

    /// [`SseParser::push`], appending the events to `out`: a caller that reads a whole stream
    /// keeps one vector for every read rather than one per read (issue 30).
    ///
    /// # Errors
    ///
    /// As [`SseParser::push`]: when these bytes completed events before the fault, they are
    /// appended, `Ok` is returned and the error comes from the next call.
    pub fn push_into<E: Dispatch>(
        &mut self,
        bytes: &[u8],
        out: &mut Vec<E>,
    ) -> Result<(), SseError> {
        if let Some(err) = &self.failed {
            return Err(err.clone());
        }
        let before = out.len();
        match self.feed(bytes, out) {
            Ok(()) => Ok(()),
            Err(err) => {
                self.failed = Some(err.clone());
                if out.len() == before {
                    Err(err)
                } else {
                    Ok(())
                }
            }
        }
    }

    /// Ends the stream. A final line without a line end is discarded (WHATWG); an event whose data
    /// arrived without the closing blank line is returned as `pending` instead of being dropped.
    /// `clean` is true iff neither happened.
    ///
    /// # Errors
    ///
    /// The error that ended the parser, if there was one (it may not have been returned yet, see
    /// [`push`](Self::push)).
    pub fn finish(mut self) -> Result<Finish, SseError> {
        if let Some(err) = self.failed {
            return Err(err);
        }
        let partial_line = !self.line.is_empty();
        let pending = self.dispatch();
        Ok(Finish {
            clean: !partial_line && pending.is_none(),
            pending,
        })
    }

    /// Splits `rest` into lines, joining the first with the buffered partial line.
    fn feed<E: Dispatch>(&mut self, mut rest: &[u8], out: &mut Vec<E>) -> Result<(), SseError> {
        if self.after_cr && !rest.is_empty() {
            self.after_cr = false;
            if let [b'\n', tail @ ..] = rest {
                rest = tail;
            }
        }
        while let Some(end) = memchr::memchr2(b'\n', b'\r', rest) {
            let (body, tail) = rest.split_at(end);
            rest = match tail {
                [b'\r', b'\n', tail @ ..] => tail,
                [b'\r'] => {
                    self.after_cr = true;
                    &[]
                }
                [_, tail @ ..] => tail,
                [] => &[], // unreachable: `end` is the index of a line end
            };
            if self.line.is_empty() {
                self.check_line(body.len())?;
                self.process_line(body, out)?;
            } else {
                self.check_line(self.line.len().saturating_add(body.len()))?;
                self.line.extend_from_slice(body);
                let mut line = std::mem::take(&mut self.line);
                let result = self.process_line(&line, out);
                if line.capacity() <= LINE_BUFFER_KEEP {
                    line.clear();
                    self.line = line;
                }
                result?;
            }
        }
        if !rest.is_empty() {
            self.check_line(self.line.len().saturating_add(rest.len()))?;
            self.line.extend_from_slice(rest);
        }
        Ok(())
    }

    fn check_line(&self, len: usize) -> Result<(), SseError> {
        if len > self.max_line {
            return Err(SseError::LineTooLong(self.max_line));
        }
        Ok(())
    }

    /// Interprets one complete line, without its line end.
    fn process_line<E: Dispatch>(&mut self, line: &[u8], out: &mut Vec<E>) -> Result<(), SseError> {
        let line = if std::mem::take(&mut self.at_start) {
            line.strip_prefix(BOM).unwrap_or(line)
        } else {
            line
        };
        let line = std::str::from_utf8(line).map_err(|_| SseError::InvalidUtf8)?;
        if line.is_empty() {
            out.extend(self.dispatch());
            return Ok(());
        }
        let (field, value) = match line.split_once(':') {
            Some((field, value)) => (field, value.strip_prefix(' ').unwrap_or(value)),
            None => (line, ""),
        };
        match field {
            "" => {} // a comment
            "event" => {
                self.event.clear();
                self.event.push_str(value);
            }
            "data" => {
                if self.data.len().saturating_add(value.len()) > self.max_event {
                    return Err(SseError::EventTooLarge(self.max_event));
                }
                // One allocation of the right size for the usual one-line event.
                self.data.reserve(value.len() + 1);
                self.data.push_str(value);
                self.data.push('\n');
            }
            // An id containing NUL falls through to `_` and is ignored.
            "id" if !value.contains('\0') => {
                self.last_id.clear();
                self.last_id.push_str(value);
            }
            "retry" => {
                // All ASCII digits; a value too large for u64 is ignored like any other bad one.
                if !value.is_empty()
                    && value.bytes().all(|b| b.is_ascii_digit())
                    && let Ok(ms) = value.parse()
                {
                    self.retry = Some(ms);
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// WHATWG "dispatch the event", minus the last-event-id bookkeeping that `id` already does.
    fn dispatch<E: Dispatch>(&mut self) -> Option<E> {
        if self.data.is_empty() {
            emptied(&mut self.event);
            return None;
        }
        // Without the LF after the last data line. The buffers keep their room for the next
        // event: what the caller keeps is its own copy (issue 30).
        let event = E::dispatch(
            (!self.event.is_empty()).then_some(self.event.as_str()),
            &self.data[..self.data.len() - 1],
            (!self.last_id.is_empty()).then_some(self.last_id.as_str()),
            self.retry.take(),
        );
        emptied(&mut self.data);
        emptied(&mut self.event);
        Some(event)
    }
}

/// What [`SseParser`] makes of each event it dispatches: an [`SseEvent`], or a caller's own
/// type (the worker's chunk, whose texts the log and the readers share).
pub trait Dispatch: Sized {
    /// The event named `event` (`None`: absent or empty) carrying `data` (its `data:` lines
    /// joined with LF), with the last event id in force (`None` while empty) and the `retry`
    /// received since the previous event.
    fn dispatch(event: Option<&str>, data: &str, id: Option<&str>, retry: Option<u64>) -> Self;
}

impl Dispatch for SseEvent {
    fn dispatch(event: Option<&str>, data: &str, id: Option<&str>, retry: Option<u64>) -> Self {
        SseEvent {
            event: event.map(str::to_owned),
            data: data.to_owned(),
            id: id.map(str::to_owned),
            retry,
        }
    }
}

/// Empties a buffer for the next event, keeping its room unless an event grew it past
/// [`LINE_BUFFER_KEEP`].
fn emptied(buffer: &mut String) {
    if buffer.capacity() > LINE_BUFFER_KEEP {
        *buffer = String::new();
    } else {
        buffer.clear();
    }
}

/// Splits text at CRLF, LF and lone CR, as an event-stream parser would; `""` is one empty line.
fn stream_lines(text: &str) -> impl Iterator<Item = &str> {
    let mut rest = Some(text);
    std::iter::from_fn(move || {
        let text = rest?;
        match memchr::memchr2(b'\r', b'\n', text.as_bytes()) {
            Some(end) => {
                let tail = &text[end..];
                let skip = if tail.starts_with("\r\n") { 2 } else { 1 };
                rest = Some(&tail[skip..]);
                Some(&text[..end])
            }
            None => {
                rest = None;
                Some(text)
            }
        }
    })
}

/// Encodes one event: `id: <id>` if given, `event: <name>` if given and not empty, one
/// `data: <line>` per line of `data`, then a blank line. A WHATWG parser (and [`SseParser`])
/// reproduces `data` exactly, including empty data, empty lines and leading spaces, provided it has
/// no CR: a stream cannot carry CR, so CRLF and lone CR in `data` arrive as LF. `event` is cut at its
/// first CR or LF, which would otherwise inject fields.
pub fn encode(id: Option<u64>, event: Option<&str>, data: &str) -> Bytes {
    let event = event
        .map(|name| name.split(['\r', '\n']).next().unwrap_or(""))
        .filter(|name| !name.is_empty());
    let mut digits = itoa::Buffer::new();
    let id = id.map(|id| digits.format(id));
    // The exact length: a buffer filled to its capacity becomes `Bytes` without a second
    // allocation, which one with room to spare costs (issue 30).
    let (lines, text) = stream_lines(data).fold((0, 0), |(n, len), line| (n + 1, len + line.len()));
    let capacity = id.map_or(0, |id| id.len() + 5)
        + event.map_or(0, |name| name.len() + 8)
        + 7 * lines
        + text
        + 1;
    let mut buf = BytesMut::with_capacity(capacity);
    if let Some(id) = id {
        buf.put_slice(b"id: ");
        buf.put_slice(id.as_bytes());
        buf.put_u8(b'\n');
    }
    if let Some(name) = event {
        buf.put_slice(b"event: ");
        buf.put_slice(name.as_bytes());
        buf.put_u8(b'\n');
    }
    for line in stream_lines(data) {
        buf.put_slice(b"data: ");
        buf.put_slice(line.as_bytes());
        buf.put_u8(b'\n');
    }
    buf.put_u8(b'\n');
    debug_assert_eq!(
        buf.len(),
        capacity,
        "an event's length is known before it is written"
    );
    buf.freeze()
}

/// The keep-alive comment of an idle stream (RD-2, RS-4).
pub const KEEPALIVE_COMMENT: &[u8] = b": keep-alive\n\n";

/// Encodes a comment (a keep-alive): `: <text>` per line of `text`, then a blank line. Parsers
/// ignore it; the blank line dispatches nothing because [`encode`] leaves no event open.
pub fn comment(text: &str) -> Bytes {
    let mut buf = BytesMut::with_capacity(text.len() + 4);
    for line in stream_lines(text) {
        buf.put_slice(b": ");
        buf.put_slice(line.as_bytes());
        buf.put_u8(b'\n');
    }
    buf.put_u8(b'\n');
    buf.freeze()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ev(event: Option<&str>, data: &str) -> SseEvent {
        SseEvent {
            event: event.map(str::to_owned),
            data: data.to_owned(),
            ..SseEvent::default()
        }
    }

    /// Parses `input` in one push and returns the events and the end state.
    fn parse(input: &[u8]) -> (Vec<SseEvent>, Finish) {
        let mut parser = SseParser::new();
        let events = parser.push(input).expect("valid stream");
        (events, parser.finish().expect("valid stream"))
    }

    /// Everything a parser delivers for `pieces`: the events in order, then how it ended.
    fn run(mut parser: SseParser, pieces: &[&[u8]]) -> (Vec<SseEvent>, Result<Finish, SseError>) {
        let mut events = Vec::new();
        for piece in pieces {
            match parser.push(piece) {
                Ok(got) => events.extend(got),
                Err(err) => return (events, Err(err)),
            }
        }
        (events, parser.finish())
    }

    fn split_at_all<'a>(input: &'a [u8], cuts: &[usize]) -> Vec<&'a [u8]> {
        let mut pieces = Vec::new();
        let mut start = 0;
        for &cut in cuts {
            pieces.push(&input[start..cut]);
            start = cut;
        }
        pieces.push(&input[start..]);
        pieces
    }

    const SAMPLE: &[u8] = b"\xEF\xBB\xBF: hi\r\nevent: a\r\ndata: x\xC3\xA9\r\ndata\r\n\r\nid: 7\rdata:y\r\rretry: 10\ndata: z\n\n";

    fn sample_events() -> Vec<SseEvent> {
        vec![
            ev(Some("a"), "x\u{e9}\n"),
            SseEvent {
                id: Some("7".into()),
                ..ev(None, "y")
            },
            SseEvent {
                id: Some("7".into()),
                retry: Some(10),
                ..ev(None, "z")
            },
        ]
    }

    /// Events already in the caller's vector do not count as events of this push: a fault
    /// before any new event is an error, and a fault after one is returned by the next push.
    #[test]
    fn push_into_a_vector_that_holds_events_reports_a_fault_before_any_new_event() {
        let mut parser = SseParser::new();
        let mut out: Vec<SseEvent> = Vec::new();
        parser.push_into(b"data: a\n\n", &mut out).expect("parsed");
        assert_eq!(
            parser.push_into(b"data: \xff\n", &mut out),
            Err(SseError::InvalidUtf8)
        );
        assert_eq!(out, vec![ev(None, "a")]);
        let mut parser = SseParser::new();
        parser
            .push_into(b"data: b\n\ndata: \xff\n", &mut out)
            .expect("one event first");
        assert_eq!(out, vec![ev(None, "a"), ev(None, "b")]);
        assert_eq!(
            parser.push_into(b"data: c\n\n", &mut out),
            Err(SseError::InvalidUtf8),
            "sticky"
        );
    }

    /// IN-2: the buffers an event was read into keep their room for the next event, unless the
    /// event grew them past the limit: a stream of one huge event then small ones does not hold
    /// the huge one's memory.
    #[test]
    fn event_buffers_are_kept_for_the_next_event_and_released_past_the_limit_in2() {
        let mut parser = SseParser::new();
        let mut out: Vec<SseEvent> = Vec::new();
        parser
            .push_into(b"event: delta\ndata: small\n\n", &mut out)
            .expect("parsed");
        assert!(parser.data.is_empty() && parser.data.capacity() >= 6);
        assert!(parser.event.is_empty() && parser.event.capacity() >= 5);
        let huge = format!("data: {}\n\n", "x".repeat(LINE_BUFFER_KEEP + 1));
        parser.push_into(huge.as_bytes(), &mut out).expect("parsed");
        assert_eq!(parser.data.capacity(), 0, "released");
        parser
            .push_into(b"data: after\n\n", &mut out)
            .expect("parsed");
        assert_eq!(
            out.iter().map(|e| e.data.len()).collect::<Vec<_>>(),
            [5, LINE_BUFFER_KEEP + 1, 5]
        );
        assert_eq!(out[0].event.as_deref(), Some("delta"));
        assert_eq!(out[1].event, None, "an event's name does not carry over");
    }

    #[test]
    fn splitting_at_any_byte_positions_gives_the_same_events() {
        let expected = (
            sample_events(),
            Ok(Finish {
                pending: None,
                clean: true,
            }),
        );
        assert_eq!(run(SseParser::new(), &[SAMPLE]), expected);
        for i in 0..=SAMPLE.len() {
            for j in i..=SAMPLE.len() {
                let pieces = split_at_all(SAMPLE, &[i, j]);
                assert_eq!(run(SseParser::new(), &pieces), expected, "cuts {i} {j}");
            }
        }
        let bytewise: Vec<&[u8]> = SAMPLE.chunks(1).collect();
        assert_eq!(run(SseParser::new(), &bytewise), expected);
    }

    #[test]
    fn crlf_lf_and_cr_line_ends_mix() {
        let (events, end) = parse(b"data: a\r\ndata: b\ndata: c\r\rdata: d\n\r\ndata: e\r\n\n");
        assert_eq!(
            events,
            vec![ev(None, "a\nb\nc"), ev(None, "d"), ev(None, "e")]
        );
        assert!(end.clean);
    }

    #[test]
    fn cr_ending_one_push_and_lf_starting_the_next_are_one_line_end() {
        let mut parser = SseParser::new();
        assert_eq!(parser.push(b"data: a\r").unwrap(), vec![]);
        assert_eq!(parser.push(b"").unwrap(), vec![]);
        assert_eq!(parser.push(b"\ndata: b\r").unwrap(), vec![]);
        // This LF belongs to the CR before it; the CR after it ends a blank line.
        assert_eq!(parser.push(b"\n\r").unwrap(), vec![ev(None, "a\nb")]);
        assert_eq!(parser.push(b"\n").unwrap(), vec![]);
        assert_eq!(
            parser.finish().unwrap(),
            Finish {
                pending: None,
                clean: true
            }
        );

        let mut parser = SseParser::new();
        assert_eq!(parser.push(b"data: a\r").unwrap(), vec![]);
        assert_eq!(parser.push(b"\r").unwrap(), vec![ev(None, "a")]);
    }

    #[test]
    fn comments_are_ignored() {
        let (events, end) = parse(b": keep-alive\n:\ndata: a\n: inside\ndata: b\n\n: after\n\n");
        assert_eq!(events, vec![ev(None, "a\nb")]);
        assert!(end.clean);
    }

    #[test]
    fn multi_line_data_is_joined_with_lf() {
        let (events, _) = parse(b"data: one\ndata:\ndata: three\ndata: \n\n");
        assert_eq!(events, vec![ev(None, "one\n\nthree\n")]);
    }

    #[test]
    fn exactly_one_space_after_the_colon_is_stripped() {
        let (events, _) = parse(b"data:x\n\ndata:  two\n\ndata:\tt\n\nevent:  e\ndata: a:b\n\n");
        assert_eq!(
            events,
            vec![
                ev(None, "x"),
                ev(None, " two"),
                ev(None, "\tt"),
                ev(Some(" e"), "a:b")
            ]
        );
    }

    #[test]
    fn field_without_colon_has_an_empty_value() {
        let (events, _) = parse(b"data\n\nevent\ndata\ndata\n\n");
        assert_eq!(events, vec![ev(None, ""), ev(None, "\n")]);
    }

    #[test]
    fn unknown_fields_are_ignored() {
        let (events, _) = parse(b"foo: bar\nData: no\ndata : no\ndata: yes\n\n");
        assert_eq!(events, vec![ev(None, "yes")]);
    }

    #[test]
    fn event_name_lasts_one_event_and_the_last_one_wins() {
        let input = b"event: a\nevent: b\ndata: 1\n\ndata: 2\n\nevent: gone\n\ndata: 3\n\nevent: c\nevent:\ndata: 4\n\n";
        let (events, _) = parse(input);
        assert_eq!(
            events,
            vec![
                ev(Some("b"), "1"),
                ev(None, "2"),
                ev(None, "3"),
                ev(None, "4")
            ]
        );
    }

    #[test]
    fn blank_line_with_empty_data_dispatches_nothing() {
        let (events, end) = parse(b"\n\n\nevent: x\nid: 1\n\n\n");
        assert_eq!(events, vec![]);
        assert_eq!(
            end,
            Finish {
                pending: None,
                clean: true
            }
        );
    }

    #[test]
    fn last_event_id_persists_and_ignores_values_with_nul() {
        let input =
            b"id: 1\ndata: a\n\ndata: b\n\nid: 2\0\ndata: c\n\nid\ndata: d\n\nid: 3\n\ndata: e\n\n";
        let ids: Vec<_> = parse(input).0.into_iter().map(|e| e.id).collect();
        let expected = [Some("1"), Some("1"), Some("1"), None, Some("3")];
        assert_eq!(ids, expected.map(|id| id.map(str::to_owned)));
    }

    #[test]
    fn retry_counts_only_when_all_ascii_digits() {
        let input = b"retry: 5\ndata: a\n\nretry: 1x\ndata: b\n\nretry: -1\nretry:\nretry: 99999999999999999999999\ndata: c\n\nretry: 7\n\ndata: d\n\n";
        let retries: Vec<_> = parse(input).0.into_iter().map(|e| e.retry).collect();
        assert_eq!(retries, vec![Some(5), None, None, Some(7)]);
    }

    #[test]
    fn event_without_final_blank_line_is_pending_and_unclean() {
        let mut parser = SseParser::new();
        assert_eq!(
            parser.push(b"data: a\n\nevent: e\ndata: b\n").unwrap(),
            vec![ev(None, "a")]
        );
        let end = parser.finish().unwrap();
        assert_eq!(
            end,
            Finish {
                pending: Some(ev(Some("e"), "b")),
                clean: false,
            }
        );
    }

    #[test]
    fn final_line_without_line_end_is_discarded_and_unclean() {
        let (events, end) = parse(b"data: a\n\ndata: {\"trunc");
        assert_eq!(events, vec![ev(None, "a")]);
        assert_eq!(
            end,
            Finish {
                pending: None,
                clean: false
            }
        );

        let (_, end) = parse(b"data: a\ndata: b");
        assert_eq!(
            end,
            Finish {
                pending: Some(ev(None, "a")),
                clean: false
            }
        );
    }

    #[test]
    fn stream_ending_on_a_blank_line_is_clean() {
        let (_, end) = parse(b"data: a\n\n");
        assert_eq!(
            end,
            Finish {
                pending: None,
                clean: true
            }
        );
        let (_, end) = parse(b"data: a\r\n\r");
        assert_eq!(
            end,
            Finish {
                pending: None,
                clean: true
            }
        );
        let (_, end) = parse(b"");
        assert_eq!(
            end,
            Finish {
                pending: None,
                clean: true
            }
        );
    }

    #[test]
    fn leading_bom_is_skipped_once_even_when_split() {
        let mut parser = SseParser::new();
        assert_eq!(parser.push(b"\xEF\xBB").unwrap(), vec![]);
        assert_eq!(
            parser.push(b"\xBFdata: a\n\n").unwrap(),
            vec![ev(None, "a")]
        );

        // Not at the start: the BOM is part of the field name, which is then unknown.
        let (events, _) = parse(b"\n\xEF\xBB\xBFdata: a\n\ndata: b\n\n");
        assert_eq!(events, vec![ev(None, "b")]);
        // Only one is skipped.
        let (events, _) = parse(b"\xEF\xBB\xBF\xEF\xBB\xBFdata: a\n\ndata: b\n\n");
        assert_eq!(events, vec![ev(None, "b")]);
    }

    #[test]
    fn invalid_utf8_is_an_error_but_split_characters_are_not() {
        let mut parser = SseParser::new();
        assert_eq!(parser.push(b"data: \xE2\x82").unwrap(), vec![]);
        assert_eq!(
            parser.push(b"\xAC\n\n").unwrap(),
            vec![ev(None, "\u{20ac}")]
        );

        for bad in [
            &b"data: \xFF\n"[..],
            b": \xC3\n",
            b"\xED\xA0\x80\n",
            b"data: \xE2\x82\n",
        ] {
            let mut parser = SseParser::new();
            assert_eq!(parser.push(bad), Err(SseError::InvalidUtf8), "{bad:?}");
        }
        let mut parser = SseParser::new();
        assert_eq!(
            parser.push(b"data: \xC3\xA9\xFF").unwrap(),
            vec![],
            "an incomplete line is checked when it completes"
        );
        assert_eq!(parser.push(b"\n"), Err(SseError::InvalidUtf8));
    }

    #[test]
    fn line_longer_than_the_limit_is_an_error() {
        let mut parser = SseParser::with_limits(8, 100);
        assert_eq!(
            parser.push(b"data: ab\r\n\n").unwrap(),
            vec![ev(None, "ab")]
        );
        assert_eq!(parser.push(b"data: abc\n"), Err(SseError::LineTooLong(8)));

        let mut parser = SseParser::with_limits(8, 100);
        assert_eq!(parser.push(b"data:").unwrap(), vec![]);
        assert_eq!(parser.push(b"123").unwrap(), vec![]);
        assert_eq!(
            parser.push(b"4"),
            Err(SseError::LineTooLong(8)),
            "caught before the line end"
        );

        let mut parser = SseParser::with_limits(8, 100);
        assert_eq!(parser.push(b"data:"), Ok(vec![]));
        assert_eq!(parser.push(b"1234\n"), Err(SseError::LineTooLong(8)));
    }

    #[test]
    fn event_data_larger_than_the_limit_is_an_error() {
        let mut parser = SseParser::with_limits(100, 5);
        assert_eq!(
            parser.push(b"data: ab\ndata: cd\n\n").unwrap(),
            vec![ev(None, "ab\ncd")]
        );
        assert_eq!(
            parser.push(b"data: ab\ndata: cde\n"),
            Err(SseError::EventTooLarge(5))
        );
    }

    #[test]
    fn errors_are_sticky_and_events_before_them_are_delivered() {
        let mut parser = SseParser::new();
        let got = parser.push(b"data: a\n\ndata: \xFF\n\ndata: b\n\n");
        assert_eq!(got, Ok(vec![ev(None, "a")]));
        assert_eq!(parser.push(b"data: c\n\n"), Err(SseError::InvalidUtf8));
        assert_eq!(parser.push(b""), Err(SseError::InvalidUtf8));
        assert_eq!(parser.finish(), Err(SseError::InvalidUtf8));

        let mut parser = SseParser::new();
        assert_eq!(
            parser.push(b"data: a\n\ndata: \xFF\n"),
            Ok(vec![ev(None, "a")])
        );
        assert_eq!(parser.finish(), Err(SseError::InvalidUtf8));
    }

    #[test]
    fn many_small_pushes_and_one_huge_push_stay_linear() {
        let mut input = b"data: ".to_vec();
        input.resize(1 << 20, b'x');
        input.extend_from_slice(b"\n\n");
        let mut parser = SseParser::new();
        let mut events = Vec::new();
        for byte in input.chunks(1) {
            events.extend(parser.push(byte).unwrap());
        }
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].data.len(), (1 << 20) - 6);

        let many: Vec<u8> = b"data: 0123456789\n\n".repeat(100_000);
        assert_eq!(parse(&many).0.len(), 100_000);
    }

    #[test]
    fn encoded_events_parse_back_exactly() {
        let cases: &[(Option<u64>, Option<&str>, &str)] = &[
            (Some(1), Some("message_start"), "{\"a\":1}"),
            (Some(2), None, ""),
            (None, None, "\n"),
            (None, Some("x"), "line one\nline two\n\n"),
            (Some(u64::MAX), None, " leading space\n:colon\ndata: nested"),
        ];
        for &(id, event, data) in cases {
            let (events, end) = parse(&encode(id, event, data));
            let expected = SseEvent {
                event: event.map(str::to_owned),
                data: data.to_owned(),
                id: id.map(|id| id.to_string()),
                retry: None,
            };
            assert_eq!(events, vec![expected]);
            assert!(end.clean);
        }
        assert_eq!(
            &encode(Some(3), Some("e"), "a\nb")[..],
            b"id: 3\nevent: e\ndata: a\ndata: b\n\n"
        );
        assert_eq!(&encode(None, None, "")[..], b"data: \n\n");
    }

    #[test]
    fn encode_turns_cr_into_line_breaks_and_cuts_event_names_at_line_breaks() {
        let (events, _) = parse(&encode(None, Some("a\r\nid: 9"), "x\r\ny\rz\r"));
        assert_eq!(events, vec![ev(Some("a"), "x\ny\nz\n")]);
        assert_eq!(&encode(None, Some(""), "d")[..], b"data: d\n\n");
    }

    #[test]
    fn comments_encode_as_ignored_lines() {
        assert_eq!(&comment("keep-alive")[..], b": keep-alive\n\n");
        let mut stream = comment("x\ndata: injected").to_vec();
        stream.extend_from_slice(&encode(None, None, "real"));
        stream.extend_from_slice(&comment(""));
        let (events, end) = parse(&stream);
        assert_eq!(events, vec![ev(None, "real")]);
        assert!(end.clean);
    }

    #[test]
    fn openai_stream_ends_with_done() {
        let input = b"data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}\n\n\
data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n\
data: [DONE]\n\n";
        let (events, end) = parse(input);
        assert_eq!(events.len(), 3);
        assert!(events.iter().all(|e| e.event.is_none() && e.id.is_none()));
        assert!(events[0].data.starts_with("{\"id\":\"chatcmpl-1\""));
        assert_eq!(events[2], ev(None, "[DONE]"));
        assert!(end.clean);
    }

    #[test]
    fn anthropic_stream_keeps_event_names() {
        let input = b"event: message_start\r\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"role\":\"assistant\",\"content\":[]}}\r\n\r\n\
event: ping\r\ndata: {\"type\": \"ping\"}\r\n\r\n\
event: content_block_delta\r\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hi\"}}\r\n\r\n\
event: message_stop\r\ndata: {\"type\":\"message_stop\"}\r\n\r\n";
        let (events, end) = parse(input);
        let names: Vec<_> = events.iter().map(|e| e.event.as_deref()).collect();
        assert_eq!(
            names,
            [
                Some("message_start"),
                Some("ping"),
                Some("content_block_delta"),
                Some("message_stop")
            ]
        );
        assert_eq!(events[3].data, "{\"type\":\"message_stop\"}");
        assert!(end.clean);
    }

    /// One modelled event: optional name and id, data lines, comments sprinkled in.
    #[derive(Debug, Clone)]
    struct Model {
        event: Option<String>,
        id: Option<String>,
        data: Vec<String>,
        comment: bool,
    }

    fn model() -> impl Strategy<Value = Model> {
        let text = "[a-z0-9 :é{}\"\\[\\]]{0,6}";
        (
            proptest::option::of("[a-z_]{1,8}"),
            proptest::option::of("[0-9a-z]{1,4}"),
            proptest::collection::vec(text, 1..4),
            any::<bool>(),
        )
            .prop_map(|(event, id, data, comment)| Model {
                event,
                id,
                data,
                comment,
            })
    }

    /// Renders events as lines, each ended with LF, CRLF or CR by `ends` (cycled), avoiding the
    /// one ambiguous spot: a blank line ending in LF right after a line ending in CR.
    fn render(models: &[Model], ends: &[u8]) -> Vec<u8> {
        let mut lines = Vec::new();
        for m in models {
            if m.comment {
                lines.push(": note".to_owned());
            }
            if let Some(id) = &m.id {
                lines.push(format!("id: {id}"));
            }
            if let Some(event) = &m.event {
                lines.push(format!("event:{event}"));
            }
            lines.extend(m.data.iter().map(|d| format!("data: {d}")));
            lines.push(String::new());
        }
        let mut out = Vec::new();
        let mut last_was_cr = false;
        for (i, line) in lines.iter().enumerate() {
            out.extend_from_slice(line.as_bytes());
            let end: &[u8] = match ends[i % ends.len()] % 3 {
                0 if !(line.is_empty() && last_was_cr) => b"\n",
                1 => b"\r",
                _ => b"\r\n",
            };
            last_was_cr = end == b"\r";
            out.extend_from_slice(end);
        }
        out
    }

    fn expected(models: &[Model]) -> Vec<SseEvent> {
        let mut id = None;
        models
            .iter()
            .map(|m| {
                if m.id.is_some() {
                    id.clone_from(&m.id);
                }
                SseEvent {
                    event: m.event.clone(),
                    data: m.data.join("\n"),
                    id: id.clone(),
                    retry: None,
                }
            })
            .collect()
    }

    fn cuts(len: usize, raw: &[usize]) -> Vec<usize> {
        let mut cuts: Vec<usize> = raw.iter().map(|c| c % (len + 1)).collect();
        cuts.sort_unstable();
        cuts
    }

    proptest! {
        #[test]
        fn generated_streams_parse_to_their_model_under_any_split_and_line_ends(
            models in proptest::collection::vec(model(), 0..6),
            ends in proptest::collection::vec(any::<u8>(), 1..8),
            raw_cuts in proptest::collection::vec(any::<usize>(), 0..10),
        ) {
            let input = render(&models, &ends);
            let pieces = split_at_all(&input, &cuts(input.len(), &raw_cuts));
            let clean = Finish { pending: None, clean: true };
            prop_assert_eq!(run(SseParser::new(), &pieces), (expected(&models), Ok(clean)));
        }

        #[test]
        fn arbitrary_bytes_parse_the_same_under_any_split(
            input in proptest::collection::vec(
                prop_oneof![
                    4 => proptest::sample::select(b"\r\n: adi".to_vec()),
                    1 => any::<u8>(),
                    2 => proptest::sample::select(vec![b'd', b'a', b't', b'\xEF', b'\xBB', b'\xBF']),
                ],
                0..80,
            ),
            raw_cuts in proptest::collection::vec(any::<usize>(), 0..10),
        ) {
            let whole = run(SseParser::with_limits(16, 24), &[&input]);
            let pieces = split_at_all(&input, &cuts(input.len(), &raw_cuts));
            prop_assert_eq!(run(SseParser::with_limits(16, 24), &pieces), whole);
        }

        #[test]
        fn encode_then_parse_round_trips(
            id in proptest::option::of(any::<u64>()),
            event in proptest::option::of("[^\r\n]{1,8}"),
            data in "[^\r]{0,40}",
        ) {
            let (events, end) = parse(&encode(id, event.as_deref(), &data));
            let expected = SseEvent { event, data, id: id.map(|id| id.to_string()), retry: None };
            prop_assert_eq!(events, vec![expected]);
            prop_assert!(end.clean);
        }
    }
}
