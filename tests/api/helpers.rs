//! Shared harness: a real holdfast (in-process on port 0, or as a child process) in front of a
//! real mock provider on loopback, each test with its own SQLite file.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use holdfast::app::{self, Running};
use holdfast::config::{Backend, Config};
use holdfast::mock::{MockConfig, MockServer};
use holdfast::provider::Provider;
use serde_json::Value;
use tempfile::TempDir;
use tokio::net::TcpListener;

/// A chat-completions body whose content is `text`.
pub fn chat_body(text: &str) -> String {
    serde_json::json!({
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": text}],
    })
    .to_string()
}

/// A mock provider on 127.0.0.1:0.
pub async fn start_mock(config: MockConfig) -> MockServer {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind mock");
    MockServer::start(listener, config)
        .await
        .expect("start mock")
}

/// Test defaults: quick retries and sweeps, the mock as every backend (OpenAI, Anthropic,
/// Gemini), a fresh SQLite file.
pub fn test_config(mock: &MockServer, dir: &Path) -> Config {
    let mut config = Config {
        database_url: format!("sqlite://{}", dir.join("holdfast.db").display()),
        backends: vec![
            Backend {
                name: "mock-openai".into(),
                kind: Provider::Openai,
                base_url: mock.base_url(),
                api_key_env: None,
            },
            Backend {
                name: "mock-anthropic".into(),
                kind: Provider::Anthropic,
                base_url: mock.base_url(),
                api_key_env: None,
            },
            Backend {
                name: "mock-gemini".into(),
                kind: Provider::Gemini,
                base_url: mock.root_url(),
                api_key_env: None,
            },
        ],
        ..Config::default()
    };
    config.workers.backoff_initial_ms = 20;
    config.workers.backoff_max_ms = 200;
    config.workers.sweep_interval_ms = 100;
    config.shutdown_grace_ms = 1_000;
    config
}

/// holdfast in-process plus its mock provider.
pub struct TestApp {
    pub addr: SocketAddr,
    pub base: String,
    pub mock: MockServer,
    pub http: reqwest::Client,
    pub dir: TempDir,
    running: Option<Running>,
}

/// Starts a mock with `mock_config` and holdfast in front of it; `tweak` adjusts the config.
pub async fn spawn_app(mock_config: MockConfig, tweak: impl FnOnce(&mut Config)) -> TestApp {
    let mock = start_mock(mock_config).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut config = test_config(&mock, dir.path());
    tweak(&mut config);
    config.validate().expect("valid test config");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let running = app::start(config, listener).await.expect("start holdfast");
    let addr = running.addr;
    TestApp {
        addr,
        base: format!("http://{addr}"),
        mock,
        http: reqwest::Client::new(),
        dir,
        running: Some(running),
    }
}

impl TestApp {
    /// POSTs raw `body` to `path` with extra `headers`.
    pub async fn post(
        &self,
        path: &str,
        body: impl Into<reqwest::Body>,
        headers: &[(&str, &str)],
    ) -> reqwest::Response {
        let mut req = self
            .http
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        req.send().await.expect("POST")
    }

    /// POSTs `body` to `/v1/chat/completions`.
    pub async fn chat(&self, body: &str) -> reqwest::Response {
        self.post("/v1/chat/completions", body.to_string(), &[])
            .await
    }

    /// `GET /requests/{id}` as JSON.
    pub async fn record(&self, id: &str) -> Value {
        get_record(&self.http, &self.base, id).await
    }

    /// `GET /metrics`: the Prometheus text.
    pub async fn metrics_text(&self) -> String {
        metrics_page(&self.http, &self.base).await
    }

    /// Begins holdfast's graceful shutdown (as SIGTERM does) and returns its task, leaving the
    /// mock and the directory to the test.
    pub fn begin_shutdown(&mut self) -> tokio::task::JoinHandle<holdfast::app::Stopped> {
        let running = self.running.take().expect("holdfast is running");
        tokio::spawn(running.shutdown())
    }

    /// Stops holdfast (graceful) and the mock.
    pub async fn stop(mut self) {
        if let Some(r) = self.running.take() {
            r.shutdown().await;
        }
    }
}

