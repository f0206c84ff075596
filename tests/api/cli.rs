//! `holdfast requests list/show/tail/cancel` and `holdfast usage` against a running server
//! (issue 16): the binary, over HTTP, with the exit codes scripts rely on.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use holdfast::mock::MockConfig;
use serde_json::Value;

use crate::helpers::*;

fn toml(dir: &std::path::Path, mock_base: &str) -> String {
    format!(
        r#"database_url = "sqlite://{}"
admin_api_keys = ["admin"]
[workers]
lease_secs = 2
sweep_interval_ms = 100
[[backends]]
name = "mock"
kind = "openai"
base_url = "{mock_base}"
[[namespaces]]
name = "team"
api_keys = ["team-key"]
[[prices]]
backend = "mock"
model = "gpt-4o-mini"
input_per_mtok = 0.15
output_per_mtok = 0.60
"#,
        dir.join("holdfast.db").display()
    )
}

/// Runs `holdfast ARGS` against `base` with the team's key; (exit code, stdout, stderr).
fn cli(base: &str, args: &[&str]) -> (i32, String, String) {
    let dir = tempfile::tempdir().unwrap();
    run_holdfast(
        dir.path(),
        args,
        &[("HOLDFAST_URL", base), ("HOLDFAST_API_KEY", "team-key")],
    )
}

async fn send(base: &str, body: String) -> String {
    let r = reqwest::Client::new()
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth("team-key")
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    let id = header(&r, "holdfast-request-id");
    let _ = r.bytes().await;
    id
}

