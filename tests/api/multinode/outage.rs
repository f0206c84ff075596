//! PostgreSQL unavailable under load (issue 18): two nodes on a PostgreSQL server of the test's
//! own, which is stopped for 5 s twice — a fast shutdown, then an immediate one (a crash, with
//! recovery at the next start) — while clients keep sending. Every answer a client gets is a
//! success or a retryable refusal (503 with `x-should-retry: true` and `retry-after-ms` at most
//! 60 000, RS-8; on a stream whose reading broke, RS-4's error event), every request a client
//! was told about is in the log (no acknowledgement without a record, RS-1), and after the
//! server returns every recorded request reaches a terminal status without restarting a node
//! (LC-2, LC-4, DU-3).
//!
//! The server is a private instance (`initdb` into a temporary directory, `postgres` on a free
//! loopback port, as the `postgres` user when the test runs as root), so stopping it touches no
//! other test. It needs PostgreSQL's server binaries (Debian: `apt-get install postgresql`);
//! it is in the `postgres` group of `scripts/test` (module `multinode::`).

use std::collections::HashSet;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use holdfast::mock::MockConfig;
use serde_json::Value;
use sqlx::Connection;
use sqlx::postgres::PgConnection;
use tempfile::TempDir;

use crate::helpers::*;

/// How long the server stays down each time.
const OUTAGE: Duration = Duration::from_secs(5);
/// Client tasks sending at once.
const CLIENTS: usize = 8;
/// Successes each phase must see before the next fault: load before, recovery after.
const SUCCESSES_PER_PHASE: u64 = 40;
/// No single answer may take longer (the pool's acquire timeout is 30 s).
const ANSWER_LIMIT: Duration = Duration::from_secs(120);

/// PostgreSQL's server binaries: the newest `/usr/lib/postgresql/<version>/bin` (Debian), else
/// `initdb` on PATH.
fn postgres_bin_dir() -> PathBuf {
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            (bin.join("initdb").exists() && bin.join("postgres").exists()).then_some((version, bin))
        })
        .collect();
    versions.sort();
    if let Some((_, bin)) = versions.pop() {
        return bin;
    }
    if let Ok(out) = std::process::Command::new("sh")
        .args(["-c", "command -v initdb"])
        .output()
        && out.status.success()
    {
        let initdb = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if let Some(bin) = initdb.parent() {
            return bin.to_path_buf();
        }
    }
    missing_dependency(
        "postgres",
        "PostgreSQL's server binaries (initdb, postgres) are not installed",
        "apt-get install postgresql (the test runs a private server of its own)",
    )
}

/// The uid and gid to run PostgreSQL as: the `postgres` user when this process is root (the
/// server refuses to run as root), else this process's own.
fn server_user() -> Option<(u32, u32)> {
    // SAFETY: geteuid has no preconditions; getpwnam gets a NUL-terminated name and its result
    // is read before any other call that could reuse its static buffer.
    unsafe {
        if libc::geteuid() != 0 {
            return None;
        }
        let pw = libc::getpwnam(c"postgres".as_ptr());
        if pw.is_null() {
            missing_dependency(
                "postgres",
                "running as root, and there is no `postgres` user to run a private PostgreSQL as",
                "install PostgreSQL from the distribution (it creates the user), or run the \
                 tests as an ordinary user",
            );
        }
        Some(((*pw).pw_uid, (*pw).pw_gid))
    }
}

/// A PostgreSQL server of this test's own, stopped and started at will. Dropped: shut down
/// (immediate mode) and its directory removed.
struct PrivatePostgres {
    bin: PathBuf,
    user: Option<(u32, u32)>,
    dir: TempDir,
    port: u16,
    server: Option<tokio::process::Child>,
    starts: u32,
}

