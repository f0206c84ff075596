//! End-to-end benchmark: holdfast side by side with no proxy and a plain proxy (nginx).
//!
//! `cargo bench --bench e2e` builds the release binary, then on loopback starts the mock
//! provider (`holdfast mock-upstream`), nginx as a plain reverse proxy in front of it (skipped
//! with a message when `/usr/sbin/nginx` is not installed), and holdfast (`holdfast serve`) with a
//! fresh SQLite file per configuration, once with `sqlite_synchronous = "full"` and once with
//! `"normal"`. An in-process load generator (tokio + reqwest, keep-alive pools) measures every
//! row; `docs/benchmarks.md` lists them. Results go to `target/bench/e2e.json` and
//! `target/bench/e2e.md`, and the table is printed.
//!
//! Options (after `--`): `--quick` (smaller counts, for a smoke run), `--database-url URL` (also
//! run the holdfast rows against that database, e.g. `postgres://...`; or set
//! `HOLDFAST_BENCH_DATABASE_URL`). Every loop is bounded in count and in time.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::TcpListener as StdListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use serde_json::json;

/// Longest any one phase may run; a phase that hits it reports what it completed.
const PHASE_DEADLINE: Duration = Duration::from_secs(180);
/// Longest any one request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);
/// Mock stream shape: content pieces per answer and the delay before each.
const MOCK_CHUNKS: u32 = 20;
const MOCK_CHUNK_DELAY_MS: u64 = 5;
/// Concurrency of the throughput rows.
const THROUGHPUT_CONCURRENCY: usize = 64;
/// The 50-events/s row: the delay before each event, and what a stream may add.
const PACED_DELAY_MS: u64 = 20;
/// Largest p99 inter-event gap the 50-events/s row accepts beyond the provider's pace.
const PACED_ADDED_GAP_P99_MS: f64 = 5.0;
/// A stream whose mean gap exceeds the pace by more than this fraction fell behind.
const PACED_BEHIND: f64 = 0.10;
const NGINX: &str = "/usr/sbin/nginx";
/// Nodes of the cluster row (with a PostgreSQL `--database-url`).
const CLUSTER_NODES: usize = 3;

/// Request counts of one run.
#[derive(Clone, Copy)]
struct Counts {
    latency_warmup: usize,
    latency: usize,
    throughput: usize,
    stream_warmup: usize,
    streams: usize,
    storm: usize,
    concurrent_streams: usize,
    /// Streams over `THROUGHPUT_CONCURRENCY` connections in the stream throughput row.
    streams_c64: usize,
    /// Events per answer in the 50-events/s row, and its ladder of concurrent streams.
    paced_events: u32,
    paced_ladder: &'static [usize],
}

const FULL: Counts = Counts {
    latency_warmup: 200,
    latency: 2000,
    throughput: 20_000,
    stream_warmup: 10,
    streams: 200,
    storm: 1000,
    concurrent_streams: 1000,
    streams_c64: 2000,
    paced_events: 200,
    paced_ladder: &[100, 200, 400, 800, 1200, 1600, 2400],
};

const QUICK: Counts = Counts {
    latency_warmup: 20,
    latency: 200,
    throughput: 2000,
    stream_warmup: 2,
    streams: 20,
    storm: 200,
    concurrent_streams: 100,
    streams_c64: 256,
    paced_events: 50,
    paced_ladder: &[50, 100, 200, 400],
};

struct Options {
    counts: Counts,
    quick: bool,
    database_url: Option<String>,
    /// Only targets whose name contains one of these (all when empty).
    targets: Vec<String>,
    /// Only these row groups (all when empty): nonstream, replay, stream, storm, streams.
    rows: Vec<String>,
    /// Record a CPU profile of each holdfast process with `perf record` (`--profile`, or
    /// `--profile-dwarf` for call graphs through code built without frame pointers).
    profile: Option<&'static str>,
}

impl Options {
    fn target(&self, name: &str) -> bool {
        self.targets.is_empty() || self.targets.iter().any(|t| name.contains(t.as_str()))
    }

    fn row(&self, group: &str) -> bool {
        self.rows.is_empty() || self.rows.iter().any(|r| r == group)
    }

    /// The stream c=64 rows asked for: short prompts (`stream`), 20 KB ones (`prompts`).
    fn stream_throughput_rows(&self) -> Vec<&'static StreamRow> {
        [("stream", &SHORT_PROMPTS), ("prompts", &LONG_PROMPTS)]
            .into_iter()
            .filter(|(group, _)| self.row(group))
            .map(|(_, row)| row)
            .collect()
    }
}

fn options() -> Result<Options> {
    let mut quick = false;
    let mut database_url = std::env::var("HOLDFAST_BENCH_DATABASE_URL")
        .ok()
        .filter(|s| !s.is_empty());
    let mut targets = Vec::new();
    let mut rows = Vec::new();
    let mut profile = None;
    let list = |v: String| -> Vec<String> {
        v.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect()
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            // cargo bench passes --bench to every harness = false target.
            "--bench" => {}
            "--quick" => quick = true,
            "--database-url" => {
                database_url = Some(args.next().context("--database-url needs a value")?)
            }
            other if other.starts_with("--database-url=") => {
                database_url = Some(other["--database-url=".len()..].to_string())
            }
            "--targets" => targets = list(args.next().context("--targets needs a value")?),
            "--rows" => rows = list(args.next().context("--rows needs a value")?),
            "--profile" => profile = Some("fp"),
            "--profile-dwarf" => profile = Some("dwarf,32768"),
            "--profile-switches" => profile = Some("switches"),
            other if other.starts_with('-') => bail!(
                "unknown option {other}; options: --quick, --database-url URL \
                 (or HOLDFAST_BENCH_DATABASE_URL), --targets A,B (substrings of target names: \
                 direct, nginx, full, normal, ...), --rows A,B (nonstream, replay, stream, storm, \
                 streams, paced, prompts), --profile, --profile-dwarf or --profile-switches (perf record each holdfast process)"
            ),
            // A positional filter from `cargo bench -- NAME`: nothing to filter here.
            _ => {}
        }
    }
    Ok(Options {
        counts: if quick { QUICK } else { FULL },
        quick,
        database_url,
        targets,
        rows,
        profile,
    })
}

// ---------------------------------------------------------------------------------------------
// Results

/// One measurement, as written to `e2e.json`.
#[derive(Clone)]
struct Measurement {
    metric: &'static str,
    target: String,
    unit: &'static str,
    value: f64,
    /// How many requests or samples the value is over.
    n: Option<usize>,
    /// `/proc/loadavg` (1, 5, 15 min) when the value was taken.
    load: String,
}

#[derive(Default)]
struct Results {
    all: Vec<Measurement>,
    /// Targets in the order they were first measured (table columns).
    targets: Vec<String>,
    notes: Vec<String>,
}

impl Results {
    fn add(&mut self, metric: &'static str, target: &str, unit: &'static str, value: f64) {
        self.add_n(metric, target, unit, value, None);
    }

    /// The p50 and p99 of `sorted` (milliseconds) as two measurements named `p50` and `p99`.
    fn add_median_and_p99(
        &mut self,
        p50: &'static str,
        p99: &'static str,
        target: &str,
        sorted: &[f64],
        n: Option<usize>,
    ) {
        self.add_n(p50, target, "ms", percentile(sorted, 50.0), n);
        self.add_n(p99, target, "ms", percentile(sorted, 99.0), n);
    }

    fn add_n(
        &mut self,
        metric: &'static str,
        target: &str,
        unit: &'static str,
        value: f64,
        n: Option<usize>,
    ) {
        if !self.targets.iter().any(|t| t == target) {
            self.targets.push(target.to_string());
        }
        let m = Measurement {
            metric,
            target: target.to_string(),
            unit,
            value,
            n,
            load: loadavg(),
        };
        println!(
            "  {:<44} {:<24} {:>12} {:<6} (load {})",
            metric,
            target,
            format_value(value, unit),
            unit,
            m.load
        );
        self.all.push(m);
    }

    fn get(&self, metric: &str, target: &str) -> Option<f64> {
        self.all
            .iter()
            .find(|m| m.metric == metric && m.target == target)
            .map(|m| m.value)
    }

    fn note(&mut self, note: impl Into<String>) {
        let note = note.into();
        println!("  note: {note}");
        self.notes.push(note);
    }

    fn json(&self) -> serde_json::Value {
        serde_json::Value::Array(
            self.all
                .iter()
                .map(|m| {
                    json!({
                        "name": format!("{} [{}]", m.metric, m.target),
                        "metric": m.metric,
                        "target": m.target,
                        "unit": m.unit,
                        "value": m.value,
                        "n": m.n,
                        "load": m.load,
                    })
                })
                .collect(),
        )
    }

    fn markdown(&self, header: &str) -> String {
        let mut metrics: Vec<(&'static str, &'static str)> = Vec::new();
        for m in &self.all {
            if !metrics.iter().any(|(name, _)| *name == m.metric) {
                metrics.push((m.metric, m.unit));
            }
        }
        let mut by_cell: BTreeMap<(&str, &str), f64> = BTreeMap::new();
        for m in &self.all {
            by_cell.insert((m.metric, m.target.as_str()), m.value);
        }
        let mut out = String::new();
        let _ = writeln!(out, "{header}\n");
        let _ = write!(out, "| measurement | unit |");
        for t in &self.targets {
            let _ = write!(out, " {t} |");
        }
        let _ = write!(out, "\n|---|---|");
        for _ in &self.targets {
            let _ = write!(out, "---:|");
        }
        out.push('\n');
        for (metric, unit) in metrics {
            let _ = write!(out, "| {metric} | {unit} |");
            for t in &self.targets {
                match by_cell.get(&(metric, t.as_str())) {
                    Some(v) => {
                        let _ = write!(out, " {} |", format_value(*v, unit));
                    }
                    None => out.push_str(" |"),
                }
            }
            out.push('\n');
        }
        if !self.notes.is_empty() {
            out.push('\n');
            for n in &self.notes {
                let _ = writeln!(out, "- {n}");
            }
        }
        out
    }
}

