//! Canonicalisation and hashing speed (SPEC ID-1..ID-3): `cargo bench --bench canonical`.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)] // criterion_group! makes an undocumented pub fn

use holdfast::canonical::{canonicalize, request_hash};

use criterion::{BenchmarkId, Criterion, Throughput, black_box, criterion_group, criterion_main};

/// A chat-completions-shaped body of roughly `target` bytes: a model, sampling settings and a
/// `messages` array whose contents mix ASCII, non-ASCII and escapes.
fn chat_body(target: usize) -> Vec<u8> {
    const CONTENTS: [&str; 4] = [
        r#"Summarise the following text in three bullet points.\nKeep it short, \"precise\" and cite line numbers like [1], [2]."#,
        r#"Voilà — the café's menu: crème brûlée, smørrebrød, 寿司 and ramen 🍜. Prices in € and ¥; tab\there, path C:\\temp\\x."#,
        r#"{\"tool\":\"search\",\"args\":{\"q\":\"rust json canonicalization\",\"limit\":10}} \u00e9\u2014\ud83d\ude00 end."#,
        r#"Plain assistant answer with enough words to look like a normal reply from a language model, nothing special in it at all."#,
    ];
    let mut body = String::from(
        r#"{"model":"gpt-4o-mini","temperature":0.7,"top_p":1.0,"max_tokens":1024,"stream":true,"messages":["#,
    );
    let mut i = 0;
    while body.len() < target.saturating_sub(64) {
        if i > 0 {
            body.push(',');
        }
        let role = ["system", "user", "assistant", "user"][i % 4];
        body.push_str(&format!(
            r#"{{"role":"{role}","content":"{} (turn {i})","name":"u{}"}}"#,
            CONTENTS[i % CONTENTS.len()],
            i % 7
        ));
        i += 1;
    }
    body.push_str(r#"],"user":"bench"}"#);
    body.into_bytes()
}

fn bench(c: &mut Criterion) {
    let headers = [("openai-beta", "assistants=v2")];
    for (label, size) in [("1KB", 1_000), ("100KB", 100_000), ("1MB", 1_000_000)] {
        let body = chat_body(size);
        let mut group = c.benchmark_group(format!("canonical/{label}"));
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_with_input(
            BenchmarkId::new("canonicalize+request_hash", body.len()),
            &body,
            |b, body| {
                b.iter(|| {
                    let canon = canonicalize(black_box(body)).expect("bench body is valid");
                    request_hash("/v1/chat/completions", "openai", &headers, &canon.bytes)
                })
            },
        );
        group.bench_with_input(
            BenchmarkId::new("serde_json::Value", body.len()),
            &body,
            |b, body| {
                b.iter(|| {
                    serde_json::from_slice::<serde_json::Value>(black_box(body))
                        .expect("bench body is valid")
                })
            },
        );
        group.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
