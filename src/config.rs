//! Configuration: a TOML file plus `HOLDFAST_*` environment overrides (SPEC CLI-1, CLI-4).
//!
//! Every key has a default, so an empty file is a valid configuration apart from `backends`.
//! Nested keys are joined with `__` in the environment: `HOLDFAST_WORKERS__LEASE_SECS=10`
//! overrides `[workers] lease_secs`. The configuration is validated once, at start-up
//! ([`Config::validate`]); an invalid one stops the process with a message naming the key.

use std::net::SocketAddr;
use std::path::Path;

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use serde::{Deserialize, Serialize};

use crate::provider::{Provider, Route};

/// The whole configuration. Field names are the config keys (SPEC CLI-4).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Address the HTTP API listens on.
    pub listen: SocketAddr,
    /// `sqlite://PATH` (created when missing, relative to the working directory; SPEC CLI-4a)
    /// or `postgres://...`.
    pub database_url: String,
    /// SQLite `synchronous` setting in WAL mode: `full` (every commit is on disk before it is
    /// acknowledged) or `normal` (a commit can be lost on power failure, never on a process
    /// crash). SPEC DU-2.
    pub sqlite_synchronous: SqliteSynchronous,
    /// PostgreSQL only: the most connections this process keeps in its query pool (default
    /// 16). Each node opens four more, outside the pool: two group-commit writers, one for
    /// stream chunks and the LISTEN connection that carries cross-node wake-ups, so the
    /// database sees at most `nodes × (database_pool_size + 4)` holdfast connections (see
    /// `docs/postgres.md`). Ignored for SQLite.
    pub database_pool_size: u32,
    /// PostgreSQL only: how long a new call waits for the database to record it, and a
    /// connection for the query pool, in milliseconds (default 1500). Past it the call is
    /// refused with 503 `store_unavailable`, `x-should-retry: true` (RS-8, RS-10), so an SDK
    /// backs off instead of hanging on a database that is down, unreachable or saturated.
    /// Ignored for SQLite, whose writer is in the process.
    pub database_timeout_ms: u64,
    /// Body-hash claim window in seconds, counted from the claimed request's submission (ID-4).
    pub dedupe_window_secs: u64,
    /// Lifetime of an explicit `Idempotency-Key` claim in seconds (ID-5).
    pub idempotency_key_ttl_secs: u64,
    /// Largest accepted request body in bytes; larger bodies get 413 (IN-1).
    pub max_body_bytes: usize,
    /// Largest provider response body (non-stream) in bytes; larger ones fail the attempt as
    /// `upstream_invalid`.
    pub max_response_bytes: usize,
    /// How long terminal requests and their chunks are kept, in seconds (DU-4).
    pub retention_secs: u64,
    /// Interval of SSE keep-alives on idle streams (comments; blank lines on Google's routes),
    /// in milliseconds (RD-2, RS-4).
    pub sse_keepalive_ms: u64,
    /// Origins allowed to call holdfast from a browser (CORS), e.g. `["https://app.example"]`,
    /// or `["*"]` for any. Empty (the default): no CORS headers, so only same-origin pages and
    /// non-browser clients can read the API.
    pub cors_allow_origins: Vec<String>,
    /// Proxied calls one node holds open at once; beyond it new calls are refused with 503,
    /// `x-should-retry: true` and `retry-after-ms` before anything is recorded (RS-8).
    pub max_held_requests: usize,
    /// Proxied calls one node holds open at once for any one namespace, unless the namespace
    /// sets its own `max_held_requests` (RS-13). Default none: only `max_held_requests` bounds
    /// a namespace.
    pub max_held_requests_per_namespace: Option<usize>,
    /// On SIGTERM/SIGINT, how long in-flight attempts may run on before they are handed back
    /// to `pending`, in milliseconds (DU-5).
    pub shutdown_grace_ms: u64,
    /// Log line format on stderr: `text` (default) or `json` (one JSON object per line).
    pub log_format: LogFormat,
    /// Worker pool settings (LC-2..LC-5).
    pub workers: Workers,
    /// Timeouts towards providers (LC-10).
    pub upstream: Upstream,
    /// Provider endpoints, tried in order when no rewrite rule matches (CLI-5).
    pub backends: Vec<Backend>,
    /// Model routing rules, first match wins (CLI-5, ID-3).
    pub model_rewrites: Vec<ModelRewrite>,
    /// Tenants. Empty: every caller is namespace `default` (CLI-5).
    pub namespaces: Vec<Namespace>,
    /// Further provider paths forwarded as they are, not logged (off by default): e.g. an
    /// OpenAI-compatible server's `/v1/moderations`. The backend's key is sent, the client's
    /// never.
    pub passthrough: Vec<Passthrough>,
    /// Prices per backend and model, USD per million tokens, for the cost and saved cost of
    /// the usage ledger (docs/usage.md). Empty (the default): no cost is computed.
    pub prices: Vec<Price>,
    /// Add `stream_options.include_usage: true` to chat and completions stream requests that
    /// do not set `stream_options`, after the request is hashed, so their usage is recorded.
    /// The client then also receives the provider's usage chunk. Default false.
    pub inject_stream_usage: bool,
    /// Keys whose holders may read `GET /usage` and `GET /requests` across namespaces
    /// (`?namespace=` narrows). They are not namespace keys: proxied calls refuse them.
    pub admin_api_keys: Vec<String>,
    /// Serve the web page at `GET /ui` (docs/ui.md). Default false: `/ui` and its assets
    /// answer 404 like any unknown path. `serve --demo` turns it on.
    pub ui: bool,
    /// `[otel]`: OpenTelemetry traces (OT-1..OT-6), off by default.
    pub otel: Otel,
    /// Signed webhooks when a request finishes (CB-1..CB-7).
    pub callbacks: Callbacks,
}

/// `[callbacks]`: the defaults of every namespace's callbacks and how they are delivered
/// (CB-1..CB-5). A namespace's own `callback_url`, `callback_secrets` and
/// `callback_include_body` win over `url`, `secrets` and `include_body`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Callbacks {
    /// Callback URL of requests that send no `Holdfast-Callback-Url` (CB-1). Default none.
    pub url: Option<String>,
    /// Signing secrets, `whsec_<base64 key>`; each signs every webhook, so a receiver that
    /// knows any of them verifies it (rotation). Callbacks are refused without one (CB-2).
    pub secrets: Vec<String>,
    /// Whether the webhook's record includes the request and its answer (CB-3).
    pub include_body: bool,
    /// Networks (`10.0.0.0/8`, `127.0.0.1/32`) or addresses callbacks may reach although they
    /// are in a refused range (CB-2, CB-5).
    pub allow: Vec<String>,
    /// A try's whole time: connect, send, answer (CB-4), in milliseconds.
    pub timeout_ms: u64,
    /// A try's TCP + TLS connect time, in milliseconds (CB-5).
    pub connect_timeout_ms: u64,
    /// Delay after the first failed try, doubling per try (CB-4), in milliseconds.
    pub backoff_initial_ms: u64,
    /// Longest delay between tries, in milliseconds.
    pub backoff_max_ms: u64,
    /// How long after its request finished a delivery is tried, in seconds (CB-4).
    pub give_up_after_secs: u64,
    /// How often this node looks for due deliveries, in milliseconds.
    pub poll_interval_ms: u64,
    /// Tries in flight at once on this node.
    pub concurrency: usize,
    /// One namespace's share of `concurrency` (CB-7): a lease gives each configured namespace
    /// up to this many tries in flight on this node first; what is left goes to the oldest due
    /// of any namespace, but for this many slots kept free for the next namespace when more
    /// than one is configured. Taken as `concurrency` when larger.
    pub concurrency_per_namespace: usize,
}

impl Default for Callbacks {
    fn default() -> Self {
        Callbacks {
            url: None,
            secrets: Vec::new(),
            include_body: false,
            allow: Vec::new(),
            timeout_ms: 10_000,
            connect_timeout_ms: 3_000,
            backoff_initial_ms: 5_000,
            backoff_max_ms: 3_600_000,
            give_up_after_secs: 86_400,
            poll_interval_ms: 1_000,
            concurrency: 64,
            concurrency_per_namespace: 8,
        }
    }
}

/// The key of a Standard Webhooks secret `whsec_<base64>` (CB-3); `None` when it is not one.
pub fn webhook_key(secret: &str) -> Option<Vec<u8>> {
    use base64::Engine;
    use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
    const LENIENT: GeneralPurpose = GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
    );
    let key = LENIENT.decode(secret.strip_prefix("whsec_")?).ok()?;
    (!key.is_empty()).then_some(key)
}

/// The callback settings of one namespace: its own where it has them, else `[callbacks]`'s.
#[derive(Debug, Clone, Copy)]
pub(crate) struct NamespaceCallbacks<'a> {
    /// The default URL.
    pub url: Option<&'a str>,
    /// The signing secrets.
    pub secrets: &'a [String],
    /// Whether bodies go with the record.
    pub include_body: bool,
}

