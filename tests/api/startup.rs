//! The first day: start-up refuses what cannot work with one line naming the key (exit 2),
//! says what it does, and logs every request and failed attempt (issue 13; SPEC CLI-1, IN-3).

use std::time::Duration;

use holdfast::mock::MockConfig;
use serde_json::Value;

use crate::helpers::*;

const BACKEND: &str =
    "[[backends]]\nname = \"mock\"\nkind = \"openai\"\nbase_url = \"http://127.0.0.1:9/v1\"\n";

/// Runs `holdfast serve --config` on `toml` and returns (exit code, stderr).
fn serve_config(toml: &str, env: &[(&str, &str)]) -> (i32, String) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("holdfast.toml"), toml).unwrap();
    let (code, _, stderr) = run_holdfast(
        dir.path(),
        &[
            "serve",
            "--config",
            "holdfast.toml",
            "--listen",
            "127.0.0.1:0",
        ],
        env,
    );
    (code, stderr)
}

#[test]
fn each_invalid_configuration_fails_start_up_with_exit_2_and_one_line_naming_the_key_cli1() {
    let cases: Vec<(&str, String, &str)> = vec![
        (
            "base_url without a host",
            BACKEND.replace("http://127.0.0.1:9/v1", "http://"),
            "backends[0].base_url",
        ),
        (
            "base_url with another scheme",
            BACKEND.replace("http://127.0.0.1:9/v1", "ftp://example.com/v1"),
            "backends[0].base_url",
        ),
        (
            "base_url that does not parse",
            BACKEND.replace("http://127.0.0.1:9/v1", "api.openai.com/v1"),
            "backends[0].base_url",
        ),
        (
            "duplicate backend name",
            format!("{BACKEND}{BACKEND}"),
            "backends[1].name",
        ),
        (
            "rewrite to an unknown backend",
            format!("{BACKEND}[[model_rewrites]]\nmatch = \"fast\"\nbackend = \"nope\"\n"),
            "model_rewrites[0].backend",
        ),
        (
            "namespace without keys",
            format!("{BACKEND}[[namespaces]]\nname = \"team\"\napi_keys = []\n"),
            "namespaces[0].api_keys",
        ),
        (
            "typo in a key",
            format!("lisen = \"127.0.0.1:1\"\n{BACKEND}"),
            "did you mean `listen`?",
        ),
        (
            "typo in a table's key",
            format!("[workers]\nlease_sec = 3\n{BACKEND}"),
            "did you mean `workers.lease_secs`?",
        ),
        (
            "an in-memory database",
            format!("database_url = \"sqlite::memory:\"\n{BACKEND}"),
            "database_url",
        ),
        (
            "a host name to listen on",
            format!("listen = \"localhost:8080\"\n{BACKEND}"),
            "127.0.0.1:8080",
        ),
        (
            "a callback secret that is not a whsec_ key",
            format!("{BACKEND}[callbacks]\nsecrets = [\"hunter2\"]\n"),
            "callbacks.secrets[0]",
        ),
        (
            "a default callback URL at the metadata address (CB-2)",
            format!(
                "{BACKEND}[callbacks]\nsecrets = [\"whsec_AAAA\"]\nurl = \"http://169.254.169.254/x\"\n"
            ),
            "callbacks.url",
        ),
        (
            "a string that never ends",
            format!("listen = \"127.0.0.1:1\n{BACKEND}"),
            "holdfast.toml: TOML parse error at line 1",
        ),
        (
            "a table header that never closes",
            format!("[workers\n{BACKEND}"),
            "holdfast.toml: TOML parse error at line 1",
        ),
    ];
    for (name, toml, names) in cases {
        let (code, stderr) = serve_config(&toml, &[("RUST_BACKTRACE", "1")]);
        assert_eq!(code, 2, "{name}: exit status 2: {stderr}");
        let lines: Vec<&str> = stderr.lines().filter(|l| !l.is_empty()).collect();
        assert_eq!(lines.len(), 1, "{name}: one line, no backtrace: {stderr}");
        assert!(lines[0].starts_with("holdfast: "), "{name}: {stderr}");
        assert!(
            lines[0].contains(names),
            "{name}: names {names:?}: {stderr}"
        );
        assert!(lines[0].len() < 300, "{name}: short: {stderr}");
        assert!(
            !lines[0].contains("default."),
            "{name}: no profile prefix: {stderr}"
        );
    }
    // An unknown key in the file is refused; the same name as an environment variable is not.
    let (code, _) = serve_config(&format!("colour = \"red\"\n{BACKEND}"), &[]);
    assert_eq!(code, 2);
}

