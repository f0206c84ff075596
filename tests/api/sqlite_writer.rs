//! The SQLite adapter's writer thread seen from outside: admission leases, queued jobs and a
//! write lock held by another process (LC-2, LC-9, DU-1).

use std::time::Duration;

use holdfast::mock::MockConfig;
use serde_json::Value;

use crate::helpers::*;

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
    let db = rusqlite::Connection::open(app.dir.path().join("holdfast.db")).expect("open db");
    db.execute_batch("BEGIN IMMEDIATE")
        .expect("take the write lock");
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
