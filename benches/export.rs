//! `GET /requests/export` over a large log (issue 34; docs/benchmarks.md, "Export"): records per
//! second and the server's memory while it streams them.
//!
//! `cargo bench --bench export` fills a fresh SQLite file with `--count` requests (default
//! 100,000; every tenth one a stream of 22 stored events, the rest non-stream chat answers)
//! through the store API, starts `holdfast serve` on it, reads the whole export over HTTP and
//! prints the records, the wall time, records per second and the server's peak RSS (`VmHWM`,
//! and `VmRSS` polled every 20 ms). `-- --database-url postgres://...` does the same on that
//! PostgreSQL database; the requests go into a namespace of their own per run, and the export
//! reads that namespace only, so a database used before does not change the count.
//! `-- --format openai-chat` exports fine-tuning examples instead of records.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use holdfast::config::{Config, SqliteSynchronous};
use holdfast::provider::Route;
use holdfast::store::sqlite::SqliteStore;
use holdfast::store::{
    ChunkBatch, ClaimKind, DynStore, LeaseTo, NewChunk, NewRequest, Outcome, Submitted, Usage,
    now_ms,
};

const IN_FLIGHT: usize = 64;
/// Every this many requests, one is a stream.
const STREAM_EVERY: usize = 10;

fn body(run: u64, i: usize, stream: bool) -> Vec<u8> {
    format!(
        r#"{{"model":"gpt-4o-mini","stream":{stream},"messages":[{{"role":"system","content":"You are a terse assistant."}},{{"role":"user","content":"run {run} request {i}: say hello in one short sentence"}}]}}"#
    )
    .into_bytes()
}

fn answer() -> Vec<u8> {
    br#"{"id":"chatcmpl-bench","object":"chat.completion","created":1764547200,"model":"gpt-4o-mini","choices":[{"index":0,"message":{"role":"assistant","content":"Hello! This is a short answer from the mock provider."},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":11,"total_tokens":23}}"#.to_vec()
}

