//! The `holdfast` binary: parse the command line, start tracing, hand over (SPEC CLI-1..CLI-3).

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use holdfast::config::{Backend, Config};
use holdfast::mock::{MockConfig, MockServer};
use holdfast::provider::Provider;
use tokio::net::TcpListener;
use tracing_subscriber::EnvFilter;

#[derive(Parser)]
#[command(name = "holdfast", version, about = "A durable proxy for LLM APIs")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the API and the workers.
    Serve(ServeArgs),
    /// Run a fake OpenAI + Anthropic provider for tests, demos and benchmarks.
    MockUpstream(MockArgs),
}

#[derive(Args)]
struct ServeArgs {
    /// TOML configuration file; every key can be overridden by HOLDFAST_<KEY>.
    #[arg(long)]
    config: Option<PathBuf>,
    /// No config, no network: embedded SQLite file and an in-process mock provider.
    #[arg(long)]
    demo: bool,
    /// Listen address (overrides the `listen` key).
    #[arg(long)]
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

fn main() -> anyhow::Result<()> {
    // The log goes to stderr, coloured only when that is a terminal (a file or a pipe gets
    // plain text); stdout is for what a command prints.
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("holdfast=info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        match Cli::parse().command {
            Command::Serve(args) => serve(args).await,
            Command::MockUpstream(args) => {
                holdfast::mock::run(args.listen, MockConfig::from(&args)).await?;
                Ok(())
            }
        }
    })
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let mut mock = None;
    let mut config = if args.demo {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let server = MockServer::start(
            listener,
            MockConfig {
                chunk_delay_ms: 40,
                ..MockConfig::default()
            },
        )
        .await?;
        let base = Config {
            database_url: "sqlite://holdfast-demo.db".into(),
            backends: vec![
                Backend {
                    name: "mock-openai".into(),
                    kind: Provider::Openai,
                    base_url: server.base_url(),
                    api_key_env: None,
                },
                Backend {
                    name: "mock-anthropic".into(),
                    kind: Provider::Anthropic,
                    base_url: server.base_url(),
                    api_key_env: None,
                },
            ],
            ..Config::default()
        };
        mock = Some(server);
        Config::load_over(base, args.config.as_deref())?
    } else {
        Config::load(args.config.as_deref())?
    };
    if let Some(listen) = args.listen {
        config.listen = listen;
    }
    let listener = TcpListener::bind(config.listen).await?;
    let database = holdfast::store::redact_url(&config.database_url);
    let running = holdfast::app::start(config, listener).await?;
    tracing::info!(addr = %running.addr, %database, demo = args.demo, "holdfast serving");
    if args.demo {
        println!(
            "holdfast demo on http://{addr} (mock provider inside, database holdfast-demo.db)\n\
             try:\n  curl -s http://{addr}/v1/chat/completions -H 'content-type: application/json' \
             -d '{{\"model\":\"gpt-4o-mini\",\"messages\":[{{\"role\":\"user\",\"content\":\"hello\"}}]}}'",
            addr = running.addr
        );
    }
    shutdown_signal().await;
    tracing::info!("shutting down: no new requests or leases; waiting for in-flight attempts");
    running.shutdown().await;
    if let Some(mock) = mock {
        mock.shutdown().await;
    }
    Ok(())
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
