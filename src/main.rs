//! The `holdfast` binary: parse the command line, start tracing, hand over (SPEC CLI-1..CLI-3).

#![forbid(unsafe_code)]

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};

use std::io::Write as _;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use holdfast::app::Stopped;
use holdfast::config::{Backend, Config, LogFormat};
use holdfast::mock::{MockConfig, MockServer};
use holdfast::provider::Provider;
use tokio::net::TcpListener;
use tracing_subscriber::EnvFilter;

#[derive(Parser)]
#[command(
    name = "holdfast",
    about = "A durable proxy for LLM APIs",
    disable_version_flag = true,
    subcommand_required = false,
    arg_required_else_help = true
)]
struct Cli {
    /// Print the version, and the schema version of the database the configuration names
    /// (read without creating or changing it).
    #[arg(short = 'V', long)]
    version: bool,
    /// TOML configuration file; every key can be overridden by HOLDFAST_<KEY>
    /// (docs/configuration.md).
    #[arg(long, global = true, env = "HOLDFAST_CONFIG", value_name = "FILE")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Run the API and the workers.
    Serve(ServeArgs),
    /// Run a fake OpenAI + Anthropic + Gemini provider for tests, demos and benchmarks.
    MockUpstream(MockArgs),
    /// Read the request log of a running holdfast (any node of a cluster).
    #[command(subcommand)]
    Requests(RequestsCommand),
    /// The usage and savings ledger of a running holdfast.
    Usage(UsageArgs),
}

/// Where a running holdfast is, and the key to read it with.
#[derive(Args, Clone)]
struct ServerArgs {
    /// holdfast's address [default: with --config, the address it listens on; else
    /// http://127.0.0.1:8080].
    #[arg(long, env = "HOLDFAST_URL", global = true)]
    url: Option<String>,
    /// A namespace key, or an admin key (every namespace) [default: with --config, its first
    /// admin key].
    #[arg(long, env = "HOLDFAST_API_KEY", global = true, hide_env_values = true)]
    api_key: Option<String>,
    /// Print the server's JSON instead of a table.
    #[arg(long, global = true)]
    json: bool,
}

// Parsed once per process: the size of its largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum RequestsCommand {
    /// List requests, newest first.
    List {
        #[command(flatten)]
        server: ServerArgs,
        #[command(flatten)]
        filters: Filters,
        /// Page size (at most 500).
        #[arg(long)]
        limit: Option<u32>,
        /// Start after this request id (the previous page's last).
        #[arg(long)]
        cursor: Option<String>,
    },
    /// Export the log as NDJSON, oldest first (docs/cli.md; SPEC EX-6).
    Export {
        #[command(flatten)]
        server: ServerArgs,
        #[command(flatten)]
        filters: Filters,
        /// records (one JSON record per line) or openai-chat (fine-tuning examples).
        #[arg(long, default_value = "records", value_parser = ["records", "openai-chat"])]
        format: String,
        /// Start after this request id (an earlier export's last cursor).
        #[arg(long)]
        after: Option<String>,
        /// Export at most this many requests (the oldest first; with --after, the next ones).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        limit: Option<u64>,
        /// Write to this file instead of stdout.
        #[arg(short = 'o', long, value_name = "FILE")]
        output: Option<PathBuf>,
    },
    /// One request: status, attempts, usage, cost, deliveries.
    #[command(alias = "get")]
    Show {
        #[command(flatten)]
        server: ServerArgs,
        /// The request id.
        id: String,
        /// Also the request body sent upstream and the answer.
        #[arg(long)]
        body: bool,
    },
    /// Follow a request's log as it is written, resuming after disconnects, until its end.
    Tail {
        #[command(flatten)]
        server: ServerArgs,
        /// The request id.
        id: String,
        /// Start after this seq (default: the current attempt).
        #[arg(long)]
        from: Option<i64>,
        /// Give up after the server has been unreachable this many seconds.
        #[arg(long, default_value_t = 60)]
        patience_secs: u64,
    },
    /// Send a logged request again as a new request, to its model or another, and show both
    /// answers (SPEC EX-9).
    Replay {
        #[command(flatten)]
        server: ServerArgs,
        /// The request id.
        id: String,
        /// Send it to this model (routed as a client's model would be).
        #[arg(long)]
        model: Option<String>,
        /// Send it to this backend.
        #[arg(long)]
        backend: Option<String>,
        /// Give up waiting for the replay's answer after this many seconds.
        #[arg(long, default_value_t = 600)]
        wait_secs: u64,
    },
    /// Cancel a request (LC-9).
    Cancel {
        #[command(flatten)]
        server: ServerArgs,
        /// The request id.
        id: String,
    },
}