/// A chat stream's events: a role chunk, 20 content chunks, a finish chunk.
fn events() -> Vec<NewChunk> {
    let chunk = |delta: &str, finish: &str| {
        NewChunk {
        event: None,
        data: format!(
            r#"{{"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1764547200,"model":"gpt-4o-mini","choices":[{{"index":0,"delta":{delta},"finish_reason":{finish}}}]}}"#
        )
        .into(),
    }
    };
    let mut out = vec![chunk(r#"{"role":"assistant","content":""}"#, "null")];
    for i in 0..20 {
        out.push(chunk(&format!(r#"{{"content":" word{i}"}}"#), "null"));
    }
    out.push(chunk("{}", r#""stop""#));
    out
}

async fn one(store: &DynStore, namespace: &str, run: u64, i: usize) {
    let stream = i.is_multiple_of(STREAM_EVERY);
    let body = body(run, i, stream);
    let hash: [u8; 32] = {
        use sha2::Digest;
        sha2::Sha256::digest(&body).into()
    };
    let now = now_ms();
    let new = NewRequest {
        id: uuid::Uuid::now_v7(),
        namespace: namespace.to_string(),
        route: Route::OpenaiChat,
        backend: "mock".into(),
        model: Some("gpt-4o-mini".into()),
        stream,
        body,
        headers: vec![],
        hash,
        claim: ClaimKind::BodyHash,
        claim_key: hex::encode(hash),
        claim_expires_at: now + 600_000,
        now,
        trace_parent: None,
        callback_url: None,
        replay_of: None,
    };
    let owner = format!("bench/{i}");
    let (submitted, lease) = store
        .submit_and_lease(
            new,
            Some(LeaseTo {
                owner: &owner,
                lease_ms: 600_000,
            }),
        )
        .await
        .expect("submit");
    assert!(matches!(submitted, Submitted::Created(_)), "unique bodies");
    let lease = lease.expect("leased at submission");
    let usage = Some(Usage {
        input_tokens: Some(12),
        output_tokens: Some(11),
        ..Usage::default()
    });
    if stream {
        let batch = ChunkBatch {
            lease: lease.clone(),
            after: 0,
            chunks: events(),
            upstream_request_id: Some("req_bench".into()),
            response_id: None,
            usage,
        };
        let stored = store.append_chunks(&[batch]).await.expect("append");
        assert!(stored[0].is_some(), "the lease is held");
    }
    let outcome = Outcome::Succeeded {
        status: 200,
        body: if stream { Vec::new() } else { answer() },
        upstream_request_id: Some("req_bench".into()),
        response_id: None,
        usage,
    };
    let done = store
        .finish(&lease, outcome, now_ms())
        .await
        .expect("finish");
    assert!(done, "the lease is held");
}

/// Fills the log with `count` requests, `IN_FLIGHT` at a time.
async fn fill(store: &DynStore, namespace: &str, count: usize) {
    let run = now_ms() as u64;
    let next = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..IN_FLIGHT)
        .map(|_| {
            let (store, next, namespace) =
                (Arc::clone(store), Arc::clone(&next), namespace.to_string());
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= count {
                        break;
                    }
                    one(&store, &namespace, run, i).await;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("task");
    }
}

/// `VmRSS` and `VmHWM` of `pid`, in KiB.
fn memory_kib(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

fn main() {
    let mut count = 100_000usize;
    let mut database_url = std::env::var("HOLDFAST_BENCH_DATABASE_URL").ok();
    let mut format = "records".to_string();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--count" => count = args.next().and_then(|n| n.parse().ok()).expect("--count N"),
            "--database-url" => database_url = args.next(),
            "--format" => format = args.next().expect("--format records|openai-chat"),
            _ => {} // cargo bench passes --bench
        }
    }
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(async {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = database_url
            .clone()
            .unwrap_or_else(|| format!("sqlite://{}", dir.path().join("export.db").display()));
        let namespace = format!("bench-{}", uuid::Uuid::new_v4().simple());
        let filled = Instant::now();
        {
            let store: DynStore = if url.starts_with("sqlite:") {
                Arc::new(
                    SqliteStore::open(&url, SqliteSynchronous::Normal)
                        .await
                        .expect("open"),
                )
            } else {
                let config = Config {
                    database_url: url.clone(),
                    ..Config::default()
                };
                holdfast::store::open(&config).await.expect("open")
            };
            fill(&store, &namespace, count).await;
        }
        let kind = if url.starts_with("sqlite:") {
            "sqlite"
        } else {
            "postgres"
        };
        println!(
            "{kind}: {count} requests logged in {:.1} s",
            filled.elapsed().as_secs_f64()
        );

        let addr = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let toml = format!(
            r#"listen = "{addr}"
database_url = "{url}"
[[backends]]
name = "mock"
kind = "openai"
base_url = "http://127.0.0.1:9/v1"
[[namespaces]]
name = "{namespace}"
api_keys = ["bench-key"]
"#
        );
        let config_path = dir.path().join("holdfast.toml");
        std::fs::write(&config_path, toml).unwrap();
        let base = format!("http://{addr}");
        let http = reqwest::Client::new();
        // The filling store lets go of the SQLite file's lock from its own threads, a moment
        // after it is dropped: a holdfast started in that moment is refused, and started again.
        let mut tries = 0;
        let mut child = loop {
            let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_holdfast"))
                .args(["serve", "--config"])
                .arg(&config_path)
                .env("RUST_LOG", "holdfast=warn")
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .expect("start holdfast");
            let ready = Instant::now();
            let up = loop {
                let answered = http.get(format!("{base}/readyz")).send().await;
                if answered.is_ok_and(|r| r.status().is_success()) {
                    break true;
                }
                if child.try_wait().expect("wait").is_some() {
                    break false;
                }
                assert!(
                    ready.elapsed() < Duration::from_secs(60),
                    "holdfast did not start"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            };
            if up {
                break child;
            }
            tries += 1;
            assert!(tries < 50, "holdfast kept exiting at start");
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let pid = child.id();
        let (before, _) = memory_kib(pid);

        let peak = Arc::new(AtomicU64::new(0));
        let sampler = {
            let peak = Arc::clone(&peak);
            tokio::spawn(async move {
                loop {
                    peak.fetch_max(memory_kib(pid).0, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            })
        };
        let started = Instant::now();
        let response = http
            .get(format!("{base}/requests/export?format={format}"))
            .bearer_auth("bench-key")
            .send()
            .await
            .expect("export");
        assert!(response.status().is_success(), "{}", response.status());
        let (mut lines, mut bytes) = (0u64, 0u64);
        let mut body = response.bytes_stream();
        while let Some(chunk) = body.next().await {
            let chunk = chunk.expect("the export broke off");
            bytes += chunk.len() as u64;
            lines += chunk.iter().filter(|b| **b == b'\n').count() as u64;
        }
        let wall = started.elapsed().as_secs_f64();
        sampler.abort();
        let (_, hwm) = memory_kib(pid);
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(lines as usize, count, "every request once");
        println!(
            "{kind} export ({format}): {lines} lines, {:.1} MB in {wall:.2} s: {:.0} records/s; \
             holdfast RSS before {:.0} MiB, peak polled {:.0} MiB, VmHWM {:.0} MiB",
            bytes as f64 / 1e6,
            lines as f64 / wall,
            before as f64 / 1024.0,
            peak.load(Ordering::Relaxed) as f64 / 1024.0,
            hwm as f64 / 1024.0,
        );
    });
}
