//! Traces: every proxied call and every attempt as an OpenTelemetry span, in the HTTP and GenAI
//! semantic conventions, exported over OTLP/HTTP (OT-1..OT-6, issue 32).
//!
//! Off by default, and then nothing here runs: [`Otel::start`] gives `None`, and an `Option`
//! test is the whole cost on the request path (OT-1). On:
//!
//! - a proxied call is a server span continuing the caller's W3C `traceparent`; a new request
//!   stores that span's own `traceparent` (OT-2), so whichever node runs an attempt, after any
//!   restart, puts the attempt's span under the call that created the request;
//! - an attempt is a client span named `{gen_ai.operation.name} {gen_ai.request.model}`, whose
//!   span id is derived from (request id, attempt number) ([`attempt_span_id`]): a call answered
//!   from the log links to the attempt that produced its answer, and an attempt to the one
//!   before it, without the log storing span ids (OT-3);
//! - export never waits: a finished span goes into a bounded queue that one task drains in
//!   batches; a full queue or a failed export drops spans, counts them
//!   (`holdfast_otel_spans_dropped_total`) and warns once per failure (OT-1).
//!
//! Parsing answers for the response's id, model and finish reasons happens only here, and only
//! when traces are on.

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, Status as SpanStatus, TraceContextExt, TraceFlags, TraceId,
    TraceState, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue, Value};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    IdGenerator, RandomIdGenerator, SdkTracer, SdkTracerProvider, SpanData, SpanExporter as _,
    SpanProcessor,
};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;
use uuid::Uuid;

use crate::config;
use crate::metrics as m;
use crate::provider::{Provider, Route};
use crate::store::{NewChunk, Outcome, RequestRecord, Status, Usage};

/// How long the exporter waits for more spans to fill a batch once one has arrived.
const LINGER: Duration = Duration::from_millis(200);
/// The instrumentation scope of every span.
const SCOPE: &str = "holdfast";

/// A trace pipeline that could not be built from the configuration.
#[derive(Debug, thiserror::Error)]
#[error("traces (`[otel]`): {0}")]
pub(crate) struct OtelError(String);

/// The tracer and what its spans need: built once at start when `otel.enabled`.
#[derive(Debug)]
pub(crate) struct Otel {
    tracer: SdkTracer,
    provider: SdkTracerProvider,
    /// Most bytes of captured content per attribute, when `capture_content` is on (OT-5).
    capture: Option<usize>,
    /// The export task, awaited at shutdown so the last spans leave.
    export: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

/// What the process holds: `None` when traces are off.
pub(crate) type Traces = Option<Arc<Otel>>;

impl Otel {
    /// Builds the pipeline when `config.enabled` (and `OTEL_SDK_DISABLED` is not `true`):
    /// the OTLP/HTTP protobuf exporter on its own HTTP client, the bounded queue and its export
    /// task (spawned on the current tokio runtime), the sampler from `OTEL_TRACES_SAMPLER`
    /// (default: parent-based, always on), the resource from `OTEL_SERVICE_NAME` and
    /// `OTEL_RESOURCE_ATTRIBUTES` (service name `holdfast` unless they name one).
    ///
    /// # Errors
    /// The endpoint or the exporter's HTTP client could not be built.
    pub(crate) fn start(config: &config::Otel) -> Result<Traces, OtelError> {
        let disabled =
            std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v.eq_ignore_ascii_case("true"));
        if !config.enabled || disabled {
            return Ok(None);
        }
        let timeout = Duration::from_millis(config.export_timeout_ms);
        let client = reqwest::Client::builder()
            .connect_timeout(timeout.min(Duration::from_secs(5)))
            .timeout(timeout)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| OtelError(format!("the exporter's HTTP client: {e}")))?;
        let mut builder = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_http_client(ExportClient(client))
            .with_protocol(Protocol::HttpBinary)
            .with_timeout(timeout);
        if let Some(endpoint) = &config.endpoint {
            builder = builder.with_endpoint(endpoint.clone());
        }
        let mut exporter = builder
            .build()
            .map_err(|e| OtelError(format!("the OTLP exporter: {e}")))?;
        let resource = resource();
        exporter.set_resource(&resource);
        let (sender, receiver) = mpsc::channel(config.queue_size);
        let export = tokio::spawn(export_spans(receiver, exporter, config.batch_size));
        let provider = SdkTracerProvider::builder()
            .with_span_processor(Queue {
                sender: Mutex::new(Some(sender)),
                warned: AtomicBool::new(false),
            })
            .with_id_generator(LogIds(RandomIdGenerator::default()))
            .with_resource(resource)
            .build();
        let tracer = provider.tracer(SCOPE);
        for reason in ["queue_full", "export_failed"] {
            metrics::counter!(m::OTEL_SPANS_DROPPED, "reason" => reason).increment(0);
        }
        metrics::counter!(m::OTEL_SPANS_EXPORTED).increment(0);
        Ok(Some(Arc::new(Otel {
            tracer,
            provider,
            capture: config.capture_content.then_some(config.content_max_bytes),
            export: Mutex::new(Some(export)),
        })))
    }

    /// Ends the pipeline: spans already finished are exported (for at most `wait`).
    pub(crate) async fn shutdown(&self, wait: Duration) {
        // Closes the queue: the export task sends what is in it and stops.
        if let Err(e) = self.provider.shutdown() {
            tracing::debug!(error = %e, "trace provider shutdown");
        }
        let export = self.export.lock().ok().and_then(|mut e| e.take());
        if let Some(export) = export
            && tokio::time::timeout(wait, export).await.is_err()
        {
            tracing::warn!("traces: the last spans were not exported before shutdown");
        }
    }

    /// The server span of one proxied call (OT-2), continuing the caller's `traceparent`;
    /// `path_model` is the model a Gemini call names in its path (GM-1). The HTTP conventions
    /// require `url.scheme` and `url.path` beside the method: the path is the one called (the
    /// query is left out: it may hold a key, GM-2).
    pub(crate) fn server(
        &self,
        route: Route,
        path_model: Option<&str>,
        headers: &HeaderMap,
    ) -> ServerSpan {
        let parent =
            TraceContextPropagator::new().extract(&opentelemetry_http::HeaderExtractor(headers));
        let path = route.router_path();
        let called = match path_model {
            Some(model) => route.client_path().replace("{model}", model),
            None => route.client_path().to_string(),
        };
        let span = self
            .tracer
            .span_builder(format!("POST {path}"))
            .with_kind(SpanKind::Server)
            .with_attributes([
                KeyValue::new("http.request.method", "POST"),
                KeyValue::new("http.route", path),
                KeyValue::new("url.scheme", "http"),
                KeyValue::new("url.path", called),
                KeyValue::new("holdfast.route", route.name()),
            ])
            .start_with_context(&self.tracer, &parent);
        ServerSpan {
            cx: parent.with_span(span),
        }
    }

    /// The span of attempt `attempt` of `record` (OT-3): under the call that created the
    /// request (its stored `traceparent`), linked to the attempt before it.
    pub(crate) fn attempt(
        &self,
        record: &RequestRecord,
        attempt: u32,
        server: Option<(String, u16)>,
    ) -> AttemptSpan {
        let parent = record
            .trace_parent
            .as_deref()
            .map(extract)
            .unwrap_or_default();
        let route = record.route;
        let operation = operation(route);
        let name = match &record.model {
            Some(model) => format!("{operation} {model}"),
            None => operation.to_string(),
        };
        let mut attributes = vec![
            KeyValue::new("gen_ai.operation.name", operation),
            KeyValue::new("gen_ai.provider.name", provider_name(route.provider())),
            KeyValue::new("holdfast.request_id", record.id.to_string()),
            KeyValue::new("holdfast.namespace", record.namespace.clone()),
            KeyValue::new("holdfast.backend", record.backend.clone()),
            KeyValue::new("holdfast.route", route.name()),
            KeyValue::new("holdfast.attempt", i64::from(attempt)),
            KeyValue::new("holdfast.stream", record.stream),
        ];
        if let Some(model) = &record.model {
            attributes.push(KeyValue::new("gen_ai.request.model", model.clone()));
        }
        if record.stream {
            attributes.push(KeyValue::new("gen_ai.request.stream", true));
        }
        if let Some(api) = openai_api_type(route) {
            attributes.push(KeyValue::new("openai.api.type", api));
        }
        request_attributes(route, &record.body, &mut attributes);
        if let Some((host, port)) = server {
            attributes.push(KeyValue::new("server.address", host));
            attributes.push(KeyValue::new("server.port", i64::from(port)));
        }
        if let Some(cap) = self.capture {
            let (messages, system) = prompt(route, &record.body, cap);
            attributes.push(KeyValue::new("gen_ai.input.messages", messages));
            if let Some(system) = system {
                attributes.push(KeyValue::new("gen_ai.system_instructions", system));
            }
        }
        let mut builder = self
            .tracer
            .span_builder(name)
            .with_kind(SpanKind::Client)
            .with_attributes(attributes);
        if attempt > 1 {
            builder = builder.with_links(vec![opentelemetry::trace::Link::with_context(
                attempt_context(record, attempt - 1),
            )]);
        }
        // A request created while traces were off has no stored parent: its attempts are roots
        // of a trace whose id is derived from the request, so links still find them.
        let trace = (!parent.span().span_context().is_valid()).then(|| request_trace_id(record.id));
        let span = with_ids(trace, attempt_span_id(record.id, attempt), || {
            builder.start_with_context(&self.tracer, &parent)
        });
        AttemptSpan {
            cx: parent.with_span(span),
            route,
            started: Instant::now(),
            events: 0,
            answer: Answer::default(),
            capture: self.capture,
        }
    }
}

/// How a proxied call was answered, as its server span says (`holdfast.delivery`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Delivery {
    /// It created the request: its answer comes from an attempt under this trace.
    New,
    /// It joined a request already running (RS-2).
    Attached,
    /// It was answered from a finished request in the log (RS-5).
    Replayed,
}

/// The server span of one proxied call; it ends when the last holder drops it (a stream's body
/// holds it to the stream's end).
#[derive(Debug, Clone)]
pub(crate) struct ServerSpan {
    cx: Context,
}

impl ServerSpan {
    /// This span's W3C `traceparent`, stored with the request it creates (OT-2).
    pub(crate) fn traceparent(&self) -> Option<String> {
        inject(&self.cx)
    }

    /// This span's trace id and span id in hex, for log lines (OT-6); `None` when it is not
    /// sampled.
    pub(crate) fn ids(&self) -> Option<(String, String)> {
        ids(&self.cx)
    }