fn format_value(v: f64, unit: &str) -> String {
    match unit {
        "ms" if v.abs() < 10.0 => format!("{v:.3}"),
        "ms" => format!("{v:.1}"),
        "ratio" => format!("{v:.2}"),
        "x" => format!("{v:.2}"),
        _ if v.fract() == 0.0 && v.abs() < 1e15 => format!("{v:.0}"),
        _ if v.abs() >= 100.0 => format!("{v:.0}"),
        _ => format!("{v:.2}"),
    }
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

/// Nearest-rank percentile of sorted samples.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn sorted_ms(samples: &[Duration]) -> Vec<f64> {
    let mut v: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    v.sort_by(f64::total_cmp);
    v
}

// ---------------------------------------------------------------------------------------------
// Child processes

/// With `--profile`: `perf record -g` attached to `pid` until the returned child is stopped,
/// written to `target/bench/<name>.perf.data` (read it with `perf report -i FILE`).
fn start_profile(options: &Options, pid: u32, out_dir: &Path, name: &str) -> Result<Option<Child>> {
    let Some(call_graph) = options.profile else {
        return Ok(None);
    };
    let file: String = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    let data = out_dir.join(format!("{file}.perf.data"));
    let mut cmd = Command::new("perf");
    // What is sampled: CPU time, or (`--profile-switches`) every time a thread leaves its CPU,
    // with the stack that made it: why the proxy's threads hand off to each other.
    let (event, frequency, call_graph) = match call_graph {
        "fp" => ("cpu-clock", "999", "fp"),
        "switches" => ("sched:sched_switch", "1", "dwarf,16384"),
        dwarf => ("cpu-clock", "299", dwarf),
    };
    cmd.args(["record", "-e", event]);
    if event == "cpu-clock" {
        cmd.args(["-F", frequency]);
    } else {
        cmd.args(["-c", frequency]);
    }
    cmd.args(["--call-graph", call_graph, "-p", &pid.to_string(), "-o"])
        .arg(&data);
    let child = spawn("perf", cmd, &out_dir.join(format!("{file}.perf.log")))?;
    println!("  profiling pid {pid} into {}", data.display());
    Ok(Some(child))
}

/// A child process killed on drop.
struct Child {
    name: String,
    child: std::process::Child,
}

impl Child {
    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGTERM, then SIGKILL after `grace`.
    fn stop(mut self, grace: Duration) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!("  {} did not stop within {grace:?}; killing it", self.name);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn free_port() -> Result<u16> {
    Ok(StdListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn spawn(name: &str, mut cmd: Command, log: &Path) -> Result<Child> {
    let out = std::fs::File::create(log)?;
    let err = out.try_clone()?;
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err))
        .spawn()
        .with_context(|| format!("starting {name}"))?;
    Ok(Child {
        name: name.to_string(),
        child,
    })
}

/// Waits until `url` answers 2xx, at most 30 s.
async fn wait_ready(
    client: &reqwest::Client,
    url: &str,
    child: &mut Child,
    log: &Path,
) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(r) = client.get(url).send().await
            && r.status().is_success()
        {
            return Ok(());
        }
        if let Ok(Some(status)) = child.child.try_wait() {
            let log = std::fs::read_to_string(log).unwrap_or_default();
            bail!(
                "{} exited with {status} before it was ready:\n{log}",
                child.name
            );
        }
        if Instant::now() > deadline {
            bail!("{} not ready at {url} after 30 s", child.name);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The environment variable that makes this binary the floor proxy: `LISTEN_PORT UPSTREAM_PORT`.
const FLOOR_ENV: &str = "HOLDFAST_BENCH_FLOOR";

/// The floor (issue 30): a tokio + hyper forwarding proxy with no log at all, on 2 worker
/// threads, a pooled keep-alive client, bodies streamed frame by frame both ways — what any
/// Rust proxy costs on this machine before it does anything of its own.
fn floor_proxy(spec: &str) -> Result<()> {
    use http_body_util::BodyExt;
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::{TokioExecutor, TokioIo};
    let (listen, upstream) = spec
        .split_once(' ')
        .context("HOLDFAST_BENCH_FLOOR: LISTEN_PORT UPSTREAM_PORT")?;
    let (listen, upstream): (u16, u16) = (listen.parse()?, upstream.parse()?);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", listen)).await?;
        let client = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(1024)
            .build_http::<hyper::body::Incoming>();
        loop {
            let (tcp, _) = listener.accept().await?;
            tcp.set_nodelay(true)?;
            let client = client.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(
                    move |mut req: hyper::Request<hyper::body::Incoming>| {
                        let client = client.clone();
                        async move {
                            let path = req
                                .uri()
                                .path_and_query()
                                .map_or("/", |p| p.as_str())
                                .to_string();
                            *req.uri_mut() = format!("http://127.0.0.1:{upstream}{path}")
                                .parse()
                                .map_err(|e| anyhow::anyhow!("{e}"))?;
                            let response = client.request(req).await?;
                            Ok::<_, anyhow::Error>(response.map(|b| b.boxed()))
                        }
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tcp), service)
                    .await;
            });
        }
    })
}

/// Starts the floor proxy (this binary with [`FLOOR_ENV`]) in front of the mock.
async fn start_floor(
    client: &reqwest::Client,
    dir: &Path,
    mock_port: u16,
) -> Result<(Child, String)> {
    let port = free_port()?;
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.env(FLOOR_ENV, format!("{port} {mock_port}"));
    let log = dir.join("floor.log");
    let mut child = spawn("floor", cmd, &log)?;
    let base = format!("http://127.0.0.1:{port}");
    wait_ready(client, &format!("{base}/_mock/calls"), &mut child, &log).await?;
    Ok((child, base))
}

/// The holdfast binary under test: this build's, or `HOLDFAST_BENCH_BIN` (an A/B run against
/// another build, each row read beside the other in one run).
fn holdfast_bin() -> PathBuf {
    std::env::var_os("HOLDFAST_BENCH_BIN").map_or_else(
        || PathBuf::from(env!("CARGO_BIN_EXE_holdfast")),
        PathBuf::from,
    )
}

async fn start_mock(client: &reqwest::Client, dir: &Path) -> Result<(Child, String)> {
    let port = free_port()?;
    // This build's mock whatever `HOLDFAST_BENCH_BIN` names: an A/B run changes the proxy only.
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_holdfast"));
    cmd.args([
        "mock-upstream",
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--chunks",
        &MOCK_CHUNKS.to_string(),
        "--chunk-delay-ms",
        &MOCK_CHUNK_DELAY_MS.to_string(),
    ])
    .env("RUST_LOG", "warn");
    let log = dir.join("mock.log");
    let mut child = spawn("mock-upstream", cmd, &log)?;
    let base = format!("http://127.0.0.1:{port}");
    wait_ready(client, &format!("{base}/_mock/calls"), &mut child, &log).await?;
    Ok((child, base))
}

async fn start_nginx(
    client: &reqwest::Client,
    dir: &Path,
    mock_port: u16,
) -> Result<(Child, String)> {
    let port = free_port()?;
    let prefix = dir.join("nginx");
    for sub in ["client_body", "proxy", "fastcgi", "uwsgi", "scgi", "logs"] {
        std::fs::create_dir_all(prefix.join(sub))?;
    }
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let p = prefix.display();
    let conf = format!(
        r#"# generated by benches/e2e.rs
{user}
worker_processes auto;
daemon off;
master_process on;
pid {p}/nginx.pid;
error_log {p}/logs/error.log warn;
worker_rlimit_nofile 16384;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {p}/client_body;
    proxy_temp_path {p}/proxy;
    fastcgi_temp_path {p}/fastcgi;
    uwsgi_temp_path {p}/uwsgi;
    scgi_temp_path {p}/scgi;
    keepalive_requests 1000000;
    keepalive_timeout 120s;
    upstream mock {{
        server 127.0.0.1:{mock_port};
        keepalive 256;
        keepalive_requests 1000000;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        client_max_body_size 64m;
        location / {{
            proxy_pass http://mock;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 300s;
        }}
    }}
}}
"#,
        user = if root { "user root;" } else { "" },
    );
    let conf_path = prefix.join("nginx.conf");
    std::fs::write(&conf_path, conf)?;
    let mut cmd = Command::new(NGINX);
    cmd.arg("-p")
        .arg(&prefix)
        .arg("-c")
        .arg(&conf_path)
        .arg("-e")
        .arg(prefix.join("logs/error.log"));
    let log = dir.join("nginx.out");
    let mut child = spawn("nginx", cmd, &log)?;
    let base = format!("http://127.0.0.1:{port}");
    wait_ready(client, &format!("{base}/_mock/calls"), &mut child, &log).await?;
    Ok((child, base))
}

/// A holdfast configuration under test.
#[derive(Clone)]
struct HoldfastSetup {
    /// Column name, e.g. `holdfast sqlite full`.
    label: String,
    database_url: Option<String>,
    synchronous: &'static str,
    /// OTLP endpoint of `[otel]`, when traces are on (issue 32: a collector that accepts and
    /// never answers).
    traces_to: Option<String>,
}

/// A collector that accepts every OTLP/HTTP export at once (an empty
/// `ExportTraceServiceResponse`), reading and dropping what it is sent: where the
/// live-collector target exports its traces. Its address.
async fn collector_sink() -> Result<std::net::SocketAddr> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(|_body: axum::body::Bytes| async {
            (
                [("content-type", "application/x-protobuf")],
                Vec::<u8>::new(),
            )
        }),
    );
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok(addr)
}

/// A collector that accepts connections and never answers (and never closes them): where the
/// dead-collector target exports its traces. Its address.
async fn black_hole() -> Result<std::net::SocketAddr> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    Ok(addr)
}

