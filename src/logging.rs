//! The text log's field formatter and both logs' timestamps: tracing-subscriber's default
//! text, written for less.
//!
//! The library's default field formatter paints every field's name and its `=` through
//! `nu_ansi_term` even when the log goes to a file or a pipe and paints nothing: about half of
//! what the `request finished` line and the attempt's span cost (docs/benchmarks-history.md,
//! "Instructions"; decision 133). [`PlainFields`] writes an ordinary field (`name=value`, the
//! value's `Debug`) itself when the writer has no ANSI escapes, and hands everything else to the
//! library's own visitor, unchanged: a coloured log, the message (its control characters
//! escaped), a raw identifier's name, an error and its sources, a `log` record's `log.*`
//! metadata. A string that needs no escape and a whole number are written without `Debug`'s
//! machinery (issue 30). The text is the default's byte for byte (the tests below pin it).
//!
//! [`PlainTime`] writes each line's timestamp as the library's `SystemTime` does, its digits
//! without `fmt` (about 2.4 k instructions of the 12 k of a `request finished` line).
//!
//! [`PlainEvent`] writes the rest of a text line as the library's default (`Full`) format does
//! with no ANSI escapes: the level, the spans with their fields, the target, each piece with
//! `write_str` where the library goes through `write!` and `nu_ansi_term`'s painting of nothing
//! for each (issue 30). A coloured log and a `log` record go to the library's own format.

use std::fmt;
use std::time::{SystemTime, UNIX_EPOCH};

use chrono::{DateTime, Datelike, Timelike, Utc};
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::field::{RecordFields, VisitOutput};
use tracing_subscriber::fmt::format::{DefaultFields, DefaultVisitor, Format, Full, Writer};
use tracing_subscriber::fmt::time::FormatTime;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, FormattedFields};
use tracing_subscriber::registry::LookupSpan;

/// The log's timestamps: UTC to the microsecond, `2026-12-07T03:58:12.123456Z`, the text of
/// tracing-subscriber's default `SystemTime` timer (see the module's doc).
#[derive(Debug, Default, Clone, Copy)]
pub struct PlainTime;

impl FormatTime for PlainTime {
    fn format_time(&self, w: &mut Writer<'_>) -> fmt::Result {
        match timestamp(SystemTime::now()) {
            Some(text) => w.write_str(std::str::from_utf8(&text).map_err(|_| fmt::Error)?),
            // Before 1970 or after 9999: the library's own text, which has signs for them.
            None => tracing_subscriber::fmt::time::SystemTime.format_time(w),
        }
    }
}

/// `at` as [`PlainTime`] writes it; `None` outside the years 1970 to 9999.
fn timestamp(at: SystemTime) -> Option<[u8; 27]> {
    let since = at.duration_since(UNIX_EPOCH).ok()?;
    let at = DateTime::<Utc>::from_timestamp(
        i64::try_from(since.as_secs()).ok()?,
        since.subsec_nanos(),
    )?;
    let year = u32::try_from(at.year()).ok().filter(|year| *year <= 9999)?;
    let mut text = *b"0000-00-00T00:00:00.000000Z";
    let mut digits = |from: usize, width: usize, mut value: u32| {
        for slot in text[from..from + width].iter_mut().rev() {
            // `value % 10` is one digit.
            *slot = b'0' + (value % 10) as u8;
            value /= 10;
        }
    };
    digits(0, 4, year);
    digits(5, 2, at.month());
    digits(8, 2, at.day());
    digits(11, 2, at.hour());
    digits(14, 2, at.minute());
    digits(17, 2, at.second());
    digits(20, 6, since.subsec_micros());
    Some(text)
}

/// The line format of `serve`'s text log (see the module's doc): the library's default
/// format's text, timestamps from `timer`.
#[derive(Debug, Clone)]
pub struct PlainEvent<T = PlainTime> {
    timer: T,
    /// The library's default format with the same timer, for what this one hands over.
    library: Format<Full, T>,
}

impl<T: FormatTime + Clone> PlainEvent<T> {
    /// Lines stamped by `timer`.
    pub fn new(timer: T) -> Self {
        Self {
            library: tracing_subscriber::fmt::format().with_timer(timer.clone()),
            timer,
        }
    }
}

impl Default for PlainEvent {
    fn default() -> Self {
        Self::new(PlainTime)
    }
}