/// The configuration of the fault tests (crashes, outages, a full disk): leases of
/// `lease_secs`, a sweep every 100 ms, up to 50 attempts with short backoff, and one
/// OpenAI-shaped backend `mock` at `mock_base`; `top` holds more top-level keys.
pub fn fault_test_toml(database_url: &str, top: &str, lease_secs: u64, mock_base: &str) -> String {
    format!(
        r#"
database_url = "{database_url}"
{top}
[workers]
lease_secs = {lease_secs}
sweep_interval_ms = 100
max_attempts = 50
backoff_initial_ms = 20
backoff_max_ms = 200
[[backends]]
name = "mock"
kind = "openai"
base_url = "{mock_base}"
"#
    )
}

/// `GET {url}` as JSON.
pub async fn get_json(http: &reqwest::Client, url: &str) -> Value {
    http.get(url)
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e}"))
        .json()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: not JSON: {e}"))
}

/// `POST {url}` with no body, the answer as JSON.
pub async fn post_json(http: &reqwest::Client, url: &str) -> Value {
    http.post(url)
        .send()
        .await
        .unwrap_or_else(|e| panic!("POST {url}: {e}"))
        .json()
        .await
        .unwrap_or_else(|e| panic!("POST {url}: not JSON: {e}"))
}

/// `GET {base}/requests/{id}` as JSON.
pub async fn get_record(http: &reqwest::Client, base: &str, id: &str) -> Value {
    get_json(http, &format!("{base}/requests/{id}")).await
}

/// A node whose provider fails every call with a 500 and which makes two attempts: each request
/// fails `attempts_exhausted` after two provider calls (ID-6a's retry tests).
pub async fn spawn_always_failing_app() -> TestApp {
    spawn_app(
        MockConfig {
            fail_first: 100,
            fail_status: 500,
            ..MockConfig::default()
        },
        |c| c.workers.max_attempts = 2,
    )
    .await
}