async fn start_holdfast(
    client: &reqwest::Client,
    dir: &Path,
    setup: &HoldfastSetup,
    mock_base: &str,
    tag: &str,
) -> Result<(Child, String)> {
    let port = free_port()?;
    let run_dir = dir.join(format!("holdfast-{}-{tag}", setup.label.replace(' ', "-")));
    std::fs::create_dir_all(&run_dir)?;
    let database_url = setup
        .database_url
        .clone()
        .unwrap_or_else(|| format!("sqlite://{}", run_dir.join("holdfast.db").display()));
    let config = format!(
        r#"# generated by benches/e2e.rs
listen = "127.0.0.1:{port}"
database_url = "{database_url}"
sqlite_synchronous = "{sync}"

[workers]
# Enough attempts in flight for the 1,000-concurrent-streams row.
concurrency = 1100

[[backends]]
name = "mock"
kind = "openai"
base_url = "{mock_base}/v1"
{otel}"#,
        sync = setup.synchronous,
        otel = setup
            .traces_to
            .as_ref()
            .map(|endpoint| format!("\n[otel]\nenabled = true\nendpoint = \"{endpoint}\"\n"))
            .unwrap_or_default(),
    );
    let config_path = run_dir.join("holdfast.toml");
    std::fs::write(&config_path, config)?;
    let mut cmd = Command::new(holdfast_bin());
    cmd.arg("serve")
        .arg("--config")
        .arg(&config_path)
        .current_dir(&run_dir)
        .env("RUST_LOG", "holdfast=warn");
    for (k, _) in std::env::vars() {
        if k.starts_with("HOLDFAST_") {
            cmd.env_remove(k);
        }
    }
    let log = run_dir.join("holdfast.log");
    let mut child = spawn("holdfast", cmd, &log)?;
    let base = format!("http://127.0.0.1:{port}");
    wait_ready(client, &format!("{base}/healthz"), &mut child, &log).await?;
    Ok((child, base))
}

// ---------------------------------------------------------------------------------------------
// Load generation

fn client(pool: usize) -> Result<reqwest::Client> {
    Ok(reqwest::Client::builder()
        .http1_only()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(pool)
        .pool_idle_timeout(Duration::from_secs(300))
        .timeout(REQUEST_TIMEOUT)
        .build()?)
}

/// A chat body unique to (`nonce`, `label`, `i`): every one takes holdfast's full durable path.
fn body(nonce: &str, label: &str, i: usize, stream: bool) -> String {
    prompted_body(nonce, label, i, stream, 0)
}

/// [`body`] with its message padded to about `prompt_bytes` bytes, as long conversations and
/// retrieved documents make LLM prompts.
fn prompted_body(nonce: &str, label: &str, i: usize, stream: bool, prompt_bytes: usize) -> String {
    let stream = if stream { r#","stream":true"# } else { "" };
    let padding = " lorem ipsum".repeat(prompt_bytes / 12);
    format!(
        r#"{{"model":"gpt-4o-mini","messages":[{{"role":"user","content":"bench {nonce} {label} {i}{padding}"}}]{stream}}}"#
    )
}

/// One stream-throughput row: its prompts and the names of its measurements.
struct StreamRow {
    prompt_bytes: usize,
    label: &'static str,
    writer: &'static [&'static str; 3],
    throughput: &'static str,
    first_p50: &'static str,
    first_p99: &'static str,
    cpu_per_stream: &'static str,
    cpu_per_event: &'static str,
    /// Context switches of the proxy's threads per event received.
    switches_per_event: &'static str,
    /// The row's proxy CPU split by thread, per event.
    threads: ThreadRows,
    errors: &'static str,
}

/// `stream c=64`: short prompts (about 100 bytes).
const SHORT_PROMPTS: StreamRow = StreamRow {
    prompt_bytes: 0,
    label: "stream-c64",
    writer: &[
        "stream c=64 store commits",
        "stream c=64 writes per commit",
        "stream c=64 mean commit",
    ],
    throughput: "stream c=64 throughput",
    first_p50: "stream c=64 first event p50",
    first_p99: "stream c=64 first event p99",
    cpu_per_stream: "stream c=64 proxy CPU per stream",
    cpu_per_event: "stream c=64 proxy CPU per event",
    switches_per_event: "stream c=64 proxy context switches per event",
    threads: ThreadRows {
        writer_cpu: "stream c=64 store writer CPU per event",
        runtime_cpu: "stream c=64 runtime CPU per event",
        writer_writes: "stream c=64 store writer write calls per event",
        checkpoint_cpu: "stream c=64 WAL checkpoint CPU per event",
        other_cpu: "stream c=64 other threads CPU per event",
    },
    errors: "stream c=64 errors",
};

/// `20 KB prompts c=64`: the same streams with 20 KB prompts (`--rows prompts`).
const LONG_PROMPTS: StreamRow = StreamRow {
    prompt_bytes: 20_000,
    label: "prompt-c64",
    writer: &[
        "20 KB prompts c=64 store commits",
        "20 KB prompts c=64 writes per commit",
        "20 KB prompts c=64 mean commit",
    ],
    throughput: "20 KB prompts c=64 throughput",
    first_p50: "20 KB prompts c=64 first event p50",
    first_p99: "20 KB prompts c=64 first event p99",
    cpu_per_stream: "20 KB prompts c=64 proxy CPU per stream",
    cpu_per_event: "20 KB prompts c=64 proxy CPU per event",
    switches_per_event: "20 KB prompts c=64 proxy context switches per event",
    threads: ThreadRows {
        writer_cpu: "20 KB prompts c=64 store writer CPU per event",
        runtime_cpu: "20 KB prompts c=64 runtime CPU per event",
        writer_writes: "20 KB prompts c=64 store writer write calls per event",
        checkpoint_cpu: "20 KB prompts c=64 WAL checkpoint CPU per event",
        other_cpu: "20 KB prompts c=64 other threads CPU per event",
    },
    errors: "20 KB prompts c=64 errors",
};

struct Answer {
    elapsed: Duration,
    replayed: Option<bool>,
}

/// One non-stream call; the whole body is read. Non-2xx is an error.
async fn call(client: &reqwest::Client, url: &str, body: String) -> Result<Answer> {
    let start = Instant::now();
    let response = client
        .post(url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await?;
    let status = response.status();
    let replayed = response
        .headers()
        .get("idempotent-replayed")
        .map(|v| v.as_bytes() == b"true");
    let bytes = response.bytes().await?;
    let elapsed = start.elapsed();
    if !status.is_success() {
        bail!("{status}: {}", String::from_utf8_lossy(&bytes));
    }
    Ok(Answer { elapsed, replayed })
}

/// Sequential calls (concurrency 1): `warmup` unmeasured, then `n` measured. Returns the
/// latencies and the bodies of the measured calls.
async fn sequential(
    client: &reqwest::Client,
    url: &str,
    bodies: impl Fn(usize) -> String,
    warmup: usize,
    n: usize,
) -> Result<Vec<Duration>> {
    let deadline = Instant::now() + PHASE_DEADLINE;
    for i in 0..warmup {
        call(client, url, bodies(i)).await?;
    }
    let mut samples = Vec::with_capacity(n);
    for i in warmup..warmup + n {
        if Instant::now() > deadline {
            break;
        }
        samples.push(call(client, url, bodies(i)).await?.elapsed);
    }
    Ok(samples)
}

struct Throughput {
    done: usize,
    errors: usize,
    elapsed: Duration,
    latencies: Vec<Duration>,
}

/// `n` calls spread over `concurrency` workers, each body from `bodies(i)`, call `i` to
/// `urls[i % urls.len()]` (several nodes of one cluster take turns).
async fn concurrent(
    client: &reqwest::Client,
    urls: &[String],
    bodies: Arc<dyn Fn(usize) -> String + Send + Sync>,
    concurrency: usize,
    n: usize,
) -> Throughput {
    let next = Arc::new(AtomicUsize::new(0));
    let errors = Arc::new(AtomicUsize::new(0));
    let first_error = Arc::new(std::sync::Mutex::new(None::<String>));
    let deadline = Instant::now() + PHASE_DEADLINE;
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..concurrency {
        let (client, urls, bodies) = (client.clone(), urls.to_vec(), Arc::clone(&bodies));
        let (next, errors, first_error) = (
            Arc::clone(&next),
            Arc::clone(&errors),
            Arc::clone(&first_error),
        );
        tasks.spawn(async move {
            let mut latencies = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n || Instant::now() > deadline {
                    return latencies;
                }
                match call(&client, &urls[i % urls.len()], bodies(i)).await {
                    Ok(a) => latencies.push(a.elapsed),
                    Err(e) => {
                        errors.fetch_add(1, Ordering::Relaxed);
                        first_error
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .get_or_insert(e.to_string());
                    }
                }
            }
        });
    }
    let mut latencies = Vec::new();
    while let Some(r) = tasks.join_next().await {
        latencies.extend(r.unwrap_or_default());
    }
    let elapsed = start.elapsed();
    if let Some(e) = first_error.lock().unwrap_or_else(|e| e.into_inner()).take() {
        eprintln!("  first error: {e}");
    }
    Throughput {
        done: latencies.len(),
        errors: errors.load(Ordering::Relaxed),
        elapsed,
        latencies,
    }
}

/// Timing of one streamed answer.
struct StreamTiming {
    /// From sending the request to the end of the first SSE event.
    first: Duration,
    /// Gaps between the ends of consecutive events.
    gaps: Vec<Duration>,
    events: usize,
    total: Duration,
    request_id: Option<String>,
}

/// One streamed call: counts complete SSE events (comments excluded) as they arrive.
async fn stream_call(client: &reqwest::Client, url: &str, body: String) -> Result<StreamTiming> {
    let start = Instant::now();
    let mut response = client
        .post(url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await?;
    let status = response.status();
    let request_id = response
        .headers()
        .get("holdfast-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    if !status.is_success() {
        let text = response.text().await.unwrap_or_default();
        bail!("{status}: {text}");
    }
    let mut buf: Vec<u8> = Vec::new();
    let mut times: Vec<Instant> = Vec::with_capacity(32);
    while let Some(piece) = response.chunk().await? {
        let now = Instant::now();
        buf.extend_from_slice(&piece);
        // Complete events end with a blank line.
        while let Some(end) = find_event_end(&buf) {
            let event: Vec<u8> = buf.drain(..end).collect();
            let is_comment = event
                .split(|b| *b == b'\n')
                .filter(|l| !l.is_empty() && *l != b"\r")
                .all(|l| l.starts_with(b":"));
            if !is_comment {
                times.push(now);
            }
        }
    }
    let total = start.elapsed();
    let Some(first) = times.first() else {
        bail!("stream ended without an event");
    };
    Ok(StreamTiming {
        first: *first - start,
        gaps: times.windows(2).map(|w| w[1] - w[0]).collect(),
        events: times.len(),
        total,
        request_id,
    })
}

/// Index just past the first `\n\n` (or `\r\n\r\n`) in `buf`.
fn find_event_end(buf: &[u8]) -> Option<usize> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|i| i + 2);
    let crlf = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4);
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