impl<S, N, T> FormatEvent<S, N> for PlainEvent<T>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    T: FormatTime,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let meta = event.metadata();
        // A `log` record's line shows the record's own target, which the library reads from
        // its `log.*` fields.
        if writer.has_ansi_escapes() || meta.fields().field("log.target").is_some() {
            return self.library.format_event(ctx, writer, event);
        }
        if self.timer.format_time(&mut writer).is_err() {
            writer.write_str("<unknown time>")?;
        }
        writer.write_str(level_text(*meta.level()))?;
        if let Some(scope) = ctx.event_scope() {
            let mut seen = false;
            for span in scope.from_root() {
                writer.write_str(span.metadata().name())?;
                seen = true;
                if let Some(fields) = span.extensions().get::<FormattedFields<N>>()
                    && !fields.is_empty()
                {
                    writer.write_char('{')?;
                    writer.write_str(fields)?;
                    writer.write_char('}')?;
                }
                writer.write_char(':')?;
            }
            if seen {
                writer.write_char(' ')?;
            }
        }
        writer.write_str(meta.target())?;
        writer.write_str(": ")?;
        ctx.format_fields(writer.by_ref(), event)?;
        writer.write_char('\n')
    }
}

/// The level as the library writes it between the timestamp and the spans: right-aligned to
/// five characters, a space on each side.
fn level_text(level: Level) -> &'static str {
    match level {
        Level::TRACE => " TRACE ",
        Level::DEBUG => " DEBUG ",
        Level::INFO => "  INFO ",
        Level::WARN => "  WARN ",
        Level::ERROR => " ERROR ",
    }
}

/// The field formatter of `serve`'s text log (see the module's doc).
#[derive(Debug, Default, Clone, Copy)]
pub struct PlainFields;

impl<'writer> FormatFields<'writer> for PlainFields {
    fn format_fields<R: RecordFields>(&self, writer: Writer<'writer>, fields: R) -> fmt::Result {
        if writer.has_ansi_escapes() {
            return DefaultFields::new().format_fields(writer, fields);
        }
        let mut visitor = PlainVisitor {
            writer,
            is_empty: true,
            result: Ok(()),
        };
        fields.record(&mut visitor);
        visitor.result
    }
}

/// Writes fields as the library's `DefaultVisitor` does with no ANSI escapes: separated by one
/// space, each `name=` and its value's `Debug`.
struct PlainVisitor<'a> {
    writer: Writer<'a>,
    /// No field written yet: the next one needs no separating space.
    is_empty: bool,
    result: fmt::Result,
}

impl PlainVisitor<'_> {
    /// Has the library's visitor record one field where this one's text stands, as if it had
    /// written every field so far.
    fn delegate(&mut self, field: &Field, record: impl FnOnce(&mut DefaultVisitor<'_>)) {
        let mut default = DefaultVisitor::new(self.writer.by_ref(), self.is_empty);
        record(&mut default);
        self.result = default.finish();
        // It writes every field but a `log` record's metadata, which its event line has
        // already shown.
        self.is_empty &= field.name().starts_with("log.");
    }

    /// Whether the library's visitor writes `field` differently from an ordinary field.
    fn is_special(field: &Field) -> bool {
        let name = field.name();
        name == "message" || name.starts_with("r#") || name.starts_with("log.")
    }

    /// Writes an ordinary field's `name=` and then its value with `value`.
    fn write_field(&mut self, field: &Field, value: impl FnOnce(&mut Writer<'_>) -> fmt::Result) {
        self.result = if std::mem::take(&mut self.is_empty) {
            Ok(())
        } else {
            self.writer.write_char(' ')
        }
        .and_then(|()| self.writer.write_str(field.name()))
        .and_then(|()| self.writer.write_char('='))
        .and_then(|()| value(&mut self.writer));
    }

    /// A whole number: its `Debug` is its decimal digits, written here without the formatting
    /// machinery; a special field goes to the library's visitor through `default`.
    fn record_integer(
        &mut self,
        field: &Field,
        value: impl itoa::Integer,
        default: impl FnOnce(&mut DefaultVisitor<'_>),
    ) {
        if self.result.is_err() {
            return;
        }
        if Self::is_special(field) {
            self.delegate(field, default);
        } else {
            self.write_field(field, |w| w.write_str(itoa::Buffer::new().format(value)));
        }
    }
}

/// Whether `value`'s `Debug` is itself in quotes: printable ASCII, no quote or backslash. The
/// log's names, routes, models and statuses are; anything else goes through `Debug`, whose
/// escapes cost a check per character (issue 30).
fn quotes_as_is(value: &str) -> bool {
    value
        .bytes()
        .all(|b| (b' '..=b'~').contains(&b) && b != b'"' && b != b'\\')
}

impl Visit for PlainVisitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if self.result.is_err() {
            return;
        }
        if Self::is_special(field) {
            self.delegate(field, |v| v.record_str(field, value));
        } else if quotes_as_is(value) {
            self.write_field(field, |w| {
                w.write_char('"')?;
                w.write_str(value)?;
                w.write_char('"')
            });
        } else {
            self.record_debug(field, &value);
        }
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.record_integer(field, value, |v| v.record_u64(field, value));
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.record_integer(field, value, |v| v.record_i64(field, value));
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        if self.result.is_err() {
            return;
        }
        self.delegate(field, |v| v.record_error(field, value));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if self.result.is_err() {
            return;
        }
        if Self::is_special(field) {
            self.delegate(field, |v| v.record_debug(field, value));
            return;
        }
        self.write_field(field, |w| write!(w, "{value:?}"));
    }
}

