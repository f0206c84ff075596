//! What holdfast knows about each provider, in one place: one module per provider kind
//! (`openai.rs`, `anthropic.rs`, `gemini.rs`), the proxied [`Route`]s each serves, and how a
//! provider answer is read (`events.rs`: stream events and whole bodies, LC-7, LC-11).
//!
//! A provider module owns every rule that differs between providers: the upstream paths of its
//! routes, how the backend's key is sent, which client headers are forwarded and which are
//! sent by default, the name of its request-id header, its error body and stream error event,
//! which event completes each of its streams, what a successful answer must contain, and the
//! shape and paging of its model list. The
//! rest of holdfast asks this module and never spells a provider rule itself (docs/architecture.md,
//! "How to add a provider").

mod anthropic;
mod dataset;
#[cfg(test)]
mod echo;
mod events;
mod gemini;
mod members;
mod openai;

use std::collections::HashMap;
use std::time::Duration;

use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use serde_json::value::RawValue;

pub(crate) use events::{Order, excerpt};

/// The provider's headers passed on with a live answer (RS-5a), shared by every client it is
/// delivered to.
pub(crate) type PassedHeaders = std::sync::Arc<[(HeaderName, HeaderValue)]>;

/// The kind of API a backend speaks, and the shape its clients expect (SPEC §0 "backend").
/// The config spelling is lower-case: `kind = "openai"`, `"anthropic"` or `"gemini"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Provider {
    /// OpenAI, or any OpenAI-compatible server.
    Openai,
    /// Anthropic's Messages API.
    Anthropic,
    /// Google's Gemini API (GM-1).
    Gemini,
    /// A provider compiled only in tests (`echo.rs`), which proves the provider boundary.
    #[cfg(test)]
    Echo,
}

/// One proxied endpoint (SPEC §0 "route", HTTP-1). The name (`openai.chat`, ...) is stored with
/// each request and is part of its hash (ID-3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Route {
    /// `POST /v1/chat/completions`.
    OpenaiChat,
    /// `POST /v1/completions`.
    OpenaiCompletions,
    /// `POST /v1/embeddings`.
    OpenaiEmbeddings,
    /// `POST /v1/responses`.
    OpenaiResponses,
    /// `POST /v1/messages`.
    AnthropicMessages,
    /// `POST /v1beta/models/{model}:generateContent` (GM-1).
    GeminiGenerate,
    /// `POST /v1beta/models/{model}:streamGenerateContent?alt=sse` (GM-1).
    GeminiStream,
    /// `POST /v1/models/{model}:generateContent` (GM-1).
    GeminiV1Generate,
    /// `POST /v1/models/{model}:streamGenerateContent?alt=sse` (GM-1).
    GeminiV1Stream,
    /// `POST /echo/say`, the test-only provider's route.
    #[cfg(test)]
    EchoSay,
}

impl Provider {
    /// Every provider kind.
    #[cfg(not(test))]
    pub const ALL: [Provider; 3] = [Provider::Openai, Provider::Anthropic, Provider::Gemini];
    /// Every provider kind, the test-only one included.
    #[cfg(test)]
    pub const ALL: [Provider; 4] = [
        Provider::Openai,
        Provider::Anthropic,
        Provider::Gemini,
        Provider::Echo,
    ];