struct StreamStats {
    first: Vec<Duration>,
    gaps: Vec<Duration>,
    events: usize,
}

async fn sequential_streams(
    client: &reqwest::Client,
    url: &str,
    nonce: &str,
    label: &str,
    warmup: usize,
    n: usize,
) -> Result<StreamStats> {
    let deadline = Instant::now() + PHASE_DEADLINE;
    for i in 0..warmup {
        stream_call(client, url, body(nonce, label, i, true)).await?;
    }
    let mut stats = StreamStats {
        first: Vec::new(),
        gaps: Vec::new(),
        events: 0,
    };
    for i in warmup..warmup + n {
        if Instant::now() > deadline {
            break;
        }
        let t = stream_call(client, url, body(nonce, label, i, true)).await?;
        stats.first.push(t.first);
        stats.gaps.extend(t.gaps);
        stats.events += t.events;
    }
    Ok(stats)
}

// ---------------------------------------------------------------------------------------------
// Measurement helpers

async fn mock_calls(client: &reqwest::Client, mock: &str) -> Result<u64> {
    let v: serde_json::Value = client
        .get(format!("{mock}/_mock/calls"))
        .send()
        .await?
        .json()
        .await?;
    v["calls"]
        .as_u64()
        .ok_or_else(|| anyhow!("no calls in {v}"))
}

async fn mock_reset(client: &reqwest::Client, mock: &str) -> Result<()> {
    client
        .post(format!("{mock}/_mock/reset"))
        .send()
        .await?
        .error_for_status()?;
    Ok(())
}

/// `VmRSS` and `VmHWM` of `pid`, in KiB.
fn memory_kib(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    Some((
        status_field(&status, "VmRSS:")?,
        status_field(&status, "VmHWM:")?,
    ))
}

/// The number after `name` in a `/proc/.../status` text.
fn status_field(status: &str, name: &str) -> Option<u64> {
    status
        .lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<u64>().ok())
}

/// User + system CPU time of `pid` so far, in seconds.
fn cpu_secs(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Some(ticks / hz)
}

/// CPU seconds of `pid` and its child processes (nginx's workers), threads included.
fn tree_cpu_secs(pid: u32) -> Option<f64> {
    let mut total = cpu_secs(pid)?;
    for child in children(pid) {
        total += tree_cpu_secs(child).unwrap_or(0.0);
    }
    Some(total)
}

/// The child processes of `pid` (nginx's workers).
fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|c| c.parse::<u32>().ok())
        .collect()
}

/// Context switches (voluntary and not) of every thread of `pid` and of its child processes so
/// far: each is a thread that stopped to wait or was preempted, so per request or per event it
/// counts the hand-offs between threads that the CPU rows pay for.
fn tree_switches(pid: u32) -> Option<u64> {
    let mut total = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .ok()?
        .flatten()
    {
        let status = std::fs::read_to_string(task.path().join("status")).unwrap_or_default();
        total += ["voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:"]
            .iter()
            .filter_map(|name| status_field(&status, name))
            .sum::<u64>();
    }
    for child in children(pid) {
        total += tree_switches(child).unwrap_or(0);
    }
    Some(total)
}

/// Context switches of all of `pids` ([`tree_switches`]); `None` without any.
fn switches_of(pids: &[u32]) -> Option<u64> {
    sum_over(pids, tree_switches)
}

/// `of` summed over `pids`; `None` without any pid or when one has none.
fn sum_over<T: std::iter::Sum<T>>(pids: &[u32], of: fn(u32) -> Option<T>) -> Option<T> {
    pids.iter()
        .map(|&pid| of(pid))
        .sum::<Option<T>>()
        .filter(|_| !pids.is_empty())
}

/// CPU seconds of all of `pids` ([`tree_cpu_secs`]); `None` without any.
fn cpu_of(pids: &[u32]) -> Option<f64> {
    sum_over(pids, tree_cpu_secs)
}

/// One thread's CPU seconds and write calls so far (`/proc/<pid>/task/<tid>/stat` and `io`).
struct ThreadTime {
    comm: String,
    cpu: f64,
    /// `syscw`: calls of `write`, `pwrite`, `writev` and the like. For the SQLite writer, two
    /// per WAL frame (its header and its page) and one per wake-up of the runtime.
    writes: u64,
}

/// Every thread of `pids` (not of their child processes), by thread id.
fn thread_times(pids: &[u32]) -> BTreeMap<u32, ThreadTime> {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let mut threads = BTreeMap::new();
    for pid in pids {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        for task in tasks.flatten() {
            let Some(tid) = task
                .file_name()
                .to_str()
                .and_then(|t| t.parse::<u32>().ok())
            else {
                continue;
            };
            let read = |name: &str| std::fs::read_to_string(task.path().join(name)).ok();
            let (Some(comm), Some(stat)) = (read("comm"), read("stat")) else {
                continue;
            };
            let Some(rest) = stat.rfind(')').map(|at| &stat[at + 2..]) else {
                continue;
            };
            let fields: Vec<&str> = rest.split_whitespace().collect();
            let ticks: f64 = [11, 12]
                .iter()
                .filter_map(|&i| fields.get(i).and_then(|f| f.parse::<f64>().ok()))
                .sum();
            let writes = read("io")
                .and_then(|io| status_field(&io, "syscw:"))
                .unwrap_or(0);
            threads.insert(
                tid,
                ThreadTime {
                    comm: comm.trim().to_string(),
                    cpu: ticks / hz,
                    writes,
                },
            );
        }
    }
    threads
}

/// Names of the rows that split a row's proxy CPU by thread (holdfast only).
struct ThreadRows {
    /// The SQLite writer thread's CPU ([`holdfast::store::sqlite::WRITER_THREAD`]).
    writer_cpu: &'static str,
    /// The tokio worker threads' CPU.
    runtime_cpu: &'static str,
    /// The SQLite writer thread's write calls.
    writer_writes: &'static str,
    /// The WAL checkpoint thread's CPU ([`holdfast::store::sqlite::CHECKPOINT_THREAD`]).
    checkpoint_cpu: &'static str,
    /// Every other thread's CPU (the blocking pool's readers, the main thread).
    other_cpu: &'static str,
}

/// Adds the [`ThreadRows`] of one row: what the threads alive at its end spent since `before`
/// (a thread that started during the row counts from zero), per `per` requests or events, in
/// microseconds. Nothing for a target without a SQLite writer thread.
fn add_thread_rows(
    results: &mut Results,
    rows: &ThreadRows,
    target: &str,
    before: &BTreeMap<u32, ThreadTime>,
    after: &BTreeMap<u32, ThreadTime>,
    per: usize,
) {
    let (mut writer_cpu, mut runtime_cpu, mut writer_writes, mut writer_seen) =
        (0.0, 0.0, 0, false);
    let (mut checkpoint_cpu, mut other_cpu) = (0.0, 0.0);
    for (tid, now) in after {
        let (cpu, writes) = match before.get(tid) {
            Some(then) => (now.cpu - then.cpu, now.writes.saturating_sub(then.writes)),
            None => (now.cpu, now.writes),
        };
        if now.comm == holdfast::store::sqlite::WRITER_THREAD {
            writer_seen = true;
            writer_cpu += cpu;
            writer_writes += writes;
        } else if now.comm.starts_with("tokio-rt-worker") {
            runtime_cpu += cpu;
        } else if now.comm == holdfast::store::sqlite::CHECKPOINT_THREAD {
            checkpoint_cpu += cpu;
        } else {
            other_cpu += cpu;
        }
    }
    if !writer_seen {
        return;
    }
    let per = per.max(1) as f64;
    results.add_n(
        rows.writer_cpu,
        target,
        "us",
        writer_cpu * 1e6 / per,
        Some(per as usize),
    );
    results.add_n(
        rows.runtime_cpu,
        target,
        "us",
        runtime_cpu * 1e6 / per,
        Some(per as usize),
    );
    results.add_n(
        rows.writer_writes,
        target,
        "calls",
        writer_writes as f64 / per,
        Some(per as usize),
    );
    for (row, cpu) in [
        (rows.checkpoint_cpu, checkpoint_cpu),
        (rows.other_cpu, other_cpu),
    ] {
        results.add_n(row, target, "us", cpu * 1e6 / per, Some(per as usize));
    }
}

/// Values of unlabelled series on holdfast's `/metrics` (0 for one not exported yet); `None`
/// when the target has no `/metrics` (no proxy, nginx).
async fn metric_values(client: &reqwest::Client, base: &str, names: &[&str]) -> Option<Vec<f64>> {
    let response = client.get(format!("{base}/metrics")).send().await.ok()?;
    if !response.status().is_success() {
        return None;
    }
    let text = response.text().await.ok()?;
    if !text.contains("holdfast_") {
        return None;
    }
    Some(
        names
            .iter()
            .map(|name| {
                text.lines()
                    .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
                    .and_then(|l| l.split_whitespace().last())
                    .and_then(|v| v.parse::<f64>().ok())
                    .unwrap_or(0.0)
            })
            .collect(),
    )
}

/// The store writer's transactions and the store writes they held (see `/metrics`): SQLite's
/// writer thread, or PostgreSQL's writer tasks (whose chunk appends run apart, on a connection
/// of their own, and are not in these). A process has one store, so the other's are 0.
const WRITER_SERIES: [&str; 6] = [
    "holdfast_sqlite_commit_jobs_count",
    "holdfast_sqlite_commit_jobs_sum",
    "holdfast_sqlite_commit_seconds_sum",
    "holdfast_postgres_commit_jobs_count",
    "holdfast_postgres_commit_jobs_sum",
    "holdfast_postgres_commit_seconds_sum",
];

