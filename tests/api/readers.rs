//! Many and slow readers of one live stream (issue 18): a thousand log readers and a hundred
//! that stop reading, on a stream the provider is still sending. The stream's writer never
//! waits for a reader, every reader gets the whole sequence in order, and the server's memory
//! stays bounded (RD-2, RD-4).

use std::time::Duration;

use futures::future::join_all;
use holdfast::mock::MockConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::helpers::*;

/// Readers that read everything as it comes.
const FAST_READERS: usize = 1_000;
/// Readers with a 4 KiB receive buffer that read nothing until the stream is over.
const STALLED_READERS: usize = 100;
/// Content events of the stream (each ~0.2 KB as stored), 5 ms apart: about 3 s live.
const CHUNKS: u32 = 600;
/// The bound on the server's peak resident memory with all of them attached: 1,100 readers
/// of a 604-chunk stream peaked at 128–136 MiB here (debug build; ~15 MiB idle), about
/// 110 KiB per reader — its connection's buffers, its task, its hub subscription and at most
/// one page of chunks read back from the store; never the whole stream.
const PEAK_RSS_BOUND_KIB: u64 = 200 * 1024;

fn toml(dir: &std::path::Path, mock_base: &str) -> String {
    format!(
        r#"database_url = "sqlite://{}"
[workers]
lease_secs = 5
[[backends]]
name = "mock"
kind = "openai"
base_url = "{mock_base}"
"#,
        dir.join("holdfast.db").display()
    )
}

/// `VmHWM` (peak resident set) of `pid`, KiB.
fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmHWM in /proc/<pid>/status")
}

/// The seqs (`id:` fields) of `events` are 1, 2, 3, ... and the last event is `end`.
fn assert_whole_sequence(events: &[holdfast::sse::SseEvent], last_seq: i64, who: &str) {
    let seqs: Vec<i64> = events
        .iter()
        .filter_map(|e| e.id.as_deref().and_then(|id| id.parse().ok()))
        .collect();
    let expected: Vec<i64> = (1..=last_seq).collect();
    assert_eq!(seqs, expected, "{who}: not the whole sequence in order");
    assert_eq!(
        events.last().and_then(|e| e.event.as_deref()),
        Some("end"),
        "{who}: no end event"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_readers_and_a_hundred_stalled_ones_never_hold_up_the_stream_rd4() {
    let mock = start_mock(MockConfig {
        chunks: CHUNKS,
        chunk_delay_ms: 5,
        ..MockConfig::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let addr = free_addr();
    let node = Process::serve(dir.path(), &toml(dir.path(), &mock.base_url()), addr).await;
    let pid = node.child.id();
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();

    let submitter = http
        .post(format!("{}/v1/chat/completions", node.base))
        .header("content-type", "application/json")
        .body(stream_body("a stream read by a thousand"))
        .send()
        .await
        .unwrap();
    assert_eq!(submitter.status(), 200);
    let id = header(&submitter, "holdfast-request-id");

    // The stalled readers: HTTP/1.0 (the body is the raw event stream, closed at its end),
    // a 4 KiB receive buffer, and nothing read.
    let mut stalled = Vec::new();
    for _ in 0..STALLED_READERS {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(4096).unwrap();
        let mut stream = socket.connect(addr).await.unwrap();
        stream
            .write_all(
                format!(
                    "GET /requests/{id} HTTP/1.0\r\nHost: {addr}\r\n\
                     Accept: text/event-stream\r\nLast-Event-ID: 0\r\n\r\n"
                )
                .as_bytes(),
            )
            .await
            .unwrap();
        stalled.push(stream);
    }

    // The fast readers attach while the provider is still sending.
    let fast = (0..FAST_READERS).map(|_| {
        let (http, base, id) = (http.clone(), node.base.clone(), id.clone());
        async move {
            let r = get_events(&http, &base, &id, Some("0")).await;
            assert_eq!(r.status(), 200);
            read_events(r).await.1
        }
    });
    let (fast, (_, submitted)) = tokio::join!(join_all(fast), read_events(submitter));
    assert_eq!(
        submitted.len() as u32,
        CHUNKS + 3,
        "role + pieces + finish + [DONE]"
    );

    // The request finished while a hundred readers had read nothing: its writer did not wait
    // for them.
    let record = get_record(&http, &node.base, &id).await;
    assert_eq!(record["status"], "succeeded", "{record}");
    let last_seq = record["last_seq"].as_i64().unwrap();
    assert_eq!(
        last_seq,
        i64::from(CHUNKS) + 4,
        "every event and the end chunk"
    );
    for (i, events) in fast.iter().enumerate() {
        assert_whole_sequence(events, last_seq, &format!("fast reader {i}"));
    }
    let peak = peak_rss_kib(pid);
    eprintln!(
        "{FAST_READERS} readers + {STALLED_READERS} stalled on {last_seq} chunks: peak RSS {} MiB",
        peak / 1024
    );
    assert!(
        peak < PEAK_RSS_BOUND_KIB,
        "peak RSS {peak} KiB over the bound {PEAK_RSS_BOUND_KIB} KiB"
    );

    // Now the stalled readers read: each gets the whole sequence, in order, and its end.
    let stalled = stalled
        .into_iter()
        .enumerate()
        .map(|(i, mut stream)| async move {
            let mut raw = Vec::new();
            tokio::time::timeout(Duration::from_secs(60), stream.read_to_end(&mut raw))
                .await
                .unwrap_or_else(|_| panic!("stalled reader {i} was never finished"))
                .unwrap();
            let text = String::from_utf8(raw).unwrap();
            let (head, body) = text.split_once("\r\n\r\n").expect("an HTTP response");
            assert!(
                head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"),
                "{head}"
            );
            let events = holdfast::sse::SseParser::new()
                .push(body.as_bytes())
                .expect("valid SSE");
            assert_whole_sequence(&events, last_seq, &format!("stalled reader {i}"));
        });
    join_all(stalled).await;
    assert_eq!(mock.calls(), 1);
}