    /// The config spelling.
    pub fn name(self) -> &'static str {
        match self {
            Provider::Openai => "openai",
            Provider::Anthropic => "anthropic",
            Provider::Gemini => "gemini",
            #[cfg(test)]
            Provider::Echo => "echo",
        }
    }

    /// The provider whose clients call `path` on holdfast: its error shape answers a request
    /// that matched no route (IN-1).
    pub(crate) fn for_path(path: &str) -> Provider {
        if anthropic::owns_path(path) {
            Provider::Anthropic
        } else if gemini::owns_path(path) {
            Provider::Gemini
        } else {
            #[cfg(test)]
            if echo::owns_path(path) {
                return Provider::Echo;
            }
            Provider::Openai
        }
    }

    /// Whether `path` is a Gemini model call without its version (`/models/{model}:...`), a
    /// client that expects its base URL to carry it (IN-1).
    pub(crate) fn is_gemini_call_without_version(path: &str) -> bool {
        gemini::lacks_version(path)
    }

    /// The header that carries the backend's key, and its value for `key` (ID-3a, IN-3).
    pub(crate) fn auth_header(self, key: &str) -> (&'static str, String) {
        match self {
            Provider::Openai => openai::auth_header(key),
            Provider::Anthropic => anthropic::auth_header(key),
            Provider::Gemini => gemini::auth_header(key),
            #[cfg(test)]
            Provider::Echo => echo::auth_header(key),
        }
    }

    /// Client headers that change what the provider does: stored with the request, covered by
    /// its hash and forwarded upstream (ID-3a). Lower-case.
    pub fn forwarded_headers(self) -> &'static [&'static str] {
        match self {
            Provider::Openai => openai::FORWARDED_HEADERS,
            Provider::Anthropic => anthropic::FORWARDED_HEADERS,
            Provider::Gemini => gemini::FORWARDED_HEADERS,
            #[cfg(test)]
            Provider::Echo => echo::FORWARDED_HEADERS,
        }
    }

    /// Headers sent upstream when the client sent none of that name. They are added at
    /// admission, so what is hashed is what is sent (ID-3a).
    pub(crate) fn default_headers(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Provider::Openai => openai::DEFAULT_HEADERS,
            Provider::Anthropic => anthropic::DEFAULT_HEADERS,
            Provider::Gemini => gemini::DEFAULT_HEADERS,
            #[cfg(test)]
            Provider::Echo => echo::DEFAULT_HEADERS,
        }
    }

    /// The provider whose SDK made a call to a path several serve (`GET /v1/models`):
    /// Anthropic's SDKs send `anthropic-version` on every call, Google's `x-goog-api-key`.
    pub(crate) fn of_shared_call(headers: &HeaderMap) -> Provider {
        if anthropic::owns_call(headers) {
            Provider::Anthropic
        } else if gemini::owns_call(headers) {
            Provider::Gemini
        } else {
            #[cfg(test)]
            if echo::owns_call(headers) {
                return Provider::Echo;
            }
            Provider::Openai
        }
    }

    /// Whether a backend's `base_url` carries the API version (decision 1), so a forwarded
    /// client path loses its first segment; a Gemini backend's does not (decision 57).
    pub(crate) fn base_url_has_version(self) -> bool {
        match self {
            Provider::Openai | Provider::Anthropic => true,
            Provider::Gemini => false,
            #[cfg(test)]
            Provider::Echo => false,
        }
    }

    /// The version prefixes of the paths this provider's clients call.
    pub(crate) fn path_prefixes(self) -> &'static [&'static str] {
        match self {
            Provider::Openai | Provider::Anthropic => &["/v1"],
            Provider::Gemini => &gemini::VERSIONS,
            #[cfg(test)]
            Provider::Echo => &["/echo"],
        }
    }

    /// The client header that carries credentials for this provider's API; never forwarded
    /// upstream (the backend's own key is sent instead).
    pub(crate) fn credential_header(self) -> &'static str {
        match self {
            Provider::Openai => openai::KEY_HEADER,
            Provider::Anthropic => anthropic::KEY_HEADER,
            Provider::Gemini => gemini::KEY_HEADER,
            #[cfg(test)]
            Provider::Echo => echo::KEY_HEADER,
        }
    }

    /// The upstream path and query of one page of a backend's model list, the page after the
    /// model id `after` (from [`Provider::next_models_page`]).
    pub(crate) fn models_page_path(self, after: Option<&str>) -> String {
        match self {
            Provider::Openai => openai::MODELS_PATH.to_string(),
            Provider::Anthropic => anthropic::models_page_path(after),
            Provider::Gemini => gemini::models_page_path(after),
            #[cfg(test)]
            Provider::Echo => "/models".to_string(),
        }
    }

    /// The upstream path of one model's entry, `segment` being its id as an encoded path
    /// segment (GM-4's lookup of a model the merged list lacks, decision 76). Gemini's is read
    /// from the version its list is read from.
    pub(crate) fn model_path(self, segment: &str) -> String {
        match self {
            Provider::Openai => format!("{}/{segment}", openai::MODELS_PATH),
            Provider::Anthropic => format!("/models/{segment}"),
            Provider::Gemini => gemini::model_path(segment),
            #[cfg(test)]
            Provider::Echo => format!("/models/{segment}"),
        }
    }

    /// Where a fetched page of the model list says the next one starts, when there is one.
    pub(crate) fn next_models_page(self, page: &Value) -> Option<String> {
        match self {
            Provider::Openai => None,
            Provider::Anthropic => anthropic::next_models_page(page),
            Provider::Gemini => gemini::next_models_page(page),
            #[cfg(test)]
            Provider::Echo => None,
        }
    }

    /// The models of a fetched page of a backend's model list.
    pub(crate) fn models_of_page(self, page: &Value) -> Option<&Vec<Value>> {
        match self {
            Provider::Openai | Provider::Anthropic => page["data"].as_array(),
            #[cfg(test)]
            Provider::Echo => page["data"].as_array(),
            Provider::Gemini => gemini::models_of_page(page),
        }
    }

    /// A model-list entry's id: the model name a request sends.
    pub(crate) fn model_id(self, model: &Value) -> Option<&str> {
        match self {
            Provider::Openai | Provider::Anthropic => model["id"].as_str(),
            #[cfg(test)]
            Provider::Echo => model["id"].as_str(),
            Provider::Gemini => gemini::model_id(model),
        }
    }

    /// The model-list entry for a model name holdfast serves by rewriting it (an alias).
    pub(crate) fn model_entry(self, id: &str) -> Value {
        match self {
            Provider::Openai => openai::model_entry(id),
            Provider::Anthropic => anthropic::model_entry(id),
            Provider::Gemini => gemini::model_entry(id),
            #[cfg(test)]
            Provider::Echo => echo::model_entry(id),
        }
    }

    /// The answer to a model-list call: `models` in this provider's list shape, paged as the
    /// call's `query` asks when the provider pages.
    ///
    /// # Errors
    /// The code and message of a 400 when the provider refuses the page asked for (Gemini's
    /// `pageToken` that holdfast did not issue, or a `pageSize` that is not a number, GM-4).
    pub(crate) fn models_answer(
        self,
        models: Vec<Value>,
        query: &HashMap<String, String>,
    ) -> Result<Value, (&'static str, String)> {
        match self {
            Provider::Openai => Ok(openai::models_answer(models)),
            Provider::Anthropic => Ok(anthropic::models_page(models, query)),
            Provider::Gemini => gemini::models_page(models, query),
            #[cfg(test)]
            Provider::Echo => Ok(echo::models_answer(models)),
        }
    }

    /// The provider's request-id response header (RS-5), when it has one: Google's API
    /// documents none (decision 57).
    pub(crate) fn request_id_header(self) -> Option<&'static str> {
        match self {
            Provider::Openai => Some(openai::REQUEST_ID_HEADER),
            Provider::Anthropic => Some(anthropic::REQUEST_ID_HEADER),
            Provider::Gemini => None,
            #[cfg(test)]
            Provider::Echo => Some(echo::REQUEST_ID_HEADER),
        }
    }

    /// RS-5a: the provider's rate-limit and timing headers of an answer, passed on to the
    /// clients it is delivered to live; `None` when it sent none (nothing allocated). Never the
    /// operator's account headers, nor any other (decision 167).
    pub(crate) fn passed_on_headers(self, headers: &HeaderMap) -> Option<PassedHeaders> {
        let passed: Vec<(HeaderName, HeaderValue)> = headers
            .iter()
            .filter(|(name, _)| self.passes_on(name.as_str()))
            .map(|(name, value)| (name.clone(), value.clone()))
            .collect();
        (!passed.is_empty()).then(|| passed.into())
    }

    /// Whether RS-5a passes on a response header of this name (lower case, as parsed).
    fn passes_on(self, name: &str) -> bool {
        match self {
            Provider::Openai => {
                name.starts_with("x-ratelimit-")
                    || name == "openai-processing-ms"
                    || name == "openai-version"
            }
            Provider::Anthropic => name.starts_with("anthropic-ratelimit-"),
            Provider::Gemini => false,
            #[cfg(test)]
            Provider::Echo => name.starts_with("x-ratelimit-"),
        }
    }

    /// The delay a provider's error body asks for before a retry, for a provider that says it
    /// there rather than in `retry-after` (LC-5): Google's `google.rpc.RetryInfo` detail
    /// (decision 88).
    pub(crate) fn retry_delay_of_body(self, body: &[u8]) -> Option<Duration> {
        match self {
            Provider::Gemini => gemini::retry_delay_of_body(body),
            Provider::Openai | Provider::Anthropic => None,
            #[cfg(test)]
            Provider::Echo => None,
        }
    }

    /// An error body in this provider's shape (RS-6), carrying holdfast's stable cause `code`.
    pub(crate) fn error_body(self, status: StatusCode, code: &str, message: &str) -> Value {
        match self {
            Provider::Openai => openai::error_body(status, code, message),
            Provider::Anthropic => anthropic::error_body(status, message),
            Provider::Gemini => gemini::error_body(status, code, message),
            #[cfg(test)]
            Provider::Echo => echo::error_body(code, message),
        }
    }

    /// An error event in this provider's stream shape, which its SDKs raise on (RS-4, LC-7):
    /// the `event:` name, if any, and the data.
    pub(crate) fn error_event(self, code: &str, message: &str) -> (Option<&'static str>, String) {
        match self {
            Provider::Openai => openai::error_event(code, message),
            Provider::Anthropic => anthropic::error_event(message),
            Provider::Gemini => gemini::error_event(code, message),
            #[cfg(test)]
            Provider::Echo => echo::error_event(code, message),
        }
    }

    /// What fills a silence in a proxied stream of this provider's shape instead of an SSE
    /// comment, when its SDKs need something else (RS-4): for Google's routes a blank line,
    /// since google-genai for Python reads every line that does not start with `data: ` as
    /// JSON and raises on a comment. A blank line between events is no event to any SSE reader.
    pub(crate) fn stream_keepalive(self) -> Option<&'static [u8]> {
        match self {
            Provider::Openai | Provider::Anthropic => None,
            Provider::Gemini => Some(gemini::STREAM_KEEPALIVE),
            #[cfg(test)]
            Provider::Echo => None,
        }
    }

    /// Whether a stream event reports an error (LC-7). `event` is its `event:` name, `kind`
    /// the `type` member of its data, `error` whether its data has a non-null `error` member.
    pub(crate) fn is_error_event(
        self,
        event: Option<&str>,
        kind: Option<&str>,
        error: bool,
    ) -> bool {
        match self {
            Provider::Openai => openai::is_error_event(event, kind, error),
            Provider::Anthropic => anthropic::is_error_event(event, kind, error),
            Provider::Gemini => gemini::is_error_event(error),
            #[cfg(test)]
            Provider::Echo => echo::is_error_event(event, error),
        }
    }
}

