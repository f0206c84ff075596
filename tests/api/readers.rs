//! Many and slow readers of one live stream (issue 18): 1,000 log readers follow a stream while
//! it is written, and 100 more connect with a 4 KiB receive buffer and read nothing until the
//! stream has ended. Asserted:
//! - the stream's writer is never blocked by a reader: the stream completes — the client's
//!   answer through `[DONE]`, the record `succeeded` — while the 100 slow readers have still
//!   read nothing (the time it took, against the same stream with no reader, is printed: the
//!   readers take CPU; a speed bound belongs in a benchmark, not here);
//! - every reader, fast or slow, gets the whole stored log in order: consecutive seqs from the
//!   first chunk through `end` (RD-2, RD-4); a slow reader's connection was behind the
//!   in-memory fan-out and caught up from the store;
//! - memory is bounded: the process's peak RSS while the 1,100 readers are connected is at
//!   most [`READERS_MEMORY_MIB`] above its RSS before them (measured, debug build: see the
//!   const), and its open sockets return to where they were once the readers are gone.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use holdfast::mock::MockConfig;
use holdfast::sse::{SseEvent, SseParser};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

use crate::helpers::*;

const FAST_READERS: usize = 1000;
const SLOW_READERS: usize = 100;
/// The slow readers' `SO_RCVBUF`.
const SLOW_RCVBUF: u32 = 4096;
/// Content events of the stream and the mock's delay before each: a stream of about 12 s.
const CHUNKS: u32 = 200;
const CHUNK_DELAY_MS: u64 = 60;
/// The readers' memory bound: about 120 KiB per reader connection, twice what was measured
/// (+61 to +63 MiB for the 1,100 readers, debug build, 2-core machine; docs/reliability.md).
const READERS_MEMORY_MIB: u64 = 128;
/// A long model name, which the mock repeats in every event: about 1.6 KiB per event, 330 KiB
/// per log, far more than a stalled reader's socket buffers and the server's hold.
fn long_model() -> String {
    format!("gpt-4o-mini-{}", "0123456789abcdef".repeat(48))
}

/// The process's open sockets.
fn sockets(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("proc fd")
        .flatten()
        .filter(|e| {
            std::fs::read_link(e.path())
                .is_ok_and(|target| target.to_string_lossy().starts_with("socket:"))
        })
        .count()
}

