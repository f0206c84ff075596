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
        let http = self.http()?;
        let response = self
            .request(&http, method, path)
            .query(query)
            .send()
            .await
            .map_err(|e| fail(format!("cannot reach holdfast at {}: {e}", self.url)))?;
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
            (
                "tokens in/out",
                format!(
                    "{} / {}",
                    text(&record["usage"]["input_tokens"]),
                    text(&record["usage"]["output_tokens"])
                ),
            ),
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
            writeln!(out, "{}", pretty(&record["request"]["body"])).map_err(io)?;
            writeln!(out, "answer:").map_err(io)?;
            match record["answer"]["text"].as_str() {
                Some(streamed) => writeln!(out, "{streamed}").map_err(io)?,
                None => writeln!(out, "{}", pretty(&record["answer"])).map_err(io)?,
            }
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
        print_table(out, &head, &rows)
    }

    /// `holdfast requests tail ID [--from N]`: the request's log as it is written, one line per
    /// event (`seq event data`), until its `end`; a dropped connection is resumed from the last
    /// seq seen (`Last-Event-ID`), a server restart included, for up to `patience`.
    ///
    /// # Errors
    /// [`CliError`] when there is no such request, the server refuses the call (a 4xx: a wrong
    /// key, a bad `--from`), or it stays unreachable for longer than `patience`.
    pub async fn tail(
        &self,
        id: &str,
        from: Option<i64>,
        patience: Duration,
        out: &mut impl Write,
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
                    writeln!(out, "# holdfast answered {}; resuming", r.status()).map_err(io)?;
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
                                    if let Some(seq) =
                                        event.id.as_deref().and_then(|s| s.parse().ok())
                                    {
                                        position = Some(seq);
                                    }
                                    let name = event.event.as_deref().unwrap_or("message");
                                    writeln!(
                                        out,
                                        "{} {name} {}",
                                        event.id.as_deref().unwrap_or("-"),
                                        event.data
                                    )
                                    .map_err(io)?;
                                    ended |= name == "end";
                                }
                                out.flush().map_err(io)?;
                                if ended {
                                    break;
                                }
                            }
                            Ok(None) => break,
                            Err(e) => {
                                writeln!(out, "# connection lost ({e}); resuming").map_err(io)?;
                                break;
                            }
                        }
                    }
                    ended
                }
                Err(e) => {
                    writeln!(out, "# cannot reach holdfast ({e}); retrying").map_err(io)?;
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

/// A refusal from holdfast (status `status`, body `body`): its message, and for a 401 where the
/// CLI's key came from.
fn refused(status: reqwest::StatusCode, body: &[u8]) -> CliError {
    let body: Value = serde_json::from_slice(body).unwrap_or_default();
    let message = body["error"]["message"].as_str().unwrap_or("no message");
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

/// A JSON value as a table cell: strings bare, `null` as `-`.
fn text(value: &Value) -> String {
    match value {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
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
        line.push_str(&format!(" ({error})"));
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

    use super::usd;

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