    /// The call is admitted: its request, and whether it runs or was answered from the log
    /// (OT-4: a link to the attempt that produced, or produces, the answer).
    pub(crate) fn admitted(&self, record: &RequestRecord, delivery: Delivery) {
        let span = self.cx.span();
        span.set_attributes([
            KeyValue::new("holdfast.request_id", record.id.to_string()),
            KeyValue::new("holdfast.namespace", record.namespace.clone()),
            KeyValue::new("holdfast.backend", record.backend.clone()),
            KeyValue::new(
                "holdfast.delivery",
                match delivery {
                    Delivery::New => "new",
                    Delivery::Attached => "attached",
                    Delivery::Replayed => "replayed",
                },
            ),
            KeyValue::new("holdfast.attached", delivery == Delivery::Attached),
            KeyValue::new("holdfast.replayed", delivery == Delivery::Replayed),
        ]);
        if delivery != Delivery::New {
            // The attempt running now, or the one that gave the answer; a queued request's
            // next.
            let attempt = match record.status {
                Status::Pending => record.attempts + 1,
                _ => record.attempts.max(1),
            };
            // The record counts this delivery already; log readers are not deliveries, and a
            // replay saves a call as an attachment does (RD-9, decision 155).
            span.set_attribute(KeyValue::new(
                "holdfast.deliveries",
                i64::from(record.deliveries()),
            ));
            span.set_attribute(KeyValue::new(
                "holdfast.saved_calls",
                i64::from(record.saved_calls()),
            ));
            span.add_link(
                attempt_context(record, attempt),
                vec![KeyValue::new("holdfast.link", "answered_by")],
            );
        }
    }

    /// The status code answered (an error status for a 5xx, HTTP conventions).
    pub(crate) fn responded(&self, status: u16) {
        let span = self.cx.span();
        span.set_attribute(KeyValue::new(
            "http.response.status_code",
            i64::from(status),
        ));
        if status >= 500 {
            span.set_attribute(KeyValue::new("error.type", status.to_string()));
            span.set_status(SpanStatus::error(""));
        }
    }
}

/// What an attempt's answer showed, for its span's attributes.
#[derive(Debug, Default)]
struct Answer {
    id: Option<String>,
    model: Option<String>,
    /// OpenAI's `service_tier` (the tier that served it: the last event that says one, as a
    /// Responses stream's first events say the one asked for) and chat's `system_fingerprint`.
    service_tier: Option<String>,
    system_fingerprint: Option<String>,
    /// The finish reason of each generation (an OpenAI choice, a Gemini candidate; Anthropic's
    /// and a Responses answer's one), by its index.
    finish_reasons: BTreeMap<u64, String>,
    /// The text of each generation, by its index, captured up to the cap in all (OT-5).
    texts: BTreeMap<u64, String>,
    /// The tool calls of each generation, by (generation index, call index), captured with
    /// the text (OT-5).
    tools: BTreeMap<(u64, u64), ToolCall>,
}

/// One tool call the model asked for, as its pieces arrive (OT-5).
#[derive(Debug, Default)]
struct ToolCall {
    id: Option<String>,
    name: Option<String>,
    /// The arguments as JSON text (a stream's fragments concatenated).
    arguments: String,
}

impl ToolCall {
    /// Adds what a piece says: the id and name when given, an argument fragment (a string).
    fn add(
        &mut self,
        id: Option<String>,
        name: Option<String>,
        arguments: Option<&serde_json::Value>,
    ) {
        if id.is_some() {
            self.id = id;
        }
        if name.is_some() {
            self.name = name;
        }
        if let Some(fragment) = arguments.and_then(|a| a.as_str()) {
            self.arguments.push_str(fragment);
        }
    }

    /// The conventions' `tool_call` part: the arguments parsed when they are JSON (as the
    /// schema's example has them), else as the text they are (cut, or cut short).
    fn part(&self, budget: &mut usize) -> serde_json::Value {
        let text = capped(self.arguments.clone(), *budget);
        *budget -= text.len();
        let arguments = serde_json::from_str::<serde_json::Value>(&text)
            .unwrap_or(serde_json::Value::String(text));
        serde_json::json!({
            "type": "tool_call",
            "id": self.id,
            "name": self.name.as_deref().unwrap_or_default(),
            "arguments": arguments,
        })
    }
}

impl Answer {
    /// Bytes of text and tool arguments captured, every generation's.
    fn text_len(&self) -> usize {
        self.texts.values().map(String::len).sum::<usize>()
            + self
                .tools
                .values()
                .map(|t| t.arguments.len())
                .sum::<usize>()
    }

    /// `gen_ai.output.messages` (OT-5): one assistant message per generation, in index order,
    /// its text and then its tool calls (`tool_call` parts), with its finish reason in the
    /// output schema's words where one applies ([`message_finish_reason`]; the schema requires
    /// a reason: `error` for a generation that ended without one, as an interrupted stream's
    /// does), texts and arguments cut to `cap` bytes in all.
    fn output_messages(&self, provider: Provider, cap: usize) -> Option<String> {
        if self.texts.values().all(String::is_empty) && self.tools.is_empty() {
            return None;
        }
        let mut budget = cap;
        let messages: Vec<serde_json::Value> = self
            .texts
            .keys()
            .chain(self.finish_reasons.keys())
            .chain(self.tools.keys().map(|(generation, _)| generation))
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .map(|&index| {
                let text = capped(self.texts.get(&index).cloned().unwrap_or_default(), budget);
                budget -= text.len();
                let calls = self.tools.range((index, 0)..=(index, u64::MAX));
                let mut parts = Vec::new();
                if !text.is_empty() || calls.clone().next().is_none() {
                    parts.push(serde_json::json!({"type": "text", "content": text}));
                }
                let calls_tools = calls.clone().next().is_some();
                parts.extend(calls.map(|(_, call)| call.part(&mut budget)));
                let reason = self.finish_reasons.get(&index).map_or("error", |reason| {
                    message_finish_reason(provider, reason, calls_tools)
                });
                serde_json::json!({
                    "role": "assistant",
                    "parts": parts,
                    "finish_reason": reason,
                })
            })
            .collect();
        Some(serde_json::Value::Array(messages).to_string())
    }
}

/// A generation's finish reason as its output message says it (OT-5): the output schema's
/// enumerated value where one applies (`stop`, `length`, `content_filter`, `tool_call`,
/// `error`), else the provider's own word (Anthropic's `pause_turn`, Gemini's `LANGUAGE`, a
/// Responses `cancelled`), as the schema allows. `gen_ai.response.finish_reasons` keeps the
/// provider's words (decision 113). A Gemini candidate that calls functions ends with `STOP`:
/// its message says `tool_call`, as the other providers' do.
fn message_finish_reason(provider: Provider, reason: &str, calls_tools: bool) -> &str {
    match (provider, reason) {
        (Provider::Openai, "tool_calls" | "function_call") => "tool_call",
        // A Responses answer that failed (its status, decision 100).
        (Provider::Openai, "failed") => "error",
        (Provider::Anthropic, "end_turn" | "stop_sequence") => "stop",
        (Provider::Anthropic, "max_tokens" | "model_context_window_exceeded") => "length",
        (Provider::Anthropic, "tool_use") => "tool_call",
        (Provider::Anthropic, "refusal") => "content_filter",
        (Provider::Gemini, "STOP") if calls_tools => "tool_call",
        (Provider::Gemini, "STOP") => "stop",
        (Provider::Gemini, "MAX_TOKENS") => "length",
        (
            Provider::Gemini,
            "SAFETY" | "RECITATION" | "BLOCKLIST" | "PROHIBITED_CONTENT" | "SPII" | "IMAGE_SAFETY",
        ) => "content_filter",
        (Provider::Gemini, "OTHER" | "FINISH_REASON_UNSPECIFIED" | "MALFORMED_FUNCTION_CALL") => {
            "error"
        }
        // OpenAI's `stop`, `length` and `content_filter` are the schema's words already.
        _ => reason,
    }
}

/// The span of one attempt; ended by [`AttemptSpan::end`], or when dropped (an attempt that
/// lost its lease).
#[derive(Debug)]
pub(crate) struct AttemptSpan {
    cx: Context,
    route: Route,
    started: Instant,
    events: u64,
    answer: Answer,
    capture: Option<usize>,
}

impl AttemptSpan {
    /// The `traceparent` the provider call carries: this span's.
    pub(crate) fn traceparent(&self) -> Option<String> {
        inject(&self.cx)
    }

    /// This span's trace id and span id in hex, for log lines (OT-6); `None` when it is not
    /// sampled.
    pub(crate) fn ids(&self) -> Option<(String, String)> {
        ids(&self.cx)
    }

    /// A stream's events handed on: the first one's time (time to first chunk, OT-3), the
    /// count, and what they say about the answer.
    pub(crate) fn events(&mut self, chunks: &[NewChunk]) {
        if chunks.is_empty() {
            return;
        }
        if self.events == 0 {
            let seconds = self.started.elapsed().as_secs_f64();
            let span = self.cx.span();
            span.add_event(
                "gen_ai.first_chunk",
                vec![KeyValue::new(
                    "gen_ai.response.time_to_first_chunk",
                    seconds,
                )],
            );
            span.set_attribute(KeyValue::new(
                "gen_ai.response.time_to_first_chunk",
                seconds,
            ));
        }
        self.events += chunks.len() as u64;
        for chunk in chunks {
            observe(
                self.route,
                chunk.data.as_bytes(),
                &mut self.answer,
                self.capture,
            );
        }
    }

    /// Ends the span with the attempt's outcome: the answer's id, model, finish reasons,
    /// usage, or the error's type.
    pub(crate) fn end(mut self, outcome: &Outcome) {
        if let Outcome::Succeeded { body, .. } = outcome
            && self.events == 0
        {
            observe(self.route, body, &mut self.answer, self.capture);
        }
        let span = self.cx.span();
        let mut attributes = Vec::new();
        if let Some(id) = self.answer.id.take() {
            attributes.push(KeyValue::new("gen_ai.response.id", id));
        }
        if let Some(model) = self.answer.model.take() {
            attributes.push(KeyValue::new("gen_ai.response.model", model));
        }
        if let Some(tier) = self.answer.service_tier.take() {
            attributes.push(KeyValue::new("openai.response.service_tier", tier));
        }
        if let Some(fingerprint) = self.answer.system_fingerprint.take() {
            attributes.push(KeyValue::new(
                "openai.response.system_fingerprint",
                fingerprint,
            ));
        }
        if !self.answer.finish_reasons.is_empty() {
            let reasons: Vec<opentelemetry::StringValue> = self
                .answer
                .finish_reasons
                .values()
                .cloned()
                .map(Into::into)
                .collect();
            attributes.push(KeyValue::new(
                "gen_ai.response.finish_reasons",
                Value::Array(reasons.into()),
            ));
        }
        if self.events > 0 {
            attributes.push(KeyValue::new("holdfast.events", self.events as i64));
        }
        if let Some(output) = self
            .capture
            .and_then(|cap| self.answer.output_messages(self.route.provider(), cap))
        {
            attributes.push(KeyValue::new("gen_ai.output.messages", output));
        }
        // `error.type`: the stored error type of a failure; for a transient failure that is
        // tried again, the provider's error status, or `transient` when it gave none — or
        // answered 2xx and then failed its stream before anything was stored (an error event, a
        // broken read): a 2xx says the answer began, not what failed.
        let (usage, error) = match outcome {
            Outcome::Succeeded { usage, status, .. } => {
                attributes.push(KeyValue::new("holdfast.status", i64::from(*status)));
                (usage.as_ref(), None)
            }
            Outcome::Failed { usage, error, .. } => {
                attributes.push(KeyValue::new("error.type", error.kind.as_str()));
                (usage.as_ref(), Some((error, error.kind.as_str())))
            }
            Outcome::Retry {
                error,
                next_retry_at,
            } => {
                span.add_event(
                    "holdfast.retry",
                    vec![KeyValue::new(
                        "holdfast.backoff_ms",
                        next_retry_at - crate::store::now_ms(),
                    )],
                );
                let kind = error
                    .status
                    .filter(|s| *s >= 300)
                    .map_or_else(|| "transient".into(), |s| s.to_string());
                attributes.push(KeyValue::new("error.type", kind));
                (None, Some((error, "retried")))
            }
        };
        if let Some(usage) = usage {
            usage_attributes(usage, &mut attributes);
        }
        if let Some((error, ended)) = error {
            if let Some(status) = error.status {
                attributes.push(KeyValue::new("holdfast.status", i64::from(status)));
            }
            // The message quotes what the provider said, which may echo the prompt: only with
            // content captured (OT-5, decision 154).
            let message = match self.capture {
                Some(_) => error.message.clone(),
                None => match error.status {
                    Some(status) => format!("{ended}: the provider answered {status}"),
                    None => ended.to_string(),
                },
            };
            span.set_status(SpanStatus::error(message));
        }
        span.set_attributes(attributes);
        span.end();
    }