/// The JSON type of an answer's result member ([`Route::result_members`]): what every answer
/// of the route has there, and what its SDKs read it as (LC-11).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Json {
    Array,
    Object,
    String,
}

impl Json {
    /// The type of a JSON value, by the first byte of its text (which starts at the value).
    pub(crate) fn of(value: &str) -> Option<Json> {
        match value.as_bytes().first() {
            Some(b'[') => Some(Json::Array),
            Some(b'{') => Some(Json::Object),
            Some(b'"') => Some(Json::String),
            _ => None,
        }
    }

    /// How messages name it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Json::Array => "array",
            Json::Object => "object",
            Json::String => "string",
        }
    }
}

/// The parts of a stream event the provider rules read, borrowed from its data (parsed once by
/// the worker).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct EventParts<'a> {
    /// The event's type: its `event:` name, else its data's `type` member.
    pub kind: Option<&'a str>,
    /// The data's `response` member, its JSON text (Responses lifecycle events).
    pub response: Option<&'a str>,
    /// The data's `message` member, its JSON text (Anthropic's `message_start`).
    pub message: Option<&'a str>,
    /// The data's `usage` member, its JSON text (a chat usage chunk, Anthropic's `message_delta`).
    pub usage: Option<&'a str>,
    /// The data's `candidates` member, its JSON text (a Gemini chunk).
    pub candidates: Option<&'a str>,
    /// The data's `promptFeedback` member, its JSON text (a Gemini chunk).
    pub prompt_feedback: Option<&'a str>,
    /// The data's `usageMetadata` member, its JSON text (a Gemini chunk).
    pub usage_metadata: Option<&'a str>,
}