/// Rows of the store writer's work between two [`WRITER_SERIES`] readings: transactions,
/// store writes per transaction, mean transaction time.
fn writer_rows(
    results: &mut Results,
    names: &'static [&'static str; 3],
    target: &str,
    before: Option<Vec<f64>>,
    after: Option<Vec<f64>>,
) {
    let (Some(a), Some(b)) = (before, after) else {
        return;
    };
    let d: Vec<f64> = b.iter().zip(&a).map(|(b, a)| b - a).collect();
    let (commits, writes, seconds) = (d[0] + d[3], d[1] + d[4], d[2] + d[5]);
    if commits <= 0.0 {
        return;
    }
    results.add(names[0], target, "commits", commits);
    results.add(names[1], target, "writes", writes / commits);
    results.add(names[2], target, "ms", seconds * 1e3 / commits);
}

/// Sum and count of the chunk-commit histogram in holdfast's `/metrics`.
async fn commit_histogram(client: &reqwest::Client, base: &str) -> Option<(f64, f64)> {
    let names = [
        "holdfast_chunk_commit_seconds_sum",
        "holdfast_chunk_commit_seconds_count",
    ];
    let v = metric_values(client, base, &names).await?;
    Some((v[0], v[1]))
}

fn chat_url(base: &str) -> String {
    format!("{base}/v1/chat/completions")
}

// ---------------------------------------------------------------------------------------------
// Rows

/// Non-stream latency at concurrency 1 (on the first of `bases`), then throughput at
/// concurrency 64 spread over all of them, for one target whose processes are `pids`.
async fn nonstream_rows(
    results: &mut Results,
    client: &reqwest::Client,
    target: &str,
    bases: &[String],
    nonce: &str,
    counts: Counts,
    pids: &[u32],
) -> Result<()> {
    let base = bases[0].as_str();
    let url = chat_url(base);
    let urls: Vec<String> = bases.iter().map(|b| chat_url(b)).collect();
    let label = format!("lat-{target}");
    let samples = sequential(
        client,
        &url,
        |i| body(nonce, &label, i, false),
        counts.latency_warmup,
        counts.latency,
    )
    .await?;
    let ms = sorted_ms(&samples);
    results.add_median_and_p99(
        "non-stream c=1 p50",
        "non-stream c=1 p99",
        target,
        &ms,
        Some(ms.len()),
    );

    let label = format!("tput-{target}");
    let nonce = nonce.to_string();
    // Warm the pool to 64 connections first.
    let warm_label = format!("tput-warm-{target}");
    let warm_nonce = nonce.clone();
    concurrent(
        client,
        &urls,
        Arc::new(move |i| body(&warm_nonce, &warm_label, i, false)),
        THROUGHPUT_CONCURRENCY,
        THROUGHPUT_CONCURRENCY * 4,
    )
    .await;
    let writer_before = metric_values(client, base, &WRITER_SERIES).await;
    let cpu_before = cpu_of(pids);
    let switches_before = switches_of(pids);
    let threads_before = thread_times(pids);
    let t = concurrent(
        client,
        &urls,
        Arc::new(move |i| body(&nonce, &label, i, false)),
        THROUGHPUT_CONCURRENCY,
        counts.throughput,
    )
    .await;
    let threads_after = thread_times(pids);
    let writer_after = metric_values(client, base, &WRITER_SERIES).await;
    add_thread_rows(
        results,
        &ThreadRows {
            writer_cpu: "non-stream c=64 store writer CPU per request",
            runtime_cpu: "non-stream c=64 runtime CPU per request",
            writer_writes: "non-stream c=64 store writer write calls per request",
            checkpoint_cpu: "non-stream c=64 WAL checkpoint CPU per request",
            other_cpu: "non-stream c=64 other threads CPU per request",
        },
        target,
        &threads_before,
        &threads_after,
        t.done,
    );
    writer_rows(
        results,
        &[
            "non-stream c=64 store commits",
            "non-stream c=64 writes per commit",
            "non-stream c=64 mean commit",
        ],
        target,
        writer_before,
        writer_after,
    );
    if let (Some(a), Some(b)) = (cpu_before, cpu_of(pids)) {
        results.add(
            "non-stream c=64 proxy CPU per request",
            target,
            "ms",
            (b - a) / t.done.max(1) as f64 * 1e3,
        );
    }
    if let (Some(a), Some(b)) = (switches_before, switches_of(pids)) {
        results.add(
            "non-stream c=64 proxy context switches per request",
            target,
            "switches",
            (b - a) as f64 / t.done.max(1) as f64,
        );
    }
    let rps = t.done as f64 / t.elapsed.as_secs_f64();
    results.add_n(
        "non-stream c=64 throughput",
        target,
        "req/s",
        rps,
        Some(t.done),
    );
    let ms = sorted_ms(&t.latencies);
    results.add_n(
        "non-stream c=64 p99",
        target,
        "ms",
        percentile(&ms, 99.0),
        Some(ms.len()),
    );
    if t.errors > 0 || t.done < counts.throughput {
        results.note(format!(
            "{target}: throughput row completed {} of {} requests with {} errors",
            t.done, counts.throughput, t.errors
        ));
    }
    Ok(())
}

/// Time to first event and gaps between events of streamed answers at concurrency 1.
async fn stream_rows(
    results: &mut Results,
    client: &reqwest::Client,
    target: &str,
    base: &str,
    nonce: &str,
    counts: Counts,
) -> Result<()> {
    let s = sequential_streams(
        client,
        &chat_url(base),
        nonce,
        &format!("stream-{target}"),
        counts.stream_warmup,
        counts.streams,
    )
    .await?;
    let first = sorted_ms(&s.first);
    let gaps = sorted_ms(&s.gaps);
    let n = Some(first.len());
    results.add_median_and_p99(
        "stream first event p50",
        "stream first event p99",
        target,
        &first,
        n,
    );
    let g = Some(gaps.len());
    results.add_median_and_p99(
        "stream inter-event gap p50",
        "stream inter-event gap p99",
        target,
        &gaps,
        g,
    );
    results.add_n(
        "stream events per answer",
        target,
        "events",
        s.events as f64 / first.len().max(1) as f64,
        n,
    );
    Ok(())
}

/// Replays: the latency row's bodies sent again (each a finished request) at c=1 and c=64.
/// Streams over [`THROUGHPUT_CONCURRENCY`] connections: streams per second, the first event,
/// and with `pid` the proxy's CPU per stream and per event.
async fn stream_throughput_row(
    results: &mut Results,
    target: &str,
    bases: &[String],
    nonce: &str,
    counts: Counts,
    pids: &[u32],
    row: &StreamRow,
) -> Result<()> {
    let client = client(THROUGHPUT_CONCURRENCY + 16)?;
    let base = bases[0].as_str();
    let urls: Vec<String> = bases.iter().map(|b| chat_url(b)).collect();
    let n = counts.streams_c64;
    let next = Arc::new(AtomicUsize::new(0));
    let deadline = Instant::now() + PHASE_DEADLINE;
    let writer_before = metric_values(&client, base, &WRITER_SERIES).await;
    let cpu_before = cpu_of(pids);
    let switches_before = switches_of(pids);
    let threads_before = thread_times(pids);
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..THROUGHPUT_CONCURRENCY {
        let (client, urls, next) = (client.clone(), urls.clone(), Arc::clone(&next));
        let label = format!("{}-{target}", row.label);
        let nonce = nonce.to_string();
        let prompt_bytes = row.prompt_bytes;
        tasks.spawn(async move {
            let mut done = Vec::new();
            let mut errors = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n || Instant::now() > deadline {
                    return (done, errors);
                }
                let url = &urls[i % urls.len()];
                let body = prompted_body(&nonce, &label, i, true, prompt_bytes);
                match stream_call(&client, url, body).await {
                    Ok(t) => done.push(t),
                    Err(e) => errors.push(e.to_string()),
                }
            }
        });
    }
    let mut timings = Vec::new();
    let mut errors = Vec::new();
    while let Some(r) = tasks.join_next().await {
        let (done, failed) = r.unwrap_or_default();
        timings.extend(done);
        errors.extend(failed);
    }
    let elapsed = start.elapsed();
    let cpu = cpu_before.zip(cpu_of(pids)).map(|(a, b)| b - a);
    let switches = switches_before.zip(switches_of(pids)).map(|(a, b)| b - a);
    let threads_after = thread_times(pids);
    let writer_after = metric_values(&client, base, &WRITER_SERIES).await;
    if let Some(e) = errors.first() {
        eprintln!("  {} stream errors; first: {e}", errors.len());
    }
    let events: usize = timings.iter().map(|t| t.events).sum();
    let streams = timings.len();
    writer_rows(results, row.writer, target, writer_before, writer_after);
    results.add_n(
        row.throughput,
        target,
        "streams/s",
        streams as f64 / elapsed.as_secs_f64(),
        Some(streams),
    );
    let firsts = sorted_ms(&timings.iter().map(|t| t.first).collect::<Vec<_>>());
    results.add_median_and_p99(row.first_p50, row.first_p99, target, &firsts, Some(streams));
    if let Some(cpu) = cpu {
        results.add_n(
            row.cpu_per_stream,
            target,
            "ms",
            cpu * 1e3 / streams.max(1) as f64,
            Some(streams),
        );
        results.add_n(
            row.cpu_per_event,
            target,
            "us",
            cpu * 1e6 / events.max(1) as f64,
            Some(events),
        );
    }
    add_thread_rows(
        results,
        &row.threads,
        target,
        &threads_before,
        &threads_after,
        events,
    );
    if let Some(switches) = switches {
        results.add_n(
            row.switches_per_event,
            target,
            "switches",
            switches as f64 / events.max(1) as f64,
            Some(events),
        );
    }
    if !errors.is_empty() {
        results.add_n(row.errors, target, "streams", errors.len() as f64, None);
    }
    Ok(())
}