    /// The attempt was stopped by a cancel of its request (LC-9): `error.type` is the
    /// request's stored error type, `cancelled`, as for any failure.
    pub(crate) fn cancelled(self) {
        let span = self.cx.span();
        span.set_attribute(KeyValue::new("error.type", "cancelled"));
        span.set_status(SpanStatus::error("the request was cancelled"));
        span.end();
    }

    /// The attempt ended without an outcome: its lease was lost, or shutdown handed it back.
    pub(crate) fn lost(self) {
        let span = self.cx.span();
        span.set_attribute(KeyValue::new("error.type", "lease_lost"));
        span.set_status(SpanStatus::error("the attempt ended without an outcome"));
        span.end();
    }
}

/// The GenAI usage attributes of `usage`.
fn usage_attributes(usage: &Usage, out: &mut Vec<KeyValue>) {
    let tokens = [
        ("gen_ai.usage.input_tokens", usage.input_tokens),
        ("gen_ai.usage.output_tokens", usage.output_tokens),
        (
            "gen_ai.usage.cache_read.input_tokens",
            usage.cached_input_tokens,
        ),
        (
            "gen_ai.usage.cache_creation.input_tokens",
            usage.cache_write_tokens,
        ),
        (
            "gen_ai.usage.reasoning.output_tokens",
            usage.reasoning_tokens,
        ),
    ];
    for (key, n) in tokens {
        if let Some(n) = n.and_then(|n| i64::try_from(n).ok()) {
            out.push(KeyValue::new(key, n));
        }
    }
}

/// The members of a request body the GenAI conventions' request attributes come from, under
/// each provider's names (Gemini's `generationConfig` under either of its names, decision 84).
/// Everything else in the body is skipped unread.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(default)]
struct RequestParams {
    max_tokens: Option<serde_json::Value>,
    max_completion_tokens: Option<serde_json::Value>,
    max_output_tokens: Option<serde_json::Value>,
    temperature: Option<serde_json::Value>,
    top_p: Option<serde_json::Value>,
    top_k: Option<serde_json::Value>,
    presence_penalty: Option<serde_json::Value>,
    frequency_penalty: Option<serde_json::Value>,
    seed: Option<serde_json::Value>,
    stop: Option<serde_json::Value>,
    stop_sequences: Option<serde_json::Value>,
    n: Option<serde_json::Value>,
    response_format: Option<serde_json::Value>,
    text: Option<serde_json::Value>,
    dimensions: Option<serde_json::Value>,
    encoding_format: Option<serde_json::Value>,
    service_tier: Option<serde_json::Value>,
    conversation: Option<serde_json::Value>,
    #[serde(rename = "generationConfig")]
    generation_config: Option<serde_json::Value>,
    #[serde(rename = "generation_config")]
    generation_config_proto: Option<serde_json::Value>,
}

/// The request attributes of the GenAI conventions that `body` (as sent upstream on `route`)
/// sets (OT-3): `gen_ai.request.max_tokens`, `.temperature`, `.top_p`, `.top_k`,
/// `.presence_penalty`, `.frequency_penalty`, `.seed`, `.stop_sequences`, `.choice.count` (when
/// not 1), `gen_ai.output.type`, and for embeddings `gen_ai.embeddings.dimension.count` and
/// `gen_ai.request.encoding_formats`; OpenAI's `openai.request.service_tier` (when not `auto`)
/// and a Responses call's `gen_ai.conversation.id` (its `conversation`, an id or `{id}`); each
/// typed as the conventions type it (an int, a double,
/// a string array: a temperature written `1` is the double 1.0, a lone stop string an array of
/// one). A member the client did not send, or of a type the provider would refuse, is left out.
fn request_attributes(route: Route, body: &[u8], out: &mut Vec<KeyValue>) {
    let Ok(p) = serde_json::from_slice::<RequestParams>(body) else {
        return;
    };
    let int = |v: Option<&serde_json::Value>| {
        v.and_then(|v| {
            v.as_i64().or_else(|| {
                v.as_f64()
                    .filter(|f| f.fract() == 0.0 && f.abs() < 9.0e15)
                    .map(|f| f as i64)
            })
        })
    };
    let double = |v: Option<&serde_json::Value>| v.and_then(serde_json::Value::as_f64);
    let strings = |v: Option<&serde_json::Value>| -> Option<Vec<opentelemetry::StringValue>> {
        let list: Vec<opentelemetry::StringValue> = match v? {
            serde_json::Value::String(s) => vec![s.clone().into()],
            serde_json::Value::Array(items) => items
                .iter()
                .filter_map(|i| i.as_str().map(|s| s.to_owned().into()))
                .collect(),
            _ => return None,
        };
        (!list.is_empty()).then_some(list)
    };
    // `json_object`, `json_schema` and `application/json` are all JSON output.
    let output_type = |kind: Option<&str>| match kind? {
        "json_object" | "json_schema" | "application/json" => Some("json"),
        "text" | "text/plain" => Some("text"),
        _ => None,
    };
    let mut ints: Vec<(&'static str, Option<i64>)> = Vec::new();
    let mut doubles: Vec<(&'static str, Option<f64>)> = Vec::new();
    let mut stop = None;
    let mut output = None;
    let mut choices = None;
    match route.provider() {
        Provider::Gemini => {
            let config = p
                .generation_config
                .as_ref()
                .or(p.generation_config_proto.as_ref());
            let get = |camel: &str, proto: &str| {
                config.and_then(|c| c.get(camel).or_else(|| c.get(proto)))
            };
            ints.push((
                "gen_ai.request.max_tokens",
                int(get("maxOutputTokens", "max_output_tokens")),
            ));
            ints.push(("gen_ai.request.seed", int(get("seed", "seed"))));
            doubles.push((
                "gen_ai.request.temperature",
                double(get("temperature", "temperature")),
            ));
            doubles.push(("gen_ai.request.top_p", double(get("topP", "top_p"))));
            doubles.push(("gen_ai.request.top_k", double(get("topK", "top_k"))));
            doubles.push((
                "gen_ai.request.presence_penalty",
                double(get("presencePenalty", "presence_penalty")),
            ));
            doubles.push((
                "gen_ai.request.frequency_penalty",
                double(get("frequencyPenalty", "frequency_penalty")),
            ));
            stop = strings(get("stopSequences", "stop_sequences"));
            choices = int(get("candidateCount", "candidate_count"));
            output =
                output_type(get("responseMimeType", "response_mime_type").and_then(|m| m.as_str()));
        }
        Provider::Anthropic => {
            ints.push(("gen_ai.request.max_tokens", int(p.max_tokens.as_ref())));
            doubles.push(("gen_ai.request.temperature", double(p.temperature.as_ref())));
            doubles.push(("gen_ai.request.top_p", double(p.top_p.as_ref())));
            doubles.push(("gen_ai.request.top_k", double(p.top_k.as_ref())));
            stop = strings(p.stop_sequences.as_ref());
        }
        _ if route == Route::OpenaiEmbeddings => {
            ints.push((
                "gen_ai.embeddings.dimension.count",
                int(p.dimensions.as_ref()),
            ));
            if let Some(formats) = strings(p.encoding_format.as_ref()) {
                out.push(KeyValue::new(
                    "gen_ai.request.encoding_formats",
                    Value::Array(formats.into()),
                ));
            }
        }
        _ if route == Route::OpenaiResponses => {
            let conversation = p
                .conversation
                .as_ref()
                .and_then(|c| c.as_str().or_else(|| c.get("id")?.as_str()));
            if let Some(id) = conversation {
                out.push(KeyValue::new("gen_ai.conversation.id", id.to_owned()));
            }
            ints.push((
                "gen_ai.request.max_tokens",
                int(p.max_output_tokens.as_ref()),
            ));
            doubles.push(("gen_ai.request.temperature", double(p.temperature.as_ref())));
            doubles.push(("gen_ai.request.top_p", double(p.top_p.as_ref())));
            output = output_type(
                p.text
                    .as_ref()
                    .and_then(|t| t.get("format"))
                    .and_then(|f| f.get("type"))
                    .and_then(|t| t.as_str()),
            );
        }
        _ => {
            let max = p.max_completion_tokens.as_ref().or(p.max_tokens.as_ref());
            ints.push(("gen_ai.request.max_tokens", int(max)));
            ints.push(("gen_ai.request.seed", int(p.seed.as_ref())));
            doubles.push(("gen_ai.request.temperature", double(p.temperature.as_ref())));
            doubles.push(("gen_ai.request.top_p", double(p.top_p.as_ref())));
            doubles.push((
                "gen_ai.request.presence_penalty",
                double(p.presence_penalty.as_ref()),
            ));
            doubles.push((
                "gen_ai.request.frequency_penalty",
                double(p.frequency_penalty.as_ref()),
            ));
            stop = strings(p.stop.as_ref());
            choices = int(p.n.as_ref());
            output = output_type(p.response_format.as_ref().and_then(|f| {
                f.as_str()
                    .or_else(|| f.get("type").and_then(|t| t.as_str()))
            }));
        }
    }
    for (key, n) in ints {
        if let Some(n) = n {
            out.push(KeyValue::new(key, n));
        }
    }
    for (key, x) in doubles {
        if let Some(x) = x {
            out.push(KeyValue::new(key, x));
        }
    }
    if let Some(stop) = stop {
        out.push(KeyValue::new(
            "gen_ai.request.stop_sequences",
            Value::Array(stop.into()),
        ));
    }
    if let Some(n) = choices.filter(|&n| n != 1) {
        out.push(KeyValue::new("gen_ai.request.choice.count", n));
    }
    if let Some(kind) = output {
        out.push(KeyValue::new("gen_ai.output.type", kind));
    }
    // Asked of chat completions and Responses calls; `auto` is the default, not said.
    if openai_api_type(route).is_some()
        && let Some(tier) = p.service_tier.as_ref().and_then(|t| t.as_str())
        && tier != "auto"
    {
        out.push(KeyValue::new(
            "openai.request.service_tier",
            tier.to_owned(),
        ));
    }
}

/// `openai.api.type` of a route: the OpenAI conventions name two of its APIs.
fn openai_api_type(route: Route) -> Option<&'static str> {
    match route {
        Route::OpenaiChat => Some("chat_completions"),
        Route::OpenaiResponses => Some("responses"),
        Route::OpenaiCompletions
        | Route::OpenaiEmbeddings
        | Route::AnthropicMessages
        | Route::GeminiGenerate
        | Route::GeminiStream
        | Route::GeminiV1Generate
        | Route::GeminiV1Stream => None,
        #[cfg(test)]
        Route::EchoSay => None,
    }
}

/// `gen_ai.operation.name` of a route.
fn operation(route: Route) -> &'static str {
    match route {
        Route::OpenaiCompletions => "text_completion",
        Route::OpenaiEmbeddings => "embeddings",
        Route::OpenaiChat | Route::OpenaiResponses | Route::AnthropicMessages => "chat",
        Route::GeminiGenerate
        | Route::GeminiStream
        | Route::GeminiV1Generate
        | Route::GeminiV1Stream => "generate_content",
        #[cfg(test)]
        Route::EchoSay => "chat",
    }
}

