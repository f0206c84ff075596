//! A commit whose answer never arrives (decision 36, LC-3, RD-4). PostgreSQL can commit a
//! statement and then lose the connection before its reply reaches holdfast (a restart, a
//! network cut); the chunk writer tries the commit again, and that second try must not store
//! the stream's events a second time. The cluster chaos test once caught exactly that (a reader
//! saw "fjord fjord") by chance; this test makes it happen every time, at the wire: a relay in
//! front of the server lets the append statement run and commit, swallows the server's answer
//! and cuts the connection.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use holdfast::ChunkWriter;
use holdfast::mock::MockConfig;
use holdfast::store::postgres::PostgresStore;
use holdfast::store::{ChunkBatch, ChunkKind, DynStore, NewChunk, Store, now_ms};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use serde_json::Value;

use super::submit;
use crate::helpers::*;
use crate::store_conformance::TestDatabase;

/// Text found only in the chunk append statement (`APPEND_CHUNKS`): its `Parse` message, the
/// first time a connection runs it, carries it.
const APPEND_STATEMENT: &[u8] = b"RETURNING b.grp";

/// A TCP relay in front of PostgreSQL that loses one answer. Once armed, the first client
/// message containing the armed text is passed on; the server's messages up to the statement's
/// `CommandComplete` are too, the rest is dropped up to the `ReadyForQuery` that follows it —
/// sent once the statement's implicit transaction has committed — and then that connection is
/// closed on both sides.
struct LosingRelay {
    port: u16,
    armed: Arc<std::sync::Mutex<Option<&'static [u8]>>>,
    answers_lost: Arc<AtomicUsize>,
}

impl LosingRelay {
    async fn start(server: String) -> LosingRelay {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind relay");
        let port = listener.local_addr().expect("relay address").port();
        let armed = Arc::new(std::sync::Mutex::new(None));
        let answers_lost = Arc::new(AtomicUsize::new(0));
        let (armed_in, lost_in) = (Arc::clone(&armed), Arc::clone(&answers_lost));
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let server = server.clone();
                let (armed, lost) = (Arc::clone(&armed_in), Arc::clone(&lost_in));
                tokio::spawn(async move {
                    if let Ok(upstream) = TcpStream::connect(&server).await {
                        relay(client, upstream, armed, lost).await;
                    }
                });
            }
        });
        LosingRelay {
            port,
            armed,
            answers_lost,
        }
    }

    /// A relay in front of `db`'s server, and `db`'s URL through it.
    async fn in_front_of(db: &TestDatabase) -> (LosingRelay, reqwest::Url) {
        let mut url = reqwest::Url::parse(&db.url).expect("database url");
        let server = format!(
            "{}:{}",
            url.host_str().expect("database host"),
            url.port().unwrap_or(5432)
        );
        let relay = LosingRelay::start(server).await;
        url.set_port(Some(relay.port)).expect("relay port");
        (relay, url)
    }

    /// Loses the answer to the next statement whose text contains `text`.
    fn lose_the_answer_to(&self, text: &'static [u8]) {
        *self.armed.lock().expect("armed") = Some(text);
    }
}

/// Relays one connection until either side closes, or until the answer it was armed to lose
/// has been swallowed.
async fn relay(
    client: TcpStream,
    server: TcpStream,
    armed: Arc<std::sync::Mutex<Option<&'static [u8]>>>,
    lost: Arc<AtomicUsize>,
) {
    let (mut from_client, mut to_client) = client.into_split();
    let (mut from_server, mut to_server) = server.into_split();
    let cutting = Arc::new(AtomicBool::new(false));
    let cut = Arc::clone(&cutting);
    let upward = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match from_client.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            {
                let mut armed = armed.lock().expect("armed");
                if let Some(text) = *armed
                    && buf[..n].windows(text.len()).any(|w| w == text)
                {
                    *armed = None;
                    cut.store(true, Ordering::SeqCst);
                }
            }
            if to_server.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    let downward = async move {
        let mut buf = vec![0u8; 64 * 1024];
        let mut pending: Vec<u8> = Vec::new();
        let mut completed = false;
        loop {
            let n = match from_server.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if !cutting.load(Ordering::SeqCst) {
                if to_client.write_all(&buf[..n]).await.is_err() {
                    return;
                }
                continue;
            }
            // Every backend message: a type byte, then its length (itself included). Messages
            // before the statement's `CommandComplete` (the answer to preparing it) go on; from
            // it on nothing does.
            pending.extend_from_slice(&buf[..n]);
            while pending.len() >= 5 {
                let len = u32::from_be_bytes([pending[1], pending[2], pending[3], pending[4]]);
                let end = 1 + len as usize;
                if pending.len() < end {
                    break;
                }
                match pending[0] {
                    b'C' => completed = true,
                    b'Z' if completed => {
                        lost.fetch_add(1, Ordering::SeqCst);
                        return;
                    }
                    _ => {}
                }
                if !completed && to_client.write_all(&pending[..end]).await.is_err() {
                    return;
                }
                pending.drain(..end);
            }
        }
    };
    // Whichever ends first ends the connection: both halves are dropped, both sockets close.
    tokio::select! {
        () = upward => {}
        () = downward => {}
    }
}

fn event(data: &str) -> NewChunk {
    NewChunk {
        event: None,
        data: data.into(),
    }
}