/// A backend whose `api_key_env` names an unset variable starts (a local server needs no key),
/// with one warning naming the backend and the variable; a set one gets none, and its key is
/// not logged (IN-3).
#[tokio::test]
async fn a_backend_whose_key_variable_is_unset_starts_with_a_warning_naming_it_in3() {
    let mock = start_mock(MockConfig::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let toml = format!(
        r#"
database_url = "sqlite://{db}"
[[backends]]
name = "keyless"
kind = "openai"
base_url = "{mock}"
api_key_env = "NO_PROVIDER_KEY_IS_SET_IN_THIS_TEST"
[[backends]]
name = "keyed"
kind = "anthropic"
base_url = "{mock}"
api_key_env = "PROVIDER_KEY_SET_IN_THIS_TEST"
"#,
        db = dir.path().join("holdfast.db").display(),
        mock = mock.base_url()
    );
    let node = Process::serve_logged_at_default_level(
        dir.path(),
        &toml,
        free_addr(),
        &[("PROVIDER_KEY_SET_IN_THIS_TEST", "sk-test")],
    )
    .await;
    let log = node.log_text();
    let warnings: Vec<&str> = log.lines().filter(|l| l.contains("WARN")).collect();
    assert_eq!(warnings.len(), 1, "{log}");
    assert!(
        warnings[0].contains("$NO_PROVIDER_KEY_IS_SET_IN_THIS_TEST is not set")
            && warnings[0].contains("keyless"),
        "{log}"
    );
    assert!(!log.contains("sk-test"), "the set key is not logged: {log}");
    drop(node);
    mock.shutdown().await;
}

#[tokio::test]
async fn an_unknown_holdfast_variable_is_one_warning_and_the_demo_starts_and_says_where_its_mock_is()
 {
    let dir = tempfile::tempdir().unwrap();
    let addr = free_addr();
    let log = dir.path().join("stderr.log");
    let out = dir.path().join("stdout.log");
    let mut command = std::process::Command::new(holdfast_bin());
    command
        .args(["serve", "--demo", "--listen", &addr.to_string()])
        .current_dir(dir.path())
        .env_remove("RUST_LOG");
    // Only the variables set here: none inherited from the suite's environment (like
    // `run_holdfast`).
    for (k, _) in std::env::vars() {
        if k.starts_with("HOLDFAST_") {
            command.env_remove(k);
        }
    }
    let mut child = command
        .env("HOLDFAST_BIN", "x")
        // The test harness's own variables (scripts/test) are ignored silently: no warning.
        .env(
            "HOLDFAST_TEST_DATABASE_URL",
            "postgres://nobody@127.0.0.1:1/x",
        )
        .env("HOLDFAST_TEST_SKIP", "browser")
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut process = Process {
        child: child_take(&mut child),
        base: format!("http://{addr}"),
        log: Some(log.clone()),
        show_log_on_failure: false,
    };
    process.wait_healthy().await;
    let stderr = std::fs::read_to_string(&log).unwrap();
    let warnings: Vec<&str> = stderr.lines().filter(|l| l.contains("WARN")).collect();
    assert_eq!(warnings.len(), 1, "{stderr}");
    assert!(warnings[0].contains("HOLDFAST_BIN"), "{stderr}");
    assert!(
        !stderr.contains('\u{1b}'),
        "no colour codes in a file: {stderr:?}"
    );
    let banner = wait_for_file(&out, "curl").await;
    assert!(banner.contains(&format!("http://{addr}")), "{banner}");
    let mock_line = banner
        .lines()
        .find(|l| l.contains("mock provider"))
        .unwrap_or_else(|| panic!("the banner names the mock provider: {banner}"));
    assert!(mock_line.contains("http://127.0.0.1:"), "{mock_line}");
    assert!(
        banner.contains("curl -i "),
        "the curl shows headers: {banner}"
    );
    // The demo's ledger fills: its example prices give a stream's tokens a cost.
    let http = reqwest::Client::new();
    let r = http
        .post(format!("http://{addr}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(stream_body("what does it cost"))
        .send()
        .await
        .unwrap();
    let id = header(&r, "holdfast-request-id");
    let _ = r.bytes().await;
    let record = get_record(&http, &format!("http://{addr}"), &id).await;
    assert!(
        record["usage"]["input_tokens"].as_u64().unwrap() > 0,
        "{record}"
    );
    assert!(record["cost_usd"].as_f64().unwrap() > 0.0, "{record}");
    drop(process);
}

/// Takes the child out of `child`, leaving a dummy behind (so `Process` owns and kills it).
fn child_take(child: &mut std::process::Child) -> std::process::Child {
    std::mem::replace(child, std::process::Command::new("true").spawn().unwrap())
}

/// Waits until `path` holds `needle`, at most 10 s; returns the text.
pub(crate) async fn wait_for_file(path: &std::path::Path, needle: &str) -> String {
    let start = std::time::Instant::now();
    loop {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        if text.contains(needle) {
            return text;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{needle} in {}",
            path.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[test]
fn a_listen_address_in_use_names_the_address_and_how_to_choose_another() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("holdfast.toml"), BACKEND).unwrap();
    let (code, _, stderr) = run_holdfast(
        dir.path(),
        &["serve", "--config", "holdfast.toml", "--listen", &addr],
        &[],
    );
    assert_eq!(code, 1, "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    for must in [addr.as_str(), "--listen", "HOLDFAST_LISTEN"] {
        assert!(stderr.contains(must), "names {must}: {stderr}");
    }
}

/// A PostgreSQL server that refuses connections stops the start with why (exit 1), not with
/// the pool's "timed out while waiting for an open connection", which hides it.
#[test]
fn a_postgres_server_that_refuses_connections_is_named_as_refusing_them() {
    // A port nothing listens on: bound, then closed.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let toml = format!("database_url = \"postgres://postgres@127.0.0.1:{port}/x\"\n{BACKEND}");
    let (code, stderr) = serve_config(&toml, &[]);
    assert_eq!(code, 1, "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("refused"), "says why: {stderr}");
    assert!(!stderr.contains("pool timed out"), "{stderr}");
}

/// CLI-1: `--config` naming a directory is refused naming `--config` (exit 2), never read as
/// an empty file with the start going on from the defaults and the environment (here it
/// then complained of no `[[backends]]`, which the directory's file may well have).
#[test]
fn a_config_path_that_is_a_directory_is_refused_cli1() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("etc")).unwrap();
    let (code, _, stderr) = run_holdfast(
        dir.path(),
        &["serve", "--config", "etc", "--listen", "127.0.0.1:0"],
        &[],
    );
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("--config") && stderr.contains("is a directory"),
        "{stderr}"
    );
}

/// The test harness's own guard: a node whose address another test's server took between
/// `free_addr` and its bind exits, and is not mistaken for healthy because the other server
/// answers `/healthz` (a chaos run once talked to a stranger that way, by the look of it).
#[tokio::test]
#[should_panic(expected = "exited before it served")]
async fn a_test_node_that_cannot_bind_is_not_taken_for_the_server_on_its_address() {
    let stranger = spawn_app(MockConfig::default(), |_| {}).await;
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("holdfast.db").display());
    let toml = fault_test_toml(&db, "", 1, &stranger.mock.base_url());
    let _node = Process::serve(dir.path(), &toml, stranger.addr).await;
}

/// `--demo --config FILE`: the banner describes what runs — the file's database, and a curl
/// that says a namespace key is needed when the file configures namespaces.
#[tokio::test]
async fn the_demo_banner_describes_the_configuration_a_file_adds_cli2() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("extra.toml"),
        "database_url = \"sqlite://other.db\"\n[[namespaces]]\nname = \"team\"\napi_keys = [\"k\"]\n",
    )
    .unwrap();
    let out = dir.path().join("stdout.log");
    let addr = free_addr();
    let mut command = std::process::Command::new(holdfast_bin());
    command
        .args(["serve", "--demo", "--config", "extra.toml", "--listen"])
        .arg(addr.to_string())
        .current_dir(dir.path())
        .env_remove("RUST_LOG")
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::process::Stdio::null());
    for (k, _) in std::env::vars() {
        if k.starts_with("HOLDFAST_") {
            command.env_remove(k);
        }
    }
    // Killed on drop, however the test ends.
    let _demo = Process {
        child: command.spawn().unwrap(),
        base: format!("http://{addr}"),
        log: None,
        show_log_on_failure: false,
    };
    let banner = wait_for_file(&out, "curl").await;
    assert!(banner.contains("database: sqlite://other.db"), "{banner}");
    assert!(!banner.contains("holdfast-demo.db"), "{banner}");
    assert!(banner.contains("authorization: Bearer"), "{banner}");
}