/// The filters of `GET /requests` (RD-7, EX-8).
#[derive(Args, Clone)]
struct Filters {
    /// Only this status: pending, running, succeeded, failed.
    #[arg(long)]
    status: Option<String>,
    /// Only this route, e.g. openai.chat.
    #[arg(long)]
    route: Option<String>,
    /// Only this model.
    #[arg(long)]
    model: Option<String>,
    /// Only this backend.
    #[arg(long)]
    backend: Option<String>,
    /// Submitted at or after (RFC 3339, or a date YYYY-MM-DD: its start, UTC).
    #[arg(long)]
    since: Option<String>,
    /// Submitted before (RFC 3339, or a date YYYY-MM-DD).
    #[arg(long)]
    until: Option<String>,
    /// A substring of the request body.
    #[arg(long)]
    q: Option<String>,
    /// Only requests that answered more than one submission.
    #[arg(long)]
    replayed: bool,
    /// Only the replays of this request.
    #[arg(long)]
    replay_of: Option<String>,
    /// Only requests whose callback is pending, delivered or failed.
    #[arg(long)]
    callback: Option<String>,
    /// Admin keys: one namespace.
    #[arg(long)]
    namespace: Option<String>,
}

impl Filters {
    /// The query parameters.
    fn query(self) -> Vec<(String, String)> {
        pairs(&[
            ("status", self.status),
            ("route", self.route),
            ("model", self.model),
            ("backend", self.backend),
            ("since", self.since),
            ("until", self.until),
            ("q", self.q),
            ("replayed", self.replayed.then(|| "true".to_string())),
            ("replay_of", self.replay_of),
            ("callback", self.callback),
            ("namespace", self.namespace),
        ])
    }
}

#[derive(Args)]
struct UsageArgs {
    #[command(flatten)]
    server: ServerArgs,
    /// Submitted at or after (RFC 3339, or a date YYYY-MM-DD: its start, UTC; default 30 days
    /// ago).
    #[arg(long)]
    since: Option<String>,
    /// Submitted before (RFC 3339, or a date YYYY-MM-DD; default now).
    #[arg(long)]
    until: Option<String>,
    /// Group by model (the default), backend, namespace, day or provider.
    #[arg(long)]
    group_by: Option<String>,
    /// Admin keys: one namespace.
    #[arg(long)]
    namespace: Option<String>,
}

#[derive(Args)]
struct ServeArgs {
    /// No config, no network: embedded SQLite file (holdfast-demo.db) and an in-process mock
    /// provider as the only backend.
    #[arg(long)]
    demo: bool,
    /// Listen address [default: the `listen` key (env: HOLDFAST_LISTEN), 127.0.0.1:8080].
    // Not `env = "HOLDFAST_LISTEN"`: the configuration reads that variable as the `listen` key,
    // and a bad value is then one line naming the variable, not a clap error about `--listen`.
    #[arg(long, value_name = "ADDR")]
    listen: Option<SocketAddr>,
}

