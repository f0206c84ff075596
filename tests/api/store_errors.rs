//! Store errors say what happened (docs/architecture.md, "Store errors"): a corrupt stored row
//! is a non-retryable 500 logged with its id; a database URL that cannot work is a start-up
//! configuration error.

use holdfast::mock::MockConfig;

use crate::helpers::*;

fn config_toml(db: &std::path::Path, mock_base: &str) -> String {
    format!(
        r#"
database_url = "sqlite://{db}"
[[backends]]
name = "mock"
kind = "openai"
base_url = "{mock_base}"
"#,
        db = db.display()
    )
}

#[tokio::test]
async fn a_corrupt_stored_row_answers_500_not_retryable_and_logs_its_id() {
    let mock = start_mock(MockConfig::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("holdfast.db");
    let node = Process::serve_logged(
        dir.path(),
        &config_toml(&db, &mock.base_url()),
        free_addr(),
        &[],
    )
    .await;
    let http = reqwest::Client::new();
    let body = chat_body("a row about to be damaged");
    let r = http
        .post(format!("{}/v1/chat/completions", node.base))
        .header("content-type", "application/json")
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let id = header(&r, "holdfast-request-id");

    // Damage the row behind holdfast's back: a route this version does not know.
    let conn = rusqlite::Connection::open(&db).unwrap();
    let changed = conn
        .execute(
            "UPDATE requests SET route = 'openai.teleport' WHERE id = ?1",
            [&id],
        )
        .unwrap();
    assert_eq!(changed, 1);
    drop(conn);

    let r = http
        .get(format!("{}/requests/{id}", node.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 500, "not a 503: retrying cannot help");
    assert_eq!(header(&r, "x-should-retry"), "false");
    assert_eq!(header(&r, "holdfast-error"), "store_corrupt");
    let log = node.log_text();
    let line = log
        .lines()
        .find(|l| l.contains("corrupt") && l.contains(&id))
        .unwrap_or_else(|| panic!("a log line names the corrupt request {id}:\n{log}"));
    assert!(line.contains("openai.teleport"), "{line}");

    // The node that answered it still knows the answer (decision 31) ...
    let send = |base: String, body: String| {
        let http = http.clone();
        async move {
            http.post(format!("{base}/v1/chat/completions"))
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap()
        }
    };
    let r = send(node.base.clone(), body.clone()).await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "idempotent-replayed"), "true");
    // ... a node that must read it from the log attaches to the damaged request: the SDK is
    // told not to retry.
    drop(node);
    let node = Process::serve_logged(
        dir.path(),
        &config_toml(&db, &mock.base_url()),
        free_addr(),
        &[],
    )
    .await;
    let r = send(node.base.clone(), body).await;
    assert_eq!(r.status(), 500);
    assert_eq!(header(&r, "x-should-retry"), "false");
    let error: serde_json::Value = r.json().await.unwrap();
    assert_eq!(error["error"]["code"], "store_corrupt", "{error}");
    assert_eq!(mock.calls(), 1);
}

#[tokio::test]
async fn an_in_memory_sqlite_url_fails_start_up_naming_the_config_key() {
    let dir = tempfile::tempdir().unwrap();
    for url in ["sqlite::memory:", "sqlite://"] {
        let toml = format!(
            "database_url = \"{url}\"\n[[backends]]\nname = \"m\"\nkind = \"openai\"\nbase_url = \"http://127.0.0.1:9/v1\"\n"
        );
        std::fs::write(dir.path().join("holdfast.toml"), toml).unwrap();
        let (code, _, stderr) =
            run_holdfast(dir.path(), &["serve", "--config", "holdfast.toml"], &[]);
        assert_ne!(code, 0, "{url}: {stderr}");
        assert!(stderr.contains("database_url"), "{url}: {stderr}");
        assert!(stderr.contains("file path"), "{url}: {stderr}");
        assert!(!stderr.contains("corrupt"), "{url}: {stderr}");
    }
}