/// CLI-2, CLI-3, GM-4: the demo's mock generates for any model name, and google-genai's
/// `client.models.get(model=...)` of one it does not list (`gemini-2.0-flash`) is answered
/// too, in Google's shape, as are OpenAI's and Anthropic's lookups.
#[tokio::test]
async fn the_demo_answers_a_model_lookup_for_any_model_it_generates_for_cli2_cli3_gm4() {
    let dir = tempfile::tempdir().unwrap();
    let addr = free_addr();
    let mut command = std::process::Command::new(holdfast_bin());
    command
        .args(["serve", "--demo", "--listen", &addr.to_string()])
        .current_dir(dir.path())
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    for (k, _) in std::env::vars() {
        if k.starts_with("HOLDFAST_") {
            command.env_remove(k);
        }
    }
    // Killed on drop, however the test ends.
    let mut demo = Process {
        child: command.spawn().unwrap(),
        base: format!("http://{addr}"),
        log: None,
        show_log_on_failure: false,
    };
    demo.wait_healthy().await;
    let http = reqwest::Client::new();
    let generate = http
        .post(format!(
            "{}/v1beta/models/gemini-2.0-flash:generateContent",
            demo.base
        ))
        .header("x-goog-api-key", "unused-in-demo")
        .header("content-type", "application/json")
        .body(gemini_body("hello"))
        .send()
        .await
        .unwrap();
    assert_eq!(generate.status(), 200);
    // As google-genai sends `models.get` (the SDK's key header; v1beta, or v1).
    for version in ["v1beta", "v1"] {
        let model = http
            .get(format!("{}/{version}/models/gemini-2.0-flash", demo.base))
            .header("x-goog-api-key", "unused-in-demo")
            .send()
            .await
            .unwrap();
        assert_eq!(model.status(), 200, "{version}");
        let model: serde_json::Value = model.json().await.unwrap();
        assert_eq!(model["name"], "models/gemini-2.0-flash", "{model}");
    }
    let openai: serde_json::Value = http
        .get(format!("{}/v1/models/gpt-4.1-mini", demo.base))
        .bearer_auth("unused-in-demo")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(openai["id"], "gpt-4.1-mini", "{openai}");
    let anthropic: serde_json::Value = http
        .get(format!("{}/v1/models/claude-sonnet-4-5", demo.base))
        .header("x-api-key", "unused-in-demo")
        .header("anthropic-version", "2023-06-01")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(anthropic["id"], "claude-sonnet-4-5", "{anthropic}");
    assert_eq!(anthropic["type"], "model", "{anthropic}");
}

