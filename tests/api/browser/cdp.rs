//! A small driver for headless Chromium over the DevTools protocol, on a pipe
//! (`--remote-debugging-pipe`: the browser reads commands on its fd 3 and writes answers and
//! events on its fd 4, each message one JSON object followed by a NUL byte). No WebSocket, no
//! extra crate: the tests open a page, evaluate JavaScript in it, wait for conditions and take
//! screenshots.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::sync::oneshot;

use super::{CHROMIUM, require_chromium};

type Waiters = Arc<Mutex<HashMap<u64, oneshot::Sender<Value>>>>;

/// A headless Chromium driven over the DevTools pipe. Killed on drop.
pub struct Browser {
    child: Child,
    commands: Mutex<File>,
    waiters: Waiters,
    /// Every event the browser sent (console messages, exceptions, log entries), in order.
    events: Arc<Mutex<Vec<Value>>>,
    next_id: AtomicU64,
    _profile: tempfile::TempDir,
}

/// One tab of a [`Browser`].
pub struct Page<'a> {
    browser: &'a Browser,
    session: String,
}

fn pipe() -> (OwnedFd, OwnedFd) {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two new descriptors into `fds`, which we then own.
    let rc = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
    assert_eq!(rc, 0, "pipe2: {}", std::io::Error::last_os_error());
    // SAFETY: both descriptors were just created and are owned by nobody else.
    unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
}