#[cfg(test)]
mod tests {
    use std::io;
    use std::sync::{Arc, Mutex};

    use tracing::{error, info, info_span, warn};
    use tracing_subscriber::fmt::MakeWriter;

    use super::*;

    /// [`PlainTime`]'s text is the library timer's: chrono's calendar, the library's layout
    /// (`{year:04}-{month:02}-{day:02}T{hour:02}:{minute:02}:{second:02}.{micros:06}Z`).
    #[test]
    fn timestamps_are_written_as_the_librarys_system_time_writes_them() {
        use std::time::Duration;
        let text = |secs: u64, nanos: u32| {
            timestamp(UNIX_EPOCH + Duration::new(secs, nanos))
                .map(|t| String::from_utf8(t.to_vec()).expect("ascii"))
        };
        assert_eq!(text(0, 0).as_deref(), Some("1970-01-01T00:00:00.000000Z"));
        assert_eq!(
            text(1_796_612_651, 123_456_789).as_deref(),
            Some("2026-12-07T03:04:11.123456Z")
        );
        // 2000-02-29, a leap day; 9999's last microsecond; the year after is left to the library.
        assert_eq!(
            text(951_782_400, 999_999_999).as_deref(),
            Some("2000-02-29T00:00:00.999999Z")
        );
        assert_eq!(
            text(253_402_300_799, 999_999_000).as_deref(),
            Some("9999-12-31T23:59:59.999999Z")
        );
        assert_eq!(text(253_402_300_800, 0), None);
        assert_eq!(timestamp(UNIX_EPOCH - Duration::from_secs(1)), None);
        for secs in (0..253_402_300_800u64).step_by(1_111_111_111) {
            let nanos = (secs % 1_000_000_000) as u32;
            let expected = DateTime::<Utc>::from_timestamp(secs as i64, nanos)
                .expect("in range")
                .format("%Y-%m-%dT%H:%M:%S%.6fZ")
                .to_string();
            assert_eq!(text(secs, nanos), Some(expected));
        }
        // And the library writes the same shape now: the same text up to the minute, unless a
        // minute turned between the two (tried again, a bounded number of times).
        let library = || {
            let mut line = String::new();
            tracing_subscriber::fmt::time::SystemTime
                .format_time(&mut Writer::new(&mut line))
                .expect("written");
            line
        };
        let ours = || {
            let mut line = String::new();
            PlainTime
                .format_time(&mut Writer::new(&mut line))
                .expect("written");
            line
        };
        let same = (0..5).any(|_| {
            let (before, mine, after) = (library(), ours(), library());
            assert_eq!(mine.len(), before.len(), "{mine} {before}");
            before[..16] == mine[..16] && mine[..16] == after[..16]
        });
        assert!(
            same,
            "the library's timestamps and ours disagree to the minute"
        );
    }