/// CLI-1: a `database_url` that names no file is refused with the configuration, before the
/// port is bound — on a taken port too, where binding first answered "address in use".
#[test]
fn a_database_url_without_a_file_is_refused_before_the_port_is_bound_cli1_cli4a() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    for url in ["sqlite::memory:", "sqlite:", "sqlite://?mode=memory"] {
        let dir = tempfile::tempdir().unwrap();
        let toml = format!("database_url = \"{url}\"\n{BACKEND}");
        std::fs::write(dir.path().join("holdfast.toml"), toml).unwrap();
        let (code, _, stderr) = run_holdfast(
            dir.path(),
            &["serve", "--config", "holdfast.toml", "--listen", &addr],
            &[],
        );
        assert_eq!(code, 2, "{url}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(stderr.contains("database_url"), "{url}: {stderr}");
    }
}

#[test]
fn serve_help_lists_defaults_and_environment_variables() {
    let dir = tempfile::tempdir().unwrap();
    let (code, stdout, _) = run_holdfast(dir.path(), &["serve", "--help"], &[]);
    assert_eq!(code, 0);
    for must in [
        "HOLDFAST_LISTEN",
        "HOLDFAST_CONFIG",
        "127.0.0.1:8080",
        "--demo",
    ] {
        assert!(stdout.contains(must), "{must}: {stdout}");
    }
}

