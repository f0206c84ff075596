//! `holdfast requests ...` and `holdfast usage`: the request log from the command line. The
//! CLI talks to a running holdfast over HTTP (so it works against any node of a cluster) with
//! the same API a script would use (docs/api.md): a table for people, `--json` for scripts.
//!
//! Exit status: 0 when the command did what was asked (found, listed, cancelled); 1 when the
//! request was not found or the server could not be reached or refused; 2 for a usage error
//! (clap's own).

use std::io::Write;
use std::time::Duration;

use serde_json::Value;

use crate::sse::SseParser;

/// Where the server is and who asks.
#[derive(Debug, Clone)]
pub struct Client {
    /// Base URL, e.g. `http://127.0.0.1:8080`.
    pub url: String,
    /// API key (a namespace's, or an admin key), sent as a bearer token.
    pub api_key: Option<String>,
}

/// Why a command stopped early.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// A failed command: the message for stderr (its exit status is 1).
    #[error("{0}")]
    Failed(String),
    /// The reader of the output went away (`holdfast requests tail ID | head`): nothing to
    /// report, like any Unix filter.
    #[error("the output was closed")]
    OutputClosed,
}

fn fail(message: impl Into<String>) -> CliError {
    CliError::Failed(message.into())
}

/// Filters of `holdfast requests list` (the query of `GET /requests`).
#[derive(Debug, Clone, Default)]
pub struct ListArgs {
    /// (name, value) pairs, passed as they are: the server validates them.
    pub query: Vec<(String, String)>,
    /// Print the JSON answer instead of a table.
    pub json: bool,
}

impl Client {
    fn http(&self) -> Result<reqwest::Client, CliError> {
        reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .build()
            .map_err(|e| fail(format!("cannot build an HTTP client: {e}")))
    }

    /// The server did not answer: which one was asked, and how to name another.
    fn unreachable(&self, e: &reqwest::Error) -> CliError {
        fail(format!(
            "cannot reach holdfast at {}: {e} (is it running there? name its address with \
             --url or HOLDFAST_URL, or its configuration with --config)",
            self.url
        ))
    }

    fn request(
        &self,
        http: &reqwest::Client,
        method: reqwest::Method,
        path: &str,
    ) -> reqwest::RequestBuilder {
        let url = format!("{}{path}", self.url.trim_end_matches('/'));
        let req = http.request(method, url);
        match &self.api_key {
            Some(key) => req.bearer_auth(key),
            None => req,
        }
    }

    /// Sends and reads a JSON answer; an error status becomes the server's message.
    async fn json(
        &self,
        method: reqwest::Method,
        path: &str,
        query: &[(String, String)],
    ) -> Result<Value, CliError> {
        self.json_with(method, path, query, None).await
    }

    /// [`Client::json`] with a JSON request body.
    async fn json_with(
        &self,
        method: reqwest::Method,
        path: &str,
        query: &[(String, String)],
        body: Option<Value>,
    ) -> Result<Value, CliError> {
        let http = self.http()?;
        let mut request = self.request(&http, method, path).query(query);
        if let Some(body) = body {
            request = request
                .header("content-type", "application/json")
                .body(body.to_string());
        }
        let response = request.send().await.map_err(|e| self.unreachable(&e))?;
        let status = response.status();
        let bytes = response
            .bytes()
            .await
            .map_err(|e| fail(format!("holdfast's answer broke off: {e}")))?;
        if !status.is_success() {
            return Err(refused(status, &bytes));
        }
        serde_json::from_slice(&bytes)
            .map_err(|e| fail(format!("holdfast answered {status} without JSON: {e}")))
    }

    /// `holdfast requests list`.
    ///
    /// # Errors
    /// [`CliError`] when the server cannot be reached or refuses the query.
    pub async fn list(&self, args: &ListArgs, out: &mut impl Write) -> Result<(), CliError> {
        let answer = self
            .json(reqwest::Method::GET, "/requests", &args.query)
            .await?;
        if args.json {
            return print_json(out, &answer);
        }
        let rows: Vec<Vec<String>> = answer["data"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|r| {
                vec![
                    text(&r["id"]),
                    text(&r["namespace"]),
                    text(&r["status"]),
                    text(&r["route"]),
                    text(&r["model"]),
                    text(&r["attempts"]),
                    text(&r["deliveries"]["total"]),
                    text(&r["saved_calls"]),
                    usd(&r["cost_usd"]),
                    text(&r["created_at"]),
                ]
            })
            .collect();
        let head = [
            "ID",
            "NAMESPACE",
            "STATUS",
            "ROUTE",
            "MODEL",
            "ATTEMPTS",
            "DELIVERIES",
            "SAVED",
            "COST",
            "CREATED",
        ];
        print_table(out, &head, &rows)?;
        if let Some(cursor) = answer["next_cursor"].as_str() {
            writeln!(out, "more: --cursor {cursor}").map_err(io)?;
        }
        Ok(())
    }