    /// A writer every line of one subscriber goes to, read back as text.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.lock().expect("capture").extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    impl<'a> MakeWriter<'a> for Captured {
        type Writer = Captured;
        fn make_writer(&'a self) -> Self::Writer {
            self.clone()
        }
    }

    #[derive(Debug)]
    struct Cause;
    impl fmt::Display for Cause {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("the disk is \x1b[31mfull\x1b[0m")
        }
    }
    impl std::error::Error for Cause {}

    #[derive(Debug)]
    struct Failure(Cause);
    impl fmt::Display for Failure {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("the write failed")
        }
    }
    impl std::error::Error for Failure {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    /// Every kind of field and line the log has, or a library or a `log` record may give it.
    fn log_everything() {
        let span = info_span!(
            "attempt",
            id = %"0192-abc",
            attempt = 2_u32,
            route = "openai.chat",
            trace_id = tracing::field::Empty,
        );
        span.record("trace_id", "4bf92f3577b34da6");
        let _entered = span.enter();
        let inner = info_span!("inner", r#type = "x", empty = tracing::field::Empty);
        let _inner = inner.enter();
        info!(
            id = %"0192-abc",
            namespace = "team \"a\"\n",
            model = "gpt-4o-mini",
            error_type = None::<&str>,
            attempts = 1_u32,
            recoveries = 0_u64,
            duration_ms = -3_i64,
            ratio = 0.5_f64,
            cached = true,
            upstream_status = Some(200_u16),
            "request finished"
        );
        warn!(cause = %"a \x1b[2Jclear", "attempt \x1b[31mfailed\x1b[0m; retried\r\n");
        let failure = Failure(Cause);
        error!(
            error = &failure as &(dyn std::error::Error + 'static),
            "store failed"
        );
        error!(
            error = &Cause as &(dyn std::error::Error + 'static),
            r#type = "raw",
            "log.target" = "hyper::proto",
            "log.line" = 12_u32,
            after = 1,
        );
        info!("log.target" = "hyper::client", after_log = 2);
        info!(
            plain = "openai.chat",
            spaced = "a b ~!",
            tab = "a\tb",
            backslash = "a\\b",
            delete = "a\x7fb",
            accented = "caf\u{e9} \u{2615}",
            combining = "e\u{301}",
            empty = "",
            big = u64::MAX,
            small = i64::MIN,
            zero = 0_i64,
            "many strings and numbers"
        );
        info!(message = "a str message \"quoted\"");
        info!(only = 1);
        info!("");
    }

    /// The lines [`log_everything`] gives through `fmt` with `fields` as its field formatter.
    fn lines_with<N>(fields: N, ansi: bool) -> String
    where
        N: for<'w> FormatFields<'w> + Send + Sync + 'static,
    {
        let captured = Captured::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(captured.clone())
            .with_ansi(ansi)
            .without_time()
            .fmt_fields(fields)
            .finish();
        tracing::subscriber::with_default(subscriber, log_everything);
        let bytes = captured.0.lock().expect("capture").clone();
        String::from_utf8(bytes).expect("utf-8")
    }

    #[test]
    fn plain_fields_write_the_default_formatters_text_byte_for_byte() {
        let default = lines_with(DefaultFields::new(), false);
        assert_eq!(lines_with(PlainFields, false), default);
        // The cases it must hand over are there to compare: the escaped message, an error's
        // sources, a raw name, the `log.*` metadata left out, a span field recorded later.
        for expected in [
            "attempt{id=0192-abc attempt=2 route=\"openai.chat\" trace_id=\"4bf92f3577b34da6\"}",
            "inner{type=\"x\"}",
            "namespace=\"team \\\"a\\\"\\n\"",
            "upstream_status=200",
            "\\x1b[31mfailed",
            "error.sources=",
            "type=\"raw\" after=1",
            ": a str message \"quoted\"",
            "holdfast::logging::tests: after_log=2\n",
            "plain=\"openai.chat\" spaced=\"a b ~!\" tab=\"a\\tb\" backslash=\"a\\\\b\" \
             delete=\"a\\u{7f}b\"",
            "big=18446744073709551615 small=-9223372036854775808 zero=0",
        ] {
            assert!(default.contains(expected), "{expected:?} in {default}");
        }
        assert!(!default.contains("hyper::proto"), "{default}");
        assert!(!default.contains("error_type"), "{default}");
    }

    /// A timer that always writes one instant, so that two formats' lines compare.
    #[derive(Clone)]
    struct Fixed;
    impl FormatTime for Fixed {
        fn format_time(&self, w: &mut Writer<'_>) -> fmt::Result {
            w.write_str("2026-12-07T05:50:50.123456Z")
        }
    }

    /// A timer that fails, as a clock before 1970 may.
    #[derive(Clone)]
    struct Broken;
    impl FormatTime for Broken {
        fn format_time(&self, _: &mut Writer<'_>) -> fmt::Result {
            Err(fmt::Error)
        }
    }

    /// The lines of every level, outside any span and inside, and [`log_everything`]'s, through
    /// `fmt` with [`PlainFields`] and `format` as its line format.
    fn lines_formatted<E>(format: E, ansi: bool) -> String
    where
        E: FormatEvent<tracing_subscriber::Registry, PlainFields> + Send + Sync + 'static,
    {
        lines_of(format, ansi, every_line)
    }

    /// The lines `log` gives through `fmt` with [`PlainFields`] and `format`.
    fn lines_of<E>(format: E, ansi: bool, log: impl FnOnce()) -> String
    where
        E: FormatEvent<tracing_subscriber::Registry, PlainFields> + Send + Sync + 'static,
    {
        let captured = Captured::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(captured.clone())
            .with_ansi(ansi)
            .with_max_level(Level::TRACE)
            .fmt_fields(PlainFields)
            .event_format(format)
            .finish();
        tracing::subscriber::with_default(subscriber, log);
        let bytes = captured.0.lock().expect("capture").clone();
        String::from_utf8(bytes).expect("utf-8")
    }

    /// Every level, outside any span and inside, then [`log_everything`].
    fn every_line() {
        {
            tracing::trace!(n = 1, "trace");
            tracing::debug!(n = 2, "debug");
            info!(n = 3, "info");
            warn!(n = 4, "warn");
            error!(n = 5, "error");
            let empty = info_span!("empty");
            let _empty = empty.enter();
            tracing::debug!("in a span with no fields");
            log_everything();
        }
    }

    #[test]
    fn plain_event_writes_the_default_formats_lines_byte_for_byte() {
        fn library<T: FormatTime>(timer: T) -> Format<Full, T> {
            tracing_subscriber::fmt::format().with_timer(timer)
        }
        let default = lines_formatted(library(Fixed), false);
        assert_eq!(lines_formatted(PlainEvent::new(Fixed), false), default);
        // What the comparison covers: each level's alignment, a line outside any span, a span
        // without fields, nested spans with theirs, the target, the fields.
        for expected in [
            "2026-12-07T05:50:50.123456Z TRACE holdfast::logging::tests: trace n=1\n",
            "2026-12-07T05:50:50.123456Z  INFO holdfast::logging::tests: info n=3\n",
            "2026-12-07T05:50:50.123456Z  WARN holdfast::logging::tests: warn n=4\n",
            "2026-12-07T05:50:50.123456Z ERROR holdfast::logging::tests: error n=5\n",
            "DEBUG empty: holdfast::logging::tests: in a span with no fields\n",
            " INFO empty:attempt{id=0192-abc attempt=2 route=\"openai.chat\" \
             trace_id=\"4bf92f3577b34da6\"}:inner{type=\"x\"}: holdfast::logging::tests: \
             request finished id=0192-abc",
        ] {
            assert!(default.contains(expected), "{expected:?} in {default}");
        }
        // A clock that fails: the library's placeholder, the same line after it.
        let broken = lines_formatted(PlainEvent::new(Broken), false);
        assert_eq!(broken, lines_formatted(library(Broken), false));
        assert!(
            broken.starts_with("<unknown time> TRACE holdfast::logging::tests: trace n=1\n"),
            "{broken}"
        );
    }

    /// A `log` crate record (hyper's, say) reaches the log as tracing-log's event, its own
    /// target in a `log.target` field: its line names that target, as the library writes it.
    #[test]
    fn plain_event_leaves_a_log_record_to_the_default_format() {
        let record = || {
            tracing_log::format_trace(
                &log::Record::builder()
                    .target("hyper::proto::h1")
                    .level(log::Level::Warn)
                    .args(format_args!("from the log crate"))
                    .build(),
            )
            .expect("traced");
        };
        let default = lines_of(
            tracing_subscriber::fmt::format().with_timer(Fixed),
            false,
            record,
        );
        assert_eq!(
            default,
            "2026-12-07T05:50:50.123456Z  WARN hyper::proto::h1: from the log crate\n"
        );
        assert_eq!(lines_of(PlainEvent::new(Fixed), false, record), default);
    }

    #[test]
    fn plain_event_leaves_a_coloured_log_to_the_default_format() {
        let default = lines_formatted(tracing_subscriber::fmt::format().with_timer(Fixed), true);
        assert!(default.contains('\x1b'), "coloured: {default}");
        assert_eq!(lines_formatted(PlainEvent::new(Fixed), true), default);
    }

    #[test]
    fn plain_fields_leave_a_coloured_log_to_the_default_formatter() {
        let default = lines_with(DefaultFields::new(), true);
        assert!(default.contains('\x1b'), "coloured: {default}");
        assert_eq!(lines_with(PlainFields, true), default);
    }
}