/// What one rung of the 50-events/s ladder saw.
struct PacedRung {
    /// p99 inter-event gap, milliseconds.
    gap_p99: f64,
    /// Streams whose mean gap fell more than [`PACED_BEHIND`] behind the pace.
    behind: usize,
    failed: usize,
}

/// Cumulative counts of SQLite commits that took at most 2, 5 and 20 ms, and all of them, from
/// holdfast's `/metrics` (`None` for a target without them).
async fn commit_tail(client: &reqwest::Client, base: &str) -> Option<Vec<f64>> {
    let names = [
        r#"holdfast_sqlite_commit_seconds_bucket{le="0.002"}"#,
        r#"holdfast_sqlite_commit_seconds_bucket{le="0.005"}"#,
        r#"holdfast_sqlite_commit_seconds_bucket{le="0.02"}"#,
        r#"holdfast_sqlite_commit_seconds_bucket{le="+Inf"}"#,
    ];
    metric_values(client, base, &names)
        .await
        .filter(|v| v[3] > 0.0)
}

/// LLM-like streams: the mock paced at one event per [`PACED_DELAY_MS`] (50 events/s) for
/// `paced_events` events; `n` streams at once, their starts spread over one second.
async fn paced_rung(base: &str, nonce: &str, target: &str, n: usize) -> Result<PacedRung> {
    let client = client(n + 16)?;
    let tail_before = commit_tail(&client, base).await;
    let url = chat_url(base);
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..n {
        let (client, url) = (client.clone(), url.clone());
        let b = body(nonce, &format!("paced-{target}-{n}"), i, true);
        let offset = Duration::from_millis((i as u64 * 1000) / n as u64);
        tasks.spawn(async move {
            tokio::time::sleep(offset).await;
            tokio::time::timeout(PHASE_DEADLINE, stream_call(&client, &url, b))
                .await
                .map_err(|_| anyhow!("stream not done within {PHASE_DEADLINE:?}"))
                .and_then(|r| r)
        });
    }
    let mut gaps = Vec::new();
    let (mut behind, mut failed) = (0, 0);
    let pace = Duration::from_millis(PACED_DELAY_MS).as_secs_f64();
    while let Some(r) = tasks.join_next().await {
        match r.map_err(anyhow::Error::from).and_then(|r| r) {
            Ok(t) if !t.gaps.is_empty() => {
                let mean =
                    t.gaps.iter().map(Duration::as_secs_f64).sum::<f64>() / t.gaps.len() as f64;
                if mean > pace * (1.0 + PACED_BEHIND) {
                    behind += 1;
                }
                gaps.extend(t.gaps);
            }
            _ => failed += 1,
        }
    }
    if let (Some(a), Some(b)) = (tail_before, commit_tail(&client, base).await) {
        let d: Vec<f64> = a.iter().zip(&b).map(|(a, b)| b - a).collect();
        println!(
            "    SQLite commits during the rung: {}, over 2 ms: {}, over 5 ms: {}, over 20 ms: {}",
            d[3],
            d[3] - d[0],
            d[3] - d[1],
            d[3] - d[2]
        );
    }
    let gaps = sorted_ms(&gaps);
    Ok(PacedRung {
        gap_p99: percentile(&gaps, 99.0),
        behind,
        failed,
    })
}

/// The 50-events/s row (the headline for LLM traffic): the largest number of concurrent
/// streams, up the ladder, at which the p99 inter-event gap stays within
/// [`PACED_ADDED_GAP_P99_MS`] of the pace and no stream falls behind.
async fn paced_row(
    results: &mut Results,
    target: &str,
    base: &str,
    mock: &str,
    nonce: &str,
    counts: Counts,
) -> Result<()> {
    let control = client(4)?;
    let pace = |chunks: u32, delay: u64| {
        let control = control.clone();
        async move {
            control
                .patch(format!("{mock}/_mock/config"))
                .json(&json!({"chunks": chunks, "chunk_delay_ms": delay}))
                .send()
                .await?
                .error_for_status()?;
            anyhow::Ok(())
        }
    };
    pace(counts.paced_events, PACED_DELAY_MS).await?;
    let mut best: Option<(usize, f64)> = None;
    let mut outcome = Ok(());
    for &n in counts.paced_ladder {
        let rung = match paced_rung(base, nonce, target, n).await {
            Ok(rung) => rung,
            Err(e) => {
                outcome = Err(e);
                break;
            }
        };
        let added = rung.gap_p99 - PACED_DELAY_MS as f64;
        println!(
            "  50 ev/s, {n} streams: gap p99 {:.2} ms (+{added:.2}), {} behind, {} failed",
            rung.gap_p99, rung.behind, rung.failed
        );
        if added > PACED_ADDED_GAP_P99_MS || rung.behind > 0 || rung.failed > 0 {
            break;
        }
        best = Some((n, rung.gap_p99));
    }
    pace(MOCK_CHUNKS, MOCK_CHUNK_DELAY_MS).await?;
    outcome?;
    let (n, gap) = best.unwrap_or((0, f64::NAN));
    results.add_n("50 ev/s streams held", target, "streams", n as f64, None);
    results.add_n("50 ev/s gap p99 at that N", target, "ms", gap, None);
    Ok(())
}

async fn replay_rows(
    results: &mut Results,
    client: &reqwest::Client,
    target: &str,
    base: &str,
    mock: &str,
    nonce: &str,
    counts: Counts,
) -> Result<()> {
    let url = chat_url(base);
    let label = format!("lat-{target}");
    let before = mock_calls(client, mock).await?;
    let deadline = Instant::now() + PHASE_DEADLINE;
    let mut samples = Vec::with_capacity(counts.latency);
    let mut fresh = 0;
    for i in counts.latency_warmup..counts.latency_warmup + counts.latency {
        if Instant::now() > deadline {
            break;
        }
        let a = call(client, &url, body(nonce, &label, i, false)).await?;
        if a.replayed != Some(true) {
            fresh += 1;
        }
        samples.push(a.elapsed);
    }
    let ms = sorted_ms(&samples);
    results.add_median_and_p99(
        "replay c=1 p50",
        "replay c=1 p99",
        target,
        &ms,
        Some(ms.len()),
    );
    let (owned, label2) = (nonce.to_string(), label.clone());
    let warmup = counts.latency_warmup;
    let replays = counts.latency;
    let t = concurrent(
        client,
        std::slice::from_ref(&url),
        Arc::new(move |i| body(&owned, &label2, warmup + i % replays, false)),
        THROUGHPUT_CONCURRENCY,
        counts.throughput,
    )
    .await;
    results.add_n(
        "replay c=64 throughput",
        target,
        "req/s",
        t.done as f64 / t.elapsed.as_secs_f64(),
        Some(t.done),
    );
    let calls = mock_calls(client, mock).await? - before;
    results.add("replay upstream calls", target, "calls", calls as f64);
    // DU-6: the bookkeeping of those replays never holds up the next new call.
    let after = call(
        client,
        &url,
        body(nonce, &format!("after-{target}"), 0, false),
    )
    .await?;
    results.add(
        "new call right after replay c=64",
        target,
        "ms",
        after.elapsed.as_secs_f64() * 1000.0,
    );
    // nginx and the floor pass every call through: their rows are plain-proxy baselines.
    if (fresh > 0 && target != "nginx" && target != "floor") || t.errors > 0 {
        results.note(format!(
            "{target}: {fresh} replays were not answered as replays; {} errors at c=64",
            t.errors
        ));
    }
    Ok(())
}

/// 1,000 concurrent identical non-stream requests: upstream calls and latency.
async fn storm_row(
    results: &mut Results,
    target: &str,
    base: &str,
    mock: &str,
    nonce: &str,
    counts: Counts,
) -> Result<()> {
    let client = client(counts.storm + 16)?;
    let url = chat_url(base);
    mock_reset(&client, mock).await?;
    let the_body = body(nonce, &format!("storm-{target}"), 0, false);
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..counts.storm {
        let (client, url, b) = (client.clone(), url.clone(), the_body.clone());
        tasks.spawn(async move { call(&client, &url, b).await });
    }
    let mut latencies = Vec::new();
    let mut errors = 0;
    let mut first_error = None;
    let mut started_execution = 0;
    while let Some(r) = tasks.join_next().await {
        match r.map_err(anyhow::Error::from).and_then(|r| r) {
            Ok(a) => {
                if a.replayed == Some(false) {
                    started_execution += 1;
                }
                latencies.push(a.elapsed);
            }
            Err(e) => {
                errors += 1;
                first_error.get_or_insert(e.to_string());
            }
        }
    }
    let wall = start.elapsed();
    let calls = mock_calls(&client, mock).await?;
    results.add_n(
        "storm upstream calls",
        target,
        "calls",
        calls as f64,
        Some(counts.storm),
    );
    let ms = sorted_ms(&latencies);
    results.add_median_and_p99("storm p50", "storm p99", target, &ms, Some(ms.len()));
    results.add("storm wall time", target, "ms", wall.as_secs_f64() * 1e3);
    if target.starts_with("holdfast") {
        results.add(
            "storm answers that started the execution",
            target,
            "answers",
            f64::from(started_execution),
        );
    }
    if errors > 0 {
        results.note(format!(
            "{target}: storm had {errors} errors; first: {}",
            first_error.unwrap_or_default()
        ));
    }
    Ok(())
}