    /// `holdfast requests show ID [--body]`.
    ///
    /// # Errors
    /// [`CliError`] when there is no such request or the server cannot be reached.
    pub async fn show(
        &self,
        id: &str,
        body: bool,
        json: bool,
        out: &mut impl Write,
    ) -> Result<(), CliError> {
        let query = if body {
            vec![("include".to_string(), "body".to_string())]
        } else {
            Vec::new()
        };
        let record = self
            .json(reqwest::Method::GET, &format!("/requests/{id}"), &query)
            .await?;
        if json {
            return print_json(out, &record);
        }
        let fields = [
            ("id", text(&record["id"])),
            ("namespace", text(&record["namespace"])),
            ("status", text(&record["status"])),
            ("route", text(&record["route"])),
            ("model", text(&record["model"])),
            ("backend", text(&record["backend"])),
            ("stream", text(&record["stream"])),
            ("attempts", text(&record["attempts"])),
            ("recoveries", text(&record["recoveries"])),
            (
                "error",
                match &record["error"] {
                    Value::Null => "-".into(),
                    e => format!("{}: {}", text(&e["type"]), text(&e["message"])),
                },
            ),
            ("created", text(&record["created_at"])),
            ("finished", text(&record["finished_at"])),
            ("tokens in/out", tokens_in_out(&record)),
            ("of which", tokens_of_which(&record)),
            ("cost", usd(&record["cost_usd"])),
            (
                "deliveries",
                format!(
                    "{} (attached {}, replayed {}; log readers {})",
                    text(&record["deliveries"]["total"]),
                    text(&record["deliveries"]["attached"]),
                    text(&record["deliveries"]["replayed"]),
                    text(&record["deliveries"]["log_reads"]),
                ),
            ),
            ("saved calls", text(&record["saved_calls"])),
            ("saved cost", usd(&record["saved_cost_usd"])),
            ("callback", callback_line(&record["callback"])),
        ];
        for (name, value) in fields {
            writeln!(out, "{name:<14} {value}").map_err(io)?;
        }
        if body {
            writeln!(out, "request:").map_err(io)?;
            let body = pretty(&record["request"]["body"]);
            writeln!(out, "{}", printable(&body, &['\n'])).map_err(io)?;
            writeln!(out, "answer:").map_err(io)?;
            // A stream's text and tool calls (decision 96); a non-stream answer as it came.
            let streamed = record["answer"]["text"]
                .as_str()
                .map(|text| record["answer_text"].as_str().unwrap_or(text));
            let answer = match streamed {
                Some(streamed) => printable(streamed, &['\n', '\t']),
                None => printable(&pretty(&record["answer"]), &['\n']),
            };
            writeln!(out, "{answer}").map_err(io)?;
        }
        Ok(())
    }

    /// `holdfast requests cancel ID`.
    ///
    /// # Errors
    /// [`CliError`] when there is no such request or the server cannot be reached.
    pub async fn cancel(&self, id: &str, json: bool, out: &mut impl Write) -> Result<(), CliError> {
        // Whether this call cancels it: a request already finished — cancelled earlier too — is
        // reported as it is.
        let before = self
            .json(reqwest::Method::GET, &format!("/requests/{id}"), &[])
            .await?;
        let finished = matches!(before["status"].as_str(), Some("succeeded" | "failed"));
        let record = self
            .json(
                reqwest::Method::POST,
                &format!("/requests/{id}/cancel"),
                &[],
            )
            .await?;
        if json {
            return print_json(out, &record);
        }
        let id = text(&record["id"]);
        if !finished && record["error"]["type"] == "cancelled" {
            writeln!(out, "{id} cancelled").map_err(io)
        } else {
            let status = text(&record["status"]);
            writeln!(out, "{id} {status} (already finished: nothing cancelled)").map_err(io)
        }
    }