/// CLI-1: a `HOLDFAST_LISTEN` that is no socket address stops the start (exit 2) with one line
/// naming the variable and the fix, as a bad `listen` in the file does, not with a usage error
/// about a `--listen` flag the operator never typed.
#[test]
fn a_bad_holdfast_listen_variable_is_one_line_naming_the_variable_cli1() {
    let (code, stderr) =
        serve_config_without_listen(BACKEND, &[("HOLDFAST_LISTEN", "localhost:8080")]);
    assert_eq!(code, 2, "{stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line: {stderr}");
    assert!(lines[0].starts_with("holdfast: configuration"), "{stderr}");
    assert!(
        lines[0].contains("HOLDFAST_LISTEN"),
        "names the variable: {stderr}"
    );
    assert!(
        lines[0].contains("127.0.0.1:8080"),
        "says what to write: {stderr}"
    );
    assert!(!lines[0].contains("--listen"), "{stderr}");
}

/// Runs `holdfast serve --config` on `toml` with no `--listen`, returning (exit code, stderr).
fn serve_config_without_listen(toml: &str, env: &[(&str, &str)]) -> (i32, String) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("holdfast.toml"), toml).unwrap();
    let (code, _, stderr) = run_holdfast(dir.path(), &["serve", "--config", "holdfast.toml"], env);
    (code, stderr)
}

/// RD-9: `holdfast usage --help` names every grouping `GET /usage` takes, `provider` among
/// them, and says that `--since` / `--until` take a date as well as an RFC 3339 time.
#[test]
fn usage_help_names_every_grouping_and_the_date_form_rd9() {
    let dir = tempfile::tempdir().unwrap();
    let (code, stdout, _) = run_holdfast(dir.path(), &["usage", "--help"], &[]);
    assert_eq!(code, 0);
    for must in [
        "model",
        "backend",
        "namespace",
        "day",
        "provider",
        "YYYY-MM-DD",
    ] {
        assert!(stdout.contains(must), "{must}: {stdout}");
    }
    let (code, stdout, _) = run_holdfast(dir.path(), &["requests", "list", "--help"], &[]);
    assert_eq!(code, 0);
    assert!(stdout.contains("YYYY-MM-DD"), "{stdout}");
}

#[tokio::test]
async fn version_prints_the_schema_version_of_the_database_it_would_open() {
    let dir = tempfile::tempdir().unwrap();
    let (code, stdout, _) = run_holdfast(dir.path(), &["--version"], &[]);
    assert_eq!(code, 0);
    assert!(stdout.starts_with("holdfast "), "{stdout}");
    assert!(stdout.contains("not created yet"), "{stdout}");
    assert!(
        !dir.path().join("holdfast.db").exists(),
        "--version creates nothing"
    );
    // Once a server has created it, its schema version.
    let mock = start_mock(MockConfig::default()).await;
    let toml = format!(
        "[[backends]]\nname = \"mock\"\nkind = \"openai\"\nbase_url = \"{}\"\n",
        mock.base_url()
    );
    let node = Process::serve(dir.path(), &toml, free_addr()).await;
    drop(node);
    let (code, stdout, _) = run_holdfast(dir.path(), &["--version"], &[]);
    assert_eq!(code, 0);
    let line = stdout.lines().nth(1).unwrap_or_default();
    assert!(
        line.contains("sqlite://holdfast.db: schema version"),
        "{stdout}"
    );
    let (db, binary) = line
        .split_once("schema version ")
        .and_then(|(_, rest)| rest.split_once(" (this binary's: "))
        .map(|(db, rest)| (db.to_string(), rest.trim_end_matches(')').to_string()))
        .unwrap_or_else(|| panic!("{stdout}"));
    assert_eq!(
        db, binary,
        "a fresh database is at the binary's schema: {stdout}"
    );
}

/// `--version` makes the checks `serve` makes and says what `serve` would refuse, so an upgrade
/// can try the new binary against the configuration before the old one stops (CLI-1, decision
/// 104); it still exits 0 and creates nothing.
#[tokio::test]
async fn version_says_whether_serve_would_refuse_the_configuration_cli1() {
    let dir = tempfile::tempdir().unwrap();
    let backend =
        "[[backends]]\nname = \"mock\"\nkind = \"openai\"\nbase_url = \"http://127.0.0.1:9/v1\"\n";
    std::fs::write(dir.path().join("ok.toml"), backend).unwrap();
    std::fs::write(
        dir.path().join("refused.toml"),
        format!("cors_allow_origins = [\"https://app.example/\"]\n{backend}"),
    )
    .unwrap();
    let (code, stdout, _) = run_holdfast(dir.path(), &["--version", "--config", "ok.toml"], &[]);
    assert_eq!(code, 0);
    assert!(
        stdout
            .lines()
            .any(|l| l == "configuration: valid for serve"),
        "{stdout}"
    );
    let (code, stdout, _) =
        run_holdfast(dir.path(), &["--version", "--config", "refused.toml"], &[]);
    assert_eq!(code, 0, "{stdout}");
    let line = stdout
        .lines()
        .find(|l| l.starts_with("configuration: "))
        .unwrap_or_else(|| panic!("{stdout}"));
    assert!(
        line.starts_with("configuration: serve would refuse it: ")
            && line.contains("cors_allow_origins"),
        "{stdout}"
    );
    assert!(
        !dir.path().join("holdfast.db").exists(),
        "--version creates nothing"
    );
}