#[tokio::test]
async fn a_chunk_commit_whose_answer_is_lost_is_tried_again_and_stores_each_event_once_lc3_rd4() {
    let db = TestDatabase::create().await;
    let (relay, url) = LosingRelay::in_front_of(&db).await;
    let store = Arc::new(
        PostgresStore::open(url.as_str())
            .await
            .expect("open through the relay"),
    );
    let id = submit(&store, "an answer lost on the wire").await;
    let (lease, record) = store
        .lease("node/a", now_ms(), 60_000)
        .await
        .expect("lease")
        .expect("the request is due");
    assert_eq!((lease.id, record.last_seq), (id, 0));
    let dyn_store: DynStore = store.clone();
    let writer = ChunkWriter::spawn(dyn_store, Duration::from_secs(60));

    // The first batch's statement commits and its answer is lost: the writer tries again.
    relay.lose_the_answer_to(APPEND_STATEMENT);
    let appended = writer.append(ChunkBatch {
        lease: lease.clone(),
        after: 0,
        chunks: vec![event("fjord"), event("bay")],
        upstream_request_id: None,
        response_id: None,
        usage: None,
    });
    // Bounded: a relay that swallowed the wrong answer would leave the writer waiting.
    let first = tokio::time::timeout(Duration::from_secs(60), appended)
        .await
        .expect("the writer answers within 60 s")
        .expect("the second try answers");
    assert_eq!(
        relay.answers_lost.load(Ordering::SeqCst),
        1,
        "the relay lost the first try's answer after its commit"
    );
    let answered: Vec<(i64, &str)> = first.iter().map(|c| (c.seq, &*c.data)).collect();
    assert_eq!(answered, vec![(1, "fjord"), (2, "bay")]);

    // The next batch follows it; each event is stored once.
    let next = writer
        .append(ChunkBatch {
            lease: lease.clone(),
            after: 2,
            chunks: vec![event("inlet")],
            upstream_request_id: None,
            response_id: None,
            usage: None,
        })
        .await
        .expect("append");
    assert_eq!(next.iter().map(|c| c.seq).collect::<Vec<_>>(), vec![3]);
    let stored = store.chunks_after(id, 0, 100).await.expect("chunks");
    let log: Vec<(i64, ChunkKind, &str)> =
        stored.iter().map(|c| (c.seq, c.kind, &*c.data)).collect();
    assert_eq!(
        log,
        vec![
            (1, ChunkKind::Data, "fjord"),
            (2, ChunkKind::Data, "bay"),
            (3, ChunkKind::Data, "inlet"),
        ]
    );
    let record = store
        .get("default", id)
        .await
        .expect("get")
        .expect("record");
    assert_eq!(record.last_seq, 3);
}

/// Text found only in the statement that stores a success alone (`FINISH_SUCCEEDED`).
const FINISH_STATEMENT: &[u8] = b"SET status = 'succeeded', response_status = $1";

/// An outcome whose commit's answer is lost (decision 38): the attempt's next try finds the
/// request no longer under its lease, recognises its own earlier commit and settles it as if
/// that try had answered — its tokens counted, "request finished" logged — with one provider
/// call, one attempt and no recovery (LC-3, DU-1).
#[tokio::test]
async fn an_outcome_commit_whose_answer_is_lost_is_settled_as_the_attempts_own_lc3_decision38() {
    let db = TestDatabase::create().await;
    let (relay, url) = LosingRelay::in_front_of(&db).await;
    // A provider slow enough to arm the relay while it answers.
    let mock = start_mock(MockConfig {
        header_delay_ms: 500,
        ..MockConfig::default()
    })
    .await;
    // Long leases and sweeps: nothing but the outcome is written while the provider answers,
    // so the success is a job of its own, one statement in its own transaction.
    let toml = format!(
        r#"
database_url = "{url}"
[workers]
lease_secs = 60
sweep_interval_ms = 60000
[[backends]]
name = "mock"
kind = "openai"
base_url = "{mock}"
"#,
        mock = mock.base_url()
    );
    let dir = tempfile::tempdir().unwrap();
    let node = Process::serve_logged(dir.path(), &toml, free_addr(), &[]).await;
    let http = reqwest::Client::new();

    let answer = tokio::spawn({
        let (http, base) = (http.clone(), node.base.clone());
        async move {
            http.post(format!("{base}/v1/chat/completions"))
                .header("content-type", "application/json")
                .body(chat_body("a success lost on the wire"))
                .send()
                .await
                .expect("POST")
        }
    });
    // Bounded: the provider call arrives within 30 s.
    for _ in 0..3_000 {
        if mock.calls() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(mock.calls(), 1, "the attempt called the provider");
    relay.lose_the_answer_to(FINISH_STATEMENT);
    let response = tokio::time::timeout(Duration::from_secs(60), answer)
        .await
        .expect("answered within 60 s")
        .unwrap();
    assert_eq!(response.status(), 200);
    let id = header(&response, "holdfast-request-id");
    let body: Value = response.json().await.expect("JSON answer");
    assert_eq!(
        relay.answers_lost.load(Ordering::SeqCst),
        1,
        "the relay lost the success's answer after its commit"
    );

    let record = get_json(&http, &format!("{}/requests/{id}", node.base)).await;
    assert_eq!(record["status"], "succeeded", "{record}");
    assert_eq!(
        (record["attempts"].as_u64(), record["recoveries"].as_u64()),
        (Some(1), Some(0))
    );
    assert_eq!(mock.calls(), 1, "one provider call");
    let log = node.log_text();
    assert!(
        log.contains("the outcome was recorded by an earlier try whose answer was lost"),
        "{log}"
    );
    assert!(
        log.lines()
            .any(|l| l.contains("request finished") && l.contains(&id)),
        "the request's finish is logged: {log}"
    );
    let input = body["usage"]["prompt_tokens"].as_f64().expect("usage");
    let page = metrics_page(&http, &node.base).await;
    assert_eq!(
        metric(&page, "holdfast_upstream_tokens_total", "kind=\"input\""),
        input,
        "the attempt's tokens are counted: {page}"
    );
}
