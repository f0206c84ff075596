//! Chunk persistence throughput: many concurrent streams storing events one at a time through
//! the group-commit writer, as workers do (SPEC LC-3; issue "Streams", acceptance 7).
//!
//! `cargo bench --bench chunks` reports chunks per second (criterion's "elem/s") for 1, 16 and
//! 256 concurrent streams with 100-byte prompts and 256 with 50 KB prompts, each appending 64
//! events of ~120 bytes, on a SQLite file in WAL mode with `synchronous = FULL` and `NORMAL`.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)] // criterion_group! makes an undocumented pub fn

use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use holdfast::ChunkWriter;
use holdfast::config::SqliteSynchronous;
use holdfast::provider::Route;
use holdfast::store::ChunkBatch;
use holdfast::store::sqlite::SqliteStore;
use holdfast::store::{ClaimKind, DynStore, Lease, NewChunk, NewRequest, now_ms};

const EVENTS_PER_STREAM: usize = 64;

async fn leased_streams(store: &DynStore, n: usize, prompt_bytes: usize) -> Vec<Lease> {
    for i in 0..n {
        let hash = {
            let mut h = [0u8; 32];
            h[..8].copy_from_slice(&(i as u64).to_be_bytes());
            h[8..16].copy_from_slice(&(now_ms() as u64).to_be_bytes());
            h
        };
        store
            .submit(NewRequest {
                id: uuid::Uuid::now_v7(),
                namespace: "default".into(),
                route: Route::OpenaiChat,
                backend: "bench".into(),
                model: Some("gpt-4o-mini".into()),
                stream: true,
                body: prompt(prompt_bytes),
                headers: vec![],
                hash,
                claim: ClaimKind::BodyHash,
                claim_key: hex::encode(hash),
                claim_expires_at: now_ms() + 600_000,
                now: now_ms(),
                trace_parent: None,
                callback_url: None,
                replay_of: None,
            })
            .await
            .expect("submit");
    }
    let mut leases = Vec::with_capacity(n);
    while let Some((lease, _)) = store
        .lease(
            &format!("bench/{}", uuid::Uuid::new_v4()),
            now_ms(),
            3_600_000,
        )
        .await
        .expect("lease")
    {
        leases.push(lease);
    }
    leases
}

/// A request body of `bytes` bytes: a chat request with one long user message.
fn prompt(bytes: usize) -> Vec<u8> {
    let head = r#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":""#;
    let tail = r#""}],"stream":true}"#;
    let text = "lorem ipsum ".repeat(bytes.saturating_sub(head.len() + tail.len()) / 12 + 1);
    format!("{head}{text}{tail}").into_bytes()
}

fn event(i: usize) -> NewChunk {
    NewChunk {
        event: None,
        data: format!(
            r#"{{"id":"chatcmpl-bench","object":"chat.completion.chunk","choices":[{{"index":0,"delta":{{"content":" word{i}"}}}}]}}"#
        )
        .into(),
    }
}

fn bench(c: &mut Criterion) {
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let mut group = c.benchmark_group("chunks_persisted");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(8));
    for (label, sync) in [
        ("full", SqliteSynchronous::Full),
        ("normal", SqliteSynchronous::Normal),
    ] {
        // Prompts of 100 bytes, and of 50 KB as long conversations and retrieved documents
        // make them: a request row rewritten with its prompt at every batch was four times
        // slower with the long ones (decision 35).
        for (streams, prompt_bytes, id) in [
            (1usize, 100usize, "1"),
            (16, 100, "16"),
            (256, 100, "256"),
            (256, 50_000, "256 x 50 KB prompts"),
        ] {
            group.throughput(Throughput::Elements((streams * EVENTS_PER_STREAM) as u64));
            group.bench_with_input(BenchmarkId::new(label, id), &streams, |b, &streams| {
                b.iter_custom(|iters| {
                    runtime.block_on(async {
                        let mut total = Duration::ZERO;
                        for _ in 0..iters {
                            let dir = tempfile::tempdir().expect("tempdir");
                            let url = format!("sqlite://{}", dir.path().join("bench.db").display());
                            let store: DynStore = std::sync::Arc::new(
                                SqliteStore::open(&url, sync).await.expect("open"),
                            );
                            let leases = leased_streams(&store, streams, prompt_bytes).await;
                            let writer = ChunkWriter::spawn(store.clone(), Duration::from_secs(30));
                            let start = Instant::now();
                            let tasks: Vec<_> = leases
                                .into_iter()
                                .map(|lease| {
                                    let writer = writer.clone();
                                    tokio::spawn(async move {
                                        for i in 0..EVENTS_PER_STREAM {
                                            let batch = ChunkBatch {
                                                lease: lease.clone(),
                                                after: i64::try_from(i).expect("seq"),
                                                chunks: vec![event(i)],
                                                upstream_request_id: None,
                                                response_id: None,
                                                usage: None,
                                            };
                                            writer.append(batch).await.expect("append");
                                        }
                                    })
                                })
                                .collect();
                            for t in tasks {
                                t.await.expect("task");
                            }
                            total += start.elapsed();
                        }
                        total
                    })
                });
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