/// `counts.concurrent_streams` streams at once: events received, chunks stored per second,
/// and (for holdfast) peak memory.
async fn many_streams_row(
    results: &mut Results,
    target: &str,
    base: &str,
    nonce: &str,
    counts: Counts,
    pid: Option<u32>,
) -> Result<()> {
    let n = counts.concurrent_streams;
    let client = client(n + 16)?;
    let url = chat_url(base);
    // Before the first commit the histogram is not exported yet: zero.
    let commits_before = pid.map(|_| (0.0, 0.0));
    let commits_before = match commits_before {
        Some(zero) => Some(commit_histogram(&client, base).await.unwrap_or(zero)),
        None => None,
    };
    // Memory sampler.
    let stop = Arc::new(AtomicUsize::new(0));
    let peak_rss = Arc::new(AtomicU64::new(0));
    let sampler = pid.map(|pid| {
        let (stop, peak) = (Arc::clone(&stop), Arc::clone(&peak_rss));
        tokio::spawn(async move {
            while stop.load(Ordering::Relaxed) == 0 {
                if let Some((rss, _)) = memory_kib(pid) {
                    peak.fetch_max(rss, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    });
    let rss_before = pid.and_then(memory_kib).map(|(rss, _)| rss);
    let cpu_before = pid.and_then(cpu_secs);
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..n {
        let (client, url) = (client.clone(), url.clone());
        let b = body(nonce, &format!("many-{target}"), i, true);
        tasks.spawn(async move {
            tokio::time::timeout(PHASE_DEADLINE, stream_call(&client, &url, b))
                .await
                .map_err(|_| anyhow!("stream not done within {PHASE_DEADLINE:?}"))
                .and_then(|r| r)
        });
    }
    let mut events = 0usize;
    let mut ids = Vec::new();
    let mut gaps = Vec::new();
    let mut totals = Vec::new();
    let mut firsts = Vec::new();
    let mut errors = 0;
    let mut first_error = None;
    while let Some(r) = tasks.join_next().await {
        match r.map_err(anyhow::Error::from).and_then(|r| r) {
            Ok(t) => {
                events += t.events;
                firsts.push(t.first);
                gaps.extend(t.gaps);
                totals.push(t.total);
                ids.extend(t.request_id);
            }
            Err(e) => {
                errors += 1;
                first_error.get_or_insert(e.to_string());
            }
        }
    }
    let wall = start.elapsed();
    let cpu = cpu_before.zip(pid.and_then(cpu_secs)).map(|(a, b)| b - a);
    stop.store(1, Ordering::Relaxed);
    if let Some(s) = sampler {
        let _ = s.await;
    }
    results.add_n(
        "1k streams wall time",
        target,
        "ms",
        wall.as_secs_f64() * 1e3,
        Some(n),
    );
    results.add_n(
        "1k streams events received/s",
        target,
        "events/s",
        events as f64 / wall.as_secs_f64(),
        Some(events),
    );
    let gaps = sorted_ms(&gaps);
    results.add_n(
        "1k streams inter-event gap p99",
        target,
        "ms",
        percentile(&gaps, 99.0),
        Some(gaps.len()),
    );
    let firsts = sorted_ms(&firsts);
    results.add_median_and_p99(
        "1k streams first event p50",
        "1k streams first event p99",
        target,
        &firsts,
        Some(firsts.len()),
    );
    let totals = sorted_ms(&totals);
    results.add_n(
        "1k streams duration p99",
        target,
        "ms",
        percentile(&totals, 99.0),
        Some(totals.len()),
    );
    if let Some(pid) = pid {
        // Stored chunks: the sum of last_seq (each answer's events plus its `end` chunk).
        let mut stored = 0i64;
        for id in &ids {
            let v: serde_json::Value = client
                .get(format!("{base}/requests/{id}"))
                .send()
                .await?
                .json()
                .await?;
            stored += v["last_seq"].as_i64().unwrap_or(0);
        }
        results.add_n(
            "1k streams stored chunks/s",
            target,
            "chunks/s",
            stored as f64 / wall.as_secs_f64(),
            Some(stored as usize),
        );
        if let Some(cpu) = cpu {
            results.add(
                "1k streams proxy CPU per stored chunk",
                target,
                "ms",
                cpu / stored.max(1) as f64 * 1e3,
            );
        }
        let peak = peak_rss.load(Ordering::Relaxed);
        results.add("1k streams peak RSS", target, "MB", peak as f64 / 1024.0);
        if let Some(before) = rss_before {
            results.add(
                "RSS before 1k streams",
                target,
                "MB",
                before as f64 / 1024.0,
            );
        }
        if let Some((_, hwm)) = memory_kib(pid) {
            results.add("VmHWM after 1k streams", target, "MB", hwm as f64 / 1024.0);
        }
        if let (Some((s0, c0)), Some((s1, c1))) =
            (commits_before, commit_histogram(&client, base).await)
        {
            let commits = c1 - c0;
            results.add("1k streams chunk commits", target, "commits", commits);
            if commits > 0.0 {
                results.add(
                    "1k streams mean chunk commit",
                    target,
                    "ms",
                    (s1 - s0) / commits * 1e3,
                );
                results.add(
                    "1k streams chunks per commit",
                    target,
                    "chunks",
                    stored as f64 / commits,
                );
            }
        }
    }
    if errors > 0 {
        results.note(format!(
            "{target}: {errors} of {n} concurrent streams failed; first: {}",
            first_error.unwrap_or_default()
        ));
    }
    Ok(())
}

/// Differences and ratios between targets, computed from the measured rows.
/// The non-stream and stream c=64 rows of `CLUSTER_NODES` holdfast processes sharing one
/// database: each call goes to the next node in turn, CPU is the sum over the nodes. On one
/// small machine this shows what a cluster costs, not how it scales (docs/postgres.md models
/// that).
#[allow(clippy::too_many_arguments)]
async fn cluster_rows(
    results: &mut Results,
    control: &reqwest::Client,
    dir: &Path,
    setup: &HoldfastSetup,
    mock: &str,
    nonce: &str,
    counts: Counts,
    options: &Options,
) -> Result<()> {
    let target = setup.label.as_str();
    let mut nodes = Vec::new();
    for n in 0..CLUSTER_NODES {
        nodes.push(start_holdfast(control, dir, setup, mock, &format!("node{n}")).await?);
    }
    let bases: Vec<String> = nodes.iter().map(|(_, b)| b.clone()).collect();
    let pids: Vec<u32> = nodes.iter().map(|(c, _)| c.pid()).collect();
    println!("\n== {target} ({}, pids {pids:?})", bases.join(", "));
    let c = client(THROUGHPUT_CONCURRENCY + 16)?;
    if options.row("nonstream") {
        nonstream_rows(results, &c, target, &bases, nonce, counts, &pids).await?;
    }
    if options.row("stream") {
        stream_throughput_row(
            results,
            target,
            &bases,
            nonce,
            counts,
            &pids,
            &SHORT_PROMPTS,
        )
        .await?;
    }
    for (child, _) in nodes {
        child.stop(Duration::from_secs(40));
    }
    Ok(())
}

/// A proxy with no log in front of the mock: nginx, or the floor.
struct PlainProxy<'a> {
    name: &'static str,
    pid: u32,
    base: &'a str,
    mock: &'a str,
}

/// The rows a plain proxy runs (every row group but the holdfast-only ones).
async fn plain_proxy_rows(
    results: &mut Results,
    options: &Options,
    proxy: &PlainProxy<'_>,
    nonce: &str,
    counts: Counts,
) -> Result<()> {
    let (name, base, mock) = (proxy.name, proxy.base, proxy.mock);
    let c = client(THROUGHPUT_CONCURRENCY + 16)?;
    let pids = [proxy.pid];
    let bases = [base.to_string()];
    if options.row("nonstream") {
        nonstream_rows(results, &c, name, &bases, nonce, counts, &pids).await?;
        if options.row("replay") {
            replay_rows(results, &c, name, base, mock, nonce, counts).await?;
        }
    }
    if options.row("stream") {
        stream_rows(results, &c, name, base, nonce, counts).await?;
    }
    for row in options.stream_throughput_rows() {
        stream_throughput_row(results, name, &bases, nonce, counts, &pids, row).await?;
    }
    if options.row("paced") {
        paced_row(results, name, base, mock, nonce, counts).await?;
    }
    if options.row("streams") {
        // No log to read the stored chunks from, no /metrics: the client-side measures only.
        many_streams_row(results, name, base, nonce, counts, None).await?;
    }
    Ok(())
}

fn derived(results: &mut Results, proxies: &[String]) {
    let direct = "direct";
    for p in proxies {
        for (src, dst) in [
            ("non-stream c=1 p50", "added latency c=1 p50"),
            ("non-stream c=1 p99", "added latency c=1 p99"),
            ("stream first event p50", "added first-event latency p50"),
            ("stream first event p99", "added first-event latency p99"),
            ("stream inter-event gap p50", "added inter-event gap p50"),
            ("stream inter-event gap p99", "added inter-event gap p99"),
        ] {
            if let (Some(a), Some(b)) = (results.get(src, p), results.get(src, direct)) {
                results.add(dst, p, "ms", a - b);
            }
        }
        if let (Some(a), Some(b)) = (
            results.get("stream c=64 first event p50", p),
            results.get("stream c=64 first event p50", direct),
        ) {
            results.add("added first-event latency c=64 p50", p, "ms", a - b);
        }
        let t = "non-stream c=64 throughput";
        if let (Some(a), Some(b)) = (results.get(t, p), results.get(t, direct)) {
            results.add("throughput / direct", p, "ratio", a / b);
        }
        if p != "nginx" {
            for (src, dst) in [
                ("non-stream c=64 throughput", "throughput / nginx"),
                ("replay c=64 throughput", "replay throughput / nginx"),
                ("stream c=64 throughput", "stream throughput / nginx"),
                ("50 ev/s streams held", "50 ev/s streams held / nginx"),
            ] {
                if let (Some(a), Some(b)) = (results.get(src, p), results.get(src, "nginx")) {
                    results.add(dst, p, "ratio", a / b);
                }
            }
        }
        // Against the floor (issue 30's targets are ratios to it).
        if p != "floor" && p != "nginx" {
            for (src, dst, unit) in [
                ("non-stream c=64 throughput", "throughput / floor", "ratio"),
                (
                    "stream c=64 throughput",
                    "stream throughput / floor",
                    "ratio",
                ),
                (
                    "replay c=64 throughput",
                    "replay throughput / floor",
                    "ratio",
                ),
                (
                    "stream c=64 proxy CPU per event",
                    "CPU per event / floor",
                    "ratio",
                ),
                (
                    "non-stream c=64 proxy CPU per request",
                    "CPU per request − floor",
                    "ms",
                ),
                (
                    "1k streams wall time",
                    "1k streams wall time / floor",
                    "ratio",
                ),
                (
                    "stream c=64 first event p50",
                    "stream c=64 first event p50 − floor",
                    "ms",
                ),
            ] {
                if let (Some(a), Some(b)) = (results.get(src, p), results.get(src, "floor")) {
                    let v = if unit == "ms" { a - b } else { a / b };
                    results.add(dst, p, unit, v);
                }
            }
        }
        // PostgreSQL against the embedded default (issue 17's goal: at least half).
        if p.contains("postgres") {
            for (src, dst) in [
                ("non-stream c=64 throughput", "throughput / sqlite full"),
                ("stream c=64 throughput", "stream throughput / sqlite full"),
            ] {
                let full = results.get(src, "holdfast sqlite full");
                if let (Some(a), Some(b)) = (results.get(src, p), full) {
                    results.add(dst, p, "ratio", a / b);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Machine

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| "?".into());
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
        })
        .map_or_else(
            || "?".into(),
            |kib| format!("{:.1} GiB", kib as f64 / 1048576.0),
        );
    let nproc = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{nproc} CPUs ({cpu}), {mem} memory")
}

/// Raises the soft open-file limit to the hard one (children inherit it).
fn raise_nofile() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid pointer to a local.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
            libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        }
    }
    lim.rlim_cur
}

// ---------------------------------------------------------------------------------------------

fn main() -> Result<()> {
    // The floor target is this binary run again as a plain tokio + hyper proxy (issue 30).
    if let Ok(spec) = std::env::var(FLOOR_ENV) {
        return floor_proxy(&spec);
    }
    let options = options()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(run(options))
}

async fn run(options: Options) -> Result<()> {
    let counts = options.counts;
    let nofile = raise_nofile();
    let needed = (counts.concurrent_streams.max(counts.storm) * 2 + 256) as u64;
    if nofile < needed {
        bail!(
            "open-file limit is {nofile}; this benchmark needs about {needed} \
             (raise it with `ulimit -n {needed}`)"
        );
    }
    let out_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/bench");
    std::fs::create_dir_all(&out_dir)?;
    let dir = tempfile::tempdir()?;
    let nonce = format!(
        "{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_millis()
    );
    let started_load = loadavg();
    println!(
        "holdfast e2e benchmark{}",
        if options.quick { " (--quick)" } else { "" }
    );
    println!(
        "machine: {}; load {started_load}; open files {nofile}",
        machine()
    );

    let control = client(64)?;
    let (mock_child, mock) = start_mock(&control, dir.path()).await?;
    let mock_port: u16 = mock
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    let mut results = Results::default();

    // No proxy.
    if options.target("direct") {
        println!("\n== direct to the mock ({mock})");
        let c = client(THROUGHPUT_CONCURRENCY + 16)?;
        if options.row("nonstream") {
            let bases = [mock.clone()];
            nonstream_rows(&mut results, &c, "direct", &bases, &nonce, counts, &[]).await?;
        }
        if options.row("stream") {
            stream_rows(&mut results, &c, "direct", &mock, &nonce, counts).await?;
        }
        for row in options.stream_throughput_rows() {
            let bases = [mock.clone()];
            stream_throughput_row(&mut results, "direct", &bases, &nonce, counts, &[], row).await?;
        }
        if options.row("paced") {
            paced_row(&mut results, "direct", &mock, &mock, &nonce, counts).await?;
        }
        if options.row("storm") {
            storm_row(&mut results, "direct", &mock, &mock, &nonce, counts).await?;
        }
        if options.row("streams") {
            many_streams_row(&mut results, "direct", &mock, &nonce, counts, None).await?;
        }
    }

    // Plain proxy.
    let mut proxies = Vec::new();
    if options.target("floor") {
        let (floor, base) = start_floor(&control, dir.path(), mock_port).await?;
        println!("\n== floor ({base})");
        let plain = PlainProxy {
            name: "floor",
            pid: floor.pid(),
            base: &base,
            mock: &mock,
        };
        plain_proxy_rows(&mut results, &options, &plain, &nonce, counts).await?;
        proxies.push("floor".to_string());
        floor.stop(Duration::from_secs(5));
    }
    let nginx_installed = Path::new(NGINX).exists();
    if options.target("nginx") && nginx_installed {
        let (nginx, base) = start_nginx(&control, dir.path(), mock_port).await?;
        println!("\n== nginx ({base})");
        let plain = PlainProxy {
            name: "nginx",
            pid: nginx.pid(),
            base: &base,
            mock: &mock,
        };
        plain_proxy_rows(&mut results, &options, &plain, &nonce, counts).await?;
        proxies.push("nginx".to_string());
        nginx.stop(Duration::from_secs(5));
    } else if !nginx_installed {
        results.note(format!(
            "nginx rows skipped: {NGINX} is not installed (Debian: `apt-get install -y nginx`)"
        ));
    }

    // holdfast, per durability setting (and database, when one is given).
    let mut setups = vec![
        HoldfastSetup {
            label: "holdfast sqlite full".into(),
            database_url: None,
            synchronous: "full",
            traces_to: None,
        },
        HoldfastSetup {
            label: "holdfast sqlite normal".into(),
            database_url: None,
            synchronous: "normal",
            traces_to: None,
        },
        // Issue 32: traces on, exported to a collector that accepts every export at once, and
        // to one that accepts connections and never answers; the calls must not notice the
        // difference.
        HoldfastSetup {
            label: "holdfast traces live collector".into(),
            database_url: None,
            synchronous: "full",
            traces_to: Some(format!("http://{}/v1/traces", collector_sink().await?)),
        },
        HoldfastSetup {
            label: "holdfast traces dead collector".into(),
            database_url: None,
            synchronous: "full",
            traces_to: Some(format!("http://{}/v1/traces", black_hole().await?)),
        },
    ];
    if let Some(url) = &options.database_url {
        let scheme = url.split("://").next().unwrap_or("db");
        setups.push(HoldfastSetup {
            label: format!("holdfast {scheme}"),
            database_url: Some(url.clone()),
            synchronous: "full",
            traces_to: None,
        });
    }
    for setup in setups.iter().filter(|s| options.target(&s.label)) {
        let target = setup.label.as_str();
        let (hf, base) = start_holdfast(&control, dir.path(), setup, &mock, "main").await?;
        println!("\n== {target} ({base}, pid {})", hf.pid());
        let profile = start_profile(&options, hf.pid(), &out_dir, target)?;
        let c = client(THROUGHPUT_CONCURRENCY + 16)?;
        if options.row("nonstream") {
            nonstream_rows(
                &mut results,
                &c,
                target,
                std::slice::from_ref(&base),
                &nonce,
                counts,
                &[hf.pid()],
            )
            .await?;
            if options.row("replay") {
                replay_rows(&mut results, &c, target, &base, &mock, &nonce, counts).await?;
            }
        }
        if options.row("stream") {
            stream_rows(&mut results, &c, target, &base, &nonce, counts).await?;
        }
        for row in options.stream_throughput_rows() {
            let bases = std::slice::from_ref(&base);
            stream_throughput_row(
                &mut results,
                target,
                bases,
                &nonce,
                counts,
                &[hf.pid()],
                row,
            )
            .await?;
        }
        if options.row("paced") {
            paced_row(&mut results, target, &base, &mock, &nonce, counts).await?;
        }
        if options.row("storm") {
            storm_row(&mut results, target, &base, &mock, &nonce, counts).await?;
        }
        if let Some(perf) = profile {
            perf.stop(Duration::from_secs(60));
        }
        hf.stop(Duration::from_secs(40));
        if options.row("streams") {
            // A fresh process for the concurrent streams, so its memory is theirs alone.
            let (hf, base) = start_holdfast(&control, dir.path(), setup, &mock, "streams").await?;
            println!("== {target}, concurrent streams ({base}, pid {})", hf.pid());
            let profile =
                start_profile(&options, hf.pid(), &out_dir, &format!("{target} streams"))?;
            many_streams_row(&mut results, target, &base, &nonce, counts, Some(hf.pid())).await?;
            if let Some(perf) = profile {
                perf.stop(Duration::from_secs(60));
            }
            hf.stop(Duration::from_secs(40));
        }
        proxies.push(target.to_string());
    }
    // Three nodes on one PostgreSQL database, the load spread over them in turn.
    if let Some(url) = options
        .database_url
        .as_ref()
        .filter(|u| u.starts_with("postgres"))
    {
        let setup = HoldfastSetup {
            label: format!("holdfast postgres x{CLUSTER_NODES}"),
            database_url: Some(url.clone()),
            synchronous: "full",
            traces_to: None,
        };
        if options.target(&setup.label) {
            cluster_rows(
                &mut results,
                &control,
                dir.path(),
                &setup,
                &mock,
                &nonce,
                counts,
                &options,
            )
            .await?;
            proxies.push(setup.label.clone());
        }
    }
    mock_child.stop(Duration::from_secs(5));

    derived(&mut results, &proxies);
    let header = format!(
        "holdfast e2e benchmark{} — {}; load at start {started_load}, at end {}; \
         mock: {MOCK_CHUNKS} chunks, {MOCK_CHUNK_DELAY_MS} ms apart; latency rows over {} \
         requests after {} warm-up, throughput over {} at c={THROUGHPUT_CONCURRENCY}, \
         streams over {}, storm of {}, {} concurrent streams",
        if options.quick { " (--quick)" } else { "" },
        machine(),
        loadavg(),
        counts.latency,
        counts.latency_warmup,
        counts.throughput,
        counts.streams,
        counts.storm,
        counts.concurrent_streams,
    );
    let md = results.markdown(&header);
    std::fs::write(out_dir.join("e2e.md"), &md)?;
    std::fs::write(
        out_dir.join("e2e.json"),
        serde_json::to_string_pretty(&results.json())?,
    )?;
    println!("\n{md}");
    println!(
        "written: {} and {}",
        out_dir.join("e2e.json").display(),
        out_dir.join("e2e.md").display()
    );
    Ok(())
}