#[tokio::test]
async fn requests_list_show_cancel_and_usage_work_against_a_running_server() {
    let mock = start_mock(MockConfig::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let node = Process::serve(dir.path(), &toml(dir.path(), &mock.base_url()), free_addr()).await;
    let first = send(&node.base, chat_body("listed one")).await;
    let again = send(&node.base, chat_body("listed one")).await;
    assert_eq!(first, again);
    wait_deliveries(&node.base, &first, Some("team-key"), 2).await;
    let second = send(&node.base, chat_body("listed two")).await;
    let no_model = send(
        &node.base,
        r#"{"messages":[{"role":"user","content":"no model"}]}"#.to_string(),
    )
    .await;

    let (code, out, err) = cli(&node.base, &["requests", "list"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("ID"), "a table: {out}");
    assert!(out.contains(&first) && out.contains(&second), "{out}");
    // Whose call each row is (RD-1): an admin key's list mixes namespaces.
    let columns: Vec<&str> = out.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(columns[..3], ["ID", "NAMESPACE", "STATUS"], "{out}");
    let row = out.lines().find(|l| l.starts_with(&second)).unwrap();
    assert_eq!(row.split_whitespace().nth(1), Some("team"), "{out}");
    let (code, out, _) = cli(
        &node.base,
        &["requests", "list", "--json", "--q", "listed two"],
    );
    assert_eq!(code, 0);
    let listed: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(listed["data"].as_array().unwrap().len(), 1);
    assert_eq!(listed["data"][0]["id"], second.as_str());
    let (code, out, _) = cli(&node.base, &["requests", "list", "--replayed"]);
    assert_eq!(code, 0);
    assert!(out.contains(&first) && !out.contains(&second), "{out}");

    let (code, out, _) = cli(&node.base, &["requests", "show", &first, "--body"]);
    assert_eq!(code, 0);
    assert!(out.contains("succeeded"), "{out}");
    assert!(out.contains("deliveries     2"), "{out}");
    assert!(out.contains("listed one"), "the prompt with --body: {out}");
    // `get`, the verb a new user tried first, is `show` too.
    let (code, got, _) = cli(&node.base, &["requests", "get", &first, "--body"]);
    assert_eq!((code, got.as_str()), (0, out.as_str()));
    let (code, _, err) = cli(
        &node.base,
        &["requests", "show", "0194c5d2-0000-7000-8000-000000000000"],
    );
    assert_eq!(code, 1, "not found is 1");
    assert!(err.contains("404"), "{err}");

    let (code, out, _) = cli(&node.base, &["usage", "--group-by", "model"]);
    assert_eq!(code, 0);
    assert!(out.lines().any(|l| l.starts_with("gpt-4o-mini")), "{out}");
    assert!(
        out.lines().any(|l| l.starts_with("- ")),
        "requests without a model ({no_model}) under `-`: {out}"
    );
    assert!(out.lines().any(|l| l.starts_with("TOTAL")), "{out}");
    let (code, _, err) = cli(
        &node.base,
        &["usage", "--since", "2026-12-03", "--until", "2026-12-01"],
    );
    assert_eq!(code, 1, "a window that ends before it starts: {err}");
    assert!(err.contains("until"), "{err}");
    let (code, out, _) = cli(&node.base, &["usage", "--json"]);
    assert_eq!(code, 0);
    let usage: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(usage["totals"]["saved_calls"], 1, "{usage}");

    // Cancel a request that is still waiting for its provider.
    mock.set_config(MockConfig {
        header_delay_ms: 5_000,
        ..MockConfig::default()
    });
    let r = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", node.base))
        .bearer_auth("team-key")
        .header("prefer", "respond-async")
        .header("content-type", "application/json")
        .body(chat_body("cancel me from the CLI"))
        .send()
        .await
        .unwrap();
    let slow = header(&r, "holdfast-request-id");
    let (code, out, _) = cli(&node.base, &["requests", "cancel", &slow]);
    assert_eq!(code, 0);
    assert_eq!(out.trim(), format!("{slow} cancelled"));
    // Cancelled already: nothing more to cancel.
    let (code, out, _) = cli(&node.base, &["requests", "cancel", &slow]);
    assert_eq!(code, 0);
    assert_eq!(
        out.trim(),
        format!("{slow} failed (already finished: nothing cancelled)")
    );
    // A finished request is reported as it is, not as cancelled.
    let (code, out, _) = cli(&node.base, &["requests", "cancel", &first]);
    assert_eq!(code, 0);
    assert_eq!(
        out.trim(),
        format!("{first} succeeded (already finished: nothing cancelled)")
    );
    // A refusal ends `tail` at once with the server's message: a wrong key cannot start working
    // by asking again, unlike a node restarting (5xx, no connection).
    let tail_with = |key: &str, extra: &[&str]| {
        let dir = tempfile::tempdir().unwrap();
        let mut args = vec!["requests", "tail", first.as_str(), "--patience-secs", "5"];
        args.extend_from_slice(extra);
        run_holdfast(
            dir.path(),
            &args,
            &[("HOLDFAST_URL", &node.base), ("HOLDFAST_API_KEY", key)],
        )
    };
    let (code, out, err) = tail_with("wrong-key", &[]);
    assert_eq!(code, 1, "{out} {err}");
    assert!(err.contains("401"), "the server's refusal: {err}");
    assert!(!out.contains("resuming"), "no reconnect loop: {out}");
    let (code, out, err) = tail_with("team-key", &["--from=-1"]);
    assert_eq!(code, 1, "{out} {err}");
    assert!(err.contains("400"), "the server's refusal: {err}");
    // Usage errors are 2; an unreachable server 1.
    let (code, _, _) = cli(&node.base, &["requests", "list", "--no-such-flag"]);
    assert_eq!(code, 2);
    let (code, _, err) = cli("http://127.0.0.1:9", &["requests", "list"]);
    assert_eq!(code, 1, "{err}");
    drop(node);
    mock.shutdown().await;
}

/// Text from the log is printed as text: a client's model name holding terminal escape
/// sequences (which the mock echoes into its answer) reaches `list`, `show --body`, `usage`
/// and `replay` escaped, so it can neither recolour nor rewrite the operator's table (a `\r`
/// and an erase-line would print a forged row over the real one).
// Multi-threaded: `replay` waits for a provider call to the in-process mock while the test
// blocks on the CLI.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_from_the_log_cannot_drive_the_terminal_of_the_cli() {
    let mock = start_mock(MockConfig::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let node = Process::serve(dir.path(), &toml(dir.path(), &mock.base_url()), free_addr()).await;
    let hostile = "gpt\u{1b}[31m\u{1b}]0;pwned\u{7}\r\u{1b}[2Kforged";
    let id = send(
        &node.base,
        serde_json::json!({
            "model": hostile,
            "messages": [{"role": "user", "content": "an \u{1b}[1mescape\u{1b}[0m in the prompt"}],
        })
        .to_string(),
    )
    .await;
    let runs = [
        vec!["requests", "list"],
        vec!["requests", "show", id.as_str(), "--body"],
        vec!["usage"],
        vec!["requests", "replay", id.as_str(), "--wait-secs", "30"],
    ];
    for args in runs {
        let (code, out, err) = cli(&node.base, &args);
        assert_eq!(code, 0, "{args:?}: {err}");
        assert!(
            !out.chars().any(|c| c.is_control() && c != '\n'),
            "{args:?} printed a control character: {out:?}"
        );
        assert!(
            out.contains(r"\u{1b}[31m"),
            "{args:?} shows it escaped: {out}"
        );
    }
    drop(node);
    mock.shutdown().await;
}

// Multi-threaded: the test reads the tail's output with blocking waits while the in-process mock
// provider keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_tail_follows_a_stream_resumes_after_a_server_restart_and_prints_the_reset_rd6() {
    let mock = start_mock(MockConfig {
        chunks: 40,
        chunk_delay_ms: 60,
        ..MockConfig::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let config = toml(dir.path(), &mock.base_url());
    let addr = free_addr();
    let mut node = Process::serve(dir.path(), &config, addr).await;
    let r = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", node.base))
        .bearer_auth("team-key")
        .header("prefer", "respond-async")
        .header("content-type", "application/json")
        .body(stream_body("tail me across a restart"))
        .send()
        .await
        .unwrap();
    let id = header(&r, "holdfast-request-id");
    let mut tail = Command::new(holdfast_bin())
        .args(["requests", "tail", &id])
        .env("HOLDFAST_URL", &node.base)
        .env("HOLDFAST_API_KEY", "team-key")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = tail.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let mut lines = Vec::new();
    while lines.len() < 5 {
        match rx.recv_timeout(Duration::from_secs(10)) {
            Ok(line) => lines.push(line),
            Err(e) => {
                let _ = tail.kill();
                let mut err = String::new();
                std::io::Read::read_to_string(&mut tail.stderr.take().unwrap(), &mut err).unwrap();
                panic!("tail prints events ({e}): {lines:?} {err}");
            }
        }
    }
    node.kill9();
    let node = Process::serve(dir.path(), &config, addr).await;
    loop {
        let line = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("tail goes on after the restart");
        let end = line.contains(" end ");
        lines.push(line);
        if end {
            break;
        }
    }
    let status = tail.wait().unwrap();
    assert!(status.success(), "tail exits 0 at the end: {lines:?}");
    let text = lines.join("\n");
    assert!(
        text.contains(" reset "),
        "the reset between the attempts is printed: {text}"
    );
    // Stdout holds events only (`SEQ EVENT DATA`); the reconnects are said on stderr.
    for line in &lines {
        let seq = line.split(' ').next().unwrap_or_default();
        assert!(
            seq.parse::<i64>().is_ok(),
            "not an event on stdout: {line:?}"
        );
    }
    let mut err = String::new();
    std::io::Read::read_to_string(&mut tail.stderr.take().unwrap(), &mut err).unwrap();
    assert!(
        err.contains("resuming") || err.contains("retrying"),
        "the reconnect is said on stderr: {err}"
    );
    let last: Value =
        serde_json::from_str(lines.last().unwrap().splitn(3, ' ').nth(2).unwrap()).unwrap();
    assert_eq!(last["status"], "succeeded", "{text}");
    drop(node);
    mock.shutdown().await;
}

/// `requests tail --json` prints the log's events as one JSON object per line (`seq`, `event`,
/// `data` as the server sent it), for scripts, as `--json` does for every other command
/// (RD-2, RD-5).
#[tokio::test]
async fn requests_tail_json_prints_one_object_per_event_rd2() {
    let mock = start_mock(MockConfig::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let node = Process::serve(dir.path(), &toml(dir.path(), &mock.base_url()), free_addr()).await;
    let id = send(&node.base, stream_body("tail me as JSON")).await;
    let (code, out, err) = cli(
        &node.base,
        &["requests", "tail", &id, "--from", "0", "--json"],
    );
    assert_eq!(code, 0, "{err}");
    let events: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?}")))
        .collect();
    assert!(events.len() > 2, "{out}");
    for (i, event) in events.iter().enumerate() {
        assert_eq!(event["seq"], i as i64 + 1, "{out}");
        assert!(event["data"].is_string(), "{out}");
    }
    assert_eq!(events[0]["event"], "message", "{out}");
    let end = events.last().unwrap();
    assert_eq!(end["event"], "end", "{out}");
    let outcome: Value = serde_json::from_str(end["data"].as_str().unwrap()).unwrap();
    assert_eq!(outcome["status"], "succeeded", "{out}");
    drop(node);
    mock.shutdown().await;
}

/// `--config` names the server and its admin key: on a server's host the configuration file is
/// all the CLI needs (a wildcard `listen` is read on this host); `--url` still wins, and a file
/// that is not there is a usage error.
#[tokio::test]
async fn requests_and_usage_read_the_server_and_the_admin_key_a_config_file_names() {
    let mock = start_mock(MockConfig::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let addr = free_addr();
    let config = format!(
        "listen = \"0.0.0.0:{}\"\n{}",
        addr.port(),
        toml(dir.path(), &mock.base_url())
    );
    let node = Process::serve(dir.path(), &config, addr).await;
    let id = send(&node.base, chat_body("found through the config file")).await;
    // Process::serve wrote the configuration here.
    let file = dir.path().join("holdfast.toml");
    let file = file.to_str().unwrap();

    let (code, out, err) = run_holdfast(dir.path(), &["requests", "list", "--config", file], &[]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(&id), "{out}");
    let (code, out, err) = run_holdfast(
        dir.path(),
        &["usage", "--json"],
        &[("HOLDFAST_CONFIG", file)],
    );
    assert_eq!(code, 0, "{err}");
    let usage: Value = serde_json::from_str(&out).expect("usage JSON");
    assert!(usage.is_object(), "{usage}");

    let (code, _, err) = run_holdfast(
        dir.path(),
        &[
            "requests",
            "list",
            "--config",
            file,
            "--url",
            "http://127.0.0.1:9",
        ],
        &[],
    );
    assert_eq!(code, 1, "--url wins over the file: {err}");
    // CLI-1 (decision 156): an unreachable server's refusal says how to name another, and a
    // URL without its scheme is a usage error that says how to write it (it was `builder
    // error`, exit 1).
    assert!(err.contains("--url or HOLDFAST_URL"), "{err}");
    let (code, _, err) = run_holdfast(
        dir.path(),
        &["requests", "list"],
        &[("HOLDFAST_URL", node.base.trim_start_matches("http://"))],
    );
    assert_eq!(code, 2, "{err}");
    // The address as given, with its scheme: the port named, not the default's.
    assert!(err.contains(&format!("write it as {}", node.base)), "{err}");
    let (code, _, err) = run_holdfast(
        dir.path(),
        &["requests", "list", "--config", "nowhere.toml"],
        &[],
    );
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("nowhere.toml"), "{err}");
    // A URL given otherwise leaves the file unread: its admin key goes nowhere else, and a
    // HOLDFAST_CONFIG naming no file does not stop a command that does not need it.
    let (code, out, err) = run_holdfast(
        dir.path(),
        &["requests", "list"],
        &[
            ("HOLDFAST_CONFIG", "nowhere.toml"),
            ("HOLDFAST_URL", node.base.as_str()),
            ("HOLDFAST_API_KEY", "team-key"),
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(&id), "{out}");
    // Without the file and without a key, the refusal says how to give one.
    let (code, _, err) = run_holdfast(
        dir.path(),
        &["requests", "list"],
        &[("HOLDFAST_URL", node.base.as_str())],
    );
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("401") && err.contains("--api-key"), "{err}");
}