    /// `holdfast usage`.
    ///
    /// # Errors
    /// [`CliError`] when the server cannot be reached or refuses the query.
    pub async fn usage(
        &self,
        query: &[(String, String)],
        json: bool,
        out: &mut impl Write,
    ) -> Result<(), CliError> {
        let answer = self.json(reqwest::Method::GET, "/usage", query).await?;
        if json {
            return print_json(out, &answer);
        }
        let row = |key: String, l: &Value| {
            vec![
                key,
                text(&l["requests"]),
                text(&l["upstream_calls"]),
                text(&l["deliveries"]),
                text(&l["saved_calls"]),
                text(&l["usage"]["input_tokens"]),
                text(&l["usage"]["output_tokens"]),
                usd(&l["cost_usd"]),
                usd(&l["saved_cost_usd"]),
            ]
        };
        let mut rows: Vec<Vec<String>> = answer["groups"]
            .as_array()
            .into_iter()
            .flatten()
            // Requests sent without a model are grouped under "": shown as `-`, as the list does.
            .map(|g| match text(&g["key"]) {
                key if key.is_empty() => row("-".into(), g),
                key => row(key, g),
            })
            .collect();
        rows.push(row("TOTAL".into(), &answer["totals"]));
        let by = text(&answer["group_by"]).to_uppercase();
        let head = [
            by.as_str(),
            "REQUESTS",
            "CALLS",
            "DELIVERIES",
            "SAVED",
            "TOKENS IN",
            "TOKENS OUT",
            "COST",
            "SAVED COST",
        ];
        print_table(out, &head, &rows)?;
        // What the sums leave out, said rather than left for the reader to notice (RD-9a).
        let unmetered = answer["totals"]["unmetered"].as_u64().unwrap_or(0);
        if unmetered > 0 {
            writeln!(
                out,
                "# {unmetered} succeeded request(s) reported no tokens, so their tokens and cost \
                 are in no column (an OpenAI stream reports them only with \
                 stream_options.include_usage; inject_stream_usage = true asks for it)"
            )
            .map_err(io)?;
        }
        let unpriced: Vec<String> = answer["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|g| g["cost_usd"].is_null() && g["usage"]["input_tokens"].as_u64() > Some(0))
            .map(|g| match text(&g["key"]) {
                key if key.is_empty() => "-".into(),
                key => key,
            })
            .collect();
        if !unpriced.is_empty() && !answer["totals"]["cost_usd"].is_null() {
            writeln!(
                out,
                "# COST adds up only what has a [[prices]] entry; none for: {}",
                unpriced.join(", ")
            )
            .map_err(io)?;
        }
        Ok(())
    }

    /// `holdfast requests tail ID [--from N]`: the request's log as it is written, one line per
    /// event on `out` (`seq event data`, or with `json` one object per line:
    /// `{"seq","event","data"}`), until its `end`; a dropped connection is resumed from the last
    /// seq seen (`Last-Event-ID`), a server restart included, for up to `patience`, each
    /// reconnect said on `notices` (stderr), so that `out` holds nothing but events.
    ///
    /// # Errors
    /// [`CliError`] when there is no such request, the server refuses the call (a 4xx: a wrong
    /// key, a bad `--from`), or it stays unreachable for longer than `patience`.
    pub async fn tail(
        &self,
        id: &str,
        from: Option<i64>,
        patience: Duration,
        json: bool,
        out: &mut impl Write,
        notices: &mut impl Write,
    ) -> Result<(), CliError> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .build()
            .map_err(|e| fail(format!("cannot build an HTTP client: {e}")))?;
        let mut position = from;
        let mut gave_up_at = tokio::time::Instant::now() + patience;
        loop {
            let mut req = self
                .request(&http, reqwest::Method::GET, &format!("/requests/{id}"))
                .header("accept", "text/event-stream");
            if let Some(p) = position {
                req = req.header("last-event-id", p.to_string());
            }
            let ended = match req.send().await {
                Ok(r) if r.status() == reqwest::StatusCode::NO_CONTENT => return Ok(()),
                Ok(r) if r.status() == reqwest::StatusCode::NOT_FOUND => {
                    return Err(fail(format!("no request {id}")));
                }
                Ok(r)
                    if r.status().is_client_error()
                        && !matches!(r.status().as_u16(), 408 | 409 | 425 | 429) =>
                {
                    // A wrong key or a bad --from: asking again cannot change the answer (a
                    // timeout, conflict or rate limit from a proxy in front may pass).
                    let status = r.status();
                    let bytes = r.bytes().await.unwrap_or_default();
                    return Err(refused(status, &bytes));
                }
                Ok(r) if !r.status().is_success() => {
                    // A server restarting answers errors for a moment: resume.
                    writeln!(notices, "# holdfast answered {}; resuming", r.status())
                        .map_err(io)?;
                    false
                }
                Ok(mut r) => {
                    gave_up_at = tokio::time::Instant::now() + patience;
                    let mut parser = SseParser::new();
                    let mut ended = false;
                    loop {
                        match r.chunk().await {
                            Ok(Some(bytes)) => {
                                let events = parser
                                    .push(&bytes)
                                    .map_err(|e| fail(format!("bad event stream: {e}")))?;
                                for event in events {
                                    let seq: Option<i64> =
                                        event.id.as_deref().and_then(|s| s.parse().ok());
                                    if seq.is_some() {
                                        position = seq;
                                    }
                                    let name = event.event.as_deref().unwrap_or("message");
                                    if json {
                                        let line = serde_json::json!({
                                            "seq": seq,
                                            "event": name,
                                            "data": event.data,
                                        });
                                        writeln!(out, "{line}").map_err(io)?;
                                    } else {
                                        writeln!(
                                            out,
                                            "{} {} {}",
                                            printable(event.id.as_deref().unwrap_or("-"), &[]),
                                            printable(name, &[]),
                                            printable(&event.data, &[])
                                        )
                                        .map_err(io)?;
                                    }
                                    ended |= name == "end";
                                }
                                out.flush().map_err(io)?;
                                if ended {
                                    break;
                                }
                            }
                            Ok(None) => break,
                            Err(e) => {
                                writeln!(notices, "# connection lost ({e}); resuming")
                                    .map_err(io)?;
                                break;
                            }
                        }
                    }
                    ended
                }
                Err(e) => {
                    writeln!(notices, "# cannot reach holdfast ({e}); retrying").map_err(io)?;
                    false
                }
            };
            if ended {
                return Ok(());
            }
            if tokio::time::Instant::now() >= gave_up_at {
                return Err(fail(format!(
                    "gave up on {id}: holdfast stayed unreachable for {patience:?}"
                )));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

/// `holdfast requests export` (EX-6): what to export and how.
#[derive(Debug, Clone, Default)]
pub struct ExportArgs {
    /// The filters (the query of `GET /requests/export`), passed as they are.
    pub query: Vec<(String, String)>,
    /// `records` or `openai-chat`.
    pub format: String,
    /// Start after this request id (an earlier export's last cursor).
    pub after: Option<String>,
    /// At most this many lines, over every resumption (EX-6).
    pub limit: Option<u64>,
    /// Draw a progress line on stderr (only when it is a terminal).
    pub progress: bool,
}

/// How many lines an export wrote and skipped.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExportSummary {
    /// Lines written.
    pub written: u64,
    /// `openai-chat`: requests skipped, by reason.
    pub skipped: std::collections::BTreeMap<String, u64>,
}

impl ExportSummary {
    /// Lines received: those written and those skipped.
    fn lines(&self) -> u64 {
        self.written + self.skipped.values().sum::<u64>()
    }
}

/// `n` and the noun, singular for one: `1 example`, `0 examples`, `3 examples`.
fn counted(n: u64, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

/// Times a cut export is resumed from its cursor before the CLI gives up.
const EXPORT_RESUMES: u32 = 5;

impl Client {
    /// `holdfast requests export` (EX-6): streams `GET /requests/export` into `out`, resuming
    /// from the last cursor when the connection breaks (EX-4), and reports on `report`.
    ///
    /// # Errors
    /// [`CliError`] when the server refuses the query, cannot be reached, or keeps breaking off.
    pub async fn export(
        &self,
        args: &ExportArgs,
        out: &mut impl Write,
        report: &mut impl Write,
    ) -> Result<ExportSummary, CliError> {
        let http = self.http()?;
        let openai_chat = args.format == "openai-chat";
        let mut summary = ExportSummary::default();
        let mut cursor = args.after.clone();
        let bar = progress_bar(args.progress);
        let mut resumes = 0;
        loop {
            let mut query = args.query.clone();
            query.push(("format".into(), args.format.clone()));
            if let Some(c) = &cursor {
                query.push(("after".into(), c.clone()));
            }
            if let Some(limit) = args.limit {
                // A resumed export asks only for what the earlier parts left of the limit.
                let left = limit.saturating_sub(summary.lines());
                if left == 0 {
                    break;
                }
                query.push(("limit".into(), left.to_string()));
            }
            let response = self
                .request(&http, reqwest::Method::GET, "/requests/export")
                .query(&query)
                .send()
                .await;
            let mut response = match response {
                Ok(r) if r.status().is_success() => r,
                Ok(r) => {
                    let status = r.status();
                    let bytes = r.bytes().await.unwrap_or_default();
                    return Err(refused(status, &bytes));
                }
                Err(e) if resumes < EXPORT_RESUMES && summary.written > 0 => {
                    resumes += 1;
                    writeln!(report, "# cannot reach holdfast ({e}); resuming").map_err(io)?;
                    tokio::time::sleep(Duration::from_millis(250)).await;
                    continue;
                }
                Err(e) => return Err(self.unreachable(&e)),
            };
            let mut pending: Vec<u8> = Vec::new();
            let broke = loop {
                match response.chunk().await {
                    Ok(Some(bytes)) => {
                        pending.extend_from_slice(&bytes);
                        // Only whole lines: a line cut by a broken connection is read again.
                        let Some(end) = pending.iter().rposition(|b| *b == b'\n') else {
                            continue;
                        };
                        let whole: Vec<u8> = pending.drain(..=end).collect();
                        for line in whole.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
                            let value: Value = serde_json::from_slice(line)
                                .map_err(|e| fail(format!("a line that is not JSON: {e}")))?;
                            write_export_line(out, line, &value, openai_chat, &mut summary)?;
                            cursor = value["cursor"].as_str().map(str::to_owned).or(cursor);
                        }
                        if let Some(bar) = &bar {
                            bar.set_position(summary.lines());
                        }
                    }
                    Ok(None) => break None,
                    Err(e) => break Some(e),
                }
            };
            match broke {
                None => break,
                Some(e) if resumes < EXPORT_RESUMES => {
                    resumes += 1;
                    writeln!(
                        report,
                        "# the export broke off ({e}); resuming after {}",
                        cursor.as_deref().unwrap_or("the start")
                    )
                    .map_err(io)?;
                }
                Some(e) => return Err(fail(format!("the export kept breaking off: {e}"))),
            }
        }
        if let Some(bar) = bar {
            bar.finish_and_clear();
        }
        out.flush().map_err(io)?;
        let what = if openai_chat { "example" } else { "record" };
        writeln!(report, "exported {}", counted(summary.written, what)).map_err(io)?;
        // An `openai-chat` file holds no cursors: the only place to continue from (EX-6).
        if let Some(cursor) = cursor
            .as_deref()
            .filter(|c| Some(*c) != args.after.as_deref())
        {
            writeln!(report, "to continue after it: --after {cursor}").map_err(io)?;
        }
        if openai_chat {
            let skipped: u64 = summary.skipped.values().sum();
            writeln!(report, "skipped {}", counted(skipped, "request")).map_err(io)?;
            for (why, n) in &summary.skipped {
                writeln!(report, "  {n}: {}", printable(why, &[])).map_err(io)?;
            }
        }
        Ok(summary)
    }
}

impl Client {
    /// `holdfast requests replay ID [--model M] [--backend B]` (EX-9): replays the request,
    /// waits up to `patience` for the replay to end, and prints both answers side by side (or
    /// `{"original", "replay"}` with `json`).
    ///
    /// # Errors
    /// [`CliError`] with the server's message when it refuses (an unknown or foreign id), when
    /// the replay does not end within `patience`, or — after printing — when it failed.
    pub async fn replay(
        &self,
        id: &str,
        asked: &[(String, String)],
        json: bool,
        patience: Duration,
        out: &mut impl Write,
    ) -> Result<(), CliError> {
        let body: serde_json::Map<String, Value> = asked
            .iter()
            .map(|(k, v)| (k.clone(), Value::String(v.clone())))
            .collect();
        let created = self
            .json_with(
                reqwest::Method::POST,
                &format!("/requests/{id}/replay"),
                &[],
                Some(Value::Object(body)),
            )
            .await?;
        let new_id = text(&created["id"]);
        let deadline = tokio::time::Instant::now() + patience;
        loop {
            let record = self
                .json(reqwest::Method::GET, &format!("/requests/{new_id}"), &[])
                .await?;
            if matches!(record["status"].as_str(), Some("succeeded" | "failed")) {
                break;
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(fail(format!(
                    "the replay {new_id} did not end within {patience:?}; follow it with \
                     `holdfast requests tail {new_id}`"
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let with_body = [("include".to_string(), "body".to_string())];
        let original = self
            .json(reqwest::Method::GET, &format!("/requests/{id}"), &with_body)
            .await?;
        let replay = self
            .json(
                reqwest::Method::GET,
                &format!("/requests/{new_id}"),
                &with_body,
            )
            .await?;
        if json {
            print_json(
                out,
                &serde_json::json!({"original": original, "replay": replay}),
            )?;
        } else {
            print_side_by_side(out, &original, &replay)?;
        }
        match replay["status"].as_str() {
            Some("succeeded") => Ok(()),
            _ => Err(fail(format!(
                "the replay {new_id} failed: {}: {}",
                text(&replay["error"]["type"]),
                text(&replay["error"]["message"])
            ))),
        }
    }
}

/// A record's input and output tokens, `IN / OUT`.
fn tokens_in_out(record: &Value) -> String {
    format!(
        "{} / {}",
        text(&record["usage"]["input_tokens"]),
        text(&record["usage"]["output_tokens"])
    )
}

/// The parts of a record's tokens that its cost prices apart (RD-9, RD-10; docs/usage.md):
/// `cache read N, cache write N (1h N), reasoning N`, each only when the provider reported it;
/// `-` when it reported none.
fn tokens_of_which(record: &Value) -> String {
    let usage = &record["usage"];
    let count = |name: &str| usage[name].as_u64();
    let mut parts = Vec::new();
    if let Some(read) = count("cached_input_tokens") {
        parts.push(format!("cache read {read}"));
    }
    if let Some(written) = count("cache_write_tokens") {
        parts.push(match count("cache_write_1h_tokens") {
            Some(hour) => format!("cache write {written} (1h {hour})"),
            None => format!("cache write {written}"),
        });
    }
    if let Some(reasoning) = count("reasoning_tokens") {
        parts.push(format!("reasoning {reasoning}"));
    }
    if parts.is_empty() {
        "-".into()
    } else {
        parts.join(", ")
    }
}

/// Column width of the side-by-side view.
const COLUMN: usize = 38;

/// Two records and their answers' texts in two columns (EX-9).
fn print_side_by_side(out: &mut impl Write, left: &Value, right: &Value) -> Result<(), CliError> {
    let facts = |r: &Value| {
        vec![
            ("id", text(&r["id"])),
            ("model", text(&r["model"])),
            ("backend", text(&r["backend"])),
            ("status", text(&r["status"])),
            ("tokens in/out", tokens_in_out(r)),
            ("cost", usd(&r["cost_usd"])),
        ]
    };
    writeln!(out, "{:<14} {:<COLUMN$} | REPLAY", "", "ORIGINAL").map_err(io)?;
    for ((name, l), (_, r)) in facts(left).into_iter().zip(facts(right)) {
        writeln!(out, "{name:<14} {l:<COLUMN$} | {r}").map_err(io)?;
    }
    writeln!(out, "{}", "-".repeat(14 + 1 + COLUMN + 3 + COLUMN)).map_err(io)?;
    let wrap = |r: &Value| {
        let answer = r["answer_text"].as_str().unwrap_or("-");
        wrapped(&printable(answer, &['\n']), COLUMN)
    };
    let (l, r) = (wrap(left), wrap(right));
    for i in 0..l.len().max(r.len()) {
        let a = l.get(i).map_or("", String::as_str);
        let b = r.get(i).map_or("", String::as_str);
        writeln!(out, "{:<14} {a:<COLUMN$} | {b}", "").map_err(io)?;
    }
    Ok(())
}

/// `text` cut into lines of at most `width` characters, at spaces where it can be.
fn wrapped(text: &str, width: usize) -> Vec<String> {
    let mut lines = Vec::new();
    for paragraph in text.split('\n') {
        let mut line = String::new();
        for word in paragraph.split(' ') {
            let mut word = word.to_string();
            while word.chars().count() > width {
                if !line.is_empty() {
                    lines.push(std::mem::take(&mut line));
                }
                let head: String = word.chars().take(width).collect();
                word = word.chars().skip(width).collect();
                lines.push(head);
            }
            let len = line.chars().count();
            if len > 0 && len + 1 + word.chars().count() > width {
                lines.push(std::mem::take(&mut line));
            }
            if !line.is_empty() {
                line.push(' ');
            }
            line.push_str(&word);
        }
        lines.push(line);
    }
    lines
}

/// Writes one export line: a record line as the server sent it, an example alone.
fn write_export_line(
    out: &mut impl Write,
    line: &[u8],
    value: &Value,
    openai_chat: bool,
    summary: &mut ExportSummary,
) -> Result<(), CliError> {
    if !openai_chat {
        out.write_all(line).map_err(io)?;
        out.write_all(b"\n").map_err(io)?;
        summary.written += 1;
        return Ok(());
    }
    if let Some(why) = value["skipped"].as_str() {
        *summary.skipped.entry(why.to_owned()).or_default() += 1;
        return Ok(());
    }
    serde_json::to_writer(&mut *out, &value["example"])
        .map_err(|e| fail(format!("cannot write the output: {e}")))?;
    out.write_all(b"\n").map_err(io)?;
    summary.written += 1;
    Ok(())
}

/// A progress line on stderr (rows, rate), only when stderr is a terminal (EX-6).
fn progress_bar(wanted: bool) -> Option<indicatif::ProgressBar> {
    if !wanted || !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        return None;
    }
    let bar =
        indicatif::ProgressBar::with_draw_target(None, indicatif::ProgressDrawTarget::stderr());
    if let Ok(style) =
        indicatif::ProgressStyle::with_template("{spinner} {pos} rows  {per_sec}  {elapsed}")
    {
        bar.set_style(style);
    }
    bar.enable_steady_tick(Duration::from_millis(200));
    Some(bar)
}

/// A refusal from holdfast (status `status`, body `body`): its message, and for a 401 where the
/// CLI's key came from.
fn refused(status: reqwest::StatusCode, body: &[u8]) -> CliError {
    let body: Value = serde_json::from_slice(body).unwrap_or_default();
    let message = printable(
        body["error"]["message"].as_str().unwrap_or("no message"),
        &[],
    );
    let hint = if status == reqwest::StatusCode::UNAUTHORIZED {
        " (the CLI sends the key given with --api-key or HOLDFAST_API_KEY, else the first admin \
         key of the --config file that names the server)"
    } else {
        ""
    };
    fail(format!("holdfast answered {status}: {message}{hint}"))
}

fn io(e: std::io::Error) -> CliError {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        return CliError::OutputClosed;
    }
    fail(format!("cannot write the output: {e}"))
}

fn print_json(out: &mut impl Write, value: &Value) -> Result<(), CliError> {
    writeln!(out, "{}", pretty(value)).map_err(io)
}

fn pretty(value: &Value) -> String {
    serde_json::to_string_pretty(value).unwrap_or_default()
}

/// A JSON value as a table cell: strings bare, `null` as `-`, control characters escaped
/// ([`printable`]).
fn text(value: &Value) -> String {
    match value {
        Value::Null => "-".into(),
        Value::String(s) => printable(s, &[]),
        other => other.to_string(),
    }
}

/// `s` with every control character (C0, DEL, C1) and bidirectional override but those in
/// `keep` written as its Rust escape (`\u{1b}`, `\r`, `\u{202e}`). What the CLI prints for
/// people comes from the log — a client's model name and prompt, a provider's answer, a webhook
/// receiver's reply — and is untrusted text, as on the web page (EX-10): printed raw, an escape
/// sequence in it would drive the operator's terminal (rewrite a line of the table, set its
/// title, write its clipboard), and an override would show a row's text in an order other than
/// its own ("Trojan Source"; the marks `rustc` refuses in literals, not the plain
/// left-to-right and right-to-left marks that right-to-left text uses).
fn printable(s: &str, keep: &[char]) -> String {
    let escaped = |c: char| {
        (c.is_control() || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}'))
            && !keep.contains(&c)
    };
    if !s.chars().any(escaped) {
        return s.to_owned();
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if escaped(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// Dollars to six significant digits, never in exponent form: a call of a cheap model costs
/// millionths of a dollar, which a fixed number of decimals would print as `$0.000000`.
fn usd(value: &Value) -> String {
    let Some(v) = value.as_f64() else {
        return "-".into();
    };
    if v == 0.0 || !v.is_finite() {
        return format!("${v}");
    }
    // Digits after the point that keep six significant ones (at most 15: below that is noise).
    let magnitude = v.abs().log10().floor();
    let decimals = (5.0 - magnitude).clamp(0.0, 15.0) as usize;
    let fixed = format!("{v:.decimals$}");
    let trimmed = if fixed.contains('.') {
        fixed.trim_end_matches('0').trim_end_matches('.')
    } else {
        &fixed
    };
    format!("${trimmed}")
}

fn print_table(out: &mut impl Write, head: &[&str], rows: &[Vec<String>]) -> Result<(), CliError> {
    let mut widths: Vec<usize> = head.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect::<Vec<_>>()
            .join("  ")
            .trim_end()
            .to_string()
    };
    writeln!(out, "{}", line(head.to_vec())).map_err(io)?;
    for row in rows {
        writeln!(out, "{}", line(row.iter().map(String::as_str).collect())).map_err(io)?;
    }
    Ok(())
}

/// The `callback` line of `requests show` (CB-6): `-` without one, else its state, tries, last
/// status or error, next try and URL.
fn callback_line(callback: &Value) -> String {
    if callback.is_null() {
        return "-".into();
    }
    let mut line = format!(
        "{} after {} tries",
        text(&callback["state"]),
        text(&callback["attempts"])
    );
    if let Some(status) = callback["last_status"].as_u64() {
        line.push_str(&format!(", last HTTP {status}"));
    }
    if let Some(error) = callback["last_error"].as_str() {
        line.push_str(&format!(" ({})", printable(error, &[])));
    }
    if let Some(next) = callback["next_try_at"].as_str() {
        line.push_str(&format!(", next try {next}"));
    }
    line.push_str(&format!(" -> {}", text(&callback["url"])));
    line
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::{printable, text, tokens_of_which, usd, wrapped};

    /// RD-9, RD-10: `requests show` says the parts of the input and output that are priced
    /// apart, as `GET /requests/{id}` and the web page do; it showed `tokens in/out` alone, so
    /// a cost made of cache reads and writes could not be read from it.
    #[test]
    fn show_says_the_cache_reads_writes_and_reasoning_within_the_tokens_rd9() {
        let record = json!({"usage": {"input_tokens": 3512, "output_tokens": 40,
            "cached_input_tokens": 500, "cache_write_tokens": 3000,
            "cache_write_1h_tokens": 2000, "reasoning_tokens": 31}});
        assert_eq!(
            tokens_of_which(&record),
            "cache read 500, cache write 3000 (1h 2000), reasoning 31"
        );
        let openai = json!({"usage": {"input_tokens": 9, "output_tokens": 8,
            "cached_input_tokens": 0, "cache_write_tokens": null, "reasoning_tokens": null}});
        assert_eq!(tokens_of_which(&openai), "cache read 0");
        assert_eq!(tokens_of_which(&json!({"usage": null})), "-");
    }

    #[test]
    fn side_by_side_text_wraps_at_spaces_and_cuts_long_words() {
        assert_eq!(wrapped("aa bb cc", 5), vec!["aa bb", "cc"]);
        assert_eq!(wrapped("abcdefgh", 3), vec!["abc", "def", "gh"]);
        assert_eq!(wrapped("a\nb", 10), vec!["a", "b"]);
    }

    /// Text from the log reaches the terminal as text: control characters (an escape
    /// sequence in a client's model name, a carriage return that would overwrite a table row)
    /// are printed as escapes, the line breaks of a multi-line answer kept.
    #[test]
    fn control_characters_from_the_log_are_printed_escaped() {
        let model = json!("x\u{1b}[31mRED\u{1b}]0;title\u{7}\r\u{9b}2Kfake");
        let cell = text(&model);
        assert_eq!(cell, r"x\u{1b}[31mRED\u{1b}]0;title\u{7}\r\u{9b}2Kfake");
        assert!(!cell.chars().any(char::is_control), "{cell:?}");
        assert_eq!(printable("a\nb\u{1b}c", &['\n']), "a\nb\\u{1b}c");
        assert_eq!(printable("plain text", &[]), "plain text");
        // A bidirectional override or isolate would reorder what the row shows; the plain
        // marks of right-to-left text stay.
        let forged = "ok\u{202e}lanif\u{202c} \u{2067}x\u{2069}";
        assert_eq!(
            printable(forged, &[]),
            r"ok\u{202e}lanif\u{202c} \u{2067}x\u{2069}"
        );
        assert_eq!(printable("שלום\u{200f}", &[]), "שלום\u{200f}");
    }

    #[test]
    fn costs_print_six_significant_digits_never_a_false_zero() {
        assert_eq!(usd(&json!(1e-7)), "$0.0000001");
        assert_eq!(usd(&json!(0.000_005_7)), "$0.0000057");
        assert_eq!(usd(&json!(0.000_017_1)), "$0.0000171");
        assert_eq!(usd(&json!(12.345_678_9)), "$12.3457");
        assert_eq!(usd(&json!(0.5)), "$0.5");
        assert_eq!(usd(&json!(1_234_567.0)), "$1234567");
        assert_eq!(usd(&json!(0.0)), "$0");
        assert_eq!(usd(&json!(null)), "-");
    }
}
