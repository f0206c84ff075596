//! A full disk under the SQLite log (issue 18): holdfast runs on a real filesystem that fills
//! up — a small tmpfs, mounted in a mount namespace of its own so nothing outside the test
//! sees it and it disappears with the process — and is then given its space back.
//!
//! While the disk is full, writes fail and the admission answers 503 `store_unavailable` with
//! `x-should-retry: true` (RS-8); reads go on (replays, records, health); the process stays up.
//! Once space returns service resumes without a restart: the refused bodies are accepted, and
//! requests caught mid-way (a stream writing its chunks, requests recorded into space SQLite
//! already held) finish (DU-1). Nothing recorded is damaged: every record and stored stream
//! reads back as before (IN-2), and after a clean stop `PRAGMA integrity_check` on the files
//! the full disk held says `ok`.
//!
//! The namespace: `unshare --mount` as root; as another user `unshare --user --map-root-user
//! --mount` (unprivileged user namespaces). Where neither works the test fails saying so.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use holdfast::mock::MockConfig;
use serde_json::Value;

use crate::helpers::*;

/// Size of the filesystem holding the database.
const DISK_BYTES: u64 = 4 * 1024 * 1024;
/// Padding of each probe body: a write the full disk cannot take.
const PROBE_PAD: usize = 64 * 1024;
/// Most probes sent while waiting for the first refusal.
const MAX_PROBES: usize = 200;
/// Probes that must be refused while the disk stays full.
const REFUSALS: usize = 5;

/// holdfast on a small disk: a shell in a mount namespace of its own mounts the tmpfs, runs
/// holdfast as its child, and when holdfast has exited keeps the namespace (and so the
/// filesystem and the database on it) until its stdin closes, so the test can still read the
/// files. Dropped: both processes killed.
struct DiskNode {
    /// The shell: its mount namespace holds the tmpfs.
    shell: Child,
    /// holdfast's pid (the shell's child).
    pid: i32,
    base: String,
    dir: PathBuf,
    /// Where the tmpfs is mounted (as this test sees the path; see [`DiskNode::on_disk`]).
    disk: PathBuf,
}