#[derive(Args)]
struct MockArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:9000")]
    listen: SocketAddr,
    /// Content pieces per response.
    #[arg(long, default_value_t = 8)]
    chunks: u32,
    /// Stream: delay before each content event, in milliseconds.
    #[arg(long, default_value_t = 0)]
    chunk_delay_ms: u64,
    /// Delay before response headers on every call, in milliseconds.
    #[arg(long, default_value_t = 0)]
    header_delay_ms: u64,
    /// Answer the first N calls with --fail-status.
    #[arg(long, default_value_t = 0)]
    fail_first: u32,
    /// Status for --fail-first.
    #[arg(long, default_value_t = 500)]
    fail_status: u16,
    /// Failures carry `retry-after: VALUE`.
    #[arg(long)]
    retry_after: Option<String>,
    /// Failures carry `retry-after-ms: VALUE`.
    #[arg(long)]
    retry_after_ms: Option<u64>,
    /// Gemini failures: a `google.rpc.RetryInfo` detail with this `retryDelay` (`1.5s`) in
    /// their body, as Google says how long to wait.
    #[arg(long)]
    retry_delay: Option<String>,
    /// Stream: close the connection abruptly after K content events.
    #[arg(long)]
    drop_after_chunks: Option<u32>,
    /// Apply --drop-after-chunks to the first N calls only (0: every call).
    #[arg(long, default_value_t = 0)]
    drop_first: u32,
    /// The first N calls: close the connection without any response.
    #[arg(long, default_value_t = 0)]
    reset_before_headers: u32,
    /// Sleep this long before the headers of the first --hang-first calls, in milliseconds.
    #[arg(long)]
    hang_before_headers_ms: Option<u64>,
    /// How many calls --hang-before-headers-ms applies to (0: every call).
    #[arg(long, default_value_t = 0)]
    hang_first: u32,
    /// Stream: `K,M` — after K content events pause M milliseconds once.
    #[arg(long, value_parser = parse_stall)]
    stall_after_chunks: Option<(u32, u64)>,
    /// Stream: emit a garbage event halfway through.
    #[arg(long)]
    malformed_sse: bool,
    /// Non-stream: answer 200 with a body that is not JSON.
    #[arg(long)]
    non_json_200: bool,
    /// Non-stream: pad the reply to at least this many bytes.
    #[arg(long)]
    oversized_bytes: Option<usize>,
    /// Stream: end the body cleanly after K content events, without the final events.
    #[arg(long)]
    end_after_chunks: Option<u32>,
    /// Stream: leave out the event that completes the stream ([DONE], message_stop, ...).
    #[arg(long)]
    omit_stream_end: bool,
    /// Answer stream requests with the complete non-stream JSON body.
    #[arg(long)]
    ignore_stream: bool,
}

impl From<&MockArgs> for MockConfig {
    fn from(a: &MockArgs) -> MockConfig {
        MockConfig {
            chunks: a.chunks,
            chunk_delay_ms: a.chunk_delay_ms,
            header_delay_ms: a.header_delay_ms,
            fail_first: a.fail_first,
            fail_status: a.fail_status,
            retry_after: a.retry_after.clone(),
            retry_after_ms: a.retry_after_ms,
            retry_delay: a.retry_delay.clone(),
            drop_after_chunks: a.drop_after_chunks,
            drop_first: a.drop_first,
            reset_before_headers: a.reset_before_headers,
            hang_before_headers_ms: a.hang_before_headers_ms,
            hang_first: a.hang_first,
            stall_after_chunks: a.stall_after_chunks,
            malformed_sse: a.malformed_sse,
            non_json_200: a.non_json_200,
            oversized_bytes: a.oversized_bytes,
            end_after_chunks: a.end_after_chunks,
            omit_stream_end: a.omit_stream_end,
            ignore_stream: a.ignore_stream,
        }
    }
}

fn parse_stall(s: &str) -> Result<(u32, u64), String> {
    let (k, m) = s.split_once(',').ok_or("expected K,M")?;
    Ok((
        k.trim().parse().map_err(|e| format!("K: {e}"))?,
        m.trim().parse().map_err(|e| format!("M: {e}"))?,
    ))
}

/// Exit status of a configuration that cannot work (and of a usage error, as clap does).
const EXIT_CONFIG: u8 = 2;

/// A reason to stop, already worded for the operator, and the exit status.
struct Stop(u8, String);

