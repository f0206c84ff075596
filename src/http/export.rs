//! `GET /requests/export`: the log as NDJSON, oldest first, one line per request, paged from
//! the store by a keyset cursor and streamed page by page (EX-1..EX-5, decision 62).

use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde_json::{Value, json};
use uuid::Uuid;

use super::AppState;
use super::errors::ApiError;
use super::requests::{RecordView, bad_parameter, body_json, list_filter};
use crate::provider::Provider;
use crate::store::{ListFilter, RequestRecord, Status, StoreError};

/// Most requests read from the store per page (decision 62).
const PAGE: i64 = 200;

/// Requests in the first page, before the width of the log's lines is known (decision 80).
const FIRST_PAGE: i64 = 8;

/// What a page's lines should come to: each page's records, bodies and lines are in memory at
/// once, so a page of wide lines (long prompts, up to `max_body_bytes` each) holds fewer
/// requests (decision 80).
const PAGE_BYTES: usize = 8 << 20;

/// How many requests the page after one whose widest line was `widest` bytes reads: as many
/// such lines as fit in [`PAGE_BYTES`], at least one, at most [`PAGE`].
fn page_len_after(widest: usize) -> i64 {
    i64::try_from(PAGE_BYTES / widest.max(1))
        .unwrap_or(PAGE)
        .clamp(1, PAGE)
}

/// The export's own parameters beside RD-7's filters, named with them by its unknown-parameter
/// error (EX-1): its paging and format; not the list's `cursor`, which it refuses.
const EXPORT_PARAMETERS: [&str; 3] = ["after", "limit", "format"];

/// What each line holds (EX-2, EX-5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Records,
    OpenaiChat,
}

/// `GET /requests/export` (EX-1): RD-7's filters plus `after`, `limit` and `format`.
pub(super) async fn export(
    State(state): State<AppState>,
    Query(query): Query<Vec<(String, String)>>,
    headers: HeaderMap,
) -> Response {
    let shape = Provider::Openai;
    let caller = match super::caller(&state.config, &headers, shape) {
        Ok(caller) => caller,
        Err(e) => return e.into_response(),
    };
    let (filter, format, limit) = match parse(&caller, query) {
        Ok(parsed) => parsed,
        Err(e) => return e.into_response(),
    };
    // The first page before the answer's head: a store that cannot be read is a 503, not an
    // empty export.
    let first = match page(&state, &filter, format, limit).await {
        Ok(first) => first,
        Err(e) => return ApiError::store(shape, &e).into_response(),
    };
    let body = async_stream::stream! {
        let mut filter = filter;
        let mut left = limit;
        let mut next = Some(first);
        while let Some(Page { bytes, count, last, full, widest }) = next.take() {
            left = left.map(|l| l.saturating_sub(count as u64));
            yield Ok::<Bytes, std::io::Error>(bytes);
            let more = full && left != Some(0);
            if let (true, Some(last)) = (more, last) {
                filter.after = Some(last);
                filter.limit = page_len_after(widest);
                match page(&state, &filter, format, left).await {
                    Ok(p) => next = Some(p),
                    Err(e) => {
                        // The body ends without its last chunk: the client sees an error, not
                        // a short export (EX-4).
                        tracing::warn!(error = %e, "export: reading the log failed");
                        yield Err(std::io::Error::other(e.to_string()));
                    }
                }
            }
        }
    };
    let mut response = Body::from_stream(body).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/x-ndjson"),
    );
    response
}

/// The export's query: the list filter (RD-7's parameters), the format and the line limit.
fn parse(
    caller: &super::Caller,
    query: Vec<(String, String)>,
) -> Result<(ListFilter, Format, Option<u64>), ApiError> {
    let mut rest = Vec::with_capacity(query.len());
    let (mut format, mut limit, mut after) = (Format::Records, None, None);
    for (name, value) in query {
        match name.as_str() {
            "format" => {
                format = match value.as_str() {
                    "records" => Format::Records,
                    "openai-chat" => Format::OpenaiChat,
                    _ => return Err(bad_parameter("format", "must be records or openai-chat")),
                }
            }
            "limit" => {
                limit = Some(
                    value
                        .parse::<u64>()
                        .map_err(|_| bad_parameter("limit", "must be a non-negative integer"))?,
                );
            }
            "after" => {
                after = Some(
                    Uuid::parse_str(&value)
                        .map_err(|_| bad_parameter("after", "must be a request id (a cursor)"))?,
                );
            }
            "cursor" => {
                return Err(bad_parameter(
                    "cursor",
                    "an export resumes with after=<the last line's cursor>",
                ));
            }
            _ => rest.push((name, value)),
        }
    }
    let mut filter = list_filter(caller, &rest, &EXPORT_PARAMETERS)?;
    filter.oldest_first = true;
    filter.after = after;
    filter.limit = FIRST_PAGE;
    Ok((filter, format, limit))
}