impl Browser {
    /// Starts Debian's Chromium headless with a fresh profile (fails the test when it is not
    /// installed, naming the fix).
    pub fn launch() -> Browser {
        require_chromium();
        let profile = tempfile::tempdir().unwrap();
        let (browser_reads, we_write) = pipe();
        let (we_read, browser_writes) = pipe();
        let (r, w) = (browser_reads.as_raw_fd(), browser_writes.as_raw_fd());
        let mut command = Command::new(CHROMIUM);
        command
            .args([
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--disable-quic",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--disable-extensions",
                "--hide-scrollbars",
                "--remote-debugging-pipe",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: only async-signal-safe calls (fcntl, dup2) between fork and exec. Both ends are
        // first copied above fd 10 so that placing them on 3 and 4 cannot overwrite either;
        // dup2 clears close-on-exec on the copies the browser gets.
        unsafe {
            command.pre_exec(move || {
                let r2 = libc::fcntl(r, libc::F_DUPFD, 10);
                let w2 = libc::fcntl(w, libc::F_DUPFD, 10);
                if r2 < 0 || w2 < 0 || libc::dup2(r2, 3) < 0 || libc::dup2(w2, 4) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command.spawn().expect("start chromium");
        drop(browser_reads);
        drop(browser_writes);

        let waiters: Waiters = Arc::default();
        let events: Arc<Mutex<Vec<Value>>> = Arc::default();
        let (w_waiters, w_events) = (Arc::clone(&waiters), Arc::clone(&events));
        std::thread::spawn(move || {
            let mut reader = BufReader::new(File::from(we_read));
            let mut message = Vec::new();
            loop {
                message.clear();
                match reader.read_until(0, &mut message) {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
                if message.last() == Some(&0) {
                    message.pop();
                }
                let Ok(value) = serde_json::from_slice::<Value>(&message) else {
                    continue;
                };
                match value["id"].as_u64() {
                    Some(id) => {
                        if let Some(tx) = w_waiters.lock().unwrap().remove(&id) {
                            let _ = tx.send(value);
                        }
                    }
                    None => w_events.lock().unwrap().push(value),
                }
            }
        });
        Browser {
            child,
            commands: Mutex::new(File::from(we_write)),
            waiters,
            events,
            next_id: AtomicU64::new(1),
            _profile: profile,
        }
    }

    /// Sends one command (to a page when `session` is set) and returns its `result`; panics
    /// with the browser's error.
    async fn call(&self, session: Option<&str>, method: &str, params: Value) -> Value {
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        let mut message = json!({"id": id, "method": method, "params": params});
        if let Some(session) = session {
            message["sessionId"] = json!(session);
        }
        let (tx, rx) = oneshot::channel();
        self.waiters.lock().unwrap().insert(id, tx);
        {
            let mut bytes = serde_json::to_vec(&message).unwrap();
            bytes.push(0);
            let mut pipe = self.commands.lock().unwrap();
            pipe.write_all(&bytes).expect("write to chromium");
            pipe.flush().unwrap();
        }
        let answer = tokio::time::timeout(Duration::from_secs(30), rx)
            .await
            .unwrap_or_else(|_| panic!("chromium did not answer {method} within 30 s"))
            .unwrap_or_else(|_| panic!("chromium went away during {method}"));
        assert!(
            answer.get("error").is_none(),
            "{method} failed: {}",
            answer["error"]
        );
        answer["result"].clone()
    }

    /// A new tab of `width` x `height` CSS pixels, with its runtime, page and log events on.
    pub async fn new_page(&self, width: u32, height: u32) -> Page<'_> {
        let target = self
            .call(None, "Target.createTarget", json!({"url": "about:blank"}))
            .await;
        let attached = self
            .call(
                None,
                "Target.attachToTarget",
                json!({"targetId": target["targetId"], "flatten": true}),
            )
            .await;
        let page = Page {
            browser: self,
            session: attached["sessionId"].as_str().unwrap().to_string(),
        };
        for domain in ["Page.enable", "Runtime.enable", "Log.enable"] {
            page.call(domain, json!({})).await;
        }
        page.resize(width, height).await;
        page
    }

    /// Every URL a page with [`Page::record_network`] on asked for so far, in order (the
    /// DevTools `Network.requestWillBeSent` events).
    pub fn requested_urls(&self) -> Vec<String> {
        let events = self.events.lock().unwrap();
        events
            .iter()
            .filter(|e| e["method"] == "Network.requestWillBeSent")
            .filter_map(|e| e["params"]["request"]["url"].as_str().map(str::to_string))
            .collect()
    }

    /// Uncaught exceptions and console errors so far, and Content-Security-Policy violations
    /// (which Chromium reports as log entries and console errors), as readable lines.
    pub fn errors(&self) -> Vec<String> {
        let events = self.events.lock().unwrap();
        let mut out = Vec::new();
        for e in events.iter() {
            let params = &e["params"];
            match e["method"].as_str() {
                Some("Runtime.exceptionThrown") => {
                    out.push(format!("exception: {}", params["exceptionDetails"]));
                }
                Some("Runtime.consoleAPICalled") if params["type"] == "error" => {
                    out.push(format!("console.error: {}", params["args"]));
                }
                Some("Log.entryAdded") if params["entry"]["level"] == "error" => {
                    let entry = &params["entry"];
                    out.push(format!("log: {} ({})", entry["text"], entry["url"]));
                }
                _ => {}
            }
        }
        out
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Page<'_> {
    async fn call(&self, method: &str, params: Value) -> Value {
        self.browser.call(Some(&self.session), method, params).await
    }

    /// Sets the viewport to `width` x `height` CSS pixels (one device pixel each).
    pub async fn resize(&self, width: u32, height: u32) {
        self.call(
            "Emulation.setDeviceMetricsOverride",
            json!({"width": width, "height": height, "deviceScaleFactor": 1, "mobile": false}),
        )
        .await;
    }

    /// Records every request the page makes from now on ([`Browser::requested_urls`]).
    pub async fn record_network(&self) {
        self.call("Network.enable", json!({})).await;
    }

    /// Navigates to `url` and waits until its document has loaded.
    pub async fn goto(&self, url: &str) {
        self.call("Page.navigate", json!({"url": url})).await;
        self.wait_for(
            &format!(
                "document.readyState === 'complete' && location.href.startsWith({})",
                json!(url)
            ),
            &format!("{url} to load"),
            Duration::from_secs(20),
        )
        .await;
    }

    /// Evaluates `expression` in the page (awaiting a promise) and returns its value as JSON;
    /// panics when it throws.
    pub async fn eval(&self, expression: &str) -> Value {
        let result = self
            .call(
                "Runtime.evaluate",
                json!({"expression": expression, "returnByValue": true, "awaitPromise": true}),
            )
            .await;
        assert!(
            result.get("exceptionDetails").is_none(),
            "{expression} threw: {}",
            result["exceptionDetails"]
        );
        result["result"]["value"].clone()
    }

    /// Evaluates `expression` every 100 ms until it is truthy, and returns that value; panics
    /// after `limit`, naming `what` and the last value.
    pub async fn wait_for(&self, expression: &str, what: &str, limit: Duration) -> Value {
        let start = Instant::now();
        loop {
            let value = self.eval(expression).await;
            let truthy = match &value {
                Value::Null | Value::Bool(false) => false,
                Value::Number(n) => n.as_f64() != Some(0.0),
                Value::String(s) => !s.is_empty(),
                _ => true,
            };
            if truthy {
                return value;
            }
            assert!(
                start.elapsed() < limit,
                "timed out after {limit:?} waiting for {what}: {expression} is {value}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A PNG of the viewport, written to `path`.
    pub async fn screenshot(&self, path: &Path) {
        let shot = self
            .call("Page.captureScreenshot", json!({"format": "png"}))
            .await;
        let png = base64_decode(shot["data"].as_str().expect("screenshot data"));
        assert!(png.starts_with(b"\x89PNG"), "a PNG");
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, png).unwrap();
    }
}

/// Standard base64 (with padding), as the DevTools protocol sends binary data.
fn base64_decode(text: &str) -> Vec<u8> {
    let value = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {c}"),
        }
    };
    let bytes: Vec<u8> = text.bytes().filter(|c| *c != b'=').collect();
    let mut out = Vec::with_capacity(bytes.len() * 3 / 4);
    for group in bytes.chunks(4) {
        let mut n = 0u32;
        for (i, c) in group.iter().enumerate() {
            n |= value(*c) << (18 - 6 * i);
        }
        let full = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&full[..group.len() - 1]);
    }
    out
}