/// One `[[prices]]` entry: USD per million tokens for a backend's models.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Price {
    /// Backend name.
    pub backend: String,
    /// Exact model name, or a prefix ending in `*`. The first matching entry wins.
    pub model: String,
    /// Input tokens that were not read from the cache.
    pub input_per_mtok: f64,
    /// Output tokens (reasoning tokens included).
    pub output_per_mtok: f64,
    /// Input tokens read from the prompt cache; `input_per_mtok` when absent.
    #[serde(default)]
    pub cached_input_per_mtok: Option<f64>,
    /// Input tokens written to the prompt cache (for Anthropic, to a five-minute cache);
    /// `input_per_mtok` when absent.
    #[serde(default)]
    pub cache_write_per_mtok: Option<f64>,
    /// Input tokens written to a one-hour prompt cache (Anthropic's `ttl: "1h"`, RD-10);
    /// `cache_write_per_mtok` when absent, then `input_per_mtok` (decision 103).
    #[serde(default)]
    pub cache_write_1h_per_mtok: Option<f64>,
}

impl Price {
    /// Whether this entry prices `model` on `backend`.
    pub(crate) fn matches(&self, backend: &str, model: &str) -> bool {
        self.backend == backend
            && match self.model.strip_suffix('*') {
                Some(prefix) => model.starts_with(prefix),
                None => model == self.model,
            }
    }
}

/// One `[[passthrough]]` entry.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Passthrough {
    /// The client path, starting with the version prefix (`/v1/moderations`), or a prefix ending
    /// in `/*` (`/v1/files/*` forwards `/v1/files` and everything under it). Every method.
    pub path: String,
    /// Backend name the calls go to; the path without its first segment (`/v1`) is appended to
    /// its `base_url`.
    pub backend: String,
}

impl Passthrough {
    /// The path without its `/*` suffix, and whether it is a prefix.
    pub(crate) fn base(&self) -> (&str, bool) {
        match self.path.strip_suffix("/*") {
            Some(base) => (base, true),
            None => (&self.path, false),
        }
    }
}

/// SQLite durability mode (SPEC DU-2).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum SqliteSynchronous {
    /// `PRAGMA synchronous = FULL`.
    Full,
    /// `PRAGMA synchronous = NORMAL`.
    Normal,
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines, coloured only on a terminal.
    Text,
    /// One JSON object per line, for log shippers.
    Json,
}

/// `[workers]`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Workers {
    /// Attempts run at once by this process.
    pub concurrency: usize,
    /// One namespace's share of `concurrency` (LC-2a): a lease gives each configured namespace
    /// up to this many running attempts on this node first, and a call is leased at admission
    /// on the same terms; while more than one namespace is configured, every namespace's
    /// unused share is held for it and only the rest is lent. Unset: `concurrency` divided by
    /// the number of namespaces, or by 10 when fewer, at least 1 ([`Config::worker_share`]).
    /// Taken as `concurrency` when larger.
    pub concurrency_per_namespace: Option<usize>,
    /// Lease length in seconds; renewed by heartbeat every third of it (LC-2).
    pub lease_secs: u64,
    /// Attempts before a transiently failing request fails for good (LC-5).
    pub max_attempts: u32,
    /// First retry delay in milliseconds; doubles per attempt, with jitter (LC-5).
    pub backoff_initial_ms: u64,
    /// Longest retry delay in milliseconds, also the cap on a provider's `retry-after` (LC-5).
    pub backoff_max_ms: u64,
    /// How often expired leases are swept back to `pending`, in milliseconds (LC-4).
    pub sweep_interval_ms: u64,
    /// How often an idle worker pool looks for due work it was not woken for, in milliseconds.
    pub poll_interval_ms: u64,
    /// How long a failed write of an attempt — its stream chunks, its outcome — is tried again
    /// from the first failure while the database is unavailable, in seconds (default 60; at
    /// least `lease_secs` is used). The provider's answer is held meanwhile, so a database
    /// back within it costs no second provider call (LC-3, decision 52).
    pub write_retry_secs: u64,
}

/// `[otel]`: traces exported over OTLP/HTTP (OT-1). The standard `OTEL_*` variables configure
/// what this does not (`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`,
/// `OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`,
/// `OTEL_TRACES_SAMPLER`); a key set here wins over its variable.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Otel {
    /// Export traces. Off by default: nothing is built, no span is made.
    pub enabled: bool,
    /// The OTLP/HTTP traces URL (e.g. `http://collector:4318/v1/traces`); unset: the `OTEL_*`
    /// variables', else `http://localhost:4318/v1/traces`.
    pub endpoint: Option<String>,
    /// Record prompts and answers on attempt spans (`gen_ai.input.messages`,
    /// `gen_ai.output.messages`), their texts cut to `content_max_bytes` each (OT-5). Off by default.
    pub capture_content: bool,
    /// Most bytes of one captured prompt or answer.
    pub content_max_bytes: usize,
    /// Finished spans waiting for export; past it a span is dropped and counted, never waited
    /// for (OT-1).
    pub queue_size: usize,
    /// Most spans in one export.
    pub batch_size: usize,
    /// Longest one export may take, in milliseconds, before it is given up and its spans
    /// counted as dropped.
    pub export_timeout_ms: u64,
}

/// `[upstream]`: separate timeouts, no total deadline on a healthy stream (LC-10).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Upstream {
    /// TCP + TLS connect timeout in milliseconds.
    pub connect_timeout_ms: u64,
    /// Time from sending the request to the provider's response headers, in milliseconds.
    pub header_timeout_ms: u64,
    /// Longest silence between two pieces of a response body, in milliseconds.
    pub idle_timeout_ms: u64,
}

/// One `[[backends]]` entry.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Backend {
    /// Unique name; part of the request hash (ID-3).
    pub name: String,
    /// API shape: `openai` or `anthropic`.
    pub kind: Provider,
    /// Base URL including the version prefix, e.g. `https://api.openai.com/v1` or
    /// `https://api.anthropic.com/v1`; the route's path (`/chat/completions`, `/messages`) is
    /// appended.
    pub base_url: String,
    /// Name of the environment variable holding the provider API key. The key itself never
    /// enters the configuration, the database or the logs (IN-3).
    #[serde(default)]
    pub api_key_env: Option<String>,
}

/// One `[[model_rewrites]]` entry.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelRewrite {
    /// Exact model name, or a prefix ending in `*`.
    #[serde(rename = "match")]
    pub pattern: String,
    /// Backend name that serves matching requests.
    pub backend: String,
    /// Model name sent upstream; the client's when absent.
    #[serde(default)]
    pub model: Option<String>,
}

impl ModelRewrite {
    /// Whether `model` matches this rule: exactly, or by prefix when the pattern ends in `*`.
    pub fn matches(&self, model: &str) -> bool {
        match self.pattern.strip_suffix('*') {
            Some(prefix) => model.starts_with(prefix),
            None => model == self.pattern,
        }
    }
}

/// One `[[namespaces]]` entry.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Namespace {
    /// Namespace name, stored with each request.
    pub name: String,
    /// Keys clients send as `Authorization: Bearer KEY` or `x-api-key: KEY`.
    pub api_keys: Vec<String>,
    /// This namespace's default callback URL (CB-1), instead of `[callbacks] url`.
    #[serde(default)]
    pub callback_url: Option<String>,
    /// This namespace's signing secrets (CB-3), instead of `[callbacks] secrets`.
    #[serde(default)]
    pub callback_secrets: Vec<String>,
    /// Whether its webhooks include the request and its answer, instead of `[callbacks]
    /// include_body`.
    #[serde(default)]
    pub callback_include_body: Option<bool>,
    /// Proxied calls of this namespace one node holds open at once, instead of
    /// `max_held_requests_per_namespace` (RS-13).
    #[serde(default)]
    pub max_held_requests: Option<usize>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            database_url: "sqlite://holdfast.db".into(),
            sqlite_synchronous: SqliteSynchronous::Full,
            database_pool_size: 16,
            database_timeout_ms: 1_500,
            dedupe_window_secs: 600,
            idempotency_key_ttl_secs: 86_400,
            max_body_bytes: 32 * 1024 * 1024,
            max_response_bytes: 64 * 1024 * 1024,
            retention_secs: 7 * 86_400,
            sse_keepalive_ms: 15_000,
            shutdown_grace_ms: 30_000,
            max_held_requests: 10_000,
            max_held_requests_per_namespace: None,
            cors_allow_origins: Vec::new(),
            log_format: LogFormat::Text,
            workers: Workers::default(),
            upstream: Upstream::default(),
            backends: Vec::new(),
            model_rewrites: Vec::new(),
            namespaces: Vec::new(),
            passthrough: Vec::new(),
            prices: Vec::new(),
            inject_stream_usage: false,
            admin_api_keys: Vec::new(),
            ui: false,
            otel: Otel::default(),
            callbacks: Callbacks::default(),
        }
    }
}

impl Default for Otel {
    fn default() -> Self {
        Otel {
            enabled: false,
            endpoint: None,
            capture_content: false,
            content_max_bytes: 8 * 1024,
            queue_size: 4_096,
            batch_size: 512,
            export_timeout_ms: 10_000,
        }
    }
}

impl Default for Workers {
    fn default() -> Self {
        Workers {
            concurrency: 10_000,
            concurrency_per_namespace: None,
            lease_secs: 30,
            max_attempts: 5,
            backoff_initial_ms: 500,
            backoff_max_ms: 30_000,
            sweep_interval_ms: 1_000,
            poll_interval_ms: 1_000,
            write_retry_secs: 60,
        }
    }
}