impl From<anyhow::Error> for Stop {
    fn from(e: anyhow::Error) -> Stop {
        let config = e
            .downcast_ref::<holdfast::store::StoreError>()
            .is_some_and(|e| matches!(e, holdfast::store::StoreError::Config(_)))
            || e.downcast_ref::<holdfast::config::ConfigError>().is_some();
        Stop(if config { EXIT_CONFIG } else { 1 }, format!("{e:#}"))
    }
}

impl From<holdfast::config::ConfigError> for Stop {
    fn from(e: holdfast::config::ConfigError) -> Stop {
        Stop(EXIT_CONFIG, e.to_string())
    }
}

/// mimalloc instead of the system allocator: measured in docs/benchmarks-history.md.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let done = tokio::runtime::Runtime::new()
        .map_err(|e| Stop(1, format!("cannot start the runtime: {e}")))
        .and_then(|runtime| {
            let done = runtime.block_on(run(cli));
            // A store call still blocked on a stalled database (DU-5a) does not hold the exit.
            runtime.shutdown_timeout(RUNTIME_STOPS_WITHIN);
            done
        });
    match done {
        Ok(()) => ExitCode::SUCCESS,
        // One line, never a backtrace: the message says what to change.
        Err(Stop(code, message)) => {
            eprintln!("holdfast: {message}");
            ExitCode::from(code)
        }
    }
}

/// How long the runtime waits at exit for blocking work still running (DU-5a).
const RUNTIME_STOPS_WITHIN: Duration = Duration::from_secs(1);

async fn run(cli: Cli) -> Result<(), Stop> {
    if cli.version {
        return version(cli.config.as_deref()).await;
    }
    match cli.command {
        Some(Command::Serve(args)) => serve(args, cli.config.as_deref()).await,
        Some(Command::MockUpstream(args)) => {
            init_tracing(LogFormat::Text);
            if let Some(path) = &cli.config {
                // `--config` is global (and HOLDFAST_CONFIG may be set for a server): say that
                // the mock did not read it rather than let its knobs seem set (decision 166).
                tracing::warn!(
                    config = %path.display(),
                    "mock-upstream reads no configuration file; its knobs are flags \
                     (holdfast mock-upstream --help) or PATCH /_mock/config"
                );
            }
            holdfast::mock::run(args.listen, MockConfig::from(&args))
                .await
                .map_err(|e| Stop(1, format!("mock-upstream on {}: {e}", args.listen)))
        }
        Some(Command::Requests(command)) => requests(command, cli.config.as_deref()).await,
        Some(Command::Usage(args)) => {
            let query = pairs(&[
                ("since", args.since),
                ("until", args.until),
                ("group_by", args.group_by),
                ("namespace", args.namespace),
            ]);
            let client = client(&args.server, cli.config.as_deref())?;
            client
                .usage(&query, args.server.json, &mut std::io::stdout())
                .await
                .or_else(command_outcome)
        }
        None => Err(Stop(EXIT_CONFIG, "no command; see holdfast --help".into())),
    }
}