/// `gen_ai.provider.name` of a provider.
fn provider_name(provider: Provider) -> &'static str {
    match provider {
        Provider::Openai => "openai",
        Provider::Anthropic => "anthropic",
        Provider::Gemini => "gcp.gemini",
        #[cfg(test)]
        Provider::Echo => "echo",
    }
}

/// The span id of attempt `attempt` of request `request`: the first 8 bytes of a SHA-256 of
/// both, the same on every node and after every restart (OT-3).
pub(crate) fn attempt_span_id(request: Uuid, attempt: u32) -> SpanId {
    let digest = Sha256::new()
        .chain_update(b"holdfast attempt span\0")
        .chain_update(request.as_bytes())
        .chain_update(attempt.to_be_bytes())
        .finalize();
    let mut id = [0u8; 8];
    id.copy_from_slice(&digest[..8]);
    if id == [0; 8] {
        id[7] = 1;
    }
    SpanId::from_bytes(id)
}

/// The trace id of a request created while traces were off (no stored `traceparent`).
fn request_trace_id(request: Uuid) -> TraceId {
    let digest = Sha256::new()
        .chain_update(b"holdfast request trace\0")
        .chain_update(request.as_bytes())
        .finalize();
    let mut id = [0u8; 16];
    id.copy_from_slice(&digest[..16]);
    if id == [0; 16] {
        id[15] = 1;
    }
    TraceId::from_bytes(id)
}

/// The span context of attempt `attempt` of `record`, for a link to it.
fn attempt_context(record: &RequestRecord, attempt: u32) -> SpanContext {
    let parent = record
        .trace_parent
        .as_deref()
        .map(extract)
        .unwrap_or_default();
    let parent = parent.span().span_context().clone();
    let (trace, flags) = if parent.is_valid() {
        (parent.trace_id(), parent.trace_flags())
    } else {
        (request_trace_id(record.id), TraceFlags::SAMPLED)
    };
    SpanContext::new(
        trace,
        attempt_span_id(record.id, attempt),
        flags,
        true,
        TraceState::default(),
    )
}

/// The trace id and span id in hex of the span in `cx`, when it is sampled.
fn ids(cx: &Context) -> Option<(String, String)> {
    let span = cx.span();
    let context = span.span_context();
    context.is_sampled().then(|| {
        (
            context.trace_id().to_string(),
            context.span_id().to_string(),
        )
    })
}

/// The context a stored `traceparent` names.
fn extract(traceparent: &str) -> Context {
    let carrier = HashMap::from([("traceparent".to_string(), traceparent.to_string())]);
    TraceContextPropagator::new().extract(&carrier)
}

/// The `traceparent` of the span in `cx`, when it is valid.
fn inject(cx: &Context) -> Option<String> {
    if !cx.span().span_context().is_valid() {
        return None;
    }
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(cx, &mut carrier);
    carrier.remove("traceparent")
}

thread_local! {
    /// Ids the next span built on this thread takes ([`with_ids`]).
    static GIVEN: Cell<(Option<TraceId>, Option<SpanId>)> = const { Cell::new((None, None)) };
}

/// Runs `build` (which builds one span) with its span id, and its trace id when it starts a
/// trace, given rather than random.
fn with_ids<T>(trace: Option<TraceId>, span: SpanId, build: impl FnOnce() -> T) -> T {
    GIVEN.with(|given| given.set((trace, Some(span))));
    let built = build();
    GIVEN.with(|given| given.set((None, None)));
    built
}

/// Random ids, except where [`with_ids`] gave them.
#[derive(Debug)]
struct LogIds(RandomIdGenerator);

impl IdGenerator for LogIds {
    fn new_trace_id(&self) -> TraceId {
        let given = GIVEN.with(|given| {
            let (trace, span) = given.get();
            given.set((None, span));
            trace
        });
        given.unwrap_or_else(|| self.0.new_trace_id())
    }

    fn new_span_id(&self) -> SpanId {
        let given = GIVEN.with(|given| {
            let (trace, span) = given.get();
            given.set((trace, None));
            span
        });
        given.unwrap_or_else(|| self.0.new_span_id())
    }
}

/// The process's resource: the SDK's and `OTEL_*`'s, with service name `holdfast` unless the
/// environment names one.
fn resource() -> Resource {
    let named = std::env::var("OTEL_SERVICE_NAME").is_ok_and(|v| !v.is_empty())
        || std::env::var("OTEL_RESOURCE_ATTRIBUTES").is_ok_and(|v| v.contains("service.name="));
    let builder = Resource::builder();
    if named {
        builder.build()
    } else {
        builder.with_service_name("holdfast").build()
    }
}

/// The span processor: a finished span goes into the bounded queue, or is dropped and counted
/// when it is full; never waited for (OT-1).
#[derive(Debug)]
struct Queue {
    /// Taken at shutdown, which closes the queue.
    sender: Mutex<Option<mpsc::Sender<SpanData>>>,
    warned: AtomicBool,
}

impl SpanProcessor for Queue {
    fn on_start(&self, _span: &mut opentelemetry_sdk::trace::Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        if !span.span_context.is_sampled() {
            return;
        }
        let sent = match self.sender.lock() {
            Ok(sender) => sender.as_ref().map(|s| s.try_send(span).is_ok()),
            Err(_) => None,
        };
        if sent == Some(false) {
            metrics::counter!(m::OTEL_SPANS_DROPPED, "reason" => "queue_full").increment(1);
            if !self.warned.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    "traces: the export queue is full, spans are dropped \
                     (holdfast_otel_spans_dropped_total; is the collector up?)"
                );
            }
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        if let Ok(mut sender) = self.sender.lock() {
            sender.take();
        }
        Ok(())
    }
}

/// Drains the queue in batches of at most `batch_size` into `exporter`, until the queue
/// closes. A failed export drops its batch (counted, warned about once per failing spell).
async fn export_spans(
    mut receiver: mpsc::Receiver<SpanData>,
    exporter: opentelemetry_otlp::SpanExporter,
    batch_size: usize,
) {
    let mut failing = false;
    loop {
        let mut batch = Vec::with_capacity(batch_size);
        if receiver.recv_many(&mut batch, batch_size).await == 0 {
            return;
        }
        let linger = tokio::time::Instant::now() + LINGER;
        while batch.len() < batch_size {
            let more = batch_size - batch.len();
            match tokio::time::timeout_at(linger, receiver.recv_many(&mut batch, more)).await {
                Ok(n) if n > 0 => {}
                _ => break,
            }
        }
        let n = batch.len() as u64;
        // The exporter's HTTP client times out the call itself (`export_timeout_ms`).
        match exporter.export(batch).await {
            Ok(()) => {
                metrics::counter!(m::OTEL_SPANS_EXPORTED).increment(n);
                if failing {
                    tracing::info!("traces: export works again");
                    failing = false;
                }
            }
            Err(e) => {
                metrics::counter!(m::OTEL_SPANS_DROPPED, "reason" => "export_failed").increment(n);
                if !failing {
                    tracing::warn!(error = %e, "traces: export failed, its spans are dropped (holdfast_otel_spans_dropped_total)");
                    failing = true;
                }
            }
        }
    }
}

/// The exporter's HTTP client: our reqwest, so OTLP needs no second HTTP stack.
#[derive(Debug)]
struct ExportClient(reqwest::Client);

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for ExportClient {
    async fn send_bytes(
        &self,
        request: axum::http::Request<bytes::Bytes>,
    ) -> Result<axum::http::Response<bytes::Bytes>, opentelemetry_http::HttpError> {
        let (parts, body) = request.into_parts();
        let response = self
            .0
            .request(parts.method, parts.uri.to_string())
            .headers(parts.headers)
            .body(body)
            .send()
            .await?;
        let status = response.status();
        let headers = response.headers().clone();
        let body = response.bytes().await?;
        let mut out = axum::http::Response::new(body);
        *out.status_mut() = status;
        *out.headers_mut() = headers;
        Ok(out)
    }
}