impl Default for Upstream {
    fn default() -> Self {
        Upstream {
            connect_timeout_ms: 10_000,
            header_timeout_ms: 600_000,
            idle_timeout_ms: 300_000,
        }
    }
}

/// A configuration that cannot be used. The message is one line naming the offending key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file or an environment variable could not be parsed into [`Config`].
    #[error("configuration: {}", describe(.0))]
    Parse(#[from] Box<figment::Error>),
    /// A value parsed but makes no sense.
    #[error("configuration key `{key}`: {message}")]
    Invalid {
        /// Dotted key path, e.g. `workers.lease_secs`.
        key: String,
        /// What is wrong with it, and how to fix it.
        message: String,
    },
}

fn invalid(key: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        message: message.into(),
    }
}

/// Paths holdfast serves itself besides the proxied routes, and whether it serves paths under
/// them too; a `[[passthrough]]` path may not overlap them ([`own_paths`]).
const OWN_PATHS: &[(&str, bool)] = &[
    ("/v1/models", true),
    ("/v1/messages/count_tokens", false),
    ("/v1/responses", true),
    ("/usage", false),
    ("/requests", true),
    ("/healthz", false),
    ("/readyz", false),
    ("/metrics", false),
    ("/openapi.json", false),
    ("/ui", true),
];

/// Every path holdfast serves itself, and whether it serves paths under it: the proxied routes'
/// from the route table ([`Route::router_path`]; a path with a parameter is its prefix), then
/// [`OWN_PATHS`].
fn own_paths() -> Vec<(&'static str, bool)> {
    Route::ALL
        .into_iter()
        .map(|route| {
            let path = route.router_path();
            match path.find("/{") {
                Some(at) => (&path[..at], true),
                None => (path, false),
            }
        })
        .chain(OWN_PATHS.iter().copied())
        .collect()
}

/// Environment variables starting with `HOLDFAST_` that are holdfast's own but not config
/// keys (the `holdfast requests` CLI's): `serve` ignores them silently.
const OWN_VARIABLES: &[&str] = &["HOLDFAST_URL", "HOLDFAST_API_KEY", "HOLDFAST_CONFIG"];

/// The prefix of the test harness's variables (`HOLDFAST_TEST_DATABASE_URL`,
/// `HOLDFAST_TEST_SKIP`, read by `scripts/test` and the tests): `serve` ignores them silently
/// too, so a suite run with one exported sees no warning about it. No config key starts with
/// `test`.
const TEST_HARNESS_PREFIX: &str = "HOLDFAST_TEST_";

/// One line for a figment error: the key as written (without figment's profile prefix), where
/// it came from, what is wrong, and for an unknown key the nearest known one.
fn describe(e: &figment::Error) -> String {
    use figment::error::Kind;
    let key = e.path.join(".");
    let source = e
        .metadata
        .as_ref()
        .map(|m| match &m.source {
            Some(source) => format!(" in {source}"),
            None => match env_variable(&key) {
                Some(variable) if m.name.contains("environment variable") => {
                    format!(" in {variable}")
                }
                _ => format!(" in {}", m.name),
            },
        })
        .unwrap_or_default();
    match &e.kind {
        Kind::UnknownField(found, expected) => {
            let table = match e.path.split_last() {
                Some((_, table)) if !table.is_empty() => format!("{}.", table.join(".")),
                _ => String::new(),
            };
            let at = format!("{table}{found}");
            let hint = if found == "api_key" && expected.contains(&"api_key_env") {
                // A key written into the file, the likeliest first mistake: say where keys go.
                format!(
                    "; did you mean `{table}api_key_env`, the name of the environment variable \
                     that holds the provider key (keys are never written in the file)?"
                )
            } else {
                nearest(found, expected)
                    .map(|k| format!("; did you mean `{table}{k}`?"))
                    .unwrap_or_else(|| "; docs/configuration.md lists every key".into())
            };
            format!("unknown key `{at}`{source}{hint}")
        }
        Kind::UnknownVariant(found, expected) => format!(
            "key `{key}`{source}: `{found}` is not one of {}",
            expected
                .iter()
                .map(|v| format!("`{v}`"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        Kind::MissingField(field) => {
            let at = if key.is_empty() {
                field.to_string()
            } else {
                format!("{key}.{field}")
            };
            format!("key `{at}`{source} is required")
        }
        // A file that is not TOML at all: where, and why, on one line (the parser's own
        // message draws the line with a caret below it).
        kind if key.is_empty() => {
            let text = kind.to_string();
            // The snippet's lines: `|` rules, and `N | text` with the line's number.
            let snippet = |l: &str| {
                l.starts_with('|')
                    || l.split_once(" |")
                        .is_some_and(|(n, _)| n.parse::<u32>().is_ok())
            };
            let mut lines = text
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !snippet(l));
            let first = lines.next().unwrap_or_default();
            let rest: Vec<&str> = lines.collect();
            let file = source.trim_start_matches(" in ");
            let whole = if rest.is_empty() {
                first.to_string()
            } else {
                format!("{first}: {}", rest.join("; "))
            };
            if file.is_empty() {
                whole
            } else {
                format!("{file}: {whole}")
            }
        }
        // A host name is not an address to listen on; say what is.
        kind if key == "listen" => format!(
            "key `listen`{source}: {kind}; give an IP address and port, e.g. 127.0.0.1:8080 \
             (this host only) or 0.0.0.0:8080 (every interface)"
        ),
        kind => format!("key `{key}`{source}: {kind}"),
    }
}

/// The known key closest to `found` (edit distance at most 3), for "did you mean".
fn nearest<'a>(found: &str, known: &[&'a str]) -> Option<&'a str> {
    fn distance(a: &str, b: &str) -> usize {
        let b: Vec<char> = b.chars().collect();
        let mut row: Vec<usize> = (0..=b.len()).collect();
        for (i, ca) in a.chars().enumerate() {
            let mut prev = row[0];
            row[0] = i + 1;
            for (j, cb) in b.iter().enumerate() {
                let cost = usize::from(ca != *cb);
                let next = (row[j + 1] + 1).min(row[j] + 1).min(prev + cost);
                prev = row[j + 1];
                row[j + 1] = next;
            }
        }
        row[b.len()]
    }
    known
        .iter()
        .map(|k| (distance(found, k), *k))
        .filter(|(d, _)| *d <= 3)
        .min()
        .map(|(_, k)| k)
}

/// The dotted keys `HOLDFAST_*` variables may set: every top-level key, and every key of the
/// `[workers]` and `[upstream]` tables (an array of tables only as a whole).
fn env_keys() -> Vec<String> {
    let mut keys = Vec::new();
    if let Ok(serde_json::Value::Object(top)) = serde_json::to_value(Config::default()) {
        for (key, value) in top {
            if let serde_json::Value::Object(table) = value {
                keys.extend(table.keys().map(|k| format!("{key}.{k}")));
            }
            keys.push(key);
        }
    }
    keys
}

/// The `HOLDFAST_*` variable that sets the dotted `key` (`workers.lease_secs` →
/// `HOLDFAST_WORKERS__LEASE_SECS`; a key inside an array, `backends.0.kind`, → the array's,
/// `HOLDFAST_BACKENDS`), for an error to name the variable the operator wrote.
fn env_variable(key: &str) -> Option<String> {
    env_keys()
        .into_iter()
        .filter(|k| key == k || key.starts_with(&format!("{k}.")))
        .max_by_key(String::len)
        .map(|k| format!("HOLDFAST_{}", k.replace('.', "__").to_ascii_uppercase()))
}

/// The key a `HOLDFAST_*` variable's name (without the prefix) sets: lower-case, `__` → `.`.
fn env_key(name: &str) -> String {
    name.to_ascii_lowercase().replace("__", ".")
}

impl Config {
    /// Loads defaults, then `file` (if any), then `HOLDFAST_*` environment variables, and
    /// validates the result.
    ///
    /// # Errors
    /// [`ConfigError`] naming the key that failed to parse or validate.
    pub fn load(file: Option<&Path>) -> Result<Config, ConfigError> {
        Config::load_over(Config::default(), file)
    }

    /// Like [`Config::load`], with `base` in place of the built-in defaults (`--demo` uses this
    /// to supply its mock backends while the file and environment still override).
    ///
    /// A `HOLDFAST_*` variable that names no key is not read ([`Config::unknown_env`] lists
    /// them for a warning): the environment is shared with scripts and with holdfast's own
    /// CLI. An unknown key in the file is an error.
    ///
    /// # Errors
    /// [`ConfigError`] naming the key that failed to parse or validate.
    pub fn load_over(base: Config, file: Option<&Path>) -> Result<Config, ConfigError> {
        let mut figment = Figment::from(Serialized::defaults(base));
        if let Some(path) = file {
            figment = figment.merge(config_file(path)?);
        }
        let known = env_keys();
        let config: Config = figment
            .merge(
                Env::prefixed("HOLDFAST_")
                    .filter(move |k| known.contains(&env_key(k.as_str())))
                    .split("__"),
            )
            .extract()
            .map_err(Box::new)?;
        config.validate()?;
        Ok(config)
    }