/// The server a `requests` or `usage` command reads, and its key: `--url` (or `HOLDFAST_URL`)
/// and `--api-key` (or `HOLDFAST_API_KEY`) when given; without a URL, with `--config`, the
/// address that configuration listens on (a wildcard address is read on this host) and, without
/// a key, its first admin key — never sent to a server the file does not name; else
/// `http://127.0.0.1:8080` and no key.
fn client(server: &ServerArgs, config: Option<&Path>) -> Result<holdfast::cli::Client, Stop> {
    let from_config = match config {
        Some(path) if server.url.is_none() => {
            if !path.exists() {
                return Err(Stop(
                    EXIT_CONFIG,
                    format!("--config {}: the file does not exist", path.display()),
                ));
            }
            let config = Config::load_unvalidated(Some(path))
                .map_err(|e| Stop(EXIT_CONFIG, e.to_string()))?;
            let mut addr = config.listen;
            if addr.ip().is_unspecified() {
                addr.set_ip(match addr {
                    SocketAddr::V4(_) => Ipv4Addr::LOCALHOST.into(),
                    SocketAddr::V6(_) => Ipv6Addr::LOCALHOST.into(),
                });
            }
            Some((
                format!("http://{addr}"),
                config.admin_api_keys.first().cloned(),
            ))
        }
        _ => None,
    };
    let (config_url, config_key) = from_config.unzip();
    if let Some(url) = &server.url {
        let scheme = url::Url::parse(url).map(|u| u.scheme().to_owned());
        if !matches!(scheme.as_deref(), Ok("http" | "https")) {
            // The address as given, with the scheme it lacks; another scheme's, the default.
            let example = if url.contains("://") {
                "http://127.0.0.1:8080".to_string()
            } else {
                format!("http://{url}")
            };
            return Err(Stop(
                EXIT_CONFIG,
                format!(
                    "--url (or HOLDFAST_URL) {url:?} is not an http:// or https:// URL: write it \
                     as {example}"
                ),
            ));
        }
    }
    Ok(holdfast::cli::Client {
        url: server
            .url
            .clone()
            .or(config_url)
            .unwrap_or_else(|| "http://127.0.0.1:8080".into()),
        api_key: server.api_key.clone().or(config_key.flatten()),
    })
}

/// The named values that are set, as query pairs.
fn pairs(values: &[(&str, Option<String>)]) -> Vec<(String, String)> {
    values
        .iter()
        .filter_map(|(name, value)| value.clone().map(|v| (name.to_string(), v)))
        .collect()
}

async fn requests(command: RequestsCommand, config: Option<&Path>) -> Result<(), Stop> {
    let out = &mut std::io::stdout();
    let done = match command {
        RequestsCommand::List {
            server,
            filters,
            limit,
            cursor,
        } => {
            let mut query = filters.query();
            query.extend(pairs(&[
                ("limit", limit.map(|l| l.to_string())),
                ("cursor", cursor),
            ]));
            let args = holdfast::cli::ListArgs {
                query,
                json: server.json,
            };
            client(&server, config)?.list(&args, out).await
        }
        RequestsCommand::Export {
            server,
            filters,
            format,
            after,
            limit,
            output,
        } => {
            let args = holdfast::cli::ExportArgs {
                query: filters.query(),
                format,
                after,
                limit,
                progress: true,
            };
            let client = client(&server, config)?;
            let report = &mut std::io::stderr();
            match output {
                Some(path) => {
                    let file = std::fs::File::create(&path)
                        .map_err(|e| Stop(1, format!("cannot create {}: {e}", path.display())))?;
                    let mut file = std::io::BufWriter::new(file);
                    client.export(&args, &mut file, report).await.map(drop)
                }
                None => {
                    let mut stdout = std::io::BufWriter::new(std::io::stdout().lock());
                    client.export(&args, &mut stdout, report).await.map(drop)
                }
            }
        }
        RequestsCommand::Show { server, id, body } => {
            client(&server, config)?
                .show(&id, body, server.json, out)
                .await
        }
        RequestsCommand::Tail {
            server,
            id,
            from,
            patience_secs,
        } => {
            client(&server, config)?
                .tail(
                    &id,
                    from,
                    std::time::Duration::from_secs(patience_secs),
                    server.json,
                    out,
                    &mut std::io::stderr(),
                )
                .await
        }
        RequestsCommand::Replay {
            server,
            id,
            model,
            backend,
            wait_secs,
        } => {
            let asked = pairs(&[("model", model), ("backend", backend)]);
            client(&server, config)?
                .replay(
                    &id,
                    &asked,
                    server.json,
                    std::time::Duration::from_secs(wait_secs),
                    out,
                )
                .await
        }
        RequestsCommand::Cancel { server, id } => {
            client(&server, config)?.cancel(&id, server.json, out).await
        }
    };
    done.or_else(command_outcome)
}

/// A CLI command's failure as the process's exit: 1 with its message, or a quiet success when
/// the reader of the output went away.
fn command_outcome(e: holdfast::cli::CliError) -> Result<(), Stop> {
    match e {
        holdfast::cli::CliError::OutputClosed => Ok(()),
        holdfast::cli::CliError::Failed(message) => Err(Stop(1, message)),
    }
}