/// The parts of a non-stream answer the provider rules read, borrowed from its body.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct BodyParts<'a> {
    /// The top-level `id`.
    pub id: Option<&'a str>,
    /// The top-level `object`.
    pub object: Option<&'a str>,
    /// The top-level `usage`, its JSON text.
    pub usage: Option<&'a str>,
    /// The top-level `usageMetadata`, its JSON text (Gemini).
    pub usage_metadata: Option<&'a str>,
}

/// Tokens a provider reported for one attempt, normalised across providers (docs/usage.md).
/// `None`: the provider did not say; nothing is guessed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Usage {
    /// Every input token processed, cached ones included.
    pub input_tokens: Option<u64>,
    /// Every output token, reasoning ones included.
    pub output_tokens: Option<u64>,
    /// Input tokens read from the provider's prompt cache (part of `input_tokens`).
    pub cached_input_tokens: Option<u64>,
    /// Input tokens written to the provider's prompt cache (part of `input_tokens`).
    pub cache_write_tokens: Option<u64>,
    /// Output tokens spent on reasoning (part of `output_tokens`).
    pub reasoning_tokens: Option<u64>,
    /// Input tokens written to a one-hour prompt cache (part of `cache_write_tokens`; Anthropic's
    /// `cache_creation.ephemeral_1h_input_tokens`), billed at their own rate (RD-10).
    pub cache_write_1h_tokens: Option<u64>,
}

/// Most tokens of one kind an answer is taken to report: 2^32, hundreds of times any model's
/// context. A count above it comes from a broken or hostile provider and is kept as not
/// reported (RD-9, decision 81): the ledger's sums in the database are 64-bit integers, which
/// two counts near 2^63 overflowed, failing `GET /usage` for good.
pub const MAX_REPORTED_TOKENS: u64 = 1 << 32;

/// One count of a provider's usage object, read on its own (RD-9): a value that is not a count
/// costs only itself and the sums it is part of, never the counts beside it. A usage object
/// is read member by member, so that one member a compatible server fills oddly (`"12"`,
/// `12.5`, `-1`) does not lose the whole answer's tokens (decision 109). A struct of them
/// takes `#[serde(default)]`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) enum Count {
    /// Absent, or `null`: not reported.
    #[default]
    Absent,
    /// Reported, but not as a non-negative integer.
    Unreadable,
    /// The count.
    Is(u64),
}

impl Count {
    /// The count, when it was reported and readable.
    pub(super) fn get(self) -> Option<u64> {
        match self {
            Count::Is(n) => Some(n),
            Count::Absent | Count::Unreadable => None,
        }
    }

    /// The count as a part of a sum: absent adds nothing, unreadable makes the sum unknown.
    pub(super) fn part(self) -> Option<u64> {
        match self {
            Count::Absent => Some(0),
            Count::Unreadable => None,
            Count::Is(n) => Some(n),
        }
    }

    /// `self + other`, reported when either is and neither is unreadable.
    pub(super) fn plus(self, other: Count) -> Option<u64> {
        if (self, other) == (Count::Absent, Count::Absent) {
            return None;
        }
        Some(self.part()?.saturating_add(other.part()?))
    }
}

impl<'de> Deserialize<'de> for Count {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Count, D::Error> {
        Ok(match Option::<&'de RawValue>::deserialize(deserializer)? {
            None => Count::Absent,
            Some(raw) => serde_json::from_str(raw.get()).map_or(Count::Unreadable, Count::Is),
        })
    }
}

/// Reads a member of a provider's usage object that holds more counts (`cache_creation`,
/// `prompt_tokens_details`), for `#[serde(default, deserialize_with = "readable")]`: a value
/// that is not a `T` is absent, and the members beside it are still read (RD-9, decision 109).
pub(super) fn readable<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: serde::de::DeserializeOwned,
{
    let raw = Option::<&'de RawValue>::deserialize(deserializer)?;
    Ok(raw.and_then(|raw| serde_json::from_str(raw.get()).ok()))
}

impl Usage {
    /// `self` without the counts above [`MAX_REPORTED_TOKENS`] (RD-9).
    pub fn plausible(self) -> Usage {
        let keep = |n: Option<u64>| n.filter(|n| *n <= MAX_REPORTED_TOKENS);
        Usage {
            input_tokens: keep(self.input_tokens),
            output_tokens: keep(self.output_tokens),
            cached_input_tokens: keep(self.cached_input_tokens),
            cache_write_tokens: keep(self.cache_write_tokens),
            reasoning_tokens: keep(self.reasoning_tokens),
            cache_write_1h_tokens: keep(self.cache_write_1h_tokens),
        }
    }

    /// Whether the provider reported nothing.
    pub fn is_empty(&self) -> bool {
        *self == Usage::default()
    }

    /// `later` over `self`, field by field: what a later event reports replaces what an earlier
    /// one did (Anthropic's `message_delta` after `message_start`).
    pub fn update(&mut self, later: Usage) {
        let pick = |now: &mut Option<u64>, new: Option<u64>| {
            if new.is_some() {
                *now = new;
            }
        };
        pick(&mut self.input_tokens, later.input_tokens);
        pick(&mut self.output_tokens, later.output_tokens);
        pick(&mut self.cached_input_tokens, later.cached_input_tokens);
        pick(&mut self.cache_write_tokens, later.cache_write_tokens);
        pick(&mut self.reasoning_tokens, later.reasoning_tokens);
        pick(&mut self.cache_write_1h_tokens, later.cache_write_1h_tokens);
    }