    /// [`Config::load`] without the validation, for tools that only read a key
    /// (`holdfast --version` reads `database_url`).
    ///
    /// # Errors
    /// [`ConfigError::Parse`] when the file or the environment cannot be parsed.
    pub fn load_unvalidated(file: Option<&Path>) -> Result<Config, ConfigError> {
        let mut figment = Figment::from(Serialized::defaults(Config::default()));
        if let Some(path) = file {
            figment = figment.merge(config_file(path)?);
        }
        let known = env_keys();
        Ok(figment
            .merge(
                Env::prefixed("HOLDFAST_")
                    .filter(move |k| known.contains(&env_key(k.as_str())))
                    .split("__"),
            )
            .extract()
            .map_err(Box::new)?)
    }

    /// The `HOLDFAST_*` environment variables that name no config key (and are neither
    /// holdfast's own CLI variables nor the test harness's `HOLDFAST_TEST_*`), which
    /// [`Config::load`] leaves unread.
    pub fn unknown_env() -> Vec<String> {
        let known = env_keys();
        std::env::vars_os()
            .filter_map(|(name, _)| name.into_string().ok())
            .filter(|name| {
                name.get(..9)
                    .is_some_and(|p| p.eq_ignore_ascii_case("HOLDFAST_"))
                    && !OWN_VARIABLES.contains(&name.as_str())
                    && !name
                        .get(..TEST_HARNESS_PREFIX.len())
                        .is_some_and(|p| p.eq_ignore_ascii_case(TEST_HARNESS_PREFIX))
                    && !known.contains(&env_key(&name[9..]))
            })
            .collect()
    }