impl DiskNode {
    /// Starts holdfast in `dir` with its SQLite database on a `DISK_BYTES` tmpfs at
    /// `dir/disk`, `mock_base` as its backend and leases of `lease_secs`, and waits for
    /// `/healthz`.
    async fn start(dir: &Path, lease_secs: u64, mock_base: &str) -> DiskNode {
        let disk = dir.join("disk");
        std::fs::create_dir(&disk).expect("create the mount point");
        let db = disk.join("holdfast.db");
        // A failed write is tried again for one lease length, as these tests were written
        // for (decision 37): `write_retry_secs` below `lease_secs` counts as `lease_secs`.
        let toml = fault_test_toml(
            &format!("sqlite://{}", db.display()),
            "",
            lease_secs,
            mock_base,
        )
        .replace("[workers]\n", "[workers]\nwrite_retry_secs = 1\n");
        let config = dir.join("holdfast.toml");
        std::fs::write(&config, toml).expect("write config");
        let addr = free_addr();
        // SAFETY: geteuid has no preconditions and cannot fail.
        let root = unsafe { libc::geteuid() } == 0;
        let mut command = Command::new("unshare");
        if !root {
            command.args(["--user", "--map-root-user"]);
        }
        command
            .args(["--mount", "--propagation", "private", "sh", "-c"])
            .arg(
                r#"mount -t tmpfs -o "size=$1" tmpfs "$2" || exit 97
"$3" serve --config "$4" --listen "$5" &
echo $! > "$6.tmp" && mv "$6.tmp" "$6"
wait $!
echo $? > "$7.tmp" && mv "$7.tmp" "$7"
read -r hold"#,
            )
            .arg("sh")
            .arg(DISK_BYTES.to_string())
            .arg(&disk)
            .arg(holdfast_bin())
            .arg(&config)
            .arg(addr.to_string())
            .arg(dir.join("holdfast.pid"))
            .arg(dir.join("holdfast.exit"))
            .current_dir(dir)
            .env("RUST_LOG", "holdfast=info")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::from(
                std::fs::File::create(dir.join("holdfast.log")).expect("log"),
            ));
        let shell = command.spawn().unwrap_or_else(|e| {
            panic!("cannot run unshare(1) to mount a small filesystem for the disk-full test: {e}")
        });
        let mut node = DiskNode {
            shell,
            pid: 0,
            base: format!("http://{addr}"),
            dir: dir.to_path_buf(),
            disk,
        };
        let http = reqwest::Client::new();
        let start = Instant::now();
        loop {
            if let Ok(Some(status)) = node.shell.try_wait() {
                panic!(
                    "the disk-full test could not mount a {DISK_BYTES}-byte tmpfs in a mount \
                     namespace of its own ({status}; {}): it needs `unshare --mount` (root) or \
                     unprivileged user namespaces (`unshare --user --map-root-user --mount`). \
                     Log:\n{}",
                    if root { "running as root" } else { "not root" },
                    node.log_text()
                );
            }
            if node.pid == 0
                && let Ok(pid) = std::fs::read_to_string(dir.join("holdfast.pid"))
            {
                node.pid = pid.trim().parse().expect("holdfast pid");
            }
            if node.pid != 0
                && let Ok(r) = http.get(format!("{}/healthz", node.base)).send().await
                && r.status() == 200
            {
                return node;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "holdfast did not become healthy:\n{}",
                node.log_text()
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// File `name` on the small disk, as the processes see it (inside the mount namespace).
    fn on_disk(&self, name: &str) -> PathBuf {
        let relative = self.disk.strip_prefix("/").expect("absolute path");
        PathBuf::from(format!("/proc/{}/root", self.shell.id()))
            .join(relative)
            .join(name)
    }

    /// holdfast's exit status, once it has exited.
    fn exit_status(&self) -> Option<i32> {
        let text = std::fs::read_to_string(self.dir.join("holdfast.exit")).ok()?;
        Some(text.trim().parse().expect("exit status"))
    }

    /// Whether holdfast is running.
    fn running(&self) -> bool {
        // SAFETY: signal 0 only checks that the process exists.
        self.exit_status().is_none() && unsafe { libc::kill(self.pid, 0) } == 0
    }

    /// SIGTERM to holdfast; waits for its exit (at most 30 s) and returns its status.
    async fn sigterm(&self) -> i32 {
        // SAFETY: kill(2) on holdfast's pid, which its shell has not reaped (it writes the
        // exit status when it does, and we checked that it has not).
        assert!(self.running(), "holdfast is running");
        assert_eq!(unsafe { libc::kill(self.pid, libc::SIGTERM) }, 0);
        let start = Instant::now();
        loop {
            if let Some(status) = self.exit_status() {
                return status;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "holdfast did not exit within 30 s of SIGTERM"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(self.dir.join("holdfast.log")).unwrap_or_default()
    }

    /// Waits (30 s at most, else fails saying `otherwise`) until holdfast has logged `line`.
    async fn wait_for_log(&self, line: &str, otherwise: &str) {
        let start = Instant::now();
        while !self.log_text().contains(line) {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "{otherwise}:\n{}",
                self.log_text()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for DiskNode {
    fn drop(&mut self) {
        if self.running() {
            // SAFETY: as in `sigterm`.
            unsafe { libc::kill(self.pid, libc::SIGKILL) };
        }
        let _ = self.shell.kill();
        let _ = self.shell.wait();
    }
}

/// Writes zeros to `path` until the filesystem refuses with ENOSPC; returns the bytes written.
fn fill(path: &Path) -> u64 {
    let mut file = std::fs::File::create(path).expect("create filler");
    let block = vec![0u8; 4096];
    let mut written = 0u64;
    // Bounded: the filesystem holds DISK_BYTES.
    for _ in 0..=DISK_BYTES / 4096 {
        match file.write(&block) {
            Ok(0) => break,
            Ok(n) => written += n as u64,
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
            Err(e) => panic!("filling the disk: {e}"),
        }
    }
    let _ = file.flush();
    assert!(written < DISK_BYTES, "the filesystem never filled up");
    written
}

fn probe_body(i: usize) -> String {
    serde_json::json!({
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": format!("probe {i}")}],
        "pad": "x".repeat(PROBE_PAD),
    })
    .to_string()
}

/// Asserts that `r` is RS-8's retryable refusal: 503 `store_unavailable`, `x-should-retry:
/// true`, `retry-after-ms` at most 60 000.
fn assert_retryable_503(r: &reqwest::Response, what: &str) {
    assert_eq!(r.status(), 503, "{what}");
    assert_eq!(header(r, "holdfast-error"), "store_unavailable", "{what}");
    assert_eq!(header(r, "x-should-retry"), "true", "{what}");
    let ms: u64 = header(r, "retry-after-ms")
        .parse()
        .unwrap_or_else(|_| panic!("{what}: retry-after-ms"));
    assert!(ms <= 60_000, "{what}: retry-after-ms {ms}");
}

/// Everything `GET /requests/{id}` says that a full disk must not change.
fn settled_part(record: &Value) -> Value {
    serde_json::json!({
        "status": record["status"],
        "attempts": record["attempts"],
        "error": record["error"],
        "response": record["response"],
        "last_seq": record["last_seq"],
        "finished_at": record["finished_at"],
    })
}

/// A stored event log: (seq, event, data) of each event.
type Log = Vec<(i64, String, String)>;

/// The stored event log of request `id`, read from position 0 (RD-6).
async fn stored_log(http: &reqwest::Client, base: &str, id: &str) -> Log {
    let (_, events) = read_events(get_events(http, base, id, Some("0")).await).await;
    events
        .into_iter()
        .map(|e| {
            (
                e.id.as_deref().unwrap().parse().unwrap(),
                e.event.unwrap_or_default(),
                e.data,
            )
        })
        .collect()
}

#[tokio::test]
async fn on_a_full_disk_writes_get_retryable_503s_the_process_stays_up_nothing_stored_is_damaged_and_service_resumes_rs8_in2_du1()
 {
    let fast = MockConfig {
        chunks: 6,
        ..MockConfig::default()
    };
    let mock = start_mock(fast.clone()).await;
    let dir = tempfile::tempdir().unwrap();
    let node = DiskNode::start(dir.path(), 1, &mock.base_url()).await;
    let pid = node.pid;
    let base = node.base.clone();
    let http = reqwest::Client::new();
    let post = |body: String, respond_async: bool| {
        let mut r = http
            .post(format!("{base}/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(body);
        if respond_async {
            r = r.header("prefer", "respond-async");
        }
        r.send()
    };

    // 1. With space: a few requests, streamed and not, all answered; remember what is stored.
    let mut before: HashMap<String, (Value, Log)> = HashMap::new();
    let mut replay_body = String::new();
    for i in 0..12 {
        let body = if i % 3 == 0 {
            stream_body(&format!("before {i}"))
        } else {
            chat_body(&format!("before {i}"))
        };
        let r = post(body.clone(), false).await.unwrap();
        assert_eq!(r.status(), 200, "with space, request {i} is answered");
        let id = header(&r, "holdfast-request-id");
        let _ = r.bytes().await.unwrap();
        let record = wait_terminal(&http, &base, &id, Duration::from_secs(20)).await;
        assert_eq!(record["status"], "succeeded");
        let log = stored_log(&http, &base, &id).await;
        before.insert(id, (settled_part(&record), log));
        replay_body = body;
    }

    // A stream in progress when the disk fills: long and slow, so it is still writing when
    // its chunks stop fitting.
    mock.set_config(MockConfig {
        chunks: 1_000,
        chunk_delay_ms: 20,
        ..fast.clone()
    });
    let r = post(stream_body("caught mid-stream"), true).await.unwrap();
    assert_eq!(r.status(), 202);
    let caught = header(&r, "holdfast-request-id");
    // Wait (on the log stream itself) until it has stored a few chunks.
    wait_for_events(&http, &base, &caught, 3).await;

    // 2. Fill the disk.
    let filler = node.on_disk("filler");
    let filled = fill(&filler);
    println!("disk_full: filesystem {DISK_BYTES} bytes, filler took the remaining {filled}");

    // New bodies are probed until enough are refused. A probe may still fit in space SQLite
    // already holds — its WAL file, whose frames are written again from the start once a
    // checkpoint has copied them, also between two refusals — and then it is recorded and
    // acknowledged, and must finish once space returns.
    let mut accepted_while_full = Vec::new();
    let mut refused: Vec<usize> = Vec::new();
    let calls_before_probes = mock.calls();
    // Refusals that follow an acceptance (or come first): the one submission whose early
    // start a failing disk may cost after each commit that stored one (ID-9, decision 72).
    let mut refusals_after_a_store = 0_u64;
    let mut last_stored = true;
    for i in 0..MAX_PROBES {
        let r = post(probe_body(i), true).await.unwrap();
        if r.status() == 202 {
            accepted_while_full.push(header(&r, "holdfast-request-id"));
            last_stored = true;
            continue;
        }
        if std::mem::replace(&mut last_stored, false) {
            refusals_after_a_store += 1;
        }
        assert_retryable_503(&r, &format!("probe {i} on a full disk"));
        assert!(
            header(&r, "holdfast-request-id").is_empty(),
            "a refused probe names no request: nothing was recorded (ID-8)"
        );
        refused.push(i);
        if refused.len() == REFUSALS {
            break;
        }
    }
    assert_eq!(
        refused.len(),
        REFUSALS,
        "{MAX_PROBES} probes on a full disk and not {REFUSALS} refusals: {refused:?}"
    );
    // ID-8, ID-9: a refused call reaches no provider, except one whose commit failed first
    // after a commit that stored a submission (its attempt started before it); after that
    // failure no attempt starts before its commit until a submission is stored again. The
    // probes go one at a time; the ones accepted (into space SQLite held) made their call, and
    // the stream caught mid-way may be recovered and call once more.
    let probe_calls = mock.calls() - calls_before_probes;
    let most = accepted_while_full.len() as u64 + refusals_after_a_store + 1;
    assert!(
        probe_calls <= most,
        "{probe_calls} provider calls for {REFUSALS} refused and {} accepted probes (at most \
         {most}): refused calls reached the provider",
        accepted_while_full.len()
    );
    // Reads go on while the disk is full: health, a record, a replay from the log.
    assert!(node.running(), "the process stays up");
    let health = http.get(format!("{base}/healthz")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    let some_id = before.keys().next().unwrap().clone();
    assert_eq!(
        get_record(&http, &base, &some_id).await["status"],
        "succeeded"
    );
    let replay = post(replay_body.clone(), false).await.unwrap();
    assert_eq!(
        replay.status(),
        200,
        "a stored answer is replayed on a full disk"
    );
    assert_eq!(header(&replay, "idempotent-replayed"), "true");
    let _ = replay.bytes().await.unwrap();
    // The stream goes on writing until its chunks no longer fit either: its attempt gives up
    // (the lease will expire and the sweep re-run it, LC-8). Its log line is the signal.
    node.wait_for_log(
        "abandoning attempt: chunks cannot be stored",
        "the stream's chunk writes never failed on the full disk",
    )
    .await;
    assert!(node.running(), "the process stays up");
    let log_while_full = node.log_text();
    let page = metrics_page(&http, &base).await;
    assert!(
        metric(
            &page,
            "holdfast_attempt_writes_abandoned_total",
            "write=\"chunks\""
        ) >= 1.0,
        "the given-up chunk write is counted"
    );

    // 3. Space returns: the filler goes. Everything resumes without a restart.
    mock.set_config(fast.clone());
    std::fs::remove_file(&filler).expect("remove filler");
    for &i in &refused {
        let start = Instant::now();
        let id = loop {
            let r = post(probe_body(i), false).await.unwrap();
            if r.status() == 200 {
                let id = header(&r, "holdfast-request-id");
                let _ = r.bytes().await.unwrap();
                break id;
            }
            assert_retryable_503(&r, &format!("probe {i} as space returns"));
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "probe {i} still refused 30 s after space returned"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let record = wait_terminal(&http, &base, &id, Duration::from_secs(30)).await;
        assert_eq!(record["status"], "succeeded", "{record}");
    }
    for id in accepted_while_full.iter().chain([&caught]) {
        let record = wait_terminal(&http, &base, id, Duration::from_secs(60)).await;
        assert_eq!(
            record["status"], "succeeded",
            "a request recorded before or while the disk was full finishes once space returns: {record}"
        );
    }
    // Read from the start, the caught stream's log goes on at its reset (RD-6: the first
    // attempt was abandoned): then the whole new attempt, consecutive, to its end.
    let caught_record = get_record(&http, &base, &caught).await;
    let caught_log = stored_log(&http, &base, &caught).await;
    let seqs: Vec<i64> = caught_log.iter().map(|(s, _, _)| *s).collect();
    assert!(
        seqs.windows(2).all(|w| w[1] == w[0] + 1),
        "the caught stream's log has consecutive seqs: {seqs:?}"
    );
    assert_eq!(caught_log[0].1, "reset", "{caught_log:?}");
    assert!(
        seqs[0] > 3,
        "the three chunks seen before the disk filled stay stored"
    );
    assert_eq!(caught_log.last().unwrap().1, "end");
    let recoveries = caught_record["recoveries"].as_u64().unwrap();
    assert!(
        recoveries >= 1,
        "the abandoned attempt was recovered by the sweep once space returned (LC-4): {caught_record}"
    );
    assert!(node.running(), "the process stayed up");
    assert_eq!(node.pid, pid, "no restart");

    // 4. Nothing recorded is damaged: every record reads back as before, then (after a clean
    // stop) SQLite's own check of the files the full disk held.
    for (id, (settled, log)) in &before {
        let record = get_record(&http, &base, id).await;
        assert_eq!(&settled_part(&record), settled, "{id} unchanged");
        assert_eq!(
            &stored_log(&http, &base, id).await,
            log,
            "{id}'s log unchanged"
        );
    }
    let all = every_record(&http, &base).await;
    for record in &all {
        let id = record["id"].as_str().unwrap();
        let r = http
            .get(format!("{base}/requests/{id}"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{id} reads back");
        let record: Value = r.json().await.unwrap();
        assert_eq!(record["status"], "succeeded", "{record}");
    }
    assert_eq!(node.sigterm().await, 0, "holdfast exits cleanly on SIGTERM");
    let copy = dir.path().join("copy");
    std::fs::create_dir(&copy).unwrap();
    for suffix in ["", "-wal", "-shm"] {
        let name = format!("holdfast.db{suffix}");
        let from = node.on_disk(&name);
        if from.exists() {
            std::fs::copy(&from, copy.join(&name)).expect("copy the database out");
        }
    }
    let conn = rusqlite::Connection::open(copy.join("holdfast.db")).expect("open the copy");
    let check: Vec<String> = conn
        .prepare("PRAGMA integrity_check")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(check, vec!["ok".to_string()], "PRAGMA integrity_check");
    let rows: i64 = conn
        .query_row("SELECT count(*) FROM requests", [], |r| r.get(0))
        .unwrap();
    assert_eq!(rows, all.len() as i64, "every row was listed and read back");
    // The caught stream's chunks, as stored: seqs 1.. without a gap, the first attempt's
    // chunks, one reset, the second attempt's; the end's seq is the row's `last_seq`, right
    // after them (no row of its own, decision 134). A row holds `count` chunks of one attempt
    // from its seq on (decision 123).
    let chunk_rows: Vec<(i64, i64, i64, String)> = conn
        .prepare("SELECT seq, count, attempt, kind FROM chunks WHERE request_id = ?1 ORDER BY seq")
        .unwrap()
        .query_map([&caught], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))
        })
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let chunks: Vec<(i64, i64, String)> = chunk_rows
        .iter()
        .flat_map(|(seq, count, attempt, kind)| {
            (*seq..seq + count).map(move |seq| (seq, *attempt, kind.clone()))
        })
        .collect();
    let reset_at = caught_log[0].0;
    for (n, (seq, attempt, kind)) in chunks.iter().enumerate() {
        assert_eq!(
            *seq,
            n as i64 + 1,
            "stored seqs are 1.. without a gap: {chunks:?}"
        );
        let expected = match seq.cmp(&reset_at) {
            std::cmp::Ordering::Less => (1, "data"),
            std::cmp::Ordering::Equal => (2, "reset"),
            std::cmp::Ordering::Greater => (2, "data"),
        };
        assert_eq!(
            (*attempt, kind.as_str()),
            expected,
            "chunk {seq}: {chunks:?}"
        );
    }
    let (status, last_seq): (String, i64) = conn
        .query_row(
            "SELECT status, last_seq FROM requests WHERE id = ?1",
            [&caught],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!(
        (status.as_str(), last_seq),
        ("succeeded", chunks.len() as i64 + 1),
        "the end's seq follows the stored chunks: {chunks:?}"
    );
    drop(conn);
    let refusals = log_while_full.matches("store unavailable").count();
    let failed_commits = log_while_full.matches("group commit failed").count();
    println!(
        "disk_full: {} probes accepted into space SQLite already held, {REFUSALS} \
         refused with 503; while full: {failed_commits} failed commits, {refusals} \
         503s logged; the stream caught mid-way: {} chunks before its attempt gave up, \
         attempts={} recoveries={recoveries}; {rows} requests stored, \
         integrity_check ok",
        accepted_while_full.len(),
        reset_at - 1,
        caught_record["attempts"],
    );
    drop(node);
    mock.shutdown().await;
}

/// A write that fails on a full disk is tried again for one lease length (decision 37). Here
/// the lease is a minute and space returns within it: the stream caught mid-way goes on in the
/// same attempt where it stopped (no reset, no recovery), the whole answer that arrived while
/// the disk was full is recorded by the attempt that received it, and the provider is called
/// once for each (DU-1, LC-3). With a 150 ms window in place of the lease length (what the
/// earlier three tries gave) it fails: the stream's attempt gives up, and the request waits
/// for its lease to expire and a second provider call.
#[tokio::test]
async fn writes_of_answers_caught_by_a_full_disk_are_tried_again_and_stored_once_space_returns_du1_lc3()
 {
    let mock = start_mock(MockConfig {
        chunks: 1_000,
        chunk_delay_ms: 20,
        ..MockConfig::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let node = DiskNode::start(dir.path(), 60, &mock.base_url()).await;
    let base = node.base.clone();
    let http = reqwest::Client::new();

    // A long, slow stream, seen storing its first events.
    let stream = submit_async(&http, &base, stream_body("a stream the disk catches")).await;
    wait_for_events(&http, &base, &stream, 3).await;
    // A whole answer of 1 MiB, held back by the provider until after the disk is full.
    mock.set_config(MockConfig {
        header_delay_ms: 1_500,
        oversized_bytes: Some(1024 * 1024),
        ..mock.config()
    });
    let answer_body = chat_body("an answer that arrives on a full disk");
    let answer = submit_async(&http, &base, answer_body.clone()).await;

    let filler = node.on_disk("filler");
    fill(&filler);
    assert_eq!(
        get_record(&http, &base, &answer).await["status"],
        "running",
        "the disk filled while the provider held the answer back (the mock's 1.5 s)"
    );
    node.wait_for_log(
        "chunk commit failed; retrying",
        "the stream's chunk writes never failed on the full disk",
    )
    .await;
    node.wait_for_log(
        "could not record the outcome; retrying",
        "the answer's outcome write never failed on the full disk",
    )
    .await;

    // Space returns well within the lease: both attempts store what they hold.
    std::fs::remove_file(&filler).expect("remove filler");
    for id in [&stream, &answer] {
        let record = wait_terminal(&http, &base, id, Duration::from_secs(60)).await;
        assert_eq!(record["status"], "succeeded", "{record}");
        assert_eq!(
            (record["attempts"].as_u64(), record["recoveries"].as_u64()),
            (Some(1), Some(0)),
            "the attempt that held the answer stored it: {record}"
        );
    }
    let log = stored_log(&http, &base, &stream).await;
    assert!(
        log.iter()
            .enumerate()
            .all(|(n, (seq, event, _))| *seq == n as i64 + 1 && event != "reset"),
        "the stream's log is one attempt's, 1.. without a gap or a reset: {:?}",
        log.iter()
            .map(|(seq, event, _)| (seq, event))
            .collect::<Vec<_>>()
    );
    assert_eq!(log.last().unwrap().1, "end");
    let pieces = log
        .iter()
        .filter(|(_, _, data)| data.contains(r#""delta":{"content":"#))
        .count();
    assert_eq!(pieces, 1_000, "every content event is stored, once");
    let replay = http
        .post(format!("{base}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(answer_body)
        .send()
        .await
        .unwrap();
    assert_eq!(replay.status(), 200);
    assert_eq!(header(&replay, "idempotent-replayed"), "true");
    let replayed = replay.bytes().await.unwrap();
    assert!(
        replayed.len() > 1024 * 1024,
        "the whole answer was recorded: {} bytes",
        replayed.len()
    );
    assert_eq!(
        mock.calls(),
        2,
        "the provider was called once for each request: {:?}",
        mock.recorded()
            .iter()
            .map(|c| &c.body["messages"])
            .collect::<Vec<_>>()
    );
    // What the operator sees: writes tried again, none given up (api.md, `/metrics`).
    let page = metrics_page(&http, &base).await;
    for write in ["chunks", "outcome"] {
        let label = format!("write={write:?}");
        let retries = metric(&page, "holdfast_attempt_write_retries_total", &label);
        assert!(retries >= 1.0, "{write} writes were tried again: {retries}");
        let abandoned = metric(&page, "holdfast_attempt_writes_abandoned_total", &label);
        assert_eq!(abandoned, 0.0, "no {write} write was given up");
    }
    assert!(node.running(), "the process stayed up");
}