/// One page of lines.
struct Page {
    bytes: Bytes,
    /// Requests in it.
    count: usize,
    /// Its last request's id: the next page's `after`.
    last: Option<Uuid>,
    /// Whether it held as many requests as it asked for: more may follow.
    full: bool,
    /// Its widest line's bytes, which size the next page.
    widest: usize,
}

/// Reads the page `filter` selects (at most `left` requests) and writes its lines.
async fn page(
    state: &AppState,
    filter: &ListFilter,
    format: Format,
    left: Option<u64>,
) -> Result<Page, StoreError> {
    let mut filter = filter.clone();
    if let Some(left) = left {
        filter.limit = filter.limit.min(i64::try_from(left).unwrap_or(i64::MAX));
    }
    let records = if filter.limit == 0 {
        Vec::new()
    } else {
        state.store.list(&filter).await?
    };
    // The page's streamed answers in one store call (decision 62).
    let streamed: Vec<(Uuid, i64)> = records
        .iter()
        .filter(|r| r.stream && r.status == Status::Succeeded)
        .map(|r| (r.id, r.reset_seq))
        .collect();
    let mut chunks = if streamed.is_empty() {
        Vec::new()
    } else {
        state.store.data_chunks_of(&streamed).await?
    }
    .into_iter();
    // Each record as a list shows it, with its callback (EX-2, CB-6): the page's in one store
    // call.
    let mut views: Vec<Value> = Vec::new();
    if format == Format::Records {
        views = records
            .iter()
            .map(|r| serde_json::to_value(RecordView::new(r, &state.config, None)))
            .map(Result::unwrap_or_default)
            .collect();
        super::callbacks::add_views(&state.store, &records, &mut views).await?;
    }
    let mut views = views.into_iter();
    let mut out = Vec::with_capacity(records.len() * 512);
    let mut widest = 0;
    for record in &records {
        let start = out.len();
        let events = if record.stream && record.status == Status::Succeeded {
            chunks.next().map(|(_, c)| c).unwrap_or_default()
        } else {
            Vec::new()
        };
        let answer = answer(record, &events);
        let line = match format {
            Format::Records => json!({
                "cursor": record.id,
                "record": views.next().unwrap_or_default(),
                "request": {
                    "headers": record.headers.iter().map(|(n, v)| json!([n, v])).collect::<Vec<_>>(),
                    "body": body_json(&record.body),
                },
                "answer": answer,
            }),
            Format::OpenaiChat => match example(record, &answer) {
                Ok(example) => json!({"cursor": record.id, "id": record.id, "example": example}),
                Err(why) => json!({"cursor": record.id, "id": record.id, "skipped": why}),
            },
        };
        if serde_json::to_writer(&mut out, &line).is_ok() {
            out.push(b'\n');
        }
        // The record as read counts too: an `openai-chat` line that skips a request is short.
        let read = record.body.len() + record.response_body.as_ref().map_or(0, Vec::len);
        widest = widest.max(read.max(out.len() - start));
    }
    Ok(Page {
        full: records.len() as i64 == filter.limit,
        bytes: Bytes::from(out),
        count: records.len(),
        last: records.last().map(|r| r.id),
        widest,
    })
}

/// EX-2: the final answer of a succeeded request in its non-stream shape; `null` otherwise.
fn answer(record: &RequestRecord, events: &[crate::store::Chunk]) -> Value {
    if record.status != Status::Succeeded {
        return Value::Null;
    }
    if !record.stream {
        // As the record shows it: a body a `Value` cannot hold is a string, not `null` (IN-2).
        return record
            .response_body
            .as_deref()
            .and_then(|b| serde_json::to_value(body_json(b)).ok())
            .unwrap_or(Value::Null);
    }
    record
        .route
        .assemble_stream(events.iter().map(|c| c.data.as_ref()))
        .unwrap_or_else(|| {
            // EX-3: a route whose events cannot be reassembled: the text, as `include=body`.
            let text: String = events
                .iter()
                .filter_map(|c| {
                    let data: Value = serde_json::from_str(&c.data).ok()?;
                    let kind = c.event.as_deref().or(data["type"].as_str());
                    record.route.text_of_event(kind, &data)
                })
                .collect();
            json!({"text": text, "events": events.len()})
        })
}

/// EX-5: the request and its answer as a fine-tuning example, or why not.
fn example(record: &RequestRecord, answer: &Value) -> Result<Value, String> {
    if record.status != Status::Succeeded {
        return Err(format!("the request {}", record.status.as_str()));
    }
    let body: Value = serde_json::from_slice(&record.body)
        .map_err(|e| format!("a request body this export cannot read: {e}"))?;
    record.route.openai_chat_example(&body, answer)
}
