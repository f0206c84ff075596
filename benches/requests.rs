//! The store's cost of one non-stream request: its two writes (the submission, claimed and
//! leased in one, and the outcome with its usage and `end` chunk), with 64 requests in flight
//! through the SQLite group-commit writer, as workers make them (issue 17; docs/benchmarks.md).
//!
//! `cargo bench --bench requests` prints requests per second and the process's CPU per request
//! for SQLite `full` and `normal`, and the writer thread's share of it. `-- --count N` changes
//! the number of requests (default 20,000), `-- --in-flight N` how many run at once (default
//! 64: at 2, a commit holds about as few writes as a stream row's do); under `valgrind --tool=callgrind` a small count gives repeatable instruction counts
//! per statement.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::sync::Arc;
use std::time::Instant;

use holdfast::config::SqliteSynchronous;
use holdfast::provider::Route;
use holdfast::store::sqlite::SqliteStore;
use holdfast::store::{
    ClaimKind, DynStore, LeaseTo, NewRequest, Outcome, Submitted, Usage, now_ms,
};

/// A chat request body of the size the e2e bench sends, unique per `i`.
fn body(run: u64, i: usize) -> Vec<u8> {
    format!(
        r#"{{"model":"gpt-4o-mini","messages":[{{"role":"user","content":"run {run} request {i}: say hello in one short sentence"}}]}}"#
    )
    .into_bytes()
}

/// A chat completion answer of the size the mock provider sends.
fn answer() -> Vec<u8> {
    br#"{"id":"chatcmpl-bench","object":"chat.completion","created":1764547200,"model":"gpt-4o-mini","choices":[{"index":0,"message":{"role":"assistant","content":"Hello! This is a short answer from the mock provider."},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":11,"total_tokens":23}}"#.to_vec()
}

fn request(run: u64, i: usize) -> NewRequest {
    let body = body(run, i);
    let hash: [u8; 32] = {
        use sha2::Digest;
        sha2::Sha256::digest(&body).into()
    };
    NewRequest {
        id: uuid::Uuid::now_v7(),
        namespace: "default".into(),
        route: Route::OpenaiChat,
        backend: "openai".into(),
        model: Some("gpt-4o-mini".into()),
        stream: false,
        body,
        headers: vec![("content-type".into(), "application/json".into())],
        hash,
        claim: ClaimKind::BodyHash,
        claim_key: hex::encode(hash),
        claim_expires_at: now_ms() + 600_000,
        now: now_ms(),
        trace_parent: None,
        callback_url: None,
        replay_of: None,
    }
}

/// One request's two writes, as a worker makes them.
async fn one(store: &DynStore, run: u64, i: usize) {
    let owner = format!("bench/{i}");
    let (submitted, lease) = store
        .submit_and_lease(
            request(run, i),
            Some(LeaseTo {
                owner: &owner,
                lease_ms: 60_000,
            }),
        )
        .await
        .expect("submit");
    let Submitted::Created(leased) = submitted else {
        panic!("unique bodies");
    };
    let lease = lease.expect("leased at submission");
    let outcome = Outcome::Succeeded {
        status: 200,
        body: answer(),
        upstream_request_id: Some("req_bench".into()),
        response_id: None,
        usage: Some(Usage {
            input_tokens: Some(12),
            output_tokens: Some(11),
            ..Usage::default()
        }),
    };
    let record = store
        .finish_read(&lease, &leased, &outcome, now_ms())
        .await
        .expect("finish");
    assert!(record.is_some(), "the lease is held");
}

/// CPU seconds so far of each SQLite writer thread of this process, by thread id (each store
/// opened has one).
fn writer_cpu_secs() -> std::collections::BTreeMap<String, f64> {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Default::default();
    };
    tasks
        .flatten()
        .filter(|task| {
            std::fs::read_to_string(task.path().join("comm"))
                .is_ok_and(|comm| comm.trim() == holdfast::store::sqlite::WRITER_THREAD)
        })
        .filter_map(|task| {
            let stat = std::fs::read_to_string(task.path().join("stat")).ok()?;
            Some((
                task.file_name().to_string_lossy().into_owned(),
                stat_cpu_secs(&stat),
            ))
        })
        .collect()
}

/// The process's user + system CPU seconds so far.
fn cpu_secs() -> f64 {
    stat_cpu_secs(&std::fs::read_to_string("/proc/self/stat").expect("/proc/self/stat"))
}

/// User + system CPU seconds in a `/proc/.../stat` line.
fn stat_cpu_secs(stat: &str) -> f64 {
    // Fields after the command name: state is field 3, utime 14, stime 15.
    let rest = &stat[stat.rfind(')').expect("comm") + 2..];
    let fields: Vec<&str> = rest.split(' ').collect();
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    ticks / hz
}

fn main() {
    let (mut count, mut in_flight) = (20_000usize, 64usize);
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        if arg == "--count" {
            count = args.next().and_then(|n| n.parse().ok()).expect("--count N");
        } else if arg == "--in-flight" {
            in_flight = args
                .next()
                .and_then(|n| n.parse().ok())
                .expect("--in-flight N");
        }
    }
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    for (label, sync) in [
        ("full", SqliteSynchronous::Full),
        ("normal", SqliteSynchronous::Normal),
    ] {
        runtime.block_on(async {
            let dir = tempfile::tempdir().expect("temp dir");
            let url = format!("sqlite://{}", dir.path().join("bench.db").display());
            let store: DynStore = Arc::new(SqliteStore::open(&url, sync).await.expect("open"));
            let run = now_ms() as u64;
            // Warm-up: the statements prepared, the tables' first pages allocated.
            for i in 0..in_flight {
                one(&store, run, count + i).await;
            }
            let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let (started, cpu, writer) = (Instant::now(), cpu_secs(), writer_cpu_secs());
            let tasks: Vec<_> = (0..in_flight)
                .map(|_| {
                    let (store, next) = (Arc::clone(&store), Arc::clone(&next));
                    tokio::spawn(async move {
                        loop {
                            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            if i >= count {
                                break;
                            }
                            one(&store, run, i).await;
                        }
                    })
                })
                .collect();
            for task in tasks {
                task.await.expect("task");
            }
            let (wall, cpu) = (started.elapsed().as_secs_f64(), cpu_secs() - cpu);
            // The writer threads alive now, from what each had spent before (a new one: 0).
            let writer: f64 = writer_cpu_secs()
                .iter()
                .map(|(tid, now)| now - writer.get(tid).copied().unwrap_or(0.0))
                .sum();
            println!(
                "sqlite {label}: {count} requests at {in_flight} in flight: {:.0} requests/s, {:.1} µs CPU per request, {:.1} of it on the writer thread",
                count as f64 / wall,
                cpu * 1e6 / count as f64,
                writer * 1e6 / count as f64
            );
        });
    }
}