/// Polls `GET /requests/{id}` until its status is terminal, at most `limit`.
pub async fn wait_terminal(http: &reqwest::Client, base: &str, id: &str, limit: Duration) -> Value {
    let start = Instant::now();
    loop {
        let record = get_record(http, base, id).await;
        if matches!(record["status"].as_str(), Some("succeeded" | "failed")) {
            return record;
        }
        assert!(
            start.elapsed() < limit,
            "request {id} not terminal after {limit:?}: {record}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until `cond` holds, checking every 20 ms, at most `limit`.
pub async fn wait_until(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A header as a string ("" when absent).
pub fn header(response: &reqwest::Response, name: &str) -> String {
    response
        .headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string()
}

/// The built `holdfast` binary.
pub fn holdfast_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_holdfast"))
}

/// holdfast as a child process (for SIGKILL and CLI tests). Killed on drop.
pub struct Process {
    pub child: Child,
    pub base: String,
    /// Where its stderr (the log) goes: the file [`Process::serve_logged`] names, or one of
    /// [`Process::serve`]'s own (see [`Process::show_log_on_failure`]).
    pub log: Option<PathBuf>,
    /// Whether a test that fails with it running prints the end of its log ([`Process::serve`]:
    /// the log is in a file only so that [`Process::wait_healthy`] can read it).
    pub show_log_on_failure: bool,
}

/// Log lines a failing test prints of a [`Process::serve`] node.
const LOG_TAIL_LINES: usize = 60;

/// The log filter [`Process::serve`] and [`Process::serve_logged`] start holdfast with.
const DEBUG_LOG: Option<&str> = Some("holdfast=debug");

impl Process {
    /// Runs `holdfast serve --config FILE --listen ADDR` in `dir` and waits until it serves
    /// ([`Process::wait_healthy`]). Its log goes to a file of its own in `dir`, whose end a
    /// failing test prints.
    pub async fn serve(dir: &Path, config_toml: &str, addr: SocketAddr) -> Process {
        static STARTS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = STARTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let log = dir.join(format!("holdfast-serve-{n}.log"));
        let mut process = Process::start(dir, config_toml, addr, Some(log), &[], DEBUG_LOG).await;
        process.show_log_on_failure = true;
        process
    }

    /// [`Process::serve`] with its log (stderr) written to `dir/holdfast.log` and `env` set.
    pub async fn serve_logged(
        dir: &Path,
        config_toml: &str,
        addr: SocketAddr,
        env: &[(&str, &str)],
    ) -> Process {
        let log = dir.join("holdfast.log");
        Process::start(dir, config_toml, addr, Some(log), env, DEBUG_LOG).await
    }

    /// [`Process::serve`] with its log (stderr) written to `log`: a node restarted in the same
    /// directory keeps each run's log apart.
    pub async fn serve_logged_to(
        dir: &Path,
        config_toml: &str,
        addr: SocketAddr,
        log: PathBuf,
    ) -> Process {
        Process::start(dir, config_toml, addr, Some(log), &[], DEBUG_LOG).await
    }

    /// [`Process::serve_logged`] at the default log level: no `RUST_LOG` at all, as an operator
    /// starts it.
    pub async fn serve_logged_at_default_level(
        dir: &Path,
        config_toml: &str,
        addr: SocketAddr,
        env: &[(&str, &str)],
    ) -> Process {
        let log = dir.join("holdfast.log");
        Process::start(dir, config_toml, addr, Some(log), env, None).await
    }

    async fn start(
        dir: &Path,
        config_toml: &str,
        addr: SocketAddr,
        log: Option<PathBuf>,
        env: &[(&str, &str)],
        rust_log: Option<&str>,
    ) -> Process {
        let config = dir.join("holdfast.toml");
        std::fs::write(&config, config_toml).expect("write config");
        let stderr = match &log {
            Some(path) => Stdio::from(std::fs::File::create(path).expect("create log")),
            None => Stdio::inherit(),
        };
        let mut command = Command::new(holdfast_bin());
        command
            .args(["serve", "--config"])
            .arg(&config)
            .args(["--listen", &addr.to_string()])
            .current_dir(dir)
            .stdout(Stdio::null())
            .stderr(stderr);
        match rust_log {
            Some(filter) => command.env("RUST_LOG", filter),
            None => command.env_remove("RUST_LOG"),
        };
        for (k, v) in env {
            command.env(k, v);
        }
        let child = command.spawn().expect("spawn holdfast");
        let mut process = Process {
            child,
            base: format!("http://{addr}"),
            log,
            show_log_on_failure: false,
        };
        process.wait_healthy().await;
        process
    }

    /// What the process logged so far ([`Process::serve_logged`]).
    pub fn log_text(&self) -> String {
        let path = self.log.as_ref().expect("started with serve_logged");
        std::fs::read_to_string(path).expect("read log")
    }

    /// Waits until this process serves (at most 30 s): it is alive, has logged that it serves
    /// (when its log is in a file) and `/healthz` answers 200. The log line matters: another
    /// test's server can take a port between [`free_addr`] and this process's bind, answer the
    /// `/healthz` itself, and this process exits with "Address already in use". Panics, with
    /// the exit status and the log, if the process exits first.
    pub async fn wait_healthy(&mut self) {
        let http = reqwest::Client::new();
        let start = Instant::now();
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                let log = self
                    .log
                    .as_ref()
                    .map(|path| std::fs::read_to_string(path).unwrap_or_default())
                    .unwrap_or_default();
                panic!(
                    "holdfast at {} exited before it served ({status}); its log:\n{log}",
                    self.base
                );
            }
            let serving = self.log.as_ref().is_none_or(|path| {
                std::fs::read_to_string(path).is_ok_and(|log| log.contains("holdfast serving"))
            });
            if serving
                && let Ok(r) = http.get(format!("{}/healthz", self.base)).send().await
                && r.status() == 200
            {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "holdfast at {} did not become healthy",
                self.base
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// SIGTERM, then wait for the exit (at most `limit`); returns whether it exited cleanly.
    pub fn sigterm_and_wait(&mut self, limit: Duration) -> bool {
        self.sigterm();
        self.wait_exit(limit)
    }

    /// Sends SIGTERM without waiting for the exit.
    pub fn sigterm(&self) {
        let pid = self.child.id().to_string();
        let sent = Command::new("kill").args(["-TERM", &pid]).status();
        assert!(sent.is_ok_and(|s| s.success()), "kill -TERM {pid}");
    }

    /// Waits for the exit that a SIGTERM sent earlier began (at most `limit`); returns whether
    /// it exited cleanly.
    pub fn wait_exit(&mut self, limit: Duration) -> bool {
        let start = Instant::now();
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status.success();
            }
            assert!(
                start.elapsed() < limit,
                "holdfast did not exit within {limit:?} of SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL, then reap.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill9();
        if self.show_log_on_failure
            && std::thread::panicking()
            && let Some(path) = &self.log
        {
            let log = std::fs::read_to_string(path).unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            let tail = &lines[lines.len().saturating_sub(LOG_TAIL_LINES)..];
            eprintln!(
                "the end of the log of holdfast at {} ({}):\n{}",
                self.base,
                path.display(),
                tail.join("\n")
            );
        }
    }
}

/// A free loopback port (bound then released).
pub fn free_addr() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr")
}

// ---------------------------------------------------------------------------------------------
// Dependencies outside Rust
// ---------------------------------------------------------------------------------------------
//
// Tests that drive a real client need something cargo does not build: Python with the official
// SDKs, Node with the npm clients, Chromium, PostgreSQL. `scripts/test` installs or starts each of
// them. A test whose dependency is missing fails, naming it and the fix; it never passes without
// having run. Opting out of a group is explicit: `HOLDFAST_TEST_SKIP=browser,python,node,postgres`
// makes `scripts/test` filter that group's tests out, so nextest counts them as skipped.

/// Fails the calling test: `what` is missing, `fix` installs it. `group` is the test's group in
/// `scripts/test` (the name `HOLDFAST_TEST_SKIP` takes).
#[track_caller]
pub fn missing_dependency(group: &str, what: &str, fix: &str) -> ! {
    panic!(
        "\n\n*** MISSING TEST DEPENDENCY ({group}): {what}\n    \
         fix: {fix}\n    \
         or run `scripts/test`, which sets up every test dependency,\n    \
         or opt out of these tests explicitly: HOLDFAST_TEST_SKIP={group} scripts/test\n    \
         (if this test ran although `{group}` was opted out, the `{group}` row of the group \
         table in scripts/test does not select it: fix its name or the row)\n\n"
    )
}

/// The Python interpreter the client tests run: the project's `.venv` (created by
/// `scripts/test`), else `python3` on PATH. (No `HOLDFAST_`-prefixed variable selects it:
/// `holdfast` reads every such variable as a config key.)
pub fn python() -> PathBuf {
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    if venv.exists() {
        return venv;
    }
    PathBuf::from("python3")
}

/// Fails the calling test unless every Python module in `modules` can be imported by
/// [`python()`].
#[track_caller]
pub fn require_python(modules: &[&str]) {
    let python = python();
    let shown = python.display();
    let fix = "scripts/test creates .venv from tests/clients/requirements.txt \
               (by hand: python3 -m venv .venv && .venv/bin/pip install -r \
               tests/clients/requirements.txt)";
    let probe = "import importlib.util, sys\n\
                 missing = [m for m in sys.argv[1:] if importlib.util.find_spec(m) is None]\n\
                 print(' '.join(missing))\n";
    let out = Command::new(&python)
        .arg("-c")
        .arg(probe)
        .args(modules)
        .output()
        .unwrap_or_else(|e| {
            missing_dependency(
                "python",
                &format!("cannot run the Python interpreter {shown} ({e})"),
                fix,
            )
        });
    let missing = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !out.status.success() {
        missing_dependency(
            "python",
            &format!(
                "the Python interpreter {shown} failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
            fix,
        );
    }
    if !missing.is_empty() {
        let names: Vec<String> = missing.split(' ').map(|m| format!("`{m}`")).collect();
        missing_dependency(
            "python",
            &format!(
                "python module{} {} not found in {shown}",
                if names.len() > 1 { "s" } else { "" },
                names.join(", ")
            ),
            fix,
        );
    }
}

/// `python tests/clients/SCRIPT ARGS` with [`python()`], not yet run.
pub fn python_command(script: &str) -> Command {
    let mut cmd = Command::new(python());
    cmd.arg(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/clients")
            .join(script),
    );
    cmd
}

/// Runs `python tests/clients/SCRIPT` with `env`, returning its stdout; panics with its stderr
/// when it fails.
pub fn run_python(script: &str, env: &[(&str, &str)]) -> String {
    run_python_args(script, &[], env)
}

/// [`run_python`] with command-line arguments after the script.
pub fn run_python_args(script: &str, args: &[&str], env: &[(&str, &str)]) -> String {
    let mut cmd = python_command(script);
    cmd.args(args.iter().filter(|a| !a.is_empty()));
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("run {} {script}: {e}", python().display()));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{script} failed ({}):\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// A streamed chat-completions body.
pub fn stream_body(text: &str) -> String {
    serde_json::json!({
        "model": "gpt-4o-mini",
        "stream": true,
        "messages": [{"role": "user", "content": text}],
    })
    .to_string()
}

/// Reads a whole SSE response: its raw text and its events (WHATWG parsing).
pub async fn read_events(response: reqwest::Response) -> (String, Vec<holdfast::sse::SseEvent>) {
    let bytes = response.bytes().await.expect("SSE body");
    let mut parser = holdfast::sse::SseParser::new();
    let events = parser.push(&bytes).expect("valid SSE");
    (String::from_utf8(bytes.to_vec()).expect("UTF-8"), events)
}

/// Two namespaces, `a` with the key `key-a` and `b` with `key-b`.
pub fn two_namespaces(a: &str, b: &str) -> Vec<holdfast::config::Namespace> {
    [(a, "key-a"), (b, "key-b")]
        .into_iter()
        .map(|(name, key)| holdfast::config::Namespace {
            name: name.into(),
            api_keys: vec![key.into()],
            callback_url: None,
            callback_secrets: Vec::new(),
            callback_include_body: None,
            max_held_requests: None,
        })
        .collect()
}

/// Reads an SSE response until it has shown at least `n` events (the stream goes on) and
/// returns them.
pub async fn first_events(
    response: &mut reqwest::Response,
    n: usize,
) -> Vec<holdfast::sse::SseEvent> {
    next_events(response, &mut holdfast::sse::SseParser::new(), n).await
}

/// Reads `response` until `parser` has given at least `n` more events (the stream goes on).
pub async fn next_events(
    response: &mut reqwest::Response,
    parser: &mut holdfast::sse::SseParser,
    n: usize,
) -> Vec<holdfast::sse::SseEvent> {
    let mut events = Vec::new();
    while events.len() < n {
        let piece = response
            .chunk()
            .await
            .expect("SSE body")
            .expect("more events");
        events.extend(parser.push(&piece).expect("valid SSE"));
    }
    events
}

/// `GET /requests/{id}` as an event stream, with an optional `Last-Event-ID`.
pub async fn get_events(
    http: &reqwest::Client,
    base: &str,
    id: &str,
    last_event_id: Option<&str>,
) -> reqwest::Response {
    let mut req = http
        .get(format!("{base}/requests/{id}"))
        .header("accept", "text/event-stream");
    if let Some(p) = last_event_id {
        req = req.header("last-event-id", p);
    }
    req.send().await.expect("GET events")
}

/// Concatenated `delta.content` of OpenAI chat-completion chunk events.
pub fn openai_text(events: &[holdfast::sse::SseEvent]) -> String {
    events
        .iter()
        .filter(|e| e.data != "[DONE]")
        .filter_map(|e| serde_json::from_str::<Value>(&e.data).ok())
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect()
}

/// A provider that answers every call with the same scripted raw HTTP response and then closes
/// the connection: for answers the mock cannot give (a body delimited by the connection's close,
/// an HTML page, a wrong content type). Counts calls.
pub struct RawProvider {
    pub addr: SocketAddr,
    calls: std::sync::Arc<std::sync::atomic::AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl RawProvider {
    /// Serves `response` (status line, headers, blank line and body, as raw bytes) to every
    /// request on 127.0.0.1:0.
    pub async fn start(response: Vec<u8>) -> RawProvider {
        use tokio::io::AsyncWriteExt;
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind raw");
        let addr = listener.local_addr().expect("addr");
        let calls = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counter = calls.clone();
        let response = std::sync::Arc::new(response);
        let task = tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let (counter, response) = (counter.clone(), response.clone());
                tokio::spawn(async move {
                    if !read_request(&mut socket).await {
                        return;
                    }
                    counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let _ = socket.write_all(&response).await;
                    let _ = socket.shutdown().await;
                });
            }
        });
        RawProvider { addr, calls, task }
    }

    /// `http://ADDR/v1`, a backend `base_url`.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// Requests answered so far.
    pub fn calls(&self) -> u64 {
        self.calls.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for RawProvider {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Reads one HTTP/1.1 request from `socket`: the head, then as many body bytes as
/// Content-Length says. False when the connection ends first.
async fn read_request(socket: &mut tokio::net::TcpStream) -> bool {
    use tokio::io::AsyncReadExt;
    let mut seen = Vec::new();
    let mut buf = [0u8; 8192];
    let head_end = loop {
        if let Some(i) = seen.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        match socket.read(&mut buf).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => seen.extend_from_slice(&buf[..n]),
        }
    };
    let head = String::from_utf8_lossy(&seen[..head_end]).to_ascii_lowercase();
    let length = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse::<usize>().ok())
        .unwrap_or(0);
    while seen.len() < head_end + length {
        match socket.read(&mut buf).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => seen.extend_from_slice(&buf[..n]),
        }
    }
    true
}

/// A provider that answers its first call with `200 text/event-stream` and then sends what the
/// test writes with [`StepwiseStream::send`], each piece as it is written; the body stays open
/// until the provider is dropped. For a test that must know what the proxy has read, and when.
pub struct StepwiseStream {
    pub addr: SocketAddr,
    pieces: tokio::sync::mpsc::UnboundedSender<String>,
    task: tokio::task::JoinHandle<()>,
}

impl StepwiseStream {
    pub async fn start() -> StepwiseStream {
        use tokio::io::AsyncWriteExt;
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind stepwise");
        let addr = listener.local_addr().expect("addr");
        let (pieces, mut to_send) = tokio::sync::mpsc::unbounded_channel::<String>();
        let task = tokio::spawn(async move {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            if !read_request(&mut socket).await {
                return;
            }
            let head =
                "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n";
            if socket.write_all(head.as_bytes()).await.is_err() {
                return;
            }
            while let Some(piece) = to_send.recv().await {
                if socket.write_all(piece.as_bytes()).await.is_err() {
                    return;
                }
            }
            // The test let go of the sender: the body ends, and the stream with it.
        });
        StepwiseStream { addr, pieces, task }
    }

    /// `http://ADDR/v1`, a backend `base_url`.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// Sends `piece` (raw SSE text) on the open stream.
    pub fn send(&self, piece: &str) {
        self.pieces
            .send(piece.to_owned())
            .expect("the stream is open");
    }
}

impl Drop for StepwiseStream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// `POST /requests/{id}/replay` with an empty JSON body (EX-7): the original's model and backend.
pub async fn post_replay(app: &TestApp, id: &str) -> reqwest::Response {
    app.http
        .post(format!("{}/requests/{id}/replay", app.base))
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .expect("POST /requests/{id}/replay")
}

/// A raw HTTP/1.1 200 response with `content_type` and `body`, its length given by
/// `Content-Length` (`close_delimited`: no length at all, the body ends when the connection
/// closes).
pub fn raw_200(content_type: &str, body: &str, close_delimited: bool) -> Vec<u8> {
    let length = if close_delimited {
        String::new()
    } else {
        format!("content-length: {}\r\n", body.len())
    };
    format!(
        "HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\n{length}connection: close\r\n\r\n{body}"
    )
    .into_bytes()
}

/// Points every backend of `config` at `base_url` (a Gemini backend at it without `/v1`).
pub fn use_backend_url(config: &mut Config, base_url: &str) {
    for b in &mut config.backends {
        b.base_url = match b.kind {
            Provider::Gemini => base_url.trim_end_matches("/v1").to_string(),
            Provider::Openai | Provider::Anthropic => base_url.to_string(),
        };
    }
}

/// A Gemini `generateContent` body whose prompt is `text`.
pub fn gemini_body(text: &str) -> String {
    serde_json::json!({"contents": [{"role": "user", "parts": [{"text": text}]}]}).to_string()
}

/// The text of Gemini chunks (their first candidate's text parts), concatenated.
pub fn gemini_text(events: &[holdfast::sse::SseEvent]) -> String {
    events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(&e.data).ok())
        .flat_map(|v| {
            v["candidates"][0]["content"]["parts"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter_map(|p| p["text"].as_str().map(str::to_owned))
        .collect()
}

/// Runs the holdfast binary with `args` in `dir` (environment: this process's, minus every
/// `HOLDFAST_*` and `RUST_LOG` variable, plus `env`) and returns its exit code, stdout and stderr.
pub fn run_holdfast(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut command = Command::new(holdfast_bin());
    command.args(args).current_dir(dir);
    for (k, _) in std::env::vars() {
        if k.starts_with("HOLDFAST_") || k == "RUST_LOG" {
            command.env_remove(k);
        }
    }
    for (k, v) in env {
        command.env(k, v);
    }
    let out = command.output().expect("run holdfast");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The requests `GET /requests` lists (its `data`).
pub async fn records(app: &TestApp) -> Vec<Value> {
    let list = get_json(&app.http, &format!("{}/requests", app.base)).await;
    list["data"].as_array().unwrap().clone()
}

/// Waits until request `id` has counted at least `min` deliveries (see [`wait_deliveries`]) and
/// returns its record; fails after 10 s with the record.
pub async fn wait_deliveries_at_least(base: &str, id: &str, min: u64) -> Value {
    let http = reqwest::Client::new();
    let start = Instant::now();
    loop {
        let record: Value = http
            .get(format!("{base}/requests/{id}"))
            .send()
            .await
            .expect("GET record")
            .json()
            .await
            .expect("JSON");
        if record["deliveries"]["total"].as_u64() >= Some(min) {
            return record;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{id} never counted {min} deliveries: {record}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until request `id` has counted `total` deliveries: a duplicate is answered first and
/// counted by a write right after (docs/usage.md), so a read at once may not include it yet.
pub async fn wait_deliveries(base: &str, id: &str, key: Option<&str>, total: u64) {
    let http = reqwest::Client::new();
    let start = Instant::now();
    loop {
        let mut req = http.get(format!("{base}/requests/{id}"));
        if let Some(key) = key {
            req = req.header("authorization", format!("Bearer {key}"));
        }
        let record: Value = req
            .send()
            .await
            .expect("GET record")
            .json()
            .await
            .expect("JSON");
        if record["deliveries"]["total"].as_u64() == Some(total) {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{id} never counted {total} deliveries: {record}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// `VmRSS` of process `pid`, KiB.
pub fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

/// Open file descriptors of process `pid`.
pub fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("proc fd")
        .count()
}

/// Open file descriptors of a process, by what they are.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FdKinds {
    /// TCP connections and listeners (`socket:[…]`).
    pub sockets: u64,
    /// Files under the directory asked about (for a node: its database, WAL, shared memory,
    /// lock file and log).
    pub files: u64,
    /// Everything else: pipes, eventfds, epoll, `/dev/null`.
    pub other: u64,
}

impl FdKinds {
    pub fn total(&self) -> u64 {
        self.sockets + self.files + self.other
    }
}

/// Open file descriptors of process `pid` by kind, `files` being those under `dir`. An fd
/// closed between listing and reading its link is not counted.
pub fn fd_kinds(pid: u32, dir: &Path) -> FdKinds {
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    let mut kinds = FdKinds::default();
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd")).expect("proc fd") {
        let Ok(target) = entry.and_then(|e| std::fs::read_link(e.path())) else {
            continue;
        };
        if target.to_string_lossy().starts_with("socket:") {
            kinds.sockets += 1;
        } else if target.starts_with(&dir) {
            kinds.files += 1;
        } else {
            kinds.other += 1;
        }
    }
    kinds
}

/// Every request in the log, through `GET /requests` on `base` (one page per 500; RD-7).
pub async fn every_record(http: &reqwest::Client, base: &str) -> Vec<Value> {
    let mut all = Vec::new();
    let mut cursor: Option<String> = None;
    for _page in 0..100 {
        let mut url = format!("{base}/requests?limit=500");
        if let Some(c) = &cursor {
            url.push_str(&format!("&cursor={c}"));
        }
        let page = get_json(http, &url).await;
        all.extend(page["data"].as_array().unwrap().iter().cloned());
        cursor = page["next_cursor"].as_str().map(str::to_owned);
        if cursor.is_none() {
            return all;
        }
    }
    panic!("more than 100 pages of requests");
}

/// [`every_record`] once every request in it is terminal, and how long that took; fails
/// after 90 s naming one that is not.
pub async fn every_record_terminal(http: &reqwest::Client, base: &str) -> (Vec<Value>, Duration) {
    let settle = Instant::now();
    loop {
        let records = every_record(http, base).await;
        let open: Vec<&Value> = records
            .iter()
            .filter(|r| !matches!(r["status"].as_str(), Some("succeeded" | "failed")))
            .collect();
        if open.is_empty() {
            return (records, settle.elapsed());
        }
        assert!(
            settle.elapsed() < Duration::from_secs(90),
            "{} requests still not terminal after 90 s, e.g. {}",
            open.len(),
            open[0]
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The value of the metric line `name{labels}` in a Prometheus text page (0 when absent).
pub fn metric(page: &str, name: &str, labels: &str) -> f64 {
    page.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (n, rest) = series.split_once('{').unwrap_or((series, "}"));
            let rest = rest.trim_end_matches('}');
            let want: Vec<&str> = labels.split(',').filter(|s| !s.is_empty()).collect();
            (n == name && want.iter().all(|w| rest.split(',').any(|p| p == *w)))
                .then(|| value.parse().ok())
                .flatten()
        })
        .unwrap_or(0.0)
}

/// `POST {base}/v1/chat/completions` with `Prefer: respond-async`: asserts the 202 and returns
/// the recorded request's id.
pub async fn submit_async(http: &reqwest::Client, base: &str, body: String) -> String {
    let r = http
        .post(format!("{base}/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("prefer", "respond-async")
        .body(body)
        .send()
        .await
        .expect("POST");
    assert_eq!(r.status(), 202, "recorded");
    header(&r, "holdfast-request-id")
}

/// Follows request `id`'s event log live until it has shown `n` events (20 s at most for each
/// piece): the stream is running and has stored them. Returns the events shown.
pub async fn wait_for_events(
    http: &reqwest::Client,
    base: &str,
    id: &str,
    n: usize,
) -> Vec<holdfast::sse::SseEvent> {
    let mut response = get_events(http, base, id, None).await;
    let mut parser = holdfast::sse::SseParser::new();
    let mut seen = Vec::new();
    while seen.len() < n {
        let piece = tokio::time::timeout(Duration::from_secs(20), response.chunk())
            .await
            .expect("the stream stores its first events")
            .unwrap()
            .expect("the stream goes on");
        seen.extend(parser.push(&piece).unwrap());
    }
    seen
}

/// `GET {base}/metrics` as text.
pub async fn metrics_page(http: &reqwest::Client, base: &str) -> String {
    http.get(format!("{base}/metrics"))
        .send()
        .await
        .expect("GET /metrics")
        .text()
        .await
        .expect("metrics text")
}

/// What [`log_signal`] watches for: a message fragment, the `request_id` field it must carry,
/// and whom to tell.
type LogWatches = Vec<(&'static str, String, std::sync::Arc<tokio::sync::Notify>)>;
static LOG_WATCHES: std::sync::Mutex<LogWatches> = std::sync::Mutex::new(Vec::new());

/// Tells [`LOG_WATCHES`] of holdfast's tracing events in this process.
struct LogWatch;

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for LogWatch {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        #[derive(Default)]
        struct Fields {
            message: String,
            request_id: String,
        }
        impl tracing::field::Visit for Fields {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                match field.name() {
                    "message" => self.message = format!("{value:?}"),
                    "request_id" => self.request_id = format!("{value:?}"),
                    _ => {}
                }
            }
        }
        let mut fields = Fields::default();
        event.record(&mut fields);
        for (text, request_id, signal) in LOG_WATCHES.lock().unwrap().iter() {
            if fields.message.contains(text) && fields.request_id == *request_id {
                signal.notify_one();
            }
        }
    }
}

/// A signal given when holdfast, in this process, logs an event (at debug level or above)
/// whose message contains `text` and whose `request_id` field is `request_id`: for a test that
/// must know a step inside holdfast has begun. Watch before the step can happen; an event
/// logged earlier is not seen.
pub fn log_signal(text: &'static str, request_id: &str) -> std::sync::Arc<tokio::sync::Notify> {
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    INSTALLED.call_once(|| {
        use tracing_subscriber::Layer;
        use tracing_subscriber::layer::SubscriberExt;
        let holdfast = tracing_subscriber::filter::Targets::new()
            .with_target("holdfast", tracing::Level::DEBUG);
        tracing::subscriber::set_global_default(
            tracing_subscriber::registry().with(LogWatch.with_filter(holdfast)),
        )
        .expect("no other global tracing subscriber in the test process");
    });
    let signal = std::sync::Arc::new(tokio::sync::Notify::new());
    LOG_WATCHES
        .lock()
        .unwrap()
        .push((text, request_id.to_owned(), std::sync::Arc::clone(&signal)));
    signal
}