    /// The field-by-field sum of `self` and `other` (`None` only where both are).
    pub fn plus(self, other: Usage) -> Usage {
        let add = |a: Option<u64>, b: Option<u64>| match (a, b) {
            (None, None) => None,
            (a, b) => Some(a.unwrap_or(0).saturating_add(b.unwrap_or(0))),
        };
        Usage {
            input_tokens: add(self.input_tokens, other.input_tokens),
            output_tokens: add(self.output_tokens, other.output_tokens),
            cached_input_tokens: add(self.cached_input_tokens, other.cached_input_tokens),
            cache_write_tokens: add(self.cache_write_tokens, other.cache_write_tokens),
            reasoning_tokens: add(self.reasoning_tokens, other.reasoning_tokens),
            cache_write_1h_tokens: add(self.cache_write_1h_tokens, other.cache_write_1h_tokens),
        }
    }

    /// Each field times `n`.
    pub fn times(self, n: u64) -> Usage {
        let mul = |a: Option<u64>| a.map(|a| a.saturating_mul(n));
        Usage {
            input_tokens: mul(self.input_tokens),
            output_tokens: mul(self.output_tokens),
            cached_input_tokens: mul(self.cached_input_tokens),
            cache_write_tokens: mul(self.cache_write_tokens),
            reasoning_tokens: mul(self.reasoning_tokens),
            cache_write_1h_tokens: mul(self.cache_write_1h_tokens),
        }
    }
}

impl Route {
    /// Every route, in documentation order.
    #[cfg(not(test))]
    pub const ALL: [Route; 9] = [
        Route::OpenaiChat,
        Route::OpenaiCompletions,
        Route::OpenaiEmbeddings,
        Route::OpenaiResponses,
        Route::AnthropicMessages,
        Route::GeminiGenerate,
        Route::GeminiStream,
        Route::GeminiV1Generate,
        Route::GeminiV1Stream,
    ];
    /// Every route, the test-only provider's included.
    #[cfg(test)]
    pub const ALL: [Route; 10] = [
        Route::OpenaiChat,
        Route::OpenaiCompletions,
        Route::OpenaiEmbeddings,
        Route::OpenaiResponses,
        Route::AnthropicMessages,
        Route::GeminiGenerate,
        Route::GeminiStream,
        Route::GeminiV1Generate,
        Route::GeminiV1Stream,
        Route::EchoSay,
    ];