/// `text` cut to at most `cap` bytes, on a character boundary.
fn capped(mut text: String, cap: usize) -> String {
    if text.len() > cap {
        let mut end = cap;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}

/// The prompt of a request body in the GenAI conventions' shapes (OT-5): its chat history as
/// `gen_ai.input.messages` (`[{role, parts: [{type: "text", content}]}]`), and the instructions
/// the API takes apart from that history as `gen_ai.system_instructions` (`[{type: "text",
/// content}]`: Anthropic's `system`, a Responses call's `instructions`, Gemini's
/// `systemInstruction`), when the body has them. An OpenAI chat's `system` and `developer`
/// messages are part of its history and stay among the messages, as the conventions ask.
/// Text parts only (other parts are named by their type); the texts of each attribute cut to
/// `cap` bytes in all.
fn prompt(route: Route, body: &[u8], cap: usize) -> (String, Option<String>) {
    let Ok(body) = serde_json::from_slice::<serde_json::Value>(body) else {
        return ("[]".into(), None);
    };
    let mut out = Vec::new();
    let text_part = |text: &str| serde_json::json!({"type": "text", "content": text});
    let parts_of = |content: &serde_json::Value| -> Vec<serde_json::Value> {
        match content {
            serde_json::Value::String(s) => vec![text_part(s)],
            serde_json::Value::Array(items) => items
                .iter()
                .map(|item| match item.get("text").and_then(|t| t.as_str()) {
                    Some(text) => text_part(text),
                    None => serde_json::json!({
                        "type": item.get("type").and_then(|t| t.as_str()).unwrap_or("other")
                    }),
                })
                .collect(),
            _ => Vec::new(),
        }
    };
    let system = match route.provider() {
        // Google's parser takes the proto field name too (decision 84).
        Provider::Gemini => body
            .get("systemInstruction")
            .or_else(|| body.get("system_instruction"))
            .and_then(|s| s.get("parts")),
        Provider::Anthropic => body.get("system"),
        _ if route == Route::OpenaiResponses => body.get("instructions"),
        _ => None,
    };
    let mut system = system.map(parts_of);
    match route.provider() {
        Provider::Gemini => {
            for content in body
                .get("contents")
                .and_then(|c| c.as_array())
                .into_iter()
                .flatten()
            {
                // Said in the input schema's roles: the model's turns are `assistant`, the
                // older API's function results `tool`.
                let role = match content.get("role").and_then(|r| r.as_str()) {
                    Some("model") => "assistant",
                    Some("function") => "tool",
                    Some(role) => role,
                    None => "user",
                };
                let parts = content.get("parts").map(parts_of).unwrap_or_default();
                out.push(serde_json::json!({"role": role, "parts": parts}));
            }
        }
        _ => {
            let messages = body
                .get("messages")
                .or_else(|| body.get("input"))
                .or_else(|| body.get("prompt"));
            match messages {
                Some(serde_json::Value::Array(messages))
                    if messages.iter().all(serde_json::Value::is_object) =>
                {
                    for message in messages {
                        let kind = message.get("type").and_then(|t| t.as_str());
                        let role = match (message.get("role").and_then(|r| r.as_str()), kind) {
                            (Some(role), _) => role,
                            // A Responses item without a role: a tool's output, or what the
                            // model produced (a function call, reasoning, ...).
                            (None, Some(kind)) if kind.ends_with("_output") => "tool",
                            (None, Some(kind)) if kind != "message" => "assistant",
                            (None, _) => "user",
                        };
                        let parts = match (message.get("content"), kind) {
                            (Some(content), _) => parts_of(content),
                            (None, Some(kind)) => vec![serde_json::json!({"type": kind})],
                            (None, None) => Vec::new(),
                        };
                        out.push(serde_json::json!({"role": role, "parts": parts}));
                    }
                }
                Some(other) => {
                    out.push(serde_json::json!({"role": "user", "parts": parts_of(other)}));
                }
                None => {}
            }
        }
    }
    let messages = out
        .iter_mut()
        .filter_map(|m| m.get_mut("parts").and_then(|p| p.as_array_mut()))
        .flatten();
    cap_texts(messages, cap);
    if let Some(system) = &mut system {
        cap_texts(system.iter_mut(), cap);
    }
    (
        serde_json::Value::Array(out).to_string(),
        system.map(|parts| serde_json::Value::Array(parts).to_string()),
    )
}

/// Cuts the `content` texts of `parts` to `cap` bytes in all, in order.
fn cap_texts<'a>(parts: impl Iterator<Item = &'a mut serde_json::Value>, cap: usize) {
    let mut budget = cap;
    for part in parts {
        if let Some(serde_json::Value::String(text)) = part.get_mut("content") {
            *text = capped(std::mem::take(text), budget);
            budget -= text.len();
        }
    }
}

/// The members, quoted, that carry a finish reason (or a Responses status).
const REASON_KEYS: [&[u8]; 4] = [
    b"\"finish_reason\"",
    b"\"stop_reason\"",
    b"\"finishReason\"",
    b"\"status\"",
];

/// Whether `data` holds member `key` (quoted) with a string value: `key`, then optional
/// whitespace, a colon, optional whitespace and a quote.
fn has_string_value(data: &[u8], key: &[u8]) -> bool {
    memchr::memmem::find_iter(data, key).any(|at| {
        let mut rest = data[at + key.len()..]
            .iter()
            .skip_while(|b| b.is_ascii_whitespace());
        rest.next() == Some(&b':') && rest.find(|b| !b.is_ascii_whitespace()) == Some(&b'"')
    })
}

/// Reads what one answer body or stream event says about the answer: its id, model, finish
/// reasons and (when captured) text. Events that cannot say anything new are not parsed.
fn observe(route: Route, data: &[u8], answer: &mut Answer, capture: Option<usize>) {
    // Most events of a stream say nothing new once the id and model are known: only those
    // giving a finish reason a string value are parsed (OpenAI's chunks all carry
    // `"finish_reason":null` until the last).
    let known = answer.id.is_some() && answer.model.is_some();
    if known && capture.is_none() && !REASON_KEYS.iter().any(|key| has_string_value(data, key)) {
        return;
    }
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    // The answer object: the event itself, or the one it wraps (Anthropic's `message_start`,
    // a Responses event's `response`).
    let inner = value
        .get("message")
        .filter(|m| m.is_object())
        .or_else(|| value.get("response").filter(|r| r.is_object()))
        .unwrap_or(&value);
    let text_of = |v: Option<&serde_json::Value>| v.and_then(|v| v.as_str()).map(str::to_owned);
    if answer.id.is_none() {
        answer.id = text_of(inner.get("id")).or_else(|| text_of(inner.get("responseId")));
    }
    if answer.model.is_none() {
        answer.model = text_of(inner.get("model")).or_else(|| text_of(inner.get("modelVersion")));
    }
    if route.provider() == Provider::Openai {
        if let Some(tier) = text_of(inner.get("service_tier")) {
            answer.service_tier = Some(tier);
        }
        if let Some(fingerprint) = text_of(inner.get("system_fingerprint")) {
            answer.system_fingerprint = Some(fingerprint);
        }
    }
    // Each generation's reason under its index: a stream of several choices gives each its
    // own in a chunk of its own.
    for (index, choice) in generations(&value) {
        if let Some(reason) =
            text_of(choice.get("finish_reason")).or_else(|| text_of(choice.get("finishReason")))
        {
            answer.finish_reasons.insert(index, reason);
        }
    }
    if let Some(reason) = text_of(inner.get("stop_reason"))
        .or_else(|| text_of(value.get("delta").and_then(|d| d.get("stop_reason"))))
    {
        answer.finish_reasons.insert(0, reason);
    }
    if route == Route::OpenaiResponses
        && let Some(reason) = responses_finish_reason(inner)
    {
        answer.finish_reasons.insert(0, reason);
    }
    if let Some(cap) = capture
        && answer.text_len() < cap
    {
        collect_output(route, &value, answer);
    }
}

/// The finish reason of a finished Responses `response` object, in the words chat completions
/// and the reference instrumentation (opentelemetry-instrumentation-openai-v2) use: `completed`
/// is `tool_calls` when its output calls a function, else `stop`; `incomplete` for the output
/// token limit is `length` and for the content filter `content_filter`; `failed`, `cancelled`
/// and any other incomplete stay as they are. `None` while it runs (`queued`, `in_progress`).
fn responses_finish_reason(response: &serde_json::Value) -> Option<String> {
    let status = response.get("status")?.as_str()?;
    let reason = match status {
        "queued" | "in_progress" => return None,
        "completed" => {
            let calls = response
                .get("output")
                .and_then(|o| o.as_array())
                .into_iter()
                .flatten()
                .any(|item| {
                    matches!(
                        item.get("type").and_then(|t| t.as_str()),
                        Some("function_call" | "custom_tool_call")
                    )
                });
            if calls { "tool_calls" } else { "stop" }
        }
        "incomplete" => match response
            .get("incomplete_details")
            .and_then(|d| d.get("reason"))
            .and_then(|r| r.as_str())
        {
            Some("max_output_tokens") => "length",
            Some("content_filter") => "content_filter",
            _ => "incomplete",
        },
        other => other,
    };
    Some(reason.to_string())
}

/// The generations an answer body or stream event carries (OpenAI's `choices`, Gemini's
/// `candidates`), each with its `index` (its position when it has none: Gemini leaves out an
/// index of 0).
fn generations(value: &serde_json::Value) -> impl Iterator<Item = (u64, &serde_json::Value)> {
    value
        .get("choices")
        .or_else(|| value.get("candidates"))
        .and_then(|c| c.as_array())
        .into_iter()
        .flatten()
        .enumerate()
        .map(|(position, g)| {
            let index = g.get("index").and_then(serde_json::Value::as_u64);
            (index.unwrap_or(position as u64), g)
        })
}

/// Appends what an answer body or stream event carries to its generation's output: text, and
/// the tool calls the model asks for (OT-5).
fn collect_output(route: Route, value: &serde_json::Value, answer: &mut Answer) {
    let push = |texts: &mut BTreeMap<u64, String>, index: u64, v: Option<&serde_json::Value>| {
        if let Some(s) = v.and_then(|v| v.as_str()) {
            texts.entry(index).or_default().push_str(s);
        }
    };
    let str_of = |v: Option<&serde_json::Value>| v.and_then(|v| v.as_str()).map(str::to_owned);
    let texts = &mut answer.texts;
    let tools = &mut answer.tools;
    match route.provider() {
        Provider::Openai => {
            for (index, choice) in generations(value) {
                for member in ["delta", "message"] {
                    let Some(message) = choice.get(member) else {
                        continue;
                    };
                    push(texts, index, message.get("content"));
                    // A stream's calls come in pieces under their `index`: the id and name
                    // once, the arguments in fragments.
                    for (position, call) in message
                        .get("tool_calls")
                        .and_then(|c| c.as_array())
                        .into_iter()
                        .flatten()
                        .enumerate()
                    {
                        let slot = call
                            .get("index")
                            .and_then(serde_json::Value::as_u64)
                            .unwrap_or(position as u64);
                        let function = call.get("function");
                        tools.entry((index, slot)).or_default().add(
                            str_of(call.get("id")),
                            str_of(function.and_then(|f| f.get("name"))),
                            function.and_then(|f| f.get("arguments")),
                        );
                    }
                }
                push(texts, index, choice.get("text"));
            }
            if value.get("type").and_then(|t| t.as_str()) == Some("response.output_text.delta") {
                push(texts, 0, value.get("delta"));
            }
            push(texts, 0, value.get("output_text"));
            // A Responses answer that did not stream: its output items (a stream's text came
            // in deltas, and its final event repeats it).
            if value.get("object").and_then(|o| o.as_str()) == Some("response") {
                responses_output(value, texts, tools, true);
            }
            // A stream's calls: from its final `response`, whole.
            if let Some(response) = value.get("response").filter(|r| r.is_object())
                && responses_finish_reason(response).is_some()
            {
                responses_output(response, texts, tools, false);
            }
        }
        Provider::Anthropic => {
            let delta = value.get("delta");
            push(texts, 0, delta.and_then(|d| d.get("text")));
            let slot = value
                .get("index")
                .and_then(serde_json::Value::as_u64)
                .unwrap_or(0);
            // A stream's tool use: its block opens with the id and name, its input follows in
            // JSON fragments.
            if let Some(block) = value.get("content_block")
                && block.get("type").and_then(|t| t.as_str()) == Some("tool_use")
            {
                tools.entry((0, slot)).or_default().add(
                    str_of(block.get("id")),
                    str_of(block.get("name")),
                    None,
                );
            }
            if delta.and_then(|d| d.get("type")).and_then(|t| t.as_str())
                == Some("input_json_delta")
            {
                tools.entry((0, slot)).or_default().add(
                    None,
                    None,
                    delta.and_then(|d| d.get("partial_json")),
                );
            }
            for (position, block) in value
                .get("content")
                .and_then(|c| c.as_array())
                .into_iter()
                .flatten()
                .enumerate()
            {
                push(texts, 0, block.get("text"));
                if block.get("type").and_then(|t| t.as_str()) == Some("tool_use") {
                    let input = block.get("input").map(|i| serde_json::json!(i.to_string()));
                    tools.entry((0, position as u64)).or_default().add(
                        str_of(block.get("id")),
                        str_of(block.get("name")),
                        input.as_ref(),
                    );
                }
            }
        }
        Provider::Gemini => {
            for (index, candidate) in generations(value) {
                for part in candidate
                    .get("content")
                    .and_then(|c| c.get("parts"))
                    .and_then(|p| p.as_array())
                    .into_iter()
                    .flatten()
                {
                    push(texts, index, part.get("text"));
                    // Each call comes whole, in one chunk.
                    if let Some(call) = part
                        .get("functionCall")
                        .or_else(|| part.get("function_call"))
                    {
                        let slot = tools.range((index, 0)..=(index, u64::MAX)).count() as u64;
                        let args = call.get("args").map(|a| serde_json::json!(a.to_string()));
                        tools.entry((index, slot)).or_default().add(
                            str_of(call.get("id")),
                            str_of(call.get("name")),
                            args.as_ref(),
                        );
                    }
                }
            }
        }
        #[cfg(test)]
        Provider::Echo => {}
    }
}