/// CLI-1: a file `serve` cannot even read (an unknown key, a value of the wrong form, a
/// missing file) is one more configuration it would refuse. `--version` printed its version
/// line, then only the error on stderr, and exited 2, so the upgrade step that runs it against
/// the configuration (docs/operations.md) saw a failing command instead of the line saying
/// what `serve` would refuse.
#[tokio::test]
async fn version_says_serve_would_refuse_a_configuration_it_cannot_read_and_exits_0_cli1() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("typo.toml"), "lisen = \"127.0.0.1:8080\"\n").unwrap();
    std::fs::write(dir.path().join("value.toml"), "listen = \"x\"\n").unwrap();
    for (file, key) in [
        ("typo.toml", "lisen"),
        ("value.toml", "listen"),
        ("missing.toml", "missing.toml"),
    ] {
        let (code, stdout, stderr) =
            run_holdfast(dir.path(), &["--version", "--config", file], &[]);
        assert_eq!(code, 0, "{file}: {stdout}{stderr}");
        assert!(stdout.starts_with("holdfast "), "{stdout}");
        let line = stdout
            .lines()
            .find(|l| l.starts_with("configuration: "))
            .unwrap_or_else(|| panic!("{file}: {stdout}{stderr}"));
        assert!(
            line.starts_with("configuration: serve would refuse it: ") && line.contains(key),
            "{file}: {stdout}"
        );
    }
    assert!(
        !dir.path().join("holdfast.db").exists(),
        "--version creates nothing"
    );
}