    /// The stored name, e.g. `openai.chat`.
    pub fn name(self) -> &'static str {
        match self {
            Route::OpenaiChat => "openai.chat",
            Route::OpenaiCompletions => "openai.completions",
            Route::OpenaiEmbeddings => "openai.embeddings",
            Route::OpenaiResponses => "openai.responses",
            Route::AnthropicMessages => "anthropic.messages",
            Route::GeminiGenerate => "gemini.v1beta.generate",
            Route::GeminiStream => "gemini.v1beta.stream",
            Route::GeminiV1Generate => "gemini.v1.generate",
            Route::GeminiV1Stream => "gemini.v1.stream",
            #[cfg(test)]
            Route::EchoSay => "echo.say",
        }
    }

    /// Parses a stored name; `None` for a name this version does not know.
    pub fn from_name(name: &str) -> Option<Route> {
        Route::ALL.into_iter().find(|r| r.name() == name)
    }

    /// The provider kind that serves this route.
    pub fn provider(self) -> Provider {
        match self {
            Route::OpenaiChat
            | Route::OpenaiCompletions
            | Route::OpenaiEmbeddings
            | Route::OpenaiResponses => Provider::Openai,
            Route::AnthropicMessages => Provider::Anthropic,
            Route::GeminiGenerate
            | Route::GeminiStream
            | Route::GeminiV1Generate
            | Route::GeminiV1Stream => Provider::Gemini,
            #[cfg(test)]
            Route::EchoSay => Provider::Echo,
        }
    }

    /// The path clients call on holdfast; `{model}` stands for the model of a route that
    /// takes it in the path (GM-1).
    pub fn client_path(self) -> &'static str {
        match self {
            Route::OpenaiChat => "/v1/chat/completions",
            Route::OpenaiCompletions => "/v1/completions",
            Route::OpenaiEmbeddings => "/v1/embeddings",
            Route::OpenaiResponses => "/v1/responses",
            Route::AnthropicMessages => "/v1/messages",
            Route::GeminiGenerate
            | Route::GeminiStream
            | Route::GeminiV1Generate
            | Route::GeminiV1Stream => gemini::client_path(self),
            #[cfg(test)]
            Route::EchoSay => echo::SAY_PATH,
        }
    }

    /// The path the router matches this route under, in its `{param}` syntax: the client path,
    /// or for a model in the path `/v1beta/models/{call}`, `{call}` being `{model}:{method}`,
    /// which several routes share (the router cannot match a literal after a parameter).
    pub fn router_path(self) -> &'static str {
        match self.provider() {
            Provider::Openai | Provider::Anthropic => self.client_path(),
            Provider::Gemini => gemini::router_path(self),
            #[cfg(test)]
            Provider::Echo => self.client_path(),
        }
    }

    /// Whether the model is in the path rather than the body (GM-1): it is then part of the
    /// request hash, and model rewrites apply to it.
    pub fn model_in_path(self) -> bool {
        match self.provider() {
            Provider::Openai | Provider::Anthropic => false,
            Provider::Gemini => true,
            #[cfg(test)]
            Provider::Echo => false,
        }
    }

    /// The route of a call to a shared router path ([`Route::router_path`]) whose `{call}`
    /// segment names `method` (`generateContent`, `streamGenerateContent`).
    pub fn of_method(router_path: &str, method: &str) -> Option<Route> {
        Route::ALL.into_iter().find(|r| {
            r.router_path() == router_path
                && r.client_path()
                    .rsplit_once(':')
                    .is_some_and(|(_, m)| m == method)
        })
    }

    /// Whether `model` can be the model segment of this route's path (GM-1).
    pub fn is_path_model(model: &str) -> bool {
        gemini::is_path_model(model)
    }

    /// Whether a request of this route streams: the body's top-level `"stream": true`
    /// (`body_stream`), or for Gemini the path (GM-1).
    pub fn streams(self, body_stream: bool) -> bool {
        match self.provider() {
            Provider::Openai | Provider::Anthropic => body_stream,
            Provider::Gemini => gemini::streams(self),
            #[cfg(test)]
            Provider::Echo => body_stream,
        }
    }

    /// The path (and query) appended to a backend's `base_url`: the client path without `/v1`
    /// (the `base_url` has it), or for Gemini the client path with `model` in it (GM-1,
    /// decision 57).
    pub(crate) fn upstream_path(self, model: Option<&str>) -> String {
        match self.provider() {
            Provider::Openai | Provider::Anthropic => self.client_path()["/v1".len()..].to_string(),
            Provider::Gemini => gemini::upstream_path(self, model.unwrap_or_default()),
            #[cfg(test)]
            Provider::Echo => "/say".to_string(),
        }
    }

    /// Whether a provider stream event completes this route's stream (LC-7). `data` is the
    /// event's data; `kind` its type: the `event:` name, else the `type` member of its data.
    pub(crate) fn ends_stream(self, data: &str, kind: Option<&str>) -> bool {
        match self.provider() {
            Provider::Openai => openai::ends_stream(self, data, kind),
            Provider::Anthropic => anthropic::ends_stream(kind),
            Provider::Gemini => false,
            #[cfg(test)]
            Provider::Echo => echo::ends_stream(kind),
        }
    }

    /// What a stream event tells of the answer: whether it finishes it, shows part of it, and
    /// which candidates it finishes and leaves open. Gemini's streams have no final event, so
    /// the answer is complete when the body ends cleanly after an event that finishes it and
    /// leaves no candidate open; after a visible part only a finishing event ends it, a usage
    /// report no longer does (GM-3, decisions 119 and 142). The other providers' streams end
    /// at their final event ([`Route::ends_stream`]) whatever came before it: nothing marked.
    pub(crate) fn answer_marks(self, event: &EventParts<'_>) -> gemini::AnswerMarks {
        match self.provider() {
            Provider::Gemini => gemini::answer_marks(event),
            _ => gemini::AnswerMarks::default(),
        }
    }

    /// Whether a stream event reports the answer's usage and nothing else, which Gemini sends
    /// last: the stream is then complete if the body ends cleanly right after it (GM-3). The
    /// other providers' usage comes before their final event.
    pub(crate) fn is_usage_report(self, event: &EventParts<'_>) -> bool {
        match self.provider() {
            Provider::Openai | Provider::Anthropic => false,
            Provider::Gemini => gemini::is_usage_report(event),
            #[cfg(test)]
            Provider::Echo => false,
        }
    }

    /// The event that completes this route's stream, as messages name it.
    pub(crate) fn stream_end_name(self) -> &'static str {
        match self.provider() {
            Provider::Openai => openai::stream_end_name(self),
            Provider::Anthropic => anthropic::STREAM_END,
            Provider::Gemini => gemini::STREAM_END,
            #[cfg(test)]
            Provider::Echo => echo::STREAM_END,
        }
    }

    /// The event this route's stream opens with, when it has one: before it only keep-alive
    /// events ([`Route::is_keepalive_event`]) and errors may come, and it comes once. An
    /// answer that breaks that is not this route's: the SDKs' stream helpers raise on it
    /// (decision 44). Chat and completions have no opening event; the Responses API has
    /// `response.created`, not checked: providers in background mode open with
    /// `response.queued`.
    pub(crate) fn stream_start_name(self) -> Option<&'static str> {
        match self.provider() {
            Provider::Openai | Provider::Gemini => None,
            Provider::Anthropic => Some(anthropic::STREAM_START),
            #[cfg(test)]
            Provider::Echo => None,
        }
    }

    /// The event that says how this route's streamed answer ended, when it has one: it comes
    /// before the final event, and a stream whose final event comes without it is not the
    /// complete answer it claims to be (Anthropic's `message_delta`, with the stop reason and
    /// the final usage; decision 108).
    pub(crate) fn stream_result_name(self) -> Option<&'static str> {
        match self.provider() {
            Provider::Openai | Provider::Gemini => None,
            Provider::Anthropic => Some(anthropic::STREAM_RESULT),
            #[cfg(test)]
            Provider::Echo => None,
        }
    }

    /// Whether a stream event of type `kind` only keeps the stream open (Anthropic's `ping`).
    pub(crate) fn is_keepalive_event(self, kind: Option<&str>) -> bool {
        match self.provider() {
            Provider::Openai | Provider::Gemini => false,
            Provider::Anthropic => anthropic::is_keepalive_event(kind),
            #[cfg(test)]
            Provider::Echo => false,
        }
    }

    /// Top-level members one of which every data event of this route's stream carries, other
    /// than its final `[DONE]` and error events: `choices` for chat and completions chunks
    /// (empty in a usage chunk, decision 42), `candidates`, `promptFeedback` or
    /// `usageMetadata` for Gemini's (GM-3). An event with none is not this route's. Empty:
    /// events are told by their type instead.
    pub(crate) fn stream_event_members(self) -> &'static [&'static str] {
        match self.provider() {
            Provider::Openai if openai::stream_events_carry_choices(self) => &["choices"],
            Provider::Openai | Provider::Anthropic => &[],
            Provider::Gemini => gemini::STREAM_EVENT_MEMBERS,
            #[cfg(test)]
            Provider::Echo => &[],
        }
    }

    /// Whether this route's answers carry a provider id that the provider's own API retrieves
    /// them by (the Responses API's `resp_...`), which holdfast records to serve that retrieval
    /// from the log.
    pub(crate) fn keeps_answer_ids(self) -> bool {
        match self.provider() {
            Provider::Openai => openai::keeps_answer_ids(self),
            Provider::Anthropic | Provider::Gemini => false,
            #[cfg(test)]
            Provider::Echo => false,
        }
    }

    /// The provider's id of the answer a stream event announces, if it announces one.
    pub(crate) fn answer_id_of_event(self, event: &EventParts<'_>) -> Option<String> {
        match self.provider() {
            Provider::Openai => openai::answer_id_of_event(self, event),
            Provider::Anthropic | Provider::Gemini => None,
            #[cfg(test)]
            Provider::Echo => None,
        }
    }

    /// The provider's id of a non-stream answer, if it has one.
    pub(crate) fn answer_id_of_body(self, body: &BodyParts<'_>) -> Option<String> {
        match self.provider() {
            Provider::Openai => openai::answer_id_of_body(self, body),
            Provider::Anthropic | Provider::Gemini => None,
            #[cfg(test)]
            Provider::Echo => None,
        }
    }

    /// What a stream event reports the attempt has cost so far, if it reports usage: to be
    /// applied over what earlier events reported ([`Usage::update`]).
    pub(crate) fn usage_of_event(self, event: &EventParts<'_>) -> Option<Usage> {
        match self.provider() {
            Provider::Openai => openai::usage_of_event(self, event),
            Provider::Anthropic => anthropic::usage_of_event(event),
            Provider::Gemini => gemini::usage_of_event(event),
            #[cfg(test)]
            Provider::Echo => echo::usage_of_event(event),
        }
        .map(Usage::plausible)
    }

    /// What a non-stream answer reports it cost.
    pub(crate) fn usage_of_body(self, body: &BodyParts<'_>) -> Option<Usage> {
        match self.provider() {
            Provider::Openai => openai::usage_of(body.usage?),
            Provider::Anthropic => anthropic::usage_of(body.usage?),
            Provider::Gemini => gemini::usage_of(body.usage_metadata?),
            #[cfg(test)]
            Provider::Echo => echo::usage_of(body.usage?),
        }
        .map(Usage::plausible)
    }

    /// The top-level `stream_options` member (as `"name":value` text) a stream request of this
    /// route needs for the provider to report its usage, when it needs one (OpenAI's chat and
    /// completions streams report usage only when asked; whether a client sent the member is
    /// the canonical body's `stream_options` flag).
    pub(crate) fn stream_usage_request(self) -> Option<&'static str> {
        match self.provider() {
            Provider::Openai => openai::stream_usage_request(self),
            Provider::Anthropic | Provider::Gemini => None,
            #[cfg(test)]
            Provider::Echo => None,
        }
    }

    /// Whether a stream event of this route is the usage report a
    /// [`Route::stream_usage_request`] asks for (a chat or completions chunk with no choices),
    /// which a client that did not ask for it must not see (decision 40).
    pub(crate) fn is_requested_usage_event(self, data: &str) -> bool {
        self.stream_usage_request().is_some() && openai::is_usage_chunk(data)
    }

    /// The answer text a stream event carries (a chat delta's content, a Responses
    /// `output_text` delta, a Messages `text_delta`), for showing a streamed answer as text.
    pub(crate) fn text_of_event(self, kind: Option<&str>, data: &Value) -> Option<String> {
        match self.provider() {
            Provider::Openai => openai::text_of_event(self, kind, data),
            Provider::Anthropic => anthropic::text_of_event(data),
            Provider::Gemini => gemini::text_of_event(data),
            #[cfg(test)]
            Provider::Echo => echo::text_of_event(data),
        }
    }

    /// A stream's data events (their `data`, in order) reassembled into the answer this route
    /// gives without streaming (EX-3); `None` when they hold none.
    pub(crate) fn assemble_stream<'a>(
        self,
        events: impl IntoIterator<Item = &'a str>,
    ) -> Option<Value> {
        match self.provider() {
            Provider::Openai => dataset::openai_assemble(self, events),
            Provider::Anthropic => dataset::anthropic_assemble(events),
            Provider::Gemini => dataset::gemini_assemble(events),
            #[cfg(test)]
            Provider::Echo => None,
        }
    }

    /// The text of a non-stream answer of this route (EX-9); `None` for a route without text.
    pub(crate) fn answer_text(self, answer: &Value) -> Option<String> {
        match self.provider() {
            Provider::Openai => dataset::openai_text(self, answer),
            Provider::Anthropic => dataset::anthropic_text(answer),
            Provider::Gemini => dataset::gemini_text(answer),
            #[cfg(test)]
            Provider::Echo => answer["say"].as_str().map(str::to_owned),
        }
    }

    /// The text of a streamed answer of this route: `text`, what its events' text pieces
    /// ([`Route::text_of_event`]) make, then the tool calls of its events reassembled
    /// ([`Route::assemble_stream`]), as [`Route::answer_text`] shows them (EX-9, decision 96).
    pub(crate) fn stream_answer_text(self, text: String, assembled: &Value) -> String {
        dataset::stream_text(self, text, assembled)
    }

    /// The request `body` of this route with its final `answer` as an OpenAI chat fine-tuning
    /// example (EX-5), or why it cannot be one.
    ///
    /// # Errors
    /// The reason, for the export's `skipped`.
    pub(crate) fn openai_chat_example(self, body: &Value, answer: &Value) -> Result<Value, String> {
        dataset::example(self, body, answer)
    }

    /// Whether a non-stream answer whose result member is an empty array answered nothing
    /// (chat and completions `choices`, decision 143); elsewhere an empty one can be an answer
    /// (a Messages `content` of no blocks, a Gemini blocked prompt's no `candidates`).
    pub(crate) fn empty_result_answers_nothing(self) -> bool {
        match self.provider() {
            Provider::Openai => openai::empty_result_answers_nothing(self),
            _ => false,
        }
    }

    /// Top-level members of a non-stream answer that make it this route's result, each with
    /// the JSON type every answer has there: a 2xx JSON object with a non-null `error` and none
    /// of these is an error, not an answer, and one whose member has another type is no answer
    /// either (LC-11).
    pub(crate) fn result_members(self) -> &'static [(&'static str, Json)] {
        match self.provider() {
            Provider::Openai => openai::result_members(self),
            Provider::Anthropic => anthropic::RESULT_MEMBERS,
            Provider::Gemini => gemini::RESULT_MEMBERS,
            #[cfg(test)]
            Provider::Echo => echo::RESULT_MEMBERS,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// IN-3: the header a client's key arrives in, never forwarded, is the one the backend's key
    /// is sent in.
    #[test]
    fn each_providers_credential_header_is_the_one_its_key_is_sent_in_in3() {
        for p in Provider::ALL {
            assert_eq!(p.credential_header(), p.auth_header("k").0, "{p:?}");
        }
    }

    #[test]
    fn names_round_trip_and_upstream_paths_drop_the_version_prefix() {
        for r in Route::ALL {
            assert_eq!(Route::from_name(r.name()), Some(r));
            let upstream = r.upstream_path(Some("m"));
            assert!(upstream.starts_with('/'));
            if !r.model_in_path() {
                assert!(r.client_path().ends_with(&upstream));
            }
            assert_eq!(Provider::for_path(r.client_path()), r.provider());
        }
        assert_eq!(Route::OpenaiChat.upstream_path(None), "/chat/completions");
        assert_eq!(Route::AnthropicMessages.upstream_path(None), "/messages");
        assert_eq!(Route::from_name("nope.chat"), None);
    }

    #[test]
    fn a_routes_name_starts_with_its_providers_name_for_usage_by_provider() {
        for route in Route::ALL {
            assert_eq!(
                route.name().split('.').next(),
                Some(route.provider().name()),
                "GET /usage?group_by=provider reads the provider from the route's name"
            );
        }
    }

    #[test]
    fn gemini_paths_carry_the_model_and_the_client_version_gm1() {
        assert_eq!(
            Route::GeminiGenerate.upstream_path(Some("gemini-2.5-flash")),
            "/v1beta/models/gemini-2.5-flash:generateContent"
        );
        assert_eq!(
            Route::GeminiV1Stream.upstream_path(Some("g")),
            "/v1/models/g:streamGenerateContent?alt=sse"
        );
        let beta = Route::GeminiGenerate.router_path();
        assert_eq!(beta, "/v1beta/models/{call}");
        assert_eq!(
            Route::of_method(beta, "streamGenerateContent"),
            Some(Route::GeminiStream)
        );
        assert_eq!(
            Route::of_method("/v1/models/{call}", "generateContent"),
            Some(Route::GeminiV1Generate)
        );
        assert_eq!(Route::of_method(beta, "countTokens"), None);
        assert!(Route::GeminiStream.streams(false));
        assert!(!Route::GeminiGenerate.streams(true));
        assert!(Route::OpenaiChat.streams(true));
        // GM-1 (decision 153): a model that is not one segment of the path's form stays one
        // inert segment; no model names another path or adds a query.
        assert_eq!(
            Route::GeminiGenerate.upstream_path(Some("../../x?y=1&z")),
            "/v1beta/models/..%2F..%2Fx%3Fy%3D1%26z:generateContent"
        );
        assert_eq!(
            Route::GeminiStream.upstream_path(Some("g:streamGenerateContent")),
            "/v1beta/models/g%3AstreamGenerateContent:streamGenerateContent?alt=sse"
        );
    }

    #[test]
    fn each_provider_shapes_its_own_errors_rs6() {
        let openai = Provider::Openai.error_body(StatusCode::BAD_GATEWAY, "upstream_invalid", "m");
        assert_eq!(openai["error"]["code"], "upstream_invalid");
        assert_eq!(openai["error"]["type"], "server_error");
        let anthropic = Provider::Anthropic.error_body(StatusCode::PAYLOAD_TOO_LARGE, "x", "m");
        assert_eq!(anthropic["type"], "error");
        assert_eq!(anthropic["error"]["type"], "request_too_large");
        assert_eq!(Provider::Anthropic.error_event("c", "m").0, Some("error"));
        assert_eq!(Provider::Openai.error_event("c", "m").0, None);
    }
}
