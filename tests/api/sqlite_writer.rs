//! The SQLite adapter's writer thread seen from outside: admission leases, queued jobs and a
//! write lock held by another process (LC-2, LC-9, DU-1).

use std::time::Duration;

use holdfast::mock::MockConfig;
use serde_json::Value;

use crate::helpers::*;

/// Takes SQLite's write lock from another connection (a second process, a backup tool), so
/// every write holdfast makes waits until the connection commits or is dropped.
fn hold_the_write_lock(app: &TestApp) -> rusqlite::Connection {
    let db = rusqlite::Connection::open(app.dir.path().join("holdfast.db")).expect("open db");
    db.execute_batch("BEGIN IMMEDIATE")
        .expect("take the write lock");
    db
}

/// The status and attempts of the only request in the log, read through `db`.
fn only_requests_status(db: &rusqlite::Connection) -> (String, i64) {
    db.query_row("SELECT status, attempts FROM requests", [], |row| {
        Ok((row.get(0)?, row.get(1)?))
    })
    .expect("the call was recorded")
}

/// The only request in the log, once it is there.
async fn only_request(app: &TestApp) -> String {
    let start = std::time::Instant::now();
    loop {
        let list: Value = app
            .http
            .get(format!("{}/requests", app.base))
            .send()
            .await
            .expect("GET /requests")
            .json()
            .await
            .expect("list JSON");
        if let Some(id) = list["data"][0]["id"].as_str() {
            return id.to_string();
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "no request recorded: {list}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn client_leaving_while_its_admission_write_is_queued_does_not_strand_the_leased_request_lc9_lc2()
 {
    // One attempt allowed, short leases: a request leased at admission whose attempt never
    // starts fails `lease_expired` without the provider ever being called.
    let app = spawn_app(MockConfig::default(), |c| {
        c.workers.lease_secs = 1;
        c.workers.max_attempts = 1;
        // The dispatcher stays idle (it holds every free permit while it leases).
        c.workers.poll_interval_ms = 60_000;
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Another connection (a second process, a backup tool) holds SQLite's write lock, so the
    // admission's submit_and_lease job waits in the writer's queue.
    let db = hold_the_write_lock(&app);
    // A client sends the request and goes away before any answer (closes its socket).
    {
        use tokio::io::AsyncWriteExt;
        let body = chat_body("leave while queued");
        let mut tcp = tokio::net::TcpStream::connect(app.addr)
            .await
            .expect("connect");
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            app.addr,
            body.len()
        );
        tcp.write_all(head.as_bytes()).await.expect("write head");
        tcp.write_all(body.as_bytes()).await.expect("write body");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // The client is gone; the server notices and drops the handler. Then the lock goes away
    // and the queued job commits the request, leased to an attempt nobody starts.
    tokio::time::sleep(Duration::from_millis(300)).await;
    db.execute_batch("COMMIT").expect("release the write lock");

    let id = only_request(&app).await;
    let record = wait_terminal(&app.http, &app.base, &id, Duration::from_secs(15)).await;
    assert_eq!(
        (
            record["status"].as_str(),
            record["recoveries"].as_u64(),
            app.mock.calls()
        ),
        (Some("succeeded"), Some(0), 1),
        "a client disconnecting never cancels (or delays) execution (LC-9): {record}"
    );
    app.stop().await;
}

/// DU-5: a call whose admission comes after the signal starts no attempt on the draining node,
/// even while the dispatcher is held in a store call. `stopping`, which admission checks before
/// it leases a call itself, was cancelled only once the dispatcher's loop saw the signal; with
/// the database's write lock held by another process the dispatcher sat in its lease, so a call
/// whose body arrived after the signal was leased at admission and its provider called on the
/// node that was stopping. Now `stopping` is cancelled with the signal: the call is recorded
/// `pending` with no attempt, answered 503 `shutting_down` at the cut, and its retry attaches
/// wherever the request runs next.
#[tokio::test]
async fn a_call_admitted_after_the_signal_starts_no_attempt_while_the_dispatcher_waits_for_the_store_du5()
 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut app = spawn_app(MockConfig::default(), |c| {
        // The dispatcher asks the store for due work (a write) every 5 ms.
        c.workers.poll_interval_ms = 5;
        c.shutdown_grace_ms = 200;
    })
    .await;
    let db = hold_the_write_lock(&app);
    // Within a poll the dispatcher's next lease waits for the lock (SQLite's busy timeout is
    // 10 s). Nothing outside the process shows that wait: forty polls' time.
    tokio::time::sleep(Duration::from_millis(200)).await;

    // A call whose head is in before the signal and whose body comes after it: `Expect:
    // 100-continue` makes the server say when the handler starts reading the body.
    let body = chat_body("admitted after the signal");
    let mut tcp = tokio::net::TcpStream::connect(app.addr)
        .await
        .expect("connect");
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nexpect: 100-continue\r\n\r\n",
        app.addr,
        body.len()
    );
    tcp.write_all(head.as_bytes()).await.expect("write head");
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&answer).contains("100 Continue\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(10), tcp.read(&mut buf))
            .await
            .expect("100 Continue within 10 s")
            .expect("read");
        assert!(n > 0, "closed before 100 Continue");
        answer.extend_from_slice(&buf[..n]);
    }
    let shutdown = app.begin_shutdown();
    tcp.write_all(body.as_bytes()).await.expect("write body");
    // The call is admitted (its try for a worker slot comes at once) and its submission waits
    // for the lock behind the dispatcher's lease; nothing shows that either.
    tokio::time::sleep(Duration::from_millis(200)).await;
    db.execute_batch("COMMIT").expect("release the write lock");

    let read_all = async {
        loop {
            let n = tcp.read(&mut buf).await.expect("read");
            if n == 0 {
                break;
            }
            answer.extend_from_slice(&buf[..n]);
            if String::from_utf8_lossy(&answer).contains("shutting_down") {
                break;
            }
        }
    };
    // The grace, the cut 2 s after the workers stop, and slack for a loaded machine.
    tokio::time::timeout(Duration::from_secs(20), read_all)
        .await
        .expect("the call answered within the drain bound");
    let answer = String::from_utf8_lossy(&answer).into_owned();
    shutdown.await.expect("shutdown");
    let (status, attempts) = only_requests_status(&db);
    assert_eq!(
        (app.mock.calls(), status.as_str(), attempts),
        (0, "pending", 0),
        "no attempt started on the draining node; the request waits for the next: {answer}"
    );
    assert!(
        answer.contains("HTTP/1.1 503") && answer.contains("shutting_down"),
        "the held call is told to retry elsewhere: {answer}"
    );
}

/// DU-5 (decision 151): a call whose admission took a worker slot before the signal, and whose
/// submission the store recorded after it (the database's write lock held by another process
/// across the signal), starts no provider call on the draining node and spends no attempt:
/// handed back `pending` with its attempt uncounted, answered 503 `shutting_down` at the cut.
/// Before, its attempt started from the writer once the lock went, called the provider after
/// the signal and, with `max_attempts = 1`, was then handed back at its last attempt and
/// failed `lease_expired`: paid and lost (a break-it trial's F1).
#[tokio::test]
async fn a_call_leased_before_the_signal_and_recorded_after_it_calls_no_provider_du5() {
    let mut app = spawn_app(MockConfig::default(), |c| {
        c.shutdown_grace_ms = 200;
        c.workers.max_attempts = 1;
    })
    .await;
    let db = hold_the_write_lock(&app);
    let call = {
        let (http, base) = (app.http.clone(), app.base.clone());
        tokio::spawn(async move {
            http.post(format!("{base}/v1/chat/completions"))
                .header("content-type", "application/json")
                .body(chat_body("slot before the signal, record after it"))
                .send()
                .await
        })
    };
    // Admission takes its worker slot at once, then its submission waits for the lock;
    // nothing outside the process shows that wait.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let shutdown = app.begin_shutdown();
    // The signal has come once the listener refuses new connections.
    wait_until_refused(app.addr).await;
    db.execute_batch("COMMIT").expect("release the write lock");

    let answer = tokio::time::timeout(Duration::from_secs(20), call)
        .await
        .expect("answered within the drain bound")
        .expect("task")
        .expect("an HTTP answer");
    let (status, code) = (answer.status().as_u16(), header(&answer, "holdfast-error"));
    shutdown.await.expect("shutdown");
    let (state, attempts) = only_requests_status(&db);
    assert_eq!(
        (app.mock.calls(), state.as_str(), attempts),
        (0, "pending", 0),
        "no provider call on the draining node, no attempt spent"
    );
    assert_eq!((status, code.as_str()), (503, "shutting_down"));
}

/// DU-5a (decision 152): a shutdown ends within its bound (here grace 0.2 s + write window
/// 1 s + 2 s, then the cut's 2.5 s) however long the database stays locked, and the process
/// exits with status 1, saying it stopped with work unrecorded. Before, each write on the way
/// out (the running attempt's hand-back at the grace's end, its heartbeat, the sweep, the
/// ledger's last flush) waited out SQLite's 10 s busy timeout in turn, and the node outlived
/// the lock (a break-it trial measured 25 s and 40 s with a 2 s grace).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_while_the_database_is_locked_ends_within_its_bound_du5a() {
    // A call in flight at the signal: its hand-back at the grace's end waits on the store.
    let mock = start_mock(MockConfig {
        header_delay_ms: 5_000,
        ..MockConfig::default()
    })
    .await;
    let dir = tempfile::tempdir().expect("tempdir");
    let toml = format!(
        r#"
database_url = "sqlite://{}"
shutdown_grace_ms = 200
[workers]
lease_secs = 1
write_retry_secs = 1
[[backends]]
name = "mock"
kind = "openai"
base_url = "{}"
"#,
        dir.path().join("holdfast.db").display(),
        mock.base_url()
    );
    let mut node = Process::serve(dir.path(), &toml, free_addr()).await;
    let call = tokio::spawn({
        let url = format!("{}/v1/chat/completions", node.base);
        async move {
            reqwest::Client::new()
                .post(url)
                .header("content-type", "application/json")
                .body(chat_body("in flight when the database locks"))
                .send()
                .await
        }
    });
    wait_until(Duration::from_secs(10), "the provider call started", || {
        mock.calls() == 1
    })
    .await;
    let db = rusqlite::Connection::open(dir.path().join("holdfast.db")).expect("open db");
    db.execute_batch("BEGIN IMMEDIATE")
        .expect("take the write lock");
    // A liveness bound: the shutdown's own is under 6 s; the lock is held past this.
    let clean = node.sigterm_and_wait(Duration::from_secs(30));
    assert!(!clean, "exit status 1: work was left unrecorded");
    let log = node.log_text();
    assert!(
        log.contains("did not answer within the shutdown's bound"),
        "the log says why: {log}"
    );
    drop(db);
    call.abort();
}

/// Waits (bounded) until `addr` refuses connections: the listener has closed.
async fn wait_until_refused(addr: std::net::SocketAddr) {
    for _ in 0..200 {
        if tokio::net::TcpStream::connect(addr).await.is_err() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the listener at {addr} still accepts 2 s after the shutdown began");
}