/// POSTs a stream and reads it to `[DONE]`; returns its id (sent on `id_tx` as soon as the
/// headers arrive) and how long the whole answer took.
async fn stream_client(
    http: &reqwest::Client,
    base: &str,
    text: &str,
    id_tx: Option<tokio::sync::oneshot::Sender<String>>,
) -> (String, Duration) {
    let start = Instant::now();
    let r = http
        .post(format!("{base}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(
            serde_json::json!({
                "model": long_model(),
                "stream": true,
                "messages": [{"role": "user", "content": text}],
            })
            .to_string(),
        )
        .send()
        .await
        .expect("POST stream");
    assert_eq!(r.status(), 200);
    let id = header(&r, "holdfast-request-id");
    if let Some(tx) = id_tx {
        tx.send(id.clone()).unwrap();
    }
    let body = r.text().await.expect("the stream");
    assert!(body.contains("data: [DONE]"), "the stream completes");
    (id, start.elapsed())
}

/// Seconds since midnight of an RFC 3339 UTC time (`2026-12-01T11:10:00.123Z`).
fn day_secs(t: &str) -> f64 {
    let time = t.split('T').nth(1).expect("a time").trim_end_matches('Z');
    let mut parts = time.split(':').map(|p| p.parse::<f64>().expect("a number"));
    let (h, m, s) = (
        parts.next().unwrap(),
        parts.next().unwrap(),
        parts.next().unwrap(),
    );
    h * 3600.0 + m * 60.0 + s
}

/// How long the request took to write, from its record: `created_at` to `finished_at`.
async fn write_time(http: &reqwest::Client, base: &str, id: &str) -> Duration {
    let record = wait_terminal(http, base, id, Duration::from_secs(60)).await;
    assert_eq!(record["status"], "succeeded", "{record}");
    let mut secs = day_secs(record["finished_at"].as_str().unwrap())
        - day_secs(record["created_at"].as_str().unwrap());
    if secs < 0.0 {
        secs += 86_400.0; // across midnight
    }
    Duration::from_secs_f64(secs)
}

/// The seqs of log events, asserted consecutive and ending with `end`.
fn assert_whole_log(who: &str, events: &[SseEvent], stored: usize) {
    let seqs: Vec<i64> = events
        .iter()
        .map(|e| e.id.as_deref().expect("id").parse().expect("seq"))
        .collect();
    assert!(
        seqs.windows(2).all(|w| w[1] == w[0] + 1),
        "{who}: consecutive seqs: {seqs:?}"
    );
    assert_eq!(
        events.last().and_then(|e| e.event.as_deref()),
        Some("end"),
        "{who}: ends with `end`"
    );
    assert_eq!(events.len(), stored, "{who}: the whole stored log");
}

/// A reader that follows `GET /requests/{id}` as it is written.
async fn fast_reader(http: reqwest::Client, base: Arc<String>, id: Arc<String>) -> Vec<SseEvent> {
    let mut response = get_events(&http, &base, &id, None).await;
    assert_eq!(response.status(), 200);
    let mut parser = SseParser::new();
    let mut events = Vec::new();
    while let Some(piece) = response.chunk().await.expect("read the log") {
        events.extend(parser.push(&piece).expect("valid SSE"));
    }
    events
}

/// Connects with a small receive buffer and sends `GET /requests/{id}`; reads nothing.
async fn slow_reader(addr: SocketAddr, id: &str) -> TcpStream {
    let socket = TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(SLOW_RCVBUF).unwrap();
    let mut stream = socket.connect(addr).await.expect("connect");
    let request =
        format!("GET /requests/{id} HTTP/1.1\r\nhost: {addr}\r\naccept: text/event-stream\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    stream
}

/// Reads a slow reader's whole answer (1 KiB per read) and returns its SSE events; the body
/// is chunked (HTTP/1.1) and ends with the zero-size chunk.
async fn read_slow(mut stream: TcpStream) -> Vec<SseEvent> {
    let mut raw = Vec::new();
    let mut buf = [0u8; 1024];
    let body_start = loop {
        if let Some(i) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = stream.read(&mut buf).await.expect("read");
        assert!(n > 0, "the answer's head");
        raw.extend_from_slice(&buf[..n]);
    };
    let head = String::from_utf8_lossy(&raw[..body_start]).to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(head.contains("transfer-encoding: chunked"), "{head}");
    // De-chunk as the bytes come.
    let mut parser = SseParser::new();
    let mut events = Vec::new();
    let mut pending = raw[body_start..].to_vec();
    loop {
        // One chunk: size line, data, CRLF.
        let parsed = pending
            .windows(2)
            .position(|w| w == b"\r\n")
            .and_then(|line_end| {
                let size = usize::from_str_radix(
                    std::str::from_utf8(&pending[..line_end]).ok()?.trim(),
                    16,
                )
                .ok()?;
                let data_end = line_end + 2 + size;
                (pending.len() >= data_end + 2).then_some((line_end + 2, size, data_end + 2))
            });
        if let Some((from, size, next)) = parsed {
            if size == 0 {
                return events;
            }
            events.extend(parser.push(&pending[from..from + size]).expect("valid SSE"));
            pending.drain(..next);
            continue;
        }
        let n = tokio::time::timeout(Duration::from_secs(30), stream.read(&mut buf))
            .await
            .expect("the slow reader's answer continues")
            .expect("read");
        assert!(n > 0, "the connection ended before the last chunk");
        pending.extend_from_slice(&buf[..n]);
    }
}

#[tokio::test]
async fn a_thousand_live_readers_and_a_hundred_stalled_ones_never_block_the_writer_and_each_get_the_whole_log_rd4()
 {
    let mock = start_mock(MockConfig {
        chunks: CHUNKS,
        chunk_delay_ms: CHUNK_DELAY_MS,
        ..MockConfig::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let toml = format!(
        r#"
database_url = "sqlite://{db}"
[[backends]]
name = "mock"
kind = "openai"
base_url = "{mock}"
"#,
        db = dir.path().join("holdfast.db").display(),
        mock = mock.base_url()
    );
    let addr = free_addr();
    let node = Process::serve_logged(dir.path(), &toml, addr, &[]).await;
    let pid = node.child.id();
    let base = Arc::new(node.base.clone());
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();

    // The same stream with no reader: the writer's pace, and the memory before the readers.
    let (alone_id, alone_answer) = stream_client(&http, &base, "readers baseline", None).await;
    let alone = write_time(&http, &base, &alone_id).await;
    let rss_before = rss_kib(pid);
    let fds_before = fds(pid);
    let sockets_before = sockets(pid);

    let (id_tx, id_rx) = tokio::sync::oneshot::channel();
    let writer = {
        let (http, base) = (http.clone(), Arc::clone(&base));
        tokio::spawn(async move { stream_client(&http, &base, "readers", Some(id_tx)).await })
    };
    let id = Arc::new(id_rx.await.unwrap());
    let mut slow = Vec::new();
    for _ in 0..SLOW_READERS {
        slow.push(slow_reader(addr, &id).await);
    }
    let done = Arc::new(AtomicU64::new(0));
    let fast: Vec<_> = (0..FAST_READERS)
        .map(|_| {
            let (http, base, id, done) = (
                http.clone(),
                Arc::clone(&base),
                Arc::clone(&id),
                Arc::clone(&done),
            );
            tokio::spawn(async move {
                let events = fast_reader(http, base, id).await;
                done.fetch_add(1, Ordering::SeqCst);
                events
            })
        })
        .collect();

    // Sample memory until the stream and every fast reader are done (at most 120 s).
    let mut rss_peak = rss_before;
    let mut fds_peak = fds_before;
    let start = Instant::now();
    while !(writer.is_finished() && done.load(Ordering::SeqCst) == FAST_READERS as u64) {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "the stream and its readers did not finish in 120 s ({} readers done)",
            done.load(Ordering::SeqCst)
        );
        rss_peak = rss_peak.max(rss_kib(pid));
        fds_peak = fds_peak.max(fds(pid));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (writer_id, with_readers_answer) = writer.await.unwrap();
    assert_eq!(&writer_id, &*id);
    // The slow readers have read nothing yet, and the stream is over.
    let with_readers = write_time(&http, &base, &id).await;
    let (stored_text, stored) = read_events(get_events(&http, &base, &id, Some("0")).await).await;
    let (stored_bytes, stored) = (stored_text.len(), stored.len());
    for (n, reader) in fast.into_iter().enumerate() {
        assert_whole_log(&format!("fast reader {n}"), &reader.await.unwrap(), stored);
    }
    let slow_reads = futures::future::join_all(slow.into_iter().map(read_slow)).await;
    for (n, events) in slow_reads.iter().enumerate() {
        assert_whole_log(&format!("slow reader {n}"), events, stored);
    }
    rss_peak = rss_peak.max(rss_kib(pid));
    let grew_mib = rss_peak.saturating_sub(rss_before) / 1024;

    // Every reader gone: the process's sockets return to where they were (at most 10 s).
    let settle = Instant::now();
    let sockets_after = loop {
        let now = sockets(pid);
        if now <= sockets_before || settle.elapsed() > Duration::from_secs(10) {
            break now;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let fds_after = fds(pid);
    println!(
        "readers: {FAST_READERS} live + {SLOW_READERS} stalled (SO_RCVBUF {SLOW_RCVBUF}) on a \
         stream of {stored} log events ({} KiB); stream written in {:.2} s alone, {:.2} s with the readers \
         (its client's answer {:.2} s, {:.2} s); RSS {:.1} MiB \
         before, peak {:.1} MiB (+{grew_mib} MiB, bound {READERS_MEMORY_MIB}); fds {fds_before} \
         before, peak {fds_peak}, after {fds_after}; sockets {sockets_before} before, \
         {sockets_after} after",
        stored_bytes / 1024,
        alone.as_secs_f64(),
        with_readers.as_secs_f64(),
        alone_answer.as_secs_f64(),
        with_readers_answer.as_secs_f64(),
        rss_before as f64 / 1024.0,
        rss_peak as f64 / 1024.0,
    );
    assert!(
        sockets_after <= sockets_before,
        "every reader's connection is closed: {sockets_after} sockets, {sockets_before} before"
    );
    // Other fds may stay: the store's read connections (at most 8, each with its database and
    // WAL files) opened under the readers' load.
    assert!(
        fds_after <= fds_before + 16,
        "open fds {fds_after}, {fds_before} before the readers"
    );
    assert!(
        grew_mib <= READERS_MEMORY_MIB,
        "the readers cost at most {READERS_MEMORY_MIB} MiB: +{grew_mib} MiB"
    );
    drop(node);
    mock.shutdown().await;
}