/// The log goes to stderr, coloured only when that is a terminal (a file or a pipe gets plain
/// text), or as one JSON object per line; stdout is for what a command prints.
fn init_tracing(format: LogFormat) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("holdfast=info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_timer(holdfast::logging::PlainTime)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .fmt_fields(holdfast::logging::PlainFields)
            .event_format(holdfast::logging::PlainEvent::default())
            .init(),
        LogFormat::Json => builder.json().with_ansi(false).init(),
    }
}

/// `holdfast --version`: the version, and where the database the configuration names stands.
async fn version(file: Option<&std::path::Path>) -> Result<(), Stop> {
    println!("holdfast {}", env!("CARGO_PKG_VERSION"));
    // A file `serve` cannot read is a configuration it refuses, said as the checks below say
    // theirs (CLI-1); the database it would name is unknown.
    let config = match Config::load_unvalidated(file) {
        Ok(config) => config,
        Err(e) => {
            println!("configuration: serve would refuse it: {e}");
            return Ok(());
        }
    };
    let url = holdfast::store::redact_url(&config.database_url);
    match holdfast::store::schema_version(&config.database_url).await {
        Ok(v) => match v.database {
            Some(n) => println!(
                "database {url}: schema version {n} (this binary's: {})",
                v.binary
            ),
            None => println!(
                "database {url}: not created yet (this binary creates schema version {})",
                v.binary
            ),
        },
        Err(e) => println!("database {url}: cannot be read: {e}"),
    }
    // The checks `serve` makes before it starts, so that an upgrade can run the new binary's
    // `--version` against the configuration before stopping the old one (decision 104).
    match config.validate() {
        Ok(()) => println!("configuration: valid for serve"),
        Err(e) => println!("configuration: serve would refuse it: {e}"),
    }
    Ok(())
}

async fn serve(args: ServeArgs, file: Option<&std::path::Path>) -> Result<(), Stop> {
    let mut config = if args.demo {
        Config::load_over(demo_config(), file)?
    } else {
        Config::load(file)?
    };
    if let Some(listen) = args.listen {
        config.listen = listen;
    }
    init_tracing(config.log_format);
    for name in Config::unknown_env() {
        tracing::warn!(
            variable = %name,
            "ignoring {name}: it names no configuration key (docs/configuration.md)"
        );
    }
    for doubt in config
        .backends
        .iter()
        .filter_map(holdfast::config::doubtful_base_url)
    {
        tracing::warn!("{doubt}");
    }
    let listener = TcpListener::bind(config.listen).await.map_err(|e| {
        Stop(
            1,
            format!(
                "cannot listen on {}: {e}; choose another address with --listen ADDR or HOLDFAST_LISTEN",
                config.listen
            ),
        )
    })?;
    // The demo's provider, in-process on a loopback port of its own.
    let mock = if args.demo {
        let mock_listener = TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| Stop(1, format!("cannot start the demo's mock provider: {e}")))?;
        let server = MockServer::start(
            mock_listener,
            MockConfig {
                chunk_delay_ms: 40,
                ..MockConfig::default()
            },
        )
        .await
        .map_err(|e| Stop(1, format!("cannot start the demo's mock provider: {e}")))?;
        for backend in &mut config.backends {
            if backend.base_url == DEMO_MOCK_URL {
                backend.base_url = server.base_url();
            } else if backend.base_url == DEMO_MOCK_ROOT {
                backend.base_url = server.root_url();
            }
        }
        Some(server)
    } else {
        None
    };
    let database = holdfast::store::redact_url(&config.database_url);
    // What the demo's banner says of a configuration `--config` may have added to.
    let only_backend = config.backends.len() == 1;
    let needs_key = !config.namespaces.is_empty();
    let running = holdfast::app::start(config, listener).await?;
    tracing::info!(addr = %running.addr, %database, demo = args.demo, "holdfast serving");
    if let Some(mock) = &mock {
        // A banner nobody reads (stdout closed, `| head -1`) is no reason to stop serving.
        let _ = writeln!(
            std::io::stdout().lock(),
            "holdfast demo on http://{addr}\n\
             \x20 web page: http://{addr}/ui\n\
             \x20 mock provider{only}: {mock}\n\
             \x20 database: {database}\n\
             try it (send it twice: the second answer is replayed, Idempotent-Replayed: true):\n\
             \x20 curl -i http://{addr}/v1/chat/completions -H 'content-type: application/json'{key} \
             -d '{{\"model\":\"gpt-4o-mini\",\"messages\":[{{\"role\":\"user\",\"content\":\"hello\"}}]}}'",
            addr = running.addr,
            mock = mock.base_url(),
            only = if only_backend {
                " (the only backend)"
            } else {
                ""
            },
            key = if needs_key {
                " -H 'authorization: Bearer YOUR_NAMESPACE_KEY'"
            } else {
                ""
            },
        );
    }
    shutdown_signal().await;
    tracing::info!("shutting down: no new requests or leases; waiting for in-flight attempts");
    let stopped = running.shutdown().await;
    if let Some(mock) = mock {
        mock.shutdown().await;
    }
    match stopped {
        Stopped::Settled => Ok(()),
        // DU-5a: nothing recorded is lost; what was not recorded is run again elsewhere.
        Stopped::Unsettled => Err(Stop(
            1,
            "stopped with attempts unrecorded: the database did not answer within the \
             shutdown's bound (shutdown_grace_ms + workers.write_retry_secs + 2 s); their leases \
             expire and the sweep recovers them"
                .into(),
        )),
    }
}

