//! The text log's field formatter: tracing-subscriber's default text, written for less.
//!
//! The library's default field formatter paints every field's name and its `=` through
//! `nu_ansi_term` even when the log goes to a file or a pipe and paints nothing: about half of
//! what the `request finished` line and the attempt's span cost (docs/benchmarks.md,
//! "Instructions"; decision 133). [`PlainFields`] writes an ordinary field (`name=value`, the
//! value's `Debug`) itself when the writer has no ANSI escapes, and hands everything else to the
//! library's own visitor, unchanged: a coloured log, the message (its control characters
//! escaped), a raw identifier's name, an error and its sources, a `log` record's `log.*`
//! metadata. A string that needs no escape and a whole number are written without `Debug`'s
//! machinery (issue 30). The text is the default's byte for byte (the tests below pin it).

use std::fmt;

use tracing::field::{Field, Visit};
use tracing_subscriber::field::{RecordFields, VisitOutput};
use tracing_subscriber::fmt::FormatFields;
use tracing_subscriber::fmt::format::{DefaultFields, DefaultVisitor, Writer};

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

    #[test]
    fn plain_fields_leave_a_coloured_log_to_the_default_formatter() {
        let default = lines_with(DefaultFields::new(), true);
        assert!(default.contains('\x1b'), "coloured: {default}");
        assert_eq!(lines_with(PlainFields, true), default);
    }
}