impl PrivatePostgres {
    /// `initdb` into a temporary directory, then start the server on a free loopback port.
    async fn create() -> PrivatePostgres {
        let bin = postgres_bin_dir();
        let user = server_user();
        let dir = tempfile::tempdir().expect("tempdir");
        if let Some((uid, gid)) = user {
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid)).expect("chown");
        }
        let mut initdb = std::process::Command::new(bin.join("initdb"));
        initdb
            .arg("-D")
            .arg(dir.path().join("data"))
            .args([
                "-A",
                "trust",
                "-U",
                "postgres",
                "-E",
                "UTF8",
                "--locale=C",
                "-N",
            ])
            .stdout(Stdio::null());
        if let Some((uid, gid)) = user {
            std::os::unix::process::CommandExt::uid(&mut initdb, uid);
            std::os::unix::process::CommandExt::gid(&mut initdb, gid);
        }
        let out = initdb.output().expect("run initdb");
        assert!(
            out.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut pg = PrivatePostgres {
            bin,
            user,
            port: free_addr().port(),
            dir,
            server: None,
            starts: 0,
        };
        pg.start().await;
        pg
    }

    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    fn log(&self) -> PathBuf {
        self.dir.path().join("postgres.log")
    }

    /// Starts the server and waits until it accepts connections (at most 30 s).
    async fn start(&mut self) {
        assert!(self.server.is_none(), "already running");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log())
            .expect("postgres log");
        let mut command = tokio::process::Command::new(self.bin.join("postgres"));
        command
            .arg("-D")
            .arg(self.dir.path().join("data"))
            .arg("-p")
            .arg(self.port.to_string())
            .arg("-k")
            .arg(self.dir.path())
            .args(["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"])
            .stdout(Stdio::null())
            .stderr(Stdio::from(log));
        if let Some((uid, gid)) = self.user {
            command.uid(uid).gid(gid);
        }
        self.server = Some(command.spawn().expect("spawn postgres"));
        self.starts += 1;
        let start = Instant::now();
        loop {
            let attempt =
                tokio::time::timeout(Duration::from_secs(2), PgConnection::connect(&self.url()))
                    .await;
            if let Ok(Ok(conn)) = attempt {
                let _ = conn.close().await;
                return;
            }
            if let Some(server) = &mut self.server
                && let Ok(Some(status)) = server.try_wait()
            {
                panic!("postgres exited ({status}):\n{}", self.log_text());
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "postgres did not accept connections within 30 s:\n{}",
                self.log_text()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Stops the server: `signal` SIGINT is PostgreSQL's fast shutdown (sessions terminated,
    /// a clean checkpoint), SIGQUIT its immediate one (everything killed, crash recovery at
    /// the next start). Waits for it to exit (at most 30 s).
    async fn stop(&mut self, signal: i32) {
        let mut server = self.server.take().expect("running");
        let pid = server.id().expect("pid");
        // SAFETY: kill(2) on the pid of our own child, which we have not reaped yet.
        let sent = unsafe { libc::kill(pid as i32, signal) };
        assert_eq!(sent, 0, "kill postgres");
        tokio::time::timeout(Duration::from_secs(30), server.wait())
            .await
            .expect("postgres stops within 30 s")
            .expect("wait for postgres");
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(self.log()).unwrap_or_default()
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        if let Some(mut server) = self.server.take()
            && let Some(pid) = server.id()
        {
            // SAFETY: as in `stop`.
            unsafe { libc::kill(pid as i32, libc::SIGQUIT) };
            let start = Instant::now();
            while !matches!(server.try_wait(), Ok(Some(_)))
                && start.elapsed() < Duration::from_secs(10)
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = server.start_kill();
        }
    }
}

/// What the clients were answered.
#[derive(Debug, Default)]
struct Tally {
    /// 200 with the whole answer (a stream through its final event).
    succeeded: u64,
    /// 503 `store_unavailable` (or `overloaded`) with `x-should-retry: true` and
    /// `retry-after-ms` ≤ 60 000 (RS-8).
    refused_retryable: u64,
    /// A stream that broke on the store with RS-4's error event, on which an SDK raises and a
    /// retry attaches: `store_unavailable` (reading the stored stream failed) ...
    stream_store_unavailable: u64,
    /// ... or `attempt_abandoned` (its attempt could not store its chunks and was re-run).
    stream_attempt_abandoned: u64,
    /// Anything else: each is a failure of the test.
    violations: Vec<String>,
    /// Every request id a client was given.
    ids: HashSet<String>,
    slowest: Duration,
}

/// One client: sends new bodies to the nodes by turns until `stop`, every fifth one to both
/// nodes at once (an SDK retry landing elsewhere), and tallies the answers.
async fn client(
    bases: Arc<Vec<String>>,
    next: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    tally: Arc<Mutex<Tally>>,
) {
    let http = reqwest::Client::builder()
        .timeout(ANSWER_LIMIT)
        .build()
        .unwrap();
    while !stop.load(Ordering::SeqCst) {
        let n = next.fetch_add(1, Ordering::SeqCst);
        let stream = n.is_multiple_of(3);
        let text = format!("outage {n}");
        let body = if stream {
            stream_body(&text)
        } else {
            chat_body(&text)
        };
        let first = (n as usize) % bases.len();
        let targets: Vec<usize> = if n.is_multiple_of(5) {
            (0..bases.len()).collect()
        } else {
            vec![first]
        };
        let sends = targets
            .iter()
            .map(|&node| send(&http, &bases[node], body.clone(), stream));
        for result in futures::future::join_all(sends).await {
            let mut t = tally.lock().unwrap();
            t.slowest = t.slowest.max(result.elapsed);
            if !result.id.is_empty() {
                t.ids.insert(result.id.clone());
            }
            match result.answer {
                Answer::Succeeded => t.succeeded += 1,
                Answer::Refused => t.refused_retryable += 1,
                Answer::StreamEnded { abandoned: false } => t.stream_store_unavailable += 1,
                Answer::StreamEnded { abandoned: true } => t.stream_attempt_abandoned += 1,
                Answer::Violation(why) => t.violations.push(format!("{text}: {why}")),
            }
        }
    }
}

enum Answer {
    Succeeded,
    Refused,
    StreamEnded { abandoned: bool },
    Violation(String),
}

struct Sent {
    answer: Answer,
    id: String,
    elapsed: Duration,
}

async fn send(http: &reqwest::Client, base: &str, body: String, stream: bool) -> Sent {
    let start = Instant::now();
    let sent = http
        .post(format!("{base}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await;
    let response = match sent {
        Ok(r) => r,
        Err(e) => {
            return Sent {
                answer: Answer::Violation(format!("no answer: {e}")),
                id: String::new(),
                elapsed: start.elapsed(),
            };
        }
    };
    let status = response.status().as_u16();
    let id = header(&response, "holdfast-request-id");
    let code = header(&response, "holdfast-error");
    let should_retry = header(&response, "x-should-retry");
    let retry_after_ms = header(&response, "retry-after-ms");
    let bytes = response.bytes().await;
    let elapsed = start.elapsed();
    let answer = match (status, bytes) {
        (_, Err(e)) => Answer::Violation(format!("{status}, then the body broke: {e}")),
        (200, Ok(bytes)) if !stream => match serde_json::from_slice::<Value>(&bytes) {
            Ok(v) if v["choices"].is_array() => Answer::Succeeded,
            _ => Answer::Violation(format!("200 that is no completion: {bytes:?}")),
        },
        (200, Ok(bytes)) => {
            let text = String::from_utf8_lossy(&bytes);
            if text.contains("data: [DONE]") {
                Answer::Succeeded
            } else if text.contains("attempt_abandoned") {
                Answer::StreamEnded { abandoned: true }
            } else if text.contains("store_unavailable") {
                Answer::StreamEnded { abandoned: false }
            } else {
                Answer::Violation(format!("a stream without its end: {text}"))
            }
        }
        (503, Ok(bytes)) => {
            let ms: Option<u64> = retry_after_ms.parse().ok();
            if matches!(code.as_str(), "store_unavailable" | "overloaded")
                && should_retry == "true"
                && ms.is_some_and(|ms| ms <= 60_000)
            {
                Answer::Refused
            } else {
                Answer::Violation(format!(
                    "503 {code}, x-should-retry {should_retry:?}, retry-after-ms \
                     {retry_after_ms:?}: {bytes:?}"
                ))
            }
        }
        (status, Ok(bytes)) => Answer::Violation(format!("{status} {code}: {bytes:?}")),
    };
    Sent {
        answer,
        id,
        elapsed,
    }
}

/// Waits until the clients have `n` more successes than `from` (at most 90 s).
async fn successes_after(tally: &Mutex<Tally>, from: u64, n: u64, what: &str) -> u64 {
    let start = Instant::now();
    loop {
        let now = tally.lock().unwrap().succeeded;
        if now >= from + n {
            return now;
        }
        assert!(
            start.elapsed() < Duration::from_secs(90),
            "{what}: {} successes in 90 s, wanted {n}: {:?}",
            now - from,
            tally.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Every request in the log, through `GET /requests` on `base`.
async fn every_record(http: &reqwest::Client, base: &str) -> Vec<Value> {
    let mut all = Vec::new();
    let mut cursor: Option<String> = None;
    for _page in 0..100 {
        let mut url = format!("{base}/requests?limit=500");
        if let Some(c) = &cursor {
            url.push_str(&format!("&cursor={c}"));
        }
        let page: Value = http.get(&url).send().await.unwrap().json().await.unwrap();
        all.extend(page["data"].as_array().unwrap().iter().cloned());
        cursor = page["next_cursor"].as_str().map(str::to_owned);
        if cursor.is_none() {
            return all;
        }
    }
    panic!("more than 100 pages of requests");
}

fn node_toml(url: &str, mock_base: &str) -> String {
    format!(
        r#"
database_url = "{url}"
database_pool_size = 6
[workers]
lease_secs = 2
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

#[tokio::test]
async fn postgres_down_for_5s_twice_under_load_every_answer_succeeds_or_is_retryable_and_every_request_ends_terminal_rs8_lc4_du3()
 {
    let mut pg = PrivatePostgres::create().await;
    let mock = start_mock(MockConfig {
        chunks: 10,
        chunk_delay_ms: 20,
        header_delay_ms: 50,
        ..MockConfig::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let toml = node_toml(&pg.url(), &mock.base_url());
    let mut nodes = Vec::new();
    for n in 0..2 {
        let node_dir = dir.path().join(format!("node{n}"));
        std::fs::create_dir(&node_dir).unwrap();
        nodes.push(Process::serve_logged(&node_dir, &toml, free_addr(), &[]).await);
    }
    let pids: Vec<u32> = nodes.iter().map(|n| n.child.id()).collect();
    let bases = Arc::new(nodes.iter().map(|n| n.base.clone()).collect::<Vec<_>>());

    let tally = Arc::new(Mutex::new(Tally::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let next = Arc::new(AtomicU64::new(0));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            tokio::spawn(client(
                Arc::clone(&bases),
                Arc::clone(&next),
                Arc::clone(&stop),
                Arc::clone(&tally),
            ))
        })
        .collect();

    // Load, then the faults, each followed by proof that service resumed.
    let mut seen = successes_after(&tally, 0, SUCCESSES_PER_PHASE, "load before the faults").await;
    let mut outages = Vec::new();
    for (mode, signal) in [("fast", libc::SIGINT), ("immediate", libc::SIGQUIT)] {
        pg.stop(signal).await;
        let down = Instant::now();
        // The fault is a duration: the server stays down this long whatever happens.
        tokio::time::sleep(OUTAGE).await;
        pg.start().await;
        let back = Instant::now();
        seen = successes_after(
            &tally,
            seen,
            SUCCESSES_PER_PHASE,
            &format!("service after the {mode} shutdown"),
        )
        .await;
        outages.push(format!(
            "{mode}: down {:.1} s, {SUCCESSES_PER_PHASE} successes {:.1} s after it returned",
            (back - down).as_secs_f64(),
            back.elapsed().as_secs_f64()
        ));
    }
    stop.store(true, Ordering::SeqCst);
    for c in clients {
        tokio::time::timeout(ANSWER_LIMIT + Duration::from_secs(10), c)
            .await
            .expect("clients finish")
            .unwrap();
    }
    let tally = std::mem::take(&mut *tally.lock().unwrap());
    assert!(
        tally.violations.is_empty(),
        "every answer is a success or a retryable refusal; {} were not:\n{}",
        tally.violations.len(),
        tally.violations.join("\n")
    );
    for (node, pid) in nodes.iter_mut().zip(&pids) {
        assert!(
            node.child.try_wait().unwrap().is_none(),
            "node {pid} stayed up"
        );
    }

    // After: every recorded request ends terminal, on the nodes that lived through it.
    let http = reqwest::Client::new();
    let settle = Instant::now();
    let records = loop {
        let records = every_record(&http, &bases[0]).await;
        let open: Vec<&Value> = records
            .iter()
            .filter(|r| !matches!(r["status"].as_str(), Some("succeeded" | "failed")))
            .collect();
        if open.is_empty() {
            break records;
        }
        assert!(
            settle.elapsed() < Duration::from_secs(90),
            "{} requests still not terminal 90 s after the last fault, e.g. {}",
            open.len(),
            open[0]
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let settled_in = settle.elapsed();
    let recorded: HashSet<&str> = records.iter().filter_map(|r| r["id"].as_str()).collect();
    for id in &tally.ids {
        assert!(
            recorded.contains(id.as_str()),
            "request {id} was named to a client but is not in the log"
        );
    }
    let failed: Vec<&Value> = records.iter().filter(|r| r["status"] == "failed").collect();
    assert!(failed.is_empty(), "failed requests: {failed:?}");
    let attempts: u64 = records
        .iter()
        .map(|r| r["attempts"].as_u64().unwrap())
        .sum();
    let recoveries: u64 = records
        .iter()
        .map(|r| r["recoveries"].as_u64().unwrap())
        .sum();
    let calls = mock.calls();
    assert!(
        calls <= attempts,
        "each attempt called the provider at most once: {calls} calls, {attempts} attempts"
    );
    println!("pg_outage: {}", outages.join("; "));
    println!(
        "pg_outage: answers={} succeeded={} refused_503_retryable={} \
         stream_error_event_store_unavailable={} stream_error_event_attempt_abandoned={} \
         violations=0 slowest_answer={:.1}s; recorded={} all terminal {:.1}s after the load \
         stopped (succeeded={}, failed=0); attempts={attempts} recoveries={recoveries} \
         provider_calls={calls}; server starts={}",
        tally.succeeded
            + tally.refused_retryable
            + tally.stream_store_unavailable
            + tally.stream_attempt_abandoned,
        tally.succeeded,
        tally.refused_retryable,
        tally.stream_store_unavailable,
        tally.stream_attempt_abandoned,
        tally.slowest.as_secs_f64(),
        records.len(),
        settled_in.as_secs_f64(),
        records.len(),
        pg.starts,
    );
    drop(nodes);
    mock.shutdown().await;
}