/// Stands for the demo's mock provider in `--demo`'s configuration until it is started.
const DEMO_MOCK_URL: &str = "http://demo-mock.invalid/v1";

/// The same, for a Gemini backend, whose `base_url` has no version prefix (decision 57).
const DEMO_MOCK_ROOT: &str = "http://demo-mock.invalid";

/// `--demo`'s base configuration: its own SQLite file, the mock provider as every backend, the
/// web page at `/ui`, and example prices with stream usage asked for, so the ledger's token and
/// cost columns fill (docs/usage.md).
fn demo_config() -> Config {
    Config {
        database_url: "sqlite://holdfast-demo.db".into(),
        backends: vec![
            Backend {
                name: "mock-openai".into(),
                kind: Provider::Openai,
                base_url: DEMO_MOCK_URL.into(),
                api_key_env: None,
            },
            Backend {
                name: "mock-anthropic".into(),
                kind: Provider::Anthropic,
                base_url: DEMO_MOCK_URL.into(),
                api_key_env: None,
            },
            Backend {
                name: "mock-gemini".into(),
                kind: Provider::Gemini,
                base_url: DEMO_MOCK_ROOT.into(),
                api_key_env: None,
            },
        ],
        ui: true,
        prices: vec![
            demo_price("mock-openai", "gpt-4o-mini*", 0.15, 0.60),
            // Anthropic's cache rates against its input price: reads 0.1×, five-minute writes
            // 1.25×, one-hour writes 2× (RD-10).
            holdfast::config::Price {
                cached_input_per_mtok: Some(0.08),
                cache_write_per_mtok: Some(1.00),
                cache_write_1h_per_mtok: Some(1.60),
                ..demo_price("mock-anthropic", "claude-*", 0.80, 4.00)
            },
            demo_price("mock-gemini", "gemini-*", 0.30, 2.50),
        ],
        inject_stream_usage: true,
        ..Config::default()
    }
}

/// An example price (USD per million tokens) for the demo's mock models.
fn demo_price(backend: &str, model: &str, input: f64, output: f64) -> holdfast::config::Price {
    holdfast::config::Price {
        backend: backend.into(),
        model: model.into(),
        input_per_mtok: input,
        output_per_mtok: output,
        cached_input_per_mtok: None,
        cache_write_per_mtok: None,
        cache_write_1h_per_mtok: None,
    }
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}