    /// Checks cross-field rules: backend names unique and kinds valid, rewrite rules naming a
    /// backend that exists, positive durations, namespaces with keys.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the first offending key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.check_backends()?;
        self.check_model_rewrites()?;
        self.check_passthrough()?;
        self.check_prices()?;
        self.check_tenants()?;
        self.check_limits()?;
        self.check_cors()?;
        self.check_otel()?;
        self.check_callbacks()?;
        self.check_database_url()
    }

    /// `[otel]`: an endpoint, when given, is an http or https URL (OT-1); so is the standard
    /// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT` the exporter reads
    /// when traces are on and no endpoint is configured: a bad one is a configuration error
    /// (exit 2), not a failure to start.
    fn check_otel(&self) -> Result<(), ConfigError> {
        let (key, endpoint) = match &self.otel.endpoint {
            Some(endpoint) => ("otel.endpoint", endpoint.clone()),
            None if self.otel.enabled => {
                let standard = [
                    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                    "OTEL_EXPORTER_OTLP_ENDPOINT",
                ]
                .into_iter()
                .find_map(|name| Some((name, std::env::var(name).ok()?)));
                match standard {
                    Some(found) => found,
                    None => return Ok(()),
                }
            }
            None => return Ok(()),
        };
        check_url(&endpoint).map_err(|why| {
            invalid(
                key,
                format!(
                    "{endpoint:?} {why}; write the collector's OTLP/HTTP URL, e.g. \
                     http://localhost:4318/v1/traces"
                ),
            )
        })
    }

    /// The configured namespaces' names, `default` when there are none (CLI-5).
    pub fn namespace_names(&self) -> Vec<&str> {
        if self.namespaces.is_empty() {
            vec!["default"]
        } else {
            self.namespaces.iter().map(|n| n.name.as_str()).collect()
        }
    }

    /// One namespace's share of `workers.concurrency` (LC-2a): `concurrency_per_namespace`,
    /// else `concurrency` divided by the number of namespaces, or by 10 when there are fewer,
    /// at least 1, so the default shares never add up to more than `concurrency` (decision
    /// 144).
    pub fn worker_share(&self) -> usize {
        let w = &self.workers;
        w.concurrency_per_namespace
            .unwrap_or((w.concurrency / self.namespaces.len().max(10)).max(1))
    }

    /// Whether the namespaces' worker shares add up to more than `workers.concurrency`: then
    /// floods of enough namespaces can take every slot before another's call comes (LC-2a).
    pub fn worker_shares_exceed_concurrency(&self) -> bool {
        self.namespaces.len() > 1
            && self.namespaces.len().saturating_mul(self.worker_share()) > self.workers.concurrency
    }

    /// The most proxied calls of `namespace` one node holds open at once (RS-13): its own
    /// `max_held_requests`, else `max_held_requests_per_namespace`; `None` when neither is set.
    pub(crate) fn held_cap_of(&self, namespace: &str) -> Option<usize> {
        self.namespaces
            .iter()
            .find(|n| n.name == namespace)
            .and_then(|n| n.max_held_requests)
            .or(self.max_held_requests_per_namespace)
    }

    /// The callback settings of `namespace` (CB-1, CB-3).
    pub(crate) fn callbacks_of(&self, namespace: &str) -> NamespaceCallbacks<'_> {
        let own = self.namespaces.iter().find(|n| n.name == namespace);
        let c = &self.callbacks;
        NamespaceCallbacks {
            url: own
                .and_then(|n| n.callback_url.as_deref())
                .or(c.url.as_deref()),
            secrets: match own {
                Some(n) if !n.callback_secrets.is_empty() => &n.callback_secrets,
                _ => &c.secrets,
            },
            include_body: own
                .and_then(|n| n.callback_include_body)
                .unwrap_or(c.include_body),
        }
    }

    /// `[callbacks]` and the namespaces' callback keys: secrets that are `whsec_` keys, allowed
    /// networks that parse, URLs that are http(s) with a secret to sign them, positive times.
    fn check_callbacks(&self) -> Result<(), ConfigError> {
        let c = &self.callbacks;
        let secrets = |key: String, secrets: &[String]| {
            for (i, s) in secrets.iter().enumerate() {
                if webhook_key(s).is_none() {
                    return Err(invalid(
                        format!("{key}[{i}]"),
                        "must be whsec_ followed by a non-empty base64 key",
                    ));
                }
            }
            Ok(())
        };
        secrets("callbacks.secrets".into(), &c.secrets)?;
        for (i, n) in self.namespaces.iter().enumerate() {
            secrets(
                format!("namespaces[{i}].callback_secrets"),
                &n.callback_secrets,
            )?;
        }
        for (i, net) in c.allow.iter().enumerate() {
            if net.parse::<ipnet::IpNet>().is_err() && net.parse::<std::net::IpAddr>().is_err() {
                return Err(invalid(
                    format!("callbacks.allow[{i}]"),
                    "must be an address or a network such as 127.0.0.1/32 or 10.0.0.0/8",
                ));
            }
        }
        let urls = std::iter::once(("callbacks.url".to_string(), "default", c.url.as_ref())).chain(
            self.namespaces.iter().enumerate().map(|(i, n)| {
                (
                    format!("namespaces[{i}].callback_url"),
                    n.name.as_str(),
                    n.callback_url.as_ref(),
                )
            }),
        );
        for (key, namespace, url) in urls {
            let Some(url) = url else { continue };
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(invalid(key, "must be an http:// or https:// URL"));
            }
            let secrets = if key == "callbacks.url" {
                &c.secrets
            } else {
                self.callbacks_of(namespace).secrets
            };
            if secrets.is_empty() {
                return Err(invalid(
                    key,
                    "needs a signing secret: set [callbacks] secrets (or the namespace's callback_secrets)",
                ));
            }
        }
        let positive = [
            ("callbacks.timeout_ms", c.timeout_ms),
            ("callbacks.connect_timeout_ms", c.connect_timeout_ms),
            ("callbacks.backoff_initial_ms", c.backoff_initial_ms),
            ("callbacks.give_up_after_secs", c.give_up_after_secs),
            ("callbacks.poll_interval_ms", c.poll_interval_ms),
            ("callbacks.concurrency", c.concurrency as u64),
            (
                "callbacks.concurrency_per_namespace",
                c.concurrency_per_namespace as u64,
            ),
        ];
        for (key, value) in positive {
            if value == 0 {
                return Err(invalid(key, "must be greater than 0"));
            }
        }
        if c.backoff_initial_ms > c.backoff_max_ms {
            return Err(invalid(
                "callbacks.backoff_initial_ms",
                "must not exceed callbacks.backoff_max_ms",
            ));
        }
        Ok(())
    }

    /// `[[backends]]`: at least one, named uniquely, each with a usable base URL.
    fn check_backends(&self) -> Result<(), ConfigError> {
        if self.backends.is_empty() {
            return Err(invalid(
                "backends",
                "at least one [[backends]] entry is required (or run `holdfast serve --demo`)",
            ));
        }
        for (i, b) in self.backends.iter().enumerate() {
            if b.name.is_empty() {
                return Err(invalid(format!("backends[{i}].name"), "must not be empty"));
            }
            if self.backends[..i].iter().any(|o| o.name == b.name) {
                return Err(invalid(
                    format!("backends[{i}].name"),
                    format!(
                        "duplicate backend name {:?}; give each [[backends]] entry its own name",
                        b.name
                    ),
                ));
            }
            check_base_url(&b.base_url).map_err(|why| {
                invalid(
                    format!("backends[{i}].base_url"),
                    format!(
                        "{:?} {why}; write the provider's URL with its version prefix, e.g. \
                         https://api.openai.com/v1",
                        b.base_url
                    ),
                )
            })?;
        }
        Ok(())
    }

    /// `[[model_rewrites]]`: a pattern, and a backend that exists.
    fn check_model_rewrites(&self) -> Result<(), ConfigError> {
        for (i, r) in self.model_rewrites.iter().enumerate() {
            if r.pattern.is_empty() {
                return Err(invalid(
                    format!("model_rewrites[{i}].match"),
                    "must not be empty",
                ));
            }
            check_model_pattern(&r.pattern)
                .map_err(|why| invalid(format!("model_rewrites[{i}].match"), why))?;
            if !self.backends.iter().any(|b| b.name == r.backend) {
                return Err(invalid(
                    format!("model_rewrites[{i}].backend"),
                    format!(
                        "no backend named {:?}; name one of the [[backends]] ({})",
                        r.backend,
                        self.backends
                            .iter()
                            .map(|b| b.name.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                ));
            }
        }
        Ok(())
    }

    /// `[[passthrough]]`: a versioned path that overlaps no route of holdfast's own, and a backend that exists.
    fn check_passthrough(&self) -> Result<(), ConfigError> {
        for (i, p) in self.passthrough.iter().enumerate() {
            let (base, _) = p.base();
            let segments: Vec<&str> = base.split('/').skip(1).collect();
            if !base.starts_with('/') || segments.len() < 2 || segments.iter().any(|s| s.is_empty())
            {
                return Err(invalid(
                    format!("passthrough[{i}].path"),
                    format!(
                        "{:?} must be a path with its version prefix, e.g. \"/v1/moderations\" \
                         or \"/v1/files/*\"",
                        p.path
                    ),
                ));
            }
            if segments.iter().any(|s| s.contains(['{', '}', '*'])) {
                return Err(invalid(
                    format!("passthrough[{i}].path"),
                    format!("{:?}: only a final /* is allowed as a pattern", p.path),
                ));
            }
            let (_, prefix) = p.base();
            let overlaps = |(own, under): &(&str, bool)| {
                base == *own
                    || (prefix && own.starts_with(&format!("{base}/")))
                    || (*under && base.starts_with(&format!("{own}/")))
            };
            if let Some((own, _)) = own_paths().iter().find(|own| overlaps(own)) {
                return Err(invalid(
                    format!("passthrough[{i}].path"),
                    format!("{:?} overlaps holdfast's own route {own}", p.path),
                ));
            }
            if !self.backends.iter().any(|b| b.name == p.backend) {
                return Err(invalid(
                    format!("passthrough[{i}].backend"),
                    format!("no backend named {:?}", p.backend),
                ));
            }
        }
        Ok(())
    }

    /// `[[prices]]`: a backend that exists, and rates of 0 or more.
    fn check_prices(&self) -> Result<(), ConfigError> {
        for (i, p) in self.prices.iter().enumerate() {
            check_model_pattern(&p.model)
                .map_err(|why| invalid(format!("prices[{i}].model"), why))?;
            if !self.backends.iter().any(|b| b.name == p.backend) {
                return Err(invalid(
                    format!("prices[{i}].backend"),
                    format!("no backend named {:?}", p.backend),
                ));
            }
            let rates = [
                ("input_per_mtok", Some(p.input_per_mtok)),
                ("output_per_mtok", Some(p.output_per_mtok)),
                ("cached_input_per_mtok", p.cached_input_per_mtok),
                ("cache_write_per_mtok", p.cache_write_per_mtok),
                ("cache_write_1h_per_mtok", p.cache_write_1h_per_mtok),
            ];
            for (key, rate) in rates {
                if rate.is_some_and(|r| !r.is_finite() || r < 0.0) {
                    return Err(invalid(
                        format!("prices[{i}].{key}"),
                        "must be a price in USD per million tokens, 0 or more",
                    ));
                }
            }
        }
        Ok(())
    }

    /// `admin_api_keys` and `[[namespaces]]`: names and non-empty keys, no key in both.
    fn check_tenants(&self) -> Result<(), ConfigError> {
        if self.admin_api_keys.iter().any(String::is_empty) {
            return Err(invalid("admin_api_keys", "must not hold an empty key"));
        }
        for (i, n) in self.namespaces.iter().enumerate() {
            if n.name.is_empty() {
                return Err(invalid(
                    format!("namespaces[{i}].name"),
                    "must not be empty",
                ));
            }
            // Every setting of a namespace is looked up by its name: a second entry's would
            // be ignored, silently (decision 144).
            if let Some(first) = self.namespaces[..i].iter().position(|m| m.name == n.name) {
                return Err(invalid(
                    format!("namespaces[{i}].name"),
                    format!(
                        "{:?} is namespaces[{first}]'s name too: give a namespace one entry, \
                         with all its api_keys",
                        n.name
                    ),
                ));
            }
            if n.api_keys.is_empty() || n.api_keys.iter().any(String::is_empty) {
                return Err(invalid(
                    format!("namespaces[{i}].api_keys"),
                    "needs at least one non-empty key, e.g. api_keys = [\"hf-team-a-key\"]",
                ));
            }
            if n.max_held_requests == Some(0) {
                return Err(invalid(
                    format!("namespaces[{i}].max_held_requests"),
                    "must be greater than 0 (leave it out for no cap of its own)",
                ));
            }
        }
        if self.max_held_requests_per_namespace == Some(0) {
            return Err(invalid(
                "max_held_requests_per_namespace",
                "must be greater than 0 (leave it out for no cap per namespace)",
            ));
        }
        // A key in both lists would spend as the namespace and read every namespace's log
        // (decision 28: admin keys read, they do not call).
        for (i, key) in self.admin_api_keys.iter().enumerate() {
            if let Some(n) = self.namespaces.iter().find(|n| n.api_keys.contains(key)) {
                return Err(invalid(
                    format!("admin_api_keys[{i}]"),
                    format!(
                        "is also a key of namespace {:?}; an admin key reads every namespace's \
                         requests, so give it a key of its own",
                        n.name
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Every count, size and duration above 0, and the backoff's bounds in order.
    fn check_limits(&self) -> Result<(), ConfigError> {
        let positive = [
            ("dedupe_window_secs", self.dedupe_window_secs),
            ("idempotency_key_ttl_secs", self.idempotency_key_ttl_secs),
            ("max_body_bytes", self.max_body_bytes as u64),
            ("max_response_bytes", self.max_response_bytes as u64),
            ("sse_keepalive_ms", self.sse_keepalive_ms),
            ("max_held_requests", self.max_held_requests as u64),
            ("database_pool_size", u64::from(self.database_pool_size)),
            ("database_timeout_ms", self.database_timeout_ms),
            ("workers.concurrency", self.workers.concurrency as u64),
            (
                "workers.concurrency_per_namespace",
                self.worker_share() as u64,
            ),
            ("workers.lease_secs", self.workers.lease_secs),
            ("workers.max_attempts", u64::from(self.workers.max_attempts)),
            ("workers.sweep_interval_ms", self.workers.sweep_interval_ms),
            ("workers.poll_interval_ms", self.workers.poll_interval_ms),
            ("workers.write_retry_secs", self.workers.write_retry_secs),
            (
                "upstream.connect_timeout_ms",
                self.upstream.connect_timeout_ms,
            ),
            (
                "upstream.header_timeout_ms",
                self.upstream.header_timeout_ms,
            ),
            ("upstream.idle_timeout_ms", self.upstream.idle_timeout_ms),
            ("otel.content_max_bytes", self.otel.content_max_bytes as u64),
            ("otel.queue_size", self.otel.queue_size as u64),
            ("otel.batch_size", self.otel.batch_size as u64),
            ("otel.export_timeout_ms", self.otel.export_timeout_ms),
        ];
        for (key, value) in positive {
            if value == 0 {
                return Err(invalid(key, "must be greater than 0"));
            }
        }
        if self.workers.backoff_initial_ms > self.workers.backoff_max_ms {
            return Err(invalid(
                "workers.backoff_initial_ms",
                "must not exceed workers.backoff_max_ms",
            ));
        }
        Ok(())
    }

    /// `cors_allow_origins`: `*`, or origins as a browser sends them in `Origin` (HTTP-3,
    /// decision 16): the list is matched byte for byte, so `https://app.example/` (a path),
    /// `app.example` (no scheme) or `https://App.example:443` would never match a page and
    /// silently leave CORS off for it. `null` (what a `file:` page or a sandboxed frame sends)
    /// and the origins of pages served under a scheme of their own (a browser extension's
    /// `chrome-extension://ID`, an app shell's `tauri://localhost`) are origins a browser
    /// sends too (decision 104).
    fn check_cors(&self) -> Result<(), ConfigError> {
        for (i, origin) in self.cors_allow_origins.iter().enumerate() {
            if origin == "*" || origin == "null" {
                continue;
            }
            let key = format!("cors_allow_origins[{i}]");
            let serialized = url::Url::parse(origin)
                .ok()
                .and_then(|u| browser_origin(&u));
            match serialized {
                Some(o) if o == *origin => {}
                Some(o) => {
                    return Err(invalid(
                        key,
                        format!(
                            "{origin:?} is not an origin as a browser sends it (scheme, host and \
                             port only, no path); write {o:?}"
                        ),
                    ));
                }
                None => {
                    return Err(invalid(
                        key,
                        format!(
                            "{origin:?} is not an origin; write the page's scheme, host and \
                             port, e.g. \"https://app.example\", or \"*\" for any"
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// `database_url`: an SQLite path that can be used (CLI-1), or a PostgreSQL URL.
    fn check_database_url(&self) -> Result<(), ConfigError> {
        if self.database_url.starts_with("sqlite:") {
            // Before the port is bound or the database opened (CLI-1).
            sqlite_path(&self.database_url).map_err(|m| invalid("database_url", m))?;
        } else if !(self.database_url.starts_with("postgres://")
            || self.database_url.starts_with("postgresql://"))
        {
            return Err(invalid(
                "database_url",
                "must start with sqlite:, postgres:// or postgresql://",
            ));
        }
        Ok(())
    }

    /// The backend named `name`.
    pub(crate) fn backend(&self, name: &str) -> Option<&Backend> {
        self.backends.iter().find(|b| b.name == name)
    }
}

/// The `Origin` a browser sends for a page at `url`: `scheme://host`, then `:port` when it is
/// not the scheme's default; `None` for no page's origin (no host; `ftp:`, `ws:`, `wss:`,
/// `file:`). An `http:` or `https:` one as the URL standard serializes it (the host in lower
/// case, punycode); one of another scheme (`chrome-extension://ID`, `moz-extension://UUID`,
/// `tauri://localhost`, `capacitor://localhost`) as written, which is how the browser sends it.
fn browser_origin(url: &url::Url) -> Option<String> {
    match url.scheme() {
        "http" | "https" => url
            .host()
            .is_some()
            .then(|| url.origin().ascii_serialization()),
        "ftp" | "ws" | "wss" | "file" => None,
        scheme => {
            let host = url.host_str().filter(|h| !h.is_empty())?;
            Some(match url.port() {
                Some(port) => format!("{scheme}://{host}:{port}"),
                None => format!("{scheme}://{host}"),
            })
        }
    }
}

/// A model pattern of `[[model_rewrites]] match` or `[[prices]] model`: an exact name, or a
/// prefix ending in `*` (CLI-5). A `*` anywhere else is no glob: the pattern would be taken as
/// an exact name no model has and never match, silently.
fn check_model_pattern(pattern: &str) -> Result<(), String> {
    if pattern.trim_end_matches('*').contains('*') || pattern.ends_with("**") {
        return Err(format!(
            "{pattern:?}: `*` may only end a pattern (a prefix, e.g. \"gpt-4o*\"); it matches \
             nothing elsewhere"
        ));
    }
    Ok(())
}

/// The TOML layer of the file `--config` names: that very file. Figment's `Toml::file` would
/// look for a relative path in every parent directory too, and take a directory, or a path
/// that is no file, for no file at all: the start would go on from the defaults and the
/// environment alone, the operator's file silently unread (CLI-1).
///
/// # Errors
/// [`ConfigError::Invalid`] for `--config` when `path` does not exist.
fn config_file(path: &Path) -> Result<figment::providers::Data<Toml>, ConfigError> {
    if !path.exists() {
        return Err(invalid(
            "--config",
            format!("{} does not exist", path.display()),
        ));
    }
    if path.is_dir() {
        return Err(invalid(
            "--config",
            format!(
                "{} is a directory; name the TOML file, e.g. {}",
                path.display(),
                path.join("holdfast.toml").display()
            ),
        ));
    }
    Ok(Toml::file_exact(path))
}

/// The file a `sqlite://PATH` or `sqlite:PATH` URL names. A query string (sqlx-style options)
/// is ignored; in-memory databases are refused, since the log must outlive the process (DU-1).
///
/// # Errors
/// Why `url` names no file, in words for the operator.
pub fn sqlite_path(url: &str) -> Result<std::path::PathBuf, String> {
    let rest = url
        .strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))
        .ok_or_else(|| format!("{url:?}: expected sqlite://PATH"))?;
    let path = rest.split('?').next().unwrap_or_default();
    if path.is_empty() || path == ":memory:" {
        return Err(format!(
            "{url:?} needs a file path, e.g. sqlite://holdfast.db (an in-memory database would \
             lose every request on restart)"
        ));
    }
    Ok(std::path::PathBuf::from(path))
}

/// What is doubtful about backend `b`'s `base_url`, if anything: a provider's root with no path
/// for a kind whose routes' version is part of the `base_url` (`https://api.openai.com`, which
/// would be asked for `/chat/completions`), or a version at the end of a `gemini` one, whose
/// clients' paths carry their own (decision 57). Start-up logs it; the configuration still
/// loads, since an OpenAI-compatible server may serve any path.
pub fn doubtful_base_url(b: &Backend) -> Option<String> {
    let parsed = reqwest::Url::parse(&b.base_url).ok()?;
    let path = parsed.path().trim_end_matches('/');
    match b.kind {
        Provider::Gemini => {
            let last = path.rsplit('/').next().unwrap_or_default();
            let versioned =
                last.starts_with('v') && last[1..].starts_with(|c: char| c.is_ascii_digit());
            versioned.then(|| {
                format!(
                    "backend {:?}: base_url {} ends in a version, and the client's path adds its own (`/v1beta/models/...`): write the root, e.g. https://generativelanguage.googleapis.com",
                    b.name, b.base_url
                )
            })
        }
        _ if path.is_empty() => {
            let (route, example) = match b.kind {
                Provider::Anthropic => ("/messages", "https://api.anthropic.com/v1"),
                _ => ("/chat/completions", "https://api.openai.com/v1"),
            };
            Some(format!(
                "backend {:?}: base_url {} has no version prefix, so a call goes to {}{route}: \
                 write it with its version, e.g. {example}",
                b.name,
                b.base_url,
                b.base_url.trim_end_matches('/'),
            ))
        }
        _ => None,
    }
}

/// Why `url` cannot be a backend's `base_url`: not a URL, a scheme other than http or https, or
/// no host.
fn check_base_url(url: &str) -> Result<(), String> {
    check_url(url).map_err(|why| match why {
        UrlProblem::Scheme(scheme) => {
            format!("has scheme {scheme:?}; holdfast calls providers over http or https")
        }
        why => why.to_string(),
    })
}

/// What is wrong with a URL holdfast would call.
enum UrlProblem {
    NotAUrl(String),
    Scheme(String),
    NoHost,
}

impl std::fmt::Display for UrlProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UrlProblem::NotAUrl(e) => write!(f, "is not a URL ({e})"),
            UrlProblem::Scheme(scheme) => write!(f, "has scheme {scheme:?}, not http or https"),
            UrlProblem::NoHost => f.write_str("has no host"),
        }
    }
}

/// Whether `url` is an http or https URL with a host.
fn check_url(url: &str) -> Result<(), UrlProblem> {
    let parsed = reqwest::Url::parse(url).map_err(|e| UrlProblem::NotAUrl(e.to_string()))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(UrlProblem::Scheme(parsed.scheme().to_string()));
    }
    if parsed.host_str().is_none_or(str::is_empty) {
        return Err(UrlProblem::NoHost);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_backend() -> Config {
        Config {
            backends: vec![Backend {
                name: "openai".into(),
                kind: Provider::Openai,
                base_url: "http://127.0.0.1:1/v1".into(),
                api_key_env: None,
            }],
            ..Config::default()
        }
    }

    /// Start-up warns about a provider's root with no version for OpenAI and Anthropic, and a
    /// version at the end of a Gemini `base_url` (decision 57); every documented form passes.
    #[test]
    fn a_base_url_missing_its_version_or_a_gemini_one_with_a_version_is_doubtful() {
        let doubt = |kind: Provider, base_url: &str| {
            doubtful_base_url(&Backend {
                name: "b".into(),
                kind,
                base_url: base_url.into(),
                api_key_env: None,
            })
        };
        for (kind, url) in [
            (Provider::Openai, "https://api.openai.com"),
            (Provider::Openai, "https://api.openai.com/"),
            (Provider::Anthropic, "https://api.anthropic.com"),
            (
                Provider::Gemini,
                "https://generativelanguage.googleapis.com/v1beta",
            ),
            (
                Provider::Gemini,
                "https://generativelanguage.googleapis.com/v1/",
            ),
        ] {
            let why = doubt(kind, url).unwrap_or_else(|| panic!("{url} passed"));
            assert!(why.contains(url), "{why}");
            assert!(!why.contains("  "), "one line of prose: {why}");
        }
        let openai = doubt(Provider::Openai, "https://api.openai.com").unwrap();
        assert!(
            openai.contains("https://api.openai.com/chat/completions"),
            "{openai}"
        );
        for (kind, url) in [
            (Provider::Openai, "https://api.openai.com/v1"),
            (
                Provider::Openai,
                "https://generativelanguage.googleapis.com/v1beta/openai",
            ),
            (Provider::Openai, "http://127.0.0.1:8000/v1/"),
            (Provider::Anthropic, "https://api.anthropic.com/v1"),
            (
                Provider::Gemini,
                "https://generativelanguage.googleapis.com",
            ),
            (Provider::Gemini, "http://127.0.0.1:9000/"),
            (Provider::Gemini, "https://proxy.example/google/vertex"),
        ] {
            assert_eq!(doubt(kind, url), None, "{url}");
        }
    }

    #[test]
    fn pass_through_paths_may_not_overlap_a_route_of_the_route_table_gm1() {
        let refused = |path: &str| {
            let mut config = with_backend();
            config.passthrough = vec![Passthrough {
                path: path.into(),
                backend: "openai".into(),
            }];
            config.check_passthrough().is_err()
        };
        for path in [
            "/v1/chat/completions",
            "/v1beta/models/*",
            "/v1beta/models/x:embedContent",
            "/v1/models/x",
            "/v1/responses/x",
        ] {
            assert!(refused(path), "{path}");
        }
        for path in ["/v1/moderations", "/v1beta/files/*", "/v1/files/*"] {
            assert!(!refused(path), "{path}");
        }
    }

    #[test]
    fn defaults_match_spec_cli4() {
        let c = Config::default();
        assert_eq!(c.dedupe_window_secs, 600);
        assert_eq!(c.idempotency_key_ttl_secs, 86_400);
        assert_eq!(c.max_body_bytes, 33_554_432);
        assert_eq!(
            c.workers.concurrency, 10_000,
            "issue 30: LLM calls are slow and I/O-bound"
        );
        assert_eq!(c.workers.lease_secs, 30);
        assert_eq!(c.workers.max_attempts, 5);
        assert_eq!(c.workers.backoff_initial_ms, 500);
        assert_eq!(c.workers.backoff_max_ms, 30_000);
    }

    #[test]
    fn rewrite_rule_naming_unknown_backend_is_refused_with_its_key() {
        let mut c = with_backend();
        c.model_rewrites.push(ModelRewrite {
            pattern: "fast".into(),
            backend: "nope".into(),
            model: None,
        });
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("model_rewrites[0].backend"), "{err}");
    }

    #[test]
    fn traces_are_off_by_default_and_an_endpoint_that_is_no_http_url_is_refused_ot1() {
        let mut c = with_backend();
        assert!(!c.otel.enabled);
        assert!(!c.otel.capture_content);
        c.otel.endpoint = Some("collector:4318".into());
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("otel.endpoint"), "{err}");
        c.otel.endpoint = Some("http://127.0.0.1:4318/v1/traces".into());
        c.validate().expect("an http URL is fine");
        c.otel.queue_size = 0;
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("otel.queue_size"), "{err}");
    }

    /// HTTP-3, decision 16: an allowed origin is matched byte for byte against the browser's
    /// `Origin`, so one no browser sends (a path, no scheme, upper case, a default port) is
    /// refused at start naming the origin to write, instead of leaving CORS silently off.
    #[test]
    fn a_cors_origin_no_browser_sends_is_refused_naming_the_one_to_write_http3() {
        let mut c = with_backend();
        for fine in [
            "*",
            "https://app.example",
            "http://127.0.0.1:3000",
            "http://[::1]:8080",
        ] {
            c.cors_allow_origins = vec![fine.into()];
            c.validate().unwrap_or_else(|e| panic!("{fine}: {e}"));
        }
        for (written, hint) in [
            ("https://app.example/", "\"https://app.example\""),
            ("https://App.example", "\"https://app.example\""),
            ("https://app.example:443", "\"https://app.example\""),
            ("https://app.example/page?x=1", "\"https://app.example\""),
            ("app.example", "e.g. \"https://app.example\""),
            ("ftp://app.example", "e.g. \"https://app.example\""),
        ] {
            c.cors_allow_origins = vec!["*".into(), written.into()];
            let err = c.validate().unwrap_err().to_string();
            assert!(err.contains("cors_allow_origins[1]"), "{written}: {err}");
            assert!(err.contains(hint), "{written}: {err}");
        }
    }

    /// HTTP-3, decision 104: `null` (a `file:` page, a sandboxed frame) and the origins of pages
    /// under a scheme of their own (a browser extension, an app shell such as Tauri or
    /// Capacitor) are origins browsers send, which a configuration could allow before the start
    /// checked the form of origins: they still start, written as the browser sends them.
    #[test]
    fn the_origins_of_extensions_app_shells_and_file_pages_are_still_allowed_http3() {
        let mut c = with_backend();
        for fine in [
            "null",
            "chrome-extension://abcdefghijklmnopabcdefghijklmnop",
            "moz-extension://0b7b7a1e-3f52-4e53-9f0e-1c2d3e4f5a6b",
            "tauri://localhost",
            "capacitor://localhost",
            "app://holdfast-client:5173",
        ] {
            c.cors_allow_origins = vec![fine.into()];
            c.validate().unwrap_or_else(|e| panic!("{fine}: {e}"));
        }
        for (written, hint) in [
            (
                "chrome-extension://abcdefgh/",
                "\"chrome-extension://abcdefgh\"",
            ),
            ("Tauri://localhost", "\"tauri://localhost\""),
            ("wss://app.example", "e.g. \"https://app.example\""),
            ("file:///home/me/page.html", "e.g. \"https://app.example\""),
        ] {
            c.cors_allow_origins = vec![written.into()];
            let err = c.validate().unwrap_err().to_string();
            assert!(err.contains("cors_allow_origins[0]"), "{written}: {err}");
            assert!(err.contains(hint), "{written}: {err}");
        }
    }

    /// CLI-5, RD-9: a model pattern is an exact name or a prefix ending in `*`; a `*` anywhere
    /// else (a glob such as `claude-*-latest`) would never match, so the start refuses it.
    #[test]
    fn a_star_anywhere_but_the_end_of_a_model_pattern_is_refused_cli5() {
        let mut c = with_backend();
        for fine in ["gpt-4o", "gpt-4o*", "*"] {
            c.model_rewrites = vec![ModelRewrite {
                pattern: fine.into(),
                backend: "openai".into(),
                model: None,
            }];
            c.validate().unwrap_or_else(|e| panic!("{fine}: {e}"));
        }
        for glob in ["claude-*-latest", "*-mini", "gpt**"] {
            c.model_rewrites = vec![ModelRewrite {
                pattern: glob.into(),
                backend: "openai".into(),
                model: None,
            }];
            let err = c.validate().unwrap_err().to_string();
            assert!(err.contains("model_rewrites[0].match"), "{glob}: {err}");
        }
        c.model_rewrites.clear();
        c.prices = vec![Price {
            backend: "openai".into(),
            model: "gpt-*-mini".into(),
            input_per_mtok: 1.0,
            output_per_mtok: 1.0,
            cached_input_per_mtok: None,
            cache_write_per_mtok: None,
            cache_write_1h_per_mtok: None,
        }];
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("prices[0].model"), "{err}");
    }

    #[test]
    fn zero_lease_is_refused_with_its_key() {
        let mut c = with_backend();
        c.workers.lease_secs = 0;
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("workers.lease_secs"), "{err}");
    }

    /// CLI-1, decision 28: a key listed both as an admin key and as a namespace's would call as
    /// that namespace and read every namespace's log; the start refuses it naming the key.
    #[test]
    fn a_key_that_is_both_an_admin_key_and_a_namespace_key_is_refused_cli1() {
        let mut c = with_backend();
        c.namespaces.push(Namespace {
            name: "team-a".into(),
            api_keys: vec!["hf-team-a-key".into()],
            callback_url: None,
            callback_secrets: Vec::new(),
            callback_include_body: None,
            max_held_requests: None,
        });
        c.admin_api_keys = vec!["hf-admin-key".into()];
        c.validate().expect("distinct keys are fine");
        c.admin_api_keys.push("hf-team-a-key".into());
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("admin_api_keys[1]"), "{err}");
        assert!(err.contains("\"team-a\""), "{err}");
    }

    #[test]
    fn callback_keys_are_checked_and_a_namespace_overrides_the_defaults_cb1_cb2_cb3() {
        let refused = |tweak: &dyn Fn(&mut Config), key: &str| {
            let mut c = with_backend();
            tweak(&mut c);
            let err = c.validate().unwrap_err().to_string();
            assert!(err.contains(key), "{key}: {err}");
        };
        refused(
            &|c| c.callbacks.secrets = vec!["nope".into()],
            "callbacks.secrets[0]",
        );
        refused(
            &|c| c.callbacks.secrets = vec!["whsec_".into()],
            "callbacks.secrets[0]",
        );
        refused(
            &|c| c.callbacks.allow = vec!["10.0.0.0/33".into()],
            "callbacks.allow[0]",
        );
        refused(
            &|c| c.callbacks.url = Some("https://x.example/".into()),
            "callbacks.url",
        );
        refused(
            &|c| {
                c.callbacks.secrets = vec!["whsec_AAAA".into()];
                c.callbacks.url = Some("ftp://x.example/".into());
            },
            "callbacks.url",
        );
        refused(&|c| c.callbacks.timeout_ms = 0, "callbacks.timeout_ms");
        refused(
            &|c| c.callbacks.backoff_initial_ms = c.callbacks.backoff_max_ms + 1,
            "callbacks.backoff_initial_ms",
        );

        let mut c = with_backend();
        c.callbacks.secrets = vec!["whsec_AAAA".into()];
        c.callbacks.url = Some("https://default.example/".into());
        c.callbacks.allow = vec!["127.0.0.1".into(), "10.0.0.0/8".into()];
        c.namespaces = vec![
            Namespace {
                name: "a".into(),
                api_keys: vec!["ka".into()],
                callback_url: Some("https://a.example/".into()),
                callback_secrets: vec!["whsec_BBBB".into()],
                callback_include_body: Some(true),
                max_held_requests: None,
            },
            Namespace {
                name: "b".into(),
                api_keys: vec!["kb".into()],
                callback_url: None,
                callback_secrets: Vec::new(),
                callback_include_body: None,
                max_held_requests: None,
            },
        ];
        c.validate().expect("valid");
        let a = c.callbacks_of("a");
        assert_eq!(
            (a.url, a.secrets, a.include_body),
            (
                Some("https://a.example/"),
                &["whsec_BBBB".to_string()][..],
                true
            )
        );
        let b = c.callbacks_of("b");
        assert_eq!(
            (b.url, b.secrets, b.include_body),
            (
                Some("https://default.example/"),
                &["whsec_AAAA".to_string()][..],
                false
            )
        );
        assert_eq!(webhook_key("whsec_AAAA"), Some(vec![0, 0, 0]));
        assert_eq!(webhook_key("AAAA"), None);
    }

    /// A namespace `name` with one key and its own cap of held calls, `cap`.
    fn namespace(name: &str, cap: Option<usize>) -> Namespace {
        Namespace {
            name: name.into(),
            api_keys: vec![format!("k{name}")],
            callback_url: None,
            callback_secrets: Vec::new(),
            callback_include_body: None,
            max_held_requests: cap,
        }
    }

    /// LC-2a, decision 144: a namespace's share of the worker slots is `concurrency` over the
    /// number of namespaces (over 10 when fewer) unless set, so lowering `concurrency` keeps
    /// the shares (a default of 1,000 made any `concurrency` of 1,000 or less one pool, with no
    /// share for anyone) and the default shares never add up to more than `concurrency`; a
    /// share set so they do is reported; 0 is refused; a name given twice is refused (its
    /// second entry's settings were ignored, and its keys shared the first one's share).
    #[test]
    fn a_namespaces_share_of_worker_slots_fits_concurrency_unless_set_and_names_are_one_each_lc2a()
    {
        let mut c = with_backend();
        assert_eq!(c.worker_share(), 1_000);
        c.workers.concurrency = 20;
        assert_eq!(c.worker_share(), 2);
        c.workers.concurrency = 6;
        assert_eq!(c.worker_share(), 1);
        // More than ten namespaces: the default shares still fit in `concurrency`.
        c.workers.concurrency = 10_000;
        c.namespaces = (0..16).map(|i| namespace(&format!("t{i}"), None)).collect();
        assert_eq!(c.worker_share(), 625);
        assert!(!c.worker_shares_exceed_concurrency());
        c.workers.concurrency_per_namespace = Some(1_000);
        assert_eq!(c.worker_share(), 1_000);
        assert!(c.worker_shares_exceed_concurrency(), "16 x 1,000 > 10,000");
        c.validate().expect("valid");
        // A name given twice: refused, naming both entries.
        c.namespaces.push(namespace("t3", None));
        let err = c.validate().unwrap_err().to_string();
        assert!(
            err.contains("namespaces[16].name") && err.contains("namespaces[3]"),
            "{err}"
        );
        c.namespaces.pop();
        c.workers.concurrency_per_namespace = Some(0);
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("workers.concurrency_per_namespace"), "{err}");
    }

    #[test]
    fn a_namespace_cap_of_held_calls_is_its_own_else_the_node_wide_one_and_never_0_rs13() {
        let mut c = with_backend();
        c.namespaces = vec![namespace("a", Some(5)), namespace("b", None)];
        c.validate().expect("valid");
        assert_eq!((c.held_cap_of("a"), c.held_cap_of("b")), (Some(5), None));
        c.max_held_requests_per_namespace = Some(2);
        assert_eq!((c.held_cap_of("a"), c.held_cap_of("b")), (Some(5), Some(2)));
        let mut alone = with_backend();
        alone.max_held_requests_per_namespace = Some(3);
        assert_eq!(alone.held_cap_of("default"), Some(3), "no [[namespaces]]");

        c.namespaces[1].max_held_requests = Some(0);
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("namespaces[1].max_held_requests"), "{err}");
        alone.max_held_requests_per_namespace = Some(0);
        let err = alone.validate().unwrap_err().to_string();
        assert!(err.contains("max_held_requests_per_namespace"), "{err}");
    }

    #[test]
    fn rewrite_pattern_matches_exact_or_prefix() {
        let exact = ModelRewrite {
            pattern: "fast".into(),
            backend: "b".into(),
            model: None,
        };
        assert!(exact.matches("fast"));
        assert!(!exact.matches("faster"));
        let prefix = ModelRewrite {
            pattern: "gpt-4o*".into(),
            ..exact
        };
        assert!(prefix.matches("gpt-4o-mini"));
        assert!(prefix.matches("gpt-4o"));
        assert!(!prefix.matches("gpt-4"));
    }

    #[test]
    #[allow(clippy::result_large_err)] // figment::Jail's signature, not ours
    fn toml_file_and_env_override_load_cli1() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("holdfast.toml");
        std::fs::write(
            &path,
            r#"
listen = "127.0.0.1:9999"
[workers]
lease_secs = 7
[[backends]]
name = "openai"
kind = "openai"
base_url = "https://api.openai.com/v1"
"#,
        )
        .unwrap();
        figment::Jail::expect_with(|jail| {
            jail.set_env("HOLDFAST_WORKERS__MAX_ATTEMPTS", "9");
            let c = Config::load(Some(&path)).map_err(|e| e.to_string())?;
            assert_eq!(c.listen.port(), 9999);
            assert_eq!(c.workers.lease_secs, 7);
            assert_eq!(c.workers.max_attempts, 9);
            Ok(())
        });
    }

    /// CLI-1: `--config` naming a directory, or a file that does not exist, stops the start
    /// naming `--config`, for `serve` and for the tools that only read a key alike: it is
    /// never read as an empty file, the start going on from the defaults and the environment.
    #[test]
    fn a_config_path_that_is_no_file_is_refused_cli1() {
        let dir = tempfile::tempdir().unwrap();
        let err = Config::load(Some(dir.path())).unwrap_err().to_string();
        assert!(
            err.contains("--config") && err.contains("is a directory"),
            "{err}"
        );
        let err = Config::load_unvalidated(Some(dir.path()))
            .unwrap_err()
            .to_string();
        assert!(err.contains("is a directory"), "{err}");
        let missing = dir.path().join("holdfast.toml");
        let err = Config::load_unvalidated(Some(&missing))
            .unwrap_err()
            .to_string();
        assert!(err.contains("does not exist"), "{err}");
    }

    #[test]
    fn unknown_key_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("holdfast.toml");
        std::fs::write(&path, "lisen = \"127.0.0.1:1\"\n").unwrap();
        let err = Config::load(Some(&path)).unwrap_err().to_string();
        assert!(err.contains("lisen"), "{err}");
    }

    /// CLI-1: a provider key written into a backend as `api_key` is told where keys go
    /// (`api_key_env`), not only that the key is unknown (a new-user trial's first mistake).
    #[test]
    fn a_backends_api_key_is_told_to_name_its_variable_cli1() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("holdfast.toml");
        std::fs::write(
            &path,
            "[[backends]]\nname = \"openai\"\nkind = \"openai\"\nbase_url = \"https://api.openai.com/v1\"\napi_key = \"sk-x\"\n",
        )
        .unwrap();
        let err = Config::load(Some(&path)).unwrap_err().to_string();
        assert!(
            err.contains(".api_key`")
                && err.contains("api_key_env")
                && err.contains("environment variable"),
            "{err}"
        );
    }

    /// OT-1: with traces on and no `otel.endpoint`, a standard OTLP endpoint variable that is
    /// no http(s) URL is a configuration error (exit 2) naming the variable, as a bad
    /// `otel.endpoint` is; a new-user trial's `localhost:4318` stopped the start with exit 1.
    /// With traces off the variable is not read.
    #[test]
    #[allow(clippy::result_large_err)] // figment::Jail's signature, not ours
    fn a_standard_otlp_endpoint_that_is_no_url_is_a_configuration_error_ot1() {
        figment::Jail::expect_with(|jail| {
            jail.set_env("OTEL_EXPORTER_OTLP_ENDPOINT", "localhost:4318");
            let mut c = with_backend();
            c.otel.enabled = true;
            let err = c.validate().unwrap_err().to_string();
            assert!(
                err.contains("OTEL_EXPORTER_OTLP_ENDPOINT") && err.contains("not http or https"),
                "{err}"
            );
            c.otel.enabled = false;
            c.validate().map_err(|e| e.to_string())?;
            c.otel.enabled = true;
            jail.set_env("OTEL_EXPORTER_OTLP_ENDPOINT", "http://localhost:4318");
            c.validate().map_err(|e| e.to_string())?;
            Ok(())
        });
    }
}