/// A backend that refuses every call: one `warn` line per attempt and one line for the request,
/// each naming the request id, the request's line with its deliveries (a second submission
/// attached while it ran); plain text in a file; `log_format = "json"` one JSON object per
/// line; the provider key never appears (IN-3). Each format at `RUST_LOG=holdfast=debug` and at
/// the default level (no `RUST_LOG`), where spans below `info` are off.
#[tokio::test]
async fn a_refused_request_leaves_a_line_per_attempt_and_one_for_the_request_in1_in3() {
    let mock = start_mock(MockConfig {
        fail_first: 1_000,
        fail_status: 503,
        // Three attempts take about a second: time for a second submission to attach.
        header_delay_ms: 300,
        ..MockConfig::default()
    })
    .await;
    let secret = "sk-holdfast-test-9f3c2e";
    for (format, debug) in [
        ("text", true),
        ("json", true),
        ("text", false),
        ("json", false),
    ] {
        let level = if debug { "debug" } else { "the default level" };
        let dir = tempfile::tempdir().unwrap();
        let toml = format!(
            r#"log_format = "{format}"
[workers]
max_attempts = 3
backoff_initial_ms = 10
backoff_max_ms = 20
[[backends]]
name = "mock"
kind = "openai"
base_url = "{}"
api_key_env = "HF_TEST_PROVIDER_KEY"
"#,
            mock.base_url()
        );
        let node = if debug {
            Process::serve_logged(
                dir.path(),
                &toml,
                free_addr(),
                &[
                    ("HF_TEST_PROVIDER_KEY", secret),
                    ("RUST_LOG", "holdfast=debug"),
                ],
            )
            .await
        } else {
            Process::serve_logged_at_default_level(
                dir.path(),
                &toml,
                free_addr(),
                &[("HF_TEST_PROVIDER_KEY", secret)],
            )
            .await
        };
        let http = reqwest::Client::new();
        let url = format!("{}/v1/chat/completions", node.base);
        let body = chat_body(&format!("refused, logged as {format} at {level}"));
        let send = |http: reqwest::Client, url: String, body: String| async move {
            http.post(url)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap()
        };
        let first = tokio::spawn(send(http.clone(), url.clone(), body.clone()));
        // Once it is recorded (and still running), the same body again attaches to it.
        let started = std::time::Instant::now();
        let id = loop {
            let list = get_json(&http, &format!("{}/requests", node.base)).await;
            if let Some(id) = list["data"][0]["id"].as_str() {
                break id.to_string();
            }
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "never recorded"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        let second = send(http.clone(), url.clone(), body).await;
        // A send refused before anything is recorded leaves its own line.
        let bad = send(http.clone(), url, "{\"model\": ".into()).await;
        assert_eq!(bad.status(), 400);
        let r = first.await.unwrap();
        assert_eq!(r.status(), 502);
        assert_eq!(second.status(), 502);
        assert_eq!(header(&r, "holdfast-request-id"), id);
        assert_eq!(
            header(&second, "holdfast-request-id"),
            id,
            "the second submission attached"
        );
        // The finished line is written before the answer is sent; read the log once it holds it.
        let path = dir.path().join("holdfast.log");
        let log = wait_for_file(&path, "request finished").await;
        assert!(!log.contains('\u{1b}'), "no escape codes in a file");
        assert!(
            !log.contains(secret),
            "the provider key never appears in the log"
        );
        if !debug {
            assert!(
                !log.contains("DEBUG"),
                "{format}: the default level logs no debug line:\n{log}"
            );
        }
        let lines: Vec<&str> = log.lines().filter(|l| l.contains(&id)).collect();
        let failed: Vec<&&str> = lines
            .iter()
            .filter(|l| l.contains("attempt failed"))
            .collect();
        let finished: Vec<&&str> = lines
            .iter()
            .filter(|l| l.contains("request finished"))
            .collect();
        assert_eq!(
            failed.len(),
            3,
            "{format} at {level}: a warn line per attempt with the id:\n{log}"
        );
        assert_eq!(
            finished.len(),
            1,
            "{format} at {level}: one line for the request with the id:\n{log}"
        );
        assert!(failed.iter().all(|l| l.contains("WARN")), "{log}");
        assert!(failed[..2].iter().all(|l| l.contains("retried")), "{log}");
        assert!(failed[2].contains("for good"), "{log}");
        assert!(finished[0].contains("attempts_exhausted"), "{log}");
        for (name, value) in [
            ("attempts", "3"),
            ("deliveries", "2"),
            ("attached", "1"),
            ("replayed", "0"),
        ] {
            assert_eq!(
                log_field(finished[0], name).as_deref(),
                Some(value),
                "{format} at {level}: `{name}` on the request's line: {}",
                finished[0]
            );
        }
        // The provider's status reads the same on every line: a number, to grep or query.
        for line in failed.iter().chain(finished.iter()) {
            assert_eq!(
                log_field(line, "upstream_status").as_deref(),
                Some("503"),
                "{format} at {level}: {line}"
            );
        }
        let log = wait_for_file(&path, "request refused").await;
        let refused = log.lines().find(|l| l.contains("request refused")).unwrap();
        for (name, value) in [
            ("status", "400"),
            ("code", "invalid_json"),
            ("route", "openai.chat"),
            ("namespace", "default"),
        ] {
            assert_eq!(
                log_field(refused, name)
                    .as_deref()
                    .map(|v| v.trim_matches('"')),
                Some(value),
                "{format} at {level}: `{name}` of the refusal: {refused}"
            );
        }
        if format == "json" {
            for line in log.lines().filter(|l| !l.is_empty()) {
                let v: Value = serde_json::from_str(line)
                    .unwrap_or_else(|e| panic!("one JSON object per line ({e}): {line}"));
                assert!(v.is_object());
            }
        }
        drop(node);
    }
}

/// The value of field `name` of one log line: `fields.NAME` of a JSON line, `NAME=VALUE` of a
/// text line.
fn log_field(line: &str, name: &str) -> Option<String> {
    match serde_json::from_str::<Value>(line) {
        Ok(v) => v["fields"].get(name).map(|f| match f.as_str() {
            Some(text) => text.to_string(),
            None => f.to_string(),
        }),
        Err(_) => {
            let prefix = format!("{name}=");
            line.split_whitespace()
                .find_map(|t| t.strip_prefix(prefix.as_str()))
                .map(str::to_owned)
        }
    }
}