/// The text (when `with_text`) and function calls of a Responses `response` object's output
/// items, as generation 0's: the calls replace any seen before (the object holds them all).
fn responses_output(
    response: &serde_json::Value,
    texts: &mut BTreeMap<u64, String>,
    tools: &mut BTreeMap<(u64, u64), ToolCall>,
    with_text: bool,
) {
    let str_of = |v: Option<&serde_json::Value>| v.and_then(|v| v.as_str()).map(str::to_owned);
    let items = response.get("output").and_then(|o| o.as_array());
    let mut slot = 0;
    tools.retain(|(generation, _), _| *generation != 0);
    for item in items.into_iter().flatten() {
        match item.get("type").and_then(|t| t.as_str()) {
            Some("message") if with_text => {
                for part in item
                    .get("content")
                    .and_then(|c| c.as_array())
                    .into_iter()
                    .flatten()
                {
                    if part.get("type").and_then(|t| t.as_str()) == Some("output_text")
                        && let Some(text) = part.get("text").and_then(|t| t.as_str())
                    {
                        texts.entry(0).or_default().push_str(text);
                    }
                }
            }
            Some("function_call" | "custom_tool_call") => {
                let arguments = item.get("arguments").or_else(|| item.get("input"));
                tools.entry((0, slot)).or_default().add(
                    str_of(item.get("call_id")),
                    str_of(item.get("name")),
                    arguments,
                );
                slot += 1;
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_attempts_span_id_is_the_same_for_the_same_request_and_attempt_and_differs_otherwise_ot3()
    {
        let a = Uuid::now_v7();
        let b = Uuid::now_v7();
        assert_eq!(attempt_span_id(a, 1), attempt_span_id(a, 1));
        assert_ne!(attempt_span_id(a, 1), attempt_span_id(a, 2));
        assert_ne!(attempt_span_id(a, 1), attempt_span_id(b, 1));
        assert_ne!(attempt_span_id(a, 1), SpanId::INVALID);
    }

    #[test]
    fn a_stored_traceparent_is_read_back_as_the_same_context_ot2() {
        let tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let cx = extract(tp);
        assert_eq!(inject(&cx).as_deref(), Some(tp));
        assert!(extract("garbage").span().span_context().trace_id() == TraceId::INVALID);
    }

    #[test]
    fn answers_of_each_provider_give_their_id_model_and_finish_reasons() {
        let cases: [(Route, &str, &str, &str, &str); 4] = [
            (
                Route::OpenaiChat,
                r#"{"id":"chatcmpl-1","model":"gpt-4o-mini","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}]}"#,
                "chatcmpl-1",
                "gpt-4o-mini",
                "stop",
            ),
            (
                Route::AnthropicMessages,
                r#"{"id":"msg_1","type":"message","model":"claude-x","content":[{"type":"text","text":"hi"}],"stop_reason":"end_turn"}"#,
                "msg_1",
                "claude-x",
                "end_turn",
            ),
            (
                Route::GeminiGenerate,
                r#"{"candidates":[{"content":{"parts":[{"text":"hi"}],"role":"model"},"finishReason":"STOP"}],"modelVersion":"gemini-2.5-flash","responseId":"r1"}"#,
                "r1",
                "gemini-2.5-flash",
                "STOP",
            ),
            (
                Route::OpenaiResponses,
                r#"{"id":"resp_1","object":"response","model":"gpt-4o","status":"completed","output":[]}"#,
                "resp_1",
                "gpt-4o",
                "stop",
            ),
        ];
        for (route, body, id, model, reason) in cases {
            let mut answer = Answer::default();
            observe(route, body.as_bytes(), &mut answer, Some(100));
            assert_eq!(answer.id.as_deref(), Some(id), "{body}");
            assert_eq!(answer.model.as_deref(), Some(model), "{body}");
            assert_eq!(
                answer.finish_reasons.values().collect::<Vec<_>>(),
                vec![reason],
                "{body}"
            );
        }
    }

    #[test]
    fn an_anthropic_stream_gives_its_id_from_message_start_and_its_reason_and_text_from_deltas() {
        let events = [
            r#"{"type":"message_start","message":{"id":"msg_9","model":"claude-y","content":[],"stop_reason":null}}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hel"}}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"lo"}}"#,
            r#"{"type":"message_delta","delta":{"stop_reason":"max_tokens"},"usage":{"output_tokens":2}}"#,
        ];
        let mut answer = Answer::default();
        for event in events {
            observe(
                Route::AnthropicMessages,
                event.as_bytes(),
                &mut answer,
                Some(100),
            );
        }
        assert_eq!(answer.id.as_deref(), Some("msg_9"));
        assert_eq!(answer.model.as_deref(), Some("claude-y"));
        assert_eq!(
            answer.finish_reasons.values().collect::<Vec<_>>(),
            vec!["max_tokens"]
        );
        assert_eq!(answer.texts[&0], "Hello");
    }

    /// The request attributes of `body` on `route`, as JSON for comparing (ints as ints,
    /// doubles as floats, arrays as arrays).
    fn request_params(route: Route, body: &str) -> serde_json::Value {
        let mut out = Vec::new();
        request_attributes(route, body.as_bytes(), &mut out);
        let mut map = serde_json::Map::new();
        for kv in out {
            let v = match kv.value {
                Value::I64(n) => serde_json::json!(n),
                Value::F64(x) => serde_json::json!(x),
                Value::String(s) => serde_json::json!(s.as_str()),
                Value::Array(opentelemetry::Array::String(items)) => {
                    serde_json::json!(items.iter().map(|s| s.as_str()).collect::<Vec<_>>())
                }
                other => panic!("unexpected {other:?}"),
            };
            map.insert(kv.key.to_string(), v);
        }
        serde_json::Value::Object(map)
    }

    /// OT-3: each provider's request parameters under the conventions' names and types: a
    /// temperature written `1` is a double, a lone stop string an array, `n` of 1 says nothing.
    #[test]
    fn each_providers_request_parameters_become_the_genai_request_attributes_ot3() {
        let chat = request_params(
            Route::OpenaiChat,
            r#"{"model":"m","messages":[],"max_completion_tokens":50,"temperature":1,"top_p":0.5,"seed":7,"stop":"END","n":2,"presence_penalty":0,"frequency_penalty":0.25,"response_format":{"type":"json_schema"}}"#,
        );
        assert_eq!(
            chat,
            serde_json::json!({
                "gen_ai.request.max_tokens": 50, "gen_ai.request.seed": 7,
                "gen_ai.request.temperature": 1.0, "gen_ai.request.top_p": 0.5,
                "gen_ai.request.presence_penalty": 0.0, "gen_ai.request.frequency_penalty": 0.25,
                "gen_ai.request.stop_sequences": ["END"], "gen_ai.request.choice.count": 2,
                "gen_ai.output.type": "json",
            })
        );
        assert!(chat["gen_ai.request.temperature"].is_f64());
        let one = request_params(Route::OpenaiChat, r#"{"model":"m","n":1,"max_tokens":9}"#);
        assert_eq!(one, serde_json::json!({"gen_ai.request.max_tokens": 9}));
        let responses = request_params(
            Route::OpenaiResponses,
            r#"{"model":"m","input":"hi","max_output_tokens":100,"temperature":0.2,"text":{"format":{"type":"text"}}}"#,
        );
        assert_eq!(
            responses,
            serde_json::json!({
                "gen_ai.request.max_tokens": 100, "gen_ai.request.temperature": 0.2,
                "gen_ai.output.type": "text",
            })
        );
        let anthropic = request_params(
            Route::AnthropicMessages,
            r#"{"model":"c","max_tokens":64,"top_k":5,"stop_sequences":["a","b"],"messages":[]}"#,
        );
        assert_eq!(
            anthropic,
            serde_json::json!({
                "gen_ai.request.max_tokens": 64, "gen_ai.request.top_k": 5.0,
                "gen_ai.request.stop_sequences": ["a", "b"],
            })
        );
        for config in ["generationConfig", "generation_config"] {
            let gemini = request_params(
                Route::GeminiGenerate,
                &format!(
                    r#"{{"contents":[],"{config}":{{"maxOutputTokens":32,"temperature":0.7,"topK":40,"stopSequences":["x"],"seed":3,"candidateCount":1,"responseMimeType":"application/json"}}}}"#
                ),
            );
            assert_eq!(
                gemini,
                serde_json::json!({
                    "gen_ai.request.max_tokens": 32, "gen_ai.request.seed": 3,
                    "gen_ai.request.temperature": 0.7, "gen_ai.request.top_k": 40.0,
                    "gen_ai.request.stop_sequences": ["x"], "gen_ai.output.type": "json",
                }),
                "{config}"
            );
        }
        let embeddings = request_params(
            Route::OpenaiEmbeddings,
            r#"{"model":"e","input":"hi","dimensions":256,"encoding_format":"base64"}"#,
        );
        assert_eq!(
            embeddings,
            serde_json::json!({
                "gen_ai.embeddings.dimension.count": 256,
                "gen_ai.request.encoding_formats": ["base64"],
            })
        );
        // Nothing set, nothing said; a body that is not an object says nothing either.
        assert_eq!(
            request_params(Route::OpenaiChat, r#"{"model":"m","messages":[]}"#),
            serde_json::json!({})
        );
        assert_eq!(
            request_params(Route::OpenaiChat, "[]"),
            serde_json::json!({})
        );
    }

    /// OT-3: the OpenAI conventions' attributes a request says (the service tier asked for,
    /// unless `auto`; a Responses call's stored conversation, by id or as `{id}`) and an
    /// answer says (the tier that served it, chat's system fingerprint), read from the events
    /// holdfast parses anyway: a Responses stream's last event, not its first, names the tier.
    #[test]
    fn an_openai_call_gives_its_service_tiers_fingerprint_and_conversation_ot3() {
        assert_eq!(
            request_params(
                Route::OpenaiChat,
                r#"{"model":"m","messages":[],"service_tier":"flex"}"#
            ),
            serde_json::json!({"openai.request.service_tier": "flex"})
        );
        for conversation in [r#""conv_1""#, r#"{"id":"conv_1"}"#] {
            assert_eq!(
                request_params(
                    Route::OpenaiResponses,
                    &format!(
                        r#"{{"model":"m","input":"hi","service_tier":"auto","conversation":{conversation}}}"#
                    )
                ),
                serde_json::json!({"gen_ai.conversation.id": "conv_1"}),
                "{conversation}"
            );
        }
        // Not an OpenAI member elsewhere.
        assert_eq!(
            request_params(
                Route::AnthropicMessages,
                r#"{"model":"c","max_tokens":9,"messages":[],"service_tier":"standard_only"}"#
            ),
            serde_json::json!({"gen_ai.request.max_tokens": 9})
        );
        let mut chat = Answer::default();
        for event in [
            r#"{"id":"c1","model":"gpt-4o-mini","service_tier":"default","system_fingerprint":"fp_1","choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}"#,
            r#"{"id":"c1","model":"gpt-4o-mini","service_tier":"default","system_fingerprint":"fp_1","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#,
        ] {
            observe(Route::OpenaiChat, event.as_bytes(), &mut chat, None);
        }
        assert_eq!(chat.service_tier.as_deref(), Some("default"));
        assert_eq!(chat.system_fingerprint.as_deref(), Some("fp_1"));
        let mut responses = Answer::default();
        for event in [
            r#"{"type":"response.created","response":{"id":"resp_1","model":"m","status":"in_progress","service_tier":"auto"}}"#,
            r#"{"type":"response.output_text.delta","delta":"hi"}"#,
            r#"{"type":"response.completed","response":{"id":"resp_1","model":"m","status":"completed","service_tier":"default","output":[]}}"#,
        ] {
            observe(
                Route::OpenaiResponses,
                event.as_bytes(),
                &mut responses,
                None,
            );
        }
        assert_eq!(responses.service_tier.as_deref(), Some("default"));
    }

    /// OT-3, OT-5: a stream of two choices (`n: 2`) gives each choice's finish reason in a
    /// chunk of its own: both are reported, in index order, and the captured answer is one
    /// output message per choice carrying its finish reason, as the conventions' output message
    /// schema requires, not the two texts interleaved into one.
    #[test]
    fn each_choice_of_a_stream_keeps_its_finish_reason_and_its_own_output_message_ot3_ot5() {
        let events = [
            r#"{"id":"c1","model":"gpt-4o-mini","choices":[{"index":0,"delta":{"role":"assistant","content":"Hel"},"finish_reason":null}]}"#,
            r#"{"id":"c1","model":"gpt-4o-mini","choices":[{"index":1,"delta":{"role":"assistant","content":"Bon"},"finish_reason":null}]}"#,
            r#"{"id":"c1","model":"gpt-4o-mini","choices":[{"index":0,"delta":{"content":"lo"},"finish_reason":null}]}"#,
            r#"{"id":"c1","model":"gpt-4o-mini","choices":[{"index":1,"delta":{"content":"jour"},"finish_reason":null}]}"#,
            r#"{"id":"c1","model":"gpt-4o-mini","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#,
            r#"{"id":"c1","model":"gpt-4o-mini","choices":[{"index":1,"delta":{},"finish_reason":"length"}]}"#,
        ];
        let mut answer = Answer::default();
        for event in events {
            observe(Route::OpenaiChat, event.as_bytes(), &mut answer, Some(100));
        }
        assert_eq!(
            answer.finish_reasons.values().collect::<Vec<_>>(),
            vec!["stop", "length"]
        );
        let output: serde_json::Value =
            serde_json::from_str(&answer.output_messages(Provider::Openai, 100).unwrap()).unwrap();
        assert_eq!(
            output,
            serde_json::json!([
                {"role": "assistant", "parts": [{"type": "text", "content": "Hello"}], "finish_reason": "stop"},
                {"role": "assistant", "parts": [{"type": "text", "content": "Bonjour"}], "finish_reason": "length"},
            ])
        );
        // The cap holds for all the texts together.
        let cut: serde_json::Value =
            serde_json::from_str(&answer.output_messages(Provider::Openai, 7).unwrap()).unwrap();
        assert_eq!(cut[0]["parts"][0]["content"], "Hello");
        assert_eq!(cut[1]["parts"][0]["content"], "Bo");
        // A stream cut before its finish reason: the message says `error`.
        let mut cut_short = Answer::default();
        observe(
            Route::OpenaiChat,
            events[0].as_bytes(),
            &mut cut_short,
            Some(100),
        );
        let output: serde_json::Value =
            serde_json::from_str(&cut_short.output_messages(Provider::Openai, 100).unwrap())
                .unwrap();
        assert_eq!(output[0]["finish_reason"], "error");
    }

    /// OT-3: a Responses answer's status is not a reason the model stopped: it is reported in
    /// chat's words, as the reference instrumentation reports it, so one dashboard panel counts
    /// `stop`, `length` and `tool_calls` across both OpenAI APIs. The stream's final event says
    /// it; the events before it (`queued`, `in_progress`) say nothing.
    #[test]
    fn a_responses_answer_gives_its_finish_reason_in_chats_words_ot3() {
        let cases = [
            (
                r#"{"type":"response.completed","response":{"id":"resp_1","model":"m","status":"completed","output":[{"type":"message","status":"completed"}]}}"#,
                "stop",
            ),
            (
                r#"{"type":"response.completed","response":{"id":"resp_1","model":"m","status":"completed","output":[{"type":"reasoning"},{"type":"function_call","name":"f","arguments":"{}"}]}}"#,
                "tool_calls",
            ),
            (
                r#"{"type":"response.incomplete","response":{"id":"resp_1","model":"m","status":"incomplete","incomplete_details":{"reason":"max_output_tokens"},"output":[]}}"#,
                "length",
            ),
            (
                r#"{"type":"response.incomplete","response":{"id":"resp_1","model":"m","status":"incomplete","incomplete_details":{"reason":"content_filter"},"output":[]}}"#,
                "content_filter",
            ),
            (
                r#"{"type":"response.failed","response":{"id":"resp_1","model":"m","status":"failed","output":[]}}"#,
                "failed",
            ),
        ];
        for (event, reason) in cases {
            let mut answer = Answer::default();
            for before in [
                r#"{"type":"response.queued","response":{"id":"resp_1","model":"m","status":"queued"}}"#,
                r#"{"type":"response.in_progress","response":{"id":"resp_1","model":"m","status":"in_progress"}}"#,
            ] {
                observe(Route::OpenaiResponses, before.as_bytes(), &mut answer, None);
                assert!(answer.finish_reasons.is_empty(), "{before}");
            }
            observe(Route::OpenaiResponses, event.as_bytes(), &mut answer, None);
            assert_eq!(
                answer.finish_reasons.values().collect::<Vec<_>>(),
                vec![reason],
                "{event}"
            );
        }
    }

    /// The captured output of `events` on `route`, parsed.
    fn output_of(route: Route, events: &[&str]) -> serde_json::Value {
        let mut answer = Answer::default();
        for event in events {
            observe(route, event.as_bytes(), &mut answer, Some(1000));
        }
        serde_json::from_str(
            &answer
                .output_messages(route.provider(), 1000)
                .expect("an output"),
        )
        .unwrap()
    }

    /// OT-5: an answer that calls tools (an agent's turn) has its calls captured as the
    /// conventions' `tool_call` parts, from each provider's answer streamed or not, instead of
    /// no output at all; a Responses answer that did not stream has its text captured from its
    /// output items.
    #[test]
    fn tool_calls_and_a_whole_responses_answer_are_captured_as_output_parts_ot5() {
        let call = serde_json::json!({
            "type": "tool_call", "id": "call_1", "name": "get_weather",
            "arguments": {"city": "Paris"},
        });
        let chat_stream = output_of(
            Route::OpenaiChat,
            &[
                r#"{"id":"c","model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":null,"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"get_weather","arguments":""}}]},"finish_reason":null}]}"#,
                r#"{"id":"c","model":"m","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"city\": "}}]},"finish_reason":null}]}"#,
                r#"{"id":"c","model":"m","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"\"Paris\"}"}}]},"finish_reason":null}]}"#,
                r#"{"id":"c","model":"m","choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#,
            ],
        );
        assert_eq!(
            chat_stream,
            serde_json::json!([{"role": "assistant", "parts": [call], "finish_reason": "tool_call"}])
        );
        let chat = output_of(
            Route::OpenaiChat,
            &[
                r#"{"id":"c","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"Checking.","tool_calls":[{"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Paris\"}"}}]},"finish_reason":"tool_calls"}]}"#,
            ],
        );
        assert_eq!(
            chat[0]["parts"],
            serde_json::json!([{"type": "text", "content": "Checking."}, call])
        );
        let anthropic_stream = output_of(
            Route::AnthropicMessages,
            &[
                r#"{"type":"message_start","message":{"id":"msg_1","model":"c","content":[],"stop_reason":null}}"#,
                r#"{"type":"content_block_start","index":0,"content_block":{"type":"tool_use","id":"call_1","name":"get_weather","input":{}}}"#,
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"input_json_delta","partial_json":"{\"city\":"}}"#,
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"input_json_delta","partial_json":" \"Paris\"}"}}"#,
                r#"{"type":"message_delta","delta":{"stop_reason":"tool_use"},"usage":{"output_tokens":9}}"#,
            ],
        );
        assert_eq!(anthropic_stream[0]["parts"], serde_json::json!([call]));
        assert_eq!(anthropic_stream[0]["finish_reason"], "tool_call");
        let anthropic = output_of(
            Route::AnthropicMessages,
            &[
                r#"{"id":"msg_1","type":"message","model":"c","content":[{"type":"tool_use","id":"call_1","name":"get_weather","input":{"city":"Paris"}}],"stop_reason":"tool_use"}"#,
            ],
        );
        assert_eq!(anthropic[0]["parts"], serde_json::json!([call]));
        let gemini = output_of(
            Route::GeminiGenerate,
            &[
                r#"{"candidates":[{"content":{"role":"model","parts":[{"functionCall":{"id":"call_1","name":"get_weather","args":{"city":"Paris"}}}]},"finishReason":"STOP"}],"responseId":"r","modelVersion":"g"}"#,
            ],
        );
        assert_eq!(gemini[0]["parts"], serde_json::json!([call]));
        assert_eq!(gemini[0]["finish_reason"], "tool_call", "STOP, with calls");
        let responses = output_of(
            Route::OpenaiResponses,
            &[
                r#"{"id":"resp_1","object":"response","model":"m","status":"completed","output":[{"type":"message","role":"assistant","status":"completed","content":[{"type":"output_text","text":"Checking."}]},{"type":"function_call","call_id":"call_1","name":"get_weather","arguments":"{\"city\":\"Paris\"}","status":"completed"}]}"#,
            ],
        );
        assert_eq!(
            responses,
            serde_json::json!([{
                "role": "assistant",
                "parts": [{"type": "text", "content": "Checking."}, call],
                "finish_reason": "tool_call",
            }])
        );
        // A Responses stream: the text from its deltas, the call from its final event, once.
        let responses_stream = output_of(
            Route::OpenaiResponses,
            &[
                r#"{"type":"response.created","response":{"id":"resp_1","object":"response","model":"m","status":"in_progress","output":[]}}"#,
                r#"{"type":"response.output_text.delta","delta":"Checking."}"#,
                r#"{"type":"response.completed","response":{"id":"resp_1","object":"response","model":"m","status":"completed","output":[{"type":"message","role":"assistant","status":"completed","content":[{"type":"output_text","text":"Checking."}]},{"type":"function_call","call_id":"call_1","name":"get_weather","arguments":"{\"city\":\"Paris\"}","status":"completed"}]}}"#,
            ],
        );
        assert_eq!(responses_stream, responses);
    }

    /// OT-3, OT-5: each output message says its generation's finish reason in the output
    /// schema's enumerated words where one applies, whatever the provider's, and keeps the
    /// provider's word where none does; `gen_ai.response.finish_reasons` keeps the provider's
    /// words (decision 113).
    #[test]
    fn each_providers_finish_reason_is_said_in_the_output_schemas_words_ot3_ot5() {
        let anthropic = |reason: &str| {
            format!(
                r#"{{"id":"msg_1","type":"message","model":"c","content":[{{"type":"text","text":"hi"}}],"stop_reason":"{reason}"}}"#
            )
        };
        let gemini = |reason: &str| {
            format!(
                r#"{{"candidates":[{{"content":{{"role":"model","parts":[{{"text":"hi"}}]}},"finishReason":"{reason}"}}],"responseId":"r","modelVersion":"g"}}"#
            )
        };
        let chat = |reason: &str| {
            format!(
                r#"{{"id":"c","model":"m","choices":[{{"index":0,"message":{{"role":"assistant","content":"hi"}},"finish_reason":"{reason}"}}]}}"#
            )
        };
        let cases = [
            (Route::AnthropicMessages, anthropic("end_turn"), "end_turn", "stop"),
            (Route::AnthropicMessages, anthropic("stop_sequence"), "stop_sequence", "stop"),
            (Route::AnthropicMessages, anthropic("max_tokens"), "max_tokens", "length"),
            (Route::AnthropicMessages, anthropic("refusal"), "refusal", "content_filter"),
            (Route::AnthropicMessages, anthropic("pause_turn"), "pause_turn", "pause_turn"),
            (Route::GeminiGenerate, gemini("STOP"), "STOP", "stop"),
            (Route::GeminiGenerate, gemini("MAX_TOKENS"), "MAX_TOKENS", "length"),
            (Route::GeminiGenerate, gemini("SAFETY"), "SAFETY", "content_filter"),
            (Route::GeminiGenerate, gemini("OTHER"), "OTHER", "error"),
            (Route::GeminiGenerate, gemini("LANGUAGE"), "LANGUAGE", "LANGUAGE"),
            (Route::OpenaiChat, chat("stop"), "stop", "stop"),
            (Route::OpenaiChat, chat("length"), "length", "length"),
            (Route::OpenaiChat, chat("content_filter"), "content_filter", "content_filter"),
            (Route::OpenaiChat, chat("tool_calls"), "tool_calls", "tool_call"),
            (
                Route::OpenaiResponses,
                r#"{"id":"resp_1","object":"response","model":"m","status":"failed","output":[{"type":"message","role":"assistant","content":[{"type":"output_text","text":"hi"}]}]}"#.into(),
                "failed",
                "error",
            ),
        ];
        for (route, body, word, said) in cases {
            let mut answer = Answer::default();
            observe(route, body.as_bytes(), &mut answer, Some(100));
            assert_eq!(
                answer.finish_reasons.values().collect::<Vec<_>>(),
                vec![word],
                "the attribute keeps the provider's word: {body}"
            );
            let output: serde_json::Value =
                serde_json::from_str(&answer.output_messages(route.provider(), 100).unwrap())
                    .unwrap();
            assert_eq!(output[0]["finish_reason"], said, "{body}");
        }
    }

    #[test]
    fn only_an_event_that_gives_a_reason_a_string_value_is_worth_parsing() {
        let key = REASON_KEYS[0];
        assert!(!has_string_value(
            br#"{"choices":[{"finish_reason":null}]}"#,
            key
        ));
        assert!(has_string_value(
            br#"{"choices":[{"finish_reason":"stop"}]}"#,
            key
        ));
        assert!(has_string_value(
            br#"{"choices":[{"finish_reason" :  "length"}]}"#,
            key
        ));
        assert!(!has_string_value(br#"{"text":"finish_reason"}"#, key));
        assert!(!has_string_value(
            br#"{"choices":[{"delta":{"content":"hi"}}]}"#,
            key
        ));
    }

    #[test]
    fn captured_content_is_cut_on_a_character_boundary_ot5() {
        assert_eq!(capped("héllo".into(), 2), "h");
        assert_eq!(capped("hello".into(), 10), "hello");
        let body = br#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{}}]}]}"#;
        let (cut, system) = prompt(Route::OpenaiChat, body, 5);
        let cut: serde_json::Value = serde_json::from_str(&cut).unwrap();
        assert_eq!(cut[0]["parts"][0]["content"], "be br");
        assert_eq!(cut[1]["parts"][0]["content"], "");
        // A chat's system message is part of its history (OT-5).
        assert_eq!(system, None);
        let (input, _) = prompt(Route::OpenaiChat, body, 100);
        let input: serde_json::Value = serde_json::from_str(&input).unwrap();
        assert_eq!(input[0]["role"], "system");
        assert_eq!(input[0]["parts"][0]["content"], "be brief");
        assert_eq!(input[1]["parts"][0]["content"], "hi");
        assert_eq!(input[1]["parts"][1]["type"], "image_url");
    }

    /// The OpenAI Agents SDK sends every Responses call its agent's `instructions` and, after a
    /// tool ran, the call and its output as items without a role: the instructions are the
    /// system instructions, given apart from the history as Anthropic's `system` is, and each
    /// item is named by its type under the role that produced it, not shown as an empty user
    /// message.
    #[test]
    fn a_responses_prompts_instructions_and_tool_items_are_captured_ot5() {
        let body = br#"{"include":[],"input":[{"content":"weather in Paris?","role":"user"},{"arguments":"{\"city\": \"Paris\"}","call_id":"call_1","name":"get_weather","type":"function_call","id":"fc_1","status":"completed"},{"call_id":"call_1","output":"sunny in Paris","type":"function_call_output"}],"instructions":"be brief","model":"gpt-4o-mini","tools":[]}"#;
        let (input, system) = prompt(Route::OpenaiResponses, body, 100);
        let input: serde_json::Value = serde_json::from_str(&input).unwrap();
        assert_eq!(
            input,
            serde_json::json!([
                {"role": "user", "parts": [{"type": "text", "content": "weather in Paris?"}]},
                {"role": "assistant", "parts": [{"type": "function_call"}]},
                {"role": "tool", "parts": [{"type": "function_call_output"}]}
            ])
        );
        let system: serde_json::Value = serde_json::from_str(&system.unwrap()).unwrap();
        assert_eq!(
            system,
            serde_json::json!([{"type": "text", "content": "be brief"}])
        );
    }

    /// Google's JSON parser takes `system_instruction` as well as `systemInstruction`, and its
    /// REST examples write the first: the captured system instructions keep it (decision 84).
    #[test]
    fn a_gemini_prompts_system_instruction_is_captured_under_either_of_its_names_ot5() {
        for name in ["systemInstruction", "system_instruction"] {
            let body = format!(
                r#"{{"{name}":{{"parts":[{{"text":"be brief"}}]}},"contents":[{{"role":"user","parts":[{{"text":"hi"}}]}}]}}"#
            );
            let (input, system) = prompt(Route::GeminiGenerate, body.as_bytes(), 100);
            let input: serde_json::Value = serde_json::from_str(&input).unwrap();
            let system: serde_json::Value = serde_json::from_str(&system.unwrap()).unwrap();
            assert_eq!(
                system,
                serde_json::json!([{"type": "text", "content": "be brief"}]),
                "{name}"
            );
            assert_eq!(input.as_array().map(Vec::len), Some(1), "{name}: {input}");
            assert_eq!(input[0]["parts"][0]["content"], "hi", "{name}");
        }
    }

    /// OT-5: Gemini names the model's turns `model` (and the older function results
    /// `function`): the input messages say them in the input schema's roles, `assistant` and
    /// `tool`, as the other providers' messages do.
    #[test]
    fn a_gemini_prompts_turns_are_said_in_the_input_schemas_roles_ot5() {
        let body = br#"{"contents":[{"role":"user","parts":[{"text":"weather?"}]},{"role":"model","parts":[{"functionCall":{"name":"get_weather","args":{}}}]},{"role":"function","parts":[{"functionResponse":{"name":"get_weather","response":{}}}]},{"parts":[{"text":"and tomorrow?"}]}]}"#;
        let (input, _) = prompt(Route::GeminiGenerate, body, 100);
        let input: serde_json::Value = serde_json::from_str(&input).unwrap();
        let roles: Vec<&str> = input
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["role"].as_str().unwrap())
            .collect();
        assert_eq!(roles, ["user", "assistant", "tool", "user"]);
    }

    /// OT-5: Anthropic's `system`, a string or text blocks (with `cache_control`, as agents send
    /// it), is the system instructions, one part per block, cut to the cap on its own.
    #[test]
    fn an_anthropic_system_prompt_is_the_system_instructions_cut_to_its_own_cap_ot5() {
        let body = br#"{"model":"c","max_tokens":9,"system":[{"type":"text","text":"You are terse.","cache_control":{"type":"ephemeral"}},{"type":"text","text":"Answer in French."}],"messages":[{"role":"user","content":"hello"}]}"#;
        let (input, system) = prompt(Route::AnthropicMessages, body, 20);
        let input: serde_json::Value = serde_json::from_str(&input).unwrap();
        assert_eq!(
            input,
            serde_json::json!([{"role": "user", "parts": [{"type": "text", "content": "hello"}]}])
        );
        let system: serde_json::Value = serde_json::from_str(&system.unwrap()).unwrap();
        assert_eq!(
            system,
            serde_json::json!([
                {"type": "text", "content": "You are terse."},
                {"type": "text", "content": "Answer"},
            ])
        );
        let (_, none) = prompt(
            Route::AnthropicMessages,
            br#"{"model":"c","messages":[]}"#,
            20,
        );
        assert_eq!(none, None);
    }
}
